"""Selective attention (Leviathan et al., 2024): tokens mask later tokens' view of earlier ones.

Section 3, eq. 1:  SelectiveAttention(Q, K, V) = softmax(Q K^T / sqrt(d_k) - F) V, with

  S = head 0's scaled, causally masked logits          (3.1; a separate bilinear form, A.3)
  S = Constrain(S): ReLU, zero the <BOS> column, zero the diagonal          (3.2, A.5)
  F_{i,j} = sum_{k <= i-1} S_{k,j}   (shifted: a token's selection affects only later
                                      queries; without the shift, sum_{k <= i}, A.4)

F is subtracted from every head's logits. Packed rows: each document's first token is its
<BOS>, and S is zero across documents (it is causally masked per document), so selection
never crosses documents.

Only head 0's logits (one (n, n) matrix per row, not per head) feed F. The 'blocksparse'
implementation runs on the blocked engine of the other variants (blockloop.attention): F of
a (query block, key chunk) pair is the column sums of S over the earlier query blocks, a
state the engine carries from block to block, plus a cumulative sum inside the block
(`_blocked_score`). The engine's online softmax and flash-style backward, which recomputes
each pair's scores and differentiates the score, keep the program the same size at every n
and memory linear in n (plus the state at each query block's start, n / T floats per key).

L_mem (eq. 2): L + eps sum_l max_i M^l_i / (L n_{!=pad}), M^l_i = i - sum_{k<=i} min(F_{i,k},
tau) / tau, sown into 'losses' per layer (the max is taken per document).

Context pruning (section 4): with a budget K_l, layer l keeps at most K_l tokens; each new
token beyond K_l evicts the kept token with the highest F (never <BOS>). Decoding keeps a
K_l-slot cache with F per kept token updated incrementally; the full forward applies the
same eviction as a mask (`kept_mask`) so a budgeted loss is one batched pass.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from models import layers
from models.attention import base, blockloop, decoding, dispatch, traits
from models.attention.registry import register

Option = base.Option
# Its options (config.model.attention_options.selective) and their defaults (the paper's
# setting).
OPTIONS = {
    'shift': Option(True, 'F_ij = sum_{k<=i-1} S_kj: no self-impact (A.4)'),
    'relu': Option(True, 'constraint 1: S = relu(S) (A.5)'),
    'mask_bos': Option(True, "constraint 2: a document's <BOS> is never masked (A.5)"),
    'mask_diag': Option(True, 'constraint 3: a token never masks itself (A.5)'),
    'separate_bilinear': Option(False, 'S from its own bilinear form, not head 0 (A.3)'),
    'lmem_eps': Option(0.0, 'eps of L_mem (eq. 2); 0 = off (paper: 0.1)',
                       bounds=base.Range(base.REAL, 0), zero_means='no L_mem'),
    'lmem_tau': Option(1.0, "tau of L_mem's M^l_i (the clamp of F)",
                       bounds=base.Range(base.REAL, 0, lo_exclusive=True)),
    'budgets': Option((), 'K_l per layer (context pruning); () = keep everything'),
}
# Eviction score of what may not be evicted (<BOS>, empty slots, other documents).
_NEG = -jnp.inf


def bos_flags(segment_ids):
  """(batch, n) bool: the first token of each document of a packed row (its <BOS>)."""
  return blockloop.document_starts(segment_ids)


def selection_gate(s, mask, bos_k, i, j, *, relu: bool, mask_bos: bool, mask_diag: bool):
  """Section 3.2: where S keeps the selection logit s (elsewhere S = 0).

  Args:
    s: (batch, q, k) selection logits.
    mask: (batch, q, k) bool causal same-document mask.
    bos_k: (batch, k) bool: key is its document's <BOS>.
    i, j: (q, 1) and (1, k) absolute query and key positions.
    relu, mask_bos, mask_diag: the three constraints.

  Returns:
    (batch, q, k) bool: inside the mask and not zeroed by a constraint; also dS/ds.
  """
  keep = mask
  if relu:
    keep = keep & (s > 0)                            # 1. only reduce attention
  if mask_bos:
    keep = keep & ~bos_k[:, None, :]                 # 2. do not mask <BOS>
  if mask_diag:
    keep = keep & (i != j)[None]                     # 3. do not mask self
  return keep


def constrain(s, mask, bos_k, i, j, *, relu: bool, mask_bos: bool, mask_diag: bool):
  """Section 3.2: zero S outside the causal same-document mask, then the constraints
  (arguments as `selection_gate`); returns the (batch, q, k) constrained S."""
  return jnp.where(selection_gate(s, mask, bos_k, i, j, relu=relu, mask_bos=mask_bos,
                                  mask_diag=mask_diag), s, 0.0)


def memory_term(f, mask, segment_ids, *, tau: float):
  """Sum over documents of max_i M_i, M_i = sum_{k <= i} (1 - min(F_{i,k}, tau) / tau) (eq. 2).

  Args:
    f: (batch, n, n) F (or the per-row M summands' source).
    mask: (batch, n, n) the keys each query sees (k <= i, same document).
    segment_ids: (batch, n) document ids; 0 (padding) is not counted.
    tau: clamp of F.

  Returns:
    Scalar: sum over the non-pad documents of the batch of max_i M_i.
  """
  m = jnp.sum(jnp.where(mask, 1.0 - jnp.minimum(f, tau) / tau, 0.0), axis=-1)  # (b, n)
  return doc_max_sum(m, segment_ids)


def doc_max_sum(m, segment_ids):
  """Sum over the non-pad documents of the batch of max of `m` (batch, n) in the document."""
  n = m.shape[1]

  def row(m_r, seg_r):  # one row at a time: the batch axis keeps its sharding
    ids = jnp.clip(seg_r, 0, n)
    top = jax.ops.segment_max(m_r, ids, num_segments=n + 1)
    present = jnp.zeros((n + 1,), bool).at[ids].set(True) & (jnp.arange(n + 1) > 0)
    return jnp.sum(jnp.where(present, top, 0.0))  # segment 0 is padding

  return jnp.sum(jax.vmap(row)(m, segment_ids))


def kept_mask(e, bos, budget):
  """Which keys each query still sees after pruning with budget K (section 4).

  Query i first evicts, if its document already keeps K tokens, the kept non-<BOS> token with
  the highest F (ties: the earliest), then keeps itself. F here is what the query would
  subtract before its own selection: sum_{k < i} S_{k,j}.

  Args:
    e: (batch, n, n) sum_{k < i} S_{k,j} (F with the shift).
    bos: (batch, n) bool document starts.
    budget: int scalar K >= 2 (may be traced).

  Returns:
    (batch, n, n) bool: key j is kept when query i attends.
  """
  b, n, _ = e.shape
  rows = jnp.arange(b)

  def body(kept, xs):
    e_i, bos_i, i = xs  # (b, n) row i of E, (b,) query i starts a document, i
    kept = jnp.where(bos_i[:, None], False, kept)  # A new document starts empty.
    cand = jnp.where(kept & ~bos, e_i, _NEG)
    evict = jnp.argmax(cand, axis=-1)  # highest F; ties: the earliest
    full = jnp.sum(kept, axis=-1) >= budget
    kept = kept.at[rows, evict].set(jnp.where(full, False, kept[rows, evict]))
    kept = kept.at[:, i].set(True)
    return kept, kept

  _, out = jax.lax.scan(body, jnp.zeros((b, n), bool),
                        (jnp.swapaxes(e, 0, 1), jnp.swapaxes(bos, 0, 1), jnp.arange(n)))
  return jnp.swapaxes(out, 0, 1)


@jax.custom_vjp
def _minus_f(logits, f):
  """logits (batch, heads, T, C) - F (batch, T, C), F the same for every head (eq. 1).

  F's gradient, minus the sum over heads of the logits', is written as adds of the heads'
  slices: as a reduction over the heads axis XLA:CPU gave it a YNNPACK fusion of its own, and
  one blocked layer's forward and backward at 8K (batch 2, 2 heads of 64, 256-query blocks)
  took 5.5 s (10.7 CPU-seconds) instead of 3.5 s (6.7)."""
  return logits - f[:, None]


def _minus_f_fwd(logits, f):
  return _minus_f(logits, f), None


def _minus_f_bwd(_, g):
  total = g[:, 0]
  for h in range(1, g.shape[1]):
    total = total + g[:, h]
  return g, -total


_minus_f.defvjp(_minus_f_fwd, _minus_f_bwd)


def _blocked_score(*, scale: float, separate: bool, shift: bool, relu: bool, mask_bos: bool,
                   mask_diag: bool, tau: float | None):
  """Eq. 1 as a score of the blocked engine (blockloop.attention with a carried state).

  Query block b (rows [bT, bT + T)) meets a key chunk at columns j. With C_j the column sums
  of S over the earlier query blocks, the state the engine carries from block to block, F of
  the pair is (section 3; A.4)

    F_{i,j} = C_j + sum_{bT <= k <= i} S_{k,j}    (k <= i - 1 with the shift),

  so a pair needs only its own S (3.1, 3.2) and C at its keys; its increment of C is its
  column sums of S. The logits are QK^T/sqrt(d) - F. The engine's backward differentiates
  this function: the gradient reaching S through later queries' F comes back as the
  cotangent of the increment. With `tau`, the rows are the pair's part of M_i of eq. 2,
  sum_k (1 - min(F_{i,k}, tau) / tau).

  q_blk and k_blk are (q, q_s) and (k, k_s) with the separate bilinear form (A.3): q_s and k_s
  as a one-head projection (batch, 1, length, d_s).
  """
  def score(params, qb, kb, i, j, ctx: blockloop.Context):
    del params
    (qh, sq), (kh, sk) = (qb, kb) if separate else ((qb, None), (kb, None))
    logits = blockloop.head_einsum('bhqd,bhkd->bhqk', qh, kh,
                                   preferred_element_type=jnp.float32) * scale
    if separate:                          # S: its own form (A.3), or head 0's on a GPU
      s = blockloop.head_einsum('bhqd,bhkd->bhqk', sq, sk,
                                preferred_element_type=jnp.float32)[:, 0] * scale
    else:
      s = logits[:, 0]                                      # S: head 0 (3.1)
    causal = i[:, None] >= j[None, :]
    s = constrain(s, causal[None] & ctx.real, ctx.starts, i[:, None], j[None, :], relu=relu,
                  mask_bos=mask_bos, mask_diag=mask_diag)
    f, increment = _sums_over_queries(s, exclusive=shift)
    f = ctx.carried[:, None, :] + f
    rows = None
    if tau is not None:
      rows = jnp.where(causal[None], 1.0 - jnp.minimum(f, tau) / tau, 0.0)
    # The Triton kernel lowers no custom VJP; its tiles are one head, where F's gradient is
    # minus the logits' anyway.
    minus_f = (lambda a, b: a - b[:, None]) if blockloop.inside_triton_kernel() else _minus_f
    return minus_f(logits, f), causal[None, None], None, increment, rows

  return score


def _sums_over_queries(s, *, exclusive: bool):
  """The cumulative sums of s (batch, T, C) over its rows (sum_{k <= i}, or k < i when
  `exclusive`), and its column sums, as batched triangular matmuls: within groups of 16
  rows, then over the groups' sums. XLA's CPU cumsum is a log-depth scan of slices, which
  took 2.5x as long forward and backward at T = 128, and the pass computes three per pair.
  The triangles are batched like s so that no operand needs a transpose, built from iotas in
  the program. Broadcast in NumPy they were constants of the batch's size in the program (six
  layers of 136 + 1 MB at the Variable Assignment recipe's 2,048 rows: 16 s to lower its train
  step, now 1.5 s)."""
  b, t, c = s.shape
  exact = jax.lax.Precision.HIGHEST  # F sums many S: no reduced-precision passes on a GPU.
  if blockloop.inside_triton_kernel():  # One row, and a Triton matmul has no batch axis:
    # the tile's T x T triangle at once (T is at most pallas_gpu.TILE).
    prefix = jnp.dot(_triangle((t, t), s.dtype, strict=exclusive), s[0], precision=exact,
                     preferred_element_type=jnp.float32)
    return prefix[None], jnp.sum(s, axis=1)
  g = math.gcd(t, 16)
  before = _triangle((b, t // g, t // g), s.dtype, strict=True)
  groups = s.reshape(b, t // g, g, c)
  totals = jnp.sum(groups, axis=2)                          # (b, T / g, C)
  if blockloop.inside_kernel():  # One batch axis: Mosaic takes a matmul with one.
    within = _triangle((b * (t // g), g, g), s.dtype, strict=exclusive)
    prefix = jnp.einsum('zxy,zyc->zxc', within, groups.reshape(b * (t // g), g, c),
                        precision=exact).reshape(b, t // g, g, c)
  else:
    within = _triangle((b, t // g, g, g), s.dtype, strict=exclusive)
    prefix = jnp.einsum('bgxy,bgyc->bgxc', within, groups, precision=exact)
  sums = prefix + jnp.einsum('bgh,bhc->bgc', before, totals, precision=exact)[:, :, None]
  return sums.reshape(b, t, c), jnp.sum(totals, axis=1)


def _triangle(shape, dtype, *, strict: bool):
  """Ones where the row index of the last two axes is >= (> when `strict`) the column's, as
  iotas in the program: no constant, so the same code runs inside the Pallas kernel (a kernel
  takes no captured array)."""
  row = jax.lax.broadcasted_iota(jnp.int32, shape, len(shape) - 2)
  col = jax.lax.broadcasted_iota(jnp.int32, shape, len(shape) - 1)
  return ((row > col) if strict else (row >= col)).astype(dtype)


@register('selective')
class SelectiveAttention(base.MultiHeadAttention):
  """Selective attention; its options are OPTIONS above. Context pruning (section 5 of
  the paper) is main.py's --mode=allocate_budgets and --mode=eval_budgets."""
  OPTIONS = OPTIONS

  @property
  def budget(self) -> int:
    """K_l of this layer (static); 0 = unlimited."""
    budgets = self.option('budgets') or ()
    return int(budgets[self.layer_index]) if budgets else 0

  def features(self, x, segment_ids):
    """The separate bilinear form's (q_s, k_s) of appendix A.3, or None (S from head 0)."""
    del segment_ids
    return self.selection_projection(x) if self.option('separate_bilinear') else None

  def selection_projection(self, x):
    """(q_s, k_s): (batch, n, head_dim) each, the separate bilinear form of appendix A.3."""
    w = self.param('selection_qk', nn.with_logical_partitioning(
        layers.default_kernel_init, ('embed', 'qkv', 'kv')),
        (x.shape[-1], 2, self.head_dim), self.param_dtype)
    qk = jnp.einsum('bnd,dte->bnte', x.astype(self.dtype), w.astype(self.dtype))
    qs, ks = qk[:, :, 0], qk[:, :, 1]
    if self.qk_norm:
      qs = layers.RMSNorm(dtype=self.dtype, param_dtype=self.param_dtype, axis_name='kv',
                          name='selection_q_norm')(qs)
      ks = layers.RMSNorm(dtype=self.dtype, param_dtype=self.param_dtype, axis_name='kv',
                          name='selection_k_norm')(ks)
    return qs, ks

  def _constrain(self, s, mask, bos_k, i, j):
    return constrain(s, mask, bos_k, i, j, relu=self.option('relu'),
                     mask_bos=self.option('mask_bos'),
                     mask_diag=self.option('mask_diag'))

  def _sow_memory_loss(self, doc_max_total, segment_ids):
    """eq. 2: eps sum_l max_i M^l_i / (L n_{!=pad}), this layer's share, into 'losses'."""
    eps = float(self.option('lmem_eps'))
    n_real = jnp.maximum(jnp.sum(segment_ids > 0), 1).astype(jnp.float32)
    self.sow('losses', 'selective_lmem', eps * doc_max_total / (self.num_layers * n_real))

  def attend(self, q, k, v, *, positions, segment_ids, deterministic, key_segment_ids=None,
             extra=None):
    del positions, key_segment_ids, deterministic
    selection = extra
    scale = q.shape[-1] ** -0.5
    pruning = self.budget or self.has_variable('pruning', 'budget')
    if self.impl in ('blocksparse', 'pallas') and not pruning:
      return self._attend_blocks(q, k, v, segment_ids, selection, scale)
    if self.impl in ('splash', 'cpu_kernel'):
      raise ValueError('selective attention subtracts F from the logits: use attention_impl '
                       f"'auto', 'xla', 'blocksparse', 'pallas', 'fused' or 'cudnn', "
                       f"not {self.impl!r}")
    mask = base.causal_segment_mask(segment_ids)  # (b, n, n)
    logits = jnp.einsum('bqhd,bkhd->bhqk', q, k, preferred_element_type=jnp.float32) * scale
    if selection is None:
      s = logits[:, 0]                                       # S: head 0 (3.1)
    else:
      s = jnp.einsum('bqd,bkd->bqk', *selection, preferred_element_type=jnp.float32) * scale
    bos = bos_flags(segment_ids)
    f, e = self._accumulate(s, mask, bos)
    if self.option('lmem_eps') > 0:
      self._sow_memory_loss(memory_term(f, mask, segment_ids,
                                        tau=float(self.option('lmem_tau'))), segment_ids)
    if self.is_mutable_collection('intermediates'):
      self.sow('intermediates', 'selection_F', f[0])
    if pruning:  # Section 4: the keys a budget of K_l would keep.
      budget = (self.get_variable('pruning', 'budget') if self.has_variable('pruning', 'budget')
                else self.budget)
      mask = mask & kept_mask(e, bos, budget)
    logits = logits - f[:, None]                             # eq. 1: QK^T/sqrt(d) - F
    if self.impl in ('fused', 'cudnn'):
      return dispatch.fused_attention(q, k, v, mask[:, None], impl=self.impl, scale=scale,
                                      dtype=self.dtype, bias=(-f[:, None]).astype(q.dtype))
    probs = base.masked_softmax(logits, mask[:, None], self.dtype)
    return jnp.einsum('bhqk,bkhd->bqhd', probs, v).astype(self.dtype)

  def _accumulate(self, s, mask, bos):
    """F (3.3) and E = sum_{k <= i-1} S_{k,j} (what pruning evicts by) from the selection
    logits s (batch, n, n), the pairs each query sees and the document starts: S is s
    constrained (3.2), F its sum over the earlier queries (with the shift, A.4: F = E)."""
    n = s.shape[-1]
    i, j = jnp.arange(n)[:, None], jnp.arange(n)[None, :]
    s = self._constrain(s, mask, bos, i, j)
    f = jnp.cumsum(s, axis=1)                                # F = sum_{k <= i} S_{k,j}
    e = f - s                                                # sum_{k <= i-1} S_{k,j}
    return (e if self.option('shift') else f), e

  def _attend_blocks(self, q, k, v, segment_ids, selection, scale):
    """The 'blocksparse' path: eq. 1 on the blocked engine (blockloop.attention, dense's
    causal blocks and step sizes) with F's column sums as the state carried across the query
    blocks (`_blocked_score`); M_i of L_mem (eq. 2) comes from the same pass as the engine's
    row sums. Memory: O(n) plus the state at each query block's start, n / T floats per key."""
    if self.block_size < 1:
      raise ValueError(f'attention block size must be >= 1, got {self.block_size}')
    batch, n = q.shape[:2]
    lmem = self.option('lmem_eps') > 0
    if selection is None and self.engine().get('kernel') == 'pallas_gpu':
      # A GPU kernel's program holds one head: head 0's S comes as a one-head query and key
      # that every head's program reads (the same products; their gradients reach head 0).
      selection = (q[:, :, 0], k[:, :, 0])
    # At most n (a short row is one block of its own length); its blocks read every earlier
    # key, as dense's do, so a CPU's long rows take dense's larger block.
    block = self.loop_block(n, prefix=True)
    nq = -(-n // block)
    table = blockloop.Table.runs(np.zeros(nq), np.arange(1, nq + 1), block)
    score = _blocked_score(scale=scale, separate=selection is not None,
                           shift=bool(self.option('shift')),
                           relu=bool(self.option('relu')),
                           mask_bos=bool(self.option('mask_bos')),
                           mask_diag=bool(self.option('mask_diag')),
                           tau=float(self.option('lmem_tau')) if lmem else None)
    qh, kh, vh = (jnp.swapaxes(a, 1, 2) for a in (q, k, v))
    if selection is not None:  # The separate form as one more (one-head) query and key.
      qh, kh = (qh, selection[0][:, None]), (kh, selection[1][:, None])
    out, _, m_rows = blockloop.attention(
        qh, kh, vh, segment_ids, segment_ids, None, table=table, q_block=block, score=score,
        dtype=self.dtype, per_step=blockloop.step_keys(self.target_platform(), block) // block,
        carry=jnp.zeros((batch, n), jnp.float32), **self.engine())
    if lmem:
      self._sow_memory_loss(doc_max_sum(m_rows, segment_ids), segment_ids)
    if self.is_mutable_collection('intermediates'):
      # F of the first row, for inspection only (no gradient): the loop never holds F whole,
      # so the row's S is recomputed here (one head, one (n, n) matrix, as the output is).
      first = (q[:1, :, 0], k[:1, :, 0]) if selection is None else (selection[0][:1],
                                                                     selection[1][:1])
      s = jnp.einsum('bqd,bkd->bqk', *first, preferred_element_type=jnp.float32) * scale
      seg = segment_ids[:1]
      f, _ = self._accumulate(s, base.causal_segment_mask(seg), bos_flags(seg))
      self.sow('intermediates', 'selection_F', jax.lax.stop_gradient(f[0]))
    return jnp.swapaxes(out, 1, 2)

  def decode_step(self, q, k, v, *, positions, extra=None):
    """One token with a K_l-slot cache (section 4); F of each kept token kept incrementally.

    Each call takes one token per row, all rows at the same step, one document per row (step
    0 is its <BOS>). When the cache is full, the kept token with the highest F (never <BOS>;
    ties: the earliest) makes room for the new one.

    Args:
      q, k, v: (batch, 1, heads, head_dim).
      positions: (batch, 1) the step's position (the cache counts steps itself).
      extra: (q_s, k_s) of the separate bilinear form, (batch, 1, head_dim) each, or None.

    Returns:
      (batch, 1, heads, head_dim).
    """
    del positions
    selection = extra
    b, t, h, d = q.shape
    if self.max_len < 1:
      raise ValueError('decoding needs the attention module to know max_len')
    cap = min(self.budget or self.max_len, self.max_len)
    if selection is not None:
      cks = self.variable('cache', 'selection_key', jnp.zeros, (b, cap, d), selection[1].dtype)
    fc = self.variable('cache', 'F', lambda: jnp.zeros((b, cap), jnp.float32))
    cache = self.kv_cache(q, k, v, cap, (b, cap))
    if cache is None:
      return jnp.zeros_like(q)
    ck, cv, pos, index = cache
    step = index.value
    rows = jnp.arange(b)
    # Evict the kept token with the highest F (not <BOS>, position 0); ties: earliest.
    cand = jnp.where(pos.value > 0, fc.value, _NEG)
    top = jnp.max(cand, axis=-1, keepdims=True)
    evict = jnp.argmin(jnp.where(cand == top, pos.value, jnp.iinfo(jnp.int32).max), axis=-1)
    slot = jnp.where(step >= cap, evict, jnp.minimum(step, cap - 1))
    ck.value = ck.value.at[rows, :, slot].set(k[:, 0])
    cv.value = cv.value.at[rows, :, slot].set(v[:, 0])
    if selection is not None:
      cks.value = cks.value.at[rows, slot].set(selection[1][:, 0])
    pos.value = pos.value.at[rows, slot].set(step)
    index.value = step + 1
    # The training tiles' score (_blocked_score) over the kept slots, F carried at each: the
    # step's S joins F after its own logits with the shift (A.4), before them without. The
    # new token's slot starts at F = 0; position 0 is the row's <BOS> (one document a row).
    score = _blocked_score(scale=d ** -0.5, separate=selection is not None,
                           shift=bool(self.option('shift')), relu=bool(self.option('relu')),
                           mask_bos=bool(self.option('mask_bos')),
                           mask_diag=bool(self.option('mask_diag')), tau=None)
    queries, keys = jnp.swapaxes(q, 1, 2), ck.value
    if selection is not None:
      queries, keys = (queries, selection[0][:, None]), (keys, cks.value[:, None])
    out, fc.value = decoding.step(
        queries, keys, cv.value, None, score=score, query_position=step,
        key_positions=pos.value, live=jnp.minimum(step + 1, cap), dtype=self.dtype,
        carry=(fc.value.at[rows, slot].set(0.0), pos.value == 0))
    return out[:, None].astype(self.dtype)


# ------------------------------------------------------------------ declared beside the math


@traits.declare('selective')
class SelectiveTraits(traits.Traits):

  @classmethod
  def layer_period(cls, options, n_layers):
    """Per-layer budgets K_l are static in decoding (and fed per layer when pruning): every
    layer is its own."""
    return None

  @classmethod
  def validate(cls, options: dict, n_heads: int, n_layers: int) -> None:
    del n_heads
    budgets = options.get('budgets') or ()
    if budgets and (not isinstance(budgets, tuple) or len(budgets) != n_layers
                    or any(isinstance(k, bool) or not isinstance(k, int) or k < 2
                           for k in budgets)):
      raise ValueError(f'budgets={budgets!r} must be a tuple of {n_layers} integers K_l >= 2 (one '
                       f'per layer; <BOS> and the current token), or () for no pruning')

  @classmethod
  def inspect(cls, config, layers, batch, source):
    """F of each selective layer on the batch's first row (figure 5), NaN where the query
    cannot see the key; selective_F.npz also holds the row's tokens."""
    seg = np.asarray(batch['segment_ids'][0])
    n = seg.shape[0]
    visible = (np.arange(n)[:, None] >= np.arange(n)[None, :]) & (seg[:, None] == seg[None, :])
    matrices = {f'layer{i}': np.where(visible, np.asarray(layer['selection_F'][0], np.float32),
                                      np.nan)
                for i, layer in enumerate(layers) if 'selection_F' in layer}
    if not matrices:
      return []
    return [traits.Figure(
        name='selective', file='selective_F', kind='matrices',
        panels={f'layer {int(k[5:]) + 1}': m for k, m in matrices.items()},
        title=f'selective attention F ({source})',
        arrays={'tokens': np.asarray(batch['inputs'][0]), **matrices},
        summary=f'F of {len(matrices)} layers ({source}): mean F '
                f'{[round(float(np.nanmean(m)), 3) for m in matrices.values()]}')]
