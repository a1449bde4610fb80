"""Selective attention at the paper's scale: C4 language modeling at d=12 (Leviathan et al.,
2024, "Selective Attention Improves Transformer", section 5). The paper's dense baseline is
the same model with --config.model.attention=dense.

At the paper's scale, on a TPU slice (compiled ahead of time from a CPU host by
`python -m benchmarks.tpu_compile --recipes selective_c4`, committed in
results/tpu_compile_recipes.json; `--mode=compile` prints the same report):
  slice:    v5e-4 (compile_topology 'v5e:2x2'), mesh data=4, remat 'full'
  memory:   4.12 GiB per chip of 16 GiB (the train step, by the TPU compiler's estimate)
  speed:    ~417,000 steps/day: a step of 207 ms, memory-bound, MFU 49% (FLOPs run: 62%)
            (the roofline estimate of the compiled step, not measured): 524,288 steps in ~1.3 days

  python main.py --config=configs/selective_c4.py --mode=compile --workdir=/tmp/sel_c4
  python main.py --config=configs/selective_c4.py --workdir=gs://BUCKET/runs/sel_c4 \
      --config.data.data_dir=gs://BUCKET/tensorflow_datasets

Tiny, on a CPU (the same code and data path; a prepared c4/en:3.0.1 under data_dir):
  python main.py --config=configs/selective_c4.py --workdir=/tmp/sel_c4_tiny --config.data.data_dir=$HOME/tensorflow_datasets --config.model.d=2 --config.model.dtype=float32 --config.seq_len=128 --config.batch_size=8 --config.total_steps=20 --config.eval_steps=2 --config.model.remat=none
"""

from configs import default


def get_config():
  """The paper's C4 model with selective attention."""
  # configs/default.py sets what section 5 gives: C4 with "a vocabulary of size 8K tokens
  # built with the SentencePiece tokenizer", "a batch size of 256 and a fixed context size
  # of 512", "AdamW ... beta1 = 0.9 and beta2 = 0.999 for a total of 524,288 steps", "cosine
  # decay and 1,000 linear warmup steps and a learning rate of 0.005"; Pre-LN, learned
  # positions, SwiGLU, QK normalization, no biases, RMSNorm. The paper does not state the
  # weight decay (the zoo's 0.1), gradient clipping (1.0), Adam's epsilon (1e-8), dropout
  # (none here) or the SwiGLU width (8/3 d_model). It trained on TPU v4.
  config = default.get_config()
  config.model.d = 12                   # Section 5: d = 12 (12 layers x 12 heads, width 768).
  config.model.attention = 'selective'  # Section 3; 'dense' is the paper's baseline.
  # The slice (see the header): the whole batch of 256 rows in one step on 4 chips, each
  # layer's activations recomputed in the backward pass.
  config.compile_topology = 'v5e:2x2'
  config.mesh.data = -1                 # Every chip data-parallel (98M parameters fit each).
  config.model.remat = 'full'
  return config
