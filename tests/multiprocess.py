"""main.py as several JAX processes on one machine: a loopback coordinator, each process with
its own fake CPU devices (tests/harness.py's Harness gives the environment and the command).

Shared by the multi-process tests (tests/training/test_multihost*.py, the multi-process
contract in tests/contracts/test_multiprocess_contract.py).
"""

from __future__ import annotations

import contextlib
import pathlib
import socket
import subprocess
import time

import pytest

SPY_MAIN = pathlib.Path(__file__).resolve().parent / 'training' / 'spy_main.py'


def free_port() -> int:
  """A TCP port free on the loopback interface now (for a coordinator)."""
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


@contextlib.contextmanager
def processes(harness, workdir, log_dir, extra: dict, tag: str, *, slurm: bool = False,
              n: int = 2, devices: int = 2, spy: bool = False, mode: str = 'train',
              config_file=None, flags: tuple[str, ...] = (), env: dict | None = None):
  """Starts main.py as `n` processes of `devices` CPU devices each; kills any left on exit.

  Yields (processes, log paths LOG_DIR/TAG_i.log).

  They are told about each other by flags, or with `slurm` as the tasks of a SLURM job step
  on this host (the variables srun sets, and no flag). With `spy`, main.py runs under
  tests/training/spy_main.py, which writes process i's waiting calls to LOG_DIR/TAG_i.spy.
  `mode`, `config_file` (default configs/tiny.py) and `flags` (more command-line flags) go to
  Harness.main_command; `env` is added to every process's environment.
  """
  port = free_port()
  procs, logs = [], []
  try:
    for i in range(n):
      command = harness.main_command(workdir, extra, mode=mode, config_file=config_file)
      command += list(flags)
      process_env = {**harness.env(devices), **(env or {})}
      if spy:
        command[1] = str(SPY_MAIN)
        process_env['SPY_OUT'] = str(pathlib.Path(log_dir) / f'{tag}_{i}.spy')
      if slurm:
        process_env.update({'SLURM_JOB_ID': '4242', 'SLURM_STEP_NODELIST': '127.0.0.1',
                            'SLURM_NTASKS': str(n), 'SLURM_PROCID': str(i),
                            'SLURM_LOCALID': str(i), 'JAX_COORDINATOR_PORT': str(port)})
      else:
        command += [f'--coordinator_address=127.0.0.1:{port}', f'--num_processes={n}',
                    f'--process_id={i}']
      logs.append(pathlib.Path(log_dir) / f'{tag}_{i}.log')
      with open(logs[-1], 'w') as log:
        procs.append(subprocess.Popen(command, env=process_env, cwd=harness.repo, stdout=log,
                                      stderr=subprocess.STDOUT))
    yield procs, logs
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()


def wait_all(procs, logs, timeout: float = 300) -> list[str]:
  """Waits for every process; returns their logs, failing with them on a non-zero exit (or
  one still running at the deadline)."""
  deadline = time.monotonic() + timeout
  for p in procs:
    try:
      p.wait(timeout=max(deadline - time.monotonic(), 1))
    except subprocess.TimeoutExpired:
      break
  texts = [pathlib.Path(log).read_text() for log in logs]
  if any(p.returncode != 0 for p in procs):
    pytest.fail('\n'.join(f'--- process {i} (rc {p.returncode}):\n{t[-3000:]}'
                          for i, (p, t) in enumerate(zip(procs, texts))))
  return texts


def run(harness, workdir, log_dir, extra: dict, tag: str, timeout: float = 300,
        **kwargs) -> list[str]:
  """`processes(...)` run to the end; returns every process's log (fails on any error)."""
  with processes(harness, workdir, log_dir, extra, tag, **kwargs) as (procs, logs):
    return wait_all(procs, logs, timeout)
