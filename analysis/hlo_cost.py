"""The work of a compiled program, with its loops counted as many times as they run.

XLA's own `cost_analysis()` counts a while loop's body once. `analyze(hlo)` walks the optimized
HLO text from its entry and counts each instruction as many times as the loops around it run:
XLA:CPU's `known_trip_count`, else (the TPU compiler records none) the loop's condition run on
its counters trip after trip (`_Evaluator`, with the program's constants and the enclosing
loops' counters: query block b of a blocked attention loop reads table[b] key chunks). A loop
whose count depends on data (adaptive span's trimmed spans, ACT's halting) counts once, in
`unknown_loops`; a conditional counts its most expensive branch. A `Kernel` (a top-level fusion,
custom call or unfused op) has its matmul FLOPs (dots, and the convolutions the TPU compiler
writes matmuls as) and its HBM bytes: a fusion's operands and outputs, only the slice of an
operand it only slices and the update of an output it updates in place, tile padding included,
on-chip arrays (layout `S(1)`) not. A Mosaic kernel counts the cost it states (pallas_call's
cost_estimate: the project's fused attention kernel); jax's splash kernel states none and is
counted from its mask's non-empty blocks (a constant table that program_stats.module_text
prints). Other custom calls count their bytes, no FLOPs (`Cost.opaque`). analysis/roofline.py
turns a Cost into a step time for a chip.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import re

import numpy as np

# `%name = type opcode(operands), attributes` (a tuple type starts with '(').
_INSTRUCTION = re.compile(r'^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s+(.+?)\s+([\w\-]+)\((.*)$')
_COMPUTATION = re.compile(r'^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$')
# An array type 'bf16[8,128]{1,0:T(8,128)(2,1)S(1)}': element type, dimensions, layout.
_ARRAY = re.compile(r'\b(pred|token|[a-z]+\d+[a-z\d]*)\[([\d,]*)\]'
                    r'(\{[^{}]*(?:\([^)]*\)[^{}]*)*\})?')
_INDEX = re.compile(r'index=(\d+)')
_DIMS = re.compile(r'dimensions=\{([\d,]*)\}')

COLLECTIVES = ('all-gather', 'reduce-scatter', 'all-reduce', 'all-to-all', 'collective-permute')
_COLLECTIVE_OPS = {**{k: k for k in COLLECTIVES},
                   **{f'{k}-start': k for k in ('all-gather', 'all-reduce', 'collective-permute')},
                   'ragged-all-to-all': 'all-to-all', 'collective-broadcast': 'all-gather'}
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
# TPU compiler custom calls that only move or reshape data: their bytes are all they cost.
_DATA_TARGETS = {'ZeroCrop', 'ConcatBitcast', 'GatherScatterIndicesBitpacked'}
# Ops that read only the slice they produce from their first operand.
_SLICING = {'dynamic-slice', 'slice', 'gather'}


def bits(dtype: str) -> int:
  """Bits of an element of an HLO primitive type ('bf16': 16, 'f8e4m3fn': 8, 'pred': 8)."""
  return 8 if dtype == 'pred' else 0 if dtype == 'token' else int(re.search(r'\d+', dtype).group())


@dataclasses.dataclass(frozen=True)
class Array:
  """One array of an HLO type: element type, dimensions, memory space (0: HBM; 1: TPU VMEM;
  2-5: other on-chip memories) and elements with the layout's tile padding."""
  dtype: str
  dims: tuple[int, ...]
  memory_space: int = 0
  padded_elements: int = 0

  @property
  def bytes(self) -> int:  # As laid out, tile padding included.
    return self.padded_elements * bits(self.dtype) // 8

  @property
  def logical_bytes(self) -> int:
    return math.prod(self.dims) * bits(self.dtype) // 8

  @property
  def hbm_bytes(self) -> int:  # Zero for an array the compiler keeps on chip.
    return self.bytes if self.memory_space == 0 else 0


