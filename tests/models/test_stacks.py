"""Tests for models/stacks.py and models/residual.py: every stack computes the unrolled model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import residual, stacks, transformer

VOCAB = 32
# The pattern variants' options (config.model.attention_options.<variant>).
_BLOCKS = {'key_block': 4, 'band_block': 0}
SPARSE = {'strided': {'stride': 4, 'factorization': 'interleave', **_BLOCKS},
          'fixed': {'stride': 4, 'summary': 2, 'factorization': 'interleave',
                    'distinct_heads': False, **_BLOCKS},
          'local': {'window': 4, **_BLOCKS},
          'local_global': {'window': 4, 'global_every': 3, **_BLOCKS},
          'block_local': dict(_BLOCKS)}
MERGED = {**SPARSE, 'strided': {**SPARSE['strided'], 'factorization': 'merged'}}


def _config(**overrides):
  cfg = {'vocab_size': VOCAB, 'd_model': 16, 'n_heads': 2, 'n_layers': 4, 'mlp_dim': 32,
         'max_len': 24, 'attention_options': SPARSE}
  cfg.update(overrides)
  return transformer.TransformerConfig.from_config(cfg)


def _to_unrolled(cfg, params):
  """`params` of cfg's stack laid out as the unrolled stack's, through Stack.layer_tree."""
  stack = stacks.of(cfg)
  out = {k: v for k, v in params.items() if k not in ('blocks', 'cycle')}
  out.update(stacks.get('unrolled').stacked_tree(
      cfg, [stack.layer_tree(cfg, params, i) for i in range(cfg.n_layers)]))
  return out


def _tokens():
  return jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, (2, 24)), jnp.int32)


def _logits_and_grads(cfg, params):
  tokens = _tokens()
  cotangent = np.random.default_rng(1).normal(size=(2, 24, VOCAB)).astype(np.float32)

  def loss(p):
    logits = transformer.Decoder(cfg).apply({'params': p}, tokens)
    return jnp.sum(logits * cotangent), logits

  (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
  return np.asarray(logits), grads


@pytest.mark.parametrize('attention,n_layers,cycle', [
    ('strided', 4, 2),            # Interleaved A1/A2: period 2.
    # Fixed's interleaved A1/A2 is strided's case again (period 2 from the factorization).
    pytest.param('fixed', 4, 2, marks=pytest.mark.slow),
    ('local_global', 6, 3),       # Every 3rd layer global.
    ('dense,local,dense,local', 4, 2),  # A list of names that repeats.
])
def test_scan_cycle_computes_the_unrolled_model(attention, n_layers, cycle):
  cfg = _config(attention=attention, n_layers=n_layers, stack='scan_cycle')
  assert stacks.cycle_length(cfg) == cycle
  params = jax.jit(transformer.Decoder(cfg).init)(jax.random.key(0),
                                                  jnp.zeros((1, 24), jnp.int32))['params']
  params = jax.tree.map(lambda a: a, params)
  assert set(params['cycle']) == {f'layer_{k}' for k in range(cycle)}
  assert all(a.shape[0] == n_layers // cycle for a in jax.tree.leaves(params['cycle']))
  unrolled_cfg = _config(attention=attention, n_layers=n_layers, stack='unrolled')
  logits, grads = _logits_and_grads(cfg, params)
  ref_logits, ref_grads = _logits_and_grads(unrolled_cfg, _to_unrolled(cfg, params))
  np.testing.assert_allclose(logits, ref_logits, atol=1e-5, rtol=1e-5)
  grads = _to_unrolled(cfg, grads)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
    np.testing.assert_allclose(a, b, atol=1e-5 * max(1.0, np.abs(b).max()), rtol=1e-4)
  # The layers of a cycle really differ (a cycle of one repeated layer would fail above only
  # if A1 and A2 gave different outputs on these inputs).
  if attention == 'strided':
    wrong = _config(attention=attention, n_layers=n_layers, attention_options=MERGED,
                    stack='unrolled')
    other = jax.jit(lambda p: transformer.Decoder(wrong).apply({'params': p}, _tokens()))(
        _to_unrolled(cfg, params))  # The forward alone: no gradient needed here.
    assert np.abs(other - ref_logits).max() > 1e-3


@pytest.mark.parametrize('overrides,message', [
    ({'attention': 'strided', 'stack': 'scan'}, r"depends on its layer index \(period 2\).*scan_cycle"),
    ({'attention': 'dense,local', 'n_layers': 2, 'stack': 'scan'}, 'same variant in every layer'),
    ({'attention': 'strided', 'n_layers': 3, 'stack': 'scan_cycle'}, 'repeat every 2 layers'),
    ({'attention': 'selective', 'stack': 'scan_cycle'}, 'selective attention gives every layer'),
    ({'stack': 'nope'}, "unknown stack 'nope'; known stacks: scan, scan_cycle, universal, unrolled"),
    ({'residual': 'nope'}, "unknown residual wiring 'nope'; known residual wirings: gtrxl, pre_ln, reversible"),
])
def test_bad_stack_or_block_is_reported_at_config_time(overrides, message):
  with pytest.raises(ValueError, match=message):
    _config(**overrides)


@pytest.mark.parametrize('name,cycle', [('unrolled', (1, 4)), ('scan', (4, 1)),
                                        ('scan_cycle', (2, 2))])
def test_cycle_trees_are_the_layers_as_repeats_of_a_cycle(name, cycle):
  """Stack.cycle_tree(tree, k)[r] is layer r p + k's part, and from_cycle_trees puts the
  places back where the stack keeps them."""
  cfg = _config(attention='dense' if name == 'scan' else 'dense,local,dense,local', stack=name)
  stack = stacks.get(name)
  assert stack.cycle(cfg) == cycle
  repeats, p = cycle
  tree = stack.stacked_tree(cfg, [{'w': jnp.full((3,), float(i))} for i in range(4)])
  places = [stack.cycle_tree(cfg, tree, k) for k in range(p)]
  for r in range(repeats):
    for k in range(p):
      np.testing.assert_array_equal(places[k]['w'][r], stack.layer_tree(cfg, tree, r * p + k)['w'])
  back = stack.from_cycle_trees(cfg, places)
  assert jax.tree.structure(back) == jax.tree.structure(tree)
  for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(tree)):
    np.testing.assert_array_equal(a, b)
  assert stack.from_cycle_trees(cfg, [{}] * p) == {}  # Nothing sown: no entry.


def test_auto_scans_only_identical_layer_independent_layers():
  assert _config(attention='dense').stack_name == 'scan'
  assert _config(attention='local').stack_name == 'scan'
  assert _config(attention='strided').stack_name == 'unrolled'
  assert _config(attention='strided', attention_options=MERGED).stack_name == 'scan'
  assert _config(attention='dense,local,dense,local').stack_name == 'unrolled'


def test_layer_context_is_static_where_it_must_be():
  ctx = residual.LayerContext(positions=jnp.zeros((1, 2)), segment_ids=jnp.ones((1, 2)),
                              deterministic=False, decode=True)
  leaves, treedef = jax.tree.flatten(ctx)
  assert len(leaves) == 2  # positions and segment_ids; step None; the flags are static.
  back = jax.tree.unflatten(treedef, leaves)
  assert back.decode and not back.deterministic
