#!/usr/bin/env bash
# Long contexts on a lent GPU (about 3 minutes, from the repository root; the last section of
# benchmarks/gpu_check.sh; benchmarks/gpu_env.sh prepares clu, carry .whl/): the blocked attention
# paths are loops, so a long sequence compiles like a short one.
#   - benchmarks/train_step.py: the first train step (compile included) and the step time of a
#     d=2 model on one row of 4K and of 16K tokens, bf16, attention_impl='blocksparse', for
#     dense, strided, selective and adaptive span;
#   - benchmarks/attention_scaling.py at 16K: one layer's forward + backward, with compile time.
# Results go to $OUT (default /tmp/gpu_check).
set -u
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
source benchmarks/gpu_env.sh || exit 1
for n in 4096 16384; do
  timeout 80 python3 -m benchmarks.train_step --d 2 --seq_len $n --batch 1 --dtype bfloat16 \
    --impl blocksparse --iters 3 --attention dense strided selective adaptive_span \
    --out "$OUT/train_step_gpu_long_$n.json" > "$OUT/train_step_long_$n.txt" 2>&1
  echo "rc $? at n=$n"; tail -6 "$OUT/train_step_long_$n.txt"
done
timeout 45 python3 -m benchmarks.attention_scaling --impls jax --iters 3 --n 16384 \
  --patterns strided fixed local --out "$OUT/attention_scaling_gpu_16384.json" \
  > "$OUT/scaling_16384.txt" 2>&1
echo "rc $? at n=16384"; tail -6 "$OUT/scaling_16384.txt"
