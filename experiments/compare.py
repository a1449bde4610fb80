"""Trains several attention variants on one data config and compares them in one table.

  python -m benchmarks.compare --set data.files=../shared/data/tinyshakespeare.txt
  python -m benchmarks.compare --variants=dense,local:window=64,reformer --d 2 --steps 600 \
      --set data.files=../shared/data/tinyshakespeare.txt --set seq_len=256
  python -m benchmarks.compare --config configs/tiny.py --variants=dense,selective

Every variant is a real training run (training.train.train_and_evaluate) in its own folder
under --workdir, so it can later be resumed, evaluated (`python main.py --workdir=W/dense
--mode=eval`) or sampled; a finished run is not trained again, an interrupted one resumes.
All runs share the recipe (--config, --set, --d), the seed, the data order and the step
budget; each differs only by its variant's own keys (listed per row in the JSON).

Variants (--variants, a comma list):
  NAME                 a registered attention variant (models/attention/registry.py)
  NAME:KEY=V[:KEY=V]   with options: KEY is an attention option (window, stride, mem_len, ...),
                       a stack or block option (act, steps, gate_bias, ...), a model field
                       (block, stack, ...) or a dotted config key; e.g. local:window=64,
                       dense:block=gtrxl, lsh:n_hashes=2:chunk_len=32, universal:act=true
  PRESET[:KEY=V...]    a block or stack preset: gtrxl (txl attention + GTrXL gated blocks),
                       reformer (lsh attention + reversible blocks), universal (one shared
                       dense block applied n_layers times, the universal stack's coordinates)
  registered, presets  every registered variant / every preset (the default: registered)
A variant gets what it needs to run: relative-position variants (txl) no absolute positions,
and variants with segment memory (txl, gtrxl) rows that continue one text stream
(data.packing='stream'; the same text, dealt to the rows differently). A variant of the
'registered' or 'presets' lists that cannot run on the chosen data (e.g. txl on a synthetic
task) is skipped with the reason; a named one that cannot is an error.

Columns: eval loss and bits per byte (text) at the last step, parameters, training FLOPs per
token (TransformerConfig.train_flops_per_token: 6 N_matmul + 12 L H d_head T, the full causal
score matrix for every variant), training tokens/s, the peak memory of one attention layer's
forward + backward at the run's batch and sequence length (XLA's compiled memory analysis:
arguments + outputs + temporaries, like benchmarks/attention_scaling.py; the largest over the
layers, each with the options its trained parameters give, e.g. adaptive span's trimmed span)
and the decoding cache of one row of max_len tokens (models/decode.py, decode.cache_bytes: the
keys and values held; lsh and reformer hold those of every position, as dense does; '-' for a
variant that cannot decode token by token, none of the registered ones or the presets).
Tokens/s: after all runs, each variant's train step with its trained parameters on random
tokens, timed round-robin (--time_rounds rounds of --time_steps steps each, each round
starting one variant later), so that a busy phase of a shared machine slows all alike; the
median over rounds. With --time_rounds 0: the median of the run's logged windows that hold
no compile, evaluation or checkpoint save.

Prints a markdown table, writes the rows, the command and the machine to --out (JSON) and the
eval loss curves to --png. Samples at evaluation are off (generate.eval_samples=0): sample a
finished run with main.py instead.
"""

import argparse
import ast
import copy
import importlib.util
import math
import os
import re
import shlex
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from training import xla_flags  # noqa: E402

xla_flags.set_cpu_defaults()  # As main.py does, before JAX starts its backend.

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_collections  # noqa: E402
from absl import logging  # noqa: E402

from benchmarks import common  # noqa: E402
from models import attention, blocks, decode, transformer  # noqa: E402
from training import assembly, metrics, sharding, steps, train  # noqa: E402

DEFAULT_CONFIG = os.path.join(REPO, 'configs', 'local_text.py')
DEFAULT_OUT = os.path.join(REPO, 'benchmarks', 'results', 'compare.json')
DEFAULT_PNG = os.path.join(REPO, 'docs', 'img', 'compare_curves.png')


def _universal(config) -> dict:
  # As deep as the layered models: the same FLOPs per token with one block's parameters.
  return {'model.attention': 'dense', 'model.stack': 'universal', 'model.n_layers': 0,
          'model.position_embedding': 'none',
          'model.stack_options.steps': config.model.n_layers or config.model.d}


