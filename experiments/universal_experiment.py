"""The experiment of docs/universal_transformer.md: a fixed-depth Pre-LN stack against the
Universal Transformer with fixed steps and with ACT, on the embedded copy and running-parity
tasks, trained on short rows and evaluated on rows up to twice as long.

  python -m experiments.universal_experiment                  # both tasks, 4 runs each
  python -m experiments.universal_experiment --steps 3000     # longer (new workdirs)
  python -m experiments.universal_experiment --tasks copy --runs ut_act,ut_fixed

The runs are data (RUNS, on configs/universal_algorithmic.py: width 64, 4 heads, float32;
TASKS sets the task):
  pre_ln_1   1 Pre-LN layer, sinusoid positions: the UT's parameters (one block)
  pre_ln_T   T distinct Pre-LN layers, sinusoid positions: the fixed UT's compute
  ut_fixed   one shared layer applied T times (universal stack, its own coordinates)
  ut_act     one shared layer, ACT halting per position, at most M steps, ponder cost τ

Each run trains in process through experiments/harness.py in --out/<task>/<run> (a finished
run is kept, an interrupted one resumes; no evaluation during training, a log line every 25
steps, warm-up at most a sixth of the steps), then evaluate() restores its latest parameters
and runs the Decoder on longer rows:
  copy    rows of copy lengths 1..2 L_train (the lengths are drawn uniformly; training saw
          1..L_train): token accuracy on the scored copy + EOS, and whole-row accuracy, per
          copy length;
  parity  rows of 2 n_train bits: accuracy at each parity token k = 1..2 n_train (training
          saw k <= n_train).
For ACT it reads the per-position steps N (intermediates 'universal'/'act_steps') and keeps
their histogram against the position and against the token's role (copy: the string, SEP,
the copy; parity: bit tokens, whose target is scored, and parity tokens). analyze() turns the
harness rows and these measurements into the JSON.

Writes results/universal_experiment.json (merged into the one there: runs not
rerun keep their entries), docs/img/universal_steps.png (ACT's steps against position) and
docs/img/universal_accuracy.png (accuracy against length).
"""

import argparse
import dataclasses
import json
import os
import subprocess
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from experiments import harness  # noqa: E402  (sets the XLA flags before JAX starts)
from experiments import rows as rows_lib  # noqa: E402

import jax  # noqa: E402
import ml_collections  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import print_table, pyplot, save_figure, write_json  # noqa: E402
from input_pipeline import synthetic  # noqa: E402
from training import assembly, run_config  # noqa: E402

RECIPE = os.path.join(REPO, 'configs', 'universal_algorithmic.py')
T = 4           # Fixed steps of ut_fixed, layers of pre_ln_T.
M = 8           # ACT's cap.
COPY_TRAIN = 10  # Copy: lengths 1..COPY_TRAIN in training (configs/universal_algorithmic.py).
PARITY_TRAIN = 12  # Parity: bits per training row.
EXTRAPOLATE = 2  # Evaluation rows are this many times the longest training row.
EVAL_ROWS = 1024
EVAL_SEED = 12345
STEPS = 1000


@dataclasses.dataclass(frozen=True)
class Sizes:
  """The experiment's sizes: the recipe, T, M, the training lengths, how much longer the
  evaluation rows are and how many. The defaults are this page's CPU experiment;
  experiments/paper_scale.py runs the paper's (configs/universal_transformer_algorithmic.py:
  copy of up to 40 decimal symbols, tested on up to 400)."""
  recipe: str = RECIPE
  T: int = T
  M: int = M
  copy_train: int = COPY_TRAIN
  parity_train: int = PARITY_TRAIN
  extrapolate: int = EXTRAPOLATE
  eval_rows: int = EVAL_ROWS

  def runs(self) -> tuple:
    """pre_ln_1, pre_ln_T, ut_fixed (T steps) and ut_act (at most M steps)."""
    return (
        harness.Run('pre_ln_1', {**LAYERED, 'model.n_layers': 1}),
        harness.Run(f'pre_ln_{self.T}', {**LAYERED, 'model.n_layers': self.T}),
        harness.Run('ut_fixed', {'model.stack_options.act': False,
                                 'model.stack_options.steps': self.T}),
        harness.Run('ut_act', {'model.stack_options.act': True,
                               'model.stack_options.max_steps': self.M}),
    )

  def tasks(self) -> dict:
    """{task: its overrides}; model.max_len is raised where the evaluation rows are longer
    than the recipe's."""
    recipe = harness.load_recipe(self.recipe)
    out = {'copy': {'data.name': 'copy', 'data.max_length': self.copy_train},
           'parity': {'data.name': 'parity', 'data.num_bits': self.parity_train}}
    longest = {'copy': 2 * self.extrapolate * self.copy_train + 2,
               'parity': 2 * self.extrapolate * self.parity_train}
    for task, n in longest.items():
      if n > recipe.model.max_len:
        out[task]['model.max_len'] = 1 << (n - 1).bit_length()
    return out


