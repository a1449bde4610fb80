"""What lm-eval receives from the zoo (training/downstream.Scorer) is the model's own forward,
for every variant, residual wiring and stack (tests/contracts/cases.py: each variant's
baseline and each wiring and stack once): the log-likelihood of a continuation scored in a
padded row of a length bucket equals the plain forward over exactly its tokens, and so does
the greedy flag; a context longer than the window is cut from the left. A segment-memory
variant (Transformer-XL) reads a long text in segments with its memory carried instead: the
scored batches give what one text read alone, segment by segment, gives.

The rows of a bucket are right-padded (segment id 0 after each row's tokens): a variant whose
real tokens saw the padding would fail here. Token ids as text (the synthetic tasks' form), a
model initialized at random, one device. The cases are in the slow tier (one compile per
bucket and case); the memory test is not."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import schema
from models import transformer
from tests.contracts import cases
from training import assembly, downstream, sharding

pytestmark = pytest.mark.model

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


@pytest.mark.slow
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
  if case.config.uses_memory:
    return  # Its long context went through the memory (below), not cut.
  assert scorer.truncated == 1


def _stream_logp(restored, tokens, scored, w):
  """log p of the last `scored` targets of `tokens`, read alone in segments of `w` inputs with
  the segment memory carried (no batch, no padding)."""
  model, params = restored.model, restored.params
  if not hasattr(restored, 'steps'):  # Compiled once per model (and piece length).
    restored.steps = (
        jax.jit(lambda p, t: model.apply({'params': p}, t, mutable=['memory'])),
        jax.jit(lambda p, m, t: model.apply({'params': p, 'memory': m}, t, mutable=['memory'])))
  first, step = restored.steps
  n, total, memory = len(tokens) - 1, 0.0, None
  for k in range(0, n, w):
    piece = jnp.asarray([tokens[k:min(k + w, n)]], jnp.int32)
    logits, mutated = first(params, piece) if memory is None else step(params, memory, piece)
    memory = mutated['memory']
    logp = np.asarray(jax.nn.log_softmax(logits[0].astype(jnp.float32), axis=-1))
    for p, target in enumerate(tokens[k + 1:min(k + w, n) + 1]):
      if k + p >= n - scored:
        total += float(logp[p, target])
  return total


def test_segment_memory_reads_long_texts_through_its_memory():
  settings = {**cases.model_settings('txl', 'pre_ln', 'unrolled'), 'n_layers': 1,
              'vocab_size': cases.VOCAB, 'max_len': cases.MAX_LEN}
  config = transformer.TransformerConfig.from_config(settings).with_options(
      {'txl': {'mem_len': 16}})
  assert config.uses_memory
  restored = _restored(cases.Case('txl', 'pre_ln', 'unrolled', config))
  scorer = downstream.Scorer(restored, batch_size=2)
  w = cases.MAX_LEN
  texts = ['1 ' + ' '.join(str(3 + (i * 7) % 40) for i in range(n)) for n in (10, 48, 70)]  # 11, 49, 71 tokens
  got = scorer.loglikelihood_rolling(texts)
  for text, total in zip(texts, got):
    tokens = [int(t) for t in text.split()]
    assert total == pytest.approx(_stream_logp(restored, tokens, len(tokens) - 1, w),
                                  abs=2e-4)
  # A context past the window: its continuation scored after all of it, nothing cut.
  (logp, _), = scorer.loglikelihood([(texts[2], ' 5 6')])
  tokens = [int(t) for t in (texts[2] + ' 5 6').split()]
  assert logp == pytest.approx(_stream_logp(restored, tokens, 2, w), abs=2e-4)
  assert scorer.truncated == 0
  # The memory reaches back: the last segment scored alone differs.
  last = (len(tokens) - 2) // w * w  # Where the last segment of inputs starts.
  alone = _stream_logp(restored, tokens[last:], 2, w)
  assert abs(alone - logp) > 1e-3
