"""Decoder-only Pre-LN transformer: embed -> N x Block -> RMSNorm -> logits.

The backbone of the selective-attention paper (section 5): Pre-LN, RMSNorm, SwiGLU,
QK-norm, no biases, learned absolute positions, d_model = 64 d and n_heads = n_layers = d.
"""

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from models import attention, layers, options, residual, reversible, stacks
from models import universal  # noqa: F401  (registers model.stack='universal')

Dtype = Any
POSITION_EMBEDDINGS = ('learned', 'sinusoidal', 'none')
REMAT_POLICIES = stacks.REMAT_POLICIES

# Model settings renamed since runs were recorded: old name -> new (training/run_config.py
# migrates records and refuses the old name on the command line; from_config names the new one).
RENAMED_FIELDS = {'block': 'residual', 'block_options': 'residual_options'}

# The option groups of config.model: field -> the registry whose entries declare them
# (models/options.py). The attention variants' group has one sub-group per variant
# (attention_options.<variant>.<name>); the residual wirings' and stacks' are flat.
# TransformerConfig holds them resolved.
OPTION_GROUPS = {
    'attention_options': attention.registry.VARIANTS,
    'residual_options': residual.RESIDUALS,
    'stack_options': stacks.STACKS,
}


def default_options(group: str) -> dict:
  """The defaults of every user-facing option of `group` (a key of OPTION_GROUPS): what
  configs/schema.py declares (per variant for attention_options: {variant: {name: v}})."""
  return OPTION_GROUPS[group].default_options()


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """Resolved model hyper-parameters; build it with `from_config`.

  Attributes:
    vocab_size: number of token ids.
    d_model: residual width.
    n_heads: attention heads per layer.
    n_layers: number of layers.
    head_dim: width of each head.
    mlp_dim: SwiGLU hidden width.
    max_len: size of the learned position table (and of decoding caches).
    position_embedding: 'learned' absolute positions, 'sinusoidal' ones (fixed, added at the
      token embedding's scale: layers.add_at_scale), or 'none' (relative-position variants;
      the universal stack's coordinates).
    attention: registry name per layer (a tuple of length n_layers).
    attention_impl: implementation switch, one of attention.IMPLEMENTATIONS.
    attention_block_size: block length of the 'blocksparse' implementation.
    attention_options: the hyper-parameters of the variants in use, sorted (variant, options)
      pairs, each variant's options sorted (name, value) pairs with every option it declares,
      defaults filled in (models/attention/registry.py); given as {variant: {name: value}}
      too, with groups of other registered variants (checked, then dropped). Read a
      variant's with `options_of`.
    qk_norm: RMS-normalize queries and keys.
    tied_embeddings: reuse the input embedding as output projection.
    dropout_rate: residual dropout (0 in the paper).
    dtype: computation dtype.
    param_dtype: parameter dtype.
    remat: rematerialization policy, one of REMAT_POLICIES.
    residual: residual wiring of each layer, a name in models/residual.py.
    stack: how the layers are applied, a name in models/stacks.py or 'auto'.
    ff_chunk_len: positions per chunk of the SwiGLU feed-forward (layers.chunked_swiglu_mlp:
      its (tokens, mlp_dim) hidden activation is never whole); 0 = all positions at once. A
      length that does not divide the sequence is padded.
    residual_options: the residual wirings' hyper-parameters (config.model.residual_options, e.g. GTrXL's
      gate_bias), sorted (name, value) pairs; every option a registered wiring declares,
      defaults filled in. Read one with `residual_option`.
    stack_options: the stacks' hyper-parameters (config.model.stack_options, e.g. the
      universal stack's steps, act, max_steps, ponder), sorted (name, value) pairs; every
      option a registered stack declares, defaults filled in. Read one with `stack_option`.
    target_platform: platform of the devices the program is compiled for ('cpu', 'gpu',
      'tpu'), read from the mesh by training/train.py's setup; '' = this process's
      jax.default_backend(). Kernels are chosen for it (models/attention/dispatch.py): a CPU
      host may compile for a TPU slice ahead of time.
    target_devices: number of devices of that mesh; 0 = this process's jax.device_count().
  """
  vocab_size: int
  d_model: int
  n_heads: int
  n_layers: int
  head_dim: int
  mlp_dim: int
  max_len: int
  attention: tuple[str, ...]
  position_embedding: str = 'learned'
  attention_impl: str = 'auto'
  attention_block_size: int = 128
  attention_options: tuple = ()
  qk_norm: bool = True
  tied_embeddings: bool = False
  dropout_rate: float = 0.0
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32
  remat: str = 'none'
  residual: str = 'pre_ln'
  stack: str = 'auto'
  ff_chunk_len: int = 0
  residual_options: tuple = ()
  stack_options: tuple = ()
  target_platform: str = ''
  target_devices: int = 0

  def __post_init__(self):
    for name in ('vocab_size', 'd_model', 'n_heads', 'n_layers', 'head_dim', 'mlp_dim', 'max_len',
                 'attention_block_size'):
      if getattr(self, name) < 1:
        raise ValueError(f'model.{name} must be >= 1, got {getattr(self, name)}')
    if len(self.attention) != self.n_layers:
      raise ValueError(f'model.attention lists {len(self.attention)} layers but n_layers is '
                       f'{self.n_layers}')
    for name in sorted(set(self.attention)):
      attention.get(name)  # An unknown variant name is the first error reported.
    options = attention.resolve_options(_per_variant(self.attention_options), self.attention)
    object.__setattr__(self, 'attention_options', _pairs(options))
    for name in sorted(set(self.attention)):
      try:  # A variant's checks name its options; the message says whose they are.
        attention.traits.of(name).validate(options[name], self.n_heads, self.n_layers)
      except ValueError as e:
        raise ValueError(f'model.attention_options.{name}: {e}') from None
    if self.attention_impl not in attention.IMPLEMENTATIONS:
      raise ValueError(f'unknown model.attention_impl {self.attention_impl!r}; known: '
                       f'{", ".join(attention.IMPLEMENTATIONS)}')
    if self.attention_impl != 'auto':  # A name no layer can run fails now ('auto' cannot).
      implementations(self)
    if self.position_embedding not in POSITION_EMBEDDINGS:
      raise ValueError(f'unknown model.position_embedding {self.position_embedding!r}; known: '
                       f'{", ".join(POSITION_EMBEDDINGS)}')
    relative = sorted(n for n in set(self.attention) if attention.traits.of(n).RELATIVE_POSITIONS)
    if relative and self.position_embedding != 'none':
      raise ValueError(f'{", ".join(relative)} attention encodes relative positions itself: set '
                       f"model.position_embedding='none' (got {self.position_embedding!r})")
    if self.remat not in REMAT_POLICIES:
      raise ValueError(f'unknown model.remat {self.remat!r}; known: {", ".join(REMAT_POLICIES)}')
    if not 0.0 <= self.dropout_rate < 1.0:
      raise ValueError(f'model.dropout_rate must be in [0, 1), got {self.dropout_rate}')
    if isinstance(self.ff_chunk_len, bool) or not isinstance(self.ff_chunk_len, int) or (
        self.ff_chunk_len < 0):
      raise ValueError(f'model.ff_chunk_len must be an integer >= 0 (0 = no chunking), got '
                       f'{self.ff_chunk_len!r}')
    resolved = residual.RESIDUALS.resolve_options(dict(self.residual_options), [self.residual])
    object.__setattr__(self, 'residual_options', tuple(sorted(resolved.items())))
    stack = [self.stack] if self.stack != 'auto' else []  # 'auto' runs a stack with no options.
    resolved = stacks.STACKS.resolve_options(dict(self.stack_options), stack)
    object.__setattr__(self, 'stack_options', tuple(sorted(resolved.items())))
    residual.get(self.residual).check(self)
    if self.stack != 'auto':
      stacks.get(self.stack).check(self)

  def options_of(self, variant: str) -> dict:
    """{name: value} of the options of `variant`, a variant in use
    (config.model.attention_options.<variant>)."""
    for name, pairs in self.attention_options:
      if name == variant:
        return dict(pairs)
    raise ValueError(f'attention variant {variant!r} is not in use (model.attention: '
                     f'{", ".join(dict.fromkeys(self.attention))})')

  def with_options(self, updates: dict[str, dict]) -> 'TransformerConfig':
    """This config with {variant: {name: value}} set in the options of the variants in use;
    the same object when nothing changes (a compiled step keyed on the config is reused)."""
    options = {name: {**dict(pairs), **updates.get(name, {})}
               for name, pairs in self.attention_options}
    if _pairs(options) == self.attention_options:
      return self
    return dataclasses.replace(self, attention_options=_pairs(options))

  def residual_option(self, name: str):
    """The residual wiring's option `name` (config.model.residual_options; its default when not given)."""
    return options.lookup(self.residual_options, name, 'model.residual_options')

  def stack_option(self, name: str):
    """The stack option `name` (config.model.stack_options; its default when not given)."""
    return options.lookup(self.stack_options, name, 'model.stack_options')

  @property
  def target(self) -> tuple[str, int]:
    """(platform, device count) the program is compiled for: target_platform and
    target_devices, or this process's backend and device count where they are unset."""
    return (self.target_platform or jax.default_backend(),
            self.target_devices or jax.device_count())

  @property
  def homogeneous(self) -> bool:
    """True when every layer uses the same variant."""
    return len(set(self.attention)) == 1

  @property
  def uses_memory(self) -> bool:
    """True if some layer carries previous-segment state (the 'memory' collection)."""
    return any(attention.traits.of(name).uses_memory(self.options_of(name))
               for name in set(self.attention))

  @property
  def stack_name(self) -> str:
    """The stack the layers run in: `stack`, with 'auto' resolved (models/stacks.py)."""
    return stacks.resolve(self)

  @classmethod
  def from_config(cls, model_cfg) -> 'TransformerConfig':
    """Resolves the `d` size knob and defaults of a `config.model` section.

    d_model = 64 d and n_heads = n_layers = d unless overridden; head_dim = d_model / n_heads;
    mlp_dim = 8/3 d_model rounded up to a multiple of 64 (keeps SwiGLU at ~8 d_model^2 params,
    so a layer has ~12 d_model^2 parameters as in the paper's table 8).

    Args:
      model_cfg: mapping with the keys of configs/schema.py's `model` section.

    Returns:
      The validated TransformerConfig.
    """
    m = dict(model_cfg)
    known = {f.name for f in dataclasses.fields(cls)} | {'d'}
    unknown = sorted(set(m) - known)
    if unknown:  # A misspelt or renamed key would otherwise be ignored: its default runs.
      renamed = ''.join(f' ({k} was renamed {RENAMED_FIELDS[k]})' for k in unknown
                        if k in RENAMED_FIELDS)
      raise ValueError(f'unknown model setting(s) {", ".join(unknown)}{renamed}; known: '
                       f'{", ".join(sorted(known))}')
    d = m.get('d') or 0
    d_model = m.get('d_model') or 64 * d
    n_heads = m.get('n_heads') or d
    # The universal stack applies one layer: its depth is its steps.
    n_layers = m.get('n_layers') or (1 if m.get('stack') == 'universal' else d)
    if not (d_model and n_heads and n_layers):
      raise ValueError('set model.d (size knob) or all of model.d_model, model.n_heads, model.n_layers')
    head_dim = m.get('head_dim')
    if not head_dim:
      if d_model % n_heads:
        raise ValueError(f'model.d_model={d_model} is not divisible by model.n_heads={n_heads}; '
                         'change one of them or set model.head_dim explicitly')
      head_dim = d_model // n_heads
    mlp_dim = m.get('mlp_dim') or 64 * math.ceil(8 * d_model / 3 / 64)
    att = m.get('attention', 'dense')
    if isinstance(att, str):
      names = [a.strip() for a in att.split(',') if a.strip()]
      att = tuple(names * n_layers if len(names) == 1 else names)
    # A key the mapping leaves out takes the field's default: the one default of each setting
    # (tests/models/test_transformer.py checks them against configs/schema.py's).
    defaults = {f.name: f.default for f in dataclasses.fields(cls)
                if f.default is not dataclasses.MISSING}
    get = lambda key: m[key] if m.get(key) is not None else defaults[key]  # noqa: E731
    return cls(
        vocab_size=m['vocab_size'], d_model=d_model, n_heads=n_heads, n_layers=n_layers,
        head_dim=head_dim, mlp_dim=mlp_dim, max_len=m['max_len'], attention=tuple(att),
        position_embedding=get('position_embedding'), attention_impl=get('attention_impl'),
        attention_block_size=get('attention_block_size'),
        attention_options=m.get('attention_options') or {}, qk_norm=get('qk_norm'),
        tied_embeddings=get('tied_embeddings'), dropout_rate=get('dropout_rate'),
        dtype=jnp.dtype(get('dtype')), param_dtype=jnp.dtype(get('param_dtype')),
        remat=get('remat'), residual=get('residual'), stack=get('stack'),
        ff_chunk_len=get('ff_chunk_len'),
        residual_options=tuple(sorted(dict(m.get('residual_options') or {}).items())),
        stack_options=tuple(sorted(dict(m.get('stack_options') or {}).items())),
        target_platform=get('target_platform'), target_devices=get('target_devices'))

  def num_params(self) -> int:
    """Number of trainable parameters, counted from the shapes `Decoder.init` creates (no
    compute; every variant's own parameters included)."""
    return count_params(self)

  def train_flops_per_token(self, seq_len: int, metrics: dict | None = None) -> float:
    """Training FLOPs per token: 6 N_matmul + 12 L H d_head T (PaLM, appendix B).

    N_matmul counts the weights used in matmuls (layers, with the residual wiring's own, such as
    GTrXL's gates, and the output projection, not the embedding lookups); the attention term
    counts the full T x T score matrix as PaLM does. L is the number of layer applications
    per token (Stack.applications): n_layers, or the universal stack's steps; with ACT, the
    mean steps the tokens took (N, from `metrics`, the logged training metrics; without
    them the cap M). The ACT scan computes all M steps for every position and discards the
    halted ones' updates: that work is not counted, like padding.

    These are model FLOPs, the MFU convention: recomputation is not counted. The reversible
    block (same count as pre_ln) recomputes each sublayer's forward once in the backward pass
    (about 4/3 of these FLOPs for the layers are executed), and model.remat and
    model.ff_chunk_len (which recomputes the feed-forward's hidden activation) add theirs.

    Args:
      seq_len: training sequence length T.

    Returns:
      FLOPs for a forward and backward pass per token.
    """
    stack = stacks.of(self)
    depth = stack.applications(self, metrics)
    matmul = depth * (4 * self.n_heads * self.head_dim * self.d_model
                      + 3 * self.d_model * self.mlp_dim
                      + residual.get(self.residual).extra_matmul_weights(self.d_model)
                      + stack.extra_matmul_weights(self)) + self.d_model * self.vocab_size
    return 6.0 * matmul + 12.0 * depth * self.n_heads * self.head_dim * seq_len


