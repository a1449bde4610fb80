"""experiments/paper_scale.py and benchmarks/gpu_paper_scale.sh: the synthetic claims at the
papers' own size, in one device lease.

- The device profile is the papers' size (each part's arguments, parsed by its experiment
  module's own parser) and its limits fit one 10-minute lease.
- harness.time_limit stops a run at the limit (or at a SIGTERM from outside) with its checkpoint
  saved, keeps the whole seeds that finished and starts nothing after (training faked: no
  compile, a second).
- The runner records a failed part and goes on, and stops after a SIGTERM from outside with
  what finished written.
- RESULTS.md's paper-size lines: the device named, the row's own verdict, a cut noted; "not run
  at paper size" with the reason otherwise (JSON written here).
- The script itself, at --profile tiny: every part's code end to end on this CPU, the JSON and
  the packed logs (about 70 s on an idle 2-core CPU). This is what keeps the script from
  rotting between leases.
"""

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import tarfile
import time
import types

import pytest

from experiments import claims_selective, claims_survey, harness, paper_scale, registry, render
from experiments import rows as rows_lib
from experiments import reformer_experiment as reformer
from experiments import selective_experiments as selective
from experiments import universal_experiment as universal

REPO = pathlib.Path(render.REPO)
SCRIPT = REPO / 'benchmarks' / 'gpu_paper_scale.sh'


def _args(part: paper_scale.Part) -> list[str]:
  return [str(REPO / a) if a.endswith('.py') else a for a in part.args]


# ------------------------------------------------------------------------------ the profile


def test_the_device_profile_is_the_papers_size():
  parts = {p.name: p for p in paper_scale.PROFILES['device']}
  assert tuple(parts) == paper_scale.PARTS
  # Selective attention A.1: d=3, 3 variables, 1,000 values, 128 assignments, batch 2,048,
  # >= 1,000 steps, 2 seeds, out of distribution on 2 values, dense against selective.
  a = selective.parse_args(['--part', 'va', '--out', '/o', *_args(parts['selective_va'])])
  base = selective.va_base(a, a.va_steps)
  assert (base.model.d, base.data.num_variables, base.data.num_values,
          base.data.num_assignments, base.batch_size) == (3, 3, 1000, 128, 2048)
  assert a.va_steps >= 1000 and a.seed_list == [0, 1] and a.ood_values == 2
  assert list(selective.variants(a, selective.VA_VARIANTS)) == ['dense', 'selective']
  assert base.warmup_steps == 1000 == base.total_steps  # The paper's first 1,000 steps.
  # A.2: Copy of lengths 1-24 and Parity at d=3, batch 2,048.
  a = selective.parse_args(['--part', 'synthetic', '--out', '/o',
                            *_args(parts['selective_synthetic'])])
  assert selective.synthetic_tasks(a) == ['copy', 'parity']
  copy = selective.synthetic_base(a, 'copy')
  assert (copy.model.d, copy.batch_size, copy.data.max_length) == (3, 2048, 24)
  assert selective.synthetic_task('copy', a).seq_len == 3 + 2 * 24 - 1
  # Reformer table 2: rows of 1,024 (L = 511), 127 symbols, one layer of 256 (d_ff 256), 4
  # heads; full attention and LSH-1/2/4 trained, each evaluated under all four.
  a = reformer.parse_args(['--part', 'dup', '--out', '/o', *_args(parts['reformer_dup'])])
  base = reformer.base_config('dup', a)
  assert (base.data.dup_length, base.data.num_symbols, base.model.d_model, base.model.mlp_dim,
          base.model.n_layers, base.model.n_heads) == (511, 127, 256, 256, 1, 4)
  runs, evals = reformer.dup_plan(a)
  trained = [r.name for r in runs if r.name in a.runs.split(',')]
  assert trained == ['full', 'lsh1', 'lsh2', 'lsh4']
  assert all([tag for tag, _ in evals[name]] == trained for name in trained)
  assert dict(evals['lsh1'])['full']['model.attention_options.lsh.chunk_len'] == 1024
  assert dict(evals['full'])['lsh4'] == {'model.attention_options.lsh.n_buckets': 16,
                                         'model.attention_options.lsh.chunk_len': 64,
                                         'model.attention_options.lsh.n_hashes': 4}
  # The UT paper: copy trained on up to 40 symbols, tested on up to 400; a fixed 8-layer stack
  # against the UT with 8 fixed steps and with ACT.
  a = universal.parse_args(_args(parts['universal']))
  base = universal.base_config('copy', a.steps, a.sizes)
  assert (base.data.max_length, base.data.num_symbols, base.model.d_model) == (40, 10, 128)
  assert a.sizes.extrapolate * a.sizes.copy_train == 400 and base.model.max_len >= 802
  assert sorted(r.name for r in a.run_list) == ['pre_ln_8', 'ut_act', 'ut_fixed']