DEFAULT = Sizes()
LAYERED = {'model.stack': 'auto', 'model.position_embedding': 'sinusoidal'}
ACT = {'model.stack_options.act': True, 'model.stack_options.max_steps': M}
RUNS = DEFAULT.runs()
TASKS = DEFAULT.tasks()


def schedule(steps):
  """The overrides of every run's schedule: one checkpoint at the end, no evaluation during
  training (evaluate() measures), a log line every 25 steps."""
  return {'total_steps': steps, 'checkpoint_every_steps': steps, 'eval_every_steps': 0,
          'log_every_steps': 25}


def base_config(task_name, steps, sizes: Sizes = DEFAULT):
  """The recipe on `task_name` for `steps` steps (harness.base_config's warm-up)."""
  return harness.base_config(sizes.recipe, steps=steps,
                             overrides={**schedule(steps), **sizes.tasks()[task_name]})


def is_act(overrides):
  """Whether a run of these overrides halts with ACT (the recipe's universal stack does)."""
  return (overrides.get('model.stack_options.act', True)
          and overrides.get('model.stack', 'universal') == 'universal')


def train(runs, task_name, *, out, steps, sizes: Sizes = DEFAULT):
  """Trains (or keeps) `runs` on `task_name` in OUT/<task>/<run>; the harness rows."""
  return harness.run(runs, base_config(task_name, steps, sizes), None,
                     os.path.join(out, task_name))


def eval_batch(task_name, sizes: Sizes = DEFAULT, num_symbols: int = 16):
  """One long evaluation batch (numpy) and its description."""
  if task_name == 'copy':
    task = synthetic.make_task('copy', num_symbols=num_symbols,
                               max_length=sizes.extrapolate * sizes.copy_train, min_length=1)
  else:
    task = synthetic.make_task('parity', num_bits=sizes.extrapolate * sizes.parity_train)
  return task.batch(EVAL_SEED, 0, sizes.eval_rows), task


def _find(tree, key):
  """The first array sown under `key` in a nested intermediates dict (sow keeps a tuple)."""
  if isinstance(tree, dict):
    for k, v in tree.items():
      if k == key:
        return v[0] if isinstance(v, tuple) else v
      found = _find(v, key)
      if found is not None:
        return found
  return None


def restore(workdir):
  """(config, setup, step, params) of a finished run, from its record and latest checkpoint."""
  config = ml_collections.ConfigDict(run_config.read_record(workdir))
  restored = assembly.load(config, workdir, required='train it first')
  return config, restored.setup, restored.step, restored.params


