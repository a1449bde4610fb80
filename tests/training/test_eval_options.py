"""--mode=eval's options (training/evaluation.py): checkpoint step, split, whole split, bits per
byte, and sliding windows over whole documents, on one tiny byte-level model trained here.

The corpus is a few dozen small local files (local_text, many-files layout: each file is one
document of one split, by a hash of its name), so every count is checked against the files
themselves, not against the pipeline.
"""

import json
import math
import pathlib

import jax
import numpy as np
import pytest

from configs import local_text as local_text_recipe
from input_pipeline import local_text
from training import assembly, evaluation, steps, train

VALIDATION_FRACTION = TEST_FRACTION = 0.3
SEQ_LEN = 128  # Also model.max_len; every document is shorter than a row.

# A d=1 byte-level model on rows of 128, trained 4 steps, checkpoints at steps 2 and 4.
OVERRIDES = {
    'peak_tflops_per_device': 1.0,
    'model.d': 1,
    'model.dtype': 'float32',
    'model.max_len': SEQ_LEN,
    'seq_len': SEQ_LEN,
    'batch_size': 4,
    'total_steps': 4,
    'warmup_steps': 1,
    'learning_rate': 0.01,
    'log_every_steps': 2,
    'eval_every_steps': 0,
    'eval_steps': 0,
    'eval_batch_size': 4,
    'checkpoint_every_steps': 2,
    'keep_checkpoints': 3,
    'async_checkpointing': False,
    'loss_chunk_len': 0,
    'data.validation_fraction': VALIDATION_FRACTION,
    'data.test_fraction': TEST_FRACTION,
    'data.shuffle_buffer': 8,
    'data.prefetch_batches': 1,
}


def make_config(corpus, extra=None):
  config = local_text_recipe.get_config()
  config.update_from_flattened_dict({
      **OVERRIDES, 'data.files': str(corpus['folder'] / '*.txt'),
      'data.data_dir': str(corpus['tfds']), **(extra or {})})
  return config


@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
  """36 files of 20-100 bytes (some non-ASCII) and their splits, computed from the names."""
  root = tmp_path_factory.mktemp('eval_options')
  folder = root / 'corpus'
  folder.mkdir()
  rs = np.random.RandomState(0)
  words = ['ka', 'lo', 'mi', 'ne', 'ru', 'tor', 'qua', 'fen', 'café', 'Zürich', '日本']
  splits = {'train': [], 'validation': [], 'test': []}
  for i in range(36):
    text = ' '.join(rs.choice(words, 40)).encode()[:rs.randint(20, 101)]
    name = f'doc{i:02d}.txt'
    (folder / name).write_bytes(text)
    splits[local_text.split_of(name, VALIDATION_FRACTION, TEST_FRACTION)].append(text)
  assert all(len(docs) >= 4 for docs in splits.values()), {k: len(v) for k, v in splits.items()}
  return {'folder': folder, 'tfds': root / 'tfds', 'splits': splits}


@pytest.fixture(scope='module')
def workdir(corpus, tmp_path_factory):
  path = tmp_path_factory.mktemp('run') / 'run'
  train.train_and_evaluate(make_config(corpus), str(path))
  assert sorted(int(p.name) for p in (path / 'checkpoints').iterdir() if p.name.isdigit()) == [2, 4]
  return path


def _evaluate(corpus, workdir, extra=None):
  return evaluation.evaluate_checkpoint(make_config(corpus, extra), str(workdir))


def _json(workdir, name):
  return json.loads((pathlib.Path(workdir) / name).read_text())


def test_a_chosen_step_and_split_write_their_own_json(corpus, workdir):
  latest = _evaluate(corpus, workdir)
  assert latest['step'] == 4 and latest['split'] == 'validation' and latest['whole_split']
  assert _json(workdir, 'eval_step_4.json') == latest
  at_2 = _evaluate(corpus, workdir, {'eval_checkpoint_step': 2, 'data.eval_split': 'test'})
  at_4 = _evaluate(corpus, workdir, {'eval_checkpoint_step': 4, 'data.eval_split': 'test'})
  for result, step in ((at_2, 2), (at_4, 4)):
    assert _json(workdir, f'eval_step_{step}_test.json') == result
    assert {'step', 'split', 'whole_split', 'loss', 'perplexity', 'accuracy', 'scored_tokens',
            'scored_bytes', 'bits_per_byte'} <= set(result), result
    assert (result['step'], result['split'], result['whole_split']) == (step, 'test', True)
    assert 'window' not in result
  assert at_2['loss'] != at_4['loss']
  assert at_4['loss'] != latest['loss']  # Another split.
  assert at_4['scored_tokens'] == sum(len(d) + 1 for d in corpus['splits']['test'])
  # A fixed number of batches is not the whole split.
  first = _evaluate(corpus, workdir, {'eval_steps': 1, 'data.eval_split': 'test'})
  assert not first['whole_split'] and first['scored_tokens'] < at_4['scored_tokens']


