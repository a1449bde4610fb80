"""experiments/universal_experiment.py and experiments/survey_act_ponder.py on the harness: the
runs as data build the configs the recorded overrides describe (as main.py built them), and
analyze() turns harness rows and in-process measurements into the JSON of the committed
results (no training: the rows are made from the committed entries). A few seconds."""

import copy
import json
import os

import pytest

from experiments import harness, rows as rows_lib, survey_act_ponder, universal_experiment as ue

RESULTS = os.path.join(os.path.dirname(__file__), '..', '..', 'results')


def _load(name):
  with open(os.path.join(RESULTS, name)) as f:
    return json.load(f)


def _shape(x):
  """The keys of a nested dict, recursively (lists and numbers are leaves)."""
  return {k: _shape(v) for k, v in x.items()} if isinstance(x, dict) else None


def _row(task, name, entry, already=False):
  """A harness row of a run with the committed entry's curve and time."""
  return rows_lib.row(name, None, {
      'task': task, 'variant': name, 'workdir': f'/runs/{task}/{name}',
      'already_trained': already, 'run_seconds': rows_lib.metric(entry, 'train_s', 'value'),
      'curves': {'train_loss': [tuple(p) for p in entry['curves']['train_loss']]}})


def _measured(entry):
  """measure()'s measurements of a run, from its committed row."""
  return {'eval': rows_lib.evaluation(entry, 'eval'),
          **{k: v for k, v in entry['curves'].items() if k != 'train_loss'}}


def test_runs_are_the_recorded_overrides_on_the_recipe():
  # At the committed step count the base's schedule is the recorded one: each run's config
  # is the recipe with exactly the overrides its JSON entry records (as main.py built it).
  steps = 2000
  for task in ue.TASKS:
    for run in ue.RUNS:
      recorded = {**ue.schedule(steps), **ue.TASKS[task], **run.overrides}
      want = harness.override(harness.load_recipe(ue.RECIPE), recorded)
      got = harness.variant_config(ue.base_config(task, steps), run.overrides)
      want.generate.eval_samples = got.generate.eval_samples  # No evaluation: never sampled.
      assert harness.flatten(got) == harness.flatten(want), (task, run.name)


def test_which_runs_halt_with_act():
  assert [r.name for r in ue.RUNS if ue.is_act(r.overrides)] == ['ut_act']
  assert all(ue.is_act(r.overrides) for r in survey_act_ponder.RUNS)


def test_analyze_gives_the_committed_structure():
  committed = _load('universal_experiment.json')
  rows, measured = [], {}
  for task in ue.TASKS:
    for name, entry in committed[task].items():
      rows.append(_row(task, name, entry))
      measured[task, name] = _measured(entry)
  out = ue.analyze(rows, measured, committed['settings'])
  assert list(out) == ['settings', *ue.TASKS]
  for task in ue.TASKS:
    for name, entry in committed[task].items():
      got = out[task][name]
      assert _shape(got) == {**_shape(entry), 'overrides': _shape(got['overrides'])}
      assert list(got) == list(entry)
      assert rows_lib.is_row(got) and got['evals'] == entry['evals']
      assert got['curves'] == entry['curves']
      for key in ('train_s', 'applications'):
        assert got['metrics'][key] == entry['metrics'][key], (task, name, key)
      assert got['metrics']['final_train_loss'] == pytest.approx(
          entry['metrics']['final_train_loss'])
      assert got['overrides'] == {
          **ue.schedule(2000), **ue.TASKS[task],
          **next(r.overrides for r in ue.RUNS if r.name == name)}


def test_analyze_merges_into_the_previous_results():
  committed = _load('universal_experiment.json')
  entry = copy.deepcopy(committed['copy']['ut_act'])
  rows = [_row('copy', 'ut_act', entry, already=True)]
  out = ue.analyze(rows, {('copy', 'ut_act'): _measured(entry)},
                   {**committed['settings'], 'code': 'now'}, previous=committed)
  assert 'machine' not in out and out['settings']['code'] == 'now'
  assert out['parity'] == committed['parity']  # Not rerun: kept.
  assert out['copy']['pre_ln_1'] == committed['copy']['pre_ln_1']
  # A run kept from an earlier call keeps its measured training time.
  assert (rows_lib.metric(out['copy']['ut_act'], 'train_s', 'value')
          == rows_lib.metric(committed['copy']['ut_act'], 'train_s', 'value'))


def test_act_ponder_analyze_gives_the_committed_structure():
  committed = _load('act_ponder.json')
  rows, measured = [], {}
  for task, runs in committed.items():
    if task in ('machine', 'settings'):
      continue
    for name, entry in runs.items():
      rows.append(_row(task, name, entry, already=True))
      measured[task, name] = {**_measured(entry), 'train_accuracy': []}
  out = survey_act_ponder.analyze(rows, measured, committed['settings'])
  assert list(out) == [k for k in committed if k != 'machine']
  got, entry = out['copy']['ut_act_tau0'], committed['copy']['ut_act_tau0']
  assert list(got) == list(entry)
  assert _shape(got) == {**_shape(entry), 'overrides': _shape(got['overrides'])}
  assert rows_lib.metric(got, 'tau', 'value') == 0.0
  assert rows_lib.metric(got, 'train_s', 'value') == rows_lib.metric(entry, 'train_s', 'value')
  assert got['overrides']['model.stack_options.ponder'] == 0.0


def test_the_papers_sizes_raise_the_position_table_and_name_the_stack():
  """experiments/paper_scale.py's sizes: copy of up to 40 symbols evaluated on up to 400 (the
  UT paper's), T = M = 8; the defaults stay the committed experiment's."""
  assert ue.DEFAULT.tasks() == ue.TASKS and ue.DEFAULT.runs() == ue.RUNS
  args = ue.parse_args([])
  assert args.sizes == ue.DEFAULT and [r.name for r in args.run_list] == [r.name for r in ue.RUNS]
  args = ue.parse_args(['--recipe', os.path.join(ue.REPO, 'configs',
                                                 'universal_transformer_algorithmic.py'),
                        '--T', '8', '--copy_train', '40', '--extrapolate', '10',
                        '--eval_rows', '4', '--tasks', 'copy', '--runs', 'ut_act,pre_ln_8'])
  sizes = args.sizes
  assert sizes.tasks()['copy'] == {'data.name': 'copy', 'data.max_length': 40,
                                   'model.max_len': 1024}
  assert [r.name for r in args.run_list] == ['ut_act', 'pre_ln_8']  # In --runs' order.
  assert dict(sizes.runs()[2].overrides)['model.stack_options.steps'] == 8
  batch, task = ue.eval_batch('copy', sizes, num_symbols=10)
  assert task.seq_len == 802 and batch['inputs'].shape == (4, 802)
  assert batch['inputs'].max() < task.vocab_size == 3 + 1 + 10
  settings = ue.settings_of(args)
  assert (settings['copy_train_max_length'], settings['extrapolate'], settings['T'],
          settings['copy_symbols'], settings['recipe']) == (
              40, 10, 8, 10, 'configs/universal_transformer_algorithmic.py')
  with pytest.raises(SystemExit, match='unknown'):
    ue.parse_args(['--runs', 'pre_ln_9'])
