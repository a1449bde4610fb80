"""experiments/compare.py and the harness under it (experiments/harness.py): variant specs,
config overrides, and a short comparison end to end on generated text.

The end-to-end run trains two variants (dense, and the reformer preset with LSH options) for
2 steps each on a d=1 model over 24-byte rows of a 20 KB generated text in tmp_path, and
times their train steps round-robin, and checks the JSON (rows, columns, command) and the
PNG; about 20 s on an idle 2-core CPU.
"""

import json
import math

import pytest

from experiments import compare, harness, rows as rows_lib
from tests.experiments.test_harness import _text
from configs import local_text, presets, tiny


def _base():
  config = local_text.get_config()
  config.model.d = 1
  return config


def test_variant_config_adds_only_the_variant_and_what_it_needs():
  base = _base()
  assert harness.own_keys(base, harness.variant_config(base, 'dense')) == {}
  assert harness.own_keys(base, harness.variant_config(base, 'local:window=64')) == {
      'model.attention': 'local', 'model.attention_options.local.window': 64}
  # Relative positions and segment memory bring their own position and packing settings.
  assert harness.own_keys(base, harness.variant_config(base, 'txl')) == {
      'model.attention': 'txl', 'model.position_embedding': 'none', 'data.packing': 'stream'}
  assert harness.own_keys(base, harness.variant_config(base, 'txl:mem_len=0')) == {
      'model.attention': 'txl', 'model.position_embedding': 'none',
      'model.attention_options.txl.mem_len': 0}
  gtrxl = harness.own_keys(base, harness.variant_config(base, 'gtrxl'))
  assert gtrxl['model.residual'] == 'gtrxl' and gtrxl['data.packing'] == 'stream'
  assert harness.own_keys(base, harness.variant_config(base, 'reformer:n_hashes=2')) == {
      'model.attention': 'lsh', 'model.residual': 'reversible',
      'model.attention_options.lsh.n_hashes': 2}
  # A stack option (model.stack_options) and a residual option (model.residual_options).
  universal = harness.variant_config(base, 'universal:act=true')
  assert (universal.model.stack, universal.model.stack_options.steps,
          universal.model.stack_options.act) == ('universal', 1, True)
  gated = harness.variant_config(base, 'dense:residual=gtrxl:gate_bias=1')
  assert harness.own_keys(base, gated) == {'model.residual': 'gtrxl',
                                           'model.residual_options.gate_bias': 1.0}
  # A model field and a dotted key.
  assert harness.variant_config(base, 'dense:residual=gtrxl').model.residual == 'gtrxl'
  # A renamed model field names its new name ("block" is attention's query/key blocks only).
  with pytest.raises(ValueError, match=r'block was renamed residual \(model\.residual\)'):
    harness.variant_config(base, 'dense:block=gtrxl')
  assert harness.variant_config(base, 'dense:data.packing=packed').data.packing == 'packed'


@pytest.mark.parametrize('spec, message', [
    ('nope', 'neither a registered attention variant'),
    ('local:windw=3', 'neither an attention option of local'),
    ('adaptive_span:span_limit=64', r'span_limit was renamed limit \(model\.attention_options\.'
                                    r'adaptive_span\.limit\)'),
    ('local:window', 'KEY=VALUE'),
    ('local:window=wide', 'window=wide'),
    ('universal:act=maybe', 'act=maybe'),
])
def test_bad_specs_are_refused(spec, message):
  with pytest.raises(ValueError, match=message):
    harness.variant_config(_base(), spec)


def test_groups_expand_and_named_variants_are_not_skippable():
  specs, grouped = compare.expand('dense,registered,presets,local:window=8')
  assert specs[0] == 'dense' and specs[-1] == 'local:window=8'
  assert set(presets.PRESETS) <= set(specs) and 'txl' in specs and specs.count('dense') == 1
  assert 'dense' not in grouped and 'local:window=8' not in grouped and 'txl' in grouped


def test_a_named_variant_that_cannot_run_on_the_data_is_an_error(tmp_path, monkeypatch):
  recipe = tmp_path / 'recipe.py'
  recipe.write_text('from configs import tiny\nget_config = tiny.get_config\n')
  assert tiny.get_config().data.name == 'variable_assignment'
  with pytest.raises(ValueError, match='stream'):
    compare.main(['--config', str(recipe), '--variants', 'txl', '--workdir', str(tmp_path)])


