"""The work of a compiled program, with its loops counted as many times as they run.

XLA's own `cost_analysis()` counts a while loop's body once, whatever its trip count, so a
blocked attention path whose work lives in loops looks cheap there, and a loop that runs 100
times more than it should looks the same as one that does not. This module reads the optimized
HLO text of a compiled program (`compiled.as_text()`) and walks its call graph from the entry:
each instruction counts as many times as the loops around it run. XLA:CPU records a loop's
count in its backend config (`known_trip_count`) whenever it can prove it (every `fori_loop`,
`scan` and `lax.map` of static length); the TPU compiler records none, so the count is also
read from the loop's condition (its counter against a bound), the bound evaluated from the
program's constants and the enclosing loop's counter when it is one (`_Evaluator`: a blocked
path's query block b reads table[b] key chunks, a constant table, so each block's loop counts
its own length). A loop whose count depends on data (adaptive span's trimmed spans, ACT's
halting) is counted once and reported in `unknown_loops`; a conditional counts its most
expensive branch.

Two readings:

- `dot_flops(hlo)`: the FLOPs of its matmuls (dot and convolution instructions; the TPU
  compiler writes a matmul as a convolution), by the JAX source op. Custom calls count zero.
- `analyze(hlo)`: the program as the kernels it launches (`Kernel`: each top-level fusion,
  custom call or unfused op, with its matmul FLOPs by operand type, the bytes it reads and
  writes in HBM, and how many times it runs) and its collectives (`Collective`: kind, bytes,
  the device groups, how many times). Bytes are a fusion's operands and outputs, not its
  internals; an operand a fusion only slices (a layer's weights out of the scanned stack,
  a block of keys) counts the slice, and an output updated in place counts the update. On
  TPU, arrays the compiler placed in on-chip memory (layout `S(1)`) do not count, and arrays
  count with their tile padding. Mosaic kernels (the splash attention kernel,
  `tpu_custom_call`) are counted from their own analytic cost: FLOPs from the mask's
  non-empty blocks (the block table is a constant of the program; the text must hold large
  constants: `module_text`), bytes from their operands plus the key / value blocks they
  stream; a kernel that states its own cost (pallas_call's cost_estimate: the project's fused
  attention kernel, from its block table) by that. Other custom calls (a CPU kernel, cuDNN)
  count their operands' and outputs' bytes and no FLOPs, and are listed in `Cost.opaque`.

analysis/roofline.py turns a Cost into a step time for a chip.

  work = hlo_cost.dot_flops(jitted.lower(*args).compile().as_text())
  work.flops, work.unknown_loops, work.by_op   # by_op: FLOPs per op_name metadata
  cost = hlo_cost.analyze(hlo_cost.module_text(compiled))
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import re

import numpy as np

# `%name = type opcode(operands), attributes` (a tuple type starts with '(').
_INSTRUCTION = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([\w\-]+)\((.*)$')
_INSTRUCTION_START = re.compile(r'^\s*(?:ROOT\s+)?%[\w.\-]+\s*=\s')
_COMPUTATION = re.compile(r'^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$')
_RESULT = re.compile(r'->\s*(.*?)\s*\{\s*$')
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CALLS = re.compile(r'\b(calls|to_apply|body|condition)=%?([\w.\-]+)')
_BRANCHES = re.compile(r'branch_computations=\{([^}]*)\}')
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_OPERAND = re.compile(r'%([\w.\-]+)')
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_PRECISION = re.compile(r'operand_precision=\{([^}]*)\}')

# Element bits of HLO's primitive types.
BITS = {'pred': 8, 's1': 1, 'u1': 1, 's2': 2, 'u2': 2, 's4': 4, 'u4': 4, 's8': 8, 'u8': 8,
        's16': 16, 'u16': 16, 'f16': 16, 'bf16': 16, 's32': 32, 'u32': 32, 'f32': 32,
        's64': 64, 'u64': 64, 'f64': 64, 'c64': 64, 'c128': 128, 'f8e4m3fn': 8, 'f8e5m2': 8,
        'f8e4m3b11fnuz': 8, 'f8e4m3fnuz': 8, 'f8e5m2fnuz': 8, 'f8e4m3': 8, 'f8e3m4': 8,
        'f8e8m0fnu': 8, 'f4e2m1fn': 4, 'token': 0}
_ARRAY = re.compile(r'\b(' + '|'.join(sorted(BITS, key=len, reverse=True))
                    + r')\[([\d,]*)\](\{[^{}]*(?:\([^)]*\)[^{}]*)*\})?')
_LEADING_ARRAY = re.compile(r'^[a-z]+\d*\[([\d,]*)\]')

COLLECTIVES = ('all-gather', 'reduce-scatter', 'all-reduce', 'all-to-all', 'collective-permute')
_COLLECTIVE_OPS = {
    **{k: k for k in COLLECTIVES},
    **{f'{k}-start': k for k in ('all-gather', 'all-reduce', 'collective-permute')},
    'ragged-all-to-all': 'all-to-all', 'collective-broadcast': 'all-gather',
}
# The TPU compiler emits a reduce-scatter as a fusion of this name around an all-reduce.
_REDUCE_SCATTER_FUSION = 'all-reduce-scatter'

# Instructions that launch nothing and move no data (or whose data moves elsewhere: a
# collective's -done, a loop's tuple).
_FREE = {'parameter', 'constant', 'get-tuple-element', 'tuple', 'bitcast', 'after-all',
         'add-dependency', 'partition-id', 'replica-id', 'opt-barrier', 'domain', 'copy-done',
         'send-done', 'recv-done', 'slice-done', 'all-gather-done', 'all-reduce-done',
         'collective-permute-done', 'async-done', 'async-update', 'while', 'conditional',
         'call'}
# Custom calls that only mark or allocate buffers, or start / finish a collective (whose
# bytes are counted as the collective).
_FREE_TARGETS = {'AllocateBuffer', 'AssumeGatherIndicesInBound', 'AsyncCollectiveStart',
                 'AsyncCollectiveDone', 'Sharding', 'SPMDFullToShardShape',
                 'SPMDShardToFullShape', 'MoveToHost', 'MoveToDevice', 'annotate_device_placement'}
# TPU compiler custom calls that only move or reshape data: their bytes count, and they have
# no FLOPs to miss.
_DATA_TARGETS = {'ZeroCrop', 'ConcatBitcast', 'GatherScatterIndicesBitpacked'}
# Ops that read only the slice they produce from their first operand.
_SLICING = {'dynamic-slice', 'slice', 'gather'}


# --- Types. -----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Array:
  """One array of an HLO type: element type, dimensions and where it lives."""
  dtype: str
  dims: tuple[int, ...]
  memory_space: int = 0      # 0: HBM (device memory); 1: TPU VMEM; 2-5: other on-chip memories.
  padded_elements: int = 0   # Elements with the layout's tile padding.

  @property
  def bytes(self) -> int:
    """Bytes as laid out (tile padding included)."""
    return self.padded_elements * BITS[self.dtype] // 8

  @property
  def logical_bytes(self) -> int:
    return math.prod(self.dims) * BITS[self.dtype] // 8

  @property
  def hbm_bytes(self) -> int:
    """Bytes in device memory: zero for an array the compiler keeps on chip."""
    return self.bytes if self.memory_space == 0 else 0


def _padded(dims: tuple[int, ...], layout: str) -> tuple[int, int]:
  """(elements with tile padding, memory space) of an array of `dims` with `layout`
  ('{1,0:T(8,128)(2,1)S(1)}' or '')."""
  n = math.prod(dims)
  if not layout:
    return n, 0
  body = layout[1:-1]
  order, _, tiling = body.partition(':')
  space = re.search(r'S\((\d+)\)', tiling)
  memory_space = int(space.group(1)) if space else 0
  tile = re.match(r'T\(([\d,]+)\)', tiling)
  if not tile or not dims:
    return n, memory_space
  try:
    minor_to_major = [int(d) for d in order.split(',') if d]
  except ValueError:
    return n, memory_space
  if sorted(minor_to_major) != list(range(len(dims))):
    return n, memory_space
  physical = [dims[d] for d in reversed(minor_to_major)]  # Major to minor.
  sizes = [int(t) for t in tile.group(1).split(',')]
  for i, t in enumerate(reversed(sizes)):
    if i < len(physical) and t > 0:
      physical[-1 - i] = -(-physical[-1 - i] // t) * t
  return math.prod(physical), memory_space


def arrays(type_text: str) -> list[Array]:
  """Every array of an HLO type (a tuple's elements in order)."""
  out = []
  for dtype, dims_text, layout in _ARRAY.findall(type_text):
    dims = tuple(int(d) for d in dims_text.split(',') if d)
    padded, space = _padded(dims, layout or '')
    out.append(Array(dtype, dims, space, padded))
  return out


def array_bytes(type_text: str) -> int:
  """Logical bytes of every array of an HLO type (no padding; wherever it lives)."""
  return sum(a.logical_bytes for a in arrays(type_text))


def _shape(text: str) -> tuple[int, ...] | None:
  m = _LEADING_ARRAY.match(text)
  if not m:
    return None
  return tuple(int(d) for d in m.group(1).split(',') if d)


def tuple_elements(text: str) -> list[str]:
  """The top-level elements of an HLO tuple type '(a, (b, c), d)'; [text] if not a tuple."""
  text = re.sub(r'/\*.*?\*/', '', text).strip()
  if not text.startswith('('):
    return [text]
  parts, depth, start = [], 0, 1
  for i, ch in enumerate(text):
    if ch in '({[':
      depth += 1
    elif ch in ')}]':
      depth -= 1
      if depth == 0:
        parts.append(text[start:i])
    elif ch == ',' and depth == 1:
      parts.append(text[start:i])
      start = i + 1
  return [p.strip() for p in parts if p.strip()]


# --- Parsing. ---------------------------------------------------------------------------------

@dataclasses.dataclass
class _Instruction:
  name: str
  type_text: str
  opcode: str
  rest: str            # Everything after 'opcode(' (operands, then attributes).
  computation: str = ''

  @property
  def shape(self) -> tuple[int, ...] | None:
    return _shape(self.type_text)

  def split(self) -> tuple[str, str]:
    """(operand text, attribute text)."""
    depth = 0
    for i, ch in enumerate(self.rest):
      if ch in '({[':
        depth += 1
      elif ch in ')}]':
        if depth == 0:
          return self.rest[:i], self.rest[i + 1:]
        depth -= 1
    return self.rest, ''

  @property
  def operands(self) -> list[str]:
    return _OPERAND.findall(self.split()[0])

  @property
  def attributes(self) -> str:
    return self.split()[1]


@dataclasses.dataclass
class _Module:
  computations: dict[str, list[_Instruction]]
  results: dict[str, str]        # Computation: its result type.
  entry: str
  by_name: dict[str, _Instruction]
  constants: object = None       # `_invariants`' evaluator, built on first use.


def _parse(hlo: str) -> _Module:
  """The module's computations, their instructions (continuation lines joined) and entry."""
  computations, results, entry, current = {}, {}, None, None
  for line in hlo.splitlines():
    if current is None:
      m = _COMPUTATION.match(line)
      if m and '=' not in line.split('{')[0].split('(')[0]:
        current = m.group(1)
        computations[current] = []
        result = _RESULT.search(line)
        results[current] = result.group(1) if result else ''
        if line.lstrip().startswith('ENTRY'):
          entry = current
      continue
    if line.strip() == '}':
      current = None
      continue
    m = _INSTRUCTION.match(line) if _INSTRUCTION_START.match(line) else None
    if m:
      name, type_text, opcode, rest = m.groups()
      computations[current].append(_Instruction(name, type_text, opcode, rest, current))
    elif computations[current]:  # An attribute continued on the next line.
      computations[current][-1].rest += '\n' + line
  if entry is None:
    raise ValueError('no ENTRY computation in the HLO text')
  by_name = {i.name: i for insts in computations.values() for i in insts}
  return _Module(computations, results, entry, by_name)


# --- Matmul FLOPs. ----------------------------------------------------------------------------

def _flops_class(inst: _Instruction, module: _Module) -> str:
  """The peak a matmul runs at: 'int8' (8-bit and smaller operands), 'bf16' (16-bit), 'f32'
  (32-bit at the default precision), 'f32_highest' (32-bit at HIGH or HIGHEST) or 'f64'."""
  lhs = module.by_name.get(inst.operands[0]) if inst.operands else None
  lhs_arrays = arrays(lhs.type_text) if lhs else arrays(inst.type_text)
  bits = BITS.get(lhs_arrays[0].dtype, 32) if lhs_arrays else 32
  if bits <= 8:
    return 'int8'
  if bits <= 16:
    return 'bf16'
  if bits >= 64:
    return 'f64'
  precision = _PRECISION.search(inst.rest)
  if precision and any(p.strip() in ('high', 'highest') for p in precision.group(1).split(',')):
    return 'f32_highest'
  return 'f32'


def _dot(inst: _Instruction, module: _Module) -> float:
  lhs = module.by_name.get(inst.operands[0]) if inst.operands else None
  lhs_shape = lhs.shape if lhs else None
  dims = re.search(r'lhs_contracting_dims=\{([\d,]*)\}', inst.rest)
  if inst.shape is None or lhs_shape is None or dims is None:
    raise ValueError(f'cannot read the shapes of dot {inst.name}: {inst.rest[:200]}')
  contracted = math.prod(lhs_shape[int(d)] for d in dims.group(1).split(',') if d)
  return 2.0 * math.prod(inst.shape) * contracted


def _window(attributes: str) -> dict[str, list]:
  m = re.search(r'window=\{([^}]*)\}', attributes)
  fields = {}
  for part in (m.group(1).split() if m else []):
    key, _, value = part.partition('=')
    if key == 'pad':
      fields[key] = [tuple(int(x) for x in p.split('_')) for p in value.split('x')]
    else:
      fields[key] = [int(x) for x in value.split('x')]
  return fields


def _valid_taps(in_size: int, out_size: int, size: int, stride: int, pad_low: int,
                lhs_dilate: int, rhs_dilate: int) -> int:
  """(output position, window tap) pairs of one spatial dimension that read a real input
  element (not padding, not a hole of the input's dilation): XLA's own count."""
  dilated = (in_size - 1) * lhs_dilate + 1 if in_size else 0
  taps = np.arange(size, dtype=np.int64) * rhs_dilate
  total = 0
  for start in range(0, out_size, 4096):  # Bounded memory for long dimensions.
    o = np.arange(start, min(out_size, start + 4096), dtype=np.int64)
    pos = o[:, None] * stride + taps[None, :] - pad_low
    total += int(np.count_nonzero((pos >= 0) & (pos < dilated) & (pos % lhs_dilate == 0)))
  return total


def _convolution(inst: _Instruction, module: _Module) -> float:
  """FLOPs of a convolution: 2 x output batch x output features x kernel input features x
  the valid (output, tap) pairs of each spatial dimension."""
  operands = inst.operands
  lhs = module.by_name.get(operands[0]) if operands else None
  rhs = module.by_name.get(operands[1]) if len(operands) > 1 else None
  labels = re.search(r'dim_labels=(\w+)_(\w+)->(\w+)', inst.rest)
  if not (lhs and rhs and labels and lhs.shape is not None and rhs.shape is not None
          and inst.shape is not None):
    raise ValueError(f'cannot read the shapes of convolution {inst.name}: {inst.rest[:200]}')
  lhs_l, rhs_l, out_l = labels.groups()
  out_shape, lhs_shape, rhs_shape = inst.shape, lhs.shape, rhs.shape
  batch = out_shape[out_l.index('b')]
  features = out_shape[out_l.index('f')]
  in_features = rhs_shape[rhs_l.index('i')]
  window = _window(inst.attributes)
  pairs = 1
  spatial = sorted(c for c in out_l if c.isdigit())
  for k, c in enumerate(spatial):
    size = window.get('size', [1] * len(spatial))[k]
    pairs *= _valid_taps(
        in_size=lhs_shape[lhs_l.index(c)], out_size=out_shape[out_l.index(c)], size=size,
        stride=window.get('stride', [1] * len(spatial))[k],
        pad_low=window.get('pad', [(0, 0)] * len(spatial))[k][0],
        lhs_dilate=window.get('lhs_dilate', [1] * len(spatial))[k],
        rhs_dilate=window.get('rhs_dilate', [1] * len(spatial))[k])
  return 2.0 * batch * features * in_features * pairs


def _matmul_flops(inst: _Instruction, module: _Module) -> float:
  return _dot(inst, module) if inst.opcode == 'dot' else _convolution(inst, module)


# --- Loop trip counts. --------------------------------------------------------------------------

def _scalar(module: _Module, name: str, outer: dict | None = None, depth: int = 0):
  """What a scalar of a loop's condition or body is: ('element', i) for element i of the
  computation's tuple parameter, ('constant', value), or None. `outer` maps a fused
  computation's parameter names to the instruction names they stand for."""
  inst = module.by_name.get(name)
  if inst is None or depth > 8:
    return None
  if inst.opcode == 'parameter' and outer and name in outer:
    return _scalar(module, outer[name], None, depth + 1)
  if inst.opcode == 'constant':
    value = re.match(r'\s*(-?\d+)\s*\)', inst.rest)
    return ('constant', int(value.group(1))) if value else None
  if inst.opcode == 'get-tuple-element' and inst.operands:
    source = module.by_name.get(inst.operands[0])
    index = re.search(r'index=(\d+)', inst.rest)
    if source is not None and source.opcode == 'parameter' and index:
      return ('element', int(index.group(1)))
    return None
  if inst.opcode in ('copy', 'bitcast', 'convert', 'reshape') and inst.operands:
    return _scalar(module, inst.operands[0], outer, depth + 1)
  return None


def _root(module: _Module, computation: str) -> _Instruction | None:
  insts = module.computations.get(computation, [])
  return insts[-1] if insts else None


class _Evaluator:
  """Evaluates small integer expressions of a program (a loop's bounds) with numpy: constants,
  the elements of a computation's tuple parameter that `lookup` knows, and the ops that index
  and reduce a constant table (the blocked attention loops' key counts per query block).
  Anything else, or an array of more than LIMIT elements, is None (unknown)."""

  LIMIT = 1 << 20
  _BINARY = {'add': np.add, 'subtract': np.subtract, 'multiply': np.multiply,
             'maximum': np.maximum, 'minimum': np.minimum, 'remainder': np.fmod}
  # Bitwise on integers (the compiler's strength-reduced divisions), logical on predicates.
  _BITWISE = {'and': (np.bitwise_and, np.logical_and), 'or': (np.bitwise_or, np.logical_or),
              'xor': (np.bitwise_xor, np.logical_xor),
              'shift-left': (np.left_shift, None), 'shift-right-arithmetic': (np.right_shift, None),
              'shift-right-logical': (np.right_shift, None)}
  _COMPARE = {'LT': np.less, 'LE': np.less_equal, 'GT': np.greater, 'GE': np.greater_equal,
              'EQ': np.equal, 'NE': np.not_equal}
  _REDUCE = {'add': np.sum, 'maximum': np.max, 'minimum': np.min, 'multiply': np.prod,
             'and': np.all, 'or': np.any}

  def __init__(self, module: _Module, lookup):
    self.module, self.lookup = module, lookup

  def __call__(self, name: str, params: dict | None = None, depth: int = 0):
    try:
      value = self._eval(name, params or {}, depth)
    except (ValueError, IndexError, TypeError, KeyError, ZeroDivisionError, OverflowError):
      return None
    if value is not None and np.size(value) > self.LIMIT:
      return None
    return value

  def _eval(self, name, params, depth):
    m = self.module
    inst = m.by_name.get(name)
    if inst is None or depth > 64:
      return None
    shape = inst.shape
    ev = lambda n: self(n, params, depth + 1)
    op, operands = inst.opcode, inst.operands
    if op in ('copy-done', 'copy-start'):  # An asynchronous copy: the value copied.
      return ev(operands[0]) if operands else None
    if op == 'parameter':
      return params[name] if name in params else self.lookup(name, None)
    if op == 'get-tuple-element':
      source = m.by_name.get(operands[0])
      index = int(re.search(r'index=(\d+)', inst.rest).group(1))
      if source is not None and source.opcode == 'parameter':
        return self.lookup(source.name, index)
      if source is not None and source.opcode == 'tuple':
        return ev(source.operands[index])
      if source is not None and source.opcode == 'while':  # What a loop passes through.
        init = m.by_name.get(source.operands[0]) if source.operands else None
        body = dict(_CALLS.findall(source.rest)).get('body', '')
        if init is not None and init.opcode == 'tuple' and _passes_on(m, body, index):
          return ev(init.operands[index])
      return None
    if shape is None:
      return None
    if math.prod(shape) > self.LIMIT:
      return None
    if op == 'constant':
      body = inst.split()[0]
      if '...' in body:
        return None
      text = body.replace('{', ' ').replace('}', ' ').replace('true', '1').replace('false', '0')
      numbers = re.findall(r'-?\d+(?:\.\d*)?(?:e[-+]?\d+)?', text)
      if len(numbers) != max(1, math.prod(shape)):
        return None
      return np.array([float(x) for x in numbers]).reshape(shape)
    if op == 'iota':
      dim = int(re.search(r'iota_dimension=(\d+)', inst.rest).group(1))
      idx = np.arange(shape[dim]).reshape([-1 if i == dim else 1 for i in range(len(shape))])
      return np.broadcast_to(idx, shape).astype(float)
    args = [ev(o) for o in operands]
    if op not in ('dynamic-slice', 'reduce', 'select', 'fusion') and any(a is None for a in args):
      return None
    dtype = arrays(inst.type_text)[0].dtype if arrays(inst.type_text) else 'f32'
    integer = dtype.startswith(('s', 'u', 'pred'))
    if op in ('copy', 'bitcast', 'reshape', 'convert'):
      value = np.asarray(args[0]).reshape(shape)
      return np.trunc(value) if integer else value
    if op == 'broadcast':
      dims = [int(d) for d in re.search(r'dimensions=\{([\d,]*)\}', inst.rest).group(1)
              .split(',') if d]
      src = np.asarray(args[0])
      view = [1] * len(shape)
      for i, d in enumerate(dims):
        view[d] = src.shape[i]
      return np.broadcast_to(src.reshape(view), shape)
    if op == 'slice':
      spans = re.findall(r'\[(\d+):(\d+)(?::(\d+))?\]', inst.rest)
      index = tuple(slice(int(lo), int(hi), int(st or 1)) for lo, hi, st in spans)
      return np.asarray(args[0])[index]
    if op == 'dynamic-slice':
      if args[0] is None or any(a is None for a in args[1:]):
        return None
      src = np.asarray(args[0])
      sizes = [int(d) for d in re.search(r'dynamic_slice_sizes=\{([\d,]*)\}', inst.rest)
               .group(1).split(',') if d]
      starts = [int(np.clip(int(np.asarray(a).reshape(())), 0, src.shape[i] - sizes[i]))
                for i, a in enumerate(args[1:])]
      return src[tuple(slice(st, st + sz) for st, sz in zip(starts, sizes))]
    if op == 'reduce':
      half = len(operands) // 2
      if half != 1 or args[0] is None:
        return None
      called = dict(_CALLS.findall(inst.rest)).get('to_apply', '')
      root = _root(m, called)
      fn = self._REDUCE.get(root.opcode if root is not None else '')
      dims = tuple(int(d) for d in re.search(r'dimensions=\{([\d,]*)\}', inst.rest)
                   .group(1).split(',') if d)
      if fn is None:
        return None
      return np.asarray(fn(np.asarray(args[0]), axis=dims)).reshape(shape)
    unary = {'negate': np.negative, 'abs': np.abs, 'not': np.logical_not, 'sign': np.sign,
             'floor': np.floor, 'ceil': np.ceil}.get(op)
    if unary is not None:
      return unary(np.asarray(args[0]))
    if op == 'divide':
      q = np.asarray(args[0]) / np.asarray(args[1])
      return np.trunc(q) if integer else q
    if op in self._BINARY:
      value = self._BINARY[op](np.asarray(args[0]), np.asarray(args[1]))
      return np.trunc(value) if integer else value
    if op in self._BITWISE:
      ints, logical = self._BITWISE[op]
      if dtype == 'pred':
        return None if logical is None else logical(np.asarray(args[0]), np.asarray(args[1]))
      a, b = (np.asarray(x).astype(np.int64) for x in args[:2])
      if op == 'shift-right-logical' and (a < 0).any():
        return None
      return ints(a, b).astype(float)
    if op == 'compare':
      direction = re.search(r'direction=(\w+)', inst.rest).group(1)
      return self._COMPARE[direction](np.asarray(args[0]), np.asarray(args[1]))
    if op == 'select':
      if any(a is None for a in args):
        return None
      return np.where(np.asarray(args[0]).astype(bool), args[1], args[2])
    if op == 'clamp':
      return np.clip(args[1], args[0], args[2])
    if op == 'fusion':
      called = dict(_CALLS.findall(inst.rest)).get('calls', '')
      inner = {}
      for p in m.computations.get(called, []):
        if p.opcode == 'parameter':
          k = int(re.match(r'\s*(\d+)', p.rest).group(1))
          if k < len(args):
            if args[k] is None:
              continue  # Unknown: fails only if the root needs it.
            inner[p.name] = args[k]
      root = _root(m, called)
      if root is None:
        return None
      value = self(root.name, inner, depth + 1)
      return None if value is None else np.asarray(value).reshape(shape)
    return None


def _passes_on(module: _Module, body: str, index: int) -> bool:
  """Whether a loop body returns element `index` of its tuple parameter unchanged."""
  root = _root(module, body)
  param = next((i.name for i in module.computations.get(body, []) if i.opcode == 'parameter'),
               None)
  if root is None or root.opcode != 'tuple' or index >= len(root.operands):
    return False
  element = module.by_name.get(root.operands[index])
  return bool(element is not None and element.opcode == 'get-tuple-element'
              and element.operands and element.operands[0] == param
              and re.search(rf'index={index}\b', element.rest))


def _counter(module: _Module, loop: _Instruction) -> tuple[int, int] | None:
  """(tuple index, step) of a while loop's counter: an element its condition compares and its
  body steps by a constant (an add, or a fusion of one)."""
  calls = dict(_CALLS.findall(loop.rest))
  compare, outer = _compare(module, calls.get('condition', ''))
  if compare is None:
    return None
  body = calls.get('body', '')
  body_root = _root(module, body)
  body_param = next((i.name for i in module.computations.get(body, [])
                     if i.opcode == 'parameter'), None)
  for o in compare.operands:
    found = _scalar(module, o, outer)
    if not found or found[0] != 'element':
      continue
    index = found[1]
    if body_root is None or body_root.opcode != 'tuple' or index >= len(body_root.operands):
      continue
    steps = set()
    for at in (0, 1000):
      value = _Evaluator(module, lambda name, i, at=at: (
          np.array(float(at)) if name == body_param and i == index else None))(
              body_root.operands[index])
      steps.add(None if value is None or np.size(value) != 1
                else int(np.asarray(value).reshape(())) - at)
    step = steps.pop() if len(steps) == 1 else None
    if step:
      return index, step
  return None


def _compare(module: _Module, condition: str):
  """(the compare that ends a loop's condition, {fused parameter: condition instruction} when
  it sits in a fusion) or (None, None)."""
  compare, outer = _root(module, condition), None
  if compare is not None and compare.opcode == 'fusion':
    fused = dict(_CALLS.findall(compare.rest)).get('calls', '')
    params = {}
    for p in module.computations.get(fused, []):
      if p.opcode == 'parameter':
        m = re.match(r'\s*(\d+)', p.rest)
        if m and int(m.group(1)) < len(compare.operands):
          params[p.name] = compare.operands[int(m.group(1))]
    compare, outer = _root(module, fused), params
  if compare is None or compare.opcode != 'compare' or len(compare.operands) != 2:
    return None, None
  return compare, outer


def _inferred_trip(module: _Module, loop: _Instruction, lookup=None) -> int | None:
  """The trip count of a while loop whose condition compares its counter (an element its body
  steps by a constant) with a bound: a constant, or an expression of the loop's other elements
  that the body leaves unchanged, evaluated from their initial values (`_Evaluator`; `lookup`
  gives the values of the enclosing computation's parameters, e.g. an outer loop's counter:
  the key chunks of each query block of a blocked attention loop). None when it cannot be
  read. The TPU compiler does not record known_trip_count; XLA:CPU does."""
  calls = dict(_CALLS.findall(loop.rest))
  counter = _counter(module, loop)
  compare, outer = _compare(module, calls.get('condition', ''))
  init = module.by_name.get(loop.operands[0]) if loop.operands else None
  if counter is None or compare is None or init is None or init.opcode != 'tuple':
    return None
  index, step = counter
  lookup = lookup or (lambda name, i: None)
  outer_eval = _Evaluator(module, lookup)
  body_root = _root(module, calls.get('body', ''))
  body_param = next((i.name for i in module.computations.get(calls.get('body', ''), [])
                     if i.opcode == 'parameter'), None)

  def invariant(j: int) -> bool:
    if body_root is None or body_root.opcode != 'tuple' or j >= len(body_root.operands):
      return False
    element = module.by_name.get(body_root.operands[j])
    return (element is not None and element.opcode == 'get-tuple-element'
            and element.operands and element.operands[0] == body_param
            and f'index={j}' in element.rest)

  def initial(name, j):  # The condition's tuple elements: their values before the first trip.
    if j is None or j == index or j >= len(init.operands) or not invariant(j):
      return None
    return outer_eval(init.operands[j])

  start = outer_eval(init.operands[index]) if index < len(init.operands) else None
  cond_eval = _Evaluator(module, initial)
  fused = {}
  for param, name in (outer or {}).items():  # The compare sits in a fusion of the condition.
    value = cond_eval(name)
    if value is not None:
      fused[param] = value
  sides = []
  for o in compare.operands:
    found = _scalar(module, o, outer)
    sides.append(None if found == ('element', index) else cond_eval(o, fused))
  if start is None or sides.count(None) != 1:
    return None
  direction = re.search(r'direction=(\w+)', compare.rest).group(1)
  limit = sides[1] if sides[0] is None else sides[0]
  if sides[0] is not None:  # bound OP counter: flip to counter OP bound.
    direction = {'LT': 'GT', 'GT': 'LT', 'LE': 'GE', 'GE': 'LE'}.get(direction, direction)
  if np.size(limit) != 1 or np.size(start) != 1:
    return None
  start, limit = int(np.asarray(start).reshape(())), int(np.asarray(limit).reshape(()))
  if step > 0 and direction in ('LT', 'LE', 'NE'):
    span = limit - start + (1 if direction == 'LE' else 0)
    return max(0, -(-span // step))
  if step < 0 and direction in ('GT', 'GE', 'NE'):
    span = start - limit + (1 if direction == 'GE' else 0)
    return max(0, -(-span // -step))
  return None


def trip_count(module: _Module, loop: _Instruction, lookup=None) -> int | None:
  """A while loop's trip count: XLA's known_trip_count, else inferred from its condition."""
  trip = _TRIP.search(loop.rest)
  if trip:
    return int(trip.group(1))
  return _inferred_trip(module, loop, lookup)


def loop_trips(module: _Module, loop: _Instruction,
               contexts: list | None) -> tuple[float | None, list | None]:
  """(the mean trip count of a while loop over the runs of the loop around it, the contexts
  of its own body: one lookup per trip, giving the value of its counter), (None, None) when
  unknown. `contexts`: one lookup per run of the enclosing loop's body (None at top level)."""
  trips = []
  for lookup in contexts or [None]:
    trip = trip_count(module, loop, lookup)
    if trip is None:
      return None, None
    trips.append(trip)
  mean = sum(trips) / len(trips)
  counter = _counter(module, loop)
  calls = dict(_CALLS.findall(loop.rest))
  body = calls.get('body', '')
  body_param = next((i.name for i in module.computations.get(body, [])
                     if i.opcode == 'parameter'), None)
  own = None
  init = module.by_name.get(loop.operands[0]) if loop.operands else None
  if counter is not None and body_param and len(set(trips)) == 1 and init is not None \
      and init.opcode == 'tuple' and trips[0] <= 4096:
    index, step = counter
    parent = _Evaluator(module, (contexts or [None])[0] or (lambda n, i: None))
    start = parent(init.operands[index])
    body_root = _root(module, body)
    cache = {}

    def invariant(j):  # An element the body passes on unchanged: its value before the loop.
      if j not in cache:
        element = (module.by_name.get(body_root.operands[j])
                   if body_root is not None and body_root.opcode == 'tuple'
                   and j < len(body_root.operands) and j < len(init.operands) else None)
        same = (element is not None and element.opcode == 'get-tuple-element'
                and element.operands and element.operands[0] == body_param
                and re.search(rf'index={j}\b', element.rest))
        cache[j] = parent(init.operands[j]) if same else None
      return cache[j]

    if start is not None and np.size(start) == 1:
      first = int(np.asarray(start).reshape(()))

      def context(value):
        def lookup(name, i):
          if name != body_param or i is None:
            return None
          return np.array(float(value)) if i == index else invariant(i)
        return lookup

      own = [context(first + t * step) for t in range(trips[0])]
  return mean, own


# --- dot_flops: the matmul FLOPs alone. ------------------------------------------------------

@dataclasses.dataclass
class Work:
  """What `dot_flops` found.

  Attributes:
    flops: FLOPs of every matmul, times the trip counts of its loops (2 per multiply-add).
    unknown_loops: while loops executed whose trip count XLA does not know (counted once).
    by_op: the same FLOPs by the op_name metadata of the matmul (the JAX source op).
  """
  flops: float = 0.0
  unknown_loops: int = 0
  by_op: dict = dataclasses.field(default_factory=lambda: collections.defaultdict(float))

  def top(self, k: int = 10) -> list[tuple[str, float]]:
    """The k source ops with the most FLOPs."""
    return sorted(self.by_op.items(), key=lambda kv: -kv[1])[:k]


def dot_flops(hlo: str) -> Work:
  """The FLOPs of every dot and convolution in the optimized HLO module `hlo`, loops
  multiplied in."""
  module = _parse(hlo)
  work = Work()
  memo: dict[str, tuple[float, int, dict]] = {}

  def visit(name: str, contexts: list | None = None) -> tuple[float, int, dict]:
    if name in memo:
      return memo[name]
    flops, unknown, by_op = 0.0, 0, collections.defaultdict(float)

    def add(sub: tuple[float, int, dict], times: float = 1.0):
      nonlocal flops, unknown
      flops += times * sub[0]
      unknown += sub[1]
      for k, v in sub[2].items():
        by_op[k] += times * v

    for inst in module.computations.get(name, []):
      if inst.opcode in ('dot', 'convolution'):
        f = _matmul_flops(inst, module)
        flops += f
        op = _OP_NAME.search(inst.rest)
        by_op[op.group(1) if op else inst.name] += f
      elif inst.opcode == 'while':
        calls = dict(_CALLS.findall(inst.rest))
        trip, inner = loop_trips(module, inst, contexts)
        times = float(trip) if trip is not None else 1.0
        add(visit(calls['body'], inner), times)
        add(visit(calls['condition'], inner), times)
        if trip is None:
          unknown += 1
      elif inst.opcode == 'conditional':
        names = _branches(inst)
        if names:
          add(max((visit(b) for b in names), key=lambda s: s[0]))
      else:
        for kind, called in _CALLS.findall(inst.rest):
          if kind == 'calls' or (kind == 'to_apply' and inst.opcode == 'call'):
            add(visit(called, contexts if inst.opcode == 'call' else None))  # Once each.
    memo[name] = (flops, unknown, dict(by_op))
    return memo[name]

  flops, unknown, by_op = visit(module.entry)
  work.flops, work.unknown_loops = flops, unknown
  work.by_op.update(by_op)
  return work


def compiled_dot_flops(jitted, *args) -> Work:
  """`dot_flops` of `jitted` (a jax.jit function) compiled for `args`."""
  return dot_flops(jitted.lower(*args).compile().as_text())


def _branches(inst: _Instruction) -> list[str]:
  branches = _BRANCHES.search(inst.rest)
  if branches:
    return [b.strip().lstrip('%') for b in branches.group(1).split(',') if b.strip()]
  found = re.findall(r'(?:true|false)_computation=%?([\w.\-]+)', inst.rest)
  return found


# --- Collectives. -----------------------------------------------------------------------------

def _iota_groups(text: str) -> list[list[int]] | None:
  """Groups of the iota form '[G,S]<=[dims]' or '[G,S]<=[dims]T(perm)'."""
  m = re.match(r'\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?', text)
  if not m:
    return None
  shape = [int(x) for x in m.group(1).split(',')]
  dims = [int(x) for x in m.group(2).split(',')]
  ids = np.arange(math.prod(dims)).reshape(dims)
  if m.group(3):
    ids = ids.transpose([int(x) for x in m.group(3).split(',')])
  return ids.reshape(shape[0], -1).tolist()


def _mesh_groups(text: str) -> list[list[int]] | None:
  """Groups of the mesh form "mesh['a'=4,'b'=2] {'a'}": devices in row-major order of the
  axes; one group per position of the axes not named."""
  m = re.match(r"mesh\[([^\]]*)\]\s*\{([^}]*)\}", text)
  if not m:
    return None
  axes = re.findall(r"'([^']+)'\s*=\s*(\d+)", m.group(1))
  if not axes:
    return None
  names = [a for a, _ in axes]
  sizes = [int(s) for _, s in axes]
  named = re.findall(r"'([^']+)'", m.group(2))
  if any(n not in names for n in named):
    return None
  ids = np.arange(math.prod(sizes)).reshape(sizes)
  inside = [names.index(n) for n in named]
  outside = [i for i in range(len(names)) if i not in inside]
  ids = ids.transpose(outside + inside)
  size = math.prod(sizes[i] for i in inside) if inside else 1
  return ids.reshape(-1, size).tolist()


def replica_groups(attributes: str) -> list[list[int]] | None:
  """The device groups of a collective from its attributes; [] for 'every device'; None when
  the form is not understood."""
  pairs = re.search(r'source_target_pairs=\{(.*?)\}\}', attributes)
  if pairs:
    return [[int(x) for x in p.split(',')] for p in re.findall(r'\{([\d,]+)\}', pairs.group(0))]
  m = re.search(r'replica_groups=(.*)', attributes)
  if not m:
    return []
  text = m.group(1).strip()
  if text.startswith('{}'):
    return []
  if text.startswith('{'):
    depth, end = 0, 0
    for i, ch in enumerate(text):
      depth += ch == '{'
      depth -= ch == '}'
      if depth == 0:
        end = i
        break
    return [[int(x) for x in g.split(',') if x.strip()]
            for g in re.findall(r'\{([\d,\s]*)\}', text[1:end])]
  if text.startswith('['):
    return _iota_groups(text)
  if text.startswith('mesh['):
    return _mesh_groups(text)
  return None


@dataclasses.dataclass
class Collective:
  """One collective instruction as it runs.

  Attributes:
    name: the instruction.
    kind: one of COLLECTIVES.
    bytes: its result's bytes on each device, once (all-gather: the gathered array;
      reduce-scatter: the shard; collective-permute: the buffer received).
    groups: the device groups (logical device ids of the program), [] for all devices, None
      when not understood.
    times: how many times it runs per execution of the program.
    op_name: the JAX source op.
    channel: its channel_id: the TPU compiler copies one collective into each fusion that
      carries a part of its transfer (async collective fusions); the copies share it and
      count once.
    over_dcn: a transfer between slices over the data-center network (the TPU compiler writes
      one as a host-transfer send to the megascale runtime).
    participants: for a transfer between slices, how many take part (None: unknown).
  """
  name: str
  kind: str
  bytes: int
  groups: list[list[int]] | None
  times: float = 1.0
  op_name: str = ''
  channel: int | None = None
  over_dcn: bool = False
  participants: int | None = None

  def group_size(self, devices: int, slices: int = 1) -> int:
    """Devices taking part in each group (`devices` when every device, or unknown; for a
    transfer between slices, its participants, else `slices`)."""
    if self.over_dcn:
      return self.participants or max(2, slices)
    if self.kind == 'collective-permute':
      return 2
    if not self.groups:
      return devices
    return max(len(g) for g in self.groups)

  def traffic(self, devices: int, slices: int = 1) -> float:
    """Bytes each device sends over links in one run: the ring algorithm's volume (all-gather
    and all-to-all (n-1)/n of the result, reduce-scatter (n-1) shards, all-reduce twice
    (n-1)/n, a permute its buffer)."""
    n = self.group_size(devices, slices)
    if n <= 1:
      return 0.0
    b = float(self.bytes)
    return {'all-gather': b * (n - 1) / n, 'all-to-all': b * (n - 1) / n,
            'reduce-scatter': b * (n - 1), 'all-reduce': 2 * b * (n - 1) / n,
            'collective-permute': b}.get(self.kind, b)

  def spans(self, slice_of) -> bool:
    """Whether a group holds devices of different slices (its bytes cross the data-center
    network); `slice_of[i]` is logical device i's slice."""
    if self.over_dcn:
      return True
    if slice_of is None or len(set(slice_of)) <= 1:
      return False
    groups = self.groups
    if not groups:  # Every device (or unknown): crosses slices when there are several.
      return True
    return any(len({slice_of[i] for i in g if i < len(slice_of)}) > 1 for g in groups)


def _collective(inst: _Instruction, module: _Module, times: float) -> Collective:
  kind = _COLLECTIVE_OPS[inst.opcode]
  shape = inst.type_text
  if inst.opcode in ('all-gather-start', 'collective-permute-start'):
    elements = tuple_elements(shape)
    shape = elements[1] if len(elements) > 1 else shape
  if kind == 'all-reduce' and inst.computation.startswith(_REDUCE_SCATTER_FUSION):
    kind, shape = 'reduce-scatter', module.results.get(inst.computation, shape)
  op = _OP_NAME.search(inst.rest)
  channel = re.search(r'channel_id=(\d+)', inst.rest)
  return Collective(name=inst.name, kind=kind, bytes=array_bytes(shape),
                    groups=replica_groups(inst.attributes), times=times,
                    op_name=op.group(1) if op else '',
                    channel=int(channel.group(1)) if channel else None)


_MEGASCALE = re.compile(r'_xla_megascale_transfer_type="(\w+)"')
_MEGASCALE_KINDS = {'ALL_REDUCE': 'all-reduce', 'ALL_GATHER': 'all-gather',
                    'REDUCE_SCATTER': 'reduce-scatter', 'ALL_TO_ALL': 'all-to-all'}


def _megascale(inst: _Instruction, times: float) -> Collective | None:
  """A transfer between slices: the TPU compiler's host-transfer send to the megascale runtime
  (_xla_megascale_transfer_type, _xla_megascale_target='{slices}x{devices}'); None for any
  other send."""
  transfer = _MEGASCALE.search(inst.rest)
  if inst.opcode != 'send' or not transfer:
    return None
  elements = tuple_elements(inst.type_text)
  target = re.search(r'_xla_megascale_target="\{([\d,]+)\}', inst.rest)
  participants = math.prod(int(x) for x in target.group(1).split(',')) if target else None
  op = _OP_NAME.search(inst.rest)
  return Collective(name=inst.name, kind=_MEGASCALE_KINDS.get(transfer.group(1), 'all-reduce'),
                    bytes=array_bytes(elements[0]), groups=None, times=times,
                    op_name=op.group(1) if op else '', over_dcn=True,
                    participants=participants if participants and participants > 1 else None)


def collectives(hlo: str) -> dict[str, dict[str, int]]:
  """Count and result bytes of each kind of collective instruction in a compiled module, each
  instruction once wherever it sits (entry, loop body, fusion, async wrapper; not multiplied
  by trip counts: `analyze` does that): an asynchronous pair counts at its -start (the result
  of all-gather-start and collective-permute-start holds the operand, then the result: the
  result is counted). The TPU compiler's reduce-scatter fusion (an all-reduce whose result is
  sliced to the device's shard) counts as a reduce-scatter of its sliced result.

  Returns:
    {kind: {'count': n, 'bytes': b}} for each kind in COLLECTIVES (zeros when absent).
  """
  module = _parse(hlo)
  out = {kind: {'count': 0, 'bytes': 0} for kind in COLLECTIVES}
  seen = set()
  for insts in module.computations.values():
    for inst in insts:
      if inst.opcode in _COLLECTIVE_OPS or _megascale(inst, 1.0):
        c = _megascale(inst, 1.0) or _collective(inst, module, 1.0)
        if c.channel is not None:
          if c.channel in seen:
            continue
          seen.add(c.channel)
        out[c.kind]['count'] += 1
        out[c.kind]['bytes'] += c.bytes
  return out


# --- analyze: kernels, bytes and collectives. -----------------------------------------------

@dataclasses.dataclass
class Kernel:
  """One launched kernel (a top-level fusion, custom call or unfused op) as it runs.

  Attributes:
    name: the instruction.
    opcode: its opcode ('fusion', 'custom-call', 'dot', ...).
    flops: matmul FLOPs per run by the peak they run at (`_flops_class`).
    bytes: HBM bytes read and written per run.
    times: runs per execution of the program.
    source: 'xla' (the compiler's own op), 'analytic' (a custom call counted from its own
      cost model: splash) or 'opaque' (a custom call whose FLOPs are unknown).
    op_name: the JAX source op.
  """
  name: str
  opcode: str
  flops: dict[str, float]
  bytes: float
  times: float = 1.0
  source: str = 'xla'
  op_name: str = ''

  @property
  def total_flops(self) -> float:
    return sum(self.flops.values())


@dataclasses.dataclass
class Cost:
  """What `analyze` found in a program, per device and per execution.

  Attributes:
    kernels: every kernel launched (a kernel in a loop is one entry with its `times`).
    collectives: every collective run.
    unknown_loops: while loops of unknown trip count (counted once).
    opaque: {custom call target: runs} of custom calls counted without FLOPs.
    notes: what the count could not read (e.g. a splash mask not in the text).
  """
  kernels: list[Kernel] = dataclasses.field(default_factory=list)
  collectives: list[Collective] = dataclasses.field(default_factory=list)
  unknown_loops: int = 0
  opaque: dict[str, float] = dataclasses.field(default_factory=dict)
  notes: list[str] = dataclasses.field(default_factory=list)

  @property
  def flops(self) -> float:
    return sum(k.times * k.total_flops for k in self.kernels)

  def flops_by_class(self) -> dict[str, float]:
    out = collections.defaultdict(float)
    for k in self.kernels:
      for c, f in k.flops.items():
        out[c] += k.times * f
    return dict(out)

  @property
  def bytes(self) -> float:
    return sum(k.times * k.bytes for k in self.kernels)

  @property
  def launches(self) -> float:
    return sum(k.times for k in self.kernels)

  def collective_summary(self) -> dict[str, dict[str, float]]:
    """{kind: {'count': runs, 'bytes': result bytes over all runs}}."""
    out = {kind: {'count': 0.0, 'bytes': 0.0} for kind in COLLECTIVES}
    for c in self.collectives:
      out[c.kind]['count'] += c.times
      out[c.kind]['bytes'] += c.times * c.bytes
    return out

  def top(self, k: int = 10, key=lambda kernel: kernel.bytes) -> list[Kernel]:
    return sorted(self.kernels, key=lambda kernel: -kernel.times * key(kernel))[:k]


def _through_views(module: _Module, computation: str, name: str) -> list[_Instruction]:
  """The users of `name` inside `computation`, looking through bitcasts and reshapes."""
  users = []
  for inst in module.computations.get(computation, []):
    if name in inst.operands:
      if inst.opcode in ('bitcast', 'reshape'):
        users.extend(_through_views(module, computation, inst.name))
      else:
        users.append(inst)
  return users


def _fusion_bytes(inst: _Instruction, module: _Module, fused: str) -> float:
  """HBM bytes of a fusion: each operand (only the slices read when the fused computation only
  slices it, nothing when it is the buffer of an in-place update) and each output (only the
  update when the root updates a slice in place)."""
  params = {}
  for p in module.computations.get(fused, []):
    if p.opcode == 'parameter':
      m = re.match(r'\s*(\d+)', p.rest)
      if m:
        params[int(m.group(1))] = p
  total = 0.0
  for i, operand in enumerate(inst.operands):
    producer = module.by_name.get(operand)
    if producer is None:
      continue
    full = sum(a.hbm_bytes for a in arrays(producer.type_text))
    if not full:
      continue
    param = params.get(i)
    users = _through_views(module, fused, param.name) if param else []
    if users and all((u.opcode in _SLICING and u.operands and u.operands[0] == param.name)
                     or (u.opcode == 'dynamic-update-slice' and u.operands
                         and u.operands[0] == param.name) for u in users):
      read = sum(sum(a.bytes for a in arrays(u.type_text))
                 for u in users if u.opcode in _SLICING)
      total += min(full, read)
    else:
      total += full
  total += _output_bytes(inst, module, fused)
  return total


def _output_bytes(inst: _Instruction, module: _Module, fused: str) -> float:
  outputs = arrays(inst.type_text)
  insts = module.computations.get(fused, [])
  root = insts[-1] if insts else None
  roots = [root] if root is not None else []
  if root is not None and root.opcode == 'tuple':
    roots = [module.by_name.get(o) for o in root.operands]
  if len(roots) != len(outputs):
    return float(sum(a.hbm_bytes for a in outputs))
  total = 0.0
  for out, r in zip(outputs, roots):
    while r is not None and r.opcode in ('bitcast', 'reshape'):
      r = module.by_name.get(r.operands[0]) if r.operands else None
    if out.memory_space == 0 and r is not None and r.opcode == 'dynamic-update-slice':
      update = module.by_name.get(r.operands[1]) if len(r.operands) > 1 else None
      total += sum(a.bytes for a in arrays(update.type_text)) if update else out.bytes
    else:
      total += out.hbm_bytes
  return total


def _only_collective(module: _Module, computation: str) -> bool:
  """Whether a fused computation holds nothing but collectives and their async wrapping (the
  TPU compiler also fuses a collective's start into a compute kernel: that one is a kernel)."""
  for inst in module.computations.get(computation, []):
    if inst.opcode in _COLLECTIVE_OPS or inst.opcode in _FREE:
      continue
    target = _TARGET.search(inst.rest) if inst.opcode == 'custom-call' else None
    if target and target.group(1) in _FREE_TARGETS:
      continue
    return False
  return True


def _plain_bytes(inst: _Instruction, module: _Module) -> float:
  """HBM bytes of an unfused op: its operands and outputs, or only the slice an op reads or
  updates in place."""
  out = sum(a.hbm_bytes for a in arrays(inst.type_text))
  ops = [module.by_name.get(o) for o in inst.operands]
  op_bytes = [sum(a.hbm_bytes for a in arrays(p.type_text)) if p else 0 for p in ops]
  if inst.opcode in _SLICING:
    return 2.0 * out + sum(op_bytes[1:])
  if inst.opcode in ('dynamic-update-slice', 'scatter'):
    update = op_bytes[-1] if inst.opcode == 'scatter' else (op_bytes[1] if len(op_bytes) > 1
                                                            else out)
    return 2.0 * update + sum(op_bytes[2:-1] if inst.opcode == 'scatter' else op_bytes[2:])
  if inst.opcode == 'copy-start':
    elements = tuple_elements(inst.type_text)
    dest = sum(a.hbm_bytes for a in arrays(elements[0])) if elements else 0
    return float(sum(op_bytes) + dest)
  if inst.opcode == 'slice-start':  # ((the operand), the slice, a flag): the slice moves.
    elements = tuple_elements(inst.type_text)
    piece = arrays(elements[1]) if len(elements) > 1 else []
    source_in_hbm = bool(ops and ops[0] and arrays(ops[0].type_text)
                         and arrays(ops[0].type_text)[0].memory_space == 0)
    return float(sum(a.bytes for a in piece) * source_in_hbm + sum(a.hbm_bytes for a in piece))
  return float(out + sum(op_bytes))


# --- Mosaic kernels. ----------------------------------------------------------------------------

def _invariants(module: _Module):
  """A lookup for `_Evaluator`: the value of element i of a loop body's (or condition's) tuple
  parameter when the body passes that element on unchanged, from the loop's initial tuple (a
  constant table carried into a scanned layer stack, for instance)."""
  loops = {}
  for insts in module.computations.values():
    for inst in insts:
      if inst.opcode == 'while':
        calls = dict(_CALLS.findall(inst.rest))
        for kind in ('body', 'condition'):
          if kind in calls:
            loops[calls[kind]] = (inst, calls.get('body', ''))
  params = {i.name: c for c, insts in module.computations.items() for i in insts
            if i.opcode == 'parameter'}
  memo = {}

  def lookup(name, index):
    if index is None or (name, index) in memo:
      return memo.get((name, index))
    memo[(name, index)] = None  # Cycles read as unknown.
    found = loops.get(params.get(name, ''))
    if found is None:
      return None
    loop, body = found
    init = module.by_name.get(loop.operands[0]) if loop.operands else None
    root = _root(module, body)
    body_param = next((i.name for i in module.computations.get(body, [])
                       if i.opcode == 'parameter'), None)
    if (init is None or init.opcode != 'tuple' or root is None or root.opcode != 'tuple'
        or index >= len(init.operands) or index >= len(root.operands)):
      return None
    element = module.by_name.get(root.operands[index])
    if not (element is not None and element.opcode == 'get-tuple-element'
            and element.operands and element.operands[0] == body_param
            and re.search(rf'index={index}\b', element.rest)):
      return None
    memo[(name, index)] = evaluator(init.operands[index])
    return memo[(name, index)]

  evaluator = _Evaluator(module, lookup)
  return evaluator


def _constant_values(module: _Module, name: str) -> np.ndarray | None:
  """The values of an integer array that is a constant of the program (through copies,
  bitcasts, broadcasts of a scalar and the tuples of the loops that carry it), when the text
  holds them."""
  if module.constants is None:
    module.constants = _invariants(module)
  value = module.constants(name)
  return None if value is None else np.asarray(value).astype(np.int64)


def _splash(inst: _Instruction, module: _Module, cost: Cost) -> tuple[dict, float] | None:
  """(FLOPs by class, HBM bytes) of one call of the splash attention kernel (jax's
  splash_attention_kernel: fwd, dq or dkv phase, from the instruction's name), from the
  kernel's non-empty blocks; None when this is not a splash call."""
  op = _OP_NAME.search(inst.rest)
  phase = re.search(r'splash_(?:mha|mqa)_(fwd|dq|dkv)',
                    inst.name + ' ' + (op.group(1) if op else ''))
  if not phase:
    return None
  phase = phase.group(1)
  operands = [module.by_name.get(o) for o in inst.operands]
  if len(operands) < 6 or any(o is None for o in operands[:6]):
    return None
  shapes = [o.shape for o in operands]
  # The prefetched block tables come first: data_next, block_mask, mask_next, each
  # (heads or head shards, rows of blocks, columns of blocks), whichever are present.
  tables = 0
  while (tables < len(shapes) and shapes[tables] is not None and len(shapes[tables]) == 3
         and arrays(operands[tables].type_text)[0].dtype.startswith(('s', 'u'))
         and shapes[tables] == shapes[0]):
    tables += 1
  if tables < 1 or tables + 3 > len(operands):
    return None
  q, k, v = operands[tables:tables + 3]
  if not (len(q.shape) >= 3 and len(k.shape) == len(q.shape) and len(v.shape) == len(q.shape)):
    return None
  # (heads, length, head_dim), with leading batch dimensions when the call is vmapped (one
  # kernel run per row).
  rows_of_calls = math.prod(q.shape[:-3])
  heads, n_q, d = q.shape[-3:]
  n_kv, dv = k.shape[-2], v.shape[-1]
  rows, cols = shapes[0][1], shapes[0][2]
  metadata = re.search(r'"xprof_metadata":"(\{.*?\})"', inst.rest.replace('\\"', '"'))
  sizes = {}
  if metadata:
    try:
      sizes = json.loads(metadata.group(1))
    except ValueError:
      sizes = {}
  suffix = {'fwd': '', 'dq': '_dq', 'dkv': '_dkv'}[phase]
  bq = int(sizes.get(f'block_q{suffix}', 0)) or max(1, n_q // rows if phase != 'dkv'
                                                     else n_q // cols)
  bkv = int(sizes.get(f'block_kv{suffix}', 0)) or max(1, n_kv // cols if phase != 'dkv'
                                                       else n_kv // rows)
  mask_index = 1 if tables == 3 else 0
  block_mask = _constant_values(module, inst.operands[mask_index]) if tables >= 2 else None
  if block_mask is not None and tables >= 2:
    blocks = float(np.count_nonzero(block_mask)) * heads / max(1, block_mask.shape[0])
  else:
    blocks = float(rows * cols * heads)
    cost.notes.append(f'{inst.name}: splash block table not in the text; every block of the '
                      'grid counted')
  blocks *= rows_of_calls
  area = float(bq * bkv)
  outputs = tuple_elements(inst.type_text)
  big_outputs = [o for o in outputs if (_shape(o) or ()) and len(_shape(o)) >= len(q.shape)]
  matmuls = {'fwd': d + dv, 'dq': 2 * d + dv,
             'dkv': 2 * d + 2 * dv + (d if len(big_outputs) >= 3 else 0)}[phase]
  flops = 2.0 * blocks * area * matmuls
  itemsize = BITS[arrays(q.type_text)[0].dtype] // 8
  streamed = k if phase != 'dkv' else q
  stream_rows = bkv if phase != 'dkv' else bq
  in_hbm = arrays(streamed.type_text)[0].memory_space == 0
  once = _plain_bytes(inst, module)
  stream = blocks * stream_rows * (d + dv) * itemsize if in_hbm else 0.0
  klass = _flops_class(_Instruction(inst.name, q.type_text, 'dot', '%' + q.name + ')'), module)
  return {klass: flops}, once + stream


_COST_ESTIMATE = re.compile(r'"cost_estimate":\{"flops":"?(\d+)"?,[^}]*?'
                            r'"bytes_accessed":"?(\d+)"?')


def _estimated(inst: _Instruction, module: _Module, cost: Cost) -> tuple[dict, float] | None:
  """(FLOPs, HBM bytes) of a Mosaic kernel that states its own cost (pallas_call's
  cost_estimate): the project's fused attention kernel computes it from its block table
  (models/attention/pallas_kernel.py). FLOPs are classed by the kernel's first floating
  operand (after its scalar-prefetched tables). None when the call states none."""
  del cost
  found = _COST_ESTIMATE.search(inst.rest.replace('\\"', '"'))
  if not found or not int(found.group(1)):
    return None
  floating = next((o for o in inst.operands if module.by_name.get(o) is not None
                   and arrays(module.by_name[o].type_text)
                   and arrays(module.by_name[o].type_text)[0].dtype.startswith(('bf', 'f'))),
                  None)
  klass = (_flops_class(_Instruction(inst.name, '', 'dot', '%' + floating + ')'), module)
           if floating else 'f32')
  return {klass: float(found.group(1))}, float(found.group(2))


def _mosaic(inst: _Instruction, module: _Module, cost: Cost) -> tuple[dict, float] | None:
  """A Mosaic kernel: splash from its block table, else the cost the kernel states."""
  return _splash(inst, module, cost) or _estimated(inst, module, cost)


# Analytic costs of custom calls by target: fn(instruction, module, cost) -> (FLOPs by class,
# bytes) or None (not this kernel). A kernel's owner may register its own.
CUSTOM_CALL_COSTS = {'tpu_custom_call': _mosaic}


def analyze(hlo: str) -> Cost:
  """The kernels and collectives of the optimized HLO module `hlo`, loops multiplied in (see
  the module's docstring)."""
  module = _parse(hlo)
  cost = Cost()
  fusion_memo: dict[str, tuple[dict, list, int]] = {}

  def fused(name: str) -> tuple[dict, list, int]:
    """(matmul FLOPs by class, collectives, unknown loops) inside a fused computation."""
    if name in fusion_memo:
      return fusion_memo[name]
    flops, colls, unknown = collections.defaultdict(float), [], 0
    for inst in module.computations.get(name, []):
      if inst.opcode in ('dot', 'convolution'):
        flops[_flops_class(inst, module)] += _matmul_flops(inst, module)
      elif inst.opcode in _COLLECTIVE_OPS:
        colls.append(_collective(inst, module, 1.0))
      for kind, called in _CALLS.findall(inst.rest):
        if kind == 'calls' or (kind == 'to_apply' and inst.opcode == 'call'):
          f, c, u = fused(called)
          for k, v in f.items():
            flops[k] += v
          colls.extend(c)
          unknown += u
    fusion_memo[name] = (dict(flops), colls, unknown)
    return fusion_memo[name]

  def program(name: str, times: float, out: Cost, contexts: list | None = None) -> None:
    """Adds the kernels of a computation that runs `times` times (not fused) to `out`;
    `contexts`: the values of its loop counter on each run (`loop_trips`)."""
    for inst in module.computations.get(name, []):
      op = _OP_NAME.search(inst.rest)
      op_name = op.group(1) if op else ''
      if inst.opcode == 'while':
        calls = dict(_CALLS.findall(inst.rest))
        trip, inner = loop_trips(module, inst, contexts)
        n = float(trip) if trip is not None else 1.0
        if trip is None:
          out.unknown_loops += 1
        program(calls['body'], times * n, out, inner)
        program(calls['condition'], times * n, out, inner)
      elif inst.opcode == 'conditional':
        branches = []
        for b in _branches(inst):
          sub = Cost()
          program(b, times, sub)  # A branch's parameter is not the loop's tuple.
          branches.append(sub)
        if branches:
          best = max(branches, key=lambda c: (c.flops, c.bytes))
          out.kernels.extend(best.kernels)
          out.collectives.extend(best.collectives)
          out.unknown_loops += best.unknown_loops
          for k, v in best.opaque.items():
            out.opaque[k] = out.opaque.get(k, 0) + v
          out.notes.extend(best.notes)
      elif inst.opcode == 'call' or (inst.opcode == 'async-start' and 'calls=' in inst.rest):
        for kind, called in _CALLS.findall(inst.rest):
          if kind in ('to_apply', 'calls'):
            program(called, times, out, contexts if inst.opcode == 'call' else None)
      elif inst.opcode in _COLLECTIVE_OPS:
        out.collectives.append(_collective(inst, module, times))
      elif inst.opcode in ('send', 'recv') and 'is_host_transfer=true' in inst.rest:
        between_slices = _megascale(inst, times)  # Counted at its send.
        if between_slices is not None:
          out.collectives.append(between_slices)
      elif inst.opcode == 'fusion':
        called = dict(_CALLS.findall(inst.rest)).get('calls')
        flops, colls, unknown = fused(called) if called else ({}, [], 0)
        out.unknown_loops += unknown
        if colls:
          out.collectives.extend(dataclasses.replace(c, times=times) for c in colls)
          if _only_collective(module, called):  # An async wrapper: no kernel of its own.
            continue
        out.kernels.append(Kernel(inst.name, 'fusion', dict(flops),
                                  _fusion_bytes(inst, module, called) if called else 0.0,
                                  times, 'xla', op_name))
      elif inst.opcode == 'custom-call':
        target = _TARGET.search(inst.rest)
        target = target.group(1) if target else ''
        if target in _FREE_TARGETS:
          continue
        analytic = CUSTOM_CALL_COSTS.get(target)
        found = analytic(inst, module, out) if analytic else None
        if target in _DATA_TARGETS:
          out.kernels.append(Kernel(inst.name, 'custom-call', {}, _plain_bytes(inst, module),
                                    times, 'xla', op_name))
        elif found is not None:
          out.kernels.append(Kernel(inst.name, 'custom-call', found[0], found[1], times,
                                    'analytic', op_name))
        else:
          out.opaque[target] = out.opaque.get(target, 0) + times
          out.kernels.append(Kernel(inst.name, 'custom-call', {}, _plain_bytes(inst, module),
                                    times, 'opaque', op_name))
      elif inst.opcode in ('dot', 'convolution'):
        out.kernels.append(Kernel(inst.name, inst.opcode,
                                  {_flops_class(inst, module): _matmul_flops(inst, module)},
                                  _plain_bytes(inst, module), times, 'xla', op_name))
      elif inst.opcode not in _FREE:
        out.kernels.append(Kernel(inst.name, inst.opcode, {}, _plain_bytes(inst, module),
                                  times, 'xla', op_name))

  program(module.entry, 1.0, cost)
  by_channel: dict[int, Collective] = {}
  unique = []
  for c in cost.collectives:
    if c.channel is None:
      unique.append(c)
    elif c.channel not in by_channel:
      by_channel[c.channel] = c
      unique.append(c)
    else:
      by_channel[c.channel].times = max(by_channel[c.channel].times, c.times)
  cost.collectives = unique
  return cost


def module_text(compiled) -> str:
  """The optimized HLO text of a jax Compiled, with its large constants printed when it calls
  a Mosaic kernel (the splash kernel's block tables are constants that `as_text()` elides);
  `as_text()` otherwise."""
  text = compiled.as_text()
  if 'tpu_custom_call' not in text:
    return text
  try:
    import jaxlib._hlo as hlo_lib  # pylint: disable=import-outside-toplevel
    options = hlo_lib.HloPrintOptions()
    options.print_large_constants = True
    modules = compiled.runtime_executable().hlo_modules()
    return modules[0].to_string(options) if len(modules) == 1 else text
  except Exception:  # pylint: disable=broad-except  (an older jaxlib: the elided text)
    return text
