"""Backbone layers: RMSNorm, SwiGLU, embeddings and learned absolute positions.

Every parameter carries logical axis names (`nn.with_logical_partitioning`); the
training code maps them onto the device mesh with the rule table in the config.
"""

import contextlib
import contextvars
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

Dtype = Any

default_kernel_init = nn.initializers.variance_scaling(1.0, 'fan_in', 'truncated_normal')
default_embed_init = nn.initializers.normal(stddev=0.02)


class RMSNorm(nn.Module):
  """Root-mean-square layer norm (Zhang & Sennrich, 2019), no bias.

  Attributes:
    epsilon: added to the mean square before the square root.
    dtype: computation dtype; the statistic is always computed in float32.
    param_dtype: dtype of the scale parameter.
    axis_name: logical name of the normalized axis.
  """
  epsilon: float = 1e-6
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32
  axis_name: str = 'norm'

  @nn.compact
  def __call__(self, x):
    scale = self.param('scale', nn.with_logical_partitioning(nn.initializers.ones, (self.axis_name,)),
                       (x.shape[-1],), self.param_dtype)
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.epsilon)
    return (y * scale.astype(jnp.float32)).astype(self.dtype)


@contextlib.contextmanager
def _raised(flag: contextvars.ContextVar):
  """`flag` is True within it (as traced: the model code below reads it while tracing)."""
  token = flag.set(True)
  try:
    yield
  finally:
    flag.reset(token)


_DECODING = contextvars.ContextVar('decoding_matmuls', default=False)
_SCANNED = contextvars.ContextVar('scanned_layers', default=False)


def decoding_matmuls():
  """Within it, `matmul` runs decoding's few-row products on the CPU kernel that streams the
  weights once (cpu_kernel.skinny_matmul; forward only). models/decode.py traces each
  decoding step inside it."""
  return _raised(_DECODING)


def decoding() -> bool:
  """Whether this is traced inside `decoding_matmuls`."""
  return _DECODING.get()


def scanned_layers():
  """Within it, the layers traced are the body of a loop over layers (the scanned stacks of
  models/stacks.py): `scanned()` is True."""
  return _raised(_SCANNED)


def scanned() -> bool:
  """Whether this is traced inside `scanned_layers`."""
  return _SCANNED.get()


