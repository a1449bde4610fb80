"""Tests for input_pipeline.synthetic (selective-attention synthetic tasks)."""

import ast
import math
import pathlib

import numpy as np
import pytest

from input_pipeline import synthetic

# Small configurations keep the brute-force checks fast.
SMALL_TASKS = [
    synthetic.VariableAssignment(num_variables=3, num_values=20, num_assignments=16),
    synthetic.Copy(num_symbols=7, max_length=6, min_length=1),
    synthetic.Parity(num_bits=9),
    synthetic.Duplication(num_symbols=5, dup_length=7),
]
DEFAULT_TASKS = [cls() for cls in synthetic.TASKS.values()]
ALL_TASKS = SMALL_TASKS + DEFAULT_TASKS
KEYS = ('inputs', 'targets', 'weights', 'positions', 'segment_ids')


def _ids(task):
  return repr(task)


def _tokens(batch):
  """Rebuilds the full token sequences from inputs and targets."""
  return np.concatenate([batch['inputs'][:, :1], batch['targets']], axis=1)


@pytest.mark.parametrize('task', ALL_TASKS, ids=_ids)
def test_deterministic_and_step_dependent(task):
  a = task.batch(seed=3, step=5, batch_size=8)
  b = task.batch(seed=3, step=5, batch_size=8)
  for key in KEYS:
    np.testing.assert_array_equal(a[key], b[key])
  other_step = task.batch(seed=3, step=6, batch_size=8)
  other_seed = task.batch(seed=4, step=5, batch_size=8)
  assert not np.array_equal(a['targets'], other_step['targets'])
  assert not np.array_equal(a['targets'], other_seed['targets'])


@pytest.mark.parametrize('task', ALL_TASKS, ids=_ids)
def test_shapes_dtypes_and_layout(task):
  batch = task.batch(seed=0, step=0, batch_size=6)
  assert set(batch) == set(KEYS)
  for key in KEYS:
    assert batch[key].shape == (6, task.seq_len), key
  for key in ('inputs', 'targets', 'positions', 'segment_ids'):
    assert batch[key].dtype == np.int32, key
  assert batch['weights'].dtype == np.float32
  assert set(np.unique(batch['weights'])) <= {0.0, 1.0}
  # Targets are the inputs shifted left by one.
  np.testing.assert_array_equal(batch['inputs'][:, 1:], batch['targets'][:, :-1])
  assert np.all(batch['inputs'][:, 0] == synthetic.BOS)
  np.testing.assert_array_equal(batch['positions'], np.tile(np.arange(task.seq_len), (6, 1)))
  np.testing.assert_array_equal(batch['segment_ids'], (batch['inputs']
                                                       != synthetic.PAD).astype(int))
  tokens = _tokens(batch)
  assert tokens.min() >= 0 and tokens.max() < task.vocab_size
  # Padding is never scored.
  assert np.all(batch['weights'][batch['targets'] == synthetic.PAD] == 0)


@pytest.mark.parametrize('task', ALL_TASKS, ids=_ids)
def test_process_slices_concatenate_to_global_batch(task):
  full = task.batch(seed=1, step=2, batch_size=12)
  parts = [
      task.batch(seed=1, step=2, batch_size=12, process_index=i, process_count=3) for i in range(3)
  ]
  for key in KEYS:
    assert parts[0][key].shape == (4, task.seq_len)
    np.testing.assert_array_equal(np.concatenate([p[key] for p in parts]), full[key])


def test_process_arguments_are_validated():
  task = synthetic.Parity()
  with pytest.raises(ValueError, match='divisible by process_count'):
    task.batch(0, 0, 10, process_index=0, process_count=3)
  with pytest.raises(ValueError, match='process_index'):
    task.batch(0, 0, 12, process_index=3, process_count=3)
  with pytest.raises(ValueError, match='seed'):
    task.batch(-1, 0, 4)
  with pytest.raises(ValueError, match='batch_size'):
    task.batch(0, 0, 0)


