"""A TFDS builder for local text corpora, so they stream through the same code as C4.

Two layouts, chosen by how many files `files` matches:

* one large file (enwik8, text8, a book): cut by bytes into train / validation / test the way
  the papers cut enwik8 and text8 (first 90%, next 5%, last 5% with the default fractions:
  90M / 5M / 5M bytes of enwik8; a cut inside a UTF-8 character moves to its start). Each split
  is stored as chunks of about `chunk_bytes`, never ending inside a character.
* many files: each file is a document (files over `chunk_bytes` are stored as several
  chunks). A file's split is a hash of its path relative to the files' common folder, so
  adding files under that folder never moves the others between splits.

Examples have one feature, 'text' (the raw bytes; chunk edges may cut a UTF-8 character,
which the byte tokenizer keeps exactly). The builder config's name carries a fingerprint of
the file list, sizes, modification times and fractions: changing the corpus prepares a new
dataset instead of silently reading a stale one.
"""

from __future__ import annotations

import hashlib
import os
import re
import time

import tensorflow as tf
import tensorflow_datasets as tfds


def expand_files(patterns: str | list[str] | tuple[str, ...]) -> list[str]:
  """Sorted files matching comma-separated globs (local or gs://).

  Raises:
    FileNotFoundError: no pattern given, or a pattern matches nothing.
  """
  if isinstance(patterns, str):
    patterns = [p for p in patterns.split(',') if p.strip()]
  if not patterns:
    raise FileNotFoundError('data.files is empty: give the text files (comma-separated globs), '
                            'e.g. --config.data.files=/path/to/enwik8')
  files = []
  for pattern in patterns:
    matched = [f for f in tf.io.gfile.glob(pattern.strip()) if not tf.io.gfile.isdir(f)]
    if not matched:
      raise FileNotFoundError(f'data.files pattern {pattern!r} matches no file')
    files.extend(matched)
  return sorted(set(files))


def split_of(relpath: str, validation_fraction: float, test_fraction: float) -> str:
  """The split of one file in many-files mode: a stable hash of its relative path."""
  u = int.from_bytes(hashlib.sha256(relpath.encode()).digest()[:8], 'big') / 2.0**64
  if u < validation_fraction:
    return 'validation'
  if u < validation_fraction + test_fraction:
    return 'test'
  return 'train'


def byte_ranges(size: int, validation_fraction: float,
                test_fraction: float) -> dict[str, tuple[int, int]]:
  """[start, end) of each split in one-file mode: train first, then validation, then test."""
  train_end = size - int(round(size * (validation_fraction + test_fraction)))
  valid_end = train_end + int(round(size * validation_fraction))
  out = {'train': (0, train_end), 'validation': (train_end, valid_end)}
  if test_fraction > 0:
    out['test'] = (valid_end, size)
  return out


class LocalTextConfig(tfds.core.BuilderConfig):
  """Which files, and how to split them."""

  def __init__(self, *, corpus: str, files: list[str], validation_fraction: float = 0.05,
               test_fraction: float = 0.05, chunk_bytes: int = 1 << 20):
    if not 0 < validation_fraction < 1 or not 0 <= test_fraction < 1 or (
        validation_fraction + test_fraction >= 1):
      raise ValueError(f'need 0 < validation_fraction, 0 <= test_fraction and their sum < 1; got '
                       f'{validation_fraction} and {test_fraction}')
    if chunk_bytes < 1:
      raise ValueError(f'data.chunk_bytes must be >= 1, got {chunk_bytes}')
    stats = [(f, tf.io.gfile.stat(f)) for f in files]
    if sum(s.length for _, s in stats) == 0:
      raise ValueError(f'empty corpus: the {len(files)} file(s) of data.files hold no bytes')
    h = hashlib.sha256(repr((sorted((f, s.length, s.mtime_nsec) for f, s in stats),
                             validation_fraction, test_fraction, chunk_bytes)).encode())
    safe = re.sub(r'[^a-z0-9_]', '_', corpus.lower()) or 'corpus'
    super().__init__(name=f'{safe}_{h.hexdigest()[:12]}', version=LocalText.VERSION,
                     description=f'{len(files)} local file(s)')
    self.files = list(files)
    self.validation_fraction = validation_fraction
    self.test_fraction = test_fraction
    self.chunk_bytes = chunk_bytes


