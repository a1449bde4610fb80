"""Measures the C++ CPU kernel against the XLA path on this CPU and records the faster for
attention_impl='auto' (models/attention/cpu_choice.py).

  python -m benchmarks.cpu_choice                      # every static variant, d=4 and d=8
  python -m benchmarks.cpu_choice --attention dense local --d 8 --iters 8
  python -m benchmarks.cpu_choice --dry_run            # measure and print, record nothing

For each variant with a static pattern, the real train step of the C4 recipe's architecture
(benchmarks/train_step.py's configuration: seq 512, batch 8, float32) is built twice, with
attention_impl='cpu_kernel' and 'blocksparse', and the two are timed in alternation (one call
of each per round, --iters rounds), so that a slow phase of the machine hits both. A variant's
choice is the path with the smaller sum over the sizes of the median step times. The choices
go to this CPU model's entry of results/cpu_paths.json (commit it: 'auto' reads that file,
and runs the XLA path on a CPU without an entry). Measure again after changing the kernel.
The measurement's rows also go to results/cpu_choice.json.
"""

import argparse
import os
import statistics
import time

from training import xla_flags  # noqa: E402

xla_flags.set_cpu_defaults()  # As main.py does, before JAX starts its backend.

import jax  # noqa: E402

from benchmarks import common  # noqa: E402
from configs import default  # noqa: E402
from models import attention  # noqa: E402
from models.attention import cpu_choice, cpu_kernel  # noqa: E402
from training import assembly, sharding, steps  # noqa: E402,I100

IMPLS = (cpu_choice.KERNEL, cpu_choice.XLA)


def static_variants() -> list[str]:
  """The registered variants whose pattern the kernel computes."""
  return [n for n in attention.known() if attention.get(n).__module__.startswith('models.')
          and attention.traits.of(n).has_static_pattern()]


def _step(variant: str, impl: str, d: int, seq_len: int, batch: int):
  """A callable that runs one train step of the configuration and waits for it."""
  config = default.get_config()
  config.model.update(d=d, attention=variant, dtype='float32', attention_impl=impl,
                      max_len=seq_len, stack='unrolled')
  config.data.name = 'parity'          # Any embedded source: only shapes matter here.
  config.data.num_bits = seq_len // 2  # Parity gives sequences of 2 * num_bits inputs.
  config.batch_size = batch
  config.total_steps = 10**6
  setup = assembly.build(config)
  setup.data.close()
  state = {'state': assembly.init_state(setup, 0)}
  step = steps.jit_train_step(setup)
  batch_ = assembly.device_batch(
      setup, common.random_lm_batch(setup.model_config.vocab_size, batch, seq_len))
  key = jax.random.key(0)

  def run():
    with sharding.activate(setup.mesh, setup.rules):
      state['state'], metrics = step(state['state'], batch_, key)
      jax.block_until_ready(metrics['loss'])

  return run


def measure(variant: str, d: int, seq_len: int, batch: int, iters: int) -> dict:
  """Median step times of both paths, timed in alternation."""
  runs = {impl: _step(variant, impl, d, seq_len, batch) for impl in IMPLS}
  for run in runs.values():
    run()  # Compile.
    run()
  times = {impl: [] for impl in IMPLS}
  for _ in range(iters):
    for impl, run in runs.items():
      start = time.perf_counter()
      run()
      times[impl].append(time.perf_counter() - start)
  row = {'variant': variant, 'd': d, 'seq_len': seq_len, 'batch': batch}
  for impl in IMPLS:
    row[f'{impl}_ms'] = 1e3 * statistics.median(times[impl])
  row['kernel/xla'] = row[f'{cpu_choice.KERNEL}_ms'] / row[f'{cpu_choice.XLA}_ms']
  return row


def main():
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument('--attention', nargs='+', default=None,
                 help='variants (default: every one with a static pattern)')
  p.add_argument('--d', type=int, nargs='+', default=[4, 8], help='size knobs to measure')
  p.add_argument('--seq_len', type=int, default=512)
  p.add_argument('--batch', type=int, default=8)
  p.add_argument('--iters', type=int, default=5, help='alternating rounds per size')
  p.add_argument('--dry_run', action='store_true', help='print, but record no choice')
  p.add_argument('--out', default=os.path.join(common.RESULTS, 'cpu_choice.json'))
  args = p.parse_args()

  why = cpu_kernel.unusable(64, jax.default_backend(), jax.device_count())
  if why:
    raise SystemExit(f'the CPU kernel cannot run here ({why}): auto runs the XLA path')
  variants = args.attention or static_variants()
  refused = [v for v in variants if v not in static_variants()]
  if refused:
    raise SystemExit(f'{", ".join(refused)}: no static pattern, the kernel cannot run it; '
                     f'choose among {", ".join(static_variants())}')
  rows, choice = [], {}
  for variant in variants:
    mine = [measure(variant, d, args.seq_len, args.batch, args.iters) for d in args.d]
    rows += mine
    total = {impl: sum(r[f'{impl}_ms'] for r in mine) for impl in IMPLS}
    choice[attention.get(variant).__name__] = min(IMPLS, key=total.get)
    for r in mine:
      r['chosen'] = choice[attention.get(variant).__name__]
    common.write_json(args.out, {'host_key': cpu_choice.host_key(), 'settings': vars(args),
                                 'rows': rows, 'choice': choice})
  common.print_table(rows, ['variant', 'd', 'seq_len', 'batch', 'cpu_kernel_ms',
                            'blocksparse_ms', 'kernel/xla', 'chosen'])
  if args.dry_run:
    print('dry run: nothing recorded')
    return
  where = cpu_choice.record(choice, {'rows': rows, 'machine': common.machine(),
                                     'kernel_build': cpu_kernel.library_key(),
                                     'measured_at': time.strftime('%Y-%m-%d %H:%M:%S')})
  print(f'recorded for {cpu_choice.host_key()!r} in {where} (commit it): '
        + ', '.join(f'{k} {v}' for k, v in choice.items()))


if __name__ == '__main__':
  main()
