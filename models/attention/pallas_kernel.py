"""One fused Pallas kernel for every score of the blocked engine (attention_impl='pallas').

blockloop.attention computes softmax attention over the key chunks a `Table` gives each query
block, with the variant's score math as a hook `score(params, q_blk, k_blk, i, j)`. Its loops
are plain JAX: every score block is written to device memory between the ops that make it.
This module computes the same thing, with the same hook, as Pallas kernels: the matmuls, the
online softmax, the block skipping and the backward run inside the kernel, and a score block
never leaves the chip's fast memory.

The kernels tile keys in aligned blocks of `key_block` positions. Which key blocks a query block
visits comes from the table (`Plan`): a host-side list per query block, prefetched as scalars
as splash does, so the grid's last axis runs only over the blocks a row can see (a step past a
row's last block repeats that block's index: no copy, no compute). Keys of a visited block that
the table does not give the row are masked with the table's own progressions, so the result
is the engine's exactly, whatever the table's chunk width.

  forward   grid (batch, query blocks, key steps): running max, sum and output per query
            block in scratch; writes the output and each query's log-sum-exp.
  backward  flash attention's: the scores are recomputed from q, k and the log-sum-exp, and
            the hook's own VJP (jax.vjp inside the kernel) turns d logits and d gate into
            gradients of q, k and the hook's parameters.
              dq      grid (batch, query blocks, key steps), dq accumulated per query block;
                      the parameters' gradient accumulates in an output block resident
                      across the whole (sequential) grid;
              dk, dv  grid (batch, key blocks, query steps) over the transposed table.
            Every sum runs in grid order: no atomics, two runs give bit-identical gradients.

A score with a carried state (selective attention's F, blockloop's `carry`) runs the query
blocks of a row in order with the state per key in scratch; its backward runs them from the
last to the first in one kernel, with the state's gradient and dk, dv resident per row.

On a CPU target the kernels run in Pallas interpret mode: what a laptop debugs is the kernel
the accelerator runs.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import PartitionSpec as P

from models.attention import blockloop, splash
from models.attention.reference import NEG_INF


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
  """The key blocks each query block visits, and its transpose, from a blockloop.Table.

  Attributes:
    q_block, key_block: queries per query block, keys per key block.
    kv: (query blocks, steps) key block of each step (a row's last repeated past its end).
    steps: (query blocks,) key blocks each query block visits.
    qs: (key blocks, steps) query blocks that visit each key block, in order (padded alike).
    q_steps: (key blocks,) how many.
    start, stride, count, width: the table's progressions (which keys a row really reads).
  """
  q_block: int
  key_block: int
  kv: np.ndarray
  steps: np.ndarray
  qs: np.ndarray
  q_steps: np.ndarray
  start: np.ndarray
  stride: np.ndarray
  count: np.ndarray
  width: int

  @property
  def q_blocks(self) -> int:
    return self.kv.shape[0]

  @property
  def key_blocks(self) -> int:
    return self.qs.shape[0]

  def visited_pairs(self) -> int:
    """(query, key) pairs of the blocks the kernel computes, per row and head."""
    return int(self.steps.sum()) * self.q_block * self.key_block


def plan(table: blockloop.Table, q_block: int, keys: int, key_block: int) -> Plan:
  """The Plan of `table` (query blocks of `q_block`) over `keys` keys in blocks of
  `key_block`."""
  nq = table.count.shape[0]
  nkb = max(1, -(-keys // key_block))
  visits = []
  for b in range(nq):
    blocks = set()
    for r in range(table.start.shape[1]):
      for t in range(int(table.count[b, r])):
        lo = int(table.start[b, r] + table.stride[b, r] * t)
        hi = min(lo + table.width, keys) - 1
        lo = max(lo, 0)
        if lo <= hi:
          blocks.update(range(lo // key_block, hi // key_block + 1))
    visits.append(sorted(blocks))
  steps = np.array([len(v) for v in visits], np.int32)
  kv = np.zeros((nq, max(1, steps.max(initial=0))), np.int32)
  for b, v in enumerate(visits):
    if v:
      kv[b, :len(v)] = v
      kv[b, len(v):] = v[-1]
  readers = [[] for _ in range(nkb)]
  for b, v in enumerate(visits):
    for c in v:
      readers[c].append(b)
  q_steps = np.array([len(r) for r in readers], np.int32)
  qs = np.zeros((nkb, max(1, q_steps.max(initial=0))), np.int32)
  for c, r in enumerate(readers):
    if r:
      qs[c, :len(r)] = r
      qs[c, len(r):] = r[-1]
  as32 = lambda a: np.asarray(a, np.int32)  # noqa: E731
  return Plan(q_block, key_block, kv, steps, qs, q_steps, as32(table.start),
              as32(table.stride), as32(table.count), table.width)


@dataclasses.dataclass(frozen=True, eq=False)
class _Spec:
  plan: Plan
  score: Callable
  dtype: jnp.dtype
  out_dtype: jnp.dtype
  keys: int               # real keys (positions >= keys are padding)
  q_tuple: bool           # the score takes a tuple of query arrays
  k_tuple: bool
  n_q: int                # arrays of queries, of keys
  n_k: int
  treedef: object         # the params' pytree
  n_params: int
  param_axes: tuple       # per parameter leaf: its axes' names (pallas_kernel.attention)
  stateful: bool
  has_rows: bool
  interpret: object
  distance_origin: int    # the distance-table row of pair (query 0, key 0)
  distance_lead: int | None = None  # zero rows `attention` put before a distance table's row
                                    # 0 to align the windows (window_rows); None: unaligned


def _tables(p: Plan):
  """The scalar-prefetched tables, in the order the kernels take them."""
  return tuple(jnp.asarray(a) for a in (p.kv, p.steps, p.qs, p.q_steps, p.start, p.stride,
                                        p.count))


_N_TABLES = 7


def _real_keys(spec: _Spec, tables, b, j):
  """(C,) bool: key positions j are keys the table gives query block b (and real keys)."""
  start, stride, count = tables[4:7]
  ok = jnp.zeros(j.shape, jnp.bool_)
  for r in range(spec.plan.start.shape[1]):
    off = j - start[b, r]
    step = stride[b, r]
    inside = (off >= 0) & (off < step * count[b, r])
    ok = ok | (inside & (jax.lax.rem(jnp.maximum(off, 0), step) < spec.plan.width))
  return ok & (j < spec.keys)


def _positions(spec: _Spec, b, c):
  """Query positions of query block b, key positions of key block c (int32)."""
  p = spec.plan
  i = b * p.q_block + jax.lax.broadcasted_iota(jnp.int32, (p.q_block,), 0)
  j = c * p.key_block + jax.lax.broadcasted_iota(jnp.int32, (p.key_block,), 0)
  return i, j


def _einsum(subscripts, a, b, **kwargs):
  """blockloop.head_einsum as inside the kernel (batch and heads merged for Mosaic)."""
  with blockloop.in_kernel():
    return blockloop.head_einsum(subscripts, a, b, **kwargs)


def _wrap(flag: bool, xs):
  return tuple(xs) if flag else xs[0]


def _pair_mask(spec, tables, b, j, seg_q_ref, seg_k_ref):
  """(1, 1, B, C) bool: pairs of real keys the table gives the block, in one document."""
  valid = _real_keys(spec, tables, b, j)
  seg_q = seg_q_ref[0, 0]                                     # (B,)
  seg_k = seg_k_ref[0, 0]                                     # (C,)
  return valid[None, None, None, :] & (seg_q[:, None] == seg_k[None, :])[None, None], valid


# A tile reads of a distance table a window that starts at a multiple of this many rows
# (lane-aligned, so that the window's products are whole lanes for the strided roll).
_WINDOW_ALIGN = 128


def window_rows(p: Plan, rows: int, aligned: bool = True) -> int:
  """Rows of a distance table of `rows` rows (a multiple of 128) that a tile reads: its
  B + C - 1 distances from a start rounded down to _WINDOW_ALIGN, or the whole table.

  `aligned`: the table is padded so that pair (query 0, key 0) reads a row at a multiple of
  _WINDOW_ALIGN (`attention` does so where it makes the windows smaller). A tile's first row
  then lies a multiple of g = gcd(B, C, 128) rows past an aligned start, at most 128 - g:
  none when both blocks are whole lanes, as compiled key blocks are (Transformer-XL's tiles
  of 512 x 256 read 768 rows, not 896). Unaligned, the first row can lie 127 rows past it."""
  slack = _WINDOW_ALIGN - (math.gcd(p.q_block, p.key_block, _WINDOW_ALIGN) if aligned else 1)
  need = p.q_block + p.key_block - 1 + slack
  return min(rows, -(-need // _WINDOW_ALIGN) * _WINDOW_ALIGN)


def _distance_lead(p: Plan, rows: int, origin: int) -> int | None:
  """Zero rows to put before a distance table of `rows` rows whose pair (0, 0) reads row
  `origin`, so that every tile's window starts aligned; None where that would not make a
  tile read fewer rows (a short table is read whole, and padding only lengthens it)."""
  lead = -origin % _WINDOW_ALIGN
  padded = -(-max(rows + lead, p.key_block) // 128) * 128
  plain = -(-max(rows, p.key_block) // 128) * 128
  if window_rows(p, padded, aligned=True) < window_rows(p, plain, aligned=False):
    return lead
  return None


def _tile_params(spec: _Spec, p_refs, b, c):
  """The hook's parameters as tile (query block b, key block c) reads them: a distance table
  (reversed, R rows) as the window of W rows its pairs reach, not whole, so a long table's
  products (B x R per head) never fill the chip (adaptive span's S = 8,192). Returns (values,
  the index each was read at, the distance offset of the window for blockloop.in_kernel)."""
  values, where, offset = [], [], 0
  for r, names in zip(p_refs, spec.param_axes):
    index = Ellipsis
    if 'distance' in names:
      axis = names.index('distance')
      rows = r.shape[axis]
      lead = spec.distance_lead or 0
      width = window_rows(spec.plan, rows, spec.distance_lead is not None)
      # The hook reads the table's own rows: row x is row x + lead of the padded table.
      offset = -lead
      if width < rows:
        # Pair (i, j) reads padded row at0 + i - j: reversed row R - 1 - at0 - i + j. The
        # tile's rows start at R - at0 - B (its last query, its first key).
        at0 = spec.distance_origin + lead + b * spec.plan.q_block - c * spec.plan.key_block
        first = jnp.maximum(rows - at0 - spec.plan.q_block, 0)
        start = jnp.minimum(jax.lax.div(first, _WINDOW_ALIGN) * _WINDOW_ALIGN, rows - width)
        start = pl.multiple_of(start, _WINDOW_ALIGN)
        index = tuple(pl.ds(start, width) if x == axis else slice(None)
                      for x in range(len(r.shape)))
        # The window as a reversed table of `width` rows holds rows from R - start - width.
        offset = rows - start - width - lead
    values.append(r[index])
    where.append(index)
  return jax.tree.unflatten(spec.treedef, values), where, offset


def _add_param_grads(dp_refs, where, dparams):
  """Adds a tile's parameter gradients at the rows it read (_tile_params' index)."""
  for r, index, x in zip(dp_refs, where, jax.tree.leaves(dparams)):
    r[index] += x.astype(jnp.float32)


def _context(carried, starts_ref, real):
  """blockloop.Context of a tile: the state at its keys (1, C), its pairs, its keys' document
  starts."""
  return blockloop.Context(carried, real[:, 0], starts_ref[0, 0][None] != 0)


# ---------------------------------------------------------------------------------------------
# Forward.


def _forward_kernel(spec: _Spec, *refs):
  tables, refs = refs[:_N_TABLES], refs[_N_TABLES:]
  kv, steps = tables[0], tables[1]
  q_refs, refs = refs[:spec.n_q], refs[spec.n_q:]
  k_refs, refs = refs[:spec.n_k], refs[spec.n_k:]
  v_ref, seg_q_ref, seg_k_ref, refs = refs[0], refs[1], refs[2], refs[3:]
  p_refs, refs = refs[:spec.n_params], refs[spec.n_params:]
  if spec.stateful:
    carry_ref, starts_ref, refs = refs[0], refs[1], refs[2:]
  out_ref, lse_ref, refs = refs[0], refs[1], refs[2:]
  if spec.stateful:
    states_ref, refs = refs[0], refs[1:]
    if spec.has_rows:
      rows_ref, refs = refs[0], refs[1:]
  m_sc, l_sc, acc_sc = refs[:3]
  state_sc = refs[3] if spec.stateful else None
  b, t = pl.program_id(1), pl.program_id(2)
  last = pl.num_programs(2) - 1

  if spec.stateful:
    @pl.when((b == 0) & (t == 0))
    def _():
      state_sc[...] = carry_ref[0]

  @pl.when(t == 0)
  def _():
    m_sc[...] = jnp.full(m_sc.shape, NEG_INF, jnp.float32)
    l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
    acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)
    if spec.stateful:
      states_ref[0, 0] = state_sc[...]
      if spec.has_rows:
        rows_ref[...] = jnp.zeros(rows_ref.shape, jnp.float32)

  @pl.when(t < steps[b])
  def _():
    c = kv[b, t]
    i, j = _positions(spec, b, c)
    real, valid = _pair_mask(spec, tables, b, j, seg_q_ref, seg_k_ref)
    qb = _wrap(spec.q_tuple, [r[...] for r in q_refs])
    kb = _wrap(spec.k_tuple, [r[...] for r in k_refs])
    params, _, offset = _tile_params(spec, p_refs, b, c)
    if spec.stateful:
      ctx = _context(state_sc[:, pl.ds(c * spec.plan.key_block, spec.plan.key_block)],
                     starts_ref, real)
      with blockloop.in_kernel(offset):
        logits, live, gate, increment, row = spec.score(params, qb, kb, i, j, ctx)
      C = spec.plan.key_block
      state_sc[:, pl.ds(c * C, C)] += jnp.where(valid[None], increment, 0.0)
      if spec.has_rows:
        rows_ref[0, 0] += jnp.sum(jnp.where(ctx.real, row, 0.0), axis=-1)[0]
    else:
      with blockloop.in_kernel(offset):
        logits, live, gate = spec.score(params, qb, kb, i, j)
    live = live & real
    logits = jnp.where(live, logits, NEG_INF)
    # Per-query statistics keep a trailing axis of 1 (queries on sublanes, as the tiles'):
    # Mosaic moves no vector between lanes and sublanes.
    m = m_sc[...]
    m_new = jnp.maximum(m, jnp.max(logits, axis=-1, keepdims=True))
    e = jnp.where(live, jnp.exp(logits - m_new), 0.0)
    w = e if gate is None else e * gate
    alpha = jnp.exp(m - m_new)
    acc_sc[...] = acc_sc[...] * alpha + _einsum(
        'bhqk,bhkd->bhqd', w.astype(spec.dtype), v_ref[...],
        preferred_element_type=jnp.float32)
    l_sc[...] = l_sc[...] * alpha + jnp.sum(w, axis=-1, keepdims=True)
    m_sc[...] = m_new

  @pl.when(t == last)
  def _():
    l = l_sc[...]
    seen = l > 0
    safe = jnp.where(seen, l, 1.0)
    out_ref[...] = jnp.where(seen, acc_sc[...] / safe, 0.0).astype(out_ref.dtype)
    lse_ref[...] = jnp.where(seen, m_sc[...] + jnp.log(safe), NEG_INF)


def _q_spec(a, p: Plan, reverse: bool = False):
  """BlockSpec of an array (batch, heads, queries, d) by query block of the grid's axis 1."""
  nq = p.q_blocks
  if reverse:
    return pl.BlockSpec((1, a.shape[1], p.q_block, a.shape[3]),
                        lambda bi, b, t, *_: (bi, 0, nq - 1 - b, 0))
  return pl.BlockSpec((1, a.shape[1], p.q_block, a.shape[3]), lambda bi, b, t, *_: (bi, 0, b, 0))


