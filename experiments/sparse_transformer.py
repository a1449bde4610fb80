"""Sparse Transformer (Child et al., 2019): strided and fixed factorized attention against
dense attention on byte-level text, at equal steps and at equal wall-clock, over seeds.

  python -m experiments.sparse_transformer --text ../shared/data/tinyshakespeare.txt \
      --out OUT/sparse_transformer.json

The runs are data (RUNS, on configs/local_text.py): each (variant, seed) is a real training
run of experiments/harness.py (same recipe, data and step budget per seed; the seed sets the
initialisation and the data order), kept in --workdir/seed<S>/<variant> so that a rerun
resumes or reuses it. Per seed, the harness times every variant's train step round-robin
after training, which gives its steps/s; analyze() turns the rows into the numbers below.

- equal steps: each variant's validation bits per byte after --steps steps;
- equal wall-clock: T = the time the fastest variant of the seed takes for --steps steps;
  each variant's bits per byte after T seconds of its own steps (T * its steps/s, <= --steps),
  read off its evaluation curve by linear interpolation between evaluations.

Writes the per-seed rows, the per-variant mean and spread (sample standard deviation over
seeds), the settings and the command to --out (JSON), and the curves of the first seed
against wall-clock to --png.
"""

import argparse
import os
import shlex
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from experiments import harness  # noqa: E402  (sets the XLA flags before JAX starts)
from experiments import rows as rows_lib  # noqa: E402

from benchmarks import common  # noqa: E402

RECIPE = os.path.join(REPO, 'configs', 'local_text.py')
# The patterns at this length: stride l near sqrt(seq_len), as the paper sets it, and c = l/8
# summary cells per block (the paper: c in {8, 16, 32} for l in {128, 256}).
RUNS = ('dense', 'strided:stride=32', 'fixed:stride=32:summary=4')
TIME_ROUNDS, TIME_STEPS = 5, 5  # The round-robin timing of each seed's train steps.


def interpolate(curve, step: float) -> float:
  """The curve's (step, value) points read at `step` (linear between points; the first
  point's value before it)."""
  points = sorted(curve)
  if step <= points[0][0]:
    return points[0][1]
  for (s0, v0), (s1, v1) in zip(points, points[1:]):
    if s0 <= step <= s1:
      return v0 + (v1 - v0) * (step - s0) / (s1 - s0)
  return points[-1][1]


def summarize(per_seed: dict[int, list[dict]], steps: int, batch: int, seq_len: int) -> dict:
  """Equal-steps and equal-wall-clock bits per byte per variant, per seed and over seeds
  (experiments/rows.py: over_seeds)."""
  rows = {}
  for seed, seed_rows in per_seed.items():
    sps = {r['run']: r['metrics']['tokens_per_sec'] / (batch * seq_len) for r in seed_rows}
    budget = steps / max(sps.values())  # Seconds: the fastest variant's whole run.
    rows[seed] = {}
    for r in seed_rows:
      m = r['metrics']
      curve = [tuple(p) for p in r['curves']['eval_bits_per_byte']]
      at = budget * sps[r['run']]
      rows[seed][r['run']] = {
          'bits_per_byte': m['bits_per_byte'], 'steps_per_sec': sps[r['run']],
          'tokens_per_sec': m['tokens_per_sec'], 'wall_clock_budget_s': budget,
          'steps_at_budget': at, 'bits_per_byte_at_budget': interpolate(curve, at),
          'attn_peak_bytes': m['attn_peak_bytes'], 'params': m['params']}
  return rows_lib.over_seeds(rows, ('bits_per_byte', 'bits_per_byte_at_budget', 'steps_per_sec'))


def plot(rows: list[dict], batch: int, seq_len: int, path: str, title: str) -> None:
  plt = common.pyplot()
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for r in rows:
    sps = r['metrics']['tokens_per_sec'] / (batch * seq_len)
    curve = r['curves']['eval_bits_per_byte']
    ax.plot([s / sps for s, _ in curve], [v for _, v in curve], marker='o', label=r['run'])
  ax.set_xlabel('seconds of training (steps / timed steps per second)')
  ax.set_ylabel('validation bits per byte')
  ax.set_title(title, fontsize=9)
  ax.grid(alpha=0.3)
  ax.legend()
  common.save_figure(fig, path)


