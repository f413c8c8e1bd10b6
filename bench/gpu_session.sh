#!/usr/bin/env bash
# One GPU session's checks, in one command (DEVELOPERS.md, "On a lent GPU"): install the
# carried wheels of what the GPU image lacks, run the gpu-marked tests, then bench/gpu_round.py.
# Everything it prints also goes to $OUT/gpu_session.log when $OUT is set.
#   bash bench/gpu_session.sh [gpu_round.py arguments...]
set -uo pipefail
cd "$(dirname "$0")/.."
LOG="${OUT:-/tmp}/gpu_session.log"
export PYTHONUNBUFFERED=1 NO_ALBUMENTATIONS_UPDATE=1
if [ -d .gpu-wheels ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .gpu-wheels/*.whl || exit 1
    export PYTHONPATH="/tmp/site:$PWD"
else
    export PYTHONPATH="$PWD"
fi
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
    echo "== gpu-marked tests"
    python3 -m pytest -q -m gpu -p no:cacheprovider tests/fl/test_cuda_graphs.py tests/utils/test_precision.py \
        tests/eval/test_metrics_torch.py tests/fl/test_concurrent_clients.py tests/data/test_data_pipeline.py \
        tests/fl/test_evaluator_loading.py --tb=short 2>&1 | tail -60
    echo "== bench/gpu_round.py $*"
    python3 bench/gpu_round.py "$@"
} 2>&1 | tee "$LOG"
