"""The reversible layer (model.residual='reversible', issue 22) and the chunked feed-forward
(model.ff_chunk_len).

The block's inverse is checked on one block; the custom VJP of models/reversible.py against
plain autodiff through the same layers with the same rng keys (reversible.run with
custom_vjp=False), for every kind of stack, with dropout, with a variant that sows a loss, one
that shares parameters across layers and LSH attention (its own rng stream); the module path (initialization, decoding,
inspect) against the training path; the compiled memory of a train step against depth; and
the chunked feed-forward against the whole one.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from models import layers, residual, reversible, transformer
from training import steps

VOCAB = 40
SEQ = 16
# XLA:CPU options that halve compile times; the values are the same (memory is measured with
# the default options).
FAST_COMPILE = {'xla_backend_optimization_level': 0, 'xla_llvm_disable_expensive_passes': True}


def _jit(fn, *args):
  """fn compiled for args with FAST_COMPILE."""
  return jax.jit(fn).lower(*args).compile(FAST_COMPILE)


def _config(attention='dense', n_layers=3, block='reversible', **overrides):
  cfg = dict(d=0, d_model=32, n_heads=2, n_layers=n_layers, vocab_size=VOCAB, max_len=32,
             attention=attention, attention_impl='xla', residual=block)
  if attention in ('txl', 'adaptive_span'):
    cfg['position_embedding'] = 'none'
  cfg.update(overrides)
  return transformer.TransformerConfig.from_config(cfg)


def _batch(seed=0, rows=2, n=SEQ):
  tokens = np.random.default_rng(seed).integers(0, VOCAB, (rows, n + 1))
  return {'inputs': jnp.asarray(tokens[:, :-1]), 'targets': jnp.asarray(tokens[:, 1:]),
          'weights': jnp.ones((rows, n), jnp.float32),
          'positions': jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (rows, n)),
          'segment_ids': jnp.ones((rows, n), jnp.int32)}


def _params(cfg, seed=0):
  model = transformer.Decoder(cfg)
  return nn.unbox(jax.jit(model.init)(jax.random.key(seed), _batch()['inputs'])['params'])


def _ctx(rows=2, n=SEQ, **kwargs):
  return residual.LayerContext(positions=jnp.broadcast_to(jnp.arange(n), (rows, n)),
                               segment_ids=jnp.ones((rows, n), jnp.int32), **kwargs)


def _close(got, want, rel):
  """Every leaf of `got` within rel * (the largest entry of `want`) of `want`."""
  assert jax.tree.structure(got) == jax.tree.structure(want)
  scale = max((float(jnp.max(jnp.abs(w))) for w in jax.tree.leaves(want)), default=0.0)
  for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, rtol=0, atol=rel * scale, err_msg=jax.tree_util.keystr(path))


def test_inverse_rebuilds_the_inputs():
  """x2 = y2 - G(y1), x1 = y1 - F(x2) with F and G applied alone, dropout on: F and G draw the
  masks they drew inside the whole block (a wrong key does not rebuild the inputs)."""
  cfg = _config(dropout_rate=0.2)
  rng = np.random.default_rng(0)
  x1, x2 = (jnp.asarray(rng.normal(size=(2, SEQ, 32)), jnp.float32) for _ in range(2))
  ctx = _ctx(deterministic=False)
  block = residual.get('reversible')(cfg, 'dense')
  params = nn.unbox(block.init(jax.random.key(0), (x1, x2), ctx)['params'])
  assert set(params) == {'pre_attention_norm', 'attention', 'pre_mlp_norm', 'mlp'}
  key = {'dropout': jax.random.key(1)}
  y1, y2 = block.apply({'params': params}, (x1, x2), ctx, rngs=key)
  assert float(jnp.abs(y1 - x1).min()) == 0.0  # Dropout really zeroed some of F's outputs.

  def inverse(rngs):
    r2 = y2 - block.apply({'params': params}, y1, ctx, half='mlp', rngs=rngs)
    return y1 - block.apply({'params': params}, r2, ctx, half='attention', rngs=rngs), r2

  r1, r2 = inverse(key)
  np.testing.assert_allclose(r2, x2, atol=1e-5)
  np.testing.assert_allclose(r1, x1, atol=1e-5)
  wrong, _ = inverse({'dropout': jax.random.key(2)})
  assert float(jnp.abs(wrong - x1).max()) > 0.1


def _objective(cfg, params, batch, rng):
  """The train step's objective (forward_sums: cross-entropy plus the sown losses)."""
  sums, aux, _ = steps.forward_sums(transformer.Decoder(cfg), params, batch, train=True, rng=rng)
  return sums['loss_sum'] / jnp.sum(batch['weights']) + aux, aux


