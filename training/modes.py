"""The modes of main.py: `--mode=NAME` runs `get(NAME)(config, workdir, request)`.

The backbone's modes are listed here; an attention variant offers modes of its own in its
`MODES` (models/attention/base.MultiHeadAttention: name -> ('module:function', help)), e.g.
selective attention's context pruning. A mode's function takes (config given, workdir,
run_config.Request) and is imported only when it runs, so that listing the modes (for the
--mode flag, before JAX starts a backend) imports no training code.
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
}


@functools.lru_cache(maxsize=1)
def table() -> dict[str, Mode]:
  """Every mode: the backbone's, then each registered variant's (a name two of them offer is
  an error)."""
  modes = dict(BACKBONE)
  for variant, cls in registry.VARIANTS.items():
    for name, (target, text) in getattr(cls, 'MODES', {}).items():
      if name in modes and modes[name].target != target:
        owner = modes[name].offered_by or 'the backbone'
        raise ValueError(f'attention variant {variant!r} offers mode {name!r}, which {owner} '
                         'offers too: give it a name of its own')
      modes.setdefault(name, Mode(target, text, offered_by=variant))
  return modes


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
