"""Text data streamed by TFDS: C4 (or any TFDS text dataset) and local corpora, one code path.

  documents (per-process split; training: shards.Reader's seeded shard order and shuffle
             windows, entered at any document; eval: TFDS's reader in file order)
    -> tokenizer (SentencePiece or bytes, batched on the host)
    -> packing.rows (packed documents or concat-and-chunk), or packing.stream_batches
       (data.packing='stream': row r of consecutive batches continues one text stream)
    -> per-process batches, built ahead of the train step by a background thread.

Exact resume: the document order is a pure function of the seed and the dataset's metadata
(see input_pipeline/shards.py), so the stream position after any batch is a `packing.Cursor`
(document index, token offset). The training loop checkpoints the cursor of the last batch it
consumed (with 'order': 2); a restart starts reading at the shard and shuffle window holding
that document, found by arithmetic, and continues the same rows. A cursor without 'order'
(older checkpoints) resumes in the older tf.data order by skipping that many documents. Each process has its own cursor. With data.packing='stream' the
position is a `packing.StreamState` (next unread document; per row, its open document and
offset): a restart re-reads from the oldest open document, tokenizing only the open ones and
those not dealt yet. Eval in that layout deals the validation split to the rows in order.
"""

from __future__ import annotations

import os
import queue
import re
import threading
from typing import Iterator

import numpy as np

from input_pipeline import packing, shards

TFDS_NAMES = ('c4', 'tfds', 'local_text')
_TOKENIZE_BATCH = 64  # Documents per tokenizer call.


def _tfds():
  import tensorflow_datasets as tfds
  tfds.disable_progress_bar()
  return tfds


def make_builder(data_cfg, *, process_index: int = 0):
  """The prepared TFDS builder for data.name 'c4'/'tfds' (data.tfds_name) or 'local_text'.

  Raises:
    FileNotFoundError: the dataset is not prepared under data.data_dir (nothing is downloaded).
  """
  tfds = _tfds()
  if data_cfg.name == 'local_text':
    from input_pipeline import local_text  # TensorFlow loads only for text data.
    return local_text.prepare(data_cfg, process_index=process_index)
  where = data_cfg.data_dir or '(the TFDS default data_dir)'
  if data_cfg.data_dir and not _exists(data_cfg.data_dir):
    raise FileNotFoundError(f'data.data_dir={data_cfg.data_dir!r} does not exist')
  try:
    builder = tfds.builder(data_cfg.tfds_name, data_dir=data_cfg.data_dir or None)
  except Exception as e:  # TFDS raises several types for unknown names or versions.
    raise FileNotFoundError(f'TFDS dataset {data_cfg.tfds_name!r} not found in {where}'
                            f'{_present_versions(data_cfg)}: {type(e).__name__}: {e}') from e
  if not builder.is_prepared():
    raise FileNotFoundError(
        f'TFDS dataset {data_cfg.tfds_name!r} is not prepared in {where}'
        f'{_present_versions(data_cfg)}. This code never downloads: prepare it once (tfds '
        'build, or copy the prepared files; for C4 3.0.1, which TFDS >= 4.9.7 no longer builds, '
        'copy the prepared files of gs://allennlp-tensorflow-datasets/c4/en/3.0.1, a '
        'requester-pays bucket; see docs/data.md) and point data.data_dir at the folder or gs:// '
        f'bucket holding {data_cfg.tfds_name.replace(":", "/")}/')
  return builder


def _present_versions(data_cfg) -> str:
  """'; versions present: ...' for the version folders of data.tfds_name in its data_dir."""
  import tensorflow as tf
  name = data_cfg.tfds_name.split(':')[0]
  data_dir = data_cfg.data_dir or os.environ.get('TFDS_DATA_DIR') or os.path.expanduser(
      '~/tensorflow_datasets')
  folder = os.path.join(data_dir, name)
  try:
    entries = tf.io.gfile.listdir(folder)
  except tf.errors.OpError:
    return f' ({folder} does not exist)'
  versions = sorted((e.rstrip('/') for e in entries if _VERSION.fullmatch(e.rstrip('/'))),
                    key=lambda v: tuple(int(x) for x in v.split('.')))
  if not versions:
    return f' ({folder} holds no version folder)'
  hint = ''
  if ':' in data_cfg.tfds_name:
    hint = f'; use one with data.tfds_name={name}:{versions[-1]}'
  return f' (versions present in {folder}: {", ".join(versions)}{hint})'


_VERSION = re.compile(r'\d+\.\d+\.\d+')


def _exists(path: str) -> bool:
  import tensorflow as tf
  return tf.io.gfile.exists(path)


