"""Training-step speed of every registered attention variant on CPU, against dense at the same
shape, and optionally against an earlier commit in the same run.

  python -m benchmarks.variant_speed                     # every variant: tiny, 512, 2048, 8192
  python -m benchmarks.variant_speed --shapes tiny 512 --attention dense adaptive_span --iters 2
  python -m benchmarks.variant_speed --before b39f426 --shapes tiny 2048
  JAX_PLATFORMS=cuda python -m benchmarks.variant_speed --shapes 4096 8192 16384 \
      --dtype bfloat16 --out results/variant_speed_gpu.json --doc docs/variant_speed_gpu.md

Shapes: `tiny` is configs/tiny.py as `python main.py` trains it (d=2, float32, Variable
Assignment, batch 256, its own short rows) with model.attention set to the variant; a number N
is the same architecture on rows of N tokens (the embedded parity task, model.max_len N) and a
batch of max(1, --tokens // N) rows. Each variant keeps its default options; where the build
refuses them the worker retries with the least change the error names, reported in `adjust`:
position_embedding='none' (variants with relative positions), or, for segment memory (txl's
mem_len), the same shapes as a data.packing='stream' text run built without data and fed
random tokens.

Each (commit, variant, shape) runs in its own child process (this file with --worker), which
builds the real sharded train step (model specialized to its initial parameters, as the
training loop does), times its first call (compile_s: compile included), one more untimed
call, then --iters calls (step_ms: their median wall time; cpu_ms: the median CPU time of the
process's threads, which other work on a shared machine inflates less). x_dense = dense's tokens/s / the variant's
at the same shape (> 1: slower than dense); dense's default on a CPU is the C++ tile kernel,
so the table also runs dense@blocksparse (a variant NAME@IMPL sets model.attention_impl), dense
on the blocked engine of the learned variants with the same block sizes, and x_engine compares
every blocksparse row with it. With --before REV, REV is checked out with `git
worktree` under a temporary folder and every row runs there and then here, back to back, so a
slow phase of a shared machine hits both (the worker is this file, importing the other tree's
packages); on a machine without the repository's history (a lent GPU gets a copy of the
working tree), --before DIR names a checkout of the earlier commit instead, labelled by the
folder's name, and GIT_COMMIT labels this one. JAX_PLATFORMS picks the
backend (default cpu); --dtype sets model.dtype (bfloat16 on an accelerator, as people train
there). A row that cannot build or run keeps the first line of its error. Rows more than
2x slower than dense carry a reason from NOTES. Results go to results/variant_speed.json,
rewritten after every row.
"""

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = ('tiny', '512', '2048', '8192')
# Why a variant's step costs more than dense's, shown for rows more than SLOW x slower. The
# static patterns run on dense's own kernel, so none is expected there.
SLOW = 2.0
STATIC = 'a static pattern, computed by the same kernels as dense: not expected; look into it'
NOTES = {
    'strided': STATIC,
    'fixed': STATIC,
    'local': STATIC,
    'block_local': STATIC,
    'local_global': 'every global_every-th layer is dense attention (its own kernel per '
                    'layer: cudnn on a GPU, where the blocked engine ran it before)',
    'lsh': 'hashing and sorting n_hashes rounds, each attending within chunks of its sorted '
           'buckets',
    'txl': 'attends over memory + segment with relative position terms',
    'selective': 'the extra selection head and F = cumsum S',
    'adaptive_span': 'soft-masked span attention with relative position terms',
    'dynamic_span': 'computes all S keys per query since z_t is per token',
}
# What the table adds when a slow variant ran another path than dense's.
OTHER_PATH = 'plain-JAX {impl} path where dense runs {dense}'
# Dense on the blocked engine the learned variants run (blockloop.py, the same block sizes):
# their x_engine is against it, since dense's own default on a CPU is the C++ tile kernel.
ENGINE = 'blocksparse'
ENGINE_DENSE = f'dense@{ENGINE}'


