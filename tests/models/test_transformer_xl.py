"""Transformer-XL attention against independent computations (issue 21).

The layer is checked against a loop over (i, j) that evaluates the survey's four terms
q_i k_j + q_i W_R r_{i-j} + u k_j + v W_R r_{i-j} from the layer's own weights, with a
sinusoid written here; the recurrence against one pass over the concatenated segments;
decoding against the forward pass. Initialization and every forward and gradient are jitted
(eagerly, each operation is dispatched and compiled alone: several times the one compile).
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import decode, transformer
from models.attention import memory as segment_memory
from models.attention import transformer_xl as txl

HEADS, D_HEAD, D_MODEL = 2, 8, 16


def _sinusoid(x, width):
  """[sin(x / 10000^(2k/width)) for k] ++ [cos(...)], in float64."""
  inv = 1.0 / 10000.0 ** (np.arange(0, width, 2) / width)
  return np.concatenate([np.sin(x * inv), np.cos(x * inv)])


def _layer(**options):
  full = {'mem_len': 0, 'eval_mem_len': 0, 'clamp_len': 0, 'same_length': False,
          'attn_window': 0, **options}
  impl = full.pop('impl', 'xla')
  return txl.TransformerXLAttention(
      num_heads=HEADS, head_dim=D_HEAD, qk_norm=False, impl=impl, block_size=4, max_len=64,
      options=tuple(sorted(full.items())))


def _shared(seed=1):
  rng = np.random.default_rng(seed)
  return {'u': jnp.asarray(rng.normal(size=(HEADS, D_HEAD)), jnp.float32),
          'v': jnp.asarray(rng.normal(size=(HEADS, D_HEAD)), jnp.float32)}


def _brute(params, shared, x, segment_ids, memory, memory_ids, *, clamp=0, reach=None):
  """The four terms one (i, j) at a time from the layer's weights; float64."""
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), nn.unbox(params))
  w_qkv, w_out, w_r = p['qkv'], p['out'], p['pos_proj']
  u, v_bias = (np.asarray(shared[k], np.float64) for k in 'uv')
  x, memory = np.asarray(x, np.float64), np.asarray(memory, np.float64)
  b, n, _ = x.shape
  m = memory.shape[1]
  context = np.concatenate([memory, x], axis=1)
  k_ids = np.concatenate([memory_ids, segment_ids], axis=1)
  q = np.einsum('bte,ehd->bthd', x, w_qkv[:, 0])
  k = np.einsum('bte,ehd->bthd', context, w_qkv[:, 1])
  v = np.einsum('bte,ehd->bthd', context, w_qkv[:, 2])
  out = np.zeros((b, n, HEADS, D_HEAD))
  for bi in range(b):
    for i in range(n):
      for h in range(HEADS):
        scores, values = [], []
        for j in range(m + n):
          dist = m + i - j
          if dist < 0 or k_ids[bi, j] != segment_ids[bi, i] or (reach is not None and
                                                                 dist > reach):
            continue
          r = _sinusoid(min(dist, clamp) if clamp else dist, D_MODEL)
          wr = r @ w_r[:, h]  # W_R r_{i-j} for this head
          score = (q[bi, i, h] @ k[bi, j, h] + q[bi, i, h] @ wr + u[h] @ k[bi, j, h]
                   + v_bias[h] @ wr) / np.sqrt(D_HEAD)
          scores.append(score)
          values.append(v[bi, j, h])
        if scores:
          w = np.exp(np.array(scores) - max(scores))
          out[bi, i, h] = (w / w.sum()) @ np.array(values)
  return np.einsum('bthd,hde->bte', out, w_out)


def _case(n=11, m=6, seed=0):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=(2, n, D_MODEL)), jnp.float32)
  memory = jnp.asarray(rng.normal(size=(2, m, D_MODEL)), jnp.float32)
  ids = np.ones((2, n), np.int32)
  ids[1, 5:] = 2  # Row 1 packs a second document, which starts inside this segment.
  memory_ids = np.ones((2, m), np.int32)
  memory_ids[1, :2] = -1  # Row 1's memory is not full yet.
  return x, jnp.asarray(ids), memory, jnp.asarray(memory_ids)


def _init_layer(layer, shared, x, ids):
  return jax.jit(lambda x, ids: layer.clone(shared=shared).init(
      jax.random.key(0), x, positions=jnp.zeros_like(ids), segment_ids=ids))(x, ids)['params']


