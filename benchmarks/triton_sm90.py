"""Compiles the fused kernel's Triton programs for an H100/H200 (sm_90) on a CPU host.

No GPU has run attention_impl='pallas' on a GPU target (models/attention/pallas_gpu.py): the
tests check its numerics in Pallas interpret mode and that each variant's train step lowers
to Triton custom calls. Lowering stops at Triton's own IR (TTIR); what a GPU's first run
would do next, Triton's compile of that IR to a cubin (layouts, shared memory, registers,
ptxas), needs no GPU. This script does it here, for every variant:

  1. lowers a one-layer model's train step (loss and gradients, bfloat16) for CUDA, keeping
     the TTIR module of every Pallas Triton kernel it lowers (the forward, dq and dk/dv
     kernels; selective's states and dstates passes) and each kernel's num_warps and
     num_stages from the custom call;
  2. compiles each module with the `triton` package for GPUTarget('cuda', 90, 32), the
     kernel's warps and stages, to PTX and a cubin;
  3. reads ptxas's report of the cubin: registers per thread, spilled bytes, and the
     kernel's shared memory (an H100/H200 block takes at most 227 KiB).

  pip install -r benchmarks/requirements-triton.txt
  python -m benchmarks.triton_sm90                        # every variant, head widths 64, 128
  python -m benchmarks.triton_sm90 --variants selective --head-dims 64

The table goes to the terminal and the rows to --out (results/triton_sm90.json). The exit
status is 1 when a kernel does not compile. XLA compiles the same TTIR with the Triton it
bundles (jaxlib's), which need not be this package's version: a kernel that compiles here
can still meet a difference there, but the checks that fail first (Triton's verifier, its
layouts, shared memory, ptxas) are the same.
"""

import argparse
import contextlib
import os
import re
import subprocess
import tempfile
import traceback

import jax
import jax.numpy as jnp

from benchmarks import common
from benchmarks.pallas_gpu_check import OPTIONS, VARIANTS
from models import transformer

COLUMNS = ('variant', 'head_dim', 'kernel', 'ok', 'warps', 'stages', 'registers',
           'spill_bytes', 'shared_kib', 'error')
# The largest shared memory one block of an H100 or H200 takes (bytes).
SHARED_LIMIT = 227 * 1024
# The custom call of a Pallas Triton kernel names it, then its stages and warps.
_PARAMS = re.compile(r'name = "(\w+)", num_stages = (\d+) : i32, num_warps = (\d+) : i32')


@contextlib.contextmanager
def _captured():
  """Yields a list that collects (kernel name, TTIR text) of every Pallas Triton kernel
  lowered inside the block (the lowering's own module, printed before XLA takes it)."""
  # pylint: disable=import-outside-toplevel,protected-access
  from jax._src.pallas.triton import pallas_call_registration as registration
  lower = registration.lowering.lower_jaxpr_to_triton_module
  kernels = []

  def keep(jaxpr, *args, **kwargs):
    result = lower(jaxpr, *args, **kwargs)
    kernels.append((str(result.module.operation.attributes['sym_name']).strip('"'),
                    result.module.operation.get_asm()))
    return result

  registration.lowering.lower_jaxpr_to_triton_module = keep
  try:
    yield kernels
  finally:
    registration.lowering.lower_jaxpr_to_triton_module = lower


def _config(variant: str, head_dim: int, seq_len: int) -> transformer.TransformerConfig:
  return transformer.TransformerConfig.from_config(dict(
      d_model=2 * head_dim, n_heads=2, n_layers=2 if variant == 'local_global' else 1,
      vocab_size=256, max_len=seq_len, attention=variant, attention_impl='pallas',
      dtype='bfloat16', target_platform='gpu', target_devices=1,
      position_embedding='none' if variant == 'txl' else 'learned',
      attention_options={variant: OPTIONS.get(variant, {})}))


