"""Tokenizers for text data: byte-level and SentencePiece, with one shared interface.

Both reserve the ids the synthetic tasks use: PAD = 0, BOS = 1, EOS = 2. Every document is
encoded as [BOS] + text + [EOS], so the first token of a document is always its BOS.

The SentencePiece model is trained lossless: identity normalization, no dummy prefix, kept
whitespace and byte fallback, so decode(encode(text)) == text and every id stands for an exact
number of UTF-8 bytes. That makes bits per byte an exact number, not an estimate.

Files go through tf.io.gfile, so vocabulary paths may be local or gs://.
"""

from __future__ import annotations

import os
import re
import tempfile
import time
from typing import Iterable, Sequence

import numpy as np

from input_pipeline.synthetic import BOS, EOS, PAD

UNK = 3  # SentencePiece's unknown piece (never produced with byte fallback).
_META = '\u2581'  # SentencePiece's whitespace symbol.


class ByteTokenizer:
  """UTF-8 bytes as tokens: byte b is id b + 3 after PAD, BOS and EOS (enwik8/text8 style)."""

  offset = 3
  vocab_size = 256 + offset
  name = 'byte'

  def encode_batch(self, texts: Sequence[bytes | str]) -> list[np.ndarray]:
    """[BOS] + bytes + [EOS] for each text, as int32 arrays."""
    out = []
    for t in texts:
      raw = np.frombuffer(t.encode('utf-8') if isinstance(t, str) else t, np.uint8)
      ids = np.empty(raw.size + 2, np.int32)
      ids[0], ids[-1] = BOS, EOS
      ids[1:-1] = raw
      ids[1:-1] += self.offset
      out.append(ids)
    return out

  def decode(self, ids: Iterable[int]) -> str:
    """The text of `ids`; special ids and ids past the 259 (the model's padded vocabulary:
    a sampled id can land there) are dropped, invalid UTF-8 is replaced."""
    ids = np.asarray(list(ids), np.int64)
    kept = ids[(ids >= self.offset) & (ids < self.vocab_size)]
    raw = (kept - self.offset).astype(np.uint8).tobytes()
    return raw.decode('utf-8', errors='replace')

  def token_bytes(self) -> np.ndarray:
    """Bytes of text each id stands for (0 for the specials)."""
    out = np.ones(self.vocab_size, np.float64)
    out[:self.offset] = 0
    return out


class SentencePieceTokenizer:
  """A trained SentencePiece model with the reserved ids checked."""

  name = 'sentencepiece'

  def __init__(self, model_proto: bytes, *, source: str = '<memory>'):
    import sentencepiece as spm
    self._sp = spm.SentencePieceProcessor(model_proto=model_proto)
    self.vocab_size = self._sp.get_piece_size()
    self.source = source
    got = (self._sp.pad_id(), self._sp.bos_id(), self._sp.eos_id())
    if got != (PAD, BOS, EOS):
      raise ValueError(f'SentencePiece model {source} reserves (pad, bos, eos) = {got}, this '
                       f'codebase needs {(PAD, BOS, EOS)}; train a new one (delete the file)')

  def encode_batch(self, texts: Sequence[bytes | str]) -> list[np.ndarray]:
    """[BOS] + pieces + [EOS] for each text, as int32 arrays."""
    texts = [t.decode('utf-8', errors='replace') if isinstance(t, bytes) else t for t in texts]
    encoded = self._sp.encode(texts, add_bos=True, add_eos=True)
    for n, t in enumerate(texts):
      if _META in t:
        encoded[n] = self._encode_with_meta(t)
    return [np.asarray(ids, np.int32) for ids in encoded]

  def _encode_with_meta(self, text: str) -> list[int]:
    # SentencePiece reads a literal U+2581 as its space symbol; spell it in byte pieces so
    # that it decodes back to itself and counts its 3 bytes.
    meta = [self._sp.piece_to_id(f'<0x{b:02X}>') for b in _META.encode('utf-8')]
    ids = [BOS]
    for n, part in enumerate(text.split(_META)):
      if n:
        ids += meta
      ids += self._sp.encode(part)
    return ids + [EOS]

  def decode(self, ids: Iterable[int]) -> str:
    """The text of `ids`; special ids are dropped, and so are ids past the vocabulary (the
    model's vocab_size pads it: a sampled id can land there)."""
    return self._sp.decode([int(i) for i in ids if UNK < int(i) < self.vocab_size])

  def token_bytes(self) -> np.ndarray:
    """Bytes of text each id stands for: exact, as the model is lossless."""
    out = np.zeros(self.vocab_size, np.float64)
    for i in range(self.vocab_size):
      if self._sp.is_control(i) or self._sp.is_unknown(i):
        continue
      if self._sp.is_byte(i):
        out[i] = 1
      else:
        out[i] = len(self._sp.id_to_piece(i).replace(_META, ' ').encode('utf-8'))
    return out