def _kv_spec(a, p: Plan, reverse: bool = False):
  """BlockSpec of keys (batch, heads, keys, d) at the key block of step t of query block b."""
  nq = p.q_blocks
  if reverse:
    return pl.BlockSpec((1, a.shape[1], p.key_block, a.shape[3]),
                        lambda bi, b, t, kv, *_: (bi, 0, kv[nq - 1 - b, t], 0))
  return pl.BlockSpec((1, a.shape[1], p.key_block, a.shape[3]),
                      lambda bi, b, t, kv, *_: (bi, 0, kv[b, t], 0))


def _whole(a):
  """BlockSpec of an array read whole at every grid step (a hook parameter)."""
  return pl.BlockSpec(a.shape, lambda *_: (0,) * a.ndim)


def _param_specs(spec: _Spec, leaves, query_block=lambda bi, b, *_: b):
  """BlockSpecs of the hook's parameters: whole, but for an axis named 'batch' the grid's
  row and for one named 'queries' the query block `query_block(*grid indices, *tables)`."""
  def one(a, names):
    if not names:
      return _whole(a)
    shape = tuple(1 if x == 'batch' else spec.plan.q_block if x == 'queries' else size
                  for x, size in zip(names, a.shape))

    def index(bi, *rest):
      at = {'batch': bi, 'queries': query_block(bi, *rest)}
      return tuple(at.get(x, 0) for x in names)
    return pl.BlockSpec(shape, index)
  return [one(a, names) for a, names in zip(leaves, spec.param_axes)]


