"""Benchmark (not a test): a hybrid model (Qwen3.5: Gated DeltaNet layers
plus full attention) trained on a tree pack against LogitTree's K+1
branches run separately, on CPU.

Model: a small random ``Qwen3_5ForCausalLM`` (float32, ``--hidden``,
``--layers``, the Qwen3.5 pattern of three linear-attention layers per full
attention layer), attention through ``"treeattn"`` for the pack and
``"sdpa"`` for the branches; the recurrent layers of the pack run along
its paths (``treeattn.hybrid``), those of a branch with transformers' own
chunked scan.

Workload: ``data/sample.jsonl`` (a compaction, a stack-pop, a fold and a
memex rollout, a GRPO group of 16 responses and a plain one), packed once
as a trie with ``share_prefixes`` (the GRPO prompt computed once). The
branches are the root-to-leaf paths of that trie (``treeattn.paths``):
K+1 sequences, each a causal forward of its own. Each target is scored on
exactly one branch (its live one), so both sides compute the same loss
(sum of the targets' log-probs) and, checked before timing, the same
log-probs (max abs difference printed).

Logits only at the targets' rows (``logits_to_keep``, as a trainer
would; the 32k-vocabulary head would otherwise dominate both sides).
Timed: forward + backward of that loss, median of ``--reps`` after a
warm-up, interleaved with a third run: the same pack with the recurrent
layers in packed order (transformers' own chunked scan over the packed
sequence: wrong numbers, but the same tokens, so the difference to the
packed step is the price of the tree recurrence). Then one profiled
packed step (``torch.profiler``): the top ops by self CPU time.

    python python/bench/hybrid.py [--hidden 256] [--layers 4] [--reps 5] [--threads 2]
"""

import argparse
import json
import os
import pathlib
import platform
import statistics
import sys
import time

import torch

import treeattn
import treeattn.hf
import treeattn.hybrid as hybrid

ROOT = pathlib.Path(__file__).resolve().parents[2]


def branches(pack):
    """Root-to-leaf row paths of the pack's trie (leaves: rows with no child)."""
    p = treeattn.paths(pack.kv_end)
    parent = p.parent.tolist()
    kv_end = pack.kv_end.tolist()
    out = []
    for t in range(len(parent)):
        if kv_end[t] == t + 1:
            rows = [t]
            while parent[rows[-1]] >= 0:
                rows.append(parent[rows[-1]])
            out.append(rows[::-1])
    return out, p


def model_of(args, vocab):
    """The random Qwen3.5 text model of the benchmark."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    h = args.hidden
    heads = max(2, h // 64)
    cfg = Qwen3_5TextConfig(
        vocab_size=vocab, hidden_size=h, intermediate_size=3 * h, num_hidden_layers=args.layers,
        num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), head_dim=64,
        linear_num_key_heads=max(1, heads // 2), linear_num_value_heads=heads,
        linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(args.layers)],
    )
    torch.manual_seed(0)
    return Qwen3_5ForCausalLM(cfg).float().train()


def packed_step(model, pack):
    """Loss and log-probs of one packed forward (sum of target log-probs)."""
    model.set_attn_implementation("treeattn")
    rows = pack.loss_rows
    logits = model(
        input_ids=pack.tokens[None], position_ids=pack.position_ids[None], kv_end=pack.kv_end, use_cache=False,
        logits_to_keep=rows,
    ).logits[0]
    lp = torch.log_softmax(logits, -1).gather(-1, pack.loss_labels[:, None])[:, 0]
    return lp.sum(), lp


def branch_step(model, pack, paths_, owner):
    """LogitTree: each branch its own causal forward; every target scored on
    the branch that owns its logit row. Returns the loss and the log-probs in
    the pack's target order."""
    model.set_attn_implementation("sdpa")
    rows = pack.loss_rows.tolist()
    lp = [None] * len(rows)
    for b, path in enumerate(paths_):
        mine = [i for i, r in enumerate(rows) if owner[r] == b]
        if not mine:
            continue
        pos = {r: j for j, r in enumerate(path)}
        at = torch.tensor([pos[rows[i]] for i in mine])
        logits = model(input_ids=pack.tokens[path][None], use_cache=False, logits_to_keep=at).logits[0]
        ls = torch.log_softmax(logits, -1).gather(-1, pack.loss_labels[mine][:, None])[:, 0]
        for i, v in zip(mine, ls):
            lp[i] = v
    lp = torch.stack(lp)
    return lp.sum(), lp