def _value_and_grad(cfg, params, batch, rng, custom_vjp=True):
  """The compiled value_and_grad of _objective (custom_vjp=False: reversible.run by plain
  autodiff)."""
  fn = jax.value_and_grad(functools.partial(_objective, cfg), has_aux=True)
  if custom_vjp:
    return _jit(fn, params, batch, rng)
  run = reversible.run
  reversible.run = functools.partial(run, custom_vjp=False)
  try:
    return _jit(fn, params, batch, rng)
  finally:
    reversible.run = run


@pytest.mark.parametrize('attention,stack,options,dropout', [
    ('dense', 'unrolled', {}, 0.1),
    ('dense,local,dense,local', 'scan_cycle', {'local': {'window': 4}}, 0.1),
    # Sows its L1 penalty into 'losses' (lambda large, so the loss matters in the gradient).
    ('adaptive_span', 'unrolled', {'adaptive_span': {'limit': 8, 'ramp': 2, 'init': 0.5,
                                                     'penalty': 0.5}}, 0.0),
    # u, v shared by every layer (LayerContext.shared); a scanned stack.
    ('txl', 'scan', {'txl': {'mem_len': 0}}, 0.1),
    # Reformer: random rotations from the 'lsh' stream, replayed in the backward pass.
    ('lsh', 'scan', {'lsh': {'n_buckets': 4, 'n_hashes': 2, 'chunk_len': 4}}, 0.0),
])
def test_custom_vjp_equals_autodiff(attention, stack, options, dropout):
  """Loss, sown loss and every gradient (the input embedding's included) of the training path
  equal plain autodiff through the same two-stream layers with the same rng keys. In float32
  the inverse loses ~1e-6 of the stream's scale per layer, which the small embedding (std
  0.02 against a stream of ~1) and the norm in front of each sublayer turn into up to ~1e-4 of
  the largest gradient entry; a wrong backward pass is off by O(1)."""
  n_layers = {'unrolled': 2, 'scan': 3, 'scan_cycle': 4}[stack]
  cfg = _config(attention, n_layers=n_layers, stack=stack, dropout_rate=dropout,
                attention_options=options)
  params, batch, rng = _params(cfg), _batch(), jax.random.key(3)
  step = _value_and_grad(cfg, params, batch, rng)
  (loss, aux), grads = step(params, batch, rng)
  (ref_loss, ref_aux), ref_grads = _value_and_grad(cfg, params, batch, rng, custom_vjp=False)(
      params, batch, rng)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
  np.testing.assert_allclose(aux, ref_aux, rtol=1e-6)
  _close(grads, ref_grads, 3e-4)
  assert float(jnp.abs(grads['token_embed']['embedding']).max()) > 1e-3
  if attention == 'adaptive_span':
    assert float(aux) > 0.1
  if attention == 'txl':
    assert all(float(jnp.abs(g).max()) > 1e-4 for g in jax.tree.leaves(grads['txl_shared']))
  if dropout or attention == 'lsh':  # Masks, rotations drawn: another key, another loss.
    (other, _), _ = step(params, batch, jax.random.key(4))
    assert abs(float(other) - float(loss)) > 1e-4


