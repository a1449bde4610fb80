"""Every experiment's figure draws from the committed results (results/*.json, the one row
format of experiments/rows.py): a plot reads the same rows its experiment writes, and a change
of the format that a plot missed fails here, not at the end of hours of training."""

import json
import os

import pytest

from experiments import (adaptive_span_lm, compare, reformer_experiment, selective_experiments,
                         sparse_transformer, txl_experiment, universal_experiment)

RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), 'results')


def _load(name: str) -> dict:
  with open(os.path.join(RESULTS, name)) as f:
    return json.load(f)


def _adaptive_span(path):
  data = _load('adaptive_span_lm.json')
  per_seed = {}
  for name, entry in data['variants'].items():
    for row in entry['rows']:
      per_seed.setdefault(row['seed'], {})[name] = row
  adaptive_span_lm.plot(per_seed, data['settings']['span_limit'], path, 'spans')


def _sparse(path):
  data = _load('sparse_transformer.json')
  s = data['settings']
  sparse_transformer.plot(data['runs'][str(s['seeds'][0])], s['batch_size'], s['seq_len'], path, 'sparse')


def _universal(path):
  folder = os.path.splitext(path)[0]
  universal_experiment.plot(_load('universal_experiment.json'), folder)
  drawn = [os.path.join(folder, f) for f in sorted(os.listdir(folder))]
  assert drawn
  os.replace(drawn[0], path)


PLOTS = {
    'adaptive_span_lm': _adaptive_span,
    'compare': lambda path: compare.plot(_load('compare.json')['rows'], path, 'compare'),
    'universal': _universal,
    'sparse_transformer': _sparse,
    'selective_kv': lambda path: selective_experiments.plot_kv(_load('selective_kv.json'), path),
    'txl': lambda path: txl_experiment.plot(_load('txl_experiment.json'), path),
    'reformer': lambda path: reformer_experiment.plot(_load('reformer_experiment.json'), path),
}


@pytest.mark.parametrize('name', sorted(PLOTS))
def test_the_figure_draws_from_the_committed_rows(tmp_path, name):
  path = str(tmp_path / f'{name}.png')
  PLOTS[name](path)
  assert os.path.getsize(path) > 1000
