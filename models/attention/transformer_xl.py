"""Transformer-XL attention (Dai et al., 2019): segment recurrence and relative positions.

Segment recurrence: a layer's keys and values come from [stop_gradient(memory); h], where the
memory is that layer's input over the previous M = `mem_len` positions of the same stream
(models/attention/memory.py; data.packing='stream' gives each batch row consecutive segments
of one text, and the training loop carries and checkpoints the 'memory' collection). Queries
come from the current segment only.

Relative attention, the survey's four terms for query i and key j (x = i - j >= 0):

    score(i, j) = (q_i k_j + q_i W_R r_x + u k_j + v W_R r_x) / sqrt(d_head)
                = ((q_i + u) k_j + (q_i + v) W_R r_x) / sqrt(d_head)

  r_x   the sinusoid encoding of distance x (d_model wide, no parameters), x clamped at
        `clamp_len`;
  W_R   a per-layer projection (d_model -> heads x d_head), parameter 'pos_proj';
  u, v  per head, one pair shared by every layer ('txl_shared/u', 'txl_shared/v'), the
        official code's default (untie_r=False).

The positional term is computed once per query and distance, (q_i + v) W_R r_x for the
distances a query block and its keys span, then shifted so that each (i, j) reads its
distance's value (blockloop.relative_term: a reshape, not a gather). Nothing of shape
(n, M + n, d) is made, and no shift wraps around (distances past the table read zeros, and
only pairs behind the query are live), so nothing needs masking beyond causality.

Which keys a query sees: those at distance 0..M + i across the memory (empty memory slots
and other documents masked), at most `attn_window` back when that is set, and fewer than M
back with `same_length` (every query then sees the same number of keys, as in the paper's
evaluation). The blocked path ('blocksparse') multiplies only the key blocks in reach, so a
window makes long-memory evaluation linear in the memory instead of quadratic.

Evaluation may use a longer memory (`eval_mem_len`): the eval step compiles the model with
mem_len = eval_mem_len (Traits.eval_options) and carries its own memory.

Decoding keeps the last mem_len + max_len keys of each layer (a ring buffer) and attends with
the same rule as the forward pass, whose outputs it reproduces.
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from models import layers
from models.attention import base, blockloop, decoding, memory, traits
from models.attention.registry import register


def sinusoid(distances, width: int):
  """r_x: (len(distances), width) sinusoid encodings [sin(x w_k), cos(x w_k)],
  w_k = 10000^(-2k / width), as Transformer-XL's relative position embedding."""
  if width % 2:
    raise ValueError(f'the sinusoid encoding needs an even width, got d_model={width}')
  inv_freq = 1.0 / (10000.0 ** (np.arange(0, width, 2, dtype=np.float32) / width))
  angles = jnp.asarray(distances, jnp.float32)[:, None] * inv_freq[None, :]
  return jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1)


def distance_table(length: int, clamp_len: int):
  """Distances 0 .. length - 1, clamped at `clamp_len` (0: no clamp); an iota in a traced
  program, not a constant of the program's length."""
  x = jnp.arange(length)
  return jnp.minimum(x, clamp_len) if clamp_len > 0 else x


