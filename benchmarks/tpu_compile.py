"""Every attention variant's train step compiled for TPU slices ahead of time: fit and cost.

  python -m benchmarks.tpu_compile                          # the full matrix (below)
  python -m benchmarks.tpu_compile --variants dense selective --topologies v5e:2x2 --impl xla
  python -m benchmarks.tpu_compile --mesh fsdp=-1 --steps train eval decode
  python -m benchmarks.tpu_compile --recipes                # the paper recipes, each on its slice
  python -m benchmarks.tpu_compile --recipes reformer_enwik8
  python -m benchmarks.tpu_compile --recipes selective_c4 --impl pallas  # another kernel

The selective-attention paper's C4 model (configs/default.py at d=12: 12 layers x 12 heads,
d_model 768, 8K vocabulary, rows of 512 tokens, batch 256, bfloat16) with each registered
attention variant, compiled by the TPU compiler (libtpu) for v5e:4x4 (v5e-16) and v4:2x2x4
(v4-32) from this host: the same code as --mode=compile (training/aot.py compile_config), one
row per (topology, variant). Columns: whether the train step fits a chip's HBM, its GiB per
chip (arguments + outputs - donated + temporaries + code), XLA's FLOPs per step and chip
relative to dense attention on the same slice, the bytes of its collectives, the compile
time. A variant that does not compile gets its error in the row. Memory and FLOPs are the
compiler's estimates; nothing runs, so speed is not measured.

The layers are unrolled (`--stack unrolled`, the default here) so that every row counts every
layer: XLA counts a loop body once, in its FLOPs and in its collectives, so a scanned stack
(what model.stack='auto' picks for identical layers, e.g. dense) would show 1/12 of its layers
next to an unrolled one (e.g. a variant whose layers differ). `--stack auto` compiles the
recipe's own program (its memory and compile time; its FLOPs column is then not comparable
across stacks). Results go to results/tpu_compile.json.

`--recipes` compiles the paper recipes instead (configs.PAPER_RECIPES, each as its file sets
it, on its own config.compile_topology): the train, eval and decoding programs, as
`--mode=compile` does, with the roofline time estimate of the train step (analysis/roofline.py:
its step time, bound and MFU), each recipe's fingerprint (configs.fingerprint) and the GiB per
chip of its train step cut to one layer (layer_config, layer_gib: the budget the CI tier holds
each layer to), into results/tpu_compile_recipes.json. With `--impl NAME` (not 'auto') the
recipes' train steps alone are compiled with model.attention_impl=NAME, into
results/tpu_compile_recipes_NAME.json (docs/tpu.md's pallas columns). The
recipes' headers quote these numbers; tests/contracts/test_paper_recipes.py checks that they
agree with the file and that the file is of the recipes as they are now.
"""

import argparse
import ast
import json
import os
import time


from training import xla_flags  # noqa: E402

xla_flags.set_cpu_defaults()  # As main.py does, before JAX starts its backend.
xla_flags.skip_absent_tpu()

from benchmarks import common  # noqa: E402
import configs  # noqa: E402
from configs import default  # noqa: E402
from models import attention  # noqa: E402
from analysis import compile_report, program_stats  # noqa: E402,I100
from training import aot, assembly, tpu_topology  # noqa: E402

GiB = program_stats.GiB

TOPOLOGIES = ('v5e:4x4', 'v4:2x2x4')

# What a variant needs besides its name to build at all: Transformer-XL carries each row's
# previous segment (stream packing) and has relative positions.
VARIANT_SETTINGS = {
    'txl': {'data.packing': 'stream', 'model.position_embedding': 'none'},
}

COLUMNS = ('topology', 'variant', 'stack', 'fits', 'gib_per_chip', 'param_gib', 'xla_gflop',
           'model_gflop', 'flops_vs_dense', 'collective_mib', 'compile_s', 'error')