def test_the_device_profile_fits_one_lease():
  parts = paper_scale.PROFILES['device']
  limits = sum(p.limit_s for p in parts)
  assert limits + paper_scale.STARTUP_S <= paper_scale.BUDGET_S == 600
  assert all(0 < p.reserve_s < p.limit_s for p in parts)
  # The script's backstop stops the run before the device tool's 600 s, after the limits.
  backstop = int(re.search(r'PAPER_SCALE_TIMEOUT_S:-(\d+)', SCRIPT.read_text()).group(1))
  assert limits < backstop < 600
  assert [p.name for p in paper_scale.PROFILES['tiny']] == list(paper_scale.PARTS)


def test_the_runners_entry_and_the_rows_name_the_parts():
  e = registry.get('paper_scale')
  assert e in registry.DEVICE and e not in registry.EXPERIMENTS + registry.PAGES
  argv = registry.argv(e, '/o', quick=True)
  assert paper_scale.parse_args(argv).profile == 'tiny' and '/o/paper_scale.json' in argv
  rows = [row for s in render.SECTIONS for row in s.rows if row.paper_size]
  assert {row.paper_size.part for row in rows} == set(paper_scale.PARTS)
  for row in rows:  # Each part stands in for the file its row reads at CPU size.
    assert paper_scale.SOURCES[row.paper_size.part] in row.sources


# ------------------------------------------------------------------------------ time limits


def _fake_training(monkeypatch, hook, step_s=0.0):
  """train.train_and_evaluate as a loop that honours SIGTERM as the real one does (the same
  _Preemption), calling hook(workdir, step) after each step; measure() a stub."""
  from training import train

  def fake(config, workdir, on_step=None, **kwargs):
    del kwargs
    with train._Preemption() as preemption:  # pylint: disable=protected-access
      for step in range(1, config.total_steps + 1):
        time.sleep(step_s)
        on_step(step)
        hook(workdir, step)
        if preemption.requested(step):
          return types.SimpleNamespace(step=step)
    return types.SimpleNamespace(step=config.total_steps)

  monkeypatch.setattr(train, 'train_and_evaluate', fake)
  monkeypatch.setattr(harness, 'measure', lambda name, config, workdir: rows_lib.row(
      name, None, {'variant': name, 'workdir': workdir}))


def _va_base():
  from configs import tiny
  return harness.base_config(tiny.get_config(), steps=10, d=1)


def test_a_time_limit_stops_a_run_and_keeps_the_whole_seeds(tmp_path, monkeypatch):
  def hook(workdir, step):
    if 'seed1' in workdir and step == 3:
      harness._LIMIT.fire()  # pylint: disable=protected-access  (the limit's timer, now)

  _fake_training(monkeypatch, hook)
  before = signal.getsignal(signal.SIGTERM)
  with harness.time_limit(60) as limit:
    rows = harness.run(['dense', 'selective'], _va_base(), [0, 1], str(tmp_path),
                       progress=False)
    assert [(r['seed'], r['run']) for r in rows] == [(0, 'dense'), (0, 'selective')]
    assert limit.expired and not limit.signalled and limit.over
    assert limit.cut == 'dense (seed 1) stopped at step 3 of 10 by the 60 s time limit'
    # Nothing starts after it, in this call or a later one.
    assert harness.run(['dense'], _va_base(), None, str(tmp_path / 'b'), progress=False) == []
    assert limit.skipped == ['dense']
  assert signal.getsignal(signal.SIGTERM) == before
  # Without a limit, a SIGTERM still stops the experiment (harness.Preempted).
  _fake_training(monkeypatch, lambda workdir, step: step == 2 and signal.raise_signal(
      signal.SIGTERM))
  with pytest.raises(harness.Preempted) as stopped:
    harness.run(['dense'], _va_base(), None, str(tmp_path / 'c'), progress=False)
  assert stopped.value.step == 2 and not isinstance(stopped.value, harness.TimeUp)


def test_the_limits_timer_and_a_sigterm_from_outside(tmp_path, monkeypatch):
  _fake_training(monkeypatch, lambda workdir, step: None, step_s=0.01)
  base = _va_base()
  base.total_steps = 3000  # 30 s unless stopped.
  start = time.monotonic()
  with harness.time_limit(2) as limit:
    rows = harness.run(['dense'], base, None, str(tmp_path / 'a'), progress=False)
  assert rows == [] and time.monotonic() - start < 20
  assert limit.expired and re.fullmatch(r'dense stopped at step \d+ of 3000 by the 2 s time '
                                        r'limit', limit.cut) or limit.skipped == ['dense']
  # A SIGTERM from outside during a run: the run stops the same way, and it is told apart.
  _fake_training(monkeypatch, lambda workdir, step: step == 2 and signal.raise_signal(
      signal.SIGTERM))
  with harness.time_limit(60) as limit:
    rows = harness.run(['dense', 'selective'], _va_base(), None, str(tmp_path / 'b'),
                       progress=False)
  assert rows == [] and limit.signalled and not limit.expired
  assert limit.cut == 'dense stopped at step 2 of 10 by SIGTERM from outside'
  # ... and between runs (it would otherwise kill the process): nothing more starts.
  _fake_training(monkeypatch, lambda workdir, step: None)
  with harness.time_limit(60) as limit:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.1)
    assert harness.run(['dense'], _va_base(), None, str(tmp_path / 'c'), progress=False) == []
  assert limit.signalled and limit.skipped == ['dense']


