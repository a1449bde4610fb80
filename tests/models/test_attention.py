"""Tests for models.attention: dense reference, fused path and the registry."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import attention, layers
from models import transformer
from models.attention import base, dense, registry

BATCH, LENGTH, D_MODEL, HEADS, HEAD_DIM = 2, 8, 12, 3, 4
# Two packed documents and trailing padding in row 0; one document in row 1.
SEGMENT_IDS = np.array([[1, 1, 1, 2, 2, 2, 2, 0],
                        [1, 1, 1, 1, 1, 1, 1, 1]], np.int32)
POSITIONS = np.array([[0, 1, 2, 0, 1, 2, 3, 0],
                      [0, 1, 2, 3, 4, 5, 6, 7]], np.int32)


def _np_mask(segment_ids):
  """(batch, q, k) bool: causal and same document, built with loops."""
  b, n = segment_ids.shape
  mask = np.zeros((b, n, n), bool)
  for r in range(b):
    for i in range(n):
      for j in range(n):
        mask[r, i, j] = j <= i and segment_ids[r, i] == segment_ids[r, j]
  return mask


def _np_attend(q, k, v, segment_ids):
  """Naive per-head softmax(q k^T / sqrt(d)) v with the causal same-document mask."""
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  b, n, h, d = q.shape
  mask = _np_mask(segment_ids)
  out = np.zeros_like(q)
  for r in range(b):
    for head in range(h):
      logits = q[r, :, head] @ k[r, :, head].T / np.sqrt(d)
      logits = np.where(mask[r], logits, -np.inf)
      probs = np.exp(logits - logits.max(-1, keepdims=True))
      probs /= probs.sum(-1, keepdims=True)
      out[r, :, head] = probs @ v[r, :, head]
  return out


def _np_rms_norm(x, scale, eps=1e-6):
  return x / np.sqrt(np.mean(np.square(x), -1, keepdims=True) + eps) * scale


def _np_mha(x, params, segment_ids, qk_norm):
  """numpy MultiHeadAttention forward using the module's own parameters."""
  x = np.asarray(x, np.float64)
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  qkv = np.einsum('btd,dphk->pbthk', x, p['qkv'])
  q, k, v = qkv[0], qkv[1], qkv[2]
  if qk_norm:
    q = _np_rms_norm(q, p['q_norm']['scale'])
    k = _np_rms_norm(k, p['k_norm']['scale'])
  out = _np_attend(q, k, v, segment_ids)
  return np.einsum('bthk,hkd->btd', out, p['out'])


def _normal(seed, shape):
  return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


def _qkv(seed=0):
  return [_normal(seed + i, (BATCH, LENGTH, HEADS, HEAD_DIM)) for i in range(3)]


def _init_module(module, x, seed=1):
  """Random float32 params shaped like module.init's (abstract init: nothing to compile).

  Random norm scales make the QK-norm scales matter in the comparisons.
  """
  shapes = nn.meta.unbox(jax.eval_shape(
      lambda: module.init(jax.random.PRNGKey(0), x, positions=POSITIONS,
                          segment_ids=SEGMENT_IDS))['params'])
  rng = np.random.default_rng(seed)

  def draw(path, s):
    if jax.tree_util.keystr(path).endswith("['scale']"):
      return jnp.asarray(rng.uniform(0.5, 1.5, s.shape), s.dtype)
    return jnp.asarray(rng.normal(size=s.shape) / np.sqrt(s.shape[0]), s.dtype)

  return jax.tree_util.tree_map_with_path(draw, shapes)


def _x(seed=10):
  return _normal(seed, (BATCH, LENGTH, D_MODEL))


def test_causal_segment_mask_matches_loops():
  got = np.asarray(base.causal_segment_mask(jnp.asarray(SEGMENT_IDS)))
  assert got.shape == (BATCH, LENGTH, LENGTH)
  np.testing.assert_array_equal(got, _np_mask(SEGMENT_IDS))


