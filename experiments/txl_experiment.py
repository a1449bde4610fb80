"""The experiment of docs/transformer_xl.md: Transformer-XL and GTrXL on bytes of a text.

  python -m experiments.txl_experiment --text ../shared/data/tinyshakespeare.txt
  python -m experiments.txl_experiment --text FILE --steps 2000 --out /tmp/txl_exp   # longer

Trains, one after another with `main.py` (configs/transformer_xl_char.py: 4 layers x 128,
segments of 128 bytes, batch 16), each run in its own workdir under --out (a finished run is
not trained again; an interrupted one resumes):

  dense        dense attention, learned absolute positions, no memory (rows cut from the text)
  txl_mem0     Transformer-XL's relative attention without memory (streams, M = 0)
  txl          Transformer-XL, M = 128, evaluated with eval_mem_len 128 and 512
  txl_gtrxl    the same with GTrXL's gated blocks
  pre_ln_lrX   txl at each learning rate X of --high_lrs (Pre-LN blocks)
  gtrxl_lrX    txl_gtrxl at the same learning rates

then evaluates each on the whole validation split (`--mode=eval --config.eval_steps=0`,
bits per byte), reads the training loss curves from TensorBoard, prints a table, and writes
experiments/results/txl_experiment.json and docs/img/txl_curves.png.
"""

import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from benchmarks.common import flags, pyplot, run_logged, write_json  # noqa: E402
from benchmarks.common import scalar_curve as curve  # noqa: E402

RUNS = {  # name: (overrides, [(eval tag, eval overrides)])
    'dense': ({'model.attention': 'dense', 'model.position_embedding': 'learned',
               'data.packing': 'concat'}, [('eval', {})]),
    'txl_mem0': ({'model.attention_options.mem_len': 0}, [('eval', {})]),
    'txl': ({}, [('eval_mem128', {}),
                 ('eval_mem512', {'model.attention_options.eval_mem_len': 512})]),
    'txl_gtrxl': ({'model.block': 'gtrxl'},
                  [('eval_mem128', {}),
                   ('eval_mem512', {'model.attention_options.eval_mem_len': 512})]),
}


def high_lr_runs(lrs: list[float]) -> dict:
  """Pre-LN and GTrXL blocks (txl, M = 128) at each learning rate of `lrs`."""
  runs = {}
  for lr in lrs:
    runs[f'pre_ln_lr{lr:g}'] = ({'learning_rate': lr}, [('eval', {})])
    runs[f'gtrxl_lr{lr:g}'] = ({'model.block': 'gtrxl', 'learning_rate': lr}, [('eval', {})])
  return runs


