"""The synthetic headline claims at the papers' own size, on one accelerator in one lease.

  bash benchmarks/gpu_paper_scale.sh OUT [WORK]          # the lease: this, nvidia-smi, logs
  python -m experiments.paper_scale --profile device --out OUT/paper_scale.json --workdir WORK
  python -m experiments.paper_scale --profile tiny --out /tmp/ps/paper_scale.json  # CI's size
  python -m experiments run paper_scale --out OUT        # the same, as the runner's entry

RESULTS.md's rows of these claims were run at CPU size (experiments/registry.py's
EXPERIMENTS); this runs them at the size of the paper, where one device holds it, with the
same code: each part calls its experiment module's functions (every run trains through
experiments/harness.py) with the paper's arguments, and stores the payload that module writes
for RESULTS.md, so the rows' own criteria (experiments/claims_*.py) judge it. The parts, in
order (PARTS; each row of RESULTS.md that reads one shows its result next to the CPU's):

  selective_va         Leviathan et al. (2024) A.1: Variable Assignment at d=3 (3 variables,
                       1,000 values, 128 assignments, batch 2,048), dense and selective, 1,000
                       steps (the paper's first 1,000: warm-up to the peak rate over all of
                       them), 2 seeds; fresh test rows in and out of distribution (2 values).
  selective_synthetic  A.2: Copy (lengths 1-24) and Parity at d=3, batch 2,048, 1,000 steps,
                       dense and selective, one seed.
  reformer_dup         Kitaev et al. (2020) table 2: the duplication task at the paper's length
                       (rows of 1,024, L = 511, 127 symbols, one layer of d_model = d_ff = 256,
                       4 heads), trained with full attention and LSH-1/2/4 (chunks of 64, 16
                       buckets), each evaluated under full attention and LSH-1/2/4; 2,000 of
                       the paper's 150K steps.
  universal            Dehghani et al. (2019) section 3.4: copy of decimal strings of up to 40
                       symbols (configs/universal_transformer_algorithmic.py), tested on strings
                       of up to 400; an 8-layer Pre-LN stack against the UT with 8 fixed steps
                       and with ACT (at most 8), 2,000 steps. Reverse and addition are not
                       implemented (input_pipeline/synthetic.py has copy and parity).

Each part has a time limit (PROFILES; what the parts before it left unused is added to it):
training stops at the limit minus the part's reserve for what follows it (tests,
evaluations), through harness.time_limit (a run still training is stopped at its next step
with its checkpoint saved, no run starts after it, and the part keeps the seeds and runs that
finished). After each part the JSON (--out) is written and the logs are packed (--out's
folder: paper_scale_logs.tar.gz: the runs' TensorBoard events and configs and the --logs
files, no checkpoints), so that a lease cut short keeps every part that finished. A part that
fails is recorded with its error and the next one runs. A SIGTERM from outside (the lease
ending, `timeout`) stops the part in progress, writes what finished and exits (143). A part
already complete in --out for this profile is kept, not run again (--force reruns it). The
harness rows leave out the memory probes no row here reads (harness.without_memory: a compile
less per run).

How the device profile was sized (no device was lent when it was written: these are
estimates; the JSON records each run's measured run_seconds and each part's wall_s, to resize
it from). One H100 runs the d=4 train step of results/train_step_h100_bf16_auto.json (8,192
tokens a step) at 93 TFLOP/s achieved and compiles it in ~9 s. A step is then the models' own
training FLOPs per token (train_flops_per_token) x tokens per step / 93e12, and at least ~4 ms
for a tiny model (launch-bound); each run adds its compiles (~6-10 s: its train step and its
eval step) and its tests or evaluations:

  part                 runs x steps        tokens/step   MFLOP/token  step     train   other  limit
  selective_va         2 x 2 seeds x 1000  2048 x 258    10.9         62 ms    248 s   +40 s  290 s
  selective_synthetic  2 tasks x 2 x 1000  2048 x 50|64  8.5          9|12 ms   43 s   +44 s   80 s
  reformer_dup         4 x 2000            32 x 1024     6.3          4 ms      32 s   +64 s   95 s
  universal            3 x 2000            256 x 82      13.7         6 ms      36 s   +45 s   75 s

(VA: 10.9e6 x 528,384 = 5.8 TFLOP a step; copy 0.87 and parity 1.12 TFLOP; the reformer's
0.21 TFLOP would take 2.2 ms, its sorts and gathers make it ~4; the UT's 0.29 TFLOP ~3 ms,
its ACT loop of 8 steps ~6. "other": the VA's two first-seed runs compile in ~10 s each, the
second seed's hit the persistent compilation cache the script sets (JAX_COMPILATION_CACHE_DIR),
and 8 test sets take ~10 s; the synthetic part's 4 runs ~11 s each; the reformer's 4 runs ~6 s
each and the 16 evaluations of table 2, a restore and a compile each, ~2.5 s; the UT's 3 runs
~10 s each and 3 evaluations on 512 rows of 802 tokens ~5 s.) The estimates sum to 552 s and
the limits to 540 s: a part's unused time passes to the next ones, and the order puts the
headline first. Starting JAX on the device, installing the wheels the GPU image lacks
(benchmarks/gpu_env.sh) and packing the logs take ~30 s more, and the script's backstop stops
the run at 570 s: within the 600 s of one device command, the 10 minutes of one lease. Each
part's reserve (the limit's share kept for its tests and evaluations) is in PROFILES;
--time_scale scales every limit.

The tiny profile runs every part's code at a few steps of a tiny model (one variant or run
where the part has several, so that CI runs it in about a minute on 2 CPU cores); its numbers
mean nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import subprocess
import sys
import tarfile
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from experiments import harness  # noqa: E402  (sets the XLA flags before JAX starts)

import jax  # noqa: E402

from benchmarks import common  # noqa: E402
from experiments import reformer_experiment as reformer  # noqa: E402
from experiments import selective_experiments as selective  # noqa: E402
from experiments import universal_experiment as universal  # noqa: E402

PARTS = ('selective_va', 'selective_synthetic', 'reformer_dup', 'universal')
# The file each part's payload stands in for: the CPU-size experiment's, which the rows read.
SOURCES = {'selective_va': 'selective_va.json', 'selective_synthetic': 'selective_synthetic.json',
           'reformer_dup': 'reformer_experiment.json',
           'universal': 'universal_experiment.json'}
STARTUP_S = 30  # Starting JAX, installing wheels, packing the logs: outside the parts' limits.
BUDGET_S = 600  # One lease: 10 minutes of device time.
SVA = 'configs/selective_variable_assignment.py'  # The paper's A.1 recipe (d=3, batch 2,048).
UT = 'configs/universal_transformer_algorithmic.py'  # The UT paper's copy (40 -> 400).


@dataclasses.dataclass(frozen=True)
class Part:
  """One part of a profile: its experiment module's arguments, its time limit and the share of
  it kept for what follows training (tests, evaluations)."""
  name: str
  limit_s: float
  reserve_s: float
  args: tuple[str, ...]

  @property
  def train_s(self) -> float:
    return self.limit_s - self.reserve_s


PROFILES = {
    # The papers' sizes (module docstring: the sizing).
    'device': (
        Part('selective_va', 290, 25,
             ('--va_recipe', SVA, '--values', '1000', '--assignments', '128', '--ood_values',
              '2', '--va_batch', '2048', '--va_steps', '1000', '--va_warmup', '1000', '--seeds',
              '0,1', '--evals', '10', '--test_batches', '2')),
        Part('selective_synthetic', 80, 15,
             ('--syn_recipe', SVA, '--tasks', 'copy,parity', '--copy_max', '24',
              '--copy_symbols', '16', '--parity_bits', '32', '--syn_batch', '2048',
              '--syn_steps', '1000', '--seeds', '0', '--evals', '10', '--test_batches', '2')),
        Part('reformer_dup', 95, 40,
             ('--dup_steps', '2000', '--dup_length', '511', '--num_symbols', '127', '--d_model',
              '256', '--mlp_dim', '256', '--chunk_len', '64', '--n_buckets', '16', '--hashes',
              '1,2,4', '--runs', 'full,lsh1,lsh2,lsh4')),
        Part('universal', 75, 15,
             ('--recipe', UT, '--tasks', 'copy', '--runs', 'ut_act,ut_fixed,pre_ln_8', '--T', '8',
              '--M', '8', '--copy_train', '40', '--extrapolate', '10', '--eval_rows', '512',
              '--steps', '2000')),
    ),
    # Every part's code at a tiny size (CI): numbers meaningless.
    'tiny': (
        Part('selective_va', 120, 60,
             ('--va_d', '1', '--values', '4', '--assignments', '2', '--va_batch', '4',
              '--va_steps', '2', '--seeds', '0', '--evals', '1', '--test_batches', '1',
              '--variants', 'selective')),
        Part('selective_synthetic', 120, 60,
             ('--tasks', 'copy,parity', '--syn_d', '1', '--copy_max', '3', '--copy_symbols', '4',
              '--parity_bits', '3', '--syn_batch', '4', '--syn_steps', '2', '--seeds', '0',
              '--evals', '1', '--test_batches', '1', '--variants', 'dense')),
        Part('reformer_dup', 120, 60,
             ('--dup_steps', '2', '--dup_length', '15', '--num_symbols', '4', '--d_model', '32',
              '--dup_batch', '4', '--chunk_len', '8', '--n_buckets', '2', '--hashes', '1',
              '--runs', 'lsh1')),
        Part('universal', 120, 60,
             ('--tasks', 'copy', '--runs', 'ut_act', '--T', '2', '--M', '2', '--copy_train', '3',
              '--extrapolate', '2', '--eval_rows', '4', '--steps', '2')),
    ),
}


# ------------------------------------------------------------------------------ the parts


def run_selective(part: str, argv: list[str], workdir: str, shown: list[str]) -> dict:
  """selective_experiments' va or synthetic part: its payload (selective_va.json's or
  selective_synthetic.json's; its command as `shown`)."""
  which = 'va' if part == 'selective_va' else 'synthetic'
  args = selective.parse_args(['--part', which, '--out', os.devnull,
                               '--workdir', os.path.join(workdir, 'selective'), *argv])
  payload = (selective.part_va if which == 'va' else selective.part_synthetic)(args)
  return {'command': selective._command(['--part', which, *shown]),  # pylint: disable=protected-access
          'part': which, **payload}


