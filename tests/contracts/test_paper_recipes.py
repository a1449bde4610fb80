"""Every paper recipe (configs.PAPER_RECIPES) is set up for the TPU slice its header names.

* Each recipe's train step lowers for its own config.compile_topology with no data read (the
  first half of `python main.py --config=configs/<recipe>.py --mode=compile`; seconds each).
* The full compile, too slow for this suite (20-200 s a program here), is
  `python -m benchmarks.tpu_compile --recipes`, committed in
  results/tpu_compile_recipes.json. The committed row must be of the recipe as it
  is now (the config's fingerprint), must fit, and the header must quote its numbers: a
  recipe changed without recompiling it, or one that no longer fits, fails here.
* The committed row cannot see a change of the model code, so this suite compiles one layer
  of each recipe whose train step is near its chip's memory (LAYER_GUARDED;
  benchmarks/tpu_compile.py's layer_config: the recipe cut to one layer, or one period of
  layers, on its own slice, mesh, batch and lengths) and holds its GiB per chip against the
  committed row's `layer_gib_per_chip`, within LAYER_SLACK: adaptive span's relative term gathered by pairs
  took that layer from 7.6 to 34 GiB of temporaries, and the recipe's train step from 14.2 to
  45.5 GiB of a 16 GiB chip, with every committed row unchanged. `-m slow` compiles each
  recipe's whole train step as the code is now and checks that it fits. Recompile the rows
  after a change of an attention variant.

tests/input_pipeline/test_paper_recipes_tiny.py runs each recipe's tiny line on this CPU.
"""

import json
import re

import pytest

import configs
from tests.harness import REPO
from analysis import program_stats
from training import aot, assembly, tpu_topology

pytestmark = pytest.mark.system

RESULTS = REPO / 'results' / 'tpu_compile_recipes.json'
RECOMPILE = 'python -m benchmarks.tpu_compile --recipes {name}'
# Recipes that train another recipe's model on other data: {recipe: the recipe it repeats}.
SAME_MODEL = {'adaptive_span_text8': 'adaptive_span_enwik8'}


def _doc(name: str) -> str:
  return __import__(f'configs.{name}', fromlist=['get_config']).__doc__ or ''


def _rows() -> dict:
  with open(RESULTS) as f:
    return {r['recipe']: r for r in json.load(f)['rows']}


# The largest constant a recipe's train step may hold (splash's mask tables of the Sparse
# Transformer: 384 KiB).
MAX_CONSTANT_BYTES = 4 << 20


@pytest.mark.parametrize('name', [pytest.param(n, marks=pytest.mark.slow) if n in SAME_MODEL
                                  else n for n in configs.PAPER_RECIPES])
