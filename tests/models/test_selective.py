"""Selective attention against the paper's figure 2 sketch, eq. 2 and section 4's pruning.

The sketch is re-written here in numpy, line for line from figure 2 (with the constraint
switches of appendix A.4-A.5), independently of models/attention/selective.py.
"""

import itertools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from selective_kit import ALL_ON, model as _model, params as _params

from models import transformer
from models.attention import selective as SEL

ABLATIONS = [{}, {'shift': False}, {'relu': False}, {'mask_bos': False}, {'mask_diag': False}]


def _sketch(q, k, v, *, shift=True, relu=True, mask_bos=True, mask_diag=True, qs=None, ks=None):
  """Figure 2 for one document: q, k, v (b, n, h, d); qs, ks (b, n, d): a separate form."""
  q, k, v = (np.asarray(a, np.float64).transpose(0, 2, 1, 3) for a in (q, k, v))  # bhnd
  n, dk = q.shape[2], q.shape[3]
  causal_mask = np.tril(np.ones((n, n), bool))
  attn_logits = np.einsum('bhnd,bhmd->bhnm', q, k) / np.sqrt(dk)
  attn_logits = np.where(causal_mask, attn_logits, -np.inf)
  if qs is None:
    S = attn_logits[:, 0].copy()                          # Select head 0.
  else:
    S = np.einsum('bnd,bmd->bnm', np.asarray(qs, np.float64), np.asarray(ks, np.float64))
    S = np.where(causal_mask, S / np.sqrt(dk), -np.inf)
  if relu:
    S = np.maximum(S, 0)                                  # Only positive selection.
  else:
    S = np.where(causal_mask, S, 0)                       # (ReLU zeroed the -inf entries.)
  if mask_bos:
    S[..., 0] = 0                                         # Do not mask <BOS>.
  if mask_diag:
    S = (1 - np.eye(n)) * S                               # Do not mask self.
  if shift:
    S = np.roll(S, 1, -2)
    S[..., 0, :] = 0                                      # Mask strictly in the future.
  F = np.cumsum(S, axis=-2)                               # Accumulate.
  attn_logits = attn_logits - F[:, None]
  w = np.exp(attn_logits - attn_logits.max(-1, keepdims=True))
  w = w / w.sum(-1, keepdims=True)
  return np.einsum('bhnm,bhmd->bnhd', w, v), F


def _qkv(b=2, n=29, h=3, d=8, seed=0, scale=2.0):
  rng = np.random.default_rng(seed)
  return [jnp.asarray(scale * rng.normal(size=(b, n, h, d)), jnp.float32) for _ in 'qkv']


def _attend(q, k, v, segment_ids, impl='xla', selection=None, block=8, **opts):
  b, n, h, d = q.shape
  module = SEL.SelectiveAttention(num_heads=h, head_dim=d, qk_norm=False, impl=impl,
                                  block_size=block, max_len=n, num_layers=2,
                                  options=tuple(sorted({**ALL_ON, **opts}.items())))
  return jax.jit(lambda q, k, v, seg, sel: module.apply(
      {}, q, k, v, positions=None, segment_ids=seg, deterministic=True, extra=sel,
      method='attend', mutable=['losses', 'intermediates']))(q, k, v, segment_ids, selection)


@pytest.mark.parametrize('impl', ['xla', 'blocksparse', 'fused'])
@pytest.mark.parametrize('ablation', ABLATIONS, ids=lambda a: ','.join(a) or 'paper')
def test_equals_the_figure_2_sketch(impl, ablation):
  q, k, v = _qkv()
  seg = jnp.ones(q.shape[:2], jnp.int32)
  out, sown = _attend(q, k, v, seg, impl=impl, **ablation)
  switches = {**ALL_ON, **ablation}
  want, f = _sketch(q, k, v, **switches)
  np.testing.assert_allclose(out, want, atol=2e-5)
  np.testing.assert_allclose(sown['intermediates']['selection_F'][0], f[0], rtol=1e-5,
                             atol=1e-4)
  # The switch matters: the paper's setting differs from this ablation's sketch.
  if ablation:
    other, _ = _sketch(q, k, v)
    assert np.abs(other - want).max() > 1e-3


