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
"""

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
  # CPU processes compute together through gloo (jax's default since 0.5; set for older ones).
  if not jax.config.jax_cpu_collectives_implementation:
    jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  shown = ', '.join(f'{k}={v}' for k, v in kwargs.items()) or 'all detected'
  logging.info('joining a multi-process run (%s)', shown)
  try:
    jax.distributed.initialize(**kwargs)
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
  return True
