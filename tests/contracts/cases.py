"""The contract suite's cases, read from the registries: a new attention variant, residual wiring or
stack is covered without a line of test code.

A case is (attention variant, residual wiring, stack setting): the variant at the small size it declares
(Traits.TEST_CONFIG), on a residual wiring of models/residual.py, in a stack of
models/stacks.py (with the stack's own test settings, Stack.TEST_CONFIG, and each of its
boolean options both ways: the universal stack with and without ACT). A combination the
config refuses (TransformerConfig raises ValueError: reversible layers with segment memory, a
scan over layers that differ) is no case.

Every valid combination (about 110) times every property would take most of CI's time, so the
suite runs a pairwise covering set (all-pairs testing): every (variant, residual), (variant,
stack) and (residual, stack) pair that some valid case has is in at least one chosen case, and
every variant's baseline (pre_ln, unrolled) is. A fault of one component, or of two that
interact, shows in some case; a fault that needs three at once is what the per-variant files
and the paper tests are for. `ALL` keeps the full product for `-m slow` runs.
"""

from __future__ import annotations

import dataclasses
import itertools

from models import attention, residual, stacks, transformer

VOCAB = 50
MAX_LEN = 24
BASELINE = ('pre_ln', 'unrolled')
BASELINE_VARIANT = 'dense'  # The attention a wiring or stack is tried on first (one_each).


@dataclasses.dataclass(frozen=True)
class Case:
  """One (variant, residual wiring, stack setting) combination and its model config."""
  variant: str
  residual: str
  stack: str          # Stack name, with its option settings: 'universal+act'.
  config: transformer.TransformerConfig

  @property
  def id(self) -> str:
    return f'{self.variant}-{self.residual}-{self.stack}'


def product_variants() -> list[str]:
  """The product's variants: those a fresh process registers (test modules may register toy
  variants of their own)."""
  return [n for n in attention.known() if attention.get(n).__module__.startswith('models.')]


def stack_settings() -> dict[str, tuple[str, dict]]:
  """label -> (stack name, stack options): every stack with its defaults, and each boolean
  option of it set to the other value ('universal+act')."""
  out = {}
  for name in stacks.known():
    out[name] = (name, {})
    for option, spec in sorted(stacks.get(name).OPTIONS.items()):
      if isinstance(spec.default, bool):
        out[f'{name}+{option}' if not spec.default else f'{name}-{option}'] = (
            name, {option: not spec.default})
  return out


def model_settings(variant: str, residual: str, stack: str) -> dict:
  """The config.model keys of a case: width 32, 4 heads, 2 layers (the stack's TEST_CONFIG
  may change that), float32, with the variant's TEST_CONFIG on top."""
  stack_name, stack_options = stack_settings()[stack]
  declared = dict(attention.traits.of(variant).TEST_CONFIG)
  m = dict(d=0, d_model=32, n_heads=4, n_layers=2, attention=variant,
           attention_options={variant: declared.pop('attention_options', {})}, residual=residual,
           stack=stack_name, dtype='float32')
  m.update(declared)
  m.update(stacks.get(stack_name).TEST_CONFIG)
  if stack_options:
    m['stack_options'] = {**m.get('stack_options', {}), **stack_options}
  return m


def model_config(variant: str, residual: str, stack: str) -> transformer.TransformerConfig:
  """The case's model at VOCAB tokens and MAX_LEN positions.

  Raises:
    ValueError: the config refuses the combination.
  """
  return transformer.TransformerConfig.from_config(
      {**model_settings(variant, residual, stack), 'vocab_size': VOCAB, 'max_len': MAX_LEN})


def run_config(case: Case, **model):
  """configs/default.py training the case's model (its option groups merged into the
  config's), with `model` overrides of config.model: the real loop's config for a case."""
  from configs import default  # pylint: disable=import-outside-toplevel
  config = default.get_config()
  settings = model_settings(case.variant, case.residual, case.stack)
  for variant, values in settings.pop('attention_options').items():
    config.model.attention_options[variant].update(values)
  for group in ('stack_options', 'residual_options'):
    for key, value in settings.pop(group, {}).items():
      config.model[group][key] = value
  config.model.update(vocab_size=0, max_len=0, **{**settings, **model})
  return config


def _valid() -> list[Case]:
  out = []
  for variant, wiring, stack in itertools.product(product_variants(), residual.known(),
                                                   stack_settings()):
    try:
      out.append(Case(variant, wiring, stack, model_config(variant, wiring, stack)))
    except ValueError:
      continue
  return out


