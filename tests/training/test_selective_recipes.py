"""Selective attention in the training loop: L_mem, --mode=inspect, budget allocation and eval.

One tiny Variable Assignment run (configs/tiny.py, 2 layers, sequences of 18) trains a
selective model with L_mem; the pruning modes and inspect then read its checkpoint, in process
and (--mode=eval_budgets) through main.py. The runs of every mode through main.py and on an
8-device mesh are slow (run them with `-m slow`).
"""

import json
import os
import shutil

import numpy as np
import pytest

from training import attention_maps, metrics, pruning, train

STEPS = 12
EXTRA = {'model.attention': 'selective', 'total_steps': STEPS, 'checkpoint_every_steps': STEPS,
         'model.attention_options.selective.lmem_eps': 0.1, 'pruning.step': 4}


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
  paths = attention_maps.write_maps(harness.config(EXTRA), str(workdir))
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


def test_main_evaluates_budgets_of_the_trained_run(harness, trained, tmp_path):
  """main.py --mode=eval_budgets on a copy of the trained run with a budget file written here:
  the default run's smoke test of main.py for selective attention (one subprocess; the slow
  test below runs every mode from training on)."""
  workdir = tmp_path / 'run'
  shutil.copytree(trained[0], workdir)
  (workdir / 'budgets.json').write_text(json.dumps({'budgets': [6, 6]}))
  proc = harness.run_main(workdir, EXTRA, mode='eval_budgets')
  assert proc.returncode == 0, proc.stderr[-3000:]
  with open(workdir / f'eval_budgets_step_{STEPS}.json') as f:
    result = json.load(f)
  assert result['step'] == STEPS and result['budgets'] == [6, 6] and result['context'] == 18
  assert result['memory_reduction'] == pytest.approx(3.0)
  assert np.isfinite(result['loss']) and np.isfinite(result['unpruned_loss'])
  assert result['loss'] != pytest.approx(result['unpruned_loss'], abs=1e-6)  # Budgets bite.


@pytest.mark.slow
def test_main_runs_the_pruning_modes(harness, tmp_path):
  """main.py: train, --mode=allocate_budgets, --mode=eval_budgets, --mode=inspect."""
  extra = {**EXTRA, 'pruning.tolerance': 0.05}
  for mode in ('train', 'allocate_budgets', 'eval_budgets', 'inspect'):
    proc = harness.run_main(tmp_path, extra, mode=mode)
    assert proc.returncode == 0, proc.stderr[-3000:]
  with open(tmp_path / f'eval_budgets_step_{STEPS}.json') as f:
    result = json.load(f)
  assert result['memory_reduction'] >= 1.0 and np.isfinite(result['loss'])
  assert (tmp_path / 'inspect' / 'selective_F.png').exists()


_SHARDED = '''
import json, sys
import jax
from configs import tiny
from training import assembly, sharding, steps

def run(data, fsdp, tensor, devices):
  config = tiny.get_config()
  config.model.update(d=2, vocab_size=32, attention='selective', dtype='float32')
  config.model.attention_options.selective.update(lmem_eps=0.1, separate_bilinear=True)
  config.update(batch_size=8, warmup_steps=0, adam_eps=1e-3, peak_tflops_per_device=1.0)
  config.data.num_assignments = 8
  config.mesh.data, config.mesh.fsdp, config.mesh.tensor = data, fsdp, tensor
  setup = assembly.build(config, devices=devices)
  state = assembly.init_state(setup, config.seed)
  step_fn = steps.jit_train_step(setup)
  out = []
  with sharding.activate(setup.mesh, setup.rules):
    for step in range(2):
      batch = assembly.device_batch(setup, setup.data.train_batch(step))
      state, m = step_fn(state, batch, jax.random.key(1))
      out.append([float(m['loss']), float(m['aux_loss']), float(m['grad_norm'])])
  return out

json.dump({'one': run(1, 1, 1, jax.devices()[:1]), 'eight': run(2, 2, 2, jax.devices())},
          open(sys.argv[1], 'w'))
'''


@pytest.mark.slow
def test_selective_step_on_a_2x2x2_mesh_matches_one_device(harness, tmp_path):
  script = tmp_path / 'sharded.py'
  script.write_text(_SHARDED)
  proc = harness.run_script(script, tmp_path / 'out.json', devices=8)
  assert proc.returncode == 0, proc.stderr[-3000:]
  result = json.loads((tmp_path / 'out.json').read_text())
  one, eight = np.array(result['one']), np.array(result['eight'])
  assert np.all(one[:, 1] > 0)  # L_mem is on
  np.testing.assert_allclose(eight, one, rtol=1e-5, atol=1e-5)
