"""The experiments of docs/reformer.md: LSH attention on the duplication task, reversible
layers on bytes.

  python -m experiments.reformer_experiment --text ../shared/data/tinyshakespeare.txt
  python -m experiments.reformer_experiment --part dup --dup_steps 2000     # longer

Part 'dup' (configs/reformer_duplication.py: rows `0 w 0 w` of 256 tokens, 1 layer of 128,
4 heads): trains
  dense      dot-product attention with separate queries and keys (not the paper's baseline)
  full       shared-QK attention over every earlier key: lsh with one bucket and one chunk
             (the paper's "full attention", which also shares QK)
  lsh1/2/4   lsh with 8 buckets, chunks of 32, and 1, 2 or 4 hash rounds
and evaluates each shared-QK model with full attention and with 1, 2 and 4 rounds (the
paper's table 2: every model under every evaluation), accuracy on the second copy.

Part 'bytes' (configs/local_text.py on --text, 4 layers of 128, rows of 256 bytes, batch 16):
trains pre_ln and reversible blocks (dense attention) for the same steps, and reports
validation bits per byte and the training curves.

Each run has its own workdir under --out (a finished run is not trained again). Writes
experiments/results/reformer_experiment.json and docs/img/reformer_curves.png.
"""

import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from benchmarks.common import flags, pyplot, run_logged, scalar_curve, write_json  # noqa: E402

SEQ = 256
LSH = {'model.attention_options.n_buckets': 8, 'model.attention_options.chunk_len': 32}
FULL = {'model.attention_options.n_buckets': 1, 'model.attention_options.chunk_len': SEQ,
        'model.attention_options.n_hashes': 1}
# Evaluations of every shared-QK model: full attention, then 1, 2 and 4 rounds.
DUP_EVALS = [('full', FULL)] + [(f'lsh{h}', {**LSH, 'model.attention_options.n_hashes': h})
                                for h in (1, 2, 4)]
DUP_RUNS = {  # name: (training overrides, evaluations)
    'dense': ({'model.attention': 'dense'}, [('dense', {})]),
    'full': (FULL, DUP_EVALS),
    **{f'lsh{h}': ({**LSH, 'model.attention_options.n_hashes': h}, DUP_EVALS) for h in (1, 2, 4)},
}
BYTE_RUNS = {
    'pre_ln': ({'model.block': 'pre_ln'}, [('eval', {})]),
    'reversible': ({'model.block': 'reversible'}, [('eval', {})]),
}


def train_and_eval(name, overrides, evals, *, main_py, out, steps, metric):
  """Trains one run (unless finished) and evaluates it; returns its results entry."""
  os.makedirs(out, exist_ok=True)
  workdir = os.path.join(out, name)
  log = os.path.join(out, f'{name}.log')
  if not os.path.isdir(os.path.join(workdir, 'checkpoints', str(steps))):
    print(f'[{name}] training {steps} steps (log: {log})', flush=True)
    run_logged(main_py + [f'--workdir={workdir}'] + flags(overrides), REPO, log)
  entry = {'overrides': overrides, 'evals': {}}
  for tag, extra in evals:
    run_logged(main_py + [f'--workdir={workdir}', '--mode=eval'] + flags(extra), REPO, log)
    with open(os.path.join(workdir, f'eval_step_{steps}.json')) as f:
      entry['evals'][tag] = json.load(f)
    print(f'[{name}] eval {tag}: {metric} {entry["evals"][tag][metric]:.4f}', flush=True)
  entry['train_loss'] = scalar_curve(workdir, 'train/loss')
  entry['train_accuracy'] = scalar_curve(workdir, 'train/accuracy')
  return entry


