#!/usr/bin/env bash
# Reruns every experiment behind RESULTS.md into OUT, then renders OUT/RESULTS.md from the
# JSON they wrote (experiments/render.py). A few hours on 2 CPU cores; each step is one row
# group's command, so one step can be rerun alone (a finished training run is reused).
#
#   bash experiments/all.sh OUT [TEXT]     # TEXT: a byte-level text file
#                                          # (default ../shared/data/tinyshakespeare.txt)
set -euo pipefail
OUT=$(realpath -m "${1:?usage: bash experiments/all.sh OUT [TEXT]}")
cd "$(dirname "$0")/.."
TEXT=$(realpath "${2:-../shared/data/tinyshakespeare.txt}")
mkdir -p "$OUT"
run() {  # A step: its command line, logged to OUT/logs/<name>.log.
  local name=$1; shift
  mkdir -p "$OUT/logs"
  echo "[$(date +%H:%M:%S)] $name: $*"
  "$@" > "$OUT/logs/$name.log" 2>&1 || { echo "$name failed: see $OUT/logs/$name.log"; exit 1; }
}

# Adaptive attention span.
run adaptive_span_lm python experiments/adaptive_span_lm.py --text "$TEXT" \
    --out "$OUT/adaptive_span_lm.json"
run adaptive_span python benchmarks/adaptive_span.py --out "$OUT/adaptive_span.json"
# Selective attention (lm first: ablations and kv at 256 reuse its dense and selective runs).
SEL="python experiments/selective_experiments.py --workdir $OUT/selective_runs"
run selective_va $SEL --part va --out "$OUT/selective_va.json"
run selective_lm $SEL --part lm --text "$TEXT" --out "$OUT/selective_lm.json"
run selective_ablations $SEL --part ablations --text "$TEXT" --out "$OUT/selective_ablations.json"
run selective_kv $SEL --part kv --contexts 128,256,512 --text "$TEXT" \
    --out "$OUT/selective_kv.json"
# Sparse Transformer.
run sparse_transformer python experiments/sparse_transformer.py --text "$TEXT" \
    --workdir "$OUT/sparse_transformer_runs" --out "$OUT/sparse_transformer.json"
run attention_scaling python benchmarks/attention_scaling.py --out "$OUT/attention_scaling.json"
# The Transformer family: Transformer-XL / GTrXL, Reformer, Universal Transformer.
run txl python benchmarks/txl_experiment.py --text "$TEXT" --steps 600 --out "$OUT/txl_exp" \
    --json "$OUT/txl_experiment.json" --plot "$OUT/txl_curves.png"
run reformer_dup python benchmarks/reformer_experiment.py --part dup --out "$OUT/reformer_exp" \
    --json "$OUT/reformer_experiment.json" --plot "$OUT/reformer_curves.png"
run reformer_bytes python benchmarks/reformer_experiment.py --part bytes --text "$TEXT" \
    --out "$OUT/reformer_exp" --json "$OUT/reformer_experiment.json" \
    --plot "$OUT/reformer_curves.png"
run lsh_scaling python benchmarks/lsh_scaling.py --out "$OUT/lsh_scaling.json"
run reversible_memory python benchmarks/reversible_memory.py --ff_chunk_len 0 128 \
    --out "$OUT/reversible_memory.json"
run universal python benchmarks/universal_experiment.py --steps 2000 --out "$OUT/universal_exp" \
    --json "$OUT/universal_experiment.json" --img "$OUT"
run act_ponder python experiments/survey_act_ponder.py --tasks copy \
    --workdir "$OUT/act_ponder_runs" --out "$OUT/act_ponder.json"
run universal_steps python benchmarks/universal_steps.py --out "$OUT/universal_steps.json"

python experiments/render.py --results "$OUT" --out "$OUT/RESULTS.md"
