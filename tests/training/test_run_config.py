"""WORKDIR/config.json is the run's config: resume, eval and inspect start from it, and a
change of the model or the training is refused unless allowed (issue 20).

Several tests train or evaluate the recorded run in this process with the same settings (a
resume to step 6, the evaluations): the module uses the session's persistent compilation
cache (conftest `compile_cache`), so a program built before is loaded, not compiled again.
"""

import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from configs import tiny
from models.attention import base, registry
from training import assembly, attention_maps, evaluation, optimizer, run_config, train

pytestmark = pytest.mark.usefixtures('compile_cache')

# A model the default recipe does not describe: evaluating with the recipe's defaults would
# score dense attention with these parameters (same shapes), silently.
TRAINED = {'total_steps': 4, 'checkpoint_every_steps': 2, 'model.attention': 'local',
           'model.attention_options.local.window': 2}


@pytest.fixture(scope='module')
def trained(harness, tmp_path_factory):
  """A run trained through main.py (so its record names the recipe): 4 steps of local
  attention with window 2."""
  workdir = tmp_path_factory.mktemp('recorded') / 'run'
  proc = harness.run_main(workdir, TRAINED)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return workdir


def _copy(trained, tmp_path):
  workdir = tmp_path / 'run'
  shutil.copytree(trained, workdir)
  return workdir


def _errors(proc) -> list[str]:
  return [line for line in proc.stderr.splitlines() if line.startswith('error: ')]


def _history(workdir) -> list[dict]:
  return [json.loads(line) for line in (workdir / 'config_history.jsonl').read_text().splitlines()]


def test_the_classification_table():
  assert run_config.kind('model.attention_options.local.window') == run_config.MODEL
  assert run_config.kind('model.attention_impl') == run_config.RUNTIME
  assert run_config.kind('data.num_assignments') == run_config.MODEL
  assert run_config.kind('data.data_dir') == run_config.RUNTIME
  for key in ('learning_rate', 'clip_grad_norm', 'batch_size', 'seed', 'data.packing'):
    assert run_config.kind(key) == run_config.TRAINING, key
  for key in ('total_steps', 'eval_steps', 'mesh.tensor', 'keep_checkpoints', 'pruning.step'):
    assert run_config.kind(key) == run_config.RUNTIME, key
  assert run_config.kind('a_field_added_later') == run_config.MODEL  # Safe by default.
  # An attention option's kind is declared with it (Option.change), not listed in training/.
  assert run_config.kind('model.attention_options.txl.eval_mem_len') == run_config.RUNTIME
  assert run_config.kind('model.attention_options.lsh.n_hashes') == run_config.TRAINING
  for variant in registry.known():
    for name, option in registry.options(variant).items():
      assert run_config.kind(f'model.attention_options.{variant}.{name}') == option.change, (
          variant, name)
  # Another variant's option name is no option of this one: the group's kind.
  assert run_config.kind('model.attention_options.dense.window') == run_config.MODEL
  assert not [k for k in run_config.KINDS if k.startswith(run_config.OPTIONS_GROUP)]
  with pytest.raises(ValueError, match="Option.change must be one of"):
    base.Option(0, 'a typo', change='eval')
  # Every field of the base recipe is classified by an entry, not by the fallback.
  fields = run_config.as_flat_json(tiny.get_config())
  unlisted = [k for k in fields if not any(
      k == e or k.startswith(e + '.') for e in run_config.KINDS)]
  assert not unlisted


def test_the_first_start_records_the_config_and_the_recipe(trained):
  record = json.loads((trained / 'config.json').read_text())
  assert record['model']['attention'] == 'local' and record['total_steps'] == 4
  [start] = _history(trained)
  assert start['start'] == 'new' and start['step'] == 0
  assert start['recipe'].endswith('configs/tiny.py')
  assert start['overrides']['model.attention_options.local.window'] == 2
  # The program that ran: the implementation each layer's attention resolved to.
  assert start['implementations']['attention_impl'] == record['model']['attention_impl']
  per_layer = start['implementations']['per_layer']
  assert len(per_layer) == record['model']['d'] == 2  # n_layers = d
  assert set(per_layer) <= set(base.IMPLEMENTATIONS) - {'auto'}, per_layer
  if record['model']['attention_impl'] == 'auto':  # What chose on this CPU (the suite's file).
    assert start['implementations']['cpu_paths']['file'] == os.environ['ZOO_CPU_CHOICE']


