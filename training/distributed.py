"""Multi-host launch: when and how to call `jax.distributed.initialize`.

A run is one process per host (or per task). It joins a cluster whenever the environment
describes one, so that N processes share one mesh, one input stream split N ways and one set
of checkpoints; N independent single-process runs on one workdir would overwrite each
other's saves. What describes a cluster, in order:

1. Explicit settings: the flags --coordinator_address, --num_processes and --process_id, each
   falling back to JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID. All three
   given, no launcher variable is read; settings a detected launcher (below) can supply may be
   left out; --num_processes=1 means one process.
2. Open MPI (`mpirun`): OMPI_COMM_WORLD_SIZE > 1; the coordinator comes from the launcher's
   OMPI_MCA_orte_hnp_uri.
3. SLURM: a job step of more than one task (SLURM_JOB_ID with SLURM_NTASKS > 1). jax's SLURM
   detector takes the process count and index from SLURM_NTASKS and SLURM_PROCID and puts the
   coordinator on the step's first node (SLURM_STEP_NODELIST) at a port derived from the job
   id (JAX_COORDINATOR_PORT overrides it). On GPUs it also gives each process the one GPU of
   index SLURM_LOCALID: launch one task per GPU.
4. Cloud TPU: a TPU VM, or TPU_WORKER_HOSTNAMES / TPU_PROCESS_ADDRESSES listing several hosts;
   jax reads the workers from the environment or the VM's metadata.

A cluster described only in part (a process count without this process's index, an index out
of range, a coordinator with nothing to say how many processes join it, SLURM_NTASKS > 1
without the variables `srun` sets) is a ValueError before anything starts: a wrong guess would
hang until jax's 5 minute connection timeout, or train alone into a shared workdir.

`plan` decides from (flags, environment) alone, so every case is testable without starting
processes; `initialize` applies the plan.

A lost process. When one process of a run dies (a host fails, or a process is killed), the
others cannot go on: they wait in their next collective for it. jax notices through its
heartbeats, but only after its heartbeat timeout (100 s by default), and then aborts every
process with a C++ stack trace (jaxlib 0.10's hook for that moment, the client's
missed_heartbeat_callback, cannot be used from Python: calling it throws std::bad_cast). So a
run of several processes also keeps its own watch (`_PeerWatch`), through the coordination
service's key-value store: each process records a heartbeat there every few seconds; process 0
reads them all, and when one has been silent for the peer timeout it records the failure; every
process then prints one `error: ...` line naming the lost process and exits with status 1 at
once (os._exit: a normal exit would wait at jax's shutdown barrier for the dead process).
Process 0 exits last, once the others have seen the failure: it hosts the coordination service,
and the others' jax clients abort the moment it goes. The same watch lets a process that
finishes wait at exit for the others, so that jax's shutdown barrier is never entered while a
process is gone. If process 0 itself dies, jax aborts the other processes at once (their
clients lose the service); nothing in Python runs before that.

The timeouts, in seconds, from the environment (whole numbers):

- DISTRIBUTED_PEER_TIMEOUT_SECONDS (default 20; 0 turns the watch off): how long a process may
  go unheard before the run is stopped. Heartbeats come from a Python thread every eighth of
  it (at most 5 s), so a process is only declared lost if it has not run Python for this long:
  dead, killed, frozen, or holding the GIL in a C call for that long.
- JAX_HEARTBEAT_TIMEOUT_SECONDS (default max(100, 3 x the peer timeout)): jax's own heartbeat
  timeout, after which it aborts every process. It must exceed the peer timeout so that the
  watch acts first; it stays the last resort when the watch is off or cannot act.
- JAX_SHUTDOWN_TIMEOUT_SECONDS (default 300, jax's): how long a process that has finished waits
  at exit for the others to finish too (process 0 may still be committing the last checkpoint
  to a slow store). Past it, the run is stopped as above, naming the processes not finished.
- JAX_INITIALIZATION_TIMEOUT (default 300, jax's): how long the processes wait for each other
  to start and connect (hosts of a pod may start minutes apart).
"""

