"""Benchmark (not a test): how well treeattn.distributed balances work over
ranks, on the rollouts of ``treeattn gen``. No process group is needed: the
figures are plans, priced by the exact cost model (``treeattn.cost``,
Llama-3-8B's shape unless --model says otherwise).

Data parallel — ``balance`` (LPT on exact FLOPs) against

  tokens-ff  the token-count first-fit peers use: units in input order into
             the first pack with room (``--budget`` tokens), packs dealt to
             ranks round-robin, micro-steps padded with empty packs;
  tokens-LPT the same LPT as ``balance`` on token counts instead of FLOPs;
  L²-LPT     the same LPT on tokens² (the usual attention proxy);

reported as max / mean cost over ranks per micro-step, summed over the
step's micro-steps (Σ max / Σ mean: the step's time over the ideal when the
ranks synchronize every micro-step; 1.00 is perfect).

Context parallel — ``shard`` on one large compaction tree and a GRPO group
of 16 × 8k tokens for P = 2 … 16: per-rank visible (query, key) pairs max /
mean for the cost-balanced cut and for an equal-token cut, and the K / V
bytes per layer a rank receives (max over ranks; the gathered ancestor
rows) against all-gathering K / V (L − L_local rows), bf16, Llama-3-8B's
8 kv heads × 128.

  python python/bench/distributed.py [--ranks 8,64,512] [--per-rank 2] [--scale paper|default]
      [--shapes compaction,grpo] [--cp-ranks 2,4,8,16] [--skip-dp] [--skip-cp]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import torch

import treeattn
from treeattn import distributed as D

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLI = os.path.join(REPO, "target", "release", "treeattn")


def gen_units(shape: str, n: int, paper: bool, model, keep: str = ""):
    """``n`` units (a compaction rollout, or a GRPO group of 16), each
    generated into a file and packed alone by the crate (the file path goes
    to ``treeattn.pack``: paper-scale contexts are never parsed in Python),
    as ``balance`` sees them: (tokens, exact cost) per unit. With ``keep``,
    every unit's lines are also appended to that file."""
    toks, costs = [], []
    tmp = f"/tmp/treeattn-bench-dist-{os.getpid()}.jsonl"
    for seed in range(n):
        cmd = [CLI, "gen", shape, "--seed", str(1000 + seed), "--out", tmp] + (["--paper-scale"] if paper else [])
        subprocess.run(cmd, check=True, capture_output=True)
        (p,) = treeattn.pack(tmp, share_prefixes=True)
        toks.append(len(p))
        costs.append(treeattn.cost(p, model)["total"])
        if keep:
            with open(tmp) as src, open(keep, "a") as dst:
                dst.write(src.read())
    os.remove(tmp)
    return toks, costs


def step_ratio(bins_cost, world):
    """Σ_micro max / Σ_micro mean over ``bins_cost[micro * world + rank]``."""
    micro = len(bins_cost) // world
    mx = sum(max(bins_cost[m * world:(m + 1) * world]) for m in range(micro))
    mean = sum(sum(bins_cost[m * world:(m + 1) * world]) / world for m in range(micro))
    return mx / mean, micro


