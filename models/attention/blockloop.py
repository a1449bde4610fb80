"""Blocked attention as loops: a program whose size does not depend on the sequence length.

Every plain-JAX blocked path (dense's causal blocks, the static patterns' block-sparse layout,
adaptive span, Transformer-XL) computes softmax attention one query block at a time over the
key chunks that block can see. Written as a Python loop, the program holds one copy of the
block's computation per block and grows with n (a few MB of HLO at 4K, minutes of compile at
the papers' 8K-64K). Here the query blocks are a `lax.map` and each block's key chunks a
`lax.fori_loop` with an online softmax (running max m, sum l and unnormalized output, as in
flash attention), so the program is the same at every length.

Which keys a query block reads comes from a `Table` built once on the host: per query block,
a few arithmetic progressions of chunk start positions (a causal row is one progression, a
row of the fixed pattern's summary blocks one per summary sub-block), padded to the row with
the most progressions, as splash's mask info pads to the row with the most blocks. The loop
runs only over the chunks a row has (a dynamic trip count), so the work follows the pattern.

A dynamic trip count cannot be differentiated by reverse-mode autodiff, and differentiating
through the forward would store every block's probabilities (memory n^2). The backward is a
custom VJP that recomputes each chunk's scores from q, k and the row's log-sum-exp (flash
attention's backward): memory and program size stay linear, resp. flat, in n.

What differs between variants is the score of a (query block, key chunk) pair, given as a
function `score(params, q_blk, k_blk, i, j) -> (logits, live, gate)`: the scaled logits, which
pairs the variant allows, and an optional multiplicative weight on the pair (adaptive span's
soft mask). Its gradients with respect to the queries, keys and `params` (relative position
embeddings, spans) come from `jax.vjp` of that function inside the backward loop, so a variant
writes only its forward score.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from models.attention.reference import NEG_INF


@dataclasses.dataclass(frozen=True, eq=False)
class Table:
  """The key chunks each query block reads: chunk c of query block b starts at key position
  start[b, r] + stride[b, r] * t for the t-th chunk (t < count[b, r]) of progression r.

  Attributes:
    start, stride, count: (query blocks, progressions) int arrays; unused progressions have
      count 0. Positions may lie before 0 or past the keys: such keys are masked.
    width: keys per chunk.
  """
  start: np.ndarray
  stride: np.ndarray
  count: np.ndarray
  width: int

  @property
  def chunks(self) -> np.ndarray:
    """(query blocks,) chunks each query block reads."""
    return self.count.sum(axis=1)

  @property
  def contiguous(self) -> bool:
    """Whether every row's chunks are one run of adjacent chunks (one progression of stride
    `width`): the loop then reads several chunks with one slice instead of a gather."""
    return self.start.shape[1] == 1 and bool(np.all((self.stride[:, 0] == self.width)
                                                    | (self.count[:, 0] <= 1)))

  @classmethod
  def runs(cls, start: Sequence[int], count: Sequence[int], width: int) -> 'Table':
    """One run of `count[b]` adjacent chunks from key position `start[b]` per query block."""
    start, count = (np.asarray(a, np.int64)[:, None] for a in (start, count))
    return cls(start, np.full_like(start, width), count, width)

  @classmethod
  def from_chunks(cls, chunks: Sequence[np.ndarray], width: int) -> 'Table':
    """The table of explicit chunk indices per query block (chunk c covers keys
    [c width, (c + 1) width)), each row written as the fewest progressions of one stride."""
    rows = [_progressions(np.unique(np.asarray(c, np.int64))) for c in chunks]
    r = max(1, max(len(p) for p in rows))
    table = np.zeros((3, len(rows), r), np.int64)  # start, stride, count
    for b, row in enumerate(rows):
      for k, (s, step, c) in enumerate(row):
        table[:, b, k] = s * width, step * width, c
    table[1][table[2] == 0] = width
    return cls(table[0], table[1], table[2], width)


def _progressions(blocks: np.ndarray) -> list[tuple[int, int, int]]:
  """Sorted distinct ints as (start, stride, count) progressions of one common stride, the
  stride that needs the fewest (a chain starts wherever x - stride is absent). The strides
  tried are the gaps between neighbours and from the first 32 ints to the first: a periodic
  row's period is among them."""
  if len(blocks) <= 1:
    return [(int(b), 1, 1) for b in blocks]
  candidates = np.unique(np.r_[np.diff(blocks), blocks[1:33] - blocks[0]])
  heads = [blocks[~np.isin(blocks - s, blocks)] for s in candidates]
  best = int(np.argmin([len(h) for h in heads]))
  stride, heads = int(candidates[best]), heads[best]
  # A chain from head x runs while x + c stride is present.
  count = [int(np.sum(np.isin(x + stride * np.arange(len(blocks)), blocks).cumprod()))
           for x in heads]
  return [(int(x), stride, c) for x, c in zip(heads, count)]


