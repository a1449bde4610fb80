"""Token-by-token decoding of Reformer LSH attention (LSHAttention.decode_step).

- One chunk (chunk_len >= the length): the forward pass attends to exactly the bucket-mates,
  so decoding (decode.score) equals it, for 1 and 2 rounds and 1 and 4 buckets (greedy
  generation, the reversible layer and the stacks: tests/contracts/test_model_contract.py).
- Shorter chunks: decoding attends to the whole bucket, checked against a reference written
  here (dense causal shared-QK attention restricted to the union of the rounds' buckets, with
  the self rule), which differs from plain causal attention and from the chunked forward.
- The cache: each slot's buckets are the hash of its key (and the forward's buckets), its
  layout and size (decode.cache_bytes); the prompt is read token by token (no prefill).

Initialization, forward passes and decoding steps are jitted (eagerly, each operation is
dispatched and compiled alone: several times the one compile of the program).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import attention, decode, transformer
from models.attention import lsh

VOCAB = 50
MAX_LEN = 24
ONE_CHUNK = 32  # >= MAX_LEN: every forward pass here is one chunk.


def _model(n_hashes=2, n_buckets=4, chunk_len=ONE_CHUNK, **extra):
  m = dict(d=0, d_model=32, n_heads=2, n_layers=2, vocab_size=VOCAB, max_len=MAX_LEN,
           attention='lsh',
           attention_options={'lsh': dict(n_hashes=n_hashes, n_buckets=n_buckets,
                                          chunk_len=chunk_len)},
           stack='unrolled', dtype='float32')
  m.update(extra)
  model = transformer.Decoder(transformer.TransformerConfig.from_config(m))
  params = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, MAX_LEN), jnp.int32))['params']
  return model, params


def _apply(model, params, tokens):
  """The forward pass's logits, jitted; traced at each call (tests patch the attention)."""
  return jax.jit(lambda p, t: model.apply({'params': p}, t))(params, tokens)


def _tokens(batch=2, length=20, seed=0):
  return jnp.asarray(np.random.default_rng(seed).integers(3, VOCAB, (batch, length)), jnp.int32)


def _stepped_cache(model, params, tokens):
  """The caches after decoding `tokens` one by one, and the logits of each step."""
  cache = decode.init_cache(model, params, tokens.shape[0])
  step = jax.jit(lambda c, t, i: decode.step(model, params, c, t, i))  # As decode.score.
  out = []
  for i in range(tokens.shape[1]):
    logits, cache = step(cache, tokens[:, i], i)
    out.append(logits)
  return cache, jnp.stack(out, axis=1)


def _forward_buckets(model, params, tokens):
  """Each layer's buckets (batch, heads, n_hashes, length) as the forward pass sows them."""
  _, inter = jax.jit(lambda p, t: model.apply({'params': p}, t, mutable=['intermediates']))(
      params, tokens)
  inter = inter['intermediates']
  return [np.asarray(inter[f'block_{i}']['attention']['buckets'][0])
          for i in range(model.config.n_layers)]


# The reversible layer and the scanned stacks decode LSH in the contract suite
# (tests/contracts/test_model_contract.py); here, the rounds and buckets on Pre-LN.
CASES = [(h, b, 'pre_ln', 'unrolled') for h in (1, 2) for b in (1, 4)]


@pytest.mark.parametrize('n_hashes, n_buckets, block, stack', CASES,
                         ids=[f'h{h}-b{b}-{block}-{stack}' for h, b, block, stack in CASES])
def test_one_chunk_decoding_equals_the_forward_pass(n_hashes, n_buckets, block, stack):
  model, params = _model(n_hashes, n_buckets, residual=block, stack=stack)
  tokens = _tokens()
  full = _apply(model, params, tokens)
  np.testing.assert_allclose(decode.score(model, params, tokens), full, rtol=1e-5, atol=2e-5)
  if n_buckets > 1:  # The buckets restrict the keys: one bucket gives other logits.
    one, _ = _model(n_hashes, 1, residual=block, stack=stack)  # The same parameters.
    assert not np.allclose(_apply(one, params, tokens), full, atol=1e-3)


