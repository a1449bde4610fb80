"""Adaptive attention span on bytes (Sukhbaatar et al., 2019), scaled down for a CPU.

  python main.py --config=configs/adaptive_span_char.py --workdir=/tmp/span \
      --config.data.files=/path/to/text8_or_any.txt
  python main.py --config=configs/adaptive_span_char.py --workdir=/tmp/span --mode=inspect
  # The fixed-span baseline with the same S (every head attends S bytes back):
  python main.py --config=configs/adaptive_span_char.py --workdir=/tmp/fixed \
      --config.model.attention_options.adaptive_span.learned=False

The paper's small model is 12 layers x 512 wide, 8 heads, S = 8192, 512-byte segments with
the previous segments cached, Adagrad for 600K steps. Here: 4 layers x 256, 8 heads of 32,
S = 1024 over 256-byte segments (each row streams one text; the memory of the last S inputs
of every layer is carried to the next batch), relative positions only, lambda = 2e-6 and
R = 32 as in the paper, AdamW. Metrics log each layer's mean and max span; --mode=inspect
plots the spans per head (figure 4) and reports the average span, attention FLOPs per token
and the decoding cache against a full-span model.
"""

from configs import local_text


def get_config():
  """Byte-level adaptive-span recipe."""
  config = local_text.get_config()
  config.data.packing = 'stream'        # Row r of consecutive batches continues one text.
  config.data.chunk_bytes = 1 << 16     # 64 KiB examples: 256 segments each before a boundary.

  config.model.attention = 'adaptive_span'
  config.model.position_embedding = 'none'  # Relative positions inside the attention (eq. 1).
  config.model.d = 0
  config.model.d_model = 256
  config.model.n_heads = 8
  config.model.n_layers = 4
  opts = config.model.attention_options.adaptive_span
  opts.limit = 1024                     # S.
  opts.ramp = 32                        # R.
  opts.penalty = 2e-6                   # lambda.
  opts.trim_multiple = 64               # Trimmed spans are multiples of this.
  opts.memory = True                    # Attend into the previous segments, up to S back.

  config.seq_len = 256
  config.batch_size = 16
  config.total_steps = 2000
  config.learning_rate = 0.002
  config.warmup_steps = 200
  config.log_every_steps = 50
  config.eval_every_steps = 500
  config.eval_steps = 20
  config.checkpoint_every_steps = 500
  return config