def attention(q, k, v, q_segments, k_segments, params, *, table: Table, q_block: int,
              score: Callable, dtype, per_step: int = 1, out_dtype=None):
  """softmax attention of every query block over the key chunks `table` gives it.

  Args:
    q: (batch, heads, n, head_dim) queries, head-major; or a tuple of such arrays when the
      score uses several query projections (Transformer-XL's content and position queries).
    k, v: (batch, heads, keys, head_dim).
    q_segments: (batch, n) document ids of the queries; (batch, keys) `k_segments` of the
      keys. A query never sees a key of another document.
    params: a pytree of arrays the score depends on (differentiated), or None.
    table: the key chunks of each query block of `q_block` queries.
    q_block: query block length.
    score: (params, q_blk, k_blk, i, j) -> (logits, live, gate): q_blk like q with B
      queries, k_blk (batch, heads, C, head_dim), i (B,) and j (C,) int32 query and key
      positions; logits (batch, heads, B, C) float32, already scaled; live bool and gate
      float32 (or None: 1) broadcastable to it. A pair counts when it is live and in the same
      document; its weight is gate * exp(logit).
    dtype: dtype of the weights fed to the value matmul and of the output.
    per_step: chunks read per loop step (more keys per matmul, fewer steps).
    out_dtype: dtype of the output if not `dtype` (float32 for parts merged afterwards).

  Returns:
    The output (batch, heads, n, head_dim) in `dtype` (zeros for a query that sees no key)
    and each query's log-sum-exp of its weights, log sum_j gate exp(logit) (batch, heads, n)
    float32 (NEG_INF for a query that sees no key), both differentiable: parts of a pattern
    computed apart merge exactly through it.
  """
  if q_block < 1 or per_step < 1:
    raise ValueError(f'block sizes must be >= 1, got q_block={q_block}, per_step={per_step}')
  spec = _Spec(table, q_block, score, jnp.dtype(dtype), per_step,
               jnp.dtype(out_dtype or dtype))
  return _attention(spec, q, k, v, q_segments, k_segments, params)


@dataclasses.dataclass(frozen=True, eq=False)
class _Spec:
  table: Table
  q_block: int
  score: Callable
  dtype: jnp.dtype
  per_step: int
  out_dtype: jnp.dtype


def _queries(q):
  return q if isinstance(q, tuple) else (q,)


def _pad_queries(spec: _Spec, q, q_segments):
  """Queries and their segments padded to whole blocks (padding rows see nothing)."""
  n = _queries(q)[0].shape[2]
  nq = spec.table.count.shape[0]
  pad = nq * spec.q_block - n
  if pad < 0:
    raise ValueError(f'the table has {nq} query blocks of {spec.q_block}, fewer than the '
                     f'{n} queries')
  q = tuple(jnp.pad(a, ((0, 0), (0, 0), (0, pad), (0, 0))) for a in _queries(q))
  return q, jnp.pad(q_segments, ((0, 0), (0, pad)), constant_values=-2)


