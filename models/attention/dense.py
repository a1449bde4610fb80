"""Dense causal softmax attention (Vaswani et al., 2017): the zoo's baseline."""

import jax
import jax.numpy as jnp

from models.attention import base
from models.attention.registry import register


@register('dense')
class DenseAttention(base.MultiHeadAttention):
  """Every query attends to all earlier keys of its own document.

  softmax(Q K^T / sqrt(d_head) + M) V with M the causal, same-document mask.
  """

  def attend(self, q, k, v, *, positions, segment_ids, deterministic):
    del positions, deterministic
    scale = q.shape[-1] ** -0.5
    mask = base.causal_segment_mask(segment_ids)  # (b, q, k)
    if self.impl == 'xla':
      return base.reference_attention(q, k, v, mask[:, None], scale=scale, dtype=self.dtype)
    implementation = 'cudnn' if self.impl == 'cudnn' else None
    return jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], scale=scale,
                                        implementation=implementation).astype(self.dtype)