def _init_param_grads(spec: _Spec, refs, first_of_grid, first_of_row, first_of_block):
  """Zero the parameters' gradient blocks where their accumulation starts: at the first grid
  step for a shared parameter, at each batch row's first for a per-row one, at each query
  block's first for a per-query one."""
  for r, names in zip(refs, spec.param_axes):
    first = (first_of_block if 'queries' in names else first_of_row if 'batch' in names
             else first_of_grid)

    @pl.when(first)
    def _(r=r):
      r[...] = jnp.zeros(r.shape, r.dtype)


# Scoped VMEM a kernel may take (Mosaic's default is 16 MiB): a backward step holds a few
# float32 score tiles of every head of a row (4 heads of 512 x 512 queries and keys: 21 MiB in
# the dq kernel). v5e and v6e chips have 128 MiB of VMEM, v5p 95 MiB.
VMEM_LIMIT = 64 << 20


def _matmul_flops(jaxpr) -> int:
  """FLOPs of the matmuls of a jaxpr, its inner jaxprs included."""
  total = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == 'dot_general':
      (contract, _), _ = eqn.params['dimension_numbers']
      lhs = eqn.invars[0].aval.shape
      total += 2 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[d] for d in contract)
    for value in eqn.params.values():
      for inner in (value if isinstance(value, (tuple, list)) else (value,)):
        if isinstance(inner, jax.extend.core.ClosedJaxpr):
          total += _matmul_flops(inner.jaxpr)
        elif isinstance(inner, jax.extend.core.Jaxpr):
          total += _matmul_flops(inner)
  return total


def _hook_flops(spec: _Spec, qs, ks, leaves) -> int:
  """Matmul FLOPs of one call of the score hook: one tile of one row, every head, with each
  parameter as a tile reads it (a distance table's window; one row; one query block),
  counted from the hook's own jaxpr. Which query arrays meet the keys, and what else a score
  multiplies, is the hook's business: Transformer-XL's second query array meets only the
  distance table, selective attention's separate form adds its own S."""
  p = spec.plan
  sd = jax.ShapeDtypeStruct
  tile = lambda a, length: sd((1, a.shape[1], length, a.shape[3]), a.dtype)  # noqa: E731
  params = []
  for a, names in zip(leaves, spec.param_axes):
    shape = list(a.shape)
    for axis, name in enumerate(names):
      if name == 'batch':
        shape[axis] = 1
      elif name == 'queries':
        shape[axis] = p.q_block
      elif name == 'distance':
        shape[axis] = window_rows(p, a.shape[axis], spec.distance_lead is not None)
    params.append(sd(tuple(shape), a.dtype))
  args = [jax.tree.unflatten(spec.treedef, params),
          _wrap(spec.q_tuple, [tile(a, p.q_block) for a in qs]),
          _wrap(spec.k_tuple, [tile(a, p.key_block) for a in ks]),
          sd((p.q_block,), jnp.int32), sd((p.key_block,), jnp.int32)]
  if spec.stateful:
    args.append(blockloop.Context(sd((1, p.key_block), jnp.float32),
                                  sd((1, p.q_block, p.key_block), jnp.bool_),
                                  sd((1, p.key_block), jnp.bool_)))
  with blockloop.in_kernel():
    return _matmul_flops(jax.make_jaxpr(spec.score)(*args).jaxpr)


