"""Recipes: `python main.py --config=configs/<name>.py`.

PAPER_RECIPES are the source papers' headline experiments at the papers' own scale, one file
each, named after the paper and the dataset. Each sets config.compile_topology to the smallest
TPU slice it fits, so `python main.py --config=configs/<name>.py --mode=compile --workdir=DIR`
checks it with no data; its docstring names that slice, the mesh and remat, the per-chip memory
and the estimated speed (from `python -m benchmarks.tpu_compile --recipes`, committed in
results/tpu_compile_recipes.json) and the one line that runs it tiny on a CPU.
docs/tpu.md has them in one table.
"""

import hashlib
import importlib
import json

import ml_collections

# Recipe name: the paper and its experiment.
PAPER_RECIPES = {
    'selective_c4': 'Selective attention (Leviathan et al., 2024): C4, d=12',
    'selective_variable_assignment':
        'Selective attention (Leviathan et al., 2024): Variable Assignment, d=3',
    'sparse_transformer_enwik8':
        'Sparse Transformer (Child et al., 2019): enwik8, context 12,288, 30 layers, fixed',
    'adaptive_span_enwik8': 'Adaptive span (Sukhbaatar et al., 2019): enwik8, 12 layers, S=8192',
    'adaptive_span_text8': 'Adaptive span (Sukhbaatar et al., 2019): text8, 12 layers, S=8192',
    'transformer_xl_enwik8': 'Transformer-XL (Dai et al., 2019): enwik8, 12 layers, M=512',
    'reformer_enwik8': 'Reformer (Kitaev et al., 2020): enwik8-64K, LSH + reversible, 12 layers',
    'universal_transformer_algorithmic':
        'Universal Transformer + ACT (Dehghani et al., 2019): copy, length 40',
}

# What a paper recipe needs on the command line to train: its corpus is not in the repository
# (text recipes read the file the paper names; C4 is read prepared in TFDS under data_dir).
# The synthetic tasks (Variable Assignment, copy) are generated on the fly and need nothing.
PAPER_DATA = {
    'selective_c4': '--config.data.data_dir=PATH/tensorflow_datasets',
    'sparse_transformer_enwik8': '--config.data.files=PATH/enwik8',
    'adaptive_span_enwik8': '--config.data.files=PATH/enwik8',
    'adaptive_span_text8': '--config.data.files=PATH/text8',
    'transformer_xl_enwik8': '--config.data.files=PATH/enwik8',
    'reformer_enwik8': '--config.data.files=PATH/enwik8',
}


def load(name: str) -> ml_collections.ConfigDict:
  """configs/<name>.py's config."""
  return importlib.import_module(f'configs.{name}').get_config()


def fingerprint(config: ml_collections.ConfigDict) -> str:
  """A short hash of every setting of `config`: a committed compile result is of this recipe
  as it is now only if the fingerprints agree.

  The option groups (model.attention_options, ...) hold every registered variant's options;
  only those the project's own modules declare count, so that a variant registered at run
  time (a user's, or a test's) does not change the recipes' fingerprints.
  """
  return hash_settings(fingerprint_settings(config))


def fingerprint_settings(config: ml_collections.ConfigDict) -> dict:
  """The settings `fingerprint` hashes: config.to_dict() with the option groups filtered to
  what the project's own modules declare."""
  from models import options as options_lib  # pylint: disable=import-outside-toplevel
  from models import transformer  # pylint: disable=import-outside-toplevel
  settings = config.to_dict()
  # The downstream tasks (--mode=harness) run after training and change no compiled program;
  # their group, added after the committed compiles, leaves the fingerprints as they were.
  settings.pop('harness', None)
  for group, registry in transformer.OPTION_GROUPS.items():
    ours = {name for name, cls in registry.items() if cls.__module__.startswith('models.')}
    if registry.per_entry:  # One group per entry.
      settings['model'][group] = {k: v for k, v in settings['model'][group].items() if k in ours}
      continue
    own = {o for name in ours for o in options_lib.declared(registry.get(name))}
    settings['model'][group] = {k: v for k, v in settings['model'][group].items() if k in own}
  return settings


