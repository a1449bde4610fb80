"""The Reformer paper's duplication task (Kitaev et al., 2020, section 5), scaled down for a CPU.

  python main.py --config=configs/reformer_duplication.py --workdir=/tmp/dup_lsh1
  python main.py --config=configs/reformer_duplication.py --workdir=/tmp/dup_full \
      --config.model.attention=dense
  # The LSH model trained with 1 round, evaluated with 4:
  python main.py --config=configs/reformer_duplication.py --workdir=/tmp/dup_lsh1 --mode=eval \
      --config.model.attention_options.lsh.n_hashes=4

Rows are `0 w 0 w` (after BOS), w of L random symbols; only the second copy is scored, and
each of its tokens is the token L + 1 back, so a model must attend there. The paper: L = 511
(sequences of 1024), N = 127 symbols, a 1-layer model of d_model = d_ff = 256 with 4 heads,
150K steps (section 2.1; its chunk length for this task is not given). Here: L = 127
(sequences of 256), 32 symbols, a 1-layer model of d_model 128 with 4 heads of 32, LSH
chunks of 32 with 8 buckets (n / chunk_len, as in the paper: a bucket holds about one
chunk), learned absolute positions, float32.
"""

from configs import default


def get_config():
  """Duplication task with LSH attention."""
  config = default.get_config()
  config.model.d = 0
  config.model.d_model = 128
  config.model.n_heads = 4
  config.model.n_layers = 1
  config.model.vocab_size = 0           # The task's vocabulary, padded to a multiple of 128.
  config.model.max_len = 0              # The task's sequence length.
  config.model.dtype = 'float32'
  config.model.attention = 'lsh'
  opts = config.model.attention_options.lsh
  opts.n_buckets = 8
  opts.n_hashes = 1
  opts.chunk_len = 32

  config.data.name = 'duplication'
  config.data.num_symbols = 32
  config.data.dup_length = 127

  config.total_steps = 1500
  config.batch_size = 32
  config.learning_rate = 0.003
  config.warmup_steps = 100
  config.log_every_steps = 100
  config.eval_every_steps = 500
  config.eval_steps = 8
  config.checkpoint_every_steps = 500
  return config
