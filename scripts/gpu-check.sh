#!/usr/bin/env bash
# GPU check of the CUDA tree-attention kernels and SDCC, for a machine with
# an NVIDIA GPU and no Rust toolchain: the treeattn binary is built here, with
#     cargo build --release --features cuda
# and carried (target/release/treeattn). One call, under 10 minutes:
#   1. what the machine is (read-only nvidia-smi query; nothing is changed);
#   2. `treeattn gpu-check`: the kernel against an f64 reference on fresh
#      random packs (trees, forests with padding, varlen, causal, a GRPO fan;
#      GQA; d 64 and 128; bf16 and f16; outputs poisoned, every element
#      checked), then timings of tree packs against a causal run of the same
#      kernel and size (CUDA events, warm-up, median, inputs > L2); then the
#      backward (both dQ modes, rotary) and SDCC against the CPU backend,
#      forward+backward timed against causal and LogitTree's K+1 branch
#      passes, and SDCC fused against its unfused baseline;
#      every correctness case's pack, inputs and outputs are dumped
#      (`--dump`, before any timing);
#   3. scripts/gpu-anchor.py on that dump: PyTorch on the very same packs —
#      SDPA with the dense mask (float32 reference, autograd gradients),
#      FlexAttention compiled (forward and backward), SDPA causal (flash) of
#      the same length — errors against ours and one side-by-side table of
#      timings;
#   4. the host-stream entries from their hosts, when scripts/gpu-build.sh
#      built them into target/gpu-carry (GPU_CARRY): the C program
#      capi/tests/c/device.c and python/tests/test_cuda.py with the cuda
#      wheel; and the candle op's device test where cargo exists;
#   5. ncu (--clock-control none) on the forward and backward main kernels
#      of one random-tree pack (`gpu-check --profile`): speed of light,
#      tensor-pipe use, shared-memory bank conflicts, stall reasons;
#   6. last, compute-sanitizer memcheck, racecheck, synccheck and initcheck
#      on a small correctness-only run (`gpu-check --check-only --small`;
#      the kernels carry -lineinfo, so reports name source lines).
# Every section prints as it goes (flushed) and a failing section does not
# stop the next. The same flow runs on CPU machines first:
# `treeattn gpu-check --backend emu --dump DIR` then
# `python3 scripts/gpu-anchor.py DIR` (.ci/run, tests/gpu_check_emu.rs).
# Logs also go to $OUT when it is set (the dump does not: it is large; set
# GPU_CHECK_DUMP to keep it somewhere).
#
# Environment: TREEATTN_BIN (default target/release/treeattn), GPU_CHECK_ARGS
# (extra arguments for gpu-check, e.g. "--tokens 16384 --heads 16 --reps 50"),
# GPU_ANCHOR_ARGS (extra arguments for gpu-anchor.py, e.g. "--flex eager"),
# GPU_CHECK_DUMP (the dump directory; default a fresh temporary one),
# PYTHON (default python3), GPU_CHECK_BUDGET (seconds for the whole call,
# default 540: sections share it, see `limit`; a section that would not
# fit is skipped with a line, so the late ones — ncu, the sanitizer — may
# need a second call: GPU_CHECK_ONLY="ncu sanitizer" runs just those),
# GPU_CHECK_ONLY (space-separated sections among: check anchor hosts ncu
# sanitizer; default all).
set -uo pipefail
cd "$(dirname "$0")/.."

# One budget for the whole call (the device tool allows 600 s per command):
# each section runs under the smaller of its own cap and what is left, less
# RESERVE for the sections after it; a section with under 20 s left is
# skipped with a line. GPU_CHECK_BUDGET (seconds, default 540).
BUDGET=${GPU_CHECK_BUDGET:-540}
START=$SECONDS
# limit CAP RESERVE: the timeout for the next section (0: skip it).
limit() {
    local left=$((BUDGET - (SECONDS - START) - $2))
    [ "$left" -gt "$1" ] && left=$1
    [ "$left" -lt 20 ] && left=0
    echo "$left"
}
skip_line() { echo "skipped: $1 (budget: $((BUDGET - (SECONDS - START))) s of $BUDGET s left)"; }

