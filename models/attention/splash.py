"""The Pallas splash-attention kernel (TPU) with masks built from a pattern function.

On TPU the kernel runs compiled and skips the blocks the mask leaves empty; elsewhere it runs
in Pallas interpret mode, which is how the CPU tests check it against the dense reference.
The mask is lazy: splash calls the pattern's `allowed(i, j, head)` on the tiles it needs,
so no (n x n) array is built for long sequences.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

from models.attention import patterns


class PatternMask(sm._ComputableMask):  # The public lazy masks (CausalMask, ...) share this base.
  """Splash mask of one head computed from `pattern.allowed`."""

  def __init__(self, pattern, n: int, head: int):
    self.pattern, self.head = pattern, head
    super().__init__(shape=(n, n),
                     mask_function=lambda i, j: pattern.allowed(i, j, head))

  def __eq__(self, other):
    return (isinstance(other, PatternMask) and self.shape == other.shape
            and self.pattern == other.pattern and self.head == other.head)

  def __hash__(self):
    return hash((type(self), self.shape, self.pattern, self.head))


def _kernel(head_patterns: tuple, n: int, block: int, interpret: bool):
  mask = sm.MultiHeadMask([PatternMask(p, n, h) for h, p in enumerate(head_patterns)])
  sizes = sk.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                        block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
                        block_q_dq=block, block_kv_dq=block)
  return sk.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1,
                            interpret=interpret)


def splash_attention(q, k, v, segment_ids, positions, head_patterns, *, block_size: int,
                     scale: float, dtype):
  """Attention of each head over its pattern with the splash kernel.

  Args:
    q, k, v: (batch, length, heads, head_dim).
    segment_ids: (batch, length) document ids.
    positions: (batch, length) positions within each (contiguous) document.
    head_patterns: one pattern object per head.
    block_size: kernel tile length; must divide the sequence length.
    scale: logit multiplier.
    dtype: output dtype.

  Returns:
    (batch, length, heads, head_dim); a query that sees no key outputs zeros, as on the
    other paths.
  """
  n = q.shape[1]
  block = block_size
  if block % 128 or n % block:
    raise ValueError(f"attention_impl='splash' needs model.attention_block_size (now {block}) "
                     f'to be a multiple of 128 that divides the sequence length (now {n}); pad '
                     "the sequence, change the block size or use attention_impl='blocksparse'")
  backend = jax.default_backend()
  if backend == 'gpu':
    raise ValueError("attention_impl='splash' is a TPU kernel; on GPU use 'auto' or "
                     "'blocksparse'")
  kernel = _kernel(tuple(head_patterns), n, block, backend != 'tpu')

  def one(qb, kb, vb, seg):
    ids = sk.SegmentIds(q=seg, kv=seg)
    return kernel(jnp.swapaxes(qb * scale, 0, 1), jnp.swapaxes(kb, 0, 1),
                  jnp.swapaxes(vb, 0, 1), segment_ids=ids)

  out = jax.vmap(one)(q, k, v, segment_ids.astype(jnp.int32))  # (b, h, n, d)
  latest = np.stack([patterns.latest_allowed(p, n, h) for h, p in enumerate(head_patterns)])
  doc_start = jnp.arange(n)[None, :] - positions  # (b, n)
  sees_any = jnp.asarray(latest)[None] >= doc_start[:, None, :]  # (b, h, n)
  out = jnp.where(sees_any[..., None], out, 0)
  return jnp.swapaxes(out, 1, 2).astype(dtype)
