"""Migrations of the committed results (results/*.json) when a name they record, or their
format, changes.

    python -m experiments.migrations            # rewrite results/*.json in place
    python -m experiments.migrations --check    # exit 1 naming each file a migration changes

A result file records how its runs were made: variant specs ('adaptive_span:span_limit=256'),
config overrides ({'model.attention_options.window': 32}), command lines. When the code renames
one of those names, the committed files are rewritten once, here, by the same rules the code
uses to read old records (training/run_config.py), never by hand; the numbers are untouched.
When the format of the runs in them changes (experiments/rows.py), they are rewritten here
too, by the function the experiments now write their rows with.
tests/experiments/test_migrations.py checks that the committed files need no migration.

MIGRATIONS, in order:
- per_variant_options: each attention variant got its own option group
  (model.attention_options.<variant>.<name>), and the options that carried their variant's
  prefix lost it (run_config.OPTION_RENAMED: span_limit -> limit, selective_relu -> relu).
  An override key is moved into the group of the variant its row ran (the row's
  model.attention, or its variant spec); with none recorded, into every variant that declares
  the option (run_config.option_keys). Variant specs and the specs in command lines get the
  new option names. Folder names (workdir) stay: they name folders that exist.
- recipe_fingerprints: the same change of the config's layout changed every recipe's
  fingerprint (configs.fingerprint), which a committed compile (results/
  tpu_compile_recipes.json) carries to say which recipe it compiled. A row whose fingerprint
  is the recipe's as the flat layout hashed it (`flat_layout_fingerprint`: the recipe has
  not changed since) gets the recipe's fingerprint now; a row of a recipe changed since keeps
  its old one (tests/contracts/test_paper_recipes.py then asks for a new compile).
- one_row_format: the experiments' results took one row format (experiments/rows.py: run,
  seed, metrics, curves, descriptive fields) and one shape of a run over seeds ('rows',
  'mean', 'std', 'diverged_seeds'). A run over seeds of the old shape ({'seeds': [{'seed': S,
  ...}], KEY: mean, KEY_std: std, 'diverged_seeds'}) becomes an entry: its per-seed dicts rows
  made by rows.row (the rule the experiments write with), 'mean' and 'std' of the keys that had
  a KEY_std, as they were (not recomputed); 'diverged_seeds' as it was, or (in a file written
  before it existed) the seeds whose row says 'diverged'. A list of the harness's
  measurements (dicts with 'variant' and 'curves': sparse_transformer.json's 'runs',
  compare.json's 'rows') becomes rows of run = variant. A run of one seed (txl_experiment.json,
  reformer_experiment.json, universal_experiment.json, act_ponder.json: {'overrides',
  'train_loss', ...}) becomes a row of seed None: its lists of [step, value] curves, its
  evaluations ('evals', or 'eval' and 'eval_TAG' beside the rest: txl_experiment.json's) its
  'evals'. The numbers are moved, never changed.
- block_meanings: "block" came to mean only attention's query/key blocks. The residual wiring
  became model.residual (model.block before) with its options in model.residual_options
  (model.block_options), and adaptive span's rounding of the trimmed span the option
  trim_multiple (block): config keys (run_config.renamed_keys, which also moves the universal
  stack's settings of old overrides into model.stack_options), specs ('dense:block=gtrxl' ->
  'dense:residual=gtrxl', 'adaptive_span:block=64' -> 'adaptive_span:trim_multiple=64'),
  command lines, and the 'block' field of a benchmark row that names a wiring. A compile
  result's fingerprint of an unchanged recipe is renewed by recipe_fingerprints.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
from typing import Any, Callable

import configs
from configs import presets
from experiments import rows as rows_lib
from models import attention, residual
from models import options as options_lib
from models import transformer
from training import run_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GROUP = run_config.OPTIONS_GROUP  # 'model.attention_options.'
# Keys whose values are names of things that exist (folders): never rewritten.
KEPT = ('workdir',)


def _spec_variants(spec: str) -> list[str]:
  """The attention variants a variant spec ('NAME[:K=V...]') runs: NAME, or a preset's."""
  name = spec.split(':')[0].strip()
  if name in attention.known():
    return [name]
  if name in presets.PRESETS:
    from configs import default  # pylint: disable=import-outside-toplevel
    given = presets.PRESETS[name](default.get_config())
    return [v.strip() for v in given.get('model.attention', 'dense').split(',')]
  return []


