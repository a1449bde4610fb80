"""Autoregressive decoding with the attention variants' caches.

Each attention layer keeps only the keys its pattern can still attend to
(`MultiHeadAttention.decode_step`), so a sliding window of w keeps w entries per layer instead
of max_len. `cache_bytes` measures that.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from models import attention, layers, stacks
from models.attention.base import PREFILL


def init_cache(model, params, batch: int):
  """Empty caches for `batch` rows of up to model.config.max_len tokens."""
  del params  # The cache shapes depend only on the config.
  dummy = jnp.zeros((batch, model.config.max_len), jnp.int32)
  return model.init(jax.random.key(0), dummy, decode=True)['cache']


def step(model, params, cache, tokens, position: int):
  """Logits (batch, vocab) for `tokens` (batch,) at `position`, and the updated cache."""
  positions = jnp.full((tokens.shape[0], 1), position, jnp.int32)
  with layers.decoding_matmuls():  # The few-row products on the CPU decoding kernel.
    logits, mutated = model.apply({'params': params, 'cache': cache}, tokens[:, None],
                                  positions=positions, decode=True, mutable=['cache'])
  return logits[:, 0], mutated['cache']


def score(model, params, tokens):
  """Logits (batch, n, vocab) of every position of `tokens` (batch, n), computed token by
  token through the decoding caches (teacher forcing): what the forward pass gives, when the
  caches are right."""
  cache = init_cache(model, params, tokens.shape[0])
  run = jax.jit(lambda c, t, i: step(model, params, c, t, i))
  out = []
  for i in range(tokens.shape[1]):
    logits, cache = run(cache, tokens[:, i], i)
    out.append(logits)
  return jnp.stack(out, axis=1)


def sample(model, params, prompt, num_steps: int, rng, temperature: float = 1.0):
  """Continues `prompt` (batch, p) by `num_steps` tokens (temperature 0 = greedy).

  Returns:
    (batch, p + num_steps) tokens.
  """
  b, p = prompt.shape
  if p + num_steps > model.config.max_len:
    raise ValueError(f'prompt {p} + {num_steps} steps exceeds model.max_len='
                     f'{model.config.max_len}')
  cache = init_cache(model, params, b)
  run = jax.jit(lambda c, t, i: step(model, params, c, t, i))
  tokens = [prompt[:, i] for i in range(p)]
  logits = None
  for i in range(p + num_steps - 1):
    logits, cache = run(cache, tokens[i], i)
    if i >= p - 1:
      rng, key = jax.random.split(rng)
      nxt = (jnp.argmax(logits, -1) if temperature == 0 else
             jax.random.categorical(key, logits / temperature, axis=-1))
      tokens.append(nxt.astype(prompt.dtype))
  return jnp.stack(tokens, axis=1)


def filter_logits(logits, *, top_k: int = 0, top_p: float = 1.0):
  """`logits` (..., vocab) with the tokens that top-k and top-p sampling exclude at -inf.

  top_k > 0 keeps the k largest (ties at the k-th value kept); top_p < 1 keeps the smallest
  set of most likely tokens whose probability mass reaches top_p (a token is kept when the
  mass of the tokens more likely than it is still below top_p, so the most likely token
  always stays).
  """
  logits = logits.astype(jnp.float32)
  if top_k:
    kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  if top_p < 1.0:
    order = jnp.sort(logits, axis=-1)[..., ::-1]
    probs = jax.nn.softmax(order, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # Mass of the more likely tokens.
    kept = jnp.where(before < top_p, order, jnp.inf)
    threshold = jnp.min(kept, axis=-1, keepdims=True)
    logits = jnp.where(logits < threshold, -jnp.inf, logits)
  return logits


def unrolled(model, params):
  """(model, params) with a scanned stack ('scan', 'scan_cycle') unrolled: the same layers
  as distinct modules, each layer's parameters sliced out of the stacked ones (the values do
  not change). Decoding runs them so that every layer's cache is its own array, updated in
  place, where the layer scan would slice each layer's cache out of the stacked one and
  write it back whole at every token. Other stacks come back as they are."""
  config = model.config
  name = stacks.resolve(config)
  if name not in ('scan', 'scan_cycle'):
    return model, params
  stack = stacks.of(config)
  flat = dataclasses.replace(config, stack='unrolled')
  per_layer = [stack.layer_tree(config, params, i) for i in range(config.n_layers)]
  owned = set(stack.stacked_tree(config, per_layer))  # The stack's own top-level names.
  rest = {k: v for k, v in params.items() if k not in owned}
  return type(model)(flat), {**rest, **stacks.Unrolled.stacked_tree(flat, per_layer)}


def can_prefill(config) -> bool:
  """Whether every attention variant of `config` fills its cache from a prompt's forward
  (Traits.can_prefill); the others read the prompt token by token."""
  return all(attention.traits.of(name).can_prefill() for name in dict.fromkeys(config.attention))


def prefill(model, params, cache, prompts):
  """One forward over `prompts` (batch, p) (every row's positions 0..p-1) that writes every
  layer's cache as p decoding steps would.

  Returns:
    (logits (batch, vocab) of the next token, the cache).
  """
  (hidden, w), mutated = model.apply({'params': params, 'cache': cache}, prompts,
                                     decode=PREFILL, return_hidden=True, mutable=['cache'])
  logits = jnp.einsum('bd,dv->bv', hidden[:, -1], w, preferred_element_type=jnp.float32)
  return logits, mutated['cache']


@functools.lru_cache(maxsize=16)
def _sampling_loop(model, b: int, width: int, prefilled: int, max_new_tokens: int,
                   temperature: float, top_k: int, top_p: float, eos_id, pad_id: int):
  """generate's jitted program for one model and setting (compiled once, reused):
  (params, buffer, lengths, rng) -> (t, cache, buffer, done, count, rng).

  The first `prefilled` positions (every row's prompt is at least that long) go through one
  prefill forward; a while loop then decodes from there."""

  def choose(t, logits, buffer, done, count, rng, lengths):
    """The token at t + 1 from the logits at t: the prompt's while a row is still in it,
    else a sample (pad once the row is done)."""
    rng, key = jax.random.split(rng)
    if temperature == 0:
      new = jnp.argmax(logits, axis=-1)
    else:
      filtered = filter_logits(logits / temperature, top_k=top_k, top_p=top_p)
      new = jax.random.categorical(key, filtered, axis=-1)
    nxt = t + 1
    generating = (nxt >= lengths) & ~done
    token = jnp.where(nxt < lengths, buffer[:, nxt], jnp.where(generating, new, pad_id))
    buffer = buffer.at[:, nxt].set(token.astype(jnp.int32))
    finished = generating & (count + 1 >= max_new_tokens)
    if eos_id is not None:
      finished = finished | (generating & (new == eos_id))
    return nxt, buffer, done | finished, count + generating, rng

  def loop(params, buffer, lengths, rng):
    dec_model, dec_params = unrolled(model, params)
    cache = init_cache(dec_model, dec_params, b)
    zeros = jnp.zeros((b,), jnp.int32)
    t, done, count = jnp.zeros((), jnp.int32), zeros > 0, zeros
    if prefilled:
      logits, cache = prefill(dec_model, dec_params, cache, buffer[:, :prefilled])
      t, buffer, done, count, rng = choose(t + prefilled - 1, logits, buffer, done, count, rng,
                                           lengths)

    def body(state):
      t, cache, buffer, done, count, rng = state
      logits, cache = step(dec_model, dec_params, cache, buffer[:, t], t)
      t, buffer, done, count, rng = choose(t, logits, buffer, done, count, rng, lengths)
      return t, cache, buffer, done, count, rng

    def cond(state):
      t, _, _, done, _, _ = state
      return (t < width - 1) & ~jnp.all(done)

    return jax.lax.while_loop(cond, body, (t, cache, buffer, done, count, rng))

  return jax.jit(loop)


def generate(model, params, prompts, prompt_lengths, max_new_tokens: int, rng, *,
             temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
             eos_id: int | None = None, pad_id: int = 0):
  """Samples continuations of a batch of prompts in one compiled program.

  The first positions every prompt covers (the largest power of two up to the shortest
  prompt's length) go through one prefill forward that writes every layer's cache (for
  variants that can: `can_prefill`; the others start at position 0). Then every row runs at the same step (position t for all
  rows, the caches' index): a row whose prompt is longer is still reading it
  (teacher-forced through the caches) while a shorter one already samples, so each row gets
  the positions and tokens it would get alone. The loop is a `lax.while_loop` over the
  positions with no host round trip; it stops once every row has finished (EOS or
  max_new_tokens). A scanned stack decodes unrolled (`unrolled`).

  Args:
    model: the Decoder.
    params: its parameters.
    prompts: (batch, P) int tokens, row r's prompt in its first prompt_lengths[r] entries
      (right padding).
    prompt_lengths: (batch,) ints in [1, P].
    max_new_tokens: tokens to generate per row at most.
    rng: the sampling key (unused when temperature is 0: greedy).
    temperature: softmax temperature; 0 = greedy (argmax).
    top_k: keep the k most likely tokens (0 = all).
    top_p: nucleus sampling mass (1 = all).
    eos_id: a row stops after sampling it (kept in the output); None = never.
    pad_id: fills each row after its end.

  Returns:
    (tokens (batch, P + max_new_tokens), lengths (batch,)): row r's prompt, its generated
    tokens, then pad_id; lengths counts the prompt and the generated tokens.
  """
  b, p = prompts.shape
  width = p + max_new_tokens
  if max_new_tokens < 1:
    raise ValueError(f'max_new_tokens must be >= 1, got {max_new_tokens}')
  if width > model.config.max_len:
    raise ValueError(f'prompts of {p} tokens + {max_new_tokens} new tokens exceed '
                     f'model.max_len={model.config.max_len}')
  lengths = np.asarray(prompt_lengths)
  if lengths.shape != (b,) or not np.all((lengths >= 1) & (lengths <= p)):
    raise ValueError(f'prompt_lengths must be ({b},) ints in [1, {p}], got {prompt_lengths}')
  buffer = jnp.full((b, width), pad_id, jnp.int32).at[:, :p].set(
      jnp.asarray(prompts, jnp.int32))
  buffer = jnp.where(jnp.arange(width)[None] < lengths[:, None], buffer, pad_id)
  # The largest power of two the shortest prompt covers: a few compiled programs serve every
  # prompt length (the rest of each prompt is read in the loop).
  prefilled = 1 << (int(lengths.min()).bit_length() - 1) if can_prefill(model.config) else 0
  run = _sampling_loop(model, b, width, prefilled, max_new_tokens, temperature, top_k, top_p,
                       eos_id, pad_id)
  _, _, buffer, _, count, _ = run(params, buffer, jnp.asarray(lengths, jnp.int32), rng)
  return buffer, jnp.asarray(lengths, jnp.int32) + count


def cache_bytes(cache) -> int:
  """Bytes held by the key/value caches."""
  return sum(leaf.size * leaf.dtype.itemsize
             for path, leaf in jax.tree_util.tree_leaves_with_path(cache)
             if jax.tree_util.keystr(path).endswith(("['key']", "['value']")))
