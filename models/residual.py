"""Residual wiring of one layer (`model.residual`): a registry, one entry per wiring.

Every wiring's layer has the same signature, `carry = layer(carry, ctx)`, with the frozen
`LayerContext` that the stack hands to each layer, so a stack never needs to know which wiring
it applies:

  pre_ln      x + Attn(RMSNorm(x)), then x + SwiGLU(RMSNorm(x))   (today's backbone)
  gtrxl       g(x, ReLU(Attn(RMSNorm(x)))), then g(x, ReLU(SwiGLU(RMSNorm(x)))), g a GRU-type
              gate (GTrXL, Parisotto et al. 2019)
  reversible  two residual halves: y1 = x1 + Attn(RMSNorm(x2)), y2 = x2 + SwiGLU(RMSNorm(y1))
              (RevNet, Gomez et al. 2017; Reformer, Kitaev et al. 2020); training rebuilds
              each layer's input from its output (models/reversible.py)

The carry is what the layers thread through the stack: the residual stream x for pre_ln and
gtrxl, the pair (x1, x2) for reversible. The Decoder makes it from the embedding with the
wiring's `split` and turns the stack's output back into one stream with `merge`. A wiring that
adds matmul weights declares them (`extra_matmul_weights`) for the FLOPs count. A wiring's
own hyper-parameters are its `OPTIONS` (config.model.residual_options; models/options.py), e.g.
GTrXL's gate_bias.
"""

from typing import Any, ClassVar

import flax
import flax.linen as nn
import jax

import jax.numpy as jnp

from models import attention, layers
from models.options import Option
from models.registry import Registry

RESIDUALS = Registry('residual wiring', 'model.residual_options')
register = RESIDUALS.register
known = RESIDUALS.known
get = RESIDUALS.get


@flax.struct.dataclass
class LayerContext:
  """What every layer of a stack sees besides its input x.

  Attributes:
    positions: (batch, length) int positions within each document.
    segment_ids: (batch, length) int document ids (0 = padding).
    step: index of the current application of a weight-shared stack (a traced int
      scalar), None for stacks whose layers are distinct.
    deterministic: disables dropout and other randomness (static).
    decode: one-token decoding with the attention caches (static).
    shared: {variant: {name: array}}: parameters a variant shares across its layers
      (Traits.shared_params), made once by the Decoder.
  """
  positions: jax.Array
  segment_ids: jax.Array
  step: Any = None
  shared: dict = flax.struct.field(default_factory=dict)
  deterministic: bool = flax.struct.field(pytree_node=False, default=True)
  decode: bool = flax.struct.field(pytree_node=False, default=False)


def make_attention(config, variant: str, layer_index: int, **kwargs) -> nn.Module:
  """Layer `layer_index`'s attention module of `variant`, configured from `config`; its `impl`
  is the concrete implementation model.attention_impl gives this variant on the platform the
  program is compiled for (config.target; 'auto' resolved: Traits.implementation)."""
  cls = attention.get(variant)
  platform, devices = config.target
  impl = attention.traits.of(variant).implementation(
      config.attention_impl, options=config.options_of(variant), head_dim=config.head_dim,
      backend=platform, dtype=config.dtype, block_size=config.attention_block_size,
      devices=devices, layer_index=layer_index)
  return cls(
      num_heads=config.n_heads, head_dim=config.head_dim, qk_norm=config.qk_norm,
      impl=impl, block_size=config.attention_block_size,
      layer_index=layer_index, max_len=config.max_len, num_layers=config.n_layers,
      options=tuple(sorted(config.options_of(variant).items())), dtype=config.dtype, param_dtype=config.param_dtype,
      platform=platform, **kwargs)


