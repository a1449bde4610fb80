"""The Universal Transformer stack (models/universal.py): fixed steps against an unrolled stack
of identical layers, ACT's halting bookkeeping against hand computations, the early-stopping
inference loop and decoding against the training scan. Initialization, the models' forward
passes and gradients are jitted (eagerly, each operation is dispatched and compiled alone)."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import decode, residual, transformer, universal

D = 32
N = 12
VOCAB = 13


class CoordinatedPreLN(residual.PreLN):
  """pre_ln after adding the universal stack's coordinates of step layer_index + 1: what a
  fixed-step universal stack computes, as an unrolled stack of distinct layers."""

  def __call__(self, x, ctx):
    return super().__call__(universal.add_coordinates(x, ctx.positions, self.layer_index + 1),
                            ctx)


@pytest.fixture(autouse=True)
def _coordinated_block(monkeypatch):
  """CoordinatedPreLN as model.residual='test_coordinated_pre_ln' for this module's tests only
  (other modules check the list of known blocks)."""
  monkeypatch.setitem(residual.RESIDUALS._entries, 'test_coordinated_pre_ln', CoordinatedPreLN)


def _config(**overrides):
  """A universal model; the universal stack's options (steps, act, max_steps, ponder) among
  `overrides` go to model.stack_options."""
  stack_options = {'steps': 3, 'max_steps': 4}
  stack_options.update({k: overrides.pop(k) for k in list(overrides)
                        if k in universal.Universal.OPTIONS})
  m = dict(vocab_size=VOCAB, d_model=D, n_heads=2, max_len=N, attention='dense',
           stack='universal', dtype='float32', position_embedding='none',
           stack_options=stack_options)
  m.update(overrides)
  return transformer.TransformerConfig.from_config(m)


def _tokens(seed=0, batch=2):
  return jnp.asarray(np.random.RandomState(seed).randint(3, VOCAB, (batch, N)), jnp.int32)


def _packed():
  """Two documents in row 0 (positions restart at 5), padding at the end of row 1."""
  positions = np.tile(np.arange(N), (2, 1))
  positions[0, 5:] = np.arange(N - 5)
  segments = np.ones((2, N), np.int32)
  segments[0, 5:] = 2
  segments[1, 9:] = 0
  return jnp.asarray(positions, jnp.int32), jnp.asarray(segments)


def _params(config, seed=0):
  init = jax.jit(transformer.Decoder(config).init)
  return nn.unbox(init(jax.random.key(seed), _tokens())['params'])


def _apply(model, variables, x, mutable=False, **arrays):
  """model.apply, jitted (`arrays`: positions, segment_ids)."""
  return jax.jit(lambda v, x, a: model.apply(v, x, mutable=mutable, **a))(variables, x, arrays)


def _with_halting(params, kernel_scale=1.0, bias=None):
  """params with the halting unit's kernel scaled and its bias set."""
  halting = dict(params['universal']['step']['halting'])
  halting['kernel'] = halting['kernel'] * kernel_scale
  if bias is not None:
    halting['bias'] = jnp.asarray(bias, jnp.float32)
  step = {**params['universal']['step'], 'halting': halting}
  return {**params, 'universal': {'step': step}}


def _sown(config, params, x, **kwargs):
  logits, sown = _apply(transformer.Decoder(config), {'params': params}, x,
                        mutable=['intermediates', 'losses', 'metrics'], **kwargs)
  return logits, sown


def _unrolled_equivalent(config, params, steps):
  """An unrolled stack of `steps` coordinated pre_ln layers holding the universal block's
  weights, and its parameters."""
  unrolled = _config(stack='unrolled', n_layers=steps, residual='test_coordinated_pre_ln')
  block = params['universal']['step']['block']
  out = {k: v for k, v in params.items() if k != 'universal'}
  out.update({f'block_{i}': block for i in range(steps)})
  return unrolled, out


