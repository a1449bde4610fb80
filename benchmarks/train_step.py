"""Train-step throughput and MFU against a matmul peak measured on the same machine.

  python -m benchmarks.train_step                       # d=4 and d=8, seq 512, batch 8
  python -m benchmarks.train_step --d=8 --batch=16 --dtype=bfloat16
  python -m benchmarks.train_step --d 2 --seq_len 16384 --batch 1 --impl blocksparse \
      --attention dense strided selective adaptive_span      # long contexts, blocked paths
  python -m benchmarks.train_step --before bb9b463 --impl blocksparse --rounds 3
  python -m benchmarks.train_step --peer --rounds 3     # against x-transformers, same model

With --peer each round runs, for each size, this tree's train step and then x-transformers'
(benchmarks/train_step_peer.py: the same architecture, cross-entropy, clipping and AdamW in
torch), each in a child process, back to back; the table gives the median tokens/s of each
and their ratio (zoo / peer: above 1 is faster). Without torch and x-transformers
(benchmarks/requirements-peer.txt) the peer row is skipped, with the line that says so.

With --before REV the same table runs on an earlier commit too, in the same run: REV is checked
out with `git worktree` under a temporary folder, and for each round and size its own
benchmarks/train_step.py runs there and then this one here, each in a child process, back to
back, so a slow phase of a shared machine hits both. The table gives each size's median
tokens/s before and after over the rounds, and their ratio (after / before: above 1 is
faster). --before_impl sets REV's attention_impl if it differs (an older tree's 'auto' may
mean another path).

Builds the real sharded train step of training/train.py for the C4 recipe's architecture
(vocab 8192) and times it on random tokens (token values do not change the step time).
MFU = training FLOPs/token (6 N_matmul + 12 L H d_head T) x tokens/s / peak, where the peak
is the best of jitted square float matmuls of several sizes on the same device.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


from training import xla_flags  # noqa: E402

# The environment as the user gave it: a --before child starts from it and applies its own
# tree's defaults (this tree's XLA flags would otherwise pass to the earlier commit).
_USER_ENV = dict(os.environ)
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


def built_step(d: int, seq_len: int, batch: int, dtype: str, impl: str, remat: str = 'none',
               scan: bool | None = None, attention: str = 'dense'):
  """(setup, state, jitted train step, device batch, key) of one configuration: the real
  sharded train step of training/train.py for the C4 recipe's architecture at size d, on random
  tokens (token values do not change the step time); scan None keeps the config's own stack
  ('auto'). benchmarks/roofline_check.py builds its rows here too."""
  config = default.get_config()
  config.model.d = d
  config.model.attention = attention
  config.model.dtype = dtype
  config.model.attention_impl = impl
  config.model.remat = remat
  if scan is not None:
    config.model.stack = 'scan' if scan else 'unrolled'
  config.model.max_len = seq_len
  config.data.name = 'parity'            # Any embedded source: only shapes matter here.
  config.data.num_bits = seq_len // 2    # Parity gives sequences of 2 * num_bits inputs.
  config.batch_size = batch
  config.total_steps = 10**6
  setup = assembly.build(config)
  state = assembly.init_state(setup, 0)
  local = common.random_lm_batch(setup.model_config.vocab_size, batch, seq_len)
  return (setup, state, steps.jit_train_step(setup), assembly.device_batch(setup, local),
          jax.random.key(0))


def bench_step(d: int, seq_len: int, batch: int, dtype: str, impl: str, remat: str,
               scan: bool, iters: int, attention: str = 'dense') -> dict:
  """Times one configuration's train step (first_step_s: its first call, compile included)."""
  setup, state, step, dev_batch, key = built_step(d, seq_len, batch, dtype, impl, remat, scan,
                                                  attention)
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
          'd_model': mc.d_model, 'n_layers': mc.n_layers, 'n_heads': mc.n_heads,
          'head_dim': mc.head_dim, 'mlp_dim': mc.mlp_dim, 'vocab_size': mc.vocab_size,
          'params_M': mc.num_params() / 1e6, 'flops_per_token': fpt, 'step_ms': 1e3 * t['median_s'],
          'tokens_per_s': tok_s, 'achieved_tflops': fpt * tok_s / 1e12}


def _child(tree: str, args, d: int, impl: str) -> dict:
  """One row of `tree`'s benchmarks/train_step.py (its own code), run in a child process."""
  with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, 'rows.json')
    cmd = [sys.executable, '-m', 'benchmarks.train_step', '--d', str(d), '--seq_len',
           str(args.seq_len), '--batch', str(args.batch), '--dtype', args.dtype, '--impl', impl,
           '--remat', args.remat, '--scan', str(args.scan), '--iters', str(args.iters),
           '--out', out]
    proc = subprocess.run(cmd, cwd=tree, env=_USER_ENV, capture_output=True, text=True,
                          check=False)
    if proc.returncode:
      raise RuntimeError(f'train_step in {tree} failed:\n{proc.stderr[-2000:]}')
    with open(out) as f:
      return json.load(f)['rows'][0]


def _paired(values: dict[str, list[float]], first: str, second: str, ratio: str) -> dict:
  """Medians and ranges of two series of tokens/s (keys '<name>_tok_s', '<name>_range'), their
  ratio under the key `ratio` ('first/second' or 'second/first'), and the rounds."""
  med = {name: statistics.median(values[name]) for name in (first, second)}
  num, den = ratio.split('/')
  return {f'{first}_tok_s': med[first], f'{second}_tok_s': med[second],
          ratio: med[num] / med[den],
          f'{first}_range': [min(values[first]), max(values[first])],
          f'{second}_range': [min(values[second]), max(values[second])],
          'rounds': len(values[second])}


