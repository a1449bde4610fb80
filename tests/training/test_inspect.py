"""--mode=inspect writes each layer's and head's connectivity mask (npz) and its plot (png)."""

import numpy as np

from configs import default
from models.attention import patterns
from training import inspect


def test_inspect_writes_the_pattern_masks(tmp_path):
  config = default.get_config()
  config.model.d = 0
  config.model.d_model, config.model.n_heads, config.model.n_layers = 64, 4, 2
  config.model.attention = 'fixed'
  opts = config.model.attention_options
  opts.stride, opts.summary, opts.factorization, opts.distinct_heads = 16, 4, 'multihead', True
  config.inspect_len = 48
  paths = inspect.inspect(config, str(tmp_path))
  masks = np.load(paths['npz'])
  assert sorted(masks) == sorted(f'layer{l}_head{h}' for l in range(2) for h in range(4))
  for h in range(4):
    part = 'a1' if h < 2 else 'a2'
    want = patterns.mask(patterns.Fixed(16, 4, part, True), 48, h)
    np.testing.assert_array_equal(masks[f'layer1_head{h}'], want)
  # Distinct summary sub-blocks: heads 2 and 3 read different cells.
  assert not np.array_equal(masks['layer0_head2'], masks['layer0_head3'])
  with open(paths['png'], 'rb') as f:
    assert f.read(8) == b'\x89PNG\r\n\x1a\n'
