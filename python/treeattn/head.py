"""The chunked output-embedding ops: per-target log-probs (and entropies)
and the SDCC forward KL computed from hidden states and the output
embedding's weight, ``chunk`` rows at a time, never ``[L, V]`` or ``[T, V]``
logits, each chunk's logits recomputed in backward.

The op layer, independent of transformers (as Liger-Kernel separates its
ops from its model patches): :mod:`treeattn.hf` finds a model's head and
hidden states and calls these (``target_logprobs``, ``pack_loss``).

- :class:`_HeadLogprob`: ``lp_i = z_i[y_i] − logsumexp(z_i)`` (and the
  entropy) for ``z = head(h)``;
- :class:`_HeadSdcc`: ``Σ w_i KL(softmax(b_i/τ) ‖ softmax(a_i/τ)) / Σ w``
  with the teacher under stop-gradient;
- :class:`_Post`: the model's logit scale, final softcap and the sampling
  temperature between ``h·Wᵀ + b`` and the log-softmax;
- :func:`default_chunk`: the default row chunk for a vocabulary.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

__all__ = ["CHUNK_ELEMENTS", "default_chunk"]

#: Elements of one [chunk, V] logits block the default chunk aims at
#: (2^24: 64 MiB in float32).
CHUNK_ELEMENTS = 1 << 24


def default_chunk(vocab: int) -> int:
    """The default row chunk: ``max(1, min(4096, 2**24 // vocab))`` (128 rows
    at V = 131,072, so one float32 ``[chunk, V]`` block is 64 MiB)."""
    return max(1, min(4096, CHUNK_ELEMENTS // max(1, int(vocab))))


def _acc_dtype(dt: torch.dtype) -> torch.dtype:
    """Softmax / accumulation dtype: float32 for bfloat16 / float16, else the dtype."""
    return torch.float32 if dt in (torch.bfloat16, torch.float16) else dt


class _Post(NamedTuple):
    """What happens to the output embedding's ``u = h·Wᵀ + b`` before the
    log-softmax: ``z = c·tanh(s·u / c) / T`` (without a cap ``z = s·u /
    T``): the model's logit scale ``s`` (Cohere's ``logit_scale``, Granite's
    ``1 / logits_scaling``), its final logit softcap ``c`` (Gemma 2/3), and
    the sampling temperature ``T`` (``inv_temp = 1 / T``) the scoring
    functions take."""

    scale: float
    cap: Optional[float]
    inv_temp: float = 1.0

    def factor(self) -> float:
        """``∂z/∂u`` without the cap's ``1 − tanh²``."""
        return self.scale * self.inv_temp


def _head_logits(h: Tensor, weight: Tensor, bias: Optional[Tensor], post: _Post) -> Tuple[Tensor, Optional[Tensor]]:
    """u = h·Wᵀ + b in the weight's dtype, then in the accumulation dtype;
    z = s·u, with a softcap c: z = c·tanh(s·u / c); then z / T (:class:`_Post`).
    Returns (z, tanh(s·u/c) or None). ∂z/∂u = s·(1 − tanh²) / T."""
    u = torch.nn.functional.linear(h, weight, bias)
    z = u.to(_acc_dtype(u.dtype))
    if post.scale != 1.0:
        z = z.mul_(post.scale)
    t = None
    if post.cap is not None:
        t = torch.tanh(z / post.cap)
        z = t * post.cap
    if post.inv_temp != 1.0:
        z = z.mul_(post.inv_temp)
    return z, t


def _amp_state(device_type: str) -> Tuple[str, bool, Optional[torch.dtype]]:
    """The autocast state of ``device_type`` at a forward, for its backward
    to recompute the head under the same casts (as activation checkpointing
    does)."""
    if device_type not in ("cpu", "cuda") or not torch.is_autocast_enabled(device_type):
        return device_type, False, None
    return device_type, True, torch.get_autocast_dtype(device_type)


def _amp(state: Tuple[str, bool, Optional[torch.dtype]]) -> Any:
    device_type, enabled, dtype = state
    return torch.autocast(device_type, dtype=dtype, enabled=enabled)


