#!/usr/bin/env python3
"""Independent check of `treeattn pack` files: a small random transformer in
numpy (RMSNorm, rotary attention, SiLU MLP; float64) is run once on each pack
with its dense mask (k <= q < kv_end[k]) and position ids, and once on every
call's `context ++ completion` alone (causal, positions 0..n). Every loss
entry's log-prob from the pack must equal the one from its call's own pass.

    python3 data/check_pack.py data/sample.jsonl PACK.safetensors [PACK-00001.safetensors ...]

Needs numpy and safetensors (pip). Exit status 1 on any mismatch.
"""
import json
import sys

import numpy as np
from safetensors.numpy import load_file

D, HEADS, LAYERS, FF = 32, 4, 2, 64
HD = D // HEADS


def model(vocab, seed=0):
    rng = np.random.default_rng(seed)
    w = lambda *s: rng.normal(0, 1 / np.sqrt(s[0]), s)
    layers = [dict(q=w(D, D), k=w(D, D), v=w(D, D), o=w(D, D), up=w(D, FF), gate=w(D, FF), down=w(FF, D)) for _ in range(LAYERS)]
    return dict(emb=rng.normal(0, 1, (vocab, D)), layers=layers, out=w(D, vocab))


def rope(x, pos):
    # Llama rotate-half convention, base 10000.
    half = HD // 2
    freq = 10000.0 ** (-np.arange(half) / half)
    ang = pos[:, None].astype(np.float64) * freq[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def rms(x):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6)


def forward(m, tokens, pos, visible):
    """Log-softmax of the logits of every row; visible[q, k] is the mask."""
    x = m["emb"][tokens]
    n = len(tokens)
    for p in m["layers"]:
        h = rms(x)
        q = rope((h @ p["q"]).reshape(n, HEADS, HD), pos)
        k = rope((h @ p["k"]).reshape(n, HEADS, HD), pos)
        v = (h @ p["v"]).reshape(n, HEADS, HD)
        s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(HD)
        s = np.where(visible[None], s, -np.inf)
        s = s - s.max(-1, keepdims=True)
        a = np.exp(s)
        a /= a.sum(-1, keepdims=True)
        x = x + np.einsum("hqk,khd->qhd", a, v).reshape(n, D) @ p["o"]
        h = rms(x)
        g = h @ p["gate"]
        x = x + ((g / (1 + np.exp(-g))) * (h @ p["up"])) @ p["down"]
    z = rms(x) @ m["out"]
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def main():
    rollouts = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
    calls = [c for r in rollouts for c in r["calls"]]  # global call index -> call
    m = model(32000)
    cache = {}
    worst, checked = 0.0, 0
    for path in sys.argv[2:]:
        t = load_file(path)
        L = len(t["tokens"])
        kv_end = t["kv_end"]
        idx = np.arange(L)
        visible = (idx[None, :] <= idx[:, None]) & (idx[:, None] < kv_end[None, :])
        lp = forward(m, t["tokens"], t["position_ids"], visible)
        for row, label, call, off in zip(t["loss_rows"], t["loss_labels"], t["loss_call"], t["loss_offset"]):
            c = calls[call]
            if call not in cache:
                seq = np.array(c["context"] + c["completion"])
                n = len(seq)
                cache[call] = forward(m, seq, np.arange(n), np.tril(np.ones((n, n), bool)))
            assert c["completion"][off] == label, (path, call, off)
            want = cache[call][len(c["context"]) + off - 1, label]
            worst = max(worst, abs(lp[row, label] - want))
            checked += 1
        print(f"{path}: L = {L}, {len(t['loss_rows'])} loss entries checked")
    print(f"{checked} targets, max |packed - separate| log-prob difference {worst:.3e}")
    # float64 end to end: differences are rounding only (~1e-13); 1e-9 leaves
    # a wide margin while any wrong mask, position or row is off by >> 1e-3.
    sys.exit(0 if worst < 1e-9 and checked > 0 else 1)


if __name__ == "__main__":
    main()
