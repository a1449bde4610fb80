"""The modes of main.py: `--mode=NAME` runs `get(NAME)(config, workdir, request)`.

The backbone's modes and those an attention variant offers (selective attention's context
pruning) are declared here, where the code that runs them lives: models/ names no training
module, not even by string. A variant's mode says which variant offers it (`offered_by`, a
registered name: --help shows it); `offer` adds one from outside this file. A mode's function
takes (config given, workdir, run_config.Request) and is imported only when it runs, so that
listing the modes (for the --mode flag, before JAX starts a backend) imports no training code.
"""

import dataclasses
import functools
import importlib
from typing import Any, Callable

from models.attention import registry


@dataclasses.dataclass(frozen=True)
class Mode:
  """One mode.

  Attributes:
    target: 'module:function' implementing it.
    help: one line for --help.
    offered_by: the attention variant that offers it ('' for the backbone's).
    kwargs: keyword arguments main.py passes besides (config, workdir, request).
  """
  target: str
  help: str
  offered_by: str = ''
  kwargs: tuple[tuple[str, Any], ...] = ()


BACKBONE = {
    'train': Mode('training.train:train_and_evaluate',
                  'train (resuming from the latest checkpoint)', kwargs=(('exits', True),)),
    'eval': Mode('training.evaluation:evaluate_checkpoint',
                 'evaluate the latest checkpoint and write JSON'),
    'generate': Mode('training.sampling:sample_checkpoint',
                     'continue config.generate.prompt (or each line of generate.prompt_file: '
                     'text, or token ids for a synthetic task) from the latest checkpoint (or '
                     'generate.step), print the samples and write WORKDIR/samples_step_<N>.jsonl'),
    'inspect': Mode('training.attention_maps:write_maps',
                    'write what each layer and head attends to (WORKDIR/inspect/)'),
    'compile': Mode('training.aot:run',
                    'build the train, eval and decoding programs for the TPU slice '
                    'config.compile_topology from this host (no data read) and report per-chip '
                    'memory, FLOPs and collectives (WORKDIR/compile_<topology>.json; exits 1 if '
                    'the train step does not fit)'),
    'harness': Mode('training.zoo_lm:run_tasks',
                    'run lm-evaluation-harness tasks (config.harness.tasks; default: the run\'s '
                    'own local task) on the latest checkpoint (or harness.step) and write '
                    'WORKDIR/harness_step_<N>.json in lm-eval\'s result format (needs '
                    'requirements-eval.txt)'),
}


# Modes of the attention variants, in the order --help lists them.
VARIANTS = {
    # Context pruning (section 5 of the selective attention paper): a trained model's per-layer
    # budgets K_l, and what they cost in loss and save in KV-cache memory.
    'allocate_budgets': Mode('training.pruning:allocate_budgets',
                             'greedy per-layer context budgets of a selective model '
                             '(WORKDIR/budgets.json)', offered_by='selective'),
    'eval_budgets': Mode('training.pruning:evaluate_budgets',
                         'loss and KV-cache reduction with those budgets',
                         offered_by='selective'),
}


def offer(name: str, target: str, text: str, *, variant: str) -> None:
  """Adds mode `name` of attention variant `variant` ('module:function', one line of help), for
  a variant defined outside this repository's files.

  Raises:
    ValueError: the name is taken (by the backbone or another variant's mode).
  """
  taken = {**BACKBONE, **VARIANTS}
  if name in taken and taken[name].target != target:
    owner = taken[name].offered_by or 'the backbone'
    raise ValueError(f'attention variant {variant!r} offers mode {name!r}, which {owner} '
                     'offers too: give it a name of its own')
  VARIANTS[name] = Mode(target, text, offered_by=variant)
  table.cache_clear()


@functools.lru_cache(maxsize=1)
def table() -> dict[str, Mode]:
  """Every mode: the backbone's, then those of the registered variants.

  Raises:
    ValueError: a variant's mode names a variant that is not registered.
  """
  for name, mode in VARIANTS.items():
    if mode.offered_by not in registry.VARIANTS.known():
      raise ValueError(f'mode {name!r} is offered by attention variant {mode.offered_by!r}, '
                       f'which is not registered; known: {", ".join(registry.VARIANTS.known())}')
  return {**BACKBONE, **VARIANTS}


def names() -> list[str]:
  return list(table())


def help_text() -> str:
  """The --mode flag's help: each mode and what it does."""
  return '; '.join(f'{name}: {mode.help}' + (f' ({mode.offered_by} attention)'
                                              if mode.offered_by else '')
                   for name, mode in table().items())


def get(name: str) -> Callable[..., Any]:
  """The function of mode `name`, with main.py's keyword arguments bound.

  Raises:
    ValueError: no such mode (the known ones named).
  """
  modes = table()
  if name not in modes:
    raise ValueError(f'unknown mode {name!r}; known modes: {", ".join(modes)}')
  mode = modes[name]
  module, _, function = mode.target.partition(':')
  return functools.partial(getattr(importlib.import_module(module), function),
                           **dict(mode.kwargs))