def _renamed_option(variants: list[str], name: str) -> str:
  """A spec's key `name` as it is called now: an option of the variants in `variants`, or a
  model field (transformer.RENAMED_FIELDS: block -> residual)."""
  new = run_config.OPTION_RENAMED.get(name)
  if new and any(new in attention.options(v) for v in variants if v in attention.known()):
    return new
  return transformer.RENAMED_FIELDS.get(name, name)


def _spec(spec: str) -> str:
  """A variant spec with its options' new names ('adaptive_span:limit=256')."""
  name, *items = spec.split(':')
  variants = _spec_variants(name)
  if not variants:
    return spec
  out = [name]
  for item in items:
    key, sep, value = item.partition('=')
    out.append(f'{_renamed_option(variants, key)}{sep}{value}' if sep else item)
  return ':'.join(out)


_SPEC = re.compile(r'(?<![\w/.-])([a-z_]+(?::[A-Za-z_][\w.]*=[^\s,:\'"]*)+)')


def _text(text: str) -> str:
  """Every variant spec in a string (a spec, or a command line holding specs) migrated."""
  return _SPEC.sub(lambda m: _spec(m.group(1)), text)


def _keys(name: str, variants: list[str], where: str) -> list[str]:
  keys = run_config.option_keys(name, variants) if variants else []
  if not keys:
    keys = run_config.option_keys(name)
    if len(keys) > 1 and variants:
      raise ValueError(f'{where}: {GROUP}{name} is no option of {variants}')
  if not keys:
    raise ValueError(f'{where}: no registered variant declares {GROUP}{name}')
  return keys


def _context(node: dict, variants: list[str]) -> list[str]:
  """The variants a dict's row ran: its model.attention, its variant spec, else the parent's."""
  if isinstance(node.get('model.attention'), str):
    return [v.strip() for v in node['model.attention'].split(',') if v.strip()]
  if isinstance(node.get('variant'), str) and _spec_variants(node['variant']):
    return _spec_variants(node['variant'])
  return variants


def per_variant_options(data: Any, variants: list[str] | None = None, where: str = '') -> Any:
  """`data` (a result file's JSON) with attention option keys and specs of the per-variant
  groups (see the module docstring)."""
  variants = variants or []
  if isinstance(data, dict):
    variants = _context(data, variants)
    out = {}
    for key, value in data.items():
      here = f'{where}/{key}'
      if key in KEPT:
        out[key] = value
        continue
      value = per_variant_options(value, variants, here)
      name = run_config.flat_option(key)
      if name is None:
        out[key] = value
      else:
        out.update({k: value for k in _keys(name, variants, here)})
    return out
  if isinstance(data, list):
    out = []
    for i, item in enumerate(data):
      flat = re.fullmatch(r'model\.attention_options\.(\w+)=(.*)', item) if isinstance(
          item, str) else None
      if flat and run_config.flat_option(f'{GROUP}{flat.group(1)}'):
        out += [f'{k}={flat.group(2)}' for k in _keys(flat.group(1), variants, f'{where}/{i}')]
      else:
        out.append(per_variant_options(item, variants, f'{where}/{i}'))
    return out
  if isinstance(data, str):
    return _text(data)
  return data


