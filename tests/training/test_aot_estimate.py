"""The compile report's slice names and its time estimate (training/aot.py): pure arithmetic."""

import pytest

from training import aot


@pytest.mark.parametrize('topology,name', [('v5e:2x2', 'v5e-4'), ('v5e:4x4', 'v5e-16'),
                                           ('v5e:2x4', 'v5e-8'), ('v4:2x2x1', 'v4-8'),
                                           ('v4:2x2x4', 'v4-32'), ('v5p:2x2x1', 'v5p-8'),
                                           ('v6e:2x2', 'v6e-4')])
def test_slice_names_count_chips_on_v5e_and_v6e_and_cores_on_v4_and_v5p(topology, name):
  assert aot.slice_name(topology) == name


def _report(device_kind: str, model_flops: float, total_steps: int) -> aot.Report:
  return aot.Report(topology='t', num_slices=1, device_kind=device_kind, chips=4,
                    hbm_bytes=16 * aot.GiB, mesh={'data': 4}, param_bytes=0, opt_state_bytes=0,
                    model_flops=model_flops, steps={}, model={}, total_steps=total_steps)


def test_the_estimate_is_the_model_flops_over_the_assumed_share_of_the_peak():
  # One step a second on a v5e chip (197 TFLOP/s) at 40%: 86,400 steps a day.
  report = _report('TPU v5 lite', 197e12 * 0.4, 172_800)
  estimate = report.estimate()
  assert estimate['steps_per_day'] == pytest.approx(86_400)
  assert estimate['days'] == pytest.approx(2.0)
  assert report.estimate(mfu=0.2)['steps_per_day'] == pytest.approx(43_200)
  assert _report('TPU v5', 459e12 * 0.4, 0).estimate()['days'] is None  # v5p; no step count.
  assert _report('some accelerator', 1e12, 10).estimate() is None
  assert report.to_json()['estimate']['days'] == pytest.approx(2.0)
