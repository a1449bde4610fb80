"""Tests for the fused block-sparse CPU kernel (models/attention/cpu_kernel.py).

* The kernel's output, log-sum-exp and gradients (including through the log-sum-exp, which
  merging parts needs) equal a dense masked softmax, for every pattern and the strided parts
  in residue order, packed documents, lengths that 16 does not divide, one or more heads,
  and keys that no query sees (the backward writes dk and dv rather than zeroing them first).
* Each registry name through the module path (attention_impl='cpu_kernel') equals the dense
  reference, outputs and gradients.
* The tile layout covers exactly the allowed pairs; a missing compiler turns the kernel off
  with a warning instead of failing, and `unusable` says why the kernel cannot run where it
  cannot (tests/models/test_implementations.py: what 'auto' and the explicit name do then).
* The built library holds the prefetches that ask for a tile's rows ahead of use (GCC once
  deleted them, finding the helper that issued them free of side effects).

Without a C++ compiler (and no cached build) the tests that call the kernel are skipped, each
with the reason (`pytest -rs`); the layout and fallback tests still run.
"""

import platform
import shutil
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import attention
from models.attention import blocksparse, cpu_kernel, patterns

# The kernel is a CPU custom call: it has no handler on another platform.
pytestmark = pytest.mark.cpu_only


@pytest.fixture(scope='module')
def _kernel_build() -> str | None:
  """Builds (or loads the cached) kernel once: None if it is usable, else why not."""
  try:
    cpu_kernel._load()  # pylint: disable=protected-access
  except cpu_kernel.KernelUnavailable as e:
    return (f'block-sparse CPU kernel unavailable (needs a C++ compiler, g++ or $CXX, or a '
            f'cached build under $ZOO_KERNEL_CACHE): {str(e).splitlines()[0]}')
  return None


@pytest.fixture
def built_kernel(_kernel_build):
  """Skips the test, with the reason, when the kernel cannot be built or loaded. Only the
  tests that call the kernel use it: the layout and the fallback tests run without one."""
  if _kernel_build is not None:
    pytest.skip(_kernel_build)


needs_kernel = pytest.mark.usefixtures('built_kernel')

A1 = blocksparse.HeadView(patterns.Strided(8, 'a1'))
A2 = blocksparse.HeadView(patterns.Strided(8, 'a2'))
# name -> (allowed, residue_stride): every pattern, and the strided parts the model computes
# in residue order.
PATTERNS = {
    'dense': (blocksparse.HeadView(patterns.Dense()), 0),
    'local': (blocksparse.HeadView(patterns.Local(21)), 0),
    'fixed': (blocksparse.HeadView(patterns.Fixed(16, 4)), 0),
    'fixed-a2': (blocksparse.HeadView(patterns.Fixed(8, 3, 'a2')), 0),  # Early queries see nothing.
    'strided': (blocksparse.HeadView(patterns.Strided(8)), 0),
    'strided-a2-residue': (A2, 8),
    'strided-a2-minus-a1-residue': (blocksparse.Minus(A2, A1), 8),
    'block_local': (blocksparse.HeadView(patterns.BlockLocal(12, 5)), 0),
    # No query sees the keys from 20 on: the key tiles past it are in no tile list, and the
    # backward must still write their dk and dv (zeros).
    'early-keys-only': (lambda i, j: (j <= i) & (j < 20), 0),
}
# name -> (the union, its disjoint parts): patterns the kernel computes as several parts in
# one call, merged inside it. Strided as the model runs it (A2 minus A1 in residue order, then
# A1 in sequence order: cpu_kernel.call_order puts residue parts first; the first part gives
# the first queries nothing, which the later part then fills), and fixed in both orders: A2
# minus A1 then A1 (likewise), and A1 then A2 minus A1 (the later part gives the first block
# nothing, which must leave its output as it was).
_F1 = blocksparse.HeadView(patterns.Fixed(16, 4, 'a1'))
_F2 = blocksparse.HeadView(patterns.Fixed(16, 4, 'a2'))
MULTI_PART = {
    'strided-two-parts': (blocksparse.HeadView(patterns.Strided(8)),
                          [(A1, 0), (blocksparse.Minus(A2, A1), 8)]),
    'fixed-two-parts': (blocksparse.HeadView(patterns.Fixed(16, 4)),
                        [(blocksparse.Minus(_F2, _F1), 0), (_F1, 0)]),
    'fixed-two-parts-a1-first': (blocksparse.HeadView(patterns.Fixed(16, 4)),
                                 [(_F1, 0), (blocksparse.Minus(_F2, _F1), 0)]),
}


