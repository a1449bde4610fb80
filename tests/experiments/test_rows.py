"""experiments/rows.py: one row format, one aggregation over seeds (a diverged seed is counted,
never averaged), one accessor; and every committed results file of a training experiment is
written in that format (a file of another shape fails here).

No training: small dicts and the committed results/*.json."""

import json
import math
import os

import pytest

from experiments import migrations, registry, rows

RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), 'results')

# Where the runs of each committed results file of a training experiment are: a path of keys
# from the top ('*': every key there) to {run name: entry or row}, or to a list of rows.
LAYOUT = {
    'adaptive_span_lm.json': [('variants',)],
    'selective_va.json': [('variants',)],
    'selective_lm.json': [('variants',)],
    'selective_ablations.json': [('variants',)],
    'selective_synthetic.json': [('tasks', '*')],
    'selective_kv.json': [('contexts', '*')],
    'sparse_transformer.json': [('variants',), ('runs', '*')],
    'compare.json': [('rows',)],
    'txl_experiment.json': [('runs',)],
    'reformer_experiment.json': [('dup', 'runs'), ('bytes', 'runs')],
    'universal_experiment.json': [('copy',), ('parity',)],
    'act_ponder.json': [('copy',)],
}


def test_a_row_splits_metrics_curves_and_fields():
  r = rows.row('fixed', 1, {'seed': 1, 'variant': 'adaptive_span:learned=False', 'step': 300,
                            'bits_per_byte': 2.5, 'eval_loss': None, 'diverged': False,
                            'head_spans': [[1.0, 2.0]], 'curves': {'eval_loss': [[1, 3.0]]},
                            'eval_accuracy_curve': [[1, 0.5]], 'at_floor': True})
  assert r == {'run': 'fixed', 'seed': 1,
               'metrics': {'step': 300, 'bits_per_byte': 2.5, 'eval_loss': None},
               'curves': {'eval_loss': [[1, 3.0]], 'eval_accuracy': [[1, 0.5]]},
               'variant': 'adaptive_span:learned=False', 'head_spans': [[1.0, 2.0]],
               'at_floor': True}
  assert rows.is_row(r) and not rows.is_entry(r)
  assert rows.metric(r, 'bits_per_byte', 'value') == 2.5 == rows.metric(r, 'bits_per_byte')
  assert rows.field(r, 'head_spans') == [[1.0, 2.0]] and rows.field(r, 'step') == 300
  assert rows.field(r, 'budgets', None) is None
  with pytest.raises(KeyError):
    rows.metric(r, 'accuracy', 'value')
  with pytest.raises(ValueError):
    rows.metric(r, 'bits_per_byte', 'std')  # One seed has no spread.


def test_a_row_of_one_seed_reads_its_evaluations():
  r = rows.row('txl', None, {'overrides': {'model.residual': 'gtrxl'}, 'train_s': 12.0,
                             'evals': {'eval_mem128': {'bits_per_byte': 2.4, 'step': 600}},
                             'eval': {'token_accuracy': {'longer': 0.3}, 'halted_at': [1.0]},
                             'curves': {'train_loss': [[1, 5.0]]}})
  assert rows.is_row(r) and r['metrics'] == {'train_s': 12.0} and 'diverged' not in r
  assert list(r['evals']) == ['eval_mem128', 'eval']
  assert rows.metric(r, 'eval_mem128/bits_per_byte', 'value') == 2.4
  assert rows.metric(r, 'eval/token_accuracy/longer', 'value') == 0.3
  assert rows.evaluation(r, 'eval')['halted_at'] == [1.0]
  with pytest.raises(KeyError, match='eval_mem512'):
    rows.metric(r, 'eval_mem512/bits_per_byte', 'value')
  diverged = rows.row('pre_ln', None, {'diverged': 'loss is nan at step 50'})
  assert rows.diverged_seeds(diverged) == [None] and rows.diverged_seeds(r) == []


def test_add_puts_later_measurements_where_row_puts_them():
  r = rows.row('dense', 0, {'variant': 'dense', 'tokens_per_sec': 100.0,
                            'curves': {'train_loss': [[1, 5.0]]}})
  assert rows.add(r, {'tokens_per_sec': 120.0, 'logged_tokens_per_sec': 100.0,
                      'timed_tokens_per_sec': {'median': 120.0}, 'diverged': None,
                      'curves': {'grad_norm': [[1, 0.5]]},
                      'evals': {'full': {'accuracy': 0.9}}, 'seed': 7}) is r
  assert r == {'run': 'dense', 'seed': 0,
               'metrics': {'tokens_per_sec': 120.0, 'logged_tokens_per_sec': 100.0},
               'curves': {'train_loss': [[1, 5.0]], 'grad_norm': [[1, 0.5]]},
               'variant': 'dense', 'timed_tokens_per_sec': {'median': 120.0},
               'evals': {'full': {'accuracy': 0.9}}}
  rows.add(r, {'evals': {'lsh2': {'accuracy': 0.8}}, 'diverged': 'loss is nan'})
  assert list(r['evals']) == ['full', 'lsh2'] and rows.diverged_seeds(r) == [0]
  assert rows.is_row(rows.add(r, {})) and 'evals' in rows.add(r, {'evals': {}})


