"""Adaptive attention span (Sukhbaatar et al., 2019): learned and dynamic spans.

Every head attends to the keys r in [t - S, t - 1] (eq. 2-3: a token does not see itself)
with the scores of eq. 1,

    s_tr = q_t . (k_r + p_{t-r}),   p: relative position embeddings shared by the heads,

and a soft mask on the distance x = t - r (section 2.2),

    m_z(x) = clamp((R + z - x) / R, 0, 1),   a_tr = m_z(t-r) exp(s_tr) / sum_q m_z(t-q) exp(s_tq).

'adaptive_span': z = S z' per head, z' in [0, 1] a parameter ('span_fraction', kept in the box
by training/optimizer.py after every update). 'dynamic_span': z_t = S sigmoid(v . x_t + b) per
token and head, b initialized to -4. Both sow the L1 penalty (lambda / M) sum_i z_i into
'losses' (M = heads per layer; the dynamic penalty averages z_t over the scored tokens).

Trimmed compute: a key at distance x >= R + z has weight 0, so only the last T keys are
computed, T = ceil(max_h z_h + R) rounded up to the option `trim_multiple` (`trimmed_span`). T is static:
the training loop reads z at its log and eval steps (where the host waits for the device
anyway) and recompiles only when a layer's T changes (the option trim carries the
per-layer T; absent, T = S). A step whose z outgrew T since computes all S keys instead
(`lax.cond`), so the trim never changes the model. The queries of a block only multiply the
keys within T of them, so the work is n T instead of n^2; no row computes past its own
length.

Segment cache (Dai et al., 2019): with the option `memory`, each layer keeps the last S inputs of the
previous segment in the 'memory' collection (stop-gradient) and attends into them, so queries
see up to S tokens back across segment boundaries; data.packing='stream' gives consecutive
segments of one text to each batch row, and the training loop carries the collection.
"""

from __future__ import annotations

import functools
import math
from typing import ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from models import host
from models.attention import base, blockloop, decoding, memory, traits
from models.attention import registry
from models.attention.registry import register

def soft_mask(x, z, ramp: float):
  """m_z(x) = clamp((R + z - x) / R, 0, 1) (section 2.2); differentiable in z on the ramp."""
  return jnp.clip((ramp + z - x) / ramp, 0.0, 1.0)