@pytest.mark.parametrize('impl', ['xla', 'fused'])
def test_dense_attend_matches_numpy(impl):
  q, k, v = _qkv()
  module = dense.DenseAttention(num_heads=HEADS, head_dim=HEAD_DIM, impl=impl)
  got = module.apply({}, q, k, v, positions=POSITIONS, segment_ids=SEGMENT_IDS,
                     deterministic=True, method='attend')
  assert got.shape == (BATCH, LENGTH, HEADS, HEAD_DIM)
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(got, _np_attend(q, k, v, SEGMENT_IDS), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize('block_size', [1, 3, 128])
def test_blocksparse_attend_matches_numpy(block_size):
  q, k, v = _qkv(seed=3)
  module = dense.DenseAttention(num_heads=HEADS, head_dim=HEAD_DIM, impl='blocksparse',
                                block_size=block_size)
  got = jax.jit(lambda q, k, v: module.apply(
      {}, q, k, v, positions=POSITIONS, segment_ids=SEGMENT_IDS, deterministic=True,
      method='attend'))(q, k, v)
  assert got.shape == (BATCH, LENGTH, HEADS, HEAD_DIM)
  np.testing.assert_allclose(got, _np_attend(q, k, v, SEGMENT_IDS), atol=1e-5, rtol=1e-5)


def test_reference_attention_fully_masked_row_is_uniform_not_nan():
  q, k, v = _qkv()
  mask = jnp.zeros((BATCH, 1, LENGTH, LENGTH), bool)
  out = base.reference_attention(q, k, v, mask, scale=0.5, dtype=jnp.float32)
  assert np.all(np.isfinite(out))
  expected = np.broadcast_to(np.mean(np.asarray(v), axis=1, keepdims=True), out.shape)
  np.testing.assert_allclose(out, expected, atol=1e-5)


@pytest.mark.parametrize('qk_norm', [True, False])
def test_dense_module_matches_numpy(qk_norm):
  x = _x()
  module = dense.DenseAttention(num_heads=HEADS, head_dim=HEAD_DIM, qk_norm=qk_norm)
  params = _init_module(module, x)
  shapes = jax.tree.map(jnp.shape, params)
  assert shapes['qkv'] == (D_MODEL, 3, HEADS, HEAD_DIM)
  assert shapes['out'] == (HEADS, HEAD_DIM, D_MODEL)
  if qk_norm:
    assert shapes['q_norm'] == {'scale': (HEAD_DIM,)}
    assert shapes['k_norm'] == {'scale': (HEAD_DIM,)}
  else:
    assert set(params) == {'qkv', 'out'}
  got = module.apply({'params': params}, x, positions=POSITIONS, segment_ids=SEGMENT_IDS)
  assert got.shape == (BATCH, LENGTH, D_MODEL)
  np.testing.assert_allclose(got, _np_mha(x, params, SEGMENT_IDS, qk_norm), atol=1e-5, rtol=1e-5)


def test_dense_module_rejects_a_cache_that_is_not_a_flag():
  x = _x()
  module = dense.DenseAttention(num_heads=HEADS, head_dim=HEAD_DIM)
  params = _init_module(module, x)
  with pytest.raises(ValueError, match='cache must be None, False, True'):
    module.apply({'params': params}, x, positions=POSITIONS, segment_ids=SEGMENT_IDS, cache={})


def test_fused_matches_xla_outputs_and_gradients():
  x = _x()
  xla = dense.DenseAttention(num_heads=HEADS, head_dim=HEAD_DIM, impl='xla')
  fused = dense.DenseAttention(num_heads=HEADS, head_dim=HEAD_DIM, impl='fused')
  params = _init_module(xla, x)
  cotangent = _normal(20, (BATCH, LENGTH, D_MODEL))

  def loss(module, p, inputs):
    y = module.apply({'params': p}, inputs, positions=POSITIONS, segment_ids=SEGMENT_IDS)
    return jnp.sum(y * cotangent)

  outs = {}
  for name, module in (('xla', xla), ('fused', fused)):
    grad_fn = jax.value_and_grad(lambda p, i, m=module: loss(m, p, i), argnums=(0, 1))
    outs[name] = jax.jit(grad_fn)(params, x)
  (v_xla, (gp_xla, gx_xla)), (v_fused, (gp_fused, gx_fused)) = outs['xla'], outs['fused']
  np.testing.assert_allclose(v_fused, v_xla, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(gx_fused, gx_xla, atol=1e-5, rtol=1e-5)
  assert jax.tree.structure(gp_fused) == jax.tree.structure(gp_xla)
  for a, b in zip(jax.tree.leaves(gp_fused), jax.tree.leaves(gp_xla)):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
  # Gradients reach every parameter (the check above is not vacuous).
  assert all(np.any(np.asarray(g) != 0) for g in jax.tree.leaves(gp_xla))


def test_the_flat_and_head_major_projections_give_the_same_outputs_and_gradients():
  # fused_projection writes q, k, v head-major outside a loop over layers and with one flat
  # matmul inside one (layers.scanned_layers): the same attention either way.
  x = _x()
  module = dense.DenseAttention(num_heads=HEADS, head_dim=HEAD_DIM)
  params = _init_module(module, x)
  cotangent = _normal(21, (BATCH, LENGTH, D_MODEL))

  def loss(p, inputs):
    y = module.apply({'params': p}, inputs, positions=POSITIONS, segment_ids=SEGMENT_IDS)
    return jnp.sum(y * cotangent)

  grad_fn = jax.value_and_grad(loss, argnums=(0, 1))
  head_major = grad_fn(params, x)
  with layers.scanned_layers():
    flat = grad_fn(params, x)
  for a, b in zip(jax.tree.leaves(head_major), jax.tree.leaves(flat)):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
  assert all(np.any(np.asarray(g) != 0) for g in jax.tree.leaves(head_major[1][0]))


def test_registry_get_known_and_unknown():
  assert attention.get('dense') is dense.DenseAttention
  assert 'dense' in attention.known()
  assert attention.known() == sorted(attention.known())
  with pytest.raises(ValueError, match='nope') as err:
    attention.get('nope')
  assert 'dense' in str(err.value)


def test_config_with_unknown_attention_lists_known_names():
  with pytest.raises(ValueError, match='nope') as err:
    transformer.TransformerConfig.from_config(
        {'vocab_size': 16, 'max_len': 8, 'd_model': 8, 'n_heads': 2, 'n_layers': 1,
         'attention': 'nope'})
  assert 'dense' in str(err.value)


def test_register_duplicate_raises_and_keeps_original():
  with pytest.raises(ValueError, match='dense'):
    attention.register('dense')(type('Impostor', (base.MultiHeadAttention,), {}))
  assert attention.get('dense') is dense.DenseAttention


def test_register_new_name(monkeypatch):
  monkeypatch.setattr(registry.VARIANTS, '_entries', dict(registry.VARIANTS._entries))

  @attention.register('test_registry_new')
  class NewAttention(dense.DenseAttention):
    pass

  assert attention.get('test_registry_new') is NewAttention
  assert 'test_registry_new' in attention.known()
  with pytest.raises(ValueError, match='twice'):
    attention.register('test_registry_new')(NewAttention)


class _AttendOnly(base.MultiHeadAttention):
  """A variant with no static pattern that overrides only `attend`."""

  def attend(self, q, k, v, **kwargs):
    return v


def test_variant_without_pattern_or_decode_step_refuses_to_decode():
  module = _AttendOnly(num_heads=2, head_dim=4, max_len=8)
  x = jnp.zeros((1, 1, 8))
  pos = jnp.zeros((1, 1), jnp.int32)
  # Full-sequence calls work; decoding raises instead of decoding as dense attention.
  variables = module.init(jax.random.key(0), x, positions=pos, segment_ids=jnp.ones((1, 1)))
  with pytest.raises(NotImplementedError, match='_AttendOnly cannot decode'):
    module.init(jax.random.key(0), x, positions=pos, segment_ids=jnp.ones((1, 1)), cache=True)
  assert 'cache' not in variables


def test_dense_decodes_through_its_static_pattern():
  module = dense.DenseAttention(num_heads=2, head_dim=4, max_len=8)
  x = jnp.ones((1, 1, 8))
  pos = jnp.zeros((1, 1), jnp.int32)
  variables = module.init(jax.random.key(0), x, positions=pos, segment_ids=jnp.ones((1, 1)),
                          cache=True)
  assert variables['cache']['key'].shape == (1, 2, 8, 4)  # (b, h, capacity, d)