def main():
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument('--text', required=True, help='a text file (cut 90/5/5%% by bytes)')
  p.add_argument('--out', default='/tmp/txl_exp', help='workdirs and TFDS data go here')
  p.add_argument('--steps', type=int, default=600)
  p.add_argument('--lr', type=float, default=0.002)
  p.add_argument('--high_lrs', default='0.02,0.06,0.15',
                 help='learning rates of the Pre-LN / GTrXL comparison')
  p.add_argument('--runs', default='all', help="comma-separated subset of the runs, or 'all'")
  p.add_argument('--json', default=os.path.join(REPO, 'experiments', 'results',
                                                'txl_experiment.json'))
  p.add_argument('--plot', default=os.path.join(REPO, 'docs', 'img', 'txl_curves.png'))
  args = p.parse_args()
  high_lrs = [float(v) for v in args.high_lrs.split(',') if v]
  runs = {**RUNS, **high_lr_runs(high_lrs)}
  names = list(runs) if args.runs == 'all' else args.runs.split(',')

  os.makedirs(args.out, exist_ok=True)
  common = {'data.files': os.path.abspath(args.text),
            'data.data_dir': os.path.join(args.out, 'tfds'),
            'data.chunk_bytes': 16384, 'total_steps': args.steps,
            'warmup_steps': max(1, args.steps // 6), 'learning_rate': args.lr,
            'eval_every_steps': 0, 'checkpoint_every_steps': args.steps // 2,
            'log_every_steps': 10}
  main_py = [sys.executable, os.path.join(REPO, 'main.py'),
             '--config=' + os.path.join(REPO, 'configs', 'transformer_xl_char.py')]
  results = {'settings': {'steps': args.steps, 'lr': args.lr, 'high_lrs': high_lrs,
                          'text': os.path.basename(args.text), 'batch_size': 16,
                          'seq_len': 128}, 'runs': {}}
  for name in names:
    overrides, evals = runs[name]
    overrides = {**common, **overrides}
    workdir = os.path.join(args.out, name)
    log = os.path.join(args.out, f'{name}.log')
    entry = {'overrides': {k: v for k, v in overrides.items() if k not in common
                           or v != common[k]}}
    done = os.path.isdir(os.path.join(workdir, 'checkpoints', str(args.steps)))
    diverged = os.path.join(workdir, 'diverged.txt')
    if not done and not os.path.exists(diverged):
      print(f'[{name}] training {args.steps} steps (log: {log})', flush=True)
      outcome = run_logged(main_py + [f'--workdir={workdir}'] + flags(overrides), REPO, log,
                           may_diverge=True)
      if isinstance(outcome, str):
        with open(diverged, 'w') as f:
          f.write(outcome)
    if os.path.exists(diverged):
      with open(diverged) as f:
        entry['diverged'] = f.read().strip()
      print(f'[{name}] diverged: {entry["diverged"]}', flush=True)
      evals = []
    for tag, extra in evals:
      run_logged(main_py + [f'--workdir={workdir}', '--mode=eval', '--config.eval_steps=0']
                 + flags(extra), REPO, log)
      with open(os.path.join(workdir, f'eval_step_{args.steps}.json')) as f:
        entry[tag] = json.load(f)
      print(f'[{name}] {tag}: bits/byte {entry[tag]["bits_per_byte"]:.4f}', flush=True)
    entry['train_loss'] = curve(workdir, 'train/loss')
    entry['grad_norm'] = curve(workdir, 'train/grad_norm')
    results['runs'][name] = entry

  print(f'\n{"run":<12} {"eval":<12} {"bits/byte":>9} {"loss":>7} '
        f'{"train loss (last 50 steps)":>26}')
  for name, entry in results['runs'].items():
    tail = [v for s, v in entry['train_loss'] if s > args.steps - 50]
    if 'diverged' in entry:
      print(f'{name:<12} diverged: {entry["diverged"][-80:]}')
    for tag, _ in runs[name][1] if 'diverged' not in entry else []:
      e = entry[tag]
      print(f'{name:<12} {tag:<12} {e["bits_per_byte"]:>9.4f} {e["loss"]:>7.4f} '
            f'{sum(tail) / max(1, len(tail)):>26.4f}')
  write_json(args.json, results)

  plt = pyplot()
  fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
  high = [n for n in results['runs'] if '_lr' in n]
  for ax, group, title in ((axes[0], [n for n in results['runs'] if n not in high],
                            f'lr {args.lr}'),
                           (axes[1], high, 'high lr: Pre-LN solid, GTrXL dashed')):
    for name in group:
      if not results['runs'][name]['train_loss']:
        continue
      steps, values = zip(*results['runs'][name]['train_loss'])
      ax.plot(steps, values, label=name, linestyle='--' if name.startswith('gtrxl_lr') else '-',
              color=(f'C{high_lrs.index(runs[name][0]["learning_rate"])}' if name in high
                     else None))
    ax.set(title=f'training loss (nats/byte), {title}', xlabel='step')
    ax.set_ylim(1.2, 3.5)
    ax.grid(alpha=0.3)
    ax.legend()
  fig.tight_layout()
  os.makedirs(os.path.dirname(args.plot), exist_ok=True)
  fig.savefig(args.plot, dpi=110)
  print(f'wrote {args.plot}')


if __name__ == '__main__':
  main()
