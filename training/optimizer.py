"""AdamW with linear warm-up and cosine decay, global-norm clipping and a decay mask."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax


def make_schedule(config) -> optax.Schedule:
  """Linear warm-up from 0 to `learning_rate`, then cosine decay to `end_learning_rate_fraction`.

  Args:
    config: the run config (learning_rate, warmup_steps, total_steps, end_learning_rate_fraction).

  Returns:
    step -> learning rate.
  """
  warmup = min(config.warmup_steps, config.total_steps)
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=config.learning_rate, warmup_steps=warmup,
      decay_steps=max(config.total_steps, warmup + 1),
      end_value=config.learning_rate * config.end_learning_rate_fraction)


def _is_box(x) -> bool:
  return isinstance(x, nn.meta.AxisMetadata)


def decay_mask(abstract_params=None):
  """Weight decay on matrices only: the mask function for optax.adamw.

  A parameter is decayed when it has two or more axes besides the leading axis a scanned
  stack adds (logical name 'layers'): norm scales, GTrXL's gate bias b_g and other
  per-feature vectors are not decayed, whether their layers are unrolled or scanned (a
  scanned norm scale is (n_layers, d), two axes, yet one vector per layer).

  Args:
    abstract_params: the model's boxed parameters (nn.LogicalPartitioned leaves, as
      `Decoder.init` makes them; shapes suffice), which name each axis. None: every axis
      counts (for parameters without a layer axis).

  Returns:
    params -> a tree of bools laid out like params, boxed or not.
  """
  if abstract_params is None:
    return lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
  rank = jax.tree.map(
      lambda x: (sum(name != 'layers' for name in x.names) if _is_box(x) else len(x.shape)),
      abstract_params, is_leaf=_is_box)

  def mask(params):
    # rank is a prefix of params: a boxed parameter's subtree gets its bool inside the box.
    return jax.tree.map(lambda r, p: jax.tree.map(lambda _: r >= 2, p), rank, params,
                        is_leaf=_is_box)

  return mask


def keep_in_box(bounds: dict[str, tuple[float, float]]) -> optax.GradientTransformation:
  """Projects parameters named in `bounds` back into [lo, hi] after the update.

  The last transform of a chain: the update u of such a parameter p becomes
  clip(p + u, lo, hi) - p, so `optax.apply_updates` lands inside the box. Other parameters
  pass through untouched.

  Args:
    bounds: leaf name -> (lo, hi).

  Returns:
    A stateless GradientTransformation that needs `params` in `update`.
  """

  def update(updates, state, params=None):
    if params is None:
      raise ValueError('keep_in_box needs params')

    def project(path, u, p):
      name = getattr(path[-1], 'key', None)
      if name not in bounds:
        return u
      lo, hi = bounds[name]
      return (jnp.clip(p + u, lo, hi) - p).astype(u.dtype)

    return jax.tree_util.tree_map_with_path(project, updates, params), state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def make_optimizer(config, param_bounds: dict[str, tuple[float, float]] | None = None,
                   abstract_params=None) -> optax.GradientTransformation:
  """The optimizer of the selective-attention recipe (AdamW, beta2 0.999).

  Args:
    config: the run config.
    param_bounds: {parameter name: (lo, hi)} the variants in use keep in a box
      (models/transformer.py param_bounds, e.g. adaptive span's z' in [0, 1]).
    abstract_params: the model's boxed parameters (shapes and axis names), which say
      which parameters are matrices (decay_mask); None counts every axis.

  Returns:
    clip_by_global_norm (identity if clip_grad_norm is 0), AdamW with the schedule, then
    `keep_in_box`. Both end slots are always in the chain and hold no state, so the optimizer
    state has one layout whatever the clipping or the model: a run resumes with clipping
    turned on or off (--allow_config_change=clip_grad_norm), and every model's checkpoint
    names its Adam moments opt_state.1.*.
  """
  chain = [optax.clip_by_global_norm(config.clip_grad_norm) if config.clip_grad_norm > 0
           else optax.identity()]
  chain.append(optax.adamw(make_schedule(config), b1=config.adam_b1, b2=config.adam_b2,
                           eps=config.adam_eps, weight_decay=config.weight_decay,
                           mask=decay_mask(abstract_params)))
  chain.append(keep_in_box(param_bounds or {}))
  return optax.chain(*chain)


def without_clip_slot(opt_state):
  """`opt_state` laid out as checkpoints written without clipping before the clip slot was
  always in the chain (before issue 35): (AdamW's state, keep_in_box's), no leading slot."""
  return tuple(opt_state)[1:]


def with_clip_slot(opt_state):
  """The inverse of `without_clip_slot`: a restored old layout in today's chain."""
  return (optax.EmptyState(),) + tuple(opt_state)
