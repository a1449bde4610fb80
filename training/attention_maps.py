"""`--mode=inspect`: what each layer and head of the configured model attends to.

Writes WORKDIR/inspect/connectivity.npz (one (n, n) boolean mask per layer and head, keys
`layer{L}_head{H}`) and connectivity.png, a grid of the masks like figure 10 of the survey
(rows: layers, columns: heads; a dark cell (i, j) means query i may attend to key j). The
masks come from the same pattern functions the attention code uses.

Then each variant in use draws its own figures (its `inspect` hook, models/attention/), from
what it sows on the first validation batch with the latest checkpoint of WORKDIR (or, without
one, the initial parameters); this file only renders them:
- selective attention: selective_F.npz (key `layer{L}`: the (n, n) F matrix of the batch's
  first row, NaN where the query cannot see the key) and selective_F.png (one panel per layer,
  greener = lower F, like figure 5 of the selective-attention paper);
- adaptive and dynamic spans: spans.json and spans.png, each head's span per layer on a log
  scale (figure 4 of the adaptive-span paper; dynamic spans averaged over the batch), the
  average span, attention FLOPs per token (table 1's columns) and the decoding cache against a
  full-span one.

A stack draws its own too (Stack.inspect, models/stacks.py):
- the universal stack with ACT: act_steps.png, .npz and .json: the mean steps N by position,
  and the histograms of N for the scored tokens and for the others (the token types every
  batch has: what the task scores, e.g. parity answers or the copied half, and its context).
"""

from __future__ import annotations

import json
import os

import jax
import ml_collections
import numpy as np
from absl import logging

from models import attention, host, residual, stacks, transformer
from models.attention import patterns
from training import agreement, assembly, run_config, sharding, steps


def connectivity(model_config: transformer.TransformerConfig, n: int) -> dict[str, np.ndarray]:
  """{'layer{L}_head{H}': (n, n) bool} for every layer and head: the static pattern, or the
  causal mask for a variant without one (what it may attend to at most)."""
  out = {}
  for layer, name in enumerate(model_config.attention):
    module = residual.make_attention(model_config, name, layer)
    for head in range(model_config.n_heads):
      pattern = module.head_pattern(head) or patterns.Dense()
      out[f'layer{layer}_head{head}'] = patterns.mask(pattern, n, head)
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


def _first_eval_batch(setup):
  """The first validation batch of the run's data (host-local arrays); closes the source."""
  try:
    return next(iter(setup.data.eval_batches()))
  finally:
    setup.data.close()


def sown_per_layer(config: ml_collections.ConfigDict, workdir: str):
  """What each layer's attention sows into 'intermediates' on the first validation batch.

  Uses the latest checkpoint's parameters of `workdir`, or the initial parameters without one.
  `config` is the resolved one (the record's, training/run_config.py).

  Returns:
    (list of layer i's sown attention intermediates (host arrays; {} where nothing is
    sown; the universal stack gives one entry per step), the batch (host arrays), the model
    config (specialized to the parameters), a description of the parameters' source, the
    whole sown tree).
  """
  restored = assembly.load(config, workdir, required='')
  setup, step, params, model = restored.setup, restored.step, restored.params, restored.model
  if params is None:
    params = assembly.init_state(setup, config.seed).params
    model = assembly.specialized_model(setup, params)
  local = _first_eval_batch(setup)
  with sharding.activate(setup.mesh, setup.rules):
    batch = assembly.device_batch(setup, local)
    variables = {'params': params}
    mutable = ['intermediates']
    if setup.model_config.uses_memory:  # Laid out for the global batch, as training's.
      variables['memory'] = steps.fresh_memory(setup, batch['inputs'].shape[0])
      mutable.append('memory')
    _, sown = jax.jit(lambda v, b: model.apply(
        v, b['inputs'], positions=b['positions'], segment_ids=b['segment_ids'],
        mutable=mutable))(variables, batch)
  mc = model.config
  # On several processes the batch and what is sown span them all (rows over the data axes,
  # heads over the tensor axis): every process gathers the whole of both.
  sown, batch = host.to_host((sown['intermediates'], batch))
  stack = stacks.of(mc)
  layers = [tree.get('attention', {}) for tree in stack.sown_layers(mc, sown)]
  source = f'checkpoint step {step}' if step is not None else 'initial parameters'
  return layers, batch, mc, source, sown


