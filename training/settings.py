"""The run's numeric settings, checked for finiteness and range before anything is built.

A NaN learning rate used to train, write config.json and stop at step 2 with a non-finite
loss that named no setting; a negative warm-up or evaluation cadence was accepted silently.
`check` runs first in `assembly.build`, so every mode (train, eval, generate, inspect, pruning,
compile) refuses such a config in one line naming the key, before any data is read.

Two rules:
- every floating-point field of the config, at any depth, must be finite (no field of
  configs/default.py means anything as NaN or infinity);
- the run-level settings in RANGES must lie in their range (integers where they count
  something). Model, data, sampling and pruning options are range-checked by the modules that
  use them (models/, input_pipeline/, training/sampling.py, training/pruning.py), which know
  what each option means.
"""

import math
from typing import Any

import ml_collections
import numpy as np

from training import run_config

# key -> (integer, low, high, low inclusive, high inclusive). None: unbounded on that side.
INTEGER, REAL = True, False
RANGES: dict[str, tuple[bool, float | None, float | None, bool, bool]] = {
    # The optimizer and its schedule.
    'learning_rate': (REAL, 0, None, True, False),
    'warmup_steps': (INTEGER, 0, None, True, False),
    'end_learning_rate_fraction': (REAL, 0, 1, True, True),
    'adam_b1': (REAL, 0, 1, True, False),
    'adam_b2': (REAL, 0, 1, True, False),
    'adam_eps': (REAL, 0, None, True, False),
    'weight_decay': (REAL, 0, None, True, False),
    'clip_grad_norm': (REAL, 0, None, True, False),
    'batch_size': (INTEGER, 1, None, True, False),
    'grad_accum_steps': (INTEGER, 1, None, True, False),
    'seq_len': (INTEGER, 1, None, True, False),
    'model.dropout_rate': (REAL, 0, 1, True, False),
    # How the run is executed.
    'total_steps': (INTEGER, 1, None, True, False),
    'loss_chunk_len': (INTEGER, 0, None, True, False),
    'log_every_steps': (INTEGER, 1, None, True, False),
    'eval_every_steps': (INTEGER, 0, None, True, False),
    'eval_steps': (INTEGER, 0, None, True, False),
    'eval_batch_size': (INTEGER, 0, None, True, False),
    'checkpoint_every_steps': (INTEGER, 1, None, True, False),
    'keep_checkpoints': (INTEGER, 1, None, True, False),
    'eval_checkpoint_step': (INTEGER, 0, None, True, False),
    'inspect_len': (INTEGER, 0, None, True, False),
    'peak_tflops_per_device': (REAL, 0, None, True, False),
}

# What each key's 0 means, where it means something other than zero of it.
ZERO_MEANS = {
    'clip_grad_norm': 'no clipping',
    'eval_every_steps': 'no periodic evaluation',
    'eval_steps': 'the whole split',
    'eval_batch_size': 'batch_size',
    'eval_checkpoint_step': 'the latest',
    'loss_chunk_len': 'one chunk',
    'peak_tflops_per_device': 'measured or from the device table',
}


def _describe(integer: bool, lo, hi, lo_in: bool, hi_in: bool) -> str:
  kind = 'an integer' if integer else 'a finite number'
  if lo is not None and hi is not None:
    interval = f'{"[" if lo_in else "("}{lo}, {hi}{"]" if hi_in else ")"}'
    return f'{kind} in {interval}'
  if lo is not None:
    return f'{kind} {">=" if lo_in else ">"} {lo}'
  return f'{kind} {"<=" if hi_in else "<"} {hi}'


def _in_range(value, lo, hi, lo_in: bool, hi_in: bool) -> bool:
  if lo is not None and (value < lo if lo_in else value <= lo):
    return False
  return not (hi is not None and (value > hi if hi_in else value >= hi))


def _is_number(value: Any) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool)


def check(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError naming the first setting that is not finite or not in its range.

  Args:
    config: the run config (a run record may lack keys added since: they are skipped).
  """
  flat = run_config.as_flat_json(config)
  for key, value in flat.items():
    if isinstance(value, float) and not math.isfinite(value):
      raise ValueError(f'{key} must be a finite number, got {value!r}')
  for key, (integer, lo, hi, lo_in, hi_in) in RANGES.items():
    if key not in flat:
      continue
    value = flat[key]
    ok = (_is_number(value) and (not integer or float(value).is_integer())
          and _in_range(value, lo, hi, lo_in, hi_in))
    if not ok:
      zero = f' (0 = {ZERO_MEANS[key]})' if key in ZERO_MEANS else ''
      raise ValueError(f'{key} must be {_describe(integer, lo, hi, lo_in, hi_in)}{zero}, '
                       f'got {value!r}')


def check_profile(config: ml_collections.ConfigDict) -> tuple[int, int]:
  """Validates the profiler settings.

  Args:
    config: the run config (a run record older than the profile keys reads as off).

  Returns:
    (profile_start_step, profile_steps).

  Raises:
    ValueError: either is not an integer >= 0.
  """
  values = []
  for name, default in (('profile_start_step', 2), ('profile_steps', 0)):
    value = config.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
      raise ValueError(f'{name} must be an integer >= 0, got {value!r}')
    values.append(int(value))
  return values[0], values[1]
