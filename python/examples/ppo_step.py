"""PPO and GRPO steps on packs of compressed rollouts, with a tiny random
Llama policy and a tiny Llama critic (``LlamaForTokenClassification`` with
one label: a value per row, read by ``treeattn.hf.values``), treeattn's
attention in Hugging Face transformers.

The rollouts (data/rl_sample.jsonl, written by `treeattn gen compaction
fold grpo --rewards --seed 2`) carry a reward each and, for the GRPO group,
a group name. Every target is scored, and every value is read, under the
target's own live prefix: for a compaction rollout that is the context
before the summary for the targets written before it.

1. Advantages by GAE on the critic's values, two ways: CompactionRL's
   segment-discounted form (mode="compaction") and the exact
   whole-trajectory form (mode="exact", one reverse scan across the
   compactions, which a tree pack makes possible). The script prints how far
   apart they are on the compaction rollouts (and that they agree on
   rollouts with one segment).
2. One PPO step (two epochs over the batch) with each: clipped policy loss
   + value loss, token-mean over the whole batch (the normalizer is the
   batch's target count, CompactionRL's token-level loss), printing the
   loss and the clip fraction.
3. One GRPO step on the GRPO group (group-normalised rewards, no critic).

The behaviour policy's log-probs are the policy's own before the step (a
trainer takes them from its inference engine: `pack.loss_logprobs`, passed
as `policy_loss(logp, pack, ...)`).

    python python/examples/ppo_step.py [--dtype float32|float64] [--budget 800]
"""

import argparse
import json
import pathlib
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM, LlamaForTokenClassification

import treeattn
import treeattn.hf
import treeattn.rl as rl

ROOT = pathlib.Path(__file__).resolve().parents[2]


def ppo_step(policy, critic, packs, adv, ret, normalizer, epochs=2):
    """Two epochs of PPO over the packs; returns the last epoch's mean stats."""
    opt = torch.optim.AdamW(list(policy.parameters()) + list(critic.parameters()), lr=3e-3)
    with torch.no_grad():
        old_lp = [treeattn.hf.target_logprobs(policy, p) for p in packs]
        old_v = [treeattn.hf.values(critic, p) for p in packs]
    for epoch in range(epochs):
        opt.zero_grad()
        total = vtotal = clip = 0.0
        for i, p in enumerate(packs):
            lp = treeattn.hf.target_logprobs(policy, p)
            loss, st = rl.policy_loss(lp, old_lp[i], adv[i], weights=p.loss_weights,
                                      clip_low=0.2, clip_high=0.28, normalizer=normalizer)
            vloss, _ = rl.value_loss(treeattn.hf.values(critic, p), old_v[i], ret[i], clip=0.2,
                                     weights=p.loss_weights, normalizer=normalizer)
            (loss + 0.5 * vloss).backward()
            share = float(p.loss_weights.sum()) / normalizer
            total += float(loss.detach())
            vtotal += float(vloss.detach())
            clip += float(st["clip_frac"]) * share
        opt.step()
    return total, vtotal, clip


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", default=str(ROOT / "data" / "rl_sample.jsonl"))
    ap.add_argument("--budget", type=int, default=800, help="tokens per pack")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    a = ap.parse_args()
    torch.set_default_dtype(getattr(torch, a.dtype))

    rollouts = [json.loads(line) for line in open(a.input) if line.strip()]
    vocab = 1 + max(t for r in rollouts for c in r["calls"] for t in c["context"] + c["completion"])
    packs = treeattn.pack(rollouts, share_prefixes=True, budget=a.budget)
    normalizer = float(sum(p.loss_weights.sum() for p in packs))  # the batch's targets
    print(f"{len(rollouts)} rollouts -> {len(packs)} packs, {sum(len(p) for p in packs)} tokens, "
          f"{int(normalizer)} targets, segments per rollout up to {max(int(p.loss_segment.max()) for p in packs) + 1}")

    treeattn.hf.register()
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      attention_dropout=0.0)
    torch.manual_seed(0)
    policy = LlamaForCausalLM(cfg)
    # The critic: a value per row (num_labels=1), no dropout on it.
    ccfg = LlamaConfig(**{k: v for k, v in cfg.to_dict().items() if k not in ("id2label", "label2id")},
                       num_labels=1, classifier_dropout=0.0)
    critic = LlamaForTokenClassification(ccfg)
    for m in (policy, critic):
        m.set_attn_implementation("treeattn")

    # 1. Advantages, both modes, from the same values.
    with torch.no_grad():
        values = [treeattn.hf.values(critic, p) for p in packs]  # V_t under each target's live prefix
    gae = {m: [rl.gae(p, v, gamma=1.0, lam="adaptive", mode=m) for p, v in zip(packs, values)]
           for m in ("compaction", "exact")}
    multi = single = 0.0
    for i, p in enumerate(packs):
        d = (gae["exact"][i][0] - gae["compaction"][i][0]).abs()
        local = p.loss_rollout_local()
        for k, st in enumerate(p.stats):
            dk = float(d[local == k].max())
            if st["junctions"] > 0:
                multi = max(multi, dk)
            else:
                single = max(single, dk)
    print(f"max |A_exact - A_compaction|: rollouts with compactions {multi:.4g}, one-segment rollouts {single:.3g}")

    # 2. PPO with each mode (from the same initial weights).
    init = ({k: v.clone() for k, v in policy.state_dict().items()},
            {k: v.clone() for k, v in critic.state_dict().items()})
    for mode in ("compaction", "exact"):
        policy.load_state_dict(init[0])
        critic.load_state_dict(init[1])
        adv = [x[0] for x in gae[mode]]
        ret = [x[1] for x in gae[mode]]
        t0 = time.perf_counter()
        loss, vloss, clip = ppo_step(policy, critic, packs, adv, ret, normalizer)
        print(f"PPO ({mode:10s}): policy loss {loss:+.5f}, value loss {vloss:.5f}, "
              f"clip fraction {clip:.3f}, {time.perf_counter() - t0:.2f} s")

    # 3. GRPO on the group: group-normalised rewards, no critic.
    group = [r for r in rollouts if r.get("group")]
    gpacks = treeattn.pack(group, share_prefixes=True, budget=a.budget)
    gadv = rl.grpo_advantages(gpacks, dtype=torch.get_default_dtype())
    gnorm = float(sum(p.loss_weights.sum() for p in gpacks))
    policy.load_state_dict(init[0])
    opt = torch.optim.AdamW(policy.parameters(), lr=3e-3)
    with torch.no_grad():
        old = [treeattn.hf.target_logprobs(policy, p) for p in gpacks]
    opt.zero_grad()
    total = 0.0
    for p, adv, o in zip(gpacks, gadv, old):
        lp = treeattn.hf.target_logprobs(policy, p)
        loss, st = rl.policy_loss(lp, o, adv, weights=p.loss_weights, normalizer=gnorm)
        loss.backward()
        total += float(loss.detach())
    opt.step()
    rewards = [r["reward"] for r in group]
    print(f"GRPO: {len(group)} rollouts in {len(gpacks)} pack(s), {len(gpacks[0])} tokens in the first "
          f"(prompt stored once), mean reward {sum(rewards) / len(rewards):.3f}, policy loss {total:+.5f}")


if __name__ == "__main__":
    main()
