"""Transformer-XL on bytes (Dai et al., 2019), scaled down for a CPU.

  python main.py --config=configs/transformer_xl_char.py --workdir=/tmp/txl \
      --config.data.files=/path/to/any.txt
  # Evaluate the same checkpoint with a 4x longer memory than training used:
  python main.py --config=configs/transformer_xl_char.py --workdir=/tmp/txl --mode=eval \
      --config.model.attention_options.txl.eval_mem_len=512
  # GTrXL's gated residual instead of Pre-LN (Parisotto et al., 2019):
  python main.py --config=configs/transformer_xl_char.py --workdir=/tmp/gtrxl \
      --config.model.residual=gtrxl

The paper's enwik8 base model is 12 layers x 512 wide, 8 heads, segments of 512 with a
memory of 512 (eval: 2100 with clamp_len 820 in the authors' scripts; 3800 is the 18- and
24-layer models'), Adam for 400K steps: configs/transformer_xl_enwik8.py. Here: 4 layers x 128,
4 heads of 32, segments of 128 bytes with M = 128 (each row streams one text; every layer
carries its inputs over the previous M bytes to the next batch), relative positions only,
AdamW.
"""

from configs import local_text


def get_config():
  """Byte-level Transformer-XL recipe."""
  config = local_text.get_config()
  config.data.packing = 'stream'        # Row r of consecutive batches continues one text.
  config.data.chunk_bytes = 1 << 16     # 64 KiB examples: 512 segments before a boundary.

  config.model.attention = 'txl'
  config.model.position_embedding = 'none'  # r_{i-j} inside the attention.
  config.model.d = 0
  config.model.d_model = 128
  config.model.n_heads = 4
  config.model.n_layers = 4
  opts = config.model.attention_options.txl
  opts.mem_len = 128                    # M.
  opts.eval_mem_len = 0                 # 0: M; a longer memory at eval needs no retraining.

  config.seq_len = 128
  config.batch_size = 16
  config.total_steps = 2000
  config.learning_rate = 0.002
  config.warmup_steps = 200
  config.log_every_steps = 50
  config.eval_every_steps = 500
  config.eval_steps = 20
  config.checkpoint_every_steps = 500
  return config
