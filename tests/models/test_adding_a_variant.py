"""docs/adding_a_variant.md's 'Adding a variant': a variant defined in one file (here, this
test) trains, decodes and is inspected through the production code with no other edit."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from configs import tiny
from models import attention, decode, transformer
from models.attention import base, patterns
from training import assembly, attention_maps, steps, train

NAME = 'test_dilated_window'


@dataclasses.dataclass(frozen=True)
class DilatedWindow:
  """Static pattern: every r-th earlier position, the w most recent of them."""
  w: int
  r: int

  def allowed(self, i, j, head=0):
    del head
    d = i - j
    return (d >= 0) & (d % self.r == 0) & (d < self.w * self.r)


class DilatedWindowAttention(base.MultiHeadAttention):
  """A dilated sliding window: the whole variant is its pattern and two options (no `attend`:
  models/attention/dispatch.py computes the pattern on every kernel)."""
  OPTIONS = {
      'test_dilation': base.Option(2, 'r: every r-th position'),
      'test_dilated_window': base.Option(3, 'w: positions kept'),
  }

  def head_pattern(self, head):
    return DilatedWindow(self.option('test_dilated_window'), self.option('test_dilation'))


if NAME not in attention.known():
  attention.register(NAME)(DilatedWindowAttention)


def _config():
  config = tiny.get_config()  # Built after the registration: the variant's group is there.
  config.model.attention = NAME  # attention_impl 'auto': the kernel the target runs.
  assert NAME in config.model.attention_options
  config.model.attention_options[NAME].test_dilation = 3
  config.batch_size, config.peak_tflops_per_device = 8, 1.0
  config.data.num_assignments = 2
  return config


def test_new_variant_trains_through_the_production_loop(tmp_path):
  setup = assembly.build(_config(), workdir=str(tmp_path))
  assert setup.model_config.options_of(NAME)['test_dilation'] == 3
  assert setup.model_config.stack_name == 'scan'  # Layer-independent: scanned by default.
  state = assembly.init_state(setup, seed=0)
  batches = setup.data.train_iter(0, None)
  step = steps.jit_train_step(setup)
  losses = []
  with train.sharding.activate(setup.mesh, setup.rules):
    for _ in range(3):
      local, _ = next(batches)
      state, metrics = step(state, assembly.device_batch(setup, local), jax.random.key(1))
      losses.append(float(metrics['loss']))
  setup.data.close()
  assert int(state.step) == 3 and np.all(np.isfinite(losses))


def test_new_variant_decodes_through_its_pattern_and_is_inspected(tmp_path):
  cfg = transformer.TransformerConfig.from_config(
      {'vocab_size': 16, 'd_model': 16, 'n_heads': 2, 'n_layers': 2, 'max_len': 12,
       'attention': NAME, 'attention_options': {NAME: {'test_dilation': 2}}})
  model = transformer.Decoder(cfg)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 16, (2, 12)), jnp.int32)
  params = jax.jit(model.init)(jax.random.key(0), tokens)['params']  # Jitted: op by op was slower.
  full = jax.jit(model.apply)({'params': params}, tokens)
  cache = decode.init_cache(model, params, 2)
  step = jax.jit(lambda c, token, t: decode.step(model, params, c, token, t))
  out = []
  for t in range(12):
    logits, cache = step(cache, tokens[:, t], t)
    out.append(logits)
  np.testing.assert_allclose(jnp.stack(out, 1), full, atol=2e-5, rtol=2e-5)
  # The cache keeps what the pattern can still reach: (w - 1) r + 1 = 5 keys, not 12.
  assert cache['blocks']['attention']['key'].shape[3] == 5  # (layers, b, h, capacity, d)
  masks = attention_maps.connectivity(cfg, 12)
  np.testing.assert_array_equal(masks['layer1_head0'],
                                patterns.mask(DilatedWindow(3, 2), 12))


def test_new_variant_runs_every_kernel_of_its_pattern():
  """Defining head_pattern is enough: 'auto' (the CPU kernel here, where it builds) and
  'blocksparse' compute the pattern and equal the 'xla' reference, and the per-layer log names
  the kernel that runs. The three models share one set of params (the implementation adds
  none), initialized once; each forward is one jitted program."""
  logits, params = {}, None
  for impl in ('xla', 'blocksparse', 'auto'):
    cfg = transformer.TransformerConfig.from_config(
        {'vocab_size': 16, 'd_model': 32, 'n_heads': 2, 'n_layers': 2, 'max_len': 24,
         'attention': NAME, 'attention_impl': impl,
         'attention_options': {NAME: {'test_dilation': 2}}})
    names = transformer.implementations(cfg)
    assert names == [names[0]] * 2 and names[0] != 'auto'
    if impl != 'auto':
      assert names[0] == impl
    model = transformer.Decoder(cfg)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 16, (2, 24)), jnp.int32)
    if params is None:
      params = jax.jit(model.init)(jax.random.key(0), tokens)['params']
    logits[impl] = jax.jit(model.apply)({'params': params}, tokens)
  for impl in ('blocksparse', 'auto'):
    np.testing.assert_allclose(logits[impl], logits['xla'], atol=2e-5, rtol=2e-5)