class Decoder(nn.Module):
  """Decoder-only language model.

  Attributes:
    config: the model config.
  """
  config: TransformerConfig

  def shared_attention_params(self) -> dict:
    """{variant: {name: parameter}} of the variants that share parameters across layers
    (Traits.shared_params), created here as '<variant>_shared/<name>'."""
    cfg = self.config
    shared = {}
    for variant in dict.fromkeys(cfg.attention):
      specs = attention.traits.of(variant).shared_params(cfg.options_of(variant), cfg.n_heads,
                                                   cfg.head_dim)
      if specs:
        shared[variant] = SharedParams(specs, cfg.param_dtype, name=f'{variant}_shared')()
    return shared

  def reversible_stack(self, carry, ctx: residual.LayerContext):
    """The stack of reversible layers through models/reversible.py, whose backward pass
    rebuilds each layer's input instead of storing it.

    The layers' parameters (and any other collection given, e.g. 'pruning') are read from
    this module's variables; each rng stream gets one key here, which layer i folds i into.
    The 'losses' and 'metrics' the layers sow are put where the layers would sow them.
    Initialization, decoding and calls that collect 'intermediates' (--mode=inspect) run the
    layers as modules instead (the same values; parameters and caches made there).
    """
    cfg = self.config
    keys = {s: self.make_rng(s) for s in rng_streams(cfg) if self.has_rng(s)}
    skip = ('params', 'intermediates', *reversible.SOWN)
    reads = {c: nn.unbox(tree) for c, tree in self.variables.items() if c not in skip}
    carry, sown = reversible.run(cfg, nn.unbox(self.variables['params']), carry, ctx, keys,
                                 reads)
    for collection, tree in sown.items():
      if self.is_mutable_collection(collection):
        for name, sub in tree.items():
          self.put_variable(collection, name, sub)
    return carry

  @nn.compact
  def __call__(self, inputs, *, positions=None, segment_ids=None, deterministic=True,
               return_hidden=False, decode=False):
    """Next-token logits.

    Args:
      inputs: (batch, length) int token ids.
      positions: (batch, length) positions within each document; defaults to 0..length-1.
      segment_ids: (batch, length) document ids for packed rows (0 = padding); defaults to 1.
      deterministic: disables dropout.
      return_hidden: return (final hidden states, output projection) instead of logits, for
        a loss that fuses the projection (training/losses.py).
      decode: autoregressive decoding with the mutable 'cache' collection: an init call
        creates the caches, then each call takes one token per row (models/decode.py).

    Returns:
      (batch, length, vocab_size) float32 logits, or ((batch, length, d_model) hidden states,
      (d_model, vocab_size) projection) in the compute dtype.
    """
    cfg = self.config
    b, n = inputs.shape
    if n > cfg.max_len:
      raise ValueError(f'sequence length {n} exceeds the position table (model.max_len={cfg.max_len})')
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))
    if segment_ids is None:
      segment_ids = jnp.ones((b, n), jnp.int32)

    embed = layers.Embed(cfg.vocab_size, cfg.d_model, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                         name='token_embed')
    x = embed(inputs)
    if cfg.position_embedding == 'learned':
      x = x + layers.LearnedPositions(cfg.max_len, cfg.d_model, dtype=cfg.dtype,
                                      param_dtype=cfg.param_dtype, name='pos_embed')(positions)
    elif cfg.position_embedding == 'sinusoidal':  # At the embedding's scale (add_at_scale).
      x = layers.add_at_scale(x, layers.sinusoid(positions, cfg.d_model))
    x = nn.Dropout(cfg.dropout_rate)(x, deterministic=deterministic)
    x = nn.with_logical_constraint(x, ('batch', 'length', 'embed'))

    ctx = residual.LayerContext(positions=positions, segment_ids=segment_ids,
                                deterministic=deterministic, decode=decode,
                                shared=self.shared_attention_params())
    wiring = residual.get(cfg.residual)
    carry = wiring.split(x)
    if (wiring.REVERSIBLE and stacks.of(cfg).REVERSIBLE_TRAINING and not decode
        and not self.is_initializing()
        and not self.is_mutable_collection('intermediates')):
      carry = self.reversible_stack(carry, ctx)
    else:
      carry = stacks.of(cfg).apply(cfg, carry, ctx)
    x = wiring.merge(carry)

    x = layers.RMSNorm(dtype=cfg.dtype, param_dtype=cfg.param_dtype, name='final_norm')(x)
    if cfg.tied_embeddings:
      w = embed.embedding.T
    else:
      w = self.param('logits_kernel', nn.with_logical_partitioning(
          layers.default_kernel_init, ('embed', 'vocab')), (cfg.d_model, cfg.vocab_size),
          cfg.param_dtype)
    w = w.astype(cfg.dtype)
    if return_hidden:
      return x, w
    if decode and not cfg.tied_embeddings:  # Decoding's few rows: layers.matmul's kernel.
      b, t, d = x.shape
      logits = layers.matmul(x.reshape(b * t, d), w,
                             preferred_element_type=jnp.float32).reshape(b, t, -1)
    else:
      logits = jnp.einsum('btd,dv->btv', x, w, preferred_element_type=jnp.float32)
    return nn.with_logical_constraint(logits, ('batch', 'length', 'vocab'))


