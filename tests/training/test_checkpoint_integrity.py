"""Checkpoint integrity: checksums catch damaged arrays, a corrupt newest checkpoint falls back
to the newest good one (moved aside, never deleted), and save errors end the run cleanly.

A module fixture trains the tiny recipe in-process to 6 steps, saving every 2; each test
damages a copy of it. The read-only-folder save error is slow (`-m slow`): the background
write error covers the save-error exit in CI.
"""

import json
import logging
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from training import assembly, checkpoints, evaluation, train

RUN = {'total_steps': 6, 'checkpoint_every_steps': 2, 'keep_checkpoints': 3}
# A main.py run that hangs (orbax threads waiting for a folder that never came) fails here.
SUBPROCESS_TIMEOUT = 150
# File size limit (bytes) of the write-error run: below the tiny model's largest array file
# (about 3 MB), above everything else it writes before its first save.
FILE_SIZE_LIMIT = 1 << 20


def _files(root: pathlib.Path) -> dict[str, bytes]:
  return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob('*') if p.is_file()}


def _largest_array_file(step_dir: pathlib.Path) -> pathlib.Path:
  """The biggest OCDBT data file of the state item (it holds most of the arrays)."""
  files = [p for p in (step_dir / 'state').rglob('*') if p.is_file() and p.parent.name == 'd']
  return max(files, key=lambda p: p.stat().st_size)


def _overwrite_4k(step_dir):
  path = _largest_array_file(step_dir)
  data = bytearray(path.read_bytes())
  middle = len(data) // 2
  data[middle:middle + 4096] = bytes(b ^ 0xA5 for b in data[middle:middle + 4096])
  path.write_bytes(bytes(data))


