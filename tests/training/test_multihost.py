"""Multi-host launch (issue 20): when a run joins a cluster, a clear error when the cluster is
described only in part, and a real 2-process x 2-device run on loopback that is preempted,
resumed and evaluated, ending with the parameters of a 1-process x 4-device run."""

import json
import os
import re
import signal
import subprocess
import time

import pytest

from tests import multiprocess
from training import distributed

SLURM_STEP = {'SLURM_JOB_ID': '4242', 'SLURM_STEP_NODELIST': 'node[003-004]',
              'SLURM_NTASKS': '4', 'SLURM_PROCID': '2', 'SLURM_LOCALID': '0'}
OMPI = {'OMPI_MCA_orte_hnp_uri': '1531576320.0;tcp://10.96.0.1:34911',
        'OMPI_COMM_WORLD_SIZE': '2', 'OMPI_COMM_WORLD_RANK': '1',
        'OMPI_COMM_WORLD_LOCAL_RANK': '1'}


# --- plan(): the decision, from flags and environment alone ---------------------------------

@pytest.mark.parametrize('environ,flags', [
    ({}, {}),
    ({'SLURM_JOB_ID': '7', 'SLURM_NTASKS': '1', 'SLURM_PROCID': '0'}, {}),  # One task.
    ({'SLURM_JOB_ID': '7'}, {}),                                             # salloc shell.
    ({'TPU_WORKER_HOSTNAMES': 'localhost'}, {}),                             # One TPU host.
    ({'OMPI_COMM_WORLD_SIZE': '1'}, {}),
    ({**SLURM_STEP}, {'num_processes': 1}),  # One process, said explicitly.
    ({'JAX_NUM_PROCESSES': '1'}, {}),
])
def test_single_process_environments_start_no_cluster(environ, flags):
  assert distributed.plan(environ, **flags) is None


@pytest.mark.parametrize('environ', [
    {'KUBERNETES_SERVICE_HOST': '10.0.0.1'},
    {'SLURM_JOB_ID': '7', 'SLURM_NTASKS': '4'},  # An salloc shell: not a task of a step.
    SLURM_STEP,
])
def test_explicit_flags_are_used_as_given_and_no_detector_overrides_them(environ):
  kwargs = distributed.plan(environ, coordinator_address='10.0.0.1:1234', num_processes=2,
                            process_id=1)
  assert kwargs == {'coordinator_address': '10.0.0.1:1234', 'num_processes': 2,
                    'process_id': 1, 'cluster_detection_method': 'deactivate'}


def test_environment_variables_stand_in_for_the_flags_and_flags_win():
  environ = {'JAX_COORDINATOR_ADDRESS': 'host0:9999', 'JAX_NUM_PROCESSES': '4',
             'JAX_PROCESS_ID': '3'}
  assert distributed.plan(environ) == {'coordinator_address': 'host0:9999', 'num_processes': 4,
                                       'process_id': 3, 'cluster_detection_method': 'deactivate'}
  assert distributed.plan(environ, process_id=0)['process_id'] == 0


def test_a_slurm_step_of_several_tasks_joins_through_the_slurm_detector():
  # Without any flag: N independent "process 0 of 1" runs into one workdir before.
  assert distributed.plan(SLURM_STEP) == {'num_processes': 4, 'process_id': 2,
                                          'cluster_detection_method': 'slurm'}
  # An explicit coordinator replaces the one jax derives from the node list and job id.
  assert distributed.plan(SLURM_STEP, coordinator_address='head:1234')[
      'coordinator_address'] == 'head:1234'


def test_mpirun_joins_through_the_open_mpi_detector_even_inside_a_slurm_job():
  assert distributed.plan({**SLURM_STEP, **OMPI}) == {
      'num_processes': 2, 'process_id': 1, 'cluster_detection_method': 'ompi'}


@pytest.mark.parametrize('environ,cloud_tpu_vm', [
    ({'TPU_WORKER_HOSTNAMES': 'w-0,w-1,w-2,w-3'}, False),
    ({'TPU_PROCESS_ADDRESSES': 'w-0:8476,w-1:8476'}, True),
    ({}, True),  # A Cloud TPU VM: the worker list is in its metadata.
])
def test_a_tpu_pod_lets_jax_detect_the_workers(environ, cloud_tpu_vm):
  assert distributed.plan(environ, cloud_tpu_vm=cloud_tpu_vm) == {}
  assert distributed.plan(environ, cloud_tpu_vm=cloud_tpu_vm,
                          coordinator_address='w-0:1234') == {'coordinator_address': 'w-0:1234'}


