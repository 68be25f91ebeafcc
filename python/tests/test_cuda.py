"""The CUDA path of treeattn.torch: the kernels on torch's CUDA tensors.

On a machine without a GPU (CI) this checks what can be checked there: the
CUDA kernels are registered with torch's dispatcher for every op, the
native entries of a build without the `cuda` feature raise a
``RuntimeError`` that says how to get one, and the fake (meta) LSE dtype
matches what the CUDA kernel returns. With a GPU and a `cuda` build (the
GPU check script installs such a wheel) the op runs on the device and is
compared with the CPU backend on the same rounded inputs, with the bounds
of the crate's tolerance table (`backend::tolerance`): relative Frobenius
error of O 1e-2 (bf16) / 2e-3 (f16), of dQ, dK, dV 2e-2 / 5e-3; SDCC loss
1e-4 relative, gradient 1e-3.
"""

import pytest
import torch

import treeattn.torch as tt
from treeattn import _native
from conftest import depths, random_forest

gpu = pytest.mark.skipif(
    not (torch.cuda.is_available() and tt.cuda_built()),
    reason="needs a CUDA device and an extension built with the `cuda` feature",
)

BOUNDS = {torch.bfloat16: (1e-2, 2e-2), torch.float16: (2e-3, 5e-3)}


def rel_frobenius(got, want):
    got, want = got.double().cpu(), want.double().cpu()
    if not torch.isfinite(got).all():
        return float("inf")
    den = want.norm()
    return float((got - want).norm() / den) if den > 0 else float((got - want).norm())


@pytest.mark.parametrize(
    "op", ["treeattn::tree_attention_fwd", "treeattn::tree_attention_bwd", "treeattn::sdcc_forward_kl"]
)
def test_cuda_kernels_are_registered(op):
    # Registered in every build: a build without the kernels raises inside.
    assert torch._C._dispatch_has_kernel_for_dispatch_key(op, "CUDA")
    assert torch._C._dispatch_has_kernel_for_dispatch_key(op, "CPU")


def test_cuda_built_is_a_bool():
    assert isinstance(tt.cuda_built(), bool)


@pytest.mark.skipif(tt.cuda_built(), reason="this build has the CUDA kernels")
def test_native_entries_without_cuda_say_how_to_build():
    # A device (device=n) on a build without the kernels: refused before
    # any address is read.
    with pytest.raises(RuntimeError, match="--features cuda"):
        _native.attention_forward("bfloat16", 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 64, 0.125, device=0)
    with pytest.raises(RuntimeError, match="--features cuda"):
        _native.attention_backward(
            "bfloat16", 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 64, 0.125, device=0, stream=0
        )
    with pytest.raises(RuntimeError, match="--features cuda"):
        _native.sdcc_forward_kl("float32", 0, 1, 1, 0, 0, 0, 0, 1.0, 0, device=0)
    # The sinks, their gradient and explicit key starts are arguments of
    # the device calls too.
    with pytest.raises(RuntimeError, match="--features cuda"):
        _native.attention_forward(
            "bfloat16", 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 64, 0.125, sinks=0, kv_start=0, device=0
        )
    with pytest.raises(RuntimeError, match="--features cuda"):
        _native.attention_backward(
            "bfloat16", 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 64, 0.125, sinks=0, dsinks=0, kv_start=0,
            device=0,
        )


def test_native_entries_refuse_what_their_place_does_not_take():
    # A stream without a device, CPU threads with one: refused, not dropped
    # (before any address is read, in every build).
    with pytest.raises(ValueError, match="without a device"):
        _native.attention_forward("float32", 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 64, 0.125, stream=5)
    with pytest.raises(ValueError, match="without a device"):
        _native.sdcc_forward_kl("float32", 0, 1, 1, 0, 0, 0, 0, 1.0, 0, stream=5)
    with pytest.raises(ValueError, match="threads are the CPU backend's"):
        _native.attention_backward(
            "bfloat16", 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 64, 0.125, threads=2, device=0
        )


@pytest.mark.skipif(
    not tt.cuda_built() or torch.cuda.is_available(), reason="a cuda build on a machine without a GPU"
)
def test_cuda_build_without_a_gpu_says_so():
    # The pack is read on the host first; the device addresses (dummies)
    # are never touched: the backend fails before any launch.
    ke, pos = torch.tensor([1], dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="no CUDA driver|CUDA device"):
        _native.attention_forward(
            "bfloat16", 256, 256, 256, ke.data_ptr(), pos.data_ptr(), 256, 256, 1, 1, 1, 64, 0.125,
            device=0, stream=0,
        )
    # With sinks and their gradient: the same clean failure (not a refusal).
    ks = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="no CUDA driver|CUDA device"):
        _native.attention_backward(
            "bfloat16", 256, 256, 256, ke.data_ptr(), pos.data_ptr(), 256, 256, 256, 256, 256, 256,
            1, 1, 1, 64, 0.125, sinks=256, dsinks=256, kv_start=ks.data_ptr(), device=0, stream=0,
        )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fake_lse_dtype_matches_the_cuda_kernel(dtype):
    # The CUDA kernel's LSE is float32 for bf16 / f16 inputs; the fake must
    # say so, or torch.compile would trace a wrong dtype.
    q = torch.empty(5, 2, 64, dtype=dtype, device="meta")
    ke = torch.empty(5, dtype=torch.int64, device="meta")
    o, lse = torch.ops.treeattn.tree_attention_fwd(q, q, q, ke, None, 0.125, None, None, 0)
    assert o.dtype == dtype and lse.dtype == torch.float32 and lse.shape == (2, 5)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("rope", [False, True])
