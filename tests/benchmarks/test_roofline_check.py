"""benchmarks/roofline_check.py: the committed check of the roofline estimate against measured
steps (results/roofline_check.json) covers dense and two other variants at d = 2, 4 and 8, and
docs/tpu.md shows exactly its table. Reads files only."""

import dataclasses
import json

import pytest

from benchmarks import roofline_check
from tests.harness import REPO
from analysis import chips

pytestmark = pytest.mark.unit

RESULTS = REPO / 'results' / 'roofline_check.json'


def _results():
  return json.loads(RESULTS.read_text())


def test_the_check_has_three_variants_at_three_sizes():
  rows = _results()['rows']
  assert len(rows) >= 9
  variants = {r['variant'] for r in rows}
  assert 'dense' in variants and len(variants) >= 3
  assert {r['d'] for r in rows} >= {2, 4, 8}
  for r in rows:
    assert r['measured_ms'] > 0 and r['estimate_ms'] > 0, r
    assert r['ratio'] == pytest.approx(r['estimate_ms'] / r['measured_ms'])
    assert not r['unknown_loops'] and not r['opaque'], r  # Every kernel counted.


def test_docs_tpu_md_has_the_committed_table():
  data = _results()
  table = roofline_check.markdown(data['rows'], chips.Chip(**data['chip']))
  assert table in (REPO / 'docs' / 'tpu.md').read_text(), (
      "docs/tpu.md's roofline check differs from results/roofline_check.json; paste the "
      'table `python -m benchmarks.roofline_check` prints')


def test_the_machine_is_taken_at_its_best_over_the_rounds():
  slow = chips.Chip(name='cpu', peak_flops={'f32': 1e11}, hbm_bytes=None, hbm_bandwidth=5e9,
                    step_overhead_s=1e-5, kernel_overhead_s=1e-8)
  fast = dataclasses.replace(slow, peak_flops={'f32': 2e11}, step_overhead_s=2e-5)
  best = roofline_check.best_chip([slow, fast])
  assert best.peak_flops['f32'] == 2e11 and best.hbm_bandwidth == 5e9
  assert best.step_overhead_s == 1e-5
