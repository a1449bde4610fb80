"""Universal Transformer stack (`model.stack='universal'`): one weight-shared layer applied
for T recurrent steps, or for a number of steps each position chooses with Adaptive
Computation Time (Dehghani et al. 2019; Graves 2016; the survey's "Make it Recurrent" and
"Adaptive Computation Time").

  s^0 = the embedded input
  s^n = Block(s^{n-1} + rms(s^{n-1}) P(i, n))

P(i, n) is the coordinate embedding: the sinusoid of position i plus the sinusoid of step n
(layers.sinusoid), added to the state before every step as the Universal Transformer does. Its
position half is left out when the attention encodes relative positions itself
(Transformer-XL), which must not see absolute positions.

The coordinates are added at the state's own scale, s + rms(s) P (`add_coordinates`). The
Universal Transformer is post-LN: its state has unit RMS at every step, and P (RMS about 1)
is comparable to it. This backbone's state is an un-normalized Pre-LN stream that starts as
the token embedding (std 0.02) and grows step by step; P added as is would outweigh the
tokens 50 to 1 at the first step (at initialization every position then halted after the same
number of steps, whatever its token), and be outweighed by the stream later. With the scale,
the layer's first norm sees RMSNorm(s) + P up to a factor: the paper's input at every step.

The stack's settings are its options, config.model.stack_options (Universal.OPTIONS): steps
(T), act, max_steps (M) and ponder (τ).

Fixed steps (model.stack_options.act=False): T = model.stack_options.steps applications; the
output is s^T. With shared weights this is an unrolled stack of T layers holding identical
weights.

ACT (model.stack_options.act=True), for each position i:

  h^n = σ(w · rms(s^n) + b)               the halting unit: w (d,), b starting at 1; rms(.) is
                                          a parameter-free RMS normalization of the state
  N   = min(min{n : h^1 + ... + h^n >= 1 - ε}, M)       ε = ACT_EPSILON, M = max_steps
  p^n = h^n for n < N,  R = 1 - (h^1 + ... + h^{N-1}) for n = N
  out = Σ_n p^n s^n                       (the p^n sum to 1)
  ponder cost τ mean(N + R) over real tokens, τ = ponder, into 'losses'

A halted position's state stops changing (s^n = s^{n-1} after its N-th step), but it stays a
key for the positions still computing: every step's attention reads every position's state
with that step's coordinates added.

How it runs:
- Training, and every call that needs per-step state (decoding caches, segment memory,
  collected intermediates, init): a masked `nn.scan` over all M (or T) steps, which stays
  differentiable. Parameters are broadcast (one layer); every other collection gets a leading
  step axis: one decoding cache per step, one segment memory per step, sown losses and
  metrics per step.
- Inference otherwise (deterministic ACT forward, e.g. evaluation): an `nn.while_loop` that
  stops once every position has halted, with the same outputs. The layer's own sown losses
  and metrics are not collected there (evaluation reads neither).
- Decoding: each new token runs the M steps of the scan with one cache per step; after it
  halts its state stays frozen, and the later steps' caches still receive that frozen state,
  because later tokens that compute longer attend to it there (as in the forward pass).

The layer may have any `model.residual` and any attention variant. A reversible layer runs its
two-stream wiring here, but its activations are stored like any layer's: models/reversible.py
trains the layered stacks only.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from models import attention, layers, residual, stacks
from models.attention import base, traits
from models.options import Option

ACT_EPSILON = 0.01  # A position halts once its cumulative halting probability reaches 1 - ε.
HALTING_BIAS_INIT = 1.0  # b_h starts at 1 (Graves 2016; the spec): p ≈ 0.73 at first.


def coordinates(positions, step, features: int, with_positions: bool = True):
  """P(i, n): sinusoid(position i) + sinusoid(step n), (batch, length, features) float32.

  Args:
    positions: (batch, length) int positions within each document.
    step: the step number n (1-based; a traced scalar is fine).
    features: model width.
    with_positions: False leaves the position half out (relative-position attention).
  """
  signal = layers.sinusoid(step, features)
  if with_positions:
    return layers.sinusoid(positions, features) + signal
  return jnp.broadcast_to(signal, positions.shape + (features,))


def add_coordinates(state, positions, step, with_positions: bool = True):
  """s + rms(s) P(i, n) for the state (a tree of (batch, length, d) arrays: each array by
  its own RMS per position; layers.add_at_scale), in the state's dtype."""
  return jax.tree.map(lambda s: layers.add_at_scale(
      s, coordinates(positions, step, s.shape[-1], with_positions)), state)


