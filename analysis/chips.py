"""What a chip can do, for the roofline step-time estimate (analysis/roofline.py).

One table, CHIPS, of the accelerators a run is sized for: peak matmul FLOP/s by operand type,
HBM capacity and bandwidth, inter-chip (ICI / NVLink) and data-center network bandwidth per
chip, with where each figure comes from. `host_chip()` measures the machine this process runs
on instead (a matmul's FLOP/s and a copy's bytes/s through XLA, and the launch overhead), so
that the same estimator can be checked against a step time measured here
(benchmarks/roofline_check.py).

Figures the vendors publish are marked with their page; figures no vendor publishes (a step's
launch overhead, a kernel's) are marked 'assumed' and are not fitted to any measurement.
"""

from __future__ import annotations

import dataclasses
import time

GiB = 1 << 30
GB = 1e9


@dataclasses.dataclass(frozen=True)
class Chip:
  """One accelerator chip (one jax device), per chip.

  Attributes:
    name: a short name ('v5e', 'H100', 'cpu').
    peak_flops: matmul FLOP/s by operand class (hlo_cost._flops_class): 'bf16', 'int8',
      'f32' (float32 operands at the default precision: one bf16 pass on TPU, TF32 on
      NVIDIA), 'f32_highest' (float32 at HIGH / HIGHEST), 'f64'.
    hbm_bytes: device memory.
    hbm_bandwidth: device memory bytes/s.
    ici_bandwidth: bytes/s one chip moves in a ring collective over its links within a
      slice / node (both directions of the one link each way a 1-D ring uses).
    dcn_bandwidth: bytes/s per chip between slices (nodes), over the data-center network.
    step_overhead_s: fixed time per step (launching the program, the host's part).
    kernel_overhead_s: fixed time per kernel launched.
    collective_latency_s: fixed time per collective.
    sources: where each figure comes from, by attribute.
  """
  name: str
  peak_flops: dict[str, float]
  hbm_bytes: int | None
  hbm_bandwidth: float
  ici_bandwidth: float = 0.0
  dcn_bandwidth: float = 0.0
  step_overhead_s: float = 0.0
  kernel_overhead_s: float = 0.0
  collective_latency_s: float = 0.0
  sources: dict[str, str] = dataclasses.field(default_factory=dict)

  def peak(self, klass: str) -> float:
    """FLOP/s of a matmul of this operand class (the nearest known class otherwise)."""
    for k in (klass, 'f32' if klass == 'f32_highest' else klass, 'bf16'):
      if self.peak_flops.get(k):
        return self.peak_flops[k]
    return max(self.peak_flops.values())


_CLOUD_TPU = 'https://cloud.google.com/tpu/docs/'
_TPU_ASSUMED = {
    'step_overhead_s': 'assumed: a jitted step launch on a TPU VM host (no vendor figure)',
    'kernel_overhead_s': 'assumed: about 1 us per XLA kernel on TPU (no vendor figure)',
    'collective_latency_s': 'assumed: a few us per collective hop (no vendor figure)',
    'f32': 'float32 matmuls at the default precision run as one bf16 pass on the MXU',
    'f32_highest': 'float32 at HIGHEST: six bf16 passes',
}


def _tpu(name: str, bf16: float, int8: float, hbm_gib: float, hbm_gbps: float,
         link_gbps: float, dcn_gbps: float, page: str, dcn_source: str) -> Chip:
  return Chip(
      name=name,
      peak_flops={'bf16': bf16 * 1e12, 'int8': int8 * 1e12, 'f32': bf16 * 1e12,
                  'f32_highest': bf16 * 1e12 / 6},
      hbm_bytes=int(hbm_gib * GiB), hbm_bandwidth=hbm_gbps * GB,
      ici_bandwidth=link_gbps * GB, dcn_bandwidth=dcn_gbps * GB,
      step_overhead_s=50e-6, kernel_overhead_s=1e-6, collective_latency_s=5e-6,
      sources={'peak_flops': _CLOUD_TPU + page, 'hbm': _CLOUD_TPU + page,
               'ici_bandwidth': ('one ICI link each way (both directions), per chip: the '
                                 'bidirectional per-link figure of "How to Scale Your Model" '
                                 '(jax-ml.github.io/scaling-book/tpus), consistent with '
                                 + _CLOUD_TPU + page + "'s per-chip ICI bandwidth over its "
                                 'ports'),
               'dcn_bandwidth': dcn_source, **_TPU_ASSUMED})


