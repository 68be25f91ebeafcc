"""python/bench/head.py's correctness check (no timing), so the benchmark
cannot rot: every log-prob head it compares (naive, treeattn's, TRL's fused
one; Liger only where it can run) against the float64 reference at tiny
sizes, float32 and bfloat16 weights, within the script's tolerances."""

import importlib.util
import pathlib

import pytest

pytest.importorskip("transformers")

BENCH = pathlib.Path(__file__).resolve().parents[1] / "bench" / "head.py"


def load():
    spec = importlib.util.spec_from_file_location("bench_head", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_head_bench_check():
    head = load()
    res = head.check(T=40, V=300, H=16, chunk=16)  # several treeattn row chunks
    ran = {m for (m, _d), e in res.items() if "not_run" not in e}
    # TRL must run where it is installed (its API is what the bench calls);
    # Liger's Triton kernels need a GPU, so it may not run here.
    must = {"naive", "treeattn"} | ({"trl"} if importlib.util.find_spec("trl") else set())
    assert must <= ran, res
    for (m, d), e in res.items():
        if "not_run" in e:
            continue
        assert e["ok"], (m, d, e)
        assert e["lp_max_abs"] is not None or m == "liger"
