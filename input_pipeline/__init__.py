"""Input pipelines: every source yields host-local numpy batches keyed by step.

A batch is a dict of (rows, seq_len) arrays: 'inputs', 'targets', 'weights' (1 where the
loss counts), 'positions' (within each document) and 'segment_ids' (document ids, 0 = pad).
"""

import dataclasses
from typing import Callable, Iterator

import numpy as np

from input_pipeline import synthetic

Batch = dict[str, np.ndarray]


@dataclasses.dataclass(frozen=True)
class DataSource:
  """What the training loop needs from a dataset.

  Attributes:
    vocab_size: token ids are in [0, vocab_size).
    seq_len: length of every example.
    train_batch: step -> this process's rows of the global training batch for that step; a
      pure function of (seed, step), so a restarted run sees the same batches.
    eval_batches: () -> iterator over this process's rows of the fixed validation batches.
    chance_loss: loss of a uniform guess over the answers, when the task defines one.
  """
  vocab_size: int
  seq_len: int
  train_batch: Callable[[int], Batch]
  eval_batches: Callable[[], Iterator[Batch]]
  chance_loss: float | None = None


# Validation examples are drawn from a seed stream disjoint from any training seed < 10**6.
EVAL_SEED_OFFSET = 10**6


def make_source(config, *, process_index: int = 0, process_count: int = 1) -> DataSource:
  """The data source named by `config.data.name`.

  Args:
    config: the run config.
    process_index: this host's index.
    process_count: number of hosts.

  Returns:
    A DataSource.
  """
  name = config.data.name
  if name in synthetic.TASKS:
    fields = {f.name for f in dataclasses.fields(synthetic.TASKS[name])}
    task = synthetic.make_task(name, **{k: v for k, v in config.data.items() if k in fields})
    eval_batch = config.eval_batch_size or config.batch_size
    shard = dict(process_index=process_index, process_count=process_count)

    def eval_batches():
      for i in range(config.eval_steps):
        yield task.batch(config.seed + EVAL_SEED_OFFSET, i, eval_batch, **shard)

    return DataSource(
        vocab_size=task.vocab_size, seq_len=task.seq_len,
        train_batch=lambda step: task.batch(config.seed, step, config.batch_size, **shard),
        eval_batches=eval_batches, chance_loss=task.chance_loss)
  if name == 'c4':
    raise NotImplementedError(
        "data.name='c4' needs the TFDS streaming pipeline, which is not in this build yet; "
        'train on a synthetic task instead, e.g. --config=configs/tiny.py')
  raise ValueError(f'unknown data.name {name!r}; known: c4, {", ".join(sorted(synthetic.TASKS))}')
