"""Blocked attention as loops: a program whose size does not depend on the sequence length.

Every plain-JAX blocked path (dense's causal blocks, the static patterns' block-sparse layout,
adaptive span, Transformer-XL, selective attention) computes softmax attention one query block
at a time over the key chunks that block can see. Written as a Python loop, the program holds
one copy of the block's computation per block and grows with n (a few MB of HLO at 4K,
minutes of compile at the papers' 8K-64K). Here the query blocks are a `lax.map` and each
block's key chunks a `lax.fori_loop` with an online softmax (running max m, sum l and
unnormalized output, as in flash attention), so the program is the same at every length.

Which keys a query block reads comes from a `Table` built once on the host: per query block,
a few arithmetic progressions of chunk start positions (a causal row is one progression, a
row of the fixed pattern's summary blocks one per summary sub-block), padded to the row with
the most progressions, as splash's mask info pads to the row with the most blocks. The loop
runs only over the chunks a row has (a dynamic trip count), so the work follows the pattern.

A dynamic trip count cannot be differentiated by reverse-mode autodiff, and differentiating
through the forward would store every block's probabilities (memory n^2). The backward is a
custom VJP that recomputes each chunk's scores from q, k and the row's log-sum-exp (flash
attention's backward): memory and program size stay linear, resp. flat, in n. Where a query
block reads all its keys in one step (adaptive span), the forward may keep its weights
instead (`keep_weights`, see KEEP_PAIRS), and the backward skips the scores' recomputation.

What differs between variants is the score of a (query block, key chunk) pair, given as a
function `score(params, q_blk, k_blk, i, j) -> (logits, live, gate)`: the scaled logits, which
pairs the variant allows, and an optional multiplicative weight on the pair (adaptive span's
soft mask). Its gradients with respect to the queries, keys and `params` (relative position
embeddings, spans) come from `jax.vjp` of that function inside the backward loop, so a variant
writes only its forward score.

A score may also depend on the queries before its block, through a state per key carried
across the query blocks in order (`attention(carry=...)`; selective attention's F, the column
sums of S over the earlier queries): the score reads the state at its keys and returns its
increment there. The query blocks then run as a `lax.scan` carrying the state instead of a
`lax.map` (without a state the program is unchanged). The backward runs the blocks from the
last to the first and carries the state's gradient back: a step takes it at its keys as the
cotangent of its increment, and adds the gradient of the state it read. The state each
block read is kept by the forward: (n / q_block) x keys floats per row, 1 / q_block of the
scores' size; recomputing it would cost a pass over the earlier blocks.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import itertools
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu

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


class Context(NamedTuple):
  """What a score with a carried state (`attention(carry=...)`) reads besides its step's
  queries and keys: the state couples the pairs of different queries, so such a score must
  know which pairs count and where documents start before it sums over queries.

  Attributes:
    carried: (batch, C, ...) the state at the step's keys: the initial value plus the
      increments the earlier query blocks returned for these keys.
    real: (batch, B, C) bool: the key is one of the row's keys, in the query's document (the
      engine masks the logits with it too).
    starts: (batch, C) bool: the key is the first of its document (a packed row's <BOS>).
  """
  carried: jax.Array
  real: jax.Array
  starts: jax.Array


def document_starts(segment_ids):
  """(batch, n) bool: the position starts a document (its segment id differs from the
  previous position's; position 0 always starts one): a packed row's <BOS>."""
  prev = jnp.pad(segment_ids[:, :-1], ((0, 0), (1, 0)), constant_values=-1)
  return segment_ids != prev


def head_einsum(subscripts: str, a, b, **kwargs):
  """jnp.einsum of two (batch, heads, ...) tiles pair by pair of (batch, head), e.g.
  'bhqd,bhkd->bhqk'. Inside the fused Pallas kernel the two axes are merged into one: Mosaic
  (the TPU Pallas compiler) takes a matmul with one batch dimension. Here it is the einsum as
  written (the programs of this engine stay as they were measured)."""
  if not inside_kernel():
    return jnp.einsum(subscripts, a, b, **kwargs)
  lhs, rest = subscripts.split(',')
  rhs, out = rest.split('->')
  if not lhs.startswith('bh') or not rhs.startswith('bh') or not out.startswith('bh'):
    raise ValueError(f'head_einsum takes (batch, heads, ...) operands, got {subscripts!r}')
  if inside_triton_kernel():
    # A Triton tile is one row and one head, and Triton's matmul has no batch dimension.
    if a.shape[:2] != (1, 1) or b.shape[:2] != (1, 1):
      raise ValueError(f'inside the Triton kernel a tile is one row and head, got {a.shape} '
                       f'and {b.shape}')
    plain = _tile_matmul(f'{lhs[2:]},{rhs[2:]}->{out[2:]}', a.reshape(a.shape[2:]),
                         b.reshape(b.shape[2:]),
                         precision=kwargs.get('precision') or _triton_precision())
    return plain.reshape((1, 1) + plain.shape)
  lead = a.shape[:2]
  merged = jnp.einsum(f'z{lhs[2:]},z{rhs[2:]}->z{out[2:]}', a.reshape((-1,) + a.shape[2:]),
                      b.reshape((-1,) + b.shape[2:]), **kwargs)
  return merged.reshape(lead + merged.shape[1:])


def _tile_matmul(subscripts: str, a, b, precision=None):
  """A two-dimensional einsum with one contracted index ('qd,kd->qk', 'qk,kd->qd', ...) as
  one matmul with float32 results, for the Triton kernel: see _matmul."""
  lhs, rest = subscripts.split(',')
  rhs, out = rest.split('->')
  shared = set(lhs) & set(rhs)
  if len(lhs) != 2 or len(rhs) != 2 or len(shared) != 1 or shared & set(out):
    raise ValueError(f'the Triton kernel multiplies two matrices over one index, got '
                     f'{subscripts!r}')
  (x,) = shared
  contract = (lhs.index(x), rhs.index(x))
  if out == lhs.replace(x, '') + rhs.replace(x, ''):
    return _matmul(a, b, contract, precision)
  return _matmul(b, a, contract[::-1], precision)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2, 3))
def _matmul(a, b, contract, precision):
  """a times b (two matrices) over axes `contract` (one of a, one of b): (a's other axis, b's
  other axis) float32.

  Triton's matmul takes operands of one type, and autodiff of this product would multiply the
  float32 cotangent by a bfloat16 operand. The JVP below writes each tangent's product in the
  operands' type, then float32: its transpose, the VJP, casts the cotangent to the operands'
  type before the matmul, as flash attention's backward casts dS before dS K. (A custom_jvp,
  not a custom_vjp: Pallas Triton lowers the first, in the forward kernel, not the second.)"""
  return jax.lax.dot_general(a, b, ((contract[:1], contract[1:]), ((), ())),
                             precision=precision, preferred_element_type=jnp.float32)


@_matmul.defjvp
def _matmul_jvp(contract, precision, primals, tangents):
  a, b = primals
  da, db = tangents
  dims = ((contract[:1], contract[1:]), ((), ()))
  # Each product in its first operand's dtype (the other cast to it), then float32.
  dot = lambda x, y: jax.lax.dot_general(x, y.astype(x.dtype), dims,  # noqa: E731
                                         precision=precision).astype(jnp.float32)
  return _matmul(a, b, contract, precision), dot(da, b) + dot(a, db)


# What computes `attention`: these loops in plain JAX ('xla'), or the fused Pallas kernels
# (Mosaic for a TPU and interpret mode on a CPU: 'pallas'; Triton for a GPU: 'pallas_gpu').
KERNELS = ('xla', 'pallas', 'pallas_gpu')
# kernel name -> its `attention` (same arguments). pallas_kernel.py and pallas_gpu.py, which
# build on this module, register themselves when imported (models/attention/dispatch.py
# imports them).
_KERNEL_CALLS: dict[str, Callable] = {}


def register_kernel(name: str, call: Callable) -> None:
  """Makes `attention(kernel=name)` run `call`."""
  if name not in KERNELS:
    raise ValueError(f'unknown engine kernel {name!r}; known: {", ".join(KERNELS)}')
  _KERNEL_CALLS[name] = call


def attention(q, k, v, q_segments, k_segments, params, *, table: Table, q_block: int,
              score: Callable, dtype, per_step: int = 1, out_dtype=None, carry=None,
              keep_weights: int = 0, devices: int = 1, kernel: str = 'xla',
              interpret=False, param_axes=None, distance_origin: int = 0):
  """softmax attention of every query block over the key chunks `table` gives it.

  Args:
    q: (batch, heads, n, head_dim) queries, head-major; or a tuple of such arrays when the
      score uses several query projections (Transformer-XL's content and position queries).
    k, v: (batch, heads, keys, head_dim); k may also be a tuple of arrays (batch, any, keys,
      any) when the score uses several key projections (selective's selection form).
    q_segments: (batch, n) document ids of the queries; (batch, keys) `k_segments` of the
      keys. A query never sees a key of another document.
    params: a pytree of arrays the score depends on (differentiated), or None.
    table: the key chunks of each query block of `q_block` queries.
    q_block: query block length.
    score: (params, q_blk, k_blk, i, j) -> (logits, live, gate): q_blk like q with B
      queries, k_blk like k with C keys (batch, heads, C, head_dim), i (B,) and j (C,) int32
      query and key positions; logits (batch, heads, B, C) float32, already scaled; live bool
      and gate float32 (or None: 1) broadcastable to it. A pair counts when it is live and in
      the same document; its weight is gate * exp(logit). With `carry`, see there.
    dtype: dtype of the weights fed to the value matmul and of the output.
    per_step: chunks read per loop step (more keys per matmul, fewer steps).
    out_dtype: dtype of the output if not `dtype` (float32 for parts merged afterwards).
    carry: None, or the initial value (batch, keys, ...) float32 of a state per key carried
      across the query blocks in order: query block b reads, at each key, the initial value
      plus the increments of blocks 0..b-1 (selective attention's F: the column sums of S over
      the earlier queries). The score is then
      (params, q_blk, k_blk, i, j, ctx: Context) -> (logits, live, gate, increment, rows):
      increment (batch, C, ...) is the block's addition to the state at its keys; rows
      (batch, B, C) float32 or None are per-pair values summed over the keys of the pairs
      that count into a per-query output (selective's M_i of L_mem). Both are differentiated
      like the logits.
    keep_weights: the layers of the model that call this with keep_weights (0: none). When
      every query block reads its keys in one loop step and that many layers' pairs on one
      device come to at most KEEP_PAIRS, the forward keeps each pair's exp(s - lse) for the
      backward, which then does not compute the scores again. Without `carry` only.
    devices: the devices the batch and heads are split over: one holds 1/devices of the pairs.
    kernel: 'xla' (these loops), 'pallas' (the same attention as the fused Pallas kernels of
      pallas_kernel.py, which ignore per_step and keep_weights) or 'pallas_gpu' (those of
      pallas_gpu.py, lowered by Pallas Triton: there a `carry` score's increment and rows
      read only one-head arrays, see pallas_gpu._check_state).
    interpret: with kernel='pallas', run the kernels as plain JAX (a CPU target).
    param_axes: None, or a pytree like `params` of tuples naming each parameter's axes
      ('batch', 'heads', 'queries', 'distance' or None): how the Pallas kernel slices it per
      row and splits it over a mesh (pallas_kernel.attention).
    distance_origin: the row of a 'distance' table that the pair (query 0, key 0) reads
      (relative_term's at0 is distance_origin + i[0] - j[0]): the Pallas kernel gives each
      tile only the rows its pairs reach.

  Returns:
    The output (batch, heads, n, head_dim) in `dtype` (zeros for a query that sees no key)
    and each query's log-sum-exp of its weights, log sum_j gate exp(logit) (batch, heads, n)
    float32 (NEG_INF for a query that sees no key), both differentiable: parts of a pattern
    computed apart merge exactly through it. With `carry` also the rows' sums (batch, n)
    float32, or None when the score returns none.
  """
  if q_block < 1 or per_step < 1:
    raise ValueError(f'block sizes must be >= 1, got q_block={q_block}, per_step={per_step}')
  if kernel not in KERNELS:
    raise ValueError(f'unknown engine kernel {kernel!r}; known: {", ".join(KERNELS)}')
  if kernel != 'xla':
    if kernel not in _KERNEL_CALLS:
      raise ValueError(f'the {kernel!r} engine kernel is not loaded: import '
                       'models.attention.pallas_kernel')
    return _KERNEL_CALLS[kernel](q, k, v, q_segments, k_segments, params, table=table,
                                 q_block=q_block, score=score, dtype=dtype,
                                 out_dtype=out_dtype, carry=carry, param_axes=param_axes,
                                 distance_origin=distance_origin, interpret=interpret)
  spec = _Spec(table, q_block, score, jnp.dtype(dtype), per_step,
               jnp.dtype(out_dtype or dtype), carry is not None)
  if carry is None and _short(spec, _queries(q)[0].shape[2]):
    return _plain(spec, q, k, v, q_segments, k_segments, params)
  if carry is None and keep_weights and _keeps(spec, v.shape[:2], keep_weights, devices):
    spec = dataclasses.replace(spec, keep=True)
  return _attention(spec, q, k, v, q_segments, k_segments, params, carry)


# A query block that reads all its keys in one loop step (adaptive span's blocks: their
# relative term is computed once over the block's T distances) can keep its weights from the
# forward: exp(s - lse) of each pair, one float32 (the scores' size, n T per head and row for a
# span). The backward then reads them instead of computing the score again, and the score's
# VJP alone remains (XLA drops the unused forward of q . k and of the relative term). Every
# layer's kept weights are live at once, from its forward to its backward: they are kept while
# all the layers' pairs on one device (its share of the batch and heads) come to at most
# KEEP_PAIRS (1 GiB), and recomputed beyond, so the memory of a long row or a deep model stays
# linear in its length.
KEEP_PAIRS = 1 << 28


def kept_pairs(table: Table, q_block: int, per_step: int, batch_heads: tuple[int, int],
               layers: int, devices: int) -> int:
  """The pairs whose weights `layers` layers, each of (batch, heads) = `batch_heads` over
  `table`, keep on one of the `devices` devices their batch and heads are split over."""
  rows = -(-int(np.prod(batch_heads)) // devices)
  return layers * rows * table.count.shape[0] * q_block * per_step * table.width


def _keeps(spec: _Spec, batch_heads: tuple[int, int], layers: int, devices: int) -> bool:
  """Whether the forward keeps the weights: one loop step per query block, few pairs."""
  t = spec.table
  if np.any(-(-t.chunks // spec.per_step) > 1):
    return False
  return kept_pairs(t, spec.q_block, spec.per_step, batch_heads, layers,
                    devices) <= KEEP_PAIRS


# Short rows: at most PLAIN_BLOCKS query blocks of at most PLAIN_QUERIES queries in all. There
# the loops' fixed costs (a map and a while loop per block, a backward that recomputes every
# score) outweigh what they save: the C4 recipe's d=4 train step at 512 tokens (4 blocks of
# 128) ran 5-8% slower than the unrolled code before the engine. Such rows are computed block by
# block, unrolled, each block over its keys in one piece, and differentiated by autodiff (it
# keeps each block's weights: at most PLAIN_QUERIES^2 / 2 floats per row and head for a causal
# row, as the unrolled code did). Longer rows keep the loops: their program does not grow with
# the sequence.
PLAIN_BLOCKS = 4
PLAIN_QUERIES = 512


def unrolled(blocks: int, n: int) -> bool:
  """Whether `attention` computes a row of n queries in `blocks` query blocks unrolled, by
  autodiff (a short row: see PLAIN_BLOCKS), rather than in its loops."""
  return blocks <= PLAIN_BLOCKS and n <= PLAIN_QUERIES


def _short(spec: _Spec, n: int) -> bool:
  return unrolled(spec.table.count.shape[0], n)


def _block_keys(table: Table, b: int) -> np.ndarray:
  """The key positions query block b reads, in the loop's order (host ints)."""
  runs = [table.start[b, r] + table.stride[b, r] * t + np.arange(table.width)
          for r in range(table.start.shape[1]) for t in range(int(table.count[b, r]))]
  return np.concatenate(runs) if runs else np.zeros((0,), np.int64)


def _plain(spec: _Spec, q, k, v, q_segments, k_segments, params):
  """`attention` of a short row, unrolled over its query blocks (see PLAIN_BLOCKS)."""
  n = _queries(q)[0].shape[2]
  qp, segp = _pad_queries(spec, q, q_segments)
  batch, heads, nk, d = v.shape
  outs, lses = [], []
  for b in range(spec.table.count.shape[0]):
    at = b * spec.q_block
    qb = tuple(a[:, :, at:at + spec.q_block] for a in qp)
    seg_q = segp[:, at:at + spec.q_block]
    i = jnp.arange(at, at + spec.q_block, dtype=jnp.int32)
    j = _block_keys(spec.table, b)
    valid = (j >= 0) & (j < nk)
    if not valid.any():
      outs.append(jnp.zeros((batch, heads, spec.q_block, d), spec.out_dtype))
      lses.append(jnp.full((batch, heads, spec.q_block), NEG_INF, jnp.float32))
      continue
    if np.array_equal(j, np.arange(j[0], j[0] + len(j))) and valid.all():
      take = lambda a, axis, s=slice(int(j[0]), int(j[0]) + len(j)): (  # noqa: E731
          a[(slice(None),) * axis + (s,)])
    else:
      idx = np.clip(j, 0, nk - 1)
      take = lambda a, axis, idx=idx: jnp.take(a, idx, axis=axis)  # noqa: E731
    kb = tuple(take(a, 2) for a in _queries(k))
    # The score sees the keys a loop step would (per_step chunks: a score may size what it
    # computes per key by that, as Transformer-XL's distances do), then all of them at once.
    group = spec.per_step * spec.table.width
    scored = [spec.score(params, _unwrap(q, qb), _unwrap(k, tuple(a[:, :, g:g + group]
                                                                  for a in kb)),
                         i, jnp.asarray(j[g:g + group], jnp.int32))
              for g in range(0, len(j), group)]
    logits = jnp.concatenate([x[0] for x in scored], axis=-1)
    live = jnp.concatenate([jnp.broadcast_to(x[1], x[0].shape) for x in scored], axis=-1)
    gate = (None if all(x[2] is None for x in scored) else jnp.concatenate(
        [jnp.broadcast_to(1.0 if x[2] is None else x[2], x[0].shape) for x in scored], axis=-1))
    live = (live & valid[None, None, None, :]
            & (seg_q[:, None, :, None] == take(k_segments, 1)[:, None, None, :]))
    logits = jnp.where(live, logits, NEG_INF)
    top = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    e = jnp.where(live, jnp.exp(logits - top), 0.0)
    w = e if gate is None else e * gate
    total = jnp.sum(w, axis=-1)
    out = jnp.einsum('bhqk,bhkd->bhqd', w.astype(spec.dtype), take(v, 2),
                     preferred_element_type=jnp.float32)
    seen = total > 0
    safe = jnp.where(seen, total, 1.0)
    outs.append(jnp.where(seen[..., None], out / safe[..., None], 0.0).astype(spec.out_dtype))
    lses.append(jnp.where(seen, top[..., 0] + jnp.log(safe), NEG_INF))
  out = jnp.concatenate(outs, axis=2)[:, :, :n]
  lse = jnp.concatenate(lses, axis=2)[:, :, :n]
  return out, lse


@dataclasses.dataclass(frozen=True, eq=False)
class _Spec:
  table: Table
  q_block: int
  score: Callable
  dtype: jnp.dtype
  per_step: int
  out_dtype: jnp.dtype
  stateful: bool = False
  keep: bool = False  # One loop step per block; the forward keeps exp(s - lse) (KEEP_PAIRS).


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
    self.spec, self.nk = spec, v.shape[2]
    self.per_step = spec.per_step
    self.span = spec.per_step * t.width  # Keys per step.
    self.contiguous = t.contiguous
    # Room on both sides so that a slice never leaves the array (dynamic_slice would clamp
    # its start and read other keys): chunk positions may lie before 0 or past the end.
    lo = max(0, -int(np.min(t.start, initial=0)))
    last = t.start + t.stride * np.maximum(t.count - 1, 0) + self.span
    hi = max(0, int(np.max(last, initial=0)) - self.nk)
    self.lo, self.hi = lo, hi
    pad = ((0, 0), (0, 0), (lo, hi), (0, 0))
    self.k, self.v = tuple(jnp.pad(a, pad) for a in _queries(k)), jnp.pad(v, pad)
    self.seg = jnp.pad(k_segments, ((0, 0), (lo, hi)), constant_values=-1)
    if spec.stateful:
      self.starts = self.pad_keys(document_starts(k_segments))
    self.start, self.stride, self.count = (jnp.asarray(a, jnp.int32)
                                           for a in (t.start, t.stride, t.count))
    self.first = jnp.asarray(np.cumsum(t.count, axis=1) - t.count, jnp.int32)

  def pad_keys(self, a):
    """a (batch, keys, ...) padded like the keys (a state, its gradient)."""
    return jnp.pad(a, ((0, 0), (self.lo, self.hi)) + ((0, 0),) * (a.ndim - 2))

  def unpad_keys(self, a):
    return a[:, self.lo:self.lo + self.nk]

  def positions(self, b, step):
    """(span,) key positions of loop step `step` of query block `b`, and which are real."""
    w = self.spec.table.width
    if self.contiguous:
      j = self.start[b, 0] + step * self.span + jnp.arange(self.span, dtype=jnp.int32)
      valid = jnp.arange(self.span) < (self.count[b, 0] * w - step * self.span)
    else:
      c = step * self.per_step + jnp.arange(self.per_step, dtype=jnp.int32)  # chunk numbers
      r = jnp.sum(c[:, None] >= self.first[b][None, 1:], axis=1)  # their progressions
      s = self.start[b, r] + self.stride[b, r] * (c - self.first[b, r])
      j = (s[:, None] + jnp.arange(w, dtype=jnp.int32)[None, :]).reshape(-1)
      valid = jnp.repeat(c < jnp.sum(self.count[b]), w)
    return j, valid & (j >= 0) & (j < self.nk)

  def gather(self, a, j, axis):
    """a (padded like the keys, keys on `axis`) at the positions j of a step."""
    if self.contiguous:
      return jax.lax.dynamic_slice_in_dim(a, j[0] + self.lo, self.span, axis=axis)
    # Positions past a row's chunks are masked; clipped, they read keys.
    return jnp.take(a, j + self.lo, axis=axis, mode='clip')

  def read(self, j):
    """Keys (a tuple), values and segments at positions j (from `positions`)."""
    return (tuple(self.gather(a, j, 2) for a in self.k), self.gather(self.v, j, 2),
            self.gather(self.seg, j, 1))

  def steps(self, b):
    return -(-jnp.sum(self.count[b]) // self.per_step)

  def narrowed(self, per_step: int) -> '_Keys':
    """The same keys read `per_step` chunks a step (at most spec.per_step: the padding,
    hence the accumulators' shapes, stay those of the widest step)."""
    keys = copy.copy(self)
    keys.per_step, keys.span = per_step, per_step * self.spec.table.width
    return keys

  def groups(self) -> list[tuple[np.ndarray, '_Keys']]:
    """The query blocks as groups that read as many keys a step: with spec.keep (one step per
    block) by the block's chunks rounded up to a power of two (the blocks at the start of a
    span's row read fewer keys than the widest: at 2K tokens and T = 1,024 one block in
    four), else one group."""
    nq = self.spec.table.count.shape[0]
    if not self.spec.keep:
      return [(np.arange(nq), self)]
    chunks = self.spec.table.chunks
    width = np.minimum(2 ** np.ceil(np.log2(np.maximum(chunks, 1))), self.per_step).astype(int)
    return [(np.flatnonzero(width == w), self.narrowed(int(w))) for w in np.unique(width)]

  def scatter_add(self, acc, j, update, axis=2):
    """acc (padded like the keys, keys on `axis`) + update at the positions j of a step."""
    if self.contiguous:
      at = j[0] + self.lo
      cur = jax.lax.dynamic_slice_in_dim(acc, at, self.span, axis=axis)
      return jax.lax.dynamic_update_slice_in_dim(acc, cur + update, at, axis=axis)
    return acc.at[(slice(None),) * axis + (j + self.lo,)].add(update, mode='drop')

  def context(self, state, j, real):
    """The `Context` of a step of a score with a carried state (padded like the keys)."""
    return Context(self.gather(state, j, 1), real[:, 0], self.gather(self.starts, j, 1))


def _step_keys(keys: _Keys, seg_q, b, step):
  """Loop step `step` of query block b: key positions, which of them are the row's keys,
  keys (a tuple), values, and which pairs are real (a key of the row's chunks, in the query's
  document)."""
  j, valid = keys.positions(b, step)
  kb, vb, seg_k = keys.read(j)
  real = valid[None, None, None, :] & (seg_q[:, None, :, None] == seg_k[:, None, None, :])
  return j, valid, kb, vb, real


def _at_keys(valid, x):
  """x (batch, C, ...) where the step's key is one of the row's keys, else 0: a state
  changes only at the keys the block reads (a gathered step may revisit a key past its row)."""
  return jnp.where(valid.reshape((1, -1) + (1,) * (x.ndim - 2)), x, 0.0)


def _block_inputs(spec: _Spec, q, q_segments, b):
  at = b * spec.q_block
  qb = tuple(jax.lax.dynamic_slice_in_dim(a, at, spec.q_block, axis=2) for a in q)
  seg_q = jax.lax.dynamic_slice_in_dim(q_segments, at, spec.q_block, axis=1)
  i = at + jnp.arange(spec.q_block, dtype=jnp.int32)
  return qb, seg_q, i


def _unwrap(spec_q, qb):
  return qb if isinstance(spec_q, tuple) else qb[0]


def _forward(spec: _Spec, q, k, v, q_segments, k_segments, params, carry, keep_states=False):
  """(output (b, h, n, d) in dtype, log-sum-exp (b, h, n) float32 (NEG_INF where no key),
  row sums (b, n) or None), and what the backward reads: with `keep_states` the state
  (padded like the keys) at the start of each query block, (nq, b, keys, ...); with
  spec.keep each block's exp(s - lse), a tuple over `_Keys.groups` of (blocks of the group,
  b, h, B, keys a step of the group), 0 at the pairs that do not count; else None."""
  n = _queries(q)[0].shape[2]
  qp, segp = _pad_queries(spec, q, q_segments)
  keys = _Keys(spec, k, v, k_segments)
  batch, heads, _, d = v.shape

  def block(b, state, keys=keys):
    qb, seg_q, i = _block_inputs(spec, qp, segp, b)
    kq, kk = _unwrap(q, qb), _unwrap(k, keys.k)

    def step(t, carry):
      """The loop step and its exp(logit - running max) at each pair (0 where not live)."""
      acc, m, l, state, rows = carry
      j, valid, kb, vb, real = _step_keys(keys, seg_q, b, t)
      if spec.stateful:
        ctx = keys.context(state, j, real)
        logits, live, gate, increment, row = spec.score(params, kq, _unwrap(k, kb), i, j, ctx)
        state = keys.scatter_add(state, j, _at_keys(valid, increment), axis=1)
        if row is not None:
          rows = rows + jnp.sum(jnp.where(ctx.real, row, 0.0), axis=-1)
      else:
        logits, live, gate = spec.score(params, kq, _unwrap(k, kb), i, j)
      live = live & real
      logits = jnp.where(live, logits, NEG_INF)
      m_new = jnp.maximum(m, jnp.max(logits, axis=-1))
      e = jnp.where(live, jnp.exp(logits - m_new[..., None]), 0.0)
      w = e if gate is None else e * gate
      alpha = jnp.exp(m - m_new)
      acc = acc * alpha[..., None] + jnp.einsum(
          'bhqk,bhkd->bhqd', w.astype(spec.dtype), vb, preferred_element_type=jnp.float32)
      return (acc, m_new, l * alpha + jnp.sum(w, axis=-1), state, rows), e

    rows = None
    if spec.stateful and _has_rows(spec, params, kq, kk, i, state, keys):
      rows = jnp.zeros((batch, spec.q_block), jnp.float32)
    init = (jnp.zeros((batch, heads, spec.q_block, d), jnp.float32),
            jnp.full((batch, heads, spec.q_block), NEG_INF, jnp.float32),
            jnp.zeros((batch, heads, spec.q_block), jnp.float32), state, rows)
    kept = None
    if spec.keep:
      # One step, as a loop of keys.steps(b) trips (1; 0 for a block without keys: no pair
      # counts, e = 0) rather than inlined: XLA:CPU then computes what the block's score
      # slices (a dynamic span's z of its queries, its key positions) once, before the loop,
      # and not again at every pair of the fused score. The dynamic span's layer forward at
      # 2K (batch 8, 2 heads of 64, T = 1,024): 530 ms inlined, 350 ms so.
      e0 = jnp.zeros((batch, heads, spec.q_block, keys.span), jnp.float32)
      (acc, m, l, state, rows), e = jax.lax.fori_loop(
          0, keys.steps(b), lambda t, c: step(t, c[0]), (init, e0))
      kept = e / jnp.where(l > 0, l, 1.0)[..., None]  # exp(s - m) / l = exp(s - lse)
    else:
      acc, m, l, state, rows = jax.lax.fori_loop(0, keys.steps(b),
                                                 lambda t, c: step(t, c)[0], init)
    out = jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
    lse = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), NEG_INF)
    return (out.astype(spec.out_dtype), lse, rows, kept), state

  nq = spec.table.count.shape[0]
  blocks = jnp.arange(nq, dtype=jnp.int32)
  states = None
  if spec.stateful:  # The query blocks in order, the state carried from one to the next.
    def scan_step(state, b):
      outputs, after = block(b, state)
      return after, outputs[:3] + ((state,) if keep_states else ())

    init = keys.pad_keys(carry.astype(jnp.float32))
    _, (out, lse, rows, *states) = jax.lax.scan(scan_step, init, blocks)
    states = states[0] if keep_states else None
  else:  # (nq, b, h, B, ...), a map per group; the kept weights are the backward's.
    groups = keys.groups()
    parts = [jax.lax.map(lambda b, g=g: block(b, None, g)[0], jnp.asarray(ids, jnp.int32))
             for ids, g in groups]
    out, lse = (jnp.concatenate([x[a] for x in parts]) for a in (0, 1))
    order = np.argsort(np.concatenate([ids for ids, _ in groups]))
    if np.any(order != np.arange(nq)):  # The blocks back in order (a span's are already).
      out, lse = out[order], lse[order]
    rows, states = None, tuple(x[3] for x in parts) if spec.keep else None
  out = jnp.moveaxis(out, 0, 2).reshape(batch, heads, nq * spec.q_block, d)[:, :, :n]
  lse = jnp.moveaxis(lse, 0, 2).reshape(batch, heads, nq * spec.q_block)[:, :, :n]
  if not spec.stateful:
    return (out, lse), states
  if rows is not None:
    rows = jnp.moveaxis(rows, 0, 1).reshape(batch, nq * spec.q_block)[:, :n]
  return (out, lse, rows), states


def _has_rows(spec: _Spec, params, kq, kk, i, state, keys: _Keys) -> bool:
  """Whether the stateful score returns per-pair rows (traced at the shapes of a step)."""
  batch, span = state.shape[0], keys.span

  def shape(a, *dims):
    return jax.ShapeDtypeStruct(dims, a.dtype)

  ctx = Context(shape(state, batch, span, *state.shape[2:]),
                jax.ShapeDtypeStruct((batch, spec.q_block, span), bool),
                jax.ShapeDtypeStruct((batch, span), bool))
  kb = jax.tree.map(lambda a: shape(a, *a.shape[:2], span, *a.shape[3:]), kk)
  j = jax.ShapeDtypeStruct((span,), jnp.int32)
  return jax.eval_shape(spec.score, params, kq, kb, i, j, ctx)[4] is not None


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(spec, q, k, v, q_segments, k_segments, params, carry):
  return _forward(spec, q, k, v, q_segments, k_segments, params, carry)[0]


def _attention_fwd(spec, q, k, v, q_segments, k_segments, params, carry):
  outputs, states = _forward(spec, q, k, v, q_segments, k_segments, params, carry,
                             keep_states=True)
  return outputs, (q, k, v, q_segments, k_segments, params, carry, outputs[0], outputs[1],
                   states)


def _attention_bwd(spec, residuals, cotangents):
  """Flash attention's backward: per query block, recompute each step's scores, weights
  P = gate exp(s - lse), and push dO back: dV += P^T dO; with dP = dO V^T and
  D = rowsum(dO * O), d logit = P (dP - D + d lse) and d gate = exp(s - lse) (dP - D + d lse),
  which the score's own VJP turns into gradients of the queries, keys and params.

  With a carried state the query blocks run from the last to the first with G, the gradient
  of the state a block leaves (what the later blocks made of it, padded like the keys): a
  step's score VJP takes G at its keys as the cotangent of its increment and gives the
  gradient of the state it read, which G accumulates (the state's own pass-through). The
  state a block read is the one the forward kept for it."""
  q, k, v, q_segments, k_segments, params, carry, out, lse, saved = residuals
  states = saved if spec.stateful else None
  d_out, d_lse = cotangents[:2]
  d_rows = cotangents[2] if spec.stateful else None
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
  if d_rows is not None:
    d_rows = jnp.pad(d_rows.astype(jnp.float32), ((0, 0), (0, pad)))
  keys = _Keys(spec, k, v, k_segments)
  zeros_params = jax.tree.map(jnp.zeros_like, params)
  nq = spec.table.count.shape[0]

  def block(b, carry, keys=keys, kept=None):
    dq, dk, dv, dparams, g = carry
    qb, seg_q, i = _block_inputs(spec, qp, segp, b)
    at = b * spec.q_block
    do_b, delta_b, lse_b = (jax.lax.dynamic_slice_in_dim(a, at, spec.q_block, axis=2)
                            for a in (d_out, delta, lse))
    state = None if states is None else jax.lax.dynamic_index_in_dim(states, b, 0, False)

    def step(t, inner):
      dqb, dk, dv, dparams, g = inner
      j, valid, kb, vb, real = _step_keys(keys, seg_q, b, t)
      ctx = keys.context(state, j, real) if spec.stateful else None
      outputs, vjp, live = _vjp_with_live(spec, q, k, qb, kb, params, i, j, ctx)
      logits, gate = outputs[:2]
      live = live & real
      if spec.keep:  # The forward's, 0 where not live (the logits go unused: not computed).
        e = kept
      else:
        e = jnp.where(live, jnp.exp(jnp.where(live, logits, NEG_INF) - lse_b[..., None]), 0.0)
      p = e if gate is None else e * gate
      dv_blk = jnp.einsum('bhqk,bhqd->bhkd', p.astype(spec.dtype), do_b.astype(spec.dtype),
                          preferred_element_type=jnp.float32)
      dp = jnp.einsum('bhqd,bhkd->bhqk', do_b, vb.astype(jnp.float32),
                      preferred_element_type=jnp.float32)
      g_s = dp - delta_b[..., None]
      d_logits = p * g_s
      d_gate = None if gate is None else _sum_to(jnp.where(live, e * g_s, 0.0), gate.shape)
      cot = (d_logits, d_gate)
      if spec.stateful:
        row = outputs[3]
        d_row = None if row is None else jnp.where(
            ctx.real, jax.lax.dynamic_slice_in_dim(d_rows, at, spec.q_block, 1)[..., None], 0.0)
        cot += (_at_keys(valid, keys.gather(g, j, 1)), d_row)
      dq_s, dk_s, dp_s, *d_state = vjp(cot)
      dqb = tuple(a + bq for a, bq in zip(dqb, dq_s))
      dk = tuple(keys.scatter_add(a, j, x.astype(jnp.float32)) for a, x in zip(dk, dk_s))
      dv = keys.scatter_add(dv, j, dv_blk)
      dparams = jax.tree.map(jnp.add, dparams, dp_s)
      if spec.stateful:
        g = keys.scatter_add(g, j, _at_keys(valid, d_state[0]), axis=1)
      return dqb, dk, dv, dparams, g

    dqb0 = tuple(jnp.zeros(a.shape, jnp.float32) for a in qb)
    if spec.keep:
      dqb, dk, dv, dparams, g = step(0, (dqb0, dk, dv, dparams, g))
    else:
      dqb, dk, dv, dparams, g = jax.lax.fori_loop(0, keys.steps(b), step,
                                                  (dqb0, dk, dv, dparams, g))
    dq = tuple(jax.lax.dynamic_update_slice_in_dim(a, x, at, axis=2) for a, x in zip(dq, dqb))
    return dq, dk, dv, dparams, g

  dq0 = tuple(jnp.zeros(a.shape, jnp.float32) for a in qp)
  dk0 = tuple(jnp.zeros(a.shape, jnp.float32) for a in keys.k)
  dv0 = jnp.zeros(keys.v.shape, jnp.float32)
  g0 = None if carry is None else jnp.zeros(keys.pad_keys(carry).shape, jnp.float32)
  grads = (dq0, dk0, dv0, zeros_params, g0)
  if spec.stateful:  # From the last block to the first.
    grads = jax.lax.fori_loop(0, nq, lambda r, c: block(nq - 1 - r, c), grads)
  else:
    for (ids, group), kept in zip(keys.groups(), saved or itertools.repeat(None)):
      ids = jnp.asarray(ids, jnp.int32)
      grads = jax.lax.fori_loop(0, ids.shape[0], lambda r, c, ids=ids, group=group, kept=kept: (
          block(ids[r], c, group, None if kept is None else kept[r])), grads)
  dq, dk, dv, dparams, g = grads
  dq = tuple(a[:, :, :n].astype(x.dtype) for a, x in zip(dq, _queries(q)))
  dk = tuple(a[:, :, keys.lo:keys.lo + keys.nk].astype(x.dtype) for a, x in zip(dk, _queries(k)))
  dv = dv[:, :, keys.lo:keys.lo + keys.nk].astype(v.dtype)
  d_carry = None if carry is None else keys.unpad_keys(g).astype(carry.dtype)
  return (_unwrap(q, dq), _unwrap(k, dk), dv, None, None,
          jax.tree.map(lambda a, x: a.astype(x.dtype), dparams, params), d_carry)


def _sum_to(x, shape):
  """x summed over the axes that `shape` broadcasts (the cotangent of a broadcast value).

  Leading axes (the batch of a gate shared by the rows: adaptive span's (1, heads, B, keys))
  are summed by a product with ones, at HIGHEST precision (an accelerator's default would
  round to bf16): XLA:CPU runs it as a matmul, where the reduction took a quarter of the
  learned span's layer gradient at 2K."""
  lead = x.ndim - len(shape)
  axes = tuple(range(lead)) + tuple(lead + a for a, s in enumerate(shape)
                                    if s == 1 and x.shape[lead + a] != 1)
  if not axes:
    return x.reshape(shape)
  if axes == tuple(range(len(axes))):
    rows = int(np.prod(x.shape[:len(axes)]))
    summed = jnp.dot(jnp.ones((rows,), x.dtype), x.reshape(rows, -1),
                     precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return summed.astype(x.dtype).reshape(shape)
  return jnp.sum(x, axis=axes, keepdims=True).reshape(shape)


def _vjp_with_live(spec, q, k, qb, kb, params, i, j, ctx):
  """The score's differentiated outputs ((logits, gate), with a state also (increment,
  rows)), their VJP w.r.t. (qb, kb, params[, the state read]) and live."""
  if not spec.stateful:
    def f(qb, kb, params):
      logits, live, gate = spec.score(params, _unwrap(q, qb), _unwrap(k, kb), i, j)
      return (logits, gate), live

    return jax.vjp(f, qb, kb, params, has_aux=True)

  def g(qb, kb, params, carried):
    logits, live, gate, increment, rows = spec.score(
        params, _unwrap(q, qb), _unwrap(k, kb), i, j, ctx._replace(carried=carried))
    return (logits, gate, increment, rows), live

  return jax.vjp(g, qb, kb, params, ctx.carried, has_aux=True)


_attention.defvjp(_attention_fwd, _attention_bwd)


# On an accelerator each loop step has a fixed cost (a GPU's while loop reads its trip count
# back on the host every step: about 35 us on an H200, where a 128 x 128 block's math takes
# a microsecond or two), so there the blocked paths take query blocks of at least
# ACCELERATOR_BLOCK and loop steps of at least ACCELERATOR_KEYS keys. A CPU keeps
# model.attention_block_size (128 by default), its best size there, except on dense causal
# attention's long rows (see query_block).
# Non-empty while a score traces inside the fused Pallas kernel (pallas_kernel.py): there a
# score's parameters come as the kernel gives them (per query block, distance tables
# reversed; see pallas_kernel.attention's param_axes), and the helpers below read them so.
# Each entry is the distance offset of the tile being traced (see in_kernel).
_IN_KERNEL: list = []
# The kind of kernel of each entry: 'mosaic' (pallas_kernel.py: a tile of every head, distance
# tables reversed) or 'triton' (pallas_gpu.py: a tile of one head, distance tables in order),
# with the precision of the Triton kernel's matmuls.
KERNEL_KINDS = ('mosaic', 'triton')
_KERNEL_KIND: list = []


@contextlib.contextmanager
def in_kernel(distance_offset=0, kind: str = 'mosaic', precision=None):
  """Scores traced in this context run inside the fused Pallas kernel. `distance_offset`: the
  kernel gives a distance table as the window of rows a tile reads, whose row x is the whole
  table's row x + distance_offset (relative_term subtracts it). `kind`: one of KERNEL_KINDS.
  `precision`: of a Triton kernel's matmuls where the score names none (Triton does not read
  jax_default_matmul_precision: None is TF32 for float32 operands)."""
  if kind not in KERNEL_KINDS:
    raise ValueError(f'unknown kernel kind {kind!r}; known: {", ".join(KERNEL_KINDS)}')
  _IN_KERNEL.append(distance_offset)
  _KERNEL_KIND.append((kind, precision))
  try:
    yield
  finally:
    _IN_KERNEL.pop()
    _KERNEL_KIND.pop()


def inside_kernel() -> bool:
  return bool(_IN_KERNEL)


def inside_triton_kernel() -> bool:
  """Whether a score traces inside the Triton (GPU) kernel: one (batch row, head) per tile,
  and matmuls of two dimensions only."""
  return bool(_KERNEL_KIND) and _KERNEL_KIND[-1][0] == 'triton'


def _triton_precision():
  return _KERNEL_KIND[-1][1]


# Non-empty while a score traces for one decoding step (models/attention/decoding.py): its j
# are the positions a cache's slots hold, in slot order, not a contiguous run.
_DECODING: list = []


@contextlib.contextmanager
def decoding():
  """Scores traced in this context score one decoding step's query against a cache
  (decoding.step): relative_term_at reads each pair's row by a gather, and query_rows gives a
  per-query parameter whole (the step's own)."""
  _DECODING.append(True)
  try:
    yield
  finally:
    _DECODING.pop()


def inside_decoding() -> bool:
  return bool(_DECODING)


def first(positions):
  """The first of a score's positions (i or j: a contiguous increasing run), e.g. for
  relative_term's at0. Inside the Triton kernel, which slices no value, their minimum (a
  reduction; the same number); elsewhere positions[0]."""
  if inside_triton_kernel():
    return jnp.min(positions)
  return positions[0]


def query_rows(a, i, axis: int):
  """A per-query parameter at the block's queries i (a contiguous run) along `axis`, e.g.
  dynamic spans: this engine gives a score the whole array, the Pallas kernel the block's
  slice already (param axis 'queries'; Mosaic slices no value at a traced offset), and a
  decoding step the step's own (blockloop.decoding)."""
  if inside_kernel() or inside_decoding():
    return a
  return jax.lax.dynamic_slice_in_dim(a, i[0], i.shape[0], axis=axis)


def relative_term_at(q, table, i, j, *, origin, form: str = 'shift'):
  """q_r . table[origin + i_r - j_t] at every pair (r, t): a score's relative-position term at
  its query and key positions i and j, where the table row is the pair's distance plus
  `origin` (adaptive span's p_{x-1}: origin -1; Transformer-XL's r_x: 0; plus the memory's
  length m where i counts the queries from the first current position). Rows off the table
  read zeros.

  On a training tile, whose i and j are contiguous runs, this is relative_term with
  at0 = origin + i[0] - j[0] (its forms and kernels). In a decoding step (`decoding`) the
  keys are a cache's slots, in any order: each pair's row is gathered, then multiplied by its
  query (one query reads as many table rows as it has keys, no more)."""
  if not inside_decoding():
    return relative_term(q, table, origin + first(i) - first(j), j.shape[0], form=form)
  rows = table.shape[-2]
  row = origin + i[:, None] - j[None, :]                                 # (B, keys)
  picked = jnp.take(table, jnp.clip(row, 0, rows - 1), axis=table.ndim - 2).astype(q.dtype)
  spec = 'bhqd,qkd->bhqk' if table.ndim == 2 else 'bhqd,hqkd->bhqk'
  term = jnp.einsum(spec, q, picked, preferred_element_type=jnp.float32)
  return jnp.where((row >= 0) & (row < rows), term, 0.0)


def relative_term(q, table, at0, keys: int, *, form: str = 'shift'):
  """q_r . table[at0 + r - t] at every pair (r, t) of a block of B contiguous queries and
  `keys` contiguous keys: a score's relative-position term (adaptive span's q . p_x,
  Transformer-XL's (q + v) W_R r_x), where the pair's distance fixes the row.

  In the form 'shift', without a gather, q . table is computed once for each of the B + keys - 1 rows the block spans, against the
  rows in reverse order, and each query's row of products is then shifted by its index (a
  reshape: row r of the flattened (B, B + keys - 1) products read from offset B - 1 - r). A
  gather of the products at each pair, with the scatter-add that is its gradient, made the
  dynamic span's train step at 2K tokens 1.4-1.7x that of the unrolled code before the engine.
  Rows outside the table read zeros.

  Two other forms read the products at each pair instead, over only the table rows the block
  spans (RELATIVE_FORMS): 'gather' indexes them by (batch, head, query, row) tuples, 'pairs'
  by (query, row) pairs with the batch and head axes sliced whole. Which form is right depends
  on the compiler (relative_form).

  Args:
    q: (batch, heads, B, head_dim) queries.
    table: (rows, head_dim) shared by the heads, or (heads, rows, head_dim).
    at0: the row of pair (0, 0) (traced int).
    keys: the block's keys.
    form: one of RELATIVE_FORMS.

  Returns:
    (batch, heads, B, keys) float32.
  """
  if form not in RELATIVE_FORMS:
    raise ValueError(f'unknown relative term form {form!r}; known: {", ".join(RELATIVE_FORMS)}')
  if inside_triton_kernel():
    return _selected_relative_term(q, table, at0 - _IN_KERNEL[-1], keys)
  if inside_kernel():
    return _rolled_relative_term(q, table, at0 - _IN_KERNEL[-1], keys)
  if form != 'shift':
    return _gathered_relative_term(q, table, at0, keys, pairs=form == 'pairs')
  b = q.shape[2]
  n = b + keys - 1
  rows = table.shape[-2]
  # Product column u is table row at0 + (b - 1) - u, so pair (r, t) is column b - 1 - r + t.
  # The start is clipped only where every pair lies past one end, in the zero padding.
  pad = [(0, 0)] * table.ndim
  pad[-2] = (n, n)
  padded = jnp.pad(table, pad)
  start = jnp.clip(at0 - keys + 1 + n, 0, rows + n)
  window = jnp.flip(jax.lax.dynamic_slice_in_dim(padded, start, n, axis=table.ndim - 2),
                    axis=table.ndim - 2)
  if table.ndim == 2:
    products = _table_products(q, window)
  else:
    # Per-head rows (Transformer-XL), heads first: the table's gradient then contracts the
    # cotangent's leading (batch, B) rows of each head, where (batch, heads, B) order made
    # XLA:CPU transpose it first. The term goes back to (batch, heads) order in the score's
    # fusion. Its train step at 2K: 4.7 and 4.6 s against 5.7 and 5.7 s (in-process, two
    # rounds); at 8K level (16.7 and 16.6 s against 16.1 and 14.8 s; CPU time 26.9 against 27.8).
    products = jnp.einsum('bhqd,hxd->hbqx', q, window, preferred_element_type=jnp.float32)
  flat = products.reshape(products.shape[:2] + (b * n,))
  term = flat[..., b - 1:b - 1 + b * (n - 1)].reshape(products.shape[:2] + (b, n - 1))[..., :keys]
  return term if table.ndim == 2 else jnp.swapaxes(term, 0, 1)


@jax.custom_vjp
def _table_products(q, table):
  """q . table at every row, (batch, heads, B, rows) float32, for a table (rows, head_dim)
  shared by the heads.

  Its VJP writes the table's gradient as (q^T g)^T: differentiated as written, XLA:CPU
  transposed the (B batch heads, rows) cotangent g to contract over its rows, which took 13 of
  the 20 ms of each query block's table gradient in the dynamic span's layer at 2K (batch 8,
  rows 1,279), and that layer's forward and backward 1.43 s against 1.24 s so."""
  return jnp.einsum('bhqd,xd->bhqx', q, table, preferred_element_type=jnp.float32)


def _table_products_fwd(q, table):
  return _table_products(q, table), (q, table)


def _table_products_bwd(residuals, g):
  q, table = residuals
  dq = jnp.einsum('bhqx,xd->bhqd', g, table.astype(jnp.float32),
                  preferred_element_type=jnp.float32)
  d_table = jnp.einsum('bhqd,bhqx->dx', q.astype(jnp.float32), g,
                       preferred_element_type=jnp.float32)
  return dq.astype(q.dtype), d_table.T.astype(table.dtype)


_table_products.defvjp(_table_products_fwd, _table_products_bwd)


def _gathered_relative_term(q, table, at0, keys: int, *, pairs: bool):
  """relative_term by a gather: q . table over the rows the block's pairs span (at most
  B + keys - 1 of them, clipped to the table), read at each pair."""
  b = q.shape[2]
  rows = table.shape[-2]
  n = min(b + keys - 1, rows)
  # The nearest row of the block's pairs is at0 - keys + 1; the window starts there, clipped.
  lo = jnp.clip(at0 - keys + 1, 0, rows - n)
  window = jax.lax.dynamic_slice_in_dim(table, lo, n, axis=table.ndim - 2)
  spec = 'bhqd,xd->bhqx' if table.ndim == 2 else 'bhqd,hxd->bhqx'
  products = jnp.einsum(spec, q, window, preferred_element_type=jnp.float32)
  row = at0 + jnp.arange(b)[:, None] - jnp.arange(keys)[None, :]  # (B, keys) table rows
  at = jnp.clip(row - lo, 0, n - 1)
  if pairs:
    term = products[:, :, jnp.arange(b)[:, None], at]
  else:
    term = jnp.take_along_axis(products, jnp.broadcast_to(at, products.shape[:2] + at.shape),
                               axis=-1)
  return jnp.where((row >= 0) & (row < rows), term, 0.0)


def _rolled_relative_term(q, reversed_table, at0, keys: int):
  """relative_term inside the fused Pallas kernel, where no value can be gathered, reversed or
  sliced at a traced offset. The table comes reversed and zero-padded to whole lanes, at least
  `keys` rows (param axis 'distance': pallas_kernel.attention does it outside the kernel).
  q . every row, then each query's products rolled into place by its own amount (one strided
  pltpu.roll: query r by s + r). Row u of the reversed table is distance R - 1 - u, so pair
  (r, t) at distance at0 + r - t reads column R - 1 - at0 - r + t. A pair whose distance lies
  off the table reads another product, not zero: its score must not be live (no live pair of
  adaptive span or Transformer-XL lies off its table)."""
  batch, heads, b, d = q.shape
  rows = reversed_table.shape[-2]
  if rows % 128 or rows < keys:
    raise ValueError(f'the kernel\'s relative table needs a multiple of 128 rows, at least the '
                     f'{keys} keys of a tile; got {rows}')
  table = reversed_table.astype(q.dtype)
  if table.ndim == 2:
    products = jax.lax.dot_general(q.reshape(-1, d), table, (((1,), (1,)), ((), ())),
                                   preferred_element_type=jnp.float32)
    products = products.reshape(batch, heads, b, rows)
  else:  # One table per head: the heads as the matmul's batch dimension.
    qh = jnp.swapaxes(q, 0, 1).reshape(heads, batch * b, d)
    products = jnp.einsum('hqd,hxd->hqx', qh, table, preferred_element_type=jnp.float32)
    products = jnp.swapaxes(products.reshape(heads, batch, b, rows), 0, 1)
  shift = jnp.mod(jnp.asarray(at0, jnp.int32) + 1 - rows, rows)
  return _strided_roll(products, shift)[..., :keys]


@jax.custom_vjp
def _strided_roll(x, shift):
  """x with row r of its last two axes rolled right by shift + r (pltpu.roll; in interpret
  mode and plain XLA a roll per row)."""
  return pltpu.roll(x, shift, axis=x.ndim - 1, stride=1, stride_axis=x.ndim - 2)


def _strided_roll_fwd(x, shift):
  return _strided_roll(x, shift), shift


def _strided_roll_bwd(shift, g):
  """Rolled back: row r by -(shift + r), i.e. (W - shift) + (W - 1) r modulo W."""
  width = g.shape[-1]
  back = pltpu.roll(g, jnp.mod(width - shift, width), axis=g.ndim - 1, stride=width - 1,
                    stride_axis=g.ndim - 2)
  return back, None


_strided_roll.defvjp(_strided_roll_fwd, _strided_roll_bwd)


def _selected_relative_term(q, window, at0, keys: int):
  """relative_term inside the Triton kernel (pallas_gpu.py), which has no roll, no gather and
  no slice of a value: the tile is one row and one head (q (1, 1, B, d)), and the table comes
  as the window of W rows its pairs reach, in order (at0 is the window row of pair (0, 0), so
  pair (r, t) reads window row at0 + r - t; a row off the table is zero). q . every window
  row, then pair (r, t) picks that column of its query's products by a compare with an
  iota: B x keys x W selects
  and adds, no matmul, so the kernel keeps such a tile small (pallas_gpu.RELATIVE_TILE). A
  column outside the window picks nothing: 0. Its VJP is the same selects and two matmuls."""
  b, d = q.shape[2], q.shape[3]
  rows = window.shape[-2]
  if q.shape[:2] != (1, 1) or int(np.prod(window.shape[:-2])) != 1:
    raise ValueError(f'inside the Triton kernel a tile is one row and head, got queries '
                     f'{q.shape} and a table window {window.shape}')
  products = _matmul(q.reshape(b, d), window.reshape(rows, d).astype(q.dtype), (1, 1),
                     _triton_precision())                                 # (B, W)
  r = jax.lax.broadcasted_iota(jnp.int32, (b, keys), 0)
  t = jax.lax.broadcasted_iota(jnp.int32, (b, keys), 1)
  column = (jnp.asarray(at0, jnp.int32) + r - t)[:, :, None]             # (B, keys, 1)
  u = jax.lax.broadcasted_iota(jnp.int32, (1, 1, rows), 2)
  term = jnp.sum(jnp.where(column == u, products[:, None, :], 0.0), axis=-1)
  return term.reshape(1, 1, b, keys)


# The forms of relative_term. 'shift' is a reshape, no gather; it multiplies q by every one of
# the B + keys - 1 rows a block spans. 'pairs' gathers whole (batch, heads) slices by
# (query, row) pairs: a CPU's fastest gather (take_along_axis's index tuples, one per batch row
# and head, and their scatter-add made adaptive span's train step at 512 tokens 8% slower).
# 'gather' takes those index tuples: the TPU compiler lays the gather of whole (batch, heads)
# slices out with them as its minor dimensions, and the shift's flattened products likewise
# again, so adaptive span's enwik8 layer (S = 8192, 8 rows of 8 heads a chip) needed 34 GiB
# of temporaries with 'pairs' and 7.6 GiB with 'gather' on a v5e chip (the recipe's train
# step, 45.5 against 14.2 GiB).
RELATIVE_FORMS = ('shift', 'gather', 'pairs')


def relative_form(platform: str, span: int, block: int, keys: int) -> str:
  """The form of relative_term for a block of `block` queries and `keys` keys over a table of
  `span` rows, compiled for `platform`: 'gather' on an accelerator (its memory); on a CPU
  'pairs' when the span is at most half the B + keys - 1 rows the shift multiplies q by (the
  learned span's T = 64 at init: 319 rows for 128 queries by 192 keys, and a layer's train step
  at 2K took 1.2x as long shifted), 'shift' otherwise (the fastest there)."""
  if platform != 'cpu':
    return 'gather'
  return 'pairs' if 2 * span <= block + keys - 1 else 'shift'


ACCELERATOR_BLOCK = 512
ACCELERATOR_KEYS = 1024
CPU_LONG_ROW = 4096


def query_block(platform: str, block_size: int, n: int, *, prefix: bool = False) -> int:
  """The query block of a blocked path over n queries compiled for `platform`:
  model.attention_block_size on a CPU, at least ACCELERATOR_BLOCK elsewhere, and never more
  than n (a row shorter than a block is one block of its own length, not a padded block).

  prefix: the layer's blocks read every earlier key in one pass (dense causal attention,
  selective attention), so its loop runs nq (nq + 1) / 2 steps. On a CPU such a layer takes
  blocks of twice block_size from CPU_LONG_ROW queries: with few rows a step, small blocks
  left the cores idle (the causal layer's step at 8K and 16K was 1.4-1.6x faster so; below
  4K there was no gain). Transformer-XL reads the prefix too but keeps block_size: a banded
  layer's keys grow with its block, and its 4K step was slower with larger blocks
  (docs/blocked_loops.md).
  """
  if platform != 'cpu':
    block = max(block_size, ACCELERATOR_BLOCK)
  elif prefix and n >= CPU_LONG_ROW:
    block = 2 * block_size
  else:
    block = block_size
  return max(1, min(block, n))


def step_keys(platform: str, block: int) -> int:
  """Keys a loop step of a blocked path reads on `platform`, at least (a query block's worth on
  a CPU, at least ACCELERATOR_KEYS elsewhere)."""
  return block if platform == 'cpu' else max(block, ACCELERATOR_KEYS)


def causal(q, k, v, segment_ids, *, block_size: int, scale: float, dtype, per_step: int = 1,
           **engine):
  """Causal attention by query blocks: block b reads the key blocks 0..b only, the blocks
  above the diagonal are never computed (about half of the dense work).

  Args:
    q, k, v: (batch, length, heads, head_dim).
    segment_ids: (batch, length) document ids; a query sees only earlier keys of its document.
    block_size: query and key block length.
    scale: logit multiplier.
    dtype: dtype of the weights fed to the value matmul and of the output.
    per_step: key blocks per loop step.
    **engine: `attention`'s kernel and interpret.

  Returns:
    (batch, length, heads, head_dim).
  """
  n = q.shape[1]
  if block_size < 1:
    raise ValueError(f'attention block size must be >= 1, got {block_size}')
  # A row shorter than a block is one block of its own length (query_block clips so too), not
  # a block padded to block_size.
  block_size = min(block_size, n)
  nq = -(-n // block_size)
  table = Table.runs(np.zeros(nq), np.arange(1, nq + 1), block_size)

  def score(params, qb, kb, i, j):
    del params
    logits = head_einsum('bhqd,bhkd->bhqk', qb, kb, preferred_element_type=jnp.float32)
    return logits * scale, (i[:, None] >= j[None, :])[None, None], None

  qh, kh, vh = (jnp.swapaxes(a, 1, 2) for a in (q, k, v))
  out, _ = attention(qh, kh, vh, segment_ids, segment_ids, None, table=table,
                     q_block=block_size, score=score, dtype=dtype, per_step=per_step, **engine)
  return jnp.swapaxes(out, 1, 2)
