"""Which kernel computes a static pattern, and the one call to it, for every variant that has one.

A variant with a static pattern (one that overrides `head_pattern` and leaves `attend` to the
base class) only says which keys each head sees; this module decides how that is computed and
calls the kernel:

  'xla'          the dense reference: the pattern as a mask on full scores (reference.py);
  'fused'        jax.nn.dot_product_attention, for dense causal attention (reported and run
                 as 'xla' for other patterns);
  'cudnn'        the same with cuDNN's flash kernel (NVIDIA GPUs);
  'blocksparse'  plain JAX over the key blocks the pattern touches (blocksparse.py; the causal
                 blocked path for dense patterns), the same code on every platform;
  'cpu_kernel'   the fused C++ tile kernel on the same parts (cpu_kernel.py, one CPU device);
  'splash'       the Pallas TPU kernel with a lazy mask from the same pattern (splash.py),
                 under shard_map over the mesh axes that split the batch and the heads.

`choose` resolves model.attention_impl for the platform and device count of the mesh the
program is compiled for (TransformerConfig.target), never for the process's backend: a CPU
host may compile a TPU slice's program ahead of time, and a CPU-only kernel must never enter
it. Interpret mode (Pallas run as plain JAX) is only for a CPU target.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from models import options as options_lib
# pallas_kernel and pallas_gpu register the blocked engine's 'pallas' and 'pallas_gpu' kernels
# with blockloop when imported.
from models.attention import (blockloop, blocksparse, cpu_choice, cpu_kernel,  # noqa: F401
                              pallas_gpu, pallas_kernel, patterns, reference, splash)

# The options of the 'blocksparse' path of a static pattern (config.model.
# attention_options.<variant>.<name>); PatternAttention declares them, and a variant that declares
# none gets these defaults.
KEY_BLOCK, BAND_BLOCK = 16, 64


def choose(impl: str, *, variant: str, static: bool, dense: bool, head_dim: int,
           platform: str, devices: int, dtype, block_size: int) -> str:
  """The implementation a variant runs for model.attention_impl=`impl` on the target.

  'auto' picks, for a static pattern:
    tpu  'splash' (block_size a multiple of 128), else 'blocksparse';
    gpu  'cudnn' for dense causal attention where cuDNN's flash kernel runs (bf16/fp16,
         head_dim a multiple of 8 up to 128; `dense` is the layer's, so local_global's global
         layers get it), else 'blocksparse';
    cpu  'cpu_kernel' where it was measured faster than 'blocksparse' for this variant on
         this CPU (cpu_choice.py; `python -m benchmarks.cpu_choice` measures), on one device
         at a head width the kernel is built for, with a compiler; else 'blocksparse'.
  A variant without a static pattern (a learned score on the blocked engine) gets `learned`:
  'pallas' on TPU, 'blocksparse' elsewhere.
  An explicit name is checked: one that cannot run on the target raises a ValueError that says
  what to use.

  Args:
    impl: one of base.IMPLEMENTATIONS (already checked to be known).
    variant: the variant's class name, for the errors.
    static: the variant has a static pattern computed here (`has_static_pattern`).
    dense: that pattern is dense causal attention in every head (of the layer asked about).
    head_dim: width of each head.
    platform: the target's platform: 'cpu', 'gpu' or 'tpu'.
    devices: the target's device count.
    dtype: computation dtype.
    block_size: config.model.attention_block_size.

  Returns:
    A name of base.IMPLEMENTATIONS other than 'auto'.
  """
  if impl == 'auto':
    if not static:
      return learned(platform)
    if platform == 'tpu':
      return 'splash' if block_size % splash.BLOCK_MULTIPLE == 0 else 'blocksparse'
    if platform == 'gpu' and dense and cudnn_runs(head_dim, dtype):
      return 'cudnn'
    if (platform == 'cpu' and cpu_choice.kernel_is_faster(variant)
        and cpu_kernel.unusable(head_dim, platform, devices) is None):
      return 'cpu_kernel'
    return 'blocksparse'
  if impl == 'pallas':
    check_pallas(variant, platform, head_dim)
    return 'pallas'
  if impl in ('splash', 'cpu_kernel') and not static:
    raise ValueError(f'attention_impl={impl!r} computes a static pattern, and {variant} has '
                     "none: use 'auto', 'xla' or 'blocksparse'")
  if impl == 'cpu_kernel' and (why := cpu_kernel.unusable(head_dim, platform, devices)):
    raise ValueError(f"attention_impl='cpu_kernel' cannot run here: {why}. Use 'auto' (the "
                     "kernel where it was measured faster, else 'blocksparse') or 'blocksparse'")
  if impl == 'splash' and platform == 'gpu':
    raise ValueError(f"{variant}: attention_impl='splash' is a TPU kernel; on GPU use 'auto' "
                     "or 'blocksparse'")
  if impl in ('fused', 'cudnn') and static and not dense:
    if impl == 'cudnn':
      raise ValueError(f"{variant}: attention_impl='cudnn' (cuDNN's flash kernel) computes "
                       "dense causal attention only; use 'auto', 'blocksparse' or 'xla'")
    return 'xla'  # jax.nn.dot_product_attention's XLA path is the masked reference here.
  if impl == 'cudnn' and platform != 'gpu':
    raise ValueError(f"{variant}: attention_impl='cudnn' is an NVIDIA GPU kernel and the "
                     f"program is compiled for {platform!r}: use 'auto', 'blocksparse' or 'xla'")
  return impl


def learned(platform: str) -> str:
  """What 'auto' runs for a variant whose score is learned (no static pattern) on the blocked
  engine: on TPU the fused Pallas kernel, whose compiled train steps of the paper recipes are
  2.3-5.1x faster than the engine's and take 30-72% less memory by the estimate (docs/tpu.md;
  no TPU has run it yet: 'blocksparse' is the engine); elsewhere the engine, 'blocksparse'
  (on a CPU the kernel runs in interpret mode; its GPU lowering, pallas_gpu.py, has not run on
  a GPU, so nothing measures it against the engine there)."""
  return 'pallas' if platform == 'tpu' else 'blocksparse'


def check_pallas(variant: str, platform: str, head_dim: int | None = None) -> None:
  """Raises ValueError where the fused Pallas kernel cannot run: on a GPU target, for a head
  width the Triton lowering (pallas_gpu.py) cannot tile. A TPU target runs pallas_kernel.py's
  Mosaic kernels, a CPU target the same in interpret mode."""
  if platform != 'gpu':
    return
  why = None if head_dim is None else pallas_gpu.unusable_head_dim(head_dim)
  if why:
    raise ValueError(f"{variant}: attention_impl='pallas' cannot run on a GPU: {why}. Use "
                     "'auto' or 'blocksparse'")


# Head widths of cuDNN's flash kernel on every GPU it supports (Hopper also takes up to 256).
CUDNN_HEAD_DIM_MAX = 128


def cudnn_runs(head_dim: int, dtype) -> bool:
  """Whether cuDNN's flash attention takes this head width and dtype."""
  return (head_dim % 8 == 0 and head_dim <= CUDNN_HEAD_DIM_MAX
          and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16))


