"""Every experiment behind RESULTS.md, as data: what runs, with which arguments, what it writes.

`python -m experiments` (experiments/__main__.py) runs them; the claims (experiments/claims_*.py)
name the experiments their rows read, and RESULTS.md shows the command derived here, so a
command is written once. In `args`, {out} is the results folder and {text} the byte-level text
file; `quick` is appended by --quick: the same code at a tiny size, to check that every
experiment still runs (its numbers mean nothing).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Experiment:
  """One experiment: `python -m MODULE ARGS` writes `writes` into the results folder.

  Attributes:
    name: what `python -m experiments run NAME` and the claims call it.
    module: the module run with `python -m`.
    args: its arguments ({out}: the results folder, {text}: the text file).
    writes: the files under the results folder that the claims read.
    quick: arguments appended by --quick (a tiny size).
    text: whether it needs --text.
  """
  name: str
  module: str
  args: tuple[str, ...]
  writes: tuple[str, ...]
  quick: tuple[str, ...] = ()
  text: bool = False


_SELECTIVE = 'experiments.selective_experiments'
_SELECTIVE_QUICK = ('--seeds', '0', '--evals', '1', '--steps', '4', '--va_steps', '4',
                    '--va_batch', '16', '--test_batches', '1', '--d', '1', '--seq_len', '32',
                    '--batch_size', '2', '--eval_steps', '1', '--prune_batches', '1')

# In the order they run (`all`): the selective-attention language models first, since the
# ablations and the kv runs reuse their dense and selective runs.
EXPERIMENTS = (
    Experiment('adaptive_span_lm', 'experiments.adaptive_span_lm',
               ('--text', '{text}', '--workdir', '{out}/adaptive_span_lm_runs',
                '--out', '{out}/adaptive_span_lm.json'),
               ('adaptive_span_lm.json',),
               quick=('--seeds', '0', '--steps', '4', '--evals', '1', '--layers', '2',
                      '--heads', '2', '--d_model', '32', '--seq_len', '32', '--batch_size', '2',
                      '--span_limit', '32', '--eval_steps', '1', '--time_rounds', '1'),
               text=True),
    Experiment('adaptive_span', 'benchmarks.adaptive_span', ('--out', '{out}/adaptive_span.json'),
               ('adaptive_span.json',),
               quick=('--limit', '64', '--seq', '32', '--batch', '1', '--heads', '2',
                      '--head_dim', '16', '--block', '16', '--trims', '32', '64',
                      '--iters', '1')),
    Experiment('selective_va', _SELECTIVE,
               ('--part', 'va', '--workdir', '{out}/selective_runs',
                '--out', '{out}/selective_va.json'),
               ('selective_va.json',), quick=_SELECTIVE_QUICK),
    Experiment('selective_synthetic', _SELECTIVE,
               ('--part', 'synthetic', '--seeds', '0,1', '--workdir', '{out}/selective_runs',
                '--out', '{out}/selective_synthetic.json'),
               ('selective_synthetic.json',),
               quick=_SELECTIVE_QUICK + ('--syn_steps', '4', '--syn_batch', '4', '--copy_max',
                                         '4', '--parity_bits', '4', '--syn_d', '1')),
    Experiment('selective_lm', _SELECTIVE,
               ('--part', 'lm', '--text', '{text}', '--workdir', '{out}/selective_runs',
                '--out', '{out}/selective_lm.json'),
               ('selective_lm.json',), quick=_SELECTIVE_QUICK, text=True),
    Experiment('selective_ablations', _SELECTIVE,
               ('--part', 'ablations', '--text', '{text}', '--workdir', '{out}/selective_runs',
                '--out', '{out}/selective_ablations.json'),
               ('selective_ablations.json',), quick=_SELECTIVE_QUICK, text=True),
    Experiment('selective_kv', _SELECTIVE,
               ('--part', 'kv', '--contexts', '128,256,512', '--text', '{text}',
                '--workdir', '{out}/selective_runs', '--out', '{out}/selective_kv.json'),
               ('selective_kv.json',), quick=_SELECTIVE_QUICK + ('--contexts', '32'),
               text=True),
    Experiment('sparse_transformer', 'experiments.sparse_transformer',
               ('--text', '{text}', '--workdir', '{out}/sparse_transformer_runs',
                '--out', '{out}/sparse_transformer.json'),
               ('sparse_transformer.json',),
               quick=('--seeds', '0', '--steps', '4', '--evals', '1', '--d', '1',
                      '--seq_len', '64', '--batch_size', '2'),
               text=True),
    Experiment('attention_scaling', 'benchmarks.attention_scaling',
               ('--out', '{out}/attention_scaling.json'), ('attention_scaling.json',),
               quick=('--n', '256', '--iters', '1', '--impls', 'jax')),
    Experiment('txl', 'experiments.txl_experiment',
               ('--text', '{text}', '--steps', '600', '--out', '{out}/txl_exp',
                '--json', '{out}/txl_experiment.json', '--plot', '{out}/txl_curves.png'),
               ('txl_experiment.json',),
               quick=('--steps', '4', '--high_lrs', '0.02', '--eval_steps', '2'), text=True),
    Experiment('reformer_dup', 'experiments.reformer_experiment',
               ('--part', 'dup', '--out', '{out}/reformer_exp',
                '--json', '{out}/reformer_experiment.json',
                '--plot', '{out}/reformer_curves.png'),
               ('reformer_experiment.json',), quick=('--dup_steps', '4')),
    Experiment('reformer_bytes', 'experiments.reformer_experiment',
               ('--part', 'bytes', '--text', '{text}', '--out', '{out}/reformer_exp',
                '--json', '{out}/reformer_experiment.json',
                '--plot', '{out}/reformer_curves.png'),
               ('reformer_experiment.json',), quick=('--byte_steps', '4'), text=True),
    Experiment('lsh_scaling', 'benchmarks.lsh_scaling', ('--out', '{out}/lsh_scaling.json'),
               ('lsh_scaling.json',),
               quick=('--n', '256', '--hashes', '1', '--iters', '1')),
    Experiment('reversible_memory', 'benchmarks.reversible_memory',
               ('--ff_chunk_len', '0', '128', '--out', '{out}/reversible_memory.json'),
               ('reversible_memory.json',),
               quick=('--layers', '2', '4', '--d_model', '32', '--seq_len', '64',
                      '--iters', '1')),
    Experiment('universal', 'experiments.universal_experiment',
               ('--steps', '2000', '--out', '{out}/universal_exp',
                '--json', '{out}/universal_experiment.json', '--img', '{out}'),
               ('universal_experiment.json',), quick=('--steps', '4', '--tasks', 'copy')),
    Experiment('act_ponder', 'experiments.survey_act_ponder',
               ('--tasks', 'copy', '--workdir', '{out}/act_ponder_runs',
                '--out', '{out}/act_ponder.json'),
               ('act_ponder.json',), quick=('--steps', '4')),
    Experiment('universal_steps', 'benchmarks.universal_steps',
               ('--out', '{out}/universal_steps.json'), ('universal_steps.json',),
               quick=('--d_model', '32', '--seq', '32', '--batch', '1', '--iters', '1')),
)
_COMPARE_VARIANTS = ('dense,strided:stride=16,fixed:stride=32:summary=4,local:window=32,'
                     'block_local:local_block=32:block_memory=32,local_global:window=32,'
                     'adaptive_span:limit=256,dynamic_span:limit=256,lsh,selective,'
                     'txl,gtrxl,reformer,universal')

# The runs quoted on a docs/ page rather than in RESULTS.md (no row reads them): `run NAME`
# runs one, `all` runs them after EXPERIMENTS.
PAGES = (
    # docs/compare.md: every variant and preset side by side on the same bytes.
    Experiment('compare', 'experiments.compare',
               ('--variants', _COMPARE_VARIANTS, '--d', '2', '--steps', '400', '--evals', '8',
                '--config.data.files={text}', '--config.seq_len=256', '--config.batch_size=8',
                '--config.eval_steps=0', '--config.data.chunk_bytes=4096',
                '--workdir', '{out}/compare_runs', '--out', '{out}/compare.json',
                '--png', '{out}/compare_curves.png', '--no_progress'),
               ('compare.json',),
               quick=('--variants', 'dense,local:window=8,txl', '--d', '1', '--steps', '4',
                      '--evals', '1', '--time_rounds', '1', '--time_steps', '1',
                      '--config.seq_len=32', '--config.eval_steps=1'),
               text=True),
    # docs/selective_attention.md: Variable Assignment (600 steps, an eval every 100) and the
    # byte LM at batch 16 (600 steps, 20 validation batches; dense also 1,800), pruned with C = 8
    # on one training batch.
    Experiment('selective_docs', _SELECTIVE,
               ('--part', 'docs', '--va_steps', '600', '--evals', '6', '--steps', '600',
                '--batch_size', '16', '--eval_steps', '20', '--prune_batches', '1',
                '--text', '{text}', '--workdir', '{out}/selective_runs',
                '--out', '{out}/selective_docs.json'),
               ('selective_docs.json',), quick=_SELECTIVE_QUICK, text=True),
)
# The runs that need an accelerator (`run NAME` runs one; `all` does not): the paper-size
# lines of RESULTS.md's synthetic rows (experiments/paper_scale.py; on a lent GPU,
# benchmarks/gpu_paper_scale.sh runs it with the device's setup). --quick: its tiny profile.
DEVICE = (
    Experiment('paper_scale', 'experiments.paper_scale',
               ('--profile', 'device', '--out', '{out}/paper_scale.json',
                '--workdir', '{out}/paper_scale_runs'),
               ('paper_scale.json',), quick=('--profile', 'tiny')),
)
BY_NAME = {e.name: e for e in EXPERIMENTS + PAGES + DEVICE}
assert len(BY_NAME) == len(EXPERIMENTS) + len(PAGES) + len(DEVICE), \
    'experiment names must be unique'


def get(name: str) -> Experiment:
  """The experiment called `name`; a clear error for an unknown one."""
  if name not in BY_NAME:
    raise KeyError(f'unknown experiment {name!r}; known: {", ".join(BY_NAME)}')
  return BY_NAME[name]


def argv(experiment: Experiment, out: str, text: str = '', quick: bool = False) -> list[str]:
  """The arguments after `python -m MODULE` for a run into `out`."""
  if experiment.text and not text:
    raise ValueError(f'experiment {experiment.name!r} needs --text (a byte-level text file)')
  args = [a.format(out=out, text=text) for a in experiment.args]
  return args + list(experiment.quick if quick else ())


def command(*names: str) -> str:
  """The command that reruns `names` (as RESULTS.md shows it: OUT and TEXT are placeholders)."""
  text = any(get(n).text for n in names)
  return (f'python -m experiments run {" ".join(names)} --out OUT'
          + (' --text TEXT' if text else ''))
