"""experiments/txl_experiment.py and experiments/reformer_experiment.py on the harness: their
runs train as main.py trained them (the recipe plus the same overrides), analyze() turns rows
into the committed JSON, and the eval-time evaluations are main.py --mode=eval's.

The end-to-end test trains one duplication run for 2 steps and evaluates it four ways: about
30 s on an idle 2-core CPU.
"""

import json
import os

from benchmarks.common import flags
from experiments import harness, reformer_experiment, rows as rows_lib, txl_experiment

RESULTS = os.path.join(os.path.dirname(__file__), '..', '..', 'results')


def _committed(name):
  with open(os.path.join(RESULTS, name)) as f:
    payload = json.load(f)
  payload.pop('machine', None)
  return payload


def _as_main_py(recipe, overrides):
  """The config main.py trained with: the recipe and --config.KEY=VALUE flags."""
  return harness.override(harness.load_recipe(recipe),
                          [f[len('--config.'):] for f in flags(overrides)])


def _differences(a, b):
  a, b = harness.flatten(a), harness.flatten(b)
  # The harness draws no samples at evaluations (there are none while these runs train).
  return {k: (a.get(k), b.get(k)) for k in set(a) | set(b)
          if a.get(k) != b.get(k) and k != 'generate.eval_samples'}


def test_txl_runs_train_as_main_py_trained_them(tmp_path):
  text = tmp_path / 'text.txt'
  text.write_text('abc\n' * 100)
  args = txl_experiment.parse_args(['--text', str(text), '--out', str(tmp_path)])
  common = txl_experiment.common_overrides(args)
  base = harness.base_config(txl_experiment.RECIPE, steps=args.steps, overrides=common)
  for run in txl_experiment.RUNS + txl_experiment.high_lr_runs([0.02, 0.15]):
    new = harness.variant_config(base, run.overrides)
    old = _as_main_py(txl_experiment.RECIPE, {**common, **run.overrides})
    assert not _differences(old, new), run.name


def test_reformer_runs_train_as_main_py_trained_them(tmp_path):
  text = tmp_path / 'text.txt'
  text.write_text('abc\n' * 100)
  args = reformer_experiment.parse_args(['--text', str(text), '--out', str(tmp_path),
                                         '--dup_steps', '4'])
  for part, runs in reformer_experiment.RUNS.items():
    common = reformer_experiment.common_overrides(part, args)
    base = reformer_experiment.base_config(part, args)
    for run in runs:
      new = harness.variant_config(base, run.overrides)
      old = _as_main_py(reformer_experiment.RECIPES[part], {**common, **run.overrides})
      assert not _differences(old, new), (part, run.name)


def test_txl_analyze_gives_the_committed_json():
  committed = _committed('txl_experiment.json')
  rows = [rows_lib.row(name, None, {  # The rows of train_and_measure.
      'evals': entry.get('evals', {}), 'diverged': entry.get('diverged'),
      'curves': {k: entry['curves'][k] for k in ('train_loss', 'grad_norm')}})
          for name, entry in committed['runs'].items()]
  runs = txl_experiment.RUNS + txl_experiment.high_lr_runs(committed['settings']['high_lrs'])
  assert txl_experiment.analyze(rows, runs, committed['settings']) == committed
  assert 'eval_mem512' in txl_experiment.table(committed)


def test_txl_adds_its_evaluations_to_the_harness_rows(tmp_path, monkeypatch):
  """train_and_measure on the harness's rows (training and evaluation faked): evaluations and
  the grad-norm curve go into each row; a diverged run is not evaluated, and a later call
  reads it from its diverged.txt instead of training it again."""
  text = tmp_path / 'text.txt'
  text.write_text('abc\n' * 100)
  args = txl_experiment.parse_args(['--text', str(text), '--out', str(tmp_path)])
  base = harness.base_config(txl_experiment.RECIPE, steps=args.steps,
                             overrides=txl_experiment.common_overrides(args))
  runs = (txl_experiment.RUNS[2], txl_experiment.high_lr_runs([0.15])[0])  # txl, pre_ln_lr0.15

  def row(name, diverged=None):
    return rows_lib.row(name, None, {'variant': name, 'step': 600, 'diverged': diverged,
                                     'curves': {'train_loss': [(1, 5.0)]}})

  def train_one(name, config, workdir):
    os.makedirs(workdir)
    return row(name, 'loss is nan' if name == 'pre_ln_lr0.15' else None)

  monkeypatch.setattr(harness, 'configs', lambda runs, base: {
      r.name: (harness.variant_config(base, r.overrides), dict(r.overrides)) for r in runs})
  monkeypatch.setattr(harness, 'train_one', train_one)
  monkeypatch.setattr(harness, 'measure', lambda name, config, workdir: row(name))
  monkeypatch.setattr(harness, 'evaluate', lambda config, workdir, extra: {
      'bits_per_byte': 2.0, 'loss': 1.4, 'asked': dict(extra)})
  monkeypatch.setattr(txl_experiment, 'scalar_curve', lambda workdir, tag: [(1, 0.5)])
  txl, high = txl_experiment.train_and_measure(runs, base, str(tmp_path))
  assert rows_lib.is_row(txl) and rows_lib.is_row(high)
  assert list(txl['evals']) == ['eval_mem128', 'eval_mem512']
  assert txl['evals']['eval_mem512']['asked']['model.attention_options.txl.eval_mem_len'] == 512
  assert txl['curves'] == {'train_loss': [(1, 5.0)], 'grad_norm': [(1, 0.5)]}
  assert txl['own_keys'] == {} and high['own_keys'] == {'learning_rate': 0.15}
  assert high['diverged'] == 'error: loss is nan' and 'evals' not in high
  payload = txl_experiment.analyze([txl, high], runs, {'steps': 600})
  assert rows_lib.metric(payload['runs']['txl'], 'eval_mem512/bits_per_byte', 'value') == 2.0
  assert payload['runs']['pre_ln_lr0.15']['diverged'] == 'error: loss is nan'

  def trained_again(*args):
    raise AssertionError(f'trained again: {args[0]}')

  monkeypatch.setattr(harness, 'train_one', trained_again)
  again, = txl_experiment.train_and_measure(runs[1:], base, str(tmp_path))
  assert again['diverged'] == 'error: loss is nan' and 'evals' not in again


