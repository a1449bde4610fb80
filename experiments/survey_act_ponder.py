"""ACT without its ponder cost: the ablation that RESULTS.md's row "the ponder cost keeps the
number of steps down" needs (experiments/claims_survey.py).

  python -m experiments.survey_act_ponder --out results/act_ponder.json
  python -m experiments.survey_act_ponder --tasks copy,parity --out OUT/act_ponder.json

Trains experiments/universal_experiment.py's `ut_act` run (configs/universal_algorithmic.py:
one shared layer of width 64, ACT with at most M = 8 steps) with model.stack_options.ponder = τ
for each τ of --taus (default 0: no ponder cost; the recipe's τ = 0.01 run is
universal_experiment.json's ut_act, same seed, data and steps). The runs are data (runs(taus),
RUNS for the default τ), trained in process through experiments/harness.py as
universal_experiment.py trains its own (--workdir/<task>/ut_act_tau<τ>; a finished run is
kept), then evaluated on the same longer rows with the same code (universal_experiment.measure).
analyze() gives each run the same row as universal_experiment.json's (experiments/rows.py:
its eval with mean_steps and halted_at, its curves train_act_steps and train_ponder,
final_train_loss) plus τ. Copy took
13 minutes on a 2-core CPU shared with other jobs.
"""

from __future__ import annotations

import argparse
import sys

from experiments import universal_experiment as ue  # (sets the XLA flags before JAX starts)
from experiments import harness
from benchmarks.common import write_json

TAUS = (0.0,)
STEPS = 2000  # As universal_experiment.json.


def runs(taus) -> tuple[harness.Run, ...]:
  """ut_act with ponder cost τ, for each τ."""
  return tuple(harness.Run(f'ut_act_tau{tau:g}', {**ue.ACT, 'model.stack_options.ponder': tau})
               for tau in taus)


RUNS = runs(TAUS)


def analyze(rows, measured, settings, trained=RUNS) -> dict:
  """The JSON payload (without the machine) from the harness rows of the runs `trained`, each
  row with its 'task', and universal_experiment.measure()'s measurements of each, keyed by
  (task, run)."""
  by_name = {r.name: r.overrides for r in trained}
  results = {'settings': settings}
  for row in rows:
    task, name = row['task'], row['run']
    overrides = {**ue.schedule(settings['steps']), **ue.TASKS[task], **by_name[name]}
    entry = ue.entry(row, measured[task, name], overrides, settings['steps'])
    results.setdefault(task, {})[name] = ue.as_row(name, {
        'overrides': overrides, 'tau': by_name[name]['model.stack_options.ponder'],
        'train_s': row['metrics']['run_seconds'], 'eval': entry['eval'],
        'final_train_loss': entry['final_train_loss'], 'train_loss': entry['train_loss'],
        'train_act_steps': entry['train_act_steps'], 'train_ponder': entry['train_ponder']})
  return results


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument('--out', required=True, help='the JSON to write')
  p.add_argument('--workdir', default='/tmp/survey_act_ponder', help='training runs go here')
  p.add_argument('--steps', type=int, default=STEPS, help='as universal_experiment.json')
  p.add_argument('--tasks', default='copy')
  p.add_argument('--taus', default=','.join(f'{t:g}' for t in TAUS))
  args = p.parse_args(argv)
  tasks = [t.strip() for t in args.tasks.split(',') if t.strip()]
  unknown = [t for t in tasks if t not in ue.TASKS]
  if unknown:
    raise SystemExit(f'--tasks: unknown {unknown}; known: {", ".join(ue.TASKS)}')
  taus = [float(t) for t in args.taus.split(',')]
  settings = {'steps': args.steps, 'M': ue.M, 'recipe': 'configs/universal_algorithmic.py',
              'base_run': 'ut_act of experiments/universal_experiment.py',
              'code': ue.code_version(),
              'command': 'python -m experiments.survey_act_ponder ' + ' '.join(
                  sys.argv[1:] if argv is None else argv)}
  trained = runs(taus)
  rows, measured = [], {}
  for task in tasks:
    for row in ue.train(trained, task, out=args.workdir, steps=args.steps):
      row['task'] = task
      measured[task, row['run']] = ue.measure(row, task, act=True)
      ev = measured[task, row['run']]['eval']
      rows.append(row)
      print(f'[{task}/{row["run"]}] mean steps {ev["mean_steps"]:.3f}, halted at '
            f'{[round(h, 3) for h in ev["halted_at"]]}, accuracy within the training lengths '
            f'{(ev.get("token_accuracy") or ev["accuracy"])["train_lengths"]:.3f}', flush=True)
  results = analyze(rows, measured, settings, trained)
  write_json(args.out, results)
  return results


if __name__ == '__main__':
  main()
