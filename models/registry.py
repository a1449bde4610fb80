"""Name -> class registries for the backbone's switches: attention, block and stack.

Each switch (`model.attention`, `model.residual`, `model.stack`) is one `Registry`; an entry
registers itself on import with the registry's decorator, and an unknown name is an error that
lists the known ones.

A registry also knows its entries' declared options (models/options.py: a class attribute
`OPTIONS`, name -> Option), in one config group per registry. The attention variants' group is
per entry (model.attention_options.<variant>.<name>: each variant sees only its own, so two
variants may use one name); blocks and stacks share one flat group (model.residual_options,
model.stack_options), so a name that two of them declare separately is refused at
registration. `resolve_options` fills in the defaults and checks the types of the options of
the entries in use.
"""

from typing import Callable

from models import options as options_lib


class Registry:
  """Names of one kind of component (e.g. 'attention variant'), their classes and options.

  Attributes:
    kind: what an entry is, for messages ('attention variant', 'residual wiring', 'stack').
    group: the config group of the entries' options (e.g. 'model.stack_options').
    per_entry: the group holds one sub-group per entry (group.<entry>.<option>), each entry's
      own; else one flat namespace that the entries share.
  """

  def __init__(self, kind: str, group: str, per_entry: bool = False):
    self.kind = kind
    self.group = group
    self.per_entry = per_entry
    self._entries: dict[str, type] = {}

  def register(self, name: str) -> Callable[[type], type]:
    """Class decorator: makes the class available under `name` in configs.

    Raises:
      ValueError: `name` is taken, or the class declares an option under a name another
        entry declares separately (the group is one flat namespace).
    """
    def wrap(cls):
      if name in self._entries:
        raise ValueError(f'{self.kind} {name!r} registered twice')
      taken = {} if self.per_entry else self.options()
      for option, spec in options_lib.declared(cls).items():
        if option in taken and taken[option] is not spec:
          owner = next(n for n, c in self.items()
                       if options_lib.declared(c).get(option) is taken[option])
          raise ValueError(f'{self.kind} {name!r} declares option {option!r}, which {owner!r} '
                           f'declares too: options share {self.group}, so give it a name of '
                           f'its own (e.g. with a {self.kind.split()[-1]} prefix)')
      self._entries[name] = cls
      return cls
    return wrap

  def known(self) -> list[str]:
    """Sorted registered names."""
    return sorted(self._entries)

  def get(self, name: str) -> type:
    """The class registered as `name`; a ValueError lists the known names."""
    try:
      return self._entries[name]
    except KeyError:
      raise ValueError(f'unknown {self.kind} {name!r}; known {self.kind}s: '
                       f'{", ".join(self.known())}') from None

  def items(self) -> list[tuple[str, type]]:
    """(name, class) pairs, sorted by name."""
    return sorted(self._entries.items())

  def options(self) -> dict[str, options_lib.Option]:
    """Every registered entry's declared options, name -> Option (a flat group's: an entry's
    own are `options_lib.declared(registry.get(name))`)."""
    out = {}
    for _, cls in self.items():
      out.update(options_lib.declared(cls))
    return out

  def default_options(self) -> dict:
    """What configs/schema.py declares: name -> default of every user-facing option; per
    entry, {entry: {name: default}} (every entry has a group, an empty one too)."""
    if self.per_entry:
      return {entry: _defaults(options_lib.declared(cls)) for entry, cls in self.items()}
    return _defaults(self.options())

  def resolve_options(self, given: dict, names) -> dict:
    """`given` with every declared option's default filled in, type-checked for the entries
    `names` in use (their own checks of the values run in TransformerConfig). Per entry,
    `given` is {entry: {name: value}} and the result holds the entries `names` only.

    Raises:
      ValueError: an option its group's entries do not declare (the message lists the
        declared ones), an entry's group for no registered entry, or a value of the wrong
        type.
    """
    if self.per_entry:
      return self._resolve_per_entry(given, names)
    declared = self.options()
    unknown = sorted(set(given) - set(declared))
    if unknown:
      raise ValueError(f'unknown {self.group} {", ".join(unknown)}; the registered '
                       f'{self.kind}s declare: {", ".join(sorted(declared)) or "none"}')
    full = {**{k: o.default for k, o in declared.items()}, **given}
    for name in sorted(set(names)):
      for option, spec in options_lib.declared(self.get(name)).items():
        spec.check(option, full[option], self.group)
    return full

  def _resolve_per_entry(self, given: dict, names) -> dict:
    unknown = sorted(set(given) - set(self._entries))
    if unknown:
      raise ValueError(f'{self.group} has a group for {", ".join(unknown)}, which is no '
                       f'registered {self.kind} (known: {", ".join(self.known())})')
    for entry, values in sorted(given.items()):
      if not isinstance(values, dict):
        raise ValueError(
            f'{self.group}.{entry} must be the {self.kind}\'s options, {{name: value}}, got '
            f'{values!r} (options are given per {self.kind}: '
            f'{self.group}.<{self.kind.split()[-1]}>.<name>)')
      declared = options_lib.declared(self.get(entry))
      bad = sorted(set(values) - set(declared))
      if bad:
        raise ValueError(f'unknown {self.group}.{entry}.{", ".join(bad)}; {entry} declares: '
                         f'{", ".join(sorted(declared)) or "none"}')
    out = {}
    for entry in sorted(set(names)):
      declared = options_lib.declared(self.get(entry))
      full = {**{k: o.default for k, o in declared.items()}, **given.get(entry, {})}
      for option, spec in declared.items():
        spec.check(option, full[option], f'{self.group}.{entry}')
      out[entry] = full
    return out


def _defaults(declared: dict[str, options_lib.Option]) -> dict:
  return {k: o.default for k, o in sorted(declared.items()) if not o.internal}