def arrays(type_text: str) -> list[Array]:
  """Every array of an HLO type (a tuple's elements in order), with the tile padding and
  memory space of its layout."""
  out = []
  for dtype, dims_text, layout in _ARRAY.findall(type_text):
    dims = tuple(int(d) for d in dims_text.split(',') if d)
    order, _, tiling = layout[1:-1].partition(':')
    space = re.search(r'S\((\d+)\)', tiling)
    tile = re.match(r'T\(([\d,]+)\)', tiling)
    minor_to_major = [int(d) for d in order.split(',') if d.isdigit()]
    padded = math.prod(dims)
    if tile and dims and sorted(minor_to_major) == list(range(len(dims))):
      physical = [dims[d] for d in reversed(minor_to_major)]  # Major to minor.
      for i, t in enumerate(reversed([int(t) for t in tile.group(1).split(',')])):
        if i < len(physical) and t > 0:
          physical[-1 - i] = -(-physical[-1 - i] // t) * t
      padded = math.prod(physical)
    out.append(Array(dtype, dims, int(space.group(1)) if space else 0, padded))
  return out


def _hbm(type_text: str, anywhere: bool = False) -> int:
  """Bytes of a type's arrays in HBM (`anywhere`: wherever they live)."""
  return sum(a.bytes if anywhere else a.hbm_bytes for a in arrays(type_text))


def _shape(type_text: str) -> tuple[int, ...] | None:
  m = re.match(r'^[a-z]+\d*\[([\d,]*)\]', type_text)
  return tuple(int(d) for d in m.group(1).split(',') if d) if m else None


def _scan(text: str) -> tuple[list[str], str]:
  """(the comma-separated pieces of `text` up to its first unmatched closing bracket, the text
  after that bracket)."""
  pieces, depth, start = [], 0, 0
  for i, ch in enumerate(text):
    if ch in ')}]' and depth == 0:
      return pieces + [text[start:i]], text[i + 1:]
    depth += (ch in '({[') - (ch in ')}]')
    if ch == ',' and depth == 0:
      pieces, start = pieces + [text[start:i]], i + 1
  return pieces + [text[start:]], ''


def tuple_elements(text: str) -> list[str]:
  """The top-level elements of an HLO tuple type '(a, (b, c), d)'; [text] if not a tuple."""
  text = re.sub(r'/\*.*?\*/', '', text).strip()
  return [p.strip() for p in _scan(text[1:])[0] if p.strip()] if text[:1] == '(' else [text]


@dataclasses.dataclass
class _Instruction:
  name: str
  type_text: str
  opcode: str
  rest: str            # Everything after 'opcode(' (operands, then attributes).
  computation: str = ''

  @functools.cached_property
  def operands(self) -> list[str]:
    return re.findall(r'%([\w.\-]+)', ','.join(_scan(self.rest)[0]))

  @property
  def calls(self) -> dict[str, str]:
    """{'calls' / 'to_apply' / 'body' / 'condition': the computation called}."""
    return dict(re.findall(r'\b(calls|to_apply|body|condition)=%?([\w.\-]+)', self.rest))

  @property
  def shape(self) -> tuple[int, ...] | None:
    return _shape(self.type_text)

  def attr(self, key: str) -> str:
    """The text of attribute `key` (op_name, custom_call_target, ...) or ''."""
    m = re.search(rf'\b{key}="([^"]*)"', self.rest)
    return m.group(1) if m else ''

  def ints(self, pattern: re.Pattern) -> list[int]:
    """The integers of an attribute ('dimensions={0,2}'), [] when absent."""
    m = pattern.search(self.rest)
    return [int(d) for d in m.group(1).split(',') if d] if m else []


@dataclasses.dataclass
class _Module:
  computations: dict[str, list[_Instruction]]
  entry: str
  by_name: dict[str, _Instruction]
  parameters: dict[str, dict[int, _Instruction]]  # Computation: {number: parameter}.

  def root(self, computation: str) -> _Instruction | None:
    return (self.computations.get(computation) or [None])[-1]

  def params(self, computation: str) -> dict[int, _Instruction]:
    return self.parameters.get(computation, {})

  def passes_on(self, body: str, index: int) -> bool:
    """Whether a loop body returns element `index` of its tuple parameter unchanged."""
    root, param = self.root(body), self.params(body).get(0)
    element = (self.by_name.get(root.operands[index]) if root is not None and param is not None
               and root.opcode == 'tuple' and index < len(root.operands) else None)
    return bool(element is not None and element.opcode == 'get-tuple-element'
                and element.operands[:1] == [param.name] and element.ints(_INDEX) == [index])


def _parse(hlo: str) -> _Module:
  """The module's computations, their instructions (continuation lines joined) and entry."""
  computations, entry, current = {}, None, None
  for line in hlo.splitlines():
    if current is None:
      m = _COMPUTATION.match(line)
      if m and '=' not in line.split('{')[0].split('(')[0]:
        current = m.group(1)
        computations[current] = []
        entry = current if line.lstrip().startswith('ENTRY') else entry
    elif line.strip() == '}':
      current = None
    elif m := _INSTRUCTION.match(line):
      computations[current].append(_Instruction(*m.groups(), current))
    elif computations[current]:  # An attribute continued on the next line.
      computations[current][-1].rest += '\n' + line
  if entry is None:
    raise ValueError('no ENTRY computation in the HLO text')
  return _Module(computations, entry, {i.name: i for c in computations.values() for i in c},
                 {c: {int(re.match(r'\s*(\d+)', p.rest).group(1)): p for p in insts
                      if p.opcode == 'parameter'} for c, insts in computations.items()})


def _flops_class(lhs: str, attributes: str = '') -> str:
  """The peak a matmul of left operand type `lhs` runs at: 'int8' (8-bit and smaller), 'bf16'
  (16-bit), 'f32' (32-bit at the default precision), 'f32_highest' (32-bit at HIGH or HIGHEST,
  its `attributes`' operand_precision) or 'f64'."""
  n = bits((arrays(lhs) or [Array('f32', ())])[0].dtype)
  precision = re.search(r'operand_precision=\{([^}]*)\}', attributes)
  if n <= 16 or n >= 64:
    return 'int8' if n <= 8 else 'bf16' if n <= 16 else 'f64'
  high = precision and {p.strip() for p in precision.group(1).split(',')} & {'high', 'highest'}
  return 'f32_highest' if high else 'f32'


def _valid_taps(in_size: int, out_size: int, size: int, stride: int, pad_low: int,
                lhs_dilate: int, rhs_dilate: int) -> int:
  """(output position, window tap) pairs of one spatial dimension that read a real input
  element (not padding, not a hole of the input's dilation): XLA's own count."""
  dilated = (in_size - 1) * lhs_dilate + 1 if in_size else 0
  taps = np.arange(size, dtype=np.int64) * rhs_dilate
  total = 0
  for start in range(0, out_size, 4096):  # Bounded memory for long dimensions.
    pos = np.arange(start, min(out_size, start + 4096))[:, None] * stride + taps - pad_low
    total += int(np.count_nonzero((pos >= 0) & (pos < dilated) & (pos % lhs_dilate == 0)))
  return total


def _matmul(inst: _Instruction, module: _Module) -> dict[str, float]:
  """{peak class: 2 x the multiply-adds} of a dot, or of a convolution (output batch x output
  features x kernel input features x the valid (output, tap) pairs of each spatial dimension)."""
  lhs, rhs = (module.by_name.get(o) for o in (inst.operands + [''] * 2)[:2])
  klass = _flops_class((lhs or inst).type_text, inst.rest)
  out = inst.shape
  labels = re.search(r'dim_labels=(\w+)_(\w+)->(\w+)', inst.rest)
  contracting = re.compile(r'lhs_contracting_dims=\{([\d,]*)\}')
  if inst.opcode == 'dot' and out is not None and lhs and lhs.shape is not None \
      and contracting.search(inst.rest):
    return {klass: 2.0 * math.prod(out) * math.prod(lhs.shape[d] for d in inst.ints(contracting))}
  if not (inst.opcode == 'convolution' and lhs and rhs and labels and lhs.shape is not None
          and rhs.shape is not None and out):
    raise ValueError(f'cannot read the shapes of {inst.opcode} {inst.name}: {inst.rest[:200]}')
  lhs_l, rhs_l, out_l = labels.groups()
  window = {}
  found = re.search(r'window=\{([^}]*)\}', _scan(inst.rest)[1])
  for part in (found.group(1).split() if found else []):
    key, _, value = part.partition('=')
    window[key] = [int(p.split('_')[0]) for p in value.split('x')]  # pad: its low side.
  pairs = 1
  for k, c in enumerate(sorted(c for c in out_l if c.isdigit())):
    get = lambda key, default: window[key][k] if key in window else default  # noqa: E731
    pairs *= _valid_taps(lhs.shape[lhs_l.index(c)], out[out_l.index(c)], get('size', 1),
                         get('stride', 1), get('pad', 0), get('lhs_dilate', 1),
                         get('rhs_dilate', 1))
  return {klass: 2.0 * out[out_l.index('b')] * out[out_l.index('f')] * pairs
          * rhs.shape[rhs_l.index('i')]}


class _Evaluator:
  """Evaluates small integer expressions (a loop's condition, splash's block table) with numpy:
  constants, the tuple elements `lookup(parameter, index)` knows, arithmetic (and the bitwise
  ops of strength-reduced divisions), compares, selects and dynamic slices of a constant table
  (a blocked attention loop's key counts per query block). Anything else, or an array of more
  than LIMIT elements, is None (unknown)."""

  LIMIT = 1 << 20
  _BINARY = {'add': np.add, 'subtract': np.subtract, 'multiply': np.multiply,
             'divide': np.divide, 'remainder': np.fmod, 'maximum': np.maximum,
             'minimum': np.minimum}
  _BITWISE = {'and': np.bitwise_and, 'or': np.bitwise_or, 'xor': np.bitwise_xor,
              'shift-left': np.left_shift, 'shift-right-arithmetic': np.right_shift,
              'shift-right-logical': np.right_shift}
  _UNARY = {'negate': np.negative, 'abs': np.abs, 'sign': np.sign, 'not': np.logical_not}
  _COMPARE = {'LT': np.less, 'LE': np.less_equal, 'GT': np.greater, 'GE': np.greater_equal,
              'EQ': np.equal, 'NE': np.not_equal}

  def __init__(self, module: _Module, lookup=None):
    self.module, self.lookup = module, lookup or (lambda name, index: None)

  def __call__(self, name: str, params: dict | None = None, depth: int = 0):
    try:
      value = self._eval(name, params or {}, depth)
    except (ValueError, IndexError, TypeError, KeyError, ZeroDivisionError, OverflowError):
      return None
    return None if value is None or np.size(value) > self.LIMIT else value

  def _eval(self, name, params, depth):  # pylint: disable=too-many-return-statements
    m, inst = self.module, self.module.by_name.get(name)
    if inst is None or depth > 64:
      return None
    op, shape = inst.opcode, inst.shape
    if op == 'parameter':
      return params[name] if name in params else self.lookup(name, None)
    if op == 'get-tuple-element':
      source, index = m.by_name[inst.operands[0]], inst.ints(_INDEX)[0]
      if source.opcode == 'parameter':
        return self.lookup(source.name, index)
      init = m.by_name.get(source.operands[0]) if source.opcode == 'while' else source
      if init.opcode == 'tuple' and (init is source or m.passes_on(source.calls['body'], index)):
        return self(init.operands[index], params, depth + 1)  # What a loop passes through.
      return None
    if op not in ('copy-start', 'copy-done') and (shape is None or math.prod(shape) > self.LIMIT):
      return None
    if op == 'constant':
      text = _scan(inst.rest)[0][0].replace('true', '1').replace('false', '0')
      numbers = re.findall(r'-?\d+(?:\.\d*)?(?:e[-+]?\d+)?', text)
      if '...' in text or len(numbers) != max(1, math.prod(shape)):
        return None
      return np.array([float(x) for x in numbers]).reshape(shape)
    args = [self(o, params, depth + 1) for o in inst.operands]
    if op == 'fusion':  # An operand of unknown value fails only if the root needs it.
      called = inst.calls.get('calls', '')
      inner = {p.name: args[k] for k, p in m.params(called).items()
               if k < len(args) and args[k] is not None}
      root = m.root(called)
      value = None if root is None else self(root.name, inner, depth + 1)
      return None if value is None else np.asarray(value).reshape(shape)
    if any(a is None for a in args):
      return None
    args = [np.asarray(a) for a in args]
    if op in ('copy-start', 'copy-done'):  # An asynchronous copy: the value copied.
      return args[0]
    if op in ('copy', 'bitcast', 'reshape', 'convert'):
      value = args[0].reshape(shape)
    elif op == 'dynamic-slice':
      sizes = inst.ints(re.compile(r'dynamic_slice_sizes=\{([\d,]*)\}'))
      starts = [int(np.clip(int(a.reshape(())), 0, args[0].shape[i] - sizes[i]))
                for i, a in enumerate(args[1:])]
      return args[0][tuple(slice(st, st + sz) for st, sz in zip(starts, sizes))]
    elif op in self._BINARY:
      value = self._BINARY[op](args[0], args[1])
    elif op in self._UNARY:
      return self._UNARY[op](args[0])
    elif op in self._BITWISE and not (op == 'shift-right-logical' and (args[0] < 0).any()):
      return self._BITWISE[op](*(a.astype(np.int64) for a in args[:2])).astype(float)
    elif op == 'compare':
      return self._COMPARE[re.search(r'direction=(\w+)', inst.rest).group(1)](*args[:2])
    elif op == 'select':
      return np.where(args[0].astype(bool), args[1], args[2])
    else:
      return None
    integer = inst.type_text.startswith(('s', 'u', 'pred'))
    return np.trunc(value) if integer else value


def loop_trips(module: _Module, loop: _Instruction,
               contexts: list | None) -> tuple[float | None, list]:
  """(the mean trip count of a while loop over the runs of the loop around it, the contexts of
  its body: one lookup per trip for `_Evaluator`, giving the elements of the loop's tuple that
  the body steps by a constant (its counters) or passes on unchanged). When the count is
  unknown (None), differs between the enclosing loop's runs or is above 4,096, one context of
  the unchanged elements. `contexts`: one lookup per run of the enclosing loop's body."""
  body, condition = loop.calls['body'], loop.calls['condition']
  init, root = module.by_name.get(loop.operands[0]), module.root(body)
  known = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', loop.rest)
  if init is None or init.opcode != 'tuple' or root is None or root.opcode != 'tuple':
    return (float(known.group(1)) if known else None), [None]
  steps = {}  # The counters: integer scalars the body steps by a constant.
  for j, element in enumerate(module.by_name.get(o) for o in init.operands):
    if element is not None and element.shape == () and element.type_text[:1] in 'su':
      ends = [_Evaluator(module, lambda _, i, x=x, j=j: np.array(float(x)) if i == j else None)(
          root.operands[j]) for x in (0, 1000)]
      if all(e is not None and np.size(e) == 1 for e in ends):
        step = {int(np.asarray(e).reshape(())) - x for e, x in zip(ends, (0, 1000))}
        steps.update({j: step.pop()} if len(step) == 1 and step != {0} else {})
  names = {p.name for c in (body, condition) for p in module.params(c).values()}
  trips, at = [], None
  for lookup in contexts or [None]:
    parent = _Evaluator(module, lookup)
    starts = {j: parent(init.operands[j]) for j in steps}
    kept = functools.cache(lambda j, parent=parent: parent(init.operands[j]) if j < len(
        init.operands) and module.passes_on(body, j) else None)

    def tuple_at(t, starts=starts, kept=kept):  # The loop's tuple on trip t (None: unknown).
      def lookup(name, i):
        if name not in names or i is None:
          return None
        if i in steps:
          return None if t is None or starts[i] is None else np.asarray(starts[i]) + t * steps[i]
        return kept(i)
      return lookup

    trip = int(known.group(1)) if known else None
    for t in range(0 if known else 1 << 17):  # The condition, trip after trip, until it fails.
      go = _Evaluator(module, tuple_at(t))(module.root(condition).name)
      if go is None or np.size(go) != 1 or not np.asarray(go).reshape(()):
        trip = None if go is None or np.size(go) != 1 else t
        break
    trips.append(trip)
    at = at or tuple_at
  if None in trips or len(set(trips)) > 1 or trips[0] > 4096:
    return (None if None in trips else sum(trips) / len(trips)), [at(None)]
  return float(trips[0]), [at(t) for t in range(trips[0])]


def replica_groups(attributes: str) -> list[list[int]] | None:
  """The device groups of a collective ([] for every device, None when not understood) from
  '{{0,1},{2,3}}', iota '[G,S]<=[dims]T(perm)', source_target_pairs or "mesh['a'=4,'b'=2]
  {'a'}" (devices in row-major order of the axes, a group per position of the others)."""
  found = re.search(r'(?:source_target_pairs|replica_groups)=(.*)', attributes)
  text = found.group(1).strip() if found else '{}'
  if text.startswith('{'):
    return [[int(x) for x in g.split(',') if x.strip()]
            for g in re.findall(r'\{([\d,\s]*)\}', ','.join(_scan(text[1:])[0]))]
  iota = re.match(r'\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?', text)
  if iota:
    dims = [int(x) for x in iota.group(2).split(',')]
    ids = np.arange(math.prod(dims)).reshape(dims)
    if iota.group(3):
      ids = ids.transpose([int(x) for x in iota.group(3).split(',')])
    return ids.reshape(int(iota.group(1).split(',')[0]), -1).tolist()
  mesh = re.match(r"mesh\[([^\]]*)\]\s*\{([^}]*)\}", text)
  axes = re.findall(r"'([^']+)'\s*=\s*(\d+)", mesh.group(1)) if mesh else []
  names, named = [a for a, _ in axes], re.findall(r"'([^']+)'", mesh.group(2)) if mesh else []
  if not axes or any(n not in names for n in named):
    return None
  sizes = [int(s) for _, s in axes]
  inside = [names.index(n) for n in named]
  outside = [i for i in range(len(names)) if i not in inside]
  ids = np.arange(math.prod(sizes)).reshape(sizes).transpose(outside + inside)
  return ids.reshape(-1, math.prod(sizes[i] for i in inside)).tolist()


@dataclasses.dataclass
class Collective:
  """One collective instruction as it runs: kind (one of COLLECTIVES), its result's bytes on
  each device once (all-gather: the gathered array; reduce-scatter: the shard; permute: the
  buffer received), device groups (`replica_groups`), runs per execution, JAX source op and
  channel_id (the copies of one collective in several fusions share it and count once); a
  transfer between slices is `over_dcn`, among `participants` (None: unknown)."""
  name: str
  kind: str
  bytes: int
  groups: list[list[int]] | None
  times: float = 1.0
  op_name: str = ''
  channel: int | None = None
  over_dcn: bool = False
  participants: int | None = None


def _collective(inst: _Instruction, module: _Module, times: float) -> Collective | None:
  """The collective `inst` is, or None. An async pair counts at its -start (its result holds
  the operand, then the result); the TPU compiler writes a reduce-scatter as an all-reduce in a
  fusion named all-reduce-scatter, a transfer between slices as a send to the megascale
  runtime (_xla_megascale_target='{slices}x{devices}')."""
  transfer = inst.attr('_xla_megascale_transfer_type')
  if inst.opcode == 'send' and transfer:
    target = re.search(r'_xla_megascale_target="\{([\d,]+)\}', inst.rest)
    n = math.prod(int(x) for x in target.group(1).split(',')) if target else 0
    kind = {'ALL_GATHER': 'all-gather', 'REDUCE_SCATTER': 'reduce-scatter',
            'ALL_TO_ALL': 'all-to-all'}.get(transfer, 'all-reduce')
    return Collective(inst.name, kind, sum(a.logical_bytes for a in arrays(tuple_elements(
        inst.type_text)[0])), None, times, inst.attr('op_name'), over_dcn=True,
                      participants=n if n > 1 else None)
  if inst.opcode not in _COLLECTIVE_OPS:
    return None
  kind, shape = _COLLECTIVE_OPS[inst.opcode], inst.type_text
  if inst.opcode in ('all-gather-start', 'collective-permute-start'):
    shape = (tuple_elements(shape) * 2)[1]
  if kind == 'all-reduce' and inst.computation.startswith('all-reduce-scatter'):
    kind, shape = 'reduce-scatter', module.root(inst.computation).type_text
  channel = re.search(r'channel_id=(\d+)', inst.rest)
  return Collective(inst.name, kind, sum(a.logical_bytes for a in arrays(shape)),
                    replica_groups(_scan(inst.rest)[1]), times, inst.attr('op_name'),
                    int(channel.group(1)) if channel else None)


def collectives(hlo: str) -> dict[str, dict[str, int]]:
  """{kind: {'count', 'bytes'}} for each kind in COLLECTIVES (zeros when absent): each
  collective instruction once wherever it sits, not multiplied by trip counts (`analyze` does
  that), the copies of one channel once."""
  module, out, seen = _parse(hlo), {kind: {'count': 0, 'bytes': 0} for kind in COLLECTIVES}, set()
  for insts in module.computations.values():
    for c in filter(None, (_collective(inst, module, 1.0) for inst in insts)):
      if c.channel is None or c.channel not in seen:
        seen.add(c.channel)
        out[c.kind]['count'] += 1
        out[c.kind]['bytes'] += c.bytes
  return out


@dataclasses.dataclass
class Kernel:
  """One launched kernel (a top-level fusion, custom call or unfused op) as it runs: matmul
  FLOPs per run by the peak they run at (`_flops_class`), HBM bytes read and written per run,
  runs per execution, source ('xla': the compiler's own op; 'analytic': a custom call counted
  from its own cost; 'opaque': a custom call whose FLOPs are unknown) and JAX source op."""
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
  """What `analyze` found in a program, per device and per execution: every kernel launched (a
  kernel in a loop is one entry with its `times`), every collective run, the loops of unknown
  trip count (counted once), {custom call target: runs} of the custom calls counted without
  FLOPs, and what the count could not read (`notes`)."""
  kernels: list[Kernel] = dataclasses.field(default_factory=list)
  collectives: list[Collective] = dataclasses.field(default_factory=list)
  unknown_loops: int = 0
  opaque: dict[str, float] = dataclasses.field(default_factory=dict)
  notes: list[str] = dataclasses.field(default_factory=list)

  @property
  def flops(self) -> float:
    return sum(k.times * k.total_flops for k in self.kernels)

  @property
  def bytes(self) -> float:
    return sum(k.times * k.bytes for k in self.kernels)

  @property
  def launches(self) -> float:
    return sum(k.times for k in self.kernels)

  def top(self, k: int = 10, key=lambda kernel: kernel.bytes) -> list[Kernel]:
    """The k kernels with the most of `key` over their runs."""
    return sorted(self.kernels, key=lambda kernel: -kernel.times * key(kernel))[:k]


def _fusion_bytes(inst: _Instruction, module: _Module) -> float:
  """HBM bytes of a fusion: each operand (only the slices read when the fused computation only
  slices it, nothing when it is the buffer of an in-place update) and each output (only the
  update when the root updates a slice in place)."""
  fused = inst.calls.get('calls', '')
  params = module.params(fused)

  def users(name):  # Looking through bitcasts and reshapes.
    for u in module.computations.get(fused, []):
      if name in u.operands:
        yield from users(u.name) if u.opcode in ('bitcast', 'reshape') else [u]

  total = 0.0
  for i, operand in enumerate(inst.operands):
    full = _hbm(module.by_name[operand].type_text) if operand in module.by_name else 0
    found = list(users(params[i].name)) if i in params else []
    if full and found and all(u.operands[0] == params[i].name and u.opcode in (
        *_SLICING, 'dynamic-update-slice') for u in found):
      total += min(full, sum(_hbm(u.type_text, True) for u in found if u.opcode in _SLICING))
    else:
      total += full
  outputs, root = arrays(inst.type_text), module.root(fused)
  roots = ([module.by_name.get(o) for o in root.operands] if root and root.opcode == 'tuple'
           else [root] if root else [])
  if len(roots) != len(outputs):
    return total + sum(a.hbm_bytes for a in outputs)
  for out, r in zip(outputs, roots):
    while r is not None and r.opcode in ('bitcast', 'reshape'):
      r = module.by_name.get(r.operands[0]) if r.operands else None
    if out.memory_space == 0 and r is not None and r.opcode == 'dynamic-update-slice':
      update = module.by_name.get(r.operands[1]) if len(r.operands) > 1 else None
      total += _hbm(update.type_text, True) if update else out.bytes
    else:
      total += out.hbm_bytes
  return total


def _plain_bytes(inst: _Instruction, module: _Module) -> float:
  """HBM bytes of an unfused op: its operands and outputs, or the slice it reads or updates."""
  out = _hbm(inst.type_text)
  ops = [module.by_name.get(o) for o in inst.operands]
  op_bytes = [_hbm(p.type_text) if p else 0 for p in ops]
  if inst.opcode in _SLICING:
    return 2.0 * out + sum(op_bytes[1:])
  if inst.opcode == 'dynamic-update-slice':
    return 2.0 * (op_bytes[1:] or [out])[0] + sum(op_bytes[2:])
  if inst.opcode == 'scatter':
    return 2.0 * op_bytes[-1] + sum(op_bytes[2:-1])
  if inst.opcode == 'copy-start':
    return float(sum(op_bytes) + _hbm(tuple_elements(inst.type_text)[0]))
  if inst.opcode == 'slice-start':  # ((the operand), the slice, a flag): the slice moves.
    piece = (tuple_elements(inst.type_text) + [''])[1]
    source = arrays(ops[0].type_text) if ops and ops[0] else []
    return float(_hbm(piece, True) * bool(source and source[0].memory_space == 0) + _hbm(piece))
  return float(out + sum(op_bytes))


def _splash(inst: _Instruction, module: _Module, cost: Cost, lookup) -> tuple[dict, float] | None:
  """(FLOPs by class, HBM bytes) of one call of jax's splash attention kernel (its fwd, dq or
  dkv phase, from the name) from the mask's non-empty blocks: per block of block_q x block_kv
  scores, 2 (d_qk + d_v) FLOPs per score forward, 2 (2 d_qk + d_v) for dq, 2 (2 d_qk + 2 d_v)
  (+ d_qk with dq fused) for dkv; its bytes are its operands and outputs plus the key and value
  (dkv: query) blocks it streams per block. None when this is not a splash call."""
  phase = re.search(r'splash_(?:mha|mqa)_(fwd|dq|dkv)', inst.name + ' ' + inst.attr('op_name'))
  operands = [module.by_name.get(o) for o in inst.operands]
  if not phase or None in operands:
    return None
  # The prefetched block tables come first: data_next, block_mask, then mask_next (absent when
  # the kernel computes the mask), each (heads or head shards, rows, columns of blocks).
  phase, shape = phase.group(1), operands[0].shape
  tables = next((i for i, o in enumerate(operands) if o.shape != shape or len(shape or ()) != 3
                 or not o.type_text.startswith(('s', 'u'))), len(operands))
  if tables < 1 or tables + 3 > len(operands):
    return None
  q, k, v = operands[tables:tables + 3]
  if not len(q.shape) >= 3 or not len(k.shape) == len(v.shape) == len(q.shape):
    return None
  # (heads, length, head_dim), with leading batch dimensions when the call is vmapped.
  heads, n_q, d = q.shape[-3:]
  n_kv, dv = k.shape[-2], v.shape[-1]
  rows, cols = shape[1:]
  suffix = {'fwd': '', 'dq': '_dq', 'dkv': '_dkv'}[phase]
  q_blocks, kv_blocks = (cols, rows) if phase == 'dkv' else (rows, cols)
  # The block sizes the kernel states in its xprof_metadata, else the grid's.
  bq, bkv = (int(m.group(1)) if (m := re.search(rf'{key}{suffix}\\?": (\d+)', inst.rest))
             else max(1, n // blocks) for key, n, blocks in (('block_q', n_q, q_blocks),
                                                              ('block_kv', n_kv, kv_blocks)))
  mask = _Evaluator(module, lookup)(inst.operands[1]) if tables >= 2 else None
  if mask is not None:
    mask = np.asarray(mask).astype(np.int64)
    blocks = float(np.count_nonzero(mask)) * heads / max(1, mask.shape[0])
  else:
    blocks = float(rows * cols * heads)
    cost.notes.append(f'{inst.name}: splash block table not in the text; every block of the '
                      'grid counted')
  blocks *= math.prod(q.shape[:-3])
  fused_dq = sum(len(_shape(o) or ()) >= len(q.shape) for o in tuple_elements(inst.type_text))
  matmuls = {'fwd': d + dv, 'dq': 2 * d + dv,
             'dkv': 2 * d + 2 * dv + (d if fused_dq >= 3 else 0)}[phase]
  streamed, stream_rows = (q, bq) if phase == 'dkv' else (k, bkv)
  stream = blocks * stream_rows * (d + dv) * (bits(arrays(q.type_text)[0].dtype) // 8)
  return ({_flops_class(q.type_text): 2.0 * blocks * bq * bkv * matmuls},
          _plain_bytes(inst, module) + stream * (arrays(streamed.type_text)[0].memory_space == 0))


def _mosaic(inst: _Instruction, module: _Module, cost: Cost, lookup) -> tuple[dict, float] | None:
  """(FLOPs by class, HBM bytes) of a Mosaic kernel: the cost it states (pallas_call's
  cost_estimate), its FLOPs classed by its first floating operand (after its scalar-prefetched
  tables); else splash's from its block table."""
  found = re.search(r'"cost_estimate":\{"flops":"?(\d+)"?,[^}]*?"bytes_accessed":"?(\d+)"?',
                    inst.rest.replace('\\"', '"'))
  if not found or not int(found.group(1)):
    return _splash(inst, module, cost, lookup)
  floating = next((t for t in (module.by_name[o].type_text for o in inst.operands
                               if o in module.by_name) if t.startswith(('bf', 'f'))), '')
  return {_flops_class(floating): float(found.group(1))}, float(found.group(2))


def analyze(hlo: str) -> Cost:
  """The kernels and collectives of the optimized HLO module `hlo`, loops multiplied in."""
  module = _parse(hlo)
  cost = Cost()

  @functools.cache
  def fused(name: str) -> tuple[dict, list]:
    """(matmul FLOPs by class, collectives) inside a fused computation."""
    flops, colls = collections.Counter(), []
    for inst in module.computations.get(name, []):
      if inst.opcode in ('dot', 'convolution'):
        flops.update(_matmul(inst, module))
      elif inst.opcode in _COLLECTIVE_OPS:
        colls.append(_collective(inst, module, 1.0))
      for kind, called in inst.calls.items():
        if kind == 'calls' or (kind == 'to_apply' and inst.opcode == 'call'):
          flops.update(fused(called)[0])
          colls.extend(fused(called)[1])
    return dict(flops), colls

  def program(name: str, times: float, out: Cost, contexts: list | None = None) -> None:
    """Adds the kernels of a computation that runs `times` times (not fused) to `out`;
    `contexts`: the values of its parameters on each run (`loop_trips`)."""
    for inst in module.computations.get(name, []):
      calls, op, target, kernel = inst.calls, inst.opcode, inst.attr('custom_call_target'), None
      if op == 'while':
        trip, inner = loop_trips(module, inst, contexts)
        out.unknown_loops += trip is None
        for called in (calls['body'], calls['condition']):
          program(called, times * (1.0 if trip is None else trip), out, inner)
      elif op == 'conditional':
        branches = re.search(r'branch_computations=\{([^}]*)\}', inst.rest)
        names = (branches.group(1).replace('%', '').split(',') if branches else
                 re.findall(r'(?:true|false)_computation=%?([\w.\-]+)', inst.rest))
        subs = {b.strip(): Cost() for b in names}
        for b, sub in subs.items():  # A branch's parameter is not the loop's tuple.
          program(b, times, sub)
        if subs:  # The most expensive branch, counted again into `out`.
          program(max(subs, key=lambda b: (subs[b].flops, subs[b].bytes)), times, out)
      elif op == 'call' or (op == 'async-start' and 'calls' in calls):
        for kind in ('to_apply', 'calls'):
          if kind in calls:
            program(calls[kind], times, out, contexts if op == 'call' else None)
      elif (c := _collective(inst, module, times)) is not None:
        out.collectives.append(c)
      elif op == 'fusion':
        flops, colls = fused(calls['calls'])
        out.collectives += [dataclasses.replace(c, times=times) for c in colls]
        if not colls or not all(  # Else an async wrapper of collectives: no kernel of its own.
            i.opcode in _COLLECTIVE_OPS or i.opcode in _FREE or (
                i.opcode == 'custom-call' and i.attr('custom_call_target') in _FREE_TARGETS)
            for i in module.computations.get(calls['calls'], [])):
          kernel = Kernel(inst.name, op, dict(flops), _fusion_bytes(inst, module))
      elif op in ('send', 'recv') and 'is_host_transfer=true' in inst.rest or (
          op == 'custom-call' and target in _FREE_TARGETS):
        pass
      elif op == 'custom-call' and target not in _DATA_TARGETS:
        found = (_mosaic(inst, module, out, (contexts or [None])[0])
                 if target == 'tpu_custom_call' else None)
        if found is None:
          out.opaque[target] = out.opaque.get(target, 0) + times
        kernel = Kernel(inst.name, op, found[0] if found else {},
                        found[1] if found else _plain_bytes(inst, module),
                        source='analytic' if found else 'opaque')
      elif op in ('dot', 'convolution'):
        kernel = Kernel(inst.name, op, _matmul(inst, module), _plain_bytes(inst, module))
      elif op not in _FREE:
        kernel = Kernel(inst.name, op, {}, _plain_bytes(inst, module))
      if kernel is not None:
        out.kernels.append(dataclasses.replace(kernel, times=times, op_name=inst.attr('op_name')))

  program(module.entry, 1.0, cost)
  unique = {}
  for c in cost.collectives:  # The copies of one channel count once, at their most runs.
    first = unique.setdefault(id(c) if c.channel is None else c.channel, c)
    first.times = max(first.times, c.times)
  cost.collectives = list(unique.values())
  return cost
