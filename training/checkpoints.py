"""Orbax checkpoints: async saves, keep the last K, restore onto any mesh, checksums.

Every checkpoint holds, beside the train state, a `checksums` item: per array, two 32-bit
sums of a position-keyed hash of its elements' bits (`tree_checksums`). The sums are
computed on the devices by one jitted reduction over the global arrays, so they do not depend
on how the arrays are sharded: a checkpoint saved on one mesh verifies on any other. They are
written by orbax in the same commit as the arrays, so no committed checkpoint lacks them.
Restoring recomputes them over the restored arrays; a mismatch, a read error or missing
metadata makes the newest checkpoint "corrupt": the restore falls back to the newest good one
and moves the bad folder to `checkpoints/corrupt/`. A step whose folder is gone by then was
rotated away by the run writing there (an eval beside a live run): it is not corrupt, and the
steps are listed again.
"""

import datetime
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from jax.experimental import multihost_utils
from etils import epath

# Folder (inside `checkpoints/`) where corrupt step folders are moved; orbax ignores it.
CORRUPT_DIR = 'corrupt'
CHECKSUM_ALGORITHM = 'fmix32-golden-position-sum-x2'
# Seeds of the two 32-bit checksum lanes, and the odd multiplier spreading positions.
_SEEDS = (0x7F4A7C15, 0x2545F491)
_GOLDEN = 0x9E3779B9


class CheckpointError(RuntimeError):
  """A checkpoint could not be saved or restored (corrupt, incompatible, or a write error)."""


class CheckpointSaveError(CheckpointError):
  """Writing a checkpoint failed (the folder is not writable, the disk is full, ...)."""


class _Corrupt(Exception):
  """A checkpoint is damaged or incomplete (as opposed to written by another model)."""


class _Incompatible(Exception):
  """A checkpoint is intact but holds other array names or shapes than the model."""


@jax.jit
def _all_finite(leaves) -> jax.Array:
  return jnp.all(jnp.stack([jnp.isfinite(x).all() for x in leaves]))


def all_finite(tree) -> bool:
  """True when every floating-point leaf of `tree` is finite: one compiled reduction over
  the whole tree (per-leaf eager reductions compiled a program for every leaf shape, about a
  second at a run's first save)."""
  leaves = [x for x in jax.tree.leaves(tree) if np.issubdtype(x.dtype, np.floating)]
  return not leaves or bool(_all_finite(leaves))


def leaf_name(path) -> str:
  """Dotted name of a tree path, as orbax names the arrays ('opt_state.1.0.count')."""
  parts = []
  for key in path:
    for attr in ('key', 'idx', 'name'):
      if hasattr(key, attr):
        parts.append(str(getattr(key, attr)))
        break
    else:
      parts.append(str(key))
  return '.'.join(parts)


def _fmix32(h):
  """MurmurHash3's 32-bit finalizer: a bijection that spreads every input bit."""
  h = h ^ (h >> 16)
  h = h * np.uint32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * np.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


def _words(x):
  """The bits of `x` as uint32 (64-bit elements gain a trailing axis of two words)."""
  if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  size = x.dtype.itemsize
  if size == 4 or size == 8:
    return jax.lax.bitcast_convert_type(x, jnp.uint32)
  return jax.lax.bitcast_convert_type(x, {1: jnp.uint8, 2: jnp.uint16}[size]).astype(jnp.uint32)


def _leaf_checksum(x):
  """Two wrapping uint32 sums, one per seed s, of fmix32(bits ^ (position * GOLDEN + s)).

  A change of one element changes its term (fmix32 is a bijection of the bits for a given
  position), so its sums always change; a larger damage, or values moved to other positions,
  goes unnoticed with probability about 2^-64. The position is the row-major index built from
  per-axis iotas, so the arrays keep their sharding (a reshape to 1-D would gather them).
  """
  words = _words(x)
  index = jnp.zeros(words.shape, jnp.uint32)
  stride = 1
  for axis in reversed(range(words.ndim)):
    index = index + jax.lax.broadcasted_iota(jnp.uint32, words.shape, axis) * np.uint32(
        stride % 2**32)
    stride *= words.shape[axis]
  key = index * np.uint32(_GOLDEN)
  return jnp.stack([jnp.sum(_fmix32(words ^ (key + np.uint32(seed))), dtype=jnp.uint32)
                    for seed in _SEEDS])


