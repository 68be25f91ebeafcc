"""treeattn.trl: TRL 1.16's AsyncGRPO tree packing on treeattn's op (issue 38).

TRL's own TreeRow packs the samples, TRL's own DataCollatorForRollout makes
the batch, TRL's add_fused_lm_head patches the model and TRL's own
AsyncGRPOTrainer.compute_loss runs the step (on a stand-in for the trainer
object: the attributes compute_loss reads).

Through the model call TRL makes (its tree arrays, depth positions), every
trained token's log-prob equals its sample run alone (sdpa, float64 tiny
Llama; <= 1e-9 absolute) and so does every parameter gradient of a weighted
sum of them (<= 1e-6 relative: Llama's RMSNorm takes its variance in
float32 even in float64). TRL's fused head computes log-probs in float32
whatever the model's dtype; through it, compute_loss's loss and gradients
equal TRL's formula on each sample alone through the same head (loss <=
1e-9, gradients <= 1e-6 relative)."""

import os
import types
from collections import defaultdict

import pytest
import torch

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")

import treeattn.hf  # noqa: E402
import treeattn.trl  # noqa: E402
import treeattn.torch as tt  # noqa: E402
from conftest import rel_err  # noqa: E402

from trl.experimental.async_grpo import packing  # noqa: E402
from trl.experimental.async_grpo.async_grpo_trainer import AsyncGRPOTrainer, DataCollatorForRollout  # noqa: E402
from trl.trainer.utils import add_fused_lm_head  # noqa: E402

VOCAB = 64


def test_the_trl_version_is_the_pinned_one():
    assert trl.__version__ == treeattn.trl.TRL_VERSION


def samples(seed=3):
    """Two GRPO groups sharing a system prompt; each of 3 answers per group
    is also continued by a second turn (a tool result, then an answer), as
    AsyncGRPO's multi-turn samples are: the first turn's answer is context
    there (completion_mask 0)."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda n: torch.randint(3, VOCAB, (n,), generator=gen)  # noqa: E731
    system = r(5)
    out = []
    for g, n in enumerate((6, 4)):
        prompt = torch.cat([system, r(n)])
        for i in range(3):
            answer = r(3 + i)
            ids = torch.cat([prompt, answer])
            mask = torch.cat([torch.zeros(len(prompt)), torch.ones(len(answer))]).long()
            out.append({"input_ids": ids, "completion_mask": mask, "advantage": float(i - 1) + 0.5 * g,
                        "group_id": g, "metrics": {}, "old_log_probs": torch.zeros(len(ids))})
            more, answer2 = r(3), r(2 + i)
            ids2 = torch.cat([ids, more, answer2])
            mask2 = torch.cat([torch.zeros(len(ids) + 3), torch.ones(len(answer2))]).long()
            out.append({"input_ids": ids2, "completion_mask": mask2, "advantage": float(1 - i),
                        "group_id": g, "metrics": {}, "old_log_probs": torch.zeros(len(ids2))})
    return out


def tiny_llama():
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, attention_dropout=0.0,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).to(torch.float64)


def alone_logprobs(model, ss, fused=False):
    """Per sample, the log-prob of each trained token (completion_mask 1 at
    p: predicted from p − 1), the sample run alone with sdpa, in TRL's loss
    order (samples in row order, positions ascending); ``fused``: through
    TRL's fused head (float32) as compute_loss scores them."""
    model.set_attn_implementation("sdpa")
    out = []
    try:
        for s in ss:
            ids, mask = s["input_ids"], s["completion_mask"].bool()
            if fused:
                labels = torch.where(mask[1:], ids[1:], -100)
                lp = model(input_ids=ids[None, :-1], shift_labels=labels[None], fused_lm_head=True).log_probs[0]
                out.append(lp[mask[1:]])
            else:
                lp = torch.log_softmax(model(input_ids=ids[None], use_cache=False).logits[0], -1)
                out.append(lp[:-1].gather(1, ids[1:, None])[:, 0][mask[1:]])
    finally:
        model.set_attn_implementation(packing.TREE_ATTENTION)
    return torch.cat(out)


def trainer_stub():
    """The attributes of an AsyncGRPOTrainer that compute_loss reads (one process)."""
    acc = types.SimpleNamespace(num_processes=1, reduce=lambda t, reduction="sum": t,
                                gather=lambda t: t.reshape(-1))
    return types.SimpleNamespace(
        epsilon_low=0.2, epsilon_high=0.28, accelerator=acc, current_gradient_accumulation_steps=1,
        aux_loss_enabled=False, _metrics={"train": defaultdict(list)}, _step_forward_tokens=0.0,
        _step_trained_tokens=0.0, _step_seq_len_weighted=0.0, _step_samples=0.0, _step_forward_s=0.0,
    )


def row_of(ss):
    row = packing.TreeRow()
    for s in ss:
        assert row.fits(s, 10_000)
        row.add(s)
    return row


