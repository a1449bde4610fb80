"""Every attention variant: one train step on 8 fake CPU devices equals the one-device step.

(And every block wiring other than pre_ln and every stack setting other than unrolled, on
dense attention, read from the registries: cases.component_cases.)

For each registered variant (`models.attention.known()`, so a new one is covered when it
registers) and each mesh of a run in RUNS, the same small model, initial parameters and batch
give, on 8 devices and on 1, the same
- loss, auxiliary loss (adaptive span's L1 penalty, selective's L_mem) and gradient norm;
- gradient, as the optimizer saw it after global-norm clipping: after one AdamW step from a
  zero state the first moment is mu = (1 - b1) g, so g = mu / (1 - b1) is read back from the
  optimizer state without compiling a second program;
- parameters after the step (`steps.jit_train_step`, the loop's step, with its shardings).

The model: 1 layer (2 for the scanned stacks, whose parameters are stacked over layers; a
second layer of an unrolled stack is the first one's sharding again and cost a fifth of the
run's CPU time), d_model 32, 4 heads of 8 (2 per device with tensor=2), float32, on the
Copy task (rows of 32 with padding, so document masks matter; most positions are scored), with
pattern sizes of 2-16 so the sparse patterns are sparse at that length. The default runs use
the einsum reference ('xla') and the TPU splash kernel (Pallas interpret mode, under shard_map
over the batch and head axes; static patterns only, and in the CI tier SPLASH_CI's two cases)
on data=2, fsdp=2, tensor=2, a mesh that splits every axis; the slow runs add every static case
on splash, the default 'blocksparse' implementation and meshes with
data=4, tensor=4 and fsdp=8.

Cost: everything runs in one 8-device subprocess per run (the fake device count is fixed when
JAX starts); the initial parameters are computed once, on one device, and put onto each mesh;
all variants share one compiled program per mesh (each variant's own jitted train step called
inside one outer jit), since XLA:CPU takes about 1 CPU-second per variant and mesh to compile
this step and a program of its own adds fixed costs.

Tolerances (float32; the only legitimate differences are reduction orders across devices;
measured on every variant and mesh: loss and gradient norm <= 4e-7 relative, clipped gradient
<= 1.5e-7 absolute, parameters after the step <= 2.7e-7 absolute):
- LOSS_RTOL 1e-5 on loss, auxiliary loss and gradient norm: sums over ~130 scored tokens and
  over the parameters, reordered, move by a few ulp. A wrongly split, dropped or double-counted
  row or shard moves them by > 1e-2.
- GRAD_ATOL 1e-5 (GRAD_RTOL 1e-4) on the clipped gradient, whose global norm is 1 and largest
  entries 0.09-0.13: about 1e-4 of the largest entries. Small entries come out of cancellation
  and their relative error can be large, hence a bound at the scale of the whole gradient.
- PARAM_ATOL 1e-5 after the step: with adam_eps 1e-3 the first AdamW step moves a weight by
  lr g / (|g| + eps), whose slope in g is at most lr / eps = 5, so a gradient error of 1e-7
  moves it by < 1e-6 (test_sharded_step.ADAM_EPS says why the default eps 1e-8 is not usable:
  a gradient entry that is pure rounding noise can flip sign and move its weight by lr).
"""

import json
import textwrap

import numpy as np
import pytest

from models import attention
from tests.contracts import cases

pytestmark = pytest.mark.system

# The product's variants: those a fresh process registers (test modules register their own
# toy variants in this process, which the 8-device subprocess does not import).
VARIANTS = [name for name in attention.known()
            if attention.get(name).__module__.startswith('models.')]
# Variants that cannot run on this configuration, with the reason; none so far.
SKIP: dict[str, str] = {}

