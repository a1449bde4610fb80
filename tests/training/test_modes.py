"""main.py's modes come from one table (training/modes.py): the backbone's and those of the
attention variants, declared beside the code they run, so main.py names none of them and models/
names no training module (issues 36 and 49)."""

import pytest

from models.attention import base, registry
from training import evaluation, modes, pruning


def test_the_table_holds_the_backbone_and_the_selective_pruning_modes():
  table = modes.table()
  assert list(table)[:6] == ['train', 'eval', 'generate', 'inspect', 'compile', 'harness']
  assert table['allocate_budgets'].offered_by == 'selective'
  assert modes.get('allocate_budgets').func is pruning.allocate_budgets
  assert modes.get('eval').func is evaluation.evaluate_checkpoint
  assert modes.get('train').keywords == {'exits': True}
  assert 'allocate_budgets: greedy per-layer context budgets' in modes.help_text()
  with pytest.raises(ValueError, match="unknown mode 'evaluate'; known modes: train, eval"):
    modes.get('evaluate')


def test_variant_modes_are_declared_in_training_for_registered_variants(monkeypatch):
  # models/ names no training module: a variant's mode is declared with the code it runs.
  assert not hasattr(base.MultiHeadAttention, 'MODES')
  assert all(m.offered_by in registry.VARIANTS.known() for m in modes.VARIANTS.values())
  monkeypatch.setitem(modes.VARIANTS, 'orphan', modes.Mode('builtins:len', 'x',
                                                            offered_by='no_such_variant'))
  modes.table.cache_clear()
  try:
    with pytest.raises(ValueError, match="'orphan' is offered by attention variant "
                                         "'no_such_variant', which is not registered"):
      modes.table()
  finally:
    monkeypatch.undo()
    modes.table.cache_clear()


def test_a_variant_defined_elsewhere_offers_a_mode(monkeypatch):
  monkeypatch.setattr(modes, 'VARIANTS', dict(modes.VARIANTS))
  try:
    modes.offer('count_heads', 'builtins:len', 'a mode of a test variant', variant='dense')
    assert modes.table()['count_heads'].offered_by == 'dense'
    assert modes.get('count_heads')('abc') == 3
    with pytest.raises(ValueError, match="'dense' offers mode 'eval', which the backbone "
                                         'offers too'):
      modes.offer('eval', 'builtins:len', 'clashes with the backbone', variant='dense')
    with pytest.raises(ValueError, match="offers mode 'allocate_budgets', which selective "
                                         'offers too'):
      modes.offer('allocate_budgets', 'builtins:len', 'clashes', variant='dense')
  finally:
    monkeypatch.undo()
    modes.table.cache_clear()
