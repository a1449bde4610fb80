"""What the processes of a run compare (training/agreement.py), without processes: the settings
that differ, in order, and what the code and version facts hold. The refusals themselves run
on two processes in tests/training/test_pod_agreement.py."""

import pytest

from training import agreement

pytestmark = pytest.mark.unit


def _published(*values):
  return [{'value': v, 'host': 'h', 'pid': i} for i, v in enumerate(values)]


def test_differences_are_the_keys_whose_values_differ_sorted():
  same = {'a': 1, 'b': [1, 2], 'c': {'x': 1}}
  assert agreement.differences(_published(same, dict(same))) == []
  other = {'a': 1, 'b': [1, 3], 'c': {'x': 2}, 'd': 0}
  assert agreement.differences(_published(same, other)) == ['b', 'c', 'd']  # 'd': absent on 0


def test_the_code_counts_each_source_file_not_only_the_commit():
  code = agreement.code()
  assert 'code.commit' in code and 'code.sources' in code
  assert 'code.file.main.py' in code and 'code.file.training/agreement.py' in code
  assert 'code.file.models/attention/blockloop.py' in code
  assert not any(k.startswith('code.file.tests/') for k in code)


def test_the_versions_name_every_library_that_changes_the_program():
  versions = agreement.versions()
  assert set(versions) == {f'version.{name}' for name in agreement.LIBRARIES}
  assert versions['version.jax'] != 'absent'