# -------------------------------------------------------------------------- the worker
# Runs in a child process whose PYTHONPATH is the measured tree (this checkout or the earlier
# commit's worktree): it imports only what both have, and nothing from benchmarks/.


def _api():
  """(module with build/init_state/device_batch/specialized_model, jit_train_step): the
  training/assembly.py + training/steps.py of this tree, or the training/train.py of older
  ones."""
  from training import steps  # pylint: disable=import-outside-toplevel
  try:
    from training import assembly as api  # pylint: disable=import-outside-toplevel
  except ImportError:
    from training import train as api  # pylint: disable=import-outside-toplevel
  return api, getattr(steps, 'jit_train_step', None) or api.jit_train_step


def _config(attention: str, shape: str, tokens: int, dtype: str = ''):
  """configs/tiny.py with `attention` (NAME or NAME@IMPL), at `shape` ('tiny' or a row
  length), in `dtype` ('' keeps the recipe's float32)."""
  from configs import tiny  # pylint: disable=import-outside-toplevel
  config = tiny.get_config()
  config.model.attention, _, impl = attention.partition('@')
  if dtype:
    config.model.dtype = dtype
  if impl:
    config.model.attention_impl = impl
  if shape != 'tiny':
    n = int(shape)
    config.data.name = 'parity'         # Any embedded source: only shapes matter here.
    config.data.num_bits = n // 2       # Parity gives rows of 2 * num_bits inputs.
    config.model.max_len = n
    config.batch_size = max(1, tokens // n)
  return config


def _as_stream(config, api):
  """The same shapes as a data.packing='stream' text run (segment memory needs one); built
  without data (vocabulary and row length from the config)."""
  import input_pipeline  # pylint: disable=import-outside-toplevel
  source = input_pipeline.make_source(config)
  multiple = getattr(api, 'VOCAB_MULTIPLE', 128)
  config.model.vocab_size = config.model.vocab_size or -(-source.vocab_size // multiple) * multiple
  config.seq_len = source.seq_len
  config.data.name = 'c4'
  config.data.packing = 'stream'


# (name, what the error says, change): tried in order, each at most once, when a build fails.
ADJUSTMENTS = (
    ('position_embedding=none', "position_embedding='none'",
     lambda config, api: setattr(config.model, 'position_embedding', 'none')),
    ('stream data (random tokens)', "packing='stream'", _as_stream),
)


def _build(config, api):
  """(Setup, adjustments made): the defaults first, then ADJUSTMENTS as the errors ask."""
  made = []
  while True:
    try:
      data = not any(name.startswith('stream') for name in made)
      return api.build(config, data=data), made
    except ValueError as e:
      fix = next((a for a in ADJUSTMENTS if a[1] in str(e) and a[0] not in made), None)
      if fix is None:
        raise
      fix[2](config, api)
      made.append(fix[0])


def _local_batch(setup, vocab_size: int, rows: int, seq_len: int) -> dict:
  """The task's first training batch, or random tokens when built without data."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  if setup.data is not None and getattr(setup.data, 'train_batch', None) is not None:
    return setup.data.train_batch(0)
  tokens = np.random.default_rng(0).integers(3, vocab_size, (rows, seq_len + 1), dtype=np.int32)
  return {'inputs': tokens[:, :-1], 'targets': tokens[:, 1:],
          'weights': np.ones((rows, seq_len), np.float32),
          'positions': np.broadcast_to(np.arange(seq_len, dtype=np.int32),
                                       (rows, seq_len)).copy(),
          'segment_ids': np.ones((rows, seq_len), np.int32)}


def measure(attention: str, shape: str, tokens: int, iters: int, dtype: str = '') -> dict:
  """One variant's train step at one shape, timed in this process."""
  try:
    from training import xla_flags  # pylint: disable=import-outside-toplevel
  except ImportError:
    pass
  else:
    xla_flags.set_cpu_defaults()  # As main.py does, before JAX starts its backend.
    if hasattr(xla_flags, 'skip_absent_tpu'):
      xla_flags.skip_absent_tpu()
  import jax  # pylint: disable=import-outside-toplevel
  from models import transformer  # pylint: disable=import-outside-toplevel
  from training import sharding  # pylint: disable=import-outside-toplevel

  row = {'variant': attention, 'shape': shape}
  api, jit_train_step = _api()
  config = _config(attention, shape, tokens, dtype)
  setup, made = _build(config, api)
  mc = setup.model_config
  row.update(seq_len=setup.seq_len, batch=config.batch_size, dtype=config.model.dtype,
             backend=jax.default_backend(), adjust=', '.join(made),
             params_M=mc.num_params() / 1e6,
             impl=','.join(dict.fromkeys(transformer.implementations(mc))))
  state = api.init_state(setup, 0)
  # The training loop's step: the model with what its variants derive from the parameters
  # (adaptive span's trimmed spans at their initial values).
  specialize = getattr(api, 'specialized_model', None)
  model = specialize(setup, state.params) if specialize else setup.model
  step = jit_train_step(setup, model)
  local = _local_batch(setup, mc.vocab_size, config.batch_size, setup.seq_len)
  batch = api.device_batch(setup, local)
  key = jax.random.key(0)
  holder = {'state': state}

  def run():
    holder['state'], metrics = step(holder['state'], batch, key)
    jax.block_until_ready(metrics['loss'])

  with sharding.activate(setup.mesh, setup.rules):
    start = time.perf_counter()
    run()
    row['compile_s'] = time.perf_counter() - start
    run()  # Warm-up.
    times, cpu = [], []
    for _ in range(iters):
      start, start_cpu = time.perf_counter(), time.process_time()
      run()
      times.append(time.perf_counter() - start)
      cpu.append(time.process_time() - start_cpu)
  row['step_ms'] = 1e3 * statistics.median(times)
  # CPU seconds of every thread of the process: what the step costs, less what other work on
  # a shared machine takes from it (a wall time that waits for a core grows; this does not).
  row['cpu_ms'] = 1e3 * statistics.median(cpu)
  row['best_ms'] = 1e3 * min(times)
  row['tokens_per_s'] = config.batch_size * setup.seq_len / statistics.median(times)
  return row


def worker(args) -> None:
  """--worker: measures one (variant, shape) and writes the row (or its error) to --out."""
  attention, shape = args.attention[0], args.shapes[0]
  try:
    row = measure(attention, shape, args.tokens, args.iters, args.dtype)
  except Exception as e:  # pylint: disable=broad-except
    lines = [l for l in str(e).splitlines() if l.strip()] or [type(e).__name__]
    row = {'variant': attention, 'shape': shape, 'error': f'{type(e).__name__}: {lines[0]}'}
  with open(args.out, 'w') as f:
    json.dump(row, f)


# -------------------------------------------------------------------------- the table


def child(tree: str, attention: str, shape: str, args) -> dict:
  """The row of one worker run against `tree`'s packages (its own process)."""
  with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, 'row.json')
    # -P: the script's folder (benchmarks/, whose input_pipeline.py would shadow the package)
    # is not put on sys.path; the tree's root is, through PYTHONPATH.
    cmd = [sys.executable, '-P', os.path.abspath(__file__), '--worker', '--attention', attention,
           '--shapes', shape, '--tokens', str(args.tokens), '--iters', str(args.iters),
           '--out', out] + (['--dtype', args.dtype] if getattr(args, 'dtype', '') else [])
    env = dict(os.environ)
    env['PYTHONPATH'] = os.pathsep.join([tree] + ([env['PYTHONPATH']] if env.get('PYTHONPATH')
                                                  else []))
    env.setdefault('JAX_PLATFORMS', 'cpu')
    env.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
    try:
      proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True,
                            timeout=args.timeout or None, check=False)
    except subprocess.TimeoutExpired:
      return {'variant': attention, 'shape': shape, 'error': f'timed out after {args.timeout} s'}
    if proc.returncode == 0 and os.path.exists(out):
      with open(out) as f:
        return json.load(f)
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    why = lines[-1] if lines else f'exit {proc.returncode}'
    if proc.returncode < 0:
      why = f'killed by signal {-proc.returncode} (out of memory?); {why}'
    return {'variant': attention, 'shape': shape, 'error': why[:300]}