class LocalText(tfds.core.GeneratorBasedBuilder):
  """Local text files as a TFDS dataset with train / validation (/ test) splits."""

  VERSION = tfds.core.Version('1.0.0')
  RELEASE_NOTES = {'1.0.0': 'First version.'}

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(
        builder=self, description='Local text files cut into splits.', disable_shuffling=True,
        features=tfds.features.FeaturesDict({'text': tfds.features.Text()}))

  def _split_generators(self, dl_manager):
    del dl_manager  # Nothing to download.
    cfg = self.builder_config
    plan: dict[str, list[tuple[str, int, int]]] = {}  # split -> (file, start, end)
    if len(cfg.files) == 1:
      path = cfg.files[0]
      size = tf.io.gfile.stat(path).length
      for split, (lo, hi) in byte_ranges(size, cfg.validation_fraction, cfg.test_fraction).items():
        # Split edges move to a character start (<= 3 bytes) so no split cuts a character.
        plan[split] = [(path, _align(path, lo, size), _align(path, hi, size))]
    else:
      root = os.path.commonpath(cfg.files) if not cfg.files[0].startswith('gs://') else ''
      plan = {'train': [], 'validation': []}
      if cfg.test_fraction > 0:
        plan['test'] = []
      for path in cfg.files:
        rel = os.path.relpath(path, root) if root else path
        split = split_of(rel, cfg.validation_fraction, cfg.test_fraction)
        plan[split].append((path, 0, tf.io.gfile.stat(path).length))
    for split, ranges in plan.items():
      if sum(hi - lo for _, lo, hi in ranges) == 0:
        raise ValueError(
            f'the {split} split of data.files would be empty ({len(cfg.files)} file(s)); give '
            'more files, one larger file, or larger data.validation_fraction/test_fraction')
    return {split: self._generate_examples(ranges) for split, ranges in plan.items()}

  def _generate_examples(self, ranges):
    step = self.builder_config.chunk_bytes
    for path, lo, hi in ranges:
      with tf.io.gfile.GFile(path, 'rb') as f:
        f.seek(lo)
        start, carry = lo, b''
        while start < hi:
          data = carry + f.read(min(step, hi - start - len(carry)))
          end = len(data) if start + len(data) >= hi else _complete_prefix(data)
          if end == 0:  # A chunk shorter than one character: keep it whole.
            end = len(data)
          yield f'{path}:{start}', {'text': data[:end]}
          carry = data[end:]
          start += end


def _complete_prefix(data: bytes) -> int:
  """Length of the longest prefix of `data` that does not end inside a UTF-8 character."""
  for back in range(1, min(4, len(data)) + 1):
    lead = data[-back]
    if lead & 0xC0 != 0x80:  # Not a continuation byte: a character starts here.
      need = (1 if lead < 0x80 else 2 if lead >> 5 == 0b110 else 3 if lead >> 4 == 0b1110
              else 4 if lead >> 3 == 0b11110 else 1)
      return len(data) - back if need > back else len(data)
  return len(data)  # Not UTF-8 here: any cut will do.


def _align(path: str, offset: int, size: int) -> int:
  """`offset` moved forward (at most 3 bytes) to the start of a UTF-8 character."""
  if offset <= 0 or offset >= size:
    return offset
  with tf.io.gfile.GFile(path, 'rb') as f:
    f.seek(offset)
    head = f.read(4)
  step = 0
  while step < len(head) - 1 and head[step] & 0xC0 == 0x80:
    step += 1
  return offset + step


def prepare(data_cfg, *, process_index: int = 0, wait_seconds: float = 3600.0) -> LocalText:
  """The prepared LocalText builder for `data_cfg`, building it on first use.

  Process 0 writes the dataset under data_cfg.data_dir ('' = the TFDS default folder); the
  other processes wait for it (on several hosts the data_dir must be shared, e.g. gs://).

  Args:
    data_cfg: the config's `data` block (files, corpus name, fractions, chunk_bytes, data_dir).
    process_index: this host's index.
    wait_seconds: how long other processes wait.

  Returns:
    The builder, ready for `as_dataset`.
  """
  config = LocalTextConfig(
      corpus=data_cfg.corpus, files=expand_files(data_cfg.files),
      validation_fraction=data_cfg.validation_fraction, test_fraction=data_cfg.test_fraction,
      chunk_bytes=data_cfg.chunk_bytes)
  builder = LocalText(config=config, data_dir=data_cfg.data_dir or None)
  if not builder.is_prepared():
    if process_index == 0:
      try:
        builder.download_and_prepare()
      except FileExistsError:  # Another job prepared the same files at the same time.
        builder = LocalText(config=config, data_dir=data_cfg.data_dir or None)
        if not builder.is_prepared():
          raise
    else:
      deadline = time.time() + wait_seconds
      while not builder.is_prepared():
        if time.time() > deadline:
          raise TimeoutError(f'waited {wait_seconds:.0f} s for process 0 to prepare {config.name}')
        time.sleep(2.0)
        builder = LocalText(config=config, data_dir=data_cfg.data_dir or None)
  return builder