def test_fixed_steps_equal_an_unrolled_stack_with_identical_weights():
  config = _config(steps=3)
  params = _params(config)
  positions, segments = _packed()
  x = _tokens()
  got = _apply(transformer.Decoder(config), {'params': params}, x, positions=positions,
               segment_ids=segments)
  unrolled, unrolled_params = _unrolled_equivalent(config, params, 3)
  want = _apply(transformer.Decoder(unrolled), {'params': unrolled_params}, x,
                positions=positions, segment_ids=segments)
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
  # Two layers are not three steps: the comparison can fail.
  short, short_params = _unrolled_equivalent(config, params, 2)
  other = _apply(transformer.Decoder(short), {'params': short_params}, x, positions=positions,
                 segment_ids=segments)
  assert np.max(np.abs(np.asarray(other - want))) > 1e-2


def test_forced_halting_at_step_one_equals_one_application_of_the_block():
  config = _config(act=True)
  params = _with_halting(_params(config), bias=50.0)  # h ≈ 1 at the first step.
  x = _tokens()
  logits, sown = _sown(config, params, x)
  unrolled, unrolled_params = _unrolled_equivalent(config, params, 1)
  want = _apply(transformer.Decoder(unrolled), {'params': unrolled_params}, x)
  np.testing.assert_allclose(logits, want, atol=2e-5, rtol=1e-5)
  np.testing.assert_array_equal(sown['intermediates']['universal']['act_steps'][0], 1)
  np.testing.assert_allclose(sown['intermediates']['universal']['act_remainder'][0], 1.0)


def _varied():
  """An ACT model whose positions halt after different numbers of steps, some at the cap."""
  config = _config(act=True, max_steps=4)
  params = _with_halting(_params(config, seed=1), kernel_scale=3.0, bias=-0.5)
  return config, params


def test_halting_weights_sum_to_one_and_stop_at_n():
  config, params = _varied()
  positions, segments = _packed()
  _, sown = _sown(config, params, _tokens(), positions=positions, segment_ids=segments)
  got = sown['intermediates']['universal']
  steps = np.asarray(got['act_steps'][0])
  weights = np.asarray(got['step']['halting_weight'][0])  # (M, batch, length)
  assert len(np.unique(steps)) >= 2 and steps.max() == 4, steps  # Varied, and some capped.
  np.testing.assert_allclose(weights.sum(0), 1.0, atol=1e-6)
  assert (weights >= 0).all()
  after = np.arange(1, 5)[:, None, None] > steps[None]
  assert (weights[after] == 0).all()  # Nothing after a position's halting step.
  np.testing.assert_allclose(weights[steps - 1, np.arange(2)[:, None], np.arange(N)[None]],
                             got['act_remainder'][0], atol=1e-7)  # R at step N.


@pytest.mark.parametrize('max_steps, n, r', [(8, 4, 0.1), (3, 3, 0.4)])
def test_ponder_cost_and_output_on_fixed_halting_probabilities(max_steps, n, r):
  """h = 0.3 at every step: the sums 0.3, 0.6, 0.9, 1.2 reach 1 - ε at step 4, so N = 4 and
  R = 1 - 0.9; a cap M = 3 stops at N = 3 with R = 1 - 0.6. The output is the p-weighted
  mean of the fixed-step states s^1 .. s^N."""
  tau = 0.05
  config = _config(act=True, max_steps=max_steps, ponder=tau)
  params = _params(config)
  halting = {'kernel': jnp.zeros((D,)), 'bias': jnp.asarray(math.log(0.3 / 0.7))}
  ut = {'step': {'block': params['universal']['step']['block'], 'halting': halting}}
  x = jax.random.normal(jax.random.key(1), (2, N, D))
  positions, segments = _packed()
  ctx = residual.LayerContext(positions=positions, segment_ids=segments)
  out, sown = universal.UniversalLoop(config).apply({'params': ut}, x, ctx,
                                                    mutable=['losses', 'metrics'])
  np.testing.assert_allclose(sown['losses']['ponder_cost'][0], tau * (n + r), rtol=1e-5)
  np.testing.assert_allclose(sown['metrics']['act_steps'][0], n)
  np.testing.assert_allclose(sown['metrics']['ponder'][0], n + r, rtol=1e-5)
  np.testing.assert_allclose(sown['metrics'][f'halted_at_{n}'][0], 1.0)
  weights = [0.3] * (n - 1) + [r]
  want = 0
  for t, w in enumerate(weights, start=1):
    fixed = _config(steps=t)
    state = universal.UniversalLoop(fixed).apply(
        {'params': {'step': {'block': ut['step']['block']}}}, x, ctx)
    want = want + w * state
  np.testing.assert_allclose(out, want, atol=1e-5, rtol=1e-5)


