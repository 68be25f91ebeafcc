#!/usr/bin/env bash
# Builds the Python package's wheel once, on a machine with a Rust toolchain,
# into dist/: treeattn-<version>-cp39-abi3-<platform>.whl, one wheel for
# every CPython >= 3.9 on this platform (PyO3's stable ABI), so that
#   pip install dist/treeattn-*.whl
# needs no Rust toolchain where it runs (what pydantic-core and tokenizers
# ship to PyPI). Then, to check it, in a fresh venv:
#   pip install "dist/treeattn-<version>-cp39-abi3-<platform>.whl[hf]"
#
#   scripts/build-wheels.sh            CPU wheel (manylinux-compatible tag, as maturin infers)
#   scripts/build-wheels.sh --cuda     with the crate's `cuda` feature (nvcc 13 at build time:
#                                      TREEATTN_NVCC, or the pinned PyPI set of .ci/run)
# The python used: TREEATTN_PY, else a `python3` with maturin (pip install maturin==1.16.0).
set -euo pipefail
cd "$(dirname "$0")/.."

features=()
case "${1:-}" in
  "") ;;
  --cuda) features=(--features cuda) ;;
  *) echo "usage: $0 [--cuda]" >&2; exit 2 ;;
esac
PY="${TREEATTN_PY:-python3}"
if ! "$PY" -m maturin --version >/dev/null 2>&1; then
  echo "$PY has no maturin: pip install maturin==1.16.0 (or set TREEATTN_PY)" >&2
  exit 1
fi
# Built into a temporary folder and moved into dist/ when complete: an
# interrupted build leaves no half-written wheel behind.
tmp=$(mktemp -d dist.tmp.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
"$PY" -m maturin build --release "${features[@]}" -m python/Cargo.toml --out "$tmp" --quiet
mkdir -p dist
for w in "$tmp"/*.whl; do
  mv -f "$w" dist/
  echo "dist/$(basename "$w")"
done
