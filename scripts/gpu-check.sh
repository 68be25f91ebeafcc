#!/usr/bin/env bash
# GPU check of the CUDA tree-attention kernels and SDCC, for a machine with
# an NVIDIA GPU and no Rust toolchain: the treeattn binary is built here, with
#     cargo build --release --features cuda
# and carried (target/release/treeattn). One call, well under 8 minutes:
#   1. what the machine is (read-only nvidia-smi query; nothing is changed);
#   2. `treeattn gpu-check`: the kernel against an f64 reference on fresh
#      random packs (trees, forests with padding, varlen, causal, a GRPO fan;
#      GQA; d 64 and 128; bf16 and f16; outputs poisoned, every element
#      checked), then timings of tree packs against a causal run of the same
#      kernel and size (CUDA events, warm-up, median, inputs > L2); then the
#      backward (both dQ modes, rotary) and SDCC against the CPU backend,
#      forward+backward timed against causal and LogitTree's K+1 branch
#      passes, and SDCC fused against its unfused baseline;
#   3. optionally (GPU_CHECK_SANITIZE=1) a small run under compute-sanitizer
#      memcheck and racecheck;
#   4. the host-stream entries from their hosts, when scripts/gpu-build.sh
#      built them into target/gpu-carry (GPU_CARRY): the C program
#      capi/tests/c/device.c and python/tests/test_cuda.py with the cuda
#      wheel.
# The table is printed last. Logs also go to $OUT when it is set.
#
# Environment: TREEATTN_BIN (default target/release/treeattn), GPU_CHECK_ARGS
# (extra arguments for gpu-check, e.g. "--tokens 16384 --heads 16 --reps 50"),
# GPU_CHECK_SANITIZE=1.
set -uo pipefail
cd "$(dirname "$0")/.."

BIN=${TREEATTN_BIN:-target/release/treeattn}
LOG_DIR=${OUT:-$(mktemp -d)}
if [ ! -x "$BIN" ]; then
    echo "no treeattn binary at $BIN: build it with 'cargo build --release --features cuda' and carry it" >&2
    exit 2
fi

echo "== machine"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv 2>&1 | head -5
date -u

rc=0
if [ "${GPU_CHECK_SANITIZE:-0}" = "1" ] && command -v compute-sanitizer >/dev/null; then
    for tool in memcheck racecheck; do
        echo "== compute-sanitizer --tool $tool (small run)"
        timeout 120 compute-sanitizer --tool "$tool" --error-exitcode 3 \
            "$BIN" gpu-check --tokens 512 --heads 4 --reps 2 >"$LOG_DIR/sanitizer-$tool.log" 2>&1
        s=$?
        tail -5 "$LOG_DIR/sanitizer-$tool.log"
        [ $s -ne 0 ] && { echo "compute-sanitizer $tool: exit $s"; rc=1; }
    done
fi

echo "== treeattn gpu-check"
# shellcheck disable=SC2086
timeout 420 "$BIN" gpu-check ${GPU_CHECK_ARGS:-} 2>&1 | tee "$LOG_DIR/gpu-check.log"
s=${PIPESTATUS[0]}
[ $s -ne 0 ] && { echo "gpu-check: exit $s"; rc=1; }

# The host-stream entries, from the hosts that use them (built by
# scripts/gpu-build.sh into $CARRY; each section is skipped with a line
# when its artifact is absent, and its failure does not stop the others).
CARRY=${GPU_CARRY:-target/gpu-carry}
echo "== C host on the device (capi/tests/c/device.c: its context, memory and stream)"
if [ -x "$CARRY/capi-device" ]; then
    timeout 120 "$CARRY/capi-device" --require-gpu 2>&1 | tee "$LOG_DIR/capi-device.log"
    s=${PIPESTATUS[0]}
    [ $s -ne 0 ] && { echo "capi-device: exit $s"; rc=1; }
else
    echo "skipped: no $CARRY/capi-device (run scripts/gpu-build.sh and carry $CARRY)"
fi
echo "== torch op on CUDA tensors (python/tests/test_cuda.py, torch's current stream)"
wheel=$(ls "$CARRY"/treeattn-*.whl 2>/dev/null | head -1)
if [ -n "$wheel" ] && command -v python3 >/dev/null; then
    venv=$(mktemp -d)
    # The machine's torch, seen from a venv that adds only the wheel.
    python3 -m venv --system-site-packages "$venv"
    "$venv/bin/python" -c "import pytest" 2>/dev/null \
        || "$venv/bin/python" -m pip install --quiet --no-index --find-links "$CARRY/wheels" pytest
    "$venv/bin/python" -m pip install --quiet --no-deps --no-index "$wheel"
    (cd python/tests && timeout 300 "$venv/bin/python" -m pytest -q -p no:cacheprovider -rs test_cuda.py) \
        2>&1 | tee "$LOG_DIR/python-cuda.log"
    s=${PIPESTATUS[0]}
    [ $s -ne 0 ] && { echo "python test_cuda: exit $s"; rc=1; }
else
    echo "skipped: no wheel in $CARRY (run scripts/gpu-build.sh and carry $CARRY)"
fi
exit $rc
