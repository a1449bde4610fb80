"""Reformer LSH attention ('lsh', issue 22) against computations written here.

- One bucket and one chunk: full causal shared-QK attention (values and gradients).
- Several buckets, rounds and chunks: a brute force that takes the same bucket assignments
  and finds each query's keys by sorting and chunking itself (numpy), then a dense softmax
  over the union of the rounds' key sets.
- The hash, the rotations' rng stream (fresh per key, replayed for the same key; one fixed
  set for every layer without it), the shared-QK self rule, packed documents, cost (no n x n
  tensor), the decoding caches made at init (decoding itself: test_lsh_decode.py), options.

Every model and attention call is jitted whole: run eagerly, a forward and its gradient
dispatch (and compile) each operation alone, several times the one compile of the program.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import transformer
from models.attention import lsh

SELF = -1e5


def _qv(seed=0, shape=(2, 24, 2, 8)):
  rng = np.random.default_rng(seed)
  return (jnp.asarray(rng.normal(size=shape), jnp.float32),
          jnp.asarray(rng.normal(size=shape), jnp.float32))


def _masked_shared_qk(q, v, allowed, scale=None):
  """softmax over `allowed` (b, h, n, n) of q_i . (q_j / |q_j|) * scale (default
  1 / sqrt(d)), the self pair used only by a query with no other allowed key."""
  scale = q.shape[-1] ** -0.5 if scale is None else scale
  k = q / jnp.linalg.norm(q, axis=-1, keepdims=True)
  logits = jnp.einsum('bqhd,bkhd->bhqk', q, k) * scale
  n = q.shape[1]
  eye = jnp.eye(n, dtype=bool)
  others = jnp.any(allowed & ~eye, axis=-1, keepdims=True)
  use = allowed & ~(eye & others)
  p = jax.nn.softmax(jnp.where(use, logits, -jnp.inf), axis=-1)
  return jnp.einsum('bhqk,bkhd->bqhd', p, v)


def _causal_docs(segment_ids, heads):
  n = segment_ids.shape[1]
  causal = np.tril(np.ones((n, n), bool))
  same = segment_ids[:, :, None] == segment_ids[:, None, :]
  return np.broadcast_to((causal & same)[:, None], (segment_ids.shape[0], heads, n, n))


def _brute_force_allowed(buckets, segment_ids, chunk_len):
  """(b, h, n, n) pairs some round attends, from the buckets (b, h, r, n) alone: each round
  orders the positions by (document, bucket, position), cuts the order into chunks of
  chunk_len, and pairs a query with the keys of its chunk and of the previous one that share
  its bucket and document and are not later."""
  b, h, r, n = buckets.shape
  allowed = np.zeros((b, h, n, n), bool)
  for bi in range(b):
    seg = segment_ids[bi]
    for hi in range(h):
      for ri in range(r):
        bk = buckets[bi, hi, ri]
        order = sorted(range(n), key=lambda p: (seg[p], bk[p], p))
        chunk_of = np.empty(n, int)
        for slot, p in enumerate(order):
          chunk_of[p] = slot // chunk_len
        for i in range(n):
          for j in range(i + 1):
            if (bk[i] == bk[j] and seg[i] == seg[j]
                and chunk_of[i] - chunk_of[j] in (0, 1)):
              allowed[bi, hi, i, j] = True
  return allowed


@functools.partial(jax.jit, static_argnames='chunk_len')
def _lsh(q, v, seg, buckets, chunk_len):
  return lsh.lsh_attention(q, v, jnp.asarray(seg), jnp.asarray(buckets), chunk_len=chunk_len,
                           scale=q.shape[-1] ** -0.5, dtype=jnp.float32)


def _check_values_and_grads(q, v, seg, buckets, chunk_len, allowed, atol=2e-6):
  cot = jnp.asarray(np.random.default_rng(7).normal(size=q.shape), jnp.float32)

  def values_and_grads(f):  # One jitted program: the outputs and the gradients of q and v.
    def loss(q, v):
      out = f(q, v)
      return jnp.sum(out * cot), out
    return jax.jit(jax.grad(loss, (0, 1), has_aux=True))(q, v)

  grads, out = values_and_grads(lambda q, v: _lsh(q, v, seg, buckets, chunk_len))
  want_grads, want = values_and_grads(
      lambda q, v: _masked_shared_qk(q, v, jnp.asarray(allowed)))
  np.testing.assert_allclose(out, want, atol=atol)
  for got, want in zip(grads, want_grads):
    np.testing.assert_allclose(got, want, atol=atol * 5)


@pytest.mark.parametrize('n_hashes', [1, 3])
def test_one_bucket_one_chunk_is_full_shared_qk_attention(n_hashes):
  """Every pair is found (n_hashes times over: counted once), with two packed documents."""
  q, v = _qv()
  b, n, h, _ = q.shape
  seg = np.ones((b, n), np.int32)
  seg[:, 10:] = 2
  seg[1, 20:] = 0  # Padding at the end of the second row.
  buckets = np.zeros((b, h, n_hashes, n), np.int32)
  _check_values_and_grads(q, v, seg, buckets, n, _causal_docs(seg, h))


@pytest.mark.parametrize('n_hashes,chunk_len,n', [(1, 4, 24), (2, 5, 24), (4, 3, 20)])
def test_buckets_rounds_and_chunks_equal_a_brute_force(n_hashes, chunk_len, n):
  """Random buckets (4 of them), several rounds, chunks that do not divide n, two documents:
  the union of the key sets each round's own sort and chunks give."""
  q, v = _qv(seed=n_hashes, shape=(2, n, 2, 8))
  b, _, h, _ = q.shape
  rng = np.random.default_rng(100 + n_hashes)
  buckets = rng.integers(0, 4, (b, h, n_hashes, n)).astype(np.int32)
  seg = np.ones((b, n), np.int32)
  seg[0, 13:] = 2
  allowed = _brute_force_allowed(buckets, seg, chunk_len)
  # Not a trivial set: some pairs are found, fewer than all causal ones.
  assert 0 < allowed.sum() < _causal_docs(seg, h).sum()
  if n_hashes > 1:  # Some pair is found by two rounds (so the duplicate count matters).
    per_round = [_brute_force_allowed(buckets[:, :, r:r + 1], seg, chunk_len)
                 for r in range(n_hashes)]
    assert (np.sum(per_round, axis=0) > 1).any()
  _check_values_and_grads(q, v, seg, buckets, chunk_len, allowed)


