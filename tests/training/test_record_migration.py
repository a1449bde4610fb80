"""Runs recorded before a config key was renamed still evaluate and resume (run_config.RENAMED):
the universal stack's settings were the top-level model.universal_* keys and are now its
options, model.stack_options.*; a stack or block option's change kind is read from its
declaration.

The evaluations and resumptions of the new and the old record build the same programs: the
module uses the session's persistent compilation cache (conftest `compile_cache`), so the
second of each pair loads them.
"""

import json
import shutil

import jax
import numpy as np
import pytest

from configs import default
from models import transformer
from tests.training.test_universal_recipe import _config as universal_recipe_config
from training import evaluation, run_config, settings, train

pytestmark = pytest.mark.usefixtures('compile_cache')

OLD_TO_NEW = {
    'model.universal_steps': 'model.stack_options.steps',
    'model.universal_act': 'model.stack_options.act',
    'model.universal_max_steps': 'model.stack_options.max_steps',
    'model.universal_ponder': 'model.stack_options.ponder',
}
# The residual wiring's keys lost the word "block" (attention's query/key blocks only).
BLOCK_TO_RESIDUAL = {'model.block': 'model.residual',
                     'model.block_options': 'model.residual_options'}


def _config(total_steps):
  """The universal recipe test's tiny ACT run on running parity, without dropout and with a
  checkpoint every 2 steps."""
  config = universal_recipe_config(total_steps)
  config.model.dropout_rate = 0.0
  config.checkpoint_every_steps = 2
  return config


def _write_old_record(workdir) -> None:
  """Rewrites WORKDIR/config.json as a run recorded before the rename wrote it."""
  path = workdir / 'config.json'
  record = json.loads(path.read_text())
  for name, value in record['model'].pop('stack_options').items():
    record['model'][f'universal_{name}'] = value
  path.write_text(json.dumps(record, indent=2))


def test_the_migration_table():
  assert run_config.RENAMED == {**OLD_TO_NEW, **BLOCK_TO_RESIDUAL}
  assert run_config.migrate({'model.universal_max_steps': 6, 'seed': 1}) == {
      'model.stack_options.max_steps': 6, 'seed': 1}
  # A new key present wins over its old name.
  assert run_config.migrate({'model.universal_steps': 2, 'model.stack_options.steps': 5}) == {
      'model.stack_options.steps': 5}


def test_the_residual_wiring_and_span_rounding_lost_the_word_block():
  """"block" now means only attention's query/key blocks: the residual wiring's keys, and
  adaptive span's rounding, are read under their new names from every old form."""
  assert run_config.migrate({'model.block': 'gtrxl', 'model.block_options.gate_bias': 1.0,
                             'model.attention_options.adaptive_span.block': 32}) == {
      'model.residual': 'gtrxl', 'model.residual_options.gate_bias': 1.0,
      'model.attention_options.adaptive_span.trim_multiple': 32}
  assert run_config.migrate({'model.attention_options.span_block': 16}) == {
      'model.attention_options.adaptive_span.trim_multiple': 16,
      'model.attention_options.dynamic_span.trim_multiple': 16}
  # Only a variant whose option was renamed has it renamed: selective never had 'block'.
  assert run_config.renamed_keys('model.attention_options.selective.block') == []
  record = {'model': {'block': 'reversible', 'block_options': {'gate_bias': 2.0},
                      'attention_options': {'adaptive_span': {'limit': 8, 'block': 4},
                                            'local': {'window': 3}}}}
  assert run_config._migrate_tree(record) == {'model': {
      'residual': 'reversible', 'residual_options': {'gate_bias': 2.0},
      'attention_options': {'adaptive_span': {'limit': 8, 'trim_multiple': 4},
                            'local': {'window': 3}}}}
  with pytest.raises(ValueError, match=r'config key model\.block was renamed model\.residual'):
    run_config.check_renamed(['model.block'])
  with pytest.raises(ValueError, match=r'unknown model setting\(s\) block \(block was renamed '
                                       r'residual\)'):
    transformer.TransformerConfig.from_config(dict(d=1, vocab_size=8, max_len=8, block='gtrxl'))


def test_stack_and_block_options_declare_their_change_kind():
  assert run_config.kind('model.stack_options.steps') == run_config.TRAINING
  assert run_config.kind('model.stack_options.max_steps') == run_config.TRAINING
  assert run_config.kind('model.stack_options.ponder') == run_config.TRAINING
  assert run_config.kind('model.stack_options.act') == run_config.MODEL  # The halting unit.
  # GTrXL's gate bias only sets an initializer.
  assert run_config.kind('model.residual_options.gate_bias') == run_config.TRAINING
  for group, registry in transformer.OPTION_GROUPS.items():
    if registry.per_entry:  # model.attention_options.<variant>: tests/training/test_run_config.py
      continue
    for name, option in registry.options().items():
      assert run_config.kind(f'model.{group}.{name}') == option.change, (group, name)
  # Nothing about them is listed by hand in training/.
  assert not [k for k in run_config.KINDS
              if k.startswith('model.universal_') or k.startswith('model.stack_options')
              or k.startswith('model.residual_options')]
  assert run_config.kind('model.stack_options.an_option_added_later') == run_config.MODEL