def run_reformer(argv: list[str], workdir: str) -> dict:
  """reformer_experiment's duplication part: {'dup': ...} as in reformer_experiment.json."""
  args = reformer.parse_args(['--part', 'dup', '--out', os.path.join(workdir, 'reformer'),
                              *argv])
  every, evals = reformer.dup_plan(args)
  runs = tuple(r for r in every if args.runs == 'all' or r.name in args.runs.split(','))
  rows = reformer.train_and_measure('dup', runs, reformer.base_config('dup', args), args.out,
                                    evals)
  return {'dup': {'settings': reformer.settings('dup', args),
                  'runs': reformer.analyze(rows, runs, reformer.common_overrides('dup', args))}}


def run_universal(argv: list[str], workdir: str) -> dict:
  """universal_experiment's runs at these sizes: its payload (universal_experiment.json's)."""
  args = universal.parse_args(['--out', os.path.join(workdir, 'universal'), *argv])
  rows, measured = universal.train_and_measure(args)
  return universal.analyze(rows, measured, universal.settings_of(args), sizes=args.sizes)


def run_part(name: str, argv: list[str], workdir: str) -> dict:
  # Recipes are named from the repository root: the parsers get absolute paths.
  shown, argv = argv, [os.path.join(REPO, a) if a.endswith('.py') and not os.path.isabs(a)
                       else a for a in argv]
  if name in ('selective_va', 'selective_synthetic'):
    return run_selective(name, argv, workdir, shown)
  if name == 'reformer_dup':
    return run_reformer(argv, workdir)
  return run_universal(argv, workdir)