def test_max_steps_caps_the_steps():
  config = _config(act=True, max_steps=3)
  params = _with_halting(_params(config), kernel_scale=0.0, bias=-50.0)  # h ≈ 0: never halts.
  _, sown = _sown(config, params, _tokens())
  np.testing.assert_array_equal(sown['intermediates']['universal']['act_steps'][0], 3)
  np.testing.assert_allclose(sown['intermediates']['universal']['act_remainder'][0], 1.0,
                             atol=1e-6)
  np.testing.assert_allclose(sown['metrics']['universal']['halted_at_3'][0], 1.0)
  np.testing.assert_allclose(sown['metrics']['universal']['ponder'][0], 4.0, atol=1e-5)


def test_padding_is_left_out_of_the_step_statistics():
  config, params = _varied()
  positions, segments = _packed()
  _, sown = _sown(config, params, _tokens(), positions=positions, segment_ids=segments)
  steps = np.asarray(sown['intermediates']['universal']['act_steps'][0])
  real = np.asarray(segments) > 0
  np.testing.assert_allclose(sown['metrics']['universal']['act_steps'][0], steps[real].mean(),
                             rtol=1e-6)
  assert steps[real].mean() != steps.mean()  # The padding would move it.


def test_parameter_count_is_one_block_plus_the_halting_unit():
  fixed = _config()
  act = _config(act=True)
  one_layer = _config(stack='unrolled', n_layers=1)
  assert fixed.num_params() == one_layer.num_params()
  assert act.num_params() == one_layer.num_params() + D + 1
  assert _config(steps=7).num_params() == fixed.num_params()


def test_inference_stops_early_with_the_training_scans_outputs():
  config, params = _varied()
  model = transformer.Decoder(config)
  x = _tokens()
  early = lambda p: model.apply({'params': p}, x)  # Deterministic: the while loop.
  scanned, _ = _sown(config, params, x)            # Collecting intermediates: the scan.
  np.testing.assert_allclose(early(params), scanned, atol=1e-6, rtol=1e-6)
  assert 'while[' in str(jax.make_jaxpr(early)(params))
  # Every position halts at step 1: the loop runs one step (the scan would run four).
  quick = _with_halting(params, bias=50.0)
  jaxpr = str(jax.make_jaxpr(early)(quick))
  assert 'while[' in jaxpr
  np.testing.assert_allclose(early(quick), _sown(config, quick, x)[0], atol=1e-6)


@pytest.mark.parametrize('act, attention, block', [(True, 'dense', 'pre_ln'),
                                                   (True, 'local', 'pre_ln')])
def test_decoding_equals_the_forward_pass(act, attention, block):
  """Token by token through one cache per step: a token that halted early still writes its
  frozen state into the later steps' caches, where longer-running tokens read it (halting
  weights set so that the tokens halt at different steps; the universal stack with fixed steps
  and with ACT, with every block and variant, decodes in tests/contracts/test_model_contract.py)."""
  config = _config(act=act, attention=attention, residual=block,
                   attention_options={'local': {'window': 5}} if attention == 'local' else {})
  params = _params(config, seed=1)
  if act:
    params = _with_halting(params, kernel_scale=3.0, bias=-0.5)
  x = _tokens(seed=3)
  forward, sown = _sown(config, params, x)
  if act:
    assert len(np.unique(sown['intermediates']['universal']['act_steps'][0])) >= 2
  cache = decode.init_cache(transformer.Decoder(config), params, 2)
  assert jax.tree.leaves(cache)[0].shape[0] == (4 if act else 3)  # One cache per step.
  np.testing.assert_allclose(decode.score(transformer.Decoder(config), params, x), forward,
                             atol=2e-5, rtol=1e-5)