def test_a_failed_part_is_recorded_and_a_sigterm_stops_the_runner(tmp_path, monkeypatch):
  out = tmp_path / 'paper_scale.json'

  def run_part(name, argv, workdir):
    if name == 'selective_synthetic':
      raise RuntimeError('out of memory')
    if name == 'reformer_dup':
      os.kill(os.getpid(), signal.SIGTERM)  # The lease ends, after the part's last run.
      time.sleep(0.1)
      assert harness.run(['dense'], _va_base(), None, str(tmp_path / 'r'),
                         progress=False) == []  # Not started.
    return {'part': name}

  monkeypatch.setattr(paper_scale, 'run_part', run_part)
  (tmp_path / 'x.log').write_text('log')
  with pytest.raises(SystemExit) as stopped:
    paper_scale.main(['--profile', 'tiny', '--out', str(out), '--logs', str(tmp_path / 'x.log')])
  assert stopped.value.code == 143
  data = json.loads(out.read_text())
  assert data['profile'] == 'tiny' and data['device']['kind'] == 'cpu'
  parts = data['parts']
  assert list(parts) == ['selective_va', 'selective_synthetic', 'reformer_dup']
  assert parts['selective_va']['status'] == 'complete'
  assert parts['selective_synthetic']['status'] == 'failed'
  assert 'out of memory' in parts['selective_synthetic']['error']
  assert parts['reformer_dup']['status'] == 'stopped'
  assert parts['reformer_dup']['skipped'] == ['dense']
  with tarfile.open(tmp_path / 'paper_scale_logs.tar.gz') as tar:
    assert 'x.log' in tar.getnames()
  # Rerun: the complete part is kept, the others run; a failure fails the command.
  monkeypatch.setattr(paper_scale, 'run_part', lambda name, argv, workdir: (
      (_ for _ in ()).throw(ValueError('bad')) if name == 'universal' else {'part': name}))
  with pytest.raises(SystemExit, match='failed parts: universal'):
    paper_scale.main(['--profile', 'tiny', '--out', str(out)])
  parts = json.loads(out.read_text())['parts']
  assert [p['status'] for p in parts.values()] == ['complete', 'complete', 'complete', 'failed']
  assert parts['selective_va']['wall_s'] == data['parts']['selective_va']['wall_s']  # Kept.


# ------------------------------------------------------------------------------ RESULTS.md


def _va(sel, dense):
  entry = lambda acc: rows_lib.over_seeds(
      {i: {'v': {'accuracy': a, 'ood_accuracy': a, 'loss': 1 - a, 'ood_loss': 1 - a,
                 'first_step_99': None}} for i, a in enumerate(acc)},
      ('accuracy', 'loss', 'ood_accuracy', 'ood_loss'))['v']
  return {'settings': {'steps': 1000, 'batch_size': 2048, 'assignments': 128,
                       'num_variables': 3, 'num_values': 1000, 'ood_values': 2,
                       'test_examples': 4096, 'd': 3},
          'variants': {'selective': entry(sel), 'dense': entry(dense)}}


def _paper_scale(**parts):
  return {'profile': 'device', 'device': {'kind': 'NVIDIA H100 80GB HBM3'}, 'parts': parts}


def _render(tmp_path, data, committed=('selective_va.json', 'reformer_experiment.json')) -> str:
  """RESULTS.md from `data` as paper_scale.json and the `committed` CPU-size results."""
  folder = tmp_path / 'results'
  folder.mkdir(exist_ok=True)
  (folder / 'paper_scale.json').write_text(json.dumps(data))
  for name in committed:
    (folder / name).write_text((REPO / 'results' / name).read_text())
  return render.render([str(folder)])


def _line(text: str, claim: str) -> str:
  return next(line for line in text.splitlines() if line.startswith(f'| {claim}'))


