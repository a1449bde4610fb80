"""Autoregressive decoding with the attention variants' caches.

Each attention layer keeps only the keys its pattern can still attend to
(`MultiHeadAttention.decode_step`), so a sliding window of w keeps w entries per layer instead
of max_len. `cache_bytes` measures that.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def init_cache(model, params, batch: int):
  """Empty caches for `batch` rows of up to model.config.max_len tokens."""
  del params  # The cache shapes depend only on the config.
  dummy = jnp.zeros((batch, model.config.max_len), jnp.int32)
  return model.init(jax.random.key(0), dummy, decode=True)['cache']


def step(model, params, cache, tokens, position: int):
  """Logits (batch, vocab) for `tokens` (batch,) at `position`, and the updated cache."""
  positions = jnp.full((tokens.shape[0], 1), position, jnp.int32)
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


def cache_bytes(cache) -> int:
  """Bytes held by the key/value caches."""
  return sum(leaf.size * leaf.dtype.itemsize
             for path, leaf in jax.tree_util.tree_leaves_with_path(cache)
             if jax.tree_util.keystr(path).endswith(("['key']", "['value']")))