class LayerBase(nn.Module):
  """Fields every wiring's layer takes; its `__call__(x, ctx)` returns the layer's output.

  Attributes:
    config: the model config (models/transformer.py TransformerConfig).
    attention_name: registry name of this layer's attention variant.
    layer_index: the index the stack gives this layer (what variants with a layer period
      read; see Traits.layer_period).
  """
  config: Any
  attention_name: str
  layer_index: int = 0

  # True for a wiring whose input is a function of its output: the Decoder then trains the
  # stack through models/reversible.py, which stores no layer's activations.
  REVERSIBLE: ClassVar[bool] = False
  # The wiring's own hyper-parameters, config.model.residual_options.<name>: name -> Option
  # (models/options.py), each with its default, doc and change kind. Options of all wirings
  # share that one group (the registry refuses a name two wirings declare separately); read
  # one with config.residual_option(name).
  OPTIONS: ClassVar[dict[str, Option]] = {}

  @classmethod
  def check(cls, config) -> None:
    """Raises ValueError if this wiring cannot run `config` (at config time)."""
    del config

  @classmethod
  def split(cls, x):
    """The carry the stack threads through the layers, from the embedded input x."""
    return x

  @classmethod
  def merge(cls, carry):
    """The stream the final norm reads, from the stack's output carry."""
    return carry

  @classmethod
  def extra_matmul_weights(cls, d_model: int) -> int:
    """Matmul weights per layer beyond attention and MLP (the wiring's own), for
    TransformerConfig.train_flops_per_token."""
    del d_model
    return 0

  def norm(self, name: str) -> nn.Module:
    """An RMSNorm in the model's dtypes."""
    return layers.RMSNorm(dtype=self.config.dtype, param_dtype=self.config.param_dtype,
                          name=name)

  def attention(self, x, ctx: LayerContext):
    """This layer's attention over x (already normalized)."""
    return make_attention(self.config, self.attention_name, self.layer_index, name='attention',
                          shared=ctx.shared.get(self.attention_name))(
        x, positions=ctx.positions, segment_ids=ctx.segment_ids, cache=ctx.decode or None,
        deterministic=ctx.deterministic)

  def mlp(self, x):
    """The SwiGLU feed-forward of this layer (over chunks of model.ff_chunk_len positions
    when set)."""
    cfg = self.config
    return layers.SwiGLU(cfg.mlp_dim, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                         chunk_len=cfg.ff_chunk_len, name='mlp')(x)

  def dropout(self, h, ctx: LayerContext, name: str | None = None):
    """Residual dropout (model.dropout_rate)."""
    return nn.Dropout(self.config.dropout_rate, name=name)(h, deterministic=ctx.deterministic)


@register('pre_ln')
class PreLN(LayerBase):
  """Pre-LN layer: x + Attn(RMSNorm(x)), then x + SwiGLU(RMSNorm(x))."""

  @nn.compact
  def __call__(self, x, ctx: LayerContext):
    x = x + self.dropout(self.attention(self.norm('pre_attention_norm')(x), ctx), ctx)
    x = x + self.dropout(self.mlp(self.norm('pre_mlp_norm')(x)), ctx)
    return nn.with_logical_constraint(x, ('batch', 'length', 'embed'))


# GTrXL's options (config.model.residual_options). The gate bias only sets b_g's initializer,
# so a recorded run may be evaluated with another value: a 'training' change.
GTRXL_OPTIONS = {
    'gate_bias': Option(2.0, "b_g at init: GTrXL's gate bias (z starts near σ(-b_g))",
                        change='training'),
}


class GRUGate(nn.Module):
  """GTrXL's gate g(x, y) in place of the residual sum x + y (Parisotto et al. 2019, eq. 4-7):

    r = σ(W_r y + U_r x)
    z = σ(W_z y + U_z x - b_g)
    ĥ = tanh(W_g y + U_g (r ⊙ x))
    g(x, y) = (1 - z) ⊙ x + z ⊙ ĥ

  x is the residual stream and y the sublayer output. The matmuls run in `dtype` (W_r, W_z,
  W_g as one (d, 3, d) kernel, U_r, U_z as one (d, 2, d)); the gating in float32. b_g is a
  learned per-feature bias that starts at `gate_bias` (2, as in the paper), so z starts near
  σ(-2) ≈ 0.12 and the layer near the identity.

  Attributes:
    gate_bias: initial value of b_g (GTrXL's model.residual_options.gate_bias).
    dtype: computation dtype of the matmuls and of the output.
    param_dtype: parameter dtype.
  """
  gate_bias: float = GTRXL_OPTIONS['gate_bias'].default
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x, y):
    d = x.shape[-1]
    kernel = lambda name, shape, axes: self.param(name, nn.with_logical_partitioning(
        layers.default_kernel_init, axes), shape, self.param_dtype).astype(self.dtype)
    w = kernel('w', (d, 3, d), ('embed', 'gate', 'mlp'))   # W_r, W_z, W_g.
    u = kernel('u', (d, 2, d), ('embed', 'gate', 'mlp'))   # U_r, U_z.
    u_g = kernel('u_g', (d, d), ('embed', 'mlp'))
    b_g = self.param('gate_bias', nn.with_logical_partitioning(
        nn.initializers.constant(self.gate_bias), ('norm',)), (d,), self.param_dtype)
    f32 = lambda a: a.astype(jnp.float32)
    wy = f32(jnp.einsum('bld,dgk->blgk', y.astype(self.dtype), w))
    ux = f32(jnp.einsum('bld,dgk->blgk', x.astype(self.dtype), u))
    r = jax.nn.sigmoid(wy[..., 0, :] + ux[..., 0, :])
    z = jax.nn.sigmoid(wy[..., 1, :] + ux[..., 1, :] - f32(b_g))
    rx = (r * f32(x)).astype(self.dtype)
    h = jnp.tanh(wy[..., 2, :] + f32(jnp.einsum('bld,dk->blk', rx, u_g)))
    out = (1.0 - z) * f32(x) + z * h
    return out.astype(x.dtype)


