"""A prepared TFDS split read shard by shard: checked at start, re-entered at any document.

Checks (`check_files`): every shard file the dataset's metadata lists must exist, hold at least
the 16 bytes of TFRecord framing per record, and the files of a split together must hold the
split's serialized bytes (`num_bytes`) plus that framing; a shortfall names the file furthest
below its share. A file damaged inside passes these checks: reading it fails, and `Reader`
turns the TensorFlow error into a `DataError` that names the dataset, split, file and record.

Document order (`Reader`, data state 'order' 2): epoch e of a process's split reads the split's
shard pieces (TFDS file instructions: file, first record, count) in an order that is a
permutation seeded by (seed, e) (fixed for datasets with disable_shuffling), one after the
other; the epoch's documents are cut into windows of `window` documents (data.shuffle_buffer)
and each window is permuted by (seed, e, window index). Document n of the stream is therefore
found by arithmetic on the metadata's shard lengths: resuming reads only the records of one
window from its start, skipping whole shards unopened and the records before the window inside
its shard without decoding them.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
from typing import Iterator

import numpy as np

ORDER_VERSION = 2  # Data states without 'order' are positions in the legacy tf.data order.
RECORD_FRAMING = 16  # Bytes around every TFRecord record: length, its CRC, data CRC.
_READ_BATCH = 256  # Records decoded per tf.data batch.
_STAT_THREADS = 32


class DataError(ValueError):
  """A dataset file is missing, too short or unreadable; the message names the file."""


@dataclasses.dataclass(frozen=True)
class Piece:
  """Records [skip, skip + take) of one shard file."""
  filename: str
  skip: int
  take: int


def dataset_name(builder) -> str:
  return f'TFDS dataset {builder.info.full_name} (in {builder.data_dir})'


def split_name(split) -> str:
  """A split string, or a per-process split as 'train' (process 1 of 4)."""
  if not isinstance(split, str) and all(hasattr(split, a) for a in ('split', 'index', 'count')):
    return f'{split.split!r} (the part of process {split.index} of {split.count})'
  return repr(str(split))


def readable(builder) -> bool:
  """Whether `Reader` can read the dataset (TFRecord shards)."""
  return getattr(builder.info.file_format, 'value', builder.info.file_format) == 'tfrecord'


def pieces(builder, split) -> list[Piece]:
  """The shard pieces of `split` (a split name, slice or per-process split), in file order."""
  out = []
  for fi in builder.info.splits[split].file_instructions:
    take = fi.take if fi.take is not None and fi.take >= 0 else fi.examples_in_shard - fi.skip
    if take > 0:
      out.append(Piece(str(fi.filename), int(fi.skip), int(take)))
  return out


def _size(path: str) -> int | None:
  import tensorflow as tf
  try:
    return tf.io.gfile.stat(path).length
  except tf.errors.NotFoundError:
    return None


def check_files(builder, split: str, role: str) -> None:
  """Checks the shard files of `split` (its whole base split) against the metadata.

  Args:
    builder: a prepared TFDS builder.
    split: the split string of the config (a slice is checked as its whole split).
    role: 'train' or 'eval', for the message.

  Raises:
    FileNotFoundError: a shard file is missing.
    DataError: a shard file is too short for the records the metadata gives it.
  """
  base = str(split).split('[')[0]
  info = builder.info.splits[base]
  files = [(str(fi.filename), fi.examples_in_shard) for fi in info.file_instructions]
  where = f'{dataset_name(builder)}, split {base!r} (data.{role}_split)'
  with concurrent.futures.ThreadPoolExecutor(_STAT_THREADS) as pool:
    sizes = list(pool.map(_size, (f for f, _ in files)))
  missing = [f for (f, _), s in zip(files, sizes) if s is None]
  if missing:
    raise FileNotFoundError(
        f'{where}: {len(missing)} of its {len(files)} shard files are missing, first {missing[0]}'
        '. Copy the prepared dataset again (all files of the version folder).')
  for (f, records), size in zip(files, sizes):
    if size < (RECORD_FRAMING * records if readable(builder) else 1) and records:
      raise DataError(f'{where}: shard file {f} is truncated: {size} bytes cannot hold the '
                      f'{records} records the metadata gives it. Copy it again.')
  num_bytes = int(info.num_bytes or 0)
  total_records = sum(r for _, r in files)
  need = num_bytes + RECORD_FRAMING * total_records
  if num_bytes and readable(builder) and sum(sizes) < need:
    # Name the file furthest below its share of the split's bytes (shards hold random records).
    per_record = need / max(total_records, 1)
    ratio, f, size, records = min((s / (per_record * r), f, s, r)
                                  for (f, r), s in zip(files, sizes) if r)
    if ratio < 0.9:
      raise DataError(
          f'{where}: the shard files hold {sum(sizes)} bytes, {need - sum(sizes)} less than the '
          f'metadata\'s {num_bytes} bytes of records plus framing; shard file {f} is truncated '
          f'({size} bytes for {records} records, about {int(per_record * records)} expected). '
          'Copy it again.')


class Reader:
  """The documents of a split, in an order that can be entered at any document index.

  Args:
    builder: a prepared TFDS builder.
    split: the split to read (this process's slice).
    text_key: the feature holding the text.
    seed: seeds the shard order and the window permutations.
    shuffle: permute shards (unless the dataset disables shuffling) and windows.
    window: documents per shuffle window (<= 1: no window shuffle).
  """

  def __init__(self, builder, split, *, text_key: str, seed: int, shuffle: bool, window: int):
    self._builder = builder
    self._split = split
    self._text_key = text_key
    self._seed = seed
    self._shuffle_shards = shuffle and not builder.info.disable_shuffling
    self._window = window if shuffle and window > 1 else 0
    self._pieces = pieces(builder, split)
    self.epoch_docs = sum(p.take for p in self._pieces)
    if not self.epoch_docs:
      raise DataError(f'{dataset_name(builder)}: split {split_name(split)} selects no record')

  def _order(self, epoch: int) -> list[Piece]:
    if not self._shuffle_shards:
      return self._pieces
    perm = np.random.default_rng([self._seed, epoch, 0]).permutation(len(self._pieces))
    return [self._pieces[i] for i in perm]

  def documents(self, start: int = 0) -> Iterator[bytes]:
    """Endless documents from global index `start` on (epochs repeat with new orders)."""
    epoch, i = divmod(start, self.epoch_docs)
    while True:
      order = self._order(epoch)
      if not self._window:
        yield from self._read(order, i, self.epoch_docs - i)
      else:
        w = i // self._window
        pos, skip = w * self._window, i - w * self._window
        records = self._read(order, pos, self.epoch_docs - pos)
        while pos < self.epoch_docs:
          n = min(self._window, self.epoch_docs - pos)
          texts = list(itertools.islice(records, n))
          perm = np.random.default_rng([self._seed, epoch, w + 1]).permutation(n)
          for j in perm[skip:]:
            yield texts[j]
          pos, w, skip = pos + n, w + 1, 0
      epoch, i = epoch + 1, 0

  def _read(self, order: list[Piece], pos: int, count: int) -> Iterator[bytes]:
    """`count` documents of the epoch whose pieces are `order`, from epoch position `pos`."""
    for piece in order:
      if count <= 0:
        return
      if pos >= piece.take:
        pos -= piece.take  # A whole shard piece skipped by its metadata length, unopened.
        continue
      n = min(piece.take - pos, count)
      yield from self._read_piece(piece, pos, n)
      count -= n
      pos = 0

  def _read_piece(self, piece: Piece, offset: int, count: int) -> Iterator[bytes]:
    import tensorflow as tf
    first = piece.skip + offset
    features = self._builder.info.features
    key = self._text_key
    ds = tf.data.TFRecordDataset(piece.filename, buffer_size=8 << 20)
    # Records before `first` are skipped as raw bytes (framing read, nothing parsed).
    ds = ds.skip(first).take(count)
    ds = ds.map(lambda r: features.deserialize_example(r)[key],
                num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    ds = ds.batch(_READ_BATCH).prefetch(2)
    read = 0
    try:
      for texts in ds.as_numpy_iterator():
        read += len(texts)
        yield from texts
    except tf.errors.OpError as e:
      raise DataError(
          f'{dataset_name(self._builder)}, split {split_name(self._split)}: reading shard file '
          f'{piece.filename} failed at or after record {first + read} ({type(e).__name__}: '
          f'{e.message.strip()}). The file is damaged: copy it again; the run can resume from '
          'its last checkpoint.') from None
    if read < count:
      raise DataError(
          f'{dataset_name(self._builder)}, split {split_name(self._split)}: shard file '
          f'{piece.filename} '
          f'ended after record {first + read}, but the metadata gives it '
          f'{piece.skip + piece.take} or more records. The file is truncated: copy it again.')
