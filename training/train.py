"""The training loop: resume, steps, checkpoints, periodic eval, preemption (a run is
assembled in training/assembly.py, its steps jitted in training/steps.py)."""

import json
import os
import signal
import threading
import time
from collections.abc import Callable

import jax
import ml_collections
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

import input_pipeline
from models import transformer
from models.attention import cpu_choice
from training import (assembly, checkpoints, evaluation, flops, metrics as metrics_lib,
                      optimizer, run_config, sampling, settings, sharding, steps, workdir_lock)


class _Preemption:
  """SIGTERM (a TPU/cloud preemption notice) sets a flag the loop checks after each step.

  The loop leaves the block only once its last checkpoint is committed, so a second SIGTERM
  during that save is logged, not fatal. When the block is left the previous handler is put
  back, unless a notice came and `exits` says the process ends after the run (main.py): then
  SIGTERM is ignored until it exits. A Python handler would not do there, as the interpreter
  puts the default action (death by SIGTERM, exit -15, which schedulers read as a crash) back
  for every signal with a Python handler while it shuts down. A process that goes on (a test,
  a notebook) gets its own handler back, so a later SIGTERM (a test runner's timeout) still
  stops it.
  """

  def __init__(self, exits: bool = False):
    self._event = threading.Event()
    self._previous = None
    self._exits = exits

  def _handle(self, *_):
    if self._event.is_set():
      logging.warning('SIGTERM again: already stopping; the checkpoint is saved (or still '
                      'being committed) before the process exits')
    else:
      logging.warning('SIGTERM: stopping after this step; a checkpoint is saved before the '
                      'process exits')
    self._event.set()

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGTERM, self._handle)
    return self

  def __exit__(self, *exc):
    if self._previous is None:
      return
    if self._event.is_set() and self._exits:
      signal.signal(signal.SIGTERM, signal.SIG_IGN)
      logging.info('preemption: further SIGTERMs are ignored until the process exits')
    else:
      signal.signal(signal.SIGTERM, self._previous)

  def requested(self, step: int, agree: bool = True) -> bool:
    """Whether to save and stop after `step`.

    One process: its own flag. Several: they must stop at the same step. JAX's preemption
    sync point (the coordination service's notice, the same answer on every process) is read
    every step; a SIGTERM that reached only some processes is agreed on by an all-gather of
    the flags, which waits for every process, so only when `agree` (the loop passes its log,
    checkpoint and eval steps, where the processes meet anyway: the same steps on all).
    """
    if jax.process_count() > 1:  # All hosts must agree to stop at the same step.
      if multihost_utils.reached_preemption_sync_point(step):
        return True
      return agree and bool(
          multihost_utils.process_allgather(np.array(self._event.is_set())).any())
    return self._event.is_set()


def _check_finite(step: int, host_metrics: dict[str, float], ckpt: checkpoints.Checkpointer):
  bad = [k for k in ('loss', 'grad_norm') if not np.isfinite(host_metrics[k])]
  if bad:
    ckpt.wait()  # Let the last good checkpoint finish writing.
    raise FloatingPointError(
        f'non-finite {" and ".join(bad)} at step {step} '
        f'({", ".join(f"{k}={host_metrics[k]}" for k in bad)}); stopping without saving. The '
        f'last good checkpoint is step {ckpt.latest_step()} in {ckpt.directory}. Lower the '
        'learning rate, enable clipping or check the data.')


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str,
                       request: run_config.Request | None = None, *,
                       exits: bool = False,
                       on_step: Callable[[int], None] | None = None) -> steps.TrainState:
  """Trains to config.total_steps, resuming from the latest checkpoint in `workdir`.

  SIGTERM (a preemption notice) saves a checkpoint and returns early.

  Args:
    config: the run config; on a resume, the keys `request` names are checked against and
      applied on top of the workdir's record (training/run_config.py).
    workdir: checkpoints, TensorBoard events and eval JSON go here.
    request: what the command line asked for; None: every field of `config`.
    exits: the process exits when this returns (main.py): after a preemption, later
      SIGTERMs are ignored so that they cannot turn the clean exit into a kill. False (a
      test, a notebook): the caller's SIGTERM handler is put back.
    on_step: called with the step count after each dispatched train step, and once with the
      starting step (0, or the restored one): a progress bar (experiments/harness.py).

  Returns:
    The final TrainState.
  """
  assembly.check_workdir(workdir)
  with workdir_lock.hold(workdir):  # One run per workdir.
    return _train_and_evaluate(config, workdir, request, exits, on_step)


