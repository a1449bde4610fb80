"""`--mode=inspect`: what each layer and head of the configured model attends to.

Writes WORKDIR/inspect/connectivity.npz (one (n, n) boolean mask per layer and head, keys
`layer{L}_head{H}`) and connectivity.png, a grid of the masks like figure 10 of the survey
(rows: layers, columns: heads; a dark cell (i, j) means query i may attend to key j). The
masks come from the same pattern functions the attention code uses.
"""

from __future__ import annotations

import os

import ml_collections
import numpy as np
from absl import logging

from models import attention, transformer
from models.attention import patterns


def connectivity(model_config: transformer.TransformerConfig, n: int) -> dict[str, np.ndarray]:
  """{'layer{L}_head{H}': (n, n) bool} for every layer and head."""
  out = {}
  for layer, name in enumerate(model_config.attention):
    module = attention.get(name)(
        num_heads=model_config.n_heads, head_dim=model_config.head_dim, layer_index=layer,
        max_len=model_config.max_len, options=model_config.attention_options)
    for head in range(model_config.n_heads):
      out[f'layer{layer}_head{head}'] = patterns.mask(module.head_pattern(head), n, head)
  return out


def plot(masks: dict[str, np.ndarray], n_layers: int, n_heads: int, path: str,
         title: str) -> None:
  """Grid of the masks as a PNG."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  size = 1.6
  fig, axes = plt.subplots(n_layers, n_heads, figsize=(size * n_heads, size * n_layers + 0.6),
                           squeeze=False)
  for layer in range(n_layers):
    for head in range(n_heads):
      ax = axes[layer][head]
      ax.imshow(masks[f'layer{layer}_head{head}'], cmap='Greys', interpolation='nearest')
      ax.set_xticks([])
      ax.set_yticks([])
      if layer == 0:
        ax.set_title(f'head {head}', fontsize=8)
      if head == 0:
        ax.set_ylabel(f'layer {layer}', fontsize=8)
  fig.suptitle(title, fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def inspect(config: ml_collections.ConfigDict, workdir: str) -> dict[str, str]:
  """Writes the connectivity masks and their plot; returns the paths written."""
  model_cfg = dict(config.model)
  model_cfg['vocab_size'] = model_cfg.get('vocab_size') or 1  # Not needed for the masks.
  n = config.inspect_len or config.seq_len
  model_cfg['max_len'] = model_cfg.get('max_len') or n
  mc = transformer.TransformerConfig.from_config(model_cfg)
  masks = connectivity(mc, n)
  out_dir = os.path.join(workdir, 'inspect')
  os.makedirs(out_dir, exist_ok=True)
  npz = os.path.join(out_dir, 'connectivity.npz')
  np.savez_compressed(npz, **masks)
  png = os.path.join(out_dir, 'connectivity.png')
  kinds = ','.join(sorted(set(mc.attention)))
  plot(masks, mc.n_layers, mc.n_heads, png, f'{kinds} attention, n={n}')
  density = {k: float(v.sum()) / (n * (n + 1) / 2) for k, v in masks.items()}
  logging.info('connectivity of %d layers x %d heads (n=%d): mean density %.3f of causal; '
               'wrote %s and %s', mc.n_layers, mc.n_heads, n, np.mean(list(density.values())),
               npz, png)
  return {'npz': npz, 'png': png}
