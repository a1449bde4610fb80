"""The selective-attention rows of RESULTS.md (experiments/claims_selective.py): verdicts follow
the numbers, including the failing cases; and experiments/selective_experiments.py's helpers
(the greedy search continued below C, its floor, the keep-the-gains point, the KV merge).

Every test here runs on small JSON built in memory (no training, no data files)."""

import json

import pytest

from experiments import claims_selective as claims
from experiments import render, rows, selective_experiments as sx

PASS = 'reproduces'
DIRECTION = 'direction holds'
FAIL = 'does not hold at this scale'
UNTESTABLE = 'not testable here'


# ------------------------------------------------------------------------------ builders


def _entry(per_seed: list[dict], keys) -> dict:
  """A run over seeds (experiments/rows.py's entry) from per-seed values."""
  return rows.over_seeds({i: {'v': row} for i, row in enumerate(per_seed)}, keys)['v']


def _va_variant(acc, ood, loss=0.5, first=None):
  return _entry([{'accuracy': a, 'ood_accuracy': o, 'loss': loss, 'ood_loss': loss,
                  'first_step_99': first} for a, o in zip(acc, ood)],
                ('accuracy', 'loss', 'ood_accuracy', 'ood_loss'))


def _va(sel=(1.0, 1.0, 0.995), dense=(0.38, 0.36, 0.40), sel_ood=(1.0, 0.999, 1.0),
        dense_ood=(0.55, 0.6, 0.5)):
  return {'settings': {'steps': 800, 'batch_size': 256, 'assignments': 8, 'num_variables': 3,
                       'num_values': 16, 'ood_values': 2, 'test_examples': 2048, 'd': 2},
          'variants': {'selective': _va_variant(sel, sel_ood, 0.001, 300),
                       'dense': _va_variant(dense, dense_ood, 1.6)}}


def _synthetic(copy=((1.0, 1.0), (0.995, 1.0)), parity=((1.0, 1.0), (1.0, 1.0))):
  """Copy and Parity: per task, (selective's, dense's) accuracy per seed."""
  tasks = {}
  for task, (sel, dense) in (('copy', copy), ('parity', parity)):
    tasks[task] = {name: _entry([{'accuracy': a, 'loss': 1 - a} for a in acc],
                                ('accuracy', 'loss'))
                   for name, acc in (('selective', sel), ('dense', dense))}
  return {'settings': {'tasks': ['copy', 'parity'], 'd': 2, 'batch_size': 64, 'steps': 600,
                       'seeds': [0, 1], 'copy_symbols': 16, 'copy_lengths': [1, 24],
                       'parity_bits': 32, 'test_rows': 512},
          'tasks': tasks}


def _lm_variant(bpb, spread=0.01, diverged=()):
  seeds = []
  for i in range(3):
    if i in diverged:
      seeds.append({'bits_per_byte': None, 'diverged': True})
    else:
      seeds.append({'bits_per_byte': bpb + (i - 1) * spread, 'diverged': False})
  return _entry(seeds, ('bits_per_byte',))


LM_SETTINGS = {'steps': 800, 'batch_size': 8, 'seq_len': 256, 'd': 2, 'windows': [16, 64, 240],
               'paper_windows': [32, 128, 480]}


def _lm(selective=2.60, dense=3.00, windows=(3.30, 3.10, 3.05)):
  variants = {'selective': _lm_variant(selective), 'dense': _lm_variant(dense)}
  for w, bpb in zip(LM_SETTINGS['windows'], windows):
    variants[f'local_{w}'] = _lm_variant(bpb)
  return {'settings': LM_SETTINGS, 'variants': variants}


def _ablations(**bpb):
  values = {'selective': 2.60, 'dense': 3.00, 'no_shift': 2.70, 'no_relu': None,
            'bos_maskable': 2.61, 'diag_unmasked': 2.70, 'separate_bilinear': 2.62, **bpb}
  variants = {}
  for name, v in values.items():
    variants[name] = (_lm_variant(0.0, diverged=(0, 1, 2)) if v is None else _lm_variant(v))
  return {'settings': LM_SETTINGS, 'variants': variants}


def _kv_model(val, pruned, reduction, keep=4.0, keep_loss=None, at_floor=False,
              floor=64.0, bpb=(3.0, 3.0)):
  seeds = [{'val_loss': val, 'bits_per_byte': b, 'unpruned_loss': val, 'pruned_loss': pruned,
            'reduction': reduction, 'budgets': [8, 8], 'at_floor': at_floor,
            'floor_reduction': floor, 'keep_reduction': keep,
            'keep_loss': val if keep_loss is None else keep_loss} for b in bpb]
  return _entry(seeds, ('val_loss', 'bits_per_byte', 'reduction', 'pruned_loss',
                        'keep_reduction', 'keep_loss'))