def _train_and_evaluate(config: ml_collections.ConfigDict, workdir: str,
                        request: run_config.Request | None, exits: bool,
                        on_step: Callable[[int], None] | None) -> steps.TrainState:
  resolved = run_config.resolve(config, workdir, trains=True, request=request)
  config = resolved.config
  setup = assembly.build(config, workdir=workdir)
  compiled = None
  if _checks_fit(setup):
    # Fail in seconds, before anything is restored or initialized, when the train step cannot
    # fit the chips' HBM: the check of --mode=compile (training/aot.py), with its advice. It
    # compiles the train step once more than the loop does (the loop jits its own step per
    # specialization of the model); with JAX's persistent compilation cache
    # (JAX_COMPILATION_CACHE_DIR, docs/tpu.md) the loop's compile of the same program is a
    # cache hit. Without the cache the extra compile (seconds to minutes, once per start) is
    # the price of a clear error instead of an out-of-memory crash after the data and the
    # state are loaded. An adaptive-span model is checked at its untrimmed spans: the most
    # memory it can need.
    try:
      from training import aot  # pylint: disable=import-outside-toplevel  (TPU runs only)
      _, compiled = aot.check_train_step_fits(setup)
    except BaseException:
      setup.data.close()
      raise
  mc = setup.model_config
  n_params = mc.num_params()
  flops_per_token = mc.train_flops_per_token(setup.data.seq_len)
  peak, peak_source = flops.peak_flops_per_device(config.peak_tflops_per_device, mc.dtype)
  logging.info('model: %d layers (%s stack) x %d heads, d_model %d, %s attention; %.2fM '
               'parameters; %.3g training FLOPs/token; peak %.3g FLOP/s/device (%s); mesh %s',
               mc.n_layers, mc.stack_name, mc.n_heads, mc.d_model, ','.join(sorted(set(mc.attention))),
               n_params / 1e6, flops_per_token, peak, peak_source, dict(setup.mesh.shape))
  per_layer = transformer.implementations(mc)
  logging.info('attention implementation per layer: %s', ', '.join(
      f'{i} {name}:{impl}' for i, (name, impl) in enumerate(zip(mc.attention, per_layer))))
  record = _implementations_record(mc, per_layer)  # Logged now, recorded once the state is.
  if 'cpu_paths' in record:
    logging.info("attention_impl=auto on this CPU follows %s, entry %r: %s",
                 record['cpu_paths']['file'], record['cpu_paths']['entry'],
                 record['cpu_paths']['choice'] or 'nothing measured (the XLA path)')
  ckpt = checkpoints.Checkpointer(workdir, keep=config.keep_checkpoints,
                                  async_save=config.async_checkpointing)
  logger = metrics_lib.MetricLogger(workdir, config.total_steps)
  harness = None
  try:
    # A config without the harness group (one built by hand) runs no tasks.
    if config.get('harness', {}).get('every_steps', 0):  # Tasks and data checked first.
      from training import zoo_lm  # pylint: disable=import-outside-toplevel  (needs lm-eval)
      harness = zoo_lm.DuringTraining(setup)
    data_state = None
    if ckpt.latest_step() is not None:
      state, saved = _restore_train_state(ckpt, setup)
      data_state = _this_process_data_state(saved, setup.data_shard)
      logging.info('resumed from checkpoint step %d (input stream at %s)', int(state.step),
                   data_state)
    else:
      state = assembly.init_state(setup, config.seed)
    if jax.process_index() == 0:  # Only once the state matches: a failed restore keeps it.
      run_config.record_start(workdir, resolved, int(state.step), implementations=record)
    return _train_loop(setup, state, data_state, ckpt, logger, peak, exits, on_step, compiled,
                       harness)
  finally:  # Also on errors: pending checkpoint writes finish, event files are flushed.
    if harness is not None:
      harness.close()
    setup.data.close()
    ckpt.close()
    logger.close()


