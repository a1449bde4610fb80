"""The run's numeric settings, checked for finiteness and range before anything is built.

A NaN learning rate used to train, write config.json and stop at step 2 with a non-finite
loss that named no setting; a negative warm-up or evaluation cadence was accepted silently.
`check` runs first in `assembly.build`, so every mode (train, eval, generate, inspect, pruning,
compile) refuses such a config in one line naming the key, before any data is read.

Two rules:
- every floating-point field of the config, at any depth, must be finite (no field of
  configs/schema.py means anything as NaN or infinity);
- the run-level settings in RANGES must lie in their range (integers where they count
  something), as configs/schema.py declares each one. Model, data, sampling and pruning
  options are range-checked by the modules that use them (models/, input_pipeline/,
  training/sampling.py, training/pruning.py), which know what each option means.
"""

import math
from typing import Any

import ml_collections

from configs import declare, schema
from models import options as options_lib
from training import run_config

# dotted key -> the range a run-level setting must lie in, and what its 0 means where that is
# not zero of it: from the one declaration of every run setting (configs/schema.py).
_RANGED = declare.ranges(schema.SETTINGS)
RANGES: dict[str, declare.Range] = {key: setting.bounds for key, setting in _RANGED.items()}
ZERO_MEANS = {key: setting.zero_means for key, setting in _RANGED.items() if setting.zero_means}


def _check(key: str, value: Any, allowed: declare.Range) -> None:
  """Raises ValueError naming `key` unless `value` is a number in `allowed` (the message of
  every range, the attention options' too: models/options.check_range)."""
  options_lib.check_range(key, value, allowed, ZERO_MEANS.get(key, ''))


def check(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError naming the first setting that is not finite or not in its range.

  A key renamed since (run_config.RENAMED) is refused with its new name.

  Args:
    config: the run config (a run record may lack keys added since: they are skipped).
  """
  flat = run_config.as_flat_json(config)
  variants = [v.strip() for v in str(flat.get('model.attention', '')).split(',') if v.strip()]
  run_config.check_renamed(flat, variants or None)  # An old key would be ignored silently.
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
  values = {name: config.get(name, schema.SETTINGS.settings[name].default)
            for name in ('profile_start_step', 'profile_steps')}
  for name, value in values.items():
    _check(name, value, RANGES[name])
  return int(values['profile_start_step']), int(values['profile_steps'])
