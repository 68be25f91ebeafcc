"""treeattn.rl: PPO policy and value losses. Hand-computed cases (exact up
to float64 rounding: 1e-15), gradcheck in float64, the batch normalizer
across packs, and the loss on a pack against each call run alone."""

import math

import pytest
import torch

import treeattn
import treeattn.rl as rl
from conftest import GOLDEN, rel_err


def t64(*xs):
    return torch.tensor(xs, dtype=torch.float64)


# --------------------------------------------------------------------------
# hand-computed


def test_policy_loss_by_hand():
    """old = 0; ratios 1.5, 0.5, 0.5, 4; A = 2, 2, −1, −1; w = 1, 2, 1, 1.
    ℓ = −min(ρA, clip(ρ, 0.8, 1.2)A): −2.4 (clipped), −1.0, 0.8 (clipped),
    4.0; with dual clip 3 the last is capped at 3·|A| = 3."""
    ratios = [1.5, 0.5, 0.5, 4.0]
    adv = t64(2, 2, -1, -1)
    w = t64(1, 2, 1, 1)
    old = torch.zeros(4, dtype=torch.float64)
    k3 = [(r - 1) - math.log(r) for r in ratios]
    for dual, last, dual_frac in ((None, 4.0, 0.0), (3.0, 3.0, 0.2)):
        logp = torch.tensor([math.log(r) for r in ratios], dtype=torch.float64, requires_grad=True)
        loss, st = rl.policy_loss(logp, old, adv, weights=w, dual_clip=dual)
        want = (-2.4 * 1 - 1.0 * 2 + 0.8 + last) / 5
        assert abs(float(loss.detach()) - want) <= 1e-15
        assert abs(float(st["clip_frac"]) - 0.4) <= 1e-15
        assert abs(float(st["dual_clip_frac"]) - dual_frac) <= 1e-15
        assert abs(float(st["ratio_mean"]) - (1.5 + 1.0 + 0.5 + 4) / 5) <= 1e-15
        assert abs(float(st["approx_kl"]) - (k3[0] + 2 * k3[1] + k3[2] + k3[3]) / 5) <= 1e-15
        loss.backward()
        # ∂ℓ/∂logp = −A·ρ where the unclipped term is taken, else 0.
        g4 = 0.0 if dual else 4.0 / 5
        assert rel_err(logp.grad, t64(0, -2 * 0.5 * 2 / 5, 0, g4)) <= 1e-15


def test_policy_loss_normalizer_and_pack_old_logp():
    logp = t64(-1.0, -2.0, -0.5)
    old = t64(-1.1, -1.9, -0.5)
    adv = t64(0.3, -0.7, 1.2)
    base, _ = rl.policy_loss(logp, old, adv)
    ten, _ = rl.policy_loss(logp, old, adv, normalizer=30)
    assert rel_err(ten * 10, base) <= 1e-15
    (p,) = treeattn.pack([{"id": "a", "calls": [
        {"context": [1, 2], "completion": [3, 4, 5], "logprobs": [-1.1, -1.9, -0.5]}]}])
    from_pack, _ = rl.policy_loss(logp, p, adv)
    assert rel_err(from_pack, rl.policy_loss(logp, p.loss_logprobs.double(), adv)[0]) <= 1e-15
    assert rel_err(from_pack, base) <= 1e-6  # the pack stores float32 log-probs


def test_value_loss_by_hand():
    """V = 1, 3, 0; V_old = 0, 2.4, 0; R = 2, 2, 1; ε = 0.5.
    Unclipped ½(V − R)² = 0.5, 0.5, 0.5; clipped V = 0.5, 2.9, 0 →
    ½ max: ½·2.25, 0.5, 0.5 (the first clipped)."""
    v = t64(1, 3, 0).requires_grad_()
    old, ret = t64(0, 2.4, 0), t64(2, 2, 1)
    loss, st = rl.value_loss(v, old, ret)
    assert abs(float(loss.detach()) - 0.5) <= 1e-15
    loss, st = rl.value_loss(v, old, ret, clip=0.5, weights=t64(1, 1, 2))
    assert abs(float(loss.detach()) - (1.125 + 0.5 + 2 * 0.5) / 4) <= 1e-15
    assert abs(float(st["clip_frac"]) - 0.25) <= 1e-15
    assert abs(float(st["mse"]) - 1.0) <= 1e-15
    loss.backward()
    # The first target's clipped error is constant in V (V − V_old beyond ε): 0.
    assert rel_err(v.grad, t64(0, 1 / 4, 2 * -1 / 4)) <= 1e-15


