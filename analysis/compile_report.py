"""The --mode=compile report: a run's compiled programs on one chip of a TPU slice.

training/aot.py compiles the programs and analysis/program_stats.py reads each into a
StepReport; a `Report` holds them with the slice (chips, HBM, mesh) and the state's bytes per
chip, and says whether each program fits one chip's HBM, the train step's roofline estimate as
steps per day and MFU, the console table (`Report.table`), the JSON written to
WORKDIR/compile_<topology>.json (`Report.to_json`, `report_filename`), and, for a train step
that does not fit, what to try (`does_not_fit`).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from analysis import chips, program_stats, roofline

NOTE = ('Memory is the TPU compiler\'s estimate for the compiled programs; FLOPs and bytes are '
        'counted from them with every loop\'s trip count (XLA\'s own FLOPs count a loop body '
        'once); speed is not measured (nothing ran): the time is a roofline estimate from '
        'those counts and the chip\'s published peak FLOP/s, HBM and interconnect bandwidth '
        '(analysis/chips.py), the bound named. Collectives are counted once per instruction in '
        'the table, with their trip counts in the estimate.')


def report_filename(topology: str, num_slices: int = 1) -> str:
  """compile_<topology>[_<n>slices].json, the topology's name made a safe file name."""
  name = re.sub(r'[^A-Za-z0-9]+', '_', topology).strip('_')
  return f'compile_{name}' + (f'_{num_slices}slices' if num_slices > 1 else '') + '.json'


def size(n: float | None) -> str:
  """Bytes as text in binary units, e.g. '1.50 GiB'."""
  if n is None:
    return '?'
  for unit, scale in (('GiB', 1 << 30), ('MiB', 1 << 20), ('KiB', 1 << 10)):
    if abs(n) >= scale:
      return f'{n / scale:.2f} {unit}'
  return f'{int(n)} B'


