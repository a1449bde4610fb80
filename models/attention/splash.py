"""The Pallas splash-attention kernel (TPU) with masks built from a pattern function.

On TPU the kernel runs compiled and skips the blocks the mask leaves empty; for a CPU target
it runs in Pallas interpret mode, which is how the CPU tests check it against the dense
reference. The mask is lazy: splash calls the pattern's `allowed(i, j, head)` on the tiles it
needs, so no (n x n) array is built for long sequences.

XLA cannot partition a Mosaic kernel, so under a mesh the kernel runs under `jax.shard_map`:
each device computes its own rows of the batch (the mesh axes the logical rules give 'batch')
and its own heads (those of 'heads', e.g. 'tensor'), with the mask's per-head tables split the
same way. The sequence is never split here: a rule that splits 'length' is gathered first.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm
from jax.sharding import NamedSharding, PartitionSpec as P

from models.attention import patterns

# The kernel's tiles are multiples of this many positions.
BLOCK_MULTIPLE = 128
# Settings of jax_default_matmul_precision that ask for full float32 products.
FULL_PRECISION = ('highest', 'float32', 'precision.highest')


class PatternMask(sm._ComputableMask):  # The public lazy masks (CausalMask, ...) share this base.
  """Splash mask of one head computed from `pattern.allowed`.

  Heads of one `patterns.head_group` give equal masks: splash processes a mask once however
  many heads share it, and broadcasts it over them where each head shard has only one (the
  Sparse Transformer recipe's 8 heads of one fixed pattern at 12,288: 20 s of mask tables on
  the host before, one head's worth now)."""

  def __init__(self, pattern, n: int, head: int):
    head = patterns.head_group(pattern, head)
    self.pattern, self.head = pattern, head
    super().__init__(shape=(n, n),
                     mask_function=lambda i, j: pattern.allowed(i, j, head))

  def __eq__(self, other):
    return (isinstance(other, PatternMask) and self.shape == other.shape
            and self.pattern == other.pattern and self.head == other.head)

  def __hash__(self):
    return hash((type(self), self.shape, self.pattern, self.head))


def _kernel(head_patterns: tuple, n: int, block: int, interpret: bool, head_shards: int):
  """The kernel of every head's pattern; its mask tables split into `head_shards` groups of
  heads (the head axis of the mesh). Not cached: its tables are arrays of the trace that
  builds it."""
  mask = sm.MultiHeadMask([PatternMask(p, n, h) for h, p in enumerate(head_patterns)])
  sizes = sk.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                        block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
                        block_q_dq=block, block_kv_dq=block)
  return sk.make_splash_mha(mask, block_sizes=sizes, head_shards=head_shards, q_seq_shards=1,
                            interpret=interpret)


def _mesh_axes(entry) -> tuple[str, ...]:
  """The mesh axes of one PartitionSpec entry, as a tuple."""
  if entry is None:
    return ()
  return (entry,) if isinstance(entry, str) else tuple(entry)


