"""Benchmark (not a test): treeattn.torch.tree_attention against what a
PyTorch user has on CPU, on the same packs in one run, f32:

  treeattn      the op (``treeattn.torch.tree_attention``, autograd);
  sdpa-dense    torch SDPA with the dense boolean tree mask k <= q < kv_end[k]
                (the 4D-mask route; per visible pair);
  sdpa-causal   torch SDPA, is_causal=True, same length (per *causal* pair:
                the speed of plain attention);
  flex          torch FlexAttention with a block mask from the same rule,
                compiled with torch.compile (eager if the compile fails; the
                table says which). Forward only: its fwd+bwd row is timed if
                the installed torch runs it, else reported "n/a".

Forward and forward+backward (``.backward(dO)`` from fresh leaf tensors).
Before any timing, per pack: the op's output and its gradients against SDPA
with the dense mask, and FlexAttention's output against the op (max abs
diff; the script stops if they disagree: a benchmark of a wrong result is
worthless). First of all (it is short), the Python call's overhead: the op
against the bare native call (``treeattn._native.attention_forward``, the
Rust contract behind one PyO3 call) on the same buffers, a GRPO pack of
--overhead-tokens, forward, interleaved pairs; and the fixed cost per call
at L = 16. FlexAttention's CPU backward is probed once on a tiny input
with eager flex_attention (calling the *compiled* function with
requires_grad=True, which raises, leaves it ~20x slower on every later call).

Packs: ``treeattn.pack`` on the rollouts of ``scripts/cpu-anchor.py`` (the
packs of BENCHMARKS §10): one compaction tree and one GRPO group of 16
responses (``share_prefixes``), each sized to about L trie tokens.

Timing: the methods run interleaved within each repetition (op, dense,
causal, flex forward, then their fwd+bwd, then the next repetition), so a
drift of the machine's load hits all alike; median and min of --reps after
the correctness checks (which are the warm-up). GFLOP/s by the median:
4·d FLOPs per pair per head forward, 3.5x that forward+backward
(FlashAttention's count), pairs = visible pairs (causal: L(L+1)/2).

SDPA with the dense mask needs the L x L bool mask plus float buffers of
about that size (measured here: ~5·L² bytes beyond the mask for fwd+bwd on
torch 2.15's CPU flash path); the script estimates 9·L² bytes + tensors and
skips it, saying why, when that is more than --mem-fraction of
MemAvailable. Eager FlexAttention materialises scores (~3·H·L²·4 bytes),
checked the same way.

    python python/bench/attention.py [--tokens 4096,8192,16384] [--shapes compaction,grpo]
        [--heads 8] [--head-dim 64] [--reps 5] [--threads N] [--no-flex]
        [--overhead-tokens 2048] [--overhead-reps 40] [--json out.json]
"""

import argparse
import datetime
import importlib.util
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

import treeattn
import treeattn.torch as tt

HERE = os.path.dirname(os.path.abspath(__file__))


