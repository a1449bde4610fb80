"""Name -> class registries for the backbone's switches: attention, block and stack.

Each switch (`model.attention`, `model.block`, `model.stack`) is one `Registry`; an entry
registers itself on import with the registry's decorator, and an unknown name is an error that
lists the known ones.
"""

from typing import Callable


class Registry:
  """Names of one kind of component (e.g. 'attention variant') and their classes."""

  def __init__(self, kind: str):
    self.kind = kind
    self._entries: dict[str, type] = {}

  def register(self, name: str) -> Callable[[type], type]:
    """Class decorator: makes the class available under `name` in configs."""
    def wrap(cls):
      if name in self._entries:
        raise ValueError(f'{self.kind} {name!r} registered twice')
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
