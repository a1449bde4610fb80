"""A bad config or workdir is a clear error before any compute.

In-process tests call train.train_and_evaluate with every compute entry point replaced by a
function that fails the test, so the error must come from the up-front checks (check_workdir,
build); one test goes through main.py for the exit code and the stderr line.
"""

import subprocess
import textwrap

import pytest

from models import attention, stacks
from training import assembly, evaluation, run_config, train

_BAD_CONFIGS = {
    'unknown_attention': (
        {'model.attention': 'no_such_attention'},
        r"unknown attention variant 'no_such_attention'; known attention variants: .*dense"),
    'd_model_not_divisible_by_heads': (
        {'model.d_model': 100, 'model.n_heads': 3},
        r'model\.d_model=100 is not divisible by model\.n_heads=3'),
    'sequence_longer_than_position_table': (
        # The task's inputs are 2 * 8 + 2 = 18 tokens long.
        {'model.max_len': 16},
        r'sequence length 18 is longer than the position table \(model\.max_len=16\)'),
    'batch_not_divisible_by_grad_accum': (
        {'batch_size': 10, 'grad_accum_steps': 3},
        r'batch_size=10 is not divisible by grad_accum_steps=3'),
    'grad_accum_zero': ({'grad_accum_steps': 0}, r'grad_accum_steps must be an integer >= 1, got 0'),
    'grad_accum_negative': ({'grad_accum_steps': -1},
                            r'grad_accum_steps must be an integer >= 1, got -1'),
    # Numbers: finite, and in range, each named (issue 35: a NaN learning rate trained).
    'learning_rate_nan': ({'learning_rate': float('nan')},
                          r'^learning_rate must be a finite number, got nan$'),
    'nested_float_inf': ({'model.attention_options.adaptive_span.penalty': float('inf')},
                         r'^model\.attention_options\.adaptive_span\.penalty must be a finite '
                         r'number'),
    'warmup_negative': ({'warmup_steps': -5}, r'^warmup_steps must be an integer >= 0, got -5$'),
    'eval_every_negative': ({'eval_every_steps': -1},
                            r'^eval_every_steps must be an integer >= 0 \(0 = no periodic '
                            r'evaluation\), got -1$'),
    'adam_b2_one': ({'adam_b2': 1.0}, r'^adam_b2 must be a finite number in \[0, 1\), got 1\.0$'),
    'total_steps_zero': ({'total_steps': 0}, r'^total_steps must be an integer >= 1, got 0$'),
    'unknown_data_name': (
        {'data.name': 'no_such_task'},
        r"unknown data\.name 'no_such_task'; known: c4, tfds, local_text, copy, duplication, "
        r'parity, variable_assignment'),
}


@pytest.mark.parametrize('case', sorted(_BAD_CONFIGS))
def test_bad_config_fails_in_build(harness, no_compute, tmp_path, case):
  extra, message = _BAD_CONFIGS[case]
  config = harness.config({**extra, 'peak_tflops_per_device': 0.0})  # Table or measurement.
  with pytest.raises(ValueError, match=message):
    assembly.build(config)
  with pytest.raises(ValueError, match=message):
    train.train_and_evaluate(config, str(tmp_path / 'train'))
  with pytest.raises(ValueError, match=message):
    evaluation.evaluate_checkpoint(config, str(tmp_path / 'eval'))
  assert not (tmp_path / 'train' / 'checkpoints').exists()
  assert not (tmp_path / 'train' / 'config.json').exists()


def test_main_reports_unknown_attention_and_exits_nonzero(harness, tmp_path):
  workdir = tmp_path / 'run'
  proc = harness.run_main(workdir, {'model.attention': 'no_such_attention'})
  assert proc.returncode != 0
  assert 'Traceback' not in proc.stderr
  errors = [line for line in proc.stderr.splitlines() if line.startswith('error: ')]
  assert len(errors) == 1, proc.stderr[-3000:]
  assert errors[0].startswith("error: unknown attention variant 'no_such_attention'; "), errors
  known = [name.strip() for name in errors[0].split('known attention variants:')[1].split(',')]
  assert 'dense' in known, errors
  assert not (workdir / 'checkpoints').exists()


def test_eval_without_checkpoint(harness, no_compute, tmp_path):
  with pytest.raises(FileNotFoundError, match='no checkpoint found in'):
    evaluation.evaluate_checkpoint(harness.config(), str(tmp_path))


def _unwritable_workdirs(tmp_path):
  """Paths no process can create a directory at, even as root (a regular file is in the way)."""
  blocker = tmp_path / 'a_file'
  blocker.write_text('not a directory')
  return {'parent_is_a_file': blocker / 'workdir', 'workdir_is_a_file': blocker}


@pytest.mark.parametrize('kind', ['parent_is_a_file', 'workdir_is_a_file'])
def test_unwritable_workdir(harness, no_compute, tmp_path, kind):
  workdir = str(_unwritable_workdirs(tmp_path)[kind])
  config = harness.config()
  for fn in (assembly.check_workdir, lambda w: train.train_and_evaluate(config, w),
             lambda w: evaluation.evaluate_checkpoint(config, w)):
    with pytest.raises(PermissionError, match='is not writable') as info:
      fn(workdir)
    assert repr(workdir) in str(info.value)
  assert (tmp_path / 'a_file').read_text() == 'not a directory'


def test_main_reports_unwritable_workdir(harness, tmp_path):
  workdir = _unwritable_workdirs(tmp_path)['parent_is_a_file']
  proc = harness.run_main(workdir)
  assert proc.returncode != 0
  assert 'Traceback' not in proc.stderr
  errors = [line for line in proc.stderr.splitlines() if line.startswith('error: ')]
  assert len(errors) == 1 and 'is not writable' in errors[0], proc.stderr[-3000:]


