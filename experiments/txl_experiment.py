"""The experiment of docs/transformer_xl.md: Transformer-XL and GTrXL on bytes of a text.

  python -m experiments.txl_experiment --text ../shared/data/tinyshakespeare.txt
  python -m experiments.txl_experiment --text FILE --steps 2000 --out /tmp/txl_exp   # longer

The runs are data (RUNS and high_lr_runs, on configs/transformer_xl_char.py: 4 layers x 128,
segments of 128 bytes, batch 16), trained one after another in process by
experiments/harness.py, each in its own workdir under --out (a finished run is not trained
again, nor one that diverged; an interrupted one resumes):

  dense        dense attention, learned absolute positions, no memory (rows cut from the text)
  txl_mem0     Transformer-XL's relative attention without memory (streams, M = 0)
  txl          Transformer-XL, M = 128, evaluated with eval_mem_len 128 and 512
  txl_gtrxl    the same with GTrXL's gated layers
  pre_ln_lrX   txl at each learning rate X of --high_lrs (Pre-LN layers)
  gtrxl_lrX    txl_gtrxl at the same learning rates

then evaluates each on the whole validation split in process (EVALS: what
`main.py --workdir=RUN --mode=eval --config.eval_steps=0 [--config.KEY=VALUE]` gives, bits per
byte), reads the training loss curves from TensorBoard, and analyze() turns it all into
results/txl_experiment.json; prints a table and draws docs/img/txl_curves.png.
"""

import argparse
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from experiments import harness  # noqa: E402  (sets the XLA flags before JAX starts)
from experiments import rows as rows_lib  # noqa: E402

from benchmarks.common import pyplot, save_figure, scalar_curve, write_json  # noqa: E402

RECIPE = os.path.join(REPO, 'configs', 'transformer_xl_char.py')
BATCH_SIZE, SEQ_LEN = 16, 128  # The recipe's (the settings of the JSON say so).
RUNS = (
    harness.Run('dense', {'model.attention': 'dense', 'model.position_embedding': 'learned',
                          'data.packing': 'concat'}),
    harness.Run('txl_mem0', {'model.attention_options.txl.mem_len': 0}),
    harness.Run('txl', {}),
    harness.Run('txl_gtrxl', {'model.residual': 'gtrxl'}),
)
# Each evaluation is on the whole validation split; a run's evaluations: [(tag, eval-time
# overrides)], [('eval', {})] for a run not named here.
EVAL_ALL = {'eval_steps': 0}
LONG_MEMORY = {'model.attention_options.txl.eval_mem_len': 512}
EVALS = {name: [('eval_mem128', {}), ('eval_mem512', LONG_MEMORY)]
         for name in ('txl', 'txl_gtrxl')}


def high_lr_runs(lrs: list[float]) -> tuple[harness.Run, ...]:
  """Pre-LN and GTrXL blocks (txl, M = 128) at each learning rate of `lrs`."""
  runs = []
  for lr in lrs:
    runs.append(harness.Run(f'pre_ln_lr{lr:g}', {'learning_rate': lr}))
    runs.append(harness.Run(f'gtrxl_lr{lr:g}', {'learning_rate': lr, 'model.residual': 'gtrxl'}))
  return tuple(runs)


def evals_of(name: str) -> list[tuple[str, dict]]:
  return EVALS.get(name, [('eval', {})])


