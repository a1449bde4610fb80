"""The programs of the blocked attention paths do not grow with the sequence (issue 39).

Every blocked path is a loop over query blocks (models/attention/blockloop.py and the band and
residue paths of blocksparse.py), so the lowered train step of every registered variant is the
same size, within 1.2x, at n = 1,024 and n = 8,192 (8 and 64 blocks of the default 128): a
Python loop over blocks, or a host constant of the sequence's length, would make it 8x larger.
Lowered only (a second each; building the static patterns' host tables grows with n, which is
why the long side is 8,192 and not 16,384: a strided model took 7 s to build there. The short
side stays 1,024: at 512 the span variants lower a smaller program, not the same loop).
"""

import pytest

from configs import default
from models import attention
from training import aot, assembly

VARIANTS = [n for n in attention.known() if attention.get(n).__module__.startswith('models.')]
EXTRA = {'txl': {'position_embedding': 'none', 'packing': 'stream'}}


def _hlo_bytes(variant: str, n: int) -> int:
  config = default.get_config()
  config.model.d = 1
  config.seq_len = config.model.max_len = n
  config.batch_size = 1
  config.data.data_dir = '/nonexistent'  # Nothing is read.
  config.model.attention = variant
  # The plain-JAX blocked path of every variant (what 'auto' runs on a GPU, and on a TPU for
  # the variants without a static pattern); the CPU kernel is a call, flat by construction.
  config.model.attention_impl = 'blocksparse'
  for key, value in EXTRA.get(variant, {}).items():
    (config.data if key == 'packing' else config.model)[key] = value
  setup = assembly.build(config, data=False)
  return len(aot.lower_train_step(setup).as_text())


@pytest.mark.parametrize('variant', VARIANTS)
def test_train_step_program_is_flat_in_the_sequence(variant):
  short, long = _hlo_bytes(variant, 1024), _hlo_bytes(variant, 8192)
  assert long <= 1.2 * short, (
      f'{variant}: the lowered train step is {long / 1e6:.2f} MB at n=8192 against '
      f'{short / 1e6:.2f} MB at n=1024: a blocked path unrolls over the sequence')
