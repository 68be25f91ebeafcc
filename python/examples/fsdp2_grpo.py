"""A GRPO step under FSDP2 on 2 processes (gloo on CPU here; NCCL on GPUs
the same way), with verl's conventions: the GRPO group of
data/rl_sample.jsonl packed and balanced over the ranks, advantages with
the sample std over the whole group across ranks, the clipped policy loss
with truncated importance sampling against the rollout engine's log-probs
and a k3 KL to a reference, token-mean over the whole step, log-probs at
the sampling temperature — then one optimizer step, and the same step in
one process for comparison.

The model is ``fully_shard``-ed per decoder layer and at the root (FSDP2's
usual wrapping): the output embedding belongs to the root unit, and
``treeattn.hf`` scores the targets inside the model's own forward, where
FSDP2 has gathered it.

    python python/examples/fsdp2_grpo.py [--world 2] [--dtype float64]

Prints, per rank, its packs and targets, then the step's loss summed over
the ranks against the single process's, the largest relative difference of
the gradients, and the loss after the step.
"""

import argparse
import datetime
import json
import os
import pathlib
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import LlamaConfig, LlamaForCausalLM

import treeattn
import treeattn.hf
import treeattn.rl as rl
from treeattn import distributed as D

ROOT = pathlib.Path(__file__).resolve().parents[2]
TEMPERATURE = 0.8


def model_of(vocab, dtype):
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=8192,
                      attention_dropout=0.0)
    torch.manual_seed(0)  # the same weights in every process
    model = LlamaForCausalLM(cfg).to(dtype)
    model.set_attn_implementation("treeattn")
    return model


def old_logprobs(model, packs):
    """The policy before the step (and, here, the rollout engine's and the
    reference policy's log-probs, shifted from it as a mismatched sampler and
    an older reference would be)."""
    with torch.no_grad():
        old = [treeattn.hf.target_logprobs(model, p, temperature=TEMPERATURE) for p in packs]
    return [(o, o - 0.02, o + 0.05) for o in old]


def step_loss(model, pack, adv, old, normalizer):
    """The policy loss of one pack's targets (verl's defaults: clamp the
    log-ratio at 20, TIS cap 2, k3 KL with coefficient 0.01, token-mean
    over the step's targets)."""
    lp = treeattn.hf.target_logprobs(model, pack, temperature=TEMPERATURE)
    old_lp, rollout_lp, ref_lp = old
    loss, stats = rl.policy_loss(lp, old_lp, adv, weights=pack.loss_weights.to(lp.dtype), normalizer=normalizer,
                                 rollout_logp=rollout_lp, tis_cap=2.0, ref_logp=ref_lp, kl_coef=0.01)
    return loss, stats


def run(rank, world, args, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=args.init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        treeattn.hf.register()
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        dtype = getattr(torch, args.dtype)
        rollouts = [json.loads(line) for line in open(args.input) if line.strip()]
        group = [r for r in rollouts if r.get("group")]
        vocab = 1 + max(t for r in rollouts for c in r["calls"] for t in c["context"] + c["completion"])
        shards = D.balance(group, world, budget=args.budget)
        packs = shards[rank]
        adv = rl.grpo_advantages(packs, dtype=dtype, distributed=True)  # sample std over the whole group
        normalizer = float(D.global_weight(packs))
        model = model_of(vocab, dtype)
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        opt.zero_grad()
        old = old_logprobs(model, packs)
        total = torch.zeros((), dtype=torch.float64)
        for p, a, o in zip(packs, adv, old):
            loss, _ = step_loss(model, p, a, o, normalizer)
            (loss * world).backward()  # FSDP2 averages over the ranks
            total += loss.detach().double()
        dist.all_reduce(total)
        grads = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}
        opt.step()
        after = torch.zeros((), dtype=torch.float64)
        with torch.no_grad():
            for p, a, o in zip(packs, adv, old):
                after += step_loss(model, p, a, o, normalizer)[0].double()
        dist.all_reduce(after)
        print(f"rank {rank}: {len(packs)} pack(s), {sum(len(p) for p in packs)} tokens, "
              f"{int(sum(p.loss_rows.numel() for p in packs))} targets", flush=True)
        if rank == 0:
            torch.save((float(total), grads, float(after)), out)
    finally:
        dist.destroy_process_group()


def single_process(args):
    treeattn.hf.register()
    dtype = getattr(torch, args.dtype)
    rollouts = [json.loads(line) for line in open(args.input) if line.strip()]
    group = [r for r in rollouts if r.get("group")]
    vocab = 1 + max(t for r in rollouts for c in r["calls"] for t in c["context"] + c["completion"])
    # The same packs, one after the other (a different packing is the same
    # loss too, but HF's RMSNorm computes in float32 even for a float64
    # model, so its gradients would differ by ~1e-8 relative).
    packs = [p for shard in D.balance(group, args.world, budget=args.budget) for p in shard]
    adv = rl.grpo_advantages(packs, dtype=dtype)
    normalizer = float(sum(p.loss_weights.sum() for p in packs))
    model = model_of(vocab, dtype)
    old = old_logprobs(model, packs)
    total = 0.0
    for p, a, o in zip(packs, adv, old):
        loss, _ = step_loss(model, p, a, o, normalizer)
        loss.backward()
        total += float(loss.detach())
    return total, {n: p.grad.clone() for n, p in model.named_parameters()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", default=str(ROOT / "data" / "rl_sample.jsonl"))
    ap.add_argument("--budget", type=int, default=200,
                    help="tokens per pack (the group, 297 tokens shared, splits in two)")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--dtype", default="float64", choices=["float32", "float64"])
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        # The ranks meet at a file store (one machine): no TCP port to pick.
        args.init = "file://" + os.path.join(tmp, "rendezvous")
        out = os.path.join(tmp, "rank0.pt")
        mp.spawn(run, args=(args.world, args, out), nprocs=args.world, join=True)
        total, grads, after = torch.load(out)
    ref_total, ref_grads = single_process(args)
    worst = max(float((grads[n] - g).norm() / max(float(g.norm()), 1e-30)) for n, g in ref_grads.items())
    print(f"FSDP2 on {args.world} ranks: step loss {total:+.10f}, one process {ref_total:+.10f}, "
          f"largest relative gradient difference {worst:.2e}")
    print(f"after one step: loss {after:+.10f}")


if __name__ == "__main__":
    main()
