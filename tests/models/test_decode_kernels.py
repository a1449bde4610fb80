"""Tests for decoding's CPU kernels (kernels/decode_cpu.cc through models/attention/cpu_kernel.py).

* skinny_matmul equals jnp.dot for 1-16 rows and widths 16 does not divide (the column tail),
  depths 8 does not divide; more rows, other dtypes and a missing library go to jnp.dot.
* decode_attention equals the plain-JAX reference over random masks, reads no slot at or past
  `live` (they hold NaN here), and gives zeros for a head that may attend to nothing.
* A decoding step's compiled program calls both kernels, training's calls neither, and the
  step's logits equal the plain-JAX step's (kernel library turned off).

Without a C++ compiler (and no cached build) the kernel tests are skipped with the reason.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import decode, layers, transformer
from models.attention import cpu_kernel

pytestmark = pytest.mark.cpu_only  # CPU custom calls; elsewhere the plain-JAX path runs.


@pytest.fixture(scope='module')
def _kernel_build() -> str | None:
  try:
    cpu_kernel._load()  # pylint: disable=protected-access
  except cpu_kernel.KernelUnavailable as e:
    return f'CPU kernels unavailable (needs a C++ compiler): {str(e).splitlines()[0]}'
  return None


@pytest.fixture(autouse=True)
def built_kernel(_kernel_build):
  if _kernel_build is not None:
    pytest.skip(_kernel_build)


def _rand(rng, *shape):
  return jnp.asarray(rng.standard_normal(shape, np.float32))


@pytest.mark.parametrize('m,k,n', [(1, 1024, 1024), (3, 37, 259), (8, 512, 1536), (8, 24, 7),
                                   (11, 100, 33), (16, 129, 64)])
def test_skinny_matmul_equals_dot(m, k, n):
  rng = np.random.default_rng(m * k + n)
  x, w = _rand(rng, m, k), _rand(rng, k, n)
  got = jax.jit(cpu_kernel.skinny_matmul)(x, w)
  want = jnp.dot(x, w, precision='highest')
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.sqrt(k))
  assert 'zoo_skinny_matmul' in jax.jit(cpu_kernel.skinny_matmul).lower(x, w).as_text()


# More rows than decoding's, other dtypes, one row of a small weight (XLA's matvec is faster).
@pytest.mark.parametrize('x_shape,dtype', [((17, 32), jnp.float32), ((4, 32), jnp.bfloat16),
                                           ((1, 32), jnp.float32)])
def test_skinny_matmul_leaves_other_products_to_xla(x_shape, dtype):
  rng = np.random.default_rng(0)
  x, w = _rand(rng, *x_shape).astype(dtype), _rand(rng, 32, 40).astype(dtype)
  assert 'zoo_skinny_matmul' not in jax.jit(cpu_kernel.skinny_matmul).lower(x, w).as_text()
  np.testing.assert_array_equal(cpu_kernel.skinny_matmul(x, w), jnp.dot(x, w))
  # The output head asks for float32 logits whatever the compute dtype.
  wide = cpu_kernel.skinny_matmul(x, w, preferred_element_type=jnp.float32)
  assert wide.dtype == jnp.float32
  np.testing.assert_array_equal(wide, jnp.dot(x, w, preferred_element_type=jnp.float32))


def _reference(q, k, v, allowed, live, scale):
  """Plain softmax over the allowed slots below live, zeros where a head sees none."""
  n = int(live)
  logits = jnp.einsum('bhd,bhcd->bhc', q, k[:, :, :n]) * scale
  mask = allowed[None, :, :n]
  probs = jax.nn.softmax(jnp.where(mask, logits, -jnp.inf), axis=-1)
  out = jnp.einsum('bhc,bhcd->bhd', jnp.where(mask, probs, 0), v[:, :, :n])
  return jnp.where(mask.any(-1)[..., None], out, 0)


@pytest.mark.parametrize('live', [1, 13, 40])
def test_decode_attention_equals_reference_and_reads_only_live_slots(live):
  rng = np.random.default_rng(live)
  b, h, c, d = 2, 3, 40, 16
  q, k, v = _rand(rng, b, h, d), _rand(rng, b, h, c, d), _rand(rng, b, h, c, d)
  allowed = jnp.asarray(rng.random((h, c)) < 0.6).at[1].set(False)  # Head 1 sees nothing.
  want = _reference(q, k, v, allowed, live, 0.25)
  # Slots at and past `live` are empty: NaN there must not reach the output.
  k, v = (a.at[:, :, live:].set(jnp.nan) for a in (k, v))
  # What other platforms would run: NaN here, so the output shows that the kernel ran.
  reference = lambda q, *_: jnp.full(q.shape, jnp.nan)  # noqa: E731
  got = jax.jit(lambda *a: cpu_kernel.decode_attention(*a, scale=0.25, reference=reference))(
      q, k, v, allowed, jnp.int32(live))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(got[:, 1], 0)


def _dense_model():
  cfg = transformer.TransformerConfig.from_config(dict(
      d=0, d_model=64, n_heads=4, n_layers=2, vocab_size=70, max_len=96, attention='dense',
      attention_impl='xla', stack='unrolled'))
  model = transformer.Decoder(cfg)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 70, (5, 30)))
  return model, jax.jit(model.init)(jax.random.key(0), tokens)['params'], tokens  # One program.


def test_decoding_step_runs_the_kernels_and_training_does_not():
  model, params, tokens = _dense_model()
  cache = decode.init_cache(model, params, tokens.shape[0])
  step = jax.jit(lambda c, t: decode.step(model, params, c, t, 3)).lower(cache, tokens[:, 3])
  assert 'zoo_skinny_matmul' in step.as_text()
  assert 'zoo_decode_attention' in step.as_text()
  forward = jax.jit(lambda p, t: model.apply({'params': p}, t)).lower(params, tokens).as_text()
  assert 'zoo_skinny_matmul' not in forward and 'zoo_decode_attention' not in forward
  # layers.matmul takes the kernel only inside decoding_matmuls.
  x, w = jnp.ones((4, 32)), jnp.ones((32, 40))
  with layers.decoding_matmuls():
    assert 'zoo_skinny_matmul' in jax.jit(lambda *a: layers.matmul(*a)).lower(x, w).as_text()
  assert 'zoo_skinny_matmul' not in jax.jit(lambda *a: layers.matmul(*a)).lower(x, w).as_text()


def test_decoding_with_the_kernels_equals_the_plain_jax_step(monkeypatch):
  model, params, tokens = _dense_model()

  def run():
    cache = decode.init_cache(model, params, tokens.shape[0])
    step = jax.jit(lambda c, t, i: decode.step(model, params, c, t, i))
    out = []
    for i in range(tokens.shape[1]):
      logits, cache = step(cache, tokens[:, i], i)
      out.append(logits)
    return jnp.stack(out, 1)

  with_kernels = run()
  monkeypatch.setattr(cpu_kernel, 'available', lambda: False)
  without = run()
  np.testing.assert_allclose(with_kernels, without, rtol=2e-5, atol=2e-5)
  full = jax.jit(model.apply)({'params': params}, tokens)
  np.testing.assert_allclose(with_kernels, full, rtol=2e-5, atol=2e-5)
