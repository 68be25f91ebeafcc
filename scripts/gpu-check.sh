#!/usr/bin/env bash
# GPU check of the CUDA tree-attention kernels and SDCC, for a machine with
# an NVIDIA GPU and no Rust toolchain: the treeattn binary is built here, with
#     cargo build --release --features cuda
# and carried (target/release/treeattn). One call, under 10 minutes, in an
# order that keeps the most information if a kernel faults:
#   1. the machine (read-only nvidia-smi: name, driver, clocks; nothing is
#      changed);
#   2. compute-sanitizer memcheck and synccheck early, on a small
#      correctness-only run (`gpu-check --check-only --small`; the kernels
#      carry -lineinfo, so reports name source lines);
#   3. correctness as its own process with CUDA_LAUNCH_BLOCKING=1 (a fault
#      names its kernel): `gpu-check --check-only --seed S --dump DIR`, the
#      forward against an f64 reference on fresh random packs (trees,
#      padding, varlen, causal, GRPO fans, one with a > 2k-token prompt,
#      ~4.3k tokens with 16 / 4 heads; d 64 and 128; bf16 and f16), the
#      backward (both dQ modes, rotary) and SDCC; on a failure, memcheck
#      at once on the same sizes and seed (`--check-only --seed S`; the
#      emulator replays the packs with `--backend emu --check-only --seed S`);
#   4. timing as a second process (`gpu-check --timing-only --seed S`),
#      nvidia-smi clocks logged before and after; the two gpu-check
#      processes are capped near 180 s together (GPU_CHECK_CAP);
#   5. scripts/gpu-anchor.py on the dump: PyTorch (SDPA, FlexAttention) on
#      the very same packs, errors against ours and timings side by side;
#   6. the host-stream entries from their hosts when scripts/gpu-build.sh
#      built them into target/gpu-carry (GPU_CARRY): the C program
#      capi/tests/c/device.c, python/tests/test_cuda.py with the cuda wheel,
#      the candle op's device test where cargo exists;
#   7. ncu (--clock-control none) on the forward and backward main kernels
#      (`gpu-check --profile`);
#   8. last, compute-sanitizer racecheck and initcheck on the small run.
# Every section prints as it goes (flushed) and a failing section does not
# stop the next. Everything goes to one combined log, $OUT/gpu-check.log
# when OUT is set (a GPU run brings back at most 8 files: this script writes
# that one and nothing else there; the dump, large, goes to GPU_CHECK_DUMP
# or a temporary folder). The same flow runs on CPU machines first:
# `treeattn gpu-check --backend emu --dump DIR` then
# `python3 scripts/gpu-anchor.py DIR` (.ci/run, tests/it/gpu_check_emu.rs).
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
# sanitizer; default all), GPU_CHECK_SEED (the seed S; default the clock),
# GPU_CHECK_CAP (seconds for the correctness and timing processes
# together, default 180).
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
# One combined log: everything below is printed and kept in it.
LOG=${OUT:+$OUT/gpu-check.log}
LOG=${LOG:-$(mktemp -d)/gpu-check.log}
exec > >(tee "$LOG") 2>&1
if [ ! -x "$BIN" ]; then
    echo "no treeattn binary at $BIN: build it with 'cargo build --release --features cuda' and carry it" >&2
    exit 2
fi

echo "== machine"
CLOCKS=name,driver_version,memory.total,clocks.sm,clocks.mem,clocks.max.sm,clocks.max.mem,clocks_throttle_reasons.active,temperature.gpu,power.draw
nvidia-smi --query-gpu=$CLOCKS --format=csv 2>&1 | head -5
date -u
SEED=${GPU_CHECK_SEED:-$(date +%s)}
CAP=${GPU_CHECK_CAP:-180}
echo "seed $SEED (replay: $BIN gpu-check --check-only --seed $SEED; on a CPU: --backend emu)"

