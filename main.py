"""Entry point: train, evaluate or sample a decoder-only model of the attention zoo.

  python main.py --config=configs/tiny.py --workdir=/tmp/tiny
  python main.py --config=configs/tiny.py --workdir=/tmp/tiny --mode=eval
  python main.py --workdir=/tmp/text --mode=generate --config.generate.prompt='Once upon a time'
  python main.py --workdir=/tmp/tiny --mode=generate --config.generate.prompt='1 5 9'
  python main.py --workdir=/tmp/tiny --mode=harness --config.harness.limit=256
  python main.py --config=configs/default.py --config.model.attention=fixed --mode=inspect
  python main.py --config=configs/default.py --workdir=gs://bucket/run --config.model.attention=dense
  python main.py --config=configs/default.py --mode=compile --config.compile_topology=v5e:4x4
"""

import os
import sys

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')  # TensorFlow's (tf.data, TFDS) C++ chatter.

from absl import app, flags, logging
from ml_collections import config_flags

from training import xla_flags

xla_flags.set_cpu_defaults()
xla_flags.skip_absent_tpu()

from training import modes  # noqa: E402  (after the flags above: it imports JAX)

FLAGS = flags.FLAGS
flags.DEFINE_string('workdir', None, 'Checkpoints, TensorBoard events and eval results go here.')
flags.DEFINE_enum('mode', 'train', modes.names(), modes.help_text())
flags.DEFINE_string('coordinator_address', None,
                    'Multi-host: host:port of process 0 (default: env JAX_COORDINATOR_ADDRESS; '
                    'srun, mpirun and Cloud TPU pods are detected without it).')
flags.DEFINE_integer('num_processes', None,
                     'Multi-host: number of processes (default: env JAX_NUM_PROCESSES).')
flags.DEFINE_integer('process_id', None, 'Multi-host: this process\'s index in '
                     '[0, num_processes) (default: env JAX_PROCESS_ID).')
flags.DEFINE_list('allow_config_change', [],
                  'In a workdir that holds a run (WORKDIR/config.json, the source of truth for '
                  'resume, eval, inspect and pruning): config keys, or groups such as model, '
                  'whose --config overrides may change the recorded model or training (e.g. '
                  'learning_rate,model.attention_options.local.window), or all. Run-time settings '
                  '(steps, eval, logging, checkpoints, mesh, data paths) never need it.')


def _bad_command_line(error: Exception, argv) -> None:
  """Reports a bad flag or --config override (unknown field, wrong type) in one line, not as
  absl's and ml_collections' chained tracebacks, and exits 1."""
  cause = error
  while cause.__cause__ is not None or cause.__context__ is not None:
    cause = cause.__cause__ or cause.__context__
  # absl's own error names the flag ('flag --mode=bogus: value should be one of ...'); its
  # cause has only the reason. ml_collections' errors name the field in the cause.
  what = f'{type(cause).__name__}: {cause}'
  if isinstance(error, flags.IllegalFlagValueError) and str(error).startswith('flag --'):
    what = str(error)
  overrides = [a for a in argv[1:] if a.startswith('--config.')]
  from training import run_config  # pylint: disable=g-import-not-at-top
  given = dict(a[len('--config.'):].partition('=')[::2] for a in overrides)
  variants = [v.strip() for v in given.get('model.attention', '').split(',') if v.strip()]
  renamed = run_config.renamed_message(given, variants or None, prefix='--config.',
                                       new_prefix='--config.')
  if renamed:  # A key that was renamed: name the new one (run_config.renamed_keys).
    print(f'error: bad command line: {renamed}', file=sys.stderr)
    sys.exit(1)
  unknown = run_config.unknown_option_message(given)
  if unknown:  # An option its group does not declare: name the ones it has.
    print(f'error: bad command line: {unknown}', file=sys.stderr)
    sys.exit(1)
  print(f'error: bad command line ({what}); config overrides given: '
        f'{" ".join(overrides) or "none"}. Fields and their types are in the recipe and '
        "configs/schema.py", file=sys.stderr)
  sys.exit(1)


try:  # ml_collections applies the --config.* overrides here, at definition.
  config_flags.DEFINE_config_file(
      'config', os.path.join(os.path.dirname(__file__), 'configs/tiny.py'),
      'Recipe file (a get_config() in configs/); override fields with --config.key=value.',
      lock_config=True)
