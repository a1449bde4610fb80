"""Tests for input_pipeline.packing: document isolation in the model, coverage, cursors."""

import collections

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from input_pipeline import packing
from input_pipeline.synthetic import PAD
from models import transformer

KEYS = ('inputs', 'targets', 'weights', 'positions', 'segment_ids')


def _unique_docs(seed: int, count: int, max_len: int) -> list[np.ndarray]:
  """Documents whose tokens are all different, so every (input, target) pair is unique.

  Lengths run from 1 (a lone BOS: no pair) to max_len, with extra weight on short ones.
  """
  rs = np.random.RandomState(seed)
  lengths = [int(rs.choice([rs.randint(1, 4), rs.randint(1, max_len + 1)])) for _ in range(count)]
  tokens = rs.permutation(10 * sum(lengths))[:sum(lengths)] + 3
  return np.split(tokens.astype(np.int32), np.cumsum(lengths)[:-1])


def _run(docs, seq_len, mode, start=packing.Cursor(), min_piece=0):
  out = list(packing.rows(docs, seq_len, mode, start, min_piece=min_piece))
  return [r for r, _ in out], [c for _, c in out]


def _doc_pairs(docs) -> collections.Counter:
  return collections.Counter((int(a), int(b)) for d in docs for a, b in zip(d[:-1], d[1:]))


def _segments(row):
  """(start, length) of each segment of a packed row, in order."""
  seg = row['segment_ids']
  out = []
  for s in range(1, seg.max() + 1):
    where = np.flatnonzero(seg == s)
    out.append((int(where[0]), len(where)))
  return out


# ------------------------------------------------------------------------ model isolation

VOCAB, SEQ_LEN = 64, 32


def _model_docs() -> list[np.ndarray]:
  """Token documents with a few awkward lengths: a row-exact one and one over two rows."""
  rs = np.random.RandomState(3)
  lengths = [9, 5, 21, 2, 81, 4, 33, 12, 17, 3]  # 81 tokens = 80 pairs: pieces 32, 32, 16.
  return [rs.randint(3, VOCAB, n).astype(np.int32) for n in lengths]


@pytest.fixture(scope='module', params=['xla', 'blocksparse'])
def decoder(request):
  """(jitted apply, params) of a small dense-attention Decoder with float32 compute."""
  cfg = transformer.TransformerConfig.from_config({
      'vocab_size': VOCAB, 'd_model': 32, 'n_heads': 2, 'n_layers': 2, 'mlp_dim': 64,
      'max_len': SEQ_LEN, 'attention': 'dense', 'attention_impl': request.param,
      'attention_block_size': 8, 'dtype': 'float32'})
  model = transformer.Decoder(cfg)
  params = nn.meta.unbox(jax.jit(model.init)(
      jax.random.key(0), jnp.zeros((1, SEQ_LEN), jnp.int32))['params'])
  apply = jax.jit(lambda p, tokens, pos, seg: model.apply(
      {'params': p}, tokens, positions=pos, segment_ids=seg))
  return apply, params


def _pieces(docs, rows):
  """(row, start in row, doc, start in doc, pairs) of every segment, checked against docs.

  Segments must take the documents' pairs in stream order, each piece continuing where the
  previous piece of its document stopped.
  """
  out, i, s = [], 0, 0
  for r, row in enumerate(rows):
    for start, n in _segments(row):
      while len(docs[i]) - 1 - s <= 0:  # Documents without a pair left are skipped.
        i, s = i + 1, 0
      assert n <= len(docs[i]) - 1 - s
      np.testing.assert_array_equal(row['inputs'][start:start + n], docs[i][s:s + n])
      np.testing.assert_array_equal(row['targets'][start:start + n], docs[i][s + 1:s + n + 1])
      out.append((r, start, i, s, n))
      s += n
  assert s == len(docs[i]) - 1 and all(len(d) < 2 for d in docs[i + 1:])  # All consumed.
  return out


