"""Sampling from a trained run: --mode=generate, and the text samples written at each eval.

`sample_checkpoint(config, workdir)` restores a checkpoint of the workdir's recorded run (the
latest, or `generate.step`) onto the devices present, continues each prompt with the compiled
sampler (models/decode.generate) and prints the prompt and its continuation. Process 0 writes
`WORKDIR/samples_step_<N>.jsonl`, one JSON object per prompt (rewritten by a later run for the
same step).

Prompts: `generate.prompt_file` (one per line; blank lines are skipped) or `generate.prompt`.
On text data they are text, tokenized with the run's own tokenizer as a document starts:
[BOS] + tokens (no EOS), and the continuation is decoded back to text. With no prompt given,
a text model samples one continuation of BOS alone (an unconditional sample). The synthetic
tasks have no tokenizer: a prompt is whitespace-separated integer token ids, taken as given
(their rows start with BOS = 1), and the continuation is printed as ids; they need a prompt.

`eval_samples` and `write_samples` sample a few continuations of the first eval batch's rows
during training and write them as TensorBoard text summaries.
"""

from __future__ import annotations

import functools
import json
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from input_pipeline import synthetic
from models import decode, host
from training import assembly, run_config, sharding

PAD, BOS, EOS = synthetic.PAD, synthetic.BOS, synthetic.EOS

# Eval samples: tokens of each eval row given as the prompt, at most.
EVAL_PROMPT_TOKENS = 32


def _check_settings(g: ml_collections.ConfigDict) -> None:
  """Raises ValueError on sampling settings decode.generate cannot use."""
  for name, minimum in (('max_new_tokens', 1), ('batch_size', 1), ('top_k', 0), ('step', 0),
                        ('eval_samples', 0), ('eval_new_tokens', 1)):
    value = g[name]
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
      raise ValueError(f'generate.{name} must be an integer >= {minimum}, got {value!r}')
  if not g.temperature >= 0:
    raise ValueError(f'generate.temperature must be >= 0 (0 = greedy), got {g.temperature}')
  if not 0 < g.top_p <= 1:
    raise ValueError(f'generate.top_p must be in (0, 1] (1 = all tokens), got {g.top_p}')


def read_prompts(g: ml_collections.ConfigDict) -> list[tuple[str, str]]:
  """(prompt, where it came from) for each prompt of `generate.prompt_file` (non-blank lines)
  or `generate.prompt`; [] when neither is given."""
  if g.prompt_file:
    path = os.path.expanduser(g.prompt_file)
    if not os.path.isfile(path):
      raise FileNotFoundError(f'generate.prompt_file {path} does not exist (one prompt per line)')
    with open(path, encoding='utf-8') as f:
      prompts = [(line.rstrip('\r\n'), f'line {n} of {path}') for n, line in enumerate(f, 1)
                 if line.strip()]
    if not prompts:
      raise ValueError(f'generate.prompt_file {path} holds no prompt (only blank lines)')
    return prompts
  if g.prompt:
    return [(g.prompt, 'generate.prompt')]
  return []


def encode_prompts(prompts: list[tuple[str, str]], tokenizer, vocab_size: int) -> list[np.ndarray]:
  """The token ids of each prompt: [BOS] + text tokens with a tokenizer, the ids as written
  without one (synthetic tasks). An empty list of prompts is one BOS with a tokenizer."""
  if tokenizer is None:
    if not prompts:
      raise ValueError(
          'give a prompt: --config.generate.prompt="1 5 9" or --config.generate.prompt_file=PATH '
          '(one per line). This run\'s data is a synthetic task without a tokenizer, so a '
          f'prompt is whitespace-separated token ids in [0, {vocab_size}) (its rows start with '
          f'BOS = {BOS})')
    out = []
    for i, (text, where) in enumerate(prompts):
      try:
        ids = np.asarray([int(t) for t in text.split()], np.int32)
      except ValueError:
        raise ValueError(f'prompt {i} ({where}) is {text!r}: this run\'s data is a synthetic '
                         'task without a tokenizer, so a prompt is whitespace-separated '
                         'integer token ids') from None
      bad = ids[(ids < 0) | (ids >= vocab_size)]
      if bad.size:
        raise ValueError(f'prompt {i} ({where}) has token ids {bad.tolist()} outside the '
                         f'task\'s vocabulary [0, {vocab_size})')
      out.append(ids)
    return out
  if not prompts:
    logging.info('no generate.prompt or generate.prompt_file: sampling one continuation of BOS')
    return [np.asarray([BOS], np.int32)]
  encoded = tokenizer.encode_batch([text for text, _ in prompts])
  return [ids[:-1] if ids.size and ids[-1] == EOS else ids for ids in encoded]


