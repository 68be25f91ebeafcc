"""treeattn.rl: PPO policy and value losses. Hand-computed cases (exact up
to float64 rounding: 1e-15), verl's options (log-ratio clamp, truncated
importance sampling, KL to a reference, loss aggregations) against direct
float64 references, gradcheck in float64, the batch normalizer across
packs, and the loss on a pack against each call run alone."""

import math
from types import SimpleNamespace

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
# verl's options


def test_a_huge_log_ratio_is_clamped_and_its_gradient_finite():
    """float32, logp − old = 100 with A > 0: exp overflows to inf, the
    clipped term is taken so the loss is finite, but the unclipped branch's
    gradient is 0 · inf = NaN — the negative control without the clamp.
    Clamped to ±20 (verl): the same loss, a finite gradient (0 for that
    token: clipped)."""
    old = torch.tensor([-100.5, -1.0])
    adv = torch.tensor([0.5, 1.0])
    for clamp in (None, 20.0):
        logp = torch.tensor([-0.5, -1.0], requires_grad=True)
        loss, st = rl.policy_loss(logp, old, adv, log_ratio_clamp=clamp)
        loss.backward()
        assert float(loss.detach()) == pytest.approx((-1.2 * 0.5 - 1.0) / 2, rel=1e-6)
        if clamp is None:
            assert torch.isnan(logp.grad[0])
        else:
            assert torch.isfinite(logp.grad).all()
            assert logp.grad.tolist() == [0.0, -0.5]
            assert float(st["log_ratio_clamp_frac"]) == 0.5
    # A < 0: the unclipped term e^20·|A| (finite), or c·|A| with the dual clip.
    adv = torch.tensor([-0.5, 1.0])
    for dual, first in ((None, 0.5 * math.exp(20.0)), (3.0, 1.5)):
        logp = torch.tensor([-0.5, -1.0], requires_grad=True)
        loss, _ = rl.policy_loss(logp, old, adv, dual_clip=dual)
        loss.backward()
        assert float(loss.detach()) == pytest.approx((first - 1.0) / 2, rel=1e-6)
        assert torch.isfinite(logp.grad).all()


def reference_terms(logp, old, adv, lo, hi, c, clamp):
    """The per-target PPO term, written out (float64)."""
    d = (logp - old).clamp(-clamp, clamp) if clamp else logp - old
    r = torch.exp(d)
    per = torch.maximum(-r * adv, -r.clamp(1 - lo, 1 + hi) * adv)
    if c is not None:
        per = torch.where(adv < 0, torch.minimum(per, -c * adv), per)
    return per


def reference_kl(logp, ref, est, clamp=20.0):
    if est == "k1":
        return logp - ref
    if est == "k2":
        return 0.5 * (logp - ref) ** 2
    u = (ref - logp).clamp(-clamp, clamp)
    k3 = u.exp() - u - 1
    return k3.clamp(-10, 10) if est == "low_var_kl" else k3


@pytest.mark.parametrize("est", ["k1", "k2", "k3", "low_var_kl"])
def test_tis_and_kl_against_the_formulas(gen, est):
    """Token-mean of min(exp(old − rollout), C)·ℓ + β·k against the direct
    formula, loss and gradient; TIS weighs the policy term only."""
    T = 31
    logp = (-torch.rand(T, generator=gen, dtype=torch.float64) * 3).requires_grad_()
    old = logp.detach() + 0.3 * torch.randn(T, generator=gen, dtype=torch.float64)
    roll = old + 0.8 * torch.randn(T, generator=gen, dtype=torch.float64)
    ref = logp.detach() + 1.5 * torch.randn(T, generator=gen, dtype=torch.float64)
    adv = torch.randn(T, generator=gen, dtype=torch.float64)
    w = torch.rand(T, generator=gen, dtype=torch.float64)
    cap, beta = 1.5, 0.05
    loss, st = rl.policy_loss(logp, old, adv, weights=w, rollout_logp=roll, tis_cap=cap, ref_logp=ref,
                              kl_coef=beta, kl_estimator=est, dual_clip=3.0)
    x = logp.detach().clone().requires_grad_()
    tis = torch.exp(old - roll).clamp(max=cap)
    k = reference_kl(x, ref, est)
    want = (w * (tis * reference_terms(x, old, adv, 0.2, 0.2, 3.0, 20.0) + beta * k)).sum() / w.sum()
    want.backward()
    assert abs(float(loss.detach()) - float(want.detach())) <= 1e-14
    loss.backward()
    assert rel_err(logp.grad, x.grad) <= 1e-13
    assert 0 < float(st["tis_clip_frac"]) < 1
    assert abs(float(st["tis_clip_frac"]) - float((w * (torch.exp(old - roll) > cap)).sum() / w.sum())) <= 1e-15
    assert abs(float(st["kl"]) - float((w * k.detach()).sum() / w.sum())) <= 1e-14
    assert abs(float(st["kl_loss"]) + float(st["pg_loss"]) - float(loss.detach())) <= 1e-14
    # Negative control: the TIS weight on the KL term too is another loss.
    wrong = (w * tis * (reference_terms(x, old, adv, 0.2, 0.2, 3.0, 20.0) + beta * k)).sum() / w.sum()
    assert abs(float(wrong.detach()) - float(loss.detach())) > 1e-6