class _Keys:
  """Reads the keys, values and key segments of a loop step: `per_step` chunks of a row."""

  def __init__(self, spec: _Spec, k, v, k_segments):
    t = spec.table
    self.spec, self.nk = spec, k.shape[2]
    self.span = spec.per_step * t.width  # Keys per step.
    self.contiguous = t.contiguous
    # Room on both sides so that a slice never leaves the array (dynamic_slice would clamp
    # its start and read other keys): chunk positions may lie before 0 or past the end.
    lo = max(0, -int(np.min(t.start, initial=0)))
    last = t.start + t.stride * np.maximum(t.count - 1, 0) + self.span
    hi = max(0, int(np.max(last, initial=0)) - self.nk)
    self.lo = lo
    pad = ((0, 0), (0, 0), (lo, hi), (0, 0))
    self.k, self.v = jnp.pad(k, pad), jnp.pad(v, pad)
    self.seg = jnp.pad(k_segments, ((0, 0), (lo, hi)), constant_values=-1)
    self.start, self.stride, self.count = (jnp.asarray(a, jnp.int32)
                                           for a in (t.start, t.stride, t.count))
    self.first = jnp.asarray(np.cumsum(t.count, axis=1) - t.count, jnp.int32)

  def positions(self, b, step):
    """(span,) key positions of loop step `step` of query block `b`, and which are real."""
    spec, w = self.spec, self.spec.table.width
    if self.contiguous:
      j = self.start[b, 0] + step * self.span + jnp.arange(self.span, dtype=jnp.int32)
      valid = jnp.arange(self.span) < (self.count[b, 0] * w - step * self.span)
    else:
      c = step * spec.per_step + jnp.arange(spec.per_step, dtype=jnp.int32)  # chunk numbers
      r = jnp.sum(c[:, None] >= self.first[b][None, 1:], axis=1)  # their progressions
      s = self.start[b, r] + self.stride[b, r] * (c - self.first[b, r])
      j = (s[:, None] + jnp.arange(w, dtype=jnp.int32)[None, :]).reshape(-1)
      valid = jnp.repeat(c < jnp.sum(self.count[b]), w)
    return j, valid & (j >= 0) & (j < self.nk)

  def read(self, j):
    """Keys, values and segments at positions j (from `positions`)."""
    if self.contiguous:
      at = j[0] + self.lo
      return (jax.lax.dynamic_slice_in_dim(self.k, at, self.span, axis=2),
              jax.lax.dynamic_slice_in_dim(self.v, at, self.span, axis=2),
              jax.lax.dynamic_slice_in_dim(self.seg, at, self.span, axis=1))
    idx = j + self.lo  # Positions past a row's chunks are masked; clipped, they read keys.
    return (jnp.take(self.k, idx, axis=2, mode='clip'), jnp.take(self.v, idx, axis=2, mode='clip'),
            jnp.take(self.seg, idx, axis=1, mode='clip'))

  def steps(self, b):
    return -(-jnp.sum(self.count[b]) // self.spec.per_step)

  def scatter_add(self, acc, j, update):
    """acc (padded like k) + update at the positions j of a step."""
    if self.contiguous:
      at = j[0] + self.lo
      cur = jax.lax.dynamic_slice_in_dim(acc, at, self.span, axis=2)
      return jax.lax.dynamic_update_slice_in_dim(acc, cur + update, at, axis=2)
    return acc.at[:, :, j + self.lo].add(update, mode='drop')


def _step_keys(keys: _Keys, seg_q, b, step):
  """Loop step `step` of query block b: key positions, keys, values, and which pairs are real
  (a key of the row's chunks, in the query's document)."""
  j, valid = keys.positions(b, step)
  kb, vb, seg_k = keys.read(j)
  real = valid[None, None, None, :] & (seg_q[:, None, :, None] == seg_k[:, None, None, :])
  return j, kb, vb, real


def _block_inputs(spec: _Spec, q, q_segments, b):
  at = b * spec.q_block
  qb = tuple(jax.lax.dynamic_slice_in_dim(a, at, spec.q_block, axis=2) for a in q)
  seg_q = jax.lax.dynamic_slice_in_dim(q_segments, at, spec.q_block, axis=1)
  i = at + jnp.arange(spec.q_block, dtype=jnp.int32)
  return qb, seg_q, i


def _unwrap(spec_q, qb):
  return qb if isinstance(spec_q, tuple) else qb[0]


def _forward(spec: _Spec, q, k, v, q_segments, k_segments, params):
  """(output (b, h, n, d) in dtype, log-sum-exp (b, h, n) float32; NEG_INF where no key)."""
  n = _queries(q)[0].shape[2]
  qp, segp = _pad_queries(spec, q, q_segments)
  keys = _Keys(spec, k, v, k_segments)
  batch, heads, _, d = k.shape

  def block(b):
    qb, seg_q, i = _block_inputs(spec, qp, segp, b)

    def step(t, carry):
      acc, m, l = carry
      j, kb, vb, real = _step_keys(keys, seg_q, b, t)
      logits, live, gate = spec.score(params, _unwrap(q, qb), kb, i, j)
      live = live & real
      logits = jnp.where(live, logits, NEG_INF)
      m_new = jnp.maximum(m, jnp.max(logits, axis=-1))
      e = jnp.where(live, jnp.exp(logits - m_new[..., None]), 0.0)
      w = e if gate is None else e * gate
      alpha = jnp.exp(m - m_new)
      acc = acc * alpha[..., None] + jnp.einsum(
          'bhqk,bhkd->bhqd', w.astype(spec.dtype), vb, preferred_element_type=jnp.float32)
      return acc, m_new, l * alpha + jnp.sum(w, axis=-1)

    init = (jnp.zeros((batch, heads, spec.q_block, d), jnp.float32),
            jnp.full((batch, heads, spec.q_block), NEG_INF, jnp.float32),
            jnp.zeros((batch, heads, spec.q_block), jnp.float32))
    acc, m, l = jax.lax.fori_loop(0, keys.steps(b), step, init)
    out = jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
    lse = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), NEG_INF)
    return out.astype(spec.out_dtype), lse

  nq = spec.table.count.shape[0]
  out, lse = jax.lax.map(block, jnp.arange(nq, dtype=jnp.int32))  # (nq, b, h, B, ...)
  out = jnp.moveaxis(out, 0, 2).reshape(batch, heads, nq * spec.q_block, d)[:, :, :n]
  lse = jnp.moveaxis(lse, 0, 2).reshape(batch, heads, nq * spec.q_block)[:, :, :n]
  return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(spec, q, k, v, q_segments, k_segments, params):
  return _forward(spec, q, k, v, q_segments, k_segments, params)


