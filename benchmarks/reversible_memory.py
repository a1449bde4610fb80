"""What the reversible wiring saves: a train step's compiled memory and time against depth.

  python -m benchmarks.reversible_memory                      # 2, 4, 8, 16 layers
  python -m benchmarks.reversible_memory --layers 2 8 --iters 2 --ff_chunk_len 0 128

The real sharded train step of training/train.py (AdamW, fused loss, donated state) of a
dense-attention model at fixed width (d_model 256, 4 heads, seq 512, batch 4, float32 by
default), with model.residual = 'pre_ln' and 'reversible', for each number of layers. For each
row: XLA's compiled temporary memory of the step (what the step allocates besides its
arguments and outputs: stored activations, gradients before the update), its growth per layer
from the shallowest row, and the median step time. Pre-LN stores every layer's activations
for the backward pass; the reversible stack rebuilds them (models/reversible.py), so its
temporaries grow only by each layer's gradients, at the cost of recomputing each layer's
forward once in the backward pass.
"""

import argparse
import os


from training import xla_flags  # noqa: E402

xla_flags.set_cpu_defaults()  # As main.py does, before JAX starts its backend.

import jax  # noqa: E402

from benchmarks import common  # noqa: E402
from configs import default  # noqa: E402
from models import transformer  # noqa: E402
from training import assembly, sharding, steps  # noqa: E402,I100

MB = 2.0 ** 20


def bench(wiring: str, n_layers: int, ff_chunk_len: int, args) -> dict:
  """Compiles and times one configuration's train step."""
  config = default.get_config()
  config.model.d_model = args.d_model
  config.model.n_heads = args.heads
  config.model.n_layers = n_layers
  config.model.dtype = args.dtype
  config.model.attention_impl = args.impl
  config.model.residual = wiring
  config.model.ff_chunk_len = ff_chunk_len
  config.model.max_len = args.seq_len
  config.data.name = 'parity'              # Any embedded source: only shapes matter here.
  config.data.num_bits = args.seq_len // 2  # Parity gives sequences of 2 * num_bits inputs.
  config.batch_size = args.batch
  config.total_steps = 10**6
  setup = assembly.build(config)
  state = assembly.init_state(setup, 0)
  step = steps.jit_train_step(setup)
  local = common.random_lm_batch(setup.model_config.vocab_size, args.batch, args.seq_len)
  batch = assembly.device_batch(setup, local)
  key = jax.random.key(0)
  with sharding.activate(setup.mesh, setup.rules):
    compiled = step.lower(state, batch, key).compile()
  memory = compiled.memory_analysis()
  holder = {'state': state}

  def run():
    holder['state'], m = compiled(holder['state'], batch, key)
    jax.block_until_ready(m['loss'])

  with sharding.activate(setup.mesh, setup.rules):
    t = common.time_fn(run, warmup=1, iters=args.iters)
  mc = setup.model_config
  return {'residual': wiring, 'n_layers': n_layers, 'ff_chunk_len': ff_chunk_len,
          'stack': mc.stack_name, 'impl': ','.join(dict.fromkeys(transformer.implementations(mc))),
          'params_M': mc.num_params() / 1e6,
          'temp_MB': memory.temp_size_in_bytes / MB,
          'argument_MB': memory.argument_size_in_bytes / MB,
          'step_s': t['median_s']}


def main():
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument('--layers', type=int, nargs='+', default=[2, 4, 8, 16])
  p.add_argument('--residual', nargs='+', default=['pre_ln', 'reversible'],
                 help='model.residual wirings to run')
  p.add_argument('--ff_chunk_len', type=int, nargs='+', default=[0],
                 help='model.ff_chunk_len values to run (0: the whole feed-forward)')
  p.add_argument('--d_model', type=int, default=256)
  p.add_argument('--heads', type=int, default=4)
  p.add_argument('--seq_len', type=int, default=512)
  p.add_argument('--batch', type=int, default=4)
  p.add_argument('--dtype', default='float32', help='compute dtype (float32 on CPU)')
  p.add_argument('--impl', default='auto', help='model.attention_impl')
  p.add_argument('--iters', type=int, default=3)
  p.add_argument('--note', default='', help='saved with the results (e.g. the machine load)')
  p.add_argument('--out', default=os.path.join(common.RESULTS, 'reversible_memory.json'))
  args = p.parse_args()

  rows = []
  for wiring in args.residual:
    for chunk in args.ff_chunk_len:
      first = None
      for n_layers in sorted(args.layers):
        row = bench(wiring, n_layers, chunk, args)
        first = first or row
        row['temp_MB_per_layer'] = ((row['temp_MB'] - first['temp_MB'])
                                    / max(1, n_layers - first['n_layers']))
        rows.append(row)
        print(row, flush=True)
  common.print_table(rows, ['residual', 'ff_chunk_len', 'n_layers', 'stack', 'impl', 'params_M',
                            'temp_MB', 'temp_MB_per_layer', 'argument_MB', 'step_s'])
  common.write_json(args.out, {'d_model': args.d_model, 'heads': args.heads,
                               'seq_len': args.seq_len, 'batch': args.batch,
                               'dtype': args.dtype, 'iters': args.iters, 'note': args.note,
                               'rows': rows})


if __name__ == '__main__':
  main()
