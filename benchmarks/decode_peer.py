"""The peer row of benchmarks/decode.py: x-transformers' cached greedy `generate`, run in its
own process (JAX's CPU runtime and torch's thread pool, in one process, slow each other
down) and printed as one JSON line.

  python -m benchmarks.decode_peer --d_model 256 --depth 4 --heads 4 --head_dim 64 \
      --mlp_dim 704 --vocab 8192 --max_len 512 --batch 8 --prompt 16 --new 256 --iters 3

Needs torch and x-transformers (benchmarks/requirements-peer.txt); prints
{"missing": "<module>"} without them.
"""

import argparse
import json
import os
import time


def peer_model(args, max_len: int):
  """(torch, x-transformers' TransformerWrapper) with the zoo's architecture: pre-norm RMSNorm,
  SwiGLU of width args.mlp_dim, learned absolute positions, normalized queries and keys, untied
  embeddings; torch on every core of this process, seeded. Raises ImportError without torch or
  x-transformers."""
  import torch  # pylint: disable=g-import-not-at-top
  from x_transformers import Decoder, TransformerWrapper  # pylint: disable=g-import-not-at-top
  torch.set_num_threads(len(os.sched_getaffinity(0)))
  torch.manual_seed(0)
  return torch, TransformerWrapper(
      num_tokens=args.vocab, max_seq_len=max_len,
      attn_layers=Decoder(dim=args.d_model, depth=args.depth, heads=args.heads,
                          attn_dim_head=args.head_dim, ff_glu=True, ff_swish=True,
                          ff_mult=args.mlp_dim / args.d_model, use_rmsnorm=True,
                          attn_qk_norm=True))


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  for name in ('d_model', 'depth', 'heads', 'head_dim', 'mlp_dim', 'vocab', 'max_len', 'batch',
               'prompt', 'new', 'iters'):
    parser.add_argument(f'--{name}', type=int, required=True)
  args = parser.parse_args()
  try:
    torch, net = peer_model(args, args.max_len)
    from x_transformers import AutoregressiveWrapper  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    print(json.dumps({'missing': e.name}))
    return
  wrapper = AutoregressiveWrapper(net).eval()
  prompts = torch.randint(0, args.vocab, (args.batch, args.prompt))
  times = []
  with torch.no_grad():
    for i in range(args.iters + 1):  # The first call warms up.
      start = time.perf_counter()
      wrapper.generate(prompts, args.new, temperature=0.0, cache_kv=True)
      if i:
        times.append(time.perf_counter() - start)
  print(json.dumps({'generate_tok_s': args.batch * args.new / min(times),
                    'params': sum(p.numel() for p in net.parameters()),
                    'torch': torch.__version__}))


if __name__ == '__main__':
  main()