def _check_split(builder, split: str, role: str) -> None:
  base = split.split('[')[0]
  if base not in builder.info.splits:
    raise ValueError(f'data.{role}_split={split!r}: {builder.info.full_name} has splits '
                     f'{sorted(builder.info.splits)}')
  if builder.info.splits[base].num_examples == 0:
    raise ValueError(f'the {base!r} split of {builder.info.full_name} is empty')
  try:  # A slice ('validation[:0]', 'train[99%:]') may select nothing of a full split.
    selected = builder.info.splits[split].num_examples
  except (ValueError, KeyError, AssertionError) as e:
    raise ValueError(f'data.{role}_split={split!r} is not a valid TFDS split of '
                     f'{builder.info.full_name}: {e}') from None
  if selected == 0:
    raise ValueError(f'data.{role}_split={split!r} selects no example of '
                     f'{builder.info.full_name} (the {base!r} split has '
                     f'{builder.info.splits[base].num_examples})')


def documents(builder, split: str, *, text_key: str = 'text', seed: int = 0,
              shuffle: bool = False, repeat: bool = False, shuffle_buffer: int = 0,
              skip: int = 0, legacy: bool = False) -> Iterator[bytes]:
  """Raw documents of `split`, in an order that depends only on the arguments.

  Args:
    builder: a prepared TFDS builder.
    split: the TFDS split string (may be a per-process slice).
    text_key: the feature holding the text.
    seed: file-shuffle and shuffle-window seed.
    shuffle: shuffle files and documents.
    repeat: repeat forever (training): the order of `shards.Reader`, entered at `skip` without
      reading what comes before (unless `legacy`).
    shuffle_buffer: documents per shuffle window (0 or 1: files are shuffled only).
    skip: documents to skip first (resume).
    legacy: the tf.data order of training streams before `shards.Reader` (files interleaved
      by TFDS, a shuffle buffer across epochs): `skip` documents are read and dropped.

  Yields:
    Document bytes.
  """
  if repeat and not legacy:
    reader = shards.Reader(builder, split, text_key=text_key, seed=seed, shuffle=shuffle,
                           window=shuffle_buffer)
    yield from reader.documents(skip)
    return
  import tensorflow as tf
  tfds = _tfds()
  read_config = tfds.ReadConfig(shuffle_seed=seed, shuffle_reshuffle_each_iteration=True,
                                try_autocache=False)
  # Ordered datasets (local_text keeps file order) are shuffled by the buffer only.
  shuffle_files = shuffle and not builder.info.disable_shuffling
  ds = builder.as_dataset(split=split, shuffle_files=shuffle_files, read_config=read_config)
  if text_key not in ds.element_spec:
    raise ValueError(f'data.text_key={text_key!r} is not a feature of {builder.info.full_name}: '
                     f'{sorted(ds.element_spec)}')
  ds = ds.map(lambda ex: ex[text_key])
  if repeat:
    ds = ds.repeat()
  if shuffle and shuffle_buffer > 1:
    ds = ds.shuffle(shuffle_buffer, seed=seed, reshuffle_each_iteration=True)
  if skip:
    ds = ds.skip(skip)
  options = tf.data.Options()
  options.deterministic = True
  ds = ds.with_options(options).batch(_TOKENIZE_BATCH).prefetch(tf.data.AUTOTUNE)
  read = 0
  try:
    for texts in ds.as_numpy_iterator():
      read += len(texts)
      yield from texts
  except tf.errors.OpError as e:  # The file is not known here: name the split and position.
    raise shards.DataError(
        f'{shards.dataset_name(builder)}, split {shards.split_name(split)}: reading failed after {skip + read} '
        f'documents of the stream ({type(e).__name__}: {e.message.strip()}). A shard file is '
        'damaged: copy the dataset again.') from None


def tokenized(docs: Iterator[bytes], tokenizer) -> Iterator[np.ndarray]:
  """Token arrays of the documents, encoded a few dozen at a time."""
  pending = []
  for doc in docs:
    pending.append(doc)
    if len(pending) == _TOKENIZE_BATCH:
      yield from tokenizer.encode_batch(pending)
      pending = []
  if pending:
    yield from tokenizer.encode_batch(pending)