def _attention_fwd(spec, q, k, v, q_segments, k_segments, params):
  out, lse = _forward(spec, q, k, v, q_segments, k_segments, params)
  return (out, lse), (q, k, v, q_segments, k_segments, params, out, lse)


def _attention_bwd(spec, residuals, cotangents):
  """Flash attention's backward: per query block, recompute each step's scores, weights
  P = gate exp(s - lse), and push dO back: dV += P^T dO; with dP = dO V^T and
  D = rowsum(dO * O), d logit = P (dP - D + d lse) and d gate = exp(s - lse) (dP - D + d lse),
  which the score's own VJP turns into gradients of the queries, keys and params."""
  q, k, v, q_segments, k_segments, params, out, lse = residuals
  d_out, d_lse = cotangents
  n = _queries(q)[0].shape[2]
  qp, segp = _pad_queries(spec, q, q_segments)
  pad = qp[0].shape[2] - n
  d_out = jnp.pad(d_out.astype(jnp.float32), ((0, 0), (0, 0), (0, pad), (0, 0)))
  delta = jnp.sum(d_out * jnp.pad(out.astype(jnp.float32), ((0, 0), (0, 0), (0, pad), (0, 0))),
                  axis=-1)
  # A row without keys has no weights to push back through: exp(s - inf) = 0.
  delta = delta - jnp.pad(d_lse, ((0, 0), (0, 0), (0, pad)))
  lse = jnp.pad(jnp.where(lse > NEG_INF / 2, lse, jnp.inf), ((0, 0), (0, 0), (0, pad)),
                constant_values=jnp.inf)
  keys = _Keys(spec, k, v, k_segments)
  zeros_params = jax.tree.map(jnp.zeros_like, params)

  def block(b, carry):
    dq, dk, dv, dparams = carry
    qb, seg_q, i = _block_inputs(spec, qp, segp, b)
    at = b * spec.q_block
    do_b, delta_b, lse_b = (jax.lax.dynamic_slice_in_dim(a, at, spec.q_block, axis=2)
                            for a in (d_out, delta, lse))

    def step(t, inner):
      dqb, dk, dv, dparams = inner
      j, kb, vb, real = _step_keys(keys, seg_q, b, t)
      (logits, gate), vjp, live = _vjp_with_live(spec, q, qb, kb, params, i, j)
      live = live & real
      e = jnp.where(live, jnp.exp(jnp.where(live, logits, NEG_INF) - lse_b[..., None]), 0.0)
      p = e if gate is None else e * gate
      dv_blk = jnp.einsum('bhqk,bhqd->bhkd', p.astype(spec.dtype), do_b.astype(spec.dtype),
                          preferred_element_type=jnp.float32)
      dp = jnp.einsum('bhqd,bhkd->bhqk', do_b, vb.astype(jnp.float32),
                      preferred_element_type=jnp.float32)
      g = dp - delta_b[..., None]
      d_logits = p * g
      d_gate = None if gate is None else _sum_to(jnp.where(live, e * g, 0.0), gate.shape)
      dq_s, dk_s, dp_s = vjp((d_logits, d_gate))
      dqb = tuple(a + bq for a, bq in zip(dqb, dq_s))
      dk = keys.scatter_add(dk, j, dk_s.astype(jnp.float32))
      dv = keys.scatter_add(dv, j, dv_blk)
      dparams = jax.tree.map(jnp.add, dparams, dp_s)
      return dqb, dk, dv, dparams

    dqb0 = tuple(jnp.zeros(a.shape, jnp.float32) for a in qb)
    dqb, dk, dv, dparams = jax.lax.fori_loop(0, keys.steps(b), step, (dqb0, dk, dv, dparams))
    dq = tuple(jax.lax.dynamic_update_slice_in_dim(a, x, at, axis=2) for a, x in zip(dq, dqb))
    return dq, dk, dv, dparams

  nq = spec.table.count.shape[0]
  dq0 = tuple(jnp.zeros(a.shape, jnp.float32) for a in qp)
  dk0 = jnp.zeros(keys.k.shape, jnp.float32)
  dq, dk, dv, dparams = jax.lax.fori_loop(0, nq, block, (dq0, dk0, dk0, zeros_params))
  dq = tuple(a[:, :, :n].astype(x.dtype) for a, x in zip(dq, _queries(q)))
  nk = k.shape[2]
  dk = dk[:, :, keys.lo:keys.lo + nk].astype(k.dtype)
  dv = dv[:, :, keys.lo:keys.lo + nk].astype(v.dtype)
  return (_unwrap(q, dq), dk, dv, None, None,
          jax.tree.map(lambda a, x: a.astype(x.dtype), dparams, params))


