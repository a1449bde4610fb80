"""Adaptive attention span (Sukhbaatar et al., 2019): learned spans, dynamic spans and the
same model with every span fixed at the limit S, on byte-level text, over seeds.

  python -m experiments.adaptive_span_lm --text ../shared/data/tinyshakespeare.txt \
      --out OUT/adaptive_span_lm.json

The runs are data (RUNS): each (variant, seed) is a real training run of
experiments/harness.py with the recipe configs/adaptive_span_char.py (relative positions,
R = 32, lambda = 2e-6, segments attending into the cached previous ones up to S back), scaled by --layers/--heads/--d_model, kept in
--workdir/seed<S>/<variant> so that a rerun resumes or reuses it. The variants:

- adaptive: 'adaptive_span', z = S z' per head, z' learned from 0 (section 2.2);
- dynamic: 'dynamic_span', z_t = S sigmoid(v . x_t + b) per token and head, b = -4 at init;
- fixed: 'adaptive_span:learned=False', every head's span z = S (the paper's fixed-span
  baseline: the same model, mask and relative positions, all S keys).

After training, each run's spans per layer and head are read by `main.py --mode=inspect`'s
code (training/attention_maps.py; the adaptive span's z = S z' from the checkpoint, the dynamic
span's z_t averaged over the first validation batch), with span_report's attention FLOPs per
predicted token (q.k and a.v, 4 head_dim per key): 'trimmed' is what the code computes (a
layer's heads together up to its trimmed span T, the dynamic span always S), 'per_head' each
head stopping at z + R. The harness gives the validation bits per byte (the whole split), the
compiled peak memory of one attention layer's forward + backward at the run's trimmed spans
and the timed train step (round-robin).

Writes the per-seed rows and the per-variant mean and spread (sample standard deviation over
seeds) to --out (JSON) and the spans per layer and head of every seed (figure 4 of the paper,
log scale) to --png.
"""

import argparse
import os
import shlex
import statistics
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from experiments import harness  # noqa: E402  (sets the XLA flags before JAX starts)
from experiments import rows as rows_lib  # noqa: E402

from benchmarks import common  # noqa: E402

RECIPE = os.path.join(REPO, 'configs', 'adaptive_span_char.py')
# name in the JSON -> the harness's variant spec.
RUNS = {'adaptive': 'adaptive_span', 'dynamic': 'dynamic_span',
        'fixed': 'adaptive_span:learned=False'}
TIME_STEPS = 3  # Steps per run per round of the round-robin timing (--time_rounds rounds).


def read_spans(config, workdir: str) -> dict:
  """span_report (models/attention/adaptive_span.py) of a trained run: the spans per layer and
  head as --mode=inspect reads them, the average span, trimmed spans and attention FLOPs."""
  import numpy as np
  from models import transformer
  from models.attention import adaptive_span
  from training import attention_maps, run_config
  config = run_config.resolve(config, workdir, trains=False).config
  layers, _, model_config, source, _ = attention_maps.sown_per_layer(config, workdir)
  head_spans = np.stack([np.asarray(layer['head_spans'][0], np.float64) for layer in layers])
  report = adaptive_span.span_report(model_config, head_spans)
  if any(getattr(cls, 'dynamic', False) for cls in transformer.variant_classes(model_config)):
    # z_t follows the input: no static trim, every query computes all S keys (T = S).
    flops = report['attention_flops_per_token']
    flops['trimmed'] = flops['full_span']
    report['trimmed_spans'] = [report['span_limit']] * len(report['trimmed_spans'])
    report['flops_saved_vs_full_span'] = 0.0
  report['source'] = source
  report['head_spans'] = head_spans.tolist()  # Unrounded.
  return report


