"""Reformer at the paper's scale: enwik8-64K with LSH attention and reversible layers
(Kitaev et al., 2020, "Reformer: The Efficient Transformer", section 5: the 12-layer enwik8
model, "1.19 bits/dim after 20K steps" with dropout 0.1). The mechanisms are in
../shared/papers/the-transformer-family.md; the sizes are the paper's (arXiv:2001.04451),
which ../shared/papers does not hold. configs/reformer_duplication.py is the paper's
duplication task scaled down for a CPU; the full-attention comparison:
--config.model.attention=dense.

At the paper's scale, on a TPU slice (compiled ahead of time from a CPU host by
`python -m benchmarks.tpu_compile --recipes reformer_enwik8`, committed in
results/tpu_compile_recipes.json; `--mode=compile` prints the same report):
  slice:    v5e-8 (compile_topology 'v5e:2x4'), mesh data=8, remat 'none'
  memory:   10.54 GiB per chip of 16 GiB (the train step, by the TPU compiler's estimate)
  speed:    ~55,400 steps/day: a step of 1.56 s, memory-bound, MFU 225% (FLOPs run: 30%)
            (the roofline estimate of the compiled step, not measured): 20,000 steps in ~0.36 days

  python main.py --config=configs/reformer_enwik8.py --mode=compile --workdir=/tmp/reformer
  python main.py --config=configs/reformer_enwik8.py --workdir=gs://BUCKET/runs/reformer \
      --config.data.files=gs://BUCKET/enwik8 --config.data.data_dir=gs://BUCKET/tfds
  # More hash rounds at evaluation (section 5: more rounds help at eval; no retraining):
  python main.py --config=configs/reformer_enwik8.py --workdir=gs://BUCKET/runs/reformer \
      --mode=eval --config.model.attention_options.lsh.n_hashes=8

Tiny, on a CPU (the same code and data path, on any text file):
  python main.py --config=configs/reformer_enwik8.py --workdir=/tmp/reformer_tiny --config.data.files=/path/to/enwik8 --config.model.n_layers=2 --config.model.d_model=64 --config.model.mlp_dim=128 --config.model.n_heads=2 --config.model.dtype=float32 --config.seq_len=256 --config.model.max_len=256 --config.model.ff_chunk_len=64 --config.model.attention_options.lsh.chunk_len=32 --config.model.attention_options.lsh.n_buckets=16 --config.batch_size=2 --config.total_steps=20 --config.eval_steps=2

Where this differs from the paper, and why:
  - Optimizer: the paper's Adafactor (no settings given); the zoo's AdamW at the authors'
    released enwik8 configuration's peak rate, 0.03125 / sqrt(2,000) = 7e-4 after 2,000
    warm-up steps (google/trax reformer_enwik8.gin), with cosine decay.
  - Hashing: section 5 gives chunks of 128 and m = 2 l / n_buckets, hence 1,024 buckets at
    l = 65,536; it gives no round count for enwik8: 2 rounds in training (the released
    configuration's), more at evaluation (above).
  - Positions: the released configuration's axial embeddings; the zoo's sinusoidal positions
    (a learned table of 65,536 x 1,024 would be 67M parameters).
  - Feed-forward: the paper's ReLU layer of 4,096 units; the zoo's SwiGLU of width 2,752 has
    about its parameters and FLOPs, applied in chunks of 4,096 positions (section 3).
  - Speed estimate: the roofline counts what the compiled step computes (LSH: 2 rounds x 256
    keys per query); the MFU's model FLOPs count the full causal attention (92% of this
    model's count at 65,536, of which LSH computes about 1.6%), hence an MFU above 100%
    next to 29% of the peak in the FLOPs the step runs.
"""

from configs import local_text


def get_config():
  """enwik8-64K, 12 reversible layers of LSH attention, d_model 1024."""
  config = local_text.get_config()
  config.data.packing = 'concat'        # 5: "enwik8 ... chunked into subsequences of 2^16".
  config.data.corpus = 'enwik8'
  config.data.chunk_bytes = 1 << 20

  config.model.attention = 'lsh'
  config.model.residual = 'reversible'     # 3: reversible residual layers.
  config.model.position_embedding = 'sinusoidal'  # See above.
  config.model.d = 0
  config.model.n_layers = 12            # 5: "a 12-layer Reformer ... on enwik8".
  config.model.d_model = 1024           # 5: "All experiments have d_model = 1024,
  config.model.mlp_dim = 2752           # d_ff = 4096 (SwiGLU: see above),
  config.model.n_heads = 8              # n_heads = 8".
  config.model.ff_chunk_len = 4096      # 3: "Chunking" of the feed-forward.
  config.model.dropout_rate = 0.1       # 5: "dropout 0.1" (the 20K-step run).
  config.model.vocab_size = 384         # 256 bytes + pad/bos/eos, padded to a multiple of 128.
  config.model.max_len = 65_536
  config.model.dtype = 'bfloat16'
  opts = config.model.attention_options.lsh
  opts.chunk_len = 128                  # 5: "chunks of 128 tokens after hashing and sorting".
  opts.n_buckets = 1024                 # 2: m = 2 l / n_buckets, l = 65,536.
  opts.n_hashes = 2                     # See above.

  config.seq_len = 65_536               # 5: "subsequences of 2^16 = 64K tokens".
  config.batch_size = 8                 # 5: "a total batch size of 8 sequences".
  config.total_steps = 20_000           # 5: "after 20K steps".
  config.learning_rate = 7e-4           # See above.
  config.warmup_steps = 2000
  config.end_learning_rate_fraction = 0.0
  config.weight_decay = 0.0             # The released configuration: weight decay 0.
  config.loss_chunk_len = 1024
  config.log_every_steps = 50
  config.eval_every_steps = 1000
  config.eval_steps = 10
  config.checkpoint_every_steps = 1000
  config.generate.eval_samples = 0      # A 64K-token row leaves no room for samples.

  # The slice (see the header).
  config.compile_topology = 'v5e:2x4'
  config.mesh.data = -1
  return config