def _cost(spec: _Spec, phase: str, qs, ks, v, leaves) -> pl.CostEstimate:
  """The kernel's cost from its block table, for XLA and the roofline (analysis/hlo_cost.py
  reads it back): FLOPs of the matmuls of the (query block, key block) tiles it visits, one
  exponential per pair, and the bytes of the blocks it reads and writes. A tile's score
  FLOPs are the hook's own (_hook_flops): its products with the keys, and a relative term's
  (q by the window of a distance table). The backward adds their gradients: the keys'
  products once more in each kernel (dS K, dS^T Q); a relative term's two gradient matmuls
  in the dq kernel (the dk, dv kernel's pallas jaxpr drops them as dead). Elementwise work of
  a hook is not counted."""
  p = spec.plan
  rows, heads = v.shape[0], v.shape[1]
  visits = int(p.steps.sum()) * rows
  hook = _hook_flops(spec, qs, ks, leaves)
  relative = sum(2 * window_rows(p, a.shape[names.index('distance')],
                                 spec.distance_lead is not None) * a.shape[-1]
                 for a, names in zip(leaves, spec.param_axes) if 'distance' in names)
  relative *= p.q_block * heads                    # q (every head) by the window, one tile
  keyed = hook - relative                          # the hook's products with the keys
  pv = 2 * p.q_block * p.key_block * v.shape[3] * heads
  flops = {'fwd': hook + pv,                       # scores, PV
           'dq': hook + pv + keyed + 2 * relative,  # scores again, dO V^T, dS K, d table, dq
           'dkv': hook + 2 * pv + keyed,           # scores again, dO V^T, P^T dO, dS^T Q
           'stateful_bwd': hook + 2 * pv + 2 * keyed + 2 * relative}[phase]
  d_q = sum(a.shape[3] * a.shape[1] for a in qs) // heads
  d_k = sum(a.shape[3] * a.shape[1] for a in ks) // heads
  d_v = v.shape[3]
  item = jnp.dtype(v.dtype).itemsize
  per_key, per_query = (d_k + d_v) * item, (d_q + d_v) * item
  once = rows * heads * (p.q_blocks * p.q_block * per_query + p.key_blocks * p.key_block * per_key)
  streamed = {'fwd': p.key_block * per_key, 'dq': p.key_block * per_key,
              'dkv': p.q_block * (per_query + d_v * item),
              'stateful_bwd': p.key_block * per_key}[phase]
  return pl.CostEstimate(flops=visits * flops,
                         transcendentals=visits * heads * p.q_block * p.key_block,
                         bytes_accessed=once + visits * heads * streamed)


def _compiler_params(sequential_axes: int):
  sem = ('parallel',) * (3 - sequential_axes) + ('arbitrary',) * sequential_axes
  return pltpu.CompilerParams(dimension_semantics=sem, vmem_limit_bytes=VMEM_LIMIT)


def _forward(spec: _Spec, qs, ks, v, seg_q, seg_k, leaves, carry, starts):
  p = spec.plan
  batch, heads, nq_pad, d = qs[0].shape
  grid = (batch, p.q_blocks, p.kv.shape[1])
  nq = p.q_blocks
  in_specs = ([_q_spec(a, p) for a in qs] + [_kv_spec(a, p) for a in ks] + [_kv_spec(v, p)]
              + [pl.BlockSpec((1, 1, p.q_block), lambda bi, b, t, *_: (bi, 0, b)),
                 pl.BlockSpec((1, 1, p.key_block), lambda bi, b, t, kv, *_: (bi, 0, kv[b, t]))]
              + _param_specs(spec, leaves))
  inputs = [*qs, *ks, v, seg_q, seg_k, *leaves]
  out_shape = [jax.ShapeDtypeStruct((batch, heads, nq_pad, d), spec.out_dtype),
               jax.ShapeDtypeStruct((batch, heads, nq_pad, 1), jnp.float32)]
  out_specs = [pl.BlockSpec((1, heads, p.q_block, d), lambda bi, b, t, *_: (bi, 0, b, 0)),
               pl.BlockSpec((1, heads, p.q_block, 1), lambda bi, b, t, *_: (bi, 0, b, 0))]
  scratch = [pltpu.VMEM((1, heads, p.q_block, 1), jnp.float32),
             pltpu.VMEM((1, heads, p.q_block, 1), jnp.float32),
             pltpu.VMEM((1, heads, p.q_block, d), jnp.float32)]
  if spec.stateful:
    nk_pad = carry.shape[-1]
    in_specs += [pl.BlockSpec((1, 1, nk_pad), lambda bi, *_: (bi, 0, 0)),
                 pl.BlockSpec((1, 1, p.key_block), lambda bi, b, t, kv, *_: (bi, 0, kv[b, t]))]
    inputs += [carry, starts]
    out_shape.append(jax.ShapeDtypeStruct((nq, batch, 1, nk_pad), jnp.float32))
    out_specs.append(pl.BlockSpec((1, 1, 1, nk_pad), lambda bi, b, t, *_: (b, bi, 0, 0)))
    if spec.has_rows:
      out_shape.append(jax.ShapeDtypeStruct((batch, 1, nq_pad), jnp.float32))
      out_specs.append(pl.BlockSpec((1, 1, p.q_block), lambda bi, b, t, *_: (bi, 0, b)))
    scratch.append(pltpu.VMEM((1, nk_pad), jnp.float32))
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=_N_TABLES, grid=grid, in_specs=in_specs, out_specs=out_specs,
      scratch_shapes=scratch)
  return pl.pallas_call(
      functools.partial(_forward_kernel, spec), grid_spec=grid_spec, out_shape=out_shape,
      compiler_params=_compiler_params(3 if spec.stateful else 1), interpret=spec.interpret,
      cost_estimate=_cost(spec, 'fwd', qs, ks, v, leaves),
      name='score_hook_attention_fwd')(*_tables(p), *inputs)


# ---------------------------------------------------------------------------------------------
# Backward.


def _score_grads(spec: _Spec, params, offset, qb, kb, vb, do, lse, delta, i, j, real, ctx=None,
                 d_increment=None, d_row=None):
  """One tile's backward: the weights P and the hook's VJP of (d logits, d gate[, d increment,
  d row]). Returns (P, dq, dk, dparams[, d state read])."""
  def f(qb, kb, params, *carried):
    qw, kw = _wrap(spec.q_tuple, qb), _wrap(spec.k_tuple, kb)
    if spec.stateful:
      logits, live, gate, increment, row = spec.score(params, qw, kw, i, j,
                                                      ctx._replace(carried=carried[0]))
      return (logits, gate, increment, row), live
    logits, live, gate = spec.score(params, qw, kw, i, j)
    return (logits, gate), live

  extra = (ctx.carried,) if spec.stateful else ()
  with blockloop.in_kernel(offset):
    outputs, vjp, live = jax.vjp(f, qb, kb, params, *extra, has_aux=True)
  logits, gate = outputs[:2]
  live = live & real
  e = jnp.where(live, jnp.exp(jnp.where(live, logits, NEG_INF) - lse), 0.0)
  p = e if gate is None else e * gate
  dp = _einsum('bhqd,bhkd->bhqk', do, vb.astype(jnp.float32),
                             preferred_element_type=jnp.float32)
  g_s = dp - delta
  d_gate = None if gate is None else blockloop._sum_to(jnp.where(live, e * g_s, 0.0),
                                                      gate.shape)
  cot = (p * g_s, d_gate)
  if spec.stateful:
    row = outputs[3]
    cot += (d_increment, None if row is None else jnp.where(ctx.real, d_row[..., None], 0.0))
  with blockloop.in_kernel(offset):
    return (p,) + tuple(vjp(cot))


class _BwdRefs(NamedTuple):
  """The inputs every backward kernel reads, in the order _bwd_inputs gives them."""
  tables: tuple
  q: tuple
  k: tuple
  v: object
  seg_q: object
  seg_k: object
  params: tuple
  do: object
  lse: object
  delta: object


