"""GTrXL's gated layer (model.residual='gtrxl', issue 21) against hand-written computations.

The gate is checked against the paper's four equations written here in float64 from the
module's parameters; the block against the same wiring composed by hand from its norm,
attention and MLP; and the model with every variant (decoding and gradients with each
variant and stack: tests/contracts/test_model_contract.py).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import residual, transformer

D = 16


def _sigmoid(a):
  return 1.0 / (1.0 + np.exp(-a))


def _gate_by_hand(p, x, y):
  """g(x, y) of the paper (eq. 4-7) in float64 from the GRUGate parameters."""
  p = {k: np.asarray(v, np.float64) for k, v in nn.unbox(p).items()}
  x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
  w_r, w_z, w_g = (p['w'][:, i] for i in range(3))
  u_r, u_z = (p['u'][:, i] for i in range(2))
  r = _sigmoid(y @ w_r + x @ u_r)
  z = _sigmoid(y @ w_z + x @ u_z - p['gate_bias'])
  h = np.tanh(y @ w_g + (r * x) @ p['u_g'])
  return (1.0 - z) * x + z * h


def _xy(seed=0, shape=(2, 5, D)):
  rng = np.random.default_rng(seed)
  return (jnp.asarray(rng.normal(size=shape), jnp.float32),
          jnp.asarray(rng.normal(size=shape), jnp.float32))


def test_gate_equals_the_papers_equations():
  x, y = _xy()
  gate = residual.GRUGate()
  params = nn.unbox(jax.jit(gate.init)(jax.random.key(0), x, y)['params'])
  np.testing.assert_array_equal(params['gate_bias'], np.full(D, 2.0))  # b_g starts at 2.
  # A b_g that is not constant, so a wrong sign or axis would show.
  params['gate_bias'] = jnp.linspace(-1.0, 3.0, D)
  got = jax.jit(gate.apply)({'params': params}, x, y)
  np.testing.assert_allclose(got, _gate_by_hand(params, x, y), atol=2e-6)


def test_gate_starts_near_the_identity():
  """With b_g = 2 the update gate z starts near σ(-2) and g(x, y) near x; with b_g = 0 the same
  weights put z near 1/2 and move the stream much further."""
  x, y = _xy(shape=(4, 64, 256))
  params = nn.unbox(jax.jit(residual.GRUGate().init)(jax.random.key(0), x, y)['params'])

  def moved(bias):
    p = {**params, 'gate_bias': jnp.full(x.shape[-1], bias)}
    out = jax.jit(residual.GRUGate(gate_bias=bias).apply)({'params': p}, x, y)
    return float(jnp.linalg.norm(out - x) / jnp.linalg.norm(x))

  near, plain = moved(2.0), moved(0.0)
  # |g - x| = z |ĥ - x|, and |ĥ - x| / |x| is about 1.2 for unit-variance inputs: z ~ 0.2
  # (σ(-2) = 0.12, spread by the unit-variance pre-activation) against z ~ 0.5.
  assert near < 0.35, near
  assert near < 0.5 * plain, (near, plain)


def _config(attention='dense', block='gtrxl', stack='unrolled', n_layers=2, **options):
  """`options`: the variant's own (config.model.attention_options.<attention>)."""
  extra = {'position_embedding': 'none'} if attention == 'txl' else {}
  return transformer.TransformerConfig.from_config(dict(
      d=0, d_model=D * 2, n_heads=2, n_layers=n_layers, vocab_size=40, max_len=32,
      attention=attention, attention_impl='xla', attention_block_size=4, residual=block,
      stack=stack, attention_options={attention: options}, **extra))