class SharedParams(nn.Module):
  """The parameters one variant shares across its layers, by name."""
  specs: dict
  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self) -> dict:
    return {name: self.param(name, nn.with_logical_partitioning(spec.init, spec.axes),
                             spec.shape, self.param_dtype)
            for name, spec in sorted(self.specs.items())}


def for_eval(config: TransformerConfig) -> TransformerConfig:
  """`config` with the option values its variants use at evaluation
  (Traits.eval_options); the same object when none differ."""
  return config.with_options({name: attention.traits.of(name).eval_options(config.options_of(name))
                             for name in dict.fromkeys(config.attention)})


def count_params(config: TransformerConfig) -> int:
  """Trainable parameters of Decoder(config), from jax.eval_shape of its init."""
  n = min(config.max_len, 8)
  shapes = jax.eval_shape(lambda: Decoder(config).init(
      jax.random.key(0), jnp.zeros((1, n), jnp.int32)))
  return sum(math.prod(a.shape) for a in jax.tree.leaves(nn.unbox(shapes['params'])))


def variant_classes(config: TransformerConfig) -> list[type]:
  """The attention classes the model's layers use, in order of first use."""
  return [attention.get(name) for name in dict.fromkeys(config.attention)]


def specialized(config: TransformerConfig, params) -> TransformerConfig:
  """`config` with the options its variants derive from `params` (e.g. adaptive span's
  per-layer trimmed spans); the same object when nothing changes, so a compiled step keyed on
  the config is reused."""
  stack = stacks.of(config)
  return config.with_options({
      name: attention.traits.of(name).specialize(config, lambda i: stack.layer_tree(config, params, i))
      or {} for name in dict.fromkeys(config.attention)})


