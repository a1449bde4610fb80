"""Name -> attention module registry. Variants register themselves on import.

The registry also knows every variant's declared options (MultiHeadAttention.OPTIONS). Each
variant has its own group, config.model.attention_options.<variant>.<name>, and its modules
see only their own options (models/registry.py, shared with blocks and stacks).
"""

from models import options as options_lib
from models.registry import Registry

VARIANTS = Registry('attention variant', 'model.attention_options', per_entry=True)
known = VARIANTS.known
get = VARIANTS.get
# Class decorator: makes an attention module available under a name in configs.
register = VARIANTS.register
# {variant: {name: default}} of every user-facing option (what configs/schema.py declares).
default_options = VARIANTS.default_options


def options(variant: str) -> dict:
  """Variant `variant`'s declared options, name -> Option."""
  return options_lib.declared(get(variant))


def resolve_options(given: dict, variants) -> dict:
  """{variant: {name: value}} of the `variants` in use: `given` ({variant: {name: value}},
  groups of any registered variant) with each declared option's default filled in and its
  type checked (each variant's `validate` then runs in TransformerConfig).

  Raises:
    ValueError: a group of no registered variant, an option its variant does not declare, or
      a value of the wrong type.
  """
  return VARIANTS.resolve_options(given, variants)