def test_results_md_shows_the_paper_size_beside_the_cpu_size(tmp_path):
  va_row = claims_selective.SECTION.rows[0]
  ok = {'status': 'complete', 'device': 'NVIDIA H100 80GB HBM3', 'cut': '', 'skipped': [],
        'payload': _va((1.0, 1.0), (0.26, 0.3))}
  text = _render(tmp_path, _paper_scale(selective_va=ok))
  line = _line(text, va_row.claim)
  assert '**CPU size** (2 CPU cores): selective 0.722' in line
  assert '<br>**Paper size** (NVIDIA H100 80GB HBM3): selective 1.000 ± 0.000' in line
  assert '2 seeds, 1000 steps of batch 2048, d=3; 128 assignments' in line
  assert 'CPU size: **does not hold at this scale**' in line
  assert 'Paper size: **reproduces**: selective >= 99% in every seed' in line
  assert '`python -m experiments.paper_scale --parts selective_va --out OUT/paper_scale.json`' \
      in line
  # The other parts: not run at paper size, with the reason.
  dup = _line(text, claims_survey.SECTION.rows[5].claim)
  assert 'Paper size: **not run at paper size**: no device has run it' in dup
  # A part its time limit cut: the seeds that finished, and what was cut.
  cut = {**ok, 'status': 'cut', 'cut': 'selective (seed 1) stopped at step 612 of 1000 by the '
         '290 s time limit', 'payload': _va((1.0,), (0.3,))}
  line = _line(_render(tmp_path, _paper_scale(selective_va=cut)), va_row.claim)
  assert ('(NVIDIA H100 80GB HBM3; cut at its time limit: selective (seed 1) stopped at step '
          '612') in line and '1 seed, 1000 steps' in line
  # A part that lacks what a row reads, and one that failed.
  empty = {**ok, 'payload': {'settings': {}, 'variants': {}}}
  line = _line(_render(tmp_path, _paper_scale(selective_va=empty)), va_row.claim)
  assert 'Paper size: **not testable here**' in line  # The row's own criterion says so.
  line = _line(_render(tmp_path, _paper_scale(selective_va={**ok, 'payload': {}})),
               va_row.claim)
  assert 'Paper size: **not run at paper size**: the run on NVIDIA H100 80GB HBM3 lacks' in line
  failed = {'status': 'failed', 'device': 'NVIDIA H100 80GB HBM3', 'error': 'OOM'}
  line = _line(_render(tmp_path, _paper_scale(selective_va=failed)), va_row.claim)
  assert '**not run at paper size**: the part failed on NVIDIA H100 80GB HBM3 (OOM)' in line


# ------------------------------------------------------------------------------ the script


def test_the_script_runs_every_part_at_tiny_size(tmp_path):
  """benchmarks/gpu_paper_scale.sh --profile tiny: the lease's script and code path, at a tiny
  size on this CPU (no GPU: no nvidia-smi, no wheels to install). Over a minute in CI: the
  script's every part starts its own process and compiles its own programs, as on the lease."""
  out, work = tmp_path / 'out', tmp_path / 'work'
  proc = subprocess.run(['bash', str(SCRIPT), str(out), str(work), '--profile', 'tiny'],
                        cwd=REPO, capture_output=True, text=True, timeout=900,
                        env={**os.environ, 'PYTHON': sys.executable})
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert sorted(os.listdir(out)) == ['paper_scale.json', 'paper_scale.log',
                                     'paper_scale_logs.tar.gz']
  data = json.loads((out / 'paper_scale.json').read_text())
  assert data['profile'] == 'tiny' and data['device']['kind'] == 'cpu'
  assert data['machine']['backend'] == 'cpu'
  assert list(data['parts']) == list(paper_scale.PARTS)
  for name, part in data['parts'].items():
    assert part['status'] == 'complete' and part['device'] == 'cpu', (name, part)
    assert part['wall_s'] < part['limit_s'], name
  payload = data['parts']
  assert set(payload['selective_va']['payload']['variants']) == {'selective'}
  assert set(payload['selective_synthetic']['payload']['tasks']) == {'copy', 'parity'}
  evals = payload['reformer_dup']['payload']['dup']['runs']['lsh1']['evals']
  assert list(evals) == ['full', 'lsh1'] and evals['lsh1']['step'] == 2
  ut = rows_lib.evaluation(payload['universal']['payload']['copy']['ut_act'], 'eval')
  assert ut['eval_seq_len'] == 2 * 2 * 3 + 2 and 'mean_steps' in ut
  with tarfile.open(out / 'paper_scale_logs.tar.gz') as tar:
    names = tar.getnames()
  assert 'paper_scale.log' in names and not [n for n in names if 'checkpoints' in n]
  assert any(n.startswith('runs/selective/va/seed0/selective/tensorboard/') for n in names)
  assert 'paper_scale rc 0' in (out / 'paper_scale.log').read_text()
  # RESULTS.md's paper-size lines render from it (the tiny runs lack what most rows read).
  text = _render(tmp_path, data, committed=())
  assert text.count('<br>**Paper size** (cpu, tiny profile)') + text.count(
      'lacks what this row reads') >= 1
