"""experiments/registry.py and the runner (python -m experiments): every RESULTS.md row names
experiments that exist and write what the row reads; the runner refuses bad input before it
runs anything, runs a named experiment as `python -m MODULE ARGS` into OUT, and stops at a
failure with the log's tail."""

import importlib.util
import pathlib
import re
import json
import subprocess
import sys

import numpy as np
import pytest

from experiments import __main__ as runner
from experiments import registry, render


def test_every_row_names_experiments_that_write_its_files():
  for section in render.SECTIONS:
    for row in section.rows:
      writes = {w for e in row.experiments for w in registry.get(e).writes}
      assert set(row.sources) <= writes, (row.claim, row.sources, row.experiments)
      assert row.command.startswith('python -m experiments run ')


def test_every_experiment_is_a_module_and_read_by_a_row():
  read = {e for section in render.SECTIONS for row in section.rows for e in row.experiments}
  for e in registry.EXPERIMENTS:
    assert importlib.util.find_spec(e.module) is not None, e.module
    assert e.name in read, f'{e.name} feeds no RESULTS.md row'
    argv = registry.argv(e, '/o', '/t.txt', quick=True)
    assert all('{' not in a for a in argv), argv
    assert any(a.startswith('/o/') for a in argv), f'{e.name} writes outside OUT'


def test_the_runner_refuses_bad_input_before_running_anything(tmp_path):
  with pytest.raises(KeyError, match="unknown experiment 'nope'"):
    runner.run(['nope'], str(tmp_path))
  with pytest.raises(ValueError, match='needs --text'):
    runner.run(['adaptive_span', 'txl'], str(tmp_path))
  with pytest.raises(SystemExit, match='no such file'):
    runner.run(['txl'], str(tmp_path), text=str(tmp_path / 'missing.txt'))
  assert not (tmp_path / 'logs').exists()


def test_run_writes_the_experiments_file_and_a_failure_names_its_log(tmp_path, monkeypatch):
  ok = registry.Experiment('ok', 'json.tool', ('{out}/in.json', '{out}/w.json'), ('w.json',))
  bad = registry.Experiment('bad', 'json.tool', ('{out}/missing.json',), ('x.json',))
  monkeypatch.setattr(registry, 'BY_NAME', {'ok': ok, 'bad': bad})
  (tmp_path / 'in.json').write_text(json.dumps({'a': 1}))
  runner.run(['ok'], str(tmp_path))
  assert json.loads((tmp_path / 'w.json').read_text()) == {'a': 1}
  failure = r'(?s)bad failed \(exit 2\); its log: .*bad\.log.*missing\.json'  # Its tail.
  with pytest.raises(SystemExit, match=failure):
    runner.run(['bad'], str(tmp_path))


def test_a_sigterm_of_the_runner_stops_its_experiment(tmp_path, monkeypatch):
  """The runner passes a SIGTERM on to the experiment it runs (whose runs save and stop), so
  stopping the runner never leaves an experiment running on its own."""
  import os
  import signal
  import threading
  import time
  sleeper = registry.Experiment('sleeper', 'timeit', ('-n', '1', '-r', '1',
                                                      "__import__('time').sleep(120)"), ())
  monkeypatch.setattr(registry, 'BY_NAME', {'sleeper': sleeper})
  before = signal.getsignal(signal.SIGTERM)
  threading.Timer(2.0, lambda: os.kill(os.getpid(), signal.SIGTERM)).start()
  start = time.monotonic()
  with pytest.raises(SystemExit, match=r'sleeper failed \(exit -15\)'):
    runner.run(['sleeper'], str(tmp_path))
  assert time.monotonic() - start < 60
  assert signal.getsignal(signal.SIGTERM) == before  # The runner's handler is gone again.


def test_list_names_every_experiment():
  out = subprocess.run([sys.executable, '-m', 'experiments', 'list'], capture_output=True,
                       text=True, cwd=render.REPO, check=True).stdout
  assert [line.split()[0] for line in out.splitlines()] == [
      e.name for e in registry.EXPERIMENTS + registry.PAGES + registry.DEVICE]
  assert all(('docs page' in line) == (line.split()[0] in {e.name for e in registry.PAGES})
             for line in out.splitlines())
  assert all(('accelerator' in line) == (line.split()[0] in {e.name for e in registry.DEVICE})
             for line in out.splitlines())


@pytest.mark.slow
@pytest.mark.system
def test_all_quick_runs_every_experiment_and_renders(tmp_path):
  """`python -m experiments all --quick`: every experiment's code end to end at a tiny size
  (RESULTS.md's and the docs pages'; 8 minutes on an idle 2-core CPU with the suite's
  fast-compile XLA flags, which the subprocess inherits; 13 as a user runs it), then
  OUT/RESULTS.md with a row for every claim."""
  rs = np.random.RandomState(0)
  words = [''.join(rs.choice(list('etaoinshrdlu'), rs.randint(1, 8))) for _ in range(300)]
  text = tmp_path / 'text.txt'
  text.write_text('\n'.join(' '.join(rs.choice(words, 12)) for _ in range(2000)))
  out = tmp_path / 'out'
  proc = subprocess.run([sys.executable, '-m', 'experiments', 'all', '--out', str(out),
                         '--text', str(text), '--quick'], cwd=render.REPO, capture_output=True,
                        text=True, timeout=3600)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  for e in registry.EXPERIMENTS + registry.PAGES:
    assert all((out / w).is_file() for w in e.writes), e.name
  rendered = (out / 'RESULTS.md').read_text()
  # Every file was written; a row may still lack the sizes only a full run measures.
  assert 'yet' not in rendered
  lacking = [line for line in rendered.splitlines() if '**not run**' in line]
  assert all('lack what this row reads' in line for line in lacking), lacking
  assert len(lacking) <= 3, lacking


def test_scripts_run_as_modules_with_no_path_hacks():
  """Every experiment and benchmark runs as `python -m PACKAGE.MODULE` from the repository
  root, so none edits sys.path, and no page or docstring shows the `python DIR/FILE.py` form
  (it would fail to import the project)."""
  repo = pathlib.Path(render.REPO)
  hacks = [str(p) for d in ('benchmarks', 'experiments') for p in (repo / d).glob('*.py')
           if 'sys.path.insert' in p.read_text()]
  assert not hacks, hacks
  pattern = re.compile(r'python3? (?:benchmarks|experiments)/\w+\.py')
  pages = [p for p in (*repo.glob('*.md'), *repo.glob('docs/*.md'), *repo.glob('*/README.md'),
                       *repo.glob('benchmarks/*.py'), *repo.glob('experiments/*.py'),
                       *repo.glob('benchmarks/*.sh'), *repo.glob('configs/*.py'))]
  found = [f'{p.name}: {m}' for p in pages for m in pattern.findall(p.read_text())]
  assert not found, found


def test_experiments_train_through_the_harness_only():
  """One way to launch a training run: the experiments train in process through
  experiments/harness.py, never through main.py subprocesses, another script's argv
  (compare.main) or a shell script."""
  repo = pathlib.Path(render.REPO)
  launches = re.compile(r"main\.py['\"]|compare\.main\(|train\.train_and_evaluate\(")
  found = [f'{p.name}: {m}' for p in (repo / 'experiments').glob('*.py')
           if p.name != 'harness.py' for m in launches.findall(p.read_text())]
  assert not found, found
  assert not list((repo / 'experiments').glob('*.sh'))
