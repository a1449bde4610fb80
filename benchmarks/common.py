"""Shared helpers for the benchmark scripts: timing, tables and JSON output."""

import json
import os
import platform
import statistics
import subprocess
import time
from typing import Callable, Sequence

import jax

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, 'results')  # Every committed result: benchmarks' and experiments'.


def time_fn(fn: Callable[[], object], *, warmup: int = 2, iters: int = 10) -> dict[str, float]:
  """Median and best wall time of `fn()` (which must block until its result is ready).

  Args:
    fn: the work to time.
    warmup: untimed calls first (compilation, caches).
    iters: timed calls.

  Returns:
    dict with 'median_s' and 'best_s'.
  """
  for _ in range(warmup):
    fn()
  times = []
  for _ in range(iters):
    t = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t)
  return {'median_s': statistics.median(times), 'best_s': min(times)}


def random_lm_batch(vocab_size: int, batch: int, seq_len: int, seed: int = 0) -> dict:
  """A host batch of random tokens, one document per row, every position scored (for timing
  train steps: token values do not change the step time)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  tokens = np.random.default_rng(seed).integers(0, vocab_size, (batch, seq_len + 1),
                                                dtype=np.int32)
  return {'inputs': tokens[:, :-1], 'targets': tokens[:, 1:],
          'weights': np.ones((batch, seq_len), np.float32),
          'positions': np.broadcast_to(np.arange(seq_len, dtype=np.int32),
                                       (batch, seq_len)).copy(),
          'segment_ids': np.ones((batch, seq_len), np.int32)}


def machine() -> dict[str, object]:
  """What the numbers were measured on."""
  cpu = platform.processor()
  try:
    with open('/proc/cpuinfo') as f:
      cpu = next((l.split(':', 1)[1].strip() for l in f if l.startswith('model name')), cpu)
  except OSError:
    pass
  return {'platform': platform.platform(), 'processor': platform.processor(), 'cpu': cpu,
          'cpu_count': os.cpu_count(), 'jax': jax.__version__,
          'backend': jax.default_backend(), 'device_kind': jax.devices()[0].device_kind,
          'device_count': jax.device_count()}


def print_table(rows: Sequence[dict], columns: Sequence[str]) -> None:
  """Prints rows as an aligned text table."""
  fmt = lambda v: f'{v:.4g}' if isinstance(v, float) else str(v)
  cells = [[fmt(r.get(c, '')) for c in columns] for r in rows]
  widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
  print('  '.join(c.rjust(w) for c, w in zip(columns, widths)))
  for row in cells:
    print('  '.join(v.rjust(w) for v, w in zip(row, widths)))


def pyplot():
  """matplotlib.pyplot on the file-only Agg backend (benchmarks run without a display)."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  return plt


def save_figure(fig, path: str) -> None:
  """Lays out `fig`, writes it to `path` (its folder made) at 110 dpi and closes it."""
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=110)
  pyplot().close(fig)
  print(f'wrote {path}')


def write_json(path: str, payload: dict) -> None:
  """Writes `payload` plus machine info to `path`."""
  os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
  with open(path, 'w') as f:
    json.dump({'machine': machine(), **payload}, f, indent=2)
  print(f'wrote {path}')


# ------------------------------------------------------ experiments that run main.py


def flags(overrides: dict) -> list[str]:
  """--config.KEY=VALUE flags of main.py for {dotted key: value}."""
  return [f'--config.{k}={v}' for k, v in overrides.items()]


def run_logged(cmd: list[str], cwd: str, log_path: str, may_diverge: bool = False) -> float | str:
  """Runs cmd with its output appended to log_path; returns seconds, or, when a training run
  stopped on a non-finite loss and `may_diverge`, the line that says so; raises on other
  failures."""
  t = time.time()
  with open(log_path, 'a') as log:
    start = log.tell()
    proc = subprocess.run(cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT)
  if proc.returncode:
    with open(log_path) as log:
      log.seek(start)
      lines = [l.strip() for l in log if 'non-finite' in l]
    if may_diverge and lines:
      return lines[-1]
    raise SystemExit(f'{" ".join(cmd)} failed (exit {proc.returncode}); see {log_path}')
  return time.time() - t


def scalar_curve(workdir: str, tag: str) -> list[tuple[int, float]]:
  """(step, value) of a scalar a main.py run wrote to TensorBoard under workdir."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tensorboard.backend.event_processing import event_accumulator  # pylint: disable=g-import-not-at-top
  acc = event_accumulator.EventAccumulator(os.path.join(workdir, 'tensorboard'),
                                           size_guidance={'tensors': 0})
  acc.Reload()
  if tag not in acc.Tags()['tensors']:
    return []
  points = {e.step: float(tf.make_ndarray(e.tensor_proto)) for e in acc.Tensors(tag)}
  return sorted(points.items())
