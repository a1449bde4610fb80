"""Selective attention (Leviathan et al., 2024): the runs behind RESULTS.md's selective rows,
over seeds, and those of docs/selective_attention.md, each a real training run of
experiments/harness.py.

  python -m experiments.selective_experiments --part va --out OUT/selective_va.json
  python -m experiments.selective_experiments --part lm --text TEXT --out OUT/selective_lm.json
  python -m experiments.selective_experiments --part ablations --text TEXT \
      --out OUT/selective_ablations.json
  python -m experiments.selective_experiments --part kv --contexts 128,256 --text TEXT \
      --out OUT/selective_kv.json
  python -m experiments.selective_experiments --part kv --contexts 512 --text TEXT \
      --out OUT/selective_kv.json   # adds context 512 to the same file
  python -m experiments.selective_experiments --part synthetic --out OUT/selective_synthetic.json
  python -m experiments run selective_docs --out OUT --text TEXT   # --part docs, the page's

The runs are data (RUNS, per part: {name: variant spec or overrides}); analyze() turns the
harness rows and the in-process measurements (test answers, budget searches) into the JSON.
Every (variant, seed) trains in --workdir/<part folder>/seed<S>/<variant>, so a rerun reuses a
finished run, and the parts share runs where their configs agree: lm, ablations and kv's
context 256 train dense and selective in the same folders.

- va (appendix A.1, scaled down): configs/tiny.py's Variable Assignment (3 variables, 16
  values, --assignments assignments, d=2, batch 256) with and without selective attention
  (--va_recipe configs/selective_variable_assignment.py with --values 1000 --assignments 128
  --va_batch 2048 is the paper's size: experiments/paper_scale.py runs it on an accelerator).
  After training, each run answers --test_batches x 256 fresh examples of the training
  distribution and as many out of distribution (the same 3 variables, only --ood_values
  values: token ids the model knows, the paper's "only 2 possible values"), scored on the
  answer token; plus the eval accuracy curve.
- synthetic (appendix A.2, scaled down): Copy (--copy_max: the paper's lengths 1-24, of
  --copy_symbols symbols; the copy and its EOS scored) and Parity (--parity_bits bits; the
  parity tokens scored), each with and without selective attention, at --syn_d on
  --syn_recipe (configs/tiny.py: d=2), batch --syn_batch, --syn_steps steps. After training,
  each run's token accuracy and loss on --test_batches x --syn_batch fresh rows, plus its eval
  accuracy curve. The paper: both models reach practically 0 loss and 100% accuracy.
- lm (appendix A.8, Table 6): byte-level LM on --text, d=2 (2 layers x 2 heads of 64),
  --seq_len bytes: dense, selective and all-local sliding windows (--windows; the paper's
  all-local 32, 128 and 480 of its 512 context, scaled to --seq_len: 16, 64 and 240 of 256).
  Validation bits per byte over the whole split.
- ablations (appendices A.3-A.5): the same LM runs for selective attention without the shift
  (A.4), without the ReLU, with <BOS> maskable, with the diagonal unmasked (A.5), with a
  separate bilinear form (A.3); dense and selective for reference. Each is an option of
  models/attention/selective.py (shift, relu, mask_bos, mask_diag, separate_bilinear:
  model.attention_options.selective.<name>).
- kv (section 4, section 6.2, figure 6): at each context of --contexts (the paper's 512,
  1,024, 2,048 scaled to 128, 256, 512), dense, selective and selective with L_mem (eps 0.1,
  eq. 2). For each selective model: training/pruning.py's greedy per-layer budgets (C =
  --prune_step, on the first --prune_batches training batches) down to the dense model's loss
  on those same batches (the paper's stopping point); once every layer is down to C, the same
  greedy search goes on --fine_step tokens at a time (to K_l = 2: <BOS> and the current
  token), so a model that needs fewer than C tokens shows it. Then the validation loss with
  those budgets and the KV-cache reduction sum_l N / sum_l K_l (eval_budgets). From the same
  greedy path, the last budgets whose training-sample loss stays within --keep_tolerance of
  the model's own unpruned loss (the paper's "maintain the perplexity gains"), evaluated
  alike.
- docs (docs/selective_attention.md's runs, one seed: the recipe's): Variable Assignment
  (configs/tiny.py, --assignments, --va_batch, --va_steps, --evals evaluations) dense and
  selective; the byte-level LM on --text (d=--d, --seq_len, --batch_size, --steps, two
  evaluations of --eval_steps batches, warm-up a tenth of the steps) dense, selective and
  selective + L_mem (eps 0.1), and dense trained 3x as long; then, for both selective LMs,
  training/pruning.py's greedy budgets (C = --prune_step, on --prune_batches training
  batches, no finer step) down to the dense model's validation loss, and the validation loss
  with them. The registry's selective_docs entry gives the page's settings.

Writes the per-seed numbers and the per-variant mean and spread (sample standard deviation over
seeds) to --out (JSON). --part kv adds to an --out written by an earlier --part kv with the
same settings (other contexts or seeds), so the contexts can run as separate commands, and
plots every context's greedy pruning path next to it (--out with .png: the paper's figure 6).
A finished budget search of the same settings and checkpoint is read back, not repeated.
"""

import argparse
import copy
import json
import os
import shlex
import sys

from absl import logging

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from experiments import harness  # noqa: E402  (sets the XLA flags before JAX starts)
from experiments import rows as rows_lib  # noqa: E402

from benchmarks import common  # noqa: E402

TINY = os.path.join(REPO, 'configs', 'tiny.py')
TEXT_RECIPE = os.path.join(REPO, 'configs', 'local_text.py')
# Test examples: a seed stream apart from training (seed) and validation (seed + 10**6).
TEST_SEED_OFFSET = 2 * 10**6
TIME_STEPS = 3  # Steps per run per round of the round-robin timing (--time_rounds).

VA_VARIANTS = {'dense': 'dense', 'selective': 'selective'}
WINDOWS = '16,64,240'  # --windows' default.
ABLATIONS = {
    'selective': 'selective',
    'no_shift': 'selective:shift=False',
    'no_relu': 'selective:relu=False',
    'bos_maskable': 'selective:mask_bos=False',
    'diag_unmasked': 'selective:mask_diag=False',
    'separate_bilinear': 'selective:separate_bilinear=True',
    'dense': 'dense',
}
KV_VARIANTS = {'dense': 'dense', 'selective': 'selective',
               'selective_lmem': 'selective:lmem_eps=0.1'}
