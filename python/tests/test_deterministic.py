"""``deterministic``: the CUDA backward's dQ mode, asked for from Python.

On CUDA the backward sums dQ with atomic adds by default (as
FlashAttention-2/3); ``deterministic=True`` runs the deterministic dQ kernel
(bit-identical dQ from run to run). Without a GPU this checks what can be
checked: the argument is accepted and validated everywhere it is taken
(``treeattn.torch.tree_attention``, the op, the native entry, the Hugging
Face attention function, context-parallel attention), it reaches the
backward, and on CPU tensors — deterministic anyway — it changes nothing,
bit for bit. With a GPU and a `cuda` build: two deterministic backward runs
give bit-identical gradients, and both modes stay within the CPU backend's
bounds.
"""

import types

import pytest
import torch

import treeattn.hf
import treeattn.torch as tt
from treeattn import _native
from conftest import depths, random_forest

gpu = pytest.mark.skipif(
    not (torch.cuda.is_available() and tt.cuda_built()),
    reason="needs a CUDA device and an extension built with the `cuda` feature",
)


def _inputs(gen, L=40, hq=4, hkv=2, d=16, dtype=torch.float32, device="cpu"):
    kv_end = random_forest(L, gen, 0.1)
    pos = depths(kv_end)
    x = [torch.randn(L, h, d, generator=gen).to(dtype) for h in (hq, hkv, hkv)]
    d_o = torch.randn(L, hq, d, generator=gen).to(dtype)
    return [t.to(device) for t in x], kv_end.to(device), pos.to(device), d_o.to(device)


def _run(x, kv_end, d_o, **kw):
    leaves = [t.detach().clone().requires_grad_() for t in x]
    o = tt.tree_attention(*leaves, kv_end, **kw)
    o.backward(d_o)
    return o.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize("bad", [1, 0, "yes", None, 1.0, torch.tensor(True)])
