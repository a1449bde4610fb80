"""The fused Pallas kernel with the engine's score hook (models/attention/pallas_kernel.py), in
interpret mode: the kernel a TPU runs, executed as plain JAX on this CPU.

* The plan visits exactly the key blocks a table's chunks touch, and its transpose lists, per
  key block, the query blocks that read it.
* Outputs, log-sum-exps and the gradients of q, k, v and the hook's parameters equal the XLA
  engine (blockloop.attention) and the dense reference, with several documents in a row, at a
  ragged length, in float32 and bfloat16, for a contiguous table whose chunks are not aligned
  to the kernel's key blocks, a gathered one (progressions of another stride), several query
  arrays, and a gate with parameters of its own.
* A state carried across the query blocks (selective attention's F, both bilinear forms, with
  L_mem's row sums) gives the engine's outputs, row sums and gradients, the initial state's
  included; pltpu's race detector finds no race in the kernels whose scratch crosses grid
  steps.
* Two backward runs give bit-identical gradients (no atomics).
* Every registered variant but LSH (which keeps its own path: its keys are sorted by a hash
  drawn per step) trains through the kernel: a one-layer model's loss and every parameter's
  gradient equal those of attention_impl='blocksparse' and of the dense reference 'xla'.

Tolerances are splash's own tests' (float32 1e-5 relative on the outputs, 1e-4 on gradients;
bfloat16 2e-2).
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from models import transformer
from models.attention import blockloop, pallas_kernel, reference, selective

B, N, H, D = 2, 37, 2, 8
SEGMENTS = np.array([[1] * 15 + [2] * 17 + [0] * 5, [3] * 37])
TOL = {jnp.float32: dict(out=1e-5, grad=1e-4), jnp.bfloat16: dict(out=2e-2, grad=2e-2)}


def test_plan_visits_the_key_blocks_of_the_table_and_its_transpose():
  # Chunks of 6 keys from unaligned starts; key blocks of 4.
  table = blockloop.Table.runs([0, 3, 10], [1, 2, 1], 6)
  p = pallas_kernel.plan(table, q_block=8, keys=20, key_block=4)
  assert p.steps.tolist() == [2, 4, 2]  # keys 0-5, 3-14, 10-15
  assert p.kv.tolist() == [[0, 1, 1, 1], [0, 1, 2, 3], [2, 3, 3, 3]]
  assert p.q_steps.tolist() == [2, 2, 2, 2, 0]
  assert p.qs[:4].tolist() == [[0, 1], [0, 1], [1, 2], [1, 2]]
  gathered = blockloop.Table.from_chunks([[0, 4, 8], []], width=4)
  p = pallas_kernel.plan(gathered, q_block=4, keys=40, key_block=8)
  assert p.steps.tolist() == [3, 0] and p.kv[0].tolist() == [0, 2, 4]


def test_stated_cost_counts_the_visited_tiles_and_a_relative_term_s_window():
  """The cost each pallas_call states (what the TPU roofline reads): per visited tile and head,
  QK^T and PV (2 x 16 x 16 x 8 multiply-adds each), and q by the 256-row window of a
  512-row distance table (16 x 256 x 8), in the forward once, in the dq kernel three times.
  The score's products are read from the hook: with Transformer-XL's two query arrays, only
  the first meets the keys (the cost once counted QK^T for both)."""
  p = pallas_kernel.plan(blockloop.Table.runs([0, 0], [1, 2], 16), 16, 32, 16)
  assert p.steps.tolist() == [1, 2]
  v = jax.ShapeDtypeStruct((1, 2, 32, 8), jnp.float32)

  def score(rel, qb, kb, i, j):
    content, position = qb if isinstance(qb, tuple) else (qb, qb)
    logits = jnp.einsum('bhqd,bhkd->bhqk', content, kb, preferred_element_type=jnp.float32)
    return logits + blockloop.relative_term(position, rel, i[0] - j[0], kb.shape[2]), None, None

  for n_q in (1, 2):
    spec = pallas_kernel._Spec(  # pylint: disable=protected-access
        p, score, jnp.float32, jnp.float32, 32, n_q == 2, False, n_q, 1,
        jax.tree.structure(0), 1, (('distance', None),), False, False, True, 0)
    cost = functools.partial(pallas_kernel._cost, spec,  # pylint: disable=protected-access
                             qs=(v,) * n_q, ks=(v,), v=v, leaves=(jnp.zeros((512, 8)),))
    tiles = 3 * 2  # visited tiles x heads
    assert cost('fwd').flops == tiles * (2 * 2 * 16 * 16 * 8 + 2 * 16 * 256 * 8)
    assert cost('dq').flops == tiles * (2 * 3 * 16 * 16 * 8 + 3 * 2 * 16 * 256 * 8)
    assert cost('dkv').flops == tiles * (2 * 4 * 16 * 16 * 8 + 2 * 16 * 256 * 8)
    assert cost('fwd').transcendentals == tiles * 16 * 16


def test_a_tile_s_window_of_the_distance_table_starts_aligned_when_blocks_are_whole_lanes():
  """attention pads a distance table so that pair (0, 0) reads an aligned row: with query and
  key blocks of whole lanes a tile reads B + C rows (Transformer-XL's 512 x 256: 768, where a
  start rounded down anywhere needed 896); blocks of 16 keep 127 rows of slack at most. A
  table read whole either way is not padded (the padding would only lengthen it)."""
  plan = lambda b, c: pallas_kernel.plan(blockloop.Table.runs([0], [1], b), b, c, c)  # noqa
  window = lambda b, c, **kw: pallas_kernel.window_rows(plan(b, c), 4096, **kw)  # noqa: E731
  assert window(512, 256) == 768 and window(256, 256) == 512
  assert window(512, 256, aligned=False) == 896
  assert window(16, 16) == 256 and window(384, 128) == 512 and window(64, 128) == 256
  lead = pallas_kernel._distance_lead  # pylint: disable=protected-access
  assert lead(plan(512, 256), 8704, 8191) == 1      # adaptive span's S = 8,192 table
  assert lead(plan(256, 256), 300, 255) is None     # read whole: 384 rows, not 512


def test_a_batch_the_mesh_cannot_split_is_computed_whole_on_each_device():
  """A model's init traces one row under the run's mesh: with the batch over 2 devices the
  kernel's shard_map leaves that batch unsplit (2 processes of main.py stopped at the start
  with "2 does not evenly divide 1"); a batch of 2 is split."""
  mesh = jax.sharding.AbstractMesh((2, 1, 2), ('data', 'fsdp', 'tensor'),
                                   axis_types=(jax.sharding.AxisType.Auto,) * 3)
  table = blockloop.Table.runs([0, 0], [1, 2], 8)

  def score(params, qb, kb, i, j):
    del params
    logits = blockloop.head_einsum('bhqd,bhkd->bhqk', qb, kb, preferred_element_type=jnp.float32)
    return logits, (j[None, :] <= i[:, None])[None, None], None

  def f(q):
    seg = jnp.ones(q.shape[:1] + (16,), jnp.int32)
    return pallas_kernel.attention(q, q, q, seg, seg, None, table=table, q_block=8, score=score,
                                   dtype=jnp.float32, interpret=True)[0]

  with jax.sharding.use_abstract_mesh(mesh), nn.logical_axis_rules(
      (('batch', ('data', 'fsdp')), ('heads', 'tensor'))):
    for rows in (1, 2):
      assert jax.eval_shape(f, jax.ShapeDtypeStruct((rows, 4, 16, 8), jnp.float32)).shape == (
          rows, 4, 16, 8)


def _inputs(dtype):
  keys = jax.random.split(jax.random.key(0), 6)
  q, q2, k, v = (jax.random.normal(x, (B, H, N, D)).astype(dtype) for x in keys[:4])
  w = jax.random.normal(keys[4], (H,))
  return q, q2, k, v, w


def _pattern(i, j):
  """Causal: the 9 latest keys and the first half of every 8 (two progressions a row)."""
  return (j <= i) & (((i - j) < 9) | (j % 8 < 4))


def _tables():
  nq = -(-N // 8)
  # Chunks of 6 keys from position -3: not aligned to the kernel's key blocks of 8.
  causal = blockloop.Table.runs(np.zeros(nq) - 3, -(-(8 * np.arange(1, nq + 1) + 3) // 6), 6)
  allowed = _pattern(np.arange(N)[:, None], np.arange(N)[None, :])
  touched = np.pad(allowed, ((0, 0), (0, -N % 4))).reshape(N, -1, 4).any(-1)  # (N, chunks)
  chunks = [np.flatnonzero(touched[b * 8:(b + 1) * 8].any(0)) for b in range(nq)]
  return {'contiguous': causal, 'gathered': blockloop.Table.from_chunks(chunks, 4)}


def _score(params, qb, kb, i, j):
  """Two query arrays, a relative bias per head and a gate (all differentiated)."""
  qa, qc = qb
  logits = jnp.einsum('bhqd,bhkd->bhqk', qa + 0.5 * qc, kb,
                      preferred_element_type=jnp.float32) * D ** -0.5
  x = (i[:, None] - j[None, :]).astype(jnp.float32)
  logits = logits + params[None, :, None, None] * x * 0.05
  gate = jax.nn.sigmoid(params[None, :, None, None] + 0.1 * x)
  return logits, _pattern(i[:, None], j[None, :])[None, None], gate


def _dense(q, q2, k, v, w):
  """The dense reference of _score: the same weights over every allowed pair."""
  i, j = np.arange(N)[:, None], np.arange(N)[None, :]
  logits, live, gate = _score(w, (q, q2), k, jnp.arange(N), jnp.arange(N))
  seg = jnp.asarray(SEGMENTS)
  live = live & (seg[:, None, :, None] == seg[:, None, None, :]) & (j <= i)
  top = jnp.max(jnp.where(live, logits, reference.NEG_INF), -1, keepdims=True)
  e = jnp.where(live, jnp.exp(logits - top), 0.0) * gate
  total = jnp.sum(e, -1)
  out = jnp.einsum('bhqk,bhkd->bhqd', e / jnp.where(total > 0, total, 1)[..., None],
                   v.astype(jnp.float32))
  return out, jnp.where(total > 0, top[..., 0] + jnp.log(jnp.where(total > 0, total, 1)),
                        reference.NEG_INF)


def _run(kernel, table, dtype, interpret=True):
  def f(q, q2, k, v, w):
    kw = dict(table=table, q_block=8, score=_score, dtype=dtype, out_dtype=jnp.float32)
    if kernel == 'pallas':
      kw.update(kernel='pallas', interpret=interpret)
    seg = jnp.asarray(SEGMENTS)
    return blockloop.attention((q, q2), k, v, seg, seg, w, **kw)

  def loss(*args):
    out, lse = f(*args)
    return jnp.sum(jnp.sin(out)) + 0.1 * jnp.sum(jnp.where(lse > -1e9, lse, 0.0))

  return jax.jit(lambda *a: (f(*a), jax.grad(loss, argnums=range(5))(*a)))


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize('form', ['contiguous', 'gathered'])
def test_outputs_and_gradients_equal_the_engine(form, dtype):
  table = _tables()[form]
  args = _inputs(dtype)
  tol = TOL[dtype]
  with jax.default_matmul_precision('highest'):
    (out, lse), grads = _run('pallas', table, dtype)(*args)
    (want_out, want_lse), want_grads = _run('xla', table, dtype)(*args)
  if form == 'contiguous':  # The table covers every causal pair: the dense reference too.
    with jax.default_matmul_precision('highest'):
      ref_out, ref_lse = _dense(*args)
    np.testing.assert_allclose(out, ref_out, atol=tol['out'] * 10, rtol=tol['out'] * 10)
    np.testing.assert_allclose(lse, ref_lse, rtol=tol['out'] * 10)
  np.testing.assert_allclose(out, want_out, atol=tol['out'], rtol=tol['out'])
  np.testing.assert_allclose(lse, want_lse, atol=tol['out'], rtol=tol['out'])
  for got, want in zip(grads, want_grads):
    assert got.dtype == want.dtype
    scale = float(jnp.max(jnp.abs(want.astype(jnp.float32)))) or 1.0
    np.testing.assert_allclose(np.asarray(got, np.float32) / scale,
                               np.asarray(want, np.float32) / scale, atol=tol['grad'])


def test_backward_is_deterministic():
  table = _tables()['gathered']
  args = _inputs(jnp.float32)
  run = _run('pallas', table, jnp.float32)
  first, second = run(*args)[1], run(*args)[1]
  for a, b in zip(first, second):
    np.testing.assert_array_equal(a, b)


MEMORY, TABLE_ROWS = 360, 400  # keys m + N: distances up to 396 over a 400-row table


def _relative(kernel, per_head, block=16):
  """An adaptive-span-like score over a memory: q . k + q . table[x - 1] at distances x in
  [1, 400] (blockloop.relative_term), the table shared or one per head."""
  keys = MEMORY + N
  chunks = blockloop.Table.runs(np.zeros(-(-N // block)),
                                np.full(-(-N // block), -(-keys // block)), block)
  seg_q = jnp.asarray(SEGMENTS)
  seg_k = jnp.concatenate([jnp.full((B, MEMORY), 3), seg_q.at[0].set(3)], axis=1)
  seg_q = seg_q.at[0].set(3)
  engine = dict(kernel='pallas', interpret=True, distance_origin=MEMORY - 1,
                param_axes=('heads', 'distance', None) if per_head else ('distance', None)
                ) if kernel == 'pallas' else {}

  def score(rel, qb, kb, i, j):
    x = (MEMORY + i)[:, None] - j[None, :]
    logits = jnp.einsum('bhqd,bhkd->bhqk', qb, kb, preferred_element_type=jnp.float32)
    logits = logits + blockloop.relative_term(qb, rel, MEMORY + i[0] - j[0] - 1, kb.shape[2])
    return logits * D ** -0.5, ((x >= 1) & (x <= TABLE_ROWS))[None, None], None

  def f(q, k, v, rel):
    return blockloop.attention(q, k, v, seg_q, seg_k, rel, table=chunks, q_block=block,
                               score=score, dtype=jnp.float32, **engine)

  def loss(*args):
    out, lse = f(*args)
    return jnp.sum(jnp.sin(out)) + 0.1 * jnp.sum(jnp.where(lse > -1e9, lse, 0.0))

  return jax.jit(lambda *a: (f(*a), jax.grad(loss, argnums=range(4))(*a)))


@pytest.mark.parametrize('per_head,block', [(False, 16), (True, 128)])
def test_a_long_distance_table_is_read_by_windows_with_the_engine_s_results(per_head, block):
  """A tile reads only the rows of a distance table its pairs reach (400 rows: windows of 256
  from every aligned start, clipped at both ends); outputs and gradients, the table's
  included, equal the engine's. Blocks of 16 read the table as it is; blocks of 128 read it
  after 25 zero rows that align every window (B + C = 256 rows, where unaligned tiles need
  384)."""
  assert (pallas_kernel._distance_lead(  # pylint: disable=protected-access
      pallas_kernel.plan(blockloop.Table.runs([0], [1], block), block, block, block),
      TABLE_ROWS, MEMORY - 1) is None) == (block == 16)
  assert pallas_kernel.window_rows(pallas_kernel.plan(
      blockloop.Table.runs([0], [1], 16), 16, 16, 16), 512) == 256
  keys = jax.random.split(jax.random.key(3), 4)
  q = jax.random.normal(keys[0], (B, H, N, D))
  k, v = (jax.random.normal(x, (B, H, MEMORY + N, D)) for x in keys[1:3])
  shape = (H, TABLE_ROWS, D) if per_head else (TABLE_ROWS, D)
  table = jax.random.normal(keys[3], shape)
  with jax.default_matmul_precision('highest'):
    got, got_grads = _relative('pallas', per_head, block)(q, k, v, table)
    want, want_grads = _relative('xla', per_head, block)(q, k, v, table)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
  for a, b in zip(got_grads, want_grads):
    scale = float(jnp.max(jnp.abs(b)))
    np.testing.assert_allclose(a / scale, b / scale, atol=1e-4)


def _selective(kernel, *, separate, shift, interpret=True):
  score = selective._blocked_score(  # pylint: disable=protected-access
      scale=D ** -0.5, separate=separate, shift=shift, relu=True, mask_bos=True,
      mask_diag=False, tau=1.0)
  nq = -(-N // 8)
  table = blockloop.Table.runs(np.zeros(nq), np.arange(1, nq + 1), 8)
  seg = jnp.asarray(SEGMENTS)
  engine = dict(kernel='pallas', interpret=interpret) if kernel == 'pallas' else {}

  def f(q, k, v, sq, sk, c):
    qs, ks = ((q, sq), (k, sk)) if separate else (q, k)
    return blockloop.attention(qs, ks, v, seg, seg, None, table=table, q_block=8, score=score,
                               dtype=jnp.float32, carry=c, **engine)

  def loss(*args):
    out, _, rows = f(*args)
    return jnp.sum(jnp.sin(out)) + 0.3 * jnp.sum(rows)

  return jax.jit(lambda *a: (f(*a), jax.grad(loss, argnums=range(6))(*a)))


@pytest.mark.parametrize('separate,shift', [(False, True), (True, False)])
def test_a_carried_state_gives_the_engine_s_outputs_rows_and_gradients(separate, shift):
  keys = jax.random.split(jax.random.key(1), 6)
  q, k, v = (jax.random.normal(x, (B, H, N, D)) for x in keys[:3])
  sq, sk = (jax.random.normal(x, (B, 1, N, 4)) for x in keys[3:5])
  carry = jax.random.uniform(keys[5], (B, N))
  with jax.default_matmul_precision('highest'):
    got, got_grads = _selective('pallas', separate=separate, shift=shift)(q, k, v, sq, sk, carry)
    want, want_grads = _selective('xla', separate=separate, shift=shift)(q, k, v, sq, sk, carry)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
  for a, b in zip(got_grads, want_grads):
    np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)


@pytest.fixture
def race_verdicts(monkeypatch):
  """pltpu's race detector's state of every kernel call (it keeps only the latest's)."""
  # pylint: disable-next=import-outside-toplevel
  from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc
  created = []
  make = ipc.RaceDetectionState

  def record(*args, **kwargs):
    created.append(make(*args, **kwargs))
    return created[-1]

  monkeypatch.setattr(ipc, 'RaceDetectionState', record)
  return created


# Two simulated cores: a grid axis marked 'parallel' runs split between them.
RACES = pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2)


