"""TRL's AsyncGRPO tree packing beside treeattn's pack on the same rollouts,
and the time of treeattn.from_chat per million tokens.

    PYTHONPATH=python python python/bench/chat_packing.py [--group 16] [--turns 8] [--reps 3]

Rollouts (the same token rollouts for both packers):

- ``sample``: data/sample.jsonl (22 token rollouts: compactions, a GRPO
  group, folds);
- ``chat-grpo``: chat logs of one GRPO group of ``--group`` rollouts of a
  thinking model with tool calls (a system prompt and a question shared by
  the group; ``--turns`` tool calls per user turn, two user turns; the
  Qwen3-style template of python/examples/chat_grpo.py drops earlier
  reasoning at the second user turn), through ``treeattn.from_chat``;
- ``chat-compaction``: chat logs of 4 agent rollouts whose harness compacts
  (old turns replaced by a summary message, the last 2 turns kept) when the
  context passes ``--compact-at`` tokens, through ``treeattn.from_chat``.

TRL (``trl.experimental.async_grpo.packing.TreeRow``, 1.16.0): every call
is one sample (``input_ids`` = context + completion, ``completion_mask`` on
the completion), all in one row, as treeattn puts them in one pack with
shared prefixes. Per row: forwarded tokens, segments, the K/V rows its
attention gathers per layer (``tree_kv_index``: every segment's
root-to-segment path), visible (query, key) pairs, and the bytes its
attention keeps for the backward per layer at Qwen3-8B's head shape (36
layers, 32 query heads, 8 KV heads, head dim 128, bf16): FA3's saved q, o
(``L·32·128``), gathered k, v (``K·8·128`` each) and the float32 LSE
(``L·32``). treeattn's op keeps q, o, k, v of the ``L`` rows themselves and
the LSE; it gathers nothing. The totals are × 36 layers.

from_chat: seconds for the chat rollouts (best of ``--reps``), per million
tokens of the calls (Σ context + completion), with the report (one
``treeattn.pack`` more) and without. The tokenizer is the example's
word-level ``tokenizers`` model (one token per word), so the time is the
template's Jinja rendering, the Rust tokenizer and the bookkeeping; a BPE
tokenizer's own share differs.
"""

import argparse
import json
import os
import pathlib
import platform
import random
import subprocess
import sys
import time

import torch

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import treeattn  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "python" / "examples"))
import chat_grpo  # noqa: E402  (the example's tokenizer and template)

LAYERS, HQ, HKV, D, BF16 = 36, 32, 8, 128, 2  # Qwen3-8B


def words(rng, n):
    return " ".join(rng.choice(chat_grpo.WORDS[5:]) for _ in range(n))


def tool_call(rng):
    args = {"city": rng.choice(["paris", "rome", "oslo"]), "day": rng.choice(["today", "tomorrow"])}
    return {"type": "function", "function": {"name": "search", "arguments": args}}


def chat_grpo_logs(rng, group, turns, think, tool_words, prompt_words):
    system = {"role": "system", "content": words(random.Random(1), prompt_words)}
    u1 = {"role": "user", "content": words(random.Random(2), 40)}
    u2 = {"role": "user", "content": words(random.Random(3), 20)}
    out = []
    for g in range(group):
        msgs, calls = [system, u1], []
        for user in (None, u2):
            if user is not None:
                msgs = msgs + [user]
            for t in range(turns + 1):
                if t < turns:
                    a = {"role": "assistant", "reasoning_content": words(rng, think), "content": "",
                         "tool_calls": [tool_call(rng)]}
                else:
                    a = {"role": "assistant", "reasoning_content": words(rng, think), "content": words(rng, 60)}
                calls.append({"messages": msgs, "tools": chat_grpo.TOOLS, "completion": a})
                msgs = msgs + [a]
                if t < turns:
                    msgs = msgs + [{"role": "tool", "content": words(rng, tool_words)}]
        out.append({"id": f"grpo-{g}", "group": "q", "reward": float(g % 2), "calls": calls})
    return out