def test_variable_assignment_brute_force():
  task = synthetic.VariableAssignment(num_variables=3, num_values=50, num_assignments=10)
  batch = task.batch(seed=7, step=1, batch_size=64)
  tokens = _tokens(batch)
  assert tokens.shape[1] == 2 * task.num_assignments + 3
  np.testing.assert_array_equal(batch['weights'].sum(axis=1), 1.0)
  queried = set()
  for row in range(tokens.shape[0]):
    latest = {}
    for k in range(task.num_assignments):
      var_tok, val_tok = tokens[row, 1 + 2 * k], tokens[row, 2 + 2 * k]
      var = var_tok - task.assign_offset
      val = val_tok - task.value_offset
      assert 0 <= var < task.num_variables
      assert 0 <= val < task.num_values
      latest[var] = val_tok
    query = tokens[row, -2] - task.query_offset
    assert 0 <= query < task.num_variables
    assert query in latest, 'queried variable was never assigned'
    queried.add(query)
    (scored,) = np.nonzero(batch['weights'][row])
    assert scored.tolist() == [task.seq_len - 1]
    assert batch['targets'][row, scored[0]] == latest[query]
  assert queried == set(range(task.num_variables))


def test_variable_assignment_queries_only_assigned_variables():
  # With many variables and few assignments most variables are unassigned.
  task = synthetic.VariableAssignment(num_variables=50, num_values=5, num_assignments=2)
  batch = task.batch(seed=0, step=0, batch_size=256)
  tokens = _tokens(batch)
  assigned = tokens[:, [1, 3]] - task.assign_offset
  query = tokens[:, -2] - task.query_offset
  assert np.all((assigned == query[:, None]).any(axis=1))
  last = np.where(assigned[:, 1] == query, tokens[:, 4], tokens[:, 2])
  np.testing.assert_array_equal(tokens[:, -1], last)


def test_variable_assignment_defaults_match_paper():
  task = synthetic.VariableAssignment()
  assert (task.num_variables, task.num_values, task.num_assignments) == (3, 1000, 128)
  assert task.seq_len == 2 * 128 + 2
  assert task.vocab_size == synthetic.NUM_RESERVED + 2 * 3 + 1000
  assert task.chance_loss == pytest.approx(math.log(1000))


def test_copy_brute_force():
  task = synthetic.Copy(num_symbols=5, max_length=8, min_length=2)
  batch = task.batch(seed=2, step=3, batch_size=200)
  tokens = _tokens(batch)
  assert tokens.shape[1] == 3 + 2 * task.max_length
  lengths = set()
  for row in range(tokens.shape[0]):
    seq = tokens[row].tolist()
    assert seq[0] == synthetic.BOS
    length = seq.index(task.sep_id) - 1
    lengths.add(length)
    source = seq[1:1 + length]
    assert all(task.symbol_offset <= s < task.vocab_size for s in source)
    assert seq[length + 2:2 * length + 2] == source
    assert seq[2 * length + 2] == synthetic.EOS
    assert all(s == synthetic.PAD for s in seq[2 * length + 3:])
    weights = batch['weights'][row]
    assert weights.sum() == length + 1
    # Scored targets: the copied symbols and the EOS.
    scored = batch['targets'][row][weights == 1].tolist()
    assert scored == source + [synthetic.EOS]
    # The first scored prediction is made from the SEP token.
    assert batch['inputs'][row][np.argmax(weights)] == task.sep_id
  assert lengths == set(range(task.min_length, task.max_length + 1))


def test_copy_defaults_match_paper():
  task = synthetic.Copy()
  assert task.seq_len + 1 == 3 + 2 * 24
  assert task.chance_loss == pytest.approx(math.log(task.num_symbols))


