"""What trimming buys: one adaptive-span attention layer at several trimmed spans T.

  python -m benchmarks.adaptive_span                       # S = 1024, segment 256, T = 64..S
  python -m benchmarks.adaptive_span --limit 4096 --seq 512

Forward + backward of `adaptive_span.span_attention` (soft mask, relative positions) for a
segment of `--seq` queries attending into the previous segments' cache, when every head's span
is at most T - R (so T keys are computed per query), against the untrimmed T = S. For each T:
median time, XLA's compiled peak memory and the attention FLOPs per token. Outputs are
identical across T (checked here too); only the work changes.
"""

import argparse
import os


from training import xla_flags  # noqa: E402

xla_flags.set_cpu_defaults()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import common  # noqa: E402
from models.attention import adaptive_span  # noqa: E402


def bench(trim: int, args, inputs) -> dict:
  q, k, v, q_seg, k_seg, rel, z = inputs
  memory = k.shape[1] - q.shape[1]

  def loss(q, k, v, rel, z):
    # Only the last `trim` cached positions are projected in the model; slice them here.
    ks, vs, segs = k[:, memory - trim:], v[:, memory - trim:], k_seg[:, memory - trim:]
    out = adaptive_span.span_attention(q, ks, vs, q_seg, segs, rel, z, ramp=args.ramp,
                                       span=trim, block=args.block,
                                       scale=args.head_dim ** -0.5, dtype=jnp.float32,
                                       keep_layers=1)
    return jnp.sum(out ** 2), out

  fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))
  compiled = fn.lower(q, k, v, rel, z).compile()
  mem = compiled.memory_analysis()
  peak = (mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
          if mem is not None else float('nan'))
  t = common.time_fn(lambda: jax.block_until_ready(compiled(q, k, v, rel, z)), warmup=1,
                     iters=args.iters)
  (_, out), _ = compiled(q, k, v, rel, z)
  flops = 4 * args.heads * args.head_dim * trim  # q.(k + p) and a.v per query, per key
  return {'T': trim, 'time_ms': 1e3 * t['median_s'], 'peak_MiB': peak / 2**20,
          'attn_flops_per_token': flops, 'out': np.asarray(out)}


def main():
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument('--limit', type=int, default=1024, help='S')
  p.add_argument('--ramp', type=int, default=32, help='R')
  p.add_argument('--seq', type=int, default=256, help='queries per segment')
  p.add_argument('--batch', type=int, default=8)
  p.add_argument('--heads', type=int, default=8)
  p.add_argument('--head_dim', type=int, default=32)
  p.add_argument('--block', type=int, default=64, help='query block')
  p.add_argument('--trims', type=int, nargs='+', default=[64, 128, 256, 512, 1024])
  p.add_argument('--iters', type=int, default=5)
  p.add_argument('--out', default=os.path.join(common.RESULTS, 'adaptive_span.json'))
  args = p.parse_args()
  rng = np.random.default_rng(0)
  b, n, h, d, s = args.batch, args.seq, args.heads, args.head_dim, args.limit
  q = jnp.asarray(rng.normal(size=(b, n, h, d)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(b, s + n, h, d)), jnp.float32) for _ in 'kv')
  q_seg = jnp.ones((b, n), jnp.int32)
  k_seg = jnp.ones((b, s + n), jnp.int32)
  rel = jnp.asarray(rng.normal(size=(s, d)), jnp.float32)
  z = jnp.full((h,), float(min(args.trims) - args.ramp))  # Every T below computes all weights.
  inputs = (q, k, v, q_seg, k_seg, rel, z)
  rows = [bench(t, args, inputs) for t in sorted(set(args.trims + [s]))]
  full, full_out = rows[-1], rows[-1]['out']
  for r in rows:
    r['speedup_vs_full'] = full['time_ms'] / r['time_ms']
    r['max_abs_diff_vs_full'] = float(np.abs(r.pop('out') - full_out).max())
  cols = ['T', 'time_ms', 'speedup_vs_full', 'peak_MiB', 'attn_flops_per_token',
          'max_abs_diff_vs_full']
  common.print_table(rows, cols)
  common.write_json(args.out, {'config': vars(args), 'backend': jax.default_backend(),
                               'rows': rows})


if __name__ == '__main__':
  main()