def test_duplicates_change_the_result_if_not_discounted():
  """The discount is what makes the brute force match: the rounds' plain log-sum-exp mix
  (each pair counted once per round that finds it) differs."""
  q, v = _qv(seed=5, shape=(1, 16, 1, 8))
  rng = np.random.default_rng(5)
  buckets = rng.integers(0, 2, (1, 1, 3, 16)).astype(np.int32)
  seg = np.ones((1, 16), np.int32)
  allowed = _brute_force_allowed(buckets, seg, 4)
  want = _masked_shared_qk(q, v, jnp.asarray(allowed))
  np.testing.assert_allclose(_lsh(q, v, seg, buckets, 4), want, atol=2e-6)
  singles = [_lsh(q, v, seg, buckets[:, :, r:r + 1], 4) for r in range(3)]
  assert not np.allclose(np.mean(singles, axis=0), want, atol=1e-3)


def test_hash_is_the_argmax_of_the_rotation_and_its_negation():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(2, 9, 3, 8)).astype(np.float32)
  rot = rng.normal(size=(2, 8, 3)).astype(np.float32)
  got = np.asarray(lsh.hash_buckets(jnp.asarray(x), jnp.asarray(rot)))
  proj = np.einsum('bnhd,rdk->bhrnk', x, rot)
  np.testing.assert_array_equal(got, np.argmax(np.concatenate([proj, -proj], -1), -1))
  assert got.min() >= 0 and got.max() < 6 and len(np.unique(got)) > 3


