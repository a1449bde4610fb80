"""attention_impl='pallas' for every registered variant: trains as 'blocksparse' does on a CPU,
and compiles for a TPU slice with the fused kernel in its train program (issue 68's bar).

  python -m benchmarks.pallas_bar --text ../shared/data/tinyshakespeare.txt
  python -m benchmarks.pallas_bar --variants dense selective --skip-compile

Per variant:
- **CPU**: `python main.py --config=configs/tiny.py --config.model.attention=NAME
  --config.model.attention_impl=IMPL --config.total_steps=20` for IMPL 'blocksparse' and
  'pallas' (the kernel in Pallas interpret mode); the step-20 training losses must agree
  within 1e-3. Transformer-XL trains with segment memory on a local text instead
  (configs/local_text.py, stream packing, mem_len=32, rows of 128 bytes; --text names the
  file, or its row is skipped).
- **TPU, ahead of time**: `python main.py --config=configs/default.py --mode=compile
  --config.compile_topology=v5e:2x2 --config.mesh.tensor=2 --config.model.attention=NAME
  --config.model.attention_impl=pallas` with the batch at --batch rows (64: at the default's
  256 rows, 128 a chip, no kernel's train step fits a 16 GiB chip; splash's dense needs 18.4
  GiB), its train row (GiB per chip, roofline step, bound), and the Mosaic kernels the lowered
  train program calls (training/aot.lower_train_step; the compiled text keeps no names).

LSH attention keeps its own path under 'pallas' (its keys are sorted by a hash drawn each
step, so no block table exists on the host), so its rows compare that path with itself.
Results go to results/pallas_bar.json.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

from benchmarks import common

LOSS = re.compile(r'step (\d+)/\d+\s+loss ([0-9.]+)')
TRAIN_ROW = re.compile(r'^train\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+ \S+)\s+(\S+)',
                       re.M)
COLUMNS = ('variant', 'blocksparse_loss', 'pallas_loss', 'loss_diff', 'cpu_ok', 'pallas_cpu_s',
           'blocksparse_cpu_s', 'tpu_compiles', 'gib_per_chip', 'step_est', 'bound', 'kernels')
TOLERANCE = 1e-3


def _main_py(args: list[str], log: str) -> tuple[int, str, float]:
  env = dict(os.environ, TPU_SKIP_MDS_QUERY='1')
  start = time.perf_counter()
  proc = subprocess.run([sys.executable, 'main.py', *args], cwd=common.REPO, env=env,
                        capture_output=True, text=True, check=False)
  wall = time.perf_counter() - start
  with open(log, 'w') as f:
    f.write(proc.stdout + proc.stderr)
  return proc.returncode, proc.stdout + proc.stderr, wall


def train(variant: str, impl: str, text: str | None, scratch: str) -> dict:
  """The 20-step CPU run's final loss (None where it failed or was skipped)."""
  if variant == 'txl':
    if not text:
      return {'skipped': 'no --text for the local-text run'}
    base = ['--config=configs/local_text.py', f'--config.data.files={text}',
            f'--config.data.data_dir={scratch}/tfds', '--config.data.packing=stream',
            '--config.seq_len=128', '--config.batch_size=8',
            '--config.model.position_embedding=none',
            '--config.model.attention_options.txl.mem_len=32', '--config.eval_every_steps=20',
            '--config.eval_steps=2']
  else:
    base = ['--config=configs/tiny.py']
  workdir = os.path.join(scratch, f'{variant}_{impl}')
  rc, out, wall = _main_py(base + [f'--config.model.attention={variant}',
                                   f'--config.model.attention_impl={impl}',
                                   '--config.total_steps=20', f'--workdir={workdir}'],
                           workdir + '.log')
  losses = {int(s): float(v) for s, v in LOSS.findall(out)}
  return {'rc': rc, 'loss': losses.get(20), 'wall_s': wall,
          **({'error': out.strip().splitlines()[-1][:300]} if rc else {})}


