"""XLA:CPU defaults applied before the first computation (flags are read at backend start)."""

import glob
import os
import re

# Fake host devices (--xla_force_host_platform_device_count=N) run their collectives on shared
# thread pools of max(cores, N) threads, and a thread that enters a collective blocks until all
# its peers arrive. One device may have several independent collectives in flight at once, so
# on a 2-core machine the blocked threads can fill the pool while other devices still wait for
# a thread to reach the collective they block on: the rendezvous times out after 40 s and the
# process aborts. Seen in CI with 8 devices: 4 threads in a collective-permute of all 8 and 3 in
# all-reduces and all-gathers of pairs, the other 4 devices never scheduled. Two defaults make
# it unlikely: XLA:CPU's concurrency-optimized scheduler off (it orders collectives to overlap;
# 2 aborts in 7 runs pinned to one core with it, 0 in 7 without, yet CI still met one), and
# THREADS_PER_FAKE_DEVICE threads per device in the pools (PJRT_NPROC, which XLA reads instead
# of the core count), so that blocked collectives cannot take every thread. Real accelerators
# and a single CPU device are unaffected.
FAKE_DEVICES_SAFE_SCHEDULER = '--xla_cpu_enable_concurrency_optimized_scheduler=false'
THREADS_PER_FAKE_DEVICE = 8

# XLA:CPU hands each matmul to YNNPACK as a fusion of its own ('individual_dot', the default),
# and there a batched matmul of small matrices (a blocked attention step: batch x heads
# products of 128 x 64 by 64 x 128) runs one matrix after another on one thread: 1.04 of 2
# cores, 280 ms for 136 such steps on a 2-core AMD EPYC. As 'dot' fusions YNNPACK spreads the
# same matmuls over the cores (1.91 cores, 159 ms), and a blocked causal attention layer's
# forward and backward at 2K (batch 8, 2 heads of 64) takes 834 ms instead of 1,250. Whole
# train steps: benchmarks/variant_speed.py, docs/variant_speed.md. The flag is experimental
# and an XLA that does not know it aborts at start, so it is set only on the jaxlib releases
# it was checked on (YNN_DOTS_JAXLIB: the flag and both fusion types are in the binaries of
# jaxlib 0.10.0-0.10.2, and 0.10.2 was measured; 0.8.3-0.9.2 know the flag too, 0.8.0 not).
YNN_DOTS = '--xla_cpu_experimental_ynn_fusion_type=+dot,-individual_dot'
YNN_DOTS_JAXLIB = ((0, 10, 0), (0, 11, 0))  # [first, past the last) checked release.
# Not at backend optimization level 0 (the tests' FAST_COMPILE; main.py never sets it): there
# the 'dot' fusions gave wrong results on jaxlib 0.10.2. A dynamic span model's decoding step
# with its cache read in a loop of chunks came out with logits off by up to 4.5, and not the same
# from run to run; at the default level, or at level 0 without them, it equals the forward pass.
NO_YNN_AT = '--xla_backend_optimization_level=0'


def _jaxlib_version() -> tuple[int, ...]:
  from importlib import metadata  # pylint: disable=import-outside-toplevel
  try:
    release = metadata.version('jaxlib')
  except metadata.PackageNotFoundError:
    return ()
  return tuple(int(part) for part in re.findall(r'\d+', release)[:3])


def _checked(releases: tuple[tuple[int, ...], tuple[int, ...]]) -> bool:
  """Whether the installed jaxlib is in [first, past) of `releases`."""
  first, past = releases
  return first <= _jaxlib_version() < past


# XLA:CPU without LLVM's optimization passes: compiles small programs several times faster
# and runs them slower, with the same results. For programs that are compiled once and run for
# milliseconds (the test suite uses it on CPU-only machines: tests/conftest.py).
#
# Fusions through XLA:CPU's older elemental emitter instead of its MLIR fusion emitters
# (--xla_cpu_use_fusion_emitters=false): the backend compile of five contract cases' gradient
# programs went from 20.0 to 9.1 s on a 2-core AMD EPYC with the same gradients to the last
# bit, and tests/contracts/test_model_contract.py from 332 to 176 s (user time 436 to 195 s).
# An XLA that does not know a flag aborts at start, so it is added only on the jaxlib releases
# it was found in (FUSION_EMITTERS_JAXLIB: the strings of jaxlib 0.7.0 and 0.10.2).
FUSION_EMITTERS_OFF = '--xla_cpu_use_fusion_emitters=false'
FUSION_EMITTERS_JAXLIB = ((0, 7, 0), (0, 11, 0))  # [first, past the last) checked release.


