"""The training loop never waits for the device between log steps, for every variant, block
and stack (cases.ONE_EACH, the static-pattern variants in the slow tier: cases.loop_slow_cases;
issue 47).

A host call that waits for the device (jax.device_get, block_until_ready, an array turned
into a numpy array or a Python number, a multihost all-gather) puts a round trip into the
step: the device idles while the host sees the result and dispatches the next step. On a TPU
that is most of a small step. The loop may wait where it meets the device anyway: at its log,
checkpoint and eval steps. A spy counts the waiting calls made between two dispatched steps
over a 12-step run that logs every 6 steps: there must be none after steps 0-5 and 7-11 (step
0: the first step's compile and dispatch). Adaptive span's trim read after every step, and
one-step-late metrics, each made one call per step.
"""

import collections

import jax
import pytest
from jax._src import array as jax_array
from jax.experimental import multihost_utils

from tests.contracts import cases
from training import train

pytestmark = [pytest.mark.system, pytest.mark.usefixtures('compile_cache')]

LOG_EVERY = 6
TOTAL = 12


def _config(case: cases.Case):
  config = cases.run_config(case)
  config.data.update(name='copy', num_symbols=12, max_length=15)  # Rows of 32.
  config.update(batch_size=4, total_steps=TOTAL, warmup_steps=1, log_every_steps=LOG_EVERY,
                eval_every_steps=0, eval_steps=1, checkpoint_every_steps=TOTAL,
                peak_tflops_per_device=1.0, async_checkpointing=False)
  return config


class _Spy:
  """Counts waiting calls per interval between dispatched steps (`on_step`'s count)."""

  def __init__(self, monkeypatch):
    self.step = None
    self.calls = collections.defaultdict(list)

    def spy(name, fn):
      def wrapper(*args, **kwargs):
        if self.step is not None:
          self.calls[self.step].append(name)
        return fn(*args, **kwargs)
      return wrapper

    monkeypatch.setattr(jax, 'device_get', spy('jax.device_get', jax.device_get))
    monkeypatch.setattr(jax, 'block_until_ready',
                        spy('jax.block_until_ready', jax.block_until_ready))
    monkeypatch.setattr(multihost_utils, 'process_allgather',
                        spy('process_allgather', multihost_utils.process_allgather))
    for method in ('__array__', '__float__', '__int__', '__bool__', 'item', 'tolist',
                   'block_until_ready'):
      monkeypatch.setattr(jax_array.ArrayImpl, method,
                          spy(f'Array.{method}', getattr(jax_array.ArrayImpl, method)))

  def on_step(self, step: int) -> None:
    self.step = step


def _sync_step(step: int) -> bool:
  return step % LOG_EVERY == 0 and step > 0


@pytest.mark.parametrize('case', cases.loop_params())
def test_the_loop_waits_only_at_log_steps(case, tmp_path, monkeypatch):
  spy = _Spy(monkeypatch)
  state = train.train_and_evaluate(_config(case), str(tmp_path), on_step=spy.on_step)
  spy.step = None
  assert int(state.step) == TOTAL
  waits = {step: calls for step, calls in spy.calls.items() if not _sync_step(step)}
  assert not waits, (f'{case.id}: the host waited for the device between log steps: '
                     + '; '.join(f'after step {s}: {", ".join(sorted(set(c)))} ({len(c)}x)'
                                 for s, c in sorted(waits.items())))
  # The spy sees the waits that do happen (the log step's metric fetch).
  assert spy.calls[LOG_EVERY], 'the spy saw no call at the log step: it counts nothing'
