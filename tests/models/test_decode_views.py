"""A decoding step's attention over the live part of its cache (base.over_live_slots).

* over_live_slots equals a plain softmax over the allowed slots below `live`, for caches of
  one chunk, of several, and of a size LIVE_CHUNK does not divide (the last chunk is moved
  back inside the cache and skips the slots the chunk before it took); the chunks past slot
  live - 1 are not read, and a row that may attend to nothing gives zeros.
* Decoding through the plain-JAX path (CPU kernel library off) past several chunks, with a
  capacity LIVE_CHUNK does not divide, equals the forward pass: a static pattern, LSH, and the
  variants whose decode_step runs their training score (decoding.step: adaptive and dynamic
  span over a ring that wraps, Transformer-XL, selective's per-row cache with F carried).
* The step's program does not grow with the capacity (lowering only): one chunk's attention
  in a loop, not one branch per cache view.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import decode, transformer
from models.attention import base, cpu_kernel, decoding

VOCAB = 50


@pytest.fixture
def plain_jax(monkeypatch):
  """Decoding's plain-JAX path (what accelerators run), not the CPU kernel."""
  monkeypatch.setattr(cpu_kernel, 'available', lambda: False)


def _softmax_reference(q, k, v, allowed, live, scale):
  """In float64 numpy: nothing to compile per (capacity, live)."""
  n = int(live)
  q, k, v, mask = (np.asarray(a)[..., :n, :] if a.ndim == 4 else np.asarray(a)
                   for a in (q, k, v, np.asarray(allowed)[:, :, :n]))
  q, k, v = (a.astype(np.float64) for a in (q, k, v))
  logits = np.where(mask, np.einsum('bhd,bhcd->bhc', q, k) * scale, -np.inf)
  top = np.max(logits, -1, keepdims=True)
  probs = np.where(mask, np.exp(logits - np.where(np.isfinite(top), top, 0)), 0)
  probs = probs / np.maximum(probs.sum(-1, keepdims=True), 1e-300)
  return np.einsum('bhc,bhcd->bhd', probs, v)  # Zeros where no slot is allowed.


@jax.jit
def _over_live(q, k, v, allowed, live):
  """over_live_slots with `allowed` as an argument and `live` traced: one compile per
  capacity, shared by every `live`."""
  scores = lambda logits, start, size: (  # noqa: E731
      logits, jax.lax.dynamic_slice_in_dim(allowed, start, size, axis=2))
  return base.over_live_slots(live, q, k, v, scores, scale=0.3, dtype=jnp.float32)


CHUNK = base.LIVE_CHUNK
SLOTS = [(capacity, live) for capacity in (5, CHUNK, CHUNK + 36, 3 * CHUNK + 8)
         for live in sorted({1, 3, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + 5, capacity - 1,
                             capacity})
         if 1 <= live <= capacity]


