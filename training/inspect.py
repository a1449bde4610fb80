"""`--mode=inspect`: what each layer and head of the configured model attends to.

Writes WORKDIR/inspect/connectivity.npz (one (n, n) boolean mask per layer and head, keys
`layer{L}_head{H}`) and connectivity.png, a grid of the masks like figure 10 of the survey
(rows: layers, columns: heads; a dark cell (i, j) means query i may attend to key j). The
masks come from the same pattern functions the attention code uses.

Models with selective attention also get selective_F.npz (key `layer{L}`: the (n, n) F matrix
of that layer for the first row of the first validation batch, NaN where the query cannot see
the key) and selective_F.png (one panel per layer, greener = lower F, like figure 5 of the
selective-attention paper), from the latest checkpoint of WORKDIR or, without one, from the
initial parameters.

Models with adaptive or dynamic spans also get, from the latest checkpoint of WORKDIR,
spans.json and spans.png: each head's span per layer on a log scale (figure 4 of the
adaptive-span paper; dynamic spans averaged over one validation batch), the average span, the
attention FLOPs per token (table 1's columns) and the decoding cache against a full-span one.
"""

from __future__ import annotations

import json
import os

import ml_collections
import numpy as np
from absl import logging

from models import attention, transformer
from models.attention import adaptive_span, patterns

SPAN_VARIANTS = {'adaptive_span', 'dynamic_span'}


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


def span_report(model_config, head_spans: np.ndarray) -> dict:
  """Average span, attention FLOPs per token and decoding cache of learned spans.

  Args:
    model_config: the TransformerConfig.
    head_spans: (layers, heads) spans z.

  Returns:
    JSON-ready dict. FLOPs count q.k and a.v (2 x 2 head_dim FLOPs per key) of one predicted
    token: `per_head` lets each head stop at z + R; `trimmed` computes a layer's heads
    together up to its trimmed span T (what this code does); `full_span` uses S everywhere.
  """
  opts = dict(model_config.attention_options)
  limit, ramp, block = opts['span_limit'], opts['span_ramp'], opts['span_block']
  d = model_config.head_dim
  reach = np.minimum(head_spans + ramp, limit)  # Keys with a non-zero mask.
  trims = [adaptive_span.trimmed_span(float(z.max()), ramp=ramp, limit=limit, block=block)
           for z in head_spans]
  heads = model_config.n_heads
  flops = {'per_head': float(4 * d * reach.sum()),
           'trimmed': float(4 * d * heads * sum(trims)),
           'full_span': float(4 * d * heads * limit * len(trims))}
  kv_bytes = 2 * heads * d * 4  # float32 key and value per cached position
  return {'span_limit': limit, 'average_span': float(head_spans.mean()),
          'max_span': float(head_spans.max()),
          'head_spans': head_spans.round(2).tolist(), 'trimmed_spans': trims,
          'attention_flops_per_token': flops,
          'flops_saved_vs_full_span': 1.0 - flops['trimmed'] / flops['full_span'],
          'decode_cache_bytes_per_row': {'trimmed': kv_bytes * sum(trims),
                                         'full_span': kv_bytes * limit * len(trims)}}


def plot_spans(head_spans: np.ndarray, limit: int, path: str, title: str) -> None:
  """Each head's span per layer, log scale (figure 4 of the adaptive-span paper)."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  layers, heads = head_spans.shape
  fig, ax = plt.subplots(figsize=(1.0 + 0.5 * layers, 3.2))
  width = 0.8 / heads
  for h in range(heads):
    ax.bar(np.arange(layers) + (h - (heads - 1) / 2) * width, np.maximum(head_spans[:, h], 1),
           width, color=plt.cm.viridis(h / max(heads - 1, 1)))
  ax.set_yscale('log')
  ax.set_ylim(1, limit * 1.2)
  ax.set_xticks(np.arange(layers), [str(i + 1) for i in range(layers)])
  ax.set_xlabel('layer')
  ax.set_ylabel('span z')
  ax.set_title(title, fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def _first_eval_batch(setup):
  """The first validation batch of the run's data (host-local arrays); closes the source."""
  try:
    return next(iter(setup.data.eval_batches()))
  finally:
    setup.data.close()


def learned_spans(config: ml_collections.ConfigDict, workdir: str):
  """((layers, heads) spans from the latest checkpoint, model config); dynamic spans are
  averaged over the first validation batch."""
  import jax
  from training import checkpoints, sharding, train
  setup = train.build(config, workdir=workdir)
  _, state = checkpoints.restore_latest(workdir, setup.abstract_state,
                                        keep=config.keep_checkpoints,
                                        required='train first, then inspect the spans')
  local = _first_eval_batch(setup)
  model = train.specialized_model(setup, state.params)
  with sharding.activate(setup.mesh, setup.rules):
    batch = train.device_batch(setup, local)
    variables = {'params': state.params}
    mutable = ['intermediates']
    if setup.model_config.uses_memory:
      variables['memory'] = train.fresh_memory(setup, local['inputs'].shape[0])
      mutable.append('memory')
    _, sown = jax.jit(lambda v, b: model.apply(
        v, b['inputs'], positions=b['positions'], segment_ids=b['segment_ids'],
        mutable=mutable))(variables, batch)
  spans = []
  for i, name in enumerate(setup.model_config.attention):
    layer = sown['intermediates'].get(f'block_{i}', {}).get('attention', {})
    if 'head_spans' not in layer:
      raise ValueError(f'layer {i} ({name}) has no span to inspect')
    spans.append(np.asarray(jax.device_get(layer['head_spans'][0]), np.float64))
  return np.stack(spans), setup.model_config