def _flip_one_bit(step_dir):
  path = _largest_array_file(step_dir)
  data = bytearray(path.read_bytes())
  data[len(data) // 2] ^= 0x10
  path.write_bytes(bytes(data))


def _flip_a_bit_every_4k(step_dir):
  """Damage that reaches every array (one bit in each 4 KiB of every array file): a
  parameters-only reader must see it too, wherever OCDBT packed the parameters."""
  for path in (step_dir / 'state').rglob('*'):
    if path.is_file() and path.parent.name == 'd':
      data = bytearray(path.read_bytes())
      for i in range(0, len(data), 4096):
        data[i] ^= 0x10
      path.write_bytes(bytes(data))


def _truncate(step_dir):
  path = _largest_array_file(step_dir)
  os.truncate(path, path.stat().st_size // 2)


def _delete(step_dir):
  _largest_array_file(step_dir).unlink()


def _delete_step_metadata(step_dir):
  (step_dir / '_CHECKPOINT_METADATA').unlink()


def _delete_array_metadata(step_dir):
  (step_dir / 'state' / '_METADATA').unlink()


DAMAGES = {'overwrite_4k': _overwrite_4k, 'flip_one_bit': _flip_one_bit, 'truncate': _truncate,
           'flip_a_bit_every_4k': _flip_a_bit_every_4k,
           'delete_file': _delete, 'no_step_metadata': _delete_step_metadata,
           'no_array_metadata': _delete_array_metadata}


@pytest.fixture(scope='module')
def run6(harness, tmp_path_factory):
  """A run to 6 steps with checkpoints 2, 4 and 6."""
  workdir = tmp_path_factory.mktemp('run6')
  train.train_and_evaluate(harness.config(RUN), str(workdir))
  assert harness.step_dirs(workdir) == [2, 4, 6]
  return workdir


@pytest.fixture(scope='module')
def step4(harness, run6):
  return harness.restore(run6, RUN, step=4)


def _damaged_copy(run6, tmp_path, damage, steps=(6,)):
  workdir = tmp_path / 'run'
  shutil.copytree(run6, workdir)
  for step in steps:
    DAMAGES[damage](workdir / 'checkpoints' / str(step))
  return workdir


def _assert_moved_aside(workdir, step, before):
  """The bad step folder is under checkpoints/corrupt/, byte for byte as it was."""
  moved = sorted((workdir / 'checkpoints' / checkpoints.CORRUPT_DIR).iterdir())
  assert [p.name.split('-')[0] for p in moved] == [str(step)], moved
  assert _files(moved[0]) == before


@pytest.mark.parametrize('damage', sorted(DAMAGES))
def test_damaged_latest_checkpoint_falls_back_to_the_previous_one(harness, run6, step4, tmp_path,
                                                                  caplog, damage):
  workdir = _damaged_copy(run6, tmp_path, damage)
  before = _files(workdir / 'checkpoints' / '6')
  with caplog.at_level(logging.WARNING):
    state = harness.restore(workdir, RUN)
  assert int(state.step) == 4
  assert harness.max_abs_diff(state.params, step4.params) == 0
  assert harness.max_abs_diff(state.opt_state, step4.opt_state) == 0
  warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
  assert any('checkpoint step 6' in w and 'corrupt' in w for w in warnings), warnings
  assert harness.step_dirs(workdir) == [2, 4]
  _assert_moved_aside(workdir, 6, before)


def test_checksums_catch_a_bit_flip_that_orbax_restores_silently(harness, run6, tmp_path):
  # The arrays are zstd-compressed: damage often breaks decoding (a read error), but this
  # flip decodes to other values, which orbax returned as they were (issue 20).
  workdir = _damaged_copy(run6, tmp_path, 'flip_one_bit')
  with pytest.raises(checkpoints.CheckpointError, match='checksum mismatch') as info:
    harness.restore(workdir, RUN, step=6)  # An explicit step: no fallback.
  assert 'step 6' in str(info.value) and str(workdir / 'checkpoints') in str(info.value)
  assert harness.step_dirs(workdir) == [2, 4, 6]  # Nothing moved without a fallback.


def test_checksums_do_not_depend_on_the_sharding(harness):
  """The same values sharded two ways over 2 devices, and on one device, sum alike."""
  if jax.device_count() < 2:
    pytest.skip('needs 2 devices (XLA_FLAGS=--xla_force_host_platform_device_count=2)')
  x = jax.numpy.arange(4 * 6, dtype=jax.numpy.float32).reshape(4, 6)
  mesh = jax.sharding.Mesh(jax.devices()[:2], ('a',))
  sums = [checkpoints.tree_checksums({'x': jax.device_put(x, s)})['x']['sum'] for s in (
      jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('a', None)),
      jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, 'a')),
      jax.devices()[0])]
  assert len(set(sums)) == 1, sums


def test_checksums_change_with_one_element_or_its_position():
  x = jax.numpy.arange(64, dtype=jax.numpy.float32).reshape(8, 8)
  base = checkpoints.tree_checksums({'x': x})['x']['sum']
  flipped = x.at[3, 5].set(jax.lax.bitcast_convert_type(
      jax.lax.bitcast_convert_type(x[3, 5], jax.numpy.uint32) ^ 1, jax.numpy.float32))
  assert checkpoints.tree_checksums({'x': flipped})['x']['sum'] != base
  assert checkpoints.tree_checksums({'x': x.T})['x']['sum'] != base  # Same values, moved.


def test_training_resumes_from_the_fallback(harness, run6, step4, tmp_path, caplog):
  workdir = _damaged_copy(run6, tmp_path, 'truncate')
  before = _files(workdir / 'checkpoints' / '6')
  with caplog.at_level(logging.INFO):
    state = train.train_and_evaluate(harness.config({**RUN, 'total_steps': 8}), str(workdir))
  assert 'resumed from checkpoint step 4' in caplog.text
  assert int(state.step) == 8
  # Step 6 is written again by the resumed run; the damaged one is kept aside.
  assert harness.step_dirs(workdir) == [4, 6, 8]
  _assert_moved_aside(workdir, 6, before)
  assert int(harness.restore(workdir, RUN, step=6).step) == 6


