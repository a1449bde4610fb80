"""Every paper recipe runs at a tiny size on this CPU with the one line its header documents.

The line is read from the recipe's docstring (the paragraph that starts 'Tiny, on a CPU') and
run as written through main.py, through the recipe's own data path, with only these test
substitutions: the workdir is a temporary folder; C4 is the fake C4 of conftest.py with its
400-piece SentencePiece model (data.vocab_path: 8K pieces cannot be learned from 200
documents); enwik8 and text8 are one generated text file; the matmul peak is not measured.

The CI tier parses every recipe's line as main.py parses it and builds and lowers its train
step (about a second a recipe), and runs the lines of RUN_IN_CI; each other line's run (25-34 s
here) is in the slow tier, since CI runs its model and data path through main.py elsewhere:
C4 with SentencePiece in tests/input_pipeline/test_c4.py, a byte-level text file in
test_local_text.py, and each variant's loop in tests/training/test_<variant>_recipe.py.
"""

import pathlib
import re
import shlex
import subprocess
import sys

import pytest

import configs
from experiments import compare
from tests.harness import REPO
from training import aot, assembly

pytestmark = pytest.mark.system


def tiny_command(name: str) -> list[str]:
  """The argv of the recipe's documented tiny line (after `python`)."""
  doc = __import__(f'configs.{name}', fromlist=['get_config']).__doc__ or ''
  block = re.search(r'^Tiny, on a CPU.*?\n((?:[ \t]+.*\n?)+)', doc, re.M)
  assert block, f'configs/{name}.py: no "Tiny, on a CPU" paragraph in the docstring'
  text = re.sub(r'\\\n\s*', ' ', block.group(1)).strip()
  argv = shlex.split(text.splitlines()[0])
  assert argv[:2] == ['python', 'main.py'] and argv[2] == f'--config=configs/{name}.py', argv
  return argv[1:]


@pytest.fixture(scope='module')
def text_file(tmp_path_factory, kit) -> pathlib.Path:
  """About 200 KB of the fake corpus as one file: enwik8 / text8 stand-in."""
  path = tmp_path_factory.mktemp('corpus') / 'corpus.txt'
  path.write_text('\n\n'.join(kit.make_docs(7, 1200)))
  return path


def _substitute(argv, workdir, tmp_path, text_file, c4, spm_path, kit) -> list[str]:
  out = []
  for arg in argv:
    key = arg.split('=', 1)[0]
    if key == '--workdir':
      arg = f'--workdir={workdir}'
    elif key == '--config.data.files':
      arg = f'--config.data.files={text_file}'
    elif key == '--config.data.data_dir':
      arg = f'--config.data.data_dir={c4.data_dir}'
    out.append(arg)
  config = configs.load(argv[1].split('configs/')[1][:-3])
  if config.data.name == 'c4':
    assert any(a.startswith('--config.data.data_dir=') for a in argv), 'say where C4 is'
    out += [f'--config.data.vocab_path={spm_path}', f'--config.data.vocab_size={kit.spm_vocab}']
  if config.data.name == 'local_text':
    assert any(a.startswith('--config.data.files=') for a in argv), 'say where the text is'
    out.append(f'--config.data.data_dir={tmp_path / "tfds"}')
  return out + ['--config.peak_tflops_per_device=1.0']


# The lines run in the CI tier: a synthetic task each (no corpus to prepare), the cheapest two
# (10-11 s). The others run in the slow tier (the module docstring says what covers them).
RUN_IN_CI = ('selective_variable_assignment', 'universal_transformer_algorithmic')


def _parsed_config(argv: list[str]):
  """The config main.py builds from `argv` (its --config flags, read as main.py reads them)."""
  others = [a for a in argv[1:] if not a.startswith('--config')]
  assert [a.split('=', 1)[0] for a in others] == ['--workdir'], others
  recipe = argv[1].split('=', 1)[1]  # configs/<name>.py, from the repository's root.
  return compare.recipe(str(REPO / recipe), [a for a in argv[2:] if a.startswith('--config.')])


@pytest.mark.parametrize('name', configs.PAPER_RECIPES)
def test_the_tiny_line_parses_and_its_train_step_lowers(name):
  """What a tiny run checks first, for every recipe: the flags exist with the types given,
  the settings pass main.py's checks and the train step traces at the tiny sizes."""
  config = _parsed_config(tiny_command(name))
  assert config.total_steps <= 50, 'a tiny line runs a few steps'
  config.peak_tflops_per_device = 1.0
  lowered = aot.lower_train_step(assembly.build(config, data=False))
  assert lowered.as_text()


@pytest.mark.parametrize('name', [n if n in RUN_IN_CI else pytest.param(n, marks=pytest.mark.slow)
                                  for n in configs.PAPER_RECIPES])
def test_the_recipe_runs_tiny_on_a_cpu(name, harness, tmp_path, text_file, c4, spm_path, kit):
  workdir = tmp_path / 'run'
  argv = _substitute(tiny_command(name), workdir, tmp_path, text_file, c4, spm_path, kit)
  proc = subprocess.run([sys.executable, *argv], env=harness.env(), cwd=REPO,
                        capture_output=True, text=True, timeout=600)
  log = proc.stdout + proc.stderr
  assert proc.returncode == 0, log[-3000:]
  total = int(re.search(r'--config\.total_steps=(\d+)', ' '.join(argv)).group(1))
  assert total <= 50, 'a tiny line runs a few steps'
  assert re.search(rf'step {total}/{total}\s+loss [\d.]+', log), log[-3000:]
  assert harness.step_dirs(workdir)[-1] == total
