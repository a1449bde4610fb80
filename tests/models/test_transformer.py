"""Tests for models.transformer: config resolution, Decoder packing, scan/remat, aux losses."""

import dataclasses
import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from configs import declare, schema
from models import attention, layers, stacks, transformer
from models.attention import dense, traits
from training import steps

VOCAB, MAX_LEN = 32, 16
AUX_NAME = 'test_dummy_aux'
AUX_COEF = 0.25
PROBE_NAME = 'test_layer_index_probe'


class DummyAuxAttention(dense.DenseAttention):
  """Dense attention that sows AUX_COEF * aux_w**2 into 'losses' (aux_w: scalar param)."""

  def attend(self, q, k, v, **kwargs):
    w = self.param('aux_w', nn.initializers.ones, (), jnp.float32)
    self.sow('losses', 'dummy', AUX_COEF * jnp.square(w))
    return super().attend(q, k, v, **kwargs)


if AUX_NAME not in attention.known():
  attention.register(AUX_NAME)(DummyAuxAttention)


class LayerIndexProbe(dense.DenseAttention):
  """Dense attention that sows its layer_index into 'intermediates'."""

  def attend(self, q, k, v, **kwargs):
    self.sow('intermediates', 'layer_index', jnp.float32(self.layer_index))
    return super().attend(q, k, v, **kwargs)


class LayerIndexProbeTraits(traits.Traits):
  """It reads its layer index: every layer is its own."""

  @classmethod
  def layer_period(cls, options, n_layers):
    return None


if PROBE_NAME not in attention.known():
  attention.register(PROBE_NAME)(LayerIndexProbe)
  traits.declare(PROBE_NAME)(LayerIndexProbeTraits)


def _config(**overrides):
  cfg = {'vocab_size': VOCAB, 'd_model': 16, 'n_heads': 2, 'n_layers': 2, 'mlp_dim': 32,
         'max_len': MAX_LEN}
  cfg.update(overrides)
  return transformer.TransformerConfig.from_config(cfg)


def _param_shapes(cfg, length=8):
  """Unboxed ShapeDtypeStructs of Decoder(cfg).init (abstract: nothing is compiled)."""
  tokens = jnp.zeros((1, length), jnp.int32)
  variables = jax.eval_shape(
      lambda: transformer.Decoder(cfg).init(jax.random.PRNGKey(0), tokens))
  return nn.meta.unbox(variables['params'])


def _random_params(cfg, seed=0):
  """Random float32 params shaped like the Decoder's (norm scales around 1)."""
  rng = np.random.default_rng(seed)

  def draw(path, s):
    if 'scale' in jax.tree_util.keystr(path) or 'aux_w' in jax.tree_util.keystr(path):
      return jnp.asarray(rng.uniform(0.5, 1.5, s.shape), s.dtype)
    return jnp.asarray(0.3 * rng.normal(size=s.shape), s.dtype)

  return jax.tree_util.tree_map_with_path(draw, _param_shapes(cfg))


def _apply_fn(cfg):
  model = transformer.Decoder(cfg)
  return jax.jit(lambda p, tokens, pos, seg: model.apply(
      {'params': p}, tokens, positions=pos, segment_ids=seg))


def _count(tree):
  return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))


def _tokens(seed, shape):
  return np.random.default_rng(seed).integers(0, VOCAB, shape).astype(np.int32)


# ----------------------------------------------------------------------------- config


def test_from_config_d_knob_defaults():
  cfg = transformer.TransformerConfig.from_config(
      {'d': 8, 'vocab_size': VOCAB, 'max_len': MAX_LEN})
  assert (cfg.d_model, cfg.n_heads, cfg.n_layers, cfg.head_dim) == (512, 8, 8, 64)
  assert cfg.mlp_dim == 1408  # 8/3 * 512 = 1365.3, rounded up to a multiple of 64.
  assert cfg.attention == ('dense',) * 8
  assert cfg.attention_impl == 'auto' and cfg.remat == 'none'
  assert cfg.qk_norm and cfg.stack == 'auto' and not cfg.tied_embeddings
  assert cfg.dtype == jnp.float32 and cfg.param_dtype == jnp.float32