# --------------------------------------------------------------------------
# gradcheck (float64, fresh random inputs)


@pytest.mark.parametrize("dual", [None, 2.5])
def test_policy_loss_gradcheck(gen, dual):
    T = 23
    logp = (-torch.rand(T, generator=gen, dtype=torch.float64) * 3).requires_grad_()
    old = logp.detach() + 0.4 * torch.randn(T, generator=gen, dtype=torch.float64)
    adv = torch.randn(T, generator=gen, dtype=torch.float64)
    w = torch.rand(T, generator=gen, dtype=torch.float64)

    def f(x):
        return rl.policy_loss(x, old, adv, weights=w, clip_low=0.15, clip_high=0.28, dual_clip=dual)[0]

    # Kinks (ratio at a clip bound) have measure zero for random inputs.
    assert torch.autograd.gradcheck(f, (logp,), eps=1e-7, atol=1e-9)
    # Some tokens are clipped and some are not, so both branches are checked.
    st = rl.policy_loss(logp, old, adv, clip_low=0.15, clip_high=0.28)[1]
    assert 0 < float(st["clip_frac"]) < 1


def test_value_loss_gradcheck(gen):
    T = 19
    v = torch.randn(T, generator=gen, dtype=torch.float64).requires_grad_()
    old = v.detach() + 0.5 * torch.randn(T, generator=gen, dtype=torch.float64)
    ret = torch.randn(T, generator=gen, dtype=torch.float64)
    w = torch.rand(T, generator=gen, dtype=torch.float64)
    for clip in (None, 0.2):
        assert torch.autograd.gradcheck(
            lambda x: rl.value_loss(x, old, ret, clip=clip, weights=w)[0], (v,), eps=1e-7, atol=1e-9)


# --------------------------------------------------------------------------
# errors


def test_errors_name_the_argument():
    x = t64(-1.0, -2.0)
    with pytest.raises(ValueError, match="old_logp has 3 entries"):
        rl.policy_loss(x, t64(0, 0, 0), x)
    with pytest.raises(ValueError, match=r"advantages\[1\]"):
        rl.policy_loss(x, x, t64(0, float("nan")))
    with pytest.raises(ValueError, match=r"logp\[0\]"):
        rl.policy_loss(t64(float("-inf"), 0), x, x)
    with pytest.raises(ValueError, match="weights"):
        rl.policy_loss(x, x, x, weights=t64(1, -1))
    with pytest.raises(ValueError, match="normalizer"):
        rl.policy_loss(x, x, x, normalizer=0)
    with pytest.raises(ValueError, match="dual_clip"):
        rl.policy_loss(x, x, x, dual_clip=1.0)
    with pytest.raises(ValueError, match="clip_low"):
        rl.policy_loss(x, x, x, clip_low=1.0)
    with pytest.raises(ValueError, match="returns"):
        rl.value_loss(x, x, t64(1))
    with pytest.raises(ValueError, match="clip"):
        rl.value_loss(x, x, x, clip=-0.1)
    with pytest.raises(ValueError, match="logp must be 1-D"):
        rl.policy_loss(x[None], x, x)
    (p,) = treeattn.pack(GOLDEN)  # no call logged log-probs
    T = p.loss_rows.numel()
    with pytest.raises(ValueError, match=f"lacks rollout log-probs for {T} of its {T} targets"):
        rl.policy_loss(torch.zeros(T, dtype=torch.float64), p, torch.zeros(T, dtype=torch.float64))


# --------------------------------------------------------------------------
# on packs, with a model


@pytest.fixture(scope="module")
def model_and_rollouts():
    pytest.importorskip("transformers")
    import treeattn.hf
    from test_hf import random_rollouts, tiny_llama

    treeattn.hf.register()
    gen = torch.Generator()
    gen.seed()
    rollouts = GOLDEN + random_rollouts(gen, n=5)
    return tiny_llama(), rollouts, gen


def keyed(pack, table):
    """Per-target values looked up by (global call, offset): the same target
    gets the same number in any packing."""
    return table[pack.loss_call, pack.loss_offset]


