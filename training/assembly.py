"""A run assembled from its config, and the one way every mode restores a checkpoint.

`build` turns a config into a Setup (model, data, mesh, optimizer, state layouts), running
every check that can fail on a bad config before any compute. `restore` is what every mode
that reads a trained model does (eval, generate, inspect, the pruning modes, experiments):
resolve the workdir's record, build, run the mode's own checks, read the parameters of one
checkpoint and specialize the model to them.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging

import input_pipeline
from models import transformer
from training import agreement, checkpoints, optimizer, run_config, settings, sharding, steps
from training.state import Setup  # pylint: disable=unused-import (assembly.Setup: its old home)


# A vocabulary taken from the data (model.vocab_size=0) is padded to a multiple of this: the
# 'vocab' axis then splits over any tensor-parallel size that divides it, and fills whole
# 128-wide matrix units.
VOCAB_MULTIPLE = 128


def check_workdir(workdir: str) -> None:
  """Creates `workdir` and proves it is writable, before any compute; on several processes,
  also that it is one folder that every process sees (agreement.check_shared_workdir)."""
  try:
    os.makedirs(workdir, exist_ok=True)
    probe = os.path.join(workdir, f'.write_probe_{jax.process_index()}')
    with open(probe, 'w') as f:
      f.write('ok')
    os.remove(probe)
  except OSError as e:
    raise PermissionError(f'workdir {workdir!r} is not writable: {e}') from e
  agreement.check_shared_workdir(workdir)  # Several processes: one folder that all of them see.


def _warn_unaligned_packing(config, model_config) -> None:
  """Patterns whose blocks are anchored to row positions (transformer.row_periods) need packed
  documents to start on block boundaries for training to see what decoding a document sees."""
  if config.data.name not in input_pipeline.text.TFDS_NAMES or config.data.packing != 'packed':
    return
  for name, period in transformer.row_periods(model_config).items():
    if config.data.pack_align % period:
      logging.warning('%s attention anchors its blocks (%d) to row positions, but packed '
                      'documents start anywhere (data.pack_align=%d): set data.pack_align=%d so '
                      'each document sees the pattern it would see alone', name, period,
                      config.data.pack_align, period)


def _check_memory(config, model_config) -> None:
  """Segment memory needs consecutive segments of one stream in each batch row; stream rows
  carry document positions longer than any position table."""
  if config.data.packing == 'stream' and model_config.position_embedding != 'none':
    raise ValueError('data.packing=\'stream\' positions grow past the position table: set '
                     'model.position_embedding=\'none\' and use a variant with relative '
                     'positions')
  if not model_config.uses_memory:
    return
  if config.data.name not in input_pipeline.text.TFDS_NAMES or config.data.packing != 'stream':
    raise ValueError(f'{",".join(sorted(set(model_config.attention)))} attention with segment '
                     'memory carries each row\'s previous segment to the next batch: it needs a '
                     'text source with data.packing=\'stream\' (got '
                     f'data.name={config.data.name!r}, data.packing={config.data.packing!r})')
  if config.grad_accum_steps != 1:
    raise ValueError('segment memory needs grad_accum_steps=1 (micro-batches would split the '
                     'streams)')


def _shapes_without_data(config: ml_collections.ConfigDict) -> tuple[int, int]:
  """(vocabulary size, sequence length) of a text source's programs, from the config alone."""
  if not config.model.vocab_size:
    raise ValueError('building without data (--mode=compile) cannot read the vocabulary from '
                     f'the {config.data.name!r} data: set --config.model.vocab_size (e.g. 8192 '
                     'for the 8K SentencePiece vocabulary, a multiple of '
                     f'{VOCAB_MULTIPLE})')
  if config.seq_len < 1:
    raise ValueError(f'seq_len must be >= 1, got {config.seq_len}')
  return config.model.vocab_size, config.seq_len


