"""MaskPlan: the mask validated once, and its exact forms for other kernels:
FlexAttention's BlockMask (from the crate's block census, against
create_block_mask's), FlashMask's startend_row_indices, TRL's tin / tout;
backend="flex" against the crate's op."""

import pytest
import torch

import treeattn
import treeattn.torch as tt
from conftest import GOLDEN, depths, random_forest, rel_err

flex = pytest.importorskip("torch.nn.attention.flex_attention")


def fan(prompt, branches, length):
    """A GRPO fan: a prompt, then `branches` answers of `length` each."""
    L = prompt + branches * length
    kv = [L] * prompt
    for b in range(branches):
        kv += [prompt + (b + 1) * length] * length
    return torch.tensor(kv)


def masks(gen):
    yield random_forest(37, gen)
    yield random_forest(200, gen, padding=0.1)
    yield random_forest(130, gen)  # L not a multiple of the block
    yield fan(40, 5, 30)
    yield torch.arange(1, 65)  # every row its own chain
    yield torch.full((64,), 64)  # causal
    (p,) = treeattn.pack(GOLDEN)
    yield p.kv_end


def rows_as_sets(num, idx):
    return [sorted(idx[i, : int(num[i])].tolist()) for i in range(num.shape[0])]


@pytest.mark.parametrize("block", [16, 32, 128])
def test_block_census_equals_create_block_mask(block, gen):
    for kv in masks(gen):
        L = kv.shape[0]
        m = tt.MaskPlan(kv)
        kv_pad = torch.cat([kv, torch.zeros(block, dtype=kv.dtype)])

        def mod(b, h, q, k):
            return (k <= q) & (q < kv_pad[k])

        ref = flex.create_block_mask(mod, 1, 1, L, L, device="cpu", BLOCK_SIZE=block)
        num, idx, fnum, fidx = m.block_census(block)
        assert torch.equal(num, ref.kv_num_blocks[0, 0]), (L, block)
        assert torch.equal(fnum, ref.full_kv_num_blocks[0, 0]), (L, block)
        assert rows_as_sets(num, idx) == rows_as_sets(ref.kv_num_blocks[0, 0], ref.kv_indices[0, 0])
        assert rows_as_sets(fnum, fidx) == rows_as_sets(ref.full_kv_num_blocks[0, 0], ref.full_kv_indices[0, 0])
        bm = m.block_mask(block)
        assert bm.seq_lengths == (L, L) and bm.BLOCK_SIZE == (block, block)
        # The mask_mod reads kv_end: its dense form is the tree mask.
        q, k = torch.meshgrid(torch.arange(L), torch.arange(L), indexing="ij")
        assert torch.equal(bm.mask_mod(0, 0, q, k), m.dense())


def test_flashmask_and_tin_tout_are_the_tree_mask(gen):
    for kv in masks(gen):
        m = tt.MaskPlan(kv)
        L = len(m)
        q, k = torch.meshgrid(torch.arange(L), torch.arange(L), indexing="ij")
        lts = m.flashmask()[0, 0, :, 0]
        assert lts.dtype == torch.int32 and m.flashmask().shape == (1, 1, L, 1)
        # FlashMask, causal with a lower-triangle start: key k is masked for
        # rows >= lts[k] (and above the diagonal).
        assert torch.equal((k <= q) & (q < lts[k]), m.dense())
        tin, tout = m.tin_tout()
        assert torch.equal((tin[k] <= tin[q]) & (tin[q] < tout[k]), m.dense())
        # Negative control: a plain causal mask differs for a real tree.
        if not bool((kv == L).all()):
            assert not torch.equal(k <= q, m.dense())


def test_flex_with_our_block_mask_equals_our_op(gen):
    """FlexAttention compiled on CPU (forward; torch has no CPU backward)
    with the BlockMask from the census: it skips the blocks the census
    leaves out, so a wrong census gives a wrong O."""
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    for kv, heads in ((random_forest(300, gen, padding=0.05), (4, 2)), (fan(70, 4, 50), (2, 2))):
        L = kv.shape[0]
        pos = depths(kv)
        m = tt.MaskPlan(kv, pos)
        q = torch.randn(L, heads[0], 16)
        k, v = (torch.randn(L, heads[1], 16) for _ in range(2))
        ours = tt.tree_attention(q, k, v, m)
        theirs = tt.tree_attention(q, k, v, m, backend="flex", block_size=32)
        assert rel_err(theirs, ours) <= 1e-5
        rot = tt.tree_attention(q, k, v, m, rope_base=10000.0)
        rot_flex = tt.tree_attention(q, k, v, m, rope_base=10000.0, backend="flex", block_size=32)
        assert rel_err(rot_flex, rot) <= 1e-5
        # Negative control: the plain causal block mask gives another O.
        causal = tt.tree_attention(q, k, v, tt.MaskPlan(torch.full((L,), L)), backend="flex", block_size=32)
        assert rel_err(causal, ours) > 1e-3
    # "auto" on CPU is the crate's op.
    assert torch.equal(tt.tree_attention(q, k, v, m, backend="auto"), tt.tree_attention(q, k, v, m))