def fast_compile() -> str:
  """XLA_FLAGS for programs compiled once and run for milliseconds (see above)."""
  return ' '.join(
      ['--xla_backend_optimization_level=0', '--xla_llvm_disable_expensive_passes=true']
      + ([FUSION_EMITTERS_OFF] if _checked(FUSION_EMITTERS_JAXLIB) else []))


FAST_COMPILE = fast_compile()


def _cpu_has_avx512() -> bool:
  try:
    with open('/proc/cpuinfo') as f:
      return 'avx512f' in f.read()
  except OSError:
    return False


def fake_cpu_devices(count: int) -> str:
  """XLA_FLAGS for `count` fake CPU devices, with the scheduler that keeps their collectives
  from overlapping (fake_cpu_env adds the thread count)."""
  flags = f'--xla_force_host_platform_device_count={count}'
  return f'{flags} {FAKE_DEVICES_SAFE_SCHEDULER}' if count > 1 else flags


def fake_cpu_env(count: int) -> dict[str, str]:
  """Environment variables for a process with `count` fake CPU devices (XLA_FLAGS and, with
  several devices, PJRT_NPROC: see THREADS_PER_FAKE_DEVICE)."""
  env = {'XLA_FLAGS': fake_cpu_devices(count)}
  if count > 1:
    env['PJRT_NPROC'] = str(THREADS_PER_FAKE_DEVICE * count)
  return env


def set_cpu_defaults() -> None:
  """XLA:CPU defaults; an explicit setting of a flag in XLA_FLAGS wins.

  - On AVX-512 machines, element-wise fusions are vectorized 512 bits wide: it shortens the
    d=8 train step by a few percent on such a CPU (benchmarks/train_step.py).
  - Matmuls as YNNPACK 'dot' fusions, which spread batched small matmuls over the cores
    (YNN_DOTS says why and where), on the jaxlib releases where it was checked, unless
    XLA_FLAGS sets the YNN fusion types or backend optimization level 0 (NO_YNN_AT).
  - With several fake host devices, the scheduler that does not overlap collectives and
    THREADS_PER_FAKE_DEVICE threads per device (PJRT_NPROC, unless set), so that collectives
    do not starve each other (the comment on FAKE_DEVICES_SAFE_SCHEDULER says why).
  Other backends ignore these.
  """
  flags = os.environ.get('XLA_FLAGS', '')
  if 'xla_cpu_prefer_vector_width' not in flags and _cpu_has_avx512():
    flags += ' --xla_cpu_prefer_vector_width=512'
  if ('xla_cpu_experimental_ynn_fusion_type' not in flags and NO_YNN_AT not in flags
      and _checked(YNN_DOTS_JAXLIB)):
    flags += ' ' + YNN_DOTS
  fake = re.search(r'xla_force_host_platform_device_count=(\d+)', flags)
  count = int(fake.group(1)) if fake else 1
  if count > 1 and 'xla_cpu_enable_concurrency_optimized_scheduler' not in flags:
    flags += ' ' + FAKE_DEVICES_SAFE_SCHEDULER
  if count > 1:
    os.environ.setdefault('PJRT_NPROC', str(THREADS_PER_FAKE_DEVICE * count))
  os.environ['XLA_FLAGS'] = flags.strip()


# Device files whose presence means a machine may have an accelerator JAX should look for.
ACCELERATOR_DEVICE_FILES = ('/dev/accel*', '/dev/vfio/[0-9]*', '/dev/nvidia[0-9]*', '/dev/kfd')


def skip_absent_tpu() -> None:
  """On a machine with no accelerator device file: JAX_PLATFORMS=cpu (unless set) and
  ALLOW_MULTIPLE_LIBTPU_LOAD=1. Call it before importing jax.

  With libtpu installed (requirements.txt brings it for --mode=compile) JAX otherwise tries to
  start a TPU at the first computation of every process and prints a screen of
  TPU_WORKER_HOSTNAMES errors; compiling for a TPU topology ahead of time
  (jax.experimental.topologies) does not need the TPU backend started. libtpu also takes a
  machine-wide lock file when it loads, which makes a second process that compiles for a
  topology at the same time (tests, a benchmark beside a run) fail; with no TPU to share,
  the lock guards nothing. A machine with a TPU, GPU or ROCm device is left alone.
  """
  if any(glob.glob(pattern) for pattern in ACCELERATOR_DEVICE_FILES):
    return
  os.environ.setdefault('JAX_PLATFORMS', 'cpu')
  os.environ.setdefault('ALLOW_MULTIPLE_LIBTPU_LOAD', '1')