def test_cuda_op_matches_the_cpu_backend(dtype, heads, d, rope, gen):
    hq, hkv = heads
    L = 300
    kv_end = random_forest(L, gen, 0.1)
    pos = depths(kv_end)
    base = 10000.0 if rope else None
    x = [torch.randn(L, h, d, generator=gen).to(dtype) for h in (hq, hkv, hkv)]
    d_o = torch.randn(L, hq, d, generator=gen).to(dtype)
    dev = [t.cuda().requires_grad_() for t in x]
    # The CPU reference on the same rounded inputs, in float32.
    cpu = [t.float().requires_grad_() for t in x]
    # A stream of its own: the op must follow torch's current stream.
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        o = tt.tree_attention(*dev, kv_end.cuda(), position_ids=pos.cuda() if rope else None, rope_base=base)
        o.backward(d_o.cuda())
    s.synchronize()
    o_ref = tt.tree_attention(*cpu, kv_end, position_ids=pos if rope else None, rope_base=base)
    o_ref.backward(d_o.float())
    o_bound, g_bound = BOUNDS[dtype]
    assert o.dtype == dtype and o.device.type == "cuda"
    assert rel_frobenius(o, o_ref) <= o_bound
    for name, a, b in zip("qkv", dev, cpu):
        err = rel_frobenius(a.grad, b.grad)
        assert err <= g_bound, f"d{name}: {err:.3e} > {g_bound}"


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("window, softcap", [(1, None), (7, None), (None, 2.0), (5, 1.5)])
def test_cuda_window_and_softcap_match_the_cpu_backend(dtype, d, window, softcap, gen):
    # The variant kernels (proven under the emulator) through torch's CUDA
    # op: backend="treeattn" must run them, not refuse or route to flex.
    hq, hkv, L = 8, 2, 300
    kv_end = random_forest(L, gen, 0.1)
    x = [torch.randn(L, h, d, generator=gen).to(dtype) for h in (hq, hkv, hkv)]
    d_o = torch.randn(L, hq, d, generator=gen).to(dtype)
    dev = [t.cuda().requires_grad_() for t in x]
    cpu = [t.float().requires_grad_() for t in x]
    o = tt.tree_attention(*dev, kv_end.cuda(), window=window, softcap=softcap, backend="treeattn")
    o.backward(d_o.cuda())
    o_ref = tt.tree_attention(*cpu, kv_end, window=window, softcap=softcap)
    o_ref.backward(d_o.float())
    o_bound, g_bound = BOUNDS[dtype]
    assert rel_frobenius(o, o_ref) <= o_bound
    for name, a, b in zip("qkv", dev, cpu):
        err = rel_frobenius(a.grad, b.grad)
        assert err <= g_bound, f"d{name}: {err:.3e} > {g_bound}"
    # Negative control: the window one wider is another answer.
    if window is not None:
        wider = tt.tree_attention(*[t.detach() for t in dev], kv_end.cuda(), window=window + 1,
                                  softcap=softcap, backend="treeattn")
        assert rel_frobenius(wider, o_ref) > 2 * o_bound


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("window, softcap", [(None, None), (5, None), (None, 2.0)])
def test_cuda_sinks_match_the_cpu_backend(dtype, d, window, softcap, gen):
    # Sinks through the extension's borrowed-pointer entries: O and dQ, dK,
    # dV, dsinks against the CPU backend on the same rounded inputs.
    hq, hkv, L = 8, 2, 300
    kv_end = random_forest(L, gen, 0.1)
    x = [torch.randn(L, h, d, generator=gen).to(dtype) for h in (hq, hkv, hkv)]
    d_o = torch.randn(L, hq, d, generator=gen).to(dtype)
    # float32 learnable sinks (a model's parameter): the op runs them in
    # q's dtype and returns their gradient in float32.
    sinks = (torch.randn(hq, generator=gen) * 2).to(dtype).float()
    dev = [t.cuda().requires_grad_() for t in x]
    dev_s = sinks.cuda().requires_grad_()
    cpu = [t.float().requires_grad_() for t in x]
    cpu_s = sinks.clone().requires_grad_()
    o = tt.tree_attention(*dev, kv_end.cuda(), window=window, softcap=softcap, sinks=dev_s, backend="treeattn")
    o.backward(d_o.cuda())
    o_ref = tt.tree_attention(*cpu, kv_end, window=window, softcap=softcap, sinks=cpu_s)
    o_ref.backward(d_o.float())
    o_bound, g_bound = BOUNDS[dtype]
    assert o.dtype == dtype and dev_s.grad is not None and dev_s.grad.dtype == torch.float32
    assert rel_frobenius(o, o_ref) <= o_bound
    for name, a, b in zip(["q", "k", "v", "sinks"], dev + [dev_s], cpu + [cpu_s]):
        err = rel_frobenius(a.grad, b.grad)
        assert err <= g_bound, f"d{name}: {err:.3e} > {g_bound}"
    # "auto" runs the same kernels (not FlexAttention): the same bits.
    with torch.no_grad():
        auto = tt.tree_attention(*dev, kv_end.cuda(), window=window, softcap=softcap, sinks=dev_s, backend="auto")
        assert torch.equal(auto, o)
        # Negative control: the answer without the sinks is another one.
        plain = tt.tree_attention(*dev, kv_end.cuda(), window=window, softcap=softcap, backend="treeattn")
    assert rel_frobenius(plain, o_ref) > 2 * o_bound