def test_history_lines_and_records_are_read_with_the_new_keys(tmp_path):
  record = default.get_config().to_dict()
  record['model'].pop('stack_options')
  record['model'].update(universal_steps=4, universal_act=True, universal_max_steps=3,
                         universal_ponder=0.05)
  (tmp_path / 'config.json').write_text(json.dumps(record))
  lines = [{'start': 'new', 'step': 0, 'recipe': 'r.py', 'overrides': None, 'changes': []},
           {'start': 'resume', 'step': 2, 'recipe': 'r.py',
            'overrides': {'model.universal_max_steps': 5},
            'changes': [{'key': 'model.universal_max_steps', 'recorded': 3, 'given': 5,
                         'kind': 'training'}]}]
  (tmp_path / 'config_history.jsonl').write_text(''.join(json.dumps(x) + '\n' for x in lines))
  flat, recipe = run_config.current_record(str(tmp_path))
  assert recipe == 'r.py'
  assert {k: flat[k] for k in OLD_TO_NEW.values()} == {
      'model.stack_options.steps': 4, 'model.stack_options.act': True,
      'model.stack_options.max_steps': 5, 'model.stack_options.ponder': 0.05}
  assert not [k for k in flat if k.startswith('model.universal_')]
  history = run_config.read_history(str(tmp_path))
  assert history[1]['overrides'] == {'model.stack_options.max_steps': 5}
  assert history[1]['changes'][0]['key'] == 'model.stack_options.max_steps'
  assert run_config.read_record(str(tmp_path))['model']['stack_options']['act'] is True


def test_an_old_key_given_now_is_refused_with_the_new_name(harness, tmp_path):
  config = _config(2)
  config.model.universal_steps = 3  # An unlocked config takes any field: refused, not ignored.
  with pytest.raises(ValueError, match=r'config key model.universal_steps was renamed '
                                       r'model.stack_options.steps'):
    settings.check(config)
  proc = harness.run_main(tmp_path / 'run', {'model.universal_steps': 3})
  assert proc.returncode == 1, proc.stderr[-3000:]
  errors = [line for line in proc.stderr.splitlines() if line.startswith('error: ')]
  assert errors == ['error: bad command line: --config.model.universal_steps was renamed '
                    '--config.model.stack_options.steps'], proc.stderr[-3000:]


