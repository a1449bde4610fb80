"""One harness for every training experiment: runs as data, trained in process, measured alike.

    from experiments import harness
    base = harness.base_config('configs/local_text.py', steps=300, d=2, workdir=OUT,
                               overrides=['data.files=../shared/data/tinyshakespeare.txt'])
    rows = harness.run(['dense', 'local:window=64', {'model.attention': 'selective'}],
                       base, seeds=[0, 1], out=OUT, time_rounds=2)

A run is a variant spec or a dict of config overrides:

- 'NAME' or 'NAME:KEY=V[:KEY=V]': a registered attention variant or a preset (configs/presets.py:
  gtrxl, reformer, universal) with options; KEY is an attention, stack or block option (window,
  mem_len, act, gate_bias, ...), a model field (block, stack, ...) or a dotted config key. The
  values are read by ml_collections' own override parser, as main.py reads --config.KEY=V.
- {dotted key: value}: typed overrides of the base config (ml_collections checks the types).
- Run(name, overrides): either of those with a name of its own for the row and the folder.

Every run is a real training run (training.train.train_and_evaluate) in OUT[/seed<S>]/<run>:
a finished run is kept and measured again, an interrupted one resumes. A variant gets what it
needs to run: relative-position variants no absolute positions, variants with segment memory
rows that continue one text stream. Every config is built before any run trains, so a bad
spec fails in seconds. A progress bar counts runs and, within a run, steps (tqdm, on stderr).

Each run's measurement is a row of experiments/rows.py (run() returns them; an experiment adds
its own measurements with rows.add and aggregates seeds with rows.over_seeds): its metrics the
eval loss and bits per byte at the last step, parameters, training FLOPs per token, training
tokens/s, the compiled peak memory of one attention layer's forward + backward and the
decoding cache of one row; its curves those of the eval loss and bits per byte, the training
loss and tokens/s; its fields the run's workdir, attention implementations, stack and data
packing.
Tokens/s: with time_rounds > 0, each run's train step with its trained parameters, timed
round-robin among the runs of the same seed (a busy phase of a shared machine slows all alike;
the median over rounds); with 0, the median of the run's logged windows that hold no compile,
evaluation or checkpoint save.

Within `with harness.time_limit(SECONDS) as limit:` (experiments/paper_scale.py, one device
lease), a run still training at the limit is stopped as a SIGTERM stops it (its checkpoint is
saved), no run starts after it, and run() returns the rows that finished (of whole seeds only,
so that variants are compared at equal seeds) instead of raising Preempted; `limit.cut` says
what was stopped.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib.util
import os
import re
import signal
import statistics
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Union

from training import xla_flags

xla_flags.set_cpu_defaults()  # As main.py does, before JAX starts its backend.

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_collections  # noqa: E402
from absl import flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from benchmarks import common  # noqa: E402
from configs import presets  # noqa: E402
from experiments import rows as rows_lib  # noqa: E402
from models import attention, decode, residual, transformer  # noqa: E402
from training import assembly, evaluation, run_config, sharding, steps, train  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Run:
  """A named run: `overrides` is a variant spec ('local:window=64') or {dotted key: value}."""
  name: str
  overrides: Union[str, Mapping[str, Any]]


RunLike = Union[str, Mapping[str, Any], Run]


# ---------------------------------------------------------------- configs


def load_recipe(path: str) -> ml_collections.ConfigDict:
  """get_config() of a recipe file."""
  spec = importlib.util.spec_from_file_location('harness_recipe', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def flatten(config, prefix: str = '') -> dict:
  """{dotted key: value} of every leaf of a ConfigDict."""
  out = {}
  for key, value in config.items():
    if isinstance(value, ml_collections.ConfigDict):
      out.update(flatten(value, f'{prefix}{key}.'))
    else:
      out[f'{prefix}{key}'] = value
  return out


def override(config: ml_collections.ConfigDict,
             overrides: Mapping[str, Any] | Sequence[str]) -> ml_collections.ConfigDict:
  """A copy of `config` with `overrides` applied: {dotted key: value} (typed values), or
  'KEY=VALUE' strings read by ml_collections' command-line parser (as --config.KEY=VALUE is
  read by main.py: the field's type decides, e.g. true/false for a bool). An unknown key or a
  value of the wrong type is a ValueError naming it."""
  config = copy.deepcopy(config)
  if isinstance(overrides, Mapping):
    known = flatten(config)
    for key, value in overrides.items():
      if key not in known:
        raise ValueError(f'unknown config key {key!r}')
      try:
        config.update_from_flattened_dict({key: value})
      except (TypeError, ValueError) as e:
        raise ValueError(f'{key}={value!r}: {e}') from e
    return config
  args = ['harness']
  for item in overrides:
    key, sep, _ = item.partition('=')
    if not sep or not key:
      raise ValueError(f'expected KEY=VALUE, got {item!r}')
    if key not in flatten(config):
      raise ValueError(f'unknown config key {key!r}')
    args.append(f'--config.{item}')
  values = flags.FlagValues()
  try:
    config_flags.DEFINE_config_dict('config', config, flag_values=values, sys_argv=args)
    values(args)
  except flags.Error as e:
    raise ValueError(str(e)) from e
  return values.config


def base_config(recipe: str | ml_collections.ConfigDict, *, steps: int, evals: int = 10,
                d: int = 0, overrides: Mapping[str, Any] | Sequence[str] = (),
                workdir: str = '') -> ml_collections.ConfigDict:
  """The recipe (a file or a config) trained for `steps` steps (warm-up at most a sixth of
  them) with `evals` evaluations, a log line at least every 40th of the run, no samples at
  evaluation (sample a run later with main.py), optionally sized by `d` (d_model 64 d, d heads,
  d layers), then `overrides` (which win). Local text files become absolute paths, prepared
  under `workdir`/tfds unless data.data_dir is set."""
  if steps < 1 or evals < 1:
    raise ValueError(f'steps and evals must be >= 1, got {steps} and {evals}')
  config = load_recipe(recipe) if isinstance(recipe, str) else copy.deepcopy(recipe)
  if d:
    config.model.d = d
    for key in ('d_model', 'n_heads', 'n_layers', 'head_dim', 'mlp_dim'):
      config.model[key] = 0
  config.total_steps = steps
  config.warmup_steps = min(config.warmup_steps, max(1, steps // 6))
  config.eval_every_steps = max(1, steps // evals)
  config.log_every_steps = max(1, min(config.log_every_steps, steps // 40))
  config.checkpoint_every_steps = min(config.checkpoint_every_steps, steps)
  if 'generate' in config:  # No samples at each eval: they would fall into the timed windows.
    config.generate.eval_samples = 0
  config = override(config, overrides)
  if config.data.name == 'local_text':
    if not config.data.files:
      raise ValueError('local_text data needs files: data.files=PATH (e.g. '
                       '../shared/data/tinyshakespeare.txt)')
    config.data.files = ','.join(os.path.abspath(f) for f in config.data.files.split(','))
    if not config.data.data_dir and workdir:  # The prepared TFDS copy lives with the runs.
      config.data.data_dir = os.path.join(os.path.abspath(workdir), 'tfds')
  return config


def describe(base: ml_collections.ConfigDict) -> dict:
  """The settings every run of a base config shares, for a results file."""
  data = base.data
  return {'seed': base.seed, 'total_steps': base.total_steps, 'seq_len': base.seq_len,
          'batch_size': base.batch_size, 'learning_rate': base.learning_rate,
          'warmup_steps': base.warmup_steps, 'eval_every_steps': base.eval_every_steps,
          'eval_steps': base.eval_steps, 'dtype': base.model.dtype, 'data': data.name,
          'files': [os.path.basename(f) for f in data.get('files', '').split(',') if f]}


def option_keys(config, key: str) -> list[str]:
  """The dotted config keys a spec option names: an option of the attention variants in use
  (model.attention_options.<variant>.<key>, for each that declares it), a stack or residual
  option, a model field, or a dotted (or top-level) config key."""
  variants = list(dict.fromkeys(n.strip() for n in config.model.attention.split(',')))
  found = [f'model.attention_options.{v}.{key}' for v in variants
           if v in attention.known() and key in attention.options(v)]
  if found:
    return found
  for group, registry in transformer.OPTION_GROUPS.items():
    if not registry.per_entry and key in registry.options():
      return [f'model.{group}.{key}']
  if key in config.model and not isinstance(config.model[key], ml_collections.ConfigDict):
    return [f'model.{key}']
  if key in flatten(config):
    return [key]
  # A renamed option of a variant in use, else a renamed model field (block -> residual).
  renamed = ([k for k in run_config.renamed_keys(f'model.attention_options.{key}', variants)
              if k.split('.')[2] in variants] or run_config.renamed_keys(f'model.{key}'))
  if renamed:
    raise ValueError(f'{key} was renamed {renamed[0].split(".")[-1]} '
                     f'({", ".join(renamed)})')
  raise ValueError(f'{key!r} is neither an attention option of {", ".join(variants)}, a stack '
                   'or residual option, a model field nor a config key')


def parse_spec(spec: str) -> tuple[str, list[tuple[str, str]]]:
  """'name:k=v:k2=v2' -> (name, [(k, v), (k2, v2)])."""
  name, *items = [p.strip() for p in spec.split(':')]
  pairs = []
  for item in items:
    key, sep, value = item.partition('=')
    if not sep or not key:
      raise ValueError(f'variant {spec!r}: options are KEY=VALUE after a colon, got {item!r}')
    pairs.append((key.strip(), value.strip()))
  if name not in attention.known() and name not in presets.PRESETS:
    raise ValueError(f'variant {spec!r}: {name!r} is neither a registered attention variant '
                     f'({", ".join(attention.known())}) nor a preset '
                     f'({", ".join(presets.PRESETS)})')
  return name, pairs


def variant_config(base: ml_collections.ConfigDict,
                   spec: str | Mapping[str, Any]) -> ml_collections.ConfigDict:
  """The base config with the variant of `spec` (a spec string or {dotted key: value}) and
  what that variant needs to run."""
  if isinstance(spec, Mapping):
    given = dict(spec)
    config = override(base, given)
  else:
    name, pairs = parse_spec(spec)
    given = (presets.PRESETS[name](base) if name in presets.PRESETS
             else {'model.attention': name})
    config = override(base, given)
    texts = []
    for key, text in pairs:
      for dotted in option_keys(config, key):
        given[dotted] = None
        texts.append(f'{dotted}={text}')
    try:
      config = override(config, texts)
    except ValueError as e:
      raise ValueError(f'variant {spec!r}: {e}') from e
  names = [n.strip() for n in config.model.attention.split(',') if n.strip()]
  declared = [attention.traits.of(n) for n in names]
  options = attention.resolve_options(
      {k: dict(v) for k, v in config.model.attention_options.items()}, names)
  if any(t.RELATIVE_POSITIONS for t in declared) and 'model.position_embedding' not in given:
    config.model.position_embedding = 'none'
  if any(t.uses_memory(options[n]) for n, t in zip(names, declared)) and (
      'data.packing' not in given):
    config.data.packing = 'stream'  # Memory carries a row's previous segment to the next batch.
  return config


def own_keys(base, config) -> dict:
  """{key: value} where a run's config differs from the base."""
  before, after = flatten(base), flatten(config)
  return {k: v for k, v in after.items() if before.get(k) != v}


