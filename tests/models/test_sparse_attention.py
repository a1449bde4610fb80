"""Tests for the static sparse attention variants (models/attention/sparse.py).

* The dense reference (`attention_impl='xla'`) equals a numpy attention over the patterns'
  set definitions (brute_patterns.py), for every registry name and factorization.
* Block-sparse and splash (Pallas, interpret mode on CPU) outputs and gradients (parameters
  and inputs) equal the reference with packed documents and trailing padding.
* The block-sparse layout covers the pattern and its FLOPs follow the pattern, not n^2.
* Invalid hyper-parameters raise a ValueError when the config is resolved (splash block sizes
  when the module is applied).

Compiles use a low XLA optimization level: the graphs are the same, compile time is what
dominates these small cases on CPU.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import brute_patterns as bp
from models import attention, transformer
from models.attention import blocksparse, patterns, sparse, splash

FAST_COMPILE = {'xla_backend_optimization_level': 0, 'xla_llvm_disable_expensive_passes': True}
NAMES = ('strided', 'fixed', 'local', 'block_local', 'local_global')
D_MODEL, HEAD_DIM = 8, 4
# Small pattern sizes so that n = 50 holds many blocks, strides and windows; each variant
# gets those it declares (`_own`: config.model.attention_options.<variant>).
OPTIONS = dict(stride=4, summary=2, factorization='interleave', distinct_heads=False, window=5,
               local_block=8, block_memory=3, global_every=2, key_block=4, band_block=4)

# (id, name, layer_index, heads, option overrides): every registry name, every factorization
# ('interleave' at layers 0 and 1 gives A1 and A2), distinct summary heads, both kinds of
# local_global layer.
CASES = [
    ('strided-interleave0', 'strided', 0, 2, {}),
    ('strided-interleave1', 'strided', 1, 2, {}),
    ('strided-merged', 'strided', 0, 2, {'factorization': 'merged', 'key_block': 3}),
    ('strided-multihead', 'strided', 0, 2, {'factorization': 'multihead'}),
    ('fixed-interleave0', 'fixed', 0, 2, {}),
    ('fixed-interleave1', 'fixed', 1, 2, {}),
    ('fixed-merged', 'fixed', 0, 2, {'factorization': 'merged'}),
    ('fixed-multihead', 'fixed', 0, 2, {'factorization': 'multihead'}),
    ('fixed-interleave1-distinct', 'fixed', 1, 2, {'distinct_heads': True}),
    ('fixed-merged-distinct', 'fixed', 0, 2, {'factorization': 'merged', 'distinct_heads': True}),
    ('fixed-multihead-distinct', 'fixed', 0, 4,
     {'factorization': 'multihead', 'distinct_heads': True, 'stride': 4, 'summary': 1}),
    ('local', 'local', 0, 2, {'key_block': 7}),
    ('block_local', 'block_local', 0, 2, {}),
    ('local_global-local', 'local_global', 0, 2, {}),
    ('local_global-global', 'local_global', 1, 2, {}),
]
CASE_IDS = [c[0] for c in CASES]
BY_ID = {c[0]: c for c in CASES}

# Block-sparse: a length that no block size divides (q blocks 16, key blocks 3, 4 or 7).
N_BLOCKSPARSE, Q_BLOCK = 50, 16
DOCS_50 = [[17, 19, 9], [31, 19]]  # Row 0 ends with 5 padding positions (segment 0).
# Splash: 128-multiple blocks dividing the length (interpret mode: keep it small).
N_SPLASH, SPLASH_BLOCK = 256, 128
DOCS_256 = [[100, 90, 50], [130, 126]]
# One splash case per pattern runs by default; the rest is the slow sweep.
SPLASH_FAST = ('strided-merged', 'fixed-multihead-distinct', 'local', 'block_local',
               'local_global-global')


def _options(**overrides):
  return {**OPTIONS, **overrides}


def _own(name, options, **overrides):
  """Variant `name`'s options: those of `options` it declares, then `overrides` (all of them:
  an option it does not declare stays an error)."""
  declared = attention.options(name)
  return {**{k: v for k, v in options.items() if k in declared}, **overrides}


def _module(name, impl, *, layer=0, heads=2, block=Q_BLOCK, **overrides):
  return attention.get(name)(num_heads=heads, head_dim=HEAD_DIM, impl=impl, block_size=block,
                             layer_index=layer,
                             options=tuple(sorted(_own(name, OPTIONS, **overrides).items())))


def _packed(n, docs):
  """(segment_ids, positions), each (rows, n): documents 1, 2, ... then padding (id 0)."""
  seg = np.zeros((len(docs), n), np.int32)
  pos = np.zeros((len(docs), n), np.int32)
  for r, lengths in enumerate(docs):
    start = 0
    for d, length in enumerate(lengths):
      seg[r, start:start + length] = d + 1
      pos[r, start:start + length] = np.arange(length)
      start += length
    assert start <= n
  return seg, pos


def _normal(seed, shape):
  return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


def _random_params(module, x, seg, pos, seed=1):
  """Random params shaped like module.init's (norm scales around 1); nothing compiled."""
  shapes = nn.meta.unbox(jax.eval_shape(
      lambda: module.init(jax.random.PRNGKey(0), x, positions=pos, segment_ids=seg))['params'])
  rng = np.random.default_rng(seed)

  def draw(path, s):
    if jax.tree_util.keystr(path).endswith("['scale']"):
      return jnp.asarray(rng.uniform(0.5, 1.5, s.shape), s.dtype)
    return jnp.asarray(rng.normal(size=s.shape) / np.sqrt(s.shape[0]), s.dtype)

  return jax.tree_util.tree_map_with_path(draw, shapes)