def train_batches(builder, tokenizer, data_cfg, *, split: str, seq_len: int, rows_per_batch: int,
                  seed: int, cursor: packing.Cursor | packing.StreamState, legacy: bool = False
                  ) -> Iterator[tuple[dict, packing.Cursor | packing.StreamState]]:
  """Endless (batch, cursor after the batch) from `cursor` on; the same for the same arguments.

  With data.packing='stream', `cursor` and the yielded positions are `packing.StreamState`s.
  Documents come in the shard order of `shards.Reader` (entered at the cursor by arithmetic),
  or with `legacy` in the tf.data order of checkpoints written before it (resumed by skipping).
  """
  def docs_from(start):
    return documents(builder, split, text_key=data_cfg.text_key, seed=seed, shuffle=True,
                     repeat=True, shuffle_buffer=data_cfg.shuffle_buffer, skip=start,
                     legacy=legacy)

  if data_cfg.packing == 'stream':
    state = cursor
    # Documents dealt before `state` and since consumed are read but not tokenized.
    needed = (d for i, d in enumerate(docs_from(state.first), state.first) if state.needs(i))
    yield from packing.stream_batches(tokenized(needed, tokenizer), seq_len, rows_per_batch,
                                      state)
    return
  stream = packing.rows(tokenized(docs_from(cursor.doc), tokenizer), seq_len, data_cfg.packing,
                        cursor, min_piece=data_cfg.pack_min_piece, align=data_cfg.pack_align)
  while True:
    rows = []
    for _ in range(rows_per_batch):
      row, cursor = next(stream)
      rows.append(row)
    yield packing.stack(rows), cursor


def eval_batches(builder, tokenizer, data_cfg, *, split: str, seq_len: int, rows_per_batch: int,
                 max_batches: int) -> Iterator[dict]:
  """The validation batches, in file order: exactly `max_batches`, or the whole split if <= 0.

  Rows that score nothing fill the last batch of the split and, with `max_batches`, any
  batches past its end, so every host runs the same number of eval steps. With
  data.packing='stream' the documents are dealt to the rows as in training (row r of
  consecutive batches continues one stream) until every stream has run out; the pair (EOS,
  next BOS) is not scored, so the scored pairs are those of 'packed' eval.
  """
  docs = documents(builder, split, text_key=data_cfg.text_key)
  if data_cfg.packing == 'stream':
    batches = (b for b, _ in packing.stream_batches(
        tokenized(docs, tokenizer), seq_len, rows_per_batch, score_boundaries=False))
    count = 0
    for batch in batches:
      if 0 < max_batches <= count:
        return
      yield batch
      count += 1
    while count < max_batches:
      yield packing.stack([packing.padding_row(seq_len)] * rows_per_batch)
      count += 1
    return
  stream = packing.rows(tokenized(docs, tokenizer), seq_len, 'packed',
                        align=data_cfg.pack_align)
  count = 0
  while max_batches <= 0 or count < max_batches:
    rows = [row for row, _ in _take(stream, rows_per_batch)]
    if not rows and max_batches <= 0:
      return
    rows += [packing.padding_row(seq_len)] * (rows_per_batch - len(rows))
    yield packing.stack(rows)
    count += 1


def eval_documents(builder, tokenizer, data_cfg, *, split: str) -> Iterator[np.ndarray]:
  """The documents of `split` in file order, each tokenized whole ([BOS] + text + [EOS], never
  packed or cut into rows), for sliding-window evaluation (training/evaluation.py).

  A document is one example of the dataset, as in the packed eval rows, except for a
  local_text corpus of one file (enwik8 style): the examples read (consecutive chunks of
  data.chunk_bytes, one contiguous stretch of the file) are joined into one document, the
  stream the papers evaluate.
  """
  docs = documents(builder, split, text_key=data_cfg.text_key)
  config = getattr(builder, 'builder_config', None)
  if data_cfg.name == 'local_text' and len(getattr(config, 'files', ())) == 1:
    docs = iter([b''.join(docs)])
  return tokenized(docs, tokenizer)


def _take(it, n):
  for _ in range(n):
    try:
      yield next(it)
    except StopIteration:
      return


class Prefetch:
  """Runs an iterator in a background thread, `depth` items ahead of the consumer.

  Errors in the producer are raised in the consumer; `close()` stops the thread.
  """

  _DONE = object()

  def __init__(self, iterator, depth: int = 2):
    self._queue = queue.Queue(maxsize=max(depth, 1))
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, args=(iterator,), daemon=True,
                                    name='input-prefetch')
    self._thread.start()

  def _run(self, iterator):
    try:
      for item in iterator:
        while not self._stop.is_set():
          try:
            self._queue.put((item, None), timeout=0.1)
            break
          except queue.Full:
            continue
        if self._stop.is_set():
          return
      self._queue.put((self._DONE, None))
    except BaseException as e:  # Handed to the consumer.
      self._queue.put((self._DONE, e))

  def __iter__(self):
    return self

  def __next__(self):
    item, error = self._queue.get()
    if item is self._DONE:
      self._queue.put((item, error))  # Later calls see the same end.
      if error is not None:
        raise error
      raise StopIteration
    return item

  def close(self):
    self._stop.set()
