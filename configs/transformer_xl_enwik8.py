"""Transformer-XL at the paper's scale: enwik8, the 12-layer base model (Dai et al., 2019,
"Transformer-XL: Attentive Language Models Beyond a Fixed-Length Context", table 2: 1.06 bits
per character with 41M parameters). The mechanism is in ../shared/papers/the-transformer-
family.md; the base model's settings are those of the authors' released enwik8 base scripts
(kimiyoung/transformer-xl, run_enwik8_base.sh), which the paper's text does not list.
configs/transformer_xl_char.py is this model scaled down for a CPU; GTrXL's gated layer:
--config.model.residual=gtrxl.

At the paper's scale, on a TPU slice (compiled ahead of time from a CPU host by
`python -m benchmarks.tpu_compile --recipes transformer_xl_enwik8`, committed in
results/tpu_compile_recipes.json; `--mode=compile` prints the same report):
  slice:    v5e-4 (compile_topology 'v5e:2x2'), mesh data=2,tensor=2, remat 'none'
  memory:   1.95 GiB per chip of 16 GiB (the train step, by the TPU compiler's estimate)
  speed:    ~4,370,000 steps/day: a step of 19.8 ms, compute-bound, MFU 19% (FLOPs run: 42%)
            (the roofline estimate of the compiled step, not measured): 400,000 steps in ~0.091 days

  python main.py --config=configs/transformer_xl_enwik8.py --mode=compile --workdir=/tmp/txl
  python main.py --config=configs/transformer_xl_enwik8.py --workdir=gs://BUCKET/runs/txl \
      --config.data.files=gs://BUCKET/enwik8 --config.data.data_dir=gs://BUCKET/tfds
  # The evaluation with the longer memory (no retraining):
  python main.py --config=configs/transformer_xl_enwik8.py --workdir=gs://BUCKET/runs/txl \
      --mode=eval --config.eval_steps=0

Tiny, on a CPU (the same code and data path, on any text file):
  python main.py --config=configs/transformer_xl_enwik8.py --workdir=/tmp/txl_tiny --config.data.files=/path/to/enwik8 --config.model.n_layers=2 --config.model.d_model=64 --config.model.mlp_dim=128 --config.model.n_heads=2 --config.model.dtype=float32 --config.seq_len=64 --config.model.attention_options.txl.mem_len=64 --config.model.attention_options.txl.eval_mem_len=128 --config.model.attention_options.txl.clamp_len=0 --config.batch_size=4 --config.total_steps=20 --config.eval_steps=2 --config.mesh.data=-1 --config.mesh.tensor=1

Where this differs from the paper, and why:
  - Evaluation memory: the base scripts evaluate with a memory of 2,100 and clamp_len 820.
    The paper's "3,800 during evaluation" (section 4.1) is the 18- and 24-layer models'
    (attention length 784 in training); set eval_mem_len=3800 and clamp_len=1000 with them.
  - Block: the released code is Post-LN with ReLU; the zoo's backbone is Pre-LN with RMSNorm
    and SwiGLU (width 1,344: about the parameters of the 2,048-unit ReLU layer).
  - Optimizer: Adam in the scripts, the zoo's AdamW with no weight decay here (the scripts
    have none); the scripts' global-norm clip of 0.25 and cosine decay with no warm-up.
  - Batch: the scripts' 22 rows, split over data=2 x tensor=2 on the slice (22 is not a
    multiple of 4).
  - Speed estimate: a 41M-parameter model on 2,816 tokens per chip keeps no TPU chip busy;
    the roofline counts the attention to the 512-position memory and the relative term too
    (the MFU's model FLOPs leave them out), and finds the step compute-bound on the fused
    Pallas kernel. The layers are unrolled (see the stack below): scanned, the step wrote
    and read back stacked activations, 31.4 ms and 4.01 GiB per chip against 20.2 and 2.01.
"""

from configs import local_text


def get_config():
  """enwik8, 12 layers x 512, segments of 512 with a memory of 512."""
  config = local_text.get_config()
  config.data.packing = 'stream'        # Row r of consecutive batches continues one text.
  config.data.chunk_bytes = 1 << 20     # 1 MiB examples: 2,048 segments before a boundary.
  config.data.corpus = 'enwik8'

  config.model.attention = 'txl'
  config.model.position_embedding = 'none'  # Relative positions r_{i-j} inside the attention.
  config.model.d = 0
  config.model.n_layers = 12            # run_enwik8_base.sh: --n_layer 12
  config.model.d_model = 512            # --d_model 512
  config.model.n_heads = 8              # --n_head 8
  config.model.head_dim = 64            # --d_head 64
  config.model.mlp_dim = 1344           # --d_inner 2048 (ReLU; SwiGLU: see above)
  config.model.dropout_rate = 0.1       # --dropout 0.1 (--dropatt 0.0)
  config.model.vocab_size = 384         # 256 bytes + pad/bos/eos, padded to a multiple of 128.
  config.model.max_len = 0
  config.model.dtype = 'bfloat16'
  # The 12 layers unrolled, not scanned: a scan writes each layer's saved activations into
  # stacked buffers and reads them back (by the roofline 7.7 of the step's 25.4 ms of kernels
  # on the slice, with the step's memory 4.01 GiB per chip against 2.02 unrolled). A 41M
  # model compiles unrolled in 90 s.
  config.model.stack = 'unrolled'
  opts = config.model.attention_options.txl
  opts.mem_len = 512                    # --mem_len 512
  opts.eval_mem_len = 2100              # eval: --mem_len 2100
  opts.clamp_len = 820                  # eval: --clamp_len 820 (also in training: distances
                                        # beyond it share one encoding either way)

  config.seq_len = 512                  # --tgt_len 512
  config.batch_size = 22                # --batch_size 22
  config.total_steps = 400_000          # --max_step 400000
  config.learning_rate = 2.5e-4         # --optim adam --lr 0.00025
  config.warmup_steps = 0               # --warmup_step 0
  config.end_learning_rate_fraction = 0.0  # --scheduler cosine --eta_min 0.0
  config.clip_grad_norm = 0.25          # --clip 0.25
  config.weight_decay = 0.0             # Adam, no weight decay.
  config.log_every_steps = 200
  config.eval_every_steps = 4000
  config.eval_steps = 20
  config.checkpoint_every_steps = 4000

  # The slice (see the header).
  config.compile_topology = 'v5e:2x2'
  config.mesh.data = 2
  config.mesh.tensor = 2
  return config
