"""Validation batches of the text sources: fixed counts, whole split, padding, process slices."""

import collections

import numpy as np
import pytest

import input_pipeline
from input_pipeline import tokenizers
from input_pipeline.synthetic import PAD

EVAL_ROWS = 8


def _source(c4, spm_path, kit, tmp_path, extra=None, **kw):
  config = kit.config({'data.data_dir': c4.data_dir, 'data.vocab_path': spm_path,
                       'eval_batch_size': EVAL_ROWS, **(extra or {})})
  return config, input_pipeline.make_source(config, workdir=str(tmp_path), **kw)


@pytest.fixture(scope='module')
def expected(c4, spm_path, kit):
  """Token arrays of the validation documents."""
  tok = tokenizers.load_sentencepiece(spm_path, kit.spm_vocab)
  return tok.encode_batch(c4.validation)


def _pairs(batches) -> collections.Counter:
  return collections.Counter(
      (int(a), int(b)) for batch in batches
      for a, b, w in zip(batch['inputs'].ravel(), batch['targets'].ravel(),
                         batch['weights'].ravel()) if w)


def test_fixed_eval_steps_give_exactly_that_many_batches(c4, spm_path, kit, tmp_path):
  _, whole = _source(c4, spm_path, kit, tmp_path, {'eval_steps': 0})
  n_whole = len(list(whole.eval_batches()))
  assert n_whole >= 3
  for n in (1, 2):
    _, source = _source(c4, spm_path, kit, tmp_path, {'eval_steps': n})
    assert not source.eval_whole_split
    batches = list(source.eval_batches())
    assert len(batches) == n
    for b in batches:
      assert b['inputs'].shape == (EVAL_ROWS, 64)
      assert b['weights'].sum() > 0
    # The same first batches as the whole split, in file order, every time.
    for a, b in zip(batches, whole.eval_batches()):
      for k in a:
        np.testing.assert_array_equal(a[k], b[k])
  # More steps than the split holds: exactly that many batches still (every host runs the
  # same count); the ones past the end score nothing.
  _, source = _source(c4, spm_path, kit, tmp_path, {'eval_steps': n_whole + 3})
  batches = list(source.eval_batches())
  assert len(batches) == n_whole + 3
  for a, b in zip(batches, whole.eval_batches(), strict=False):
    for k in a:
      np.testing.assert_array_equal(a[k], b[k])
  for b in batches[n_whole:]:
    assert not b['weights'].any() and not b['segment_ids'].any()


def test_whole_split_scores_every_validation_pair_once(c4, spm_path, kit, tmp_path, expected):
  _, source = _source(c4, spm_path, kit, tmp_path, {'eval_steps': 0})
  assert source.eval_whole_split
  batches = list(source.eval_batches())
  weights = sum(float(b['weights'].sum()) for b in batches)
  assert weights == sum(len(t) - 1 for t in expected)
  assert _pairs(batches) == collections.Counter(
      (int(a), int(b)) for t in expected for a, b in zip(t[:-1], t[1:]))
  scored_bytes = sum(float((source.token_bytes[b['targets']] * b['weights']).sum())
                     for b in batches)
  assert scored_bytes == sum(len(d.encode('utf-8')) for d in c4.validation)
  # Packing mode only applies to training: eval rows are packed documents either way.
  _, concat = _source(c4, spm_path, kit, tmp_path, {'eval_steps': 0, 'data.packing': 'concat'})
  for a, b in zip(batches, concat.eval_batches(), strict=True):
    np.testing.assert_array_equal(a['inputs'], b['inputs'])


def test_last_eval_batch_is_padded_with_rows_that_score_nothing(c4, spm_path, kit, tmp_path):
  _, source = _source(c4, spm_path, kit, tmp_path, {'eval_steps': 0})
  batches = list(source.eval_batches())
  used = [int((b['weights'].sum(axis=1) > 0).sum()) for b in batches]
  assert used[:-1] == [EVAL_ROWS] * (len(batches) - 1)
  assert 0 < used[-1] < EVAL_ROWS  # The split does not fill the last batch.
  last = batches[-1]
  assert last['inputs'].shape == (EVAL_ROWS, 64)
  for k in ('inputs', 'targets', 'positions', 'segment_ids'):
    assert np.all(last[k][used[-1]:] == PAD), k
  assert np.all(last['weights'][used[-1]:] == 0)


def test_processes_split_the_validation_data(c4, spm_path, kit, tmp_path, expected):
  per_process = []
  for index in range(2):
    _, source = _source(c4, spm_path, kit, tmp_path, {'eval_steps': 0},
                        process_index=index, process_count=2)
    batches = list(source.eval_batches())
    assert all(b['inputs'].shape == (EVAL_ROWS // 2, 64) for b in batches)
    per_process.append(_pairs(batches))
    train_batch, _ = next(source.train_iter(0, None))
    assert train_batch['inputs'].shape == (2, 64)
    source.close()
  assert per_process[0] + per_process[1] == collections.Counter(
      (int(a), int(b)) for t in expected for a, b in zip(t[:-1], t[1:]))