def test_tree_mask_validates_once_and_refuses_bad_input():
    (p,) = treeattn.pack(GOLDEN)
    m = tt.MaskPlan(p.kv_end, p.position_ids)
    assert len(m) == 16 and m.kv_end.dtype == torch.int64
    with pytest.raises(ValueError, match=r"kv_end\[1\] = 0"):
        tt.MaskPlan(torch.tensor([2, 0]))
    with pytest.raises(ValueError, match="1-D integer"):
        tt.MaskPlan(torch.tensor([[2, 2]]))
    with pytest.raises(ValueError, match="1-D integer"):
        tt.MaskPlan(torch.tensor([2.0, 2.0]))
    with pytest.raises(ValueError, match="position_ids has 3 entries"):
        tt.MaskPlan(torch.tensor([2, 2]), torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="block_size"):
        m.block_census(0)
    q = torch.randn(16, 2, 8)
    with pytest.raises(ValueError, match="backend"):
        tt.tree_attention(q, q, q, m, backend="fast")
    # The MaskPlan's position ids drive rotary when none are given.
    a = tt.tree_attention(q, q, q, m, rope_base=500.0)
    b = tt.tree_attention(q, q, q, p.kv_end, position_ids=p.position_ids, rope_base=500.0)
    assert torch.equal(a, b)


def test_magi_ranges_cover_exactly_the_tree_mask(gen):
    for kv in list(masks(gen)) + [torch.tensor([2, 1]), torch.tensor([4, 2, 2, 3, 4]), random_forest(90, gen, padding=0.3)]:
        m = tt.MaskPlan(kv)
        L = len(m)
        qr, kr, types = m.magi_ranges()
        dense = torch.zeros(L, L, dtype=torch.int64)
        for (q0, q1), (k0, k1), ty in zip(qr.tolist(), kr.tolist(), types):
            assert ty in ("full", "causal") and q0 < q1 and k0 < k1
            block = torch.ones(q1 - q0, k1 - k0, dtype=torch.int64)
            if ty == "causal":
                assert (q0, q1) == (k0, k1)
                block = torch.tril(block)
            dense[q0:q1, k0:k1] += block
        assert dense.max() <= 1, "slices overlap"
        assert torch.equal(dense.bool(), m.dense())


def test_tree_mask_plan_is_reused_and_equals_the_per_call_path(gen):
    """A MaskPlan's plan is validated once (at construction) and then used
    by every call, forward and backward, with the same results as a bare
    kv_end (bit for bit: the same crate code on the same mask). Position
    ids other than the mask's take the per-call path; a plan whose
    MaskPlan is gone is never looked up (its id is dead)."""
    (p,) = treeattn.pack(GOLDEN)
    kv = random_forest(90, gen, padding=0.1)
    pos = depths(kv)
    with tt.count_mask_work() as n:
        m = tt.MaskPlan(kv, pos)
    assert n == {"plan_builds": 1, "validations": 1}, n
    assert m._native.fingerprint != 0 and len(m._native) == 90 and m._native.device_copies == 0
    q = torch.randn(90, 4, 16, dtype=torch.float64, generator=gen, requires_grad=True)
    k = torch.randn(90, 2, 16, dtype=torch.float64, generator=gen, requires_grad=True)
    v = torch.randn(90, 2, 16, dtype=torch.float64, generator=gen, requires_grad=True)
    g = torch.randn(90, 4, 16, dtype=torch.float64, generator=gen)

    def run(mask, **kw):
        o = tt.tree_attention(q, k, v, mask, rope_base=1000.0, **kw)
        dq, dk, dv = torch.autograd.grad(o, (q, k, v), g)
        return o, dq, dk, dv

    with tt.count_mask_work() as n:
        ours = [run(m) for _ in range(3)]  # three "layers"
    assert n == {}, n
    with tt.count_mask_work() as n:
        ref = run(kv, position_ids=pos)
    assert n == {"validations": 2}, n  # forward and backward
    for a in ours:
        for x, y in zip(a, ref):
            assert torch.equal(x, y)
    with tt.count_mask_work() as n:
        run(m, position_ids=pos.clone())
    assert n == {"validations": 2}, n
    # A plan of the wrong length is an error from the crate, not a wrong read.
    with pytest.raises(treeattn.ShapeError, match="mask plan is for 16 tokens"):
        x = torch.zeros(90, 1, 8)
        treeattn._native.attention_forward(
            "float32", x.data_ptr(), x.data_ptr(), x.data_ptr(), 0, 0, x.data_ptr(),
            torch.zeros(90).data_ptr(), 90, 1, 1, 8, 1.0, plan=tt.MaskPlan(p.kv_end)._native,
        )
    pid = m._plan_id
    del m, ours, a, x, y
    import gc

    gc.collect()
    assert pid not in tt._PLANS