def make_config(args, variant: str, topology: str):
  """The paper's C4 recipe at args.d with `variant` attention, for `topology`."""
  config = default.get_config()
  config.model.d = args.d
  config.model.attention = variant
  config.model.attention_impl = args.impl
  config.model.dtype = args.dtype
  config.model.stack = args.stack
  config.seq_len = args.seq_len
  config.model.max_len = args.seq_len
  config.batch_size = args.batch
  config.compile_topology = topology
  config.compile_topology_num_slices = args.num_slices
  overrides = dict(VARIANT_SETTINGS.get(variant, {}))
  overrides.update({f'mesh.{k}': int(v) for k, v in (kv.split('=') for kv in args.mesh)})
  for kv in args.set:
    key, value = kv.split('=', 1)
    try:
      overrides[key] = ast.literal_eval(value)
    except (ValueError, SyntaxError):  # A bare word is a string.
      overrides[key] = value
  config.update_from_flattened_dict(overrides)
  return config


def bench(args, variant: str, topology: str) -> dict:
  """One row: the variant's programs compiled for the topology (or the error)."""
  row = {'topology': topology, 'variant': variant}
  start = time.perf_counter()
  try:
    report = aot.compile_config(make_config(args, variant, topology), tuple(args.steps))
  except (ValueError, NotImplementedError) as e:
    row.update(error=str(e)[:300], wall_s=time.perf_counter() - start)
    return row
  train = report.steps['train']
  row.update(
      fits=report.fits('train'), hbm_gib=(report.hbm_bytes or 0) / GiB,
      gib_per_chip=train.total_bytes / GiB if train.memory else None,
      param_gib=report.param_bytes / GiB, opt_state_gib=report.opt_state_bytes / GiB,
      xla_gflop=train.xla_flops / 1e9, model_gflop=report.model_flops / 1e9,
      collective_mib=train.collective_bytes / 2**20, compile_s=train.compile_seconds,
      lower_s=train.lower_seconds, out_of_memory=train.out_of_memory,
      implementation=report.model['implementation'], stack=report.model['stack'],
      mesh=report.mesh,
      steps={name: {'total_gib': s.total_bytes / GiB if s.memory else None,
                    'fits': report.fits(name), 'compile_s': s.compile_seconds,
                    'skipped': s.skipped, 'out_of_memory': s.out_of_memory}
             for name, s in report.steps.items()},
      collectives=train.collectives, wall_s=time.perf_counter() - start)
  return row


RECIPE_COLUMNS = ('recipe', 'topology', 'mesh', 'remat', 'fits', 'gib_per_chip', 'params_m',
                  'step_seconds', 'bound', 'mfu', 'steps_per_day', 'days', 'compile_s', 'error')


def layer_config(config):
  """The recipe `config` cut to its smallest stack that still holds each kind of layer: one
  layer, or one period of layers whose pattern follows the layer index (Traits.layer_period;
  layers that differ only by static per-layer settings, such as adaptive span's trimmed spans,
  hold the same program and memory as the first), on the same slice, mesh, batch and lengths.
  Its train step holds one layer's attention as the whole recipe's does, and compiles in a
  fraction of the time."""
  from models import stacks, transformer  # pylint: disable=import-outside-toplevel
  layered = config.copy_and_resolve_references()
  model = layered.model.copy_and_resolve_references()
  # A text source sets these at build; any value gives the layers' periods.
  model.vocab_size = model.vocab_size or 256
  model.max_len = model.max_len or layered.seq_len
  model = transformer.TransformerConfig.from_config(model)
  if model.n_layers <= 1:
    return layered
  period = max((p or 1) for p in stacks.layer_periods(model))
  layered.model.n_layers = min(period, model.n_layers)
  return layered