def main():
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument('--part', default='all', choices=['all', 'dup', 'bytes'])
  p.add_argument('--text', help="a text file for part 'bytes' (cut 90/5/5%% by bytes)")
  p.add_argument('--out', default='/tmp/reformer_exp', help='workdirs and TFDS data go here')
  p.add_argument('--dup_steps', type=int, default=1000)
  p.add_argument('--byte_steps', type=int, default=1500)
  p.add_argument('--runs', default='all', help="comma-separated subset of the runs, or 'all'")
  p.add_argument('--json', default=os.path.join(REPO, 'experiments', 'results',
                                                'reformer_experiment.json'))
  p.add_argument('--plot', default=os.path.join(REPO, 'docs', 'img', 'reformer_curves.png'))
  args = p.parse_args()
  os.makedirs(args.out, exist_ok=True)
  results = {}
  if os.path.exists(args.json):
    with open(args.json) as f:
      results = json.load(f)
  results.setdefault('dup', {'runs': {}})
  results.setdefault('bytes', {'runs': {}})
  pick = lambda runs: {k: v for k, v in runs.items()
                       if args.runs == 'all' or k in args.runs.split(',')}
  config = lambda name: '--config=' + os.path.join(REPO, 'configs', name)
  main_py = [sys.executable, os.path.join(REPO, 'main.py')]

  if args.part in ('all', 'dup'):
    common = {'total_steps': args.dup_steps, 'eval_every_steps': 0,
              'checkpoint_every_steps': args.dup_steps, 'log_every_steps': 20, 'eval_steps': 16}
    results['dup']['settings'] = {'steps': args.dup_steps, 'seq_len': SEQ, **common}
    for name, (overrides, evals) in pick(DUP_RUNS).items():
      results['dup']['runs'][name] = train_and_eval(
          name, {**common, **overrides}, evals, main_py=main_py + [config('reformer_duplication.py')],
          out=os.path.join(args.out, 'dup'), steps=args.dup_steps, metric='accuracy')
    print(f'\naccuracy on the second copy after {args.dup_steps} steps (rows: trained with; '
          'columns: evaluated with)')
    cols = [tag for tag, _ in DUP_EVALS]
    print(f'{"":<8}' + ''.join(f'{c:>8}' for c in cols))
    for name, entry in results['dup']['runs'].items():
      print(f'{name:<8}' + ''.join(
          f'{entry["evals"][c]["accuracy"]:>8.3f}' if c in entry['evals'] else f'{"":>8}'
          for c in cols) + (f'  (own: {entry["evals"]["dense"]["accuracy"]:.3f})'
                            if 'dense' in entry['evals'] else ''))

  if args.part in ('all', 'bytes'):
    if not args.text:
      raise SystemExit("part 'bytes' needs --text FILE")
    common = {'data.files': os.path.abspath(args.text),
              'data.data_dir': os.path.join(args.out, 'tfds'), 'data.chunk_bytes': 16384,
              'model.d_model': 128, 'model.n_heads': 4, 'model.n_layers': 4, 'seq_len': 256,
              'model.max_len': 256, 'batch_size': 16, 'total_steps': args.byte_steps,
              'warmup_steps': max(1, args.byte_steps // 6), 'learning_rate': 0.002,
              'eval_every_steps': 0, 'checkpoint_every_steps': args.byte_steps,
              'log_every_steps': 10, 'eval_steps': 0}
    results['bytes']['settings'] = {'text': os.path.basename(args.text), **common}
    for name, (overrides, evals) in pick(BYTE_RUNS).items():
      results['bytes']['runs'][name] = train_and_eval(
          name, {**common, **overrides}, evals, main_py=main_py + [config('local_text.py')],
          out=os.path.join(args.out, 'bytes'), steps=args.byte_steps, metric='bits_per_byte')
    for name, entry in results['bytes']['runs'].items():
      tail = [v for s, v in entry['train_loss'] if s > args.byte_steps - 50]
      print(f'{name:<12} bits/byte {entry["evals"]["eval"]["bits_per_byte"]:.4f}  train loss '
            f'(last 50 steps) {sum(tail) / max(1, len(tail)):.4f}')

  write_json(args.json, results)

  plt = pyplot()
  fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
  for ax, part, tag, title in ((axes[0], 'dup', 'train_accuracy', 'duplication: train accuracy'),
                               (axes[1], 'bytes', 'train_loss', 'bytes: train loss (nats)')):
    for name, entry in results[part]['runs'].items():
      if entry[tag]:
        steps, values = zip(*entry[tag])
        ax.plot(steps, values, label=name)
    ax.set(title=title, xlabel='step')
    ax.grid(alpha=0.3)
    ax.legend()
  fig.tight_layout()
  os.makedirs(os.path.dirname(args.plot), exist_ok=True)
  fig.savefig(args.plot, dpi=110)
  print(f'wrote {args.plot}')


if __name__ == '__main__':
  main()
