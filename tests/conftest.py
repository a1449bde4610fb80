"""Fixtures shared by every test folder, and what the suite assumes of the backend."""

import os
import tempfile

from training import xla_flags

xla_flags.skip_absent_tpu()  # Before jax starts a backend: no TPU here (see its docstring).

# On a CPU-only machine the suite compiles with XLA:CPU's fast-compile settings (no LLVM
# optimization passes): most of a test's time is compiling small programs that then run for
# milliseconds, and these settings cut a model test's time by about a quarter. They change how
# the code is generated, not what it computes. Subprocesses get them too (tests/harness.py's
# Harness). ZOO_TEST_OPTIMIZED=1 keeps XLA's defaults.
TEST_XLA_FLAGS = (xla_flags.FAST_COMPILE if os.environ.get('JAX_PLATFORMS') == 'cpu'
                  and not os.environ.get('ZOO_TEST_OPTIMIZED') else '')
if TEST_XLA_FLAGS not in os.environ.get('XLA_FLAGS', ''):
  os.environ['XLA_FLAGS'] = f'{os.environ.get("XLA_FLAGS", "")} {TEST_XLA_FLAGS}'.strip()
# And the CPU defaults main.py sets (xla_flags.set_cpu_defaults). A test module that imports
# experiments.harness sets them too, at collection: without this line a run's flags depended
# on which files it collected (a run of one file had none of them, CI's workers all).
xla_flags.set_cpu_defaults()

# attention_impl='auto' on a CPU runs the C++ kernel where it was measured faster on this CPU
# (models/attention/cpu_choice.py). The suite does not read this machine's measurement: it
# records its own, the kernel for every static variant (as a machine where it won), so it runs
# the same paths on every machine, and compiles a kernel call where XLA would compile a blocked
# loop (faster to build). Tests of the choice itself write their own record.
os.environ['ZOO_CPU_CHOICE'] = os.path.join(tempfile.mkdtemp(prefix='zoo_cpu_choice_'),
                                            'cpu_choice.json')

import jax  # noqa: E402
import pytest

from models.attention import base, cpu_choice, registry, traits
from tests.harness import Harness

cpu_choice.record({registry.get(n).__name__: cpu_choice.KERNEL for n in registry.known()
                   if traits.of(n).has_static_pattern()}, {'by': 'tests/conftest.py'})
from training import assembly, evaluation, flops, steps, train

# The tests compare float32 paths to ~1e-5 (the rounding of exact float32 products). On NVIDIA
# GPUs JAX runs float32 matmuls in TF32 by default (errors of 5e-4 to 1e-2 on an H100, which
# failed 95 tests there), so the suite asks for full float32 products on every backend (CPU
# computes them anyway).
jax.config.update('jax_default_matmul_precision', 'highest')


# The kind of each test (pytest.ini: unit, model, system), by folder unless its file is listed
# in KINDS_BY_FILE or its module sets pytestmark: `-m unit` is the quick loop while
# editing, `-m "not system"` everything that runs in the test process.
KINDS_BY_FOLDER = {'models': 'model', 'contracts': 'model', 'training': 'system',
                   'input_pipeline': 'unit', 'experiments': 'unit', 'benchmarks': 'system',
                   'analysis': 'unit'}
KINDS_BY_FILE = {
    'models/test_patterns.py': 'unit',            # Pattern sets and plans, no model.
    'training/test_losses.py': 'model',
    'training/test_optimizer.py': 'model',
    'training/test_modes.py': 'unit',
    'training/test_multislice.py': 'unit',        # Meshes of an absent TPU slice.
    'training/test_inspect.py': 'unit',           # Masks from the pattern definitions.
    'input_pipeline/test_packing.py': 'model',
    'input_pipeline/test_c4.py': 'system',        # Trains on a local C4 build.
    'input_pipeline/test_local_text.py': 'system',
    'input_pipeline/test_resume.py': 'system',
    'input_pipeline/test_shards.py': 'system',    # Several processes.
    'input_pipeline/test_text_errors.py': 'system',
    'input_pipeline/test_paper_recipes_tiny.py': 'system',  # main.py per paper recipe.
}
KINDS = ('unit', 'model', 'system')


def _kind(path) -> str:
  rel = path.relative_to(path.parents[1]).as_posix()  # 'models/test_x.py'
  return KINDS_BY_FILE.get(rel, KINDS_BY_FOLDER.get(rel.split('/')[0], 'system'))


