"""--mode=eval's options: which split, and sliding-window scoring of whole documents.

`train.evaluate` asks `options(setup)` what to evaluate (checked before any checkpoint is read
or anything compiled) and, with `eval_window` W > 0, calls `run` instead of the packed rows of
`train.run_eval`.

Sliding windows (for models with absolute positions, whose context ends at the row): each
document of the eval split is tokenized whole ([BOS] + text + [EOS]: n tokens, n - 1 targets,
every token after BOS) and scored by windows of W inputs, positions 0..W-1:

* a document of at most W targets is one window that scores all of them;
* otherwise the first window scores its W targets, each next one starts S tokens later and
  scores only the targets no earlier window scored (its last S), and the last one ends at
  the document's end (it may move by less than S, and scores the rest);
* so every target is scored exactly once (the scored tokens are the split's tokens minus
  one BOS per document, the same pairs as the packed whole-split eval), each from at least
  W - S + 1 inputs (or all of its document's earlier tokens, when there are fewer).

Windows fill rows of eval_batch_size (rows that score nothing pad the last batch) and run
through the same jitted eval step as packed evaluation (steps.EvalStep), so sharding, several
hosts and `eval_steps` (a number of batches, or 0 = the whole split) work as there.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Iterable, Iterator

import jax
import numpy as np
from absl import logging

from input_pipeline import packing, synthetic

DEFAULT_SPLIT = 'validation'


@dataclasses.dataclass(frozen=True)
class Options:
  """What --mode=eval evaluates.

  Attributes:
    split: data.eval_split.
    whole_split: every document of the split is scored (eval_steps = 0).
    window: W, the inputs of a sliding window; 0 = the packed rows of training's eval.
    stride: S, the targets each window after the first scores at most.
  """
  split: str
  whole_split: bool
  window: int = 0
  stride: int = 0

  def describe(self) -> dict:
    """The options, as the eval JSON records them."""
    out = {'split': self.split, 'whole_split': self.whole_split}
    if self.window:
      out.update(window=self.window, stride=self.stride)
    return out

  def filename(self, step: int) -> str:
    """eval_step_<step>[_<split>][_window<W>_stride<S>].json: evaluations of one step with
    other options do not overwrite each other."""
    name = f'eval_step_{step}'
    if self.split != DEFAULT_SPLIT:
      name += f'_{split_tag(self.split)}'
    if self.window:
      name += f'_window{self.window}_stride{self.stride}'
    return name + '.json'


def split_tag(split: str) -> str:
  """A TFDS split string as a file-name part: 'test' -> 'test', 'validation[:10%]' ->
  'validation_-10pct', 'train[5:]' -> 'train_5-'."""
  tag = re.sub(r'[^A-Za-z0-9.-]+', '_', split.replace('%', 'pct').replace(':', '-'))
  return tag.strip('_') or 'split'


def options(setup) -> Options:
  """The eval options of `setup.config`, checked against the model and the data.

  The split itself was checked when the data source was built (an unknown one names the
  splits there are); this checks what only evaluation uses.

  Raises:
    ValueError: a bad window or stride, a window for a model with segment memory or for data
      without documents, or a whole split of a synthetic task.
  """
  config = setup.config
  synthetic_task = config.data.name in synthetic.TASKS
  if synthetic_task and config.eval_steps < 1:
    raise ValueError(f'eval_steps={config.eval_steps}: the synthetic task {config.data.name!r} '
                     'has no finite split; give the number of validation batches (>= 1)')
  window, stride = config.eval_window, config.eval_stride
  split = Options(split=config.data.eval_split, whole_split=config.eval_steps <= 0)
  if window == 0:
    if stride:
      raise ValueError(f'eval_stride={stride} needs a sliding window: set eval_window > 0')
    return split
  if window < 0 or stride < 0:
    raise ValueError(f'eval_window={window} and eval_stride={stride} must be >= 0 '
                     '(eval_window 0 = rows as trained, eval_stride 0 = eval_window / 2)')
  stride = stride or max(window // 2, 1)
  if stride > window:
    raise ValueError(f'eval_stride={stride} is larger than eval_window={window}: windows would '
                     'skip tokens (each window scores at most its last eval_stride tokens)')
  mc = setup.model_config
  if mc.uses_memory:
    raise ValueError(f'eval_window: {",".join(sorted(set(mc.attention)))} attention carries '
                     'segment memory and evaluates the split as a stream already (its context '
                     'reaches past the row); evaluate it without eval_window')
  if window > mc.max_len:
    raise ValueError(f'eval_window={window} is longer than the position table '
                     f'(model.max_len={mc.max_len})')
  if synthetic_task or setup.data.eval_documents is None:
    raise ValueError(f'eval_window needs text documents; data.name={config.data.name!r} has '
                     'fixed-length examples: evaluate it without eval_window')
  if window > setup.data.seq_len:
    logging.warning('eval_window=%d is longer than the trained rows (seq_len=%d): positions '
                    'from %d on were never trained', window, setup.data.seq_len,
                    setup.data.seq_len)
  return dataclasses.replace(split, window=window, stride=stride)


def windows(length: int, window: int, stride: int) -> list[tuple[int, int, int]]:
  """The windows over a document of `length` tokens (length - 1 targets).

  Returns:
    (start, n, first) per window: inputs tokens[start:start + n], targets one further; the
    targets from row position `first` on are scored.
  """
  targets = length - 1
  if targets <= 0:
    return []
  if targets <= window:
    return [(0, targets, 0)]
  out, end = [(0, window, 0)], window  # Targets 1..end are scored.
  while end < targets:
    start = min(end - window + stride, targets - window)
    out.append((start, window, end - start))
    end = start + window
  return out


def _row(tokens: np.ndarray, start: int, n: int, first: int, width: int) -> dict[str, np.ndarray]:
  row = packing.padding_row(width)
  row['inputs'][:n] = tokens[start:start + n]
  row['targets'][:n] = tokens[start + 1:start + n + 1]
  row['weights'][first:n] = 1.0
  row['positions'][:n] = np.arange(n, dtype=np.int32)
  row['segment_ids'][:n] = 1
  return row


def batches(documents: Iterable[np.ndarray], window: int, stride: int, rows: int,
            max_batches: int = 0, counts: dict | None = None) -> Iterator[dict[str, np.ndarray]]:
  """Batches of `rows` windows of width `window` over the documents, in order.

  Args:
    documents: token arrays.
    window: W.
    stride: S.
    rows: rows per batch (this process's).
    max_batches: exactly this many batches (rows past the documents score nothing), or all
      the windows if <= 0.
    counts: if given, its 'documents' and 'windows' count those that were scored.
  """
  counts = counts if counts is not None else {}
  counts.setdefault('documents', 0)
  counts.setdefault('windows', 0)

  def all_rows():
    for tokens in documents:
      spans = windows(len(tokens), window, stride)
      if spans:
        counts['documents'] += 1
      for span in spans:
        counts['windows'] += 1
        yield _row(tokens, *span, window)

  source, done = all_rows(), 0
  while max_batches <= 0 or done < max_batches:
    batch = [row for _, row in zip(range(rows), source)]
    if not batch and max_batches <= 0:
      return
    batch += [packing.padding_row(window)] * (rows - len(batch))
    yield packing.stack(batch)
    done += 1


def run(setup, eval_step, params, opts: Options,
        documents: Iterable[np.ndarray] | None = None) -> dict:
  """Sliding-window evaluation of `documents` (default: this process's eval split).

  Returns:
    train.run_eval's metrics (loss, perplexity, accuracy, scored_tokens and, for text,
    bits_per_byte and scored_bytes) over the scored targets, with 'documents' and 'windows'.
  """
  from training import train  # pylint: disable=import-outside-toplevel  (train calls this)
  if documents is None:
    documents = setup.data.eval_documents()
  config = setup.config
  rows = (config.eval_batch_size or config.batch_size) // jax.process_count()
  counts = {}
  result = train.run_eval(setup, eval_step, params, batches=batches(
      documents, opts.window, opts.stride, rows, config.eval_steps, counts))
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
    summed = np.asarray(multihost_utils.process_allgather(
        np.array([counts['documents'], counts['windows']]))).sum(axis=0)
    counts = {'documents': int(summed[0]), 'windows': int(summed[1])}
  return {**result, **counts}