CARRY=${GPU_CARRY:-target/gpu-carry}
# The binary scripts/gpu-build.sh carries, else a plain release build's.
if [ -z "${TREEATTN_BIN:-}" ] && [ -x "$CARRY/treeattn" ]; then
    BIN=$CARRY/treeattn
else
    BIN=${TREEATTN_BIN:-target/release/treeattn}
fi
LOG_DIR=${OUT:-$(mktemp -d)}
if [ ! -x "$BIN" ]; then
    echo "no treeattn binary at $BIN: build it with 'cargo build --release --features cuda' and carry it" >&2
    exit 2
fi

echo "== machine"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv 2>&1 | head -5
date -u

rc=0
# want SECTION: whether GPU_CHECK_ONLY (default: all) names it.
want() { [ -z "${GPU_CHECK_ONLY:-}" ] || [[ " $GPU_CHECK_ONLY " == *" $1 "* ]]; }

DUMP=${GPU_CHECK_DUMP:-$(mktemp -d)/gpu-check-dump}
echo "== treeattn gpu-check --dump $DUMP"
# shellcheck disable=SC2086
t=$(limit 300 200)
if ! want check; then
    echo "skipped: not in GPU_CHECK_ONLY"
elif [ "$t" -eq 0 ]; then
    skip_line "gpu-check"
    rc=1
else
    timeout "$t" "$BIN" gpu-check --dump "$DUMP" ${GPU_CHECK_ARGS:-} 2>&1 | tee "$LOG_DIR/gpu-check.log"
    s=${PIPESTATUS[0]}
    [ $s -ne 0 ] && { echo "gpu-check: exit $s"; rc=1; }
fi

echo "== scripts/gpu-anchor.py $DUMP (PyTorch SDPA / FlexAttention on the same packs)"
# The correctness comparisons with eager FlexAttention (a compile per case
# shape would spend the budget), no torch timing on the small correctness
# packs; then torch on the full-size timing packs, compiled, within the
# section's time less a margin.
t=$(limit 200 100)
if ! want anchor; then
    echo "skipped: not in GPU_CHECK_ONLY"
elif [ "$t" -eq 0 ]; then
    skip_line "gpu-anchor.py"
elif [ -f "$DUMP/manifest.json" ]; then
    # shellcheck disable=SC2086
    timeout "$t" "${PYTHON:-python3}" -u scripts/gpu-anchor.py "$DUMP" --no-case-timing --flex-check eager \
        --timing-budget $((t - 40 > 20 ? t - 40 : 20)) ${GPU_ANCHOR_ARGS:-} 2>&1 \
        | tee "$LOG_DIR/gpu-anchor.log"
    s=${PIPESTATUS[0]}
    [ $s -ne 0 ] && { echo "gpu-anchor.py: exit $s"; rc=1; }
else
    echo "no dump at $DUMP (gpu-check stopped before its correctness sections ended): gpu-anchor.py not run"
    rc=1
fi

# The host-stream entries, from the hosts that use them (built by
# scripts/gpu-build.sh into $CARRY; each section is skipped with a line
# when its artifact is absent, and its failure does not stop the others).
echo "== C host on the device (capi/tests/c/device.c: its context, memory and stream)"
t=$(limit 30 60)
if ! want hosts; then
    echo "skipped: not in GPU_CHECK_ONLY"
elif [ "$t" -eq 0 ]; then
    skip_line "the C host"
elif [ -x "$CARRY/capi-device" ]; then
    timeout "$t" "$CARRY/capi-device" --require-gpu 2>&1 | tee "$LOG_DIR/capi-device.log"
    s=${PIPESTATUS[0]}
    [ $s -ne 0 ] && { echo "capi-device: exit $s"; rc=1; }
else
    echo "skipped: no $CARRY/capi-device (run scripts/gpu-build.sh and carry $CARRY)"
fi
echo "== torch op on CUDA tensors (python/tests/test_cuda.py, torch's current stream)"
wheel=$(ls "$CARRY"/treeattn-*.whl 2>/dev/null | head -1)
t=$(limit 120 60)
if ! want hosts; then
    echo "skipped: not in GPU_CHECK_ONLY"
elif [ "$t" -eq 0 ]; then
    skip_line "test_cuda.py"
