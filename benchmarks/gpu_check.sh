#!/usr/bin/env bash
# One prepared run on a lent GPU machine (about 8 minutes), from the repository root:
#   1. what attention_impl='auto' picks for each variant there, and one training run of the tiny
#      recipe in bf16 through main.py (the dispatch reads the mesh's platform: 'gpu');
#   2. the models tests (pytest-xdist; cpu_only tests skip themselves);
#   3. benchmarks/train_step.py (bf16, auto and cudnn), benchmarks/decode.py and
#      benchmarks/attention_scaling.py at 4K-16K with compile times, each under a time limit.
# Results go to $OUT (default /tmp/gpu_check). The GPU image has jax but neither tensorflow nor
# clu: carry clu and ml-collections as wheels in .whl/ (see the device notes); without
# tensorflow, clu's SummaryWriter is pointed at its PyTorch TensorBoard writer for this run only.
set -u
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
writer=$(python3 -c "import importlib.util as u; print(u.find_spec('clu').submodule_search_locations[0])")/metric_writers/summary_writer.py
python3 -c "import tensorflow" 2>/dev/null || cat > "$writer" <<'EOF'
"""Patched for a GPU check without tensorflow: TensorBoard events through PyTorch."""
from clu.metric_writers.torch_tensorboard_writer import TorchTensorboardWriter as SummaryWriter  # noqa
EOF
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
from training import train
for dtype in ('float32', 'bfloat16'):
  for name in [n for n in attention.known() if attention.get(n).__module__.startswith('models.')]:
    config = tiny.get_config()
    config.model.attention = name
    config.model.dtype = dtype
    config.model.position_embedding = 'none' if attention.get(name).RELATIVE_POSITIONS else 'learned'
    config.model.attention_options.mem_len = 0  # Transformer-XL without a stream.
    try:
      setup = train.build(config)
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
timeout 170 python3 -m pytest -q -n 16 -p no:cacheprovider tests/models > "$OUT/pytest_models.txt" 2>&1
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
  timeout 40 python3 benchmarks/attention_scaling.py --impls jax --iters 3 --n $n \
    --patterns strided local --out "$OUT/attention_scaling_gpu_$n.json" > "$OUT/scaling_$n.txt" 2>&1
  echo "rc $? at n=$n"; tail -6 "$OUT/scaling_$n.txt"
done
