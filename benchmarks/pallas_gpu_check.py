"""The GPU kernel's first check on a lent GPU: attention_impl='pallas' (pallas_gpu.py, Pallas
Triton) against 'blocksparse' (the engine) on each variant it computes, before any timing.

  python -m benchmarks.pallas_gpu_check                          # on a GPU
  python -m benchmarks.pallas_gpu_check --interpret --seq-len 64 --d-model 64   # on a CPU

Per variant, a one-layer model's loss and every parameter's gradient with 'pallas' and with
'blocksparse' on the same batch (two documents a row, the second ragged): the loss's relative
difference and each gradient's largest difference over its largest magnitude must be within
the tolerance (bfloat16: 2e-2, test_pallas_kernel.py's; float32: 1e-3, as a GPU's
matmuls run in TF32 by default). It also writes the compile time and the median train-step
time of both (the kernel has never run on a GPU: a Triton compile error or a wrong result is
what this run is for; benchmarks/gpu_variant_speed.sh part 3 times it at 4K-16K).

--interpret runs the same kernels in Pallas interpret mode on a CPU (the engine's kernel
switched to 'pallas_gpu' for the CPU target), to check this script itself. The exit status is
1 when a variant fails or differs. Results go to --out (default
/tmp/pallas_gpu_check.json).
"""

import argparse
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common
from models import transformer
from models.attention import base

VARIANTS = ('dense', 'strided', 'fixed', 'local', 'block_local', 'local_global',
            'adaptive_span', 'dynamic_span', 'txl', 'selective')
# Options that keep the patterns sparse at the check's lengths; fixed's heads read distinct
# summary blocks (the GPU kernel's per-head masks).
OPTIONS = {'strided': dict(stride=16), 'fixed': dict(stride=16, summary=4, distinct_heads=True),
           'local': dict(window=48), 'local_global': dict(window=48, global_every=2),
           'block_local': {}, 'adaptive_span': dict(limit=256), 'dynamic_span': dict(limit=256),
           'txl': dict(mem_len=0), 'selective': dict(lmem_eps=0.1)}
TOLERANCE = {'bfloat16': 2e-2, 'float32': 1e-3}
COLUMNS = ('variant', 'ok', 'loss_rel_diff', 'grad_max_diff', 'pallas_compile_s',
           'pallas_step_ms', 'blocksparse_step_ms', 'error')


def _config(variant: str, impl: str, args) -> transformer.TransformerConfig:
  return transformer.TransformerConfig.from_config(dict(
      d_model=args.d_model, n_heads=args.d_model // 64 if args.d_model >= 128 else 2,
      n_layers=2 if variant == 'local_global' else 1, vocab_size=256, max_len=args.seq_len,
      attention=variant, attention_impl=impl, dtype=args.dtype,
      target_platform='cpu' if args.interpret else '',
      position_embedding='none' if variant == 'txl' else 'learned',
      attention_options={variant: OPTIONS.get(variant, {})}))


def _batch(args):
  """Random tokens, two documents a row: the first 5/8 of the row, then the rest less 5
  padding positions."""
  n = args.seq_len
  first, pad = 5 * n // 8, 5
  tokens = np.random.default_rng(0).integers(0, 256, (args.batch, n)).astype(np.int32)
  segments = np.r_[[1] * first, [2] * (n - first - pad), [0] * pad][None].repeat(args.batch, 0)
  positions = np.r_[np.arange(first), np.arange(n - first - pad), np.zeros(pad, int)][None]
  return (jnp.asarray(tokens), jnp.asarray(positions.repeat(args.batch, 0)),
          jnp.asarray(segments))


def _step(variant: str, impl: str, args):
  model = transformer.Decoder(_config(variant, impl, args))
  tokens, positions, segments = _batch(args)

  def loss(params):
    logits, state = model.apply({'params': params}, tokens, positions=positions,
                                segment_ids=segments, mutable=['losses'])
    aux = sum(jnp.sum(x) for x in jax.tree.leaves(state.get('losses', {})))
    return jnp.mean(jnp.sin(logits.astype(jnp.float32))) + aux

  return jax.jit(jax.value_and_grad(loss))


def check(variant: str, args) -> dict:
  """One variant's row (see the module's docstring)."""
  row = {'variant': variant}
  tokens = _batch(args)[0]
  params = transformer.Decoder(_config(variant, 'blocksparse', args)).init(
      jax.random.key(0), tokens[:, :8])['params']
  timed = {}
  for impl in ('pallas', 'blocksparse'):
    step = _step(variant, impl, args)
    start = time.perf_counter()
    result = jax.block_until_ready(step(params))
    row[f'{impl}_compile_s'] = round(time.perf_counter() - start, 2)
    row[f'{impl}_step_ms'] = round(1e3 * common.time_fn(
        lambda step=step: jax.block_until_ready(step(params)), warmup=1,
        iters=args.iters)['median_s'], 3)
    timed[impl] = result
  (value, grads), (want, want_grads) = timed['pallas'], timed['blocksparse']
  row['loss_rel_diff'] = float(abs(value - want) / max(abs(float(want)), 1e-6))
  diffs = [float(jnp.max(jnp.abs(g.astype(jnp.float32) - w.astype(jnp.float32)))
                 / (float(jnp.max(jnp.abs(w.astype(jnp.float32)))) or 1.0))
           for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads))]
  row['grad_max_diff'] = max(diffs)
  tol = TOLERANCE[args.dtype]
  row['ok'] = bool(row['loss_rel_diff'] <= tol and row['grad_max_diff'] <= tol
                   and np.isfinite(row['grad_max_diff']))
  return row


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--variants', nargs='+', default=list(VARIANTS))
  parser.add_argument('--seq-len', type=int, default=1024)
  parser.add_argument('--batch', type=int, default=2)
  parser.add_argument('--d-model', type=int, default=256, help='64 per head (2 heads below 128)')
  parser.add_argument('--dtype', default='bfloat16', choices=tuple(TOLERANCE))
  parser.add_argument('--iters', type=int, default=5)
  parser.add_argument('--interpret', action='store_true',
                      help='run the GPU kernel in Pallas interpret mode on a CPU')
  parser.add_argument('--out', default='/tmp/pallas_gpu_check.json')
  args = parser.parse_args()
  if args.interpret:
    engine = base.MultiHeadAttention.engine
    base.MultiHeadAttention.engine = lambda self: (
        {'kernel': 'pallas_gpu', 'interpret': True} if self.impl == 'pallas' else engine(self))
  elif jax.default_backend() != 'gpu':
    parser.error(f'no GPU here (backend {jax.default_backend()!r}): run with --interpret')
  rows = []
  for variant in args.variants:
    if variant not in VARIANTS:
      continue
    try:
      rows.append(check(variant, args))
    except Exception as e:  # pylint: disable=broad-except
      traceback.print_exc()
      rows.append({'variant': variant, 'ok': False, 'error': f'{type(e).__name__}: {e}'[:300]})
    common.print_table(rows[-1:], COLUMNS)
    common.write_json(args.out, {'args': vars(args), 'rows': rows})
  print()
  common.print_table(rows, COLUMNS)
  raise SystemExit(0 if rows and all(r['ok'] for r in rows) else 1)


if __name__ == '__main__':
  main()
