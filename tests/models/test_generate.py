"""The compiled sampler (models/decode.generate): top-k, top-p, EOS, prompts of different
lengths in one batch, long caches read a chunk at a time, and a variant that cannot decode (a
test-only one) is refused. Greedy output = the forward's argmax, and prefill = steps, for
every variant, block and stack: tests/contracts/test_model_contract.py. Initialization and
the forward passes compared with are jitted (eagerly, each operation compiles alone)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import attention, decode, transformer

VOCAB = 50
MAX_LEN = 24


def _config(name, **extra) -> transformer.TransformerConfig:
  """A small model of variant `name` (its TEST_CONFIG), with `extra` ('options': the
  variant's own attention options) on top."""
  declared = dict(attention.traits.of(name).TEST_CONFIG) if name in attention.known() else {}
  options = {**declared.pop('attention_options', {}), **extra.pop('options', {})}
  m = dict(d=0, d_model=32, n_heads=4, n_layers=2, vocab_size=VOCAB, max_len=MAX_LEN,
           attention=name, attention_options={name: options}, stack='unrolled',
           dtype='float32')
  m.update(declared)
  m.update(extra)
  return transformer.TransformerConfig.from_config(m)


def _model(name, **extra):
  model = transformer.Decoder(_config(name, **extra))
  params = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, MAX_LEN), jnp.int32))['params']
  return model, params


def _forward(model, params, tokens):
  return jax.jit(lambda p, t: model.apply({'params': p}, t))(params, tokens)


def _prompts(batch=2, length=5, seed=0):
  return jnp.asarray(np.random.default_rng(seed).integers(3, VOCAB, (batch, length)), jnp.int32)


def test_variants_with_their_own_cache_say_they_cannot_prefill():
  for name, extra in [('selective', {}), ('txl', {'position_embedding': 'none'}),
                      ('lsh', {'options': {'chunk_len': 8, 'n_buckets': 4}})]:
    assert not decode.can_prefill(_config(name, **extra))


def test_every_registered_variant_makes_its_caches():
  """No registered variant refuses decoding (the caches' shapes only, no compute)."""
  for name in attention.known():
    model = transformer.Decoder(_config(name))
    cache = jax.eval_shape(lambda: decode.init_cache(model, None, 1))
    assert decode.cache_bytes(cache) > 0, name


def test_decoding_reads_the_live_part_of_a_long_cache():
  """max_len 160: the step attends over 1, 2, then 3 chunks of 64 slots as the text grows
  (base.over_live_slots; the last chunk ends at slot 160); greedy still equals the forward's
  argmax across them (tests/models/test_decode_views.py runs the plain-JAX path on CPU)."""
  model, params = _model('dense', max_len=160, n_layers=1)
  prompts = _prompts(batch=2, length=60, seed=2)
  tokens, _ = decode.generate(model, params, prompts, [60, 20], 74, jax.random.key(0),
                              temperature=0.0)
  # One causal forward over both rows: row 1's logits up to its end do not see its padding.
  logits = _forward(model, params, tokens[:, :-1])
  for r, n in enumerate([60, 20]):
    np.testing.assert_array_equal(tokens[r, n:n + 74],
                                  jnp.argmax(logits[r, n - 1:n + 73], -1))


def test_unrolled_keeps_the_values_of_a_scanned_stack():
  model, params = _model('dense', stack='scan')
  flat, flat_params = decode.unrolled(model, params)
  assert flat.config.stack == 'unrolled' and 'blocks' not in flat_params
  tokens = _prompts(length=9)
  np.testing.assert_allclose(_forward(flat, flat_params, tokens), _forward(model, params, tokens),
                             rtol=1e-5, atol=1e-5)


def test_top_k_one_is_greedy():
  model, params = _model('local')
  prompts = _prompts()
  greedy, _ = decode.generate(model, params, prompts, [5, 5], 6, jax.random.key(0),
                              temperature=0.0)
  top1, _ = decode.generate(model, params, prompts, [5, 5], 6, jax.random.key(7),
                            temperature=1.0, top_k=1)
  np.testing.assert_array_equal(top1, greedy)
  sampled, _ = decode.generate(model, params, prompts, [5, 5], 6, jax.random.key(7),
                               temperature=1.0)
  assert not np.array_equal(sampled, greedy)  # Sampling does sample.