def test_the_train_step_lowers_for_the_recipes_slice(name):
  """A recipe with the same model as another (SAME_MODEL) lowers in the slow tier only."""
  config = configs.load(name)
  assert config.compile_topology, f'{name} sets no config.compile_topology'
  devices = tpu_topology.topology_devices(config.compile_topology,
                                          config.compile_topology_num_slices)
  setup = assembly.build(config, devices=devices, data=False)
  lowered = aot.lower_train_step(setup)
  text = lowered.as_text()
  assert 'zoo_' not in text, 'a CPU kernel entered a TPU program'
  # No array computed on the host is baked into the program at the batch's size (selective
  # attention's triangles were six of 136 MB; the largest now are splash's mask tables).
  largest = max((len(m.group(1)) // 2 for m in re.finditer(r'dense<"0x([0-9A-Fa-f]*)"', text)),
                default=0)
  assert largest <= MAX_CONSTANT_BYTES, f'a constant of {largest} bytes in the train step'


@pytest.mark.parametrize('name', configs.PAPER_RECIPES)
def test_the_committed_full_compile_is_of_this_recipe_and_fits(name):
  rows = _rows()
  assert name in rows, f'no committed compile of {name}: run {RECOMPILE.format(name=name)}'
  row, config = rows[name], configs.load(name)
  assert row['fingerprint'] == configs.fingerprint(config), (
      f'configs/{name}.py changed since its compile was committed: run '
      f'{RECOMPILE.format(name=name)} and update its header')
  assert not row.get('error'), row.get('error')
  assert row['topology'] == config.compile_topology
  assert row['fits'] is True, f'{name} does not fit {row["topology"]}: {row["gib_per_chip"]} GiB'
  assert row.get('layer_gib_per_chip'), f'no layer budget committed: run {RECOMPILE.format(name=name)}'
  for step, report in row['report']['steps'].items():
    assert not report['out_of_memory'], (step, report['out_of_memory'])
    assert report['skipped'] or report['fits'] is not False, (step, report)


# A layer may grow this much over its committed GiB per chip before the suite fails; a change
# that needs more recompiles the rows (the recipe's whole train step must still fit).
LAYER_SLACK = 0.05

# The recipes whose layer compile runs in this suite (80-90 s each on 2 cores): those whose
# train step is within THIN of its chip's HBM, where a regression the committed rows cannot
# see first breaks a run. None is today: adaptive span on enwik8 was, at 14.20 GiB of 16 on the
# blocked engine, and takes 3.94 on the fused Pallas kernel that `auto` runs on TPU. Every
# recipe has a third of its chip or more to spare and is compiled whole in the slow tier.
LAYER_GUARDED = ()
THIN = 0.8


def test_every_recipe_near_its_chips_memory_has_its_layer_guarded():
  for name, row in _rows().items():
    if row['gib_per_chip'] > THIN * row['hbm_gib']:
      assert SAME_MODEL.get(name, name) in LAYER_GUARDED, (
          f'{name} takes {row["gib_per_chip"]:.2f} of {row["hbm_gib"]:.0f} GiB per chip: add it '
          'to LAYER_GUARDED so that this suite holds its layer to its budget')


@pytest.mark.parametrize('name', LAYER_GUARDED)
def test_one_layer_fits_its_committed_budget(name):
  """About 90 s on 2 cores: the TPU compiler compiles the layer's forward and backward at the
  recipe's own lengths (S = 8192 keys a query block for adaptive span), the only way to see
  its memory; a smaller shape lays the program out differently."""
  from benchmarks import tpu_compile  # pylint: disable=import-outside-toplevel
  row = _rows()[name]
  layers, gib = tpu_compile.layer_gib(configs.load(name))
  assert layers == row['layer_n_layers'], (layers, row['layer_n_layers'])
  budget = row['layer_gib_per_chip']
  assert gib <= budget * (1 + LAYER_SLACK), (
      f'{layers} layer(s) of {name} now take {gib:.2f} GiB per chip of '
      f'{row["topology"]} where {budget:.2f} were committed: the recipe\'s train step '
      f'({row["gib_per_chip"]:.2f} GiB committed) may no longer fit. Find the change, or '
      f'recompile with {RECOMPILE.format(name=name)}')


@pytest.mark.slow
@pytest.mark.parametrize('name', configs.PAPER_RECIPES)
def test_the_train_step_as_the_code_is_now_fits_the_slice(name):
  config = configs.load(name)
  report = aot.compile_config(config, ('train',))
  train = report.steps['train']
  assert report.fits('train') is True, (
      f'{name}\'s train step does not fit {config.compile_topology} any more: '
      f'{train.out_of_memory or train.total_bytes / program_stats.GiB}')


@pytest.mark.parametrize('name', configs.PAPER_RECIPES)
def test_the_header_quotes_the_committed_numbers(name):
  """The docstring's 'slice:', 'memory:' and 'speed:' lines are the committed row's, as
  configs.header_lines writes them (the benchmark prints them after a recompile)."""
  doc, row, config = _doc(name), _rows()[name], configs.load(name)
  assert row['remat'] == config.model.remat
  assert configs.slice_name(config.compile_topology) in configs.header_lines(row)
  assert configs.header_lines(row) in doc, (
      f'configs/{name}.py\'s header differs from the committed compile; it should read:\n'
      + configs.header_lines(row))


def test_docs_tpu_md_has_the_committed_table():
  rows = _rows()
  table = configs.recipes_markdown([rows[n] for n in configs.PAPER_RECIPES])
  assert table in (REPO / 'docs' / 'tpu.md').read_text(), (
      'docs/tpu.md\'s recipe table differs from results/tpu_compile_recipes.json; '
      'paste the table `python -m benchmarks.tpu_compile --recipes` prints')


def test_the_fingerprint_sees_the_recipes_settings_and_not_run_time_variants():
  """A variant registered at run time (tests/models/test_adding_a_variant.py registers one in
  its process) adds its group to every config's options: it must not change the
  fingerprint."""
  config = configs.load('selective_c4')
  before = configs.fingerprint(config)
  config.model.attention_options['someones_own_variant'] = {'its_option': 3}
  assert configs.fingerprint(config) == before
  config.model.attention_options.selective.lmem_tau += 1
  assert configs.fingerprint(config) != before
  config = configs.load('selective_c4')
  config.batch_size = 128
  assert configs.fingerprint(config) != before


@pytest.mark.parametrize('name', configs.PAPER_RECIPES)
def test_the_data_a_recipe_reads_is_named_with_its_command(name):
  """RESULTS.md shows each recipe's run with its configs.PAPER_DATA flag: a recipe that reads a
  corpus (not a synthetic task) names the field it needs, a field the recipe leaves unset and
  its tiny line sets; without it the command could only fail (a run found 'data.files is
  empty')."""
  from input_pipeline import synthetic  # pylint: disable=import-outside-toplevel
  config = configs.load(name)
  flag = configs.PAPER_DATA.get(name)
  if config.data.name in synthetic.TASKS:
    assert flag is None, f'{name} generates its data; PAPER_DATA names {flag!r}'
    return
  assert flag, f'{name} reads {config.data.name} data: configs.PAPER_DATA must name it'
  key, _ = flag.removeprefix('--config.').split('=', 1)
  group, field = key.split('.')
  assert config[group][field] == '', f'{name} sets {key} already: {config[group][field]!r}'
  assert f'--config.{key}=' in _doc(name).split('Tiny, on a CPU')[1], name
