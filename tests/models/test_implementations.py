"""Tests for model.attention_impl: what 'auto' picks per backend and variant, the explicit names.

* 'auto' resolves to the documented implementation per backend and variant
  (Traits.implementation, called with backend='tpu'/'gpu'/'cpu': no accelerator
  needed): splash on TPU, cuDNN flash for bf16 dense on GPU else block-sparse, the C++ kernel
  on one CPU device where it was measured faster on this CPU (models/attention/cpu_choice.py)
  else block-sparse; variants without a static pattern get their own blocked path everywhere.
* attention_impl='cpu_kernel' gives the outputs and gradients of 'xla' for dense and a sparse
  pattern; 'blocksparse' never calls the kernel.
* Without a compiler 'auto' falls back to 'blocksparse' with one warning, and an explicit
  'cpu_kernel' is refused at config time saying what to use; so is 'cpu_kernel' for a variant
  without a static pattern (selective, adaptive and dynamic span), naming the variant.
* transformer.implementations lists each layer's implementation, and the training log says it.
"""

import dataclasses
import functools
import json
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import tiny
from models import attention, transformer
from models.attention import cpu_choice, cpu_kernel
from training import train

STATIC = ('dense', 'strided', 'fixed', 'local', 'block_local', 'local_global')
LEARNED = ('selective', 'adaptive_span', 'dynamic_span')  # No static pattern.
# The static variants' options (config.model.attention_options.<variant>).
_BLOCKS = dict(key_block=4, band_block=4)
OPTIONS = {'strided': dict(stride=4, factorization='merged', **_BLOCKS),
           'fixed': dict(stride=4, summary=2, factorization='merged', **_BLOCKS),
           'local': dict(window=5, **_BLOCKS),
           'local_global': dict(window=5, global_every=2, **_BLOCKS),
           'block_local': dict(_BLOCKS)}


def _auto(name, backend, *, head_dim=64, dtype=jnp.float32, block_size=128, devices=1):
  return attention.traits.of(name).implementation(
      'auto', options=attention.resolve_options({}, [name])[name], head_dim=head_dim,
      backend=backend, dtype=dtype, block_size=block_size, devices=devices)


@pytest.fixture
def kernel_builds(monkeypatch, tmp_path):
  """The kernel counts as built (nothing is compiled) and was measured faster than the XLA
  path on this CPU for every static variant: 'auto' may pick it on CPU."""
  monkeypatch.setattr(cpu_kernel, 'available', lambda: True)
  monkeypatch.setenv('ZOO_CPU_CHOICE', str(tmp_path / 'cpu_choice.json'))
  cpu_choice.record({attention.get(n).__name__: 'cpu_kernel' for n in STATIC}, {})


@pytest.fixture
def nothing_measured(monkeypatch, tmp_path):
  """The kernel builds, and nothing was measured on this CPU."""
  monkeypatch.setattr(cpu_kernel, 'available', lambda: True)
  monkeypatch.setenv('ZOO_CPU_CHOICE', str(tmp_path / 'cpu_choice.json'))


@pytest.fixture
def no_compiler(monkeypatch, tmp_path):
  """No compiler and no cached build: the kernel cannot be built (warns once, as in a fresh
  process)."""
  monkeypatch.setenv('ZOO_KERNEL_CACHE', str(tmp_path))
  monkeypatch.setenv('ZOO_CPU_CHOICE', str(tmp_path / 'cpu_choice.json'))
  monkeypatch.setenv('CXX', str(tmp_path / 'no-such-compiler'))
  load = cpu_kernel._load  # pylint: disable=protected-access
  monkeypatch.setattr(cpu_kernel, '_load', load.__wrapped__)
  monkeypatch.setattr(cpu_kernel, 'available', functools.cache(cpu_kernel.available.__wrapped__))


@pytest.fixture(scope='module')
def _kernel_build():
  try:
    cpu_kernel._load()  # pylint: disable=protected-access
  except cpu_kernel.KernelUnavailable as e:
    return f'CPU kernel unavailable (needs a C++ compiler): {str(e).splitlines()[0]}'
  return None


@pytest.fixture
def built_kernel(_kernel_build):
  if _kernel_build is not None:
    pytest.skip(_kernel_build)


# ------------------------------------------------------------------------ what 'auto' picks