def _pairs(case: Case) -> set:
  return {('vb', case.variant, case.residual), ('vs', case.variant, case.stack),
          ('bs', case.residual, case.stack)}


def pairwise(cases: list[Case]) -> list[Case]:
  """A small subset of `cases` with every pair of components that `cases` has: each
  variant's baseline first, then greedily the case that covers most pairs not yet covered
  (ties: the first in registry order, so the choice is deterministic)."""
  chosen = [c for c in cases if (c.residual, c.stack) == BASELINE]
  covered = set().union(*map(_pairs, chosen)) if chosen else set()
  needed = set().union(*map(_pairs, cases))
  while covered != needed:
    best = max(cases, key=lambda c: len(_pairs(c) - covered))
    chosen.append(best)
    covered |= _pairs(best)
  return chosen


def one_each(cases: list[Case]) -> list[Case]:
  """Each variant's baseline, then for each other wiring and stack setting the first of
  `cases` that has it, on dense attention where the component accepts it: every component
  once, for the properties that cost a training run.

  Dense first: a component's case then costs what the component costs, and a fault in it is
  not mistaken for the variant's (the first variant in registry order is adaptive span, whose
  trims recompile the step: its gtrxl/universal case cost 49 s of the resume contract's
  299). Each variant's own state is its baseline's case; variant x component pairs are the
  pairwise set's (COVERING)."""
  chosen = [c for c in cases if (c.residual, c.stack) == BASELINE]
  ordered = ([c for c in cases if c.variant == BASELINE_VARIANT]
             + [c for c in cases if c.variant != BASELINE_VARIANT])
  for component in ('residual', 'stack'):
    for value in dict.fromkeys(getattr(c, component) for c in cases):
      if not any(getattr(c, component) == value for c in chosen):
        chosen.append(next(c for c in ordered if getattr(c, component) == value))
  return chosen


def component_cases(variants=('dense',)) -> dict[str, dict]:
  """'<wiring>_residual' and '<stack setting>_stack' -> dotted config keys, for each residual
  wiring other than pre_ln and each stack setting other than unrolled, on the first of
  `variants` that the wiring or stack accepts: the cases of the contract tests that build a
  run per case (a train step on several devices, the TPU programs), where one case per
  component is affordable."""
  out = {}
  for label, wiring, stack in ([(f'{w}_residual', w, BASELINE[1]) for w in residual.known()
                                if w != BASELINE[0]]
                               + [(f'{s}_stack', BASELINE[0], s) for s in stack_settings()
                                  if s != BASELINE[1]]):
    for variant in variants:
      try:
        model_config(variant, wiring, stack)
      except ValueError:
        continue
      settings = model_settings(variant, wiring, stack)
      keys = {'model.attention': variant, 'model.residual': wiring,
              'model.stack': settings['stack']}
      keys.update({f'model.{k}': v for k, v in stacks.get(settings['stack']).TEST_CONFIG.items()})
      keys.update({f'model.stack_options.{k}': v
                   for k, v in settings.get('stack_options', {}).items()})
      out[label] = keys
      break
  return out


def loop_slow_cases(cases: list[Case]) -> list[Case]:
  """The cases of `cases` that the contracts of the training loop (resume, host waits) run in
  the slow tier only: the baselines of the variants whose connectivity is a static pattern
  (the sparse patterns, local). Such a variant keeps no state outside its parameters and reads
  nothing back on the host, so in the loop it takes dense attention's path. Every other case
  stays in CI: dense, the variants with a state or a host read of their own
  (segment memory, adaptive span's trims, LSH's random stream, selective's budgets) and every
  residual wiring and stack."""
  from models.attention import traits  # pylint: disable=import-outside-toplevel
  return [c for c in cases if (c.residual, c.stack) == BASELINE and c.variant != BASELINE_VARIANT
          and traits.of(c.variant).has_static_pattern()]


ALL = _valid()
COVERING = pairwise(ALL)
ONE_EACH = one_each(COVERING)
LOOP_SLOW = loop_slow_cases(ONE_EACH)


def loop_params() -> list:
  """ONE_EACH as pytest params, the static-pattern baselines (loop_slow_cases) marked slow."""
  import pytest  # pylint: disable=import-outside-toplevel
  return [pytest.param(c, id=c.id, marks=[pytest.mark.slow] if c in LOOP_SLOW else [])
          for c in ONE_EACH]
