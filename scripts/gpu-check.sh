#!/usr/bin/env bash
# GPU check of the CUDA tree-attention kernels and SDCC, for a machine with
# an NVIDIA GPU and no Rust toolchain: the treeattn binary is built here, with
#     cargo build --release --features cuda
# (or scripts/gpu-build.sh, into target/gpu-carry) and carried. One call,
# under 10 minutes, ordered so that a run cut short keeps what matters most
# (issue 39): correctness, then timing, then ncu, then the sanitizers.
#   0. the machine (read-only nvidia-smi: name, driver, clocks; nothing is
#      changed) and whether it runs under gVisor;
#   1. correctness as its own process with CUDA_LAUNCH_BLOCKING=1 (a fault
#      names its kernel): `gpu-check --check-only --seed S --dump DIR`, the
#      forward against an f64 reference on fresh random packs (trees,
#      padding, varlen, causal, GRPO fans, one with a > 2k-token prompt,
#      ~4.3k tokens with 16 / 4 heads; d 64 and 128; bf16 and f16), the
#      backward (both dQ modes, rotary) and SDCC (the emulator replays the
#      packs with `--backend emu --check-only --seed S`);
#   2. timing as a second process (`gpu-check --timing-only --seed S --dump
#      DIR --time-limit T`): first the GRPO pack at d 128 against causal,
#      forward and forward + backward in both dQ modes (10 reps), then every
#      other row; each row is appended to DIR/timing/timing.json as it
#      finishes (whole at any moment), and the binary itself skips the rows
#      that would not fit in T (the section's time less a margin), so a
#      timeout loses at most one row; nvidia-smi clocks logged before and
#      after; the two gpu-check processes are capped near 180 s together
#      (GPU_CHECK_CAP);
#   3. scripts/gpu-anchor.py on the dump: PyTorch (SDPA, FlexAttention) on
#      the very same packs, errors against ours and timings side by side;
#   4. the host-stream entries from their hosts when scripts/gpu-build.sh
#      built them into target/gpu-carry (GPU_CARRY): the C program
#      capi/tests/c/device.c, python/tests/test_cuda.py with the cuda wheel,
#      the candle op's device test where cargo exists;
#   5. ncu (--clock-control none) on the forward and backward main kernels
#      (`gpu-check --profile`);
#   6. last, compute-sanitizer memcheck (first on the failing seed when the
#      correctness process failed), synccheck, racecheck and initcheck on
#      the small correctness run (`gpu-check --check-only --small`).
# Every section runs under a timeout that leaves a reserve for the sections
# after it; a section whose time is gone is skipped with a line. A GPU where
# ncu or compute-sanitizer cannot attach (a gVisor sandbox: "Device not
# supported", "LibraryNotLoaded") is reported as such, UNAVAILABLE, and is
# not a failure; the remaining sanitizer tools are then skipped. Every
# section prints as it goes (flushed), a failing section does not stop the
# next, and a summary of every section ends the log. Everything goes to one
# combined log, $OUT/gpu-check.log when OUT is set (a GPU run brings back at
# most 8 files: this script writes that one and nothing else there; the
# dump, large, goes to GPU_CHECK_DUMP or a temporary folder).
#
# The same flow runs on CPU machines first: GPU_CHECK_BACKEND=emu runs every
# gpu-check above on the SIMT emulator (`--backend emu`, small sizes) — the
# dry run of lab/tests/it/gpu_check_script.rs, with stand-ins for nvidia-smi,
# ncu and compute-sanitizer — and `treeattn gpu-check --backend emu --dump
# DIR` then `python3 scripts/gpu-anchor.py DIR` run in .ci/run
# (lab/tests/it/gpu_check_emu.rs).
#
# Environment: TREEATTN_BIN (default target/gpu-carry/treeattn, else
# target/release/treeattn), GPU_CHECK_ARGS (extra arguments for the
# correctness and timing runs, e.g. "--tokens 16384 --heads 16 --reps 50"),
# GPU_ANCHOR_ARGS (extra arguments for gpu-anchor.py, e.g. "--flex eager"),
# GPU_CHECK_DUMP (the dump directory; default a fresh temporary one),
# PYTHON (default python3), GPU_CHECK_BUDGET (seconds for the whole call,
# default 540: sections share it, see `limit`), GPU_CHECK_ONLY
# (space-separated sections among: check timing anchor hosts ncu sanitizer;
# default all), GPU_CHECK_SEED (the seed S; default the clock),
# GPU_CHECK_CAP (seconds for the correctness and timing processes together,
# default 180), GPU_CHECK_BACKEND (cuda, the default, or emu).
set -uo pipefail
cd "$(dirname "$0")/.."

