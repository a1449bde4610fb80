"""Checkpoints: preemption (SIGKILL and SIGTERM), keep-last-K, NaN, corruption, eval mode, and
resuming on another mesh.

Most tests run `main.py` in subprocesses on the tiny recipe with a small batch (see
conftest.FAST); the subprocesses share one JAX compilation cache. The SIGTERM test and the
eval on a pure data-parallel 8-device mesh are slow (`-m slow`): other tests cover them in CI
(see their comments).
"""

import json
import math
import pathlib
import shutil
import signal
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from training import assembly, checkpoints, evaluation, train

# SIGKILL test: a run to N steps saving every EVERY steps is killed once a checkpoint at a
# step >= KILL_AFTER is on disk; N - KILL_AFTER steps are left so the run cannot finish
# before the signal lands.
N = 120
EVERY = 5
KILL_AFTER = 15
# Largest parameter difference between the resumed run and the uninterrupted one.
RESUME_TOL = 1e-6

# SIGTERM test: total steps of the run, and the logged step after which SIGTERM is sent.
TERM_TOTAL = 300
TERM_AFTER = 10

# Keep-last-K test (also the run that the corruption test damages).
SHORT = {'total_steps': 10, 'checkpoint_every_steps': 2, 'keep_checkpoints': 2}

# Resume on another mesh: a run on MESH_A to MESH_STEPS saves every MESH_EVERY steps; a copy
# without its last checkpoint resumes from step MESH_EVERY on another mesh. The vocabulary is
# set (32 ids, the task uses 25): left at 0 it is padded to a multiple of the tensor axis, so a
# model trained with tensor=2 would not be the one built on a mesh without it.
MESH_STEPS = 6
MESH_EVERY = 3
MESH_RUN = {'total_steps': MESH_STEPS, 'checkpoint_every_steps': MESH_EVERY, 'warmup_steps': 2,
            'model.vocab_size': 32, 'adam_eps': 1e-3}
MESH_A = {'mesh.data': 4, 'mesh.fsdp': 1, 'mesh.tensor': 2}
MESH_B = {'mesh.data': 2, 'mesh.fsdp': 2, 'mesh.tensor': 2}
# Largest difference of parameters and optimizer state between the run resumed on another mesh
# and the uninterrupted one, after MESH_STEPS - MESH_EVERY steps on different meshes: only
# reduction orders differ (float32, ~1e-7 a step). adam_eps 1e-3 bounds how much AdamW
# amplifies that: its update lr g / (|g| + eps) has slope at most lr / eps = 5 in g; with the
# default 1e-8 a gradient entry that is rounding noise can flip sign and move its weight by lr
# (see test_sharded_step.ADAM_EPS). A resume that restored the wrong step, the wrong batch
# position or a wrongly resharded array differs by > 1e-3. A run that silently started over
# instead of resuming would match the uninterrupted one (its batches are a function of the
# step), so the resumed runs fail if they initialize parameters (assembly.init_state).
MESH_TOL = 1e-5

EVAL_KEYS = {'step', 'loss', 'perplexity', 'accuracy'}
# Eval on a differently sized mesh: same batches, only reduction orders differ.
EVAL_RTOL = 1e-5


def _log_text(path) -> str:
  return pathlib.Path(path).read_text()


@pytest.fixture(scope='module')
def reference(harness, tmp_path_factory):
  """An uninterrupted run to N steps on one device (one checkpoint, at the end)."""
  workdir = tmp_path_factory.mktemp('reference')
  proc = harness.run_main(workdir, {'total_steps': N, 'checkpoint_every_steps': N})
  assert proc.returncode == 0, proc.stderr[-5000:]
  assert 'resumed from checkpoint' not in proc.stderr
  assert harness.step_dirs(workdir) == [N]
  return workdir


