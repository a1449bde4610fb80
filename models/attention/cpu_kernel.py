"""The CPU kernels: the fused block-sparse attention kernel (kernels/blocksparse_cpu.cc) and
decoding's few-row matmul and in-place cache attention (kernels/decode_cpu.cc, at the end of
this file): build, layout and call.

XLA:CPU runs the many small matmuls of a thin pattern far below its large-matmul speed and
writes every score tile to memory between ops, so on a CPU the plain-JAX block-sparse path
costs several times more per computed pair than dense attention. This kernel computes a
pattern tile by tile (16 queries x 16 keys) with the softmax statistics kept in registers,
forward and backward, through the XLA FFI. The tile layout (which key tiles each query tile
touches, and the 16 x 16 mask of the partial ones) is derived from the pattern's own
`allowed(i, j)` at trace time, like every other path. A pattern made of disjoint parts
computed in different orders (strided: A1 in sequence order, A2 in residue order) is one
call: the kernel merges the parts' softmaxes itself.

The kernels are compiled into one library with the system C++ compiler on first use and
cached under $ZOO_KERNEL_CACHE (default ~/.cache/attention_zoo); the cache key covers the
sources, the flags, the jax version and its XLA FFI headers, and the CPU. Without a compiler
or a writable cache, `available()` is False (with one warning): attention_impl='auto' then
runs the plain-JAX 'blocksparse' path, an explicit attention_impl='cpu_kernel' is refused
(`unusable`), and decoding runs XLA's products.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

TILE = 16
HEAD_DIMS = (16, 32, 64, 128, 256)
NEG_INF = -1e30  # lse of a query that sees no key (the kernel's kEmpty).
# Above this many key tiles per query tile on average, heads are made contiguous first.
STREAM_TILES = 32

KERNELS = Path(__file__).parent / 'kernels'
SOURCE = KERNELS / 'blocksparse_cpu.cc'
# Compiled into one library; cpu_common.h is what they share.
SOURCES = (SOURCE, KERNELS / 'decode_cpu.cc')
HEADERS = (KERNELS / 'cpu_common.h',)
FLAGS = ('-O3', '-march=native', '-std=c++20', '-shared', '-fPIC', '-pthread', '-w',
         '-fno-math-errno', '-fno-trapping-math', '-fassociative-math', '-fno-signed-zeros')
_FORWARD, _BACKWARD = 'zoo_blocksparse_forward', 'zoo_blocksparse_backward'
_SKINNY_MATMUL, _DECODE_ATTENTION = 'zoo_skinny_matmul', 'zoo_decode_attention'
# Most rows skinny_matmul takes (decoding's batch); more go to XLA's dot, which is fast there.
SKINNY_ROWS = 16
# For one row, the fewest weights (K N) it takes: below, XLA's matrix-vector product beats the
# kernel's thread fan-out. Batch-1 greedy decode with every one-row product on XLA / on the
# kernel: d=4 1,140 / 940 tok/s, d=8 180 / 200; with this threshold 1,077 and 189.
SKINNY_ONE_ROW_WEIGHTS = 1 << 20


class KernelUnavailable(RuntimeError):
  """The CPU kernel could not be built or loaded."""


def _cpu_id() -> str:
  try:
    with open('/proc/cpuinfo') as f:
      lines = [l for l in f.read().splitlines() if l.startswith(('model name', 'flags'))]
    return '\n'.join(sorted(set(lines)))
  except OSError:
    return platform.processor()


def cache_dir() -> Path:
  """Where the kernel's builds are kept."""
  return Path(os.environ.get('ZOO_KERNEL_CACHE', Path.home() / '.cache' / 'attention_zoo'))


@functools.cache
def library_key() -> str:
  """The build's cache key: sources, flags, jax and its FFI headers, and the CPU."""
  key = hashlib.sha256()
  for part in (*(f.read_bytes() for f in SOURCES + HEADERS), ' '.join(FLAGS).encode(),
               jax.ffi.include_dir().encode(),
               jax.__version__.encode(), _cpu_id().encode(), platform.machine().encode()):
    key.update(part)
  return key.hexdigest()[:16]


def _library_path() -> Path:
  return cache_dir() / f'blocksparse_cpu_{library_key()}.so'