def folder(name: str) -> str:
  """A run's folder name."""
  return re.sub(r'[^\w.=-]+', '_', name)


def _named(run: RunLike) -> Run:
  if isinstance(run, Run):
    return run
  if isinstance(run, str):
    return Run(run, run)
  if isinstance(run, Mapping):
    return Run(','.join(f'{k}={v}' for k, v in run.items()) or 'base', dict(run))
  raise TypeError(f'a run is a variant spec, a dict of overrides or a Run, got {run!r}')


# ---------------------------------------------------------------- measurements


def scalar_curve(workdir: str, tag: str) -> list[tuple[int, float]]:
  """(step, value) of a scalar a run wrote to WORKDIR/tensorboard, read without TensorFlow:
  as a tensor (clu's TensorFlow writer) or as a plain scalar (clu's PyTorch writer, which the
  GPU machines' setup uses: benchmarks/gpu_env.sh). benchmarks.common.scalar_curve reads the
  first kind through TensorFlow, which a GPU image may lack."""
  from tensorboard.backend.event_processing import event_accumulator  # pylint: disable=g-import-not-at-top
  from tensorboard.util import tensor_util  # pylint: disable=g-import-not-at-top
  acc = event_accumulator.EventAccumulator(os.path.join(workdir, 'tensorboard'),
                                           size_guidance={'tensors': 0, 'scalars': 0})
  acc.Reload()
  tags = acc.Tags()
  if tag in tags.get('tensors', ()):
    points = {e.step: float(tensor_util.make_ndarray(e.tensor_proto)) for e in acc.Tensors(tag)}
  elif tag in tags.get('scalars', ()):
    points = {e.step: float(e.value) for e in acc.Scalars(tag)}
  else:
    return []
  return sorted(points.items())



