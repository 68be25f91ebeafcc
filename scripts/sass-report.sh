#!/usr/bin/env bash
# The SASS evidence of the kernels' inner loops, for sm_90a: per kernel and
# head dim, registers and spills (cuobjdump -res-usage), the static counts of
# HMMA (tensor-core MMA) and LDSM (ldmatrix: shared-memory fragment loads) in
# the whole kernel, and the same counts inside the loop that holds the most
# HMMA (found from the backward branches of the disassembly: a BRA to a
# lower address closes a loop). HMMA / LDSM is the ratio that bounds a tile
# loop by shared-memory bandwidth (FlashAttention-2 reaches ~3.2 in its
# forward); with rolled loops the static whole-kernel count understates it,
# so the loop column is the estimate per iteration.
#
# Compiles kernels/*.cu to sm_90a cubins with the flags of build.rs (nvcc as
# scripts/ptxas-report.sh finds it); cuobjdump and nvdisasm come from PyPI
# (nvidia-cuda-cuobjdump, nvidia-cuda-nvdisasm: 13.2 reads CUDA 13.0 cubins),
# found on PATH or installed into $HOME/.cache/treeattn/cuda-tools.
set -euo pipefail
cd "$(dirname "$0")/.."

TOOLS="${TREEATTN_CUDA_TOOLS:-$HOME/.cache/treeattn/cuda-tools}"
if ! command -v cuobjdump >/dev/null || ! command -v nvdisasm >/dev/null; then
    if [ ! -x "$TOOLS/nvidia/cu13/bin/nvdisasm" ]; then
        python3 -m pip install --quiet --disable-pip-version-check --upgrade --target "$TOOLS" \
            nvidia-cuda-cuobjdump==13.2.86 nvidia-cuda-nvdisasm==13.2.78
    fi
    export PATH="$TOOLS/nvidia/cu13/bin:$PATH"
fi

NVCC="${TREEATTN_NVCC:-}"
if [ -z "$NVCC" ]; then
    NVCC=$(bash scripts/ptxas-report.sh 2>/dev/null | sed -n 's/^nvcc: \([^ ]*\) .*/\1/p' | head -1)
fi
[ -x "$NVCC" ] || { echo "nvcc not found (set TREEATTN_NVCC; see scripts/ptxas-report.sh)" >&2; exit 2; }

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "nvcc $("$NVCC" --version | tail -1 | sed 's/.*, //'), $(cuobjdump --version | tail -1 | sed 's/.*, //') cuobjdump; sm_90a"
printf '%-34s %5s %6s %7s %6s %7s  %s\n' kernel regs spill HMMA LDSM ratio "main loop: HMMA / LDSM = ratio"
for src in kernels/*.cu; do
    base=$(basename "$src" .cu)
    "$NVCC" -std=c++17 -O3 -Ikernels -gencode=arch=compute_90a,code=sm_90a -cubin "$src" -o "$tmp/$base.cubin"
    cuobjdump -res-usage "$tmp/$base.cubin" >"$tmp/$base.res"
    cuobjdump -sass "$tmp/$base.cubin" >"$tmp/$base.sass"
    python3 - "$tmp/$base.res" "$tmp/$base.sass" <<'PY'
import re, sys
res, sass = (open(p).read() for p in sys.argv[1:3])
regs, stack, fn = {}, {}, None
for line in res.splitlines():
    m = re.search(r"Function (\S+):", line)
    if m:
        fn = m.group(1)
    m = re.search(r"REG:(\d+).*STACK:(\d+)", line)
    if m and fn:
        regs[fn], stack[fn] = m.group(1), m.group(2)
for part in re.split(r"\n\s*Function : ", sass)[1:]:
    name = part.split(None, 1)[0]
    ins = []  # (address, is HMMA, is LDSM, backward-branch target)
    for line in part.splitlines():
        m = re.search(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if not m:
            continue
        a, text = int(m.group(1), 16), m.group(2)
        t = re.search(r"BRA\b.*?0x([0-9a-f]+)", text)
        back = int(t.group(1), 16) if t and int(t.group(1), 16) < a else None
        ins.append((a, "HMMA" in text, "LDSM" in text, back))
    th, tl = sum(i[1] for i in ins), sum(i[2] for i in ins)
    best = None  # the loop with the most HMMA (fewest LDSM on a tie)
    for a, _, _, back in ins:
        if back is None:
            continue
        h = sum(i[1] for i in ins if back <= i[0] <= a)
        l = sum(i[2] for i in ins if back <= i[0] <= a)
        if h and (best is None or (h, -l) > (best[0], -best[1])):
            best = (h, l)
    loop = f"{best[0]} / {best[1]} = {best[0] / best[1]:.2f}" if best and best[1] else "-"
    ratio = f"{th / tl:.2f}" if tl else "-"
    print(f"{name:<34} {regs.get(name, '?'):>5} {stack.get(name, '?'):>6} {th:>7} {tl:>6} {ratio:>7}  {loop}")
PY
done | sort
echo "spill = stack frame bytes (0: no spills); HMMA / LDSM counts are static instructions"
