"""AdamW's weight decay reaches the matrices only, whatever the stack."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import tiny
from models import stacks
from training import assembly


def _decayed(stack: str, block: str = 'pre_ln') -> dict[str, list[bool]]:
  """{parameter of one layer (or outside the stack): [decayed in layer i]} after one AdamW step
  with zero gradients, where only the decay moves a parameter."""
  config = tiny.get_config()
  config.model.stack, config.model.residual = stack, block
  config.peak_tflops_per_device = 1.0
  config.weight_decay, config.learning_rate, config.warmup_steps = 0.5, 0.1, 0
  setup = assembly.build(config)
  # Shapes only, and the update as one compiled program: op by op it took 84 s of CI time.
  shapes = jax.eval_shape(setup.init_fn, jax.random.key(0)).params
  params = jax.tree.map(lambda s: jnp.ones(s.shape, s.dtype), shapes)
  tx = setup.tx

  @jax.jit
  def update(params):
    return tx.update(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)[0]

  updates = update(params)
  moved = jax.tree.map(lambda u: np.asarray(u != 0), updates)
  out = {}
  for i in range(setup.model_config.n_layers):
    layer = stacks.of(setup.model_config).layer_tree(setup.model_config, moved, i)
    for path, m in jax.tree_util.tree_leaves_with_path(layer):
      out.setdefault(jax.tree_util.keystr(path), []).append(bool(m.all()) if m.any() else False)
  for name in ('final_norm', 'token_embed'):
    for path, m in jax.tree_util.tree_leaves_with_path(moved[name]):
      out[name + jax.tree_util.keystr(path)] = [bool(m.all())]
  return out


@pytest.mark.parametrize('block', ['pre_ln', 'gtrxl'])
def test_scanned_and_unrolled_layers_decay_the_same_parameters(block):
  scanned, unrolled = _decayed('scan', block), _decayed('unrolled', block)
  assert scanned == unrolled
  decayed = {k for k, v in scanned.items() if all(v)}
  kept = {k for k, v in scanned.items() if not any(v)}
  assert decayed | kept == set(scanned)  # Every layer alike.
  assert all(k.endswith("['scale']") or k.endswith("['gate_bias']") for k in kept), kept
  assert {"['attention']['qkv']", "['mlp']['wi']", "token_embed['embedding']"} <= decayed
  assert "['pre_attention_norm']['scale']" in kept and "final_norm['scale']" in kept
  if block == 'gtrxl':
    assert "['attention_gate']['gate_bias']" in kept
    assert "['attention_gate']['w']" in decayed