def combine(after: dict, before: dict | None) -> dict:
  """One table row: this tree's numbers, with the earlier tree's beside them."""
  row = {k: after.get(k) for k in ('variant', 'shape', 'seq_len', 'batch', 'dtype', 'backend',
                                   'impl', 'adjust',
                                   'params_M', 'compile_s', 'step_ms', 'best_ms', 'cpu_ms',
                                   'tokens_per_s', 'error')}
  if before is not None:
    row.update(before_seq_len=before.get('seq_len'), before_impl=before.get('impl'),
               before_adjust=before.get('adjust'), before_compile_s=before.get('compile_s'),
               before_step_ms=before.get('step_ms'), before_cpu_ms=before.get('cpu_ms'),
               before_tokens_per_s=before.get('tokens_per_s'), before_error=before.get('error'))
    if after.get('step_ms') and before.get('step_ms'):
      row['after/before'] = after['step_ms'] / before['step_ms']
    if after.get('cpu_ms') and before.get('cpu_ms'):
      row['cpu after/before'] = after['cpu_ms'] / before['cpu_ms']
  return row


def annotate(row: dict, dense: dict | None, engine: dict | None = None) -> None:
  """Adds x_dense, x_engine (against dense on the same blocked engine, for a row that runs
  it) and the note (errors, the reason a row is slow) to `row`."""
  if dense and dense.get('tokens_per_s') and row.get('tokens_per_s'):
    row['x_dense'] = dense['tokens_per_s'] / row['tokens_per_s']
  if (engine and engine.get('tokens_per_s') and row.get('tokens_per_s')
      and row.get('impl') == ENGINE):
    row['x_engine'] = engine['tokens_per_s'] / row['tokens_per_s']
  notes = []
  if row.get('error'):
    notes.append(f"error: {row['error']}")
  if row.get('before_error'):
    notes.append(f"before: error: {row['before_error']}")
  if row.get('x_dense', 0) > SLOW and row['variant'] in NOTES:
    notes.append(NOTES[row['variant']])
    if dense.get('impl') and row.get('impl') and row['impl'] != dense['impl']:
      notes.append(OTHER_PATH.format(impl=row['impl'], dense=dense['impl']))
  row['note'] = '; '.join(notes)


