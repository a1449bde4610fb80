"""End to end on a fake C4: TFDS read-back, SentencePiece in the workdir, train, eval, reuse."""

import json
import math
import os

import numpy as np
import pytest
import tensorflow_datasets as tfds

from input_pipeline import tokenizers
from training import evaluation, metrics as metrics_lib
from training import train

STEPS = 4
RUN = {'total_steps': STEPS, 'eval_every_steps': STEPS, 'eval_steps': 0,
       'checkpoint_every_steps': 2, 'keep_checkpoints': 3}


def test_fake_c4_reads_back_through_tfds(c4):
  builder = tfds.builder('c4/en:3.0.1', data_dir=c4.data_dir)
  assert builder.is_prepared()
  assert {s: builder.info.splits[s].num_examples for s in builder.info.splits} == {
      'train': len(c4.train), 'validation': len(c4.validation)}
  for split, docs in (('train', c4.train), ('validation', c4.validation)):
    examples = list(tfds.as_numpy(builder.as_dataset(split=split)))
    assert sorted(ex['text'].decode() for ex in examples) == sorted(docs)
    assert all(ex['url'].startswith(f'https://example.com/{split}/'.encode()) for ex in examples)
    assert all(ex['timestamp'].startswith(b'2019-04-') for ex in examples)


@pytest.fixture(scope='module')
def c4_run(c4, tmp_path_factory, kit):
  """Trains STEPS steps from scratch, evaluates, then runs again to STEPS + 2 in the same
  workdir; returns what each stage left behind."""
  workdir = tmp_path_factory.mktemp('c4_run')
  config = kit.config({'data.data_dir': c4.data_dir, **RUN})
  vocab = workdir / 'vocab' / f'spm_unigram_{kit.spm_vocab}.model'
  out = {'workdir': workdir, 'config': config, 'vocab': vocab, 'vocab_before': vocab.exists()}
  logged = []
  spm_calls = []
  real_write, real_train_spm = metrics_lib.MetricLogger.write, tokenizers.train_sentencepiece

  def spy_write(self, step, scalars, prefix='train'):
    logged.append((prefix, step, dict(scalars)))
    return real_write(self, step, scalars, prefix)

  def spy_train_spm(*args, **kwargs):
    spm_calls.append(kwargs.get('vocab_size'))
    return real_train_spm(*args, **kwargs)

  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(metrics_lib.MetricLogger, 'write', spy_write)
    mp.setattr(tokenizers, 'train_sentencepiece', spy_train_spm)
    out['state'] = train.train_and_evaluate(config, str(workdir))
    out['logged'], logged = logged, []
    out['spm_calls'], spm_calls = spm_calls, []
    out['vocab_bytes'], out['vocab_mtime'] = vocab.read_bytes(), os.stat(vocab).st_mtime_ns
    out['eval'] = evaluation.evaluate_checkpoint(config, str(workdir))
    out['eval_json'] = json.loads((workdir / f'eval_step_{STEPS}.json').read_text())
    rerun = kit.config({'data.data_dir': c4.data_dir, **RUN, 'total_steps': STEPS + 2})
    out['rerun_state'] = train.train_and_evaluate(rerun, str(workdir))
    out['rerun_logged'], out['rerun_spm_calls'] = logged, spm_calls
  return out


def test_sentencepiece_model_is_trained_into_the_workdir(c4_run, c4, kit):
  assert not c4_run['vocab_before']
  assert c4_run['spm_calls'] == [kit.spm_vocab]
  assert os.listdir(c4_run['workdir'] / 'vocab') == [c4_run['vocab'].name]
  tok = tokenizers.load_sentencepiece(str(c4_run['vocab']), kit.spm_vocab)
  for doc in c4.validation:
    assert tok.decode(tok.encode_batch([doc])[0]) == doc


def test_training_loss_is_finite_and_logged_every_step(c4_run, kit):
  assert int(c4_run['state'].step) == STEPS
  train_logs = [(step, s) for prefix, step, s in c4_run['logged'] if prefix == 'train']
  assert [step for step, _ in train_logs] == list(range(1, STEPS + 1))
  losses = [s['loss'] for _, s in train_logs]
  assert all(np.isfinite(losses))
  # Near ln(vocab) at the start (the model is untrained), never wildly off.
  assert abs(losses[0] - math.log(kit.spm_vocab)) < 1.5
  assert all(0 < loss < 2 * math.log(kit.spm_vocab) for loss in losses)
  # Saved every 2 steps (the second run added step 6).
  assert sorted(int(p.name) for p in (c4_run['workdir'] / 'checkpoints').iterdir()
                if p.name.isdigit()) == [2, 4, STEPS + 2]


def test_evaluate_writes_loss_perplexity_accuracy_and_bits_per_byte(c4_run, c4):
  result = c4_run['eval']
  assert result == c4_run['eval_json']
  assert {'step', 'loss', 'perplexity', 'accuracy', 'bits_per_byte'} <= set(result)
  assert result['step'] == STEPS
  assert np.isfinite(result['loss']) and result['loss'] > 0
  assert result['perplexity'] == pytest.approx(math.exp(result['loss']), rel=1e-9)
  assert 0 <= result['accuracy'] <= 1
  # The whole validation split is scored: every pair of every document, and each byte of
  # text once (the SentencePiece model is lossless).
  tok = tokenizers.load_sentencepiece(str(c4_run['vocab']), 400)
  assert result['scored_tokens'] == sum(len(t) - 1 for t in tok.encode_batch(c4.validation))
  assert result['scored_bytes'] == sum(len(d.encode('utf-8')) for d in c4.validation)
  # bits per byte = loss sum / ln 2 / bytes.
  assert result['bits_per_byte'] * result['scored_bytes'] * math.log(2) == pytest.approx(
      result['loss'] * result['scored_tokens'], rel=1e-9)
  assert 0 < result['bits_per_byte'] < result['loss'] / math.log(2)
  # The evaluation at the end of training saw the same parameters and batches.
  evals = [(step, s) for prefix, step, s in c4_run['logged'] if prefix == 'eval']
  assert [step for step, _ in evals] == [STEPS]
  for key in ('loss', 'accuracy', 'bits_per_byte', 'scored_tokens', 'scored_bytes'):
    assert evals[0][1][key] == pytest.approx(result[key], rel=1e-6), key


def test_second_run_reuses_the_vocabulary_file(c4_run):
  assert c4_run['rerun_spm_calls'] == []
  assert c4_run['vocab'].read_bytes() == c4_run['vocab_bytes']
  assert os.stat(c4_run['vocab']).st_mtime_ns == c4_run['vocab_mtime']
  assert int(c4_run['rerun_state'].step) == STEPS + 2
  steps = [step for prefix, step, _ in c4_run['rerun_logged'] if prefix == 'train']
  assert steps == [STEPS + 1, STEPS + 2]  # Resumed, not restarted.