def chat_compaction_logs(rng, n, turns, think, tool_words, compact_at, tok):
    out = []
    for r in range(n):
        system = {"role": "system", "content": words(random.Random(10), 300)}
        user = {"role": "user", "content": words(rng, 80)}
        msgs, calls, size = [system, user], [], 0
        for t in range(turns):
            a = {"role": "assistant", "reasoning_content": words(rng, think), "content": "",
                 "tool_calls": [tool_call(rng)]}
            calls.append({"messages": msgs, "tools": chat_grpo.TOOLS, "completion": a})
            msgs = msgs + [a, {"role": "tool", "content": words(rng, tool_words)}]
            size += think + tool_words + 20
            if size > compact_at:  # the harness compacts: summary, last 2 turns kept
                s = {"role": "assistant", "reasoning_content": words(rng, think), "content": words(rng, 400)}
                calls.append({"messages": msgs + [{"role": "user", "content": "summarize"}], "tools": chat_grpo.TOOLS,
                              "completion": s, "summary": True})
                msgs = [system, user, {"role": "user", "content": "summary " + s["content"]}] + msgs[-4:]
                size = 400 + 2 * (think + tool_words + 20)
        a = {"role": "assistant", "reasoning_content": words(rng, think), "content": words(rng, 100)}
        calls.append({"messages": msgs, "tools": chat_grpo.TOOLS, "completion": a})
        out.append({"id": f"agent-{r}", "reward": 1.0, "calls": calls})
    return out


def trl_row(rollouts):
    from trl.experimental.async_grpo.packing import TreeRow

    row = TreeRow()
    for r in rollouts:
        for c in r["calls"]:
            ids = torch.tensor(c["context"] + c["completion"])
            mask = torch.cat([torch.zeros(len(c["context"]), dtype=torch.long),
                              torch.ones(len(c["completion"]), dtype=torch.long)])
            row.add({"input_ids": ids, "completion_mask": mask, "old_log_probs": torch.zeros(len(ids)),
                     "advantage": 0.0, "group_id": r.get("group", r["id"]), "metrics": {}})
    return row.pack()


def saved_bytes(L, K):
    """Attention's saved tensors per layer: q, o, k, v, LSE (k, v of K rows)."""
    return (2 * L * HQ * D + 2 * K * HKV * D) * BF16 + L * HQ * 4


