"""The universal stack with ACT in the real training loop: the steps are logged and counted in
the MFU, evaluation may allow more steps than training, and --mode=inspect draws the steps per
token. (A resumed run equals an uninterrupted one: tests/contracts/test_resume_contract.py.)"""

import json

import numpy as np
import pytest

from configs import default
from training import assembly, attention_maps, evaluation, metrics, train


def _config(total_steps, **model):
  config = default.get_config()
  config.model.update(d=0, d_model=32, n_heads=2, vocab_size=0, max_len=0, dtype='float32',
                      position_embedding='none', stack='universal', dropout_rate=0.1, **model)
  config.model.stack_options.update(act=True, max_steps=3, ponder=0.05)
  config.data.name = 'parity'
  config.data.num_bits = 8
  config.update(batch_size=8, total_steps=total_steps, warmup_steps=2, log_every_steps=2,
                eval_every_steps=0, eval_steps=2, checkpoint_every_steps=3,
                peak_tflops_per_device=1.0, async_checkpointing=False)
  return config


def test_steps_are_logged_and_counted_in_the_mfu(tmp_path, monkeypatch):
  written = []
  original = metrics.MetricLogger.write

  def record(self, step, scalars, prefix='train'):
    written.append((prefix, dict(scalars)))
    return original(self, step, scalars, prefix)

  monkeypatch.setattr(metrics.MetricLogger, 'write', record)
  config = _config(4)
  train.train_and_evaluate(config, str(tmp_path))
  logged = [s for prefix, s in written if prefix == 'train']
  assert logged
  for scalars in logged:
    steps = scalars['act_steps/universal']
    assert 1.0 <= steps <= 3.0
    assert steps <= scalars['ponder/universal'] <= steps + 1.0
    assert sum(scalars[f'halted_at_{k}/universal'] for k in (1, 2, 3)) == pytest.approx(1.0)
    assert scalars['aux_loss'] == pytest.approx(0.05 * scalars['ponder/universal'], rel=1e-4)
    # The MFU counts the mean steps taken, not the cap.
    setup = assembly.build(config, workdir=str(tmp_path))
    flops = setup.model_config.train_flops_per_token(setup.data.seq_len, scalars)
    assert scalars['mfu'] == pytest.approx(scalars['tokens_per_sec'] * flops / 1e12, rel=1e-6)
    setup.data.close()


def test_eval_may_allow_more_steps_than_training(tmp_path):
  workdir = str(tmp_path / 'run')
  train.train_and_evaluate(_config(3), workdir)
  three = evaluation.evaluate_checkpoint(_config(3), workdir)
  more = _config(3)
  more.model.stack_options.max_steps = 6
  six = evaluation.evaluate_checkpoint(more, workdir)
  assert three['step'] == six['step'] == 3
  assert np.isfinite(six['loss'])
  assert six['config_overrides'] == {'model.stack_options.max_steps': 6}


def test_inspect_draws_the_steps_per_token(tmp_path):
  workdir = str(tmp_path / 'run')
  train.train_and_evaluate(_config(3), workdir)
  paths = attention_maps.write_maps(_config(3), workdir)
  with open(paths['act_steps_json']) as f:
    report = json.load(f)
  steps = np.load(paths['act_steps_npz'])['act_steps']
  assert steps.shape[1] == 16 and steps.min() >= 1 and steps.max() <= 3
  assert report['mean_steps'] == pytest.approx(float(steps.mean()))
  assert sum(report['fraction_by_steps_scored']) == pytest.approx(1.0)
  assert len(report['mean_steps_by_position']) == 16