def _checks_fit(setup: assembly.Setup) -> bool:
  """Whether a start compiles the train step first to check that it fits (on a TPU)."""
  return setup.model_config.target_platform == 'tpu'


def _restore_train_state(ckpt: checkpoints.Checkpointer, setup: assembly.Setup):
  """(state, saved input-stream position) of the newest good checkpoint.

  A checkpoint written without clipping before the optimizer chain always held its clip slot
  (optimizer.without_clip_slot) restores too: it fails to match today's layout by its
  opt_state names only, and is read in its own layout and given the slot (which holds no
  state), so no saved moment is lost.
  """
  try:
    return ckpt.restore(setup.abstract_state, with_data=True)
  except checkpoints.CheckpointError as e:
    if 'opt_state' not in str(e):
      raise
    old = setup.abstract_state.replace(
        opt_state=optimizer.without_clip_slot(setup.abstract_state.opt_state))
    try:
      state, saved = ckpt.restore(old, with_data=True)
    except checkpoints.CheckpointError:
      raise e from None
    logging.info('checkpoint step %d has the optimizer layout of a run without clipping '
                 'written before the clip slot: restored into today\'s layout', int(state.step))
    return state.replace(opt_state=optimizer.with_clip_slot(state.opt_state)), saved


def _gather_data_state(state: dict, shard: tuple[int, int]) -> dict:
  """Every process's input-stream position, as saved with a checkpoint, each with the block of
  the batch rows its stream reads (`shard`: setup.data_shard)."""
  mine = {'data_shard': list(shard), 'state': state}
  if jax.process_count() == 1:
    return {'process_count': 1, 'processes': [mine]}
  encoded = json.dumps(mine).encode()
  if len(encoded) > 1024:
    raise ValueError(f'input stream state is too large to gather: {state}')
  buf = np.zeros(1024, np.uint8)
  buf[:len(encoded)] = np.frombuffer(encoded, np.uint8)
  rows = multihost_utils.process_allgather(buf)
  return {'process_count': jax.process_count(),
          'processes': [json.loads(bytes(r).rstrip(b'\0')) for r in np.asarray(rows)]}


def _implementations_record(mc, per_layer: list[str]) -> dict:
  """What the run's record says of its attention programs: the setting, what each layer runs
  and, for 'auto' on a CPU, the measurements that chose (cpu_choice.source)."""
  out = {'attention_impl': mc.attention_impl, 'per_layer': per_layer}
  if mc.attention_impl == 'auto' and jax.default_backend() == 'cpu':
    out['cpu_paths'] = cpu_choice.source()
  return out


