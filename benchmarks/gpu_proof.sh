#!/usr/bin/env bash
# The GPU proof of issue 47, as ONE prepared run of at most 8 minutes (docs/benchmarks.md, "On a GPU").
#
#     bash benchmarks/gpu_proof.sh            # from the repository root, on a machine with a CUDA GPU
#
# Needs a python with torch (a CUDA build) and the package's test dependencies (requirements-test.txt);
# the package is imported from this checkout (PYTHONPATH).  In order, each part under `timeout` and
# guarded, so that one part failing or running out of time never stops the others:
#   0. nvidia-smi, then the versions (python, torch, CUDA, NCCL, the commit);
#   1. every CUDA test: pytest -m '' (no marker deselects) -k 'cuda or gpu' over the test files that
#      mention cuda (tests marked `cuda`, CUDA parametrisations, tests named for CUDA or a GPU, such
#      as those that skip with skipif(not torch.cuda.is_available()));
#   2. benchmarks/device_modes.py on the first GPU (4 devices on it), then, with 2+ GPUs, one device
#      per GPU (--gpus all: the one-NCCL-reduce path);
#   3. the pipeline language model with 2 stages on CUDA (2 worker processes sharing the GPU) and the
#      same model trained in one process on that GPU.
# Everything goes to "${OUT:-benchmarks/results}/gpu-<date>/" (nvidia-smi's output first), and a short
# summary is printed at the end (also summary.txt there).  Knobs: PYTHON, GPU_PROOF_BUDGET (seconds
# for the whole run, default 465), PIPE_STEPS (default 600: the example's own run, which must beat
# the bigram).  Exits 1 if a part failed, else 0.

set -u

cd "$(dirname "$0")/.." || exit 1
PYTHON=${PYTHON:-$(command -v python || command -v python3)}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
BUDGET=${GPU_PROOF_BUDGET:-465}  # 8 minutes less the grace each timeout may add (-k 3) and the summary
STEPS=${PIPE_STEPS:-600}
START=$(date +%s)

day=$(date +%Y-%m-%d)
DIR="${OUT:-benchmarks/results}/gpu-$day"
[ -e "$DIR" ] && DIR="$DIR-$(date +%H%M%S)"  # a second run the same day keeps the first
mkdir -p "$DIR" || exit 1
SUMMARY="$DIR/summary.txt"
: >"$SUMMARY"
FAILED=0

note() {  # one line of the summary
    printf '%s\n' "$*" | tee -a "$SUMMARY"
}

# part NAME LOG LIMIT CMD...: run CMD under timeout (LIMIT seconds, or what is left of the budget),
# its output in LOG; record how it ended.  Never stops the script.
part() {
    local name=$1 log=$2 limit=$3
    shift 3
    local left=$((BUDGET - ($(date +%s) - START)))
    ((limit > left)) && limit=$left
    if ((limit < 15)); then
        note "$name: SKIPPED (${left}s of the budget left)"
        return 0
    fi
    echo "== $name (limit ${limit}s): $*" | tee "$log"
    local begun rc
    begun=$(date +%s)
    timeout -k 3 "$limit" "$@" >>"$log" 2>&1
    rc=$?
    local took=$(($(date +%s) - begun))
    if ((rc == 0)); then
        note "$name: ok (${took}s)"
    elif ((rc == 124 || rc == 137)); then
        note "$name: TIMED OUT after ${took}s (limit ${limit}s)"
        FAILED=1
    else
        note "$name: FAILED rc=$rc (${took}s)"
        FAILED=1
    fi
    return 0
}

# -- 0. the machine ---------------------------------------------------------------------------------
timeout 20 nvidia-smi >"$DIR/00-nvidia-smi.txt" 2>&1 || echo "(nvidia-smi failed: rc $?)" >>"$DIR/00-nvidia-smi.txt"
cat "$DIR/00-nvidia-smi.txt"
timeout 30 "$PYTHON" - >"$DIR/01-versions.txt" 2>&1 <<'EOF'
import platform, subprocess
import numpy, torch
print("python", platform.python_version(), "| numpy", numpy.__version__, "| torch", torch.__version__,
      "| CUDA", torch.version.cuda, "| available", torch.cuda.is_available(),
      "| GPUs", torch.cuda.device_count())
for i in range(torch.cuda.device_count()):
    print(f"cuda:{i}", torch.cuda.get_device_name(i))
