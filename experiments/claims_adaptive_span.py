"""RESULTS.md rows of Adaptive attention span (Sukhbaatar et al., 2019): learned spans per layer
and head, their average, the compute and memory they save against the same model with every
span fixed at S, and dynamic spans (experiments/adaptive_span_lm.py); the cost of a trimmed
span (benchmarks/adaptive_span.py)."""

from __future__ import annotations

from experiments.report import Row, Section, near, pm
from experiments.rows import field, metric, seed_rows

LM = 'adaptive_span_lm.json'
LM_COMMAND = ('adaptive_span_lm',)  # experiments/registry.py
BENCH = 'adaptive_span.json'
BENCH_COMMAND = ('adaptive_span',)
# "Equal bits per byte": within 2% of the other's, or within twice the seeds' spread.
NEAR = 0.02
# Figure 4: the upper half of the layers' mean span more than this times the lower half's.
LAYER_RATIO = 2.0
# Table 1 / 3: average spans 314 of S = 8192 (4%) and 123 of S = 1024 (12%): "well below".
WELL_BELOW = 0.25
# Saved: at most this fraction of the fixed span's attention FLOPs or peak memory.
SAVED = 0.5
# Table 3, "comparable average spans" (149 vs 123): within this factor of each other.
COMPARABLE = 2.0


def _variants(results, *names):
  """(settings, the variants' entries) or None where one was not run."""
  data = results[LM]
  variants = data['variants']
  if any(n not in variants for n in names):
    return None
  return data['settings'], [variants[n] for n in names]


def _scale(settings, entry) -> str:
  return (f'{len(seed_rows(entry))} seeds, {settings["steps"]} steps of '
          f'{settings["batch_size"]} x {settings["seq_len"]} bytes, {settings["layers"]} layers '
          f'x {settings["heads"]} heads, S = {settings["span_limit"]}')


def _pm(entry, key: str, digits: int = 3) -> str:
  """An entry's mean ± spread of `key`."""
  return pm(metric(entry, key), metric(entry, key, 'std'), digits)


def _missing(names) -> tuple[str, str, str]:
  return ('-', 'not testable here', f'the run has no {" / ".join(names)} variant')


def _bpb(a, b) -> tuple[bool, float]:
  """(a at or below b, or near it; a - b) in bits per byte."""
  x, x_std = metric(a, 'bits_per_byte'), metric(a, 'bits_per_byte', 'std')
  y, y_std = metric(b, 'bits_per_byte'), metric(b, 'bits_per_byte', 'std')
  return x <= y or near(x, x_std, y, y_std, NEAR), x - y


def figure4(results):
  """Spans short in the low layers, long in the upper ones: in every seed, the top half of the
  layers' mean span > LAYER_RATIO x the bottom half's (reproduces), or > it (direction)."""
  got = _variants(results, 'adaptive')
  if got is None:
    return _missing(['adaptive'])
  settings, (a,) = got
  spans = [field(s, 'head_spans') for s in seed_rows(a)]
  layers = len(spans[0])
  per_layer = [sum(sum(s[i]) / len(s[i]) for s in spans) / len(spans) for i in range(layers)]
  longest = []
  for s in spans:
    z, layer = max((z, i) for i, heads in enumerate(s) for z in heads)
    longest.append(f'layer {layer + 1} ({z:.1f})')
  ratios = [top / max(bottom, 1e-9) for top, bottom in zip(
      metric(a, 'top_half_span', 'seeds'), metric(a, 'bottom_half_span', 'seeds'))]
  text = (f'mean span per layer, bottom to top: {", ".join(f"{z:.1f}" for z in per_layer)}; '
          f'top / bottom half {_pm(a, "top_half_span", 1)} / {_pm(a, "bottom_half_span", 1)}; '
          'longest head per seed: '
          f'{", ".join(longest)} ({_scale(settings, a)})')
  shown = ', '.join(f'{r:.2f}x' for r in ratios)
  if all(r > LAYER_RATIO for r in ratios):
    return text, 'reproduces', (f'top half > {LAYER_RATIO:g}x the bottom half in every seed '
                                f'({shown})')
  if all(r > 1 for r in ratios):
    return text, 'direction holds', (f'top half longer in every seed, but not '
                                     f'{LAYER_RATIO:g}x ({shown})')
  return text, 'does not hold at this scale', (
      f'top half / bottom half {shown}: the upper layers are not longer in every seed; spans '
      f'start at 0, and after {settings["steps"]} steps the longest is '
      f'{metric(a, "max_span"):.1f} of '
      f'S = {settings["span_limit"]}')