def _apply(layer, params, shared, x, ids, memory, memory_ids):
  layer = layer.clone(shared=shared)

  @jax.jit
  def apply(params, x, ids, memory, memory_ids):
    variables = {'params': params,
                 'memory': {'hidden': memory, 'segment_ids': memory_ids}}
    out, _ = layer.apply(variables, x, positions=jnp.zeros_like(ids), segment_ids=ids,
                         mutable=['memory'])
    return out
  return apply(params, x, ids, memory, memory_ids)


@pytest.mark.parametrize('impl', ['xla', 'blocksparse'])
@pytest.mark.parametrize('extra,reach', [
    ({}, None),
    ({'clamp_len': 3}, None),
    ({'attn_window': 5}, 5),
    ({'same_length': True}, 5),  # mem_len 6: keys fewer than 6 back.
])
def test_relative_attention_equals_the_four_terms(impl, extra, reach):
  x, ids, memory, memory_ids = _case()
  layer = _layer(mem_len=6, impl=impl, **extra)
  shared = _shared()
  params = _init_layer(layer, shared, x, ids)
  got = _apply(layer, params, shared, x, ids, memory, memory_ids)
  want = _brute(params, shared, x, np.asarray(ids), memory, np.asarray(memory_ids),
                clamp=extra.get('clamp_len', 0), reach=reach)
  np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=2e-5)


def test_clamp_changes_only_far_pairs():
  x, ids, memory, memory_ids = _case()
  shared = _shared()
  layer = _layer(mem_len=6)
  params = _init_layer(layer, shared, x, ids)
  far = _apply(_layer(mem_len=6, clamp_len=16), params, shared, x, ids, memory, memory_ids)
  plain = _apply(layer, params, shared, x, ids, memory, memory_ids)
  near = _apply(_layer(mem_len=6, clamp_len=2), params, shared, x, ids, memory, memory_ids)
  np.testing.assert_allclose(far, plain, atol=1e-6)  # No distance reaches 16.
  assert float(jnp.abs(near - plain).max()) > 1e-3


def test_one_layer_segments_equal_the_concatenation_values_and_gradients():
  """Segment 2 over [stop_gradient(segment 1); segment 2] equals the last n rows of one pass
  over both: outputs, and gradients w.r.t. segment 2's inputs and the weights."""
  n = 8
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.normal(size=(2, 2 * n, D_MODEL)), jnp.float32)
  ids = jnp.ones((2, 2 * n), jnp.int32)
  shared = _shared()
  with_memory = _layer(mem_len=n).clone(shared=shared)
  plain = _layer(mem_len=0).clone(shared=shared)
  params = jax.jit(functools.partial(plain.init, positions=ids, segment_ids=ids))(
      jax.random.key(0), x)['params']
  g = jnp.asarray(rng.normal(size=(2, n, D_MODEL)), jnp.float32)

  def segmented(params, second):
    memory = {'hidden': x[:, :n], 'segment_ids': ids[:, :n]}
    out, _ = with_memory.apply({'params': params, 'memory': memory}, second,
                               positions=ids[:, n:], segment_ids=ids[:, n:], mutable=['memory'])
    return jnp.sum(out * g), out

  def whole(params, second):
    out = plain.apply({'params': params}, jnp.concatenate([x[:, :n], second], axis=1),
                      positions=ids, segment_ids=ids)[:, n:]
    return jnp.sum(out * g), out

  (_, a), grads_a = jax.jit(jax.value_and_grad(segmented, argnums=(0, 1), has_aux=True))(
      params, x[:, n:])
  (_, b), grads_b = jax.jit(jax.value_and_grad(whole, argnums=(0, 1), has_aux=True))(
      params, x[:, n:])
  np.testing.assert_allclose(a, b, atol=2e-5)
  for ga, gb in zip(jax.tree.leaves(grads_a), jax.tree.leaves(grads_b)):
    np.testing.assert_allclose(ga, gb, atol=2e-5)


def _model(mem_len=0, max_len=32, stack='auto', **extra):
  options = {'mem_len': mem_len, **extra}
  cfg = transformer.TransformerConfig.from_config(dict(
      d=0, d_model=32, n_heads=2, n_layers=2, vocab_size=40, max_len=max_len, attention='txl',
      position_embedding='none', attention_impl=options.pop('impl', 'blocksparse'),
      attention_block_size=4, attention_options={'txl': options}, stack=stack))
  return transformer.Decoder(cfg)


