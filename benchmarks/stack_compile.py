"""Compile time and step time of the train step per stack (models/stacks.py).

  python -m benchmarks.stack_compile                      # strided, 4/8/16 layers
  python -m benchmarks.stack_compile --attention local_global --layers 6 12

Builds the real train step of training/train.py (configs/tiny.py's d=2 width, Variable
Assignment shapes) for each `model.stack` and measures, separately: tracing + lowering to
HLO, XLA compilation, and the compiled step's run time (best of a few). `unrolled` compiles
n_layers blocks; `scan_cycle` compiles one cycle of p layers (interleaved strided: p = 2) and
scans it. Results go to results/stack_compile.json.
"""

import argparse
import os
import time


from training import xla_flags  # noqa: E402

xla_flags.set_cpu_defaults()  # As main.py does, before JAX starts its backend.

import jax  # noqa: E402

from benchmarks import common  # noqa: E402
from configs import tiny  # noqa: E402
from models import stacks  # noqa: E402
from training import assembly, sharding, steps  # noqa: E402,I100


def bench(attention: str, n_layers: int, stack: str, iters: int) -> dict:
  """Lower, compile and run times of one (attention, n_layers, stack) train step."""
  config = tiny.get_config()
  config.model.attention = attention
  config.model.n_layers = n_layers
  config.model.stack = stack
  config.peak_tflops_per_device = 1.0
  setup = assembly.build(config)
  state = assembly.init_state(setup, 0)
  local, _ = next(setup.data.train_iter(0, None))
  setup.data.close()
  step = steps.jit_train_step(setup)
  rng = jax.random.key(0)
  with sharding.activate(setup.mesh, setup.rules):
    batch = assembly.device_batch(setup, local)
    t = time.perf_counter()
    lowered = step.lower(state, batch, rng)
    lower_s = time.perf_counter() - t
    t = time.perf_counter()
    compiled = lowered.compile()
    compile_s = time.perf_counter() - t
    box = {'state': state}

    def run():
      box['state'], metrics = compiled(box['state'], batch, rng)
      jax.block_until_ready(metrics)

    timing = common.time_fn(run, warmup=1, iters=iters)
  return {'attention': attention, 'n_layers': n_layers, 'stack': stack,
          'cycle': stacks.cycle_length(setup.model_config) if stack == 'scan_cycle' else None,
          'hlo_kb': len(lowered.as_text()) / 1024, 'lower_s': lower_s, 'compile_s': compile_s,
          'step_ms': 1e3 * timing['best_s']}


def main():
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--attention', default='strided')
  p.add_argument('--layers', type=int, nargs='+', default=[4, 8, 16])
  p.add_argument('--stacks', nargs='+', default=['unrolled', 'scan_cycle'])
  p.add_argument('--iters', type=int, default=5)
  p.add_argument('--out', default=os.path.join(common.RESULTS, 'stack_compile.json'))
  args = p.parse_args()
  rows = [bench(args.attention, n, s, args.iters) for n in args.layers for s in args.stacks]
  common.print_table(rows, ['attention', 'n_layers', 'stack', 'cycle', 'hlo_kb', 'lower_s',
                            'compile_s', 'step_ms'])
  common.write_json(args.out, {'rows': rows})


if __name__ == '__main__':
  main()