@pytest.mark.parametrize('impl', ['xla', 'blocksparse'])
def test_separate_bilinear_selection_equals_the_sketch(impl):
  q, k, v = _qkv()
  rng = np.random.default_rng(5)
  qs, ks = (jnp.asarray(2 * rng.normal(size=q.shape[:2] + (q.shape[-1],)), jnp.float32)
            for _ in 'qk')
  seg = jnp.ones(q.shape[:2], jnp.int32)
  out, _ = _attend(q, k, v, seg, impl=impl, selection=(qs, ks))
  want, _ = _sketch(q, k, v, qs=qs, ks=ks)
  np.testing.assert_allclose(out, want, atol=2e-5)
  assert np.abs(_sketch(q, k, v)[0] - want).max() > 1e-3


def _packed():
  seg = np.ones((2, 29), np.int32)
  seg[1, 11:] = 2  # Row 1 packs two documents; its second one starts at 11 (its <BOS>).
  seg[1, 25:] = 0  # and ends with padding.
  return jnp.asarray(seg)


def test_packed_documents_select_only_inside_themselves():
  q, k, v = _qkv()
  seg = _packed()
  out, _ = _attend(q, k, v, seg)
  alone, _ = _attend(q[1:, 11:25], k[1:, 11:25], v[1:, 11:25], jnp.ones((1, 14), jnp.int32))
  np.testing.assert_allclose(out[1, 11:25], alone[0], atol=2e-5)
  first, _ = _attend(q[1:, :11], k[1:, :11], v[1:, :11], jnp.ones((1, 11), jnp.int32))
  np.testing.assert_allclose(out[1, :11], first[0], atol=2e-5)
  # Without the document start as <BOS>, the second document's output would differ.
  unmasked, _ = _attend(q[1:, 11:25], k[1:, 11:25], v[1:, 11:25], jnp.ones((1, 14), jnp.int32),
                        mask_bos=False)
  assert np.abs(unmasked[0] - alone[0]).max() > 1e-3


@pytest.mark.parametrize('ablation', [{}, {'shift': False}], ids=['shift', 'noshift'])
def test_blocksparse_equals_reference_values_and_gradients(ablation):
  q, k, v = _qkv()
  seg = _packed()
  rng = np.random.default_rng(3)
  qs, ks = (jnp.asarray(rng.normal(size=(2, 29, 8)), jnp.float32) for _ in 'qk')
  opts = {'lmem_eps': 0.1, **ablation}

  def loss(impl, q, k, v, qs, ks):
    out, sown = _attend(q, k, v, seg, impl=impl, selection=(qs, ks), **opts)
    aux = sum(jnp.sum(x) for x in jax.tree.leaves(sown['losses']))
    return jnp.sum(jnp.sin(out) * (seg > 0)[..., None, None]) + 10 * aux

  ref = jax.jit(jax.value_and_grad(lambda *a: loss('xla', *a), argnums=(0, 1, 2, 3, 4)))(
      q, k, v, qs, ks)
  blk = jax.jit(jax.value_and_grad(lambda *a: loss('blocksparse', *a), argnums=(0, 1, 2, 3, 4)))(
      q, k, v, qs, ks)
  np.testing.assert_allclose(blk[0], ref[0], rtol=1e-5)
  for a, b in zip(ref[1], blk[1]):
    np.testing.assert_allclose(b, a, atol=1e-4, rtol=1e-4)
    assert float(jnp.abs(a).max()) > 0


def _m_loop(f, seg, tau):
  """M_i = i - sum_{k=1}^{i} min(F_{i,k}, tau) / tau per document, one entry at a time."""
  total = 0.0
  for b in range(seg.shape[0]):
    for doc in sorted(set(seg[b].tolist()) - {0}):
      idx = [t for t in range(seg.shape[1]) if seg[b, t] == doc]
      best = -np.inf
      for pos, i in enumerate(idx, start=1):  # i-th token of the document (1-based)
        m = pos - sum(min(f[b, i, kk], tau) / tau for kk in idx[:pos])
        best = max(best, m)
      total += best
  return total


