"""analysis/hlo_cost.py `analyze`: a compiled program's kernels, bytes and collectives, with
its loops counted as many times as they run. Small jitted CPU programs (compiled in well under
a second each) and HLO text as the TPU compiler prints it (shortened)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from analysis import hlo_cost, roofline

pytestmark = pytest.mark.unit


def test_a_layer_loop_reads_one_layers_weights_per_iteration():
  """A scan over stacked weights: every iteration's matmul counts, and the weights are read
  one slice per iteration (the loop's dynamic slice), not the whole stack each time."""
  layers, rows, width = 6, 8, 64

  def stack(x, ws):
    return jax.lax.fori_loop(0, layers, lambda i, a: jnp.tanh(a @ ws[i]), x)

  x = jnp.ones((rows, width))
  ws = jnp.ones((layers, width, width))
  cost = hlo_cost.analyze(jax.jit(stack).lower(x, ws).compile().as_text())
  assert cost.flops == layers * 2 * rows * width * width
  assert cost.unknown_loops == 0
  one_layer, stack_bytes = width * width * 4, layers * width * width * 4
  assert layers * one_layer <= cost.bytes < layers * stack_bytes
  # The kernel that slices the stack reads one layer (and writes it), not the whole stack.
  [sliced] = [k for k in cost.kernels if k.bytes >= one_layer and 'slice' in k.name]
  assert sliced.times == layers
  assert 2 * one_layer <= sliced.bytes < 2 * one_layer + 64, cost.top(5)
  assert cost.launches >= layers


def test_a_loop_of_data_dependent_length_counts_once_and_is_reported():
  def f(x, w, n):
    return jax.lax.fori_loop(0, n, lambda i, a: a @ w, x)

  cost = hlo_cost.analyze(jax.jit(f).lower(jnp.ones((4, 8)), jnp.ones((8, 8)), 3)
                          .compile().as_text())
  assert cost.flops == 2 * 4 * 8 * 8
  assert cost.unknown_loops == 1


def test_a_loop_whose_length_a_constant_table_gives_per_outer_step_counts_each_length():
  """The blocked attention loops: query block i reads table[i] key chunks (a constant of the
  program), so the inner loop's length changes with the outer counter; each is counted."""
  table = np.array([1, 3, 2, 4], np.int32)

  def blocks(x, w):
    chunks = jnp.asarray(table)
    return jax.lax.fori_loop(
        0, 4, lambda i, a: jax.lax.fori_loop(0, chunks[i], lambda j, b: jnp.tanh(b @ w), a), x)

  x, w = jnp.ones((4, 8)), jnp.ones((8, 8))
  text = jax.jit(blocks).lower(x, w).compile().as_text()
  one = 2 * 4 * 8 * 8
  cost = hlo_cost.analyze(text)
  assert cost.flops == table.sum() * one and cost.unknown_loops == 0


def test_a_conditional_counts_its_most_expensive_branch():
  def f(p, x, w):
    return jax.lax.cond(p, lambda a: jnp.tanh(a @ w) @ w, jnp.tanh, x)

  text = jax.jit(f).lower(True, jnp.ones((8, 64)), jnp.ones((64, 64))).compile().as_text()
  assert ' conditional(' in text
  cost = hlo_cost.analyze(text)
  assert cost.flops == 2 * (2 * 8 * 64 * 64) and cost.unknown_loops == 0


def test_convolutions_count_only_the_taps_that_read_input():
  """The TPU compiler writes matmuls as convolutions, some with dilated inputs whose holes
  read nothing: the count is XLA's own (here a strided, padded, dilated convolution)."""
  lhs = jnp.ones((2, 3, 17, 9))
  rhs = jnp.ones((5, 3, 4, 3))

  def conv(a, b):
    return jax.lax.conv_general_dilated(a, b, window_strides=(2, 1), padding=((3, 1), (2, 2)),
                                        lhs_dilation=(2, 1), rhs_dilation=(1, 2))

  compiled = jax.jit(conv).lower(lhs, rhs).compile()
  text = compiled.as_text()
  assert ' convolution(' in text
  xla = compiled.cost_analysis()
  xla = xla[0] if isinstance(xla, (list, tuple)) else xla
  assert hlo_cost.analyze(text).flops == pytest.approx(xla['flops'])


# A TPU-style loop: no known_trip_count in the backend config; the condition compares the
# counter with a constant inside a fusion, the counter starts at 2 and steps by 3.
_LOOP = """\
HloModule jit_loop, entry_computation_layout={(f32[8,64]{1,0})->f32[8,64]{1,0}}

%cond_fused (p.0: s32[]) -> pred[] {
  %p.0 = s32[]{:T(128)} parameter(0)
  %limit = s32[]{:T(128)} constant(17)
  ROOT %lt = pred[]{:T(512)} compare(%p.0, %limit), direction=LT
}

%cond (wide.param.1: (s32[], f32[8,64], f32[64,64])) -> pred[] {
  %wide.param.1 = (s32[]{:T(128)}, f32[8,64]{1,0}, f32[64,64]{1,0}) parameter(0)
  %gte.c = s32[]{:T(128)} get-tuple-element(%wide.param.1), index=0
  ROOT %fusion.c = pred[]{:T(512)} fusion(%gte.c), kind=kLoop, calls=%cond_fused
}

%body (wide.param.0: (s32[], f32[8,64], f32[64,64])) -> (s32[], f32[8,64], f32[64,64]) {
  %wide.param.0 = (s32[]{:T(128)}, f32[8,64]{1,0}, f32[64,64]{1,0}) parameter(0)
  %gte.i = s32[]{:T(128)} get-tuple-element(%wide.param.0), index=0
  %gte.a = f32[8,64]{1,0} get-tuple-element(%wide.param.0), index=1
  %gte.w = f32[64,64]{1,0} get-tuple-element(%wide.param.0), index=2
  %step = s32[]{:T(128)} constant(3)
  %next = s32[]{:T(128)} add(%gte.i, %step)
  %dot.1 = f32[8,64]{1,0} dot(%gte.a, %gte.w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %tuple.b = (s32[]{:T(128)}, f32[8,64]{1,0}, f32[64,64]{1,0}) tuple(%next, %dot.1, %gte.w)
}

ENTRY %main (x: f32[8,64]) -> f32[8,64] {
  %x = f32[8,64]{1,0} parameter(0)
  %w = f32[64,64]{1,0} constant({...})
  %start = s32[]{:T(128)} constant(2)
  %tuple.0 = (s32[]{:T(128)}, f32[8,64]{1,0}, f32[64,64]{1,0}) tuple(%start, %x, %w)
  %while.0 = (s32[]{:T(128)}, f32[8,64]{1,0}, f32[64,64]{1,0}) while(%tuple.0), condition=%cond, body=%body
  ROOT %out = f32[8,64]{1,0} get-tuple-element(%while.0), index=1
}
"""


def test_a_loop_without_a_recorded_trip_count_is_counted_from_its_condition():
  trips = len(range(2, 17, 3))  # 5
  cost = hlo_cost.analyze(_LOOP)
  assert cost.flops == trips * 2 * 8 * 64 * 64 and cost.unknown_loops == 0
  dots = [k for k in cost.kernels if k.opcode == 'dot']
  assert [k.times for k in dots] == [trips]
  assert dots[0].bytes == (8 * 64 + 64 * 64 + 8 * 64) * 4


def test_tiles_pad_and_on_chip_arrays_move_no_hbm_bytes():
  [a] = hlo_cost.arrays('bf16[3,64]{1,0:T(8,128)(2,1)}')
  assert (a.logical_bytes, a.bytes, a.hbm_bytes) == (3 * 64 * 2, 8 * 128 * 2, 8 * 128 * 2)
  [b] = hlo_cost.arrays('f32[1024,2,384]{0,2,1:T(8,128)S(1)}')
  assert b.memory_space == 1 and b.hbm_bytes == 0 and b.bytes == 1024 * 2 * 384 * 4
  pair = hlo_cost.arrays('(f32[2]{0}, s8[4,4]{1,0})')
  assert [x.bytes for x in pair] == [8, 16]


# Collectives as the TPU compiler writes them: one all-gather copied into the fusion that
# starts it and into a compute fusion that carries part of its transfer (one channel), an
# all-reduce over explicit groups, an all-to-all over iota groups, a collective-permute.
_COLLECTIVES = """\
HloModule jit_step, entry_computation_layout={(bf16[32,128]{1,0})->f32[]}

%start_fusion (param_0.1: bf16[32,128]) -> (bf16[32,128], bf16[128,128]) {
  %param_0.1 = bf16[32,128]{1,0} parameter(0)
  %all-gather.1 = bf16[128,128]{1,0} all-gather(%param_0.1), channel_id=7, replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0'}, dimensions={0}, use_global_device_ids=true
  ROOT %cc = (bf16[32,128]{1,0}, bf16[128,128]{1,0}) custom-call(%all-gather.1), custom_call_target="AsyncCollectiveStart"
}

%compute_fusion (param_0.2: bf16[32,128], param_1.2: f32[8,128]) -> (f32[8,128], bf16[128,128]) {
  %param_0.2 = bf16[32,128]{1,0} parameter(0)
  %param_1.2 = f32[8,128]{1,0} parameter(1)
  %all-gather.2 = bf16[128,128]{1,0} all-gather(%param_0.2), channel_id=7, replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0'}, dimensions={0}, use_global_device_ids=true
  %exp = f32[8,128]{1,0} exponential(%param_1.2)
  ROOT %t = (f32[8,128]{1,0}, bf16[128,128]{1,0}) tuple(%exp, %all-gather.2)
}

ENTRY %main (p: bf16[32,128]) -> f32[] {
  %p = bf16[32,128]{1,0} parameter(0)
  %q = f32[8,128]{1,0} parameter(1)
  %fusion.1 = (bf16[32,128]{1,0}, bf16[128,128]{1,0}) fusion(%p), kind=kCustom, calls=%start_fusion
  %fusion.2 = (f32[8,128]{1,0}, bf16[128,128]{1,0}) fusion(%p, %q), kind=kCustom, calls=%compute_fusion
  %all-reduce.3 = f32[1024]{0} all-reduce(%q), channel_id=8, replica_groups={{0,2,4,6},{1,3,5,7}}, use_global_device_ids=true, to_apply=%add
  %all-to-all.4 = f32[4,256]{1,0} all-to-all(%q), channel_id=9, replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}
  %collective-permute.5 = f32[16]{0} collective-permute(%q), channel_id=10, source_target_pairs={{0,1},{1,0}}
  ROOT %r = f32[] constant(0)
}
"""


def test_collectives_count_once_per_channel_with_their_groups_and_ring_traffic():
  static = hlo_cost.collectives(_COLLECTIVES)
  assert static['all-gather'] == {'count': 1, 'bytes': 128 * 128 * 2}
  cost = hlo_cost.analyze(_COLLECTIVES)
  by_kind = {c.kind: c for c in cost.collectives}
  assert sorted(by_kind) == ['all-gather', 'all-reduce', 'all-to-all', 'collective-permute']
  assert len(cost.collectives) == 4
  gather = by_kind['all-gather']
  assert gather.groups == [[0, 2, 4, 6], [1, 3, 5, 7]]  # Axis 0 of a 4 x 2 mesh.
  assert roofline.traffic(gather, 8) == pytest.approx(128 * 128 * 2 * 3 / 4)
  assert roofline.traffic(by_kind['all-reduce'], 8) == pytest.approx(2 * 4096 * 3 / 4)
  assert by_kind['all-to-all'].groups == np.arange(8).reshape(2, 4).T.tolist()
  assert roofline.traffic(by_kind['collective-permute'], 8) == 64
  # Slices 0 and 1 of four devices each: axis 0 of the mesh crosses them, the pairs do not.
  slices = [0, 0, 0, 0, 1, 1, 1, 1]
  assert roofline.spans(gather, slices)
  assert not roofline.spans(by_kind['collective-permute'], slices)
  assert not roofline.spans(gather, None)
  # The compute fusion that carries part of the gather is a kernel; the start wrapper is not.
  assert [k.name for k in cost.kernels] == ['fusion.2']


def _splash_hlo(block_mask: str, mask_next: str = '%mask_next, ') -> str:
  return f"""\
HloModule jit_attend, entry_computation_layout={{(f32[2,512,64]{{2,1,0}})->f32[2,512,64]{{2,1,0}}}}

ENTRY %main (q: f32[2,512,64], k: f32[2,512,64], v: f32[2,512,64]) -> f32[2,512,64] {{
  %q = f32[2,512,64]{{2,1,0}} parameter(0)
  %k = f32[2,512,64]{{2,1,0}} parameter(1)
  %v = f32[2,512,64]{{2,1,0}} parameter(2)
  %data_next = s8[2,4,4]{{2,1,0}} constant({{...}})
  %block_mask = s8[2,4,4]{{2,1,0}} constant({block_mask})
  %copy-start.1 = (s8[2,4,4]{{2,1,0:S(1)}}, s8[2,4,4]{{2,1,0}}, u32[]) copy-start(%block_mask)
  %copy-done.1 = s8[2,4,4]{{2,1,0:S(1)}} copy-done(%copy-start.1)
  %zero = s8[] constant(0)
  %mask_next = s8[2,4,4]{{2,1,0}} broadcast(%zero), dimensions={{}}
  ROOT %splash_mha_fwd_residuals.1 = (f32[128,128]{{1,0}}, f32[2,512,64]{{2,1,0}}) custom-call(%data_next, %copy-done.1, {mask_next}%q, %k, /*index=5*/%v), custom_call_target="tpu_custom_call", frontend_attributes={{kernel_metadata={{
"xprof_metadata":"{{\\"block_q\\": 128, \\"block_kv\\": 128, \\"block_kv_compute\\": 128}}"
}}}}, metadata={{op_name="jit(attend)/splash_mha_fwd_residuals/pallas_call"}}
}}
"""


def test_the_splash_kernel_is_counted_from_its_non_empty_blocks():
  causal = np.tril(np.ones((4, 4), int)) * 2 - np.eye(4, dtype=int)  # 1: partial, 2: full.
  table = np.stack([causal, causal])
  text = '{ ' + ', '.join('{ ' + ', '.join('{ ' + ', '.join(map(str, row)) + ' }'
                                           for row in head) + ' }' for head in table) + ' }'
  cost = hlo_cost.analyze(_splash_hlo(text))
  [kernel] = [k for k in cost.kernels if k.opcode == 'custom-call']
  assert kernel.source == 'analytic' and not cost.opaque and not cost.notes
  blocks = 2 * 10  # Two heads of 10 causal blocks out of 16.
  assert kernel.flops == {'f32': 2.0 * blocks * 128 * 128 * (64 + 64)}
  q = 2 * 512 * 64 * 4
  assert kernel.bytes >= 3 * q + q  # q, k, v read and the output written, at least.
  # A mask the kernel computes itself has no mask_next: the block table is still the second.
  computed = hlo_cost.analyze(_splash_hlo(text, mask_next=''))
  assert computed.kernels[-1].flops == kernel.flops and not computed.notes
  # Without the table (the text printed without large constants): every block, and a note.
  elided = hlo_cost.analyze(_splash_hlo('{...}'))
  assert elided.kernels[-1].flops['f32'] == 2.0 * 2 * 16 * 128 * 128 * 128
  assert elided.notes and 'every block' in elided.notes[0]
