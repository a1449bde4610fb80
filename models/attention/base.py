"""Shared multi-head attention: the one call path of every variant, which overrides `attend`."""

from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from models import layers
from models import options as options_lib
from models.attention import (blockloop, blocksparse, cpu_kernel, decoding, dispatch, memory,
                              patterns, splash)
# The shared math, under the names the variants use (base.reference_attention, ...).
from models.attention.reference import (NEG_INF, causal_segment_mask,  # noqa: F401
                                        masked_softmax, reference_attention)

Dtype = Any

# How a variant's scores are computed: 'auto' picks per backend and variant
# (Traits.implementation); 'xla' is the plain einsum reference that every fast
# path is tested against; 'blocksparse' computes only the key blocks a query block can see
# (plain JAX, any backend); 'cpu_kernel' is the fused C++ tile kernel of cpu_kernel.py (one
# CPU device, static patterns); 'fused' is jax.nn.dot_product_attention (XLA's own einsum);
# 'cudnn' forces the cuDNN flash kernel on NVIDIA GPUs; 'splash' is the Pallas TPU kernel
# (interpret mode elsewhere, for tests); 'pallas' is the project's own fused Pallas kernel with
# the variant's score hook (pallas_kernel.py): every variant on the blocked engine and every
# static pattern, compiled by Mosaic for a TPU, in interpret mode for a CPU.
IMPLEMENTATIONS = ('auto', 'xla', 'blocksparse', 'cpu_kernel', 'fused', 'cudnn', 'splash',
                   'pallas')

# `cache` value of MultiHeadAttention.__call__ (and Decoder's `decode`) for a prompt's forward
# that fills the decoding caches.
PREFILL = 'prefill'

# A decoding step's attention over its cache's live slots (models/attention/decoding.py), under
# the names the variants use (base.over_live_slots, base.LIVE_CHUNK).
LIVE_CHUNK = decoding.LIVE_CHUNK
over_live_slots = decoding.over_live_slots


def check_known(impl: str) -> None:
  """Raises ValueError unless `impl` is one of IMPLEMENTATIONS."""
  if impl not in IMPLEMENTATIONS:
    raise ValueError(f'unknown model.attention_impl {impl!r}; known: '
                     f'{", ".join(IMPLEMENTATIONS)}')


def constrain_heads(a):
  """Logical sharding of (batch, length, heads, head_dim) activations."""
  return nn.with_logical_constraint(a, ('batch', 'length', 'heads', 'kv'))


# impl='auto' of a module built directly -> its implementation (set by traits.py).
RESOLVE_AUTO = None

# Option, its Range and CHANGES live in models/options.py (blocks and stacks declare options
# too); the variants use them under these names (base.Option, base.Range).
Option = options_lib.Option
Range, INTEGER, REAL = options_lib.Range, options_lib.INTEGER, options_lib.REAL
CHANGES = options_lib.CHANGES


# What a variant writes, the whole protocol (docs/adding_a_variant.md): its options, how it
# attends (a static pattern or its own attend), how it decodes one step (nothing with a
# pattern), its segment memory and what it computes from x. Each has a working default but
# one of head_pattern / attend.
PROTOCOL = ('OPTIONS', 'head_pattern', 'attend', 'decode_step', 'memory_spec', 'features')
# Methods a variant may also override where its math asks for it, each with a working default:
# the q/k/v projection (LSH's shared QK), filling its own decode_step's cache from a prompt in
# one pass, and a pattern's disjoint parts for the block-sparse path.
OVERRIDABLE = ('project', 'prefill_cache', 'parts')


def has_static_pattern(module: type) -> bool:
  """True for a variant module whose connectivity is a static pattern computed by the shared
  kernels: it overrides `head_pattern` and leaves `attend` to MultiHeadAttention (a variant
  that overrides both computes its pattern itself, and no kernel is claimed for it)."""
  return (module.head_pattern is not MultiHeadAttention.head_pattern
          and module.attend is MultiHeadAttention.attend)


