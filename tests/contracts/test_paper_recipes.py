"""Every paper recipe (configs.PAPER_RECIPES) is set up for the TPU slice its header names.

* Each recipe's train step lowers for its own config.compile_topology with no data read (the
  first half of `python main.py --config=configs/<recipe>.py --mode=compile`; seconds each).
* The full compile, too slow for this suite (20-200 s a program here), is
  `python -m benchmarks.tpu_compile --recipes`, committed in
  results/tpu_compile_recipes.json. The committed row must be of the recipe as it
  is now (the config's fingerprint), must fit, and the header must quote its numbers: a
  recipe changed without recompiling it, or one that no longer fits, fails here.
* The committed row cannot see a change of the model code: `-m slow` compiles each recipe's
  train step as the code is now and checks that it fits (adaptive span's reshaped relative
  term once took its train step from 14.2 to 25.3 GiB per v5e chip of 16 with every committed
  row unchanged). Run it, and recompile the rows, after a change of an attention variant.

tests/input_pipeline/test_paper_recipes_tiny.py runs each recipe's tiny line on this CPU.
"""

import json

import pytest

import configs
from tests.harness import REPO
from training import aot, assembly, program_stats, tpu_topology

pytestmark = pytest.mark.system

RESULTS = REPO / 'results' / 'tpu_compile_recipes.json'
RECOMPILE = 'python -m benchmarks.tpu_compile --recipes {name}'


def _doc(name: str) -> str:
  return __import__(f'configs.{name}', fromlist=['get_config']).__doc__ or ''


def _rows() -> dict:
  with open(RESULTS) as f:
    return {r['recipe']: r for r in json.load(f)['rows']}


@pytest.mark.parametrize('name', configs.PAPER_RECIPES)
def test_the_train_step_lowers_for_the_recipes_slice(name):
  config = configs.load(name)
  assert config.compile_topology, f'{name} sets no config.compile_topology'
  devices = tpu_topology.topology_devices(config.compile_topology,
                                          config.compile_topology_num_slices)
  setup = assembly.build(config, devices=devices, data=False)
  lowered = aot.lower_train_step(setup)
  text = lowered.as_text()
  assert 'zoo_' not in text, 'a CPU kernel entered a TPU program'


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
  for step, report in row['report']['steps'].items():
    assert not report['out_of_memory'], (step, report['out_of_memory'])
    assert report['skipped'] or report['fits'] is not False, (step, report)


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
  assert tpu_topology.slice_name(config.compile_topology) in configs.header_lines(row)
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
