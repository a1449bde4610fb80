"""What Transformer-XL's memory costs: one attention layer, forward + backward, against dense.

  python -m benchmarks.txl_layer                  # n = 512, M = 0, n, 2n, 4n, plus a window
  python -m benchmarks.txl_layer --seq 256 --batch 4 --impl xla

A whole attention layer (projections, attention, output projection; gradients w.r.t. the
parameters and the input) over a segment of n queries: dense causal attention over the n
positions, and Transformer-XL ('txl') attending into M cached positions of the previous
segments plus the n current ones, with the four-term relative score. The last rows add
attn_window = n at the largest M: each query then multiplies at most n + block keys, however
long the memory. For each row: median time, XLA's compiled peak memory (arguments + outputs +
temporaries) and the time relative to dense.
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
from models.attention import dense, transformer_xl  # noqa: E402


def _layer(name: str, args, mem_len: int = 0, window: int = 0):
  common_fields = dict(num_heads=args.heads, head_dim=args.head_dim, qk_norm=True,
                       impl=args.impl, block_size=args.block, max_len=args.seq)
  if name == 'dense':
    return dense.DenseAttention(**common_fields)
  options = {'mem_len': mem_len, 'eval_mem_len': 0, 'clamp_len': 0, 'same_length': False,
             'attn_window': window}
  return transformer_xl.TransformerXLAttention(options=tuple(sorted(options.items())),
                                               **common_fields)


def bench(name: str, args, mem_len: int = 0, window: int = 0) -> dict:
  rng = np.random.default_rng(0)
  b, n, d_model = args.batch, args.seq, args.heads * args.head_dim
  x = jnp.asarray(rng.normal(size=(b, n, d_model)), jnp.float32)
  ids = jnp.ones((b, n), jnp.int32)
  layer = _layer(name, args, mem_len, window)
  shared = None
  if name == 'txl':
    shared = {k: jnp.asarray(rng.normal(size=(args.heads, args.head_dim)) * 0.1, jnp.float32)
              for k in 'uv'}
    layer = layer.clone(shared=shared)
  variables = nn.unbox(layer.init(jax.random.key(0), x, positions=ids, segment_ids=ids))
  params = variables['params']
  memory = None
  if mem_len:
    memory = {'hidden': jnp.asarray(rng.normal(size=(b, mem_len, d_model)), jnp.float32),
              'segment_ids': jnp.ones((b, mem_len), jnp.int32)}

  def loss(params, x, memory):
    v = {'params': params, **({'memory': memory} if memory is not None else {})}
    out, _ = layer.apply(v, x, positions=ids, segment_ids=ids, mutable=['memory'])
    return jnp.sum(out ** 2)

  fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  compiled = fn.lower(params, x, memory).compile()
  mem = compiled.memory_analysis()
  peak = (mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
          if mem is not None else float('nan'))
  t = common.time_fn(lambda: jax.block_until_ready(compiled(params, x, memory)), warmup=1,
                     iters=args.iters)
  label = 'dense' if name == 'dense' else f'txl M={mem_len}' + (f' w={window}' if window else '')
  return {'layer': label, 'M': mem_len, 'window': window, 'keys_per_segment': mem_len + n,
          'time_ms': 1e3 * t['median_s'], 'best_ms': 1e3 * t['best_s'],
          'peak_MiB': peak / 2**20}


def main():
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument('--seq', type=int, default=512, help='n: queries per segment')
  p.add_argument('--batch', type=int, default=4)
  p.add_argument('--heads', type=int, default=8)
  p.add_argument('--head_dim', type=int, default=32)
  p.add_argument('--block', type=int, default=128, help='query block of the blocked path')
  p.add_argument('--impl', default='blocksparse', choices=['blocksparse', 'xla'])
  p.add_argument('--mem_factors', type=int, nargs='+', default=[0, 1, 2, 4],
                 help='M as multiples of n')
  p.add_argument('--iters', type=int, default=5)
  p.add_argument('--out', default=os.path.join(common.RESULTS, 'txl_layer.json'))
  args = p.parse_args()
  n = args.seq
  rows = [bench('dense', args)]
  rows += [bench('txl', args, mem_len=f * n) for f in args.mem_factors]
  rows.append(bench('txl', args, mem_len=max(args.mem_factors) * n, window=n))
  for r in rows:
    r['time_vs_dense'] = r['time_ms'] / rows[0]['time_ms']
    r['peak_vs_dense'] = r['peak_MiB'] / rows[0]['peak_MiB']
  cols = ['layer', 'keys_per_segment', 'time_ms', 'best_ms', 'time_vs_dense', 'peak_MiB',
          'peak_vs_dense']
  common.print_table(rows, cols)
  common.write_json(args.out, {'config': vars(args), 'backend': jax.default_backend(),
                               'rows': rows})


if __name__ == '__main__':
  main()