def compare(name, rollouts):
    calls = sum(len(r["calls"]) for r in rollouts)
    raw = sum(len(c["context"]) + len(c["completion"]) for r in rollouts for c in r["calls"])
    t0 = time.perf_counter()
    (p,) = treeattn.pack(rollouts)
    t_ours = time.perf_counter() - t0
    L = len(p)
    pairs = int((p.kv_end - torch.arange(L)).sum())
    nodes = int(treeattn.paths(p.kv_end).node_start.numel())
    t0 = time.perf_counter()
    row = trl_row(rollouts)
    t_trl = time.perf_counter() - t0
    Lt = int(row["input_ids"].numel())
    cq, ck = row["tree_cu_seqlens_q"].long(), row["tree_cu_seqlens_k"].long()
    q, k = cq.diff(), ck.diff()
    K = int(row["tree_kv_index"].numel())
    trl_pairs = int((q * (k - q) + q * (q + 1) // 2).sum())
    gib = 2.0 ** 30
    return {
        "name": name, "rollouts": len(rollouts), "calls": calls, "raw": raw,
        "ours": {"tokens": L, "segments": nodes, "kv_rows": L, "pairs": pairs,
                 "bytes": saved_bytes(L, L) * LAYERS / gib, "pack_s": t_ours},
        "trl": {"tokens": Lt, "segments": int(q.numel()), "kv_rows": K, "pairs": trl_pairs,
                "bytes": saved_bytes(Lt, K) * LAYERS / gib, "pack_s": t_trl},
    }


def cpu():
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except Exception:
        return platform.processor()
    info = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    flags = set(info.get("Flags", "").split())
    shown = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile") if f in flags]
    return f"{info.get('Model name', '?').strip()}, {info.get('CPU(s)', '?').strip()} CPUs, flags {' '.join(shown)}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--group", type=int, default=16)
    ap.add_argument("--turns", type=int, default=8, help="tool calls per user turn (chat-grpo)")
    ap.add_argument("--agent-turns", type=int, default=40, help="tool calls per agent rollout (chat-compaction)")
    ap.add_argument("--think", type=int, default=120, help="reasoning words per call")
    ap.add_argument("--tool-words", type=int, default=300)
    ap.add_argument("--prompt-words", type=int, default=1500)
    ap.add_argument("--compact-at", type=int, default=12000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default=None, help="also write the figures here")
    a = ap.parse_args()
    import trl
    import trl.experimental.async_grpo.packing  # noqa: F401  (imported before any timing)

    print(f"{cpu()}; Python {platform.python_version()}, torch {torch.__version__}, trl {trl.__version__}, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average {os.getloadavg()[0]:.1f}")
    tok = chat_grpo.tokenizer()
    rng = random.Random(0)
    chats = {
        "chat-grpo": chat_grpo_logs(rng, a.group, a.turns, a.think, a.tool_words, a.prompt_words),
        "chat-compaction": chat_compaction_logs(rng, 4, a.agent_turns, a.think, a.tool_words, a.compact_at, tok),
    }
    sets = {"sample": [json.loads(line) for line in open(ROOT / "data" / "sample.jsonl") if line.strip()]}
    timing = []
    for name, records in chats.items():
        best = {True: float("inf"), False: float("inf")}
        for _ in range(a.reps):
            for report in (False, True):
                t0 = time.perf_counter()
                out = treeattn.from_chat(records, tok, report=report)
                best[report] = min(best[report], time.perf_counter() - t0)
        rep = out.report
        sets[name] = list(out)
        timing.append({"name": name, "rollouts": len(records), "calls": rep.calls, "tokens": rep.tokens,
                       "packed": rep.packed_tokens, "junctions": rep.junctions,
                       "template_junctions": rep.template_junctions, "s": best[False], "s_report": best[True]})
    rows = [compare(name, rs) for name, rs in sets.items()]

    print()
    print("| rollouts | calls | tokens in the calls | packer | tokens | segments | "
          "K/V rows attention takes per layer | visible pairs | "
          "attention's saved tensors, GiB (Qwen3-8B, 36 layers) | pack, s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        for who, label in (("trl", "TRL TreeRow (gathered)"), ("ours", "treeattn (in place)")):
            x = r[who]
            print(f"| {r['name']} ({r['rollouts']}) | {r['calls']} | {r['raw']:,} | {label} | {x['tokens']:,} | "
                  f"{x['segments']:,} | {x['kv_rows']:,} | {x['pairs']:,} | {x['bytes']:.2f} | {x['pack_s']:.3f} |")
    print()
    print("| chat logs | rollouts | calls | tokens in the calls | junctions (by the template) | packed (per rollout) | "
          "from_chat, s | s per 1M tokens | with the report, s per 1M tokens |")
    print("|---|---|---|---|---|---|---|---|---|")
    for t in timing:
        m = t["tokens"] / 1e6
        print(f"| {t['name']} | {t['rollouts']} | {t['calls']} | {t['tokens']:,} | {t['junctions']} "
              f"({t['template_junctions']}) | {t['packed']:,} | {t['s']:.3f} | {t['s'] / m:.2f} | "
              f"{t['s_report'] / m:.2f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"packing": rows, "from_chat": timing, "cpu": cpu()}, f, indent=1)


if __name__ == "__main__":
    main()