# ------------------------------------------------------------------------------ the record


def device() -> dict:
  """What the parts ran on: JAX's device kind, and nvidia-smi's line where there is one."""
  d = jax.devices()[0]
  out = {'kind': d.device_kind, 'platform': d.platform, 'count': jax.device_count()}
  try:
    smi = subprocess.run(['nvidia-smi', '--query-gpu=name,memory.total,driver_version',
                          '--format=csv,noheader'], capture_output=True, text=True, timeout=30)
    if smi.returncode == 0 and smi.stdout.strip():
      out['nvidia_smi'] = smi.stdout.strip()
  except (OSError, subprocess.SubprocessError):
    pass
  return out


def load(path: str, profile: str) -> dict:
  """The parts an earlier call wrote to `path` for this profile ({} otherwise)."""
  if not os.path.isfile(path):
    return {}
  with open(path) as f:
    old = json.load(f)
  return old.get('parts', {}) if old.get('profile') == profile else {}


def pack_logs(workdir: str, extra: list[str], path: str) -> None:
  """A tar.gz of the runs' logs under `workdir` (TensorBoard events, configs, eval JSON: no
  checkpoints, no compilation cache) and the `extra` files, written beside the JSON."""
  tmp = path + '.tmp'

  def keep(info: tarfile.TarInfo):
    parts = info.name.split('/')
    if {'checkpoints', 'jax_cache', 'tfds', '.run.lock'} & set(parts):
      return None
    return info if info.isdir() or info.size < 64 << 20 else None

  with tarfile.open(tmp, 'w:gz') as tar:
    if os.path.isdir(workdir):
      tar.add(workdir, arcname='runs', filter=keep)
    for f in extra:
      if os.path.isfile(f):
        tar.add(f, arcname=os.path.basename(f))
  os.replace(tmp, path)


def write(path: str, args, dev: dict, parts: dict, started: float) -> None:
  limits = {p.name: p.limit_s for p in PROFILES[args.profile]}
  common.write_json(path, {
      'profile': args.profile, 'device': dev,
      'budget_s': BUDGET_S if args.profile == 'device' else None, 'limits_s': limits,
      'time_scale': args.time_scale, 'startup_s': STARTUP_S, 'wall_s': time.time() - started,
      'command': 'python -m experiments.paper_scale ' + shlex.join(args.argv),
      'parts': {name: parts[name] for name in PARTS if name in parts}})