def parse_args(argv):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument('--text', required=True, help='byte-level training text (one file)')
  p.add_argument('--out', required=True, help='JSON of the results')
  p.add_argument('--png', default='', help='curves of the first seed (default: next to --out)')
  p.add_argument('--workdir', default=os.path.join(REPO, 'runs', 'sparse_transformer'))
  p.add_argument('--seeds', default='0,1,2')
  p.add_argument('--steps', type=int, default=1000)
  p.add_argument('--evals', type=int, default=10)
  p.add_argument('--d', type=int, default=2)
  p.add_argument('--seq_len', type=int, default=512)
  p.add_argument('--batch_size', type=int, default=8)
  p.add_argument('--variants', default=','.join(RUNS))
  return p.parse_args(argv)


def base_config(args):
  """configs/local_text.py at --d on --text: --seq_len bytes per row, 4 KiB documents, bits
  per byte over the whole validation split."""
  return harness.base_config(
      RECIPE, steps=args.steps, evals=args.evals, d=args.d, workdir=args.workdir,
      overrides={'data.files': os.path.abspath(args.text), 'seq_len': args.seq_len,
                 'batch_size': args.batch_size, 'eval_steps': 0, 'data.chunk_bytes': 4096})


def analyze(rows: list[dict], settings: dict) -> dict:
  """The JSON payload (without the command) from the harness rows of every (variant, seed)."""
  per_seed = {}
  for r in rows:
    per_seed.setdefault(r['seed'], []).append(r)
  summary = summarize(per_seed, settings['steps'], settings['batch_size'], settings['seq_len'])
  lines = ['| variant | bits/byte at equal steps | bits/byte at equal wall-clock | steps/s |',
           '|---|---:|---:|---:|']
  for variant, e in summary.items():
    m, sd = e['mean'], e['std']
    lines.append(f'| {variant} | {m["bits_per_byte"]:.3f} ± {sd["bits_per_byte"]:.3f} | '
                 f'{m["bits_per_byte_at_budget"]:.3f} ± {sd["bits_per_byte_at_budget"]:.3f} | '
                 f'{m["steps_per_sec"]:.2f} |')
  return {'settings': settings, 'variants': summary, 'table': '\n'.join(lines),
          'runs': {str(s): [{k: v for k, v in r.items() if k != 'workdir'} for r in seed_rows]
                   for s, seed_rows in per_seed.items()}}


def main(argv=None) -> dict:
  args = parse_args(argv)
  if not os.path.isfile(args.text):
    raise SystemExit(f'--text {args.text}: no such file')
  seeds = [int(s) for s in args.seeds.split(',')]
  runs = [v.strip() for v in args.variants.split(',') if v.strip()]
  rows = harness.run(runs, base_config(args), seeds, args.workdir, time_rounds=TIME_ROUNDS,
                     time_steps=TIME_STEPS)
  settings = {'text': os.path.basename(args.text), 'seeds': seeds, 'steps': args.steps,
              'd': args.d, 'seq_len': args.seq_len, 'batch_size': args.batch_size,
              'variants': args.variants}
  payload = analyze(rows, settings)
  print('\n' + payload['table'] + '\n')
  payload = {'command': 'python -m experiments.sparse_transformer ' + shlex.join(
      sys.argv[1:] if argv is None else argv), **payload}
  common.write_json(args.out, payload)
  png = args.png or os.path.splitext(args.out)[0] + '.png'
  first = [r for r in rows if r['seed'] == seeds[0]]
  plot(first, args.batch_size, args.seq_len, png,
       f'{os.path.basename(args.text)}, d={args.d}, batch {args.batch_size} x {args.seq_len}, '
       f'seed {seeds[0]}')
  return payload


if __name__ == '__main__':
  main()
