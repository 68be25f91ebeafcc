"""The attention variants of the models people train, on a tree: sliding
windows (of tree levels), logit softcaps, attention sinks and a value head
dim unlike the query / key one (MLA) — against a dense float64 reference
written from the definitions, with autograd for every gradient (sinks
included), and negative controls that must fail."""

import math

import pytest
import torch

import treeattn
import treeattn.torch as tt
from conftest import depths, random_forest, rel_err


def dense_variant(q, k, v, kv_end, *, scale, window=None, softcap=None, sinks=None, sink_value=None):
    """The definition, one [L, L] score matrix per head: key k is visible to
    query q iff k <= q < kv_end[k] and (with a window) depth(q) − depth(k) <
    window, depth counted pair by pair (`conftest.depths`); the scaled
    score is softcapped as c · tanh(s / c); a sink adds exp(σ_h) to each
    row's denominator with no value. Differentiable (autograd gives the
    gradients, sinks included)."""
    L, hq, _ = q.shape
    g = hq // k.shape[1]
    idx = torch.arange(L)
    m = (idx[None, :] <= idx[:, None]) & (idx[:, None] < kv_end[None, :])
    if window is not None:
        dep = depths(kv_end)
        m = m & (dep[:, None] - dep[None, :] < window)
    kk = k.repeat_interleave(g, 1)
    vv = v.repeat_interleave(g, 1)
    s = torch.einsum("qhd,khd->hqk", q, kk) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~m[None], float("-inf"))
    if sinks is not None:
        col = sinks.to(s.dtype)[:, None, None].expand(hq, L, 1)
        s = torch.cat([s, col], -1)
    lse = torch.logsumexp(s, -1, keepdim=True)
    p = torch.where(torch.isfinite(lse), torch.exp(s - lse), torch.zeros_like(s))
    o = torch.einsum("hqk,khd->qhd", p[..., :L], vv)
    if sink_value is not None:  # a (wrong) sink that carries a value
        o = o + p[..., L].transpose(0, 1)[..., None] * sink_value
    return o


def make(gen, L, hq, hkv, d, dv, dtype=torch.float64, padding=0.1, sinks=False):
    kv_end = random_forest(L, gen, padding=padding)
    q = (2 * torch.randn(L, hq, d, generator=gen)).to(dtype).requires_grad_()
    k = (2 * torch.randn(L, hkv, d, generator=gen)).to(dtype).requires_grad_()
    v = torch.randn(L, hkv, dv, generator=gen).to(dtype).requires_grad_()
    s = (3 * torch.randn(hq, generator=gen)).to(dtype).requires_grad_() if sinks else None
    return q, k, v, kv_end, s


def grads(out, inputs, seed_grad):
    return torch.autograd.grad(out, [t for t in inputs if t is not None], seed_grad)


VARIANTS = [
    dict(window=1),
    dict(window=4),
    dict(softcap=1.0),
    dict(sinks=True),
    dict(dv=12),
    dict(window=3, softcap=2.5, sinks=True),
    dict(window=6, softcap=0.7, sinks=True, dv=20),
]


@pytest.mark.parametrize("var", VARIANTS, ids=lambda v: "-".join(f"{k}{v[k]}" for k in v))
@pytest.mark.parametrize("heads", [(4, 4), (6, 2)])
def test_matches_the_definition_float64(var, heads, gen):
    hq, hkv = heads
    d, dv = 16, var.get("dv", 16)
    q, k, v, kv_end, sinks = make(gen, 90, hq, hkv, d, dv, sinks=var.get("sinks", False))
    scale = 1 / math.sqrt(d)
    kw = dict(window=var.get("window"), softcap=var.get("softcap"), sinks=sinks)
    o = tt.tree_attention(q, k, v, kv_end, **kw)
    ref = dense_variant(q, k, v, kv_end, scale=scale, **kw)
    assert o.shape == (90, hq, dv)
    assert rel_err(o, ref) < 1e-12, f"seed {gen.initial_seed()}"
    go = torch.randn(o.shape, generator=gen, dtype=o.dtype)
    ins = [q, k, v, sinks]
    for name, a, b in zip(["dq", "dk", "dv", "dsinks"], grads(o, ins, go), grads(ref, ins, go)):
        assert rel_err(a, b) < 1e-11, f"{name}, seed {gen.initial_seed()}"


