"""A run setting declared once: its default, doc, range and what a change of it is.

configs/schema.py declares every setting of a run as a tree of `Group`s of `Setting`s (a
`models.options.Option` with a range), and everything else reads that one declaration:

- `build` makes the ConfigDict that every recipe in configs/ starts from;
- `kinds` gives training/run_config.py the kind of a change of each key on a recorded run
  (runtime, training or model; a setting without its own takes its group's);
- `ranges` gives training/settings.py the range each numeric setting must lie in, with what
  its 0 means where that is not zero of it.

The hyper-parameters of the attention variants, blocks and stacks are declared next to their
code (models/options.Option in each OPTIONS); an `Options` entry is where their group sits in
the config.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any, Union

import ml_collections

from models import options as options_lib
from models import transformer

RUNTIME, TRAINING, MODEL = 'runtime', 'training', 'model'
INTEGER, REAL, Range = options_lib.INTEGER, options_lib.REAL, options_lib.Range


@dataclasses.dataclass(frozen=True)
class Setting(options_lib.Option):
  """One run setting: an Option (default, doc, change) with a range.

  Attributes:
    default: the value a run starts from; the config field's type is its type.
    doc: what it is, in a line or two.
    change: what a change of it on a recorded run is ('model', 'training', 'runtime';
      training/run_config.py); '' takes its group's.
    bounds: the range a numeric setting must lie in (training/settings.py checks it before
      anything is built); None: any value of its type (a module that reads it checks it).
    zero_means: what 0 means where it is not zero of it ('no clipping', 'the latest').
  """
  change: str = ''

  def __post_init__(self):
    if self.change:
      super().__post_init__()
    if self.zero_means and self.bounds is None:
      raise ValueError(f'{self.doc!r}: zero_means needs bounds that allow 0')


@dataclasses.dataclass(frozen=True)
class Options:
  """The hyper-parameters of every registered attention variant, block or stack
  (config.model.<group>): each declared next to its code (models/options.Option in OPTIONS,
  with its own change kind); `group` is a key of models.transformer.OPTION_GROUPS."""
  group: str
  doc: str


@dataclasses.dataclass(frozen=True)
class Group:
  """A config section: settings and sub-groups in the order the config lists them; `change`
  is the kind of a change of every key under it that declares none (a key under it that no
  entry declares, e.g. one of an older run, is of this kind too)."""
  doc: str
  settings: Mapping[str, Union[Setting, 'Group', Options]]
  change: str = ''


def build(group: Group) -> ml_collections.ConfigDict:
  """The ConfigDict of `group`'s defaults (copies: each config is its own)."""
  config = ml_collections.ConfigDict()
  for name, entry in group.settings.items():
    if isinstance(entry, Group):
      config[name] = build(entry)
    elif isinstance(entry, Options):
      config[name] = ml_collections.ConfigDict(transformer.default_options(entry.group))
    else:
      config[name] = copy.deepcopy(entry.default)
  return config


def walk(group: Group, prefix: str = '', change: str = MODEL
         ) -> Iterator[tuple[str, Union[Setting, Group, Options], str]]:
  """(dotted key, entry, its change kind) of every group and setting under `group`, parents
  first; an Options group's entries are its registry's, not listed here."""
  for name, entry in group.settings.items():
    key = f'{prefix}{name}'
    own = getattr(entry, 'change', '') or change
    yield key, entry, own
    if isinstance(entry, Group):
      yield from walk(entry, f'{key}.', own)


def kinds(group: Group) -> dict[str, str]:
  """dotted key of every group and setting -> the kind of a change of it (the option groups
  are left to their registries)."""
  return {key: change for key, entry, change in walk(group, change=group.change or MODEL)
          if not isinstance(entry, Options)}


def ranges(group: Group) -> dict[str, Setting]:
  """dotted key -> Setting of every setting with a range."""
  return {key: entry for key, entry, _ in walk(group)
          if isinstance(entry, Setting) and entry.bounds is not None}
