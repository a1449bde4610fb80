"""A decoding step's attention over its cache, through the variant's own score.

A variant's score math is written once, as the score hook of the blocked engine
(blockloop.attention's `score`: logits, liveness, an optional gate, and a carried state where
the variant has one). The engine's loops and both fused Pallas kernels run it over (query
block, key chunk) tiles; `step` below runs the same function over one query and its cache, so
a variant's `decode_step` manages only its cache (which keys it keeps, in which slots) and
never writes its scores a second time.

What differs from a training tile: the keys of a cache are not a contiguous run of
positions (a ring buffer wraps; a pruned cache keeps any subset), so the score is traced
inside `blockloop.decoding()`: its `j` are the positions the slots hold, in slot order,
`blockloop.relative_term_at` reads each pair's distance row by a gather instead of a shift,
and `blockloop.query_rows` gives a per-query parameter whole (the caller passes the step's
own). A cache whose rows hold different positions (selective attention's pruned cache) is
scored row by row (a vmap), since a score takes one `j` for the whole batch.

The work follows the text, not the cache's capacity: the slots are read a chunk at a time
(LIVE_CHUNK; STEP_CHUNK for a variant's score) with an online softmax, and the chunks past the
last live slot are not read.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from models.attention import blockloop
from models.attention.reference import NEG_INF

# The slots a decoding step reads at a time: LIVE_CHUNK, or the capacity over MAX_ROUNDS where
# that is more (a loop step on an accelerator has a fixed cost: a long cache is read in at most
# MAX_ROUNDS steps). Its work is the live slots rounded up to a multiple of the chunk, and its
# program holds one chunk's attention.
LIVE_CHUNK = 64
MAX_ROUNDS = 16
# The slots a chunk of `step` (a variant's score) holds at least. A loop trip has a fixed cost
# (a GPU's while loop reads its trip count back on the host, about 35 us on an H200), and the
# loop copies each chunk's slice of the cache where one pass reads the cache in place. On a
# CPU, the d=4 model's decoding step at batch 8 (benchmarks/decode.py's shape) over
# selective's 512 slots took 2.9-3.0 ms in one pass and 3.3-6.4 ms in chunks of 128 (60 and
# 440 tokens in); over Transformer-XL's 640, 4.2-4.4 ms against 3.0-6.9. A cache of up to
# STEP_CHUNK slots is one pass (one query's products over 8K slots are a few microseconds of
# an accelerator's bandwidth); a longer one is read in chunks of it, which bounds the step's
# temporaries (the relative term's gathered rows: a chunk's slots x d_model).
STEP_CHUNK = 8192


def over_chunks(live, capacity: int, values, chunk_scores: Callable, *, dtype, state=None,
                chunk: int = LIVE_CHUNK):
  """softmax(logits over the allowed slots) . values for one query per (row, head), a chunk of
  slots at a time (at least `chunk` slots, see LIVE_CHUNK) in a loop over the chunks that hold
  live slots, with an online softmax (a running max, sum and unnormalized output, as flash
  attention's): the program holds one chunk's attention whatever the capacity (a cache of at
  most `chunk` slots is one chunk, with no loop). Decoding is not differentiated: the loop (a
  while loop: its trip count is traced) has no reverse-mode rule.

  Args:
    live: int32 scalar, may be traced: slots >= live are empty (`chunk_scores` allows none of
      them); the loop stops at the chunk that holds slot live - 1.
    capacity: the cache's slots.
    values: (batch, heads, capacity, head_dim).
    chunk_scores: (start, size, fresh, state) -> (logits, allowed, gate, state) for the slots
      [start, start + size) (a traced start, a static size; always inside the cache): logits
      (batch, heads, size) float32, which slots may be attended to (bool, broadcastable to
      the logits), their weights' gate (float32 or None: 1) and `state` after the chunk.
      `fresh` (size,) bool: the slot is read for the first time (the last chunk of a
      capacity that `size` does not divide is moved back to end at the cache's end, and skips
      the slots the chunk before it took: it must not count them, nor add to their state).
    dtype: dtype of the (unnormalized) probabilities fed to the value matmul.
    state: a pytree carried from chunk to chunk (None: none).

  Returns:
    (batch, heads, head_dim) float32, zeros for a row that may attend to no slot; and the
    state after the last chunk.
  """
  b, h, _, d = values.shape
  size = min(capacity, max(chunk, -(-capacity // MAX_ROUNDS)))
  chunks = -(-capacity // size)

  def one(c, carry):
    top, total, out, state = carry
    first = c * size
    start = jnp.minimum(first, capacity - size)
    fresh = start + jnp.arange(size) >= first
    logits, allowed, gate, state = chunk_scores(start, size, fresh, state)
    allowed = allowed & fresh
    logits = jnp.where(allowed, logits, NEG_INF)
    new_top = jnp.maximum(top, logits.max(axis=-1))
    p = jnp.where(allowed, jnp.exp(logits - new_top[..., None]), 0)
    if gate is not None:
      p = p * gate
    fade = jnp.exp(top - new_top)  # Rescales what the earlier chunks summed.
    total = total * fade + p.sum(axis=-1)
    v = jax.lax.dynamic_slice_in_dim(values, start, size, axis=2)
    out = out * fade[..., None] + jnp.einsum('bhc,bhcd->bhd', p.astype(dtype), v,
                                             preferred_element_type=jnp.float32)
    return new_top, total, out, state

  # NEG_INF, not -inf: fade stays finite (1) while no slot has been allowed yet.
  init = (jnp.full((b, h), NEG_INF, jnp.float32), jnp.zeros((b, h), jnp.float32),
          jnp.zeros((b, h, d), jnp.float32), state)
  if chunks == 1:
    _, total, out, state = one(0, init)
  else:
    rounds = jnp.minimum((jnp.asarray(live, jnp.int32) + size - 1) // size, chunks)
    _, total, out, state = jax.lax.fori_loop(0, rounds, one, init)
  # total > 0 where a slot with a non-zero weight is allowed; out is 0 where none is.
  return out / jnp.where(total > 0, total, 1)[..., None], state


def over_live_slots(live, q, keys, values, scores, *, scale: float, dtype):
  """A decoding step's plain attention over the live part of its cache, its first `live`
  slots (the static patterns' and LSH's decoding: the allowed slots come from the caller).

  Args:
    live: int32 scalar, may be traced: slots >= live are empty (see over_chunks).
    q: (batch, heads, head_dim) the step's queries.
    keys, values: (batch, heads, capacity, head_dim) the cache.
    scores: (logits, start, size) -> (logits, allowed) for the slots [start, start + size)
      (a traced start, a static size; always inside the cache): given their float32 logits
      scale q . k, (batch, heads, size), the logits to use and which of the slots may be
      attended to (bool, broadcastable to (batch, heads, size)).
    scale: logit multiplier.
    dtype: dtype of the (unnormalized) probabilities fed to the value matmul.

  Returns:
    (batch, heads, head_dim) float32; zeros for a row that may attend to no slot.
  """
  def chunk_scores(start, size, fresh, state):
    del fresh
    k = jax.lax.dynamic_slice_in_dim(keys, start, size, axis=2)
    logits = jnp.einsum('bhd,bhcd->bhc', q, k, preferred_element_type=jnp.float32) * scale
    return (*scores(logits, start, size), None, state)

  return over_chunks(live, keys.shape[2], values, chunk_scores, dtype=dtype)[0]


def step(q, k, v, params, *, score: Callable, query_position, key_positions, live, dtype,
         carry=None):
  """One decoding step's attention through a variant's score (blockloop.attention's `score`,
  the function its training tiles run), over the cache's live slots.

  Args:
    q: (batch, heads, 1, head_dim) the step's query, or a tuple of such arrays (the queries
      the score takes: Transformer-XL's content and position queries).
    k: (batch, heads, capacity, head_dim) the cached keys, or a tuple of (batch, any,
      capacity, any) arrays (selective's separate selection keys).
    v: (batch, heads, capacity, head_dim) the cached values.
    params: the score's parameters, as blockloop.attention's (a per-query one given at the
      step's query only: blockloop.query_rows returns it whole here). With per-row
      `key_positions`, shared by the rows.
    score: (params, q, k, i, j) -> (logits, live, gate), or with `carry` (params, q, k, i, j,
      ctx) -> (logits, live, gate, increment, rows) (blockloop.attention's; `rows` is not
      used). Traced inside blockloop.decoding(): i is the step's position (1,), j the
      positions of a chunk of slots (C,), in slot order.
    query_position: int32 scalar (may be traced): the step's position, in the keys' numbering.
    key_positions: (capacity,) int32 position held by each slot (-1: empty), or (batch,
      capacity) when the rows hold different positions (each row is then scored on its own).
    live: int32 scalar (may be traced): slots >= live are empty; the chunks (STEP_CHUNK)
      past the one that holds slot live - 1 are not read.
    dtype: dtype of the weights fed to the value matmul.
    carry: None, or (state, starts): the variant's state at each slot (batch, capacity)
      float32 (selective attention's F: the column sums over the earlier queries) and whether
      the slot holds the first key of its document (batch, capacity) bool.

  Returns:
    (batch, heads, head_dim) float32, zeros for a row and head that sees no slot; with
    `carry` also the state after the step (each slot's state plus the step's increment).
  """
  if key_positions.ndim == 2:  # One score per row: its own j.
    def row(q, k, v, positions, carry):
      one = lambda a: jax.tree.map(lambda x: x[None], a)  # noqa: E731
      out = step(one(q), one(k), v[None], params, score=score, query_position=query_position,
                 key_positions=positions, live=live, dtype=dtype, carry=one(carry))
      return jax.tree.map(lambda x: x[0], out)

    return jax.vmap(row)(q, k, v, key_positions, carry)
  capacity = v.shape[2]
  i = jnp.reshape(jnp.asarray(query_position, jnp.int32), (1,))

  def chunk_scores(start, size, fresh, state):
    j = jax.lax.dynamic_slice_in_dim(key_positions, start, size)
    kb = jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, start, size, axis=2), k)
    real = j >= 0
    with blockloop.decoding():
      if carry is None:
        logits, allowed, gate = score(params, q, kb, i, j)
      else:
        carried = jax.lax.dynamic_slice_in_dim(state, start, size, axis=1)
        starts = jax.lax.dynamic_slice_in_dim(carry[1], start, size, axis=1)
        ctx = blockloop.Context(carried, jnp.broadcast_to(real, carried.shape)[:, None],
                                starts)
        logits, allowed, gate, increment, _ = score(params, q, kb, i, j, ctx)
        increment = jnp.where(real & fresh, increment, 0.0)
        state = jax.lax.dynamic_update_slice_in_dim(state, carried + increment, start, axis=1)
    first = lambda a: jnp.broadcast_to(a, logits.shape)[:, :, 0]  # noqa: E731
    gate = None if gate is None else first(gate)
    return logits[:, :, 0], first(allowed) & real, gate, state

  out, state = over_chunks(live, capacity, v, chunk_scores, dtype=dtype,
                           state=None if carry is None else carry[0].astype(jnp.float32),
                           chunk=STEP_CHUNK)
  return out if carry is None else (out, state)
