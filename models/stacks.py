"""How layers are applied (`model.stack`): a registry, one entry per way of stacking.

  unrolled    n_layers distinct blocks in Python: parameters 'block_{i}'; any mix of variants.
  scan        one block scanned n_layers times (nn.scan): parameters 'blocks' with a leading
              layer axis; needs identical layers that ignore their index.
  scan_cycle  a repeating cycle of p layers scanned n_layers / p times (as MaxText scans
              Gemma 3's local/global pattern): parameters 'cycle/layer_{k}' with a leading
              repeat axis; p is the least common multiple of each layer's period (below) and
              of the period of the list of variant names.
  auto        scan where it applies, else unrolled (the default; what `scan_layers` did).

A variant's period (Traits.layer_period) says how its module depends on the layer
index: 1, not at all; p, only through index mod p (strided's interleaved A1/A2: 2); None,
every layer is its own (per-layer trimmed spans or budgets), so only `unrolled` applies.
A stack gives each layer the index it may read: i unrolled, k (the place in the cycle)
under scan_cycle, 0 under scan.

The stack owns the layer naming: `layer_tree(config, tree, i)` is layer i's part of any tree
laid out like the parameters (params, or a sown or persistent collection), and
`stacked_tree(config, per_layer)` builds such a tree from one entry per layer. For code that
applies the layers itself (models/reversible.py), `cycle(config)` gives the layers as repeats
of a cycle, and `cycle_tree` / `from_cycle_trees` the trees per place of the cycle with the
repeats on a leading axis, without slicing a scanned stack's arrays.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from models import attention, layers, residual
from models.registry import Registry

STACKS = Registry('stack', 'model.stack_options')
register = STACKS.register
known = STACKS.known
get = STACKS.get

REMAT_POLICIES = ('none', 'full', 'dots_saveable', 'dots_with_no_batch_dims_saveable')


def remat(cls, policy: str, scanned: bool):
  """`cls` under nn.remat with the named jax.checkpoint policy ('none': unchanged)."""
  if policy == 'none':
    return cls
  jax_policy = None if policy == 'full' else getattr(jax.checkpoint_policies, policy)
  return nn.remat(cls, policy=jax_policy, prevent_cse=not scanned)


def _scan(body, length: int):
  """nn.scan of `body` over `length` steps: every collection and rng stream gets a leading
  axis (parameters, sown losses and statistics, caches, segment memory)."""
  return nn.scan(body, variable_axes={True: 0}, split_rngs={True: True},
                 in_axes=(nn.broadcast,), length=length,
                 metadata_params={nn.PARTITION_NAME: 'layers'})


def layer_periods(config) -> list[int | None]:
  """Each layer's period (Traits.layer_period) under `config`."""
  return [attention.traits.of(name).layer_period(config.options_of(name), config.n_layers)
          for name in config.attention]


def cycle_length(config) -> int | None:
  """p for scan_cycle: the smallest cycle that repeats the layers exactly; None if some
  layer has no period."""
  periods = layer_periods(config)
  if any(p is None for p in periods):
    return None
  names = config.attention
  name_period = next(q for q in range(1, len(names) + 1)
                     if len(names) % q == 0 and all(names[i] == names[i % q]
                                                    for i in range(len(names))))
  return math.lcm(name_period, *periods)