def average_span(results):
  """Average span < WELL_BELOW x S (reproduces), < S / 2 (direction)."""
  got = _variants(results, 'adaptive')
  if got is None:
    return _missing(['adaptive'])
  settings, (a,) = got
  limit = settings['span_limit']
  mean = metric(a, 'average_span')
  text = (f'average {_pm(a, "average_span", 1)} of S = {limit} '
          f'({mean / limit:.1%}); max {_pm(a, "max_span", 1)} '
          f'({_scale(settings, a)})')
  caveat = ('; spans start at 0 (z\' = 0 at init, as in the paper), so a short run mostly '
            'shows how little they grew')
  if mean < WELL_BELOW * limit:
    return text, 'reproduces', f'{mean:.1f} < {WELL_BELOW:g} S = {WELL_BELOW * limit:g}{caveat}'
  if mean < limit / 2:
    return text, 'direction holds', f'{mean:.1f} < S/2 but >= {WELL_BELOW:g} S{caveat}'
  return text, 'does not hold at this scale', f'{mean:.1f} >= S/2 = {limit / 2:g}'


def _saved(key: str, what: str, unit):
  """The adaptive model's `key` (attention FLOPs per token as computed, or peak memory of an
  attention layer) <= SAVED x the fixed span's (reproduces) or below it (direction), at bits
  per byte at or below the fixed span's, or within NEAR or twice the seeds' spread."""

  def measure(results):
    got = _variants(results, 'adaptive', 'fixed')
    if got is None:
      return _missing(['adaptive', 'fixed'])
    settings, (a, f) = got
    ours, theirs = metric(a, key), metric(f, key)
    ratio = ours / theirs
    ok, diff = _bpb(a, f)
    speed = metric(a, 'steps_per_sec') / metric(f, 'steps_per_sec')
    extra = ''
    if key == 'attn_flops_trimmed':
      extra = (f'; {metric(a, "attn_flops_per_head") / theirs:.2f}x if each head stopped at '
               'its own z + R')
    text = (f'{what} {unit(ours)} vs fixed span {unit(theirs)} ({ratio:.2f}x{extra}); '
            f'bits/byte {_pm(a, "bits_per_byte")} vs {_pm(f, "bits_per_byte")}; train step '
            f'{speed:.2f}x '
            f'fixed\'s steps/s ({_scale(settings, a)})')
    equal = (f'bits/byte {diff:+.3f} vs fixed: at or below it, or within {NEAR:.0%} or twice '
             'the seed spread')
    if not ok:
      return text, 'does not hold at this scale', (
          f'not at equal bits/byte: {diff:+.3f} vs fixed, more than {NEAR:.0%} and twice the '
          'seed spread')
    if ratio <= SAVED:
      return text, 'reproduces', f'{ratio:.2f}x <= {SAVED:g}x the fixed span\'s; {equal}'
    if ratio < 1:
      return text, 'direction holds', f'{ratio:.2f}x: less, but > {SAVED:g}x; {equal}'
    return text, 'does not hold at this scale', f'{ratio:.2f}x the fixed span\'s: nothing saved'

  return measure


def dynamic(results):
  """Dynamic spans: bits per byte at or near the adaptive model's and average spans within
  COMPARABLE x of each other (reproduces); bits per byte only (direction)."""
  got = _variants(results, 'dynamic', 'adaptive')
  if got is None:
    return _missing(['dynamic', 'adaptive'])
  settings, (d, a) = got
  ok = near(metric(d, 'bits_per_byte'), metric(d, 'bits_per_byte', 'std'),
            metric(a, 'bits_per_byte'), metric(a, 'bits_per_byte', 'std'), NEAR)
  diff = metric(d, 'bits_per_byte') - metric(a, 'bits_per_byte')
  ratio = metric(d, 'average_span') / max(metric(a, 'average_span'), 1e-9)
  comparable = 1 / COMPARABLE <= ratio <= COMPARABLE
  text = (f'dynamic {_pm(d, "bits_per_byte")} vs adaptive {_pm(a, "bits_per_byte")} '
          f'bits/byte; average span {metric(d, "average_span"):.1f} vs '
          f'{metric(a, "average_span"):.1f} (dynamic: z_t averaged over a '
          f'validation batch; its code computes all S keys) ({_scale(settings, a)})')
  spans = f'average spans {ratio:.2f}x of each other'
  if ok and comparable:
    return text, 'reproduces', (f'{diff:+.3f} bits/byte (within {NEAR:.0%} or twice the seed '
                                f'spread); {spans}, within {COMPARABLE:g}x')
  if ok:
    return text, 'direction holds', (f'same bits/byte ({diff:+.3f}), but {spans}: not within '
                                     f'{COMPARABLE:g}x')
  return text, 'does not hold at this scale', (
      f'{diff:+.3f} bits/byte: more than {NEAR:.0%} and twice the seed spread')