def test_sigkill_and_restart_match_uninterrupted_run(harness, reference, tmp_path):
  """Over a minute in CI: a run killed mid-way and its restart are two main.py starts, and
  the module's uninterrupted reference run is built on first use here."""
  workdir, log = tmp_path / 'run', tmp_path / 'killed.log'
  extra = {'total_steps': N, 'checkpoint_every_steps': EVERY}
  proc = harness.start_main(workdir, log, extra)
  try:
    harness.wait_for(lambda: [s for s in harness.step_dirs(workdir) if s >= KILL_AFTER], proc,
                     log, timeout=420, what=f'a checkpoint at step >= {KILL_AFTER}')
    proc.send_signal(signal.SIGKILL)
  finally:
    proc.kill()
    proc.wait()
  assert proc.returncode == -signal.SIGKILL, (
      f'the run ended by itself (rc {proc.returncode}) before SIGKILL; raise N:\n'
      f'{_log_text(log)[-3000:]}')
  assert f'step {N}/{N}' not in _log_text(log)
  saved = harness.step_dirs(workdir)
  assert saved and KILL_AFTER <= saved[-1] < N and saved[-1] % EVERY == 0, saved

  restart = harness.run_main(workdir, extra)
  assert restart.returncode == 0, restart.stderr[-5000:]
  assert f'resumed from checkpoint step {saved[-1]}' in restart.stderr
  assert harness.step_dirs(workdir)[-1] == N
  assert harness.tmp_dirs(workdir) == []

  resumed = harness.restore(workdir, extra)
  uninterrupted = harness.restore(reference, {'total_steps': N})
  assert int(resumed.step) == int(uninterrupted.step) == N
  diff = harness.max_abs_diff(resumed.params, uninterrupted.params)
  assert diff <= RESUME_TOL, f'resumed params differ from the uninterrupted run by {diff}'
  assert harness.max_abs_diff(resumed.opt_state, uninterrupted.opt_state) <= RESUME_TOL


# Slow: test_signals.py's second-SIGTERM test covers, in CI, a SIGTERM that saves one step,
# exits 0 and leaves no temporary folder, and a resume from that step; a main.py restart that
# resumes and finishes is the SIGKILL test's above.
@pytest.mark.slow
def test_sigterm_saves_exits_zero_and_restart_finishes(harness, tmp_path):
  """About a minute: a run stopped by SIGTERM and its restart, two main.py starts."""
  workdir, log = tmp_path / 'run', tmp_path / 'term.log'
  # Checkpoints only at the end or on SIGTERM; log every step to see the loop running (the
  # SIGTERM handler is installed by then).
  extra = {'total_steps': TERM_TOTAL, 'checkpoint_every_steps': 10 * TERM_TOTAL,
           'log_every_steps': 1}
  proc = harness.start_main(workdir, log, extra)
  try:
    harness.wait_for(lambda: f'step {TERM_AFTER}/{TERM_TOTAL}' in _log_text(log), proc, log,
                     timeout=420, what=f'step {TERM_AFTER}')
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(timeout=120)
  finally:
    proc.kill()
    proc.wait()
  text = _log_text(log)
  assert rc == 0, text[-5000:]
  saved = harness.step_dirs(workdir)
  assert len(saved) == 1 and TERM_AFTER <= saved[0] < TERM_TOTAL, (saved, text[-3000:])
  stopped = saved[0]
  assert f'preemption requested: saved step {stopped}, exiting' in text
  assert harness.tmp_dirs(workdir) == []
  assert int(harness.restore(workdir, extra).step) == stopped

  restart = harness.run_main(workdir, extra)
  assert restart.returncode == 0, restart.stderr[-5000:]
  assert f'resumed from checkpoint step {stopped}' in restart.stderr
  assert f'step {TERM_TOTAL}/{TERM_TOTAL}' in restart.stderr
  assert harness.step_dirs(workdir)[-1] == TERM_TOTAL
  assert int(harness.restore(workdir, extra).step) == TERM_TOTAL


@pytest.fixture(scope='module')
def short_run(harness, tmp_path_factory):
  """Trains in-process for 10 steps, saving every 2 and keeping 2."""
  workdir = tmp_path_factory.mktemp('short')
  state = train.train_and_evaluate(harness.config(SHORT), str(workdir))
  assert int(state.step) == SHORT['total_steps']
  return workdir


def test_keeps_only_the_last_k_checkpoints(harness, short_run):
  assert harness.step_dirs(short_run) == [8, 10]
  assert harness.tmp_dirs(short_run) == []
  ckpt = checkpoints.Checkpointer(str(short_run), keep=2, async_save=False)
  assert ckpt.latest_step() == 10
  ckpt.close()