# Meshes (data, fsdp, tensor) compared with one device: heads, MLP width and the vocabulary
# split over tensor, parameters and optimizer state over fsdp, batch rows over data and fsdp.
MESHES = {
    'data2_fsdp2_tensor2': (2, 2, 2),
}
# More meshes, and the default implementation ('blocksparse': the plain-JAX block-sparse path
# on several devices), in the slow run only: each mesh adds a program of every case (the 'xla'
# run of one device, data4_tensor2 and data2_fsdp2_tensor2 took 297 s in CI; data4_tensor2's
# data and tensor splits are both in data2_fsdp2_tensor2).
SLOW_MESHES = {
    'data4_tensor2': (4, 1, 2),
    'fsdp2_tensor4': (1, 2, 4),
    'fsdp8': (1, 8, 1),
}
RUNS = {  # name: (model.attention_impl, meshes)
    'xla': ('xla', MESHES),
    # The Pallas TPU kernel in interpret mode, under shard_map over the batch and head axes
    # (models/attention/splash.py), for the static patterns; its tiles are 128 long, so the
    # 32-position rows are padded to one tile.
    'splash': ('splash', {'data2_fsdp2_tensor2': MESHES['data2_fsdp2_tensor2']}),
    # The CI tier's splash run: SPLASH_CI's cases only (the full run took 194 s of CI's budget
    # for 12 cases, issue 67); the slow run has every case.
    'splash_ci': ('splash', {'data2_fsdp2_tensor2': MESHES['data2_fsdp2_tensor2']}),
    'blocksparse': ('blocksparse', {**MESHES, **SLOW_MESHES}),
    # The fused Pallas kernel of every variant on the blocked engine and every static pattern
    # (models/attention/pallas_kernel.py), in interpret mode under shard_map: heads split over
    # tensor except for a score with a carried state (selective), per-head parameters
    # (Transformer-XL's R, fixed attention's distinct heads) and per-row ones (dynamic spans)
    # split with them. CI runs PALLAS_CI's cases.
    'pallas': ('pallas', {'data2_fsdp2_tensor2': MESHES['data2_fsdp2_tensor2']}),
    'pallas_ci': ('pallas', {'data2_fsdp2_tensor2': MESHES['data2_fsdp2_tensor2']}),
    'xla_more_meshes': ('xla', SLOW_MESHES),
}
FAST_RUNS = ('xla', 'splash_ci', 'pallas_ci')  # The others are slow (CI skips them).
# pallas_ci's cases: one of each way the kernel splits its inputs over the mesh (above).
PALLAS_CI = ('fixed', 'txl', 'dynamic_span', 'selective')
# splash_ci's cases: a sparse pattern (its kernel call carries a mask) and the block whose
# backward pass replays the kernel.
SPLASH_CI = ('local', 'reversible_residual')
# Keys on top of CONFIG for a run.
RUN_CONFIG = {'splash': {'model.attention_block_size': 128},
              'splash_ci': {'model.attention_block_size': 128}}
REFERENCE = 'one'

LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-4
GRAD_ATOL = 1e-5
PARAM_RTOL = 1e-5
PARAM_ATOL = 1e-5
ADAM_EPS = 1e-3

# Pattern sizes for a sequence of 32: stride / block l = 4 with c = 2 summary cells, a window
# of 8, query blocks of 8, spans of at most 16 with a ramp of 4 (z starts at 4: trimmed span
# 8), selective attention's L_mem on (an auxiliary loss summed over the batch), and
# block_local's m = 4 earlier positions (sparse on a 32-position row), and LSH's 2 rounds of 4
# buckets in chunks of 8.
# Each is given to every variant that declares an option of that name.
OPTIONS = {'stride': 4, 'summary': 2, 'window': 8, 'local_block': 8, 'block_memory': 4,
           'key_block': 4, 'limit': 16, 'ramp': 4, 'trim_multiple': 4, 'init': 0.25, 'lmem_eps': 0.1,
           'chunk_len': 8, 'n_buckets': 4, 'n_hashes': 2}