@pytest.mark.parametrize('min_piece', [0, 4])
def test_packed_logits_match_each_document_alone(decoder, min_piece):
  apply, params = decoder
  docs = _model_docs()
  rows, _ = _run(docs, SEQ_LEN, 'packed', min_piece=min_piece)
  pieces = _pieces(docs, rows)
  if min_piece == 0:  # Only the 80-pair document is cut: 32 + 32 + 16.
    assert [n for _, _, i, _, n in pieces if i == 4] == [32, 32, 16]
    assert len(pieces) == 12
  else:  # Documents are also cut to fill rows: every row but the last is (nearly) full.
    assert len(pieces) > 12
    assert all(row['weights'].sum() > SEQ_LEN - min_piece for row in rows[:-1])
  # Padding rows give both batches one shape: one compile.
  size = max(len(rows), len(pieces))
  batch = packing.stack(rows + [packing.padding_row(SEQ_LEN)] * (size - len(rows)))
  packed = np.asarray(apply(params, batch['inputs'], batch['positions'], batch['segment_ids']))

  alone = {k: np.zeros((size, SEQ_LEN), np.int32) for k in ('tokens', 'seg')}
  for j, (_, _, i, s, n) in enumerate(pieces):
    alone['tokens'][j, :n] = docs[i][s:s + n]
    alone['seg'][j, :n] = 1
  positions = np.tile(np.arange(SEQ_LEN, dtype=np.int32), (size, 1))
  reference = np.asarray(apply(params, alone['tokens'], positions, alone['seg']))
  for j, (r, start, i, s, n) in enumerate(pieces):
    np.testing.assert_allclose(packed[r, start:start + n], reference[j, :n],
                               atol=1e-5, rtol=1e-5, err_msg=f'row {r}, doc {i} from {s}')

  # The check has teeth: one segment for the whole row lets documents see each other.
  leaky = np.asarray(apply(params, batch['inputs'], batch['positions'],
                           (batch['segment_ids'] > 0).astype(np.int32)))
  shared = [(r, start) for r, start, _, _, _ in pieces if start > 0]
  assert shared
  assert max(np.abs(leaky[r, s] - packed[r, s]).max() for r, s in shared) > 1e-3


# ------------------------------------------------------------------------ row properties


PROPERTY_CASES = [(0, 8, 0), (1, 8, 0), (2, 5, 0), (3, 16, 0), (4, 1, 0), (0, 8, 1), (1, 8, 3),
                  (2, 5, 5), (3, 16, 6), (4, 1, 1), (5, 8, 9)]


@pytest.mark.parametrize('seed,seq_len,min_piece', PROPERTY_CASES)
def test_packed_rows_cover_every_pair_once(seed, seq_len, min_piece):
  docs = _unique_docs(seed, 120, 3 * seq_len + 2)
  rows, cursors = _run(docs, seq_len, 'packed', min_piece=min_piece)
  got = collections.Counter()
  for row, cursor in zip(rows, cursors):
    for k in KEYS:
      assert row[k].shape == (seq_len,), k
    seg, w = row['segment_ids'], row['weights']
    assert row['inputs'].dtype == row['targets'].dtype == np.int32
    assert w.dtype == np.float32
    # Weights are 1 exactly on segments and 0 exactly on padding, which is a suffix.
    np.testing.assert_array_equal(w, (seg > 0).astype(np.float32))
    fill = int((seg > 0).sum())
    assert fill > 0 and np.all(seg[fill:] == 0) and np.all(seg[:fill] > 0)
    assert np.all(row['inputs'][fill:] == PAD) and np.all(row['targets'][fill:] == PAD)
    assert np.all(row['positions'][fill:] == 0)
    # Segments are numbered 1, 2, ... in order and positions restart at 0 in each.
    assert np.all(np.diff(seg[:fill]) >= 0)
    segments = _segments(row)
    assert [int(seg[s]) for s, _ in segments] == list(range(1, len(segments) + 1))
    for start, n in segments:
      np.testing.assert_array_equal(row['positions'][start:start + n], np.arange(n))
    got.update((int(a), int(b)) for a, b, ww in zip(row['inputs'], row['targets'], w) if ww)
    assert cursor.doc <= len(docs)
  assert got == _doc_pairs(docs)
  assert max(got.values()) == 1
  _pieces(docs, rows)  # Stream order, pieces continue their documents.
  where = {}
  for r, row in enumerate(rows):
    for a in row['inputs'][row['weights'] > 0]:
      where[int(a)] = r
  if min_piece == 0 or min_piece > seq_len:
    # A document that fits in a row is never split across rows.
    for d in docs:
      if 2 <= len(d) <= seq_len + 1:
        assert len({where[int(t)] for t in d[:-1]}) == 1
  else:
    # A row is closed with padding only when fewer than min_piece tokens would fit.
    for row in rows[:-1]:
      assert row['weights'].sum() > seq_len - min_piece
  assert cursors[-1] == packing.Cursor(len(docs), 0)