def test_kl_estimators_by_hand():
    """ref − logp = u: k1 = −u, k2 = u²/2, k3 = e^u − u − 1; low_var_kl
    caps k3 at 10 (verl, which also runs it for "k3"); the log-ratio clamp
    (±20) bounds u."""
    logp = torch.tensor([0.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    ref = torch.tensor([0.5, -1.0, 15.0, 30.0], dtype=torch.float64)
    adv = torch.zeros(4, dtype=torch.float64)

    def kl(est):
        return rl.policy_loss(logp, logp, adv, ref_logp=ref, kl_coef=1.0, kl_estimator=est)[1]["kl"]

    u = ref.tolist()
    k3 = [math.exp(x) - x - 1 for x in u[:3]] + [math.exp(20) - 21]
    assert float(kl("k1")) == pytest.approx(-sum(u) / 4, abs=1e-15)
    assert float(kl("k2")) == pytest.approx(sum(x * x / 2 for x in u) / 4, rel=1e-15)
    assert float(kl("k3")) == pytest.approx(sum(k3) / 4, rel=1e-15)
    assert float(kl("low_var_kl")) == pytest.approx((k3[0] + k3[1] + 10 + 10) / 4, rel=1e-15)


def verl_agg_loss(mat, mask, mode):
    """verl's core_algos.agg_loss on a padded [B, L] batch."""
    if mode == "token-mean":
        return (mat * mask).sum() / mask.sum()
    if mode == "seq-mean-token-sum":
        return (mat * mask).sum(-1).mean()
    if mode == "seq-mean-token-mean":
        return ((mat * mask).sum(-1) / mask.sum(-1)).mean()
    return (mat * mask).sum() / mask.shape[-1]


def per_target(pack, gen):
    T = pack.loss_rows.numel()
    logp = -torch.rand(T, generator=gen, dtype=torch.float64) * 2
    old = logp + 0.3 * torch.randn(T, generator=gen, dtype=torch.float64)
    adv = torch.randn(T, generator=gen, dtype=torch.float64)
    return logp, old, adv


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                                 "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("seq", ["rollout", "call"])
def test_aggregations_are_verl_agg_loss(gen, agg, seq):
    """Each loss_agg_mode against verl's agg_loss on the padded batch of
    sequences (rollouts or calls), with a 0/1 weight mask; the loss of two
    packs with the batch normalizer adds up to the loss of one."""
    from conftest import SAMPLE

    (one,) = treeattn.pack(SAMPLE)
    T = one.loss_rows.numel()
    logp, old, adv = per_target(one, gen)
    w = (torch.rand(T, generator=gen) < 0.9).double()
    ids = (one.loss_rollout if seq == "rollout" else one.loss_call).tolist()
    order = list(dict.fromkeys(ids))
    # verl's seq-mean-token-mean is NaN for a sequence of weight 0 (here it
    # adds 0): keep one weight per sequence (a call of one target drew 0
    # in about one run of ten).
    w[torch.tensor([ids.index(i) for i in order])] = 1.0
    width = max(ids.count(i) for i in order)
    mat = torch.zeros(len(order), width, dtype=torch.float64)
    mask = torch.zeros(len(order), width, dtype=torch.float64)
    fill = {i: 0 for i in order}
    per = reference_terms(logp, old, adv, 0.2, 0.28, None, 20.0)
    for t, i in enumerate(ids):
        b = order.index(i)
        mat[b, fill[i]], mask[b, fill[i]] = per[t], w[t]
        fill[i] += 1
    want = float(verl_agg_loss(mat, mask, agg))
    norm = width if agg == "seq-mean-token-sum-norm" else None
    loss, _ = rl.policy_loss(logp, old, adv, weights=w, clip_high=0.28, agg=agg, agg_sequence=seq,
                             pack=one, normalizer=norm)
    assert float(loss) == pytest.approx(want, rel=1e-13, abs=1e-15)
    # Per pack, with the batch's normalizer: the parts add up.
    two = treeattn.pack(SAMPLE, budget=800)
    assert len(two) >= 2
    key = {k: t for t, k in enumerate(zip(one.loss_call.tolist(), one.loss_offset.tolist()))}
    batch_n = {"token-mean": float(w.sum()), "seq-mean-token-sum-norm": float(width)}.get(
        agg, sum(len(p.rollout_ids) if seq == "rollout" else p.loss_call.unique().numel() for p in two))
    total = 0.0
    for p in two:
        idx = torch.tensor([key[k] for k in zip(p.loss_call.tolist(), p.loss_offset.tolist())])
        part, _ = rl.policy_loss(logp[idx], old[idx], adv[idx], weights=w[idx], clip_high=0.28, agg=agg,
                                 agg_sequence=seq, pack=p, normalizer=batch_n)
        total += float(part)
    assert total == pytest.approx(want, rel=1e-12, abs=1e-15)


def test_rollout_and_call_sequences_differ():
    """Negative control: on a rollout of several calls of unequal lengths,
    the seq-mean over calls is not the seq-mean over rollouts."""
    (p,) = treeattn.pack(GOLDEN)
    x = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.6], dtype=torch.float64)
    zero = torch.zeros(6, dtype=torch.float64)
    # ℓ_t = −A_t at ratio 1.
    r, _ = rl.policy_loss(zero, zero, -x, agg="seq-mean-token-mean", pack=p)
    c, _ = rl.policy_loss(zero, zero, -x, agg="seq-mean-token-mean", agg_sequence="call", pack=p)
    assert float(r) == pytest.approx(2.1 / 6, rel=1e-15)
    assert float(c) == pytest.approx((0.15 + 0.3 + 0.45 + 0.6) / 4, rel=1e-15)


