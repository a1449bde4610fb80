"""Output projection fused with cross-entropy, computed over chunks of the sequence.

Materializing (tokens, vocab) logits, their softmax and their gradient costs several
passes over the largest tensors of the step (134 MB each at 4096 tokens x 8K vocab). This
computes the projection, the loss and, when differentiated, the gradients chunk by chunk,
so only (batch, chunk, vocab) blocks ever exist. The FLOPs are those of the plain
computation; the batch axis stays whole in every chunk, so data-parallel sharding holds.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np


def _split(a, chunk):
  """(b, t, ...) -> (t / chunk, b, chunk, ...), the scan axis first."""
  b, t = a.shape[:2]
  return jnp.swapaxes(a.reshape((b, t // chunk, chunk) + a.shape[2:]), 0, 1)


def _merge(a):
  """Inverse of _split."""
  a = jnp.swapaxes(a, 0, 1)
  return a.reshape((a.shape[0], a.shape[1] * a.shape[2]) + a.shape[3:])


def _chunk_len(t: int, chunk: int) -> int:
  return chunk if 0 < chunk < t and t % chunk == 0 else t


def _chunk_stats(x, w, t, wt):
  """Loss and accuracy sums of one chunk, plus its softmax."""
  logits = jnp.einsum('bcd,dv->bcv', x, w, preferred_element_type=jnp.float32)
  m = jnp.max(logits, axis=-1)
  e = jnp.exp(logits - m[..., None])
  s = jnp.sum(e, axis=-1)
  target_logit = jnp.take_along_axis(logits, t[..., None], axis=-1)[..., 0]
  loss = jnp.sum(wt * (m + jnp.log(s) - target_logit))
  # Correct iff the target is the arg-max (ties: the first index), so all-equal logits of a
  # diverged model do not count as right: the target reaches the max and no earlier index
  # does. Counted as a plain float sum: jnp.argmax is a two-operand reduction that XLA:CPU
  # runs unvectorized (the d=4 train step 8-12% slower), and a max of -index over the maxima
  # became an int32 reduce-window tree there (2-3% of the d=4 step on an Intel Xeon;
  # results/train_step_d4_intel_xeon_ab.json).
  index = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
  earlier = jnp.sum(jnp.where((logits == m[..., None]) & (index < t[..., None]), 1.0, 0.0),
                    axis=-1)
  correct = jnp.sum(wt * ((target_logit == m) & (earlier == 0)))
  return loss, correct, e / s[..., None]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def linear_cross_entropy(x, w, targets, weights, chunk: int = 128):
  """Weighted sums of cross-entropy and accuracy of the logits x @ w.

  Args:
    x: (batch, length, d_model) final hidden states.
    w: (d_model, vocab) output projection.
    targets: (batch, length) int target ids.
    weights: (batch, length) loss weights; treated as constants (no gradient).
    chunk: sequence positions per chunk; must divide length, else one chunk is used.

  Returns:
    (loss_sum, correct_sum): sum of weights * cross-entropy, and sum of weights over the
    positions whose arg-max logit (the first on ties) is the target.
  """
  chunk = _chunk_len(x.shape[1], chunk)

  def body(carry, xs):
    xc, t, wt = xs
    loss, correct, _ = _chunk_stats(xc, w, t, wt)
    return (carry[0] + loss, carry[1] + correct), None

  zero = jnp.zeros((), jnp.float32)
  sums, _ = jax.lax.scan(body, (zero, zero), (_split(x, chunk), _split(targets, chunk),
                                              _split(weights, chunk)))
  return sums


def _fwd(x, w, targets, weights, chunk):
  """The forward pass that also forms d(loss_sum)/dx and d(loss_sum)/dw chunk by chunk."""
  chunk = _chunk_len(x.shape[1], chunk)

  def body(carry, xs):
    loss_acc, correct_acc, dw = carry
    xc, t, wt = xs
    loss, correct, probs = _chunk_stats(xc, w, t, wt)
    # dCE/dlogits = softmax - onehot(target), times the token's weight (one exp per logit).
    onehot = jax.nn.one_hot(t, probs.shape[-1], dtype=probs.dtype)
    dlogits = ((probs - onehot) * wt[..., None]).astype(xc.dtype)
    dx = jnp.einsum('bcv,dv->bcd', dlogits, w, preferred_element_type=jnp.float32)
    dw = dw + jnp.einsum('bcd,bcv->dv', xc, dlogits, preferred_element_type=jnp.float32)
    return (loss_acc + loss, correct_acc + correct, dw), dx.astype(xc.dtype)

  zero = jnp.zeros((), jnp.float32)
  (loss, correct, dw), dx = jax.lax.scan(
      body, (zero, zero, jnp.zeros(w.shape, jnp.float32)),
      (_split(x, chunk), _split(targets, chunk), _split(weights, chunk)))
  return (loss, correct), (_merge(dx), dw.astype(w.dtype), targets, weights)


def _bwd(chunk, residuals, cotangents):
  del chunk
  dx, dw, targets, weights = residuals
  g = cotangents[0]  # The accuracy count has no gradient.
  no_grad_targets = np.zeros(targets.shape, jax.dtypes.float0)  # Integer input.
  return ((g * dx).astype(dx.dtype), (g * dw).astype(dw.dtype), no_grad_targets,
          jnp.zeros_like(weights))


linear_cross_entropy.defvjp(_fwd, _bwd)