@pytest.mark.parametrize('seed,seq_len', [(0, 8), (1, 8), (2, 5), (3, 16), (4, 1)])
def test_concat_rows_chunk_the_stream_with_overlap(seed, seq_len):
  docs = _unique_docs(seed, 120, 3 * seq_len + 2)
  stream = np.concatenate(docs)
  rows, _ = _run(docs, seq_len, 'concat')
  assert len(rows) == (len(stream) - 1) // seq_len
  for i, row in enumerate(rows):
    np.testing.assert_array_equal(row['inputs'], stream[i * seq_len:(i + 1) * seq_len])
    np.testing.assert_array_equal(row['targets'], stream[i * seq_len + 1:(i + 1) * seq_len + 1])
    np.testing.assert_array_equal(row['weights'], np.ones(seq_len, np.float32))
    np.testing.assert_array_equal(row['positions'], np.arange(seq_len))
    np.testing.assert_array_equal(row['segment_ids'], np.ones(seq_len))
    if i:  # Consecutive rows overlap by one token.
      assert rows[i - 1]['targets'][-1] == row['inputs'][0]
  # Every in-document pair appears once, except in the dropped partial tail.
  got = collections.Counter(
      (int(a), int(b)) for r in rows for a, b in zip(r['inputs'], r['targets']))
  assert max(got.values()) == 1
  tail = len(stream) - 1 - len(rows) * seq_len
  assert 0 <= tail < seq_len
  missing = _doc_pairs(docs) - got
  covered_until = len(rows) * seq_len
  assert all(int(np.flatnonzero(stream == a)[0]) >= covered_until for a, _ in missing)


def _first_token_at(docs, cursor, mode):
  """The token a row starting at `cursor` begins with."""
  need = 2 if mode == 'packed' else 1
  for j in range(cursor.doc, len(docs)):
    offset = cursor.offset if j == cursor.doc else 0
    if len(docs[j]) - offset >= need:
      return docs[j][offset]
  raise AssertionError(f'nothing left after {cursor}')


@pytest.mark.parametrize('mode,min_piece', [('packed', 0), ('packed', 3), ('concat', 0)])
@pytest.mark.parametrize('seed,seq_len', [(5, 8), (6, 3), (7, 12)])
def test_resume_from_any_cursor_continues_the_same_rows(mode, min_piece, seed, seq_len):
  docs = _unique_docs(seed, 80, 3 * seq_len + 2)
  rows, cursors = _run(docs, seq_len, mode, min_piece=min_piece)
  assert len(rows) > 20
  rs = np.random.RandomState(seed)
  picks = sorted(set(rs.choice(len(rows) - 1, 12, replace=False)) | {0, len(rows) - 2})
  for i in picks:
    c = cursors[i]
    assert 0 <= c.offset < len(docs[c.doc])
    # The cursor names the token that starts the next row (documents without a pair are
    # skipped in packed mode).
    assert rows[i + 1]['inputs'][0] == _first_token_at(docs, c, mode)
    resumed_rows, resumed_cursors = _run(docs[c.doc:], seq_len, mode, c, min_piece)
    assert len(resumed_rows) == len(rows) - i - 1
    assert resumed_cursors == cursors[i + 1:]
    for a, b in zip(resumed_rows, rows[i + 1:]):
      for k in KEYS:
        np.testing.assert_array_equal(a[k], b[k], err_msg=f'{k} after cursor {c}')
  # Starting from a cursor that is not at a row boundary is not the same stream (sanity).
  c = cursors[len(rows) // 2]
  shifted = next(packing.rows(docs[c.doc:], seq_len, mode, packing.Cursor(c.doc, c.offset + 1),
                              min_piece=min_piece))
  assert not np.array_equal(shifted[0]['inputs'], rows[len(rows) // 2 + 1]['inputs'])


def test_padding_row_and_stack():
  pad = packing.padding_row(6)
  assert set(pad) == set(KEYS)
  for k in KEYS:
    np.testing.assert_array_equal(pad[k], np.zeros(6))
  rows, _ = _run(_unique_docs(0, 10, 9), 6, 'packed')
  batch = packing.stack(rows[:3] + [pad])
  assert batch['inputs'].shape == (4, 6) and batch['weights'][3].sum() == 0
  np.testing.assert_array_equal(batch['targets'][1], rows[1]['targets'])


def test_rows_rejects_bad_arguments():
  with pytest.raises(ValueError, match=r"data\.packing must be one of .*got 'pack'"):
    next(packing.rows([np.arange(4)], 4, 'pack'))
  with pytest.raises(ValueError, match=r'seq_len must be >= 1, got 0'):
    next(packing.rows([np.arange(4)], 0, 'packed'))
  with pytest.raises(ValueError, match=r'data\.pack_min_piece must be >= 0, got -1'):
    next(packing.rows([np.arange(4)], 4, 'packed', min_piece=-1))
