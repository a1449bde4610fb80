"""Transformer-XL in the real training loop: memory carried, checkpointed and resumed; eval
with its own (longer) memory. A stream of bytes from a small text, packed as 'stream'.

The module uses the session's persistent compilation cache (conftest `compile_cache`): the
straight, stopped and resumed runs and the evaluations build the same programs, which are then
loaded instead of compiled again.
"""

import jax
import numpy as np
import pytest

from configs import transformer_xl_char
from training import assembly, evaluation, train

pytestmark = pytest.mark.usefixtures('compile_cache')

N, MEM = 16, 16


def _config(tmp_path, total_steps, **options):
  text = tmp_path / 'corpus.txt'
  if not text.exists():
    # Each line is a random 24-byte key, then filler, then the same key again: the second
    # copy is predictable only from 40+ bytes back, beyond one segment of 16.
    rng = np.random.default_rng(0)
    lines = []
    for _ in range(300):
      key = ''.join(rng.choice(list('abcdefghijklmnop'), 24))
      lines.append(f'{key} ..........{key}')
    text.write_text('\n'.join(lines))
  config = transformer_xl_char.get_config()
  config.data.files = str(text)
  config.data.data_dir = str(tmp_path / 'tfds')
  config.data.chunk_bytes = 2048
  config.data.prefetch_batches = 1
  config.model.update(d_model=32, n_heads=2, n_layers=2, attention_block_size=8)
  config.model.attention_options.txl.update(mem_len=MEM, **options)
  config.update(seq_len=N, batch_size=2, total_steps=total_steps, warmup_steps=2,
                learning_rate=0.01, log_every_steps=2, eval_every_steps=0, eval_steps=4,
                checkpoint_every_steps=3, peak_tflops_per_device=1.0,
                async_checkpointing=False,
                # The stopped run's first steps are another program (total_steps 3) than the
                # straight run's: a gradient entry that is pure float32 rounding noise can
                # flip sign between them, and with Adam's eps 1e-8 move its weight by the
                # whole learning rate (7.8e-4 in the memory after 6 steps, with the suite's
                # compile flags). eps 1e-3 bounds that, as tests/training/test_sharded_step.py
                # does; a memory or stream position missing from the checkpoint moves far more.
                adam_eps=1e-3)
  return config


def test_memory_is_carried_checkpointed_and_resumes_exactly(tmp_path, straight_and_resumed):
  """A run stopped at step 3 and resumed to 6 equals a run straight to 6: the checkpoint
  holds every layer's memory and the stream positions."""
  straight, resumed = straight_and_resumed(lambda steps: _config(tmp_path, steps))
  memory = straight.memory['blocks']['attention']
  assert memory['hidden'].shape == (2, 2, MEM, 32)  # (layers, rows, M, d_model)
  assert np.all(np.asarray(memory['segment_ids']) > 0)  # Filled from the streams.
  for a, b in zip(jax.tree.leaves(straight), jax.tree.leaves(resumed)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5)  # 3.7e-6 seen.


def test_eval_with_a_longer_memory_runs_and_changes_the_loss(tmp_path):
  # 6 steps, as the straight run above: its train step is loaded from the compile cache.
  steps = 6
  workdir = str(tmp_path / 'run')
  train.train_and_evaluate(_config(tmp_path, steps), workdir)
  base = evaluation.evaluate_checkpoint(_config(tmp_path, steps), workdir)
  longer = evaluation.evaluate_checkpoint(_config(tmp_path, steps, eval_mem_len=4 * MEM),
                                          workdir)
  assert np.isfinite(base['bits_per_byte']) and np.isfinite(longer['bits_per_byte'])
  assert base['step'] == longer['step'] == steps
  assert abs(longer['loss'] - base['loss']) > 1e-4, (base, longer)
  assert longer['config_overrides'] == {'model.attention_options.txl.eval_mem_len': 4 * MEM}


@pytest.mark.parametrize('extra,match', [
    ({'data.packing': 'packed'}, "data.packing='stream'"),
    ({'model.position_embedding': 'learned'}, "position_embedding='none'"),
])
def test_bad_setups_are_refused_before_compute(tmp_path, no_compute, extra, match):
  config = _config(tmp_path, 2)
  for key, value in extra.items():
    section, name = key.split('.')
    config[section][name] = value
  with pytest.raises(ValueError, match=match):
    assembly.build(config)
