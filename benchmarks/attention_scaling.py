"""Time and memory of one attention layer (forward + backward) as the sequence grows.

  python -m benchmarks.attention_scaling                          # n = 1K .. 16K on CPU
  python -m benchmarks.attention_scaling --n 1024 2048 --heads 8

Dense causal attention against each sparse pattern computed block-sparse (l = 128, c = 16,
w = 128; strided and fixed with factorization='merged', one head over A1 | A2), each row the
variant's own `attend` under one model.attention_impl: 'jax' rows run 'blocksparse', the
plain-JAX path that also runs on GPU/TPU (for dense, the causal block engine, which already
skips the blocks above the diagonal); 'kernel' rows run 'cpu_kernel', the fused CPU tile
kernel (models/attention/cpu_kernel.py; for dense, the same kernel on the causal layout, i.e.
flash attention), which attention_impl='auto' picks on one CPU device where it was measured
faster (benchmarks/cpu_choice.py). For each n: the time of
the jitted forward + backward of softmax attention on (batch, n, heads, 64) inputs (best of
--iters rounds; all rows of one n are timed round-robin, each round starting one row later, so
that a slow phase of a shared machine hits them alike; the median is printed too), XLA's
compiled peak memory (arguments + outputs + temporaries), the ideal FLOP ratio (causal pairs /
pairs the pattern allows), the ratio the tiles allow (pairs the fastest dense row computes /
pairs this row computes) and the achieved speedup over the FASTER of the two dense rows
(speedup_over_ideal: best time over best time, divided by the FLOP ratio; paired_over_ideal:
the median over rounds of each round's dense time over this row's, divided by the FLOP ratio).
Targets (CPU): at 8K the achieved speedup is at least 70% of the FLOP ratio; the sparse paths'
memory grows linearly in n.
"""

import argparse
import os
import time


from training import xla_flags  # noqa: E402

xla_flags.set_cpu_defaults()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import common  # noqa: E402
from models import attention  # noqa: E402
from models.attention import blocksparse, cpu_kernel  # noqa: E402

# Row implementation -> model.attention_impl.
IMPLEMENTATIONS = {'jax': 'blocksparse', 'kernel': 'cpu_kernel'}


def module(name: str, impl: str, args):
  """The attention module of a benchmark row (a registry name, a row implementation)."""
  cls = attention.get(name)
  options = dict(stride=args.l, summary=args.c, factorization='merged', distinct_heads=False,
                 window=args.w, local_block=args.l, block_memory=args.l,
                 key_block=args.key_block, band_block=args.band_block)
  declared = attention.options(name)
  return cls(num_heads=args.heads, head_dim=args.head_dim, impl=IMPLEMENTATIONS[impl],
             block_size=args.block,
             options=tuple(sorted((k, v) for k, v in options.items() if k in declared)))


def pattern_parts(name: str, args):
  """(pattern for counting allowed pairs, block-sparse parts) of a benchmark row."""
  m = module(name, 'jax', args)
  return m.head_pattern(0), m.parts(0)


def allowed_pairs(pattern, n: int, chunk: int = 1024) -> int:
  total = 0
  j = np.arange(n)[None, :]
  for s in range(0, n, chunk):
    i = np.arange(s, min(s + chunk, n))[:, None]
    total += int(np.asarray(pattern.allowed(i, j), bool).sum())
  return total


def make_fn(name: str, impl: str, args):
  m = module(name, impl, args)

  def attend(q, k, v, seg):
    pos = jnp.broadcast_to(jnp.arange(q.shape[1]), seg.shape)
    return m.apply({}, q, k, v, positions=pos, segment_ids=seg, deterministic=True,
                   method='attend')

  def loss(q, k, v, seg):
    return jnp.sum(attend(q, k, v, seg) ** 2)

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def kernel_pairs(parts, n: int) -> int:
  """Query-key products of the kernel's 16 x 16 tiles (a residue part in residue order)."""
  return sum(cpu_kernel.layout_pairs(p.allowed, n, p.residue_stride) for p in parts)


