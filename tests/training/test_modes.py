"""main.py's modes come from one table (training/modes.py): the backbone's and those a
variant offers in its MODES, so main.py names none of them (issue 36)."""

import pytest

from models.attention import base, registry
from training import evaluation, modes, pruning


def test_the_table_holds_the_backbone_and_the_selective_pruning_modes():
  table = modes.table()
  assert list(table)[:5] == ['train', 'eval', 'generate', 'inspect', 'compile']
  assert table['allocate_budgets'].offered_by == 'selective'
  assert modes.get('allocate_budgets').func is pruning.allocate_budgets
  assert modes.get('eval').func is evaluation.evaluate_checkpoint
  assert modes.get('train').keywords == {'exits': True}
  assert 'allocate_budgets: greedy per-layer context budgets' in modes.help_text()
  with pytest.raises(ValueError, match="unknown mode 'evaluate'; known modes: train, eval"):
    modes.get('evaluate')


class _OffersAMode(base.MultiHeadAttention):
  MODES = {'count_heads': ('builtins:len', 'a mode of a test variant')}


class _TakesTheEvalName(base.MultiHeadAttention):
  MODES = {'eval': ('builtins:len', 'clashes with the backbone')}


def test_a_variant_offers_a_mode_without_a_line_in_training(monkeypatch):
  monkeypatch.setitem(registry.VARIANTS._entries, 'test_offers_a_mode', _OffersAMode)
  modes.table.cache_clear()
  try:
    assert modes.table()['count_heads'].offered_by == 'test_offers_a_mode'
    assert modes.get('count_heads')('abc') == 3
    monkeypatch.setitem(registry.VARIANTS._entries, 'test_takes_eval', _TakesTheEvalName)
    modes.table.cache_clear()
    with pytest.raises(ValueError, match="'test_takes_eval' offers mode 'eval', which the "
                                         'backbone offers too'):
      modes.table()
  finally:
    monkeypatch.undo()
    modes.table.cache_clear()
