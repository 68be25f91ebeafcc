"""Hugging Face: one packed forward of a tiny random LlamaForCausalLM (f64)
with attn_implementation="treeattn" equals every call run alone with "sdpa"
(per-target log-probs <= 1e-9 absolute; parameter gradients of the summed
log-probs <= 1e-6 relative: Llama's RMSNorm takes the variance in float32
even in an f64 model, so sums in another order agree to ~1e-8)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

import treeattn  # noqa: E402
import treeattn.hf  # noqa: E402
from conftest import GOLDEN, rel_err  # noqa: E402

VOCAB = 64


def random_rollouts(gen, n=3):
    """Rollouts with edits: each call's context either extends the previous
    call's sequence or rewrites it (a summary token and a kept tail)."""
    out = []
    r = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=gen))  # noqa: E731
    for i in range(n):
        system = [r(4, VOCAB) for _ in range(r(1, 4))]
        seq = system + [r(4, VOCAB) for _ in range(r(1, 4))]
        calls = []
        for _ in range(r(2, 5)):
            completion = [r(4, VOCAB) for _ in range(r(1, 4))]
            calls.append({"context": list(seq), "completion": completion})
            seq = seq + completion
            if r(0, 2):  # an edit: system prompt, a summary token, the last 2 tokens kept
                seq = system + [3, r(4, VOCAB)] + seq[-2:]
            seq = seq + [r(4, VOCAB) for _ in range(r(1, 3))]
        out.append({"id": f"rand{i}", "calls": calls})
    return out


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rope_theta=10000.0, attention_dropout=0.0,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.float64)
    model.eval()
    return model


def per_call_truth(model, rollouts):
    """Log-prob of every (global call, offset) target, each call run alone (sdpa)."""
    model.set_attn_implementation("sdpa")
    truth = {}
    g = 0
    for r in rollouts:
        for c in r["calls"]:
            seq = torch.tensor(c["context"] + c["completion"])[None]
            logits = model(input_ids=seq).logits[0]
            lp = torch.log_softmax(logits, -1)
            n = len(c["context"])
            for j, tok in enumerate(c["completion"]):
                truth[(g, j)] = lp[n - 1 + j, tok]
            g += 1
    return truth


@pytest.fixture(scope="module")
def setup():
    treeattn.hf.register()
    gen = torch.Generator().manual_seed(1234)
    rollouts = GOLDEN + random_rollouts(gen)
    (pack,) = treeattn.pack(rollouts)
    # Several rollouts in one pack: depth positions restart at 0 and jump
    # back at every branch, which transformers' packed-sequence detection
    # would split on.
    assert (pack.position_ids == 0).sum() >= 2
    return rollouts, pack, tiny_llama()


def test_packed_forward_equals_each_call_alone(setup):
    rollouts, pack, model = setup
    truth = per_call_truth(model, rollouts)
    model.set_attn_implementation("treeattn")
    lp = treeattn.hf.target_logprobs(model, pack)
    ref = torch.stack([truth[(c, o)] for c, o in zip(pack.loss_call.tolist(), pack.loss_offset.tolist())])
    assert len(truth) == pack.loss_rows.numel()
    assert (lp - ref).abs().max() <= 1e-9


def test_gradients_equal_sum_over_calls(setup):
    rollouts, pack, model = setup
    model.set_attn_implementation("treeattn")
    model.zero_grad()
    treeattn.hf.target_logprobs(model, pack).sum().backward()
    ours = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    truth = per_call_truth(model, rollouts)
    torch.stack(list(truth.values())).sum().backward()
    for n, p in model.named_parameters():
        assert rel_err(ours[n], p.grad) <= 1e-6, n


def test_negative_control_default_attention_with_positions_differs(setup):
    rollouts, pack, model = setup
    truth = per_call_truth(model, rollouts)
    ref = torch.stack([truth[(c, o)] for c, o in zip(pack.loss_call.tolist(), pack.loss_offset.tolist())])
    for impl in ("sdpa", "eager"):
        model.set_attn_implementation(impl)
        logits = model(input_ids=pack.tokens[None], position_ids=pack.position_ids[None]).logits[0]
        lp = torch.log_softmax(logits[pack.loss_rows], -1).gather(-1, pack.loss_labels[:, None])[:, 0]
        assert (lp - ref).abs().max() > 1e-3, impl
        # ... which is why the scoring functions refuse such logits.
        with pytest.raises(ValueError, match="does not use treeattn"):
            treeattn.hf.target_logprobs(model, pack, logits)
    model.set_attn_implementation("treeattn")


def test_pack_loss_with_sdcc(setup):
    rollouts, pack, model = setup
    model.set_attn_implementation("treeattn")
    assert pack.sdcc_student_rows.numel() > 0
    parts = treeattn.hf.pack_loss(model, pack, sdcc_lambda=0.1)
    lp = treeattn.hf.target_logprobs(model, pack)
    w = pack.loss_weights.double()
    assert abs(float((parts["nll"] + (w * lp).sum() / w.sum()).detach())) <= 1e-12
    assert float(parts["sdcc"].detach()) > 0
    assert abs(float((parts["loss"] - parts["nll"] - 0.1 * parts["sdcc"]).detach())) <= 1e-12
    parts["loss"].backward()


def test_missing_kv_end_raises(setup):
    _, pack, model = setup
    model.set_attn_implementation("treeattn")
    with pytest.raises(ValueError, match="kv_end"):
        model(input_ids=pack.tokens[None], position_ids=pack.position_ids[None])


def test_one_mask_plan_per_forward(setup):
    """The hook builds the pack's mask plan once per forward and every layer
    reuses it, backward included: one plan build and one validation of
    kv_end per forward and backward of a multi-layer model, no host copy.
    The same, unmodified kv_end tensor in a later forward reuses the plan;
    an in-place change builds a new one. Negative control: bare kv_end
    calls (the path without a plan) validate once per call."""
    _, pack, model = setup
    model.set_attn_implementation("treeattn")
    layers = model.config.num_hidden_layers
    assert layers >= 2
    kv_end = pack.kv_end.clone()
    run = lambda: model(  # noqa: E731
        input_ids=pack.tokens[None], position_ids=pack.position_ids[None], kv_end=kv_end
    ).logits
    with treeattn.torch.count_mask_work() as n:
        run().sum().backward()
    assert n == {"plan_builds": 1, "validations": 1}, n
    with treeattn.torch.count_mask_work() as n:
        run()
    assert n == {}, n
    kv_end.add_(0)  # an in-place change: the version moves
    with treeattn.torch.count_mask_work() as n:
        ref = run()
    assert n == {"plan_builds": 1, "validations": 1}, n
    # A MaskPlan given by the caller is used as it is.
    with treeattn.torch.count_mask_work() as n:
        given = model(
            input_ids=pack.tokens[None], position_ids=pack.position_ids[None],
            kv_end=treeattn.torch.MaskPlan(kv_end),
        ).logits
    assert n == {"plan_builds": 1, "validations": 1}, n
    assert torch.equal(given, ref)
    L = kv_end.shape[0]
    q = torch.randn(L, 4, 8, dtype=torch.float64)
    with treeattn.torch.count_mask_work() as n:
        for _ in range(layers):
            treeattn.torch.tree_attention(q, q, q, kv_end)
    assert n == {"validations": layers}, n
