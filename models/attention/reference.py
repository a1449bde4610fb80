"""The attention math every path shares: the masks and the dense reference (the path the
kernels are tested against; models/attention/dispatch.py picks among them; the blocked paths
are loops in blockloop.py)."""

import jax
import jax.numpy as jnp

# Masked logits get this instead of -inf so a fully masked row (padding) gives a uniform
# distribution rather than NaN; such rows carry zero loss weight.
NEG_INF = -1e30


def causal_segment_mask(segment_ids: jax.Array) -> jax.Array:
  """Boolean (batch, q, k) mask: key j is visible to query i iff j <= i and same document.

  Args:
    segment_ids: (batch, length) int document ids of packed sequences (0 = padding).

  Returns:
    (batch, length, length) bool mask.
  """
  n = segment_ids.shape[-1]
  causal = jnp.arange(n)[:, None] >= jnp.arange(n)[None, :]
  same_doc = segment_ids[:, :, None] == segment_ids[:, None, :]
  return causal[None] & same_doc


def reference_attention(q, k, v, mask, *, scale, dtype):
  """softmax(q k^T * scale + mask) v with float32 scores: the dense reference path.

  Args:
    q: (batch, q_len, heads, head_dim) queries.
    k: (batch, k_len, heads, head_dim) keys.
    v: (batch, k_len, heads, head_dim) values.
    mask: bool, broadcastable to (batch, heads, q_len, k_len).
    scale: multiplier of the logits.
    dtype: dtype of the probabilities fed to the value matmul.

  Returns:
    (batch, q_len, heads, head_dim) attention output.
  """
  logits = jnp.einsum('bqhd,bkhd->bhqk', q, k, preferred_element_type=jnp.float32) * scale
  return jnp.einsum('bhqk,bkhd->bqhd', masked_softmax(logits, mask, dtype), v)


def masked_softmax(logits, mask, dtype):
  """softmax over the last axis of float32 logits where `mask` is True, cast to `dtype`."""
  return jax.nn.softmax(jnp.where(mask, logits, NEG_INF), axis=-1).astype(dtype)