def _git(*argv: str) -> str:
  return subprocess.run(['git', *argv], cwd=ROOT, capture_output=True, text=True,
                        check=True).stdout.strip()


def _revision(default: str = 'unknown') -> tuple[str, bool]:
  """(this checkout's short commit, whether tracked files changed): GIT_COMMIT where it is set
  (a copy of the working tree on a lent machine, whose git history may be missing or older
  than the tree), else git's answer, else `default`."""
  if os.environ.get('GIT_COMMIT'):
    return os.environ['GIT_COMMIT'], False
  try:
    return (_git('rev-parse', '--short', 'HEAD'),
            bool(_git('status', '--porcelain', '--untracked-files=no')))
  except (OSError, subprocess.CalledProcessError):
    return default, False


def before_tree(before: str) -> tuple[str | None, bool]:
  """(label, whether it is a commit to check out) of --before: a folder holding a checkout of
  the earlier commit is used as it is and labelled by its name; anything else is a revision."""
  if not before:
    return None, False
  if os.path.isdir(before):
    if not os.path.isdir(os.path.join(before, 'models')):
      raise ValueError(f'--before {before}: a folder, but not a checkout of this repository '
                       '(no models/ in it)')
    return os.path.basename(os.path.normpath(before)), False
  return _git('rev-parse', '--short', before), True


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--attention', nargs='+', default=None,
                      help='variants to run, NAME or NAME@IMPL (an attention_impl; default: '
                           f'every registered one and {ENGINE_DENSE}); dense is always run '
                           'too, as the reference of x_dense')
  parser.add_argument('--shapes', nargs='+', default=list(SHAPES),
                      help="'tiny' (configs/tiny.py as main.py trains it) or row lengths N")
  parser.add_argument('--tokens', type=int, default=16384,
                      help='tokens per step at a row length N: batch = max(1, tokens // N)')
  parser.add_argument('--iters', type=int, default=5, help='timed steps (after 1 warm-up)')
  parser.add_argument('--before', default='', help='an earlier git commit to run beside this '
                                                   'checkout, row by row, or a folder holding '
                                                   "a checkout of it")
  parser.add_argument('--dtype', default='', choices=('', 'float32', 'bfloat16'),
                      help="model.dtype ('': the recipe's float32)")
  parser.add_argument('--timeout', type=int, default=3600,
                      help='seconds one row may take (0: no limit); a row past it keeps an '
                           'error')
  parser.add_argument('--out', default=os.path.join(ROOT, 'results', 'variant_speed.json'))
  parser.add_argument('--doc', default=os.path.join(ROOT, 'docs', 'variant_speed.md'),
                      help="the page whose table is rewritten at the end ('' for none)")
  parser.add_argument('--render', action='store_true',
                      help='only rewrite --doc from the JSON at --out (no measurement)')
  parser.add_argument('--worker', action='store_true', help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.worker:
    worker(args)
    return
  if args.render:
    with open(args.out) as f:
      write_doc(json.load(f), args.doc)
    return
  for shape in args.shapes:
    if shape != 'tiny' and (not shape.isdigit() or int(shape) < 2 or int(shape) % 2):
      parser.error(f"--shapes: {shape!r} is neither 'tiny' nor an even row length")

  os.environ.setdefault('JAX_PLATFORMS', 'cpu')  # The machine the JSON records: its CPU.
  from benchmarks import common  # pylint: disable=import-outside-toplevel
  from models import attention as attention_lib  # pylint: disable=import-outside-toplevel
  known = attention_lib.known()
  variants = args.attention or known + [ENGINE_DENSE]
  unknown = sorted({v for v in variants if v.partition('@')[0] not in known})
  if unknown:
    parser.error(f'unknown variants {", ".join(unknown)}; known: {", ".join(known)}')
  # dense first (x_dense), then dense on the blocked engine (x_engine), then the rest.
  variants = ['dense'] + sorted((v for v in dict.fromkeys(variants) if v != 'dense'),
                                key=lambda v: v != ENGINE_DENSE)

  after, dirty = _revision()
  try:
    before, checkout = before_tree(args.before)
  except (ValueError, subprocess.CalledProcessError) as e:
    parser.error(str(e).strip() or f'--before {args.before}: not a commit of this repository')
  worktree = os.path.abspath(args.before) if args.before and not checkout else None
  # A stopped run (kill, a job scheduler's SIGTERM) still removes its worktree and its
  # running child (subprocess.run kills the child when the exit interrupts it).
  signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
  if checkout:
    worktree = tempfile.mkdtemp(prefix='variant_speed_')
    subprocess.run(['git', 'worktree', 'add', '--detach', worktree, args.before], cwd=ROOT,
                   check=True, capture_output=True)
  rows = []
  columns = ['variant', 'shape', 'seq_len', 'batch', 'impl', 'adjust', 'compile_s', 'step_ms',
             'tokens_per_s', 'x_dense', 'x_engine']
  if args.before:
    columns += ['before_step_ms', 'before_tokens_per_s', 'after/before', 'cpu after/before']
  columns.append('note')

  def save():
    common.write_json(args.out, {'after': after, 'after_uncommitted_changes': dirty,
                                 'before': before, 'settings': vars(args), 'notes': NOTES,
                                 'machine': common.machine(), 'rows': rows})

  try:
    for shape in args.shapes:
      dense = engine = None
      for variant in variants:
        old = child(worktree, variant, shape, args) if worktree else None
        row = combine(child(ROOT, variant, shape, args), old)
        if variant == 'dense':
          dense = row
        if variant == ENGINE_DENSE:
          engine = row
        annotate(row, dense, engine)
        rows.append(row)
        print(' '.join(f'{c}={row[c]:.4g}' if isinstance(row.get(c), float) else
                       f'{c}={row[c]}' for c in columns if row.get(c) not in (None, '')),
              flush=True)
        save()
  finally:
    if checkout:
      subprocess.run(['git', 'worktree', 'remove', '--force', worktree], cwd=ROOT, check=False)
  print()
  common.print_table(rows, columns)
  if args.doc:
    with open(args.out) as f:
      write_doc(json.load(f), args.doc)


def _fmt(value, digits: int = 0) -> str:
  if value is None or value == '':
    return ''
  if isinstance(value, float):
    return f'{value:,.{digits}f}'
  return str(value)


def markdown(payload: dict) -> str:
  """The table of a results JSON as markdown (docs/variant_speed.md)."""
  before = payload.get('before')
  head = ['variant', 'shape', 'rows x tokens', 'path', 'compile s', 'step ms', 'tokens/s',
          'x dense', f'x {ENGINE_DENSE}']
  if before:
    head += [f'{before} step ms', f'after / {before}', f'CPU time after / {before}']
  head.append('why slower than dense')
  lines = ['| ' + ' | '.join(head) + ' |', '|' + '---|' * len(head)]
  for r in payload['rows']:
    cells = [r['variant'], r['shape'],
             f"{r.get('batch')} x {r.get('seq_len')}" if r.get('seq_len') else '',
             _fmt(r.get('impl')), _fmt(r.get('compile_s'), 1), _fmt(r.get('step_ms'), 1),
             _fmt(r.get('tokens_per_s')), _fmt(r.get('x_dense'), 2),
             _fmt(r.get('x_engine'), 2)]
    if before:
      cells += [_fmt(r.get('before_step_ms'), 1), _fmt(r.get('after/before'), 2),
                _fmt(r.get('cpu after/before'), 2)]
    cells.append(_fmt(r.get('note')).replace('|', '/'))
    lines.append('| ' + ' | '.join(cells) + ' |')
  return '\n'.join(lines) + '\n'


BEGIN, END = '<!-- variant_speed table -->', '<!-- end of variant_speed table -->'


def write_doc(payload: dict, path: str) -> None:
  """Puts the table between the BEGIN and END markers of `path` (the page's prose stays)."""
  with open(path) as f:
    text = f.read()
  if BEGIN not in text or END not in text:
    raise ValueError(f'{path} has no {BEGIN} ... {END} markers for the table')
  head, rest = text.split(BEGIN, 1)
  _, tail = rest.split(END, 1)
  machine = payload.get('machine', {})
  dirty = ' with uncommitted changes' if payload.get('after_uncommitted_changes') else ''
  against = f", against {payload['before']}" if payload.get('before') else ''
  host = (f"{machine.get('cpu') or machine.get('platform', '?')} "
          f"({machine.get('cpu_count', '?')} cores, jax {machine.get('jax', '?')})")
  if machine.get('backend') not in (None, 'cpu'):
    host = f"one {machine.get('device_kind', machine['backend'])} (host: {host})"
  dtype = payload.get('settings', {}).get('dtype') or 'float32'
  where = (f"\nMeasured on {host}, {dtype}, commit {payload['after']}{dirty}{against}.\n\n")
  with open(path, 'w') as f:
    f.write(head + BEGIN + where + markdown(payload) + END + tail)


if __name__ == '__main__':
  main()
