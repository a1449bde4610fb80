"""The attention math every path shares: the masks, the dense reference and the causal
blocked path (the paths the kernels are tested against; models/attention/dispatch.py picks
among them)."""

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


def block_attention(q, k, v, segment_ids, *, key_range, allowed, block_size, scale, dtype):
  """Attention computed query block by query block over a static range of keys.

  For each query block [s, e), only keys in key_range(s, e) are multiplied; `allowed`
  masks inside that range. The work is proportional to the blocks the pattern touches,
  not to n^2 (for causal attention it is about half of the dense work). Queries never see
  keys of another document.

  Args:
    q: (batch, length, heads, head_dim) queries.
    k: (batch, length, heads, head_dim) keys.
    v: (batch, length, heads, head_dim) values.
    segment_ids: (batch, length) document ids.
    key_range: (q_start, q_end) -> (k_start, k_end), Python ints: the keys any query of
      the block may see.
    allowed: (i, j) -> (q, k) bool pattern for absolute query indices i (shape (q, 1)) and
      key indices j (shape (1, k)).
    block_size: query block length.
    scale: multiplier of the logits.
    dtype: dtype of the probabilities fed to the value matmul.

  Returns:
    (batch, length, heads, head_dim).
  """
  n = q.shape[1]
  if block_size < 1:
    raise ValueError(f'attention block size must be >= 1, got {block_size}')
  # Head-major once, so that slicing blocks along the sequence needs no further transposes.
  qh, kh, vh = (jnp.swapaxes(a, 1, 2) for a in (q, k, v))  # (b, h, n, d)
  outputs = []
  for qs in range(0, n, block_size):
    qe = min(qs + block_size, n)
    ks, ke = key_range(qs, qe)
    same_doc = segment_ids[:, None, qs:qe, None] == segment_ids[:, None, None, ks:ke]
    mask = allowed(jnp.arange(qs, qe)[:, None], jnp.arange(ks, ke)[None, :]) & same_doc
    logits = jnp.einsum('bhqd,bhkd->bhqk', qh[:, :, qs:qe], kh[:, :, ks:ke],
                        preferred_element_type=jnp.float32) * scale
    logits = jnp.where(mask, logits, NEG_INF)
    # softmax(l) v = (exp(l - m) v) / sum exp(l - m): dividing the (q, d) output rather than
    # the (q, k) probabilities saves a pass over the largest tensor, forward and backward.
    e = jnp.exp(logits - jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True)))
    out = jnp.einsum('bhqk,bhkd->bhqd', e.astype(dtype), vh[:, :, ks:ke],
                     preferred_element_type=jnp.float32)
    outputs.append((out / jnp.sum(e, axis=-1, keepdims=True)).astype(dtype))
  return jnp.swapaxes(jnp.concatenate(outputs, axis=2), 1, 2)
