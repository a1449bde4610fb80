"""The fused score-hook kernel's GPU lowering (models/attention/pallas_gpu.py, Pallas Triton).

No GPU runs here. What is checked is what a CPU host can check:

* Interpret mode (the Triton-style kernels executed as plain JAX): outputs, log-sum-exps and
  the gradients of q, k, v and the hook's parameters equal the XLA engine
  (blockloop.attention) and the dense reference, with two documents in a row at a ragged
  length, in float32 and bfloat16, for a contiguous table not aligned to the tiles and a
  gathered one; and for a distance table read by windows (shared and per head) together with
  a per-row, per-head, per-query parameter. Tiles of 16 queries straddle the table's query
  blocks of 8, so each query is masked by its own block's row of the table.
* Two backward runs give bit-identical gradients (no atomics).
* A carried state (selective attention's F, and its L_mem rows) through the pre-pass and the
  gradient pass equals the engine; a state whose increment reads a head's own array (each
  program holds one head) is refused.
* Every variant trains through it in interpret mode: a one-layer model's loss and every
  gradient equal those of attention_impl='blocksparse'.
* Every variant lowers its one-layer model's train step (loss and gradients) for ('cuda',)
  with the forward, dq and dk/dv kernels (and selective's state passes) as Triton custom
  calls; a head width Triton cannot tile is refused with the reason when the config is
  built.

Tolerances are those of test_pallas_kernel.py (splash's: float32 1e-5 on outputs, 1e-4 on
gradients; bfloat16 2e-2), whose cases and helpers these tests reuse.
"""

# The cases and helpers of test_pallas_kernel.py are its private functions.
# pylint: disable=protected-access
import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import transformer
from models.attention import base, blockloop, pallas_gpu, selective
from tests.models import test_pallas_kernel as tpk
from tests.models.test_pallas_kernel import B, D, H, N, SEGMENTS, TOL


def test_tiles_straddle_the_table_s_blocks_and_read_each_query_s_own_row():
  # Query blocks of 8 (rows: keys 0-5, 3-14, 10-15); query tiles of 16, key tiles of 4.
  table = blockloop.Table.runs([0, 3, 10], [1, 2, 1], 6)
  t = pallas_gpu.tiles(table, q_block=8, queries=20, keys=20, q_tile=16, key_tile=4)
  assert t.steps.tolist() == [4, 2]        # blocks 0 and 1: keys 0-14; block 2: keys 10-15
  assert t.kv.tolist() == [[0, 1, 2, 3], [2, 3, 3, 3]]
  assert t.q_steps.tolist() == [1, 1, 2, 2, 0] and t.qs[2:4].tolist() == [[0, 1], [0, 1]]
  start, _, count = t.rows[:, 0]
  assert start[[0, 8, 16, 19, 20]].tolist() == [0, 3, 10, 10, 10]
  assert count[[0, 8, 16, 19, 20, 31]].tolist() == [1, 2, 1, 1, 0, 0]  # padding reads none


def _run(table, dtype, interpret=True):
  """tpk._run's attention and gradients on the GPU kernel: the same score, whose per-head
  parameter is named so that each program gets its head's."""
  def f(q, q2, k, v, w):
    seg = jnp.asarray(SEGMENTS)
    return blockloop.attention((q, q2), k, v, seg, seg, w, table=table, q_block=8,
                               score=tpk._score, dtype=dtype, out_dtype=jnp.float32,
                               kernel='pallas_gpu', interpret=interpret,
                               param_axes=('heads',))

  def loss(*args):
    out, lse = f(*args)
    return jnp.sum(jnp.sin(out)) + 0.1 * jnp.sum(jnp.where(lse > -1e9, lse, 0.0))

  return jax.jit(lambda *a: (f(*a), jax.grad(loss, argnums=range(5))(*a)))


@functools.lru_cache(maxsize=None)
def _compiled(form, dtype):
  return _run(tpk._tables()[form], dtype)


def _assert_grads_close(grads, want_grads, tol):
  for got, want in zip(grads, want_grads):
    assert got.dtype == want.dtype
    scale = float(jnp.max(jnp.abs(want.astype(jnp.float32)))) or 1.0
    np.testing.assert_allclose(np.asarray(got, np.float32) / scale,
                               np.asarray(want, np.float32) / scale, atol=tol)