def _rms(x):
  x = x.astype(jnp.float32)
  return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + 1e-6)


class HaltingUnit(nn.Module):
  """ACT's halting probability h = σ(w · rms(s) + b) per position, float32 (batch, length).

  Attributes:
    param_dtype: parameter dtype.
  """
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, state):
    d = state.shape[-1]
    w = self.param('kernel', nn.with_logical_partitioning(
        nn.initializers.normal(d ** -0.5), ('embed',)), (d,), self.param_dtype)
    b = self.param('bias', nn.with_logical_partitioning(
        nn.initializers.constant(HALTING_BIAS_INIT), ()), (), self.param_dtype)
    return jax.nn.sigmoid(_rms(state) @ w.astype(jnp.float32) + b.astype(jnp.float32))


def _where(mask, a, b):
  """Per position: a where mask, else b (trees of (batch, length, d) arrays)."""
  return jax.tree.map(lambda u, v: jnp.where(mask[..., None], u, v), a, b)


def _relative(config) -> bool:
  return any(attention.traits.of(name).RELATIVE_POSITIONS for name in set(config.attention))


class UniversalStep(nn.Module):
  """One recurrent step: the shared layer on the state plus its coordinates, and (ACT) the
  halting bookkeeping. `carry` is a dict: 'state' (the layer's carry), 'n' (steps done), and
  with ACT 'out' (Σ p s so far, float32), 'cum' (Σ h of the steps before halting), 'remainder'
  (R, set at halting), 'steps' (N so far) and 'halted' (bool), each (batch, length).

  Attributes:
    config: the model config.
  """
  config: Any

  @nn.compact
  def __call__(self, carry, ctx: residual.LayerContext):
    cfg = self.config
    layer_cls = residual.get(cfg.residual)
    state = carry['state']
    n = carry['n'] + 1  # This step's number.
    layer = stacks.remat(layer_cls, cfg.remat, scanned=True)(
        cfg, cfg.attention[0], layer_index=0, name='block')
    new = layer(add_coordinates(state, ctx.positions, n, with_positions=not _relative(cfg)),
                ctx.replace(step=carry['n']))
    if not cfg.stack_option('act'):
      return {'state': new, 'n': n}
    running = ~carry['halted']
    state = _where(running, new, state)  # A halted position's state stops changing.
    h = HaltingUnit(param_dtype=cfg.param_dtype, name='halting')(layer_cls.merge(state))
    cum = carry['cum']
    reached = running & ((cum + h >= 1.0 - ACT_EPSILON) | (n >= cfg.stack_option('max_steps')))
    p = jnp.where(reached, 1.0 - cum, jnp.where(running, h, 0.0))
    self.sow('intermediates', 'halting_weight', p)  # p^n: zero once halted, sums to 1.
    return {
        'state': state,
        'n': n,
        'out': jax.tree.map(lambda o, s: o + p[..., None] * s.astype(jnp.float32),
                            carry['out'], state),
        'cum': jnp.where(running & ~reached, cum + h, cum),
        'remainder': jnp.where(reached, 1.0 - cum, carry['remainder']),
        'steps': carry['steps'] + running.astype(jnp.int32),
        'halted': carry['halted'] | reached,
    }


def _scan(length: int, broadcast: list[str]):
  """nn.scan of the step: the `broadcast` collections (the parameters, and read-only inputs
  such as selective attention's 'pruning' budgets: one layer, one of each) are shared by
  every step; every other collection (caches, segment memory, sown values) and every rng
  stream but 'params' gets one entry per step."""
  return nn.scan(stacks.carry_only(UniversalStep), variable_broadcast=list(broadcast),
                 variable_axes={True: 0}, split_rngs={'params': False, True: True},
                 in_axes=(nn.broadcast,), length=length,
                 metadata_params={nn.PARTITION_NAME: 'layers'})


