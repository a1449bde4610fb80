"""The option mechanism every registry shares (models/options.py, models/registry.py):
declared options, their defaults, resolution with type checks, one flat namespace; and the
model's block and stack option groups (model.residual_options, model.stack_options)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import attention, options, transformer
from models.attention import base
from models.registry import Registry


def _registry():
  reg = Registry('widget', 'model.widget_options')

  @reg.register('plain')
  class Plain:  # pylint: disable=unused-variable
    pass

  @reg.register('knobbed')
  class Knobbed:
    OPTIONS = {'turns': options.Option(3, 'n: turns'),
               'loose': options.Option(False, 'slack', change='training'),
               'secret': options.Option(0.5, 'set by the loop', internal=True)}

  @reg.register('more_knobs')
  class MoreKnobs(Knobbed):  # pylint: disable=unused-variable
    OPTIONS = {'width': options.Option(1.0, 'w')}

  return reg


def test_attention_keeps_its_names_for_the_shared_option():
  assert base.Option is options.Option and base.CHANGES == options.CHANGES


def test_declared_options_defaults_and_inheritance():
  reg = _registry()
  assert sorted(reg.options()) == ['loose', 'secret', 'turns', 'width']
  assert sorted(options.declared(reg.get('more_knobs'))) == ['loose', 'secret', 'turns', 'width']
  assert options.declared(reg.get('plain')) == {}
  # Internal options stay out of the configs.
  assert reg.default_options() == {'loose': False, 'turns': 3, 'width': 1.0}


def test_resolve_fills_defaults_and_checks_the_types_of_the_entries_in_use():
  reg = _registry()
  assert reg.resolve_options({'turns': 5}, ['knobbed']) == {
      'turns': 5, 'loose': False, 'secret': 0.5, 'width': 1.0}
  with pytest.raises(ValueError, match=r"model.widget_options.turns \(n: turns\) must be an "
                                       r"integer, got 2.5"):
    reg.resolve_options({'turns': 2.5}, ['knobbed'])
  reg.resolve_options({'turns': 2.5}, ['plain'])  # Checked only where an entry in use reads it.
  reg.resolve_options({'width': 2}, ['more_knobs'])  # A float option takes ints.


def test_an_unknown_option_lists_the_declared_ones():
  with pytest.raises(ValueError, match=r'unknown model.widget_options turnz; the registered '
                                       r'widgets declare: loose, secret, turns, width'):
    _registry().resolve_options({'turnz': 1}, [])
  empty = Registry('gadget', 'model.gadget_options')
  with pytest.raises(ValueError, match='the registered gadgets declare: none'):
    empty.resolve_options({'x': 1}, [])


def test_a_module_built_with_an_option_it_does_not_declare_refuses_it():
  """A script or notebook that builds a variant with an old flat option name (span_limit,
  now adaptive_span's limit) used to get the default silently."""
  span = attention.get('adaptive_span')
  with pytest.raises(ValueError, match=r"has no option 'span_limit'; its options: .*limit"):
    span(num_heads=2, head_dim=8, options=(('span_limit', 24),))
  span(num_heads=2, head_dim=8, options=(('limit', 24),))  # Declared: accepted.


def test_an_option_s_range_is_checked_with_the_run_settings_words():
  """Option.bounds: the same Range and the same message as a run setting's
  (training/settings.py), checked with the option's type when its group is resolved."""
  limit = options.Option(4, 'S', bounds=options.Range(options.INTEGER, 1))
  limit.check('limit', 1, 'model.attention_options.x')
  with pytest.raises(ValueError, match=r'^model\.attention_options\.x\.limit must be an integer '
                     r'>= 1, got 0$'):
    limit.check('limit', 0, 'model.attention_options.x')
  tau = options.Option(1.0, 'tau', bounds=options.Range(options.REAL, 0, lo_exclusive=True),
                       zero_means='never')
  with pytest.raises(ValueError, match=r'g\.tau must be a finite number > 0 \(0 = never\), '
                     r'got -1.0'):
    tau.check('tau', -1.0, 'g')
  with pytest.raises(ValueError, match='finite'):
    tau.check('tau', float('nan'), 'g')


def test_one_flat_namespace_per_registry():
  reg = _registry()
  with pytest.raises(ValueError, match=r"widget 'copy' declares option 'turns', which 'knobbed' "
                                       r"declares too: options share model.widget_options"):
    reg.register('copy')(type('Copy', (), {'OPTIONS': {'turns': options.Option(3, 'again')}}))
  # The same Option object shared by two entries is one option.
  shared = reg.options()['turns']
  reg.register('sharer')(type('Sharer', (), {'OPTIONS': {'turns': shared}}))
  with pytest.raises(ValueError, match="registered twice"):
    reg.register('plain')(type('Again', (), {}))


def test_lookup_names_the_group():
  assert options.lookup((('a', 1), ('b', 2)), 'b', 'model.stack_options') == 2
  with pytest.raises(ValueError, match=r'model.stack_options.c is read but no registered'):
    options.lookup((('a', 1),), 'c', 'model.stack_options')


def test_a_change_kind_outside_the_three_is_refused():
  with pytest.raises(ValueError, match='Option.change must be one of'):
    options.Option(0, 'a typo', change='eval')


def _model(**model):
  return transformer.TransformerConfig.from_config(dict(
      vocab_size=16, d_model=16, n_heads=2, n_layers=1, max_len=8, **model))


def test_every_model_carries_each_groups_options_with_defaults():
  config = _model()
  assert dict(config.residual_options) == {'gate_bias': 2.0}
  assert dict(config.stack_options) == {'act': False, 'max_steps': 8, 'ponder': 0.01,
                                        'steps': 4}
  assert config.residual_option('gate_bias') == 2.0 and config.stack_option('steps') == 4
  with pytest.raises(ValueError, match='unknown model.residual_options gate; the registered '
                                       'residual wirings declare: gate_bias'):
    _model(residual_options={'gate': 1.0})
  # Types are checked for the block and stack in use only (as attention options are).
  _model(residual_options={'gate_bias': 'high'})
  with pytest.raises(ValueError, match=r'model.residual_options.gate_bias \(.*\) must be a number'):
    _model(residual='gtrxl', residual_options={'gate_bias': 'high'})


def test_gtrxl_gate_bias_sets_the_initial_bias_only():
  x = jnp.zeros((1, 8), jnp.int32)

  def params(**residual_options):
    model = transformer.Decoder(_model(residual='gtrxl', dtype='float32',
                                       residual_options=residual_options))
    return nn.unbox(model.init(jax.random.key(0), x)['params'])

  default, other = params(), params(gate_bias=0.5)
  gates = lambda p: [p[k][g]['gate_bias'] for k in p if k.startswith('block') or k == 'blocks'
                     for g in ('attention_gate', 'mlp_gate')]
  assert len(gates(default)) == 2  # One layer's two gates.
  assert all(np.all(np.asarray(b) == 2.0) for b in gates(default))
  assert all(np.all(np.asarray(b) == 0.5) for b in gates(other))
  # The same tree: only the initial value differs.
  assert jax.tree.structure(default) == jax.tree.structure(other)