def row_periods(config: TransformerConfig) -> dict[str, int]:
  """{variant: p} for the variants whose blocks are anchored to multiples of p in the row."""
  return {name: p for name in dict.fromkeys(config.attention)
          if (p := attention.traits.of(name).row_period(config.options_of(name)))}


def param_bounds(config: TransformerConfig) -> dict[str, tuple[float, float]]:
  """{parameter name: (lo, hi)} the optimizer keeps in a box, from the variants in use."""
  return {k: v for name in dict.fromkeys(config.attention)
          for k, v in attention.traits.of(name).param_bounds(config.options_of(name)).items()}


def rng_streams(config: TransformerConfig) -> tuple[str, ...]:
  """Random streams a training forward pass draws from: 'dropout' and the variants' own."""
  extra = [s for name in dict.fromkeys(config.attention)
           for s in attention.traits.of(name).rng_streams(config.options_of(name))]
  return ('dropout', *dict.fromkeys(s for s in extra if s != 'dropout'))


def implementations(config: TransformerConfig) -> list[str]:
  """The implementation each layer's attention runs on this backend (model.attention_impl
  resolved per variant, as models/residual.py builds the modules).

  Raises:
    ValueError: model.attention_impl names one that a layer's variant cannot run here.
  """
  out = []
  for i, name in enumerate(config.attention):
    try:
      out.append(residual.make_attention(config, name, i, parent=None).impl)
    except ValueError as e:
      raise ValueError(f'model.attention {name!r} (layer {i}): {e}') from None
  return out


def _per_variant(options) -> dict:
  """attention_options as {variant: {name: value}}, from that form or from sorted
  (variant, pairs) pairs (a resolved config's)."""
  if isinstance(options, tuple):
    try:
      return {name: dict(pairs) for name, pairs in options}
    except (TypeError, ValueError):
      raise ValueError(f'model.attention_options must be {{variant: {{name: value}}}} (each '
                       f'variant has its own options), got {options!r}') from None
  return {name: dict(values) if hasattr(values, 'items') else values
          for name, values in dict(options).items()}


def _pairs(options: dict) -> tuple:
  """{variant: {name: value}} -> sorted (variant, sorted (name, value) pairs) pairs."""
  return tuple((name, tuple(sorted(values.items()))) for name, values in sorted(options.items()))
