"""Trains several attention variants on one data config and compares them in one table.

  python -m experiments.compare --config.data.files=../shared/data/tinyshakespeare.txt
  python -m experiments.compare --variants=dense,local:window=64,reformer --d 2 --steps 600 \
      --config.data.files=../shared/data/tinyshakespeare.txt --config.seq_len=256
  python -m experiments.compare --config configs/tiny.py --variants=dense,selective

Every variant is a real training run (training.train.train_and_evaluate) in its own folder
under --workdir, so it can later be resumed, evaluated (`python main.py --workdir=W/dense
--mode=eval`) or sampled; a finished run is not trained again, an interrupted one resumes.
All runs share the recipe (--config, its --config.KEY=VALUE overrides as main.py takes them,
--d), the seed, the data order and the step budget; each differs only by its variant's own keys
(listed per row in the JSON). The runs are experiments/harness.py's (its Python API runs the
same from a script or a notebook).

Variants (--variants, a comma list):
  NAME                 a registered attention variant (models/attention/registry.py)
  NAME:KEY=V[:KEY=V]   with options: KEY is an attention option (window, stride, mem_len, ...),
                       a stack or block option (act, steps, gate_bias, ...), a model field
                       (block, stack, ...) or a dotted config key; e.g. local:window=64,
                       dense:residual=gtrxl, lsh:n_hashes=2:chunk_len=32, universal:act=true
  PRESET[:KEY=V...]    a block or stack preset: gtrxl (txl attention + GTrXL gated layers),
                       reformer (lsh attention + reversible layers), universal (one shared
                       dense block applied n_layers times, the universal stack's coordinates)
  registered, presets  every registered variant / every preset (the default: registered)
A variant gets what it needs to run: relative-position variants (txl) no absolute positions,
and variants with segment memory (txl, gtrxl) rows that continue one text stream
(data.packing='stream'; the same text, dealt to the rows differently). A variant of the
'registered' or 'presets' lists that cannot run on the chosen data (e.g. txl on a synthetic
task) is skipped with the reason; a named one that cannot is an error.

Columns: eval loss and bits per byte (text) at the last step, parameters, training FLOPs per
token (TransformerConfig.train_flops_per_token: 6 N_matmul + 12 L H d_head T, the full causal
score matrix for every variant), training tokens/s, the peak memory of one attention layer's
forward + backward at the run's batch and sequence length (XLA's compiled memory analysis:
arguments + outputs + temporaries, like benchmarks/attention_scaling.py; the largest over the
layers, each with the options its trained parameters give, e.g. adaptive span's trimmed span)
and the decoding cache of one row of max_len tokens (models/decode.py, decode.cache_bytes: the
keys and values held; lsh and reformer hold those of every position, as dense does; '-' for a
variant that cannot decode token by token, none of the registered ones or the presets).
Tokens/s: after all runs, each variant's train step with its trained parameters on random
tokens, timed round-robin (--time_rounds rounds of --time_steps steps each, each round
starting one variant later), so that a busy phase of a shared machine slows all alike; the
median over rounds. With --time_rounds 0: the median of the run's logged windows that hold
no compile, evaluation or checkpoint save.

Prints a markdown table, writes the rows (experiments/rows.py's format: run = the variant
spec), the command and the machine to --out (JSON) and the eval loss curves to --png. Samples
at evaluation are off (generate.eval_samples=0): sample a finished run with main.py instead.
"""


import argparse
import math
import os
import shlex
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from experiments import harness  # noqa: E402  (sets the XLA flags before JAX starts)
from experiments import rows as rows_lib  # noqa: E402

from absl import flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from benchmarks import common  # noqa: E402
from configs import presets  # noqa: E402
from models import attention  # noqa: E402
from training import assembly, metrics  # noqa: E402