def _kv(plain=(6, 8, 10), lmem=(20, 30, 50), pruned=(1.9, 1.9, 1.9), keep=(4, 5, 5),
        floors=(False, False, False), gains=((0.5, 0.52), (0.6, 0.62), (0.7, 0.72))):
  """gains: per context, each seed's dense minus selective bits/byte."""
  contexts = {}
  for n, p, m, pl, k, fl, g in zip((128, 256, 512), plain, lmem, pruned, keep, floors, gains):
    sel_bpb = tuple(3.0 - x for x in g)
    contexts[str(n)] = {'dense': _kv_model(2.0, None, None),
                        'selective': _kv_model(1.8, pl, p, keep=k, at_floor=fl, floor=n / 2,
                                               bpb=sel_bpb),
                        'selective_lmem': _kv_model(1.8, pl, m, keep=k, at_floor=fl,
                                                    floor=n / 2, bpb=sel_bpb)}
  return {'settings': {'steps': 800, 'batch_size': 8, 'd': 2, 'prune_step': 8, 'fine_step': 1,
                       'prune_batches': 4, 'keep_tolerance': 0.005},
          'contexts': contexts}


def _verdicts(va=None, lm=None, ablations=None, kv=None, synthetic=None):
  results = {claims.VA: va or _va(), claims.SYNTHETIC: synthetic or _synthetic(),
             claims.LM: lm or _lm(),
             claims.ABLATIONS: ablations or _ablations(), claims.KV: kv or _kv()}
  out = []
  for row in claims.SECTION.rows:
    ours, verdict, why = row.measure({s: results[s] for s in row.sources})
    assert isinstance(ours, str) and why
    out.append(verdict)
  return out


# ------------------------------------------------------------------------------ verdicts


def test_every_row_reproduces_when_the_numbers_do():
  assert _verdicts() == [PASS] * len(claims.SECTION.rows)


def test_variable_assignment_rows_fail_when_dense_solves_it_too():
  va_in, va_ood, *_ = _verdicts(va=_va(dense=(0.99, 1.0, 1.0), dense_ood=(0.99, 1.0, 1.0)))
  assert va_in == FAIL and va_ood == FAIL
  # Selective well ahead but short of 99% in a seed: the direction only.
  va_in, va_ood, *_ = _verdicts(va=_va(sel=(0.97, 0.98, 0.97), sel_ood=(0.95, 0.96, 0.94)))
  assert va_in == DIRECTION and va_ood == DIRECTION
  # Dense ahead.
  assert _verdicts(va=_va(sel=(0.3, 0.3, 0.3)))[0] == FAIL


def test_copy_and_parity_row_needs_both_models_to_solve_both_tasks():
  assert _verdicts()[2] == PASS
  ours, verdict, why = claims.synthetic_solved({claims.SYNTHETIC: _synthetic(
      copy=((1.0, 1.0), (0.95, 0.97)))})
  assert verdict == DIRECTION and 'dense on copy (0.950)' in why, why
  assert 'copy lengths 1-24 of 16 symbols, parity of 32 bits' in ours and 'd=2' in ours
  assert _verdicts(synthetic=_synthetic(parity=((0.6, 1.0), (1.0, 1.0))))[2] == FAIL
  data = _synthetic()
  del data['tasks']['parity']
  assert _verdicts(synthetic=data)[2] == UNTESTABLE


def test_language_model_rows_follow_the_numbers():
  rows = _verdicts(lm=_lm(selective=3.05))  # Selective worse than dense.
  assert rows[3] == FAIL and rows[4] == FAIL
  rows = _verdicts(lm=_lm(selective=2.995))  # Below dense, within the noise.
  assert rows[3] == DIRECTION and rows[4] == DIRECTION
  # A window better than dense (what a short run favours): the ranking fails, the
  # selective-vs-dense row does not.
  rows = _verdicts(lm=_lm(windows=(3.30, 2.90, 3.05)))
  assert rows[3] == PASS and rows[4] == FAIL
  # Every window above dense only within the noise: direction.
  assert _verdicts(lm=_lm(windows=(3.01, 3.005, 3.002)))[4] == DIRECTION


