"""Fixed-length training rows from a stream of tokenized documents.

Three modes:

* 'packed': several documents per row, each its own segment (segment_ids 1, 2, ...) with
  positions restarting at 0, so attention never crosses documents and the loss skips padding
  (weights 0, segment id 0). A document that does not fit in the room left in a row is cut to
  fill it when at least `min_piece` tokens fit (the rest opens the next row as a new segment),
  else the row is closed with padding; with min_piece = 0 documents are only cut when they are
  longer than a row. Without cuts, C4-like ~2 KB documents at seq_len 512 leave a third of
  every batch as padding.
* 'concat': the documents are concatenated and the stream is chunked into rows of seq_len + 1
  tokens overlapping by one (GPT style): one segment per row, no padding.
* 'stream' (`stream_batches`): row r of every batch is its own concat-style stream, so row r of
  batch k + 1 continues exactly where row r of batch k stopped (its first input is the last
  target of row r in batch k): the layout for segment-level recurrence (a Transformer-XL
  cache of the previous batch's hidden states). Whenever a stream needs a document it takes
  the next one from the single, ordered document sequence; rows are filled in a fixed order,
  so the dealing is deterministic. Each document keeps one segment id in every batch it spans
  (`segment_id`), positions count tokens within the document (they may exceed seq_len), and
  the pair (EOS, next BOS) belongs to the earlier document, as in 'concat'.

A document of tokens t_0 .. t_m (t_0 = BOS, t_m = EOS) gives the (input, target) pairs
(t_k, t_{k+1}). The position in the stream between rows is a `Cursor` (document index, first
token of the next row in that document), which is all the state needed to resume exactly:
documents are re-read from `doc` and tokenized again, deterministically. In 'stream' mode it is
a `StreamState`: the next unread document and, per stream, its open document and offset.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import json
from typing import Iterable, Iterator

import numpy as np

from input_pipeline.synthetic import PAD

MODES = ('packed', 'concat', 'stream')


@dataclasses.dataclass(frozen=True)
class Cursor:
  """Where the next row starts: token `offset` of document `doc` (0-based, in stream order)."""
  doc: int = 0
  offset: int = 0


def _empty_row(seq_len: int) -> dict[str, np.ndarray]:
  return {'inputs': np.full(seq_len, PAD, np.int32), 'targets': np.full(seq_len, PAD, np.int32),
          'weights': np.zeros(seq_len, np.float32), 'positions': np.zeros(seq_len, np.int32),
          'segment_ids': np.zeros(seq_len, np.int32)}


def rows(documents: Iterable[np.ndarray], seq_len: int, mode: str = 'packed',
         start: Cursor = Cursor(), *, min_piece: int = 0,
         align: int = 1) -> Iterator[tuple[dict[str, np.ndarray], Cursor]]:
  """Yields (row, cursor after the row) for the documents `start.doc`, `start.doc + 1`, ...

  Args:
    documents: token arrays of the documents from `start.doc` on.
    seq_len: tokens per row.
    mode: 'packed' or 'concat'.
    start: where to begin; `start.offset` is skipped in the first document.
    min_piece: packed mode: cut a document to fill a row when at least this many (input,
      target) pairs fit; 0 = never cut a document that fits in a row.
    align: packed mode: every segment starts at a multiple of `align` in its row, so patterns
      anchored to row positions (fixed, block_local with block l) see each document as if it
      started the row.

  Yields:
    A row (dict of (seq_len,) arrays) and the cursor where the following row starts.
  """
  if mode not in MODES:
    raise ValueError(f'data.packing must be one of {MODES}, got {mode!r}')
  if mode == 'stream':
    raise ValueError("data.packing='stream' builds whole batches: use stream_batches")
  if seq_len < 1:
    raise ValueError(f'seq_len must be >= 1, got {seq_len}')
  if mode == 'packed':
    if min_piece < 0:
      raise ValueError(f'data.pack_min_piece must be >= 0, got {min_piece}')
    if align < 1 or seq_len % align:
      raise ValueError(f'data.pack_align={align} must be >= 1 and divide seq_len={seq_len}')
    yield from _packed(iter(documents), seq_len, start, min_piece or seq_len + 1, align)
  else:
    yield from _concat(iter(documents), seq_len, start)


def _packed(documents, seq_len, start, min_piece, align):
  row, fill, segment = _empty_row(seq_len), 0, 0
  doc = start.doc
  offset = start.offset
  for tokens in documents:
    pairs_left = len(tokens) - 1 - offset
    while pairs_left > 0:
      n = min(pairs_left, seq_len)  # One piece: a whole document or a row-sized cut of one.
      fill = -(-fill // align) * align  # The segment starts on an aligned cell.
      room = seq_len - fill
      if n > room:
        if room >= min_piece and room > 0:  # Cut the document to fill the row.
          n = room
        else:                       # Close the row; the piece starts the next one.
          yield row, Cursor(doc, offset)
          row, fill, segment = _empty_row(seq_len), 0, 0
      segment += 1
      span = slice(fill, fill + n)
      row['inputs'][span] = tokens[offset:offset + n]
      row['targets'][span] = tokens[offset + 1:offset + n + 1]
      row['weights'][span] = 1.0
      row['positions'][span] = np.arange(n, dtype=np.int32)
      row['segment_ids'][span] = segment
      fill += n
      offset += n
      pairs_left -= n
      if fill == seq_len:
        yield row, (Cursor(doc, offset) if pairs_left > 0 else Cursor(doc + 1, 0))
        row, fill, segment = _empty_row(seq_len), 0, 0
    doc, offset = doc + 1, 0
  if fill:  # The stream ended (finite splits): the last row is padded.
    yield row, Cursor(doc, 0)


def _concat(documents, seq_len, start):
  # Pending token runs: (doc index, offset of the run's first token, tokens).
  runs: list[tuple[int, int, np.ndarray]] = []
  have = 0
  doc, offset = start.doc, start.offset
  positions = np.arange(seq_len, dtype=np.int32)
  for tokens in documents:
    if offset < len(tokens):
      runs.append((doc, offset, tokens[offset:]))
      have += len(tokens) - offset
    doc, offset = doc + 1, 0
    while have >= seq_len + 1:
      parts, need = [], seq_len + 1
      for _, _, toks in runs:
        parts.append(toks[:need])
        need -= len(parts[-1])
        if not need:
          break
      window = np.concatenate(parts)
      # Drop the first seq_len tokens; the last token of this row is the next row's first input.
      drop = seq_len
      while drop:
        d, o, toks = runs[0]
        if len(toks) <= drop:
          drop -= len(toks)
          runs.pop(0)
        else:
          runs[0] = (d, o + drop, toks[drop:])
          drop = 0
      have -= seq_len
      row = {'inputs': window[:-1].astype(np.int32), 'targets': window[1:].astype(np.int32),
             'weights': np.ones(seq_len, np.float32), 'positions': positions.copy(),
             'segment_ids': np.ones(seq_len, np.int32)}
      yield row, Cursor(runs[0][0], runs[0][1])
  # A trailing partial window is dropped in concat mode (training streams repeat forever).


def stack(rows_: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
  """A batch from a list of rows."""
  return {k: np.stack([r[k] for r in rows_]) for k in rows_[0]}


def padding_row(seq_len: int) -> dict[str, np.ndarray]:
  """A row that scores nothing (fills the last batch of a finite split)."""
  return _empty_row(seq_len)


# Stream mode: one concat-style stream per row, documents dealt from one ordered reader.

MAX_SEGMENT_ID = 2**31 - 1  # 'stream' segment ids are in [1, MAX_SEGMENT_ID] (positive int32).
STATE_BYTES = 1024  # JSON bytes of one process's data state that can be gathered across hosts.


def segment_id(doc: int, previous: int = 0) -> int:
  """The segment id of document `doc` in a stream whose previous document has id `previous`.

  It is 1 + doc wrapped into the positive int32 range, or the id after that when it equals
  `previous` (possible only after 2**31 - 1 documents were dealt to the other streams).
  """
  sid = 1 + doc % MAX_SEGMENT_ID
  return sid % MAX_SEGMENT_ID + 1 if sid == previous else sid


@dataclasses.dataclass(frozen=True)
class StreamState:
  """Where the streams of the 'stream' layout stand between batches.

  Attributes:
    next: global index of the next unread document (documents are dealt in index order).
    streams: per row, (open document, offset in it of the next row's first input, segment id
      of that document), or None for a stream that has ended (finite splits); () = nothing
      has been dealt yet.
  """
  next: int = 0
  streams: tuple[tuple[int, int, int] | None, ...] = ()

  @property
  def first(self) -> int:
    """The first document a resume reads: the oldest open one, else the next unread one."""
    return min((s[0] for s in self.streams if s), default=self.next)

  @functools.cached_property
  def _open(self) -> frozenset[int]:
    return frozenset(s[0] for s in self.streams if s)

  def needs(self, doc: int) -> bool:
    """Whether document `doc` (>= first) is read on resume: open in a stream, or not dealt."""
    return doc >= self.next or doc in self._open

  def to_json(self, limit: int | None = STATE_BYTES) -> dict:
    """The state as a small JSON-able dict.

    {'next': n, 'streams': [[n - doc, offset], ...]} (a third entry holds the segment id
    where it is not `segment_id(doc)`); over STATE_BYTES, 'streams' is instead a base64
    string of varints (n - doc, offset, segment id or 0) per stream.

    Args:
      limit: raise if the JSON is longer than this many bytes; None = no limit.

    Raises:
      ValueError: the state does not fit in `limit` bytes, or a stream has ended.
    """
    if any(s is None for s in self.streams):
      raise ValueError('a stream has ended: finite (eval) streams have no resumable state')
    rows = [[self.next - d, o] + ([s] if s != segment_id(d) else [])
            for d, o, s in self.streams]
    state = {'next': self.next, 'streams': rows}
    if _json_bytes(state) <= min(STATE_BYTES, limit or STATE_BYTES):
      return state
    state = {'next': self.next, 'streams': _varints(
        v for d, o, s in self.streams for v in (self.next - d, o, 0 if s == segment_id(d) else s))}
    if limit is not None and _json_bytes(state) > limit:
      raise ValueError(
          f"data.packing='stream': the input state of {len(self.streams)} streams takes "
          f'{_json_bytes(state)} bytes, over the {limit} gathered per process with a checkpoint; '
          'use fewer rows per process (batch_size / process count)')
    return state

  @classmethod
  def from_json(cls, state: dict) -> StreamState:
    """The inverse of `to_json`."""
    # 'order' (the document order, see shards.py) belongs to the caller.
    if not isinstance(state, dict) or set(state) - {'order'} != {'next', 'streams'}:
      raise ValueError(f"data state {state!r} is not a data.packing='stream' state (was the "
                       'checkpoint written with another data.packing?)')
    n, rows = state['next'], state['streams']
    if isinstance(rows, str):
      values = _unvarints(rows)
      rows = [values[i:i + 3] for i in range(0, len(values), 3)]
    streams = []
    for row in rows:
      back, offset, sid = (list(row) + [0])[:3]
      streams.append((n - back, offset, sid or segment_id(n - back)))
    return cls(n, tuple(streams))


def _json_bytes(state: dict) -> int:
  return len(json.dumps(state).encode())


def _varints(values: Iterable[int]) -> str:
  out = bytearray()
  for v in values:
    while v >= 0x80:
      out.append(v & 0x7f | 0x80)
      v >>= 7
    out.append(v)
  return base64.b64encode(bytes(out)).decode('ascii')


def _unvarints(text: str) -> list[int]:
  values, v, shift = [], 0, 0
  for b in base64.b64decode(text):
    v |= (b & 0x7f) << shift
    shift += 7
    if b < 0x80:
      values.append(v)
      v, shift = 0, 0
  return values


def stream_batches(documents: Iterable[np.ndarray], seq_len: int, rows: int,
                   start: StreamState = StreamState(), *, score_boundaries: bool = True
                   ) -> Iterator[tuple[dict[str, np.ndarray], StreamState]]:
  """Yields (batch of `rows` rows, state after the batch) in the 'stream' layout.

  Row r of each batch continues stream r: seq_len (input, target) pairs of the concatenation
  of the documents dealt to it. Rows are filled in order 0 .. rows - 1, and a stream that
  needs a document takes the next one. When the documents run out (finite splits), a stream
  that needs one ends: its rows are padded, and the batches end once every stream has ended.

  Args:
    documents: token arrays of the documents that `start.needs`, in index order: the open
      ones, then `start.next`, `start.next + 1`, ...
    seq_len: tokens per row.
    rows: streams, one per row of a batch.
    start: where the streams stand; StreamState() = nothing dealt yet.
    score_boundaries: give the pair (EOS, next document's BOS) weight 1; False (eval) scores
      exactly the pairs of 'packed' rows.

  Yields:
    A batch (dict of (rows, seq_len) arrays) and the state after it.
  """
  if seq_len < 1 or rows < 1:
    raise ValueError(f'seq_len={seq_len} and rows={rows} must be >= 1')
  if start.streams and len(start.streams) != rows:
    raise ValueError(f'the data state has {len(start.streams)} streams, but a batch has {rows} '
                     'rows per process: resume with the same batch_size and process count')
  docs = iter(documents)
  # Per stream: pending [doc, segment id, offset, tokens], and the last segment id dealt.
  pending: list[list[list]] = [[] for _ in range(rows)]
  last = [0] * rows
  ended = [bool(start.streams) and s is None for s in start.streams] or [False] * rows
  opened = sorted({s[0] for s in start.streams if s})
  by_doc = dict(zip(opened, docs))
  for r, s in enumerate(start.streams):
    if s is None:
      continue
    doc, offset, sid = s
    tokens = by_doc.get(doc)
    if tokens is None or offset >= len(tokens):
      raise ValueError(f'the data state (stream {r}: document {doc}, offset {offset}) does not '
                       'match the documents (another dataset, split or tokenizer?)')
    pending[r].append([doc, sid, offset, tokens])
    last[r] = sid
  next_doc = start.next

  def deal(r: int) -> int:
    """Deals the next non-empty document to stream r; returns its length (0: none left)."""
    nonlocal next_doc
    for tokens in docs:
      doc, next_doc = next_doc, next_doc + 1
      if len(tokens):
        last[r] = segment_id(doc, last[r])
        pending[r].append([doc, last[r], 0, tokens])
        return len(tokens)
    return 0

  while True:
    batch, used = [], 0
    for r in range(rows):
      row = _empty_row(seq_len)
      batch.append(row)
      if ended[r]:
        continue
      runs = pending[r]
      have = sum(len(t) - o for _, _, o, t in runs)
      while have < seq_len + 1:
        got = deal(r)
        if not got:
          break
        have += got
      n = min(seq_len, have - 1)  # Pairs in this row.
      if n < seq_len:  # Out of documents: this stream ends with this row.
        ended[r] = True
      if n <= 0:
        pending[r] = []
        continue
      used += 1
      _fill_stream_row(row, runs, n, score_boundaries)
      drop = n  # The last target stays: it is the next row's first input.
      while drop:
        run = runs[0]
        left = len(run[3]) - run[2]
        if left <= drop:
          drop -= left
          runs.pop(0)
        else:
          run[2] += drop
          drop = 0
      if ended[r]:
        pending[r] = []
    if not used:
      return
    state = StreamState(next_doc, tuple(
        None if ended[r] else (p[0][0], p[0][2], p[0][1]) for r, p in enumerate(pending)))
    yield stack(batch), state


def _fill_stream_row(row, runs, n, score_boundaries) -> None:
  """Writes the first n + 1 pending tokens of a stream into `row` as n pairs."""
  tokens = np.empty(n + 1, np.int32)
  row['weights'][:n] = 1.0
  fill = 0
  for _, sid, offset, toks in runs:
    take = min(len(toks) - offset, n + 1 - fill)
    tokens[fill:fill + take] = toks[offset:offset + take]
    cells = slice(fill, min(fill + take, n))  # Cells whose input is one of these tokens.
    row['segment_ids'][cells] = sid
    row['positions'][cells] = np.arange(offset, offset + cells.stop - cells.start)
    end = fill + take - 1  # Cell of this run's last token.
    if not score_boundaries and offset + take == len(toks) and end < n:
      row['weights'][end] = 0.0  # The pair (EOS, next document's BOS).
    fill += take
    if fill == n + 1:
      break
  row['inputs'][:n] = tokens[:n]
  row['targets'][:n] = tokens[1:]
