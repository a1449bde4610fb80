"""experiments/claims_survey.py: every row's criterion runs on the committed results and
returns a valid verdict, and doctored results move the verdicts the way the criteria say.

Reads only the committed JSON (results/); no training."""

import copy
import os

import pytest

from experiments import claims_survey, registry, render, rows
from experiments.report import VERDICTS

FOLDERS = [render.RESULTS]
ROWS = {row.measure.__name__: row for row in claims_survey.SECTION.rows}


def _committed(row):
  results = {name: render.load(FOLDERS, name) for name in row.sources}
  missing = [name for name, data in results.items() if data is None]
  if missing:
    pytest.skip(f'no committed {missing}')
  return copy.deepcopy(results)


def _verdict(name, edit=None):
  row = ROWS[name]
  results = _committed(row)
  if edit:
    edit(results)
  ours, verdict, why = row.measure(results)
  assert ours and why
  return verdict


@pytest.mark.parametrize('name', sorted(ROWS))
def test_every_row_gives_a_verdict_on_the_committed_results(name):
  assert _verdict(name) in VERDICTS


def test_each_row_names_a_doc_and_a_command_that_writes_its_files():
  for row in claims_survey.SECTION.rows:
    assert row.links and all(os.path.isfile(os.path.join(render.REPO, p)) for p in row.links)
    for source in row.sources:
      assert any(source in registry.get(e).writes for e in row.experiments), (row.claim, source)


def _txl_runs(results):
  return results['txl_experiment.json']['runs']


def test_txl_memory_verdict_follows_the_gain():
  def gain(factor):
    def edit(results):
      runs = _txl_runs(results)
      runs['txl']['evals']['eval_mem128']['bits_per_byte'] = (
          factor * runs['txl_mem0']['evals']['eval']['bits_per_byte'])
    return edit
  assert _verdict('txl_memory', gain(0.97)) == 'reproduces'
  assert _verdict('txl_memory', gain(0.995)) == 'direction holds'
  assert _verdict('txl_memory', gain(1.01)) == 'does not hold at this scale'


def test_eval_memory_needs_every_model_to_gain():
  def edit(factor_txl, factor_gtrxl):
    def apply(results):
      runs = _txl_runs(results)
      for name, f in (('txl', factor_txl), ('txl_gtrxl', factor_gtrxl)):
        evals = runs[name]['evals']
        evals['eval_mem512']['bits_per_byte'] = f * evals['eval_mem128']['bits_per_byte']
    return apply
  assert _verdict('txl_eval_memory', edit(0.95, 0.95)) == 'reproduces'
  assert _verdict('txl_eval_memory', edit(0.995, 0.999)) == 'direction holds'
  assert _verdict('txl_eval_memory', edit(0.95, 1.001)) == 'does not hold at this scale'


def test_gtrxl_stability_flips_when_the_gate_is_the_stable_one():
  def edit(results):
    runs = _txl_runs(results)
    for lr in results['txl_experiment.json']['settings']['high_lrs']:
      plain = runs[f'pre_ln_lr{lr:g}']['evals']['eval']['bits_per_byte']
      runs[f'gtrxl_lr{lr:g}']['evals']['eval']['bits_per_byte'] = plain * 0.9
  assert _verdict('gtrxl_high_lr') == 'does not hold at this scale'
  assert _verdict('gtrxl_high_lr', edit) == 'reproduces'

  def diverged(results):  # A diverged Pre-LN run counts as worse than any number.
    edit(results)
    runs = _txl_runs(results)
    lr = results['txl_experiment.json']['settings']['high_lrs'][-1]
    name = f'pre_ln_lr{lr:g}'
    runs[name] = rows.row(name, None, {'diverged': 'loss is nan at step 50'})
  assert _verdict('gtrxl_high_lr', diverged) == 'reproduces'


def _dup(results):
  return results['reformer_experiment.json']['dup']['runs']


def test_duplication_rows_follow_the_accuracies():
  def paper_like(results):  # Table 2's numbers in place of ours.
    runs = _dup(results)
    for trained, evals in claims_survey.PAPER_DUP.items():
      for tag, acc in evals.items():
        runs[trained]['evals'][tag]['accuracy'] = acc
  assert _verdict('dup_train_rounds') == 'does not hold at this scale'
  assert _verdict('dup_train_rounds', paper_like) == 'reproduces'
  assert _verdict('dup_lsh_under_full') == 'does not hold at this scale'
  assert _verdict('dup_lsh_under_full', paper_like) == 'reproduces'
  assert _verdict('dup_eval_rounds', paper_like) == 'reproduces'
  assert _verdict('dup_solved', paper_like) == 'reproduces'  # LSH-4 99.9% vs full 100%.

  def lsh4_fails(results):
    _dup(results)['lsh4']['evals']['lsh4']['accuracy'] = 0.3
  assert _verdict('dup_solved', lsh4_fails) == 'does not hold at this scale'

  def fewer_rounds_better(results):
    _dup(results)['full']['evals']['lsh4']['accuracy'] = 0.5
  assert _verdict('dup_eval_rounds', fewer_rounds_better) == 'does not hold at this scale'