def _anchor():
    """scripts/cpu-anchor.py's rollout generators (the packs of §10)."""
    path = os.path.join(HERE, "..", "..", "scripts", "cpu-anchor.py")
    spec = importlib.util.spec_from_file_location("cpu_anchor", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def make_pack(shape, length):
    a = _anchor()
    if shape == "compaction":
        p = treeattn.pack(a.compaction_rollout(length, 7))
    elif shape == "grpo":
        p = treeattn.pack(a.grpo_rollouts(length, 7), share_prefixes=True)
    else:
        raise ValueError(f"shape {shape!r}: expected compaction or grpo")
    assert len(p) == 1
    return p[0].kv_end.to(torch.int64)


def visible_pairs(kv_end):
    L = kv_end.shape[0]
    return int((kv_end - torch.arange(L)).clamp_min(0).sum())


def mem_available():
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def machine():
    info = {"date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")}
    try:
        info["loadavg"] = open("/proc/loadavg").read().split()[:3]
    except OSError:
        info["loadavg"] = None
    info["uptime"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    model, flags = platform.processor() or platform.machine(), []
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        for line in out.splitlines():
            key, _, val = line.partition(":")
            if key.strip() == "Model name":
                model = val.strip()
            elif key.strip() == "Flags":
                flags = val.split()
    except OSError:
        pass
    info["cpu"] = model
    info["simd_flags"] = [f for f in flags if f.startswith(("avx", "fma", "amx"))]
    info["avx512"] = any(f.startswith("avx512") for f in flags)
    info["cpus"] = os.cpu_count()
    info["mem_available_gb"] = round((mem_available() or 0) / 2**30, 1)
    info["torch"] = torch.__version__
    info["torch_threads"] = torch.get_num_threads()
    info["treeattn"] = treeattn.__version__
    info["treeattn_threads"] = tt.get_num_threads()
    info["python"] = platform.python_version()
    return info


def maxdiff(a, b):
    return float((a - b).abs().max())


FLEX_BACKWARD = [None]  # None: FlexAttention's CPU backward runs; else why not


def probe_flex_backward():
    """Does the installed torch run FlexAttention's backward on CPU? Probed on a
    tiny input with eager flex_attention (not the compiled function used for
    timing: a call with requires_grad=True that raises inside a compiled
    function leaves it recompiling on every later call)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    n = 128
    bm = create_block_mask(lambda b, h, qi, ki: ki <= qi, 1, 1, n, n, device="cpu")
    x = torch.randn(1, 1, n, 16, requires_grad=True)
    try:
        flex_attention(x, x, x, block_mask=bm).sum().backward()
        FLEX_BACKWARD[0] = None
    except Exception as e:
        FLEX_BACKWARD[0] = f"n/a ({type(e).__name__}: {str(e).strip().splitlines()[0][:120]})"


def run_pack(shape, length, a, info):
    H, d = a.heads, a.head_dim
    kv_end = make_pack(shape, length)
    L = kv_end.shape[0]
    pairs = visible_pairs(kv_end)
    causal_pairs = L * (L + 1) // 2
    g = torch.Generator().manual_seed(0)
    # The op's layout [L, H, d]; SDPA / Flex get [1, H, L, d] copies (each its own layout, contiguous).
    q, k, v, do = (torch.randn(L, H, d, generator=g) for _ in range(4))
    qs, ks, vs, dos = (t.transpose(0, 1)[None].contiguous() for t in (q, k, v, do))
    row = {"shape": shape, "tokens": L, "visible_pairs": pairs, "visible_share": pairs / causal_pairs,
           "methods": {}, "checks": {}, "skipped": {}}
    print(f"\n{shape}: L = {L}, visible pairs {pairs} ({pairs / causal_pairs:.3f} of causal)", flush=True)

    avail = mem_available() or 0
    tensors = 16 * H * L * d * 4  # q, k, v, dO, outputs, gradients, copies
    dense = None
    need = 9 * L * L + tensors
    if need > a.mem_fraction * avail:
        row["skipped"]["sdpa-dense"] = (f"needs ~{need / 2**30:.1f} GiB (L^2 bool mask + float buffers), "
                                        f"{a.mem_fraction:.0%} of MemAvailable is {a.mem_fraction * avail / 2**30:.1f} GiB")
    else:
        idx = torch.arange(L)
        dense = (idx[None, :] <= idx[:, None]) & (idx[:, None] < kv_end[None, :])  # [q, k]

    def fwd_bwd(f, do_, *xs):
        def go():
            leaves = [x.detach().requires_grad_() for x in xs]
            f(*leaves).backward(do_)
            return [x.grad for x in leaves]
        return go

    op = lambda a_, b_, c_: tt.tree_attention(a_, b_, c_, kv_end)
    sd = lambda a_, b_, c_: F.scaled_dot_product_attention(a_, b_, c_, attn_mask=dense)
    sc = lambda a_, b_, c_: F.scaled_dot_product_attention(a_, b_, c_, is_causal=True)

    # Correctness first (also the warm-up of every path).
    o_op = op(q, k, v)
    g_op = fwd_bwd(op, do, q, k, v)()
    if dense is not None:
        with torch.no_grad():
            o_sd = sd(qs, ks, vs)
        g_sd = fwd_bwd(sd, dos, qs, ks, vs)()
        to_op = lambda t: t[0].transpose(0, 1)
        row["checks"]["op_vs_sdpa_dense_fwd"] = maxdiff(o_op, to_op(o_sd))
        row["checks"]["op_vs_sdpa_dense_grad"] = max(maxdiff(x, to_op(y)) for x, y in zip(g_op, g_sd))
        del o_sd, g_sd
    with torch.no_grad():
        o_sc = sc(qs, ks, vs)
    fwd_bwd(sc, dos, qs, ks, vs)()
    # The tree hides keys that causal shows: the two must differ (the mask is not a no-op).
    row["checks"]["op_vs_sdpa_causal_fwd"] = maxdiff(o_op, o_sc[0].transpose(0, 1))
    del o_sc

    flex_fwd = flex_fb = None
    if not a.no_flex:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        ends = kv_end

        def mask_mod(b, h, qi, ki):
            return (ki <= qi) & (qi < ends[ki])

        torch._dynamo.reset()  # a fresh compile per pack: no recompile limit, no stale guards
        t0 = time.perf_counter()
        bm = create_block_mask(mask_mod, 1, 1, L, L, device="cpu")
        mode = "compiled"
        try:
            fl = torch.compile(flex_attention, dynamic=False)
            with torch.no_grad():
                o_fl = fl(qs, ks, vs, block_mask=bm)
        except Exception as e:  # a compiler failure is a result to report
            err = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160]}"
            eager_need = 3 * H * L * L * 4 + tensors
            if eager_need > a.mem_fraction * avail:
                row["skipped"]["flex"] = f"compile failed ({err}); eager would need ~{eager_need / 2**30:.1f} GiB"
                fl = None
            else:
                mode = f"eager (compile failed: {err})"
                fl = flex_attention
                with torch.no_grad():
                    o_fl = fl(qs, ks, vs, block_mask=bm)
        if fl is not None:
            row["flex_mode"] = mode
            row["flex_setup_s"] = time.perf_counter() - t0
            row["checks"]["flex_vs_op_fwd"] = maxdiff(o_op, o_fl[0].transpose(0, 1))
            del o_fl

            def flex_fwd():
                with torch.no_grad():
                    return fl(qs, ks, vs, block_mask=bm)

            if FLEX_BACKWARD[0] is None:
                flex_fb = fwd_bwd(lambda a_, b_, c_: fl(a_, b_, c_, block_mask=bm), dos, qs, ks, vs)
                flex_fb()  # warm-up (compiles the backward)
            else:
                row["flex_backward"] = FLEX_BACKWARD[0]
            print(f"  flex: {mode}, block mask + compile + first call {row['flex_setup_s']:.1f} s"
                  + (f"; backward: {row['flex_backward']}" if "flex_backward" in row else ""), flush=True)

    print("  checks: " + ", ".join(f"{k} {v:.2e}" for k, v in row["checks"].items()), flush=True)
    for name, why in row["skipped"].items():
        print(f"  skipped {name}: {why}", flush=True)
    bad = [k for k, v in row["checks"].items() if k != "op_vs_sdpa_causal_fwd" and not v <= a.tol]
    if bad:
        raise SystemExit(f"outputs disagree on {shape} L={L}: {bad} (tolerance {a.tol}); not timing a wrong result")
    if row["checks"]["op_vs_sdpa_causal_fwd"] < 1e-3:
        raise SystemExit(f"{shape} L={L}: the tree output equals causal's; the mask is not applied")

    # (method, pass) -> (callable, pairs counted)
    runs = {("treeattn", "fwd"): (lambda: op(q, k, v), pairs)}
    if dense is not None:
        runs[("sdpa-dense", "fwd")] = (lambda: sd(qs, ks, vs), pairs)
    runs[("sdpa-causal", "fwd")] = (lambda: sc(qs, ks, vs), causal_pairs)
    if flex_fwd is not None:
        runs[("flex", "fwd")] = (flex_fwd, pairs)
    runs[("treeattn", "fwd+bwd")] = (fwd_bwd(op, do, q, k, v), pairs)
    if dense is not None:
        runs[("sdpa-dense", "fwd+bwd")] = (fwd_bwd(sd, dos, qs, ks, vs), pairs)
    runs[("sdpa-causal", "fwd+bwd")] = (fwd_bwd(sc, dos, qs, ks, vs), causal_pairs)
    if flex_fb is not None:
        runs[("flex", "fwd+bwd")] = (flex_fb, pairs)

    times = {key: [] for key in runs}
    for _ in range(a.reps):
        for key, (f, _) in runs.items():
            if key[1] == "fwd":
                with torch.no_grad():
                    t0 = time.perf_counter()
                    f()
                    dt = time.perf_counter() - t0
            else:
                t0 = time.perf_counter()
                f()
                dt = time.perf_counter() - t0
            times[key].append(dt)
    row["maxrss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    row["loadavg_after"] = open("/proc/loadavg").read().split()[:3]

    for (m, p), ts in times.items():
        med = statistics.median(ts)
        fl_count = 4 * d * H * runs[(m, p)][1] * (3.5 if p == "fwd+bwd" else 1)
        row["methods"].setdefault(m, {})[p] = {"median_ms": med * 1e3, "min_ms": min(ts) * 1e3,
                                               "gflops": fl_count / med / 1e9, "times_ms": [t * 1e3 for t in ts]}
    if "flex" in row["methods"] and "fwd+bwd" not in row["methods"]["flex"]:
        row["methods"]["flex"]["fwd+bwd"] = row.get("flex_backward", "n/a")
    for m in ("sdpa-dense", "flex"):
        if m in row["skipped"]:
            row["methods"][m] = {"skipped": row["skipped"][m]}

    print(f"  {'method':<12} {'pass':<8} {'median ms':>10} {'min ms':>10} {'GF/s':>7} {'op speed-up':>12}")
    for m, passes in row["methods"].items():
        for p in ("fwd", "fwd+bwd"):
            r = passes.get(p)
            if isinstance(r, dict):
                opm = row["methods"]["treeattn"][p]["median_ms"]
                print(f"  {m:<12} {p:<8} {r['median_ms']:>10.1f} {r['min_ms']:>10.1f} {r['gflops']:>7.1f} "
                      f"{r['median_ms'] / opm:>11.2f}x", flush=True)
            elif r is not None:
                print(f"  {m:<12} {p:<8} {r}", flush=True)
            elif "skipped" in passes:
                print(f"  {m:<12} {p:<8} skipped: {passes['skipped']}", flush=True)
                break
    print(f"  peak RSS so far {row['maxrss_gb']:.2f} GiB; load after {' '.join(row['loadavg_after'])}", flush=True)
    return row


def overhead(a):
    """The op against the bare native call on the same buffers, interleaved."""
    H, d = a.heads, a.head_dim
    kv_end = make_pack("grpo", a.overhead_tokens)  # exactly --overhead-tokens long
    L = kv_end.shape[0]
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(L, H, d, generator=g) for _ in range(3))
    ke = kv_end.to(torch.int32)
    pos = torch.zeros(L, dtype=torch.int32)
    o = torch.empty_like(q)
    lse = torch.empty(H, L)
    scale = 1 / math.sqrt(d)
    thr = tt.get_num_threads()

    def native():
        treeattn._native.attention_forward("float32", q.data_ptr(), k.data_ptr(), v.data_ptr(), ke.data_ptr(),
                                           pos.data_ptr(), o.data_ptr(), lse.data_ptr(), L, H, H, d, scale,
                                           None, None, thr)

    op = lambda: tt.tree_attention(q, k, v, kv_end)
    native()
    diff = maxdiff(op(), o)  # same buffers, same kernel: must be bit-equal
    tn, to = [], []
    for _ in range(a.overhead_reps):
        for f, ts in ((native, tn), (op, to)):
            t0 = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t0)
    r = {"tokens": L, "reps": a.overhead_reps, "op_vs_native_maxdiff": diff,
         "native_median_ms": statistics.median(tn) * 1e3, "native_min_ms": min(tn) * 1e3,
         "op_median_ms": statistics.median(to) * 1e3, "op_min_ms": min(to) * 1e3}
    r["overhead_median_pct"] = 100 * (r["op_median_ms"] / r["native_median_ms"] - 1)
    r["overhead_min_pct"] = 100 * (r["op_min_ms"] / r["native_min_ms"] - 1)
    # Paired: per repetition, op minus native (adjacent calls see the same load).
    r["paired_median_ms"] = statistics.median(b - c for b, c in zip(to, tn)) * 1e3
    print(f"\noverhead at L = {L} (GRPO pack, forward, {a.overhead_reps} interleaved pairs; "
          f"op == native: max diff {diff:.1e}):\n"
          f"  native call median {r['native_median_ms']:.2f} ms, min {r['native_min_ms']:.2f} ms\n"
          f"  tree_attention median {r['op_median_ms']:.2f} ms, min {r['op_min_ms']:.2f} ms\n"
          f"  overhead: {r['overhead_median_pct']:+.1f}% by median, {r['overhead_min_pct']:+.1f}% by min, "
          f"paired median difference {r['paired_median_ms']:+.3f} ms", flush=True)

    # The fixed cost itself, where the kernel is negligible.
    Ls = 16
    ke_s = torch.full((Ls,), Ls, dtype=torch.int64)
    qs_, ks_, vs_ = (torch.randn(Ls, H, d, generator=g) for _ in range(3))
    ke32 = ke_s.to(torch.int32)
    pos_s = torch.zeros(Ls, dtype=torch.int32)
    o_s, lse_s = torch.empty_like(qs_), torch.empty(H, Ls)

    def native_s():
        treeattn._native.attention_forward("float32", qs_.data_ptr(), ks_.data_ptr(), vs_.data_ptr(),
                                           ke32.data_ptr(), pos_s.data_ptr(), o_s.data_ptr(), lse_s.data_ptr(),
                                           Ls, H, H, d, scale, None, None, thr)

    n = 2000
    res = {}
    for name, f in (("native", native_s), ("op", lambda: tt.tree_attention(qs_, ks_, vs_, ke_s))) * 2:
        f()
        t0 = time.perf_counter()
        for _ in range(n):
            f()
        res[name] = (time.perf_counter() - t0) / n * 1e6  # the second round is kept
    r["fixed_us"] = {"tokens": Ls, "calls": n, "native_us": res["native"], "op_us": res["op"]}
    print(f"  fixed cost at L = {Ls} ({n} calls each): native {res['native']:.0f} us, op {res['op']:.0f} us per call "
          f"(op - native {res['op'] - res['native']:.0f} us = "
          f"{100 * (res['op'] - res['native']) * 1e-3 / r['native_median_ms']:.1f}% of the L = {L} native median)",
          flush=True)
    return r


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="4096,8192,16384", help="comma-separated trie lengths")
    ap.add_argument("--shapes", default="compaction,grpo")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=os.cpu_count(),
                    help="torch threads and the crate's threads (the same for both)")
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--tol", type=float, default=1e-4, help="max abs diff allowed in the checks")
    ap.add_argument("--mem-fraction", type=float, default=0.6,
                    help="skip a method whose estimated memory exceeds this share of MemAvailable")
    ap.add_argument("--overhead-tokens", type=int, default=2048)
    ap.add_argument("--overhead-reps", type=int, default=40)
    ap.add_argument("--no-overhead", action="store_true")
    ap.add_argument("--json", help="also write the results as JSON here")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    tt.set_num_threads(a.threads)

    info = machine()
    print(f"# python/bench/attention.py, {info['date_utc']} UTC\n"
          f"# {info['uptime']}\n"
          f"# CPU: {info['cpu']}, {info['cpus']} logical CPUs, AVX-512: {'yes' if info['avx512'] else 'no'} "
          f"({' '.join(info['simd_flags'])}); MemAvailable {info['mem_available_gb']} GiB\n"
          f"# torch {info['torch']} ({info['torch_threads']} threads), treeattn {info['treeattn']} "
          f"({a.threads} threads), Python {info['python']}\n"
          f"# f32, {a.heads} heads x d {a.head_dim}, median/min of {a.reps} interleaved reps", flush=True)
    if not a.no_flex:
        probe_flex_backward()
        print(f"# FlexAttention CPU backward: {FLEX_BACKWARD[0] or 'runs (timed)'}", flush=True)
    # The overhead first: it is short, and a long run cut off still has it.
    ov = None if a.no_overhead else overhead(a)
    rows = []
    for length in (int(x) for x in a.tokens.split(",")):
        for shape in a.shapes.split(","):
            rows.append(run_pack(shape, length, a, info))
    info["loadavg_end"] = open("/proc/loadavg").read().split()[:3]
    print(f"\n# end {datetime.datetime.now(datetime.timezone.utc):%H:%M:%S} UTC, "
          f"load average {' '.join(info['loadavg_end'])}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"machine": info, "args": vars(a), "rows": rows, "overhead": ov}, f, indent=1)


if __name__ == "__main__":
    main()
