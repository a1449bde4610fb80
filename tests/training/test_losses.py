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


def test_accuracy_is_the_first_arg_max_with_ties():
  # One-hot hidden states and an identity projection: the logits are chosen row by row. Ties
  # count for the first index reaching the max only (jnp.argmax's rule), so a diverged model's
  # equal logits score 1 / vocab at most, not 1.
  logits = np.array([[0., 0., 0., 0.],    # All equal: only target 0 is right.
                     [0., 0., 0., 0.],
                     [1., 3., 3., 2.],    # Tie at 1 and 2: 1 is right, 2 is not.
                     [1., 3., 3., 2.],
                     [5., 1., 2., 5.],    # Tie at 0 and 3; target 3 is not right.
                     [0., 1., 4., 2.]],   # Unique max at 2.
                    np.float32)
  targets = np.array([[0, 2, 1, 2, 3, 2]], np.int32)
  want = np.asarray(jnp.argmax(logits, -1) == targets[0])
  assert want.tolist() == [True, False, True, False, False, True]
  x = jnp.asarray(logits)[None]
  w = jnp.eye(4, dtype=jnp.float32)
  for chunk in (1, 2, 6):
    _, correct = losses.linear_cross_entropy(x, w, jnp.asarray(targets),
                                             jnp.ones((1, 6), jnp.float32), chunk)
    assert float(correct) == want.sum()
  per_row = [float(losses.linear_cross_entropy(x[:, i:i + 1], w, jnp.asarray(targets[:, i:i + 1]),
                                               jnp.ones((1, 1), jnp.float32), 1)[1])
             for i in range(6)]
  assert per_row == want.astype(float).tolist()
