"""LSH attention against dense: one attention layer, forward + backward, as n grows.

  python -m benchmarks.lsh_scaling                      # n = 1K .. 16K, 1 / 2 / 4 rounds
  python -m benchmarks.lsh_scaling --n 1024 2048 --hashes 1 --dense_impls blocksparse

A whole attention layer (projections, attention, output projection; gradients w.r.t. the
parameters and the input) over n positions, batch 1, 4 heads of 64: dense causal attention
under each of --dense_impls ('cpu_kernel' is flash attention on the causal tile layout, the
fastest dense path on one CPU device; 'blocksparse' the plain-JAX causal block engine; 'xla'
the n x n einsum), and 'lsh' (shared-QK, chunks of --chunk_len, n_buckets = n / chunk_len as
in the paper, so a bucket holds about one chunk) with 1, 2 and 4 hash rounds. For each row:
the best and median time, XLA's compiled peak memory (arguments + outputs + temporaries) and
the time relative to the fastest dense row of the same n. A row whose memory would not fit
(--max_gib, XLA's own estimate) is skipped and says so.
"""

import argparse
import os


from training import xla_flags  # noqa: E402

xla_flags.set_cpu_defaults()

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import common  # noqa: E402
from models.attention import dense, lsh  # noqa: E402


def _layer(name: str, impl: str, n: int, args, n_hashes: int = 1):
  fields = dict(num_heads=args.heads, head_dim=args.head_dim, qk_norm=True, impl=impl,
                block_size=args.block, max_len=n)
  if name == 'dense':
    return dense.DenseAttention(**fields)
  options = {'n_buckets': max(2, 2 * (n // args.chunk_len // 2)), 'n_hashes': n_hashes,
             'chunk_len': args.chunk_len}
  return lsh.LSHAttention(options=tuple(sorted(options.items())), **fields)


def bench(name: str, impl: str, n: int, args, n_hashes: int = 1) -> dict:
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(1, n, args.heads * args.head_dim)), jnp.float32)
  ids = jnp.ones((1, n), jnp.int32)
  layer = _layer(name, impl, n, args, n_hashes)
  params = nn.unbox(layer.init(jax.random.key(0), x, positions=ids, segment_ids=ids))['params']
  rngs = {'lsh': jax.random.key(1)} if name == 'lsh' else None

  def loss(p, x):
    return jnp.sum(layer.apply({'params': p}, x, positions=ids, segment_ids=ids, rngs=rngs) ** 2)

  compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x).compile()
  mem = compiled.memory_analysis()
  peak = mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
  row = {'attention': name if name == 'dense' else f'lsh x{n_hashes}', 'impl': impl, 'n': n,
         'peak_MiB': peak / 2**20}
  if peak > args.max_gib * 2**30:
    row['skipped'] = f'needs {peak / 2**30:.1f} GiB'
    return row
  t = common.time_fn(lambda: jax.block_until_ready(compiled(params, x)), warmup=1,
                     iters=args.iters)
  row.update(time_ms=1e3 * t['best_s'], median_ms=1e3 * t['median_s'])
  return row


def main():
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument('--n', type=int, nargs='+', default=[1024, 2048, 4096, 8192, 16384])
  p.add_argument('--hashes', type=int, nargs='+', default=[1, 2, 4])
  p.add_argument('--dense_impls', nargs='+', default=None,
                 help="dense rows' implementations (default: cpu_kernel and blocksparse on "
                      "CPU; on GPU 'fused', XLA's attention: cuDNN's flash kernel takes bf16 "
                      "only, and blocksparse's per-block program compiles for minutes at 16K)")
  p.add_argument('--chunk_len', type=int, default=64)
  p.add_argument('--heads', type=int, default=4)
  p.add_argument('--head_dim', type=int, default=64)
  p.add_argument('--block', type=int, default=128, help='query block of blocksparse')
  p.add_argument('--iters', type=int, default=3)
  p.add_argument('--max_gib', type=float, default=12.0)
  p.add_argument('--out', default=os.path.join(common.RESULTS, 'lsh_scaling.json'))
  args = p.parse_args()
  impls = args.dense_impls or (['fused'] if jax.default_backend() == 'gpu'
                               else ['cpu_kernel', 'blocksparse'])
  rows = []
  for n in args.n:
    group = [bench('dense', impl, n, args) for impl in impls]
    group += [bench('lsh', 'blocksparse', n, args, h) for h in args.hashes]
    fastest = min((r['time_ms'] for r in group if r['attention'] == 'dense' and 'time_ms' in r),
                  default=None)
    for r in group:
      if fastest and 'time_ms' in r:
        r['vs_dense'] = r['time_ms'] / fastest
      print({k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items()}, flush=True)
    rows += group
  common.print_table(rows, ['attention', 'impl', 'n', 'time_ms', 'median_ms', 'peak_MiB',
                            'vs_dense', 'skipped'])
  common.write_json(args.out, {'args': vars(args), 'rows': rows})


if __name__ == '__main__':
  main()
