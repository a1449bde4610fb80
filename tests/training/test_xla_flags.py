"""XLA:CPU defaults: the collective-safe scheduler with several fake devices, user flags win."""

import json
import os

import pytest

from training import xla_flags


def _defaults(monkeypatch, flags, jaxlib=(0, 0, 0)):
  monkeypatch.setenv('XLA_FLAGS', flags)
  monkeypatch.setattr(xla_flags, '_cpu_has_avx512', lambda: False)
  monkeypatch.setattr(xla_flags, '_jaxlib_version', lambda: jaxlib)
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


def test_matmuls_go_to_ynnpack_dot_fusions_on_the_checked_jaxlib_releases(monkeypatch):
  first, past = xla_flags.YNN_DOTS_JAXLIB
  for release in (first, (0, 10, 2)):  # 0.10.2: the release it was measured on.
    assert xla_flags.YNN_DOTS in _defaults(monkeypatch, '', release).split()
  # An XLA that does not know the flag aborts at start: none outside the checked releases.
  for release in ((0, 9, 2), past, ()):
    assert 'ynn' not in _defaults(monkeypatch, '', release)
  # The user's own fusion types win.
  given = '--xla_cpu_experimental_ynn_fusion_type=dot'
  assert _defaults(monkeypatch, given, first) == given
  # None under the tests' fast compile (optimization level 0), where they computed wrong
  # results.
  assert 'ynn' not in _defaults(monkeypatch, xla_flags.FAST_COMPILE, first)


def test_fast_compile_names_the_fusion_emitter_flag_only_on_checked_releases(monkeypatch):
  first, past = xla_flags.FUSION_EMITTERS_JAXLIB
  for release in (first, (0, 10, 2)):
    monkeypatch.setattr(xla_flags, '_jaxlib_version', lambda r=release: r)
    assert xla_flags.FUSION_EMITTERS_OFF in xla_flags.fast_compile().split()
  for release in ((0, 6, 2), past, ()):
    monkeypatch.setattr(xla_flags, '_jaxlib_version', lambda r=release: r)
    flags = xla_flags.fast_compile().split()
    assert xla_flags.FUSION_EMITTERS_OFF not in flags
    assert '--xla_backend_optimization_level=0' in flags


def test_the_installed_jaxlib_release_is_read():
  release = xla_flags._jaxlib_version()  # pylint: disable=protected-access
  assert len(release) == 3 and release >= (0, 7, 0)


def test_harness_flags_for_fake_devices():
  assert xla_flags.fake_cpu_devices(1) == '--xla_force_host_platform_device_count=1'
  assert xla_flags.fake_cpu_devices(8).split() == [
      '--xla_force_host_platform_device_count=8', xla_flags.FAKE_DEVICES_SAFE_SCHEDULER]


def test_several_fake_devices_get_threads_for_their_collectives(monkeypatch):
  monkeypatch.delenv('PJRT_NPROC', raising=False)
  _defaults(monkeypatch, '--xla_force_host_platform_device_count=8')
  assert os.environ['PJRT_NPROC'] == str(8 * xla_flags.THREADS_PER_FAKE_DEVICE)
  monkeypatch.setenv('PJRT_NPROC', '3')  # The user's setting wins.
  _defaults(monkeypatch, '--xla_force_host_platform_device_count=8')
  assert os.environ['PJRT_NPROC'] == '3'
  monkeypatch.delenv('PJRT_NPROC')
  _defaults(monkeypatch, '--xla_force_host_platform_device_count=1')
  assert 'PJRT_NPROC' not in os.environ
  assert 'PJRT_NPROC' not in xla_flags.fake_cpu_env(1)


_COUNT_THREADS = '''
import collections, json, os
import jax, jax.numpy as jnp
jax.jit(lambda x: x + 1)(jnp.ones(4)).block_until_ready()
names = collections.Counter(open(f'/proc/self/task/{t}/comm').read().strip()
                            for t in os.listdir('/proc/self/task'))
print(json.dumps({'devices': jax.device_count(), 'eigen': names['tf_XLAEigen']}))
'''


@pytest.mark.skipif(not os.path.isdir('/proc/self/task'), reason='needs Linux /proc')
def test_the_thread_pool_really_grows(harness, tmp_path):
  """XLA reads PJRT_NPROC when the CPU client starts: its pool has a thread per unit."""
  script = tmp_path / 'count.py'
  script.write_text(_COUNT_THREADS)
  proc = harness.run_script(script, devices=4)
  assert proc.returncode == 0, proc.stderr[-3000:]
  got = json.loads(proc.stdout.strip().splitlines()[-1])
  assert got == {'devices': 4, 'eigen': 4 * xla_flags.THREADS_PER_FAKE_DEVICE}
