"""One training run per workdir: an advisory lock held for the whole run.

Two runs on one workdir would resume from each other's checkpoints and save into one folder.
Process 0 of a run takes an exclusive `flock` on WORKDIR/.run.lock and writes its pid, host
and start time there; a second run fails at once with a message naming the first. The
operating system drops the lock when its process dies, however it dies, so a lock left by a
dead run is taken over (with a note in the log). Object stores (gs://) have no locks: there
the run goes on without one and says so.

In a multi-process run only process 0 tries the lock, and every process must learn its verdict:
the others would otherwise go on alone until their first collective and die there, after
jax's timeouts, with an error that says nothing about the lock. So right after process 0's try,
all processes take part in one broadcast of the verdict (`_share_verdict`), and a refusal is
the same WorkdirBusy, with the same message, on every process. Process 0 reaches that
broadcast whatever its try gave: an error there is raised only after it.
"""

import contextlib
import fcntl
import json
import os
import socket
import time

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

LOCK_FILE = '.run.lock'


# The verdict process 0 broadcasts: one status byte, then the UTF-8 message, zero-padded. A
# fixed size, so that every process can take part without knowing the message's length.
_VERDICT_BYTES = 4096
_OK, _BUSY, _FAILED = 0, 1, 2


class WorkdirBusy(RuntimeError):
  """Another live run holds the workdir.

  On a process other than 0 of a multi-process run, also: process 0 could not take the lock
  for another reason (the message says which), so that the entry point reports it as one line.
  """


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


@contextlib.contextmanager
def hold(workdir: str):
  """Holds the workdir's run lock (process 0 only) for the duration of the block.

  In a multi-process run this is a collective: every process must call it (and they do: each
  runs the same program), since all of them receive process 0's verdict.

  Raises:
    WorkdirBusy: another live process holds it (on every process of a multi-process run).
  """
  if '://' in workdir:  # Every process sees the same path: none needs process 0's verdict.
    if jax.process_index() == 0:
      logging.warning('workdir %s is not a local path: no run lock; make sure no other run '
                      'uses it', workdir)
    yield
    return
  if jax.process_count() == 1:
    with _locked(workdir):
      yield
    return
  with contextlib.ExitStack() as stack:
    error = None
    if jax.process_index() == 0:
      try:
        stack.enter_context(_locked(workdir))
      except Exception as e:  # pylint: disable=broad-except  (raised below, on every process)
        error = e
    status, message = _share_verdict(error)
    if error is not None:
      raise error
    if status == _BUSY:
      raise WorkdirBusy(message)
    if status == _FAILED:
      raise WorkdirBusy(f'process 0 could not take the run lock of workdir {workdir}: '
                        f'{message}')
    yield


def _share_verdict(error: Exception | None) -> tuple[int, str]:
  """Broadcasts process 0's verdict on the lock, (status, message), to every process."""
  buf = np.zeros(_VERDICT_BYTES, np.uint8)
  if error is not None:
    status = _BUSY if isinstance(error, WorkdirBusy) else _FAILED
    text = str(error) if status == _BUSY else f'{type(error).__name__}: {error}'
    raw = text.encode('utf-8')[:_VERDICT_BYTES - 1]
    buf[0] = status
    buf[1:1 + len(raw)] = np.frombuffer(raw, np.uint8)
  buf = np.asarray(multihost_utils.broadcast_one_to_all(buf))
  message = buf[1:].tobytes().rstrip(b'\0').decode('utf-8', errors='replace')
  return int(buf[0]), message


@contextlib.contextmanager
def _locked(workdir: str):
  """Takes WORKDIR/.run.lock (raising WorkdirBusy if a live run has it) and holds it."""
  path = os.path.join(workdir, LOCK_FILE)
  with open(path, 'a+') as f:
    try:
      fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      f.seek(0)
      owner = f.read().strip() or 'owner unknown'
      raise WorkdirBusy(f'workdir {workdir} is in use by another run ({owner}): wait for it to '
                        'finish, stop it, or choose another --workdir') from None
    f.seek(0)
    previous = f.read().strip()
    if previous:
      try:
        owner = json.loads(previous)
      except ValueError:
        owner = {}
      same_host = owner.get('host') == socket.gethostname()
      if not (same_host and _pid_alive(int(owner.get('pid', -1)))):
        logging.warning('workdir %s: took over the run lock of a run that is no longer running '
                        '(%s)', workdir, previous)
    f.seek(0)
    f.truncate()
    f.write(json.dumps({'pid': os.getpid(), 'host': socket.gethostname(),
                        'started': time.strftime('%Y-%m-%d %H:%M:%S')}))
    f.flush()
    try:
      yield
    finally:
      f.seek(0)
      f.truncate()
      f.flush()
      fcntl.flock(f, fcntl.LOCK_UN)
