"""The project's modules import one another without a circle, and the model layer never
imports training code (issue 49).

An import circle (training/assembly.py and training/steps.py had one, hidden under
TYPE_CHECKING for type hints) means neither module can be read or tested alone. The graph is
read from the source (every `import` and `from ... import`, TYPE_CHECKING blocks and function
bodies included), so nothing is imported here.
"""

import ast
import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ('configs', 'models', 'input_pipeline', 'training', 'experiments', 'benchmarks',
            'analysis')


def _modules() -> dict[str, pathlib.Path]:
  out = {}
  for package in PACKAGES:
    for path in (ROOT / package).rglob('*.py'):
      parts = path.relative_to(ROOT).with_suffix('').parts
      out['.'.join(parts[:-1] if parts[-1] == '__init__' else parts)] = path
  return out


def import_graph(modules: dict[str, pathlib.Path]) -> dict[str, set[str]]:
  """module -> the project modules it imports (absolute imports; `from a import b` counts as
  a.b where that is a module, else a)."""
  graph = {}
  for name, path in modules.items():
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      if isinstance(node, ast.Import):
        found.update(alias.name for alias in node.names)
      elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
        for alias in node.names:
          full = f'{node.module}.{alias.name}'
          found.add(full if full in modules else node.module)
    graph[name] = {m for m in found if m in modules and m != name}
  return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
  """The strongly connected components of more than one module (Tarjan's algorithm)."""
  index, low, stack, on_stack, out = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(graph[v]):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        out.append(sorted(component))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return out


def test_the_circle_finder_finds_a_circle():
  graph = {'a': {'b'}, 'b': {'c'}, 'c': {'a'}, 'd': {'a'}}
  assert circles(graph) == [['a', 'b', 'c']]
  assert circles({'a': {'b'}, 'b': set()}) == []


def test_no_import_circle():
  found = circles(import_graph(_modules()))
  assert not found, f'modules that import one another (directly or around a circle): {found}'


def test_the_model_layer_imports_no_training_code():
  graph = import_graph(_modules())
  bad = sorted((m, t) for m, targets in graph.items() if m.startswith('models')
               for t in targets if t.startswith('training'))
  assert not bad, f'models/ modules importing training/: {bad}'


def _strings_naming(path: pathlib.Path, package: str) -> list[str]:
  """String constants of a module (docstrings left out) that name a module of `package` the
  way an importer would read them: 'package.module' or 'package.module:function'."""
  tree = ast.parse(path.read_text(), str(path))
  docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                     ast.AsyncFunctionDef))
                and node.body and isinstance(node.body[0], ast.Expr)}
  return [node.value for node in ast.walk(tree)
          if isinstance(node, ast.Constant) and isinstance(node.value, str)
          and id(node) not in docstrings
          and (node.value.startswith(f'{package}.') or node.value.startswith(f'{package}:'))
          and ' ' not in node.value]


def test_the_model_layer_names_no_training_module_by_string(tmp_path):
  # A 'module:function' string is an import put off: selective attention's pruning modes
  # named 'training.pruning:allocate_budgets' from models/ until they moved to
  # training/modes.py.
  modules = _modules()
  bad = {m: found for m, path in modules.items() if m.startswith('models')
         if (found := _strings_naming(path, 'training'))}
  assert not bad, f'models/ modules naming training/ modules: {bad}'
  planted = tmp_path / 'variant.py'  # The check sees such a string.
  planted.write_text('"""Doc naming training.pruning is prose."""\n'
                     "MODES = {'prune': ('training.pruning:allocate_budgets', 'help')}\n")
  assert _strings_naming(planted, 'training') == ['training.pruning:allocate_budgets']


def test_the_program_analysis_is_a_leaf_that_training_imports_only_to_compile():
  """analysis/ (HLO cost, roofline, chips, the compile report) imports no other project code,
  and training/ imports it only in aot.py, which --mode=compile and the fit check at the start
  of a TPU run load when they run (issue 69)."""
  graph = import_graph(_modules())
  leaf = sorted((m, t) for m, targets in graph.items() if m.startswith('analysis')
                for t in targets if not t.startswith('analysis'))
  assert not leaf, f'analysis/ importing other project code: {leaf}'
  users = sorted({m for m, targets in graph.items() if m.startswith('training')
                 for t in targets if t.startswith('analysis')})
  assert users == ['training.aot'], users


def test_a_training_run_loads_no_program_analysis():
  """`import training.train` (what a training run loads) imports neither the compiled-program
  analysis nor aot.py."""
  code = ('import sys, training.train; '
          'print(sorted(m for m in sys.modules if m.split(".")[0] == "analysis" '
          'or m == "training.aot"))')
  proc = subprocess.run([sys.executable, '-c', code], cwd=ROOT, capture_output=True,
                        text=True, timeout=300, env={**os.environ, 'JAX_PLATFORMS': 'cpu'})
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.strip() == '[]', proc.stdout


def test_imports_run_one_way_between_top_level_folders():
  """No two top-level folders import each other (configs/ and training/ did: the settings
  schema one way, the slice names of the recipe headers the other)."""
  edges = {}
  for module, targets in import_graph(_modules()).items():
    for target in targets:
      a, b = module.split('.')[0], target.split('.')[0]
      if a != b:
        edges.setdefault((a, b), []).append((module, target))
  both = {(a, b): (edges[(a, b)][:3], edges[(b, a)][:3]) for a, b in edges
          if (b, a) in edges and a < b}
  assert not both, f'folders that import each other: {both}'
