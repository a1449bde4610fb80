"""Name -> attention module registry. Variants register themselves on import.

The registry also knows every variant's declared options (MultiHeadAttention.OPTIONS): they
share the flat namespace config.model.attention_options, so a name two variants declare
separately is refused at registration.
"""

from typing import Callable

from models.registry import Registry

VARIANTS = Registry('attention variant')
known = VARIANTS.known
get = VARIANTS.get


def register(name: str) -> Callable[[type], type]:
  """Class decorator: makes an attention module available under `name` in configs."""
  def wrap(cls):
    taken = options()
    for option, spec in cls.declared_options().items():
      if option in taken and taken[option] is not spec:
        owner = next(n for n, c in VARIANTS.items() if c.declared_options().get(option) is
                     taken[option])
        raise ValueError(f'attention variant {name!r} declares option {option!r}, which '
                         f'{owner!r} declares too: options share model.attention_options, '
                         'so give it a name of its own (e.g. with a variant prefix)')
    return VARIANTS.register(name)(cls)
  return wrap


def options() -> dict:
  """Every registered variant's declared options, name -> Option."""
  out = {}
  for _, cls in VARIANTS.items():
    out.update(cls.declared_options())
  return out


def default_options() -> dict:
  """name -> default of every user-facing option (what configs/default.py starts from)."""
  return {k: o.default for k, o in sorted(options().items()) if not o.internal}


def resolve_options(given: dict, variants) -> dict:
  """`given` with every declared option's default filled in, checked for the `variants`
  in use (types, then each variant's `validate` runs in TransformerConfig).

  Raises:
    ValueError: an option no registered variant declares, or a value of the wrong type.
  """
  declared = options()
  unknown = sorted(set(given) - set(declared))
  if unknown:
    raise ValueError(f'unknown model.attention_options {", ".join(unknown)}; the registered '
                     f'variants declare: {", ".join(sorted(declared))}')
  full = {**{k: o.default for k, o in declared.items()}, **given}
  for name in sorted(set(variants)):
    for option, spec in get(name).declared_options().items():
      spec.check(option, full[option])
  return full
