"""Hyper-parameters a registered component declares next to its code: `Option`.

An attention variant, a block or a stack lists its own hyper-parameters in a class attribute
`OPTIONS` (name -> Option; a subclass inherits its parents'). Each registry (models/registry.py)
collects the options of its entries into one config group: config.model.attention_options
(one sub-group per variant: attention_options.<variant>.<name>), config.model.block_options
and config.model.stack_options (flat). Each option carries its default,
its type (the default's), a one-line doc and what a change of it on a recorded run is
(training/run_config.py reads `change` from the registry; nothing is listed there by hand).
"""

import dataclasses
from typing import Any

# What a change of an option on a recorded run is (Option.change; training/run_config.py).
CHANGES = ('model', 'training', 'runtime')


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
  """
  default: Any
  doc: str
  internal: bool = False
  change: str = 'model'

  def __post_init__(self):
    if self.change not in CHANGES:
      raise ValueError(f'Option.change must be one of {CHANGES}, got {self.change!r}')

  def check(self, name: str, value, group: str = 'model.attention_options') -> None:
    """Raises ValueError if `value` does not have the default's type.

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