def test_float32_and_bfloat16(gen):
    q, k, v, kv_end, sinks = make(gen, 120, 4, 2, 32, 32, sinks=True)
    kw = dict(window=5, softcap=2.0)
    ref = dense_variant(q, k, v, kv_end, scale=1 / math.sqrt(32), sinks=sinks, **kw)
    for dtype, tol in [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)]:
        c = [t.detach().to(dtype) for t in (q, k, v, sinks)]
        o = tt.tree_attention(c[0], c[1], c[2], kv_end, sinks=c[3], **kw)
        assert o.dtype == dtype
        assert rel_err(o, ref) < tol, dtype


def test_negative_controls_differ(gen):
    """What a mistake would compute is far from the op's result: a window
    one level off, the softcap on the unscaled score, a sink that carries a
    value (ones): each at least 1e-2 relative on a deep tree."""
    L, d = 120, 16
    # A trunk of 60 rows and two branches of 30: depths up to 89.
    kv_end = torch.tensor([120] * 60 + [90] * 30 + [120] * 30)
    q, k, v = (2 * torch.randn(L, 4, d, generator=gen, dtype=torch.float64) for _ in range(3))
    sinks = torch.randn(4, generator=gen, dtype=torch.float64)
    scale = 1 / math.sqrt(d)
    o = tt.tree_attention(q, k, v, kv_end, window=4, softcap=1.0, sinks=sinks)
    assert rel_err(o, dense_variant(q, k, v, kv_end, scale=scale, window=4, softcap=1.0, sinks=sinks)) < 1e-12
    for w in (3, 5):
        wrong = dense_variant(q, k, v, kv_end, scale=scale, window=w, softcap=1.0, sinks=sinks)
        assert rel_err(o, wrong) > 1e-2, f"window {w}"
    before_scale = dense_variant(q, k, v, kv_end, scale=scale, window=4, softcap=1.0 * scale, sinks=sinks)
    assert rel_err(o, before_scale) > 1e-2
    with_value = dense_variant(q, k, v, kv_end, scale=scale, window=4, softcap=1.0, sinks=sinks, sink_value=1.0)
    assert rel_err(o, with_value) > 1e-2