def trimmed_cost(results):
  """Cost follows the span: time and peak memory of one attention layer rise with T at every
  step, and doubling T from S/2 to S multiplies the time by >= 1.5 (near linear: reproduces);
  monotone only (direction)."""
  data = results[BENCH]
  rows = sorted(data['rows'], key=lambda r: r['T'])
  small, half, full = rows[0], rows[-2], rows[-1]
  times = [r['time_ms'] for r in rows]
  peaks = [r['peak_MiB'] for r in rows]
  monotone = (all(x < y for x, y in zip(times, times[1:]))
              and all(x < y for x, y in zip(peaks, peaks[1:])))
  doubling = full['time_ms'] / half['time_ms']
  text = (f'one layer forward + backward, T = {small["T"]} vs T = S = {full["T"]}: '
          f'{small["time_ms"]:.0f} vs {full["time_ms"]:.0f} ms ({full["time_ms"] / small["time_ms"]:.1f}x), '
          f'peak {small["peak_MiB"]:.0f} vs {full["peak_MiB"]:.0f} MiB; T = {half["T"]} -> '
          f'{full["T"]}: {doubling:.2f}x the time ({data["machine"]["backend"]}, '
          f'{data["config"]["batch"]} x {data["config"]["seq"]} queries)')
  if monotone and doubling >= 1.5:
    return text, 'reproduces', (f'time and memory rise with T at every step; doubling T to S '
                                f'gives {doubling:.2f}x >= 1.5x the time')
  if monotone:
    return text, 'direction holds', f'rising with T, but doubling T gives only {doubling:.2f}x'
  return text, 'does not hold at this scale', 'time or memory does not rise with T at every step'


def _flops(x):
  return f'{x / 1e3:,.0f}K'


def _mib(x):
  return f'{x / 2**20:.1f} MiB'


SECTION = Section(
    paper_scale=('adaptive_span_enwik8', 'adaptive_span_text8'),
    title='Adaptive attention span (Sukhbaatar et al., 2019)',
    source='adaptive-attention-span.md',
    intro=('The paper: text8 and enwik8, 12 layers x 8 heads, S up to 8192, 600K Adagrad '
           'steps. Ours (experiments/adaptive_span_lm.py): tinyshakespeare bytes, the recipe '
           'configs/adaptive_span_char.py (relative positions, R = 32, lambda = 2e-6, segments '
           'attending into the cached previous ones up to S back) at 4 layers x 4 heads of 32, '
           'each of three variants trained with the same seeds, data order and steps: '
           '**adaptive** (z = S z\' per head, z\' from 0), **dynamic** (z_t = S sigmoid(v.x_t '
           '+ b), b = -4) and **fixed** (the same model with every span z = S, the paper\'s '
           'fixed-span baseline). Spans are z (a head weighs keys up to z + R back). Attention '
           'FLOPs per token count q.k and a.v over the keys the code computes (a layer\'s heads '
           'together up to its trimmed span T, a multiple of 64; the dynamic span always S); '
           'peak memory is one attention layer\'s compiled forward + backward at the trained '
           'spans. "Equal bits/byte": at or below, or within '
           f'{NEAR:.0%} or twice the seeds\' spread. Earlier single runs: docs/adaptive_span.md.'),
    rows=(
        Row('Spans are short in the low layers and long in a few heads of the upper layers '
            '(Figure 4)',
            'S = 4096: the lowest 5 of 12 layers keep the smallest span (R = 32); a few upper '
            'heads exceed several thousand; not monotonic in the layer',
            (LM,), LM_COMMAND, figure4, links=('results/adaptive_span_lm.png',)),
        Row('The average learned span is far below the limit S (Tables 1, 3)',
            'text8: 314 of S = 8192 (Table 1); 123 of S = 1024 (Table 3)',
            (LM,), LM_COMMAND, average_span),
        Row('Adaptive spans cut the attention FLOPs against a fixed span S at equal (or better) '
            'bits per byte (Figure 3)',
            'as good as or better than fixed at every S; up to 70% fewer FLOPS at large S',
            (LM,), LM_COMMAND, _saved('attn_flops_trimmed', 'attention FLOPs/token', _flops)),
        Row('Adaptive spans cut the attention memory against a fixed span S at equal bits per '
            'byte: a layer\'s longest span sets it (Section 3)',
            'largest fixed span that fit for training: S = 2048 (~550 ms/batch); adaptive with '
            'S = 8192 fit, at about the same time per batch',
            (LM,), LM_COMMAND, _saved('attn_peak_bytes', 'attention peak', _mib)),
        Row('Dynamic spans match adaptive spans (Table 3)',
            'S = 1024: adaptive 1.08 dev bpc, average span 123; dynamic 1.08, 149',
            (LM,), LM_COMMAND, dynamic),
        Row('A fixed span\'s cost grows almost linearly with S; computing only a learned span '
            'keeps it low (Figure 3, right): one attention layer at trimmed spans T <= S',
            'FLOPS of fixed-span models grow almost linearly with S; attention is 82% of the '
            'FLOPS at S = 8192',
            (BENCH,), BENCH_COMMAND, trimmed_cost),
    ))