def test_no_race_where_scratch_crosses_grid_steps(race_verdicts):
  """The race detector over the stateful forward and backward (state, G, dk and dv resident
  across a row's grid steps) and the stateless ones (running statistics, dq, the parameters'
  gradient resident across the whole grid), on two simulated cores."""
  keys = jax.random.split(jax.random.key(2), 3)
  q, k, v = (jax.random.normal(x, (B, H, N, D)) for x in keys)
  _selective('pallas', separate=False, shift=True, interpret=RACES)(q, k, v, q, k,
                                                                    jnp.zeros((B, N)))
  _run('pallas', _tables()['gathered'], jnp.float32, interpret=RACES)(*_inputs(jnp.float32))
  assert len(race_verdicts) >= 5  # every kernel of both: 2 forwards, 3 backwards
  assert not any(r.races_found for r in race_verdicts)


@pytest.mark.slow
def test_race_detector_sees_a_gradient_shared_by_parallel_rows(race_verdicts, monkeypatch):
  """The check above can fail: with every grid axis parallel, the batch rows' cores add to
  the one resident block of the hook parameters' gradient at once. In the slow tier: it tests
  the detector, not the kernels (10 s of CI)."""
  monkeypatch.setattr(pallas_kernel, '_compiler_params', lambda sequential_axes: (
      pltpu.CompilerParams(dimension_semantics=('parallel',) * 3)))
  _run('pallas', _tables()['gathered'], jnp.float32, interpret=RACES)(*_inputs(jnp.float32))
  assert any(r.races_found for r in race_verdicts)