def _build(path: Path) -> None:
  compiler = os.environ.get('CXX', 'g++')
  # Compile to a temporary file and rename: concurrent processes never load a partial file.
  try:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix='.so', dir=path.parent)
  except OSError as e:
    raise KernelUnavailable(f'cannot write the kernel cache {path.parent} (set '
                            f'ZOO_KERNEL_CACHE to a writable folder): {e}') from e
  os.close(fd)
  cmd = [compiler, *FLAGS, f'-I{jax.ffi.include_dir()}', *map(str, SOURCES), '-o', tmp]
  try:
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
  except OSError as e:
    os.unlink(tmp)
    raise KernelUnavailable(f'cannot run the C++ compiler {compiler!r}: {e}') from e
  if result.returncode != 0:
    os.unlink(tmp)
    names = ', '.join(f.name for f in SOURCES)
    raise KernelUnavailable(f'compiling {names} failed:\n{result.stderr[-2000:]}')
  os.replace(tmp, path)


@functools.cache
def _load() -> None:
  path = _library_path()
  if not path.exists():
    _build(path)
  try:
    lib = ctypes.cdll.LoadLibrary(str(path))
  except OSError as e:
    raise KernelUnavailable(f'cannot load {path}: {e}') from e
  jax.ffi.register_ffi_target(_FORWARD, jax.ffi.pycapsule(lib.ZooBlockSparseForward),
                              platform='cpu')
  jax.ffi.register_ffi_target(_BACKWARD, jax.ffi.pycapsule(lib.ZooBlockSparseBackward),
                              platform='cpu')
  jax.ffi.register_ffi_target(_SKINNY_MATMUL, jax.ffi.pycapsule(lib.ZooSkinnyMatmul),
                              platform='cpu')
  jax.ffi.register_ffi_target(_DECODE_ATTENTION, jax.ffi.pycapsule(lib.ZooDecodeAttention),
                              platform='cpu')


@functools.cache
def available() -> bool:
  """True if the kernel is built and registered (builds it on the first call)."""
  try:
    _load()
    return True
  except KernelUnavailable as e:
    logging.warning('CPU kernel unavailable (block-sparse attention, decoding), '
                    'using the plain-JAX paths: %s', e)
    return False


def supports(head_dim: int) -> bool:
  """True if `head_dim` is one the kernel is compiled for."""
  return head_dim in HEAD_DIMS


def unusable(head_dim: int, backend: str, devices: int) -> str | None:
  """Why the kernel cannot run a layer of `head_dim` on `backend` with `devices` devices, or
  None if it can (which builds it, on the first call: the compiler is checked last)."""
  if backend != 'cpu':
    return f'it runs on the CPU backend only, and this run is on {backend}'
  if devices != 1:
    return (f'it needs a single CPU device, and this run has {devices} (XLA would replicate '
            'the custom call on every device)')
  if not supports(head_dim):
    return f'it is built for head_dim in {HEAD_DIMS}, and model.head_dim is {head_dim}'
  if not available():
    return ('it could not be built (see the warning above: it needs a C++ compiler, g++ or '
            '$CXX, and a writable $ZOO_KERNEL_CACHE)')
  return None


def computation_order(n: int, residue_stride: int = 0) -> np.ndarray:
  """Sequence positions in the kernel's computation order: the identity, or sorted by
  (i mod l, i) so that a part pairing only equal residues becomes block-diagonal."""
  i = np.arange(n)
  return i if not residue_stride else np.lexsort((i, i % residue_stride))


