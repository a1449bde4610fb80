"""--mode=compile (training/aot.py): the run's programs compiled for a TPU slice from this host.

The tiny model (configs/tiny.py, d=2, the 'xla' attention path) is compiled for v5e:2x2 (4
chips of 16 GiB) by the real TPU compiler (libtpu), without a TPU and without reading data.
The fsdp=4 run of the mode compiles once for the module (train, eval and decoding programs:
about 10 s on 2 cores); the other tests lower, compile one step, or need no compiler.
"""

import dataclasses
import importlib.util
import json
import os
import re

import pytest

from analysis import chips, compile_report, program_stats, roofline
from configs import tiny
from training import aot, assembly, evaluation, steps, tpu_topology, train

TOPOLOGY = 'v5e:2x2'

needs_libtpu = pytest.mark.skipif(importlib.util.find_spec('libtpu') is None,
                                  reason="compiling for a TPU needs libtpu (pip install "
                                  "'jax[tpu]', Linux x86-64)")

# Rows no v5e chip can hold for the tiny model's train step (the compiler finds about 200 GiB
# of temporaries per chip); the program is no larger than with 16 rows, so it compiles fast.
HUGE_BATCH = 1 << 21

# C4 rows of 32 tokens (the data is never read: model.vocab_size is given), fsdp over 4 chips.
C4 = {'data.name': 'c4', 'seq_len': 32, 'model.vocab_size': 256, 'mesh.data': 1, 'mesh.fsdp': 4}


def _config(**overrides):
  """configs/tiny.py on the xla attention path, for TOPOLOGY."""
  config = tiny.get_config()
  config.model.attention_impl = 'xla'  # 'auto' picks splash on TPU (not partitionable yet).
  config.batch_size = 16
  config.peak_tflops_per_device = 1.0
  config.compile_topology = TOPOLOGY
  config.update_from_flattened_dict(overrides)
  return config


@pytest.fixture(scope='module')
def compiled(tmp_path_factory):
  """(report JSON, Report, workdir, data_dir) of the mode on C4 (its data_dir does not
  exist: nothing may be read) with the parameters sharded over the 4 chips (fsdp)."""
  if importlib.util.find_spec('libtpu') is None:
    pytest.skip('needs libtpu')
  root = tmp_path_factory.mktemp('compile')
  workdir, data_dir = root / 'run', root / 'no_such_data'
  config = _config(**C4, **{'data.data_dir': str(data_dir)})
  report = aot.run(config, str(workdir))
  path = workdir / compile_report.report_filename(TOPOLOGY)
  return json.loads(path.read_text()), report, workdir, data_dir


@needs_libtpu
def test_the_report_is_the_only_file_written_and_no_data_is_read(compiled):
  _, _, workdir, data_dir = compiled
  assert os.listdir(workdir) == ['compile_v5e_2x2.json']
  assert not data_dir.exists()


@needs_libtpu
def test_per_chip_memory_of_the_fsdp_train_step(compiled):
  js, report, _, _ = compiled
  assert (js['topology'], js['chips'], js['device_kind']) == (TOPOLOGY, 4, 'TPU v5 lite')
  assert js['hbm_bytes'] == 16 * program_stats.GiB
  assert js['mesh'] == {'data': 1, 'fsdp': 4, 'tensor': 1}
  per_chip = js['per_chip']
  whole = report.model['params'] * 4  # float32 parameters, unsharded.
  # fsdp splits the matrices 4 ways; norms and other small vectors stay whole on each chip.
  assert whole / 4 <= per_chip['param_bytes'] < whole / 2
  # AdamW keeps two moments per parameter, sharded like the parameters.
  assert 2 * per_chip['param_bytes'] <= per_chip['opt_state_bytes'] < 2.2 * per_chip['param_bytes']
  train_memory = js['steps']['train']['memory']
  assert train_memory['generated_code_bytes'] > 0 and train_memory['temp_bytes'] >= 0
  # The donated state is an argument and, in place, the output.
  assert train_memory['argument_bytes'] >= per_chip['param_bytes'] + per_chip['opt_state_bytes']
  assert train_memory['alias_bytes'] >= per_chip['param_bytes'] + per_chip['opt_state_bytes']
  assert per_chip['train_total_bytes'] == train_memory['total_bytes'] == (
      train_memory['argument_bytes'] + train_memory['output_bytes']
      - train_memory['alias_bytes'] + train_memory['temp_bytes']
      + train_memory['generated_code_bytes'])
  assert 0 < per_chip['train_total_bytes'] < js['hbm_bytes']
  assert js['fits'] is True and js['steps']['train']['fits'] is True


