"""data.packing='stream': row r of consecutive batches continues one stream of whole documents.

The streams are rebuilt from the batches alone (segment ids, positions, inputs, targets) and
compared with the documents read independently in the seeded training order.
"""

import collections
import dataclasses
import json

import numpy as np
import pytest

import input_pipeline
from input_pipeline import packing, text, tokenizers
from input_pipeline.synthetic import PAD

KEYS = ('inputs', 'targets', 'weights', 'positions', 'segment_ids')
N_BATCHES = 8
SHUFFLE_BUFFER = 4


@pytest.fixture(scope='module')
def local_corpus(tmp_path_factory, kit):
  """A 1,500-byte file: 7 training chunks of 200 bytes, each longer than a row."""
  folder = tmp_path_factory.mktemp('stream_corpus')
  kit.write_corpus(folder, {'small.txt': 1500}, seed=11)
  return str(folder / 'small.txt'), str(tmp_path_factory.mktemp('stream_tfds'))


def _config(kind, c4, spm_path, local_corpus, kit, extra=None):
  extra = {'data.packing': 'stream', 'data.shuffle_buffer': SHUFFLE_BUFFER, **(extra or {})}
  if kind == 'c4':
    # 12 training documents, so 8 batches read the split several times.
    return kit.config({**extra, 'data.data_dir': c4.data_dir, 'data.vocab_path': spm_path,
                       'data.train_split': 'train[:12]'})
  return kit.local_text_config(*local_corpus, {**extra, 'data.chunk_bytes': 200})


def _reference(config, spm_path, count):
  """The first `count` training documents in the seeded order, tokenized independently."""
  data = config.data
  builder = text.make_builder(data)
  tok = (tokenizers.ByteTokenizer() if data.tokenizer == 'byte'
         else tokenizers.load_sentencepiece(spm_path, data.vocab_size))
  docs = text.documents(builder, data.train_split, text_key=data.text_key, seed=config.seed,
                        shuffle=True, repeat=True, shuffle_buffer=data.shuffle_buffer)
  return tok.encode_batch([d for _, d in zip(range(count), docs)])


def _take(source, n, step=0, state=None):
  it = source.train_iter(step, state)
  return [next(it) for _ in range(n)]


def _same(a, b) -> bool:
  return all(np.array_equal(a[k], b[k]) for k in KEYS)


@dataclasses.dataclass
class _Doc:
  segment: int
  first_seen: tuple[int, int, int]  # (batch, row, cell of the window) where its BOS appeared.
  tokens: list[int]


def _rebuild(batches) -> list[list[_Doc]]:
  """Per row, its documents in order, rebuilt from consecutive batches (checking continuity)."""
  n_rows, seq_len = batches[0]['inputs'].shape
  streams = []
  for r in range(n_rows):
    docs: list[_Doc] = []
    for k, b in enumerate(batches):
      inputs, targets, weights, positions, segments = (b[key][r] for key in KEYS)
      assert np.all(weights == 1) and np.all(segments > 0), (k, r)  # No padding in training.
      # Within a row and across batches, each target is the next input.
      np.testing.assert_array_equal(targets[:-1], inputs[1:])
      if k:
        assert inputs[0] == batches[k - 1]['targets'][r, -1], f'row {r} breaks at batch {k}'
      for c in range(seq_len):
        if positions[c] == 0:  # A new document; its BOS was the last target before if c == 0.
          seen = (k - 1, r, seq_len) if c == 0 and k else (k, r, c)
          assert not docs or segments[c] != docs[-1].segment, 'neighbours share a segment id'
          docs.append(_Doc(int(segments[c]), seen, []))
        else:  # The same document goes on: same id, next position.
          assert docs, f'row {r} starts inside a document'
          assert segments[c] == docs[-1].segment and positions[c] == len(docs[-1].tokens)
        docs[-1].tokens.append(int(inputs[c]))
    streams.append(docs)
  return streams