def test_overrides_are_ml_collections_own():
  base = _base()
  # Strings are read as main.py reads --config.KEY=VALUE: by the field's type.
  config = harness.override(base, ['seq_len=64', 'model.dtype=bfloat16',
                                   'model.attention_options.local.window=8'])
  assert (config.seq_len, config.model.dtype,
          config.model.attention_options.local.window) == (64, 'bfloat16', 8)
  assert base.seq_len != 64  # A copy.
  # Typed values, as a script passes them.
  assert harness.override(base, {'learning_rate': 1e-3}).learning_rate == 1e-3
  for bad, match in [(['seq_len=long'], 'seq_len'), (['nope=1'], 'unknown config key'),
                     ({'nope': 1}, 'unknown config key'), ({'seq_len': 'long'}, 'seq_len'),
                     (['seq_len'], 'KEY=VALUE')]:
    with pytest.raises(ValueError, match=match):
      harness.override(base, bad)


def test_a_bad_config_override_on_the_command_line_is_refused(tmp_path):
  with pytest.raises(ValueError, match='seq_len'):
    compare.main(['--config.seq_len=long', '--workdir', str(tmp_path)])
  with pytest.raises(SystemExit):  # argparse: not an option of compare nor a config key.
    compare.main(['--set', 'seq_len=64', '--workdir', str(tmp_path)])


def test_compare_two_variants_end_to_end(tmp_path):
  text = tmp_path / 'text.txt'
  _text(text)
  out, png = tmp_path / 'compare.json', tmp_path / 'curves.png'
  argv = ['--variants', 'dense,reformer:chunk_len=8:n_buckets=4', '--d', '1', '--steps', '2',
          '--evals', '2', '--time_rounds', '2', '--time_steps', '1',
          '--workdir', str(tmp_path / 'runs'), '--out', str(out), '--png', str(png),
          f'--config.data.files={text}', '--config.seq_len=24', '--config.batch_size=4',
          '--config.eval_steps=1', '--config.data.chunk_bytes=2048',
          '--config.peak_tflops_per_device=1.0']
  compare.main(argv)

  result = json.loads(out.read_text())
  assert result['command'].startswith('python -m experiments.compare --variants')
  assert result['columns'] == list(compare.COLUMNS)
  assert {'platform', 'backend'} <= set(result['machine'])
  rows = {r['run']: r for r in result['rows']}
  assert list(rows) == ['dense', 'reformer:chunk_len=8:n_buckets=4']
  value = lambda row, key: rows_lib.metric(row, key, 'value')
  for row in rows.values():
    assert rows_lib.is_row(row)
    assert set(compare.COLUMNS) <= set(row['metrics']) | set(row)
    assert value(row, 'step') == 2
    for key in ('eval_loss', 'bits_per_byte', 'tokens_per_sec'):
      assert math.isfinite(value(row, key)) and value(row, key) > 0, (key, row)
    assert (value(row, 'params') > 0 and value(row, 'train_flops_per_token') > 0
            and value(row, 'attn_peak_bytes') > 0)
    assert [s for s, _ in row['curves']['eval_loss']] == [1, 2]
    assert value(row, 'eval_loss') == row['curves']['eval_loss'][-1][1]
    assert len(row['timed_tokens_per_sec']['rounds']) == 2
    assert value(row, 'tokens_per_sec') == row['timed_tokens_per_sec']['median']
  assert value(rows['dense'], 'decode_cache_bytes') > 0 and rows['dense']['own_keys'] == {}
  reformer = rows['reformer:chunk_len=8:n_buckets=4']
  # LSH decodes (whole buckets): the unit keys and values of every position, as dense.
  assert value(reformer, 'decode_cache_bytes') == value(rows['dense'], 'decode_cache_bytes')
  assert 'decode_refused' not in reformer
  assert reformer['own_keys']['model.residual'] == 'reversible'
  assert '| reformer:chunk_len=8:n_buckets=4 |' in result['table']
  assert png.stat().st_size > 10_000
  # Real runs: each workdir holds its recorded config and the last checkpoint.
  for name in ('dense', 'reformer_chunk_len=8_n_buckets=4'):
    assert (tmp_path / 'runs' / name / 'config.json').exists()
    assert (tmp_path / 'runs' / name / 'checkpoints' / '2').is_dir()
