"""Tests for input_pipeline.local_text: byte-exact splits, fingerprints, byte-level training."""

import math
import os

import numpy as np
import pytest
import tensorflow_datasets as tfds

from input_pipeline import local_text
from training import evaluation, train


def _split_bytes(builder) -> dict[str, list[bytes]]:
  """Every split's examples, in stored order."""
  return {split: [ex['text'] for ex in tfds.as_numpy(builder.as_dataset(split=split))]
          for split in builder.info.splits}


def _is_utf8(data: bytes) -> bool:
  try:
    data.decode('utf-8')
  except UnicodeDecodeError:
    return False
  return True


def test_byte_ranges_cut_90_5_5():
  assert local_text.byte_ranges(100_000_000, 0.05, 0.05) == {
      'train': (0, 90_000_000), 'validation': (90_000_000, 95_000_000),
      'test': (95_000_000, 100_000_000)}
  assert local_text.byte_ranges(1001, 0.1, 0.0) == {'train': (0, 901), 'validation': (901, 1001)}


def test_single_file_splits_are_disjoint_and_complete(tmp_path, kit):
  data = kit.write_corpus(tmp_path / 'corpus', {'book.txt': 20_000})['book.txt']
  config = kit.local_text_config(str(tmp_path / 'corpus' / 'book.txt'), str(tmp_path / 'tfds'),
                                 {'data.chunk_bytes': 700})
  builder = local_text.prepare(config.data)
  assert builder.info.full_name.startswith('local_text/local_')
  splits = _split_bytes(builder)
  assert sorted(splits) == ['test', 'train', 'validation']
  joined = {s: b''.join(chunks) for s, chunks in splits.items()}
  assert {s: len(b) for s, b in joined.items()} == {
      'train': 18_000, 'validation': 1_000, 'test': 1_000}
  assert joined['train'] + joined['validation'] + joined['test'] == data
  for split, chunks in splits.items():
    assert all(697 <= len(c) <= 700 for c in chunks[:-1]) and len(chunks[-1]) <= 700
    assert builder.info.splits[split].num_examples == len(chunks)
  # Chunk edges move back to a character start: every chunk is whole UTF-8, and at least
  # one edge had to move (the corpus puts multi-byte characters across the 700-byte marks).
  assert all(_is_utf8(c) for chunks in splits.values() for c in chunks)
  assert any(len(c) < 700 for chunks in splits.values() for c in chunks[:-1])


def test_many_files_land_in_exactly_one_split(tmp_path, kit):
  rs = np.random.RandomState(4)
  names = [f'{d}/doc{i:02d}.txt' for i, d in enumerate(
      rs.choice(['a', 'b/c', 'b/d/e'], 30))]
  files = kit.write_corpus(tmp_path / 'corpus',
                           {n: int(rs.randint(100, 1500)) for n in names}, seed=5)
  extra = {'data.chunk_bytes': 512, 'data.validation_fraction': 0.2, 'data.test_fraction': 0.2}
  pattern = ','.join(str(tmp_path / 'corpus' / d / '*.txt') for d in ('a', 'b/c', 'b/d/e'))
  config = kit.local_text_config(pattern, str(tmp_path / 'tfds'), extra)
  builder = local_text.prepare(config.data)
  joined = {s: b''.join(chunks) for s, chunks in _split_bytes(builder).items()}
  assert sorted(joined) == ['test', 'train', 'validation']
  assert all(joined.values())
  assert sum(len(b) for b in joined.values()) == sum(len(b) for b in files.values())
  home = {}
  for name, data in files.items():
    found = [s for s, b in joined.items() if data in b]
    assert len(found) == 1, (name, found)
    home[name] = found[0]
    # The split is the stable hash of the path relative to the common folder.
    assert found[0] == local_text.split_of(name, 0.2, 0.2)
  assert set(home.values()) == {'train', 'validation', 'test'}

  # A new file prepares a new dataset and moves no other file between splits.
  files.update(kit.write_corpus(tmp_path / 'corpus', {'b/c/new.txt': 300}, seed=6))
  builder2 = local_text.prepare(config.data)
  assert builder2.builder_config.name != builder.builder_config.name
  joined2 = {s: b''.join(chunks) for s, chunks in _split_bytes(builder2).items()}
  assert sum(len(b) for b in joined2.values()) == sum(len(b) for b in files.values())
  for name, split in home.items():
    assert files[name] in joined2[split]
  assert sum(files['b/c/new.txt'] in b for b in joined2.values()) == 1


