"""Renders RESULTS.md from the JSON the experiments write: one table per source paper, each
row a claim, the paper's number, ours, the command that reproduces it and a verdict.

  python -m experiments.render                               # the committed results
  python -m experiments.render --results OUT --out OUT/RESULTS.md   # as experiments `all` does

No number in RESULTS.md is typed by hand: every "ours" cell and every verdict is computed
here from a results file, by the criterion its row states. A row whose file is missing says
so ("not run") instead of a number, as does a row whose files lack what it reads (a --quick
run measures fewer sizes). Results are looked up by file name in the --results
folders, first match wins (default: results/, the one folder of every committed result: the
experiments' and the component timings some rows read).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, 'results')  # Every committed result file.

import configs  # noqa: E402
from experiments import (claims_adaptive_span, claims_selective, claims_sparse,  # noqa: E402
                         claims_survey)
from experiments.report import VERDICTS  # noqa: E402

# One table per source paper, in this order.
SECTIONS = (claims_adaptive_span.SECTION, claims_sparse.SECTION, claims_selective.SECTION,
            claims_survey.SECTION)


# ------------------------------------------------------------------------------ render


def load(folders: list[str], name: str):
  for folder in folders:
    path = os.path.join(folder, name)
    if os.path.isfile(path):
      with open(path) as f:
        return json.load(f)
  return None


def cell(text: str) -> str:
  return text.replace('|', '\\|').replace('\n', ' ')


def paper_scale(folders: list[str], recipes: tuple[str, ...]) -> str:
  """The section's 'at the paper's scale' commands, with each recipe's slice, per-chip
  memory and estimated days from tpu_compile_recipes.json (benchmarks/tpu_compile.py
  --recipes) when that file is there."""
  rows = {r['recipe']: r
          for r in (load(folders, 'tpu_compile_recipes.json') or {}).get('rows', [])}
  items = []
  for name in recipes:
    data = configs.PAPER_DATA.get(name)
    text = f'`python main.py --config=configs/{name}.py' + (f' {data}`' if data else '`')
    row = rows.get(name)
    if row and row.get('gib_per_chip') and row.get('days'):
      days = row['days']
      amount, unit = ((days, 'day') if days >= 1 else (24 * days, 'hour') if days >= 1 / 24
                      else (1440 * days, 'minute'))
      time = f'{amount:.2g} {unit}' + ('' if f'{amount:.2g}' == '1' else 's')
      text += (f' ({configs.slice_name(row["topology"])}, {row["gib_per_chip"]:.1f} GiB per chip, '
               + (f'about {time} to the paper\'s steps by the roofline estimate, '
                  f'{row["bound"]}-bound)' if 'bound' in row else
                  f'about {time} to the paper\'s steps at {100 * row["assumed_mfu"]:.0f}% MFU '
                  'by estimate)'))
    items.append(text)
  return ('At the paper\'s scale, on a TPU slice (each recipe cites the paper for every '
          'value; [docs/tpu.md](docs/tpu.md#the-papers-at-their-own-scale) has the table): '
          + '; '.join(items) + '.')


PAPER_SCALE = 'paper_scale.json'  # experiments/paper_scale.py's: the rows' paper-size runs.
PAPER_SCALE_LEASE = ('`bash benchmarks/gpu_paper_scale.sh OUT` runs every paper-size part on '
                     'one H100 or H200 in 10 minutes')


def _where(results: dict) -> str:
  """What a CPU-size result ran on, from its file's machine record: ' (2 CPU cores)' ('' when
  the file does not say)."""
  machine = next((r.get('machine') for r in results.values() if isinstance(r, dict)
                  and r.get('machine')), None)
  if not machine:
    return ''
  if machine.get('backend') == 'cpu':
    return f' ({machine.get("cpu_count", "?")} CPU cores)'
  return f' ({machine.get("device_kind", machine.get("backend", "?"))})'


def paper_size(row, folders: list[str]) -> tuple[str, str, str]:
  """(where, ours, verdict) of a row's run at the paper's size, from paper_scale.json's part:
  the row's criterion applied to the part's payload, where = ' (the device[; what its time
  limit cut])'; 'not run at paper size' with the reason where no device has run it (or the
  run lacks what the row reads)."""
  spec = row.paper_size
  data = load(folders, PAPER_SCALE) or {}
  part = data.get('parts', {}).get(spec.part)
  not_run = 'not run at paper size'
  if part is None:
    return '', not_run, f'**{not_run}**: no device has run it; {PAPER_SCALE_LEASE}'
  device = part.get('device') or data.get('device', {}).get('kind', '?')
  if data.get('profile', 'device') != 'device':
    device += f', {data["profile"]} profile'
  if 'payload' not in part:
    return '', not_run, (f'**{not_run}**: the part {part.get("status", "failed")} on '
                         f'{device} ({part.get("error", "no result")}); {PAPER_SCALE_LEASE}')
  cut = part.get('cut') or ', '.join(part.get('skipped', []))
  cut = f'; cut at its time limit: {cut}' if cut else ''
  measure = spec.measure or row.measure
  source = spec.source or row.sources[0]
  try:
    ours, verdict, why = measure({source: part['payload']})
  except (KeyError, IndexError, ZeroDivisionError, TypeError) as e:
    return '', not_run, (f'**{not_run}**: the run on {device} lacks what this row reads '
                         f'({type(e).__name__}: {e}{cut})')
  if verdict not in VERDICTS:
    raise ValueError(f'{row.claim!r}: paper-size verdict {verdict!r} is not one of {VERDICTS}')
  return f' ({device}{cut})', ours, f'**{verdict}**: {why}'


def render(folders: list[str]) -> str:
  lines = ['# Results: the source papers\' claims, re-run here',
           '',
           'Every number below is computed by `experiments/render.py` from the JSON the '
           'experiments write; none is typed by hand. Rerun everything with '
           '`python -m experiments all --out OUT --text TEXT` (a few hours on 2 CPU cores; it '
           'renders OUT/RESULTS.md: `python -m experiments.render --results OUT --out '
           'OUT/RESULTS.md`). Each row\'s command reruns that row\'s experiments alone '
           '(experiments/README.md). TEXT is a byte-level text file (here '
           '`../shared/data/tinyshakespeare.txt`).',
           '',
           'Verdicts: **reproduces** (the claim holds by the row\'s criterion), **direction '
           'holds** (the sign or ranking holds, the size does not), **does not hold at this '
           'scale**, **not testable here** (with the reason).',
           '',
           'The rows of the synthetic experiments a single accelerator can run at the paper\'s '
           'own size (Variable Assignment, Copy and Parity, the Reformer\'s duplication task, '
           'the Universal Transformer\'s copy) also show that run, on the device named, with '
           'its own verdict by the same criterion, or "not run at paper size" until a device '
           'has run it (`experiments/paper_scale.py`: `bash benchmarks/gpu_paper_scale.sh OUT` '
           'runs them all in one 10-minute lease and writes OUT/paper_scale.json, which this '
           'renderer reads like the other results).',
           '']
  for section in SECTIONS:
    lines += [f'## {section.title}', '', f'Source: `../shared/papers/{section.source}`.', '']
    if section.intro:
      lines += [section.intro, '']
    if section.paper_scale:
      lines += [paper_scale(folders, section.paper_scale), '']
    lines += ['| claim | paper | ours | verdict | command |', '|---|---|---|---|---|']
    for row in section.rows:
      results = {name: load(folders, name) for name in row.sources}
      missing = [name for name, data in results.items() if data is None]
      if missing:
        ours, verdict, why = 'not run', 'not run', f'no {", ".join(missing)} yet'
      else:
        try:
          ours, verdict, why = row.measure(results)
        except (KeyError, IndexError, ZeroDivisionError) as e:  # E.g. a --quick run's sizes.
          ours, verdict = 'not run', 'not run'
          why = (f'{", ".join(row.sources)} lack what this row reads ({type(e).__name__}: '
                 f'{e}); a --quick run measures fewer sizes')
        else:
          if verdict not in VERDICTS:
            raise ValueError(f'{row.claim!r}: verdict {verdict!r} is not one of {VERDICTS}')
      links = ''.join(f' ([{os.path.basename(link)}]({link}))' for link in row.links)
      ours, verdict = cell(ours), f'**{verdict}**: {cell(why)}'
      command = f'`{cell(row.command)}`'
      if row.paper_size:  # The paper-size run beside the CPU-size one, each with its verdict.
        device, paper_ours, paper_verdict = paper_size(row, folders)
        where = _where(results) if not missing else ''
        ours = f'**CPU size**{where}: {ours}<br>**Paper size**{cell(device)}: {cell(paper_ours)}'
        verdict = f'CPU size: {verdict}<br>Paper size: {cell(paper_verdict)}'
        command += (f'<br>`python -m experiments.paper_scale --parts {row.paper_size.part} '
                    '--out OUT/paper_scale.json`')
      lines.append(f'| {cell(row.claim)}{links} | {cell(row.paper)} | {ours} | '
                   f'{verdict} | {command} |')
    lines.append('')
  return '\n'.join(lines)


def main(argv=None) -> str:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument('--results', action='append', default=[],
                 help='folder of result JSON files (repeatable; default: results/)')
  p.add_argument('--out', default=os.path.join(REPO, 'RESULTS.md'))
  args = p.parse_args(argv)
  folders = args.results or [RESULTS]
  text = render(folders)
  with open(args.out, 'w') as f:
    f.write(text + '\n')
  print(f'wrote {args.out}')
  return text


if __name__ == '__main__':
  sys.exit(main() and 0)
