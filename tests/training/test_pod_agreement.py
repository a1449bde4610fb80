"""A pod whose hosts disagree refuses at start, on every process, with one `error:` line:

* different settings on the hosts (a shape-changing `model.d` and a shape-keeping
  `learning_rate`), which aborted in gloo's first collective or trained one model from two
  recipes;
* a workdir on each host's local disk, where not one step was ever committed;
* different code on one host (a source file edited there, the same commit);
* and a process that dies during a checkpoint save: the other stops within the peer timeout
  naming it, and the previous committed step stays the latest and restores whole.

Each case is 2 processes x 1 CPU device on a loopback coordinator (tests/multiprocess.py); the
refusals come before anything compiles. The refusal of per-host workdirs in eval mode is slow
(`-m slow`): the same check refuses them in train mode in CI.
"""

import pathlib
import shutil
import subprocess
import sys
import time

import pytest

from tests import multiprocess
from tests.harness import REPO

pytestmark = pytest.mark.system

# The refusals come before the first compile: imports and joining the run take 8-30 s on 2
# loaded cores, so every process must have exited well within a minute.
DEADLINE = 90


def _launch(harness, workdirs, log_dir, extras, tag, *, repos=None, mode='train', main=None):
  """main.py as len(workdirs) processes: process i with workdirs[i], extras[i] and the copy of
  the project in repos[i] (default: this one)."""
  port = multiprocess.free_port()
  n = len(workdirs)
  procs, logs = [], []
  for i in range(n):
    repo = pathlib.Path(repos[i]) if repos else REPO
    command = harness.main_command(workdirs[i], extras[i], mode=mode)
    command[1] = str(main or repo / 'main.py')
    command += [f'--coordinator_address=127.0.0.1:{port}', f'--num_processes={n}',
                f'--process_id={i}']
    env = {**harness.env(1), 'PYTHONPATH': str(repo)}
    logs.append(pathlib.Path(log_dir) / f'{tag}_{i}.log')
    with open(logs[-1], 'w') as log:
      procs.append(subprocess.Popen(command, env=env, cwd=repo, stdout=log,
                                    stderr=subprocess.STDOUT))
  return procs, logs


def _finish(procs, logs, timeout):
  """(seconds to the last exit or None, return codes, log texts); kills what is left."""
  start = time.monotonic()
  try:
    for p in procs:
      p.wait(timeout=max(start + timeout - time.monotonic(), 1))
    took = time.monotonic() - start
  except subprocess.TimeoutExpired:
    took = None
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  return took, [p.returncode for p in procs], [pathlib.Path(f).read_text() for f in logs]


def _errors(text: str) -> list[str]:
  return [line for line in text.splitlines() if line.startswith('error: ')]


def _report(codes, texts) -> str:
  return '\n'.join(f'--- process {i} (rc {c}):\n{t[-2500:]}'
                   for i, (c, t) in enumerate(zip(codes, texts)))


def _refused_by_all(procs, logs, timeout=DEADLINE) -> list[str]:
  """Every process exits 1 within `timeout` with one `error:` line, the same on each (every
  process reaches the verdict from the same published values); returns that line."""
  took, codes, texts = _finish(procs, logs, timeout)
  report = _report(codes, texts)
  assert took is not None, 'a process was still running at the deadline:\n' + report
  assert codes == [1] * len(procs), report
  errors = [_errors(t) for t in texts]
  assert all(len(e) == 1 for e in errors) and all(e == errors[0] for e in errors), report
  assert not any('Traceback' in t or 'EnforceNotMet' in t for t in texts), report
  return errors[0][0]


def test_settings_that_differ_between_the_hosts_are_refused_on_every_process(harness,
                                                                            tmp_path):
  workdir = tmp_path / 'run'
  procs, logs = _launch(harness, [workdir, workdir], tmp_path,
                        [{'total_steps': 4, 'model.d': 2},
                         {'total_steps': 4, 'model.d': 3, 'learning_rate': 0.002}], 'settings')
  error = _refused_by_all(procs, logs)
  assert 'do not agree on their settings' in error, error
  assert 'config.model.d: 2 on process 0' in error and '3 on process 1' in error, error
  assert 'config.learning_rate' in error and '0.002 on process 1' in error, error
  assert not (workdir / 'checkpoints').exists()  # Nothing trained, nothing saved.


