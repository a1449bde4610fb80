"""The narrow attention protocol (docs/adding_a_variant.md): a variant's module writes only its
math (base.PROTOCOL, plus base.OVERRIDABLE where it needs them), and every other declaration
is an optional traits.Traits read through traits.of."""

import pytest

from models import attention
from models.attention import base, traits


def _overridden(module: type) -> set[str]:
  """The names of MultiHeadAttention that `module` or a parent below it redefines."""
  own = set()
  for klass in module.__mro__:
    if klass is base.MultiHeadAttention:
      break
    own |= set(vars(klass))
  # Flax makes every module a dataclass: its generated fields and methods are not overrides.
  return {n for n in own if n in vars(base.MultiHeadAttention) and not n.startswith('_')
          and n not in ('name', 'parent', 'scope')}


def test_the_required_protocol_is_at_most_six_names_and_the_module_has_no_class_hooks():
  assert len(base.PROTOCOL) <= 6
  assert all(hasattr(base.MultiHeadAttention, n) for n in base.PROTOCOL + base.OVERRIDABLE)
  hooks = [n for n, v in vars(base.MultiHeadAttention).items()
           if isinstance(v, (classmethod, staticmethod))]
  assert hooks == [], f'class-level hooks belong in traits.Traits: {hooks}'


@pytest.mark.parametrize('name', attention.known())
def test_each_variant_overrides_only_the_protocol(name):
  module = attention.get(name)
  extra = _overridden(module) - set(base.PROTOCOL) - set(base.OVERRIDABLE)
  assert not extra, f'{name} overrides {sorted(extra)} outside the protocol'
  declared = attention.traits.of(name)
  assert declared.module is module and issubclass(declared, traits.Traits)


def test_a_hook_written_on_the_module_is_refused_with_where_it_goes():
  class Misplaced(base.MultiHeadAttention):
    @classmethod
    def param_bounds(cls, options):
      return {'w': (0.0, 1.0)}

  with pytest.raises(TypeError, match=r"param_bounds on its module: declare them in a "
                                      r"traits.Traits subclass.*@traits.declare\('misplaced'\)"):
    traits._check_module('misplaced', Misplaced)  # pylint: disable=protected-access


def test_a_variant_that_declares_nothing_gets_working_defaults():
  declared = attention.traits.of('dense')
  default = type('T', (traits.Traits,), {'module': attention.get('local')})
  assert default.layer_period({}, 4) == 1 and default.param_bounds({}) == {}
  assert default.specialize(None, None) is None and not default.draws()
  assert default.has_static_pattern() and default.can_prefill()
  assert declared.DENSE and not default.DENSE
  assert default.implementation('xla', options={}, head_dim=16, backend='cpu') == 'xla'


def test_a_variant_declares_once():
  with pytest.raises(ValueError, match='already declares DenseTraits'):
    traits.declare('dense')(type('Other', (traits.Traits,), {}))
  with pytest.raises(TypeError, match='must subclass traits.Traits'):
    traits.declare('dense')(type('NotTraits', (), {}))


def test_every_traits_hook_is_documented():
  doc = open('docs/adding_a_variant.md').read()
  for name, value in vars(traits.Traits).items():
    if name.startswith('_') or name in ('module', 'draws', 'has_static_pattern', 'can_prefill',
                                        'own_path_implementation'):
      continue
    assert f'`{name}' in doc, f'{name} is missing from docs/adding_a_variant.md'
  for name in base.PROTOCOL + base.OVERRIDABLE:
    assert f'`{name}' in doc
