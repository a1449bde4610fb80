"""Shared helpers for the benchmark scripts: timing, tables and JSON output."""

import json
import os
import platform
import statistics
import time
from typing import Callable, Sequence

import jax


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


def machine() -> dict[str, object]:
  """What the numbers were measured on."""
  return {'platform': platform.platform(), 'processor': platform.processor(),
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


def write_json(path: str, payload: dict) -> None:
  """Writes `payload` plus machine info to `path`."""
  os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
  with open(path, 'w') as f:
    json.dump({'machine': machine(), **payload}, f, indent=2)
  print(f'wrote {path}')
