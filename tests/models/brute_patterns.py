"""Test oracle: the sparse-attention sets written from their definitions, not the library's.

Each `*_keys(i, n, ...)` returns the set of keys j in 0..n-1 that query i may attend to, by
plain loops over j, exactly as the sets are written in the Sparse Transformer (Child et al.,
2019) and the local-attention definitions; `*_np(n, ...)` are the same definitions with numpy
broadcasting, for the long sequences of the FLOP tests (checked against the loops in
test_patterns.py). `layer_keys` says which set each head of a registry variant uses.
"""

import numpy as np


def strided_keys(i, n, l, part='union'):
  """A1 = {j : max(0, i - l) <= j <= i}, A2 = {j <= i : (i - j) mod l = 0}."""
  a1 = {j for j in range(n) if max(0, i - l) <= j <= i}
  a2 = {j for j in range(n) if j <= i and (i - j) % l == 0}
  return {'a1': a1, 'a2': a2, 'union': a1 | a2}[part]


def summary_cells(l, c, head=0, distinct_heads=False):
  """Cells (mod l) read by A2: the last c, or with distinct heads {l-(g+1)c .. l-gc-1}."""
  g = head % (l // c) if distinct_heads else 0
  return set(range(l - (g + 1) * c, l - g * c))


def fixed_keys(i, n, l, c, part='union', head=0, distinct_heads=False):
  """A1 = {j <= i : floor(j / l) = floor(i / l)}, A2 = {j <= i : j mod l in the cells}."""
  cells = summary_cells(l, c, head, distinct_heads)
  a1 = {j for j in range(n) if j <= i and j // l == i // l}
  a2 = {j for j in range(n) if j <= i and j % l in cells}
  return {'a1': a1, 'a2': a2, 'union': a1 | a2}[part]


def local_keys(i, n, w):
  """{j : i - w < j <= i}."""
  return {j for j in range(n) if i - w < j <= i}


def block_local_keys(i, n, b, m):
  """{j <= i : j >= floor(i / b) b - m}."""
  return {j for j in range(n) if j <= i and j >= (i // b) * b - m}


def dense_keys(i, n):
  """{j : j <= i}."""
  return {j for j in range(n) if j <= i}


def matrix(keys, n):
  """(n, n) bool matrix of `keys(i)` (a set of key indices per query)."""
  out = np.zeros((n, n), bool)
  for i in range(n):
    for j in keys(i):
      out[i, j] = True
  return out


def strided_np(n, l, part='union'):
  i, j = np.arange(n)[:, None], np.arange(n)[None, :]
  a1 = (np.maximum(0, i - l) <= j) & (j <= i)
  a2 = (j <= i) & ((i - j) % l == 0)
  return {'a1': a1, 'a2': a2, 'union': a1 | a2}[part]


def fixed_np(n, l, c, part='union', head=0, distinct_heads=False):
  i, j = np.arange(n)[:, None], np.arange(n)[None, :]
  a1 = (j <= i) & (j // l == i // l)
  a2 = (j <= i) & np.isin(j % l, sorted(summary_cells(l, c, head, distinct_heads)))
  return {'a1': a1, 'a2': a2, 'union': a1 | a2}[part]


def local_np(n, w):
  i, j = np.arange(n)[:, None], np.arange(n)[None, :]
  return (i - w < j) & (j <= i)


def block_local_np(n, b, m):
  i, j = np.arange(n)[:, None], np.arange(n)[None, :]
  return (j <= i) & (j >= (i // b) * b - m)


def dense_np(n):
  i, j = np.arange(n)[:, None], np.arange(n)[None, :]
  return j <= i


def factorized_part(factorization, layer, head, heads):
  """The Sparse Transformer's three uses of (A1, A2), as documented in sparse.py."""
  if factorization == 'interleave':
    return 'a1' if layer % 2 == 0 else 'a2'
  if factorization == 'merged':
    return 'union'
  assert factorization == 'multihead'
  return 'a1' if head < heads // 2 else 'a2'


def layer_keys(name, options, layer, head, heads):
  """keys(i, n) of `head` in layer `layer` of registry variant `name` with `options`."""
  o = options
  if name == 'strided':
    part = factorized_part(o['factorization'], layer, head, heads)
    return lambda i, n: strided_keys(i, n, o['stride'], part)
  if name == 'fixed':
    part = factorized_part(o['factorization'], layer, head, heads)
    return lambda i, n: fixed_keys(i, n, o['stride'], o['summary'], part, head,
                                   o['distinct_heads'])
  if name == 'local':
    return lambda i, n: local_keys(i, n, o['window'])
  if name == 'block_local':
    return lambda i, n: block_local_keys(i, n, o['local_block'], o['block_memory'])
  assert name == 'local_global'
  if layer % o['global_every'] == o['global_every'] - 1:  # Layers k-1, 2k-1, ... are global.
    return dense_keys
  return lambda i, n: local_keys(i, n, o['window'])
