#!/usr/bin/env bash
# One prepared run on a lent GPU machine (about 9 minutes), from the repository root:
#   1. what attention_impl='auto' picks for each variant there, and one training run of the tiny
#      recipe in bf16 through main.py (the dispatch reads the mesh's platform: 'gpu');
#   2. the models tests (pytest-xdist; cpu_only tests skip themselves);
#   3. benchmarks/train_step.py (bf16, auto and cudnn), benchmarks/decode.py and
#      benchmarks/attention_scaling.py at 4K-16K with compile times, each under a time limit;
#   4. long contexts on the blocked paths (loops: the program does not grow with n): the first
#      train step (compile included) and the step time of a d=2 model at 4K and 16K tokens.
# Results go to $OUT (default /tmp/gpu_check). benchmarks/gpu_env.sh prepares clu (carry .whl/).
set -u
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
source benchmarks/gpu_env.sh || exit 1
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
  git log -1 --format='commit %h %s' 2>/dev/null || true
} > "$OUT/device.txt" 2>&1
cat "$OUT/device.txt"

echo '== 1. dispatch'
timeout 60 python3 - > "$OUT/dispatch.txt" 2>&1 <<'EOF'
import jax
from configs import tiny
from models import attention, transformer
from training import assembly
for dtype in ('float32', 'bfloat16'):
  for name in [n for n in attention.known() if attention.get(n).__module__.startswith('models.')]:
    config = tiny.get_config()
    config.model.attention = name
    config.model.dtype = dtype
    config.model.position_embedding = 'none' if attention.get(name).RELATIVE_POSITIONS else 'learned'
    config.model.attention_options.mem_len = 0  # Transformer-XL without a stream.
    try:
      setup = assembly.build(config)
      print(dtype, name, setup.model_config.target, transformer.implementations(setup.model_config))
    except Exception as e:  # pylint: disable=broad-except
      print(dtype, name, 'ERROR', type(e).__name__, e)
EOF
cat "$OUT/dispatch.txt"
timeout 90 python3 main.py --workdir=/tmp/gpu_tiny --config.total_steps=20 \
  --config.eval_every_steps=20 --config.checkpoint_every_steps=20 --config.model.dtype=bfloat16 \
  > "$OUT/main_tiny.txt" 2>&1
grep -E 'implementation per layer|first train step|step 20|error' "$OUT/main_tiny.txt"

echo '== 2. tests/models'
timeout 130 python3 -m pytest -q -n 16 -p no:cacheprovider tests/models > "$OUT/pytest_models.txt" 2>&1
tail -15 "$OUT/pytest_models.txt"

echo '== 3. benchmarks'
for impl in auto cudnn; do
  timeout 60 python3 benchmarks/train_step.py --dtype bfloat16 --impl $impl --batch 16 \
    --out "$OUT/train_step_gpu_bf16_$impl.json" > "$OUT/train_step_$impl.txt" 2>&1
  tail -5 "$OUT/train_step_$impl.txt"
done
timeout 60 python3 benchmarks/decode.py --variants dense,strided,local --new 128 \
  --out "$OUT/decode_gpu.json" > "$OUT/decode.txt" 2>&1
tail -12 "$OUT/decode.txt"
for n in 4096 8192 16384; do
  timeout 45 python3 benchmarks/attention_scaling.py --impls jax --iters 3 --n $n \
    --patterns strided fixed local --out "$OUT/attention_scaling_gpu_$n.json" \
    > "$OUT/scaling_$n.txt" 2>&1
  echo "rc $? at n=$n"; tail -6 "$OUT/scaling_$n.txt"
done

echo '== 4. long contexts, blocked paths'
bash benchmarks/gpu_long_context.sh
