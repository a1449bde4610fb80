"""Training a stack of reversible layers without storing its activations (Gomez et al. 2017).

Layer i of model.residual='reversible' (models/residual.py Reversible) maps the pair (x1, x2) to

  y1 = x1 + F(x2),   y2 = x2 + G(y1)        F = attention sublayer, G = feed-forward sublayer

and its input follows from its output:

  x2 = y2 - G(y1),   x1 = y1 - F(x2).

`run` applies every layer of the stack inside one jax.custom_vjp. Its forward keeps only the
last layer's (y1, y2), besides the parameters, the rng keys and the other inputs it was given,
so the memory a training step needs does not grow with depth. Its backward walks the layers in
reverse; at layer i, from (y1, y2) and their cotangents (dy1, dy2):

  G(y1) and its vjp        ->  x2 = y2 - G(y1),  dy1 += dG/dy1^T dy2
  F(x2) and its vjp        ->  x1 = y1 - F(x2),  dx2 = dy2 + dF/dx2^T dy1,  dx1 = dy1

and the parameter cotangents of F and G, so each sublayer's forward runs once more in the
backward pass (the recompute; TransformerConfig.train_flops_per_token does not count it).
A custom_vjp around each layer alone would not do: autodiff would store every layer's output.

The layers run as the stack lays them out (Stack.cycle): `repeats` applications of a cycle
of p layers, the repeats under lax.scan with the cycle unrolled in its body (unrolled: one
repeat of all layers; scan: n_layers repeats of one; scan_cycle: n_layers / p repeats of p),
so a scanned stack compiles one layer, forward and backward, and its stacked parameters are
never sliced. Each layer is the Reversible module applied functionally to its parameters.

What the layer needs besides its parameters:
- rng keys: the Decoder draws one key per stream (dropout, and the variants' own such as LSH's
  rotations) and layer i folds in i. The forward and the recompute use the same keys, and F
  and G alone draw what they draw inside the whole layer (their modules are named), so every
  dropout mask and LSH bucketing of the backward pass is the forward's.
- shared attention parameters (LayerContext.shared, e.g. Transformer-XL's u, v): an input of
  the custom_vjp; their cotangent sums every layer's.
- sown collections: each layer's 'losses' (adaptive span's L1 penalty, selective's L_mem) and
  'metrics' are outputs, laid out as the stack would sow them. The losses' cotangents reach
  F and G in the backward pass, so auxiliary losses train as with autodiff; metrics get none.
- other collections the Decoder was given (e.g. selective's read-only 'pruning' budgets):
  each layer reads its part. Segment memory is refused at config time (Reversible.check).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from models import residual, stacks

# Collections a layer sows that `run` returns (laid out like the parameters).
SOWN = ('losses', 'metrics')


def run(config, params, carry, ctx: residual.LayerContext, keys: dict, reads: dict, *,
        custom_vjp: bool = True):
  """Applies the reversible stack to `carry`, with the backward pass that rebuilds inputs.

  Args:
    config: the model's TransformerConfig (model.residual='reversible').
    params: the model's parameters (unboxed); the stack's layers are read from them.
    carry: (x1, x2), each (batch, length, d_model) float32.
    ctx: the layer context (decode False; its flags are static).
    keys: {stream: key}: one key per rng stream the layers draw from; layer i gets
      fold_in(key, i). {} when nothing is random.
    reads: {collection: tree laid out like the parameters}: other variables the layers read
      (not written).
    custom_vjp: False differentiates the same layers by plain autodiff, storing every
      layer's activations (the reference the tests compare the backward pass with).

  Returns:
    ((y1, y2), {collection: tree}): the last layer's output, and the SOWN collections laid out
    like the parameters ({} where nothing was sown).
  """
  if ctx.decode:
    raise ValueError('the reversible backward pass is for full sequences: decoding runs the '
                     'layers as modules (Decoder with decode=True)')
  stack = stacks.of(config)
  repeats, p = stack.cycle(config)
  places = lambda tree: [stack.cycle_tree(config, tree, k) for k in range(p)]
  side = (ctx.positions, ctx.segment_ids, keys)
  fn = _stack_fn(config, ctx.deterministic, repeats, p, custom_vjp)
  carry, sown = fn(places(params), ctx.shared, carry, side,
                   {c: places(tree) for c, tree in reads.items()})
  return carry, {c: stack.from_cycle_trees(config, [s[c] for s in sown]) for c in SOWN}


def _apply(config, deterministic, k, i, half, params, shared, inputs, side, reads):
  """Layer i (place k of the cycle) applied to `inputs`: the whole layer (half None) or F or G
  alone. Returns (output, {collection: sown tree} for SOWN)."""
  positions, segment_ids, keys = side
  ctx = residual.LayerContext(positions=positions, segment_ids=segment_ids, shared=shared,
                              deterministic=deterministic)
  layer = residual.get(config.residual)(config, config.attention[k], layer_index=k, parent=None)
  rngs = {stream: jax.random.fold_in(key, i) for stream, key in keys.items()}
  out, sown = layer.apply({'params': params, **reads}, inputs, ctx, half=half, rngs=rngs,
                          mutable=list(SOWN))
  return out, {c: dict(sown.get(c, {})) for c in SOWN}


def _paired_sum(tree, weights) -> jax.Array:
  """sum over the leaves of `tree` of <leaf, the leaf of `weights` at the same path>."""
  by_path = {jax.tree_util.keystr(path): w
             for path, w in jax.tree_util.tree_flatten_with_path(weights)[0]}
  total = jnp.zeros((), jnp.float32)
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    total += jnp.sum(leaf.astype(jnp.float32) * by_path[jax.tree_util.keystr(path)])
  return total


def _zero_cotangent(a):
  """The zero cotangent of an input: zeros for floats, float0 for integers and keys."""
  if jnp.issubdtype(a.dtype, jnp.inexact):
    return jnp.zeros_like(a)
  return np.zeros(a.shape, jax.dtypes.float0)


def _add(a, b):
  return jax.tree.map(jnp.add, a, b)


def _stack_fn(config, deterministic: bool, repeats: int, p: int, custom_vjp: bool = True):
  """The custom_vjp (place_params, shared, carry, side, place_reads) -> (carry, sown per place)
  of the stack's layers (see the module docstring); the plain forward when not `custom_vjp`.
  side = (positions, segment_ids, keys); place_params and place_reads hold one tree per place
  of the cycle, with the repeats on a leading axis."""

  def layer_reads(reads_r, k):
    return {c: trees[k] for c, trees in reads_r.items()}

  def forward(place_params, shared, carry, side, place_reads):
    def body(carry, xs):
      r, params_r, reads_r = xs
      sown_r = []
      for k in range(p):
        carry, sown = _apply(config, deterministic, k, r * p + k, None, params_r[k], shared,
                             carry, side, layer_reads(reads_r, k))
        sown_r.append(sown)
      return carry, sown_r

    return jax.lax.scan(body, carry, (jnp.arange(repeats), place_params, place_reads))

  if not custom_vjp:
    return forward

  def layer_backward(k, i, params, shared, y, dy, dlosses, side, reads):
    """Layer i's input from its output y, and the cotangents of its input, parameters and
    shared parameters from those of its output (dy) and of its sown losses (dlosses)."""
    (y1, y2), (dy1, dy2) = y, dy

    def sublayer(half):
      def fn(params, shared, a):
        out, sown = _apply(config, deterministic, k, i, half, params, shared, a, side, reads)
        return out.astype(a.dtype), _paired_sum(sown['losses'], dlosses)
      return fn

    # x2 = y2 - G(y1); the losses G sows weigh in through their cotangents (the 1.0 below).
    (g, _), g_vjp = jax.vjp(sublayer('mlp'), params, shared, y1)
    x2 = y2 - g
    # x1 = y1 - F(x2).
    (f, _), f_vjp = jax.vjp(sublayer('attention'), params, shared, x2)
    x1 = y1 - f
    one = jnp.ones((), jnp.float32)
    dparams_g, dshared_g, dy1_g = g_vjp((dy2, one))
    dy1 = dy1 + dy1_g
    dparams_f, dshared_f, dx2_f = f_vjp((dy1, one))
    return ((x1, x2), (dy1, dy2 + dx2_f), _add(dparams_f, dparams_g),
            _add(dshared_f, dshared_g))

  @jax.custom_vjp
  def stack_fn(place_params, shared, carry, side, place_reads):
    return forward(place_params, shared, carry, side, place_reads)

  def stack_fwd(place_params, shared, carry, side, place_reads):
    out = forward(place_params, shared, carry, side, place_reads)
    # Only the last layer's output is kept: every other layer's input is rebuilt from it.
    return out, (place_params, shared, out[0], side, place_reads)

  def stack_bwd(residuals, cotangents):
    place_params, shared, y, side, place_reads = residuals
    dy, dsown = cotangents
    dlosses = [d['losses'] for d in dsown]

    def body(state, xs):
      y, dy, dshared = state
      r, params_r, reads_r, dlosses_r = xs
      dparams_r = [None] * p
      for k in reversed(range(p)):
        y, dy, dparams_r[k], dsh = layer_backward(
            k, r * p + k, params_r[k], shared, y, dy, dlosses_r[k], side,
            layer_reads(reads_r, k))
        dshared = _add(dshared, dsh)
      return (y, dy, dshared), dparams_r

    init = (y, dy, jax.tree.map(jnp.zeros_like, shared))
    (_, dx, dshared), dparams = jax.lax.scan(
        body, init, (jnp.arange(repeats), place_params, place_reads, dlosses), reverse=True)
    return (dparams, dshared, dx, jax.tree.map(_zero_cotangent, side),
            jax.tree.map(_zero_cotangent, place_reads))

  stack_fn.defvjp(stack_fwd, stack_bwd)
  return stack_fn
