"""Input pipelines: every source yields host-local numpy batches keyed by step.

A batch is a dict of (rows, seq_len) arrays: 'inputs', 'targets', 'weights' (1 where the
loss counts), 'positions' (within each document) and 'segment_ids' (document ids, 0 = pad).
With data.packing='stream' (text sources), row r of consecutive training batches continues one
text stream, for segment-level recurrence; see input_pipeline/packing.py.
"""

import dataclasses
import hashlib
from typing import Any, Callable, Iterator

from absl import logging
import numpy as np

from input_pipeline import packing, shards, synthetic, text, tokenizers

DataError = shards.DataError

Batch = dict[str, np.ndarray]
DataState = dict[str, Any]  # JSON-able position of a process's training stream.


@dataclasses.dataclass(frozen=True)
class DataSource:
  """What the training loop needs from a dataset.

  Attributes:
    vocab_size: token ids are in [0, vocab_size).
    seq_len: length of every example.
    train_iter: (step, state) -> iterator of (this process's rows of the global batch, the
      state after that batch), starting at `step` from `state` (None = from the start). A
      restart given the state saved with a checkpoint continues with exactly the batches an
      uninterrupted run would have seen.
    eval_batches: () -> iterator over this process's rows of the validation batches.
    train_batch: step -> this process's rows for that step, for sources where a batch is a
      pure function of (seed, step) (the synthetic tasks); None otherwise.
    chance_loss: loss of a uniform guess over the answers, when the task defines one.
    token_bytes: bytes of text each token id stands for (text data), for bits per byte.
    eval_whole_split: the eval batches cover a whole split, so hosts may see different counts.
    eval_documents: () -> iterator over this process's documents of the eval split, each
      tokenized whole (text data; None for the synthetic tasks), for sliding-window eval.
    close: releases background readers.
    tokenizer: the text tokenizer (input_pipeline/tokenizers.py: encode_batch, decode), for
      sampling; None for the synthetic tasks (their tokens are ids).
    fingerprint: {name: JSON-able value} that identifies the data read (the dataset's name and
      version, its splits' sizes, the vocabulary), which every process of a run must share
      (training/agreement.py).
  """
  vocab_size: int
  seq_len: int
  train_iter: Callable[[int, DataState | None], Iterator[tuple[Batch, DataState]]]
  eval_batches: Callable[[], Iterator[Batch]]
  train_batch: Callable[[int], Batch] | None = None
  chance_loss: float | None = None
  token_bytes: np.ndarray | None = None
  eval_whole_split: bool = False
  eval_documents: Callable[[], Iterator[np.ndarray]] | None = None
  close: Callable[[], None] = lambda: None
  tokenizer: Any = None
  fingerprint: dict[str, Any] = dataclasses.field(default_factory=dict)


# Validation examples are drawn from a seed stream disjoint from any training seed < 10**6.
EVAL_SEED_OFFSET = 10**6


def make_source(config, *, process_index: int = 0, process_count: int = 1,
                workdir: str | None = None,
                shard: tuple[int, int] | None = None) -> DataSource:
  """The data source named by `config.data.name`.

  Args:
    config: the run config.
    process_index: this host's index (process 0 prepares a local corpus and trains a
      SentencePiece model; the others wait for them).
    process_count: number of hosts.
    shard: (index, count): the block of every batch's rows this process reads, block `index`
      of `count` (training/sharding.py's data_shard: the rows its devices hold in the
      batch's layout; processes that hold the same rows read the same rows). Default
      (process_index, process_count): each process its own share.
    workdir: the run's folder; the SentencePiece model goes there unless data.vocab_path
      names a file.

  Returns:
    A DataSource.
  """
  name = config.data.name
  shard = shard or (process_index, process_count)
  if config.data.packing not in packing.MODES:
    raise ValueError(f'data.packing must be one of {packing.MODES}, got {config.data.packing!r}')
  if name in synthetic.TASKS:
    if config.data.packing == 'stream':
      raise ValueError(f"data.packing='stream' needs a text source ({', '.join(text.TFDS_NAMES)}); "
                       f'the synthetic task {name!r} has independent examples')
    if config.data.eval_split != 'validation':
      raise ValueError(f'data.eval_split={config.data.eval_split!r}: the synthetic task '
                       f'{name!r} has no splits; it evaluates on its validation stream (examples '
                       f'drawn from seed + {EVAL_SEED_OFFSET}, apart from training), '
                       "data.eval_split='validation'")
    if config.eval_every_steps and config.eval_steps < 1:
      raise ValueError(f'eval_steps={config.eval_steps}: a synthetic task has no finite split; '
                       'give the number of validation batches (>= 1)')
    fields = {f.name for f in dataclasses.fields(synthetic.TASKS[name])}
    task = synthetic.make_task(name, **{k: v for k, v in config.data.items() if k in fields})
    eval_batch = config.eval_batch_size or config.batch_size
    rows = dict(process_index=shard[0], process_count=shard[1])

    def eval_batches():
      for i in range(config.eval_steps):
        yield task.batch(config.seed + EVAL_SEED_OFFSET, i, eval_batch, **rows)

    def train_batch(step):
      return task.batch(config.seed, step, config.batch_size, **rows)

    def train_iter(step, state=None):
      del state  # A batch is a pure function of (seed, step).
      while True:
        yield train_batch(step), {'step': step + 1}
        step += 1

    return DataSource(
        vocab_size=task.vocab_size, seq_len=task.seq_len, train_iter=train_iter,
        eval_batches=eval_batches, train_batch=train_batch, chance_loss=task.chance_loss,
        fingerprint={'data.task': repr(task), 'data.vocab_size': task.vocab_size})
  if name in text.TFDS_NAMES:
    return _text_source(config, process_index, process_count, workdir, shard)
  raise ValueError(f'unknown data.name {name!r}; known: '
                   f'{", ".join(text.TFDS_NAMES + tuple(sorted(synthetic.TASKS)))}')


