"""The experiments behind RESULTS.md: one runner.

  python -m experiments list
  python -m experiments run NAME [NAME ...] --out OUT [--text TEXT] [--quick]
  python -m experiments all --out OUT [--text TEXT] [--quick]

Each experiment trains through experiments/harness.py (or, for a component timing, runs a
benchmarks/ script); registry.EXPERIMENTS are RESULTS.md's, registry.PAGES the runs a docs/
page quotes.

`run` runs the named experiments (experiments/registry.py; paper_scale, the papers' sizes on
an accelerator, only this way) into OUT, each as
`python -m MODULE ARGS` with its log in OUT/logs/NAME.log; a finished training run inside OUT
is reused. `all` runs every experiment in order, RESULTS.md's then the pages' (several hours
on 2 CPU cores), and renders OUT/RESULTS.md from what they wrote (experiments/render.py).
TEXT is a byte-level text file (RESULTS.md used ../shared/data/tinyshakespeare.txt).
--quick appends each experiment's tiny settings: every experiment's code runs end to end in
minutes, and its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

from experiments import registry, render

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _call(cmd: list[str], log) -> int:
  """Runs `cmd` to its end, passing a SIGTERM or Ctrl-C of the runner on to it (its runs save
  their checkpoints and stop), so that stopping the runner never leaves an experiment running
  on its own."""
  proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
  previous = signal.signal(signal.SIGTERM, lambda signum, frame: proc.terminate())
  try:
    return proc.wait()
  except KeyboardInterrupt:  # The experiment stops as after a SIGTERM, then so does the runner.
    proc.terminate()
    proc.wait()
    raise
  finally:
    signal.signal(signal.SIGTERM, previous)


def run(names: list[str], out: str, text: str = '', quick: bool = False) -> None:
  """Runs `names` into `out` in order; stops at the first failure with its log's tail.

  Raises:
    SystemExit: an experiment failed (its log is named).
  """
  experiments = [registry.get(n) for n in names]  # Unknown names fail before anything runs.
  out = os.path.abspath(out)
  text = os.path.abspath(text) if text else ''
  for e in experiments:
    registry.argv(e, out, text, quick)  # Missing --text fails before anything runs.
  if text and not os.path.isfile(text):
    raise SystemExit(f'--text {text}: no such file')
  os.makedirs(os.path.join(out, 'logs'), exist_ok=True)
  for i, e in enumerate(experiments, 1):
    cmd = [sys.executable, '-m', e.module, *registry.argv(e, out, text, quick)]
    log = os.path.join(out, 'logs', f'{e.name}.log')
    print(f'[{i}/{len(experiments)}] {e.name}: python -m {e.module} '
          f'{" ".join(cmd[3:])}', flush=True)
    start = time.perf_counter()
    with open(log, 'w') as f:
      # `python -m` from the repository root imports the project from there.
      code = _call(cmd, f)
    if code:
      with open(log) as f:
        tail = ''.join(f.readlines()[-15:])
      raise SystemExit(f'{e.name} failed (exit {code}); its log: {log}\n{tail}')
    missing = [w for w in e.writes if not os.path.isfile(os.path.join(out, w))]
    if missing:
      raise SystemExit(f'{e.name} finished without writing {", ".join(missing)} (log: {log})')
    print(f'      done in {time.perf_counter() - start:.0f} s', flush=True)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(prog='python -m experiments', description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = parser.add_subparsers(dest='verb', required=True)
  sub.add_parser('list', help='the experiments, in order, with what they write')
  for verb in ('run', 'all'):
    p = sub.add_parser(verb, help='run the named experiments' if verb == 'run' else
                       'run every experiment, then render OUT/RESULTS.md')
    if verb == 'run':
      p.add_argument('names', nargs='+', help='experiment names (python -m experiments list)')
    p.add_argument('--out', required=True, help='results folder')
    p.add_argument('--text', default='', help='a byte-level text file (for the experiments '
                   'that train on text)')
    p.add_argument('--quick', action='store_true', help='tiny settings: check that the code '
                   'runs (numbers meaningless)')
  args = parser.parse_args(argv)
  if args.verb == 'list':
    for e in registry.EXPERIMENTS + registry.PAGES + registry.DEVICE:
      print(f'{e.name:<20} python -m {e.module:<34} -> {", ".join(e.writes)}'
            + ('  (needs --text)' if e.text else '')
            + ('  (a docs page\'s runs)' if e in registry.PAGES else '')
            + ('  (needs an accelerator; not in all)' if e in registry.DEVICE else ''))
    return
  names = (args.names if args.verb == 'run'
           else [e.name for e in registry.EXPERIMENTS + registry.PAGES])
  run(names, args.out, args.text, args.quick)
  if args.verb == 'all':
    render.main(['--results', args.out, '--out', os.path.join(args.out, 'RESULTS.md')])


if __name__ == '__main__':
  main()
