"""benchmarks/cpu_choice.py: it times both paths of a static variant, records the faster for
this CPU, and attention_impl='auto' then follows the record."""

import json
import sys

import pytest

from benchmarks import cpu_choice as tuner
from models import attention
from models.attention import cpu_choice, cpu_kernel


@pytest.fixture
def kernel(monkeypatch, tmp_path):
  if cpu_kernel.unusable(64, 'cpu', 1):
    pytest.skip(cpu_kernel.unusable(64, 'cpu', 1))
  monkeypatch.setenv('ZOO_CPU_CHOICE', str(tmp_path / 'cpu_choice.json'))
  return tmp_path


def test_it_records_the_faster_path_and_auto_follows_it(kernel, monkeypatch, capsys):
  out = kernel / 'rows.json'
  monkeypatch.setattr(sys, 'argv', ['cpu_choice', '--attention', 'local', '--d', '1',
                                    '--seq_len', '64', '--batch', '1', '--iters', '1',
                                    '--out', str(out)])
  tuner.main()
  rows = json.loads(out.read_text())['rows']
  assert len(rows) == 1 and rows[0]['cpu_kernel_ms'] > 0 and rows[0]['blocksparse_ms'] > 0
  faster = 'cpu_kernel' if rows[0]['cpu_kernel_ms'] < rows[0]['blocksparse_ms'] else 'blocksparse'
  assert cpu_choice.measured() == {'LocalAttention': faster}
  assert attention.traits.of('local').implementation(
      'auto', options=attention.resolve_options({}, ['local']), head_dim=64,
      backend='cpu') == faster
  assert f'recorded for {cpu_choice.host_key()!r}' in capsys.readouterr().out


def test_a_variant_without_a_static_pattern_is_refused(kernel, monkeypatch):
  del kernel
  monkeypatch.setattr(sys, 'argv', ['cpu_choice', '--attention', 'selective'])
  with pytest.raises(SystemExit, match='no static pattern'):
    tuner.main()