def test_parity_brute_force():
  task = synthetic.Parity(num_bits=11)
  batch = task.batch(seed=5, step=0, batch_size=32)
  tokens = _tokens(batch)
  assert tokens.shape[1] == 2 * task.num_bits + 1
  assert task.vocab_size == synthetic.NUM_RESERVED + 2
  for row in range(tokens.shape[0]):
    parity = 0
    for k in range(task.num_bits):
      bit = tokens[row, 1 + 2 * k] - task.bit_offset
      assert bit in (0, 1)
      parity ^= bit
      assert tokens[row, 2 + 2 * k] - task.bit_offset == parity
  # Weights only on targets that are parity tokens (even token positions).
  expected = np.zeros(task.seq_len, np.float32)
  expected[1::2] = 1.0
  np.testing.assert_array_equal(batch['weights'], np.tile(expected, (32, 1)))
  assert task.chance_loss == pytest.approx(math.log(2))


def test_duplication_brute_force():
  """0 w 0 w (BOS first): the second copy repeats the first, and exactly its symbols are
  scored, each predictable from the token dup_length + 1 back."""
  task = synthetic.Duplication(num_symbols=6, dup_length=9)
  batch = task.batch(seed=3, step=2, batch_size=16)
  tokens = _tokens(batch)
  n = task.dup_length
  assert tokens.shape[1] == 2 * n + 3 and task.seq_len == 2 * n + 2
  assert task.vocab_size == synthetic.NUM_RESERVED + 1 + 6
  for row in tokens:
    assert row[0] == synthetic.BOS and row[1] == row[n + 2] == task.sep_id
    w = row[2:n + 2]
    assert ((w >= task.symbol_offset) & (w < task.vocab_size)).all()
    np.testing.assert_array_equal(row[n + 3:], w)
  assert len(np.unique(tokens[:, 2:n + 2])) == 6  # Every symbol drawn somewhere.
  scored = batch['weights'] > 0
  for row in range(16):
    idx = np.flatnonzero(scored[row])
    np.testing.assert_array_equal(idx, np.arange(n + 2, 2 * n + 2))
    # Target i is token i + 1 = token i - n (the same symbol in the first copy).
    np.testing.assert_array_equal(batch['targets'][row, idx], tokens[row, idx - n])
  assert synthetic.Duplication(dup_length=511).seq_len == 1024  # The paper's length.


def test_make_task():
  task = synthetic.make_task('copy', max_length=5)
  assert task == synthetic.Copy(max_length=5)
  assert isinstance(synthetic.make_task('parity'), synthetic.Parity)
  with pytest.raises(ValueError, match='variable_assignment'):
    synthetic.make_task('sorting')
  with pytest.raises(ValueError, match='num_bits'):
    synthetic.make_task('parity', num_bitz=3)


@pytest.mark.parametrize('name, kwargs, message', [
    ('variable_assignment', {
        'num_values': 0
    }, 'num_values'),
    ('variable_assignment', {
        'num_variables': 0
    }, 'num_variables'),
    ('variable_assignment', {
        'num_assignments': 0
    }, 'num_assignments'),
    ('variable_assignment', {
        'num_values': 2.5
    }, 'integer'),
    ('copy', {
        'min_length': 5,
        'max_length': 4
    }, 'min_length'),
    ('copy', {
        'num_symbols': 0
    }, 'num_symbols'),
    ('copy', {
        'min_length': 0
    }, 'min_length'),
    ('parity', {
        'num_bits': 0
    }, 'num_bits'),
    ('duplication', {
        'dup_length': 0
    }, 'dup_length'),
])
def test_invalid_hyper_parameters_raise(name, kwargs, message):
  with pytest.raises(ValueError, match=message):
    synthetic.make_task(name, **kwargs)
  with pytest.raises(ValueError, match=message):
    synthetic.TASKS[name](**kwargs)


def test_module_imports_only_numpy():
  tree = ast.parse(pathlib.Path(synthetic.__file__).read_text())
  imported = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      imported |= {a.name.split('.')[0] for a in node.names}
    elif isinstance(node, ast.ImportFrom):
      imported.add(node.module.split('.')[0])
  assert imported <= {'__future__', 'dataclasses', 'math', 'numbers', 'typing', 'numpy'}, imported