def test_eval_with_no_flags_scores_the_recorded_model(harness, trained, tmp_path):
  workdir = _copy(trained, tmp_path)
  # No --config at all: the default recipe (dense attention, batch 256, 4 assignments) is
  # not what was trained; the record is.
  proc = subprocess.run([sys.executable, str(harness.repo / 'main.py'), f'--workdir={workdir}',
                         '--mode=eval'], env=harness.env(), cwd=harness.repo,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  result = json.loads((workdir / 'eval_step_4.json').read_text())
  assert 'config_overrides' not in result
  # The same numbers as evaluating the recorded model itself.
  reference = evaluation.evaluate_checkpoint(harness.config(TRAINED),
                                             str(_copy(trained, tmp_path / 'ref')))
  assert result['loss'] == pytest.approx(reference['loss'], rel=1e-5)


def _main_request(harness, given: dict) -> run_config.Request:
  """The Request main.py makes of `harness.main_command(workdir, given)`: every flag of it,
  the tiny recipe named with --config."""
  return run_config.Request(keys=frozenset(harness.overrides(given)),
                            recipe=str(harness.repo / 'configs' / 'tiny.py'), recipe_given=True)


def test_eval_with_a_model_override_is_refused(harness, trained, tmp_path):
  # In this process, with the request main.py makes of these flags (main.py's one error line
  # and exit status for a refused change: test_a_different_recipe_file_counts_...).
  workdir = _copy(trained, tmp_path)
  given = {**TRAINED, 'model.attention_options.local.window': 4}
  with pytest.raises(ValueError) as info:
    evaluation.evaluate_checkpoint(harness.config(given), str(workdir),
                                   _main_request(harness, given))
  error = str(info.value)
  assert 'model.attention_options.local.window: recorded 2, given 4' in error, error
  assert '--allow_config_change=model.attention_options.local.window' in error
  assert not list(workdir.glob('eval_step_*.json'))


def test_a_different_recipe_file_counts_but_its_defaults_do_not(harness, trained, tmp_path):
  workdir = _copy(trained, tmp_path)
  proc = subprocess.run([sys.executable, str(harness.repo / 'main.py'), f'--workdir={workdir}',
                         f'--config={harness.repo / "configs" / "default.py"}', '--mode=eval'],
                        env=harness.env(), cwd=harness.repo, capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 1, proc.stderr[-3000:]
  [error] = _errors(proc)
  assert 'model.d: recorded 2, given 8 (recipe ' in error, error


def test_eval_reads_parameters_only_so_optimizer_settings_never_block_it(harness, trained,
                                                                         tmp_path):
  # In this process, with the request main.py makes of these flags: the eval program is the
  # one test_eval_with_no_flags_scores_the_recorded_model built (the compile cache has it).
  workdir = _copy(trained, tmp_path)
  given = {**TRAINED, 'clip_grad_norm': 0.0}
  evaluation.evaluate_checkpoint(harness.config(given), str(workdir),
                                 _main_request(harness, given))
  result = json.loads((workdir / 'eval_step_4.json').read_text())
  assert result['config_overrides'] == {'clip_grad_norm': 0.0}
  # Without a record (an older run) the config given is used as it is: its optimizer state
  # tree (no clipping) differs from the checkpoint's, and only the parameters are read.
  (workdir / 'config.json').unlink()
  again = evaluation.evaluate_checkpoint(harness.config({**TRAINED, 'clip_grad_norm': 0.0}),
                                         str(workdir))
  assert again['loss'] == pytest.approx(result['loss'], rel=1e-5)


def test_resume_with_more_steps_keeps_the_record(harness, trained, tmp_path):
  workdir = _copy(trained, tmp_path)
  record = (workdir / 'config.json').read_text()
  request = run_config.Request(keys=frozenset({'total_steps'}))
  state = train.train_and_evaluate(harness.config({**TRAINED, 'total_steps': 6}),
                                   str(workdir), request)
  assert int(state.step) == 6 and 6 in harness.step_dirs(workdir)
  assert (workdir / 'config.json').read_text() == record
  resume = _history(workdir)[-1]
  assert resume['start'] == 'resume' and resume['step'] == 4
  assert resume['changes'] == [{'key': 'total_steps', 'recorded': 4, 'given': 6,
                                'kind': 'runtime'}]


def test_resume_with_another_learning_rate_needs_allowing(harness, trained, tmp_path, caplog):
  workdir = _copy(trained, tmp_path)
  record = (workdir / 'config.json').read_text()
  config = harness.config({**TRAINED, 'total_steps': 6, 'learning_rate': 0.001})
  keys = frozenset({'total_steps', 'learning_rate'})
  with pytest.raises(ValueError, match='learning_rate: recorded 0.005, given 0.001'):
    train.train_and_evaluate(config, str(workdir), run_config.Request(keys=keys))
  assert harness.step_dirs(workdir) == [2, 4] and len(_history(workdir)) == 1
  with pytest.raises(ValueError, match='no config field or group'):
    train.train_and_evaluate(config, str(workdir),
                             run_config.Request(keys=keys, allow=('learning_rat',)))

  with caplog.at_level('WARNING'):
    train.train_and_evaluate(config, str(workdir),
                             run_config.Request(keys=keys, allow=('learning_rate',)))
  assert 'changing the recorded run' in caplog.text and 'learning_rate' in caplog.text
  assert (workdir / 'config.json').read_text() == record
  assert {'key': 'learning_rate', 'recorded': 0.005, 'given': 0.001,
          'kind': 'training'} in _history(workdir)[-1]['changes']
  # The accepted change stays: a later start without the flag trains with 0.001 (and
  # asking for 0.005 again is a change back that needs allowing).
  later = run_config.resolve(harness.config(), str(workdir), trains=True,
                             request=run_config.Request(keys=frozenset()))
  assert later.config.learning_rate == 0.001 and later.config.model.attention == 'local'


def test_a_start_that_saved_no_checkpoint_is_replaced(harness, trained, tmp_path):
  workdir = _copy(trained, tmp_path)
  old = json.loads((workdir / 'config.json').read_text())
  shutil.rmtree(workdir / 'checkpoints')
  resolved = run_config.resolve(harness.config({'model.d': 1}), str(workdir), trains=True)
  assert resolved.new_start and resolved.replaced == old
  assert resolved.config.model.d == 1


def test_inspect_uses_the_recorded_model(trained, tmp_path):
  workdir = _copy(trained, tmp_path)
  paths = attention_maps.write_maps(tiny.get_config(), str(workdir),
                                    run_config.Request(keys=frozenset()))
  mask = np.load(paths['npz'])['layer0_head0']
  assert mask[5, 4] and mask[5, 5] and not mask[5, 3]  # Window 2, not dense.


def test_main_allows_a_change_named_by_the_flag(harness, trained, tmp_path):
  workdir = _copy(trained, tmp_path)
  # A resume at the last step: it restores, records and stops (no step to compile).
  command = harness.main_command(workdir, {**TRAINED, 'learning_rate': 0.002})
  proc = subprocess.run([*command, '--allow_config_change=learning_rate'], env=harness.env(),
                        cwd=harness.repo, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert 'changing the recorded run' in proc.stderr
  resume = _history(workdir)[-1]
  assert resume['allowed'] == ['learning_rate'] and resume['step'] == 4
  assert resume['changes'] == [{'key': 'learning_rate', 'recorded': 0.005, 'given': 0.002,
                                'kind': 'training'}]


def test_an_allowed_change_that_cannot_restore_records_nothing(harness, trained, tmp_path):
  workdir = _copy(trained, tmp_path)
  record = (workdir / 'config.json').read_text()
  history = (workdir / 'config_history.jsonl').read_text()
  request = run_config.Request(keys=frozenset({'model.d'}), allow=('model',))
  with pytest.raises(train.checkpoints.CheckpointError, match='different model configuration'):
    train.train_and_evaluate(harness.config({**TRAINED, 'model.d': 1}), str(workdir), request)
  assert (workdir / 'config.json').read_text() == record
  assert (workdir / 'config_history.jsonl').read_text() == history


def test_clipping_turned_off_and_on_again_resumes_when_allowed(harness, trained, tmp_path):
  # Issue 35: the optimizer state's layout followed the clipping (opt_state.0.0.count: not in
  # the checkpoint), so the NaN message's advice to enable clipping could not be taken.
  workdir = _copy(trained, tmp_path)
  keys = frozenset({'total_steps', 'clip_grad_norm'})
  for steps, clip in ((5, 0.0), (6, 1.0)):
    config = harness.config({**TRAINED, 'total_steps': steps, 'clip_grad_norm': clip})
    state = train.train_and_evaluate(config, str(workdir),
                                     run_config.Request(keys=keys, allow=('clip_grad_norm',)))
    assert int(state.step) == steps
  assert harness.step_dirs(workdir)[-2:] == [5, 6]
  assert [[c for c in line['changes'] if c['key'] == 'clip_grad_norm']
          for line in _history(workdir)[-2:]] == [
      [{'key': 'clip_grad_norm', 'recorded': 1.0, 'given': 0.0, 'kind': 'training'}],
      [{'key': 'clip_grad_norm', 'recorded': 0.0, 'given': 1.0, 'kind': 'training'}]]


def test_an_unclipped_checkpoint_of_the_old_optimizer_layout_resumes_exactly(harness, tmp_path):
  # Before the clip slot was always in the chain, a run without clipping saved its Adam
  # moments as opt_state.0.*: such a checkpoint resumes with its moments.
  make = lambda steps: harness.config({'total_steps': steps, 'checkpoint_every_steps': 2,
                                       'clip_grad_norm': 0.0})
  straight = train.train_and_evaluate(make(3), str(tmp_path / 'straight'))
  setup = assembly.build(make(2))
  ckpt = train.checkpoints.Checkpointer(str(tmp_path / 'straight'), async_save=False)
  try:
    saved = ckpt.restore(setup.abstract_state, step=2)
  finally:
    ckpt.close()
  old = train.checkpoints.Checkpointer(str(tmp_path / 'old'), async_save=False)
  try:
    old.save(2, saved.replace(opt_state=optimizer.without_clip_slot(saved.opt_state)))
  finally:
    old.close()
  resumed = train.train_and_evaluate(make(3), str(tmp_path / 'old'))
  assert int(resumed.step) == 3
  assert harness.max_abs_diff(straight.params, resumed.params) == 0.0


def test_the_recorded_mesh_is_fitted_to_the_devices_of_the_effective_config(harness, tmp_path):
  # --mode=compile fits the record's mesh to the topology it compiles for, which the
  # effective config names: resolve asks for the devices with that config.
  record = harness.config({'mesh.data': 1, 'mesh.fsdp': 2, 'compile_topology': 'v5e:2x2'})
  (tmp_path / 'config.json').write_text(record.to_json_best_effort())
  asked = []

  def devices(config):
    asked.append(config.compile_topology)
    return jax.devices()[:1]

  resolved = run_config.resolve(harness.config(), str(tmp_path), trains=False,
                                request=run_config.Request(keys=frozenset()), devices=devices)
  assert asked == ['v5e:2x2']
  assert dict(resolved.config.mesh) == {'data': -1, 'fsdp': 1, 'tensor': 1, 'dcn_data': 1,
                                        'dcn_fsdp': 1}
  asked_mesh = run_config.Request(keys=frozenset({'mesh.fsdp'}))
  resolved = run_config.resolve(harness.config({'mesh.fsdp': 4}), str(tmp_path), trains=False,
                                request=asked_mesh, devices=devices)
  assert resolved.config.mesh.fsdp == 4 and asked == ['v5e:2x2']  # Asked for: kept as given.
