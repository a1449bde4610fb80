"""What lm-eval receives from the zoo (training/downstream.Scorer) is the model's own forward,
for every variant, block and stack (tests/contracts/cases.py: each variant's baseline and
each block and stack once): the log-likelihood of a continuation scored in a padded row of a
length bucket equals the plain forward over exactly its tokens, and so does the greedy flag;
a context longer than the window is cut from the left.

The rows of a bucket are right-padded (segment id 0 after each row's tokens): a variant whose
real tokens saw the padding would fail here. Token ids as text (the synthetic tasks' form), a
model initialized at random, one device. Slow tier: one compile per bucket and case."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import schema
from models import transformer
from tests.contracts import cases
from training import assembly, downstream, sharding

pytestmark = [pytest.mark.model, pytest.mark.slow]

PAIRS = [('1 5 6 7', ' 8 9'), ('1 4', ' 30'), ('1 ' + ' '.join(['11'] * 15), ' 12 13 14'),
         ('1 ' + ' '.join(str(3 + i % 40) for i in range(30)), ' 20 21')]  # 31 + 2: cut.


def _restored(case: cases.Case) -> assembly.Restored:
  """The case's model at random parameters, with the little of a Setup that Scorer reads."""
  model = transformer.Decoder(case.config)
  params = jax.jit(model.init)(jax.random.key(0), jnp.ones((1, cases.MAX_LEN), jnp.int32))
  params = params['params']
  mesh = sharding.make_mesh({'data': -1, 'fsdp': 1, 'tensor': 1, 'dcn_data': 1, 'dcn_fsdp': 1},
                            jax.devices()[:1])
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  setup = types.SimpleNamespace(
      data=types.SimpleNamespace(tokenizer=None, vocab_size=cases.VOCAB),
      config=types.SimpleNamespace(loss_chunk_len=8),  # Rows of 16 and 24 in chunks.

      model_config=case.config, mesh=mesh, rules=sharding.rules_from_config(schema.LOGICAL_AXIS_RULES),
      state_sharding=types.SimpleNamespace(params=jax.tree.map(lambda _: replicated, params)),
      batch_sharding=sharding.batch_sharding(mesh))
  return assembly.Restored(setup=setup, step=0, params=params, model=model)


@pytest.mark.parametrize('case', cases.ONE_EACH, ids=lambda c: c.id)
def test_scored_rows_are_the_forward_over_exactly_their_tokens(case):
  restored = _restored(case)
  scorer = downstream.Scorer(restored, batch_size=2)
  got = scorer.loglikelihood(PAIRS)
  # A segment-memory variant reads an empty memory (made by the call), as the Scorer's rows do.
  memory = ['memory'] if case.config.uses_memory else []
  forward = jax.jit(lambda p, t: restored.model.apply({'params': p}, t, mutable=memory)[0])
  for (context, continuation), (logp, greedy) in zip(PAIRS, got):
    tail = [int(t) for t in continuation.split()]
    tokens = ([int(t) for t in context.split()] + tail)[-(cases.MAX_LEN + 1):]
    logits = forward(restored.params, jnp.asarray([tokens[:-1]], jnp.int32))[0]
    logp_all = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    targets = np.asarray(tokens[1:])
    want = float(np.sum(np.asarray(logp_all)[np.arange(len(targets)), targets][-len(tail):]))
    want_greedy = bool(np.all(np.asarray(jnp.argmax(logits, -1))[-len(tail):] ==
                              targets[-len(tail):]))
    assert logp == pytest.approx(want, abs=2e-4), (case.id, context[:20], continuation)
    assert greedy == want_greedy, (case.id, context[:20])
  assert scorer.truncated == 1