KV_KEYS = ('val_loss', 'bits_per_byte', 'reduction', 'pruned_loss', 'keep_reduction',
           'keep_loss')
# docs/selective_attention.md: the byte LM's evaluations, and how much longer the long dense
# run trains (it evaluates every --steps steps).
DOCS_LM_EVALS = 2
DOCS_LONG = 3
DOCS_PRUNED = ('selective', 'selective_lmem')


def lm_runs(windows: str = WINDOWS) -> dict:
  """The lm part's runs: dense, selective and an all-local window per --windows entry."""
  runs = {'dense': 'dense', 'selective': 'selective'}
  for w in [int(w) for w in windows.split(',')]:
    runs[f'local_{w}'] = f'local:window={w}'
  return runs


def docs_runs(steps: int) -> dict:
  """The docs part's runs: {'va': {name: spec}, 'lm': {name: spec or overrides}}."""
  return {'va': dict(VA_VARIANTS),
          'lm': {'dense': 'dense', 'selective': 'selective',
                 'selective_lmem': KV_VARIANTS['selective_lmem'],
                 f'dense_{DOCS_LONG * steps}': {
                     'model.attention': 'dense', 'total_steps': DOCS_LONG * steps,
                     'eval_every_steps': steps, 'checkpoint_every_steps': steps}}}


# Each part's runs at the default settings ({name: variant spec or overrides}); the kv part
# runs its variants at every context of --contexts.
RUNS = {'va': VA_VARIANTS, 'lm': lm_runs(), 'ablations': ABLATIONS, 'kv': KV_VARIANTS,
        'docs': docs_runs(600), 'synthetic': VA_VARIANTS}
SYNTHETIC_TASKS = ('copy', 'parity')
PARTS = tuple(RUNS)


# ------------------------------------------------------------------------------ helpers


def first_step_at(curve, threshold: float):
  """The first step of a (step, value) curve whose value reaches `threshold`, or None."""
  return next((step for step, v in sorted(curve) if v >= threshold), None)


def keep_point(history: list[dict], unpruned: float, tolerance: float, context: int,
               n_layers: int) -> list[int]:
  """The budgets the greedy path reaches before its training-sample loss first exceeds the
  unpruned loss by more than `tolerance` (relative): the greedy search with that target."""
  budgets = [context] * n_layers
  for step in history:
    if step['loss'] > unpruned * (1 + tolerance):
      break
    budgets = list(step['budgets'])
  return budgets


def at_floor(budgets: list[int], layers: list[int], step: int) -> bool:
  """No selective layer's budget can be cut by C any more (training/pruning.greedy_budgets)."""
  return all(budgets[i] - step < 2 for i in layers)