def test_a_tpu_vm_that_may_not_query_its_metadata_is_a_single_host():
  assert distributed.plan({'TPU_SKIP_MDS_QUERY': '1'}, cloud_tpu_vm=True) is None


@pytest.mark.parametrize('environ,flags,message', [
    ({}, {'num_processes': 2}, '--coordinator_address (or JAX_COORDINATOR_ADDRESS) and '
                               '--process_id (or JAX_PROCESS_ID)'),
    ({}, {'coordinator_address': 'h:1', 'num_processes': 2}, 'give --process_id'),
    ({'JAX_COORDINATOR_ADDRESS': 'h:1'}, {}, 'give --num_processes (or JAX_NUM_PROCESSES) and '
                                             '--process_id'),
    ({}, {'process_id': 1}, 'no cluster launcher'),
    ({}, {'num_processes': 2, 'process_id': 2}, 'process id 2 is outside [0, num_processes=2)'),
    ({'JAX_NUM_PROCESSES': '2', 'JAX_PROCESS_ID': 'one'}, {}, "JAX_PROCESS_ID='one' is not an"),
    ({}, {'num_processes': 0}, '--num_processes=0 must be >= 1'),
    ({}, {'process_id': 1, 'num_processes': 1}, 'outside [0, num_processes=1)'),
    ({}, {'coordinator_address': '10.0.0.1', 'num_processes': 2, 'process_id': 0},
     "'10.0.0.1' is not host:port"),
    ({'SLURM_JOB_ID': '7', 'SLURM_NTASKS': '4', 'SLURM_PROCID': '0', 'SLURM_LOCALID': '0'}, {},
     'SLURM_STEP_NODELIST is not set: start one process per task with srun'),
    ({**SLURM_STEP, 'SLURM_PROCID': '4'}, {}, 'SLURM_PROCID=4 is outside [0, SLURM_NTASKS=4)'),
    (SLURM_STEP, {'num_processes': 2}, 'process id 2 is outside [0, num_processes=2)'),
    ({'OMPI_COMM_WORLD_SIZE': '2', 'OMPI_COMM_WORLD_RANK': '0'}, {},
     'OMPI_MCA_orte_hnp_uri, OMPI_COMM_WORLD_LOCAL_RANK are not set'),
])
def test_a_cluster_described_in_part_is_an_error_naming_what_is_missing(environ, flags,
                                                                         message):
  with pytest.raises(ValueError) as e:
    distributed.plan(environ, **flags)
  assert message in str(e.value)


# --- timeouts(): jax's timeouts and the peer watch's, from the environment --------------------

def test_the_default_timeouts_stop_a_run_with_a_lost_process_well_before_jax_aborts_it():
  limits = distributed.timeouts({})
  assert limits == distributed.Timeouts(peer=20, heartbeat=100, shutdown=300,
                                        initialization=300)
  assert limits.jax_kwargs() == {'heartbeat_timeout_seconds': 100,
                                 'shutdown_timeout_seconds': 300, 'initialization_timeout': 300}
  # A longer peer timeout keeps jax's abort three times further.
  assert distributed.timeouts({'DISTRIBUTED_PEER_TIMEOUT_SECONDS': '60'}).heartbeat == 180
  off = distributed.timeouts({'DISTRIBUTED_PEER_TIMEOUT_SECONDS': '0',
                              'JAX_HEARTBEAT_TIMEOUT_SECONDS': '10',
                              'JAX_SHUTDOWN_TIMEOUT_SECONDS': '30',
                              'JAX_INITIALIZATION_TIMEOUT': '600'})
  assert off == distributed.Timeouts(peer=0, heartbeat=10, shutdown=30, initialization=600)