import atexit
import dataclasses
import json
import os
import socket
import sys
import threading
import time
from typing import Any, Mapping

from absl import logging

ENV_COORDINATOR = 'JAX_COORDINATOR_ADDRESS'
ENV_NUM_PROCESSES = 'JAX_NUM_PROCESSES'
ENV_PROCESS_ID = 'JAX_PROCESS_ID'

# What jax's SLURM detector (jax._src.clusters.SlurmCluster) reads; srun sets all of them.
SLURM_VARS = ('SLURM_JOB_ID', 'SLURM_STEP_NODELIST', 'SLURM_NTASKS', 'SLURM_PROCID',
              'SLURM_LOCALID')
# What jax's Open MPI detector (jax._src.clusters.OmpiCluster) reads.
OMPI_VARS = ('OMPI_MCA_orte_hnp_uri', 'OMPI_COMM_WORLD_SIZE', 'OMPI_COMM_WORLD_RANK',
             'OMPI_COMM_WORLD_LOCAL_RANK')
TPU_HOST_VARS = ('TPU_PROCESS_ADDRESSES', 'TPU_WORKER_HOSTNAMES')

ENV_PEER_TIMEOUT = 'DISTRIBUTED_PEER_TIMEOUT_SECONDS'
ENV_HEARTBEAT_TIMEOUT = 'JAX_HEARTBEAT_TIMEOUT_SECONDS'
ENV_SHUTDOWN_TIMEOUT = 'JAX_SHUTDOWN_TIMEOUT_SECONDS'
ENV_INITIALIZATION_TIMEOUT = 'JAX_INITIALIZATION_TIMEOUT'
DEFAULT_PEER_TIMEOUT = 20
DEFAULT_HEARTBEAT_TIMEOUT = 100  # jax's default; raised to 3x a longer peer timeout.
DEFAULT_SHUTDOWN_TIMEOUT = 300  # jax's default.
DEFAULT_INITIALIZATION_TIMEOUT = 300  # jax's default.


class LaunchError(ValueError):
  """The processes of a multi-host run could not be started or could not find each other."""


def _int_setting(flag_name: str, flag_value, env_name: str, environ: Mapping[str, str],
                 minimum: int) -> int | None:
  """The flag's value, else the environment variable's, as an int >= minimum (None if unset)."""
  if flag_value is not None:
    value, source = flag_value, f'--{flag_name}'
  elif environ.get(env_name, '').strip():
    value, source = environ[env_name].strip(), env_name
  else:
    return None
  try:
    number = int(value)
  except (TypeError, ValueError):
    raise LaunchError(f'{source}={value!r} is not an integer') from None
  if number < minimum:
    raise LaunchError(f'{source}={number} must be >= {minimum}')
  return number


def _coordinator(flag_value: str | None, environ: Mapping[str, str]) -> str | None:
  """--coordinator_address, else JAX_COORDINATOR_ADDRESS, checked to be host:port."""
  if flag_value:
    value, source = flag_value.strip(), '--coordinator_address'
  elif environ.get(ENV_COORDINATOR, '').strip():
    value, source = environ[ENV_COORDINATOR].strip(), ENV_COORDINATOR
  else:
    return None
  host, _, port = value.rpartition(':')
  if not host or not port.isdigit() or not 0 < int(port) < 65536:
    raise LaunchError(f'{source}={value!r} is not host:port (process 0\'s host, as every '
                      'process reaches it, and a free port there, e.g. 10.0.0.1:1234)')
  return value


