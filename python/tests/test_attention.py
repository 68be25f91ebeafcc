"""treeattn.torch.tree_attention against torch SDPA with the dense mask.

Tolerances (max abs error / max abs reference, O and dQ/dK/dV): float64
<= 1e-10, float32 <= 1e-5 (float32 op against the float64 reference)."""

import math

import pytest
import torch

import treeattn.torch as tt
from conftest import dense_mask, depths, random_forest, reference_attention, rel_err

TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


def run_both(L, hq, hkv, d, dtype, gen, padding=0.0, rope=False, scale=None):
    kv_end = random_forest(L, gen, padding)
    pos = depths(kv_end)
    base = 10000.0 if rope else None
    x = [torch.randn(L, h, d, dtype=torch.float64, generator=gen) for h in (hq, hkv, hkv)]
    ours = [t.to(dtype).detach().clone().requires_grad_() for t in x]
    ref = [t.detach().clone().requires_grad_() for t in x]
    o = tt.tree_attention(*ours, kv_end, scale=scale,
                          position_ids=pos if rope else None, rope_base=base)
    o_ref = reference_attention(*ref, kv_end, scale=scale, position_ids=pos, rope_base=base)
    d_o = torch.randn(L, hq, d, dtype=torch.float64, generator=gen)
    o.backward(d_o.to(dtype))
    o_ref.backward(d_o)
    return kv_end, o, o_ref, ours, ref


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("rope", [False, True])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("padding", [0.0, 0.15])
def test_matches_sdpa(dtype, rope, heads, padding, gen):
    hq, hkv = heads
    for L, d in [(1, 8), (37, 16), (150, 32)]:
        kv_end, o, o_ref, ours, ref = run_both(L, hq, hkv, d, dtype, gen, padding, rope)
        assert o.dtype == dtype and o.shape == (L, hq, d)
        tol = TOL[dtype]
        assert rel_err(o, o_ref) <= tol, (L, kv_end.tolist())
        for name, a, b in zip("qkv", ours, ref):
            assert torch.isfinite(a.grad).all()
            assert rel_err(a.grad, b.grad) <= tol, (name, L, kv_end.tolist())


def test_scale_is_used(gen):
    kv_end, o, o_ref, ours, ref = run_both(40, 2, 1, 8, torch.float64, gen, scale=0.3)
    assert rel_err(o, o_ref) <= 1e-10
    # Negative control: the default scale gives another result.
    o_default = tt.tree_attention(*[t.detach() for t in ours], kv_end)
    assert rel_err(o_default, o_ref) > 1e-3


def test_mask_matters(gen):
    """Negative control: the same inputs under plain causal attention differ
    (so the comparison above can fail)."""
    L = 60
    kv_end = random_forest(L, gen)
    while bool((kv_end == L).all()):
        kv_end = random_forest(L, gen)
    q, k, v = (torch.randn(L, 2, 8, dtype=torch.float64, generator=gen) for _ in range(3))
    o = tt.tree_attention(q, k, v, kv_end)
    causal = tt.tree_attention(q, k, v, torch.full((L,), L))
    assert rel_err(o, causal) > 1e-3
    assert rel_err(causal, reference_attention(q, k, v, torch.full((L,), L))) <= 1e-10


def test_rotary_matters(gen):
    L = 30
    kv_end = random_forest(L, gen)
    pos = depths(kv_end)
    q, k, v = (torch.randn(L, 2, 16, dtype=torch.float64, generator=gen) for _ in range(3))
    o_rot = tt.tree_attention(q, k, v, kv_end, position_ids=pos, rope_base=500.0)
    ref = reference_attention(q, k, v, kv_end, position_ids=pos, rope_base=500.0)
    assert rel_err(o_rot, ref) <= 1e-10
    assert rel_err(tt.tree_attention(q, k, v, kv_end), ref) > 1e-3
    # rope_dims < d: only the first rope_dims lanes rotate.
    from conftest import rotate
    qr, kr = rotate(q, pos, 500.0, 8), rotate(k, pos, 500.0, 8)
    part = reference_attention(qr, kr, v, kv_end)
    assert rel_err(tt.tree_attention(q, k, v, kv_end, position_ids=pos, rope_base=500.0, rope_dims=8), part) <= 1e-10


