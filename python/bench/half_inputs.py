"""Benchmark (not a test): bf16 / f16 CPU tensors through
``treeattn.torch.tree_attention``, forward + backward, in one run on the
same pack:

  native        the op on the bf16 tensors as they are (the crate widens
                them in its own operand copies, computes in f32, rounds each
                result once);
  cast          what the op did before (and what a user of an f32-only op
                writes): ``.float()`` copies of q, k, v, the f32 op, the
                output cast back (autograd through the casts);
  f32           the op on float32 tensors (no casts at all: the f32 speed);
  sdpa-causal   torch SDPA ``is_causal=True`` on the bf16 tensors, same
                length (per *causal* pair: the speed of plain attention in
                bf16 on this CPU).

Before timing: native against cast, bit for bit for O (the crate's
contract for 16-bit inputs; the script stops otherwise) — within 1e-2
relative for bf16 on the ``avx512+bf16`` path, where the block products run
on bf16 pairs with P and dS rounded to bf16 (``TREEATTN_ISA=avx512`` runs
the f32 products instead, to compare).
Timing: the methods interleaved within each repetition, median of --reps
after the check (the warm-up). GFLOP/s by the median: 4·d FLOPs per pair
per head forward, x3.5 forward+backward; pairs = visible pairs (causal:
L(L+1)/2). Packs: ``bench/attention.py``'s (scripts/cpu-anchor.py's
rollouts).

    python python/bench/half_inputs.py [--tokens 8192] [--shapes compaction,grpo]
        [--heads 8] [--head-dim 64] [--dtype bfloat16] [--reps 5] [--threads N]
"""

import argparse
import importlib.util
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F

import treeattn.torch as tt

HERE = os.path.dirname(os.path.abspath(__file__))


def _attention_bench():
    spec = importlib.util.spec_from_file_location("attention_bench", os.path.join(HERE, "attention.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_pack(bench, shape, length, a):
    H, d, dt = a.heads, a.head_dim, getattr(torch, a.dtype)
    kv_end = bench.make_pack(shape, length)
    L = kv_end.shape[0]
    n_pairs = bench.visible_pairs(kv_end)
    causal_pairs = L * (L + 1) // 2
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(L, H, d, generator=g).to(dt) for _ in range(4))
    qs, ks, vs, dos = (t.transpose(0, 1)[None].contiguous() for t in (q, k, v, do))
    q32, k32, v32, do32 = (t.float() for t in (q, k, v, do))

    def fwd_bwd(f, do_, *xs):
        def go():
            leaves = [x.detach().requires_grad_() for x in xs]
            o = f(*leaves)
            o.backward(do_)
            return [o.detach()] + [x.grad for x in leaves]
        return go

    op = lambda a_, b_, c_: tt.tree_attention(a_, b_, c_, kv_end)
    cast = lambda a_, b_, c_: tt.tree_attention(a_.float(), b_.float(), c_.float(), kv_end).to(a_.dtype)
    sc = lambda a_, b_, c_: F.scaled_dot_product_attention(a_, b_, c_, is_causal=True)
    methods = {
        "native": fwd_bwd(op, do, q, k, v),
        "cast": fwd_bwd(cast, do, q, k, v),
        "f32": fwd_bwd(op, do32, q32, k32, v32),
        "sdpa-causal": fwd_bwd(sc, dos, qs, ks, vs),
    }
    # The check (and warm-up): the native route is the cast route, bit for
    # bit, but for the backward's D = rowsum(dO ∘ O), which the cast route
    # takes from the f32 O: there the two differ by that rounding.
    got, ref = methods["native"](), methods["cast"]()
    pairs = a.dtype == "bfloat16" and tt.cpu_isa() == "avx512+bf16"
    o_err = float((got[0].float() - ref[0].float()).norm() / ref[0].float().norm())
    if pairs:  # block products on bf16 pairs: within the 16-bit tolerance
        assert o_err < 1e-2, f"native O differs from the cast route's by {o_err:.2e}"
    else:
        assert torch.equal(got[0], ref[0]), "native O differs from the cast route's"
    grad_diff = max(float((x.float() - y.float()).abs().max()) for x, y in zip(got[1:], ref[1:]))
    methods["f32"]()
    methods["sdpa-causal"]()
    times = {m: [] for m in methods}
    for _ in range(a.reps):
        for m, f in methods.items():
            t0 = time.perf_counter()
            f()
            times[m].append(time.perf_counter() - t0)
    row = {"shape": shape, "tokens": L, "visible_pairs": n_pairs, "cpu_isa": tt.cpu_isa(),
           "o_rel_err_vs_cast": o_err, "grad_max_diff_vs_cast": grad_diff, "methods": {}}
    flops = 3.5 * 4 * d * H
    for m, ts in times.items():
        med = statistics.median(ts)
        n = causal_pairs if m == "sdpa-causal" else n_pairs
        row["methods"][m] = {"ms": med * 1e3, "min_ms": min(ts) * 1e3, "gflops": flops * n / med / 1e9}
    causal = row["methods"]["sdpa-causal"]["gflops"]
    print(f"\n{shape}: L = {L}, visible pairs {n_pairs} ({n_pairs / causal_pairs:.3f} of causal), "
          f"{a.dtype}, H = {H}, d = {d}, cpu path {tt.cpu_isa()}; native vs cast: O rel. err. "
          f"{o_err:.2e}, grads max |diff| {grad_diff:.3g}")
    print(f"{'method':<12} {'fwd+bwd ms':>11} {'min ms':>9} {'GFLOP/s':>9} {'/ causal':>9}")
    for m, r in row["methods"].items():
        print(f"{m:<12} {r['ms']:>11.1f} {r['min_ms']:>9.1f} {r['gflops']:>9.2f} {r['gflops'] / causal:>9.2f}")
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="8192")
    p.add_argument("--shapes", default="compaction,grpo")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="torch and treeattn threads (0: both defaults)")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
        tt.set_num_threads(a.threads)
    bench = _attention_bench()
    info = bench.machine()
    print(json.dumps(info))
    rows = [run_pack(bench, s, int(n), a) for n in a.tokens.split(",") for s in a.shapes.split(",")]
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"machine": info, "args": vars(a), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
