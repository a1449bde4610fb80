"""Device mesh and logical-axis sharding.

One mesh with named axes (data, fsdp, tensor) and Auto axis types; parameters and
activations carry logical axis names that `config.logical_axis_rules` maps onto it. On
several TPU slices, the data-parallel axes also span the slices (mesh.dcn_data,
mesh.dcn_fsdp), so the rule table is the same on one slice and on many.
"""

import contextlib
from typing import Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ('data', 'fsdp', 'tensor')


def _size(mesh_cfg, key: str, *, auto: bool) -> int:
  """The integer size `mesh_cfg[key]`.

  Args:
    mesh_cfg: the mesh config.
    key: 'data', 'fsdp' or 'tensor' (required), or 'dcn_data' or 'dcn_fsdp' (1 when absent:
      configs and run records older than these keys).
    auto: -1 (all remaining devices) is allowed.

  Returns:
    The size.
  """
  value = mesh_cfg[key] if key in MESH_AXES or key in mesh_cfg else 1
  try:
    size = int(value)
    integral = not isinstance(value, bool) and size == value
  except (TypeError, ValueError):
    integral = False
  if not integral or size == 0 or size < (-1 if auto else 1):
    allowed = 'an integer >= 1, or -1 for all remaining devices' if auto else 'an integer >= 1'
    raise ValueError(f'mesh.{key} must be {allowed}, got {value!r}')
  return size


def _resolve(shape: list[int], n_devices: int, where: str = '') -> list[int]:
  """`shape` with its -1 entry (at most one) set so that it covers `n_devices` devices."""
  if shape.count(-1) > 1:
    raise ValueError(f'at most one mesh axis may be -1, got {dict(zip(MESH_AXES, shape))}')
  known = int(np.prod([s for s in shape if s != -1]))
  if -1 in shape:
    if n_devices % known:
      raise ValueError(f'{n_devices} devices{where} cannot be split into a mesh '
                       f'{dict(zip(MESH_AXES, shape))}')
    shape[shape.index(-1)] = n_devices // known
  if int(np.prod(shape)) != n_devices:
    raise ValueError(f'mesh {dict(zip(MESH_AXES, shape))} needs {int(np.prod(shape))} devices'
                     f'{where}, {n_devices} are available')
  return shape


def _slices(devices: Sequence[jax.Device]) -> dict[int, list[jax.Device]]:
  """slice_index -> the devices of that slice; {} when the devices carry no slice index."""
  if not all(getattr(d, 'slice_index', None) is not None for d in devices):
    return {}
  slices = {}
  for d in devices:
    slices.setdefault(int(d.slice_index), []).append(d)
  return slices