def test_an_entry_reads_mean_spread_and_each_seed():
  e = rows.over_seeds({0: {'dense': {'bits_per_byte': 3.0, 'steps_per_sec': 2.0}},
                       1: {'dense': {'bits_per_byte': 3.2, 'steps_per_sec': 4.0}}},
                      ('bits_per_byte',))['dense']
  assert rows.is_entry(e) and e['run'] == 'dense'
  assert rows.metric(e, 'bits_per_byte') == pytest.approx(3.1)
  assert rows.metric(e, 'bits_per_byte', 'std') == pytest.approx(math.sqrt(0.02))
  assert rows.metric(e, 'steps_per_sec', 'seeds') == [2.0, 4.0]  # Not aggregated: per seed.
  assert [r['seed'] for r in rows.seed_rows(e)] == [0, 1] and rows.diverged_seeds(e) == []
  with pytest.raises(KeyError):
    rows.metric(e, 'steps_per_sec')  # Not among the keys aggregated.
  with pytest.raises(ValueError):
    rows.metric(e, 'bits_per_byte', 'value')


def test_a_diverged_seed_is_counted_not_averaged():
  e = rows.over_seeds({0: {'v': {'bits_per_byte': 2.0}},
                       1: {'v': {'bits_per_byte': float('nan'), 'diverged': 'loss is nan'}},
                       2: {'v': {'bits_per_byte': 2.2}}}, ('bits_per_byte',))['v']
  assert rows.metric(e, 'bits_per_byte') == pytest.approx(2.1)
  assert rows.metric(e, 'bits_per_byte', 'std') == pytest.approx(math.sqrt(0.02))
  assert e['diverged_seeds'] == [1] == rows.diverged_seeds(e)
  every = rows.over_seeds({0: {'v': {'bits_per_byte': None, 'diverged': True}}},
                          ('bits_per_byte',))['v']
  assert rows.metric(every, 'bits_per_byte') is None and every['diverged_seeds'] == [0]


def test_the_migration_moves_the_numbers_and_keeps_them():
  old = {'variants': {'dense': {
      'seeds': [{'seed': 0, 'variant': 'dense', 'bits_per_byte': 3.0, 'diverged': False,
                 'curves': {'eval_loss': [[1, 2.0]]}},
                {'seed': 1, 'variant': 'dense', 'bits_per_byte': 3.4, 'diverged': False}],
      'bits_per_byte': 3.2, 'bits_per_byte_std': 0.28, 'diverged_seeds': []}},
         'runs': {'0': [{'variant': 'dense', 'bits_per_byte': 3.0, 'curves': {}}]}}
  new = migrations.one_row_format(old)
  e = new['variants']['dense']
  assert rows.is_entry(e) and e['run'] == 'dense'
  assert rows.metric(e, 'bits_per_byte') == 3.2 and rows.metric(e, 'bits_per_byte', 'std') == 0.28
  assert rows.metric(e, 'bits_per_byte', 'seeds') == [3.0, 3.4]
  assert e['rows'][0]['curves'] == {'eval_loss': [[1, 2.0]]}
  assert new['runs']['0'] == [rows.row('dense', 0, old['runs']['0'][0])]
  assert migrations.one_row_format(new) == new  # Migrated data stays as it is.
  # A run of one seed (txl_experiment.json's): its evaluations and curves in their places.
  old = {'runs': {'txl': {'overrides': {}, 'eval_mem128': {'bits_per_byte': 2.4, 'loss': 1.7},
                          'train_loss': [[1, 5.0]], 'grad_norm': []}}}
  new = migrations.one_row_format(old)
  assert new['runs']['txl'] == {
      'run': 'txl', 'seed': None, 'metrics': {}, 'curves': {'train_loss': [[1, 5.0]],
                                                            'grad_norm': []},
      'overrides': {}, 'evals': {'eval_mem128': {'bits_per_byte': 2.4, 'loss': 1.7}}}
  assert migrations.one_row_format(new) == new


def _at(data, path):
  """The {run: item} mappings (or lists of rows) at a LAYOUT path."""
  nodes = [data]
  for key in path:
    nodes = [v for n in nodes for v in (n.values() if key == '*' else [n[key]])]
  return nodes


def test_every_training_experiments_results_file_is_in_the_row_format():
  written = {name for e in registry.EXPERIMENTS + registry.PAGES
             if e.module.startswith('experiments.') for name in e.writes
             if os.path.isfile(os.path.join(RESULTS, name))}
  assert set(LAYOUT) == written
  for name, paths in LAYOUT.items():
    with open(os.path.join(RESULTS, name)) as f:
      data = json.load(f)
    found = 0
    for path in paths:
      for runs in _at(data, path):
        items = runs if isinstance(runs, list) else list(runs.values())
        assert items, (name, path)
        for item in items:
          assert rows.is_row(item) or rows.is_entry(item), (name, path, sorted(item))
          for r in rows.seed_rows(item):
            for key in r['metrics']:
              rows.metric(r, key, 'value')  # Readable through the accessor.
            if rows.is_entry(item):
              assert r['run'] == item['run']
          if rows.is_entry(item):
            for key in item['mean']:
              assert rows.metric(item, key) is None or math.isfinite(rows.metric(item, key))
              rows.metric(item, key, 'std')
          found += 1
    assert found, name
