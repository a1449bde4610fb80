"""One record of a run's config: WORKDIR/config.json is the source of truth for the run.

The first start of training in a workdir that succeeds (state initialized) writes
WORKDIR/config.json. Every later use of the workdir -- resuming, --mode=eval, inspect,
allocate_budgets, eval_budgets -- starts from that record, not from the recipe file:

  effective config = the record + the keys the user asked for on this command line

"Asked for" means the `--config.KEY=VALUE` flags given, plus every field of a `--config`
recipe file given explicitly that is not the recorded recipe. The defaults of the recipe
(given or not) never count: `main.py --workdir=W --mode=eval` evaluates the recorded model
even if configs/ has changed since, or the run was trained with overrides. Called from
Python without a Request, every field of the config passed counts as asked for.

Each asked-for value that differs from the record is a change, of one of three kinds (each
setting declares its own in configs/schema.py; KINDS below, by dotted-key prefix):

- runtime: how the run is executed (steps, evaluation, logging, checkpoint cadence, mesh,
  data paths, attention kernel). Applied and logged, never refused.
- training: what the optimizer does (learning rate and schedule, AdamW, clipping, batch,
  seed, data order and packing). A resume refuses it; eval, inspect and the pruning modes
  read parameters only, so they apply it (e.g. batch_size sizes the eval batch) and log it.
- model: what the parameters mean (shapes, attention variants and options, vocabulary,
  task). Every mode refuses it.

A refused change is one ValueError naming each key with its recorded and given values.
`--allow_config_change=KEY[,KEY...]` accepts changes of the named keys, or of every key
under a named group (`model.attention_options`, `model`), or `all`; each name must be a
config field or group. Accepted changes of a resume are kept: they are appended to
WORKDIR/config_history.jsonl, and later starts begin from the record with them applied
(config.json itself is never rewritten, so it keeps what the run started with). A run-time
override lasts for the one command only.

WORKDIR/config_history.jsonl has one JSON line per successful start of training: time,
'new' or 'resume', step, recipe file, the command-line overrides, the changes (key,
recorded, given, kind) and the attention implementation each layer ran. A workdir without config.json (a run older than this record) uses
the config given, with a warning. A start of training in a workdir whose record has no
checkpoint yet (the first start died before saving) is a new start: the given config
replaces the record, and the old record is kept in the history line.

A config key renamed since a run was recorded (RENAMED) is read under its new name wherever a
record is read: config.json and the history lines (their changes, overrides and replaced
records); `migrate` does the same for any other flat mapping of an older file, such as an eval
result's `config_overrides`. The old name given now is refused with the new one.

The attention options were one flat group (model.attention_options.<name>, some with a
variant's prefix: span_limit, selective_relu) and are now per variant
(model.attention_options.<variant>.<name>: adaptive_span.limit, selective.relu). A recorded
flat option is read as the option of every variant that declares it (OPTION_RENAMED gives the
names that lost their prefix), so the variant the run used has its value; the old key given
now is refused with the new one (`renamed_keys`).
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import json
import os
import re
from typing import Any, Callable, Sequence

import jax
import ml_collections
from absl import logging
from etils import epath

from configs import declare, schema
from models import attention, transformer
from models import options as options_lib
from training import sharding

RECORD = 'config.json'
HISTORY = 'config_history.jsonl'

RUNTIME = declare.RUNTIME
TRAINING = declare.TRAINING
MODEL = declare.MODEL

# Dotted config key, or group of keys, -> kind of change (see the module docstring), from
# the one declaration of every run setting (configs/schema.py SETTINGS: a setting without a
# kind of its own takes its group's). The longest entry that is the key or a group above it
# decides; a key no entry covers (a field of an older run) is a model change. An option of
# model.attention_options, model.residual_options or model.stack_options declares its own kind
# where its variant, block or stack declares it (models/options.Option.change), read from the
# registry by `kind`.
KINDS = declare.kinds(schema.SETTINGS)

ALL = 'all'

# Config keys renamed since runs were recorded: old dotted key -> new one. A record written
# before the rename is read with the new keys (read_record, read_history; `migrate` for other
# flat mappings such as an eval result's config_overrides), so its runs still resume and
# evaluate; the old key given now (on the command line: main.py; in a config:
# settings.check) is refused with the new name (`check_renamed`). Add a line here when a
# recorded key is renamed.
RENAMED = {
    # The universal stack's settings became its options (models/universal.py OPTIONS).
    'model.universal_steps': 'model.stack_options.steps',
    'model.universal_act': 'model.stack_options.act',
    'model.universal_max_steps': 'model.stack_options.max_steps',
    'model.universal_ponder': 'model.stack_options.ponder',
    # "block" was also the residual wiring; it now means only attention's query/key blocks.
    **{f'model.{old}': f'model.{new}' for old, new in transformer.RENAMED_FIELDS.items()},
}


def _renamed(key: str) -> str | None:
  """The new name of dotted `key` by RENAMED: its own entry, or the entry of a group above it
  (model.block_options.gate_bias -> model.residual_options.gate_bias); None if not renamed."""
  if key in RENAMED:
    return RENAMED[key]
  for old, new in RENAMED.items():
    if key.startswith(old + '.'):
      return new + key[len(old):]
  return None


# Prefix of the attention options' keys.
OPTIONS_GROUP = 'model.attention_options.'

# Attention options that lost their variant's prefix when each variant got its own group
# (model.attention_options.span_limit -> model.attention_options.adaptive_span.limit, and
# dynamic_span.limit): old flat name -> name in the variant's group. Every other flat option
# kept its name. Add a line here when an attention option is renamed.
OPTION_RENAMED = {
    # Adaptive span's rounding of the trimmed span was 'block' in its group, 'span_block' flat.
    'block': 'trim_multiple',
    'span_block': 'trim_multiple',
    **{f'span_{n}': n for n in ('limit', 'ramp', 'init', 'penalty', 'learned', 'memory',
                                'trim')},
    'dynamic_span_bias': 'bias',
    **{f'selective_{n}': n for n in ('shift', 'relu', 'mask_bos', 'mask_diag',
                                     'separate_bilinear', 'lmem_eps', 'lmem_tau', 'budgets')},
}
# Prefix of each option group's keys -> the registry that declares its options.
OPTION_GROUPS = {f'model.{group}.': reg for group, reg in transformer.OPTION_GROUPS.items()}


def _declared_option(reg, rest: str):
  """The Option that `rest` (a key below the group of registry `reg`) names, or None."""
  if not reg.per_entry:
    return reg.options().get(rest.split('.')[0])
  entry, _, name = rest.partition('.')
  if entry not in reg.known():
    return None
  return options_lib.declared(reg.get(entry)).get(name.split('.')[0])


def kind(key: str) -> str:
  """The kind of a change of dotted config `key`: the declared kind of an attention, block or
  stack option (the registry's Option.change), else KINDS' (MODEL when no entry covers it)."""
  for prefix, reg in OPTION_GROUPS.items():
    if key.startswith(prefix):
      option = _declared_option(reg, key[len(prefix):])
      if option is not None:
        return option.change
  parts = key.split('.')
  for n in range(len(parts), 0, -1):
    found = KINDS.get('.'.join(parts[:n]))
    if found:
      return found
  return MODEL


@dataclasses.dataclass(frozen=True)
class Request:
  """What the user asked for on the command line, beyond the workdir's record.

  Attributes:
    keys: dotted keys of the --config.KEY=VALUE flags given; None: every field of the config.
    recipe: the recipe file the config was read from ('' when unknown).
    recipe_given: the recipe was named with --config (not the flag's default).
    allow: --allow_config_change: keys or groups whose refused changes are accepted, or 'all'.
  """
  keys: frozenset[str] | None = None
  recipe: str = ''
  recipe_given: bool = False
  allow: tuple[str, ...] = ()

  def asks(self, key: str) -> bool:
    """True when the command line set dotted config `key` (every key when `keys` is None)."""
    return self.keys is None or key in self.keys


@dataclasses.dataclass(frozen=True)
class Change:
  """One asked-for value that differs from the record.

  Attributes:
    key: dotted config key.
    recorded: the record's value (JSON form).
    given: the value asked for (JSON form).
    kind: RUNTIME, TRAINING or MODEL.
    source: where the given value came from ('--config.KEY' or the recipe file).
  """
  key: str
  recorded: Any
  given: Any
  kind: str
  source: str

  def describe(self) -> str:
    return (f'{self.key}: recorded {self.recorded!r}, given {self.given!r} '
            f'({self.source})')

  def to_json(self) -> dict:
    return {'key': self.key, 'recorded': self.recorded, 'given': self.given,
            'kind': self.kind}


@dataclasses.dataclass(frozen=True)
class Resolved:
  """The config a run uses and how it came about.

  Attributes:
    config: the effective config.
    new_start: training starts a new run here (no record, or a record without checkpoints):
      the config becomes the record.
    replaced: the record a new start replaces (JSON), or None.
    changes: the asked-for values that differ from the record (all applied).
    request: the Request.
  """
  config: ml_collections.ConfigDict
  new_start: bool
  replaced: dict | None
  changes: tuple[Change, ...]
  request: Request


def flat_option(key: str) -> str | None:
  """The option name of a key of the old flat attention group
  (model.attention_options.<name>), or None for any other key."""
  if not key.startswith(OPTIONS_GROUP):
    return None
  name = key[len(OPTIONS_GROUP):]
  return None if '.' in name or name in attention.known() else name


def option_keys(name: str, variants=None) -> list[str]:
  """The keys of an option of the old flat attention group, `name`, in the per-variant
  groups: model.attention_options.<variant>.<new name> for each of `variants` (default: every
  registered variant) that declares it."""
  new = OPTION_RENAMED.get(name, name)
  return [f'{OPTIONS_GROUP}{v}.{new}' for v in (variants or attention.known())
          if v in attention.known() and new in attention.options(v)]


def renamed_keys(key: str, variants=None) -> list[str]:
  """The new keys of dotted `key` if it was renamed (RENAMED; an old flat attention option:
  `option_keys` for `variants`, the variants in use where known; an old prefixed name in a
  variant's group, e.g. model.attention_options.selective.selective_relu), else []."""
  if _renamed(key):
    return [_renamed(key)]
  name = flat_option(key)
  if name is not None:
    return option_keys(name, variants) or option_keys(name)
  if key.startswith(OPTIONS_GROUP):
    variant, _, name = key[len(OPTIONS_GROUP):].partition('.')
    new = _variant_option(variant, name)
    if new:
      return [f'{OPTIONS_GROUP}{variant}.{new}']
  return []


def _variant_option(variant: str, name: str) -> str | None:
  """The new name of option `name` in `variant`'s group when it was renamed (OPTION_RENAMED,
  the new name declared by the variant and the old one not), else None."""
  new = OPTION_RENAMED.get(name)
  if (new and variant in attention.known() and new in attention.options(variant)
      and name not in attention.options(variant)):
    return new
  return None


def migrate(flat: dict[str, Any]) -> dict[str, Any]:
  """`flat` (dotted key -> value, e.g. a record's changes, overrides or an eval result's
  config_overrides) with every RENAMED key under its new name, and an old flat attention
  option under each variant's key that declares it (a new key present wins)."""
  out = {}
  for key, value in flat.items():
    new = option_keys(flat_option(key)) if flat_option(key) is not None else renamed_keys(key)
    if not new:
      out[key] = value
      continue
    out.update({k: value for k in new if k not in flat})
  return out


def _migrate_options(tree: dict) -> None:
  """A record's flat model.attention_options (a run recorded before each variant had its own
  group) as per-variant groups, in place: each option under every variant that declares it."""
  model = tree.get('model')
  group = model.get('attention_options') if isinstance(model, dict) else None
  if not isinstance(group, dict):
    return
  if all(isinstance(v, dict) for v in group.values()):  # Per variant: rename options only.
    for variant, options in group.items():
      for name in list(options):
        new = _variant_option(variant, name)
        if new:
          options.setdefault(new, options.pop(name))
    return
  nested = {v: {} for v in attention.known()}
  for name, value in group.items():
    if isinstance(value, dict):  # A variant's group already.
      nested.setdefault(name, {}).update(value)
      continue
    for key in option_keys(name):
      variant, option = key[len(OPTIONS_GROUP):].split('.')
      nested[variant].setdefault(option, value)
  model['attention_options'] = nested


def _migrate_tree(tree: dict) -> dict:
  """A nested record (config.json) with every RENAMED key moved to its new place."""
  tree = copy.deepcopy(tree)
  _migrate_options(tree)
  for old, new in RENAMED.items():  # A renamed group moves whole: its keys keep their names.
    *parents, leaf = old.split('.')
    node = tree
    for p in parents:
      node = node.get(p) if isinstance(node, dict) else None
    if not isinstance(node, dict) or leaf not in node:
      continue
    value = node.pop(leaf)
    *parents, leaf = new.split('.')
    node = tree
    for p in parents:
      node = node.setdefault(p, {})
    node.setdefault(leaf, value)
  return tree


def renamed_message(keys, variants=None, prefix: str = 'config key ', new_prefix: str = ''
                    ) -> str:
  """'PREFIX<old> was renamed NEW_PREFIX<new>' for each renamed key among dotted `keys`,
  joined with '; ' ('' when none is); `variants`: the attention variants in use, where known."""
  out = []
  for key in sorted(keys):
    new = renamed_keys(key, variants)
    if new:
      out.append(f'{prefix}{key} was renamed ' + ' or '.join(f'{new_prefix}{k}' for k in new)
                 + (' (the variant in use)' if len(new) > 1 else ''))
  return '; '.join(out)


def unknown_option_message(keys, prefix: str = '--config.') -> str:
  """For each dotted key among `keys` that names an option no registered component declares
  (model.attention_options.<variant>.<name>, model.residual_options.<name>,
  model.stack_options.<name>), what the group does declare; joined with '; ' ('' when none)."""
  out = []
  for key in sorted(keys):
    parts = key.split('.')
    if len(parts) < 3 or parts[0] != 'model' or parts[1] not in transformer.OPTION_GROUPS:
      continue
    registry = transformer.OPTION_GROUPS[parts[1]]
    group = f'{prefix}model.{parts[1]}'
    if not registry.per_entry:
      if parts[2] not in registry.options():
        out.append(f'{prefix}{key}: no registered {registry.kind} has the option '
                   f'{parts[2]!r}; {group} has: {", ".join(sorted(registry.options()))}')
    elif parts[2] not in registry.known():
      out.append(f'{prefix}{key}: {parts[2]!r} is no registered {registry.kind} (known: '
                 f'{", ".join(registry.known())})')
    elif len(parts) == 4:
      declared = options_lib.declared(registry.get(parts[2]))
      if parts[3] not in declared:
        out.append(f'{prefix}{key}: {parts[2]} has no option {parts[3]!r}; its options: '
                   f'{", ".join(sorted(declared)) or "none"}')
  return '; '.join(out)


def check_renamed(keys, variants=None) -> None:
  """Raises ValueError naming the new key of each renamed key among dotted `keys` (a config
  given now, or the --config overrides of a command line)."""
  message = renamed_message(keys, variants)
  if message:
    raise ValueError(message)


def flatten(tree: dict, prefix: str = '') -> dict[str, Any]:
  """Nested dicts -> {'a.b': leaf}; lists and other values are leaves."""
  out = {}
  for k, v in tree.items():
    key = f'{prefix}{k}'
    if isinstance(v, dict) and v:
      out.update(flatten(v, key + '.'))
    else:
      out[key] = v
  return out


def as_flat_json(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """The config's fields in their JSON form (what config.json holds), flattened."""
  return flatten(json.loads(config.to_json_best_effort()))


def _path(workdir: str, name: str) -> epath.Path:
  return epath.Path(workdir) / name


def read_record(workdir: str) -> dict | None:
  """WORKDIR/config.json as a nested dict, or None when there is none.

  Raises:
    ValueError: it cannot be read as JSON.
  """
  path = _path(workdir, RECORD)
  if not path.exists():
    return None
  try:
    return _migrate_tree(json.loads(path.read_text()))
  except (ValueError, OSError) as e:
    raise ValueError(f'the run\'s config record {path} cannot be read ({e}); restore it from a '
                     'copy, or move it aside to use the config given') from e


def read_history(workdir: str) -> list[dict]:
  """The lines of WORKDIR/config_history.jsonl (an unreadable line is skipped with a warning),
  with RENAMED keys under their new names."""
  path = _path(workdir, HISTORY)
  if not path.exists():
    return []
  lines = []
  for n, line in enumerate(path.read_text().splitlines(), 1):
    if not line.strip():
      continue
    try:
      entry = json.loads(line)
    except ValueError:
      logging.warning('%s line %d is not JSON; skipped', path, n)
      continue
    if isinstance(entry.get('changes'), list):
      entry['changes'] = [{**change, 'key': key} for change in entry['changes']
                          for key in (migrate({change.get('key'): None}) or [change.get('key')])]
    if isinstance(entry.get('overrides'), dict):
      entry['overrides'] = migrate(entry['overrides'])
    if isinstance(entry.get('replaced_record'), dict):
      entry['replaced_record'] = _migrate_tree(entry['replaced_record'])
    lines.append(entry)
  return lines


def _has_checkpoints(workdir: str) -> bool:
  folder = _path(workdir, 'checkpoints')
  return folder.is_dir() and any(re.fullmatch(r'\d+', p.name) for p in folder.iterdir())


def current_record(workdir: str) -> tuple[dict | None, str]:
  """The run's config now, flattened: config.json with the accepted changes of the
  resumes after its start applied (config_history.jsonl); and its recipe ('' if unknown)."""
  record = read_record(workdir)
  if record is None:
    return None, ''
  flat = flatten(record)
  history = read_history(workdir)
  starts = [i for i, line in enumerate(history) if line.get('start') == 'new']
  recipe = history[starts[-1]].get('recipe', '') if starts else ''
  for line in history[starts[-1] + 1 if starts else 0:]:
    for change in line.get('changes', []):
      if change.get('kind') != RUNTIME and change.get('key') in flat:
        flat[change['key']] = change['given']
  return flat, recipe


def _recipe_name(recipe: str) -> str:
  """A recipe's identity: its file name (and argument), wherever the checkout lies."""
  path, sep, arg = recipe.partition(':')
  return os.path.basename(path) + sep + arg


def _asked(request: Request, given: dict, recipe: str) -> dict[str, str]:
  """Asked-for key -> where its value came from."""
  if request.keys is None:
    return {k: 'config given' for k in given}
  asked = {}
  if (request.recipe_given and recipe and request.recipe
      and _recipe_name(request.recipe) != _recipe_name(recipe)):
    asked = {k: f'recipe {request.recipe}; the run was recorded with {recipe}' for k in given}
  asked.update({k: f'--config.{k}' for k in request.keys})
  return asked


def _covers(name: str, key: str) -> bool:
  return name == ALL or key == name or key.startswith(name + '.')


def _check_allow(allow: tuple[str, ...], given: dict) -> None:
  unknown = [a for a in allow if a != ALL and not any(_covers(a, k) for k in given)]
  if unknown:
    raise ValueError(f'--allow_config_change names {", ".join(unknown)}, which is no config '
                     'field or group (use dotted keys such as learning_rate or '
                     'model.attention_options, or all)')


def _like(value, template):
  """`value` (JSON form) with the sequence types of `template` (tuples come back as lists)."""
  if isinstance(value, list) and isinstance(template, (list, tuple)):
    items = [_like(v, template[min(i, len(template) - 1)] if template else None)
             for i, v in enumerate(value)]
    return type(template)(items)
  return value


def _apply(config: ml_collections.ConfigDict, flat: dict[str, Any], keys) -> None:
  for key in keys:
    *parents, leaf = key.split('.')
    node = config
    for p in parents:
      node = node[p]
    try:
      node[leaf] = _like(flat[key], node[leaf])
    except (TypeError, ValueError) as e:
      raise ValueError(f'the recorded {key}={flat[key]!r} does not fit the current config '
                       f'field ({type(node[leaf]).__name__}): {e}') from e


def resolve(config: ml_collections.ConfigDict, workdir: str, *, trains: bool,
            request: Request | None = None,
            devices: Callable[[ml_collections.ConfigDict], Sequence[Any]] | None = None
            ) -> Resolved:
  """The config to run with in `workdir`: its record plus the asked-for changes.

  The mesh is the machine's, not the run's: when no mesh key is asked for and the recorded
  mesh does not fit the devices present (an eval on one device of a run trained on eight, a
  resume on a slice of another size), it is fitted to them (sharding.fit_mesh) with one log
  line.

  Args:
    config: the config given (recipe and command-line overrides).
    workdir: the run's folder.
    trains: training (refuses training changes too) rather than reading parameters.
    request: what was asked for on the command line; None: every field of `config`.
    devices: effective config -> the devices its mesh is for (--mode=compile: a TPU
      topology's); None: jax.devices().

  Returns:
    The Resolved config.

  Raises:
    ValueError: a change of the model (or, when training, of the training) that is not
      allowed; a bad --allow_config_change; an unreadable record.
  """
  request = request or Request()
  given = as_flat_json(config)
  _check_allow(request.allow, given)
  recorded, recipe = current_record(workdir)
  if recorded is None or (trains and not _has_checkpoints(workdir)):
    if recorded is None and _has_checkpoints(workdir):
      logging.warning('%s has checkpoints but no %s (a run older than the record): using the '
                      'config given', workdir, RECORD)
    elif recorded is not None:
      logging.warning('%s records a run that saved no checkpoint: this start replaces the '
                      'record (the old one is kept in %s)', workdir, HISTORY)
    return Resolved(config=config, new_start=trains, changes=(), request=request,
                    replaced=read_record(workdir) if recorded is not None else None)
  asked = _asked(request, given, recipe)
  changes = tuple(Change(k, recorded[k], given[k], kind(k), asked[k]) for k in sorted(asked)
                  if k in recorded and k in given and recorded[k] != given[k])
  refused = [c for c in changes
             if (c.kind == MODEL or (trains and c.kind == TRAINING))
             and not any(_covers(a, c.key) for a in request.allow)]
  if refused:
    what = 'model or training' if trains else 'model'
    raise ValueError(
        f'{workdir} holds a run recorded in {RECORD}, and this changes its {what}: '
        f'{"; ".join(c.describe() for c in refused)}. Use a new workdir for another run, or '
        f'pass --allow_config_change={",".join(c.key for c in refused)} to change it '
        'deliberately')
  effective = copy.deepcopy(config)
  _apply(effective, recorded, [k for k in recorded if k in given and k not in asked])
  for k in sorted(set(given) - set(recorded)):
    logging.info('%s is not in the record (a newer field): using %r', k, given[k])
  for k in sorted(set(recorded) - set(given)):
    logging.warning('the record\'s %s=%r is no field of the current config: ignored', k,
                    recorded[k])
  _log(changes, trains, request)
  if not any(_covers('mesh', k) for k in asked):
    _fit_mesh(effective, devices(effective) if devices else None)
  return Resolved(config=effective, new_start=False, replaced=None, changes=changes,
                  request=request)


def _fit_mesh(config: ml_collections.ConfigDict, devices: Sequence[Any] | None) -> None:
  """Fits `config.mesh` (the record's) to `devices` (default all), in place, if it does not
  fit them."""
  devices = jax.devices() if devices is None else devices
  fitted = sharding.fit_mesh(config.mesh, devices)
  if fitted is None:
    return
  recorded = {k: config.mesh[k] for k in fitted if k in config.mesh}
  config.mesh.update(fitted)
  logging.warning('the recorded mesh %s does not fit the %d devices here: using mesh %s '
                  '(--config.mesh.* chooses another)', recorded, len(devices), fitted)


def _log(changes: tuple[Change, ...], trains: bool, request: Request) -> None:
  for c in changes:
    if c.kind == RUNTIME:
      logging.info('run-time override of the record: %s', c.describe())
    elif c.kind == TRAINING and not trains:
      logging.info('override of the record (training setting; parameters are read only): %s',
                   c.describe())
    else:
      logging.warning('changing the recorded run (allowed by --allow_config_change=%s): %s',
                      ','.join(request.allow), c.describe())
  unused = [a for a in request.allow if a != ALL and not any(_covers(a, c.key) for c in changes)]
  if unused:
    logging.warning('--allow_config_change=%s: nothing asked for changes %s',
                    ','.join(request.allow), ', '.join(unused))


def record_start(workdir: str, resolved: Resolved, step: int,
                 implementations: dict | None = None) -> None:
  """Records a start of training whose state is restored or initialized: writes config.json
  on a new start (never on a resume) and appends a line to config_history.jsonl, with
  `implementations` (the attention implementation each layer runs, and what chose it), so
  that the record says which program ran.

  Call it on process 0 only.
  """
  config = resolved.config
  if resolved.new_start:
    _path(workdir, RECORD).write_text(config.to_json_best_effort(indent=2))
  request = resolved.request
  line = {
      'time': datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds'),
      'start': 'new' if resolved.new_start else 'resume',
      'step': step,
      'recipe': request.recipe,
      'overrides': ({k: v for k, v in as_flat_json(config).items() if k in request.keys}
                    if request.keys is not None else None),
      'changes': [c.to_json() for c in resolved.changes],
  }
  if implementations is not None:
    line['implementations'] = implementations
  if request.allow:
    line['allowed'] = list(request.allow)
  if resolved.replaced is not None:
    line['replaced_record'] = resolved.replaced
  with _path(workdir, HISTORY).open('a') as f:
    f.write(json.dumps(line, default=repr) + '\n')
