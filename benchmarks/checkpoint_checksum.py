"""Cost of checkpoint checksums (training/checkpoints.py) on save and on restore.

  python -m benchmarks.checkpoint_checksum                  # 10M and 100M parameters
  python -m benchmarks.checkpoint_checksum --params 1e7 --repeats 5

For each size, a TrainState of float32 parameter matrices (1024 x 1024, plus one remainder)
is saved synchronously to a scratch folder and restored onto the same devices, with
checksums on and off: medians of interleaved repeats (on/off alternate, so both see the
same load on a shared machine), each on a new step folder, after one warm-up round. Also
timed alone: the checksum reduction (jitted, after its compile) and its first call (compile
+ run).
Results go to results/checkpoint_checksum.json.
"""

import argparse
import functools
import os
import shutil
import tempfile
import time


from training import xla_flags  # noqa: E402

xla_flags.set_cpu_defaults()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import logging  # noqa: E402

from benchmarks import common  # noqa: E402
from training import checkpoints, steps  # noqa: E402,I100

COLUMNS = 1024


def make_state(n_params: int) -> steps.TrainState:
  """A TrainState of ~n_params float32 parameters in 1024 x 1024 matrices."""
  rows = [COLUMNS] * (n_params // (COLUMNS * COLUMNS))
  rest = n_params - sum(rows) * COLUMNS
  if rest >= COLUMNS:
    rows.append(rest // COLUMNS)
  keys = jax.random.split(jax.random.key(0), len(rows))
  params = {f'w{i:03d}': jax.random.normal(k, (r, COLUMNS), jnp.float32)
            for i, (k, r) in enumerate(zip(keys, rows))}
  return steps.TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=(), memory={})


def _seconds(fn) -> float:
  t = time.perf_counter()
  fn()
  return time.perf_counter() - t


def _save(ckpt, step, state):
  ckpt.save(step, state)
  ckpt.wait()


def bench(n_params: int, repeats: int, scratch: str) -> dict:
  state = make_state(n_params)
  jax.block_until_ready(state)
  actual = sum(x.size for x in jax.tree.leaves(state.params))
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                          state)
  row = {'params_m': actual / 1e6, 'mbytes': 4 * actual / 2**20,
         'checksum_first_call_s': _seconds(lambda: checkpoints.tree_checksums(state)),
         'checksum_s': float(np.median([_seconds(lambda: checkpoints.tree_checksums(state))
                                        for _ in range(repeats)]))}
  ckpts = {label: checkpoints.Checkpointer(os.path.join(scratch, f'{n_params}_{label}'), keep=1,
                                           async_save=False, checksums=label == 'on')
           for label in ('off', 'on')}
  times = {f'{what}_{label}': [] for what in ('save', 'restore') for label in ckpts}
  for step in range(1, repeats + 2):  # Interleaved, so both see the same machine load.
    for label, ckpt in ckpts.items():
      save = _seconds(functools.partial(_save, ckpt, step, state))
      restore = _seconds(lambda c=ckpt: jax.block_until_ready(c.restore(abstract)))
      if step > 1:  # The first round warms up (compiles, creates folders).
        times[f'save_{label}'].append(save)
        times[f'restore_{label}'].append(restore)
  for label, ckpt in ckpts.items():
    ckpt.close()
    shutil.rmtree(os.path.join(scratch, f'{n_params}_{label}'))
  for key, values in times.items():
    row[f'{key}_s'] = float(np.median(values))
  for what in ('save', 'restore'):
    row[f'{what}_overhead_s'] = row[f'{what}_on_s'] - row[f'{what}_off_s']
    row[f'{what}_overhead_pct'] = 100 * (row[f'{what}_on_s'] / row[f'{what}_off_s'] - 1)
  row['checksum_gb_per_s'] = row['mbytes'] / 1024 / row['checksum_s']
  return row


def main():
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--params', type=float, nargs='+', default=[1e7, 1e8])
  p.add_argument('--repeats', type=int, default=5)
  p.add_argument('--scratch', default=None, help='folder for the checkpoints (default: a '
                 'temporary one)')
  p.add_argument('--out', default=os.path.join(common.RESULTS, 'checkpoint_checksum.json'))
  args = p.parse_args()
  logging.set_verbosity(logging.ERROR)  # "restored unverified" for every checksum-off restore.
  scratch = args.scratch or tempfile.mkdtemp(prefix='checkpoint_checksum_')
  rows = [bench(int(n), args.repeats, scratch) for n in args.params]
  common.print_table(rows, ['params_m', 'mbytes', 'checksum_first_call_s', 'checksum_s',
                            'checksum_gb_per_s', 'save_off_s', 'save_on_s', 'save_overhead_s',
                            'save_overhead_pct', 'restore_off_s', 'restore_on_s',
                            'restore_overhead_s', 'restore_overhead_pct'])
  common.write_json(args.out, {'rows': rows, 'devices': [str(d) for d in jax.devices()],
                               'repeats': args.repeats})
  if not args.scratch:
    shutil.rmtree(scratch, ignore_errors=True)


if __name__ == '__main__':
  main()
