"""Selective attention decoding with K_l-slot caches and context pruning (section 4).

Unlimited budgets equal the full forward; a budget of at least the context changes nothing;
<BOS> is never evicted; each eviction takes the kept token with the highest F; the pruned
full forward (the eviction as a mask) equals pruned decoding.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from selective_kit import forward as _forward, model as _model, params as _params

from models import decode
from models.attention import selective as SEL
from training import pruning


def _decode_all(model, params, tokens, inspect_cache=None):
  cache = decode.init_cache(model, params, tokens.shape[0])
  run = jax.jit(lambda c, tok, t: decode.step(model, params, c, tok, t))
  out = []
  for t in range(tokens.shape[1]):
    if inspect_cache is not None:
      inspect_cache(t, cache, 'before')
    logits, cache = run(cache, tokens[:, t], t)
    if inspect_cache is not None:
      inspect_cache(t, cache, 'after')
    out.append(logits)
  return jnp.stack(out, 1), cache


@pytest.mark.parametrize('opts', [{}, {'shift': False}, {'separate_bilinear': True}],
                         ids=['paper', 'noshift', 'bilinear'])
def test_decoding_with_unlimited_budget_equals_the_full_forward(opts):
  model = _model(**opts)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 40, (2, 24)))
  params = _params(model, tokens)
  full = _forward(model, params, tokens)
  stepped, _ = _decode_all(model, params, tokens)
  np.testing.assert_allclose(stepped, full, atol=1e-5, rtol=1e-5)
  if opts:
    return
  # A budget of at least the context length changes nothing.
  big = _model(budgets=(24, 30), **opts)
  np.testing.assert_allclose(_decode_all(big, params, tokens)[0], full, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(_forward(big, params, tokens), full, atol=1e-5)


def test_pruned_decoding_respects_budgets_never_evicts_bos_and_evicts_the_highest_f():
  budgets = (4, 6)
  # Without the <BOS> constraint the <BOS> can get the highest F: it must still stay.
  model = _model(budgets=budgets, mask_bos=False)
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, 40, (2, 24)))
  params = _params(model, tokens)
  seen = {'evictions': 0, 'bos_top': 0}
  before = {}

  def check(t, cache, when):
    for layer, k_l in enumerate(budgets):
      c = jax.device_get(cache[f'block_{layer}']['attention'])
      pos, f = np.asarray(c['position']), np.asarray(c['F'])
      assert pos.shape[1] == k_l  # the cache holds K_l slots, so at most K_l tokens
      if when == 'before':
        before[layer] = (pos.copy(), f.copy())
        continue
      kept = pos[pos >= 0].reshape(2, -1)
      assert kept.shape[1] == min(t + 1, k_l)
      assert np.all((pos == 0).sum(axis=1) == 1), f'<BOS> evicted at step {t}'
      assert np.all((pos == t).sum(axis=1) == 1)
      if t >= k_l:  # One eviction: the kept non-<BOS> token with the highest F.
        old_pos, old_f = before[layer]
        for row in range(2):
          gone = sorted(set(old_pos[row]) - set(pos[row]))
          assert len(gone) == 1
          cand = {p: fv for p, fv in zip(old_pos[row], old_f[row]) if p > 0}
          top = max(cand.values())
          assert cand[gone[0]] == top and gone[0] == min(p for p, fv in cand.items() if fv == top)
          seen['evictions'] += 1
          bos_f = old_f[row][list(old_pos[row]).index(0)]
          seen['bos_top'] += int(bos_f > top)

  stepped, _ = _decode_all(model, params, tokens, check)
  assert seen['evictions'] == 2 * sum(24 - k for k in budgets)
  assert seen['bos_top'] > 0  # <BOS> had the highest F at least once and was kept.
  # The pruned full forward (the kept mask) gives what decoding gives.
  np.testing.assert_allclose(_forward(model, params, tokens), stepped, atol=1e-4, rtol=1e-4)
  full = _forward(_model(mask_bos=False), params, tokens)
  assert float(jnp.abs(full - stepped).max()) > 1e-3  # pruning changed something
  # The KV cache shrinks by the reported factor sum_l N / sum_l K_l (48 / 10).
  unlimited = decode.cache_bytes(decode.init_cache(_model(), params, 2))
  pruned = decode.cache_bytes(decode.init_cache(model, params, 2))
  assert unlimited / pruned == pytest.approx(pruning.memory_reduction(budgets, 24)) == 4.8


def test_kept_mask_matches_a_loop():
  rng = np.random.default_rng(2)
  seg = np.array([[1] * 9 + [2] * 7 + [0] * 2], np.int32)
  e = rng.uniform(0, 3, size=(1, 18, 18)).astype(np.float32)
  bos = np.asarray(SEL.bos_flags(jnp.asarray(seg)))
  got = np.asarray(SEL.kept_mask(jnp.asarray(e), jnp.asarray(bos), 3))
  kept = []
  for i in range(18):
    if bos[0, i]:
      kept = []
    if len(kept) >= 3:
      cand = [j for j in kept if not bos[0, j]]
      kept.remove(max(cand, key=lambda j: (e[0, i, j], -j)))
    kept.append(i)
    want = np.zeros(18, bool)
    want[kept] = True
    np.testing.assert_array_equal(got[0, i], want)


def test_budgets_through_the_pruning_collection_equal_static_budgets():
  model = _model()
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, 40, (2, 24)))
  params = _params(model, tokens)
  pruning = {f'block_{i}': {'attention': {'budget': jnp.asarray(k, jnp.int32)}}
             for i, k in enumerate((5, 3))}
  dynamic = jax.jit(lambda p, r: model.apply({'params': p, 'pruning': r}, tokens))(
      params, pruning)
  static = _forward(_model(budgets=(5, 3)), params, tokens)
  np.testing.assert_allclose(dynamic, static, atol=1e-6)