def steady_tokens_per_sec(points: list[tuple[int, float]], config) -> float:
  """Median logged tokens/s over the windows without a compile, an evaluation or a checkpoint
  in them: a window's clock starts at the previous log line, so the first window holds the
  compile and the one after an eval or save step holds that eval or save."""

  def busy(step):
    return ((config.eval_every_steps and step % config.eval_every_steps == 0)
            or step % config.checkpoint_every_steps == 0)

  clean = [v for (prev, _), (_, v) in zip(points, points[1:]) if not busy(prev)]
  if not clean:  # Too short a run: any window after the first, else the first.
    clean = [v for _, v in points[1:]] or [v for _, v in points]
  return statistics.median(clean) if clean else float('nan')


class _OneAttentionLayer(nn.Module):
  """Layer `index`'s attention of a model config, as its block builds it (shared parameters
  included), on x of (batch, n, d_model)."""
  config: transformer.TransformerConfig
  index: int

  @nn.compact
  def __call__(self, x, positions, segment_ids):
    cfg = self.config
    variant = cfg.attention[self.index]
    specs = attention.traits.of(variant).shared_params(cfg.options_of(variant), cfg.n_heads,
                                                 cfg.head_dim)
    shared = (transformer.SharedParams(specs, cfg.param_dtype, name=f'{variant}_shared')()
              if specs else None)
    return residual.make_attention(cfg, variant, self.index, name='attention', shared=shared)(
        x, positions=positions, segment_ids=segment_ids, deterministic=False)