def _check_every_share(builder, split: str, role: str, count: int) -> None:
  """Raises ValueError on every process when a process's share of `split` (TFDS's
  split_for_jax_process over `count` processes) would hold no example: that process would
  fail at its first read and leave the others waiting in a collective."""
  if count == 1:
    return
  import tensorflow_datasets as tfds  # pylint: disable=import-outside-toplevel
  empty = [i for i in range(count) if builder.info.splits[
      tfds.split_for_jax_process(split, process_index=i, process_count=count)].num_examples == 0]
  if empty:
    raise ValueError(
        f'data.{role}_split={split!r} has {builder.info.splits[split].num_examples} example(s) '
        f'of {builder.info.full_name}, too few to give each of the {count} processes one '
        f'(process(es) {empty} would read none): use a larger split or fewer processes')


def _text_source(config, process_index, process_count, workdir, shard) -> DataSource:
  """C4 / any TFDS text dataset / local text files, tokenized and packed."""
  data = config.data
  shard_index, shard_count = shard
  for name, rows in (('batch_size', config.batch_size),
                     ('eval batch size', config.eval_batch_size or config.batch_size)):
    if rows % shard_count:
      raise ValueError(f'{name}={rows} is not divisible by the {shard_count} processes')
  if data.pack_min_piece < 0:
    raise ValueError(f'data.pack_min_piece must be >= 0, got {data.pack_min_piece}')
  if data.pack_align < 1 or config.seq_len % data.pack_align:
    raise ValueError(f'data.pack_align={data.pack_align} must be >= 1 and divide '
                     f'seq_len={config.seq_len}')
  if config.seq_len < 1:
    raise ValueError(f'seq_len must be >= 1, got {config.seq_len}')
  builder = text.make_builder(data, process_index=process_index)
  text._check_split(builder, data.train_split, 'train')
  text._check_split(builder, data.eval_split, 'eval')
  shards.check_files(builder, data.train_split, 'train')
  shards.check_files(builder, data.eval_split, 'eval')
  if data.text_key not in builder.info.features:
    raise ValueError(f'data.text_key={data.text_key!r} is not a feature of '
                     f'{builder.info.full_name}: {sorted(builder.info.features)}')
  import tensorflow_datasets as tfds
  for role, split in (('train', data.train_split), ('eval', data.eval_split)):
    _check_every_share(builder, split, role, shard_count)
  train_split = tfds.split_for_jax_process(data.train_split, process_index=shard_index,
                                           process_count=shard_count)
  eval_split = tfds.split_for_jax_process(data.eval_split, process_index=shard_index,
                                          process_count=shard_count)
  if data.tokenizer == 'byte':
    tokenizer = tokenizers.ByteTokenizer()
  elif data.tokenizer == 'sentencepiece':
    path = data.vocab_path
    if not path:
      if not workdir:
        raise ValueError('data.vocab_path is empty and there is no workdir to keep the '
                         'SentencePiece model in')
      path = tokenizers.default_vocab_path(workdir, data.vocab_size, data.spm_model_type)

    def sample():
      docs = text.documents(builder, train_split, text_key=data.text_key, seed=config.seed,
                            shuffle=True)
      return (d for _, d in zip(range(data.spm_sample_docs), docs))

    tokenizer = tokenizers.get_sentencepiece(
        path, vocab_size=data.vocab_size, model_type=data.spm_model_type, sample_fn=sample,
        process_index=process_index)
  else:
    raise ValueError(f"data.tokenizer must be 'sentencepiece' or 'byte', got {data.tokenizer!r}")
  local_rows = config.batch_size // shard_count
  local_eval_rows = (config.eval_batch_size or config.batch_size) // shard_count
  readers = []

  stream = data.packing == 'stream'
  # Over several processes the state is gathered as <= packing.STATE_BYTES of JSON each.
  state_limit = packing.STATE_BYTES if process_count > 1 else None
  if stream and state_limit:  # Fail now if even the smallest state of local_rows cannot fit.
    packing.StreamState(local_rows, tuple(
        (d, 0, packing.segment_id(d)) for d in range(local_rows))).to_json(state_limit)

  shard_order = shards.readable(builder)
  if not shard_order:
    logging.warning('%s is stored as %s, not TFRecord: training reads it through TFDS, and a '
                    'resume re-reads every earlier document (~20K documents/s)',
                    builder.info.full_name, builder.info.file_format)

  def to_json(cursor, legacy):
    if stream:
      state = cursor.to_json(state_limit and state_limit - 16)  # Room for 'order'.
    else:
      state = dataclasses.asdict(cursor)
    return state if legacy else {**state, 'order': shards.ORDER_VERSION}

  def train_iter(step, state=None):
    del step  # The cursor says where the stream is.
    state = dict(state or {})
    order = state.pop('order', None)
    # Written before the shard order, or a dataset it cannot read: TFDS's order, resumed slowly.
    legacy = (bool(state) and order is None) or not shard_order
    if order not in (None, shards.ORDER_VERSION) or (order and not shard_order):
      raise ValueError(f'data state {state!r} has document order {order!r}; this code reads '
                       f'order {shards.ORDER_VERSION} from TFRecord datasets (a checkpoint of '
                       f'newer code, or of another dataset than {builder.info.full_name}?)')
    if stream:
      cursor = packing.StreamState.from_json(state) if state else packing.StreamState()
    elif state and set(state) != {'doc', 'offset'}:
      raise ValueError(f'data state {state!r} is not a data.packing={data.packing!r} state (was '
                       'the checkpoint written with another data.packing?)')
    else:
      cursor = packing.Cursor(**state) if state else packing.Cursor()
    if legacy and state:
      logging.warning('the input state %s was saved in the older tf.data document order: the '
                      'stream resumes exactly in that order, skipping documents (slow, ~20K '
                      'documents/s)', state)
    it = text.Prefetch(
        ((b, to_json(c, legacy)) for b, c in text.train_batches(
            builder, tokenizer, data, split=train_split, seq_len=config.seq_len,
            rows_per_batch=local_rows, seed=config.seed, cursor=cursor, legacy=legacy)),
        depth=data.prefetch_batches)
    readers.append(it)
    return it

  def eval_batches():
    return text.eval_batches(builder, tokenizer, data, split=eval_split, seq_len=config.seq_len,
                             rows_per_batch=local_eval_rows, max_batches=config.eval_steps)

  def eval_documents():
    return text.eval_documents(builder, tokenizer, data, split=eval_split)

  def close():
    for r in readers:
      r.close()

  return DataSource(vocab_size=tokenizer.vocab_size, seq_len=config.seq_len,
                    train_iter=train_iter, eval_batches=eval_batches,
                    token_bytes=tokenizer.token_bytes(), eval_whole_split=config.eval_steps <= 0,
                    eval_documents=eval_documents, close=close, tokenizer=tokenizer,
                    fingerprint=_fingerprint(builder, tokenizer))


def _fingerprint(builder, tokenizer) -> dict[str, Any]:
  """A text source's identity: the prepared dataset (its name, config and version: a local
  corpus's config name carries a hash of its files), every split's size and the vocabulary."""
  return {'data.dataset': builder.info.full_name,
          'data.splits': {name: int(split.num_examples)
                          for name, split in sorted(builder.info.splits.items())},
          'data.vocab_size': int(tokenizer.vocab_size),
          'data.token_bytes': hashlib.sha256(
              np.asarray(tokenizer.token_bytes()).tobytes()).hexdigest()[:16]}
