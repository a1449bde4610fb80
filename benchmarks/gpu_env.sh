# Sourced by the GPU scripts (benchmarks/gpu_check.sh, gpu_long_context.sh): the GPU image has
# jax but neither tensorflow nor clu. clu and ml-collections come as wheels carried in .whl/
# (see the device notes), installed once under /tmp/site; without tensorflow, clu's
# SummaryWriter is pointed at its PyTorch TensorBoard writer for this machine only.
# main.py itself no longer imports clu (training/metrics.py writes event files with the
# tensorboard package alone); the shim stays for the earlier commits that --before runs.
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
if ls .whl/*.whl >/dev/null 2>&1; then
  [ -d /tmp/site/clu ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || return 1
  export PYTHONPATH=/tmp/site
fi
writer=$(python3 -c "import importlib.util as u; print(u.find_spec('clu').submodule_search_locations[0])")/metric_writers/summary_writer.py
python3 -c "import tensorflow" 2>/dev/null || cat > "$writer" <<'EOF'
"""Patched for a GPU check without tensorflow: TensorBoard events through PyTorch."""
from clu.metric_writers.torch_tensorboard_writer import TorchTensorboardWriter as SummaryWriter  # noqa
EOF