def test_file_names_say_split_and_window():
  opts = evaluation.Options(split='validation', whole_split=True)
  assert opts.filename(7) == 'eval_step_7.json'
  assert evaluation.Options('test', True, 64, 32).filename(7) == 'eval_step_7_test_window64_stride32.json'
  assert evaluation.Options('validation', False, 8, 8).filename(3) == 'eval_step_3_window8_stride8.json'
  names = {evaluation.split_tag(s) for s in ('test[:10]', 'test[10:]', 'test[:10%]', 'train+test')}
  assert len(names) == 4 and all('/' not in n and '[' not in n for n in names)


def test_a_missing_step_names_the_saved_ones(corpus, workdir):
  with pytest.raises(FileNotFoundError, match=r'no checkpoint step 3 .*saved steps: 2, 4'):
    _evaluate(corpus, workdir, {'eval_checkpoint_step': 3})


def test_an_unknown_split_names_the_splits(corpus, no_compute, tmp_path):
  with pytest.raises(ValueError, match=r"data\.eval_split='valid': local_text/.* has splits "
                                       r"\['test', 'train', 'validation'\]"):
    _evaluate(corpus, tmp_path / 'run', {'data.eval_split': 'valid'})


def test_a_synthetic_task_only_has_its_validation_stream(no_compute, harness, tmp_path):
  with pytest.raises(ValueError, match=r"synthetic task 'variable_assignment' has no splits.*"
                                       r"data\.eval_split='validation'"):
    evaluation.evaluate_checkpoint(harness.config({'data.eval_split': 'test'}),
                                   str(tmp_path / 'run'))
  with pytest.raises(ValueError, match='has no finite split'):
    evaluation.evaluate_checkpoint(harness.config({'eval_steps': 0}), str(tmp_path / 'run'))


def test_whole_split_scores_every_token_and_bits_per_byte(corpus, workdir):
  result = _evaluate(corpus, workdir)
  docs = corpus['splits']['validation']
  # Byte tokens: each document is [BOS] + its bytes + [EOS]; every token after BOS is scored.
  assert result['scored_tokens'] == sum(len(d) + 1 for d in docs)
  assert result['scored_bytes'] == sum(len(d) for d in docs)
  loss_sum = result['loss'] * result['scored_tokens']
  assert result['bits_per_byte'] == pytest.approx(
      loss_sum / math.log(2) / sum(len(d) for d in docs), rel=1e-9)
  assert result['perplexity'] == pytest.approx(math.exp(result['loss']), rel=1e-9)


@pytest.mark.parametrize('window, stride', [(1, 1), (5, 5), (8, 3), (8, 1), (16, 8), (16, 15)])
def test_windows_score_every_target_once_with_enough_context(window, stride):
  assert evaluation.windows(1, window, stride) == []  # A document of BOS alone has no target.
  for length in range(2, 60):
    seen = []
    for start, n, first in evaluation.windows(length, window, stride):
      assert 0 < n <= window and start + n <= length - 1 and 0 <= first < n
      for j in range(first, n):
        target = start + j + 1
        seen.append(target)
        assert j + 1 >= min(window - stride + 1, target)  # Inputs the prediction sees.
    assert sorted(seen) == seen == list(range(1, length))


def test_a_window_longer_than_every_document_equals_the_packed_rows(corpus, workdir):
  packed = _evaluate(corpus, workdir)
  windowed = _evaluate(corpus, workdir, {'eval_window': SEQ_LEN, 'eval_stride': SEQ_LEN})
  assert _json(workdir, f'eval_step_4_window{SEQ_LEN}_stride{SEQ_LEN}.json') == windowed
  docs = corpus['splits']['validation']
  assert (windowed['window'], windowed['stride']) == (SEQ_LEN, SEQ_LEN)
  assert windowed['documents'] == windowed['windows'] == len(docs)
  for key in ('scored_tokens', 'scored_bytes'):
    assert windowed[key] == packed[key]
  for key in ('loss', 'accuracy', 'bits_per_byte'):
    assert windowed[key] == pytest.approx(packed[key], rel=1e-5), key


def test_short_windows_score_every_token_once(corpus, workdir):
  result = _evaluate(corpus, workdir, {'eval_window': 16, 'data.eval_split': 'test'})
  docs = corpus['splits']['test']
  assert result['stride'] == 8 and result['whole_split'] and result['split'] == 'test'
  assert result['scored_tokens'] == sum(len(d) + 1 for d in docs)
  assert result['scored_bytes'] == sum(len(d) for d in docs)
  assert result['documents'] == len(docs)
  assert result['windows'] == sum(1 + math.ceil(max(len(d) + 1 - 16, 0) / 8) for d in docs)
  assert (pathlib.Path(workdir) / 'eval_step_4_test_window16_stride8.json').exists()