@pytest.fixture(scope="module")
def setup():
    treeattn.trl.register()
    model = tiny_llama()
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))  # as AsyncGRPOTrainer.__init__ does
    model.set_attn_implementation(packing.TREE_ATTENTION)
    ss = samples()
    with torch.no_grad():
        truth = alone_logprobs(model, ss)
    # Old log-probs: the truth shifted, so ratios spread over and past the clip range.
    gen = torch.Generator().manual_seed(9)
    k = 0
    for s in ss:
        old = torch.zeros(len(s["input_ids"]), dtype=torch.float32)
        for p in range(1, len(s["input_ids"])):
            if s["completion_mask"][p]:
                old[p] = float(truth[k]) + 0.3 * float(torch.randn((), generator=gen))
                k += 1
        s["old_log_probs"] = old
    return model, ss, truth


def call_kwargs(packed):
    """The model call of AsyncGRPOTrainer.compute_loss, for one row."""
    return dict(
        input_ids=packed["input_ids"][None], position_ids=packed["position_ids"][None],
        shift_labels=packed["shift_labels"][None], fused_lm_head=True,
        tree_kv_index=packed["tree_kv_index"], tree_cu_seqlens_q=packed["tree_cu_seqlens_q"],
        tree_cu_seqlens_k=packed["tree_cu_seqlens_k"],
        tree_max_seqlen_q=int(packed["tree_max_seqlens"][0]), tree_max_seqlen_k=int(packed["tree_max_seqlens"][1]),
    )


def tree_logprobs(model, packed):
    """The trained tokens' log-probs from TRL's model call with the row's
    tree arrays, float64 logits (the model's own head)."""
    kw = call_kwargs(packed)
    del kw["shift_labels"], kw["fused_lm_head"]
    lp = torch.log_softmax(model(**kw, use_cache=False).logits[0], -1)
    idx = packed["token_index"]
    return lp[idx, packed["shift_labels"][idx]]


def test_every_trained_token_equals_its_sample_alone(setup):
    model, ss, truth = setup
    packed = row_of(ss).pack()
    L = packed["input_ids"].numel()
    assert L < sum(len(s["input_ids"]) for s in ss)  # shared prefixes are forwarded once
    with torch.no_grad():
        lp = tree_logprobs(model, packed)
        fused = model(**call_kwargs(packed)).log_probs.flatten()[packed["token_index"]]
        fused_alone = alone_logprobs(model, ss, fused=True)
    assert lp.shape == truth.shape
    assert (lp - truth).abs().max() <= 1e-9
    assert fused.dtype == torch.float32 and (fused - fused_alone).abs().max() <= 1e-6
    # Gradients of a weighted sum of the log-probs, every parameter.
    w = torch.linspace(-1.0, 2.0, truth.numel(), dtype=torch.float64)
    model.zero_grad()
    (w * alone_logprobs(model, ss)).sum().backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    (w * tree_logprobs(model, packed)).sum().backward()
    for n, p in model.named_parameters():
        assert rel_err(p.grad, ref[n]) <= 1e-6, n
    # The mask: TRL's paths exactly, and the same as the depths give.
    m = treeattn.trl.tree_mask(packed["tree_kv_index"], packed["tree_cu_seqlens_q"], packed["tree_cu_seqlens_k"],
                               packed["position_ids"])
    assert torch.equal(m.kv_end, tt.MaskPlan.from_positions(packed["position_ids"]).kv_end)
    visible = m.dense()
    cq, ck, kv = packed["tree_cu_seqlens_q"].tolist(), packed["tree_cu_seqlens_k"].tolist(), packed["tree_kv_index"]
    trl_dense = torch.zeros(L, L, dtype=torch.bool)
    for s in range(len(cq) - 1):
        path = kv[ck[s]:ck[s + 1]]
        n_anc = len(path) - (cq[s + 1] - cq[s])
        for i, q in enumerate(range(cq[s], cq[s + 1])):
            trl_dense[q, path[: n_anc + i + 1]] = True  # FA3 causal, bottom-right aligned
    assert torch.equal(visible, trl_dense)


def test_negative_control_the_row_read_as_padding_free_segments_is_wrong(setup):
    """Without the tree (HF's padding-free reading of TRL's position ids:
    a new sequence where positions do not go up by 1), later segments lose
    their ancestors: the test above would catch it."""
    model, ss, truth = setup
    packed = row_of(ss).pack()
    model.set_attn_implementation("sdpa")
    try:
        with torch.no_grad():
            logits = model(input_ids=packed["input_ids"][None], position_ids=packed["position_ids"][None],
                           use_cache=False).logits[0]
    finally:
        model.set_attn_implementation(packing.TREE_ATTENTION)
    idx = packed["token_index"]
    lp = torch.log_softmax(logits, -1)[idx, packed["shift_labels"][idx]]
    assert (lp - truth).abs().max() > 1e-2


