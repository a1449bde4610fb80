"""LSH attention of the Reformer (Kitaev et al., 2020), causal, with shared-QK.

Shared-QK: one projection gives the queries q and the values v; the keys are the queries
normalized to unit length, k_j = q_j / |q_j|, so a query and its key hash alike. The logit
is q_i . k_j = |q_i| cos(q_i, q_j), not divided by sqrt(d_head) (see `attend`).

Angular LSH, `n_hashes` rounds of `n_buckets` (b) buckets: round r hashes a key with its own
random rotation R_r in R^{d x b/2}, h_r(x) = argmax([x R_r; -x R_r]). The rotations are drawn
from the model's 'lsh' rng stream, which the train step folds from (seed, step): fresh each
step, the same in the backward pass (autodiff keeps them; remat and reversible layers
replay the key) and in a resumed run. Without the stream (evaluation, decoding, init) every
layer uses the rotations of one fixed key (`eval_rotations`), so evaluation is deterministic
and does not depend on the stack: a scanned stack gives every layer index 0 and decoding runs
it unrolled (decode.unrolled), so rotations that followed the layer index would differ between
the scanned forward pass and its decoding (the variant's layer period is 1: it does not read
its layer index).

Each round sorts the positions by (bucket, position) and cuts the sorted order into chunks
of `chunk_len` (m); a chunk attends to itself and to the previous chunk, keeping the pairs
that share the round's bucket, are causal (j <= i) and of the same document. In a row of
packed documents the sort key is (document, bucket, position): each document's chunks then
depend on its own tokens and its start in the row only, never on another document (with
one document per row this is the paper's order). A query does
not attend to itself unless it has no other key: its own logit is replaced by SELF_LOGIT,
far below any real logit and far above a masked one (the paper's shared-QK rule).

The rounds combine with the weight of each round's log-sum-exp: out_i = sum_r
exp(lse_r(i) - logsumexp_r lse_r(i)) out_r(i). A pair found by several rounds is counted
once: its logit in each round is lowered by log N_ij, N_ij the number of rounds whose chunks
pair i with j, so the result is the softmax over the union of the rounds' key sets
(N_ij is found from each round's bucket and sorted rank of i and j).

Cost: the sort is O(n log n); every score, mask and count is a (chunk, 2 chunk) block per
chunk and round, so time and memory are O(n * chunk_len * n_hashes) (the duplicate count
multiplies by n_hashes once more), never O(n^2).

Decoding (`LSHAttention.decode_step`) attends to the whole bucket, without chunks. The
cache of a layer holds, for each of the max_len positions, its unit key k_j, its value v_j and
its bucket in every round (hashed with the evaluation rotations). The query at position t is
hashed in each round and attends, with logit q_t . k_j, to every cached j <= t that shares its
bucket in at least one round, each such j counted once (the softmax over the union of the
rounds' bucket-mates, which is what the forward pass's log-sum-exp combination with the log
N_ij correction computes), and to itself only when it has no other key (SELF_LOGIT). The
chunks cannot be reproduced: a query's chunk in the sorted order depends on how many later
tokens hash into lower buckets (the forward pass itself therefore depends, through the chunk
boundaries, on later tokens' hashes, as in the paper's causal LSH attention; no later token's
value is ever read), so no cache can give the chunked forward pass exactly. Decoding attends
to the whole bucket instead, as the Reformer's own fast decoding does. When chunk_len is at
least the sequence length (one chunk) the forward pass attends to exactly the bucket-mates
and decoding equals it; with shorter chunks the forward pass sees a subset of the bucket
(its chunk and the previous one) and decoding can differ from it. The prompt is read token
by token (no `prefill_cache`): a prefill runs the chunked forward pass for the prompt, which
with chunk_len shorter than the prompt would not be what p decoding steps compute.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from models.attention import base, traits
from models.attention.registry import register

# A query's logit to itself: exp(SELF_LOGIT - m) is exactly 0 in float32 next to any real
# logit m, so the query falls back to itself only when it has no other key.
SELF_LOGIT = -1e5
# Rotations of a call with no 'lsh' stream (evaluation, decoding) come from this key, the
# same for every layer (`eval_rotations`).
EVAL_KEY = 0x15A
# Document id of the positions that pad the length to whole chunks.
PAD_SEGMENT = 2**31 - 1


def eval_rotations(n_hashes: int, head_dim: int, n_buckets: int):
  """(n_hashes, head_dim, n_buckets / 2) rotations of a call with no 'lsh' stream (evaluation
  and decoding): the same for every layer, whatever the stack."""
  # fold_in(., 0): what layer 0 (and so every layer of a scanned stack) drew before the
  # evaluation rotations stopped following the layer index.
  key = jax.random.fold_in(jax.random.key(EVAL_KEY), 0)
  return jax.random.normal(key, (n_hashes, head_dim, n_buckets // 2), jnp.float32)


def unit_keys(q):
  """The shared-QK keys q / |q| (in q's dtype, norms in float32)."""
  qf = q.astype(jnp.float32)
  k = qf * jax.lax.rsqrt(jnp.maximum(jnp.sum(qf * qf, axis=-1, keepdims=True), 1e-12))
  return k.astype(q.dtype)


def hash_buckets(unit_keys, rotations):
  """h_r(x) = argmax([x R_r; -x R_r]) per round.

  Args:
    unit_keys: (batch, length, heads, head_dim) keys (unit length; any direction works).
    rotations: (n_hashes, head_dim, n_buckets / 2) random rotations.

  Returns:
    (batch, heads, n_hashes, length) int32 buckets in [0, n_buckets).
  """
  proj = jnp.einsum('bnhd,rdk->bhrnk', unit_keys.astype(jnp.float32),
                    rotations.astype(jnp.float32))
  return jnp.argmax(jnp.concatenate([proj, -proj], axis=-1), axis=-1).astype(jnp.int32)


def _lookup(table, pos):
  """table (b, h, N, ...) read at the positions pos (b, h, ...) -> pos.shape + table's trailing
  axes."""
  flat = pos.reshape(pos.shape[:2] + (-1,))
  out = jnp.take_along_axis(table, flat.reshape(flat.shape + (1,) * (table.ndim - 3)), axis=2)
  return out.reshape(pos.shape + table.shape[3:])


def _windows(chunks):
  """(b, h, r, C, m, ...) chunks -> (b, h, r, C, 2m, ...): the previous chunk, then the chunk
  itself (chunk 0's previous slot is filled with chunk 0 and masked by `look_back_valid`)."""
  prev = jnp.concatenate([chunks[:, :, :, :1], chunks[:, :, :, :-1]], axis=3)
  return jnp.concatenate([prev, chunks], axis=4)


def lsh_attention(q, v, segment_ids, buckets, *, chunk_len: int, scale: float, dtype):
  """Causal shared-QK attention within hash buckets, chunked in sorted order.

  Args:
    q: (batch, length, heads, head_dim) queries; the keys are q / |q|.
    v: (batch, length, heads, head_dim) values.
    segment_ids: (batch, length) document ids (packed documents never see each other).
    buckets: (batch, heads, n_hashes, length) int bucket of every position in each round.
    chunk_len: sorted positions per chunk (m); capped at the length.
    scale: logit multiplier.
    dtype: dtype of the weights fed to the value matmul and of the output.

  Returns:
    (batch, length, heads, head_dim).
  """
  b, n, h, d = q.shape
  rounds = buckets.shape[2]
  m = max(1, min(chunk_len, n))
  total = -(-n // m) * m  # Padded to whole chunks; padding sorts last and sees only itself.
  pad = total - n
  k = unit_keys(q)
  qh, kh, vh = (jnp.pad(jnp.swapaxes(a, 1, 2), ((0, 0), (0, 0), (0, pad), (0, 0)))
                for a in (q, k, v))  # (b, h, N, d)
  # Padding gets a document id of its own that sorts after every real one.
  seg = jnp.pad(segment_ids, ((0, 0), (0, pad)), constant_values=PAD_SEGMENT)
  seg = jnp.broadcast_to(seg[:, None], (b, h, total))
  buckets = jnp.pad(buckets, ((0, 0), (0, 0), (0, 0), (0, pad)))
  index = jnp.broadcast_to(jnp.arange(total, dtype=jnp.int32), buckets.shape)
  # Sort by (document, bucket, position): a document's positions are contiguous in the
  # sorted order, so its chunks depend on its own tokens and on where it starts, never on
  # another document's tokens.
  order = jnp.lexsort((index, buckets, jnp.broadcast_to(seg[:, :, None], buckets.shape)),
                      axis=-1).astype(jnp.int32)              # (b, h, r, N)
  rank = jnp.argsort(order, axis=-1).astype(jnp.int32)  # Sorted slot of each position.

  chunk = lambda a: a.reshape(a.shape[:3] + (total // m, m) + a.shape[4:])
  pos_q = chunk(order)                                        # (b, h, r, C, m)
  bucket_q = chunk(jnp.take_along_axis(buckets, order, axis=-1))
  seg_q = chunk(_lookup(seg, order))
  q_s = chunk(_lookup(qh, order))                             # (b, h, r, C, m, d)
  pos_k, bucket_k, seg_k = _windows(pos_q), _windows(bucket_q), _windows(seg_q)
  k_s = _windows(chunk(_lookup(kh, order)))                   # (b, h, r, C, 2m, d)
  v_s = _windows(chunk(_lookup(vh, order)))
  look_back_valid = jnp.concatenate(
      [jnp.arange(total // m)[:, None] > 0, jnp.ones((total // m, 1), bool)], axis=1)
  look_back_valid = jnp.repeat(look_back_valid, m, axis=1)    # (C, 2m)

  live = ((bucket_q[..., :, None] == bucket_k[..., None, :])
          & (pos_k[..., None, :] <= pos_q[..., :, None])
          & (seg_q[..., :, None] == seg_k[..., None, :])
          & look_back_valid[:, None, :])                      # (b, h, r, C, m, 2m)
  logits = jnp.einsum('bhrcqd,bhrckd->bhrcqk', q_s, k_s,
                      preferred_element_type=jnp.float32) * scale
  logits = jnp.where(pos_k[..., None, :] == pos_q[..., :, None], SELF_LOGIT, logits)
  if rounds > 1:
    # N_ij: rounds whose chunks pair i with j (same bucket, j's chunk is i's or the one before).
    per_round = jnp.stack([rank // m, buckets], axis=-1)      # (b, h, r, N, 2)
    per_round = jnp.moveaxis(per_round, 2, 3)                 # (b, h, N, r, 2)
    q_info, k_info = _lookup(per_round, pos_q), _lookup(per_round, pos_k)
    step = q_info[..., :, None, :, 0] - k_info[..., None, :, :, 0]
    together = ((q_info[..., :, None, :, 1] == k_info[..., None, :, :, 1])
                & (step >= 0) & (step <= 1))
    count = jnp.sum(together, axis=-1)                        # (b, h, r, C, m, 2m)
    logits = logits - jnp.log(jnp.maximum(count, 1).astype(jnp.float32))
  logits = jnp.where(live, logits, base.NEG_INF)
  top = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
  e = jnp.where(live, jnp.exp(logits - top), 0.0)
  mass = jnp.sum(e, axis=-1, keepdims=True)  # > 0: a query always sees itself.
  out = jnp.einsum('bhrcqk,bhrckd->bhrcqd', e.astype(dtype), v_s,
                   preferred_element_type=jnp.float32) / mass
  lse = (top + jnp.log(mass))[..., 0]                         # (b, h, r, C, m)
  # Back to position order, then the rounds weighted by their log-sum-exp.
  out = jnp.take_along_axis(out.reshape(b, h, rounds, total, d), rank[..., None], axis=3)
  lse = jnp.take_along_axis(lse.reshape(b, h, rounds, total), rank, axis=3)
  weights = jax.nn.softmax(lse, axis=2)[..., None]
  out = jnp.sum(weights * out, axis=2)[:, :, :n]              # (b, h, n, d)
  return jnp.swapaxes(out, 1, 2).astype(dtype)


@register('lsh')
class LSHAttention(base.MultiHeadAttention):
  """Reformer LSH attention with shared-QK (module docstring). Options n_buckets, n_hashes,
  chunk_len."""

  OPTIONS = {
      # The same parameters, other key sets: the paper evaluates a model trained with one
      # round at more rounds, so eval may change them (a resume may not).
      'n_buckets': base.Option(8, 'b: hash buckets per round, even (1: one bucket, no hashing)',
                               change='training'),
      'n_hashes': base.Option(1, 'rounds of hashing; a query sees the union of its rounds',
                              change='training', bounds=base.Range(base.INTEGER, 1)),
      'chunk_len': base.Option(64, 'm: sorted positions per chunk; a chunk attends to itself '
                                   'and the previous one', change='training',
                               bounds=base.Range(base.INTEGER, 1)),
  }

  def project(self, x):
    """Queries and values from one (d_model, 2, heads, head_dim) kernel 'qv' (shared-QK has
    no key projection); returns (q, q, v): the keys are derived from q in `attend`."""
    q, v = self.fused_projection(x, 'qv', 2)
    if self.qk_norm:
      q = self.head_norm('q_norm')(q)
    return base.constrain_heads(q), base.constrain_heads(q), base.constrain_heads(v)

  def rotations(self):
    """(n_hashes, head_dim, n_buckets / 2) random rotations of this call: drawn from the
    'lsh' stream in training, `eval_rotations` without it (evaluation, decoding)."""
    shape = (self.option('n_hashes'), self.head_dim, self.option('n_buckets') // 2)
    if self.has_rng('lsh'):
      return jax.random.normal(self.make_rng('lsh'), shape, jnp.float32)
    return eval_rotations(*shape[:2], self.option('n_buckets'))

  def buckets(self, q):
    """(batch, heads, n_hashes, length) buckets of the keys q / |q| (direction only)."""
    b, n, h, _ = q.shape
    if self.option('n_buckets') == 1:
      return jnp.zeros((b, h, self.option('n_hashes'), n), jnp.int32)
    return hash_buckets(q, self.rotations())

  def attend(self, q, k, v, *, positions, segment_ids, deterministic, key_segment_ids=None,
             extra=None):
    del k, positions, deterministic, key_segment_ids, extra
    buckets = self.buckets(q)
    self.sow('intermediates', 'buckets', buckets)
    # Scale 1: a unit key makes q . k = |q| cos, which already has the range that 1/sqrt(d)
    # gives q . k for keys of norm sqrt(d) in dot-product attention (with QK-norm, |q| is
    # sqrt(d) times its learned scale). A further 1/sqrt(d) bounded the logits by about the
    # q-norm scale (|cos| <= 1) and kept the softmax near uniform: on the duplication task
    # the model stayed at chance for 250 steps where dense attention learned it in 150.
    return lsh_attention(q, v, segment_ids, buckets, chunk_len=self.option('chunk_len'),
                         scale=1.0, dtype=self.dtype)

  def decode_step(self, q, k, v, *, positions, extra=None):
    """One token, attending to its whole bucket in every round (no chunks: module docstring).

    The cache holds every position up to max_len: 'key' the unit keys k_j = q_j / |q_j| and
    'value' the values v_j, (batch, heads, max_len, head_dim); 'bucket' the bucket of each
    position in every round, (batch, heads, n_hashes, max_len) (-1 when empty); 'position'
    (max_len,) (-1 when empty) and 'index' (the next step). The token at step t joins the
    cache (its key, value and buckets, hashed with the evaluation rotations), then attends,
    with logit q_t . k_j (scale 1, as `attend`), to the cached j <= t that share its bucket in
    at least one round, each counted once (the softmax over the union of the rounds'
    bucket-mates), and to itself only when it has no other key (SELF_LOGIT). This equals the
    forward pass when chunk_len is at least the sequence length (one chunk); with shorter
    chunks the forward pass keeps only the bucket-mates in the query's sorted chunk and the
    one before, which depends on later tokens' buckets, and decoding attends to the whole
    bucket instead (as the Reformer's own fast decoding). One document per row, all rows at
    the same step; the prompt is read token by token (no prefill_cache).

    Args:
      q, k, v: (batch, 1, heads, head_dim); k is q (shared-QK: `project`).
      positions: (batch, 1) the step's position (the cache counts steps itself).
      extra: unused.

    Returns:
      (batch, 1, heads, head_dim).
    """
    del k, positions, extra
    b, t, h, d = q.shape
    n = self.max_len
    if n < 1:
      raise ValueError('decoding needs the attention module to know max_len')
    rounds = self.option('n_hashes')
    bucket = self.variable('cache', 'bucket', lambda: jnp.full((b, h, rounds, n), -1, jnp.int32))
    key = unit_keys(q)
    cache = self.kv_cache(q, key, v, n, (n,))
    if cache is None:
      return jnp.zeros_like(q)
    ck, cv, pos, index = cache
    step = index.value
    mine = self.buckets(q)[..., 0]                             # (b, h, r)
    # Slot t holds position t: in-place slice updates (no scatter).
    put = lambda a, x, axis: jax.lax.dynamic_update_slice_in_dim(
        a, jnp.expand_dims(x, axis).astype(a.dtype), step, axis)
    ck.value = put(ck.value, key[:, 0], 2)
    cv.value = put(cv.value, v[:, 0], 2)
    bucket.value = put(bucket.value, mine, 3)
    pos.value = put(pos.value, step, 0)
    index.value = step + 1

    def scores(logits, start, size):
      held = jax.lax.dynamic_slice_in_dim(pos.value, start, size)
      logits = jnp.where((held == step)[None, None], SELF_LOGIT, logits)
      # Each bucket-mate once, found by any round (the union of the rounds' key sets).
      buckets = jax.lax.dynamic_slice_in_dim(bucket.value, start, size, axis=3)
      mates = jnp.any(buckets == mine[..., None], axis=2)  # (b, h, size)
      return logits, mates & ((held >= 0) & (held <= step))[None, None]

    # Scale 1, as `attend`.
    out = base.over_live_slots(step + 1, q[:, 0], ck.value, cv.value, scores, scale=1.0,
                               dtype=self.dtype)
    return out[:, None].astype(self.dtype)


# ------------------------------------------------------------------ declared beside the math


@traits.declare('lsh')
class LSHTraits(traits.Traits):
  # One chunk (chunk_len >= the tests' 24 tokens): the forward pass attends to the whole
  # bucket, as decoding does (tests/models/test_lsh_decode.py).
  TEST_CONFIG = {'attention_options': {'chunk_len': 32, 'n_buckets': 4, 'n_hashes': 2}}

  @classmethod
  def validate(cls, options: dict, n_heads: int, n_layers: int) -> None:
    del n_heads, n_layers
    b = options['n_buckets']
    if b < 1 or (b > 1 and b % 2):
      raise ValueError(f'n_buckets must be 1 or an even number (the hash '
                       f'is an argmax over [xR; -xR], R of b/2 columns), got {b}')

  @classmethod
  def rng_streams(cls, options: dict) -> tuple[str, ...]:
    return ('lsh',) if options.get('n_buckets', 1) > 1 else ()

  @classmethod
  def implementation(cls, impl, **kwargs):
    """LSH attention has one path of its own (sort, chunk, attend); 'auto', 'xla',
    'blocksparse' and 'pallas' all run it. Its keys are sorted by a hash drawn each step, so
    no block table built on the host says which key blocks a query block reads; it stays on
    its own path, reported as 'blocksparse'."""
    return cls.own_path_implementation(
        impl, refused=('cpu_kernel', 'splash', 'fused', 'cudnn'), engine=False,
        why='lsh attention sorts positions by hash bucket and attends chunk by chunk', **kwargs)
