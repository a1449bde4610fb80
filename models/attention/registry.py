"""Name -> attention module registry. Variants register themselves on import.

The registry also knows every variant's declared options (MultiHeadAttention.OPTIONS): they
share the flat namespace config.model.attention_options, so a name two variants declare
separately is refused at registration (models/registry.py, shared with blocks and stacks).
"""

from models.registry import Registry

VARIANTS = Registry('attention variant', 'model.attention_options')
known = VARIANTS.known
get = VARIANTS.get
# Class decorator: makes an attention module available under a name in configs.
register = VARIANTS.register
# Every registered variant's declared options, name -> Option.
options = VARIANTS.options
# name -> default of every user-facing option (what configs/default.py starts from).
default_options = VARIANTS.default_options


def resolve_options(given: dict, variants) -> dict:
  """`given` with every declared option's default filled in, checked for the `variants`
  in use (types, then each variant's `validate` runs in TransformerConfig).

  Raises:
    ValueError: an option no registered variant declares, or a value of the wrong type.
  """
  return VARIANTS.resolve_options(given, variants)