def check_lengths(prompts: list[tuple[str, str]], ids: list[np.ndarray], max_new_tokens: int,
                  max_len: int) -> None:
  """Raises ValueError for a prompt that is empty or leaves no room for max_new_tokens."""
  for i, tokens in enumerate(ids):
    where = prompts[i][1] if prompts else 'BOS'
    n = int(tokens.size)
    if n == 0:
      raise ValueError(f'prompt {i} ({where}) has no tokens')
    if n >= max_len:
      raise ValueError(
          f'prompt {i} ({where}) has {n} tokens and the model\'s max_len is {max_len}: no room '
          f'for a new token. Shorten it to at most {max_len - 1} tokens (and lower '
          'generate.max_new_tokens to fit)')
    if n + max_new_tokens > max_len:
      # Shortening the prompt helps only if max_new_tokens leaves room for one token.
      shorten = (f', or shorten the prompt to at most {max_len - max_new_tokens} tokens'
                 if max_new_tokens < max_len else '')
      raise ValueError(
          f'prompt {i} ({where}) has {n} tokens; with generate.max_new_tokens={max_new_tokens} '
          f'that exceeds the model\'s max_len={max_len}. Set generate.max_new_tokens <= '
          f'{max_len - n}{shorten}')


def fit_new_tokens(ids: list[np.ndarray], max_new_tokens: int, max_len: int) -> int:
  """`max_new_tokens`, or fewer so that the longest prompt's continuation fits the model's
  context (max_len - its length, at least 1), with a log line when it is fewer."""
  longest = max(int(tokens.size) for tokens in ids)
  room = max(max_len - longest, 1)  # check_lengths refuses a prompt that fills max_len.
  if max_new_tokens <= room:
    return max_new_tokens
  logging.info('generate.max_new_tokens=%d (not set on the command line) is more than the '
               'model\'s context leaves after the longest prompt (max_len=%d, %d prompt '
               'tokens): generating up to %d new tokens', max_new_tokens, max_len, longest, room)
  return room


@functools.lru_cache(maxsize=16)
def _cannot_decode(model) -> str | None:
  """Why `model` cannot decode token by token (the variant's NotImplementedError), or None;
  a trace of the cache's shapes, no compute."""
  try:
    jax.eval_shape(lambda: decode.init_cache(model, None, 1))
  except NotImplementedError as e:
    attention = ','.join(sorted(set(model.config.attention)))
    return (f'this run\'s model ({attention} attention, {model.config.stack_name} stack) '
            f'cannot generate: {e}')
  return None


def check_decodes(model) -> None:
  """Raises NotImplementedError (the variant's own reason) if `model` cannot decode token by
  token."""
  reason = _cannot_decode(model)
  if reason:
    raise NotImplementedError(reason)


def _data_parallel(setup: assembly.Setup) -> int:
  return setup.mesh.shape['data'] * setup.mesh.shape['fsdp']