DEFAULT_CONFIG = os.path.join(REPO, 'configs', 'local_text.py')
DEFAULT_OUT = os.path.join(REPO, 'results', 'compare.json')
DEFAULT_PNG = os.path.join(REPO, 'docs', 'img', 'compare_curves.png')
GROUPS = ('registered', 'presets')

COLUMNS = ('variant', 'eval_loss', 'bits_per_byte', 'params', 'train_flops_per_token',
           'tokens_per_sec', 'attn_peak_bytes', 'decode_cache_bytes')
HEADERS = {'variant': 'variant', 'eval_loss': 'eval loss', 'bits_per_byte': 'bits/byte',
           'params': 'params', 'train_flops_per_token': 'train FLOPs/token',
           'tokens_per_sec': 'train tokens/s', 'attn_peak_bytes': 'attn peak (MiB)',
           'decode_cache_bytes': 'decode cache (KiB)'}


def expand(variants: str) -> tuple[list[str], set[str]]:
  """The specs of --variants, its groups expanded, in order; and those only a group named
  (skipped, not refused, when they cannot run on the data)."""
  specs, named = [], set()
  for item in [v.strip() for v in variants.split(',') if v.strip()]:
    if item in GROUPS:
      names = list(attention.known()) if item == 'registered' else list(presets.PRESETS)
    else:
      names = [item]
      named.add(item)
    specs.extend(n for n in names if n not in specs)
  return specs, set(specs) - named


def fmt(column: str, value) -> str:
  """A table cell."""
  if value is None or (isinstance(value, float) and math.isnan(value)):
    return '-'
  if column in ('eval_loss', 'bits_per_byte'):
    return f'{value:.4f}'
  if column == 'params':
    return f'{value:,}'
  if column == 'train_flops_per_token':
    return f'{value / 1e6:.2f}M'
  if column == 'tokens_per_sec':
    return f'{value:,.0f}'
  if column == 'attn_peak_bytes':
    return f'{value / 2**20:.2f}'
  if column == 'decode_cache_bytes':
    return f'{value / 2**10:,.0f}'
  return str(value)


def markdown(rows: list[dict]) -> str:
  lines = ['| ' + ' | '.join(HEADERS[c] for c in COLUMNS) + ' |',
           '|' + '|'.join('---' if c == 'variant' else '---:' for c in COLUMNS) + '|']
  for r in rows:
    lines.append('| ' + ' | '.join(fmt(c, rows_lib.field(r, c, None)) for c in COLUMNS) + ' |')
  return '\n'.join(lines)


