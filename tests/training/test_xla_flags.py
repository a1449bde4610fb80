"""XLA:CPU defaults: the collective-safe scheduler with several fake devices, user flags win."""

import os

from training import xla_flags


def _defaults(monkeypatch, flags):
  monkeypatch.setenv('XLA_FLAGS', flags)
  monkeypatch.setattr(xla_flags, '_cpu_has_avx512', lambda: False)
  xla_flags.set_cpu_defaults()
  return os.environ['XLA_FLAGS']


def test_several_fake_devices_get_the_safe_scheduler(monkeypatch):
  out = _defaults(monkeypatch, '--xla_force_host_platform_device_count=8')
  assert xla_flags.FAKE_DEVICES_SAFE_SCHEDULER in out.split()


def test_one_device_keeps_the_default_scheduler(monkeypatch):
  assert 'scheduler' not in _defaults(monkeypatch, '--xla_force_host_platform_device_count=1')
  assert 'scheduler' not in _defaults(monkeypatch, '')


def test_an_explicit_scheduler_setting_wins(monkeypatch):
  given = ('--xla_force_host_platform_device_count=4 '
           '--xla_cpu_enable_concurrency_optimized_scheduler=true')
  assert _defaults(monkeypatch, given) == given


def test_harness_flags_for_fake_devices():
  assert xla_flags.fake_cpu_devices(1) == '--xla_force_host_platform_device_count=1'
  assert xla_flags.fake_cpu_devices(8).split() == [
      '--xla_force_host_platform_device_count=8', xla_flags.FAKE_DEVICES_SAFE_SCHEDULER]
