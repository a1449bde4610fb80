"""Static sparse patterns: Sparse Transformer strided and fixed, local and local-global.

Which keys a query sees comes only from models/attention/patterns.py; this file decides which
pattern each layer and head uses. How it is computed (the dense reference, the block-sparse
path over the option `key_block`'s key blocks, the C++ tile kernel, the TPU splash
kernel) is models/attention/dispatch.py's choice, the same for every static pattern.

The Sparse Transformer's three ways to use a factorized pattern (A1, A2) are
the option `factorization`:
  'interleave'  layer 2k uses A1, layer 2k + 1 uses A2 (all heads);
  'merged'      every head attends to A1 | A2;
  'multihead'   the first half of the heads use A1, the second half A2.
A query that sees no key (e.g. the first block under fixed A2 alone) outputs zeros.
"""

from __future__ import annotations

from models.attention import base, blocksparse, dispatch, patterns, traits
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


class PatternAttention(base.MultiHeadAttention):
  """Static patterns with the block-sparse path's options; subclasses say which pattern each
  head uses (`head_pattern`) and may split it into parts (`parts`); dispatch.py computes it."""
  OPTIONS = {
      'key_block': Option(dispatch.KEY_BLOCK,
                          "key block of the 'blocksparse' path for sparse patterns"),
      'band_block': Option(dispatch.BAND_BLOCK, 'query block of the band path for near-diagonal '
                           'patterns (local, strided A1); 0 = never use it'),
  }

  def head_pattern(self, head: int):
    """The pattern object of `head` in this layer."""
    raise NotImplementedError


def _factorized_part(layer: int, head: int, heads: int, factorization: str) -> str:
  if factorization == 'merged':
    return 'union'
  if factorization == 'interleave':
    return 'a1' if layer % 2 == 0 else 'a2'
  return 'a1' if head < heads // 2 else 'a2'


def _check_factorization(options: dict, n_heads: int) -> None:
  f = options.get('factorization')
  if f not in FACTORIZATIONS:
    raise ValueError(f'factorization must be one of {FACTORIZATIONS}, '
                     f'got {f!r}')
  if f == 'multihead' and n_heads < 2:
    raise ValueError("factorization='multihead' splits heads between A1 and A2: it needs "
                     f'at least 2 heads, got {n_heads}')


def _check_blocks(options: dict) -> None:
  for name, minimum in (('key_block', 1), ('band_block', 0)):
    value = options.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
      raise ValueError(f'{name} must be an integer >= {minimum}, '
                       f'got {value!r}')


@register('strided')
class StridedAttention(PatternAttention):
  """Sparse Transformer strided attention: A1 the previous l positions, A2 every l-th one."""
  OPTIONS = FACTORIZED

  def head_pattern(self, head):
    part = _factorized_part(self.layer_index, head, self.num_heads,
                            self.option('factorization'))
    return patterns.Strided(self.option('stride'), part)

  def parts(self, head):
    p = self.head_pattern(head)
    l = p.l
    a1 = blocksparse.HeadView(patterns.Strided(l, 'a1'))
    a2 = blocksparse.HeadView(patterns.Strided(l, 'a2'))
    if p.part == 'a1':
      return [blocksparse.Part(a1)]
    if p.part == 'a2':  # Block-diagonal once positions are sorted by residue mod l.
      return [blocksparse.Part(a2, residue_stride=l)]
    return [blocksparse.Part(a1), blocksparse.Part(blocksparse.Minus(a2, a1), residue_stride=l)]


@register('fixed')
class FixedAttention(PatternAttention):
  """Sparse Transformer fixed attention: A1 the same block of l, A2 the c summary cells."""
  OPTIONS = {
      **FACTORIZED,
      'summary': Option(16, 'fixed: summary cells c per block (paper: 8, 16, 32)'),
      'distinct_heads': Option(False, 'fixed: each head reads its own summary sub-block'),
  }

  def head_pattern(self, head):
    part = _factorized_part(self.layer_index, head, self.num_heads,
                            self.option('factorization'))
    return patterns.Fixed(self.option('stride'), self.option('summary'), part,
                          bool(self.option('distinct_heads')))


@register('local')
class LocalAttention(PatternAttention):
  """Sliding window: each query sees the `window` most recent positions."""
  OPTIONS = WINDOW

  def head_pattern(self, head):
    return patterns.Local(self.option('window'))


