"""Exact resume of the text stream: from data states, and through the training loop."""

import json
import shutil

import jax
import numpy as np
import pytest

import input_pipeline
from training import assembly, checkpoints, train

KEYS = ('inputs', 'targets', 'weights', 'positions', 'segment_ids')
N_BATCHES = 8


def _take(source, n, step=0, state=None):
  """n (batch, state) pairs of source.train_iter(step, state)."""
  it = source.train_iter(step, state)
  return [next(it) for _ in range(n)]


def _same(a, b) -> bool:
  return all(np.array_equal(a[k], b[k]) for k in KEYS)


@pytest.fixture(scope='module')
def local_corpus(tmp_path_factory, kit):
  """A 1,500-byte file (train split: 7 chunks of 200 bytes), so 8 batches span epochs."""
  folder = tmp_path_factory.mktemp('resume_corpus')
  kit.write_corpus(folder, {'small.txt': 1500}, seed=9)
  return str(folder / 'small.txt'), str(tmp_path_factory.mktemp('resume_tfds'))


def _source_config(kind, mode, c4, spm_path, local_corpus, kit):
  # Packed rows cut documents to fill a row when >= 16 tokens fit (resume mid-document).
  extra = {'data.packing': mode, 'data.shuffle_buffer': 4, 'data.pack_min_piece': 16}
  if kind == 'c4':
    # 12 training documents, so 8 batches read the split several times.
    return kit.config({**extra, 'data.data_dir': c4.data_dir, 'data.vocab_path': spm_path,
                       'data.train_split': 'train[:12]'})
  return kit.local_text_config(*local_corpus, {**extra, 'data.chunk_bytes': 200})


@pytest.mark.parametrize('mode', ['packed', 'concat'])
@pytest.mark.parametrize('kind', ['c4', 'local_text'])
def test_train_iter_resumes_from_any_saved_state(kind, mode, c4, spm_path, local_corpus, kit,
                                                 tmp_path):
  config = _source_config(kind, mode, c4, spm_path, local_corpus, kit)
  source = input_pipeline.make_source(config, workdir=str(tmp_path))
  try:
    run = _take(source, N_BATCHES)
    batches, states = [b for b, _ in run], [s for _, s in run]
    for b in batches:
      assert b['inputs'].shape == (config.batch_size, config.seq_len)
      assert np.all(b['weights'].sum(axis=1) > config.seq_len - 16)  # pack_min_piece is used.
    # The stream went past the end of the (small) training split at least once.
    docs_per_epoch = 12 if kind == 'c4' else 7
    assert states[-1]['doc'] > docs_per_epoch
    assert any(s['offset'] > 0 for s in states)  # Some resumes start inside a document.
    # Deterministic: a second uninterrupted run is the same.
    assert all(_same(a, b) for a, (b, _) in zip(batches, _take(source, N_BATCHES)))
    for k in (1, 2, 4, 6):
      saved = json.loads(json.dumps(states[k - 1]))  # As stored in a checkpoint.
      resumed = _take(source, N_BATCHES - k, k, saved)
      for i, (batch, state) in enumerate(resumed):
        assert _same(batch, batches[k + i]), f'batch {k + i} after resuming at {k}'
        assert state == states[k + i]
      # Without the saved state the stream would restart: the test can tell the difference.
      restarted, _ = _take(source, 1, k, None)[0]
      assert not _same(restarted, batches[k])
  finally:
    source.close()


def test_training_resumes_exactly_from_an_earlier_checkpoint(c4, spm_path, kit, tmp_path):
  config = kit.config({'data.data_dir': c4.data_dir, 'data.vocab_path': spm_path,
                       'total_steps': 6, 'checkpoint_every_steps': 3, 'keep_checkpoints': 3})
  workdir = tmp_path / 'run'
  first = train.train_and_evaluate(config, str(workdir))
  assert int(first.step) == 6
  final = jax.tree.map(np.asarray, jax.device_get(first.params))
  ckpt_dir = workdir / 'checkpoints'
  assert sorted(int(p.name) for p in ckpt_dir.iterdir() if p.name.isdigit()) == [3, 6]

  # The data cursor saved at step 3 is where 3 batches of a fresh stream end, and it matters.
  setup = assembly.build(config, devices=jax.devices()[:1], workdir=str(workdir))
  try:
    ckpt = checkpoints.Checkpointer(str(workdir), async_save=False)
    try:
      _, saved = ckpt.restore(setup.abstract_state, step=3, with_data=True)
    finally:
      ckpt.close()
    assert saved['process_count'] == 1
    assert saved['processes'][0]['data_shard'] == [0, 1]
    cursor = saved['processes'][0]['state']
    fresh = _take(setup.data, 4)
    assert cursor == fresh[2][1]
    resumed_batch, _ = _take(setup.data, 1, 3, cursor)[0]
    assert _same(resumed_batch, fresh[3][0])
    restarted_batch, _ = _take(setup.data, 1, 3, None)[0]
    assert not _same(restarted_batch, resumed_batch)
  finally:
    setup.data.close()

  shutil.rmtree(ckpt_dir / '6')
  second = train.train_and_evaluate(config, str(workdir))
  assert int(second.step) == 6
  diff = kit.max_abs_diff(final, jax.tree.map(np.asarray, jax.device_get(second.params)))
  assert diff <= 1e-6
  # Training moved the parameters after step 3, so equality above is not vacuous.
  setup = assembly.build(config, devices=jax.devices()[:1], workdir=str(workdir))
  setup.data.close()
  ckpt = checkpoints.Checkpointer(str(workdir), async_save=False)
  try:
    at_3 = ckpt.restore(setup.abstract_state, step=3)
  finally:
    ckpt.close()
  assert kit.max_abs_diff(final, jax.tree.map(np.asarray, jax.device_get(at_3.params))) > 1e-4
