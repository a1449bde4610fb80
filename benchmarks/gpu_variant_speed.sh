#!/usr/bin/env bash
# Every registered variant's train step on a lent GPU at 4K-16K (issue 47's table there), in one
# lease of at most 10 minutes, from the repository root; each part has its own time limit and
# every row is written to the JSON as it finishes, so a run cut off keeps what it measured:
#   1. benchmarks/variant_speed.py at 4096, 8192 and 16384 tokens a row (16K tokens a step:
#      batch 4, 2, 1), bf16, every variant and dense on the blocked engine, against dense;
#   2. the same for the variants whose step the span and Transformer-XL fixes changed, against an
#      earlier commit in the same run (alternating row by row). The device machine gets a copy
#      of the working tree, and the git history there is not to be relied on (one lease's copy
#      of .git stood at the session's first commit), so the earlier commit travels as a
#      checkout under .before/ (carry it), and GIT_COMMIT labels this tree:
#        echo /.before/ >> .git/info/exclude
#        mkdir -p .before/b39f426 && git archive b39f426 | tar -x -C .before/b39f426
# benchmarks/gpu_env.sh prepares clu and ml-collections (carry .whl/). Results go to $OUT
# (default /tmp/gpu_variant_speed): variant_speed_gpu.json, variant_speed_gpu_before.json and
# the logs; render the page with
#   python -m benchmarks.variant_speed --render --out results/variant_speed_gpu.json \
#     --doc docs/variant_speed_gpu.md
#   3. the fused Pallas kernel's Triton lowering (attention_impl='pallas', pallas_gpu.py) on
#      the variants it computes: first benchmarks/pallas_gpu_check.py (a one-layer model's
#      loss and gradients against 'blocksparse' at 1K, bf16; PALLAS_CHECK_S seconds), then
#      NAME@pallas rows beside part 1's dense (cuDNN in bf16) and engine rows: issue 68's bar
#      (dense at >= 85% of cuDNN's TFLOP/s, every learned variant >= 3x the engine at 16K).
#      No GPU has run the kernel yet. Its kernels compile to sm_90 cubins with triton 3.9.0
#      on a CPU (benchmarks/triton_sm90.py), but XLA compiles them with its own Triton: the
#      first lease may still find a compile error (a row then fails alone, with the log),
#      so run it alone:
#        GIT_COMMIT=... PART1_S=0 BEFORE= bash benchmarks/gpu_variant_speed.sh
# Settings (environment): SHAPES, VARIANTS (part 1's, default every one; dense always runs),
# BEFORE (a folder under .before/, '' to skip part 2), PALLAS (part 3's variants, '' to skip),
# PALLAS_SHAPES, PALLAS_CHECK_S and PART3_S (seconds),
# BEFORE_SHAPES, BEFORE_VARIANTS, PART1_S and PART2_S (seconds), ROW_S (seconds a row may take),
# GIT_COMMIT (this tree's commit: give it, git's answer there can be stale). Seen on an H200:
# a row takes about 20 s (a process, 8-16 s of compiling, the steps), so the 36 rows of part 1
# need about 720 s: a lease of 10 minutes runs SHAPES in two calls. The first lease (fb8d54a,
# docs/variant_speed_gpu.md) measured 4K and 16K; the next one:
#   GIT_COMMIT=... SHAPES=8192 BEFORE_SHAPES=4096 ROW_S=120 bash benchmarks/gpu_variant_speed.sh
# (b39f426 unrolls every block: its adaptive span at 8K did not get through build, compile and a
# first step in 40 s, so the comparison runs at 4K with a longer row limit.)
#   GIT_COMMIT=... SHAPES="4096 16384" VARIANTS=local_global BEFORE= \
#     bash benchmarks/gpu_variant_speed.sh      # local_global's per-layer cuDNN (510888e)
set -u
OUT=${OUT:-/tmp/gpu_variant_speed}
mkdir -p "$OUT"
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  source benchmarks/gpu_env.sh || exit 1
  export JAX_PLATFORMS=${JAX_PLATFORMS:-cuda}
fi
export PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2
PY=${PYTHON:-python3}
BEFORE=${BEFORE-.before/b39f426}

echo '== 1. every variant'
[ "${PART1_S:-400}" != 0 ] && timeout --signal=TERM --kill-after=10 "${PART1_S:-400}" "$PY" -m benchmarks.variant_speed \
  --shapes ${SHAPES:-4096 8192 16384} ${VARIANTS:+--attention $VARIANTS} --dtype bfloat16 \
  --iters 5 --timeout "${ROW_S:-90}" \
  --out "$OUT/variant_speed_gpu.json" --doc '' 2>&1 | tee "$OUT/variant_speed_gpu.log" \
  | grep -v 'oneDNN\|InitializeLog'
echo "part 1 rc ${PIPESTATUS[0]}"

if [ -n "$BEFORE" ]; then
  echo "== 2. against $BEFORE"
  timeout --signal=TERM --kill-after=10 "${PART2_S:-130}" "$PY" -m benchmarks.variant_speed \
    --before "$BEFORE" --shapes ${BEFORE_SHAPES:-8192} \
    --attention ${BEFORE_VARIANTS:-adaptive_span dynamic_span txl} --dtype bfloat16 --iters 5 \
    --timeout "${ROW_S:-90}" --out "$OUT/variant_speed_gpu_before.json" --doc '' 2>&1 \
    | tee "$OUT/variant_speed_gpu_before.log" | grep -v 'oneDNN\|InitializeLog'
  echo "part 2 rc ${PIPESTATUS[0]}"
fi

# Part 3: every variant of the kernel (selective's F through its state passes).
PALLAS=${PALLAS-dense strided fixed local block_local local_global adaptive_span dynamic_span txl selective}
if [ -n "$PALLAS" ]; then
  echo '== 3. the fused Pallas kernel (Triton)'
  timeout --signal=TERM --kill-after=10 "${PALLAS_CHECK_S:-150}" "$PY" -m benchmarks.pallas_gpu_check \
    --variants $PALLAS --out "$OUT/pallas_gpu_check.json" 2>&1 \
    | tee "$OUT/pallas_gpu_check.log" | grep -v 'oneDNN\|InitializeLog'
  echo "part 3 check rc ${PIPESTATUS[0]}"
  timeout --signal=TERM --kill-after=10 "${PART3_S:-400}" "$PY" -m benchmarks.variant_speed \
    --shapes ${PALLAS_SHAPES:-4096 16384} --attention $(printf '%s@pallas ' $PALLAS) \
    --dtype bfloat16 --iters 5 --timeout "${ROW_S:-90}" \
    --out "$OUT/variant_speed_gpu_pallas.json" --doc '' 2>&1 \
    | tee "$OUT/variant_speed_gpu_pallas.log" | grep -v 'oneDNN\|InitializeLog'
  echo "part 3 rc ${PIPESTATUS[0]}"
fi