def block_option(module, name: str) -> int:
  """`key_block` / `band_block` of the module's options, or the default where the variant
  does not declare them."""
  if name in options_lib.declared(type(module)):
    return module.option(name)
  return {'key_block': KEY_BLOCK, 'band_block': BAND_BLOCK}[name]


def attend(module, q, k, v, *, positions, segment_ids):
  """Attention of every head of `module` over its static pattern, on `module.impl`.

  Args:
    module: the variant's MultiHeadAttention (head_pattern, parts, impl, block_size, dtype,
      platform).
    q, k, v: (batch, length, heads, head_dim).
    positions: (batch, length) positions within each document.
    segment_ids: (batch, length) document ids; keys of other documents are never seen.

  Returns:
    (batch, length, heads, head_dim); a query that sees no key outputs zeros.
  """
  heads = q.shape[2]
  head_patterns = [module.head_pattern(h) for h in range(heads)]
  dense = all(isinstance(p, patterns.Dense) for p in head_patterns)
  scale = q.shape[-1] ** -0.5
  dtype = module.dtype
  impl = module.impl
  if impl == 'splash':
    return splash.splash_attention(q, k, v, segment_ids, positions, head_patterns,
                                   block_size=module.block_size, scale=scale, dtype=dtype,
                                   interpret=module.target_platform() == 'cpu')
  if impl == 'pallas':
    return pallas_patterns(module, q, k, v, segment_ids, head_patterns, scale)
  if impl == 'blocksparse' and dense:
    # Query block [s, e) sees keys [0, e): the blocks above the diagonal are never computed.
    block = module.loop_block(q.shape[1], prefix=True)
    return blockloop.causal(q, k, v, segment_ids, block_size=block, scale=scale, dtype=dtype,
                            per_step=blockloop.step_keys(module.target_platform(), block) // block)
  if impl in ('blocksparse', 'cpu_kernel'):
    if impl == 'cpu_kernel':
      def compute(q, k, v, parts):
        return cpu_kernel.pattern_attention(q, k, v, segment_ids, parts, scale=scale,
                                            dtype=dtype)
    else:
      def compute(q, k, v, parts):
        return blocksparse.pattern_attention(
            q, k, v, segment_ids, parts, q_block=module.loop_block(q.shape[1]),
            k_block=block_option(module, 'key_block'),
            band_block=block_option(module, 'band_block'), scale=scale, dtype=dtype)
    return _by_head_group(module, q, k, v, compute)
  mask = reference.causal_segment_mask(segment_ids)  # (b, q, k)
  if dense:
    if impl in ('fused', 'cudnn'):  # choose() gives these to dense variants only.
      return fused_attention(q, k, v, mask[:, None], impl=impl, scale=scale, dtype=dtype)
    return reference.reference_attention(q, k, v, mask[:, None], scale=scale, dtype=dtype)
  n = q.shape[1]
  i, j = jnp.arange(n)[:, None], jnp.arange(n)[None, :]
  allowed = jnp.stack([p.allowed(i, j, h) for h, p in enumerate(head_patterns)])
  mask = allowed[None] & mask[:, None]  # (b, h, q, k)
  out = reference.reference_attention(q, k, v, mask, scale=scale, dtype=dtype)
  sees_any = jnp.swapaxes(mask.any(axis=-1), 1, 2)[..., None]  # (b, q, h, 1)
  return jnp.where(sees_any, out, 0).astype(dtype)


def pallas_patterns(module, q, k, v, segment_ids, head_patterns, scale):
  """Every head's static pattern in one call of the fused Pallas kernel: its table is the
  union of the key blocks the heads' patterns touch (blocksparse's layout, one per group of
  heads that see the same keys), and the score masks each head with its own pattern."""
  n = q.shape[1]
  dense = all(isinstance(p, patterns.Dense) for p in head_patterns)
  block = module.loop_block(n, prefix=dense)
  if dense:
    return blockloop.causal(q, k, v, segment_ids, block_size=block, scale=scale,
                            dtype=module.dtype, **module.engine())
  tables = {blocksparse.pattern_table(blocksparse.HeadView(p, patterns.head_group(p, h)), n,
                                      block, block) for h, p in enumerate(head_patterns)}
  nq = -(-n // block)
  chunks = [np.unique(np.concatenate([
      (t.start[b, r] + t.stride[b, r] * np.arange(t.count[b, r])) // block
      for t in tables for r in range(t.start.shape[1])])) for b in range(nq)]
  table = blockloop.Table.from_chunks(chunks, block)
  # The distinct masks (heads of one group see the same keys), and which one each head reads:
  # a one-hot (group, 1, head, 1, 1) parameter split with the heads over a mesh, so that the
  # score masks the heads a device holds (the kernel computes a device's heads at once).
  heads_of = [(p, patterns.head_group(p, h)) for h, p in enumerate(head_patterns)]
  views = list(dict.fromkeys(heads_of))
  if len(views) > 1 and module.engine().get('kernel') == 'pallas_gpu':
    return _pallas_gpu_views(module, q, k, v, segment_ids, views, heads_of, table, block, scale)
  one_hot = None
  if len(views) > 1:
    one_hot = np.zeros((len(views), 1, len(heads_of), 1, 1), np.float32)
    for h, view in enumerate(heads_of):
      one_hot[views.index(view), 0, h] = 1.0
    one_hot = jnp.asarray(one_hot)

  def score(params, qb, kb, i, j):
    logits = blockloop.head_einsum('bhqd,bhkd->bhqk', qb, kb, preferred_element_type=jnp.float32)
    masks = [p.allowed(i[:, None], j[None, :], g)[None, None] for p, g in views]
    if params is None:
      return logits * scale, masks[0], None
    allowed = sum(params[g] * m.astype(jnp.float32) for g, m in enumerate(masks)) > 0.5
    return logits * scale, allowed, None

  qh, kh, vh = (jnp.swapaxes(a, 1, 2) for a in (q, k, v))
  out, _ = blockloop.attention(qh, kh, vh, segment_ids, segment_ids, one_hot, table=table,
                               q_block=block, score=score, dtype=module.dtype,
                               param_axes=None if one_hot is None else (
                                   None, None, 'heads', None, None), **module.engine())
  return jnp.swapaxes(out, 1, 2)


def _pallas_gpu_views(module, q, k, v, segment_ids, views, heads_of, table, block, scale):
  """pallas_patterns' call for heads that see different keys on the GPU kernel, which
  computes one head per program and reads no element of an array by a static index: each
  head's view number (a (1, heads, 1, 1) parameter split with the heads, never differentiated)
  selects its view's mask by compares."""
  view_of = jnp.asarray(np.array([views.index(x) for x in heads_of], np.float32)
                        .reshape(1, -1, 1, 1))

  def score(params, qb, kb, i, j):
    logits = blockloop.head_einsum('bhqd,bhkd->bhqk', qb, kb, preferred_element_type=jnp.float32)
    allowed = None
    for g, (p, h) in enumerate(views):
      x = (params == g) & p.allowed(i[:, None], j[None, :], h)[None, None]
      allowed = x if allowed is None else allowed | x
    return logits * scale, allowed, None

  qh, kh, vh = (jnp.swapaxes(a, 1, 2) for a in (q, k, v))
  out, _ = blockloop.attention(qh, kh, vh, segment_ids, segment_ids,
                               jax.lax.stop_gradient(view_of), table=table, q_block=block,
                               score=score, dtype=module.dtype,
                               param_axes=(None, 'heads', None, None), **module.engine())
  return jnp.swapaxes(out, 1, 2)


def fused_attention(q, k, v, mask, *, impl: str, scale: float, dtype, bias=None):
  """jax.nn.dot_product_attention: XLA's fused path ('fused') or cuDNN's flash kernel ('cudnn').

  Args:
    q, k, v: (batch, length, heads, head_dim).
    mask: bool, broadcastable to (batch, heads, q_len, k_len).
    impl: 'fused' or 'cudnn'.
    scale: logit multiplier.
    dtype: output dtype.
    bias: added to the logits, broadcastable like `mask` (selective attention's -F).

  Returns:
    (batch, length, heads, head_dim).
  """
  return jax.nn.dot_product_attention(
      q, k, v, bias=bias, mask=mask, scale=scale,
      implementation='cudnn' if impl == 'cudnn' else None).astype(dtype)


def _by_head_group(module, q, k, v, compute):
  """`compute(q, k, v, parts)` once per group of heads with the same parts (module.parts)."""
  heads = q.shape[2]
  groups: dict[tuple, list[int]] = {}
  for h in range(heads):
    groups.setdefault(tuple(module.parts(h)), []).append(h)
  if len(groups) == 1:
    return compute(q, k, v, list(next(iter(groups))))
  outs = {}
  for parts, hs in groups.items():
    sel = np.asarray(hs)
    out = compute(q[:, :, sel], k[:, :, sel], v[:, :, sel], list(parts))
    for idx, h in enumerate(hs):
      outs[h] = out[:, :, idx]
  return jnp.stack([outs[h] for h in range(heads)], axis=2)
