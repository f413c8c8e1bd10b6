#!/usr/bin/env bash
# One GPU session's checks, in one command (DEVELOPERS.md, "On a lent GPU"): install the
# carried wheels of what the GPU image lacks, run the gpu-marked tests and bench/gpu_round.py.
# Everything it prints also goes to $OUT/gpu_session.log when $OUT is set.
#   [SESSION_TESTS=first|last|skip] bash bench/gpu_session.sh [gpu_round.py arguments...]
# SESSION_TESTS (default first) places the tests: a call that runs out of time still returns
# what came before, so the part that matters most to this call goes first.
set -uo pipefail
cd "$(dirname "$0")/.."
LOG="${OUT:-/tmp}/gpu_session.log"
TESTS="${SESSION_TESTS:-first}"
case "$TESTS" in first|last|skip) ;; *) echo "SESSION_TESTS must be first, last or skip, not '$TESTS'" >&2; exit 2;; esac
export PYTHONUNBUFFERED=1 NO_ALBUMENTATIONS_UPDATE=1
if [ -d .gpu-wheels ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .gpu-wheels/*.whl || exit 1
    export PYTHONPATH="/tmp/site:$PWD"
else
    export PYTHONPATH="$PWD"
fi
gpu_tests() {
    echo "== gpu-marked tests"
    # every test file with a gpu mark; the service and Flower tests are not among them
    python3 -m pytest -q -m gpu -p no:cacheprovider $(grep -rl "mark.gpu" tests --include='test_*.py' | sort) \
        --tb=short 2>&1 | tail -60
}
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
    [ "$TESTS" = first ] && gpu_tests
    echo "== bench/gpu_round.py $*"
    python3 bench/gpu_round.py "$@"
    [ "$TESTS" = last ] && gpu_tests
    true
} 2>&1 | tee "$LOG"