@pytest.mark.parametrize('kind', ['c4', 'local_text'])
def test_rows_continue_streams_of_documents_dealt_in_order(kind, c4, spm_path, local_corpus,
                                                           kit, tmp_path):
  config = _config(kind, c4, spm_path, local_corpus, kit)
  source = input_pipeline.make_source(config, workdir=str(tmp_path))
  try:
    run = _take(source, N_BATCHES)
  finally:
    source.close()
  batches = [b for b, _ in run]
  streams = _rebuild(batches)
  assert len(streams) == config.batch_size
  everything = sorted((d for docs in streams for d in docs), key=lambda d: d.first_seen)
  reference = _reference(config, spm_path, len(everything) + 1)
  # Segment id = 1 + global index: every document is dealt exactly once, in reading order.
  assert [d.segment - 1 for d in everything] == list(range(len(everything)))
  assert len(everything) > (12 if kind == 'c4' else 7)  # The split repeated.
  for r, docs in enumerate(streams):
    # Closed documents are whole; the open one (last) is a prefix.
    for d in docs[:-1]:
      np.testing.assert_array_equal(d.tokens, reference[d.segment - 1], f'row {r}')
    last = docs[-1]
    np.testing.assert_array_equal(last.tokens, reference[last.segment - 1][:len(last.tokens)])
  # A document spans batches with one segment id (checked in _rebuild): some do, with
  # positions past seq_len for the longer ones.
  assert any(len(d.tokens) > config.seq_len for docs in streams for d in docs)
  assert max(int(b['positions'].max()) for b in batches) >= config.seq_len
  # The state names the next unread document and each row's open document and offset.
  state = packing.StreamState.from_json(run[-1][1])
  unseen = 0  # Documents whose BOS is only the last target so far.
  for docs, (doc, offset, segment) in zip(streams, state.streams):
    if offset:
      assert (doc + 1, offset) == (docs[-1].segment, len(docs[-1].tokens))
    else:
      assert doc >= len(everything) and segment == doc + 1
      unseen += 1
  assert state.next == len(everything) + unseen


@pytest.mark.parametrize('kind', ['c4', 'local_text'])
def test_resume_from_saved_states_repeats_the_batches(kind, c4, spm_path, local_corpus, kit,
                                                      tmp_path):
  config = _config(kind, c4, spm_path, local_corpus, kit)
  source = input_pipeline.make_source(config, workdir=str(tmp_path))
  try:
    run = _take(source, 2 * N_BATCHES)
    batches, states = [b for b, _ in run], [s for _, s in run]
    assert all(_same(a, b) for a, (b, _) in zip(batches, _take(source, 2 * N_BATCHES)))
    parsed = [packing.StreamState.from_json(s) for s in states]
    # Resumes that skip documents (dealt and consumed after the oldest open one): one is tried.
    skipping = [k + 1 for k, p in enumerate(parsed) if p.first < p.next - len(p.streams)]
    assert skipping and skipping[0] < len(batches)
    for k in (1, 2, 4, 6, skipping[0]):
      saved = json.loads(json.dumps(states[k - 1]))  # As stored in a checkpoint.
      assert len(json.dumps(saved)) <= packing.STATE_BYTES
      for i, (batch, state) in enumerate(_take(source, min(N_BATCHES, len(batches) - k), k,
                                               saved)):
        assert _same(batch, batches[k + i]), f'batch {k + i} after resuming at {k}'
        assert state == states[k + i]
      restarted, _ = _take(source, 1, k, None)[0]
      assert not _same(restarted, batches[k])
  finally:
    source.close()


def test_packed_and_stream_states_are_not_interchangeable(c4, spm_path, local_corpus, kit,
                                                          tmp_path):
  config = _config('c4', c4, spm_path, local_corpus, kit)
  source = input_pipeline.make_source(config, workdir=str(tmp_path))
  packed = input_pipeline.make_source(_config('c4', c4, spm_path, local_corpus, kit,
                                              {'data.packing': 'packed'}),
                                      workdir=str(tmp_path))
  try:
    stream_state = _take(source, 1)[0][1]
    packed_state = _take(packed, 1)[0][1]
    with pytest.raises(ValueError, match=r"not a data\.packing='stream' state"):
      next(source.train_iter(1, packed_state))
    with pytest.raises(ValueError, match=r"not a data\.packing='packed' state"):
      next(packed.train_iter(1, stream_state))
    # A state saved with another number of rows per process.
    fewer = {**stream_state, 'streams': stream_state['streams'][:-1]}
    with pytest.raises(ValueError, match='same batch_size and process count'):
      next(source.train_iter(1, fewer))
  finally:
    source.close()
    packed.close()


def test_segment_ids_wrap_in_positive_int32_and_differ_from_the_previous():
  top = packing.MAX_SEGMENT_ID
  assert top == 2**31 - 1
  assert packing.segment_id(0) == 1
  assert packing.segment_id(top - 1) == top
  assert packing.segment_id(top) == 1  # Wrapped, never 0.
  for doc in (0, 5, top - 1, top, 3 * top + 7):
    same = packing.segment_id(doc)
    other = packing.segment_id(doc, previous=same)
    assert other != same and 1 <= other <= top