def _compiled(fn, *args):
  return jax.jit(fn).lower(*args).compile(compiler_options=FAST_COMPILE)


def _assert_close(got, want, what, rtol=1e-5):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  assert got.shape == want.shape, what
  scale = max(float(np.max(np.abs(want))), 1e-30) if want.size else 1.0
  np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * scale, err_msg=what)


def _check_against_xla(case_id, impl, n, block, docs):
  """Outputs and gradients of `impl` equal the 'xla' reference on packed rows."""
  _, name, layer, heads, overrides = BY_ID[case_id]
  seg, pos = _packed(n, docs)
  x = _normal(10, (len(docs), n, D_MODEL))
  real = seg > 0
  # Padding rows carry no loss: the cotangent is zero there.
  cotangent = _normal(11, x.shape) * jnp.asarray(real)[..., None]
  modules = [_module(name, i, layer=layer, heads=heads, block=block, **overrides)
             for i in ('xla', impl)]
  params = _random_params(modules[0], x, seg, pos)

  def outputs_and_grads(p, inputs):
    results = []
    for module in modules:
      def loss(p, inputs, module=module):
        y = module.apply({'params': p}, inputs, positions=pos, segment_ids=seg)
        return jnp.sum(y * cotangent), y
      (_, y), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(p, inputs)
      results.append((y, grads))
    return results

  (y_ref, (gp_ref, gx_ref)), (y, (gp, gx)) = _compiled(outputs_and_grads, params, x)(params, x)
  _assert_close(np.asarray(y)[real], np.asarray(y_ref)[real], f'{case_id} {impl} output')
  _assert_close(gx, gx_ref, f'{case_id} {impl} input gradient')
  assert jax.tree.structure(gp) == jax.tree.structure(gp_ref)
  for (path, g), g_ref in zip(jax.tree_util.tree_leaves_with_path(gp), jax.tree.leaves(gp_ref)):
    _assert_close(g, g_ref, f'{case_id} {impl} gradient {jax.tree_util.keystr(path)}')
    assert np.any(np.asarray(g_ref) != 0), path  # Not a vacuous comparison.