def sample_ids(setup: assembly.Setup, model, params, ids: list[np.ndarray], *,
               max_new_tokens: int, batch_size: int, rng, temperature: float, top_k: int,
               top_p: float, eos_id: int | None,
               width: int = 0) -> list[tuple[np.ndarray, bool]]:
  """(new token ids, stopped at EOS) for each prompt of `ids`, decoded `batch_size` at a time.

  Every batch has the same shape (rows: batch_size, or fewer prompts, rounded up to a multiple
  of the mesh's data-parallel size; width: the longest prompt, or `width` if larger, +
  max_new_tokens), so the sampling loop compiles once; rows past the prompts repeat the first
  and are dropped. Batch k samples with fold_in(rng, k). A caller that samples groups of
  prompts of different lengths gives a few widths (training/downstream.py: a power of two),
  so that the groups share programs.
  """
  dp = _data_parallel(setup)
  rows = -(-min(batch_size, len(ids)) // dp) * dp
  width = max(width, max(t.size for t in ids))
  out = []
  with sharding.activate(setup.mesh, setup.rules):
    for k, start in enumerate(range(0, len(ids), rows)):
      group = ids[start:start + rows]
      group += [group[0]] * (rows - len(group))
      prompts = np.full((rows, width), PAD, np.int32)
      for r, t in enumerate(group):
        prompts[r, :t.size] = t
      lengths = np.asarray([t.size for t in group], np.int32)
      tokens, ends = decode.generate(
          model, params, jnp.asarray(prompts), lengths, max_new_tokens,
          jax.random.fold_in(rng, k), temperature=temperature, top_k=top_k, top_p=top_p,
          eos_id=eos_id, pad_id=PAD)
      tokens, ends = host.to_host((tokens, ends))
      for r in range(min(rows, len(ids) - start)):
        new = tokens[r, lengths[r]:ends[r]]
        out.append((new, eos_id is not None and new.size > 0 and int(new[-1]) == eos_id))
  return out


def _detokenize(tokenizer, ids) -> str:
  return ' '.join(str(int(i)) for i in ids) if tokenizer is None else tokenizer.decode(ids)


def sample_checkpoint(config: ml_collections.ConfigDict, workdir: str,
                      request: run_config.Request | None = None) -> list[dict]:
  """Samples continuations of the prompts of `config.generate` from a checkpoint of `workdir`.

  The model is the workdir's recorded one (training/run_config.py); the `generate.*` settings
  are run-time keys, so the command line may set any of them. Prints each prompt and its
  continuation; process 0 writes WORKDIR/samples_step_<N>.jsonl. generate.max_new_tokens not
  set on the command line is capped at what the model's context leaves after the longest
  prompt (logged); set there, a prompt that leaves less room is an error.

  Args:
    config: the config given.
    workdir: the training run's workdir.
    request: what the command line asked for; None: every field of `config`.

  Returns:
    One record per prompt: index, prompt, completion (text; ids as text for a synthetic
    task), prompt_tokens and new_tokens (counts), completion_ids, stopped_at_eos, step and
    the sampling settings.

  Raises:
    ValueError: no prompt for a task without a tokenizer, a prompt too long for the model,
      bad settings. FileNotFoundError: no checkpoint, no checkpoint `generate.step` (the
      message lists the saved ones), no prompt file. NotImplementedError: the model's
      attention cannot decode token by token (a variant with neither a static pattern nor a
      decode_step of its own; every registered variant decodes).
  """
  asked_length = request is None or request.asks('generate.max_new_tokens')
  prompts, ids, lengths = [], [], []

  def check_config(config):
    _check_settings(config.generate)
    prompts.extend(read_prompts(config.generate))  # A missing file fails before any build.

  def check(setup):
    ids.extend(encode_prompts(prompts, setup.data.tokenizer, setup.data.vocab_size))
    length = setup.config.generate.max_new_tokens
    if not asked_length:  # The default: up to the model's context.
      length = fit_new_tokens(ids, length, setup.model_config.max_len)
    check_lengths(prompts, ids, length, setup.model_config.max_len)
    check_decodes(setup.model)
    lengths.append(length)

  restored = assembly.restore(config, workdir, request, step_key='generate.step',
                              check_config=check_config, check=check)
  setup, model, params, step = restored.setup, restored.model, restored.params, restored.step
  g, tokenizer, max_new_tokens = setup.config.generate, setup.data.tokenizer, lengths[0]
  eos_id = EOS if g.stop_at_eos else None
  samples = sample_ids(setup, model, params, ids, max_new_tokens=max_new_tokens,
                       batch_size=g.batch_size, rng=jax.random.key(g.seed),
                       temperature=g.temperature, top_k=g.top_k, top_p=g.top_p, eos_id=eos_id)
  settings = {k: g[k] for k in ('temperature', 'top_k', 'top_p', 'seed', 'stop_at_eos',
                                'batch_size')}
  settings['max_new_tokens'] = max_new_tokens
  records = []
  for i, (tokens, (new, stopped)) in enumerate(zip(ids, samples)):
    records.append({
        'index': i,
        'prompt': prompts[i][0] if prompts else '',
        'completion': _detokenize(tokenizer, new),
        'prompt_tokens': int(tokens.size),
        'new_tokens': int(new.size),
        'completion_ids': [int(t) for t in new],
        'stopped_at_eos': bool(stopped),
        'step': step,
        **settings,
    })
  if jax.process_index() == 0:
    _print(records)
    path = os.path.join(workdir, f'samples_step_{step}.jsonl')
    with open(path, 'w', encoding='utf-8') as f:
      for record in records:
        f.write(json.dumps(record, ensure_ascii=False) + '\n')
    logging.info('%d samples of step %d -> %s', len(records), step, path)
  return records


def _print(records: list[dict]) -> None:
  for r in records:
    end = 'ended at EOS' if r['stopped_at_eos'] else f'max_new_tokens={r["max_new_tokens"]}'
    print(f'=== sample {r["index"]} (step {r["step"]}; prompt {r["prompt_tokens"]} tokens, '
          f'{r["new_tokens"]} new tokens, {end})')
    print('--- prompt')
    print(r['prompt'])
    print('--- continuation')
    print(r['completion'], flush=True)


def eval_samples(setup: assembly.Setup, model, params, step: int,
                 rng_seed: int | None = None) -> list[tuple[str, str]]:
  """(prompt, continuation) texts of `generate.eval_samples` rows of the first eval batch.

  Each prompt is the start of a row (its first document, up to EVAL_PROMPT_TOKENS tokens or
  half the model's max_len); the continuation has up to `generate.eval_new_tokens` new tokens
  (fewer if max_len leaves less room: a sample never stops training), sampled with the
  generate settings and key fold_in(key(rng_seed), step). The shapes are the same at every
  eval, so the sampling loop compiles once. Call it on every process (the parameters may be
  sharded over all of them).

  Args:
    setup: the run's Setup.
    model: the Decoder to sample (None: assembly.specialized_model(setup, params)).
    params: its parameters.
    step: the training step (written with the samples, and folded into the key).
    rng_seed: the sampling seed; None: generate.seed.

  Returns:
    The samples; [] when the data has no tokenizer (synthetic tasks), generate.eval_samples
    is 0, or the model cannot decode token by token (a variant with neither a static
    pattern nor a decode_step of its own; a warning says why).
  """
  g = setup.config.generate
  tokenizer = setup.data.tokenizer
  if tokenizer is None or not g.eval_samples:
    return []
  max_len = setup.model_config.max_len
  cap = max(1, min(EVAL_PROMPT_TOKENS, max_len // 2))
  new_tokens = min(g.eval_new_tokens, max_len - cap)
  model = model or assembly.specialized_model(setup, params)
  reason = _cannot_decode(model)
  if reason:  # Training goes on without samples.
    logging.log_first_n(logging.WARNING, 'no eval samples: %s', 1, reason)
    return []
  ids = _eval_prompts(setup, g.eval_samples, cap)
  seed = g.seed if rng_seed is None else rng_seed
  samples = sample_ids(setup, model, params, ids, max_new_tokens=new_tokens,
                       batch_size=len(ids), rng=jax.random.fold_in(jax.random.key(seed), step),
                       temperature=g.temperature, top_k=g.top_k, top_p=g.top_p,
                       eos_id=EOS if g.stop_at_eos else None)
  return [(tokenizer.decode(p), tokenizer.decode(new)) for p, (new, _) in zip(ids, samples)]


def _eval_prompts(setup: assembly.Setup, n: int, cap: int) -> list[np.ndarray]:
  """The first `n` rows of the first eval batch (process 0's, on every process), each cut to
  its first document and `cap` tokens; a row of padding or a missing row is BOS alone."""
  batches = setup.data.eval_batches()
  try:
    first = next(iter(batches), None)
  finally:
    close = getattr(batches, 'close', None)
    if close:
      close()
  prompts = np.full((n, cap), PAD, np.int32)
  lengths = np.ones((n,), np.int32)
  prompts[:, 0] = BOS
  if first is not None:
    inputs, segments = first['inputs'], first['segment_ids']
    for r in range(min(n, inputs.shape[0])):
      if segments[r, 0] == 0:  # Padding row.
        continue
      same = segments[r, :cap] == segments[r, 0]
      length = int(np.argmin(same)) if not same.all() else int(same.size)
      prompts[r, :length] = inputs[r, :length]
      lengths[r] = length
  if jax.process_count() > 1:  # The same prompts on every process: process 0's.
    prompts, lengths = multihost_utils.broadcast_one_to_all((prompts, lengths))
    prompts, lengths = np.asarray(prompts), np.asarray(lengths)
  return [prompts[r, :lengths[r]] for r in range(n)]


def _code_block(text: str) -> str:
  """`text` as a markdown code block (TensorBoard renders text summaries as markdown)."""
  return '\n'.join('    ' + line for line in (text or ' ').split('\n'))


def write_samples(writer, step: int, samples: list[tuple[str, str]]) -> None:
  """Writes eval samples as TensorBoard text summaries `samples/<i>` (prompt, then the
  continuation) and logs them; nothing when `samples` is empty.

  Args:
    writer: anything with write_texts(step, {key: text}): a metrics.MetricLogger or
      metrics.EventWriter.
    step: the training step.
    samples: (prompt, continuation) pairs, as eval_samples returns them.
  """
  if not samples:
    return
  texts = {f'samples/{i}': f'prompt:\n\n{_code_block(p)}\n\ncontinuation:\n\n{_code_block(c)}'
           for i, (p, c) in enumerate(samples)}
  writer.write_texts(step, texts)
  for i, (p, c) in enumerate(samples):
    logging.info('eval sample %d at step %d: %r -> %r', i, step, p, c)