class Stack:
  """A way of applying the layers; subclasses are registered under their config name."""

  # Whether models/reversible.py can train this stack's reversible layers (it replays the
  # layers through `cycle`); a stack without it runs reversible layers as plain modules.
  REVERSIBLE_TRAINING = True
  # The stack's own hyper-parameters, config.model.stack_options.<name>: name -> Option
  # (models/options.py), each with its default, doc and change kind. Options of all stacks
  # share that one group (the registry refuses a name two stacks declare separately); `check`
  # validates their values.
  OPTIONS = {}
  # config.model keys the contract suite's small models need to run this stack
  # (tests/contracts/cases.py), like Traits.TEST_CONFIG.
  TEST_CONFIG = {}

  @classmethod
  def check(cls, config) -> None:
    """Raises ValueError if this stack cannot run `config` (at config time)."""
    del config

  @classmethod
  def apply(cls, config, x, ctx: residual.LayerContext):
    """Applies the layers to x; runs inside the Decoder's compact __call__, so the modules it
    creates are the Decoder's children."""
    raise NotImplementedError

  @classmethod
  def applications(cls, config, metrics=None) -> float:
    """Layer applications per token, for the FLOPs count: n_layers. A stack whose depth is
    decided at run time reads it from `metrics` (the logged training metrics) when given."""
    del metrics
    return float(config.n_layers)

  @classmethod
  def extra_matmul_weights(cls, config) -> int:
    """Matmul weights per application beyond the layer's (the stack's own), for the FLOPs
    count."""
    del config
    return 0

  @classmethod
  def sown_layers(cls, config, tree) -> list:
    """One subtree per layer of a sown tree ('intermediates'), for the variants' inspect
    figures: layer_tree of each layer."""
    return [cls.layer_tree(config, tree, i) for i in range(config.n_layers)]

  @classmethod
  def inspect(cls, config, sown, batch: dict, source: str) -> list:
    """Figures (models/attention/base.py Figure) of what the stack itself sows into
    'intermediates' (`sown`, the whole tree, host arrays) on `batch`; none by default."""
    del config, sown, batch, source
    return []

  @classmethod
  def layer_tree(cls, config, tree, i: int):
    """Layer i's part of a tree laid out like the parameters ({} where it has none)."""
    raise NotImplementedError

  @classmethod
  def stacked_tree(cls, config, per_layer: list):
    """The tree laid out like the parameters from one subtree per layer (identical structure
    where layers are stacked)."""
    raise NotImplementedError

  @classmethod
  def cycle(cls, config) -> tuple[int, int]:
    """(repeats, p): the layers as `repeats` applications of a cycle of p layers; layer
    i = r p + k is place k of repeat r, and its layer gets layer_index k and
    config.attention[k]."""
    raise NotImplementedError

  @classmethod
  def cycle_tree(cls, config, tree, k: int):
    """Place k's part of a tree laid out like the parameters, every repeat on a leading axis
    ({} where it has none)."""
    raise NotImplementedError

  @classmethod
  def from_cycle_trees(cls, config, per_place: list):
    """The tree laid out like the parameters from one subtree per place of the cycle (each
    with the repeats on a leading axis); empty subtrees are left out."""
    raise NotImplementedError


def _layer(config):
  return residual.get(config.residual)


@register('unrolled')
class Unrolled(Stack):
  """block_0 .. block_{L-1}, each its own module and variant."""

  @classmethod
  def apply(cls, config, x, ctx):
    layer = remat(_layer(config), config.remat, scanned=False)
    for i, name in enumerate(config.attention):
      x = layer(config, name, layer_index=i, name=f'block_{i}')(x, ctx)
    return x

  @classmethod
  def layer_tree(cls, config, tree, i):
    return tree.get(f'block_{i}', {})

  @classmethod
  def stacked_tree(cls, config, per_layer):
    return {f'block_{i}': sub for i, sub in enumerate(per_layer) if sub is not None}

  @classmethod
  def cycle(cls, config):
    return 1, config.n_layers

  @classmethod
  def cycle_tree(cls, config, tree, k):
    return jax.tree.map(lambda a: a[None], tree.get(f'block_{k}', {}))

  @classmethod
  def from_cycle_trees(cls, config, per_place):
    return {f'block_{k}': _index(sub, 0) for k, sub in enumerate(per_place) if sub}


def carry_only(layer_cls):
  """`layer_cls` with the (carry, output) signature nn.scan needs: (x, ctx) -> (x, None)."""

  class Scanned(layer_cls):
    def __call__(self, x, ctx):
      return super().__call__(x, ctx), None

  Scanned.__name__ = f'Scanned{layer_cls.__name__}'
  return Scanned


def _index(tree, index):
  return jax.tree.map(lambda a: a[index], tree)


def _stack(trees):
  return jax.tree.map(lambda *a: jnp.stack(a), *trees)