@dataclasses.dataclass
class Report:
  """What compiling a run's programs for a TPU slice says, per chip.

  Attributes:
    topology: the topology name (or the device kind of a real slice).
    num_slices: slices.
    device_kind: jax's device_kind of the chips.
    chips: devices of the mesh.
    hbm_bytes: HBM of one chip; None when unknown.
    mesh: the mesh's axis sizes.
    param_bytes: parameters one chip holds (their shardings' shard shapes).
    opt_state_bytes: optimizer state one chip holds.
    model_flops: the model's training FLOPs per step per chip
      (TransformerConfig.train_flops_per_token x tokens per step / chips).
    steps: program_stats.StepReport per compiled program, in order.
    model: a summary of the model (attention per layer and implementation, parameters).
    total_steps: the run's optimizer steps (config.total_steps), for the time estimate.
  """
  topology: str
  num_slices: int
  device_kind: str
  chips: int
  hbm_bytes: int | None
  mesh: dict[str, int]
  param_bytes: int
  opt_state_bytes: int
  model_flops: float
  steps: dict[str, program_stats.StepReport]
  model: dict[str, Any]
  total_steps: int = 0

  def fits(self, step: str = 'train') -> bool | None:
    """Whether `step`'s total fits one chip's HBM (None: HBM or the step unknown)."""
    report = self.steps.get(step)
    if report is not None and report.out_of_memory:
      return False
    if self.hbm_bytes is None or report is None or report.skipped or not report.memory:
      return None
    return report.total_bytes <= self.hbm_bytes

  def chip(self) -> chips.Chip | None:
    """The chip's figures (chips.CHIPS), None when the table does not know it."""
    return chips.chip_for(self.device_kind)

  def estimate(self, step: str = 'train') -> dict | None:
    """The roofline estimate of `step` on the chip (analysis/roofline.py), with steps per day,
    days to total_steps, MFU (the model FLOPs per step and chip, 6 N + the full causal
    attention term, PaLM's convention, over the step time at the chip's peak for the model's
    dtype: above 1 for sparse attention, which computes far fewer scores than that counts) and
    flops_utilization (the counted FLOPs over the same); an estimate, not a measurement. None
    when the chip is unknown or the step was not analyzed."""
    report, chip = self.steps.get(step), self.chip()
    if report is None or not report.estimate or chip is None:
      return None
    est = report.estimate
    per_day = 86400.0 / est['step_s'] if est['step_s'] > 0 else float('inf')
    dtype = self.model.get('dtype', 'bfloat16')
    peak = chip.peak('f32' if dtype == 'float32' else 'bf16')
    return {'bound': est['bound'], 'step_seconds': est['step_s'], 'steps_per_day': per_day,
            'mfu': self.model_flops / (est['step_s'] * peak) if est['step_s'] > 0 else 0.0,
            'flops_utilization': (est['flops'] / (est['step_s'] * peak) if est['step_s'] > 0
                                  else 0.0),
            'peak_flops_per_chip': peak, 'chip': chip.name,
            'compute_seconds': est['compute_s'], 'memory_seconds': est['memory_s'],
            'collective_seconds': est['collectives_s'], 'overhead_seconds': est['overhead_s'],
            'parts_seconds': {'compute': est['compute_bound_s'],
                              'memory': est['memory_bound_s'],
                              'collectives': est['collectives_s'],
                              'overhead': est['overhead_s']},
            'total_steps': self.total_steps,
            'days': self.total_steps / per_day if self.total_steps else None}

  def to_json(self) -> dict:
    steps = {}
    for name, s in self.steps.items():
      steps[name] = {**dataclasses.asdict(s), 'fits': self.fits(name),
                     'collective_bytes': s.collective_bytes}
    train_step = self.steps.get('train')
    chip = self.chip()
    return {
        'topology': self.topology, 'num_slices': self.num_slices,
        'device_kind': self.device_kind, 'chips': self.chips, 'hbm_bytes': self.hbm_bytes,
        'mesh': self.mesh, 'model': self.model,
        'per_chip': {
            'param_bytes': self.param_bytes,
            'opt_state_bytes': self.opt_state_bytes,
            'train_temp_bytes': train_step.memory.get('temp_bytes') if train_step else None,
            'train_generated_code_bytes': (train_step.memory.get('generated_code_bytes')
                                           if train_step else None),
            'train_total_bytes': train_step.total_bytes if train_step else None,
            'model_flops_per_step': self.model_flops,
            'xla_train_flops_per_step': train_step.xla_flops if train_step else None,
            'train_flops_per_step': train_step.flops if train_step else None,
        },
        'fits': self.fits('train'),
        'estimate': self.estimate(),
        'chip_figures': dataclasses.asdict(chip) if chip else None,
        'steps': steps,
        'note': NOTE,
    }

  def table(self) -> str:
    """The report as text for the console."""
    gib = lambda b: '?' if b is None else f'{b / program_stats.GiB:.3f}'
    lines = [f'compiled for {self.topology} x {self.num_slices} slice(s): {self.chips} x '
             f'{self.device_kind} ({size(self.hbm_bytes)} HBM each), mesh {self.mesh}',
             f'model: {self.model["params"] / 1e6:.2f}M parameters, '
             f'{self.model["attention"]} attention ({self.model["implementation"]}), '
             f'{self.model["n_layers"]} layers ({self.model["stack"]} stack)',
             f'per chip: parameters {size(self.param_bytes)}, optimizer state '
             f'{size(self.opt_state_bytes)}',
             f'{"program":<8} {"total GiB":>10} {"temp GiB":>9} {"code MiB":>9} '
             f'{"fits":>5} {"GFLOP":>8} {"est. time":>10} {"bound":>11} {"compile s":>9}  '
             'collectives (count, MiB)']
    for name, s in self.steps.items():
      if s.skipped:
        lines.append(f'{name:<8} skipped: {s.skipped}')
        continue
      if s.out_of_memory:
        lines.append(f'{name:<8} does NOT fit (the compiler: {s.out_of_memory})')
        continue
      fits = self.fits(name)
      colls = ', '.join(f'{k} {c["count"]} {c["bytes"] / 2**20:.1f}'
                        for k, c in s.collectives.items() if c['count']) or 'none'
      est = s.estimate
      when = roofline.duration(est['step_s']) if est else '?'
      lines.append(f'{name:<8} {gib(s.total_bytes):>10} {gib(s.memory.get("temp_bytes")):>9} '
                   f'{s.memory.get("generated_code_bytes", 0) / 2**20:>9.1f} '
                   f'{"?" if fits is None else "yes" if fits else "NO":>5} '
                   f'{(s.flops or s.xla_flops) / 1e9:>8.3g} {when:>10} '
                   f'{est.get("bound", "?") if est else "?":>11} '
                   f'{s.compile_seconds:>9.1f}  {colls}')
      if s.detail:
        lines.append(f'{"":<8} ({s.detail})')
    train_step = self.steps.get('train')
    if train_step and train_step.memory:
      counted = train_step.flops or train_step.xla_flops
      ratio = counted / self.model_flops if self.model_flops else float('nan')
      lines.append(f'train FLOPs per step per chip: {counted:.4g} counted with loop trip '
                   f'counts (XLA\'s cost analysis: {train_step.xla_flops:.4g}, each loop body '
                   f'once), model {self.model_flops:.4g} (6N + attention; counted / model = '
                   f'{ratio:.2f})')
    lines.extend(self._estimate_lines())
    lines.append('note: ' + NOTE)
    return '\n'.join(lines)

  def _estimate_lines(self) -> list[str]:
    estimate, chip = self.estimate(), self.chip()
    train_step = self.steps.get('train')
    if not estimate or chip is None or train_step is None:
      if self.steps.get('train') and not self.steps['train'].out_of_memory:
        return [f'estimate: no figures for {self.device_kind} in analysis/chips.py']
      return []
    est = train_step.estimate
    parts = estimate['parts_seconds']
    dur = roofline.duration
    lines = [
        f'estimate of the train step on one {chip.name} chip (roofline, not measured): '
        f'compute {dur(est["compute_s"])} ({est["flops"] / 1e9:.3g} GFLOP at '
        f'{chip.peak("bf16") / 1e12:.0f} TFLOP/s bf16), memory {dur(est["memory_s"])} '
        f'({size(est["bytes"])} at {chip.hbm_bandwidth / 1e9:,.0f} GB/s), collectives '
        f'{dur(est["collectives_s"])} ({size(est["collective_bytes"])} sent'
        + (f', {dur(est["dcn_s"])} of it over DCN' if est['dcn_s'] else '') + '), overhead '
        f'{dur(est["overhead_s"])} ({est["launches"]:,.0f} kernels)',
        f'  step {dur(est["step_s"])}, bound: {estimate["bound"]} (compute-bound kernels '
        f'{dur(parts["compute"])}, memory-bound {dur(parts["memory"])}); '
        f'~{_three_digits(estimate["steps_per_day"]):,.0f} steps/day, MFU '
        f'{100 * estimate["mfu"]:.1f}% (the counted FLOPs: '
        f'{100 * estimate["flops_utilization"]:.1f}% of peak)'
        + (f', {estimate["total_steps"]:,} steps in ~{dur(estimate["days"] * 86400)}'
           if estimate['days'] else '')]
    if est['unknown_loops']:
      lines.append(f'  {est["unknown_loops"]} loop(s) of data-dependent length counted once: '
                   'the estimate is low there')
    if est['opaque']:
      lines.append('  custom calls counted without FLOPs: '
                   + ', '.join(f'{k} x{v:g}' for k, v in est['opaque'].items()))
    return lines