def test_eval_mode_uses_the_fallback_and_changes_no_checkpoint(harness, run6, tmp_path, caplog):
  # --mode=eval's function, in this process (main.py's eval mode: test_checkpointing.py and
  # test_run_config.py).
  workdir = _damaged_copy(run6, tmp_path, 'flip_a_bit_every_4k')
  before = _files(workdir / 'checkpoints')
  with caplog.at_level(logging.WARNING):
    assert evaluation.evaluate_checkpoint(harness.config(RUN), str(workdir))['step'] == 4
  assert 'checkpoint step 6' in caplog.text and 'is corrupt' in caplog.text
  assert 'left in place' in caplog.text
  assert [p.name for p in workdir.glob('eval_step_*.json')] == ['eval_step_4.json']
  assert json.loads((workdir / 'eval_step_4.json').read_text())['step'] == 4
  # Eval only reads (it may run beside the training job): the training run moves step 6 aside.
  assert _files(workdir / 'checkpoints') == before


def test_params_only_restore_checks_the_parameters_checksums(harness, run6, step4, tmp_path):
  """restore_params reads params and step alone, and still catches their damage."""
  workdir = _damaged_copy(run6, tmp_path, 'flip_a_bit_every_4k')
  setup = assembly.build(harness.config(RUN), workdir=str(workdir))
  try:
    step, params = assembly.latest_params(setup, str(workdir))
  finally:
    setup.data.close()
  assert step == 4
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               params, step4.params)
  with pytest.raises(checkpoints.CheckpointError, match='checkpoint step 6'):
    ckpt = checkpoints.Checkpointer(str(workdir), read_only=True)
    try:
      ckpt.restore_params(setup.abstract_state.params, step=6)
    finally:
      ckpt.close()


def test_no_good_checkpoint_is_an_error_naming_every_bad_step(harness, run6, tmp_path):
  workdir = _damaged_copy(run6, tmp_path, 'flip_a_bit_every_4k', steps=(2, 4, 6))
  before = _files(workdir)
  with pytest.raises(checkpoints.CheckpointError) as info:
    evaluation.evaluate_checkpoint(harness.config(RUN), str(workdir))
  message = str(info.value)
  assert 'steps 6, 4, 2' in message and str(workdir / 'checkpoints') in message, message
  # Training does not start over either; nothing is moved or deleted.
  with pytest.raises(checkpoints.CheckpointError):
    train.train_and_evaluate(harness.config(RUN), str(workdir))
  after = _files(workdir)
  assert {k: after.get(k) for k in before} == before
  assert harness.step_dirs(workdir) == [2, 4, 6]


def _rotating_copy(run6, tmp_path, monkeypatch):
  """A copy of run6 whose step 6 is committed, and step 4 deleted, while step 4 is being read:
  what a reader beside a run with keep_checkpoints=1 meets (issue 35)."""
  workdir = tmp_path / 'run'
  shutil.copytree(run6, workdir)
  folder = workdir / 'checkpoints'
  (folder / '6').rename(tmp_path / 'pending_6')
  read = checkpoints.Checkpointer._read

  def rotate_then_read(self, step, args):
    if step == 4 and (tmp_path / 'pending_6').exists():
      (tmp_path / 'pending_6').rename(folder / '6')
      shutil.rmtree(folder / '4')
    return read(self, step, args)

  monkeypatch.setattr(checkpoints.Checkpointer, '_read', rotate_then_read)
  return workdir


def test_a_step_rotated_away_while_read_is_not_corrupt(harness, run6, tmp_path, monkeypatch,
                                                       caplog):
  workdir = _rotating_copy(run6, tmp_path, monkeypatch)
  setup = assembly.build(harness.config(RUN), workdir=str(workdir))
  setup.data.close()
  ckpt = checkpoints.Checkpointer(str(workdir), read_only=True)
  try:
    with caplog.at_level(logging.INFO):
      step, _ = ckpt.restore_params(setup.abstract_state.params)
  finally:
    ckpt.close()
  assert step == 6  # The newest step that exists, listed again.
  assert 'step 4' in caplog.text and 'deleted while it was read' in caplog.text
  assert 'corrupt' not in caplog.text
  assert not (workdir / 'checkpoints' / checkpoints.CORRUPT_DIR).exists()