@pytest.mark.parametrize('attention,stack,options', [
    ('dense', 'scan', {}),
    ('adaptive_span', 'unrolled', {'adaptive_span': {'limit': 8, 'ramp': 2, 'init': 0.5}}),
])
def test_training_path_equals_the_module_path(attention, stack, options):
  """Without dropout, the training path (reversible.run) computes what the blocks compute as
  modules (the path of init, decoding and inspect, taken here by collecting 'intermediates'):
  logits, gradients, and the sown losses and metrics, laid out alike."""
  cfg = _config(attention, stack=stack, attention_options=options)
  params, tokens = _params(cfg), _batch()['inputs']
  cotangent = jnp.asarray(np.random.default_rng(1).normal(size=(2, SEQ, VOCAB)), jnp.float32)

  def run(mutable):
    def loss(p):
      logits, sown = transformer.Decoder(cfg).apply({'params': p}, tokens, mutable=mutable)
      return jnp.sum(logits * cotangent) + steps.sum_collection(sown.get('losses', {})), sown
    return _jit(jax.value_and_grad(loss, has_aux=True), params)(params)

  (value, sown), grads = run(['losses', 'metrics'])
  (ref_value, ref_sown), ref_grads = run(['losses', 'metrics', 'intermediates'])
  np.testing.assert_allclose(value, ref_value, rtol=1e-5)
  _close(grads, ref_grads, 3e-4)
  for c in ('losses', 'metrics'):
    _close(sown.get(c, {}), ref_sown.get(c, {}), 1e-6)
  assert ('metrics' in sown) == (attention == 'adaptive_span')
  if 'metrics' in sown:
    assert steps.sown_metrics(sown['metrics']).keys() == steps.sown_metrics(
        ref_sown['metrics']).keys()


def test_training_path_reads_the_other_collections():
  """Selective attention's context pruning reads per-layer budgets from the 'pruning'
  collection: the training path hands each layer its own and computes the module path's
  logits (and the budgets do change them)."""
  cfg = _config('selective', n_layers=2, stack='unrolled')
  params, tokens = _params(cfg), _batch()['inputs']
  model = transformer.Decoder(cfg)
  variables = lambda budgets: {'params': params, 'pruning': {
      f'block_{i}': {'attention': {'budget': jnp.asarray(b, jnp.int32)}}
      for i, b in enumerate(budgets)}}
  pruned = _jit(lambda v: model.apply(v, tokens), variables((2, 4)))
  ref = _jit(lambda v: model.apply(v, tokens, mutable=['intermediates'])[0], variables((2, 4)))
  np.testing.assert_allclose(pruned(variables((2, 4))), ref(variables((2, 4))), atol=1e-5)
  whole = pruned(variables((SEQ, SEQ)))  # Every key kept.
  assert float(jnp.abs(pruned(variables((2, 4))) - whole).max()) > 1e-3


def _temp_bytes(block, n_layers, **overrides) -> int:
  """Compiled temporary memory of a jitted train step (SGD) of a scanned model."""
  cfg = _config(block=block, n_layers=n_layers, stack='scan', vocab_size=32, max_len=256,
                **overrides)
  model = transformer.Decoder(cfg)
  batch = _batch(rows=4, n=256)
  batch['inputs'] = batch['targets'] = batch['inputs'] % 32
  params = nn.unbox(jax.eval_shape(model.init, jax.random.key(0), batch['inputs'])['params'])
  tx = optax.sgd(0.1)
  state = jax.eval_shape(lambda p: steps.TrainState(step=jnp.zeros((), jnp.int32), params=p,
                                                    opt_state=tx.init(p)), params)
  step = jax.jit(steps.make_train_step(model, tx, lambda s: 0.1))
  compiled = step.lower(state, batch, jax.random.key(0)).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def test_train_step_memory_does_not_grow_with_depth():
  """From 2 to 8 layers (4 x 256 tokens, d_model 32): pre_ln's step stores each layer's
  activations (its temporary memory grows by ~5 MB a layer, mostly the 2 x 256 x 256 attention
  probabilities of 4 rows); the reversible step's grows by less than a tenth of one of those
  layers (the extra layers' gradients, 50 KB each)."""
  pre = {n: _temp_bytes('pre_ln', n) for n in (2, 8)}
  rev = {n: _temp_bytes('reversible', n) for n in (2, 8)}
  per_layer = (pre[8] - pre[2]) / 6
  print(f'temp bytes pre_ln {pre} reversible {rev}; pre_ln per layer {per_layer:.0f}')
  assert per_layer > 4 * 4 * 256 * 256 * 2  # The attention probabilities of a layer, at least.
  assert rev[8] - rev[2] < 0.1 * per_layer
  assert rev[8] < pre[2]