def test_every_default_of_the_model_config_is_the_schema_s():
  """One default per setting: TransformerConfig's (what a notebook that builds a Decoder gets,
  and what from_config fills in) equal configs/schema.py's (what main.py starts from); before,
  attention_impl was 'xla' against 'auto' and dtype float32 against bfloat16."""
  declared = schema.MODEL_SETTINGS.settings
  fields = {f.name: f.default for f in dataclasses.fields(transformer.TransformerConfig)
            if f.default is not dataclasses.MISSING}
  compared = set()
  for name, default in fields.items():
    if name in declared and isinstance(declared[name], declare.Setting):
      want = declared[name].default
      got = jnp.dtype(default).name if name.endswith('dtype') else default
      assert got == want, (name, got, want)
      compared.add(name)
  assert compared == set(fields) - {'attention_options', 'residual_options', 'stack_options',
                                    'target_platform', 'target_devices'}
  # The set-by-the-loop fields are no user setting; the option groups are the registries'.
  assert set(fields) - set(declared) == {'target_platform', 'target_devices'}
  # An attention module built directly starts from the same defaults, 'auto' resolved as the
  # Decoder resolves it.
  module = {f.name: f.default for f in dataclasses.fields(attention.base.MultiHeadAttention)}
  for name, setting in (('impl', 'attention_impl'), ('block_size', 'attention_block_size'),
                        ('qk_norm', 'qk_norm')):
    assert module[name] == declared[setting].default, name
  for name in ('dtype', 'param_dtype'):
    assert jnp.dtype(module[name]).name == declared[name].default, name
  built = attention.get('local')(num_heads=2, head_dim=64)
  assert built.impl == transformer.implementations(transformer.TransformerConfig.from_config(
      {'d': 1, 'd_model': 128, 'n_heads': 2, 'attention': 'local', 'vocab_size': VOCAB,
       'max_len': MAX_LEN}))[0]
  assert built.impl != 'auto'


def test_from_config_explicit_overrides_win():
  cfg = transformer.TransformerConfig.from_config(
      {'d': 8, 'd_model': 96, 'n_heads': 4, 'n_layers': 3, 'mlp_dim': 100, 'vocab_size': VOCAB,
       'max_len': MAX_LEN, 'dtype': 'bfloat16', 'tied_embeddings': True, 'qk_norm': False,
       'remat': 'full', 'stack': 'unrolled', 'attention_impl': 'fused'})
  assert (cfg.d_model, cfg.n_heads, cfg.n_layers, cfg.head_dim, cfg.mlp_dim) == (96, 4, 3, 24, 100)
  assert cfg.dtype == jnp.bfloat16 and cfg.param_dtype == jnp.float32
  assert cfg.tied_embeddings and not cfg.qk_norm and cfg.stack == 'unrolled'
  assert cfg.remat == 'full' and cfg.attention_impl == 'fused'
  assert cfg.attention == ('dense',) * 3
  explicit_head_dim = transformer.TransformerConfig.from_config(
      {'d': 2, 'head_dim': 16, 'vocab_size': VOCAB, 'max_len': MAX_LEN})
  assert (explicit_head_dim.d_model, explicit_head_dim.n_heads,
          explicit_head_dim.head_dim) == (128, 2, 16)


def test_from_config_zero_fields_are_derived():
  cfg = transformer.TransformerConfig.from_config(
      {'d': 2, 'd_model': 0, 'n_heads': 0, 'n_layers': 0, 'head_dim': 0, 'mlp_dim': 0,
       'vocab_size': VOCAB, 'max_len': MAX_LEN})
  assert (cfg.d_model, cfg.n_heads, cfg.n_layers, cfg.head_dim, cfg.mlp_dim) == (128, 2, 2, 64, 384)