try:
    from torch.cuda import nccl
    print("NCCL", nccl.version())
except Exception as exc:  # a build without NCCL
    print("NCCL: none", type(exc).__name__)
try:
    import zmq
    print("pyzmq", zmq.__version__)
except ImportError:
    print("pyzmq: MISSING (the cluster parts will fail)")
try:
    print("commit", subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                    text=True, timeout=10).stdout.strip() or "unknown")
except Exception:
    print("commit unknown (no git)")
EOF
cat "$DIR/01-versions.txt"
GPUS=$(timeout 30 "$PYTHON" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
note "gpu-proof $day: $(head -n 1 "$DIR/01-versions.txt"); results in $DIR"
if [ "${GPUS:-0}" -lt 1 ]; then
    note "no CUDA device visible to torch: the parts below will skip or fail"
fi

# -- 1. every CUDA test -----------------------------------------------------------------------------
mapfile -t FILES < <(grep -rl --include='test_*.py' 'cuda' tests | sort)  # torch.cuda, "cuda", mark.cuda
PYTEST=(-m pytest -p no:cacheprovider -m '' -k 'cuda or gpu' -ra --junitxml "$DIR/02-cuda-tests.xml")
if "$PYTHON" -c 'import xdist' 2>/dev/null; then
    PYTEST+=(-n 4 --dist loadfile)  # addopts says -n logical: 4 processes are enough to share one GPU
else
    PYTEST+=(-o 'addopts=')  # addopts' -n needs pytest-xdist
fi
if "$PYTHON" -c 'import pytest_timeout' 2>/dev/null; then
    PYTEST+=(--timeout 120)
fi
if ((${#FILES[@]} > 0)); then
    part "CUDA tests (${#FILES[@]} files)" "$DIR/02-cuda-tests.log" 170 "$PYTHON" "${PYTEST[@]}" "${FILES[@]}"
    tail -n 1 "$DIR/02-cuda-tests.log" | sed 's/^/    /' | tee -a "$SUMMARY"
else
    note "CUDA tests: none found under tests/"
    FAILED=1
fi

# -- 2. the device modes' benchmark -------------------------------------------------------------------
part "device_modes.py, 4 devices on 1 GPU" "$DIR/03-device-modes.log" 75 \
    "$PYTHON" benchmarks/device_modes.py --devices 4 --sizes 1,16,64 --repeat 20 --json "$DIR/03-device-modes.json"
grep -E '^ +[0-9.]+M ' "$DIR/03-device-modes.log" | sed 's/^/    /' | tee -a "$SUMMARY"
if [ "${GPUS:-0}" -ge 2 ]; then
    part "device_modes.py, one device per GPU ($GPUS GPUs)" "$DIR/04-device-modes-gpus.log" 60 \
        "$PYTHON" benchmarks/device_modes.py --devices "$GPUS" --gpus all --sizes 16,64 --repeat 10 \
        --json "$DIR/04-device-modes-gpus.json"
    grep -E '^ +[0-9.]+M ' "$DIR/04-device-modes-gpus.log" | sed 's/^/    /' | tee -a "$SUMMARY"
else
    note "device_modes.py on 2+ GPUs: not run (${GPUS:-0} GPU here)"
fi

# -- 3. the pipeline language model on the GPU ----------------------------------------------------------
if [ -f examples/pipeline_lm.py ]; then
    part "pipeline LM, 2 stages on CUDA (launch.py -n 2 -s 1)" "$DIR/05-pipeline-2-stages.log" 120 \
        "$PYTHON" launch.py -n 2 -s 1 examples/pipeline_lm.py --stages 2 --device cuda --steps "$STEPS"
    tail -n 3 "$DIR/05-pipeline-2-stages.log" | sed 's/^/    /' | tee -a "$SUMMARY"
    part "pipeline LM, one process on CUDA" "$DIR/06-pipeline-one-process.log" 70 \
        "$PYTHON" examples/pipeline_lm.py --one-process --device cuda --steps "$STEPS"
    tail -n 3 "$DIR/06-pipeline-one-process.log" | sed 's/^/    /' | tee -a "$SUMMARY"
else
    note "pipeline LM: SKIPPED (examples/pipeline_lm.py is not in this checkout)"
fi

note "total $(($(date +%s) - START))s of ${BUDGET}s; logs in $DIR"
echo
echo "==== summary ===="
cat "$SUMMARY"
exit "$FAILED"
