"""What every case (tests/contracts/cases.py: variant x block x stack, pairwise) promises:

- decode = forward: token-by-token decoding through the caches gives the full forward's
  logits at every position;
- prefill = steps: one forward over a prompt leaves the caches, and the next-token logits,
  that one-token steps leave (for variants that prefill; the others read the prompt token by
  token, which the first property covers);
- generate = argmax: the compiled greedy sampler (models/decode.generate) picks the full
  forward's argmax at every new position, for prompts of different lengths in one batch;
- gradients: the training loss (dropout on, auxiliary losses included) has finite gradients,
  not all zero, through the training path (the reversible layer's own backward pass).

Decoding and gradients run on the pairwise covering set (cases.COVERING); the sampler's two
properties on each variant's baseline and each block and stack once (cases.ONE_EACH): they
test the decoding loop around the layers, which the first property already checks layer by
layer. One model per case, initialized once; each property compiles one program, with XLA's
fast-compile options (the programs are small: compile time is what counts here).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import decode, transformer
from tests.contracts import cases
from training import steps

pytestmark = pytest.mark.model

FAST_COMPILE = {'xla_backend_optimization_level': 0, 'xla_llvm_disable_expensive_passes': True}
ATOL = RTOL = 2e-5  # float32 logits of order 1: the decode and forward sums differ in order.


def _jit(fn, **kwargs):
  return jax.jit(fn, compiler_options=FAST_COMPILE, **kwargs)


class Built:
  """A case's model, parameters and token rows."""

  def __init__(self, case: cases.Case):
    self.case = case
    self.model = transformer.Decoder(case.config)
    rng = np.random.default_rng(0)
    self.tokens = jnp.asarray(rng.integers(3, cases.VOCAB, (2, cases.MAX_LEN)), jnp.int32)
    self.params = _jit(self.model.init)(jax.random.key(0), self.tokens)['params']
    self._forward = _jit(lambda p, t: self.model.apply({'params': p}, t))

  def forward(self, tokens):
    return self._forward(self.params, tokens)


_BUILT: dict[str, Built] = {}


def _built(case: cases.Case) -> Built:
  """The case's Built, made on first use (one init per case for every property)."""
  if case.id not in _BUILT:
    _BUILT[case.id] = Built(case)
  return _BUILT[case.id]


@pytest.fixture(scope='module', autouse=True)
def _forget_built():
  yield
  _BUILT.clear()


@pytest.fixture(params=cases.COVERING, ids=lambda c: c.id)
def built(request) -> Built:
  """Every case of the pairwise covering set."""
  return _built(request.param)


@pytest.fixture(params=cases.ONE_EACH, ids=lambda c: c.id)
def built_one_each(request) -> Built:
  """Each variant's baseline and each block and stack once: for the properties of the
  decoding loop, which the block does not change."""
  return _built(request.param)


def _steps(model, params, tokens):
  """(cache, logits (length, batch, vocab)) after decoding `tokens` one position at a time
  (a traced scan: one compiled program, whatever the length)."""
  def body(cache, inputs):
    token, position = inputs
    logits, cache = decode.step(model, params, cache, token, position)
    return cache, logits
  cache = decode.init_cache(model, params, tokens.shape[0])
  return jax.lax.scan(body, cache, (tokens.T, jnp.arange(tokens.shape[1])))


def test_decoding_equals_the_forward_pass(built):
  model = built.model
  stepped = _jit(lambda p, t: jnp.swapaxes(_steps(model, p, t)[1], 0, 1))
  np.testing.assert_allclose(stepped(built.params, built.tokens), built.forward(built.tokens),
                             atol=ATOL, rtol=RTOL)


def test_prefill_leaves_the_caches_of_the_step_path(built_one_each):
  built = built_one_each
  model, params = decode.unrolled(built.model, built.params)
  if not decode.can_prefill(model.config):
    pytest.skip(f'{built.case.variant} reads the prompt token by token (no prefill)')
  prompts = built.tokens[:, :11]  # Past local's window and fixed's first block.

  def both(params, prompts):
    stepped, logits = _steps(model, params, prompts)
    filled, prefilled = decode.prefill(
        model, params, decode.init_cache(model, params, prompts.shape[0]), prompts)
    return (logits[-1], stepped), (filled, prefilled)

  (logits, stepped), (filled, prefilled) = _jit(both)(params, prompts)
  np.testing.assert_allclose(filled, logits, atol=ATOL, rtol=RTOL)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5),
               prefilled, stepped)


def test_greedy_generation_is_the_forward_argmax(built_one_each):
  built = built_one_each
  prompts = built.tokens[:, :6]
  lengths, new = [6, 3], 8
  tokens, ends = decode.generate(built.model, built.params, prompts, lengths, new,
                                 jax.random.key(0), temperature=0.0, pad_id=0)
  np.testing.assert_array_equal(np.asarray(ends), [n + new for n in lengths])
  logits = built.forward(tokens[:, :-1])  # Position t - 1 sees tokens[:, :t] only.
  for row, n in enumerate(lengths):
    np.testing.assert_array_equal(tokens[row, :n], prompts[row, :n])
    np.testing.assert_array_equal(tokens[row, n:n + new],
                                  jnp.argmax(logits[row, n - 1:n + new - 1], -1))


def test_training_gradients_are_finite_and_not_all_zero(built):
  model, tokens = built.model, built.tokens
  batch = {'inputs': tokens, 'targets': jnp.roll(tokens, -1, axis=1),
           'weights': jnp.ones(tokens.shape, jnp.float32),
           'positions': jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape),
           'segment_ids': jnp.ones(tokens.shape, jnp.int32)}

  def loss(params):
    sums, aux, _ = steps.forward_sums(model, params, batch, train=True, rng=jax.random.key(1))
    return sums['loss_sum'] / sums['weight_sum'] + aux

  grads = _jit(jax.grad(loss))(built.params)
  flat = jax.tree_util.tree_leaves_with_path(grads)
  bad = [jax.tree_util.keystr(p) for p, g in flat if not np.isfinite(np.asarray(g)).all()]
  assert not bad, f'non-finite gradients: {bad}'
  assert max(float(jnp.max(jnp.abs(g))) for _, g in flat) > 0