def test_block_equals_the_wiring_by_hand():
  """x = g_a(x, ReLU(Attn(norm x))), x = g_m(x, ReLU(MLP(norm x))): norms on the sublayer
  input only, the stream itself never normalized."""
  cfg = _config(n_layers=1)
  x, _ = _xy(shape=(2, 6, cfg.d_model))
  x = 3.0 * x  # A stream far from unit RMS: a norm on it would show.
  ctx = residual.LayerContext(positions=jnp.broadcast_to(jnp.arange(6), (2, 6)),
                              segment_ids=jnp.ones((2, 6), jnp.int32))
  block = residual.get('gtrxl')(config=cfg, attention_name='dense')
  params = nn.unbox(jax.jit(block.init)(jax.random.key(0), x, ctx)['params'])
  assert set(params) == {'pre_attention_norm', 'attention', 'attention_gate', 'pre_mlp_norm',
                         'mlp', 'mlp_gate'}
  # Norm scales other than ones, so each norm's place matters.
  params['pre_attention_norm']['scale'] = jnp.linspace(0.5, 1.5, cfg.d_model)
  params['pre_mlp_norm']['scale'] = jnp.linspace(1.5, 0.5, cfg.d_model)
  got = jax.jit(block.apply)({'params': params}, x, ctx)

  def norm(p, a):
    a = np.asarray(a, np.float64)
    return a / np.sqrt(np.mean(a * a, axis=-1, keepdims=True) + 1e-6) * np.asarray(p['scale'])

  attn = residual.make_attention(cfg, 'dense', 0)
  mlp = residual.layers.SwiGLU(cfg.mlp_dim)
  h = norm(params['pre_attention_norm'], x)
  # Each module applied as one jitted program (op by op was slower).
  y = np.asarray(jax.jit(attn.apply)({'params': params['attention']},
                                     jnp.asarray(h, jnp.float32), positions=ctx.positions,
                                     segment_ids=ctx.segment_ids))
  x1 = _gate_by_hand(params['attention_gate'], x, np.maximum(y, 0.0))
  h = norm(params['pre_mlp_norm'], x1)
  y = np.asarray(jax.jit(mlp.apply)({'params': params['mlp']}, jnp.asarray(h, jnp.float32)))
  want = _gate_by_hand(params['mlp_gate'], x1, np.maximum(y, 0.0))
  np.testing.assert_allclose(got, want, atol=2e-5)


@pytest.mark.parametrize('attention,stack,options', [
    ('dense', 'scan', {}),
    ('dense', 'unrolled', {}),
    ('local', 'auto', {'window': 4}),
    ('strided', 'scan_cycle', {'stride': 4}),
    ('adaptive_span', 'auto', {'limit': 8, 'ramp': 2}),
    ('selective', 'auto', {}),
    ('txl', 'auto', {'mem_len': 4}),
])
def test_gates_add_their_parameters_and_flops_with_any_variant(attention, stack, options):
  """The gates add 2 x (6 d^2 + d) parameters per layer (counted from init's shapes) and
  12 d^2 matmul weights per layer to the FLOPs count, whatever the attention and the stack
  (that every variant and stack trains and decodes in gated layers: the contract suite)."""
  gated = _config(attention, 'gtrxl', stack, **options)
  plain = _config(attention, 'pre_ln', stack, **options)
  d, layers = gated.d_model, gated.n_layers
  assert gated.num_params() - plain.num_params() == layers * 2 * (6 * d * d + d)
  assert (gated.train_flops_per_token(16) - plain.train_flops_per_token(16)
          == 6 * layers * 12 * d * d)


def test_every_gate_gets_a_gradient():
  model = transformer.Decoder(_config('dense', 'gtrxl', 'scan'))
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 40, (2, 16)))
  variables = jax.jit(model.init)(jax.random.key(0), tokens)  # Jitted: op by op was slower.
  grads = jax.jit(jax.grad(lambda p: model.apply({**variables, 'params': p}, tokens,
                                                 mutable=True)[0].mean()))(variables['params'])
  gate_grads = [g for path, g in jax.tree_util.tree_leaves_with_path(nn.unbox(grads))
                if 'gate' in jax.tree_util.keystr(path)]
  assert gate_grads and all(bool(jnp.any(g != 0)) for g in gate_grads)
