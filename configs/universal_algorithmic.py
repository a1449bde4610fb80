"""Universal Transformer with ACT on the embedded algorithmic tasks (Dehghani et al. 2019;
Graves 2016), scaled down for a CPU. docs/universal_transformer.md has the experiment.

  python main.py --config=configs/universal_algorithmic.py --workdir=/tmp/ut_act_copy
  # Running parity instead of copy:
  python main.py --config=configs/universal_algorithmic.py --workdir=/tmp/ut_act_parity \
      --config.data.name=parity
  # UT with T = 4 fixed steps (no halting):
  python main.py --config=configs/universal_algorithmic.py --workdir=/tmp/ut_fixed \
      --config.model.stack_options.act=False --config.model.stack_options.steps=4
  # The fixed-depth Pre-LN baseline of 4 distinct layers (equal compute to T = 4):
  python main.py --config=configs/universal_algorithmic.py --workdir=/tmp/pre_ln_4 \
      --config.model.stack=auto --config.model.n_layers=4 \
      --config.model.position_embedding=sinusoidal

One weight-shared Pre-LN block of width 64 (4 heads of 16), applied with ACT for up to
M = 8 steps, ponder cost τ = 0.01. The universal stack adds the sinusoid of the position and
of the step to the state before every step, so the model adds no positions of its own
(position_embedding='none'); the layered baselines use fixed sinusoid positions instead
('sinusoidal'), so that every model can be run on rows longer than it was trained on.
model.max_len (64) only bounds the evaluation lengths: neither has a position table.

Tasks (input_pipeline/synthetic.py): 'copy' (`BOS s_1..s_L SEP s_1..s_L EOS`, L uniform in
1..10 here, 16 symbols; the copy and EOS are scored) and 'parity' (running parity of
data.num_bits = 12 bits, scored at every parity token).
"""

from configs import default


def get_config():
  """Universal Transformer + ACT on the copy task."""
  config = default.get_config()
  config.model.d = 0
  config.model.d_model = 64
  config.model.n_heads = 4
  config.model.n_layers = 0             # 0 = 1 for the universal stack.
  config.model.vocab_size = 0           # The task's vocabulary, padded to a multiple of 128.
  config.model.max_len = 64             # Longest evaluation row (no table: see above).
  config.model.dtype = 'float32'        # bf16 matmuls are slow on most CPUs.
  config.model.position_embedding = 'none'  # The universal stack's coordinates carry positions.
  config.model.stack = 'universal'
  config.model.stack_options.act = True
  config.model.stack_options.steps = 4
  config.model.stack_options.max_steps = 8
  config.model.stack_options.ponder = 0.01

  config.data.name = 'copy'
  config.data.num_symbols = 16
  config.data.max_length = 10
  config.data.num_bits = 12

  config.total_steps = 1000
  config.batch_size = 64
  config.learning_rate = 0.003
  config.warmup_steps = 100
  config.log_every_steps = 50
  config.eval_every_steps = 0
  config.eval_steps = 4
  config.checkpoint_every_steps = 1000
  return config
