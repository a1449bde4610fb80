"""The fused CPU kernel timed alone, without the XLA ops and buffers around the call.

  python -m benchmarks.cpu_kernel_alone                 # n = 8K, 1 x 4 heads of 64, 2 threads
  python -m benchmarks.cpu_kernel_alone --n 4096 --threads 1
  python -m benchmarks.cpu_kernel_alone --batch 4 --heads 1  # every row's heads contiguous

Builds benchmarks/cpu_kernel_alone.cc (which includes the kernel source) with the kernel's own
flags and times forward and backward for dense causal attention, a sliding window of w = 128,
the strided pattern (l = 128) as the model computes it (A2 minus A1 in residue order, then A1
in sequence order, one call), that residue part alone, and a window of 1 (one tile per query
row: what is left is per-row work), each on the operands cpu_kernel.parts_layout builds for
the model, in the memory layout cpu_kernel.attention gives it (heads made contiguous for
dense, read in place for the thin patterns). Rows are timed round-robin, best of --rounds,
and compared per computed pair: attention_scaling.py's end-to-end ratios minus these say how
much of a pattern's time is spent outside the kernel.
"""

import argparse
import os
import subprocess
import tempfile


import jax  # noqa: E402

from benchmarks import common  # noqa: E402
from models.attention import blocksparse, cpu_kernel, patterns  # noqa: E402

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'cpu_kernel_alone.cc')
_A1 = blocksparse.HeadView(patterns.Strided(128, 'a1'))
_A2_MINUS_A1 = blocksparse.Minus(blocksparse.HeadView(patterns.Strided(128, 'a2')), _A1)
PATTERNS = {  # name -> kernel parts ((allowed, residue_stride), ...)
    'dense': ((blocksparse.HeadView(patterns.Dense()), 0),),
    'local_128': ((blocksparse.HeadView(patterns.Local(128)), 0),),
    'strided_128': cpu_kernel.call_order(((_A1, 0), (_A2_MINUS_A1, 128))),
    'strided_128_residue_part': ((_A2_MINUS_A1, 128),),
    'window_1': ((blocksparse.HeadView(patterns.Local(1)), 0),),
}


def build(out_dir: str) -> str:
  exe = os.path.join(out_dir, 'cpu_kernel_alone')
  flags = [f for f in cpu_kernel.FLAGS if f not in ('-shared', '-fPIC')]
  subprocess.run([os.environ.get('CXX', 'g++'), *flags, f'-I{jax.ffi.include_dir()}', SOURCE,
                  '-o', exe], check=True)
  return exe


def main():
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument('--n', type=int, default=8192)
  p.add_argument('--batch', type=int, default=1)
  p.add_argument('--heads', type=int, default=4,
                 help='heads interleaved in the (batch, n, heads, 64) operands, as in the model')
  p.add_argument('--threads', type=int, default=2)
  p.add_argument('--rounds', type=int, default=3)
  p.add_argument('--out', default=os.path.join(common.RESULTS, 'cpu_kernel_alone.json'))
  args = p.parse_args()
  with tempfile.TemporaryDirectory() as tmp:
    exe = build(tmp)
    for name, parts in PATTERNS.items():
      os.makedirs(os.path.join(tmp, name))
      layout = cpu_kernel.parts_layout(parts, args.n)
      for array, file in zip(layout, ('order.i32', 'row_ptr.i32', 'col.i32', 'mask_id.i32',
                                      'masks.u8')):
        array.tofile(os.path.join(tmp, name, file))
    # The memory layout cpu_kernel.attention gives each pattern: heads made contiguous
    # (batch * heads rows of one head) for dense-like layouts, the model's own otherwise.
    shapes = {}
    for name, parts in PATTERNS.items():
      tiles = len(cpu_kernel.parts_layout(parts, args.n)[2])
      by_head = tiles > cpu_kernel.STREAM_TILES * -(-args.n // cpu_kernel.TILE)
      shapes[name] = (args.batch * args.heads, 1) if by_head else (args.batch, args.heads)
    best = {name: (float('inf'), float('inf'), 0) for name in PATTERNS}
    for _ in range(args.rounds):
      for name in PATTERNS:
        batch, heads = shapes[name]
        out = subprocess.run([exe, str(args.n), str(batch), str(heads), os.path.join(tmp, name),
                              str(args.threads), '1' if name == 'dense' else '3'],
                             check=True, capture_output=True, text=True).stdout.split()
        fwd, bwd, pairs = float(out[0]), float(out[1]), int(out[2])
        best[name] = (min(best[name][0], fwd), min(best[name][1], bwd), pairs)
  rows = []
  for name, (fwd, bwd, pairs) in best.items():
    rows.append({'pattern': name, 'n': args.n, 'fwd_ms': fwd, 'bwd_ms': bwd,
                 'fwd_bwd_ms': fwd + bwd, 'computed_pairs': pairs,
                 'ns_per_pair': 1e6 * (fwd + bwd) / pairs})
  dense = rows[0]['fwd_bwd_ms']
  for r in rows:
    r['speedup_over_dense'] = dense / r['fwd_bwd_ms']
  common.print_table(rows, ['pattern', 'n', 'fwd_ms', 'bwd_ms', 'ns_per_pair',
                            'speedup_over_dense'])
  common.write_json(args.out, {'config': vars(args), 'rows': rows})


if __name__ == '__main__':
  main()
