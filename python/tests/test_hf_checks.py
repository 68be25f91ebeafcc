"""Hugging Face: the natural mistakes that used to give wrong log-probs
silently are errors now (a model not switched to "treeattn", missing or
foreign position ids, a padding attention_mask), and the correct calls still
match each call run alone (the negative controls)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

import treeattn  # noqa: E402
import treeattn.hf  # noqa: E402
from conftest import GOLDEN, random_forest  # noqa: E402
from test_hf import per_call_truth, random_rollouts, tiny_llama  # noqa: E402


@pytest.fixture
def setup():
    treeattn.hf.register()
    gen = torch.Generator().manual_seed(5)
    rollouts = random_rollouts(gen, n=3) + GOLDEN
    (pack,) = treeattn.pack(rollouts, share_prefixes=True)
    model = tiny_llama()
    return model, rollouts, pack


def packed_vs_truth(model, rollouts, pack):
    truth = per_call_truth(model, rollouts)
    model.set_attn_implementation("treeattn")
    with torch.no_grad():
        lp = treeattn.hf.target_logprobs(model, pack)
    want = torch.stack([truth[(c, o)] for c, o in zip(pack.loss_call.tolist(), pack.loss_offset.tolist())])
    return float((lp - want.detach()).abs().max())


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_a_model_not_switched_to_treeattn_is_refused(setup, impl):
    model, rollouts, pack = setup
    model.set_attn_implementation(impl)
    for call in (lambda: treeattn.hf.target_logprobs(model, pack),
                 lambda: treeattn.hf.pack_loss(model, pack)):
        with pytest.raises(ValueError, match=f"_attn_implementation = '{impl}'.*set_attn_implementation"):
            call()
    # Negative control: switched, the packed log-probs are each call's own.
    assert packed_vs_truth(model, rollouts, pack) <= 1e-9


def test_a_sub_config_not_switched_is_refused(setup):
    model, _, pack = setup
    model.set_attn_implementation("treeattn")

    class Outer:
        sub_configs = {"text_config": None}
        _attn_implementation = "treeattn"
        text_config = type("C", (), {"_attn_implementation": "sdpa", "sub_configs": {}})()

    class Wrapped:
        config = Outer()

    with pytest.raises(ValueError, match=r"config\.text_config\._attn_implementation = 'sdpa'"):
        treeattn.hf.require_treeattn(Wrapped())
    treeattn.hf.require_treeattn(model)


def test_missing_or_foreign_position_ids_are_refused(setup):
    model, rollouts, pack = setup
    model.set_attn_implementation("treeattn")
    with pytest.raises(ValueError, match=r"position_ids\[\d+\] = \d+, but row \d+ is at depth.*transformers fills"):
        model(input_ids=pack.tokens[None], kv_end=pack.kv_end)
    # The position ids of another pack of the same length.
    gen = torch.Generator().manual_seed(1)
    other = random_forest(len(pack), gen)
    other_pos = treeattn.hf.tree_depths(other)
    assert not torch.equal(other_pos, pack.position_ids)
    with pytest.raises(ValueError, match="not this pack's"):
        model(input_ids=pack.tokens[None], position_ids=other_pos[None], kv_end=pack.kv_end)
    # ... and kv_end of another pack with this pack's position ids.
    with pytest.raises(ValueError, match="depth"):
        model(input_ids=pack.tokens[None], position_ids=pack.position_ids[None], kv_end=other)
    # A kv_end of the wrong length.
    with pytest.raises(ValueError, match="kv_end of shape"):
        model(input_ids=pack.tokens[None], position_ids=pack.position_ids[None], kv_end=pack.kv_end[:-1])
    # Negative control: the pack's own.
    assert packed_vs_truth(model, rollouts, pack) <= 1e-9


def test_the_check_runs_once_per_forward_and_again_on_new_tensors(setup, monkeypatch):
    model, _, pack = setup
    model.set_attn_implementation("treeattn")
    calls = []
    real = treeattn.hf.tree_depths
    monkeypatch.setattr(treeattn.hf, "tree_depths", lambda kv: calls.append(1) or real(kv))
    pos = pack.position_ids[None].clone()
    with torch.no_grad():
        model(input_ids=pack.tokens[None], position_ids=pos, kv_end=pack.kv_end)
        assert len(calls) == 1  # two layers, one check
        model(input_ids=pack.tokens[None], position_ids=pos, kv_end=pack.kv_end)
        assert len(calls) == 1  # the same tensors, unmodified
        pos.add_(0)  # in place: a new version
        model(input_ids=pack.tokens[None], position_ids=pos, kv_end=pack.kv_end)
        assert len(calls) == 2
        bad = pos.clone()
        bad[0, 1:] = bad[0, :-1].clone()
        with pytest.raises(ValueError, match="depth"):
            model(input_ids=pack.tokens[None], position_ids=bad, kv_end=pack.kv_end)


def test_check_positions_false_allows_offset_positions(setup):
    model, _, pack = setup
    try:
        treeattn.hf.register(check_positions=False)
        model.set_attn_implementation("treeattn")
        with torch.no_grad():
            out = model(input_ids=pack.tokens[None], position_ids=pack.position_ids[None] + 7,
                        kv_end=pack.kv_end)
        assert torch.isfinite(out.logits).all()
    finally:
        treeattn.hf.register()


def test_an_attention_mask_with_padding_is_refused(setup):
    model, rollouts, pack = setup
    model.set_attn_implementation("treeattn")
    mask = torch.ones(1, len(pack), dtype=torch.int64)
    with torch.no_grad():
        ok = model(input_ids=pack.tokens[None], position_ids=pack.position_ids[None],
                   kv_end=pack.kv_end, attention_mask=mask).logits
        plain = model(input_ids=pack.tokens[None], position_ids=pack.position_ids[None],
                      kv_end=pack.kv_end).logits
    assert torch.equal(ok, plain)  # all ones: accepted, changes nothing
    mask[0, 3] = 0
    with pytest.raises(ValueError, match="attention_mask has a zero.*kv_end"):
        model(input_ids=pack.tokens[None], position_ids=pack.position_ids[None],
              kv_end=pack.kv_end, attention_mask=mask)


def test_tree_depths_are_the_ancestor_counts():
    gen = torch.Generator().manual_seed(3)
    for L in (1, 2, 17, 90):
        kv = random_forest(L, gen, padding=0.1)
        want = [sum(1 for k in range(t) if t < int(kv[k])) for t in range(L)]
        assert treeattn.hf.tree_depths(kv).tolist() == want
    (p,) = treeattn.pack(GOLDEN)
    assert torch.equal(treeattn.hf.tree_depths(p.kv_end), p.position_ids)