def _segments(rng, rows, n):
  """Packed documents 1, 2, 3 of random lengths, then trailing padding (id 0)."""
  seg = np.zeros((rows, n), np.int32)
  for r in range(rows):
    cuts = np.sort(rng.choice(np.arange(1, n - 3), size=2, replace=False))
    seg[r, :cuts[0]], seg[r, cuts[0]:cuts[1]], seg[r, cuts[1]:n - 3] = 1, 2, 3
  return jnp.asarray(seg)


def _reference(q, k, v, seg, allowed, scale):
  """Dense masked softmax: (o, lse) with o = 0, lse = NEG_INF for a query that sees no key."""
  n = q.shape[1]
  pair = np.asarray(allowed(np.arange(n)[:, None], np.arange(n)[None, :]), bool)
  mask = (jnp.asarray(pair)[None] & (seg[:, :, None] == seg[:, None, :]))[:, None]  # b1qk
  logits = jnp.where(mask, jnp.einsum('bqhd,bkhd->bhqk', q, k) * scale, -jnp.inf)
  sees = mask.any(-1)
  lse = jax.nn.logsumexp(jnp.where(sees[..., None], logits, 0.0), axis=-1)
  probs = jnp.where(mask, jnp.exp(logits - lse[..., None]), 0.0)
  o = jnp.einsum('bhqk,bkhd->bqhd', probs, v)
  lse = jnp.swapaxes(jnp.where(sees, lse, cpu_kernel.NEG_INF), 1, 2)  # (b, n, h)
  return o, lse, jnp.swapaxes(jnp.broadcast_to(sees, lse.shape[:1] + sees.shape[1:]), 1, 2)


def _names_by_layout_and_shape():
  """Every name in both layouts (the kernel reads rows differently), each with one of the two
  shapes, alternating, so each (layout, shape) pair runs for half the names in CI. The rest of
  the full product (each name in each layout at the other shape) repeats what those cases
  prove, so it runs under -m slow."""
  cases = []
  for layout in ('in_place', 'by_head'):
    for i, name in enumerate(sorted(PATTERNS) + sorted(MULTI_PART)):
      for j, shape in enumerate(_SHAPES):
        marks = () if (i + j + (layout == 'by_head')) % 2 == 0 else pytest.mark.slow
        cases.append(pytest.param(name, *shape, layout, marks=marks,
                                  id=f'{layout}-{shape[0]}-{shape[1]}-{shape[2]}-{name}'))
  return cases


# (n, h, d): a length that 16 does not divide with two heads, and a wider head.
_SHAPES = [(75, 2, 16), (48, 1, 64)]


@needs_kernel
@pytest.mark.parametrize('name,n,h,d,layout', _names_by_layout_and_shape())
def test_kernel_matches_dense_softmax_values_and_gradients(name, n, h, d, layout, monkeypatch):
  # Rows read in the (b, n, h, d) layout, or heads made contiguous first (dense-like layouts).
  monkeypatch.setattr(cpu_kernel, 'STREAM_TILES', 10**9 if layout == 'in_place' else 0)
  _check_against_reference(name, b=2, n=n, h=h, d=d)


# (n, threads) per name: a covering set (every name at both lengths and every thread count;
# every thread count at both lengths). The other 9 cases of the full product run under -m slow.
_RUNS_IN_CI = {'strided-two-parts': {(300, 1), (600, 2), (300, 5)},
               'local': {(600, 1), (300, 2), (600, 5)},
               'fixed-two-parts': {(300, 1), (600, 2), (600, 5)}}