def _this_process_data_state(saved: dict | None, shard: tuple[int, int]) -> dict | None:
  """The saved input-stream position of a stream that read the rows this process reads now.

  A stream is its block of the batch rows (`shard`, (index, count)): a restart on another
  layout (heads split across the hosts where the data axis was, another process count)
  resumes each process from a saved stream of the same block, wherever one exists, and
  restarts the stream, with a warning, where none does; a position is never handed to a
  stream of other rows. Checkpoints written before the block was saved resume by process
  index when the process count is the same.
  """
  if not saved:
    return None
  entries = saved['processes']
  if all(isinstance(e, dict) and 'data_shard' in e for e in entries):
    for entry in entries:
      if tuple(entry['data_shard']) == tuple(shard):
        return entry['state']
    logging.warning('no process of the checkpoint read the rows this process reads now (block '
                    '%d of %d; saved: %s): its input stream restarts from the beginning instead '
                    'of resuming exactly', shard[0], shard[1],
                    sorted({tuple(e['data_shard']) for e in entries}))
    return None
  if saved['process_count'] != jax.process_count():
    logging.warning('the checkpoint was written by %d processes and this run has %d: the input '
                    'stream restarts from the beginning instead of resuming exactly',
                    saved['process_count'], jax.process_count())
    return None
  return entries[jax.process_index()]


class _MetricWindow:
  """Train metrics since the last log line.

  The steps' metrics stay on the device until `flush`, which the loop calls only where it
  meets the device anyway (log, checkpoint and eval steps): between them the host never
  waits for a step, so it keeps dispatching while the device computes. A flush fetches every
  pending step in one transfer and checks each, in order, for NaN/inf, so a non-finite loss
  still names the first step it appeared at, and a checkpoint is never saved before the
  steps it holds are checked.
  """

  def __init__(self, ckpt: checkpoints.Checkpointer):
    self._ckpt = ckpt
    self._pending = []
    self.last = {}
    self.reset()

  def reset(self) -> None:
    self.sums, self.count, self.start = {}, 0, time.time()

  def add(self, step: int, device_metrics) -> None:
    self._pending.append((step, device_metrics))

  def flush(self) -> None:
    if not self._pending:
      return
    pending, self._pending = self._pending, []
    fetched = jax.device_get([metrics for _, metrics in pending])
    for (step, _), values in zip(pending, fetched):
      host = {k: float(v) for k, v in values.items()}
      _check_finite(step, host, self._ckpt)
      self.last = host
      for k, v in host.items():
        self.sums[k] = self.sums.get(k, 0.0) + v
      self.count += 1


class _SpecializedSteps:
  """Jitted train/eval steps per static specialization of the model (the options its variants
  derive from the parameters, e.g. adaptive spans' trimmed T per layer): a step is compiled
  again only when one of those options changes.

  The parameters are read (a device-to-host copy) only where the loop calls `update`: at its
  start and at log and eval steps, where the host meets the device anyway. A specialization
  read there may be a few steps old; the variants keep it exact (adaptive span computes the
  full span in a step whose spans outgrew the trim).

  `compiled` is the train step that the TPU fit check compiled for `setup.model`: the loop
  runs that executable wherever the parameters specialize to `setup.model`, instead of
  compiling the same program again.
  """

  def __init__(self, setup: assembly.Setup, compiled=None):
    self._setup = setup
    self._steps = {}
    self._current = None
    self._compiled = compiled

  def update(self, params):
    """Selects the steps for the current parameters; returns (train_step, eval_step)."""
    model = assembly.specialized_model(self._setup, params)
    key = model.config.attention_options
    if key not in self._steps:
      if self._current is not None:
        changed = {k: v for k, v in key if dict(self._current).get(k) != v}
        logging.info('specialized attention options changed to %s; compiling their step',
                     changed)
      if self._compiled is not None and key == self._setup.model.config.attention_options:
        train_step = self._compiled
        logging.info('train step: the executable the fit check compiled')
      else:
        train_step = steps.jit_train_step(self._setup, model)
      self._steps[key] = (train_step, steps.jit_eval_step(self._setup, model))
    self._current = key
    return self._steps[key]