def relative_attention(q, k, v, q_segments, k_segments, pos_keys, u, v_bias, *, reach, block,
                       scale, dtype, engine: dict | None = None):
  """Transformer-XL attention of n queries over m cached and n current keys, block by block.

  Args:
    q: (batch, n, heads, head_dim) queries of the current segment.
    k, v: (batch, m + n, heads, head_dim): m memory positions, then the current ones.
    q_segments: (batch, n) document ids of the queries (0 = padding).
    k_segments: (batch, m + n) document ids of the keys (-1 = empty memory slot).
    pos_keys: (L, heads, head_dim) W_R r_x for distances x = 0 .. L - 1 (clamped already);
      L must exceed the farthest distance a query sees.
    u, v_bias: (heads, head_dim) the global content and positional biases.
    reach: the farthest distance a query sees (keys i - reach .. i), or None for all.
    block: query block length (n: one block).
    scale: logit multiplier (1 / sqrt(head_dim)).
    dtype: dtype of the weights fed to the value matmul and of the output.
    engine: blockloop.attention's kernel and interpret (MultiHeadAttention.engine).

  Returns:
    (batch, n, heads, head_dim); a query with no visible key outputs zeros.
  """
  b, n, h, d = q.shape
  m = k.shape[1] - n
  if block < 1:
    raise ValueError(f'attention block size must be >= 1, got {block}')
  # A row shorter than the block is one block of its own length (the tiny recipe's 10 tokens
  # had been padded to 128 queries reading 256 keys: 5.5x dense's whole train step).
  block = min(block, n)
  nq = -(-n // block)
  # Query i is key index m + i and sees key indices m + i - reach .. m + i.
  windowed = reach is not None and reach + block < m + n
  if windowed:  # Block [s, s + B) reads one window of reach + B keys.
    table = blockloop.Table.runs(m + np.arange(nq) * block - reach, np.ones(nq), reach + block)
    per_step = 1
  else:  # Block [s, s + B) reads the key blocks up to its last query, two per loop step.
    table = blockloop.Table.runs(np.zeros(nq), -(-(m + (np.arange(nq) + 1) * block) // block),
                                 block)
    per_step = min(2, int(table.count.max()))
  farthest = m + n - 1 if reach is None else min(m + n - 1, reach)  # of a visible pair
  if farthest >= pos_keys.shape[0]:
    raise ValueError(f'relative positions cover distances < {pos_keys.shape[0]}, the queries '
                     f'reach {farthest}')
  pk = jnp.swapaxes(pos_keys, 0, 1).astype(q.dtype)  # W_R r_x head-major

  qh, kh, vh = (jnp.swapaxes(a, 1, 2) for a in (q, k, v))  # (b, h, len, d)
  queries = (qh + u[None, :, None, :].astype(qh.dtype),
             qh + v_bias[None, :, None, :].astype(qh.dtype))
  score = relative_score(m=m, reach=reach, scale=scale)
  out, _ = blockloop.attention(queries, kh, vh, q_segments, k_segments, pk, table=table,
                               q_block=block, score=score, dtype=dtype, per_step=per_step,
                               param_axes=('heads', 'distance', None), distance_origin=m,
                               **(engine or {}))
  return jnp.swapaxes(out, 1, 2)


def relative_score(*, m: int, reach: int | None, scale: float):
  """The four-term score as the score of the blocked engine, the Pallas kernels and decoding
  (blockloop.attention's `score`; decoding.step): queries (q + u, q + v), params the
  positional table, row x for distance x (W_R r_x per head, (heads, L, head_dim); or any
  table whose product with the position query gives (q + v) W_R r_x, see decode_step).

  Query i is key m + i (m memory positions precede the queries): the pair's distance is
  x = m + i - j, live for 0 <= x (<= reach)."""
  def score(params, qb, kb, i, j):
    q_content, q_position = qb
    x = (m + i)[:, None] - j[None, :]  # (B, keys) distances
    logits = blockloop.head_einsum('bhqd,bhkd->bhqk', q_content, kb,
                                   preferred_element_type=jnp.float32)
    # (q_i + v) W_R r_x once per query and distance of the step, shifted to each key
    # (blockloop.relative_term; x outside [0, reach] is masked).
    logits = (logits + blockloop.relative_term_at(q_position, params, i, j, origin=m)) * scale
    live = x >= 0
    if reach is not None:
      live &= x <= reach
    return logits, live[None, None], None

  return score


_COUNT = base.Range(base.INTEGER, 0)  # A length or distance: 0 or more.


@register('txl')
class TransformerXLAttention(base.MultiHeadAttention):
  """Transformer-XL: attention into the previous segment's layer inputs with the four-term
  relative score. Options mem_len, eval_mem_len, clamp_len, same_length, attn_window."""
  OPTIONS = {
      'mem_len': base.Option(128, "M: previous-segment inputs each layer attends into (0: "
                                  "none; needs data.packing='stream')",
                             bounds=_COUNT, zero_means='no memory'),
      'eval_mem_len': base.Option(0, 'M at evaluation (0: mem_len); the paper evaluates with '
                                     'a longer memory than it trains with',
                                  change='runtime', bounds=_COUNT, zero_means='mem_len'),
      'clamp_len': base.Option(0, 'distances beyond this share its encoding r (0: no clamp)',
                               bounds=_COUNT, zero_means='no clamp'),
      'same_length': base.Option(False, 'every query sees the same number of keys: those '
                                        'fewer than M back'),
      'attn_window': base.Option(0, 'w: keys at most w positions back, across the memory '
                                    '(0: all M + i)', bounds=_COUNT, zero_means='all M + i'),
  }

  @property
  def reach(self) -> int | None:
    """The farthest distance a query sees (None: every key of the context)."""
    limits = []
    if self.option('attn_window'):
      limits.append(self.option('attn_window'))
    if self.option('same_length'):
      limits.append(self.option('mem_len') - 1)
    return min(limits) if limits else None

  def memory_spec(self):
    mem_len = self.option('mem_len')
    return memory.Spec(keep=mem_len, use=mem_len) if mem_len else None

  def features(self, x, segment_ids):
    """W_R, the per-layer projection of the sinusoid r (d_model -> heads x d_head)."""
    del segment_ids
    return self.param('pos_proj', nn.with_logical_partitioning(
        layers.default_kernel_init, ('embed', 'heads', 'kv')),
        (x.shape[-1], self.num_heads, self.head_dim), self.param_dtype)

  def biases(self):
    """u, v: (heads, head_dim), shared by the layers (the Decoder hands them in)."""
    if not self.shared or set(self.shared) != {'u', 'v'}:
      raise ValueError('Transformer-XL attention reads u and v shared by all layers: build it '
                       "through the Decoder, or pass shared={'u': ..., 'v': ...}")
    return self.shared['u'], self.shared['v']

  def position_keys(self, w_r, length: int):
    """W_R r_x for x = 0 .. length - 1 (clamped): (length, heads, head_dim)."""
    r = sinusoid(distance_table(length, self.option('clamp_len')), w_r.shape[0])
    return jnp.einsum('xe,ehd->xhd', r.astype(self.dtype), w_r.astype(self.dtype))

  def attend(self, q, k, v, *, positions, segment_ids, deterministic, key_segment_ids=None,
             extra=None):
    del positions, deterministic
    n = q.shape[1]
    if key_segment_ids is None:
      key_segment_ids = segment_ids
    reach = self.reach
    span = k.shape[1] if reach is None else min(k.shape[1], reach + 1)
    u, v_bias = self.biases()
    block = n if self.impl == 'xla' else self.loop_block(n)
    return relative_attention(q, k, v, segment_ids, key_segment_ids,
                              self.position_keys(extra, span), u, v_bias, reach=reach,
                              block=block, scale=self.head_dim ** -0.5, dtype=self.dtype,
                              engine=self.engine())

  def decode_step(self, q, k, v, *, positions, extra=None):
    """One token over a ring buffer of the last mem_len + max_len keys.

    Args:
      q, k, v: (batch, 1, heads, head_dim).
      positions: (batch, 1) the step's position (the cache counts steps itself).
      extra: W_R (features).

    Returns:
      (batch, 1, heads, head_dim).
    """
    del positions
    d = q.shape[-1]
    if self.max_len < 1:
      raise ValueError('decoding needs the attention module to know max_len')
    capacity = self.option('mem_len') + self.max_len
    cache = self.kv_cache(q, k, v, capacity, (capacity,))
    if cache is None:
      return jnp.zeros_like(q)
    ck, cv, pos, index = cache
    step = index.value
    slot = step % capacity
    ck.value = ck.value.at[:, :, slot].set(k[:, 0])
    cv.value = cv.value.at[:, :, slot].set(v[:, 0])
    pos.value = pos.value.at[slot].set(step)
    index.value = step + 1
    u, v_bias = self.biases()
    qh = jnp.swapaxes(q, 1, 2)  # (b, h, 1, d)
    # The training tiles' score (relative_score) with the positional term reassociated:
    # (q + v) . (W_R r_x) = ((q + v) W_R^T) . r_x, so a step projects its query to d_model once
    # and reads r_x at its keys' distances, instead of projecting every r_x by W_R (capacity x
    # d_model x heads x head_dim multiply-adds a step, head_dim times the attention's).
    r = sinusoid(distance_table(capacity, self.option('clamp_len')), extra.shape[0])
    w_r = extra.astype(self.dtype)
    position = jnp.einsum('bhqd,ehd->bhqe', qh + v_bias[None, :, None, :].astype(qh.dtype), w_r)
    queries = (qh + u[None, :, None, :].astype(qh.dtype), position)
    out = decoding.step(queries, ck.value, cv.value, r.astype(self.dtype),
                        score=relative_score(m=0, reach=self.reach, scale=d ** -0.5),
                        query_position=step, key_positions=pos.value,
                        live=jnp.minimum(step + 1, capacity), dtype=self.dtype)
    return out[:, None].astype(self.dtype)


# ------------------------------------------------------------------ declared beside the math


@traits.declare('txl')
class TransformerXLTraits(traits.Traits):
  TEST_CONFIG = {'position_embedding': 'none', 'attention_options': {'mem_len': 0}}
  RELATIVE_POSITIONS = True

  @classmethod
  def validate(cls, options: dict, n_heads: int, n_layers: int) -> None:
    del n_heads, n_layers
    if options['same_length'] and options['mem_len'] < 1:
      raise ValueError('same_length limits each query to the keys fewer '
                       'than mem_len back: it needs mem_len >= 1')
    if options['eval_mem_len'] and not options['mem_len']:
      raise ValueError('eval_mem_len needs a model with segment memory '
                       '(mem_len >= 1): the memory is carried only when training uses one')

  @classmethod
  def uses_memory(cls, options: dict) -> bool:
    return options.get('mem_len', 0) > 0

  @classmethod
  def eval_options(cls, options: dict) -> dict:
    """Evaluation attends into eval_mem_len cached inputs when it is set."""
    return {'mem_len': options['eval_mem_len']} if options.get('eval_mem_len') else {}

  @classmethod
  def shared_params(cls, options, num_heads, head_dim):
    """u and v, one (heads, head_dim) pair for every layer (the official untie_r=False)."""
    del options
    zeros = nn.initializers.zeros
    return {'u': traits.SharedParam((num_heads, head_dim), zeros, ('heads', 'kv')),
            'v': traits.SharedParam((num_heads, head_dim), zeros, ('heads', 'kv'))}

  @classmethod
  def implementation(cls, impl, **kwargs):
    """'xla' computes every key of a query at once; other names run the blocked path
    ('blocksparse'). The relative term is no static pattern: no kernel computes it."""
    return cls.own_path_implementation(
        impl, refused=('cpu_kernel', 'splash', 'fused', 'cudnn'),
        why="Transformer-XL's relative positional term is computed by its own path", **kwargs)
