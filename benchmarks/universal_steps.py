"""What the universal stack's steps cost: evaluation that stops once every position has
halted, and training, which computes every step.

  python -m benchmarks.universal_steps                      # d_model 256, seq 512, batch 8
  python -m benchmarks.universal_steps --seq 256 --iters 3  # quicker

One weight-shared pre_ln block of dense attention (float32, 4 heads), M = 8.

- eval: the deterministic forward of an ACT model whose positions all halt after exactly k
  steps (halting unit set to a constant h = 0.99 / k + 1e-4), through the early-stopping
  while loop (what evaluation runs) and through the masked scan over all M steps (what a
  call that collects intermediates runs); the two give the same logits (checked here).
- train: value and gradient of the loss for fixed-step models of T = 1, 2, 4, 8 and for the
  ACT model (M = 8): the masked scan runs all M steps whatever the halting, so ACT costs
  about as much as T = M; the MFU counts only the steps the tokens took (the mean N).

Writes results/universal_steps.json.
"""

import argparse
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import (RESULTS, print_table, random_lm_batch, time_fn,  # noqa: E402
                               write_json)
from models import transformer  # noqa: E402

M = 8


def _config(args, **stack_options):
  m = dict(vocab_size=512, d_model=args.d_model, n_heads=4, max_len=args.seq,
           attention='dense', attention_impl='xla', stack='universal', dtype='float32',
           position_embedding='none', stack_options={'max_steps': M, **stack_options})
  return transformer.TransformerConfig.from_config(m)


def _halting_after(params, k):
  """params with a constant halting probability that halts every position at step k."""
  h = 0.99 / k + 1e-4
  halting = {'kernel': jnp.zeros_like(params['universal']['step']['halting']['kernel']),
             'bias': jnp.asarray(np.log(h / (1 - h)), jnp.float32)}
  step = {**params['universal']['step'], 'halting': halting}
  return {**params, 'universal': {'step': step}}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--d_model', type=int, default=256)
  parser.add_argument('--seq', type=int, default=512)
  parser.add_argument('--batch', type=int, default=8)
  parser.add_argument('--iters', type=int, default=5)
  parser.add_argument('--out', default=os.path.join(RESULTS, 'universal_steps.json'))
  args = parser.parse_args()
  batch = random_lm_batch(512, args.batch, args.seq)
  x = jnp.asarray(batch['inputs'])

  act = _config(args, act=True)
  model = transformer.Decoder(act)
  params = nn.unbox(model.init(jax.random.key(0), x[:1])['params'])
  early = jax.jit(lambda p: model.apply({'params': p}, x))
  scanned = jax.jit(lambda p: model.apply({'params': p}, x, mutable=['intermediates']))
  eval_rows = []
  for k in (1, 2, 4, 8):
    p = _halting_after(params, k)
    logits, sown = scanned(p)
    steps = np.asarray(sown['intermediates']['universal']['act_steps'][0])
    assert (steps == k).all(), (k, np.unique(steps))
    diff = float(jnp.max(jnp.abs(early(p) - logits)))
    t_early = time_fn(lambda: early(p).block_until_ready(), iters=args.iters)['median_s']
    t_scan = time_fn(lambda: jax.block_until_ready(scanned(p)), iters=args.iters)['median_s']
    eval_rows.append({'halts_at': k, 'early_stop_ms': 1e3 * t_early,
                      'full_scan_ms': 1e3 * t_scan, 'speedup': t_scan / t_early,
                      'max_logit_diff': diff})
  print(f'eval forward, ACT with M={M} (d_model {args.d_model}, seq {args.seq}, batch '
        f'{args.batch}):')
  print_table(eval_rows, ['halts_at', 'early_stop_ms', 'full_scan_ms', 'speedup',
                          'max_logit_diff'])

  train_rows = []
  targets = jnp.asarray(batch['targets'])
  for name, cfg in [*[(f'fixed T={t}', _config(args, steps=t)) for t in (1, 2, 4, 8)],
                    (f'ACT M={M}', act)]:
    m = transformer.Decoder(cfg)
    p = nn.unbox(m.init(jax.random.key(0), x[:1])['params'])

    def loss(p, m=m):
      logits, sown = m.apply({'params': p}, x, deterministic=False, mutable=['losses'],
                             rngs={'dropout': jax.random.key(0)})
      ce = -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1))
      return ce + sum(jnp.sum(v) for v in jax.tree.leaves(sown.get('losses', {})))

    step = jax.jit(jax.value_and_grad(loss))
    t = time_fn(lambda: jax.block_until_ready(step(p)), iters=args.iters)['median_s']
    train_rows.append({'model': name, 'step_ms': 1e3 * t,
                       'flops_per_token_model': cfg.train_flops_per_token(args.seq)})
  print('\ntrain step (loss and gradients):')
  print_table(train_rows, ['model', 'step_ms', 'flops_per_token_model'])
  write_json(args.out, {'config': vars(args), 'eval': eval_rows, 'train': train_rows})


if __name__ == '__main__':
  main()