# Slow for eval: every mode reaches the check through the same assembly.check_workdir
# (train.py, assembly.build); [train] keeps the refusal in CI.
@pytest.mark.parametrize('mode', ['train', pytest.param('eval', marks=pytest.mark.slow)])
def test_a_workdir_on_each_hosts_own_disk_is_refused_on_every_process(harness, tmp_path, mode):
  dirs = [tmp_path / 'run_host0', tmp_path / 'run_host1']
  procs, logs = _launch(harness, dirs, tmp_path, [{'total_steps': 4}] * 2, 'workdir', mode=mode)
  error = _refused_by_all(procs, logs)
  assert 'do not share one workdir' in error, error
  assert 'process 1 (host' in error and f'--workdir={dirs[1]}' in error, error
  assert 'a bucket' in error, error
  assert not any((d / 'checkpoints').exists() for d in dirs)


def test_a_source_file_edited_on_one_host_is_refused_on_every_process(harness, tmp_path):
  # Process 1 runs a copy of the project in which one model file differs: the same commit,
  # the same command, another program.
  copy = tmp_path / 'host1_checkout'
  shutil.copytree(REPO, copy, ignore=shutil.ignore_patterns(
      '.git', '.venv', 'runs', '__pycache__', 'results', 'docs', 'experiments', 'benchmarks',
      'tests'))
  edited = copy / 'models' / 'layers.py'
  edited.write_text(edited.read_text() + '\n# Edited on this host only.\n')
  workdir = tmp_path / 'run'
  procs, logs = _launch(harness, [workdir, workdir], tmp_path, [{'total_steps': 4}] * 2, 'code',
                        repos=[REPO, copy])
  error = _refused_by_all(procs, logs)
  assert 'do not agree on their settings' in error, error
  assert 'code.file.models/layers.py' in error, error


SAVE_KILLER = '''
"""main.py, with process 1 killed (SIGKILL) as it starts to save checkpoint step KILL_AT."""
import os, runpy, signal, sys
from training import checkpoints
save = checkpoints.Checkpointer.save
def dying_save(self, step, *args, **kwargs):
  import jax
  if jax.process_index() == 1 and int(step) == int(os.environ['KILL_AT']):
    os.kill(os.getpid(), signal.SIGKILL)
  return save(self, step, *args, **kwargs)
checkpoints.Checkpointer.save = dying_save
sys.argv[0] = os.path.join(os.environ['PYTHONPATH'], 'main.py')
runpy.run_path(sys.argv[0], run_name='__main__')
'''


def test_a_process_lost_during_a_save_stops_the_other_and_the_last_step_resumes(
    harness, tmp_path, monkeypatch):
  """Over a minute in CI: two processes start, compile and train to the save that kills one,
  and the other waits out its peer check. The last whole step is then restored in this
  process (a restart of both, which resumed from it, doubled the time; a main.py restart
  resuming from a checkpoint is test_checkpointing.py's SIGKILL test)."""
  killer = tmp_path / 'save_killer.py'
  killer.write_text(SAVE_KILLER)
  workdir = tmp_path / 'run'
  extra = {'total_steps': 4, 'checkpoint_every_steps': 2, 'eval_every_steps': 0,
           'log_every_steps': 2}
  monkeypatch.setenv('KILL_AT', '4')
  monkeypatch.setenv('DISTRIBUTED_PEER_TIMEOUT_SECONDS', '5')  # The watch names it sooner.
  procs, logs = _launch(harness, [workdir, workdir], tmp_path, [extra] * 2, 'save', main=killer)
  took, codes, texts = _finish(procs, logs, 240)
  monkeypatch.delenv('KILL_AT')
  report = _report(codes, texts)
  assert took is not None, report
  assert codes[1] == -9 and codes[0] == 1, report  # Killed; the survivor stops itself.
  errors = _errors(texts[0])
  assert 'saving checkpoint step 4' in errors[0] and 'last committed checkpoint is step 2' in (
      errors[0]), report
  assert 'process 1 of 2' in errors[-1] and 'not been heard from' in errors[-1], report
  assert harness.step_dirs(workdir) == [2], report  # Step 4 was never committed.
  # What a restart resumes from: the latest step, 2, restores whole (both processes' shards),
  # and the half-written step 4 is not taken for a checkpoint.
  assert int(harness.restore(workdir, extra).step) == 2
  assert harness.step_dirs(workdir) == [2], report
