"""Selective attention's blocked path ('blocksparse': the blocked engine of blockloop.py with F's
column sums as its carried state): its values, F, M_i and gradients equal the dense path's for
every switch, and its program does not grow with the sequence length."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from selective_kit import ALL_ON

from models.attention import blockloop
from models.attention import selective as SEL

SWITCHES = [{}, {'shift': False}, {'relu': False}, {'mask_bos': False}, {'mask_diag': False},
            {'shift': False, 'relu': False, 'mask_bos': False, 'mask_diag': False},
            {'lmem_eps': 0.1}, {'lmem_eps': 0.1, 'lmem_tau': 0.5, 'shift': False}]


def _inputs(n, separate, b=2, h=3, d=8, seed=0):
  rng = np.random.default_rng(seed)
  q, k, v = (jnp.asarray(2.0 * rng.normal(size=(b, n, h, d)), jnp.float32) for _ in 'qkv')
  sel = tuple(jnp.asarray(2.0 * rng.normal(size=(b, n, d)), jnp.float32)
              for _ in 'qk') if separate else None
  seg = np.ones((b, n), np.int32)
  seg[0, n // 3:] = 2          # row 0: two documents, then padding
  seg[0, n - n // 5:] = 0
  return q, k, v, sel, jnp.asarray(seg)


def _module(impl, block, n, h, d, **opts):
  return SEL.SelectiveAttention(num_heads=h, head_dim=d, qk_norm=False, impl=impl,
                                block_size=block, max_len=n, num_layers=2,
                                options=tuple(sorted({**ALL_ON, **opts}.items())))


def _loss(impl, block, seg, mutable, opts):
  def loss(q, k, v, sel):
    b, n, h, d = q.shape
    out, sown = _module(impl, block, n, h, d, **opts).apply(
        {}, q, k, v, positions=None, segment_ids=seg, deterministic=True, extra=sel,
        method='attend', mutable=mutable)
    aux = sum(jnp.sum(x) for x in jax.tree.leaves(sown.get('losses', {})))
    return jnp.sum(jnp.sin(out) * (seg > 0)[..., None, None]) + 10 * aux, sown
  return loss


def _switch_cases():
  """Every switch in CI, the paper's setting in both forms (head 0's q, k and the separate
  bilinear), each other switch in one form, alternating; its other form (which repeats the
  checks the form makes with another switch) runs under -m slow."""
  cases = []
  for i, opts in enumerate(SWITCHES):
    for separate in (False, True):
      name = ','.join(f'{k}={v}' for k, v in opts.items()) or 'paper'
      ci = i == 0 or separate == (i % 2 == 1)
      cases.append(pytest.param(opts, separate, marks=() if ci else pytest.mark.slow,
                                id=f'{name}-{"separate" if separate else "head0"}'))
  return cases


@pytest.mark.parametrize('opts,separate', _switch_cases())
def test_loop_values_and_gradients_equal_the_dense_path(opts, separate):
  n = 40  # 3 blocks of 16, the last one padded
  q, k, v, sel, seg = _inputs(n, separate)
  args = (q, k, v, sel)
  argnums = (0, 1, 2, 3) if separate else (0, 1, 2)
  grads = {impl: jax.jit(jax.value_and_grad(_loss(impl, 16, seg, ['losses'], opts),
                                            argnums=argnums, has_aux=True))(*args)
           for impl in ('xla', 'blocksparse')}
  (want, want_sown), want_g = grads['xla']
  (got, got_sown), got_g = grads['blocksparse']
  np.testing.assert_allclose(got, want, rtol=1e-5)
  if opts.get('lmem_eps'):
    np.testing.assert_allclose(got_sown['losses']['selective_lmem'],
                               want_sown['losses']['selective_lmem'], rtol=1e-5)
  for a, b in zip(jax.tree.leaves(want_g), jax.tree.leaves(got_g)):
    np.testing.assert_allclose(b, a, atol=1e-4, rtol=1e-4)
    assert float(jnp.abs(a).max()) > 0


@pytest.mark.parametrize('n,block', [(32, 8), (29, 8), (20, 64)], ids=['whole', 'padded', 'one'])
def test_loop_f_and_output_equal_the_dense_path(n, block):
  q, k, v, sel, seg = _inputs(n, False, seed=1)
  outs = {}
  for impl in ('xla', 'blocksparse'):
    outs[impl] = jax.jit(lambda q, k, v, impl=impl: _loss(
        impl, block, seg, ['losses', 'intermediates'], {'lmem_eps': 0.1})(
            q, k, v, None))(q, k, v)
  (want, want_sown), (got, got_sown) = outs['xla'], outs['blocksparse']
  np.testing.assert_allclose(got, want, rtol=1e-5)
  np.testing.assert_allclose(got_sown['intermediates']['selection_F'][0],
                             want_sown['intermediates']['selection_F'][0], rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(got_sown['losses']['selective_lmem'],
                             want_sown['losses']['selective_lmem'], rtol=1e-5)


def test_program_does_not_grow_with_the_sequence_length():
  """The lowered forward and backward (with L_mem and the separate form) is the same size at
  4 and at 63 blocks: the loops' bodies appear once, no O(n) constants. (63: from
  blockloop.CPU_LONG_ROW queries on a CPU the block would double.)"""
  sizes = []
  for n in (256, blockloop.CPU_LONG_ROW - 64):
    b, h, d = 1, 2, 16
    q = jax.ShapeDtypeStruct((b, n, h, d), jnp.float32)
    sel = (jax.ShapeDtypeStruct((b, n, d), jnp.float32),) * 2
    seg = jax.ShapeDtypeStruct((b, n), jnp.int32)

    def loss(q, k, v, sel, seg):
      return _loss('blocksparse', 64, seg, ['losses'], {'lmem_eps': 0.1})(
          q, k, v, sel)[0]

    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).lower(q, q, q, sel, seg).as_text()
    sizes.append(len(text))
  assert sizes[1] < 1.05 * sizes[0], sizes