@pytest.mark.parametrize('name', STATIC + LEARNED)
def test_auto_picks_the_documented_implementation(name, kernel_builds):
  del kernel_builds
  static = name in STATIC
  # TPU: splash for a static pattern whose blocks it can tile (multiples of 128); the fused
  # Pallas kernel for a learned score (dispatch.learned).
  assert _auto(name, 'tpu') == ('splash' if static else 'pallas')
  assert _auto(name, 'tpu', block_size=64) == ('blocksparse' if static else 'pallas')
  # GPU: cuDNN flash for dense in bf16/fp16 at head widths it takes; otherwise block-sparse.
  assert _auto(name, 'gpu') == 'blocksparse'  # float32
  for dtype in (jnp.bfloat16, jnp.float16):
    assert _auto(name, 'gpu', dtype=dtype) == ('cudnn' if name == 'dense' else 'blocksparse')
  assert _auto(name, 'gpu', dtype=jnp.bfloat16, head_dim=12) == 'blocksparse'  # Not 8 k.
  assert _auto(name, 'gpu', dtype=jnp.bfloat16, head_dim=256) == 'blocksparse'
  # CPU: the kernel for a static pattern on one device at a width it is built for, where it was
  # measured faster on this CPU (the fixture's record).
  assert _auto(name, 'cpu') == ('cpu_kernel' if static else 'blocksparse')
  assert _auto(name, 'cpu', head_dim=12) == 'blocksparse'
  assert _auto(name, 'cpu', devices=8) == 'blocksparse'


def test_auto_on_a_cpu_runs_the_kernel_only_where_it_was_measured_faster(nothing_measured):
  """A kernel tuned on one CPU is no default for every CPU: with nothing measured here 'auto'
  runs the XLA path; a record of this CPU picks per variant; another CPU's record is not
  read."""
  del nothing_measured
  assert [_auto(n, 'cpu') for n in STATIC] == ['blocksparse'] * len(STATIC)
  cpu_choice.record({'DenseAttention': 'blocksparse', 'LocalAttention': 'cpu_kernel'},
                    {'how': 'a test'})
  assert _auto('dense', 'cpu') == 'blocksparse'
  assert _auto('local', 'cpu') == 'cpu_kernel'
  assert _auto('strided', 'cpu') == 'blocksparse'  # Not measured.
  assert _auto('local', 'cpu', devices=2) == 'blocksparse'  # The kernel cannot run there.
  records = json.loads(cpu_choice.path().read_text())
  records['another-cpu'] = records.pop(cpu_choice.host_key())
  cpu_choice.path().write_text(json.dumps(records))
  assert _auto('local', 'cpu') == 'blocksparse'
  with pytest.raises(ValueError, match='cpu_kernel'):
    cpu_choice.record({'DenseAttention': 'fast'}, {})


def test_without_an_override_auto_reads_the_committed_measurements(monkeypatch):
  """No per-machine cache decides: the choices come from results/cpu_paths.json, committed
  with the code and keyed by CPU model and core count, unless $ZOO_CPU_CHOICE names a file."""
  monkeypatch.delenv('ZOO_CPU_CHOICE')
  assert cpu_choice.path() == cpu_choice.COMMITTED
  assert cpu_choice.COMMITTED.relative_to(cpu_choice.COMMITTED.parents[1]).as_posix() == (
      'results/cpu_paths.json')
  entries = json.loads(cpu_choice.COMMITTED.read_text())
  assert entries, 'no measured CPU committed'
  for key, entry in entries.items():
    assert re.fullmatch(r'.+ / \d+ cores', key), key
    assert set(entry['choice'].values()) <= {cpu_choice.KERNEL, cpu_choice.XLA}, key
    assert set(entry['choice']) <= {attention.get(n).__name__ for n in STATIC}, key
    assert entry['evidence']['rows'], key
  assert cpu_choice.source() == {'file': str(cpu_choice.COMMITTED), 'entry': cpu_choice.host_key(),
                                 'choice': entries.get(cpu_choice.host_key(), {}).get('choice', {})}


def test_an_unreadable_choice_file_runs_the_xla_path(nothing_measured, caplog):
  del nothing_measured
  cpu_choice.path().write_text('{not json')
  with caplog.at_level(logging.WARNING):
    assert _auto('local', 'cpu') == 'blocksparse'
  assert 'cannot read the CPU path choices' in caplog.text


@pytest.mark.parametrize('impl', [i for i in attention.IMPLEMENTATIONS if i != 'auto'])
def test_an_explicit_name_is_kept_where_it_runs(impl, kernel_builds):
  del kernel_builds
  backend = 'gpu' if impl == 'cudnn' else 'cpu'
  name = 'dense' if impl in ('fused', 'cudnn') else 'strided'
  assert attention.traits.of(name).implementation(
      impl, options=attention.resolve_options({}, [name])[name], head_dim=64,
      backend=backend) == impl