# --------------------------------------------------------------------------
# gradcheck (float64, fresh random inputs)


def test_policy_loss_gradcheck_with_every_option(gen):
    """TIS, k3 to a reference and seq-mean-token-mean over rollouts at once."""
    T = 17
    logp = (-torch.rand(T, generator=gen, dtype=torch.float64) * 3).requires_grad_()
    old = logp.detach() + 0.4 * torch.randn(T, generator=gen, dtype=torch.float64)
    roll = old + 0.5 * torch.randn(T, generator=gen, dtype=torch.float64)
    ref = logp.detach() + torch.randn(T, generator=gen, dtype=torch.float64)
    adv = torch.randn(T, generator=gen, dtype=torch.float64)
    w = torch.rand(T, generator=gen, dtype=torch.float64)
    seqs = SimpleNamespace(loss_rollout=torch.tensor([0] * 5 + [3] * 8 + [9] * 4))

    def f(x):
        return rl.policy_loss(x, old, adv, weights=w, rollout_logp=roll, tis_cap=1.2, ref_logp=ref, kl_coef=0.1,
                              agg="seq-mean-token-mean", pack=seqs, dual_clip=2.5)[0]

    assert torch.autograd.gradcheck(f, (logp,), eps=1e-7, atol=1e-9)


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
    z = torch.zeros(T, dtype=torch.float64)
    with pytest.raises(ValueError, match=f"lacks rollout log-probs for {T} of its {T} targets"):
        rl.policy_loss(z, p, z)
    with pytest.raises(ValueError, match=f"rollout_logp: the pack lacks rollout log-probs for {T}"):
        rl.policy_loss(z, z, z, rollout_logp=p, tis_cap=2.0)
    with pytest.raises(ValueError, match="pack: agg='seq-mean-token-mean' needs pack="):
        rl.policy_loss(z, z, z, agg="seq-mean-token-mean")
    with pytest.raises(ValueError, match="normalizer: agg='seq-mean-token-sum-norm'"):
        rl.policy_loss(z, z, z, agg="seq-mean-token-sum-norm", pack=p)
    with pytest.raises(ValueError, match="agg 'mean'"):
        rl.policy_loss(z, z, z, agg="mean")
    with pytest.raises(ValueError, match="agg_sequence 'turn'"):
        rl.policy_loss(z, z, z, agg="seq-mean-token-sum", agg_sequence="turn", pack=p)
    with pytest.raises(ValueError, match=r"pack has \(5,\) loss_rollout, expected \[6\]"):
        rl.policy_loss(z, z, z, agg="seq-mean-token-sum", pack=SimpleNamespace(loss_rollout=torch.zeros(5)))
    with pytest.raises(ValueError, match="rollout_logp: tis_cap needs"):
        rl.policy_loss(z, z, z, tis_cap=2.0)
    with pytest.raises(ValueError, match="rollout_logp is read only with tis_cap"):
        rl.policy_loss(z, z, z, rollout_logp=z)
    with pytest.raises(ValueError, match="tis_cap"):
        rl.policy_loss(z, z, z, rollout_logp=z, tis_cap=0.0)
    with pytest.raises(ValueError, match="ref_logp: kl_coef = 0.1"):
        rl.policy_loss(z, z, z, kl_coef=0.1)
    with pytest.raises(ValueError, match="kl_coef"):
        rl.policy_loss(z, z, z, ref_logp=z, kl_coef=-1.0)
    with pytest.raises(ValueError, match="kl_estimator 'k4'"):
        rl.policy_loss(z, z, z, ref_logp=z, kl_estimator="k4")
    with pytest.raises(ValueError, match=r"ref_logp\[0\]"):
        rl.policy_loss(z, z, z, ref_logp=torch.full((T,), float("nan"), dtype=torch.float64))
    with pytest.raises(ValueError, match="log_ratio_clamp"):
        rl.policy_loss(z, z, z, log_ratio_clamp=0.0)


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