def plot(rows: list[dict], path: str, title: str) -> None:
  """Eval loss against step, one line per variant."""
  plt = common.pyplot()
  fig, ax = plt.subplots(figsize=(11, 5.5))
  styles = ['-', '--', ':', '-.']
  for i, r in enumerate(rows):
    points = r['curves']['eval_loss']
    if not points:
      continue
    steps, values = zip(*points)
    ax.plot(steps, values, marker='o', markersize=3, linestyle=styles[(i // 10) % len(styles)],
            color=f'C{i % 10}', label=r['run'])
  ax.set(xlabel='step', ylabel='eval loss (nats per token)', title=title)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8, loc='upper left', bbox_to_anchor=(1.01, 1.0))
  common.save_figure(fig, path)


def recipe(path: str, overrides: list[str]):
  """The recipe file with its --config.KEY=VALUE overrides, read by ml_collections as main.py
  reads them."""
  argv = ['compare', f'--config={path}'] + overrides
  values = flags.FlagValues()
  try:
    config_flags.DEFINE_config_file('config', path, flag_values=values, sys_argv=argv)
    values(argv)
  except (flags.Error, AttributeError, KeyError) as e:
    raise ValueError(f'bad config override ({type(e).__name__}: {e}); given: '
                     f'{" ".join(overrides) or "none"}') from e
  return values.config


def parse_args(argv):
  """(the options, the --config.KEY=VALUE overrides)."""
  p = argparse.ArgumentParser(prog='python -m experiments.compare', description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument('--variants', default='registered',
                 help='comma list of variant specs (see above); default: registered')
  p.add_argument('--config', default=DEFAULT_CONFIG,
                 help='recipe file (default: %(default)s); override its fields with '
                 '--config.KEY=VALUE (repeatable), e.g. --config.seq_len=256')
  p.add_argument('--steps', type=int, default=300, help='training steps of every variant')
  p.add_argument('--evals', type=int, default=10, help='evaluations per run (the curve points)')
  p.add_argument('--time_rounds', type=int, default=5,
                 help='after training, time every train step round-robin for this many rounds '
                 '(the tokens/s column: their median); 0: the runs\' logged tokens/s instead')
  p.add_argument('--time_steps', type=int, default=5, help='steps per variant per round')
  p.add_argument('--d', type=int, default=0,
                 help='size knob: d_model 64 d, d heads, d layers (0: the recipe\'s sizes)')
  p.add_argument('--workdir', default=os.path.join(REPO, 'runs', 'compare'),
                 help='each variant trains in WORKDIR/<variant>')
  p.add_argument('--out', default=DEFAULT_OUT, help='JSON (default: %(default)s)')
  p.add_argument('--png', default=DEFAULT_PNG, help='eval loss curves (default: %(default)s)')
  p.add_argument('--no_progress', action='store_true', help='no progress bars')
  args, rest = p.parse_known_args(argv)
  bad = [a for a in rest if not a.startswith('--config.')]
  if bad:
    p.error(f'unrecognized arguments: {" ".join(bad)}')
  if args.steps < 1 or args.evals < 1 or args.time_rounds < 0 or args.time_steps < 1:
    p.error('--steps, --evals and --time_steps must be >= 1, --time_rounds >= 0')
  return args, rest


def main(argv=None) -> dict:
  argv = sys.argv[1:] if argv is None else argv
  args, overrides = parse_args(argv)
  logging.set_verbosity(logging.INFO)
  metrics.quiet_libraries()
  base = harness.base_config(recipe(args.config, overrides), steps=args.steps,
                             evals=args.evals, d=args.d, workdir=args.workdir)
  specs, grouped = expand(args.variants)
  runnable, skipped = [], {}
  for spec in specs:  # A grouped variant that cannot run on the data is skipped, with why.
    if spec in grouped:
      try:
        assembly.build(harness.variant_config(base, spec)).data.close()
      except ValueError as e:
        skipped[spec] = str(e)
        print(f'[{spec}] skipped: {e}', flush=True)
        continue
    runnable.append(spec)
  if not runnable:
    raise SystemExit('no variant can run on this data')
  rows = harness.run(runnable, base, None, args.workdir, time_rounds=args.time_rounds,
                     time_steps=args.time_steps, progress=not args.no_progress,
                     on_row=lambda r: print(
                         f'[{r["run"]}] done in {r["metrics"]["run_seconds"]:.0f} s: eval loss '
                         f'{fmt("eval_loss", r["metrics"]["eval_loss"])}', flush=True))
  table = markdown(rows)
  print('\n' + table + '\n')
  command = 'python -m experiments.compare ' + shlex.join(argv)
  data = base.data
  settings = {'config': os.path.relpath(args.config, REPO), 'overrides': overrides,
              'd': args.d, 'steps': args.steps, **harness.describe(base),
              'time_rounds': args.time_rounds, 'time_steps': args.time_steps}
  payload = {'command': command, 'settings': settings, 'columns': list(COLUMNS),
             'rows': rows,
             'skipped': skipped, 'table': table}
  common.write_json(args.out, payload)
  plot(rows, args.png, f'eval loss, {data.name} ({", ".join(settings["files"]) or data.name}), '
       f'{args.steps} steps, batch {base.batch_size} x {base.seq_len}')
  return payload


if __name__ == '__main__':
  main()
