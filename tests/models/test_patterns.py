"""Tests for models.attention.patterns: every pattern equals its set definition.

The oracle (brute_patterns.py) enumerates all (i, j) with plain loops over the definitions;
the library's masks, latest_allowed and density must match it for several sizes, including
lengths that are not multiples of the block or stride (n in {1, 7, 33, 64}).
"""

import jax.numpy as jnp
import numpy as np
import pytest

import brute_patterns as bp
from models.attention import patterns

LENGTHS = (1, 7, 33, 64)
PARTS = ('a1', 'a2', 'union')
# (l, c) pairs: c in {1, 2, l} (c <= l), and one c that does not divide l.
FIXED_SIZES = ((1, 1), (4, 1), (4, 2), (4, 4), (8, 1), (8, 2), (8, 8), (8, 3))


def _check(pattern, keys, n, head=0):
  got = patterns.mask(pattern, n, head)
  want = bp.matrix(lambda i: keys(i, n), n)
  assert got.shape == (n, n) and got.dtype == bool
  if not np.array_equal(got, want):
    i, j = np.argwhere(got != want)[0]
    pytest.fail(f'{pattern} head {head}, n={n}: (i={i}, j={j}) library {got[i, j]}, '
                f'definition {want[i, j]}')


def test_part_names_select_a1_a2_and_their_union():
  """Every part name the library accepts selects the set the Sparse Transformer paper gives it
  (section 4.2's formulas, written here with numpy): 'a1' and 'a2' the two halves of the
  factorization, 'union' (the merged head) A1 | A2, for both factorized patterns."""
  n, l, c = 45, 6, 2
  i, j = np.arange(n)[:, None], np.arange(n)[None, :]
  causal = j <= i
  paper = {
      'strided': {'a1': causal & (j >= i - l), 'a2': causal & ((i - j) % l == 0)},
      'fixed': {'a1': causal & (j // l == i // l), 'a2': causal & (j % l >= l - c)},
  }
  for name, make in (('strided', lambda part: patterns.Strided(l, part)),
                     ('fixed', lambda part: patterns.Fixed(l, c, part))):
    want = {**paper[name], 'union': paper[name]['a1'] | paper[name]['a2']}
    assert set(patterns.PARTS) == set(want), f'untested part names {patterns.PARTS}'
    for part in patterns.PARTS:
      np.testing.assert_array_equal(patterns.mask(make(part), n), want[part],
                                    err_msg=f'{name} {part}')
    # The three names select three different sets at this size.
    assert len({want[part].tobytes() for part in patterns.PARTS}) == 3


@pytest.mark.parametrize('part', PARTS)
@pytest.mark.parametrize('l', [1, 4, 8])
def test_strided_matches_definition(l, part):
  for n in LENGTHS:
    _check(patterns.Strided(l, part), lambda i, n: bp.strided_keys(i, n, l, part), n)


def test_strided_default_part_is_union():
  assert patterns.Strided(4) == patterns.Strided(4, 'union')


@pytest.mark.parametrize('part', PARTS)
@pytest.mark.parametrize('l,c', FIXED_SIZES)
def test_fixed_matches_definition(l, c, part):
  for n in LENGTHS:
    # Without distinct_heads the head argument changes nothing.
    for head in (0, 3):
      _check(patterns.Fixed(l, c, part), lambda i, n: bp.fixed_keys(i, n, l, c, part), n, head)


@pytest.mark.parametrize('part', ['a2', 'union'])
@pytest.mark.parametrize('l,c', FIXED_SIZES)
def test_fixed_distinct_heads_match_definition(l, c, part):
  pattern = patterns.Fixed(l, c, part, distinct_heads=True)
  for n in (7, 33, 64):
    for head in range(l // c + 2):  # The last two wrap around: g = head mod (l // c).
      _check(pattern, lambda i, n, h=head: bp.fixed_keys(i, n, l, c, part, h, True), n, head)


@pytest.mark.parametrize('l,c', [(4, 1), (8, 2), (8, 3)])
def test_fixed_distinct_heads_read_disjoint_summary_blocks(l, c):
  n = 4 * l
  pattern = patterns.Fixed(l, c, 'a2', distinct_heads=True)
  groups = l // c
  columns = [set(np.flatnonzero(patterns.mask(pattern, n, h).any(axis=0)) % l)
             for h in range(groups)]
  for g, cells in enumerate(columns):
    assert cells == set(range(l - (g + 1) * c, l - g * c))
  assert set().union(*columns) == set(range(l - groups * c, l))
  assert sum(map(len, columns)) == groups * c  # Disjoint.


@pytest.mark.parametrize('w', [1, 2, 5, 64, 100])
def test_local_matches_definition(w):
  for n in LENGTHS:
    _check(patterns.Local(w), lambda i, n: bp.local_keys(i, n, w), n)


@pytest.mark.parametrize('b,m', [(1, 0), (4, 0), (4, 2), (8, 3), (8, 16), (5, 7), (64, 1)])
def test_block_local_matches_definition(b, m):
  for n in LENGTHS:
    _check(patterns.BlockLocal(b, m), lambda i, n: bp.block_local_keys(i, n, b, m), n)


def test_dense_matches_definition():
  for n in LENGTHS:
    _check(patterns.Dense(), bp.dense_keys, n)


@pytest.mark.parametrize('pattern', [
    patterns.Strided(4), patterns.Fixed(8, 2, distinct_heads=True), patterns.Local(5),
    patterns.BlockLocal(8, 3), patterns.Dense()], ids=repr)
def test_allowed_on_jax_arrays_matches_numpy(pattern):
  # The dense reference and the splash mask call `allowed` on jax arrays.
  n = 33
  for head in (0, 1):
    got = pattern.allowed(jnp.arange(n)[:, None], jnp.arange(n)[None, :], head)
    np.testing.assert_array_equal(np.asarray(got), patterns.mask(pattern, n, head))


# One instance of every pattern class, with sizes where heads could differ.
HEAD_GROUP_CASES = [
    patterns.Strided(4, 'a2'), patterns.Fixed(8, 2), patterns.Fixed(8, 2, 'a2', True),
    patterns.Fixed(8, 3, 'union', True), patterns.Local(5), patterns.BlockLocal(8, 3),
    patterns.Dense()]


def test_every_pattern_class_has_a_head_group_case():
  classes = {c for c in vars(patterns).values()
             if isinstance(c, type) and hasattr(c, 'allowed')}
  assert classes == {type(p) for p in HEAD_GROUP_CASES}


@pytest.mark.parametrize('pattern', HEAD_GROUP_CASES, ids=repr)
def test_heads_of_one_group_see_the_same_keys_and_other_groups_do_not(pattern):
  """splash and the block-sparse paths compute one mask per head group (patterns.head_group):
  a pattern whose `allowed` read its head without saying so would give every head head 0's
  keys there."""
  n, heads = 40, 8
  masks = {h: patterns.mask(pattern, n, h) for h in range(heads)}
  groups = {h: patterns.head_group(pattern, h) for h in range(heads)}
  for h in range(heads):
    np.testing.assert_array_equal(masks[h], patterns.mask(pattern, n, groups[h]))
    for g in range(h):
      assert np.array_equal(masks[h], masks[g]) == (groups[h] == groups[g]), (h, g, groups)
    np.testing.assert_array_equal(patterns.latest_allowed(pattern, n, h),
                                  patterns.latest_allowed(pattern, n, groups[h]))


def _oracle_cases():
  for l in (1, 4, 8):
    for part in PARTS:
      yield patterns.Strided(l, part), 0, lambda i, n, l=l, p=part: bp.strided_keys(i, n, l, p)
  for l, c in FIXED_SIZES:
    for part in PARTS:
      yield patterns.Fixed(l, c, part), 0, lambda i, n, l=l, c=c, p=part: bp.fixed_keys(
          i, n, l, c, p)
      yield (patterns.Fixed(l, c, part, True), 1,
             lambda i, n, l=l, c=c, p=part: bp.fixed_keys(i, n, l, c, p, 1, True))
  for w in (1, 5, 64):
    yield patterns.Local(w), 0, lambda i, n, w=w: bp.local_keys(i, n, w)
  for b, m in ((1, 0), (4, 2), (8, 16)):
    yield patterns.BlockLocal(b, m), 0, lambda i, n, b=b, m=m: bp.block_local_keys(i, n, b, m)
  yield patterns.Dense(), 0, bp.dense_keys


@pytest.mark.parametrize('chunk', [512, 5])
def test_latest_allowed_matches_definition(chunk):
  for pattern, head, keys in _oracle_cases():
    for n in LENGTHS:
      want = np.array([max(keys(i, n), default=-1) for i in range(n)])
      got = patterns.latest_allowed(pattern, n, head, chunk=chunk)
      np.testing.assert_array_equal(got, want, err_msg=f'{pattern} head {head} n={n}')


def test_latest_allowed_is_minus_one_for_queries_that_see_nothing():
  # Fixed A2 alone: the first l - c queries precede every summary cell.
  got = patterns.latest_allowed(patterns.Fixed(8, 2, 'a2'), 20)
  np.testing.assert_array_equal(got[:6], -1)
  assert np.all(got[6:] >= 6)


def test_density_matches_definition():
  for pattern, head, keys in _oracle_cases():
    for n in LENGTHS:
      pairs = sum(len(keys(i, n)) for i in range(n))
      assert patterns.density(pattern, n, head) == pytest.approx(pairs / (n * (n + 1) / 2),
                                                                   rel=1e-12, abs=0), pattern


def test_density_of_dense_is_one_and_local_shrinks_with_length():
  assert patterns.density(patterns.Dense(), 64) == 1.0
  assert patterns.density(patterns.Local(1), 64) == pytest.approx(64 / (64 * 65 / 2))
  assert patterns.density(patterns.Local(8), 512) < patterns.density(patterns.Local(8), 64)


def test_vectorized_oracle_matches_loops():
  # The numpy forms of the definitions (used for long sequences) equal the loop forms.
  n = 45
  cases = [(bp.strided_np(n, l, p), lambda i, l=l, p=p: bp.strided_keys(i, n, l, p))
           for l in (1, 4, 7) for p in PARTS]
  cases += [(bp.fixed_np(n, l, c, p, h, d),
             lambda i, l=l, c=c, p=p, h=h, d=d: bp.fixed_keys(i, n, l, c, p, h, d))
            for l, c in ((4, 1), (8, 3)) for p in PARTS for h in (0, 1) for d in (False, True)]
  cases += [(bp.local_np(n, w), lambda i, w=w: bp.local_keys(i, n, w)) for w in (1, 6)]
  cases += [(bp.block_local_np(n, b, m), lambda i, b=b, m=m: bp.block_local_keys(i, n, b, m))
            for b, m in ((4, 0), (8, 3))]
  cases += [(bp.dense_np(n), lambda i: bp.dense_keys(i, n))]
  for vectorized, keys in cases:
    np.testing.assert_array_equal(vectorized, bp.matrix(keys, n))


@pytest.mark.parametrize('make,match', [
    (lambda: patterns.Strided(0), 'stride'),
    (lambda: patterns.Strided(-3), 'stride'),
    (lambda: patterns.Strided(2.5), 'stride'),
    (lambda: patterns.Strided(True), 'stride'),
    (lambda: patterns.Strided(4, 'a3'), 'part'),
    (lambda: patterns.Fixed(0, 1), 'block length'),
    (lambda: patterns.Fixed(4, 0), 'summary'),
    (lambda: patterns.Fixed(4, 5), 'c <= l'),
    (lambda: patterns.Fixed(4, 2, 'both'), 'part'),
    (lambda: patterns.Local(0), 'window'),
    (lambda: patterns.BlockLocal(0, 2), 'local_block'),
    (lambda: patterns.BlockLocal(4, -1), 'memory'),
], ids=['stride0', 'stride-3', 'stride2.5', 'strideTrue', 'strided-part', 'fixed-l0',
        'fixed-c0', 'fixed-c>l', 'fixed-part', 'window0', 'block0', 'memory-1'])
def test_invalid_pattern_sizes_raise(make, match):
  with pytest.raises(ValueError, match=match):
    make()
