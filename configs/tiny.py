"""CPU default: a d=2 model on the paper's Variable Assignment task; learns in CPU minutes.

Scaled down from appendix A.1 (3 variables, 1,000 values, 128 assignments, d=3): 16 values
and 4 assignments, so a dense model drops well below chance (ln 16 = 2.77 nats) within a
few hundred steps on a laptop. Only the answer token is scored, so the batch is large.
With many assignments a dense model learns which values occur but not which came last
(with 8 assignments it stalls near 0.56 x chance after 600 steps): the difficulty the
paper's selective attention removes.
"""

from configs import default


def get_config():
  """Tiny Variable Assignment recipe."""
  config = default.get_config()
  config.model.d = 2
  config.model.vocab_size = 0           # 0 = the task's vocabulary, padded to a multiple of 128.
  config.model.max_len = 0              # 0 = the task's sequence length.
  config.model.dtype = 'float32'        # bf16 matmuls are slow on most CPUs.

  config.data.name = 'variable_assignment'
  config.data.num_variables = 3
  config.data.num_values = 16
  config.data.num_assignments = 4

  config.total_steps = 400
  config.batch_size = 256
  config.learning_rate = 0.005
  config.warmup_steps = 50
  config.log_every_steps = 50
  config.eval_every_steps = 100
  config.eval_steps = 4
  config.checkpoint_every_steps = 100
  return config