@needs_libtpu
def test_flops_collectives_and_compile_times(compiled):
  js, report, _, _ = compiled
  per_chip = js['per_chip']
  # The model's own count for the 16 x 32 tokens of a step, split over the 4 chips.
  setup = assembly.build(_config(**C4), devices=tpu_topology.topology_devices(TOPOLOGY),
                         data=False)
  assert report.model['params'] == setup.model_config.num_params()
  assert per_chip['model_flops_per_step'] == pytest.approx(
      setup.model_config.train_flops_per_token(32) * 16 * 32 / 4)
  assert per_chip['xla_train_flops_per_step'] > 0
  for name in aot.STEPS:
    step = js['steps'][name]
    assert step['skipped'] == '' and step['out_of_memory'] == '', name
    assert step['compile_seconds'] > 0 and step['lower_seconds'] > 0, name
    assert step['xla_flops'] > 0, name
  # fsdp gathers each layer's parameters and reduce-scatters (or all-reduces) the gradients.
  train_collectives = js['steps']['train']['collectives']
  assert set(train_collectives) == set(program_stats.COLLECTIVES)
  assert train_collectives['all-gather']['count'] > 0
  assert train_collectives['all-gather']['bytes'] > 0
  assert (train_collectives['reduce-scatter']['count']
          + train_collectives['all-reduce']['count']) > 0
  assert js['steps']['train']['collective_bytes'] == sum(
      c['bytes'] for c in train_collectives.values())
  assert 'speed is not measured' in js['note']


@needs_libtpu
def test_the_step_time_estimate_is_a_roofline_the_chip_could_reach(compiled):
  """The train step's time on a v5e chip: the FLOPs counted with the layer loop's trip count
  (the tiny model's stack is a scan: XLA's own count sees one layer), and a time no shorter
  than the chip's peak FLOP/s and HBM bandwidth allow for them."""
  js, report, _, _ = compiled
  chip = chips.chip_for('TPU v5 lite')
  train = js['steps']['train']
  assert train['flops'] > train['xla_flops']
  assert js['per_chip']['train_flops_per_step'] == train['flops']
  est = train['estimate']
  assert est['flops'] == train['flops'] and est['unknown_loops'] == 0
  assert est['step_s'] >= max(est['flops'] / chip.peak('f32'), est['bytes'] / chip.hbm_bandwidth)
  assert est['step_s'] == pytest.approx(max(est['kernels_s'], est['collectives_s'])
                                        + est['overhead_s'])
  assert est['collectives_s'] > 0  # fsdp gathers and reduce-scatters.
  estimate = js['estimate']
  assert estimate['bound'] in roofline.BOUNDS and estimate['chip'] == 'v5e'
  assert estimate['steps_per_day'] == pytest.approx(86400 / est['step_s'])
  assert 0 < estimate['mfu'] < 1
  for name in ('eval', 'decode'):
    assert js['steps'][name]['estimate']['step_s'] > 0, name
  text = report.table()
  assert 'estimate of the train step on one v5e chip (roofline, not measured)' in text
  assert f'bound: {estimate["bound"]}' in text and 'steps/day, MFU' in text


@needs_libtpu
def test_the_table_names_each_program(compiled, capsys):
  _, report, _, _ = compiled
  print(report.table())
  out = capsys.readouterr().out
  for name in aot.STEPS:
    assert f'\n{name} ' in out
  assert 'TPU v5 lite' in out and 'speed is not measured' in out


@needs_libtpu
def test_tensor_parallel_train_step_on_a_synthetic_task():
  """The synthetic task's shapes come from the task (no data is read either way); tensor=2
  splits heads, MLP and vocabulary: activations are all-reduced inside the step."""
  config = _config(**{'mesh.data': -1, 'mesh.tensor': 2})
  setup = assembly.build(config, devices=tpu_topology.topology_devices(TOPOLOGY),
                         data=False)
  assert setup.data is None
  assert setup.seq_len == 10  # 2 x 4 assignments + 2.
  assert dict(setup.mesh.shape) == {'data': 2, 'fsdp': 1, 'tensor': 2}
  report, compiled = aot.report_for(setup, ('train',), topology=TOPOLOGY)
  assert compiled['train'] is not None and list(report.steps) == ['train']
  whole = setup.model_config.num_params() * 4
  assert whole / 2 <= report.param_bytes < whole  # Embeddings and norms are not split.
  assert report.steps['train'].collectives['all-reduce']['count'] > 0
  assert report.fits('train') is True


@needs_libtpu
def test_an_oversized_step_is_described_with_what_to_try(compiled):
  _, report, _, _ = compiled
  assert compile_report.does_not_fit(report) == ''
  small = dataclasses.replace(report, hbm_bytes=1 << 20)  # A 1 MiB chip.
  message = compile_report.does_not_fit(small)
  assert message.startswith('the train step does not fit one chip of v5e:2x2 (TPU v5 lite, '
                            '1.00 MiB HBM): it needs ')
  assert 'more than the HBM' in message and "the compiler's estimate" in message
  for advice in ('batch_size', "model.remat='full'", 'grad_accum_steps', 'mesh.fsdp (now 4',
                 'larger slice'):
    assert advice in message, advice