def hash_settings(settings: dict) -> str:
  text = json.dumps(settings, sort_keys=True, default=str)
  return hashlib.sha256(text.encode()).hexdigest()[:16]


def _three_digits(x: float) -> float:
  return float(f'{x:.3g}')


def _mesh(row: dict) -> str:
  """The mesh axes of more than one device, e.g. 'data=2,tensor=2'."""
  return ','.join(f'{k}={v}' for k, v in row['mesh'].items() if v > 1)


def _percent(fraction: float) -> str:
  """'15%', or '0.5%' under 1% (a step that computes far more than the model count reads 0%
  rounded)."""
  return f'{100 * fraction:.1f}%' if fraction < 0.01 else f'{100 * fraction:.0f}%'


def _duration(seconds: float) -> str:
  from analysis.roofline import duration  # pylint: disable=import-outside-toplevel
  return duration(seconds)


def slice_name(topology: str) -> str:
  """Cloud TPU's name of the slice of `topology`: v5e counts chips (v5e:2x4 is v5e-8), v4 and
  v5p count TensorCores, two per chip (v4:2x2x1 is v4-8)."""
  generation, _, shape = topology.partition(':')
  chips = 1
  for n in shape.split('x'):
    chips *= int(n)
  return f'{generation}-{chips * 2 if generation in ("v4", "v5p", "v5") else chips}'


def header_lines(row: dict) -> str:
  """The 'slice:', 'memory:' and 'speed:' lines of a recipe's docstring, from its row of
  results/tpu_compile_recipes.json (benchmarks/tpu_compile.py --recipes)."""
  per_day = _three_digits(row['steps_per_day'])
  head = (f"  slice:    {slice_name(row['topology'])} (compile_topology '{row['topology']}'), "
          f"mesh {_mesh(row)}, remat '{row['remat']}'\n"
          f"  memory:   {row['gib_per_chip']:.2f} GiB per chip of {row['hbm_gib']:.0f} GiB (the "
          f"train step, by the TPU compiler's estimate)\n")
  if 'step_seconds' not in row:  # A row compiled before the roofline estimate.
    return head + (
        f"  speed:    ~{per_day:,.0f} steps/day at {100 * row['assumed_mfu']:.0f}% "
        f"MFU, estimated from the model FLOPs and\n"
        f"            {row['peak_tflops_per_chip']:.0f} TFLOP/s bf16 per chip (not measured): "
        f"{row['total_steps']:,} steps in ~{row['days']:.2g} days")
  return head + (
      f"  speed:    ~{per_day:,.0f} steps/day: a step of {_duration(row['step_seconds'])}, "
      f"{row['bound']}-bound, MFU {_percent(row['mfu'])} (FLOPs run: "
      f"{_percent(row['flops_utilization'])})\n"
      f"            (the roofline estimate of the compiled step, not measured): "
      f"{row['total_steps']:,} steps in ~{row['days']:.2g} days")


def recipes_markdown(rows: list[dict]) -> str:
  """The table of docs/tpu.md ("The papers at their own scale") from the committed rows."""
  lines = ['| paper: experiment | recipe | slice | mesh, remat | GiB per chip (HBM) | '
           'step (est.) | bound | MFU (FLOPs run) (est.) | steps/day (est.) | '
           'days to the paper\'s steps (est.) |',
           '|---|---|---|---|---|---|---|---|---|---|']
  for row in rows:
    lines.append(
        f'| {PAPER_RECIPES[row["recipe"]]} | `configs/{row["recipe"]}.py` | '
        f'{slice_name(row["topology"])} | {_mesh(row)}, {row["remat"]} | '
        f'{row["gib_per_chip"]:.2f} ({row["hbm_gib"]:.0f}) | '
        + (f'{_duration(row["step_seconds"])} | {row["bound"]} | {_percent(row["mfu"])} '
           f'({_percent(row["flops_utilization"])}) | '
           if 'step_seconds' in row else
           f'- | - | {100 * row["assumed_mfu"]:.0f}% (assumed) | ') +
        f'{_three_digits(row["steps_per_day"]):,.0f} | '
        f'{row["total_steps"]:,} steps: {row["days"]:.2g} |')
  return '\n'.join(lines)