def test_fused_and_cudnn_name_what_runs_for_a_sparse_pattern():
  """jax.nn.dot_product_attention computes a sparse pattern as the masked reference, and the log
  says so; cuDNN's flash kernel cannot compute it at all."""
  args = dict(options=attention.resolve_options({}, ['strided'])['strided'], head_dim=64,
              backend='gpu')
  assert attention.traits.of('strided').implementation('fused', **args) == 'xla'
  with pytest.raises(ValueError, match='dense causal attention only'):
    attention.traits.of('strided').implementation('cudnn', **args)


@pytest.mark.parametrize('impl,backend', [('cudnn', 'cpu'), ('cudnn', 'tpu'), ('splash', 'gpu'),
                                          ('cpu_kernel', 'tpu'), ('cpu_kernel', 'gpu')])
def test_a_kernel_of_another_platform_is_refused_for_the_target(impl, backend, kernel_builds):
  del kernel_builds
  with pytest.raises(ValueError, match=f'{impl}.*cannot run here|StridedAttention.*{impl}'):
    attention.traits.of('strided').implementation(
        impl, options=attention.resolve_options({}, ['strided'])['strided'], head_dim=64,
        backend=backend)


@pytest.mark.cpu_only  # What the real backend resolves to on one CPU device.
def test_auto_without_a_compiler_falls_back_with_one_warning(no_compiler, caplog):
  del no_compiler
  cfg = transformer.TransformerConfig.from_config(dict(
      d_model=32, n_heads=2, n_layers=2, vocab_size=16, max_len=24, attention='dense,strided',
      attention_impl='auto', attention_options=OPTIONS))
  # Measured faster here once (a kernel build since removed): auto tries it and cannot build.
  cpu_choice.record({'DenseAttention': 'cpu_kernel', 'StridedAttention': 'cpu_kernel'}, {})
  with caplog.at_level(logging.WARNING):
    assert transformer.implementations(cfg) == ['blocksparse', 'blocksparse']
    assert transformer.implementations(cfg) == ['blocksparse', 'blocksparse']
  warnings = [r for r in caplog.records if 'kernel unavailable' in r.getMessage()]
  assert len(warnings) == 1, caplog.text


# --------------------------------------------------------- explicit names that cannot run


@pytest.mark.cpu_only  # What the real backend resolves to on one CPU device.
def test_explicit_cpu_kernel_without_a_compiler_is_refused_at_config_time(no_compiler):
  del no_compiler
  with pytest.raises(ValueError, match=r"compiler.*Use 'auto'"):
    transformer.TransformerConfig.from_config(dict(
        d_model=32, n_heads=2, n_layers=2, vocab_size=16, max_len=24, attention='strided',
        attention_impl='cpu_kernel', attention_options=OPTIONS))


@pytest.mark.parametrize('kwargs,match', [
    (dict(head_dim=12), r'head_dim in \(16, 32, 64, 128, 256\).*12'),
    (dict(devices=8), 'single CPU device'),
    (dict(backend='gpu'), 'CPU backend only'),
])
def test_explicit_cpu_kernel_where_it_cannot_run_says_why(kwargs, match, kernel_builds):
  del kernel_builds
  args = dict(options=attention.resolve_options({}, ['local'])['local'], head_dim=64,
              backend='cpu', devices=1)
  with pytest.raises(ValueError, match=match):
    attention.traits.of('local').implementation('cpu_kernel', **{**args, **kwargs})


@pytest.mark.parametrize('name,match', [
    ('selective', "'selective'.*SelectiveAttention has none"),
    ('adaptive_span', "'adaptive_span'.*adaptive span"),
    ('dynamic_span', "'dynamic_span'.*adaptive span"),
])
def test_explicit_cpu_kernel_for_a_variant_without_a_static_pattern_names_it(
    name, match, kernel_builds):
  del kernel_builds
  with pytest.raises(ValueError, match=match):
    transformer.TransformerConfig.from_config(dict(
        d_model=32, n_heads=2, n_layers=2, vocab_size=16, max_len=24, attention=name,
        position_embedding='none' if 'span' in name else 'learned', attention_impl='cpu_kernel'))


def test_splash_for_selective_is_refused_at_config_time():
  with pytest.raises(ValueError, match="'selective'.*'splash'"):
    transformer.TransformerConfig.from_config(dict(
        d_model=32, n_heads=2, n_layers=2, vocab_size=16, max_len=24, attention='selective',
        attention_impl='splash'))


