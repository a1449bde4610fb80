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
from typing import Any, NamedTuple

import ml_collections
import numpy as np

from training import run_config


class Range(NamedTuple):
  """Values a setting may take: `lo` <= value (< `hi`, or <= with `hi_inclusive`)."""
  integer: bool
  lo: float
  hi: float | None = None
  hi_inclusive: bool = False


INTEGER, REAL = True, False
RANGES: dict[str, Range] = {
    # The optimizer and its schedule.
    'learning_rate': Range(REAL, 0),
    'warmup_steps': Range(INTEGER, 0),
    'end_learning_rate_fraction': Range(REAL, 0, 1, hi_inclusive=True),
    'adam_b1': Range(REAL, 0, 1),
    'adam_b2': Range(REAL, 0, 1),
    'adam_eps': Range(REAL, 0),
    'weight_decay': Range(REAL, 0),
    'clip_grad_norm': Range(REAL, 0),
    'batch_size': Range(INTEGER, 1),
    'grad_accum_steps': Range(INTEGER, 1),
    'seq_len': Range(INTEGER, 1),
    'model.dropout_rate': Range(REAL, 0, 1),
    # How the run is executed.
    'total_steps': Range(INTEGER, 1),
    'loss_chunk_len': Range(INTEGER, 0),
    'log_every_steps': Range(INTEGER, 1),
    'eval_every_steps': Range(INTEGER, 0),
    'eval_steps': Range(INTEGER, 0),
    'eval_batch_size': Range(INTEGER, 0),
    'checkpoint_every_steps': Range(INTEGER, 1),
    'keep_checkpoints': Range(INTEGER, 1),
    'eval_checkpoint_step': Range(INTEGER, 0),
    'inspect_len': Range(INTEGER, 0),
    'peak_tflops_per_device': Range(REAL, 0),
    'profile_start_step': Range(INTEGER, 0),
    'profile_steps': Range(INTEGER, 0),
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


def _check(key: str, value: Any, allowed: Range) -> None:
  """Raises ValueError naming `key` unless `value` is a number in `allowed`."""
  ok = (isinstance(value, (int, float, np.integer)) and not isinstance(value, bool)
        and (not allowed.integer or float(value).is_integer()) and value >= allowed.lo
        and (allowed.hi is None or value < allowed.hi
             or (allowed.hi_inclusive and value == allowed.hi)))
  if ok:
    return
  what = 'an integer' if allowed.integer else 'a finite number'
  if allowed.hi is None:
    what += f' >= {allowed.lo}'
  else:
    what += f' in [{allowed.lo}, {allowed.hi}{"]" if allowed.hi_inclusive else ")"}'
  zero = f' (0 = {ZERO_MEANS[key]})' if key in ZERO_MEANS else ''
  raise ValueError(f'{key} must be {what}{zero}, got {value!r}')


def check(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError naming the first setting that is not finite or not in its range.

  A key renamed since (run_config.RENAMED) is refused with its new name.

  Args:
    config: the run config (a run record may lack keys added since: they are skipped).
  """
  flat = run_config.as_flat_json(config)
  run_config.check_renamed(flat)  # An old key would be ignored silently.
  for key, value in flat.items():
    if isinstance(value, float) and not math.isfinite(value):
      raise ValueError(f'{key} must be a finite number, got {value!r}')
  for key, allowed in RANGES.items():
    if key in flat:
      _check(key, flat[key], allowed)


def check_profile(config: ml_collections.ConfigDict) -> tuple[int, int]:
  """Validates the profiler settings.

  Args:
    config: the run config (a run record older than the profile keys reads as off).

  Returns:
    (profile_start_step, profile_steps).

  Raises:
    ValueError: either is not an integer >= 0.
  """
  values = {name: config.get(name, default)
            for name, default in (('profile_start_step', 2), ('profile_steps', 0))}
  for name, value in values.items():
    _check(name, value, RANGES[name])
  return int(values['profile_start_step']), int(values['profile_steps'])