def _launcher_ints(environ, count_var: str, index_var: str, required: tuple[str, ...],
                   launcher: str, hint: str) -> tuple[int, int] | None:
  """(process count, index) of a multi-process launcher step, None if it is not one."""
  count = environ.get(count_var, '').strip()
  if not count:
    return None
  try:
    n = int(count)
  except ValueError:
    raise LaunchError(f'{count_var}={count!r} is not an integer') from None
  if n <= 1:
    return None
  missing = [v for v in required if not environ.get(v, '').strip()]
  if missing:
    raise LaunchError(f'{launcher} describes {n} processes ({count_var}={n}) but '
                      f'{", ".join(missing)} {"is" if len(missing) == 1 else "are"} not set: '
                      f'{hint}, give --coordinator_address, --num_processes and --process_id '
                      'explicitly, or --num_processes=1 for a single process')
  try:
    index = int(environ[index_var])
  except ValueError:
    raise LaunchError(f'{index_var}={environ[index_var]!r} is not an integer') from None
  if not 0 <= index < n:
    raise LaunchError(f'{index_var}={index} is outside [0, {count_var}={n})')
  return n, index


def _slurm(environ) -> tuple[int, int] | None:
  if not environ.get('SLURM_JOB_ID', '').strip():
    return None
  return _launcher_ints(environ, 'SLURM_NTASKS', 'SLURM_PROCID', SLURM_VARS, 'SLURM',
                        'start one process per task with srun (not python alone inside an '
                        'sbatch script)')


def _ompi(environ) -> tuple[int, int] | None:
  return _launcher_ints(environ, 'OMPI_COMM_WORLD_SIZE', 'OMPI_COMM_WORLD_RANK', OMPI_VARS,
                        'Open MPI', 'start the processes with Open MPI\'s mpirun (< 5)')


def _tpu_pod(environ, cloud_tpu_vm: bool) -> bool:
  """True when jax's Cloud TPU detector should find the workers (several may be listed)."""
  for var in TPU_HOST_VARS:
    hosts = [h for h in environ.get(var, '').split(',') if h.strip()]
    if hosts:
      return len(hosts) > 1
  return cloud_tpu_vm and 'TPU_SKIP_MDS_QUERY' not in environ


def plan(environ: Mapping[str, str], *, coordinator_address: str | None = None,
         num_processes: int | None = None, process_id: int | None = None,
         cloud_tpu_vm: bool = False) -> dict[str, Any] | None:
  """Keyword arguments for `jax.distributed.initialize`, or None for a single process.

  Args:
    environ: the process environment (os.environ).
    coordinator_address: --coordinator_address (None = not given).
    num_processes: --num_processes (None = not given).
    process_id: --process_id (None = not given).
    cloud_tpu_vm: this is a Cloud TPU VM (jax found TPU chips and libtpu at import).

  Returns:
    The arguments (a subset of coordinator_address, num_processes, process_id and
    cluster_detection_method; jax's detector supplies the rest), or None when the
    environment describes no cluster.

  Raises:
    LaunchError (a ValueError): the cluster is described only in part, or inconsistently.
  """
  coordinator = _coordinator(coordinator_address, environ)
  n = _int_setting('num_processes', num_processes, ENV_NUM_PROCESSES, environ, 1)
  index = _int_setting('process_id', process_id, ENV_PROCESS_ID, environ, 0)
  if n is not None and index is not None and index >= n:
    raise LaunchError(f'process id {index} is outside [0, num_processes={n})')
  if n == 1:  # Said explicitly: one process, whatever the launcher.
    return None
  explicit = {k: v for k, v in (('coordinator_address', coordinator), ('num_processes', n),
                                ('process_id', index)) if v is not None}
  if len(explicit) == 3:  # All given: no detector may change them (a stray SLURM variable).
    return {**explicit, 'cluster_detection_method': 'deactivate'}
  # Open MPI first: mpirun inside a SLURM job also carries the job's SLURM variables.
  for name, detected in (('ompi', _ompi(environ)), ('slurm', _slurm(environ))):
    if detected is None:
      continue
    # The launcher's count and index, unless given explicitly; its detector adds the
    # coordinator (and, on GPUs, this process's device).
    kwargs = {'num_processes': detected[0], 'process_id': detected[1], **explicit,
              'cluster_detection_method': name}
    if kwargs['process_id'] >= kwargs['num_processes']:
      raise LaunchError(f'process id {kwargs["process_id"]} is outside [0, num_processes='
                        f'{kwargs["num_processes"]})')
    return kwargs
  if _tpu_pod(environ, cloud_tpu_vm):
    return explicit  # jax's TPU detector fills in what is not given.
  if not explicit:
    return None
  missing = [f'--{k} (or {env})' for k, env in (('coordinator_address', ENV_COORDINATOR),
                                               ('num_processes', ENV_NUM_PROCESSES),
                                               ('process_id', ENV_PROCESS_ID))
             if k not in explicit]
  given = ', '.join(f'{k}={v}' for k, v in explicit.items())
  raise LaunchError(f'a multi-process run is described in part ({given}) and no cluster '
                    f'launcher (srun, mpirun, Cloud TPU) was detected to supply the rest: '
                    f'give {" and ".join(missing)} too, the same coordinator on every process')


