"""The experiments of docs/reformer.md: LSH attention on the duplication task, reversible
layers on bytes.

  python -m experiments.reformer_experiment --text ../shared/data/tinyshakespeare.txt
  python -m experiments.reformer_experiment --part dup --dup_steps 2000     # longer

The runs are data (RUNS, per part), trained in process by experiments/harness.py.

Part 'dup' (configs/reformer_duplication.py: rows `0 w 0 w` of 256 tokens, 1 layer of 128,
4 heads): trains
  dense      dot-product attention with separate queries and keys (not the paper's baseline)
  full       shared-QK attention over every earlier key: lsh with one bucket and one chunk
             (the paper's "full attention", which also shares QK)
  lsh1/2/4   lsh with 8 buckets, chunks of 32, and 1, 2 or 4 hash rounds
and evaluates each shared-QK model with full attention and with 1, 2 and 4 rounds (the
paper's table 2: every model under every evaluation; DUP_EVALS, each what
`main.py --workdir=RUN --mode=eval --config.KEY=VALUE...` gives), accuracy on the second copy.
--dup_length, --num_symbols, --d_model, --mlp_dim, --dup_batch, --chunk_len, --n_buckets and
--hashes change the sizes (experiments/paper_scale.py runs the paper's: rows of 1024, 127
symbols, d_model = d_ff = 256, chunks of 64 in 16 buckets); the JSON records every size that
differs from the recipe's among each run's overrides.

Part 'bytes' (configs/local_text.py on --text, 4 layers of 128, rows of 256 bytes, batch 16):
trains pre_ln and reversible layers (dense attention) for the same steps, and reports
validation bits per byte and the training curves.

Each run has its own workdir under --out/<part> (a finished run is not trained again; an
interrupted one resumes). analyze() turns a part's runs into its half of
results/reformer_experiment.json (the other part's half is kept); draws
docs/img/reformer_curves.png.
"""

import argparse
import json
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from experiments import harness  # noqa: E402  (sets the XLA flags before JAX starts)
from experiments import rows as rows_lib  # noqa: E402

from benchmarks.common import pyplot, save_figure, write_json  # noqa: E402

RECIPES = {'dup': os.path.join(REPO, 'configs', 'reformer_duplication.py'),
           'bytes': os.path.join(REPO, 'configs', 'local_text.py')}
METRIC = {'dup': 'accuracy', 'bytes': 'bits_per_byte'}
SEQ = 256
LSH = {'model.attention_options.lsh.n_buckets': 8, 'model.attention_options.lsh.chunk_len': 32}
HASHES = (1, 2, 4)


def dup_evals(seq: int = SEQ, lsh: dict = None, hashes=HASHES) -> list[tuple[str, dict]]:
  """Evaluations of every shared-QK model of rows of `seq` tokens: full attention (one bucket,
  one chunk), then LSH (`lsh`: its buckets and chunks) with each of `hashes` rounds."""
  lsh = LSH if lsh is None else lsh
  full = {'model.attention_options.lsh.n_buckets': 1,
          'model.attention_options.lsh.chunk_len': seq,
          'model.attention_options.lsh.n_hashes': 1}
  return [('full', full)] + [(f'lsh{h}', {**lsh, 'model.attention_options.lsh.n_hashes': h})
                             for h in hashes]


def dup_runs(seq: int = SEQ, lsh: dict = None, hashes=HASHES) -> tuple:
  """The duplication runs: dense (separate Q, K), full shared-QK attention, LSH with each of
  `hashes` rounds."""
  evals = dict(dup_evals(seq, lsh, hashes))
  return (harness.Run('dense', {'model.attention': 'dense'}),
          *(harness.Run(name, overrides) for name, overrides in evals.items()))


# Evaluations of every shared-QK model: full attention, then 1, 2 and 4 rounds.
DUP_EVALS = dup_evals()
RUNS = {
    'dup': dup_runs(),
    'bytes': (harness.Run('pre_ln', {'model.residual': 'pre_ln'}),
              harness.Run('reversible', {'model.residual': 'reversible'})),
}
# A run's evaluations: [(tag, eval-time overrides)]; [('eval', {})] for a run not named here.
EVALS = {'dense': [('dense', {})],
         **{run.name: DUP_EVALS for run in RUNS['dup'] if run.name != 'dense'}}
# The duplication task's sizes (--dup_length ...: the recipe's by default; the paper's: rows of
# 1024, L = 511, 127 symbols, d_model = d_ff = 256): {argument: recipe key}.
SIZES = {'dup_length': 'data.dup_length', 'num_symbols': 'data.num_symbols',
         'd_model': 'model.d_model', 'mlp_dim': 'model.mlp_dim', 'dup_batch': 'batch_size'}


def evals_of(name: str, evals: dict | None = None) -> list[tuple[str, dict]]:
  return (EVALS if evals is None else evals).get(name, [('eval', {})])