# One budget for the whole call (the device tool allows 600 s per command):
# each section runs under the smaller of its own cap and what is left, less
# its RESERVE for the sections after it; a section with under 20 s left is
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
skip_line() {
    echo "skipped: $1 (budget: $((BUDGET - (SECONDS - START))) s of $BUDGET s left, reserve $2 s for the sections after it)"
}

CARRY=${GPU_CARRY:-target/gpu-carry}
# The binary scripts/gpu-build.sh carries, else a plain release build's.
if [ -z "${TREEATTN_BIN:-}" ] && [ -x "$CARRY/treeattn" ]; then
    BIN=$CARRY/treeattn
else
    BIN=${TREEATTN_BIN:-target/release/treeattn}
fi
# The target of every gpu-check run, and the size of the profiled run.
case ${GPU_CHECK_BACKEND:-cuda} in
    cuda) BACKEND=(--backend cuda); PROFILE=(--tokens 16384 --heads 16) ;;
    emu) BACKEND=(--backend emu); PROFILE=(--tokens 256 --heads 4) ;;
    *) echo "GPU_CHECK_BACKEND must be cuda or emu, not ${GPU_CHECK_BACKEND}" >&2; exit 2 ;;
esac
# One combined log: everything below is printed and kept in it.
LOG=${OUT:+$OUT/gpu-check.log}
LOG=${LOG:-$(mktemp -d)/gpu-check.log}
exec > >(tee "$LOG") 2>&1
if [ ! -x "$BIN" ]; then
    echo "no treeattn binary at $BIN: build it with 'cargo build --release --features cuda' and carry it" >&2
    exit 2
fi

rc=0
SUMMARY=()
# note SECTION WORDS...: one line of the closing summary.
note() { SUMMARY+=("$(printf '%-28s %s' "$1" "${*:2}")"); }

echo "== machine"
CLOCKS=name,driver_version,memory.total,clocks.sm,clocks.mem,clocks.max.sm,clocks.max.mem,clocks_throttle_reasons.active,temperature.gpu,power.draw
nvidia-smi --query-gpu=$CLOCKS --format=csv 2>&1 | head -5
date -u
# gVisor (runsc) says so in its kernel log and version; there ncu and
# compute-sanitizer cannot attach (sections 5 and 6 then report UNAVAILABLE).
if dmesg 2>/dev/null | grep -qi gvisor || grep -qi gvisor /proc/version 2>/dev/null; then
    echo "sandbox: gVisor (expect ncu and compute-sanitizer to be unavailable: reported, not failures)"
    note machine "gVisor sandbox"
else
    echo "sandbox: no gVisor seen (dmesg, /proc/version)"
fi
SEED=${GPU_CHECK_SEED:-$(date +%s)}
CAP=${GPU_CHECK_CAP:-180}
echo "seed $SEED (replay: $BIN gpu-check --check-only --seed $SEED; on a CPU: --backend emu)"
echo "budget $BUDGET s: correctness -> timing -> anchor -> hosts -> ncu -> sanitizers, each with a reserve for the rest"

# gate SECTION NAME CAP RESERVE: sets t, the next section's timeout (see
# `limit`), and fails with a line saying why: status 2 when GPU_CHECK_ONLY
# (default: all) does not name SECTION, 1 when the budget is spent.
gate() {
    t=$(limit "$3" "$4")
    if [ -n "${GPU_CHECK_ONLY:-}" ] && [[ " $GPU_CHECK_ONLY " != *" $1 "* ]]; then
        echo "skipped: not in GPU_CHECK_ONLY"
        return 2
    fi
    [ "$t" -eq 0 ] && { skip_line "$2" "$4"; note "$2" "skipped (budget)"; return 1; }
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
    if [ "$s" -ne 0 ]; then
        [ "$s" -eq 124 ] && echo "$name: timed out after $t s" || echo "$name: exit $s"
        rc=1
        note "$name" "FAILED (exit $s)"
    else
        note "$name" ok
    fi
    return $s
}
# What ncu and compute-sanitizer print when they cannot attach to the GPU
# (gVisor; a driver without profiling rights).
CANNOT_ATTACH='Device not supported|LibraryNotLoaded|ERR_NVGPUCTRPERM|not supported on this (device|platform)'
# tool NAME PATTERN CMD...: runs a tool that attaches to a process (ncu,
# compute-sanitizer) under the timeout t. Output with one of CANNOT_ATTACH,
# or a failure without PATTERN (what the tool prints once it attached): the
# tool could not attach — reported UNAVAILABLE with its first error line,
# status 99, not a failure. Otherwise it attached: a non-zero status is a
# failure, and so is status 0 without PATTERN (nothing was checked or
# profiled: a wrong kernel filter, ours).
tool() {
    local name=$1 pat=$2 out s why
    shift 2
    out=$(mktemp)
    timeout "$t" "$@" 2>&1 | tee "$out"
    s=${PIPESTATUS[0]}
    if grep -qE "$CANNOT_ATTACH" "$out" || { [ "$s" -ne 0 ] && ! grep -q -- "$pat" "$out"; }; then
        why=$(grep -m1 -E "$CANNOT_ATTACH" "$out" || grep -m1 -iE 'error|fail' "$out")
        why=$(printf '%s' "$why" | cut -c1-160)
        rm -f "$out"
        echo "$name: UNAVAILABLE on this machine (exit $s: ${why:-no message}); under gVisor the tool cannot" \
            "attach to the GPU: not a failure"
        note "$name" "UNAVAILABLE (${why:-exit $s})"
        return 99
    fi
    if ! grep -q -- "$pat" "$out"; then
        echo "$name: exited 0 without output matching '$pat' (nothing was checked or profiled)"
        rc=1
        note "$name" "FAILED (did nothing)"
        rm -f "$out"
        return 1
    fi
    rm -f "$out"
    if [ "$s" -ne 0 ]; then
        echo "$name: exit $s"
        rc=1
        note "$name" "FAILED (exit $s)"
    else
        note "$name" ok
    fi
    return "$s"
}

