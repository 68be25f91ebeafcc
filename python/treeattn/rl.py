"""Reinforcement-learning objectives on packs (torch).

Every function works on per-target tensors in a pack's loss order (``[T]``,
one entry per loss entry, as :func:`treeattn.hf.target_logprobs` returns
them), so a loss computed on a pack is the loss of every target scored under
its exact live prefix. Sums are divided by a ``normalizer``: by default the
``Σ weights`` of the targets given; for a token mean over a whole batch
(CompactionRL's token-level loss, verl's ``token-mean``), pass the batch's
``Σ weights`` over all packs and ranks, so that the per-pack losses add up to
the batch loss and their gradients to its gradient.

Errors are ``ValueError`` naming the argument: a non-tensor, wrong shape or
dtype, NaN / ±inf entries, negative weights, a bad clip range or normalizer.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional, Tuple

import torch
from torch import Tensor

__all__ = ["policy_loss", "value_loss"]


# --------------------------------------------------------------------------
# helpers


def _vector(name: str, x: Any, n: Optional[int] = None, like: Optional[Tensor] = None) -> Tensor:
    """A finite 1-D floating tensor (``[n]`` when given), on ``like``'s
    device and in its dtype when given."""
    if not isinstance(x, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 1:
        raise ValueError(f"{name} must be 1-D [T], got shape {tuple(x.shape)}")
    if n is not None and x.shape[0] != n:
        raise ValueError(f"{name} has {x.shape[0]} entries, expected {n} (one per target)")
    if not x.dtype.is_floating_point:
        raise ValueError(f"{name} has dtype {x.dtype}: expected a float dtype")
    bad = ~torch.isfinite(x.detach())
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(f"{name}[{i}] = {float(x[i])}: {int(bad.sum())} entries of {name} are NaN or infinite")
    if like is not None:
        if x.device != like.device:
            raise ValueError(f"{name} is on {x.device}, logp / values on {like.device}")
        x = x.to(like.dtype)
    return x


def _weights(weights: Any, like: Tensor) -> Tensor:
    if weights is None:
        return torch.ones_like(like.detach())
    w = _vector("weights", weights, like.shape[0], like).detach()
    if bool((w < 0).any()):
        i = int((w < 0).nonzero()[0, 0])
        raise ValueError(f"weights[{i}] = {float(w[i])} is negative")
    return w


def _normalizer(normalizer: Any, w: Tensor) -> Tensor:
    """The divisor: ``normalizer`` (a positive finite number or one-element
    tensor), or ``Σ w`` (floored at the dtype's tiny, so no targets give 0)."""
    if normalizer is None:
        return w.sum().clamp_min(torch.finfo(w.dtype).tiny)
    if isinstance(normalizer, Tensor):
        if normalizer.numel() != 1:
            raise ValueError(f"normalizer must be a number or a one-element tensor, got shape {tuple(normalizer.shape)}")
        v = float(normalizer.detach())
    elif isinstance(normalizer, bool) or not isinstance(normalizer, (int, float)):
        raise ValueError(f"normalizer must be a positive number or None, got {normalizer!r}")
    else:
        v = float(normalizer)
    if not (math.isfinite(v) and v > 0):
        raise ValueError(f"normalizer = {v} must be finite and > 0 (e.g. Σ weights over the whole batch)")
    return torch.tensor(v, dtype=w.dtype, device=w.device)


def _wmean(x: Tensor, w: Tensor) -> Tensor:
    """Σ w·x / Σ w (0 when Σ w = 0), detached: a statistic."""
    s = w.sum()
    return (w * x.detach()).sum() / s if float(s) > 0 else torch.zeros((), dtype=w.dtype, device=w.device)


def _number(name: str, v: Any, lo: float, lo_open: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(float(v)):
        raise ValueError(f"{name} must be a finite number, got {v!r}")
    v = float(v)
    if v < lo or (lo_open and v == lo):
        raise ValueError(f"{name} = {v} must be {'>' if lo_open else '>='} {lo}")
    return v


# --------------------------------------------------------------------------
# PPO losses


def policy_loss(
    logp: Tensor,
    old_logp: Any,
    advantages: Tensor,
    *,
    weights: Optional[Tensor] = None,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: Optional[float] = None,
    normalizer: Any = None,
) -> Tuple[Tensor, Dict[str, Tensor]]:
    """Token-level PPO clipped surrogate.

    Per target t: ``ρ_t = exp(logp_t − old_logp_t)``,
    ``ℓ_t = −min(ρ_t A_t, clip(ρ_t, 1 − clip_low, 1 + clip_high) A_t)``;
    with ``dual_clip`` c (> 1, Ye et al. 2020, as verl's ``clip_ratio_c``),
    for ``A_t < 0``: ``ℓ_t = min(ℓ_t, −c·A_t)`` (the loss of a negative
    advantage is capped at ``c·|A_t|``). ``loss = Σ_t w_t ℓ_t / N``,
    ``N = normalizer`` (default ``Σ w``). Gradient flows to ``logp`` only.

    ``logp`` ``[T]``: the current policy's log-probs (e.g.
    :func:`treeattn.hf.target_logprobs`); ``old_logp`` ``[T]`` or a
    :class:`treeattn.Pack`, whose ``loss_logprobs`` (the rollout policy's
    log-probs) are then used — a pack with missing log-probs (NaN) is
    refused, saying how many; ``advantages`` ``[T]``; ``weights`` ``[T]``
    non-negative (default ones; a pack's ``loss_weights``).

    Returns ``(loss, stats)``, stats detached, weighted means over targets:
    ``clip_frac`` (fraction where the clipped term is the one taken, i.e.
    ``clip(ρ)A < ρA``: the token gives no gradient), ``dual_clip_frac``
    (fraction where the dual clip bound is taken; 0 without it),
    ``approx_kl`` (Schulman's k3 estimator of KL(π_old ‖ π):
    ``(ρ − 1) − log ρ``, ≥ 0, unbiased under samples of π_old),
    ``ratio_mean`` (of ρ).
    """
    if not isinstance(logp, Tensor):
        raise ValueError(f"logp must be a torch.Tensor, got {type(logp).__name__}")
    logp = _vector("logp", logp)
    T = logp.shape[0]
    if hasattr(old_logp, "loss_logprobs") and not isinstance(old_logp, Tensor):
        pack_lp = old_logp.loss_logprobs
        if pack_lp is None or pack_lp.shape != (T,):
            raise ValueError(
                f"old_logp is a pack with {None if pack_lp is None else tuple(pack_lp.shape)} "
                f"loss_logprobs, expected [{T}] (one per target of logp)"
            )
        missing = int(torch.isnan(pack_lp).sum())
        if missing:
            raise ValueError(
                f"old_logp: the pack lacks rollout log-probs for {missing} of its {T} targets "
                "(loss_logprobs is NaN where a call logged none): log them, or recompute them and pass a tensor"
            )
        old_logp = pack_lp.to(logp.device)
    old = _vector("old_logp", old_logp, T, logp).detach()
    adv = _vector("advantages", advantages, T, logp).detach()
    w = _weights(weights, logp)
    lo = _number("clip_low", clip_low, 0.0)
    hi = _number("clip_high", clip_high, 0.0)
    if lo >= 1.0:
        raise ValueError(f"clip_low = {lo} must be < 1 (the ratio's lower bound 1 − clip_low must be positive)")
    c = None
    if dual_clip is not None:
        c = _number("dual_clip", dual_clip, 1.0, lo_open=True)
    norm = _normalizer(normalizer, w)

    ratio = torch.exp(logp - old)
    surr = ratio * adv
    surr_clip = torch.clamp(ratio, 1.0 - lo, 1.0 + hi) * adv
    # A tie (ratio inside the range) takes the unclipped term, gradient and all.
    clipped = surr_clip < surr
    per = -torch.where(clipped, surr_clip, surr)
    dual = torch.zeros_like(clipped)
    if c is not None:
        bound = -c * adv
        dual = (adv < 0) & (bound < per)
        per = torch.where(adv < 0, torch.minimum(per, bound), per)
    loss = (w * per).sum() / norm
    with torch.no_grad():
        r = ratio.detach()
        stats = {
            "clip_frac": _wmean(clipped.to(w.dtype), w),
            "dual_clip_frac": _wmean(dual.to(w.dtype), w),
            "approx_kl": _wmean((r - 1.0) - (logp.detach() - old), w),
            "ratio_mean": _wmean(r, w),
        }
    return loss, stats


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    *,
    clip: Optional[float] = None,
    weights: Optional[Tensor] = None,
    normalizer: Any = None,
) -> Tuple[Tensor, Dict[str, Tensor]]:
    """PPO value loss, per target t:
    ``ℓ_t = ½ (V_t − R_t)²`` without ``clip``; with ``clip`` ε (PPO value
    clipping): ``ℓ_t = ½ max((V_t − R_t)², (V_old,t + clip(V_t − V_old,t,
    −ε, ε) − R_t)²)``. ``loss = Σ_t w_t ℓ_t / N``, ``N = normalizer``
    (default ``Σ w``). Gradient flows to ``values`` only.

    ``values`` ``[T]`` (the critic now, at each target's loss row),
    ``old_values`` ``[T]`` (the critic at rollout time), ``returns`` ``[T]``.

    Returns ``(loss, stats)``, detached weighted means: ``clip_frac``
    (fraction where the clipped error is the larger one), ``mse``
    (``(V − R)²``), ``value_mean``.
    """
    if not isinstance(values, Tensor):
        raise ValueError(f"values must be a torch.Tensor, got {type(values).__name__}")
    values = _vector("values", values)
    T = values.shape[0]
    old = _vector("old_values", old_values, T, values).detach()
    ret = _vector("returns", returns, T, values).detach()
    w = _weights(weights, values)
    eps = None if clip is None else _number("clip", clip, 0.0, lo_open=True)
    norm = _normalizer(normalizer, w)
    err = (values - ret) ** 2
    clipped = torch.zeros_like(err, dtype=torch.bool)
    if eps is not None:
        v_clip = old + torch.clamp(values - old, -eps, eps)
        err_clip = (v_clip - ret) ** 2
        clipped = err_clip > err
        err = torch.where(clipped, err_clip, err)  # a tie keeps the unclipped gradient
    loss = 0.5 * (w * err).sum() / norm
    with torch.no_grad():
        stats = {
            "clip_frac": _wmean(clipped.to(w.dtype), w),
            "mse": _wmean((values.detach() - ret) ** 2, w),
            "value_mean": _wmean(values.detach(), w),
        }
    return loss, stats