def attention_peak_bytes(mc: transformer.TransformerConfig, batch: int,
                         seq_len: int) -> int | None:
  """Largest compiled peak (arguments + outputs + temporaries) over the layers of one attention
  layer's forward + backward (gradients of the parameters and the input) at (batch, seq_len);
  nothing is computed."""
  x = jax.ShapeDtypeStruct((batch, seq_len, mc.d_model), mc.dtype)
  ids = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32)
  streams = transformer.rng_streams(mc)
  peak, seen = 0, set()
  for i in range(mc.n_layers):
    layer = _OneAttentionLayer(mc, i)
    key = jax.random.key(0)
    variables = jax.eval_shape(
        lambda x, p, s: layer.init({'params': key, **{n: key for n in streams}}, x, p, s),
        x, ids, ids)
    params = variables['params']
    rest = {k: v for k, v in variables.items() if k not in ('params', 'losses', 'metrics',
                                                              'intermediates')}

    def loss(params, x, positions, segment_ids, rest):
      y, _ = layer.apply({'params': params, **rest}, x, positions, segment_ids,
                         rngs={n: jax.random.key(1) for n in streams},
                         mutable=list(rest) + ['losses', 'metrics', 'intermediates'])
      return jnp.sum(jnp.square(y.astype(jnp.float32)))

    lowered = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(params, x, ids, ids, rest)
    signature = lowered.as_text()
    if signature in seen:  # Layers that compile alike (every layer of most variants).
      continue
    seen.add(signature)
    mem = lowered.compile().memory_analysis()
    if mem is None:  # The backend does not report it.
      return None
    peak = max(peak, mem.argument_size_in_bytes + mem.output_size_in_bytes
               + mem.temp_size_in_bytes)
  return peak


