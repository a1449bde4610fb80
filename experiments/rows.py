"""One format of the results the training experiments write, one rule for aggregating seeds,
and one way to read a metric back (RESULTS.md's claims read every number through it).

A row is one run of one seed:

    {'run': NAME, 'seed': S or None,
     'metrics': {name: number or None},             # what was measured (None: not measured)
     'curves': {name: [[step, value], ...]},        # e.g. eval_loss, eval_bits_per_byte
     'diverged': why,                               # present only when the run diverged
     'evals': {tag: evaluation},                    # evaluations after training, if any
     ...descriptive fields}                         # the variant spec, budgets, spans, ...

experiments/harness.py's run() returns the rows of its runs; `row()` writes one from a flat
{key: value} and `add()` adds a flat {key: value} to one (the harness's own measurements go
through them, and an experiment's after training: its evaluations, budgets, curves), by one
rule: numbers and None are metrics, the 'curves' dict and every KEY_curve are curves, the
'evals' dict and every dict under 'eval' or 'eval_TAG' are evaluations (what `main.py
--mode=eval` gives: {'loss': ..., 'bits_per_byte': ..., ...}), a false 'diverged' is left out,
the rest are descriptive fields.

An entry is a run over seeds (`over_seeds()`, the one aggregation):

    {'run': NAME, 'rows': [row, ...],               # seed by seed
     'mean': {key: mean over the seeds where key is finite, None where it is nowhere},
     'std': {key: their sample standard deviation, 0 for one seed},
     'diverged_seeds': [S, ...]}                    # the rows that say 'diverged'

A diverged seed's NaN never enters a mean: it is counted in 'diverged_seeds' instead.

`metric(entry, key, stat)` reads a metric of an entry ('mean', 'std', or 'seeds': the value of
each row) or of a row ('value'; 'TAG/KEY[/KEY...]': a number of its evaluation TAG);
`evaluation`, `seed_rows`, `diverged_seeds` and `field` read the rest.
tests/experiments/test_rows.py checks that every committed results file of an experiment
parses through them.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

CURVE = '_curve'  # A flat key KEY_curve is the curve KEY.
STATS = ('mean', 'std', 'seeds', 'value')


def finite(x) -> bool:
  """A number that is neither NaN nor infinite (a diverged run's loss is not)."""
  return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _number(x) -> bool:
  return x is None or (isinstance(x, (int, float)) and not isinstance(x, bool))


def is_row(x) -> bool:
  """Whether `x` is a row of this format."""
  return (isinstance(x, Mapping) and {'run', 'seed', 'metrics', 'curves'} <= set(x)
          and isinstance(x['metrics'], Mapping) and isinstance(x['curves'], Mapping)
          and all(_number(v) for v in x['metrics'].values()))


def is_entry(x) -> bool:
  """Whether `x` is a run over seeds of this format."""
  return (isinstance(x, Mapping) and {'run', 'rows', 'mean', 'std', 'diverged_seeds'} <= set(x)
          and all(is_row(r) for r in x['rows']))


def row(run: str, seed: int | None, values: Mapping[str, Any]) -> dict:
  """The row of run `run`, seed `seed`, from its flat {key: value} (see the module
  docstring); a 'seed' or 'run' among `values` is dropped (the arguments say them)."""
  metrics, curves, evals, fields = {}, {}, {}, {}
  for key, value in values.items():
    if key in ('run', 'seed'):
      continue
    if key == 'curves' and isinstance(value, Mapping):
      curves.update(value)
    elif key.endswith(CURVE):
      curves[key[:-len(CURVE)]] = value
    elif key == 'evals' and isinstance(value, Mapping):
      evals.update(value)
    elif (key == 'eval' or key.startswith('eval_')) and isinstance(value, Mapping):
      evals[key] = value
    elif key == 'diverged':
      if value:
        fields[key] = value
    elif _number(value):
      metrics[key] = value
    else:
      fields[key] = value
  if evals:
    fields['evals'] = evals
  return {'run': run, 'seed': seed, 'metrics': metrics, 'curves': curves, **fields}


def add(r: dict, values: Mapping[str, Any]) -> dict:
  """Adds a flat {key: value} to row `r` by row()'s rule (numbers to its metrics, curves to
  its curves, evaluations to its evals, the rest as fields; a key already there takes the new
  value); returns `r`. A run's later measurements (its training time, evaluations after
  training, the timed tokens/s) go into its row through this."""
  more = row(r['run'], r['seed'], values)
  r['metrics'].update(more.pop('metrics'))
  r['curves'].update(more.pop('curves'))
  if 'evals' in more:
    r['evals'] = {**r.get('evals', {}), **more.pop('evals')}
  for key in ('run', 'seed'):
    del more[key]
  r.update(more)
  return r


def seed_stats(values: Sequence) -> tuple[float | None, float]:
  """(mean, sample standard deviation) of the finite values; (None, 0) when there are none,
  a standard deviation of 0 for one."""
  values = [v for v in values if finite(v)]
  if not values:
    return None, 0.0
  return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def over_seeds(per_seed: Mapping[int, Mapping[str, Mapping[str, Any]]],
               keys: Sequence[str]) -> dict[str, dict]:
  """Every experiment's runs aggregated over seeds, with one rule for what diverged.

  Args:
    per_seed: seed -> run name -> that run's row, or its flat {key: value} (made a row by
      row()).
    keys: the metrics to aggregate.

  Returns:
    run name -> its entry (see the module docstring), runs in first-seen order.
  """
  out = {}
  for seed, runs in per_seed.items():
    for name, values in runs.items():
      r = values if is_row(values) else row(name, seed, values)
      out.setdefault(name, []).append({**r, 'run': name, 'seed': seed})
  return {name: entry(name, rows, keys) for name, rows in out.items()}


def entry(name: str, rows: Sequence[dict], keys: Sequence[str]) -> dict:
  """The entry of run `name` over its seeds' `rows`, `keys` aggregated."""
  mean, std = {}, {}
  for key in keys:
    mean[key], std[key] = seed_stats([r['metrics'].get(key) for r in rows])
  return {'run': name, 'rows': list(rows), 'mean': mean, 'std': std,
          'diverged_seeds': [r['seed'] for r in rows if r.get('diverged')]}


# ------------------------------------------------------------------------------ reading


def metric(item: Mapping, key: str, stat: str = 'mean'):
  """A metric of an entry (stat 'mean', 'std', or 'seeds': each row's value, seed by seed)
  or of a row (stat 'value', or 'mean' for a row read as one seed; a key 'TAG/KEY[/KEY...]'
  not among its metrics is a number of its evaluation TAG). A KeyError names what is missing
  (RESULTS.md then says what the results lack)."""
  if stat not in STATS:
    raise ValueError(f'stat must be one of {STATS}, got {stat!r}')
  if is_row(item):
    if stat not in ('value', 'mean'):
      raise ValueError(f'a row of one seed has no {stat!r}')
    if key in item['metrics'] or '/' not in key:
      return item['metrics'][key]
    tag, *path = key.split('/')
    value = evaluation(item, tag)
    for part in path:
      value = value[part]
    return value
  if stat == 'value':
    raise ValueError(f'{item.get("run")!r} is over seeds: ask for its mean, std or seeds')
  if stat == 'seeds':
    return [r['metrics'].get(key) for r in item['rows']]
  return item[stat][key]


def evaluation(r: Mapping, tag: str) -> dict:
  """A row's evaluation `tag` (what main.py --mode=eval gave); a KeyError naming the tag when
  the row has none (a diverged run is not evaluated)."""
  evals = r.get('evals', {})
  if tag not in evals:
    raise KeyError(f'{r.get("run")}: evaluation {tag}')
  return evals[tag]


def seed_rows(item: Mapping) -> list[dict]:
  """The rows of an entry, seed by seed (a row: itself)."""
  return [item] if is_row(item) else list(item['rows'])


def diverged_seeds(item: Mapping) -> list:
  """The seeds of an entry (or a row) whose run diverged."""
  return [r['seed'] for r in seed_rows(item) if r.get('diverged')]


def field(r: Mapping, key: str, default: Any = KeyError):
  """A row's metric, curve or descriptive field `key`, in that order (`default` when it has
  none; a KeyError without one)."""
  for where in (r['metrics'], r['curves'], r):
    if key in where:
      return where[key]
  if default is KeyError:
    raise KeyError(key)
  return default