def _sentences(documents: Iterable[bytes | str], max_bytes: int):
  """Lines of the documents, as SentencePiece trains on lines; long lines are cut."""
  for doc in documents:
    text = doc.decode('utf-8', errors='replace') if isinstance(doc, bytes) else doc
    for line in text.split('\n'):
      while line:
        yield line[:max_bytes // 4]  # Characters, so the cut is within max_bytes.
        line = line[max_bytes // 4:]


def train_sentencepiece(documents: Iterable[bytes | str], *, vocab_size: int,
                        model_type: str = 'unigram', num_threads: int = 0) -> bytes:
  """Trains a lossless SentencePiece model on `documents` and returns the serialized model.

  Args:
    documents: the training sample.
    vocab_size: number of pieces, including 4 reserved ids and 256 byte-fallback pieces.
    model_type: 'unigram' or 'bpe'.
    num_threads: trainer threads; 0 = all cores.

  Returns:
    The model proto bytes.

  Raises:
    ValueError: empty sample, unusable size or type, or a vocabulary larger than the sample
      supports.
  """
  import io

  import sentencepiece as spm
  if model_type not in ('unigram', 'bpe'):
    raise ValueError(f"data.spm_model_type must be 'unigram' or 'bpe', got {model_type!r}")
  minimum = 4 + 256 + 2  # Reserved ids, byte fallback, and room for the newline piece.
  if vocab_size < minimum:
    raise ValueError(f'data.vocab_size={vocab_size} is too small for a byte-fallback '
                     f'SentencePiece model (at least {minimum})')
  max_bytes = 4192
  sentences = [s for s in _sentences(documents, max_bytes) if s.strip()]
  if not sentences:
    raise ValueError('cannot train SentencePiece: the training sample has no text (empty corpus?)')
  model = io.BytesIO()
  try:
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences), model_writer=model, vocab_size=vocab_size,
        model_type=model_type, pad_id=PAD, bos_id=BOS, eos_id=EOS, unk_id=UNK,
        byte_fallback=True, normalization_rule_name='identity', add_dummy_prefix=False,
        remove_extra_whitespaces=False, split_digits=True, user_defined_symbols=['\n'],
        character_coverage=0.9995, max_sentence_length=max_bytes,
        input_sentence_size=0, shuffle_input_sentence=False,
        num_threads=num_threads or os.cpu_count() or 1, minloglevel=2)
  except RuntimeError as e:
    match = re.search(r'Vocabulary size too high \((\d+)\)\. Please set it to a value <= (\d+)',
                      str(e))
    chars = re.search(r'Vocabulary size is smaller than required_chars\. (\d+) vs (\d+)', str(e))
    if chars:
      raise ValueError(
          f'data.vocab_size={vocab_size} is too small: the sample has {chars.group(2)} distinct '
          f'characters and each needs a piece; raise data.vocab_size above that') from e
    if match:
      raise ValueError(
          f'data.vocab_size={vocab_size} is larger than the sample of {len(sentences)} lines '
          f'supports (at most {match.group(2)} pieces): lower data.vocab_size or raise '
          f'data.spm_sample_docs') from e
    raise ValueError(f'SentencePiece training failed: {e}') from e
  return model.getvalue()


def load_sentencepiece(path: str, vocab_size: int) -> SentencePieceTokenizer:
  """Loads the model at `path` and checks it has `vocab_size` pieces."""
  import tensorflow as tf
  with tf.io.gfile.GFile(path, 'rb') as f:
    proto = f.read()
  try:
    tok = SentencePieceTokenizer(proto, source=path)
  except RuntimeError as e:  # sentencepiece's parse error.
    raise ValueError(f'{path} is not a SentencePiece model: {e}') from e
  if tok.vocab_size != vocab_size:
    raise ValueError(f'the vocabulary file {path} has {tok.vocab_size} pieces but '
                     f'data.vocab_size={vocab_size}: point data.vocab_path elsewhere, delete the '
                     f'file to retrain, or set data.vocab_size={tok.vocab_size}')
  return tok


def get_sentencepiece(path: str, *, vocab_size: int, model_type: str, sample_fn,
                      process_index: int = 0, wait_seconds: float = 3600.0,
                      poll_seconds: float = 2.0) -> SentencePieceTokenizer:
  """The SentencePiece model at `path`, trained there first if it does not exist.

  Process 0 trains on `sample_fn()` and writes the file atomically; other processes wait for
  it. A restart finds the file and reuses it.

  Args:
    path: model file (local or gs://).
    vocab_size: expected number of pieces.
    model_type: 'unigram' or 'bpe'.
    sample_fn: () -> iterable of training documents; called only when training.
    process_index: this host's index.
    wait_seconds: how long other processes wait for process 0's file.
    poll_seconds: how often they look.

  Returns:
    The tokenizer.
  """
  import tensorflow as tf
  if not tf.io.gfile.exists(path):
    if process_index == 0:
      proto = train_sentencepiece(sample_fn(), vocab_size=vocab_size, model_type=model_type)
      directory = os.path.dirname(path)
      if directory:
        tf.io.gfile.makedirs(directory)
      tmp = f'{path}.tmp-{os.getpid()}'
      with tf.io.gfile.GFile(tmp, 'wb') as f:
        f.write(proto)
      tf.io.gfile.rename(tmp, path, overwrite=True)
    else:
      deadline = time.time() + wait_seconds
      while not tf.io.gfile.exists(path):
        if time.time() > deadline:
          raise TimeoutError(f'process {process_index} waited {wait_seconds:.0f} s for process 0 '
                             f'to write the SentencePiece model {path}')
        time.sleep(poll_seconds)
  return load_sentencepiece(path, vocab_size)


def default_vocab_path(workdir: str | None, vocab_size: int, model_type: str) -> str:
  """workdir/vocab/spm_<type>_<size>.model, or a temp path when there is no workdir."""
  base = workdir if workdir else tempfile.gettempdir()
  return os.path.join(base, 'vocab', f'spm_{model_type}_{vocab_size}.model')
