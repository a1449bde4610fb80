"""benchmarks/variant_speed.py: a worker row at a small shape, the table's derived columns, and
the --before machinery (a worktree of an earlier commit, removed afterwards)."""

import argparse
import json
import pathlib
import subprocess
import sys

import pytest

from benchmarks import variant_speed
from models import attention

REPO = pathlib.Path(variant_speed.ROOT)
# The commit issue 47 compares against: older than training/assembly.py (the worker falls back
# to training/train.py there).
BEFORE = 'b39f426'


def _has_commit(rev: str) -> bool:
  return subprocess.run(['git', 'cat-file', '-e', f'{rev}^{{commit}}'], cwd=REPO,
                        capture_output=True, check=False).returncode == 0


def _worktrees() -> str:
  return subprocess.run(['git', 'worktree', 'list'], cwd=REPO, capture_output=True, text=True,
                        check=True).stdout


def test_worker_times_dense_at_a_small_shape():
  args = argparse.Namespace(tokens=128, iters=1, timeout=600)
  row = variant_speed.child(str(REPO), 'dense', '64', args)
  assert 'error' not in row, row
  assert (row['seq_len'], row['batch']) == (64, 2)
  assert row['tokens_per_s'] > 0 and row['compile_s'] > 0 and row['step_ms'] > 0
  assert row['impl']


def test_name_at_impl_sets_the_attention_implementation():
  config = variant_speed._config('dense@blocksparse', '64', 128)
  assert (config.model.attention, config.model.attention_impl) == ('dense', 'blocksparse')
  assert variant_speed._config('dense', '64', 128).model.attention == 'dense'
  assert variant_speed._config('dense', '64', 128).model.dtype == 'float32'  # The recipe's.
  assert variant_speed._config('dense', '64', 128, 'bfloat16').model.dtype == 'bfloat16'


@pytest.mark.unit
def test_before_is_a_commit_or_a_checkout_folder(tmp_path, monkeypatch):
  # A lent machine gets the working tree without its history: the earlier commit travels as a
  # folder, used as it is and labelled by its name.
  checkout = tmp_path / 'b39f426'
  (checkout / 'models').mkdir(parents=True)
  assert variant_speed.before_tree(str(checkout)) == ('b39f426', False)
  assert variant_speed.before_tree('') == (None, False)
  with pytest.raises(ValueError, match='not a checkout'):
    variant_speed.before_tree(str(tmp_path / 'b39f426' / 'models'))
  # Without git history this checkout is 'unknown', and GIT_COMMIT labels it (first: a lent
  # machine's copy of .git can be older than the tree it measures).
  monkeypatch.setattr(variant_speed, 'ROOT', str(tmp_path))
  monkeypatch.setenv('GIT_CEILING_DIRECTORIES', str(tmp_path.parent))
  monkeypatch.delenv('GIT_COMMIT', raising=False)
  assert variant_speed._revision() == ('unknown', False)
  monkeypatch.setenv('GIT_COMMIT', 'abc1234')
  assert variant_speed._revision() == ('abc1234', False)


def test_a_build_error_is_a_row_not_a_crash():
  args = argparse.Namespace(tokens=128, iters=1, timeout=600)
  row = variant_speed.child(str(REPO), 'no_such_variant', '64', args)
  assert 'no_such_variant' in row['error'] and 'tokens_per_s' not in row


@pytest.mark.unit
def test_x_dense_after_before_and_notes():
  dense = variant_speed.combine({'variant': 'dense', 'tokens_per_s': 300.0, 'step_ms': 10.0,
                                 'impl': 'cpu_kernel'}, None)
  variant_speed.annotate(dense, dense)
  slow = variant_speed.combine(
      {'variant': 'lsh', 'tokens_per_s': 100.0, 'step_ms': 30.0, 'impl': 'blocksparse'},
      {'variant': 'lsh', 'tokens_per_s': 200.0, 'step_ms': 15.0})
  variant_speed.annotate(slow, dense)
  assert dense['x_dense'] == 1 and not dense['note']
  assert slow['x_dense'] == pytest.approx(3.0) and slow['after/before'] == pytest.approx(2.0)
  assert slow['note'].startswith(variant_speed.NOTES['lsh']) and 'cpu_kernel' in slow['note']
  engine = {'variant': 'dense@blocksparse', 'tokens_per_s': 200.0, 'impl': 'blocksparse'}
  variant_speed.annotate(slow, dense, engine)
  assert slow['x_engine'] == pytest.approx(2.0)
  variant_speed.annotate(dense, dense, engine)
  assert 'x_engine' not in dense  # Only rows on the blocked engine.
  broken = variant_speed.combine({'variant': 'txl', 'error': 'ValueError: no'}, None)
  variant_speed.annotate(broken, dense)
  assert 'x_dense' not in broken and broken['note'] == 'error: ValueError: no'
  assert set(variant_speed.NOTES) <= set(attention.known())  # Every note is a variant's.


@pytest.mark.skipif(not _has_commit(BEFORE), reason=f'{BEFORE} is not in this clone')
def test_before_runs_the_worker_in_a_worktree_of_the_earlier_commit(tmp_path):
  out = tmp_path / 'variant_speed.json'
  doc = tmp_path / 'page.md'
  doc.write_text(f'# Speed\n\n{variant_speed.BEGIN}\nold\n{variant_speed.END}\n\nafter\n')
  proc = subprocess.run(
      [sys.executable, '-m', 'benchmarks.variant_speed', '--before', BEFORE, '--attention',
       'dense', '--shapes', '64', '--tokens', '128', '--iters', '1', '--out', str(out),
       '--doc', str(doc)],
      cwd=REPO, capture_output=True, text=True, check=False)
  assert proc.returncode == 0, proc.stderr[-2000:]
  result = json.loads(out.read_text())
  assert result['before'] and result['after'] and 'machine' in result
  (row,) = result['rows']
  assert row['tokens_per_s'] > 0 and row['before_tokens_per_s'] > 0, row
  assert row['after/before'] > 0
  assert 'variant_speed_' not in _worktrees()  # Removed in `finally`.
  page = doc.read_text()  # The page's table is rewritten between its markers, prose kept.
  assert page.startswith('# Speed') and page.endswith('after\n') and '\nold\n' not in page
  assert '| dense | 64 | 2 x 64 |' in page and f'after / {result["before"]}' in page
