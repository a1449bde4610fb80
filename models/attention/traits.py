"""What an attention variant may declare besides its math, all of it optional.

A variant's module (base.MultiHeadAttention) is its math: OPTIONS, `head_pattern` or
`attend`, `decode_step`, `memory_spec` and `features`. Everything the rest of the zoo needs to
know about a variant without running it is a `Traits` subclass declared beside it:

    @register('my_variant')
    class MyVariantAttention(base.MultiHeadAttention): ...

    @traits.declare('my_variant')
    class MyVariantTraits(traits.Traits):
      RELATIVE_POSITIONS = True
      @classmethod
      def param_bounds(cls, options): return {'my_param': (0.0, 1.0)}

and read through one registry, `of(name)` (models.attention.traits.of(name)): the option checks
and the layer period at config time, the implementation a layer runs, what training does
between steps (`specialize`, `param_bounds`, `rng_streams`, `shared_params`), what evaluation
changes (`eval_options`), the figures `--mode=inspect` draws, and the small model the contract
tests build (`TEST_CONFIG`). A variant that declares none gets the defaults below, which read
nothing but its module (`module`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from models.attention import base, dispatch, registry

Dtype = Any


@dataclasses.dataclass(frozen=True)
class SharedParam:
  """A parameter every layer of a variant reads (one copy for the whole stack): the Decoder
  creates it under `<variant>_shared/<name>` and hands it to each layer (`shared`).

  Attributes:
    shape: its shape.
    init: a flax initializer, init(key, shape, dtype).
    axes: logical axis names, one per dimension.
  """
  shape: tuple
  init: Any
  axes: tuple


@dataclasses.dataclass(frozen=True)
class Figure:
  """A plot `--mode=inspect` draws from what a variant sows (training/attention_maps.py renders it).

  Attributes:
    name: key of the paths inspect returns (NAME_png, NAME_npz, NAME_json).
    file: file stem under WORKDIR/inspect/.
    kind: 'matrices' (one heatmap per panel, NaN left blank, greener = lower), 'head_bars'
      (panels['values'], (layers, heads), one bar per head grouped by layer, log scale) or
      'bars' (one bar chart per panel: {'x': ..., 'y': ..., 'xlabel': ..., 'ylabel': ...}).
    panels: what is plotted, by panel title.
    title: the figure's title.
    arrays: saved to FILE.npz (nothing when empty).
    report: saved to FILE.json (nothing when None).
    summary: the log line.
    y_max: top of a 'head_bars' axis.
    y_label: its label.
  """
  name: str
  file: str
  kind: str
  panels: dict
  title: str
  arrays: dict = dataclasses.field(default_factory=dict)
  report: dict | None = None
  summary: str = ''
  y_max: float = 1.0
  y_label: str = ''


class Traits:
  """A variant's optional declarations; each classmethod's default serves a variant that
  declares nothing. Methods that take `options` get the variant's own declared options
  (config.model.attention_options.<variant>, defaults filled in, each of its declared type).

  Attributes:
    module: the variant's module class (set by `declare`, or by `of` for the defaults).
    TEST_CONFIG: a small model of this variant for the tests that cover every registered
      variant (tests/contracts/, tests/models/test_generate.py): model config overrides for
      d_model 32, 4 heads, 2 layers and sequences of 24 tokens; 'attention_options' there
      holds the variant's own options ({name: value}). A new variant is covered by them
      without a line of test code.
    RELATIVE_POSITIONS: True for a variant that encodes positions itself, relative to each
      query, and is meant to run without absolute position embeddings
      (model.position_embedding='none').
    DENSE: True for a variant whose every head of every layer is dense causal attention
      (cuDNN's flash kernel can then compute it: dispatch.choose).
  """
  module: ClassVar[type] = base.MultiHeadAttention
  TEST_CONFIG: ClassVar[dict[str, Any]] = {}
  RELATIVE_POSITIONS: ClassVar[bool] = False
  DENSE: ClassVar[bool] = False

  # ------------------------------------------------------------ config time

  @classmethod
  def validate(cls, options: dict, n_heads: int, n_layers: int) -> None:
    """Raises ValueError for hyper-parameters the variant cannot use (before any compute)."""
    del options, n_heads, n_layers

  @classmethod
  def uses_memory(cls, options: dict) -> bool:
    """True if the variant keeps previous-segment state in the 'memory' collection (its
    module's `memory_spec` then returns one)."""
    del options
    return False

  @classmethod
  def layer_period(cls, options: dict, n_layers: int) -> int | None:
    """How the module depends on `layer_index`: 1, not at all (the default); p, only through
    layer_index mod p; None, every layer is its own (static per-layer settings)."""
    del options, n_layers
    return 1

  @classmethod
  def row_period(cls, options: dict) -> int | None:
    """p if the pattern's blocks are anchored to multiples of p in the row (packed documents
    should then start on them: data.pack_align); None (the default) if it depends only on
    i - j."""
    del options

  @classmethod
  def implementation(cls, impl: str, *, options: dict, head_dim: int, backend: str,
                     dtype: Dtype = jnp.float32, block_size: int = 128, devices: int = 1,
                     layer_index: int | None = None) -> str:
    """What the variant's layers run for model.attention_impl=`impl` on the target: 'auto'
    resolved, an explicit name checked (a ValueError says what to use where it cannot run).

    This default serves every variant (dispatch.choose decides); those with a path of their
    own override it (`own_path_implementation`).

    Args:
      impl: one of base.IMPLEMENTATIONS.
      options: the variant's resolved options.
      head_dim: width of each head.
      backend: the platform the program is compiled for (TransformerConfig.target): 'cpu',
        'gpu' or 'tpu'.
      dtype: computation dtype.
      block_size: config.model.attention_block_size.
      devices: the target's device count.
      layer_index: the layer whose implementation this is (None: the variant's as a whole);
        a layer whose every head is dense causal attention can run dense's kernel
        (`dense_layer`).

    Returns:
      A name of base.IMPLEMENTATIONS other than 'auto'.
    """
    base.check_known(impl)
    return dispatch.choose(impl, variant=cls.module.__name__, static=cls.has_static_pattern(),
                           dense=cls.dense_layer(options, layer_index), head_dim=head_dim,
                           platform=backend, devices=devices, dtype=dtype,
                           block_size=block_size)

  @classmethod
  def dense_layer(cls, options: dict, layer_index: int | None) -> bool:
    """True where every head of layer `layer_index` (None: of every layer) is dense causal
    attention, so that cuDNN's flash kernel can compute it (dispatch.choose). A variant
    whose pattern differs by layer (local_global) overrides it."""
    del options, layer_index
    return cls.DENSE

  # ------------------------------------------------------------ training and evaluation

  @classmethod
  def specialize(cls, config, layer_params) -> dict | None:
    """Option values that follow the parameters and are static in the compiled step (the
    training loop recompiles when they change), or None (the default).

    Args:
      config: the model's TransformerConfig.
      layer_params: i -> layer i's parameters (host or device arrays).

    Returns:
      {option name: value} of the variant's own options to set, or None.
    """
    del config, layer_params

  @classmethod
  def param_bounds(cls, options: dict) -> dict[str, tuple[float, float]]:
    """{parameter name: (lo, hi)}: parameters the optimizer keeps in a box after every
    update (none by default)."""
    del options
    return {}

  @classmethod
  def rng_streams(cls, options: dict) -> tuple[str, ...]:
    """Random streams the variant draws from in training besides 'dropout' (e.g. LSH's
    random rotations); the train step provides a key for each."""
    del options
    return ()

  @classmethod
  def shared_params(cls, options: dict, num_heads: int, head_dim: int) -> dict[str, SharedParam]:
    """Parameters one copy of which serves every layer of the variant (e.g. Transformer-XL's
    u and v), by name; none by default. A layer reads them from its module's `shared`."""
    del options, num_heads, head_dim
    return {}

  @classmethod
  def eval_options(cls, options: dict) -> dict:
    """Option values that evaluation uses instead of training's (e.g. Transformer-XL's
    longer eval memory); none by default. The eval step compiles a model with them."""
    del options
    return {}

  @classmethod
  def inspect(cls, config, layers: list[dict], batch: dict, source: str) -> list[Figure]:
    """Figures of what the variant sows into 'intermediates' (none by default).

    Args:
      config: the model's TransformerConfig.
      layers: layer i's sown attention intermediates on `batch` (host arrays, as sown:
        tuples), {} where nothing is sown (e.g. layers of another variant).
      batch: the first validation batch (host arrays: inputs, positions, segment_ids, ...).
      source: where the parameters came from (e.g. 'checkpoint step 400'), for titles.
    """
    del config, layers, batch, source
    return []

  # ------------------------------------------------------------ derived (not declared)

  @classmethod
  def draws(cls) -> bool:
    """Whether the variant declares figures (`inspect`)."""
    return cls.inspect.__func__ is not Traits.inspect.__func__

  @classmethod
  def has_static_pattern(cls) -> bool:
    """Whether the module's connectivity is a static pattern the shared kernels compute."""
    return base.has_static_pattern(cls.module)

  @classmethod
  def can_prefill(cls) -> bool:
    """Whether the module fills its decoding cache from a prompt's forward."""
    return base.can_prefill(cls.module)

  @classmethod
  def own_path_implementation(cls, impl: str, *, refused: tuple[str, ...], why: str,
                              engine: bool = True, backend: str = 'cpu', **kwargs) -> str:
    """`implementation` for a variant that computes its scores on a path of its own (no
    static pattern, so no kernel): a name in `refused` raises ValueError('{why}:
    attention_impl=... cannot run it; use ...'); 'xla' keeps its all-keys path; 'pallas' runs
    the variant's score on the fused Pallas kernel where its path is the blocked engine's
    (`engine`), else its own path, and so does 'auto' on TPU (dispatch.learned); every other
    name runs the variant's blocked path, reported as 'blocksparse'."""
    base.check_known(impl)
    if impl in refused:
      raise ValueError(f"{why}: attention_impl={impl!r} cannot run it; use 'auto' (blocked), "
                       "'blocksparse', 'pallas' or 'xla'")
    if impl == 'auto' and engine:
      impl = dispatch.learned(backend)
    if impl == 'pallas' and engine:
      dispatch.check_pallas(cls.module.__name__, backend, kwargs.get('head_dim'))
      return 'pallas'
    return impl if impl == 'xla' else 'blocksparse'


_DECLARED: dict[str, type[Traits]] = {}
_DEFAULTS: dict[str, type[Traits]] = {}


def declare(name: str):
  """Class decorator: `cls` (a Traits subclass) is what the registered variant `name`
  declares; register the module first."""
  def wrap(cls: type[Traits]) -> type[Traits]:
    if not issubclass(cls, Traits):
      raise TypeError(f'{cls.__name__} must subclass traits.Traits')
    if name in _DECLARED and _DECLARED[name] is not cls:
      raise ValueError(f'attention variant {name!r} already declares {_DECLARED[name].__name__}')
    cls.module = registry.get(name)
    _DECLARED[name] = cls
    return cls
  return wrap


def _hooks() -> set[str]:
  """The names a Traits subclass may declare."""
  return {n for n in vars(Traits) if not n.startswith('_') and n != 'module'}


def _check_module(name: str, module: type) -> None:
  """A declaration written on the module class would be ignored: refuse it, saying where it
  goes."""
  misplaced = sorted(n for klass in module.__mro__ if klass is not base.MultiHeadAttention
                     and issubclass(klass, base.MultiHeadAttention)
                     for n in vars(klass) if n in _hooks())
  if misplaced:
    raise TypeError(f'attention variant {name!r} ({module.__name__}) defines '
                    f'{", ".join(misplaced)} on its module: declare them in a traits.Traits '
                    f"subclass beside it, @traits.declare({name!r}) (docs/adding_a_variant.md)")


def of(name: str) -> type[Traits]:
  """What variant `name` declares (raises ValueError for an unknown name); the defaults for
  a variant that declares nothing.

  Raises:
    TypeError: the variant's module class defines a name of Traits (it would be ignored).
  """
  module = registry.get(name)
  _check_module(name, module)
  if name in _DECLARED:
    return _DECLARED[name]
  if name not in _DEFAULTS or _DEFAULTS[name].module is not module:
    _DEFAULTS[name] = type(f'{module.__name__}Traits', (Traits,), {'module': module})
  return _DEFAULTS[name]


def _resolve_auto(module) -> str:
  """impl='auto' of an attention module built directly (base.MultiHeadAttention): what the
  Decoder would give its registered variant; 'xla' for a class no name registers."""
  name = next((n for n, cls in registry.VARIANTS.items() if cls is type(module)), None)
  if name is None:
    return 'xla'
  options = registry.resolve_options({name: dict(module.options)}, [name])[name]
  return of(name).implementation(
      'auto', options=options, head_dim=module.head_dim, backend=module.target_platform(),
      dtype=module.dtype, block_size=module.block_size, devices=jax.device_count(),
      layer_index=module.layer_index)


base.RESOLVE_AUTO = _resolve_auto
