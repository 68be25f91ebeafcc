"""Every bad input of the torch ops raises, naming what is wrong."""

import pytest
import torch

import treeattn.torch as tt

L, HQ, HKV, D = 6, 4, 2, 8


def good():
    return dict(
        q=torch.randn(L, HQ, D),
        k=torch.randn(L, HKV, D),
        v=torch.randn(L, HKV, D),
        kv_end=torch.tensor([6, 3, 3, 6, 6, 6]),
    )


def call(q, k, v, kv_end, **kw):
    return tt.tree_attention(q, k, v, kv_end, **kw)


CASES = [
    (dict(q=torch.randn(L, HQ)), {}, "q must be [L, Hq, d]"),
    (dict(k=torch.randn(L, HKV * D)), {}, "k must be [L, Hkv, d]"),
    (dict(v=torch.randn(L, HKV + 1, D)), {}, "v must be [L, Hkv, dv]"),
    (dict(k=torch.randn(L + 1, HKV, D), v=torch.randn(L + 1, HKV, D)), {}, "k has 7 tokens"),
    (dict(k=torch.randn(L, HKV, D * 2), v=torch.randn(L, HKV, D * 2)), {}, "head dim"),
    (dict(k=torch.randn(L, 3, D), v=torch.randn(L, 3, D)), {}, "kv heads"),
    (dict(q=torch.randn(L, HQ, D).int()), {}, "q has dtype"),
    (dict(k=torch.randn(L, HKV, D).double()), {}, "share one dtype"),
    (dict(q=torch.randn(0, HQ, D)), {}, "non-empty"),
    (dict(kv_end=torch.tensor([6, 3, 3, 6, 6])), {}, "kv_end must be [L]"),
    (dict(kv_end=torch.tensor([6.0, 3, 3, 6, 6, 6])), {}, "kv_end has dtype"),
    (dict(kv_end=torch.tensor([6, 3, 1, 6, 6, 6])), {}, "kv_end[2] = 1"),
    (dict(kv_end=torch.tensor([6, 3, 3, 6, 6, 7])), {}, "kv_end[5] = 7"),
    (dict(kv_end=torch.tensor([6, 3, 3, 6, 6, 2**32 + 6])), {}, "kv_end[5]"),
    (dict(kv_end=[6, 3, 3, 6, 6, 6]), {}, "kv_end must be a torch.Tensor"),
    ({}, dict(rope_base=10000.0), "position_ids"),
    ({}, dict(position_ids=torch.arange(L), rope_base=0.5), "rope_base"),
    ({}, dict(position_ids=torch.arange(L), rope_base=float("nan")), "rope_base"),
    ({}, dict(position_ids=torch.arange(L), rope_base=1e4, rope_dims=3), "rope_dims"),
    ({}, dict(rope_dims=4), "rope_dims"),
    ({}, dict(position_ids=torch.arange(L - 1)), "position_ids must be [L]"),
    ({}, dict(position_ids=torch.arange(L) - 1, rope_base=1e4), "position_ids[0] = -1"),
    ({}, dict(scale=0.0), "scale"),
    ({}, dict(scale=float("inf")), "scale"),
    (dict(kv_end=torch.tensor([6, 3, 3, 6, 6, 6], device="meta")), {}, "kv_end is on meta"),
    (dict(v=torch.randn(L, HKV, D, device="meta")), {}, "v is on meta"),
    # Hugging Face's layouts name the expected one and the fix.
    (dict(q=torch.randn(1, HQ, L, D)), {}, "q must be [L, Hq, d] (tokens first), got shape (1, 4, 6, 8) "
     "(from transformers' [B, H, L, d], take q[0].transpose(0, 1)"),
    (dict(k=torch.randn(1, HKV, L, D)), {}, "take k[0].transpose(0, 1)"),
    (dict(q=torch.randn(HQ, L, D), k=torch.randn(HKV, L, D), v=torch.randn(HKV, L, D)), {},
     "k has 2 tokens, q has 4: q (4, 6, 8) and k (2, 6, 8) must be [L, Hq, d] and [L, Hkv, d] (tokens first); "
     "they look like [H, L, d] (heads first, L = 6): pass q.transpose(0, 1)"),
    (dict(kv_end=torch.tensor([[6, 3, 3, 6, 6, 6]])), {}, "a [B, L] batch goes through treeattn.hf's attention"),
]


@pytest.mark.parametrize("change, kw, words", CASES)
def test_attention_bad_input(change, kw, words):
    args = good()
    args.update(change)
    with pytest.raises(ValueError) as e:
        call(**args, **kw)
    assert words in str(e.value), str(e.value)


def test_attention_good_input_passes():
    # The baseline of the cases above is valid (so each case fails for its own reason).
    call(**good())
    call(**good(), position_ids=torch.arange(L), rope_base=1e4, rope_dims=4, scale=0.5)


def test_attention_non_finite_input_is_an_error():
    args = good()
    args["q"][2, 1, 3] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        call(**args)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
@pytest.mark.skipif(tt.cuda_built(), reason="this build has the CUDA kernels (tests/test_cuda.py)")
def test_cuda_tensors_say_no_cuda_build():
    args = {n: t.cuda() for n, t in good().items()}
    with pytest.raises(RuntimeError, match="without the crate's `cuda` feature"):
        call(**args)


def sgood():
    return dict(
        logits=torch.randn(5, 11),
        student_rows=torch.tensor([0, 1]),
        teacher_rows=torch.tensor([3, 4]),
    )


SCASES = [
    (dict(logits=torch.randn(5)), {}, "logits must be [rows, vocab]"),
    (dict(logits=torch.randn(5, 0)), {}, "vocab > 0"),
    (dict(logits=torch.randn(5, 11).int()), {}, "logits has dtype"),
    (dict(student_rows=torch.tensor([[0, 1]])), {}, "student_rows must be 1-D"),
    (dict(teacher_rows=torch.tensor([3.0, 4.0])), {}, "teacher_rows has dtype"),
    (dict(teacher_rows=torch.tensor([3])), {}, "student_rows has 2 pairs, teacher_rows 1"),
    (dict(student_rows=torch.tensor([0, 5])), {}, "student_rows[1] = 5"),
    (dict(teacher_rows=torch.tensor([-1, 4])), {}, "teacher_rows[0] = -1"),
    ({}, dict(weights=torch.tensor([1.0])), "weights must be [P]"),
    ({}, dict(weights=torch.tensor([1, 1])), "weights has dtype"),
    ({}, dict(weights=torch.tensor([1.0, -0.5])), "weight"),
    ({}, dict(weights=torch.tensor([1.0, float("nan")])), "weights"),
    ({}, dict(tau=0.0), "tau"),
    ({}, dict(tau=float("nan")), "tau"),
    (dict(teacher_rows=torch.tensor([3, 4], device="meta")), {}, "teacher_rows is on meta"),
]


@pytest.mark.parametrize("change, kw, words", SCASES)
def test_sdcc_bad_input(change, kw, words):
    args = sgood()
    args.update(change)
    with pytest.raises(ValueError) as e:
        tt.sdcc_forward_kl(**args, **kw)
    assert words in str(e.value), str(e.value)


def test_sdcc_nan_logits_is_an_error():
    args = sgood()
    args["logits"][3, 2] = float("nan")
    with pytest.raises(ValueError, match="non-finite|NaN"):
        tt.sdcc_forward_kl(**args)


def test_set_num_threads_bad():
    with pytest.raises(ValueError, match="set_num_threads"):
        tt.set_num_threads(-1)
