"""Shard files checked at start, read errors named and saved over, resume entered by arithmetic.

A fake C4 of 4 training shards (30 documents each) is written once; tests that damage it work
on a copy.
"""

import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow_datasets as tfds

import input_pipeline
from input_pipeline import packing, shards, text

REPO = pathlib.Path(__file__).resolve().parents[2]
KEYS = ('inputs', 'targets', 'weights', 'positions', 'segment_ids')
SHARDS, PER_SHARD = 4, 30


class ShardedC4(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """C4's name, version and features; 4 shards per split."""

  name = 'c4'
  VERSION = tfds.core.Version('3.0.1')
  BUILDER_CONFIGS = [tfds.core.BuilderConfig(name='en')]
  TRAIN: list = []
  VALIDATION: list = []

  def _info(self):
    return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(
        {'text': tfds.features.Text(), 'url': tfds.features.Text()}))

  def _split_generators(self, dl_manager):
    del dl_manager
    return {'train': self._generate_examples('train', self.TRAIN),
            'validation': self._generate_examples('validation', self.VALIDATION)}

  def _generate_examples(self, split, docs):
    for i, doc in enumerate(docs):
      yield f'{split}-{i}', {'text': doc, 'url': f'https://example.com/{split}/{i}'}


@pytest.fixture(scope='module')
def sharded(tmp_path_factory, kit):
  """The prepared data_dir (read-only by convention) and its version folder."""
  ShardedC4.TRAIN = kit.make_docs(5, SHARDS * PER_SHARD)
  ShardedC4.VALIDATION = kit.make_docs(6, 12)
  data_dir = tmp_path_factory.mktemp('sharded_tfds')
  ShardedC4(config='en', data_dir=str(data_dir)).download_and_prepare(
      download_config=tfds.download.DownloadConfig(num_shards=SHARDS))
  return data_dir


@pytest.fixture
def damaged(sharded, tmp_path):
  """A copy of the sharded data_dir, and its train shard files in file order."""
  data_dir = tmp_path / 'tfds'
  shutil.copytree(sharded, data_dir)
  version = data_dir / 'c4' / 'en' / '3.0.1'
  return data_dir, sorted(version.glob('c4-train.tfrecord-*'))


def _config(kit, data_dir, spm_path, extra=None):
  return kit.config({'data.data_dir': str(data_dir), 'data.vocab_path': spm_path,
                     'data.pack_min_piece': 16, **(extra or {})})


def _same(a, b) -> bool:
  return all(np.array_equal(a[k], b[k]) for k in KEYS)


def _take(source, n, state=None):
  it = source.train_iter(0, state)
  return [next(it) for _ in range(n)]


def test_metadata_has_the_shards_the_tests_rely_on(sharded):
  builder = tfds.builder('c4/en:3.0.1', data_dir=str(sharded))
  assert builder.info.splits['train'].shard_lengths == [PER_SHARD] * SHARDS
  shards.check_files(builder, 'train', 'train')  # An intact copy passes.


def test_missing_shard_is_an_error_at_start_naming_the_file(damaged, spm_path, kit, tmp_path):
  data_dir, files = damaged
  files[2].unlink()
  with pytest.raises(FileNotFoundError) as e:
    input_pipeline.make_source(_config(kit, data_dir, spm_path), workdir=str(tmp_path))
  message = str(e.value)
  assert str(files[2]) in message and 'c4/en/3.0.1' in message and "'train'" in message