def test_non_finite_loss_stops_with_error_and_keeps_checkpoints(harness, tmp_path):
  # lr 1e6 without clipping: AdamW's decoupled weight decay alone multiplies every matrix by
  # (1 - lr * wd) per step, so the parameters overflow within a few steps.
  extra = {'total_steps': 40, 'checkpoint_every_steps': 2, 'learning_rate': 1e6,
           'clip_grad_norm': 0.0, 'log_every_steps': 1}
  proc = harness.run_main(tmp_path, extra)
  assert proc.returncode != 0, proc.stderr[-5000:]
  assert 'Traceback' not in proc.stderr
  errors = [line for line in proc.stderr.splitlines() if line.startswith('error: ')]
  assert len(errors) == 1, proc.stderr[-5000:]
  assert 'non-finite' in errors[0], errors[0]
  assert str(tmp_path / 'checkpoints') in errors[0]
  saved = harness.step_dirs(tmp_path)
  assert saved and saved[-1] < extra['total_steps'], saved
  assert f'last good checkpoint is step {saved[-1]}' in errors[0]
  assert harness.tmp_dirs(tmp_path) == []
  for step in saved:  # Every checkpoint left behind restores and is finite.
    state = harness.restore(tmp_path, extra, step=step)
    assert int(state.step) == step
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(state.params))


def test_save_refuses_non_finite_params(harness, tmp_path):
  setup = assembly.build(harness.config(), devices=jax.devices()[:1])
  state = assembly.init_state(setup, 0)
  ckpt = checkpoints.Checkpointer(str(tmp_path), keep=3, async_save=False)
  ckpt.save(1, state)
  leaves, treedef = jax.tree.flatten(state.params)
  for i, bad_value in enumerate((jnp.nan, jnp.inf)):
    bad_leaves = list(leaves)
    bad_leaves[-1] = bad_leaves[-1].at[(0,) * bad_leaves[-1].ndim].set(bad_value)
    bad = state.replace(step=state.step + 2 + i, params=jax.tree.unflatten(treedef, bad_leaves))
    with pytest.raises(FloatingPointError, match='not finite'):
      ckpt.save(2 + i, bad)
  ckpt.wait()
  assert ckpt.latest_step() == 1
  ckpt.close()
  assert harness.step_dirs(tmp_path) == [1]
  assert harness.tmp_dirs(tmp_path) == []


def _files(root: pathlib.Path) -> dict[str, int]:
  return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob('*') if p.is_file()}


