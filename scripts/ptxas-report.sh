#!/usr/bin/env bash
# Prints the ptxas resource report (registers, stack frame, spills, shared
# memory) of every kernel in kernels/*.cu for sm_80 and sm_90a, compiled with
# the flags of build.rs, and fails if an attention or SDCC kernel
# (tree_attn_fwd_*, tree_attn_bwd_*, sdcc_*) spills or uses a stack frame.
# PTXAS_REPORT_EXTRA_FLAGS adds nvcc flags (e.g. -maxrregcount=64 to see the
# spill check fire).
#
# nvcc is found like build.rs finds it: $TREEATTN_NVCC, $CUDA_HOME/bin/nvcc,
# nvcc on PATH, then the PyPI compiler (<site-packages>/nvidia/cu13/bin/nvcc).
# Dynamic shared memory is not in ptxas's numbers: the forward kernels take
# (128 + 4 * 64) * (d + 8) * 2 + 4096 + 2 * (64 + 4 + 64) * 4 bytes at launch
# (the last term: two buffers of a tile's kv_end, its bound and the walk's
# look-ahead window; 60448 for d=64, 109600 for d=128);
# the backward main kernels 65792 / 75520 (the two-m-tile main2 kernels
# 93696 for d64, 159232 for d128; main2w4, d64, 93696), the deterministic dQ kernels
# 56320 / 105472 (with two look-ahead windows; src/backend/launch/bwd.rs),
# the SDCC kernels 400.
set -euo pipefail
cd "$(dirname "$0")/.."

find_nvcc() {
    local c
    for c in "${TREEATTN_NVCC:-}" "${CUDA_HOME:+$CUDA_HOME/bin/nvcc}" "$(command -v nvcc || true)"; do
        [ -n "$c" ] && [ -x "$c" ] && { echo "$c"; return; }
    done
    for py in python3 python; do
        command -v "$py" >/dev/null || continue
        while read -r c; do
            [ -x "$c" ] && { echo "$c"; return; }
        done < <("$py" -c "import nvidia, os
for p in nvidia.__path__: print(os.path.join(p, 'cu13', 'bin', 'nvcc'))" 2>/dev/null || true)
    done
    echo "nvcc not found: pip install nvidia-cuda-nvcc==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85 (or set TREEATTN_NVCC / CUDA_HOME)" >&2
    exit 2
}
NVCC=$(find_nvcc)
echo "nvcc: $NVCC ($("$NVCC" --version | tail -1))"
echo

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
log="$tmp/ptxas.log"
for src in kernels/*.cu; do
    "$NVCC" -std=c++17 -O3 -lineinfo -Ikernels -Xptxas -v \
        -gencode=arch=compute_80,code=sm_80 \
        -gencode=arch=compute_90a,code=sm_90a \
        -gencode=arch=compute_80,code=compute_80 \
        ${PTXAS_REPORT_EXTRA_FLAGS:-} -fatbin "$src" -o "$tmp/out.fatbin" 2>>"$log"
done

# POSIX awk (mawk has no 3-argument match).
awk -v fail_file="$tmp/fail" '
function after(line, key,    i, rest) {   # the word following `key`
    i = index(line, key); if (i == 0) return ""
    rest = substr(line, i + length(key)); sub(/^[ \047]*/, "", rest); sub(/[\047 ,].*$/, "", rest)
    return rest
}
function before(line, key,    i, head, n, w) {   # the word preceding `key`
    i = index(line, key); if (i == 0) return 0
    head = substr(line, 1, i - 1); n = split(head, w, /[ ,]+/)
    return (w[n] == "" ? w[n - 1] : w[n])
}
/Compiling entry function/ { k = after($0, "function"); arch = after($0, "for") }
/bytes stack frame/ {
    stack = before($0, "bytes stack frame"); spill_st = before($0, "bytes spill stores"); spill_ld = before($0, "bytes spill loads")
}
/Used [0-9]+ registers/ {
    regs = before($0, "registers"); smem = before($0, "bytes smem")
    printf "%-30s %-7s %5s regs  %6s B static smem  %4s B stack  %4s B spill st  %4s B spill ld\n", k, arch, regs, smem, stack, spill_st, spill_ld
    if (k ~ /^(tree_attn_fwd_|tree_attn_bwd_|sdcc_)/ && (spill_st + spill_ld + stack) > 0) print "SPILL: " k " on " arch > fail_file
}' "$log" | sort

if [ -s "$tmp/fail" ]; then
    cat "$tmp/fail" >&2
    echo "attention and SDCC kernels must not spill" >&2
    exit 1
fi
echo "no spills in the attention and SDCC kernels"