def test_fully_masked_rows_are_zero_and_finite():
    # Key 0 is a padding key and the root of nothing: row 0 sees no key;
    # row 3 is a root whose only key (itself) is padding too.
    kv_end = torch.tensor([0, 3, 3, 3, 6, 6], dtype=torch.int64)
    L = 6
    assert not dense_mask(kv_end)[0].any() and not dense_mask(kv_end)[3].any()
    for dtype in (torch.float64, torch.float32):
        q, k, v = (torch.randn(L, 2, 4, dtype=dtype, requires_grad=True) for _ in range(3))
        o = tt.tree_attention(q, k, v, kv_end)
        assert (o[0] == 0).all() and (o[3] == 0).all()
        o.backward(torch.randn_like(o))
        for t in (q, k, v):
            assert torch.isfinite(t.grad).all()
        assert (q.grad[0] == 0).all() and (q.grad[3] == 0).all()
        # Padding keys get no gradient: no query sees them.
        assert (k.grad[0] == 0).all() and (v.grad[3] == 0).all()


def test_non_contiguous_inputs(gen):
    L, d = 25, 8
    kv_end = random_forest(L, gen)
    base = torch.randn(L, d, 3, dtype=torch.float64, generator=gen)
    q = base.permute(0, 2, 1)  # [L, 3, d], not contiguous
    k = torch.randn(2 * L, 1, d, dtype=torch.float64, generator=gen)[::2]
    v = torch.randn(L, 1, 2 * d, dtype=torch.float64, generator=gen)[..., ::2]
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    o = tt.tree_attention(q, k, v, kv_end)
    o2 = tt.tree_attention(q.contiguous(), k.contiguous(), v.contiguous(), kv_end.to(torch.int32))
    assert torch.equal(o, o2)
    assert rel_err(o, reference_attention(q, k, v, kv_end)) <= 1e-10


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rope", [False, True])
def test_half_inputs_compute_in_f32(dtype, rope, gen):
    """bf16 / f16 CPU tensors go to the crate as they are: O bit for bit the
    float32 op on the widened inputs, rounded once; the LSE float32; the
    gradients bit for bit the float32 backward on the widened O, LSE and
    dO, rounded once (no tolerance: the crate widens exactly). On the
    avx512+bf16 path bf16's block products run on bf16 pairs, P and dS
    rounded to bf16: there, within the 16-bit tolerances (1e-2 O and LSE,
    2e-2 gradients, relative)."""
    L = 70
    kv_end = random_forest(L, gen)
    pos = depths(kv_end) if rope else None
    kw = dict(position_ids=pos, rope_base=10000.0) if rope else {}
    x = [torch.randn(L, h, 16, generator=gen).to(dtype) for h in (4, 2, 2)]
    xs = [t.clone().requires_grad_() for t in x]
    o = tt.tree_attention(*xs, kv_end, **kw)
    assert o.dtype == dtype
    g = torch.randn(o.shape, generator=gen).to(dtype)
    (o.float() * g.float()).sum().backward()
    assert all(t.grad.dtype == dtype for t in xs)
    w = [t.float() for t in x]
    scale, rb, rd = 16 ** -0.5, (10000.0 if rope else None), (16 if rope else None)
    o_, lse = tt._attn_fwd(*x, kv_end, pos, scale, rb, rd, 0)
    assert lse.dtype == torch.float32 and torch.equal(o_, o)
    o32, lse32 = tt._attn_fwd(*w, kv_end, pos, scale, rb, rd, 0)
    assert not torch.equal(o.float(), o32)  # the rounding is real
    ref = tt._attn_bwd(*w, kv_end, pos, o.float(), lse, g.float(), scale, rb, rd, 0)
    if dtype == torch.bfloat16 and tt.cpu_isa() == "avx512+bf16":
        def rel(a, b):
            a, b = a.detach().float(), b.detach().float()
            keep = torch.isfinite(b)
            return float((a[keep] - b[keep]).norm() / b[keep].norm())
        assert rel(o, o32) < 1e-2 and rel(lse, lse32) < 1e-2
        # The pair products ran: the float32 LSE shows their summation order
        # (O, rounded to bf16, may hide it on a case this small).
        assert not torch.equal(lse, lse32)
        for t, r in zip(xs, ref):
            assert rel(t.grad, r) < 2e-2
        return
    assert torch.equal(o, o32.to(dtype))
    assert torch.equal(lse, lse32)
    for t, r in zip(xs, ref):
        assert torch.equal(t.grad, r.to(dtype))


