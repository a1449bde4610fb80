"""Adaptive attention span at the paper's scale: enwik8, the small model with S = 8192
(Sukhbaatar et al., 2019, "Adaptive Attention Span in Transformers", section 4 and table 2;
../shared/papers/adaptive-attention-span.md). configs/adaptive_span_text8.py is the same
model on text8 (table 1); configs/adaptive_span_char.py is this model scaled down for a CPU.
The fixed-span baseline: --config.model.attention_options.adaptive_span.learned=False.

At the paper's scale, on a TPU slice (compiled ahead of time from a CPU host by
`python -m benchmarks.tpu_compile --recipes adaptive_span_enwik8`, committed in
results/tpu_compile_recipes.json; `--mode=compile` prints the same report):
  slice:    v5e-8 (compile_topology 'v5e:2x4'), mesh data=8, remat 'full'
  memory:   3.99 GiB per chip of 16 GiB (the train step, by the TPU compiler's estimate)
  speed:    ~553,000 steps/day: a step of 156 ms, compute-bound, MFU 3% (FLOPs run: 61%)
            (the roofline estimate of the compiled step, not measured): 900,000 steps in ~1.6 days

  python main.py --config=configs/adaptive_span_enwik8.py --mode=compile --workdir=/tmp/span
  python main.py --config=configs/adaptive_span_enwik8.py --workdir=gs://BUCKET/runs/span \
      --config.data.files=gs://BUCKET/enwik8 --config.data.data_dir=gs://BUCKET/tfds

enwik8 is the first 10^8 bytes of the English Wikipedia XML dump (the file `enwik8`, unzipped);
data.files names it and local_text cuts it 90M / 5M / 5M bytes into train / validation / test,
as the paper does.

Tiny, on a CPU (the same code and data path, on any text file):
  python main.py --config=configs/adaptive_span_enwik8.py --workdir=/tmp/span_tiny --config.data.files=/path/to/enwik8 --config.model.n_layers=2 --config.model.d_model=64 --config.model.mlp_dim=128 --config.model.n_heads=2 --config.model.dtype=float32 --config.model.remat=none --config.seq_len=64 --config.model.attention_options.adaptive_span.limit=128 --config.batch_size=4 --config.total_steps=20 --config.eval_steps=2

Where this differs from the paper, and why:
  - Optimizer. The paper: Adagrad, lr 0.07 (fixed after a 32K-step linear warm-up), batch 64,
    each module's gradient clipped at 0.03. The zoo trains every variant with AdamW and
    warm-up + cosine decay (one backbone, one optimizer): lr 1e-3 (a usual AdamW rate for a
    12 x 512 model; not tuned here) after the paper's 32K warm-up steps, global-norm
    clipping at 1.0.
  - Feed-forward. The paper's ReLU layer of 2,048 units; the zoo's SwiGLU of width 1,344 has
    about its parameters and FLOPs (2/3 of 2,048, to a multiple of 64).
  - Dropout. The paper: 0.3 on the attention weights and the ReLU activations; the zoo has
    residual dropout only, at the same rate.
  - Positions. The paper's learned relative embeddings; the zoo's adaptive-span attention
    has relative positions inside the attention (docs/adaptive_span.md).
  - Speed estimate: the compiled step attends all 8,704 keys (S = 8,192 cached + the
    segment: the trimmed span is unset at the start); the roofline estimate counts that
    program, so it is the start of a run. Once the spans are learned each layer computes
    only up to its trimmed span (314 on average in the paper's text8 model) and a step takes
    a fraction of this. MFU reads low because the model FLOPs count 512 keys per query.
"""

from configs import local_text


def get_config():
  """enwik8, the 12-layer model, S = 8192."""
  config = local_text.get_config()
  config.data.packing = 'stream'        # Row r of consecutive batches continues one text:
                                        # section 2.1 caches the previous segments (Dai et al.).
  config.data.chunk_bytes = 1 << 20     # 1 MiB examples: 2,048 segments before a boundary.
  config.data.corpus = 'enwik8'

  config.model.attention = 'adaptive_span'
  config.model.position_embedding = 'none'  # Relative positions inside the attention.
  config.model.d = 0
  config.model.n_layers = 12            # Section 4: "small models have 12 layers
  config.model.d_model = 512            # and a hidden size of d_h = 512,
  config.model.mlp_dim = 1344           # except for the feedforward ReLU layers, which have
                                        # 2048 units" (SwiGLU of the same size: see above).
  config.model.n_heads = 8              # "All models have 8 attention heads in each layer."
  config.model.vocab_size = 384         # 256 bytes + pad/bos/eos, padded to a multiple of 128
                                        # (what the data path gives; --mode=compile reads none).
  config.model.max_len = 0
  config.model.dtype = 'bfloat16'
  config.model.dropout_rate = 0.3       # "dropout with a rate of 0.3" (small models).
  opts = config.model.attention_options.adaptive_span
  opts.limit = 8192                     # Tables 1-2: S = 8192.
  opts.ramp = 32                        # "R = 32".
  opts.penalty = 0.5e-6                 # "lambda is reduced to 0.5 x 10^-6 when S = 8192".
  opts.init = 0.0                       # "z' ... is initialized to 0".
  opts.memory = True                    # Attend into the previous segments, up to S back.

  config.seq_len = 512                  # "a block of 512 consecutive characters".
  config.batch_size = 64                # "a batch size of 64".
  config.total_steps = 900_000          # "600K steps (900K steps when S = 8192)".
  config.warmup_steps = 32_000          # "32k warm-up steps".
  config.learning_rate = 1e-3           # AdamW (the paper's Adagrad: 0.07; see above).
  config.end_learning_rate_fraction = 0.0
  config.clip_grad_norm = 1.0           # The paper clips each module at 0.03 (Adagrad).
  config.log_every_steps = 100
  config.eval_every_steps = 10_000
  config.eval_steps = 50
  config.checkpoint_every_steps = 10_000

  # The slice (see the header): 8 rows per chip. On 4 chips the compiler needs 24.7 GiB of
  # temporaries per chip, even with remat: every layer attends 8,192 + 512 keys.
  config.compile_topology = 'v5e:2x4'
  config.mesh.data = -1
  config.model.remat = 'full'
  return config
