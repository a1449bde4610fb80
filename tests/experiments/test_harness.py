"""experiments/harness.py: runs as data (variant specs, override dicts, named Runs), trained
over seeds in their own folders, resumed or kept, measured, with the round-robin timing.

The end-to-end run trains two runs x two seeds for 2 steps each (a d=1 model on 24-byte rows
of a generated text): about 20 s on an idle 2-core CPU.
"""

import math
import os

import numpy as np
import pytest

from configs import local_text
from experiments import harness, rows as rows_lib


def _text(path, size=20_000):
  words = ['the', 'king', 'and', 'queen', 'of', 'a', 'castle', 'speak', 'thou', 'art', 'my',
           'lord', 'good', 'night', 'sweet', 'prince']
  rng = np.random.default_rng(0)
  out, n = [], 0
  while n < size:
    line = ' '.join(rng.choice(words, rng.integers(3, 10))) + '.\n'
    out.append(line)
    n += len(line)
  path.write_text(''.join(out))


def _base(tmp_path, **overrides):
  text = tmp_path / 'text.txt'
  if not text.exists():
    _text(text)
  recipe = local_text.get_config()
  recipe.model.d = 1
  return harness.base_config(
      recipe, steps=2, evals=2, workdir=str(tmp_path),
      overrides={'data.files': str(text), 'seq_len': 24, 'batch_size': 4, 'eval_steps': 1,
                 'data.chunk_bytes': 2048, 'peak_tflops_per_device': 1.0, **overrides})


def test_base_config_sizes_the_run_and_applies_overrides_last(tmp_path):
  base = _base(tmp_path)
  assert (base.total_steps, base.eval_every_steps, base.checkpoint_every_steps) == (2, 1, 2)
  assert base.seq_len == 24 and base.generate.eval_samples == 0
  assert os.path.isabs(base.data.files) and base.data.data_dir == str(tmp_path / 'tfds')
  with pytest.raises(ValueError, match='steps and evals'):
    harness.base_config(local_text.get_config(), steps=0)
  with pytest.raises(ValueError, match='needs files'):
    harness.base_config(local_text.get_config(), steps=2)


def test_a_bad_run_fails_before_anything_trains(tmp_path):
  base = _base(tmp_path)
  for runs, match in [(['dense', 'local:windw=3'], 'windw'),
                      (['dense', {'model.attention': 'nope'}], 'nope'),
                      (['dense', 'dense'], 'two runs'),
                      (['txl:data.packing=packed'], 'stream')]:
    with pytest.raises(ValueError, match=match):
      harness.run(runs, base, [0], str(tmp_path / 'runs'), progress=False)
  assert not (tmp_path / 'runs').exists()


def test_runs_over_seeds_in_their_folders_then_kept(tmp_path):
  """Over a minute in CI: two runs over two seeds are four trainings, each timed, then a
  second call keeps the first (running runs over seeds is what the harness is for)."""
  base = _base(tmp_path)
  out = str(tmp_path / 'runs')
  runs = ['dense', harness.Run('wide_window', {'model.attention': 'local',
                                               'model.attention_options.local.window': 16})]
  seen = []
  rows = harness.run(runs, base, [0, 1], out, time_rounds=1, time_steps=1, progress=True,
                     on_row=lambda r: seen.append((r['run'], r['seed'], rows_lib.is_row(r))))
  assert seen == [('dense', 0, True), ('wide_window', 0, True), ('dense', 1, True),
                  ('wide_window', 1, True)]
  assert [(r['run'], r['seed'], True) for r in rows] == seen
  for r in rows:
    # experiments/rows.py's rows, as the experiments write them: numbers in 'metrics'.
    assert rows_lib.is_row(r) and 'diverged' not in r and 'step' not in r
    m = r['metrics']
    assert os.path.isdir(os.path.join(out, f'seed{r["seed"]}', r['run'], 'checkpoints', '2'))
    assert m['step'] == 2 and math.isfinite(m['eval_loss']) and m['bits_per_byte'] > 0
    assert m['run_seconds'] > 0 and m['params'] > 0 and m['attn_peak_bytes'] > 0
    assert [s for s, _ in r['curves']['eval_loss']] == [1, 2]
    assert len(r['timed_tokens_per_sec']['rounds']) == 1 and not r['already_trained']
    assert m['tokens_per_sec'] == r['timed_tokens_per_sec']['median']
    assert m['logged_tokens_per_sec'] > 0 and r['workdir'].endswith(r['run'])
  assert rows[1]['own_keys'] == {'model.attention': 'local',
                                 'model.attention_options.local.window': 16}
  # The seed is the model's: different initial losses.
  assert rows[0]['curves']['train_loss'][0][1] != rows[2]['curves']['train_loss'][0][1]
  again = harness.run(runs[:1], base, [0], out, progress=False)
  assert rows_lib.is_row(again[0]) and 'logged_tokens_per_sec' not in again[0]['metrics']
  assert again[0]['already_trained'] and rows_lib.metric(again[0], 'eval_loss', 'value') == (
      rows_lib.metric(rows[0], 'eval_loss', 'value'))


def test_a_sigterm_stops_the_experiment_with_the_run_saved(tmp_path, monkeypatch):
  """SIGTERM during a run (a preemption, `timeout`, a scheduler): the training loop saves and
  returns early, and the harness stops with Preempted (exit status 143) instead of measuring a
  half-trained run and going on to the next; a rerun resumes from the saved step."""
  import signal
  from training import train
  base = _base(tmp_path)
  base.total_steps = 4
  out = tmp_path / 'runs'
  real = train.train_and_evaluate

  def terminated_at_step_2(config, workdir, on_step=None, **kwargs):
    def step(n):
      on_step(n)
      if n == 2:
        signal.raise_signal(signal.SIGTERM)
    return real(config, workdir, on_step=step, **kwargs)

  monkeypatch.setattr(train, 'train_and_evaluate', terminated_at_step_2)
  with pytest.raises(harness.Preempted) as stopped:
    harness.run(['dense', 'local:window=8'], base, None, str(out), progress=False)
  assert stopped.value.code == 143 and stopped.value.step == 2
  assert (out / 'dense' / 'checkpoints' / '2').is_dir() and not (out / 'local_window=8').exists()
  monkeypatch.setattr(train, 'train_and_evaluate', real)
  rows = harness.run(['dense'], base, None, str(out), progress=False)
  assert rows[0]['metrics']['step'] == 4 and not rows[0]['already_trained']


def test_curves_read_either_writers_events_without_tensorflow(tmp_path):
  """harness.scalar_curve reads plain scalars (clu's PyTorch writer, which the GPU machines
  use: they have no TensorFlow) as it reads the tensors of the TensorFlow writer (the runs of
  the end-to-end test above)."""
  import time
  from tensorboard.compat.proto import event_pb2, summary_pb2
  from tensorboard.summary.writer.event_file_writer import EventFileWriter
  writer = EventFileWriter(str(tmp_path / 'tensorboard'))
  for step, value in ((3, 0.5), (6, 0.75)):
    summary = summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag='eval/accuracy',
                                                                   simple_value=value)])
    writer.add_event(event_pb2.Event(wall_time=time.time(), step=step, summary=summary))
  writer.close()
  assert harness.scalar_curve(str(tmp_path), 'eval/accuracy') == [(3, 0.5), (6, 0.75)]
  assert harness.scalar_curve(str(tmp_path), 'train/loss') == []
