"""A TPU start compiles its train step once: the loop runs the executable that the fit check
(training/aot.py) compiled, instead of jitting the same program again (issue 47).

No TPU here: the fit check is switched on for a CPU run, which compiles the same way.
"""

import pytest

from tests.harness import Harness  # noqa: F401  (the `harness` fixture's type)
from training import aot, steps, train

pytestmark = pytest.mark.system


def test_the_loop_runs_the_fit_checks_executable(harness, tmp_path, monkeypatch):
  checked, jitted_calls = [], []
  check = aot.check_train_step_fits

  def spy_check(setup):
    report, compiled = check(setup)
    checked.append(compiled)
    return report, compiled

  jit_train_step = steps.jit_train_step

  class Counted:  # The jitted step, counting the calls that run it (not its lowering).
    def __init__(self, fn):
      self.fn = fn

    def lower(self, *args):
      return self.fn.lower(*args)

    def __call__(self, *args):
      jitted_calls.append(1)
      return self.fn(*args)

  def spy_jit(setup, model=None):
    return Counted(jit_train_step(setup, model))

  monkeypatch.setattr(train, '_checks_fit', lambda setup: True)
  monkeypatch.setattr(aot, 'check_train_step_fits', spy_check)
  monkeypatch.setattr(steps, 'jit_train_step', spy_jit)
  config = harness.config({'total_steps': 3, 'checkpoint_every_steps': 3, 'log_every_steps': 3})
  state = train.train_and_evaluate(config, str(tmp_path))
  assert int(state.step) == 3
  assert len(checked) == 1 and checked[0] is not None
  assert not jitted_calls, 'the loop compiled its own train step after the fit check'