def _overwrite_array_files(step_dir: pathlib.Path) -> None:
  """Overwrites the OCDBT data files holding the arrays."""
  damaged = [p for p in step_dir.rglob('*') if p.is_file() and p.parent.name == 'd']
  assert damaged, sorted(_files(step_dir))
  for p in damaged:
    p.write_bytes(b'\xde\xad\xbe\xef' * (p.stat().st_size // 4 + 1))


def test_corrupt_checkpoint_falls_back_and_keeps_files(harness, short_run, tmp_path):
  workdir = tmp_path / 'run'
  shutil.copytree(short_run, workdir)
  folder = workdir / 'checkpoints'
  _overwrite_array_files(folder / '10')
  before = _files(workdir)
  config = harness.config(SHORT)

  # The newest good checkpoint is evaluated; eval only reads, so nothing is moved.
  assert evaluation.evaluate_checkpoint(config, str(workdir))['step'] == 8
  assert [p.name for p in workdir.glob('eval_step_*.json')] == ['eval_step_8.json']
  assert _files(folder) == {k.removeprefix('checkpoints/'): v for k, v in before.items()
                            if k.startswith('checkpoints/')}
  # A writable restore (what a resuming run does) moves the corrupt one aside, not deleted.
  assert int(harness.restore(workdir, SHORT).step) == 8
  assert harness.step_dirs(workdir) == [8]
  moved = list((folder / checkpoints.CORRUPT_DIR).iterdir())
  assert len(moved) == 1 and moved[0].name.startswith('10-'), moved
  after = _files(workdir)
  prefix = f'checkpoints/{checkpoints.CORRUPT_DIR}/{moved[0].name}/'
  after = {k.replace(prefix, 'checkpoints/10/'): v for k, v in after.items()}
  missing = {k for k in before if k not in after}
  assert not missing, f'files removed: {sorted(missing)}'
  assert {k: after[k] for k in before} == before

  # With no good checkpoint left: an error naming the step; training does not start over.
  _overwrite_array_files(folder / '8')
  before = _files(workdir)
  with pytest.raises(checkpoints.CheckpointError) as info:
    evaluation.evaluate_checkpoint(config, str(workdir))
  message = str(info.value)
  assert str(folder) in message and 'step 8' in message, message
  with pytest.raises(checkpoints.CheckpointError):
    train.train_and_evaluate(config, str(workdir))
  after = _files(workdir)
  assert {k: after.get(k) for k in before} == before
  assert harness.step_dirs(workdir) == [8]


def test_checkpoint_of_another_model_raises_checkpoint_error(harness, short_run, tmp_path):
  workdir = tmp_path / 'run'
  shutil.copytree(short_run, workdir)
  # Without the config record (a run older than it; with it, the change is refused first:
  # test_run_config.py), the config given meets the checkpoint.
  (workdir / 'config.json').unlink()
  before = _files(workdir)
  config = harness.config({**SHORT, 'model.d': 1})  # d_model 64 instead of 128.
  with pytest.raises(checkpoints.CheckpointError, match='different model configuration') as info:
    evaluation.evaluate_checkpoint(config, str(workdir))
  assert str(workdir / 'checkpoints') in str(info.value)
  after = _files(workdir)
  assert {k: after.get(k) for k in before} == before


@pytest.fixture(scope='module')
def eval_one_device(harness, reference, tmp_path_factory):
  """`main.py --mode=eval` on one device over a copy of the reference run."""
  workdir = tmp_path_factory.mktemp('eval1') / 'run'
  shutil.copytree(reference, workdir)
  proc = harness.run_main(workdir, {'total_steps': N, 'eval_steps': 2}, mode='eval')
  return workdir, proc


def test_eval_mode_writes_json(eval_one_device):
  workdir, proc = eval_one_device
  assert proc.returncode == 0, proc.stderr[-5000:]
  assert [p.name for p in workdir.glob('eval_step_*.json')] == [f'eval_step_{N}.json']
  result = json.loads((workdir / f'eval_step_{N}.json').read_text())
  assert EVAL_KEYS <= set(result), result
  assert result['step'] == N
  assert math.isfinite(result['loss']) and result['loss'] > 0
  assert result['perplexity'] == pytest.approx(math.exp(result['loss']), rel=1e-6)
  assert 0.0 <= result['accuracy'] <= 1.0


@pytest.mark.parametrize('mesh', [
    # Slow: data2_fsdp4 restores onto 8 devices too, and also reshards over fsdp.
    pytest.param({'mesh.data': 8}, marks=pytest.mark.slow),
    # The eval batch of 16 splits 8 ways and the parameters saved from one device are
    # resharded over fsdp on restore.
    {'mesh.data': 2, 'mesh.fsdp': 4},
], ids=['data8', 'data2_fsdp4'])
def test_eval_restores_onto_eight_devices(harness, reference, eval_one_device, tmp_path, mesh):
  _, proc1 = eval_one_device
  assert proc1.returncode == 0, proc1.stderr[-5000:]
  loss1 = json.loads((eval_one_device[0] / f'eval_step_{N}.json').read_text())['loss']
  workdir = tmp_path / 'run'
  shutil.copytree(reference, workdir)
  proc = harness.run_main(workdir, {'total_steps': N, 'eval_steps': 2, **mesh}, mode='eval',
                          devices=8)
  assert proc.returncode == 0, proc.stderr[-5000:]
  assert '8 devices' in proc.stderr
  result = json.loads((workdir / f'eval_step_{N}.json').read_text())
  assert result['step'] == N
  assert result['loss'] == pytest.approx(loss1, rel=EVAL_RTOL)


_MESH_CHANGE_SCRIPT = textwrap.dedent('''\
    """Trains on mesh A, then resumes a copy of the run from its first checkpoint on mesh B."""
    import json
    import pathlib
    import shutil
    import sys

    import jax

    from configs import tiny
    from training import assembly, train

    out, spec = pathlib.Path(sys.argv[1]), json.loads(sys.argv[2])


    def make_config(overrides):
      config = tiny.get_config()
      config.update_from_flattened_dict(overrides)
      return config


    def summary(state):
      return {'step': int(state.step),
              'mesh': dict(jax.tree.leaves(state.params)[0].sharding.mesh.shape)}


    straight = train.train_and_evaluate(make_config(spec['a']), str(out / 'straight'))
    shutil.copytree(out / 'straight', out / 'resumed')
    shutil.rmtree(out / 'resumed' / 'checkpoints' / str(spec['last']))


    def fresh_init(*args, **kwargs):
      raise AssertionError('the resumed run initialized new parameters instead of restoring')


    assembly.init_state = fresh_init
    resumed = train.train_and_evaluate(make_config(spec['b']), str(out / 'resumed'))
    with open(out / 'result.json', 'w') as f:
      json.dump({'device_count': jax.device_count(), 'straight': summary(straight),
                 'resumed': summary(resumed)}, f)
    ''')


@pytest.fixture(scope='module')
def mesh_change(harness, tmp_path_factory):
  """In one 8-device process: a run to MESH_STEPS on MESH_A (checkpoints every MESH_EVERY),
  and a copy of it without its last checkpoint resumed on MESH_B. Returns the folder."""
  out = tmp_path_factory.mktemp('mesh_change')
  script = out / 'mesh_change.py'
  script.write_text(_MESH_CHANGE_SCRIPT)
  spec = {'a': harness.overrides({**MESH_RUN, **MESH_A}),
          'b': harness.overrides({**MESH_RUN, **MESH_B}), 'last': MESH_STEPS}
  proc = harness.run_script(script, out, json.dumps(spec), devices=8)
  assert proc.returncode == 0, proc.stderr[-5000:]
  result = json.loads((out / 'result.json').read_text())
  assert result['device_count'] == 8
  assert result['straight'] == {'step': MESH_STEPS, 'mesh': {'data': 4, 'fsdp': 1, 'tensor': 2}}
  assert harness.step_dirs(out / 'straight') == [MESH_EVERY, MESH_STEPS]
  return out, result


def _assert_resumed_run_matches(harness, resumed_dir, straight_dir):
  """Both runs' last checkpoints, restored onto one device, hold the same state."""
  assert harness.step_dirs(resumed_dir) == [MESH_EVERY, MESH_STEPS]
  resumed = harness.restore(resumed_dir, MESH_RUN)
  straight = harness.restore(straight_dir, MESH_RUN)
  assert int(resumed.step) == int(straight.step) == MESH_STEPS
  init = harness.restore(straight_dir, MESH_RUN, step=MESH_EVERY)
  # The last steps moved the parameters far more than the tolerance.
  assert harness.max_abs_diff(straight.params, init.params) > 100 * MESH_TOL
  diff = harness.max_abs_diff(resumed.params, straight.params)
  assert diff <= MESH_TOL, f'resumed params differ from the uninterrupted run by {diff}'
  diff = harness.max_abs_diff(resumed.opt_state, straight.opt_state)
  assert diff <= MESH_TOL, f'resumed optimizer state differs from the uninterrupted run by {diff}'


def test_resume_on_another_eight_device_mesh_matches_uninterrupted_run(harness, mesh_change):
  out, result = mesh_change
  assert result['resumed'] == {'step': MESH_STEPS, 'mesh': {'data': 2, 'fsdp': 2, 'tensor': 2}}
  _assert_resumed_run_matches(harness, out / 'resumed', out / 'straight')


def test_resume_on_one_device_matches_uninterrupted_run(harness, mesh_change, tmp_path,
                                                        monkeypatch):
  out, _ = mesh_change
  workdir = tmp_path / 'run'
  shutil.copytree(out / 'straight', workdir)
  shutil.rmtree(workdir / 'checkpoints' / str(MESH_STEPS))

  def fresh_init(*args, **kwargs):
    del args, kwargs
    pytest.fail('the resumed run initialized new parameters instead of restoring')

  monkeypatch.setattr(assembly, 'init_state', fresh_init)
  # This process's devices (one, unless XLA_FLAGS says otherwise): data=-1 takes them all.
  state = train.train_and_evaluate(harness.config(MESH_RUN), str(workdir))
  assert int(state.step) == MESH_STEPS
  mesh = dict(jax.tree.leaves(state.params)[0].sharding.mesh.shape)
  assert mesh == {'data': jax.device_count(), 'fsdp': 1, 'tensor': 1}
  _assert_resumed_run_matches(harness, workdir, out / 'straight')