@dataclasses.dataclass(frozen=True)
class Timeouts:
  """Seconds; see the module docstring. peer == 0: no peer watch."""
  peer: int
  heartbeat: int
  shutdown: int
  initialization: int

  def jax_kwargs(self) -> dict[str, int]:
    """The arguments of jax.distributed.initialize that they set."""
    return {'heartbeat_timeout_seconds': self.heartbeat,
            'shutdown_timeout_seconds': self.shutdown,
            'initialization_timeout': self.initialization}


def timeouts(environ: Mapping[str, str]) -> Timeouts:
  """The timeouts the environment sets, with the defaults for those it does not.

  Raises:
    LaunchError (a ValueError): a value that is not a whole number of seconds, or a heartbeat
      timeout that would abort the processes before the peer watch can stop them cleanly.
  """
  peer = _int_setting('', None, ENV_PEER_TIMEOUT, environ, 0)
  peer = DEFAULT_PEER_TIMEOUT if peer is None else peer
  heartbeat = _int_setting('', None, ENV_HEARTBEAT_TIMEOUT, environ, 1)
  if heartbeat is None:
    heartbeat = max(DEFAULT_HEARTBEAT_TIMEOUT, 3 * peer)
  elif peer and heartbeat <= peer:
    raise LaunchError(f'{ENV_HEARTBEAT_TIMEOUT}={heartbeat} must exceed {ENV_PEER_TIMEOUT}='
                      f'{peer}: jax aborts every process once a peer has been silent for its '
                      'heartbeat timeout, so the peer watch, which stops them with a clear '
                      'message, must act first')
  shutdown = _int_setting('', None, ENV_SHUTDOWN_TIMEOUT, environ, 1)
  initialization = _int_setting('', None, ENV_INITIALIZATION_TIMEOUT, environ, 1)
  return Timeouts(
      peer=peer, heartbeat=heartbeat,
      shutdown=DEFAULT_SHUTDOWN_TIMEOUT if shutdown is None else shutdown,
      initialization=(DEFAULT_INITIALIZATION_TIMEOUT if initialization is None
                      else initialization))


def _running_on_cloud_tpu_vm() -> bool:
  try:
    from jax._src import cloud_tpu_init  # Set by `import jax` when it finds TPU chips.
  except ImportError:
    return False
  return bool(getattr(cloud_tpu_init, 'running_in_cloud_tpu_vm', False))


