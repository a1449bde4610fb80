"""Adaptive and dynamic spans in the real training loop (configs/tiny.py, Variable Assignment).

Spans start at z = 2 (reach z + R = 6, trimmed span T = 8 with block 4) under a strong
L1 penalty (lambda = 1) and a learning rate of 0.02, so they shrink to the box's floor z = 0
within the 20 steps (at 0.01 they took ~15 of 40 steps, and 20 steps left them at z = 0.36);
when a layer's z + R falls to 4 its T crosses a block and the loop compiles the step for the
new T (and only then). Measured on 2 CPU cores (about 5 s a run).
"""

import json
import os

import jax
import numpy as np
import pytest

from configs import adaptive_span_char
from training import assembly, attention_maps, evaluation, steps, train

STEPS = 20
OPTIONS = {'limit': 16, 'ramp': 4, 'init': 0.125, 'trim_multiple': 4, 'penalty': 1.0, 'memory': False}


def _run(harness, tmp_path, name, monkeypatch):
  compiled = []
  original = steps.jit_train_step

  def counting(setup, model=None):
    compiled.append((model or setup.model).config.options_of(name)['trim'])
    return original(setup, model)

  monkeypatch.setattr(steps, 'jit_train_step', counting)
  extra = {'model.attention': name, 'model.position_embedding': 'none', 'total_steps': STEPS,
           'learning_rate': 0.02, 'warmup_steps': 5, 'checkpoint_every_steps': STEPS,
           'model.attention_block_size': 8}
  extra.update({f'model.attention_options.{name}.{k}': v for k, v in OPTIONS.items()})
  config = harness.config(extra)
  state = train.train_and_evaluate(config, str(tmp_path))
  return state, compiled


def test_adaptive_span_trains_and_recompiles_only_when_a_span_crosses_a_block(
    harness, tmp_path, monkeypatch):
  """The real loop trains long enough for the spans to shrink across a block, and each
  crossing compiles the step again (what the test counts)."""
  state, compiled = _run(harness, tmp_path, 'adaptive_span', monkeypatch)
  assert int(state.step) == STEPS
  fractions = np.stack([np.asarray(jax.device_get(
      state.params[f'block_{i}']['attention']['span_fraction'])) for i in range(2)])
  assert np.all((fractions >= 0) & (fractions <= 1))
  assert np.all(fractions == 0.0), fractions  # Pushed down to the floor and kept there.
  # T = 8 per layer at first (ceil(2 + 4) rounded up to 4), then 4 once z + R <= 4; one
  # compile per distinct trim, never one per step.
  assert compiled[0] == (8, 8) and compiled[-1] == (4, 4), compiled
  assert len(set(compiled)) == len(compiled) <= 3, compiled

  # --mode=inspect reads the checkpoint: spans per head (all 0 here), FLOPs and cache.
  config = harness.config({'model.attention': 'adaptive_span',
                           'model.position_embedding': 'none',
                           **{f'model.attention_options.adaptive_span.{k}': v
                              for k, v in OPTIONS.items()}})
  paths = attention_maps.write_maps(config, str(tmp_path))
  with open(paths['spans_json']) as f:
    report = json.load(f)
  assert report['head_spans'] == [[0.0, 0.0], [0.0, 0.0]] and report['trimmed_spans'] == [4, 4]
  heads, d = 2, 64
  assert report['attention_flops_per_token']['trimmed'] == 4 * d * heads * (4 + 4)
  assert report['attention_flops_per_token']['full_span'] == 4 * d * heads * 16 * 2
  assert report['decode_cache_bytes_per_row'] == {'trimmed': 2 * heads * d * 4 * 8,
                                                  'full_span': 2 * heads * d * 4 * 32}
  assert os.path.getsize(paths['spans_png']) > 0


def test_dynamic_span_trains(harness, tmp_path, monkeypatch):
  state, compiled = _run(harness, tmp_path, 'dynamic_span', monkeypatch)
  assert int(state.step) == STEPS and compiled == [None]  # No trim: one compile.
  assert np.isfinite(np.asarray(jax.device_get(state.params['block_0']['attention']['span_b']))).all()


@pytest.mark.parametrize('extra,match', [
    ({'model.attention_options.adaptive_span.memory': True}, "data.packing='stream'"),
])
def test_memory_needs_a_stream(harness, tmp_path, extra, match):
  config = harness.config({'model.attention': 'adaptive_span',
                           'model.position_embedding': 'none', **extra})
  with pytest.raises(ValueError, match=match):
    assembly.build(config)


def _stream_config(tmp_path, total_steps):
  text = tmp_path / 'corpus.txt'
  if not text.exists():
    rng = np.random.default_rng(0)
    words = ['alpha', 'beta', 'gamma', 'delta', 'to', 'be', 'or', 'not', 'the', 'question']
    text.write_text(' '.join(rng.choice(words, 6000)))
  config = adaptive_span_char.get_config()
  config.data.files = str(text)
  config.data.data_dir = str(tmp_path / 'tfds')
  config.data.chunk_bytes = 2048
  config.data.prefetch_batches = 1
  config.model.update(d_model=32, n_heads=2, n_layers=2, attention_block_size=8)
  config.model.attention_options.adaptive_span.update(limit=24, ramp=4, trim_multiple=8, init=0.3,
                                                      penalty=0.01)
  config.update(seq_len=16, batch_size=2, total_steps=total_steps, warmup_steps=2,
                learning_rate=0.01, log_every_steps=2, eval_every_steps=0, eval_steps=2,
                checkpoint_every_steps=3, peak_tflops_per_device=1.0,
                async_checkpointing=False, adam_eps=1e-3)
  return config


@pytest.mark.usefixtures('compile_cache')
def test_segment_memory_is_carried_and_resumes_exactly(tmp_path, straight_and_resumed):
  """A run stopped at step 3 and resumed to 6 equals a run straight to 6: the checkpoint
  holds the memory of every layer and the stream positions of every row. The straight,
  stopped and resumed runs build the segment-memory step; the session's persistent compile
  cache (conftest `compile_cache`) loads what an earlier one compiled."""
  straight, resumed = straight_and_resumed(lambda steps: _stream_config(tmp_path, steps))
  memory = straight.memory['block_1']['attention']
  assert memory['hidden'].shape == (2, 24, 32)
  assert np.all(np.asarray(memory['segment_ids']) > 0)  # Filled with the streams' documents.
  for a, b in zip(jax.tree.leaves(straight), jax.tree.leaves(resumed)):
    # The stopped run compiles other programs (total_steps 3) than the straight one, so sums
    # may round differently; adam_eps 1e-3 keeps such noise in a gradient entry from moving its
    # weight by the learning rate (tests/training/test_sharded_step.py ADAM_EPS). 3.0e-6 seen.
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5)
  result = evaluation.evaluate_checkpoint(_stream_config(tmp_path, 6), str(tmp_path / 'straight'))
  assert np.isfinite(result['bits_per_byte'])
