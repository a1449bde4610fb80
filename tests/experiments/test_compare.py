"""benchmarks/compare.py: variant specs, and a short comparison end to end on generated text.

The end-to-end run trains two variants (dense, and the reformer preset with LSH options) for
2 steps each on a d=1 model over 24-byte rows of a 20 KB generated text in tmp_path, and
times their train steps round-robin, and checks the JSON (rows, columns, command) and the
PNG; about 20 s on an idle 2-core CPU.
"""

import json
import math

import numpy as np
import pytest

from benchmarks import compare
from configs import local_text, tiny


def _base():
  config = local_text.get_config()
  config.model.d = 1
  return config


def test_variant_config_adds_only_the_variant_and_what_it_needs():
  base = _base()
  assert compare.own_keys(base, compare.variant_config(base, 'dense')) == {}
  assert compare.own_keys(base, compare.variant_config(base, 'local:window=64')) == {
      'model.attention': 'local', 'model.attention_options.window': 64}
  # Relative positions and segment memory bring their own position and packing settings.
  assert compare.own_keys(base, compare.variant_config(base, 'txl')) == {
      'model.attention': 'txl', 'model.position_embedding': 'none', 'data.packing': 'stream'}
  assert compare.own_keys(base, compare.variant_config(base, 'txl:mem_len=0')) == {
      'model.attention': 'txl', 'model.position_embedding': 'none',
      'model.attention_options.mem_len': 0}
  gtrxl = compare.own_keys(base, compare.variant_config(base, 'gtrxl'))
  assert gtrxl['model.block'] == 'gtrxl' and gtrxl['data.packing'] == 'stream'
  assert compare.own_keys(base, compare.variant_config(base, 'reformer:n_hashes=2')) == {
      'model.attention': 'lsh', 'model.block': 'reversible',
      'model.attention_options.n_hashes': 2}
  # A stack option (model.stack_options) and a block option (model.block_options).
  universal = compare.variant_config(base, 'universal:act=true')
  assert (universal.model.stack, universal.model.stack_options.steps,
          universal.model.stack_options.act) == ('universal', 1, True)
  gated = compare.variant_config(base, 'dense:block=gtrxl:gate_bias=1')
  assert compare.own_keys(base, gated) == {'model.block': 'gtrxl',
                                           'model.block_options.gate_bias': 1.0}
  # A model field and a dotted key.
  assert compare.variant_config(base, 'dense:block=gtrxl').model.block == 'gtrxl'
  assert compare.variant_config(base, 'dense:data.packing=packed').data.packing == 'packed'


@pytest.mark.parametrize('spec, message', [
    ('nope', 'neither a registered attention variant'),
    ('local:windw=3', 'neither an attention option'),
    ('local:window', 'KEY=VALUE'),
    ('local:window=wide', 'expected a int'),
])
def test_bad_specs_are_refused(spec, message):
  with pytest.raises(ValueError, match=message):
    compare.variant_config(_base(), spec)


def test_groups_expand_and_named_variants_are_not_skippable():
  specs, grouped = compare.expand('dense,registered,presets,local:window=8')
  assert specs[0] == 'dense' and specs[-1] == 'local:window=8'
  assert set(compare.PRESETS) <= set(specs) and 'txl' in specs and specs.count('dense') == 1
  assert 'dense' not in grouped and 'local:window=8' not in grouped and 'txl' in grouped


def test_a_named_variant_that_cannot_run_on_the_data_is_an_error(tmp_path, monkeypatch):
  recipe = tmp_path / 'recipe.py'
  recipe.write_text('from configs import tiny\nget_config = tiny.get_config\n')
  assert tiny.get_config().data.name == 'variable_assignment'
  with pytest.raises(ValueError, match='stream'):
    compare.main(['--config', str(recipe), '--variants', 'txl', '--workdir', str(tmp_path)])


def _text(path, size=20_000):
  words = ['the', 'king', 'and', 'queen', 'of', 'a', 'castle', 'speak', 'thou', 'art', 'my',
           'lord', 'good', 'night', 'sweet', 'prince']
  rng = np.random.default_rng(0)
  out, n = [], 0
  while n < size:
    line = ' '.join(rng.choice(words, rng.integers(3, 10))) + '.\n'
    out.append(line)
    n += len(line)
  path.write_text(''.join(out))


def test_compare_two_variants_end_to_end(tmp_path):
  text = tmp_path / 'text.txt'
  _text(text)
  out, png = tmp_path / 'compare.json', tmp_path / 'curves.png'
  argv = ['--variants', 'dense,reformer:chunk_len=8:n_buckets=4', '--d', '1', '--steps', '2',
          '--evals', '2', '--time_rounds', '2', '--time_steps', '1',
          '--workdir', str(tmp_path / 'runs'), '--out', str(out), '--png', str(png),
          '--set', f'data.files={text}', '--set', 'seq_len=24', '--set', 'batch_size=4',
          '--set', 'eval_steps=1', '--set', 'data.chunk_bytes=2048',
          '--set', 'peak_tflops_per_device=1.0']
  compare.main(argv)

  result = json.loads(out.read_text())
  assert result['command'].startswith('python -m benchmarks.compare --variants')
  assert result['columns'] == list(compare.COLUMNS)
  assert {'platform', 'backend'} <= set(result['machine'])
  rows = {r['variant']: r for r in result['rows']}
  assert list(rows) == ['dense', 'reformer:chunk_len=8:n_buckets=4']
  for row in rows.values():
    assert set(compare.COLUMNS) <= set(row)
    assert row['step'] == 2
    for key in ('eval_loss', 'bits_per_byte', 'tokens_per_sec'):
      assert math.isfinite(row[key]) and row[key] > 0, (key, row[key])
    assert row['params'] > 0 and row['train_flops_per_token'] > 0 and row['attn_peak_bytes'] > 0
    assert [s for s, _ in row['curves']['eval_loss']] == [1, 2]
    assert row['eval_loss'] == row['curves']['eval_loss'][-1][1]
    assert len(row['timed_tokens_per_sec']['rounds']) == 2
    assert row['tokens_per_sec'] == row['timed_tokens_per_sec']['median']
  assert rows['dense']['decode_cache_bytes'] > 0 and rows['dense']['own_keys'] == {}
  reformer = rows['reformer:chunk_len=8:n_buckets=4']
  # LSH decodes (whole buckets): the unit keys and values of every position, as dense.
  assert reformer['decode_cache_bytes'] == rows['dense']['decode_cache_bytes']
  assert 'decode_refused' not in reformer
  assert reformer['own_keys']['model.block'] == 'reversible'
  assert '| reformer:chunk_len=8:n_buckets=4 |' in result['table']
  assert png.stat().st_size > 10_000
  # Real runs: each workdir holds its recorded config and the last checkpoint.
  for name in ('dense', 'reformer_chunk_len=8_n_buckets=4'):
    assert (tmp_path / 'runs' / name / 'config.json').exists()
    assert (tmp_path / 'runs' / name / 'checkpoints' / '2').is_dir()