@functools.lru_cache(maxsize=256)
def tile_layout(allowed, n: int, residue_stride: int = 0, chunk: int = 8):
  """(row_ptr, col, mask_id, masks) of `allowed` over n positions in 16 x 16 tiles of the
  computation order (see computation_order).

  Key tiles with no allowed pair are skipped; a tile whose 256 pairs are all allowed gets
  mask_id -1; the others index `masks` (M, 16, 16) uint8, key-major (masks[m, j, i] for key
  j and query i of the tile), one copy per distinct mask. Padding (tile positions >= n) is
  never allowed.
  """
  nt = -(-n // TILE)
  order = computation_order(n, residue_stride)
  pos = np.concatenate([order, np.zeros(nt * TILE - n, order.dtype)])  # Original positions.
  real = np.arange(nt * TILE) < n
  row_ptr, cols, ids = [0], [], []
  mask_index: dict[bytes, int] = {}
  for t0 in range(0, nt, chunk):
    t1 = min(t0 + chunk, nt)
    rows = slice(t0 * TILE, t1 * TILE)
    hit = (np.asarray(allowed(pos[rows, None], pos[None, :]), bool)
           & real[None, :] & real[rows, None])
    tiles = hit.reshape(t1 - t0, TILE, nt, TILE).transpose(0, 2, 1, 3)  # (tq, tk, 16, 16)
    any_pair, all_pairs = tiles.any(axis=(2, 3)), tiles.all(axis=(2, 3))
    for r in range(t1 - t0):
      for u in np.flatnonzero(any_pair[r]):
        cols.append(u)
        if all_pairs[r, u]:
          ids.append(-1)
        else:
          ids.append(mask_index.setdefault(tiles[r, u].T.tobytes(), len(mask_index)))
      row_ptr.append(len(cols))
  masks = np.zeros((max(1, len(mask_index)), TILE, TILE), np.uint8)
  for raw, idx in mask_index.items():
    masks[idx] = np.frombuffer(raw, bool).reshape(TILE, TILE)
  return (np.asarray(row_ptr, np.int32), np.asarray(cols, np.int32),
          np.asarray(ids, np.int32), masks)


@functools.lru_cache(maxsize=64)
def parts_layout(parts: tuple, n: int):
  """The kernel's operands for the disjoint `parts` ((allowed, residue_stride) pairs) over n
  positions: (order (P, n), row_ptr (P, ceil(n / 16) + 1), col, mask_id, masks), each part's
  tile_layout with its col / mask_id entries and mask ids offset into the concatenation."""
  orders, row_ptrs, cols, ids, masks = [], [], [], [], []
  edges = n_masks = 0
  for allowed, residue_stride in parts:
    row_ptr, col, mask_id, m = tile_layout(allowed, n, residue_stride)
    orders.append(computation_order(n, residue_stride).astype(np.int32))
    row_ptrs.append(row_ptr + edges)
    cols.append(col)
    ids.append(np.where(mask_id < 0, -1, mask_id + n_masks).astype(np.int32))
    masks.append(m)
    edges, n_masks = edges + len(col), n_masks + len(m)
  return (np.stack(orders), np.stack(row_ptrs), np.concatenate(cols).astype(np.int32),
          np.concatenate(ids), np.concatenate(masks))


def call_order(parts) -> tuple:
  """`parts` ((allowed, residue_stride) pairs) in the order the kernel computes them:
  residue-order parts first. The first part writes o and dq, and each later one reads them
  back to merge or add, which costs less in sequence order than over rows l positions apart
  (timed alone at 8K, strided 1.01-1.08x faster than with A1 first)."""
  return tuple(sorted(((allowed, int(stride)) for allowed, stride in parts),
                      key=lambda part: part[1] == 0))


def layout_pairs(allowed, n: int, residue_stride: int = 0) -> int:
  """Query-key products the kernel computes for `allowed` over n positions."""
  return len(tile_layout(allowed, n, residue_stride)[1]) * TILE * TILE


def _threads() -> int:
  try:
    return len(os.sched_getaffinity(0))
  except AttributeError:
    return os.cpu_count() or 1


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _attention(q, k, v, seg, parts, scale):
  return _forward(q, k, v, seg, parts, scale)[0]


def _layout_args(parts, n):
  return tuple(jnp.asarray(x) for x in parts_layout(parts, n))


def _forward(q, k, v, seg, parts, scale):
  b, n, h, _ = q.shape
  o, lse = jax.ffi.ffi_call(
      _FORWARD, (jax.ShapeDtypeStruct(q.shape, jnp.float32),
                 jax.ShapeDtypeStruct((b, n, h), jnp.float32)),
      vmap_method='sequential')(q, k, v, seg, *_layout_args(parts, n), scale=np.float32(scale),
                                threads=np.int64(_threads()))
  return (o, lse), (q, k, v, seg, o, lse)


def _backward(parts, scale, res, grads):
  q, k, v, seg, o, lse = res
  do, dlse = grads
  dq, dk, dv = jax.ffi.ffi_call(
      _BACKWARD, tuple(jax.ShapeDtypeStruct(q.shape, jnp.float32) for _ in range(3)),
      vmap_method='sequential')(q, k, v, seg, *_layout_args(parts, q.shape[1]), o, lse, do,
                                dlse, scale=np.float32(scale), threads=np.int64(_threads()))
  return dq, dk, dv, None


_attention.defvjp(_forward, _backward)


def attention(q, k, v, seg, parts, *, scale):
  """Softmax attention over the union of `parts` and equal `seg`, fused on CPU.

  Args:
    q, k, v: (batch, n, heads, head_dim) (any float dtype; computed in float32).
    seg: (batch, n) int document ids.
    parts: disjoint (allowed, residue_stride) pairs, computed in one call: `allowed` is a
      hashable (i, j) -> bool over positions 0..n-1 (tile layouts are cached on it);
      residue_stride l > 0 computes that part in residue order mod l (for parts that only
      pair equal residues, e.g. the strided pattern's A2), 0 in sequence order.
    scale: logit multiplier.

  Returns:
    (o, lse): o (batch, n, heads, head_dim) float32, normalized, zeros for a query that sees
    no key; lse (batch, n, heads) float32 log-sum-exp of its logits (NEG_INF for such a query).
  """
  _load()
  b, n, h, d = q.shape
  if not supports(d):
    raise ValueError(f'the CPU kernel supports head_dim in {HEAD_DIMS}, got {d}')
  parts = call_order(parts)
  if not parts:
    raise ValueError('attention needs at least one part')
  q, k, v = (a.astype(jnp.float32) for a in (q, k, v))
  seg = seg.astype(jnp.int32)
  tiles = len(parts_layout(parts, n)[2])
  if tiles <= STREAM_TILES * -(-n // TILE):
    return _attention(q, k, v, seg, parts, float(scale))

  # A query tile streams many key tiles (dense-like patterns): each head as its own batch row,
  # so that those rows are contiguous. Read in place, h d floats apart, they made dense
  # attention ~1.8x slower at 8K (TLB and prefetch); for thin patterns the transposes and
  # their buffers cost more than they save.
  def by_head(a):
    return jnp.swapaxes(a, 1, 2).reshape(b * h, n, 1, d)

  seg = jnp.broadcast_to(seg[:, None], (b, h, n)).reshape(b * h, n)
  o, lse = _attention(by_head(q), by_head(k), by_head(v), seg, parts, float(scale))
  return (jnp.swapaxes(o.reshape(b, h, n, d), 1, 2),
          jnp.swapaxes(lse.reshape(b, h, n), 1, 2))


def pattern_attention(q, k, v, segment_ids, parts, *, scale: float, dtype):
  """blocksparse.pattern_attention computed by the kernel: softmax over the union of the
  disjoint `parts` (blocksparse.Part: allowed, residue_stride), all in one call.

  Args:
    q, k, v: (batch, length, heads, head_dim).
    segment_ids: (batch, length) document ids; keys of other documents are never seen.
    parts: disjoint blocksparse.Parts whose union is the pattern.
    scale: logit multiplier.
    dtype: dtype of the output (the kernel computes in float32).

  Returns:
    (batch, length, heads, head_dim); a query that sees no key outputs zeros.
  """
  return attention(q, k, v, segment_ids, [(p.allowed, p.residue_stride) for p in parts],
                   scale=scale)[0].astype(dtype)


# Decoding (kernels/decode_cpu.cc). Both are inference-only (no gradient) and run only when
# the computation is compiled for the CPU (lax.platform_dependent): compiled for an
# accelerator, or without the kernel library, they are the plain-JAX products.


def skinny_matmul(x, w, preferred_element_type=None):
  """x (M, K) . w (K, N): on CPU, for M <= SKINNY_ROWS float32 rows (one row only for w of
  SKINNY_ONE_ROW_WEIGHTS or more), by the kernel that streams w once (decoding's per-token
  products); otherwise, and on other platforms, jnp.dot. Same values up to float32 summation
  order. Not differentiable on the kernel path (decoding only)."""
  if (x.ndim != 2 or w.ndim != 2 or x.shape[0] > SKINNY_ROWS or x.dtype != jnp.float32
      or w.dtype != jnp.float32 or (x.shape[0] == 1 and w.size < SKINNY_ONE_ROW_WEIGHTS)
      or not available()):
    return jnp.dot(x, w, preferred_element_type=preferred_element_type)

  def kernel(x, w):
    return jax.ffi.ffi_call(_SKINNY_MATMUL,
                            jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), jnp.float32),
                            vmap_method='sequential')(
                                x, w, threads=np.int64(_threads()))

  return jax.lax.platform_dependent(x, w, cpu=kernel, default=jnp.dot)


