"""A few training steps of a tiny random Llama on the packs of
data/sample.jsonl, with treeattn's attention in Hugging Face transformers.

Each step: one packed forward + backward per pack (trie layout, shared
prefixes), loss = weighted NLL of every target under its exact live prefix
+ lambda * SDCC. Before training, and after, it prints the largest
|log-prob difference| between the packed forward and running every call
alone (sdpa), which should be float rounding.

    python python/examples/train_step.py [--steps 3] [--budget 800] [--dtype float32]
"""

import argparse
import json
import pathlib
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import treeattn
import treeattn.hf

ROOT = pathlib.Path(__file__).resolve().parents[2]


def per_call_logprobs(model, rollouts, pack):
    """Log-prob of each loss entry of `pack`, its call run alone (sdpa)."""
    calls = [c for r in rollouts for c in r["calls"]]
    model.set_attn_implementation("sdpa")
    out = torch.empty(pack.loss_rows.numel(), dtype=torch.float64)
    with torch.no_grad():
        cache = {}
        for t, (g, o) in enumerate(zip(pack.loss_call.tolist(), pack.loss_offset.tolist())):
            if g not in cache:
                c = calls[g]
                seq = torch.tensor(c["context"] + c["completion"])[None]
                cache = {g: (len(c["context"]), torch.log_softmax(model(input_ids=seq).logits[0].double(), -1))}
            n, lp = cache[g]
            out[t] = lp[n - 1 + o, calls[g]["completion"][o]]
    model.set_attn_implementation("treeattn")
    return out


def max_drift(model, rollouts, packs):
    worst = 0.0
    for p in packs:
        with torch.no_grad():
            ours = treeattn.hf.target_logprobs(model, p).double()
        worst = max(worst, float((ours - per_call_logprobs(model, rollouts, p)).abs().max()))
    return worst


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", default=str(ROOT / "data" / "sample.jsonl"))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--budget", type=int, default=800, help="tokens per pack")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    ap.add_argument("--sdcc-lambda", type=float, default=0.1)
    ap.add_argument("--max-rollouts", type=int, default=None, help="use only the first N rollouts")
    a = ap.parse_args()

    rollouts = [json.loads(line) for line in open(a.input) if line.strip()][: a.max_rollouts]
    vocab = 1 + max(t for r in rollouts for c in r["calls"] for t in c["context"] + c["completion"])
    packs = treeattn.pack(rollouts, share_prefixes=True, budget=a.budget)
    print(f"{len(rollouts)} rollouts -> {len(packs)} packs, "
          f"{sum(len(p) for p in packs)} tokens, {sum(p.loss_rows.numel() for p in packs)} targets, "
          f"{sum(p.sdcc_student_rows.numel() for p in packs)} SDCC pairs")

    treeattn.hf.register()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      attention_dropout=0.0)
    model = LlamaForCausalLM(cfg).to(getattr(torch, a.dtype))
    model.set_attn_implementation("treeattn")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    print(f"max |Δ log-prob| packed vs each call alone, before: {max_drift(model, rollouts, packs):.2e}")
    for step in range(a.steps):
        t0 = time.perf_counter()
        opt.zero_grad()
        total = nll = sdcc = 0.0
        for p in packs:
            parts = treeattn.hf.pack_loss(model, p, sdcc_lambda=a.sdcc_lambda)
            (parts["loss"] / len(packs)).backward()
            total += float(parts["loss"].detach()) / len(packs)
            nll += float(parts["nll"].detach()) / len(packs)
            sdcc += float(parts["sdcc"].detach()) / len(packs)
        opt.step()
        print(f"step {step}: loss {total:.4f} (nll {nll:.4f}, sdcc {sdcc:.4f}), {time.perf_counter() - t0:.2f} s")
    print(f"max |Δ log-prob| packed vs each call alone, after:  {max_drift(model, rollouts, packs):.2e}")


if __name__ == "__main__":
    main()
