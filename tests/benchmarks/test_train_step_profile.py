"""benchmarks/train_step_profile.py's reading of a trace (which part an operation is charged to,
nested events charged once) and benchmarks/train_step_peer.py's row where the peer is absent."""

import json
import subprocess
import sys

import pytest

from benchmarks import train_step_profile as profile
from tests.harness import REPO

pytestmark = pytest.mark.unit

STEP = 'jit(train_step)'


@pytest.mark.parametrize('op_name,expected', [
    (f'{STEP}/jvp(Decoder)/block_3/block_3.attention/attention/attention.attend/exp',
     ('attention', 'forward')),
    (f'{STEP}/transpose(jvp(Decoder))/block_0/block_0.attention/attention/attention.project/'
     'attention.fused_projection/dot_general', ('qkv/out proj', 'backward')),
    (f'{STEP}/jvp(Decoder)/block_1/block_1.attention/attention/attention.project_out/'
     'dot_general', ('qkv/out proj', 'forward')),
    (f'{STEP}/jvp(Decoder)/block_1/block_1.attention/attention/attention.project/q_norm/mul',
     ('attention', 'forward')),
    (f'{STEP}/transpose(jvp(Decoder))/block_2/block_2.mlp/mlp/dot_general',
     ('feed-forward', 'backward')),
    (f'{STEP}/jvp()/while/body/closed_call/bcd,dv->bcv/dot_general', ('logits + loss', 'forward')),
    (f'{STEP}/transpose(jvp(Decoder))/block_2/pre_mlp_norm/mul', ('embed + norms', 'backward')),
    (f'{STEP}/jvp(Decoder)/token_embed/jit(_take)/gather', ('embed + norms', 'forward')),
    (f'{STEP}/sqrt', ('optimizer', '')),
])
def test_each_operation_is_charged_to_its_part(op_name, expected):
  assert profile.part_of(op_name) == expected


def test_instruction_sources_read_the_op_name_of_each_instruction():
  hlo = '\n'.join([
      '  %fusion.3 = f32[8,512]{1,0} fusion(%p0), kind=kLoop, calls=%fused_computation.3, '
      f'metadata={{op_name="{STEP}/jvp(Decoder)/final_norm/mul" source_file="x.py"}}',
      '  ROOT %dot.7 = f32[8,8]{1,0} dot(%a, %b), metadata={op_name="' + STEP + '/sqrt"}',
      '  %copy.1 = f32[8]{0} copy(%c)'])
  assert profile.instruction_sources(hlo) == {
      'fusion.3': f'{STEP}/jvp(Decoder)/final_norm/mul', 'dot.7': f'{STEP}/sqrt'}


def test_an_event_inside_another_of_its_thread_is_charged_once():
  sources = {'while.1': f'{STEP}/jvp()/while', 'fusion.2': f'{STEP}/jvp()/while/body/exp',
             'fusion.9': f'{STEP}/sqrt'}
  events = [
      {'name': 'while.1', 'ts': 0.0, 'dur': 1000.0, 'pid': 1, 'tid': 1},
      {'name': 'fusion.2', 'ts': 100.0, 'dur': 200.0, 'pid': 1, 'tid': 1},   # In the loop.
      {'name': 'fusion.2', 'ts': 100.0, 'dur': 300.0, 'pid': 1, 'tid': 2},   # Another thread.
      {'name': 'fusion.9', 'ts': 1500.0, 'dur': 500.0, 'pid': 1, 'tid': 1},
      {'name': 'ThreadpoolListener', 'ts': 0.0, 'dur': 9000.0, 'pid': 1, 'tid': 1},
  ]
  totals, _ = profile.split(events, sources, steps=2)
  assert totals == {('logits + loss', 'forward'): (1000.0 + 300.0) / 1e3 / 2,
                    ('optimizer', ''): 500.0 / 1e3 / 2}


def test_the_peer_row_says_what_is_missing_without_torch():
  proc = subprocess.run(
      [sys.executable, '-c', 'import sys; sys.modules["torch"] = None\n'
       'from benchmarks import train_step_peer\n'
       'sys.argv = ["x"] + "--d_model 64 --depth 1 --heads 1 --head_dim 64 --mlp_dim 192 '
       '--vocab 32 --seq_len 8 --batch 1 --iters 1".split()\n'
       'train_step_peer.main()'],
      cwd=REPO, capture_output=True, text=True, check=False)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert json.loads(proc.stdout.strip().splitlines()[-1]) == {'missing': 'torch'}
