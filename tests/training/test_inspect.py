"""--mode=inspect writes each layer's and head's connectivity mask (npz) and its plot (png).

The masks are checked against brute_patterns.py (tests/models), the sets written from their
definitions with plain loops, with its own account of which set each layer and head uses:
the factorizations over layers ('interleave') and heads ('multihead'), distinct summary
heads, and local_global's global layers.
"""

import importlib.util
import pathlib

import numpy as np
import pytest

from configs import default
from training import attention_maps


def _load_oracle():
  path = pathlib.Path(__file__).resolve().parents[1] / 'models' / 'brute_patterns.py'
  spec = importlib.util.spec_from_file_location('_inspect_brute_patterns', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


bp = _load_oracle()

N = 48
# (id, attention, layers, heads, option overrides): every registry name with a static pattern,
# every factorization, more layers than one period of 'interleave' and 'global_every'.
CASES = [
    ('strided-interleave', 'strided', 4, 2, dict(stride=6, factorization='interleave')),
    ('strided-merged', 'strided', 2, 2, dict(stride=5, factorization='merged')),
    ('strided-multihead', 'strided', 2, 4, dict(stride=4, factorization='multihead')),
    ('fixed-interleave', 'fixed', 3, 2, dict(stride=8, summary=3, factorization='interleave')),
    ('fixed-multihead-distinct', 'fixed', 2, 4,
     dict(stride=16, summary=4, factorization='multihead', distinct_heads=True)),
    ('fixed-merged-distinct', 'fixed', 2, 3,
     dict(stride=8, summary=2, factorization='merged', distinct_heads=True)),
    ('local', 'local', 2, 2, dict(window=7)),
    ('block_local', 'block_local', 2, 2, dict(local_block=8, block_memory=3)),
    ('local_global-every3', 'local_global', 6, 2, dict(window=5, global_every=3)),
    ('local_global-every1', 'local_global', 2, 2, dict(window=5, global_every=1)),
]


def _config(name, layers, heads, overrides):
  config = default.get_config()
  config.model.d = 0
  config.model.d_model, config.model.n_heads, config.model.n_layers = 16 * heads, heads, layers
  config.model.attention = name
  unknown = set(overrides) - set(config.model.attention_options[name])
  assert not unknown, f'not {name} options: {unknown}'  # A typo would test the defaults.
  config.model.attention_options[name].update(overrides)
  config.inspect_len = N
  return config


@pytest.mark.parametrize('case', CASES, ids=[c[0] for c in CASES])
def test_inspect_masks_equal_the_definitions(case, tmp_path):
  _, name, layers, heads, overrides = case
  config = _config(name, layers, heads, overrides)
  paths = attention_maps.write_maps(config, str(tmp_path))
  masks = np.load(paths['npz'])
  assert sorted(masks) == sorted(f'layer{l}_head{h}' for l in range(layers) for h in range(heads))
  options = dict(config.model.attention_options[name])
  for layer in range(layers):
    for head in range(heads):
      want = bp.matrix(lambda i, layer=layer, head=head: bp.layer_keys(
          name, options, layer, head, heads)(i, N), N)
      got = masks[f'layer{layer}_head{head}']
      assert got.shape == (N, N) and got.dtype == bool
      if not np.array_equal(got, want):
        i, j = np.argwhere(got != want)[0]
        pytest.fail(f'{case[0]} layer {layer} head {head}: (i={i}, j={j}) inspect {got[i, j]}, '
                    f'definition {want[i, j]}')
  with open(paths['png'], 'rb') as f:
    assert f.read(8) == b'\x89PNG\r\n\x1a\n'


def test_inspect_masks_differ_where_the_definitions_do(tmp_path):
  # The cases above are not vacuous: layers of an interleaved or local_global model and the
  # heads of a multihead, distinct-summary model see different keys.
  def masks(case_id):
    _, name, layers, heads, overrides = next(c for c in CASES if c[0] == case_id)
    return np.load(attention_maps.write_maps(_config(name, layers, heads, overrides),
                                   str(tmp_path / case_id))['npz'])

  strided = masks('strided-interleave')
  assert not np.array_equal(strided['layer0_head0'], strided['layer1_head0'])
  np.testing.assert_array_equal(strided['layer0_head0'], strided['layer2_head0'])
  fixed = masks('fixed-multihead-distinct')
  assert len({fixed[f'layer0_head{h}'].tobytes() for h in range(4)}) == 3  # A1 twice, 2 A2s
  local_global = masks('local_global-every3')
  dense = np.tril(np.ones((N, N), bool))
  assert [np.array_equal(local_global[f'layer{l}_head0'], dense) for l in range(6)] == [
      False, False, True, False, False, True]
