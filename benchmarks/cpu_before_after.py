"""CPU time and memory of the blocked attention paths: this checkout against an earlier commit,
in the same run (issue 39: the loops must keep the unrolled code's CPU speed).

  python -m benchmarks.cpu_before_after --before b39f426
  python -m benchmarks.cpu_before_after --before b39f426 --n 1024 2048 --skip txl span

For each length n, benchmarks/attention_scaling.py --impls jax (one attention layer's jitted
forward + backward: dense's causal blocks and the static patterns' block-sparse path) runs in
the earlier commit (checked out with `git worktree` under a temporary folder) and then here,
one child process each, back to back so that a slow phase of a shared machine hits both;
then benchmarks/txl_layer.py and benchmarks/adaptive_span.py once each way. The table gives
each row's best time before and after, their ratio (after / before: below 1 is faster),
XLA's compiled peak memory and, for attention_scaling, the compile time. Results go to
results/cpu_before_after.json.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile


from benchmarks import common  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COLUMNS = ('bench', 'row', 'n', 'before_ms', 'after_ms', 'ratio', 'before_MiB', 'after_MiB',
           'before_compile_s', 'after_compile_s')


def run(tree: str, script: str, flags: list[str]) -> list[dict]:
  """The rows of benchmarks/<script> run in `tree` with `flags`."""
  with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, 'rows.json')
    # As a module from the tree's root, so that it imports that tree's code (both trees have
    # benchmarks/__init__.py).
    module = 'benchmarks.' + os.path.splitext(script)[0]
    proc = subprocess.run([sys.executable, '-m', module, *flags, '--out', out], cwd=tree,
                          capture_output=True, text=True, check=False)
    if proc.returncode:
      raise RuntimeError(f'{script} in {tree} failed:\n{proc.stderr[-2000:]}')
    with open(out) as f:
      return json.load(f)['rows']


def pair(bench: str, key, before: list[dict], after: list[dict], n=None) -> list[dict]:
  """Rows matched by key(row): before and after side by side."""
  old = {key(r): r for r in before}
  rows = []
  for r in after:
    b = old.get(key(r))
    if b is None:
      continue
    rows.append({'bench': bench, 'row': key(r), 'n': n,
                 'before_ms': b['time_ms'], 'after_ms': r['time_ms'],
                 'ratio': r['time_ms'] / b['time_ms'],
                 'before_MiB': b.get('peak_MiB'), 'after_MiB': r.get('peak_MiB'),
                 'before_compile_s': b.get('compile_s'), 'after_compile_s': r.get('compile_s')})
  return rows


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--before', required=True, help='the earlier git commit')
  parser.add_argument('--n', nargs='+', type=int, default=[1024, 2048, 4096, 8192])
  parser.add_argument('--iters', type=int, default=5, help='attention_scaling rounds')
  parser.add_argument('--skip', nargs='*', default=[], choices=['scaling', 'txl', 'span'])
  parser.add_argument('--out', default=os.path.join(common.RESULTS, 'cpu_before_after.json'))
  args = parser.parse_args()

  worktree = tempfile.mkdtemp(prefix='cpu_before_after_')
  subprocess.run(['git', 'worktree', 'add', '--detach', worktree, args.before], cwd=ROOT,
                 check=True, capture_output=True)
  after = subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], cwd=ROOT,
                         capture_output=True, text=True).stdout.strip()
  rows = []

  def save():
    common.write_json(args.out, {'before': args.before, 'after': after,
                                 'settings': vars(args), 'rows': rows})

  try:
    if 'scaling' not in args.skip:
      for n in args.n:
        flags = ['--impls', 'jax', '--n', str(n), '--iters', str(args.iters)]
        before = run(worktree, 'attention_scaling.py', flags)
        rows += pair('attention_scaling', lambda r: r['pattern'], before,
                     run(ROOT, 'attention_scaling.py', flags), n)
        save()
    if 'txl' not in args.skip:
      before = run(worktree, 'txl_layer.py', [])
      rows += pair('txl_layer', lambda r: f"{r['layer']} M={r['M']} window={r['window']}",
                   before, run(ROOT, 'txl_layer.py', []), 512)
      save()
    if 'span' not in args.skip:
      before = run(worktree, 'adaptive_span.py', [])
      rows += pair('adaptive_span', lambda r: f"T={r['T']}", before,
                   run(ROOT, 'adaptive_span.py', []), 256)
      save()
  finally:
    subprocess.run(['git', 'worktree', 'remove', '--force', worktree], cwd=ROOT, check=False)
  common.print_table(rows, COLUMNS)


if __name__ == '__main__':
  main()
