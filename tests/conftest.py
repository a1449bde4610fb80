"""Fixtures shared by every test folder."""

import pytest

from training import flops, train


@pytest.fixture
def no_compute(monkeypatch):
  """Makes any compiled compute (or the matmul peak measurement) fail the test: bad input must
  be reported before it starts."""

  def fail(*args, **kwargs):
    del args, kwargs
    pytest.fail('compute started before the bad input was reported')

  for name in ('init_state', 'jit_train_step', 'jit_eval_step', 'run_eval'):
    monkeypatch.setattr(train, name, fail)
  monkeypatch.setattr(flops, 'measure_matmul_peak', fail)
