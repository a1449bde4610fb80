#!/usr/bin/env bash
# One prepared run on a lent GPU machine (at most 8 minutes; each part has its own time limit),
# from the repository root:
#   1. what attention_impl='auto' picks for each variant there, and one training run of the tiny
#      recipe in bf16 through main.py (the dispatch reads the mesh's platform: 'gpu');
#   2. benchmarks/train_step.py (bf16, auto and cudnn), benchmarks/decode.py and
#      benchmarks/attention_scaling.py at 4K-16K with compile times;
#   3. the model contract (every variant x block x stack setting: decode = forward, finite
#      gradients, prefill = steps) and tests/models, until the time limit (SIGINT: pytest still
#      prints what failed so far); cpu_only tests skip themselves.
# Logs and JSON go to $WORK (default /tmp/gpu_check); after each part they are packed into
# $OUT/gpu_check.tgz, so a run cut off keeps what it finished (the device tool returns at most 8
# files). benchmarks/gpu_env.sh prepares clu (carry .whl/). benchmarks/gpu_long_context.sh has
# the long-context runs of the blocked paths.
set -u
OUT=${OUT:-/tmp/gpu_check}
WORK=${WORK:-/tmp/gpu_check_work}
mkdir -p "$OUT" "$WORK"
pack() { tar -czf "$OUT/gpu_check.tgz" -C "$WORK" . ; }
source benchmarks/gpu_env.sh || exit 1
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import jax, flax, optax, orbax.checkpoint as o; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, jax.devices())"
  git log -1 --format='commit %h %s' 2>/dev/null || true
} > "$WORK/device.txt" 2>&1
cat "$WORK/device.txt"

echo '== 1. dispatch'
timeout 40 python3 - > "$WORK/dispatch.txt" 2>&1 <<'EOF'
from configs import tiny
from models import attention, transformer
from training import assembly
for dtype in ('float32', 'bfloat16'):
  for name in [n for n in attention.known() if attention.get(n).__module__.startswith('models.')]:
    config = tiny.get_config()
    config.model.attention = name
    config.model.dtype = dtype
    config.model.position_embedding = 'none' if attention.traits.of(name).RELATIVE_POSITIONS else 'learned'
    config.model.attention_options.txl.mem_len = 0  # Transformer-XL without a stream.
    try:
      setup = assembly.build(config)
      print(dtype, name, setup.model_config.target, transformer.implementations(setup.model_config))
    except Exception as e:  # pylint: disable=broad-except
      print(dtype, name, 'ERROR', type(e).__name__, e)
EOF
grep -v -i 'warning\|tpu' "$WORK/dispatch.txt" | tail -24
timeout 50 python3 main.py --workdir=/tmp/gpu_tiny --config.total_steps=20 \
  --config.eval_every_steps=20 --config.checkpoint_every_steps=20 --config.model.dtype=bfloat16 \
  > "$WORK/main_tiny.txt" 2>&1
echo "main.py rc $?"
grep -E 'implementation per layer|first train step|step 20|rror' "$WORK/main_tiny.txt" | tail -8
pack

echo '== 2. benchmarks'
for impl in auto cudnn; do
  timeout 50 python3 -m benchmarks.train_step --dtype bfloat16 --impl $impl --batch 16 \
    --out "$WORK/train_step_gpu_bf16_$impl.json" > "$WORK/train_step_$impl.txt" 2>&1
  echo "train_step $impl rc $?"; tail -4 "$WORK/train_step_$impl.txt"
done
pack
timeout 110 python3 -m benchmarks.decode --depths 4 --batches 1,8 --variants dense,strided,local \
  --new 128 --out "$WORK/decode_gpu.json" > "$WORK/decode.txt" 2>&1
echo "decode rc $?"; tail -9 "$WORK/decode.txt"
pack
timeout 100 python3 -m benchmarks.attention_scaling --impls jax --iters 3 --n 4096 8192 16384 \
  --patterns strided fixed local --out "$WORK/attention_scaling_gpu.json" \
  > "$WORK/scaling.txt" 2>&1
echo "attention_scaling rc $?"; grep -A20 '^pattern' "$WORK/scaling.txt" | tail -14
pack

echo '== 3. tests'
timeout -s INT -k 20 ${TEST_SECONDS:-120} python3 -m pytest -q -n 16 --dist load -p no:cacheprovider \
  -rf tests/contracts/test_model_contract.py tests/models > "$WORK/pytest.txt" 2>&1
echo "pytest rc $?"; grep -E '^(FAILED|ERROR)|passed|failed' "$WORK/pytest.txt" | tail -25
pack