@pytest.mark.parametrize('capacity, live', SLOTS)
def test_over_live_slots_equals_the_softmax_over_the_live_slots(capacity, live):
  rng = np.random.default_rng(capacity * 1000 + live)
  b, h, d = 2, 3, 8
  q = jnp.asarray(3 * rng.standard_normal((b, h, d)), jnp.float32)
  k, v = (jnp.asarray(rng.standard_normal((b, h, capacity, d)), jnp.float32) for _ in 'kv')
  allowed = jnp.asarray(rng.random((b, h, capacity)) < 0.6).at[:, 1].set(False)
  # Slots at and past `live` are empty (not allowed); in the chunk of slot live - 1 they
  # hold values that would show if they counted, and past it NaN: those are not read.
  allowed = allowed.at[:, :, live:].set(False)
  want = _softmax_reference(q, k, v, allowed, live, 0.3)
  read = -(-live // CHUNK) * CHUNK
  k, v = (a.at[:, :, live:].set(1e4).at[:, :, read:].set(jnp.nan) for a in (k, v))
  got = _over_live(q, k, v, allowed, jnp.int32(live))
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(got[:, 1], 0)  # Head 1 may attend to nothing.


def _model(name, max_len, **extra):
  m = dict(d=0, d_model=32, n_heads=2, n_layers=1, vocab_size=VOCAB, max_len=max_len,
           attention=name, stack='unrolled', dtype='float32')
  m.update(extra)
  return transformer.Decoder(transformer.TransformerConfig.from_config(m))


# Capacity 150 (static: dense caches every position; LSH: max_len) is two chunks and a part.
LONG = 150


@pytest.mark.parametrize('name, extra', [
    ('dense', dict(attention_impl='blocksparse')),
    # One chunk (chunk_len >= the length): the forward pass attends to the whole bucket, as
    # decoding does (tests/models/test_lsh_decode.py).
    ('lsh', dict(attention_options={'lsh': dict(chunk_len=160, n_buckets=4, n_hashes=2)})),
    # The variants whose decode_step runs their training score (decoding.step): a ring of the
    # last 96 keys that wraps (two chunks, the second moved back), and a span of 58 + 8 keys.
    ('adaptive_span', dict(position_embedding='none', attention_options={
        'adaptive_span': dict(limit=96, ramp=8, init=0.6, trim_multiple=32)})),
    # (Under the suite's fast compile with YNNPACK dot fusions this case came out wrong:
    # training/xla_flags.NO_YNN_AT.)
    ('dynamic_span', dict(position_embedding='none', attention_options={
        'adaptive_span': dict(limit=96, ramp=8, trim_multiple=32),
        'dynamic_span': dict(bias=0.0)})),
    ('txl', dict(position_embedding='none',
                 attention_options={'txl': dict(mem_len=0, clamp_len=100)})),
    ('selective', {})])
def test_decoding_past_several_chunks_equals_the_forward_pass(plain_jax, monkeypatch, name,
                                                              extra):
  monkeypatch.setattr(decoding, 'STEP_CHUNK', CHUNK)  # A variant's score in chunks of 64 too.
  model = _model(name, LONG, **extra)
  tokens = jnp.asarray(np.random.default_rng(3).integers(3, VOCAB, (2, LONG)), jnp.int32)
  params = jax.jit(model.init)(jax.random.key(0), tokens)['params']  # Jitted: op by op was slower.
  full = jax.jit(model.apply)({'params': params}, tokens)
  np.testing.assert_allclose(decode.score(model, params, tokens), full, rtol=2e-5, atol=2e-5)


def _step_program_chars(model) -> int:
  """Characters of the decoding step's lowered StableHLO (shapes only, nothing computed),
  large constants elided: the static patterns' cache-plan tables (the slot of each position,
  the live slots after each step) are data of max_len entries, not program."""
  tokens = jax.ShapeDtypeStruct((1, model.config.max_len), jnp.int32)
  params = jax.eval_shape(lambda t: model.init(jax.random.key(0), t)['params'], tokens)
  cache = jax.eval_shape(lambda: decode.init_cache(model, None, 1))
  step = jax.jit(lambda p, c, tok, t: decode.step(model, p, c, tok, t))
  lowered = step.lower(params, cache, jax.ShapeDtypeStruct((1,), jnp.int32),
                       jax.ShapeDtypeStruct((), jnp.int32))
  return len(lowered.compiler_ir('stablehlo').operation.get_asm(large_elements_limit=16))


@pytest.mark.parametrize('name, small, large', [
    # Caches of 128 and 2048 slots (the same max_len: the same cache-plan tables); one cache
    # view per power of two gave 1.36x.
    ('local', dict(max_len=2048, attention_options={'local': dict(window=128)}),
     dict(max_len=2048, attention_options={'local': dict(window=2048)})),
    ('lsh', dict(max_len=128), dict(max_len=16384)),  # Was 1.73x.
    ('txl', dict(max_len=128, position_embedding='none'),
     dict(max_len=2048, position_embedding='none')),
    ('selective', dict(max_len=128), dict(max_len=2048)),
])
def test_the_step_program_does_not_grow_with_the_capacity(plain_jax, name, small, large):
  impl = dict(attention_impl='blocksparse') if name != 'lsh' else {}
  sizes = [_step_program_chars(_model(name, **impl, **kw)) for kw in (small, large)]
  assert sizes[1] <= 1.2 * sizes[0], sizes
