"""The roofline step-time estimate against the measured step time, on this machine.

  python -m benchmarks.roofline_check                        # dense, local, adaptive_span; d=2,4,8
  python -m benchmarks.roofline_check --variants dense selective --d 2 4 --rounds 5

--mode=compile estimates a TPU step from the compiled program (analysis/roofline.py: compute,
memory, collectives and overhead; loops counted with their trip counts, analysis/hlo_cost.py)
and a chip's published figures (analysis/chips.py); nothing runs there. This script checks the
same estimator where a step can be measured: the machine it runs on (its default jax device)
described by measurements -- a jitted 2048^3 float32 matmul's FLOP/s, a jitted element-wise
pass over 256 MB (bytes/s), a one-op program's launch time and a kernel's launch time
(chips.host_chip) -- against the measured time of the same compiled train step.

Each row is the real sharded train step of training/train.py (configs/default.py's C4
architecture at the given d, float32, `attention_impl='blocksparse'` so that every kernel is
XLA's own and counted: the CPU kernel of 'auto' is a custom call whose FLOPs XLA cannot see),
rows of --seq_len random tokens, --batch rows. Each round measures the machine, then times
every configuration (interleaved, so that a busy phase of a shared machine hits all of them):
the median of --iters steps after a warm-up step. Two comparisons: the estimate from the
machine's best figures over the rounds against the best round's step (each the least
disturbed by other work), and the median over rounds of each round's estimate against that
round's step (both under the same load). Nothing is fitted: the estimate's inputs are the
program and the machine's figures only.

Writes results/roofline_check.json and prints the table for docs/tpu.md.
"""

import argparse
import statistics
import time

from training import xla_flags  # noqa: E402

xla_flags.set_cpu_defaults()  # As main.py does, before JAX starts its backend.
xla_flags.skip_absent_tpu()

import dataclasses  # noqa: E402
import os  # noqa: E402

import jax  # noqa: E402

from benchmarks import common, train_step  # noqa: E402
from models import transformer  # noqa: E402
from analysis import chips, hlo_cost, roofline  # noqa: E402,I100
from training import sharding  # noqa: E402

COLUMNS = ('variant', 'd', 'params_m', 'gflop', 'mib', 'launches', 'compute_ms', 'memory_ms',
           'overhead_ms', 'bound', 'estimate_ms', 'measured_ms', 'ratio', 'round_ratio')


def build(variant: str, d: int, seq_len: int, batch: int, impl: str):
  """(setup, compiled train step, run(): one step that blocks) of one configuration: the
  step benchmarks/train_step.py times, float32."""
  setup, state, step, batch_arrays, key = train_step.built_step(d, seq_len, batch, 'float32',
                                                                impl, attention=variant)
  with sharding.activate(setup.mesh, setup.rules):
    compiled = step.lower(state, batch_arrays, key).compile()
  holder = {'state': state}

  def run():
    with sharding.activate(setup.mesh, setup.rules):
      holder['state'], metrics = compiled(holder['state'], batch_arrays, key)
    jax.block_until_ready(metrics['loss'])

  return setup, compiled, run


