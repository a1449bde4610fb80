"""Every run setting is declared once (configs/schema.py, configs/declare.py: default, doc,
range, change kind), and the config, the change-kind check (training/run_config.py) and the
range check (training/settings.py) all read that declaration (issue 49): before, a setting
was declared in four places, and a field added to the declaration was a model change
until someone listed it in run_config.KINDS."""

import ml_collections
import pytest

from configs import declare, default, schema
from configs.declare import INTEGER, REAL, RUNTIME, TRAINING, Group, Options, Range, Setting
from training import run_config, settings

pytestmark = pytest.mark.unit


def _declared_leaves() -> dict[str, Setting]:
  return {key: entry for key, entry, _ in declare.walk(schema.SETTINGS)
          if isinstance(entry, Setting)}


def test_every_field_of_the_base_config_is_declared_once_with_a_doc():
  flat = run_config.as_flat_json(default.get_config())
  option_groups = tuple(run_config.OPTION_GROUPS)
  fields = {k for k in flat if not k.startswith(option_groups)}
  leaves = _declared_leaves()
  assert fields == set(leaves), fields ^ set(leaves)
  assert all(s.doc.strip() for s in leaves.values())
  # The option groups are their registries' (models/options.Option next to each variant).
  assert {k for k, e, _ in declare.walk(schema.SETTINGS) if isinstance(e, Options)} == {
      g.rstrip('.') for g in run_config.OPTION_GROUPS}


def test_the_change_check_and_the_range_check_read_the_declaration():
  for key, entry, change in declare.walk(schema.SETTINGS):
    if not isinstance(entry, Options):
      assert run_config.kind(key) == change, key
  assert run_config.kind('seed') == TRAINING  # Its own kind, inside a 'model' top level.
  assert run_config.kind('generate.top_k') == RUNTIME  # Its group's.
  assert run_config.kind('generate.a_field_of_an_older_run') == RUNTIME
  ranged = {k: s for k, s in _declared_leaves().items() if s.bounds is not None}
  assert settings.RANGES == {k: s.bounds for k, s in ranged.items()}
  assert settings.ZERO_MEANS == {k: s.zero_means for k, s in ranged.items() if s.zero_means}
  config = default.get_config()
  config.clip_grad_norm = -1.0
  with pytest.raises(ValueError, match=r'clip_grad_norm must be a finite number >= 0 '
                     r'\(0 = no clipping\), got -1.0'):
    settings.check(config)
  # The model's sizes too, in the same words, before anything is built (issue 69).
  config = default.get_config()
  config.model.n_heads = -1
  with pytest.raises(ValueError, match=r'^model\.n_heads must be an integer >= 0 \(0 = d\), '
                     r'got -1$'):
    settings.check(config)


def test_a_setting_declared_in_one_place_reaches_every_reader():
  tree = Group('a run', change='model', settings={
      'steps': Setting(10, 'Steps.', change=RUNTIME, bounds=Range(INTEGER, 1)),
      'opt': Group('An optimizer.', change=TRAINING, settings={
          'lr': Setting(0.1, 'Rate.', bounds=Range(REAL, 0, 1), zero_means='frozen'),
          'name': Setting('adam', 'Which.', change='model'),
      }),
  })
  config = declare.build(tree)
  assert isinstance(config.opt, ml_collections.ConfigDict)
  assert config.to_dict() == {'steps': 10, 'opt': {'lr': 0.1, 'name': 'adam'}}
  assert declare.kinds(tree) == {'steps': RUNTIME, 'opt': TRAINING, 'opt.lr': TRAINING,
                                 'opt.name': 'model'}
  assert set(declare.ranges(tree)) == {'steps', 'opt.lr'}
  assert declare.ranges(tree)['opt.lr'].bounds.describe() == 'a finite number in [0, 1)'
  assert not declare.ranges(tree)['steps'].bounds.holds(0)
  assert declare.ranges(tree)['opt.lr'].bounds.holds(0.5)
  # Each config is its own: a list default is copied.
  listed = Group('g', settings={'rules': Setting([('a', None)], 'Rules.')})
  first = declare.build(listed)
  first.rules.append(('b', None))
  assert declare.build(listed).rules == [('a', None)]


def test_a_bad_declaration_is_refused_where_it_is_written():
  with pytest.raises(ValueError, match='Option.change must be one of'):
    Setting(0, 'A typo.', change='eval')
  with pytest.raises(ValueError, match='zero_means needs bounds'):
    Setting(0, 'Off.', zero_means='off')