@needs_libtpu
def test_a_tpu_run_checks_the_fit_before_anything_starts(monkeypatch, tmp_path):
  """train_and_evaluate on a TPU mesh (here the topology's, through build) fails with the
  mode's message before restoring, initializing or compiling anything else."""
  devices = tpu_topology.topology_devices(TOPOLOGY)
  build = assembly.build
  monkeypatch.setattr(assembly, 'build', lambda config, **kw: build(config, devices=devices, **kw))

  def fail(*args, **kwargs):
    del args, kwargs
    pytest.fail('the run started before the fit check failed')

  monkeypatch.setattr(assembly, 'init_state', fail)
  monkeypatch.setattr(steps, 'jit_eval_step', fail)
  monkeypatch.setattr(evaluation, 'score', fail)
  monkeypatch.setattr(train, '_train_loop', fail)
  monkeypatch.setattr(train.checkpoints, 'Checkpointer', fail)
  config = _config(**{'batch_size': HUGE_BATCH, 'mesh.data': 1, 'mesh.fsdp': 4})
  with pytest.raises(ValueError, match=r'the train step does not fit one TPU v5 lite chip '
                     r'\(16.00 GiB HBM\) of this 4-chip slice: the TPU compiler needs .* GiB '
                     r'where .* GiB is usable'):
    train.train_and_evaluate(config, str(tmp_path))
  assert not (tmp_path / 'checkpoints').exists()
  assert not (tmp_path / 'config.json').exists()


@needs_libtpu
def test_main_exits_1_with_one_error_line_when_the_step_cannot_fit(harness, tmp_path):
  """`python main.py --mode=compile` on a CPU host (JAX_PLATFORMS=cpu, as such a user sets it):
  the one error line is the mode's, and nothing of libtpu's start-up reaches the terminal (its
  TPU_ACCELERATOR_TYPE and TPU_WORKER_HOSTNAMES warnings and 'INVALID_ARGUMENT ... unexpected
  worker hostname', which a user reads as a failure)."""
  workdir = tmp_path / 'run'
  proc = harness.run_main(workdir, {
      'batch_size': HUGE_BATCH, 'model.attention_impl': 'xla', 'mesh.data': 1, 'mesh.fsdp': 4,
      'compile_topology': TOPOLOGY}, mode='compile')
  assert proc.returncode == 1, proc.stderr[-3000:]
  assert 'Traceback' not in proc.stderr
  errors = [line for line in proc.stderr.splitlines() if line.startswith('error: ')]
  assert len(errors) == 1, proc.stderr[-3000:]
  assert errors[0].startswith('error: the train step does not fit one chip of v5e:2x2'), errors
  assert 'Try a smaller batch_size' in errors[0]
  # The report is written first, saying why.
  js = json.loads((workdir / 'compile_v5e_2x2.json').read_text())
  assert js['fits'] is False
  assert js['steps']['train']['out_of_memory'].startswith('RESOURCE_EXHAUSTED')
  assert 'does NOT fit' in proc.stdout
  assert os.listdir(workdir) == ['compile_v5e_2x2.json']
  assert not _libtpu_noise(proc.stdout + proc.stderr), proc.stderr[-3000:]


# What libtpu printed when it started on a host that is not a Cloud TPU VM
# (tpu_topology.LIBTPU_NOISE holds it back): warnings naming these variables, and C++ log lines
# (file.cc:line) at warning, error or fatal level. The mode's own Python log lines
# (file.py:line) are not noise.
_NOISE = ('TPU_ACCELERATOR_TYPE', 'TPU_WORKER_HOSTNAMES', 'INVALID_ARGUMENT',
          'Failed to find host bounds', 'Source Location Trace')


def _libtpu_noise(output: str) -> list[str]:
  return [line for line in output.splitlines()
          if any(n in line for n in _NOISE) or re.match(r'^[EWF]\d{4} [^\]]*\.cc:\d+\]', line)]


def test_no_topology_is_a_clear_error(tmp_path):
  with pytest.raises(ValueError, match=r'set --config.compile_topology to the TPU slice'):
    aot.run(_config(compile_topology=''), str(tmp_path / 'run'))
  assert not (tmp_path / 'run').exists()


def test_without_libtpu_the_mode_says_what_to_install(monkeypatch, tmp_path):
  monkeypatch.setattr(tpu_topology.importlib.util, 'find_spec',
                      lambda name, *a: None if name == 'libtpu' else importlib.util.find_spec(
                          name, *a))
  with pytest.raises(ValueError, match=r"pip install 'jax\[tpu\]' \(Linux x86-64 only"):
    aot.run(_config(), str(tmp_path / 'run'))


