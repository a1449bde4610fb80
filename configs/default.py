"""Base recipe: the selective-attention paper's C4 language model (section 5), d=8.

Every recipe in configs/ starts from this file and edits it. The settings themselves (default,
doc, range, change kind) are declared once in configs/schema.py; this recipe is the schema's
defaults with the paper's bfloat16 compute.
"""

import ml_collections

from configs import declare, schema


def get_config() -> ml_collections.ConfigDict:
  """The default (C4, d=8) configuration."""
  config = declare.build(schema.SETTINGS)
  config.model.dtype = 'bfloat16'
  return config