def timed(fn):
    """Wall and process CPU time of fn() (forward + backward). CPU time does
    not grow while the process waits for a core of a shared machine."""
    t, c = time.perf_counter(), time.process_time()
    loss, _ = fn()
    loss.backward()
    return time.perf_counter() - t, time.process_time() - c


def profile(model, pack):
    """Share of self CPU time of the top ops of one packed step."""
    from torch.profiler import ProfilerActivity, profile as prof

    model.zero_grad()
    with prof(activities=[ProfilerActivity.CPU]) as p:
        loss, _ = packed_step(model, pack)
        loss.backward()
    ev = p.key_averages()
    total = sum(e.self_cpu_time_total for e in ev)
    top = sorted(ev, key=lambda e: -e.self_cpu_time_total)[:8]
    return {e.key: e.self_cpu_time_total / total for e in top}, total / 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    treeattn.hf.register()
    rollouts = [json.loads(line) for line in (ROOT / "data" / "sample.jsonl").read_text().splitlines()]
    vocab = 1 + max(t for r in rollouts for c in r["calls"] for t in c["context"] + c["completion"])
    (pack,) = treeattn.pack(rollouts, share_prefixes=True)
    paths_, p = branches(pack)
    owner = [-1] * len(pack)
    for b, path in enumerate(paths_):
        for r in path:
            if owner[r] < 0:
                owner[r] = b
    model = model_of(args, vocab)
    branch_tokens = sum(len(x) for x in paths_)

    # Same numbers first.
    with torch.no_grad():
        _, a = packed_step(model, pack)
        _, b = branch_step(model, pack, paths_, owner)
    diff = float((a - b).abs().max())
    print(f"# check: max |log p(pack) - log p(branches)| = {diff:.2e} over {a.numel()} targets")
    if diff > 1e-3:
        sys.exit("packed and per-branch log-probs disagree: not timing a wrong result")

    def wrong_step():
        with hybrid._packed_order():
            return packed_step(model, pack)

    tp, tb, tw = [], [], []
    for i in range(args.reps + 1):
        model.zero_grad()
        x = timed(lambda: packed_step(model, pack))
        model.zero_grad()
        y = timed(lambda: branch_step(model, pack, paths_, owner))
        model.zero_grad()
        z = timed(wrong_step)
        if i:  # the first is the warm-up
            tp.append(x)
            tb.append(y)
            tw.append(z)
    cats, prof_s = profile(model, pack)
    res = {
        "machine": platform.processor() or platform.machine(),
        "threads": args.threads,
        "torch": torch.__version__,
        "hidden": args.hidden,
        "layers": args.layers,
        "pack_tokens": len(pack),
        "nodes": int(p.node_start.numel()),
        "levels": int(p.level_offsets.numel() - 1),
        "branches": len(paths_),
        "branch_tokens": branch_tokens,
        "targets": int(pack.loss_rows.numel()),
        "pack_s": statistics.median(x[0] for x in tp),
        "pack_cpu_s": statistics.median(x[1] for x in tp),
        "pack_packed_order_s": statistics.median(x[0] for x in tw),
        "pack_packed_order_cpu_s": statistics.median(x[1] for x in tw),
        "branches_s": statistics.median(x[0] for x in tb),
        "branches_cpu_s": statistics.median(x[1] for x in tb),
        "profile_s": prof_s,
        "profile": cats,
    }
    print(f"pack: {len(pack)} tokens, {res['nodes']} nodes in {res['levels']} levels; "
          f"branches: K+1 = {len(paths_)}, {branch_tokens} tokens ({branch_tokens / len(pack):.2f}x)")
    print("| fwd+bwd | tokens | wall median (s) | CPU median (s) |")
    print("|---|---:|---:|---:|")
    print(f"| trie pack (treeattn + tree recurrence) | {len(pack)} | {res['pack_s']:.3f} | {res['pack_cpu_s']:.3f} |")
    print(f"| K+1 branches separately (sdpa + transformers' scan) | {branch_tokens} | {res['branches_s']:.3f} | "
          f"{res['branches_cpu_s']:.3f} |")
    print(f"| same pack, recurrent layers in packed order (wrong numbers) | {len(pack)} | "
          f"{res['pack_packed_order_s']:.3f} | {res['pack_packed_order_cpu_s']:.3f} |")
    print(f"by CPU time: the pack is {res['branches_cpu_s'] / res['pack_cpu_s']:.2f}x faster than the branches; "
          f"the tree recurrence step costs {res['pack_cpu_s'] / res['pack_packed_order_cpu_s']:.2f}x the packed-order step")
    print(f"top ops of one packed step ({prof_s:.3f} s self CPU in total):")
    for k, v in cats.items():
        print(f"  {v * 100:5.1f}%  {k}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