def _unpack_bwd(spec: _Spec, refs):
  """(_BwdRefs, the kernel's remaining refs)."""
  tables, refs = refs[:_N_TABLES], refs[_N_TABLES:]
  q_refs, refs = refs[:spec.n_q], refs[spec.n_q:]
  k_refs, refs = refs[:spec.n_k], refs[spec.n_k:]
  v_ref, seg_q_ref, seg_k_ref, refs = refs[0], refs[1], refs[2], refs[3:]
  p_refs, refs = refs[:spec.n_params], refs[spec.n_params:]
  do_ref, lse_ref, delta_ref, refs = refs[0], refs[1], refs[2], refs[3:]
  return _BwdRefs(tables, q_refs, k_refs, v_ref, seg_q_ref, seg_k_ref, p_refs, do_ref, lse_ref,
                  delta_ref), refs


def _tile_backward(spec: _Spec, ins: _BwdRefs, b, c, state=None):
  """The backward of tile (query block b, key block c) from the refs: (dO in float32, which
  keys are the row's, where the parameters were read (_tile_params), _score_grads' outputs).
  `state(real, valid)` gives a stateful score's (ctx, d increment, d rows)."""
  i, j = _positions(spec, b, c)
  real, valid = _pair_mask(spec, ins.tables, b, j, ins.seg_q, ins.seg_k)
  params, where, offset = _tile_params(spec, ins.params, b, c)
  do = ins.do[...].astype(jnp.float32)
  extra = state(real, valid) if state is not None else ()
  grads = _score_grads(spec, params, offset, [r[...] for r in ins.q], [r[...] for r in ins.k],
                       ins.v[...], do, ins.lse[...], ins.delta[...], i, j, real, *extra)
  return do, valid, where, grads


def _zero(*refs):
  for r in refs:
    r[...] = jnp.zeros(r.shape, r.dtype)


def _dq_kernel(spec: _Spec, *refs):
  ins, refs = _unpack_bwd(spec, refs)
  dq_refs, refs = refs[:spec.n_q], refs[spec.n_q:]
  dp_refs, dq_sc = refs[:spec.n_params], refs[spec.n_params:]
  kv, steps = ins.tables[0], ins.tables[1]
  bi, b, t = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  _init_param_grads(spec, dp_refs, (bi == 0) & (b == 0) & (t == 0), (b == 0) & (t == 0), t == 0)
  pl.when(t == 0)(lambda: _zero(*dq_sc))

  @pl.when(t < steps[b])
  def _():
    _, _, where, (_, dq, _, dparams) = _tile_backward(spec, ins, b, kv[b, t])
    for s, x in zip(dq_sc, dq):
      s[...] += x.astype(jnp.float32)
    _add_param_grads(dp_refs, where, dparams)

  @pl.when(t == pl.num_programs(2) - 1)
  def _():
    for r, s in zip(dq_refs, dq_sc):
      r[...] = s[...].astype(r.dtype)


def _dkv_kernel(spec: _Spec, *refs):
  ins, refs = _unpack_bwd(spec, refs)
  dk_refs, refs = refs[:spec.n_k], refs[spec.n_k:]
  dv_ref, refs = refs[0], refs[1:]
  dk_sc, dv_sc = refs[:spec.n_k], refs[spec.n_k]
  qs, q_steps = ins.tables[2], ins.tables[3]
  c, t = pl.program_id(1), pl.program_id(2)
  pl.when(t == 0)(lambda: _zero(*dk_sc, dv_sc))

  @pl.when(t < q_steps[c])
  def _():
    do, _, _, (p, _, dk, _) = _tile_backward(spec, ins, qs[c, t], c)
    dv_sc[...] += _einsum('bhqk,bhqd->bhkd', p.astype(spec.dtype), do.astype(spec.dtype),
                          preferred_element_type=jnp.float32)
    for s, x in zip(dk_sc, dk):
      s[...] += x.astype(jnp.float32)

  @pl.when(t == pl.num_programs(2) - 1)
  def _():
    for r, s in zip((*dk_refs, dv_ref), (*dk_sc, dv_sc)):
      r[...] = s[...].astype(r.dtype)


def _stateful_bwd_kernel(spec: _Spec, *refs):
  """The query blocks of a row from the last to the first, G (the gradient of the state a
  block leaves) in scratch; dk, dv and the parameters' gradient resident."""
  ins, refs = _unpack_bwd(spec, refs)
  states_ref, starts_ref, refs = refs[0], refs[1], refs[2:]
  if spec.has_rows:
    d_rows_ref, refs = refs[0], refs[1:]
  dq_refs, refs = refs[:spec.n_q], refs[spec.n_q:]
  dk_refs, refs = refs[:spec.n_k], refs[spec.n_k:]
  dv_ref, refs = refs[0], refs[1:]
  dp_refs, refs = refs[:spec.n_params], refs[spec.n_params:]
  d_carry_ref, refs = refs[0], refs[1:]
  dq_sc, g_sc = refs[:spec.n_q], refs[spec.n_q]
  kv, steps = ins.tables[0], ins.tables[1]
  bi, r, t = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  b = spec.plan.q_blocks - 1 - r
  C = spec.plan.key_block
  _init_param_grads(spec, dp_refs, (bi == 0) & (r == 0) & (t == 0), (r == 0) & (t == 0), t == 0)
  pl.when((r == 0) & (t == 0))(lambda: _zero(*dk_refs, dv_ref, g_sc))
  pl.when(t == 0)(lambda: _zero(*dq_sc))

  @pl.when(t < steps[b])
  def _():
    c = kv[b, t]
    keys = pl.ds(c * C, C)

    def state(real, valid):
      # The state block b read (kept by the forward) at these keys; G there is the
      # cotangent of the block's increment.
      ctx = _context(states_ref[0, 0, :, keys], starts_ref, real)
      return ctx, jnp.where(valid[None], g_sc[:, keys], 0.0), (
          d_rows_ref[0] if spec.has_rows else None)

    do, valid, where, (p, dq, dk, dparams, d_state) = _tile_backward(spec, ins, b, c, state)
    g_sc[:, keys] += jnp.where(valid[None], d_state, 0.0)
    for s, x in zip(dq_sc, dq):
      s[...] += x.astype(jnp.float32)
    dv_ref[:, :, keys, :] += _einsum('bhqk,bhqd->bhkd', p.astype(spec.dtype),
                                     do.astype(spec.dtype), preferred_element_type=jnp.float32)
    for x, y in zip(dk_refs, dk):
      x[:, :, keys, :] += y.astype(jnp.float32)
    _add_param_grads(dp_refs, where, dparams)

  @pl.when(t == pl.num_programs(2) - 1)
  def _():
    for x, s in zip(dq_refs, dq_sc):
      x[...] = s[...].astype(x.dtype)

  @pl.when((r == pl.num_programs(1) - 1) & (t == pl.num_programs(2) - 1))
  def _():
    d_carry_ref[0] = g_sc[...]