# By jax device_kind.
CHIPS: dict[str, Chip] = {
    # v4: 275 TFLOP/s (bf16 and int8), 32 GiB at 1,200 GB/s; 6 ICI links of 45 GB/s each way.
    'TPU v4': _tpu('v4', 275, 275, 32, 1200, 90, 6.25, 'v4',
                   'assumed: as v5p, 50 Gbps per chip'),
    # v5e: 197 TFLOP/s bf16, 394 int8, 16 GiB at 819 GB/s, 4 ICI ports (400 GB/s per chip
    # bidirectional); hosts of 8 chips with 2 x 100 Gbps NICs: 25 Gbps per chip.
    'TPU v5 lite': _tpu('v5e', 197, 394, 16, 819, 90, 3.125, 'v5e',
                        _CLOUD_TPU + 'v5e: 2 x 100 Gbps NICs per host of 8 chips'),
    # v5p: 459 TFLOP/s bf16, 918 int8, 95 GiB at 2,765 GB/s, 1,200 GB/s ICI per chip over 6
    # ports, 50 Gbps DCN per chip.
    'TPU v5': _tpu('v5p', 459, 918, 95, 2765, 180, 6.25, 'v5p',
                   _CLOUD_TPU + 'v5p: 50 Gbps DCN per chip'),
    # v6e: 918 TFLOP/s bf16, 1,836 int8, 32 GiB at 1,638 GB/s, 800 GB/s ICI per chip over 4
    # ports.
    'TPU v6 lite': _tpu('v6e', 918, 1836, 32, 1638, 180, 12.5, 'v6e',
                        'assumed: 100 Gbps per chip (4 x 200 Gbps NICs per host of 8)'),
}

_NVIDIA = 'https://www.nvidia.com/en-us/data-center/h100/ (H100 SXM datasheet)'
_NVIDIA_ASSUMED = {
    'step_overhead_s': 'assumed: a jitted step launch (no vendor figure)',
    'kernel_overhead_s': 'assumed: about 5 us per kernel launch (no vendor figure)',
    'collective_latency_s': 'assumed: about 10 us per NCCL collective (no vendor figure)',
    'f32': 'float32 matmuls at the default precision use TF32 tensor cores',
    'f32_highest': 'float32 at HIGHEST: the CUDA cores',
    'dcn_bandwidth': 'assumed: one 400 Gb/s InfiniBand NIC per GPU (DGX H100 / H200)',
    'ici_bandwidth': 'NVLink 4: 900 GB/s per GPU both directions, 450 GB/s each way',
}


def _nvidia(name: str, hbm_gib: float, hbm_gbps: float, page: str) -> Chip:
  # Dense (no 2:4 sparsity) tensor-core figures of the SXM part.
  return Chip(
      name=name,
      peak_flops={'bf16': 989e12, 'int8': 1979e12, 'f32': 494.7e12, 'f32_highest': 66.9e12,
                  'f64': 66.9e12},
      hbm_bytes=int(hbm_gib * GiB), hbm_bandwidth=hbm_gbps * GB, ici_bandwidth=450 * GB,
      dcn_bandwidth=50 * GB, step_overhead_s=50e-6, kernel_overhead_s=5e-6,
      collective_latency_s=10e-6,
      sources={'peak_flops': page + ' (dense tensor-core figures)', 'hbm': page,
               **_NVIDIA_ASSUMED})


GPUS: dict[str, Chip] = {
    'H100': _nvidia('H100', 80, 3350, _NVIDIA),
    'H200': _nvidia('H200', 141, 4800, 'https://www.nvidia.com/en-us/data-center/h200/ '
                    '(141 GB at 4.8 TB/s; the H100 SXM\'s compute)'),
}


def chip_for(device_kind: str) -> Chip | None:
  """The table's chip of a jax device_kind ('TPU v5 lite', 'NVIDIA H100 80GB HBM3', ...);
  None when the table does not know it."""
  if device_kind in CHIPS:
    return CHIPS[device_kind]
  for key, chip in GPUS.items():
    if key in device_kind:
      return chip
  return None


