#!/usr/bin/env bash
# Builds, on a machine with Rust and no GPU, everything the GPU check
# (scripts/gpu-check.sh) runs on a GPU machine that has CUDA 13 and
# PyTorch but no Rust, into target/gpu-carry/ (carry that folder):
#   treeattn                  the CLI with the `cuda` feature (gpu-check);
#   libtreeattn_capi.so       the C ABI with `cuda`;
#   capi-device               capi/tests/c/device.c linked against it
#                             (RUNPATH $ORIGIN: it finds the library beside it);
#   treeattn-*.whl            the Python extension with `cuda` (abi3),
#                             for python/tests/test_cuda.py;
#   wheels/                   pytest and its dependencies (pure Python).
# Needs nvcc 13 (TREEATTN_NVCC, or the pinned PyPI set of .ci/run) and, for
# the wheel, maturin (TREEATTN_PY: a python with maturin; default: the CI
# venv).
set -euo pipefail
cd "$(dirname "$0")/.."

CUDA_SITE="${TREEATTN_CUDA_SITE:-$HOME/.cache/treeattn/cuda-13.0}"
export TREEATTN_NVCC="${TREEATTN_NVCC:-$CUDA_SITE/nvidia/cu13/bin/nvcc}"
PY="${TREEATTN_PY:-$HOME/.cache/treeattn/venv-ci/bin/python}"
OUT_DIR=target/gpu-carry
# The cargo target folder (.ci/run passes its own to reuse its cuda build).
T=${GPU_BUILD_TARGET:-target/cuda}
rm -rf "$OUT_DIR.tmp"
mkdir -p "$OUT_DIR.tmp"

echo "== treeattn CLI and C ABI (release, cuda)"
CARGO_TARGET_DIR=$T cargo build --release -p treeattn-lab --features cuda --bin treeattn
CARGO_TARGET_DIR=$T cargo build --release -p treeattn-capi --features cuda
cp "$T/release/treeattn" "$T/release/libtreeattn_capi.so" "$OUT_DIR.tmp/"

echo "== the C device program"
${CC:-cc} -std=c99 -O1 -Wall -Wextra -Werror -pedantic -Iinclude capi/tests/c/device.c \
  -o "$OUT_DIR.tmp/capi-device" -L"$OUT_DIR.tmp" -ltreeattn_capi \
  -Wl,-rpath,'$ORIGIN' -lm -ldl

echo "== the Python wheel (cuda)"
"$PY" -m maturin build --release --features cuda -m python/Cargo.toml \
  --out "$OUT_DIR.tmp" --quiet

echo "== pytest wheels (the GPU machine may lack pytest; it has no index)"
"$PY" -m pip download --quiet --disable-pip-version-check --dest "$OUT_DIR.tmp/wheels" pytest

rm -rf "$OUT_DIR"
mv "$OUT_DIR.tmp" "$OUT_DIR"
ls -la "$OUT_DIR"
