"""The sharded train step computes the same update as the single-device one.

The 8-device case runs in a subprocess because the number of fake CPU devices is fixed
when JAX starts (XLA_FLAGS=--xla_force_host_platform_device_count=8).
"""

import json
import re
import textwrap

import jax
import numpy as np
import pytest

from training import assembly, sharding, steps

# float32 everywhere; the only differences are reduction orders across devices.
RTOL = 1e-5
ATOL = 1e-5
NUM_STEPS = 3
# Adam's first steps move each weight by about lr * g / (|g| + eps): with the default eps
# (1e-8) a gradient entry that is pure cancellation noise (|g| ~ 1e-9) can flip sign between
# two reduction orders and move its weight by up to lr = 5e-3 (seen: 3e-5 to 6e-5 on a few of
# 33k entries). A larger eps keeps the update Lipschitz in the gradient, so float32 noise
# stays far below ATOL while a wrongly scaled or wrongly summed gradient still shows.
ADAM_EPS = 1e-3

_SCRIPT = textwrap.dedent('''\
    """Runs NUM_STEPS train steps on 1 device and on a 2x2x2 mesh; saves losses and params."""
    import json
    import sys

    import jax
    import numpy as np

    from configs import tiny
    from training import assembly, sharding, steps

    out_dir, num_steps = sys.argv[1], int(sys.argv[2])


    def make_config(data, fsdp, tensor):
      config = tiny.get_config()
      config.model.d = 2
      config.model.n_heads = 2
      config.model.dtype = 'float32'
      config.model.param_dtype = 'float32'
      # 32 token ids (the task uses 25) so the vocab axis splits over tensor=2.
      config.model.vocab_size = 32
      config.data.num_assignments = 8
      config.batch_size = 8
      config.warmup_steps = 0  # Every step moves the parameters.
      config.adam_eps = float(sys.argv[3])
      config.peak_tflops_per_device = 1.0
      config.mesh.data, config.mesh.fsdp, config.mesh.tensor = data, fsdp, tensor
      return config


    def run(config, devices):
      setup = assembly.build(config, devices=devices)
      state = assembly.init_state(setup, config.seed)
      init = jax.tree.map(np.asarray, jax.device_get(state.params))
      step_fn = steps.jit_train_step(setup)
      rng = jax.random.key(config.seed + 1)
      losses = []
      with sharding.activate(setup.mesh, setup.rules):
        for step in range(num_steps):
          batch = assembly.device_batch(setup, setup.data.train_batch(step))
          state, metrics = step_fn(state, batch, rng)
          losses.append([float(metrics['loss']), float(metrics['grad_norm'])])
      return setup, state, init, losses


    setup1, state1, init1, losses1 = run(make_config(1, 1, 1), jax.devices()[:1])
    setup8, state8, init8, losses8 = run(make_config(2, 2, 2), jax.devices())
    arrays, layout = {}, {}
    for tag, tree in (('init1', init1), ('init8', init8), ('final1', state1.params),
                      ('final8', state8.params)):
      for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        arrays[f'{tag}{jax.tree_util.keystr(path)}'] = np.asarray(jax.device_get(leaf))
    for path, leaf in jax.tree_util.tree_leaves_with_path(state8.params):
      layout[jax.tree_util.keystr(path)] = {
          'spec': str(leaf.sharding.spec),
          'global_shape': list(leaf.shape),
          'shard_shape': list(leaf.addressable_shards[0].data.shape),
          'devices': len(leaf.sharding.device_set),
      }
    np.savez(f'{out_dir}/params.npz', **arrays)
    with open(f'{out_dir}/result.json', 'w') as f:
      json.dump({'device_count': jax.device_count(), 'mesh1': dict(setup1.mesh.shape),
                 'mesh8': dict(setup8.mesh.shape), 'losses1': losses1, 'losses8': losses8,
                 'layout': layout}, f)
    ''')


@pytest.mark.slow
def test_2x2x2_mesh_matches_single_device(tmp_path, harness):
  """In the slow tier (12 s of CI's budget, issue 67): the CI tier has its cases, every
  variant's step on this mesh against one device (tests/contracts/test_sharded_contract.py)
  and several steps with the parameters split over processes and devices
  (tests/contracts/test_multiprocess_contract.py's fsdp and tensor layouts)."""
  script = tmp_path / 'sharded_step.py'
  script.write_text(_SCRIPT)
  proc = harness.run_script(script, tmp_path, NUM_STEPS, ADAM_EPS, devices=8)
  assert proc.returncode == 0, proc.stderr[-5000:]
  result = json.loads((tmp_path / 'result.json').read_text())
  assert result['device_count'] == 8
  assert result['mesh1'] == {'data': 1, 'fsdp': 1, 'tensor': 1}
  assert result['mesh8'] == {'data': 2, 'fsdp': 2, 'tensor': 2}

  # The 8-device parameters are really split: over fsdp and over tensor, on all 8 devices.
  layout = result['layout']
  assert all(v['devices'] == 8 for v in layout.values()), layout
  split = {k for k, v in layout.items() if v['shard_shape'] != v['global_shape']}
  assert any('fsdp' in layout[k]['spec'] for k in split), layout
  assert any('tensor' in layout[k]['spec'] for k in split), layout
  qkv = next(v for k, v in layout.items() if k.endswith("['qkv']"))
  assert int(np.prod(qkv['shard_shape'])) * 4 == int(np.prod(qkv['global_shape'])), qkv

  # Per step: [loss, grad_norm].
  losses1, losses8 = np.array(result['losses1']), np.array(result['losses8'])
  assert losses1.shape == (NUM_STEPS, 2) and np.all(np.isfinite(losses1))
  np.testing.assert_allclose(losses8, losses1, rtol=RTOL, atol=ATOL)
  assert len(set(losses1[:, 0])) == NUM_STEPS  # Different batches, moving parameters.

  arrays = np.load(tmp_path / 'params.npz')
  names = sorted(k[len('final1'):] for k in arrays.files if k.startswith('final1'))
  assert names and names == sorted(k[len('final8'):] for k in arrays.files
                                   if k.startswith('final8'))
  moved = 0.0
  for name in names:
    np.testing.assert_array_equal(arrays['init8' + name], arrays['init1' + name], err_msg=name)
    np.testing.assert_allclose(arrays['final8' + name], arrays['final1' + name], rtol=RTOL,
                               atol=ATOL, err_msg=name)
    moved = max(moved, float(np.max(np.abs(arrays['final1' + name] - arrays['init1' + name]))))
  assert moved > 100 * ATOL  # The comparison is not between untouched initializations.