def test_adaptive_span_runs_its_blocked_path_for_every_name_but_xla_and_pallas():
  cls = attention.traits.of('adaptive_span')
  for backend in ('cpu', 'gpu', 'tpu'):
    for impl in ('auto', 'blocksparse', 'fused', 'cudnn', 'splash'):
      want = 'pallas' if (impl, backend) == ('auto', 'tpu') else 'blocksparse'
      assert cls.implementation(impl, options={}, head_dim=64, backend=backend) == want
    assert cls.implementation('xla', options={}, head_dim=64, backend=backend) == 'xla'
  # LSH has no block table: it keeps its own path on TPU too.
  assert attention.traits.of('lsh').implementation('auto', options={}, head_dim=64,
                                                   backend='tpu') == 'blocksparse'


# --------------------------------------------------------------- what the implementations run


def _decoder(impl, attention_names='dense,strided', stack='unrolled'):
  cfg = transformer.TransformerConfig.from_config(dict(
      d_model=32, n_heads=2, n_layers=2, vocab_size=16, max_len=40, attention=attention_names,
      attention_impl=impl, attention_options=OPTIONS, stack=stack))
  return transformer.Decoder(cfg)


def _init(model):
  """The model's params (one jitted init: op by op it was the larger part of a test)."""
  return jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 40), jnp.int32))['params']


def _logits_and_grads(model, params, lower_only=False):
  """Logits and gradients of a fixed loss; with lower_only, just traces and lowers the program
  (which calls each layer's implementation) and returns nothing."""
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, 16, (2, 40)), jnp.int32)
  seg = np.ones((2, 40), np.int32)
  seg[0, 23:] = 2  # Two packed documents in row 0.
  pos = np.broadcast_to(np.arange(40), (2, 40)).copy()
  pos[0, 23:] -= 23
  cotangent = jnp.asarray(rng.normal(size=(2, 40, 16)), jnp.float32)

  def loss(p):
    logits = model.apply({'params': p}, tokens, positions=jnp.asarray(pos),
                         segment_ids=jnp.asarray(seg))
    return jnp.sum(logits * cotangent), logits

  program = jax.jit(jax.value_and_grad(loss, has_aux=True))
  if lower_only:
    program.lower(params)
    return None
  (_, logits), grads = program(params)
  return logits, grads


@pytest.mark.cpu_only
@pytest.mark.usefixtures('built_kernel')
@pytest.mark.parametrize('names,stack', [
    ('dense', 'unrolled'), ('dense', 'scan'),
    # Strided's kernel calls (the residue-order parts) equal the reference through the module
    # in tests/models/test_cpu_kernel.py; here it repeats what local_global shows of a sparse
    # pattern in the decoder, so it runs under -m slow.
    pytest.param('strided', 'unrolled', marks=pytest.mark.slow),
    ('local_global', 'unrolled')])