VARIANTS = ('dense', 'strided', 'fixed', 'local', 'block_local', 'local_global',
            'adaptive_span', 'dynamic_span', 'txl', 'selective')
_BLOCKS = dict(key_block=4, band_block=4)
OPTIONS = {'strided': dict(stride=4, factorization='merged', **_BLOCKS),
           'fixed': dict(stride=4, summary=2, factorization='merged', **_BLOCKS),
           'local': dict(window=5, **_BLOCKS),
           'local_global': dict(window=5, global_every=2, **_BLOCKS),
           'block_local': dict(_BLOCKS),
           'adaptive_span': dict(limit=24, ramp=4, init=0.5, trim_multiple=8),
           'dynamic_span': dict(limit=24, ramp=4, trim_multiple=8),
           'txl': dict(mem_len=0),
           'selective': dict(lmem_eps=0.1)}


@functools.lru_cache(maxsize=None)
def _model(variant, impl):
  cfg = transformer.TransformerConfig.from_config(dict(
      d_model=16, n_heads=2, n_layers=2 if variant == 'local_global' else 1, vocab_size=16,
      max_len=N, attention=variant, attention_impl=impl, attention_block_size=8,
      target_platform='cpu', position_embedding='none' if variant == 'txl' else 'learned',
      attention_options={variant: OPTIONS.get(variant, {})}))
  return transformer.Decoder(cfg)


