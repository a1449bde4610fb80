"""The committed results hold today's names (experiments/migrations.py), and the migration
moves an old file's names as training/run_config.py reads an old record."""

import json

import pytest

from experiments import migrations

# A result file as the per-variant option groups found it: override keys of the one flat
# group, option names with their variant's prefix in specs and command lines.
OLD = {
    'command': 'python -m experiments.compare --variants dense,local:window=32,'
               'adaptive_span:span_limit=256,selective:selective_relu=False --d 2',
    'rows': [
        {'variant': 'local:window=32', 'workdir': 'runs/compare/adaptive_span_span_limit=256',
         'own_keys': {'model.attention': 'local', 'model.attention_options.window': 32}},
        {'variant': 'adaptive_span:span_limit=256',
         'own_keys': {'model.attention_options.span_limit': 256}},
        {'variant': 'fixed', 'own_keys': {'model.attention': 'fixed',
                                          'model.attention_options.stride': 32}},
    ],
    'runs': {'lsh1': {'overrides': {'model.attention_options.chunk_len': 64}}},
    'set': ['seq_len=256', 'model.attention_options.span_limit=256'],
    'loss': 1.25,
}
NEW = {
    'command': 'python -m experiments.compare --variants dense,local:window=32,'
               'adaptive_span:limit=256,selective:relu=False --d 2',
    'rows': [
        {'variant': 'local:window=32', 'workdir': 'runs/compare/adaptive_span_span_limit=256',
         'own_keys': {'model.attention': 'local', 'model.attention_options.local.window': 32}},
        {'variant': 'adaptive_span:limit=256',
         'own_keys': {'model.attention_options.adaptive_span.limit': 256}},
        {'variant': 'fixed', 'own_keys': {'model.attention': 'fixed',
                                          'model.attention_options.fixed.stride': 32}},
    ],
    # Without a variant recorded, every variant that declares the option.
    'runs': {'lsh1': {'overrides': {'model.attention_options.lsh.chunk_len': 64}}},
    'set': ['seq_len=256', 'model.attention_options.adaptive_span.limit=256',
            'model.attention_options.dynamic_span.limit=256'],
    'loss': 1.25,
}


def test_an_old_result_file_is_migrated_and_a_migrated_one_is_left_as_it_is():
  assert migrations.migrate(OLD) == NEW
  assert migrations.migrate(NEW) == NEW


def test_an_option_no_variant_of_the_row_declares_is_an_error():
  with pytest.raises(ValueError, match=r'/rows/0/own_keys/model.attention_options.stride: '
                                       r'model.attention_options.stride is no option of '
                                       r"\['local'\]"):
    migrations.migrate({'rows': [{'own_keys': {'model.attention': 'local',
                                               'model.attention_options.stride': 4}}]})


def test_the_committed_results_need_no_migration():
  stale = [path for path in migrations.files()
           if migrations.migrate(json.load(open(path))) != json.load(open(path))]
  assert not stale, f'run python -m experiments.migrations: {stale}'


def test_a_rewritten_file_keeps_its_layout(tmp_path):
  path = tmp_path / 'r.json'
  path.write_text(json.dumps(OLD, indent=1))
  assert migrations.main([str(path)]) == 0
  assert path.read_text() == json.dumps(NEW, indent=1)
  assert migrations.main(['--check', str(path)]) == 0
  path.write_text(json.dumps(OLD, indent=1))
  assert migrations.main(['--check', str(path)]) == 1
  assert json.loads(path.read_text()) == OLD  # --check writes nothing.


def test_the_names_block_lost_are_migrated_in_keys_specs_and_command_lines():
  old = {'command': 'python -m experiments.compare --variants dense:block=gtrxl,'
                    'adaptive_span:block=64 --set model.block=reversible',
         'rows': [{'own_keys': {'model.attention': 'txl', 'model.block': 'gtrxl',
                                'model.block_options.gate_bias': 1.0}},
                  {'own_keys': {'model.attention': 'adaptive_span',
                                'model.attention_options.adaptive_span.block': 32}},
                  {'block': 'reversible', 'n_layers': 2}, {'block': 128, 'heads': 4}]}
  new = {'command': 'python -m experiments.compare --variants dense:residual=gtrxl,'
                    'adaptive_span:trim_multiple=64 --set model.residual=reversible',
         'rows': [{'own_keys': {'model.attention': 'txl', 'model.residual': 'gtrxl',
                                'model.residual_options.gate_bias': 1.0}},
                  {'own_keys': {'model.attention': 'adaptive_span',
                                'model.attention_options.adaptive_span.trim_multiple': 32}},
                  # A benchmark's wiring field is renamed; an attention block length is not.
                  {'residual': 'reversible', 'n_layers': 2}, {'block': 128, 'heads': 4}]}
  assert migrations.migrate(old) == new
  assert migrations.migrate(new) == new


def test_a_compile_row_of_an_unchanged_recipe_gets_its_fingerprint_renewed():
  import configs  # pylint: disable=import-outside-toplevel
  recipe = 'adaptive_span_enwik8'
  config = configs.load(recipe)
  before = migrations.before_block_meanings_fingerprint(config)
  assert before != configs.fingerprint(config)
  rows = {'rows': [{'recipe': recipe, 'fingerprint': before},
                   {'recipe': recipe, 'fingerprint': 'changed-since'}]}
  assert [r['fingerprint'] for r in migrations.migrate(rows)['rows']] == [
      configs.fingerprint(config), 'changed-since']