def test_fingerprint_follows_the_files(tmp_path, kit):
  files = kit.write_corpus(tmp_path / 'corpus', {'x.txt': 3000, 'y.txt': 2000}, seed=1)
  paths = [str(tmp_path / 'corpus' / n) for n in sorted(files)]

  def name(**kw):
    return local_text.LocalTextConfig(corpus='My Corpus!', files=paths, **kw).name

  first = name()
  assert first.startswith('my_corpus__') and len(first) == len('my_corpus__') + 12
  assert name() == first  # Stable for unchanged files.
  assert name(validation_fraction=0.1) != first
  assert name(chunk_bytes=100) != first
  stat = os.stat(paths[0])
  os.utime(paths[0], ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
  touched = name()
  assert touched != first
  with open(paths[1], 'ab') as f:
    f.write(b'one more line\n')
  appended = name()
  assert appended not in (first, touched)

  # prepare() reads the changed file, not the dataset prepared before the change.
  config = kit.local_text_config(str(tmp_path / 'corpus' / 'y.txt'), str(tmp_path / 'tfds'),
                                 {'data.chunk_bytes': 10_000})
  before = b''.join(b''.join(c) for c in _split_bytes(local_text.prepare(config.data)).values())
  with open(paths[1], 'ab') as f:
    f.write('and a last one: ünïcode\n'.encode())
  os.utime(paths[1], ns=(stat.st_atime_ns, stat.st_mtime_ns + 2 * 10**9))
  builder = local_text.prepare(config.data)
  after = _split_bytes(builder)
  assert b''.join(after['train'] + after['validation'] + after['test']) == (
      tmp_path / 'corpus' / 'y.txt').read_bytes()
  assert len(b''.join(b''.join(c) for c in after.values())) > len(before)


def test_local_text_trains_end_to_end_with_bytes(tmp_path, kit):
  data = kit.write_corpus(tmp_path / 'corpus', {'enwik_like.txt': 12_000}, seed=2)
  path = str(tmp_path / 'corpus' / 'enwik_like.txt')
  config = kit.local_text_config(path, str(tmp_path / 'tfds'), {
      'total_steps': 3, 'eval_every_steps': 3, 'checkpoint_every_steps': 3,
      'data.chunk_bytes': 1000})
  workdir = tmp_path / 'workdir'
  state = train.train_and_evaluate(config, str(workdir))
  assert int(state.step) == 3
  assert not (workdir / 'vocab').exists()  # The byte tokenizer needs no vocabulary file.
  result = evaluation.evaluate_checkpoint(config, str(workdir))
  assert result['step'] == 3
  assert np.isfinite(result['loss']) and 0 < result['loss'] < 2 * np.log(400)
  # Whole validation split (eval_steps=0): every byte of it is scored once, plus one EOS
  # target per stored chunk.
  lo, hi = local_text.byte_ranges(len(data['enwik_like.txt']), 0.05, 0.05)['validation']
  assert result['scored_bytes'] == hi - lo == 600
  assert result['scored_tokens'] == (hi - lo) + math.ceil((hi - lo) / 1000)
  assert result['bits_per_byte'] == pytest.approx(
      result['loss'] * result['scored_tokens'] / np.log(2) / result['scored_bytes'], rel=1e-9)


def test_sentencepiece_scores_each_file_byte_once(tmp_path, kit, spm_path):
  """bits per byte stays exact with SentencePiece, even where chunk edges cut characters."""
  import input_pipeline  # pylint: disable=import-outside-toplevel
  rs = np.random.RandomState(3)
  text = ' '.join(rs.choice(['naïve', 'café', '日本語', 'Ωμέγα', 'kalo', '😀'], 3000))
  path = tmp_path / 'multibyte.txt'
  path.write_bytes(text.encode())
  config = kit.local_text_config(str(path), str(tmp_path / 'tfds'), {
      'data.tokenizer': 'sentencepiece', 'data.vocab_path': spm_path, 'data.chunk_bytes': 97})
  source = input_pipeline.make_source(config)
  lo, hi = local_text.byte_ranges(len(text.encode()), 0.05, 0.05)['validation']
  valid = text.encode()[lo:hi]
  assert sum(not _is_utf8(valid[i:i + 97]) for i in range(0, len(valid), 97)) > 5
  scored = sum(float((source.token_bytes[b['targets']] * b['weights']).sum())
               for b in source.eval_batches())
  assert scored == hi - lo
