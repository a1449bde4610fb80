"""main.py with a spy on the calls that make the host wait for the device (for
test_multihost.py): counts them per interval between dispatched train steps and writes
{step: [call, ...]} as JSON to $SPY_OUT when the process exits.

  python tests/training/spy_main.py [main.py flags]
"""

import atexit
import collections
import json
import os
import pathlib
import runpy
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import jax  # noqa: E402
from jax._src import array as jax_array  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from training import train  # noqa: E402

_step = [None]
_calls = collections.defaultdict(list)


def _spy(name, fn):
  def wrapper(*args, **kwargs):
    if _step[0] is not None:
      _calls[_step[0]].append(name)
    return fn(*args, **kwargs)
  return wrapper


jax.device_get = _spy('jax.device_get', jax.device_get)
jax.block_until_ready = _spy('jax.block_until_ready', jax.block_until_ready)
multihost_utils.process_allgather = _spy('process_allgather', multihost_utils.process_allgather)
for _method in ('__array__', '__float__', '__int__', '__bool__', 'item', 'tolist',
                'block_until_ready'):
  setattr(jax_array.ArrayImpl, _method,
          _spy(f'Array.{_method}', getattr(jax_array.ArrayImpl, _method)))

_add = train._MetricWindow.add  # pylint: disable=protected-access


def _add_and_mark(self, step, metrics):  # Called once per dispatched step, with its count.
  _step[0] = step
  return _add(self, step, metrics)


train._MetricWindow.add = _add_and_mark  # pylint: disable=protected-access


@atexit.register
def _write():
  _step[0] = None
  with open(os.environ['SPY_OUT'], 'w') as f:
    json.dump({str(k): v for k, v in _calls.items()}, f)


sys.argv = [str(REPO / 'main.py'), *sys.argv[1:]]
runpy.run_path(str(REPO / 'main.py'), run_name='__main__')
