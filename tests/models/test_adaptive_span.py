"""Adaptive and dynamic attention span against the paper's formulas (section 2.2).

The attention is checked against a brute-force loop over (t, r) written from eq. 1-3 and the
masked softmax; trimmed compute, the segment cache and decoding against the full forward.
Every computation is jitted whole: run eagerly, a gradient dispatches (and compiles) each
operation of the blocked loops alone, about ten times the one compile of the jitted program.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from configs import default
from models import attention, decode, transformer
from models.attention import adaptive_span as A, blockloop
from training import optimizer, steps

S, R = 24, 4
# adaptive_span's options (config.model.attention_options.adaptive_span); dynamic_span has
# them too, and its own b at init.
OPTIONS = dict(limit=S, ramp=R, init=0.0, penalty=2e-6, trim_multiple=4, learned=True, memory=False)
DYNAMIC_OPTIONS = {**OPTIONS, 'bias': -4.0}


def _brute(q, k, v, q_seg, k_seg, rel, z, scale):
  """Eq. 1-3 with the soft mask, one (t, r) pair at a time; memory = k.len - q.len."""
  q, k, v, rel, z = (np.asarray(a, np.float64) for a in (q, k, v, rel, z))
  b, n, h, _ = q.shape
  m = k.shape[1] - n
  out = np.zeros(q.shape)
  for bi in range(b):
    for t in range(n):
      for hh in range(h):
        zt = z[hh] if z.ndim == 1 else z[bi, t, hh]
        num, den = 0.0, 0.0
        for r in range(k.shape[1]):
          x = m + t - r
          if not 1 <= x <= rel.shape[0] or q_seg[bi, t] != k_seg[bi, r]:
            continue
          s = q[bi, t, hh] @ (k[bi, r, hh] + rel[x - 1]) * scale       # eq. 1
          mask = min(max((R + zt - x) / R, 0.0), 1.0)                     # m_z(x)
          num, den = num + mask * np.exp(s) * v[bi, r, hh], den + mask * np.exp(s)
        out[bi, t, hh] = num / den if den > 0 else 0.0
  return out


def _inputs(n=29, memory=5, heads=3, d=8, seed=0):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.normal(size=(2, n, heads, d)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(2, memory + n, heads, d)), jnp.float32) for _ in 'kv')
  q_seg = np.ones((2, n), np.int32)
  q_seg[1, 11:] = 2  # Row 1 packs two documents.
  k_seg = np.concatenate([np.array([[1] * memory, [-1] * memory]), q_seg], axis=1)
  rel = jnp.asarray(rng.normal(size=(S, d)), jnp.float32)
  return q, k, v, jnp.asarray(q_seg), jnp.asarray(k_seg), rel


@functools.partial(jax.jit, static_argnames=('span', 'block', 'platform'))
def _attend(q, k, v, q_seg, k_seg, rel, z, span=S, block=8, platform='cpu'):
  return A.span_attention(q, k, v, q_seg, k_seg, rel, z, ramp=R, span=span, block=block,
                          scale=q.shape[-1] ** -0.5, dtype=jnp.float32, platform=platform,
                          keep_layers=1)


def test_soft_mask_is_the_formula():
  x = np.arange(0, 40, dtype=np.float32)
  for z in (0.0, 3.5, 17.0):
    expected = np.clip((R + z - x) / R, 0, 1)
    np.testing.assert_allclose(A.soft_mask(x, z, R), expected, rtol=0, atol=1e-7)


def test_gradient_reaches_z_only_through_the_ramp():
  z = 10.0
  grad = jax.vmap(jax.grad(lambda x, z: A.soft_mask(x, z, R), argnums=1), in_axes=(0, None))(
      jnp.arange(1.0, 20.0) + 0.5, z)
  x = np.arange(1.0, 20.0) + 0.5
  inside = (x > z) & (x < z + R)
  np.testing.assert_allclose(np.asarray(grad)[inside], 1.0 / R, rtol=1e-6)
  assert np.all(np.asarray(grad)[~inside] == 0)
  # Through the attention: no key beyond z -> no gradient to z; keys on the ramp -> some.
  q, k, v, q_seg, k_seg, rel = _inputs()

  def loss(z):
    return jnp.sum(_attend(q, k, v, q_seg, k_seg, rel, z) ** 2)

  assert float(jnp.abs(jax.jit(jax.grad(loss))(jnp.full((3,), S - R + 0.0))).max()) > 0
  short = _inputs(n=3, memory=0)
  g = jax.jit(jax.grad(lambda z: jnp.sum(_attend(*short, z) ** 2)))(jnp.full((3,), 5.0))
  assert float(jnp.abs(g).max()) == 0  # Distances <= 2 < z: every weight has mask 1.


@pytest.mark.parametrize('dynamic', [False, True])
@pytest.mark.parametrize('platform', ['cpu', 'tpu'])  # Their relative terms' forms differ.
def test_attention_equals_the_papers_formulas(dynamic, platform):
  q, k, v, q_seg, k_seg, rel = _inputs()
  rng = np.random.default_rng(1)
  z = (rng.uniform(0, S, size=(2, q.shape[1], 3)) if dynamic else np.array([0.0, 6.5, 19.0]))
  out = _attend(q, k, v, q_seg, k_seg, rel, jnp.asarray(z, jnp.float32), platform=platform)
  expected = _brute(q, k, v, np.asarray(q_seg), np.asarray(k_seg), rel, z, 8 ** -0.5)
  np.testing.assert_allclose(out, expected, atol=2e-5)


@pytest.mark.parametrize('loops', [False, True], ids=['short_row', 'loops'])
def test_the_accelerators_path_gives_the_same_gradients(loops, monkeypatch):
  # An accelerator gathers the relative term (shifted, the enwik8 recipe's train step did not
  # fit a v5e chip) and recomputes the weights in the backward; a CPU keeps them
  # (blockloop.KEEP_PAIRS): the same sums and gradients. Short rows are unrolled; `loops` runs
  # these 4 query blocks as the long rows' loops.
  if loops:
    monkeypatch.setattr(blockloop, 'PLAIN_BLOCKS', 0)
  q, k, v, q_seg, k_seg, rel = _inputs()
  z = jnp.asarray([1.0, 6.5, 19.0])

  def loss(accelerator, q, k, v, z, rel):
    return jnp.sum(jnp.sin(_attend(q, k, v, q_seg, k_seg, rel, z,
                                   platform='tpu' if accelerator else 'cpu')))

  whole = jax.jit(jax.value_and_grad(lambda *a: loss(False, *a), argnums=(0, 1, 2, 3, 4)))(
      q, k, v, z, rel)
  split = jax.jit(jax.value_and_grad(lambda *a: loss(True, *a), argnums=(0, 1, 2, 3, 4)))(
      q, k, v, z, rel)
  np.testing.assert_allclose(whole[0], split[0], rtol=1e-5)
  for a, b in zip(whole[1], split[1]):
    np.testing.assert_allclose(a, b, atol=1e-5)


def test_a_token_does_not_attend_to_itself():
  # The first query of a document without memory sees no key: eq. 2 sums over t-S .. t-1.
  q, k, v, q_seg, k_seg, rel = _inputs(memory=0)
  out = _attend(q, k, v, q_seg, k_seg, rel, jnp.full((3,), 8.0))
  assert float(jnp.abs(out[:, 0]).max()) == 0 and float(jnp.abs(out[1, 11]).max()) == 0
  assert float(jnp.abs(out[:, 1]).max()) > 0


def test_trimmed_equals_untrimmed_outputs_and_gradients():
  q, k, v, q_seg, k_seg, rel = _inputs()
  z = jnp.asarray([1.0, 5.5, 9.2])
  trim = A.trimmed_span(9.2, ramp=R, limit=S, multiple=4)
  assert trim == 16 < S

  def loss(span, q, k, v, z, rel):
    return jnp.sum(jnp.sin(_attend(q, k, v, q_seg, k_seg, rel, z, span=span)))

  full = jax.jit(jax.value_and_grad(lambda *a: loss(S, *a), argnums=(0, 1, 2, 3, 4)))(
      q, k, v, z, rel)
  trimmed = jax.jit(jax.value_and_grad(lambda *a: loss(trim, *a), argnums=(0, 1, 2, 3, 4)))(
      q, k, v, z, rel)
  np.testing.assert_allclose(full[0], trimmed[0], rtol=1e-5)
  for a, b in zip(full[1], trimmed[1]):
    np.testing.assert_allclose(a, b, atol=1e-5)
  # Too short a trim drops keys the ramp still weighs.
  short = _attend(q, k, v, q_seg, k_seg, rel, z, span=8)
  assert float(jnp.abs(short - _attend(q, k, v, q_seg, k_seg, rel, z)).max()) > 1e-3


def test_trimmed_span_rounds_up_to_blocks():
  assert A.trimmed_span(0.0, ramp=32, limit=1024, multiple=64) == 64
  assert A.trimmed_span(32.0, ramp=32, limit=1024, multiple=64) == 64
  assert A.trimmed_span(32.5, ramp=32, limit=1024, multiple=64) == 128
  assert A.trimmed_span(1024.0, ramp=32, limit=1024, multiple=64) == 1024


def _model(name='adaptive_span', memory=False, max_len=48, **extra):
  own = DYNAMIC_OPTIONS if name == 'dynamic_span' else OPTIONS
  cfg = transformer.TransformerConfig.from_config(dict(
      d=0, d_model=32, n_heads=2, n_layers=2, vocab_size=40, max_len=max_len, attention=name,
      position_embedding='none', attention_impl='blocksparse', attention_block_size=8,
      attention_options={name: {**own, 'memory': memory, **extra}}, stack='unrolled'))
  return transformer.Decoder(cfg)


def _apply(model, params, tokens, **kwargs):
  """model.apply, jitted (one compile, not one per operation)."""
  return jax.jit(functools.partial(model.apply, **kwargs))({'params': params}, tokens)


def _init(model, tokens):
  return jax.jit(model.init)(jax.random.key(0), tokens)


def _set_spans(params, fractions):
  params = jax.tree.map(lambda a: a, nn.unbox(params))
  for i, f in enumerate(fractions):
    params[f'block_{i}']['attention']['span_fraction'] = jnp.asarray(f, jnp.float32)
  return params


def test_penalty_equals_its_formula_and_spans_are_logged():
  model = _model()
  tokens = jnp.zeros((2, 16), jnp.int32)
  params = _set_spans(_init(model, tokens)['params'], [[0.25, 0.5], [0.0, 1.0]])
  _, sown = _apply(model, params, tokens, mutable=['losses', 'metrics'])
  lam, m = OPTIONS['penalty'], 2
  expected = lam / m * S * (0.25 + 0.5) + lam / m * S * (0.0 + 1.0)  # (lambda / M) sum_i z_i
  np.testing.assert_allclose(float(steps.sum_collection(sown['losses'])), expected, rtol=1e-6)
  logged = steps.sown_metrics(sown['metrics'])
  assert logged['span_max/block_1'] == pytest.approx(S) and logged['span_mean/block_0'] == 9.0


def test_z_stays_in_zero_to_s_after_updates():
  config = default.get_config()
  config.learning_rate, config.warmup_steps, config.total_steps = 0.1, 0, 10
  tx = optimizer.make_optimizer(config, attention.traits.of('adaptive_span').param_bounds({}))
  params = {'attention': {'span_fraction': jnp.asarray([0.999, 0.001, 0.5]),
                          'other': jnp.asarray([0.999, 0.001, 0.5])}}
  state = tx.init(params)
  grads = {'attention': {'span_fraction': jnp.asarray([-1.0, 1.0, 1.0]),
                         'other': jnp.asarray([-1.0, 1.0, 1.0])}}
  for _ in range(3):
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
  z = np.asarray(params['attention']['span_fraction'])
  assert z[0] == 1.0 and z[1] == 0.0 and 0 < z[2] < 0.5  # Clamped at the box, else free.
  other = np.asarray(params['attention']['other'])
  assert other[0] > 1.0 and other[1] < 0.0  # Only the span parameter is boxed.


def test_with_trims_follows_the_largest_span_per_layer():
  model = _model()
  params = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))['params']
  cfg = transformer.specialized(model.config, _set_spans(params, [[0.1, 0.2], [0.0, 0.0]]))
  assert cfg.options_of('adaptive_span')['trim'] == (12, 4)  # ceil(4.8 + 4) -> 12; R -> 4
  same = transformer.specialized(model.config, _set_spans(params, [[0.1, 0.3], [0.0, 0.0]]))
  assert same == cfg  # 7.2 + 4 still rounds to 12: the compiled step is reused.
  assert transformer.specialized(model.config, _set_spans(params, [[0.1, 0.34], [0.0, 0.0]])) != cfg


def test_trimmed_model_equals_untrimmed_model():
  model = _model()
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 40, (2, 24)))
  params = _set_spans(_init(model, tokens)['params'], [[0.1, 0.3], [0.0, 0.5]])
  trimmed = transformer.Decoder(transformer.specialized(model.config, params))
  assert trimmed.config.options_of('adaptive_span')['trim'] == (12, 16)
  np.testing.assert_allclose(_apply(trimmed, params, tokens), _apply(model, params, tokens),
                             atol=2e-5)


def test_a_stale_trim_computes_the_full_span():
  """The loop reads z only at its log steps: a model trimmed for smaller spans than its
  parameters now have computes all S keys (outputs and gradients of the untrimmed model),
  and the trim is used while it still covers every z. The trimmed and untrimmed models'
  forward and backward compile once each (one jitted program returns the outputs and the
  gradients)."""
  model = _model()
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 40, (2, 24)))
  small = _set_spans(_init(model, tokens)['params'], [[0.1, 0.2], [0.0, 0.0]])
  stale = transformer.Decoder(transformer.specialized(model.config, small))
  assert stale.config.options_of('adaptive_span')['trim'] == (12, 4)
  grown = _set_spans(small, [[0.1, 0.6], [0.0, 0.5]])  # z + R: 13.6 > 12 and 12 > 4

  def outputs_and_gradients(m):
    def loss(p):
      out = m.apply({'params': p}, tokens)
      return jnp.sum(out ** 2), out
    (_, out), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(grown)
    return out, grads

  (stale_out, stale_grads), (full_out, full_grads) = map(outputs_and_gradients, (stale, model))
  np.testing.assert_allclose(stale_out, full_out, atol=2e-5)
  for a, b in zip(jax.tree.leaves(stale_grads), jax.tree.leaves(full_grads)):
    np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)
  # With the spans it was trimmed for, the trimmed model is not the S-wide computation's
  # program: it holds a conditional whose taken branch computes T keys.
  text = jax.jit(lambda p: stale.apply({'params': p}, tokens)).lower(small).as_text()
  assert 'case' in text or 'cond' in text


def test_segment_cache_equals_one_pass_over_the_concatenation():
  n = 16
  model = _model(memory=True, max_len=2 * n)
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, 40, (2, 2 * n)))
  variables = _init(model, tokens[:, :n])
  params = _set_spans(variables['params'], [[0.3, 0.9], [0.5, 1.0]])  # z up to S = 24 > n
  segment = jax.jit(functools.partial(model.apply, mutable=['memory']))
  first, mutated = segment({'params': params, 'memory': variables['memory']}, tokens[:, :n])
  second, _ = segment({'params': params, 'memory': mutated['memory']}, tokens[:, n:])
  plain = _model(memory=False, max_len=2 * n)
  whole = _apply(plain, params, tokens)
  np.testing.assert_allclose(first, whole[:, :n], atol=2e-5)
  np.testing.assert_allclose(second, whole[:, n:], atol=2e-5)
  # Without the cache the second segment differs (it would not see the first).
  alone = _apply(plain, params, tokens[:, n:])
  assert float(jnp.abs(alone - whole[:, n:]).max()) > 1e-3


@pytest.mark.parametrize('name', ['adaptive_span', 'dynamic_span'])
def test_decoding_with_the_trimmed_cache_equals_the_full_forward(name):
  model = _model(name)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 40, (2, 24)))
  params = _init(model, tokens)['params']
  if name == 'adaptive_span':
    params = _set_spans(params, [[0.1, 0.3], [0.0, 0.2]])
  else:  # A non-zero v makes the spans differ per token.
    params = jax.tree.map(lambda a: a, nn.unbox(params))
    for i in range(2):
      att = params[f'block_{i}']['attention']
      att['span_v'] = jax.random.normal(jax.random.key(i), att['span_v'].shape)
  model = transformer.Decoder(transformer.specialized(model.config, params))
  full = _apply(model, params, tokens)
  np.testing.assert_allclose(decode.score(model, params, tokens), full, atol=3e-5, rtol=3e-5)
  if name == 'adaptive_span':  # Per-layer caches of T = 12 and 12 keys instead of max_len 48.
    assert decode.cache_bytes(decode.init_cache(model, params, 2)) == 2 * 2 * (12 + 12) * 2 * 16 * 4


def test_dynamic_span_starts_small_and_varies_per_token():
  model = _model('dynamic_span')
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 40, (4, 32)))
  params = nn.unbox(_init(model, tokens)['params'])
  _, sown = _apply(model, params, tokens, mutable=['metrics'])
  logged = steps.sown_metrics(sown['metrics'])
  small = S * float(jax.nn.sigmoid(-4.0))  # b = -4 at init: z_t = S sigmoid(-4) = 0.43
  assert logged['span_mean/block_0'] == pytest.approx(small, rel=1e-5)
  assert logged['span_max/block_0'] == pytest.approx(small, rel=1e-5)

  # A few steps of training on next-token loss move v, so spans differ between tokens.
  config = default.get_config()
  config.learning_rate, config.warmup_steps, config.total_steps = 0.05, 0, 10
  tx = optimizer.make_optimizer(config, attention.traits.of('dynamic_span').param_bounds({}))
  batch = {'inputs': tokens, 'targets': jnp.roll(tokens, -1, axis=1),
           'weights': jnp.ones(tokens.shape, jnp.float32),
           'positions': jnp.broadcast_to(jnp.arange(32), tokens.shape),
           'segment_ids': jnp.ones(tokens.shape, jnp.int32)}
  state = steps.TrainState(step=jnp.zeros((), jnp.int32), params=params,
                           opt_state=tx.init(params))
  train_step = jax.jit(steps.make_train_step(model, tx, optimizer.make_schedule(config)))
  for _ in range(5):
    state, _ = train_step(state, batch, jax.random.key(0))
  att = state.params['block_0']['attention']
  z_tokens = S * jax.nn.sigmoid(
      jnp.einsum('btd,dh->bth', jax.random.normal(jax.random.key(1), (2, 8, 32)),
                 att['span_v']) + att['span_b'])
  assert float(jnp.abs(att['span_v']).max()) > 0 and float(jnp.std(z_tokens)) > 1e-4


def test_invalid_span_options_are_rejected():
  group = r'model\.attention_options\.adaptive_span'
  # The declared ranges (Option.bounds), in the run settings' words; trim is the variant's own.
  for bad, match in [({'limit': 0}, r'\.limit must be an integer >= 1, got 0'),
                     ({'ramp': 0}, r'\.ramp must be an integer >= 1, got 0'),
                     ({'init': 1.5}, r'\.init must be a finite number in \[0, 1\], got 1.5'),
                     ({'penalty': -1.0}, r'\.penalty must be a finite number >= 0, got -1.0'),
                     ({'trim_multiple': 0}, r'\.trim_multiple must be an integer >= 1, got 0'),
                     ({'trim': (4,)}, ': trim')]:
    with pytest.raises(ValueError, match=group + match):
      _model(**bad)




def test_the_relative_term_is_gathered_on_accelerators_and_for_short_spans():
  """An accelerator's program reads the relative term at each pair (a gather): shifted by a
  reshape of the flattened products, the enwik8 recipe's train step took 25.3 GiB per v5e chip
  of 16 (14.2 gathered), which only a compile for the TPU shows (minutes: the slow test of
  tests/contracts/test_paper_recipes.py). A CPU shifts it (faster there) unless the span is
  at most half the distances of a block's pairs (the shift would multiply q by all of them).
  Counted in the traced program of one layer's gradient, against the CPU's with a long span
  (which gathers only its embeddings): queries in blocks of 16 on the CPU, whose pairs span 62
  distances with S = 32 (shifted) and 38 with S = 8 (gathered)."""
  n = 64

  def gathers(platform, limit=32):
    cfg = transformer.TransformerConfig.from_config(dict(
        d=0, d_model=32, n_heads=2, n_layers=1, vocab_size=40, max_len=n,
        attention='adaptive_span', position_embedding='none', attention_impl='blocksparse',
        attention_options={'adaptive_span': {**OPTIONS, 'limit': limit}}, stack='unrolled',
        attention_block_size=16, target_platform=platform))
    model = transformer.Decoder(cfg)
    tokens = jnp.zeros((1, n), jnp.int32)
    params = jax.eval_shape(model.init, jax.random.key(0), tokens)['params']
    return str(jax.make_jaxpr(
        jax.grad(lambda p: jnp.sum(model.apply({'params': p}, tokens))))(params)).count('gather[')

  cpu = gathers('cpu')
  assert gathers('tpu') > cpu and gathers('gpu') > cpu and gathers('cpu', limit=8) > cpu
