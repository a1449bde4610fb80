"""Train-step throughput and MFU against a matmul peak measured on the same machine.

  python -m benchmarks.train_step                       # d=4 and d=8, seq 512, batch 8
  python -m benchmarks.train_step --d=8 --batch=16 --dtype=bfloat16
  python -m benchmarks.train_step --d 2 --seq_len 16384 --batch 1 --impl blocksparse \
      --attention dense strided selective adaptive_span      # long contexts, blocked paths

Builds the real sharded train step of training/train.py for the C4 recipe's architecture
(vocab 8192) and times it on random tokens (token values do not change the step time).
MFU = training FLOPs/token (6 N_matmul + 12 L H d_head T) x tokens/s / peak, where the peak
is the best of jitted square float matmuls of several sizes on the same device.
"""

import argparse
import os
import time


from training import xla_flags  # noqa: E402

xla_flags.set_cpu_defaults()  # As main.py does, before JAX starts its backend.

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks import common  # noqa: E402
from configs import default  # noqa: E402
from models import transformer  # noqa: E402
from training import assembly, flops, sharding, steps  # noqa: E402,I100


def matmul_peak(dtype) -> tuple[float, int]:
  """Best FLOP/s over square matmul sizes, and the size that reached it."""
  best = max((flops.measure_matmul_peak(n, dtype=dtype, repeats=10), n) for n in (1024, 2048, 4096))
  return best


def bench_step(d: int, seq_len: int, batch: int, dtype: str, impl: str, remat: str,
               scan: bool, iters: int, attention: str = 'dense') -> dict:
  """Times one configuration's train step (first_step_s: its first call, compile included)."""
  config = default.get_config()
  config.model.d = d
  config.model.attention = attention
  config.model.dtype = dtype
  config.model.attention_impl = impl
  config.model.remat = remat
  config.model.stack = 'scan' if scan else 'unrolled'
  config.model.max_len = seq_len
  config.data.name = 'parity'            # Any embedded source: only shapes matter here.
  config.data.num_bits = seq_len // 2    # Parity gives sequences of 2 * num_bits inputs.
  config.batch_size = batch
  config.total_steps = 10**6
  setup = assembly.build(config)
  state = assembly.init_state(setup, 0)
  step = steps.jit_train_step(setup)
  local = common.random_lm_batch(setup.model_config.vocab_size, batch, seq_len)
  dev_batch = assembly.device_batch(setup, local)
  key = jax.random.key(0)
  holder = {'state': state}

  def run():
    holder['state'], m = step(holder['state'], dev_batch, key)
    jax.block_until_ready(m['loss'])

  with sharding.activate(setup.mesh, setup.rules):
    start = time.perf_counter()
    run()
    first = time.perf_counter() - start
    t = common.time_fn(run, warmup=1, iters=iters)
  mc = setup.model_config
  fpt = mc.train_flops_per_token(seq_len)
  tok_s = batch * seq_len / t['median_s']
  # What the layers ran: model.attention_impl resolved ('auto' on one CPU device: cpu_kernel
  # where benchmarks/cpu_choice.py measured it faster on this CPU, else blocksparse).
  ran = ','.join(dict.fromkeys(transformer.implementations(mc)))
  return {'attention': attention, 'first_step_s': first, 'd': d, 'seq_len': seq_len,
          'batch': batch, 'dtype': dtype, 'impl': ran, 'attention_impl': impl, 'remat': remat, 'scan': scan,
          'params_M': mc.num_params() / 1e6, 'flops_per_token': fpt, 'step_ms': 1e3 * t['median_s'],
          'tokens_per_s': tok_s, 'achieved_tflops': fpt * tok_s / 1e12}


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument('--d', type=int, nargs='+', default=[4, 8], help='size knobs to run')
  p.add_argument('--seq_len', type=int, default=512)
  p.add_argument('--attention', nargs='+', default=['dense'], help='model.attention variants')
  p.add_argument('--batch', type=int, default=8)
  p.add_argument('--dtype', default='float32', help='compute dtype (float32 on CPU)')
  p.add_argument('--impl', default='auto',
                 help="model.attention_impl ('auto', 'xla', 'blocksparse', 'cpu_kernel', 'fused')")
  p.add_argument('--remat', default='none')
  p.add_argument('--scan', type=int, default=0,
                 help='1: nn.scan over layers; 0: unrolled (faster on CPU: no per-layer copies)')
  p.add_argument('--iters', type=int, default=10)
  p.add_argument('--out', default=os.path.join(common.RESULTS, 'train_step.json'))
  args = p.parse_args()

  peak, peak_n = matmul_peak(jnp.dtype(args.dtype))
  print(f'measured {args.dtype} matmul peak: {peak / 1e9:.1f} GFLOP/s (n={peak_n}) on '
        f'{jax.devices()[0].device_kind} x{jax.device_count()}')
  rows = []
  for attention in args.attention:
    for d in args.d:
      row = bench_step(d, args.seq_len, args.batch, args.dtype, args.impl, args.remat,
                       bool(args.scan), args.iters, attention)
      row['mfu'] = row['achieved_tflops'] * 1e12 / (peak * jax.device_count())
      rows.append(row)
      common.write_json(args.out, {'matmul_peak_flops': peak, 'matmul_peak_n': peak_n,
                                   'rows': rows})
  common.print_table(rows, ['attention', 'd', 'seq_len', 'first_step_s', 'batch', 'dtype', 'impl',
                            'scan', 'params_M', 'step_ms', 'tokens_per_s', 'achieved_tflops',
                            'mfu'])


if __name__ == '__main__':
  main()
