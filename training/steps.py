"""The train and eval steps: pure functions of (state or params, batch), and their sharded,
jitted forms for a Setup (training/state.py, built by training/assembly.py)."""

from __future__ import annotations


import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from models import transformer
from models.attention import memory as segment_memory
from training import losses, sharding
from training.state import Setup, TrainState

Batch = dict[str, jax.Array]


def sum_collection(tree) -> jax.Array:
  """Sum of every element of a sown collection ('losses'): the auxiliary loss."""
  return sum((jnp.sum(x) for x in jax.tree.leaves(tree)), jnp.zeros((), jnp.float32))


def sown_metrics(tree) -> dict[str, jax.Array]:
  """The 'metrics' collection as flat scalars named '<name>/<layer path>' (e.g.
  'span_max/block_3'); values sown several times are averaged."""
  out = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(
      tree, is_leaf=lambda x: isinstance(x, tuple))[0]:
    keys = [getattr(k, 'key', str(k)) for k in path]
    name = f'{keys[-1]}/{"/".join(k for k in keys[:-1] if k != "attention")}'
    values = jnp.stack([jnp.asarray(v, jnp.float32) for v in leaf])
    if values.ndim > 1:  # Scanned layers: one value per layer.
      for i, v in enumerate(jnp.moveaxis(values, 1, 0)):
        out[f'{name}_{i}'] = jnp.mean(v)
    else:
      out[name] = jnp.mean(values)
  return out


def _rngs(model: nn.Module, rng):
  """{stream: key} for the model's random streams ('dropout' gets `rng` itself)."""
  if rng is None:
    return None
  streams = transformer.rng_streams(model.config)
  return {name: rng if name == 'dropout' else jax.random.fold_in(rng, i)
          for i, name in enumerate(streams)}


def forward_sums(model: nn.Module, params, batch: Batch, *, train: bool, rng=None,
                 loss_chunk_len: int = 128, memory=None):
  """Runs the model on a batch.

  Args:
    model: the Decoder.
    params: its parameters.
    batch: dict with 'inputs', 'targets', 'weights', 'positions' and 'segment_ids'.
    train: enables dropout (with `rng`).
    rng: key of the training randomness: 'dropout' gets it, and every other stream the
      variants draw from (transformer.rng_streams) a key folded from it.
    loss_chunk_len: sequence positions per chunk of the fused projection + cross-entropy.
    memory: the 'memory' collection of segment-recurrent attention, or None/{}.

  Returns:
    (sums, aux, extra): sums has 'loss_sum' (weighted cross-entropy), 'correct_sum' and
    'weight_sum'; aux is the sum of the 'losses' collection; extra has 'metrics' (the sown
    'metrics' collection, flattened) and 'memory' (the updated memory, {} without).
  """
  variables = {'params': params}
  mutable = ['losses', 'metrics']
  if memory:
    variables['memory'] = memory
    mutable.append('memory')
  (hidden, w_out), mutated = model.apply(
      variables, batch['inputs'], positions=batch['positions'],
      segment_ids=batch['segment_ids'], deterministic=not train, return_hidden=True,
      rngs=_rngs(model, rng), mutable=mutable)
  loss_sum, correct_sum = losses.linear_cross_entropy(
      hidden, w_out, batch['targets'], batch['weights'], loss_chunk_len)
  sums = {'loss_sum': loss_sum, 'correct_sum': correct_sum,
          'weight_sum': jnp.sum(batch['weights'])}
  extra = {'metrics': sown_metrics(mutated.get('metrics', {})),
           'memory': mutated.get('memory', {}) if memory else {}}
  return sums, sum_collection(mutated.get('losses', {})), extra


def make_train_step(model: nn.Module, tx: optax.GradientTransformation, schedule,
                    grad_accum_steps: int = 1, loss_chunk_len: int = 128):
  """Builds train_step(state, batch, rng) -> (state, metrics).

  The objective is mean cross-entropy over the scored positions of the whole batch plus the
  auxiliary losses sown into 'losses'. With gradient accumulation the batch is split into
  micro-batches whose gradients are summed; each micro-batch's cross-entropy is divided by
  the weight of the whole batch, so the update equals the one-shot update up to float
  rounding.

  Args:
    model: the Decoder.
    tx: the optimizer.
    schedule: step -> learning rate (for logging).
    grad_accum_steps: number of micro-batches.
    loss_chunk_len: sequence positions per chunk of the fused projection + cross-entropy.

  Returns:
    The un-jitted step function.
  """

  def train_step(state: TrainState, batch: Batch, rng: jax.Array):
    rng = jax.random.fold_in(rng, state.step)
    total_weight = jnp.maximum(jnp.sum(batch['weights']), 1.0)

    def micro_loss(params, micro, micro_rng, memory=None):
      sums, aux, extra = forward_sums(model, params, micro, train=True, rng=micro_rng,
                                      loss_chunk_len=loss_chunk_len, memory=memory)
      objective = sums['loss_sum'] / total_weight + aux / grad_accum_steps
      return objective, (sums, aux, extra)

    grad_fn = jax.value_and_grad(micro_loss, has_aux=True)
    extra = {'metrics': {}, 'memory': {}}
    if grad_accum_steps == 1:
      (_, (sums, aux, extra)), grads = grad_fn(state.params, batch, rng, state.memory)
    else:
      if state.memory:
        raise ValueError('segment memory needs '
                         'grad_accum_steps=1: micro-batches would split the streams')
      micro_batches = jax.tree.map(
          lambda x: x.reshape((grad_accum_steps, -1) + x.shape[1:]), batch)

      def accumulate(carry, xs):
        micro, i = xs
        (_, (s, a, _)), g = grad_fn(state.params, micro, jax.random.fold_in(rng, i))
        return jax.tree.map(jnp.add, carry, (g, s, a)), None

      zero = jnp.zeros((), jnp.float32)
      zeros = (jax.tree.map(jnp.zeros_like, state.params),
               {'loss_sum': zero, 'correct_sum': zero, 'weight_sum': zero}, zero)
      (grads, sums, aux), _ = jax.lax.scan(
          accumulate, zeros, (micro_batches, jnp.arange(grad_accum_steps)))
      aux = aux / grad_accum_steps

    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    loss = sums['loss_sum'] / total_weight
    metrics = {
        'loss': loss,
        'aux_loss': aux,
        'accuracy': sums['correct_sum'] / total_weight,
        'grad_norm': optax.tree.norm(grads),
        'learning_rate': schedule(state.step),
        'scored_tokens': sums['weight_sum'],
        **extra['metrics'],
    }
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state,
                         memory=extra['memory']), metrics

  return train_step