def evaluate(workdir, task_name, act, sizes: Sizes = DEFAULT):
  """Accuracy (and ACT steps) of a run on the long evaluation batch."""
  config, setup, step, params = restore(workdir)
  model = setup.model
  batch, task = eval_batch(task_name, sizes, config.data.num_symbols)
  copy_train, parity_train, extrapolate = sizes.copy_train, sizes.parity_train, sizes.extrapolate
  M = sizes.M  # pylint: disable=redefined-outer-name
  n_params = int(sum(np.prod(x.shape) for x in jax.tree.leaves(params)))

  @jax.jit
  def forward(params, inputs, positions, segment_ids):
    logits, sown = model.apply({'params': params}, inputs, positions=positions,
                               segment_ids=segment_ids, mutable=['intermediates'])
    return logits.argmax(-1), _find(sown.get('intermediates', {}), 'act_steps')

  @jax.jit
  def forward_plain(params, inputs, positions, segment_ids):  # ACT's early-stopping loop
    return model.apply({'params': params}, inputs, positions=positions,
                       segment_ids=segment_ids).argmax(-1)

  args = (params, batch['inputs'], batch['positions'], batch['segment_ids'])
  t = time.time()
  pred, steps = jax.device_get(forward(*args))
  forward_s = time.time() - t
  correct = (pred == batch['targets'])
  w = batch['weights'] > 0
  real = batch['segment_ids'] > 0
  result = {'step': int(step), 'params': n_params, 'forward_s_incl_compile': forward_s,
            'eval_rows': sizes.eval_rows, 'eval_seq_len': int(task.seq_len)}
  if task_name == 'copy':
    lengths = w.sum(1) - 1  # Scored: the L copied symbols and EOS.
    tok, row = {}, {}
    for length in range(1, extrapolate * copy_train + 1):
      rows = lengths == length
      if rows.any():
        tok[length] = float(correct[rows][w[rows]].mean())
        row[length] = float((correct[rows] | ~w[rows]).all(1).mean())
    result['token_accuracy_by_length'] = tok
    result['row_accuracy_by_length'] = row
    groups = {'train_lengths': lengths <= copy_train,
              'longer': lengths > copy_train,
              'longest_quarter': lengths > extrapolate * copy_train * 3 // 4}
    result['token_accuracy'] = {g: float(correct[r][w[r]].mean()) for g, r in groups.items()}
    result['row_accuracy'] = {g: float((correct[r] | ~w[r]).all(1).mean())
                              for g, r in groups.items()}
  else:
    k_acc = correct[:, 1::2].mean(0)  # Parity token k (1-based) is predicted at index 2k - 1.
    result['accuracy_by_bit'] = {k + 1: float(a) for k, a in enumerate(k_acc)}
    result['accuracy'] = {'train_lengths': float(k_acc[:parity_train].mean()),
                          'longer': float(k_acc[parity_train:].mean()),
                          'longest_quarter': float(k_acc[-parity_train // 2:].mean())}
    result['row_accuracy'] = {
        'train_lengths': float(correct[:, 1:2 * parity_train:2].all(1).mean()),
        'whole_row': float(correct[:, 1::2].all(1).mean())}
  if act:
    steps = np.asarray(steps)
    plain = jax.device_get(forward_plain(*args))
    # The early-stopping while loop must give what the masked scan gives.
    result['while_loop_scan_argmax_agreement'] = float((plain == pred)[real].mean())
    result['mean_steps'] = float(steps[real].mean())
    n = steps.shape[1]
    hist = np.zeros((n, M), np.int64)  # [position, N - 1], real tokens only
    for pos in range(n):
      hist[pos] = np.bincount(steps[real[:, pos], pos], minlength=M + 1)[1:M + 1]
    result['steps_histogram_by_position'] = hist.tolist()
    result['mean_steps_by_position'] = [
        float(steps[real[:, p], p].mean()) if real[:, p].any() else None for p in range(n)]
    pos = np.arange(n)[None, :]
    if task_name == 'copy':
      lengths_col = (w.sum(1) - 1)[:, None]
      roles = {'string': (pos >= 1) & (pos <= lengths_col),
               'sep': pos == lengths_col + 1,
               'copy': (pos > lengths_col + 1) & real}
      result['mean_steps_by_length'] = {
          int(length): float(steps[(lengths_col[:, 0] == length)[:, None] & real].mean())
          for length in np.unique(lengths_col)}
    else:
      roles = {'bit (parity scored)': (pos % 2 == 1) & real,
               'parity (next bit random)': (pos % 2 == 0) & (pos > 0) & real}
      # Difficulty for running parity: does the answer flip at this bit (bit = 1)?
      bit_one = batch['inputs'] == task.bit_offset + 1
      roles['bit = 1'] = (pos % 2 == 1) & bit_one
      roles['bit = 0'] = (pos % 2 == 1) & ~bit_one
    result['mean_steps_by_role'] = {r: float(steps[m].mean()) for r, m in roles.items()}
    result['steps_histogram_by_role'] = {
        r: np.bincount(steps[m], minlength=M + 1)[1:M + 1].tolist() for r, m in roles.items()}
    result['halted_at'] = (np.bincount(steps[real], minlength=M + 1)[1:M + 1]
                           / real.sum()).tolist()
  return result


def code_version():
  """git HEAD of this checkout, '+dirty' when models/, training/ or input_pipeline/ differ."""
  try:
    head = subprocess.run(['git', 'rev-parse', 'HEAD'], cwd=REPO, capture_output=True,
                          text=True, check=True).stdout.strip()
    dirty = subprocess.run(['git', 'status', '--porcelain', 'models', 'training',
                            'input_pipeline'], cwd=REPO, capture_output=True, text=True).stdout
    return head + ('+dirty' if dirty.strip() else '')
  except (OSError, subprocess.CalledProcessError):
    return 'unknown'


def measure(row, task_name, act, sizes: Sizes = DEFAULT):
  """In-process measurements of a trained run (its harness row) that the row lacks: the
  evaluation on the longer rows and the training curves of accuracy (and ACT's steps and
  ponder cost)."""
  workdir = row['workdir']
  measured = {'eval': evaluate(workdir, task_name, act, sizes),
              'train_accuracy': harness.scalar_curve(workdir, 'train/accuracy')}
  if act:
    measured['train_act_steps'] = harness.scalar_curve(workdir, 'train/act_steps/universal')
    measured['train_ponder'] = harness.scalar_curve(workdir, 'train/ponder/universal')
  return measured


def entry(row, measured, overrides, steps):
  """One run's JSON entry from its harness row and measure()'s measurements; train_s is None
  for a run trained by an earlier call."""
  loss = [list(p) for p in row['curves']['train_loss']]
  tail = [v for s, v in loss if s > steps * 0.9]
  train_s = None if row['already_trained'] else row['metrics']['run_seconds']
  out = {'overrides': overrides, 'train_s': train_s, 'eval': measured['eval'],
         'final_train_loss': sum(tail) / max(1, len(tail)), 'train_loss': loss,
         'train_accuracy': measured['train_accuracy']}
  for key in ('train_act_steps', 'train_ponder'):
    if key in measured:
      out[key] = measured[key]
  return out


CURVES = ('train_loss', 'train_accuracy', 'train_act_steps', 'train_ponder')


def as_row(name, e):
  """A run's JSON entry (entry()'s, with what analyze adds) as the row of experiments/rows.py
  that the JSON holds (one seed: the recipe's): its training curves its curves, its
  evaluation on the longer rows its evals['eval']."""
  curves = {k: e[k] for k in CURVES if k in e}
  return rows_lib.row(name, None, {**{k: v for k, v in e.items() if k not in curves},
                                   'curves': curves})


def analyze(rows, measured, settings, previous=None, sizes: Sizes = DEFAULT):
  """The JSON payload (without the machine) from the harness rows, each with its 'task', and
  measure()'s measurements of each, keyed by (task, run). `previous`: an earlier payload whose
  tasks and runs are kept where not rerun (and a cached run keeps its training time)."""
  results = {k: v for k, v in (previous or {}).items() if k != 'machine'}
  results['settings'] = settings
  by_name = {r.name: r.overrides for r in sizes.runs()}
  tasks = sizes.tasks()
  steps = settings['steps']
  for row in rows:
    task_name, name = row['task'], row['run']
    m = measured[task_name, name]
    act = is_act(by_name[name])
    e = entry(row, m, {**schedule(steps), **tasks[task_name], **by_name[name]}, steps)
    e['applications'] = (m['eval']['mean_steps'] if act
                         else float(sizes.T if name != 'pre_ln_1' else 1))
    task_results = results.setdefault(task_name, {})
    old = task_results.get(name)
    if (e['train_s'] is None and old and rows_lib.field(old, 'train_s', None) is not None
        and rows_lib.metric(old, 'eval/step', 'value') == e['eval']['step']):
      e['train_s'] = rows_lib.field(old, 'train_s')  # Keep the measured time of a cached run.
    task_results[name] = as_row(name, e)
  return results


def summary_row(task_name, name, entry):
  """The printed table's line of a run (its row of the JSON)."""
  value = lambda key: rows_lib.metric(entry, key, 'value')
  acc = 'eval/token_accuracy' if task_name == 'copy' else 'eval/accuracy'
  train_s = value('train_s')
  return {'task': task_name, 'run': name, 'params': value('eval/params'),
          'steps/token': value('applications'),
          'acc train len': value(f'{acc}/train_lengths'), 'acc longer': value(f'{acc}/longer'),
          'acc longest 1/4': value(f'{acc}/longest_quarter'),
          'row acc train len': value('eval/row_accuracy/train_lengths'),
          'final train loss': value('final_train_loss'),
          'train s': train_s if train_s is not None else 'cached'}


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument('--out', default='/tmp/universal_exp', help='workdirs go here')
  p.add_argument('--steps', type=int, default=STEPS, help='training steps of every run')
  p.add_argument('--tasks', default=','.join(TASKS))
  p.add_argument('--runs', default='all', help="comma-separated subset of the runs, or 'all'")
  p.add_argument('--json', default=os.path.join(REPO, 'results',
                                                'universal_experiment.json'))
  p.add_argument('--img', default=os.path.join(REPO, 'docs', 'img'))
  p.add_argument('--code', default='', help='what code the runs used, for the JSON (default: '
                 "git HEAD of this checkout, '+dirty' when models/ or training/ differ)")
  # The sizes (Sizes; experiments/paper_scale.py runs the paper's).
  p.add_argument('--recipe', default=RECIPE, help='default configs/universal_algorithmic.py')
  p.add_argument('--T', type=int, default=T, help='ut_fixed\'s steps, pre_ln_T\'s layers')
  p.add_argument('--M', type=int, default=M, help='ACT\'s cap')
  p.add_argument('--copy_train', type=int, default=COPY_TRAIN,
                 help='copy: training lengths 1..this (paper: 40)')
  p.add_argument('--parity_train', type=int, default=PARITY_TRAIN, help='parity: training bits')
  p.add_argument('--extrapolate', type=int, default=EXTRAPOLATE,
                 help='evaluation rows up to this many times the longest training row '
                 '(paper: 10, copies of up to 400)')
  p.add_argument('--eval_rows', type=int, default=EVAL_ROWS)
  args = p.parse_args(argv)
  args.sizes = Sizes(recipe=args.recipe, T=args.T, M=args.M, copy_train=args.copy_train,
                     parity_train=args.parity_train, extrapolate=args.extrapolate,
                     eval_rows=args.eval_rows)
  args.task_list = [t.strip() for t in args.tasks.split(',') if t.strip()]
  unknown = [t for t in args.task_list if t not in TASKS]
  if unknown:
    raise SystemExit(f'--tasks: unknown {unknown}; known: {", ".join(TASKS)}')
  known = [r.name for r in args.sizes.runs()]
  wanted = known if args.runs == 'all' else [r.strip() for r in args.runs.split(',')]
  if set(wanted) - set(known):
    raise SystemExit(f'--runs: unknown {sorted(set(wanted) - set(known))}; known: '
                     f'{", ".join(known)}')
  by_name = {r.name: r for r in args.sizes.runs()}
  args.run_list = [by_name[n] for n in wanted]  # In --runs' order (the order they train in).
  return args


def settings_of(args) -> dict:
  """The JSON's settings: the sizes and what code ran."""
  sizes = args.sizes
  return {'steps': args.steps, 'T': sizes.T, 'M': sizes.M,
          'copy_train_max_length': sizes.copy_train, 'parity_train_bits': sizes.parity_train,
          'extrapolate': sizes.extrapolate, 'eval_rows': sizes.eval_rows,
          'eval_seed': EVAL_SEED, 'recipe': os.path.relpath(sizes.recipe, REPO),
          'copy_symbols': harness.load_recipe(sizes.recipe).data.num_symbols,
          'code': args.code or code_version()}


def train_and_measure(args) -> tuple[list, dict]:
  """Trains (or keeps) the runs of every task and measures each: (harness rows, each with its
  'task'; {(task, run): measure()'s})."""
  by_name = {r.name: r.overrides for r in args.sizes.runs()}
  rows, measured = [], {}
  for task_name in args.task_list:
    for row in train(args.run_list, task_name, out=args.out, steps=args.steps,
                     sizes=args.sizes):
      row['task'] = task_name
      m = measured[task_name, row['run']] = measure(
          row, task_name, is_act(by_name[row['run']]), args.sizes)
      rows.append(row)
      ev = m['eval']
      print(f'[{task_name}/{row["run"]}] trained in {row["metrics"]["run_seconds"]:.1f} s'
            + (' (kept)' if row['already_trained'] else ''), flush=True)
      if 'mean_steps' in ev:
        print(f'[{task_name}/{row["run"]}] mean steps {ev["mean_steps"]:.3f}  by role '
              + '  '.join(f'{r} {v:.3f}' for r, v in ev['mean_steps_by_role'].items())
              + f'  while/scan agreement {ev["while_loop_scan_argmax_agreement"]:.4f}',
              flush=True)
  return rows, measured


def main(argv=None):
  args = parse_args(argv)
  previous = {}
  if os.path.exists(args.json):
    from experiments import migrations  # pylint: disable=import-outside-toplevel
    with open(args.json) as f:
      previous = migrations.migrate(json.load(f))  # Written before a rename: as it is now.
  settings = settings_of(args)
  rows, measured = train_and_measure(args)
  results = analyze(rows, measured, settings, previous, args.sizes)
  table = [summary_row(t, n, e) for t in TASKS if t in results for n, e in results[t].items()]
  print()
  print_table(table, list(table[0]) if table else [])
  write_json(args.json, results)
  plot(results, args.img, args.sizes)
  return results


def plot(results, img, sizes: Sizes = DEFAULT):
  plt = pyplot()
  os.makedirs(img, exist_ok=True)
  tasks = [t for t in TASKS if t in results]
  # ACT's steps against position: the share of tokens halting at each N, and the mean.
  fig, axes = plt.subplots(1, len(tasks), figsize=(6.5 * len(tasks), 4.5), squeeze=False)
  for ax, task_name in zip(axes[0], tasks):
    act = results[task_name].get('ut_act')
    ev = act and act.get('evals', {}).get('eval')
    if not ev:
      continue
    hist = np.asarray(ev['steps_histogram_by_position'], float)
    share = hist / np.maximum(hist.sum(1, keepdims=True), 1)
    im = ax.imshow(share.T, origin='lower', aspect='auto', cmap='viridis', vmin=0, vmax=1,
                   extent=(-0.5, hist.shape[0] - 0.5, 0.5, sizes.M + 0.5))
    mean = [np.nan if v is None else v for v in ev['mean_steps_by_position']]
    ax.plot(range(len(mean)), mean, color='w', lw=1.5, label='mean N')
    edge = ((2 * sizes.copy_train + 1.5) if task_name == 'copy'
            else (2 * sizes.parity_train - 0.5))
    ax.axvline(edge, color='r', ls='--', lw=1, label='longest training row')
    ax.set(title=f'{task_name}: ACT steps N per input position (share of tokens)',
           xlabel='input position', ylabel='steps N')
    ax.legend(loc='upper right', fontsize=8)
    fig.colorbar(im, ax=ax)
  save_figure(fig, os.path.join(img, 'universal_steps.png'))
  # Accuracy against length.
  fig, axes = plt.subplots(1, len(tasks), figsize=(6.5 * len(tasks), 4.5), squeeze=False)
  for ax, task_name in zip(axes[0], tasks):
    for name, entry in results[task_name].items():
      ev = rows_lib.evaluation(entry, 'eval')
      curve = ev['token_accuracy_by_length'] if task_name == 'copy' else ev['accuracy_by_bit']
      xs = sorted(curve, key=int)
      ax.plot([int(x) for x in xs], [curve[x] for x in xs], marker='.', label=name)
    train_len = sizes.copy_train if task_name == 'copy' else sizes.parity_train
    ax.axvline(train_len + 0.5, color='k', ls='--', lw=1, label='training lengths end')
    ax.set(title=f'{task_name}: ' + ('token accuracy by copy length' if task_name == 'copy'
                                      else 'accuracy at parity token k'),
           xlabel='copy length L' if task_name == 'copy' else 'bit index k', ylim=(0, 1.02))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  save_figure(fig, os.path.join(img, 'universal_accuracy.png'))


if __name__ == '__main__':
  main()
