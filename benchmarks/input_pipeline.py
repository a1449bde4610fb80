"""Input-pipeline throughput against what the train step consumes, on this machine.

  python -m benchmarks.input_pipeline                       # ../shared tinyshakespeare
  python -m benchmarks.input_pipeline --files='/data/*.txt' --vocab_size=8000

Prepares a local text corpus as a TFDS dataset (local_text, ~2 KB documents like C4's), then
times the production iterator (tf.data reading + tokenizing + packing + background prefetch,
exactly what the training loop calls) in tokens/s for SentencePiece (packed) and bytes
(concat), and the resume cost (documents skipped per second when restarting mid-stream).
Next to it: tokens/s the train step consumes for the tiny model (d=2) and the C4 recipe's
d=8 model at sequence 512, batch 8, timed here. Target: pipeline >= 5x the step.

  python -m benchmarks.input_pipeline --sections=resume    # resume cost only (~2 min)

The resume section prepares a C4-shaped TFDS dataset (c4/en:3.0.1, 8 shards of 16,384
~2.2 KB documents) and times the first batch after resuming at documents 10^6, 10^7, 10^8 and
at the shuffle window that starts deepest inside a shard, in the shard order (data state
'order' 2), against the older order that reads every earlier document (measured at 5*10^4,
extrapolated linearly); then the raw in-shard record skip rate, scaled to a C4 shard.
Sections not run keep their previous results in the JSON.
"""

import argparse
import json
import os
import sys
import tempfile
import time


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


# C4 en 3.0.1 as TFDS prepares it (catalog): 364,868,892 training documents in 1024 shards,
# about 806 GiB (train and validation; validation is 0.1%).
C4_TRAIN_DOCS = 364_868_892
C4_TRAIN_SHARDS = 1024
C4_TRAIN_BYTES = 806 * 2**30


def _bench_c4(data_dir: str, shards: int, per_shard: int) -> str:
  """Prepares a C4-shaped TFDS dataset ('c4/en:3.0.1': ~2 KB pseudo-English documents in
  `shards` training shards) under data_dir, once; returns data_dir."""
  import numpy as np
  import tensorflow_datasets as tfds
  if os.path.exists(os.path.join(data_dir, 'c4', 'en', '3.0.1', 'dataset_info.json')):
    return data_dir
  rs = np.random.RandomState(0)
  words = np.array([''.join(rs.choice(list('etaoinshrdlucmfwyp'), rs.randint(2, 9)))
                    for _ in range(5000)])

  class BenchC4(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    name = 'c4'
    VERSION = tfds.core.Version('3.0.1')
    BUILDER_CONFIGS = [tfds.core.BuilderConfig(name='en')]

    def _info(self):
      return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(
          {'text': tfds.features.Text(), 'url': tfds.features.Text()}))

    def _split_generators(self, dl_manager):
      del dl_manager
      return {'train': self._generate_examples(shards * per_shard, 1),
              'validation': self._generate_examples(100, 2)}

    def _generate_examples(self, count, seed):
      r = np.random.RandomState(seed)
      for i in range(count):
        text = ' '.join(words[r.randint(0, len(words), r.randint(200, 500))])
        yield i, {'text': text, 'url': f'https://example.com/{i}'}

  BenchC4(config='en', data_dir=data_dir).download_and_prepare(
      download_config=tfds.download.DownloadConfig(num_shards=shards))
  return data_dir


def _first_batch_s(config, state) -> float:
  """Seconds from train_iter(state) to its first batch, on a fresh source."""
  source = input_pipeline.make_source(config)
  try:
    t0 = time.perf_counter()
    it = source.train_iter(0, state)
    next(it)
    return time.perf_counter() - t0
  finally:
    source.close()


