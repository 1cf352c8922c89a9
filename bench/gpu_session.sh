#!/usr/bin/env bash
# Every GPU check of the project in one run, for a session lent the device machine (15 minutes
# of device time in all, a machine's start included: one call, each step under its own limit).
#
#   bash bench/gpu_session.sh --prepare   here, once: torchao's wheel into .gpu/ (git ignores it;
#                                          the GPU image has torch, triton, pytest, rich, not torchao)
#   run(command="bash bench/gpu_session.sh", carry=[".gpu"], timeout_s=570)
#
# Each step's output goes to $OUT (what the device tool brings back), one file a step, and a
# line per step to stdout: its exit status and seconds. A step past its limit is stopped and
# the next one runs. Without a GPU (here) the CUDA tests skip and the benchmarks say so: a dry
# run of the plumbing.
set -u
cd "$(dirname "$0")/.."
TORCHAO=0.18.0

if [ "${1:-}" = "--prepare" ]; then
    mkdir -p .gpu/wheels
    python -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
        -d .gpu/wheels "torchao==$TORCHAO"
    ls -l .gpu/wheels
    exit
fi

OUT=${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/ampaudit-gpu.XXXXXX")}
mkdir -p "$OUT"
SITE=$(mktemp -d "${TMPDIR:-/tmp}/ampaudit-site.XXXXXX")
if ls .gpu/wheels/*.whl >/dev/null 2>&1; then  # offline: the machine reaches nothing outside
    python -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --no-deps --no-index --target "$SITE" \
        .gpu/wheels/*.whl || echo "torchao: install failed (tests/test_fp8_cuda.py will skip)"
fi
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"

step() {  # step NAME LIMIT_S COMMAND...: one check, its output to $OUT/NAME.txt
    local name=$1 limit=$2 start rc
    shift 2
    start=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.txt" 2>&1
    rc=$?
    echo "$name: exit $rc in $(($(date +%s) - start)) s$([ $rc = 124 ] && echo " (stopped at ${limit} s)")"
}

nvidia-smi >"$OUT/env.txt" 2>&1
python -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__,
'triton', triton.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA')" 2>&1 \
    | tail -n 1 | tee -a "$OUT/env.txt"
python -c "import torchao; print('torchao', torchao.__version__)" 2>>"$OUT/env.txt" | tee -a "$OUT/env.txt"

# the correctness checks first: one process each, pytest's workers off (one GPU)
step watch_cuda 120 python -m pytest -q -s -n 0 -p no:cacheprovider tests/test_watch_cuda.py
step fp8_cuda 120 python -m pytest -q -s -n 0 -p no:cacheprovider tests/test_fp8_cuda.py
# then the timings docs/benchmarks.md waits for
step watch_gpu 150 python bench/watch_gpu.py --rounds 3
step convert_speed 120 python bench/convert_speed.py --steps 10
echo "outputs: $OUT"