def test_a_query_falls_back_to_itself_only_without_other_keys():
  """Every document's first query has only itself: it returns its own value. With one bucket
  and one chunk, the second query attends to the first alone (not to itself)."""
  q, v = _qv(seed=3, shape=(1, 12, 2, 8))
  seg = np.array([[1] * 5 + [2] * 7], np.int32)
  out = _lsh(q, v, seg, np.zeros((1, 2, 1, 12), np.int32), 12)
  np.testing.assert_allclose(out[0, 0], v[0, 0], atol=1e-6)
  np.testing.assert_allclose(out[0, 5], v[0, 5], atol=1e-6)
  np.testing.assert_allclose(out[0, 1], v[0, 0], atol=1e-6)
  np.testing.assert_allclose(out[0, 6], v[0, 5], atol=1e-6)


def test_packed_documents_do_not_affect_each_other():
  """Changing the first document's queries, values and buckets leaves the second document's
  outputs unchanged (its chunks depend on its own tokens and its start only)."""
  q, v = _qv(seed=4, shape=(1, 24, 2, 8))
  seg = np.array([[1] * 10 + [2] * 14], np.int32)
  rng = np.random.default_rng(4)
  buckets = rng.integers(0, 4, (1, 2, 2, 24)).astype(np.int32)
  base = _lsh(q, v, seg, buckets, 4)
  q2 = q.at[:, :10].set(-3.0 * q[:, :10] + 1.0)
  v2 = v.at[:, :10].set(7.0)
  b2 = buckets.copy()
  b2[..., :10] = 3 - b2[..., :10]
  other = _lsh(q2, v2, seg, b2, 4)
  np.testing.assert_allclose(other[:, 10:], base[:, 10:], atol=1e-6)
  assert not np.allclose(other[:, :10], base[:, :10], atol=1e-3)


def _model(n_buckets=4, n_hashes=2, chunk_len=4, n_layers=2, stack='unrolled'):
  cfg = transformer.TransformerConfig(
      vocab_size=16, d_model=32, n_heads=2, n_layers=n_layers, head_dim=16, mlp_dim=64,
      max_len=32, attention=('lsh',) * n_layers, stack=stack,
      attention_options=(('lsh', (('chunk_len', chunk_len), ('n_buckets', n_buckets),
                                  ('n_hashes', n_hashes))),))
  return transformer.Decoder(cfg)


def _init(model, tokens, **kwargs):
  return jax.jit(functools.partial(model.init, **kwargs))(jax.random.key(0), tokens)


def _tokens(n=24):
  return jnp.asarray(np.random.default_rng(0).integers(0, 16, (2, n)), jnp.int32)


def test_module_with_one_bucket_is_full_attention_of_its_own_projections():
  """End to end through the module: its q (shared projection, q-norm) and v, full causal
  shared-QK attention with logits q . k (unit keys, no 1/sqrt(d)), its output projection."""
  model = _model(n_buckets=1, n_hashes=1, chunk_len=32, n_layers=1)
  tokens = _tokens()
  params = _init(model, tokens)['params']
  attn = nn.unbox(params)['block_0']['attention']
  assert set(attn) == {'qv', 'q_norm', 'out'}  # Shared-QK: no key projection.

  def forward(params):  # The attention's input and output, captured in one jitted pass.
    seen = {}

    def grab(next_fun, args, kwargs, context):
      out = next_fun(*args, **kwargs)
      if context.module.name == 'attention' and context.method_name == '__call__':
        seen['x'], seen['y'] = args[0], out
      return out

    with nn.intercept_methods(grab):
      _, inter = model.apply({'params': params}, tokens, mutable=['intermediates'])
    return seen['x'], seen['y'], inter

  x, y, inter = jax.jit(forward)(params)
  # The attention's output computed by hand from its input.
  qv = jnp.einsum('bnd,dghk->bnghk', x, attn['qv'])
  q = qv[:, :, 0]
  q = q * jax.lax.rsqrt(jnp.mean(q * q, -1, keepdims=True) + 1e-6) * attn['q_norm']['scale']
  v = qv[:, :, 1]
  seg = np.ones(tokens.shape, np.int32)
  heads = _masked_shared_qk(q, v, jnp.asarray(_causal_docs(seg, 2)), scale=1.0)
  want = jnp.einsum('bnhk,hkd->bnd', heads, attn['out'])
  np.testing.assert_allclose(y, want, atol=2e-5)
  assert inter['intermediates']['block_0']['attention']['buckets'][0].shape == (2, 2, 1, 24)