def pytest_collection_modifyitems(config, items):
  """Every test gets its kind marker (unit, model or system) unless it has one. Tests marked
  cpu_only (the CPU tile kernel, Pallas interpret mode, what 'auto' picks on one CPU device)
  are skipped on another backend, with the reason."""
  del config
  for item in items:
    if not any(item.get_closest_marker(k) for k in KINDS):
      item.add_marker(getattr(pytest.mark, _kind(item.path)))
  backend = jax.default_backend()
  if backend == 'cpu':
    return
  skip = pytest.mark.skip(reason=f'needs the CPU backend (this run is on {backend})')
  for item in items:
    if item.get_closest_marker('cpu_only'):
      item.add_marker(skip)


@pytest.fixture(scope='session')
def compile_cache_dir(tmp_path_factory) -> str:
  """The session's JAX persistent compilation cache: main.py subprocesses (the training
  Harness) and the in-process tests that ask for `compile_cache` share it, so a program
  compiled once (the same HLO) is loaded, not compiled again, by the next run that builds it.

  With -n N (pytest-xdist) the workers share it too (a folder beside their own temporary
  folders): both build the tiny recipe's programs in their main.py runs. JAX writes an entry
  once per key, and a reader that meets an entry still being written warns and compiles."""
  if os.environ.get('PYTEST_XDIST_WORKER'):
    shared = tmp_path_factory.getbasetemp().parent / 'jax_compilation_cache'
    shared.mkdir(exist_ok=True)
    return str(shared)
  return str(tmp_path_factory.mktemp('jax_compilation_cache'))


@pytest.fixture(scope='module')
def compile_cache(compile_cache_dir):
  """Turns the session's persistent compilation cache on for a module, then restores the
  settings. Worth it where a module builds the same programs again (a resumed training run
  compiles what the first run compiled); elsewhere writing every program costs more than it
  saves."""
  from jax._src import compilation_cache  # pylint: disable=import-outside-toplevel
  settings = {'jax_compilation_cache_dir': compile_cache_dir,
              'jax_persistent_cache_min_compile_time_secs': 0.0,
              'jax_persistent_cache_min_entry_size_bytes': 0}
  previous = {k: getattr(jax.config, k) for k in settings}
  for k, v in settings.items():
    jax.config.update(k, v)
  compilation_cache.reset_cache()
  yield
  for k, v in previous.items():
    jax.config.update(k, v)
  compilation_cache.reset_cache()


@pytest.fixture(scope='session')
def harness(compile_cache_dir) -> Harness:
  """main.py runs and scripts in subprocesses, small configs, checkpoints (tests/harness.py)."""
  return Harness(compile_cache_dir)


@pytest.fixture
def straight_and_resumed(tmp_path):
  """run(make_config, stop=3, total=6) -> (state of a run straight to `total` steps, state of
  a run stopped at `stop` and resumed to `total`), in tmp_path/straight and tmp_path/resumed;
  make_config(steps) builds the config."""

  def run(make_config, stop: int = 3, total: int = 6):
    straight = train.train_and_evaluate(make_config(total), str(tmp_path / 'straight'))
    train.train_and_evaluate(make_config(stop), str(tmp_path / 'resumed'))
    resumed = train.train_and_evaluate(make_config(total), str(tmp_path / 'resumed'))
    return straight, resumed

  return run


@pytest.fixture
def no_compute(monkeypatch):
  """Makes any compiled compute (or the matmul peak measurement) fail the test: bad input must
  be reported before it starts."""

  def fail(*args, **kwargs):
    del args, kwargs
    pytest.fail('compute started before the bad input was reported')

  monkeypatch.setattr(assembly, 'init_state', fail)
  for name in ('jit_train_step', 'jit_eval_step'):
    monkeypatch.setattr(steps, name, fail)
  monkeypatch.setattr(evaluation, 'score', fail)
  monkeypatch.setattr(flops, 'measure_matmul_peak', fail)


NO_DECODE = 'test_no_decode'


class NoDecodeAttention(base.MultiHeadAttention):
  """Test-only: dense causal attention with no static pattern (head_pattern) and no
  decode_step of its own, so it cannot decode (every registered variant can)."""

  def attend(self, q, k, v, *, positions, segment_ids, deterministic, key_segment_ids=None,
             extra=None):
    del positions, deterministic, key_segment_ids, extra
    mask = base.causal_segment_mask(segment_ids)[:, None]
    return base.reference_attention(q, k, v, mask, scale=q.shape[-1] ** -0.5, dtype=self.dtype)


@pytest.fixture
def no_decode(monkeypatch):
  """NoDecodeAttention registered as NO_DECODE for one test."""
  monkeypatch.setitem(registry.VARIANTS._entries, NO_DECODE, NoDecodeAttention)
  return NO_DECODE
