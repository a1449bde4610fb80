"""Composite presets: a paper's model as a variant, a block and a stack together.

A preset names a combination of registered parts (models/) that a paper trained as one model,
as dotted config overrides for any recipe; experiments/harness.py takes a preset's name
wherever it takes a variant's ('gtrxl', 'reformer:n_hashes=4', `python -m experiments.compare
--variants=presets`).
"""

from typing import Any, Callable

import ml_collections


def _universal(config: ml_collections.ConfigDict) -> dict[str, Any]:
  # As deep as the layered models: the same FLOPs per token with one block's parameters.
  return {'model.attention': 'dense', 'model.stack': 'universal', 'model.n_layers': 0,
          'model.position_embedding': 'none',
          'model.stack_options.steps': config.model.n_layers or config.model.d}


# name -> (the recipe's config -> overrides, dotted keys).
PRESETS: dict[str, Callable[[ml_collections.ConfigDict], dict[str, Any]]] = {
    # GTrXL (Parisotto et al., 2020): Transformer-XL attention in gated residual blocks.
    'gtrxl': lambda config: {'model.attention': 'txl', 'model.residual': 'gtrxl'},
    # Reformer (Kitaev et al., 2020): LSH attention in reversible layers.
    'reformer': lambda config: {'model.attention': 'lsh', 'model.residual': 'reversible'},
    # Universal Transformer (Dehghani et al., 2019): one shared layer applied for d steps.
    'universal': _universal,
}