def _sum_to(x, shape):
  """x summed over the axes that `shape` broadcasts (the cotangent of a broadcast value)."""
  lead = x.ndim - len(shape)
  axes = tuple(range(lead)) + tuple(lead + a for a, s in enumerate(shape)
                                    if s == 1 and x.shape[lead + a] != 1)
  return jnp.sum(x, axis=axes, keepdims=True).reshape(shape)


def _vjp_with_live(spec, q, qb, kb, params, i, j):
  """(logits, gate), the VJP of (logits, gate) w.r.t. (qb, kb, params), and live."""
  def f(qb, kb, params):
    logits, live, gate = spec.score(params, _unwrap(q, qb), kb, i, j)
    return (logits, gate), live

  return jax.vjp(f, qb, kb, params, has_aux=True)


_attention.defvjp(_attention_fwd, _attention_bwd)


# On an accelerator each loop step has a fixed cost (a GPU's while loop reads its trip count
# back on the host every step: about 35 us on an H200, where a 128 x 128 block's math takes
# a microsecond or two), so there the blocked paths take query blocks of at least
# ACCELERATOR_BLOCK and loop steps of at least ACCELERATOR_KEYS keys. A CPU keeps
# model.attention_block_size (128 by default), its best size there.
ACCELERATOR_BLOCK = 512
ACCELERATOR_KEYS = 1024


def query_block(platform: str, block_size: int, n: int) -> int:
  """The query block of a blocked path over n queries compiled for `platform`:
  model.attention_block_size on a CPU, at least ACCELERATOR_BLOCK elsewhere (at most n)."""
  return block_size if platform == 'cpu' else max(block_size, min(ACCELERATOR_BLOCK, n))


def step_keys(platform: str, block: int) -> int:
  """Keys a loop step of a blocked path reads on `platform`, at least (a query block's worth on
  a CPU, at least ACCELERATOR_KEYS elsewhere)."""
  return block if platform == 'cpu' else max(block, ACCELERATOR_KEYS)


def causal(q, k, v, segment_ids, *, block_size: int, scale: float, dtype, per_step: int = 1):
  """Causal attention by query blocks: block b reads the key blocks 0..b only, the blocks
  above the diagonal are never computed (about half of the dense work).

  Args:
    q, k, v: (batch, length, heads, head_dim).
    segment_ids: (batch, length) document ids; a query sees only earlier keys of its document.
    block_size: query and key block length.
    scale: logit multiplier.
    dtype: dtype of the weights fed to the value matmul and of the output.
    per_step: key blocks per loop step.

  Returns:
    (batch, length, heads, head_dim).
  """
  n = q.shape[1]
  if block_size < 1:
    raise ValueError(f'attention block size must be >= 1, got {block_size}')
  nq = -(-n // block_size)
  table = Table.runs(np.zeros(nq), np.arange(1, nq + 1), block_size)

  def score(params, qb, kb, i, j):
    del params
    logits = jnp.einsum('bhqd,bhkd->bhqk', qb, kb, preferred_element_type=jnp.float32)
    return logits * scale, (i[:, None] >= j[None, :])[None, None], None

  qh, kh, vh = (jnp.swapaxes(a, 1, 2) for a in (q, k, v))
  out, _ = attention(qh, kh, vh, segment_ids, segment_ids, None, table=table,
                     q_block=block_size, score=score, dtype=dtype, per_step=per_step)
  return jnp.swapaxes(out, 1, 2)