def best_chip(measured: list[chips.Chip]) -> chips.Chip:
  """The machine's best figures over several measurements (a shared machine is only ever
  slower than it can be)."""
  best = measured[0]
  return dataclasses.replace(
      best,
      peak_flops={k: max(c.peak_flops[k] for c in measured) for k in best.peak_flops},
      hbm_bandwidth=max(c.hbm_bandwidth for c in measured),
      step_overhead_s=min(c.step_overhead_s for c in measured),
      kernel_overhead_s=min(c.kernel_overhead_s for c in measured))


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--variants', nargs='+', default=['dense', 'local', 'adaptive_span'])
  parser.add_argument('--d', nargs='+', type=int, default=[2, 4, 8])
  parser.add_argument('--seq_len', type=int, default=512)
  parser.add_argument('--batch', type=int, default=8)
  parser.add_argument('--impl', default='blocksparse', help='model.attention_impl')
  parser.add_argument('--rounds', type=int, default=3)
  parser.add_argument('--iters', type=int, default=3, help='timed steps per round')
  parser.add_argument('--out', default=os.path.join(common.RESULTS, 'roofline_check.json'))
  args = parser.parse_args()

  configs = [(v, d) for d in args.d for v in args.variants]
  built = {}
  for variant, d in configs:
    start = time.perf_counter()
    setup, compiled, run = build(variant, d, args.seq_len, args.batch, args.impl)
    cost = hlo_cost.analyze(compiled.as_text())
    run()  # The first call (allocation).
    built[variant, d] = (setup, cost, run)
    print(f'built {variant} d={d} in {time.perf_counter() - start:.1f} s', flush=True)

  measured_chips, samples = [], {c: [] for c in configs}
  for r in range(args.rounds):
    measured_chips.append(chips.host_chip())
    c = measured_chips[-1]
    print(f'round {r + 1}: matmul {c.peak_flops["f32"] / 1e9:.1f} GFLOP/s, copy '
          f'{c.hbm_bandwidth / 1e9:.2f} GB/s, launch {c.step_overhead_s * 1e6:.0f} us, kernel '
          f'{c.kernel_overhead_s * 1e9:.0f} ns', flush=True)
    for key in configs:
      t = common.time_fn(built[key][2], warmup=1, iters=args.iters)
      samples[key].append(t['median_s'])
      print(f'  {key[0]} d={key[1]}: {1e3 * t["median_s"]:.1f} ms', flush=True)
  chip = best_chip(measured_chips)

  rows = []
  for variant, d in configs:
    setup, cost, _ = built[variant, d]
    # The machine at its best against the step at its best: both are what this machine does
    # with the least interference from other work.
    est = roofline.estimate(cost, chip, devices=jax.device_count())
    best = min(samples[variant, d])
    # Each round's estimate (from the machine as measured at the start of that round) against
    # that round's step: both under the same load.
    per_round = [roofline.estimate(cost, c, devices=jax.device_count()).step_s / s
                 for c, s in zip(measured_chips, samples[variant, d])]
    rows.append({
        'variant': variant, 'd': d, 'params_m': setup.model_config.num_params() / 1e6,
        'impl': ','.join(dict.fromkeys(transformer.implementations(setup.model_config))),
        'gflop': est.flops / 1e9, 'mib': est.bytes / 2**20, 'launches': est.launches,
        'compute_ms': 1e3 * est.compute_s, 'memory_ms': 1e3 * est.memory_s,
        'kernels_ms': 1e3 * est.kernels_s, 'overhead_ms': 1e3 * est.overhead_s,
        'bound': est.bound, 'estimate_ms': 1e3 * est.step_s, 'measured_ms': 1e3 * best,
        'measured_median_ms': 1e3 * statistics.median(samples[variant, d]),
        'measured_rounds_ms': [1e3 * s for s in samples[variant, d]],
        'ratio': est.step_s / best, 'round_ratios': per_round,
        'round_ratio': statistics.median(per_round), 'unknown_loops': est.unknown_loops,
        'opaque': est.opaque,
        'model_gflop': setup.model_config.train_flops_per_token(args.seq_len)
                       * args.batch * args.seq_len / 1e9})
  common.print_table(rows, COLUMNS)
  print('\n' + markdown(rows, chip))
  common.write_json(args.out, {
      'machine': common.machine(),
      'settings': {'seq_len': args.seq_len, 'batch': args.batch, 'impl': args.impl,
                   'rounds': args.rounds, 'iters': args.iters, 'dtype': 'float32'},
      'chip': dataclasses.asdict(chip),
      'chip_rounds': [dataclasses.asdict(c) for c in measured_chips],
      'rows': rows})


def markdown(rows: list[dict], chip: chips.Chip) -> str:
  """The table of docs/tpu.md."""
  lines = [f'This machine at its best over the rounds: matmul {chip.peak_flops["f32"] / 1e9:.1f} '
           f'GFLOP/s (float32), element-wise pass {chip.hbm_bandwidth / 1e9:.2f} GB/s, '
           f'program launch {chip.step_overhead_s * 1e6:.0f} us, kernel launch '
           f'{chip.kernel_overhead_s * 1e9:.0f} ns.',
           '',
           '| variant | d | params | GFLOP | GiB moved | kernels | compute s | memory s | '
           'bound | estimate s | measured s (best) | estimate / measured | same, per round '
           '(median) |',
           '|---|---|---|---|---|---|---|---|---|---|---|---|---|']
  for r in rows:
    lines.append(f'| {r["variant"]} | {r["d"]} | {r["params_m"]:.1f}M | {r["gflop"]:.0f} | '
                 f'{r["mib"] / 1024:.1f} | {r["launches"]:,.0f} | {r["compute_ms"] / 1e3:.2f} | '
                 f'{r["memory_ms"] / 1e3:.2f} | {r["bound"]} | {r["estimate_ms"] / 1e3:.2f} | '
                 f'{r["measured_ms"] / 1e3:.2f} | {r["ratio"]:.2f} | {r["round_ratio"]:.2f} |')
  return '\n'.join(lines)


if __name__ == '__main__':
  main()