def decode_attention(q, k, v, allowed, live, *, scale: float, reference):
  """One decoding step's attention over a cache, read in place on CPU.

  Args:
    q: (batch, heads, head_dim) the step's queries.
    k, v: (batch, heads, capacity, head_dim) the cache.
    allowed: (heads, capacity) bool, the slots each head may attend to.
    live: int32 scalar: slots >= live are empty and not read.
    scale: logit multiplier.
    reference: (q, k, v, allowed, live) -> the same output in plain JAX, what runs on other
      platforms and without the kernel library.

  Returns:
    (batch, heads, head_dim) float32 softmax(scale q . k over the allowed slots) . v, zeros
    for a head that may attend to nothing.
  """
  args = (q, k, v, allowed, live)
  if any(a.dtype != jnp.float32 for a in (q, k, v)) or not available():
    return reference(*args)

  def kernel(q, k, v, allowed, live):
    return jax.ffi.ffi_call(_DECODE_ATTENTION, jax.ShapeDtypeStruct(q.shape, jnp.float32),
                            vmap_method='sequential')(
        q, k, v, allowed.astype(jnp.uint8), jnp.asarray(live, jnp.int32),
        scale=np.float32(scale), threads=np.int64(_threads()))

  return jax.lax.platform_dependent(*args, cpu=kernel, default=reference)
