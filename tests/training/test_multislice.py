"""Multi-slice meshes (mesh.dcn_data, mesh.dcn_fsdp) on the devices of an absent TPU topology.

The devices come from a TPU topology description (two v5e 2x2 slices, 8 chips): they carry
slice indices and can be lowered for, but nothing is ever placed on them.
"""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from configs import default
from training import sharding


@pytest.fixture(scope='module')
def two_slices():
  """The 8 devices of two v5e 2x2 slices (4 chips each)."""
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
  try:
    devices = topologies.get_topology_desc(topology_name='v5e:2x2', platform='tpu',
                                           num_slices=2).devices
  except Exception as e:  # pylint: disable=broad-except  (no libtpu on this machine)
    pytest.skip(f'no TPU topology description available: {e}')
  assert len(devices) == 8
  assert sorted({d.slice_index for d in devices}) == [0, 1]
  return devices


def _mesh_cfg(**sizes) -> ml_collections.ConfigDict:
  cfg = default.get_config().mesh
  cfg.update(sizes)
  return cfg


def _slices_along(mesh, axis: str) -> list[set[int]]:
  """The slice indices of the devices at each index of mesh axis `axis`."""
  grid = np.moveaxis(mesh.devices, sharding.MESH_AXES.index(axis), 0)
  return [{d.slice_index for d in part.flat} for part in grid]


def test_defaults_are_one_slice():
  cfg = default.get_config().mesh
  assert (cfg.dcn_data, cfg.dcn_fsdp) == (1, 1)


def test_dcn_data_splits_slices_over_data(two_slices):
  mesh = sharding.make_mesh(_mesh_cfg(data=1, fsdp=4, tensor=1, dcn_data=2), two_slices)
  assert dict(mesh.shape) == {'data': 2, 'fsdp': 4, 'tensor': 1}
  assert mesh.axis_types == (AxisType.Auto,) * 3
  assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in two_slices)
  # Each 'data' index is one whole slice; 'fsdp' never crosses a slice boundary.
  assert _slices_along(mesh, 'data') == [{0}, {1}]
  for row in mesh.devices.reshape(2, -1):
    assert len({d.slice_index for d in row}) == 1


def test_dcn_fsdp_puts_slice_boundary_on_fsdp(two_slices):
  mesh = sharding.make_mesh(_mesh_cfg(data=2, fsdp=2, tensor=1, dcn_fsdp=2), two_slices)
  assert dict(mesh.shape) == {'data': 2, 'fsdp': 4, 'tensor': 1}
  # The outer half of 'fsdp' is the slice; 'data' stays within a slice.
  assert _slices_along(mesh, 'fsdp') == [{0}, {0}, {1}, {1}]
  assert _slices_along(mesh, 'data') == [{0, 1}, {0, 1}]


def test_minus_one_resolves_per_slice(two_slices):
  mesh = sharding.make_mesh(_mesh_cfg(data=-1, fsdp=1, tensor=2, dcn_data=2), two_slices)
  assert dict(mesh.shape) == {'data': 4, 'fsdp': 1, 'tensor': 2}
  assert _slices_along(mesh, 'data') == [{0}, {0}, {1}, {1}]
  assert _slices_along(mesh, 'tensor') == [{0, 1}, {0, 1}]


def test_one_slice_config_is_unchanged():
  """No dcn keys (an old config or run record) and dcn 1 give today's mesh."""
  devices = jax.devices()
  old = ml_collections.ConfigDict({'data': -1, 'fsdp': 1, 'tensor': 1})
  new = _mesh_cfg(data=-1, fsdp=1, tensor=1)
  expected = jax.make_mesh((len(devices), 1, 1), sharding.MESH_AXES, devices=devices,
                           axis_types=(AxisType.Auto,) * 3)
  for cfg in (old, new, {'data': -1, 'fsdp': 1, 'tensor': 1}):
    mesh = sharding.make_mesh(cfg, devices)
    assert mesh == expected
  with pytest.raises(ValueError, match='at most one mesh axis may be -1'):
    sharding.make_mesh(_mesh_cfg(data=-1, fsdp=-1), devices)
  with pytest.raises(ValueError, match=r'needs \d+ devices, \d+ are available'):
    sharding.make_mesh(_mesh_cfg(data=len(devices) + 1), devices)


def test_one_slice_of_a_topology(two_slices):
  mesh = sharding.make_mesh(_mesh_cfg(data=-1), two_slices[:4])
  assert dict(mesh.shape) == {'data': 4, 'fsdp': 1, 'tensor': 1}


@pytest.mark.parametrize('sizes, message', [
    ({'dcn_data': 4}, r'dcn_data=4 x mesh.dcn_fsdp=1 = 4 slices, but the 8 devices form 2 '
                      r'slices \(slice_index \[0, 1\]\)'),
    ({'dcn_data': 2, 'dcn_fsdp': 2}, 'form 2 slices'),
    ({'data': 8, 'dcn_data': 2}, r'needs 8 devices per slice, 4 are available'),
    ({'data': 3, 'dcn_data': 2}, r'mesh .* needs 3 devices per slice, 4 are available'),
    ({'data': -1, 'tensor': 3, 'dcn_data': 2}, '4 devices per slice cannot be split'),
    ({'dcn_data': 0}, r'mesh.dcn_data must be an integer >= 1, got 0'),
    ({'dcn_fsdp': -1}, r'mesh.dcn_fsdp must be an integer >= 1, got -1'),
    ({'dcn_data': 1.5}, r'mesh.dcn_data must be an integer >= 1, got 1.5'),
    ({'fsdp': 0}, r'mesh.fsdp must be an integer >= 1, or -1 .*got 0'),
    ({'tensor': 2.5}, r'mesh.tensor must be an integer .*got 2.5'),
    ({'data': True}, r'mesh.data must be an integer .*got True'),
])
def test_bad_sizes(two_slices, sizes, message):
  # A plain dict: a ConfigDict's type lock would refuse the floats before make_mesh sees them.
  cfg = {'data': -1, 'fsdp': 1, 'tensor': 1, 'dcn_data': 1, 'dcn_fsdp': 1, **sizes}
  with pytest.raises(ValueError, match=message):
    sharding.make_mesh(cfg, two_slices)


def test_several_slices_need_dcn(two_slices):
  with pytest.raises(ValueError, match=r'the 8 devices form 2 slices.*--config.mesh.dcn_data=2'):
    sharding.make_mesh(_mesh_cfg(data=-1), two_slices)


def test_one_slice_asked_of_two(two_slices):
  with pytest.raises(ValueError, match=r'= 2 slices, but the 4 devices form 1 slice '):
    sharding.make_mesh(_mesh_cfg(data=-1, dcn_data=2), two_slices[:4])


def test_devices_without_slices_cannot_be_multislice():
  with pytest.raises(ValueError, match=r'needs TPU slices .* the cpu devices here have none'):
    sharding.make_mesh(_mesh_cfg(data=-1, dcn_data=2), jax.devices('cpu'))


def test_lowers_over_two_slices(two_slices):
  """A jitted function lowers (is not compiled, nothing is placed) for the two-slice mesh."""
  mesh = sharding.make_mesh(_mesh_cfg(data=1, fsdp=4, dcn_data=2), two_slices)
  rows = NamedSharding(mesh, P(('data', 'fsdp')))
  x = jax.ShapeDtypeStruct((16, 32), jnp.float32, sharding=rows)
  lowered = jax.jit(lambda a: (a * 2.0).sum(axis=0)).lower(x)
  text = lowered.as_text()
  assert 'num_partitions = 8' in text