def decode_cache_bytes(mc: transformer.TransformerConfig) -> tuple[int | None, str]:
  """(bytes of the decoding caches of one row of max_len tokens, '') or (None, why not)."""
  model = transformer.Decoder(mc)
  try:
    cache = jax.eval_shape(lambda: decode.init_cache(model, None, 1))
  except (NotImplementedError, ValueError) as e:
    return None, f'{type(e).__name__}: {e}'
  return decode.cache_bytes(cache), ''


class StepTimer:
  """A run's train step (the run's compiled step with its trained parameters, e.g. adaptive
  span's trimmed spans) on a fixed batch of random tokens, run `steps` at a time."""

  def __init__(self, config, workdir: str):
    self.setup = setup = assembly.build(config, workdir=workdir)
    setup.data.close()
    _, params = assembly.latest_params(setup, workdir)
    state = assembly.init_state(setup, config.seed)
    if params is not None:
      state = state.replace(params=params)
    self._step = steps.jit_train_step(setup, assembly.specialized_model(setup, state.params))
    self.tokens = config.batch_size * setup.data.seq_len
    local = common.random_lm_batch(setup.data.vocab_size, config.batch_size, setup.data.seq_len)
    self._batch = assembly.device_batch(setup, local)
    self._rng = jax.random.key(0)
    self._state = state
    self(1)  # Compile.

  def __call__(self, steps: int) -> float:
    """Seconds for `steps` steps."""
    with sharding.activate(self.setup.mesh, self.setup.rules):
      start = time.perf_counter()
      for _ in range(steps):
        self._state, metrics = self._step(self._state, self._batch, self._rng)
      jax.block_until_ready(metrics)
      return time.perf_counter() - start


def time_round_robin(timers: dict[str, StepTimer], rounds: int, steps: int) -> dict[str, dict]:
  """Tokens/s of every run's train step, timed in rounds that run each `steps` steps in turn
  (each round starting one run later), so that a busy phase of a shared machine slows them
  alike; the median and best over the rounds."""
  names = list(timers)
  rates = {n: [] for n in names}
  for i in range(rounds):
    for name in names[i % len(names):] + names[:i % len(names)]:
      rates[name].append(steps * timers[name].tokens / timers[name](steps))
  return {n: {'median': statistics.median(r), 'best': max(r), 'rounds': r}
          for n, r in rates.items()}


