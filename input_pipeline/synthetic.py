"""Synthetic tasks from "Selective Attention Improves Transformer".

Deterministic numpy batch generators for the synthetic tasks of Leviathan et
al. (2024), section 2 and appendix A.1-A.2: Variable Assignment, Copy and
Parity; and the Reformer paper's Duplication task (Kitaev et al., 2020). They
are the embedded default training data: nothing is downloaded.

Every task shares the reserved ids `PAD`, `BOS` and `EOS`; task tokens start at
`NUM_RESERVED`. A task's `batch(seed, step, batch_size)` returns a dict of
arrays of shape `(batch_size, seq_len)`:

* `inputs` (int32): `tokens[:, :-1]`; every row starts with `BOS`.
* `targets` (int32): `tokens[:, 1:]`.
* `weights` (float32): 1.0 exactly on the targets the paper scores, else 0.
* `positions` (int32): `0 .. seq_len - 1` in every row.
* `segment_ids` (int32): 1 on real input tokens, 0 on `PAD`.

A batch is a pure function of `(seed, step, batch_size)`: the random draws come
from `np.random.default_rng([seed, step])`. With `process_index` and
`process_count`, each host returns its contiguous row slice of that same
global batch.

This module deliberately imports only numpy.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Union

import numpy as np

# Reserved ids shared by every task; task-specific ids start at NUM_RESERVED.
PAD, BOS, EOS = 0, 1, 2
NUM_RESERVED = 3


def _check_int(name: str, value: Any, minimum: int) -> None:
  """Raises ValueError unless `value` is an integer >= `minimum`.

  Args:
    name: Name of the hyper-parameter, used in the error message.
    value: The value to check.
    minimum: Smallest allowed value.

  Raises:
    ValueError: If `value` is not an integer or is below `minimum`.
  """
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    raise ValueError(f'{name} must be an integer, got {value!r}.')
  if value < minimum:
    raise ValueError(f'{name} must be >= {minimum}, got {value}.')


class _Task:
  """Shared batching logic; subclasses implement `_tokens` and the sizes."""

  @property
  def vocab_size(self) -> int:
    raise NotImplementedError

  @property
  def seq_len(self) -> int:
    raise NotImplementedError

  @property
  def chance_loss(self) -> float:
    raise NotImplementedError

  def _tokens(self, rng: np.random.Generator, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Draws full token sequences and their target weights.

    Args:
      rng: Random generator to draw from.
      batch_size: Number of rows.

    Returns:
      A pair `(tokens, weights)`: int32 `(batch_size, seq_len + 1)`
      tokens and float32 `(batch_size, seq_len)` weights aligned with
      `tokens[:, 1:]`.
    """
    raise NotImplementedError

  def batch(self,
            seed: int,
            step: int,
            batch_size: int,
            *,
            process_index: int = 0,
            process_count: int = 1) -> dict[str, np.ndarray]:
    """Generates one deterministic batch (or one host's slice of it).

    Args:
      seed: Non-negative data seed.
      step: Non-negative training step; different steps give different
        data.
      batch_size: Global batch size (rows across all processes).
      process_index: Index of this process in `[0, process_count)`.
      process_count: Number of processes; must divide `batch_size`.

    Returns:
      Dict with `inputs`, `targets`, `positions`, `segment_ids` (int32)
      and `weights` (float32), each of shape `(b, seq_len)` with
      `b = batch_size // process_count`, holding rows
      `[process_index * b, (process_index + 1) * b)` of the global batch.

    Raises:
      ValueError: On negative seed/step, non-positive sizes, an
        out-of-range `process_index`, or `batch_size` not divisible by
        `process_count`.
    """
    _check_int('seed', seed, 0)
    _check_int('step', step, 0)
    _check_int('batch_size', batch_size, 1)
    _check_int('process_count', process_count, 1)
    _check_int('process_index', process_index, 0)
    if process_index >= process_count:
      raise ValueError(f'process_index must be < process_count '
                       f'({process_count}), got {process_index}.')
    if batch_size % process_count:
      raise ValueError(f'batch_size ({batch_size}) must be divisible by '
                       f'process_count ({process_count}).')
    rng = np.random.default_rng([int(seed), int(step)])
    # Draw the whole global batch so every host sees the same random
    # stream, then keep this host's rows (generation is cheap).
    tokens, weights = self._tokens(rng, batch_size)
    per_host = batch_size // process_count
    rows = slice(process_index * per_host, (process_index + 1) * per_host)
    tokens, weights = tokens[rows], weights[rows]
    inputs = np.ascontiguousarray(tokens[:, :-1], dtype=np.int32)
    targets = np.ascontiguousarray(tokens[:, 1:], dtype=np.int32)
    positions = np.broadcast_to(np.arange(self.seq_len, dtype=np.int32), inputs.shape).copy()
    return {
        'inputs': inputs,
        'targets': targets,
        'weights': np.ascontiguousarray(weights, dtype=np.float32),
        'positions': positions,
        'segment_ids': (inputs != PAD).astype(np.int32),
    }


