"""Multi-process runs that cannot go on end on every process within seconds, with one clear
`error:` line and exit status 1: a second launch on a live workdir (the lock's verdict reaches
every process), and a host lost mid-run (the others stop instead of waiting out jax's
heartbeat timeout and aborting with a C++ stack trace)."""

import os
import pathlib
import socket
import subprocess
import time

from training import workdir_lock


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def _launch(harness, workdir, log_dir, extra: dict, tag: str, env: dict | None = None,
            n: int = 2, devices: int = 1):
  """Starts main.py as `n` processes on a loopback coordinator, described by the environment
  variables a launcher script would set; returns (processes, log paths)."""
  port = _free_port()
  procs, logs = [], []
  for i in range(n):
    process_env = {**harness.env(devices), **(env or {}),
                   'JAX_COORDINATOR_ADDRESS': f'127.0.0.1:{port}',
                   'JAX_NUM_PROCESSES': str(n), 'JAX_PROCESS_ID': str(i)}
    logs.append(pathlib.Path(log_dir) / f'{tag}_{i}.log')
    with open(logs[-1], 'w') as log:
      procs.append(subprocess.Popen(harness.main_command(workdir, extra), env=process_env,
                                    cwd=harness.repo, stdout=log, stderr=subprocess.STDOUT))
  return procs, logs


def _wait_exits(procs, start: float, timeout: float) -> list[float | None]:
  """Seconds from `start` to each process's exit (None: still running at the deadline)."""
  ends = [None] * len(procs)
  deadline = start + timeout
  while time.monotonic() < deadline and None in ends:
    for i, p in enumerate(procs):
      if ends[i] is None and p.poll() is not None:
        ends[i] = time.monotonic() - start
    time.sleep(0.05)
  return ends


def _kill_all(procs):
  for p in procs:
    if p.poll() is None:
      p.kill()
      p.wait()


def _errors(text: str) -> list[str]:
  return [line for line in text.splitlines() if line.startswith('error: ')]


def test_a_second_two_process_run_on_a_live_workdir_is_refused_on_every_process(harness,
                                                                                tmp_path):
  # Before: process 0 printed the lock's refusal but waited for process 1 at exit, and process
  # 1, knowing nothing of it, went on to its first collective and died there 37 s later with a
  # Gloo DEADLINE_EXCEEDED traceback.
  workdir = tmp_path / 'run'
  workdir.mkdir()
  with workdir_lock.hold(str(workdir)):  # A live run holds it.
    start = time.monotonic()
    procs, logs = _launch(harness, workdir, tmp_path, {'total_steps': 2}, 'second')
    try:
      ends = _wait_exits(procs, start, timeout=240)  # Both start in 8-30 s on 2 loaded cores.
    finally:
      _kill_all(procs)
  texts = [log.read_text() for log in logs]
  report = '\n'.join(f'--- process {i} (rc {p.returncode}, exit after {e} s):\n{t[-3000:]}'
                     for i, (p, e, t) in enumerate(zip(procs, ends, texts)))
  # Both stop as soon as process 0 has tried the lock (8 s after launch on 2 idle cores, of
  # which 7 s are imports and joining the run), waiting out no collective timeout.
  assert None not in ends and max(ends) < 60, report
  assert [p.returncode for p in procs] == [1, 1], report
  errors = [_errors(t) for t in texts]
  assert len(errors[0]) == 1 and errors[0] == errors[1], report  # The same verdict.
  assert 'is in use by another run' in errors[0][0], report
  assert f'"pid": {os.getpid()}' in errors[0][0], report  # It names the run that holds it.
  assert not any('Traceback' in t or 'DEADLINE_EXCEEDED' in t for t in texts), report
  assert not (workdir / 'checkpoints').exists() and not (workdir / 'config.json').exists()