def test_act_gradients_reach_the_halting_unit_and_the_block():
  config, params = _varied()
  model = transformer.Decoder(config)
  x = _tokens()

  def loss(p):
    logits, sown = model.apply({'params': p}, x, deterministic=False, mutable=['losses'],
                               rngs={'dropout': jax.random.key(0)})
    return jnp.mean(logits ** 2) + sum(jnp.sum(v) for v in jax.tree.leaves(sown['losses']))

  grads = jax.jit(jax.grad(loss))(params)
  halting = grads['universal']['step']['halting']
  assert np.all(np.isfinite(jax.tree.leaves(grads)[0]))
  assert float(jnp.abs(halting['bias'])) > 0 and float(jnp.max(jnp.abs(halting['kernel']))) > 0
  qkv = grads['universal']['step']['block']['attention']['qkv']
  assert float(jnp.max(jnp.abs(qkv))) > 0


def test_flops_count_the_steps_taken():
  seq = 64
  fixed = _config(steps=2)
  act = _config(act=True, max_steps=8)
  layered = _config(stack='unrolled', n_layers=2)
  assert fixed.train_flops_per_token(seq) == layered.train_flops_per_token(seq)
  halting = 6.0 * D  # w · s per step: d matmul weights.
  assert act.train_flops_per_token(seq, {'act_steps/universal': 2.0}) == (
      fixed.train_flops_per_token(seq) + 2 * halting)
  four = _config(steps=4).train_flops_per_token(seq)
  assert act.train_flops_per_token(seq, {'act_steps/universal': 4.0}) == four + 4 * halting
  # Without measured steps: the cap.
  assert act.train_flops_per_token(seq) == _config(steps=8).train_flops_per_token(
      seq) + 8 * halting


def test_coordinates_are_position_plus_step_sinusoids():
  positions = jnp.asarray([[0, 1, 2, 7]])
  got = universal.coordinates(positions, 3, 6)
  i = np.asarray([0, 1, 2, 7], np.float64)[:, None]
  k = np.arange(3)
  freq = 10000.0 ** (-2 * k / 6)
  want = np.zeros((4, 6))
  want[:, 0::2] = np.sin(i * freq) + np.sin(3 * freq)
  want[:, 1::2] = np.cos(i * freq) + np.cos(3 * freq)
  np.testing.assert_allclose(got[0], want, atol=1e-5)
  no_pos = universal.coordinates(positions, 3, 6, with_positions=False)
  step_only = np.stack([np.sin(3 * freq), np.cos(3 * freq)], -1).reshape(-1)
  np.testing.assert_allclose(no_pos[0], np.broadcast_to(step_only, (4, 6)), atol=1e-6)


def test_relative_position_attention_gets_only_the_step_signal():
  """Transformer-XL encodes positions itself: its universal stack adds the step sinusoid
  only, so shifting every position leaves the logits unchanged."""
  config = _config(attention='txl', attention_options={'txl': {'mem_len': 0}})
  params = _params(config)
  x = _tokens()
  model = transformer.Decoder(config)
  base = _apply(model, {'params': params}, x)
  shifted = _apply(model, {'params': params}, x,
                   positions=jnp.broadcast_to(jnp.arange(N) + 3, (2, N)))
  np.testing.assert_allclose(base, shifted, atol=1e-6)
  dense = _config()
  dense_params = _params(dense)
  a = _apply(transformer.Decoder(dense), {'params': dense_params}, x)
  b = _apply(transformer.Decoder(dense), {'params': dense_params}, x,
             positions=jnp.broadcast_to(jnp.arange(N)[::-1], (2, N)))
  assert np.max(np.abs(np.asarray(a - b))) > 1e-3  # Absolute coordinates do move it.


