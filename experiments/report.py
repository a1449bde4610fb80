"""The pieces of RESULTS.md (experiments/render.py): a Section per source paper, a Row per
claim, and the small helpers the rows' criteria share. Each paper's rows live in their own
module (experiments/claims_*.py)."""

from __future__ import annotations

import dataclasses
from typing import Callable

from experiments import registry

VERDICTS = ('reproduces', 'direction holds', 'does not hold at this scale',
            'not testable here')


@dataclasses.dataclass(frozen=True)
class PaperSize:
  """A row's run at the paper's own size (experiments/paper_scale.py, on one accelerator): the
  part of paper_scale.json that runs it, and the row's criterion applied to that part's
  payload, given as `source` (the file of the CPU-size experiment it stands in for, which
  `measure` reads). Defaults: the row's own measure and first source."""
  part: str
  measure: Callable[[dict], tuple[str, str, str]] | None = None
  source: str = ''


@dataclasses.dataclass(frozen=True)
class Row:
  """One claim of a paper.

  measure(results) -> (ours, verdict, why): `results` maps each of `sources` (written by the
  named `experiments`) to its loaded JSON; `ours` is the cell text, `verdict` one of
  VERDICTS and `why` the reason in a few words
  (with the numbers the criterion compared).
  """
  claim: str
  paper: str
  sources: tuple[str, ...]
  experiments: tuple[str, ...]  # experiments/registry.py names that write `sources`.
  measure: Callable[[dict], tuple[str, str, str]]
  links: tuple[str, ...] = ()
  # The claim run at the paper's size too (a synthetic experiment one device holds): RESULTS.md
  # shows that result beside the CPU-size one, each with its own verdict.
  paper_size: PaperSize | None = None

  @property
  def command(self) -> str:
    """The command that reruns this row's experiments."""
    return registry.command(*self.experiments)


@dataclasses.dataclass(frozen=True)
class Section:
  title: str
  source: str  # The paper, as in ../shared/papers/.
  rows: tuple[Row, ...]
  intro: str = ''
  # The paper recipes of this section's experiments (configs.PAPER_RECIPES names): the
  # commands that run them at the paper's scale on a TPU slice.
  paper_scale: tuple[str, ...] = ()


# ------------------------------------------------------------------------------ helpers


def pm(mean: float, std: float, digits: int = 3) -> str:
  return f'{mean:.{digits}f} ± {std:.{digits}f}'


def near(a: float, a_std: float, b: float, b_std: float, tolerance: float) -> bool:
  """|a - b| within `tolerance` (relative to b) or within twice the seeds' spread."""
  return abs(a - b) <= max(tolerance * abs(b), 2 * max(a_std, b_std))