def mesh_layout():
  """(mesh, batch axes, head axes) of the mesh and logical rules in force, or None outside a
  mesh (one device: the kernel is called directly)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return None
  spec = nn.logical_to_mesh_axes(('batch', 'length', 'heads', 'kv'))
  if spec is None:  # No logical rules in force: nothing is split.
    return mesh, (), ()
  return mesh, _mesh_axes(spec[0]), _mesh_axes(spec[2])


def divisible_axes(mesh, axes: tuple, size: int) -> tuple:
  """`axes` if their devices divide an array dimension of `size`, else () (not split: every
  device computes it whole). A batch of 1 row, as a model's init traces it under a mesh whose
  batch axes span 2 devices, cannot be split over them."""
  devices = int(np.prod([mesh.shape[a] for a in axes])) if axes else 1
  return axes if size % devices == 0 else ()


def splash_attention(q, k, v, segment_ids, positions, head_patterns, *, block_size: int,
                     scale: float, dtype, interpret: bool):
  """Attention of each head over its pattern with the splash kernel.

  Args:
    q, k, v: (batch, length, heads, head_dim).
    segment_ids: (batch, length) document ids.
    positions: (batch, length) positions within each (contiguous) document.
    head_patterns: one pattern object per head.
    block_size: kernel tile length, a multiple of BLOCK_MULTIPLE; a sequence that it does not
      divide is padded at the end (causal patterns: no real query sees the padding).
    scale: logit multiplier.
    dtype: output dtype.
    interpret: run the kernel as plain JAX (only for a CPU target).

  Returns:
    (batch, length, heads, head_dim); a query that sees no key outputs zeros, as on the
    other paths.
  """
  _, n, h, _ = q.shape
  block = block_size
  if block % BLOCK_MULTIPLE:
    raise ValueError(f"attention_impl='splash' needs model.attention_block_size (now {block}) "
                     f"to be a multiple of {BLOCK_MULTIPLE}; change it or use "
                     "attention_impl='blocksparse'")
  seg = segment_ids.astype(jnp.int32)
  if (str(jax.config.jax_default_matmul_precision).lower() in FULL_PRECISION
      and jnp.dtype(q.dtype).itemsize < 4):
    # Mosaic computes a 16-bit matmul only at its own precision ("Bad lhs type" at HIGHEST):
    # the full float32 products asked for process-wide are products of float32 inputs.
    q, k, v = (a.astype(jnp.float32) for a in (q, k, v))
  pad = -n % block
  if pad:  # Padding keys come after every real query, so the causal patterns never see them.
    q, k, v = (jnp.pad(a, ((0, 0), (0, pad), (0, 0), (0, 0))) for a in (q, k, v))
    seg = jnp.pad(seg, ((0, 0), (0, pad)), constant_values=-1)
  layout = mesh_layout()
  batch_axes, head_axes = (layout[1], layout[2]) if layout else ((), ())
  if layout:
    batch_axes = divisible_axes(layout[0], batch_axes, q.shape[0])
  head_shards = int(np.prod([layout[0].shape[a] for a in head_axes])) if head_axes else 1
  if h % head_shards:
    raise ValueError(f'{h} heads cannot be split over the mesh axes {head_axes} '
                     f'({head_shards} devices)')
  kernel = _kernel(tuple(head_patterns), n + pad, block, interpret, head_shards)

  def attend(kernel, q, k, v, seg):
    def one(qb, kb, vb, sb):
      ids = sk.SegmentIds(q=sb, kv=sb)
      return kernel(jnp.swapaxes(qb * scale, 0, 1), jnp.swapaxes(kb, 0, 1),
                    jnp.swapaxes(vb, 0, 1), segment_ids=ids)
    return jnp.swapaxes(jax.vmap(one)(q, k, v, seg), 1, 2)  # (b, n, h, d)

  if layout is None:
    out = attend(kernel, q, k, v, seg)
  else:
    mesh = layout[0]
    rows = P(batch_axes or None, None, head_axes or None, None)
    kernel_spec = kernel.manual_sharding_spec(NamedSharding(mesh, P(head_axes or None, None)))
    out = jax.shard_map(attend, mesh=mesh,
                        in_specs=(kernel_spec, rows, rows, rows, P(batch_axes or None, None)),
                        out_specs=rows, check_vma=False)(kernel, q, k, v, seg)
  out = out[:, :n]
  latest = np.stack([patterns.latest_allowed(p, n, i) for i, p in enumerate(head_patterns)])
  doc_start = jnp.arange(n)[None, :] - positions  # (b, n)
  sees_any = jnp.asarray(latest)[None] >= doc_start[:, None, :]  # (b, h, n)
  out = jnp.where(jnp.swapaxes(sees_any, 1, 2)[..., None], out, 0)
  return out.astype(dtype)
