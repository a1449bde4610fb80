"""--mode=compile: a run's programs built for a TPU slice ahead of time, from any host.

  python main.py --config=configs/default.py --mode=compile --config.compile_topology=v5e:4x4

jax.experimental.topologies describes a slice that is not here (its compile-only devices);
the run's own train step, eval step and sampling program (training/train.py,
models/decode.py) are lowered with abstract arguments -- shapes, dtypes and shardings, no
arrays -- and compiled by the real TPU compiler (libtpu). No data is read (assembly.build with
data=False). MaxText's train_compile.py is the model.

The report, per chip: parameter and optimizer-state bytes (from the state's shardings), the
compiler's temporaries and generated code, their total against the chip's HBM; the FLOPs of
each program counted with its loops' trip counts (training/hlo_cost.py) next to XLA's own
count (each loop body once) and the model's; the collectives in each compiled program; the
compile time; and a roofline estimate of each program's time on the chip
(training/roofline.py with training/chips.py's figures: compute, memory, collectives and
overhead, the bound named), the train step's as steps per day and MFU. It is printed and
written to WORKDIR/compile_<topology>.json, the only file the mode writes. Memory is the
compiler's estimate; nothing runs, so speed is estimated, not measured (docs/tpu.md says how
far the same estimator is from steps measured on a CPU).

`check_train_step_fits` is the same check before a real TPU run (training/train.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import importlib.util
import json
import os
import re
import sys
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging
from jax.experimental import topologies
from jax.sharding import NamedSharding, PartitionSpec as P

from models import decode, transformer
from training import (assembly, chips, hlo_cost, roofline, run_config, sampling, sharding,
                      steps, xla_flags)

GiB = 1 << 30

# HBM per chip by jax device_kind (the compile-only devices of a topology have no
# memory_stats; a real TPU's own bytes_limit is used when it reports one): chips.CHIPS.
HBM_BYTES = {kind: chip.hbm_bytes for kind, chip in chips.CHIPS.items()}

# Topology name prefixes whose chips hold two TensorCores that JAX drives as one device
# (megacore): without chip_config_name='megacore', libtpu describes v4:2x2x4 as 32 devices
# where the real v4-32 slice has 16.
MEGACORE_PREFIXES = ('v4', 'v5p', 'v5:')

COLLECTIVES = hlo_cost.COLLECTIVES

STEPS = ('train', 'eval', 'decode')

NOTE = ('Memory is the TPU compiler\'s estimate for the compiled programs; FLOPs and bytes are '
        'counted from them with every loop\'s trip count (XLA\'s own FLOPs count a loop body '
        'once); speed is not measured (nothing ran): the time is a roofline estimate from '
        'those counts and the chip\'s published peak FLOP/s, HBM and interconnect bandwidth '
        '(training/chips.py), the bound named. Collectives are counted once per instruction in '
        'the table, with their trip counts in the estimate.')

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


def slice_name(topology: str) -> str:
  """Cloud TPU's name of the slice of `topology`: v5e counts chips (v5e:2x4 is v5e-8), v4 and
  v5p count TensorCores, two per chip (v4:2x2x1 is v4-8)."""
  generation, _, shape = topology.partition(':')
  chips = 1
  for n in shape.split('x'):
    chips *= int(n)
  return f'{generation}-{chips * 2 if generation in ("v4", "v5p", "v5") else chips}'


def report_filename(topology: str, num_slices: int = 1) -> str:
  """compile_<topology>[_<n>slices].json, the topology's name made a safe file name."""
  name = re.sub(r'[^A-Za-z0-9]+', '_', topology).strip('_')
  return f'compile_{name}' + (f'_{num_slices}slices' if num_slices > 1 else '') + '.json'


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


def size(n: float | None) -> str:
  """Bytes as text in binary units, e.g. '1.50 GiB'."""
  if n is None:
    return '?'
  for unit, scale in (('GiB', 1 << 30), ('MiB', 1 << 20), ('KiB', 1 << 10)):
    if abs(n) >= scale:
      return f'{n / scale:.2f} {unit}'
  return f'{int(n)} B'


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


# --- Compiling one program. -----------------------------------------------------------------

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
      count (hlo_cost.analyze); 0 until `analyze_step`.
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