def test_cpu_kernel_equals_xla_outputs_and_gradients(names, stack):
  ref, kernel = _decoder('xla', names, stack), _decoder('cpu_kernel', names, stack)
  assert transformer.implementations(kernel.config) == ['cpu_kernel'] * 2
  params = _init(ref)
  want, g_want = _logits_and_grads(ref, params)
  got, g_got = _logits_and_grads(kernel, params)
  for g, g_ref in [(got, want)] + list(zip(jax.tree.leaves(g_got), jax.tree.leaves(g_want))):
    scale = float(np.max(np.abs(g_ref)))  # float32 rounding, relative to the leaf's size.
    np.testing.assert_allclose(g, g_ref, rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.cpu_only  # What the real backend resolves to on one CPU device.
def test_blocksparse_never_calls_the_kernel(monkeypatch, kernel_builds):
  del kernel_builds

  def fail(*args, **kwargs):
    del args, kwargs
    raise AssertionError('the CPU kernel was called')

  monkeypatch.setattr(cpu_kernel, 'attention', fail)
  # Dense, a sparse pattern, and local_global's global (dense) layer 1; head_dim 16 is one the
  # kernel is built for, on one CPU device: the old option would have used it. The kernel would
  # be called while tracing, so abstract params and lowering the forward and backward (nothing
  # compiled) show it is not.
  tokens = jax.ShapeDtypeStruct((1, 40), jnp.int32)
  for names in ('dense,strided', 'local_global'):
    model = _decoder('blocksparse', names)
    assert transformer.implementations(model.config) == ['blocksparse'] * 2
    params = jax.eval_shape(model.init, jax.random.key(0), tokens)['params']
    _logits_and_grads(model, params, lower_only=True)
  with pytest.raises(AssertionError, match='kernel was called'):  # The patch is the live path.
    model = _decoder('cpu_kernel', 'local_global')
    jax.eval_shape(model.init, jax.random.key(0), tokens)


# ---------------------------------------------------------------------------- per-layer log


@pytest.mark.cpu_only  # What the real backend resolves to on one CPU device.
def test_implementations_per_layer_of_a_mixed_model(monkeypatch, kernel_builds):
  del kernel_builds
  for impl, want in [('auto', ['cpu_kernel', 'cpu_kernel']), ('xla', ['xla', 'xla']),
                     ('blocksparse', ['blocksparse', 'blocksparse'])]:
    assert transformer.implementations(_decoder(impl).config) == want
  cfg = _decoder('auto').config
  for backend, dtype, want in [('tpu', jnp.float32, ['splash', 'splash']),
                               ('gpu', jnp.float32, ['blocksparse', 'blocksparse']),
                               ('gpu', jnp.bfloat16, ['cudnn', 'blocksparse'])]:
    monkeypatch.setattr(jax, 'default_backend', lambda b=backend: b)
    assert transformer.implementations(dataclasses.replace(cfg, dtype=dtype)) == want


@pytest.mark.parametrize('global_every,n_layers', [(2, 4), (3, 3)])
def test_local_globals_global_layers_run_denses_kernel_on_a_gpu(global_every, n_layers):
  """A global layer of local_global is dense causal attention: on a GPU, in bf16, 'auto' gives
  it cuDNN's flash kernel as it gives dense (the blocked engine was 6.4x slower there at 16K:
  docs/variant_speed_gpu.md); the window layers stay on the blocked engine."""
  options = {**OPTIONS, 'local_global': {**OPTIONS['local_global'], 'global_every': global_every}}
  cfg = transformer.TransformerConfig.from_config(dict(
      d_model=64, n_heads=2, n_layers=n_layers, vocab_size=16, max_len=24,
      attention='local_global', attention_impl='auto', attention_options=options,
      target_platform='gpu', target_devices=1, dtype='bfloat16'))
  want = ['cudnn' if i % global_every == global_every - 1 else 'blocksparse'
          for i in range(n_layers)]
  assert transformer.implementations(cfg) == want
  for name, value in [('dtype', jnp.float32), ('target_platform', 'tpu')]:
    assert 'cudnn' not in transformer.implementations(dataclasses.replace(cfg, **{name: value}))
  # The variant as a whole (no layer) is no dense pattern; an explicit 'cudnn' names the
  # window layers it cannot compute.
  assert _auto('local_global', 'gpu', dtype=jnp.bfloat16) == 'blocksparse'
  with pytest.raises(ValueError, match='dense causal attention only'):
    transformer.implementations(dataclasses.replace(cfg, attention_impl='cudnn'))


def test_local_global_per_layer_fused_equals_xla():
  """The per-layer choice end to end on a CPU: explicit 'fused' runs local_global's global
  layer 1 on jax.nn.dot_product_attention (the call cuDNN's kernel goes through on a GPU) and
  its window layer 0 on the masked reference; logits and gradients equal 'xla''s."""
  ref, fused = _decoder('xla', 'local_global'), _decoder('fused', 'local_global')
  assert transformer.implementations(fused.config) == ['xla', 'fused']
  params = _init(ref)
  want, g_want = _logits_and_grads(ref, params)
  got, g_got = _logits_and_grads(fused, params)
  for g, g_ref in [(got, want)] + list(zip(jax.tree.leaves(g_got), jax.tree.leaves(g_want))):
    scale = float(np.max(np.abs(g_ref)))
    np.testing.assert_allclose(g, g_ref, rtol=1e-5, atol=1e-5 * scale)


class _Stop(Exception):
  pass


@pytest.mark.cpu_only  # What the real backend resolves to on one CPU device.
def test_training_log_says_each_layers_implementation(monkeypatch, tmp_path, caplog,
                                                      kernel_builds):
  del kernel_builds  # Measured faster here for every static variant.
  config = tiny.get_config()
  config.model.attention = 'dense,strided'
  config.model.attention_options.strided.stride = 4
  config.peak_tflops_per_device = 1.0  # No matmul peak measurement.

  def stop(*args, **kwargs):  # Right after the model lines: nothing is compiled.
    raise _Stop

  monkeypatch.setattr(train.checkpoints, 'Checkpointer', stop)
  with caplog.at_level(logging.INFO), pytest.raises(_Stop):
    train.train_and_evaluate(config, str(tmp_path))
  # The tiny recipe's heads are 64 wide: the kernel.
  impl = 'cpu_kernel'
  assert (f'attention implementation per layer: 0 dense:{impl}, 1 strided:{impl}'
          in caplog.text), caplog.text
