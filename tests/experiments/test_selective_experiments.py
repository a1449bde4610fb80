"""experiments/selective_experiments.py: every part's runs are valid harness runs, and its
analyze functions turn harness rows into the JSON that RESULTS.md is rendered from (the same
keys, at every level, as the committed results/selective_*.json); the docs page's
experiment is registered. No model trains here (seconds)."""

import json
import os

import pytest

from configs import local_text, tiny
from experiments import harness, registry, rows as rows_lib
from experiments import selective_experiments as SE

RESULTS = os.path.join(SE.REPO, 'results')


def _committed(part):
  with open(os.path.join(RESULTS, f'selective_{part}.json')) as f:
    return json.load(f)


def _keys(x, path=''):
  """The set of key paths of a JSON value (list items merged)."""
  out = set()
  if isinstance(x, dict):
    for k, v in x.items():
      out.add(f'{path}/{k}')
      out |= _keys(v, f'{path}/{k}')
  elif isinstance(x, list):
    for v in x:
      out |= _keys(v, f'{path}[]')
  return out


def _same_keys(payload, committed, skip=('machine', 'command', 'commands', 'part')):
  committed = {k: v for k, v in committed.items() if k not in skip}
  assert _keys(json.loads(json.dumps(payload))) == _keys(committed)


def _row(spec, seed, loss=2.0, step=4):
  """A harness row (experiments/rows.py's format) of run `spec`."""
  return rows_lib.row(spec, seed, {
      'variant': spec, 'step': step, 'eval_loss': loss, 'bits_per_byte': loss / 0.693,
      'params': 1000, 'tokens_per_sec': 512.0, 'run_seconds': 1.5,
      'workdir': f'/runs/seed{seed}/{harness.folder(spec)}',
      'curves': {'eval_loss': [[2, loss + 1], [step, loss]],
                 'eval_bits_per_byte': [[step, loss / 0.693]],
                 'train_loss': [[1, 3.0]], 'train_tokens_per_sec': [[1, 512.0]]}})


def test_every_run_is_a_valid_variant_of_its_base(tmp_path):
  text_base = harness.base_config(local_text.get_config(), steps=4,
                                  overrides={'data.files': str(tmp_path / 't.txt')})
  va_base = harness.base_config(tiny.get_config(), steps=4)
  for part, runs in SE.RUNS.items():
    if part == 'docs':
      for name, spec in runs['va'].items():
        harness.variant_config(va_base, spec)
      runs = runs['lm']
    base = va_base if part == 'va' else text_base
    for name, spec in runs.items():
      config = harness.variant_config(base, spec)
      assert config.model.attention in ('dense', 'selective', 'local'), (part, name)
  assert SE.RUNS['docs']['lm']['dense_1800']['total_steps'] == 1800


@pytest.mark.parametrize('part', ['lm', 'ablations'])
def test_analyze_lm_keeps_the_committed_structure(part):
  committed = _committed(part)
  runs = SE.lm_runs() if part == 'lm' else SE.ABLATIONS
  seeds = committed['settings']['seeds']
  rows = [_row(spec, seed) for seed in seeds for spec in runs.values()]
  payload = SE.analyze(part, rows, runs, committed['settings'])
  _same_keys(payload, committed)
  assert list(payload['variants']) == list(committed['variants'])
  assert rows_lib.metric(payload['variants']['dense'], 'steps_per_sec', 'seeds')[0] == (
      pytest.approx(512.0 / (8 * 256)))


def test_analyze_va_keeps_the_committed_structure():
  committed = _committed('va')
  rows = [_row(spec, seed) for seed in (0, 1, 2) for spec in SE.VA_VARIANTS.values()]
  test = {'step': 4, 'loss': 0.5, 'accuracy': 0.9, 'examples': 2048}
  measured = {(r['seed'], r['run']): {'test': test, 'ood': test,
                                          'accuracy_curve': [[2, 0.5], [4, 0.995]]}
              for r in rows}
  payload = SE.analyze('va', rows, measured, committed['settings'])
  _same_keys(payload, committed)
  assert rows_lib.metric(payload['variants']['selective'], 'first_step_99', 'seeds')[0] == 4


