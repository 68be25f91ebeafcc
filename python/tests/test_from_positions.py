"""MaskPlan.from_positions: the mask of a pre-order layout whose position
ids are depths (issue 38) — every treeattn pack, and Hugging Face's
padding-free packed batches (a forest of chains)."""

import pytest
import torch

import treeattn
import treeattn.torch as tt
from conftest import GOLDEN, SAMPLE, random_forest


def rule(pos):
    """kv_end[k] = the first j > k with pos[j] <= pos[k], else L (as written)."""
    L = len(pos)
    return [next((j for j in range(k + 1, L) if pos[j] <= pos[k]), L) for k in range(L)]


def test_the_golden_pack_and_every_sample_pack_come_back_from_their_positions():
    for rollouts in (GOLDEN, str(SAMPLE)):
        for layout in ("trie", "replicated"):
            for share in (True, False):
                for p in treeattn.pack(rollouts, layout=layout, share_prefixes=share, budget=1000):
                    m = tt.MaskPlan.from_positions(p.position_ids)
                    assert torch.equal(m.kv_end, p.kv_end), (layout, share)
                    assert torch.equal(m.position_ids, p.position_ids)


def test_random_forests_and_the_rule_as_written(gen):
    for L in (1, 2, 7, 64, 200):
        for _ in range(5):
            kv = random_forest(L, gen)
            depth = tt.MaskPlan(kv).depths()
            m = tt.MaskPlan.from_positions(depth)
            assert torch.equal(m.kv_end, kv)
            assert m.kv_end.tolist() == rule(depth.tolist())
            assert torch.equal(m.dense(), tt.MaskPlan(kv).dense())


def test_batch_dim_of_one_and_device():
    m = tt.MaskPlan.from_positions(torch.tensor([[0, 1, 1, 0]], dtype=torch.int32))
    assert m.kv_end.tolist() == [3, 2, 3, 4] and m.position_ids.tolist() == [0, 1, 1, 0]
    assert len(tt.MaskPlan.from_positions(torch.zeros(0, dtype=torch.int64))) == 0


def test_what_is_no_pre_order_is_refused_naming_the_row():
    with pytest.raises(ValueError, match=r"position_ids\[0\] = 3: the first row must be a root"):
        tt.MaskPlan.from_positions(torch.tensor([3, 4, 5]))  # an offset chunk, not a tree
    with pytest.raises(ValueError, match=r"position_ids\[3\] = 3 after position_ids\[2\] = 1"):
        tt.MaskPlan.from_positions(torch.tensor([0, 1, 1, 3]))
    with pytest.raises(ValueError, match=r"position_ids\[1\] = -1 is outside"):
        tt.MaskPlan.from_positions(torch.tensor([0, -1]))
    with pytest.raises(ValueError, match=r"\[L\] or \[1, L\]"):
        tt.MaskPlan.from_positions(torch.zeros(2, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="integer"):
        tt.MaskPlan.from_positions(torch.zeros(3))
    with pytest.raises(ValueError, match="integer"):
        tt.MaskPlan.from_positions([0, 1, 2])
    # PackError is a ValueError subclass of treeattn's own.
    with pytest.raises(treeattn.PackError):
        tt.MaskPlan.from_positions(torch.tensor([0, 2]))


def test_hf_padding_free_batches_are_forests_of_chains():
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

    gen = torch.Generator().manual_seed(5)
    lengths = [5, 1, 9, 3, 7]
    features = [{"input_ids": torch.randint(3, 60, (n,), generator=gen).tolist()} for n in lengths]
    batch = transformers.DataCollatorWithFlattening(return_tensors="pt")(features)
    pos = batch["position_ids"]
    assert pos.shape == (1, sum(lengths))
    m = tt.MaskPlan.from_positions(pos)
    ends = torch.tensor(lengths).cumsum(0)
    expect = torch.repeat_interleave(ends, torch.tensor(lengths))
    assert torch.equal(m.kv_end, expect)  # kv_end = end of own sequence
    (cu_q, _), _ = prepare_fa_kwargs_from_position_ids(pos)
    assert cu_q.tolist() == [0] + ends.tolist()  # the same chains flash-attention's varlen reads
    # Block-diagonal causal: the dense mask of transformers' packed-sequence rule.
    seq = transformers.masking_utils.find_packed_sequence_indices(pos)[0]
    i = torch.arange(pos.shape[1])
    dense = (seq[:, None] == seq[None, :]) & (i[None, :] <= i[:, None])
    assert torch.equal(m.dense(), dense)

    # A tiny Llama: sdpa on the padding-free batch (transformers splits it
    # at the restarts) equals treeattn with the mask from the positions.
    import treeattn.hf

    treeattn.hf.register()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, attention_dropout=0.0)
    model = transformers.LlamaForCausalLM(cfg).double().eval()
    ids = batch["input_ids"]
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        ref = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        alone = torch.cat([model(input_ids=torch.tensor([f["input_ids"]])).logits[0] for f in features])
        model.set_attn_implementation("treeattn")
        ours = model(input_ids=ids, position_ids=pos, kv_end=m.kv_end).logits
    assert (ref[0] - alone).abs().max() < 1e-12
    assert (ours - ref).abs().max() < 1e-12
    # Negative control: one causal chain over the batch (what attention
    # without the restarts computes) is far from it.
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        chain = model(input_ids=ids, use_cache=False).logits
    assert (chain - ref).abs().max() > 1e-3