# Dotted config keys applied on top of configs/tiny.py.
CONFIG = {
    'data.name': 'copy', 'data.num_symbols': 28, 'data.max_length': 15,  # seq 32, 32 ids.
    'model.d_model': 32, 'model.n_heads': 4, 'model.n_layers': 1, 'model.vocab_size': 32,
    'model.dtype': 'float32', 'model.param_dtype': 'float32', 'model.attention_block_size': 8,
    'batch_size': 8, 'warmup_steps': 0, 'adam_eps': ADAM_EPS, 'peak_tflops_per_device': 1.0,
    **{f'model.attention_options.{variant}.{k}': v for variant in attention.known()
       for k, v in OPTIONS.items() if k in attention.options(variant)},
}

# Cases beyond one per variant: each block wiring and stack setting, on dense attention, with
# dropout so that the masks a block or stack replays (the reversible layer's backward pass,
# the universal stack's per-step masks) are compared too.
EXTRA_CASES = list(cases.component_cases())
CASES = VARIANTS + EXTRA_CASES
# Per-case keys on top of CONFIG and model.attention=<case>: Transformer-XL encodes positions
# itself, and the Copy task is not a stream, so its layers attend within the segment (the
# relative score alone).
CASE_CONFIG = {
    'txl': {'model.position_embedding': 'none', 'model.attention_options.txl.mem_len': 0},
    **{label: {**keys, 'model.dropout_rate': 0.1}
       for label, keys in cases.component_cases().items()},
}
# The universal stack at 3 steps (ACT: at most 3, the ponder cost a visible auxiliary loss).
for _label in EXTRA_CASES:
  if CASE_CONFIG[_label]['model.stack'] == 'universal':
    CASE_CONFIG[_label].update({'model.stack_options.steps': 3, 'model.stack_options.max_steps': 3,
                                'model.stack_options.ponder': 0.05})
  if CASE_CONFIG[_label]['model.stack'] in ('scan', 'scan_cycle'):
    CASE_CONFIG[_label]['model.n_layers'] = 2  # Scanned parameters of more than one layer.

