"""Dense causal softmax attention (Vaswani et al., 2017): the zoo's baseline."""

import jax

from models.attention import base, patterns, splash
from models.attention.registry import register


@register('dense')
class DenseAttention(base.MultiHeadAttention):
  """Every query attends to all earlier keys of its own document.

  softmax(Q K^T / sqrt(d_head) + M) V with M the causal, same-document mask.
  """

  def head_pattern(self, head):
    return patterns.Dense()

  def attend(self, q, k, v, *, positions, segment_ids, deterministic, key_segment_ids=None,
             extra=None):
    del key_segment_ids, deterministic, extra
    scale = q.shape[-1] ** -0.5
    if self.impl == 'splash':
      return splash.splash_attention(q, k, v, segment_ids, positions,
                                     [patterns.Dense()] * q.shape[2], block_size=self.block_size,
                                     scale=scale, dtype=self.dtype)
    if self.impl == 'blocksparse':
      # Query block [s, e) sees keys [0, e): the blocks above the diagonal are never computed.
      return base.block_attention(
          q, k, v, segment_ids, key_range=lambda s, e: (0, e), allowed=lambda i, j: i >= j,
          block_size=self.block_size, scale=scale, dtype=self.dtype)
    mask = base.causal_segment_mask(segment_ids)  # (b, q, k)
    if self.impl == 'xla':
      return base.reference_attention(q, k, v, mask[:, None], scale=scale, dtype=self.dtype)
    implementation = 'cudnn' if self.impl == 'cudnn' else None
    return jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], scale=scale,
                                        implementation=implementation).astype(self.dtype)
