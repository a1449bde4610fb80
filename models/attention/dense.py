"""Dense causal softmax attention (Vaswani et al., 2017): the zoo's baseline."""

import jax
import jax.numpy as jnp

from models.attention import base, blocksparse, cpu_kernel, patterns, sparse, splash
from models.attention.registry import register

# The causal pattern as the kernel's one part (the layout cache is keyed on it).
DENSE_PARTS = (blocksparse.Part(sparse.HeadView(patterns.Dense())),)
# Head widths of cuDNN's flash kernel on every GPU it supports (Hopper also takes up to 256).
CUDNN_HEAD_DIM_MAX = 128


@register('dense')
class DenseAttention(base.MultiHeadAttention):
  """Every query attends to all earlier keys of its own document.

  softmax(Q K^T / sqrt(d_head) + M) V with M the causal, same-document mask.
  """

  @classmethod
  def implementation(cls, impl, *, options, head_dim, backend, dtype=jnp.float32,
                     block_size=128, devices=1):
    """As for every variant, except that 'auto' on GPU picks cuDNN flash attention where it
    runs (bf16/fp16, head_dim a multiple of 8 up to 128)."""
    if (impl == 'auto' and backend == 'gpu' and head_dim % 8 == 0
        and head_dim <= CUDNN_HEAD_DIM_MAX and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)):
      return 'cudnn'
    return super().implementation(impl, options=options, head_dim=head_dim, backend=backend,
                                  dtype=dtype, block_size=block_size, devices=devices)

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
    if self.impl == 'cpu_kernel':  # Flash attention on the causal tile layout.
      return cpu_kernel.pattern_attention(q, k, v, segment_ids, DENSE_PARTS, scale=scale,
                                          dtype=self.dtype)
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