def measure(name: str, config, workdir: str) -> dict:
  """The row of a trained run in `workdir` (see the module docstring), of seed None."""
  flat = {'variant': name, 'workdir': workdir}
  setup = assembly.build(config, workdir=workdir)
  try:
    step, params = assembly.latest_params(setup, workdir)
  finally:
    setup.data.close()
  mc = setup.model_config if params is None else transformer.specialized(setup.model_config,
                                                                          params)
  seq_len = setup.data.seq_len
  tags = ['eval/loss', 'eval/bits_per_byte', 'eval/scored_tokens', 'train/loss',
          'train/tokens_per_sec']
  act = mc.stack_name == 'universal' and mc.stack_option('act')
  if act:
    tags.append('train/act_steps/universal')
  curves = {tag: scalar_curve(workdir, tag) for tag in tags}
  evals = curves['eval/loss']
  flat['step'] = step
  flat['eval_loss'] = evals[-1][1] if evals else float('nan')
  bpb = curves['eval/bits_per_byte']
  flat['bits_per_byte'] = bpb[-1][1] if bpb else None
  scored = curves['eval/scored_tokens']
  flat['eval_scored_tokens'] = scored[-1][1] if scored else None
  flat['params'] = setup.model_config.num_params()
  metrics = ({'act_steps/universal': curves['train/act_steps/universal'][-1][1]}
             if act and curves['train/act_steps/universal'] else None)
  flat['train_flops_per_token'] = mc.train_flops_per_token(seq_len, metrics)
  flat['tokens_per_sec'] = steady_tokens_per_sec(curves['train/tokens_per_sec'], config)
  if _MEMORY:
    flat['attn_peak_bytes'] = attention_peak_bytes(mc, config.batch_size, seq_len)
    flat['decode_cache_bytes'], why = decode_cache_bytes(mc)
    if why:
      flat['decode_refused'] = why
  else:  # Within without_memory(): not measured.
    flat['attn_peak_bytes'] = flat['decode_cache_bytes'] = None
  flat['attention_impl'] = transformer.implementations(mc)
  flat['stack'] = mc.stack_name
  flat['data_packing'] = config.data.packing
  flat['curves'] = {'eval_loss': evals, 'eval_bits_per_byte': bpb,
                    'train_loss': curves['train/loss'],
                    'train_tokens_per_sec': curves['train/tokens_per_sec']}
  return rows_lib.row(name, None, flat)


# ---------------------------------------------------------------- runs


def _bar(progress: bool, **kwargs):
  """A tqdm bar on stderr; a log file gets a line every 30 s instead of a redraw per step."""
  from tqdm import auto as tqdm  # pylint: disable=g-import-not-at-top
  tty = sys.stderr.isatty()
  return tqdm.tqdm(disable=not progress, file=sys.stderr, dynamic_ncols=tty,
                   mininterval=0.5 if tty else 30, leave=False, **kwargs)


class Preempted(SystemExit):
  """A run stopped early by SIGTERM (a preemption notice, `timeout`, a scheduler): its
  checkpoint is saved, and the experiment stops instead of measuring a half-trained run and
  going on; rerunning it resumes. Exits with 143 (128 + SIGTERM) when not caught."""

  def __init__(self, name: str, step: int, total: int, workdir: str, why: str = 'SIGTERM'):
    print(f'run {name!r} stopped at step {step} of {total} ({why}); its checkpoint is in '
          f'{workdir}: rerun the experiment to resume it', file=sys.stderr, flush=True)
    super().__init__(143)
    self.name, self.step, self.total, self.workdir, self.why = name, step, total, workdir, why


class TimeLimit:
  """The state of a `time_limit`: its deadline, whether its own timer fired (`expired`) or a
  SIGTERM came from outside (`signalled`: a lease ending, `timeout`), and what it cut."""

  def __init__(self, seconds: float):
    if seconds <= 0:
      raise ValueError(f'a time limit must be > 0 s, got {seconds}')
    self.seconds = seconds
    self.deadline = time.monotonic() + seconds
    self.expired = False
    self.signalled = False
    self.cut = ''        # The run the limit (or a SIGTERM) stopped, and at which step.
    self.skipped = []    # Runs that did not start because the limit had passed.

  def remaining(self) -> float:
    return self.deadline - time.monotonic()

  @property
  def over(self) -> bool:
    return self.expired or self.signalled or self.remaining() <= 0

  @property
  def reason(self) -> str:
    return ('SIGTERM from outside' if self.signalled else
            f'the {self.seconds:.0f} s time limit')

  def fire(self) -> None:
    """The limit's timer: a SIGTERM to this process, which stops a training loop as a
    preemption does (its checkpoint saved)."""
    self.expired = True
    os.kill(os.getpid(), signal.SIGTERM)


_LIMIT: TimeLimit | None = None