DUMP=${GPU_CHECK_DUMP:-$(mktemp -d)/gpu-check-dump}
CHECK_START=$SECONDS
check_failed=0
echo "== 1. correctness: CUDA_LAUNCH_BLOCKING=1 treeattn gpu-check --check-only --seed $SEED --dump $DUMP"
# Reserve: timing 150 s, ncu 60 s, the sanitizers 120 s.
gate check "correctness" $((CAP * 2 / 3)) 330
case $? in
    # shellcheck disable=SC2086
    0)
        logged correctness env CUDA_LAUNCH_BLOCKING=1 \
            "$BIN" gpu-check "${BACKEND[@]}" --check-only --seed "$SEED" --dump "$DUMP" ${GPU_CHECK_ARGS:-} \
            || check_failed=1
        ;;
    1) rc=1 ;; # the main check did not run for lack of time: a failed call
esac

echo "== 2. timing: treeattn gpu-check --timing-only --seed $SEED --dump $DUMP (rows appended to $DUMP/timing/timing.json)"
nvidia-smi --query-gpu=clocks.sm,clocks.mem,clocks_throttle_reasons.active,temperature.gpu,power.draw \
    --format=csv,noheader 2>&1 | sed 's/^/clocks before timing: /'
left_cap=$((CAP - (SECONDS - CHECK_START)))
[ "$left_cap" -lt 20 ] && left_cap=20
# Reserve: ncu 60 s, the sanitizers 120 s.
if gate timing "timing" "$left_cap" 180; then
    # The binary stops starting rows 10 s before the timeout; what finished
    # is in timing.json either way.
    # shellcheck disable=SC2086
    logged timing "$BIN" gpu-check "${BACKEND[@]}" --timing-only --seed "$SEED" --dump "$DUMP" \
        --time-limit $((t > 20 ? t - 10 : 10)) ${GPU_CHECK_ARGS:-}
    if [ -f "$DUMP/timing/timing.json" ]; then
        echo "timing.json: $(grep -c '"name"' "$DUMP/timing/timing.json") rows, $(grep -m1 '"complete"' "$DUMP/timing/timing.json" | tr -d ' ,')"
    fi
fi
nvidia-smi --query-gpu=clocks.sm,clocks.mem,clocks_throttle_reasons.active,temperature.gpu,power.draw \
    --format=csv,noheader 2>&1 | sed 's/^/clocks after timing: /'

echo "== 3. scripts/gpu-anchor.py $DUMP (PyTorch SDPA / FlexAttention on the same packs)"
# The correctness comparisons with eager FlexAttention (a compile per case
# shape would spend the budget), no torch timing on the small correctness
# packs; then torch on the full-size timing packs, compiled, within the
# section's time less a margin.
if gate anchor "anchor" 200 150; then
    if [ -f "$DUMP/manifest.json" ]; then
        # shellcheck disable=SC2086
        logged anchor "${PYTHON:-python3}" -u scripts/gpu-anchor.py "$DUMP" \
            --no-case-timing --flex-check eager --timing-budget $((t - 40 > 20 ? t - 40 : 20)) ${GPU_ANCHOR_ARGS:-}
    else
        echo "no dump at $DUMP (gpu-check stopped before its correctness sections ended): gpu-anchor.py not run"
        rc=1
        note anchor "FAILED (no dump)"
    fi
fi

# The host-stream entries, from the hosts that use them (built by
# scripts/gpu-build.sh into $CARRY; each section is skipped with a line
# when its artifact is absent, and its failure does not stop the others).
echo "== 4a. C host on the device (capi/tests/c/device.c: its context, memory and stream)"
if gate hosts "C host" 30 150; then
    if [ -x "$CARRY/capi-device" ]; then
        logged "C host" "$CARRY/capi-device" --require-gpu
    else
        echo "skipped: no $CARRY/capi-device (run scripts/gpu-build.sh and carry $CARRY)"
        note "C host" "skipped (not built)"
    fi