def table_markdown() -> str:
  """The chip table as markdown (docs/tpu.md)."""
  lines = ['| chip (jax device_kind) | bf16 TFLOP/s | f32 TFLOP/s (default precision) | '
           'HBM GiB | HBM GB/s | ICI GB/s (ring, per chip) | DCN GB/s per chip | source |',
           '|---|---|---|---|---|---|---|---|']
  for kind, chip in {**CHIPS, **{f'NVIDIA {k}': v for k, v in GPUS.items()}}.items():
    lines.append(f'| {chip.name} (`{kind}`) | {chip.peak_flops["bf16"] / 1e12:.0f} | '
                 f'{chip.peak_flops["f32"] / 1e12:.0f} | {chip.hbm_bytes / GiB:.0f} | '
                 f'{chip.hbm_bandwidth / GB:,.0f} | {chip.ici_bandwidth / GB:.0f} | '
                 f'{chip.dcn_bandwidth / GB:.3g} | {chip.sources["peak_flops"]} |')
  return '\n'.join(lines)


# --- The machine this process runs on. ---------------------------------------------------------

def _best_seconds(fn, repeats: int) -> float:
  fn()  # Compile and warm up.
  best = float('inf')
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    best = min(best, time.perf_counter() - start)
  return best


def measure_matmul(n: int = 2048, dtype='float32', repeats: int = 5) -> float:
  """FLOP/s of the best of `repeats` jitted n x n x n matmuls on the default device."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  a = jnp.ones((n, n), dtype)
  b = jnp.ones((n, n), dtype)
  f = jax.jit(lambda x, y: x @ y)
  return 2.0 * n ** 3 / _best_seconds(lambda: f(a, b).block_until_ready(), repeats)


def measure_bandwidth(megabytes: int = 256, repeats: int = 5) -> float:
  """Bytes/s of the best of `repeats` jitted element-wise passes over a float32 array of
  `megabytes` MB (one read and one write of each element), as an XLA fusion streams it."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  x = jnp.ones((megabytes * (1 << 20) // 4,), jnp.float32)
  f = jax.jit(lambda v: v * 1.0001 + 1.0)
  return 2.0 * x.nbytes / _best_seconds(lambda: f(x).block_until_ready(), repeats)


def measure_overheads(repeats: int = 20) -> tuple[float, float]:
  """(a jitted program's launch time, one kernel's launch time) on the default device: the
  best call of a program of one tiny op, and the best per-iteration time of a loop of 1,000
  iterations whose body is one tiny op (the loop's condition and body are a few kernels)."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from analysis import hlo_cost  # pylint: disable=import-outside-toplevel
  x = jnp.ones((8,), jnp.float32)
  one = jax.jit(lambda v: v + 1.0)
  step = _best_seconds(lambda: one(x).block_until_ready(), repeats)
  iterations = 1000
  loop = jax.jit(lambda v: jax.lax.fori_loop(0, iterations, lambda i, a: a * 0.5 + 1.0, v))
  compiled = loop.lower(x).compile()
  kernels = hlo_cost.analyze(compiled.as_text()).launches
  total = _best_seconds(lambda: compiled(x).block_until_ready(), max(3, repeats // 4))
  return step, max(0.0, total - step) / max(1.0, kernels)


def host_chip(dtype: str = 'float32') -> Chip:
  """The machine this process runs on (its default jax device) as a Chip, from measurements:
  a 2048^3 matmul in `dtype` (its FLOP/s stands for every operand class), a 256 MB
  element-wise pass (bytes/s), and the launch overheads. Nothing is fitted to a model."""
  import jax  # pylint: disable=import-outside-toplevel
  device = jax.devices()[0]
  peak = measure_matmul(dtype=dtype)
  bandwidth = measure_bandwidth()
  step, kernel = measure_overheads()
  how = 'measured here'
  return Chip(
      name=device.device_kind, peak_flops={'bf16': peak, 'int8': peak, 'f32': peak,
                                           'f32_highest': peak, 'f64': peak / 2},
      hbm_bytes=None, hbm_bandwidth=bandwidth, step_overhead_s=step, kernel_overhead_s=kernel,
      sources={'peak_flops': f'{how}: jitted 2048^3 {dtype} matmul, best of 5',
               'hbm': f'{how}: jitted element-wise pass over 256 MB (read + write), best of 5',
               'step_overhead_s': f'{how}: a jitted one-op program, best of 20',
               'kernel_overhead_s': f'{how}: a 1,000-iteration loop of one tiny op, per '
                                    'kernel launched'})