class UniversalLoop(nn.Module):
  """The recurrent steps over the layer's carry x (see the module docstring).

  Attributes:
    config: the model config.
  """
  config: Any

  def early_stop(self, ctx: residual.LayerContext) -> bool:
    """True where the loop may stop once every position has halted: a deterministic ACT
    forward that keeps no per-step state (no decoding cache, segment memory, init or
    collected intermediates)."""
    return (self.config.stack_option('act') and ctx.deterministic and not ctx.decode
            and not self.is_initializing() and not self.config.uses_memory
            and not self.is_mutable_collection('intermediates'))

  @nn.compact
  def __call__(self, carry, ctx: residual.LayerContext):
    cfg = self.config
    init = {'state': carry, 'n': jnp.zeros((), jnp.int32)}
    broadcast = ['params'] + [c for c in self.variables
                              if c != 'params' and not self.is_mutable_collection(c)]
    if not cfg.stack_option('act'):
      final, _ = _scan(cfg.stack_option('steps'), broadcast)(cfg, name='step')(init, ctx)
      return final['state']
    shape = ctx.segment_ids.shape
    init.update(out=jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), carry),
                cum=jnp.zeros(shape, jnp.float32), remainder=jnp.zeros(shape, jnp.float32),
                steps=jnp.zeros(shape, jnp.int32), halted=jnp.zeros(shape, bool))
    if self.early_stop(ctx):
      final = nn.while_loop(
          lambda mdl, c: jnp.any(~c['halted']),
          lambda mdl, c: UniversalStep(cfg, name='step')(c, ctx),
          self, init, broadcast_variables='params', carry_variables=False, split_rngs={})
    else:
      final, _ = _scan(cfg.stack_option('max_steps'), broadcast)(cfg, name='step')(init, ctx)
    self.report(final['steps'], final['remainder'], ctx.segment_ids)
    return jax.tree.map(lambda o, s: o.astype(s.dtype), final['out'], carry)

  def report(self, steps, remainder, segment_ids):
    """Sows the ponder cost into 'losses', its statistics into 'metrics' (mean N, mean
    N + R, the fraction of tokens halting at each step) and N, R per position into
    'intermediates'. Padding (segment id 0) is left out of the means."""
    cfg = self.config
    real = (segment_ids > 0).astype(jnp.float32)
    count = jnp.maximum(jnp.sum(real), 1.0)
    mean = lambda a: jnp.sum(a * real) / count
    ponder = mean(steps + remainder)
    self.sow('losses', 'ponder_cost', cfg.stack_option('ponder') * ponder)
    self.sow('metrics', 'act_steps', mean(steps.astype(jnp.float32)))
    self.sow('metrics', 'ponder', ponder)
    for k in range(1, cfg.stack_option('max_steps') + 1):
      self.sow('metrics', f'halted_at_{k}', mean((steps == k).astype(jnp.float32)))
    self.sow('intermediates', 'act_steps', steps)
    self.sow('intermediates', 'act_remainder', remainder)


