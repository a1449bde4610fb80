"""ACT without its ponder cost: the ablation that RESULTS.md's row "the ponder cost keeps the
number of steps down" needs (experiments/claims_survey.py).

  python -m experiments.survey_act_ponder --out experiments/results/act_ponder.json
  python -m experiments.survey_act_ponder --tasks copy,parity --out OUT/act_ponder.json

Trains experiments/universal_experiment.py's `ut_act` run (configs/universal_algorithmic.py:
one shared block of width 64, ACT with at most M = 8 steps) with model.stack_options.ponder = τ
for each τ of --taus (default 0: no ponder cost; the recipe's τ = 0.01 run is
universal_experiment.json's ut_act, same seed, data and steps), then evaluates it on the same
longer rows with the same code (universal_experiment.evaluate). Each entry has the same
fields as universal_experiment.json's (eval with mean_steps and halted_at, train_act_steps,
train_ponder, final_train_loss). Copy took 13 minutes on a 2-core CPU shared with other jobs.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from experiments import universal_experiment as ue  # noqa: E402
from benchmarks.common import scalar_curve, write_json  # noqa: E402


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument('--out', required=True, help='the JSON to write')
  p.add_argument('--workdir', default='/tmp/survey_act_ponder', help='training runs go here')
  p.add_argument('--steps', type=int, default=2000, help='as universal_experiment.json')
  p.add_argument('--tasks', default='copy')
  p.add_argument('--taus', default='0')
  args = p.parse_args(argv)
  results = {'settings': {'steps': args.steps, 'M': ue.M,
                          'recipe': 'configs/universal_algorithmic.py',
                          'base_run': 'ut_act of experiments/universal_experiment.py',
                          'code': ue._code_version(),  # pylint: disable=protected-access
                          'command': 'python -m experiments.survey_act_ponder ' + ' '.join(
                              sys.argv[1:] if argv is None else argv)}}
  common = {'total_steps': args.steps, 'checkpoint_every_steps': args.steps,
            'eval_every_steps': 0, 'log_every_steps': 25}
  for task in args.tasks.split(','):
    for tau in (float(t) for t in args.taus.split(',')):
      name = f'ut_act_tau{tau:g}'
      overrides = {**common, **ue.TASKS[task], **ue.RUNS['ut_act'],
                   'model.stack_options.ponder': tau}
      t = time.time()
      workdir, _ = ue.train(name, overrides, out=os.path.join(args.workdir, task),
                            steps=args.steps)
      seconds = time.time() - t
      ev = ue.evaluate(workdir, task, act=True)
      loss = scalar_curve(workdir, 'train/loss')
      tail = [v for s, v in loss if s > args.steps * 0.9]
      results.setdefault(task, {})[name] = {
          'overrides': overrides, 'tau': tau, 'train_s': seconds, 'eval': ev,
          'final_train_loss': sum(tail) / max(1, len(tail)), 'train_loss': loss,
          'train_act_steps': scalar_curve(workdir, 'train/act_steps/universal'),
          'train_ponder': scalar_curve(workdir, 'train/ponder/universal')}
      print(f'[{task}/{name}] mean steps {ev["mean_steps"]:.3f}, halted at '
            f'{[round(h, 3) for h in ev["halted_at"]]}, accuracy within the training lengths '
            f'{(ev.get("token_accuracy") or ev["accuracy"])["train_lengths"]:.3f}', flush=True)
  write_json(args.out, results)


if __name__ == '__main__':
  main()
