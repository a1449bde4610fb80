"""Selective attention in the training loop: L_mem, --mode=inspect, budget allocation and eval.

One tiny Variable Assignment run (configs/tiny.py, 2 layers, sequences of 18) trains a
selective model with L_mem; the pruning modes and inspect then read its checkpoint.
"""

import json
import os

import numpy as np
import pytest

from training import inspect, metrics, pruning, train

STEPS = 12
EXTRA = {'model.attention': 'selective', 'total_steps': STEPS, 'checkpoint_every_steps': STEPS,
         'model.attention_options.selective_lmem_eps': 0.1, 'pruning.step': 4}


def test_greedy_cuts_the_layer_that_hurts_least_until_the_target():
  # Layer 0 is free to cut down to 2; layer 1 costs 0.1 per cut; layer 2 is not selective.
  def loss_of(budgets):
    return 1.0 + 0.1 * (16 - budgets[1]) / 4 + 0.001 * (16 - budgets[0]) / 4

  budgets, base, final, target, history = pruning.greedy_budgets(
      loss_of, 3, [0, 1], 16, 4, lambda b: b + 0.15)
  assert base == 1.0 and target == pytest.approx(1.15)
  assert budgets == [4, 12, 16]  # 16 -> 12 -> 8 -> 4 for layer 0 (2 is < 2 + C), one cut of 1
  assert [h['layer'] for h in history] == [0, 0, 0, 1]
  assert final == pytest.approx(loss_of(budgets))
  assert pruning.memory_reduction(budgets, 16) == pytest.approx(48 / 32)


@pytest.fixture(scope='module')
def trained(harness, tmp_path_factory):
  workdir = tmp_path_factory.mktemp('selective')
  logged = []
  original = metrics.MetricLogger.write

  def write(self, step, scalars, prefix='train'):
    logged.append(dict(scalars))
    return original(self, step, scalars, prefix)

  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(metrics.MetricLogger, 'write', write)
    state = train.train_and_evaluate(harness.config(EXTRA), str(workdir))
  return workdir, state, logged


def test_selective_trains_with_l_mem(trained):
  _, state, logged = trained
  assert int(state.step) == STEPS
  # L_mem = eps sum_l max_i M_i / (L n): each document's max_i M_i <= its length, so <= eps.
  aux = [m['aux_loss'] for m in logged if 'aux_loss' in m]
  assert aux and all(0 < a <= 0.1 for a in aux), aux
  leaves = [np.asarray(x) for x in state.params['block_0']['attention'].values()
            if hasattr(x, 'shape')]
  assert leaves and all(np.isfinite(x).all() for x in leaves)


def test_inspect_writes_f_like_figure_5(harness, trained):
  workdir = trained[0]
  paths = inspect.inspect(harness.config(EXTRA), str(workdir))
  f = np.load(paths['selective_npz'])
  n = 18
  assert sorted(k for k in f if k.startswith('layer')) == ['layer0', 'layer1']
  for key in ('layer0', 'layer1'):
    m = f[key]
    assert m.shape == (n, n)
    assert np.isnan(m[np.triu_indices(n, 1)]).all()           # queries never see later keys
    low = m[np.tril_indices(n)]
    assert np.isfinite(low).all() and (low >= 0).all()       # ReLU: F >= 0
    np.testing.assert_array_equal(m[:, 0], 0.0)              # <BOS> is never masked
    np.testing.assert_array_equal(np.diag(m), 0.0)           # shift + diagonal: F_ii = 0
  with open(paths['selective_png'], 'rb') as fh:
    assert fh.read(8) == b'\x89PNG\r\n\x1a\n'


def test_allocate_and_evaluate_budgets(harness, trained):
  workdir = trained[0]
  # A generous tolerance: every layer is cut to its floor (18 -> 14 -> 10 -> 6 -> 2).
  loose = harness.config({**EXTRA, 'pruning.tolerance': 100.0})
  result = pruning.allocate_budgets(loose, str(workdir))
  assert result['budgets'] == [2, 2] and result['context'] == 18
  assert result['memory_reduction'] == pytest.approx(9.0)
  assert len(result['history']) == 8
  with open(workdir / 'budgets.json') as f:
    assert json.load(f)['budgets'] == [2, 2]
  evaluated = pruning.evaluate_budgets(loose, str(workdir))
  assert evaluated['memory_reduction'] == pytest.approx(9.0)
  assert evaluated['loss'] != pytest.approx(evaluated['unpruned_loss'], abs=1e-6)
  assert os.path.exists(workdir / f'eval_budgets_step_{STEPS}.json')
  # A strict target (below the unpruned loss): nothing is cut, and the loss is unchanged.
  strict_file = str(workdir / 'strict.json')
  strict = harness.config({**EXTRA, 'pruning.target_loss': 1e-9,
                           'pruning.budget_file': strict_file})
  result = pruning.allocate_budgets(strict, str(workdir))
  assert result['budgets'] == [18, 18] and result['memory_reduction'] == 1.0
  evaluated = pruning.evaluate_budgets(strict, str(workdir))
  assert evaluated['loss'] == pytest.approx(evaluated['unpruned_loss'], rel=1e-5)
