#!/bin/bash
# Selective attention experiments of docs/selective_attention.md (CPU-sized).
#
#   bash experiments/selective.sh OUT_DIR TEXT_FILE
#
# 1. Variable Assignment (appendix A.1, scaled down: 3 variables, 16 values, 8 assignments):
#    dense vs selective, eval accuracy every 100 steps.
# 2. Byte-level LM on TEXT_FILE (e.g. tinyshakespeare): dense, selective, selective + L_mem
#    (eps 0.1) at equal steps; then, for both selective models, the greedy per-layer budgets
#    (C = 8) down to the dense model's validation loss and the loss with those budgets.
# Logs (with the periodic eval lines) go to OUT_DIR/<run>.log; final evals to
# OUT_DIR/<run>/eval_step_*.json; budgets to OUT_DIR/<run>/budgets.json and
# OUT_DIR/<run>/eval_budgets_step_*.json.
set -euo pipefail
OUT=$(realpath -m "${1:?usage: experiments/selective.sh OUT_DIR TEXT_FILE}")
TEXT=$(realpath "${2:?usage: experiments/selective.sh OUT_DIR TEXT_FILE}")
cd "$(dirname "$0")/.."
mkdir -p "$OUT"

VA="--config=configs/tiny.py --config.data.num_assignments=8 --config.total_steps=600"
for attn in dense selective; do
  python main.py $VA --workdir="$OUT/va_$attn" --config.model.attention=$attn \
      2>&1 | tee "$OUT/va_$attn.log"
done

LM="--config=configs/local_text.py --config.data.files=$TEXT --config.data.data_dir=$OUT/tfds
    --config.model.d=2 --config.seq_len=256 --config.batch_size=16 --config.total_steps=600
    --config.learning_rate=0.003 --config.warmup_steps=60 --config.log_every_steps=100
    --config.eval_every_steps=300 --config.eval_steps=20 --config.checkpoint_every_steps=300"
for run in lm_dense lm_selective lm_selective_lmem; do
  case $run in
    lm_dense) extra="--config.model.attention=dense" ;;
    lm_selective) extra="--config.model.attention=selective" ;;
    lm_selective_lmem) extra="--config.model.attention=selective
        --config.model.attention_options.selective_lmem_eps=0.1" ;;
  esac
  python main.py $LM --workdir="$OUT/$run" $extra 2>&1 | tee "$OUT/$run.log"
  python main.py $LM --workdir="$OUT/$run" $extra --mode=eval 2>&1 | tail -3
done
DENSE_LOSS=$(python -c "import json,sys; print(json.load(open(sys.argv[1]))['loss'])" \
    "$OUT/lm_dense/eval_step_600.json")
for run in lm_selective lm_selective_lmem; do
  extra=""
  [ "$run" = lm_selective_lmem ] && extra="--config.model.attention_options.selective_lmem_eps=0.1"
  python main.py $LM --workdir="$OUT/$run" --config.model.attention=selective $extra \
      --mode=allocate_budgets --config.pruning.target_loss="$DENSE_LOSS"
  python main.py $LM --workdir="$OUT/$run" --config.model.attention=selective $extra \
      --mode=eval_budgets
done
# The dense model trained 3x longer (how much of the gap is speed of learning):
python main.py $LM --workdir="$OUT/lm_dense_1800" --config.model.attention=dense \
    --config.total_steps=1800 --config.eval_every_steps=600 --config.checkpoint_every_steps=600 \
    2>&1 | tee "$OUT/lm_dense_1800.log"
