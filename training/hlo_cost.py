"""The matmul work of a compiled program, with its loops counted as many times as they run.

XLA's own `cost_analysis()` counts a while loop's body once, whatever its trip count, so a
blocked attention path whose work lives in loops looks cheap there, and a loop that runs 100
times more than it should looks the same as one that does not. This module reads the optimized
HLO text of a compiled program (`compiled.as_text()`) and adds up the FLOPs of its dot
instructions, each multiplied by the trip counts of the loops around it: XLA records a loop's
count in its backend config (`known_trip_count`) whenever it can prove it (every `fori_loop`
and `lax.map` of static length). A loop whose count depends on data (a blocked path whose rows
read different numbers of key chunks) is counted once and reported in `unknown_loops`; a
conditional counts its most expensive branch.

Custom calls (the CPU tile kernel, Pallas and cuDNN kernels) hide their work from XLA and are
counted as zero: compare programs that run the same kernels, or reckon those apart.

  work = hlo_cost.dot_flops(jitted.lower(*args).compile().as_text())
  work.flops, work.unknown_loops, work.by_op   # by_op: FLOPs per op_name metadata
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re

# `%name = type[dims]{layout} opcode(operands), attributes` (a tuple type starts with '(').
_INSTRUCTION = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([\w\-]+)\((.*)$')
_COMPUTATION = re.compile(r'^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$')
_ARRAY = re.compile(r'^[a-z]+\d*\[([\d,]*)\]')
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_DIMS = {key: re.compile(key + r'=\{([\d,]*)\}') for key in ('lhs_contracting_dims',)}
_CALLS = re.compile(r'\b(calls|to_apply|body|condition)=%?([\w.\-]+)')
_BRANCHES = re.compile(r'branch_computations=\{([^}]*)\}')
_OP_NAME = re.compile(r'op_name="([^"]*)"')


@dataclasses.dataclass
class Work:
  """What `dot_flops` found.

  Attributes:
    flops: FLOPs of every dot, times the trip counts of its loops (2 per multiply-add).
    unknown_loops: while loops executed whose trip count XLA does not know (counted once).
    by_op: the same FLOPs by the op_name metadata of the dot (the JAX source op).
  """
  flops: float = 0.0
  unknown_loops: int = 0
  by_op: dict = dataclasses.field(default_factory=lambda: collections.defaultdict(float))

  def top(self, k: int = 10) -> list[tuple[str, float]]:
    """The k source ops with the most FLOPs."""
    return sorted(self.by_op.items(), key=lambda kv: -kv[1])[:k]


@dataclasses.dataclass
class _Instruction:
  name: str
  shape: tuple[int, ...] | None
  opcode: str
  rest: str


def _shape(text: str) -> tuple[int, ...] | None:
  m = _ARRAY.match(text)
  if not m:
    return None
  return tuple(int(d) for d in m.group(1).split(',') if d)


def _parse(hlo: str) -> tuple[dict[str, list[_Instruction]], str]:
  """{computation: its instructions} and the entry computation's name."""
  computations, entry, current = {}, None, None
  for line in hlo.splitlines():
    if current is None:
      m = _COMPUTATION.match(line)
      if m and '=' not in line.split('{')[0].split('(')[0]:
        current = m.group(1)
        computations[current] = []
        if line.lstrip().startswith('ENTRY'):
          entry = current
      continue
    if line.strip() == '}':
      current = None
      continue
    m = _INSTRUCTION.match(line)
    if m:
      name, type_text, opcode, rest = m.groups()
      computations[current].append(_Instruction(name, _shape(type_text), opcode, rest))
  if entry is None:
    raise ValueError('no ENTRY computation in the HLO text')
  return computations, entry


def _dot(inst: _Instruction, shapes: dict[str, tuple[int, ...]]) -> float:
  lhs = inst.rest.split(',')[0].strip().lstrip('%').split(' ')[-1].lstrip('%')
  lhs_shape = shapes.get(lhs)
  dims = _DIMS['lhs_contracting_dims'].search(inst.rest)
  if inst.shape is None or lhs_shape is None or dims is None:
    raise ValueError(f'cannot read the shapes of dot {inst.name}: {inst.rest[:200]}')
  contracted = math.prod(lhs_shape[int(d)] for d in dims.group(1).split(',') if d)
  return 2.0 * math.prod(inst.shape) * contracted


def dot_flops(hlo: str) -> Work:
  """The FLOPs of every dot in the optimized HLO module `hlo`, loops multiplied in."""
  computations, entry = _parse(hlo)
  shapes = {i.name: i.shape for insts in computations.values() for i in insts if i.shape}
  work = Work()
  memo: dict[str, tuple[float, int, dict]] = {}

  def visit(name: str) -> tuple[float, int, dict]:
    if name in memo:
      return memo[name]
    flops, unknown, by_op = 0.0, 0, collections.defaultdict(float)

    def add(sub: tuple[float, int, dict], times: float = 1.0):
      nonlocal flops, unknown
      flops += times * sub[0]
      unknown += sub[1]
      for k, v in sub[2].items():
        by_op[k] += times * v

    for inst in computations.get(name, []):
      if inst.opcode == 'dot':
        f = _dot(inst, shapes)
        flops += f
        op = _OP_NAME.search(inst.rest)
        by_op[op.group(1) if op else inst.name] += f
      elif inst.opcode == 'while':
        calls = dict(_CALLS.findall(inst.rest))
        trip = _TRIP.search(inst.rest)
        times = float(trip.group(1)) if trip else 1.0
        add(visit(calls['body']), times)
        add(visit(calls['condition']), times)
        if not trip:
          unknown += 1
      elif inst.opcode == 'conditional':
        branches = _BRANCHES.search(inst.rest)
        names = [b.strip().lstrip('%') for b in branches.group(1).split(',')] if branches else []
        if names:
          add(max((visit(b) for b in names), key=lambda s: s[0]))
      else:
        for kind, called in _CALLS.findall(inst.rest):
          if kind in ('calls',):  # fusions and calls run their computation once
            add(visit(called))
    memo[name] = (flops, unknown, dict(by_op))
    return memo[name]

  flops, unknown, by_op = visit(entry)
  work.flops, work.unknown_loops = flops, unknown
  work.by_op.update(by_op)
  return work


def compiled_dot_flops(jitted, *args) -> Work:
  """`dot_flops` of `jitted` (a jax.jit function) compiled for `args`."""
  return dot_flops(jitted.lower(*args).compile().as_text())
