"""Segment memory: a layer attends into the inputs it saw in earlier segments (Dai et al., 2019).

A variant that keeps state across segments says how much through
`MultiHeadAttention.memory_spec`; the shared `__call__` then calls `extend`, which declares the
variables below in the 'memory' collection. Each variable's fill value (an empty slot) is
declared here too, so the training loop creates, carries, checkpoints and resets memory
without knowing which variant holds it (`fresh`).

With data.packing='stream', row r of consecutive batches continues one text, so the cached
inputs are the previous segment of the same stream.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

COLLECTION = 'memory'
# Logical axes of the cached inputs.
AXES = ('batch', 'length', 'embed')
# Value of an empty slot, per variable: no input, and document id -1 (no query's document).
FILL = {'hidden': 0, 'segment_ids': -1}


@dataclasses.dataclass(frozen=True)
class Spec:
  """How much of the past a layer keeps and reads.

  Attributes:
    keep: inputs cached per row (the longest reach any later segment may need).
    use: the most recent cached inputs prepended to this segment (<= keep).
  """
  keep: int
  use: int

  def __post_init__(self):
    if not 1 <= self.use <= self.keep:
      raise ValueError(f'segment memory must use between 1 and keep={self.keep} cached '
                       f'inputs, got {self.use}')


def extend(module: nn.Module, x, segment_ids, spec: Spec):
  """[the last `spec.use` cached inputs; x] and their document ids; caches x's last inputs.

  Called from a module's compact method: the variables are that module's.

  Args:
    module: the attention module holding the memory.
    x: (batch, n, d_model) this segment's inputs.
    segment_ids: (batch, n) their document ids.
    spec: how much to keep and to read.

  Returns:
    (context (batch, use + n, d_model) in the module's dtype, its document ids (batch,
    use + n)); cached inputs carry no gradient.
  """
  b, _, d_model = x.shape
  hidden = module.variable(COLLECTION, 'hidden', nn.with_logical_partitioning(
      lambda shape, dtype: jnp.full(shape, FILL['hidden'], dtype), AXES),
      (b, spec.keep, d_model), module.dtype)
  ids = module.variable(COLLECTION, 'segment_ids', nn.with_logical_partitioning(
      lambda shape: jnp.full(shape, FILL['segment_ids'], jnp.int32), ('batch', 'length')),
      (b, spec.keep))
  past, past_ids = nn.unbox(hidden.value), nn.unbox(ids.value)
  if past.shape[0] != b:
    raise ValueError(f'the segment memory holds {past.shape[0]} rows but the batch has {b}: '
                     'carry the memory of the same batch size')
  start = spec.keep - spec.use
  context = jnp.concatenate([jax.lax.stop_gradient(past[:, start:]).astype(module.dtype),
                             x.astype(module.dtype)], axis=1)
  key_segment_ids = jnp.concatenate([past_ids[:, start:], segment_ids], axis=1)
  if module.is_mutable_collection(COLLECTION) and not module.is_initializing():
    hidden.value = jax.lax.stop_gradient(
        jnp.concatenate([past, x.astype(past.dtype)], axis=1)[:, -spec.keep:])
    ids.value = jnp.concatenate([past_ids, segment_ids], axis=1)[:, -spec.keep:]
  return context, key_segment_ids


def fill_value(path) -> int:
  """The empty-slot value of the memory variable at `path` (a jax tree path)."""
  name = getattr(path[-1], 'key', None)
  if name not in FILL:
    raise ValueError(f'memory variable {jax.tree_util.keystr(path)} has no declared fill value '
                     f'(models/attention/memory.py FILL)')
  return FILL[name]


def fresh(abstract_memory):
  """Empty memory shaped like `abstract_memory` (arrays or ShapeDtypeStructs): numpy arrays."""
  return jax.tree_util.tree_map_with_path(
      lambda path, a: np.full(a.shape, fill_value(path), a.dtype), abstract_memory)