@needs_kernel
@pytest.mark.parametrize('n,threads,name', [
    pytest.param(n, t, name, marks=() if (n, t) in _RUNS_IN_CI[name] else pytest.mark.slow,
                 id=f'{n}-{t}-{name}')
    for n in (300, 600) for t in (1, 2, 5) for name in ('strided-two-parts', 'local',
                                                        'fixed-two-parts')])
def test_kernel_over_several_runs_of_tiles_and_head_groups(name, threads, n, monkeypatch):
  # 300 positions are 19 query tiles (runs of 8 in the forward; two runs of 16 in the
  # backward's two phases), 600 are 38 (three runs of 16: runs 0 and 2 share a phase).
  # Local, strided's parts and fixed's A1 run in two phases; fixed's summary columns are seen
  # from every run, so that part runs by head groups, split by the thread count (1: one
  # group; 2: heads {0, 1} and {2}; 5: one head each).
  monkeypatch.setattr(cpu_kernel, 'STREAM_TILES', 10**9)
  monkeypatch.setattr(cpu_kernel, '_threads', lambda: threads)
  _check_against_reference(name, b=1, n=n, h=3, d=32)


@needs_kernel
# 7 helpers (more than the pool holds) is the harder case; 2 runs under -m slow.
@pytest.mark.parametrize('threads', [pytest.param(2, marks=pytest.mark.slow), 7])
def test_independent_calls_in_one_program_share_xla_thread_pool(threads, monkeypatch):
  # The kernel takes its helper threads from XLA's CPU pool, which may run independent calls
  # at the same time, each asking the same pool for helpers, and may start a helper late or
  # never (7 helpers asked of a pool of fewer threads). Every call must still finish with
  # its own result. Four calls (six before: cheaper to compile, still several at once).
  monkeypatch.setattr(cpu_kernel, '_threads', lambda: threads)
  rng = np.random.default_rng(3)
  n, h, d, calls = 200, 2, 32, 4
  allowed, parts = MULTI_PART['strided-two-parts']
  seg = jnp.ones((1, n), jnp.int32)
  qkv = [tuple(jnp.asarray(rng.normal(size=(1, n, h, d)), jnp.float32) for _ in range(3))
         for _ in range(calls)]

  def total(qkv):
    return sum(jnp.sum(cpu_kernel.attention(q, k, v, seg, parts, scale=0.2)[0] ** 2)
               for q, k, v in qkv)

  def total_ref(qkv):
    return sum(jnp.sum(_reference(q, k, v, seg, allowed, 0.2)[0] ** 2) for q, k, v in qkv)

  got, g_got = jax.jit(jax.value_and_grad(total))(qkv)
  want, g_want = jax.jit(jax.value_and_grad(total_ref))(qkv)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(g_got), jax.tree.leaves(g_want)):
    np.testing.assert_allclose(a, b, atol=5e-5)


