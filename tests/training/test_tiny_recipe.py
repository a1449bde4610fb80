"""The tiny CPU recipe learns: eval loss ends well below the task's chance loss.

Thresholds are fractions of the task's chance loss (DataSource.chance_loss: ln(num_values)
for Variable Assignment, ln(num_symbols) for Copy), set with a wide margin above what these
exact runs reach on CPU (the runs are deterministic; the margin covers other XLA builds).

Measured on 2 CPU cores (eval over eval_steps x eval batch fixed validation examples):
  * Variable Assignment as in configs/tiny.py (3 variables, 16 values, 4 assignments, batch
    256) stopped at 200 steps: eval loss 0.61 = 0.22 x chance, accuracy 0.71, under a
    minute. With 16 assignments and batch 64 the dense model plateaus near 0.63 x chance:
    it learns which values can be the answer but not which assignment is the last one.
  * Copy (16 symbols, strings up to 8) with batch 32 for 300 steps: 0.091 = 0.033 x chance,
    accuracy 0.976, under half a minute.
  * The same Copy run through main.py stopped at 40 steps: train loss 2.91 over steps 1-10,
    0.93 over steps 31-40; eval loss 0.84 = 0.30 x chance, accuracy 0.74 (about 25 s with
    compiling, 10 s from the compilation cache).

The runs of hundreds of steps are marked slow (CI and the default run skip them; run them
with `-m slow`); the default run keeps the short Copy run through main.py (a subprocess: the
flags, the training loop, its in-loop eval and the final checkpoint).
"""

import math
import re

import pytest

from configs import tiny
from training import assembly, evaluation, train

# Fast Variable Assignment run: the tiny recipe stopped at half its steps.
VA_FAST = {'total_steps': 200}
VA_FAST_MAX_LOSS_FRACTION = 0.4    # Measured 0.22.
VA_FAST_MIN_ACCURACY = 0.5         # Measured 0.71; chance 1/16.

# configs/tiny.py exactly (slow: about 2 CPU minutes).
VA_DEFAULT_MAX_LOSS_FRACTION = 0.3  # Measured 0.20 (eval loss 0.561).
VA_DEFAULT_MIN_ACCURACY = 0.6        # Measured 0.73.

COPY = {'data.name': 'copy', 'data.num_symbols': 16, 'data.max_length': 8, 'batch_size': 32,
        'total_steps': 300}
COPY_MAX_LOSS_FRACTION = 0.1  # Measured 0.033.
COPY_MIN_ACCURACY = 0.9       # Measured 0.976; chance about 1/16.

# The Copy run through main.py, stopped early (on top of the harness's FAST overrides).
COPY_MAIN = {**COPY, 'total_steps': 40, 'warmup_steps': 5, 'log_every_steps': 10,
             'eval_every_steps': 40, 'eval_steps': 2, 'checkpoint_every_steps': 40}
COPY_MAIN_MAX_LOSS_FRACTION = 0.6  # Measured 0.30.
COPY_MAIN_MIN_ACCURACY = 0.4       # Measured 0.74.


def _config(overrides):
  config = tiny.get_config()
  config.peak_tflops_per_device = 1.0
  config.eval_every_steps = 0  # Evaluated once at the end, by evaluation.evaluate_checkpoint.
  config.update_from_flattened_dict(overrides)
  return config


def _train_and_eval(config, workdir):
  state = train.train_and_evaluate(config, str(workdir))
  assert int(state.step) == config.total_steps
  result = evaluation.evaluate_checkpoint(config, str(workdir))
  assert result['step'] == config.total_steps
  chance = assembly.build(config).data.chance_loss
  return result, chance


def _report(name, result, chance):
  return (f'{name}: eval loss {result["loss"]:.4f} = {result["loss"] / chance:.3f} x chance '
          f'({chance:.4f}), accuracy {result["accuracy"]:.3f}')


@pytest.mark.slow
def test_variable_assignment_learns_well_below_chance(tmp_path):
  config = _config(VA_FAST)
  result, chance = _train_and_eval(config, tmp_path)
  assert chance == pytest.approx(math.log(config.data.num_values))
  summary = _report('variable assignment (fast)', result, chance)
  print(summary)
  assert result['loss'] < VA_FAST_MAX_LOSS_FRACTION * chance, summary
  assert result['accuracy'] > VA_FAST_MIN_ACCURACY, summary


@pytest.mark.slow
def test_copy_learns_well_below_chance(tmp_path):
  config = _config(COPY)
  result, chance = _train_and_eval(config, tmp_path)
  assert chance == pytest.approx(math.log(16))
  summary = _report('copy', result, chance)
  print(summary)
  assert result['loss'] < COPY_MAX_LOSS_FRACTION * chance, summary
  assert result['accuracy'] > COPY_MIN_ACCURACY, summary


@pytest.mark.slow
def test_default_tiny_recipe_learns_below_chance(tmp_path):
  config = _config({})
  assert config.total_steps == 400 and config.data.name == 'variable_assignment'
  result, chance = _train_and_eval(config, tmp_path)
  assert chance == pytest.approx(math.log(16))
  summary = _report('configs/tiny.py', result, chance)
  print(summary)
  assert result['loss'] < VA_DEFAULT_MAX_LOSS_FRACTION * chance, summary
  assert result['accuracy'] > VA_DEFAULT_MIN_ACCURACY, summary


def test_main_trains_copy_briefly_and_its_loss_drops(harness, tmp_path):
  proc = harness.run_main(tmp_path, COPY_MAIN)
  assert proc.returncode == 0, proc.stderr[-5000:]
  train_loss = {int(m[1]): float(m[2]) for m in re.finditer(
      r'step (\d+)/40\s+loss ([0-9.]+)', proc.stderr)}
  assert sorted(train_loss) == [10, 20, 30, 40], proc.stderr[-3000:]
  evals = re.findall(r'eval step 40 (.*)', proc.stderr)  # The in-loop eval at the last step.
  assert len(evals) == 1, proc.stderr[-3000:]
  scalars = {k: float(v) for k, v in re.findall(r'(\w+) (\S+)', evals[0])}
  accuracy, loss = scalars['accuracy'], scalars['loss']
  chance = math.log(16)
  summary = (f'copy via main.py, 40 steps: train losses {train_loss}, eval loss {loss:.4f} = '
             f'{loss / chance:.3f} x chance, accuracy {accuracy:.3f}')
  print(summary)
  assert train_loss[40] < 0.7 * train_loss[10], summary
  assert loss < COPY_MAIN_MAX_LOSS_FRACTION * chance, summary
  assert accuracy > COPY_MAIN_MIN_ACCURACY, summary
  assert harness.step_dirs(tmp_path) == [40]