def make_mesh(mesh_cfg, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """Builds the (data, fsdp, tensor) mesh, over one TPU slice or several.

  Within a slice devices talk over the fast interconnect (ICI); slices talk to each other
  over the data-center network (DCN). `data`, `fsdp` and `tensor` are the per-slice (ICI)
  sizes; `dcn_data` and `dcn_fsdp` split the slices between the data-parallel axes, so the
  mesh's axes have sizes data * dcn_data, fsdp * dcn_fsdp and tensor, and only the outer
  (DCN) part of the 'data' and 'fsdp' axes crosses a slice boundary.

  Args:
    mesh_cfg: mapping with integer sizes for 'data', 'fsdp' and 'tensor' (one of them may be
      -1 to take all remaining devices of a slice), and optionally 'dcn_data' and 'dcn_fsdp'
      (slices; 1 when absent).
    devices: devices to use; defaults to all of jax.devices().

  Returns:
    A Mesh with Auto axis types (linen logical constraints need them).

  Raises:
    ValueError: a size that is not a positive integer (or -1 on a per-slice axis), sizes
      that do not cover the devices, or slices that do not match dcn_data * dcn_fsdp.
  """
  devices = list(jax.devices() if devices is None else devices)
  shape = [_size(mesh_cfg, a, auto=True) for a in MESH_AXES]
  dcn = [_size(mesh_cfg, f'dcn_{a}', auto=False) for a in MESH_AXES[:2]] + [1]
  n_slices = int(np.prod(dcn))
  slices = _slices(devices)
  if n_slices == 1:
    if len(slices) > 1:
      raise ValueError(f'the {len(devices)} devices form {len(slices)} slices (slice_index '
                       f'{sorted(slices)}): set mesh.dcn_data (or mesh.dcn_fsdp) so that '
                       f'mesh.dcn_data * mesh.dcn_fsdp = {len(slices)}, e.g. '
                       f'--config.mesh.dcn_data={len(slices)}')
    shape = _resolve(shape, len(devices))
    return jax.make_mesh(tuple(shape), MESH_AXES, devices=devices,
                         axis_types=(AxisType.Auto,) * len(MESH_AXES))

  dcn_desc = f'mesh.dcn_data={dcn[0]} x mesh.dcn_fsdp={dcn[1]} = {n_slices} slices'
  if not slices:
    raise ValueError(f'{dcn_desc} asks for a multi-slice mesh, which needs TPU slices (devices '
                     f'with a slice_index); the {devices[0].platform} devices here have none. '
                     'Set mesh.dcn_data = mesh.dcn_fsdp = 1')
  if len(slices) != n_slices:
    raise ValueError(f'{dcn_desc}, but the {len(devices)} devices form {len(slices)} '
                     f'slice{"s" if len(slices) != 1 else ""} (slice_index {sorted(slices)})')
  sizes = sorted({len(s) for s in slices.values()})
  if len(sizes) > 1:
    raise ValueError(f'the slices hold different numbers of devices '
                     f'{ {i: len(s) for i, s in sorted(slices.items())} }: a multi-slice mesh '
                     'needs equal slices')
  shape = _resolve(shape, sizes[0], where=' per slice')
  # Each slice gets the per-slice (ICI) mesh; the slices are tiled along the DCN axes.
  grid = mesh_utils.create_hybrid_device_mesh(shape, dcn, devices,
                                              allow_split_physical_axes=True)
  return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def fit_mesh(mesh_cfg, devices: Sequence[jax.Device]) -> dict[str, int] | None:
  """A mesh like `mesh_cfg` for `devices`, or None when `mesh_cfg` fits them as it is.

  A run's recorded mesh describes the machine it trained on; an eval, or a resume on a slice
  of another size, fits it to the devices present: each recorded axis size is kept where it
  divides the devices left (tensor first, then fsdp), otherwise it becomes 1, and the axis
  recorded as -1 (else data) takes the rest. Slices: dcn_data * dcn_fsdp is kept when it is
  the number of slices present, otherwise the slices all go to dcn_data.

  Args:
    mesh_cfg: the mesh config (as make_mesh takes it).
    devices: the devices the mesh is for.

  Returns:
    The fitted mesh config, or None.
  """
  try:
    make_mesh(mesh_cfg, devices)
    return None
  except ValueError:
    pass
  devices = list(devices)
  n_slices = max(len(_slices(devices)), 1)
  dcn = {a: _size(mesh_cfg, a, auto=False) for a in ('dcn_data', 'dcn_fsdp')}
  if dcn['dcn_data'] * dcn['dcn_fsdp'] != n_slices:
    dcn = {'dcn_data': n_slices, 'dcn_fsdp': 1}
  shape = {a: _size(mesh_cfg, a, auto=True) for a in MESH_AXES}
  rest = next((a for a in MESH_AXES if shape[a] == -1), 'data')
  remaining = len(devices) // n_slices
  fitted = {}
  for axis in ('tensor', 'fsdp', 'data'):
    if axis == rest:
      continue
    fitted[axis] = shape[axis] if remaining % shape[axis] == 0 else 1
    remaining //= fitted[axis]
  fitted[rest] = -1
  return {**{a: fitted[a] for a in MESH_AXES}, **dcn}


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


def data_shards(mesh: Mesh) -> dict[int, tuple[int, int]]:
  """process index -> (index, count): the block of every batch's rows that the process's
  devices hold under `batch_sharding(mesh)`, as block `index` of `count` equal blocks.

  The rows a process must read are those its devices hold: not a 1/process_count share of
  the batch. With the data-parallel axes across the hosts each process holds its own block
  (count = the processes); with only the tensor axis across them (heads split over the hosts)
  every process holds every row (count 1, the same index on all), and reads the same rows.

  Raises:
    ValueError: a process whose devices hold rows that are not one contiguous block, or
      blocks of different sizes (a mesh whose data-parallel devices interleave the hosts).
  """
  rows = mesh.shape['data'] * mesh.shape['fsdp']  # One row per data-parallel device.
  held: dict[int, set[int]] = {}
  for device, index in batch_sharding(mesh).devices_indices_map((rows,)).items():
    start, stop, _ = index[0].indices(rows)
    held.setdefault(device.process_index, set()).update(range(start, stop))
  return row_blocks(held, rows, f'under the mesh {dict(mesh.shape)}')


def row_blocks(held: dict[int, set[int]], rows: int,
               where: str = '') -> dict[int, tuple[int, int]]:
  """process -> (index, count) from the rows of `rows` each process holds (`data_shards`)."""
  sizes = {len(r) for r in held.values()}
  out = {}
  for process, r in sorted(held.items()):
    start, size = min(r), len(r)
    if r != set(range(start, start + size)) or len(sizes) > 1 or start % size:
      raise ValueError(
          f'process {process} holds batch rows {sorted(r)} of {rows} {where}: each process '
          'must hold one contiguous block of the batch, the same size on every process '
          '(order the devices host by host along the data-parallel axes)')
    out[process] = (start // size, rows // size)
  return out


def data_shard(mesh: Mesh) -> tuple[int, int]:
  """(index, count) of this process's block of the batch rows (`data_shards`): what its data
  reader reads, so that the batch assembled from every process's rows is the global batch."""
  if jax.process_count() == 1:
    return 0, 1
  return data_shards(mesh)[jax.process_index()]


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