def _compile(name: str, jitted, args, setup: assembly.Setup, detail: str, topology: str):
  """Lowers and compiles `jitted(*args)` under the run's mesh and rules.

  Returns:
    (the jax Compiled, its StepReport); (None, a report with `out_of_memory`) when the
    compiler finds that the program cannot fit HBM.

  Raises:
    ValueError: the program does not lower or compile for another reason (the compiler's
      first line).
  """
  report = StepReport(name=name, detail=detail)
  try:
    with sharding.activate(setup.mesh, setup.rules):
      start = time.perf_counter()
      lowered = jitted.lower(*args)
      report.lower_seconds = time.perf_counter() - start
      start = time.perf_counter()
      compiled = lowered.compile()
      report.compile_seconds = time.perf_counter() - start
  except (ValueError, NotImplementedError):
    raise
  except Exception as e:  # pylint: disable=broad-except  (XLA raises JaxRuntimeError)
    first = (str(e).strip().splitlines() or [type(e).__name__])[0][:600]
    if 'RESOURCE_EXHAUSTED' in str(e):  # The compiler's own HBM check.
      report.out_of_memory = first
      logging.info('%s step for %s: the compiler says it does not fit: %s', name, topology,
                   first)
      return None, report
    raise ValueError(f'the {name} step does not compile for {topology}: '
                     f'{type(e).__name__}: {first}') from e
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
  logging.info('%s step for %s: lowered in %.1f s, compiled in %.1f s', name, topology,
               report.lower_seconds, report.compile_seconds)
  return compiled, report


def analyze_step(report: StepReport, compiled, setup: assembly.Setup,
                 chip: chips.Chip | None) -> roofline.Estimate | None:
  """Counts a compiled program's work (hlo_cost.analyze: FLOPs with trip counts) into
  `report` and, when the chip is known, its roofline estimate (also returned)."""
  cost = hlo_cost.analyze(hlo_cost.module_text(compiled))
  report.flops = cost.flops
  if chip is None:
    return None
  mesh_devices = list(setup.mesh.devices.flat)
  slices = [getattr(d, 'slice_index', 0) or 0 for d in mesh_devices]
  est = roofline.estimate(cost, chip, devices=len(mesh_devices), slice_of=slices)
  report.estimate = est.to_json()
  return est


def _replicated(setup: assembly.Setup) -> NamedSharding:
  return NamedSharding(setup.mesh, P())


def abstract_batch(setup: assembly.Setup, rows: int) -> dict[str, jax.ShapeDtypeStruct]:
  """A batch of `rows` rows as the input pipeline yields it (input_pipeline/__init__.py),
  abstract, with the batch sharding."""
  shape = (rows, setup.seq_len)
  return {k: jax.ShapeDtypeStruct(shape, jnp.float32 if k == 'weights' else jnp.int32,
                                  sharding=setup.batch_sharding)
          for k in ('inputs', 'targets', 'weights', 'positions', 'segment_ids')}


def _device_kind(setup: assembly.Setup) -> str:
  return setup.mesh.devices.flat[0].device_kind


def abstract_key(setup: assembly.Setup) -> jax.ShapeDtypeStruct:
  """A replicated random key, abstract (its dtype carries the key implementation)."""
  key = jax.eval_shape(lambda: jax.random.key(0))
  return jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=_replicated(setup))


def compile_train_step(setup: assembly.Setup, where: str = ''):
  """The run's train step (steps.jit_train_step: sharded, donated), compiled for the mesh.

  Args:
    setup: the run's Setup on the devices to compile for.
    where: the slice's name, for messages (default: the devices' kind).

  Returns:
    (the jax Compiled, its StepReport).
  """
  config = setup.config
  return _compile(
      'train', steps.jit_train_step(setup), _train_args(setup),
      setup, f'{config.batch_size} rows x {setup.seq_len} tokens, '
      f'grad_accum_steps={config.grad_accum_steps}', where or _device_kind(setup))


def _train_args(setup: assembly.Setup):
  """The train step's abstract arguments: state, one global batch, the step's key."""
  return (setup.abstract_state, abstract_batch(setup, setup.config.batch_size),
          abstract_key(setup))


def lower_train_step(setup: assembly.Setup):
  """The run's train step lowered for the mesh, not compiled (seconds where a TPU compile
  takes tens of them): its StableHLO names the kernels it calls.

  Returns:
    The jax Lowered.
  """
  with sharding.activate(setup.mesh, setup.rules):
    return steps.jit_train_step(setup).lower(*_train_args(setup))