_TENSOR_SCRIPT = textwrap.dedent('''\
    """Compiles the train step on a tensor=2 mesh; writes every all-gather's result shape."""
    import json
    import re
    import sys

    import jax

    from configs import tiny
    from training import assembly, sharding, steps

    config = tiny.get_config()
    config.model.dtype = config.model.param_dtype = 'float32'
    config.model.vocab_size = 32  # Splits over tensor=2.
    config.data.num_assignments = 8
    config.batch_size = 8
    config.mesh.data, config.mesh.fsdp, config.mesh.tensor = 1, 1, 2
    setup = assembly.build(config, devices=jax.devices())
    state = assembly.init_state(setup, config.seed)
    step_fn = steps.jit_train_step(setup)
    with sharding.activate(setup.mesh, setup.rules):
      batch = assembly.device_batch(setup, setup.data.train_batch(0))
      hlo = step_fn.lower(state, batch, jax.random.key(0)).compile().as_text()
    gathers = [line.strip()[:160] for line in hlo.splitlines()
               if re.search(r'= [a-z0-9]+\\[[0-9,]*\\]\\S* all-gather(-start)?\\(', line)]
    with open(sys.argv[1], 'w') as f:
      json.dump({'mesh': dict(setup.mesh.shape), 'gathers': gathers,
                 'tokens': int(batch['inputs'].size)}, f)
    ''')


def test_tensor_parallel_step_gathers_no_weights_or_hidden_activations(tmp_path, harness):
  """Megatron layout: with heads and MLP width split over `tensor`, the QKV and SwiGLU input
  kernels are column-parallel and the output kernels row-parallel, so a step needs all-reduces
  but never all-gathers a kernel or a per-token hidden vector. (Flattening a (d, parts, n)
  kernel whose n is split made GSPMD gather both, every step.) Only a few numbers per token
  may be gathered: each vocab shard's best logit and its index, for the accuracy metric."""
  script = tmp_path / 'tensor_step.py'
  script.write_text(_TENSOR_SCRIPT)
  proc = harness.run_script(script, tmp_path / 'result.json', devices=2)
  assert proc.returncode == 0, proc.stderr[-5000:]
  result = json.loads((tmp_path / 'result.json').read_text())
  assert result['mesh'] == {'data': 1, 'fsdp': 1, 'tensor': 2}
  limit = result['tokens'] * 2  # Two numbers per token (one per vocab shard).
  for line in result['gathers']:
    shape = re.search(r'\[([0-9,]*)\]', line).group(1)
    size = int(np.prod([int(n) for n in shape.split(',') if n]))
    assert size <= limit, f'all-gather of {size} elements (> {limit}): {line}'


def _train(harness, grad_accum_steps, num_steps=2):
  config = harness.config({'batch_size': 8, 'grad_accum_steps': grad_accum_steps,
                           'warmup_steps': 0, 'adam_eps': ADAM_EPS})
  setup = assembly.build(config, devices=jax.devices()[:1])
  state = assembly.init_state(setup, config.seed)
  init = jax.tree.map(np.asarray, jax.device_get(state.params))
  step_fn = steps.jit_train_step(setup)
  rng = jax.random.key(config.seed + 1)
  losses = []
  with sharding.activate(setup.mesh, setup.rules):
    for step in range(num_steps):
      state, metrics = step_fn(state, assembly.device_batch(setup, setup.data.train_batch(step)),
                               rng)
      losses.append([float(metrics['loss']), float(metrics['grad_norm'])])
  assert int(state.step) == num_steps
  return init, jax.tree.map(np.asarray, jax.device_get(state.params)), losses


def test_grad_accumulation_matches_full_batch(harness):
  init1, params1, losses1 = _train(harness, grad_accum_steps=1)
  init2, params2, losses2 = _train(harness, grad_accum_steps=2)
  for a, b in zip(jax.tree.leaves(init1), jax.tree.leaves(init2)):
    np.testing.assert_array_equal(a, b)
  # Per step: [loss, grad_norm]; the accumulated gradient has the full batch's scale.
  np.testing.assert_allclose(losses2, losses1, rtol=RTOL, atol=ATOL)
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(params1)]
  moved = 0.0
  for name, a, b, a0 in zip(paths, jax.tree.leaves(params1), jax.tree.leaves(params2),
                            jax.tree.leaves(init1)):
    np.testing.assert_allclose(b, a, rtol=RTOL, atol=ATOL, err_msg=name)
    moved = max(moved, float(np.max(np.abs(a - a0))))
  assert moved > 100 * ATOL
