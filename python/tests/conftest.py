"""Shared helpers of the treeattn Python tests: random tree masks, the dense
reference, rotary in torch."""

import pathlib

import pytest
import torch

REPO = pathlib.Path(__file__).resolve().parents[2]
SAMPLE = REPO / "data" / "sample.jsonl"

# The README's worked example (DESIGN §4), as a list of dicts.
GOLDEN = [
    {
        "id": "r17",
        "calls": [
            {"context": [10, 11, 20], "completion": [30, 31]},
            {"context": [10, 11, 20, 30, 31, 40], "completion": [32]},
            {"context": [10, 11, 20, 30, 31, 40, 32, 1], "completion": [50, 51]},
            {"context": [10, 11, 3, 50, 51, 40, 32], "completion": [33]},
        ],
    }
]


def random_forest(L, gen, padding=0.0):
    """kv_end of a random forest laid out in pre-order (nested intervals):
    each node's subtree is a contiguous range. With probability `padding` a
    key becomes a padding key (kv_end[k] == k, seen by no query)."""
    kv_end = [0] * L
    stack = []  # open nodes: their subtrees end where the next sibling of theirs starts

    i = 0
    while i < L:
        # pop a random number of open ancestors (0 = child of the top)
        if stack:
            pops = int(torch.randint(0, len(stack) + 1, (1,), generator=gen))
            for _ in range(pops):
                kv_end[stack.pop()] = i
        stack.append(i)
        i += 1
    for s in stack:
        kv_end[s] = L
    kv_end = torch.tensor(kv_end, dtype=torch.int64)
    if padding > 0:
        pad = torch.rand(L, generator=gen) < padding
        kv_end = torch.where(pad, torch.arange(L), kv_end)
    return kv_end


def depths(kv_end):
    """Depth position ids of a pre-order forest (padding keys ignored as ancestors)."""
    L = kv_end.shape[0]
    pos = []
    for q in range(L):
        pos.append(sum(1 for k in range(q) if k < q < int(kv_end[k])))
    return torch.tensor(pos, dtype=torch.int64)


def dense_mask(kv_end):
    """mask[q, k] = k <= q < kv_end[k]."""
    L = kv_end.shape[0]
    idx = torch.arange(L)
    return (idx[None, :] <= idx[:, None]) & (idx[:, None] < kv_end[None, :])


def rotate(x, pos, base, dims=None):
    """Llama rotate-half rotary on [L, H, d] at integer positions pos [L]."""
    d = x.shape[-1]
    dims = dims or d
    half = dims // 2
    inv = base ** (-torch.arange(half, dtype=torch.float64) * 2.0 / dims)
    ang = pos.to(torch.float64)[:, None] * inv[None, :]  # [L, half]
    cos = torch.cat([ang.cos(), ang.cos()], -1)[:, None, :].to(x.dtype)
    sin = torch.cat([ang.sin(), ang.sin()], -1)[:, None, :].to(x.dtype)
    xr, rest = x[..., :dims], x[..., dims:]
    x1, x2 = xr[..., :half], xr[..., half:]
    rot = torch.cat([-x2, x1], -1)
    return torch.cat([xr * cos + rot * sin, rest], -1)


def reference_attention(q, k, v, kv_end, scale=None, position_ids=None, rope_base=None):
    """torch SDPA with the dense boolean mask from kv_end. Fully masked rows
    (SDPA would give NaN) get one visible dummy key and their output is then
    replaced by 0, which adds nothing to any gradient."""
    L, hq, d = q.shape
    g = hq // k.shape[1]
    if rope_base is not None:
        q = rotate(q, position_ids, rope_base)
        k = rotate(k, position_ids, rope_base)
    m = dense_mask(kv_end)
    empty = ~m.any(1)
    m = m | (torch.eye(L, dtype=torch.bool) & empty[:, None])
    qq = q.transpose(0, 1)[None]
    kk = k.repeat_interleave(g, 1).transpose(0, 1)[None]
    vv = v.repeat_interleave(g, 1).transpose(0, 1)[None]
    o = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, attn_mask=m, scale=scale)
    o = o[0].transpose(0, 1)
    return torch.where(empty[:, None, None], torch.zeros_like(o), o)


def rel_err(a, b, floor=1.0):
    """max |a - b| / max(max |b|, floor).

    The floor: the tests' inputs are O(1) (randn), so rounding errors are
    absolute at that scale. A reference that is mathematically zero (dQ and
    dK of a pack with one token: softmax over a single key) comes out as
    rounding noise on either side (SDPA's ~1e-16, a float32 op's ~1e-7, or
    exact 0, depending on the machine's kernels); dividing noise by noise
    would give ~1 for a correct result."""
    a, b = a.detach().to(torch.float64), b.detach().to(torch.float64)
    den = max(float(b.abs().max()) if b.numel() else 0.0, floor)
    return float((a - b).abs().max()) / den if a.numel() else 0.0


@pytest.fixture
def gen():
    # Fresh trees every run (the seed is printed on failure by the tests).
    g = torch.Generator()
    g.seed()
    return g