def bench_resume(args) -> dict:
  """Time to the first batch when resuming at document p: the shard order (data state order 2)
  at 10^6 .. 10^8 and at the worst place (the last window of a shard), against the older
  skip-every-document order at smaller p; and the raw in-shard record skip rate."""
  import tensorflow as tf
  import tensorflow_datasets as tfds
  data_dir = _bench_c4(os.path.join(args.workdir, 'resume_tfds'), args.resume_shards,
                       args.resume_docs_per_shard)
  config = default.get_config()
  config.data.data_dir = data_dir
  config.data.tokenizer = 'byte'
  config.data.packing = 'packed'
  config.seq_len = args.seq_len
  config.batch_size = 8
  window = config.data.shuffle_buffer
  builder = tfds.builder('c4/en:3.0.1', data_dir=data_dir)
  info = builder.info.splits['train']
  epoch = info.num_examples
  per_shard = info.shard_lengths[0]
  # The window that starts deepest inside a shard: the most records skipped undecoded.
  worst = max(range(0, epoch - window + 1, window), key=lambda start: start % per_shard)
  rows = []
  for label, p in (('start', 0), ('1e6', 10**6), ('1e7', 10**7), ('1e8', 10**8),
                   ('worst in-shard', 10 * epoch + worst)):
    s = _first_batch_s(config, {'doc': p, 'offset': 0, 'order': 2})
    rows.append({'order': 'shards (new)', 'resume_at_doc': p, 'where': label,
                 'records_skipped': (p % epoch) // window * window % per_shard,
                 'first_batch_s': s})
  base = rows[0]['first_batch_s']
  legacy = []
  for p in args.legacy_positions:
    s = _first_batch_s(config, {'doc': p, 'offset': 0})
    legacy.append({'order': 'tf.data skip (old)', 'resume_at_doc': p, 'where': 'measured',
                   'records_skipped': p, 'first_batch_s': s})
  rate = (legacy[-1]['resume_at_doc'] - legacy[0]['resume_at_doc']) / max(
      legacy[-1]['first_batch_s'] - legacy[0]['first_batch_s'], 1e-9)
  for p in (10**6, 10**7, 10**8):
    legacy.append({'order': 'tf.data skip (old)', 'resume_at_doc': p,
                   'where': f'extrapolated at {rate:,.0f} docs/s', 'records_skipped': p,
                   'first_batch_s': legacy[0]['first_batch_s'] + (p - legacy[0]['resume_at_doc'])
                   / rate})
  # Raw skip inside one shard (records read, not parsed): records/s and bytes/s.
  shard_file = builder.info.splits['train'].file_instructions[0].filename
  shard_bytes = tf.io.gfile.stat(shard_file).length
  t0 = time.perf_counter()
  for _ in tf.data.TFRecordDataset(shard_file, buffer_size=8 << 20).skip(per_shard - 1):
    pass
  skip_s = time.perf_counter() - t0
  c4_shard_records = C4_TRAIN_DOCS / C4_TRAIN_SHARDS
  c4_shard_bytes = C4_TRAIN_BYTES / C4_TRAIN_SHARDS
  skip = {'bench_docs_per_epoch': epoch, 'bench_shards': len(info.shard_lengths),
          'bench_records_per_shard': per_shard, 'bench_shard_bytes': shard_bytes,
          'shuffle_window': window, 'in_shard_skip_records_per_s': (per_shard - 1) / skip_s,
          'in_shard_skip_mb_per_s': shard_bytes / skip_s / 1e6,
          'c4_shard_records': c4_shard_records, 'c4_shard_bytes': c4_shard_bytes,
          'c4_worst_in_shard_skip_s_local_disk': c4_shard_bytes / (shard_bytes / skip_s),
          'c4_worst_resume_s_local_disk_estimate':
              max(r['first_batch_s'] for r in rows[1:]) - base
              + c4_shard_bytes / (shard_bytes / skip_s),
          'old_order_docs_per_s': rate,
          'old_order_resume_s_at_1e8_estimate': 10**8 / rate}
  return {'resume': rows + legacy, 'skip': skip}


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
  p.add_argument('--out', default=os.path.join(common.RESULTS, 'input_pipeline.json'))
  p.add_argument('--sections', default='pipeline,resume',
                 help='comma-separated: pipeline (throughput against the step), resume')
  p.add_argument('--resume_shards', type=int, default=8)
  p.add_argument('--resume_docs_per_shard', type=int, default=16384)
  p.add_argument('--legacy_positions', type=lambda v: [int(x) for x in v.split(',')],
                 default=[0, 50_000], help='documents skipped by the old order, measured')
  args = p.parse_args()
  sections = set(args.sections.split(','))
  results = {}
  if os.path.exists(args.out):  # Sections not run keep their last results.
    with open(args.out) as f:
      results = json.load(f)
  if 'resume' in sections:
    resume = bench_resume(args)
    common.print_table(resume['resume'], ['order', 'resume_at_doc', 'where', 'records_skipped',
                                          'first_batch_s'])
    print()
    common.print_table([resume['skip']], list(resume['skip']))
    results['resume'] = resume
    common.write_json(args.out, results)
  if 'pipeline' not in sections:
    return
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
  results.update({'pipelines': rows, 'steps': ratios, 'seq_len': args.seq_len,
                  'files': os.path.abspath(args.files.split(',')[0])})
  common.write_json(args.out, results)


if __name__ == '__main__':
  main()