def test_a_non_bool_deterministic_is_refused(bad, gen):
    x, kv_end, _, _ = _inputs(gen)
    with pytest.raises(ValueError, match="deterministic"):
        tt.tree_attention(*x, kv_end, deterministic=bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("variants", [{}, {"window": 3, "softcap": 2.0}, {"rope_base": 10000.0}])
def test_deterministic_changes_nothing_on_cpu(dtype, variants, gen):
    # The CPU backward is deterministic already: the flag is accepted and
    # the outputs and gradients are bit-identical either way.
    x, kv_end, pos, d_o = _inputs(gen, dtype=dtype)
    if "rope_base" in variants:
        variants = dict(variants, position_ids=pos)
    o0, g0 = _run(x, kv_end, d_o, **variants)
    o1, g1 = _run(x, kv_end, d_o, deterministic=True, **variants)
    o2, g2 = _run(x, kv_end, d_o, deterministic=False, **variants)
    assert torch.equal(o0, o1) and torch.equal(o0, o2)
    for a, b, c in zip(g0, g1, g2):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_deterministic_with_sinks_and_a_mask_plan_changes_nothing_on_cpu(gen):
    x, kv_end, pos, d_o = _inputs(gen)
    mask = tt.MaskPlan(kv_end, pos)
    sinks = torch.randn(4, generator=gen)
    outs = []
    for det in (False, True):
        s = sinks.clone().requires_grad_()
        o, g = _run(x, mask, d_o, sinks=s, deterministic=det)
        outs.append((o, g, s.grad))
    (o0, g0, s0), (o1, g1, s1) = outs
    assert torch.equal(o0, o1) and torch.equal(s0, s1)
    assert all(torch.equal(a, b) for a, b in zip(g0, g1))


def test_deterministic_reaches_the_backward_op(gen, monkeypatch):
    # The autograd Function carries the flag from the forward to the
    # backward op (where the CUDA kernel reads it).
    seen = []
    real = tt._attn_bwd

    def spy(*args):
        seen.append(args[17] if len(args) > 17 else False)
        return real(*args)

    monkeypatch.setattr(tt, "_attn_bwd", spy)
    x, kv_end, _, d_o = _inputs(gen)
    for det in (False, True):
        _run(x, kv_end, d_o, deterministic=det)
    assert seen == [False, True]


def test_the_ops_take_deterministic_and_pass_opcheck(gen):
    schema = str(torch.ops.treeattn.tree_attention_bwd.default._schema)
    assert "bool deterministic=False" in schema, schema
    assert "bool deterministic=False" in str(torch.ops.treeattn.tree_attention_fwd.default._schema)
    x, kv_end, _, _ = _inputs(gen, L=12)
    x = [t.requires_grad_() for t in x]
    torch.library.opcheck(
        torch.ops.treeattn.tree_attention_fwd.default,
        (*x, kv_end, None, 0.25, None, None, 0, 0, None, None, None, None, True),
        test_utils=("test_schema", "test_faketensor", "test_autograd_registration"),
    )


@pytest.mark.skipif(tt.cuda_built(), reason="this build has the CUDA kernels")
def test_the_native_backward_takes_deterministic():
    # A keyword of the backward entry in every build (a build without the
    # kernels raises for a device, after accepting it).
    for det in (False, True):
        with pytest.raises(RuntimeError, match="--features cuda"):
            _native.attention_backward(
                "bfloat16", 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 64, 0.125, deterministic=det,
                device=0, stream=0,
            )
    with pytest.raises(TypeError):
        _native.attention_backward(
            "bfloat16", 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 64, 0.125, deterministic="yes",
            device=0,
        )


def _hf_call(gen, **kwargs):
    x, kv_end, pos, _ = _inputs(gen, L=24)
    q, k, v = (t.transpose(0, 1)[None].requires_grad_() for t in x)  # [1, H, L, d]
    module = types.SimpleNamespace(is_causal=True)
    o, _ = treeattn.hf.attention(module, q, k, v, None, kv_end=kv_end, position_ids=pos[None], **kwargs)
    return o


def test_hf_attention_reads_deterministic(gen, monkeypatch):
    seen = []
    real = treeattn.hf.tree_attention

    def spy(*args, **kw):
        seen.append(kw.get("deterministic"))
        return real(*args, **kw)

    monkeypatch.setattr(treeattn.hf, "tree_attention", spy)
    # Given: as it is; absent or None: torch's deterministic-algorithms switch.
    _hf_call(gen, deterministic=True)
    _hf_call(gen, deterministic=False)
    _hf_call(gen)
    _hf_call(gen, deterministic=None)
    was = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        _hf_call(gen)
        _hf_call(gen, deterministic=False)
    finally:
        torch.use_deterministic_algorithms(was)
    assert seen == [True, False, was, was, True, False]


def test_hf_attention_refuses_a_non_bool_deterministic(gen):
    with pytest.raises(ValueError, match="deterministic"):
        _hf_call(gen, deterministic="yes")


def test_context_parallel_attention_refuses_a_non_bool_deterministic(gen):
    from treeattn import distributed

    x, _, _, _ = _inputs(gen, L=8)
    with pytest.raises(ValueError, match="deterministic"):
        distributed.tree_attention(*x, object(), deterministic=1)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("variants", [{}, {"window": 5, "softcap": 1.5}, {"rope_base": 10000.0}])
def test_cuda_deterministic_backward_is_bit_identical(dtype, d, variants, gen):
    # Many query tiles and heads: atomic dQ would vary in its last bits.
    x, kv_end, pos, d_o = _inputs(gen, L=700, hq=8, hkv=2, d=d, dtype=dtype)
    if "rope_base" in variants:
        variants = dict(variants, position_ids=pos.cuda())
    dev = [t.cuda() for t in x]
    runs = [_run(dev, kv_end.cuda(), d_o.cuda(), deterministic=True, **variants) for _ in range(3)]
    (o0, g0) = runs[0]
    for o, g in runs[1:]:
        assert torch.equal(o, o0)
        for name, a, b in zip("qkv", g, g0):
            assert torch.equal(a, b), f"d{name} differs between two deterministic runs"
    # Both modes agree with the CPU backend within the CUDA bounds.
    _, ga = _run(dev, kv_end.cuda(), d_o.cuda(), deterministic=False, **variants)
    cpu_variants = dict(variants, position_ids=pos) if "rope_base" in variants else variants
    _, gc = _run([t.float() for t in x], kv_end, d_o.float(), **cpu_variants)
    bound = {torch.bfloat16: 2e-2, torch.float16: 5e-3}[dtype]
    for name, a, b, c in zip("qkv", g0, ga, gc):
        for what, got in (("deterministic", a), ("atomic", b)):
            got, want = got.double().cpu(), c.double()
            err = float((got - want).norm() / want.norm())
            assert err <= bound, f"d{name} ({what}): {err:.3e} > {bound}"


@gpu
def test_cuda_deterministic_sinks_backward_is_bit_identical(gen):
    x, kv_end, _, d_o = _inputs(gen, L=500, hq=8, hkv=2, d=64, dtype=torch.bfloat16)
    dev = [t.cuda() for t in x]
    sinks = torch.randn(8, generator=gen).to(torch.bfloat16).cuda()
    runs = []
    for _ in range(2):
        s = sinks.clone().requires_grad_()
        o, g = _run(dev, kv_end.cuda(), d_o.cuda(), sinks=s, deterministic=True)
        runs.append((o, g, s.grad))
    (o0, g0, s0), (o1, g1, s1) = runs
    assert torch.equal(o0, o1) and torch.equal(s0, s1)
    assert all(torch.equal(a, b) for a, b in zip(g0, g1))