def test_d_model_not_divisible_by_heads():
  with pytest.raises(ValueError, match=r'd_model=100\b.*n_heads=3\b'):
    _config(d_model=100, n_heads=3)
  # An explicit head_dim lifts the restriction.
  cfg = _config(d_model=100, n_heads=3, head_dim=32)
  assert cfg.head_dim == 32


def test_unknown_keys_are_refused_not_ignored():
  with pytest.raises(ValueError, match=r'unknown model setting\(s\) universal_act; known: '):
    transformer.TransformerConfig.from_config(dict(d=1, vocab_size=8, max_len=8,
                                                   universal_act=True))


def test_missing_sizes_error():
  with pytest.raises(ValueError, match='model.d'):
    transformer.TransformerConfig.from_config({'vocab_size': VOCAB, 'max_len': MAX_LEN})


def test_per_layer_attention_list():
  assert _config(attention='dense,dense').attention == ('dense', 'dense')
  assert _config(attention=' dense , dense ').attention == ('dense', 'dense')
  assert _config(attention=('dense', 'dense')).attention == ('dense', 'dense')
  mixed = _config(attention=f'dense,{AUX_NAME}')
  assert mixed.attention == ('dense', AUX_NAME) and not mixed.homogeneous
  assert _config(attention='dense').homogeneous
  with pytest.raises(ValueError, match='3 layers') as err:
    _config(attention='dense,dense,dense')
  assert 'n_layers is 2' in str(err.value)
  with pytest.raises(ValueError, match='nope') as err:
    _config(attention='dense,nope')
  assert 'dense' in str(err.value)


@pytest.mark.parametrize('field,value,known', [
    ('remat', 'everything', 'dots_saveable'),
    ('attention_impl', 'flash', 'fused'),
])
def test_invalid_names_error(field, value, known):
  with pytest.raises(ValueError, match=value) as err:
    _config(**{field: value})
  assert known in str(err.value)


@pytest.mark.parametrize('field,value', [('dropout_rate', 1.0), ('dropout_rate', -0.1),
                                         ('max_len', 0), ('vocab_size', 0)])
def test_invalid_values_error(field, value):
  with pytest.raises(ValueError, match=field):
    _config(**{field: value})


def test_sequence_longer_than_max_len_raises():
  cfg = _config()
  params = _random_params(cfg)
  model = transformer.Decoder(cfg)

  def apply(n):
    tokens = jnp.zeros((1, n), jnp.int32)
    return jax.eval_shape(lambda: model.apply({'params': params}, tokens))

  assert apply(MAX_LEN).shape == (1, MAX_LEN, VOCAB)
  with pytest.raises(ValueError, match='max_len'):
    apply(MAX_LEN + 1)
  with pytest.raises(ValueError, match='max_len'):
    _param_shapes(cfg, length=MAX_LEN + 1)


# ------------------------------------------------------------------------ param count


def _backbone_params(cfg):
  """The dense backbone's parameter count written out by hand (embeddings, qkv, out, SwiGLU,
  two RMSNorms and the QK-norms per layer, final norm, output projection)."""
  block = (cfg.d_model * 3 * cfg.n_heads * cfg.head_dim + cfg.n_heads * cfg.head_dim * cfg.d_model
           + 3 * cfg.d_model * cfg.mlp_dim + 2 * cfg.d_model + (2 * cfg.head_dim if cfg.qk_norm else 0))
  embed = cfg.vocab_size * cfg.d_model + cfg.max_len * cfg.d_model
  head = 0 if cfg.tied_embeddings else cfg.d_model * cfg.vocab_size
  return cfg.n_layers * block + embed + head + cfg.d_model


