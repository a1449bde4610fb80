"""The loop engine of the blocked attention paths (models/attention/blockloop.py).

* A row's chunks are written as the fewest progressions of one stride (causal rows: one;
  periodic summary blocks: one per sub-block), and the table reads exactly those chunks.
* Outputs, log-sum-exps and the gradients of queries, keys, values and score parameters equal
  the dense reference with packed documents, for contiguous tables (slices) and gathered ones,
  one or several chunks per loop step, and a multiplicative gate with parameters of its own.
* A state carried across the query blocks (selective attention's F) gives the whole-sequence
  formula's outputs, row sums and gradients, the initial state's included.
* A short row (at most PLAIN_BLOCKS query blocks) is computed unrolled, with the same outputs
  and gradients.
* Query blocks that read their keys in one step and keep their weights for the backward
  (keep_weights, grouped by how many keys they read) give the same outputs and gradients;
  past KEEP_PAIRS pairs (every keeping layer's, on one device) a layer recomputes them.
* A query that sees no key outputs zeros, with finite gradients.
* Every blocked path at the accelerators' block sizes gives the CPU sizes' model.
* The relative-position term (relative_term), in each of its forms (shifted, gathered by index
  tuples or by pairs), is q_r . table[at0 + r - t] at every pair, zero off the table, with the
  same gradients.

The dense references' outputs and gradients are computed once for the module (the inputs are
fixed), and each loop compiles once: one jitted program returns its outputs and gradients.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import transformer
from models.attention import blockloop, blocksparse, reference

B, N, H, D = 2, 37, 3, 8
SEGMENTS = np.array([[1] * 15 + [2] * 17 + [0] * 5, [3] * 37])


def test_rows_become_few_progressions():
  causal = blockloop.Table.from_chunks([np.arange(b + 1) for b in range(4)], width=8)
  assert causal.start.shape == (4, 1) and causal.contiguous
  assert causal.count[:, 0].tolist() == [1, 2, 3, 4] and np.all(causal.stride == 8)
  summary = blockloop.Table.from_chunks([[6, 7, 14, 15, 22, 23]], width=16)
  assert summary.count.tolist() == [[3, 3]] and summary.stride.tolist() == [[128, 128]]
  assert summary.start.tolist() == [[96, 112]] and not summary.contiguous
  empty = blockloop.Table.from_chunks([[], [2]], width=4)
  assert empty.chunks.tolist() == [0, 1]


def _inputs():
  keys = jax.random.split(jax.random.key(0), 5)
  q, k, v, w = (jax.random.normal(x, (B, H, N, D)) for x in keys[:4])
  rel = jax.random.normal(keys[4], (N, D))
  return q, k, v, w, rel


def _pattern(i, j):
  """Causal: the 9 latest keys and the keys in the first half of each 8 (summary-like)."""
  return (j <= i) & (((i - j) < 9) | (j % 8 < 4))


def _score(params, qb, kb, i, j):
  """Logits with a relative term and a gate that decays with the distance, from a per-head
  start read from the table (so that, as adaptive span's z, the gate has a gradient, summed
  over the batch that shares it)."""
  x = i[:, None] - j[None, :]
  rel = params[jnp.clip(x, 0, N - 1)]  # (B, C, D)
  logits = (jnp.einsum('bhqd,bhkd->bhqk', qb, kb) + jnp.einsum('bhqd,qkd->bhqk', qb, rel)) * 0.3
  start = 1.2 + 0.1 * params[N - 1, :H]  # (H,)
  gate = jnp.clip(start[None, :, None, None] - x / 30.0, 0.0, 1.0)
  return logits, _pattern(i[:, None], j[None, :])[None, None], gate


def _dense(q, k, v, rel):
  i, j = np.arange(N)[:, None], np.arange(N)[None, :]
  logits, live, gate = _score(rel, q, k, jnp.arange(N), jnp.arange(N))
  live = live & (SEGMENTS[:, None, :, None] == SEGMENTS[:, None, None, :])
  w = jnp.where(live, gate * jnp.exp(logits - jnp.max(jnp.where(live, logits, -1e30), -1,
                                                       keepdims=True)), 0.0)
  del i, j
  out = jnp.einsum('bhqk,bhkd->bhqd', w / jnp.sum(w, -1, keepdims=True), v)
  lse = jnp.log(jnp.sum(jnp.where(live, gate * jnp.exp(logits), 0.0), -1))
  return out, lse


def _reference(dense, n_args, extra=()):
  """(outputs, gradients) of `dense` (`_dense` or `_state_dense`) at the module's inputs: the
  forward and the gradients of the loss `_loss_and_grads` takes, in one jitted program."""
  q, k, v, w, rel = _inputs()
  with jax.default_matmul_precision('highest'):
    return _outputs_and_grads(dense, w, n_args)(q, k, v, rel, *extra)


def _outputs_and_grads(f, w, n_args):
  """Jitted: f's outputs and the gradients of sum(out * w) + sum(sin(lse)) (+ sum(cos(rows))
  where f returns row sums) with respect to its first n_args arguments."""
  def fn(*args):
    outs = f(*args)
    loss = jnp.sum(outs[0] * w) + jnp.sum(jnp.sin(outs[1]))
    if len(outs) == 3:
      loss = loss + jnp.sum(jnp.cos(outs[2]))
    return loss, outs
  grad = jax.grad(fn, argnums=tuple(range(n_args)), has_aux=True)
  return jax.jit(lambda *a: grad(*a)[::-1])


@functools.cache
def _dense_reference():
  return _reference(_dense, 4)


@functools.cache
def _state_dense_reference():
  return _reference(_state_dense, 5, (_carry(),))


def _spy_keeps(monkeypatch) -> list:
  """What blockloop._keeps answered, call by call."""
  answers, keeps = [], blockloop._keeps
  monkeypatch.setattr(blockloop, '_keeps', lambda *a: answers.append(keeps(*a)) or answers[-1])
  return answers


# (q_block, per_step, gathered) in CI: a pairwise covering set of the 12 (every two values of
# two parameters meet in some case); the other 6 repeat those pairs and run with -m slow.
_PAIRWISE = {(8, 1, False), (10, 1, True), (8, 3, True), (10, 3, False), (8, 0, True),
             (10, 0, False)}


@pytest.mark.parametrize('gathered, per_step, q_block', [
    pytest.param(gathered, per_step, q_block,
                 id=f"{'loops' if q_block == 8 else 'short_row'}-{per_step or 'kept'}-{gathered}",
                 marks=() if (q_block, per_step, gathered) in _PAIRWISE else pytest.mark.slow)
    for q_block in (8, 10) for per_step in (1, 3, 0) for gathered in (False, True)])
def test_loop_equals_dense_with_gradients(gathered, per_step, q_block, monkeypatch):
  """q_block 8: 5 query blocks, the loops; 10: 4 blocks, a short row, computed unrolled.
  per_step 0: every chunk of a block in one step, the weights kept for the backward
  (keep_weights); the blocks read 2, 4, 6, 8 and 10 chunks, four groups."""
  q, k, v, w, rel = _inputs()
  keeps = _spy_keeps(monkeypatch)
  width = 4
  nq = -(-N // q_block)
  assert (nq <= blockloop.PLAIN_BLOCKS) == (q_block == 10)
  chunks = [np.arange(-(-min(N, (b + 1) * q_block) // width)) for b in range(nq)]
  if gathered:  # Only the chunks the pattern reaches: every other one far from the diagonal.
    i, j = np.arange(N)[:, None], np.arange(N)[None, :]
    hit = np.asarray(_pattern(i, j))
    chunks = [c[[hit[b * q_block:(b + 1) * q_block, x * width:(x + 1) * width].any()
                 for x in c]] for b, c in enumerate(chunks)]
  table = blockloop.Table.from_chunks(chunks, width)
  assert table.contiguous != gathered

  def loop(q, k, v, rel):
    return blockloop.attention(q, k, v, SEGMENTS, SEGMENTS, rel, table=table, q_block=q_block,
                               score=_score, dtype=jnp.float32,
                               per_step=per_step or int(table.chunks.max()),
                               keep_weights=int(per_step == 0))

  with jax.default_matmul_precision('highest'):
    (out, lse), grads = _outputs_and_grads(loop, w, 4)(q, k, v, rel)
  assert keeps == ([True] if per_step == 0 and q_block == 8 else [])
  (want_out, want_lse), want_grads = _dense_reference()
  np.testing.assert_allclose(out, want_out, atol=2e-5, rtol=1e-5)
  np.testing.assert_allclose(lse, want_lse, atol=2e-5, rtol=1e-5)
  for got, want in zip(grads, want_grads):
    np.testing.assert_allclose(got, want, atol=5e-5, rtol=1e-4)


def _carry():
  return jax.random.normal(jax.random.key(1), (B, N))


def _state_score(params, qb, kb, i, j, ctx):
  """`_score` minus F, F_ij = C_j + sum_{k < i} X_kj with X = sigmoid(head 0's logit) on the
  pairs that count, and rows tanh(F) (selective attention's shape, with a nonlinear X)."""
  logits, live, gate = _score(params, qb, kb, i, j)
  x = jnp.where(live[:, 0] & ctx.real, jax.nn.sigmoid(logits[:, 0]), 0.0)
  f = ctx.carried[:, None, :] + jnp.cumsum(x, axis=1) - x
  rows = jnp.where(live[:, 0], jnp.tanh(f), 0.0)
  return logits - f[:, None], live, gate, jnp.sum(x, axis=1), rows


def _state_dense(q, k, v, rel, carry):
  """`_state_score` on the whole sequence at once: (output, log-sum-exp, rows)."""
  logits, live, gate = _score(rel, q, k, jnp.arange(N), jnp.arange(N))
  live = live & (SEGMENTS[:, None, :, None] == SEGMENTS[:, None, None, :])
  x = jnp.where(live[:, 0], jax.nn.sigmoid(logits[:, 0]), 0.0)
  f = carry[:, None, :] + jnp.cumsum(x, axis=1) - x
  rows = jnp.sum(jnp.where(live[:, 0], jnp.tanh(f), 0.0), axis=-1)
  logits = logits - f[:, None]
  w = jnp.where(live, gate * jnp.exp(logits - jnp.max(jnp.where(live, logits, -1e30), -1,
                                                       keepdims=True)), 0.0)
  out = jnp.einsum('bhqk,bhkd->bhqd', w / jnp.sum(w, -1, keepdims=True), v)
  lse = jnp.log(jnp.sum(jnp.where(live, gate * jnp.exp(logits), 0.0), -1))
  return out, lse, rows


@pytest.mark.parametrize('gathered', [False, True])
@pytest.mark.parametrize('per_step', [1, 3])
def test_carried_state_equals_dense_with_gradients(gathered, per_step):
  """A state carried across the query blocks (selective attention's F): the score reads the
  sum of the earlier blocks' increments at its keys. Outputs, log-sum-exps, row sums and the
  gradients of everything, the initial state included, equal the whole-sequence formula;
  the gradient reaching a block's increment from later blocks is the backward's carried
  state, so it fails if the state is dropped, read late, or counted twice."""
  q, k, v, w, rel = _inputs()
  carry = _carry()
  q_block, width = 8, 4
  nq = -(-N // q_block)
  chunks = [np.arange(-(-min(N, (b + 1) * q_block) // width)) for b in range(nq)]
  if gathered:
    i, j = np.arange(N)[:, None], np.arange(N)[None, :]
    hit = np.asarray(_pattern(i, j))
    chunks = [c[[hit[b * q_block:(b + 1) * q_block, x * width:(x + 1) * width].any()
                 for x in c]] for b, c in enumerate(chunks)]
  table = blockloop.Table.from_chunks(chunks, width)

  def loop(q, k, v, rel, carry):
    return blockloop.attention(q, k, v, SEGMENTS, SEGMENTS, rel, table=table, q_block=q_block,
                               score=_state_score, dtype=jnp.float32, per_step=per_step,
                               carry=carry)

  with jax.default_matmul_precision('highest'):
    got, got_grads = _outputs_and_grads(loop, w, 5)(q, k, v, rel, carry)
  want, want_grads = _state_dense_reference()
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-5)
  for a, b in zip(got_grads, want_grads):
    np.testing.assert_allclose(a, b, atol=5e-5, rtol=1e-4)
  assert float(jnp.abs(got_grads[4]).max()) > 0.01  # The initial state's gradient is checked.


@pytest.mark.parametrize('path', ['short_row', 'loops', 'kept'])
def test_query_without_keys_outputs_zeros_with_finite_gradients(path, monkeypatch):
  if path != 'short_row':  # The loops, which these 2 blocks would not otherwise run.
    monkeypatch.setattr(blockloop, 'PLAIN_BLOCKS', 0)
  keeps = _spy_keeps(monkeypatch)
  q, k, v, w, _ = _inputs()
  # Block 0 reads nothing; block 1 reads keys it may not see (live is False for them).
  table = blockloop.Table.runs([0, 0], [0, 1], 8)

  def score(params, qb, kb, i, j):
    del params
    return jnp.einsum('bhqd,bhkd->bhqk', qb, kb), (j[None, :] > 100)[None, None], None

  def f(q, k, v):
    out, lse = blockloop.attention(q[:, :, :16], k, v, SEGMENTS[:, :16], SEGMENTS, None,
                                   table=table, q_block=8, score=score, dtype=jnp.float32,
                                   keep_weights=int(path == 'kept'))
    return out, lse

  def loss(*a):
    out, lse = f(*a)
    return jnp.sum(out * w[:, :, :16]), (out, lse)

  grads, (out, lse) = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
  assert keeps == ([True] if path == 'kept' else [])
  assert np.all(np.asarray(out) == 0) and np.all(np.asarray(lse) <= reference.NEG_INF / 2)
  assert all(np.all(np.isfinite(g)) and np.all(np.asarray(g) == 0) for g in grads)


@pytest.mark.parametrize('layers, devices', [(1, 1), (3, 1), (3, 2)])
def test_weights_are_kept_up_to_keep_pairs(layers, devices, monkeypatch):
  """Weights are kept while the pairs of every keeping layer on one device, its share of the
  batch and heads (batch x heads x queries x keys a step), come to at most KEEP_PAIRS, and
  where every block reads its keys in one step."""
  q, k, v, _, _ = _inputs()
  table = blockloop.Table.runs(np.zeros(5), np.arange(1, 6), 8)  # 1..5 chunks of 8 keys

  def keeps(per_step, limit):
    monkeypatch.setattr(blockloop, 'KEEP_PAIRS', limit)
    answers = _spy_keeps(monkeypatch)
    jax.eval_shape(lambda q: blockloop.attention(
        q, k, v, SEGMENTS, SEGMENTS, None, table=table, q_block=8, per_step=per_step,
        score=lambda p, qb, kb, i, j: (qb @ jnp.swapaxes(kb, 2, 3), True, None),
        dtype=jnp.float32, keep_weights=layers, devices=devices)[0], q)
    monkeypatch.undo()
    return answers

  pairs = layers * (B * H // devices) * 5 * 8 * 5 * 8
  assert blockloop.kept_pairs(table, 8, 5, (B, H), layers, devices) == pairs
  assert keeps(5, pairs) == [True]
  assert keeps(5, pairs - 1) == [False]
  assert keeps(4, pairs) == [False]  # The last block takes two steps.


def test_kept_blocks_come_back_in_order(monkeypatch):
  """Blocks grouped by the keys they read (here 3, 1, 2, 1 and 3 chunks: three groups, in the
  order 1, 3, 2, 0, 4) give the outputs, log-sum-exps and gradients of the recomputing path."""
  monkeypatch.setattr(blockloop, 'PLAIN_BLOCKS', 0)
  keeps = _spy_keeps(monkeypatch)
  q, k, v, w, rel = _inputs()
  table = blockloop.Table.runs([0, 8, 0, 16, 8], [3, 1, 2, 1, 3], 8)

  def f(keep):
    def fn(q, k, v, rel):
      out, lse = blockloop.attention(q, k, v, SEGMENTS, SEGMENTS, rel, table=table, q_block=8,
                                     score=_score, dtype=jnp.float32, per_step=3,
                                     keep_weights=int(keep))
      return jnp.sum(out * w) + jnp.sum(jnp.sin(lse))
    return jax.jit(jax.value_and_grad(fn, argnums=(0, 1, 2, 3)))

  with jax.default_matmul_precision('highest'):
    (kept, kept_grads), (plain, grads) = f(True)(q, k, v, rel), f(False)(q, k, v, rel)
  assert keeps == [True]  # keep_weights=False does not ask.
  np.testing.assert_allclose(kept, plain, rtol=1e-5)
  for a, b in zip(kept_grads, grads):
    np.testing.assert_allclose(a, b, atol=5e-5, rtol=1e-4)


def test_accelerators_take_big_steps():
  """A loop step has a fixed cost on a GPU or TPU: query blocks of at least 512 and steps of at
  least 1024 keys there; a CPU keeps the configured block. On every platform a row shorter
  than the block is one block of its own length."""
  assert blockloop.query_block('cpu', 128, 16384) == 128
  assert blockloop.query_block('gpu', 128, 16384) == blockloop.ACCELERATOR_BLOCK == 512
  assert blockloop.query_block('tpu', 1024, 16384) == 1024
  assert blockloop.query_block('tpu', 128, 256) == 256
  assert blockloop.query_block('tpu', 1024, 256) == 256
  assert blockloop.query_block('cpu', 128, 10) == 10
  assert blockloop.step_keys('cpu', 128) == 128
  assert blockloop.step_keys('gpu', 512) == blockloop.ACCELERATOR_KEYS == 1024


def test_a_cpu_doubles_the_block_of_long_prefix_rows():
  """On a CPU dense causal attention takes blocks of twice the configured length from
  CPU_LONG_ROW queries on (its nq^2 / 2 loop steps were too small to keep two cores busy);
  another layer, a shorter row and an accelerator keep their blocks."""
  long = blockloop.CPU_LONG_ROW
  assert blockloop.query_block('cpu', 128, long, prefix=True) == 256
  assert blockloop.query_block('cpu', 128, 16384, prefix=True) == 256
  assert blockloop.query_block('cpu', 128, long - 1, prefix=True) == 128
  assert blockloop.query_block('cpu', 128, long) == 128
  assert blockloop.query_block('gpu', 128, 16384, prefix=True) == blockloop.ACCELERATOR_BLOCK


@pytest.mark.parametrize('variant,block', [('dense', 256), ('selective', 256), ('txl', 128),
                                           ('fixed', 128), ('adaptive_span', 128)])
def test_prefix_layers_take_the_long_row_block(monkeypatch, variant, block):
  """Dense causal and selective attention ask for the long-row block on a CPU; the other
  blocked layers keep block_size (Transformer-XL measured slower with 256). Shapes only: the
  engine's q_block is recorded while tracing."""
  n = blockloop.CPU_LONG_ROW
  seen = []

  def recording(engine):
    def spy(*args, **kwargs):
      seen.append(kwargs['q_block'])
      return engine(*args, **kwargs)
    return spy

  monkeypatch.setattr(blockloop, 'attention', recording(blockloop.attention))
  monkeypatch.setattr(blocksparse, 'pattern_attention', recording(blocksparse.pattern_attention))
  cfg = transformer.TransformerConfig.from_config(dict(
      d_model=32, n_heads=2, n_layers=1, vocab_size=16, max_len=n, attention=variant,
      attention_impl='blocksparse', target_platform='cpu',
      position_embedding='none' if variant == 'txl' else 'learned',
      attention_options={'txl': {'mem_len': 0}} if variant == 'txl' else {}))
  tokens = jax.ShapeDtypeStruct((1, n), jnp.int32)
  jax.eval_shape(lambda t: transformer.Decoder(cfg).init(jax.random.key(0), t), tokens)
  assert seen and set(seen) == {block}, seen


@pytest.mark.parametrize('variant', ['dense', 'fixed', 'adaptive_span', 'txl', 'selective'])
def test_accelerator_block_sizes_give_the_same_model(variant):
  """Each blocked path wired to the GPU/TPU sizes (query blocks of 512, steps of 1,024 keys;
  plain JAX, so it runs here) gives the CPU sizes' logits and gradients, on rows of 600 tokens
  with two documents (two query blocks, the second ragged)."""
  n = 600
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 16, (1, n)))
  segments = jnp.asarray(np.r_[[1] * 250, [2] * (n - 250)][None])
  positions = jnp.asarray(np.r_[np.arange(250), np.arange(n - 250)][None])

  def model(platform):
    cfg = transformer.TransformerConfig.from_config(dict(
        d_model=32, n_heads=2, n_layers=1, vocab_size=16, max_len=n, attention=variant,
        attention_impl='blocksparse', target_platform=platform,
        position_embedding='none' if variant == 'txl' else 'learned',
        attention_options={'txl': {'mem_len': 0}} if variant == 'txl' else {}))
    return transformer.Decoder(cfg)

  # Eagerly (the last bits of jitted initializers differ) on a short row: the same values.
  params = model('cpu').init(jax.random.key(0), tokens[:, :16])['params']

  def loss(platform):
    def fn(params):
      logits = model(platform).apply({'params': params}, tokens, positions=positions,
                                     segment_ids=segments)
      return jnp.sum(jnp.sin(logits))
    return jax.jit(jax.value_and_grad(fn))

  with jax.default_matmul_precision('highest'):
    (cpu_value, cpu_grads), (tpu_value, tpu_grads) = loss('cpu')(params), loss('tpu')(params)
  np.testing.assert_allclose(tpu_value, cpu_value, rtol=1e-5)
  for got, want in zip(jax.tree.leaves(tpu_grads), jax.tree.leaves(cpu_grads)):
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize('form', blockloop.RELATIVE_FORMS)
@pytest.mark.parametrize('per_head', [False, True])
@pytest.mark.parametrize('at0', [-9, 0, 5, 17, 40])  # Pairs off either end of the table too.
@pytest.mark.parametrize('rows', [24, 9])  # A table longer, or shorter, than the pairs' span.
def test_relative_term_reads_the_distance_row_of_every_pair(form, per_head, at0, rows):
  rng = np.random.default_rng(at0 + 10 + 100 * blockloop.RELATIVE_FORMS.index(form) + rows)
  b, keys = 6, 10
  q = jnp.asarray(rng.normal(size=(2, H, b, D)), jnp.float32)
  table = jnp.asarray(rng.normal(size=(H, rows, D) if per_head else (rows, D)), jnp.float32)

  def term(q, table):
    return blockloop.relative_term(q, table, jnp.asarray(at0), keys, form=form)

  def brute(q, table):
    row = at0 + np.arange(b)[:, None] - np.arange(keys)[None, :]
    inside = jnp.asarray((row >= 0) & (row < rows))
    picked = table[..., np.clip(row, 0, rows - 1), :]  # (B, keys, D) or (H, B, keys, D)
    spec = 'bhqd,qkd->bhqk' if table.ndim == 2 else 'bhqd,hqkd->bhqk'
    return jnp.where(inside, jnp.einsum(spec, q, picked), 0.0)

  np.testing.assert_allclose(term(q, table), brute(q, table), atol=1e-5)
  cot = jnp.asarray(rng.normal(size=(2, H, b, keys)), jnp.float32)
  grads = jax.vjp(term, q, table)[1](cot)
  expected = jax.vjp(brute, q, table)[1](cot)
  for got, want in zip(grads, expected):
    np.testing.assert_allclose(got, want, atol=1e-4)


def test_a_row_shorter_than_a_block_is_not_padded_to_the_block():
  # The tiny recipe's rows are 10 tokens: padded to a 128-query block, dense's blocked step
  # computed 128 x 128 scores a row and ran 5x the XLA path's.
  n = 10
  q = jnp.zeros((2, n, H, D), jnp.float32)
  seg = jnp.ones((2, n), jnp.int32)
  jaxpr = jax.make_jaxpr(lambda q: blockloop.causal(q, q, q, seg, block_size=128, scale=1.0,
                                                    dtype=jnp.float32))(q)
  widest = max(max(getattr(v.aval, 'shape', ()) or (0,)) for e in jaxpr.jaxpr.eqns
               for v in e.outvars)
  assert widest < 128, widest


def test_each_platform_takes_its_relative_form():
  """An accelerator gathers by index tuples (pairs made the TPU compiler lay out adaptive span's
  enwik8 layer in 34 GiB instead of 7.6); a CPU gathers a short span by pairs and shifts a long
  one."""
  assert blockloop.relative_form('tpu', 8192, 512, 8704) == 'gather'
  assert blockloop.relative_form('gpu', 64, 128, 192) == 'gather'
  assert blockloop.relative_form('cpu', 64, 128, 192) == 'pairs'
  assert blockloop.relative_form('cpu', 1024, 128, 1152) == 'shift'
  with pytest.raises(ValueError, match='unknown relative term form'):
    blockloop.relative_term(jnp.zeros((1, 1, 2, 4)), jnp.zeros((3, 4)), 0, 2, form='roll')