@contextlib.contextmanager
def time_limit(seconds: float):
  """Limits the training of every run() inside to `seconds` of wall clock from now: a run
  still training then stops at its next step (checkpoint saved), later runs do not start, and
  run() returns what finished. A SIGTERM from outside does the same (and sets `signalled`),
  also between runs, where it would otherwise kill the process. Yields the TimeLimit."""
  global _LIMIT
  limit = TimeLimit(seconds)
  outer, _LIMIT = _LIMIT, limit
  handler = None
  if threading.current_thread() is threading.main_thread():

    def on_sigterm(signum, frame):
      del signum, frame
      if not limit.expired:
        limit.signalled = True

    handler = signal.signal(signal.SIGTERM, on_sigterm)
  try:
    yield limit
  finally:
    _LIMIT = outer
    if handler is not None:
      signal.signal(signal.SIGTERM, handler)


_MEMORY = True


@contextlib.contextmanager
def without_memory():
  """Rows measured inside leave out the compiled memory of an attention layer and the
  decoding cache (None): a compile less per run, for experiments that read neither
  (experiments/paper_scale.py, where a lease's seconds count)."""
  global _MEMORY
  outer, _MEMORY = _MEMORY, False
  try:
    yield
  finally:
    _MEMORY = outer


class TimeUp(Preempted):
  """A run stopped (step > 0, its checkpoint saved), or not started (step 0), because the
  active time_limit had passed or a SIGTERM came within it."""

  def __init__(self, name: str, step: int, total: int, workdir: str, why: str):
    if step:
      super().__init__(name, step, total, workdir, why)
    else:
      print(f'run {name!r} not started ({why})', file=sys.stderr, flush=True)
      SystemExit.__init__(self, 143)  # pylint: disable=non-parent-init-called
      self.name, self.step, self.total, self.workdir, self.why = name, step, total, workdir, why


def train_one(name: str, config, workdir: str, *, progress: bool = True) -> dict:
  """Trains (or resumes, or keeps) one run and measures its row (seed None; with the metric
  'run_seconds', the field 'already_trained' and, when the run diverged, 'diverged'); raises
  Preempted when a SIGTERM stops the run before its last step (TimeUp when an active
  time_limit does, or has passed before the run starts)."""
  limit = _LIMIT
  if limit is not None and limit.over:
    raise TimeUp(name, 0, config.total_steps, workdir, f'{limit.reason} passed')
  already = os.path.isdir(os.path.join(workdir, 'checkpoints', str(config.total_steps)))
  started = time.time()
  diverged = None
  timer = None
  if limit is not None:
    timer = threading.Timer(max(0.0, limit.remaining()), limit.fire)
    timer.daemon = True
    timer.start()
  try:
    with _bar(progress, total=config.total_steps, desc=f'  {name}', unit='step') as bar:

      def on_step(step: int) -> None:
        bar.update(step - bar.n)

      try:
        state = train.train_and_evaluate(config, workdir, on_step=on_step)
      except FloatingPointError as e:  # A diverged run keeps its curves up to there.
        diverged = str(e)
      else:
        if int(state.step) < config.total_steps:  # SIGTERM: the loop saved and returned.
          if limit is None:
            raise Preempted(name, int(state.step), config.total_steps, workdir)
          if not limit.expired:  # The loop caught a SIGTERM that was not the limit's.
            limit.signalled = True
          raise TimeUp(name, int(state.step), config.total_steps, workdir, limit.reason)
  finally:
    if timer is not None:
      timer.cancel()
  seconds = time.time() - started
  # already_trained: by an earlier call (then run_seconds is only this call's restore).
  return rows_lib.add(measure(name, config, workdir), {
      'already_trained': already, 'run_seconds': seconds, 'diverged': diverged})


def evaluate(config, workdir: str, extra: dict) -> dict:
  """What `main.py --workdir=WORKDIR --mode=eval --config.KEY=VALUE...` (KEY=VALUE: `extra`)
  gives, in process: the workdir's recorded run with the keys of `extra` asked for on top of
  its record (training/run_config.py); writes WORKDIR/eval_step_<step>.json as it does."""
  request = run_config.Request(keys=frozenset(extra))
  return evaluation.evaluate_checkpoint(override(config, extra), workdir, request)