_SCRIPT = textwrap.dedent('''\
    """One train step of every variant on 1 device and on 8-device meshes; saves the results."""
    import json
    import sys
    import traceback

    import jax
    import numpy as np
    import optax

    from configs import tiny
    from training import assembly, sharding, steps

    out_dir = sys.argv[1]
    spec = json.loads(sys.argv[2])
    meshes = {'one': (1, 1, 1), **{k: tuple(v) for k, v in spec['meshes'].items()}}
    FAST_COMPILE = {'xla_backend_optimization_level': 0,
                    'xla_llvm_disable_expensive_passes': True}
    errors = {}


    def make_config(name, mesh):
      config = tiny.get_config()
      for key, value in {**spec['config'], 'model.attention': name,
                         **spec['case_config'].get(name, {})}.items():
        node = config
        *parents, leaf = key.split('.')
        for p in parents:
          node = node[p]
        node[leaf] = value
      config.mesh.data, config.mesh.fsdp, config.mesh.tensor = mesh
      return config


    def fail(name, where):
      errors.setdefault(name, f'{where}:\\n{traceback.format_exc()}')


    # Setups per variant and mesh; a variant whose config does not build is reported.
    setups = {}
    for name in spec['variants']:
      try:
        setups[name] = {tag: assembly.build(make_config(name, mesh),
                                         devices=jax.devices()[:int(np.prod(mesh))])
                        for tag, mesh in meshes.items()}
      except Exception:  # pylint: disable=broad-except
        fail(name, 'assembly.build')

    # Initial states: every variant initialized once on one device (one compiled program).
    one = {name: s['one'] for name, s in setups.items()}
    first = next(iter(one.values()))
    key = jax.random.key(first.config.seed)
    with sharding.activate(first.mesh, first.rules):
      init = jax.jit(lambda k: {n: s.init_fn(k) for n, s in one.items()},
                     out_shardings={n: s.state_sharding for n, s in one.items()})
      host_init = jax.device_get(init.lower(key).compile(FAST_COMPILE)(key))
    host_batch = first.data.train_batch(0)
    rng = jax.random.key(first.config.seed + 1)


    def run_group(tag, names):
      """One step of each variant in `names` on mesh `tag`, compiled as one program."""
      group = {n: setups[n][tag] for n in names}
      lead = group[names[0]]
      states = {n: jax.device_put(host_init[n], s.state_sharding) for n, s in group.items()}
      batch = assembly.device_batch(lead, host_batch)
      # The loop's step: each model specialized to its parameters (adaptive span's trim).
      fns = {n: steps.jit_train_step(s, assembly.specialized_model(s, host_init[n].params))
             for n, s in group.items()}
      with sharding.activate(lead.mesh, lead.rules):
        step = jax.jit(lambda st, b, r: {n: fns[n](st[n], b, r) for n in names})
        return step.lower(states, batch, rng).compile(FAST_COMPILE)(states, batch, rng)


    def run_mesh(tag, names):
      """run_group, falling back to one variant at a time to name the one that fails."""
      try:
        return run_group(tag, names)
      except Exception:  # pylint: disable=broad-except
        if len(names) == 1:
          fail(names[0], f'mesh {tag}')
          return {}
        out = {}
        for n in names:
          out.update(run_mesh(tag, [n]))
        return out


    arrays, results = {}, {}
    for name in setups:
      for path, leaf in jax.tree_util.tree_leaves_with_path(host_init[name].params):
        arrays[f'{name}|init|{jax.tree_util.keystr(path)}'] = np.asarray(leaf)
    b1 = first.config.adam_b1
    for tag in meshes:
      for name, (state, metrics) in run_mesh(tag, list(setups)).items():
        grads = jax.tree.map(lambda mu: mu / (1.0 - b1),
                             optax.tree_utils.tree_get(state.opt_state, 'mu'))
        layout = {}
        for kind, tree in (('params', state.params), ('grads', grads)):
          for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
            arrays[f'{name}|{tag}|{kind}|{jax.tree_util.keystr(path)}'] = np.asarray(
                jax.device_get(leaf))
            if kind == 'params':
              axes = [a for entry in leaf.sharding.spec if entry is not None
                      for a in ((entry,) if isinstance(entry, str) else entry)]
              layout[jax.tree_util.keystr(path)] = {
                  'spec': str(leaf.sharding.spec), 'devices': len(leaf.sharding.device_set),
                  'split_axes': [a for a in axes if leaf.sharding.mesh.shape[a] > 1],
                  'global_shape': list(leaf.shape),
                  'shard_shape': list(leaf.addressable_shards[0].data.shape)}
        results[f'{name}|{tag}'] = {
            'metrics': {k: float(metrics[k]) for k in ('loss', 'aux_loss', 'grad_norm')},
            'mesh': dict(setups[name][tag].mesh.shape), 'step': int(state.step),
            'layout': layout}
    np.savez(f'{out_dir}/arrays.npz', **arrays)
    with open(f'{out_dir}/results.json', 'w') as f:
      json.dump({'device_count': jax.device_count(), 'errors': errors, 'results': results}, f)
    ''')


def _run_cases(run):
  """The cases of a run: splash computes static patterns only (dense for the extra cases)."""
  if run == 'pallas_ci':
    return [c for c in CASES if c in PALLAS_CI]
  if RUNS[run][0] != 'splash':
    return CASES
  static = [c for c in CASES if c in EXTRA_CASES or attention.traits.of(c).has_static_pattern()]
  return [c for c in static if c in SPLASH_CI] if run == 'splash_ci' else static


def _run(harness, out, run):
  """Runs the script for every variant on one device and on the meshes of RUNS[run]."""
  impl, meshes = RUNS[run]
  script = out / 'sharding_variants.py'
  script.write_text(_SCRIPT)
  spec = {'variants': [v for v in _run_cases(run) if v not in SKIP], 'meshes': meshes,
          'config': {**CONFIG, 'model.attention_impl': impl, **RUN_CONFIG.get(run, {})},
          'case_config': CASE_CONFIG}
  proc = harness.run_script(script, out, json.dumps(spec), devices=8)
  assert proc.returncode == 0, proc.stderr[-5000:]
  result = json.loads((out / 'results.json').read_text())
  assert result['device_count'] == 8
  with np.load(out / 'arrays.npz') as arrays:
    return result, dict(arrays)