@pytest.mark.parametrize('block,chunk', [('pre_ln', 5), ('reversible', 8)])
def test_chunked_feed_forward_equals_the_whole(block, chunk):
  """model.ff_chunk_len: the same logits and gradients, with chunks that divide the length
  (8 of 16) and that do not (5: the last chunk padded). The reversible backward pass rebuilds
  each layer's input by subtraction, so a change of summation order (a chunk is another matmul
  shape: on a GPU, another kernel) reaches its gradients amplified, as in the custom-VJP test
  above: 3e-4 of the largest entry there (2.2e-5 seen on an H200), 1e-5 for pre_ln."""
  cfg = _config(block=block, stack='scan')
  chunked = _config(block=block, stack='scan', ff_chunk_len=chunk)
  params, tokens = _params(cfg), _batch()['inputs']
  cotangent = jnp.asarray(np.random.default_rng(1).normal(size=(2, SEQ, VOCAB)), jnp.float32)

  def run(c):
    loss = lambda p: jnp.sum(transformer.Decoder(c).apply({'params': p}, tokens) * cotangent)
    return _jit(jax.value_and_grad(loss), params)(params)

  value, grads = run(chunked)
  ref_value, ref_grads = run(cfg)
  np.testing.assert_allclose(value, ref_value, rtol=1e-5)
  _close(grads, ref_grads, 3e-4 if block == 'reversible' else 1e-5)


def test_chunked_feed_forward_never_holds_the_whole_hidden_activation():
  """Forward and backward of the SwiGLU over 2048 tokens with a hidden width of 512: the
  (tokens, 2, 512) float32 activation is 8 MB; chunks of 64 positions keep the compiled
  temporaries under a quarter of it, where the whole computation needs more than all of it."""
  x = jnp.zeros((1, 2048, 32))
  w_in, w_out = jnp.zeros((32, 2, 512)), jnp.zeros((512, 32))
  hidden = 2048 * 2 * 512 * 4

  def temp(fn):
    grad = jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a) ** 2), argnums=(0, 1, 2)))
    return grad.lower(x, w_in, w_out).compile().memory_analysis().temp_size_in_bytes

  whole = temp(layers.swiglu_mlp)
  chunked = temp(lambda *a: layers.chunked_swiglu_mlp(*a, chunk_len=64))
  assert whole > hidden and chunked < hidden / 4, (whole, chunked, hidden)


def test_flops_and_parameters_are_those_of_pre_ln():
  """The same sublayers and no weights of its own: the reversible layer counts the model
  FLOPs of pre_ln (its recompute in the backward pass is not model FLOPs) and has the same
  parameters."""
  rev, pre = _config(), _config(block='pre_ln')
  assert rev.train_flops_per_token(SEQ) == pre.train_flops_per_token(SEQ)
  assert rev.num_params() == pre.num_params()


@pytest.mark.parametrize('overrides,message', [
    ({'residual': 'nope'}, "unknown residual wiring 'nope'; known residual wirings: gtrxl, pre_ln, reversible$"),
    ({'ff_chunk_len': -1}, r'model.ff_chunk_len must be an integer >= 0 .* got -1'),
    ({'ff_chunk_len': 2.5}, r'model.ff_chunk_len must be an integer >= 0 .* got 2.5'),
    ({'attention': 'txl', 'attention_options': {'txl': {'mem_len': 4}}},
     "residual='reversible' cannot carry segment memory"),
    ({'attention': 'adaptive_span', 'attention_options': {'adaptive_span': {'memory': True}}},
     "residual='reversible' cannot carry segment memory"),
])
def test_bad_config_is_reported(overrides, message):
  with pytest.raises(ValueError, match=message):
    _config(**overrides)