def prepare(name: str, impl: str, n: int, args) -> dict:
  """Compiles one row's forward + backward; returns the row with its runner and counts."""
  rng = np.random.default_rng(0)
  shape = (args.batch, n, args.heads, args.head_dim)
  q, k, v = (jnp.asarray(rng.normal(size=shape), jnp.float32) for _ in range(3))
  seg = jnp.ones((args.batch, n), jnp.int32)
  started = time.perf_counter()
  compiled = make_fn(name, impl, args).lower(q, k, v, seg).compile()
  compile_s = time.perf_counter() - started
  mem = compiled.memory_analysis()
  peak = (mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
          if mem is not None else float('nan'))
  run = lambda: jax.block_until_ready(compiled(q, k, v, seg))
  run()  # Warm-up.
  causal = n * (n + 1) // 2
  pattern, parts = pattern_parts(name, args)
  pairs = causal if name == 'dense' else allowed_pairs(pattern, n)
  if impl == 'kernel':
    computed = kernel_pairs(parts, n)
  elif name == 'dense':
    computed = blocksparse.computed_pairs(parts, n, args.block, args.block)
  else:
    computed = blocksparse.computed_pairs(parts, n, args.block, args.key_block, args.band_block)
  return {'pattern': name, 'impl': impl, 'n': n, 'compile_s': compile_s,
          'peak_MiB': peak / 2**20,
          'allowed_pairs': pairs, 'computed_pairs': computed, 'flop_ratio': causal / pairs,
          'run': run, 'times': []}


def time_round_robin(rows: list[dict], rounds: int) -> None:
  """Times every row once per round, rows interleaved, so that slow phases of a shared
  machine hit all rows alike; each row keeps its best and median time. Each round starts one
  row later than the one before: a row right after the long dense one runs slower (strided
  at 8K, best of 12: 52.7 ms after dense, 47.3 after local), and in a fixed order the same
  row always came after it."""
  for i in range(rounds):
    for r in rows[i % len(rows):] + rows[:i % len(rows)]:
      start = time.perf_counter()
      r['run']()
      r['times'].append(time.perf_counter() - start)
  for r in rows:
    del r['run']
    times = r['times']
    r['time_ms'], r['median_ms'] = 1e3 * min(times), 1e3 * float(np.median(times))


COLUMNS = ['pattern', 'impl', 'n', 'compile_s', 'time_ms', 'median_ms', 'peak_MiB', 'flop_ratio',
           'block_ratio', 'speedup', 'speedup_over_ideal', 'paired_over_ideal']


def main():
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument('--n', type=int, nargs='+', default=[1024, 2048, 4096, 8192, 16384])
  p.add_argument('--patterns', nargs='+', default=['strided', 'fixed', 'local', 'block_local'])
  p.add_argument('--batch', type=int, default=1)
  p.add_argument('--heads', type=int, default=4)
  p.add_argument('--head_dim', type=int, default=64)
  p.add_argument('--l', type=int, default=128, help='stride / block length')
  p.add_argument('--c', type=int, default=16, help='fixed: summary cells')
  p.add_argument('--w', type=int, default=128, help='local: window')
  p.add_argument('--block', type=int, default=128, help='query block')
  p.add_argument('--key_block', type=int, default=16, help='key block of the sparse paths')
  p.add_argument('--band_block', type=int, default=64,
                 help='query block of the band path (local, strided A1); 0 = blocked only')
  p.add_argument('--impls', nargs='+', default=['jax', 'kernel'], choices=['jax', 'kernel'],
                 help="'jax': attention_impl='blocksparse' (plain JAX); 'kernel': "
                 "attention_impl='cpu_kernel' (the fused CPU kernel)")
  p.add_argument('--iters', type=int, default=5, help='rounds of round-robin timing')
  p.add_argument('--out', default=os.path.join(common.RESULTS, 'attention_scaling.json'))
  args = p.parse_args()
  if 'kernel' in args.impls and not cpu_kernel.available():
    p.error('the CPU kernel is unavailable (see the warning above); use --impls jax')
  rows = []
  for n in args.n:
    block = [prepare(name, impl, n, args) for name in ['dense'] + args.patterns
             for impl in args.impls]
    time_round_robin(block, args.iters)
    dense = min((r for r in block if r['pattern'] == 'dense'), key=lambda r: r['time_ms'])
    for r in block:
      r['speedup'] = dense['time_ms'] / r['time_ms']
      r['speedup_over_ideal'] = r['speedup'] / r['flop_ratio']
      # The same ratio round by round (dense and this row timed moments apart), median over
      # rounds: less moved by a phase of the machine that only the best times caught.
      paired = np.asarray(dense['times']) / np.asarray(r['times'])
      r['paired_over_ideal'] = float(np.median(paired)) / r['flop_ratio']
    for r in block:
      del r['times']
      # What the tiles allow: the fastest dense row's computed pairs over this row's.
      r['block_ratio'] = dense['computed_pairs'] / r['computed_pairs']
    rows.extend(block)
    common.print_table(block, COLUMNS)
    print(flush=True)
    # After each length: a run cut off by a time limit keeps the lengths it finished.
    common.write_json(args.out, {'config': vars(args), 'backend': jax.default_backend(),
                                 'rows': rows})
  common.print_table(rows, COLUMNS)
  common.write_json(args.out, {'config': vars(args), 'backend': jax.default_backend(),
                               'rows': rows})


if __name__ == '__main__':
  main()