@pytest.mark.parametrize('variant', VARIANTS)
def test_every_variant_trains_through_the_kernel(variant):
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 16, (B, N)))
  segments = jnp.asarray(SEGMENTS)
  positions = jnp.asarray(np.r_[np.arange(15), np.arange(17), np.zeros(5, int)][None]
                          .repeat(B, 0))
  params = _model(variant, 'blocksparse').init(jax.random.key(0), tokens[:, :8])['params']

  def loss(impl):
    def fn(params):
      logits, state = _model(variant, impl).apply(
          {'params': params}, tokens, positions=positions, segment_ids=segments,
          mutable=['losses'])
      aux = sum(jnp.sum(x) for x in jax.tree.leaves(state.get('losses', {})))
      return jnp.sum(jnp.sin(logits)) + aux
    return jax.jit(jax.value_and_grad(fn))

  with jax.default_matmul_precision('highest'):
    value, grads = loss('pallas')(params)
    for reference_impl in ('blocksparse', 'xla'):  # the engine's loops; the dense reference
      want, want_grads = loss(reference_impl)(params)
      np.testing.assert_allclose(value, want, rtol=1e-5, err_msg=reference_impl)
      for got, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
        # The reference sums whole rows in another order: float32 error at the gradient's
        # scale (up to ~700 here) as well.
        atol = 1e-4 + (1e-6 * float(np.max(np.abs(ref))) if reference_impl == 'xla' else 0.0)
        np.testing.assert_allclose(got, ref, atol=atol, rtol=1e-4, err_msg=reference_impl)