rc=0
# gate SECTION NAME CAP RESERVE: sets t, the next section's timeout (see
# `limit`), and fails with a line saying why: status 2 when GPU_CHECK_ONLY
# (default: all) does not name SECTION, 1 when the budget is spent.
gate() {
    t=$(limit "$3" "$4")
    if [ -n "${GPU_CHECK_ONLY:-}" ] && [[ " $GPU_CHECK_ONLY " != *" $1 "* ]]; then
        echo "skipped: not in GPU_CHECK_ONLY"
        return 2
    fi
    [ "$t" -eq 0 ] && { skip_line "$2"; return 1; }
    return 0
}
# logged NAME CMD...: runs CMD under the timeout t (its output goes to the
# combined log as it comes); a failure is reported and fails the call (rc),
# the next sections still run. Returns CMD's status.
logged() {
    local name=$1
    shift
    timeout "$t" "$@"
    local s=$?
    [ "$s" -ne 0 ] && { echo "$name: exit $s"; rc=1; }
    return $s
}
# sanitize TOOL ARGS...: compute-sanitizer TOOL on `gpu-check ARGS`.
sanitize() {
    local tool=$1
    shift
    if command -v compute-sanitizer >/dev/null; then
        logged "compute-sanitizer $tool" compute-sanitizer --tool "$tool" --error-exitcode 3 \
            --print-limit 20 "$BIN" gpu-check "$@"
    else
        echo "skipped: no compute-sanitizer on PATH"
    fi
}

# Early: memcheck and synccheck on the small correctness run, so that a
# fault is found with its source line even if a later section takes the
# context down.
for tool in memcheck synccheck; do
    echo "== compute-sanitizer --tool $tool (gpu-check --check-only --small --seed 1)"
    gate sanitizer "compute-sanitizer $tool" 60 300 && sanitize "$tool" --check-only --small --seed 1
done

DUMP=${GPU_CHECK_DUMP:-$(mktemp -d)/gpu-check-dump}
CHECK_START=$SECONDS
echo "== correctness: CUDA_LAUNCH_BLOCKING=1 treeattn gpu-check --check-only --seed $SEED --dump $DUMP"
gate check "gpu-check --check-only" $((CAP * 2 / 3)) 200
case $? in
    # shellcheck disable=SC2086
    0)
        if ! logged gpu-check-correctness env CUDA_LAUNCH_BLOCKING=1 \
            "$BIN" gpu-check --check-only --seed "$SEED" --dump "$DUMP" ${GPU_CHECK_ARGS:-}; then
            echo "== correctness failed: compute-sanitizer memcheck at once, same sizes and seed"
            gate check "memcheck on the failing run" 120 150 && sanitize memcheck --check-only --seed "$SEED"
        fi
        ;;
    1) rc=1 ;;  # the main check did not run for lack of time: a failed call
esac

echo "== timing: treeattn gpu-check --timing-only --seed $SEED --dump $DUMP"
nvidia-smi --query-gpu=clocks.sm,clocks.mem,clocks_throttle_reasons.active,temperature.gpu,power.draw \
    --format=csv,noheader 2>&1 | sed 's/^/clocks before timing: /'
left_cap=$((CAP - (SECONDS - CHECK_START)))
if [ "$left_cap" -lt 20 ]; then
    echo "skipped: the correctness process used the gpu-check cap ($CAP s)"
elif gate check "gpu-check --timing-only" "$left_cap" 150; then
    # shellcheck disable=SC2086
    logged gpu-check-timing "$BIN" gpu-check --timing-only --seed "$SEED" --dump "$DUMP" ${GPU_CHECK_ARGS:-}
fi
nvidia-smi --query-gpu=clocks.sm,clocks.mem,clocks_throttle_reasons.active,temperature.gpu,power.draw \
    --format=csv,noheader 2>&1 | sed 's/^/clocks after timing: /'

echo "== scripts/gpu-anchor.py $DUMP (PyTorch SDPA / FlexAttention on the same packs)"
# The correctness comparisons with eager FlexAttention (a compile per case
# shape would spend the budget), no torch timing on the small correctness
# packs; then torch on the full-size timing packs, compiled, within the
# section's time less a margin.
if gate anchor "gpu-anchor.py" 200 100; then
    if [ -f "$DUMP/manifest.json" ]; then
        # shellcheck disable=SC2086
        logged gpu-anchor.py "${PYTHON:-python3}" -u scripts/gpu-anchor.py "$DUMP" \
            --no-case-timing --flex-check eager --timing-budget $((t - 40 > 20 ? t - 40 : 20)) ${GPU_ANCHOR_ARGS:-}
    else
        echo "no dump at $DUMP (gpu-check stopped before its correctness sections ended): gpu-anchor.py not run"
        rc=1
    fi