def _bwd_inputs(spec, p, qs, ks, v, seg_q, seg_k, leaves, do, lse, delta, *, by_key: bool,
                reverse: bool = False):
  """in_specs and inputs shared by the backward kernels: by query block (dq, stateful) or by
  key block over the transposed table (dk, dv)."""
  nq = p.q_blocks
  if by_key:
    qspec = lambda a: pl.BlockSpec((1, a.shape[1], p.q_block, a.shape[3]),  # noqa: E731
                                   lambda bi, c, t, kv, st, qs_, *_: (bi, 0, qs_[c, t], 0))
    kspec = lambda a: pl.BlockSpec((1, a.shape[1], p.key_block, a.shape[3]),  # noqa: E731
                                   lambda bi, c, t, *_: (bi, 0, c, 0))
    rspec = pl.BlockSpec((1, do.shape[1], p.q_block, 1),
                         lambda bi, c, t, kv, st, qs_, *_: (bi, 0, qs_[c, t], 0))
    sq = pl.BlockSpec((1, 1, p.q_block), lambda bi, c, t, kv, st, qs_, *_: (bi, 0, qs_[c, t]))
    sk = pl.BlockSpec((1, 1, p.key_block), lambda bi, c, t, *_: (bi, 0, c))
  else:
    qspec = lambda a: _q_spec(a, p, reverse)  # noqa: E731
    kspec = lambda a: _kv_spec(a, p, reverse)  # noqa: E731
    qb = (lambda b: nq - 1 - b) if reverse else (lambda b: b)
    rspec = pl.BlockSpec((1, do.shape[1], p.q_block, 1),
                         lambda bi, b, t, *_: (bi, 0, qb(b), 0))
    sq = pl.BlockSpec((1, 1, p.q_block), lambda bi, b, t, *_: (bi, 0, qb(b)))
    sk = pl.BlockSpec((1, 1, p.key_block), lambda bi, b, t, kv, *_: (bi, 0, kv[qb(b), t]))
  if by_key:
    query_block = lambda bi, c, t, kv, st, qs_, *_: qs_[c, t]  # noqa: E731
  elif reverse:
    query_block = lambda bi, b, *_: nq - 1 - b  # noqa: E731
  else:
    query_block = lambda bi, b, *_: b  # noqa: E731
  in_specs = ([qspec(a) for a in qs] + [kspec(a) for a in ks] + [kspec(v), sq, sk]
              + _param_specs(spec, leaves, query_block) + [qspec(do), rspec, rspec])
  return in_specs, [*qs, *ks, v, seg_q, seg_k, *leaves, do, lse, delta]


def _backward(spec: _Spec, qs, ks, v, seg_q, seg_k, leaves, do, lse, delta):
  p = spec.plan
  batch = v.shape[0]
  in_specs, inputs = _bwd_inputs(spec, p, qs, ks, v, seg_q, seg_k, leaves, do, lse, delta,
                                 by_key=False)
  f32 = lambda a: jax.ShapeDtypeStruct(a.shape, jnp.float32)  # noqa: E731
  dq_and_params = pl.pallas_call(
      functools.partial(_dq_kernel, spec),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=_N_TABLES, grid=(batch, p.q_blocks, p.kv.shape[1]),
          in_specs=in_specs,
          out_specs=[_q_spec(a, p) for a in qs] + _param_specs(spec, leaves),
          scratch_shapes=[pltpu.VMEM((1, a.shape[1], p.q_block, a.shape[3]), jnp.float32)
                          for a in qs]),
      out_shape=[f32(a) for a in qs] + [f32(a) for a in leaves],
      compiler_params=_compiler_params(3), interpret=spec.interpret,
      cost_estimate=_cost(spec, 'dq', qs, ks, v, leaves),
      name='score_hook_attention_dq')(*_tables(p), *inputs)
  dq, dparams = dq_and_params[:spec.n_q], dq_and_params[spec.n_q:]
  in_specs, inputs = _bwd_inputs(spec, p, qs, ks, v, seg_q, seg_k, leaves, do, lse, delta,
                                 by_key=True)
  kshape = lambda a: (1, a.shape[1], p.key_block, a.shape[3])  # noqa: E731
  dkv = pl.pallas_call(
      functools.partial(_dkv_kernel, spec),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=_N_TABLES, grid=(batch, p.key_blocks, p.qs.shape[1]),
          in_specs=in_specs,
          out_specs=[pl.BlockSpec(kshape(a), lambda bi, c, t, *_: (bi, 0, c, 0))
                     for a in (*ks, v)],
          scratch_shapes=[pltpu.VMEM(kshape(a), jnp.float32) for a in (*ks, v)]),
      out_shape=[f32(a) for a in (*ks, v)],
      compiler_params=_compiler_params(1), interpret=spec.interpret,
      cost_estimate=_cost(spec, 'dkv', qs, ks, v, leaves),
      name='score_hook_attention_dkv')(*_tables(p), *inputs)
  return dq, dkv[:spec.n_k], dkv[spec.n_k], dparams, None


def _stateful_backward(spec: _Spec, qs, ks, v, seg_q, seg_k, leaves, do, lse, delta, states,
                       starts, d_rows):
  p = spec.plan
  batch, nk_pad = v.shape[0], states.shape[-1]
  nq = p.q_blocks
  in_specs, inputs = _bwd_inputs(spec, p, qs, ks, v, seg_q, seg_k, leaves, do, lse, delta,
                                 by_key=False, reverse=True)
  in_specs += [pl.BlockSpec((1, 1, 1, nk_pad), lambda bi, r, t, *_: (nq - 1 - r, bi, 0, 0)),
               pl.BlockSpec((1, 1, p.key_block),
                            lambda bi, r, t, kv, *_: (bi, 0, kv[nq - 1 - r, t]))]
  inputs += [states, starts]
  if spec.has_rows:
    in_specs.append(pl.BlockSpec((1, 1, p.q_block), lambda bi, r, t, *_: (bi, 0, nq - 1 - r)))
    inputs.append(d_rows)
  f32 = lambda a: jax.ShapeDtypeStruct(a.shape, jnp.float32)  # noqa: E731
  def whole_row(a):  # a batch row's whole array, resident across its blocks
    return pl.BlockSpec((1,) + a.shape[1:], lambda bi, *_: (bi,) + (0,) * (a.ndim - 1))
  outs = pl.pallas_call(
      functools.partial(_stateful_bwd_kernel, spec),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=_N_TABLES, grid=(batch, nq, p.kv.shape[1]), in_specs=in_specs,
          out_specs=([_q_spec(a, p, reverse=True) for a in qs]
                     + [whole_row(a) for a in (*ks, v)]
                     + _param_specs(spec, leaves, lambda bi, r, *_: nq - 1 - r)
                     + [pl.BlockSpec((1, 1, nk_pad), lambda bi, *_: (bi, 0, 0))]),
          scratch_shapes=([pltpu.VMEM((1, a.shape[1], p.q_block, a.shape[3]), jnp.float32)
                           for a in qs] + [pltpu.VMEM((1, nk_pad), jnp.float32)])),
      out_shape=([f32(a) for a in (*qs, *ks, v)] + [f32(a) for a in leaves]
                 + [jax.ShapeDtypeStruct((batch, 1, nk_pad), jnp.float32)]),
      compiler_params=_compiler_params(3), interpret=spec.interpret,
      cost_estimate=_cost(spec, 'stateful_bwd', qs, ks, v, leaves),
      name='score_hook_attention_stateful_bwd')(*_tables(p), *inputs)
  n_q, n_k = spec.n_q, spec.n_k
  return (outs[:n_q], outs[n_q:n_q + n_k], outs[n_q + n_k], outs[n_q + n_k + 1:-1],
          outs[-1])


