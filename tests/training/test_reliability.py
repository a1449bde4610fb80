"""Runs that do not lose or mix anything: one run per workdir, the config record written only
once the state matches, a checkpoint before every evaluation, honest accuracy (issue 20)."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from training import losses, train, workdir_lock


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


def test_failed_restore_keeps_the_config_record(harness, tmp_path):
  workdir = tmp_path / 'run'
  train.train_and_evaluate(harness.config({'total_steps': 2, 'checkpoint_every_steps': 2}),
                           str(workdir))
  record = (workdir / 'config.json').read_text()
  with pytest.raises(Exception):  # Another model cannot restore this checkpoint.
    train.train_and_evaluate(harness.config({'total_steps': 4, 'model.d': 3}), str(workdir))
  assert (workdir / 'config.json').read_text() == record


def test_checkpoint_is_saved_before_a_failing_evaluation(harness, tmp_path, monkeypatch):
  def broken_eval(*args, **kwargs):
    raise RuntimeError('eval data broke')

  monkeypatch.setattr(train, 'run_eval', broken_eval)
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


def test_a_one_device_checkpoint_evaluates_on_a_tensor_parallel_mesh(harness, tmp_path):
  # The vocabulary taken from the data (model.vocab_size=0) is padded independently of the
  # mesh, so parameter shapes, and checkpoints, are the same on every mesh.
  workdir = tmp_path / 'run'
  train.train_and_evaluate(harness.config({'total_steps': 2, 'checkpoint_every_steps': 2}),
                           str(workdir))
  proc = harness.run_main(workdir, {'total_steps': 2, 'mesh.data': 1, 'mesh.tensor': 2},
                          mode='eval', devices=2)
  assert proc.returncode == 0, proc.stderr[-3000:]
  result = json.loads((workdir / 'eval_step_2.json').read_text())
  assert np.isfinite(result['loss'])