def _check_against_reference(name, *, b, n, h, d):
  """The kernel's o, lse and gradients (through both) equal the dense masked softmax."""
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.normal(size=(b, n, h, d)), jnp.float32) for _ in range(3))
  seg = _segments(rng, b, n)
  if name in MULTI_PART:
    allowed, parts = MULTI_PART[name]
  else:
    allowed, residue = PATTERNS[name]
    parts = [(allowed, residue)]
  scale = d ** -0.5
  o_ref, lse_ref, sees = _reference(q, k, v, seg, allowed, scale)
  sees = jnp.broadcast_to(sees, lse_ref.shape)

  def kernel(q, k, v):
    return cpu_kernel.attention(q, k, v, seg, parts, scale=scale)

  o, lse = jax.jit(kernel)(q, k, v)
  np.testing.assert_allclose(o, o_ref, atol=2e-5)
  np.testing.assert_allclose(lse, lse_ref, rtol=1e-5, atol=1e-5)
  if name == 'fixed-a2':
    assert not bool(sees.all())  # Blind queries are covered.

  w_o = jnp.asarray(rng.normal(size=o.shape), jnp.float32)
  w_lse = jnp.where(sees, jnp.asarray(rng.normal(size=lse.shape), jnp.float32), 0.0)

  def loss(fn):
    def f(q, k, v):
      out, l = fn(q, k, v)
      return jnp.sum(out * w_o) + jnp.sum(jnp.where(sees, l, 0.0) * w_lse)
    return jax.jit(jax.grad(f, argnums=(0, 1, 2)))

  want = loss(lambda q, k, v: _reference(q, k, v, seg, allowed, scale)[:2])(q, k, v)
  got = loss(kernel)(q, k, v)
  for g, g_ref, what in zip(got, want, 'qkv'):
    np.testing.assert_allclose(g, g_ref, atol=5e-5, err_msg=f'd{what}')
    assert np.any(np.asarray(g_ref) != 0)


@pytest.mark.parametrize('name', sorted(PATTERNS))
def test_tile_layout_covers_exactly_the_allowed_pairs(name):
  n = 83
  allowed, residue = PATTERNS[name]
  row_ptr, col, mask_id, masks = cpu_kernel.tile_layout(allowed, n, residue)
  order = cpu_kernel.computation_order(n, residue)
  nt = -(-n // 16)
  covered = np.zeros((nt * 16, nt * 16), bool)  # In computation order.
  for t in range(nt):
    for e in range(row_ptr[t], row_ptr[t + 1]):
      u = col[e]
      tile = np.ones((16, 16), bool) if mask_id[e] < 0 else masks[mask_id[e]].T.astype(bool)
      assert tile.any()  # Empty tiles are skipped.
      covered[t * 16:(t + 1) * 16, u * 16:(u + 1) * 16] = tile
  assert not covered[n:].any() and not covered[:, n:].any()
  want = np.asarray(allowed(order[:, None], order[None, :]), bool)
  np.testing.assert_array_equal(covered[:n, :n], want)
  assert len({m.tobytes() for m in masks}) == len(masks)  # One copy per distinct mask.


def test_residue_order_makes_the_strided_part_block_diagonal():
  n, l = 256, 16
  allowed = blocksparse.HeadView(patterns.Strided(l, 'a2'))
  residue_pairs = cpu_kernel.layout_pairs(allowed, n, l)
  assert residue_pairs == l * (n // l) ** 2  # One 16 x 16 tile per residue class.
  assert cpu_kernel.layout_pairs(allowed, n) > 8 * residue_pairs  # Sequence order: thin tiles.


CASES = [  # (name, layer, heads, overrides): every registry name and kind of part.
    ('strided', 0, 2, {'factorization': 'merged'}),  # Band/blocked part + residue part.
    ('strided', 1, 2, {}),                           # A2 alone, per residue class.
    ('fixed', 0, 2, {'factorization': 'multihead', 'distinct_heads': True}),
    ('local', 0, 2, {}),
    ('block_local', 0, 2, {}),
    ('local_global', 0, 2, {}),                      # -m slow: the window 'local' runs.
    ('local_global', 1, 2, {}),                      # The global (dense) layer.
]
_SLOW_CASES = {('local_global', 0)}  # Repeats another case (commented above).
OPTIONS = dict(stride=8, summary=3, factorization='interleave', distinct_heads=False,
               window=11, local_block=8, block_memory=5, global_every=2, key_block=4, band_block=8)


@needs_kernel
@pytest.mark.parametrize('name,layer,heads,overrides', [
    pytest.param(*c, id=f'{c[0]}-{c[1]}-{c[3].get("factorization", "")}',
                 marks=pytest.mark.slow if c[:2] in _SLOW_CASES else ()) for c in CASES])
def test_module_with_kernel_matches_dense_reference(name, layer, heads, overrides):
  n, d = 70, 16
  rng = np.random.default_rng(1)
  seg = _segments(rng, 2, n)
  pos = jnp.broadcast_to(jnp.arange(n), (2, n))
  q, k, v = (jnp.asarray(rng.normal(size=(2, n, heads, d)), jnp.float32) for _ in range(3))

  own = {k: v for k, v in OPTIONS.items() if k in attention.options(name)}  # Its own options.

  def module(impl):
    return attention.get(name)(num_heads=heads, head_dim=d, impl=impl, block_size=16,
                               layer_index=layer,
                               options=tuple(sorted({**own, **overrides}.items())))

  kernel_module = module('cpu_kernel')

  def run(m):
    def f(q, k, v):
      out = m.apply({}, q, k, v, positions=pos, segment_ids=seg, deterministic=True,
                    method='attend')
      return jnp.sum(jnp.where((seg > 0)[..., None, None], out, 0.0) ** 2), out
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(q, k, v)

  (_, want), g_want = run(module('xla'))
  (_, got), g_got = run(kernel_module)
  real = np.asarray(seg > 0)
  np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], atol=2e-5)
  for g, g_ref in zip(g_got, g_want):
    np.testing.assert_allclose(g, g_ref, atol=5e-5)