def kernels(variant: str, head_dim: int, seq_len: int, batch: int = 2):
  """[(name, TTIR, num_warps, num_stages)] of the variant's train step lowered for CUDA."""
  model = transformer.Decoder(_config(variant, head_dim, seq_len))
  tokens = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32)
  params = jax.eval_shape(lambda: model.init(jax.random.key(0),
                                             jnp.zeros((batch, 8), jnp.int32))['params'])

  def step(params, tokens):
    def loss(params):
      logits, state = model.apply({'params': params}, tokens, mutable=['losses'])
      aux = sum(jnp.sum(x) for x in jax.tree.leaves(state.get('losses', {})))
      return jnp.mean(logits.astype(jnp.float32) ** 2) + aux
    return jax.value_and_grad(loss)(params)

  with _captured() as found:
    text = jax.jit(step).trace(params, tokens).lower(lowering_platforms=('cuda',)).as_text()
  params_of = {}
  for name, stages, warps in _PARAMS.findall(text):
    params_of.setdefault(name, set()).add((int(warps), int(stages)))
  out, seen = [], set()
  for name, ttir in found:
    if (name, ttir) in seen:  # the same kernel lowered again (a layer's twin, a recomputation)
      continue
    seen.add((name, ttir))
    (warps, stages), *others = sorted(params_of.get(name, {(4, 3)}))
    if others:  # two kernels of one name compiled differently: not this module's kernels
      raise ValueError(f'kernel {name} is called with several (warps, stages): '
                       f'{sorted(params_of[name])}')
    out.append((name, ttir, warps, stages))
  return out


def _ptxas_report(ptxas: str, ptx: str, workdir: str) -> dict:
  """Registers per thread and spilled bytes of a PTX kernel for sm_90, by `ptxas -v`."""
  path = os.path.join(workdir, 'kernel.ptx')
  with open(path, 'w', encoding='utf-8') as f:
    f.write(ptx)
  report = subprocess.run([ptxas, '-arch=sm_90a', '-v', path, '-o', os.devnull],
                          capture_output=True, text=True, check=True).stderr
  registers = re.search(r'Used (\d+) registers', report)
  spills = [int(x) for x in re.findall(r'(\d+) bytes spill (?:stores|loads)', report)]
  return {'registers': int(registers.group(1)) if registers else None,
          'spill_bytes': max(spills, default=0)}


def compile_kernel(name: str, ttir: str, warps: int, stages: int, workdir: str) -> dict:
  """One kernel's row: Triton's compile of its TTIR for sm_90, ptxas's report."""
  # pylint: disable=import-outside-toplevel
  import triton
  from triton.backends.compiler import GPUTarget
  from triton.backends.nvidia import compiler as nvidia
  path = os.path.join(workdir, f'{name}.ttir')
  with open(path, 'w', encoding='utf-8') as f:
    f.write(ttir)
  compiled = triton.compile(path, target=GPUTarget('cuda', 90, 32),
                            options={'num_warps': warps, 'num_stages': stages})
  shared = int(compiled.metadata.shared)
  row = {'warps': warps, 'stages': stages, 'shared_kib': round(shared / 1024, 1)}
  row.update(_ptxas_report(nvidia.get_ptxas(90).path, compiled.asm['ptx'], workdir))
  row['ok'] = shared <= SHARED_LIMIT
  if not row['ok']:
    row['error'] = f'{shared} bytes of shared memory, more than the {SHARED_LIMIT} of sm_90'
  return row


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--variants', nargs='+', default=list(VARIANTS))
  parser.add_argument('--head-dims', nargs='+', type=int, default=[64, 128])
  parser.add_argument('--seq-len', type=int, default=1024)
  parser.add_argument('--out', default='results/triton_sm90.json')
  args = parser.parse_args()
  try:
    import triton  # pylint: disable=import-outside-toplevel
  except ImportError:
    parser.error('this check compiles with the triton package: pip install -r '
                 'benchmarks/requirements-triton.txt')
  rows = []
  with tempfile.TemporaryDirectory() as workdir:
    for variant in args.variants:
      for head_dim in args.head_dims:
        try:
          found = kernels(variant, head_dim, args.seq_len)
        except Exception as e:  # pylint: disable=broad-except
          traceback.print_exc()
          rows.append({'variant': variant, 'head_dim': head_dim, 'kernel': '(lowering)',
                       'ok': False, 'error': f'{type(e).__name__}: {e}'[:300]})
          continue
        for name, ttir, warps, stages in found:
          row = {'variant': variant, 'head_dim': head_dim, 'kernel': name}
          try:
            row.update(compile_kernel(name, ttir, warps, stages, workdir))
          except Exception as e:  # pylint: disable=broad-except
            row.update(ok=False, error=f'{type(e).__name__}: {e}'[:300])
          rows.append(row)
          common.print_table(rows[-1:], COLUMNS)
        common.write_json(args.out, {
            'args': vars(args), 'triton': triton.__version__, 'jax': jax.__version__,
            'target': 'cuda sm_90 (H100, H200)', 'rows': rows})
  print()
  common.print_table(rows, COLUMNS)
  raise SystemExit(0 if rows and all(r['ok'] for r in rows) else 1)


if __name__ == '__main__':
  main()