def flat_layout_fingerprint(config) -> str:
  """configs.fingerprint(config) as it was computed when model.attention_options was one flat
  group: every option of the project's variants under its old name (OPTION_RENAMED), at its
  default, with the values of the variants in use on top."""
  old_name = {new: old for old, new in run_config.OPTION_RENAMED.items()}
  ours = [n for n in attention.known() if attention.get(n).__module__.startswith('models.')]
  in_use = [n.strip() for n in config.model.attention.split(',') if n.strip()]
  flat = {}
  for variant in ours:
    flat.update({old_name.get(k, k): o.default
                 for k, o in options_lib.declared(attention.get(variant)).items()
                 if not o.internal})
  for variant in in_use:
    flat.update({old_name.get(k, k): v
                 for k, v in config.model.attention_options[variant].to_dict().items()})
  settings = configs.fingerprint_settings(config)
  settings['model']['attention_options'] = flat
  _old_model_fields(settings)
  return configs.hash_settings(settings)


def _old_model_fields(settings: dict) -> None:
  """Fingerprint settings with the model fields under their names before block_meanings
  (model.block, model.block_options), in place."""
  for old, new in transformer.RENAMED_FIELDS.items():
    settings['model'][old] = settings['model'].pop(new)


def before_block_meanings_fingerprint(config) -> str:
  """configs.fingerprint(config) as it was computed before block_meanings: the residual
  wiring's fields and adaptive span's rounding under their old names."""
  settings = configs.fingerprint_settings(config)
  _old_model_fields(settings)
  for options in settings['model']['attention_options'].values():
    if 'trim_multiple' in options:
      options['block'] = options.pop('trim_multiple')
  return configs.hash_settings(settings)


def recipe_fingerprints(data: Any) -> Any:
  """A compile result's rows ({'recipe', 'fingerprint', ...}) with today's fingerprint where
  the row's is its unchanged recipe's in an older layout (the flat one, or the names before
  block_meanings)."""
  rows = data.get('rows') if isinstance(data, dict) else None
  if not isinstance(rows, list) or not all(
      isinstance(r, dict) and {'recipe', 'fingerprint'} <= set(r) for r in rows):
    return data
  out = []
  for row in rows:
    if row['recipe'] in configs.PAPER_RECIPES:
      config = configs.load(row['recipe'])
      if row['fingerprint'] in (flat_layout_fingerprint(config),
                                before_block_meanings_fingerprint(config)):
        row = {**row, 'fingerprint': configs.fingerprint(config)}
    out.append(row)
  return {**data, 'rows': out}


def _old_entry(node: Any) -> bool:
  """A run over seeds as over_seeds wrote it before one_row_format."""
  return (isinstance(node, dict) and isinstance(node.get('seeds'), list) and node['seeds']
          and all(isinstance(s, dict) and 'seed' in s for s in node['seeds'])
          and any(k.endswith('_std') for k in node))


def _measurement(node: Any) -> bool:
  """One of the harness's measurements as an experiment wrote it before one_row_format."""
  return isinstance(node, dict) and {'variant', 'curves'} <= set(node) and 'metrics' not in node


def _old_run(node: Any) -> bool:
  """A run of one seed as txl_experiment, reformer_experiment, universal_experiment and
  survey_act_ponder wrote it before one_row_format: its overrides and training curves."""
  return (isinstance(node, dict) and 'overrides' in node and 'metrics' not in node
          and isinstance(node.get('train_loss'), list))


def _run_row(name: str, node: dict) -> dict:
  """An old run of one seed as a row: its lists of [step, value] are its curves, its
  evaluations ('evals', 'eval', 'eval_TAG') its evals (rows.row's rule)."""
  flat = {}
  for key, value in node.items():
    curve = isinstance(value, list) and all(isinstance(p, list) and len(p) == 2 for p in value)
    flat[key + rows_lib.CURVE if curve else key] = value
  return rows_lib.row(name, None, flat)