def test_an_asked_for_step_rotated_away_while_read_is_not_found(harness, run6, tmp_path,
                                                                monkeypatch):
  workdir = _rotating_copy(run6, tmp_path, monkeypatch)
  with pytest.raises(FileNotFoundError, match=r'step 4 .* was deleted while it was read .*'
                                              r'saved steps now: 2, 6'):
    evaluation.evaluate_checkpoint(harness.config({**RUN, 'eval_checkpoint_step': 4}), str(workdir))


def test_another_model_is_an_error_not_a_fallback(harness, run6, tmp_path):
  workdir = _damaged_copy(run6, tmp_path, 'truncate')  # Even with a damaged newest step.
  before = _files(workdir)
  with pytest.raises(checkpoints.CheckpointError, match='different model configuration') as info:
    harness.restore(workdir, {**RUN, 'model.d': 1})
  assert 'step 6' in str(info.value)
  after = _files(workdir)
  assert {k: after.get(k) for k in before} == before


def _assert_save_error(harness, proc, workdir):
  """main.py stopped with one error line naming the folder, and kept every checkpoint."""
  assert proc.returncode == 1, proc.stderr[-5000:]
  errors = [line for line in proc.stderr.splitlines() if line.startswith('error: ')]
  assert len(errors) == 1, proc.stderr[-5000:]
  assert 'saving checkpoint step 8' in errors[0], errors[0]
  assert str(workdir / 'checkpoints') in errors[0], errors[0]
  assert 'last committed checkpoint is step 6' in errors[0], errors[0]
  assert harness.step_dirs(workdir) == [2, 4, 6]
  assert int(harness.restore(workdir, RUN).step) == 6
  return errors[0]


def _read_only_mount_works(path) -> bool:
  probe = subprocess.run(['unshare', '-rm', 'sh', '-c', 'mount --bind "$0" "$0" && '
                          'mount -o remount,bind,ro "$0" && ! touch "$0/probe"', str(path)],
                         capture_output=True, check=False)
  return probe.returncode == 0


# Slow: the write-error test below covers in CI a save that fails ending main.py with one
# error line naming the folder and the last committed step, every checkpoint kept.
@pytest.mark.slow
def test_read_only_checkpoints_folder_ends_the_run_with_an_error(harness, run6, tmp_path):
  """The folder is mounted read-only in a private mount namespace (fails for root too)."""
  workdir = tmp_path / 'run'
  shutil.copytree(run6, workdir)
  if shutil.which('unshare') is None or not _read_only_mount_works(tmp_path):
    pytest.skip('cannot mount a folder read-only here (unshare -rm)')
  command = ['unshare', '-rm', 'sh', '-c', 'mount --bind "$0" "$0" && '
             'mount -o remount,bind,ro "$0" && exec "$@"', str(workdir / 'checkpoints'),
             *harness.main_command(workdir, {**RUN, 'total_steps': 10})]
  proc = subprocess.run(command, env=harness.env(), cwd=harness.repo, capture_output=True,
                        text=True, timeout=SUBPROCESS_TIMEOUT)
  assert 'resumed from checkpoint step 6' in proc.stderr
  assert 'Read-only file system' in _assert_save_error(harness, proc, workdir)


def test_write_error_in_the_background_save_ends_the_run_with_an_error(harness, run6, tmp_path):
  """A file size limit (like a full disk, it binds root too) fails orbax's background write."""
  if shutil.which('prlimit') is None:
    pytest.skip('needs prlimit (util-linux)')
  workdir = tmp_path / 'run'
  shutil.copytree(run6, workdir)
  assert _largest_array_file(workdir / 'checkpoints' / '6').stat().st_size > FILE_SIZE_LIMIT
  # SIGXFSZ ignored: a write past the limit fails with EFBIG instead of killing the process.
  command = ['sh', '-c', 'trap "" XFSZ && exec "$@"', 'sh', 'prlimit',
             f'--fsize={FILE_SIZE_LIMIT}', '--',
             *harness.main_command(workdir, {**RUN, 'total_steps': 10})]
  proc = subprocess.run(command, env=harness.env(), cwd=harness.repo, capture_output=True,
                        text=True, timeout=SUBPROCESS_TIMEOUT)
  assert 'resumed from checkpoint step 6' in proc.stderr
  assert 'File too large' in _assert_save_error(harness, proc, workdir)