@functools.lru_cache(maxsize=8)
def _checksum_fn(out_sharding):
  return jax.jit(lambda leaves: [_leaf_checksum(x) for x in leaves], out_shardings=out_sharding)


def tree_checksums(tree) -> dict[str, dict]:
  """{array name: {'sum', 'dtype', 'shape'}} of every array leaf of `tree`.

  Runs on the devices holding the arrays (a collective over all processes when they are
  sharded across hosts); every process gets the same sums.
  """
  named = [(leaf_name(path), x) for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]
           if hasattr(x, 'dtype') and hasattr(x, 'shape')]
  if not named:
    return {}
  sharding = getattr(named[0][1], 'sharding', None)
  out = None
  if isinstance(sharding, jax.sharding.NamedSharding):
    out = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
  sums = _checksum_fn(out)([x for _, x in named])
  result = {}
  for (name, x), s in zip(named, sums):
    a, b = (int(v) for v in np.asarray(s.addressable_data(0)))
    result[name] = {'sum': f'{a:08x}{b:08x}', 'dtype': str(np.dtype(x.dtype)),
                    'shape': list(x.shape)}
  return result


def _short(error: BaseException, limit: int = 300) -> str:
  """First line of an error and of its root cause, capped (TensorStore errors carry a spec)."""
  def line(e):
    return f'{type(e).__name__}: {e}'.split('\n', 1)[0].split(' See full TensorStore', 1)[0]
  root = error
  while root.__cause__ is not None or root.__context__ is not None:
    root = root.__cause__ or root.__context__
  text = line(error) if root is error else f'{line(error)} <- {line(root)}'
  return text if len(text) <= limit else text[:limit] + '...'


def _first(items: list[str], count: int = 3) -> str:
  more = f' (and {len(items) - count} more)' if len(items) > count else ''
  return '; '.join(items[:count]) + more


def _agree(code: int) -> tuple[int, str]:
  """The largest of every process's `code` (0 ok, 1 corrupt, 2 incompatible), and which
  processes reported it ('' with one process)."""
  if jax.process_count() == 1:
    return code, ''
  codes = np.asarray(multihost_utils.process_allgather(np.array(code, np.int32))).reshape(-1)
  worst = int(codes.max())
  return worst, ', '.join(str(i) for i in np.flatnonzero(codes == worst)) if worst else ''


