"""Sparse Transformer at the paper's scale: enwik8 at context 12,288 with fixed attention
(Child et al., 2019, "Generating Long Sequences with Sparse Transformers", section 7.2 and
table 2: 0.99 bits per byte, against dense attention's 1.00 and strided attention's 1.13).
The pattern is ../shared/papers/fixed-factorized-attention.md; the other numbers are from the
paper itself (arXiv:1904.10509), which ../shared/papers does not hold. The comparisons:
--config.model.attention=strided, --config.model.attention=dense.

At the paper's scale, on a TPU slice (compiled ahead of time from a CPU host by
`python -m benchmarks.tpu_compile --recipes sparse_transformer_enwik8`, committed in
results/tpu_compile_recipes.json; `--mode=compile` prints the same report):
  slice:    v5e-4 (compile_topology 'v5e:2x2'), mesh data=4, remat 'full'
  memory:   6.43 GiB per chip of 16 GiB (the train step, by the TPU compiler's estimate)
  speed:    ~79,300 steps/day: a step of 1.09 s, memory-bound, MFU 65% (FLOPs run: 64%)
            (the roofline estimate of the compiled step, not measured): 36,622 steps in ~0.46 days

  python main.py --config=configs/sparse_transformer_enwik8.py --mode=compile --workdir=/tmp/st
  python main.py --config=configs/sparse_transformer_enwik8.py --workdir=gs://BUCKET/runs/st \
      --config.data.files=gs://BUCKET/enwik8 --config.data.data_dir=gs://BUCKET/tfds

Tiny, on a CPU (the same code and data path, on any text file):
  python main.py --config=configs/sparse_transformer_enwik8.py --workdir=/tmp/st_tiny --config.data.files=/path/to/enwik8 --config.model.n_layers=2 --config.model.d_model=64 --config.model.mlp_dim=128 --config.model.n_heads=2 --config.model.dtype=float32 --config.model.remat=none --config.seq_len=256 --config.model.attention_options.fixed.stride=16 --config.model.attention_options.fixed.summary=4 --config.batch_size=4 --config.total_steps=20 --config.eval_steps=2

Where this differs from the paper, and why:
  - Batch and learning rate: section 7.2 states neither. 16 rows of 12,288 bytes per step
    (196,608 tokens), and Adam's 0.00035, the one rate the paper gives (CIFAR-10, section
    7.1); the step count is the paper's 80 epochs of the 90M training bytes at that batch.
  - Feed-forward: the paper's GELU layer of 4 d = 2,048 units; the zoo's SwiGLU of width
    1,344 has about its parameters and FLOPs.
  - Positions: the paper's learned two-dimensional attention embeddings (row and column of a
    matrix of width l); the zoo's learned absolute table of 12,288 positions.
  - Mixed precision: the paper's fp16 activations with loss scaling; the zoo's bfloat16
    activations with float32 parameters (no scaling needed).
  - Speed estimate: the roofline counts the attention the compiled step computes (the splash
    kernel's non-empty blocks of the fixed pattern); the MFU's model FLOPs count the full
    causal attention (80% of this model's count at 12,288) and full remat recomputes the
    forward, which the MFU convention leaves out: the two happen to about cancel here.
"""

from configs import local_text


def get_config():
  """enwik8, 30 layers, fixed attention, context 12,288."""
  config = local_text.get_config()
  config.data.packing = 'concat'        # Chunks of the byte stream.
  config.data.corpus = 'enwik8'         # 7.2: "the first 90 million tokens" for training,
  config.data.validation_fraction = 0.05  # "the last 10 million for validation and test".
  config.data.test_fraction = 0.05
  config.data.chunk_bytes = 1 << 20

  config.model.attention = 'fixed'      # Table 2's best: "Sparse Transformer 95M (fixed)".
  config.model.d = 0
  config.model.n_layers = 30            # 7.2: "30-layer fixed Sparse Transformers
  config.model.n_heads = 8              # with 8 heads,
  config.model.d_model = 512            # d = 512,
  config.model.dropout_rate = 0.4       # and a dropout rate of 0.40" (5.4: at the end of each
                                        # residual addition, as the zoo's residual dropout).
  config.model.mlp_dim = 1344           # 5.2: a 4 d = 2,048 GELU layer (SwiGLU: see above).
  opts = config.model.attention_options.fixed
  opts.stride = 128                     # 7.2: "a stride of 128,
  opts.summary = 32                     # c = 32,
  opts.factorization = 'merged'         # and merged the factorized attention heads".
  config.model.vocab_size = 384         # 256 bytes + pad/bos/eos, padded to a multiple of 128.
  config.model.max_len = 12_288
  config.model.dtype = 'bfloat16'

  config.seq_len = 12_288               # 7.2: "a context length of 12,288".
  config.batch_size = 16                # Not stated (see above).
  config.total_steps = 36_622           # 7.2: "80 epochs": 80 x 90M / (16 x 12,288).
  config.learning_rate = 3.5e-4         # Not stated for enwik8 (see above).
  config.warmup_steps = 5000            # 6: "a linear warmup of 5000 iterations
  config.clip_grad_norm = 1.0           # and a gradient clipping of 1.0";
  config.weight_decay = 0.01            # "a weight decay penalty of 0.01";
  config.end_learning_rate_fraction = 0.0  # "a cosine decay".
  config.log_every_steps = 100
  config.eval_every_steps = 2000
  config.eval_steps = 20
  config.checkpoint_every_steps = 2000

  # The slice (see the header). 5.4 recomputes attention and feed-forward in the backward
  # pass, as remat='full' does.
  config.compile_topology = 'v5e:2x2'
  config.mesh.data = -1
  config.model.remat = 'full'
  return config