def one_row_format(data: Any, name: str = '') -> Any:
  """`data` with every run over seeds an entry of experiments/rows.py and every list of
  harness measurements a list of rows (see the module docstring); `name` is the key `data`
  is found under (an entry's run)."""
  if _old_entry(data):
    keys = [k[:-len('_std')] for k in data if k.endswith('_std') and k[:-len('_std')] in data]
    rows = [rows_lib.row(name, s['seed'], s) for s in data['seeds']]
    return {'run': name, 'rows': rows, 'mean': {k: data[k] for k in keys},
            'std': {k: data[k + '_std'] for k in keys},
            'diverged_seeds': data.get('diverged_seeds',
                                       [s['seed'] for s in data['seeds'] if s.get('diverged')])}
  if _old_run(data):
    return _run_row(name, data)
  if isinstance(data, dict):
    return {k: one_row_format(v, k) for k, v in data.items()}
  if isinstance(data, list):
    if data and all(_measurement(m) for m in data):
      seed = int(name) if name.isdigit() else None  # sparse_transformer.json: by seed.
      return [rows_lib.row(m['variant'], m.get('seed', seed), m) for m in data]
    return [one_row_format(item) for item in data]
  return data


_OLD_MODEL_FIELD = re.compile(
    r'\bmodel\.(' + '|'.join(transformer.RENAMED_FIELDS) + r')\b')


def block_meanings(data: Any) -> Any:
  """`data` with the names "block" lost when it came to mean only attention's query/key
  blocks (see the module docstring)."""
  if isinstance(data, dict):
    out = {}
    for key, value in data.items():
      if key in KEPT:
        out[key] = value
        continue
      value = block_meanings(value)
      if key == 'block' and isinstance(value, str) and value in residual.known():
        key = 'residual'  # A benchmark row's wiring (benchmarks/reversible_memory.py).
      elif key.startswith('model.') and run_config.flat_option(key) is None:
        key = (run_config.renamed_keys(key) or [key])[0]
      out[key] = value
    return out
  if isinstance(data, list):
    return [block_meanings(item) for item in data]
  if isinstance(data, str):
    return _OLD_MODEL_FIELD.sub(lambda m: 'model.' + transformer.RENAMED_FIELDS[m.group(1)],
                                _text(data))
  return data


MIGRATIONS: tuple[Callable[[Any], Any], ...] = (per_variant_options, recipe_fingerprints,
                                                one_row_format, block_meanings)


def migrate(data: Any) -> Any:
  """`data` with every migration applied, in order (each leaves migrated data as it is)."""
  for step in MIGRATIONS:
    data = step(data)
  return data


def _dumps(data: Any, text: str) -> str:
  """`data` as JSON laid out as `text` (the file it was read from) was: the same indent and
  final newline, so that a migration's diff shows only what it changed."""
  end = '\n' if text.endswith('\n') else ''
  for indent in (2, 1, 4, None):
    if json.dumps(json.loads(text), indent=indent) + end == text:
      return json.dumps(data, indent=indent) + end
  return json.dumps(data, indent=2) + end


def files(folder: str = os.path.join(REPO, 'results')) -> list[str]:
  return sorted(glob.glob(os.path.join(folder, '*.json')))


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--check', action='store_true',
                      help='change nothing; exit 1 naming each file a migration would change')
  parser.add_argument('paths', nargs='*', help='result files (default: results/*.json)')
  args = parser.parse_args(argv)
  stale = []
  for path in args.paths or files():
    with open(path) as f:
      text = f.read()
    data = json.loads(text)
    new = migrate(data)
    if new == data:
      continue
    stale.append(path)
    if not args.check:
      with open(path, 'w') as f:
        f.write(_dumps(new, text))
      print(f'migrated {os.path.relpath(path, REPO)}')
  if args.check and stale:
    print('needs migration (python -m experiments.migrations): '
          + ', '.join(os.path.relpath(p, REPO) for p in stale), file=sys.stderr)
    return 1
  return 0


if __name__ == '__main__':
  sys.exit(main())
