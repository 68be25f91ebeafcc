"""FlexAttention BlockMask of a tree pack: treeattn's MaskPlan.block_mask
(the crate's block census, O(L + n²)) against create_block_mask (mask_mod
evaluated per pair), on the same kv_end, same process, interleaved.

    PYTHONPATH=python python python/bench/block_mask.py [--tokens 16384,65536] [--block 128] [--reps 3]

The tree: a GRPO-style fan (a prompt of L/8 tokens, then answers of
L/64 tokens each) — the rule of INTEGRATION-NOTES' create_block_mask
figure. Prints median seconds of each, the ratio, and the BlockMask's
index memory.
"""

import argparse
import statistics
import time

import torch
from torch.nn.attention.flex_attention import create_block_mask

import treeattn.torch as tt


def fan(L):
    prompt, answer = L // 8, L // 64
    kv = [L] * prompt
    start = prompt
    while start < L:
        end = min(start + answer, L)
        kv += [end] * (end - start)
        start = end
    return torch.tensor(kv)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="16384,65536")
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--compile", action="store_true", help="create_block_mask(_compile=True)")
    a = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, block {a.block}, "
          f"create_block_mask _compile={a.compile}")
    print("| L | MaskPlan.block_mask, s | create_block_mask, s | ratio | index memory, MiB |")
    print("|---|---|---|---|---|")
    for L in (int(x) for x in a.tokens.split(",")):
        kv = fan(L)
        kv_pad = torch.cat([kv, torch.zeros(a.block, dtype=kv.dtype)])

        def mod(b, h, q, k):
            return (k <= q) & (q < kv_pad[k])

        ours, theirs = [], []
        ref = None
        for _ in range(a.reps):
            t0 = time.perf_counter()
            bm = tt.MaskPlan(kv).block_mask(a.block)
            ours.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            try:
                ref = create_block_mask(mod, 1, 1, L, L, device="cpu", BLOCK_SIZE=a.block, _compile=a.compile)
                theirs.append(time.perf_counter() - t0)
            except RuntimeError as e:  # the dense [L, L] evaluation does not fit
                theirs.append(None)
                why = str(e).split("you tried to allocate ")[-1].split(" bytes")[0]
        mem = sum(t.numel() * t.element_size() for t in (bm.kv_indices, bm.full_kv_indices, bm.q_indices, bm.full_q_indices)) / 2**20
        o = statistics.median(ours)
        if ref is None:
            print(f"| {L:,} | {o:.4f} | out of memory (asked for {int(why) / 2**30:.0f} GiB) | — | {mem:.1f} |")
            continue
        assert torch.equal(bm.kv_num_blocks, ref.kv_num_blocks)
        assert torch.equal(bm.full_kv_num_blocks, ref.full_kv_num_blocks)
        t = statistics.median(theirs)
        print(f"| {L:,} | {o:.4f} | {t:.2f} | {t / o:.0f}× | {mem:.1f} |")


if __name__ == "__main__":
    main()
