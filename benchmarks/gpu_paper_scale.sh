#!/usr/bin/env bash
# The synthetic headline claims at the papers' own size, in one lease of one GPU (10 minutes on
# an H100 or H200; from the repository root): Variable Assignment (selective attention A.1,
# 2 seeds), Copy and Parity (A.2), the Reformer's duplication task (table 2) and the Universal
# Transformer's copy (40 -> 400), each part with its own time limit; experiments/paper_scale.py
# does the work and its docstring says how the 10 minutes were shared out.
#
#   bash benchmarks/gpu_paper_scale.sh [OUT [WORK [paper_scale options...]]]
#
# OUT (default $OUT, else /tmp/paper_scale) receives three files: paper_scale.json (written
# after each part: RESULTS.md's paper-size lines are rendered from it; copy it to results/ and
# run `python -m experiments.render`), paper_scale_logs.tar.gz (the runs' TensorBoard events and
# configs and this log, packed after each part) and paper_scale.log. WORK (default
# /tmp/paper_scale_work) holds the training runs and the compilation cache, which do not come
# back. A lease cut short keeps every part that finished; rerunning resumes (finished parts are
# kept, finished runs reused).
#
# On the device tool: carry .whl (clu and ml-collections wheels, which benchmarks/gpu_env.sh
# installs: the GPU image has neither, nor tensorflow) and give it timeout_s=600:
#   bash benchmarks/gpu_paper_scale.sh "$OUT"
# CI runs this script at --profile tiny (tests/experiments/test_paper_scale.py), so it cannot
# rot between leases ($PYTHON: the interpreter, default python3):
#   bash benchmarks/gpu_paper_scale.sh /tmp/ps /tmp/ps_work --profile tiny
set -u
OUT=${1:-${OUT:-/tmp/paper_scale}}
WORK=${2:-/tmp/paper_scale_work}
shift $(( $# < 2 ? $# : 2 ))
mkdir -p "$OUT" "$WORK"
OUT=$(cd "$OUT" && pwd)
WORK=$(cd "$WORK" && pwd)
LOG="$OUT/paper_scale.log"
: > "$LOG"
export PYTHONUNBUFFERED=1 JAX_COMPILATION_CACHE_DIR="$WORK/jax_cache"
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$LOG"
  source benchmarks/gpu_env.sh || exit 1
fi
git log -1 --format='commit %h %s' 2>/dev/null | tee -a "$LOG"
# The parts' limits sum to 540 s (experiments/paper_scale.py); this backstop SIGTERMs the run
# (it writes what finished and exits) before the device tool's 600 s end the command.
timeout --signal=TERM --kill-after=10 "${PAPER_SCALE_TIMEOUT_S:-570}" \
  "${PYTHON:-python3}" -m experiments.paper_scale --out "$OUT/paper_scale.json" \
  --workdir "$WORK/runs" --logs "$LOG" "$@" 2>&1 \
  | grep --line-buffered -v 'oneDNN custom operations\|InitializeLog' | tee -a "$LOG"
rc=${PIPESTATUS[0]}
echo "paper_scale rc $rc" | tee -a "$LOG"
# Once more, with the log's last lines.
if [ -d "$WORK/runs" ]; then
  tar -czf "$OUT/paper_scale_logs.tar.gz" --exclude=checkpoints --exclude=.run.lock \
    -C "$WORK" runs -C "$OUT" paper_scale.log
fi
exit "$rc"