def _peer(zoo: dict, args) -> dict:
  """x-transformers' train step on the zoo row's architecture (benchmarks/train_step_peer.py),
  in a child process; {'missing': module} where the peer is not installed."""
  cmd = [sys.executable, '-m', 'benchmarks.train_step_peer', '--d_model', str(zoo['d_model']),
         '--depth', str(zoo['n_layers']), '--heads', str(zoo['n_heads']), '--head_dim',
         str(zoo['head_dim']), '--mlp_dim', str(zoo['mlp_dim']), '--vocab',
         str(zoo['vocab_size']), '--seq_len', str(args.seq_len), '--batch', str(args.batch),
         '--iters', str(args.iters)]
  proc = subprocess.run(cmd, cwd=common.REPO, env=_USER_ENV, capture_output=True, text=True,
                        check=False)
  if proc.returncode:
    raise RuntimeError(f'train_step_peer failed:\n{proc.stderr[-2000:]}')
  return json.loads(proc.stdout.strip().splitlines()[-1])


def against_peer(args) -> None:
  """The --peer table: each size, this tree's train step and x-transformers', alternately."""
  samples = {d: {'zoo': [], 'peer': []} for d in args.d}
  rows, peer_version = [], None
  for r in range(args.rounds):
    for d in args.d:
      zoo = _child(common.REPO, args, d, args.impl)
      peer = _peer(zoo, args)
      if 'missing' in peer:
        print(f'x-transformers row skipped: {peer["missing"]} is not installed '
              '(pip install -r benchmarks/requirements-peer.txt)')
        common.print_table([zoo], ['d', 'seq_len', 'batch', 'impl', 'params_M', 'step_ms',
                                   'tokens_per_s'])
        return
      peer_version = peer['torch']
      samples[d]['zoo'].append(zoo['tokens_per_s'])
      samples[d]['peer'].append(peer['tokens_per_s'])
      params_ratio = peer['params'] / (zoo['params_M'] * 1e6)
      print(f'round {r + 1} d={d}: zoo {zoo["tokens_per_s"]:.0f} ({zoo["impl"]}), '
            f'x-transformers {peer["tokens_per_s"]:.0f} tokens/s '
            f'(parameters x{params_ratio:.4f})', flush=True)
      rows = [{'d': k, 'seq_len': args.seq_len, 'batch': args.batch, 'impl': zoo['impl'],
               **_paired(v, 'zoo', 'peer', 'zoo/peer')}
              for k, v in samples.items() if v['zoo']]
      common.write_json(args.out, {'peer': 'x-transformers', 'torch': peer_version,
                                   'machine': common.machine(), 'settings': vars(args),
                                   'rows': rows})
  common.print_table(rows, ['d', 'seq_len', 'batch', 'impl', 'zoo_tok_s', 'peer_tok_s',
                            'zoo/peer'])


def before_after(args) -> None:
  """The --before table: each size, alternately in REV's tree and in this one."""
  root = common.REPO
  worktree = tempfile.mkdtemp(prefix='train_step_before_')
  subprocess.run(['git', 'worktree', 'add', '--detach', worktree, args.before], cwd=root,
                 check=True, capture_output=True)
  after = subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], cwd=root,
                         capture_output=True, text=True, check=False).stdout.strip()
  samples = {d: {'before': [], 'after': []} for d in args.d}
  rows = []
  try:
    for r in range(args.rounds):
      for d in args.d:
        b = _child(worktree, args, d, args.before_impl or args.impl)
        a = _child(root, args, d, args.impl)
        samples[d]['before'].append(b['tokens_per_s'])
        samples[d]['after'].append(a['tokens_per_s'])
        print(f'round {r + 1} d={d}: before {b["tokens_per_s"]:.0f} ({b["impl"]}), after '
              f'{a["tokens_per_s"]:.0f} ({a["impl"]}) tokens/s', flush=True)
        rows = [{'d': k, 'seq_len': args.seq_len, 'batch': args.batch,
                 'before_impl': args.before_impl or args.impl, 'after_impl': args.impl,
                 **_paired(v, 'before', 'after', 'after/before')}
                for k, v in samples.items() if v['after']]
        common.write_json(args.out, {'before': args.before, 'after': after,
                                     'machine': common.machine(), 'settings': vars(args),
                                     'rows': rows})
  finally:
    subprocess.run(['git', 'worktree', 'remove', '--force', worktree], cwd=root, check=False)
  common.print_table(rows, ['d', 'seq_len', 'batch', 'before_impl', 'after_impl', 'before_tok_s',
                            'after_tok_s', 'after/before'])


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
  p.add_argument('--out', default=None,
                 help='JSON (default results/train_step.json, or train_step_before_after.json '
                 'with --before)')
  p.add_argument('--before', default=None, help='an earlier commit to run the table on too')
  p.add_argument('--before_impl', default=None, help="REV's attention_impl (default: --impl)")
  p.add_argument('--peer', action='store_true',
                 help="x-transformers' train step on the same architecture, alternating with "
                 "this tree's (benchmarks/requirements-peer.txt; skipped when not installed)")
  p.add_argument('--rounds', type=int, default=3, help='--before/--peer: alternating rounds')
  args = p.parse_args()
  if args.peer:
    args.out = args.out or os.path.join(common.RESULTS, 'train_step_peer.json')
    against_peer(args)
    return
  if args.before:
    args.out = args.out or os.path.join(common.RESULTS, 'train_step_before_after.json')
    before_after(args)
    return
  args.out = args.out or os.path.join(common.RESULTS, 'train_step.json')

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