@gpu
def test_cuda_explicit_key_starts_are_the_window():
    # Explicit key starts (context parallelism's) reach the kernels: the
    # window's own starts give the window's answer, bit for bit; the starts
    # of a window one wider give another.
    gen = torch.Generator().manual_seed(7)
    L, W = 200, 4
    kv_end = random_forest(L, gen, 0.1)
    q, k, v = (torch.randn(L, h, 64, generator=gen).to(torch.bfloat16).cuda() for h in (4, 2, 2))
    mask = tt.MaskPlan(kv_end)
    op = torch.ops.treeattn.tree_attention_fwd
    win, _ = op(q, k, v, kv_end.cuda(), None, 0.125, None, None, 0, 0, W, None, None, None)
    st, _ = op(q, k, v, kv_end.cuda(), None, 0.125, None, None, 0, 0, None, None, None,
               mask.window_starts(W).cuda())
    assert torch.equal(st, win)
    wider, _ = op(q, k, v, kv_end.cuda(), None, 0.125, None, None, 0, 0, None, None, None,
                  mask.window_starts(W + 1).cuda())
    assert rel_frobenius(wider, win) > 2e-2


@gpu
def test_cuda_value_head_dim_is_refused_by_name():
    q = torch.randn(64, 2, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(64, 2, 128, device="cuda", dtype=torch.bfloat16)
    kv_end = torch.full((64,), 64, device="cuda")
    with pytest.raises(ValueError, match='backend="flex"'):
        tt.tree_attention(q, q, v, kv_end, sinks=torch.zeros(2, device="cuda"), backend="treeattn")


@gpu
def test_cuda_op_under_compile_and_opcheck(gen):
    L, d = 64, 64
    kv_end = random_forest(L, gen).cuda()
    q = torch.randn(L, 2, d, generator=gen).to(torch.bfloat16).cuda()
    f = torch.compile(lambda q: tt.tree_attention(q, q, q, kv_end), fullgraph=True)
    o = f(q)
    ref = tt.tree_attention(q, q, q, kv_end)
    assert torch.equal(o, ref)
    torch.library.opcheck(
        torch.ops.treeattn.tree_attention_fwd.default,
        (q, q, q, kv_end, None, 0.125, None, None, 0),
        test_utils=("test_schema", "test_faketensor"),
    )


@gpu
def test_cuda_float32_attention_is_refused():
    q = torch.randn(4, 1, 64, device="cuda")
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        tt.tree_attention(q, q, q, torch.tensor([4, 4, 4, 4], device="cuda"))


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_sdcc_matches_the_cpu_backend(dtype, gen):
    logits = (3 * torch.randn(10, 5000, generator=gen)).to(dtype)
    s_rows, t_rows = torch.tensor([0, 1, 2, 2]), torch.tensor([5, 6, 7, 8])
    w = torch.tensor([1.0, 0.5, 2.0, 0.0])
    dev = logits.cuda().requires_grad_()
    loss, kl = tt.sdcc_forward_kl(dev, s_rows.cuda(), t_rows.cuda(), w.cuda())
    loss.backward()
    ref_in = logits.float().requires_grad_()
    ref_loss, ref_kl = tt.sdcc_forward_kl(ref_in, s_rows, t_rows, w)
    ref_loss.backward()
    # The loss comes back in the logits' dtype: rounded to 2^-8 (bf16) /
    # 2^-11 (f16) relative there.
    loss_rel = 1e-4 if dtype == torch.float32 else 8e-3
    assert abs(float(loss) - float(ref_loss)) <= loss_rel * max(abs(float(ref_loss)), 1e-2)
    assert rel_frobenius(dev.grad.float(), ref_in.grad) <= (1e-3 if dtype == torch.float32 else 1e-2)
    assert kl.device.type == "cuda" and kl.shape == (4,)
