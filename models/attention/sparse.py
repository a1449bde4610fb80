"""Static sparse patterns: Sparse Transformer strided and fixed, local and local-global.

Which keys a query sees comes only from models/attention/patterns.py; this file decides which
pattern each layer and head uses, and how it is computed:

* `attention_impl='xla'` (and 'fused'/'cudnn'): the dense reference, a mask on full scores.
* `attention_impl='blocksparse'`: blocksparse.pattern_attention, only the key blocks the
  pattern touches (key blocks of `attention_options.key_block` positions); plain JAX, the
  same code on every backend.
* `attention_impl='cpu_kernel'`: the same parts in the fused C++ tile kernel of cpu_kernel.py
  (one CPU device; what 'auto' picks there).
* `attention_impl='splash'`: the Pallas TPU splash kernel with a lazy mask from the same
  pattern function (interpret mode off TPU; what 'auto' picks on TPU).

The Sparse Transformer's three ways to use a factorized pattern (A1, A2) are
`attention_options.factorization`:
  'interleave'  layer 2k uses A1, layer 2k + 1 uses A2 (all heads);
  'merged'      every head attends to A1 | A2;
  'multihead'   the first half of the heads use A1, the second half A2.
A query that sees no key (e.g. the first block under fixed A2 alone) outputs zeros.
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np

from models.attention import base, blocksparse, cpu_kernel, patterns, splash
from models.attention.registry import register

FACTORIZATIONS = ('interleave', 'merged', 'multihead')
Option = base.Option

# Options shared by the factorized patterns (strided and fixed) and by the sliding windows.
FACTORIZED = {
    'stride': Option(128, 'Sparse Transformer l: the stride (strided) or block length (fixed)'),
    'factorization': Option('interleave', "how A1/A2 are used: 'interleave' (by layer), "
                            "'merged' (A1 | A2 in every head), 'multihead' (half the heads each)"),
}
WINDOW = {'window': Option(128, 'sliding window w: the w most recent positions')}


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


class PatternAttention(base.MultiHeadAttention):
  """Shared compute for static patterns; subclasses say which pattern each head uses."""
  OPTIONS = {
      'key_block': Option(16, "key block of the 'blocksparse' path for sparse patterns"),
      'band_block': Option(64, 'query block of the band path for near-diagonal patterns (local, '
                           'strided A1); 0 = never use it'),
  }

  def head_pattern(self, head: int):
    """The pattern object of `head` in this layer."""
    raise NotImplementedError

  def parts(self, head: int) -> list[blocksparse.Part]:
    """Disjoint parts of the head's pattern for the block-sparse path (default: one part)."""
    p = self.head_pattern(head)
    # Heads whose pattern does not depend on the head share one view (and one computation).
    return [blocksparse.Part(HeadView(p, head if getattr(p, 'distinct_heads', False) else 0))]

  def attend(self, q, k, v, *, positions, segment_ids, deterministic, key_segment_ids=None,
             extra=None):
    del key_segment_ids, deterministic, extra
    scale = q.shape[-1] ** -0.5
    heads = q.shape[2]
    if self.impl in ('blocksparse', 'cpu_kernel'):
      if self.impl == 'cpu_kernel':
        compute = functools.partial(cpu_kernel.pattern_attention, scale=scale, dtype=self.dtype)
      else:
        compute = functools.partial(
            blocksparse.pattern_attention, q_block=self.block_size,
            k_block=self.option('key_block'), band_block=self.option('band_block'), scale=scale,
            dtype=self.dtype)
      groups: dict[tuple, list[int]] = {}  # Heads with the same parts share one computation.
      for h in range(heads):
        groups.setdefault(tuple(self.parts(h)), []).append(h)
      if len(groups) == 1:
        return compute(q, k, v, segment_ids, list(next(iter(groups))))
      outs = {}
      for parts, hs in groups.items():
        sel = np.asarray(hs)
        out = compute(q[:, :, sel], k[:, :, sel], v[:, :, sel], segment_ids, list(parts))
        for idx, h in enumerate(hs):
          outs[h] = out[:, :, idx]
      return jnp.stack([outs[h] for h in range(heads)], axis=2)
    if self.impl == 'splash':
      return splash.splash_attention(
          q, k, v, segment_ids, positions, [self.head_pattern(h) for h in range(heads)],
          block_size=self.block_size, scale=scale, dtype=self.dtype)
    n = q.shape[1]
    i, j = jnp.arange(n)[:, None], jnp.arange(n)[None, :]
    allowed = jnp.stack([self.head_pattern(h).allowed(i, j, h) for h in range(heads)])
    mask = allowed[None] & base.causal_segment_mask(segment_ids)[:, None]  # (b, h, q, k)
    out = base.reference_attention(q, k, v, mask, scale=scale, dtype=self.dtype)
    sees_any = jnp.swapaxes(mask.any(axis=-1), 1, 2)[..., None]  # (b, q, h, 1)
    return jnp.where(sees_any, out, 0).astype(self.dtype)


def _factorized_part(layer: int, head: int, heads: int, factorization: str) -> str:
  if factorization == 'merged':
    return 'union'
  if factorization == 'interleave':
    return 'a1' if layer % 2 == 0 else 'a2'
  return 'a1' if head < heads // 2 else 'a2'