def compile_eval_step(setup: assembly.Setup, where: str = ''):
  """The run's eval step (steps.jit_eval_step), compiled for eval_batch_size rows."""
  rows = setup.config.eval_batch_size or setup.config.batch_size
  eval_step = steps.jit_eval_step(setup)
  memory = eval_step.memory if eval_step.memory is not None else {}
  # EvalStep keeps its jitted function private; it is what EvalStep.__call__ runs.
  return _compile('eval', eval_step._fn,  # pylint: disable=protected-access
                  (setup.abstract_state.params, abstract_batch(setup, rows), memory),
                  setup, f'{rows} rows x {setup.seq_len} tokens', where or _device_kind(setup))


def compile_decode(setup: assembly.Setup, where: str = ''):
  """generate's sampling program (models/decode.generate: a prefill forward, then a loop of
  one-token decoding steps over the caches), compiled for generate.batch_size rows of
  model.max_len tokens: the longest prompt that leaves room for generate.max_new_tokens.

  Returns:
    (the jax Compiled, its StepReport); (None, a report with `skipped`) for a model that
    cannot decode token by token.
  """
  model = setup.model  # The parameters' specialization (adaptive spans) needs their values.
  try:
    sampling.check_decodes(model)
  except NotImplementedError as e:
    return None, StepReport(name='decode', skipped=str(e))
  g = setup.config.generate
  dp = setup.mesh.shape['data'] * setup.mesh.shape['fsdp']
  rows = -(-g.batch_size // dp) * dp  # As sampling.sample_ids pads a batch of prompts.
  width = model.config.max_len
  new_tokens = max(1, min(g.max_new_tokens, width - 1))
  prompt = width - new_tokens
  prefilled = 1 << (prompt.bit_length() - 1) if decode.can_prefill(model.config) else 0
  eos_id = sampling.EOS if g.stop_at_eos else None
  # The jitted program decode.generate runs (one per shape and setting); private to decode.
  loop = decode._sampling_loop(  # pylint: disable=protected-access
      model, rows, width, prefilled, new_tokens, g.temperature, g.top_k, g.top_p, eos_id,
      sampling.PAD)
  replicated = _replicated(setup)
  args = (setup.abstract_state.params,
          jax.ShapeDtypeStruct((rows, width), jnp.int32, sharding=replicated),
          jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=replicated), abstract_key(setup))
  return _compile('decode', loop, args, setup,
                  f'{rows} rows, prompt {prompt} (prefill {prefilled}) + {new_tokens} new '
                  'tokens', where or _device_kind(setup))


_COMPILERS = {'train': compile_train_step, 'eval': compile_eval_step, 'decode': compile_decode}