@pytest.mark.parametrize('overrides', [
    {},
    {'tied_embeddings': True},
    {'qk_norm': False, 'stack': 'unrolled'},
    {'tied_embeddings': True, 'qk_norm': False, 'n_layers': 3},
    {'d_model': 16, 'n_heads': 3, 'head_dim': 6, 'stack': 'unrolled'},
    {'d_model': 24, 'n_heads': 4, 'mlp_dim': 40, 'n_layers': 1},
], ids=str)
def test_num_params_matches_the_backbone_formula(overrides):
  for scan in (True, False):
    cfg = _config(**{**overrides, 'stack': 'auto' if scan else 'unrolled'})
    shapes = _param_shapes(cfg)
    assert cfg.num_params() == _backbone_params(cfg) == _count(shapes)
    if scan:
      assert 'blocks' in shapes and 'block_0' not in shapes
      assert all(x.shape[0] == cfg.n_layers for x in jax.tree.leaves(shapes['blocks']))
    else:
      assert 'blocks' not in shapes
      assert sorted(k for k in shapes if k.startswith('block_')) == [
          f'block_{i}' for i in range(cfg.n_layers)]
    assert ('logits_kernel' in shapes) == (not cfg.tied_embeddings)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(shapes))


def test_num_params_counts_a_variants_own_parameters():
  # Adaptive span adds p_1..p_S (S x head_dim) and z' (one per head) to every layer.
  span = {'limit': 8, 'ramp': 2, 'init': 0.0, 'penalty': 0.0, 'trim_multiple': 4, 'learned': True,
          'memory': False}
  cfg = _config(attention='adaptive_span', attention_options={'adaptive_span': span})
  assert cfg.num_params() == _backbone_params(cfg) + cfg.n_layers * (8 * cfg.head_dim + cfg.n_heads)
  # The test variant's scalar aux_w, in one of two layers.
  assert _config(attention=f'dense,{AUX_NAME}').num_params() == _backbone_params(_config()) + 1


def test_mixed_attention_list_is_not_scanned():
  shapes = _param_shapes(_config(attention=f'dense,{AUX_NAME}', stack='auto'))
  assert 'blocks' not in shapes
  assert 'aux_w' not in shapes['block_0']['attention']
  assert shapes['block_1']['attention']['aux_w'].shape == ()


# ---------------------------------------------------------------------------- packing


def _pack(doc_a, doc_b):
  tokens = np.concatenate([doc_a, doc_b])
  positions = np.concatenate([np.arange(len(doc_a)), np.arange(len(doc_b))]).astype(np.int32)
  segments = np.array([1] * len(doc_a) + [2] * len(doc_b), np.int32)
  return tokens, positions, segments