def test_normalizer_two_packs_sum_to_one_pack(model_and_rollouts):
    """Two packs with normalizer = the global Σ w give the one-pack loss and
    gradient (policy loss + pack_loss NLL). Tolerances: losses 1e-9, gradients
    1e-6 relative — the packs are different sequences, and Llama's RMSNorm
    takes its variance in float32 even in float64 (INTEGRATION-NOTES)."""
    import treeattn.hf

    model, rollouts, gen = model_and_rollouts
    model.set_attn_implementation("treeattn")
    (one,) = treeattn.pack(rollouts)
    two = treeattn.pack(rollouts, budget=len(one) // 2 + 4)
    assert len(two) >= 2
    calls = sum(len(r["calls"]) for r in rollouts)
    adv = torch.randn(calls, 8, generator=gen, dtype=torch.float64)
    shift = 0.3 * torch.randn(calls, 8, generator=gen, dtype=torch.float64)
    total = float(one.loss_weights.double().sum())
    assert total == sum(float(p.loss_weights.double().sum()) for p in two)

    def run(packs, normalizer):
        model.zero_grad()
        loss = 0
        for p in packs:
            parts = treeattn.hf.pack_loss(model, p, normalizer=normalizer, chunk=5)
            lp = parts["logprobs"]
            pl, _ = rl.policy_loss(lp, lp.detach() + keyed(p, shift), keyed(p, adv),
                                   weights=p.loss_weights.double(), normalizer=normalizer)
            part = pl + parts["nll"]
            part.backward()
            loss = loss + float(part.detach())
        return loss, {n: q.grad.clone() for n, q in model.named_parameters()}

    l1, g1 = run([one], None)
    l2, g2 = run(two, total)
    assert abs(l1 - l2) <= 1e-9 * max(1.0, abs(l1))
    for n in g1:
        assert rel_err(g2[n], g1[n]) <= 1e-6, n
    # Negative control: each pack normalized by its own Σ w is another loss.
    l3, _ = run(two, None)
    assert abs(l3 - l1) > 1e-3


def test_policy_loss_on_a_pack_equals_each_call_alone(model_and_rollouts):
    """The clipped surrogate on one packed forward ("treeattn") and its
    gradient equal the sum over calls of the same loss on each call run
    alone (HF "sdpa"), with the batch normalizer: the pack changes nothing
    but speed. Tolerances as in test_hf (log-probs 1e-9; gradients 1e-6)."""
    import treeattn.hf

    model, rollouts, gen = model_and_rollouts
    (pack,) = treeattn.pack(rollouts)
    calls = [c for r in rollouts for c in r["calls"]]
    adv = torch.randn(len(calls), 8, generator=gen, dtype=torch.float64)
    old = -3.0 + 0.5 * torch.randn(len(calls), 8, generator=gen, dtype=torch.float64)
    N = float(pack.loss_weights.double().sum())

    model.set_attn_implementation("treeattn")
    model.zero_grad()
    lp = treeattn.hf.target_logprobs(model, pack, chunk=4)
    loss, st = rl.policy_loss(lp, keyed(pack, old), keyed(pack, adv), weights=pack.loss_weights.double(),
                              clip_low=0.1, clip_high=0.1, dual_clip=3.0)
    loss.backward()
    ours = {n: q.grad.clone() for n, q in model.named_parameters()}
    assert 0 < float(st["clip_frac"]) < 1

    model.set_attn_implementation("sdpa")
    model.zero_grad()
    ref = 0
    for g, c in enumerate(calls):
        seq = torch.tensor(c["context"] + c["completion"])[None]
        logits = model(input_ids=seq).logits[0]
        n, k = len(c["context"]), len(c["completion"])
        lpc = torch.log_softmax(logits[n - 1:n - 1 + k], -1).gather(1, torch.tensor(c["completion"])[:, None])[:, 0]
        part, _ = rl.policy_loss(lpc, old[g, :k], adv[g, :k], clip_low=0.1, clip_high=0.1, dual_clip=3.0,
                                 normalizer=N)
        part.backward()
        ref = ref + float(part.detach())
    model.set_attn_implementation("treeattn")
    assert (pack.loss_weights == 1).all()
    assert abs(float(loss.detach()) - ref) <= 1e-9
    for n in ours:
        assert rel_err(ours[n], model.get_parameter(n).grad) <= 1e-6, n