def test_truncated_shard_is_an_error_at_start_naming_the_file(damaged, spm_path, kit, tmp_path):
  data_dir, files = damaged
  data = files[1].read_bytes()
  files[1].write_bytes(data[:len(data) // 2])
  with pytest.raises(input_pipeline.DataError) as e:
    input_pipeline.make_source(_config(kit, data_dir, spm_path), workdir=str(tmp_path))
  assert str(files[1]) in str(e.value) and 'truncated' in str(e.value)
  assert isinstance(e.value, ValueError)  # main.py prints it as one 'error:' line.


def _corrupt_middle(path: pathlib.Path) -> None:
  """Overwrites 64 bytes in the middle of a shard: its size (the start check) is unchanged."""
  data = bytearray(path.read_bytes())
  mid = len(data) // 2
  data[mid:mid + 64] = b'\xa5' * 64
  path.write_bytes(bytes(data))


def test_corrupt_shard_fails_the_read_naming_the_file(damaged, kit):
  data_dir, files = damaged
  _corrupt_middle(files[3])
  builder = tfds.builder('c4/en:3.0.1', data_dir=str(data_dir))
  shards.check_files(builder, 'train', 'train')  # Same size: the start check cannot tell.
  reader = shards.Reader(builder, 'train', text_key='text', seed=0, shuffle=False, window=0)
  docs = reader.documents(0)
  for _ in range(3 * PER_SHARD):  # The three intact shards read fine.
    next(docs)
  with pytest.raises(input_pipeline.DataError) as e:
    for _ in range(PER_SHARD):
      next(docs)
  assert str(files[3]) in str(e.value) and 'record' in str(e.value)


def _env(cache_dir):
  env = dict(os.environ, JAX_PLATFORMS='cpu', TF_CPP_MIN_LOG_LEVEL='2',
             JAX_COMPILATION_CACHE_DIR=str(cache_dir),
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='0',
             JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES='0')
  env['XLA_FLAGS'] = '--xla_force_host_platform_device_count=1'
  return env


def test_read_error_in_training_saves_the_last_step_and_names_the_file(
    damaged, spm_path, kit, tmp_path, compile_cache_dir):
  data_dir, files = damaged
  builder = tfds.builder('c4/en:3.0.1', data_dir=str(data_dir))
  # The shard the training stream reads last in its first epoch (seed 0): damaged. Documents
  # are tokenized 64 at a time, so it is needed some 20 steps in.
  order = shards.Reader(builder, 'train', text_key='text', seed=0, shuffle=True,
                        window=16)._order(0)
  last = pathlib.Path(order[-1].filename)
  _corrupt_middle(last)
  workdir = tmp_path / 'run'
  overrides = {**kit.tiny, 'data.data_dir': str(data_dir), 'data.vocab_path': spm_path,
               'data.pack_min_piece': 16, 'total_steps': 200, 'checkpoint_every_steps': 1000}
  flags_ = [f'--config.{k}={v}' for k, v in overrides.items()]
  proc = subprocess.run(
      [sys.executable, str(REPO / 'main.py'), f'--config={REPO / "configs" / "default.py"}',
       f'--workdir={workdir}', *flags_], env=_env(compile_cache_dir), cwd=REPO,
      capture_output=True, text=True, timeout=300)
  assert proc.returncode == 1, proc.stderr[-3000:]
  error = [line for line in proc.stderr.splitlines() if line.startswith('error:')]
  assert len(error) == 1 and str(last) in error[0] and 'c4/en/3.0.1' in error[0], error
  assert 'Traceback' not in proc.stderr
  saved = sorted(int(p.name) for p in (workdir / 'checkpoints').iterdir() if p.name.isdigit())
  assert len(saved) == 1 and 0 < saved[0] < 200, proc.stderr[-4000:]
  assert f'saved step {saved[0]} before stopping' in proc.stderr
  # The saved input position is where the stream stands after exactly that many batches.
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  with ocp.CheckpointManager(workdir / 'checkpoints') as manager:
    data = manager.restore(saved[0], args=ocp.args.Composite(data=ocp.args.JsonRestore())).data
  config = kit.config({k: v for k, v in overrides.items() if k not in kit.tiny})
  source = input_pipeline.make_source(config, workdir=str(workdir))
  try:
    assert data['processes'][0] == {'data_shard': [0, 1], 'state': _take(source, saved[0])[-1][1]}
  finally:
    source.close()


def test_missing_version_lists_the_versions_present(sharded, spm_path, kit, tmp_path):
  data_dir = tmp_path / 'tfds'
  shutil.copytree(sharded / 'c4' / 'en' / '3.0.1', data_dir / 'c4' / 'en' / '3.1.0')
  (data_dir / 'c4' / 'en' / '2.2.0').mkdir()
  with pytest.raises(FileNotFoundError) as e:
    input_pipeline.make_source(_config(kit, data_dir, spm_path), workdir=str(tmp_path))
  message = str(e.value)
  assert 'versions present' in message and '2.2.0, 3.1.0' in message, message
  assert 'data.tfds_name=c4/en:3.1.0' in message


def test_reader_enters_the_stream_at_any_document(sharded):
  builder = tfds.builder('c4/en:3.0.1', data_dir=str(sharded))
  reader = shards.Reader(builder, 'train', text_key='text', seed=3, shuffle=True, window=16)
  n = reader.epoch_docs
  assert n == SHARDS * PER_SHARD
  it = reader.documents(0)
  full = [next(it) for _ in range(2 * n + 20)]
  # Every epoch is a permutation of the split, and the two epochs differ.
  assert sorted(full[:n]) == sorted(full[n:2 * n]) and full[:n] != full[n:2 * n]
  # Starts at a window edge, inside windows, at and around shard edges, in the second epoch.
  for start in (1, 15, 16, 29, 30, 31, 47, 61, 119, 120, 137, 2 * n):
    it = reader.documents(start)
    assert [next(it) for _ in range(20)] == full[start:start + 20], start
  # A position 10^7 epochs on costs no more than one window: nothing before it is read.
  far = 10**7 * n + 45
  t0 = time.perf_counter()
  it = reader.documents(far)
  got = [next(it) for _ in range(5)]
  assert time.perf_counter() - t0 < 5
  it = reader.documents(far - 45)
  assert [next(it) for _ in range(50)][45:] == got


@pytest.mark.parametrize('mode', ['packed', 'stream'])
def test_source_resumes_exactly_across_shards(mode, sharded, spm_path, kit, tmp_path):
  config = _config(kit, sharded, spm_path, {'data.packing': mode})
  source = input_pipeline.make_source(config, workdir=str(tmp_path))
  try:
    run = _take(source, 64)
    batches, states = [b for b, _ in run], [s for _, s in run]
    assert all(s['order'] == shards.ORDER_VERSION for s in states)
    first_unread = [s['doc'] if mode == 'packed' else s['next'] for s in states]
    assert first_unread[-1] > SHARDS * PER_SHARD  # Past the first epoch (all shards).
    ks = (3, 17, 29, 41, 53, 61)
    # The resume points lie in several shards of the epoch order, and in two epochs.
    assert len({first_unread[k - 1] // PER_SHARD for k in ks}) >= 4
    for k in ks:
      saved = json.loads(json.dumps(states[k - 1]))
      resumed = _take(source, 3, saved)
      for i, (batch, state) in enumerate(resumed):
        assert _same(batch, batches[k + i]), (k, i)
        assert state == states[k + i]
  finally:
    source.close()


def test_source_splits_across_processes_resume_exactly(sharded, spm_path, kit, tmp_path):
  config = _config(kit, sharded, spm_path)
  source = input_pipeline.make_source(config, process_index=1, process_count=2,
                                      workdir=str(tmp_path))
  try:
    run = _take(source, 16)
    for k in (5, 13):
      batch, state = _take(source, 1, run[k - 1][1])[0]
      assert _same(batch, run[k][0]) and state == run[k][1]
  finally:
    source.close()


def test_state_of_older_runs_resumes_in_the_older_order(c4, spm_path, kit, tmp_path):
  config = kit.config({'data.data_dir': c4.data_dir, 'data.vocab_path': spm_path,
                       'data.train_split': 'train[:40]', 'data.pack_min_piece': 16})
  source = input_pipeline.make_source(config, workdir=str(tmp_path))
  builder = text.make_builder(config.data)
  tok = __import__('input_pipeline.tokenizers', fromlist=['x']).load_sentencepiece(
      spm_path, kit.spm_vocab)
  old = text.train_batches(builder, tok, config.data, split='train[:40]', seq_len=config.seq_len,
                           rows_per_batch=config.batch_size, seed=config.seed,
                           cursor=packing.Cursor(), legacy=True)
  try:
    legacy = [next(old) for _ in range(8)]
    saved = json.loads(json.dumps(legacy[4][1].__dict__))  # {'doc', 'offset'}: no 'order'.
    resumed = _take(source, 3, saved)
    for i, (batch, state) in enumerate(resumed):
      assert _same(batch, legacy[5 + i][0])
      assert state == legacy[5 + i][1].__dict__  # Still the older order's cursor.
    assert not _same(_take(source, 6)[5][0], legacy[5][0])  # The new order differs.
  finally:
    source.close()


def test_eval_read_error_names_the_dataset_split_and_position(damaged, kit):
  data_dir, files = damaged
  builder = tfds.builder('c4/en:3.0.1', data_dir=str(data_dir))
  assert len(list(text.documents(builder, 'train'))) == SHARDS * PER_SHARD
  _corrupt_middle(files[0])
  with pytest.raises(input_pipeline.DataError) as e:  # TFDS's reader: the file is not known.
    list(text.documents(builder, 'train'))
  assert 'c4/en/3.0.1' in str(e.value) and "split 'train'" in str(e.value), str(e.value)
  assert 'documents of the stream' in str(e.value)
