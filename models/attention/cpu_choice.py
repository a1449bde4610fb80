"""Which path `attention_impl='auto'` runs on a CPU: what was measured fastest on this CPU.

The C++ tile kernel (cpu_kernel.py) was tuned on one host. On another it can lose to XLA's
plain-JAX block-sparse path: on a 2-core Intel Xeon the C4 recipe's d=8 train step ran 440-460
tokens/s with the kernel and 535 without, where on the AMD EPYC it was tuned on the kernel
won. A kernel tuned on one CPU is no default for all of them, so 'auto' runs the kernel only
where it was measured faster on this CPU, variant by variant, and the XLA path where nothing
was measured.

`python -m benchmarks.cpu_choice` measures both paths' train steps for each static-pattern
variant and records the faster here. The record is keyed by the CPU (model, flags, core
count) and by the kernel's build (its sources, flags and jax version: the library's cache
key), so a record is never applied to another CPU or to a changed kernel. It lives beside the
kernel's build, in $ZOO_KERNEL_CACHE/cpu_choice.json, or wherever $ZOO_CPU_CHOICE points.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from pathlib import Path

from models.attention import cpu_kernel

KERNEL, XLA = 'cpu_kernel', 'blocksparse'
COMMAND = 'python -m benchmarks.cpu_choice'


def path() -> Path:
  """The file that holds the measured choices."""
  if os.environ.get('ZOO_CPU_CHOICE'):
    return Path(os.environ['ZOO_CPU_CHOICE'])
  return cpu_kernel.cache_dir() / 'cpu_choice.json'


def host_key() -> str:
  """This CPU and this build of the kernel: the kernel library's cache key (sources, flags,
  jax, CPU model and flags) and the core count."""
  return f'{cpu_kernel.library_key()}-{os.cpu_count()}cpu'


def _read() -> dict:
  try:
    with open(path()) as f:
      return json.load(f)
  except FileNotFoundError:
    return {}
  except (OSError, ValueError) as e:
    logging.warning('cannot read the CPU path choices %s (%s): attention_impl=auto runs the '
                    'XLA path; `%s` measures again', path(), e, COMMAND)
    return {}


def measured() -> dict[str, str]:
  """{variant class name: 'cpu_kernel' or 'blocksparse'} measured on this CPU ({} if none)."""
  return dict(_read().get(host_key(), {}).get('choice', {}))


@functools.cache
def _warn_unmeasured(variant: str) -> None:
  logging.info("attention_impl=auto on this CPU: the C++ kernel has not been measured against "
               "the XLA path here, so %s runs the XLA path ('blocksparse'); `%s` measures "
               'both and makes auto pick the faster', variant, COMMAND)


def kernel_is_faster(variant: str) -> bool:
  """Whether the kernel was measured faster than the XLA path for `variant` on this CPU."""
  choice = measured().get(variant)
  if choice is None:
    _warn_unmeasured(variant)
  return choice == KERNEL


def record(choice: dict[str, str], evidence: dict) -> Path:
  """Saves this CPU's choices ({variant class name: path}) with what they were measured
  from; other CPUs' records in the file are kept."""
  bad = {k: v for k, v in choice.items() if v not in (KERNEL, XLA)}
  if bad:
    raise ValueError(f'a CPU path choice is {KERNEL!r} or {XLA!r}, got {bad}')
  records = _read()
  records[host_key()] = {'choice': dict(choice), 'evidence': evidence}
  target = path()
  target.parent.mkdir(parents=True, exist_ok=True)
  tmp = target.with_suffix('.tmp')
  with open(tmp, 'w') as f:
    json.dump(records, f, indent=1, sort_keys=True)
  os.replace(tmp, target)
  return target
