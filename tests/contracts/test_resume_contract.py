"""Resume = straight run, for every variant and every block and stack (cases.ONE_EACH; the
static-pattern variants in the slow tier, cases.loop_slow_cases says why).

The real training loop (training/train.py) runs 4 steps with a checkpoint at step 2; its
step-4 checkpoint is then removed and the loop run again in the same workdir: it resumes
from step 2, and its parameters and optimizer state at step 4 must equal the straight run's.
What this catches: state that a variant keeps outside the parameters and optimizer (segment
memory, a specialized program, a random stream not derived from (seed, step)) and is lost or
drawn anew on a resume. Dropout is on, so every step's random masks must be replayed too.
"""

import shutil

import jax
import numpy as np
import pytest

from tests.contracts import cases
from training import train

pytestmark = [pytest.mark.system, pytest.mark.usefixtures('compile_cache')]


def _config(case: cases.Case):
  config = cases.run_config(case, dropout_rate=0.1, attention_impl='xla')
  config.data.update(name='copy', num_symbols=12, max_length=15)  # Rows of 32.
  config.update(batch_size=4, total_steps=4, warmup_steps=1, log_every_steps=2,
                eval_every_steps=0, eval_steps=1, checkpoint_every_steps=2,
                keep_checkpoints=3, peak_tflops_per_device=1.0, async_checkpointing=False)
  return config


@pytest.mark.parametrize('case', cases.loop_params())
def test_a_resumed_run_equals_the_straight_run(case, tmp_path):
  config = _config(case)
  straight = train.train_and_evaluate(config, str(tmp_path))
  shutil.rmtree(tmp_path / 'checkpoints' / '4')  # The run now ends at its step-2 checkpoint.
  resumed = train.train_and_evaluate(config, str(tmp_path))
  assert int(straight.step) == int(resumed.step) == 4
  for kind in ('params', 'opt_state', 'memory'):
    a, b = getattr(straight, kind), getattr(resumed, kind)
    assert jax.tree.structure(a) == jax.tree.structure(b), kind
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
      np.testing.assert_allclose(np.asarray(y), np.asarray(x), atol=1e-6, rtol=1e-6,
                                 err_msg=f'{kind}{jax.tree_util.keystr(path)}')