def test_reformer_analyze_gives_the_committed_json(tmp_path):
  committed = _committed('reformer_experiment.json')
  for part, data in committed.items():
    rows = [rows_lib.row(name, None, {
        'evals': entry['evals'],
        'curves': {k: entry['curves'][k] for k in ('train_loss', 'train_accuracy')}})
            for name, entry in data['runs'].items()]
    common = {k: v for k, v in data['settings'].items() if k not in ('steps', 'text')}
    if part == 'dup':
      common.pop('seq_len')
    assert reformer_experiment.analyze(rows, reformer_experiment.RUNS[part],
                                       common) == data['runs'], part
  args = reformer_experiment.parse_args(['--text', '/x/tinyshakespeare.txt', '--out',
                                         '/tmp/reformer_exp_long'])
  for part in ('dup', 'bytes'):
    assert reformer_experiment.settings(part, args).keys() == committed[part]['settings'].keys()


def test_reformer_sizes_are_recorded_only_where_they_differ_from_the_recipe():
  """The committed runs' overrides stay as they were; the paper's sizes (paper_scale.py) add
  theirs, and the LSH settings and full attention follow the row length."""
  args = reformer_experiment.parse_args(['--part', 'dup'])
  assert reformer_experiment.size_overrides(args) == {}
  runs, evals = reformer_experiment.dup_plan(args)
  assert runs == reformer_experiment.RUNS['dup'] and evals == reformer_experiment.EVALS
  args = reformer_experiment.parse_args([
      '--part', 'dup', '--dup_length', '511', '--num_symbols', '127', '--d_model', '256',
      '--mlp_dim', '256', '--chunk_len', '64', '--n_buckets', '16', '--hashes', '1,4'])
  assert reformer_experiment.size_overrides(args) == {
      'data.dup_length': 511, 'data.num_symbols': 127, 'model.d_model': 256,
      'model.mlp_dim': 256}
  assert reformer_experiment.settings('dup', args)['seq_len'] == 1024
  runs, evals = reformer_experiment.dup_plan(args)
  assert [r.name for r in runs] == ['dense', 'full', 'lsh1', 'lsh4']
  assert [tag for tag, _ in evals['lsh4']] == ['full', 'lsh1', 'lsh4']
  assert dict(evals['lsh1'])['full']['model.attention_options.lsh.chunk_len'] == 1024
  assert dict(runs[3].overrides)['model.attention_options.lsh.chunk_len'] == 64
  base = reformer_experiment.base_config('dup', args)
  assert (base.data.dup_length, base.model.d_model, base.model.mlp_dim) == (511, 256, 256)


def test_reformer_dup_trains_evaluates_as_main_py_and_keeps_its_run(tmp_path):
  out, path = tmp_path / 'out', tmp_path / 'reformer.json'
  other = {'runs': {'pre_ln': rows_lib.row('pre_ln', None, {'curves': {'train_loss': [[1, 5.0]]}})},
           'settings': {'text': 'x'}}
  with open(path, 'w') as f:  # The other part's results are kept.
    json.dump({'bytes': other}, f)
  # Rows of 64 (L = 31) in batches of 4: at the recipe's 256 x 32 the test took 216 s of CI
  # time, most of it in four evaluations of 16 batches each.
  argv = ['--part', 'dup', '--dup_steps', '2', '--runs', 'full', '--out', str(out),
          '--json', str(path), '--plot', str(tmp_path / 'curves.png'), '--dup_length', '31',
          '--dup_batch', '4']
  first = reformer_experiment.main(argv)
  assert list(first) == ['bytes', 'dup'] and first['bytes'] == other
  entry = first['dup']['runs']['full']
  assert list(entry['evals']) == ['full', 'lsh1', 'lsh2', 'lsh4']
  assert entry['overrides']['model.attention_options.lsh.chunk_len'] == 64  # The whole row.
  assert entry['overrides']['data.dup_length'] == 31
  # As main.py --mode=eval gives it: the recorded run, the keys asked for changed on top.
  assert 'config_overrides' not in entry['evals']['full']
  assert entry['evals']['lsh1']['config_overrides'] == {
      'model.attention_options.lsh.chunk_len': 32, 'model.attention_options.lsh.n_buckets': 8}
  lsh4 = entry['evals']['lsh4']['config_overrides']
  assert lsh4['model.attention_options.lsh.n_hashes'] == 4
  assert all(e['step'] == 2 and 0 <= e['accuracy'] <= 1 for e in entry['evals'].values())
  assert rows_lib.is_row(entry)
  assert [s for s, _ in entry['curves']['train_loss']] and (tmp_path / 'curves.png').exists()
  with open(path) as f:
    assert json.load(f)['dup']['runs']['full']['evals'] == entry['evals']
  again = reformer_experiment.main(argv)  # Kept, not trained again: the same numbers.
  assert again['dup']['runs']['full']['evals'] == entry['evals']
  assert again['dup']['runs']['full']['curves'] == entry['curves']