@pytest.mark.parametrize('overrides, message', [
    ({'n_layers': 2}, r"applies one weight-shared layer: set model.n_layers=1"),
    ({'steps': 0}, r'model.stack_options.steps must be an integer >= 1, got 0'),
    ({'max_steps': 0, 'act': True}, r'model.stack_options.max_steps must be an integer >= 1'),
    ({'steps': 2.5}, r'model.stack_options.steps \(T: .*\) must be an integer, got 2.5'),
    ({'ponder': -0.1}, r'model.stack_options.ponder .* must be >= 0'),
    ({'act': 'yes'}, r'model.stack_options.act \(.*\) must be True or False'),
    ({'stack_options': {'stepz': 2}},
     r'unknown model.stack_options stepz; the registered stacks declare: act, max_steps'),
    ({'attention': 'strided'}, r"strided attention alternates its pattern .* \(period 2\)"),
    ({'attention': 'local_global'}, r"local_global attention alternates its pattern"),
])
def test_bad_universal_settings_are_refused_at_config_time(overrides, message):
  with pytest.raises(ValueError, match=message):
    _config(**overrides)


def test_universal_stack_defaults_to_one_layer():
  config = transformer.TransformerConfig.from_config(
      dict(vocab_size=VOCAB, d=2, max_len=N, stack='universal'))
  assert config.n_layers == 1 and config.n_heads == 2 and config.stack_name == 'universal'


def test_segment_memory_is_kept_per_step():
  """Transformer-XL's memory under the universal stack: one memory per step (step t's memory
  holds the previous segment's inputs to step t), carried into the next segment."""
  config = _config(attention='txl', act=True, attention_options={'txl': {'mem_len': N}})
  model = transformer.Decoder(config)
  variables = jax.jit(model.init)(jax.random.key(0), _tokens())
  params = nn.unbox(variables['params'])
  memory = variables['memory']
  hidden = nn.unbox(memory)['universal']['step']['block']['attention']['hidden']
  assert hidden.shape == (4, 2, N, D)  # M steps, batch, mem_len, d_model.
  segment = jax.jit(lambda v, x: model.apply(v, x, mutable=['memory']))  # Compiled once.
  first, mutated = segment({'params': params, 'memory': memory}, _tokens(1))
  second, _ = segment({'params': params, **mutated}, _tokens(2))
  fresh, _ = segment({'params': params, 'memory': memory}, _tokens(2))
  filled = nn.unbox(mutated['memory'])['universal']['step']['block']['attention']['hidden']
  assert np.all(np.any(np.asarray(filled) != 0, axis=(1, 2, 3)))  # Every step wrote its own.
  assert np.max(np.abs(np.asarray(second - fresh))) > 1e-4  # The memory is read.


def test_read_only_collections_are_shared_by_the_steps():
  """Selective attention's pruning budgets (a read-only input laid out like the parameters:
  stacked_tree) reach the one block at every step."""
  config = _config(attention='selective', steps=2)
  params = _params(config)
  model = transformer.Decoder(config)
  x = _tokens()
  full = _apply(model, {'params': params}, x)
  pruned_by = jax.jit(lambda budget: model.apply({'params': params, 'pruning': (
      universal.Universal.stacked_tree(config, [{'attention': {'budget': budget}}]))}, x))
  pruned = pruned_by(jnp.asarray(2, jnp.int32))
  assert np.max(np.abs(np.asarray(pruned - full))) > 1e-4
  np.testing.assert_allclose(  # A budget of the whole row prunes nothing.
      pruned_by(jnp.asarray(N, jnp.int32)), full, atol=1e-5)