# ---------------------------------------------------------------------------------------------
# The differentiable call.


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _call(spec, qs, ks, v, seg_q, seg_k, leaves, carry, starts):
  return _call_fwd(spec, qs, ks, v, seg_q, seg_k, leaves, carry, starts)[0]


def _call_fwd(spec, qs, ks, v, seg_q, seg_k, leaves, carry, starts):
  outs = _forward(spec, qs, ks, v, seg_q, seg_k, leaves, carry, starts)
  out, lse = outs[0], outs[1]
  states = outs[2] if spec.stateful else None
  rows = outs[3] if spec.stateful and spec.has_rows else None
  return (out, lse[..., 0], rows), (qs, ks, v, seg_q, seg_k, leaves, out, lse[..., 0], states,
                                    starts)


def _call_bwd(spec, residuals, cotangents):
  qs, ks, v, seg_q, seg_k, leaves, out, lse, states, starts = residuals
  d_out, d_lse, d_rows = cotangents
  d_out = d_out.astype(jnp.float32)
  delta = jnp.sum(d_out * out.astype(jnp.float32), axis=-1, keepdims=True) - d_lse[..., None]
  lse = jnp.where(lse > NEG_INF / 2, lse, jnp.inf)[..., None]  # no keys: nothing pushed back
  if spec.stateful:
    dq, dk, dv, dparams, d_carry = _stateful_backward(
        spec, qs, ks, v, seg_q, seg_k, leaves, d_out, lse, delta, states, starts,
        None if d_rows is None else d_rows.astype(jnp.float32))
  else:
    dq, dk, dv, dparams, d_carry = _backward(spec, qs, ks, v, seg_q, seg_k, leaves, d_out,
                                             lse, delta)
  cast = lambda xs, like: tuple(a.astype(b.dtype) for a, b in zip(xs, like))  # noqa: E731
  return (cast(dq, qs), cast(dk, ks), dv.astype(v.dtype), None, None, cast(dparams, leaves),
          None if d_carry is None else d_carry, None)


_call.defvjp(_call_fwd, _call_bwd)


def attention(q, k, v, q_segments, k_segments, params, *, table: blockloop.Table, q_block: int,
              score: Callable, dtype, out_dtype=None, carry=None, param_axes=None,
              distance_origin: int = 0, key_block: int | None = None, interpret=False):
  """blockloop.attention (same arguments, same results) as the fused Pallas kernels.

  Under a mesh the kernels run under jax.shard_map (XLA cannot partition a Mosaic kernel):
  each device computes its rows of the batch (the mesh axes of the logical axis 'batch') and,
  for a score without a carried state, its heads (those of 'heads'). A carried state couples
  the heads (selective attention's S is head 0's), so such a score is computed whole per row.

  Args:
    q, k, v, q_segments, k_segments, params, table, q_block, score, dtype, out_dtype, carry:
      as blockloop.attention.
    param_axes: None (every parameter shared), or a pytree like `params` whose leaves are
      tuples naming each axis of the parameter (PARAM_AXES or None):
        'batch'     the kernel, which computes one row at a time, gives the score that
                    row's slice (a dynamic span per token);
        'heads'     split with the heads over a mesh;
        'queries'   the kernel gives the score the query block's slice (blockloop.query_rows
                    reads it in both engines);
        'distance'  a relative-position table's rows (distance x at row x): the kernel
                    gives it reversed, and to each tile only the window of rows its pairs
                    reach (blockloop.relative_term reads it so).
    distance_origin: the row of a 'distance' table that pair (query 0, key 0) reads: pair
      (i, j) reads row distance_origin + i - j (blockloop.relative_term's at0).
    key_block: keys per kernel tile (default q_block, rounded up to a multiple of 128 when
      compiled); any value gives the same result.
    interpret: run as plain JAX (a CPU target): True, or a pltpu.InterpretParams (race
      detection).

  Returns:
    As blockloop.attention: (output, log-sum-exp), with `carry` also the rows' sums.
  """
  qs = tuple(q) if isinstance(q, tuple) else (q,)
  ks = tuple(k) if isinstance(k, tuple) else (k,)
  if (not interpret and str(jax.config.jax_default_matmul_precision).lower()
      in splash.FULL_PRECISION and jnp.dtype(v.dtype).itemsize < 4):
    # Mosaic computes a 16-bit matmul only at its own precision ("Bad lhs type" at HIGHEST):
    # full float32 products, asked for process-wide, are products of float32 inputs.
    qs, ks, v = (tuple(a.astype(jnp.float32) for a in qs),
                 tuple(a.astype(jnp.float32) for a in ks), v.astype(jnp.float32))
    out_dtype, dtype = out_dtype or dtype, jnp.float32  # the weights fed to P V too
  n, nk = qs[0].shape[2], v.shape[2]
  key_block = key_block or (q_block if interpret else compiled_key_block(q_block, v.shape[1]))
  p = plan(table, q_block, nk, key_block)
  if p.q_blocks * q_block < n:
    raise ValueError(f'the table has {p.q_blocks} query blocks of {q_block}, fewer than the '
                     f'{n} queries')
  leaves, treedef = jax.tree.flatten(params)
  axes = ([tuple(a) for a in jax.tree.leaves(param_axes, is_leaf=_names_axes)]
          if param_axes is not None else [()] * len(leaves))
  if len(axes) != len(leaves):
    raise ValueError(f'param_axes names the axes of {len(axes)} parameters, params has '
                     f'{len(leaves)}')
  if not interpret and any(a.ndim < 2 for a in leaves):
    raise ValueError('the Pallas TPU kernel takes score parameters of rank >= 2 (Mosaic '
                     'cannot tile a vector of rank 1): shape them as the scores broadcast them, '
                     f'got shapes {[a.shape for a in leaves]}')
  unknown = {x for a in axes for x in a} - {None, *PARAM_AXES}
  if unknown:
    raise ValueError(f'unknown parameter axis names {sorted(unknown)}; known: {PARAM_AXES}')
  # A distance table zero-padded to whole lanes (at least a key block) and reversed: Mosaic
  # reverses no vector and pads none by a few rows, and blockloop.relative_term reads it so
  # inside the kernel. Its gradient comes back through the flip and the pad.
  # Zero rows before distance 0 bring the row of pair (0, 0) to a multiple of _WINDOW_ALIGN,
  # so that every tile's window starts aligned (window_rows), where that makes it smaller.
  lengths = {a.shape[names.index('distance')] for a, names in zip(leaves, axes)
             if 'distance' in names}
  lead = (_distance_lead(p, max(lengths), int(distance_origin)) if lengths else None)
  leaves = [_reversed_rows(a, names.index('distance'), key_block, lead or 0)
            if 'distance' in names else a for a, names in zip(leaves, axes)]
  tables = {a.shape[names.index('distance')] for a, names in zip(leaves, axes)
            if 'distance' in names}
  if len(tables) > 1:  # a tile reads every table at one window (blockloop.in_kernel's offset)
    raise ValueError(f'distance tables of different lengths {sorted(tables)}: the kernel reads '
                     'every distance table of a score at the same rows')
  flags = dict(q_tuple=isinstance(q, tuple), k_tuple=isinstance(k, tuple))

  def run(qs, ks, v, q_segments, k_segments, leaves, carry):
    return _attention(qs, ks, v, q_segments, k_segments, leaves, carry, plan=p,
                      treedef=treedef, param_axes=tuple(axes), score=score, dtype=dtype,
                      out_dtype=out_dtype, interpret=interpret, keys=nk,
                      distance_origin=int(distance_origin), distance_lead=lead, **flags)

  layout = splash.mesh_layout()
  if layout is None:
    return run(qs, ks, v, q_segments, k_segments, tuple(leaves), carry)
  mesh, batch_axes, head_axes = layout
  batch_axes = splash.divisible_axes(mesh, batch_axes, v.shape[0])
  heads = v.shape[1]
  if carry is not None:
    head_axes = ()
  shards = int(np.prod([mesh.shape[a] for a in head_axes])) if head_axes else 1
  if heads % shards:
    raise ValueError(f'{heads} heads cannot be split over the mesh axes {head_axes} '
                     f'({shards} devices)')
  batch_spec, head_spec = batch_axes or None, head_axes or None
  tile = lambda a: P(batch_spec, head_spec if a.shape[1] == heads else None)  # noqa: E731
  name = {'batch': batch_spec, 'heads': head_spec}
  param_specs = tuple(P(*(name.get(x) for x in a)) for a in axes)
  row = P(batch_spec)
  out_specs = (P(batch_spec, head_spec), P(batch_spec, head_spec))
  if carry is not None:
    out_specs += (row,)
  return jax.shard_map(
      run, mesh=mesh, check_vma=False,
      in_specs=(tuple(tile(a) for a in qs), tuple(tile(a) for a in ks), tile(v), row, row,
                param_specs, None if carry is None else row),
      out_specs=out_specs)(qs, ks, v, q_segments, k_segments, tuple(leaves), carry)