def test_a_run_recorded_with_the_old_keys_evaluates_and_resumes_the_same(tmp_path):
  new, old = tmp_path / 'new', tmp_path / 'old'
  train.train_and_evaluate(_config(2), str(new))
  shutil.copytree(new, old)
  _write_old_record(old)
  assert 'universal_act' in json.loads((old / 'config.json').read_text())['model']

  # Eval from the record alone (the recipe given is the default dense model, nothing asked
  # for): the old record's ACT model, scored exactly as the new record's.
  nothing = run_config.Request(keys=frozenset())
  scores = [evaluation.evaluate_checkpoint(default.get_config(), str(w), nothing)
            for w in (new, old)]
  assert scores[0]['loss'] == scores[1]['loss'] and np.isfinite(scores[0]['loss'])
  # Every field asked for: the same values under the new keys are no change.
  given = evaluation.evaluate_checkpoint(_config(2), str(old))
  assert 'config_overrides' not in given and given['loss'] == scores[1]['loss']

  # Resume to step 4 from each record: the same parameters (tree and values).
  more = default.get_config()
  more.total_steps = 4
  total = run_config.Request(keys=frozenset({'total_steps'}))
  states = [train.train_and_evaluate(more, str(w), total) for w in (new, old)]
  assert int(states[0].step) == int(states[1].step) == 4
  assert 'halting' in states[1].params['universal']['step']
  assert jax.tree.structure(states[0].params) == jax.tree.structure(states[1].params)
  for a, b in zip(jax.tree.leaves(states[0].params), jax.tree.leaves(states[1].params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # config.json is never rewritten: the old record keeps its keys and is read as before.
  assert 'universal_act' in json.loads((old / 'config.json').read_text())['model']


# The attention options were one flat group; now each variant has its own (issue 49).
SPAN = {'limit': 16, 'ramp': 4, 'trim_multiple': 4, 'init': 0.25}


def _span_config(harness, total_steps: int):
  """The tiny recipe with adaptive span (options that lost their prefix), 2 steps a save."""
  return harness.config({
      'model.attention': 'adaptive_span', 'model.position_embedding': 'none',
      'total_steps': total_steps, 'checkpoint_every_steps': 2, 'model.attention_block_size': 8,
      **{f'model.attention_options.adaptive_span.{k}': v for k, v in SPAN.items()}})


def _write_flat_record(workdir) -> None:
  """Rewrites WORKDIR/config.json as a run recorded with one flat attention group wrote it:
  every variant's options in one namespace, the span and selective options with their prefix,
  the variant in use winning where two declare a name."""
  path = workdir / 'config.json'
  record = json.loads(path.read_text())
  old_name = {new: old for old, new in run_config.OPTION_RENAMED.items()}
  groups = record['model']['attention_options']
  in_use = record['model']['attention']
  flat = {}
  for variant in sorted(groups, key=lambda v: v == in_use):
    for name, value in groups[variant].items():
      flat[old_name.get(name, name)] = value
  record['model']['attention_options'] = flat
  path.write_text(json.dumps(record, indent=2))


def test_flat_attention_options_are_read_per_variant():
  assert run_config.migrate({'model.attention_options.window': 8, 'seed': 1}) == {
      'model.attention_options.local.window': 8,
      'model.attention_options.local_global.window': 8, 'seed': 1}
  assert run_config.migrate({'model.attention_options.span_limit': 64}) == {
      'model.attention_options.adaptive_span.limit': 64,
      'model.attention_options.dynamic_span.limit': 64}
  assert run_config.migrate({'model.attention_options.selective_relu': False}) == {
      'model.attention_options.selective.relu': False}
  # A key of the new groups is kept as it is; a new key present wins.
  assert run_config.migrate({'model.attention_options.local.window': 3}) == {
      'model.attention_options.local.window': 3}
  assert run_config.migrate({'model.attention_options.n_hashes': 2,
                             'model.attention_options.lsh.n_hashes': 4}) == {
                                 'model.attention_options.lsh.n_hashes': 4}
  # The variants in use name the one new key where they are known.
  assert run_config.renamed_keys('model.attention_options.window', ['local']) == [
      'model.attention_options.local.window']
  assert run_config.renamed_keys('model.attention_options.selective.selective_lmem_eps') == [
      'model.attention_options.selective.lmem_eps']
  assert run_config.renamed_keys('model.attention_options.local.window') == []
  # Every old flat name of an option that lost its prefix names a declared option.
  for old, new in run_config.OPTION_RENAMED.items():
    assert run_config.option_keys(old), old


def test_a_flat_attention_option_given_now_is_refused_with_its_new_key(harness, tmp_path):
  config = harness.config({'model.attention': 'local'})
  config.model.attention_options.window = 3  # An unlocked config takes any field.
  with pytest.raises(ValueError, match=r'^config key model\.attention_options\.window was '
                                       r'renamed model\.attention_options\.local\.window$'):
    settings.check(config)
  proc = harness.run_main(tmp_path / 'run', {'model.attention': 'adaptive_span',
                                             'model.attention_options.span_limit': 32})
  assert proc.returncode == 1, proc.stderr[-3000:]
  errors = [line for line in proc.stderr.splitlines() if line.startswith('error: ')]
  assert errors == ['error: bad command line: --config.model.attention_options.span_limit was '
                    'renamed --config.model.attention_options.adaptive_span.limit'], (
                        proc.stderr[-3000:])


def test_a_run_recorded_with_flat_attention_options_evaluates_and_resumes_the_same(
    harness, tmp_path):
  new, old = tmp_path / 'new', tmp_path / 'old'
  train.train_and_evaluate(_span_config(harness, 2), str(new))
  shutil.copytree(new, old)
  _write_flat_record(old)
  recorded = json.loads((old / 'config.json').read_text())['model']['attention_options']
  assert recorded['span_limit'] == 16 and 'adaptive_span' not in recorded

  # Eval from the record alone (the recipe given is the default dense model, nothing asked
  # for): the old record's span model, with its options, scored as the new record's.
  nothing = run_config.Request(keys=frozenset())
  scores = [evaluation.evaluate_checkpoint(default.get_config(), str(w), nothing)
            for w in (new, old)]
  assert scores[0]['loss'] == scores[1]['loss'] and np.isfinite(scores[0]['loss'])
  flat, _ = run_config.current_record(str(old))
  assert {k: flat[f'model.attention_options.adaptive_span.{k}'] for k in SPAN} == SPAN

  # Resume to step 4 from each record: the same parameters.
  more = default.get_config()
  more.total_steps = 4
  total = run_config.Request(keys=frozenset({'total_steps'}))
  states = [train.train_and_evaluate(more, str(w), total) for w in (new, old)]
  assert int(states[0].step) == int(states[1].step) == 4
  for a, b in zip(jax.tree.leaves(states[0].params), jax.tree.leaves(states[1].params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