def layer_gib(config) -> tuple[int, float]:
  """(layers, GiB per chip) of the train step of layer_config(config) on its slice: the
  compiler's estimate, or what it said it needs where it refused the program."""
  layered = layer_config(config)
  devices = tpu_topology.topology_devices(layered.compile_topology,
                                          layered.compile_topology_num_slices)
  setup = assembly.build(layered, devices=devices, data=False)
  report, _ = aot.report_for(setup, ('train',), analyze=False)
  train = report.steps['train']
  if train.out_of_memory:
    amounts = program_stats.compiler_amounts(train.out_of_memory)
    if amounts is None:
      raise ValueError(train.out_of_memory)
    return layered.model.n_layers, amounts[0] / GiB
  return layered.model.n_layers, train.total_bytes / GiB


def bench_recipe(name: str, impl: str = 'auto') -> dict:
  """One row: the recipe's train, eval and decoding programs compiled for its own slice; with
  another `impl` than the recipe's, its train step alone with that attention_impl."""
  config = configs.load(name)
  row = {'recipe': name, 'topology': config.compile_topology,
         'fingerprint': configs.fingerprint(config), 'remat': config.model.remat}
  if impl != 'auto':
    config.model.attention_impl = impl
  start = time.perf_counter()
  try:
    report = aot.compile_config(config, aot.STEPS if impl == 'auto' else ('train',))
  except (ValueError, NotImplementedError) as e:
    row.update(error=str(e)[:300], wall_s=time.perf_counter() - start)
    return row
  train = report.steps['train']
  estimate = report.estimate() or {}
  row.update(
      fits=report.fits('train'), hbm_gib=(report.hbm_bytes or 0) / GiB,
      gib_per_chip=train.total_bytes / GiB if train.memory else None,
      params_m=report.model['params'] / 1e6, mesh=report.mesh, chips=report.chips,
      implementation=report.model['implementation'], stack=report.model['stack'],
      steps_per_day=estimate.get('steps_per_day'), days=estimate.get('days'),
      total_steps=estimate.get('total_steps'), bound=estimate.get('bound'),
      step_seconds=estimate.get('step_seconds'), mfu=estimate.get('mfu'),
      flops_utilization=estimate.get('flops_utilization'),
      peak_tflops_per_chip=(estimate.get('peak_flops_per_chip') or 0) / 1e12,
      compile_s=sum(s.compile_seconds for s in report.steps.values()),
      report=report.to_json())
  if impl == 'auto':
    row['layer_n_layers'], row['layer_gib_per_chip'] = layer_gib(config)
  row['wall_s'] = time.perf_counter() - start
  return row


