"""Selective attention at the paper's scale: Variable Assignment at d=3 (Leviathan et al.,
2024, "Selective Attention Improves Transformer", appendix A.1). The paper's baseline is the
same model with --config.model.attention=dense; configs/tiny.py is this task scaled down.

At the paper's scale, on a TPU slice (compiled ahead of time from a CPU host by
`python -m benchmarks.tpu_compile --recipes selective_variable_assignment`, committed in
results/tpu_compile_recipes.json; `--mode=compile` prints the same report):
  slice:    v5e-4 (compile_topology 'v5e:2x2'), mesh data=4, remat 'none'
  memory:   5.16 GiB per chip of 16 GiB (the train step, by the TPU compiler's estimate)
  speed:    ~1,780,000 steps/day: a step of 48.5 ms, memory-bound, MFU 15% (FLOPs run: 18%)
            (the roofline estimate of the compiled step, not measured): 65,536 steps in ~0.037 days

  python main.py --config=configs/selective_variable_assignment.py --mode=compile --workdir=/tmp/va
  python main.py --config=configs/selective_variable_assignment.py --workdir=gs://BUCKET/runs/va

A model of 1.8M parameters keeps no TPU chip busy: the roofline (the speed line) finds the
step memory-bound at a few percent of the peak; read it as the time a chip could reach, not
a prediction.

Tiny, on a CPU (the same code; the task is generated, no data to prepare):
  python main.py --config=configs/selective_variable_assignment.py --workdir=/tmp/va_tiny --config.model.d=1 --config.model.dtype=float32 --config.data.num_values=16 --config.data.num_assignments=8 --config.batch_size=32 --config.total_steps=20 --config.eval_steps=2
"""

from configs import default


def get_config():
  """Variable Assignment (3 variables, 1,000 values, 128 assignments) at d=3."""
  config = default.get_config()
  config.model.d = 3                    # A.1: "small transformers (d=3)".
  config.model.attention = 'selective'
  config.model.vocab_size = 0           # The task's vocabulary, padded to a multiple of 128.
  config.model.max_len = 0              # The task's sequence length.

  config.data.name = 'variable_assignment'
  config.data.num_variables = 3         # A.1: "3 variables,
  config.data.num_values = 1000         # 1,000 possible values,
  config.data.num_assignments = 128     # and 128 assignments".

  config.batch_size = 2048              # A.1: "a batch size of 2,048
  config.total_steps = 65_536           # for 65,536 steps".
  # The optimizer is section 5's (AdamW, beta2 0.999, lr 0.005, 1,000 warm-up steps, cosine
  # decay), as configs/default.py sets it: A.1 names no other.
  config.eval_every_steps = 4096
  config.eval_steps = 4
  config.checkpoint_every_steps = 4096

  # The slice (see the header): the whole batch in one step on one v5e host.
  config.compile_topology = 'v5e:2x2'
  config.mesh.data = -1
  return config