def floor_budget(context: int, step: int, fine_step: int) -> int:
  """The smallest budget the search can reach: from N down by C while >= 2, then (fine_step
  > 0 and < C) down by fine_step while >= 2."""
  k = context - step * ((context - 2) // step)
  if 0 < fine_step < step:
    k -= fine_step * ((k - 2) // fine_step)
  return k


def _command(argv) -> str:
  return 'python -m experiments.selective_experiments ' + shlex.join(
      sys.argv[1:] if argv is None else argv)


def _table(summary: dict, key: str, label: str) -> str:
  lines = [f'| variant | {label} | seeds | diverged |', '|---|---:|---:|---:|']
  for name, e in summary.items():
    mean, std = rows_lib.metric(e, key), rows_lib.metric(e, key, 'std')
    value = '-' if mean is None else f'{mean:.4f} ± {std:.4f}'
    lines.append(f'| {name} | {value} | {len(e["rows"])} | {len(e["diverged_seeds"])} |')
  return '\n'.join(lines)


# ------------------------------------------------------------------------------ configs


def lm_overrides(args, seq_len: int, seed: int | None = None) -> dict:
  """The byte-level LM runs' overrides of configs/local_text.py (the same for the lm,
  ablations and kv parts, so that they share runs); with `seed`, that seed's."""
  seeded = {} if seed is None else {'seed': seed}
  return {'data.files': os.path.abspath(args.text),
          'data.data_dir': os.path.join(os.path.abspath(args.workdir), 'tfds'),
          'seq_len': seq_len, 'batch_size': args.batch_size, **seeded,
          'eval_steps': args.eval_steps, 'learning_rate': args.learning_rate,
          'data.chunk_bytes': 4096}


def lm_base(args, seq_len: int):
  return harness.base_config(TEXT_RECIPE, steps=args.steps, evals=args.evals, d=args.d,
                             overrides=lm_overrides(args, seq_len), workdir=args.workdir)


def va_base(args, steps: int, log_every: int = 0):
  """Variable Assignment: --va_recipe (configs/tiny.py; the paper's size:
  configs/selective_variable_assignment.py) with --assignments, --values, --va_batch and, when
  given, --va_d and --va_warmup warm-up steps (else the harness's: at most a sixth of the
  steps)."""
  overrides = {'data.num_assignments': args.assignments, 'data.num_values': args.values,
               'batch_size': args.va_batch}
  if log_every:
    overrides['log_every_steps'] = log_every
  if args.va_warmup:
    overrides['warmup_steps'] = args.va_warmup
  return harness.base_config(args.va_recipe, steps=steps, evals=args.evals, d=args.va_d,
                             overrides=overrides)


def run_config(base, spec, seed):
  """A run's config as harness.run trains it (config.seed = the row's seed)."""
  config = harness.variant_config(base, spec)
  if seed is not None:
    config.seed = seed
  return config


def compare_settings(args, base, seq_len: int, seed: int) -> dict:
  """The LM runs' settings, as the JSON's 'compare' entry has recorded them since these runs
  went through benchmarks/compare.py ('set': the overrides, seed: the last seed's)."""
  data = base.data
  return {'config': os.path.relpath(TEXT_RECIPE, REPO),
          'set': [f'{k}={v}' for k, v in lm_overrides(args, seq_len, seed).items()],
          'd': args.d, 'steps': args.steps, 'seed': seed, 'seq_len': base.seq_len,
          'batch_size': base.batch_size, 'learning_rate': base.learning_rate,
          'warmup_steps': base.warmup_steps, 'eval_every_steps': base.eval_every_steps,
          'eval_steps': base.eval_steps, 'dtype': base.model.dtype, 'data': data.name,
          'time_rounds': args.time_rounds, 'time_steps': TIME_STEPS,
          'files': [os.path.basename(f) for f in data.files.split(',') if f]}


def lm_row(r: dict, batch: int, seq_len: int) -> dict:
  m = r['metrics']
  return {'variant': r['run'], 'step': m['step'], 'bits_per_byte': m['bits_per_byte'],
          'eval_loss': m['eval_loss'] if rows_lib.finite(m['eval_loss']) else None,
          'diverged': bool(r.get('diverged')), 'params': m['params'],
          'steps_per_sec': m['tokens_per_sec'] / (batch * seq_len),
          'run_seconds': m['run_seconds'], 'curves': r['curves']}


def _by_seed(rows: list[dict], runs: dict) -> dict[int, dict[str, dict]]:
  """{seed: {name: row}} of harness rows whose run is a spec of `runs` ({name: spec})."""
  names = {spec: name for name, spec in runs.items()}
  out = {}
  for r in rows:
    out.setdefault(r['seed'], {})[names[r['run']]] = r
  return {seed: {n: by_name[n] for n in runs} for seed, by_name in out.items()}


# ------------------------------------------------------------------------------ va


def fresh_scores(config, workdir: str, seed: int, batches: int, tasks: dict) -> dict:
  """{name: loss and accuracy} of a trained run on `batches` x batch_size fresh examples of
  each of `tasks` ({name: input_pipeline.synthetic task}), drawn from a seed stream apart from
  training's and validation's; one restore and one compiled eval step for all of them (their
  rows are of one length)."""
  from training import assembly, evaluation, steps
  restored = assembly.load(config, workdir, required='train it first')
  setup, step, params = restored.setup, restored.step, restored.params
  eval_step = steps.jit_eval_step(setup, restored.model)
  out = {}
  for name, task in tasks.items():
    data = [task.batch(seed + TEST_SEED_OFFSET, i, config.batch_size) for i in range(batches)]
    scored = evaluation.score(setup, eval_step, params, batches=data)
    out[name] = {'step': step, 'loss': scored['loss'], 'accuracy': scored['accuracy'],
                 'examples': int(scored['scored_tokens'])}
  return out


def va_tasks(config, num_values: int, ood_values: int) -> dict:
  """The test distributions of a Variable Assignment run: 'test' (its training distribution)
  and 'ood' (the same variables, values drawn from the first `ood_values` only: token ids the
  model knows, the paper's "only 2 possible values")."""
  from input_pipeline import synthetic
  task = lambda values: synthetic.VariableAssignment(
      num_variables=config.data.num_variables, num_values=values,
      num_assignments=config.data.num_assignments)
  return {'test': task(num_values), 'ood': task(ood_values)}


def measure_va(rows: list[dict], base, args) -> dict:
  """{(seed, variant): {'test': ..., 'ood': ..., 'accuracy_curve': ...}}: each run's answers
  on fresh examples in and out of distribution, and its eval accuracy curve."""
  out = {}
  for r in rows:
    config = run_config(base, r['run'], r['seed'])
    scores = fresh_scores(config, r['workdir'], r['seed'], args.test_batches,
                         va_tasks(config, args.values, args.ood_values))
    out[r['seed'], r['run']] = {
        **scores, 'accuracy_curve': harness.scalar_curve(r['workdir'], 'eval/accuracy')}
  return out


def analyze_va(rows: list[dict], measured: dict, settings: dict, runs=VA_VARIANTS) -> dict:
  """The va part's payload from the harness rows and measure_va's measurements."""
  per_seed = {}
  steps_per_row = settings['batch_size'] * (2 * settings['assignments'] + 2)
  for seed, by_name in _by_seed(rows, runs).items():
    per_seed[seed] = {}
    for name, r in by_name.items():
      m = measured[seed, r['run']]
      test, ood, accuracy = m['test'], m['ood'], m['accuracy_curve']
      per_seed[seed][name] = {
          'variant': r['run'], 'step': r['metrics']['step'], 'diverged': bool(r.get('diverged')),
          'accuracy': test['accuracy'], 'loss': test['loss'],
          'ood_accuracy': ood['accuracy'], 'ood_loss': ood['loss'],
          'test_examples': test['examples'],
          'first_step_99': first_step_at(accuracy, 0.99),
          'eval_accuracy_curve': accuracy, 'eval_loss_curve': r['curves']['eval_loss'],
          'steps_per_sec': r['metrics']['tokens_per_sec'] / steps_per_row,
          'run_seconds': r['metrics']['run_seconds']}
  summary = rows_lib.over_seeds(per_seed, ('accuracy', 'loss', 'ood_accuracy', 'ood_loss'))
  lines = ['| variant | accuracy | loss | OOD accuracy | OOD loss | first eval >= 99% |',
           '|---|---:|---:|---:|---:|---|']
  for name, e in summary.items():
    m, sd = e['mean'], e['std']
    lines.append(f'| {name} | {m["accuracy"]:.3f} ± {sd["accuracy"]:.3f} | '
                 f'{m["loss"]:.4f} | {m["ood_accuracy"]:.3f} ± {sd["ood_accuracy"]:.3f} | '
                 f'{m["ood_loss"]:.4f} | {rows_lib.metric(e, "first_step_99", "seeds")} |')
  return {'settings': settings, 'variants': summary, 'table': '\n'.join(lines)}


def va_settings(args) -> dict:
  recipe = harness.load_recipe(args.va_recipe)
  return {'task': 'variable_assignment', 'num_variables': recipe.data.num_variables,
          'num_values': args.values, 'ood_values': args.ood_values,
          'assignments': args.assignments, 'batch_size': args.va_batch, 'steps': args.va_steps,
          'seeds': args.seed_list, 'd': args.va_d or recipe.model.d,
          'test_examples': args.test_batches * args.va_batch}


def variants(args, all_variants: dict) -> dict:
  """{name: spec} of the --variants asked for (all by default), in their order."""
  names = [n.strip() for n in args.variants.split(',') if n.strip()] or list(all_variants)
  unknown = [n for n in names if n not in all_variants]
  if unknown:
    raise SystemExit(f'--variants: unknown {unknown}; known: {", ".join(all_variants)}')
  return {n: all_variants[n] for n in names}


def part_va(args) -> dict:
  base = va_base(args, args.va_steps)
  runs = variants(args, VA_VARIANTS)
  rows = harness.run(list(runs.values()), base, args.seed_list,
                     os.path.join(args.workdir, 'va'))
  return analyze('va', rows, measure_va(rows, base, args), va_settings(args), runs)


# ------------------------------------------------------------------------------ synthetic


def synthetic_task(name: str, args):
  """Copy (lengths 1..--copy_max of --copy_symbols symbols) or Parity (--parity_bits bits):
  input_pipeline/synthetic.py's tasks as the runs of --part synthetic train on them."""
  from input_pipeline import synthetic
  if name == 'copy':
    return synthetic.Copy(num_symbols=args.copy_symbols, max_length=args.copy_max)
  return synthetic.Parity(num_bits=args.parity_bits)


def synthetic_base(args, task: str):
  """--syn_recipe (configs/tiny.py; the paper's size: configs/selective_variable_assignment.py)
  at --syn_d (0: the recipe's d) on `task`, batch --syn_batch, --syn_steps steps (warm-up
  --syn_warmup, else the harness's)."""
  overrides = {'data.name': task, 'batch_size': args.syn_batch}
  if task == 'copy':
    overrides.update({'data.num_symbols': args.copy_symbols, 'data.max_length': args.copy_max})
  else:
    overrides['data.num_bits'] = args.parity_bits
  if args.syn_warmup:
    overrides['warmup_steps'] = args.syn_warmup
  return harness.base_config(args.syn_recipe, steps=args.syn_steps, evals=args.evals,
                             d=args.syn_d, overrides=overrides)


def synthetic_tasks(args) -> list[str]:
  names = [t.strip() for t in args.tasks.split(',') if t.strip()]
  unknown = [t for t in names if t not in SYNTHETIC_TASKS]
  if unknown:
    raise SystemExit(f'--tasks: unknown {unknown}; known: {", ".join(SYNTHETIC_TASKS)}')
  return names


def analyze_synthetic(rows: dict, measured: dict, settings: dict, runs=VA_VARIANTS) -> dict:
  """The synthetic part's payload: per task ({task: harness rows}), per variant, the test
  accuracy and loss on fresh examples (measured[task][seed, spec]) over seeds."""
  tasks, lines = {}, ['| task | variant | accuracy | loss | first eval >= 99% |',
                      '|---|---|---:|---:|---|']
  for task, task_rows in rows.items():
    per_seed = {}
    for seed, by_name in _by_seed(task_rows, runs).items():
      per_seed[seed] = {}
      for name, r in by_name.items():
        m = measured[task][seed, r['run']]
        per_seed[seed][name] = {
            'variant': r['run'], 'step': r['metrics']['step'], 'diverged': bool(r.get('diverged')),
            'accuracy': m['test']['accuracy'], 'loss': m['test']['loss'],
            'test_tokens': m['test']['examples'],
            'first_step_99': first_step_at(m['accuracy_curve'], 0.99),
            'eval_accuracy_curve': m['accuracy_curve'],
            'eval_loss_curve': r['curves']['eval_loss'],
            'run_seconds': r['metrics']['run_seconds']}
    tasks[task] = summary = rows_lib.over_seeds(per_seed, ('accuracy', 'loss'))
    for name, e in summary.items():
      m, sd = e['mean'], e['std']
      lines.append(f'| {task} | {name} | {m["accuracy"]:.3f} ± {sd["accuracy"]:.3f} | '
                   f'{m["loss"]:.4f} | {rows_lib.metric(e, "first_step_99", "seeds")} |')
  return {'settings': settings, 'tasks': tasks, 'table': '\n'.join(lines)}


def synthetic_settings(args) -> dict:
  recipe = harness.load_recipe(args.syn_recipe)
  return {'tasks': synthetic_tasks(args), 'd': args.syn_d or recipe.model.d,
          'batch_size': args.syn_batch, 'steps': args.syn_steps, 'seeds': args.seed_list,
          'copy_symbols': args.copy_symbols, 'copy_lengths': [1, args.copy_max],
          'parity_bits': args.parity_bits, 'test_rows': args.test_batches * args.syn_batch}


def part_synthetic(args) -> dict:
  runs = variants(args, VA_VARIANTS)
  rows, measured = {}, {}
  for task in synthetic_tasks(args):
    base = synthetic_base(args, task)
    rows[task] = harness.run(list(runs.values()), base, args.seed_list,
                             os.path.join(args.workdir, 'synthetic', task))
    measured[task] = {}
    for r in rows[task]:
      config = run_config(base, r['run'], r['seed'])
      scores = fresh_scores(config, r['workdir'], r['seed'], args.test_batches,
                           {'test': synthetic_task(task, args)})
      measured[task][r['seed'], r['run']] = {
          **scores, 'accuracy_curve': harness.scalar_curve(r['workdir'], 'eval/accuracy')}
  return analyze('synthetic', rows, measured, synthetic_settings(args), runs)


# ------------------------------------------------------------------------------ lm, ablations


def analyze_lm(rows: list[dict], runs: dict, settings: dict) -> dict:
  """The lm or ablations part's payload from the harness rows of `runs` ({name: spec})."""
  per_seed = {seed: {n: lm_row(r, settings['batch_size'], settings['seq_len'])
                     for n, r in by_name.items()}
              for seed, by_name in _by_seed(rows, runs).items()}
  summary = rows_lib.over_seeds(per_seed, ('bits_per_byte', 'eval_loss', 'steps_per_sec'))
  return {'settings': settings, 'variants': summary,
          'table': _table(summary, 'bits_per_byte', 'bits/byte')}


def run_lm(args, runs: dict, seq_len: int) -> tuple[list[dict], object]:
  """Trains `runs` ({name: spec}) on --text for every seed in --workdir/lm_ctx<seq_len>:
  (rows, base config)."""
  base = lm_base(args, seq_len)
  rows = harness.run(list(runs.values()), base, args.seed_list,
                     os.path.join(args.workdir, f'lm_ctx{seq_len}'),
                     time_rounds=args.time_rounds, time_steps=TIME_STEPS)
  return rows, base


def part_lm(args) -> dict:
  runs = lm_runs(args.windows)
  rows, base = run_lm(args, runs, args.seq_len)
  windows = [int(w) for w in args.windows.split(',')]
  settings = {**_lm_settings(args), 'seq_len': args.seq_len, 'windows': windows,
              'paper_windows': [round(w * 512 / args.seq_len) for w in windows],
              'compare': compare_settings(args, base, args.seq_len, args.seed_list[-1])}
  return analyze('lm', rows, runs, settings)


def part_ablations(args) -> dict:
  rows, base = run_lm(args, ABLATIONS, args.seq_len)
  settings = {**_lm_settings(args), 'seq_len': args.seq_len, 'ablations': ABLATIONS,
              'compare': compare_settings(args, base, args.seq_len, args.seed_list[-1])}
  return analyze('ablations', rows, ABLATIONS, settings)


def _lm_settings(args) -> dict:
  return {'text': os.path.basename(args.text), 'seeds': args.seed_list, 'steps': args.steps,
          'd': args.d, 'batch_size': args.batch_size, 'learning_rate': args.learning_rate,
          'eval_steps': args.eval_steps}


# ------------------------------------------------------------------------------ kv


def sample_loss(config, workdir: str, batches: int) -> float:
  """A trained run's loss on the first `batches` training batches: the sample
  training/pruning.allocate_budgets measures (the same data config gives the same batches)."""
  from training import assembly, evaluation, steps
  restored = assembly.load(config, workdir, required='train it first')
  setup = restored.setup
  try:
    it = setup.data.train_iter(0, None)
    sample = [next(it)[0] for _ in range(batches)]
  finally:
    setup.data.close()
  eval_step = steps.jit_eval_step(setup, restored.model)
  return evaluation.score(setup, eval_step, restored.params, batches=sample)['loss']


def greedy_from(loss_of, budgets: list[int], layers, step: int, target: float,
                current: float) -> tuple[list[int], float, list[dict]]:
  """training/pruning's greedy loop from given budgets (loss `current`) instead of N."""
  from training import pruning
  return pruning.greedy_cuts(loss_of, budgets, list(layers), step, target, current)


def refine(config, workdir: str, budgets: list[int], target: float, step: int):
  """Continues the greedy search below C with a finer step on the same training sample
  allocate_budgets measures (its first pruning.batches batches): (budgets, loss, history)."""
  import jax
  import jax.numpy as jnp
  from training import assembly, pruning, sharding
  restored = assembly.load(config, workdir, required='train it first')
  setup, params = restored.setup, restored.params
  try:
    it = setup.data.train_iter(0, None)
    sample = [next(it)[0] for _ in range(config.pruning.batches)]
  finally:
    setup.data.close()
  loss_fn = pruning.make_loss_fn(setup)
  with sharding.activate(setup.mesh, setup.rules):
    batches = [assembly.device_batch(setup, local) for local in sample]

    def loss_of(trial):
      arr = jnp.asarray(trial, jnp.int32)
      total, weight = 0.0, 0.0
      for batch in batches:
        s, w = jax.device_get(loss_fn(params, batch, arr))
        total, weight = total + float(s), weight + float(w)
      return total / max(weight, 1.0)

    layers = pruning.selective_layers(setup.model_config)
    return greedy_from(loss_of, budgets, layers, step, target, loss_of(budgets))


def finished_search(path: str, target: float, args, checkpoint_step: int, n_layers: int):
  """The budget file a search of these settings already wrote for this checkpoint, or None:
  the greedy search is deterministic, so a rerun (e.g. to add a context to the JSON) need not
  repeat it."""
  if not os.path.isfile(path):
    return None
  with open(path) as f:
    found = json.load(f)
  same = (found.get('target_loss') == target and found.get('step') == args.prune_step
          and found.get('batches') == args.prune_batches
          and found.get('checkpoint_step') == checkpoint_step)
  refining = 0 < args.fine_step < args.prune_step
  if 'fine_step' in found:
    done = found['fine_step'] == args.fine_step and refining
  else:  # Stopped above the floor of C, or no refinement asked for.
    done = not (refining and at_floor(found['budgets'], list(range(n_layers)),
                                      args.prune_step))
  return found if same and done else None


def greedy_path(history: list[dict], unpruned: float, context: int, n_layers: int) -> list:
  """The greedy search's (tokens kept over all layers, training-sample loss) points from the
  unpruned cache on: the trade-off curve of the paper's figure 6."""
  points = [(context * n_layers, unpruned)] + [(sum(h['budgets']), h['loss']) for h in history]
  return [[int(k), round(float(loss), 5)] for k, loss in points]


def prune(config, workdir: str, target: float, args, checkpoint_step: int) -> dict:
  """Greedy budgets (C = --prune_step, then --fine_step once every layer is down to C) to
  `target` on the training sample; their validation loss and KV-cache reduction; and the
  keep-the-gains point of the same greedy path."""
  from training import pruning
  config = copy.deepcopy(config)
  config.pruning.step = args.prune_step
  config.pruning.batches = args.prune_batches
  config.pruning.target_loss = target
  config.pruning.tolerance = 0.0
  config.pruning.budget_file = os.path.join(workdir, 'budgets_at_dense_loss.json')
  n_layers = config.model.n_layers
  found = finished_search(config.pruning.budget_file, target, args, checkpoint_step, n_layers)
  if found is None:
    found = pruning.allocate_budgets(config, workdir)
  else:
    logging.info('reusing the finished budget search %s', config.pruning.budget_file)
  budgets, loss, history = found['budgets'], found['loss'], list(found['history'])
  context = found['context']
  layers = list(range(len(budgets)))  # Every layer is selective here.
  step = args.fine_step if 'fine_step' in found else args.prune_step
  if (0 < args.fine_step < args.prune_step and 'fine_step' not in found
      and at_floor(budgets, layers, args.prune_step)):
    budgets, loss, fine = refine(config, workdir, budgets, target, args.fine_step)
    history += fine
    step = args.fine_step
    with open(config.pruning.budget_file, 'w') as f:
      json.dump({**found, 'budgets': budgets, 'loss': loss, 'history': history,
                 'fine_step': args.fine_step,
                 'memory_reduction': pruning.memory_reduction(budgets, context)}, f, indent=2)
  at_dense = pruning.evaluate_budgets(config, workdir)
  keep = keep_point(history, found['unpruned_loss'], args.keep_tolerance, context,
                    len(budgets))
  keep_file = os.path.join(workdir, 'budgets_keep_gain.json')
  with open(keep_file, 'w') as f:
    json.dump({'budgets': keep, 'context': context,
               'tolerance': args.keep_tolerance}, f, indent=2)
  config.pruning.budget_file = keep_file
  kept = pruning.evaluate_budgets(config, workdir)
  return {
      'unpruned_loss': at_dense['unpruned_loss'], 'sample_unpruned_loss': found['unpruned_loss'],
      'sample_target': target,
      'budgets': budgets, 'reduction': at_dense['memory_reduction'],
      'pruned_loss': at_dense['loss'], 'sample_pruned_loss': loss,
      'at_floor': at_floor(budgets, layers, step),
      'floor_reduction': context / floor_budget(context, args.prune_step, args.fine_step),
      'cuts': len(history),
      'path': greedy_path(history, found['unpruned_loss'], context, len(budgets)),
      'keep_budgets': keep, 'keep_reduction': kept['memory_reduction'],
      'keep_loss': kept['loss']}


def measure_kv(rows: list[dict], base, args) -> dict:
  """{(seed, variant): measurements} of one context's runs: the dense model's loss on the
  pruning sample (the search's target); each selective model's budget search and evaluations
  (prune)."""
  out = {}
  for seed, by_name in _by_seed(rows, KV_VARIANTS).items():
    dense = by_name['dense']
    target = sample_loss(run_config(base, dense['run'], seed), dense['workdir'],
                         args.prune_batches)
    out[seed, dense['run']] = {'sample_loss': target}
    for name in ('selective', 'selective_lmem'):
      r = by_name[name]
      out[seed, r['run']] = prune(run_config(base, r['run'], seed), r['workdir'], target, args,
                                  r['metrics']['step'])
  return out


def analyze_kv(rows: dict[int, list[dict]], measured: dict[int, dict], settings: dict) -> dict:
  """The kv part's payload from the harness rows and measure_kv's measurements, each
  {context: ...}."""
  out = {}
  for context, context_rows in rows.items():
    per_seed = {}
    for seed, by_name in _by_seed(context_rows, KV_VARIANTS).items():
      per_seed[seed] = {}
      for name, r in by_name.items():
        row = {**lm_row(r, settings['batch_size'], context),
               'val_loss': r['metrics']['eval_loss'], **measured[context][seed, r['run']]}
        row.pop('curves')
        per_seed[seed][name] = row
    out[str(context)] = rows_lib.over_seeds(per_seed, KV_KEYS)
  return {'settings': settings, 'contexts': out, 'table': kv_table(out)}


def part_kv(args) -> dict:
  rows, measured = {}, {}
  for context in [int(c) for c in args.contexts.split(',')]:
    rows[context], base = run_lm(args, KV_VARIANTS, context)
    measured[context] = measure_kv(rows[context], base, args)
  return analyze('kv', rows, measured, kv_settings(args))


def kv_settings(args) -> dict:
  return {**_lm_settings(args), 'contexts': [int(c) for c in args.contexts.split(',')],
          'prune_step': args.prune_step, 'fine_step': args.fine_step,
          'prune_batches': args.prune_batches, 'keep_tolerance': args.keep_tolerance,
          'lmem_eps': 0.1, 'variants': KV_VARIANTS}


def kv_table(contexts: dict) -> str:
  lines = ['| context | model | val loss | pruned loss | KV reduction at dense loss | '
           'keep-gain reduction |', '|---:|---|---:|---:|---:|---:|']
  for context, summary in sorted(contexts.items(), key=lambda kv: int(kv[0])):
    for name, e in summary.items():
      m = e['mean']
      if name == 'dense':
        lines.append(f'| {context} | dense | {m["val_loss"]:.4f} | - | - | - |')
      else:
        lines.append(f'| {context} | {name} | {m["val_loss"]:.4f} | {m["pruned_loss"]:.4f} | '
                     f'{m["reduction"]:.1f}x ± {e["std"]["reduction"]:.1f} | '
                     f'{m["keep_reduction"]:.1f}x |')
  return '\n'.join(lines)


def plot_kv(payload: dict, path: str) -> None:
  """The paper's figure 6 at our scale: per context, the training-sample loss along each
  seed's greedy path against the KV cache kept (fraction of the full cache), for selective
  attention with and without L_mem; dotted: the dense model's loss on the same sample, the
  search's target."""
  plt = common.pyplot()
  contexts = sorted(payload['contexts'].items(), key=lambda kv: int(kv[0]))
  fig, axes = plt.subplots(1, len(contexts), figsize=(4.2 * len(contexts), 3.8), squeeze=False)
  colors = {'selective': 'tab:blue', 'selective_lmem': 'tab:green'}
  for ax, (context, summary) in zip(axes[0], contexts):
    for name, color in colors.items():
      for i, seed in enumerate(rows_lib.seed_rows(summary[name])):
        greedy = seed.get('path')
        if not greedy:
          continue
        full = greedy[0][0]
        ax.plot([k / full for k, _ in greedy], [loss for _, loss in greedy],
                color=color, alpha=0.85, lw=1.2, ls='-' if i == 0 else '--',
                label=f'{name} (seed {seed["seed"]})')
        kept = sum(seed['keep_budgets'])
        loss = next((loss for k, loss in reversed(greedy) if k == kept), None)
        if loss is not None:
          ax.plot([kept / full], [loss], 'o', color=color, ms=4)
    for i, target in enumerate(rows_lib.metric(summary['selective'], 'sample_target', 'seeds')):
      ax.axhline(target, color='tab:orange', ls=':', lw=1.2,
                 label='dense (the target)' if i == 0 else None)
    ax.set_xscale('log')
    ax.set_xlabel('KV cache kept (fraction of N x layers)')
    ax.set_title(f'N = {context}', fontsize=9)
    ax.grid(alpha=0.3)
  axes[0][0].set_ylabel('training-sample loss (nats/byte)')
  axes[0][-1].legend(fontsize=7)
  fig.suptitle('Greedy context pruning (dots: the keep-gain budgets)', fontsize=9)
  common.save_figure(fig, path)


def merge_kv(path: str, payload: dict) -> dict:
  """payload's results added to those of an earlier --part kv file at `path` with the same
  settings but for the contexts and seeds, so that contexts (or seeds) can run as separate
  commands into one file; a (context, seed) run again replaces the earlier one."""
  if not os.path.isfile(path):
    return payload
  from experiments import migrations  # pylint: disable=import-outside-toplevel
  with open(path) as f:
    old = migrations.migrate(json.load(f))  # A file written before a rename: as it is now.
  same = lambda s: {k: v for k, v in s.items() if k not in ('contexts', 'seeds')}
  if old.get('part') != 'kv' or same(old['settings']) != same(
      json.loads(json.dumps(payload['settings']))):
    raise SystemExit(f'{path} holds other results (not --part kv with these settings): '
                     'remove it or write to another --out')
  contexts = dict(old['contexts'])
  for context, summary in payload['contexts'].items():
    per_seed = {}
    for entries in (contexts.get(context, {}), summary):
      for name, entry in entries.items():
        for row in rows_lib.seed_rows(entry):
          per_seed.setdefault(row['seed'], {})[name] = row
    complete = {seed: rows for seed, rows in per_seed.items() if len(rows) == len(summary)}
    contexts[context] = rows_lib.over_seeds(dict(sorted(complete.items())), KV_KEYS)
  seeds = sorted({r['seed'] for c in contexts.values() for e in c.values()
                  for r in rows_lib.seed_rows(e)})
  settings = {**payload['settings'], 'contexts': sorted(int(c) for c in contexts),
              'seeds': seeds}
  return {**payload, 'settings': settings, 'contexts': contexts, 'table': kv_table(contexts),
          'commands': old.get('commands', [old['command']]) + [payload['command']]}


# ------------------------------------------------------------------------------ docs


def docs_lm_base(args):
  """docs/selective_attention.md's byte LM: configs/local_text.py at --d, --seq_len,
  --batch_size, --learning_rate, warm-up a tenth of --steps, two evaluations of --eval_steps
  batches (a checkpoint at each), a log line every sixth of the run."""
  steps = args.steps
  every = max(1, steps // DOCS_LM_EVALS)
  return harness.base_config(
      TEXT_RECIPE, steps=steps, evals=DOCS_LM_EVALS, d=args.d, workdir=args.workdir,
      overrides={'data.files': os.path.abspath(args.text),
                 'data.data_dir': os.path.join(os.path.abspath(args.workdir), 'tfds'),
                 'seq_len': args.seq_len, 'batch_size': args.batch_size,
                 'learning_rate': args.learning_rate, 'warmup_steps': max(1, steps // 10),
                 'log_every_steps': max(1, steps // 6), 'eval_steps': args.eval_steps,
                 'checkpoint_every_steps': every})


def docs_prune(config, workdir: str, target: float, args, checkpoint_step: int) -> dict:
  """training/pruning.py's greedy budgets (C = --prune_step, --prune_batches training
  batches, no finer step) down to `target` (WORKDIR/budgets.json, reused when a search of
  these settings already ran on this checkpoint), then the validation loss with them."""
  from training import pruning
  config = copy.deepcopy(config)
  config.pruning.step = args.prune_step
  config.pruning.batches = args.prune_batches
  config.pruning.target_loss = target
  config.pruning.budget_file = os.path.join(workdir, 'budgets.json')
  coarse = argparse.Namespace(**{**vars(args), 'fine_step': 0})
  found = finished_search(config.pruning.budget_file, target, coarse, checkpoint_step,
                          config.model.n_layers)
  if found is None:
    found = pruning.allocate_budgets(config, workdir)
  evaluated = pruning.evaluate_budgets(config, workdir)
  return {'target': target, 'budgets': found['budgets'], 'context': found['context'],
          'reduction': evaluated['memory_reduction'], 'pruned_loss': evaluated['loss'],
          'unpruned_loss': evaluated['unpruned_loss'],
          'sample_unpruned_loss': found['unpruned_loss'], 'sample_pruned_loss': found['loss'],
          'cuts': len(found['history'])}


def measure_docs(va_rows: list[dict], lm_rows: list[dict], lm, args) -> dict:
  """The page's measurements: each Variable Assignment run's eval accuracy curve; each
  selective LM's budgets down to the dense LM's validation loss (docs_prune)."""
  lm_by = {r['run']: r for r in lm_rows}
  runs = docs_runs(args.steps)['lm']
  target = lm_by['dense']['metrics']['eval_loss']
  return {'va_accuracy': {r['run']: harness.scalar_curve(r['workdir'], 'eval/accuracy')
                          for r in va_rows},
          'pruning': {name: docs_prune(harness.variant_config(lm, runs[name]),
                                       lm_by[name]['workdir'], target, args,
                                       lm_by[name]['metrics']['step'])
                      for name in DOCS_PRUNED}}


def analyze_docs(va_rows: list[dict], lm_rows: list[dict], measured: dict,
                 settings: dict) -> dict:
  """docs/selective_attention.md's tables from the harness rows and measure_docs'
  measurements."""
  va, lm = {}, {}
  for r in va_rows:
    m = r['metrics']
    va[r['run']] = rows_lib.row(r['run'], r['seed'], {
        'step': m['step'], 'eval_loss': m['eval_loss'],
        'eval_accuracy_curve': measured['va_accuracy'][r['run']],
        'eval_loss_curve': r['curves']['eval_loss'], 'run_seconds': m['run_seconds']})
  for r in lm_rows:
    m = r['metrics']
    lm[r['run']] = rows_lib.row(r['run'], r['seed'], {
        'step': m['step'], 'eval_loss': m['eval_loss'], 'bits_per_byte': m['bits_per_byte'],
        'eval_loss_curve': r['curves']['eval_loss'], 'params': m['params'],
        'run_seconds': m['run_seconds']})
  pruning = measured['pruning']
  steps = sorted({s for e in va.values() for s, _ in e['curves']['eval_accuracy']})
  lines = ['| step | ' + ' | '.join(str(s) for s in steps) + ' |',
           '|---|' + '---|' * len(steps)]
  for name, e in va.items():
    acc = dict(e['curves']['eval_accuracy'])
    cells = [f'{acc[s]:.2f}' if s in acc else '-' for s in steps]
    cells[-1] += f' (loss {rows_lib.metric(e, "eval_loss", "value"):.4g})'
    lines.append(f'| {name} | ' + ' | '.join(cells) + ' |')
  lines += ['', '| model | loss (nats/byte) | bits per byte |', '|---|---|---|']
  for name, e in lm.items():
    curve = ', '.join(f'{v:.3f} at {s}' for s, v in e['curves']['eval_loss'][:-1])
    label = f'{name} ({curve})' if name.startswith('dense_') and curve else name
    lines.append(f'| {label} | {rows_lib.metric(e, "eval_loss", "value"):.3f} | '
                 f'{rows_lib.metric(e, "bits_per_byte", "value"):.3f} |')
  lines += ['', f'| model | budgets K_l (of {settings["lm"]["seq_len"]}) | KV-cache reduction '
            '| loss with budgets | unpruned |', '|---|---|---|---|---|']
  for name, p in pruning.items():
    lines.append(f'| {name} | {p["budgets"]} | {p["reduction"]:.3g}x | '
                 f'{p["pruned_loss"]:.3f} ({p["pruned_loss"] - p["unpruned_loss"]:+.2g}) | '
                 f'{p["unpruned_loss"]:.3f} |')
  return {'settings': settings, 'va': va, 'lm': lm, 'pruning': pruning,
          'table': '\n'.join(lines)}


def docs_settings(args, va, lm) -> dict:
  runs = docs_runs(args.steps)
  return {'va': {'recipe': os.path.relpath(TINY, REPO), 'steps': args.va_steps,
                 'assignments': args.assignments, 'values': args.values,
                 'batch_size': args.va_batch, 'eval_every_steps': va.eval_every_steps,
                 'seed': va.seed, 'variants': runs['va']},
          'lm': {'recipe': os.path.relpath(TEXT_RECIPE, REPO),
                 'text': os.path.basename(args.text), 'd': args.d, 'seq_len': args.seq_len,
                 'batch_size': args.batch_size, 'steps': args.steps,
                 'learning_rate': args.learning_rate, 'warmup_steps': lm.warmup_steps,
                 'eval_every_steps': lm.eval_every_steps, 'eval_steps': args.eval_steps,
                 'seed': lm.seed, 'variants': runs['lm']},
          'pruning': {'step': args.prune_step, 'batches': args.prune_batches,
                      'target': 'the dense LM\'s validation loss'}}


def part_docs(args) -> dict:
  runs = docs_runs(args.steps)
  va = va_base(args, args.va_steps, log_every=max(1, args.va_steps // 12))
  va_rows = harness.run([harness.Run(n, s) for n, s in runs['va'].items()], va, None,
                        os.path.join(args.workdir, 'docs', 'va'))
  lm = docs_lm_base(args)
  lm_rows = harness.run([harness.Run(n, s) for n, s in runs['lm'].items()], lm, None,
                        os.path.join(args.workdir, 'docs', 'lm'))
  measured = measure_docs(va_rows, lm_rows, lm, args)
  return analyze('docs', va_rows, lm_rows, measured, docs_settings(args, va, lm))


# ------------------------------------------------------------------------------ main


ANALYZE = {'va': analyze_va, 'lm': analyze_lm, 'ablations': analyze_lm, 'kv': analyze_kv,
           'docs': analyze_docs, 'synthetic': analyze_synthetic}


def analyze(part: str, *args, **kwargs) -> dict:
  """The JSON payload of `part` (without the command) from its harness rows and its
  in-process measurements: analyze_va, analyze_lm (lm, ablations), analyze_kv, analyze_docs,
  analyze_synthetic."""
  return ANALYZE[part](*args, **kwargs)


def parse_args(argv):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument('--part', required=True, choices=PARTS)
  p.add_argument('--out', required=True, help='JSON of the results')
  p.add_argument('--text', default='', help='byte-level text (lm, ablations, kv, docs)')
  p.add_argument('--workdir', default=os.path.join(REPO, 'runs', 'selective'))
  p.add_argument('--seeds', default='', help='default: 0,1,2 (kv: 0,1; docs: the recipe\'s '
                 'seed only)')
  p.add_argument('--evals', type=int, default=10)
  # Variable Assignment.
  p.add_argument('--va_steps', type=int, default=800)
  p.add_argument('--assignments', type=int, default=8)
  p.add_argument('--values', type=int, default=16)
  p.add_argument('--ood_values', type=int, default=2)
  p.add_argument('--va_batch', type=int, default=256)
  p.add_argument('--va_recipe', default=TINY, help='the recipe (default configs/tiny.py; the '
                 "paper's size: configs/selective_variable_assignment.py)")
  p.add_argument('--va_d', type=int, default=0, help="d (0: the recipe's)")
  p.add_argument('--va_warmup', type=int, default=0,
                 help="warm-up steps (0: the harness's, at most a sixth of the steps)")
  p.add_argument('--test_batches', type=int, default=8,
                 help='fresh test batches per model (va, synthetic)')
  p.add_argument('--variants', default='',
                 help='va, synthetic: a comma list of dense, selective (default: both)')
  # Copy and Parity (appendix A.2).
  p.add_argument('--tasks', default=','.join(SYNTHETIC_TASKS), help='synthetic: copy, parity')
  p.add_argument('--syn_recipe', default=TINY, help='synthetic: the recipe (its model, '
                 "optimizer and dtype; the paper's size: configs/selective_variable_assignment.py)")
  p.add_argument('--syn_d', type=int, default=0, help="synthetic: d (0: the recipe's)")
  p.add_argument('--syn_batch', type=int, default=64)
  p.add_argument('--syn_steps', type=int, default=600)
  p.add_argument('--syn_warmup', type=int, default=0,
                 help="synthetic: warm-up steps (0: the harness's)")
  p.add_argument('--copy_symbols', type=int, default=16, help='copy: alphabet (paper: not given)')
  p.add_argument('--copy_max', type=int, default=24, help='copy: lengths 1..this (paper: 24)')
  p.add_argument('--parity_bits', type=int, default=32, help='parity: bits (paper: not given)')
  # Byte-level LM.
  p.add_argument('--steps', type=int, default=800)
  p.add_argument('--d', type=int, default=2)
  p.add_argument('--seq_len', type=int, default=256)
  p.add_argument('--batch_size', type=int, default=8)
  p.add_argument('--learning_rate', type=float, default=0.003)
  p.add_argument('--eval_steps', type=int, default=0,
                 help='validation batches per evaluation (0: the whole split)')
  p.add_argument('--time_rounds', type=int, default=0,
                 help="the harness's round-robin step timing (0: the runs' logged tokens/s)")
  p.add_argument('--windows', default=WINDOWS,
                 help='all-local windows (lm; paper: 32, 128, 480 of 512)')
  # KV-cache pruning.
  p.add_argument('--contexts', default='128,256,512')
  p.add_argument('--prune_step', type=int, default=8, help='C (paper: 8)')
  p.add_argument('--fine_step', type=int, default=1,
                 help='once every layer is down to C, go on cutting this many (0: stop at C)')
  p.add_argument('--prune_batches', type=int, default=4)
  p.add_argument('--keep_tolerance', type=float, default=0.005,
                 help='keep-gain point: training-sample loss within this fraction of unpruned')
  args = p.parse_args(argv)
  if args.part not in ('va', 'synthetic') and not os.path.isfile(args.text):
    p.error(f'--part {args.part} needs --text (a byte-level text file): {args.text!r}')
  args.seed_list = [int(s) for s in (args.seeds or ('0,1' if args.part == 'kv' else '0,1,2'))
                    .split(',')]
  return args


def main(argv=None) -> dict:
  args = parse_args(argv)
  payload = {'va': part_va, 'lm': part_lm, 'ablations': part_ablations, 'kv': part_kv,
             'docs': part_docs, 'synthetic': part_synthetic}[args.part](args)
  payload = {'command': _command(argv), 'part': args.part, **payload}
  if args.part == 'kv':
    payload = merge_kv(args.out, payload)
    plot_kv(payload, os.path.splitext(args.out)[0] + '.png')
  print('\n' + payload['table'] + '\n')
  common.write_json(args.out, payload)
  return payload


if __name__ == '__main__':
  main()