_TWO_PROCESS_SCRIPT = textwrap.dedent('''\
    """One of two processes (one CPU device each): saves steps 1 and 2 of a state sharded over
    both, damages (process 1) its own array file of step 2, restores the newest good step."""
    import json
    import pathlib
    import sys

    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    jax.config.update('jax_cpu_collectives_implementation', 'gloo')
    pid, port, workdir = int(sys.argv[1]), sys.argv[2], pathlib.Path(sys.argv[3])
    jax.distributed.initialize(f'localhost:{port}', num_processes=2, process_id=pid)
    from training import checkpoints, steps

    mesh = jax.sharding.Mesh(np.array(jax.devices()), ('data',))
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('data', None))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


    def state(step):
      full = np.random.default_rng(step).normal(size=(2048, 256)).astype(np.float32)
      return steps.TrainState(
          step=jax.make_array_from_callback((), replicated, lambda _: np.array(step, np.int32)),
          params={'w': jax.make_array_from_callback(full.shape, rows, lambda i: full[i])},
          opt_state=(), memory={})


    ckpt = checkpoints.Checkpointer(str(workdir), keep=3, async_save=False)
    for step in (1, 2):
      ckpt.save(step, state(step))
      ckpt.wait()
    multihost_utils.sync_global_devices('saved')
    if pid == 1:  # Only process 1 reads this file back: process 0 sees nothing wrong.
      folder = workdir / 'checkpoints' / '2' / 'state' / 'ocdbt.process_1' / 'd'
      path = max(folder.iterdir(), key=lambda p: p.stat().st_size)
      data = bytearray(path.read_bytes())
      data[len(data) // 2] ^= 0x10
      path.write_bytes(bytes(data))
    multihost_utils.sync_global_devices('damaged')
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state(0))
    restored = ckpt.restore(abstract)
    ckpt.close()
    expected = state(1).params['w'].addressable_data(0)
    with open(workdir / f'result_{pid}.json', 'w') as f:
      json.dump({'restored_step': ckpt.restored_step,
                 'step': int(restored.step.addressable_data(0)),
                 'equal': bool(np.array_equal(restored.params['w'].addressable_data(0),
                                              expected))}, f)
    ''')


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('localhost', 0))
    return s.getsockname()[1]


def test_processes_agree_on_the_fallback(harness, tmp_path):
  """A read error on one process of two: both fall back to the same step, moved once."""
  script = tmp_path / 'two_process.py'
  script.write_text(_TWO_PROCESS_SCRIPT)
  workdir, port = tmp_path / 'run', _free_port()
  # pylint: disable-next=consider-using-with
  logs = [open(tmp_path / f'process_{i}.log', 'w') for i in range(2)]
  procs = [subprocess.Popen([sys.executable, str(script), str(i), str(port), str(workdir)],
                            env=harness.env(), cwd=harness.repo, stdout=log,
                            stderr=subprocess.STDOUT) for i, log in enumerate(logs)]
  try:
    codes = [p.wait(timeout=SUBPROCESS_TIMEOUT) for p in procs]
  finally:
    for p, log in zip(procs, logs):
      p.kill()
      p.wait()
      log.close()
  text = '\n'.join((tmp_path / f'process_{i}.log').read_text()[-3000:] for i in range(2))
  assert codes == [0, 0], text
  results = [json.loads((workdir / f'result_{i}.json').read_text()) for i in range(2)]
  assert results == [{'restored_step': 1, 'step': 1, 'equal': True}] * 2, text
  assert harness.step_dirs(workdir) == [1]
  moved = list((workdir / 'checkpoints' / checkpoints.CORRUPT_DIR).iterdir())
  assert [p.name.split('-')[0] for p in moved] == ['2'], moved
  assert 'read error on process 1' in (tmp_path / 'process_0.log').read_text()