def test_ablation_rows_follow_the_numbers():
  index = {name: i for i, name in enumerate(
      ['no_shift', 'no_relu', 'bos_maskable', 'diag_unmasked', 'separate_bilinear'], start=5)}
  rows = _verdicts(ablations=_ablations(no_shift=2.55, diag_unmasked=2.605))
  assert rows[index['no_shift']] == FAIL          # Better than selective.
  assert rows[index['diag_unmasked']] == DIRECTION  # Worse, within the noise.
  rows = _verdicts(ablations=_ablations(no_relu=2.61))  # Converges like selective.
  assert rows[index['no_relu']] == FAIL
  rows = _verdicts(ablations=_ablations(no_relu=2.80))  # Worse than selective, not dense.
  assert rows[index['no_relu']] == DIRECTION
  rows = _verdicts(ablations=_ablations(no_relu=3.30))  # Above dense in every seed.
  assert rows[index['no_relu']] == PASS
  rows = _verdicts(ablations=_ablations(bos_maskable=2.40, separate_bilinear=2.90))
  assert rows[index['bos_maskable']] == FAIL           # Clearly better: not "neutral".
  assert rows[index['separate_bilinear']] == DIRECTION  # Clearly worse: more than "slightly".


def test_a_missing_variant_is_not_testable():
  data = _ablations()
  del data['variants']['separate_bilinear']
  assert _verdicts(ablations=data)[9] == UNTESTABLE


def test_kv_rows_follow_the_numbers():
  plain, lmem, keep = _verdicts(kv=_kv(plain=(3, 4, 5), lmem=(4, 5, 6), keep=(2, 2, 2)))[10:13]
  assert plain == DIRECTION and lmem == DIRECTION and keep == DIRECTION
  # The pruned loss above the dense model's (2.0) by more than 1%.
  plain, lmem, _ = _verdicts(kv=_kv(pruned=(1.9, 2.05, 1.9)))[10:13]
  assert plain == FAIL and lmem == FAIL
  # L_mem saves less than without it, everywhere or at one context.
  assert _verdicts(kv=_kv(lmem=(5, 7, 9)))[11] == FAIL
  assert _verdicts(kv=_kv(lmem=(20, 5, 50)))[11] == FAIL
  # No reduction at all.
  assert _verdicts(kv=_kv(plain=(1, 1, 1)))[10] == FAIL
  # The same budgets at the dense loss, but L_mem keeps its own loss with fewer tokens at 512:
  # the verdict stays, and the reason says where L_mem does help.
  data = _kv(lmem=(6, 8, 10))
  for s in data['contexts']['512']['selective_lmem']['rows']:
    s['metrics']['keep_reduction'] = 9
  row = claims.SECTION.rows[11]
  _, verdict, why = row.measure({claims.KV: data})
  assert verdict == FAIL and why.endswith('at N = 512 (next row)'), why
  _, verdict, why = row.measure({claims.KV: _kv(lmem=(6, 8, 10))})
  assert verdict == FAIL and 'own loss' not in why, why
  # Both at the search's floor everywhere: the factors are the cap, L_mem cannot show.
  plain, lmem, _ = _verdicts(kv=_kv(plain=(64, 128, 256), lmem=(64, 128, 256),
                                    floors=(True, True, True)))[10:13]
  assert plain == PASS and lmem == UNTESTABLE
  # Keeping the own loss costs more than 1% on validation.
  data = _kv()
  for c in data['contexts'].values():
    for s in c['selective']['rows']:
      s['metrics']['keep_loss'] = 1.9
  assert _verdicts(kv=data)[12] == FAIL


def test_gain_with_context_follows_the_numbers():
  row = claims.SECTION.rows[13]
  assert row.measure({claims.KV: _kv()})[1] == PASS
  # Larger at 512 than at 128 but not at 256; or larger only within the seeds' spread.
  assert row.measure({claims.KV: _kv(gains=((0.5, 0.52), (0.45, 0.47), (0.7, 0.72)))})[
      1] == DIRECTION
  assert row.measure({claims.KV: _kv(gains=((0.4, 0.6), (0.45, 0.65), (0.5, 0.7)))})[
      1] == DIRECTION
  # Shrinking gain.
  assert row.measure({claims.KV: _kv(gains=((0.7, 0.72), (0.6, 0.62), (0.5, 0.52)))})[
      1] == FAIL
  # One context only.
  data = _kv()
  data['contexts'] = {'128': data['contexts']['128']}
  assert row.measure({claims.KV: data})[1] == UNTESTABLE
  ours, _, why = row.measure({claims.KV: _kv()})
  assert 'N=128: 0.510 ± 0.014' in ours and 'N=512: 0.710 ± 0.014' in ours, ours
  assert 'dense itself' not in why
  # Dense worse on longer rows: said, since part of the growth is dense's.
  data = _kv()
  for s in data['contexts']['512']['dense']['rows']:
    s['metrics']['bits_per_byte'] = 3.2
  data['contexts']['512']['dense']['mean']['bits_per_byte'] = 3.2
  assert 'dense itself does worse on longer rows' in row.measure({claims.KV: data})[2]