def recipes_main(names: list[str], out: str, impl: str = 'auto') -> None:
  """--recipes: each paper recipe on its slice; rows merged into `out` by recipe name (a run
  of some recipes keeps the others' committed rows)."""
  unknown = sorted(set(names) - set(configs.PAPER_RECIPES))
  if unknown:
    raise SystemExit(f'unknown recipes {unknown}; known: {", ".join(configs.PAPER_RECIPES)}')
  rows = {}
  if os.path.exists(out):
    with open(out) as f:
      rows = {r['recipe']: r for r in json.load(f).get('rows', [])}
  for name in names:
    row = bench_recipe(name, impl)
    rows[name] = row
    print(f'{name} on {row["topology"]}: ' + (f'error: {row["error"]}' if 'error' in row else
          f'{row["gib_per_chip"] or 0:.2f} GiB per chip, ~{row["steps_per_day"] or 0:,.0f} '
          f'steps/day, compiled in {row["compile_s"]:.1f} s'), flush=True)
    ordered = [rows[n] for n in configs.PAPER_RECIPES if n in rows]
    common.write_json(out, {'note': compile_report.NOTE, 'rows': ordered})
  common.print_table([rows[n] for n in names], RECIPE_COLUMNS)
  if impl != 'auto':  # Not the recipes as they run: no header, no docs table.
    return
  for name in names:  # What each recompiled recipe's header must say.
    if not rows[name].get('error'):
      print(f'\nconfigs/{name}.py\'s header:\n' + configs.header_lines(rows[name]))
  done = [rows[n] for n in configs.PAPER_RECIPES if n in rows and not rows[n].get('error')]
  print('\ndocs/tpu.md\'s table:\n' + configs.recipes_markdown(done))


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--topologies', nargs='+', default=list(TOPOLOGIES),
                      help='TPU topologies (jax.experimental.topologies names)')
  parser.add_argument('--num-slices', type=int, default=1, help='slices of each topology')
  parser.add_argument('--variants', nargs='+', default=None,
                      help='attention variants (default: every registered one)')
  parser.add_argument('--d', type=int, default=12, help='size knob of configs/default.py')
  parser.add_argument('--seq-len', type=int, default=512)
  parser.add_argument('--batch', type=int, default=256, help='global batch (rows)')
  parser.add_argument('--dtype', default='bfloat16', help='compute dtype')
  parser.add_argument('--impl', default='auto', help='model.attention_impl')
  parser.add_argument('--stack', default='unrolled',
                      help="model.stack: 'unrolled' (every layer counted) or 'auto' (the "
                      "recipe's own program)")
  parser.add_argument('--mesh', nargs='*', default=[],
                      help='mesh axis sizes, e.g. fsdp=-1 data=1 (default: the recipe\'s, '
                      'all data-parallel)')
  parser.add_argument('--set', nargs='*', default=[],
                      help='other config overrides KEY=VALUE (dotted keys of configs/default.py)')
  parser.add_argument('--steps', nargs='+', default=['train'], choices=aot.STEPS,
                      help='programs to compile (the columns describe the train step)')
  parser.add_argument('--recipes', nargs='*', default=None,
                      help='compile these paper recipes on their own slices instead (no names: '
                      'all of configs.PAPER_RECIPES)')
  parser.add_argument('--out', default=None,
                      help='JSON path (default: results/tpu_compile.json, with --recipes '
                      'results/tpu_compile_recipes.json)')
  args = parser.parse_args()
  results = common.RESULTS
  if args.recipes is not None:
    name = 'tpu_compile_recipes' + ('' if args.impl == 'auto' else f'_{args.impl}') + '.json'
    recipes_main(args.recipes or list(configs.PAPER_RECIPES),
                 args.out or os.path.join(results, name), args.impl)
    return
  args.out = args.out or os.path.join(results, 'tpu_compile.json')
  variants = args.variants or attention.known()
  unknown = sorted(set(variants) - set(attention.known()))
  if unknown:
    parser.error(f'unknown variants {unknown}; known: {", ".join(attention.known())}')

  rows = []
  for topology in args.topologies:
    for variant in variants:
      row = bench(args, variant, topology)
      rows.append(row)
      print(f'{topology} {variant}: ' + (f'error: {row["error"]}' if 'error' in row else
            f'{row["gib_per_chip"] or 0:.2f} GiB per chip, compiled in {row["compile_s"]:.1f} s'),
            flush=True)
      _relative_flops(rows, topology)
      _write(args, rows)  # After each row: a run cut off keeps the rows it finished.
  common.print_table(rows, COLUMNS)


def _relative_flops(rows: list[dict], topology: str) -> None:
  """flops_vs_dense of the topology's rows, once its dense row is in."""
  dense = next((r for r in rows if r['topology'] == topology and r['variant'] == 'dense'
                and r.get('xla_gflop')), None)
  for r in rows:
    if r['topology'] == topology and dense and r.get('xla_gflop'):
      r['flops_vs_dense'] = r['xla_gflop'] / dense['xla_gflop']


def _write(args, rows: list[dict]) -> None:
  common.write_json(args.out, {
      'settings': {'d': args.d, 'seq_len': args.seq_len, 'batch': args.batch,
                   'dtype': args.dtype, 'impl': args.impl, 'stack': args.stack,
                   'mesh': args.mesh, 'set': args.set, 'num_slices': args.num_slices,
                   'steps': args.steps},
      'note': compile_report.NOTE, 'rows': rows})

if __name__ == '__main__':
  main()
