"""The Reformer recipe (configs/reformer_duplication.py) in the real training loop: LSH's
rotations come from the step's rng, so a resumed run equals an uninterrupted one; a model
trained with one hash round is evaluated with more."""

import jax
import numpy as np

from configs import reformer_duplication
from training import evaluation, train


def _config(total_steps, **model):
  config = reformer_duplication.get_config()
  config.data.num_symbols = 8
  config.data.dup_length = 15                     # Rows of 32.
  config.model.update(d_model=32, n_heads=2, n_layers=2, **model)
  config.model.attention_options.update(n_buckets=4, chunk_len=8)
  config.update(batch_size=4, total_steps=total_steps, warmup_steps=2, log_every_steps=2,
                eval_every_steps=0, eval_steps=2, checkpoint_every_steps=3,
                peak_tflops_per_device=1.0, async_checkpointing=False)
  return config


def test_resume_equals_an_uninterrupted_run(straight_and_resumed):
  """Stopped at step 3 and resumed to 6 equals straight to 6: each step's buckets are drawn
  from the same (seed, step) key in both runs (rotations drawn from any other source, such as
  a fresh key per process, would give other parameters after the resume)."""
  straight, resumed = straight_and_resumed(_config)
  assert int(straight.step) == int(resumed.step) == 6
  for a, b in zip(jax.tree.leaves(straight.params), jax.tree.leaves(resumed.params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def test_eval_with_more_hash_rounds_than_training(tmp_path):
  workdir = str(tmp_path / 'run')
  train.train_and_evaluate(_config(4), workdir)
  one = evaluation.evaluate_checkpoint(_config(4), workdir)
  more = _config(4)
  more.model.attention_options.n_hashes = 4
  four = evaluation.evaluate_checkpoint(more, workdir)
  assert one['step'] == four['step'] == 4
  assert np.isfinite(four['loss']) and abs(four['loss'] - one['loss']) > 1e-6, (one, four)
  assert four['config_overrides'] == {'model.attention_options.n_hashes': 4}