@pytest.mark.parametrize('environ,message', [
    ({'JAX_HEARTBEAT_TIMEOUT_SECONDS': '20'},
     'JAX_HEARTBEAT_TIMEOUT_SECONDS=20 must exceed DISTRIBUTED_PEER_TIMEOUT_SECONDS=20'),
    ({'JAX_SHUTDOWN_TIMEOUT_SECONDS': '5m'}, "JAX_SHUTDOWN_TIMEOUT_SECONDS='5m' is not an"),
    ({'DISTRIBUTED_PEER_TIMEOUT_SECONDS': '-1'}, 'DISTRIBUTED_PEER_TIMEOUT_SECONDS=-1 must be'),
    ({'JAX_INITIALIZATION_TIMEOUT': '0'}, 'JAX_INITIALIZATION_TIMEOUT=0 must be >= 1'),
])
def test_a_bad_timeout_is_an_error_naming_the_variable(environ, message):
  with pytest.raises(ValueError) as e:
    distributed.timeouts(environ)
  assert message in str(e.value)


class _KeyValueStore:
  """The coordination service's key-value store, as the peer watch uses it."""

  def __init__(self):
    self.data = {}

  def key_value_set(self, key, value, allow_overwrite=False):
    if key in self.data and not allow_overwrite:
      raise RuntimeError(f'ALREADY_EXISTS: key {key} already exists.')
    self.data[key] = value

  def key_value_dir_get(self, prefix):
    return sorted((k, v) for k, v in self.data.items() if k.startswith(prefix))


def test_process_0_names_the_silent_processes_and_not_those_that_finished():
  # pylint: disable=protected-access
  store = _KeyValueStore()
  limits = distributed.Timeouts(peer=20, heartbeat=100, shutdown=300, initialization=300)
  watches = [distributed._PeerWatch(store, i, 4, limits) for i in range(4)]
  for w in watches:
    w._beat()
  watch = watches[0]
  assert watch._check() is None
  # Process 1 finished: its heartbeats stop, after a last one that says so.
  store.key_value_set('peer_watch/beat/1', json.dumps({'n': 9, 'exited': True}),
                      allow_overwrite=True)
  # 25 s later on process 0's clock; process 3 has beaten since, process 2 has not.
  watch._last = {i: (value, t - 25) for i, (value, t) in watch._last.items()}
  watches[3]._beat()
  failure = watch._check()
  assert failure['lost'] == [2], failure
  assert failure['message'].startswith(f'process 2 of 4 (pid {os.getpid()} on host '), failure
  assert 'has not been heard from for 25 s (DISTRIBUTED_PEER_TIMEOUT_SECONDS=20)' in (
      failure['message'])
  # Recorded once, for every process to read; a later failure does not replace it.
  assert watches[2]._recorded_failure() == failure
  assert watch._record('another', [3]) == failure