@pytest.mark.parametrize('form,dtype', [('contiguous', jnp.float32), ('gathered', jnp.float32),
                                        ('contiguous', jnp.bfloat16)])
def test_outputs_and_gradients_equal_the_engine(form, dtype):
  table = tpk._tables()[form]
  args = tpk._inputs(dtype)
  tol = TOL[dtype]
  (out, lse), grads = _compiled(form, dtype)(*args)
  (want_out, want_lse), want_grads = tpk._run('xla', table, dtype)(*args)
  if form == 'contiguous':  # The table covers every causal pair: the dense reference too.
    ref_out, ref_lse = tpk._dense(*args)
    np.testing.assert_allclose(out, ref_out, atol=tol['out'] * 10, rtol=tol['out'] * 10)
    np.testing.assert_allclose(lse, ref_lse, rtol=tol['out'] * 10)
  np.testing.assert_allclose(out, want_out, atol=tol['out'], rtol=tol['out'])
  np.testing.assert_allclose(lse, want_lse, atol=tol['out'], rtol=tol['out'])
  _assert_grads_close(grads, want_grads, tol['grad'])


def _primitives(jaxpr) -> set[str]:
  """The primitives of a jaxpr and of every jaxpr inside it (the kernels' bodies too)."""
  names = set()
  for eqn in jaxpr.eqns:
    names.add(eqn.primitive.name)
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        inner = getattr(sub, 'jaxpr', sub)
        if hasattr(inner, 'eqns'):
          names |= _primitives(inner)
  return names


def test_backward_is_deterministic():
  """Two runs give bit-identical gradients, and nothing in the program could make a GPU's
  differ: no atomic in a kernel, no scatter-add (XLA's runs with atomics on a GPU)."""
  run = _compiled('gathered', jnp.float32)
  args = tpk._inputs(jnp.float32)
  first, second = run(*args)[1], run(*args)[1]
  for a, b in zip(first, second):
    np.testing.assert_array_equal(a, b)
  names = _primitives(jax.make_jaxpr(run)(*args).jaxpr)
  assert {'pallas_call', 'while', 'dot_general'} <= names  # the kernels' bodies are read
  assert not [x for x in names if 'atomic' in x or 'scatter' in x], sorted(names)


MEMORY, TABLE_ROWS = 40, 60  # keys m + N: distances up to 76 over a 60-row table


