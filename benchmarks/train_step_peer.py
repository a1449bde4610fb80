"""The peer row of benchmarks/train_step.py --peer: x-transformers' train step on the C4
recipe's architecture, run in its own process (JAX's CPU runtime and torch's thread pool, in
one process, slow each other down) and printed as one JSON line.

  python -m benchmarks.train_step_peer --d_model 512 --depth 8 --heads 8 --head_dim 64 \
      --mlp_dim 1408 --vocab 8192 --seq_len 512 --batch 8 --iters 10

The step is what a PyTorch user writes for the same model (benchmarks/decode_peer.py's
peer_model, the zoo's architecture): logits, cross-entropy over the vocabulary, backward,
global-norm clipping at 1.0 and AdamW with decoupled weight decay 0.1, float32, eager, on
random tokens.

Needs torch and x-transformers (benchmarks/requirements-peer.txt); prints
{"missing": "<module>"} without them.
"""

import argparse
import json
import statistics
import time

from benchmarks.decode_peer import peer_model


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  for name in ('d_model', 'depth', 'heads', 'head_dim', 'mlp_dim', 'vocab', 'seq_len', 'batch',
               'iters'):
    parser.add_argument(f'--{name}', type=int, required=True)
  parser.add_argument('--profile', type=int, default=0,
                      help='N: also run N steps under torch.profiler and print their split by '
                      'operator kind (the torch side of benchmarks/train_step_profile.py)')
  args = parser.parse_args()
  try:
    torch, net = peer_model(args, args.seq_len)
  except ImportError as e:
    print(json.dumps({'missing': e.name}))
    return
  net.train()
  decay = [p for p in net.parameters() if p.ndim >= 2]
  no_decay = [p for p in net.parameters() if p.ndim < 2]
  opt = torch.optim.AdamW([{'params': decay, 'weight_decay': 0.1},
                           {'params': no_decay, 'weight_decay': 0.0}], lr=1e-4,
                          betas=(0.9, 0.999), eps=1e-8)
  tokens = torch.randint(0, args.vocab, (args.batch, args.seq_len + 1))
  inputs, targets = tokens[:, :-1], tokens[:, 1:]

  def step():
    logits = net(inputs)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, args.vocab), targets.reshape(-1))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()

  step()  # Warm-up.
  times = []
  for _ in range(args.iters):
    start = time.perf_counter()
    step()
    times.append(time.perf_counter() - start)
  median = statistics.median(times)
  out = {'step_ms': 1e3 * median, 'tokens_per_s': args.batch * args.seq_len / median,
         'params': sum(p.numel() for p in net.parameters()), 'torch': torch.__version__,
         'threads': torch.get_num_threads()}
  if args.profile:
    out['split_ms'] = _profile(torch, step, args.profile)
  print(json.dumps(out))


# Operator kinds of the torch profile, by the aten operator's name (first match wins). Torch
# has no module names in its operator events, so the matmuls of the projections, the
# feed-forward and the logits are one kind here.
KINDS = (('attention', ('scaled_dot_product', 'flash_attention', 'softmax_backward', 'bmm',
                        'baddbmm')),
         ('loss (log-softmax, nll)', ('log_softmax', 'nll_loss', 'cross_entropy')),
         ('matmuls (projections, feed-forward, logits)', ('aten::mm', 'aten::addmm',
                                                          'aten::linear', 'aten::matmul')),
         ('optimizer and clipping', ('adamw', 'optimizer', '_foreach', 'clip_grad',
                                     'aten::norm', 'linalg_vector_norm')))


def _profile(torch, step, steps: int) -> dict:
  """{kind: ms per step} of the self CPU time of every operator over `steps` steps."""
  from torch.profiler import ProfilerActivity, profile  # pylint: disable=g-import-not-at-top
  with profile(activities=[ProfilerActivity.CPU]) as prof:
    for _ in range(steps):
      step()
  split = {}
  for event in prof.key_averages():
    name = event.key.lower()
    kind = next((k for k, words in KINDS if any(w.lower() in name for w in words)), 'the rest')
    split[kind] = split.get(kind, 0.0) + event.self_cpu_time_total / 1e3 / steps
  return split


if __name__ == '__main__':
  main()
