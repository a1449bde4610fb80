"""Preemption notices: SIGTERM repeated while the preemption checkpoint is saved, and after.

main.py runs in a subprocess on the tiny recipe (conftest.FAST). In CI one run gets every
notice (a second during the save, then one every 50 ms until the process exits); the run
that gets only the 50 ms notices from the first one on is slow (`-m slow`).
"""

import logging
import os
import pathlib
import signal
import time

import pytest

from training import train

# Checkpoints only on SIGTERM (or at the far end); every step is logged to see the loop run.
RUN = {'total_steps': 300, 'checkpoint_every_steps': 3000, 'log_every_steps': 1}
# The logged step after which the first SIGTERM is sent.
TERM_AFTER = 3

def _preempt(harness, tmp_path, notices):
  """Runs main.py to step TERM_AFTER, then `notices(proc, log)` (the SIGTERMs); returns the
  exit status and the log once the process has exited."""
  workdir, log = tmp_path / 'run', tmp_path / 'term.log'
  proc = harness.start_main(workdir, log, RUN)
  try:
    harness.wait_for(lambda: f'step {TERM_AFTER}/{RUN["total_steps"]}' in log.read_text(), proc,
                     log, timeout=300, what=f'step {TERM_AFTER}')
    notices(proc, log)
    rc = proc.wait(timeout=120)
  finally:
    proc.kill()
    proc.wait()
  return rc, pathlib.Path(log).read_text()


def test_second_sigterm_keeps_the_checkpoint_and_exits_zero(harness, tmp_path, caplog):
  def notices(proc, log):
    proc.send_signal(signal.SIGTERM)
    # A second notice while the run stops and saves, once the first is handled: two sent
    # while the main thread is inside one long C call (a step, under load) are one call of
    # the handler, and the second was not seen (CI on a loaded machine).
    harness.wait_for(lambda: 'SIGTERM: stopping' in log.read_text(), proc, log, timeout=120,
                     what='the first notice')
    proc.send_signal(signal.SIGTERM)
    # A third comes as soon as the run says it saved (the issue: the log said
    # "saved step N" while the save was still being written, and the second SIGTERM killed
    # it).
    harness.wait_for(lambda: 'preemption requested' in log.read_text(), proc, log, timeout=120,
                     what='the preemption save')
    # Then one every 50 ms until it has exited (issue 35: the save was committed, yet the
    # process died of a later SIGTERM while the interpreter exited).
    _every_50ms_until_exit(proc)

  workdir = tmp_path / 'run'
  rc, text = _preempt(harness, tmp_path, notices)
  assert rc == 0, f'rc {rc}:\n{text[-5000:]}'
  saved = harness.step_dirs(workdir)
  assert len(saved) == 1 and TERM_AFTER <= saved[0] < RUN['total_steps'], (saved, text[-3000:])
  stopped = saved[0]
  assert harness.tmp_dirs(workdir) == []
  assert f'preemption requested: saved step {stopped}, exiting' in text
  assert 'SIGTERM again' in text
  assert 'further SIGTERMs are ignored until the process exits' in text

  # The run resumes from it (in this process: a third main.py would double the time).
  with caplog.at_level(logging.INFO):
    state = train.train_and_evaluate(harness.config({**RUN, 'total_steps': stopped + 2}),
                                     str(workdir))
  assert f'resumed from checkpoint step {stopped}' in caplog.text
  assert int(state.step) == stopped + 2
  assert harness.step_dirs(workdir) == [stopped, stopped + 2]


def _every_50ms_until_exit(proc):
  deadline = time.monotonic() + 120
  while proc.poll() is None and time.monotonic() < deadline:
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.05)


# Slow: the test above ends with the same notices every 50 ms until the process exits, once
# the preemption save is committed (the window of the issue), and checks the clean exit.
@pytest.mark.slow
def test_sigterms_every_50ms_until_exit_end_in_a_clean_exit(harness, tmp_path):
  # Issue 35: the preemption save was committed, yet the process died of a later SIGTERM
  # (rc -15, 7 tries in 7): the interpreter restores the default action while it exits.
  def notices(proc, log):
    del log
    _every_50ms_until_exit(proc)

  rc, text = _preempt(harness, tmp_path, notices)
  assert rc == 0, f'rc {rc}:\n{text[-3000:]}'
  [saved] = harness.step_dirs(tmp_path / 'run')
  assert f'preemption requested: saved step {saved}, exiting' in text
  assert 'further SIGTERMs are ignored until the process exits' in text


def test_an_in_process_run_gives_the_caller_its_sigterm_handler_back():
  # A test or notebook that trains in its own process keeps its handler (a test runner's
  # timeout still stops it); only main.py, which exits next, ignores later notices.
  def mine(*_):
    pass

  previous = signal.signal(signal.SIGTERM, mine)
  try:
    for exits, after in ((False, mine), (True, signal.SIG_IGN)):
      with train._Preemption(exits) as preemption:  # pylint: disable=protected-access
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 10
        while not preemption.requested(1) and time.monotonic() < deadline:
          time.sleep(0.01)
        assert preemption.requested(1)
      assert signal.getsignal(signal.SIGTERM) is after
      signal.signal(signal.SIGTERM, mine)
  finally:
    signal.signal(signal.SIGTERM, previous)
