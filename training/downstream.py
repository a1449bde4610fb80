"""Downstream tasks through EleutherAI's lm-evaluation-harness (lm-eval): what the zoo
computes for it, and the tasks it reads. --mode=harness and the lm-eval model itself are in
training/zoo_lm.py, the one module that imports lm_eval at its top.

`Scorer` is what the model computes for lm-eval, in the project's own terms (a restored
checkpoint, its mesh, its compiled programs):

- `loglikelihood`: (context, continuation) pairs as token ids, scored in rows of
  `harness.batch_size`, grouped by length into buckets (widths 16, 32, ..., up to the
  model's window max_len): one compiled program per bucket;
- `loglikelihood_rolling`: a whole text scored by windows of max_len inputs
  (evaluation.windows with the stride equal to the window: each target once, the last
  window with full context, as lm-eval's rolling loglikelihood asks);
- `generate`: the compiled sampler of --mode=generate (sampling.sample_ids), prompts grouped
  by length bucket; stop strings cut the decoded text.

A context longer than the window is cut from the left (as lm-eval's Hugging Face model does),
with one warning per model, except for a segment-memory variant (Transformer-XL, adaptive
span's segment cache): it reads a context or text of any length in consecutive segments of
max_len with its memory carried, as --mode=eval reads a stream, so its context reaches as far
as its memory does. Generation cuts contexts for every variant.

Text: a run on text has a tokenizer: a context is [BOS] + its tokens; a continuation's
tokens are those of context + continuation past the context's (the context's trailing
spaces moved to the continuation, as lm-eval's Hugging Face model does). A synthetic task has
none: texts are whitespace-separated token ids, taken as written (their rows start with
BOS = 1), as --mode=generate reads its prompts.

Tasks: `load_tasks` checks the names and reads every task's data (one line for an unknown
name or data out of reach). `local_tasks` writes the run's own task:
`zoo_variable_assignment` for a Variable Assignment run, in multiple-choice form: the
examples --mode=eval scores (the validation stream, the same rows), each a choice among the
task's values. A choice among the values is never harder than --mode=eval's argmax over the
whole vocabulary, so its accuracy is at least eval's.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging

import input_pipeline
from input_pipeline import synthetic
from models import transformer
from training import assembly, evaluation, sampling, sharding

PAD, BOS, EOS = synthetic.PAD, synthetic.BOS, synthetic.EOS

LM_EVAL_VERSION = '0.4.13'
INSTALL = 'pip install -r requirements-eval.txt'
# The narrowest bucket of loglikelihood rows: shorter requests share its program.
MIN_BUCKET = 16
# The local Variable Assignment task's name (zoo_ keeps it apart from lm-eval's own tasks).
VARIABLE_ASSIGNMENT_TASK = 'zoo_variable_assignment'


class MissingPackage(ValueError):
  """lm-eval is not installed: the message says what to install."""


def require_lm_eval():
  """The lm_eval package; MissingPackage (what to install) when it is absent."""
  try:
    import lm_eval  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise MissingPackage(f'--mode=harness needs EleutherAI\'s lm-evaluation-harness '
                         f'(lm-eval {LM_EVAL_VERSION}, no torch needed), which is not '
                         f'installed ({e}): {INSTALL}') from None
  return lm_eval


class IdText:
  """A synthetic task's text: whitespace-separated token ids, taken as written."""

  adds_bos = False

  def __init__(self, vocab_size: int):
    self.vocab_size = vocab_size

  def encode(self, text: str) -> list[int]:
    try:
      ids = [int(t) for t in text.split()]
    except ValueError:
      raise ValueError(f'{text[:60]!r}: this run\'s data is a synthetic task without a '
                       'tokenizer, so a text is whitespace-separated integer token ids') from None
    bad = [i for i in ids if not 0 <= i < self.vocab_size]
    if bad:
      raise ValueError(f'{text[:60]!r} has token ids {bad[:5]} outside the task\'s vocabulary '
                       f'[0, {self.vocab_size})')
    return ids

  def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
    # Ids are whole words: the two parts tokenize apart.
    return self.encode(context), self.encode(continuation)

  def decode(self, ids) -> str:
    """' 5 9': each id after a space, so context + continuation is the whole text."""
    return ''.join(f' {int(i)}' for i in ids)