# ---------------------------------------------------------------- reference vs definitions


def _numpy_attention(q, k, v, seg, masks):
  """softmax(q k^T / sqrt(d)) v per head over masks[h] & causal same-document; queries that
  see no key output zeros."""
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  b, n, h, d = q.shape
  out = np.zeros_like(q)
  blind = 0
  for r in range(b):
    same_doc = seg[r][:, None] == seg[r][None, :]
    for head in range(h):
      mask = masks[head] & same_doc & np.tri(n, dtype=bool)
      logits = np.where(mask, q[r, :, head] @ k[r, :, head].T / np.sqrt(d), -np.inf)
      sees = mask.any(axis=1)
      blind += int((~sees & (seg[r] > 0)).sum())
      probs = np.exp(logits[sees] - logits[sees].max(axis=1, keepdims=True))
      out[r, sees, head] = (probs / probs.sum(axis=1, keepdims=True)) @ v[r, :, head]
  return out, blind


@pytest.mark.parametrize('case_id', CASE_IDS)
def test_xla_reference_matches_definitions(case_id):
  _, name, layer, heads, overrides = BY_ID[case_id]
  n = N_BLOCKSPARSE
  seg, pos = _packed(n, DOCS_50)
  q, k, v = (_normal(s, (len(DOCS_50), n, heads, HEAD_DIM)) for s in (20, 21, 22))
  module = _module(name, 'xla', layer=layer, heads=heads, **overrides)
  got = module.apply({}, q, k, v, positions=pos, segment_ids=seg, deterministic=True,
                     method='attend')
  options = _options(**overrides)
  masks = [bp.matrix(lambda i, h=h: bp.layer_keys(name, options, layer, h, heads)(i, n), n)
           for h in range(heads)]
  want, blind = _numpy_attention(q, k, v, seg, masks)
  real = seg > 0
  _assert_close(np.asarray(got)[real], want[real], case_id)
  if case_id in ('fixed-interleave1', 'fixed-interleave1-distinct'):
    assert blind > 0  # A2 alone: early queries of a document see nothing and output zeros.


# ------------------------------------------------------------ block-sparse and splash paths


@pytest.mark.parametrize('case_id', CASE_IDS)
def test_blocksparse_matches_xla_outputs_and_gradients(case_id):
  _check_against_xla(case_id, 'blocksparse', N_BLOCKSPARSE, Q_BLOCK, DOCS_50)


def test_blocksparse_with_one_position_blocks():
  # Degenerate blocks: every query and key block holds one position (two parts, one of them
  # in residue order).
  seg, pos = _packed(9, [[5, 3]])
  q, k, v = (_normal(s, (1, 9, 2, HEAD_DIM)) for s in (30, 31, 32))
  modules = [_module('strided', impl, block=1, key_block=1, stride=3, factorization='merged')
             for impl in ('xla', 'blocksparse')]
  attend = lambda q, k, v: [m.apply({}, q, k, v, positions=pos, segment_ids=seg,
                                    deterministic=True, method='attend') for m in modules]
  outs = _compiled(attend, q, k, v)(q, k, v)
  _assert_close(outs[1][seg > 0], outs[0][seg > 0], 'one-position blocks')


@pytest.fixture
def fresh_splash_kernels():
  """Empties splash's kernel cache, so that each case builds its kernel in its own trace
  (see test_splash_kernel_survives_a_second_trace)."""
  clear = getattr(splash._kernel, 'cache_clear', None)  # pylint: disable=protected-access
  if clear:
    clear()
  yield
  if clear:
    clear()


@pytest.mark.cpu_only  # Pallas interpret mode (on TPU the kernel runs compiled).
@pytest.mark.parametrize('case_id', [
    c if c in SPLASH_FAST else pytest.param(c, marks=pytest.mark.slow) for c in CASE_IDS])
