"""What a compiled program says about itself: memory, FLOPs and collectives per chip.

training/aot.py compiles a run's programs; this module reads each compiled program into a
`StepReport`: the compiler's memory analysis (arguments, outputs, temporaries, code), XLA's own
FLOP count (each loop body once), the matmul FLOPs with every loop's trip count and the roofline
estimate on the chip (analysis/hlo_cost.py, analysis/roofline.py), the collectives in its HLO,
and the amounts in the TPU compiler's out-of-memory message when it refused the program. It
also gives what one chip holds of a sharded tree and the HBM of a chip. training/
compile_report.py turns the reports into the mode's table and JSON.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from analysis import chips, hlo_cost, roofline

GiB = 1 << 30

# HBM per chip by jax device_kind (the compile-only devices of a topology have no
# memory_stats; a real TPU's own bytes_limit is used when it reports one): chips.CHIPS.
HBM_BYTES = {kind: chip.hbm_bytes for kind, chip in chips.CHIPS.items()}

COLLECTIVES = hlo_cost.COLLECTIVES


def hbm_bytes(device: jax.Device) -> int | None:
  """HBM of one chip: the device's own limit when it reports one (a real TPU), else the
  HBM_BYTES table by device_kind; None when neither knows."""
  try:
    stats = device.memory_stats()
  except Exception:  # pylint: disable=broad-except  (compile-only devices have none)
    stats = None
  if stats and stats.get('bytes_limit'):
    return int(stats['bytes_limit'])
  return HBM_BYTES.get(device.device_kind)


def per_device_bytes(tree) -> int:
  """Bytes one device holds of a tree of ShapeDtypeStructs with NamedShardings (each leaf's
  shard shape, so replicated leaves count whole)."""
  total = 0
  for leaf in jax.tree.leaves(tree):
    shape = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
    total += int(np.prod(shape, dtype=np.int64)) * jnp.dtype(leaf.dtype).itemsize
  return total


# --- Collectives in compiled HLO text. ----------------------------------------------------

def collectives(hlo_text: str) -> dict[str, dict[str, int]]:
  """Count and result bytes of each kind of collective in a compiled HLO module's text, each
  instruction once (hlo_cost.collectives; the estimate counts them with their trip counts).

  Args:
    hlo_text: `compiled.as_text()`.

  Returns:
    {kind: {'count': n, 'bytes': b}} for each kind in COLLECTIVES (zeros when absent).
  """
  return hlo_cost.collectives(hlo_text)


# --- One compiled program. ------------------------------------------------------------

@dataclasses.dataclass
class StepReport:
  """One compiled program.

  Attributes:
    name: 'train', 'eval' or 'decode'.
    lower_seconds: tracing and lowering to StableHLO.
    compile_seconds: the TPU compiler.
    memory: per chip, from compiled.memory_analysis(): argument_bytes, output_bytes,
      alias_bytes (outputs written in place of donated inputs), temp_bytes,
      generated_code_bytes, and total_bytes = arguments + outputs - aliased + temporaries +
      code (what is live at once, at most).
    xla_flops: compiled.cost_analysis()['flops'] per chip (loop bodies counted once).
    flops: matmul FLOPs per chip with every loop's trip count and the splash kernel's own
      count (hlo_cost.analyze); 0 until `analyze`.
    collectives: {kind: {'count', 'bytes'}} (`collectives`: each instruction once).
    estimate: the roofline estimate on the chip (roofline.Estimate.to_json()); {} when the
      chip is not in chips.CHIPS or the program was not analyzed.
    detail: what was compiled (rows, lengths).
    skipped: why the program was not compiled ('' when it was).
    out_of_memory: the compiler's message when it refused the program for not fitting HBM
      ('' otherwise); memory, FLOPs and collectives are then unknown.
  """
  name: str
  lower_seconds: float = 0.0
  compile_seconds: float = 0.0
  memory: dict[str, int] = dataclasses.field(default_factory=dict)
  xla_flops: float = 0.0
  flops: float = 0.0
  collectives: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
  estimate: dict[str, Any] = dataclasses.field(default_factory=dict)
  detail: str = ''
  skipped: str = ''
  out_of_memory: str = ''

  @property
  def total_bytes(self) -> int:
    return self.memory.get('total_bytes', 0)

  @property
  def collective_bytes(self) -> int:
    return sum(c['bytes'] for c in self.collectives.values())


def read(report: StepReport, compiled) -> None:
  """Fills `report` from a compiled program: the compiler's memory analysis, XLA's FLOP
  count (loop bodies once) and the collectives of its HLO text."""
  stats = compiled.memory_analysis()
  if stats is not None:
    memory = {
        'argument_bytes': int(stats.argument_size_in_bytes),
        'output_bytes': int(stats.output_size_in_bytes),
        'alias_bytes': int(stats.alias_size_in_bytes),
        'temp_bytes': int(stats.temp_size_in_bytes),
        'generated_code_bytes': int(stats.generated_code_size_in_bytes),
    }
    memory['total_bytes'] = (memory['argument_bytes'] + memory['output_bytes']
                             - memory['alias_bytes'] + memory['temp_bytes']
                             + memory['generated_code_bytes'])
    report.memory = memory
  costs = compiled.cost_analysis()
  if isinstance(costs, (list, tuple)):  # Older jax: one dict per program.
    costs = costs[0] if costs else {}
  report.xla_flops = float((costs or {}).get('flops', 0.0))
  report.collectives = collectives(compiled.as_text())


def module_text(compiled) -> str:
  """The optimized HLO text of a jax Compiled, with its large constants printed when it calls
  a Mosaic kernel (the splash kernel's block tables are constants that `as_text()` elides);
  `as_text()` otherwise."""
  text = compiled.as_text()
  if 'tpu_custom_call' not in text:
    return text
  try:
    import jaxlib._hlo as hlo_lib  # pylint: disable=import-outside-toplevel
    options = hlo_lib.HloPrintOptions()
    options.print_large_constants = True
    modules = compiled.runtime_executable().hlo_modules()
    return modules[0].to_string(options) if len(modules) == 1 else text
  except Exception:  # pylint: disable=broad-except  (an older jaxlib: the elided text)
    return text


def analyze(report: StepReport, compiled, mesh: jax.sharding.Mesh,
            chip: chips.Chip | None) -> roofline.Estimate | None:
  """Counts a compiled program's work (hlo_cost.analyze: FLOPs with trip counts) into
  `report` and, when the chip is known, its roofline estimate on `mesh`'s devices (also
  returned)."""
  cost = hlo_cost.analyze(module_text(compiled))
  report.flops = cost.flops
  if chip is None:
    return None
  mesh_devices = list(mesh.devices.flat)
  slices = [getattr(d, 'slice_index', 0) or 0 for d in mesh_devices]
  est = roofline.estimate(cost, chip, devices=len(mesh_devices), slice_of=slices)
  report.estimate = est.to_json()
  return est


# --- The TPU compiler's out-of-memory message. --------------------------------------------

_UNITS = {'': 1, 'K': 1 << 10, 'M': 1 << 20, 'G': 1 << 30, 'T': 1 << 40}
# "... required for HLO temporaries (209.11G) exceeds available HBM (15.75G)."
_EXHAUSTED = re.compile(r'\(([\d.]+)([KMGT]?)\) exceeds available HBM \(([\d.]+)([KMGT]?)\)')


def compiler_amounts(message: str) -> tuple[int, int] | None:
  """(bytes needed, bytes available) from the TPU compiler's out-of-memory message, if it
  states them."""
  found = _EXHAUSTED.search(message)
  if not found:
    return None
  needed, unit, available, unit2 = found.groups()
  return int(float(needed) * _UNITS[unit]), int(float(available) * _UNITS[unit2])
