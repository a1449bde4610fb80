"""Hyper-parameters a registered component declares next to its code: `Option`.

An attention variant, a block or a stack lists its own hyper-parameters in a class attribute
`OPTIONS` (name -> Option; a subclass inherits its parents'). Each registry (models/registry.py)
collects the options of its entries into one config group: config.model.attention_options
(one sub-group per variant: attention_options.<variant>.<name>), config.model.residual_options
and config.model.stack_options (flat). Each option carries its default,
its type (the default's), a one-line doc and what a change of it on a recorded run is
(training/run_config.py reads `change` from the registry; nothing is listed there by hand).
"""

import dataclasses
from typing import Any

import numpy as np

# What a change of an option on a recorded run is (Option.change; training/run_config.py).
CHANGES = ('model', 'training', 'runtime')
INTEGER, REAL = True, False


@dataclasses.dataclass(frozen=True)
class Range:
  """Values a numeric setting may take: `lo` <= value (< with `lo_exclusive`) and value <
  `hi` (<= with `hi_inclusive`), an integer where `integer` (it counts something)."""
  integer: bool
  lo: float
  hi: float | None = None
  hi_inclusive: bool = False
  lo_exclusive: bool = False

  def describe(self) -> str:
    """'an integer >= 1', 'a finite number in [0, 1)', 'a finite number > 0', ..."""
    what = 'an integer' if self.integer else 'a finite number'
    if self.hi is None:
      return f'{what} {">" if self.lo_exclusive else ">="} {self.lo}'
    return (f'{what} in {"(" if self.lo_exclusive else "["}{self.lo}, {self.hi}'
            f'{"]" if self.hi_inclusive else ")"}')

  def holds(self, value: Any) -> bool:
    return (isinstance(value, (int, float, np.integer)) and not isinstance(value, bool)
            and np.isfinite(value)
            and (not self.integer or float(value).is_integer())
            and (value > self.lo if self.lo_exclusive else value >= self.lo)
            and (self.hi is None or value < self.hi
                 or (self.hi_inclusive and value == self.hi)))


def check_range(key: str, value: Any, bounds: Range, zero_means: str = '') -> None:
  """Raises ValueError naming `key` unless `value` lies in `bounds`: one message for every
  range, run settings' (training/settings.py) and options' alike."""
  if bounds.holds(value):
    return
  zero = f' (0 = {zero_means})' if zero_means else ''
  raise ValueError(f'{key} must be {bounds.describe()}{zero}, got {value!r}')


@dataclasses.dataclass(frozen=True)
class Option:
  """One hyper-parameter of a registered component: config.model.<group>.<name>.

  A component declares its own in `OPTIONS` and checks their values together (an attention
  variant's `validate`, a block's or a stack's `check`). Each attention variant has its own
  group; blocks and stacks share one flat namespace per registry (which refuses a name two
  components declare separately).

  Attributes:
    default: the value configs start from; its type is the type the option must have
      (a float option takes ints; None takes anything).
    doc: one line: what it is, with the paper's symbol.
    internal: set by the training loop, not by users (kept out of configs/schema.py).
    change: what a change of it on a recorded run is (training/run_config.py): 'model' (the
      parameters mean something else: refused in every mode unless allowed), 'training'
      (the same parameters, other training: eval may change it, a resume may not) or
      'runtime' (the same values computed otherwise, or an eval-time setting: always
      allowed).
    bounds: the range a numeric value must lie in (checked with the type, in check); None:
      any value of its type (the component's own checks, if any).
    zero_means: what 0 means where it is not zero of it ('no clamp').
  """
  default: Any
  doc: str
  internal: bool = False
  change: str = 'model'
  bounds: Range | None = None
  zero_means: str = ''

  def __post_init__(self):
    if self.change not in CHANGES:
      raise ValueError(f'Option.change must be one of {CHANGES}, got {self.change!r}')

  def check(self, name: str, value, group: str = 'model.attention_options') -> None:
    """Raises ValueError if `value` does not have the default's type or lies outside the
    option's bounds.

    Args:
      name: the option's name.
      value: its value.
      group: the config group it is given in (for the message).
    """
    d = self.default
    if d is None:
      return
    if isinstance(d, bool):
      ok, kind = isinstance(value, bool), 'True or False'
    elif isinstance(d, int):
      ok, kind = isinstance(value, int) and not isinstance(value, bool), 'an integer'
    elif isinstance(d, float):
      ok, kind = isinstance(value, (int, float)) and not isinstance(value, bool), 'a number'
    elif isinstance(d, (tuple, list)):
      ok, kind = isinstance(value, (tuple, list)), 'a tuple'
    else:
      ok, kind = isinstance(value, type(d)), f'a {type(d).__name__}'
    if not ok:
      raise ValueError(f'{group}.{name} ({self.doc}) must be {kind}, got {value!r}')
    if self.bounds is not None and not (value is None and d is None):
      check_range(f'{group}.{name}', value, self.bounds, self.zero_means)


def declared(cls: type) -> dict[str, Option]:
  """Every option `cls` reads: its own OPTIONS and those of its parent classes."""
  out = {}
  for klass in reversed(cls.__mro__):
    out.update(vars(klass).get('OPTIONS', {}))
  return out


def lookup(pairs: tuple, name: str, group: str):
  """The value of option `name` in `pairs`, sorted (name, value) pairs of a resolved group
  (every declared option present); a ValueError names the group for an undeclared one."""
  for key, value in pairs:
    if key == name:
      return value
  raise ValueError(f'{group}.{name} is read but no registered component declares it in its '
                   f'OPTIONS (declared: {", ".join(k for k, _ in pairs) or "none"})')
