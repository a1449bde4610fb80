"""Fixtures shared by every test folder, and what the suite assumes of the backend."""

import jax
import pytest

from training import flops, train

# The tests compare float32 paths to ~1e-5 (the rounding of exact float32 products). On NVIDIA
# GPUs JAX runs float32 matmuls in TF32 by default (errors of 5e-4 to 1e-2 on an H100, which
# failed 95 tests there), so the suite asks for full float32 products on every backend (CPU
# computes them anyway).
jax.config.update('jax_default_matmul_precision', 'highest')


def pytest_collection_modifyitems(config, items):
  """Tests marked cpu_only (the CPU tile kernel, Pallas interpret mode, what 'auto' picks on
  one CPU device) are skipped on another backend, with the reason."""
  del config
  backend = jax.default_backend()
  if backend == 'cpu':
    return
  skip = pytest.mark.skip(reason=f'needs the CPU backend (this run is on {backend})')
  for item in items:
    if item.get_closest_marker('cpu_only'):
      item.add_marker(skip)


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
