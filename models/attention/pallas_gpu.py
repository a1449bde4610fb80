"""The fused score-hook attention of pallas_kernel.py for NVIDIA GPUs, lowered by Pallas Triton.

pallas_kernel.attention computes blockloop.attention as Mosaic (TPU) kernels. This module
computes the same attention, with the same hook and the same arguments, in Triton's model:

  * one program per (batch row, head, query tile): the hook sees tiles of one row and one
    head, (1, 1, B, C), and inside this kernel blockloop.head_einsum multiplies them as
    two-dimensional matrices (Triton's matmul has no batch dimension);
  * no scalar prefetch: the key tiles each query tile visits (`Tiles`, from the engine's
    table through pallas_kernel.plan) are an ordinary int32 input, and a program loops over
    its own row of them up to its own count (lax.fori_loop), so a skipped tile costs nothing;
  * every array a whole power of two (Triton's rule), and a matmul's operands at least
    MIN_DOT wide;
  * no roll: a distance table's relative term picks its columns by compares from the window
    of the table a tile reaches (blockloop._selected_relative_term).

  forward   grid (batch, heads, query tiles): the running max, sum and output in the loop's
            carry; writes the output and each query's log-sum-exp.
  backward  flash attention's: the scores are recomputed from q, k and the log-sum-exp, and
            the hook's own VJP (jax.vjp inside the kernel) turns d logits and d gate into the
            gradients of q, k and the hook's parameters.
              dq      grid (batch, heads, query tiles), dq in the loop's carry (with a
                      distance table, DQ_GROUP query tiles a program, one after the other).
                      Each program writes its own share of the parameters' gradient and XLA
                      sums the shares afterwards; a distance table's share is the program's
                      own copy of the table, a tile's window added in place, a barrier
                      between steps;
              dk, dv  grid (batch, heads, key tiles) over the transposed tiles.
            No atomics: every sum runs in a fixed order, and two runs give bit-identical
            gradients.

The query tiles are not the table's query blocks (the GPU's blocked paths take blocks of 512
queries, far too large a tile for one program): each query reads the keys of its own block's
row of the table (`Tiles.rows`, read per query inside the kernel), and a tile visits the union
of the key tiles of the blocks it overlaps.

A state carried across the query blocks (selective attention's F: blockloop's `carry`) needs
the query tiles in order, which a grid of independent programs does not give, and its
increment is the same for every head, where a program holds one. So it runs as passes:

  states    grid (batch, key tiles): the query tiles that visit the key tile in order, the
            state at its keys in the loop's carry, the increments from head 0's tiles;
            writes the state each query tile reads (batch, query tiles, keys).
  forward   as above, each tile reading its state; a score's rows summed per query.
  dstates   grid (batch, heads, query tiles): each tile's gradient of the state it read.
            XLA sums them over the heads and over the later query tiles: G, the cotangent
            of each tile's increment, which the dq and dk/dv kernels then take (head 0's
            programs: theirs are the increments the states pass summed).

The increment and rows must read only arrays of one head, which every head's program reads
(selective's S from a one-head query and key: the model passes head 0's), and the increment
must not read the state (so that G is known before the tiles' backward); _check_state traces
the score and refuses it otherwise.

On a CPU the kernels run in Pallas interpret mode (the tests). A model compiled for a CPU or
a TPU target runs pallas_kernel.py's kernels; this module's run only for a GPU target.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jax.sharding import PartitionSpec as P

from models.attention import blockloop, pallas_kernel, splash
from models.attention.reference import NEG_INF

# Queries and keys of a tile, and warps of a program, chosen by what ptxas reports of the
# kernels compiled for sm_90 (H100, H200: benchmarks/triton_sm90.py, results/triton_sm90.json;
# no GPU has timed them):
#   TILE           dense and the static patterns: no spill at 4 warps with heads of 64; heads
#                  of 128 take 8 (the dk/dv kernel spilled 1.2 KB a thread at 4, 0.4 at 8).
#   RELATIVE_TILE  a score with a distance table, whose relative term holds B x C x W selects
#                  for a window of W >= B + C - 1 rows: at 32 x 32 x 64 (64K values a program)
#                  every kernel spilled 11-19 KB a thread at 4 warps, 0.5-2.3 KB at 16. At
#                  16 x 16 x 32 none spills at 4 warps, and a pair takes half the selects (a
#                  dq program runs DQ_GROUP tiles: 128 queries a copy of the table's gradient).
#   STATE_TILE     a carried state (selective's F: S, its triangular prefix and F beside the
#                  logits): at 64 the kernels spilled 4-11 KB a thread at 4 warps and 1-3 KB
#                  at 8; at 32, at most 0.1 KB at 8.
TILE = 64
RELATIVE_TILE = 16
STATE_TILE = 32
# Query tiles of one dq program where the score has a distance table: each dq program writes
# its own copy of the table's gradient (no atomics), so fewer programs write fewer copies (at
# 16K tokens, 8 heads and a table of 8K rows of 64: 17 GB a layer with one tile of 16 queries
# a program, 2.2 GB with 8), and 128 queries a program leave 128 programs a row and head.
DQ_GROUP = 8
# Triton's matmul (tl.dot) takes operands at least 16 wide along each dimension.
MIN_DOT = 16
NUM_STAGES = 2


def num_warps(relative: bool, stateful: bool, head_width: int) -> int:
  """Warps of a program (see TILE): 8 for a carried state or for heads wider than 64 (but a
  distance table's tiles of 16), else 4."""
  return 8 if stateful or (head_width > 64 and not relative) else 4


@dataclasses.dataclass(frozen=True, eq=False)
class Tiles:
  """The key tiles each query tile visits, and its transpose, from a blockloop.Table.

  Attributes:
    q_tile, key_tile: queries per query tile, keys per key tile.
    kv: (query tiles, steps) key tile of each step (a row's last repeated past its count).
    steps: (query tiles,) key tiles each query tile visits.
    qs: (key tiles, steps) query tiles that visit each key tile, in order (padded alike).
    q_steps: (key tiles,) how many.
    rows: (3, progressions, query tiles x q_tile) the table's start, stride and count of
      each query's own block (count 0 past the real queries): which keys it really reads.
    width: the table's chunk width.
  """
  q_tile: int
  key_tile: int
  kv: np.ndarray
  steps: np.ndarray
  qs: np.ndarray
  q_steps: np.ndarray
  rows: np.ndarray
  width: int

  @property
  def q_tiles(self) -> int:
    return self.kv.shape[0]

  @property
  def key_tiles(self) -> int:
    return self.qs.shape[0]


def tiles(table: blockloop.Table, q_block: int, queries: int, keys: int, q_tile: int,
          key_tile: int, group: int = 1) -> Tiles:
  """The Tiles of `table` (query blocks of `q_block`) over `queries` queries in tiles of
  `q_tile` and `keys` keys in tiles of `key_tile`; the query tiles a whole number of `group`s
  (the tiles past the queries visit no key)."""
  p = pallas_kernel.plan(table, q_block, keys, key_tile)
  if p.q_blocks * q_block < queries:
    raise ValueError(f'the table has {p.q_blocks} query blocks of {q_block}, fewer than the '
                     f'{queries} queries')
  nqt = -(-max(1, -(-queries // q_tile)) // group) * group
  visits = []
  for qt in range(nqt):
    first, last = qt * q_tile, max(qt * q_tile, min((qt + 1) * q_tile, queries) - 1)
    if qt and first >= queries:  # a tile of padding
      visits.append([])
      continue
    seen = set()
    for b in range(first // q_block, min(last // q_block, p.q_blocks - 1) + 1):
      seen.update(p.kv[b, :p.steps[b]].tolist())
    visits.append(sorted(seen))
  kv, steps = _padded(visits)
  readers = [[] for _ in range(p.key_blocks)]
  for qt, visit in enumerate(visits):
    for c in visit:
      readers[c].append(qt)
  qs, q_steps = _padded(readers)
  n_pad = nqt * q_tile
  block = np.minimum(np.arange(n_pad) // q_block, p.q_blocks - 1)
  real = (np.arange(n_pad) < queries)[:, None]
  rows = np.stack([p.start[block], np.maximum(p.stride[block], 1),
                   np.where(real, p.count[block], 0)])          # (3, n_pad, progressions)
  rows = np.ascontiguousarray(np.swapaxes(rows, 1, 2), np.int32)
  return Tiles(q_tile, key_tile, kv, steps, qs, q_steps, rows, p.width)


def _padded(lists):
  """The lists as one (len(lists), longest) int32 array, each padded with its last entry,
  and their lengths."""
  steps = np.array([len(x) for x in lists], np.int32)
  out = np.zeros((len(lists), max(1, steps.max(initial=0))), np.int32)
  for r, x in enumerate(lists):
    if x:
      out[r, :len(x)] = x
      out[r, len(x):] = x[-1]
  return out, steps


@dataclasses.dataclass(frozen=True, eq=False)
class _Spec:
  tiles: Tiles
  score: Callable
  dtype: jnp.dtype
  out_dtype: jnp.dtype
  keys: int               # real keys (positions >= keys are padding)
  q_tuple: bool           # the score takes a tuple of query arrays
  k_tuple: bool
  n_q: int                # arrays of queries, of keys
  n_k: int
  treedef: object         # the params' pytree
  param_axes: tuple       # per parameter leaf: its axes' names (pallas_kernel.attention)
  table_rows: int         # rows of the distance tables (0: none)
  window: int             # rows of a distance table a tile reads
  distance_origin: int    # the distance-table row of pair (query 0, key 0)
  precision: object       # of the kernel's own matmuls
  interpret: bool
  warps: int = 4          # per program (num_warps)
  dq_group: int = 1       # query tiles of a dq program (DQ_GROUP with a distance table)
  q_shared: tuple = ()    # per query array: one head, read by every head's program
  k_shared: tuple = ()    # per key array
  stateful: bool = False  # a state per key carried across the query tiles (see _states)
  has_rows: bool = False  # a stateful score's per-pair rows, summed per query


class _Refs(NamedTuple):
  """The inputs of every kernel, in the order _inputs gives them."""
  q: tuple
  k: tuple
  v: object
  seg_q: object
  seg_k: object
  rows: object
  order: object           # the forward's and dq's kv, the dk/dv kernel's qs
  count: object           # its steps, resp. q_steps
  params: tuple
  do: object = None
  lse: object = None
  delta: object = None
  # A stateful score's (_STATE_INPUTS), where the kernel takes them.
  carry: object = None    # (nk_pad,) the state's initial value
  starts: object = None   # (nk_pad,) int32: the key is the first of its document
  states: object = None   # (query tiles, nk_pad) the state each query tile reads
  g: object = None        # (query tiles, nk_pad) the gradient of the state the tile leaves
  d_rows: object = None   # (n_pad,) the cotangent of the rows' sums (zero but for head 0)


_STATE_INPUTS = ('carry', 'starts', 'states', 'g', 'd_rows')


def _unpack(spec: _Spec, refs, backward: bool, state: tuple = ()):
  """(_Refs, the kernel's remaining refs: its outputs). `state`: the _STATE_INPUTS the
  kernel takes, in that order."""
  q, refs = refs[:spec.n_q], refs[spec.n_q:]
  k, refs = refs[:spec.n_k], refs[spec.n_k:]
  fixed, refs = refs[:6], refs[6:]
  n_params = len(spec.param_axes)
  params, refs = refs[:n_params], refs[n_params:]
  extra = ()
  if backward:
    extra, refs = refs[:3], refs[3:]
  ins = _Refs(tuple(q), tuple(k), *fixed, tuple(params), *extra)
  names = [x for x in _STATE_INPUTS if x in state]
  ins = ins._replace(**dict(zip(names, refs[:len(names)])))
  return ins, refs[len(names):]


def _wrap(flag: bool, xs):
  return tuple(xs) if flag else xs[0]


def _dot(spec: _Spec, a, b, contract=((1,), (0,))):
  """A 2-D matmul with float32 results at the kernel's precision."""
  return jax.lax.dot_general(a, b, (contract, ((), ())), precision=spec.precision,
                             preferred_element_type=jnp.float32)


class _QuerySide(NamedTuple):
  q: list                 # each (1, 1, B, d), as the hook takes it
  i: jax.Array            # (B,) positions
  seg: jax.Array          # (B,) documents
  rows: list              # per progression: (start, stride, count), each (B,)


class _KeySide(NamedTuple):
  k: list                 # each (1, 1, C, d)
  v: jax.Array            # (C, d)
  j: jax.Array            # (C,) positions
  seg: jax.Array          # (C,)


def _query_side(spec: _Spec, ins: _Refs, qt) -> _QuerySide:
  b = spec.tiles.q_tile
  at = pl.ds(qt * b, b)
  q = [r[at, :].reshape(1, 1, b, r.shape[-1]) for r in ins.q]
  i = qt * b + jax.lax.broadcasted_iota(jnp.int32, (b,), 0)
  rows = [tuple(ins.rows[x, r, at] for x in range(3)) for r in range(ins.rows.shape[1])]
  return _QuerySide(q, i, ins.seg_q[at], rows)


def _key_side(spec: _Spec, ins: _Refs, c) -> _KeySide:
  w = spec.tiles.key_tile
  at = pl.ds(c * w, w)
  k = [r[at, :].reshape(1, 1, w, r.shape[-1]) for r in ins.k]
  j = c * w + jax.lax.broadcasted_iota(jnp.int32, (w,), 0)
  return _KeySide(k, ins.v[at, :], j, ins.seg_k[at])


def _pairs(spec: _Spec, qside: _QuerySide, kside: _KeySide):
  """(B, C) bool: key j is one the table gives query i's block (the block's progressions),
  a real key, in the query's document."""
  j = kside.j[None, :]
  ok = None
  for start, stride, count in qside.rows:
    off = j - start[:, None]
    step = stride[:, None]
    inside = (off >= 0) & (off < step * count[:, None])
    x = inside & (jax.lax.rem(jnp.maximum(off, 0), step) < spec.tiles.width)
    ok = x if ok is None else ok | x
  return ok & (j < spec.keys) & (qside.seg[:, None] == kside.seg[None, :])


def _plane(spec: _Spec, x):
  """A hook's output (broadcastable to (1, 1, B, C)) as the tile's (B, C)."""
  shape = (spec.tiles.q_tile, spec.tiles.key_tile)
  return jnp.broadcast_to(x, (1, 1) + shape).reshape(shape)


def _sum_to(x, shape):
  """The tile's (B, C) x summed over the axes that `shape` broadcasts (the cotangent of a
  broadcast gate)."""
  ndim = max(len(shape), 2)
  x = x.reshape((1,) * (ndim - 2) + x.shape)
  if ndim > len(shape):
    x = jnp.sum(x, axis=tuple(range(ndim - len(shape))))
  axes = tuple(a for a, (s, t) in enumerate(zip(shape, x.shape)) if s == 1 and t != 1)
  if axes:
    x = jnp.sum(x, axis=axes, keepdims=True)
  return x.reshape(shape)


def _window_start(spec: _Spec, qt, c):
  """The padded table's first row of the window tile (qt, c) reads, and the table row it
  holds. Pair (i, j) reads row distance_origin + i - j: the tile's rows run from its first
  query and last key up. A window wholly off the table is clipped to the zero padding."""
  t = spec.tiles
  low = spec.distance_origin + qt * t.q_tile - c * t.key_tile - (t.key_tile - 1)
  start = jnp.clip(low + spec.window, 0, spec.table_rows + spec.window)
  return start, start - spec.window


def _param_index(spec: _Spec, names, qt, start):
  """How a tile reads a parameter of these axis names: its query tile's rows, a distance
  table's window, the rest whole ('batch' and 'heads' come as the program's, one)."""
  if not names:
    return Ellipsis
  t = spec.tiles
  return tuple(pl.ds(qt * t.q_tile, t.q_tile) if x == 'queries'
               else pl.ds(start, spec.window) if x == 'distance' else slice(None)
               for x in names)


def _tile_params(spec: _Spec, p_refs, qt, c):
  """The hook's parameters as tile (qt, c) reads them, the window's first padded row, and
  the table row it holds (blockloop.in_kernel's offset)."""
  start, offset = _window_start(spec, qt, c) if spec.table_rows else (0, 0)
  values = [r[_param_index(spec, names, qt, start)] for r, names in zip(p_refs,
                                                                         spec.param_axes)]
  return jax.tree.unflatten(spec.treedef, values), start, offset


def _score(spec: _Spec, params, offset, qside, kside, q=None, k=None, ctx=None):
  """The hook on a tile: (logits, live, gate), and with a state (ctx) also (increment,
  rows)."""
  with blockloop.in_kernel(offset, kind='triton', precision=spec.precision):
    return spec.score(params, _wrap(spec.q_tuple, qside.q if q is None else q),
                      _wrap(spec.k_tuple, kside.k if k is None else k), qside.i, kside.j,
                      *(() if ctx is None else (ctx,)))


def _context(spec: _Spec, ins: _Refs, c, real, carried):
  """blockloop.Context of tile (., key tile c): the state at its keys (1, C), its pairs,
  its keys' document starts."""
  at = pl.ds(c * spec.tiles.key_tile, spec.tiles.key_tile)
  return blockloop.Context(carried.reshape(1, -1), real[None], (ins.starts[at] != 0)[None])


def _state_at(spec: _Spec, ref, qt, c):
  """(C,) a (query tiles, nk_pad) state array's row qt at key tile c."""
  w = spec.tiles.key_tile
  return ref[qt, pl.ds(c * w, w)]


# ---------------------------------------------------------------------------------------------
# Forward.


def _states_kernel(spec: _Spec, *refs):
  """A stateful score's pre-pass, one program per (batch row, key tile): the query tiles that
  visit the key tile in order, the state at its keys carried in the loop. Writes the state
  each query tile reads there (its initial value plus the increments of the earlier tiles)."""
  ins, (states_ref,) = _unpack(spec, refs, backward=False, state=('carry', 'starts'))
  w = spec.tiles.key_tile
  c = pl.program_id(2)
  kside = _key_side(spec, ins, c)
  at = pl.ds(c * w, w)

  def step(s, state):
    qt = ins.order[c, s]
    states_ref[qt, at] = state
    qside = _query_side(spec, ins, qt)
    params, _, offset = _tile_params(spec, ins.params, qt, c)
    ctx = _context(spec, ins, c, _pairs(spec, qside, kside), state)
    increment = _score(spec, params, offset, qside, kside, ctx=ctx)[3]
    return state + jnp.where(kside.j < spec.keys, increment.reshape(w), 0.0)

  jax.lax.fori_loop(0, ins.count[c], step, ins.carry[at].astype(jnp.float32))


def _forward_kernel(spec: _Spec, *refs):
  ins, refs = _unpack(spec, refs, backward=False,
                      state=('starts', 'states') if spec.stateful else ())
  out_ref, lse_ref = refs[:2]
  rows_ref = refs[2] if spec.has_rows else None
  b = spec.tiles.q_tile
  qt = pl.program_id(2)
  qside = _query_side(spec, ins, qt)

  def step(s, carry):
    m, l, acc, rows = carry
    c = ins.order[qt, s]
    kside = _key_side(spec, ins, c)
    params, _, offset = _tile_params(spec, ins.params, qt, c)
    real = _pairs(spec, qside, kside)
    if spec.stateful:
      ctx = _context(spec, ins, c, real, _state_at(spec, ins.states, qt, c))
      logits, live, gate, _, row = _score(spec, params, offset, qside, kside, ctx=ctx)
      if row is not None:
        rows = rows + jnp.sum(jnp.where(real, _plane(spec, row), 0.0), axis=1)
    else:
      logits, live, gate = _score(spec, params, offset, qside, kside)
    live = _plane(spec, live) & real
    logits = jnp.where(live, _plane(spec, logits), NEG_INF)
    m_new = jnp.maximum(m, jnp.max(logits, axis=1))
    e = jnp.where(live, jnp.exp(logits - m_new[:, None]), 0.0)
    w = e if gate is None else e * _plane(spec, gate)
    alpha = jnp.exp(m - m_new)
    acc = acc * alpha[:, None] + _dot(spec, w.astype(spec.dtype),
                                              kside.v.astype(spec.dtype))
    return m_new, l * alpha + jnp.sum(w, axis=1), acc, rows

  init = (jnp.full((b,), NEG_INF, jnp.float32), jnp.zeros((b,), jnp.float32),
          jnp.zeros((b, out_ref.shape[-1]), jnp.float32), jnp.zeros((b,), jnp.float32))
  m, l, acc, rows = jax.lax.fori_loop(0, ins.count[qt], step, init)
  seen = l > 0
  safe = jnp.where(seen, l, 1.0)
  out_ref[...] = jnp.where(seen[:, None], acc / safe[:, None], 0.0).astype(out_ref.dtype)
  lse_ref[...] = jnp.where(seen, m + jnp.log(safe), NEG_INF)
  if rows_ref is not None:
    rows_ref[...] = rows


def _row_spec(a, shared: bool = False):
  """BlockSpec of an array (batch, heads, length, d) or (batch, heads, length): the
  program's (batch row, head), every position (a tile is read by pl.ds in the kernel).
  `shared`: an array of one head that every head's program reads."""
  return pl.BlockSpec((None, None) + a.shape[2:],
                      lambda bi, h, x: (bi, 0 if shared else h) + (0,) * (a.ndim - 2))


def _batch_row_spec(a):
  """BlockSpec of an array (batch, ...): the program's batch row, whole."""
  return pl.BlockSpec((None,) + a.shape[1:], lambda bi, h, x: (bi,) + (0,) * (a.ndim - 1))


def _tile_spec(a, size: int):
  """BlockSpec of an output (batch, heads, length[, d]) by tiles of `size` on the grid's
  last axis."""
  return pl.BlockSpec((None, None, size) + a.shape[3:],
                      lambda bi, h, x: (bi, h, x) + (0,) * (len(a.shape) - 3))


def _whole(a):
  return pl.BlockSpec(a.shape, lambda *_: (0,) * a.ndim)


def _param_spec(a, names):
  """BlockSpec of a hook parameter: the program's row ('batch') and head ('heads'), the rest
  whole (a tile reads its queries and its window by pl.ds)."""
  if not names:
    return _whole(a)
  shape = tuple(1 if x in ('batch', 'heads') else size for x, size in zip(names, a.shape))
  return pl.BlockSpec(shape, lambda bi, h, x: tuple(bi if n == 'batch' else h if n == 'heads'
                                                    else 0 for n in names))


def _inputs(spec: _Spec, qs, ks, v, seg_q, seg_k, leaves, order, count, extra=(), state=()):
  """in_specs and inputs of a kernel (_Refs' order). `extra`: arrays (batch, heads, ...) read
  per program; `state`: the state's arrays (batch, ...) read per batch row (_STATE_INPUTS)."""
  rows = jnp.asarray(spec.tiles.rows)
  order, count = jnp.asarray(order), jnp.asarray(count)
  shared = (*spec.q_shared, *spec.k_shared, False)
  in_specs = ([_row_spec(a, one) for a, one in zip((*qs, *ks, v), shared)]
              + [_batch_row_spec(seg_q), _batch_row_spec(seg_k)]
              + [_whole(rows), _whole(order), _whole(count)]
              + [_param_spec(a, names) for a, names in zip(leaves, spec.param_axes)]
              + [_row_spec(a) for a in extra] + [_batch_row_spec(a) for a in state])
  return in_specs, [*qs, *ks, v, seg_q, seg_k, rows, order, count, *leaves, *extra, *state]


def _compiler_params(spec: _Spec, stages: int = NUM_STAGES):
  return plgpu.CompilerParams(num_warps=spec.warps, num_stages=stages)


def _states(spec: _Spec, qs, ks, v, seg_q, seg_k, leaves, carry, starts):
  """The state each query tile reads at every key, (batch, query tiles, nk_pad) float32; a
  key tile the query tile does not visit is left unwritten. Its programs, one per (batch row,
  key tile), compute the increments from the tiles of head 0 (which they equal: see
  _check_state)."""
  t = spec.tiles
  batch = v.shape[0]
  in_specs, inputs = _inputs(spec, qs, ks, v, seg_q, seg_k, leaves, t.qs, t.q_steps,
                             state=(carry, starts))
  out = jax.ShapeDtypeStruct((batch, t.q_tiles, carry.shape[1]), jnp.float32)
  return pl.pallas_call(
      functools.partial(_states_kernel, spec), grid=(batch, 1, t.key_tiles),
      in_specs=in_specs, out_specs=_batch_row_spec(out), out_shape=out,
      compiler_params=_compiler_params(spec), interpret=spec.interpret,
      name='score_hook_gpu_states')(*inputs)


def _forward(spec: _Spec, qs, ks, v, seg_q, seg_k, leaves, starts=None, states=None):
  """(output, log-sum-exp, rows' sums or None) of every (batch row, head, query tile)."""
  t = spec.tiles
  (batch, heads), n_pad = v.shape[:2], qs[0].shape[2]
  state = (starts, states) if spec.stateful else ()
  in_specs, inputs = _inputs(spec, qs, ks, v, seg_q, seg_k, leaves, t.kv, t.steps,
                             state=state)
  out_shape = [jax.ShapeDtypeStruct((batch, heads, n_pad, v.shape[3]), spec.out_dtype),
               jax.ShapeDtypeStruct((batch, heads, n_pad), jnp.float32)]
  if spec.has_rows:
    out_shape.append(jax.ShapeDtypeStruct((batch, heads, n_pad), jnp.float32))
  outs = pl.pallas_call(
      functools.partial(_forward_kernel, spec), grid=(batch, heads, t.q_tiles),
      in_specs=in_specs, out_specs=[_tile_spec(a, t.q_tile) for a in out_shape],
      out_shape=out_shape, compiler_params=_compiler_params(spec), interpret=spec.interpret,
      name='score_hook_gpu_fwd')(*inputs)
  # Every head's program sums the same rows (they read no head's own array): head 0's.
  return outs[0], outs[1], outs[2][:, 0] if spec.has_rows else None


# ---------------------------------------------------------------------------------------------
# Backward.


class _TileState(NamedTuple):
  """What a stateful score's tile backward reads besides the tile."""
  ctx: blockloop.Context  # the state the tile read (its keys), its pairs, its keys' starts
  d_increment: object     # (C,) the cotangent of the tile's increment
  d_rows: object          # (B,) the cotangent of its queries' rows' sums


def _tile_grads(spec: _Spec, params, offset, qside, kside, do, lse, delta, state=None,
                state_only: bool = False):
  """One tile's backward: the weights P (B, C) and the hook's VJP of (d logits, d gate[,
  d increment, d rows]): (P, dq, dk, dparams), and with `state` (a _TileState) also the
  gradient of the state the tile read (C,). `state_only`: (P, that gradient) alone."""
  real = _pairs(spec, qside, kside)
  if state is None:
    def f(q, k, params):
      logits, live, gate = _score(spec, params, offset, qside, kside, q, k)
      return (logits, gate), live
    primals = (qside.q, kside.k, params)
  elif state_only:
    def f(carried):
      logits, live, gate, increment, row = _score(
          spec, params, offset, qside, kside, ctx=state.ctx._replace(carried=carried))
      return (logits, gate, increment, row), live
    primals = (state.ctx.carried,)
  else:
    def f(q, k, params, carried):
      logits, live, gate, increment, row = _score(
          spec, params, offset, qside, kside, q, k, state.ctx._replace(carried=carried))
      return (logits, gate, increment, row), live
    primals = (qside.q, kside.k, params, state.ctx.carried)

  with blockloop.in_kernel(offset, kind='triton', precision=spec.precision):
    outputs, vjp, live = jax.vjp(f, *primals, has_aux=True)
  logits, gate = outputs[:2]
  live = _plane(spec, live) & real
  e = jnp.where(live, jnp.exp(jnp.where(live, _plane(spec, logits), NEG_INF) - lse[:, None]),
                0.0)
  p = e if gate is None else e * _plane(spec, gate)
  dp = _dot(spec, do, kside.v.astype(jnp.float32), ((1,), (1,)))
  g_s = dp - delta[:, None]
  d_gate = None if gate is None else _sum_to(jnp.where(live, e * g_s, 0.0), gate.shape)
  cot = ((p * g_s).reshape(logits.shape), d_gate)
  if state is not None:
    increment, row = outputs[2:]
    d_row = None if row is None else jnp.where(
        real, state.d_rows[:, None], 0.0).reshape(row.shape)
    cot += (state.d_increment.reshape(increment.shape), d_row)
  with blockloop.in_kernel(offset, kind='triton', precision=spec.precision):
    grads = vjp(cot)
  if state_only:
    return p, grads[0].reshape(-1)
  if state is not None:
    return (p, *grads[:3], grads[3].reshape(-1))
  return (p, *grads)


def _tile_state(spec: _Spec, ins: _Refs, qt, c, real, first_head, *, with_g: bool = True):
  """A stateful score's _TileState of tile (qt, c) from the refs: the increment's cotangent
  G (the gradient of the state the later query tiles read) and the rows' in head 0's
  programs only (`first_head`: the program's is head 0), whose increments and rows the
  forward kept."""
  w, b = spec.tiles.key_tile, spec.tiles.q_tile
  ctx = _context(spec, ins, c, real, _state_at(spec, ins.states, qt, c))
  if with_g:
    g = jnp.where(first_head, _state_at(spec, ins.g, qt, c), 0.0)
  else:
    g = jnp.zeros((w,), jnp.float32)
  if spec.has_rows:
    d_rows = jnp.where(first_head, ins.d_rows[pl.ds(qt * b, b)], 0.0)
  else:
    d_rows = jnp.zeros((b,), jnp.float32)
  return _TileState(ctx, g, d_rows)


def _d_states_kernel(spec: _Spec, *refs):
  """The gradient of the state each (batch row, head, query tile) reads, at the key tiles it
  visits: its logits' and rows' part (a tile's increment does not depend on the state it
  reads: _check_state)."""
  ins, (ds_ref,) = _unpack(spec, refs, backward=True, state=('starts', 'states', 'd_rows'))
  b, w = spec.tiles.q_tile, spec.tiles.key_tile
  qt, first_head = pl.program_id(2), pl.program_id(1) == 0
  qside = _query_side(spec, ins, qt)
  at = pl.ds(qt * b, b)
  do = ins.do[at, :].astype(jnp.float32)
  lse, delta = ins.lse[at], ins.delta[at]

  def step(s, _):
    c = ins.order[qt, s]
    kside = _key_side(spec, ins, c)
    params, _, offset = _tile_params(spec, ins.params, qt, c)
    state = _tile_state(spec, ins, qt, c, _pairs(spec, qside, kside), first_head,
                        with_g=False)
    _, d_state = _tile_grads(spec, params, offset, qside, kside, do, lse, delta, state,
                             state_only=True)
    ds_ref[pl.ds(c * w, w)] = jnp.where(kside.j < spec.keys, d_state, 0.0)
    return ()

  jax.lax.fori_loop(0, ins.count[qt], step, ())


def _barrier(spec: _Spec):
  """Orders a program's writes to global memory before its next reads (the threads that read
  a row of a distance table's gradient are not those that wrote it)."""
  if not spec.interpret:
    plgpu.debug_barrier()


_BACKWARD_STATE = ('starts', 'states', 'g', 'd_rows')


def _dq_kernel(spec: _Spec, *refs):
  """dq of `spec.dq_group` query tiles, one after the other, and the program's share of the
  parameters' gradient: a per-query parameter's at its tiles' rows, a distance table's as
  the program's own copy of the table (windows added in place, a barrier between steps),
  any other summed over its tiles."""
  ins, refs = _unpack(spec, refs, backward=True,
                      state=_BACKWARD_STATE if spec.stateful else ())
  dq_refs, dp_refs = refs[:spec.n_q], refs[spec.n_q:]
  b = spec.tiles.q_tile
  group, first_head = pl.program_id(2), pl.program_id(1) == 0
  tables = ['distance' in names for names in spec.param_axes]
  per_query = ['queries' in (names or ()) for names in spec.param_axes]
  for r, names in zip(dp_refs, spec.param_axes):
    if 'distance' in names:  # the program's copy of a table's gradient, zeroed by windows
      chunks = r.shape[names.index('distance')] // spec.window

      def zero(x, _, r=r, names=names):
        r[_param_index(spec, names, 0, x * spec.window)] = jnp.zeros(
            tuple(spec.window if n == 'distance' else s for n, s in zip(names, r.shape)),
            r.dtype)
        return ()

      jax.lax.fori_loop(0, chunks, zero, ())
  if any(tables):
    _barrier(spec)
  # A tile's accumulator of each parameter's gradient (None: a table's, added in place).
  tile_shapes = [None if table else tuple(b if n == 'queries' else x for n, x in
                                          zip(names or (None,) * len(r.shape), r.shape))
                 for r, names, table in zip(dp_refs, spec.param_axes, tables)]

  def tile(u, summed):
    qt = group * spec.dq_group + u
    qside = _query_side(spec, ins, qt)
    at = pl.ds(qt * b, b)
    do = ins.do[at, :].astype(jnp.float32)
    lse, delta = ins.lse[at], ins.delta[at]

    def step(s, carry):
      dq, dparams = carry
      c = ins.order[qt, s]
      kside = _key_side(spec, ins, c)
      params, start, offset = _tile_params(spec, ins.params, qt, c)
      state = (_tile_state(spec, ins, qt, c, _pairs(spec, qside, kside), first_head)
               if spec.stateful else None)
      _, dq_t, _, dp_t = _tile_grads(spec, params, offset, qside, kside, do, lse, delta,
                                     state)[:4]
      dq = [a + x.reshape(a.shape).astype(jnp.float32) for a, x in zip(dq, dq_t)]
      out = []
      for r, names, acc, x in zip(dp_refs, spec.param_axes, dparams, jax.tree.leaves(dp_t)):
        if acc is None:  # a distance table's window, added in place
          index = _param_index(spec, names, 0, start)
          r[index] = r[index] + x.astype(jnp.float32)
          out.append(None)
        else:
          out.append(acc + x.reshape(acc.shape).astype(jnp.float32))
      if any(tables):
        _barrier(spec)
      return dq, out

    init = ([jnp.zeros((b, r.shape[-1]), jnp.float32) for r in ins.q],
            [None if shape is None else jnp.zeros(shape, jnp.float32)
             for shape in tile_shapes])
    dq, dparams = jax.lax.fori_loop(0, ins.count[qt], step, init)
    for r, x in zip(dq_refs, dq):
      r[pl.ds(u * b, b), :] = x.astype(r.dtype)
    out = []
    for r, names, x, total, own in zip(dp_refs, spec.param_axes, dparams, summed, per_query):
      if x is not None and own:  # its tile's rows of the program's share
        r[_param_index(spec, names, u, 0)] = x
      out.append(None if x is None or own else total + x)
    return out

  summed = [None if shape is None or own else jnp.zeros(shape, jnp.float32)
            for shape, own in zip(tile_shapes, per_query)]
  summed = jax.lax.fori_loop(0, spec.dq_group, tile, summed)
  for r, x in zip(dp_refs, summed):
    if x is not None:
      r[...] = x


def _dkv_kernel(spec: _Spec, *refs):
  ins, refs = _unpack(spec, refs, backward=True,
                      state=_BACKWARD_STATE if spec.stateful else ())
  dk_refs, dv_ref = refs[:spec.n_k], refs[spec.n_k]
  b = spec.tiles.q_tile
  c, first_head = pl.program_id(2), pl.program_id(1) == 0
  kside = _key_side(spec, ins, c)

  def step(s, carry):
    dk, dv = carry
    qt = ins.order[c, s]
    qside = _query_side(spec, ins, qt)
    at = pl.ds(qt * b, b)
    do = ins.do[at, :].astype(jnp.float32)
    params, _, offset = _tile_params(spec, ins.params, qt, c)
    state = (_tile_state(spec, ins, qt, c, _pairs(spec, qside, kside), first_head)
             if spec.stateful else None)
    p, _, dk_t, _ = _tile_grads(spec, params, offset, qside, kside, do, ins.lse[at],
                                ins.delta[at], state)[:4]
    dv = dv + _dot(spec, p.astype(spec.dtype), do.astype(spec.dtype), ((0,), (0,)))
    return [a + x.reshape(a.shape).astype(jnp.float32) for a, x in zip(dk, dk_t)], dv

  w = spec.tiles.key_tile
  init = ([jnp.zeros((w, r.shape[-1]), jnp.float32) for r in ins.k],
          jnp.zeros((w, dv_ref.shape[-1]), jnp.float32))
  dk, dv = jax.lax.fori_loop(0, ins.count[c], step, init)
  for r, x in zip((*dk_refs, dv_ref), (*dk, dv)):
    r[...] = x.astype(r.dtype)


def _grad_tile(spec: _Spec, a, names, rows: int | None = None):
  """The shape of a parameter as a tile reads it, and of a program's share of its gradient:
  one row and head, `rows` queries (default: a query tile's), a distance table whole
  (padded)."""
  if not names:
    return a.shape
  rows = rows or spec.tiles.q_tile
  return tuple(1 if x in ('batch', 'heads') else rows if x == 'queries' else s
               for x, s in zip(names, a.shape))


def _d_states(spec: _Spec, qs, ks, v, seg_q, seg_k, leaves, do, lse, delta, starts, states,
              d_rows):
  """(G, d carry): the gradient of the state each query tile leaves to the later ones, G
  (batch, query tiles, nk_pad), and of the initial state (batch, nk_pad). The programs write
  each (row, head, query tile)'s gradient of the state it read; the sums over heads and over
  the later query tiles run in XLA, in a fixed order."""
  t = spec.tiles
  batch, heads = v.shape[:2]
  nk_pad = states.shape[-1]
  in_specs, inputs = _inputs(spec, qs, ks, v, seg_q, seg_k, leaves, t.kv, t.steps,
                             (do, lse, delta), state=(starts, states, d_rows))
  out = jax.ShapeDtypeStruct((batch, heads, t.q_tiles, nk_pad), jnp.float32)
  read = pl.pallas_call(
      functools.partial(_d_states_kernel, spec), grid=(batch, heads, t.q_tiles),
      in_specs=in_specs,
      out_specs=pl.BlockSpec((None, None, None, nk_pad), lambda bi, h, x: (bi, h, x, 0)),
      out_shape=out, compiler_params=_compiler_params(spec), interpret=spec.interpret,
      name='score_hook_gpu_dstates')(*inputs)
  visits = np.zeros((t.q_tiles, t.key_tiles), bool)  # the tiles the programs wrote
  for qt in range(t.q_tiles):
    visits[qt, t.kv[qt, :t.steps[qt]]] = True
  visited = jnp.repeat(jnp.asarray(visits), t.key_tile, axis=1)
  read = jnp.sum(jnp.where(visited, read, 0.0), axis=1)     # (batch, query tiles, nk_pad)
  after = jnp.flip(jnp.cumsum(jnp.flip(read, 1), axis=1), 1)  # tiles qt and later
  return after - read, after[:, 0]


def _backward(spec: _Spec, qs, ks, v, seg_q, seg_k, leaves, do, lse, delta, state=()):
  """(dq, dk, dv, dparams). `state`: a stateful score's (starts, states, G, d rows)."""
  t = spec.tiles
  batch, heads = v.shape[:2]
  f32 = lambda a: jax.ShapeDtypeStruct((batch, heads) + a.shape[2:], jnp.float32)  # noqa
  extra = (do, lse, delta)
  in_specs, inputs = _inputs(spec, qs, ks, v, seg_q, seg_k, leaves, t.kv, t.steps, extra,
                             state)
  groups, rows = t.q_tiles // spec.dq_group, spec.dq_group * t.q_tile
  shares = [jax.ShapeDtypeStruct((batch, heads, groups) + _grad_tile(spec, a, names, rows),
                                 jnp.float32) for a, names in zip(leaves, spec.param_axes)]
  share_specs = [pl.BlockSpec((None, None, None) + s.shape[3:],
                              lambda bi, h, x, n=len(s.shape) - 3: (bi, h, x) + (0,) * n)
                 for s in shares]
  # A distance table's gradient is read back and written in place at every step: no software
  # pipelining there, which could load a step's window before the last step stored it.
  stages = 1 if spec.table_rows else NUM_STAGES
  outs = pl.pallas_call(
      functools.partial(_dq_kernel, spec), grid=(batch, heads, groups),
      in_specs=in_specs, out_specs=[_tile_spec(a, rows) for a in qs] + share_specs,
      out_shape=[f32(a) for a in qs] + shares, compiler_params=_compiler_params(spec, stages),
      interpret=spec.interpret, name='score_hook_gpu_dq')(*inputs)
  dq, shares = outs[:spec.n_q], outs[spec.n_q:]
  in_specs, inputs = _inputs(spec, qs, ks, v, seg_q, seg_k, leaves, t.qs, t.q_steps, extra,
                             state)
  dkv = pl.pallas_call(
      functools.partial(_dkv_kernel, spec), grid=(batch, heads, t.key_tiles),
      in_specs=in_specs, out_specs=[_tile_spec(a, t.key_tile) for a in (*ks, v)],
      out_shape=[f32(a) for a in (*ks, v)], compiler_params=_compiler_params(spec),
      interpret=spec.interpret, name='score_hook_gpu_dkv')(*inputs)
  dparams = [_assemble(g, names) for g, names in zip(shares, spec.param_axes)]
  # An array of one head that every head's program read: the sum of the heads' shares.
  heads_sum = lambda xs, shared: [jnp.sum(x, axis=1, keepdims=True) if one else x  # noqa
                                  for x, one in zip(xs, shared)]
  return (heads_sum(dq, spec.q_shared), heads_sum(dkv[:spec.n_k], spec.k_shared),
          dkv[spec.n_k], dparams)


def _assemble(g, names):
  """A parameter's gradient from the programs' shares g (batch, heads, query tiles, *share):
  summed over the programs, but along an axis named 'batch', 'heads' or 'queries', where the
  program's own row, head or query tile goes to its place."""
  owner = {'batch': 0, 'heads': 1, 'queries': 2}
  kept = [owner[x] for x in names if x in owner]
  g = jnp.sum(g, axis=tuple(a for a in range(3) if a not in kept), keepdims=True)
  order, shape = [], []
  for axis, name in enumerate(names or (None,) * (g.ndim - 3)):
    if name in owner:
      order.append(owner[name])
    order.append(3 + axis)
    shape.append(g.shape[3 + axis] * (g.shape[owner[name]] if name in owner else 1))
  rest = [a for a in range(3) if a not in order]
  return jnp.transpose(g, order + rest).reshape(shape)


# ---------------------------------------------------------------------------------------------
# The differentiable call.


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _call(spec, qs, ks, v, seg_q, seg_k, leaves, carry, starts):
  return _call_fwd(spec, qs, ks, v, seg_q, seg_k, leaves, carry, starts)[0]


def _call_fwd(spec, qs, ks, v, seg_q, seg_k, leaves, carry, starts):
  states = (_states(spec, qs, ks, v, seg_q, seg_k, leaves, carry, starts) if spec.stateful
            else None)
  out, lse, rows = _forward(spec, qs, ks, v, seg_q, seg_k, leaves, starts, states)
  return (out, lse, rows), (qs, ks, v, seg_q, seg_k, leaves, out, lse, starts, states)


def _call_bwd(spec, residuals, cotangents):
  qs, ks, v, seg_q, seg_k, leaves, out, lse, starts, states = residuals
  d_out, d_lse, d_rows = cotangents
  d_out = d_out.astype(jnp.float32)
  delta = jnp.sum(d_out * out.astype(jnp.float32), axis=-1) - d_lse
  lse = jnp.where(lse > NEG_INF / 2, lse, jnp.inf)  # no keys: nothing pushed back
  state, d_carry = (), None
  if spec.stateful:
    d_rows = (jnp.zeros(seg_q.shape, jnp.float32) if d_rows is None
              else d_rows.astype(jnp.float32))
    g, d_carry = _d_states(spec, qs, ks, v, seg_q, seg_k, leaves, d_out, lse, delta, starts,
                           states, d_rows)
    state = (starts, states, g, d_rows)
  dq, dk, dv, dparams = _backward(spec, qs, ks, v, seg_q, seg_k, leaves, d_out, lse, delta,
                                  state)
  cast = lambda xs, like: tuple(a.astype(b.dtype) for a, b in zip(xs, like))  # noqa: E731
  return (cast(dq, qs), cast(dk, ks), dv.astype(v.dtype), None, None, cast(dparams, leaves),
          d_carry, None)


_call.defvjp(_call_fwd, _call_bwd)


def _pow2(x: int) -> int:
  return 1 << max(0, int(x) - 1).bit_length()


def tile_size(q_block: int, relative: bool, stateful: bool = False) -> int:
  """Queries (and keys) of a tile: the table's query block rounded up to a power of two, at
  least MIN_DOT, at most TILE (RELATIVE_TILE for a score with a distance table, STATE_TILE
  for a carried state)."""
  largest = RELATIVE_TILE if relative else STATE_TILE if stateful else TILE
  return min(largest, max(MIN_DOT, _pow2(q_block)))


def unusable_head_dim(head_dim: int) -> str | None:
  """Why the Triton kernel cannot take heads of this width, or None."""
  if head_dim < MIN_DOT or head_dim != _pow2(head_dim):
    return (f'its tiles take head widths that are powers of two of at least {MIN_DOT} '
            f'(Triton), got {head_dim}')
  return None


def _fit(a, axis: int, length: int):
  """a cut or zero-padded to `length` along `axis`."""
  if a.shape[axis] >= length:
    return jax.lax.slice_in_dim(a, 0, length, axis=axis)
  pad = [(0, 0)] * a.ndim
  pad[axis] = (0, length - a.shape[axis])
  return jnp.pad(a, pad)


def _compiled_checks(spec: _Spec, qs, ks, v, leaves):
  """Raises ValueError where Triton cannot compile the kernel: every array a whole power of
  two, a matmul's operands at least MIN_DOT wide."""
  t = spec.tiles
  widths = {a.shape[3] for a in (*qs, *ks, v)}
  bad = [x for x in (t.q_tile, t.key_tile, *widths) if x < MIN_DOT or x != _pow2(x)]
  if bad:
    raise ValueError(f'the Pallas Triton kernel takes tiles and head widths that are powers of '
                     f'two of at least {MIN_DOT}: got tiles {t.q_tile} x {t.key_tile} and head '
                     f'widths {sorted(widths)}')
  for a, names in zip(leaves, spec.param_axes):
    shape = tuple(spec.window if x == 'distance' else s
                  for x, s in zip(names or (None,) * a.ndim, _grad_tile(spec, a, names)))
    if any(s != _pow2(s) for s in shape):
      raise ValueError(f'the Pallas Triton kernel reads a score parameter as a tile of shape '
                       f'{shape}; Triton takes only powers of two: shape it so (parameter of '
                       f'shape {a.shape}, axes {names})')


def attention(q, k, v, q_segments, k_segments, params, *, table: blockloop.Table, q_block: int,
              score: Callable, dtype, out_dtype=None, carry=None, param_axes=None,
              distance_origin: int = 0, key_block: int | None = None, interpret=False,
              q_tile: int | None = None):
  """blockloop.attention (same arguments, same results) as Pallas Triton kernels.

  Under a mesh the kernels run under jax.shard_map (XLA cannot partition a Triton kernel):
  each device computes its rows of the batch and its heads.

  Args:
    q, k, v, q_segments, k_segments, params, table, q_block, score, dtype, out_dtype,
    param_axes, distance_origin: as pallas_kernel.attention.
    carry: None, or a state (batch, keys) carried across the query tiles, as
      blockloop.attention's (see the module's docstring and _check_state).
    key_block: keys per tile (default: the query tile).
    interpret: run as plain JAX (a CPU target: the tests).
    q_tile: queries per tile (default tile_size: 64; 16 with a distance table, 32 with a
      carried state).

  Returns:
    As blockloop.attention: (output, log-sum-exp), with `carry` also the rows' sums.
  """
  qs = tuple(q) if isinstance(q, tuple) else (q,)
  ks = tuple(k) if isinstance(k, tuple) else (k,)
  heads = v.shape[1]
  if any(a.shape[1] not in (heads, 1) for a in (*qs, *ks)):
    raise ValueError('the Pallas Triton kernel computes one head per program: every query '
                     f'and key array has the {heads} heads of v or one head that every head '
                     f'reads, got {[a.shape for a in (*qs, *ks)]}')
  if carry is not None and carry.ndim != 2:
    raise ValueError('the Pallas Triton kernel carries a state of one value per key, (batch, '
                     f'keys); got shape {carry.shape}')
  n, nk = qs[0].shape[2], v.shape[2]
  leaves, treedef = jax.tree.flatten(params)
  names = pallas_kernel._names_axes  # pylint: disable=protected-access
  axes = ([tuple(a) for a in jax.tree.leaves(param_axes, is_leaf=names)]
          if param_axes is not None else [()] * len(leaves))
  if len(axes) != len(leaves):
    raise ValueError(f'param_axes names the axes of {len(axes)} parameters, params has '
                     f'{len(leaves)}')
  unknown = {x for a in axes for x in a} - {None, *pallas_kernel.PARAM_AXES}
  if unknown:
    raise ValueError(f'unknown parameter axis names {sorted(unknown)}; known: '
                     f'{pallas_kernel.PARAM_AXES}')
  rows = {a.shape[names.index('distance')] for a, names in zip(leaves, axes)
          if 'distance' in names}
  if len(rows) > 1:  # a tile reads every table at one window (blockloop.in_kernel's offset)
    raise ValueError(f'distance tables of different lengths {sorted(rows)}: the kernel reads '
                     'every distance table of a score at the same rows')
  q_tile = q_tile or tile_size(q_block, bool(rows), carry is not None)
  group = DQ_GROUP if rows else 1
  t = tiles(table, q_block, n, nk, q_tile, key_block or q_tile, group)
  window = _pow2(t.q_tile + t.key_tile - 1)
  full = str(jax.config.jax_default_matmul_precision).lower() in splash.FULL_PRECISION
  flags = dict(q_tuple=isinstance(q, tuple), k_tuple=isinstance(k, tuple))

  def run(qs, ks, v, q_segments, k_segments, leaves, carry):
    return _attention(qs, ks, v, q_segments, k_segments, leaves, carry, tiles=t,
                      treedef=treedef, param_axes=tuple(axes), score=score, dtype=dtype,
                      out_dtype=out_dtype, interpret=bool(interpret), keys=nk, window=window,
                      table_rows=max(rows, default=0), distance_origin=int(distance_origin),
                      precision=jax.lax.Precision.HIGHEST if full else None, **flags)

  layout = splash.mesh_layout()
  if layout is None:
    return run(qs, ks, v, q_segments, k_segments, tuple(leaves), carry)
  mesh, batch_axes, head_axes = layout
  batch_axes = splash.divisible_axes(mesh, batch_axes, v.shape[0])
  if carry is not None:  # the state's gradient sums over every head: a device holds them all
    head_axes = ()
  shards = int(np.prod([mesh.shape[a] for a in head_axes])) if head_axes else 1
  if heads % shards:
    raise ValueError(f'{heads} heads cannot be split over the mesh axes {head_axes} '
                     f'({shards} devices)')
  batch_spec, head_spec = batch_axes or None, head_axes or None
  name = {'batch': batch_spec, 'heads': head_spec}
  row = P(batch_spec)
  tile = lambda a: P(batch_spec, head_spec if a.shape[1] == heads else None)  # noqa: E731
  out_specs = (P(batch_spec, head_spec), P(batch_spec, head_spec))
  if carry is not None:
    out_specs += (row,)
  return jax.shard_map(
      run, mesh=mesh, check_vma=False,
      in_specs=(tuple(tile(a) for a in qs), tuple(tile(a) for a in ks), tile(v), row, row,
                tuple(P(*(name.get(x) for x in a)) for a in axes),
                None if carry is None else row),
      out_specs=out_specs)(qs, ks, v, q_segments, k_segments, tuple(leaves), carry)


def _dependencies(jaxpr) -> list[set[int]]:
  """For each output of a jaxpr, the inputs (their indices) it is computed from: an
  equation's outputs from all of its inputs (a nested jaxpr taken whole, which can only add
  inputs)."""
  deps = {v: {x} for x, v in enumerate(jaxpr.invars)}
  for eqn in jaxpr.eqns:
    used = set().union(*(deps.get(v, set()) for v in eqn.invars
                         if not isinstance(v, jax.extend.core.Literal)))
    for v in eqn.outvars:
      deps[v] = used
  return [set() if isinstance(v, jax.extend.core.Literal) else deps.get(v, set())
          for v in jaxpr.outvars]


def _check_state(spec: _Spec, qs, ks, leaves) -> bool:
  """Raises ValueError where the kernel cannot carry a stateful score's state; returns
  whether the score has rows. A program holds one head, so the state's increment and the
  rows, which the kernel takes from head 0's programs, must not read a head's own query, key
  or parameter; and G, the increment's cotangent, is known before the tiles' backward only
  if the increment does not read the state (selective attention's increment, the column sums
  of S, does not: F does)."""
  t = spec.tiles
  sd = jax.ShapeDtypeStruct
  tile = lambda a, n: sd((1, 1, n, a.shape[3]), a.dtype)  # noqa: E731
  q_tiles = [tile(a, t.q_tile) for a in qs]
  k_tiles = [tile(a, t.key_tile) for a in ks]
  params = [sd(tuple(spec.window if x == 'distance' else s for x, s in
                     zip(names or (None,) * a.ndim, _grad_tile(spec, a, names))), a.dtype)
            for a, names in zip(leaves, spec.param_axes)]
  ctx = blockloop.Context(sd((1, t.key_tile), jnp.float32),
                          sd((1, t.q_tile, t.key_tile), bool), sd((1, t.key_tile), bool))
  i, j = sd((t.q_tile,), jnp.int32), sd((t.key_tile,), jnp.int32)

  def f(q_tiles, k_tiles, params, carried, real, starts, i, j):
    with blockloop.in_kernel(0, kind='triton', precision=spec.precision):
      out = spec.score(jax.tree.unflatten(spec.treedef, params), _wrap(spec.q_tuple, q_tiles),
                       _wrap(spec.k_tuple, k_tiles), i, j,
                       blockloop.Context(carried, real, starts))
    return out[3], out[4]

  reads = _dependencies(jax.make_jaxpr(f)(q_tiles, k_tiles, params, *ctx, i, j).jaxpr)
  has_rows = len(reads) == 2                              # rows None: one output
  increment, rows = reads[0], reads[1] if has_rows else set()
  own = ([x for x, one in enumerate(spec.q_shared) if not one]
         + [len(qs) + x for x, one in enumerate(spec.k_shared) if not one]
         + [len(qs) + len(ks) + x for x, names in enumerate(spec.param_axes)
            if 'heads' in (names or ())])
  carried = len(qs) + len(ks) + len(leaves)
  for what, reads in (('increment', increment), ('rows', rows)):
    if set(own) & reads:
      raise ValueError(f"the Pallas Triton kernel takes a carried state's {what} from head "
                       "0's programs: it must read only arrays of one head (a one-head query "
                       "or key array, as selective attention's S), not a head's own")
  if carried in increment:
    raise ValueError('the Pallas Triton kernel computes the gradient of a carried state '
                     "before the tiles' backward: the state's increment must not read the "
                     'state itself')
  return has_rows


def _attention(qs, ks, v, q_segments, k_segments, leaves, carry, *, tiles: Tiles, treedef,
               param_axes, score, dtype, out_dtype, interpret, keys, window, table_rows,
               distance_origin, precision, q_tuple, k_tuple):
  """`attention` on one device's arrays: padded to whole tiles, through the kernels."""
  t = tiles
  heads = v.shape[1]
  n = qs[0].shape[2]
  n_pad, nk_pad = t.q_tiles * t.q_tile, t.key_tiles * t.key_tile
  pad_len = lambda a, to: jnp.pad(a, ((0, 0), (0, 0), (0, to - a.shape[2]), (0, 0)))  # noqa
  qs_p = tuple(pad_len(a, n_pad) for a in qs)
  ks_p = tuple(pad_len(a, nk_pad) for a in ks)
  v_p = pad_len(v, nk_pad)
  seg_q = jnp.pad(q_segments.astype(jnp.int32), ((0, 0), (0, n_pad - n)), constant_values=-2)
  seg_k = jnp.pad(k_segments.astype(jnp.int32), ((0, 0), (0, nk_pad - keys)),
                  constant_values=-1)
  # A distance table gets `window` zero rows before it and at least as many after (a window
  # off the table reads zeros), to a whole number of windows; a per-query parameter the
  # padded queries.
  chunks = 2 + -(-table_rows // window)

  def fitted(a, names):
    for axis, x in enumerate(names):
      if x == 'distance':
        a = jnp.pad(a, [(window, chunks * window - window - a.shape[axis]) if y == axis
                        else (0, 0) for y in range(a.ndim)])
      elif x == 'queries':
        a = _fit(a, axis, n_pad)
    return a

  padded = tuple(fitted(a, names) for a, names in zip(leaves, param_axes))
  stateful = carry is not None
  spec = _Spec(t, score, jnp.dtype(dtype), jnp.dtype(out_dtype or dtype), keys, q_tuple,
               k_tuple, len(qs), len(ks), treedef, param_axes, table_rows, window,
               distance_origin, precision, interpret,
               q_shared=tuple(heads > 1 and a.shape[1] == 1 for a in qs),
               k_shared=tuple(heads > 1 and a.shape[1] == 1 for a in ks), stateful=stateful,
               warps=num_warps(bool(table_rows), stateful,
                               max(a.shape[3] for a in (*qs, *ks, v))),
               dq_group=DQ_GROUP if table_rows else 1)
  carry_p = starts = None
  if stateful:
    spec = dataclasses.replace(spec, has_rows=_check_state(spec, qs, ks, padded))
    starts = jnp.pad(blockloop.document_starts(k_segments).astype(jnp.int32),
                     ((0, 0), (0, nk_pad - keys)))
    carry_p = jnp.pad(carry.astype(jnp.float32), ((0, 0), (0, nk_pad - keys)))
  if not interpret:
    _compiled_checks(spec, qs_p, ks_p, v_p, padded)
  # The parameters' gradients come back through the padding (XLA differentiates it).
  out, lse, rows = _call(spec, qs_p, ks_p, v_p, seg_q, seg_k, padded, carry_p, starts)
  if not stateful:
    return out[:, :, :n], lse[:, :, :n]
  return out[:, :, :n], lse[:, :, :n], None if rows is None else rows[:, :n]


blockloop.register_kernel('pallas_gpu', attention)
