"""Orbax checkpoints: async saves, keep the last K, restore onto any mesh."""

import os

import jax
import numpy as np
import orbax.checkpoint as ocp
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
    self.directory = os.path.join(os.path.abspath(workdir), 'checkpoints')
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=async_save))

  def latest_step(self) -> int | None:
    """Step of the newest complete checkpoint, or None."""
    return self._manager.latest_step()

  def save(self, step: int, state) -> None:
    """Starts saving `state` at `step`; refuses a non-finite state.

    Args:
      step: the optimizer step the state is at.
      state: the TrainState.

    Raises:
      FloatingPointError: the state holds NaN or inf; nothing is written.
    """
    if not all_finite(state.params):
      raise FloatingPointError(
          f'parameters at step {step} are not finite; no checkpoint written. The last good '
          f'checkpoint (step {self.latest_step()}) in {self.directory} is kept.')
    self._manager.save(step, args=ocp.args.StandardSave(state), force=True)

  def restore(self, abstract_state, step: int | None = None):
    """Restores a state laid out like `abstract_state` (shapes, dtypes and shardings).

    Args:
      abstract_state: tree of jax.ShapeDtypeStruct with the target shardings; the saved
        arrays are resharded onto them, so the device count may differ from the saving run.
      step: which checkpoint; defaults to the latest.

    Returns:
      The restored state.

    Raises:
      FileNotFoundError: there is no checkpoint.
      CheckpointError: the checkpoint cannot be read or does not match the model.
    """
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f'no checkpoint found in {self.directory}')
    try:
      return self._manager.restore(step, args=ocp.args.StandardRestore(abstract_state))
    except Exception as e:  # Orbax raises many types; name the folder and the cause.
      raise CheckpointError(
          f'could not restore checkpoint step {step} from {self.directory}: it is corrupt or was '
          f'written by a different model configuration ({type(e).__name__}: {e})') from e

  def wait(self) -> None:
    """Blocks until pending async saves are on disk."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    """Waits for pending saves and releases the manager."""
    self._manager.wait_until_finished()
    self._manager.close()
    logging.info('checkpoints closed: %s', self.directory)
