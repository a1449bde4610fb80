"""Runs that do not lose or mix anything: one run per workdir, the config record written only
once the state matches, a checkpoint before every evaluation, honest accuracy (issue 20).

The tests that need a finished run copy one module fixture (2 steps in-process, one device).
"""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from training import evaluation, losses, train, workdir_lock


def test_a_second_run_on_a_live_workdir_is_refused(harness, tmp_path):
  workdir = tmp_path / 'run'
  workdir.mkdir()
  with workdir_lock.hold(str(workdir)):  # A live run holds it.
    proc = harness.run_main(workdir, {'total_steps': 2})
  assert proc.returncode == 1, proc.stderr[-2000:]
  errors = [line for line in proc.stderr.splitlines() if line.startswith('error: ')]
  assert len(errors) == 1 and 'is in use by another run' in errors[0], proc.stderr[-2000:]
  assert f'"pid": {os.getpid()}' in errors[0]  # It names the run that holds the workdir.
  assert not (workdir / 'checkpoints').exists() and not (workdir / 'config.json').exists()


def test_the_lock_of_a_dead_run_is_taken_over_with_a_note(tmp_path, caplog):
  lock = tmp_path / workdir_lock.LOCK_FILE
  lock.write_text(json.dumps({'pid': 2 ** 22 + 7, 'host': os.uname().nodename,
                              'started': 'yesterday'}))
  with caplog.at_level('WARNING'):
    with workdir_lock.hold(str(tmp_path)):
      assert json.loads(lock.read_text())['pid'] == os.getpid()
  assert 'no longer running' in caplog.text
  with workdir_lock.hold(str(tmp_path)):  # Released: the next run takes it silently.
    pass


@pytest.fixture(scope='module')
def two_steps(harness, tmp_path_factory):
  """A run of 2 steps on one device, trained in this process, its checkpoint at step 2."""
  workdir = tmp_path_factory.mktemp('two_steps') / 'run'
  train.train_and_evaluate(harness.config({'total_steps': 2, 'checkpoint_every_steps': 2}),
                           str(workdir))
  return workdir


def _copy(run, tmp_path):
  workdir = tmp_path / 'run'
  shutil.copytree(run, workdir)
  return workdir


def test_failed_restore_keeps_the_config_record(harness, two_steps, tmp_path):
  workdir = _copy(two_steps, tmp_path)
  record = (workdir / 'config.json').read_text()
  with pytest.raises(Exception):  # Another model cannot restore this checkpoint.
    train.train_and_evaluate(harness.config({'total_steps': 4, 'model.d': 3}), str(workdir))
  assert (workdir / 'config.json').read_text() == record


def test_checkpoint_is_saved_before_a_failing_evaluation(harness, tmp_path, monkeypatch):
  def broken_eval(*args, **kwargs):
    raise RuntimeError('eval data broke')

  monkeypatch.setattr(evaluation, 'score', broken_eval)
  workdir = tmp_path / 'run'
  config = harness.config({'total_steps': 4, 'checkpoint_every_steps': 2, 'eval_every_steps': 2})
  with pytest.raises(RuntimeError, match='eval data broke'):
    train.train_and_evaluate(config, str(workdir))
  assert harness.step_dirs(workdir) == [2]


def test_accuracy_does_not_count_tied_logits_as_right():
  x = jnp.zeros((1, 4, 3))          # All logits equal: a diverged model.
  w = jnp.zeros((3, 5))
  targets = jnp.asarray([[1, 2, 3, 4]])
  weights = jnp.ones((1, 4))
  _, correct = losses.linear_cross_entropy(x, w, targets, weights, 4)
  assert float(correct) == 0.0
  x = jnp.asarray(np.eye(3, dtype=np.float32)[None, [0, 1, 2, 0]])  # Target = the arg-max.
  w = jnp.asarray(np.eye(3, 5, dtype=np.float32))
  _, correct = losses.linear_cross_entropy(x, w, jnp.asarray([[0, 1, 2, 1]]), weights, 4)
  assert float(correct) == 3.0


def test_a_one_device_checkpoint_evaluates_on_a_tensor_parallel_mesh(harness, two_steps,
                                                                     tmp_path):
  # The vocabulary taken from the data (model.vocab_size=0) is padded independently of the
  # mesh, so parameter shapes, and checkpoints, are the same on every mesh.
  workdir = _copy(two_steps, tmp_path)
  proc = harness.run_main(workdir, {'total_steps': 2, 'mesh.data': 1, 'mesh.tensor': 2},
                          mode='eval', devices=2)
  assert proc.returncode == 0, proc.stderr[-3000:]
  result = json.loads((workdir / 'eval_step_2.json').read_text())
  assert np.isfinite(result['loss'])


def test_the_recorded_mesh_is_fitted_to_the_devices_present(harness, two_steps, tmp_path):
  """Its evaluation on 1 device, its resumption on 2 and a refused evaluation: three main.py
  starts."""
  # Issue 35: a run trained on 4 devices (data=2, fsdp=2) could not be evaluated on 1 device
  # ("mesh ... needs 4 devices, 1 are available") nor resumed on 2. The mesh is the machine's:
  # a start that sets none fits the recorded one to the devices present, in one log line.
  # What is fitted is the record's mesh, so the run is trained here on one device and its
  # record then says data=2, fsdp=2: what a 4-device run records (a 4-device main.py run
  # cost a third of the test; checkpoints restore onto any mesh: test_checkpointing.py).
  workdir = _copy(two_steps, tmp_path)
  mesh = {'mesh.data': 2, 'mesh.fsdp': 2}
  record = json.loads((workdir / 'config.json').read_text())
  record['mesh'].update(data=2, fsdp=2)
  (workdir / 'config.json').write_text(json.dumps(record, indent=2))
  proc = harness.run_main(workdir, {'total_steps': 2}, mode='eval', devices=1)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert ("the recorded mesh {'data': 2, 'fsdp': 2, 'tensor': 1, 'dcn_data': 1, 'dcn_fsdp': 1} "
          'does not fit the 1 devices here: using mesh {\'data\': -1, \'fsdp\': 1, ') in proc.stderr
  assert np.isfinite(json.loads((workdir / 'eval_step_2.json').read_text())['loss'])
  proc = harness.run_main(workdir, {'total_steps': 3}, devices=2)  # Resume on 2: fsdp kept.
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "using mesh {'data': -1, 'fsdp': 2, 'tensor': 1" in proc.stderr
  assert harness.step_dirs(workdir) == [2, 3]
  # A mesh asked for is not fitted: it is an error naming it.
  proc = harness.run_main(workdir, {'total_steps': 3, **mesh}, mode='eval', devices=1)
  assert proc.returncode == 1 and 'needs 4 devices, 1 are available' in proc.stderr


def test_fit_mesh_keeps_the_sizes_that_divide_and_fills_the_rest():
  from training import sharding  # pylint: disable=import-outside-toplevel
  one = jax.devices()[:1]
  assert sharding.fit_mesh({'data': -1, 'fsdp': 1, 'tensor': 1}, one) is None  # Fits.
  assert sharding.fit_mesh({'data': 2, 'fsdp': 4, 'tensor': 1}, one) == {
      'data': -1, 'fsdp': 1, 'tensor': 1, 'dcn_data': 1, 'dcn_fsdp': 1}
  # The axis recorded as -1 keeps taking the rest; others that do not divide become 1.
  assert sharding.fit_mesh({'data': 2, 'fsdp': -1, 'tensor': 2, 'dcn_data': 2}, one) == {
      'data': 1, 'fsdp': -1, 'tensor': 1, 'dcn_data': 1, 'dcn_fsdp': 1}
