"""Generation speed: prefill and decode tokens/s of the compiled sampler (models/decode.py),
the decoding cache's bytes per variant, and, when torch and x-transformers are installed
(benchmarks/requirements-peer.txt), the same architecture's cached `generate` timed in the
same run.

  python -m benchmarks.decode                       # d = 4, 8; batch 1, 8; prompt 16 + 256 new
  python -m benchmarks.decode --depths 4 --batches 8 --iters 1   # quicker

The model is the zoo's d-knob shape (d_model 64 d, d heads of 64, d layers, SwiGLU 8/3
d_model rounded up to 64, vocabulary 8192, max_len 512, float32, dense causal attention),
greedy (temperature 0): every row generates all its new tokens. On CPU the decoding steps run
the decode kernels (models/attention/kernels/decode_cpu.cc); the prefill is the XLA forward.

- prefill tok/s: prompt tokens / time of the prompt's one forward that fills the caches;
- decode tok/s: new tokens / (time of the whole `generate` call - the prefill's);
- generate tok/s: new tokens / time of the whole call (prefill included): what a user waits
  for, and what the peer's row measures (x-transformers' `generate` with cache_kv=True,
  same shapes, its learned absolute positions, RMSNorm, SwiGLU, QK-norm, torch threads =
  the CPUs this process may use), in its own process (benchmarks/decode_peer.py: JAX's
  runtime and torch's threads in one process slow each other down), run right after ours;
  ratio = ours / the peer's.
- cache rows (d = 4, batch 8): generate tok/s and cache bytes (keys and values at max_len)
  of each variant that decodes.

Writes results/decode.json.
"""

import argparse
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import RESULTS, print_table, time_fn, write_json  # noqa: E402
from models import decode, transformer  # noqa: E402

VOCAB = 8192
MAX_LEN = 512
# Variants timed for the cache table, with the options that make them what they are.
VARIANTS = {
    'dense': {},
    'local': {'window': 64},
    'strided': {'stride': 16},
    'fixed': {'stride': 16, 'summary': 4},
    'adaptive_span': {'limit': 128},
    'selective': {},
    'txl': {'mem_len': 128},
}


def config(depth: int, attention: str = 'dense', options=None):
  """The d-knob model of `depth`, float32, XLA attention."""
  position = 'none' if attention == 'txl' else 'learned'
  return transformer.TransformerConfig.from_config(dict(
      vocab_size=VOCAB, d_model=64 * depth, n_heads=depth, n_layers=depth, max_len=MAX_LEN,
      attention=attention, attention_impl='xla', attention_options={attention: options or {}},
      position_embedding=position, dtype='float32'))


def ours(cfg, batch: int, prompt: int, new: int, iters: int) -> dict:
  """Prefill, decode and whole-call speed of decode.generate (greedy)."""
  model = transformer.Decoder(cfg)
  params = nn.unbox(model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))['params'])
  prompts = jax.random.randint(jax.random.key(1), (batch, prompt), 0, VOCAB)
  lengths = np.full((batch,), prompt)
  rng = jax.random.key(2)

  def whole():
    tokens, _ = decode.generate(model, params, prompts, lengths, new, rng, temperature=0.0)
    tokens.block_until_ready()

  dec_model, dec_params = decode.unrolled(model, params)
  cache = decode.init_cache(dec_model, dec_params, batch)
  run_prefill = jax.jit(lambda p, c, x: decode.prefill(dec_model, p, c, x))

  def prefill():
    jax.block_until_ready(run_prefill(dec_params, cache, prompts))

  total = time_fn(whole, warmup=1, iters=iters)['best_s']
  first = (time_fn(prefill, warmup=1, iters=iters)['best_s'] if decode.can_prefill(cfg)
           else float('nan'))
  return {'prefill_tok_s': batch * prompt / first,
          'decode_tok_s': batch * new / (total - (0.0 if np.isnan(first) else first)),
          'generate_tok_s': batch * new / total,
          'cache_bytes': decode.cache_bytes(cache)}


def peer(cfg, batch: int, prompt: int, new: int, iters: int) -> dict | None:
  """x-transformers' cached greedy generate of the same shapes, timed in its own process
  (benchmarks/decode_peer.py); None if torch or x-transformers is not installed."""
  command = [sys.executable, os.path.join(REPO, 'benchmarks/decode_peer.py'),
             f'--d_model={cfg.d_model}', f'--depth={cfg.n_layers}', f'--heads={cfg.n_heads}',
             f'--head_dim={cfg.head_dim}', f'--mlp_dim={cfg.mlp_dim}', f'--vocab={VOCAB}',
             f'--max_len={MAX_LEN}', f'--batch={batch}', f'--prompt={prompt}', f'--new={new}',
             f'--iters={iters}']
  out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
  result = json.loads(out.strip().splitlines()[-1])
  if 'missing' in result:
    print(f'peer rows skipped: {result["missing"]} is not installed '
          '(pip install -r benchmarks/requirements-peer.txt)')
    return None
  return result


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--depths', default='4,8')
  parser.add_argument('--batches', default='1,8')
  parser.add_argument('--prompt', type=int, default=16)
  parser.add_argument('--new', type=int, default=256)
  parser.add_argument('--iters', type=int, default=3)
  parser.add_argument('--variants', default=','.join(VARIANTS),
                      help='cache table rows (at the first depth, the last batch)')
  parser.add_argument('--out', default=os.path.join(RESULTS, 'decode.json'))
  args = parser.parse_args()
  depths = [int(d) for d in args.depths.split(',')]
  batches = [int(b) for b in args.batches.split(',')]

  speed = []
  for depth in depths:
    cfg = config(depth)
    for batch in batches:
      row = {'d': depth, 'batch': batch,
             'params': transformer.count_params(cfg),
             **ours(cfg, batch, args.prompt, args.new, args.iters)}
      other = peer(cfg, batch, args.prompt, args.new, args.iters)
      if other is not None:
        row['peer_params'] = other['params']
        row['peer_generate_tok_s'] = other['generate_tok_s']
        row['ratio'] = row['generate_tok_s'] / other['generate_tok_s']
      speed.append(row)
      print_table([row], list(row))
  print('\ngeneration (greedy, prompt %d + %d new, float32)' % (args.prompt, args.new))
  columns = ['d', 'batch', 'params', 'prefill_tok_s', 'decode_tok_s', 'generate_tok_s',
             'peer_generate_tok_s', 'ratio', 'cache_bytes']
  print_table(speed, columns)

  caches = []
  for name in args.variants.split(','):
    cfg = config(depths[0], name, VARIANTS.get(name, {}))
    row = {'variant': name, 'd': depths[0], 'batch': batches[-1],
           'prefill': 'forward' if decode.can_prefill(cfg) else 'token by token',
           **ours(cfg, batches[-1], args.prompt, args.new, args.iters)}
    caches.append(row)
  print('\ncache per variant')
  print_table(caches, ['variant', 'd', 'batch', 'prefill', 'prefill_tok_s', 'decode_tok_s',
                       'generate_tok_s', 'cache_bytes'])
  write_json(args.out, {'command': ' '.join(sys.argv), 'prompt': args.prompt, 'new': args.new,
                        'speed': speed, 'caches': caches})


if __name__ == '__main__':
  main()