def _stream_docs(lengths):
  return [np.arange(1000 * i, 1000 * i + n, dtype=np.int32) for i, n in enumerate(lengths)]


def test_resume_with_the_documents_a_state_needs_and_compact_states():
  # Packing alone: documents of varied lengths, resumed from every state.
  lengths = [5, 3, 40, 7, 2, 9, 20, 4, 61, 11, 3, 8, 15, 2, 5] * 8
  docs = _stream_docs(lengths)
  rows, seq_len = 3, 8
  run = [x for _, x in zip(range(30), packing.stream_batches(docs, seq_len, rows))]
  skipped = 0
  for k, (_, state) in enumerate(run[:-1]):
    # The reader starts at the oldest open document and skips the dealt, closed ones.
    needed = [d for i, d in enumerate(docs) if i >= state.first and state.needs(i)]
    skipped += state.next - state.first - rows
    resumed = packing.stream_batches(needed, seq_len, rows,
                                     packing.StreamState.from_json(state.to_json()))
    for (batch, after), (batch2, after2) in zip(run[k + 1:], resumed):
      assert _same(batch, batch2) and after == after2
  assert skipped > 0
  # Many rows: the state is encoded compactly, and refused when it cannot fit.
  many = packing.StreamState(10**9, tuple((10**9 - 3 - i % 50, 7 * i, packing.segment_id(
      10**9 - 3 - i % 50)) for i in range(120)) + ((10**9 - 1, 5, 77),))
  encoded = many.to_json()
  assert isinstance(encoded['streams'], str)
  assert len(json.dumps(encoded)) <= packing.STATE_BYTES
  assert packing.StreamState.from_json(json.loads(json.dumps(encoded))) == many
  small = packing.StreamState(9, ((7, 3, 8), (8, 0, 5)))
  assert small.to_json() == {'next': 9, 'streams': [[2, 3], [1, 0, 5]]}
  assert packing.StreamState.from_json(small.to_json()) == small
  huge = packing.StreamState(10**9, tuple((i, 10**6 + i, 1 + i) for i in range(400)))
  with pytest.raises(ValueError, match='fewer rows per process'):
    huge.to_json()
  assert packing.StreamState.from_json(huge.to_json(limit=None)) == huge


def test_finite_streams_end_padded():
  docs = _stream_docs([5, 30, 3, 4])
  batches = [b for b, _ in packing.stream_batches(docs, 8, 3, score_boundaries=False)]
  # Row 0: documents 0 and 1 (4 + 29 scored pairs); row 1: 2 and 3 (2 + 3); row 2: none.
  weights = np.array([b['weights'].sum(axis=1) for b in batches])
  np.testing.assert_array_equal(weights, [[7, 5, 0], [8, 0, 0], [8, 0, 0], [8, 0, 0], [2, 0, 0]])
  first = batches[0]
  np.testing.assert_array_equal(first['inputs'][0], [0, 1, 2, 3, 4, 1000, 1001, 1002])
  np.testing.assert_array_equal(first['weights'][0], [1, 1, 1, 1, 0, 1, 1, 1])  # (EOS, BOS): 0.
  np.testing.assert_array_equal(first['segment_ids'][0], [1, 1, 1, 1, 1, 2, 2, 2])
  np.testing.assert_array_equal(first['inputs'][1], [2000, 2001, 2002, 3000, 3001, 3002, PAD, PAD])
  np.testing.assert_array_equal(first['segment_ids'][1], [3, 3, 3, 4, 4, 4, 0, 0])
  np.testing.assert_array_equal(first['positions'][1], [0, 1, 2, 0, 1, 2, 0, 0])
  np.testing.assert_array_equal(batches[-1]['positions'][0, :2], [27, 28])
  for b in batches:
    pad = b['segment_ids'] == 0
    assert np.all(b['inputs'][pad] == PAD) and np.all(b['targets'][pad] == PAD)
    assert not b['weights'][pad].any() and not b['positions'][pad].any()
  # Training weights every pair.
  trained = next(packing.stream_batches(docs, 8, 3))[0]
  np.testing.assert_array_equal(trained['weights'][0], np.ones(8))


EVAL_ROWS = 4


def _eval_source(c4, spm_path, kit, tmp_path, extra=None):
  config = kit.config({'data.data_dir': c4.data_dir, 'data.vocab_path': spm_path,
                       'data.packing': 'stream', 'eval_batch_size': EVAL_ROWS, **(extra or {})})
  return input_pipeline.make_source(config, workdir=str(tmp_path))


