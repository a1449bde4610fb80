"""Adaptive attention span at the paper's scale: text8, the small model with S = 8192
(Sukhbaatar et al., 2019, section 4 and table 1: 1.11 bits per character on test). The model
and the training are configs/adaptive_span_enwik8.py's (the paper uses the same settings for
both datasets); only the corpus differs. text8 is the first 10^8 characters of Wikipedia
cleaned to lower-case letters and spaces (the file `text8`), cut 90M / 5M / 5M.

At the paper's scale, on a TPU slice (compiled ahead of time from a CPU host by
`python -m benchmarks.tpu_compile --recipes adaptive_span_text8`, committed in
results/tpu_compile_recipes.json; `--mode=compile` prints the same report):
  slice:    v5e-8 (compile_topology 'v5e:2x4'), mesh data=8, remat 'full'
  memory:   3.99 GiB per chip of 16 GiB (the train step, by the TPU compiler's estimate)
  speed:    ~553,000 steps/day: a step of 156 ms, compute-bound, MFU 3% (FLOPs run: 61%)
            (the roofline estimate of the compiled step, not measured): 900,000 steps in ~1.6 days

  python main.py --config=configs/adaptive_span_text8.py --mode=compile --workdir=/tmp/span8
  python main.py --config=configs/adaptive_span_text8.py --workdir=gs://BUCKET/runs/span8 \
      --config.data.files=gs://BUCKET/text8 --config.data.data_dir=gs://BUCKET/tfds

Tiny, on a CPU (the same code and data path, on any text file):
  python main.py --config=configs/adaptive_span_text8.py --workdir=/tmp/span8_tiny --config.data.files=/path/to/text8 --config.model.n_layers=2 --config.model.d_model=64 --config.model.mlp_dim=128 --config.model.n_heads=2 --config.model.dtype=float32 --config.model.remat=none --config.seq_len=64 --config.model.attention_options.adaptive_span.limit=128 --config.batch_size=4 --config.total_steps=20 --config.eval_steps=2
"""

from configs import adaptive_span_enwik8


def get_config():
  """text8, the 12-layer model, S = 8192."""
  config = adaptive_span_enwik8.get_config()
  config.data.corpus = 'text8'
  return config