@dataclasses.dataclass(frozen=True)
class VariableAssignment(_Task):
  """Variable Assignment: output the latest value of a queried variable.

  Example from the paper: `y=7; x=1; x=3; z=5; x=?` -> `3`. A sequence is
  `BOS, (var_1=, value_1), ..., (var_A=, value_A), query=?, answer` with
  `A = num_assignments`. The queried variable is drawn uniformly among the
  variables assigned at least once; the answer is its last assigned value and
  is the only weighted target.

  Token layout: `[reserved | num_variables "v=" tokens | num_variables "v=?"
  tokens | num_values value tokens]`.

  Attributes:
    num_variables: Number of distinct variables (paper: 3).
    num_values: Number of possible values (paper: 1,000).
    num_assignments: Number of assignments before the query (paper: 128).
  """

  num_variables: int = 3
  num_values: int = 1000
  num_assignments: int = 128

  def __post_init__(self):
    _check_int('num_variables', self.num_variables, 1)
    _check_int('num_values', self.num_values, 1)
    _check_int('num_assignments', self.num_assignments, 1)

  @property
  def assign_offset(self) -> int:
    """Id of the first "<variable>=" token."""
    return NUM_RESERVED

  @property
  def query_offset(self) -> int:
    """Id of the first "<variable>=?" query token."""
    return NUM_RESERVED + self.num_variables

  @property
  def value_offset(self) -> int:
    """Id of the first value token."""
    return NUM_RESERVED + 2 * self.num_variables

  @property
  def vocab_size(self) -> int:
    """Total number of token ids."""
    return self.value_offset + self.num_values

  @property
  def seq_len(self) -> int:
    """Model input length: BOS + 2 tokens per assignment + query."""
    return 2 * self.num_assignments + 2

  @property
  def chance_loss(self) -> float:
    """Loss (nats) of a uniform guess over the values: ln(num_values)."""
    return math.log(self.num_values)

  def _tokens(self, rng, batch_size):
    b, a, v = batch_size, self.num_assignments, self.num_variables
    variables = rng.integers(0, v, size=(b, a))
    values = rng.integers(0, self.num_values, size=(b, a))
    # Query a variable uniformly among those assigned at least once: random
    # scores, with unassigned variables masked to -1 (scores lie in [0, 1)).
    assigned = np.zeros((b, v), dtype=bool)
    np.put_along_axis(assigned, variables, True, axis=1)
    scores = np.where(assigned, rng.random((b, v)), -1.0)
    query = scores.argmax(axis=1)
    # Index of the last assignment to the queried variable.
    hits = variables == query[:, None]
    last = a - 1 - hits[:, ::-1].argmax(axis=1)
    answer = values[np.arange(b), last]

    tokens = np.empty((b, 2 * a + 3), dtype=np.int32)
    tokens[:, 0] = BOS
    tokens[:, 1:2 * a + 1:2] = variables + self.assign_offset
    tokens[:, 2:2 * a + 2:2] = values + self.value_offset
    tokens[:, -2] = query + self.query_offset
    tokens[:, -1] = answer + self.value_offset
    # Only the answer (the last target) is scored.
    weights = np.zeros((b, self.seq_len), dtype=np.float32)
    weights[:, -1] = 1.0
    return tokens, weights