def _chain_post(g: Tensor, t: Optional[Tensor], post: _Post) -> Tensor:
    """``g ← g · ∂z/∂u`` in place (``∂/∂z`` into ``∂/∂u``)."""
    if t is not None:
        g.mul_(1.0 - t * t)
    if post.factor() != 1.0:
        g.mul_(post.factor())
    return g


def _slice_head(weight: Tensor, bias: Optional[Tensor], v0: int, v1: int) -> Tuple[Tensor, Optional[Tensor]]:
    return weight[v0:v1], (None if bias is None else bias[v0:v1])


def _dw_by_vocab(h: Tensor, weight: Tensor, chunk: int, grad: Callable[[int, int, int, int], Tensor]) -> Tensor:
    """∂W = Σ_rows gᵀ·h for a 16-bit weight, one slice of the vocabulary
    at a time: each slice's rows are summed in the accumulation dtype over
    row chunks (``grad(i, j, v0, v1)`` gives ``∂/∂u`` of rows ``i:j`` at
    vocabulary entries ``v0:v1``, ``[j − i, v1 − v0]``) and rounded to the
    weight's dtype once. Extra memory: one ``[slice, H]`` accumulator and
    one ``[chunk, slice]`` block, whatever V — no float32 ``[V, H]``."""
    V, H = weight.shape
    adt = _acc_dtype(weight.dtype)
    dw = torch.empty_like(weight)
    vs = max(1, min(V, CHUNK_ELEMENTS // max(1, H)))
    n = h.shape[0]
    for v0 in range(0, V, vs):
        v1 = min(V, v0 + vs)
        acc = torch.zeros((v1 - v0, H), dtype=adt, device=weight.device)
        for i in range(0, n, chunk):
            j = min(n, i + chunk)
            acc.addmm_(grad(i, j, v0, v1).t(), h[i:j].to(adt))
        dw[v0:v1] = acc
    return dw


class _HeadLogprob(torch.autograd.Function):
    """lp_i = z_i[y_i] − logsumexp(z_i) and, optionally, the entropy
    H_i = −Σ_v p_iv log p_iv (p_i = softmax(z_i)) for rows h_i, z_i = head(h_i),
    computed ``chunk`` rows at a time. Saved for backward: h, W, b, labels and
    per-row logsumexp / entropy; each chunk's logits are recomputed.

    Backward, per row: ∂lp/∂z = onehot(y) − p; ∂H/∂z = −p ∘ (log p + H);
    with ``post`` (:class:`_Post`), ∂z/∂u = s·(1 − tanh²(s·u/c)) / T;
    then ∂h = g·W, ∂W = gᵀ·h, ∂b = Σ g. ∂W of a 16-bit weight is summed per
    vocabulary slice in float32 and rounded once (:func:`_dw_by_vocab`), so
    the extra memory stays a few blocks besides the gradient itself."""

    @staticmethod
    def forward(ctx, h, weight, bias, labels, chunk, post, want_entropy):
        n = h.shape[0]
        adt = _acc_dtype(weight.dtype)
        lp = torch.empty(n, dtype=adt, device=h.device)
        lse = torch.empty(n, dtype=adt, device=h.device)
        ent = torch.empty(n if want_entropy else 0, dtype=adt, device=h.device)
        for i in range(0, n, chunk):
            j = min(n, i + chunk)
            z, _t = _head_logits(h[i:j], weight, bias, post)
            zy = z.gather(1, labels[i:j, None])[:, 0]
            # logsumexp in place over the block (torch.logsumexp makes
            # temporaries and was ~2x slower here): m = max, e = exp(z − m).
            m = z.amax(-1)
            zm = z.sub_(m[:, None])
            if want_entropy:
                e = zm.exp()
                s = e.sum(-1)
                # H = log s − Σ e·(z − m) / s, the dot product batched (no third buffer).
                ent[i:j] = s.log() - torch.bmm(e[:, None, :], zm[:, :, None])[:, 0, 0] / s
                del e
            else:
                s = zm.exp_().sum(-1)
            lse[i:j] = m + s.log()
            lp[i:j] = zy - lse[i:j]
            del z, zm, _t
        ctx.save_for_backward(h, weight, bias, labels, lse, ent)
        ctx.chunk, ctx.post, ctx.want_entropy = chunk, post, want_entropy
        ctx.amp = _amp_state(h.device.type)
        ctx.set_materialize_grads(False)
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        h, weight, bias, labels, lse, ent = ctx.saved_tensors
        chunk, post = ctx.chunk, ctx.post
        n = h.shape[0]
        adt = lse.dtype
        need_h, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        # A 16-bit weight's ∂W is summed by vocabulary slice (_dw_by_vocab);
        # a float32 / float64 one's in place, over the row chunks.
        w_in_rows = need_w and weight.dtype == adt
        dh = torch.zeros_like(h) if need_h else None
        dw = torch.zeros(weight.shape, dtype=adt, device=weight.device) if w_in_rows else None
        db = torch.zeros(bias.shape, dtype=adt, device=bias.device) if (need_b and bias is not None) else None
        if g_ent is not None and not ctx.want_entropy:
            g_ent = None
        if (g_lp is None and g_ent is None) or n == 0:
            dw = torch.zeros_like(weight) if need_w else None
            return dh, dw, (db.to(bias.dtype) if db is not None else None), None, None, None, None

        def grad(i: int, j: int, v0: int, v1: int) -> Tensor:
            """∂/∂u of rows i:j at vocabulary entries v0:v1."""
            w_, b_ = _slice_head(weight, bias, v0, v1)
            z, t = _head_logits(h[i:j], w_, b_, post)
            logp = z.sub_(lse[i:j, None])
            gl = g_lp[i:j, None].to(adt) if g_lp is not None else None
            # g = ∂/∂z of Σ gl·lp + ge·H, written over logp's buffer:
            #   −p·(gl + ge·(log p + H)), then + gl at the label.
            if g_ent is None:
                g = logp.exp_().mul_(-gl)
            else:
                p = logp.exp()
                g = logp.add_(ent[i:j, None]).mul_(g_ent[i:j, None].to(adt))
                if gl is not None:
                    g.add_(gl)
                g.mul_(p).neg_()
                del p
            if gl is not None:
                # + gl at each row's label, where it falls in v0:v1.
                y = labels[i:j, None] - v0
                hit = (y >= 0) & (y < v1 - v0)
                g.scatter_add_(1, y.clamp(0, v1 - v0 - 1), torch.where(hit, gl, torch.zeros_like(gl)))
            return _chain_post(g, t, post)

        V = weight.shape[0]
        with torch.no_grad(), _amp(ctx.amp):
            for i in range(0, n, chunk):
                j = min(n, i + chunk)
                g = grad(i, j, 0, V)
                if need_h:
                    dh[i:j] = (g.to(weight.dtype) @ weight).to(dh.dtype)
                if dw is not None:
                    dw.addmm_(g.t(), h[i:j].to(adt))
                if db is not None:
                    db.add_(g.sum(0))
                del g
            if need_w and not w_in_rows:
                dw = _dw_by_vocab(h, weight, chunk, grad)
        return (
            dh,
            dw.to(weight.dtype) if dw is not None else None,
            db.to(bias.dtype) if db is not None else None,
            None, None, None, None,
        )


class _HeadSdcc(torch.autograd.Function):
    """SDCC on head rows: for pairs i (student hidden s_i, teacher hidden t_i),
    a = head(s_i)/τ, b = head(t_i)/τ (teacher: stop-gradient),
    KL_i = Σ_v p_b (log p_b − log p_a), loss = Σ w_i KL_i / Σ w (0 when Σ w = 0),
    chunked like :class:`_HeadLogprob`; τ and w in the accumulation dtype.
    ∂loss/∂a_i = w_i (p_a − p_b) / (τ Σ w) (only the student gets a gradient)."""

    @staticmethod
    def forward(ctx, hs, ht, weight, bias, w, tau, chunk, post):
        P = hs.shape[0]
        adt = _acc_dtype(weight.dtype)
        w = w.to(adt)
        wsum = w.sum()
        kl = torch.empty(P, dtype=adt, device=hs.device)
        lse_a = torch.empty(P, dtype=adt, device=hs.device)
        lse_b = torch.empty(P, dtype=adt, device=hs.device)
        for i in range(0, P, chunk):
            j = min(P, i + chunk)
            za, _ = _head_logits(hs[i:j], weight, bias, post)
            zb, _ = _head_logits(ht[i:j], weight, bias, post)
            za.div_(tau)
            zb.div_(tau)
            lse_a[i:j] = torch.logsumexp(za, -1)
            lse_b[i:j] = torch.logsumexp(zb, -1)
            la = za.sub_(lse_a[i:j, None])
            lb = zb.sub_(lse_b[i:j, None])
            pb = lb.exp()
            # p_b = 0 (underflow) adds 0: lb − la is finite for head logits.
            kl[i:j] = torch.bmm(pb[:, None, :], lb.sub_(la)[:, :, None])[:, 0, 0]
            del la, lb, pb, za, zb
        loss = (w * kl).sum() / wsum if float(wsum) > 0 else torch.zeros((), dtype=adt, device=hs.device)
        ctx.save_for_backward(hs, ht, weight, bias, w, lse_a, lse_b)
        ctx.tau, ctx.chunk, ctx.post, ctx.wsum = tau, chunk, post, wsum
        ctx.amp = _amp_state(hs.device.type)
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(kl)
        return loss, kl

    @staticmethod
    def backward(ctx, g_loss, _g_kl):
        hs, ht, weight, bias, w, lse_a, lse_b = ctx.saved_tensors
        tau, chunk, post, wsum = ctx.tau, ctx.chunk, ctx.post, ctx.wsum
        P = hs.shape[0]
        adt = w.dtype
        need_h, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[2], ctx.needs_input_grad[3]
        w_in_rows = need_w and weight.dtype == adt
        dh = torch.zeros_like(hs) if need_h else None
        dw = torch.zeros(weight.shape, dtype=adt, device=weight.device) if w_in_rows else None
        db = torch.zeros(bias.shape, dtype=adt, device=bias.device) if (need_b and bias is not None) else None
        if g_loss is None or P == 0 or not float(wsum) > 0:
            dw = torch.zeros_like(weight) if need_w else None
            return dh, None, dw, (db.to(bias.dtype) if db is not None else None), None, None, None, None
        scale = w * (g_loss.to(adt) / (wsum * tau))  # [P]

        def grad(i: int, j: int, v0: int, v1: int) -> Tensor:
            """∂/∂u (student) of pairs i:j at vocabulary entries v0:v1."""
            w_, b_ = _slice_head(weight, bias, v0, v1)
            za, ta = _head_logits(hs[i:j], w_, b_, post)
            zb, _ = _head_logits(ht[i:j], w_, b_, post)
            g = za.div_(tau).sub_(lse_a[i:j, None]).exp_()
            g.sub_(zb.div_(tau).sub_(lse_b[i:j, None]).exp_()).mul_(scale[i:j, None])
            del za, zb
            return _chain_post(g, ta, post)

        V = weight.shape[0]
        with torch.no_grad(), _amp(ctx.amp):
            for i in range(0, P, chunk):
                j = min(P, i + chunk)
                g = grad(i, j, 0, V)
                if need_h:
                    dh[i:j] = (g.to(weight.dtype) @ weight).to(dh.dtype)
                if dw is not None:
                    dw.addmm_(g.t(), hs[i:j].to(adt))
                if db is not None:
                    db.add_(g.sum(0))
                del g
            if need_w and not w_in_rows:
                dw = _dw_by_vocab(hs, weight, chunk, grad)
        return (
            dh, None,
            dw.to(weight.dtype) if dw is not None else None,
            db.to(bias.dtype) if db is not None else None,
            None, None, None, None,
        )
