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
  from training.aot import slice_name  # pylint: disable=import-outside-toplevel
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
      text += (f' ({slice_name(row["topology"])}, {row["gib_per_chip"]:.1f} GiB per chip, '
               + (f'about {time} to the paper\'s steps by the roofline estimate, '
                  f'{row["bound"]}-bound)' if 'bound' in row else
                  f'about {time} to the paper\'s steps at {100 * row["assumed_mfu"]:.0f}% MFU '
                  'by estimate)'))
    items.append(text)
  return ('At the paper\'s scale, on a TPU slice (each recipe cites the paper for every '
          'value; [docs/tpu.md](docs/tpu.md#the-papers-at-their-own-scale) has the table): '
          + '; '.join(items) + '.')


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
      lines.append(f'| {cell(row.claim)}{links} | {cell(row.paper)} | {cell(ours)} | '
                   f'**{verdict}**: {cell(why)} | `{cell(row.command)}` |')
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
