"""The system tests' harness: small configs, main.py subprocesses, checkpoints (the fixtures
`harness` and `straight_and_resumed` in tests/conftest.py give it to every folder).

Everything here is sized for a 2-core CPU: the tiny recipe with a small batch and short
sequences, no matmul peak measurement and no periodic evaluation unless a test asks.
"""

import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import jax
import ml_collections
import numpy as np
import pytest

from configs import tiny
from training import assembly, checkpoints, xla_flags

REPO = pathlib.Path(__file__).resolve().parents[1]

# Overrides (dotted config keys) applied on top of configs/tiny.py by every helper below.
FAST = {
    'peak_tflops_per_device': 1.0,  # Skip the matmul peak measurement.
    'batch_size': 16,
    'data.num_assignments': 8,      # seq_len 18 instead of 34.
    'eval_steps': 1,
    'eval_every_steps': 0,
    'log_every_steps': 5,
}

_STEP_DIR = re.compile(r'^\d+$')


class Harness:
  """Builds configs and runs main.py or scripts in subprocesses with a fixed device count.

  Args:
    cache_dir: JAX persistent compilation cache shared by the subprocesses of this session
      (most runs compile the same train step; loading it halves a run's time on 2 cores).
  """

  repo = REPO

  def __init__(self, cache_dir):
    self.cache_dir = str(cache_dir)

  def overrides(self, extra: dict | None = None) -> dict:
    """FAST with `extra` on top."""
    return {**FAST, **(extra or {})}

  def config(self, extra: dict | None = None) -> ml_collections.ConfigDict:
    """configs/tiny.py with FAST and `extra` applied (the same run as `flags(extra)`)."""
    config = tiny.get_config()
    config.update_from_flattened_dict(self.overrides(extra))
    return config

  def flags(self, extra: dict | None = None) -> list[str]:
    """The command-line form of `config(extra)`."""
    return [f'--config.{k}={v}' for k, v in self.overrides(extra).items()]

  def env(self, devices: int = 1) -> dict[str, str]:
    """Environment for a CPU-only subprocess with `devices` fake host devices."""
    env = dict(os.environ)
    env['JAX_PLATFORMS'] = 'cpu'
    env.pop('PJRT_NPROC', None)
    env.update(xla_flags.fake_cpu_env(devices))  # Collectives that cannot starve each other.
    if xla_flags.FAST_COMPILE in os.environ.get('XLA_FLAGS', ''):  # tests/conftest.py
      env['XLA_FLAGS'] += ' ' + xla_flags.FAST_COMPILE
    env['PYTHONPATH'] = os.pathsep.join([str(REPO)] + (
        [env['PYTHONPATH']] if env.get('PYTHONPATH') else []))
    env['TF_CPP_MIN_LOG_LEVEL'] = '2'
    env['JAX_COMPILATION_CACHE_DIR'] = self.cache_dir
    env['JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS'] = '0'
    env['JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES'] = '0'
    return env

  def main_command(self, workdir, extra: dict | None = None, mode: str = 'train',
                   config_file=None) -> list[str]:
    """main.py with `config_file` (default configs/tiny.py) and FAST + `extra` as flags."""
    config_file = config_file or REPO / 'configs' / 'tiny.py'
    return [sys.executable, str(REPO / 'main.py'), f'--config={config_file}',
            f'--workdir={workdir}', f'--mode={mode}', *self.flags(extra)]

  def run_main(self, workdir, extra: dict | None = None, *, mode: str = 'train',
               devices: int = 1, timeout: float = 600) -> subprocess.CompletedProcess:
    """Runs main.py to completion; returns the CompletedProcess (text stdout and stderr)."""
    return subprocess.run(self.main_command(workdir, extra, mode), env=self.env(devices),
                          cwd=REPO, capture_output=True, text=True, timeout=timeout)

  def start_main(self, workdir, log_path, extra: dict | None = None,
                 devices: int = 1, mode: str = 'train') -> subprocess.Popen:
    """Starts main.py in the background with stdout and stderr going to `log_path`."""
    log = open(log_path, 'w')  # pylint: disable=consider-using-with
    proc = subprocess.Popen(self.main_command(workdir, extra, mode), env=self.env(devices),
                            cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    log.close()  # The child holds its own descriptor.
    return proc

  def run_script(self, path, *args, devices: int = 1,
                 timeout: float = 600) -> subprocess.CompletedProcess:
    """Runs a Python script with the repository importable."""
    return subprocess.run([sys.executable, str(path), *map(str, args)], env=self.env(devices),
                          cwd=REPO, capture_output=True, text=True, timeout=timeout)

  @staticmethod
  def step_dirs(workdir) -> list[int]:
    """Finalized checkpoint steps in `workdir/checkpoints` (orbax renames `<step>` at the end)."""
    d = pathlib.Path(workdir) / 'checkpoints'
    if not d.is_dir():
      return []
    return sorted(int(p.name) for p in d.iterdir() if p.is_dir() and _STEP_DIR.match(p.name))

  @staticmethod
  def tmp_dirs(workdir) -> list[str]:
    """In-progress (or abandoned) orbax checkpoint folders."""
    d = pathlib.Path(workdir) / 'checkpoints'
    return sorted(p.name for p in d.iterdir() if 'orbax-checkpoint-tmp' in p.name)

  def restore(self, workdir, extra: dict | None = None, step: int | None = None):
    """Restores a checkpoint of a run made with `extra` onto one device; numpy leaves."""
    setup = assembly.build(self.config(extra), devices=jax.devices()[:1])
    ckpt = checkpoints.Checkpointer(str(workdir), async_save=False)
    try:
      state = ckpt.restore(setup.abstract_state, step=step)
    finally:
      ckpt.close()
    return jax.tree.map(np.asarray, jax.device_get(state))

  @staticmethod
  def wait_for(predicate, proc: subprocess.Popen, log_path, timeout: float, what: str):
    """Polls `predicate()` until true; fails if `proc` exits first or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
      result = predicate()
      if result:
        return result
      if proc.poll() is not None:
        pytest.fail(f'the run exited (rc {proc.returncode}) before {what}:\n'
                    f'{pathlib.Path(log_path).read_text()[-4000:]}')
      time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    pytest.fail(f'timed out after {timeout}s waiting for {what}:\n'
                f'{pathlib.Path(log_path).read_text()[-4000:]}')

  @staticmethod
  def max_abs_diff(a, b) -> float:
    """Largest absolute difference between two trees of arrays with the same structure."""
    assert jax.tree.structure(a) == jax.tree.structure(b)
    return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
