"""Which path `attention_impl='auto'` runs on a CPU: what was measured fastest on this kind of
CPU, read from a committed file.

The C++ tile kernel (cpu_kernel.py) was tuned on one host. On another it can lose to XLA's
plain-JAX block-sparse path: on a 2-core Intel Xeon the C4 recipe's d=8 train step ran 440-460
tokens/s with the kernel and 535 without. So 'auto' runs the kernel only for a variant where it
was measured faster on this CPU model and core count, and the XLA path elsewhere.

The measurements are an input of the run, not a cache: results/cpu_paths.json, committed with
the code and keyed by CPU model and core count ("AMD EPYC / 2 cores"), so the same command
builds the same program on the same kind of machine. `python -m benchmarks.cpu_choice`
measures both paths on this CPU and writes its entry there (commit it). $ZOO_CPU_CHOICE names
another file instead (the test suite writes its own). Each start of training logs and records
(config_history.jsonl) which file and entry decided (`source`).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import platform
from pathlib import Path

KERNEL, XLA = 'cpu_kernel', 'blocksparse'
COMMAND = 'python -m benchmarks.cpu_choice'


# The committed measurements (results/ beside the package).
COMMITTED = Path(__file__).resolve().parents[2] / 'results' / 'cpu_paths.json'


def path() -> Path:
  """The file that holds the measured choices: $ZOO_CPU_CHOICE, else COMMITTED."""
  if os.environ.get('ZOO_CPU_CHOICE'):
    return Path(os.environ['ZOO_CPU_CHOICE'])
  return COMMITTED


def cpu_model() -> str:
  """This CPU's model name (/proc/cpuinfo's, else the platform's)."""
  try:
    with open('/proc/cpuinfo') as f:
      for line in f:
        if line.startswith('model name'):
          return line.split(':', 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine() or 'unknown CPU'


def host_key() -> str:
  """The entry of this kind of machine: CPU model and core count."""
  return f'{cpu_model()} / {os.cpu_count()} cores'


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


def source() -> dict:
  """What decides 'auto' on this CPU, for the run's record: the file, this machine's entry,
  and its choices ({} where nothing was measured: the XLA path)."""
  return {'file': str(path()), 'entry': host_key(), 'choice': measured()}


@functools.cache
def _warn_unmeasured(variant: str) -> None:
  logging.info("attention_impl=auto on this CPU: %s has no entry for %r, so %s runs the XLA "
               "path ('blocksparse'); `%s` measures both paths and writes the entry",
               path(), host_key(), variant, COMMAND)


def kernel_is_faster(variant: str) -> bool:
  """Whether the kernel was measured faster than the XLA path for `variant` on this kind of
  CPU."""
  choice = measured().get(variant)
  if choice is None:
    _warn_unmeasured(variant)
  return choice == KERNEL


def record(choice: dict[str, str], evidence: dict) -> Path:
  """Saves this kind of CPU's choices ({variant class name: path}) with what they were
  measured from, in path(); other CPUs' entries in the file are kept."""
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
