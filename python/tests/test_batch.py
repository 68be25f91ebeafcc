"""Batches of packs: treeattn.collate / Collator and the "treeattn" HF
attention on [B, L]. A batch of 3 packs of different lengths (padded) gives
each pack's log-probs and the gradients of running it alone: f64 tiny Llama,
log-probs <= 1e-10 absolute (the same sums; the attention tiles fall
elsewhere in a batch, so the rounding differs at ~1e-16 per op), parameter
gradients <= 1e-6 relative (as in test_hf: Llama's RMSNorm takes the
variance in float32 even in an f64 model)."""

import pytest
import torch

import treeattn
from conftest import GOLDEN, rel_err

VOCAB = 64


def _rollouts(gen, n, prefix):
    r = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=gen))  # noqa: E731
    out = []
    for i in range(n):
        system = [r(4, VOCAB) for _ in range(r(1, 4))]
        seq = system + [r(4, VOCAB) for _ in range(r(1, 6))]
        calls = []
        for _ in range(r(1, 4)):
            completion = [r(4, VOCAB) for _ in range(r(1, 4))]
            calls.append({"context": list(seq), "completion": completion})
            seq = seq + completion
            if r(0, 2):  # a compaction: system prompt, summary token, last 2 tokens
                seq = system + [3, r(4, VOCAB)] + seq[-2:]
            seq = seq + [r(4, VOCAB) for _ in range(r(1, 3))]
        out.append({"id": f"{prefix}{i}", "calls": calls})
    return out


def _packs():
    gen = torch.Generator().manual_seed(77)
    packs = [treeattn.pack(GOLDEN)[0]]
    packs += [treeattn.pack(_rollouts(gen, n, f"b{n}-"))[0] for n in (3, 1)]
    assert len({len(p) for p in packs}) == 3, "want three different lengths"
    return packs


def test_collate_pads_with_unseen_keys_and_keeps_each_pack():
    packs = _packs()
    b = treeattn.collate(packs, pad_token_id=5, pad_to_multiple_of=16)
    B, L = b["input_ids"].shape
    assert B == 3 and L % 16 == 0 and L >= max(len(p) for p in packs)
    for i, p in enumerate(packs):
        n = len(p)
        assert torch.equal(b["input_ids"][i, :n], p.tokens)
        assert torch.equal(b["position_ids"][i, :n], p.position_ids)
        assert torch.equal(b["kv_end"][i, :n], p.kv_end)
        # Padding: kv_end[k] == k (no query sees it), the pad token, position 0.
        assert torch.equal(b["kv_end"][i, n:], torch.arange(n, L))
        assert (b["input_ids"][i, n:] == 5).all() and (b["position_ids"][i, n:] == 0).all()
        sel = b["loss_batch"] == i
        for name in ("loss_rows", "loss_labels", "loss_weights", "loss_call", "loss_segment"):
            assert torch.equal(b[name][sel], getattr(p, name)), name
        assert torch.equal(b["sdcc_student_rows"][b["sdcc_batch"] == i], p.sdcc_student_rows)
    # Dicts of pack tensors collate the same but name no rollouts (no
    # rollout_ids, groups: what rollout_group indexes); the Collator is collate.
    d = treeattn.collate([p.tensors() for p in packs], pad_token_id=5, pad_to_multiple_of=16)
    c = treeattn.Collator(pad_token_id=5, pad_to_multiple_of=16)(packs)
    same = lambda x, y: torch.equal(x.isnan(), y.isnan()) and torch.equal(x.nan_to_num(), y.nan_to_num())  # noqa: E731
    rollout_keys = {"rollout_ids", "rollout_indices", "groups", "rollout_batch", "loss_rollout_local",
                    "rollout_reward", "rollout_group", "rollout_fingerprint", "rollout_truncated"}
    assert set(b) - set(d) == rollout_keys and set(d) <= set(b)
    assert c.keys() == b.keys()
    for name, t in b.items():
        if isinstance(t, list):
            assert c[name] == t, name
            continue
        assert same(c[name], t), name
        if name in d:
            assert same(d[name], t), name


def test_collate_through_a_dataloader():
    packs = _packs()
    loader = torch.utils.data.DataLoader(packs, batch_size=3, collate_fn=treeattn.Collator())
    (got,) = list(loader)
    want = treeattn.collate(packs)
    assert got.keys() == want.keys()
    assert all(got[n] == want[n] if isinstance(want[n], list) else torch.equal(got[n].nan_to_num(), want[n].nan_to_num())
               for n in want)


def test_collate_errors():
    (p,) = treeattn.pack(GOLDEN)
    with pytest.raises(ValueError, match="no packs"):
        treeattn.collate([])
    with pytest.raises(ValueError, match="list of packs"):
        treeattn.collate(p)
    for bad in (-1, 2**40, 1.5, True):
        with pytest.raises(ValueError, match="pad_token_id must be a token id"):
            treeattn.collate([p], pad_token_id=bad)
    with pytest.raises(ValueError, match="pad_to_multiple_of"):
        treeattn.collate([p], pad_to_multiple_of=0)
    bad = dict(p.tensors())
    bad["kv_end"] = bad["kv_end"][:-1]
    with pytest.raises(ValueError, match="pack 1 has .* kv_end of length"):
        treeattn.collate([p, bad])
    del bad["tokens"]
    with pytest.raises(ValueError, match="pack 0 has no 1-D tensor 'tokens'"):
        treeattn.collate([bad])
    # A replicated pack has no SDCC pairs: the batch has none either.
    (rep,) = treeattn.pack(GOLDEN, layout="replicated")
    assert "sdcc_batch" not in treeattn.collate([p, rep])