def test_splash_matches_xla_outputs_and_gradients(case_id, fresh_splash_kernels):
  del fresh_splash_kernels
  _check_against_xla(case_id, 'splash', N_SPLASH, SPLASH_BLOCK, DOCS_256)


@pytest.mark.cpu_only
def test_splash_kernel_survives_a_second_trace():
  """The same splash module traced twice (e.g. a train step and an eval step).

  splash._kernel is an lru_cache around sk.make_splash_mha, which converts the mask info to
  jnp arrays; built inside the first jit trace they are tracers of that trace, and the cached
  kernel leaks them into every later trace (UnexpectedTracerError).
  """
  n = 128
  seg, pos = _packed(n, [[n]])
  x = _normal(40, (1, n, D_MODEL))
  module = _module('local', 'splash', heads=1, block=128, window=3)
  params = _random_params(_module('local', 'xla', heads=1, window=3), x, seg, pos)
  apply = lambda inputs: module.apply({'params': params}, inputs, positions=pos,
                                      segment_ids=seg)
  first = jax.jit(apply)(x)
  second = jax.jit(lambda inputs: 2.0 * apply(inputs))(x)  # A new trace, same kernel.
  _assert_close(second, 2.0 * np.asarray(first), 'second trace')


@pytest.mark.cpu_only
@pytest.mark.parametrize('scan', [True, False])
def test_splash_decoder_builds_and_matches_xla(scan, fresh_splash_kernels):
  """What assembly.build and the train step do: an abstract init (jax.eval_shape), then a jit.

  Unrolled, the jit is the kernel's second trace (see above); under nn.scan, flax traces the
  layer body more than once, so even the abstract init fails.
  """
  del fresh_splash_kernels
  n = 128
  seg, pos = _packed(n, [[70, 50], [n]])
  tokens = jnp.asarray(np.random.default_rng(60).integers(0, 16, (2, n)), jnp.int32)
  models = {impl: transformer.Decoder(transformer.TransformerConfig.from_config(dict(
      vocab_size=16, max_len=n, d_model=16, n_heads=2, n_layers=2, attention='local',
      attention_impl=impl, attention_block_size=128,
      attention_options={'local': _own('local', OPTIONS)},
      stack='auto' if scan else 'unrolled'))) for impl in ('xla', 'splash')}
  assert models['splash'].config.stack_name == ('scan' if scan else 'unrolled')
  init = lambda impl: models[impl].init(jax.random.PRNGKey(0), tokens)['params']
  shapes = jax.eval_shape(lambda: init('splash'))
  assert jax.tree.structure(shapes) == jax.tree.structure(jax.eval_shape(lambda: init('xla')))
  rng = np.random.default_rng(61)
  params = jax.tree.map(
      lambda s: jnp.asarray(0.3 * rng.normal(size=s.shape), s.dtype), nn.meta.unbox(shapes))
  logits = {impl: jax.jit(lambda p, m=model: m.apply(
      {'params': p}, tokens, positions=pos, segment_ids=seg))(params)
            for impl, model in models.items()}
  real = seg > 0
  _assert_close(np.asarray(logits['splash'])[real], np.asarray(logits['xla'])[real], 'logits')


@pytest.mark.parametrize('n,block', [(256, 64), (256, 100)])
def test_splash_block_size_must_be_a_multiple_of_128(n, block):
  seg, pos = _packed(n, [[n]])
  x = jnp.zeros((1, n, D_MODEL))
  module = _module('local', 'splash', block=block)
  params = _random_params(_module('local', 'xla'), x, seg, pos)
  with pytest.raises(ValueError, match=rf'multiple of 128.*now {block}|now {block}.*multiple'):
    jax.eval_shape(lambda: module.apply({'params': params}, x, positions=pos,
                                        segment_ids=seg))


