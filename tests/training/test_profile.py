"""config.profile_steps: a JAX profiler trace of a few train steps in WORKDIR/profile."""

import logging

import jax.numpy as jnp
import pytest

from training import settings, steps, train


def _traces(workdir) -> list:
  return sorted((workdir / 'profile').glob('plugins/profile/*/*.xplane.pb'))


def test_profile_steps_traces_steps_of_this_process(harness, tmp_path, caplog):
  """Off by default; on a resume the window counts from the restored step."""
  workdir = tmp_path / 'run'
  train.train_and_evaluate(harness.config({'total_steps': 2}), str(workdir))
  assert not (workdir / 'profile').exists()

  caplog.set_level(logging.INFO)
  # Resumed at step 2: steps 3 and 4 (this process's first is 0 and compiles) are traced.
  train.train_and_evaluate(harness.config({'total_steps': 5, 'profile_steps': 2,
                                           'profile_start_step': 1}), str(workdir))
  [trace] = _traces(workdir)
  assert trace.stat().st_size > 0
  assert list(trace.parent.glob('perfetto_trace.json.gz'))
  [line] = [r.getMessage() for r in caplog.records if 'profiler trace' in r.getMessage()]
  assert f'train steps 4-5 written to {workdir}/profile' in line
  assert 'tensorboard --logdir' in line
  assert not any('nothing was profiled' in r.getMessage() for r in caplog.records)


def test_a_run_that_ends_before_the_window_writes_no_trace(tmp_path, caplog):
  caplog.set_level(logging.INFO)
  # state.step 3, trace from step 3 + 2; the loop stops at step 4.
  with train._Profile(str(tmp_path / 'profile'), 3, 2, 2) as profile:  # pylint: disable=protected-access
    for step in (3, 4):
      profile.before_step(step, None)
      profile.after_step(step + 1, None)
    profile.stop(None)
  assert not (tmp_path / 'profile').exists()
  [line] = [r.getMessage() for r in caplog.records if 'nothing was profiled' in r.getMessage()]
  assert 'before state.step 5 where the trace starts' in line


def test_an_error_inside_the_window_still_writes_the_trace(tmp_path):
  with pytest.raises(RuntimeError, match='boom'):
    with train._Profile(str(tmp_path / 'profile'), 0, 0, 5) as profile:  # pylint: disable=protected-access
      profile.before_step(0, None)
      jnp.arange(4.0).sum().block_until_ready()
      raise RuntimeError('boom')
  assert _traces(tmp_path)


@pytest.mark.parametrize('key, value', [('profile_steps', -1), ('profile_start_step', -2),
                                        ('profile_steps', 1.5), ('profile_start_step', True)])
def test_bad_values_are_refused_before_the_train_step(key, value):
  # A plain dict: a ConfigDict's type lock would refuse the float before the check sees it.
  config = {'profile_steps': 2, 'profile_start_step': 2, key: value}
  with pytest.raises(ValueError, match=rf'{key} must be an integer >= 0, got {value!r}'):
    settings.check_profile(config)


def test_a_bad_value_stops_the_run_before_compiling(harness, tmp_path, monkeypatch):
  def fail(*args, **kwargs):
    del args, kwargs
    pytest.fail('the train step was built before the bad profile_steps was reported')

  monkeypatch.setattr(steps, 'jit_train_step', fail)
  with pytest.raises(ValueError, match='profile_steps must be an integer >= 0, got -1'):
    train.train_and_evaluate(harness.config({'total_steps': 2, 'profile_steps': -1}),
                             str(tmp_path / 'run'))