fi
echo "== 4b. torch op on CUDA tensors (python/tests/test_cuda.py, torch's current stream)"
wheel=$(ls "$CARRY"/treeattn-*.whl 2>/dev/null | head -1)
if gate hosts "test_cuda.py" 120 150; then
    if [ -n "$wheel" ] && command -v "${PYTHON:-python3}" >/dev/null; then
        venv=$(mktemp -d)
        # The machine's torch, seen from a venv that adds only the wheel.
        "${PYTHON:-python3}" -m venv --system-site-packages "$venv"
        "$venv/bin/python" -c "import pytest" 2>/dev/null \
            || "$venv/bin/python" -m pip install --quiet --no-index --find-links "$CARRY/wheels" pytest
        "$venv/bin/python" -m pip install --quiet --no-deps --no-index "$wheel"
        logged "test_cuda.py" env -C python/tests \
            "$venv/bin/python" -m pytest -q -p no:cacheprovider -rs test_cuda.py
    else
        echo "skipped: no wheel in $CARRY (run scripts/gpu-build.sh and carry $CARRY)"
        note "test_cuda.py" "skipped (not built)"
    fi
fi
echo "== 4c. candle op on CUDA tensors (tests/candle_op.rs cuda_op_matches_the_cpu_op, candle's stream)"
# candle-core's `cuda` links libcuda, cuBLAS and cuRAND, so this test
# binary cannot be linked on a machine without them (the build machine):
# it is built and run here, where a Rust toolchain exists.
if gate hosts "candle device test" 300 150; then
    if command -v cargo >/dev/null; then
        logged "candle device test" cargo test --release --features candle-cuda --test candle_op \
            cuda_op_matches_the_cpu_op -- --nocapture
    else
        echo "skipped: no Rust toolchain on this machine (the candle CUDA test must be linked where libcuda and cuBLAS exist)"
        note "candle device test" "skipped (no cargo)"
    fi
fi

echo "== 5. ncu --clock-control none: forward and backward main kernels of one random-tree pack (gpu-check --profile)"
# Speed of light, compute (tensor pipe) and memory tables (shared-memory
# bank conflicts), stall reasons, occupancy; the first launch of each
# kernel only (-c 2: the forward, then the backward's main kernel).
# Reserve: the sanitizers 120 s.
if gate ncu "ncu" 90 120; then
    if command -v ncu >/dev/null; then
        tool ncu '==PROF== Profiling' ncu --clock-control none -k 'regex:^tree_attn_(fwd|bwd_main)' -c 2 \
            --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables \
            --section WarpStateStats --section Occupancy --section LaunchStats \
            "$BIN" gpu-check "${BACKEND[@]}" --profile "${PROFILE[@]}"
    else
        echo "skipped: no ncu on PATH"
        note ncu "skipped (no ncu)"
    fi
fi

# Last: the sanitizers (sanitized kernels run 10-100x slower); a tool's
# report ends in "ERROR SUMMARY: N errors" (--print-limit 20 keeps it
# short). memcheck first on the failing run when correctness failed (the
# same sizes and seed), then the four tools on the small run.
sanitizer_runs=()
[ "$check_failed" -eq 1 ] && sanitizer_runs+=("memcheck --check-only --seed $SEED")
for tool_name in memcheck synccheck racecheck initcheck; do
    sanitizer_runs+=("$tool_name --check-only --small --seed 1")
done
unavailable=""
for run in "${sanitizer_runs[@]}"; do
    read -r tool_name args <<<"$run"
    echo "== 6. compute-sanitizer --tool $tool_name (gpu-check $args)"
    if [ -n "$unavailable" ]; then
        echo "skipped: compute-sanitizer is unavailable here ($unavailable)"
        continue
    fi
    gate sanitizer "compute-sanitizer $tool_name" 90 0 || continue
    if ! command -v compute-sanitizer >/dev/null; then
        echo "skipped: no compute-sanitizer on PATH"
        note "compute-sanitizer" "skipped (not on PATH)"
        break
    fi
    # shellcheck disable=SC2086
    tool "compute-sanitizer $tool_name" 'ERROR SUMMARY' compute-sanitizer --tool "$tool_name" --error-exitcode 3 \
        --print-limit 20 "$BIN" gpu-check "${BACKEND[@]}" $args
    [ $? -eq 99 ] && unavailable="it could not attach for $tool_name"
done

echo "== summary ($((SECONDS - START)) s of a $BUDGET s budget; log: $LOG)"
printf '%s\n' "${SUMMARY[@]}"
[ "$rc" -eq 0 ] && echo "result: ok" || echo "result: FAILED"
exit $rc
