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
implementation (`_blocks`) loops over pairs of (query block, key block): F of a pair is the
column sums of S over the earlier query blocks (a carry) plus a cumulative sum inside the
pair, the softmax is online (flash attention) and the backward a custom VJP that recomputes
each pair's scores, so the program does not grow with n and memory is O(n).

L_mem (eq. 2): L + eps sum_l max_i M^l_i / (L n_{!=pad}), M^l_i = i - sum_{k<=i} min(F_{i,k},
tau) / tau, sown into 'losses' per layer (the max is taken per document).

Context pruning (section 4): with a budget K_l, layer l keeps at most K_l tokens; each new
token beyond K_l evicts the kept token with the highest F (never <BOS>). Decoding keeps a
K_l-slot cache with F per kept token updated incrementally; the full forward applies the
same eviction as a mask (`kept_mask`) so a budgeted loss is one batched pass.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from models import layers
from models.attention import base, blockloop, dispatch
from models.attention.registry import register

Option = base.Option
# attention_options read by this module and their defaults (the paper's setting).
OPTIONS = {
    'selective_shift': Option(True, 'F_ij = sum_{k<=i-1} S_kj: no self-impact (A.4)'),
    'selective_relu': Option(True, 'constraint 1: S = relu(S) (A.5)'),
    'selective_mask_bos': Option(True, "constraint 2: a document's <BOS> is never masked (A.5)"),
    'selective_mask_diag': Option(True, 'constraint 3: a token never masks itself (A.5)'),
    'selective_separate_bilinear': Option(False, 'S from its own bilinear form, not head 0 (A.3)'),
    'selective_lmem_eps': Option(0.0, 'eps of L_mem (eq. 2); 0 = off (paper: 0.1)'),
    'selective_lmem_tau': Option(1.0, "tau of L_mem's M^l_i (the clamp of F)"),
    'selective_budgets': Option((), 'K_l per layer (context pruning); () = keep everything'),
}
# Eviction score of what may not be evicted (<BOS>, empty slots, other documents).
_NEG = -jnp.inf


def bos_flags(segment_ids):
  """(batch, n) bool: the first token of each document of a packed row (its <BOS>)."""
  prev = jnp.pad(segment_ids[:, :-1], ((0, 0), (1, 0)), constant_values=-1)
  return segment_ids != prev


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


@dataclasses.dataclass(frozen=True)
class _Blocked:
  """Static settings of the blocked path (the custom VJP's non-differentiated argument).

  Attributes:
    block: T, the query and key block length.
    scale: logit multiplier, 1 / sqrt(head_dim).
    shift, relu, mask_bos, mask_diag: the selective_* switches (A.4, A.5).
    tau: tau of L_mem's M_i (eq. 2); None: M_i is not computed.
    keep_f: also return F of the batch's first row (the 'selection_F' intermediate).
    dtype: dtype of the probabilities fed to the value matmul and of the output.
  """
  block: int
  scale: float
  shift: bool
  relu: bool
  mask_bos: bool
  mask_diag: bool
  tau: float | None
  keep_f: bool
  dtype: jnp.dtype


class _Padded(NamedTuple):
  """The inputs padded to whole blocks (padded positions form a document of their own, -1).

  q, k, v: (batch, heads, N, head_dim), head-major. sq, sk: (batch, N, d_s), the two sides of
  the selection's bilinear form (head 0's q and k without a separate form, A.3). seg, bos:
  (batch, N) document ids and document starts. separate: S comes from (sq, sk), not head 0.
  """
  q: jax.Array
  k: jax.Array
  v: jax.Array
  sq: jax.Array
  sk: jax.Array
  seg: jax.Array
  bos: jax.Array
  separate: bool


class _Side(NamedTuple):
  """One block of rows [at, at + T) of the queries or of the keys (v, bos: keys only)."""
  h: jax.Array      # (batch, heads, T, head_dim) q or k
  v: jax.Array      # (batch, heads, T, head_dim) or None
  s: jax.Array      # (batch, T, d_s) sq or sk
  seg: jax.Array    # (batch, T)
  bos: jax.Array    # (batch, T) or None
  pos: jax.Array    # (T,) absolute positions