def trimmed_span(max_z: float, *, ramp: int, limit: int, multiple: int) -> int:
  """Keys a head with span <= max_z can weigh (x < R + z), rounded up to `multiple`, <= S."""
  needed = max(1, math.ceil(max_z + ramp))
  return int(min(limit, -(-needed // multiple) * multiple))


def span_attention(q, k, v, q_segments, k_segments, rel, z, *, ramp: float, span: int,
                   block: int, scale: float, dtype, platform: str = 'cpu',
                   keep_layers: int = 0, devices: int = 1, engine: dict | None = None):
  """Soft-masked attention over the keys 1..`span` positions back, query block by block.

  Args:
    q: (batch, n, heads, head_dim) queries of the n current positions.
    k, v: (batch, m + n, heads, head_dim): m cached positions, then the n current ones.
    q_segments: (batch, n) document ids of the queries (0 = padding).
    k_segments: (batch, m + n) document ids of the keys (-1 = empty cache slot).
    rel: (>= span, head_dim) relative embeddings; row x - 1 is distance x (eq. 1's p_x).
    z: spans, (heads,) or (batch, n, heads) per token.
    ramp: R.
    span: T, the farthest distance computed; exact when T >= ceil(max z + R) - 1.
    block: query block length.
    scale: logit multiplier.
    dtype: dtype of the weights fed to the value matmul and of the output.
    platform: the platform compiled for: it picks the relative term's form
      (blockloop.relative_form) and whether the weights may be kept.
    keep_layers: on a CPU, the layers of the model that keep their weights for the backward
      (blockloop.attention's keep_weights); 0: recompute them.
    devices: the devices the batch and heads are split over (the kept weights' share).
    engine: blockloop.attention's kernel and interpret (MultiHeadAttention.engine).

  Returns:
    (batch, n, heads, head_dim); a query with no key in reach outputs zeros.
  """
  b, n, h, d = q.shape
  keys = k.shape[1]
  m = keys - n
  if block < 1:
    raise ValueError(f'attention block size must be >= 1, got {block}')
  block = min(block, n)
  nq = -(-n // block)
  # No pair is farther apart than the row allows: a span past keys - 1 computes nothing more
  # (a dynamic span's T = S = 1024 over a 10-token row of the tiny recipe read 1,033 keys per
  # query, 100x the row).
  span = max(1, min(span, keys - 1))
  # Query i is key index m + i; it sees keys m + i - T .. m + i - 1: the queries of block
  # [s, s + B) read the keys from max(0, m + s - T) to m + s + B - 1 (exclusive), in chunks of
  # min(B, T) keys (blockloop's loop over chunks): a block near the start of the row, or a
  # span longer than the row, reads only the keys before its last query (a window of fixed
  # width T + B - 1 read 1.6x the pairs of a 512-token row at T = S).
  width = min(block, span)
  first = np.maximum(0, m + np.arange(nq) * block - span)
  end = np.minimum(keys, m + np.arange(nq) * block + block - 1)
  table = blockloop.Table.runs(first, -(-(end - first) // width), width)
  # All of a block's chunks in one step: its q . p_x over the T distances is computed once per
  # block, not once per chunk (a short row's blocks then read only their own chunks). On a
  # TPU this also takes the least memory: the enwik8 recipe's train step (S = 8192, 8,704 keys
  # a block) needed 14.2 GiB per v5e chip so, and 18.1 GiB at 1,024 keys a step.
  per_step = max(1, int(table.count.max()))
  z = jnp.asarray(z, jnp.float32)
  per_token = z.ndim != 1
  if per_token:  # (b, n, h) -> (b, h, blocks x B): sliced by each block's queries.
    z = jnp.pad(jnp.swapaxes(z, 1, 2), ((0, 0), (0, 0), (0, nq * block - n)))
  # The Pallas kernel takes z shaped as the scores broadcast it (Mosaic tiles no vector of
  # rank 1). The XLA engine keeps the shapes it was measured with: (b, h, blocks x B, 1) made
  # the dynamic span's tiny train step 1.4x as slow on XLA:CPU.
  pallas = (engine or {}).get('kernel') in ('pallas', 'pallas_gpu')
  if pallas:
    z = z[..., None] if per_token else z[None, :, None, None]

  score = span_score(m=m, span=span, ramp=ramp, scale=scale, platform=platform,
                     per_token=per_token, pallas=pallas)
  qh, kh, vh = (jnp.swapaxes(a, 1, 2) for a in (q, k, v))  # (b, h, len, d)
  out, _ = blockloop.attention(qh, kh, vh, q_segments, k_segments,
                               (rel[:span].astype(dtype), z), table=table, q_block=block,
                               score=score, dtype=dtype, per_step=per_step,
                               keep_weights=keep_layers if platform == 'cpu' else 0,
                               devices=devices, **(engine or {}),
                               param_axes=(('distance', None),
                                           ('batch', 'heads', 'queries', None) if per_token
                                           else (None, 'heads', None, None)) if pallas else None,
                               distance_origin=m - 1)
  return jnp.swapaxes(out, 1, 2)


def span_score(*, m: int, span: int, ramp: float, scale: float, platform: str,
               per_token: bool, pallas: bool = False):
  """Eq. 1-3 as the score of the blocked engine, the Pallas kernels and decoding
  (blockloop.attention's `score`; decoding.step): params (p, z), the relative embeddings
  (row x - 1 is distance x) and the spans, (b, h, queries) per token (plus a trailing axis of
  1 for the Pallas kernels, `pallas`) or per head ((1, h, 1, 1) for the kernels, else (h,)).

  Query i is key m + i (m cached positions precede the queries): the pair's distance is
  x = m + i - j. A pair is live for
  1 <= x <= span (T) and m_z(x) > 0, and weighs m_z(x) exp(s)."""
  def score(params, qb, kb, i, j):
    p, z = params
    x = (m + i)[:, None] - j[None, :]  # distances (B, W)
    logits = blockloop.head_einsum('bhqd,bhkd->bhqk', qb, kb, preferred_element_type=jnp.float32)
    # q . p_{x-1} (eq. 1's relative term); pairs outside [1, T] are not live.
    form = blockloop.relative_form(platform, p.shape[0], qb.shape[2], kb.shape[2])
    logits = (logits + blockloop.relative_term_at(qb, p, i, j, origin=m - 1,
                                                  form=form)) * scale
    if per_token:
      z_block = blockloop.query_rows(z, i, axis=2)
      z_block = z_block if pallas else z_block[..., None]
    else:
      z_block = z if pallas else z[None, :, None, None]
    live = (x >= 1) & (x <= span) & (x < ramp + z_block)  # m_z(x) > 0
    return logits, live, soft_mask(x, z_block, ramp)

  return score


def span_report(config, head_spans: np.ndarray) -> dict:
  """Average span, attention FLOPs per token and decoding cache of learned spans (table 1).

  Args:
    config: the TransformerConfig.
    head_spans: (layers, heads) spans z.

  Returns:
    JSON-ready dict. FLOPs count q.k and a.v (2 x 2 head_dim FLOPs per key) of one predicted
    token: `per_head` lets each head stop at z + R; `trimmed` computes a layer's heads
    together up to its trimmed span T (what this code does); `full_span` uses S everywhere.
  """
  opts = config.options_of(next(n for n in config.attention
                                 if issubclass(registry.get(n), AdaptiveSpanAttention)))
  limit, ramp, multiple = opts['limit'], opts['ramp'], opts['trim_multiple']
  d = config.head_dim
  reach = np.minimum(head_spans + ramp, limit)  # Keys with a non-zero mask.
  trims = [trimmed_span(float(z.max()), ramp=ramp, limit=limit, multiple=multiple) for z in head_spans]
  heads = config.n_heads
  flops = {'per_head': float(4 * d * reach.sum()),
           'trimmed': float(4 * d * heads * sum(trims)),
           'full_span': float(4 * d * heads * limit * len(trims))}
  kv_bytes = 2 * heads * d * 4  # float32 key and value per cached position
  return {'span_limit': limit, 'average_span': float(head_spans.mean()),
          'max_span': float(head_spans.max()),
          'head_spans': head_spans.round(2).tolist(), 'trimmed_spans': trims,
          'attention_flops_per_token': flops,
          'flops_saved_vs_full_span': 1.0 - flops['trimmed'] / flops['full_span'],
          'decode_cache_bytes_per_row': {'trimmed': kv_bytes * sum(trims),
                                         'full_span': kv_bytes * limit * len(trims)}}


@register('adaptive_span')
class AdaptiveSpanAttention(base.MultiHeadAttention):
  """Per-head learned span z = S z' (section 2.2).

  Options (config.model.attention_options.adaptive_span; dynamic_span's has them too): limit
  S, ramp R, init (z' at init), penalty lambda, block (trim granularity), learned (False:
  z = S, a fixed-span baseline with the same machinery), memory (segment cache), trim
  (per-layer T, set by the training loop).
  """
  dynamic: ClassVar[bool] = False
  OPTIONS = {
      'limit': base.Option(1024, 'S: the longest span a head may learn',
                           bounds=base.Range(base.INTEGER, 1)),
      'ramp': base.Option(32, "R: width of the soft mask's ramp",
                          bounds=base.Range(base.INTEGER, 1)),
      'init': base.Option(0.0, "z' = z / S at init (paper: 0)",
                          bounds=base.Range(base.REAL, 0, 1, hi_inclusive=True)),
      'penalty': base.Option(2e-6, 'lambda of the L1 penalty (lambda / M) sum z',
                             bounds=base.Range(base.REAL, 0)),
      'trim_multiple': base.Option(64, 'the trimmed span T is rounded up to a multiple of this',
                                   bounds=base.Range(base.INTEGER, 1)),
      'learned': base.Option(True, 'False: z = S for every head (fixed-span baseline)'),
      'memory': base.Option(False, "attend into the previous segment (needs data.packing="
                            "'stream'; the loop carries the 'memory' collection)"),
      'trim': base.Option(None, 'per-layer trimmed span T, set by the training loop from '
                          "the learned z'", internal=True),
  }

  @property
  def limit(self) -> int:
    return self.option('limit')

  @property
  def trim(self) -> int:
    """T of this layer: the keys computed per query."""
    for key, value in self.options:
      if key == 'trim' and value is not None:
        return value[self.layer_index]
    return self.limit

  def spans(self, x, segment_ids):
    """z: (heads,) here; (batch, n, heads) for the dynamic span. Sows the L1 penalty."""
    del x
    init = self.option('init')
    z_frac = self.param('span_fraction', nn.with_logical_partitioning(
        nn.initializers.constant(init), ('heads',)), (self.num_heads,), jnp.float32)
    if not self.option('learned'):
      z = jnp.full((self.num_heads,), float(self.limit))
      self.sow('intermediates', 'head_spans', z)
      return z
    z = self.limit * z_frac
    # L = -log P + (lambda / M) sum_i z_i  (section 2.2)
    self.sow('losses', 'span_penalty', self.option('penalty') / self.num_heads * jnp.sum(z))
    self.sow('metrics', 'span_mean', jnp.mean(z))
    self.sow('metrics', 'span_max', jnp.max(z))
    self.sow('intermediates', 'head_spans', z)
    return z

  def features(self, x, segment_ids):
    """(z, rel): the spans and p_1 .. p_S, the relative embeddings shared by the heads
    (section 3)."""
    z = self.spans(x, segment_ids)
    rel = self.param('rel_pos', nn.with_logical_partitioning(
        nn.initializers.normal(1.0), (None, 'kv')), (self.limit, self.head_dim),
        self.param_dtype)
    return z, rel

  def memory_spec(self):
    """With the option memory: keep the last S inputs, attend into the last T of them."""
    if not self.option('memory'):
      return None
    return memory.Spec(keep=self.limit, use=self.trim)

  def attend(self, q, k, v, *, positions, segment_ids, deterministic, key_segment_ids=None,
             extra=None):
    del positions, deterministic
    z, rel = extra
    impl_block = q.shape[1] if self.impl == 'xla' else self.loop_block(q.shape[1])
    if key_segment_ids is None:
      key_segment_ids = segment_ids
    ramp = self.option('ramp')
    attend = functools.partial(span_attention, q, k, v, segment_ids, key_segment_ids, rel, z,
                               ramp=ramp, block=impl_block, scale=self.head_dim ** -0.5,
                               dtype=self.dtype, platform=self.target_platform(),
                               keep_layers=self.num_layers, devices=self.devices_split(),
                               engine=self.engine())
    reach = k.shape[1] - 1  # The farthest pair of the row.
    if self.dynamic or min(self.trim, reach) >= min(self.limit, reach):
      return attend(span=self.trim)
    # The training loop sets T from z read at its log steps; z may have grown since. A key at
    # distance x weighs m_z(x) > 0 while x < R + z, so T keys are exact while max z + R <= T + 1;
    # a step whose spans outgrew T computes all S (exact, slower) until the loop trims again.
    # Differentiating a cond keeps the residuals of both branches, the one not taken as zeros.
    # So the S-wide branch is rematerialized (its residuals are its inputs) and a trimmed step
    # writes no S-wide zeros; a short row's unrolled trimmed branch is rematerialized too,
    # since the cond writes autodiff's residuals out whole.
    trimmed = lambda: attend(span=self.trim)
    if blockloop.unrolled(-(-q.shape[1] // impl_block), q.shape[1]):
      trimmed = jax.checkpoint(trimmed)
    return jax.lax.cond(jnp.max(z) + ramp <= self.trim + 1, trimmed,
                        jax.checkpoint(lambda: attend(span=self.limit)))

  def decode_step(self, q, k, v, *, positions, extra=None):
    """One token; the cache keeps the last T keys (T = this layer's trimmed span).

    Args:
      q, k, v: (batch, 1, heads, head_dim).
      positions: (batch, 1) the step's position (the cache counts steps itself).
      extra: (z, rel): (heads,) or (batch, 1, heads) spans; (S, head_dim) relative embeddings.

    Returns:
      (batch, 1, heads, head_dim).
    """
    del positions
    z, rel = extra
    d = q.shape[-1]
    trim = self.trim
    cache = self.kv_cache(q, k, v, trim, (trim,))
    if cache is None:
      return jnp.zeros_like(q)
    ck, cv, pos, index = cache
    step = index.value
    z = jnp.asarray(z, jnp.float32)
    per_token = z.ndim != 1
    # The cache holds the last T positions, so no distance exceeds T. The score is the
    # training tiles' (span_score); slots 0 .. min(step, T) - 1 are filled.
    score = span_score(m=0, span=trim, ramp=self.option('ramp'), scale=d ** -0.5,
                       platform=self.target_platform(), per_token=per_token)
    out = decoding.step(jnp.swapaxes(q, 1, 2), ck.value, cv.value,
                        (rel[:trim], jnp.swapaxes(z, 1, 2) if per_token else z), score=score,
                        query_position=step, key_positions=pos.value,
                        live=jnp.minimum(step, trim), dtype=self.dtype)
    # The token joins the cache after attending (it does not see itself).
    slot = step % trim
    ck.value = ck.value.at[:, :, slot].set(k[:, 0])
    cv.value = cv.value.at[:, :, slot].set(v[:, 0])
    pos.value = pos.value.at[slot].set(step)
    index.value = step + 1
    return out[:, None].astype(self.dtype)

  def prefill_cache(self, k, v, *, extra=None):
    """The ring of the last T keys after a prompt of p tokens: slot s holds the latest
    position congruent to s mod T (what p decode steps leave)."""
    del extra
    p, h, trim = k.shape[1], k.shape[2], self.trim
    held = np.full((trim,), -1, np.int64)
    for position in range(p):  # In order: a later position overwrites an earlier one.
      held[position % trim] = position
    self.fill_cache(k, v, np.broadcast_to(held, (h, trim)), (trim,), positions=held)


@register('dynamic_span')
class DynamicSpanAttention(AdaptiveSpanAttention):
  """Per-token span z_t = S sigmoid(v . x_t + b) (section 2.2, 'Dynamic attention span').

  z_t depends on the input, so no static trim below S exists: every query computes the S
  keys before it (still n S work, not n^2).
  """
  dynamic: ClassVar[bool] = True
  OPTIONS = {'bias': base.Option(-4.0, 'b at init (z_t = S sigmoid(v . x_t + b))')}

  @property
  def trim(self) -> int:
    return self.limit

  def spans(self, x, segment_ids):
    w = self.param('span_v', nn.with_logical_partitioning(
        nn.initializers.zeros, ('embed', 'heads')), (x.shape[-1], self.num_heads), jnp.float32)
    bias = self.param('span_b', nn.with_logical_partitioning(
        nn.initializers.constant(self.option('bias')), ('heads',)),
        (self.num_heads,), jnp.float32)
    z = self.limit * jax.nn.sigmoid(
        jnp.einsum('bnd,dh->bnh', x.astype(jnp.float32), w) + bias)  # z_t = S sigma(v.x_t + b)
    real = (segment_ids > 0).astype(jnp.float32)[..., None]
    mean_z = jnp.sum(z * real, axis=(0, 1)) / jnp.maximum(jnp.sum(real), 1.0)  # (h,)
    self.sow('losses', 'span_penalty',
             self.option('penalty') / self.num_heads * jnp.sum(mean_z))
    self.sow('metrics', 'span_mean', jnp.mean(mean_z))
    self.sow('metrics', 'span_max', jnp.max(jnp.where(real > 0, z, 0.0)))
    self.sow('intermediates', 'head_spans', mean_z)
    self.sow('intermediates', 'token_spans', jnp.mean(z, axis=-1))  # figure 5
    return z


# ------------------------------------------------------------------ declared beside the math


@traits.declare('adaptive_span')
class AdaptiveSpanTraits(traits.Traits):
  TEST_CONFIG = {'position_embedding': 'none',
                 'attention_options': {'limit': 16, 'ramp': 4, 'trim_multiple': 4}}

  @classmethod
  def layer_period(cls, options, n_layers):
    """The trimmed span T differs between layers and is static: every layer is its own."""
    return None

  @classmethod
  def implementation(cls, impl, **kwargs):
    """'xla' computes all T keys of every query at once; every other name runs the blocked
    path (query blocks of attention_block_size), reported as 'blocksparse'. The span is
    learned, not a static pattern: 'cpu_kernel' is refused."""
    return cls.own_path_implementation(
        impl, refused=('cpu_kernel',),
        why="adaptive span's soft mask follows the learned spans z, not a static pattern",
        **kwargs)

  @classmethod
  def param_bounds(cls, options):
    return {'span_fraction': (0.0, 1.0)}  # z' = z / S stays in [0, 1].

  @classmethod
  def inspect(cls, config, layers, batch, source):
    """Each head's span per layer (figure 4; dynamic spans averaged over the batch), with
    the average span, attention FLOPs per token and decoding cache (spans.json)."""
    del batch
    if not all('head_spans' in layer for layer in layers):
      return []  # Spans of a model whose every layer has one (one figure for both kinds).
    head_spans = np.stack([np.asarray(layer['head_spans'][0], np.float64) for layer in layers])
    report = span_report(config, head_spans)
    kinds = ','.join(sorted(set(config.attention)))
    flops = report['attention_flops_per_token']
    return [traits.Figure(
        name='spans', file='spans', kind='head_bars', panels={'values': head_spans},
        title=f'{kinds}: average span {report["average_span"]:.0f} of '
              f'S={report["span_limit"]} ({source})',
        report=report, y_max=report['span_limit'], y_label='span z',
        summary=f'average {report["average_span"]:.1f} (max {report["max_span"]:.0f}) of '
                f'S={report["span_limit"]}; trimmed spans {report["trimmed_spans"]}; attention '
                f'FLOPs per token {flops["trimmed"]:.3g} (full span {flops["full_span"]:.3g}, '
                f'{100 * report["flops_saved_vs_full_span"]:.0f}% saved)')]

  @classmethod
  def specialize(cls, config, layer_params):
    """trim: each layer's T from the current z' (a device-to-host copy of one (heads,)
    vector per learned-span layer, gathered from every process where the heads are split
    across hosts); layers without a learned span keep T = S."""
    layers = [i for i, name in enumerate(config.attention)
              if registry.get(name) is cls.module]
    if not layers:
      return None
    opts = config.options_of(config.attention[layers[0]])
    if not opts['learned']:
      return None
    limit = opts['limit']
    fractions = host.to_host([layer_params(i)['attention']['span_fraction'] for i in layers])
    trims = [limit] * config.n_layers
    for i, frac in zip(layers, fractions):
      trims[i] = trimmed_span(limit * float(np.max(frac)), ramp=opts['ramp'], limit=limit,
                              multiple=opts['trim_multiple'])
    return {'trim': tuple(trims)}

  @classmethod
  def validate(cls, options: dict, n_heads: int, n_layers: int) -> None:
    del n_heads
    limit = options['limit']  # The ranges of the options are their declarations' (bounds).
    trim = options['trim']
    if trim is not None and (len(trim) != n_layers or any(not 1 <= t <= limit for t in trim)):
      raise ValueError(f'trim={trim} must give each of the {n_layers} layers a span in '
                       f'[1, limit={limit}]')

  @classmethod
  def uses_memory(cls, options: dict) -> bool:
    return bool(options.get('memory'))


@traits.declare('dynamic_span')
class DynamicSpanTraits(AdaptiveSpanTraits):

  @classmethod
  def specialize(cls, config, layer_params):
    return None  # z_t follows the input: T = S.

  @classmethod
  def param_bounds(cls, options):
    return {}