def common_overrides(args) -> dict:
  """The overrides of the recipe every run shares (no evaluation while training)."""
  return {'data.files': os.path.abspath(args.text),
          'data.data_dir': os.path.join(args.out, 'tfds'),
          'data.chunk_bytes': 16384, 'total_steps': args.steps,
          'warmup_steps': max(1, args.steps // 6), 'learning_rate': args.lr,
          'eval_every_steps': 0, 'checkpoint_every_steps': max(1, args.steps // 2),
          'log_every_steps': 10}


def train_and_measure(runs, base, out: str, eval_steps: int = 0) -> list[dict]:
  """Trains each run (unless finished or diverged) in OUT/<run>, then evaluates it (EVALS) and
  reads its curves; the harness rows with 'evals' ({tag: eval result}; none when it diverged)
  and the curve 'grad_norm'. eval_steps: validation batches per evaluation (0: the whole
  split, as the results use)."""
  rows = []
  for name, (config, keys) in harness.configs(runs, base).items():
    workdir = os.path.join(out, harness.folder(name))
    diverged = os.path.join(workdir, 'diverged.txt')
    if os.path.exists(diverged):  # Training again would diverge again.
      with open(diverged) as f:
        row = rows_lib.add(harness.measure(name, config, workdir), {'diverged': f.read().strip()})
    else:
      if not os.path.isdir(os.path.join(workdir, 'checkpoints', str(config.total_steps))):
        print(f'[{name}] training {config.total_steps} steps in {workdir}', flush=True)
      row = harness.train_one(name, config, workdir)
      if 'diverged' in row:
        row['diverged'] = f'error: {row["diverged"]}'  # As main.py said it.
        with open(diverged, 'w') as f:
          f.write(row['diverged'])
    evals = {}
    if 'diverged' in row:
      print(f'[{name}] diverged: {row["diverged"]}', flush=True)
    else:
      for tag, extra in evals_of(name):
        evals[tag] = harness.evaluate(config, workdir,
                                      {**EVAL_ALL, 'eval_steps': eval_steps, **extra})
        print(f'[{name}] {tag}: bits/byte {evals[tag]["bits_per_byte"]:.4f}', flush=True)
    rows.append(rows_lib.add(row, {'own_keys': dict(keys), 'evals': evals, 'curves': {
        'grad_norm': scalar_curve(workdir, 'train/grad_norm')}}))
  return rows


def analyze(rows: list[dict], runs, settings: dict) -> dict:
  """The JSON payload from the rows of train_and_measure and the runs they are of: each run
  a row of experiments/rows.py (one seed: the recipe's) with its evaluations (EVALS)."""
  declared = {run.name: dict(run.overrides) for run in runs}
  out = {'settings': settings, 'runs': {}}
  for row in rows:
    name = row['run']
    out['runs'][name] = rows_lib.row(name, None, {
        'overrides': declared[name], 'diverged': row.get('diverged'),
        'evals': row.get('evals', {}),
        'curves': {k: [list(p) for p in row['curves'][k]] for k in ('train_loss', 'grad_norm')}})
  return out


def table(payload: dict) -> str:
  """Each run's evaluations and its mean training loss over the last 50 steps."""
  steps = payload['settings']['steps']
  lines = [f'{"run":<12} {"eval":<12} {"bits/byte":>9} {"loss":>7} '
           f'{"train loss (last 50 steps)":>26}']
  for name, entry in payload['runs'].items():
    tail = [v for s, v in entry['curves']['train_loss'] if s > steps - 50]
    if 'diverged' in entry:
      lines.append(f'{name:<12} diverged: {entry["diverged"][-80:]}')
      continue
    for tag, _ in evals_of(name):
      bpb = rows_lib.metric(entry, f'{tag}/bits_per_byte', 'value')
      loss = rows_lib.metric(entry, f'{tag}/loss', 'value')
      lines.append(f'{name:<12} {tag:<12} {bpb:>9.4f} {loss:>7.4f} '
                   f'{sum(tail) / max(1, len(tail)):>26.4f}')
  return '\n'.join(lines)


def plot(payload: dict, path: str) -> None:
  """Training loss curves: the runs at --lr, and the high learning rates."""
  settings, runs = payload['settings'], payload['runs']
  high_lrs = settings['high_lrs']
  plt = pyplot()
  fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
  high = [n for n in runs if '_lr' in n]
  for ax, group, title in ((axes[0], [n for n in runs if n not in high], f'lr {settings["lr"]}'),
                           (axes[1], high, 'high lr: Pre-LN solid, GTrXL dashed')):
    for name in group:
      if not runs[name]['curves']['train_loss']:
        continue
      steps, values = zip(*runs[name]['curves']['train_loss'])
      ax.plot(steps, values, label=name, linestyle='--' if name.startswith('gtrxl_lr') else '-',
              color=(f'C{high_lrs.index(runs[name]["overrides"]["learning_rate"])}'
                     if name in high else None))
    ax.set(title=f'training loss (nats/byte), {title}', xlabel='step')
    ax.set_ylim(1.2, 3.5)
    ax.grid(alpha=0.3)
    ax.legend()
  save_figure(fig, path)


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument('--text', required=True, help='a text file (cut 90/5/5%% by bytes)')
  p.add_argument('--out', default='/tmp/txl_exp', help='workdirs and TFDS data go here')
  p.add_argument('--steps', type=int, default=600)
  p.add_argument('--lr', type=float, default=0.002)
  p.add_argument('--high_lrs', default='0.02,0.06,0.15',
                 help='learning rates of the Pre-LN / GTrXL comparison')
  p.add_argument('--runs', default='all', help="comma-separated subset of the runs, or 'all'")
  p.add_argument('--eval_steps', type=int, default=0,
                 help='validation batches per evaluation (0: the whole split)')
  p.add_argument('--json', default=os.path.join(REPO, 'results',
                                                'txl_experiment.json'))
  p.add_argument('--plot', default=os.path.join(REPO, 'docs', 'img', 'txl_curves.png'))
  return p.parse_args(argv)


def main(argv=None) -> dict:
  args = parse_args(argv)
  high_lrs = [float(v) for v in args.high_lrs.split(',') if v]
  runs = RUNS + high_lr_runs(high_lrs)
  if args.runs != 'all':
    wanted = args.runs.split(',')
    unknown = set(wanted) - {r.name for r in runs}
    if unknown:
      raise SystemExit(f'--runs: unknown runs {", ".join(sorted(unknown))}')
    runs = tuple(sorted((r for r in runs if r.name in wanted),
                        key=lambda r: wanted.index(r.name)))
  os.makedirs(args.out, exist_ok=True)
  base = harness.base_config(RECIPE, steps=args.steps, overrides=common_overrides(args),
                             workdir=args.out)
  rows = train_and_measure(runs, base, args.out, args.eval_steps)
  settings = {'steps': args.steps, 'lr': args.lr, 'high_lrs': high_lrs,
              'text': os.path.basename(args.text), 'batch_size': BATCH_SIZE,
              'seq_len': SEQ_LEN}
  payload = analyze(rows, runs, settings)
  print('\n' + table(payload))
  write_json(args.json, payload)
  plot(payload, args.plot)
  return payload


if __name__ == '__main__':
  main()