def test_window_losses_equal_a_forward_per_window_by_hand(corpus, workdir):
  """A 41-token document (40 targets), W = 16, S = 5: targets 1-16 from the window at 0, then
  17-21 (start 5), 22-26 (10), 27-31 (15), 32-36 (20), and 37-40 from the last window, which
  ends at the document's end (start 24)."""
  config = make_config(corpus, {'eval_window': 16, 'eval_stride': 5})
  setup = assembly.build(config, devices=jax.devices()[:1])
  step, params = assembly.latest_params(setup, str(workdir), required='trained above')
  assert step == 4
  tokens = np.concatenate([[1], np.random.RandomState(3).randint(3, 259, 39), [2]]).astype(np.int32)
  opts = evaluation.options(setup)
  result = evaluation.score_windows(setup, steps.jit_eval_step(setup), params, opts,
                                    documents=[tokens])
  assert result['scored_tokens'] == 40 and result['windows'] == 6 and result['documents'] == 1

  by_hand = [(0, range(1, 17)), (5, range(17, 22)), (10, range(22, 27)), (15, range(27, 32)),
             (20, range(32, 37)), (24, range(37, 41))]
  loss_sum, targets = 0.0, []
  for start, scored in by_hand:
    inputs = tokens[start:start + 16][None]
    logits = setup.model.apply({'params': params}, inputs, deterministic=True)
    z = np.asarray(logits[0], np.float64)
    logp = z - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)) - z.max(
        -1, keepdims=True)
    for target in scored:
      loss_sum -= logp[target - start - 1, tokens[target]]
      targets.append(target)
  assert targets == list(range(1, 41))
  assert result['loss'] * result['scored_tokens'] == pytest.approx(loss_sum, rel=1e-5)


@pytest.mark.parametrize('extra, message', [
    ({'eval_window': SEQ_LEN + 1}, r'eval_window=129 is longer than the position table '
                                   r'\(model\.max_len=128\)'),
    ({'eval_window': 16, 'eval_stride': 17}, r'eval_stride=17 is larger than eval_window=16'),
    ({'eval_window': -4}, r'must be >= 0'),
    ({'eval_stride': 4}, r'eval_stride=4 needs a sliding window'),
    ({'eval_window': 16, 'model.attention': 'txl', 'model.position_embedding': 'none',
      'data.packing': 'stream'}, r'txl attention carries segment memory'),
], ids=['longer_than_max_len', 'stride_over_window', 'negative', 'stride_alone', 'txl'])
def test_bad_windows_are_refused_before_any_compute(corpus, no_compute, tmp_path, extra,
                                                    message):
  with pytest.raises(ValueError, match=message):
    _evaluate(corpus, tmp_path / 'run', extra)


def test_a_window_on_a_synthetic_task_is_refused(no_compute, harness, tmp_path):
  with pytest.raises(ValueError, match=r"eval_window needs text documents; "
                                       r"data\.name='variable_assignment'"):
    evaluation.evaluate_checkpoint(harness.config({'eval_window': 8}), str(tmp_path / 'run'))


def test_eval_documents_are_whole(corpus, tmp_path):
  """Many files: one document per file of the split. One file (enwik8 style): the split's
  stretch of the file is one document, however many chunks it is stored as."""
  import input_pipeline  # pylint: disable=import-outside-toplevel
  source = input_pipeline.make_source(make_config(corpus))
  docs = [bytes((d[1:-1] - 3).astype(np.uint8)) for d in source.eval_documents()]
  assert all(d[0] == 1 and d[-1] == 2 for d in source.eval_documents())
  assert sorted(docs) == sorted(corpus['splits']['validation'])
  book = tmp_path / 'book.txt'
  book.write_bytes(b''.join(corpus['splits']['train']) * 4)
  size = book.stat().st_size
  config = make_config(corpus, {'data.files': str(book), 'data.chunk_bytes': 100,
                                'data.data_dir': str(tmp_path / 'tfds')})
  [tokens] = list(input_pipeline.make_source(config).eval_documents())
  lo, hi = local_text.byte_ranges(size, VALIDATION_FRACTION, TEST_FRACTION)['validation']
  assert hi - lo > 300  # Several chunks.
  assert tokens[0] == 1 and tokens[-1] == 2
  assert bytes((tokens[1:-1] - 3).astype(np.uint8)) == book.read_bytes()[lo:hi]


def test_main_eval_options_from_the_command_line(corpus, workdir, harness, tmp_path):
  """Only --workdir, --mode and the eval flags: the model and data come from the run's record."""
  import shutil  # pylint: disable=import-outside-toplevel
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  copy = tmp_path / 'run'
  shutil.copytree(workdir, copy)

  def main(*flags):
    return subprocess.run([sys.executable, str(harness.repo / 'main.py'), f'--workdir={copy}',
                           '--mode=eval', *flags], env=harness.env(), cwd=harness.repo,
                          capture_output=True, text=True, timeout=300)

  proc = main('--config.eval_checkpoint_step=2', '--config.data.eval_split=test',
              '--config.eval_window=16', '--config.eval_stride=4')
  assert proc.returncode == 0, proc.stderr[-3000:]
  result = _json(copy, 'eval_step_2_test_window16_stride4.json')
  assert (result['step'], result['split'], result['window'], result['stride']) == (2, 'test', 16, 4)
  assert result['scored_tokens'] == sum(len(d) + 1 for d in corpus['splits']['test'])
  proc = main('--config.data.eval_split=dev')
  assert proc.returncode == 1
  assert "data.eval_split='dev'" in proc.stderr and "['test', 'train', 'validation']" in proc.stderr