except Exception as e:  # pylint: disable=broad-except  (it raises many kinds)
  _bad_command_line(e, sys.argv)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  import jax
  from training import agreement, checkpoints, distributed, metrics, run_config, workdir_lock
  metrics.quiet_libraries()
  recipe_file = config_flags.get_config_filename(FLAGS['config'])
  # The workdir's record is the run's config; the command line asks for the --config.KEY
  # flags given (and a recipe named with --config), not for the recipe's defaults.
  request = run_config.Request(
      keys=frozenset(config_flags.get_override_values(FLAGS['config'])), recipe=recipe_file,
      recipe_given=FLAGS['config'].present > 0, allow=tuple(FLAGS.allow_config_change))
  recipe = os.path.splitext(os.path.basename(recipe_file))[0]
  workdir = FLAGS.workdir or os.path.join('runs', recipe)
  try:
    distributed.initialize(os.environ, coordinator_address=FLAGS.coordinator_address,
                           num_processes=FLAGS.num_processes, process_id=FLAGS.process_id)
    logging.info('JAX %s, %d devices (%s), process %d/%d; workdir %s', jax.__version__,
                 jax.device_count(), jax.devices()[0].device_kind, jax.process_index(),
                 jax.process_count(), workdir)
    modes.get(FLAGS.mode)(FLAGS.config, workdir, request)
  except (ValueError, NotImplementedError, PermissionError, FileNotFoundError, FloatingPointError,
          checkpoints.CheckpointError, workdir_lock.WorkdirBusy) as e:
    logging.error('%s: %s', type(e).__name__, e)
    print(f'error: {e}', file=sys.stderr)
    if not isinstance(e, (agreement.Disagreement, workdir_lock.WorkdirBusy)):
      # An error this process may have met alone: the others would wait for it in their next
      # collective or exchange. Every process met a disagreement and the lock's verdict.
      distributed.stop_run(str(e), peer_suspected=distributed.caused_by_a_peer(e))
    sys.exit(1)
  except jax.errors.JaxRuntimeError as e:
    if 'RESOURCE_EXHAUSTED' in str(e):
      logging.error('JaxRuntimeError: %s', e)
      message = _out_of_memory(e, FLAGS.config)
      print(f'error: {message}', file=sys.stderr)
      distributed.stop_run(message)
      sys.exit(1)
    if jax.process_count() == 1:
      raise
    # A collective failed because another process is gone (gloo saw it before the peer
    # watch did): one line here; at exit the peer watch names the lost process, exits 1.
    logging.error('JaxRuntimeError: %s', e)
    print(f'error: a collective with the other processes failed '
          f'({str(e).strip().splitlines()[0]}); the peer watch names the lost process',
          file=sys.stderr)
    sys.exit(1)
  except Exception as e:  # pylint: disable=broad-except  (a bug, or an error not foreseen)
    if jax.process_count() == 1:
      raise
    # On several processes the others would wait for this one in their next collective until
    # jax's shutdown timeout: the traceback goes to the log, and every process stops.
    logging.exception('%s on process %d', type(e).__name__, jax.process_index())
    print(f'error: {type(e).__name__}: {e} (traceback in the log)', file=sys.stderr)
    distributed.stop_run(f'{type(e).__name__}: {e}',
                         peer_suspected=distributed.caused_by_a_peer(e))
    sys.exit(1)


def _out_of_memory(e: Exception, config) -> str:
  """What to do when a run needs more memory than its devices have (a paper recipe run on a
  laptop, a batch too large for the slice): the usual levers, and the check that costs no run."""
  import jax
  devices = jax.devices()
  where = f'{len(devices)} {devices[0].platform} device{"s" if len(devices) > 1 else ""}'
  topology = config.get('compile_topology', '')
  sized = (f'; this recipe is sized for the TPU slice {topology!r} (config.compile_topology)'
           if topology else '')
  return (f'out of memory on {where} ({str(e).strip().splitlines()[0]}){sized}. Lower '
          f'config.batch_size or config.seq_len, set config.model.remat=full, or shard over '
          f'more devices (config.mesh); --mode=compile reports the memory per device without '
          f'running. Saved checkpoints are untouched')


def parse_flags(argv):
  """absl's flag parsing, with a bad flag or override reported in one line."""
  try:
    return FLAGS(argv)
  except Exception as e:  # pylint: disable=broad-except  (absl and ml_collections raise many)
    _bad_command_line(e, argv)


if __name__ == '__main__':
  app.run(main, flags_parser=parse_flags)