def _relative(kernel, per_head):
  """An adaptive-span-like score over a memory: q . k + q . table[x - 1] at distances x in
  [1, 60] (blockloop.relative_term; the table shared or one per head) with a gate from a
  per-row, per-head, per-query parameter z (blockloop.query_rows, as dynamic spans)."""
  keys = MEMORY + N
  chunks = blockloop.Table.runs(np.zeros(-(-N // 8)), np.full(-(-N // 8), -(-keys // 8)), 8)
  seg_q = jnp.asarray(SEGMENTS)
  seg_k = jnp.concatenate([jnp.full((B, MEMORY), 3), seg_q.at[0].set(3)], axis=1)
  seg_q = seg_q.at[0].set(3)
  engine = dict(kernel='pallas_gpu', interpret=True, distance_origin=MEMORY - 1, param_axes=(
      ('heads', 'distance', None) if per_head else ('distance', None),
      ('batch', 'heads', 'queries', None))) if kernel == 'pallas_gpu' else {}

  def score(params, qb, kb, i, j):
    table, z = params
    x = (MEMORY + i)[:, None] - j[None, :]
    logits = blockloop.head_einsum('bhqd,bhkd->bhqk', qb, kb, preferred_element_type=jnp.float32)
    at0 = MEMORY + blockloop.first(i) - blockloop.first(j) - 1
    logits = logits + blockloop.relative_term(qb, table, at0, kb.shape[2])
    z_block = blockloop.query_rows(z, i, axis=2)
    gate = jax.nn.sigmoid(z_block - 0.02 * x)
    return logits * D ** -0.5, ((x >= 1) & (x <= TABLE_ROWS))[None, None], gate

  def f(q, k, v, table, z):
    return blockloop.attention(q, k, v, seg_q, seg_k, (table, z), table=chunks, q_block=8,
                               score=score, dtype=jnp.float32, **engine)

  def loss(*args):
    out, lse = f(*args)
    return jnp.sum(jnp.sin(out)) + 0.1 * jnp.sum(jnp.where(lse > -1e9, lse, 0.0))

  return jax.jit(lambda *a: (f(*a), jax.grad(loss, argnums=range(5))(*a)))


@pytest.mark.parametrize('per_head', [False, True])
def test_a_distance_table_read_by_windows_gives_the_engine_s_results(per_head):
  """Tiles of 16 queries and keys read windows of 32 rows of the table, clipped at both of
  its ends (distances past 60 and before 1 read zeros); outputs and gradients, the table's
  and z's included, equal the engine's."""
  keys = jax.random.split(jax.random.key(3), 5)
  q = jax.random.normal(keys[0], (B, H, N, D))
  k, v = (jax.random.normal(x, (B, H, MEMORY + N, D)) for x in keys[1:3])
  table = jax.random.normal(keys[3], (H, TABLE_ROWS, D) if per_head else (TABLE_ROWS, D))
  z = jax.random.normal(keys[4], (B, H, -(-N // 8) * 8, 1))  # whole query blocks, as spans
  got, got_grads = _relative('pallas_gpu', per_head)(q, k, v, table, z)
  want, want_grads = _relative('xla', per_head)(q, k, v, table, z)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
  _assert_grads_close(got_grads, want_grads, 1e-4)


def test_dq_programs_of_several_query_tiles_give_the_engine_s_gradients(monkeypatch):
  """With a distance table each dq program runs DQ_GROUP query tiles (fewer copies of the
  table's gradient); at 2, the 3 query tiles of 16 are padded to 4: two programs a row and
  head, the second with a tile of padding. The per-query z's gradient goes to each tile's
  rows of its program's share, the table's to its copy."""
  monkeypatch.setattr(pallas_gpu, 'DQ_GROUP', 2)
  keys = jax.random.split(jax.random.key(5), 5)
  q = jax.random.normal(keys[0], (B, H, N, D))
  k, v = (jax.random.normal(x, (B, H, MEMORY + N, D)) for x in keys[1:3])
  table = jax.random.normal(keys[3], (H, TABLE_ROWS, D))
  z = jax.random.normal(keys[4], (B, H, -(-N // 8) * 8, 1))
  got = _relative('pallas_gpu', True)(q, k, v, table, z)[1]
  want = _relative('xla', True)(q, k, v, table, z)[1]
  _assert_grads_close(got, want, 1e-4)


def _carried(kernel, separate: bool, tau):
  """Selective attention's score (blockloop.attention with a carried state: F's column
  sums, and with `tau` the rows of L_mem) on two documents in a row at a ragged length, with
  a random initial state. `separate`: S from a one-head query and key (what the model passes
  the GPU kernel: head 0's), else from head 0's logits (a head's own arrays)."""
  table = blockloop.Table.runs(np.zeros(-(-N // 8)), np.arange(1, -(-N // 8) + 1), 8)
  score = selective._blocked_score(scale=D ** -0.5, separate=separate, shift=True, relu=True,
                                   mask_bos=True, mask_diag=True, tau=tau)
  seg = jnp.asarray(SEGMENTS)
  engine = dict(kernel='pallas_gpu', interpret=True) if kernel == 'pallas_gpu' else {}

  def f(q, k, v, carry):
    qs, ks = ((q, q[:, :1]), (k, k[:, :1])) if separate else (q, k)
    return blockloop.attention(qs, ks, v, seg, seg, None, table=table, q_block=8, score=score,
                               dtype=jnp.float32, carry=carry, **engine)

  def loss(*args):
    out, lse, rows = f(*args)
    total = jnp.sum(jnp.sin(out)) + 0.1 * jnp.sum(jnp.where(lse > -1e9, lse, 0.0))
    return total + (0.0 if rows is None else 0.3 * jnp.sum(jnp.cos(rows)))

  return jax.jit(lambda *a: (f(*a), jax.grad(loss, argnums=range(4))(*a)))


def _carried_inputs():
  keys = jax.random.split(jax.random.key(4), 4)
  q, k, v = (jax.random.normal(x, (B, H, N, 16)) for x in keys[:3])
  return q, k, v, 0.1 * jax.random.normal(keys[3], (B, N))


@pytest.mark.parametrize('tau', [None, 0.5])
def test_a_carried_state_gives_the_engine_s_results(tau):
  """Selective attention's F through the GPU kernel: the state each query tile reads comes
  from a pre-pass over the key tiles, its gradient G from the heads' and later tiles' sums;
  outputs, log-sum-exps, the rows' sums and the gradients of q, k (the one-head S's summed
  into head 0's), v and the initial state equal the engine's. Tiles of 16 queries straddle
  the table's blocks of 8."""
  args = _carried_inputs()
  got, got_grads = _carried('pallas_gpu', True, tau)(*args)
  want, want_grads = _carried('xla', True, tau)(*args)
  assert (got[2] is None) == (tau is None)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
  _assert_grads_close(got_grads, want_grads, 1e-4)
  again = _carried('pallas_gpu', True, tau)(*args)[1]
  for a, b in zip(got_grads, again):  # deterministic: the sums run in a fixed order
    np.testing.assert_array_equal(a, b)


def test_a_state_that_reads_a_head_s_own_array_is_refused():
  """A program holds one head: an increment computed from head 0's own logits (selective's
  S without the one-head arrays the model passes) would be each head's in its programs."""
  with pytest.raises(ValueError, match="state's increment from head 0's programs"):
    _carried('pallas_gpu', False, None)(*_carried_inputs())


def test_a_state_whose_increment_reads_the_state_is_refused():
  """G, the cotangent of a tile's increment, is summed before the tiles' backward from the
  gradients of the states they read: an increment that reads the state would need them in
  order."""
  table = blockloop.Table.runs([0], [1], 16)

  def score(params, qb, kb, i, j, ctx):
    del params
    (qh, sq), (kh, sk) = qb, kb
    logits = blockloop.head_einsum('bhqd,bhkd->bhqk', qh, kh,
                                   preferred_element_type=jnp.float32)
    s = blockloop.head_einsum('bhqd,bhkd->bhqk', sq, sk, preferred_element_type=jnp.float32)
    increment = jnp.sum(s[:, 0], axis=1) * ctx.carried      # reads the state
    return logits, (i[:, None] >= j[None, :])[None, None], None, increment, None

  q = jnp.zeros((1, H, 16, 16))
  seg = jnp.ones((1, 16), jnp.int32)
  with pytest.raises(ValueError, match='must not read the state itself'):
    pallas_gpu.attention((q, q[:, :1]), (q, q[:, :1]), q, seg, seg, None, table=table,
                         q_block=16, score=score, dtype=jnp.float32,
                         carry=jnp.zeros((1, 16)), interpret=True)


# test_pallas_kernel's options, but fixed attention's heads read distinct summary blocks: they
# see different keys, which the GPU kernel tells apart by a per-head parameter.
GPU_VARIANTS = tpk.VARIANTS
OPTIONS = {**tpk.OPTIONS, 'fixed': {**tpk.OPTIONS['fixed'], 'distinct_heads': True}}


@functools.lru_cache(maxsize=None)
def _cpu_model(variant, impl, dtype='float32'):
  cfg = transformer.TransformerConfig.from_config(dict(
      d_model=16, n_heads=2, n_layers=1, vocab_size=16, max_len=N, attention=variant,
      attention_impl=impl, attention_block_size=8, target_platform='cpu', dtype=dtype,
      position_embedding='none' if variant == 'txl' else 'learned',
      attention_options={variant: OPTIONS.get(variant, {})}))
  return transformer.Decoder(cfg)


# local's window is local_global's first layer: its own model is left out (test time).
@pytest.mark.parametrize('variant,dtype', [(v, 'float32') for v in GPU_VARIANTS if v != 'local']
                         + [('txl', 'bfloat16')])
def test_a_model_trains_through_the_gpu_kernel_in_interpret_mode(variant, dtype, monkeypatch):
  """Each variant's one-layer model through the GPU kernel in interpret mode (the engine's
  kernel switched to 'pallas_gpu' for this CPU target): loss and every gradient equal
  'blocksparse''s. Fixed attention's heads see different keys (each head's mask chosen by a
  parameter), adaptive span's table is shared by the heads, dynamic span's z is per row,
  head and query, Transformer-XL reads two query arrays and a distance table per head (and
  in bfloat16 its matmuls' backward casts the float32 cotangent to the operands' dtype),
  selective reads head 0's S as one-head arrays and carries F, with L_mem's rows."""
  engine = base.MultiHeadAttention.engine
  monkeypatch.setattr(base.MultiHeadAttention, 'engine', lambda self: (
      {'kernel': 'pallas_gpu', 'interpret': True} if self.impl == 'pallas' else engine(self)))
  calls = []
  monkeypatch.setitem(blockloop._KERNEL_CALLS, 'pallas_gpu',
                      lambda *a, **kw: calls.append(1) or pallas_gpu.attention(*a, **kw))
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 16, (B, N)))
  segments = jnp.asarray(SEGMENTS)
  positions = jnp.asarray(np.r_[np.arange(15), np.arange(17), np.zeros(5, int)][None]
                          .repeat(B, 0))
  params = _cpu_model(variant, 'blocksparse', dtype).init(jax.random.key(0),
                                                         tokens[:, :8])['params']

  def loss(impl):
    def fn(params):
      logits, state = _cpu_model(variant, impl, dtype).apply(
          {'params': params}, tokens, positions=positions, segment_ids=segments,
          mutable=['losses'])
      aux = sum(jnp.sum(x) for x in jax.tree.leaves(state.get('losses', {})))
      return jnp.sum(jnp.sin(logits.astype(jnp.float32))) + aux
    return jax.jit(jax.value_and_grad(fn))

  value, grads = loss('pallas')(params)
  assert calls, 'the model did not call the GPU kernel'
  want, want_grads = loss('blocksparse')(params)
  if dtype == 'float32':
    np.testing.assert_allclose(value, want, rtol=1e-5)
    for got, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
      np.testing.assert_allclose(got, ref, atol=1e-4, rtol=1e-4)
  else:
    np.testing.assert_allclose(value, want, rtol=TOL[jnp.bfloat16]['out'])
    _assert_grads_close(jax.tree.leaves(grads), jax.tree.leaves(want_grads),
                        TOL[jnp.bfloat16]['grad'])


def test_under_a_mesh_each_device_computes_its_rows_and_heads():
  """The kernels run under shard_map over the batch and head axes (XLA cannot partition a
  Triton kernel), a per-head parameter split with the heads; a batch the mesh cannot split
  (a model's init traces one row) is computed whole on each device."""
  mesh = jax.sharding.AbstractMesh((2, 1, 2), ('data', 'fsdp', 'tensor'),
                                   axis_types=(jax.sharding.AxisType.Auto,) * 3)
  table = blockloop.Table.runs([0, 0], [1, 2], 8)

  def score(w, qb, kb, i, j):
    logits = blockloop.head_einsum('bhqd,bhkd->bhqk', qb, kb, preferred_element_type=jnp.float32)
    return logits * w, (j[None, :] <= i[:, None])[None, None], None

  def f(q, w):
    seg = jnp.ones(q.shape[:1] + (16,), jnp.int32)
    return pallas_gpu.attention(q, q, q, seg, seg, w, table=table, q_block=8, score=score,
                                dtype=jnp.float32, param_axes=(None, 'heads', None, None),
                                interpret=True)[0]

  w = jax.ShapeDtypeStruct((1, 4, 1, 1), jnp.float32)
  with jax.sharding.use_abstract_mesh(mesh), nn.logical_axis_rules(
      (('batch', ('data', 'fsdp')), ('heads', 'tensor'))):
    for rows in (1, 2):
      assert jax.eval_shape(f, jax.ShapeDtypeStruct((rows, 4, 16, 16), jnp.float32),
                            w).shape == (rows, 4, 16, 16)


def test_under_a_mesh_a_carried_state_keeps_a_row_s_heads_on_one_device():
  """With a carried state the kernels run under shard_map over the batch axes only (the
  state's gradient sums over every head), the one-head S arrays and the state by row; the
  gradients of q (S's summed into head 0's) and of the initial state trace."""
  mesh = jax.sharding.AbstractMesh((2, 1, 2), ('data', 'fsdp', 'tensor'),
                                   axis_types=(jax.sharding.AxisType.Auto,) * 3)
  table = blockloop.Table.runs([0, 0], [1, 2], 8)
  score = selective._blocked_score(scale=0.25, separate=True, shift=True, relu=True,
                                   mask_bos=True, mask_diag=True, tau=0.5)

  def f(q, carry):
    seg = jnp.ones(q.shape[:1] + (16,), jnp.int32)
    out, _, rows = pallas_gpu.attention((q, q[:, :1]), (q, q[:, :1]), q, seg, seg, None,
                                        table=table, q_block=8, score=score,
                                        dtype=jnp.float32, carry=carry, interpret=True)
    return jnp.sum(out) + jnp.sum(rows)

  q = jax.ShapeDtypeStruct((2, 4, 16, 16), jnp.float32)
  carry = jax.ShapeDtypeStruct((2, 16), jnp.float32)
  with jax.sharding.use_abstract_mesh(mesh), nn.logical_axis_rules(
      (('batch', ('data', 'fsdp')), ('heads', 'tensor'))):
    dq, d_carry = jax.eval_shape(jax.grad(f, argnums=(0, 1)), q, carry)
  assert dq.shape == q.shape and d_carry.shape == carry.shape


GPU_N = 48  # a ragged row: one query tile of 64 (of 16 with a distance table: three)


def _gpu_config(variant, impl, d_model=64):
  return transformer.TransformerConfig.from_config(dict(
      d_model=d_model, n_heads=2, n_layers=2 if variant == 'local_global' else 1, vocab_size=16,
      max_len=GPU_N, attention=variant, attention_impl=impl, attention_block_size=8,
      target_platform='gpu', target_devices=1, dtype='bfloat16',
      position_embedding='none' if variant == 'txl' else 'learned',
      attention_options={variant: OPTIONS.get(variant, {})}))


def _gpu_model(variant, impl):
  return transformer.Decoder(_gpu_config(variant, impl))


# The custom call of a Pallas Triton kernel (jaxlib <= 0.10.2; the FFI call after it).
TRITON_CALL = re.compile(r'custom_call @(__gpu\$xla\.gpu\.triton|triton_kernel_call_ffi)')


@pytest.mark.parametrize('variant', GPU_VARIANTS)
def test_every_supported_variant_s_train_step_lowers_to_triton_kernels(variant):
  """The one-layer model's loss and gradients lowered for CUDA: its attention is the three
  Triton kernels (forward, dq, dk/dv), in every layer."""
  tokens = jax.ShapeDtypeStruct((B, GPU_N), jnp.int32)
  params = jax.eval_shape(lambda: _gpu_model(variant, 'blocksparse').init(
      jax.random.key(0), jnp.zeros((B, 8), jnp.int32))['params'])
  model = _gpu_model(variant, 'pallas')

  segments = jnp.asarray(np.r_[[1] * 20, [2] * 23, [0] * 5][None].repeat(B, 0))
  positions = jnp.asarray(np.r_[np.arange(20), np.arange(23), np.zeros(5, int)][None]
                          .repeat(B, 0))

  def step(params, tokens):
    def fn(params):
      logits, state = model.apply({'params': params}, tokens, positions=positions,
                                  segment_ids=segments, mutable=['losses'])
      aux = sum(jnp.sum(x) for x in jax.tree.leaves(state.get('losses', {})))
      return jnp.sum(logits.astype(jnp.float32) ** 2) + aux
    return jax.value_and_grad(fn)(params)

  text = jax.jit(step).trace(params, tokens).lower(lowering_platforms=('cuda',)).as_text()
  layers = 2 if variant == 'local_global' else 1
  assert len(TRITON_CALL.findall(text)) >= 3 * layers, variant
  kernels = ('fwd', 'dq', 'dkv') + (('states', 'dstates') if variant == 'selective' else ())
  for kernel in kernels:
    assert f'score_hook_gpu_{kernel}' in text, (variant, kernel)
  assert 'mosaic' not in text
  assert transformer.implementations(_gpu_config(variant, 'pallas')) == ['pallas'] * layers


WIDTHS = r'its tiles take head widths that are powers of two of at least 16 \(Triton\), got'


@pytest.mark.parametrize('variant,d_model,why', [
    ('dense', 48, f'{WIDTHS} 24'), ('txl', 16, f'{WIDTHS} 8'), ('selective', 16, f'{WIDTHS} 8')])
def test_what_the_gpu_kernel_cannot_compute_is_refused_with_the_reason(variant, d_model, why):
  """When the config is built: heads that Triton's tiles cannot take."""
  with pytest.raises(ValueError, match=f"Attention: attention_impl='pallas' cannot run on a "
                                       f'GPU: {why}'):
    transformer.implementations(_gpu_config(variant, 'pallas', d_model))
