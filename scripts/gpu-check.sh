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
#   4. optionally (GPU_CHECK_SANITIZE=1) a small run under compute-sanitizer
#      memcheck and racecheck (before 2).
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
# PYTHON (default python3), GPU_CHECK_SANITIZE=1.
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

DUMP=${GPU_CHECK_DUMP:-$(mktemp -d)/gpu-check-dump}
echo "== treeattn gpu-check --dump $DUMP"
# shellcheck disable=SC2086
timeout 420 "$BIN" gpu-check --dump "$DUMP" ${GPU_CHECK_ARGS:-} 2>&1 | tee "$LOG_DIR/gpu-check.log"
s=${PIPESTATUS[0]}
[ $s -ne 0 ] && { echo "gpu-check: exit $s"; rc=1; }

echo "== scripts/gpu-anchor.py $DUMP (PyTorch SDPA / FlexAttention on the same packs)"
if [ -f "$DUMP/manifest.json" ]; then
    # shellcheck disable=SC2086
    timeout 300 "${PYTHON:-python3}" -u scripts/gpu-anchor.py "$DUMP" ${GPU_ANCHOR_ARGS:-} 2>&1 \
        | tee "$LOG_DIR/gpu-anchor.log"
    s=${PIPESTATUS[0]}
    [ $s -ne 0 ] && { echo "gpu-anchor.py: exit $s"; rc=1; }
else
    echo "no dump at $DUMP (gpu-check stopped before its correctness sections ended): gpu-anchor.py not run"
    rc=1
fi
exit $rc