@pytest.fixture(scope='module')
def runs(harness, tmp_path_factory):
  """run name -> (results json, {name: array}); each run's subprocess starts on first use."""
  cache = {}

  def get(run):
    if run not in cache:
      cache[run] = _run(harness, tmp_path_factory.mktemp(f'sharding_{run}'), run)
    return cache[run]

  return get


def _tree(arrays, prefix: str) -> dict[str, np.ndarray]:
  return {k[len(prefix):]: v for k, v in arrays.items() if k.startswith(prefix)}


def _cases():
  for run, (_, meshes) in RUNS.items():
    for mesh in meshes:
      for name in _run_cases(run):
        marks = [pytest.mark.slow] if run not in FAST_RUNS else []
        if name in SKIP:
          marks.append(pytest.mark.skip(reason=SKIP[name]))
        yield pytest.param(run, mesh, name, marks=marks, id=f'{run}-{mesh}-{name}')


@pytest.mark.parametrize('run,mesh,name', list(_cases()))
def test_step_on_eight_devices_matches_one_device(runs, run, mesh, name):
  """The first case of a run takes minutes in CI: it starts the run's 8-device subprocess,
  which compiles and runs every case of the run (the module docstring's Cost); the other
  cases read its results."""
  result, arrays = runs(run)
  assert name not in result['errors'], result['errors'][name]
  one, eight = result['results'][f'{name}|{REFERENCE}'], result['results'][f'{name}|{mesh}']
  data, fsdp, tensor = RUNS[run][1][mesh]
  assert one['mesh'] == {'data': 1, 'fsdp': 1, 'tensor': 1}
  assert eight['mesh'] == {'data': data, 'fsdp': fsdp, 'tensor': tensor}
  assert one['step'] == eight['step'] == 1

  # The 8-device parameters really are split over every mesh axis of size > 1.
  layout = eight['layout']
  assert all(v['devices'] == 8 for v in layout.values()), layout
  split = {a for v in layout.values() for a in v['split_axes']}
  assert split == {a for a, size in (('fsdp', fsdp), ('tensor', tensor)) if size > 1}, layout
  # The fused input projection ('qv' for LSH's shared-QK) is split over fsdp and tensor.
  qkv = next(v for k, v in layout.items() if k.endswith("['qkv']") or k.endswith("['qv']"))
  assert int(np.prod(qkv['shard_shape'])) * fsdp * tensor == int(np.prod(qkv['global_shape']))

  m1, m8 = one['metrics'], eight['metrics']
  assert np.isfinite(m1['loss']) and m1['grad_norm'] > 0, m1
  for k in ('loss', 'aux_loss', 'grad_norm'):
    assert m8[k] == pytest.approx(m1[k], rel=LOSS_RTOL, abs=1e-7), (k, m8, m1)

  init = _tree(arrays, f'{name}|init|')
  for kind, rtol, atol in (('grads', GRAD_RTOL, GRAD_ATOL), ('params', PARAM_RTOL, PARAM_ATOL)):
    ref, got = _tree(arrays, f'{name}|{REFERENCE}|{kind}|'), _tree(arrays, f'{name}|{mesh}|{kind}|')
    assert ref and sorted(ref) == sorted(got) == sorted(init)
    for leaf in sorted(ref):
      np.testing.assert_allclose(got[leaf], ref[leaf], rtol=rtol, atol=atol,
                                 err_msg=f'{name} {mesh} {kind} {leaf}')
  # The comparison is not between zeros or untouched initializations.
  grads = _tree(arrays, f'{name}|{REFERENCE}|grads|')
  assert max(float(np.max(np.abs(g))) for g in grads.values()) > 100 * GRAD_ATOL
  params = _tree(arrays, f'{name}|{REFERENCE}|params|')
  assert max(float(np.max(np.abs(params[k] - init[k]))) for k in init) > 100 * PARAM_ATOL
