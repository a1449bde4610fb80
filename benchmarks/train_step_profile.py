"""Where the train step's time goes on this machine: XLA's own profile of the step, split by
what each compiled operation computes.

  python -m benchmarks.train_step_profile                 # d=4 and d=8, seq 512, batch 8
  python -m benchmarks.train_step_profile --d 8 --impl blocksparse --steps 5

Builds the train step of benchmarks/train_step.py (the C4 recipe's architecture, float32,
AdamW), runs it under `jax.profiler.trace`, and reads the trace back: every event XLA:CPU
records for an operation of the step's compiled program (a fusion, a matmul, a custom call, a
loop) is charged to a part of the model by the operation's source location in JAX's name
stack (the `op_name` XLA keeps in each instruction's metadata):

  attention      the attention core: scores, softmax, the weighted values (the kernel call
                 or XLA's blocked loop), and the qk normalization
  qkv/out proj   the attention's input and output projections
  feed-forward   the SwiGLU's three matmuls and its gating
  logits + loss  the output projection fused with the cross-entropy (training/losses.py)
  embed + norms  the embeddings, the RMSNorms and the residual adds
  optimizer      clipping and AdamW's update (everything outside the gradient)

each for the forward and the backward. Events nested in another charged event of the same
thread (a loop's body) are charged once, to the outer one's part. An operation spread over
several threads (XLA:CPU's matmuls run on every core) is charged on each, so the parts add up
to thread-milliseconds (cpu_ms), more than the step's wall time; the table gives each part's
share of them and that share of the step's median wall time (wall_ms). The JSON keeps every
row and the unclassified operations, if any.
"""

import argparse
import collections
import glob
import gzip
import json
import os
import re
import tempfile

from benchmarks import train_step  # noqa: I100  (sets XLA's CPU defaults before JAX starts)

import jax  # noqa: E402,I100

from benchmarks import common  # noqa: E402
from training import sharding  # noqa: E402

PARTS = ('attention', 'qkv/out proj', 'feed-forward', 'logits + loss', 'embed + norms',
         'optimizer')


def part_of(op_name: str) -> tuple[str, str]:
  """(part, 'forward' | 'backward' | '') of one instruction, from its name-stack op_name
  (e.g. 'jit(train_step)/transpose(jvp(Decoder))/block_3/block_3.mlp/...')."""
  if 'transpose(' in op_name:
    direction = 'backward'
  elif 'jvp(' in op_name:
    direction = 'forward'
  else:
    return 'optimizer', ''
  if 'jvp(Decoder)' not in op_name:  # The loss's custom VJP, outside the model's modules.
    return 'logits + loss', direction
  if re.search(r'[/.]mlp\b', op_name):
    return 'feed-forward', direction
  if re.search(r'[/.]attention\b', op_name):
    if 'fused_projection' in op_name or 'project_out' in op_name:
      return 'qkv/out proj', direction
    return 'attention', direction
  return 'embed + norms', direction


_INSTRUCTION = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?metadata=\{[^}]*op_name="([^"]*)"')


def instruction_sources(hlo_text: str) -> dict[str, str]:
  """{instruction name: op_name} of every instruction with metadata in the optimized HLO."""
  out = {}
  for line in hlo_text.splitlines():
    m = _INSTRUCTION.match(line)
    if m:
      out[m.group(1)] = m.group(2)
  return out


def trace_events(trace_dir: str) -> list[dict]:
  """Complete ('X') events of the perfetto trace jax.profiler wrote under trace_dir."""
  files = glob.glob(os.path.join(trace_dir, '**', '*.trace.json.gz'), recursive=True)
  files += glob.glob(os.path.join(trace_dir, '**', 'perfetto_trace.json.gz'), recursive=True)
  if not files:
    raise FileNotFoundError(f'no trace under {trace_dir}')
  with gzip.open(files[0], 'rt') as f:
    data = json.load(f)
  events = data['traceEvents'] if isinstance(data, dict) else data
  return [e for e in events if e.get('ph') == 'X' and 'dur' in e]


def split(events: list[dict], sources: dict[str, str], steps: int) -> tuple[dict, dict]:
  """({(part, direction): ms per step}, {unclassified name: ms per step}) of the events
  that name an instruction of the program; nested events count once, in their outermost."""
  named = [e for e in events if e['name'] in sources]
  by_thread = collections.defaultdict(list)
  for e in named:
    by_thread[(e.get('pid'), e.get('tid'))].append(e)
  totals = collections.Counter()
  for thread_events in by_thread.values():
    thread_events.sort(key=lambda e: (e['ts'], -e['dur']))
    end = -1.0
    for e in thread_events:
      if e['ts'] < end:  # Inside an outer event of this thread.
        continue
      end = e['ts'] + e['dur']
      totals[part_of(sources[e['name']])] += e['dur'] / 1e3 / steps
  unnamed = collections.Counter()
  for e in events:
    if e['name'] not in sources and e['name'].split('.')[0] in ('fusion', 'dot', 'custom-call',
                                                               'while', 'copy'):
      unnamed[e['name']] += e['dur'] / 1e3 / steps
  return dict(totals), dict(unnamed.most_common(20))


def profile(d: int, seq_len: int, batch: int, impl: str, steps: int) -> dict:
  """One size's split: the step's wall time and each part's time per step."""
  setup, state, step, dev_batch, key = train_step.built_step(d, seq_len, batch, 'float32', impl,
                                                             scan=False)
  with sharding.activate(setup.mesh, setup.rules):
    compiled = step.lower(state, dev_batch, key).compile()
    sources = instruction_sources(compiled.as_text())
    holder = {'state': state}

    def run():
      holder['state'], m = compiled(holder['state'], dev_batch, key)
      jax.block_until_ready(m['loss'])

    wall = common.time_fn(run, warmup=2, iters=steps)['median_s']
    with tempfile.TemporaryDirectory() as tmp:
      with jax.profiler.trace(tmp, create_perfetto_trace=True):
        for _ in range(steps):
          run()
      events = trace_events(tmp)
  totals, unnamed = split(events, sources, steps)
  rows = []
  for part in PARTS:
    for direction in ('forward', 'backward', ''):
      ms = totals.get((part, direction))
      if ms:
        rows.append({'d': d, 'part': part, 'pass': direction or '-', 'cpu_ms': ms})
  charged = sum(totals.values())
  for row in rows:
    row['share'] = row['ms'] / charged
    row['wall_ms'] = row['share'] * 1e3 * wall
  return {'d': d, 'seq_len': seq_len, 'batch': batch, 'impl': impl,
          'step_ms': 1e3 * wall, 'charged_ms': charged, 'rows': rows, 'unclassified': unnamed}


def main():
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--d', type=int, nargs='+', default=[4, 8])
  p.add_argument('--seq_len', type=int, default=512)
  p.add_argument('--batch', type=int, default=8)
  p.add_argument('--impl', default='auto')
  p.add_argument('--steps', type=int, default=5)
  p.add_argument('--out', default=os.path.join(common.RESULTS, 'train_step_profile.json'))
  args = p.parse_args()
  results = []
  for d in args.d:
    result = profile(d, args.seq_len, args.batch, args.impl, args.steps)
    results.append(result)
    print(f'd={d}: step {result["step_ms"]:.0f} ms (median, outside the trace); its operations '
          f'ran {result["charged_ms"]:.0f} thread-ms a step')
    common.print_table(result['rows'], ['d', 'part', 'pass', 'cpu_ms', 'share', 'wall_ms'])
    common.write_json(args.out, {'machine': common.machine(), 'settings': vars(args),
                                 'results': results})


if __name__ == '__main__':
  main()