def test_unusable_says_why(monkeypatch):
  monkeypatch.setattr(cpu_kernel, 'available', lambda: True)
  assert cpu_kernel.unusable(16, 'cpu', 1) is None
  assert 'head_dim' in cpu_kernel.unusable(12, 'cpu', 1)  # A width it is not compiled for.
  assert 'single CPU device' in cpu_kernel.unusable(16, 'cpu', 8)
  assert 'CPU backend only' in cpu_kernel.unusable(16, 'gpu', 1)
  monkeypatch.setattr(cpu_kernel, 'available', lambda: False)
  assert 'compiler' in cpu_kernel.unusable(16, 'cpu', 1)


def test_missing_compiler_turns_the_kernel_off_with_a_warning(monkeypatch, tmp_path, caplog):
  monkeypatch.setenv('ZOO_KERNEL_CACHE', str(tmp_path))
  monkeypatch.setenv('CXX', str(tmp_path / 'no-such-compiler'))
  load, avail = cpu_kernel._load, cpu_kernel.available  # pylint: disable=protected-access
  monkeypatch.setattr(cpu_kernel, '_load', load.__wrapped__)
  monkeypatch.setattr(cpu_kernel, 'available', avail.__wrapped__)
  with pytest.raises(cpu_kernel.KernelUnavailable, match='no-such-compiler'):
    cpu_kernel._load()  # pylint: disable=protected-access
  assert not cpu_kernel.available()
  assert 'plain-JAX path' in caplog.text
  assert not list(tmp_path.glob('*.so'))  # Nothing half-built is left behind.


def test_unwritable_cache_turns_the_kernel_off(monkeypatch, tmp_path):
  blocker = tmp_path / 'a_file'
  blocker.write_text('')
  monkeypatch.setenv('ZOO_KERNEL_CACHE', str(blocker / 'cache'))  # Under a file: no mkdir.
  load = cpu_kernel._load  # pylint: disable=protected-access
  monkeypatch.setattr(cpu_kernel, '_load', load.__wrapped__)
  with pytest.raises(cpu_kernel.KernelUnavailable, match='ZOO_KERNEL_CACHE'):
    cpu_kernel._load()  # pylint: disable=protected-access


@needs_kernel
@pytest.mark.skipif(platform.machine() not in ('x86_64', 'AMD64') or not shutil.which('objdump'),
                    reason='checks x86 instructions with objdump')
def test_library_holds_the_lookahead_prefetches():
  cpu_kernel._load()  # pylint: disable=protected-access
  path = cpu_kernel._library_path()  # pylint: disable=protected-access
  code = subprocess.run(['objdump', '-d', str(path)], capture_output=True, text=True,
                        check=True).stdout
  assert code.count('prefetcht1') > 0