def test_a_half_described_launch_is_one_error_line_before_any_work(harness, tmp_path):
  workdir = tmp_path / 'run'
  proc = subprocess.run(harness.main_command(workdir, {'total_steps': 2}) + ['--num_processes=2'],
                        env={**harness.env(1), 'JAX_PROCESS_ID': '5'}, cwd=harness.repo,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 1, proc.stderr[-2000:]
  errors = [line for line in proc.stderr.splitlines() if line.startswith('error: ')]
  assert errors == ['error: process id 5 is outside [0, num_processes=2)'], proc.stderr[-2000:]
  assert 'Traceback' not in proc.stderr and not workdir.exists()


# --- a real multi-process run on loopback ----------------------------------------------------

_processes = multiprocess.processes
_wait_all = multiprocess.wait_all


def _preempted_run(harness, workdir, log_dir, extra: dict, slurm: bool = False,
                   devices: int = 2) -> int:
  """Trains with 2 processes x `devices` devices and sends SIGTERM to process 1 alone once the
  first regular checkpoint is on disk; checks that both stop at one step and save it; returns
  it."""
  first = extra['checkpoint_every_steps']
  with _processes(harness, workdir, log_dir, extra, 'preempted', slurm=slurm,
                  devices=devices) as (procs, logs):
    deadline = time.monotonic() + 300
    while first not in harness.step_dirs(workdir):  # Mid-run.
      if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
        _wait_all(procs, logs, timeout=1)
        pytest.fail(f'no checkpoint at step {first}: {[log.read_text()[-3000:] for log in logs]}')
      time.sleep(0.02)
    procs[1].send_signal(signal.SIGTERM)  # Only one host gets the notice.
    texts = _wait_all(procs, logs)
  assert 'process 1 of 2 (coordinator 127.0.0.1:' in texts[1], texts[1][-3000:]
  stopped = [int(m.group(1)) for text in texts
             for m in re.finditer(r'preemption requested\D*(\d+)', text)]
  # Both processes stop after the same step, before the end, and that step is saved whole.
  assert len(stopped) == 2 and stopped[0] == stopped[1], stopped
  assert first <= stopped[0] < extra['total_steps'], stopped
  assert harness.step_dirs(workdir)[-1] == stopped[0] and not harness.tmp_dirs(workdir)
  return stopped[0]


def test_two_processes_with_heads_split_wait_for_the_device_only_at_log_steps(harness,
                                                                             tmp_path):
  """Learned adaptive span (its trim is read from a head-sharded parameter) on 2 processes of
  1 device, heads split across them: the run trains (the trim's host copy is gathered from
  both processes; a bare device_get failed with 'spans non-addressable devices'), and neither
  process waits for the device between log steps (issue 47: the trim was read, and a SIGTERM
  agreed on by an all-gather, after every step)."""
  extra = {'total_steps': 12, 'log_every_steps': 6, 'checkpoint_every_steps': 12,
           'model.attention': 'adaptive_span', 'model.position_embedding': 'none',
           'mesh.data': 1, 'mesh.fsdp': 1, 'mesh.tensor': 2}
  with _processes(harness, tmp_path / 'run', tmp_path, extra, 'spy', devices=1,
                  spy=True) as (procs, logs):
    texts = _wait_all(procs, logs)
  assert all('process 1 of 2' in t or 'process 0 of 2' in t for t in texts)
  for i in range(2):
    calls = json.loads((tmp_path / f'spy_{i}.spy').read_text())
    waits = {s: c for s, c in calls.items() if int(s) % 6}
    assert not waits, f'process {i} waited for the device between log steps: {waits}'
    assert calls.get('6'), f'process {i}: the spy saw nothing at the log step'


def test_srun_tasks_form_one_run_and_one_sigterm_stops_both_at_one_saved_step(harness,
                                                                              tmp_path):
  # Two tasks of a SLURM step with no coordinator given: one run of 2 processes (before, two
  # independent "process 0 of 1" runs saving into one workdir). One device a process: what
  # is tested is the joining and the stop, and a 2 x 1 program compiles faster than 2 x 2.
  extra = {'total_steps': 40, 'checkpoint_every_steps': 2}
  workdir = tmp_path / 'run'
  stopped = _preempted_run(harness, workdir, tmp_path, extra, slurm=True, devices=1)
  state = harness.restore(workdir, extra)  # The multi-process save restores whole.
  assert int(state.step) == stopped


@pytest.mark.slow  # 75-150 s on 2 shared cores (80 s CPU): 6 process starts, 3 compiles.
def test_two_processes_preempted_resumed_and_evaluated_match_one_process(harness, tmp_path):
  total = 16
  extra = {'total_steps': total, 'checkpoint_every_steps': 4, 'eval_every_steps': total}
  reference = tmp_path / 'one'  # 1 process x 4 devices, uninterrupted, alongside.
  single = harness.start_main(reference, tmp_path / 'one.log', extra, devices=4)
  workdir = tmp_path / 'two'
  try:
    stopped = _preempted_run(harness, workdir, tmp_path, extra)
    assert json.loads((workdir / 'config.json').read_text())['total_steps'] == total

    with _processes(harness, workdir, tmp_path, extra, 'resumed') as (procs, logs):
      texts = _wait_all(procs, logs)
    for text in texts:
      assert f'resumed from checkpoint step {stopped}' in text
    assert harness.step_dirs(workdir)[-1] == total
    # The evaluation at the last step ran over both processes' rows.
    two_process_loss = float(re.search(rf'eval step {total} .* loss (\S+)', texts[0]).group(1))

    evaluated = harness.run_main(workdir, extra, mode='eval', devices=1)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    result = json.loads((workdir / f'eval_step_{total}.json').read_text())
    assert result['step'] == total and abs(result['loss'] - two_process_loss) < 1e-4
    assert single.wait(timeout=300) == 0, (tmp_path / 'one.log').read_text()[-3000:]
  finally:
    if single.poll() is None:
      single.kill()
      single.wait()
  two, one = harness.restore(workdir, extra), harness.restore(reference, extra)
  assert int(two.step) == int(one.step) == total
  assert harness.max_abs_diff(two.params, one.params) < 1e-6  # 1.3e-7 measured.
  assert harness.max_abs_diff(two.opt_state, one.opt_state) < 1e-6
