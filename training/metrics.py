"""Console progress lines, TensorBoard scalars and texts."""

import itertools
import time

import jax
from absl import logging


class MetricLogger:
  """Writes scalars to TensorBoard (process 0) and a progress line with ETA to the console.

  Args:
    workdir: TensorBoard event files go to `workdir/tensorboard`.
    total_steps: last step of the run (for the ETA).
  """

  def __init__(self, workdir: str, total_steps: int):
    # Event files from process 0 only; the console line below is every process's.
    self._writer = EventWriter(f'{workdir}/tensorboard') if jax.process_index() == 0 else None
    self._total = total_steps
    self._start = time.time()
    self._start_step = None

  def write(self, step: int, scalars: dict[str, float], prefix: str = 'train') -> None:
    """Logs `scalars` at `step` under `prefix/`."""
    if self._writer:
      self._writer.write_scalars(step, {f'{prefix}/{k}': v for k, v in scalars.items()})
    if prefix == 'train':
      if self._start_step is None:
        self._start_step, self._start = step, time.time()
      done = step - self._start_step
      eta = (time.time() - self._start) / done * (self._total - step) if done > 0 else float('nan')
      logging.info('step %d/%d  loss %.4f  acc %.3f  lr %.2e  |g| %.3f  tok/s %.0f  MFU %.1f%%  ETA %s%s',
                   step, self._total, scalars['loss'], scalars['accuracy'], scalars['learning_rate'],
                   scalars['grad_norm'], scalars['tokens_per_sec'], 100 * scalars['mfu'],
                   _fmt_time(eta), _per_layer(scalars))
    else:
      logging.info('%s step %d  %s', prefix, step,
                   '  '.join(f'{k} {v:.4f}' for k, v in sorted(scalars.items())))

  def write_texts(self, step: int, texts: dict[str, str]) -> None:
    """Writes `texts` ({tag: markdown}) at `step` as TensorBoard text summaries."""
    if self._writer:
      self._writer.write_texts(step, texts)

  def close(self) -> None:
    """Flushes and closes the event file."""
    if self._writer:
      self._writer.close()


_FILE_IDS = itertools.count()  # EventWriter's file names, unique in a process.


class EventWriter:
  """TensorBoard event files, written in a background thread with no TensorFlow in a local
  folder.

  The summaries are those tf.summary writes (a float32 scalar tensor under the 'scalars'
  plugin, a string tensor under 'text'), in TFRecord framing, so TensorBoard, its
  EventAccumulator (experiments/harness.py) and tf.compat.v1.train.summary_iterator read them
  as before. Not clu's SummaryWriter, nor tensorboard's EventFileWriter: both import
  TensorFlow where it is installed, about 8 CPU-seconds of every start of main.py on a 2-core
  machine, for runs whose data needs none (the synthetic tasks, every `--mode=eval` or
  `--mode=generate` of them). A remote folder (gs://...) is written through tf.io.gfile.

  Args:
    logdir: the folder of the event file (created if missing).
  """

  def __init__(self, logdir: str):
    # pylint: disable=import-outside-toplevel
    import concurrent.futures
    import os
    import socket
    from tensorboard.compat.proto import event_pb2, summary_pb2
    from tensorboard.plugins.scalar import summary_v2 as scalar_summary
    from tensorboard.plugins.text import summary_v2 as text_summary
    from tensorboard.summary.writer import record_writer
    self._event, self._summary = event_pb2.Event, summary_pb2.Summary
    self._scalar, self._text = scalar_summary.scalar_pb, text_summary.text_pb
    # The counter keeps two writers of one process in one second (a run, then its evaluation,
    # in the same folder) from opening, and so emptying, the same file.
    name = (f'events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.'
            f'{os.getpid()}.{next(_FILE_IDS)}')
    if '://' in logdir:
      import tensorflow as tf
      tf.io.gfile.makedirs(logdir)
      file = tf.io.gfile.GFile(f'{logdir.rstrip("/")}/{name}', 'wb')
    else:
      os.makedirs(logdir, exist_ok=True)
      file = open(os.path.join(logdir, name), 'wb')  # pylint: disable=consider-using-with
    self._records = record_writer.RecordWriter(file)
    self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix='event_writer')
    self._pending = []
    self._add(self._event(wall_time=time.time(), file_version='brain.Event:2'))

  def _add(self, event) -> None:
    """Queues `event`; the writer thread appends and flushes it (in order)."""
    data = event.SerializeToString()
    self._pending = [f for f in self._pending if not f.done() or f.exception()]
    self._pending.append(self._thread.submit(self._write, data))

  def _write(self, data: bytes) -> None:
    self._records.write(data)
    self._records.flush()

  def _summaries(self, step: int, summaries) -> None:
    values = [v for summary in summaries for v in summary.value]
    self._add(self._event(wall_time=time.time(), step=int(step),
                          summary=self._summary(value=values)))

  def write_scalars(self, step: int, scalars: dict[str, float]) -> None:
    """One event at `step` with a scalar summary per key."""
    self._summaries(step, [self._scalar(tag, float(v)) for tag, v in scalars.items()])

  def write_texts(self, step: int, texts: dict[str, str]) -> None:
    """One event at `step` with a text summary (markdown) per key."""
    self._summaries(step, [self._text(tag, text) for tag, text in texts.items()])

  def close(self) -> None:
    """Waits for the queued writes, closes the file, and raises the first write's error."""
    self._thread.shutdown(wait=True)
    self._records.close()
    for future in self._pending:
      future.result()


def _per_layer(scalars: dict[str, float]) -> str:
  """Sown per-layer metrics ('span_max/block_0', ...) as '  span_max [12 40]'."""
  groups: dict[str, list[tuple[str, float]]] = {}
  for key, value in scalars.items():
    if '/' in key:
      name, layer = key.split('/', 1)
      groups.setdefault(name, []).append((layer, value))

  def order(item):  # block_2 before block_10
    digits = ''.join(c for c in item[0] if c.isdigit())
    return (int(digits) if digits else 0, item[0])

  return ''.join(f'  {name} [{" ".join(f"{v:.3g}" for _, v in sorted(vals, key=order))}]'
                 for name, vals in sorted(groups.items()))


def _fmt_time(seconds: float) -> str:
  if seconds != seconds:  # NaN
    return '?'
  m, s = divmod(int(seconds), 60)
  h, m = divmod(m, 60)
  return f'{h}:{m:02d}:{s:02d}'


def quiet_libraries() -> None:
  """Orbax and TFDS log every save and read at INFO: keep their warnings, drop the chatter
  (a filter on the root and absl handlers)."""
  import logging as py_logging  # pylint: disable=g-import-not-at-top

  class _Filter(py_logging.Filter):
    def filter(self, record):
      return record.levelno >= py_logging.WARNING or not any(
          lib in record.pathname for lib in ('/orbax/', '/tensorflow_datasets/'))

  for handler in py_logging.getLogger().handlers + py_logging.getLogger('absl').handlers:
    handler.addFilter(_Filter())