def _check_factorization(options: dict, n_heads: int) -> None:
  f = options.get('factorization')
  if f not in FACTORIZATIONS:
    raise ValueError(f'model.attention_options.factorization must be one of {FACTORIZATIONS}, '
                     f'got {f!r}')
  if f == 'multihead' and n_heads < 2:
    raise ValueError("factorization='multihead' splits heads between A1 and A2: it needs "
                     f'at least 2 heads, got {n_heads}')


def _check_blocks(options: dict) -> None:
  for name, minimum in (('key_block', 1), ('band_block', 0)):
    value = options.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
      raise ValueError(f'model.attention_options.{name} must be an integer >= {minimum}, '
                       f'got {value!r}')


def _factorized_period(options: dict) -> int:
  """Interleaved A1/A2 alternate with the layer index; the other factorizations ignore it."""
  return 2 if options.get('factorization') == 'interleave' else 1


@register('strided')
class StridedAttention(PatternAttention):
  """Sparse Transformer strided attention: A1 the previous l positions, A2 every l-th one."""
  OPTIONS = FACTORIZED

  @classmethod
  def layer_period(cls, options, n_layers):
    return _factorized_period(options)

  def head_pattern(self, head):
    part = _factorized_part(self.layer_index, head, self.num_heads,
                            self.option('factorization'))
    return patterns.Strided(self.option('stride'), part)

  def parts(self, head):
    p = self.head_pattern(head)
    l = p.l
    a1 = HeadView(patterns.Strided(l, 'a1'))
    a2 = HeadView(patterns.Strided(l, 'a2'))
    if p.part == 'a1':
      return [blocksparse.Part(a1)]
    if p.part == 'a2':  # Block-diagonal once positions are sorted by residue mod l.
      return [blocksparse.Part(a2, residue_stride=l)]
    return [blocksparse.Part(a1), blocksparse.Part(Minus(a2, a1), residue_stride=l)]

  @classmethod
  def validate(cls, options, n_heads, n_layers):
    _check_factorization(options, n_heads)
    _check_blocks(options)
    patterns.Strided(options.get('stride'))


@register('fixed')
class FixedAttention(PatternAttention):
  """Sparse Transformer fixed attention: A1 the same block of l, A2 the c summary cells."""
  OPTIONS = {
      **FACTORIZED,
      'summary': Option(16, 'fixed: summary cells c per block (paper: 8, 16, 32)'),
      'distinct_heads': Option(False, 'fixed: each head reads its own summary sub-block'),
  }

  @classmethod
  def layer_period(cls, options, n_layers):
    return _factorized_period(options)

  def head_pattern(self, head):
    part = _factorized_part(self.layer_index, head, self.num_heads,
                            self.option('factorization'))
    return patterns.Fixed(self.option('stride'), self.option('summary'), part,
                          bool(self.option('distinct_heads')))

  @classmethod
  def validate(cls, options, n_heads, n_layers):
    _check_factorization(options, n_heads)
    _check_blocks(options)
    patterns.Fixed(options.get('stride'), options.get('summary'))


@register('local')
class LocalAttention(PatternAttention):
  """Sliding window: each query sees the `window` most recent positions."""
  OPTIONS = WINDOW

  def head_pattern(self, head):
    return patterns.Local(self.option('window'))

  @classmethod
  def validate(cls, options, n_heads, n_layers):
    _check_blocks(options)
    patterns.Local(options.get('window'))


@register('block_local')
class BlockLocalAttention(PatternAttention):
  """Image Transformer 1D local attention: query blocks plus `block_memory` earlier positions."""
  OPTIONS = {
      'local_block': Option(128, 'block_local: query block length b'),
      'block_memory': Option(128, 'block_local: earlier positions m each query block sees'),
  }

  def head_pattern(self, head):
    return patterns.BlockLocal(self.option('local_block'), self.option('block_memory'))

  @classmethod
  def row_period(cls, options):
    return options['local_block']  # Query blocks [k b, (k + 1) b).

  @classmethod
  def validate(cls, options, n_heads, n_layers):
    _check_blocks(options)
    patterns.BlockLocal(options.get('local_block'), options.get('block_memory'))


@register('local_global')
class LocalGlobalAttention(PatternAttention):
  """Every `global_every`-th layer dense (global), the others a sliding window.

  The local-global baseline of the selective-attention paper's appendix A.8; layers
  global_every - 1, 2 global_every - 1, ... are the global ones.
  """
  OPTIONS = {**WINDOW, 'global_every': Option(2, 'local_global: every k-th layer is global')}

  @classmethod
  def layer_period(cls, options, n_layers):
    return options.get('global_every')

  def is_global(self) -> bool:
    return self.layer_index % self.option('global_every') == self.option('global_every') - 1

  def head_pattern(self, head):
    return patterns.Dense() if self.is_global() else patterns.Local(self.option('window'))

  def attend(self, q, k, v, **kwargs):
    if self.is_global() and self.impl == 'blocksparse':
      return base.block_attention(  # The causal block engine, as DenseAttention's.
          q, k, v, kwargs['segment_ids'], key_range=lambda s, e: (0, e),
          allowed=lambda i, j: i >= j, block_size=self.block_size, scale=q.shape[-1] ** -0.5,
          dtype=self.dtype)
    return super().attend(q, k, v, **kwargs)

  @classmethod
  def validate(cls, options, n_heads, n_layers):
    _check_blocks(options)
    patterns.Local(options.get('window'))
    k = options.get('global_every')
    if not isinstance(k, int) or k < 1:
      raise ValueError(f'model.attention_options.global_every must be an integer >= 1, '
                       f'got {k!r}')