def _pad(spec: _Blocked, q, k, v, segment_ids, selection) -> _Padded:
  """`_Padded` of the inputs of `_blocks`."""
  pad = -q.shape[1] % spec.block

  def rows(a, value=0):
    return jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2), constant_values=value)

  qh, kh, vh = (jnp.swapaxes(rows(a), 1, 2) for a in (q, k, v))
  seg = rows(segment_ids, -1)
  sq, sk = (rows(a) for a in selection) if selection is not None else (qh[:, 0], kh[:, 0])
  return _Padded(qh, kh, vh, sq, sk, seg, bos_flags(seg), selection is not None)


def _side(x: _Padded, at, size: int, keys: bool) -> _Side:
  """Rows [at, at + size) (`at` traced) of the queries (keys=False) or of the keys."""
  def take(a, axis):
    return jax.lax.dynamic_slice_in_dim(a, at, size, axis)

  return _Side(take(x.k if keys else x.q, 2), take(x.v, 2) if keys else None,
               take(x.sk if keys else x.sq, 1), take(x.seg, 1),
               take(x.bos, 1) if keys else None, at + jax.lax.iota(jnp.int32, size))


def _pair(spec: _Blocked, x: _Padded, qb: _Side, kb: _Side, heads: bool = True):
  """Scores of a query block against a key block.

  Returns:
    logits: (batch, heads, T, T) Q K^T / sqrt(d_k), float32; None when not `heads`.
    mask: (batch, T, T) causal same-document mask.
    gate: (batch, T, T) where S keeps the selection logit (`selection_gate`).
    s: (batch, T, T) S after the constraints (3.1, 3.2).
  """
  i, j = qb.pos[:, None], kb.pos[None, :]
  mask = (i >= j)[None] & (qb.seg[:, :, None] == kb.seg[:, None, :])
  logits = None
  if heads:
    logits = jnp.einsum('bhqd,bhkd->bhqk', qb.h, kb.h,
                        preferred_element_type=jnp.float32) * spec.scale
  if heads and not x.separate:
    s = logits[:, 0]                                        # S: head 0 (3.1)
  else:                                                     # (or a separate form, A.3)
    s = jnp.einsum('bqd,bkd->bqk', qb.s, kb.s, preferred_element_type=jnp.float32) * spec.scale
  gate = selection_gate(s, mask, kb.bos, i, j, relu=spec.relu, mask_bos=spec.mask_bos,
                        mask_diag=spec.mask_diag)
  return logits, mask, gate, jnp.where(gate, s, 0.0)


def _block_f(spec: _Blocked, carried, s):
  """F of a pair (section 3): the carried column sums C plus the cumulative sum of S over
  the block's rows up to and including the query (excluding it with the shift, A.4)."""
  f = carried[:, None, :] + jnp.cumsum(s, axis=1)
  return f - s if spec.shift else f


def _m_summands(spec: _Blocked, f, mask):
  """The pair's part of M_i = sum_k (1 - min(F_{i,k}, tau) / tau) (eq. 2), (batch, T)."""
  return jnp.sum(jnp.where(mask, 1.0 - jnp.minimum(f, spec.tau) / spec.tau, 0.0), axis=-1)


