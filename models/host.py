"""Host copies of device arrays that work on every layout, one process or several.

`jax.device_get` (or `np.asarray`) of an array sharded over several processes fails ("spans
non-addressable devices"): on a pod with heads split across hosts, a head-sharded parameter
has no host that holds all of it. `to_host` gathers such an array from every process (a
collective: every process must call it at the same point) and copies the rest directly.
"""

import jax
import numpy as np
from jax.experimental import multihost_utils


def to_host(tree):
  """`tree` with every jax.Array replaced by its whole value as a numpy array."""
  def one(x):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))

  return jax.tree.map(one, tree)