def plot_matrices(panels: dict[str, np.ndarray], path: str, title: str) -> None:
  """One heatmap per panel (NaN blank), greener = lower (like figure 5 of the
  selective-attention paper)."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  cols = min(4, len(panels))
  rows = -(-len(panels) // cols)
  fig, axes = plt.subplots(rows, cols, figsize=(3.0 * cols, 3.0 * rows + 0.5), squeeze=False)
  for ax in axes.flat:
    ax.axis('off')
  for ax, (name, matrix) in zip(axes.flat, panels.items()):
    ax.imshow(matrix, cmap='RdYlGn_r', interpolation='nearest')
    ax.set_title(name, fontsize=8)
  fig.suptitle(title, fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def plot_head_bars(values: np.ndarray, y_max: float, path: str, title: str,
                   y_label: str) -> None:
  """(layers, heads) values as one bar per head, grouped by layer, log scale (like figure 4
  of the adaptive-span paper)."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  layers, heads = values.shape
  fig, ax = plt.subplots(figsize=(1.0 + 0.5 * layers, 3.2))
  width = 0.8 / heads
  for h in range(heads):
    ax.bar(np.arange(layers) + (h - (heads - 1) / 2) * width, np.maximum(values[:, h], 1),
           width, color=plt.cm.viridis(h / max(heads - 1, 1)))
  ax.set_yscale('log')
  ax.set_ylim(1, y_max * 1.2)
  ax.set_xticks(np.arange(layers), [str(i + 1) for i in range(layers)])
  ax.set_xlabel('layer')
  ax.set_ylabel(y_label)
  ax.set_title(title, fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def plot_bars(panels: dict, path: str, title: str) -> None:
  """One bar chart per panel: {title: {'x', 'y', 'xlabel', 'ylabel'}}."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, len(panels), figsize=(3.6 * len(panels), 3.2), squeeze=False)
  for ax, (name, panel) in zip(axes[0], panels.items()):
    ax.bar(np.asarray(panel['x']), np.asarray(panel['y']), width=0.8, color='tab:blue')
    ax.set_xlabel(panel.get('xlabel', ''))
    ax.set_ylabel(panel.get('ylabel', ''))
    ax.set_title(name, fontsize=8)
  fig.suptitle(title, fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def write_figure(figure, out_dir: str) -> dict[str, str]:
  """Renders a variant's Figure (models/attention/traits.py) into `out_dir`: FILE.png, plus
  FILE.npz of its arrays and FILE.json of its report; returns {NAME_png: path, ...}."""
  paths = {f'{figure.name}_png': os.path.join(out_dir, f'{figure.file}.png')}
  if figure.kind == 'matrices':
    plot_matrices(figure.panels, paths[f'{figure.name}_png'], figure.title)
  elif figure.kind == 'head_bars':
    plot_head_bars(figure.panels['values'], figure.y_max, paths[f'{figure.name}_png'],
                   figure.title, figure.y_label)
  elif figure.kind == 'bars':
    plot_bars(figure.panels, paths[f'{figure.name}_png'], figure.title)
  else:
    raise ValueError(f'unknown figure kind {figure.kind!r} of {figure.name}')
  if figure.arrays:
    paths[f'{figure.name}_npz'] = os.path.join(out_dir, f'{figure.file}.npz')
    np.savez_compressed(paths[f'{figure.name}_npz'], **figure.arrays)
  if figure.report is not None:
    paths[f'{figure.name}_json'] = os.path.join(out_dir, f'{figure.file}.json')
    with open(paths[f'{figure.name}_json'], 'w') as f:
      json.dump(figure.report, f, indent=2)
  logging.info('%s: %s; wrote %s', figure.name, figure.summary or figure.title,
               paths[f'{figure.name}_png'])
  return paths


def write_maps(config: ml_collections.ConfigDict, workdir: str,
               request: run_config.Request | None = None) -> dict[str, str]:
  """Writes the connectivity masks and their plot, and the figures of each variant in use
  (its `inspect` hook: F of selective attention, spans of adaptive spans); returns the paths
  written.

  Args:
    config: the config given; in a workdir with a recorded run, the record's model is
      inspected (training/run_config.py: `request` may change run-time settings).
    workdir: the run's folder (or a new one: the configured model, initialized).
    request: what the command line asked for; None: every field of `config`.
  """
  assembly.check_workdir(workdir)
  config = run_config.resolve(config, workdir, trains=False, request=request).config
  agreement.agree('settings', agreement.settings(run_config.as_flat_json(config)),
                  agreement.SETTINGS_ADVICE)
  model_cfg = dict(config.model)
  model_cfg['vocab_size'] = model_cfg.get('vocab_size') or 1  # Not needed for the masks.
  n = config.inspect_len or config.seq_len
  model_cfg['max_len'] = model_cfg.get('max_len') or n
  mc = transformer.TransformerConfig.from_config(model_cfg)
  masks = connectivity(mc, n)
  out_dir = os.path.join(workdir, 'inspect')
  # On several processes each computes the same figures and process 0 writes them (two
  # writers of one file in a shared workdir could interleave).
  writes = jax.process_index() == 0
  os.makedirs(out_dir, exist_ok=True)
  npz = os.path.join(out_dir, 'connectivity.npz')
  png = os.path.join(out_dir, 'connectivity.png')
  kinds = ','.join(sorted(set(mc.attention)))
  if writes:
    np.savez_compressed(npz, **masks)
    plot(masks, mc.n_layers, mc.n_heads, png, f'{kinds} attention, n={n}')
  density = {k: float(v.sum()) / (n * (n + 1) / 2) for k, v in masks.items()}
  logging.info('connectivity of %d layers x %d heads (n=%d): mean density %.3f of causal; '
               'wrote %s and %s', mc.n_layers, mc.n_heads, n, np.mean(list(density.values())),
               npz, png)
  paths = {'npz': npz, 'png': png}
  stack = stacks.of(mc)
  variants = [attention.traits.of(name) for name in dict.fromkeys(mc.attention)]
  if stack.inspect.__func__ is stacks.Stack.inspect.__func__ and not any(
      t.draws() for t in variants):  # Neither the stack nor a variant draws.
    return paths
  layers, batch, model_config, source, sown = sown_per_layer(config, workdir)
  figures = stack.inspect(model_config, sown, batch, source)
  for t in variants:
    figures += t.inspect(model_config, layers, batch, source)
  for figure in figures:
    paths.update(write_figure(figure, out_dir) if writes else {})
  return paths