def _blocks_forward(spec: _Blocked, q, k, v, segment_ids, selection):
  """Eq. 1 over the pairs of blocks; returns (output, M, F of row 0, log-sum-exp).

  output: (batch, n, heads, head_dim) in spec.dtype; M: (batch, n) M_i of eq. 2 (None without
  tau); F of row 0: (n, n), zero above the diagonal blocks (None without keep_f);
  log-sum-exp: (batch, heads, N) of each padded row's logits, for the backward.
  """
  x = _pad(spec, q, k, v, segment_ids, selection)
  batch, heads, n_pad, d = x.q.shape
  t = spec.block
  n = q.shape[1]

  def query_block(carried, b):
    qb = _side(x, b * t, t, keys=False)

    def key_block(c, state):
      carried, acc, m, l, m_rows, f_rows = state
      kb = _side(x, c * t, t, keys=True)
      logits, mask, _, s = _pair(spec, x, qb, kb)
      column = jax.lax.dynamic_slice_in_dim(carried, c * t, t, 1)
      f = _block_f(spec, column, s)
      carried = jax.lax.dynamic_update_slice_in_dim(carried, column + jnp.sum(s, axis=1),
                                                    c * t, 1)
      if spec.tau is not None:
        m_rows = m_rows + _m_summands(spec, f, mask)
      if spec.keep_f:
        f_rows = jax.lax.dynamic_update_slice_in_dim(f_rows, f[0], c * t, 1)
      logits = jnp.where(mask[:, None], logits - f[:, None], base.NEG_INF)  # eq. 1
      # Online softmax: the rows' running max m, sum l and unnormalized output acc.
      m_new = jnp.maximum(m, jnp.max(logits, axis=-1))
      alpha = jnp.exp(m - m_new)
      p = jnp.exp(logits - m_new[..., None])
      acc = acc * alpha[..., None] + jnp.einsum('bhqk,bhkd->bhqd', p.astype(spec.dtype), kb.v,
                                                preferred_element_type=jnp.float32)
      return carried, acc, m_new, l * alpha + jnp.sum(p, axis=-1), m_rows, f_rows

    init = (carried, jnp.zeros((batch, heads, t, d), jnp.float32),
            jnp.full((batch, heads, t), base.NEG_INF, jnp.float32),
            jnp.zeros((batch, heads, t), jnp.float32),
            jnp.zeros((batch, t), jnp.float32) if spec.tau is not None else None,
            jnp.zeros((t, n_pad), jnp.float32) if spec.keep_f else None)
    # Key block b, the last, holds each row's own key: a row masked in all earlier blocks
    # (another document) has its placeholder sums scaled away by alpha = 0 there.
    carried, acc, m, l, m_rows, f_rows = jax.lax.fori_loop(0, b + 1, key_block, init)
    out = (acc / l[..., None]).astype(spec.dtype)
    return carried, (out, m + jnp.log(l), m_rows, f_rows)

  _, (out, lse, m_rows, f_rows) = jax.lax.scan(
      query_block, jnp.zeros((batch, n_pad), jnp.float32), jax.lax.iota(jnp.int32, n_pad // t))
  # (blocks, batch, heads, T, d) -> (batch, n, heads, d)
  out = jnp.transpose(out, (1, 0, 3, 2, 4)).reshape(batch, n_pad, heads, d)[:, :n]
  lse = jnp.transpose(lse, (1, 2, 0, 3)).reshape(batch, heads, n_pad)
  if m_rows is not None:
    m_rows = jnp.swapaxes(m_rows, 0, 1).reshape(batch, n_pad)[:, :n]
  if f_rows is not None:
    f_rows = f_rows.reshape(n_pad, n_pad)[:n, :n]
  return out, m_rows, f_rows, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _blocks(spec: _Blocked, q, k, v, segment_ids, selection):
  """The 'blocksparse' path: eq. 1 as loops over pairs of blocks, memory O(n).

  Query block b (rows [bT, bT + T)) meets key block c (columns [cT, cT + T)) for c <= b only.
  With C_{b,c,j} = sum_{k < bT} S_{k,j}, the column sums of S over the earlier query blocks,
  F of the pair is (section 3; A.4)

    F_{i,j} = C_{b,c,j} + sum_{bT <= k <= i} S_{k,j}    (k <= i - 1 with the shift),

  so a pair needs only its own S (3.1, 3.2: `_pair`) and one (batch, T) vector of C.

  Forward (`_blocks_forward`): the query blocks in order (a scan), each one's key blocks
  0..b in order (a loop of b + 1 steps) with an online softmax of the logits QK^T/sqrt(d) - F
  (running max, sum and unnormalized output, as flash attention); C is a (batch, n) column
  carry across the query blocks, updated with each pair's column sums of S. M_i of eq. 2
  accumulates over the key blocks the same way.

  Backward (`_blocks_bwd`, flash attention's): the key blocks (a scan), each one's query
  blocks from the last back to the diagonal, the pair's probabilities recomputed from q, k
  and the rows' log-sum-exp. F = cumsum(S) reversed is dS_{k,j} = sum_{i > k} dF_{i,j}
  (i >= k without the shift): the sum over the later query blocks is a (batch, T) carry from
  the last block back, plus a reverse cumulative sum inside the pair. The C_{b,c} of the key
  block are recomputed by a first loop over its query blocks (one head's scores each).

  The program holds each loop body once (its size does not depend on n), and nothing of
  size n^2 is kept for the backward (only the output and a log-sum-exp per row).

  Args:
    spec: static settings.
    q, k, v: (batch, n, heads, head_dim).
    segment_ids: (batch, n) document ids.
    selection: (q_s, k_s), (batch, n, d_s) each, of a separate bilinear form (A.3), or None
      (S from head 0).

  Returns:
    output (batch, n, heads, head_dim) in spec.dtype; M_i (batch, n) of eq. 2 (None without
    spec.tau); F (n, n) of the first row, zero above the diagonal blocks (None without
    spec.keep_f).
  """
  return _blocks_forward(spec, q, k, v, segment_ids, selection)[:3]


def _blocks_fwd(spec: _Blocked, q, k, v, segment_ids, selection):
  out, m_rows, f_rows, lse = _blocks_forward(spec, q, k, v, segment_ids, selection)
  return (out, m_rows, f_rows), (q, k, v, segment_ids, selection, out, lse)


def _blocks_bwd(spec: _Blocked, residuals, cotangents):
  """Gradients of q, k, v and the selection's (q_s, k_s) (the algorithm: `_blocks`).

  Per pair, P = exp(QK^T/sqrt(d) - F - lse) recomputed: dV += P^T dO; dP = dO V^T;
  dZ = P (dP - rowsum(dO * O)) the gradient of the logits Z = QK^T/sqrt(d) - F;
  dF = -sum_heads dZ (plus -dM_i / tau where F < tau, from eq. 2's M_i);
  dS = the later blocks' sum of dF (the carry `later`) + the reverse cumulative sum of dF in
  the pair; ds = dS where the constraints keep s (`selection_gate`), added to head 0's dZ or
  pushed through the separate bilinear form. F of row 0 is sown for inspection only: its cotangent
  is dropped.
  """
  q, k, v, segment_ids, selection, out, lse = residuals
  d_out, d_m, _ = cotangents
  x = _pad(spec, q, k, v, segment_ids, selection)
  batch, heads, n_pad, d = x.q.shape
  t, n = spec.block, q.shape[1]
  nb = n_pad // t
  pad = n_pad - n

  def heads_rows(a):  # (batch, n, heads, d) -> (batch, heads, N, d) float32
    return jnp.swapaxes(jnp.pad(a.astype(jnp.float32), ((0, 0), (0, pad), (0, 0), (0, 0))), 1, 2)

  d_out = heads_rows(d_out)
  delta = jnp.sum(d_out * heads_rows(out), axis=-1)          # rowsum(dO * O)
  d_m = None if d_m is None else jnp.pad(d_m, ((0, 0), (0, pad)))

  def key_block(grads, c):
    dq, dsq = grads
    kb = _side(x, c * t, t, keys=True)

    def prefix(b, state):  # C_{b,c}: S's column sums over the query blocks before b
      run, sums = state
      sums = jax.lax.dynamic_update_index_in_dim(sums, run, b, 0)
      _, _, _, s = _pair(spec, x, _side(x, b * t, t, keys=False), kb, heads=False)
      return run + jnp.sum(s, axis=1), sums

    zeros = jnp.zeros((batch, t), jnp.float32)
    _, sums = jax.lax.fori_loop(c, nb, prefix, (zeros, jnp.zeros((nb, batch, t), jnp.float32)))

    def query_block(r, state):
      dq, dsq, dk, dv, dsk, later = state
      b = nb - 1 - r
      at = b * t
      qb = _side(x, at, t, keys=False)
      logits, mask, gate, s = _pair(spec, x, qb, kb)
      f = _block_f(spec, sums[b], s)
      do, delta_b, lse_b = (jax.lax.dynamic_slice_in_dim(a, at, t, 2)
                            for a in (d_out, delta, lse))
      p = jnp.exp(jnp.where(mask[:, None], logits - f[:, None], base.NEG_INF) - lse_b[..., None])
      dv = dv + jnp.einsum('bhqk,bhqd->bhkd', p.astype(spec.dtype), do.astype(spec.dtype),
                           preferred_element_type=jnp.float32)
      dp = jnp.einsum('bhqd,bhkd->bhqk', do, kb.v.astype(jnp.float32))
      dz = p * (dp - delta_b[..., None])
      df = -jnp.sum(dz, axis=1)
      if d_m is not None:  # M_i = sum_k 1 - min(F_{i,k}, tau) / tau
        dm = jax.lax.dynamic_slice_in_dim(d_m, at, t, 1)
        df = df - jnp.where(mask & (f < spec.tau), dm[:, :, None] / spec.tau, 0.0)
      ds = later[:, None, :] + jax.lax.cumsum(df, axis=1, reverse=True)
      if spec.shift:
        ds = ds - df
      later = later + jnp.sum(df, axis=1)
      ds = jnp.where(gate, ds, 0.0)
      if x.separate:
        dsq_b = jnp.einsum('bqk,bkd->bqd', ds, kb.s.astype(jnp.float32)) * spec.scale
        dsq = jax.lax.dynamic_update_slice_in_dim(
            dsq, jax.lax.dynamic_slice_in_dim(dsq, at, t, 1) + dsq_b, at, 1)
        dsk = dsk + jnp.einsum('bqk,bqd->bkd', ds, qb.s.astype(jnp.float32)) * spec.scale
      else:  # S is head 0's logits
        dz = jax.lax.dynamic_update_index_in_dim(dz, dz[:, 0] + ds, 0, 1)
      dq_b = jnp.einsum('bhqk,bhkd->bhqd', dz, kb.h.astype(jnp.float32)) * spec.scale
      dq = jax.lax.dynamic_update_slice_in_dim(
          dq, jax.lax.dynamic_slice_in_dim(dq, at, t, 2) + dq_b, at, 2)
      dk = dk + jnp.einsum('bhqk,bhqd->bhkd', dz, qb.h.astype(jnp.float32)) * spec.scale
      return dq, dsq, dk, dv, dsk, later

    block = jnp.zeros((batch, heads, t, d), jnp.float32)
    dsk = jnp.zeros((batch, t, x.sk.shape[-1]), jnp.float32) if x.separate else None
    dq, dsq, dk, dv, dsk, _ = jax.lax.fori_loop(0, nb - c, query_block,
                                                (dq, dsq, block, block, dsk, zeros))
    return (dq, dsq), (dk, dv, dsk)

  init = (jnp.zeros((batch, heads, n_pad, d), jnp.float32),
          jnp.zeros((batch, n_pad, x.sq.shape[-1]), jnp.float32) if x.separate else None)
  (dq, dsq), (dk, dv, dsk) = jax.lax.scan(key_block, init, jax.lax.iota(jnp.int32, nb))

  def unblock(a):  # (blocks, batch, heads, T, d) -> (batch, n, heads, d)
    return jnp.transpose(a, (1, 0, 3, 2, 4)).reshape(batch, n_pad, heads, d)[:, :n]

  dq = jnp.swapaxes(dq, 1, 2)[:, :n]
  d_sel = None
  if x.separate:
    dsk = jnp.swapaxes(dsk, 0, 1).reshape(batch, n_pad, -1)[:, :n]
    d_sel = (dsq[:, :n].astype(selection[0].dtype), dsk.astype(selection[1].dtype))
  return (dq.astype(q.dtype), unblock(dk).astype(k.dtype), unblock(dv).astype(v.dtype), None,
          d_sel)


_blocks.defvjp(_blocks_fwd, _blocks_bwd)


@register('selective')
class SelectiveAttention(base.MultiHeadAttention):
  """Selective attention; options `selective_*` (OPTIONS above)."""
  OPTIONS = OPTIONS
  # Context pruning (section 5 of the paper), training/pruning.py: a trained model's per-layer
  # budgets K_l, and what they cost in loss and save in KV-cache memory.
  MODES = {
      'allocate_budgets': ('training.pruning:allocate_budgets',
                           'greedy per-layer context budgets of a selective model '
                           '(WORKDIR/budgets.json)'),
      'eval_budgets': ('training.pruning:evaluate_budgets',
                       'loss and KV-cache reduction with those budgets'),
  }

  @classmethod
  def layer_period(cls, options, n_layers):
    """Per-layer budgets K_l are static in decoding (and fed per layer when pruning): every
    layer is its own."""
    return None

  @classmethod
  def validate(cls, options: dict, n_heads: int, n_layers: int) -> None:
    del n_heads
    eps = options.get('selective_lmem_eps', 0.0)
    if not isinstance(eps, (int, float)) or eps < 0:
      raise ValueError(f'attention_options.selective_lmem_eps (eps of L_mem) must be >= 0, got '
                       f'{eps!r}')
    tau = options.get('selective_lmem_tau', 1.0)
    if not isinstance(tau, (int, float)) or tau <= 0:
      raise ValueError(f'attention_options.selective_lmem_tau (tau of L_mem) must be > 0, got '
                       f'{tau!r}')
    budgets = options.get('selective_budgets') or ()
    if budgets and (not isinstance(budgets, tuple) or len(budgets) != n_layers
                    or any(isinstance(k, bool) or not isinstance(k, int) or k < 2
                           for k in budgets)):
      raise ValueError(f'attention_options.selective_budgets={budgets!r} must be a tuple of '
                       f'{n_layers} integers K_l >= 2 (one per layer; <BOS> and the current '
                       f'token), or () for no pruning')

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
    return [base.Figure(
        name='selective', file='selective_F', kind='matrices',
        panels={f'layer {int(k[5:]) + 1}': m for k, m in matrices.items()},
        title=f'selective attention F ({source})',
        arrays={'tokens': np.asarray(batch['inputs'][0]), **matrices},
        summary=f'F of {len(matrices)} layers ({source}): mean F '
                f'{[round(float(np.nanmean(m)), 3) for m in matrices.values()]}')]

  @property
  def budget(self) -> int:
    """K_l of this layer (static); 0 = unlimited."""
    budgets = self.option('selective_budgets') or ()
    return int(budgets[self.layer_index]) if budgets else 0

  def features(self, x, segment_ids):
    """The separate bilinear form's (q_s, k_s) of appendix A.3, or None (S from head 0)."""
    del segment_ids
    return self.selection_projection(x) if self.option('selective_separate_bilinear') else None

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
    return constrain(s, mask, bos_k, i, j, relu=self.option('selective_relu'),
                     mask_bos=self.option('selective_mask_bos'),
                     mask_diag=self.option('selective_mask_diag'))

  def _sow_memory_loss(self, doc_max_total, segment_ids):
    """eq. 2: eps sum_l max_i M^l_i / (L n_{!=pad}), this layer's share, into 'losses'."""
    eps = float(self.option('selective_lmem_eps'))
    n_real = jnp.maximum(jnp.sum(segment_ids > 0), 1).astype(jnp.float32)
    self.sow('losses', 'selective_lmem', eps * doc_max_total / (self.num_layers * n_real))

  def attend(self, q, k, v, *, positions, segment_ids, deterministic, key_segment_ids=None,
             extra=None):
    del positions, key_segment_ids, deterministic
    selection = extra
    scale = q.shape[-1] ** -0.5
    pruning = self.budget or self.has_variable('pruning', 'budget')
    if self.impl == 'blocksparse' and not pruning:
      return self._attend_blocks(q, k, v, segment_ids, selection, scale)
    if self.impl in ('splash', 'cpu_kernel'):
      raise ValueError('selective attention subtracts F from the logits: use attention_impl '
                       f"'auto', 'xla', 'blocksparse', 'fused' or 'cudnn', not {self.impl!r}")
    n = q.shape[1]
    mask = base.causal_segment_mask(segment_ids)  # (b, n, n)
    logits = jnp.einsum('bqhd,bkhd->bhqk', q, k, preferred_element_type=jnp.float32) * scale
    if selection is None:
      s = logits[:, 0]                                       # S: head 0 (3.1)
    else:
      s = jnp.einsum('bqd,bkd->bqk', *selection, preferred_element_type=jnp.float32) * scale
    i, j = jnp.arange(n)[:, None], jnp.arange(n)[None, :]
    bos = bos_flags(segment_ids)
    s = self._constrain(s, mask, bos, i, j)
    f = jnp.cumsum(s, axis=1)                                # F = sum_{k <= i} S_{k,j}
    e = f - s                                                # sum_{k <= i-1} S_{k,j}
    if self.option('selective_shift'):
      f = e
    if self.option('selective_lmem_eps') > 0:
      self._sow_memory_loss(memory_term(f, mask, segment_ids,
                                        tau=float(self.option('selective_lmem_tau'))), segment_ids)
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

  def _attend_blocks(self, q, k, v, segment_ids, selection, scale):
    """The 'blocksparse' path: eq. 1 as a loop over pairs of blocks with a flash-style
    backward (`_blocks`); M_i of L_mem (eq. 2) and the 'selection_F' intermediate come from
    the same pass."""
    if self.block_size < 1:
      raise ValueError(f'attention block size must be >= 1, got {self.block_size}')
    lmem = self.option('selective_lmem_eps') > 0
    keep_f = self.is_mutable_collection('intermediates')
    # One block length for queries and keys: on an accelerator, a loop step's worth of keys
    # (blockloop.step_keys), the size at which the loop matched the unrolled code on an H200.
    block = blockloop.step_keys(self.target_platform(), self.loop_block(q.shape[1]))
    spec = _Blocked(block=min(block, q.shape[1]), scale=scale,
                    shift=bool(self.option('selective_shift')),
                    relu=bool(self.option('selective_relu')),
                    mask_bos=bool(self.option('selective_mask_bos')),
                    mask_diag=bool(self.option('selective_mask_diag')),
                    tau=float(self.option('selective_lmem_tau')) if lmem else None,
                    keep_f=keep_f, dtype=jnp.dtype(self.dtype))
    out, m_rows, f_rows = _blocks(spec, q, k, v, segment_ids, selection)
    if lmem:
      self._sow_memory_loss(doc_max_sum(m_rows, segment_ids), segment_ids)
    if keep_f:
      self.sow('intermediates', 'selection_F', f_rows)
    return out

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
    f = fc.value.at[rows, slot].set(0.0)
    index.value = step + 1
    live = pos.value >= 0  # (b, cap)
    scale = d ** -0.5
    logits = jnp.einsum('bhd,bhcd->bhc', q[:, 0], ck.value,
                        preferred_element_type=jnp.float32) * scale
    if selection is None:
      s = logits[:, 0]
    else:
      s = jnp.einsum('bd,bcd->bc', selection[0][:, 0], cks.value,
                     preferred_element_type=jnp.float32) * scale
    s = jnp.where(live, s, 0.0)
    if self.option('selective_relu'):
      s = jax.nn.relu(s)
    if self.option('selective_mask_bos'):
      s = jnp.where(pos.value == 0, 0.0, s)
    if self.option('selective_mask_diag'):
      s = jnp.where(pos.value == step, 0.0, s)
    if not self.option('selective_shift'):
      f = f + s                       # F_{t,j} = sum_{k <= t} S_{k,j}
    probs = base.masked_softmax(logits - f[:, None], live[:, None], self.dtype)
    out = jnp.einsum('bhc,bhcd->bhd', probs, cv.value)
    fc.value = f + s if self.option('selective_shift') else f  # F_{t+1,j} for the next token
    return out[:, None].astype(self.dtype)
