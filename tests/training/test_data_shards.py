"""Which rows of every batch each process reads (training/sharding.py data_shards): the rows
its devices hold in the batch's layout. Before, each process read 1/process_count of the
batch whatever the mesh, so with only the tensor axis across the hosts (every process holds
every row) each fed half a batch: a batch of the wrong global size, other rows on each host,
and Transformer-XL's segment memory (laid out for the global batch) refused it."""

import pytest

from training import sharding

pytestmark = pytest.mark.unit


def test_heads_split_across_hosts_every_process_reads_the_whole_batch():
  assert sharding.row_blocks({0: {0}, 1: {0}}, 1) == {0: (0, 1), 1: (0, 1)}


def test_batch_split_across_hosts_each_process_reads_its_block():
  assert sharding.row_blocks({0: {0, 1}, 1: {2, 3}}, 4) == {0: (0, 2), 1: (1, 2)}
  # Four hosts, two data-parallel groups (tensor across pairs of hosts).
  assert sharding.row_blocks({0: {0}, 1: {0}, 2: {1}, 3: {1}}, 2) == {
      0: (0, 2), 1: (0, 2), 2: (1, 2), 3: (1, 2)}


@pytest.mark.parametrize('held', [{0: {0, 2}, 1: {1, 3}},   # Interleaved.
                                  {0: {0, 1, 2}, 1: {3}},   # Unequal.
                                  {0: {1, 2}, 1: {0, 3}}])
def test_rows_that_are_not_one_block_per_process_are_an_error(held):
  with pytest.raises(ValueError, match='one contiguous block of the batch'):
    sharding.row_blocks(held, 4, 'under the mesh m')


def test_one_process_reads_everything():
  import jax
  mesh = sharding.make_mesh({'data': -1, 'fsdp': 1, 'tensor': 1}, jax.devices()[:1])
  assert sharding.data_shard(mesh) == (0, 1)
  assert sharding.data_shards(mesh) == {0: (0, 1)}


# A checkpoint's input-stream positions are saved with the rows each stream reads: a restart
# on another layout resumes a process from a stream of its own rows, never from another's.
# Before, the only check was the process count, so 2 hosts with the data axis across them
# (rows 0-1 and 2-3) restarted with heads split (both reading rows 0-3) resumed each from
# its half-batch position.

def _saved(*streams):
  return {'process_count': len(streams),
          'processes': [{'data_shard': list(shard), 'state': {'cursor': cursor}}
                        for shard, cursor in streams]}


def test_resume_takes_the_saved_stream_of_the_same_rows():
  from training import train
  saved = _saved(((0, 2), 10), ((1, 2), 20))
  assert train._this_process_data_state(saved, (1, 2)) == {'cursor': 20}
  assert train._this_process_data_state(saved, (0, 2)) == {'cursor': 10}
  # Heads split across the same 2 hosts on restart, each reads all rows: a 1-process
  # checkpoint's stream is that one.
  assert train._this_process_data_state(_saved(((0, 1), 7)), (0, 1)) == {'cursor': 7}


def test_resume_on_other_rows_restarts_the_stream_with_a_warning(caplog):
  from training import train
  saved = _saved(((0, 2), 10), ((1, 2), 20))
  with caplog.at_level('WARNING'):
    assert train._this_process_data_state(saved, (0, 1)) is None
  assert 'restarts from the beginning' in caplog.text and 'block 0 of 1' in caplog.text


def test_checkpoints_without_the_rows_resume_by_process_index():
  from training import train
  legacy = {'process_count': 1, 'processes': [{'cursor': 3}]}
  assert train._this_process_data_state(legacy, (0, 1)) == {'cursor': 3}
  assert train._this_process_data_state(None, (0, 1)) is None