def test_trls_compute_loss_trains_unchanged(setup):
    model, ss, truth = setup
    batch = DataCollatorForRollout(pad_token_id=0, num_processes=1)([[row_of(ss)]])
    # The reference: TRL's loss formula on the samples run alone (TRL's head).
    model.zero_grad()
    lp = alone_logprobs(model, ss, fused=True)
    old = torch.cat([s["old_log_probs"][1:][s["completion_mask"][1:].bool()] for s in ss])
    adv = torch.cat([torch.full((int(s["completion_mask"][1:].sum()),), s["advantage"]) for s in ss])
    ratio = torch.exp(lp - old)
    per = -torch.min(ratio * adv, torch.clamp(ratio, 1 - 0.2, 1 + 0.28) * adv)
    ref_loss = per.sum() / lp.numel()
    ref_loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    clipped = ((ratio < 0.8) | (ratio > 1.28)).sum()
    assert 0 < int(clipped) < lp.numel()  # the clip is exercised
    # TRL's compute_loss on the packed row, treeattn underneath.
    model.zero_grad()
    model.train()
    loss = AsyncGRPOTrainer.compute_loss(trainer_stub(), model, batch)
    model.eval()
    assert abs(float(loss.detach()) - float(ref_loss.detach())) <= 1e-9 * max(1.0, abs(float(ref_loss.detach())))
    loss.backward()
    for n, p in model.named_parameters():
        assert rel_err(p.grad, ref_grads[n]) <= 1e-6, n


def test_register_survives_the_trainers_own_registration(setup):
    packing.register_tree_attention()  # what AsyncGRPOTrainer.__init__ calls
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    assert ALL_ATTENTION_FUNCTIONS[packing.TREE_ATTENTION] is treeattn.trl.attention
    assert treeattn.trl.register() == "tree_fa3"


def test_bad_tree_arrays_and_positions_are_refused_naming_the_segment(setup):
    model, ss, _ = setup
    packed = row_of(ss).pack()
    kv, cq, ck = (packed[k].clone() for k in ("tree_kv_index", "tree_cu_seqlens_q", "tree_cu_seqlens_k"))
    # A segment whose path skips an ancestor row.
    s = next(i for i in range(len(cq) - 1) if int(ck[i + 1] - ck[i]) > int(cq[i + 1] - cq[i]) + 1)
    bad = kv.clone()
    bad[int(ck[s])] = bad[int(ck[s]) + 1]
    with pytest.raises(ValueError, match=rf"segment {s}"):
        treeattn.trl.tree_mask(bad, cq, ck)
    # A path that does not end with its own segment.
    bad = kv.clone()
    bad[int(ck[1]) - 1] = 0
    with pytest.raises(ValueError, match="segment 0's path does not end with the segment's own rows"):
        treeattn.trl.tree_mask(bad, cq, ck)
    with pytest.raises(ValueError, match="tile rows"):
        treeattn.trl.tree_mask(kv, cq[:-1], ck[:-1], length=int(cq[-1]))
    pos = packed["position_ids"].clone()
    pos[5] += 1
    with pytest.raises(ValueError, match=r"position_ids\[5\]"):
        treeattn.trl.tree_mask(kv, cq, ck, pos)
    # The model call with position ids that are not the row's depths.
    kw = call_kwargs(packed)
    kw["position_ids"] = torch.arange(len(pos))[None]
    with pytest.raises(ValueError, match="position_ids"):
        with torch.no_grad():
            model(**kw)
    # Without the tree arrays.
    kw = call_kwargs(packed)
    del kw["tree_kv_index"]
    with pytest.raises(ValueError, match="tree_kv_index"):
        with torch.no_grad():
            model(**kw)


def test_hybrid_models_are_refused_by_the_tree_attention_and_run_with_kv_end():
    """TRL's tree arrays reach attention layers only; a Qwen3.5 (Gated
    DeltaNet layers) is refused by name, and runs exactly when called with
    kv_end from the same row (treeattn.hf + treeattn.hybrid)."""
    treeattn.trl.register()
    treeattn.hf.register()
    cfg = transformers.Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "full_attention"], attention_dropout=0.0,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForCausalLM(cfg).eval()
    ss = samples(seed=5)[:4]
    packed = row_of(ss).pack()
    model.set_attn_implementation(packing.TREE_ATTENTION)
    kw = call_kwargs(packed)
    del kw["shift_labels"], kw["fused_lm_head"]
    with pytest.raises(ValueError, match="recurrent layers"):
        with torch.no_grad():
            model(**kw)
    m = treeattn.trl.tree_mask(packed["tree_kv_index"], packed["tree_cu_seqlens_q"], packed["tree_cu_seqlens_k"],
                               packed["position_ids"])
    model.set_attn_implementation("treeattn")
    with torch.no_grad():
        logits = model(input_ids=packed["input_ids"][None], position_ids=packed["position_ids"][None],
                       kv_end=m.kv_end, use_cache=False).logits[0]
        lp = torch.log_softmax(logits, -1)
        ours = lp[packed["token_index"], packed["shift_labels"][packed["token_index"]]]
        model.set_attn_implementation("sdpa")
        truth = []
        for s in ss:
            ids = s["input_ids"]
            a = torch.log_softmax(model(input_ids=ids[None], use_cache=False).logits[0], -1)
            truth += [a[p - 1, ids[p]] for p in range(1, len(ids)) if s["completion_mask"][p]]
    assert (ours - torch.stack(truth)).abs().max() <= 1e-4  # float32 model (the GDN path computes in float32)