def _save_before_data_error(ckpt, window, step: int, state, data_state, shard) -> None:
  """Saves `step` (its batches all consumed) unless it is saved already, before a data error
  ends the run; the save's own failure is logged, and the data error is what gets raised."""
  if step == 0 or ckpt.latest_step() == step:
    return
  if jax.process_count() > 1:  # Saving is collective: the other hosts are in a train step.
    logging.error('input read failed on process %d: not saving step %d alone (the last '
                  'checkpoint is step %s)', jax.process_index(), step, ckpt.latest_step())
    return
  try:
    window.flush()
    ckpt.save(step, state, _gather_data_state(data_state, shard))
    ckpt.wait()
    logging.warning('input read failed: saved step %d before stopping', step)
  except Exception as e:  # pylint: disable=broad-except  (the data error matters more)
    logging.error('could not save step %d before the input error: %s: %s', step,
                  type(e).__name__, e)


class _Profile:
  """A JAX profiler trace of `steps` train steps of this process, into `directory`.

  Counted from the first step this process runs (0; on a resume, the one after the restored
  step): steps start .. start + steps - 1 are traced, so with start >= 1 the first step's
  compilation is not in the trace. As a context manager it also stops (and writes) the trace
  when the loop ends early or raises.
  """

  def __init__(self, directory: str, first_step: int, start: int, steps: int):
    self.directory = directory
    self._begin = first_step + start  # The trace starts before the step from this state.step,
    self._end = self._begin + steps   # and stops once state.step reaches this one.
    self._steps = steps
    self._active = self._done = False
    # A local, single-process trace is also converted for ui.perfetto.dev (jax writes that
    # file through pathlib, and picks the newest trace folder: one host's, on local paths).
    self._perfetto = '://' not in directory and jax.process_count() == 1

  def __enter__(self):
    return self

  def before_step(self, step: int, state) -> None:
    """Starts the trace if the step from state.step == `step` is the first one traced."""
    if self._steps and not self._done and step == self._begin:
      jax.block_until_ready(state)  # Earlier steps' device work stays out of the trace.
      jax.profiler.start_trace(self.directory, create_perfetto_trace=self._perfetto)
      self._active = True

  def after_step(self, step: int, state) -> None:
    """Stops the trace once state.step == `step` ends the traced steps."""
    if self._active and step >= self._end:
      self.stop(state)

  def stop(self, state=None) -> None:
    """Waits for `state` (if given) and writes the trace, if one is running."""
    if not self._active:
      return
    self._active, self._done = False, True
    try:
      if state is not None:
        jax.block_until_ready(state)
    finally:
      jax.profiler.stop_trace()
    logging.info('profiler trace of train steps %d-%d written to %s/plugins/profile/: view it '
                 'with TensorBoard\'s profile plugin (pip install tensorboard-plugin-profile; '
                 'tensorboard --logdir %s, Profile tab) or XProf%s', self._begin + 1, self._end,
                 self.directory, self.directory,
                 ', or open its perfetto_trace.json.gz at https://ui.perfetto.dev'
                 if self._perfetto else '')

  def __exit__(self, exc_type, *exc):
    if not self._active:
      if self._steps and not self._done and exc_type is None:
        logging.warning('profile_steps=%d: nothing was profiled, the run stopped before '
                        'state.step %d where the trace starts (profile_start_step counts from '
                        'the step this process started at)', self._steps, self._begin)
      return
    try:  # The loop ended early or failed: keep what was traced.
      self.stop()
    except Exception as e:  # pylint: disable=broad-except  (never mask the loop's error)
      if exc_type is None:
        raise
      logging.error('could not write the profiler trace: %s: %s', type(e).__name__, e)