def selection_matrices(config: ml_collections.ConfigDict, workdir: str):
  """({'layer{L}': (n, n) F}, the example's tokens, checkpoint step or None) of a selective
  model on the first row of the first validation batch."""
  import jax
  import jax.numpy as jnp
  from training import checkpoints, sharding, train
  setup = train.build(config, workdir=workdir)
  step, state = checkpoints.restore_latest(workdir, setup.abstract_state,
                                           keep=config.keep_checkpoints)
  params = state.params if state is not None else train.init_state(setup, config.seed).params
  local = _first_eval_batch(setup)
  example = {k: np.asarray(v[:1]) for k, v in local.items()}
  with sharding.activate(setup.mesh, setup.rules):
    _, sown = jax.jit(lambda p, b: setup.model.apply(
        {'params': p}, b['inputs'], positions=b['positions'], segment_ids=b['segment_ids'],
        mutable=['intermediates']))(params, {k: jnp.asarray(v) for k, v in example.items()})
  seg = example['segment_ids'][0]
  n = seg.shape[0]
  visible = (np.arange(n)[:, None] >= np.arange(n)[None, :]) & (seg[:, None] == seg[None, :])
  out = {}
  for i, name in enumerate(setup.model_config.attention):
    layer = sown['intermediates'].get(f'block_{i}', {}).get('attention', {})
    if 'selection_F' in layer:
      f = np.asarray(jax.device_get(layer['selection_F'][0]), np.float32)
      out[f'layer{i}'] = np.where(visible, f, np.nan)
  return out, example['inputs'][0], step


def plot_selection(matrices: dict[str, np.ndarray], path: str, title: str) -> None:
  """One panel of F per layer, greener = lower (figure 5 of the selective-attention paper)."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  names = sorted(matrices, key=lambda k: int(k[5:]))
  cols = min(4, len(names))
  rows = -(-len(names) // cols)
  fig, axes = plt.subplots(rows, cols, figsize=(3.0 * cols, 3.0 * rows + 0.5), squeeze=False)
  for ax in axes.flat:
    ax.axis('off')
  for ax, name in zip(axes.flat, names):
    ax.imshow(matrices[name], cmap='RdYlGn_r', interpolation='nearest')
    ax.set_title(f'layer {int(name[5:]) + 1}', fontsize=8)
  fig.suptitle(title, fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def inspect(config: ml_collections.ConfigDict, workdir: str) -> dict[str, str]:
  """Writes the connectivity masks and their plot (and the spans of span variants); returns
  the paths written."""
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
  paths = {'npz': npz, 'png': png}
  if 'selective' in mc.attention:
    matrices, tokens, step = selection_matrices(config, workdir)
    paths['selective_npz'] = os.path.join(out_dir, 'selective_F.npz')
    np.savez_compressed(paths['selective_npz'], tokens=tokens, **matrices)
    paths['selective_png'] = os.path.join(out_dir, 'selective_F.png')
    source = f'checkpoint step {step}' if step is not None else 'initial parameters'
    plot_selection(matrices, paths['selective_png'], f'selective attention F ({source})')
    logging.info('selective F of %d layers (%s): mean F %s; wrote %s', len(matrices), source,
                 [round(float(np.nanmean(m)), 3) for m in matrices.values()],
                 paths['selective_png'])
  if set(mc.attention) & SPAN_VARIANTS:
    head_spans, full_config = learned_spans(config, workdir)
    report = span_report(full_config, head_spans)
    paths['spans_json'] = os.path.join(out_dir, 'spans.json')
    with open(paths['spans_json'], 'w') as f:
      json.dump(report, f, indent=2)
    paths['spans_png'] = os.path.join(out_dir, 'spans.png')
    plot_spans(head_spans, report['span_limit'], paths['spans_png'],
               f'{kinds}: average span {report["average_span"]:.0f} of S={report["span_limit"]}')
    logging.info('spans: average %.1f (max %.0f) of S=%d; trimmed spans %s; attention FLOPs '
                 'per token %.3g (full span %.3g, %.0f%% saved); wrote %s', report['average_span'],
                 report['max_span'], report['span_limit'], report['trimmed_spans'],
                 report['attention_flops_per_token']['trimmed'],
                 report['attention_flops_per_token']['full_span'],
                 100 * report['flops_saved_vs_full_span'], paths['spans_json'])
  return paths