def test_kv_compares_each_context_with_the_paper_at_four_times_it():
  # Only the 512 context: the paper's 2,048 (8x without, 47x with L_mem).
  data = _kv()
  data['contexts'] = {'512': data['contexts']['512']}
  ours, verdict, why = claims.SECTION.rows[10].measure({claims.KV: data})
  assert verdict == PASS and '8x at 2048' in why
  data['contexts']['512']['selective_lmem'] = _kv_model(1.8, 1.9, 40)  # < 47x.
  assert claims.SECTION.rows[11].measure({claims.KV: data})[1] == DIRECTION


def test_render_marks_the_rows_not_run_without_results(tmp_path):
  text = render.main(['--results', str(tmp_path), '--out', str(tmp_path / 'R.md')])
  section = text.split('## Selective attention')[1].split('\n## ')[0]
  assert section.count('**not run**') == len(claims.SECTION.rows)
  for name, data in ((claims.VA, _va()), (claims.LM, _lm()), (claims.ABLATIONS, _ablations()),
                     (claims.KV, _kv()), (claims.SYNTHETIC, _synthetic())):
    (tmp_path / name).write_text(json.dumps(data))
  text = render.main(['--results', str(tmp_path), '--out', str(tmp_path / 'R.md')])
  section = text.split('## Selective attention')[1].split('\n## ')[0]
  assert '**not run**' not in section
  assert section.count('**reproduces**') == len(claims.SECTION.rows)
  # The synthetic rows show the paper's size too: not run there until a device has.
  paper = [row for row in claims.SECTION.rows if row.paper_size]
  assert [row.measure for row in paper] == [claims.va_in_distribution,
                                            claims.va_out_of_distribution,
                                            claims.synthetic_solved]
  assert section.count('Paper size: **not run at paper size**: no device has run it') == 3


# ------------------------------------------------------------------------------ helpers


def test_greedy_from_continues_below_c_to_the_target():
  # Layer 0 is free to cut, layer 1 costs 0.1 a token.
  loss_of = lambda b: 1.0 + 0.1 * (8 - b[1])
  budgets, loss, history = sx.greedy_from(loss_of, [8, 8], [0, 1], 1, 1.25, loss_of([8, 8]))
  assert budgets == [2, 6] and loss == pytest.approx(1.2)
  assert [h['layer'] for h in history] == [0] * 6 + [1, 1]
  # A target below the current loss: nothing is cut.
  assert sx.greedy_from(loss_of, [8, 8], [0, 1], 1, 0.5, 1.0)[0] == [8, 8]


def test_floor_and_keep_point():
  assert sx.floor_budget(512, 8, 1) == 2 and sx.floor_budget(512, 8, 0) == 8
  assert sx.floor_budget(100, 8, 0) == 4 and sx.floor_budget(100, 8, 3) == 4
  assert sx.at_floor([8, 9], [0, 1], 8) and not sx.at_floor([8, 10], [0, 1], 8)
  history = [{'budgets': [120, 128], 'loss': 1.0}, {'budgets': [112, 128], 'loss': 1.004},
             {'budgets': [112, 120], 'loss': 1.02}, {'budgets': [104, 120], 'loss': 1.001}]
  # Stops where the greedy search with that target would: at the first loss above it.
  assert sx.keep_point(history, 1.0, 0.005, 128, 2) == [112, 128]
  assert sx.keep_point(history, 1.0, 0.0, 128, 2) == [120, 128]
  assert sx.keep_point([], 1.0, 0.005, 128, 2) == [128, 128]


def test_greedy_path_starts_at_the_full_cache():
  history = [{'budgets': [120, 128], 'loss': 1.0000004}, {'budgets': [112, 120], 'loss': 1.02}]
  assert sx.greedy_path(history, 0.99, 128, 2) == [[256, 0.99], [248, 1.0], [232, 1.02]]