def kernels_called(variant: str, batch: int) -> list[str]:
  """The Mosaic kernels of the fused attention in the lowered train program."""
  from configs import default  # pylint: disable=import-outside-toplevel
  from training import aot, assembly, tpu_topology  # pylint: disable=import-outside-toplevel
  config = default.get_config()
  config.compile_topology = 'v5e:2x2'
  config.mesh.tensor = 2
  config.batch_size = batch
  config.model.attention = variant
  config.model.attention_impl = 'pallas'
  config.data.data_dir = '/nonexistent'
  if variant == 'txl':
    config.model.position_embedding = 'none'
    config.model.attention_options.txl.mem_len = 0
  setup = assembly.build(config, devices=tpu_topology.topology_devices('v5e:2x2'),
                         data=False)
  text = aot.lower_train_step(setup).as_text()
  return sorted(set(re.findall(r'kernel_name = "(score_hook_attention_\w+)"', text)))


def compile_tpu(variant: str, batch: int, scratch: str) -> dict:
  """The bar's --mode=compile run (its train row) and the kernels its program calls."""
  extra = (['--config.model.position_embedding=none',
            '--config.model.attention_options.txl.mem_len=0'] if variant == 'txl' else [])
  workdir = os.path.join(scratch, f'compile_{variant}')
  rc, out, wall = _main_py(['--config=configs/default.py', '--mode=compile',
                            '--config.compile_topology=v5e:2x2', '--config.mesh.tensor=2',
                            f'--config.batch_size={batch}', f'--config.model.attention={variant}',
                            '--config.model.attention_impl=pallas', f'--workdir={workdir}',
                            *extra], workdir + '.log')
  row = {'rc': rc, 'wall_s': wall}
  found = TRAIN_ROW.search(out)
  if found:
    row.update(gib_per_chip=float(found.group(1)), step_est=found.group(6),
               bound=found.group(7))
  if rc:
    row['error'] = out.strip().splitlines()[-1][:300]
  row['kernels'] = kernels_called(variant, batch)
  return row


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--variants', nargs='+', default=None, help='default: every registered')
  parser.add_argument('--text', default=None, help="a text file for Transformer-XL's run")
  parser.add_argument('--batch', type=int, default=64, help='rows of the TPU compile')
  parser.add_argument('--skip-compile', action='store_true')
  parser.add_argument('--out', default=os.path.join(common.RESULTS, 'pallas_bar.json'))
  args = parser.parse_args()
  from models import attention  # pylint: disable=import-outside-toplevel
  variants = args.variants or attention.known()
  text = os.path.abspath(args.text) if args.text else None
  rows = []
  with tempfile.TemporaryDirectory() as scratch:
    for variant in variants:
      runs = {impl: train(variant, impl, text, scratch) for impl in ('blocksparse', 'pallas')}
      row = {'variant': variant, 'runs': runs}
      a, b = runs['blocksparse'].get('loss'), runs['pallas'].get('loss')
      row.update(blocksparse_loss=a, pallas_loss=b,
                 blocksparse_cpu_s=round(runs['blocksparse'].get('wall_s', 0), 1),
                 pallas_cpu_s=round(runs['pallas'].get('wall_s', 0), 1))
      if a is not None and b is not None:
        row['loss_diff'] = abs(a - b)
        row['cpu_ok'] = abs(a - b) <= TOLERANCE
      if not args.skip_compile:
        tpu = compile_tpu(variant, args.batch, scratch)
        row['tpu'] = tpu
        row.update(tpu_compiles=tpu['rc'] == 0, gib_per_chip=tpu.get('gib_per_chip'),
                   step_est=tpu.get('step_est'), bound=tpu.get('bound'),
                   kernels=' '.join(k.replace('score_hook_attention_', '')
                                    for k in tpu['kernels']))
      rows.append(row)
      print(json.dumps({k: row.get(k) for k in COLUMNS}), flush=True)
      common.write_json(args.out, {'settings': {'batch': args.batch, 'text': bool(text),
                                                'tolerance': TOLERANCE},
                                   'machine': common.machine(), 'rows': rows})
  common.print_table(rows, COLUMNS)


if __name__ == '__main__':
  main()