class _SeparatorAndSymbols(_Task):
  """Token layout `[reserved | SEP | num_symbols symbol tokens]` (Copy, Duplication); the
  subclass has a `num_symbols` field."""

  @property
  def sep_id(self) -> int:
    """Id of the separator token (Copy's end of input, Duplication's `0`)."""
    return NUM_RESERVED

  @property
  def symbol_offset(self) -> int:
    """Id of the first symbol token."""
    return NUM_RESERVED + 1

  @property
  def vocab_size(self) -> int:
    """Total number of token ids."""
    return self.symbol_offset + self.num_symbols


@dataclasses.dataclass(frozen=True)
class Copy(_SeparatorAndSymbols):
  """Copy: reproduce a variable-length sequence after a separator.

  A sequence is `BOS, s_1..s_L, SEP, s_1..s_L, EOS`, padded with `PAD` to
  `3 + 2 * max_length` tokens, with `L` uniform in `[min_length, max_length]`
  and symbols uniform over the alphabet. Scored targets are the predictions
  made from `SEP` onward: the `L` copied symbols and the `EOS`.

  Token layout: `[reserved | SEP | num_symbols symbol tokens]`.

  Attributes:
    num_symbols: Alphabet size.
    max_length: Longest sequence to copy (paper: L_max = 24).
    min_length: Shortest sequence to copy (paper: 1).
  """

  num_symbols: int = 64
  max_length: int = 24
  min_length: int = 1

  def __post_init__(self):
    _check_int('num_symbols', self.num_symbols, 1)
    _check_int('min_length', self.min_length, 1)
    _check_int('max_length', self.max_length, 1)
    if self.min_length > self.max_length:
      raise ValueError(f'min_length ({self.min_length}) must be <= '
                       f'max_length ({self.max_length}).')

  @property
  def seq_len(self) -> int:
    """Model input length: context 3 + 2 * max_length, minus one."""
    return 2 * self.max_length + 2

  @property
  def chance_loss(self) -> float:
    """Approximate uniform-guess loss (nats): ln(num_symbols).

    This is the loss of a uniform guess over the alphabet on each scored
    copy position; the single EOS target per row is not accounted for
    separately.
    """
    return math.log(self.num_symbols)

  def _tokens(self, rng, batch_size):
    b, m = batch_size, self.max_length
    lengths = rng.integers(self.min_length, m + 1, size=(b, 1))
    symbols = (rng.integers(0, self.num_symbols, size=(b, m)) + self.symbol_offset)
    j = np.arange(2 * m + 3)[None, :]  # token index
    in_first = (j >= 1) & (j <= lengths)
    in_copy = (j >= lengths + 2) & (j <= 2 * lengths + 1)
    # Symbol index for either half, clipped so the gather stays in range.
    first = np.take_along_axis(symbols, np.clip(j - 1, 0, m - 1), axis=1)
    copy = np.take_along_axis(symbols, np.clip(j - lengths - 2, 0, m - 1), axis=1)
    tokens = np.full((b, 2 * m + 3), PAD, dtype=np.int32)
    tokens[:, 0] = BOS
    tokens = np.where(in_first, first, tokens)
    tokens = np.where(j == lengths + 1, self.sep_id, tokens)
    tokens = np.where(in_copy, copy, tokens)
    tokens = np.where(j == 2 * lengths + 2, EOS, tokens).astype(np.int32)
    # Target i predicts token i + 1: score the copy and EOS (tokens
    # lengths + 2 .. 2 * lengths + 2).
    i = np.arange(self.seq_len)[None, :]
    weights = (i >= lengths + 1) & (i <= 2 * lengths + 1)
    weights = weights.astype(np.float32)
    return tokens, weights


