"""Benchmark (not a test): a sliding window on a tree pack, CPU, float32,
in one run on the same pack:

  window        treeattn.torch.tree_attention(..., window=W) (the window of
                W tree levels), per *visible* pair under the window;
  no-window     the same op on the same pack without a window, per visible
                pair of the tree;
  sdpa-window   torch SDPA with the dense boolean mask of the tree under the
                window (what a torch user has), per visible pair under the
                window;
  sdpa-causal   torch SDPA, is_causal=True, same length, per causal pair
                (the speed of plain attention, for scale).

Forward and forward+backward (``.backward(dO)``), interleaved within each
repetition; median and min of --reps after the checks (the warm-up): the
op's output and gradients against SDPA with the dense windowed mask (max abs
diff; stops if they disagree). GFLOP/s by the median: 4·d FLOPs per pair per
head forward, 3.5x forward+backward. The pack: scripts/cpu-anchor.py's
compaction rollout (BENCHMARKS §10), about --tokens trie tokens.

    python python/bench/windowed.py [--tokens 4096] [--window 1024] [--heads 8]
        [--head-dim 64] [--reps 5] [--threads N] [--json out.json]
"""

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import treeattn.torch as tt

HERE = os.path.dirname(os.path.abspath(__file__))


def _attention_bench():
    """python/bench/attention.py: its pack builder and machine report."""
    spec = importlib.util.spec_from_file_location("bench_attention", os.path.join(HERE, "attention.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def dense_window_mask(mask, window):
    dep = mask.depths()
    return mask.dense() & (dep[:, None] - dep[None, :] < window)


def timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
        tt.set_num_threads(args.threads)
    ab = _attention_bench()
    kv_end = ab.make_pack("compaction", args.tokens)
    L, H, d, W = kv_end.shape[0], args.heads, args.head_dim, args.window
    mask = tt.MaskPlan(kv_end)
    dense_w = dense_window_mask(mask, W)
    pairs_tree = ab.visible_pairs(kv_end)
    pairs_window = int(dense_w.sum())
    pairs_causal = L * (L + 1) // 2
    depth = int(mask.depths().max())
    print(f"compaction pack: L = {L}, depth up to {depth}, window {W} levels; visible pairs: tree {pairs_tree:,}, "
          f"under the window {pairs_window:,} ({pairs_window / pairs_tree:.2f} of the tree's)")

    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(L, H, d, generator=g) for _ in range(4))

    def leaf(*ts):
        return [t.detach().clone().requires_grad_() for t in ts]

    def op(window, bwd):
        def run():
            qq, kk, vv = leaf(q, k, v) if bwd else (q, k, v)
            o = tt.tree_attention(qq, kk, vv, mask, window=window)
            if bwd:
                o.backward(do)
        return run

    def sdpa(m, causal, bwd):
        def run():
            qq, kk, vv = leaf(q, k, v) if bwd else (q, k, v)
            o = F.scaled_dot_product_attention(
                qq.transpose(0, 1), kk.transpose(0, 1), vv.transpose(0, 1),
                attn_mask=None if causal else m, is_causal=causal,
            ).transpose(0, 1)
            if bwd:
                o.backward(do)
        return run

    # Checks (and warm-up): the windowed op against SDPA with the dense windowed mask.
    qq, kk, vv = leaf(q, k, v)
    o = tt.tree_attention(qq, kk, vv, mask, window=W)
    o.backward(do)
    rq, rk, rv = leaf(q, k, v)
    r = F.scaled_dot_product_attention(rq.transpose(0, 1), rk.transpose(0, 1), rv.transpose(0, 1),
                                       attn_mask=dense_w).transpose(0, 1)
    r.backward(do)
    diffs = [ab.maxdiff(o.detach(), r.detach()), ab.maxdiff(qq.grad, rq.grad), ab.maxdiff(kk.grad, rk.grad),
             ab.maxdiff(vv.grad, rv.grad)]
    print("check against SDPA with the dense windowed mask, max abs diff (O, dQ, dK, dV):",
          " ".join(f"{x:.1e}" for x in diffs))
    if max(diffs) > 1e-3:
        sys.exit("the windowed op disagrees with SDPA: not timing a wrong result")
    for f in (op(None, True), sdpa(None, True, True)):
        f()

    methods = [
        ("window", lambda b: op(W, b), pairs_window),
        ("no-window", lambda b: op(None, b), pairs_tree),
        ("sdpa-window", lambda b: sdpa(dense_w, False, b), pairs_window),
        ("sdpa-causal", lambda b: sdpa(None, True, b), pairs_causal),
    ]
    times = {(name, b): [] for name, _, _ in methods for b in (False, True)}
    for _ in range(args.reps):
        for bwd in (False, True):
            for name, make, _ in methods:
                times[(name, bwd)].append(timed(make(bwd)))
    rows = []
    print(f"\n{'method':<12} {'pass':<8} {'median ms':>10} {'min ms':>8} {'GFLOP/s':>8} {'× window':>9}")
    for bwd in (False, True):
        ref = statistics.median(times[("window", bwd)])
        for name, _, pairs in methods:
            t = times[(name, bwd)]
            med = statistics.median(t)
            flops = 4 * d * H * pairs * (3.5 if bwd else 1.0)
            row = dict(method=name, pass_="fwd+bwd" if bwd else "fwd", median_ms=med * 1e3, min_ms=min(t) * 1e3,
                       gflops=flops / med / 1e9, pairs=pairs, time_vs_window=med / ref)
            rows.append(row)
            print(f"{name:<12} {row['pass_']:<8} {row['median_ms']:>10.2f} {row['min_ms']:>8.2f} "
                  f"{row['gflops']:>8.1f} {row['time_vs_window']:>8.2f}x")
    info = ab.machine()
    print("\nmachine:", json.dumps(info))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), L=L, depth=depth, rows=rows, checks=diffs, machine=info), f, indent=1)


if __name__ == "__main__":
    main()