def test_rotations_come_from_the_lsh_stream():
  """The same 'lsh' key gives the same buckets and outputs; another key other buckets, and
  each layer its own rotations; no stream (evaluation) the fixed `eval_rotations`, the same
  in every layer (so that a scanned stack, where every layer has index 0, and its unrolled
  copy that decoding runs hash alike)."""
  model = _model()
  tokens = _tokens()
  params = _init(model, tokens)['params']

  @jax.jit  # Two compiles: with the stream and without.
  def forward(rngs):
    rotations = []

    def grab(next_fun, args, kwargs, context):
      out = next_fun(*args, **kwargs)
      if context.method_name == 'rotations':
        rotations.append(out)
      return out

    with nn.intercept_methods(grab):
      out, inter = model.apply({'params': params}, tokens, rngs=rngs,
                               mutable=['intermediates'])
    b = inter['intermediates']
    return out, [b[f'block_{i}']['attention']['buckets'][0] for i in range(2)], rotations

  def run(rngs, rotations=None):
    out, buckets, drawn = forward(rngs)
    if rotations is not None:
      rotations.extend(np.asarray(r) for r in drawn)
    return out, [np.asarray(b) for b in buckets]

  drawn, fixed = [], []
  a, ba = run({'lsh': jax.random.key(1)}, drawn)
  a2, ba2 = run({'lsh': jax.random.key(1)})
  c, bc = run({'lsh': jax.random.key(2)})
  e, be = run(None, fixed)
  e2, _ = run(None)
  np.testing.assert_array_equal(a, a2)
  np.testing.assert_array_equal(ba[0], ba2[0])
  assert not np.array_equal(ba[0], bc[0]) and not np.allclose(a, c)
  np.testing.assert_array_equal(e, e2)
  assert len(drawn) == len(fixed) == 2 and drawn[0].shape == (2, 16, 2)
  assert not np.array_equal(drawn[0], drawn[1])  # Training: each layer its own.
  # Evaluation: the same fixed rotations in every layer. Bit-equal between the layers (one
  # program); against the same draw made outside the model to float32 rounding, since the
  # normal sampler's arithmetic fused into the model may round its last bit differently.
  np.testing.assert_array_equal(fixed[0], fixed[1])
  np.testing.assert_allclose(fixed[0], lsh.eval_rotations(2, 16, 4), rtol=1e-6, atol=1e-6)
  assert not np.array_equal(be[0], be[1])  # The layers' queries still hash differently.
  assert len(np.unique(ba[0])) > 2  # Several buckets in use.
  assert transformer.rng_streams(model.config) == ('dropout', 'lsh')


@pytest.mark.parametrize('remat', ['none', 'full'])
def test_gradients_use_the_forward_buckets(monkeypatch, remat):
  """The gradient equals that of the same model with each layer's buckets fixed by hand to
  the ones its forward pass drew, also when the backward pass recomputes the layer (remat)."""
  model = _model(n_layers=2)
  model = transformer.Decoder(transformer.dataclasses.replace(model.config, remat=remat))
  tokens = _tokens()
  params = _init(model, tokens)['params']
  rngs = {'lsh': jax.random.key(3)}
  _, inter = jax.jit(functools.partial(model.apply, mutable=['intermediates']))(
      {'params': params}, tokens, rngs=rngs)
  drawn = [inter['intermediates'][f'block_{i}']['attention']['buckets'][0] for i in range(2)]

  def grad(p, r):  # Jitted, traced afresh at each call (after each monkeypatch).
    return jax.jit(jax.grad(lambda p, r: jnp.mean(model.apply({'params': p}, tokens,
                                                              rngs=r) ** 2)))(p, r)

  g = grad(params, rngs)
  monkeypatch.setattr(lsh.LSHAttention, 'buckets', lambda self, q: drawn[self.layer_index])
  g_fixed = grad(params, None)
  for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_fixed)):
    np.testing.assert_allclose(a, b, atol=1e-6)
  # Other buckets give another gradient, so the comparison can fail.
  monkeypatch.setattr(lsh.LSHAttention, 'buckets', lambda self, q: 3 - drawn[self.layer_index])
  g_other = grad(params, None)
  assert not all(np.allclose(a, b, atol=1e-6)
                 for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_other)))


