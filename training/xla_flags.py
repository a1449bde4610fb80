"""XLA:CPU defaults applied before the first computation (flags are read at backend start)."""

import os
import re

# XLA:CPU's concurrency-optimized scheduler lets one device run several independent collectives
# at once. With fake host devices (--xla_force_host_platform_device_count=N) the N devices share
# a thread pool of about one thread per core, and on a 2-core machine devices can block in
# different collectives, each waiting for a peer that has no thread left: the rendezvous times
# out after 40 s and the process aborts (seen in CI on the 8-device sharding test, and here in
# 2 of 7 runs pinned to one core; 0 of 7 with this scheduler off). Real accelerators and a
# single CPU device are unaffected.
FAKE_DEVICES_SAFE_SCHEDULER = '--xla_cpu_enable_concurrency_optimized_scheduler=false'


def _cpu_has_avx512() -> bool:
  try:
    with open('/proc/cpuinfo') as f:
      return 'avx512f' in f.read()
  except OSError:
    return False


def fake_cpu_devices(count: int) -> str:
  """XLA_FLAGS for `count` fake CPU devices that cannot deadlock in their collectives."""
  flags = f'--xla_force_host_platform_device_count={count}'
  return f'{flags} {FAKE_DEVICES_SAFE_SCHEDULER}' if count > 1 else flags


def set_cpu_defaults() -> None:
  """XLA:CPU defaults; an explicit setting of a flag in XLA_FLAGS wins.

  - On AVX-512 machines, element-wise fusions are vectorized 512 bits wide: it shortens the
    d=8 train step by a few percent on such a CPU (benchmarks/train_step.py).
  - With several fake host devices, the scheduler that keeps each device's collectives in one
    order (FAKE_DEVICES_SAFE_SCHEDULER says why).
  Other backends ignore both.
  """
  flags = os.environ.get('XLA_FLAGS', '')
  if 'xla_cpu_prefer_vector_width' not in flags and _cpu_has_avx512():
    flags += ' --xla_cpu_prefer_vector_width=512'
  fake = re.search(r'xla_force_host_platform_device_count=(\d+)', flags)
  if (fake and int(fake.group(1)) > 1
      and 'xla_cpu_enable_concurrency_optimized_scheduler' not in flags):
    flags += ' ' + FAKE_DEVICES_SAFE_SCHEDULER
  os.environ['XLA_FLAGS'] = flags.strip()