@register('block_local')
class BlockLocalAttention(PatternAttention):
  """Image Transformer 1D local attention: query blocks plus `block_memory` earlier positions."""
  OPTIONS = {
      'local_block': Option(128, 'block_local: query block length b'),
      'block_memory': Option(128, 'block_local: earlier positions m each query block sees'),
  }

  def head_pattern(self, head):
    return patterns.BlockLocal(self.option('local_block'), self.option('block_memory'))


def _is_global(options: dict, layer_index: int) -> bool:
  """Whether local_global's layer `layer_index` is a global (dense) one."""
  k = options.get('global_every', LocalGlobalAttention.OPTIONS['global_every'].default)
  return layer_index % k == k - 1


@register('local_global')
class LocalGlobalAttention(PatternAttention):
  """Every `global_every`-th layer dense (global), the others a sliding window.

  The local-global baseline of the selective-attention paper's appendix A.8; layers
  global_every - 1, 2 global_every - 1, ... are the global ones.
  """
  OPTIONS = {**WINDOW, 'global_every': Option(2, 'local_global: every k-th layer is global')}

  def head_pattern(self, head):
    if _is_global(dict(self.options), self.layer_index):
      return patterns.Dense()
    return patterns.Local(self.option('window'))


# ------------------------------------------------------------------ declared beside the math


class PatternTraits(traits.Traits):
  """The block-sparse path's options checked; a subclass checks its pattern (`pattern`)."""

  @classmethod
  def pattern(cls, options: dict, n_heads: int) -> None:
    """Raises ValueError where the options make no pattern (the pattern's own checks)."""
    del options, n_heads

  @classmethod
  def validate(cls, options, n_heads, n_layers):
    _check_blocks(options)
    cls.pattern(options, n_heads)


class FactorizedTraits(PatternTraits):
  """Interleaved A1/A2 alternate with the layer index; the other factorizations ignore it."""

  @classmethod
  def layer_period(cls, options, n_layers):
    return 2 if options.get('factorization') == 'interleave' else 1


@traits.declare('strided')
class StridedTraits(FactorizedTraits):
  TEST_CONFIG = {'attention_options': {'stride': 8, 'key_block': 4, 'factorization': 'merged'}}

  @classmethod
  def pattern(cls, options, n_heads):
    _check_factorization(options, n_heads)
    patterns.Strided(options.get('stride'))


@traits.declare('fixed')
class FixedTraits(FactorizedTraits):
  TEST_CONFIG = {'attention_options': {'stride': 8, 'summary': 3, 'key_block': 4,
                                       'factorization': 'multihead'}}

  @classmethod
  def pattern(cls, options, n_heads):
    _check_factorization(options, n_heads)
    patterns.Fixed(options.get('stride'), options.get('summary'))


@traits.declare('local')
class LocalTraits(PatternTraits):
  TEST_CONFIG = {'attention_options': {'window': 6, 'key_block': 4}}

  @classmethod
  def pattern(cls, options, n_heads):
    patterns.Local(options.get('window'))


@traits.declare('block_local')
class BlockLocalTraits(PatternTraits):
  TEST_CONFIG = {'attention_options': {'local_block': 8, 'block_memory': 5, 'key_block': 4}}

  @classmethod
  def row_period(cls, options):
    return options['local_block']  # Query blocks [k b, (k + 1) b).

  @classmethod
  def pattern(cls, options, n_heads):
    patterns.BlockLocal(options.get('local_block'), options.get('block_memory'))


@traits.declare('local_global')
class LocalGlobalTraits(PatternTraits):
  TEST_CONFIG = {'attention_options': {'window': 6, 'global_every': 2, 'key_block': 4}}

  @classmethod
  def layer_period(cls, options, n_layers):
    return options.get('global_every')

  @classmethod
  def dense_layer(cls, options, layer_index):
    # A global layer is dense causal attention: on a GPU it runs cuDNN's flash kernel, as
    # dense does, instead of the blocked engine (6.4x slower on an H200 at 16K).
    return layer_index is not None and _is_global(options, layer_index)

  @classmethod
  def pattern(cls, options, n_heads):
    patterns.Local(options.get('window'))
    k = options.get('global_every')
    if not isinstance(k, int) or k < 1:
      raise ValueError(f'global_every must be an integer >= 1, '
                       f'got {k!r}')