# Bytes of one float32 score tile of every head a compiled kernel step holds: a backward step
# holds several (logits, weights, their gradients), within VMEM_LIMIT. 4 heads of 512 x 512
# (4 MiB) took 21 MiB in the dq kernel; selective attention's 12 heads, which its carried
# state keeps together, ran out of 64 MiB at 512 x 512.
TILE_BYTES = 4 << 20


def compiled_key_block(q_block: int, heads: int) -> int:
  """Keys per tile of a compiled kernel: whole lanes (Mosaic must prove that each slice of
  the keys and of the state starts at a multiple of 128; a row of 389 queries is one block
  of 389), at most TILE_BYTES of scores for all heads, and not past the query block."""
  lanes = -(-q_block // 128) * 128
  fits = TILE_BYTES // (4 * heads * q_block) // 128 * 128
  return max(128, min(lanes, fits))


# Names of a score parameter's axes (pallas_kernel.attention's param_axes).
PARAM_AXES = ('batch', 'heads', 'queries', 'distance')


def _reversed_rows(table, axis: int, key_block: int, lead: int = 0):
  """A distance table (distance x at row x) after `lead` zero rows, padded with zero rows to a
  multiple of 128 of at least key_block rows, then reversed."""
  rows = table.shape[axis] + lead
  width = -(-max(rows, key_block) // 128) * 128
  pad = [(0, 0)] * table.ndim
  pad[axis] = (lead, width - rows)
  return jnp.flip(jnp.pad(table, pad), axis=axis)


def _tile_of(a, names, q_block):
  """A parameter as one grid step reads it: one row, one query block."""
  for axis, name in enumerate(names):
    if name == 'batch':
      a = jax.lax.slice_in_dim(a, 0, 1, axis=axis)
    elif name == 'queries':
      a = jax.lax.slice_in_dim(a, 0, q_block, axis=axis)
  return a


def _names_axes(x) -> bool:
  """Whether x is one parameter's axis names (a leaf of param_axes)."""
  return isinstance(x, tuple) and all(e is None or isinstance(e, str) for e in x)


def _attention(qs, ks, v, q_segments, k_segments, leaves, carry, *, plan: Plan, treedef,
               param_axes, score, dtype, out_dtype, interpret, keys, q_tuple, k_tuple,
               distance_origin, distance_lead):
  """`attention` on one device's arrays: padded to whole blocks, through the kernels."""
  p = plan
  n = qs[0].shape[2]
  q_block, key_block = p.q_block, p.key_block
  n_pad, nk_pad = p.q_blocks * q_block, p.key_blocks * key_block
  pad_len = lambda a, to: jnp.pad(a, ((0, 0), (0, 0), (0, to - a.shape[2]), (0, 0)))  # noqa
  qs_p = tuple(pad_len(a, n_pad) for a in qs)
  ks_p = tuple(pad_len(a, nk_pad) for a in ks)
  v_p = pad_len(v, nk_pad)
  seg_q = jnp.pad(q_segments.astype(jnp.int32), ((0, 0), (0, n_pad - n)),
                  constant_values=-2)[:, None]
  seg_k = jnp.pad(k_segments.astype(jnp.int32), ((0, 0), (0, nk_pad - keys)),
                  constant_values=-1)[:, None]
  stateful = carry is not None
  starts = carry_p = None
  has_rows = False
  if stateful:
    starts = jnp.pad(blockloop.document_starts(k_segments).astype(jnp.int32),
                     ((0, 0), (0, nk_pad - keys)))[:, None]
    carry_p = jnp.pad(carry.astype(jnp.float32), ((0, 0), (0, nk_pad - keys)))[:, None]
    tile_params = jax.tree.unflatten(treedef, [_tile_of(a, names, q_block)
                                               for a, names in zip(leaves, param_axes)])
    has_rows = _has_rows(score, tile_params, qs, ks, q_block, key_block, q_tuple, k_tuple)
  spec = _Spec(p, score, jnp.dtype(dtype), jnp.dtype(out_dtype or dtype), keys, q_tuple,
               k_tuple, len(qs), len(ks), treedef, len(leaves), param_axes, stateful, has_rows,
               interpret, distance_origin, distance_lead)
  out, lse, rows_sum = _call(spec, qs_p, ks_p, v_p, seg_q, seg_k, tuple(leaves), carry_p,
                             starts)
  out, lse = out[:, :, :n], lse[:, :, :n]
  if not stateful:
    return out, lse
  return out, lse, None if rows_sum is None else rows_sum[:, 0, :n]


def _has_rows(score, params, qs, ks, q_block, key_block, q_tuple, k_tuple) -> bool:
  """Whether a stateful score returns per-pair rows (traced at one tile's shapes)."""
  sd = jax.ShapeDtypeStruct
  tile = lambda a, length: sd((1, a.shape[1], length, a.shape[3]), a.dtype)  # noqa: E731
  qb = tuple(tile(a, q_block) for a in qs)
  kb = tuple(tile(a, key_block) for a in ks)
  ctx = blockloop.Context(sd((1, key_block), jnp.float32), sd((1, q_block, key_block), bool),
                          sd((1, key_block), bool))
  i, j = sd((q_block,), jnp.int32), sd((key_block,), jnp.int32)
  with blockloop.in_kernel():
    return jax.eval_shape(score, params, _wrap(q_tuple, qb), _wrap(k_tuple, kb), i, j,
                          ctx)[4] is not None


blockloop.register_kernel('pallas', attention)