def test_memory_loss_equals_eq_2_on_a_hand_built_f():
  rng = np.random.default_rng(0)
  seg = np.array([[1, 1, 1, 1, 2, 2, 2, 0], [3, 3, 3, 3, 3, 3, 3, 3]], np.int32)
  f = rng.uniform(0, 2.5, size=(2, 8, 8)).astype(np.float32)
  f[0, 3, :4] = [0.0, 0.0, 0.2, 0.5]  # a low-F row: the max of document 1
  mask = np.asarray(transformer.attention.causal_segment_mask(jnp.asarray(seg)))
  for tau in (1.0, 0.5):
    got = SEL.memory_term(jnp.asarray(f), jnp.asarray(mask), jnp.asarray(seg), tau=tau)
    np.testing.assert_allclose(float(got), _m_loop(f, seg, tau), rtol=1e-6)
  # Through the model: eps sum_l max_i M^l_i / (L n_{!=pad}) with each layer's F.
  model = _model(lmem_eps=0.1)
  tokens = jnp.asarray(rng.integers(0, 40, (2, 8)))
  params = _params(model, tokens)
  _, sown = jax.jit(lambda p: model.apply({'params': p}, tokens, segment_ids=jnp.asarray(seg),
                                          mutable=['losses', 'intermediates']))(params)
  n_real = int((seg > 0).sum())
  want = 0.0
  for layer in range(2):  # selection_F holds row 0 only: build the loss from row 0.
    fl = np.asarray(sown['intermediates'][f'block_{layer}']['attention']['selection_F'][0])
    want += 0.1 * _m_loop(fl[None], seg[:1], 1.0) / (2 * n_real)
  _, sown0 = jax.jit(lambda p: model.apply({'params': p}, tokens[:1],
                                           segment_ids=jnp.asarray(seg[:1]),
                                           mutable=['losses']))(params)
  got = sum(float(jnp.sum(x)) for x in jax.tree.leaves(sown0['losses']))
  np.testing.assert_allclose(got, want * n_real / int((seg[:1] > 0).sum()), rtol=1e-5)
  assert got > 0
  # Traced only (shapes, nothing compiled): what it sows is the same.
  off = jax.eval_shape(lambda p: _model().apply({'params': p}, tokens, mutable=['losses']),
                       params)[1]
  assert not jax.tree.leaves(off.get('losses', {}))  # eps = 0: no L_mem


def test_invalid_options_are_rejected():
  group = r'model.attention_options.selective'
  for bad, match in [({'shift': 1}, group + r'.shift \(.*\) must be True or False, got 1'),
                     ({'lmem_eps': -0.1}, group + r'.lmem_eps must be a finite number >= 0 '
                                           r'\(0 = no L_mem\), got -0.1'),
                     ({'lmem_tau': 0.0}, group + r'.lmem_tau must be a finite number > 0, got 0.0'),
                     ({'budgets': (8,)}, group + r': budgets=\(8,\)'),
                     ({'budgets': (8, 1)}, group + r': budgets=\(8, 1\)')]:
    with pytest.raises(ValueError, match=match):
      _model(**bad)
  with pytest.raises(ValueError, match='splash'):
    q, k, v = _qkv(n=8)
    _attend(q, k, v, jnp.ones((2, 8), jnp.int32), impl='splash')


def test_every_switch_combination_in_the_model_config_follows_the_sketch():
  """Each of the 16 combinations of the four constraint switches, set through the model
  config, reaches every layer's attention: its output and F equal figure 2's sketch with the
  same switches (on that layer's own q, k, v), and the 16 models' logits all differ."""
  tokens = jnp.asarray(np.random.default_rng(7).integers(0, 40, (2, 24)))
  params = _params(_model(), tokens)
  logits = {}
  for combo in itertools.product([False, True], repeat=4):
    opts = dict(zip(sorted(ALL_ON), combo))
    seen = []

    def capture(next_fun, args, kwargs, context, seen=seen):
      out = next_fun(*args, **kwargs)
      if context.method_name == 'attend':
        seen.append((context.module.layer_index, args[:3], out))
      return out

    with nn.intercept_methods(capture):  # Eager: the captured arrays are concrete.
      logits[combo], sown = _model(**opts).apply({'params': params}, tokens,
                                                 mutable=['intermediates'])
    assert sorted(layer for layer, _, _ in seen) == [0, 1], opts
    for layer, (q, k, v), out in seen:
      want, f = _sketch(q, k, v, **opts)
      np.testing.assert_allclose(out, want, atol=2e-5, err_msg=f'{opts} layer {layer}')
      got_f = sown['intermediates'][f'block_{layer}']['attention']['selection_F'][0]
      np.testing.assert_allclose(got_f, f[0], rtol=1e-5, atol=1e-4, err_msg=f'{opts}')
  for a, b in itertools.combinations(logits, 2):
    assert np.abs(np.asarray(logits[a]) - np.asarray(logits[b])).max() > 1e-4, (a, b)


def test_separate_bilinear_adds_counted_parameters():
  tokens = jnp.zeros((1, 8), jnp.int32)
  for bilinear in (False, True):
    model = _model(separate_bilinear=bilinear)
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), tokens))['params']
    count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    assert count == model.config.num_params()
  assert count == _model().config.num_params() + 2 * (2 * 32 * 16 + 2 * 16)  # 2 layers
