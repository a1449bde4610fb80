"""Orbax checkpoints: async saves, keep the last K, restore onto any mesh."""

import os

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from absl import logging


class CheckpointError(RuntimeError):
  """A checkpoint could not be restored (corrupt, or from an incompatible config)."""


def all_finite(tree) -> bool:
  """True when every floating-point leaf of `tree` is finite (one device reduction per leaf)."""
  leaves = [x for x in jax.tree.leaves(tree) if np.issubdtype(x.dtype, np.floating)]
  return all(bool(jax.numpy.isfinite(x).all()) for x in leaves)


class Checkpointer:
  """CheckpointManager wrapper owning the `checkpoints/` folder of a workdir.

  Attributes:
    directory: the checkpoint folder.
  """

  def __init__(self, workdir: str, *, keep: int = 3, async_save: bool = True):
    self.directory = os.path.join(workdir if '://' in workdir else os.path.abspath(workdir),
                                  'checkpoints')
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=async_save))

  def latest_step(self) -> int | None:
    """Step of the newest complete checkpoint, or None."""
    return self._manager.latest_step()

  def save(self, step: int, state, data_state: dict | None = None) -> None:
    """Starts saving `state` (and the input stream's position) at `step`; refuses non-finite.

    Args:
      step: the optimizer step the state is at.
      state: the TrainState.
      data_state: JSON-able position of every process's input stream after `step` batches.

    Raises:
      FloatingPointError: the state holds NaN or inf; nothing is written.
    """
    if not all_finite(state.params):
      raise FloatingPointError(
          f'parameters at step {step} are not finite; no checkpoint written. The last good '
          f'checkpoint (step {self.latest_step()}) in {self.directory} is kept.')
    items = {'state': ocp.args.StandardSave(state)}
    if data_state is not None:
      items['data'] = ocp.args.JsonSave(data_state)
    self._manager.save(step, args=ocp.args.Composite(**items), force=True)

  def restore(self, abstract_state, step: int | None = None, *, with_data: bool = False):
    """Restores a state laid out like `abstract_state` (shapes, dtypes and shardings).

    Args:
      abstract_state: tree of jax.ShapeDtypeStruct with the target shardings; the saved
        arrays are resharded onto them, so the device count may differ from the saving run.
      step: which checkpoint; defaults to the latest.
      with_data: also return the saved input-stream position (None if none was saved).

    Returns:
      The restored state, or (state, data_state) with `with_data`.

    Raises:
      FileNotFoundError: there is no checkpoint.
      CheckpointError: the checkpoint cannot be read or does not match the model.
    """
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f'no checkpoint found in {self.directory}')
    items = {'state': ocp.args.StandardRestore(abstract_state)}
    has_data = with_data and 'data' in self._item_names(step)
    if has_data:
      items['data'] = ocp.args.JsonRestore()
    try:
      restored = self._manager.restore(step, args=ocp.args.Composite(**items))
    except Exception as e:  # Orbax raises many types; name the folder and the cause.
      raise CheckpointError(
          f'could not restore checkpoint step {step} from {self.directory}: it is corrupt or was '
          f'written by a different model configuration ({type(e).__name__}: {e})') from e
    if not with_data:
      return restored.state
    return restored.state, (restored.data if has_data else None)

  def _item_names(self, step: int) -> set[str]:
    path = epath.Path(self.directory) / str(step)
    return {child.name for child in path.iterdir()} if path.exists() else set()

  def wait(self) -> None:
    """Blocks until pending async saves are on disk."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    """Waits for pending saves and releases the manager."""
    self._manager.wait_until_finished()
    self._manager.close()
    logging.info('checkpoints closed: %s', self.directory)

  def restore_params(self, abstract_params, step: int | None = None):
    """Restores only the parameters and the step of a checkpoint (orbax partial restore).

    The optimizer state is not read, so a config whose optimizer differs from the run's
    (e.g. clip_grad_norm=0, another opt_state tree) can still evaluate its parameters.

    Args:
      abstract_params: tree of jax.ShapeDtypeStruct with the target shardings; the saved
        arrays are resharded onto them, whatever mesh wrote them.
      step: which checkpoint; defaults to the latest.

    Returns:
      (step, params).

    Raises:
      FileNotFoundError: there is no checkpoint.
      CheckpointError: the checkpoint cannot be read or its parameters do not match.
    """
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f'no checkpoint found in {self.directory}')
    mesh = jax.tree.leaves(abstract_params)[0].sharding.mesh
    item = {'params': abstract_params,
            'step': jax.ShapeDtypeStruct((), np.int32, sharding=jax.sharding.NamedSharding(
                mesh, jax.sharding.PartitionSpec()))}
    # A read-only manager of its own: this one may have bound 'state' to StandardSave/Restore,
    # and orbax keeps one handler per item name.
    reader = ocp.CheckpointManager(
        self.directory, item_names=('state',),
        options=ocp.CheckpointManagerOptions(read_only=True, save_interval_steps=0,
                                             create=False))
    try:
      restored = reader.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
          item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item),
          partial_restore=True)))
    except Exception as e:  # Orbax raises many types; name the folder and the cause.
      raise CheckpointError(
          f'could not restore the parameters of checkpoint step {step} from {self.directory}: '
          f'it is corrupt or was written by a different model configuration '
          f'({type(e).__name__}: {e})') from e
    finally:
      reader.close()
    return int(restored.state['step']), restored.state['params']


def restore_latest(workdir: str, abstract_state, *, keep: int, required: str = ''):
  """(step, state) of the latest checkpoint in `workdir`, or (None, None) if there is none.

  Args:
    workdir: the training run's folder.
    abstract_state: the state's shapes and shardings.
    keep: config.keep_checkpoints (the manager is opened with it).
    required: if not empty, a missing checkpoint raises FileNotFoundError ending with this.
  """
  ckpt = Checkpointer(workdir, keep=keep, async_save=False)
  try:
    step = ckpt.latest_step()
    if step is None:
      if required:
        raise FileNotFoundError(f'no checkpoint in {workdir}: {required}')
      return None, None
    return step, ckpt.restore(abstract_state)
  finally:
    ckpt.close()