transformers = pytest.importorskip("transformers")
import treeattn.hf  # noqa: E402


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rope_theta=10000.0, attention_dropout=0.0,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.float64)
    model.eval()
    treeattn.hf.register()
    model.set_attn_implementation("treeattn")
    return model


def test_a_batch_gives_each_packs_logprobs_and_gradients():
    model = _tiny_llama()
    packs = _packs()
    batch = treeattn.collate(packs, pad_to_multiple_of=8)
    lp = treeattn.hf.target_logprobs(model, batch)
    alone = [treeattn.hf.target_logprobs(model, p) for p in packs]
    assert (lp - torch.cat(alone)).abs().max() <= 1e-10
    # Full logits of the batch ([B, L, V]) score the same entries.
    out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], kv_end=batch["kv_end"])
    assert (treeattn.hf.target_logprobs(model, batch, out.logits) - lp).abs().max() <= 1e-12

    # One batch loss with the batch's normalizer == the sum of each pack's
    # loss with the same normalizer (SDCC on: a mean over every pair).
    norm = float(batch["loss_weights"].sum())
    model.zero_grad()
    parts = treeattn.hf.pack_loss(model, batch, sdcc_lambda=0.1)
    parts["loss"].backward()
    ours = {n: q.grad.clone() for n, q in model.named_parameters()}
    model.zero_grad()
    pairs = [p.sdcc_student_rows.numel() for p in packs]
    nll = sdcc = 0.0
    for p, n in zip(packs, pairs):
        one = treeattn.hf.pack_loss(model, p, sdcc_lambda=0.1, normalizer=norm)
        # pack_loss's SDCC term is a mean over the pack's own pairs.
        (one["nll"] + 0.1 * one["sdcc"] * n / sum(pairs)).backward()
        nll += float(one["nll"].detach())
        sdcc += float(one["sdcc"].detach()) * n / sum(pairs)
    assert abs(float(parts["nll"].detach()) - nll) <= 1e-12
    assert abs(float(parts["sdcc"].detach()) - sdcc) <= 1e-12
    for n, q in model.named_parameters():
        assert rel_err(ours[n], q.grad) <= 1e-6, n


def test_negative_controls_causal_attention_and_swapped_masks_differ():
    model = _tiny_llama()
    packs = _packs()
    batch = treeattn.collate(packs, pad_to_multiple_of=8)
    want = treeattn.hf.target_logprobs(model, batch)
    # Another pack's mask on each row (rows rotated), with the position check
    # off: the op runs, and the log-probs are wrong.
    rotated = dict(batch)
    rotated["kv_end"] = batch["kv_end"].roll(1, 0)
    rotated["position_ids"] = batch["position_ids"].roll(1, 0)
    out = model(input_ids=batch["input_ids"], position_ids=rotated["position_ids"], kv_end=rotated["kv_end"])
    assert (treeattn.hf.target_logprobs(model, batch, out.logits) - want).abs().max() > 1e-3
    # The batch run with causal attention (sdpa) differs (which is why the
    # scoring functions refuse logits of a model not on "treeattn").
    model.set_attn_implementation("sdpa")
    out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
    model.set_attn_implementation("treeattn")
    assert (treeattn.hf.target_logprobs(model, batch, out.logits) - want).abs().max() > 1e-3


def test_batch_errors():
    model = _tiny_llama()
    packs = _packs()
    batch = treeattn.collate(packs)
    with pytest.raises(ValueError, match="treeattn.collate"):
        treeattn.hf.target_logprobs(model, {k: v for k, v in batch.items() if k != "loss_batch"})
    with pytest.raises(ValueError, match="kv_end of shape"):
        model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], kv_end=batch["kv_end"][:2])
    bad = dict(batch)
    bad["loss_batch"] = batch["loss_batch"] + 5
    with pytest.raises(ValueError, match="loss_batch"):
        treeattn.hf.target_logprobs(model, bad)
    # Context parallelism splits one pack: a batch is refused, not cut to its first row.
    q = torch.zeros(2, 4, 8, 16)
    with pytest.raises(ValueError, match="batch 1"):
        treeattn.hf.attention(None, q, q, q, None, treeattn_shard=object())
    # Another batch's position ids: the depth check names the row.
    pos = batch["position_ids"].flip(0)
    with pytest.raises(ValueError, match="position_ids"):
        model(input_ids=batch["input_ids"], position_ids=pos, kv_end=batch["kv_end"])


def test_trainer_runs_a_step_on_collated_packs(tmp_path):
    pytest.importorskip("accelerate")
    from transformers import Trainer, TrainingArguments

    model = _tiny_llama().to(torch.float32)
    model.train()
    packs = _packs()

    class PackTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return treeattn.hf.pack_loss(model, inputs)["loss"]

    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=3, max_steps=2, learning_rate=1e-2,
        report_to=[], use_cpu=True, save_strategy="no", remove_unused_columns=False,
        dataloader_num_workers=0, logging_steps=1,
    )
    before = {n: q.detach().clone() for n, q in model.named_parameters()}
    trainer = PackTrainer(model=model, args=args, train_dataset=packs, data_collator=treeattn.Collator())
    result = trainer.train()
    assert result.global_step == 2
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in trainer.state.log_history if "loss" in h)
    moved = [n for n, q in model.named_parameters() if not torch.equal(q.detach(), before[n])]
    assert moved, "the Trainer step changed no parameter"