def mesh_splits(logical_axis: str) -> int:
  """How many ways the mesh and logical axis rules in force (training/sharding.activate)
  split `logical_axis`: 1 outside a mesh or where the rules leave the axis whole."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return 1
  axes = nn.logical_to_mesh_axes((logical_axis,))[0]
  if not axes:
    return 1
  axes = (axes,) if isinstance(axes, str) else axes
  return math.prod(mesh.shape.get(a, 1) for a in axes if isinstance(a, str))


def can_flatten(logical_axis: str) -> bool:
  """Whether a (d, parts, n) kernel whose n axis is `logical_axis` may run as one 2-D
  (d, parts * n) matmul. On one device that is the fast form (XLA makes no transposed copies).
  With n split over devices, each device's columns of the flat kernel are not contiguous, so
  GSPMD would all-gather the kernel (and the activations) in every step: there the 3-D
  einsum keeps the Megatron layout (column-parallel in, an all-reduce after row-parallel out)."""
  return mesh_splits(logical_axis) == 1


def matmul(x, w, preferred_element_type=None):
  """x (M, K) . w (K, N): jnp.dot, or, inside `decoding_matmuls`, cpu_kernel.skinny_matmul
  (the kernel for a few float32 rows on CPU, jnp.dot otherwise)."""
  if _DECODING.get():
    from models.attention import cpu_kernel  # pylint: disable=import-outside-toplevel
    return cpu_kernel.skinny_matmul(x, w, preferred_element_type)
  return jnp.dot(x, w, preferred_element_type=preferred_element_type)


@jax.custom_vjp
def swiglu_activation(h):
  """silu(gate) * up for h = (..., 2, hidden) holding [gate, up].

  Same values and gradients as autodiff; the hand-written backward writes d(gate) and d(up)
  in one pass instead of padding and adding two slice gradients (about 8% off the SwiGLU
  block's forward+backward on CPU).
  """
  return nn.silu(h[..., 0, :]) * h[..., 1, :]


def _swiglu_fwd(h):
  return swiglu_activation(h), h


def _swiglu_bwd(h, dy):
  gate, up = h[..., 0, :], h[..., 1, :]
  sig = jax.nn.sigmoid(gate)
  silu = gate * sig
  # d silu(g)/dg = sigmoid(g) + g sigmoid(g) (1 - sigmoid(g)).
  return (jnp.stack([dy * up * (sig + silu * (1 - sig)), dy * silu], axis=-2),)


swiglu_activation.defvjp(_swiglu_fwd, _swiglu_bwd)


@jax.custom_vjp
def swiglu_mlp(x, w_in, w_out):
  """W_o (silu(x W_g) * (x W_u)) for x (..., d), w_in (d, 2, hidden), w_out (hidden, d).

  Same values and gradients as autodiff of the einsum form. The hand-written backward forms
  d(h) once, in its natural (tokens, 2, hidden) layout, and never transposes it: d(x) is a
  2-D matmul against the (small) transposed kernel and the weight gradients contract the
  tokens axis of x and d(y). Autodiff's form wrote d(h) twice (once transposed for the
  kernel gradient) and transposed the kernel gradient back; about 7% off the d=4 step.
  """
  return _swiglu_mlp_fwd(x, w_in, w_out)[0]


def _swiglu_mlp_fwd(x, w_in, w_out):
  d = x.shape[-1]
  x2 = x.reshape(-1, d)
  if can_flatten('mlp'):
    h = matmul(x2, w_in.reshape(d, -1)).reshape(x2.shape[0], *w_in.shape[1:])
  else:
    h = jnp.einsum('nd,dgf->ngf', x2, w_in)
  act = nn.with_logical_constraint(nn.silu(h[:, 0]) * h[:, 1], ('batch', 'mlp'))
  return matmul(act, w_out).reshape(x.shape[:-1] + (w_out.shape[-1],)), (x2, w_in, w_out, h, act)


def _swiglu_mlp_bwd(residuals, dy):
  x2, w_in, w_out, h, act = residuals
  n, d = x2.shape
  dy2 = dy.reshape(n, -1)
  gate, up = h[:, 0], h[:, 1]
  sig = jax.nn.sigmoid(gate)
  silu = gate * sig
  dact = jnp.dot(dy2, w_out.T)
  # d silu(g)/dg = sigmoid(g) + g sigmoid(g) (1 - sigmoid(g)).
  d_gate, d_up = dact * up * (sig + silu * (1 - sig)), dact * silu
  if can_flatten('mlp'):
    # Each part's products on its own, as 2-D matmuls: d(h) stacked as (tokens, 2, hidden)
    # was written once more (the 3-D einsum form wrote it twice, once transposed). The
    # selective C4 recipe's step on v5e (data-parallel): 230 -> 207 ms by the estimate.
    dx = jnp.dot(d_gate, w_in[:, 0].T) + jnp.dot(d_up, w_in[:, 1].T)
    dw_in = jnp.stack([jnp.dot(x2.T, d_gate), jnp.dot(x2.T, d_up)], axis=1)
  else:
    # The hidden axis split over devices (Megatron layout): the stacked d(h) and 3-D
    # einsums, which GSPMD partitions better here. The default config's dense step compiled
    # for v5e:2x2 with tensor=2 took 31.9 ms and 5.13 GiB by the estimate so, 34.9 ms and
    # 5.22 GiB per part (python -m benchmarks.pallas_bar).
    dh = jnp.stack([d_gate, d_up], axis=1)
    dx = jnp.einsum('ngf,dgf->nd', dh, w_in)
    dw_in = jnp.einsum('nd,ngf->dgf', x2, dh)
  dw_out = jnp.dot(act.T, dy2)
  return dx.reshape(dy.shape[:-1] + (d,)), dw_in, dw_out


swiglu_mlp.defvjp(_swiglu_mlp_fwd, _swiglu_mlp_bwd)


def chunked_swiglu_mlp(x, w_in, w_out, chunk_len: int):
  """swiglu_mlp over chunks of `chunk_len` positions (Reformer's chunked feed-forward,
  Kitaev et al. 2020): the (tokens, 2, hidden) activation exists for one chunk at a time,
  in the forward and in the backward pass.

  The chunks run in a lax.map of a jax.checkpoint'ed chunk function, so the backward pass
  keeps only each chunk's input and recomputes its hidden activation. A length that is not a
  multiple of `chunk_len` is padded with zeros (SwiGLU(0) = 0) and the padding cut off.

  Args:
    x: (batch, length, d) inputs.
    w_in: (d, 2, hidden) gate and up kernels.
    w_out: (hidden, d) output kernel.
    chunk_len: positions per chunk (>= 1).

  Returns:
    (batch, length, d) outputs, equal to swiglu_mlp(x, w_in, w_out).
  """
  b, n, d = x.shape
  chunks = -(-n // chunk_len)
  x = jnp.pad(x, ((0, 0), (0, chunks * chunk_len - n), (0, 0)))
  xs = x.reshape(b, chunks, chunk_len, d).swapaxes(0, 1)   # (chunks, batch, chunk_len, d)
  ys = jax.lax.map(jax.checkpoint(lambda xc: swiglu_mlp(xc, w_in, w_out)), xs)
  return ys.swapaxes(0, 1).reshape(b, chunks * chunk_len, -1)[:, :n]


class SwiGLU(nn.Module):
  """Gated feed-forward block (Shazeer, 2020): W_o (silu(x W_g) * (x W_u)), no biases.

  Attributes:
    hidden_dim: width of the gated hidden layer.
    dtype: computation dtype.
    param_dtype: parameter dtype.
    chunk_len: positions per chunk of a (batch, length, d) input (chunked_swiglu_mlp); 0, or a
      length no longer than it, computes all positions at once.
  """
  hidden_dim: int
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32
  chunk_len: int = 0

  @nn.compact
  def __call__(self, x):
    d_model = x.shape[-1]
    # Gate and up projections as one kernel: one matmul instead of two.
    w_in = self.param('wi', nn.with_logical_partitioning(
        default_kernel_init, ('embed', 'gate', 'mlp')), (d_model, 2, self.hidden_dim), self.param_dtype)
    w_out = self.param('wo', nn.with_logical_partitioning(default_kernel_init, ('mlp', 'embed')),
                       (self.hidden_dim, d_model), self.param_dtype)
    x, w_in, w_out = x.astype(self.dtype), w_in.astype(self.dtype), w_out.astype(self.dtype)
    if self.chunk_len and x.ndim == 3 and x.shape[1] > self.chunk_len:
      return chunked_swiglu_mlp(x, w_in, w_out, self.chunk_len)
    if _DECODING.get():  # Forward only, traced here: not through the custom VJP's caches.
      return _swiglu_mlp_fwd(x, w_in, w_out)[0]
    return swiglu_mlp(x, w_in, w_out)


class Embed(nn.Module):
  """Token embedding table; its transpose is the output projection when tied.

  Attributes:
    num_embeddings: vocabulary size.
    features: embedding width (d_model).
    dtype: computation dtype.
    param_dtype: parameter dtype.
  """
  num_embeddings: int
  features: int
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32

  def setup(self):
    self.embedding = self.param(
        'embedding', nn.with_logical_partitioning(default_embed_init, ('vocab', 'embed')),
        (self.num_embeddings, self.features), self.param_dtype)

  def __call__(self, ids):
    return jnp.take(self.embedding, ids, axis=0).astype(self.dtype)


class LearnedPositions(nn.Module):
  """Learned absolute position embeddings (the selective-attention backbone).

  Attributes:
    max_len: size of the position table; longer inputs are rejected at config time.
    features: embedding width.
    dtype: computation dtype.
    param_dtype: parameter dtype.
  """
  max_len: int
  features: int
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, positions):
    table = self.param('pos_embedding', nn.with_logical_partitioning(
        default_embed_init, ('length_table', 'embed')),
        (self.max_len, self.features), self.param_dtype)
    return jnp.take(table, positions, axis=0).astype(self.dtype)


def add_at_scale(x, signal):
  """x + rms(x) signal, per position (the RMS over the features, float32), in x's dtype.

  How a fixed sinusoid joins a stream of any scale at the ratio Vaswani et al. (2017) had:
  their embeddings, multiplied by sqrt(d_model), and the sinusoid both have RMS about 1.
  Here the token embedding starts at std 0.02 and the universal stack's state grows from step
  to step; added as is, the sinusoid would outweigh the tokens 50 to 1 at first.
  """
  x32 = x.astype(jnp.float32)
  scale = jnp.sqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True))
  return (x32 + scale * signal).astype(x.dtype)


def sinusoid(positions, features: int):
  """The sinusoidal signal of Vaswani et al. (2017) at integer `positions` (any shape):
  (..., features) float32 with sin(i / 10000^(2k/features)) at feature 2k and the cosine at
  2k + 1 (interleaved, as the Universal Transformer's coordinate embedding writes it).

  Args:
    positions: integer array (e.g. token positions, or a recurrent step number).
    features: width of the signal.
  """
  k = jnp.arange((features + 1) // 2, dtype=jnp.float32)
  angles = jnp.asarray(positions, jnp.float32)[..., None] / (10000.0 ** (2 * k / features))
  signal = jnp.stack([jnp.sin(angles), jnp.cos(angles)], axis=-1)
  return signal.reshape(*signal.shape[:-2], -1)[..., :features]