@dataclasses.dataclass(frozen=True)
class Parity(_Task):
  """Parity: running parity of random bits.

  A sequence is `BOS, b_1, p_1, b_2, p_2, ..., b_n, p_n` where the `b_k` are
  uniform random bits (odd positions) and `p_k = b_1 xor ... xor b_k` (even
  positions). Only the parity targets are scored.

  Token layout: `[reserved | bit 0 | bit 1]`.

  Attributes:
    num_bits: Number of random bits `n`.
  """

  num_bits: int = 32

  def __post_init__(self):
    _check_int('num_bits', self.num_bits, 1)

  @property
  def bit_offset(self) -> int:
    """Id of the bit-0 token; bit 1 is `bit_offset + 1`."""
    return NUM_RESERVED

  @property
  def vocab_size(self) -> int:
    """Total number of token ids."""
    return NUM_RESERVED + 2

  @property
  def seq_len(self) -> int:
    """Model input length: 2 * num_bits."""
    return 2 * self.num_bits

  @property
  def chance_loss(self) -> float:
    """Loss (nats) of a uniform guess over the two bits: ln 2."""
    return math.log(2)

  def _tokens(self, rng, batch_size):
    n = self.num_bits
    bits = rng.integers(0, 2, size=(batch_size, n), dtype=np.int32)
    parities = np.bitwise_xor.accumulate(bits, axis=1)
    tokens = np.empty((batch_size, 2 * n + 1), dtype=np.int32)
    tokens[:, 0] = BOS
    tokens[:, 1::2] = bits + self.bit_offset
    tokens[:, 2::2] = parities + self.bit_offset
    # Target i predicts token i + 1; parities sit at even token indices.
    weights = np.zeros((batch_size, self.seq_len), dtype=np.float32)
    weights[:, 1::2] = 1.0
    return tokens, weights


@dataclasses.dataclass(frozen=True)
class Duplication(_SeparatorAndSymbols):
  """Duplication (the Reformer paper's synthetic task, Kitaev et al. 2020, section 5): a
  sequence `0 w 0 w`, w a string of random symbols; the second copy is scored.

  A row is `BOS, SEP, w_1..w_L, SEP, w_1..w_L` with `L = dup_length` and symbols uniform over
  the alphabet (the paper's `0` is SEP). The first half is unpredictable; each token of the
  second copy is the token L + 1 positions back, which a model finds only by attending to it:
  the paper uses it to compare full attention with LSH attention. Scored targets are the L
  symbols of the second copy (the prediction made at the second SEP onward).

  Token layout: `[reserved | SEP | num_symbols symbol tokens]`.

  Attributes:
    num_symbols: Alphabet size (paper: N = 127).
    dup_length: Length L of w (paper: 511, a sequence of 1024).
  """

  num_symbols: int = 64
  dup_length: int = 127

  def __post_init__(self):
    _check_int('num_symbols', self.num_symbols, 1)
    _check_int('dup_length', self.dup_length, 1)

  @property
  def seq_len(self) -> int:
    """Model input length: BOS + 2 (L + 1) tokens, minus the last (a power of two for
    L = 2^k - 1)."""
    return 2 * self.dup_length + 2

  @property
  def chance_loss(self) -> float:
    """Loss (nats) of a uniform guess over the alphabet on the scored copy: ln(num_symbols)."""
    return math.log(self.num_symbols)

  def _tokens(self, rng, batch_size):
    n = self.dup_length
    w = (rng.integers(0, self.num_symbols, size=(batch_size, n)) + self.symbol_offset)
    sep = np.full((batch_size, 1), self.sep_id)
    tokens = np.concatenate([np.full((batch_size, 1), BOS), sep, w, sep, w],
                            axis=1).astype(np.int32)
    # Target i predicts token i + 1; the second copy is tokens n + 3 .. 2 n + 2.
    weights = np.zeros((batch_size, self.seq_len), dtype=np.float32)
    weights[:, n + 2:] = 1.0
    return tokens, weights


Task = Union[VariableAssignment, Copy, Parity, Duplication]

TASKS = {
    'variable_assignment': VariableAssignment,
    'copy': Copy,
    'parity': Parity,
    'duplication': Duplication,
}


def make_task(name: str, **kwargs: Any) -> Task:
  """Builds a synthetic task by name.

  Args:
    name: One of the keys of `TASKS`.
    **kwargs: Hyper-parameters of that task's dataclass.

  Returns:
    The task instance.

  Raises:
    ValueError: If `name` is unknown, a keyword is not a hyper-parameter of
      the task, or a hyper-parameter value is invalid.
  """
  if name not in TASKS:
    raise ValueError(f'Unknown synthetic task {name!r}; known tasks: '
                     f'{", ".join(sorted(TASKS))}.')
  cls = TASKS[name]
  allowed = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(kwargs) - allowed)
  if unknown:
    raise ValueError(f'Unknown hyper-parameter(s) {unknown} for task '
                     f'{name!r}; valid: {sorted(allowed)}.')
  return cls(**kwargs)