def test_a_finished_budget_search_is_reused_only_for_the_same_settings(tmp_path):
  args = sx.parse_args(['--part', 'va', '--out', str(tmp_path / 'x.json')])  # C 8, fine 1, 4.
  path = tmp_path / 'budgets.json'
  assert sx.finished_search(str(path), 2.0, args, 800, 2) is None  # No file.
  found = {'budgets': [3, 3], 'target_loss': 2.0, 'step': 8, 'batches': 4,
           'checkpoint_step': 800, 'fine_step': 1, 'history': []}
  path.write_text(json.dumps(found))
  assert sx.finished_search(str(path), 2.0, args, 800, 2) == found
  for target, step in ((2.1, 800), (2.0, 900)):  # Another dense target, another checkpoint.
    assert sx.finished_search(str(path), target, args, step, 2) is None
  for key, value in (('step', 16), ('batches', 2), ('fine_step', 2)):
    path.write_text(json.dumps({**found, key: value}))
    assert sx.finished_search(str(path), 2.0, args, 800, 2) is None, key
  # Stopped at C's floor without the finer search: not finished. Above the floor: finished.
  coarse = {k: v for k, v in found.items() if k != 'fine_step'}
  path.write_text(json.dumps({**coarse, 'budgets': [8, 8]}))
  assert sx.finished_search(str(path), 2.0, args, 800, 2) is None
  path.write_text(json.dumps({**coarse, 'budgets': [16, 8]}))
  assert sx.finished_search(str(path), 2.0, args, 800, 2) is not None


def test_summarize_keeps_diverged_seeds_out_of_the_mean():
  e = _entry([{'bits_per_byte': 2.0}, {'bits_per_byte': None, 'diverged': True},
              {'bits_per_byte': 2.2}], ('bits_per_byte',))
  assert rows.metric(e, 'bits_per_byte') == pytest.approx(2.1) and e['diverged_seeds'] == [1]
  assert rows.metric(_entry([{'bits_per_byte': None}], ('bits_per_byte',)),
                     'bits_per_byte') is None


def test_kv_results_of_separate_commands_merge(tmp_path):
  path = tmp_path / 'kv.json'
  settings = {'steps': 800, 'contexts': [128, 256]}
  first = {'command': 'a', 'part': 'kv', 'settings': settings,
           'contexts': _kv()['contexts'] | {}}
  first['contexts'] = {k: v for k, v in first['contexts'].items() if k != '512'}
  path.write_text(json.dumps(first))
  second = {'command': 'b', 'part': 'kv', 'settings': {**settings, 'contexts': [512]},
            'contexts': {'512': _kv()['contexts']['512']}}
  merged = sx.merge_kv(str(path), second)
  assert sorted(merged['contexts']) == ['128', '256', '512']
  assert merged['settings']['contexts'] == [128, 256, 512] and merged['commands'] == ['a', 'b']
  other = {**second, 'settings': {'steps': 400, 'contexts': [512]}}
  with pytest.raises(SystemExit):
    sx.merge_kv(str(path), other)


def _kv_context(seed: int, reduction: float) -> dict:
  row = {'val_loss': 2.0, 'unpruned_loss': 2.0, 'pruned_loss': 2.0, 'reduction': reduction,
         'keep_reduction': reduction / 2, 'keep_loss': 2.0, 'bits_per_byte': 2.9}
  return rows.over_seeds({seed: {'dense': {'val_loss': 2.1}, 'selective': row}}, sx.KV_KEYS)


def test_kv_seeds_of_separate_commands_merge(tmp_path):
  path = tmp_path / 'kv.json'
  settings = {'steps': 800, 'contexts': [512], 'seeds': [0]}
  path.write_text(json.dumps({'command': 'a', 'part': 'kv', 'settings': settings,
                              'contexts': {'512': _kv_context(0, 10.0)}}))
  second = {'command': 'b', 'part': 'kv', 'settings': {**settings, 'seeds': [1]},
            'contexts': {'512': _kv_context(1, 20.0)}}
  merged = sx.merge_kv(str(path), second)
  sel = merged['contexts']['512']['selective']
  assert [s['seed'] for s in sel['rows']] == [0, 1] and merged['settings']['seeds'] == [0, 1]
  assert rows.metric(sel, 'reduction') == pytest.approx(15.0)
  assert rows.metric(sel, 'reduction', 'std') > 0
  # Seed 1 again replaces its earlier result.
  path.write_text(json.dumps(merged))
  again = sx.merge_kv(str(path), {**second, 'contexts': {'512': _kv_context(1, 12.0)}})
  assert rows.metric(again['contexts']['512']['selective'], 'reduction') == pytest.approx(11.0)
