"""The option mechanism every registry shares (models/options.py, models/registry.py):
declared options, their defaults, resolution with type checks, one flat namespace."""

import pytest

from models import options
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