@pytest.mark.parametrize('impl,scan', [('xla', True), ('fused', False)])
def test_packed_documents_match_separate_runs(impl, scan):
  cfg = _config(attention_impl=impl, stack='auto' if scan else 'unrolled')
  params = _random_params(cfg)
  apply = _apply_fn(cfg)
  doc1, doc2 = _tokens(1, 5), _tokens(2, 7)
  rows = [_pack(doc1, doc2), _pack(doc2, doc1)]
  tokens, positions, segments = (np.stack(parts) for parts in zip(*rows))
  packed = np.asarray(apply(params, tokens, positions, segments))
  # Each document alone, one per row; doc1 is followed by padding (segment 0), which
  # causality keeps out of its logits.
  alone_tokens = np.stack([np.concatenate([doc1, [0, 0]]), doc2])
  alone_positions = np.tile(np.arange(7, dtype=np.int32), (2, 1))
  alone_segments = np.array([[1] * 5 + [0] * 2, [1] * 7], np.int32)
  alone = np.asarray(apply(params, alone_tokens, alone_positions, alone_segments))
  alone1, alone2 = alone[0, :5], alone[1]
  np.testing.assert_allclose(packed[0, :5], alone1, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(packed[0, 5:], alone2, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(packed[1, :7], alone2, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(packed[1, 7:], alone1, atol=1e-5, rtol=1e-5)
  # Without restarting positions, document 2 would see different position embeddings.
  shifted = np.asarray(apply(params, tokens, np.tile(np.arange(12, dtype=np.int32), (2, 1)),
                             segments))
  assert np.abs(shifted[0, 5:] - alone2).max() > 1e-3


def test_documents_isolated_and_causal():
  cfg = _config()
  params = _random_params(cfg)
  base_tokens, positions, segments = _pack(_tokens(1, 5), _tokens(2, 7))
  variants = [base_tokens.copy() for _ in range(4)]
  variants[1][5:] = (variants[1][5:] + 1) % VOCAB   # Every token of document 2.
  variants[2][4] = (variants[2][4] + 1) % VOCAB     # Last token of document 1.
  variants[3][8] = (variants[3][8] + 1) % VOCAB     # A middle token of document 2.
  logits = np.asarray(_apply_fn(cfg)(params, np.stack(variants), np.stack([positions] * 4),
                                     np.stack([segments] * 4)))
  ref = logits[0]
  np.testing.assert_allclose(logits[1, :5], ref[:5], atol=1e-6)   # Doc 1 ignores doc 2.
  np.testing.assert_allclose(logits[2, 5:], ref[5:], atol=1e-6)   # Doc 2 ignores doc 1.
  np.testing.assert_allclose(logits[2, :4], ref[:4], atol=1e-6)   # Causal within doc 1.
  np.testing.assert_allclose(logits[3, :8], ref[:8], atol=1e-6)   # Causal within doc 2.
  # The edits do change what may depend on them (the checks above are not vacuous).
  for row, changed in ((1, [5, 6, 11]), (2, [4]), (3, [8, 9, 11])):
    assert np.all(np.abs(logits[row, changed] - ref[changed]).max(-1) > 1e-4), row


# ----------------------------------------------------------------------- scan / remat


def _unscan(params, n_layers):
  """Scanned params ('blocks' with a leading layer axis) -> unrolled block_i params."""
  out = {k: v for k, v in params.items() if k != 'blocks'}
  for i in range(n_layers):
    out[f'block_{i}'] = jax.tree.map(lambda a, i=i: a[i], params['blocks'])
  return out


def test_stack_layer_trees_round_trip():
  cfg = _config(n_layers=4, attention='dense', stack='scan_cycle')
  for name in ('scan', 'scan_cycle', 'unrolled'):
    stack = stacks.get(name)
    per_layer = [{'w': jnp.full((3,), float(i))} for i in range(4)]
    tree = stack.stacked_tree(cfg, per_layer)
    for i in range(4):
      np.testing.assert_array_equal(stack.layer_tree(cfg, tree, i)['w'], per_layer[i]['w'])


def test_scanned_params_convert_to_unrolled():
  scanned_cfg = _config(n_layers=3, stack='auto')
  unrolled_cfg = _config(n_layers=3, stack='unrolled')
  scanned = _random_params(scanned_cfg)
  unrolled = _unscan(scanned, 3)
  expected_shapes = _param_shapes(unrolled_cfg)
  assert jax.tree.structure(unrolled) == jax.tree.structure(expected_shapes)
  assert jax.tree.map(jnp.shape, unrolled) == jax.tree.map(lambda s: s.shape, expected_shapes)
  # Layers hold different weights, so reusing one layer's weights would be caught by
  # test_remat_and_scan_match_plain_unrolled[none-True], which compares logits and grads.
  assert np.abs(np.asarray(unrolled['block_0']['mlp']['wo']) -
                np.asarray(unrolled['block_1']['mlp']['wo'])).max() > 0.1


@functools.lru_cache(maxsize=None)
def _logits_and_grads(remat, scan):
  """Logits and parameter gradients; the same weights for every (remat, scan).

  Unrolled runs use the scanned weights split per layer, and scanned gradients are returned
  split the same way, so every variant is comparable leaf by leaf.
  """
  cfg = _config(remat=remat, stack='auto' if scan else 'unrolled')
  params = _random_params(_config(stack='auto'))
  if not scan:
    params = _unscan(params, cfg.n_layers)
  model = transformer.Decoder(cfg)
  tokens, positions, segments = (x[None] for x in _pack(_tokens(5, 6), _tokens(6, 6)))
  cotangent = np.random.default_rng(7).normal(size=(1, 12, VOCAB)).astype(np.float32)

  def loss(p):
    logits = model.apply({'params': p}, tokens, positions=positions, segment_ids=segments)
    return jnp.sum(logits * cotangent), logits

  (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
  return logits, (_unscan(grads, cfg.n_layers) if scan else grads)


# A covering set in CI: every policy once, and remat both under scan (the stack 'auto' picks
# for a homogeneous model) and unrolled: 'full' unrolled, the dots policies under scan, and
# scan alone ('none'). The other pairs repeat those checks, so they run under -m slow.
_REMAT_IN_CI = {('none', True), ('dots_saveable', True),
                ('dots_with_no_batch_dims_saveable', True), ('full', False), ('none', False)}


@pytest.mark.parametrize('remat,scan', [
    pytest.param(r, s, marks=() if (r, s) in _REMAT_IN_CI else pytest.mark.slow)
    for s in (True, False) for r in transformer.REMAT_POLICIES])
def test_remat_and_scan_match_plain_unrolled(remat, scan):
  if (remat, scan) == ('none', False):
    pytest.skip('the reference itself')
  logits, grads = _logits_and_grads(remat, scan)
  ref_logits, ref_grads = _logits_and_grads('none', False)
  np.testing.assert_allclose(logits, ref_logits, atol=1e-5, rtol=1e-5)
  assert jax.tree.structure(grads) == jax.tree.structure(ref_grads)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
    # float32 summation order differs between variants: tolerance relative to the leaf scale.
    np.testing.assert_allclose(a, b, atol=1e-5 * max(1.0, np.abs(b).max()), rtol=1e-5)
  assert all(np.any(np.asarray(g) != 0) for g in jax.tree.leaves(ref_grads))


@pytest.mark.parametrize('scan', [False, True])
def test_attention_sees_its_layer_index(scan):
  # MultiHeadAttention.layer_index is documented as "index of the layer holding this module
  # (per-layer patterns use it)"; it must not depend on how the stack is compiled.
  cfg = _config(attention=PROBE_NAME, n_layers=3, stack='auto' if scan else 'unrolled')
  assert cfg.stack_name == 'unrolled'  # A variant that reads its layer index is never scanned.
  assert _config(n_layers=3, stack='auto' if scan else 'unrolled').stack_name == (
      'scan' if scan else 'unrolled')
  tokens = jnp.zeros((1, 4), jnp.int32)
  params = _random_params(cfg)
  _, inter = jax.jit(lambda p: transformer.Decoder(cfg).apply(
      {'params': p}, tokens, mutable=['intermediates']))(params)
  seen = np.concatenate([np.ravel(x) for x in jax.tree.leaves(inter)])
  np.testing.assert_array_equal(seen, [0.0, 1.0, 2.0])


# ------------------------------------------------------------------------- aux losses


def _set_aux_w(params, values, scan):
  params = jax.tree.map(lambda x: x, params)  # Shallow-copy the dict tree.
  if scan:
    params['blocks']['attention']['aux_w'] = jnp.asarray(values, jnp.float32)
  else:
    for i, v in enumerate(values):
      params[f'block_{i}']['attention']['aux_w'] = jnp.asarray(v, jnp.float32)
  return params


def _get_aux_w(params, n_layers, scan):
  if scan:
    return np.asarray(params['blocks']['attention']['aux_w'])
  return np.array([params[f'block_{i}']['attention']['aux_w'] for i in range(n_layers)])


@pytest.mark.parametrize('scan', [True, False])
def test_aux_losses_are_collected_per_layer(scan):
  cfg = _config(attention=AUX_NAME, stack='auto' if scan else 'unrolled')
  aux_w = [2.0, 3.0]
  params = _set_aux_w(_random_params(cfg), aux_w, scan)
  tokens = jnp.asarray(_tokens(8, (2, 6)))
  logits, mutated = jax.jit(lambda p: transformer.Decoder(cfg).apply(
      {'params': p}, tokens, mutable=['losses']))(params)
  assert logits.shape == (2, 6, VOCAB)
  leaves = jax.tree.leaves(mutated['losses'])
  assert sum(x.size for x in leaves) == 2  # One sown value per layer.
  expected = AUX_COEF * sum(w * w for w in aux_w)
  np.testing.assert_allclose(steps.sum_collection(mutated['losses']), expected, rtol=1e-6)


def test_sum_collection_empty_and_nested():
  assert float(steps.sum_collection({})) == 0.0
  tree = {'a': (jnp.array([1.0, 2.0]),), 'b': {'c': (jnp.array(3.0), jnp.array(4.0))}}
  assert float(steps.sum_collection(tree)) == 10.0


@pytest.mark.parametrize('scan,accum,remat', [(True, 2, 'full'), (False, 1, 'none')])
def test_train_step_includes_aux_loss(scan, accum, remat):
  cfg = _config(attention=AUX_NAME, stack='auto' if scan else 'unrolled', remat=remat)
  model = transformer.Decoder(cfg)
  aux_w = np.array([2.0, 3.0], np.float32)
  params = _set_aux_w(_random_params(cfg), aux_w, scan)
  lr = 0.1
  tx = optax.sgd(lr)
  state = steps.TrainState(step=jnp.zeros((), jnp.int32), params=params,
                           opt_state=tx.init(params))
  tokens = _tokens(9, (2, 9))
  batch = {'inputs': tokens[:, :-1], 'targets': tokens[:, 1:],
           'weights': np.ones((2, 8), np.float32),
           'positions': np.tile(np.arange(8, dtype=np.int32), (2, 1)),
           'segment_ids': np.ones((2, 8), np.int32)}
  train_step = jax.jit(steps.make_train_step(model, tx, lambda step: lr, grad_accum_steps=accum))
  new_state, metrics = train_step(state, batch, jax.random.PRNGKey(0))
  np.testing.assert_allclose(metrics['aux_loss'], AUX_COEF * np.sum(aux_w ** 2), rtol=1e-6)
  # aux_w only enters the objective through the sown loss: d/dw (c w^2) = 2 c w.
  np.testing.assert_allclose(_get_aux_w(new_state.params, 2, scan),
                             aux_w - lr * 2 * AUX_COEF * aux_w, rtol=1e-6)
  assert np.isfinite(metrics['loss']) and metrics['loss'] > 0
  assert int(new_state.step) == 1


# ------------------------------------------------------------------------------ bf16


def test_bfloat16_compute_float32_params():
  cfg16 = _config(dtype='bfloat16', param_dtype='float32')
  cfg32 = _config()
  shapes = _param_shapes(cfg16)
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(shapes))
  assert _count(shapes) == cfg16.num_params()
  params = _random_params(cfg32)
  tokens, positions, segments = (x[None] for x in _pack(_tokens(10, 6), _tokens(11, 6)))
  logits32 = np.asarray(_apply_fn(cfg32)(params, tokens, positions, segments))
  logits16 = _apply_fn(cfg16)(params, tokens, positions, segments)
  assert logits16.dtype == jnp.float32
  assert np.all(np.isfinite(logits16))
  scale = np.abs(logits32).max()
  err = np.abs(np.asarray(logits16) - logits32).max()
  assert err < 0.05 * scale, (err, scale)
  assert err > 0  # bfloat16 really was used for the computation.


def test_swiglu_activation_matches_autodiff():
  h = jax.random.normal(jax.random.key(3), (2, 5, 2, 7)) * 3.0
  dy = jax.random.normal(jax.random.key(4), (2, 5, 7))
  plain = lambda h: jax.nn.silu(h[..., 0, :]) * h[..., 1, :]

  @jax.jit  # One program (op by op, each primitive compiled alone, was slower).
  def both(h, dy):
    y, vjp_custom = jax.vjp(layers.swiglu_activation, h)
    y_plain, vjp_plain = jax.vjp(plain, h)
    return y, y_plain, vjp_custom(dy)[0], vjp_plain(dy)[0]

  y, y_plain, g, g_plain = both(h, dy)
  np.testing.assert_allclose(y, y_plain, rtol=1e-6)
  np.testing.assert_allclose(g, g_plain, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('hidden_split', [False, True])
def test_swiglu_mlp_matches_autodiff(monkeypatch, hidden_split):
  # The backward takes a per-part form, or the stacked 3-D form where the mesh splits the
  # hidden axis (layers.can_flatten('mlp') is False): both against autodiff.
  monkeypatch.setattr(layers, 'can_flatten', lambda axis: not hidden_split)
  k = jax.random.split(jax.random.key(5), 4)
  x = jax.random.normal(k[0], (2, 5, 6))
  w_in = jax.random.normal(k[1], (6, 2, 7)) * 0.5
  w_out = jax.random.normal(k[2], (7, 6)) * 0.5
  dy = jax.random.normal(k[3], (2, 5, 6))

  def plain(x, w_in, w_out):
    h = jnp.einsum('btd,dgf->btgf', x, w_in)
    return jnp.einsum('btf,fd->btd', jax.nn.silu(h[..., 0, :]) * h[..., 1, :], w_out)

  @jax.jit  # One program (op by op, each primitive compiled alone, was slower).
  def both(x, w_in, w_out, dy):
    y, vjp_custom = jax.vjp(layers.swiglu_mlp, x, w_in, w_out)
    y_plain, vjp_plain = jax.vjp(plain, x, w_in, w_out)
    return y, y_plain, vjp_custom(dy), vjp_plain(dy)

  y, y_plain, g, g_plain = both(x, w_in, w_out, dy)
  np.testing.assert_allclose(y, y_plain, rtol=1e-5, atol=1e-6)
  for got, want in zip(g, g_plain):
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_sinusoidal_positions_join_the_embedding_at_its_scale():
  """model.position_embedding='sinusoidal': no parameters; the first block reads the token
  embedding plus rms(embedding) times the sinusoid (layers.add_at_scale)."""
  base = dict(vocab_size=VOCAB, d_model=32, n_heads=2, n_layers=1, max_len=MAX_LEN,
              dtype='float32')
  sin = transformer.TransformerConfig.from_config({**base, 'position_embedding': 'sinusoidal'})
  none = transformer.TransformerConfig.from_config({**base, 'position_embedding': 'none'})
  assert sin.num_params() == none.num_params()
  emb = jax.random.normal(jax.random.key(0), (2, 5, 32)) * 0.02
  signal = layers.sinusoid(jnp.arange(5), 32)
  got = layers.add_at_scale(emb, signal)
  rms = np.sqrt(np.mean(np.square(np.asarray(emb)), axis=-1, keepdims=True))
  np.testing.assert_allclose(got, np.asarray(emb) + rms * np.asarray(signal), rtol=1e-5,
                             atol=1e-7)
  tokens = jnp.ones((1, MAX_LEN), jnp.int32)  # Same token everywhere: only positions differ.
  model = transformer.Decoder(sin)
  params = jax.jit(model.init)(jax.random.key(0), tokens)  # Jitted: op by op was slower.
  logits = jax.jit(model.apply)(params, tokens)
  assert np.max(np.abs(np.asarray(logits[0, 1:] - logits[0, :1]))) > 1e-4