@pytest.mark.cpu_only  # Pallas interpret mode.
@pytest.mark.parametrize('n,block', [(200, 128), (100, 256)])
def test_splash_pads_a_length_its_block_does_not_divide(n, block):
  seg, pos = _packed(n, [[n // 2, n - n // 2]])
  x = jnp.asarray(np.random.default_rng(0).normal(size=(1, n, D_MODEL)), jnp.float32)
  params = _random_params(_module('local', 'xla'), x, seg, pos)
  # Jitted: eagerly, interpret mode dispatches each of the kernel's operations alone.
  out = {impl: jax.jit(lambda p, x, m=_module('local', impl, block=block): m.apply(
      {'params': p}, x, positions=pos, segment_ids=seg))(params, x) for impl in ('splash', 'xla')}
  _assert_close(np.asarray(out['splash']), np.asarray(out['xla']), 'padded splash')


def _placed(doc_len, offset, n):
  """A row holding a filler document of `offset` tokens, then the document, then padding."""
  lengths = [offset, doc_len] if offset else [doc_len]
  return _packed(n, [lengths])


@pytest.mark.parametrize('case_id', [
    'strided-interleave0', 'strided-interleave1', 'local', 'local_global-local',
    pytest.param('fixed-interleave0', marks=pytest.mark.xfail(strict=True, reason=(
        'patterns use row indices, not positions in the document: the fixed blocks of a '
        'packed document depend on where it starts in the row'))),
    pytest.param('block_local', marks=pytest.mark.xfail(strict=True, reason=(
        'patterns use row indices: block_local query blocks depend on where a packed '
        'document starts in the row'))),
])
def test_packed_document_sees_the_same_keys_wherever_it_starts(case_id):
  """A document's attention output does not depend on its offset in a packed row (as for
  dense attention, tests/models/test_transformer.py), so that training on packed rows sees
  the pattern that decoding one document (models/decode.py) uses."""
  _, name, layer, heads, overrides = BY_ID[case_id]
  n, doc_len, offset = 32, 21, 3
  module = _module(name, 'xla', layer=layer, heads=heads, **overrides)
  q, k, v = (_normal(s, (1, doc_len, heads, HEAD_DIM)) for s in (50, 51, 52))
  outs = []
  for off in (0, offset):
    seg, pos = _placed(doc_len, off, n)
    pad = lambda a, off=off: jnp.pad(a, ((0, 0), (off, n - off - doc_len), (0, 0), (0, 0)))
    out = module.apply({}, pad(q), pad(k), pad(v), positions=pos, segment_ids=seg,
                       deterministic=True, method='attend')
    outs.append(np.asarray(out)[:, off:off + doc_len])
  _assert_close(outs[1], outs[0], case_id)


# ------------------------------------------------------------------------- layout and FLOPs

LONG = dict(stride=128, summary=16, factorization='interleave', distinct_heads=False,
            window=128, local_block=128, block_memory=64, global_every=2, key_block=16,
            band_block=64)
FLOP_Q_BLOCK = 128


def _head_parts(name, layer, heads, overrides, head, options=None):
  module = attention.get(name)(num_heads=heads, head_dim=HEAD_DIM, impl='blocksparse',
                               layer_index=layer,
                               options=tuple(sorted(
                                   _own(name, options or OPTIONS, **overrides).items())))
  return module.parts(head)


def _allowed_np(name, options, layer, head, heads, n):
  o = options
  if name in ('strided', 'fixed'):
    part = bp.factorized_part(o['factorization'], layer, head, heads)
    if name == 'strided':
      return bp.strided_np(n, o['stride'], part)
    return bp.fixed_np(n, o['stride'], o['summary'], part, head, o['distinct_heads'])
  if name == 'local':
    return bp.local_np(n, o['window'])
  if name == 'block_local':
    return bp.block_local_np(n, o['local_block'], o['block_memory'])
  if layer % o['global_every'] == o['global_every'] - 1:
    return bp.dense_np(n)
  return bp.local_np(n, o['window'])


def _block_cover_pairs(part_mask, order, q_block, k_block, per_step=0):
  """Brute force from the pattern's mask: for each query block (q_block rows of the
  computation order), the key blocks (k_block columns of that order, the last one ragged)
  holding at least one allowed pair; returns ({query block: those key blocks}, the pairs
  multiplied when each query block is computed against all the keys of its key blocks, or,
  with per_step, against whole loop steps of per_step key blocks)."""
  n = len(order)
  m = part_mask[np.ix_(order, order)]
  touched, pairs = {}, 0
  for qb, qs in enumerate(range(0, n, q_block)):
    rows = range(qs, min(qs + q_block, n))
    touched[qb] = {int(col) // k_block for col in np.flatnonzero(m[rows].any(axis=0))}
    if per_step:
      pairs += len(rows) * -(-len(touched[qb]) // per_step) * per_step * k_block
    else:
      pairs += len(rows) * sum(min(k_block, n - kb * k_block) for kb in touched[qb])
  return touched, pairs


@pytest.mark.parametrize('case_id', CASE_IDS)
def test_blocksparse_layout_covers_the_pattern_with_disjoint_parts(case_id):
  """Each head's parts are disjoint, their union is the pattern's definition, and each
  part's layout computes exactly the key blocks that hold an allowed pair (counted by brute
  force from the mask); computed_pairs reports those blocks in whole steps of the loop; the
  total never exceeds the causal dense layout's work."""
  _, name, layer, heads, overrides = BY_ID[case_id]
  n, q_block = 100, 16
  options = _options(**overrides)
  k_block = options['key_block']
  i, j = np.arange(n)[:, None], np.arange(n)[None, :]
  dense = blocksparse.computed_pairs([blocksparse.Part(blocksparse.HeadView(patterns.Dense()))], n,
                                     q_block, k_block)
  per_step = blocksparse.chunks_per_step(q_block, k_block)
  assert dense == _block_cover_pairs(bp.dense_np(n), np.arange(n), q_block, k_block,
                                     per_step)[1]
  for head in range(heads):
    parts = _head_parts(name, layer, heads, overrides, head)
    union = np.zeros((n, n), bool)
    total = 0
    for part in parts:
      what = f'{case_id} head {head} {part}'
      part_mask = np.asarray(part.allowed(i, j), bool)
      order, keys_of_block = blocksparse.layout(part, n, q_block, k_block)
      l = part.residue_stride
      want_order = sorted(range(n), key=lambda t: (t % l, t)) if l else list(range(n))
      np.testing.assert_array_equal(order, want_order, err_msg=what)
      touched, brute = _block_cover_pairs(part_mask, order, q_block, k_block)
      assert len(keys_of_block) == len(touched), what
      covered = np.zeros((n, n), bool)  # In the part's order.
      layout_pairs = 0
      for b, idx in enumerate(keys_of_block):
        queries = order[b * q_block:(b + 1) * q_block]
        covered[np.ix_(queries, order[idx])] = True
        layout_pairs += len(queries) * len(idx)
        assert set((np.asarray(idx) // k_block).tolist()) == touched[b], f'{what} block {b}'
        # Whole key blocks (in the part's order) except the ragged last one.
        assert all(len(set(idx) & set(range(s, s + k_block))) in (0, min(k_block, n - s))
                   for s in range(0, n, k_block))
      assert not np.any(part_mask & ~covered), f'{what}: pairs not computed'
      assert layout_pairs == brute, what
      assert not np.any(part_mask & union), f'{what}: parts overlap'
      union |= part_mask
      reported = blocksparse.computed_pairs([part], n, q_block, k_block)
      if l:
        # A residue part pairs only positions of equal residue mod l, and is computed as one
        # attention per class over its positions padded to ceil(n / l): count those pairs.
        assert np.all((i - j)[part_mask] % l == 0), what
        grid = np.arange(-(-n // l) * l)
        assert reported == int(np.sum(grid[:, None] % l == grid[None, :] % l)), what
        # Cheaper than the key blocks it touches in sequence order (all up to the diagonal).
        seq_order = _block_cover_pairs(part_mask, np.arange(n), q_block, k_block)[1]
        assert part_mask.sum() <= reported < seq_order, what
      else:
        assert reported == _block_cover_pairs(part_mask, order, q_block, k_block, per_step)[1]
      total += reported
    want = _allowed_np(name, options, layer, head, heads, n)
    np.testing.assert_array_equal(union, want, err_msg=f'{case_id} head {head}')
    assert blocksparse.computed_pairs(parts, n, q_block, k_block) == total, case_id
    assert want.sum() <= total <= dense, (case_id, head, total, dense)


LINEAR = [('local', 0, {}), ('block_local', 0, {}), ('fixed', 0, {}), ('strided', 0, {}),
          ('local_global', 0, {})]
FACTORIZED = [(name, layer, {'factorization': f})
              for name in ('strided', 'fixed')
              for f, layer in (('interleave', 0), ('interleave', 1), ('merged', 0))]


def _pairs(name, layer, overrides, n, head=0, heads=2):
  parts = _head_parts(name, layer, heads, overrides, head, LONG)
  computed = blocksparse.computed_pairs(parts, n, FLOP_Q_BLOCK, LONG['key_block'],
                                        LONG['band_block'])
  allowed = int(_allowed_np(name, {**LONG, **overrides}, layer, head, heads, n).sum())
  return computed, allowed


def _dense_pairs(n):
  return blocksparse.computed_pairs([blocksparse.Part(blocksparse.HeadView(patterns.Dense()))], n,
                                    FLOP_Q_BLOCK, LONG['key_block'])


@pytest.mark.parametrize('name,layer,overrides', LINEAR,
                         ids=['local', 'block_local', 'fixed-a1', 'strided-a1', 'local_global'])
def test_blocksparse_flops_grow_linearly(name, layer, overrides):
  (c1, a1), (c2, a2) = (_pairs(name, layer, overrides, n) for n in (1024, 2048))
  assert a1 <= c1 and a2 <= c2  # Every allowed pair is computed.
  assert 1.9 <= c2 / c1 <= 2.1, (c1, c2)
  dense1, dense2 = _dense_pairs(1024), _dense_pairs(2048)
  assert dense2 / dense1 > 3.7  # Causal attention grows ~4x.
  assert c2 < dense2 / 2


@pytest.mark.parametrize('name,layer,overrides', FACTORIZED,
                         ids=[f'{n}-{o["factorization"]}{l}' for n, l, o in FACTORIZED])
def test_blocksparse_flops_grow_no_faster_than_the_pattern(name, layer, overrides):
  (c1, a1), (c2, a2) = (_pairs(name, layer, overrides, n) for n in (1024, 2048))
  assert a1 <= c1 and a2 <= c2
  assert c2 / c1 <= a2 / a1 + 0.3, ((c1, a1), (c2, a2))  # n^2 / l parts grow ~4x too.
  assert c2 < _dense_pairs(2048)


def test_band_path_computes_the_window_plus_one_query_block():
  # Local w = 128 with band_block 64: every query block of 64 sees 128 + 64 keys (1.5 x the
  # window) where the blocked layout with 128-query blocks sees 2 x the window.
  n = 2048
  part = _head_parts('local', 0, 2, {}, 0, LONG)[0]
  assert blocksparse.band_width(part, n, FLOP_Q_BLOCK, 16, 64) == 128
  assert blocksparse.computed_pairs([part], n, FLOP_Q_BLOCK, 16, 64) == n * (128 + 64)
  blocked = blocksparse.computed_pairs([part], n, FLOP_Q_BLOCK, 16)
  assert blocked == 128 * 128 + (n - 128) * (128 + 128)
  # The band is not used where it would compute more (fixed A1 is block-diagonal).
  fixed_a1 = _head_parts('fixed', 0, 2, {}, 0, LONG)[0]
  assert blocksparse.band_width(fixed_a1, n, FLOP_Q_BLOCK, 16, 64) == 0


def test_computed_pairs_dense_counts_the_causal_blocks():
  # Query block b of length 128 sees keys [0, (b + 1) 128).
  assert _dense_pairs(512) == sum(128 * 128 * (b + 1) for b in range(4))
  # The loop reads whole steps of 128 keys: block 1's second step is masked past n = 200.
  assert _dense_pairs(200) == 128 * 128 + 72 * 256


# ------------------------------------------------------------------- config-time validation


def _model_config(name, n_heads=2, **overrides):
  return {'vocab_size': 16, 'max_len': 16, 'd_model': 8, 'n_heads': n_heads, 'n_layers': 2,
          'attention': name,
          'attention_options': {v: _own(v, OPTIONS, **overrides) for v in name.split(',')}}


@pytest.mark.parametrize('name', NAMES)
def test_valid_options_resolve(name):
  cfg = transformer.TransformerConfig.from_config(_model_config(name))
  assert cfg.attention == (name, name)
  # The given options win; every other declared option takes its declared default.
  given = _own(name, OPTIONS)
  resolved = cfg.options_of(name)
  assert given and {k: resolved[k] for k in given} == given
  assert resolved == {k: o.default for k, o in attention.options(name).items()} | given
  # Held as sorted (variant, sorted (name, value) pairs) pairs, for the variant in use only.
  assert cfg.attention_options == ((name, tuple(sorted(resolved.items()))),)


INVALID = [
    ('fixed', 2, {'stride': 4, 'summary': 5}, r'c <= l'),
    ('fixed', 2, {'summary': 0}, r'summary'),
    ('fixed', 2, {'stride': 0}, r'block length l'),
    ('strided', 2, {'stride': 0}, r'stride'),
    ('strided', 2, {'stride': -2}, r'stride'),
    ('local', 2, {'window': 0}, r'window'),
    ('local_global', 2, {'window': 0}, r'window'),
    ('block_local', 2, {'local_block': 0}, r'local_block'),
    ('block_local', 2, {'block_memory': -1}, r'block_memory'),
    ('local_global', 2, {'global_every': 0}, r'global_every'),
    ('strided', 2, {'factorization': 'diagonal'}, r'factorization'),
    ('fixed', 2, {'factorization': 'diagonal'}, r'factorization'),
    ('strided', 1, {'factorization': 'multihead'}, r'at least 2 heads'),
    ('fixed', 1, {'factorization': 'multihead'}, r'at least 2 heads'),
] + [(name, 2, {'key_block': 0}, r'key_block') for name in NAMES] + [
    # The kernel is attention_impl='cpu_kernel' now, not an option.
    (name, 2, {'cpu_kernel': True},
     rf'unknown model.attention_options.{name}.cpu_kernel; {name} declares: ')
    for name in NAMES] + [
    (name, 2, {'band_block': -1}, r'band_block') for name in NAMES]


@pytest.mark.parametrize('name,n_heads,overrides,match', INVALID,
                         ids=[f'{n}-{"-".join(f"{k}={v}" for k, v in o.items())}-h{h}'
                              for n, h, o, _ in INVALID])
def test_invalid_options_raise_at_config_time(name, n_heads, overrides, match):
  with pytest.raises(ValueError, match=match):
    transformer.TransformerConfig.from_config(_model_config(name, n_heads, **overrides))


def test_invalid_options_raise_for_a_per_layer_list():
  with pytest.raises(ValueError, match=r'model.attention_options.local: window'):
    transformer.TransformerConfig.from_config(
        {**_model_config('strided,local'),
         'attention_options': {'strided': _own('strided', OPTIONS),
                               'local': _own('local', OPTIONS, window=0)}})