@stacks.register('universal')
class Universal(stacks.Stack):
  """One weight-shared layer applied for model.stack_options.steps steps, or with ACT for up
  to model.stack_options.max_steps: parameters 'universal/step/block' (and
  'universal/step/halting' with ACT)."""

  REVERSIBLE_TRAINING = False
  TEST_CONFIG = {'n_layers': 1, 'position_embedding': 'none'}  # One layer; its coordinates.
  # config.model.stack_options. The same parameters run for other step counts, so evaluation
  # may change steps and max_steps (e.g. more steps than trained); ponder weighs a training
  # loss only; act adds the halting unit's parameters.
  OPTIONS = {
      'steps': Option(4, 'T: recurrent steps without ACT', change='training'),
      'act': Option(False, 'halt per position with ACT (Graves 2016): adds the halting unit',
                    change='model'),
      'max_steps': Option(8, "M: ACT's cap on the steps", change='training'),
      'ponder': Option(0.01, "τ: ACT's ponder cost weight (loss += τ mean(N + R))",
                       change='training'),
  }

  @classmethod
  def check(cls, config):
    if config.n_layers != 1:
      raise ValueError(
          f"model.stack='universal' applies one weight-shared layer: set model.n_layers=1 "
          f"(got {config.n_layers}); its depth is model.stack_options.steps, or "
          f"model.stack_options.max_steps with model.stack_options.act=True")
    period = stacks.layer_periods(config)[0]
    if period not in (1, None):
      raise ValueError(
          f"model.stack='universal': {config.attention[0]} attention alternates its pattern "
          f"with the layer index (period {period}), but the universal stack applies one layer "
          f"at every step, which would only ever use the first pattern. Use a factorization "
          f"that does not depend on the layer (model.attention_options."
          f"{config.attention[0]}.factorization='merged' or 'multihead'), or a layered stack")
    # Their types are checked where they are resolved (Option.check): the ranges here.
    for name in ('steps', 'max_steps'):
      value = config.stack_option(name)
      if value < 1:
        raise ValueError(f'model.stack_options.{name} must be an integer >= 1, got {value!r}')
    ponder = config.stack_option('ponder')
    if not ponder >= 0:
      raise ValueError(f'model.stack_options.ponder (the ponder cost weight τ) must be >= 0, '
                       f'got {ponder!r}')

  @classmethod
  def apply(cls, config, x, ctx):
    return UniversalLoop(config, name='universal')(x, ctx)

  @classmethod
  def applications(cls, config, metrics=None) -> float:
    """Layer applications per token: T, or with ACT the mean N of `metrics` (the logged
    'act_steps/universal') when given, else the cap M."""
    if not config.stack_option('act'):
      return float(config.stack_option('steps'))
    if metrics and 'act_steps/universal' in metrics:
      return float(metrics['act_steps/universal'])
    return float(config.stack_option('max_steps'))

  @classmethod
  def extra_matmul_weights(cls, config) -> int:
    return config.d_model if config.stack_option('act') else 0  # The halting unit, per step.

  @classmethod
  def sown_layers(cls, config, tree):
    """The layer's sown tree per step (each step as a layer, for the variants' figures)."""
    block = cls.layer_tree(config, tree, 0)
    leaves = jax.tree.leaves(block)
    steps = leaves[0].shape[0] if leaves else 0
    return [jax.tree.map(lambda a, t=t: a[t], block) for t in range(steps)] or [block]

  @classmethod
  def inspect(cls, config, sown, batch, source):
    """With ACT: the steps N per position (see training/attention_maps.py)."""
    got = sown.get('universal', {})
    if 'act_steps' not in got:
      return []
    steps = np.asarray(got['act_steps'][0])
    real = np.asarray(batch['segment_ids']) > 0
    scored = real & (np.asarray(batch['weights']) > 0)
    m = config.stack_option('max_steps')
    ks = np.arange(1, m + 1)
    hist = lambda mask: [float(np.mean(steps[mask] == k)) if mask.any() else 0.0 for k in ks]
    by_position = [float(steps[:, i][real[:, i]].mean()) if real[:, i].any() else 0.0
                   for i in range(steps.shape[1])]
    report = {
        'mean_steps': float(steps[real].mean()),
        'mean_steps_scored': float(steps[scored].mean()) if scored.any() else None,
        'mean_steps_context': float(steps[real & ~scored].mean()) if (real & ~scored).any()
                              else None,
        'max_steps': m,
        'fraction_by_steps_scored': hist(scored),
        'fraction_by_steps_context': hist(real & ~scored),
        'mean_steps_by_position': by_position,
    }
    panels = {
        'mean steps by position': {'x': np.arange(len(by_position)), 'y': by_position,
                                   'xlabel': 'position', 'ylabel': 'mean steps N'},
        'scored tokens': {'x': ks, 'y': report['fraction_by_steps_scored'],
                          'xlabel': 'steps N', 'ylabel': 'fraction of tokens'},
        'context tokens': {'x': ks, 'y': report['fraction_by_steps_context'],
                           'xlabel': 'steps N', 'ylabel': 'fraction of tokens'},
    }
    return [traits.Figure(
        name='act_steps', file='act_steps', kind='bars', panels=panels,
        title=f'ACT steps per token (M={m}; {source})',
        arrays={'act_steps': steps, 'act_remainder': np.asarray(got['act_remainder'][0])},
        report=report,
        summary=f"mean steps {report['mean_steps']:.2f} of at most {m} ({source})")]

  @classmethod
  def layer_tree(cls, config, tree, i):
    if i:
      raise IndexError(f'the universal stack has one layer, not layer {i}')
    return tree.get('universal', {}).get('step', {}).get('block', {})

  @classmethod
  def stacked_tree(cls, config, per_layer):
    (block,) = per_layer
    return {'universal': {'step': {'block': block}}}

  @classmethod
  def cycle(cls, config):
    raise NotImplementedError('the universal stack applies one layer for several steps; it '
                              'has no cycle of distinct layers (models/reversible.py)')
