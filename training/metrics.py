"""Console progress lines, TensorBoard scalars and texts (through clu metric writers)."""

import time

import jax
from absl import logging
from clu import metric_writers


class MetricLogger:
  """Writes scalars to TensorBoard (process 0) and a progress line with ETA to the console.

  Args:
    workdir: TensorBoard event files go to `workdir/tensorboard`.
    total_steps: last step of the run (for the ETA).
  """

  def __init__(self, workdir: str, total_steps: int):
    # The console line below replaces clu's LoggingWriter, so only event files are written.
    writers = []
    if jax.process_index() == 0:
      writers.append(metric_writers.AsyncWriter(metric_writers.SummaryWriter(f'{workdir}/tensorboard')))
    self._writer = metric_writers.MultiWriter(writers)
    self._total = total_steps
    self._start = time.time()
    self._start_step = None

  def write(self, step: int, scalars: dict[str, float], prefix: str = 'train') -> None:
    """Logs `scalars` at `step` under `prefix/`."""
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
    self._writer.write_texts(step, texts)

  def close(self) -> None:
    """Flushes and closes the writers."""
    self._writer.flush()
    self._writer.close()


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
