"""TensorBoard event files without TensorFlow (training/metrics.py's EventWriter)."""

import subprocess
import sys
import textwrap

import numpy as np
import pytest

from tests.harness import REPO
from training import metrics

pytestmark = pytest.mark.unit


def _read(logdir):
  """{(step, tag): (plugin, value)} through TensorBoard's own reader."""
  from tensorboard.backend.event_processing import event_accumulator  # pylint: disable=import-outside-toplevel
  from tensorboard.util import tensor_util  # pylint: disable=import-outside-toplevel
  acc = event_accumulator.EventAccumulator(str(logdir), size_guidance={'tensors': 0})
  acc.Reload()
  out = {}
  for tag in acc.Tags()['tensors']:
    plugin = acc.summary_metadata[tag].plugin_data.plugin_name
    for event in acc.Tensors(tag):
      value = tensor_util.make_ndarray(event.tensor_proto)
      out[(event.step, tag)] = (plugin, value.item())
  return out


def test_scalars_and_texts_read_back_as_tf_summary_writes_them(tmp_path):
  writer = metrics.EventWriter(str(tmp_path / 'tb'))
  writer.write_scalars(2, {'train/loss': 1.5, 'train/lr': np.float32(0.25)})
  writer.write_texts(4, {'samples/0': 'prompt:\n\n    the cat'})
  writer.write_scalars(4, {'train/loss': 0.75})
  writer.close()
  read = _read(tmp_path / 'tb')
  assert read == {(2, 'train/loss'): ('scalars', 1.5), (2, 'train/lr'): ('scalars', 0.25),
                  (4, 'train/loss'): ('scalars', 0.75),
                  (4, 'samples/0'): ('text', b'prompt:\n\n    the cat')}


def test_two_writers_of_one_folder_keep_both_files(tmp_path):
  """A run and its evaluation in one process, within one second: neither file empties the
  other."""
  first = metrics.EventWriter(str(tmp_path))
  second = metrics.EventWriter(str(tmp_path))
  first.write_scalars(1, {'train/loss': 1.0})
  second.write_scalars(2, {'eval/loss': 2.0})
  first.close()
  second.close()
  assert set(_read(tmp_path)) == {(1, 'train/loss'), (2, 'eval/loss')}


def test_a_run_writes_its_events_without_importing_tensorflow(tmp_path):
  """The logger of every main.py start: TensorFlow's import is ~8 CPU-s of a 2-core start."""
  script = textwrap.dedent(f'''
      import sys
      from training import metrics
      logger = metrics.MetricLogger({str(tmp_path)!r}, total_steps=2)
      logger.write(1, {{'loss': 2.0}}, prefix='eval')
      logger.write_texts(1, {{'samples/0': 'x'}})
      logger.close()
      print('tensorflow' in sys.modules)
      ''')
  proc = subprocess.run([sys.executable, '-c', script], cwd=REPO, capture_output=True,
                        text=True, env={'PYTHONPATH': str(REPO), 'JAX_PLATFORMS': 'cpu',
                                        'PATH': '/usr/bin:/bin'}, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.split() == ['False']
  assert set(_read(tmp_path / 'tensorboard')) == {(1, 'eval/loss'), (1, 'samples/0')}


def test_a_failed_write_is_raised_at_close(tmp_path, monkeypatch):
  writer = metrics.EventWriter(str(tmp_path / 'tb'))

  def broken(data):
    raise OSError('disk full')

  monkeypatch.setattr(writer, '_write', broken)
  writer.write_scalars(1, {'loss': 1.0})
  with pytest.raises(OSError, match='disk full'):
    writer.close()