def test_reversible_memory_fails_when_it_grows_like_pre_ln():
  def edit(results):
    rows = results['reversible_memory.json']['rows']
    pre = {(r['n_layers'], r['ff_chunk_len']): r['temp_MB'] for r in rows
           if r['residual'] == 'pre_ln'}
    for r in rows:
      if r['residual'] == 'reversible':
        r['temp_MB'] = pre[r['n_layers'], r['ff_chunk_len']]
  assert _verdict('reversible_memory') == 'reproduces'
  assert _verdict('reversible_memory', edit) == 'does not hold at this scale'


def test_lsh_scaling_fails_when_lsh_grows_quadratically():
  def edit(results):
    for r in results['lsh_scaling.json']['rows']:
      if r['attention'].startswith('lsh'):
        r['time_ms'] = 1e-4 * r['n'] ** 2
  assert _verdict('lsh_scaling') == 'reproduces'
  assert _verdict('lsh_scaling', edit) == 'does not hold at this scale'


def test_extrapolation_reproduces_when_a_ut_generalizes():
  def edit(results):
    data = results['universal_experiment.json']
    data['copy']['ut_act']['evals']['eval']['token_accuracy']['longer'] = 0.6
    data['parity']['ut_fixed']['evals']['eval']['accuracy']['longer'] = 0.9
  assert _verdict('ut_extrapolation') == 'does not hold at this scale'
  assert _verdict('ut_extrapolation', edit) == 'reproduces'


def test_extrapolation_reads_the_tasks_and_the_stack_it_has():
  """At the paper's size the UT part runs copy only, against an 8-layer stack, on 10 symbols
  and rows up to 10x longer: the row reads those from the results."""
  results = _committed(ROWS['ut_extrapolation'])
  data = results['universal_experiment.json']
  del data['parity']
  data['copy'] = {{'pre_ln_4': 'pre_ln_8'}.get(n, n): e for n, e in data['copy'].items()
                  if n != 'pre_ln_1'}
  data['settings'].update({'T': 8, 'extrapolate': 10, 'copy_symbols': 10})
  ours, verdict, why = ROWS['ut_extrapolation'].measure(results)
  assert ours.startswith('accuracy on rows longer than in training (up to 10x), copy: pre_ln_8 ')
  assert '(chance 0.100)' in ours and 'parity' not in ours and 'pre_ln_1' not in ours
  assert verdict == 'does not hold at this scale'
  assert why.startswith('no UT beats the 8-layer stack on copy (best UT minus pre_ln_8: copy')
  data['copy']['ut_act']['evals']['eval']['token_accuracy']['longer'] = 0.6
  assert ROWS['ut_extrapolation'].measure(results)[1] == 'reproduces'


def test_depth_row_is_testable_only_when_one_layer_falls_short():
  def edit(results):
    data = results['universal_experiment.json']
    for task, key in (('copy', 'token_accuracy'), ('parity', 'accuracy')):
      data[task]['pre_ln_1']['evals']['eval'][key]['train_lengths'] = 0.7
  assert _verdict('ut_depth') == 'not testable here'
  assert _verdict('ut_depth', edit) == 'reproduces'


def test_act_ponder_compares_with_the_run_without_it():
  def steps_without(n):
    def edit(results):
      for task in ('copy', 'parity'):
        runs = results['act_ponder.json'].get(task, {})
        if 'ut_act_tau0' in runs:
          runs['ut_act_tau0']['evals']['eval']['mean_steps'] = n
    return edit
  assert _verdict('act_ponder', steps_without(4.0)) == 'reproduces'
  assert _verdict('act_ponder', steps_without(1.0)) == 'does not hold at this scale'

  def other_steps(results):
    results['act_ponder.json']['settings']['steps'] += 1
  assert _verdict('act_ponder', other_steps) == 'not testable here'


def test_a_missing_run_is_reported_not_raised():
  def edit(results):
    del _txl_runs(results)['txl_mem0']
  assert _verdict('txl_memory', edit) == 'not testable here'
