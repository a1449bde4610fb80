"""One training run per workdir: an advisory lock held for the whole run.

Two runs on one workdir would resume from each other's checkpoints and save into one folder.
Process 0 of a run takes an exclusive `flock` on WORKDIR/.run.lock and writes its pid, host
and start time there; a second run fails at once with a message naming the first. The
operating system drops the lock when its process dies, however it dies, so a lock left by a
dead run is taken over (with a note in the log). Object stores (gs://) have no locks: there
the run goes on without one and says so.
"""

import contextlib
import fcntl
import json
import os
import socket
import time

import jax
from absl import logging

LOCK_FILE = '.run.lock'


class WorkdirBusy(RuntimeError):
  """Another live run holds the workdir."""


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

  Raises:
    WorkdirBusy: another live process holds it.
  """
  if jax.process_index() != 0:
    yield
    return
  if '://' in workdir:
    logging.warning('workdir %s is not a local path: no run lock; make sure no other run uses '
                    'it', workdir)
    yield
    return
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
