"""The zoo as an lm-evaluation-harness model, registered with lm-eval as 'zoo', and
--mode=harness.

The one module that imports lm_eval (requirements-eval.txt) at its top; without it, importing
this module raises downstream.MissingPackage, which says what to install. Two ways in:

  python main.py --workdir=DIR --mode=harness --config.harness.tasks=lambada_openai
  python -m training.zoo_lm --model zoo --model_args workdir=DIR,step=N --tasks lambada_openai

The second is lm-eval's own command line (every flag of `lm-eval run`) with this module
imported first: lm-eval 0.4.13 finds models only among those registered in its process (its
model registry reads no entry points, and --include_path adds tasks, not models), so a bare
`lm_eval --model zoo` does not know the zoo. From Python, `import training.zoo_lm` registers
it for lm_eval.simple_evaluate(model='zoo', model_args='workdir=DIR').

model_args: workdir (required), step (0 = the latest), batch_size (rows of a compiled batch),
and any dotted config key as an override of the recorded run, with --mode=eval's rules
(run-time settings apply; a change of the model is refused unless allow_config_change names
it, '+' between keys). A tuple is written with '+' between its items, as model_args splits at
commas: selective attention's pruning budgets are
`model.attention_options.selective.budgets=64+64+32,allow_config_change=model.attention_options.selective.budgets`.

--mode=harness (`run_tasks`) checks the task names and reads the tasks' data before any
checkpoint is read or program compiled, so a typo or data out of reach costs seconds; it
writes lm-eval's result dict to WORKDIR/harness_step_<N>.json, and the run's local tasks to
WORKDIR/harness_tasks/ for lm-eval's command line (`--include_path WORKDIR/harness_tasks`).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile

from training import downstream

downstream.require_lm_eval()  # One line saying what to install, before the imports below.

# pylint: disable=wrong-import-position
import jax
import ml_collections
from absl import logging
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from training import assembly, run_config

NAME = 'zoo'
# model_args that are not config keys.
_OWN_ARGS = ('workdir', 'step', 'batch_size', 'allow_config_change', 'max_batch_size', 'device')


@register_model(NAME)
class ZooLM(LM):
  """A checkpoint of a zoo run, for lm-eval (training/downstream.Scorer does the work).

  It keeps lm-eval's rank 0 and world size 1 on every process: each process runs every
  request, as the compiled programs span the processes, and the caller writes from process
  0 only.
  """

  def __init__(self, workdir: str | None = None, step: int = 0, batch_size=None,
               allow_config_change: str = '', max_batch_size=None, device=None, *,
               restored: assembly.Restored | None = None, **overrides):
    """Restores checkpoint `step` (0 = the latest) of `workdir` with its recorded config, as
    --mode=eval does; `overrides` are dotted config keys (lm-eval's model_args)."""
    super().__init__()
    del max_batch_size, device  # The mesh decides where the model runs.
    if restored is None:
      if not workdir:
        raise ValueError('the zoo model needs model_args workdir=DIR (a run\'s folder)')
      restored = _restore(workdir, int(step or 0), overrides, allow_config_change)
    elif overrides:
      raise ValueError(f'config overrides {sorted(overrides)} go to the restore, not here')
    size = batch_size if isinstance(batch_size, int) and batch_size > 0 else (
        restored.setup.config.harness.batch_size)
    self.workdir = workdir
    self.restored = restored
    self.scorer = downstream.Scorer(restored, size)

  @classmethod
  def from_restored(cls, restored: assembly.Restored, *, batch_size: int,
                    workdir: str = '') -> 'ZooLM':
    """The model of a checkpoint already restored (--mode=harness)."""
    return cls(workdir=workdir, batch_size=batch_size, restored=restored)

  def get_model_info(self) -> dict:
    """What lm-eval records of the model in its result's 'config'."""
    mc = self.restored.setup.model_config
    return {'zoo_workdir': self.workdir, 'zoo_step': self.restored.step,
            'zoo_attention': ','.join(dict.fromkeys(mc.attention)),
            'zoo_stack': mc.stack_name, 'zoo_max_len': mc.max_len,
            'zoo_truncated_requests': self.scorer.truncated}

  def loglikelihood(self, requests, disable_tqdm: bool = False):
    del disable_tqdm
    return self.scorer.loglikelihood([r.args for r in requests])

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
    del disable_tqdm
    return self.scorer.loglikelihood_rolling([r.args[0] for r in requests])

  def generate_until(self, requests, disable_tqdm: bool = False):
    """Requests with the same generation settings are sampled together."""
    del disable_tqdm
    groups: dict[str, list[int]] = {}
    settings = []
    for i, request in enumerate(requests):
      context, kwargs = request.args
      setting = _gen_settings(kwargs or {})
      settings.append((context, setting))
      groups.setdefault(repr(sorted(setting.items())), []).append(i)
    out = [''] * len(requests)
    for members in groups.values():
      setting = settings[members[0]][1]
      texts = self.scorer.generate([settings[i][0] for i in members], **setting)
      for i, text in zip(members, texts):
        out[i] = text
    return out


def _gen_settings(kwargs: dict) -> dict:
  """Scorer.generate's arguments from lm-eval's generation kwargs (until, max_gen_toks,
  do_sample, temperature, top_k, top_p); greedy unless do_sample with temperature > 0."""
  known = {'until', 'max_gen_toks', 'do_sample', 'temperature', 'top_k', 'top_p', 'seed'}
  unknown = sorted(set(kwargs) - known)
  if unknown:
    raise ValueError(f'generation kwargs {unknown} are not supported by the zoo model '
                     f'(known: {", ".join(sorted(known))})')
  until = kwargs.get('until', [])
  until = [until] if isinstance(until, str) else list(until)
  sample = bool(kwargs.get('do_sample', False))
  temperature = float(kwargs.get('temperature', 1.0 if sample else 0.0)) if sample else 0.0
  return {'until': tuple(until), 'max_gen_toks': int(kwargs.get('max_gen_toks', 256)),
          'temperature': temperature, 'top_k': int(kwargs.get('top_k', 0) or 0),
          'top_p': float(kwargs.get('top_p', 1.0) or 1.0), 'seed': int(kwargs.get('seed', 0))}


def _value(value, like):
  """A model_args value (lm-eval has made numbers and booleans of it) as the type of config
  field value `like`; a tuple is written with '+' between its items (model_args splits at
  commas): budgets=64+64+32."""
  if isinstance(like, tuple) and isinstance(value, (str, int)):
    items = str(value).replace('+', ' ').split()
    return tuple(int(x) if x.lstrip('-').isdigit() else x for x in items)
  if like is None or isinstance(like, bool) or isinstance(value, type(like)):
    return value
  return type(like)(value)


def _restore(workdir: str, step: int, overrides: dict, allow: str = '') -> assembly.Restored:
  """Checkpoint `step` of `workdir` with its recorded config and `overrides` (dotted keys),
  as --mode=eval restores one; `allow` names the keys ('+' between them) whose model
  changes are accepted (main.py's --allow_config_change)."""
  from configs import default  # pylint: disable=import-outside-toplevel
  config = default.get_config()
  flat = run_config.as_flat_json(config)
  for key, value in overrides.items():
    if key not in flat:
      raise ValueError(f'model_args {key}={value!r} is neither the zoo model\'s own '
                       f'({", ".join(_OWN_ARGS)}) nor a config key')
    node = config
    *parents, leaf = key.split('.')
    for p in parents:
      node = node[p]
    node[leaf] = _value(value, node[leaf])
  config.harness.step = step
  request = run_config.Request(keys=frozenset(overrides) | {'harness.step'},
                               allow=tuple(a for a in str(allow or '').split('+') if a))
  return assembly.restore(config, workdir, request, step_key='harness.step')


def evaluate(lm, manager, loaded: dict, *, limit: int = 0, num_fewshot: int = -1) -> dict:
  """lm-eval's simple_evaluate of the loaded tasks (load_tasks) on `lm` (a zoo_lm.ZooLM): its
  result dict, without the per-sample records."""
  import lm_eval  # pylint: disable=import-outside-toplevel
  objects = []
  for name, one in loaded.items():  # The task or group itself; a tag's tasks.
    found = one['groups'].get(name) or one['tasks'].get(name)
    objects.extend([found] if found is not None else one['tasks'].values())
  results = lm_eval.simple_evaluate(
      model=lm, tasks=objects, task_manager=manager, limit=limit or None,
      num_fewshot=None if num_fewshot < 0 else num_fewshot, log_samples=False)
  results.pop('samples', None)
  return results


def run_tasks(config: ml_collections.ConfigDict, workdir: str,
              request: run_config.Request | None = None) -> dict:
  """--mode=harness: the lm-eval tasks `harness.tasks` (default: the run's own local task) on
  checkpoint `harness.step` (0 = the latest) of `workdir`.

  Process 0 writes lm-eval's result dict (results, versions, n-shot, configs, and config with
  the zoo's model info) to WORKDIR/harness_step_<N>.json. Every process runs every request:
  each holds the whole batches, and the programs are sharded over the mesh.

  Raises:
    ValueError: an unknown task, a task whose data cannot be read, bad settings.
    FileNotFoundError: no checkpoint (or none at harness.step), no include_path folder.
  """
  folder = tempfile.mkdtemp(prefix='zoo_harness_tasks_')
  chosen = {}

  def check_config(resolved):
    downstream.check_config(resolved)
    local = downstream.local_tasks(resolved, folder)
    names = downstream.task_names(resolved, local)
    include = [folder] + ([os.path.expanduser(resolved.harness.include_path)]
                          if resolved.harness.include_path else [])
    chosen['manager'], chosen['loaded'] = downstream.load_tasks(names, include)

  try:
    restored = assembly.restore(config, workdir, request, step_key='harness.step',
                                check_config=check_config)
    h = restored.setup.config.harness
    lm = ZooLM.from_restored(restored, batch_size=h.batch_size, workdir=workdir)
    results = evaluate(lm, chosen['manager'], chosen['loaded'], limit=h.limit,
                       num_fewshot=h.num_fewshot)
  finally:
    shutil.rmtree(folder, ignore_errors=True)
  if jax.process_index() == 0:
    from lm_eval.utils import handle_non_serializable  # pylint: disable=import-outside-toplevel
    # The run's local tasks stay in the workdir for lm-eval's own command line
    # (--include_path WORKDIR/harness_tasks), which has no run to write them from.
    tasks = os.path.join(workdir, 'harness_tasks')
    os.makedirs(tasks, exist_ok=True)
    downstream.local_tasks(restored.setup.config, tasks)
    path = os.path.join(workdir, f'harness_step_{restored.step}.json')
    with open(path, 'w', encoding='utf-8') as f:
      f.write(json.dumps(results, indent=2, default=handle_non_serializable,
                         ensure_ascii=False))
    summary = {task: {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
               for task, metrics in results.get('results', {}).items()}
    logging.info('harness at step %d: %s -> %s', restored.step, summary, path)
    print(f'harness at step {restored.step}: {json.dumps(summary)} -> {path}', flush=True)
  return results


def scalars(results: dict) -> dict[str, float]:
  """'<task>/<metric>' -> value of lm-eval's results (metrics under the 'none' filter keep
  their bare name; standard errors are left out)."""
  out = {}
  for task, metrics in results.get('results', {}).items():
    for key, value in metrics.items():
      metric, _, filtered = key.partition(',')
      if (not filtered or metric.endswith('_stderr') or isinstance(value, bool)
          or not isinstance(value, (int, float))):
        continue
      out[f'{task}/{metric if filtered == "none" else f"{metric}_{filtered}"}'] = float(value)
  return out


class DuringTraining:
  """harness.tasks on training's latest parameters (training/train.py, every
  harness.every_steps steps). The tasks are checked and their data read when it is made,
  before the first train step; every run reuses the programs the first one compiled (for the
  same specialization of the model). Every process calls it at the same steps."""

  def __init__(self, setup: assembly.Setup):
    self.setup = setup
    self.folder = tempfile.mkdtemp(prefix='zoo_harness_tasks_')
    try:
      downstream.check_config(setup.config)
      local = downstream.local_tasks(setup.config, self.folder)
      names = downstream.task_names(setup.config, local)
      include = [self.folder] + ([os.path.expanduser(setup.config.harness.include_path)]
                                 if setup.config.harness.include_path else [])
      self.manager, self.loaded = downstream.load_tasks(names, include)
    except BaseException:
      self.close()
      raise
    self.lm = None

  def __call__(self, params, step: int) -> dict[str, float]:
    """The tasks' metrics (`scalars`) for `params`, the parameters at `step`."""
    h = self.setup.config.harness
    restored = assembly.Restored(setup=self.setup, step=step, params=params,
                                 model=assembly.specialized_model(self.setup, params))
    if self.lm is None:
      self.lm = ZooLM.from_restored(restored, batch_size=h.batch_size)
    else:
      self.lm.restored = restored
      self.lm.scorer.update(restored)
    results = evaluate(self.lm, self.manager, self.loaded, limit=h.limit,
                       num_fewshot=h.num_fewshot)
    out = scalars(results)
    logging.info('harness at step %d: %s', step, out)
    return out

  def close(self) -> None:
    shutil.rmtree(self.folder, ignore_errors=True)


def main() -> None:
  """lm-eval's command line, with the zoo registered (`--model zoo`)."""
  from lm_eval.__main__ import cli_evaluate  # pylint: disable=import-outside-toplevel
  cli_evaluate()


if __name__ == '__main__':
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  from training import xla_flags  # pylint: disable=import-outside-toplevel
  xla_flags.set_cpu_defaults()
  xla_flags.skip_absent_tpu()
  sys.exit(main())
