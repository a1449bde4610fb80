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
