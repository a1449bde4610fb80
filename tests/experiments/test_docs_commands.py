"""Every command the pages show (README.md, RESULTS.md, docs/, experiments/ and benchmarks/
READMEs) still matches the code, without running it: the module or recipe it names exists, its
options are ones the module's parser takes, every --config.KEY is a field of the recipe it
runs, every --mode a mode, every experiment name a registered one.

Running them is a separate, manual check (the long ones train for hours); this keeps the pages
from rotting between those checks.
"""

import contextlib
import functools
import io
import os
import pathlib
import re
import runpy
import shlex
import sys

import pytest

from experiments import harness, registry, render
from training import modes

REPO = pathlib.Path(render.REPO)
PAGES = sorted({*REPO.glob('*.md'), *REPO.glob('docs/*.md'), REPO / 'experiments/README.md',
                REPO / 'benchmarks/README.md'})
# main.py's own flags (absl's --help/--helpshort included).
MAIN_FLAGS = {'workdir', 'mode', 'coordinator_address', 'num_processes', 'process_id',
              'allow_config_change', 'config', 'help', 'helpshort', 'helpfull'}


def _commands(text: str) -> list[str]:
  """The `python ...` commands of a page: lines of code blocks (fenced or indented, with their
  backslash continuations) and inline code spans."""
  found = []
  lines = text.splitlines()
  i = 0
  while i < len(lines):
    line = lines[i].strip()
    if re.match(r'(?:\$ )?python3? (?:-m \w|main\.py)', line):
      while line.endswith('\\') and i + 1 < len(lines):
        i += 1
        line = line[:-1] + ' ' + lines[i].strip()
      found.append(line.lstrip('$ '))
    i += 1
  found += re.findall(r'`(python3? (?:-m \w[^`]*|main\.py[^`]*))`', text)
  return [c.split(' #')[0].split(' &&')[0].split(' |')[0].strip() for c in found]


def _all():
  out = []
  for page in PAGES:
    for command in _commands(page.read_text()):
      out.append((page.relative_to(REPO).as_posix(), command))
  return out


COMMANDS = _all()


def _words(command: str) -> list[str]:
  try:
    return shlex.split(command)
  except ValueError:
    return command.split()


def _option_names(words: list[str]) -> list[str]:
  return [w[2:].split('=')[0] for w in words if w.startswith('--') and len(w) > 2]


@functools.lru_cache(maxsize=None)
def _help(module: str) -> str:
  """`python -m MODULE --help`, run in this process (the imports are shared)."""
  out = io.StringIO()
  argv, environ = sys.argv, dict(os.environ)
  sys.argv = [module, '--help']
  try:
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
      runpy.run_module(module, run_name='__main__', alter_sys=False)
  finally:  # A module may set XLA flags at import: later subprocesses must not inherit them.
    sys.argv = argv
    os.environ.clear()
    os.environ.update(environ)
  return out.getvalue()


def _recipe_keys(path: str) -> set[str]:
  return set(harness.flatten(harness.load_recipe(str(REPO / path))))


def test_the_pages_show_commands():
  assert len(COMMANDS) > 100, len(COMMANDS)
  assert sum(c.startswith('python main.py') for _, c in COMMANDS) > 20


@pytest.mark.parametrize('page, command', [pc for pc in COMMANDS
                                           if ' main.py' in pc[1].split(' --')[0]],
                         ids=lambda v: v if len(v) < 40 else v[:40])
def test_main_py_commands_name_real_recipes_keys_and_modes(page, command):
  words = _words(command)
  recipe = 'configs/tiny.py'
  for w in words:
    if w.startswith('--config=') and w.endswith('.py'):
      recipe = w.split('=', 1)[1]
  if any(c in recipe for c in '<>{}') or recipe.startswith(('/', '$')):
    return  # A placeholder or a file of the user's.
  assert (REPO / recipe).is_file(), f'{page}: {command}: no recipe {recipe}'
  keys = _recipe_keys(recipe)
  for name in _option_names(words):
    if name.startswith('config.'):
      assert name[len('config.'):] in keys, f'{page}: {command}: {recipe} has no {name}'
    else:
      assert name in MAIN_FLAGS, f'{page}: {command}: main.py has no --{name}'
  for w in words:
    if w.startswith('--mode='):
      assert w.split('=', 1)[1] in modes.names(), f'{page}: {command}'


MODULE_COMMANDS = [pc for pc in COMMANDS if re.match(r'python3? -m (benchmarks|experiments)\b',
                                                      pc[1])]


@pytest.mark.parametrize('page, command', MODULE_COMMANDS,
                         ids=lambda v: v if len(v) < 40 else v[:40])
def test_module_commands_use_options_their_parser_takes(page, command):
  words = _words(command)
  module = words[2]
  if module == 'experiments':  # The runner: its verbs and registered names.
    if len(words) == 3:
      return
    assert words[3] in ('list', 'run', 'all'), f'{page}: {command}'
    rest, names = words[4:], []
    while rest:
      w = rest.pop(0)
      if w in ('--out', '--text'):
        rest.pop(0)
      elif w.startswith('--'):
        assert w in ('--quick',) or w.startswith(('--out=', '--text=')), f'{page}: {command}'
      else:
        names.append(w)
    assert (words[3] == 'run') == bool(names), f'{page}: {command}'
    for name in names:
      assert name in registry.BY_NAME, f'{page}: {command}: no experiment {name!r}'
    return
  text = _help(module)
  for name in _option_names(words):
    if name.startswith('config.') and module == 'experiments.compare':
      continue  # The recipe's fields (checked by ml_collections when it runs).
    assert f'--{name}' in text, f'{page}: {command}: python -m {module} has no --{name}'
