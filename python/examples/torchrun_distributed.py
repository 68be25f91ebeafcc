"""treeattn on many processes with torchrun: data parallel (cost-balanced
packs, DDP, one loss normalizer for the whole step) or context parallel (one
pack split over the ranks, K / V of ancestors exchanged per layer).

    # GPUs (NCCL; bfloat16; the extension built with --features cuda):
    torchrun --nproc-per-node 8 python/examples/torchrun_distributed.py --mode dp
    torchrun --nproc-per-node 8 python/examples/torchrun_distributed.py --mode cp
    # CPU (gloo; float32), e.g. to try it on a laptop:
    torchrun --nproc-per-node 2 python/examples/torchrun_distributed.py --mode dp --device cpu

Status: run on CPU with gloo (2 processes, both modes); NOT yet run on a
GPU with NCCL. The model is a tiny random Llama (head dim 64, what the CUDA
kernels take); put your own ``from_pretrained(..., attn_implementation=
"treeattn")`` in its place.
"""

import argparse
import os
import pathlib

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import LlamaConfig, LlamaForCausalLM

import treeattn
import treeattn.hf
from treeattn import distributed as D

ROOT = pathlib.Path(__file__).resolve().parents[2]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("dp", "cp"), default="dp")
    ap.add_argument("--rollouts", default=str(ROOT / "data" / "sample.jsonl"))
    ap.add_argument("--budget", type=int, default=1024, help="tokens per pack (dp)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=2)
    args = ap.parse_args()

    cuda = args.device == "cuda"
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32

    treeattn.hf.register()
    torch.manual_seed(0)  # the same random weights everywhere (DDP also broadcasts them)
    cfg = LlamaConfig(vocab_size=32768, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                      max_position_embeddings=131072, attn_implementation="treeattn")
    model = LlamaForCausalLM(cfg).to(device, dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    cost_model = treeattn.ModelCost.from_config(cfg)

    if args.mode == "dp":
        # Every rank computes the same plan; it takes its own list of packs.
        shards = D.balance(args.rollouts, world, budget=args.budget, model_cost=cost_model)
        if rank == 0:
            rep = D.balance_report(shards, cost_model)
            print(f"{len(shards[0])} micro-steps, cost max/mean per step {rep['step']:.3f}", flush=True)
        ddp = DDP(model, device_ids=[device.index] if cuda else None)
        packs = shards[rank]
        for step in range(args.steps):
            G = D.global_weight(packs).to(device)  # Σ w over the whole step, all ranks
            total = torch.zeros((), dtype=torch.float64, device=device)
            for i, p in enumerate(packs):
                lp = treeattn.hf.target_logprobs(ddp, p)  # empty packs too: every rank in every collective
                loss = -(p.loss_weights.to(device, torch.float64) * lp.double()).sum() / G
                total += loss.detach()
                if i + 1 < len(packs):
                    with ddp.no_sync():
                        (loss * world).backward()  # DDP averages; × world makes it the sum
                else:
                    (loss * world).backward()
            opt.step()
            opt.zero_grad()
            dist.all_reduce(total)
            if rank == 0:
                print(f"step {step}: loss {float(total):.4f}", flush=True)
    else:
        # One pack (every rollout, shared prefixes) split over all ranks.
        (pack,) = treeattn.pack(args.rollouts, share_prefixes=True)
        s = D.shard(pack, model_cost=cost_model)
        wsum = float(pack.loss_weights.double().sum())
        for step in range(args.steps):
            s.stats.reset()
            lp = treeattn.hf.shard_logprobs(model, s)
            loss = -(s.loss_weights.to(device, torch.float64) * lp.double()).sum() / wsum
            loss.backward()
            for p in model.parameters():  # the context-parallel group is one data-parallel replica
                dist.all_reduce(p.grad)
            opt.step()
            opt.zero_grad()
            total = loss.detach().clone()
            dist.all_reduce(total)
            if rank == 0:
                st = s.stats
                print(f"step {step}: loss {float(total):.4f}; rank 0 rows [{s.start}, {s.end}) of {len(pack)}, "
                      f"K/V received {st.bytes_received} B in {st.calls} layers vs all-gather "
                      f"{st.allgather_bytes} B", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