def make_eval_step(model: nn.Module, loss_chunk_len: int = 128):
  """Builds eval_step(params, batch, memory) -> (summed loss, correct and weight; memory).

  `memory` is the segment memory carried from the previous eval batch ({} without)."""

  def eval_step(params, batch: Batch, memory):
    sums, _, extra = forward_sums(model, params, batch, train=False,
                                  loss_chunk_len=loss_chunk_len, memory=memory)
    return sums, extra['memory']

  return eval_step


def jit_train_step(setup: Setup, model: transformer.Decoder | None = None):
  """The sharded, donated train step of `model` (default `setup.model`)."""
  fn = make_train_step(model or setup.model, setup.tx, setup.schedule,
                             setup.config.grad_accum_steps, setup.config.loss_chunk_len)
  replicated = jax.sharding.NamedSharding(setup.mesh, jax.sharding.PartitionSpec())
  return jax.jit(fn, in_shardings=(setup.state_sharding, setup.batch_sharding, replicated),
                 out_shardings=(setup.state_sharding, replicated), donate_argnums=(0,))


class EvalStep:
  """The sharded eval step of a model, (params, batch, memory) -> (sums, memory), with the
  layout of the segment memory it carries (its own when evaluation uses other options, e.g.
  Transformer-XL's eval_mem_len).

  Attributes:
    model: the Decoder it evaluates (transformer.for_eval of the trained one).
    memory: abstract memory (shapes, dtypes, shardings) for one eval batch, or None.
  """

  def __init__(self, setup: Setup, model: transformer.Decoder):
    self.model = model
    self.memory = memory_layout(setup, model)
    replicated = jax.sharding.NamedSharding(setup.mesh, jax.sharding.PartitionSpec())
    memory = (jax.tree.map(lambda a: a.sharding, self.memory) if self.memory is not None
              else replicated)
    self._fn = jax.jit(make_eval_step(model, setup.config.loss_chunk_len),
                       in_shardings=(setup.state_sharding.params, setup.batch_sharding, memory),
                       out_shardings=(replicated, memory))

  def __call__(self, params, batch, memory):
    return self._fn(params, batch, memory)

  def fresh_memory(self, setup: Setup, rows: int):
    """Empty memory for `rows` eval rows ({} for models without memory)."""
    if self.memory is None:
      return {}
    if rows != setup.config.batch_size:
      raise ValueError(f'segment memory is laid out for batch_size={setup.config.batch_size} '
                       f'rows; set eval_batch_size to the same ({rows} given)')
    return jax.tree.map(jax.device_put, segment_memory.fresh(self.memory),
                        jax.tree.map(lambda a: a.sharding, self.memory))


def jit_eval_step(setup: Setup, model: transformer.Decoder | None = None) -> EvalStep:
  """The sharded eval step of `model` (default `setup.model`), with the option values its
  variants use at evaluation (transformer.for_eval)."""
  model = model or setup.model
  config = transformer.for_eval(model.config)
  return EvalStep(setup, model if config == model.config else transformer.Decoder(config))


def memory_layout(setup: Setup, model: transformer.Decoder):
  """Abstract segment memory of `model` for one batch (shapes, dtypes and shardings), or
  None for a model without memory."""
  if not model.config.uses_memory:
    return None
  if model.config == setup.model_config:
    return setup.abstract_state.memory
  boxed = jax.eval_shape(lambda rng: model.init(
      rng, jnp.zeros((setup.config.batch_size, setup.seq_len), jnp.int32)),
      jax.random.key(0))['memory']
  shardings = sharding.logical_shardings(boxed, setup.mesh, setup.rules)
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                      nn.unbox(boxed), shardings)


def fresh_memory(setup: Setup, rows: int):
  """Empty training segment memory for `rows` batch rows ({} for models without memory)."""
  if not setup.model_config.uses_memory:
    return {}
  if rows != setup.config.batch_size:
    raise ValueError(f'segment memory is laid out for batch_size={setup.config.batch_size} '
                     f'rows; set eval_batch_size to the same ({rows} given)')
  abstract = setup.abstract_state.memory
  return jax.tree.map(jax.device_put, segment_memory.fresh(abstract),
                      jax.tree.map(lambda a: a.sharding, abstract))
