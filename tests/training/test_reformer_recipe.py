"""The Reformer recipe (configs/reformer_duplication.py) in the real training loop: a model
trained with one hash round is evaluated with more. (That a resumed LSH run, whose rotations
come from the step's rng, equals an uninterrupted one: tests/contracts/test_resume_contract.py.)"""

import numpy as np

from configs import reformer_duplication
from training import evaluation, train


def _config(total_steps, **model):
  config = reformer_duplication.get_config()
  config.data.num_symbols = 8
  config.data.dup_length = 15                     # Rows of 32.
  config.model.update(d_model=32, n_heads=2, n_layers=2, **model)
  config.model.attention_options.lsh.update(n_buckets=4, chunk_len=8)
  config.update(batch_size=4, total_steps=total_steps, warmup_steps=2, log_every_steps=2,
                eval_every_steps=0, eval_steps=2, checkpoint_every_steps=3,
                peak_tflops_per_device=1.0, async_checkpointing=False)
  return config


def test_eval_with_more_hash_rounds_than_training(tmp_path):
  workdir = str(tmp_path / 'run')
  train.train_and_evaluate(_config(4), workdir)
  one = evaluation.evaluate_checkpoint(_config(4), workdir)
  more = _config(4)
  more.model.attention_options.lsh.n_hashes = 4
  four = evaluation.evaluate_checkpoint(more, workdir)
  assert one['step'] == four['step'] == 4
  assert np.isfinite(four['loss']) and abs(four['loss'] - one['loss']) > 1e-6, (one, four)
  assert four['config_overrides'] == {'model.attention_options.lsh.n_hashes': 4}
