"""Fixed-length training rows from a stream of tokenized documents.

Two modes:

* 'packed': several documents per row, each its own segment (segment_ids 1, 2, ...) with
  positions restarting at 0, so attention never crosses documents and the loss skips padding
  (weights 0, segment id 0). A document that does not fit in the room left in a row is cut to
  fill it when at least `min_piece` tokens fit (the rest opens the next row as a new segment),
  else the row is closed with padding; with min_piece = 0 documents are only cut when they are
  longer than a row. Without cuts, C4-like ~2 KB documents at seq_len 512 leave a third of
  every batch as padding.
* 'concat': the documents are concatenated and the stream is chunked into rows of seq_len + 1
  tokens overlapping by one (GPT style): one segment per row, no padding.

A document of tokens t_0 .. t_m (t_0 = BOS, t_m = EOS) gives the (input, target) pairs
(t_k, t_{k+1}). The position in the stream between rows is a `Cursor` (document index, first
token of the next row in that document), which is all the state needed to resume exactly:
documents are re-read from `doc` and tokenized again, deterministically.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Iterator

import numpy as np

from input_pipeline.synthetic import PAD

MODES = ('packed', 'concat')


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