class Checkpointer:
  """CheckpointManager wrapper owning the `checkpoints/` folder of a workdir.

  Attributes:
    directory: the checkpoint folder.
    restored_step: the step the last restore() returned (None before).
  """

  def __init__(self, workdir: str, *, keep: int = 3, async_save: bool = True,
               checksums: bool = True, read_only: bool = False):
    self.directory = os.path.join(workdir if '://' in workdir else os.path.abspath(workdir),
                                  'checkpoints')
    self._checksums = checksums
    self._pending = None  # Step of the last save not yet known to be committed.
    self.restored_step = None  # Set by restore(): the step it restored.
    self._read_only = read_only
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(
            # A reader (eval, inspect) never saves, deletes, moves or makes folders.
            read_only=read_only, save_interval_steps=0 if read_only else 1,
            max_to_keep=keep, create=not read_only, enable_async_checkpointing=async_save,
            # Folders are made in save(): an unwritable folder fails there. Made in the
            # background, the failure left orbax's writer threads waiting 20 minutes for a
            # folder signal that never came, and the process hung at exit.
            async_options=ocp.AsyncOptions(create_directories_asynchronously=False)))

  def latest_step(self) -> int | None:
    """Step of the newest complete checkpoint, or None."""
    return self._manager.latest_step()

  def _save_error(self, step: int, error: BaseException) -> CheckpointSaveError:
    return CheckpointSaveError(
        f'saving checkpoint step {step} to {self.directory} failed ({_short(error, 2000)}); '
        f'the last committed checkpoint is step {self._committed_step()}')

  def _committed_step(self) -> int | None:
    try:
      self._manager.reload()
      return self._manager.latest_step()
    except Exception:  # pylint: disable=broad-except  (only for the message)
      return None

  def save(self, step: int, state, data_state: dict | None = None) -> None:
    """Starts saving `state` (and the input stream's position) at `step`; refuses non-finite.

    A failure of the previous asynchronous save surfaces here.

    Args:
      step: the optimizer step the state is at.
      state: the TrainState.
      data_state: JSON-able position of every process's input stream after `step` batches.

    Raises:
      FloatingPointError: the state holds NaN or inf; nothing is written.
      CheckpointSaveError: this save, or the previous one, could not be written.
    """
    if not all_finite(state.params):
      raise FloatingPointError(
          f'parameters at step {step} are not finite; no checkpoint written. The last good '
          f'checkpoint (step {self.latest_step()}) in {self.directory} is kept.')
    self.wait()  # Surfaces the previous save's error before starting another.
    items = {'state': ocp.args.StandardSave(state)}
    if data_state is not None:
      items['data'] = ocp.args.JsonSave(data_state)
    if self._checksums:
      items['checksums'] = ocp.args.JsonSave(
          {'algorithm': CHECKSUM_ALGORITHM, 'arrays': tree_checksums(state)})
    try:
      self._manager.save(step, args=ocp.args.Composite(**items), force=True)
    except Exception as e:  # Orbax raises many types; name the folder and the cause.
      raise self._save_error(step, e) from e
    self._pending = step

  def wait(self) -> None:
    """Blocks until the pending save is committed.

    Raises:
      CheckpointSaveError: it failed, or its folder is not there once orbax is done.
    """
    step, self._pending = self._pending, None
    try:
      self._manager.wait_until_finished()
    except Exception as e:  # pylint: disable=broad-except
      if step is None:  # Already raised for its step: do not mask what came since.
        logging.error('checkpoint save failure seen again: %s', _short(e))
        return
      raise self._save_error(step, e) from e
    if step is not None and not (epath.Path(self.directory) / str(step)).is_dir():
      # Orbax logs some commit errors instead of raising them.
      raise self._save_error(step, FileNotFoundError(
          f'{self.directory}/{step} is missing after the commit; see the log above'))

  def restore(self, abstract_state, step: int | None = None, *, with_data: bool = False):
    """Restores a state laid out like `abstract_state` (shapes, dtypes and shardings).

    Without `step`, a corrupt or incomplete newest checkpoint (read error, missing metadata,
    checksum mismatch) is skipped with a warning for the newest good one; once one restores,
    the bad folders are moved to `checkpoints/corrupt/<step>-<UTC time>` (never deleted).

    Args:
      abstract_state: tree of jax.ShapeDtypeStruct with the target shardings; the saved
        arrays are resharded onto them, so the device count may differ from the saving run.
      step: which checkpoint (no fallback); defaults to the newest good one.
      with_data: also return the saved input-stream position (None if none was saved).

    Returns:
      The restored state, or (state, data_state) with `with_data`.

    Raises:
      FileNotFoundError: there is no checkpoint.
      CheckpointError: `step` (or, without `step`, every checkpoint) is corrupt, or the
        checkpoint holds other arrays or shapes than the model (no fallback then: an older
        checkpoint of the same run would not match either).
    """
    return self._newest_good(
        step, lambda s: self._restore_verified(abstract_state, s, with_data=with_data))

  def restore_params(self, abstract_params, step: int | None = None):
    """Restores only the parameters and the step of a checkpoint (orbax partial restore).

    The optimizer state is not read, so a config whose optimizer differs from the run's
    (e.g. clip_grad_norm=0, another opt_state tree) can still evaluate its parameters. The
    parameters are checked against their checksums like restore(), with the same fallback
    to the newest good checkpoint; a read-only Checkpointer leaves the corrupt folders where
    they are (the training run moves them aside when it resumes).

    Args:
      abstract_params: tree of jax.ShapeDtypeStruct with the target shardings; the saved
        arrays are resharded onto them, whatever mesh wrote them.
      step: which checkpoint (no fallback); defaults to the newest good one.

    Returns:
      (step, params).

    Raises:
      FileNotFoundError: there is no checkpoint.
      CheckpointError: as restore().
    """
    mesh = jax.tree.leaves(abstract_params)[0].sharding.mesh
    item = {'params': abstract_params,
            'step': jax.ShapeDtypeStruct((), np.int32, sharding=jax.sharding.NamedSharding(
                mesh, jax.sharding.PartitionSpec()))}
    state = self._newest_good(
        step, lambda s: self._restore_verified(item, s, partial=True))
    return int(state['step']), state['params']

  def _newest_good(self, step: int | None, read):
    """`read(step)` of `step`, or without it of the newest step that is not corrupt."""
    self._manager.reload()
    steps = sorted(self._manager.all_steps(), reverse=True) if step is None else [step]
    if not steps:
      raise FileNotFoundError(f'no checkpoint found in {self.directory}')
    if step is not None and not (epath.Path(self.directory) / str(step)).exists():
      saved = sorted(self._manager.all_steps())
      raise FileNotFoundError(f'no checkpoint step {step} in {self.directory} (saved steps: '
                              f'{", ".join(map(str, saved)) or "none"})')
    bad, tried = [], set()
    while steps:
      candidate = steps.pop(0)
      tried.add(candidate)
      try:
        restored = read(candidate)
      except _Incompatible as e:
        raise CheckpointError(
            f'checkpoint step {candidate} in {self.directory} was written by a different model '
            f'configuration: {e}') from e
      except _Corrupt as e:
        if self._deleted(candidate):
          # The run that writes these checkpoints rotated this step away (keep_checkpoints)
          # while it was read: not damage. Newer steps may have been committed meanwhile.
          if step is not None:
            raise FileNotFoundError(
                f'checkpoint step {step} in {self.directory} was deleted while it was read '
                '(the training run keeps only its newest keep_checkpoints steps); saved '
                f'steps now: {", ".join(map(str, sorted(self._manager.all_steps()))) or "none"}'
            ) from None
          steps = [s for s in sorted(self._manager.all_steps(), reverse=True) if s not in tried]
          logging.info('checkpoint step %d in %s was deleted while it was read (rotated by '
                       'the run writing there); reading the newest step now: %s', candidate,
                       self.directory, steps[0] if steps else 'none left')
          continue
        bad.append((candidate, str(e)))
        if step is None:
          logging.warning('checkpoint step %d in %s is corrupt (%s); trying an older one',
                          candidate, self.directory, e)
        continue
      for bad_step, reason in bad:
        if self._read_only:
          logging.warning('checkpoint step %d in %s is corrupt (%s); restored step %d. It is '
                          'left in place: the training run moves it aside when it resumes',
                          bad_step, self.directory, reason, candidate)
        else:
          self._move_aside(bad_step, reason, candidate)
      self.restored_step = candidate
      return restored
    if not bad:
      raise FileNotFoundError(f'no checkpoint found in {self.directory}: every step was deleted '
                              'while it was read')
    listing = '; '.join(f'step {s}: {reason}' for s, reason in bad)
    raise CheckpointError(
        f'could not restore checkpoint step{"s" if len(bad) > 1 else ""} '
        f'{", ".join(str(s) for s, _ in bad)} from {self.directory}: '
        f'{"no good checkpoint remains; nothing was moved or deleted. " if step is None else ""}'
        f'{listing}')

  def _deleted(self, step: int) -> bool:
    """True when `step`'s folder is gone (on any process), the step list reloaded."""
    gone, _ = _agree(int(not (epath.Path(self.directory) / str(step)).exists()))
    self._manager.reload()
    return bool(gone)

  def _restore_verified(self, abstract_state, step: int, *, with_data: bool = False,
                        partial: bool = False):
    """One step's state (and data position), checked against the model and its checksums;
    every process reaches the same verdict. `partial`: `abstract_state` names a subset of
    the saved arrays (the others are not read)."""
    code, problem = 0, None
    try:
      self._check_metadata(abstract_state, step, partial=partial)
    except _Incompatible as e:
      code, problem = 2, e
    except _Corrupt as e:
      code, problem = 1, e
    agreed, where = _agree(code)
    if agreed:
      raise problem or (_Incompatible if agreed == 2 else _Corrupt)(
          f'unusable on process {where}')
    names = self._item_names(step)
    if partial:
      items = {'state': ocp.args.PyTreeRestore(
          item=abstract_state, partial_restore=True,
          restore_args=ocp.checkpoint_utils.construct_restore_args(abstract_state))}
    else:
      items = {'state': ocp.args.StandardRestore(abstract_state)}
    has_data = with_data and 'data' in names
    if has_data:
      items['data'] = ocp.args.JsonRestore()
    if 'checksums' in names:
      items['checksums'] = ocp.args.JsonRestore()
    restored, problem = None, None
    try:
      restored = self._read(step, ocp.args.Composite(**items))
    except Exception as e:  # pylint: disable=broad-except  (orbax raises many types)
      problem = _Corrupt(f'read error: {_short(e)}')
    failed, where = _agree(int(problem is not None))
    if failed:
      raise problem or _Corrupt(f'a read error on process {where}')
    if 'checksums' in names:
      self._verify(restored.checksums, restored.state, step)
    else:
      logging.warning('checkpoint step %d in %s has no checksums (written before they were '
                      'recorded); restored unverified', step, self.directory)
    state = restored.state
    if not with_data:
      return state
    return state, (restored.data if has_data else None)

  def _read(self, step: int, args):
    """Orbax's restore of one step without its closing cross-process barrier: a process
    whose read fails would skip the barrier the others wait in (they then fail with a
    barrier name mismatch, or hang). The processes agree afterwards (_agree)."""
    me = jax.process_index()
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler(),
                          multiprocessing_options=ocp.options.MultiprocessingOptions(
                              primary_host=me, active_processes={me})) as reader:
      return reader.restore(epath.Path(self.directory) / str(step), args=args)

  def _check_metadata(self, abstract_state, step: int, *, partial: bool = False) -> None:
    """Raises _Corrupt if the step's metadata is missing or unreadable, _Incompatible if the
    saved arrays' names or shapes differ from the model's (`partial`: if some of the model's
    are not saved, or differ).

    The names come from the item's `_METADATA` (a small JSON file), the shapes from the array
    store: names that `_METADATA` lists but the store does not are damage, not another model.
    """
    step_dir = epath.Path(self.directory) / str(step)
    path = step_dir / 'state'
    # Orbax writes both for every committed step (without the second it guesses the tree).
    for required in (step_dir / '_CHECKPOINT_METADATA', path / '_METADATA'):
      if not required.exists():
        raise _Corrupt(f'{required.relative_to(step_dir)} is missing')
    try:
      entries = json.loads((path / '_METADATA').read_text())['tree_metadata'].values()
      listed = {'.'.join(str(k['key']) for k in entry['key_metadata']) for entry in entries
                if not entry['value_metadata'].get('skip_deserialize')}  # Not empty nodes.
    except Exception as e:  # pylint: disable=broad-except
      raise _Corrupt(f'state/_METADATA cannot be read ({_short(e)})') from e
    wanted = {leaf_name(p): tuple(a.shape) for p, a in
              jax.tree_util.tree_flatten_with_path(abstract_state)[0]}
    if (not set(wanted) <= listed) if partial else listed != set(wanted):
      differences = [f'{n}: {"only in the checkpoint" if n in listed else "not in the checkpoint"}'
                     for n in sorted((set(wanted) - listed) if partial else listed ^ set(wanted))]
      raise _Incompatible(_first(differences))
    try:
      with ocp.StandardCheckpointer() as reader:
        metadata = reader.metadata(path).item_metadata
      stored = {leaf_name(p): tuple(m.shape) for p, m in
                jax.tree_util.tree_flatten_with_path(metadata)[0]}
    except Exception as e:  # pylint: disable=broad-except
      raise _Corrupt(f'its array metadata cannot be read ({_short(e)})') from e
    if set(stored) != listed:
      raise _Corrupt(f'the array store lacks {_first(sorted(listed - set(stored)))} '
                     'listed in state/_METADATA')
    differences = [f'{n}: stored {stored[n]}, requested {wanted[n]}'
                   for n in sorted(wanted) if stored[n] != wanted[n]]
    if differences:
      raise _Incompatible(_first(differences))

  def _verify(self, saved: dict, state, step: int) -> None:
    """Raises _Corrupt when a restored array's checksum differs from the saved one."""
    if saved.get('algorithm') != CHECKSUM_ALGORITHM:
      raise _Corrupt(f'unknown checksum algorithm {saved.get("algorithm")!r}')
    recorded = saved['arrays']
    actual = tree_checksums(state)
    unverified = [n for n in actual if n in recorded and
                  recorded[n]['dtype'] != actual[n]['dtype']]
    mismatched = [n for n in actual if n in recorded and n not in unverified and
                  recorded[n]['sum'] != actual[n]['sum']]
    missing = sorted(set(actual) - set(recorded))
    if mismatched or missing:
      raise _Corrupt(f'checksum mismatch in {len(mismatched)} arrays ({", ".join(mismatched[:4])})'
                     if mismatched else f'no checksum for {", ".join(missing[:4])}')
    if unverified:
      logging.info('checkpoint step %d: %d arrays restored in another dtype are not '
                   'checksummed', step, len(unverified))

  def _move_aside(self, step: int, reason: str, good: int) -> None:
    """Moves a corrupt step folder to `corrupt/<step>-<UTC time>` (process 0; all wait)."""
    source = epath.Path(self.directory) / str(step)
    target = epath.Path(self.directory) / CORRUPT_DIR / (
        f'{step}-{datetime.datetime.now(datetime.timezone.utc):%Y%m%dT%H%M%SZ}')
    if jax.process_index() == 0:
      try:
        target.parent.mkdir(parents=True, exist_ok=True)
        source.rename(target)
        logging.warning('checkpoint step %d is corrupt (%s): moved %s to %s; restored step %d '
                        'instead', step, reason, source, target, good)
      except OSError as e:
        logging.warning('checkpoint step %d is corrupt (%s) and could not be moved aside '
                        '(%s); restored step %d instead', step, reason, e, good)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices(f'checkpoint_move_aside_{step}')
    self._manager.reload()

  def _item_names(self, step: int) -> set[str]:
    path = epath.Path(self.directory) / str(step)
    return {child.name for child in path.iterdir()} if path.exists() else set()

  def close(self) -> None:
    """Waits for the pending save and releases the manager.

    Raises:
      CheckpointSaveError: the pending save failed (the manager is released all the same).
    """
    try:
      self.wait()
    finally:
      try:
        self._manager.close()
      except Exception as e:  # pylint: disable=broad-except
        logging.error('closing the checkpoint manager of %s: %s', self.directory, e)
      logging.info('checkpoints closed: %s', self.directory)