fi

# The host-stream entries, from the hosts that use them (built by
# scripts/gpu-build.sh into $CARRY; each section is skipped with a line
# when its artifact is absent, and its failure does not stop the others).
echo "== C host on the device (capi/tests/c/device.c: its context, memory and stream)"
if gate hosts "the C host" 30 60; then
    if [ -x "$CARRY/capi-device" ]; then
        logged capi-device "$CARRY/capi-device" --require-gpu
    else
        echo "skipped: no $CARRY/capi-device (run scripts/gpu-build.sh and carry $CARRY)"
    fi
fi
echo "== torch op on CUDA tensors (python/tests/test_cuda.py, torch's current stream)"
wheel=$(ls "$CARRY"/treeattn-*.whl 2>/dev/null | head -1)
if gate hosts "test_cuda.py" 120 60; then
    if [ -n "$wheel" ] && command -v "${PYTHON:-python3}" >/dev/null; then
        venv=$(mktemp -d)
        # The machine's torch, seen from a venv that adds only the wheel.
        "${PYTHON:-python3}" -m venv --system-site-packages "$venv"
        "$venv/bin/python" -c "import pytest" 2>/dev/null \
            || "$venv/bin/python" -m pip install --quiet --no-index --find-links "$CARRY/wheels" pytest
        "$venv/bin/python" -m pip install --quiet --no-deps --no-index "$wheel"
        logged "python test_cuda" env -C python/tests \
            "$venv/bin/python" -m pytest -q -p no:cacheprovider -rs test_cuda.py
    else
        echo "skipped: no wheel in $CARRY (run scripts/gpu-build.sh and carry $CARRY)"
    fi
fi
echo "== candle op on CUDA tensors (tests/candle_op.rs cuda_op_matches_the_cpu_op, candle's stream)"
# candle-core's `cuda` links libcuda, cuBLAS and cuRAND, so this test
# binary cannot be linked on a machine without them (the build machine):
# it is built and run here, where a Rust toolchain exists.
if gate hosts "the candle device test" 300 60; then
    if command -v cargo >/dev/null; then
        logged "candle cuda test" cargo test --release --features candle-cuda --test candle_op \
            cuda_op_matches_the_cpu_op -- --nocapture
    else
        echo "skipped: no Rust toolchain on this machine (the candle CUDA test must be linked where libcuda and cuBLAS exist)"
    fi
fi
echo "== ncu --clock-control none: forward and backward main kernels of one random-tree pack (gpu-check --profile)"
# Speed of light, compute (tensor pipe) and memory tables (shared-memory
# bank conflicts), stall reasons, occupancy; the first launch of each
# kernel only (-c 2: the forward, then the backward's main kernel).
if gate ncu "ncu" 90 45; then
    if command -v ncu >/dev/null; then
        logged ncu ncu --clock-control none -k 'regex:^tree_attn_(fwd|bwd_main)' -c 2 \
            --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables \
            --section WarpStateStats --section Occupancy --section LaunchStats \
            "$BIN" gpu-check --profile --tokens 16384 --heads 16
    else
        echo "skipped: no ncu on PATH"
    fi
fi

# Last: racecheck and initcheck on the small correctness-only run
# (sanitized kernels run 10-100x slower); a tool's report ends in
# "ERROR SUMMARY: N errors" (--print-limit 20 keeps it short).
for tool in racecheck initcheck; do
    echo "== compute-sanitizer --tool $tool (gpu-check --check-only --small --seed 1)"
    gate sanitizer "compute-sanitizer $tool" 90 0 && sanitize "$tool" --check-only --small --seed 1
done
echo "== done in $((SECONDS - START)) s of a $BUDGET s budget; log: $LOG"
exit $rc