_INDIVISIBLE_SCRIPT = textwrap.dedent('''\
    """The tiny recipe on a tensor=2 mesh: an explicit 25-id vocabulary cannot split in 2;
    the vocabulary derived from the data (model.vocab_size=0) is padded (to 128, whatever the
    mesh) so that it does."""
    import jax

    from configs import tiny
    from training import assembly

    config = tiny.get_config()
    config.peak_tflops_per_device = 1.0
    config.mesh.data, config.mesh.fsdp, config.mesh.tensor = 1, 1, 2
    assert jax.device_count() == 2
    setup = assembly.build(config)
    assembly.init_state(setup, 0)
    print('PADDED_OK', setup.model_config.vocab_size)
    config.model.vocab_size = 25
    try:
      setup = assembly.build(config)
    except ValueError as e:
      print('BUILD_ERROR', e)
    else:
      try:
        assembly.init_state(setup, 0)
      except Exception as e:  # pylint: disable=broad-except
        print('INIT_ERROR', type(e).__name__, e)
      else:
        print('OK')
    ''')


def test_parameter_not_divisible_by_mesh_axis_fails_in_build(harness, tmp_path):
  """tensor=2 with the 25-id Variable Assignment vocabulary (logits kernel (128, 25))."""
  script = tmp_path / 'indivisible.py'
  script.write_text(_INDIVISIBLE_SCRIPT)
  proc = harness.run_script(script, devices=2)
  assert proc.returncode == 0, proc.stderr[-5000:]
  padded, out = proc.stdout.strip().splitlines()[-2:]
  assert padded == 'PADDED_OK 128', padded
  assert out.startswith('BUILD_ERROR'), (
      'assembly.build accepted a mesh that cannot hold the parameters; the error only comes '
      f'later, from compute: {out}')
  # The message names the parameter (or its vocab axis) and the mesh axis.
  assert 'tensor' in out, out
  assert any(name in out for name in ('vocab', 'logits_kernel', 'token_embed')), out


@pytest.mark.parametrize('flag,message', [
    ('--config.no_such_field=1', "KeyError: 'no_such_field'"),
    ('--config.total_steps=abc', "invalid literal for int() with base 10: 'abc'"),
    ('--no_such_flag', "Unknown command line flag 'no_such_flag'"),
    # absl's message names the flag; the bare reason did not (issue 35).
    ('--mode=bogus', 'flag --mode=bogus: value should be one of <train|eval'),
    ('--num_processes=x', "flag --num_processes=x: invalid literal for int() with base 10: 'x'"),
    # The variant's options are named, not only "KeyError: 'bogus'" (issue 69).
    ('--config.model.attention_options.selective.bogus=3',
     "selective has no option 'bogus'; its options: budgets, lmem_eps"),
])
def test_bad_command_line_is_one_line_and_exit_1(harness, tmp_path, flag, message):
  proc = subprocess.run(harness.main_command(tmp_path / 'run') + [flag], env=harness.env(),
                        cwd=harness.repo, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 1
  assert 'Traceback' not in proc.stderr, proc.stderr[-3000:]
  errors = [line for line in proc.stderr.splitlines() if line.startswith('error: ')]
  assert len(errors) == 1 and message in errors[0], proc.stderr[-3000:]
  assert not (tmp_path / 'run').exists()


_OUT_OF_MEMORY = '''
import runpy, sys
import jax
from training import modes

def run_out_of_memory(*args):
  raise jax.errors.JaxRuntimeError(
      'RESOURCE_EXHAUSTED: Out of memory allocating 53626900560 bytes.')

modes.get = lambda mode: run_out_of_memory
sys.argv = ['main.py', *sys.argv[1:]]
runpy.run_path('main.py', run_name='__main__')
'''


def test_out_of_memory_is_one_line_naming_the_levers_and_the_recipes_slice(harness, tmp_path):
  """A paper recipe run on a laptop ran out of host memory at its first step with a traceback;
  the error is one line naming the devices, the recipe's slice and what to change."""
  script = tmp_path / 'out_of_memory.py'
  script.write_text(_OUT_OF_MEMORY)
  proc = harness.run_script(script, '--config=configs/selective_variable_assignment.py',
                            f'--workdir={tmp_path / "run"}')
  assert proc.returncode == 1
  assert 'Traceback' not in proc.stderr, proc.stderr[-3000:]
  errors = [line for line in proc.stderr.splitlines() if line.startswith('error: ')]
  assert len(errors) == 1, proc.stderr[-3000:]
  assert errors[0].startswith('error: out of memory on 1 cpu device (RESOURCE_EXHAUSTED: Out of '
                              "memory allocating 53626900560 bytes.); this recipe is sized for "
                              "the TPU slice 'v5e:2x2'"), errors[0]
  for lever in ('config.batch_size', 'config.model.remat=full', 'config.mesh', '--mode=compile'):
    assert lever in errors[0], errors[0]


def test_an_option_no_component_declares_is_named_with_the_ones_its_group_has():
  message = run_config.unknown_option_message([
      'model.attention_options.local.windw', 'model.attention_options.nope.x',
      'model.stack_options.stepz', 'model.attention_options.local.window', 'total_steps'])
  assert message == '; '.join([
      "--config.model.attention_options.local.windw: local has no option 'windw'; its "
      f"options: {', '.join(sorted(attention.options('local')))}",
      "--config.model.attention_options.nope.x: 'nope' is no registered attention variant "
      f"(known: {', '.join(attention.known())})",
      "--config.model.stack_options.stepz: no registered stack has the option 'stepz'; "
      f"--config.model.stack_options has: {', '.join(sorted(stacks.STACKS.options()))}"])