def can_prefill(module: type) -> bool:
  """Whether `prefill_cache` can fill the variant module's decoding cache from a prompt's
  forward: the default does for the static-pattern decode_step; a variant with its own
  decode_step says so by overriding prefill_cache."""
  own_decode = module.decode_step is not MultiHeadAttention.decode_step
  own_prefill = module.prefill_cache is not MultiHeadAttention.prefill_cache
  return own_prefill or not own_decode


class MultiHeadAttention(nn.Module):
  """Projections, QK-norm, head split/merge and output projection shared by all variants.

  A variant subclasses it and writes its math, the whole protocol (docs/adding_a_variant.md):
  `OPTIONS`; how it attends, a static `head_pattern` (kernels, decoding and plots then come
  for free) or its own `attend`; `decode_step` (not needed with a pattern); `memory_spec`
  (segment memory; none by default); `features` (what it computes from x; none by default).
  `attend` runs inside the compact `__call__`: it may create parameters, `self.sow('losses',
  ...)` auxiliary losses and `self.sow('intermediates', ...)` statistics. Everything else
  about a variant (option checks, layer period, implementation, training hooks, inspect
  figures, test sizes) is optional and declared beside it (models/attention/traits.py).

  Attributes:
    num_heads: number of attention heads.
    head_dim: width of each head.
    qk_norm: RMS-normalize queries and keys per head (Dehghani et al., 2023).
    impl: one of IMPLEMENTATIONS; 'auto' (the default, as model.attention_impl's) is resolved
      when the module is built, as the Decoder resolves model.attention_impl.
    block_size: query/key block length of the 'blocksparse' implementation.
    layer_index: the index the stack gives this layer; a variant may read it only as its
      traits declare (`layer_period`, models/stacks.py).
    max_len: longest sequence (the position table); sizes decoding caches.
    num_layers: layers of the decoder (selective attention's L_mem divides by it).
    options: the variant's own hyper-parameters as sorted (name, value) pairs (config.model.
      attention_options.<variant>); read them with `option(name)`.
    shared: {name: array} of the parameters the variant shares across layers
      (its traits' `shared_params`), created by the Decoder; None for variants without.
    platform: the platform the program is compiled for (TransformerConfig.target); '' =
      this process's jax.default_backend().
    dtype: computation dtype.
    param_dtype: parameter dtype.
  """
  num_heads: int
  head_dim: int
  qk_norm: bool = True
  impl: str = 'auto'
  block_size: int = 128
  layer_index: int = 0
  max_len: int = 0
  num_layers: int = 1
  options: tuple = ()
  shared: Any = None
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32
  platform: str = ''

  # The variant's own hyper-parameters (name -> Option); subclasses inherit their parents'.
  OPTIONS: ClassVar[dict[str, Option]] = {}

  def __post_init__(self):
    # An option the variant does not declare (a misspelt or old flat name: span_limit for
    # adaptive_span's limit) would otherwise leave the default in force without a word.
    declared = options_lib.declared(type(self))
    unknown = sorted(k for k, _ in self.options if k not in declared)
    if unknown:
      raise ValueError(f'{type(self).__name__} has no option {", ".join(map(repr, unknown))}; '
                       f'its options: {", ".join(sorted(declared)) or "none"}')
    if self.impl == 'auto':  # Built directly (a script): resolved as the Decoder resolves it.
      object.__setattr__(self, 'impl', self._resolved_auto())
    super().__post_init__()

  def _resolved_auto(self) -> str:
    """What impl='auto' runs for this module on its platform, as models/residual.py resolves
    model.attention_impl (traits.py installs RESOLVE_AUTO; it imports this module)."""
    return RESOLVE_AUTO(self) if RESOLVE_AUTO is not None else 'xla'

  def option(self, name: str):
    """The variant's hyper-parameter `name` (config.model.attention_options.<variant>.<name>;
    its declared default when the options leave it out)."""
    for key, value in self.options:
      if key == name:
        return value
    declared = options_lib.declared(type(self))
    if name not in declared:
      raise ValueError(f'{type(self).__name__} reads option {name!r}, which it does not '
                       f'declare in OPTIONS')
    return declared[name].default

  @nn.compact
  def __call__(self, x, *, positions, segment_ids, cache=None, deterministic=True):
    """Self-attention over x (and over the cached past, for variants with segment memory).

    The one path every variant runs: its `features` of x, the context (x, or the cached past
    inputs then x, `memory_spec`), queries from x and keys/values from the context (one fused
    projection), then `attend` (or `decode_step` when decoding) and the output projection.

    Args:
      x: (batch, length, d_model) inputs.
      positions: (batch, length) int positions within each document.
      segment_ids: (batch, length) int document ids (0 = padding).
      cache: True to decode one token with the mutable 'cache' collection (see
        `decode_step`); PREFILL for the forward of a prompt that also fills the (empty)
        caches as decoding its tokens one by one would (`prefill_cache`); None or False
        for a full-sequence forward.
      deterministic: disables dropout-like randomness when True.

    Returns:
      (batch, length, d_model) outputs.
    """
    if cache is not None and not isinstance(cache, bool) and cache != PREFILL:
      raise ValueError(f'cache must be None, False, True (decode with the mutable "cache" '
                       f'collection) or {PREFILL!r}, got {cache!r}')
    n = x.shape[1]
    extra = self.features(x, segment_ids)
    if cache is True:
      q, k, v = self.project(x)
      out = self.decode_step(q, k, v, positions=positions, extra=extra)
    elif cache == PREFILL:
      if not can_prefill(type(self)):
        raise NotImplementedError(f'{type(self).__name__} has no prefill_cache: decode its '
                                  'prompt token by token')
      q, k, v = self.project(x)
      out = self.attend(q, k, v, positions=positions, segment_ids=segment_ids,
                        deterministic=deterministic, extra=extra)
      self.prefill_cache(k, v, extra=extra)
    else:
      context, key_segment_ids = x, segment_ids
      spec = self.memory_spec()
      if spec is not None:
        context, key_segment_ids = memory.extend(self, x, segment_ids, spec)
      q, k, v = self.project(context)
      out = self.attend(q[:, context.shape[1] - n:], k, v, positions=positions,
                        segment_ids=segment_ids, key_segment_ids=key_segment_ids,
                        deterministic=deterministic, extra=extra)
    return self.project_out(out, x.shape[-1])

  def features(self, x, segment_ids):
    """What the variant computes from x besides q, k, v (e.g. per-token spans), handed to
    `attend` and `decode_step` as `extra`; it may create parameters. None by default."""
    del x, segment_ids

  def memory_spec(self) -> memory.Spec | None:
    """How many past inputs this layer keeps and attends into (models/attention/memory.py);
    None (the default) for no segment memory. Variants that return one also declare it in
    their traits (`uses_memory`, read before a module exists)."""
    return None

  def project(self, x):
    """Queries, keys and values of x: one fused matmul, then QK-norm.

    Called once from a variant's compact `__call__` (it creates the 'qkv' kernel and the
    norms).

    Args:
      x: (batch, length, d_model).

    Returns:
      q, k, v: (batch, length, heads, head_dim) each.
    """
    q, k, v = self.fused_projection(x, 'qkv', 3)
    if self.qk_norm:
      q, k = self.head_norm('q_norm')(q), self.head_norm('k_norm')(k)
    return constrain_heads(q), constrain_heads(k), constrain_heads(v)

  def fused_projection(self, x, name: str, parts: int):
    """`parts` projections of x (batch, length, d_model) to (batch, length, heads, head_dim),
    from one (d_model, parts, heads, head_dim) kernel called `name`."""
    d_model = x.shape[-1]
    w = self.param(name, nn.with_logical_partitioning(
        layers.default_kernel_init, ('embed', 'qkv', 'heads', 'kv')),
        (d_model, parts, self.num_heads, self.head_dim), self.param_dtype)
    x, w = x.astype(self.dtype), w.astype(self.dtype)
    if layers.decoding() or layers.scanned():
      # One matmul for all parts: decoding's few tokens (on the CPU decoding kernel,
      # layers.matmul), and the body of a loop over layers (the scanned stacks), where the
      # head-major form below costs more than it saves: XLA's TPU compile makes each part's
      # matmul a convolution that reads about 1 GB, and the Sparse Transformer recipe's step
      # (30 scanned layers) would go from 1.1 to 1.55 s by the compiled estimate.
      b, t = x.shape[:2]
      x2 = x.reshape(b * t, d_model)
      if layers.can_flatten('heads'):
        # A plain 2-D matmul (parameter reshapes are free): XLA then needs no transposed copies.
        y = layers.matmul(x2, w.reshape(d_model, -1))
      else:
        y = jnp.einsum('nd,dphk->nphk', x2, w)
      y = y.reshape(b, t, parts, self.num_heads, self.head_dim)
      return tuple(y[:, :, i] for i in range(parts))
    # One matmul per part, written head-major (batch, heads, length, head_dim) and viewed as
    # (batch, length, heads, head_dim). The attention kernels read and write head-major
    # arrays, so XLA makes no transposed copy between them and these matmuls, and no part's
    # gradient is padded to the whole fused output and summed with the others (autodiff's
    # transpose of a slice). On a TPU, by the compiled estimate, selective attention's C4
    # recipe (12 unrolled layers) goes from 271 to 230 ms a step; on a CPU the d=4 step is
    # the same.
    return tuple(jnp.swapaxes(jnp.einsum('btd,dhk->bhtk', x, w[:, i]), 1, 2)
                 for i in range(parts))

  def head_norm(self, name: str) -> nn.Module:
    """QK-norm: an RMSNorm over each head's features."""
    return layers.RMSNorm(dtype=self.dtype, param_dtype=self.param_dtype, axis_name='kv',
                          name=name)

  def project_out(self, out, d_model: int):
    """(batch, length, heads, head_dim) head outputs -> (batch, length, d_model)."""
    b, t = out.shape[:2]
    w_o = self.param('out', nn.with_logical_partitioning(
        layers.default_kernel_init, ('heads', 'kv', 'embed')),
        (self.num_heads, self.head_dim, d_model), self.param_dtype)
    return layers.matmul(out.astype(self.dtype).reshape(b * t, -1),
                         w_o.astype(self.dtype).reshape(-1, d_model)).reshape(b, t, -1)

  def head_pattern(self, head: int):
    """The static pattern of `head` (models/attention/patterns.py), or None for a variant
    whose connectivity is not a static pattern (the default). A variant that returns one
    needs no `attend`: models/attention/dispatch.py computes it on every kernel."""
    del head
    return None

  def parts(self, head: int) -> list[blocksparse.Part]:
    """Disjoint parts of the head's pattern for the block-sparse paths (default: one part)."""
    p = self.head_pattern(head)
    # Heads that see the same keys share one view (and one computation).
    return [blocksparse.Part(blocksparse.HeadView(p, patterns.head_group(p, head)))]

  def target_platform(self) -> str:
    """The platform the program is compiled for: `platform`, or this process's backend."""
    return self.platform or jax.default_backend()

  def devices_split(self) -> int:
    """The devices the mesh in force splits the batch and the heads over (1 outside a mesh):
    one device holds 1/that of the layer's rows and heads."""
    layout = splash.mesh_layout()
    if layout is None:
      return 1
    mesh, batch_axes, head_axes = layout
    return int(np.prod([mesh.shape[a] for a in batch_axes + head_axes]))

  def engine(self) -> dict:
    """blockloop.attention's `kernel` and `interpret` for this layer's blocked path: the fused
    Pallas kernel for attention_impl='pallas' (Mosaic's for a TPU target, interpret mode for a
    CPU target, Triton's for a GPU target: pallas_gpu.py), else the XLA engine."""
    if self.impl != 'pallas':
      return {}
    if self.target_platform() == 'gpu':
      return {'kernel': 'pallas_gpu'}
    return {'kernel': 'pallas', 'interpret': self.target_platform() == 'cpu'}

  def loop_block(self, n: int, *, prefix: bool = False) -> int:
    """The query block of this layer's blocked path over n queries (blockloop.query_block:
    block_size, larger on an accelerator, and on a CPU's long rows with `prefix`: a layer whose
    blocks read every earlier key in one pass, dense causal or selective attention)."""
    return blockloop.query_block(self.target_platform(), self.block_size, n, prefix=prefix)

  def kv_cache(self, q, k, v, capacity: int, position_shape: tuple[int, ...]):
    """The decoding cache of a layer: 'key' and 'value' (batch, heads, capacity, head_dim)
    (each head's slots contiguous: the score and value contractions read the cache in place),
    'position' (the position held by each slot, -1 when empty, laid out as
    `position_shape`) and 'index' (the next step). Returns the four variables, or None
    while the caches are being created (shapes only: the caller returns zeros). Decoding
    takes one token per call."""
    b, t, h, d = q.shape
    ck = self.variable('cache', 'key', jnp.zeros, (b, h, capacity, d), k.dtype)
    cv = self.variable('cache', 'value', jnp.zeros, (b, h, capacity, d), v.dtype)
    pos = self.variable('cache', 'position', lambda: jnp.full(position_shape, -1, jnp.int32))
    index = self.variable('cache', 'index', lambda: jnp.zeros((), jnp.int32))
    if self.is_initializing():
      return None
    if t != 1:
      raise ValueError(f'decoding takes one token per call, got {t}')
    return ck, cv, pos, index

  def decode_step(self, q, k, v, *, positions, extra=None):
    """One token of autoregressive decoding over the 'cache' collection.

    This default serves every variant with a static pattern (`head_pattern`); a variant
    without one implements its own (same signature) or cannot decode.

    The cache holds only the keys the pattern can still attend to: key j stays until the last
    query that may see it (patterns.cache_plan), so a sliding window keeps w entries and fixed
    attention its current block plus the summary cells. The cache is created by an init call
    with decoding on (its length is `max_len`); each later call takes one token per row, all
    rows at the same step, one document per row.

    Args:
      q, k, v: (batch, 1, heads, head_dim).
      positions: (batch, 1) the step's position.
      extra: the variant's `features` of the token.

    Returns:
      (batch, 1, heads, head_dim).
    """
    del positions, extra
    if self.head_pattern(0) is None:
      raise NotImplementedError(
          f'{type(self).__name__} cannot decode: it has no static pattern (head_pattern) and '
          'does not implement decode_step')
    b, t, h, d = q.shape
    n = self.max_len
    if n < 1:
      raise ValueError('decoding needs the attention module to know max_len')
    plans = [patterns.cache_plan(self.head_pattern(i), n, i) for i in range(h)]
    capacity = max(p[0] for p in plans)
    plan_slots = np.stack([p[1] for p in plans])  # (h, n)
    slot_of = jnp.asarray(plan_slots)
    cache = self.kv_cache(q, k, v, capacity, (capacity, h))
    if cache is None:
      return jnp.zeros_like(q)
    ck, cv, pos, index = cache
    step = index.value
    heads = jnp.arange(h)
    slots = slot_of[:, jnp.minimum(step, n - 1)]  # (h,)
    ck.value = ck.value.at[:, heads, slots].set(k[:, 0])
    cv.value = cv.value.at[:, heads, slots].set(v[:, 0])
    pos.value = pos.value.at[slots, heads].set(step)
    index.value = step + 1
    keys_pos = pos.value  # (capacity, h)
    allowed = jnp.stack([self.head_pattern(i).allowed(step, keys_pos[:, i], i) & (keys_pos[:, i] >= 0)
                         for i in range(h)], axis=0)  # (h, capacity)
    # Slots are used in the plans' order: after step s only the first used[s] can be live.
    used = np.maximum.accumulate(plan_slots.max(axis=0)) + 1  # (n,)

    def reference(q, keys, values, allowed, live):
      def scores(logits, start, size):
        return logits, jax.lax.dynamic_slice_in_dim(allowed, start, size, axis=1)[None]

      return over_live_slots(live, q, keys, values, scores, scale=d ** -0.5, dtype=self.dtype)

    live = jnp.asarray(used)[jnp.minimum(step, n - 1)]
    # On CPU, a kernel reads the cache in place (XLA copied the live slots first).
    out = cpu_kernel.decode_attention(q[:, 0], ck.value, cv.value, allowed, live,
                                      scale=d ** -0.5, reference=reference)
    return out[:, None].astype(self.dtype)

  def prefill_cache(self, k, v, *, extra=None):
    """Writes the empty decoding cache as `decode_step` would have left it after the p
    tokens whose keys and values are k, v (batch, p, heads, head_dim): every row's positions
    0..p-1 (one document per row, as in decoding); decoding continues at position p.

    The default serves the static-pattern decode_step: each slot of each head holds the
    latest of the p positions its cache plan puts there (patterns.cache_plan), read from k
    and v with one gather, instead of p one-token steps.
    """
    del extra
    b, p, h, d = k.shape
    n = self.max_len
    if p > n:
      raise ValueError(f'a prompt of {p} tokens exceeds max_len={n}')
    plans = [patterns.cache_plan(self.head_pattern(i), n, i) for i in range(h)]
    capacity = max(plan[0] for plan in plans)
    held = np.full((h, capacity), -1, np.int64)  # The position each slot holds after p steps.
    for i, (_, slot_of) in enumerate(plans):
      for position in range(p):  # In order: a later position overwrites an earlier one.
        held[i, slot_of[position]] = position
    self.fill_cache(k, v, held, (capacity, h), positions=held.T)

  def fill_cache(self, k, v, held, position_shape, *, positions):
    """Sets the 'cache' variables: slot c of head i holds position held[i, c] of k and v
    (numpy (heads, capacity), -1 = empty), 'position' = `positions` (laid out as
    position_shape), 'index' = k's length."""
    b, p, h, d = k.shape
    capacity = held.shape[1]
    ck = self.variable('cache', 'key', jnp.zeros, (b, h, capacity, d), k.dtype)
    cv = self.variable('cache', 'value', jnp.zeros, (b, h, capacity, d), v.dtype)
    pos = self.variable('cache', 'position', lambda: jnp.full(position_shape, -1, jnp.int32))
    index = self.variable('cache', 'index', lambda: jnp.zeros((), jnp.int32))
    heads = np.arange(h)[:, None]
    live = jnp.asarray(held >= 0)[None, :, :, None]
    take = np.maximum(held, 0)
    ck.value = jnp.where(live, k[:, take, heads], 0).astype(ck.value.dtype)
    cv.value = jnp.where(live, v[:, take, heads], 0).astype(cv.value.dtype)
    pos.value = jnp.asarray(positions, jnp.int32).reshape(position_shape)
    index.value = jnp.asarray(p, jnp.int32)

  def attend(self, q, k, v, *, positions, segment_ids, deterministic, key_segment_ids=None,
             extra=None):
    """Which keys each query sees and how scores are shaped: the variant's whole job.

    Args:
      q: (batch, length, heads, head_dim) queries after projection and QK-norm.
      k, v: (batch, m + length, heads, head_dim): m cached past positions (segment memory,
        m = 0 without), then the current ones.
      positions: (batch, length) int positions of the queries within each document.
      segment_ids: (batch, length) int document ids of the queries.
      key_segment_ids: (batch, m + length) document ids of the keys (-1: empty memory slot);
        None when they are the queries' (no memory).
      deterministic: True at eval.
      extra: the variant's `features` of x (None by default).

    Returns:
      (batch, length, heads, head_dim).
    """
    del key_segment_ids, deterministic, extra
    if self.head_pattern(0) is None:
      raise NotImplementedError(f'{type(self).__name__} has no static pattern (head_pattern): '
                                'it must implement attend')
    return dispatch.attend(self, q, k, v, positions=positions, segment_ids=segment_ids)
