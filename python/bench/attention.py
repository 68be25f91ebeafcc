"""Benchmark (not a test): treeattn.torch.tree_attention on packs of
generated trees against torch SDPA with the dense boolean mask and SDPA
causal of the same length, forward and forward+backward, f32, CPU; and the
Python wrapper's overhead against the bare native call (the Rust contract
behind a PyO3 call, no torch op machinery).

    python python/bench/attention.py [--tokens 2048] [--heads 8] [--head-dim 64] [--reps 5]

Throughput counts visible (query, key) pairs only: 4·d FLOPs per pair per
head forward, 2.5x that more for backward (FlashAttention's convention,
DESIGN §7). Times: best of --reps after one warm-up.
"""

import argparse
import math
import time

import torch

import treeattn
import treeattn.torch as tt


def compaction_like(L, gen, branches=4):
    """kv_end of a compaction-shaped tree: a shared trunk (system prompt)
    and `branches` chains after it (each a re-rendered context)."""
    trunk = L // 8
    rest = L - trunk
    kv_end = torch.full((L,), L, dtype=torch.int64)
    start = trunk
    for b in range(branches):
        end = L if b == branches - 1 else start + rest // branches
        kv_end[start:end] = end
        start = end
    return kv_end


def grpo_like(L, responses=16):
    prompt = L // 4
    kv_end = torch.full((L,), L, dtype=torch.int64)
    per = (L - prompt) // responses
    start = prompt
    for r in range(responses):
        end = L if r == responses - 1 else start + per
        kv_end[start:end] = end
        start = end
    return kv_end


def best(f, reps):
    f()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    return min(ts)


def visible_pairs(kv_end):
    L = kv_end.shape[0]
    return int((kv_end - torch.arange(L)).clamp_min(0).sum())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    L, H, d = a.tokens, a.heads, a.head_dim
    gen = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, treeattn {treeattn.__version__}, torch threads {torch.get_num_threads()}, "
          f"L {L}, heads {H}, d {d}, f32, best of {a.reps}")
    print(f"{'tree':12} {'method':22} {'fwd ms':>9} {'GFLOP/s':>8} {'fwd+bwd ms':>11} {'GFLOP/s':>8}")
    for name, kv_end in (("compaction", compaction_like(L, gen)), ("grpo-16", grpo_like(L))):
        pairs = visible_pairs(kv_end)
        flops = 4 * d * pairs * H
        idx = torch.arange(L)
        dense = (idx[None, :] <= idx[:, None]) & (idx[:, None] < kv_end[None, :])
        q, k, v = (torch.randn(L, H, d, generator=gen) for _ in range(3))
        qs, ks, vs = (t.transpose(0, 1)[None].contiguous() for t in (q, k, v))
        causal_flops = 4 * d * (L * (L + 1) // 2) * H

        def fb(f, *xs):
            xs = [x.detach().requires_grad_() for x in xs]
            f(*xs).sum().backward()

        runs = [
            ("treeattn", lambda: tt.tree_attention(q, k, v, kv_end),
             lambda: fb(lambda a, b, c: tt.tree_attention(a, b, c, kv_end), q, k, v), flops),
            ("SDPA dense mask", lambda: torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=dense),
             lambda: fb(lambda a, b, c: torch.nn.functional.scaled_dot_product_attention(a, b, c, attn_mask=dense), qs, ks, vs), flops),
            ("SDPA causal (same L)", lambda: torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True),
             lambda: fb(lambda a, b, c: torch.nn.functional.scaled_dot_product_attention(a, b, c, is_causal=True), qs, ks, vs), causal_flops),
        ]
        for method, fwd, fwdbwd, fl in runs:
            tf = best(fwd, a.reps)
            tb = best(fwdbwd, a.reps)
            print(f"{name:12} {method:22} {tf * 1e3:9.2f} {fl / tf / 1e9:8.1f} {tb * 1e3:11.2f} {3.5 * fl / tb / 1e9:8.1f}")

    # Wrapper overhead: the full op against the bare native call on the same buffers.
    kv_end = compaction_like(L, gen)
    q, k, v = (torch.randn(L, H, d, generator=gen) for _ in range(3))
    ke = kv_end.to(torch.int32)
    pos = torch.zeros(L, dtype=torch.int32)
    o = torch.empty_like(q)
    lse = torch.empty(H, L)
    scale = 1 / math.sqrt(d)

    def native():
        treeattn._native.attention_forward("float32", q.data_ptr(), k.data_ptr(), v.data_ptr(), ke.data_ptr(),
                                           pos.data_ptr(), o.data_ptr(), lse.data_ptr(), L, H, H, d, scale)

    reps = max(a.reps, 10)
    t_native = best(native, reps)
    t_op = best(lambda: tt.tree_attention(q, k, v, kv_end), reps)
    print(f"overhead at L {L}: native call {t_native * 1e3:.3f} ms, tree_attention {t_op * 1e3:.3f} ms "
          f"({100 * (t_op / t_native - 1):+.1f}%)")


if __name__ == "__main__":
    main()