# --- The report. ------------------------------------------------------------------------------

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
    steps: StepReport per compiled program, in order.
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
  steps: dict[str, StepReport]
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
    """The roofline estimate of `step` on the chip (training/roofline.py), with steps per day,
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
    gib = lambda b: '?' if b is None else f'{b / GiB:.3f}'
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
        return [f'estimate: no figures for {self.device_kind} in training/chips.py']
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


def _model_summary(setup: assembly.Setup) -> dict[str, Any]:
  mc = setup.model_config
  return {'params': mc.num_params(), 'd_model': mc.d_model, 'n_layers': mc.n_layers,
          'n_heads': mc.n_heads, 'stack': mc.stack_name, 'dtype': str(jnp.dtype(mc.dtype)),
          'attention': ','.join(sorted(set(mc.attention))),
          'implementation': ','.join(sorted(set(transformer.implementations(mc)))),
          'batch_size': setup.config.batch_size, 'seq_len': setup.seq_len,
          'vocab_size': mc.vocab_size}


def report_for(setup: assembly.Setup, steps=STEPS, *, topology: str = '',
               num_slices: int = 1, analyze: bool = True) -> tuple[Report, dict]:
  """Compiles `steps` of the run for `setup`'s mesh and reports on them.

  Args:
    setup: a Setup on the slice's devices (compile-only or real).
    steps: names in STEPS to compile, in order.
    topology: the slice's topology name (default: the devices' kind).
    num_slices: slices the mesh spans (for the report).
    analyze: count each program's work and estimate its time (`analyze_step`); a fit check
      alone does not need it.

  Returns:
    (the Report, {step name: the jax Compiled, or None when skipped}).
  """
  unknown = [s for s in steps if s not in _COMPILERS]
  if unknown:
    raise ValueError(f'unknown programs {unknown}; known: {", ".join(STEPS)}')
  device = setup.mesh.devices.flat[0]
  n_chips = int(setup.mesh.devices.size)
  mc = setup.model_config
  tokens = setup.config.batch_size * setup.seq_len
  topology = topology or device.device_kind
  chip = chips.chip_for(device.device_kind)
  compiled, reports = {}, {}
  for name in steps:
    compiled[name], reports[name] = _COMPILERS[name](setup, topology)
    if analyze and compiled[name] is not None:
      analyze_step(reports[name], compiled[name], setup, chip)
  report = Report(
      topology=topology, num_slices=num_slices, device_kind=device.device_kind,
      chips=n_chips, hbm_bytes=hbm_bytes(device), mesh=dict(setup.mesh.shape),
      param_bytes=per_device_bytes(setup.abstract_state.params),
      opt_state_bytes=per_device_bytes(setup.abstract_state.opt_state),
      model_flops=mc.train_flops_per_token(setup.seq_len) * tokens / n_chips, steps=reports,
      model=_model_summary(setup), total_steps=int(setup.config.total_steps))
  return report, compiled


_UNITS = {'': 1, 'K': 1 << 10, 'M': 1 << 20, 'G': 1 << 30, 'T': 1 << 40}
# "... required for HLO temporaries (209.11G) exceeds available HBM (15.75G)."
_EXHAUSTED = re.compile(r'\(([\d.]+)([KMGT]?)\) exceeds available HBM \(([\d.]+)([KMGT]?)\)')


def _compiler_amounts(message: str) -> tuple[int, int] | None:
  """(bytes needed, bytes available) from the TPU compiler's out-of-memory message, if it
  states them."""
  found = _EXHAUSTED.search(message)
  if not found:
    return None
  needed, unit, available, unit2 = found.groups()
  return int(float(needed) * _UNITS[unit]), int(float(available) * _UNITS[unit2])


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
    amounts = _compiler_amounts(s.out_of_memory)
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


def check_train_step_fits(setup: assembly.Setup):
  """Compiles the run's train step for `setup`'s devices and raises if it cannot fit.

  Returns:
    (the Report of the train step, the compiled train step).

  Raises:
    ValueError: it does not fit one chip's HBM (`does_not_fit`'s message).
  """
  report, compiled = report_for(setup, ('train',), analyze=False)
  message = does_not_fit(report)
  if message:
    raise ValueError(message)
  return report, compiled['train']


def compile_config(config: ml_collections.ConfigDict, steps=STEPS,
                   workdir: str | None = None) -> Report:
  """Builds the run of `config` on config.compile_topology (x compile_topology_num_slices)
  without reading data, and compiles `steps` (the mode and benchmarks/tpu_compile.py).

  Args:
    config: the run config.
    steps: names in STEPS.
    workdir: the run's folder, if any (nothing is written there).

  Returns:
    The Report.
  """
  num_slices = config.compile_topology_num_slices
  devices = topology_devices(config.compile_topology, num_slices)
  setup = assembly.build(config, devices=devices, workdir=workdir, data=False)
  report, _ = report_for(setup, steps, topology=config.compile_topology,
                         num_slices=num_slices)
  return report


def run(config: ml_collections.ConfigDict, workdir: str,
        request: run_config.Request | None = None) -> Report:
  """--mode=compile: compiles the run's train, eval and decoding programs for
  config.compile_topology, prints the report and writes WORKDIR/compile_<topology>.json.

  The config is the workdir's recorded run when there is one (training/run_config.py, as
  --mode=eval reads it), else the one given; nothing but the report is written, and no data
  is read.

  Args:
    config: the config given.
    workdir: the folder the report goes to (and the recorded run, if any, comes from).
    request: what the command line asked for; None: every field of `config`.

  Returns:
    The Report.

  Raises:
    ValueError: no topology or no TPU support; a program does not compile; the train step
      does not fit one chip's HBM (after the report is written).
  """
  config = run_config.resolve(
      config, workdir, trains=False, request=request,
      devices=lambda c: topology_devices(c.compile_topology, c.compile_topology_num_slices)
  ).config
  report = compile_config(config, STEPS, workdir)
  print(report.table(), flush=True)
  if jax.process_index() == 0:
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, report_filename(report.topology, report.num_slices))
    with open(path, 'w') as f:
      json.dump(report.to_json(), f, indent=2)
    print(f'wrote {path}', flush=True)
  for name in ('eval', 'decode'):
    if report.fits(name) is False:
      logging.warning('the %s program does not fit one chip\'s HBM (%s): see the report',
                      name, size(report.hbm_bytes))
  message = does_not_fit(report)
  if message:
    raise ValueError(message)
  return report