def _run(model, variables, tokens, mutable=False):
  """model.apply, jitted."""
  return jax.jit(functools.partial(model.apply, mutable=mutable))(variables, tokens)


@pytest.mark.parametrize('stack', ['scan', 'unrolled'])
def test_decoder_segments_equal_one_pass_over_the_concatenation(stack):
  """Two layers: each layer's memory is its own input over the previous segment."""
  n = 8
  model = _model(mem_len=n, max_len=2 * n, stack=stack)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 40, (2, 2 * n)))
  variables = jax.jit(model.init)(jax.random.key(0), tokens[:, :n])
  params = variables['params']
  segment = jax.jit(functools.partial(model.apply, mutable=['memory']))  # Compiled once.
  first, mutated = segment({'params': params, 'memory': variables['memory']}, tokens[:, :n])
  second, _ = segment({'params': params, 'memory': mutated['memory']}, tokens[:, n:])
  whole = _model(mem_len=0, max_len=2 * n, stack=stack)
  both = _run(whole, {'params': params}, tokens)
  np.testing.assert_allclose(first, both[:, :n], atol=2e-5)
  np.testing.assert_allclose(second, both[:, n:], atol=2e-5)
  alone = _run(whole, {'params': params}, tokens[:, n:])
  assert float(jnp.abs(alone - both[:, n:]).max()) > 1e-3  # The memory is what makes it equal.


def test_u_and_v_are_one_pair_for_all_layers():
  model = _model(mem_len=4)
  params = nn.unbox(jax.eval_shape(model.init, jax.random.key(0),
                                   jnp.zeros((1, 8), jnp.int32))['params'])
  assert set(params['txl_shared']) == {'u', 'v'}
  assert params['txl_shared']['u'].shape == (2, 16)
  layer = params['blocks']['attention']
  assert 'u' not in layer and layer['pos_proj'].shape == (2, 32, 2, 16)  # W_R per layer.


@pytest.mark.parametrize('extra', [{}, {'same_length': True, 'clamp_len': 3}])
def test_decoding_equals_the_forward_pass(extra):
  model = _model(mem_len=6, max_len=20, **extra)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 40, (2, 20)))
  variables = jax.jit(model.init)(jax.random.key(0), tokens)
  params = jax.tree.map(lambda a: a, nn.unbox(variables['params']))
  # Non-zero u and v, so the biases' terms count.
  params['txl_shared'] = {k: jax.random.normal(jax.random.key(i), a.shape)
                          for i, (k, a) in enumerate(params['txl_shared'].items())}
  memory = segment_memory.fresh(nn.unbox(variables['memory']))
  full, _ = _run(model, {'params': params, 'memory': memory}, tokens, mutable=['memory'])
  np.testing.assert_allclose(decode.score(model, params, tokens), full, atol=3e-5)


def test_position_embedding_must_be_none():
  with pytest.raises(ValueError, match="position_embedding='none'"):
    transformer.TransformerConfig.from_config(dict(
        d=1, vocab_size=40, max_len=16, attention='txl', position_embedding='learned'))


@pytest.mark.parametrize('options,match', [
    ({'mem_len': -1}, r'model.attention_options.txl.mem_len must be an integer >= 0 '
                      r'\(0 = no memory\), got -1'),
    ({'mem_len': 0, 'same_length': True},
     'model.attention_options.txl: same_length .* needs mem_len >= 1'),
    ({'mem_len': 0, 'eval_mem_len': 8}, 'model.attention_options.txl: eval_mem_len needs'),
])
def test_bad_options_are_refused(options, match):
  with pytest.raises(ValueError, match=match):
    _model(**options)


def test_kernels_are_refused_by_name():
  with pytest.raises(ValueError, match='relative positional term'):
    _model(mem_len=4, impl='cpu_kernel')


def test_eval_options_lengthen_the_memory():
  model = _model(mem_len=4, eval_mem_len=12)
  config = transformer.for_eval(model.config)
  assert config.options_of('txl')['mem_len'] == 12
  shapes = jax.eval_shape(lambda: transformer.Decoder(config).init(
      jax.random.key(0), jnp.zeros((2, 8), jnp.int32)))['memory']
  assert nn.unbox(shapes)['blocks']['attention']['hidden'].shape == (2, 2, 12, 32)
  assert transformer.for_eval(_model(mem_len=4).config) == _model(mem_len=4).config