def test_opcheck(gen):
    L = 12
    kv_end = random_forest(L, gen, 0.1)
    pos = depths(kv_end)
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        q = torch.randn(L, 4, 8, dtype=dtype, requires_grad=True)
        k = torch.randn(L, 2, 8, dtype=dtype, requires_grad=True)
        v = torch.randn(L, 2, 8, dtype=dtype, requires_grad=True)
        for args in [
            (q, k, v, kv_end, None, 0.35, None, None, 0),
            (q, k, v, kv_end, pos, 0.35, 10000.0, 8, 1),
        ]:
            torch.library.opcheck(torch.ops.treeattn.tree_attention_fwd.default, args)
        with torch.no_grad():
            o, lse = torch.ops.treeattn.tree_attention_fwd(q, k, v, kv_end, pos, 0.35, 10000.0, 8, 0)
        torch.library.opcheck(
            torch.ops.treeattn.tree_attention_bwd.default,
            (q.detach(), k.detach(), v.detach(), kv_end, pos, o, lse, torch.randn_like(o), 0.35, 10000.0, 8, 0),
        )


def test_gradcheck(gen):
    L = 9
    kv_end = random_forest(L, gen, 0.1)
    pos = depths(kv_end)
    x = [torch.randn(L, h, 4, dtype=torch.float64, generator=gen, requires_grad=True) for h in (2, 1, 1)]
    f = lambda q, k, v: tt.tree_attention(q, k, v, kv_end, position_ids=pos, rope_base=100.0)  # noqa: E731
    assert torch.autograd.gradcheck(f, x)


def test_torch_compile_fullgraph(gen):
    torch._dynamo.reset()
    L = 33
    kv_end = random_forest(L, gen, 0.1)
    pos = depths(kv_end)
    w = torch.randn(16, 16, dtype=torch.float32, generator=gen)

    def layer(x, kv_end, pos):
        q = (x @ w).view(L, 2, 8)
        k = (x @ w.t()).view(L, 2, 8)[:, :1]
        v = x.view(L, 2, 8)[:, 1:]
        o = tt.tree_attention(q, k, v, kv_end, position_ids=pos, rope_base=10000.0)
        return torch.tanh(o).sum()

    x = torch.randn(L, 16, generator=gen, requires_grad=True)
    compiled = torch.compile(layer, fullgraph=True)
    y = compiled(x, kv_end, pos)
    (gx,) = torch.autograd.grad(y, x)
    x2 = x.detach().clone().requires_grad_()
    y2 = layer(x2, kv_end, pos)
    (gx2,) = torch.autograd.grad(y2, x2)
    assert rel_err(y, y2) <= 1e-5 and rel_err(gx, gx2) <= 1e-5


def test_threads_setting(gen):
    L = 70
    kv_end = random_forest(L, gen)
    q, k, v = (torch.randn(L, 2, 8, dtype=torch.float64, generator=gen) for _ in range(3))
    tt.set_num_threads(1)
    try:
        o1 = tt.tree_attention(q, k, v, kv_end)
    finally:
        tt.set_num_threads(0)
    # The backend is deterministic whatever the thread count.
    assert torch.equal(o1, tt.tree_attention(q, k, v, kv_end))