# name -> config -> overrides (dotted keys); what each preset stands for is in the docstring.
PRESETS = {
    'gtrxl': lambda config: {'model.attention': 'txl', 'model.block': 'gtrxl'},
    'reformer': lambda config: {'model.attention': 'lsh', 'model.block': 'reversible'},
    'universal': _universal,
}
GROUPS = ('registered', 'presets')

COLUMNS = ('variant', 'eval_loss', 'bits_per_byte', 'params', 'train_flops_per_token',
           'tokens_per_sec', 'attn_peak_bytes', 'decode_cache_bytes')
HEADERS = {'variant': 'variant', 'eval_loss': 'eval loss', 'bits_per_byte': 'bits/byte',
           'params': 'params', 'train_flops_per_token': 'train FLOPs/token',
           'tokens_per_sec': 'train tokens/s', 'attn_peak_bytes': 'attn peak (MiB)',
           'decode_cache_bytes': 'decode cache (KiB)'}


# ---------------------------------------------------------------- configs and variant specs


def load_recipe(path: str) -> ml_collections.ConfigDict:
  """get_config() of a recipe file."""
  spec = importlib.util.spec_from_file_location('compare_recipe', path)
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


def parse_value(key: str, current, text: str):
  """`text` as a value of the type `current` (the field's value now) has."""
  try:
    if isinstance(current, bool):
      if text.lower() not in ('true', 'false', '1', '0'):
        raise ValueError(text)
      return text.lower() in ('true', '1')
    if isinstance(current, int):
      return int(text)
    if isinstance(current, float):
      return float(text)
    if isinstance(current, str):
      return text
    if isinstance(current, (tuple, list)):
      return type(current)(ast.literal_eval(text))
    return ast.literal_eval(text)
  except (ValueError, SyntaxError) as e:
    raise ValueError(f'{key}={text!r}: expected a {type(current).__name__}') from e


def set_key(config, key: str, value) -> None:
  """config[dotted key] = value; the key must exist."""
  *parents, leaf = key.split('.')
  node = config
  for name in parents:
    if name not in node or not isinstance(node[name], ml_collections.ConfigDict):
      raise ValueError(f'unknown config key {key!r}')
    node = node[name]
  if leaf not in node:
    raise ValueError(f'unknown config key {key!r}')
  node[leaf] = value


def get_key(config, key: str):
  node = config
  for name in key.split('.'):
    node = node[name]
  return node


def apply_text(config, assignments: list[str]) -> None:
  """KEY=VALUE strings (dotted keys) parsed against the current values and set."""
  for item in assignments:
    key, sep, text = item.partition('=')
    if not sep:
      raise ValueError(f'expected KEY=VALUE, got {item!r}')
    flat = flatten(config)
    if key not in flat:
      raise ValueError(f'unknown config key {key!r}')
    set_key(config, key, parse_value(key, flat[key], text))


def option_key(config, key: str) -> str:
  """The dotted config key a spec option names: an attention, stack or block option, a model
  field, or a dotted (or top-level) config key."""
  for group, registry in transformer.OPTION_GROUPS.items():
    if key in registry.options():
      return f'model.{group}.{key}'
  if key in config.model and not isinstance(config.model[key], ml_collections.ConfigDict):
    return f'model.{key}'
  if key in flatten(config):
    return key
  raise ValueError(f'{key!r} is neither an attention option, a stack or block option, a '
                   'model field nor a config key')


def parse_spec(spec: str) -> tuple[str, list[tuple[str, str]]]:
  """'name:k=v:k2=v2' -> (name, [(k, v), (k2, v2)])."""
  name, *items = [p.strip() for p in spec.split(':')]
  pairs = []
  for item in items:
    key, sep, value = item.partition('=')
    if not sep or not key:
      raise ValueError(f'variant {spec!r}: options are KEY=VALUE after a colon, got {item!r}')
    pairs.append((key.strip(), value.strip()))
  if name not in attention.known() and name not in PRESETS:
    raise ValueError(f'variant {spec!r}: {name!r} is neither a registered attention variant '
                     f'({", ".join(attention.known())}) nor a preset ({", ".join(PRESETS)})')
  return name, pairs