# ------------------------------------------------------------------------------ main


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument('--profile', default='device', choices=sorted(PROFILES),
                 help="device: the papers' sizes, 10 minutes on one H100; tiny: CI's")
  p.add_argument('--out', required=True, help='the JSON (RESULTS.md reads paper_scale.json)')
  p.add_argument('--workdir', default='', help='training runs (default: beside --out, '
                 'OUT_DIR/paper_scale_runs); a finished run there is reused')
  p.add_argument('--parts', default=','.join(PARTS), help='a comma list of ' + ', '.join(PARTS))
  p.add_argument('--logs', nargs='*', default=[], help='files packed with the runs\' logs')
  p.add_argument('--time_scale', type=float, default=1.0,
                 help='multiplies every time limit (e.g. 0.5 on a faster device)')
  p.add_argument('--force', action='store_true', help='rerun parts already complete in --out')
  args = p.parse_args(argv)
  args.argv = list(sys.argv[1:] if argv is None else argv)
  args.part_list = [x.strip() for x in args.parts.split(',') if x.strip()]
  unknown = [x for x in args.part_list if x not in PARTS]
  if unknown:
    p.error(f'--parts: unknown {unknown}; known: {", ".join(PARTS)}')
  if args.time_scale <= 0:
    p.error('--time_scale must be > 0')
  args.out = os.path.abspath(args.out)
  args.workdir = os.path.abspath(args.workdir or os.path.join(os.path.dirname(args.out),
                                                              'paper_scale_runs'))
  return args


def main(argv=None) -> dict:
  args = parse_args(argv)
  started = time.time()
  dev = device()
  parts = load(args.out, args.profile)
  tar = os.path.join(os.path.dirname(args.out), 'paper_scale_logs.tar.gz')
  print(f'paper_scale: profile {args.profile} on {dev["kind"]} ({dev["platform"]}); parts '
        f'{", ".join(args.part_list)}', flush=True)
  stopped = False
  planned = 0.0  # The limits of the parts run so far: what they leave unused passes on.
  for part in PROFILES[args.profile]:
    if part.name not in args.part_list:
      continue
    if parts.get(part.name, {}).get('status') == 'complete' and not args.force:
      print(f'[{part.name}] complete in {args.out}: kept (--force reruns it)', flush=True)
      continue
    spare = max(0.0, planned - (time.time() - started))
    limit_s = part.limit_s * args.time_scale + spare
    train_s = max(1.0, limit_s - part.reserve_s * args.time_scale)
    planned += part.limit_s * args.time_scale
    print(f'[{part.name}] limit {limit_s:.0f} s ({spare:.0f} s left over by the parts before; '
          f'training stops at {train_s:.0f} s): ' + shlex.join(part.args), flush=True)
    start = time.time()
    record = {'limit_s': limit_s, 'train_limit_s': train_s, 'device': dev['kind'],
              'args': list(part.args)}
    with harness.time_limit(train_s) as limit, harness.without_memory():
      try:
        record['payload'] = run_part(part.name, list(part.args), args.workdir)
      except Exception as e:  # pylint: disable=broad-except  (the next part still runs)
        record['status'] = 'failed'
        record['error'] = f'{type(e).__name__}: {e}'
        record['traceback'] = traceback.format_exc()[-4000:]
        print(record['traceback'], file=sys.stderr, flush=True)
      else:
        record['status'] = 'cut' if (limit.cut or limit.skipped) else 'complete'
      record.update({'wall_s': time.time() - start, 'cut': limit.cut,
                     'skipped': list(limit.skipped)})
      stopped = limit.signalled
    if stopped and record['status'] == 'cut':  # Cut by the SIGTERM, not by its limit.
      record['status'] = 'stopped'
    parts[part.name] = record
    write(args.out, args, dev, parts, started)
    pack_logs(args.workdir, args.logs, tar)
    print(f'[{part.name}] {record["status"]} in {record["wall_s"]:.0f} s'
          + (f' ({record["cut"] or ", ".join(record["skipped"])})'
             if record['status'] in ('cut', 'stopped') else ''), flush=True)
    if stopped:
      print('paper_scale: SIGTERM: stopped after writing what finished', flush=True)
      raise SystemExit(143)
  failed = [n for n in args.part_list if parts.get(n, {}).get('status') == 'failed']
  if failed:
    raise SystemExit(f'paper_scale: failed parts: {", ".join(failed)} (see {args.out})')
  return parts


if __name__ == '__main__':
  main()
