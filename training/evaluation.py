"""Evaluation: scoring parameters on the eval split, and --mode=eval.

- `score`: loss, perplexity, accuracy (and bits per byte on text) over the eval batches, or
  any batches given (the training loop's periodic eval, the pruning modes, experiments).
- `score_windows`: the same over sliding windows of whole documents.
- `evaluate_checkpoint`: --mode=eval. It asks `options(setup)` what to evaluate (checked
  before any checkpoint is read or anything compiled) and, with `eval_window` W > 0, scores
  windows instead of the packed rows.

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
import json
import os
import re
from typing import Iterable, Iterator

import jax
import ml_collections
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from input_pipeline import packing, synthetic
from training import assembly, run_config, sharding, steps

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


def score_windows(setup: assembly.Setup, eval_step: steps.EvalStep, params, opts: Options,
                  documents: Iterable[np.ndarray] | None = None) -> dict:
  """Sliding-window evaluation of `documents` (default: this process's eval split).

  Returns:
    score's metrics (loss, perplexity, accuracy, scored_tokens and, for text,
    bits_per_byte and scored_bytes) over the scored targets, with 'documents' and 'windows'.
  """
  if documents is None:
    documents = setup.data.eval_documents()
  config = setup.config
  rows = (config.eval_batch_size or config.batch_size) // setup.data_shard[1]
  counts = {}
  result = score(setup, eval_step, params, batches=batches(
      documents, opts.window, opts.stride, rows, config.eval_steps, counts))
  summed = _sum_over_shards(setup, [counts['documents'], counts['windows']])
  counts = {'documents': int(summed[0]), 'windows': int(summed[1])}
  return {**result, **counts}


def _sum_over_shards(setup: assembly.Setup, values) -> np.ndarray:
  """The sums of `values` over the blocks of the batch rows (setup.data_shard), each block
  counted once: processes that hold the same rows (heads split across the hosts) read the
  same documents. A collective: every process calls it at the same point."""
  values = np.asarray(values, np.float64)
  if jax.process_count() == 1:
    return values
  gathered = np.asarray(multihost_utils.process_allgather(values))
  first = {}  # Block index -> the first process that reads it.
  for process, (index, _) in sorted(sharding.data_shards(setup.mesh).items()):
    first.setdefault(index, process)
  return gathered[sorted(first.values())].sum(axis=0)


def _eval_local_batches(setup: assembly.Setup, batches=None):
  """This process's eval batches (`batches`, default the data's); with a whole split on
  several hosts, every host runs the same number of steps, feeding rows that score nothing
  once its own batches run out."""
  batches = setup.data.eval_batches() if batches is None else iter(batches)
  if not (setup.data.eval_whole_split and jax.process_count() > 1):
    yield from batches
    return
  template = None
  while True:
    local = next(batches, None)
    if local is not None and template is None:
      template = {k: np.zeros_like(v) for k, v in local.items()}
    if not multihost_utils.process_allgather(np.array(local is not None)).any():
      return
    if local is None and template is None:  # This host had no eval data at all.
      raise ValueError(f'process {jax.process_index()} has no rows of data.eval_split; use '
                       'a larger split or a fixed config.eval_steps')
    yield template if local is None else local


def score(setup: assembly.Setup, eval_step: steps.EvalStep, params,
          batches=None) -> dict[str, float]:
  """Loss, perplexity and accuracy over the validation batches (or this process's
  `batches`, e.g. score_windows' windows), and bits per byte on text.

  Segment memory, if the model has it, starts empty and is carried across the eval batches
  (the eval step's own layout: it may be longer than training's).
  """
  totals = {'loss_sum': 0.0, 'correct_sum': 0.0, 'weight_sum': 0.0}
  text_bytes = 0.0
  memory = eval_step.fresh_memory(setup, setup.config.eval_batch_size or setup.config.batch_size)
  with sharding.activate(setup.mesh, setup.rules):
    for local in _eval_local_batches(setup, batches):
      out, memory = eval_step(params, assembly.device_batch(setup, local), memory)
      out = jax.device_get(out)
      for k in totals:
        totals[k] += float(out[k])
      if setup.data.token_bytes is not None:
        text_bytes += float(np.sum(setup.data.token_bytes[local['targets']] * local['weights']))
  w = max(totals['weight_sum'], 1.0)
  loss = totals['loss_sum'] / w
  result = {'loss': loss, 'perplexity': float(np.exp(min(loss, 80.0))),
            'accuracy': totals['correct_sum'] / w, 'scored_tokens': totals['weight_sum']}
  if setup.data.token_bytes is not None:
    text_bytes = float(_sum_over_shards(setup, [text_bytes])[0])
    result['bits_per_byte'] = float(totals['loss_sum'] / np.log(2.0) / max(text_bytes, 1.0))
    result['scored_bytes'] = text_bytes
  return result


def evaluate_checkpoint(config: ml_collections.ConfigDict, workdir: str,
                        request: run_config.Request | None = None) -> dict[str, float]:
  """--mode=eval: restores a checkpoint's parameters onto this machine's mesh and scores them.

  The model is the workdir's recorded one (training/run_config.py); the asked-for keys may
  change run-time and training settings (e.g. eval_steps, the mesh), not the model unless
  allowed. What is evaluated: checkpoint `eval_checkpoint_step` (0 = the latest), split
  `data.eval_split`, `eval_steps` batches or the whole split (0), packed rows or, with
  `eval_window` > 0, sliding windows over whole documents. Writes
  `workdir/eval_step_<step>[_<split>][_window<W>_stride<S>].json` with step, the options,
  loss, perplexity, accuracy, scored tokens (and bytes and bits per byte on text), and the
  keys that differ from the record, if any ('config_overrides').

  Args:
    config: the config given.
    workdir: the training run's workdir.
    request: what the command line asked for; None: every field of `config`.

  Returns:
    The metrics written.
  """
  chosen = []
  restored = assembly.restore(config, workdir, request, step_key='eval_checkpoint_step',
                              check=lambda setup: chosen.append(options(setup)))
  setup, opts = restored.setup, chosen[0]
  eval_step = steps.jit_eval_step(setup, restored.model)
  if opts.window:
    metrics = score_windows(setup, eval_step, restored.params, opts)
  else:
    metrics = score(setup, eval_step, restored.params)
  result = {'step': restored.step, **opts.describe(), **metrics}
  if restored.resolved.changes:
    result['config_overrides'] = {c.key: c.given for c in restored.resolved.changes}
  if jax.process_index() == 0:
    path = os.path.join(workdir, opts.filename(restored.step))
    with open(path, 'w') as f:
      json.dump(result, f, indent=2)
    logging.info('eval at step %d: %s -> %s', result['step'], result, path)
  return result
