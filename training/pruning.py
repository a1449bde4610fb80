"""Context pruning with selective attention (section 4): per-layer budgets K_l.

`--mode=allocate_budgets`: the greedy allocation. Every selective layer starts at K_l = N
(the context length); each iteration tries cutting C (config.pruning.step, paper: 8) from
each layer in turn, measures the loss on a training sample (config.pruning.batches batches)
and keeps the cut that hurts least, until the best cut would raise the loss above the target
(config.pruning.target_loss, e.g. a dense model's loss; 0 = the unpruned loss plus
config.pruning.tolerance). Writes WORKDIR/budgets.json (or config.pruning.budget_file).

`--mode=eval_budgets`: the validation loss with those budgets (and without), and the KV-cache
memory reduction factor sum_l N / sum_l K_l. Writes WORKDIR/eval_budgets_step_<step>.json.

Loss with budgets runs the full forward with the eviction applied as a mask
(models/attention/selective.py `kept_mask`), which equals token-by-token decoding with
K_l-slot caches; the budgets enter through the 'pruning' collection, so the greedy search
compiles one forward pass.
"""

from __future__ import annotations

import copy
import json
import os

import jax
import jax.numpy as jnp
from absl import logging

from models import stacks
from models.attention import selective
from models.attention import registry
from training import assembly, evaluation, losses, run_config, sharding, steps


def selective_layers(model_config) -> list[int]:
  """Indices of the layers using selective attention."""
  return [i for i, name in enumerate(model_config.attention)
          if registry.get(name) is selective.SelectiveAttention]


def memory_reduction(budgets, context: int) -> float:
  """KV-cache memory reduction factor: sum_l N / sum_l min(K_l, N)."""
  return len(budgets) * context / sum(min(k, context) for k in budgets)


def _check_selective(setup) -> None:
  if not selective_layers(setup.model_config):
    raise ValueError('context pruning needs model.attention = \'selective\' (in some layer)')


def _restore(config, workdir):
  """(setup, step, params) of the latest checkpoint; `config` is the resolved one."""
  restored = assembly.load(config, workdir, required='train a selective model first',
                           check=_check_selective)
  return restored.setup, restored.step, restored.params


def budget_path(config, workdir: str) -> str:
  """config.pruning.budget_file, or WORKDIR/budgets.json."""
  return config.pruning.budget_file or os.path.join(workdir, 'budgets.json')


def make_loss_fn(setup):
  """jit (params, batch, budgets (L,) int32) -> (loss_sum, weight_sum) with pruning."""
  model, chunk = setup.model, setup.config.loss_chunk_len
  layers = selective_layers(setup.model_config)

  config = setup.model_config

  def loss_fn(params, batch, budgets):
    pruning = stacks.of(config).stacked_tree(config, [
        {'attention': {'budget': budgets[i]}} if i in layers else None
        for i in range(config.n_layers)])
    hidden, w = model.apply({'params': params, 'pruning': pruning}, batch['inputs'],
                            positions=batch['positions'], segment_ids=batch['segment_ids'],
                            return_hidden=True)
    loss_sum, _ = losses.linear_cross_entropy(hidden, w, batch['targets'], batch['weights'],
                                              chunk)
    return loss_sum, jnp.sum(batch['weights'])

  return jax.jit(loss_fn)


def greedy_cuts(loss_of, budgets: list[int], layers: list[int], step: int, target: float,
                current: float) -> tuple[list[int], float, list[dict]]:
  """The greedy loop of section 4 from `budgets` (whose loss is `current`): each iteration
  cuts `step` from the layer whose cut raises the loss least, while that loss stays at or
  below `target` and every budget stays >= 2. Returns (budgets, loss, history)."""
  budgets, history = list(budgets), []
  while True:
    trials = {}
    for i in layers:
      if budgets[i] - step >= 2:
        trial = list(budgets)
        trial[i] -= step
        trials[i] = loss_of(trial)
    if not trials:
      break
    best = min(trials, key=lambda i: (trials[i], i))
    if trials[best] > target:
      break
    budgets[best] -= step
    current = trials[best]
    history.append({'layer': best, 'budgets': list(budgets), 'loss': current})
    logging.info('pruning: cut layer %d -> budgets %s, loss %.4f (target %.4f)', best,
                 budgets, current, target)
  return budgets, current, history


def greedy_budgets(loss_of, n_layers: int, layers: list[int], context: int, step: int,
                   target_fn):
  """Section 4's greedy allocation.

  Args:
    loss_of: budgets (list of n_layers ints) -> loss on the training sample.
    n_layers: L.
    layers: the layers whose budget may be cut (the others stay at N).
    context: N, every budget's start.
    step: C.
    target_fn: unpruned loss -> the largest acceptable loss.

  Returns:
    (budgets, unpruned loss, final loss, target, history of (layer, budgets, loss)).
  """
  budgets = [context] * n_layers
  base = loss_of(budgets)
  target = target_fn(base)
  budgets, current, history = greedy_cuts(loss_of, budgets, layers, step, target, base)
  return budgets, base, current, target, history