def size_overrides(args) -> dict:
  """The duplication sizes that differ from the recipe's (none by default): {key: value}."""
  recipe = harness.flatten(harness.load_recipe(RECIPES['dup']))
  return {key: getattr(args, arg) for arg, key in SIZES.items()
          if getattr(args, arg, None) is not None and getattr(args, arg) != recipe[key]}


def dup_seq(args) -> int:
  """The duplication rows' length: BOS + 2 (L + 1) tokens, minus the last."""
  length = getattr(args, 'dup_length', None)
  return SEQ if length is None else 2 * length + 2


def dup_lsh(args) -> dict:
  """The LSH settings of --n_buckets and --chunk_len (default: LSH's)."""
  return {'model.attention_options.lsh.n_buckets': getattr(args, 'n_buckets', None) or
          LSH['model.attention_options.lsh.n_buckets'],
          'model.attention_options.lsh.chunk_len': getattr(args, 'chunk_len', None) or
          LSH['model.attention_options.lsh.chunk_len']}


def dup_plan(args) -> tuple[tuple, dict]:
  """(the duplication runs, {run: its evaluations}) of these arguments (--hashes, --runs)."""
  hashes = tuple(int(h) for h in str(getattr(args, 'hashes', '1,2,4')).split(','))
  seq, lsh = dup_seq(args), dup_lsh(args)
  runs = dup_runs(seq, lsh, hashes)
  evals = {'dense': [('dense', {})],
           **{run.name: dup_evals(seq, lsh, hashes) for run in runs if run.name != 'dense'}}
  return runs, evals


