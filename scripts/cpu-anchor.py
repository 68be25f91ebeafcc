#!/usr/bin/env python3
"""CPU anchor: treeattn against what a PyTorch user has, on the same packs, in one run.

For each tree shape and length it writes rollouts (JSONL), packs them with
`treeattn pack`, and times on that very pack, f32, the same thread count:

  sdpa-causal   torch scaled_dot_product_attention, is_causal=True, same length
                (per *causal* pair: the speed of plain attention);
  sdpa-dense    torch SDPA with the dense boolean tree mask k <= q < kv_end[k]
                (per visible pair; what a 4D-mask user runs today);
  flex          torch FlexAttention, compiled, block mask from the same rule
                (forward only: it has no CPU backward);
  treeattn      `treeattn bench --pack FILE --json` (per visible pair).

GFLOP/s count 4*d per pair per query head forward, x3.5 forward+backward
(FlashAttention's count), by wall time, median of --reps after one warm-up.
The table gives each method's GFLOP/s and its ratio to sdpa-causal.

Shapes (one tree each, sized to --lengths trie tokens):
  compaction  a system prompt, turns of tool output + completion, compaction
              (summary + the last 2 turns kept) whenever the live context
              passes a third of the length: one tree with a few long branches;
  grpo        one prompt shared by 16 sampled responses (--share-prefixes).

Needs: torch (with FlexAttention), safetensors, numpy; a release build of
treeattn (`cargo build --release`). Example:

  python3 scripts/cpu-anchor.py --threads 2 --lengths 8192,16384 --reps 3

At 16-32k SDPA with the dense mask takes minutes per call: `--no-dense`
leaves it (and FlexAttention) out and times SDPA causal and treeattn only.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time


def compaction_rollout(length, seed):
    """One compaction rollout whose trie holds about `length` tokens."""
    import random

    rng = random.Random(seed)
    tok = lambda n: [rng.randrange(100, 30000) for _ in range(n)]
    system = tok(max(64, length // 10))
    window = max(512, length // 3)
    turn_in, turn_out = 192, 64
    calls, turns, summary = [], [], []
    trie = len(system)
    seq = list(system)
    while trie < length:
        live = sum(len(t) for t in turns) + len(summary) + len(system)
        if live > window and len(turns) > 2:
            # The summary call: its completion is the summary.
            ctx = system + summary + [t for turn in turns for t in turn] + [1]
            s = tok(128)
            calls.append({"context": ctx, "completion": s})
            trie += 1 + len(s)
            summary, turns = [2] + s, turns[-2:]
            # The next context re-renders the summary and the kept turns.
            seq = system + summary + [t for turn in turns for t in turn]
            trie += len(seq) - len(system)
        new_in, new_out = tok(turn_in), tok(turn_out)
        ctx = seq + new_in
        calls.append({"context": ctx, "completion": new_out})
        turns.append(new_in + new_out)
        seq = ctx + new_out
        trie += turn_in + turn_out
    return [{"id": f"compaction-{seed}", "calls": calls}]


def grpo_rollouts(length, seed):
    """16 responses sharing one prompt: about `length` tokens with prefixes shared."""
    import random

    rng = random.Random(seed)
    tok = lambda n: [rng.randrange(100, 30000) for _ in range(n)]
    prompt = tok(length // 4)
    resp = (length - len(prompt)) // 16
    return [
        {"id": f"grpo-{seed}-{i:02d}", "calls": [{"context": prompt, "completion": tok(resp)}]}
        for i in range(16)
    ]


def make_pack(treeattn, shape, length, workdir):
    rollouts = (compaction_rollout if shape == "compaction" else grpo_rollouts)(length, 7)
    jsonl = os.path.join(workdir, f"{shape}-{length}.jsonl")
    with open(jsonl, "w") as f:
        for r in rollouts:
            f.write(json.dumps(r) + "\n")
    out = os.path.join(workdir, f"{shape}-{length}.safetensors")
    cmd = [treeattn, "pack", jsonl, "--out", out] + (["--share-prefixes"] if shape == "grpo" else ["--no-share-prefixes"])
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    from safetensors.numpy import load_file

    t = load_file(out)
    return out, t["kv_end"].astype("int64"), t["position_ids"].astype("int64")


def median_ms(fn, reps):
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def torch_side(kv_end, heads, head_dim, reps, flex, dense_mask=True):
    import torch
    import torch.nn.functional as F

    L = len(kv_end)
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, heads, L, head_dim, generator=g) for _ in range(4))
    ends = torch.from_numpy(kv_end)
    pos = torch.arange(L)
    dense = (pos[None, :] <= pos[:, None]) & (pos[:, None] < ends[None, :])  # [q, k]
    res = {}

    def fwd_bwd(run):
        def go():
            qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
            run(qq, kk, vv).backward(do)

        return go

    causal = lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True)
    masked = lambda a, b, c: F.scaled_dot_product_attention(a, b, c, attn_mask=dense)
    with torch.no_grad():
        res["sdpa-causal"] = [median_ms(lambda: causal(q, k, v), reps)]
    res["sdpa-causal"].append(median_ms(fwd_bwd(causal), reps))
    if not dense_mask:
        return res
    with torch.no_grad():
        res["sdpa-dense"] = [median_ms(lambda: masked(q, k, v), reps)]
    res["sdpa-dense"].append(median_ms(fwd_bwd(masked), reps))
    # Sanity: the dense-mask output differs from causal wherever the tree hides keys.
    with torch.no_grad():
        res["_dense_vs_causal"] = float((masked(q, k, v) - causal(q, k, v)).abs().max())
    if flex:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        def mask_mod(b, h, qi, ki):
            return (ki <= qi) & (qi < ends[ki])

        try:
            bm = create_block_mask(mask_mod, 1, 1, L, L, device="cpu")
            compiled = torch.compile(flex_attention)
            with torch.no_grad():
                out = compiled(q, k, v, block_mask=bm)
                res["_flex_vs_dense"] = float((out - masked(q, k, v)).abs().max())
                res["flex"] = [median_ms(lambda: compiled(q, k, v, block_mask=bm), reps), None]
        except Exception as e:  # a compiler failure is a result to report, not the end of the run
            res["_flex_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--treeattn", default=os.path.join(os.path.dirname(__file__), "..", "target", "release", "treeattn"))
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--lengths", default="8192")
    ap.add_argument("--shapes", default="compaction,grpo")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-flex", action="store_true", help="skip FlexAttention (its compile takes a while)")
    ap.add_argument("--no-dense", action="store_true",
                    help="skip SDPA with the dense tree mask (minutes per call at 16-32k) and the flex run")
    ap.add_argument("--json-out", help="also write the results as JSON here")
    a = ap.parse_args()

    import torch

    torch.set_num_threads(a.threads)
    flags = ""
    try:
        flags = " ".join(
            f for f in open("/proc/cpuinfo").read().split("flags")[1].split("\n")[0].split()
            if f.startswith(("avx", "fma", "amx"))
        )
    except (OSError, IndexError):
        pass
    print(f"# cpu-anchor: torch {torch.__version__}, {a.threads} threads, f32, {a.heads} heads x d {a.head_dim}, "
          f"median of {a.reps}; {platform.processor() or platform.machine()}; flags: {flags}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for shape in a.shapes.split(","):
            for length in (int(x) for x in a.lengths.split(",")):
                path, kv_end, _ = make_pack(a.treeattn, shape, length, work)
                L = len(kv_end)
                pairs = int((kv_end - list(range(L))).sum())
                causal_pairs = L * (L + 1) // 2
                gflops = lambda p, ms, bwd: p * a.heads * 4 * a.head_dim * (3.5 if bwd else 1) / (ms * 1e-3) / 1e9
                res = torch_side(kv_end, a.heads, a.head_dim, a.reps, not (a.no_flex or a.no_dense), not a.no_dense)
                out = subprocess.run(
                    [a.treeattn, "bench", "--pack", path, "--heads", str(a.heads), "--head-dim", str(a.head_dim),
                     "--threads", str(a.threads), "--reps", str(a.reps), "--json"],
                    check=True, capture_output=True, text=True,
                ).stdout
                ta = json.loads(out)
                table = {
                    "sdpa-causal": [gflops(causal_pairs, ms, i == 1) if ms else None
                                    for i, ms in enumerate(res["sdpa-causal"])],
                    "treeattn": [ta["fwd_gflops"], ta["fwd_bwd_gflops"]],
                    "treeattn-causal": [ta["causal_fwd_gflops"], ta["causal_fwd_bwd_gflops"]],
                }
                if "sdpa-dense" in res:
                    table["sdpa-dense"] = [gflops(pairs, ms, i == 1) for i, ms in enumerate(res["sdpa-dense"])]
                if "flex" in res:
                    table["flex"] = [gflops(pairs, res["flex"][0], False), None]
                base = table["sdpa-causal"]
                print(f"\n{shape}: L = {L}, visible pairs {pairs} ({pairs / causal_pairs:.3f} of causal); "
                      f"isa {ta['isa']}; checks: "
                      + (f"|dense - causal| {res['_dense_vs_causal']:.2e}" if "_dense_vs_causal" in res else "dense skipped")
                      + (f", |flex - dense| {res['_flex_vs_dense']:.2e}" if "_flex_vs_dense" in res else "")
                      + (f"; flex failed: {res['_flex_error']}" if "_flex_error" in res else ""), flush=True)
                print(f"  {'method':<16} {'fwd GF/s':>9} {'fwd+bwd GF/s':>13} {'fwd / sdpa-causal':>18} {'fwd+bwd / sdpa-causal':>22}")
                fmt = lambda x: "-" if x is None else f"{x:.1f}"
                ratio = lambda x, b: "-" if x is None or b is None else f"{x / b:.2f}"
                for name, (f, fb) in table.items():
                    print(f"  {name:<16} {fmt(f):>9} {fmt(fb):>13} {ratio(f, base[0]):>18} {ratio(fb, base[1]):>22}", flush=True)
                rows.append({"shape": shape, "tokens": L, "visible_pairs": pairs, "gflops": table,
                             "treeattn_json": ta})
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump({"threads": a.threads, "heads": a.heads, "head_dim": a.head_dim, "flags": flags,
                       "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