def plan_lpt(weights, toks, costs, world, budget):
    micro0 = max(1, -(-sum(toks) // (world * budget)))
    micro, where = D._assign(weights, toks, world, budget, micro0)
    bins = [0.0] * (world * micro)
    for u, b in enumerate(where):
        bins[b] += costs[u]
    return step_ratio(bins, world)


def plan_first_fit(toks, costs, world, budget):
    packs, room = [], []
    for u, t in enumerate(toks):
        for i, r in enumerate(room):
            if r >= t:
                packs[i] += costs[u]
                room[i] -= t
                break
        else:
            packs.append(costs[u])
            room.append(budget - t)
    micro = -(-len(packs) // world)
    bins = [0.0] * (world * micro)
    for i, c in enumerate(packs):  # pack i -> rank i % world, micro-step i // world
        bins[(i // world) * world + i % world] = c
    return step_ratio(bins, world)


def data_parallel(args, model):
    paper = args.scale == "paper"
    print(f"\n## Data parallel ({args.scale} scale, {args.per_rank} units per rank, Llama-3-8B costs)\n")
    print("| rollouts | ranks | units | budget | micro-steps | balance (FLOPs LPT) | tokens first-fit | tokens LPT | L² LPT |")
    print("|---|---|---|---|---|---|---|---|---|")
    budgets = {"compaction": args.compaction_budget, "grpo": args.grpo_budget}
    for shape in args.shapes:
        budget = budgets[shape]
        for world in args.ranks:
            n = world * args.per_rank
            t0 = time.time()
            keep = f"/tmp/treeattn-bench-dist-all-{os.getpid()}.jsonl" if world <= args.check_upto else ""
            if keep and os.path.exists(keep):
                os.remove(keep)
            toks, costs = gen_units(shape, n, paper, model, keep)
            ours, micro = plan_lpt(costs, toks, costs, world, budget)
            ff, ffm = plan_first_fit(toks, costs, world, budget)
            tl, tlm = plan_lpt([float(t) for t in toks], toks, costs, world, budget)
            l2, l2m = plan_lpt([float(t) ** 2 for t in toks], toks, costs, world, budget)
            check = ""
            if keep:
                # The plan above is balance()'s own assignment; confirm with
                # balance() + balance_report() on the real packs.
                shards = D.balance(keep, world, budget=budget, model_cost=model)
                rep = D.balance_report(shards, model)
                check = f" (balance_report {rep['step']:.3f})"
                del shards
                os.remove(keep)
            print(f"| {shape} | {world} | {len(toks)} | {budget} | {micro} / {ffm} / {tlm} / {l2m} | "
                  f"{ours:.3f}{check} | {ff:.3f} | {tl:.3f} | {l2:.3f} |", flush=True)
            print(f"<!-- {shape} {world}: {sum(toks)} tokens, {time.time() - t0:.0f} s -->", flush=True)


def grpo_group(tokens_each: int, prompt: int, group: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    p = torch.randint(4, 30000, (prompt,), generator=g).tolist()
    return [{"id": f"g{i}", "calls": [{"context": p, "completion":
             torch.randint(4, 30000, (tokens_each - prompt,), generator=g).tolist()}]} for i in range(group)]


def equal_token_pairs(pack, P):
    vk = D.visible_keys_per_query(pack.kv_end)
    L = len(pack)
    b = [round(L * r / P) for r in range(P + 1)]
    return [int(vk[b[r]:b[r + 1]].sum()) for r in range(P)]


def context_parallel(args, model):
    print("\n## Context parallel (per-rank visible pairs max / mean; K/V bytes per layer, bf16, 8 kv heads × 128)\n")
    tmp = f"/tmp/treeattn-bench-dist-cp-{os.getpid()}.jsonl"
    subprocess.run([CLI, "gen", "compaction", "--paper-scale", "--seed", str(args.cp_seed), "--out", tmp],
                   check=True, capture_output=True)
    (cpack,) = treeattn.pack(tmp)
    os.remove(tmp)
    (gpack,) = treeattn.pack(grpo_group(8192, 1024, 16, 5), share_prefixes=True)
    row = 2 * 8 * 128 * 2  # K and V rows, bf16
    for name, p in ((f"compaction (L = {len(cpack)})", cpack), (f"GRPO 16 × 8k, prompt 1k (L = {len(gpack)})", gpack)):
        print(f"\n{name}, {treeattn.cost(p, model)['visible_pairs']} visible pairs\n")
        print("| P | pairs max/mean (cost cut) | pairs max/mean (equal tokens) | FLOPs max/mean | "
              "received max (MB) | all-gather (MB) | ratio | padding-query pairs / useful |")
        print("|---|---|---|---|---|---|---|---|")
        for P in args.cp_ranks:
            plan = D.plan_comm(p, P, model_cost=model)
            vp = plan["visible_pairs"]
            eq = equal_token_pairs(p, P)
            s0 = D.shard(p, world_size=P, rank=0, model_cost=model)
            fl = s0.cost
            recv = max(plan["received"]) * row / 1e6
            ag = max(plan["allgather"]) * row / 1e6
            waste = sum(plan["wasted_pairs"]) / max(1, sum(vp))
            print(f"| {P} | {max(vp) / (sum(vp) / P):.3f} | {max(eq) / (sum(eq) / P):.3f} | "
                  f"{max(fl) / (sum(fl) / P):.3f} | {recv:.1f} | {ag:.1f} | {recv / ag:.3f} | {waste:.3f} |",
                  flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="8,64,512")
    ap.add_argument("--per-rank", type=int, default=2)
    ap.add_argument("--shapes", default="compaction,grpo")
    ap.add_argument("--scale", choices=("paper", "default"), default="paper")
    ap.add_argument("--compaction-budget", type=int, default=393216)
    ap.add_argument("--grpo-budget", type=int, default=65536)
    ap.add_argument("--check-upto", type=int, default=8, help="also run balance() itself up to this many ranks")
    ap.add_argument("--cp-ranks", default="2,4,8,16")
    ap.add_argument("--cp-seed", type=int, default=1)
    ap.add_argument("--skip-dp", action="store_true")
    ap.add_argument("--skip-cp", action="store_true")
    args = ap.parse_args()
    args.ranks = [int(x) for x in args.ranks.split(",")]
    args.cp_ranks = [int(x) for x in args.cp_ranks.split(",")]
    args.shapes = args.shapes.split(",")
    if not os.path.exists(CLI):
        sys.exit(f"{CLI} missing: cargo build --release --bin treeattn")
    model = treeattn.ModelCost.llama3_8b()
    if not args.skip_dp:
        data_parallel(args, model)
    if not args.skip_cp:
        context_parallel(args, model)


if __name__ == "__main__":
    main()
