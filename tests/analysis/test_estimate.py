"""The compile report's slice names and its step-time estimate (configs.slice_name,
training/tpu_topology.py, analysis/compile_report.py, analysis/roofline.py, analysis/chips.py): pure arithmetic, no
compiler."""

import pytest

import configs
from analysis import chips, compile_report, hlo_cost, program_stats, roofline
from training import tpu_topology


@pytest.mark.parametrize('topology,name', [('v5e:2x2', 'v5e-4'), ('v5e:4x4', 'v5e-16'),
                                           ('v5e:2x4', 'v5e-8'), ('v4:2x2x1', 'v4-8'),
                                           ('v4:2x2x4', 'v4-32'), ('v5p:2x2x1', 'v5p-8'),
                                           ('v6e:2x2', 'v6e-4')])
def test_slice_names_count_chips_on_v5e_and_v6e_and_cores_on_v4_and_v5p(topology, name):
  assert configs.slice_name(topology) == name


def test_accelerator_types_name_the_slice_as_cloud_tpu_does():
  assert tpu_topology.accelerator_type('v5e:2x2') == 'v5litepod-4'
  assert tpu_topology.accelerator_type('v4:2x2x4') == 'v4-32'
  assert tpu_topology.accelerator_type('v6e:2x2') == 'v6e-4'


CHIP = chips.Chip(name='test', peak_flops={'bf16': 100e12, 'f32': 100e12, 'int8': 200e12,
                                           'f32_highest': 100e12 / 6},
                  hbm_bytes=16 << 30, hbm_bandwidth=1e12, ici_bandwidth=1e11,
                  dcn_bandwidth=1e10, step_overhead_s=1e-4, kernel_overhead_s=1e-6,
                  collective_latency_s=1e-5)


def _kernel(flops=0.0, nbytes=0.0, times=1.0, klass='bf16'):
  return hlo_cost.Kernel('k', 'fusion', {klass: flops} if flops else {}, nbytes, times)


def test_each_kernel_takes_the_longer_of_its_compute_and_memory_time():
  cost = hlo_cost.Cost(kernels=[
      _kernel(flops=100e12 * 2e-3),                    # 2 ms of compute, no bytes.
      _kernel(flops=100e12 * 1e-3, nbytes=1e12 * 3e-3, times=2),  # Memory-bound: 2 x 3 ms.
  ])
  est = roofline.estimate(cost, CHIP)
  assert est.compute_s == pytest.approx(4e-3) and est.memory_s == pytest.approx(6e-3)
  assert est.kernels_s == pytest.approx(8e-3)  # 2 + 2 x 3: not max(4, 6).
  assert est.compute_bound_s == pytest.approx(2e-3)
  assert est.memory_bound_s == pytest.approx(6e-3)
  assert est.overhead_s == pytest.approx(1e-4 + 3 * 1e-6)
  assert est.step_s == pytest.approx(8e-3 + est.overhead_s)
  assert est.bound == 'memory'
  assert est.steps_per_day == pytest.approx(86400 / est.step_s)
  # Physically possible: never faster than the chip's peak allows for the FLOPs and bytes.
  assert est.step_s >= max(cost.flops / 100e12, cost.bytes / 1e12)
  # float32 at HIGHEST runs at a sixth of the peak.
  slow = roofline.estimate(hlo_cost.Cost(kernels=[_kernel(6e12, klass='f32_highest')]), CHIP)
  assert slow.compute_s == pytest.approx(6e12 / (100e12 / 6))


def test_collectives_overlap_the_kernels_and_cross_slices_over_dcn():
  gather = hlo_cost.Collective('ag', 'all-gather', bytes=4 * 10**9, groups=[[0, 1, 2, 3]],
                               times=1.0)
  across = hlo_cost.Collective('ar', 'all-reduce', bytes=10**8, groups=[[0, 4]], times=2.0)
  cost = hlo_cost.Cost(kernels=[_kernel(flops=100e12 * 1e-3)], collectives=[gather, across])
  est = roofline.estimate(cost, CHIP, devices=8, slice_of=[0, 0, 0, 0, 1, 1, 1, 1])
  ici = 4e9 * 3 / 4 / 1e11 + 1e-5                # Ring all-gather of 4 over ICI.
  dcn = 2 * (2 * 1e8 * 1 / 2 / 1e10 + 1e-5)       # All-reduce of 2 over DCN, twice.
  assert est.collectives_s == pytest.approx(ici + dcn)
  assert est.dcn_s == pytest.approx(dcn)
  assert est.step_s == pytest.approx(ici + dcn + est.overhead_s)  # Longer than the kernel.
  assert est.bound == 'collectives'
  one_slice = roofline.estimate(cost, CHIP, devices=8)
  assert one_slice.dcn_s == 0 and one_slice.collectives_s < est.collectives_s


def test_a_tiny_program_is_bound_by_its_overhead():
  est = roofline.estimate(hlo_cost.Cost(kernels=[_kernel(1e6, 1e3)] * 50), CHIP)
  assert est.bound == 'overhead'


def _report(step_s: float, total_steps: int, device_kind='TPU v5 lite') -> compile_report.Report:
  train = program_stats.StepReport(name='train', estimate={
      'step_s': step_s, 'bound': 'compute', 'compute_s': step_s, 'memory_s': 0.0,
      'collectives_s': 0.0, 'overhead_s': 0.0, 'compute_bound_s': step_s,
      'memory_bound_s': 0.0, 'dcn_s': 0.0, 'flops': 1.0, 'bytes': 1.0,
      'collective_bytes': 0.0, 'launches': 1.0, 'unknown_loops': 0, 'opaque': {}})
  return compile_report.Report(topology='t', num_slices=1, device_kind=device_kind, chips=4,
                    hbm_bytes=16 * program_stats.GiB, mesh={'data': 4}, param_bytes=0,
                    opt_state_bytes=0, model_flops=197e12 * 0.5, steps={'train': train},
                    model={'dtype': 'bfloat16'}, total_steps=total_steps)


def test_the_report_gives_steps_per_day_days_and_mfu_of_the_train_step():
  report = _report(1.0, 172_800)  # One step a second.
  estimate = report.estimate()
  assert estimate['steps_per_day'] == pytest.approx(86_400)
  assert estimate['days'] == pytest.approx(2.0)
  assert estimate['mfu'] == pytest.approx(0.5)  # Half of v5e's 197 TFLOP/s of model FLOPs.
  assert estimate['bound'] == 'compute' and estimate['chip'] == 'v5e'
  assert _report(1.0, 0).estimate()['days'] is None
  assert _report(1.0, 10, 'some accelerator').estimate() is None
  assert report.to_json()['estimate']['days'] == pytest.approx(2.0)
  assert 'bound: compute' in '\n'.join(report._estimate_lines())  # pylint: disable=protected-access


def test_every_chip_has_its_figures_and_their_sources():
  for kind in ('TPU v4', 'TPU v5 lite', 'TPU v5', 'TPU v6 lite', 'NVIDIA H100 80GB HBM3',
               'NVIDIA H200'):
    chip = chips.chip_for(kind)
    assert chip is not None, kind
    assert chip.peak('bf16') > 0 and chip.hbm_bandwidth > 0 and chip.ici_bandwidth > 0
    assert chip.sources['peak_flops'] and chip.sources['hbm'], kind
  assert chips.chip_for('TPU v5 lite').peak('bf16') == 197e12
  assert program_stats.HBM_BYTES['TPU v5 lite'] == 16 * program_stats.GiB
  assert chips.chip_for('cpu') is None
  assert '| v5e (`TPU v5 lite`) | 197 |' in chips.table_markdown()
