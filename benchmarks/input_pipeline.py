"""Input-pipeline throughput against what the train step consumes, on this machine.

  python benchmarks/input_pipeline.py                       # ../shared tinyshakespeare
  python benchmarks/input_pipeline.py --files='/data/*.txt' --vocab_size=8000

Prepares a local text corpus as a TFDS dataset (local_text, ~2 KB documents like C4's), then
times the production iterator (tf.data reading + tokenizing + packing + background prefetch,
exactly what the training loop calls) in tokens/s for SentencePiece (packed) and bytes
(concat), and the resume cost (documents skipped per second when restarting mid-stream).
Next to it: tokens/s the train step consumes for the tiny model (d=2) and the C4 recipe's
d=8 model at sequence 512, batch 8, timed here. Target: pipeline >= 5x the step.
"""

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from training import xla_flags  # noqa: E402

xla_flags.set_cpu_defaults()
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')


import input_pipeline  # noqa: E402
from benchmarks import common  # noqa: E402
from configs import default  # noqa: E402

_SHARED = os.path.join(os.path.dirname(__file__), '..', '..', 'shared', 'data', 'tinyshakespeare.txt')


def pipeline_config(args, tokenizer: str, packing: str, batch: int):
  config = default.get_config()
  config.data.name = 'local_text'
  config.data.files = args.files
  config.data.corpus = 'bench'
  config.data.data_dir = os.path.join(args.workdir, 'tfds')
  config.data.chunk_bytes = 2048          # C4's mean document is about 2.2 KB.
  config.data.tokenizer = tokenizer
  config.data.packing = packing
  config.data.vocab_size = args.vocab_size
  config.data.spm_sample_docs = 100_000
  config.data.vocab_path = os.path.join(args.workdir, f'spm_{args.vocab_size}.model')
  config.seq_len = args.seq_len
  config.batch_size = batch
  return config


def bench_pipeline(args, tokenizer: str, packing: str, batch: int) -> dict:
  config = pipeline_config(args, tokenizer, packing, batch)
  t0 = time.perf_counter()
  source = input_pipeline.make_source(config, workdir=args.workdir)
  setup_s = time.perf_counter() - t0
  t0 = time.perf_counter()
  it = source.train_iter(0, None)
  next(it)
  first_s = time.perf_counter() - t0
  real, state = 0.0, None
  t0 = time.perf_counter()
  for _ in range(args.batches):
    b, state = next(it)
    real += float(b['weights'].sum())
  dt = time.perf_counter() - t0
  it.close()
  # Resume cost: restart at the cursor reached, which skips state['doc'] documents.
  t0 = time.perf_counter()
  again = source.train_iter(0, state)
  next(again)
  resume_s = time.perf_counter() - t0
  again.close()
  tokens = args.batches * batch * args.seq_len
  return {'tokenizer': tokenizer, 'packing': packing, 'batch': batch, 'vocab': source.vocab_size,
          'setup_s': setup_s, 'first_batch_s': first_s, 'tokens_per_s': tokens / dt,
          'real_tokens_frac': real / tokens, 'resume_docs': state['doc'], 'resume_s': resume_s,
          'skip_docs_per_s': state['doc'] / resume_s}


def step_tokens_per_s(d: int, seq_len: int, iters: int) -> float:
  from benchmarks import train_step
  row = train_step.bench_step(d, seq_len, 8, 'float32', 'blocksparse', 'none', False, iters)
  return row['tokens_per_s']


def main():
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument('--files', default=_SHARED, help='text file(s): comma-separated globs')
  p.add_argument('--workdir', default=os.path.join(tempfile.gettempdir(), 'bench_input'))
  p.add_argument('--vocab_size', type=int, default=4000,
                 help='SentencePiece pieces (the corpus must support them)')
  p.add_argument('--seq_len', type=int, default=512)
  p.add_argument('--batches', type=int, default=200, help='batches timed per pipeline')
  p.add_argument('--step_iters', type=int, default=3, help='train steps timed per model')
  p.add_argument('--out', default=os.path.join(os.path.dirname(__file__), 'results',
                                               'input_pipeline.json'))
  args = p.parse_args()
  if not args.files or not os.path.exists(args.files.split(',')[0].replace('*', '')) and (
      '*' not in args.files):
    sys.exit(f'no corpus at {args.files!r}: pass --files')

  rows = [bench_pipeline(args, 'sentencepiece', 'packed', 8),
          bench_pipeline(args, 'sentencepiece', 'packed', 256),
          bench_pipeline(args, 'byte', 'concat', 8)]
  common.print_table(rows, ['tokenizer', 'packing', 'batch', 'vocab', 'setup_s', 'first_batch_s',
                            'tokens_per_s', 'real_tokens_frac', 'resume_docs', 'resume_s',
                            'skip_docs_per_s'])
  steps = {f'd={d}': step_tokens_per_s(d, args.seq_len, args.step_iters) for d in (2, 8)}
  pipe = min(r['tokens_per_s'] for r in rows)
  ratios = [{'train_step': k, 'step_tokens_per_s': v, 'slowest_pipeline_tokens_per_s': pipe,
             'pipeline_over_step': pipe / v} for k, v in steps.items()]
  print()
  common.print_table(ratios, ['train_step', 'step_tokens_per_s', 'slowest_pipeline_tokens_per_s',
                              'pipeline_over_step'])
  ok = all(r['pipeline_over_step'] >= 5 for r in ratios)
  print(f'target pipeline >= 5x step: {"met" if ok else "NOT met"}')
  common.write_json(args.out, {'pipelines': rows, 'steps': ratios, 'seq_len': args.seq_len,
                               'files': os.path.abspath(args.files.split(',')[0])})


if __name__ == '__main__':
  main()