@pytest.mark.parametrize('top_p, kept', [(0.5, [0]), (0.7, [0, 1]), (0.81, [0, 1, 2]),
                                         (1.0, [0, 1, 2, 3])])
def test_top_p_keeps_the_smallest_set_reaching_p(top_p, kept):
  """Probabilities 0.5, 0.3, 0.15, 0.05 (shuffled): the set reaching 0.7 is the first two."""
  probs = np.array([0.15, 0.5, 0.05, 0.3])
  order = [1, 3, 0, 2]  # Most likely first.
  out = decode.filter_logits(jnp.log(jnp.asarray(probs))[None], top_p=top_p)[0]
  want = np.full(4, False)
  want[[order[i] for i in kept]] = True
  np.testing.assert_array_equal(np.isfinite(np.asarray(out)), want)


def test_top_k_keeps_k():
  out = decode.filter_logits(jnp.asarray([[0.1, 3.0, -1.0, 2.0, 0.5]]), top_k=2)
  np.testing.assert_array_equal(np.isfinite(np.asarray(out[0])),
                                [False, True, False, True, False])


def test_eos_stops_a_row_and_pads_the_rest():
  model, params = _model('dense')
  prompts = _prompts(seed=3)
  greedy, _ = decode.generate(model, params, prompts, [5, 5], 8, jax.random.key(0),
                              temperature=0.0)
  eos = int(greedy[0, 6])  # Row 0's second new token.
  assert eos not in np.asarray(greedy[0, 5:6])
  tokens, lengths = decode.generate(model, params, prompts, [5, 5], 8, jax.random.key(0),
                                    temperature=0.0, eos_id=eos, pad_id=0)
  np.testing.assert_array_equal(tokens[0, :7], greedy[0, :7])
  np.testing.assert_array_equal(tokens[0, 7:], 0)
  assert int(lengths[0]) == 7
  row1_eos = np.flatnonzero(np.asarray(greedy[1, 5:]) == eos)
  end = 5 + (row1_eos[0] + 1 if row1_eos.size else 8)
  np.testing.assert_array_equal(tokens[1, :end], greedy[1, :end])
  assert int(lengths[1]) == end


def test_prompts_of_different_lengths_match_each_prompt_alone():
  model, params = _model('local')
  prompts = _prompts(batch=3, length=7, seed=5)
  lengths = [7, 3, 5]
  batched, out_lengths = decode.generate(model, params, prompts, lengths, 6,
                                         jax.random.key(0), temperature=0.0, pad_id=0)
  for r, n in enumerate(lengths):
    alone, _ = decode.generate(model, params, prompts[r:r + 1, :n], [n], 6,
                               jax.random.key(0), temperature=0.0)
    np.testing.assert_array_equal(batched[r, :n + 6], alone[0])
    np.testing.assert_array_equal(batched[r, n + 6:], 0)
    assert int(out_lengths[r]) == n + 6


def test_bad_requests_are_refused(no_decode):
  model, params = _model('dense')
  with pytest.raises(ValueError, match='exceed model.max_len=24'):
    decode.generate(model, params, _prompts(length=20), [20, 20], 5, jax.random.key(0))
  with pytest.raises(ValueError, match=r'prompt_lengths must be \(2,\) ints in \[1, 5\]'):
    decode.generate(model, params, _prompts(), [0, 5], 5, jax.random.key(0))
  with pytest.raises(ValueError, match='max_new_tokens must be >= 1'):
    decode.generate(model, params, _prompts(), [5, 5], 0, jax.random.key(0))
  undecodable, undecodable_params = _model(no_decode)
  assert _forward(undecodable, undecodable_params, _prompts()).shape == (2, 5, VOCAB)
  with pytest.raises(NotImplementedError, match='NoDecodeAttention cannot decode: it has no '
                                                'static pattern'):
    decode.generate(undecodable, undecodable_params, _prompts(), [5, 5], 5, jax.random.key(0))
