"""A TPU slice that is not here, described from any host: its compile-only devices.

jax.experimental.topologies asks libtpu for the devices of a named slice (v5e:4x4, v4:2x2x4,
...); training/aot.py compiles a run's programs for them. On a host that is not a Cloud TPU VM
libtpu prints start-up warnings that read as failures: they are held back here, and the slice's
names (Cloud TPU's accelerator type, the slice name) are worked out from the topology's.
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import os
import sys
import tempfile

import jax
from jax.experimental import topologies

from configs import slice_name
from training import xla_flags

# Topology name prefixes whose chips hold two TensorCores that JAX drives as one device
# (megacore): without chip_config_name='megacore', libtpu describes v4:2x2x4 as 32 devices
# where the real v4-32 slice has 16.
MEGACORE_PREFIXES = ('v4', 'v5p', 'v5:')

NO_LIBTPU = ('jax has no TPU support on this machine (the libtpu package is not installed): '
             'install it with pip install \'jax[tpu]\' (Linux x86-64 only; requirements.txt '
             'does this there). On macOS or ARM, run --mode=compile on a Linux x86-64 machine '
             'or a Cloud TPU VM')


# What libtpu prints when it starts on a host that is not a Cloud TPU VM (it asks the VM's
# metadata server for the slice it is on, finds none, and says so on the C-level stderr):
# warnings about TPU_ACCELERATOR_TYPE and TPU_WORKER_HOSTNAMES and an INVALID_ARGUMENT error
# line with its source trace. None of it matters to a compile for a described topology.
LIBTPU_NOISE = ('TPU_ACCELERATOR_TYPE', 'TPU_WORKER_HOSTNAMES', 'Failed to find host bounds',
                'Logging before InitGoogle()', 'unexpected worker hostname',
                '=== Source Location Trace', 'libtpu_init_utils', 'could not determine TPU')


def accelerator_type(topology: str) -> str:
  """Cloud TPU's accelerator type of a topology name: v5e:2x2 is v5litepod-4, v4:2x2x4 is
  v4-32, v6e:2x2 is v6e-4."""
  try:
    name = slice_name(topology)
  except ValueError:  # Not GENERATION:SHAPE; libtpu will say what it makes of it.
    return topology
  return name.replace('v5e-', 'v5litepod-', 1)


@contextlib.contextmanager
def _quiet_libtpu(topology: str):
  """On a host without a TPU: libtpu starts (at the first topology described) without its
  warnings and error lines, which would read as a failure.

  libtpu reads the slice it is on from TPU_ACCELERATOR_TYPE and TPU_WORKER_HOSTNAMES, else
  from the VM's metadata server, which a host that is not a TPU VM lacks. They are set for the
  call, to the topology described and this host (unless set), and put back after: the compiled
  programs do not depend on them (the same HLO for every value tried). What libtpu still
  writes to the C-level stderr during the call is held back, and every line but the known
  start-up noise (LIBTPU_NOISE) is written out again. A machine with an accelerator is left
  alone."""
  if any(glob.glob(pattern) for pattern in xla_flags.ACCELERATOR_DEVICE_FILES):
    yield
    return
  saved = {k: os.environ.get(k) for k in ('TPU_ACCELERATOR_TYPE', 'TPU_WORKER_HOSTNAMES')}
  os.environ.setdefault('TPU_ACCELERATOR_TYPE', accelerator_type(topology))
  os.environ.setdefault('TPU_WORKER_HOSTNAMES', 'localhost')
  sys.stderr.flush()
  held = tempfile.TemporaryFile(mode='w+b')
  stderr_fd = os.dup(2)
  os.dup2(held.fileno(), 2)
  try:
    yield
  finally:
    sys.stderr.flush()
    os.dup2(stderr_fd, 2)
    os.close(stderr_fd)
    held.seek(0)
    text = held.read().decode(errors='replace')
    held.close()
    for k, v in saved.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v
    kept = [line for line in text.splitlines() if line.strip()
            and not any(noise in line for noise in LIBTPU_NOISE)]
    if kept:
      sys.stderr.write('\n'.join(kept) + '\n')
      sys.stderr.flush()


def topology_devices(topology: str, num_slices: int = 1) -> list[jax.Device]:
  """The compile-only devices of `num_slices` slices of a TPU topology.

  Args:
    topology: a name jax.experimental.topologies.get_topology_desc takes, e.g. 'v5e:2x2',
      'v5e:4x4', 'v4:2x2x4', 'v5p:2x2x2', 'v6e:2x2'.
    num_slices: slices joined over the data-center network.

  Returns:
    The devices, one per chip (megacore chips are one device, as on the real slice).

  Raises:
    ValueError: no topology given, libtpu missing, or a name libtpu does not know.
  """
  if not topology:
    raise ValueError('set --config.compile_topology to the TPU slice to compile for, e.g. '
                     'v5e:2x2, v5e:4x4 (v5e-16), v4:2x2x4 (v4-32), v5p:2x2x2 or v6e:2x2')
  if isinstance(num_slices, bool) or not isinstance(num_slices, int) or num_slices < 1:
    raise ValueError(f'compile_topology_num_slices must be an integer >= 1, got {num_slices!r}')
  if importlib.util.find_spec('libtpu') is None:
    raise ValueError(NO_LIBTPU)
  if not any(glob.glob(pattern) for pattern in xla_flags.ACCELERATOR_DEVICE_FILES):
    # libtpu takes /tmp/libtpu_lockfile for the process that loads it, so that two processes
    # never drive one TPU; a second compile on a host without a TPU (another shell, a test's
    # subprocess) would fail with "Internal error when accessing libtpu multi-process
    # lockfile". There is no TPU here for the lock to guard.
    os.environ.setdefault('ALLOW_MULTIPLE_LIBTPU_LOAD', '1')
  chip = 'megacore' if topology.startswith(MEGACORE_PREFIXES) else 'default'
  try:
    with _quiet_libtpu(topology):
      desc = topologies.get_topology_desc(topology_name=topology, platform='tpu',
                                          chip_config_name=chip, num_slices=num_slices)
  except Exception as e:  # pylint: disable=broad-except  (libtpu raises several kinds)
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    raise ValueError(f'libtpu cannot describe the TPU topology {topology!r} ({first}); use '
                     'GENERATION:SHAPE as Cloud TPU names the chip layout, e.g. v5e:2x2, '
                     'v5e:4x4, v4:2x2x4, v5p:2x2x2, v6e:2x2') from e
  return list(desc.devices)