class TokenizerText:
  """A text run's tokenizer (input_pipeline/tokenizers.py) without its BOS and EOS."""

  adds_bos = True

  def __init__(self, tokenizer):
    self.tokenizer = tokenizer

  def encode(self, text: str) -> list[int]:
    if not text:
      return []
    return [int(i) for i in self.tokenizer.encode_batch([text])[0][1:-1]]

  def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """The context's tokens and the continuation's: those of the whole past the context's,
    so that a piece that spans the boundary is scored as the whole text tokenizes."""
    spaces = len(context) - len(context.rstrip())
    if spaces:  # ' world' tokenizes as the word it starts; 'hello ' would end in a lone space.
      context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = self.encode(context + continuation)
    head = self.encode(context)
    if whole[:len(head)] != head:  # The pieces differ at the boundary: split where they agree.
      n = 0
      while n < min(len(head), len(whole)) and head[n] == whole[n]:
        n += 1
      head = whole[:n]
    return head, whole[len(head):]

  def decode(self, ids) -> str:
    return self.tokenizer.decode(ids)


def text_codec(setup):
  """IdText for a synthetic task, else TokenizerText of the run's tokenizer."""
  if setup.data.tokenizer is None:
    return IdText(setup.data.vocab_size)
  return TokenizerText(setup.data.tokenizer)


def bucket_width(n: int, max_len: int) -> int:
  """The row width of `n` inputs: the next power of two from MIN_BUCKET, at most max_len."""
  width = MIN_BUCKET
  while width < n:
    width *= 2
  return min(width, max_len)


@dataclasses.dataclass(frozen=True)
class Row:
  """One row to score: `tokens` (n + 1 of them: inputs tokens[:-1], targets tokens[1:]), of
  which the last `scored` targets count."""
  tokens: np.ndarray
  scored: int