def expand(variants: str) -> tuple[list[str], set[str]]:
  """The specs of --variants, its groups expanded, in order; and those only a group named
  (skipped, not refused, when they cannot run on the data)."""
  specs, named = [], set()
  for item in [v.strip() for v in variants.split(',') if v.strip()]:
    if item in GROUPS:
      names = list(attention.known()) if item == 'registered' else list(PRESETS)
    else:
      names = [item]
      named.add(item)
    specs.extend(n for n in names if n not in specs)
  return specs, set(specs) - named


def variant_config(base: ml_collections.ConfigDict, spec: str) -> ml_collections.ConfigDict:
  """The base config with the variant of `spec` and what that variant needs to run."""
  name, pairs = parse_spec(spec)
  config = copy.deepcopy(base)
  given = PRESETS[name](config) if name in PRESETS else {'model.attention': name}
  for key, value in given.items():
    set_key(config, key, value)
  for key, text in pairs:
    dotted = option_key(config, key)
    given[dotted] = parse_value(dotted, get_key(config, dotted), text)
    set_key(config, dotted, given[dotted])
  names = [n.strip() for n in config.model.attention.split(',') if n.strip()]
  classes = [attention.get(n) for n in names]
  options = attention.resolve_options(dict(config.model.attention_options), names)
  if any(c.RELATIVE_POSITIONS for c in classes) and 'model.position_embedding' not in given:
    config.model.position_embedding = 'none'
  if any(c.uses_memory(options) for c in classes) and 'data.packing' not in given:
    config.data.packing = 'stream'  # Memory carries a row's previous segment to the next batch.
  return config


def own_keys(base, config) -> dict:
  """{key: value} where a variant's config differs from the base."""
  before, after = flatten(base), flatten(config)
  return {k: v for k, v in after.items() if before.get(k) != v}


def folder(spec: str) -> str:
  return re.sub(r'[^\w.=-]+', '_', spec)


# ---------------------------------------------------------------- measurements