def _three_digits(x: float) -> float:
  return float(f'{x:.3g}')


def does_not_fit(report: Report) -> str:
  """Why the train step does not fit one chip's HBM and what to try; '' when it fits (or
  the HBM is unknown)."""
  if report.fits('train') is not False:
    return ''
  s = report.steps['train']
  hbm = size(report.hbm_bytes) if report.hbm_bytes else 'unknown'
  where = (f'one chip of {report.topology} ({report.device_kind}, {hbm} HBM)'
           if report.topology != report.device_kind else
           f'one {report.device_kind} chip ({hbm} HBM) of this {report.chips}-chip slice')
  state = report.param_bytes + report.opt_state_bytes
  if s.out_of_memory:
    amounts = program_stats.compiler_amounts(s.out_of_memory)
    need = (f'the TPU compiler needs {size(amounts[0])} where {size(amounts[1])} is usable, '
            f'{size(amounts[0] - amounts[1])} too much' if amounts else
            'the TPU compiler finds it too large')
    what = (f'{need} ("{s.out_of_memory}"); parameters {size(report.param_bytes)} and '
            f'optimizer state {size(report.opt_state_bytes)} per chip')
    temp = amounts[0] if amounts else 0
  else:
    temp = s.memory['temp_bytes']
    what = (f'it needs {size(s.total_bytes)} per chip, {size(s.total_bytes - report.hbm_bytes)}'
            f' more than the HBM (parameters {size(report.param_bytes)}, optimizer state '
            f'{size(report.opt_state_bytes)}, temporaries {size(temp)}, code '
            f'{size(s.memory["generated_code_bytes"])}; the compiler\'s estimate)')
  shard_state = (f'a larger mesh.fsdp (now {report.mesh.get("fsdp", 1)}: parameters and '
                 'optimizer state are split over that many chips)')
  shrink_activations = ('a smaller batch_size (activations grow with the rows per chip), '
                        "model.remat='full' (recompute activations in the backward pass) or "
                        'grad_accum_steps=2 or more (micro-batches)')
  hints = ([shard_state, shrink_activations] if state > temp
           else [shrink_activations, shard_state])
  return (f'the train step does not fit {where}: {what}. Try {"; or ".join(hints)}; or a '
          'larger slice')