def configs(runs: Sequence[RunLike], base: ml_collections.ConfigDict
            ) -> dict[str, tuple[ml_collections.ConfigDict, Mapping[str, Any]]]:
  """{run name: (its config, its own keys)}; every config is built (the model and the data)
  so that a bad run fails before any trains."""
  out = {}
  for run in map(_named, runs):
    if run.name in out:
      raise ValueError(f'two runs are called {run.name!r}')
    config = variant_config(base, run.overrides)
    try:
      assembly.build(config).data.close()
    except ValueError as e:
      raise ValueError(f'run {run.name!r}: {e}') from e
    out[run.name] = config, own_keys(base, config)
  return out


def run(runs: Sequence[RunLike], base: ml_collections.ConfigDict,
        seeds: Sequence[int] | None, out: str, *, time_rounds: int = 0, time_steps: int = 5,
        progress: bool = True,
        on_row: Callable[[dict], None] | None = None) -> list[dict]:
  """Trains every run for every seed and returns their rows, seed by seed in run order.

  Args:
    runs: variant specs, {dotted key: value} overrides or Runs (see the module docstring).
    base: the config every run starts from (base_config builds one from a recipe).
    seeds: each run trains once per seed (config.seed = seed) in OUT/seed<S>/<run>; None: once
      with the base's seed, in OUT/<run>.
    out: the folder of the runs; a finished run there is measured, not trained again.
    time_rounds, time_steps: round-robin timing of the train steps (0 rounds: the logged
      tokens/s).
    progress: show progress bars (runs, and steps within a run).
    on_row: called with each row as soon as it is measured (before the timing rounds).

  Within a time_limit, a run stopped by it ends the call: the rows of the seeds every run
  finished are returned (with seeds None, the runs that finished), and no run starts after.

  Returns:
    The rows (experiments/rows.py's format: 'run' the run's name, 'seed' config.seed); each
    has the field 'own_keys' and, when timed, the field 'timed_tokens_per_sec' (its metric
    'tokens_per_sec' is then the timed median, 'logged_tokens_per_sec' the logged one).
  """
  if time_rounds < 0 or time_steps < 1:
    raise ValueError('time_rounds must be >= 0 and time_steps >= 1')
  per_run = configs(runs, base)
  seed_list = [None] if seeds is None else list(seeds)
  if not seed_list:
    raise ValueError('seeds: give at least one seed, or None for the base\'s')
  rows = []
  with _bar(progress, total=len(per_run) * len(seed_list), desc='runs', unit='run') as bar:
    for seed in seed_list:
      here = out if seed is None else os.path.join(out, f'seed{seed}')
      seeded, workdirs = [], {}
      for name, (config, keys) in per_run.items():
        if seed is not None:
          config = copy.deepcopy(config)
          config.seed = seed
        workdirs[name] = (config, os.path.join(here, folder(name)))
        bar.set_postfix_str(name if seed is None else f'{name}, seed {seed}')
        try:
          row = train_one(name, config, workdirs[name][1], progress=progress)
        except TimeUp as e:
          # Within a time_limit: what finished, of whole seeds (None: the finished runs).
          label = name if seed is None else f'{name} (seed {seed})'
          if e.step and not _LIMIT.cut:
            _LIMIT.cut = f'{label} stopped at step {e.step} of {e.total} by {_LIMIT.reason}'
          else:
            _LIMIT.skipped.append(label)
          return rows + seeded if seed is None else rows
        row['seed'] = config.seed
        rows_lib.add(row, {'own_keys': dict(keys)})
        if on_row:
          on_row(row)
        seeded.append(row)
        bar.update(1)
      if time_rounds:
        timers = {name: StepTimer(*workdirs[name]) for name in workdirs}
        timed = time_round_robin(timers, time_rounds, time_steps)
        del timers
        for r in seeded:
          rows_lib.add(r, {'logged_tokens_per_sec': r['metrics']['tokens_per_sec'],
                           'tokens_per_sec': timed[r['run']]['median'],
                           'timed_tokens_per_sec': timed[r['run']]})
      rows.extend(seeded)
  return rows
