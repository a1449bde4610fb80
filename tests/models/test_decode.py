"""Token-by-token decoding with each variant's pattern-sized cache equals the full forward,
for the pattern settings that the variants' TEST_CONFIG (the contract suite's cases,
tests/contracts/test_model_contract.py) does not use: the fixed pattern with distinct summary heads,
interleaved and in one head set."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import decode, transformer
from models.attention import patterns

# Each pattern variant's options (config.model.attention_options.<variant>).
_BLOCKS = dict(key_block=4, band_block=4)
_OPTIONS = {
    'fixed': dict(stride=8, summary=3, factorization='interleave', distinct_heads=True,
                  **_BLOCKS),
    'strided': dict(stride=8, factorization='interleave', **_BLOCKS),
    'local': dict(window=6, **_BLOCKS),
    'block_local': dict(local_block=8, block_memory=5, **_BLOCKS),
    'local_global': dict(window=6, global_every=2, **_BLOCKS),
}
_MAX_LEN = 40


def _model(name, scan, **extra):
  cfg = transformer.TransformerConfig.from_config(dict(
      d=0, d_model=32, n_heads=4, n_layers=2, vocab_size=50, max_len=_MAX_LEN, attention=name,
      attention_options={**_OPTIONS, name: {**_OPTIONS.get(name, {}), **extra}},
      stack='auto' if scan else 'unrolled'))
  return transformer.Decoder(cfg)


@pytest.mark.parametrize('name,extra,scan', [
    ('fixed', {}, False), ('fixed', {'factorization': 'multihead'}, False),
    ('strided', {}, False)])
def test_decoding_equals_full_forward(name, extra, scan):
  model = _model(name, scan, **extra)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 50, (2, _MAX_LEN)))
  # Init and forward jitted (op by op they were slower than the decoding itself).
  params = jax.jit(model.init)(jax.random.key(0), tokens)['params']
  full = jax.jit(model.apply)({'params': params}, tokens)
  cache = decode.init_cache(model, params, 2)
  run = jax.jit(lambda c, tok, t: decode.step(model, params, c, tok, t))
  steps = []
  for t in range(_MAX_LEN):
    logits, cache = run(cache, tokens[:, t], t)
    steps.append(logits)
  np.testing.assert_allclose(jnp.stack(steps, 1), full, atol=2e-5, rtol=2e-5)


def test_cache_keeps_only_what_the_pattern_can_still_see():
  # Sliding window w: w entries; fixed: its block plus summary cells; dense: everything.
  assert patterns.cache_plan(patterns.Local(6), 40)[0] == 6
  assert patterns.cache_plan(patterns.BlockLocal(8, 5), 40)[0] == 13
  assert patterns.cache_plan(patterns.Dense(), 40)[0] == 40
  capacity, _ = patterns.cache_plan(patterns.Fixed(8, 3, 'union'), 40)
  assert capacity == 8 + 3 * (40 // 8 - 1)
  local = decode.cache_bytes(decode.init_cache(_model('local', False), None, 2))
  dense = decode.cache_bytes(decode.init_cache(_model('dense', False), None, 2))
  assert dense == local * _MAX_LEN // 6


def test_sample_is_greedy_at_temperature_zero():
  model = _model('local', False)
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, 50, (1, 5)))
  params = jax.jit(model.init)(jax.random.key(0), tokens)['params']
  out = decode.sample(model, params, tokens, 3, jax.random.key(0), temperature=0.0)
  assert out.shape == (1, 8)
  np.testing.assert_array_equal(out[:, :5], tokens)
  # Each new token is the argmax of the full forward over what came before.
  logits = jax.jit(model.apply)({'params': params}, out[:, :-1])  # Causal: t - 1 sees :t.
  np.testing.assert_array_equal(out[0, 5:], jnp.argmax(logits[0, 4:], -1))
  with pytest.raises(ValueError, match='exceeds model.max_len'):
    decode.sample(model, params, tokens, _MAX_LEN, jax.random.key(0))