def read_scalars(workdir: str, tags: list[str]) -> dict[str, list[tuple[int, float]]]:
  """{tag: [(step, value)]} of scalars a run logged to TensorBoard (training/metrics.py)."""
  return {tag: common.scalar_curve(workdir, tag) for tag in tags}


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
    specs = attention.get(variant).shared_params(dict(cfg.attention_options), cfg.n_heads,
                                                 cfg.head_dim)
    shared = (transformer.SharedParams(specs, cfg.param_dtype, name=f'{variant}_shared')()
              if specs else None)
    return blocks.make_attention(cfg, variant, self.index, name='attention', shared=shared)(
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
  """A variant's train step (the run's compiled step with its trained parameters, e.g. adaptive
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
  """Tokens/s of every variant's train step, timed in rounds that run each variant `steps`
  steps in turn (each round starting one variant later), so that a busy phase of a shared
  machine slows them alike; the median and best over the rounds."""
  names = list(timers)
  rates = {n: [] for n in names}
  for i in range(rounds):
    for name in names[i % len(names):] + names[:i % len(names)]:
      rates[name].append(steps * timers[name].tokens / timers[name](steps))
  return {n: {'median': statistics.median(r), 'best': max(r), 'rounds': r}
          for n, r in rates.items()}


# ---------------------------------------------------------------- runs


def run_variant(spec: str, config, workdir: str) -> dict:
  """Trains (or resumes) one variant and measures its row."""
  row = {'variant': spec, 'workdir': workdir}
  # Trained by an earlier call (then run_seconds is only this call's restore).
  row['already_trained'] = os.path.isdir(os.path.join(workdir, 'checkpoints',
                                                      str(config.total_steps)))
  started = time.time()
  try:
    train.train_and_evaluate(config, workdir)
  except FloatingPointError as e:  # A diverged run keeps its curves up to there.
    row['diverged'] = str(e)
  row['run_seconds'] = time.time() - started
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
  curves = read_scalars(workdir, tags)
  evals = curves['eval/loss']
  row['step'] = step
  row['eval_loss'] = evals[-1][1] if evals else float('nan')
  bpb = curves['eval/bits_per_byte']
  row['bits_per_byte'] = bpb[-1][1] if bpb else None
  scored = curves['eval/scored_tokens']
  row['eval_scored_tokens'] = scored[-1][1] if scored else None
  row['params'] = setup.model_config.num_params()
  metrics = ({'act_steps/universal': curves['train/act_steps/universal'][-1][1]}
             if act and curves['train/act_steps/universal'] else None)
  row['train_flops_per_token'] = mc.train_flops_per_token(seq_len, metrics)
  row['tokens_per_sec'] = steady_tokens_per_sec(curves['train/tokens_per_sec'], config)
  row['attn_peak_bytes'] = attention_peak_bytes(mc, config.batch_size, seq_len)
  row['decode_cache_bytes'], why = decode_cache_bytes(mc)
  if why:
    row['decode_refused'] = why
  row['attention_impl'] = transformer.implementations(mc)
  row['stack'] = mc.stack_name
  row['data_packing'] = config.data.packing
  row['curves'] = {'eval_loss': evals, 'eval_bits_per_byte': bpb,
                   'train_loss': curves['train/loss'],
                   'train_tokens_per_sec': curves['train/tokens_per_sec']}
  return row


def fmt(column: str, value) -> str:
  """A table cell."""
  if value is None or (isinstance(value, float) and math.isnan(value)):
    return '-'
  if column in ('eval_loss', 'bits_per_byte'):
    return f'{value:.4f}'
  if column == 'params':
    return f'{value:,}'
  if column == 'train_flops_per_token':
    return f'{value / 1e6:.2f}M'
  if column == 'tokens_per_sec':
    return f'{value:,.0f}'
  if column == 'attn_peak_bytes':
    return f'{value / 2**20:.2f}'
  if column == 'decode_cache_bytes':
    return f'{value / 2**10:,.0f}'
  return str(value)


def markdown(rows: list[dict]) -> str:
  lines = ['| ' + ' | '.join(HEADERS[c] for c in COLUMNS) + ' |',
           '|' + '|'.join('---' if c == 'variant' else '---:' for c in COLUMNS) + '|']
  for r in rows:
    lines.append('| ' + ' | '.join(fmt(c, r.get(c)) for c in COLUMNS) + ' |')
  return '\n'.join(lines)


def plot(rows: list[dict], path: str, title: str) -> None:
  """Eval loss against step, one line per variant."""
  plt = common.pyplot()
  fig, ax = plt.subplots(figsize=(11, 5.5))
  styles = ['-', '--', ':', '-.']
  for i, r in enumerate(rows):
    points = r['curves']['eval_loss']
    if not points:
      continue
    steps, values = zip(*points)
    ax.plot(steps, values, marker='o', markersize=3, linestyle=styles[(i // 10) % len(styles)],
            color=f'C{i % 10}', label=r['variant'])
  ax.set(xlabel='step', ylabel='eval loss (nats per token)', title=title)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8, loc='upper left', bbox_to_anchor=(1.01, 1.0))
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=110)
  plt.close(fig)
  print(f'wrote {path}')


def base_config(args) -> ml_collections.ConfigDict:
  """The recipe with --d, --steps (warm-up at most a sixth of them), the eval, log and
  checkpoint cadence, no samples at evaluation (sample a run later with main.py), then --set
  (which wins) applied."""
  config = load_recipe(args.config)
  if args.d:
    config.model.d = args.d
    for key in ('d_model', 'n_heads', 'n_layers', 'head_dim', 'mlp_dim'):
      config.model[key] = 0
  config.total_steps = args.steps
  config.warmup_steps = min(config.warmup_steps, max(1, args.steps // 6))
  config.eval_every_steps = max(1, args.steps // args.evals)
  config.log_every_steps = max(1, min(config.log_every_steps, args.steps // 40))
  config.checkpoint_every_steps = min(config.checkpoint_every_steps, args.steps)
  if 'generate' in config:  # No samples at each eval: they would fall into the timed windows.
    config.generate.eval_samples = 0
  apply_text(config, args.set)
  if config.data.name == 'local_text':
    if not config.data.files:
      raise ValueError('local_text data needs files: --set data.files=PATH (e.g. '
                       '../shared/data/tinyshakespeare.txt)')
    config.data.files = ','.join(os.path.abspath(f) for f in config.data.files.split(','))
    if not config.data.data_dir:  # The prepared TFDS copy lives with the runs.
      config.data.data_dir = os.path.join(os.path.abspath(args.workdir), 'tfds')
  return config


def parse_args(argv):
  p = argparse.ArgumentParser(prog='python -m benchmarks.compare', description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument('--variants', default='registered',
                 help='comma list of variant specs (see above); default: registered')
  p.add_argument('--config', default=DEFAULT_CONFIG, help='recipe file (default: %(default)s)')
  p.add_argument('--set', action='append', default=[], metavar='KEY=VALUE',
                 help='config override with a dotted key, e.g. seq_len=256 (repeatable)')
  p.add_argument('--steps', type=int, default=300, help='training steps of every variant')
  p.add_argument('--evals', type=int, default=10, help='evaluations per run (the curve points)')
  p.add_argument('--time_rounds', type=int, default=5,
                 help='after training, time every train step round-robin for this many rounds '
                 '(the tokens/s column: their median); 0: the runs\' logged tokens/s instead')
  p.add_argument('--time_steps', type=int, default=5, help='steps per variant per round')
  p.add_argument('--d', type=int, default=0,
                 help='size knob: d_model 64 d, d heads, d layers (0: the recipe\'s sizes)')
  p.add_argument('--workdir', default=os.path.join(REPO, 'runs', 'compare'),
                 help='each variant trains in WORKDIR/<variant>')
  p.add_argument('--out', default=DEFAULT_OUT, help='JSON (default: %(default)s)')
  p.add_argument('--png', default=DEFAULT_PNG, help='eval loss curves (default: %(default)s)')
  args = p.parse_args(argv)
  if args.steps < 1 or args.evals < 1 or args.time_rounds < 0 or args.time_steps < 1:
    p.error('--steps, --evals and --time_steps must be >= 1, --time_rounds >= 0')
  return args


def main(argv=None) -> dict:
  args = parse_args(argv)
  logging.set_verbosity(logging.INFO)
  metrics.quiet_libraries()
  base = base_config(args)
  specs, grouped = expand(args.variants)
  configs, skipped = {}, {}
  for spec in specs:  # Every config is checked before any training.
    config = variant_config(base, spec)
    try:
      assembly.build(config).data.close()
    except ValueError as e:
      if spec not in grouped:
        raise
      skipped[spec] = str(e)
      print(f'[{spec}] skipped: {e}', flush=True)
      continue
    configs[spec] = config
  if not configs:
    raise SystemExit('no variant can run on this data')

  rows = []
  for spec, config in configs.items():
    workdir = os.path.join(args.workdir, folder(spec))
    print(f'[{spec}] training {args.steps} steps in {workdir} (a finished run is kept)',
          flush=True)
    row = run_variant(spec, config, workdir)
    row['own_keys'] = own_keys(base, config)
    rows.append(row)
    print(f'[{spec}] done in {row["run_seconds"]:.0f} s: eval loss '
          f'{fmt("eval_loss", row["eval_loss"])}', flush=True)

  if args.time_rounds:
    print(f'timing the train steps: {args.time_rounds} rounds of {args.time_steps} steps each',
          flush=True)
    timers = {r['variant']: StepTimer(configs[r['variant']], r['workdir']) for r in rows}
    timed = time_round_robin(timers, args.time_rounds, args.time_steps)
    del timers
    for r in rows:
      r['logged_tokens_per_sec'] = r['tokens_per_sec']
      r['tokens_per_sec'] = timed[r['variant']]['median']
      r['timed_tokens_per_sec'] = timed[r['variant']]

  table = markdown(rows)
  print('\n' + table + '\n')
  command = 'python -m benchmarks.compare ' + shlex.join(sys.argv[1:] if argv is None else argv)
  data = base.data
  settings = {'config': os.path.relpath(args.config, REPO), 'set': args.set, 'd': args.d,
              'steps': args.steps, 'seed': base.seed, 'seq_len': base.seq_len,
              'batch_size': base.batch_size, 'learning_rate': base.learning_rate,
              'warmup_steps': base.warmup_steps, 'eval_every_steps': base.eval_every_steps,
              'eval_steps': base.eval_steps, 'dtype': base.model.dtype, 'data': data.name,
              'time_rounds': args.time_rounds, 'time_steps': args.time_steps,
              'files': [os.path.basename(f) for f in data.files.split(',') if f]}
  payload = {'command': command, 'settings': settings, 'columns': list(COLUMNS),
             'rows': rows, 'skipped': skipped, 'table': table}
  common.write_json(args.out, payload)
  plot(rows, args.png, f'eval loss, {data.name} ({", ".join(settings["files"]) or data.name}), '
       f'{args.steps} steps, batch {base.batch_size} x {base.seq_len}')
  return payload


if __name__ == '__main__':
  main()