def test_eval_covers_the_split_once_in_stream_layout(c4, spm_path, kit, tmp_path):
  # The validation documents in file order, read and tokenized independently.
  config = kit.config({'data.data_dir': c4.data_dir})
  tok = tokenizers.load_sentencepiece(spm_path, kit.spm_vocab)
  expected = tok.encode_batch(list(text.documents(text.make_builder(config.data), 'validation')))
  assert len(expected) == len(c4.validation)
  source = _eval_source(c4, spm_path, kit, tmp_path, {'eval_steps': 0})
  batches = list(source.eval_batches())
  assert len(batches) >= 2
  assert all(b['inputs'].shape == (EVAL_ROWS, 64) for b in batches)
  # Stream layout: every row's scored cells continue across batches, documents in file order.
  dealt = []
  for r in range(EVAL_ROWS):
    cells = [(int(b['segment_ids'][r, c]), int(b['positions'][r, c]), int(b['inputs'][r, c]),
              int(b['targets'][r, c]), float(b['weights'][r, c]))
             for b in batches for c in range(64)]
    real = [c for c in cells if c[0]]
    assert all(not c[0] for c in cells[len(real):])  # A stream ends once: padding after.
    assert all(c[2] == PAD and c[4] == 0 for c in cells[len(real):])
    for a, b in zip(real, real[1:]):
      assert a[3] == b[2]  # Continuous stream.
    ids = list(dict.fromkeys(c[0] for c in real))
    for sid in ids:
      doc = [c for c in real if c[0] == sid]
      want = expected[sid - 1]
      assert [c[1] for c in doc] == list(range(len(doc)))
      # Whole documents; the (EOS, next BOS) pair is there but not scored.
      assert len(doc) in (len(want) - 1, len(want))
      np.testing.assert_array_equal([c[2] for c in doc], want[:len(doc)])
      assert len(doc) == len(want) or doc[-1][3] == want[-1]
      assert [c[4] for c in doc] == [1.0] * (len(want) - 1) + [0.0] * (len(doc) - len(want) + 1)
    dealt.append(ids)
  assert sorted(i for ids in dealt for i in ids) == list(range(1, len(expected) + 1))
  assert all(ids == sorted(ids) for ids in dealt)
  assert sum(bool(ids) for ids in dealt) == EVAL_ROWS
  # The last batch still holds text; the scored pairs are exactly those of 'packed' eval.
  assert batches[-1]['weights'].sum() > 0
  pairs = collections.Counter((int(a), int(b)) for x in batches for a, b, w in zip(
      x['inputs'].ravel(), x['targets'].ravel(), x['weights'].ravel()) if w)
  assert pairs == collections.Counter(
      (int(a), int(b)) for t in expected for a, b in zip(t[:-1], t[1:]))
  # Fixed counts: a prefix of the same batches, then padding batches.
  for n in (1, len(batches) + 2):
    fixed = list(_eval_source(c4, spm_path, kit, tmp_path, {'eval_steps': n}).eval_batches())
    assert len(fixed) == n
    for a, b in zip(fixed, batches):
      assert _same(a, b)
    for b in fixed[len(batches):]:
      assert not b['weights'].any() and not b['segment_ids'].any()
      assert np.all(b['inputs'] == PAD)


def test_too_many_rows_per_process_for_the_gathered_state(c4, spm_path, kit, tmp_path):
  config = kit.config({'data.data_dir': c4.data_dir, 'data.vocab_path': spm_path,
                       'data.packing': 'stream', 'batch_size': 2 * 400})
  with pytest.raises(ValueError, match=r"data\.packing='stream'.*fewer rows per process"):
    input_pipeline.make_source(config, workdir=str(tmp_path), process_count=2)
  # One process gathers nothing: any number of rows works.
  input_pipeline.make_source(config, workdir=str(tmp_path)).close()


def test_stream_with_a_synthetic_task_is_refused(kit):
  for task in ('parity', 'copy'):
    config = kit.config({'data.name': task, 'data.packing': 'stream', 'eval_steps': 1})
    with pytest.raises(ValueError, match=r"data\.packing='stream' needs a text source"):
      input_pipeline.make_source(config)
  config = kit.config({'data.name': 'parity', 'data.packing': 'streams', 'eval_steps': 1})
  with pytest.raises(ValueError, match=r"data\.packing must be one of .*'stream'.*'streams'"):
    input_pipeline.make_source(config)
