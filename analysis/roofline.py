"""A step time from the compiled program and the chip: the roofline estimate.

For one device's program (analysis/hlo_cost.py `analyze`: every kernel with its matmul FLOPs,
HBM bytes and run count, loops counted with their trip counts; every collective) on one chip
(analysis/chips.py):

- compute: each kernel's matmul FLOPs over the chip's peak for their operand type;
- memory: each kernel's HBM bytes over the chip's HBM bandwidth;
- a kernel takes the longer of its two (it is compute- or memory-bound), so the kernels take
  sum(max(compute, memory)) >= max(sum compute, sum memory);
- collectives: each collective's ring traffic over the chip's ICI bandwidth, or its DCN
  bandwidth when its group spans slices, plus a fixed latency each; they run beside the
  kernels (asynchronous collectives overlap compute), so the two overlap: max(kernels,
  collectives);
- overhead: a fixed time per step and per kernel launched.

step = max(kernels, collectives) + overhead. The bound named is the largest of the four parts
(compute: the time of the compute-bound kernels; memory: of the memory-bound ones;
collectives; overhead). It can only be optimistic about what the chip does (peak FLOP/s and
full bandwidth for every kernel, perfect overlap), except where it assumes an overhead.

  cost = hlo_cost.analyze(program_stats.module_text(compiled))
  est = roofline.estimate(cost, chips.chip_for(device.device_kind), devices=4)
  est.step_s, est.bound, est.mfu(model_flops)
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from analysis import chips as chips_lib
from analysis import hlo_cost

BOUNDS = ('compute', 'memory', 'collectives', 'overhead')


@dataclasses.dataclass
class Estimate:
  """The roofline estimate of one program on one chip, per step (seconds).

  Attributes:
    chip: the chip's name.
    compute_s: sum of matmul FLOPs over peak, every kernel.
    memory_s: sum of HBM bytes over bandwidth, every kernel.
    kernels_s: sum over kernels of the longer of the two.
    compute_bound_s / memory_bound_s: the part of kernels_s from compute-bound / memory-bound
      kernels.
    collectives_s: the collectives' time (ICI and DCN).
    dcn_s: the part of collectives_s over the data-center network.
    overhead_s: the fixed per-step and per-kernel time.
    step_s: max(kernels_s, collectives_s) + overhead_s.
    bound: 'compute', 'memory', 'collectives' or 'overhead': the largest part.
    flops: matmul FLOPs per step on one device (loops counted).
    bytes: HBM bytes per step on one device.
    collective_bytes: bytes each device sends per step.
    launches: kernels launched per step.
    unknown_loops: loops of unknown trip count (counted once: the estimate is low).
    opaque: custom calls counted without FLOPs ({target: runs}).
    notes: what the count could not read.
  """
  chip: str
  compute_s: float
  memory_s: float
  kernels_s: float
  compute_bound_s: float
  memory_bound_s: float
  collectives_s: float
  dcn_s: float
  overhead_s: float
  step_s: float
  bound: str
  flops: float
  bytes: float
  collective_bytes: float
  launches: float
  unknown_loops: int = 0
  opaque: dict = dataclasses.field(default_factory=dict)
  notes: list = dataclasses.field(default_factory=list)

  @property
  def steps_per_day(self) -> float:
    return 86400.0 / self.step_s if self.step_s > 0 else float('inf')

  def mfu(self, model_flops: float, peak: float) -> float:
    """Model FLOPs per step and device over (step time x the chip's peak)."""
    return model_flops / (self.step_s * peak) if self.step_s > 0 and peak else 0.0

  def parts(self) -> dict[str, float]:
    return {'compute': self.compute_bound_s, 'memory': self.memory_bound_s,
            'collectives': self.collectives_s, 'overhead': self.overhead_s}

  def to_json(self) -> dict:
    return dataclasses.asdict(self)


def traffic(c: hlo_cost.Collective, devices: int, slices: int = 1) -> float:
  """Bytes each device sends in one run of collective `c`, as the ring algorithm does
  (all-gather and all-to-all (n-1)/n of the result, reduce-scatter n-1 shards, all-reduce
  twice (n-1)/n, a permute its buffer) among the n devices of its group: `devices` for every
  device or unknown groups; for a transfer between slices its participants, else `slices`."""
  if c.over_dcn:
    n = c.participants or max(2, slices)
  else:
    n = 2 if c.kind == 'collective-permute' else (max(map(len, c.groups)) if c.groups
                                                   else devices)
  b = float(c.bytes)
  return 0.0 if n <= 1 else {
      'all-gather': b * (n - 1) / n, 'all-to-all': b * (n - 1) / n,
      'reduce-scatter': b * (n - 1), 'all-reduce': 2 * b * (n - 1) / n}.get(c.kind, b)


def spans(c: hlo_cost.Collective, slice_of: Sequence[int] | None) -> bool:
  """Whether a group of collective `c` holds devices of different slices (its bytes cross the
  data-center network); `slice_of[i]` is logical device i's slice."""
  if c.over_dcn:
    return True
  if slice_of is None or len(set(slice_of)) <= 1:
    return False
  return not c.groups or any(len({slice_of[i] for i in g if i < len(slice_of)}) > 1
                             for g in c.groups)


def estimate(cost: hlo_cost.Cost, chip: chips_lib.Chip, devices: int = 1,
             slice_of: Sequence[int] | None = None) -> Estimate:
  """The roofline step time of the program `cost` describes on `chip`.

  Args:
    cost: one device's program (hlo_cost.analyze).
    chip: the chip it runs on.
    devices: devices of the program (a collective over every device has this many).
    slice_of: the slice of each logical device id of the program (multi-slice); None: one.
  """
  compute = memory = kernels = compute_bound = memory_bound = 0.0
  for k in cost.kernels:
    c = sum(f / chip.peak(klass) for klass, f in k.flops.items())
    m = k.bytes / chip.hbm_bandwidth if chip.hbm_bandwidth else 0.0
    compute += k.times * c
    memory += k.times * m
    kernels += k.times * max(c, m)
    if c >= m:
      compute_bound += k.times * c
    else:
      memory_bound += k.times * m
  collectives = dcn = sent = 0.0
  slices = len(set(slice_of)) if slice_of is not None else 1
  for c in cost.collectives:
    sends = traffic(c, devices, slices)
    if sends <= 0:
      continue
    over_dcn = spans(c, slice_of)
    bandwidth = chip.dcn_bandwidth if over_dcn else chip.ici_bandwidth
    seconds = c.times * (sends / bandwidth if bandwidth else 0.0)
    seconds += c.times * chip.collective_latency_s
    collectives += seconds
    dcn += seconds if over_dcn else 0.0
    sent += c.times * sends
  overhead = chip.step_overhead_s + cost.launches * chip.kernel_overhead_s
  step = max(kernels, collectives) + overhead
  parts = {'compute': compute_bound, 'memory': memory_bound, 'collectives': collectives,
           'overhead': overhead}
  bound = max(BOUNDS, key=lambda b: parts[b])
  return Estimate(chip=chip.name, compute_s=compute, memory_s=memory, kernels_s=kernels,
                  compute_bound_s=compute_bound, memory_bound_s=memory_bound,
                  collectives_s=collectives, dcn_s=dcn, overhead_s=overhead, step_s=step,
                  bound=bound, flops=cost.flops, bytes=cost.bytes, collective_bytes=sent,
                  launches=cost.launches, unknown_loops=cost.unknown_loops,
                  opaque=dict(cost.opaque), notes=list(cost.notes))


def duration(seconds: float) -> str:
  """A time in the unit that reads best: '3.2 ms', '41 us', '2.5 h', '1.7 days'."""
  for unit, scale in (('days', 86400.0), ('h', 3600.0), ('min', 60.0), ('s', 1.0),
                      ('ms', 1e-3), ('us', 1e-6)):
    if seconds >= scale:
      return f'{seconds / scale:.3g} {unit}'
  return f'{seconds * 1e9:.3g} ns'
