"""The fused, chunked projection + cross-entropy equals the plain computation."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from training import losses


def _plain(x, w, targets, weights):
  logits = jnp.einsum('btd,dv->btv', x, w)
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
  correct = jnp.argmax(logits, -1) == targets
  return jnp.sum(ce * weights), jnp.sum(correct * weights)


def _inputs(b=3, t=16, d=8, v=11, seed=0):
  k = jax.random.split(jax.random.key(seed), 4)
  x = jax.random.normal(k[0], (b, t, d))
  w = jax.random.normal(k[1], (d, v))
  targets = jax.random.randint(k[2], (b, t), 0, v)
  weights = (jax.random.uniform(k[3], (b, t)) > 0.3).astype(jnp.float32)
  return x, w, targets, weights


@pytest.mark.parametrize('chunk', [1, 4, 16, 5, 0])  # 5 and 0 fall back to one chunk.
def test_values_and_gradients_match_plain(chunk):
  x, w, targets, weights = _inputs()
  fused = losses.linear_cross_entropy(x, w, targets, weights, chunk)
  plain = _plain(x, w, targets, weights)
  np.testing.assert_allclose(fused[0], plain[0], rtol=1e-5)
  np.testing.assert_allclose(fused[1], plain[1])
  grad_fused = jax.grad(lambda x, w: 0.7 * losses.linear_cross_entropy(
      x, w, targets, weights, chunk)[0], argnums=(0, 1))(x, w)
  grad_plain = jax.grad(lambda x, w: 0.7 * _plain(x, w, targets, weights)[0],
                        argnums=(0, 1))(x, w)
  for a, b in zip(grad_fused, grad_plain):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_zero_weight_positions_do_not_contribute():
  x, w, targets, weights = _inputs()
  weights = weights.at[:, ::2].set(0.0)
  g = jax.grad(lambda x: losses.linear_cross_entropy(x, w, targets, weights, 4)[0])(x)
  np.testing.assert_array_equal(g[:, ::2], 0.0)
  assert np.all(np.abs(g[:, 1::2]).sum(-1)[weights[:, 1::2] > 0] > 0)


def test_jit_and_bfloat16_inputs():
  x, w, targets, weights = _inputs()
  f = jax.jit(lambda x, w: losses.linear_cross_entropy(x, w, targets, weights, 8))
  loss, _ = f(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16))
  assert loss.dtype == jnp.float32
  np.testing.assert_allclose(loss, _plain(x, w, targets, weights)[0], rtol=2e-2)
