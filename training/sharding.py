"""Device mesh and logical-axis sharding.

One mesh with named axes (data, fsdp, tensor) and Auto axis types; parameters and
activations carry logical axis names that `config.logical_axis_rules` maps onto it.
"""

import contextlib
from typing import Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ('data', 'fsdp', 'tensor')


def make_mesh(mesh_cfg, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """Builds the (data, fsdp, tensor) mesh.

  Args:
    mesh_cfg: mapping with integer sizes for 'data', 'fsdp' and 'tensor'; one of them may be -1
      to take all remaining devices.
    devices: devices to use; defaults to all of jax.devices().

  Returns:
    A Mesh with Auto axis types (linen logical constraints need them).
  """
  devices = list(jax.devices() if devices is None else devices)
  shape = [int(mesh_cfg[a]) for a in MESH_AXES]
  if shape.count(-1) > 1:
    raise ValueError(f'at most one mesh axis may be -1, got {dict(zip(MESH_AXES, shape))}')
  known = int(np.prod([s for s in shape if s != -1]))
  if -1 in shape:
    if len(devices) % known:
      raise ValueError(f'{len(devices)} devices cannot be split into a mesh '
                       f'{dict(zip(MESH_AXES, shape))}')
    shape[shape.index(-1)] = len(devices) // known
  if int(np.prod(shape)) != len(devices):
    raise ValueError(f'mesh {dict(zip(MESH_AXES, shape))} needs {int(np.prod(shape))} devices, '
                     f'{len(devices)} are available')
  return jax.make_mesh(tuple(shape), MESH_AXES, devices=devices,
                       axis_types=(AxisType.Auto,) * len(MESH_AXES))


def rules_from_config(rules_cfg) -> tuple[tuple[str, str | tuple[str, ...] | None], ...]:
  """Normalizes the config's rule list (lists from the CLI become tuples)."""
  out = []
  for logical, physical in rules_cfg:
    if isinstance(physical, list):
      physical = tuple(physical)
    out.append((logical, physical))
  return tuple(out)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Batch rows split over the data-parallel axes, sequence replicated."""
  return NamedSharding(mesh, P(('data', 'fsdp')))


def logical_shardings(abstract_tree, mesh: Mesh, rules):
  """NamedShardings for a tree whose leaves may be nn.LogicalPartitioned boxes.

  Args:
    abstract_tree: output of jax.eval_shape over a function returning boxed parameters.
    mesh: the device mesh.
    rules: logical-to-mesh rule table.

  Returns:
    A tree of NamedSharding with the structure of `nn.unbox(abstract_tree)`.
  """
  specs = nn.get_partition_spec(abstract_tree)
  return nn.logical_to_mesh_sharding(specs, mesh, rules)


def check_divisible(abstract_tree, shardings) -> None:
  """Raises a ValueError naming the first array whose sharded axes do not divide evenly.

  Args:
    abstract_tree: tree of arrays or ShapeDtypeStructs.
    shardings: matching tree of NamedSharding.
  """
  flat, _ = jax.tree_util.tree_flatten_with_path(abstract_tree)
  for (path, leaf), s in zip(flat, jax.tree.leaves(shardings)):
    for dim, axes in zip(leaf.shape, tuple(s.spec) + (None,) * (len(leaf.shape) - len(s.spec))):
      axes = (axes,) if isinstance(axes, str) else (axes or ())
      parts = int(np.prod([s.mesh.shape[a] for a in axes]))
      if dim % parts:
        raise ValueError(
            f'parameter {jax.tree_util.keystr(path)} of shape {leaf.shape} cannot be split by '
            f'the mesh: an axis of size {dim} is sharded {parts} ways over {axes} (spec '
            f'{s.spec}, mesh {dict(s.mesh.shape)}). Change the mesh, the model size or '
            'config.logical_axis_rules.')


@contextlib.contextmanager
def activate(mesh: Mesh, rules):
  """Context in which jit tracing resolves logical activation constraints."""
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    yield
