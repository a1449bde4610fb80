"""Peak FLOP/s for MFU: a table of known accelerators, else a matmul measured here."""

import time

import jax
import jax.numpy as jnp

# Dense bf16 peak TFLOP/s per device (vendor numbers).
_PEAK_TFLOPS = {
    'TPU v4': 275.0,
    'TPU v5 lite': 197.0,
    'TPU v5e': 197.0,
    'TPU v5p': 459.0,
    'TPU v5': 459.0,          # v5p's device_kind.
    'TPU v6 lite': 918.0,
    'TPU v6e': 918.0,
    'NVIDIA H100 80GB HBM3': 989.0,
    'NVIDIA H200': 989.0,
    'NVIDIA A100-SXM4-80GB': 312.0,
    'NVIDIA A100-SXM4-40GB': 312.0,
}


def measure_matmul_peak(n: int = 1024, dtype=jnp.float32, repeats: int = 10,
                        device: jax.Device | None = None) -> float:
  """Best achieved FLOP/s of an n x n x n matmul on one device.

  Args:
    n: matrix size.
    dtype: operand dtype.
    repeats: timed repetitions (the best one counts).
    device: device to run on; defaults to the first.

  Returns:
    FLOP/s.
  """
  device = device or jax.devices()[0]
  a = jax.device_put(jnp.ones((n, n), dtype), device)
  b = jax.device_put(jnp.ones((n, n), dtype), device)
  f = jax.jit(lambda x, y: x @ y)
  f(a, b).block_until_ready()
  best = float('inf')
  for _ in range(repeats):
    t = time.perf_counter()
    f(a, b).block_until_ready()
    best = min(best, time.perf_counter() - t)
  return 2.0 * n ** 3 / best


def table_peak_flops(device_kind: str) -> float | None:
  """The vendor's dense bf16 peak FLOP/s of one device of this jax device_kind; None when
  the table does not know it."""
  tflops = _PEAK_TFLOPS.get(device_kind)
  return None if tflops is None else tflops * 1e12


def peak_flops_per_device(config_tflops: float = 0.0, dtype=jnp.float32) -> tuple[float, str]:
  """Peak FLOP/s of one device and where the number came from.

  Args:
    config_tflops: a user-given peak in TFLOP/s; used when > 0.
    dtype: matmul dtype to measure with when the device is not in the table.

  Returns:
    (FLOP/s, source) where source is 'config', 'table' or 'measured'.
  """
  if config_tflops > 0:
    return config_tflops * 1e12, 'config'
  peak = table_peak_flops(jax.devices()[0].device_kind)
  if peak:
    return peak, 'table'
  return measure_matmul_peak(dtype=dtype), 'measured'