def test_analyze_synthetic_keeps_the_committed_structure():
  committed = _committed('synthetic')
  settings = committed['settings']
  rows = {task: [_row(spec, seed) for seed in settings['seeds']
                 for spec in SE.VA_VARIANTS.values()] for task in settings['tasks']}
  test = {'step': 4, 'loss': 0.01, 'accuracy': 0.995, 'examples': 100}
  measured = {task: {(r['seed'], r['run']): {'test': test,
                                                 'accuracy_curve': [[2, 0.5], [4, 0.995]]}
                     for r in task_rows} for task, task_rows in rows.items()}
  payload = SE.analyze('synthetic', rows, measured, settings)
  _same_keys(payload, committed)
  assert list(payload['tasks']) == ['copy', 'parity']
  assert rows_lib.metric(payload['tasks']['parity']['selective'], 'first_step_99',
                         'seeds')[0] == 4
  # The CLI's defaults are the committed settings (the registry adds the seeds).
  args = SE.parse_args(['--part', 'synthetic', '--seeds', '0,1', '--out', '/o/s.json'])
  assert SE.synthetic_settings(args) == settings
  copy = SE.synthetic_base(args, 'copy')
  assert (copy.model.d, copy.batch_size, copy.data.max_length, copy.data.num_symbols) == (
      2, 64, 24, 16)
  assert SE.synthetic_task('parity', args).seq_len == 2 * 32


def test_analyze_kv_keeps_the_committed_structure():
  committed = _committed('kv')
  contexts = committed['settings']['contexts']
  rows, measured = {}, {}
  for context in contexts:
    rows[context] = [_row(spec, seed) for seed in (0, 1) for spec in SE.KV_VARIANTS.values()]
    measured[context] = {}
    for seed in (0, 1):
      for name, spec in SE.KV_VARIANTS.items():
        row = committed['contexts'][str(context)][name]['rows'][seed]
        flat = {**row['metrics'], **{k: v for k, v in row.items()
                                     if k not in ('run', 'seed', 'metrics', 'curves')}}
        known = set(SE.lm_row(_row(spec, seed), 8, context)) | {'seed', 'val_loss'}
        measured[context][seed, spec] = {k: v for k, v in flat.items() if k not in known}
  payload = SE.analyze('kv', rows, measured, committed['settings'])
  _same_keys(payload, committed)


def test_analyze_docs_gives_the_pages_tables():
  va_rows = [_row(spec, 0) for spec in ('dense', 'selective')]
  lm_rows = [_row(name, 0) for name in ('dense', 'selective', 'selective_lmem', 'dense_1800')]
  pruned = {'target': 2.0, 'budgets': [8, 8], 'context': 256, 'reduction': 32.0,
            'pruned_loss': 2.01, 'unpruned_loss': 2.0, 'sample_unpruned_loss': 2.0,
            'sample_pruned_loss': 2.0, 'cuts': 60}
  measured = {'va_accuracy': {'dense': [[2, 0.3], [4, 0.38]], 'selective': [[2, 0.7], [4, 1.0]]},
              'pruning': {'selective': pruned, 'selective_lmem': pruned}}
  args = SE.parse_args(['--part', 'docs', '--text', __file__, '--out', '/o/docs.json'])
  settings = SE.docs_settings(args, SE.va_base(args, 600), SE.docs_lm_base(args))
  assert settings['lm']['eval_every_steps'] == 400 and settings['va']['eval_every_steps'] == 60
  payload = SE.analyze('docs', va_rows, lm_rows, measured, settings)
  assert set(payload) == {'settings', 'va', 'lm', 'pruning', 'table'}
  assert '| model | budgets K_l (of 256) |' in payload['table']
  assert '| selective | 0.70 | 1.00 (loss 2) |' in payload['table']
  assert '| dense_1800 (3.000 at 2) | 2.000 |' in payload['table']
  assert '| selective_lmem | [8, 8] | 32x | 2.010 (+0.01) | 2.000 |' in payload['table']


def test_the_synthetic_experiment_is_registered_and_its_quick_run_is_tiny():
  e = registry.get('selective_synthetic')
  assert e in registry.EXPERIMENTS and e.writes == ('selective_synthetic.json',)
  args = SE.parse_args(registry.argv(e, '/o', quick=True))
  assert args.part == 'synthetic' and args.seed_list == [0] and args.syn_steps == 4
  assert SE.synthetic_base(args, 'copy').model.d == 1


def test_the_docs_experiment_is_registered_and_writes_into_out():
  e = registry.get('selective_docs')
  assert e not in registry.EXPERIMENTS and e in registry.PAGES  # A page's runs, no row's.
  argv = registry.argv(e, '/o', '/t.txt', quick=True)
  assert all('{' not in a for a in argv) and '/o/selective_docs.json' in argv
  args = SE.parse_args([a if a != '/t.txt' else __file__ for a in argv])
  assert args.part == 'docs' and args.steps == 4  # --quick's settings win.
  full = SE.parse_args([a if a != '/t.txt' else __file__ for a in registry.argv(e, '/o', '/t.txt')])
  assert (full.va_steps, full.evals, full.steps, full.batch_size, full.eval_steps,
          full.prune_batches, full.d, full.seq_len) == (600, 6, 600, 16, 20, 1, 2, 256)