@register('gtrxl')
class GTrXL(LayerBase):
  """Gated layer of GTrXL (Parisotto et al. 2019): the norm sits on the sublayer input only,
  so the stream x is never normalized inside the stack; a ReLU follows each sublayer; and a
  GRU-type gate (GRUGate) replaces both residual sums:

    x = g_attn(x, ReLU(Attn(RMSNorm(x)))),  x = g_mlp(x, ReLU(SwiGLU(RMSNorm(x))))

  Works with any attention variant. Residual dropout applies to the sublayer output before
  the gate. The decoder's final RMSNorm still normalizes the stack's output. Option:
  gate_bias, b_g's initial value (model.residual_options.gate_bias; 2 as in the paper).
  """

  OPTIONS = GTRXL_OPTIONS

  @classmethod
  def extra_matmul_weights(cls, d_model: int) -> int:
    return 2 * 6 * d_model * d_model  # Two gates, six d x d matrices each.

  def gate(self, name: str) -> nn.Module:
    return GRUGate(gate_bias=self.config.residual_option('gate_bias'), dtype=self.config.dtype,
                   param_dtype=self.config.param_dtype, name=name)

  @nn.compact
  def __call__(self, x, ctx: LayerContext):
    y = jax.nn.relu(self.attention(self.norm('pre_attention_norm')(x), ctx))
    x = self.gate('attention_gate')(x, self.dropout(y, ctx))
    x = nn.with_logical_constraint(x, ('batch', 'length', 'embed'))
    y = jax.nn.relu(self.mlp(self.norm('pre_mlp_norm')(x)))
    x = self.gate('mlp_gate')(x, self.dropout(y, ctx))
    return nn.with_logical_constraint(x, ('batch', 'length', 'embed'))


def _stream(x):
  return nn.with_logical_constraint(x, ('batch', 'length', 'embed'))


@register('reversible')
class Reversible(LayerBase):
  """Reversible layer (RevNet, Gomez et al. 2017; Reformer, Kitaev et al. 2020) over a
  residual stream split into two halves:

    y1 = x1 + F(x2),  F(a) = Dropout(Attn(RMSNorm(a)))
    y2 = x2 + G(y1),  G(a) = Dropout(SwiGLU(RMSNorm(a)))

  so the input follows from the output: x2 = y2 - G(y1), x1 = y1 - F(x2). The Decoder trains
  a stack of these through models/reversible.py, which rebuilds each layer's input in the
  backward pass instead of storing it; initialization and decoding run the layer as written
  here. Works with any attention variant and stack; segment memory is refused (`check`).

  `split` puts the embedding into both halves; `merge` hands their mean (y1 + y2) / 2 to the
  final norm, so every width, and the logits kernel, stays d_model (Reformer concatenates the
  halves into a 2 d_model stream instead). The halves are carried in float32 whatever
  model.dtype, so that subtracting F and G rebuilds the inputs to float32 rounding; F and G
  compute in model.dtype. Residual dropout applies to each sublayer output, as in pre_ln.

  `half='attention'` (or 'mlp') applies F (or G) alone to its one input, for the backward
  pass. The sublayers' modules, dropout included, are named, so F and G alone draw the same
  random masks (LSH rotations, dropout) as inside the whole layer.
  """

  REVERSIBLE = True

  @classmethod
  def check(cls, config):
    if config.uses_memory:
      raise ValueError(
          "model.residual='reversible' cannot carry segment memory (Transformer-XL's mem_len, "
          "adaptive span's memory): its training path rebuilds each layer's input and does not "
          'update the memory collection. Set model.attention_options.txl.mem_len=0 / '
          "model.attention_options.adaptive_span.memory=False, or use model.residual='pre_ln'")

  @classmethod
  def split(cls, x):
    x = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    return x, x

  @classmethod
  def merge(cls, carry):
    y1, y2 = carry
    return (y1 + y2) / 2

  def f(self, x2, ctx: LayerContext):
    """F(x2) = Dropout(Attn(RMSNorm(x2)))."""
    return self.dropout(self.attention(self.norm('pre_attention_norm')(x2), ctx), ctx,
                        name='attention_dropout')

  def g(self, y1, ctx: LayerContext):
    """G(y1) = Dropout(SwiGLU(RMSNorm(y1)))."""
    return self.dropout(self.mlp(self.norm('pre_mlp_norm')(y1)), ctx, name='mlp_dropout')

  @nn.compact
  def __call__(self, carry, ctx: LayerContext, half: str | None = None):
    if half == 'attention':
      return self.f(carry, ctx)
    if half == 'mlp':
      return self.g(carry, ctx)
    if half is not None:
      raise ValueError(f"half must be None, 'attention' or 'mlp', got {half!r}")
    x1, x2 = carry
    y1 = _stream(x1 + self.f(x2, ctx).astype(x1.dtype))
    y2 = _stream(x2 + self.g(y1, ctx).astype(x2.dtype))
    return y1, y2