def _row_program(model, width: int, chunk: int):
  """(params, memory, inputs, targets, lengths, first) -> (log-likelihood, all greedy,
  memory) per row: the model's forward over each row's first `lengths` inputs (positions
  0.., padding after), the log-softmax of its logits at the targets, summed over the real
  targets from row position `first` on.

  A segment-memory variant reads `memory` (the rows' previous segments; None: empty) and
  returns it updated; other models take and give None. The logits are formed `chunk`
  positions at a time (all of them when it does not divide the width), as the training loss
  does (training/losses.py): (rows, width, vocab) never exists."""
  uses_memory = model.config.uses_memory
  chunk = chunk if 0 < chunk < width and width % chunk == 0 else width

  def run(params, memory, inputs, targets, lengths, first):
    rows = inputs.shape[0]
    position = jnp.arange(width, dtype=jnp.int32)
    real = position[None] < lengths[:, None]
    weights = real & (position[None] >= first[:, None])
    variables = {'params': params}
    if memory is not None:
      variables['memory'] = memory
    # Without memory given, a segment-memory variant makes an empty one for these rows.
    (hidden, w), mutated = model.apply(
        variables, inputs, positions=jnp.broadcast_to(position, (rows, width)),
        segment_ids=real.astype(jnp.int32), return_hidden=True,
        mutable=['memory'] if uses_memory else [])

    def one(part):
      x, t, counted = part
      logits = jnp.einsum('btd,dv->btv', x, w, preferred_element_type=jnp.float32)
      logp = jax.nn.log_softmax(logits, axis=-1)
      target = jnp.take_along_axis(logp, t[..., None], axis=-1)[..., 0]
      greedy = jnp.argmax(logits, axis=-1) == t
      return (jnp.sum(jnp.where(counted, target, 0.0), axis=1),
              jnp.all(greedy | ~counted, axis=1))

    split = lambda a: jnp.swapaxes(a.reshape((rows, width // chunk, chunk) + a.shape[2:]), 0, 1)
    sums, greedy = jax.lax.map(one, (split(hidden), split(targets), split(weights)))
    carried = mutated['memory'] if memory is not None else None
    return jnp.sum(sums, axis=0), jnp.all(greedy, axis=0), carried

  return run


class Scorer:
  """What lm-eval asks of a restored checkpoint, in token ids (and text for generation).

  Attributes:
    restored: the checkpoint (assembly.Restored).
    codec: IdText or TokenizerText.
    max_len: the model's window (its position table).
    rows: rows of every compiled batch (harness.batch_size rounded up to a multiple of the
      data-parallel devices).
  """

  def __init__(self, restored: assembly.Restored, batch_size: int):
    setup = restored.setup
    self.codec = text_codec(setup)
    self.max_len = setup.model_config.max_len
    dp = setup.mesh.shape['data'] * setup.mesh.shape['fsdp']
    self.rows = -(-batch_size // dp) * dp
    self._programs = {}
    self._warned = False
    self.truncated = 0
    self.update(restored)

  def update(self, restored: assembly.Restored) -> None:
    """Scores `restored` (other parameters of the same run: training's latest) from now on;
    the compiled programs are kept for a model of the same specialization."""
    self.restored = restored
    # Scoring uses the option values the variants evaluate with, as --mode=eval does.
    config = transformer.for_eval(restored.model.config)
    self.score_model = (restored.model if config == restored.model.config
                        else transformer.Decoder(config))
    # A segment-memory variant reads a long text segment by segment, its memory carried.
    self.streams = config.uses_memory

  # Rows.

  def _truncate(self, tokens: list[int], keep: int, what: str) -> list[int]:
    """`tokens` cut from the left to `keep`, warning once per Scorer."""
    if len(tokens) <= keep:
      return tokens
    self.truncated += 1
    if not self._warned:
      self._warned = True
      logging.warning('a %s of %d tokens is longer than the model\'s window (max_len=%d): '
                      'cut from the left to its last %d tokens, as lm-eval\'s HF model does '
                      '(said once; every longer one is cut the same way)', what, len(tokens),
                      self.max_len, keep)
    return tokens[-keep:]

  def pair_row(self, context: str, continuation: str) -> Row:
    """The row that scores `continuation` after `context`."""
    head, tail = self.codec.encode_pair(context, continuation)
    if self.codec.adds_bos:
      head = [BOS] + head
    if not tail:
      raise ValueError(f'the continuation {continuation!r} (after {context[-40:]!r}) has no '
                       'tokens to score')
    if not head:
      raise ValueError(f'the context of {continuation!r} is empty: a synthetic task\'s text '
                       f'starts with BOS = {BOS}')
    if self.streams:  # The whole context, through the memory.
      return Row(np.asarray(head + tail, np.int32), len(tail))
    if len(tail) > self.max_len:
      raise ValueError(f'a continuation of {len(tail)} tokens is longer than the model\'s '
                       f'window (max_len={self.max_len}): it cannot be scored')
    tokens = self._truncate(head + tail, self.max_len + 1, 'context and continuation')
    return Row(np.asarray(tokens, np.int32), len(tail))

  def rolling_rows(self, text: str) -> list[Row]:
    """The windows that score every token of `text` once (after BOS, or after the first id of
    a synthetic task's text)."""
    tokens = self.codec.encode(text)
    if self.codec.adds_bos:
      tokens = [BOS] + tokens
    tokens = np.asarray(tokens, np.int32)
    if self.streams:  # One row of any length, read segment by segment through the memory.
      return [Row(tokens, tokens.size - 1)] if tokens.size > 1 else []
    out = []
    for start, n, first in evaluation.windows(len(tokens), self.max_len, self.max_len):
      out.append(Row(tokens[start:start + n + 1], n - first))
    return out

  # Scoring.

  def _program(self, width: int):
    key = (self.score_model, width)
    if key not in self._programs:
      setup = self.restored.setup
      replicated = jax.sharding.NamedSharding(setup.mesh, jax.sharding.PartitionSpec())
      rows = setup.batch_sharding  # Memory too: each leaf's first axis is the batch row.
      memory = rows if self.streams else None
      self._programs[key] = jax.jit(
          _row_program(self.score_model, width, setup.config.loss_chunk_len),
          in_shardings=(setup.state_sharding.params, memory) + (rows,) * 4,
          out_shardings=(replicated, replicated, memory))
    return self._programs[key]

  def _global(self, array: np.ndarray):
    """`array` (the whole batch, the same on every process) laid out over the mesh."""
    setup = self.restored.setup
    return jax.make_array_from_callback(array.shape, setup.batch_sharding,
                                        lambda index: array[index])

  def _fresh_memory(self):
    """Empty segment memory for `self.rows` rows of the scoring model, on the mesh (its
    shapes traced outside the mesh's context, as the training state's are)."""
    from models.attention import memory as segment_memory  # pylint: disable=import-outside-toplevel
    import flax.linen as nn  # pylint: disable=import-outside-toplevel
    abstract = jax.eval_shape(lambda: self.score_model.init(
        jax.random.key(0), jnp.zeros((self.rows, self.max_len), jnp.int32))['memory'])
    return jax.tree.map(self._global, segment_memory.fresh(nn.unbox(abstract)))

  def _batch(self, pieces: list[tuple[np.ndarray, int]], width: int):
    """The arrays of one batch: each piece is (tokens: inputs and one more target, first
    counted target's row position); rows past the pieces score nothing."""
    inputs = np.full((self.rows, width), PAD, np.int32)
    targets = np.full((self.rows, width), PAD, np.int32)
    lengths = np.zeros(self.rows, np.int32)
    first = np.zeros(self.rows, np.int32)
    for r, (tokens, start) in enumerate(pieces):
      n = tokens.size - 1
      if n > 0:
        inputs[r, :n], targets[r, :n] = tokens[:-1], tokens[1:]
      lengths[r], first[r] = max(n, 0), start
    return [self._global(a) for a in (inputs, targets, lengths, first)]

  def score_rows(self, rows: Sequence[Row]) -> list[tuple[float, bool]]:
    """(log-likelihood of the scored targets, each the argmax) for each row.

    Rows are sorted by length and cut into batches of `self.rows` of one bucket width each
    (the last padded with empty rows), so each bucket's program compiles once. A
    segment-memory variant reads rows of any length in segments of max_len (`_streams`)."""
    if self.streams:
      return self._streams(rows)
    setup = self.restored.setup
    order = sorted(range(len(rows)), key=lambda i: -rows[i].tokens.size)
    out: list[Any] = [None] * len(rows)
    with sharding.activate(setup.mesh, setup.rules):
      start = 0
      while start < len(order):
        width = bucket_width(rows[order[start]].tokens.size - 1, self.max_len)
        group = order[start:start + self.rows]
        start += len(group)
        batch = self._batch([(rows[i].tokens, rows[i].tokens.size - 1 - rows[i].scored)
                             for i in group], width)
        logp, greedy, _ = self._program(width)(self.restored.params, None, *batch)
        logp, greedy = np.asarray(jax.device_get(logp)), np.asarray(jax.device_get(greedy))
        for r, i in enumerate(group):
          out[i] = (float(logp[r]), bool(greedy[r]))
    return out

  def _streams(self, rows: Sequence[Row]) -> list[tuple[float, bool]]:
    """score_rows for a segment-memory variant: `self.rows` rows at a time, each read in
    consecutive segments of max_len inputs with the memory carried from one to the next (as
    --mode=eval reads a stream), from an empty memory; a row's scored targets may lie in any
    of its segments. One program (width max_len) for every batch."""
    setup, w = self.restored.setup, self.max_len
    order = sorted(range(len(rows)), key=lambda i: -rows[i].tokens.size)
    out: list[Any] = [None] * len(rows)
    fresh = self._fresh_memory()
    with sharding.activate(setup.mesh, setup.rules):
      for start in range(0, len(order), self.rows):
        group = order[start:start + self.rows]
        segments = -(-(rows[group[0]].tokens.size - 1) // w)
        memory = fresh
        logp, greedy = np.zeros(len(group)), np.ones(len(group), bool)
        for k in range(segments):
          pieces = []
          for i in group:
            tokens, n = rows[i].tokens, rows[i].tokens.size - 1
            pieces.append((tokens[k * w:min((k + 1) * w, n) + 1],
                           max(n - rows[i].scored - k * w, 0)))
          sums, all_greedy, memory = self._program(w)(self.restored.params, memory,
                                                      *self._batch(pieces, w))
          logp += np.asarray(jax.device_get(sums))[:len(group)]
          greedy &= np.asarray(jax.device_get(all_greedy))[:len(group)]
        for r, i in enumerate(group):
          out[i] = (float(logp[r]), bool(greedy[r]))
    return out

  def loglikelihood(self, pairs: Sequence[tuple[str, str]]) -> list[tuple[float, bool]]:
    """(log p(continuation | context), whether greedy decoding gives the continuation)."""
    return self.score_rows([self.pair_row(c, x) for c, x in pairs])

  def loglikelihood_rolling(self, texts: Sequence[str]) -> list[float]:
    """log p(text) of each text, over windows of the model's window."""
    rows, owner = [], []
    for k, text in enumerate(texts):
      for row in self.rolling_rows(text):
        rows.append(row)
        owner.append(k)
    totals = [0.0] * len(texts)
    for k, (logp, _) in zip(owner, self.score_rows(rows)):
      totals[k] += logp
    return totals

  # Generation.

  def generate(self, contexts: Sequence[str], *, until: Sequence[str], max_gen_toks: int,
               temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
               seed: int = 0) -> list[str]:
    """The continuation of each context by the compiled sampler (--mode=generate's), up to
    `max_gen_toks` tokens or EOS, cut before the first of the `until` strings.

    A context that leaves no room for max_gen_toks in the window is cut from the left to
    max_len - max_gen_toks tokens (max_gen_toks is capped at max_len - 1)."""
    setup = self.restored.setup
    new_tokens = max(1, min(int(max_gen_toks), self.max_len - 1))
    keep = self.max_len - new_tokens
    prompts = []
    for context in contexts:
      ids = self.codec.encode(context)
      if self.codec.adds_bos:
        ids = [BOS] + ids
      if not ids:
        raise ValueError('an empty context: a synthetic task\'s text starts with BOS = '
                         f'{BOS}')
      prompts.append(np.asarray(self._truncate(ids, keep, 'context to generate from'),
                                np.int32))
    order = sorted(range(len(prompts)), key=lambda i: -prompts[i].size)
    out: list[Any] = [None] * len(prompts)
    for k, start in enumerate(range(0, len(order), self.rows)):
      group = order[start:start + self.rows]
      width = min(bucket_width(prompts[group[0]].size, self.max_len), keep)
      samples = sampling.sample_ids(
          setup, self.restored.model, self.restored.params, [prompts[i] for i in group],
          max_new_tokens=new_tokens, batch_size=self.rows,
          rng=jax.random.fold_in(jax.random.key(seed), k), temperature=temperature,
          top_k=top_k, top_p=top_p, eos_id=EOS, width=width)
      for i, (new, stopped) in zip(group, samples):
        text = self.codec.decode(new[:-1] if stopped else new)
        out[i] = cut_at(text, until)
    return out


def cut_at(text: str, until: Sequence[str]) -> str:
  """`text` up to the first occurrence of any of the `until` strings."""
  end = len(text)
  for stop in until:
    if stop:
      found = text.find(stop)
      if found != -1:
        end = min(end, found)
  return text[:end]


# Tasks.


def variable_assignment_docs(config: ml_collections.ConfigDict) -> list[dict]:
  """The examples --mode=eval scores on a Variable Assignment run (eval_steps batches of the
  validation stream), each as a multiple-choice document: context (BOS, the assignments and
  the query, as ids), choices (every value id) and answer (the index of the right one)."""
  fields = {f.name for f in dataclasses.fields(synthetic.VariableAssignment)}
  task = synthetic.make_task(config.data.name,
                             **{k: v for k, v in config.data.items() if k in fields})
  rows = config.eval_batch_size or config.batch_size
  choices = [str(task.value_offset + v) for v in range(task.num_values)]
  docs = []
  for i in range(config.eval_steps):
    batch = task.batch(config.seed + input_pipeline.EVAL_SEED_OFFSET, i, rows)
    for inputs, targets in zip(batch['inputs'], batch['targets']):
      docs.append({'context': ' '.join(str(int(t)) for t in inputs), 'choices': choices,
                   'answer': int(targets[-1]) - task.value_offset})
  return docs


# The local task's definition; lm-eval joins context and choice with a space.
_VARIABLE_ASSIGNMENT_YAML = """\
task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: context
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def local_tasks(config: ml_collections.ConfigDict, folder: str) -> list[str]:
  """Writes the run's own local tasks into `folder` (a task YAML and its data) and returns
  their names: zoo_variable_assignment for a Variable Assignment run, else none."""
  if config.data.name != 'variable_assignment':
    return []
  data = os.path.join(folder, f'{VARIABLE_ASSIGNMENT_TASK}.jsonl')
  with open(data, 'w', encoding='utf-8') as f:
    for doc in variable_assignment_docs(config):
      f.write(json.dumps(doc) + '\n')
  with open(os.path.join(folder, f'{VARIABLE_ASSIGNMENT_TASK}.yaml'), 'w') as f:
    f.write(_VARIABLE_ASSIGNMENT_YAML.format(name=VARIABLE_ASSIGNMENT_TASK, data=data))
  return [VARIABLE_ASSIGNMENT_TASK]


def task_names(config: ml_collections.ConfigDict, local: list[str]) -> list[str]:
  """The names in harness.tasks, or the run's own local task when none is given."""
  names = [n.strip() for n in config.harness.tasks.split(',') if n.strip()]
  if names:
    return names
  if not local:
    raise ValueError(f'give the lm-eval tasks to run: --config.harness.tasks=NAME[,NAME...] '
                     f'(e.g. lambada_openai,hellaswag); this run\'s data '
                     f'({config.data.name!r}) has no local task of the zoo')
  return local


def load_tasks(names: list[str], include_path: list[str], *, defaults: bool = True):
  """(TaskManager, {name: lm-eval's loaded task dict}), with the data of every task read.

  Args:
    names: task, group or tag names.
    include_path: folders of task YAMLs.
    defaults: also lm-eval's own tasks (indexing their 14,000 YAMLs takes 10-40 s, so they
      are indexed only when a name is not among the folders' tasks).

  Raises:
    ValueError: an unknown task name (with the nearest known ones), or a task whose data
      cannot be read (offline, a missing file), in one line each.
  """
  require_lm_eval()
  from lm_eval.tasks import TaskManager  # pylint: disable=import-outside-toplevel
  manager = TaskManager(include_path=include_path or None, include_defaults=False)
  if defaults and not set(names) <= set(manager.all_tasks):
    manager = TaskManager(include_path=include_path or None)
  known = set(manager.all_tasks)
  for name in names:
    if name not in known:
      import difflib  # pylint: disable=import-outside-toplevel
      near = difflib.get_close_matches(name, sorted(known), n=3)
      hint = f'; did you mean {", ".join(near)}?' if near else ''
      raise ValueError(f'unknown lm-eval task {name!r}{hint} (lm-eval {LM_EVAL_VERSION} knows '
                       f'{len(known)} tasks and groups: `lm-eval ls tasks`; a task of your own '
                       'goes in a folder named by --config.harness.include_path)')
  loaded = {}
  for name in names:
    try:
      loaded[name] = manager.load([name])
    except Exception as e:  # pylint: disable=broad-except  (datasets raises many kinds)
      first = (str(e).strip().splitlines() or [''])[0][:300]
      raise ValueError(f'lm-eval task {name!r}: its data could not be read ({type(e).__name__}: '
                       f'{first}). The standard tasks download from the Hugging Face hub, '
                       'which needs network access (or a filled HF_DATASETS_CACHE); a local '
                       'task reads the files its YAML names') from None
  return manager, loaded


def check_config(config: ml_collections.ConfigDict) -> None:
  """Raises FileNotFoundError when harness.include_path names no folder."""
  h = config.harness
  if h.include_path and not os.path.isdir(os.path.expanduser(h.include_path)):
    raise FileNotFoundError(f'harness.include_path {h.include_path} is not a folder (of task '
                            'YAMLs)')