elif [ -n "$wheel" ] && command -v "${PYTHON:-python3}" >/dev/null; then
    venv=$(mktemp -d)
    # The machine's torch, seen from a venv that adds only the wheel.
    "${PYTHON:-python3}" -m venv --system-site-packages "$venv"
    "$venv/bin/python" -c "import pytest" 2>/dev/null \
        || "$venv/bin/python" -m pip install --quiet --no-index --find-links "$CARRY/wheels" pytest
    "$venv/bin/python" -m pip install --quiet --no-deps --no-index "$wheel"
    (cd python/tests && timeout "$t" "$venv/bin/python" -m pytest -q -p no:cacheprovider -rs test_cuda.py) \
        2>&1 | tee "$LOG_DIR/python-cuda.log"
    s=${PIPESTATUS[0]}
    [ $s -ne 0 ] && { echo "python test_cuda: exit $s"; rc=1; }
else
    echo "skipped: no wheel in $CARRY (run scripts/gpu-build.sh and carry $CARRY)"
fi
echo "== candle op on CUDA tensors (tests/candle_op.rs cuda_op_matches_the_cpu_op, candle's stream)"
# candle-core's `cuda` links libcuda, cuBLAS and cuRAND, so this test
# binary cannot be linked on a machine without them (the build machine):
# it is built and run here, where a Rust toolchain exists.
t=$(limit 300 60)
if ! want hosts; then
    echo "skipped: not in GPU_CHECK_ONLY"
elif [ "$t" -eq 0 ]; then
    skip_line "the candle device test"
elif command -v cargo >/dev/null; then
    timeout "$t" cargo test --release --features candle-cuda --test candle_op cuda_op_matches_the_cpu_op \
        -- --nocapture 2>&1 | tee "$LOG_DIR/candle-cuda.log"
    s=${PIPESTATUS[0]}
    [ $s -ne 0 ] && { echo "candle cuda test: exit $s"; rc=1; }
else
    echo "skipped: no Rust toolchain on this machine (the candle CUDA test must be linked where libcuda and cuBLAS exist)"
fi
echo "== ncu --clock-control none: forward and backward main kernels of one random-tree pack (gpu-check --profile)"
# Speed of light, compute (tensor pipe) and memory tables (shared-memory
# bank conflicts), stall reasons, occupancy; the first launch of each
# kernel only (-c 2: the forward, then the backward's main kernel).
t=$(limit 90 45)
if ! want ncu; then
    echo "skipped: not in GPU_CHECK_ONLY"
elif [ "$t" -eq 0 ]; then
    skip_line "ncu"
elif command -v ncu >/dev/null; then
    timeout "$t" ncu --clock-control none -k 'regex:^tree_attn_(fwd|bwd_main)' -c 2 \
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables \
        --section WarpStateStats --section Occupancy --section LaunchStats \
        "$BIN" gpu-check --profile --tokens 16384 --heads 16 >"$LOG_DIR/ncu.log" 2>&1
    s=$?
    cat "$LOG_DIR/ncu.log"
    [ $s -ne 0 ] && { echo "ncu: exit $s"; rc=1; }
else
    echo "skipped: no ncu on PATH"
fi

# Last: each tool on a small correctness-only run (sanitized kernels run
# 10-100x slower); a tool's report ends in "ERROR SUMMARY: N errors".
for tool in memcheck racecheck synccheck initcheck; do
    echo "== compute-sanitizer --tool $tool (gpu-check --check-only --small)"
    t=$(limit 90 0)
    if ! want sanitizer; then
        echo "skipped: not in GPU_CHECK_ONLY"
        continue
    fi
    [ "$t" -eq 0 ] && { skip_line "compute-sanitizer $tool"; continue; }
    if ! command -v compute-sanitizer >/dev/null; then
        echo "skipped: no compute-sanitizer on PATH"
        continue
    fi
    timeout "$t" compute-sanitizer --tool "$tool" --error-exitcode 3 --print-limit 20 \
        "$BIN" gpu-check --check-only --small --seed 1 >"$LOG_DIR/sanitizer-$tool.log" 2>&1
    s=$?
    grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|=========' "$LOG_DIR/sanitizer-$tool.log" | head -30
    tail -3 "$LOG_DIR/sanitizer-$tool.log"
    [ $s -ne 0 ] && { echo "compute-sanitizer $tool: exit $s"; rc=1; }
done
echo "== done in $((SECONDS - START)) s of a $BUDGET s budget"
exit $rc