def build(config: ml_collections.ConfigDict, devices=None, workdir: str | None = None, *,
          data: bool = True) -> Setup:
  """Validates the config and builds model, data, mesh, optimizer and state shardings.

  Every check that can fail on a bad config runs here, before any compute.

  Args:
    config: the run config.
    devices: devices for the mesh; defaults to all. They may be a TPU topology's
      compile-only devices (training/aot.py) when `data` is False.
    workdir: the run's folder (where a SentencePiece model is trained if none is given).
    data: read the data source. False builds the programs' shapes without reading anything
      (--mode=compile): a text source's vocabulary is model.vocab_size (which must then be
      set) and its rows are config.seq_len long; a synthetic task's sizes come from the task
      (pure computation). Setup.data is then None.

  Returns:
    The Setup.
  """
  settings.check(config)
  # Several processes: the same settings, code and libraries everywhere, before any data is
  # read or program compiled (then the same data, below).
  agreement.agree('settings', agreement.settings(run_config.as_flat_json(config)),
                  agreement.SETTINGS_ADVICE)
  mesh = sharding.make_mesh(config.mesh, devices)
  # The rows this process reads are those its devices hold in the batch's layout (all of
  # them when only the tensor axis crosses the hosts), not 1/process_count of the batch.
  shard = sharding.data_shard(mesh)
  source = None
  if data or config.data.name not in input_pipeline.text.TFDS_NAMES:
    # A synthetic task reads nothing, and an unknown name gets the source's own error.
    source = input_pipeline.make_source(
        config, process_index=jax.process_index(), process_count=jax.process_count(),
        workdir=workdir, shard=shard)
    data_vocab, seq_len = source.vocab_size, source.seq_len
    agreement.agree('data', source.fingerprint, agreement.DATA_ADVICE)
  else:
    data_vocab, seq_len = _shapes_without_data(config)
  if not data:
    source = None
  model_cfg = dict(config.model)
  # A vocabulary taken from the data is padded to a multiple of VOCAB_MULTIPLE, whatever the
  # mesh: parameter shapes, and so checkpoints, are the same on every mesh.
  model_cfg['vocab_size'] = (config.model.vocab_size
                             or -(-data_vocab // VOCAB_MULTIPLE) * VOCAB_MULTIPLE)
  model_cfg['max_len'] = config.model.max_len or seq_len
  # Kernels are chosen for the devices the program is compiled for, not for this process's
  # backend: a CPU host may build a TPU slice's program (--mode=compile).
  model_cfg['target_platform'] = mesh.devices.flat[0].platform
  model_cfg['target_devices'] = int(mesh.devices.size)
  model_config = transformer.TransformerConfig.from_config(model_cfg)
  if seq_len > model_config.max_len:
    raise ValueError(f'sequence length {seq_len} is longer than the position table '
                     f'(model.max_len={model_config.max_len})')
  if data_vocab > model_config.vocab_size:
    raise ValueError(f'the data uses {data_vocab} token ids but model.vocab_size is '
                     f'{model_config.vocab_size}')

  _warn_unaligned_packing(config, model_config)
  _check_memory(config, model_config)
  data_parallel = mesh.shape['data'] * mesh.shape['fsdp']
  if config.batch_size % config.grad_accum_steps:
    raise ValueError(f'batch_size={config.batch_size} is not divisible by '
                     f'grad_accum_steps={config.grad_accum_steps}')
  per_step = config.batch_size // config.grad_accum_steps
  for name, rows in (('batch_size / grad_accum_steps', per_step),
                     ('eval batch size', config.eval_batch_size or config.batch_size)):
    if rows % data_parallel:
      raise ValueError(f'{name}={rows} is not divisible by the {data_parallel} data-parallel '
                       f'devices of the mesh {dict(mesh.shape)}')

  rules = sharding.rules_from_config(config.logical_axis_rules)
  model = transformer.Decoder(model_config)
  schedule = optimizer.make_schedule(config)
  # Segment memory has one row per batch row; parameters do not depend on the batch.
  rows = config.batch_size if model_config.uses_memory else 1
  init_model = lambda rng: model.init(rng, jnp.zeros((rows, seq_len), jnp.int32))
  abstract_params = jax.eval_shape(init_model, jax.random.key(0))['params']
  tx = optimizer.make_optimizer(config, transformer.param_bounds(model_config),
                                abstract_params=abstract_params)

  def init_boxed(rng):
    variables = init_model(rng)
    params = variables['params']
    return steps.TrainState(step=jnp.zeros((), jnp.int32), params=params,
                            opt_state=tx.init(params), memory=variables.get('memory', {}))

  boxed = jax.eval_shape(init_boxed, jax.random.key(0))
  state_sharding = sharding.logical_shardings(boxed, mesh, rules)
  sharding.check_divisible(nn.unbox(boxed).params, state_sharding.params)
  abstract_state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                nn.unbox(boxed), state_sharding)
  setup = Setup(config=config, model_config=model_config, model=model, data=source,
                seq_len=seq_len, mesh=mesh, rules=rules, tx=tx, schedule=schedule,
                abstract_state=abstract_state,
                state_sharding=state_sharding, batch_sharding=sharding.batch_sharding(mesh),
                init_fn=lambda rng: nn.unbox(init_boxed(rng)), data_shard=shard)
  return setup


def init_state(setup: Setup, seed: int) -> steps.TrainState:
  """Initializes parameters and optimizer state directly into their shardings."""
  with sharding.activate(setup.mesh, setup.rules):
    return jax.jit(setup.init_fn, out_shardings=setup.state_sharding)(jax.random.key(seed))


def device_batch(setup: Setup, local: dict[str, np.ndarray]) -> dict[str, jax.Array]:
  """Assembles the global batch from this process's rows (its block of the batch,
  setup.data_shard: processes that hold the same rows give the same rows)."""
  return {k: jax.make_array_from_process_local_data(
      setup.batch_sharding, v, (setup.global_rows(v.shape[0]),) + v.shape[1:])
          for k, v in local.items()}


def specialized_model(setup: Setup, params) -> transformer.Decoder:
  """The Decoder with the static values its variants derive from the parameters
  (transformer.specialized, e.g. adaptive span's trimmed spans); `setup.model` when none."""
  config = transformer.specialized(setup.model_config, params)
  return setup.model if config == setup.model_config else transformer.Decoder(config)


def latest_params(setup: Setup, workdir: str, *, required: str = '', step: int = 0):
  """(step, params) of the latest checkpoint of `workdir` (or of checkpoint `step`), restored
  onto `setup`'s mesh; only the parameters and the step are read, so the optimizer settings
  need not match the run's.

  Args:
    setup: the Setup of the run's (resolved) config.
    workdir: the run's folder.
    required: if not empty, a missing checkpoint raises FileNotFoundError ending with this;
      otherwise it returns (None, None).
    step: a checkpoint step to restore (FileNotFoundError listing the saved steps if there
      is none); 0 = the newest good one.
  """
  if step < 0:
    raise ValueError(f'a checkpoint step must be >= 0 (0 = latest), got {step}')
  if not os.path.isdir(os.path.join(workdir, 'checkpoints')) and '://' not in workdir:
    if required:
      raise FileNotFoundError(f'no checkpoint found in {workdir}/checkpoints: {required}')
    return None, None
  ckpt = checkpoints.Checkpointer(workdir, keep=setup.config.keep_checkpoints, async_save=False,
                                  read_only=True)
  try:
    if ckpt.latest_step() is None:
      if required:
        raise FileNotFoundError(f'no checkpoint found in {ckpt.directory}: {required}')
      return None, None
    return ckpt.restore_params(setup.abstract_state.params, step or None)
  finally:
    ckpt.close()


@dataclasses.dataclass
class Restored:
  """A checkpoint's parameters on this machine's mesh, and what they were built with.

  Attributes:
    setup: the Setup of the run's config (its data source closed: a mode that reads
      batches opens readers again).
    step: the checkpoint step read; None when there was none and none was required.
    params: its parameters; None likewise.
    model: the Decoder specialized to the parameters (`specialized_model`), or setup.model.
    resolved: how the config came about (the record, the changes asked for); None from
      `load`, which is given the run's config.
  """
  setup: Setup
  step: int | None
  params: Any
  model: transformer.Decoder
  resolved: run_config.Resolved | None = None


def load(config: ml_collections.ConfigDict, workdir: str, *, step: int = 0,
         required: str = 'train a model first',
         check: Callable[[Setup], None] | None = None) -> Restored:
  """Builds the run of `config` (the run's own: the record's, already resolved) and reads
  the parameters of its checkpoint `step` in `workdir`.

  Args:
    config: the run's config.
    workdir: the run's folder.
    step: the checkpoint step to read; 0 = the newest good one.
    required: what to do when there is no checkpoint (the FileNotFoundError's advice); ''
      gives step and params None instead.
    check: the mode's own checks of the Setup, run before anything is read or compiled.

  Returns:
    The Restored (resolved None).
  """
  setup = build(config, workdir=workdir)
  try:
    if check is not None:
      check(setup)
    step, params = latest_params(setup, workdir, required=required, step=step)
  finally:
    setup.data.close()
  model = setup.model if params is None else specialized_model(setup, params)
  return Restored(setup=setup, step=step, params=params, model=model)


def restore(config: ml_collections.ConfigDict, workdir: str,
            request: run_config.Request | None = None, *, step_key: str | None = None,
            required: str = 'train a model first',
            check_config: Callable[[ml_collections.ConfigDict], None] | None = None,
            check: Callable[[Setup], None] | None = None) -> Restored:
  """What every mode that reads a trained model does first: resolves the workdir's record
  with what the command line asked for, then `load`s the checkpoint.

  Args:
    config: the config given; the workdir's record is the run's (run_config.resolve).
    workdir: the run's folder.
    request: what the command line asked for; None: every field of `config`.
    step_key: dotted config key (of the resolved config) naming the checkpoint step to read
      (0 = the newest good one), e.g. 'eval_checkpoint_step'; None: the newest.
    required: as `load`'s.
    check_config: the mode's own checks of the resolved config, run before anything is
      built (e.g. that a prompt file exists).
    check: as `load`'s.

  Returns:
    The Restored.
  """
  check_workdir(workdir)
  resolved = run_config.resolve(config, workdir, trains=False, request=request)
  if check_config is not None:
    check_config(resolved.config)
  step = 0
  if step_key:
    step = resolved.config
    for part in step_key.split('.'):
      step = step[part]
  restored = load(resolved.config, workdir, step=step, required=required, check=check)
  restored.resolved = resolved
  return restored