def test_scan_stack_gives_each_layer_its_own_rotations():
  model = _model(stack='scan')
  tokens = _tokens()
  params = _init(model, tokens)['params']
  _, inter = jax.jit(functools.partial(model.apply, mutable=['intermediates']))(
      {'params': params}, tokens, rngs={'lsh': jax.random.key(1)})
  buckets = np.asarray(inter['intermediates']['blocks']['attention']['buckets'][0])
  assert buckets.shape[0] == 2 and not np.array_equal(buckets[0], buckets[1])


def test_memory_is_linear_in_the_length():
  """Compiled forward + backward temp memory at n = 2K and 4K grows about 2x (dense: 4x)."""
  def temp(n):
    q, v = _qv(shape=(1, n, 1, 16))
    seg = jnp.ones((1, n), jnp.int32)
    buckets = jnp.asarray(np.random.default_rng(0).integers(0, 8, (1, 1, 2, n)), jnp.int32)
    f = jax.jit(jax.grad(lambda q, v: jnp.sum(lsh.lsh_attention(
        q, v, seg, buckets, chunk_len=32, scale=0.25, dtype=jnp.float32) ** 2), (0, 1)))
    return f.lower(q, v).compile().memory_analysis().temp_size_in_bytes
  small, large = temp(2048), temp(4096)
  assert large < 2.5 * small, (small, large)
  assert large < 4096 * 4096 * 4 / 4  # Far below one n x n float32 score matrix.


def test_init_with_decoding_makes_the_caches():
  """Unit keys, values and each position's bucket in every round, for all max_len
  positions (decoding itself: test_lsh_decode.py)."""
  model = _model()
  cache = _init(model, _tokens(1), decode=True)['cache']
  layer = cache['block_1']['attention']
  assert {k: v.shape for k, v in layer.items()} == {
      'key': (2, 2, 32, 16), 'value': (2, 2, 32, 16), 'bucket': (2, 2, 2, 32),
      'position': (32,), 'index': ()}
  np.testing.assert_array_equal(layer['bucket'], -1)


@pytest.mark.parametrize('options,match', [
    ((('lsh', (('n_buckets', 3),)),),
     'model.attention_options.lsh: n_buckets must be 1 or an even'),
    ((('lsh', (('n_hashes', 0),)),),
     'model.attention_options.lsh.n_hashes must be an integer >= 1'),
    ((('lsh', (('chunk_len', 0),)),),
     'model.attention_options.lsh.chunk_len must be an integer >= 1'),
])
def test_bad_options_are_refused(options, match):
  with pytest.raises(ValueError, match=match):
    transformer.TransformerConfig(vocab_size=8, d_model=16, n_heads=2, n_layers=1, head_dim=8,
                                  mlp_dim=32, max_len=16, attention=('lsh',),
                                  attention_options=options)


@pytest.mark.parametrize('impl', ['cpu_kernel', 'cudnn', 'splash'])
def test_kernels_that_cannot_run_it_are_refused(impl):
  with pytest.raises(ValueError, match='lsh attention sorts positions'):
    transformer.TransformerConfig(vocab_size=8, d_model=16, n_heads=2, n_layers=1, head_dim=8,
                                  mlp_dim=32, max_len=16, attention=('lsh',),
                                  attention_impl=impl)
