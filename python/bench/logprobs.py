"""Benchmark (not a test): ``treeattn.hf.pack_loss`` forward + backward with
full ``[L, V]`` logits (the old path) against the chunked head (log-probs
recomputed per row chunk in backward), on a tiny random Llama, float32, CPU.

  old    the pre-issue-22 pack_loss: ``model(...).logits`` ``[L, V]``, then
         ``log_softmax(logits[loss_rows])`` and the weighted NLL (verbatim
         below as ``old_pack_loss``);
  new    ``treeattn.hf.pack_loss(model, pack, chunk=...)``;
  body   the model body alone (hidden states at the loss rows, summed): the
         memory and time that are not the head's, so that
         "logits part" = path − body.

Pack: one call, a context of L − T tokens and a completion of T tokens
(``treeattn.pack``), random token ids; SDCC off (one call has no SDCC
pairs). Each measurement runs in a fresh subprocess (so ``ru_maxrss``, the
peak resident set, is that run's): the child builds the model and the pack,
reads its peak RSS, runs forward + backward once, and reports the growth of
the peak and the wall time. Runs are interleaved (old, new, body, old, new,
body, ...) so a drift of the machine's load hits all alike; the table shows
the median and the range over --reps.

The old path needs about (2·L + T)·V·4 bytes (measured: 16.1 GiB at
L = 16k, T = 2k, V = 128k); the script skips it, saying so, when that is
more than --mem-fraction of MemAvailable.

    python python/bench/logprobs.py [--tokens 16384] [--targets 2048] [--vocab 131072]
        [--hidden 32] [--reps 3] [--chunk N] [--paths old,new,body] [--json out.json]
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time


def old_pack_loss(model, pack):
    """pack_loss as it was before issue 22 (sdcc_lambda = 0): full logits."""
    import torch
    import treeattn.hf

    logits = treeattn.hf._forward(model, pack)
    rows = pack.loss_rows.to(logits.device)
    labels = pack.loss_labels.to(logits.device)
    lp = torch.log_softmax(logits[rows], dim=-1).gather(-1, labels[:, None])[:, 0]
    w = pack.loss_weights.to(lp.device, lp.dtype)
    nll = -(w * lp).sum() / w.sum()
    return {"loss": nll, "logprobs": lp}


def child(a):
    import torch
    import treeattn
    import treeattn.hf
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    treeattn.hf.register()
    cfg = LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=2 * a.hidden,
                      num_hidden_layers=a.layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=a.tokens + 8)
    model = LlamaForCausalLM(cfg)
    model.set_attn_implementation("treeattn")
    ids = torch.randint(0, a.vocab, (a.tokens,)).tolist()
    C = a.tokens - a.targets
    (pack,) = treeattn.pack([{"id": "b", "calls": [{"context": ids[:C], "completion": ids[C:]}]}])
    assert len(pack) == a.tokens and pack.loss_rows.numel() == a.targets
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    if a.child == "old":
        loss = old_pack_loss(model, pack)["loss"]
    elif a.child == "new":
        loss = treeattn.hf.pack_loss(model, pack, chunk=a.chunk)["loss"]
    else:
        h, _, _, _ = treeattn.hf._hidden(model, pack)
        loss = h[pack.loss_rows].sum()
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    print(json.dumps({"path": a.child, "peak_growth_mib": grown / 1024, "fwd_s": t1 - t0,
                      "fwd_bwd_s": t2 - t0, "loss": float(loss.detach())}))


def mem_available():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=16384, help="L, tokens in the pack")
    ap.add_argument("--targets", type=int, default=2048, help="T, loss entries (the completion)")
    ap.add_argument("--vocab", type=int, default=131072)
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=None, help="rows per logits block (default: treeattn.hf.default_chunk)")
    ap.add_argument("--paths", default="old,new,body")
    ap.add_argument("--mem-fraction", type=float, default=0.9)
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a)
    if not 0 < a.targets < a.tokens:
        ap.error("need 0 < --targets < --tokens")
    paths = a.paths.split(",")
    need = (2 * a.tokens + a.targets) * a.vocab * 4
    avail = mem_available()
    if "old" in paths and avail is not None and need > a.mem_fraction * avail:
        print(f"skipping old: needs ~{need / 2**30:.1f} GiB, {avail / 2**30:.1f} GiB available")
        paths.remove("old")
    base = [sys.executable, os.path.abspath(__file__), "--tokens", str(a.tokens), "--targets", str(a.targets),
            "--vocab", str(a.vocab), "--hidden", str(a.hidden), "--layers", str(a.layers)]
    if a.chunk:
        base += ["--chunk", str(a.chunk)]
    runs = {p: [] for p in paths}
    for rep in range(a.reps):
        for p in paths:
            out = subprocess.run(base + ["--child", p], check=True, capture_output=True, text=True).stdout
            r = json.loads(out.strip().splitlines()[-1])
            runs[p].append(r)
            print(f"rep {rep} {p:4s}: peak +{r['peak_growth_mib']:8.1f} MiB, fwd {r['fwd_s']:6.2f} s, "
                  f"fwd+bwd {r['fwd_bwd_s']:6.2f} s, loss {r['loss']:.6f}", flush=True)
    import treeattn.hf

    chunk = a.chunk or treeattn.hf.default_chunk(a.vocab)
    print(f"\nL = {a.tokens}, T = {a.targets}, V = {a.vocab}, hidden {a.hidden}, {a.layers} layer(s), "
          f"float32, chunk {chunk}, {a.reps} interleaved reps, torch threads {os.environ.get('OMP_NUM_THREADS', 'default')}")
    print("| path | peak RSS growth, MiB (median; min–max) | logits part, MiB | fwd+bwd, s (median; min–max) |")
    print("|---|---|---|---|")
    med = {}
    for p in paths:
        g = [r["peak_growth_mib"] for r in runs[p]]
        t = [r["fwd_bwd_s"] for r in runs[p]]
        med[p] = (statistics.median(g), statistics.median(t))
    for p in paths:
        g = [r["peak_growth_mib"] for r in runs[p]]
        t = [r["fwd_bwd_s"] for r in runs[p]]
        part = f"{med[p][0] - med['body'][0]:.0f}" if "body" in med and p != "body" else "—"
        print(f"| {p} | {med[p][0]:.0f}; {min(g):.0f}–{max(g):.0f} | {part} | {med[p][1]:.2f}; {min(t):.2f}–{max(t):.2f} |")
    if "old" in med and "new" in med:
        if "body" in med:
            lo, ln = med["old"][0] - med["body"][0], med["new"][0] - med["body"][0]
            print(f"logits part: old / new = {lo / max(ln, 1e-9):.1f}x")
        print(f"time new / old = {med['new'][1] / med['old'][1]:.2f}")
        lo = statistics.median(r["loss"] for r in runs["old"])
        ln = statistics.median(r["loss"] for r in runs["new"])
        print(f"loss old {lo:.6f}, new {ln:.6f} (|Δ| {abs(lo - ln):.2e})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