def test_chain_window_is_transformers_sliding_window(gen):
    """On a chain (causal kv_end = L) the window is q − k < W: the same as a
    dense sliding-window mask, whatever the position ids."""
    L, W = 70, 9
    q, k, v = (torch.randn(L, 2, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    kv_end = torch.full((L,), L)
    o = tt.tree_attention(q, k, v, kv_end, window=W)
    idx = torch.arange(L)
    m = (idx[None, :] <= idx[:, None]) & (idx[:, None] - idx[None, :] < W)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=m
    ).transpose(0, 1)
    assert rel_err(o, ref) < 1e-12


def test_a_row_with_no_visible_key_gets_o_zero_and_the_sink(gen):
    """Padding rows see nothing: O = 0, no NaN anywhere, and with sinks the
    row's gradient is 0 (D = 0)."""
    kv_end = torch.tensor([2, 2, 2, 4, 4])  # row 2 is a padding key seeing nothing
    q, k, v = (torch.randn(5, 2, 4, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3))
    sinks = torch.randn(2, dtype=torch.float64, requires_grad=True)
    o = tt.tree_attention(q, k, v, kv_end, sinks=sinks, window=1)
    assert torch.equal(o[2], torch.zeros_like(o[2]))
    o.sum().backward()
    for t in (q, k, v, sinks):
        assert torch.isfinite(t.grad).all()
    assert torch.equal(q.grad[2], torch.zeros_like(q.grad[2]))


def test_bad_arguments_are_value_errors(gen):
    q, k, v, kv_end, _ = make(gen, 10, 2, 1, 8, 8)
    for kw, needle in [
        (dict(window=0), "window"),
        (dict(window=True), "window"),
        (dict(window=2.5), "window"),
        (dict(softcap=0.0), "softcap"),
        (dict(softcap=float("nan")), "softcap"),
        (dict(sinks=torch.zeros(3)), "sinks"),
        (dict(sinks=torch.zeros(2, dtype=torch.int64)), "sinks"),
    ]:
        with pytest.raises(ValueError, match=needle):
            tt.tree_attention(q, k, v, kv_end, **kw)
    with pytest.raises(ValueError, match="v must be"):
        tt.tree_attention(q, k, v[:, :, None].expand(10, 1, 2, 8).reshape(10, 2, 8), kv_end)
    # A window on crossing ranges (no tree): refused by the crate.
    crossing = torch.tensor([3, 4, 4, 4])
    x = torch.randn(4, 1, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="tree-shaped"):
        tt.tree_attention(x, x, x, crossing, window=2)
    assert torch.isfinite(tt.tree_attention(x, x, x, crossing)).all()


def test_a_batch_window_stays_in_each_pack(gen):
    """A collate batch is a forest: each pack's rows attend with the window
    as they do alone."""
    packs = treeattn.pack([
        {"id": "a", "calls": [{"context": list(range(1, 30)), "completion": [5, 6, 7]},
                              {"context": list(range(1, 12)) + [40], "completion": [8, 9]}]},
        {"id": "b", "calls": [{"context": list(range(1, 22)), "completion": [3, 4]}]},
    ], budget=40, share_prefixes=False)
    assert len(packs) == 2
    batch = treeattn.collate(packs)
    B, L = batch["kv_end"].shape
    flat = (batch["kv_end"] + torch.arange(B)[:, None] * L).reshape(-1)
    q, k, v = (torch.randn(B * L, 2, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    o = tt.tree_attention(q, k, v, flat, window=5, softcap=3.0)
    for b, p in enumerate(packs):
        n = len(p)
        rows = slice(b * L, b * L + n)
        alone = tt.tree_attention(q[rows], k[rows], v[rows], p.kv_end, window=5, softcap=3.0)
        assert rel_err(o[rows], alone) < 1e-13


def test_flex_backend_computes_the_same_forward(gen):
    """backend="flex": the window in its mask_mod (depths), the softcap as
    its score_mod — the same O as the crate's op (FlexAttention compiled on
    CPU: forward only, and without the LSE sinks need there: refused)."""
    q, k, v, kv_end, sinks = make(gen, 200, 4, 2, 16, 16, dtype=torch.float32, sinks=True)
    q, k, v, sinks = (t.detach() for t in (q, k, v, sinks))
    mask = tt.MaskPlan(kv_end)
    for kw in [dict(window=7), dict(softcap=1.5), dict(window=3, softcap=2.0)]:
        ours = tt.tree_attention(q, k, v, mask, **kw)
        flex = tt.tree_attention(q, k, v, mask, backend="flex", block_size=64, **kw)
        assert rel_err(flex, ours) < 2e-5, kw
    with pytest.raises(ValueError, match="LSE"):
        tt.tree_attention(q, k, v, mask, backend="flex", sinks=sinks)


def test_windowed_block_census_is_sound(gen):
    kv_end = random_forest(300, gen, padding=0.05)
    m = tt.MaskPlan(kv_end)
    dep = m.depths()
    assert torch.equal(dep, depths(kv_end))
    for w in (1, 4, 30):
        idx = torch.arange(300)
        dense = tt.MaskPlan(kv_end).dense() & (dep[:, None] - dep[None, :] < w)
        num, ind, fnum, find = m.block_census(32, window=w)
        plain = m.block_census(32)
        assert int(num.sum() + fnum.sum()) <= int(plain[0].sum() + plain[2].sum())
        n = num.shape[0]
        for i in range(n):
            listed = set(ind[i, : num[i]].tolist()) | set(find[i, : fnum[i]].tolist())
            full = set(find[i, : fnum[i]].tolist())
            for j in range(n):
                blk = dense[i * 32:(i + 1) * 32, j * 32:(j + 1) * 32]
                if j in full:
                    assert bool(blk.all()) and blk.shape == (32, 32), (w, i, j)
                if j not in listed:
                    assert not bool(blk.any()), (w, i, j)
        del idx


def test_opcheck_with_variants(gen):
    q, k, v, kv_end, sinks = make(gen, 40, 4, 2, 8, 6, sinks=True)
    args = (q.detach(), k.detach(), v.detach(), kv_end, None, 0.3, None, None, 0, 0, 3, 1.5, sinks.detach())
    torch.library.opcheck(torch.ops.treeattn.tree_attention_fwd.default, args)
