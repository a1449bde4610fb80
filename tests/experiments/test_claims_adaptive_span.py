"""The adaptive-span rows of RESULTS.md (experiments/claims_adaptive_span.py): verdicts follow
the numbers, and experiments/adaptive_span_lm.py's layer halves.

Every test here runs on small JSON built in memory (no training, no data files)."""

import copy

from experiments import adaptive_span_lm, claims_adaptive_span as claims
from experiments import rows

S = 256


def _variant(bpb, spans, flops, peak, sps=1.0, bpb_std=0.005):
  """A variant over two seeds with the same (layers, heads) spans."""
  bottom, top = adaptive_span_lm.layer_halves(spans)
  flat = [z for layer in spans for z in layer]
  seed = {'bits_per_byte': bpb, 'head_spans': spans, 'average_span': sum(flat) / len(flat),
          'max_span': max(flat), 'bottom_half_span': bottom, 'top_half_span': top,
          'attn_flops_trimmed': flops, 'attn_flops_per_head': flops / 2,
          'attn_flops_full_span': 4 * 32 * 4 * S * 4, 'attn_peak_bytes': peak,
          'steps_per_sec': sps}
  entry = rows.over_seeds({s: {'v': copy.deepcopy(seed)} for s in range(2)},
                          adaptive_span_lm.KEYS)['v']
  entry['std']['bits_per_byte'] = bpb_std
  return entry


LOW_HIGH = [[1, 1, 1, 1], [1, 2, 1, 1], [3, 40, 2, 1], [2, 1, 90, 3]]  # Figure 4's shape.
FLAT = [[5, 5, 5, 5]] * 4
FULL = [[S] * 4] * 4


def _data(adaptive_spans=LOW_HIGH, adaptive_bpb=2.50, fixed_bpb=2.55, dynamic_bpb=2.51,
          dynamic_spans=LOW_HIGH, flops=131072, peak=40 * 2**20):
  full_flops = 4 * 32 * 4 * S * 4
  return {'settings': {'steps': 300, 'batch_size': 8, 'seq_len': 256, 'layers': 4, 'heads': 4,
                       'span_limit': S},
          'variants': {'adaptive': _variant(adaptive_bpb, adaptive_spans, flops, peak),
                       'dynamic': _variant(dynamic_bpb, dynamic_spans, full_flops, 130 * 2**20),
                       'fixed': _variant(fixed_bpb, FULL, full_flops, 80 * 2**20, sps=0.7)}}


def _verdicts(data, bench=None):
  results = {claims.LM: data, claims.BENCH: bench or _bench()}
  return [row.measure(results)[1] for row in claims.SECTION.rows]


def _bench(times=(250, 280, 410, 710, 1460), peaks=(85, 100, 135, 204, 360)):
  return {'machine': {'backend': 'cpu'}, 'config': {'batch': 8, 'seq': 256},
          'rows': [{'T': t, 'time_ms': ms, 'peak_MiB': mib}
                   for t, ms, mib in zip((64, 128, 256, 512, 1024), times, peaks)]}


def test_layer_halves():
  assert adaptive_span_lm.layer_halves([[1, 3], [5, 7]]) == (2, 6)
  assert adaptive_span_lm.layer_halves([[1], [100], [3]]) == (1, 3)  # The middle: neither.


def test_rows_reproduce_when_the_numbers_do():
  assert _verdicts(_data()) == ['reproduces'] * 6


def test_rows_fail_when_the_numbers_do():
  figure4, average, flops, memory, dynamic, cost = _verdicts(_data(
      adaptive_spans=[[200, 200, 200, 200], [150] * 4, [10] * 4, [5] * 4],  # Long below.
      adaptive_bpb=2.80, dynamic_bpb=3.2))
  assert figure4 == 'does not hold at this scale'
  assert average == 'direction holds'  # 91 of 256: below S/2, not below S/4.
  assert flops == memory == 'does not hold at this scale'  # 0.25 bits/byte worse than fixed.
  assert dynamic == 'does not hold at this scale'
  assert _verdicts(_data(adaptive_spans=[[200] * 4] * 4))[1] == 'does not hold at this scale'
  # Equal bits per byte, but the upper half only slightly longer; little saved.
  figure4, _, flops, memory, _, _ = _verdicts(_data(
      adaptive_spans=[[4] * 4, [4] * 4, [5] * 4, [5] * 4], flops=393216, peak=79 * 2**20))
  assert figure4 == 'direction holds'
  assert flops == memory == 'direction holds'
  assert _verdicts(_data(flops=4 * 32 * 4 * S * 4))[2] == 'does not hold at this scale'
  # Dynamic: same bits per byte, spans 10x longer than adaptive's.
  assert _verdicts(_data(adaptive_spans=FLAT, dynamic_spans=[[50] * 4] * 4))[4] == \
      'direction holds'
  # Cost: near-linear, only monotone, not monotone.
  assert _verdicts(_data(), _bench(times=(250, 280, 410, 710, 900)))[5] == 'direction holds'
  assert _verdicts(_data(), _bench(peaks=(85, 80, 135, 204, 360)))[5] == \
      'does not hold at this scale'


def test_a_missing_variant_is_not_testable():
  data = _data()
  del data['variants']['dynamic']
  verdicts = _verdicts(data)
  assert verdicts[4] == 'not testable here' and verdicts[2] == 'reproduces'
