"""--mode=compile: a run's programs built for a TPU slice ahead of time, from any host.

  python main.py --config=configs/default.py --mode=compile --config.compile_topology=v5e:4x4

training/tpu_topology.py describes a slice that is not here (its compile-only devices);
the run's own train step, eval step and sampling program (training/train.py,
models/decode.py) are lowered with abstract arguments -- shapes, dtypes and shardings, no
arrays -- and compiled by the real TPU compiler (libtpu). No data is read (assembly.build with
data=False). MaxText's train_compile.py is the model.

The report (analysis/compile_report.py, from each program as analysis/program_stats.py reads
it), per chip: parameter and optimizer-state bytes (from the state's shardings), the
compiler's temporaries and generated code, their total against the chip's HBM; the FLOPs of
each program counted with its loops' trip counts (analysis/hlo_cost.py) next to XLA's own
count (each loop body once) and the model's; the collectives in each compiled program; the
compile time; and a roofline estimate of each program's time on the chip
(analysis/roofline.py with analysis/chips.py's figures: compute, memory, collectives and
overhead, the bound named), the train step's as steps per day and MFU. It is printed and
written to WORKDIR/compile_<topology>.json, the only file the mode writes. Memory is the
compiler's estimate; nothing runs, so speed is estimated, not measured (docs/tpu.md says how
far the same estimator is from steps measured on a CPU).

`check_train_step_fits` is the same check before a real TPU run (training/train.py).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from absl import logging
from jax.sharding import NamedSharding, PartitionSpec as P

from analysis import chips, compile_report, program_stats
from models import decode, transformer
from training import assembly, run_config, sampling, sharding, steps, tpu_topology

STEPS = ('train', 'eval', 'decode')


# --- Compiling one program. -----------------------------------------------------------------

def _compile(name: str, jitted, args, setup: assembly.Setup, detail: str, topology: str):
  """Lowers and compiles `jitted(*args)` under the run's mesh and rules.

  Returns:
    (the jax Compiled, its program_stats.StepReport); (None, a report with `out_of_memory`)
    when the compiler finds that the program cannot fit HBM.

  Raises:
    ValueError: the program does not lower or compile for another reason (the compiler's
      first line).
  """
  report = program_stats.StepReport(name=name, detail=detail)
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
  program_stats.read(report, compiled)
  logging.info('%s step for %s: lowered in %.1f s, compiled in %.1f s', name, topology,
               report.lower_seconds, report.compile_seconds)
  return compiled, report


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
    (the jax Compiled, its program_stats.StepReport).
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
    (the jax Compiled, its program_stats.StepReport); (None, a report with `skipped`) for a
    model that cannot decode token by token.
  """
  model = setup.model  # The parameters' specialization (adaptive spans) needs their values.
  try:
    sampling.check_decodes(model)
  except NotImplementedError as e:
    return None, program_stats.StepReport(name='decode', skipped=str(e))
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


# --- The programs of a run, reported. ---------------------------------------------------------

def _model_summary(setup: assembly.Setup) -> dict[str, Any]:
  mc = setup.model_config
  return {'params': mc.num_params(), 'd_model': mc.d_model, 'n_layers': mc.n_layers,
          'n_heads': mc.n_heads, 'stack': mc.stack_name, 'dtype': str(jnp.dtype(mc.dtype)),
          'attention': ','.join(sorted(set(mc.attention))),
          'implementation': ','.join(sorted(set(transformer.implementations(mc)))),
          'batch_size': setup.config.batch_size, 'seq_len': setup.seq_len,
          'vocab_size': mc.vocab_size}


def report_for(setup: assembly.Setup, steps=STEPS, *, topology: str = '',
               num_slices: int = 1, analyze: bool = True) -> tuple[compile_report.Report, dict]:
  """Compiles `steps` of the run for `setup`'s mesh and reports on them.

  Args:
    setup: a Setup on the slice's devices (compile-only or real).
    steps: names in STEPS to compile, in order.
    topology: the slice's topology name (default: the devices' kind).
    num_slices: slices the mesh spans (for the report).
    analyze: count each program's work and estimate its time (program_stats.analyze); a fit
      check alone does not need it.

  Returns:
    (the compile_report.Report of the programs, {step name: the jax Compiled, or None when
    skipped}).
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
      program_stats.analyze(reports[name], compiled[name], setup.mesh, chip)
  report = compile_report.Report(
      topology=topology, num_slices=num_slices, device_kind=device.device_kind,
      chips=n_chips, hbm_bytes=program_stats.hbm_bytes(device), mesh=dict(setup.mesh.shape),
      param_bytes=program_stats.per_device_bytes(setup.abstract_state.params),
      opt_state_bytes=program_stats.per_device_bytes(setup.abstract_state.opt_state),
      model_flops=mc.train_flops_per_token(setup.seq_len) * tokens / n_chips, steps=reports,
      model=_model_summary(setup), total_steps=int(setup.config.total_steps))
  return report, compiled


def check_train_step_fits(setup: assembly.Setup):
  """Compiles the run's train step for `setup`'s devices and raises if it cannot fit.

  Returns:
    (the compile_report.Report of the train step, the compiled train step).

  Raises:
    ValueError: it does not fit one chip's HBM (compile_report.does_not_fit's message).
  """
  report, compiled = report_for(setup, ('train',), analyze=False)
  message = compile_report.does_not_fit(report)
  if message:
    raise ValueError(message)
  return report, compiled['train']


def compile_config(config: ml_collections.ConfigDict, steps=STEPS,
                   workdir: str | None = None) -> compile_report.Report:
  """Builds the run of `config` on config.compile_topology (x compile_topology_num_slices)
  without reading data, and compiles `steps` (the mode and benchmarks/tpu_compile.py).

  Args:
    config: the run config.
    steps: names in STEPS.
    workdir: the run's folder, if any (nothing is written there).

  Returns:
    The compile_report.Report.
  """
  num_slices = config.compile_topology_num_slices
  devices = tpu_topology.topology_devices(config.compile_topology, num_slices)
  setup = assembly.build(config, devices=devices, workdir=workdir, data=False)
  report, _ = report_for(setup, steps, topology=config.compile_topology,
                         num_slices=num_slices)
  return report


def run(config: ml_collections.ConfigDict, workdir: str,
        request: run_config.Request | None = None) -> compile_report.Report:
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
    The compile_report.Report.

  Raises:
    ValueError: no topology or no TPU support; a program does not compile; the train step
      does not fit one chip's HBM (after the report is written).
  """
  config = run_config.resolve(
      config, workdir, trains=False, request=request,
      devices=lambda c: tpu_topology.topology_devices(c.compile_topology,
                                                       c.compile_topology_num_slices)
  ).config
  report = compile_config(config, STEPS, workdir)
  print(report.table(), flush=True)
  if jax.process_index() == 0:
    os.makedirs(workdir, exist_ok=True)
    name = compile_report.report_filename(report.topology, report.num_slices)
    path = os.path.join(workdir, name)
    with open(path, 'w') as f:
      json.dump(report.to_json(), f, indent=2)
    print(f'wrote {path}', flush=True)
  for name in ('eval', 'decode'):
    if report.fits(name) is False:
      logging.warning('the %s program does not fit one chip\'s HBM (%s): see the report',
                      name, compile_report.size(report.hbm_bytes))
  message = compile_report.does_not_fit(report)
  if message:
    raise ValueError(message)
  return report
