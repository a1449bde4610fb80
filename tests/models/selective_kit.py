"""Small selective-attention models and shared parameters for the selective tests."""

import jax

from models import transformer

# Its options (config.model.attention_options.selective) with every constraint switch on.
ALL_ON = dict(shift=True, relu=True, mask_bos=True, mask_diag=True)


def model(max_len=24, impl='xla', **opts):
  """A 2-layer selective model; `opts`: its own options (bare names, e.g. budgets=(4, 6))."""
  cfg = transformer.TransformerConfig.from_config(dict(
      d=0, d_model=32, n_heads=2, n_layers=2, vocab_size=40, max_len=max_len,
      attention='selective', attention_impl=impl, attention_block_size=8,
      attention_options={'selective': {**ALL_ON, **opts}}))
  return transformer.Decoder(cfg)


def forward(model, params, tokens, **kw):
  return jax.jit(lambda p, t: model.apply({'params': p}, t, **kw))(params, tokens)


_PARAMS = {}


def params(model, tokens):
  """Parameters shared by the tests (one init per parameter structure: it compiles slowly)."""
  key = model.config.options_of('selective')['separate_bilinear']
  if key not in _PARAMS:
    fresh = jax.jit(model.init)(jax.random.key(0), tokens[:, :8])['params']
    # Larger q/k weights make head 0 select strongly (F of order 1-10), as a trained model does.
    _PARAMS[key] = jax.tree_util.tree_map_with_path(
        lambda p, a: a * 4 if 'qkv' in jax.tree_util.keystr(p) else a, fresh)
  return _PARAMS[key]