def layer_halves(head_spans: list[list[float]]) -> tuple[float, float]:
  """(mean span of the bottom half of the layers, of the top half); the middle layer of an odd
  count belongs to neither."""
  n = len(head_spans)
  bottom = [z for layer in head_spans[:n // 2] for z in layer]
  top = [z for layer in head_spans[n - n // 2:] for z in layer]
  return statistics.mean(bottom), statistics.mean(top)


# The metrics of a row aggregated over seeds (experiments/rows.py: over_seeds).
KEYS = ('bits_per_byte', 'average_span', 'max_span', 'attn_flops_trimmed', 'attn_flops_per_head',
        'attn_flops_full_span', 'attn_peak_bytes', 'steps_per_sec', 'bottom_half_span',
        'top_half_span')


def plot(per_seed: dict[int, dict[str, dict]], limit: int, path: str, title: str) -> None:
  """Figure 4: one bar per head, grouped by layer, log scale; a panel per variant and seed
  (per_seed: seed -> variant -> its row, experiments/rows.py)."""
  plt = common.pyplot()
  import numpy as np
  panels = [(seed, name, r) for seed, rows in per_seed.items() for name, r in rows.items()
            if name != 'fixed']
  fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 3.4), squeeze=False)
  for ax, (seed, name, r) in zip(axes[0], panels):
    values = np.asarray(rows_lib.field(r, 'head_spans'))
    layers, heads = values.shape
    width = 0.8 / heads
    for h in range(heads):
      ax.bar(np.arange(layers) + (h - (heads - 1) / 2) * width, np.maximum(values[:, h], 1),
             width, color=plt.cm.viridis(h / max(heads - 1, 1)))
    ax.axhline(limit, color='grey', linestyle=':', linewidth=1)
    ax.set_yscale('log')
    ax.set_ylim(1, limit * 1.5)
    ax.set_xticks(np.arange(layers), [str(i + 1) for i in range(layers)])
    ax.set_xlabel('layer')
    ax.set_ylabel('span z (bytes)')
    ax.set_title(f'{name}, seed {seed}: average {rows_lib.field(r, "average_span"):.1f}',
                 fontsize=8)
  fig.suptitle(title, fontsize=9)
  common.save_figure(fig, path)


def parse_args(argv):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument('--text', required=True, help='byte-level training text (one file)')
  p.add_argument('--out', required=True, help='JSON of the results')
  p.add_argument('--png', default='', help='spans per layer and head (default: next to --out)')
  p.add_argument('--workdir', default=os.path.join(REPO, 'runs', 'adaptive_span_lm'))
  p.add_argument('--seeds', default='0,1')
  p.add_argument('--steps', type=int, default=300)
  p.add_argument('--evals', type=int, default=3)
  p.add_argument('--layers', type=int, default=4)
  p.add_argument('--heads', type=int, default=4)
  p.add_argument('--d_model', type=int, default=128)
  p.add_argument('--seq_len', type=int, default=256)
  p.add_argument('--batch_size', type=int, default=8)
  p.add_argument('--span_limit', type=int, default=256, help='S')
  p.add_argument('--learning_rate', type=float, default=0.003)
  p.add_argument('--eval_steps', type=int, default=0,
                 help='validation batches per evaluation (0: the whole split)')
  p.add_argument('--time_rounds', type=int, default=2)
  p.add_argument('--variants', default=','.join(RUNS))
  return p.parse_args(argv)


def base_config(args):
  """The recipe scaled by --layers/--heads/--d_model on --text, at --span_limit S."""
  return harness.base_config(
      RECIPE, steps=args.steps, evals=args.evals, workdir=args.workdir, overrides={
          'data.files': os.path.abspath(args.text), 'seq_len': args.seq_len,
          'batch_size': args.batch_size, 'eval_steps': args.eval_steps,
          'learning_rate': args.learning_rate, 'data.chunk_bytes': 16384,
          'model.n_layers': args.layers, 'model.n_heads': args.heads,
          'model.d_model': args.d_model, 'model.attention_options.adaptive_span.limit':
          args.span_limit, 'model.attention_options.dynamic_span.limit': args.span_limit})


def row(r: dict, spans: dict, tokens_per_step: int) -> dict:
  """One (variant, seed) of the JSON: the harness row with the run's spans."""
  bottom, top = layer_halves(spans['head_spans'])
  flops = spans['attention_flops_per_token']
  m = r['metrics']
  return {
      'variant': r['run'], 'step': m['step'], 'bits_per_byte': m['bits_per_byte'],
      'eval_loss': m['eval_loss'], 'params': m['params'],
      'head_spans': spans['head_spans'], 'average_span': spans['average_span'],
      'max_span': spans['max_span'], 'trimmed_spans': spans['trimmed_spans'],
      'bottom_half_span': bottom, 'top_half_span': top,
      'attn_flops_trimmed': flops['trimmed'], 'attn_flops_per_head': flops['per_head'],
      'attn_flops_full_span': flops['full_span'],
      'attn_peak_bytes': m['attn_peak_bytes'],
      'decode_cache_bytes': m['decode_cache_bytes'],
      'train_flops_per_token': m['train_flops_per_token'],
      'steps_per_sec': m['tokens_per_sec'] / tokens_per_step,
      'run_seconds': m['run_seconds'], 'spans_source': spans['source'],
      'curves': r['curves']}


def analyze(per_seed: dict[int, dict[str, dict]], settings: dict) -> dict:
  """The JSON payload (without the command) from every (variant, seed)'s row."""
  summary = rows_lib.over_seeds(per_seed, KEYS)
  lines = ['| variant | bits/byte | average span | top / bottom half span | attention FLOPs/token '
           '(as computed) | attn peak (MiB) | steps/s |', '|---|---:|---:|---:|---:|---:|---:|']
  for name, e in summary.items():
    m = e['mean']
    lines.append(
        f'| {name} | {m["bits_per_byte"]:.3f} ± {e["std"]["bits_per_byte"]:.3f} | '
        f'{m["average_span"]:.1f} | {m["top_half_span"]:.1f} / {m["bottom_half_span"]:.1f} | '
        f'{m["attn_flops_trimmed"]:,.0f} | {m["attn_peak_bytes"] / 2**20:.2f} | '
        f'{m["steps_per_sec"]:.2f} |')
  return {'settings': settings, 'variants': summary, 'table': '\n'.join(lines)}


def main(argv=None) -> dict:
  args = parse_args(argv)
  if not os.path.isfile(args.text):
    raise SystemExit(f'--text {args.text}: no such file')
  seeds = [int(s) for s in args.seeds.split(',')]
  names = [n.strip() for n in args.variants.split(',') if n.strip()]
  unknown = [n for n in names if n not in RUNS]
  if unknown:
    raise SystemExit(f'--variants: unknown {unknown}; known: {", ".join(RUNS)}')
  base = base_config(args)
  runs = [harness.Run(RUNS[n], RUNS[n]) for n in names]
  rows = harness.run(runs, base, seeds, args.workdir, time_rounds=args.time_rounds,
                     time_steps=TIME_STEPS)
  by_run = {(r['seed'], r['run']): r for r in rows}
  per_seed = {}
  for seed in seeds:
    per_seed[seed] = {}
    for name in names:
      r = by_run[seed, RUNS[name]]
      config = harness.override(harness.variant_config(base, RUNS[name]), {'seed': seed})
      per_seed[seed][name] = rows_lib.row(name, seed, row(
          r, read_spans(config, r['workdir']), args.batch_size * args.seq_len))
  settings = {
      'text': os.path.basename(args.text), 'seeds': seeds, 'steps': args.steps,
      'layers': args.layers, 'heads': args.heads, 'd_model': args.d_model,
      'seq_len': args.seq_len, 'batch_size': args.batch_size, 'span_limit': args.span_limit,
      'span_ramp': base.model.attention_options.adaptive_span.ramp,
      'learning_rate': args.learning_rate, 'eval_steps': args.eval_steps,
      'variants': {n: RUNS[n] for n in names},
      'harness': {'recipe': os.path.relpath(RECIPE, REPO), **harness.describe(base),
                  'time_rounds': args.time_rounds, 'time_steps': TIME_STEPS}}
  payload = analyze(per_seed, settings)
  print('\n' + payload['table'] + '\n')
  payload = {'command': 'python -m experiments.adaptive_span_lm ' + shlex.join(
      sys.argv[1:] if argv is None else argv), **payload}
  common.write_json(args.out, payload)
  png = args.png or os.path.splitext(args.out)[0] + '.png'
  plot(per_seed, args.span_limit, png,
       f'learned spans per layer and head (S={args.span_limit}, {args.steps} steps, '
       f'{args.layers} layers x {args.heads} heads, {os.path.basename(args.text)})')
  return payload


if __name__ == '__main__':
  main()
