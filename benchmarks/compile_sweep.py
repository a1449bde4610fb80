"""Compile time and per-chip memory of the blocked attention paths as the sequence grows,
for a TPU slice, this checkout against an earlier commit in the same run.

  python -m benchmarks.compile_sweep                        # this checkout only
  python -m benchmarks.compile_sweep --before b39f426       # and the commit before the loops

Each row is one child process of benchmarks/tpu_compile.py (the --mode=compile code path:
the run's train step compiled by libtpu for the topology, from this host, nothing run) for
one (version, variant, sequence length): a 1-layer model (configs/default.py at --d) with
model.attention_impl='blocksparse' (the plain-JAX blocked path: what 'auto' runs for every
variant on a GPU, and on a TPU for the variants without a static pattern; splash, which a TPU
runs for static patterns, is a kernel call and flat by construction), global batch --batch
over a data-parallel mesh. A child that does not finish in --timeout seconds is recorded as
such: that is the finding for an unrolled program at long sequences.

--before checks the commit out with `git worktree` under a temporary folder and runs the same
rows there. Columns: compile seconds, GiB per chip, whether it fits. Results go to
results/compile_sweep.json (written after each row).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


from benchmarks import common  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = ('strided', 'fixed', 'local', 'selective', 'adaptive_span')
COLUMNS = ('version', 'variant', 'seq_len', 'compile_s', 'gib_per_chip', 'fits', 'error')


def child_row(tree: str, args, variant: str, seq_len: int) -> dict:
  """tpu_compile.py of `tree` for one variant and length, in a child with a time limit."""
  with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, 'row.json')
    # As a module from the tree's root, so that it imports that tree's code.
    cmd = [sys.executable, '-m', 'benchmarks.tpu_compile',
           '--topologies', args.topology, '--variants', variant, '--seq-len', str(seq_len),
           '--d', str(args.d), '--batch', str(args.batch), '--impl', 'blocksparse',
           '--stack', 'auto', '--dtype', args.dtype, '--out', out]
    start = time.perf_counter()
    try:
      proc = subprocess.run(cmd, cwd=tree, capture_output=True, text=True, timeout=args.timeout,
                            check=False)
    except subprocess.TimeoutExpired:
      return {'error': f'did not compile in {args.timeout} s', 'wall_s': args.timeout}
    if proc.returncode or not os.path.exists(out):
      return {'error': (proc.stderr or proc.stdout).strip().splitlines()[-1][:300],
              'wall_s': time.perf_counter() - start}
    with open(out) as f:
      row = json.load(f)['rows'][0]
  return {k: row.get(k) for k in ('compile_s', 'lower_s', 'gib_per_chip', 'fits', 'error',
                                  'implementation', 'wall_s')}


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--variants', nargs='+', default=list(VARIANTS))
  parser.add_argument('--seq-lens', nargs='+', type=int, default=[1024, 4096, 16384])
  parser.add_argument('--topology', default='v5e:2x2')
  parser.add_argument('--d', type=int, default=1, help='size knob of configs/default.py')
  parser.add_argument('--batch', type=int, default=8, help='global batch (rows)')
  parser.add_argument('--dtype', default='bfloat16')
  parser.add_argument('--timeout', type=int, default=600, help='seconds per compile')
  parser.add_argument('--before', default=None,
                      help='a git commit to measure too (checked out with git worktree)')
  parser.add_argument('--reuse', default=None,
                      help="an earlier output whose 'before' rows are kept, not measured again "
                      '(the old code does not change; its long compiles are the slow part)')
  parser.add_argument('--out', default=os.path.join(common.RESULTS, 'compile_sweep.json'))
  args = parser.parse_args()

  trees = [('after', ROOT, subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], cwd=ROOT,
                                          capture_output=True, text=True).stdout.strip())]
  worktree = None
  if args.before:
    worktree = tempfile.mkdtemp(prefix='compile_sweep_')
    subprocess.run(['git', 'worktree', 'add', '--detach', worktree, args.before], cwd=ROOT,
                   check=True, capture_output=True)
    trees.insert(0, ('before', worktree, args.before))
  reused = {}
  if args.reuse:
    with open(args.reuse) as f:
      reused = {(r['variant'], r['seq_len']): r for r in json.load(f)['rows']
                if r['version'] == 'before' and r['commit'] == args.before}
  rows = []
  try:
    for variant in args.variants:
      for seq_len in args.seq_lens:
        for version, tree, commit in trees:
          if version == 'before' and (variant, seq_len) in reused:
            row = {**reused[(variant, seq_len)], 'reused_from': args.reuse}
          else:
            row = {'version': version, 'commit': commit, 'variant': variant, 'seq_len': seq_len,
                   **child_row(tree, args, variant, seq_len)}
          rows.append(row)
          print(' '.join(f'{k}={row.get(k)}' for k in COLUMNS), flush=True)
          common.write_json(args.out, {'settings': vars(args), 'rows': rows})
  finally:
    if worktree:
      subprocess.run(['git', 'worktree', 'remove', '--force', worktree], cwd=ROOT, check=False)
  common.print_table(rows, COLUMNS)


if __name__ == '__main__':
  main()