@register('scan')
class Scan(Stack):
  """One block scanned over the layers: 'blocks' holds every layer on a leading axis."""

  @classmethod
  def check(cls, config):
    if len(set(config.attention)) != 1:
      raise ValueError(f"model.stack='scan' needs the same variant in every layer, got "
                       f"{config.attention}: use 'scan_cycle' or 'unrolled'")
    period = layer_periods(config)[0]
    if period != 1:
      raise ValueError(f"model.stack='scan': {config.attention[0]} attention depends on its "
                       f"layer index (period {period}) under these options: use "
                       f"{'scan_cycle' if period else 'unrolled'}")

  @classmethod
  def apply(cls, config, x, ctx):
    body = remat(carry_only(_layer(config)), config.remat, scanned=True)
    with layers.scanned_layers():
      x, _ = _scan(body, config.n_layers)(
          config, config.attention[0], name='blocks')(x, ctx)
    return x

  @classmethod
  def layer_tree(cls, config, tree, i):
    return _index(tree['blocks'], i) if 'blocks' in tree else {}

  @classmethod
  def stacked_tree(cls, config, per_layer):
    return {'blocks': _stack(per_layer)}

  @classmethod
  def cycle(cls, config):
    return config.n_layers, 1

  @classmethod
  def cycle_tree(cls, config, tree, k):
    return tree.get('blocks', {})

  @classmethod
  def from_cycle_trees(cls, config, per_place):
    return {'blocks': per_place[0]} if per_place[0] else {}


class _Cycle(nn.Module):
  """The p layers of one cycle, applied in order; (carry, None) for nn.scan."""
  config: object
  names: tuple[str, ...]

  @nn.compact
  def __call__(self, x, ctx):
    layer = remat(_layer(self.config), self.config.remat, scanned=True)
    for k, name in enumerate(self.names):
      x = layer(self.config, name, layer_index=k, name=f'layer_{k}')(x, ctx)
    return x, None


@register('scan_cycle')
class ScanCycle(Stack):
  """A cycle of p layers scanned n_layers / p times: one cycle is compiled."""

  @classmethod
  def check(cls, config):
    periods = layer_periods(config)
    if None in periods:
      name = config.attention[periods.index(None)]
      raise ValueError(f"model.stack='scan_cycle': {name} attention gives every layer its own "
                       f"static setting under these options; use model.stack='unrolled'")
    p = cycle_length(config)
    if config.n_layers % p:
      raise ValueError(f"model.stack='scan_cycle': the layers repeat every {p} layers, which "
                       f"does not divide model.n_layers={config.n_layers}")

  @classmethod
  def apply(cls, config, x, ctx):
    p = cycle_length(config)
    with layers.scanned_layers():
      x, _ = _scan(_Cycle, config.n_layers // p)(
          config, tuple(config.attention[:p]), name='cycle')(x, ctx)
    return x

  @classmethod
  def layer_tree(cls, config, tree, i):
    repeat, k = divmod(i, cycle_length(config))
    return _index(tree['cycle'][f'layer_{k}'], repeat) if 'cycle' in tree else {}

  @classmethod
  def stacked_tree(cls, config, per_layer):
    p = cycle_length(config)
    return {'cycle': {f'layer_{k}': _stack(per_layer[k::p]) for k in range(p)}}

  @classmethod
  def cycle(cls, config):
    p = cycle_length(config)
    return config.n_layers // p, p

  @classmethod
  def cycle_tree(cls, config, tree, k):
    return tree.get('cycle', {}).get(f'layer_{k}', {})

  @classmethod
  def from_cycle_trees(cls, config, per_place):
    places = {f'layer_{k}': sub for k, sub in enumerate(per_place) if sub}
    return {'cycle': places} if places else {}


def resolve(config) -> str:
  """The stack `config` runs: model.stack, with 'auto' resolved (scan if it applies)."""
  if config.stack != 'auto':
    return config.stack
  try:
    Scan.check(config)
  except ValueError:
    return 'unrolled'
  return 'scan'


def of(config) -> type[Stack]:
  """The Stack class `config` runs."""
  return get(resolve(config))
