"""treeattn.torch.sdcc_forward_kl against a log_softmax reference (float64,
<= 1e-10 relative on the loss, per-pair KL and the gradient)."""

import pytest
import torch

import treeattn.torch as tt
from conftest import rel_err


def reference(logits, s, t, w, tau):
    """Forward KL(teacher ‖ student) with torch's log_softmax; teacher
    detached (stop-gradient); p_t = 0 entries add 0."""
    ls = torch.log_softmax(logits[s] / tau, -1)
    lt = torch.log_softmax(logits[t].detach() / tau, -1)
    pt = lt.exp()
    kl = torch.where(pt > 0, pt * (lt - ls), torch.zeros_like(pt)).sum(-1)
    return (w * kl).sum() / w.sum(), kl


def make(rows, vocab, pairs, gen, dtype=torch.float64):
    logits = torch.randn(rows, vocab, dtype=torch.float64, generator=gen) * 3
    s = torch.randint(0, rows, (pairs,), generator=gen)
    t = torch.randint(0, rows, (pairs,), generator=gen)
    w = torch.rand(pairs, generator=gen, dtype=torch.float64) + 0.1
    w = w.to(torch.float32).to(torch.float64)  # exact in float32 too (the float32 tests)
    return logits.to(dtype), s, t, w


@pytest.mark.parametrize("tau", [1.0, 0.7, 2.5])
def test_matches_log_softmax(tau, gen):
    rows, vocab, pairs = 12, 301, 9
    logits, s, t, w = make(rows, vocab, pairs, gen)
    # Students are rows 0..8, teachers rows 9..11 (and row 0 twice as a student).
    s = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 0])
    t = torch.randint(9, rows, (pairs,), generator=gen)
    # −inf entries: a teacher row with zero-probability tokens, and a student
    # −inf where its teacher has no mass (KL stays finite).
    logits[t[0], :50] = float("-inf")
    logits[s[1], 7] = float("-inf")
    logits[t[1], 7] = float("-inf")
    a = logits.clone().requires_grad_()
    b = logits.clone().requires_grad_()
    loss, kl = tt.sdcc_forward_kl(a, s, t, w, tau)
    # float64 logits: tau and the weights are used in float64 (not rounded
    # to the crate's float32).
    loss_ref, kl_ref = reference(b, s, t, w, tau)
    assert torch.isfinite(kl).all()
    assert rel_err(loss, loss_ref) <= 1e-10
    assert rel_err(kl, kl_ref) <= 1e-10
    loss.backward()
    loss_ref.backward()
    assert torch.isfinite(a.grad).all()
    assert rel_err(a.grad, b.grad) <= 1e-10
    # Only student rows get a gradient (teacher is stop-gradient).
    only_teacher = set(t.tolist()) - set(s.tolist())
    for r in only_teacher:
        assert (a.grad[r] == 0).all()


def test_teacher_gets_no_gradient_negative_control(gen):
    logits, s, t, w = make(6, 40, 4, gen)
    s = torch.tensor([0, 1, 2, 3])
    t = torch.tensor([4, 5, 4, 5])
    a = logits.clone().requires_grad_()
    tt.sdcc_forward_kl(a, s, t, w)[0].backward()
    assert (a.grad[4:] == 0).all() and (a.grad[:4] != 0).any()
    # A reference that lets the gradient reach the teacher differs.
    b = logits.clone().requires_grad_()
    ls = torch.log_softmax(b[s], -1)
    lt = torch.log_softmax(b[t], -1)
    ((w * (lt.exp() * (lt - ls)).sum(-1)).sum() / w.sum()).backward()
    assert rel_err(a.grad, b.grad) > 1e-3


def test_student_minus_inf_under_teacher_mass_is_inf_kl(gen):
    logits, _, _, _ = make(2, 10, 1, gen)
    logits[0, 3] = float("-inf")
    a = logits.clone().requires_grad_()
    loss, kl = tt.sdcc_forward_kl(a, torch.tensor([0]), torch.tensor([1]))
    assert kl[0] == float("inf") and loss == float("inf")
    loss.backward()
    assert torch.isfinite(a.grad).all()


def test_default_weights_and_float32(gen):
    logits, s, t, _ = make(8, 1000, 5, gen)
    ones = torch.ones(5, dtype=torch.float64)
    loss_ref, kl_ref = reference(logits, s, t, ones, 1.0)
    loss, kl = tt.sdcc_forward_kl(logits.float(), s, t)
    assert loss.dtype == torch.float32
    assert rel_err(kl, kl_ref) <= 1e-5 and rel_err(loss, loss_ref) <= 1e-5


def test_zero_weights_zero_loss(gen):
    logits, s, t, _ = make(4, 20, 3, gen)
    a = logits.clone().requires_grad_()
    loss, kl = tt.sdcc_forward_kl(a, s, t, torch.zeros(3))
    assert loss == 0
    loss.backward()
    assert (a.grad == 0).all()


def test_kl_per_pair_has_no_gradient(gen):
    logits, s, t, w = make(4, 20, 3, gen)
    a = logits.clone().requires_grad_()
    loss, kl = tt.sdcc_forward_kl(a, s, t, w)
    assert loss.requires_grad and not kl.requires_grad


def test_opcheck(gen):
    logits, s, t, w = make(6, 33, 4, gen)
    a = logits.clone().requires_grad_()
    torch.library.opcheck(torch.ops.treeattn.sdcc_forward_kl.default, (a, s, t, w.float(), 0.9, 0))


def test_compile(gen):
    torch._dynamo.reset()
    logits, s, t, w = make(6, 33, 4, gen)

    def f(x):
        loss, _ = tt.sdcc_forward_kl(x * 2, s, t, w)
        return loss

    a = logits.clone().requires_grad_()
    y = torch.compile(f, fullgraph=True)(a)
    y.backward()
    b = logits.clone().requires_grad_()
    f(b).backward()
    assert rel_err(y, f(logits)) <= 1e-12 and rel_err(a.grad, b.grad) <= 1e-12


def test_float64_tau_and_weights_not_rounded_to_float32(gen):
    """tau = 1.7 and weights that float32 cannot hold: float64 logits give
    the float64 reference to 1e-12 relative (rounding both to float32 was a
    1e-7 error); the rounded reference differs by more (negative control)."""
    logits, s, t, _ = make(10, 257, 7, gen)
    w = torch.rand(7, generator=gen, dtype=torch.float64) + 0.1
    tau = 1.7
    a = logits.clone().requires_grad_()
    b = logits.clone().requires_grad_()
    loss, kl = tt.sdcc_forward_kl(a, s, t, w, tau)
    loss_ref, kl_ref = reference(b, s, t, w, tau)
    assert rel_err(loss, loss_ref) <= 1e-12 and rel_err(kl, kl_ref) <= 1e-12
    loss.backward()
    loss_ref.backward()
    assert rel_err(a.grad, b.grad) <= 1e-12
    rounded, _ = reference(logits, s, t, w.float().double(), float(torch.tensor(tau, dtype=torch.float32)))
    assert rel_err(rounded, loss_ref) > 1e-10
