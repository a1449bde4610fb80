"""Name -> attention module registry. Variants register themselves on import."""

from typing import Callable

_REGISTRY: dict[str, type] = {}


def register(name: str) -> Callable[[type], type]:
  """Class decorator: makes an attention module available under `name` in configs."""
  def wrap(cls):
    if name in _REGISTRY:
      raise ValueError(f'attention variant {name!r} registered twice')
    _REGISTRY[name] = cls
    return cls
  return wrap


def known() -> list[str]:
  """Sorted names of the registered attention variants."""
  return sorted(_REGISTRY)


def get(name: str) -> type:
  """The module class registered as `name`; a ValueError lists the known names."""
  try:
    return _REGISTRY[name]
  except KeyError:
    raise ValueError(f'unknown attention variant {name!r}; known variants: '
                     f'{", ".join(known())}') from None
