"""Residual wiring of one layer (`model.block`): a registry, one entry per wiring.

Every block has the same signature, `x = block(x, ctx)`, with the frozen `LayerContext` that
the stack hands to each layer, so a stack never needs to know which block it applies:

  pre_ln   x + Attn(RMSNorm(x)), then x + SwiGLU(RMSNorm(x))   (today's backbone)

The later variants add their wiring here (GTrXL's gates, reversible halves) and nowhere else.
"""

from typing import Any

import flax
import flax.linen as nn
import jax

from models import attention, layers
from models.registry import Registry

BLOCKS = Registry('block')
register = BLOCKS.register
known = BLOCKS.known
get = BLOCKS.get


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
      (MultiHeadAttention.shared_params), made once by the Decoder.
  """
  positions: jax.Array
  segment_ids: jax.Array
  step: Any = None
  shared: dict = flax.struct.field(default_factory=dict)
  deterministic: bool = flax.struct.field(pytree_node=False, default=True)
  decode: bool = flax.struct.field(pytree_node=False, default=False)


def make_attention(config, variant: str, layer_index: int, **kwargs) -> nn.Module:
  """Layer `layer_index`'s attention module of `variant`, configured from `config`; its `impl`
  is the concrete implementation model.attention_impl gives this variant on this run's
  backend ('auto' resolved: MultiHeadAttention.implementation)."""
  cls = attention.get(variant)
  impl = cls.implementation(
      config.attention_impl, options=dict(config.attention_options), head_dim=config.head_dim,
      backend=jax.default_backend(), dtype=config.dtype, block_size=config.attention_block_size,
      devices=jax.device_count())
  return cls(
      num_heads=config.n_heads, head_dim=config.head_dim, qk_norm=config.qk_norm,
      impl=impl, block_size=config.attention_block_size,
      layer_index=layer_index, max_len=config.max_len, num_layers=config.n_layers,
      options=config.attention_options, dtype=config.dtype, param_dtype=config.param_dtype,
      **kwargs)


class BlockBase(nn.Module):
  """Fields every block takes; a block's `__call__(x, ctx)` returns the layer's output.

  Attributes:
    config: the model config (models/transformer.py TransformerConfig).
    attention_name: registry name of this layer's attention variant.
    layer_index: the index the stack gives this layer (what variants with a layer period
      read; see MultiHeadAttention.layer_period).
  """
  config: Any
  attention_name: str
  layer_index: int = 0

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
    """The SwiGLU feed-forward of this layer."""
    cfg = self.config
    return layers.SwiGLU(cfg.mlp_dim, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                         name='mlp')(x)

  def dropout(self, h, ctx: LayerContext):
    """Residual dropout (model.dropout_rate)."""
    return nn.Dropout(self.config.dropout_rate)(h, deterministic=ctx.deterministic)


@register('pre_ln')
class PreLN(BlockBase):
  """Pre-LN block: x + Attn(RMSNorm(x)), then x + SwiGLU(RMSNorm(x))."""

  @nn.compact
  def __call__(self, x, ctx: LayerContext):
    x = x + self.dropout(self.attention(self.norm('pre_attention_norm')(x), ctx), ctx)
    x = x + self.dropout(self.mlp(self.norm('pre_mlp_norm')(x)), ctx)
    return nn.with_logical_constraint(x, ('batch', 'length', 'embed'))
