"""Block-sparse attention for static patterns: only the key blocks a query block touches.

The layout (for each query block, which key blocks hold at least one allowed pair) is derived
from the pattern's own `allowed(i, j)` function at trace time, so FLOPs and memory follow the
pattern's non-empty blocks, not n^2. A pattern may be split into parts whose union is the
pattern, each computed in its own way and merged exactly with their softmax statistics (as in
flash attention). The strided pattern's second part, {j : (i - j) mod l = 0}, touches every
key block in sequence order but only pairs positions of equal residue mod l (the Sparse
Transformer's own implementation trick): it runs as one batched (n/l x n/l) attention per
residue class. Parts whose pairs all lie within a short distance of the diagonal (a sliding
window, the previous l positions, a block plus its memory) can instead run as a band: every
query block of `band_block` positions sees the same number of keys just before it, so all
blocks go through one batched matmul on a strided view of the keys. Whichever of the two
computes fewer pairs is used.

The blocked layout runs as a loop over query blocks (blockloop.py), its key blocks read from a
table built once on the host; the band and residue computations are batched, their masks built
in the program from iotas. None of the three grows the program with the sequence length.

This is plain JAX, the same code on every backend (attention_impl='blocksparse'). The fused
CPU kernel takes the same parts (attention_impl='cpu_kernel': cpu_kernel.pattern_attention).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from models.attention import blockloop
from models.attention.reference import NEG_INF


@dataclasses.dataclass(frozen=True)
class Part:
  """One part of a pattern: `allowed(i, j)` on original positions, computed in `order`.

  Attributes:
    allowed: (i, j) -> bool for broadcastable int arrays of original positions.
    residue_stride: 0 = sequence order; l > 0 = positions sorted by (i mod l, i).
  """
  allowed: Callable
  residue_stride: int = 0


@dataclasses.dataclass(frozen=True)
class HeadView:
  """`pattern` as an (i, j) -> bool callable for one head (hashable: layouts are cached)."""
  pattern: object
  head: int = 0

  def __call__(self, i, j):
    return self.pattern.allowed(i, j, self.head)


@dataclasses.dataclass(frozen=True)
class Minus:
  """Pairs allowed by `a` and not by `b`: makes the parts of a union disjoint."""
  a: object
  b: object

  def __call__(self, i, j):
    return self.a(i, j) & ~self.b(i, j)


def residue_order(n: int, l: int) -> np.ndarray:
  """Positions 0..n-1 sorted by (i mod l, i): each residue class becomes contiguous."""
  i = np.arange(n)
  return np.lexsort((i, i % l))


@functools.lru_cache(maxsize=256)
def _layout(allowed, n: int, q_block: int, k_block: int, residue_stride: int):
  order = residue_order(n, residue_stride) if residue_stride else np.arange(n)
  keys_of_block = []
  for qs in range(0, n, q_block):
    qi = order[qs:qs + q_block][:, None]
    hit = np.asarray(allowed(qi, order[None, :]), bool).any(axis=0)  # (n,) keys touched
    nk = -(-n // k_block)
    padded = np.zeros(nk * k_block, bool)
    padded[:n] = hit
    blocks = np.flatnonzero(padded.reshape(nk, k_block).any(axis=1))
    idx = (blocks[:, None] * k_block + np.arange(k_block)[None, :]).reshape(-1)
    keys_of_block.append(idx[idx < n])
  return order, tuple(keys_of_block)


@functools.lru_cache(maxsize=256)
def reach(allowed, n: int, chunk: int = 512) -> int:
  """1 + the largest i - j over allowed pairs (0 if none); -1 if a pair has j > i."""
  out = 0
  j = np.arange(n)[None, :]
  for s in range(0, n, chunk):
    i = np.arange(s, min(s + chunk, n))[:, None]
    hit = np.asarray(allowed(i, j), bool)
    if np.any(hit & (j > i)):
      return -1
    if hit.any():
      out = max(out, int(np.max(np.where(hit, i - j, -1))) + 1)
  return out


def band_width(part: Part, n: int, q_block: int, k_block: int, band_block: int) -> int:
  """Keys W before each query block that the band computation of `part` covers (a multiple
  of band_block); 0 when the blocked layout is used instead (band_block 0, residue order, a
  non-causal part, or a band that would not compute fewer pairs)."""
  if band_block < 1 or part.residue_stride:
    return 0
  r = reach(part.allowed, n)
  if r < 1:
    return 0
  width = -(-(r - 1) // band_block) * band_block
  if _band_pairs(n, width, band_block) >= _blocked_pairs(part, n, q_block, k_block):
    return 0
  return width


def _band_pairs(n: int, width: int, band_block: int) -> int:
  return -(-n // band_block) * band_block * (width + band_block)


def chunks_per_step(q_block: int, k_block: int) -> int:
  """Key blocks the blocked layout's loop reads per step: about a query block's worth."""
  return max(1, q_block // k_block)


def _blocked_pairs(part: Part, n: int, q_block: int, k_block: int) -> int:
  """Pairs of the blocked layout's loop: whole steps of chunks_per_step key blocks."""
  _, keys = layout(part, n, q_block, k_block)
  per_step = chunks_per_step(q_block, k_block)
  pairs = 0
  for b, idx in enumerate(keys):
    chunks = -(-len(idx) // k_block)
    pairs += min(q_block, n - b * q_block) * -(-chunks // per_step) * per_step * k_block
  return pairs


@functools.lru_cache(maxsize=256)
def _table(allowed, n: int, q_block: int, k_block: int) -> blockloop.Table:
  """The blocked layout of a sequence-order part as blockloop's table of key blocks (built
  once per pattern and size, like the layout)."""
  _, keys_of_block = _layout(allowed, n, q_block, k_block, 0)
  return blockloop.Table.from_chunks([idx[::k_block] // k_block for idx in keys_of_block],
                                     k_block)


def pattern_table(allowed, n: int, q_block: int, k_block: int) -> blockloop.Table:
  """The key blocks of k_block keys each query block of `allowed` (sequence order) touches, as
  blockloop's table (the fused Pallas kernel's, which computes every part at once)."""
  return _table(allowed, n, q_block, k_block)


def layout(part: Part, n: int, q_block: int, k_block: int):
  """(order, key indices per query block) of `part` in its computation order.

  Key indices index the reordered sequence; they cover whole key blocks of length k_block.
  """
  return _layout(part.allowed, n, q_block, k_block, part.residue_stride)


def computed_pairs(parts, n: int, q_block: int, k_block: int, band_block: int = 0) -> int:
  """Query-key products the block-sparse path computes (for the FLOP ratio)."""
  total = 0
  for part in parts:
    if part.residue_stride:  # One (g x g) block per residue class, g = ceil(n / l).
      g = -(-n // part.residue_stride)
      total += part.residue_stride * g * g
      continue
    width = band_width(part, n, q_block, k_block, band_block)
    total += (_band_pairs(n, width, band_block) if width else
              _blocked_pairs(part, n, q_block, k_block))
  return total


def _masked_stats(q, k, v, mask, *, scale, dtype):
  """Unnormalized softmax(q k^T scale) v over `mask`, its row max m and row sum s.

  q (..., q, d), k and v (..., k, d), mask broadcastable to (..., q, k); a row with no allowed
  key has m = NEG_INF and s = 0.
  """
  logits = jnp.einsum('...qd,...kd->...qk', q, k, preferred_element_type=jnp.float32) * scale
  logits = jnp.where(mask, logits, NEG_INF)
  m = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
  e = jnp.where(mask, jnp.exp(logits - m), 0.0)
  o = jnp.einsum('...qk,...kd->...qd', e.astype(dtype), v, preferred_element_type=jnp.float32)
  return o, m, jnp.sum(e, axis=-1, keepdims=True)


def _residue_stats(q, k, v, segment_ids, part: Part, *, scale, dtype):
  """`_part_stats` for a part that only pairs positions of equal residue mod l: one batched
  (g x g) attention per residue class (g = ceil(n / l)), work n g = n^2 / l."""
  l = part.residue_stride
  b, h, n, d = q.shape
  g = -(-n // l)
  pad = g * l - n

  def by_class(a):  # (b, h, n, d) -> (b, h, l, g, d): position t l + r goes to [r, t].
    a = jnp.pad(a, ((0, 0), (0, 0), (0, pad), (0, 0)))
    return jnp.swapaxes(a.reshape(b, h, g, l, d), 2, 3)

  qg, kg, vg = by_class(q), by_class(k), by_class(v)
  seg = jnp.swapaxes(jnp.pad(segment_ids, ((0, 0), (0, pad))).reshape(b, g, l), 1, 2)  # (b, l, g)
  # Positions from iota, not host constants: the program stays the same size at every n.
  pos = jnp.arange(g)[None, :] * l + jnp.arange(l)[:, None]  # (l, g) original positions
  real = pos < n
  mask = (part.allowed(pos[:, :, None], pos[:, None, :]) & real[:, :, None] & real[:, None, :])
  mask = mask[None, None] & (seg[:, None, :, :, None] == seg[:, None, :, None, :])
  o, m, s = _masked_stats(qg, kg, vg, mask, scale=scale, dtype=dtype)

  def back(a):  # (b, h, l, g, x) -> (b, h, n, x)
    return jnp.swapaxes(a, 2, 3).reshape(b, h, g * l, a.shape[-1])[:, :, :n]

  return back(o), back(m), back(s)


def _band_stats(q, k, v, segment_ids, part: Part, *, width, band_block, scale, dtype):
  """`_part_stats` for a part whose pairs lie within `width` positions before each query block:
  query block t of B = band_block positions sees keys [t B - width, (t + 1) B), all blocks in
  one batched matmul. Work n (width + B) instead of a loop over blocks."""
  b, h, n, d = q.shape
  bb = band_block
  nb = -(-n // bb)
  shifts = width // bb + 1  # Key blocks per query block, the query's own block last.

  def windows(a, fill=0):  # (..., n, x) -> (..., nb, width + B, x): keys of each query block.
    pad = [(0, 0)] * (a.ndim - 2) + [(width, nb * bb - n), (0, 0)]
    a = jnp.pad(a, pad, constant_values=fill)
    a = a.reshape(a.shape[:-2] + (nb + shifts - 1, bb, a.shape[-1]))
    return jnp.concatenate([a[..., s:s + nb, :, :] for s in range(shifts)], axis=-2)

  kw, vw = windows(k), windows(v)
  seg_k = windows(segment_ids[..., None], fill=-1)[..., 0]  # (b, nb, width + B)
  seg_q = jnp.pad(segment_ids, ((0, 0), (0, nb * bb - n)), constant_values=-2)
  qpos = jnp.arange(nb)[:, None, None] * bb + jnp.arange(bb)[None, :, None]
  kpos = jnp.arange(nb)[:, None, None] * bb - width + jnp.arange(width + bb)[None, None, :]
  inside = (kpos >= 0) & (qpos < n)
  mask = part.allowed(qpos, jnp.maximum(kpos, 0)) & inside  # (nb, B, W + B)
  mask = mask[None, None] & (
      seg_q.reshape(b, nb, bb)[:, None, :, :, None] == seg_k[:, None, :, None, :])
  qb = jnp.pad(q, ((0, 0), (0, 0), (0, nb * bb - n), (0, 0))).reshape(b, h, nb, bb, d)
  o, m, s = _masked_stats(qb, kw, vw, mask, scale=scale, dtype=dtype)

  def back(a):  # (b, h, nb, B, x) -> (b, h, n, x)
    return a.reshape(b, h, nb * bb, a.shape[-1])[:, :, :n]

  return back(o), back(m), back(s)


def _part_stats(q, k, v, segment_ids, part: Part, *, q_block, k_block, band_block, scale,
                dtype):
  """Softmax statistics of one part, in sequence order: o, m, s with the part's attention
  o / s and its weights summing to s exp(m) (o unnormalized, m the row max and s the row sum
  for the band and residue paths; the loop's normalized output, its log-sum-exp and 1 for
  the blocked layout).

  q, k, v are head-major (b, h, n, d); returns o (b, h, n, d) f32, m and s (b, h, n, 1).
  """
  if part.residue_stride:
    return _residue_stats(q, k, v, segment_ids, part, scale=scale, dtype=dtype)
  n = q.shape[2]
  width = band_width(part, n, q_block, k_block, band_block)
  if width:
    return _band_stats(q, k, v, segment_ids, part, width=width, band_block=band_block,
                       scale=scale, dtype=dtype)
  table = _table(part.allowed, n, q_block, k_block)

  def score(params, qb, kb, i, j):
    del params
    logits = blockloop.head_einsum('bhqd,bhkd->bhqk', qb, kb, preferred_element_type=jnp.float32)
    return logits * scale, part.allowed(i[:, None], j[None, :])[None, None], None

  out, lse = blockloop.attention(q, k, v, segment_ids, segment_ids, None, table=table,
                                 q_block=q_block, score=score, dtype=dtype,
                                 per_step=chunks_per_step(q_block, k_block),
                                 out_dtype=jnp.float32)
  # As (o, m, s) statistics: the normalized output weighs exp(lse) in a merge.
  return out, lse[..., None], (lse > NEG_INF / 2).astype(jnp.float32)[..., None]


def pattern_attention(q, k, v, segment_ids, parts, *, q_block: int, k_block: int, scale: float,
                      dtype, band_block: int = 0):
  """softmax over the union of `parts` (which must be disjoint), block-sparse.

  Args:
    q, k, v: (batch, length, heads, head_dim).
    segment_ids: (batch, length) document ids; keys of other documents are never seen.
    parts: disjoint Parts whose union is the pattern.
    q_block: query block length.
    k_block: key block length (smaller blocks follow thin patterns more closely).
    band_block: query block of the band computation of near-diagonal parts (0: never).
    scale: logit multiplier.
    dtype: dtype of the probabilities fed to the value matmul and of the output.

  Returns:
    (batch, length, heads, head_dim); a query that sees no key outputs zeros.
  """
  if q_block < 1 or k_block < 1 or band_block < 0:
    raise ValueError(f'block sizes must be >= 1 (band_block >= 0), got q_block={q_block}, '
                     f'k_block={k_block}, band_block={band_block}')
  qh, kh, vh = (jnp.swapaxes(a, 1, 2) for a in (q, k, v))
  stats = [_part_stats(qh, kh, vh, segment_ids, p, q_block=q_block, k_block=k_block,
                       band_block=band_block, scale=scale, dtype=dtype) for p in parts]
  if len(stats) == 1:
    o, m, s = stats[0]
  else:  # Merge the parts' softmax statistics exactly.
    m = functools.reduce(jnp.maximum, [st[1] for st in stats])
    o = sum(st[0] * jnp.exp(st[1] - m) for st in stats)
    s = sum(st[2] * jnp.exp(st[1] - m) for st in stats)
  out = jnp.where(s > 0, o / jnp.where(s > 0, s, 1.0), 0.0)
  return jnp.swapaxes(out, 1, 2).astype(dtype)
