"""Universal Transformer with ACT at the paper's task scale: copy, trained on strings of up to
40 symbols (Dehghani et al., 2019, "Universal Transformers", section 3.4 and table 4; ACT from
Graves, 2016). The recurrence and ACT are in ../shared/papers/the-transformer-family.md;
the task setting is the paper's (arXiv:1807.03819). configs/universal_algorithmic.py is this
recipe scaled down for a CPU and says how to run the baselines; docs/universal_transformer.md
has the experiment. Running parity instead of copy: --config.data.name=parity.

At the paper's scale, on a TPU slice (compiled ahead of time from a CPU host by
`python -m benchmarks.tpu_compile --recipes universal_transformer_algorithmic`, committed in
results/tpu_compile_recipes.json; `--mode=compile` prints the same report):
  slice:    v5e-4 (compile_topology 'v5e:2x2'), mesh data=4, remat 'none'
  memory:   1.19 GiB per chip of 16 GiB (the train step, by the TPU compiler's estimate)
  speed:    ~14,900,000 steps/day: a step of 5.78 ms, memory-bound, MFU 6% (FLOPs run: 8%)
            (the roofline estimate of the compiled step, not measured): 100,000 steps in ~0.0067 days

  python main.py --config=configs/universal_transformer_algorithmic.py --mode=compile \
      --workdir=/tmp/ut
  python main.py --config=configs/universal_transformer_algorithmic.py --workdir=gs://BUCKET/runs/ut
  # The paper's test: strings of up to 400 symbols (the universal stack's coordinates are
  # sinusoids, so any length evaluates):
  python main.py --config=configs/universal_transformer_algorithmic.py \
      --workdir=gs://BUCKET/runs/ut --mode=eval --config.data.max_length=400 --config.model.max_len=1024

A model of 0.3M parameters keeps no TPU chip busy: the roofline (the speed line) finds the
step memory-bound at a few percent of the peak, and its launch overheads are assumed ones:
read it as the time a chip could reach, not a prediction.

Tiny, on a CPU (the same code; the task is generated, no data to prepare):
  python main.py --config=configs/universal_transformer_algorithmic.py --workdir=/tmp/ut_tiny --config.model.d_model=32 --config.model.mlp_dim=64 --config.model.n_heads=2 --config.model.dtype=float32 --config.data.max_length=8 --config.model.max_len=32 --config.model.stack_options.max_steps=3 --config.batch_size=8 --config.total_steps=20 --config.eval_steps=2

What the paper gives and what it does not: section 3.4 gives the tasks (strings of decimal
symbols), training on length 40 and testing on 400, and positions with randomized offsets;
the model and optimizer settings of table 4 are not in the paper, and the zoo does not
randomize the position offsets. The sizes here are
tensor2tensor's universal-transformer 'tiny' settings (width 128, 4 heads, feed-forward 512,
8 steps) with its ACT defaults (halting threshold 1 - 0.01, ponder weight 0.01), all code
defaults, not settings the paper states; batch, steps and learning rate are the zoo's.
The zoo's copy task has 10 symbols (the decimal digits) and scores the copy; reverse and
addition are not implemented (input_pipeline/synthetic.py has copy and parity).
"""

from configs import default


def get_config():
  """Universal Transformer + ACT on copy, strings of up to 40 digits."""
  config = default.get_config()
  config.model.d = 0
  config.model.d_model = 128            # t2t universal_transformer_tiny: hidden_size 128,
  config.model.n_heads = 4              # num_heads 4,
  config.model.mlp_dim = 512            # filter_size 512 (SwiGLU here).
  config.model.n_layers = 0             # 0 = 1 for the universal stack (one shared layer).
  config.model.vocab_size = 0           # The task's vocabulary, padded to a multiple of 128.
  config.model.max_len = 128            # Longest row: 2 x 40 + 3 (no table: sinusoids).
  config.model.position_embedding = 'none'  # The universal stack's position + step sinusoid.
  config.model.stack = 'universal'
  config.model.stack_options.act = True
  config.model.stack_options.max_steps = 8  # t2t: num_rec_steps 8.
  config.model.stack_options.ponder = 0.01  # t2t: act_loss_weight 0.01.
  config.model.dtype = 'bfloat16'

  config.data.name = 'copy'
  config.data.num_symbols = 10          # 3.4: "strings composed of decimal symbols".
  config.data.max_length = 40           # 3.4: "we train the models on sequences of length 40".

  config.batch_size = 256               # The zoo's (not stated).
  config.total_steps = 100_000          # The zoo's (not stated).
  config.learning_rate = 1e-3           # The zoo's (not stated).
  config.warmup_steps = 1000
  config.log_every_steps = 200
  config.eval_every_steps = 5000
  config.eval_steps = 8
  config.checkpoint_every_steps = 5000

  # The slice (see the header).
  config.compile_topology = 'v5e:2x2'
  config.mesh.data = -1
  return config