def common_overrides(part: str, args) -> dict:
  """The overrides of the part's recipe that its runs share (no evaluation while training)."""
  if part == 'dup':
    return {'total_steps': args.dup_steps, 'eval_every_steps': 0,
            'checkpoint_every_steps': args.dup_steps, 'log_every_steps': 20, 'eval_steps': 16,
            **size_overrides(args)}
  return {'data.files': os.path.abspath(args.text),
          'data.data_dir': os.path.join(args.out, 'tfds'), 'data.chunk_bytes': 16384,
          'model.d_model': 128, 'model.n_heads': 4, 'model.n_layers': 4, 'seq_len': 256,
          'model.max_len': 256, 'batch_size': 16, 'total_steps': args.byte_steps,
          'warmup_steps': max(1, args.byte_steps // 6), 'learning_rate': 0.002,
          'eval_every_steps': 0, 'checkpoint_every_steps': args.byte_steps,
          'log_every_steps': 10, 'eval_steps': 0}


def base_config(part: str, args):
  """The part's recipe with its common overrides; the recipe's own warm-up where they give
  none (the harness would cap it at a sixth of the steps), so the runs train as the recipe
  does."""
  recipe = harness.load_recipe(RECIPES[part])
  steps = args.dup_steps if part == 'dup' else args.byte_steps
  return harness.base_config(
      recipe, steps=steps, workdir=args.out,
      overrides={'warmup_steps': recipe.warmup_steps, **common_overrides(part, args)})


def train_and_measure(part: str, runs, base, out: str, evals: dict | None = None) -> list[dict]:
  """Trains each run (unless finished) in OUT/<part>/<run> through the harness, evaluates it
  (`evals`, default EVALS) and reads its curves: the harness rows with 'evals' ({tag: eval
  result}) and the curve 'train_accuracy'."""
  by_name = {run.name: run for run in runs}
  rows = []
  for row in harness.run(runs, base, None, os.path.join(out, part)):
    name, workdir = row['run'], row['workdir']
    config = harness.variant_config(base, by_name[name].overrides)
    done = {}
    for tag, extra in evals_of(name, evals):
      done[tag] = harness.evaluate(config, workdir, extra)
      print(f'[{name}] eval {tag}: {METRIC[part]} {done[tag][METRIC[part]]:.4f}', flush=True)
    rows.append(rows_lib.add(row, {'evals': done, 'curves': {
        'train_accuracy': harness.scalar_curve(workdir, 'train/accuracy')}}))
  return rows


def analyze(rows: list[dict], runs, common: dict) -> dict:
  """A part's runs in the JSON payload ({run: its row of experiments/rows.py, one seed: the
  recipe's}) from the rows of train_and_measure, the runs they are of and the part's common
  overrides."""
  declared = {run.name: dict(run.overrides) for run in runs}
  return {row['run']: rows_lib.row(row['run'], None, {
      'overrides': {**common, **declared[row['run']]}, 'evals': row.get('evals', {}),
      'curves': {k: [list(p) for p in row['curves'][k]]
                 for k in ('train_loss', 'train_accuracy')}})
          for row in rows}


def settings(part: str, args) -> dict:
  common = common_overrides(part, args)
  if part == 'dup':
    return {'steps': args.dup_steps, 'seq_len': dup_seq(args), **common}
  return {'text': os.path.basename(args.text), **common}


def dup_table(part: dict) -> str:
  """Accuracy of each model (rows) under each evaluation (columns)."""
  cols = [tag for tag in ('full', 'lsh1', 'lsh2', 'lsh4', 'lsh8')
          if any(tag in entry['evals'] for entry in part['runs'].values())]
  lines = [f'accuracy on the second copy after {part["settings"]["steps"]} steps (rows: '
           'trained with; columns: evaluated with)', f'{"":<8}' + ''.join(f'{c:>8}' for c in cols)]
  for name, entry in part['runs'].items():
    lines.append(f'{name:<8}' + ''.join(
        f'{rows_lib.metric(entry, f"{c}/accuracy", "value"):>8.3f}' if c in entry['evals']
        else f'{"":>8}' for c in cols)
        + (f'  (own: {rows_lib.metric(entry, "dense/accuracy", "value"):.3f})'
           if 'dense' in entry['evals'] else ''))
  return '\n'.join(lines)


def bytes_table(part: dict) -> str:
  """Bits per byte and the mean training loss over the last 50 steps of each run."""
  steps = part['settings']['total_steps']
  lines = []
  for name, entry in part['runs'].items():
    tail = [v for s, v in entry['curves']['train_loss'] if s > steps - 50]
    bpb = rows_lib.metric(entry, 'eval/bits_per_byte', 'value')
    lines.append(f'{name:<12} bits/byte {bpb:.4f}  train '
                 f'loss (last 50 steps) {sum(tail) / max(1, len(tail)):.4f}')
  return '\n'.join(lines)


def plot(results: dict, path: str) -> None:
  """Duplication: train accuracy; bytes: train loss."""
  plt = pyplot()
  fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
  for ax, part, tag, title in ((axes[0], 'dup', 'train_accuracy', 'duplication: train accuracy'),
                               (axes[1], 'bytes', 'train_loss', 'bytes: train loss (nats)')):
    for name, entry in results[part]['runs'].items():
      if entry['curves'][tag]:
        steps, values = zip(*entry['curves'][tag])
        ax.plot(steps, values, label=name)
    ax.set(title=title, xlabel='step')
    ax.grid(alpha=0.3)
    ax.legend()
  save_figure(fig, path)


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument('--part', default='all', choices=['all', 'dup', 'bytes'])
  p.add_argument('--text', help="a text file for part 'bytes' (cut 90/5/5%% by bytes)")
  p.add_argument('--out', default='/tmp/reformer_exp', help='workdirs and TFDS data go here')
  p.add_argument('--dup_steps', type=int, default=1000)
  p.add_argument('--byte_steps', type=int, default=1500)
  p.add_argument('--runs', default='all', help="comma-separated subset of the runs, or 'all'")
  p.add_argument('--dup_length', type=int, default=None,
                 help="dup: L, rows of 2 L + 2 (default: the recipe's 127; paper: 511)")
  p.add_argument('--num_symbols', type=int, default=None,
                 help="dup: alphabet (default: the recipe's 32; paper: 127)")
  p.add_argument('--d_model', type=int, default=None, help="dup: width (recipe: 128; paper: 256)")
  p.add_argument('--mlp_dim', type=int, default=None,
                 help="dup: feed-forward width (recipe: derived; paper: 256)")
  p.add_argument('--dup_batch', type=int, default=None, help="dup: batch (recipe: 32)")
  p.add_argument('--chunk_len', type=int, default=None, help='dup: LSH chunk length (default 32)')
  p.add_argument('--n_buckets', type=int, default=None, help='dup: LSH buckets (default 8)')
  p.add_argument('--hashes', default='1,2,4', help='dup: the hash rounds trained and evaluated')
  p.add_argument('--json', default=os.path.join(REPO, 'results',
                                                'reformer_experiment.json'))
  p.add_argument('--plot', default=os.path.join(REPO, 'docs', 'img', 'reformer_curves.png'))
  return p.parse_args(argv)


def main(argv=None) -> dict:
  args = parse_args(argv)
  parts = ['dup', 'bytes'] if args.part == 'all' else [args.part]
  if 'bytes' in parts and not args.text:
    raise SystemExit("part 'bytes' needs --text FILE")
  os.makedirs(args.out, exist_ok=True)
  results = {}
  if os.path.exists(args.json):  # The other part's results are kept.
    from experiments import migrations  # pylint: disable=import-outside-toplevel
    with open(args.json) as f:
      results = migrations.migrate(json.load(f))  # Written before a rename: as it is now.
    results.pop('machine', None)  # write_json writes this run's.
  for part in RUNS:
    results.setdefault(part, {'runs': {}})
  for part in parts:
    every, evals = dup_plan(args) if part == 'dup' else (RUNS[part], None)
    runs = tuple(r for r in every if args.runs == 'all' or r.name in args.runs.split(','))
    rows = train_and_measure(part, runs, base_config(part, args), args.out, evals)
    results[part]['settings'] = settings(part, args)
    results[part]['runs'].update(analyze(rows, runs, common_overrides(part, args)))
    print('\n' + (dup_table if part == 'dup' else bytes_table)(results[part]))
  write_json(args.json, results)
  plot(results, args.plot)
  return results


if __name__ == '__main__':
  main()