def initialize(environ: Mapping[str, str], *, coordinator_address: str | None = None,
               num_processes: int | None = None, process_id: int | None = None) -> bool:
  """Joins the cluster the flags and environment describe, before any JAX computation.

  Logs this process's index, the process count, the coordinator and the devices.

  Args:
    environ: the process environment (os.environ).
    coordinator_address: --coordinator_address.
    num_processes: --num_processes.
    process_id: --process_id.

  Returns:
    True if jax.distributed was initialized, False for a single-process run.

  Raises:
    LaunchError (a ValueError): a partly described cluster, or the processes did not connect.
  """
  import jax
  kwargs = plan(environ, coordinator_address=coordinator_address, num_processes=num_processes,
                process_id=process_id, cloud_tpu_vm=_running_on_cloud_tpu_vm())
  if kwargs is None:
    return False
  limits = timeouts(environ)
  # CPU processes compute together through gloo (jax's default since 0.5; set for older ones).
  if not jax.config.jax_cpu_collectives_implementation:
    jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  shown = ', '.join(f'{k}={v}' for k, v in kwargs.items()) or 'all detected'
  logging.info('joining a multi-process run (%s)', shown)
  try:
    jax.distributed.initialize(**kwargs, **limits.jax_kwargs())
  except (RuntimeError, KeyError, ValueError) as e:  # jax's detectors and the connection.
    raise LaunchError(f'could not start the multi-process run ({shown}): {type(e).__name__}: '
                      f'{e}. Check that every process was given the same coordinator, a '
                      'distinct process id and the same process count, and that process 0 '
                      'is running and reachable') from e
  from jax._src import distributed as jax_distributed
  logging.info('process %d of %d (coordinator %s): %d local of %d devices',
               jax.process_index(), jax.process_count(),
               getattr(jax_distributed.global_state, 'coordinator_address', None) or '?',
               jax.local_device_count(), jax.device_count())
  client = jax_distributed.global_state.client
  if limits.peer and client is not None:
    _watch['now'] = _PeerWatch(client, jax.process_index(), jax.process_count(), limits)
    _watch['now'].start()
  return True


_watch: dict[str, '_PeerWatch'] = {}  # This process's peer watch, once started.


# What a lost peer leaves in the error of a collective or of the coordination service.
PEER_SIGNS = ('Gloo', 'gloo', 'Connection reset', 'DEADLINE_EXCEEDED', 'UNAVAILABLE')


def caused_by_a_peer(error: BaseException) -> bool:
  """Whether `error`, or an error it was raised from, is a collective or the coordination
  service failing, as it does when another process is gone."""
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    if any(sign in str(error) for sign in PEER_SIGNS):
      return True
    error = error.__cause__ or error.__context__
  return False


def stop_run(message: str, *, peer_suspected: bool = False) -> None:
  """Stops every process of the run, this one last or at once: for an error that this process
  met alone (its data missing, its checkpoint unreadable, a bad value of its own) while the
  others go on towards a collective or an exchange that this one will never join. Records the
  failure for the peer watch, which stops every other process within a watch interval with a
  line naming this one, and exits with status 1 (process 0 once the others have seen it). Does
  nothing in a single-process run or without the watch; the caller has printed its error.

  With `peer_suspected` (the error came from a collective: caused_by_a_peer), another process
  is likely gone: the watch is given its timeout to name it (it then stops the run itself)
  before this process's own error is recorded.
  """
  watch = _watch.get('now')
  if watch is None:
    return
  if peer_suspected:
    watch.wait_for_failure()
  watch.stop_from_here(message)


# The peer watch's keys in the coordination service's key-value store.
_WATCH = 'peer_watch/'
_BEAT = _WATCH + 'beat/'  # + process index: JSON {n, host, pid, exited}.
_FAILED_DIR = _WATCH + 'failed/'
_FAILED = _FAILED_DIR + 'record'  # JSON {message, lost}: set once, by the first to see it.
_ACK = _WATCH + 'ack/'  # + process index: this process has seen the failure and is leaving.


