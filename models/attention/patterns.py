"""Static connectivity patterns: ONE pure function each of (query i, key j, head, sizes).

A pattern answers "may query i attend to key j?" for integer arrays i and j that broadcast
(numpy or jax). Every consumer derives from that one function: the dense reference mask,
the block layout of the block-sparse path, decoding caches, the plots of `--mode=inspect`
and the tests. All patterns are causal (j <= i).

Sparse Transformer (Child et al., 2019; ../shared/papers/fixed-factorized-attention.md and
the survey's "Sparse Attention Matrix Factorization"), with stride / block length l:

  strided  A1_i = {j : max(0, i - l) <= j <= i}          (the previous l positions)
           A2_i = {j : (i - j) mod l = 0}
  fixed    A1_i = {j : floor(j / l) = floor(i / l)}      (the same block of length l)
           A2_i = {j : j mod l in {l - c, ..., l - 1}}   (the block's last c "summary" cells)

Localized spans (survey, "Localized Attention Span"):

  local        {j : i - w < j <= i}                      (sliding window of width w)
  block_local  {j : floor(i / b) b - m <= j <= i}        (Image Transformer 1D: query blocks
                                                          of length b plus m earlier cells)

i and j are positions in the row. strided and local depend only on i - j, so a packed
document sees the same pattern wherever it starts; fixed and block_local are anchored to
multiples of l (or b), so packed documents must start on those multiples (data.pack_align)
to see what they would see alone, as in decoding.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

# Which part of a factorized pattern a head or layer uses.
PARTS = ('a1', 'a2', 'union')


def _check(name: str, value: int, minimum: int) -> None:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
    raise ValueError(f'{name} must be an integer >= {minimum}, got {value!r}')


@dataclasses.dataclass(frozen=True)
class Dense:
  """Causal: every earlier position."""

  def allowed(self, i, j, head: int = 0):
    del head
    return j <= i


@dataclasses.dataclass(frozen=True)
class Strided:
  """Sparse Transformer strided attention with stride l (part 'a1', 'a2' or 'union')."""
  l: int
  part: str = 'union'

  def __post_init__(self):
    _check('stride (l)', self.l, 1)
    if self.part not in PARTS:
      raise ValueError(f'part must be one of {PARTS}, got {self.part!r}')

  def allowed(self, i, j, head: int = 0):
    del head
    causal = j <= i
    a1 = (i - j) <= self.l
    a2 = (i - j) % self.l == 0
    return causal & {'a1': a1, 'a2': a2, 'union': a1 | a2}[self.part]


@dataclasses.dataclass(frozen=True)
class Fixed:
  """Sparse Transformer fixed attention with block length l and c summary cells.

  With `distinct_heads`, head h reads the summary sub-block
  {l - (g + 1) c, ..., l - g c - 1} with g = h mod (l // c) instead of the last c cells
  (the paper found distinct sub-blocks per head better than a shared one).
  """
  l: int
  c: int
  part: str = 'union'
  distinct_heads: bool = False

  def __post_init__(self):
    _check('stride (block length l)', self.l, 1)
    _check('summary (c)', self.c, 1)
    if self.c > self.l:
      raise ValueError(f'fixed attention needs c <= l (summary <= stride), got '
                       f'c={self.c} > l={self.l}')
    if self.part not in PARTS:
      raise ValueError(f'part must be one of {PARTS}, got {self.part!r}')

  def head_group(self, head: int) -> int:
    """The summary sub-block `head` reads (see `head_group` below): l / c of them with
    `distinct_heads`, one shared by every head without."""
    return head % (self.l // self.c) if self.distinct_heads else 0

  def summary_start(self, head: int = 0) -> int:
    """First cell (mod l) of the summary sub-block that `head` reads."""
    return self.l - (self.head_group(head) + 1) * self.c

  def allowed(self, i, j, head: int = 0):
    causal = j <= i
    a1 = (j // self.l) == (i // self.l)
    t = self.summary_start(head)
    a2 = ((j % self.l) >= t) & ((j % self.l) < t + self.c)
    return causal & {'a1': a1, 'a2': a2, 'union': a1 | a2}[self.part]


@dataclasses.dataclass(frozen=True)
class Local:
  """Sliding window: the w most recent positions, the query's own included."""
  w: int

  def __post_init__(self):
    _check('window (w)', self.w, 1)

  def allowed(self, i, j, head: int = 0):
    del head
    return (j <= i) & (i - j < self.w)


@dataclasses.dataclass(frozen=True)
class BlockLocal:
  """Image Transformer 1D local attention: query blocks of length b, each seeing its own
  block (causally) and the m positions before it."""
  b: int
  m: int

  def __post_init__(self):
    _check('local_block (b)', self.b, 1)
    _check('block_memory (m)', self.m, 0)

  def allowed(self, i, j, head: int = 0):
    del head
    return (j <= i) & (j >= (i // self.b) * self.b - self.m)


def head_group(pattern, head: int) -> int:
  """A head that sees the same keys as `head` under `pattern` (allowed(i, j, group) ==
  allowed(i, j, head) everywhere): heads of one group share one mask and one computation.
  Only a pattern whose `allowed` reads its head defines `head_group` (fixed attention with
  distinct summary sub-blocks); every head of the others is head 0."""
  group = getattr(pattern, 'head_group', None)
  return group(head) if group else 0


def latest_allowed(pattern, n: int, head: int = 0, chunk: int = 512) -> np.ndarray:
  """For each query i, the largest allowed key j (-1 if none): with documents packed as
  contiguous runs, query i sees a key iff latest_allowed[i] >= i - position[i]. Read-only:
  one array per head group, computed once (0.1 s a head at 12,288, for every trace)."""
  return _latest_allowed(pattern, n, head_group(pattern, head), chunk)


@functools.lru_cache(maxsize=64)
def _latest_allowed(pattern, n: int, head: int, chunk: int) -> np.ndarray:
  out = np.full(n, -1, np.int64)
  j = np.arange(n)[None, :]
  for s in range(0, n, chunk):
    i = np.arange(s, min(s + chunk, n))[:, None]
    hit = np.asarray(pattern.allowed(i, j, head), bool)
    out[s:s + chunk] = np.where(hit.any(axis=1), n - 1 - np.argmax(hit[:, ::-1], axis=1), -1)
  out.setflags(write=False)
  return out


def cache_plan(pattern, n: int, head: int = 0, chunk: int = 512) -> tuple[int, np.ndarray]:
  """Decoding-cache layout derived from the pattern: (capacity, slot of each position).

  Key j is kept from step j until the last query i < n with allowed(i, j); a slot freed by
  a key no query needs any more is reused. The capacity is the most keys alive at once: w for
  a sliding window, the block plus the summary cells for fixed attention, n for dense.
  One plan per head group (head_group), computed once.
  """
  return _cache_plan(pattern, n, head_group(pattern, head), chunk)


@functools.lru_cache(maxsize=256)
def _cache_plan(pattern, n: int, head: int, chunk: int) -> tuple[int, np.ndarray]:
  last_use = np.full(n, -1, np.int64)  # Last query that may see key j (-1: none).
  i_all = np.arange(n)[:, None]
  for s in range(0, n, chunk):
    j = np.arange(s, min(s + chunk, n))[None, :]
    hit = np.asarray(pattern.allowed(i_all, j, head), bool)  # (n, chunk)
    last_use[s:s + chunk] = np.where(hit.any(axis=0), n - 1 - np.argmax(hit[::-1], axis=0), -1)
  slot_of = np.zeros(n, np.int64)
  free: list[int] = []
  alive: list[tuple[int, int]] = []  # (last use, slot)
  capacity = 0
  for t in range(n):
    still = []
    for until, slot in alive:
      (still if until >= t else free).append((until, slot) if until >= t else slot)
    alive = still
    slot = free.pop() if free else capacity
    capacity = max(capacity, slot + 1)
    slot_of[t] = slot
    alive.append((max(int(last_use[t]), t), slot))
  return capacity, slot_of


def mask(pattern, n: int, head: int = 0) -> np.ndarray:
  """The (n, n) boolean connectivity matrix of `pattern` for one head."""
  i = np.arange(n)[:, None]
  j = np.arange(n)[None, :]
  return np.asarray(pattern.allowed(i, j, head), bool)


def density(pattern, n: int, head: int = 0) -> float:
  """Fraction of the n (n + 1) / 2 causal pairs the pattern keeps."""
  return float(mask(pattern, n, head).sum()) / (n * (n + 1) / 2)