def _bucket_attention(self, q, k, v, *, positions, segment_ids, deterministic,
                      key_segment_ids=None, extra=None, restrict=True):
  """Reference LSHAttention.attend (one document per row): the evaluation rotations drawn
  here, h_r(x) = argmax([xR_r; -xR_r]); query i attends, with logit q_i . q_j / |q_j|, to
  every j <= i that shares its bucket in some round (all j <= i when restrict is False), and
  to itself only when it has no other such key."""
  del k, positions, segment_ids, deterministic, key_segment_ids, extra
  b, n, h, d = q.shape
  rounds, n_buckets = self.option('n_hashes'), self.option('n_buckets')
  if n_buckets == 1:
    buckets = jnp.zeros((b, h, rounds, n), jnp.int32)
  else:
    rot = jax.random.normal(jax.random.fold_in(jax.random.key(lsh.EVAL_KEY), 0),
                            (rounds, d, n_buckets // 2))
    proj = jnp.einsum('bnhd,rdk->bhrnk', q, rot)
    buckets = jnp.argmax(jnp.concatenate([proj, -proj], -1), -1)
  allowed = jnp.tril(jnp.ones((n, n), bool))[None, None]
  if restrict:
    allowed = allowed & jnp.any(buckets[..., :, None] == buckets[..., None, :], axis=2)
  keys = q / jnp.linalg.norm(q, axis=-1, keepdims=True)
  logits = jnp.einsum('bqhd,bkhd->bhqk', q, keys)
  eye = jnp.eye(n, dtype=bool)
  others = jnp.any(allowed & ~eye, axis=-1, keepdims=True)
  use = allowed & ~(eye & others)
  probs = jax.nn.softmax(jnp.where(use, logits, -jnp.inf), axis=-1)
  return jnp.einsum('bhqk,bkhd->bqhd', probs, v)


@pytest.mark.parametrize('n_hashes', [1, 2])
def test_short_chunks_decode_the_whole_bucket(monkeypatch, n_hashes):
  """chunk_len 4 < 20 tokens: decoding is full bucket-restricted causal attention over the
  union of the rounds, not the chunked forward pass."""
  model, params = _model(n_hashes, 4, chunk_len=4)
  tokens = _tokens()
  decoded = decode.score(model, params, tokens)
  chunked = _apply(model, params, tokens)
  with monkeypatch.context() as m:
    m.setattr(lsh.LSHAttention, 'attend', _bucket_attention)
    reference = _apply(model, params, tokens)
    m.setattr(lsh.LSHAttention, 'attend',
              lambda self, *a, **kw: _bucket_attention(self, *a, **kw, restrict=False))
    causal = _apply(model, params, tokens)
  np.testing.assert_allclose(decoded, reference, rtol=1e-5, atol=2e-5)
  # The reference can fail: the buckets matter, and so do the chunks of the forward pass.
  assert not np.allclose(reference, causal, atol=1e-3)
  assert not np.allclose(decoded, chunked, atol=1e-3)
  # Up to the first chunk boundary no chunk cuts a bucket: the chunked forward agrees there.
  np.testing.assert_allclose(decoded[:, :4], chunked[:, :4], rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize('n_hashes, n_buckets', [(1, 4), (2, 4), (3, 2), (2, 1)])
def test_cached_buckets_are_the_hash_of_the_cached_keys(n_hashes, n_buckets):
  model, params = _model(n_hashes, n_buckets)  # One chunk: every layer's q as decoded.
  tokens = _tokens(length=13)
  p = tokens.shape[1]
  cache, _ = _stepped_cache(model, params, tokens)
  forward = _forward_buckets(model, params, tokens)
  rotations = lsh.eval_rotations(n_hashes, model.config.head_dim, n_buckets)
  used = set()
  for i in range(model.config.n_layers):
    layer = cache[f'block_{i}']['attention']
    keys, buckets = np.asarray(layer['key']), np.asarray(layer['bucket'])
    b, h, _, d = keys.shape
    assert keys.shape == layer['value'].shape == (2, 2, MAX_LEN, d)
    assert buckets.shape == (2, 2, n_hashes, MAX_LEN) and buckets.dtype == np.int32
    np.testing.assert_allclose(np.linalg.norm(keys[:, :, :p], axis=-1), 1.0, rtol=1e-5)
    want = (np.zeros((b, h, n_hashes, p), np.int32) if n_buckets == 1 else
            np.asarray(lsh.hash_buckets(jnp.swapaxes(keys[:, :, :p], 1, 2), rotations)))
    np.testing.assert_array_equal(buckets[..., :p], want)
    np.testing.assert_array_equal(buckets[..., :p], forward[i])
    # The empty slots: no bucket, no position, zero keys and values.
    np.testing.assert_array_equal(buckets[..., p:], -1)
    np.testing.assert_array_equal(layer['position'], np.r_[np.arange(p), np.full(MAX_LEN - p, -1)])
    assert not np.any(keys[:, :, p:]) and not np.any(np.asarray(layer['value'])[:, :, p:])
    assert int(layer['index']) == p
    used |= set(np.unique(buckets[..., :p]).tolist())
  assert len(used) == n_buckets  # Every bucket in use: the hash is not degenerate.


def test_cache_bytes_count_the_keys_and_values_of_every_position():
  model, params = _model(2, 4, n_layers=3)
  cache = decode.init_cache(model, params, 1)
  d = model.config.head_dim
  assert decode.cache_bytes(cache) == 3 * 2 * model.config.n_heads * MAX_LEN * d * 4
  dense, dense_params = _model(attention='dense', n_layers=3)
  assert decode.cache_bytes(cache) == decode.cache_bytes(decode.init_cache(dense, dense_params, 1))


def test_the_prompt_is_read_token_by_token():
  """No prefill_cache: decode.generate starts at position 0 (with chunks shorter than the
  prompt a prefill's chunked forward pass would not be what the decoding steps compute)."""
  model, params = _model(2, 4, chunk_len=4)
  assert not attention.traits.of('lsh').can_prefill() and not decode.can_prefill(model.config)
  with pytest.raises(NotImplementedError, match='no prefill_cache'):
    decode.prefill(model, params, decode.init_cache(model, params, 2), _tokens(length=8))
  prompts = _tokens(length=8, seed=2)
  tokens, _ = decode.generate(model, params, prompts, [8, 8], 6, jax.random.key(0),
                              temperature=0.0)
  np.testing.assert_array_equal(
      tokens, decode.sample(model, params, prompts, 6, jax.random.key(0), temperature=0.0))


def test_a_scanned_stack_and_its_unrolled_copy_evaluate_alike():
  """The evaluation rotations do not follow the layer index (a scanned stack gives every layer
  index 0): decode.unrolled keeps an LSH model's values, so generate decodes what the
  scanned forward pass computes."""
  model, params = _model(2, 4, stack='scan')
  flat, flat_params = decode.unrolled(model, params)
  tokens = _tokens()
  np.testing.assert_allclose(_apply(flat, flat_params, tokens), _apply(model, params, tokens),
                             rtol=1e-5, atol=1e-5)