class _PeerWatch:
  """Stops every process of the run, cleanly and at once, when one of them is lost.

  See the module docstring. A daemon thread on each process records a heartbeat every
  `interval` seconds; on process 0 it also reads the others' and records a failure when one
  has not changed for the peer timeout; on the others it looks for a recorded failure. At exit
  (atexit, before jax's own shutdown) a process marks itself finished and waits for the others
  to finish too, the thread still watching, then stops the thread.
  """

  def __init__(self, client, index: int, count: int, limits: Timeouts):
    self._client = client
    self._index, self._count = index, count
    self._timeout, self._shutdown_timeout = limits.peer, limits.shutdown
    self._interval = min(max(limits.peer / 8, 0.25), 5.0)
    self._identity = {'host': socket.gethostname(), 'pid': os.getpid()}
    self._beats = 0
    self._exiting = False
    self._lock = threading.Lock()  # Orders the thread's beats before the exit mark.
    self._stopping = threading.Lock()  # Held by the one thread that ends the process.
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, name='peer-watch', daemon=True)
    # Process 0's view: each process's last heartbeat and when it last changed.
    now = time.monotonic()
    self._last = {i: (None, now) for i in range(count)}

  def start(self):
    self._beat()
    self._thread.start()
    atexit.register(self._at_exit)  # Runs before jax's shutdown (registered at import).
    logging.info('peer watch: a process unheard for %d s stops the run (%s)', self._timeout,
                 ENV_PEER_TIMEOUT)

  # --- the thread ---------------------------------------------------------------------------

  def _run(self):
    failing_since = None
    while not self._stop.is_set():
      try:
        self._beat()
        failure = self._check() if self._index == 0 else self._recorded_failure()
        failing_since = None
      except Exception as e:  # pylint: disable=broad-except  (the service's RPC errors)
        if self._stop.is_set():
          return
        failing_since = failing_since or time.monotonic()
        if time.monotonic() - failing_since >= self._timeout:
          _exit_run(f'process {self._index} of {self._count} has not reached the coordination '
                    f'service (process 0) for {self._timeout} s ({_first_line(e)}): process 0 '
                    'is gone or unreachable, and the run cannot go on without it')
        failure = None
      if failure is not None:
        self._stop_run(failure)
      self._stop.wait(self._interval)

  def _beat(self):
    with self._lock:
      if self._exiting:
        return
      self._beats += 1
      self._client.key_value_set(f'{_BEAT}{self._index}', json.dumps(
          {'n': self._beats, **self._identity, 'exited': False}), allow_overwrite=True)

  def _recorded_failure(self) -> dict | None:
    entries = self._client.key_value_dir_get(_FAILED_DIR)
    return json.loads(entries[0][1]) if entries else None

  def _check(self) -> dict | None:
    """Process 0: the recorded failure, or a new one if a process has gone silent."""
    entries = dict(self._client.key_value_dir_get(_WATCH))
    if _FAILED in entries:
      return json.loads(entries[_FAILED])
    now = time.monotonic()
    lost = []
    for i in range(1, self._count):
      value = entries.get(f'{_BEAT}{i}')
      if value != self._last[i][0]:
        self._last[i] = (value, now)
      beat = json.loads(value) if value else {}
      if not beat.get('exited') and now - self._last[i][1] >= self._timeout:
        lost.append((i, beat))
    if not lost:
      return None
    silent = int(now - max(self._last[i][1] for i, _ in lost))

    def name(i: int, beat: dict) -> str:
      where = f'pid {beat["pid"]} on host {beat["host"]}' if beat else 'never heard from'
      return f'{i} of {self._count} ({where})'

    one = len(lost) == 1
    return self._record(
        f'process{"" if one else "es"} {", ".join(name(i, b) for i, b in lost)} '
        f'{"has" if one else "have"} not been heard from for {silent} s ({ENV_PEER_TIMEOUT}='
        f'{self._timeout}): {"it" if one else "they"} died (killed, crashed, host lost) or '
        f'{"is" if one else "are"} stuck. The run cannot go on without '
        f'{"it" if one else "them"}: every process stops; restart the run to resume from its '
        'last checkpoint', [i for i, _ in lost])

  def _record(self, message: str, lost: list[int]) -> dict:
    """Records a failure, unless one is recorded already; returns the one recorded."""
    try:
      self._client.key_value_set(_FAILED, json.dumps({'message': message, 'lost': lost}))
    except Exception:  # pylint: disable=broad-except  (ALREADY_EXISTS: another process was first)
      return self._recorded_failure() or {'message': message, 'lost': lost}
    return {'message': message, 'lost': lost}

  def wait_for_failure(self):
    """Waits while the watch may still find a lost process (its timeout and two rounds): when
    it does, its thread stops the run and this never returns."""
    self._stop.wait(self._timeout + 2 * self._interval)

  def stop_from_here(self, message: str):
    """stop_run: this process failed on its own; every process stops."""
    failure = self._record(f'process {self._index} of {self._count} (pid {os.getpid()} on host '
                           f'{socket.gethostname()}) stopped: {message}', [self._index])
    self._stop_run(failure, report=False)

  def _stop_run(self, failure: dict, report: bool = True):
    """Exits this process (status 1) with the failure's message (unless not `report`: the
    process that failed has said why); process 0 last."""
    if not self._stopping.acquire(blocking=False):
      threading.Event().wait()  # The other thread (watch or exit) is ending the process.
    if report:
      _report(failure['message'])
    if self._index != 0:
      try:
        self._client.key_value_set(f'{_ACK}{self._index}', '1', allow_overwrite=True)
      finally:
        _exit_run(None)
    waiting = set(range(1, self._count)) - set(failure.get('lost', ()))
    deadline = time.monotonic() + self._timeout
    while waiting and time.monotonic() < deadline:
      try:
        waiting -= {int(k[len(_ACK):]) for k, _ in self._client.key_value_dir_get(_ACK)}
      except Exception:  # pylint: disable=broad-except
        break
      time.sleep(0.05)
    time.sleep(0.5)  # Let the processes that answered leave before the service goes.
    _exit_run(None)

  # --- exit ---------------------------------------------------------------------------------

  def _at_exit(self):
    """Marks this process finished and waits for the others; see the class docstring."""
    try:
      with self._lock:
        self._exiting = True
        self._client.key_value_set(f'{_BEAT}{self._index}', json.dumps(
            {'n': self._beats, **self._identity, 'exited': True}), allow_overwrite=True)
      deadline = time.monotonic() + self._shutdown_timeout
      while True:
        beats = {k: json.loads(v) for k, v in self._client.key_value_dir_get(_BEAT)}
        running = [i for i in range(self._count)
                   if not beats.get(f'{_BEAT}{i}', {}).get('exited')]
        if not running:
          break
        if time.monotonic() > deadline:
          self._stop_run(self._record(
              f'process {self._index} of {self._count} finished but process'
              f'{"es" if len(running) > 1 else ""} {", ".join(map(str, running))} did not '
              f'within {self._shutdown_timeout} s ({ENV_SHUTDOWN_TIMEOUT}): stuck, or still '
              'working; stopping the run', []))
        time.sleep(min(self._interval, 0.2))
    except Exception as e:  # pylint: disable=broad-except  (the client is gone: jax decides)
      logging.warning('peer watch: could not wait for the other processes at exit: %s',
                      _first_line(e))
    finally:
      self._stop.set()
      self._thread.join(timeout=30)


def _first_line(error: Exception) -> str:
  return f'{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error) else ""}'


def _report(message: str):
  logging.error('%s', message)
  print(f'error: {message}', file=sys.stderr, flush=True)


def _exit_run(message: str | None):
  """Ends the process now, with status 1: a normal exit would wait for the lost process."""
  if message is not None:
    _report(message)
  logging.flush()
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(1)  # pylint: disable=protected-access