def _train_loop(setup: assembly.Setup, state, data_state, ckpt, logger, peak: float, exits: bool,
                on_step: Callable[[int], None] | None = None, compiled=None, harness=None):
  """Steps to config.total_steps. Between log, checkpoint and eval steps the host only
  dispatches: no call in the loop waits for the device (metrics, specialization and the
  preemption agreement are read at those steps), so the device is never idle waiting for
  the host to see a result."""
  config = setup.config
  profile_start, profile_steps = settings.check_profile(config)  # Before the train step compiles.
  # The workdir is the checkpoint folder's parent (checkpoints.Checkpointer).
  profile = _Profile(os.path.join(os.path.dirname(ckpt.directory), 'profile'),
                     int(state.step), profile_start, profile_steps)
  specialized = _SpecializedSteps(setup, compiled)
  train_step, eval_step = specialized.update(state.params)
  # Made on the mesh, replicated (as the compiled step takes it; device_put cannot place a
  # host value on another process's devices).
  rng = jax.jit(lambda: jax.random.key(config.seed + 1), out_shardings=jax.sharding.NamedSharding(
      setup.mesh, jax.sharding.PartitionSpec()))()
  tokens_per_step = config.batch_size * setup.data.seq_len
  window = _MetricWindow(ckpt)
  step = int(state.step)
  batches = setup.data.train_iter(step, data_state)
  compiling = True
  on_step = on_step or (lambda step: None)
  on_step(step)
  with sharding.activate(setup.mesh, setup.rules), _Preemption(exits) as preemption, profile:
    while step < config.total_steps:
      try:
        local, data_state = next(batches)
      except input_pipeline.DataError:  # A damaged shard: keep the last good step, then fail.
        _save_before_data_error(ckpt, window, step, state, data_state, setup.data_shard)
        raise
      batch = assembly.device_batch(setup, local)
      profile.before_step(step, state)
      started = time.time()
      state, step_metrics = train_step(state, batch, rng)
      if compiling:  # The model's (and its stack's) compile time, in the log.
        # A call returns once its step is compiled and dispatched: no wait for the device.
        logging.info('first train step compiled and dispatched in %.1f s (%s stack)',
                     time.time() - started, setup.model_config.stack_name)
        compiling = False
      step += 1
      on_step(step)
      profile.after_step(step, state)
      window.add(step, step_metrics)
      last = step == config.total_steps
      logs = step % config.log_every_steps == 0 or last
      saves = step % config.checkpoint_every_steps == 0 or last
      evals = bool(config.eval_every_steps) and (step % config.eval_every_steps == 0 or last)
      tasks = harness is not None and (step % config.harness.every_steps == 0 or last)
      stop = preemption.requested(step, agree=logs or saves or evals or tasks)
      if logs or stop:
        window.flush()
        scalars = {k: v / window.count for k, v in window.sums.items()}
        scalars['learning_rate'] = window.last['learning_rate']
        scalars['perplexity'] = float(np.exp(min(scalars['loss'], 80.0)))
        scalars['tokens_per_sec'] = window.count * tokens_per_step / (time.time() - window.start)
        # The FLOPs per token of the steps the window's tokens took (a stack of run-time depth
        # reads them from the scalars; every other model gives the startup figure).
        window_flops = setup.model_config.train_flops_per_token(setup.data.seq_len, scalars)
        scalars['mfu'] = scalars['tokens_per_sec'] * window_flops / (peak * jax.device_count())
        logger.write(step, scalars)
        window.reset()
      if saves or stop:
        window.flush()  # Never save a state whose last step has not been checked.
        ckpt.save(step, state, _gather_data_state(data_state, setup.data_shard))
      if logs or evals:  # Where the host meets the device anyway: read the parameters.
        train_step, eval_step = specialized.update(state.params)
      # After the save: a failing evaluation never costs the step's checkpoint.
      if evals:
        logger.write(step, evaluation.score(setup, eval_step, state.params), prefix='eval')
        sampling.write_samples(logger, step, sampling.eval_samples(setup, None, state.params, step))
      if tasks:  # lm-eval's tasks (harness.every_steps) on the same devices, beside the eval.
        logger.write(step, harness(state.params, step), prefix='harness')
      if stop:
        ckpt.wait()  # "saved" only once it is committed.
        logging.warning('preemption requested: saved step %d, exiting', step)
        break
    profile.stop(state)  # A run that ends inside the traced steps.
    ckpt.wait()  # The last save is committed while SIGTERM is still handled.
  return state
