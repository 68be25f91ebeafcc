"""A MaskPlan cannot go stale: it keeps copies of its own, refuses to be used
after those were changed in place, and validates what it is given when it
is built (issue 41)."""

import pytest
import torch

import treeattn.torch as tt
from conftest import random_forest, rel_err


def test_the_callers_tensor_is_copied(gen):
    kv_end = random_forest(40, gen)
    q, k, v = (torch.randn(40, 2, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    m = tt.MaskPlan(kv_end)
    before = tt.tree_attention(q, k, v, m)
    kv_end.fill_(40)  # the caller edits its own tensor: the mask does not follow
    assert not torch.equal(m.kv_end, kv_end)
    after = tt.tree_attention(q, k, v, m)
    assert torch.equal(before, after)
    assert rel_err(after, tt.tree_attention(q, k, v, m.kv_end.clone())) == 0.0


def test_an_in_place_change_of_the_masks_own_copy_is_refused(gen):
    kv_end = random_forest(30, gen)
    q, k, v = (torch.randn(30, 2, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    m = tt.MaskPlan(kv_end, torch.zeros(30, dtype=torch.int64))
    tt.tree_attention(q, k, v, m)
    m.kv_end[3] = 30  # what used to compute with the old plan while showing the new mask
    with pytest.raises(ValueError, match="modified in place"):
        tt.tree_attention(q, k, v, m)
    with pytest.raises(ValueError, match="modified in place"):
        m.block_mask(16)
    m2 = tt.MaskPlan(kv_end, torch.zeros(30, dtype=torch.int64))
    m2.position_ids.add_(1)
    with pytest.raises(ValueError, match="modified in place"):
        tt.tree_attention(q, k, v, m2)


def test_invalid_values_are_refused_when_the_mask_is_built():
    with pytest.raises(ValueError, match=r"kv_end\[1\] = 99"):
        tt.MaskPlan(torch.tensor([4, 99, 4, 4]))
    with pytest.raises(ValueError, match=r"kv_end\[2\] = 1"):
        tt.MaskPlan(torch.tensor([4, 4, 1, 4]))
    assert "L=4" in repr(tt.MaskPlan(torch.tensor([4, 4, 4, 4])))


def test_the_former_name_is_the_same_class(gen):
    """One name in every language (issue 40): ``MaskPlan``, as the crate's
    ``MaskPlan`` and C's ``TreeattnMaskPlan``; ``TreeMask`` still works."""
    assert tt.TreeMask is tt.MaskPlan
    kv_end = random_forest(20, gen)
    m = tt.TreeMask(kv_end)
    assert isinstance(m, tt.MaskPlan)
    assert repr(m).startswith("MaskPlan(L=20")