def allocate_budgets(config, workdir: str, request: run_config.Request | None = None) -> dict:
  """Greedy per-layer budgets on a training sample; writes the budget file (JSON).

  The model is the workdir's recorded one (training/run_config.py); `request` (what the
  command line asked for; None: every field of `config`) may change run-time settings.
  """
  assembly.check_workdir(workdir)
  config = run_config.resolve(config, workdir, trains=False, request=request).config
  pc = config.pruning
  if pc.step < 1 or pc.batches < 1:
    raise ValueError(f'pruning.step (C) and pruning.batches must be >= 1, got {pc.step}, '
                     f'{pc.batches}')
  setup, step, params = _restore(config, workdir)
  try:
    it = setup.data.train_iter(0, None)
    sample = [next(it)[0] for _ in range(pc.batches)]
  finally:
    setup.data.close()
  loss_fn = make_loss_fn(setup)
  mc = setup.model_config
  context = setup.data.seq_len
  with sharding.activate(setup.mesh, setup.rules):
    batches = [assembly.device_batch(setup, local) for local in sample]

    def loss_of(budgets):
      arr = jnp.asarray(budgets, jnp.int32)
      total, weight = 0.0, 0.0
      for batch in batches:
        s, w = jax.device_get(loss_fn(params, batch, arr))
        total, weight = total + float(s), weight + float(w)
      return total / max(weight, 1.0)

    target_fn = (lambda base: float(pc.target_loss)) if pc.target_loss > 0 else (
        lambda base: base + float(pc.tolerance))
    budgets, base, final, target, history = greedy_budgets(
        loss_of, mc.n_layers, selective_layers(mc), context, int(pc.step), target_fn)
  result = {'budgets': budgets, 'context': context, 'step': int(pc.step),
            'batches': int(pc.batches), 'unpruned_loss': base, 'loss': final, 'target_loss': target,
            'memory_reduction': memory_reduction(budgets, context),
            'checkpoint_step': step, 'history': history}
  path = budget_path(config, workdir)
  if jax.process_index() == 0:
    with open(path, 'w') as f:
      json.dump(result, f, indent=2)
  logging.info('budgets %s (memory reduction %.2fx), train-sample loss %.4f (unpruned %.4f, '
               'target %.4f) -> %s', budgets, result['memory_reduction'], final, base, target,
               path)
  return result


def evaluate_budgets(config, workdir: str, request: run_config.Request | None = None) -> dict:
  """Validation loss with the budget file's K_l and without; the memory reduction factor.

  The model is the workdir's recorded one, as in `allocate_budgets`.
  """
  assembly.check_workdir(workdir)
  config = run_config.resolve(config, workdir, trains=False, request=request).config
  path = budget_path(config, workdir)
  if not os.path.exists(path):
    raise FileNotFoundError(f'no budget file {path}: run --mode=allocate_budgets first')
  with open(path) as f:
    budgets = tuple(int(k) for k in json.load(f)['budgets'])
  setup, step, params = _restore(config, workdir)
  unpruned = evaluation.score(setup, steps.jit_eval_step(setup), params)
  pruned_config = copy.deepcopy(config)
  pruned_config.model.attention_options.selective.budgets = budgets
  pruned_setup = assembly.build(pruned_config, workdir=workdir)
  try:
    pruned = evaluation.score(pruned_setup, steps.jit_eval_step(pruned_setup), params)
  finally:
    pruned_setup.data.close()
  context = setup.data.seq_len
  result = {'step': step, 'budgets': list(budgets), 'context': context,
            'loss': pruned['loss'], 'perplexity': pruned['perplexity'],
            'accuracy': pruned['accuracy'], 'unpruned_loss': unpruned['loss'],
            'unpruned_accuracy': unpruned['accuracy'],
            'memory_reduction': memory_reduction(budgets, context)}
  if 'bits_per_byte' in pruned:
    result['bits_per_byte'] = pruned['bits_per_byte']
  if jax.process_index() == 0:
    out = os.path.join(workdir, f'eval_budgets_step_{result["step"]}.json')
    with open(out, 'w') as f:
      json.dump(result, f, indent=2)
    logging.info('eval with budgets %s: loss %.4f (unpruned %.4f), KV-cache memory reduced '
                 '%.2fx -> %s', list(budgets), result['loss'], result['unpruned_loss'],
                 result['memory_reduction'], out)
  return result