@needs_libtpu
def test_an_unknown_topology_is_a_clear_error():
  with pytest.raises(ValueError, match=r"libtpu cannot describe the TPU topology 'v5e:3x5x7'"):
    tpu_topology.topology_devices('v5e:3x5x7')
  with pytest.raises(ValueError, match=r'compile_topology_num_slices must be an integer >= 1'):
    tpu_topology.topology_devices(TOPOLOGY, 0)


def test_text_data_without_a_vocabulary_size_is_a_clear_error():
  config = _config(**{'data.name': 'c4', 'data.data_dir': '/no/such/dir', 'seq_len': 32,
                      'model.vocab_size': 0})
  with pytest.raises(ValueError, match=r'set --config.model.vocab_size'):
    assembly.build(config, data=False)


@needs_libtpu
def test_topologies_have_one_device_per_chip_and_known_hbm():
  # v4 and v5p chips are megacore: one device of two TensorCores, as on the real slice.
  for topology, n in (('v5e:2x2', 4), ('v4:2x2x4', 16), ('v5p:2x2x1', 4), ('v6e:2x2', 4)):
    devices = tpu_topology.topology_devices(topology)
    assert len(devices) == n, topology
    kind = devices[0].device_kind
    assert program_stats.hbm_bytes(devices[0]) == program_stats.HBM_BYTES[kind], topology
  two = tpu_topology.topology_devices(TOPOLOGY, 2)
  assert len(two) == 8 and sorted({d.slice_index for d in two}) == [0, 1]


def test_report_file_names():
  assert compile_report.report_filename('v5e:2x2') == 'compile_v5e_2x2.json'
  assert compile_report.report_filename('v4:2x2x4', 2) == 'compile_v4_2x2x4_2slices.json'


# Compiled TPU HLO as the compiler prints it (shortened): an async all-gather pair, an
# all-reduce in the entry and one inside the reduce-scatter fusion, an all-to-all and a
# collective-permute pair.
_HLO = """\
HloModule jit_train_step, entry_computation_layout={(f32[8]{0})->f32[8]{0}}

%all-reduce-scatter.4 (input.4: f32[128,128]) -> f32[32,128] {
  %input.4 = f32[128,128]{0,1:T(8,128)} parameter(0)
  %all-reduce.38 = f32[128,128]{1,0:T(8,128)} all-reduce(%input.4), channel_id=47, replica_groups={{0,1,2,3}}, to_apply=%add.9.clone
  ROOT %dynamic-slice.134 = f32[32,128]{1,0:T(8,128)S(1)} dynamic-slice(%all-reduce.38, %m, %c), dynamic_slice_sizes={32,128}
}

ENTRY %main.42_spmd (param.4: bf16[32,128]) -> f32[] {
  %param.4 = bf16[32,128]{1,0} parameter(0)
  %all-gather-start = (bf16[32,128]{1,0}, bf16[128,128]{1,0:T(8,128)(2,1)}) all-gather-start(%param.4), channel_id=1, dimensions={0}
  %all-gather-done = bf16[128,128]{1,0} all-gather-done(%all-gather-start)
  %fusion.8 = f32[32,128]{1,0:T(8,128)S(1)} fusion(%x), kind=kCustom, calls=%all-reduce-scatter.4
  %all-reduce.12 = (f32[]{:T(128)}, f32[2,64]{1,0}) all-reduce(%a, %b), channel_id=29, to_apply=%region_0.0.clone
  %all-to-all = f32[4,1,1280]{2,1,0:T(1,128)S(1)} all-to-all(%reshape.600), channel_id=34, dimensions={0}
  %collective-permute-start = (f32[16]{0}, f32[16]{0}, u32[]{:S(2)}, u32[]{:S(2)}) collective-permute-start(%p), source_target_pairs={{0,1},{1,0}}
  %collective-permute-done = f32[16]{0} collective-permute-done(%collective-permute-start)
  ROOT %r = f32[] constant(0)
}
"""


def test_collectives_are_counted_once_with_their_result_bytes():
  found = program_stats.collectives(_HLO)
  assert found == {
      'all-gather': {'count': 1, 'bytes': 128 * 128 * 2},         # The gathered result.
      'reduce-scatter': {'count': 1, 'bytes': 32 * 128 * 4},      # The fusion's shard.
      'all-reduce': {'count': 1, 'bytes': 4 + 2 * 64 * 4},        # A combined all-reduce.
      'all-to-all': {'count': 1, 'bytes': 4 * 1280 * 4},
      'collective-permute': {'count': 1, 'bytes': 16 * 4},        # The received buffer.
  }
