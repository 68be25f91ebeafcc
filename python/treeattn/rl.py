"""Reinforcement learning on packs: advantages (GAE across compactions,
GRPO) and the PPO objectives over a pack's targets.

A pack's loss entries are its targets in generation order (sorted by rollout,
call, offset); ``Pack.loss_segment`` numbers each target's segment in its
rollout (0 from the first call, +1 at every junction: a compaction, an
eviction); ``Pack.rollout_reward`` / ``Pack.rollout_group`` carry the
rollouts' ``"reward"`` and ``"group"`` input fields. The advantages'
arithmetic runs in the Rust crate (``treeattn::rl``) in float64; these
functions map a pack's tensors onto it.

The losses work on per-target tensors in a pack's loss order (``[T]``,
one entry per loss entry, as :func:`treeattn.hf.target_logprobs` returns
them), so a loss computed on a pack is the loss of every target scored under
its exact live prefix. Sums are divided by a ``normalizer``: by default the
``Σ weights`` of the targets given; for a token mean over a whole batch
(CompactionRL's token-level loss, verl's ``token-mean``), pass the batch's
``Σ weights`` over all packs and ranks, so that the per-pack losses add up to
the batch loss and their gradients to its gradient.

Errors are ``ValueError`` naming the argument: a non-tensor, wrong shape or
dtype, NaN / ±inf entries, negative weights, a bad clip range or normalizer,
a rollout without a reward.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from . import _native

__all__ = ["gae", "grpo_advantages", "policy_loss", "value_loss"]


def _f64(data: bytes) -> Tensor:
    if not data:
        return torch.empty(0, dtype=torch.float64)
    return torch.frombuffer(bytearray(data), dtype=torch.float64).clone()


def _target_rewards(pack: Any) -> Tensor:
    """``[T]`` float64: the reward of each target's rollout; ValueError
    naming the rollouts without one."""
    local = pack.loss_rollout_local()
    reward = pack.rollout_reward.to(torch.float64)
    missing = [pack.rollout_ids[i] for i in torch.nonzero(torch.isnan(reward)).flatten().tolist()
               if bool((local == i).any())]
    if missing:
        shown = ", ".join(repr(m) for m in missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ValueError(
            f"{len(missing)} rollout(s) of the pack have no reward ({shown}): "
            'give each rollout a finite "reward" in the input'
        )
    return reward[local]


def gae(
    pack: Any,
    values: Tensor,
    *,
    gamma: float = 1.0,
    lam: Union[float, str] = 0.95,
    alpha: float = 1.5,
    mode: str = "exact",
) -> Tuple[Tensor, Tensor]:
    """Generalized advantage estimation over a pack's targets.

    ``values`` ``[T]``: the critic's value ``V_t`` at each loss entry's row
    (``pack.loss_rows``), i.e. under that target's own live prefix. Each
    rollout (targets ``t = 0 … n−1`` in generation order) has reward ``R``
    at its last target (``r_t = 0`` before it). Returns ``(advantages,
    returns)``, both ``[T]`` in ``values``' dtype and device, computed in
    float64; ``returns = advantages + values``; no gradient flows.

    ``mode``:

    - ``"exact"``: ``δ_t = r_t + γ V_{t+1} − V_t`` (``V_n = 0``),
      ``A_t = Σ_l (γλ)^l δ_{t+l}`` over the whole rollout, across its
      segments (one reverse scan: the pack holds every segment at once).
    - ``"segment"``: each segment alone, as if the rollout ended at its last
      target (value 0 after it, reward ``R`` there).
    - ``"compaction"``: CompactionRL's eq. 9 (arXiv 2607.05378): the
      ``"segment"`` advantage of segment ``s`` times ``(γλ)^{N>s}``, ``N>s``
      = the rollout's targets in later segments.

    ``lam="adaptive"``: VAPO's ``λ = 1 − 1/(alpha · n)`` per rollout, with
    ``n`` read as the rollout's number of targets (the paper's "response
    length"), clamped to ``[0, 1]``.

    Raises ``ValueError`` for ``values`` of the wrong shape or not finite, a
    rollout with no reward (naming it), ``gamma`` / ``lam`` outside
    ``[0, 1]``, an unknown mode.
    """
    if not isinstance(values, Tensor):
        raise ValueError(f"values must be a torch.Tensor, got {type(values).__name__}")
    t = pack.loss_rows.numel()
    if values.dim() != 1 or values.shape[0] != t:
        raise ValueError(
            f"values has shape {tuple(values.shape)}, expected [{t}] (one per loss entry of the pack)"
        )
    if not values.dtype.is_floating_point:
        raise ValueError(f"values must be floating point, got {values.dtype}")
    if isinstance(lam, str):
        if lam != "adaptive":
            raise ValueError(f'lam {lam!r}: expected a number in [0, 1] or "adaptive"')
        lam_value: Optional[float] = None
    else:
        lam_value = float(lam)
    rewards = _target_rewards(pack)
    v = values.detach().to("cpu", torch.float64)
    adv, ret = _native.gae(
        pack.loss_rollout.tolist(),
        pack.loss_segment.tolist(),
        v.tolist(),
        rewards.tolist(),
        float(gamma),
        lam_value,
        float(alpha),
        mode,
    )
    out = (_f64(adv), _f64(ret))
    return tuple(x.to(values.device, values.dtype) for x in out)  # type: ignore[return-value]


def _rollout_records(packs: Sequence[Any]) -> List[Tuple[str, Optional[str], float]]:
    """(rollout id, group name or None, reward) of every rollout of the packs."""
    out = []
    for p in packs:
        for i, rid in enumerate(p.rollout_ids):
            g = int(p.rollout_group[i])
            out.append((rid, p.groups[g] if g >= 0 else None, float(p.rollout_reward[i])))
    return out


def grpo_advantages(
    packs: Union[Any, Sequence[Any]],
    *,
    scale: str = "std",
    eps: float = 1e-6,
    dtype: torch.dtype = torch.float32,
    distributed: bool = False,
    process_group: Any = None,
) -> Union[Tensor, List[Tensor]]:
    """GRPO advantages, broadcast to every target of a rollout.

    For a rollout with reward ``R`` in group ``g`` (the input's ``"group"``:
    rollouts answering the same prompt): ``(R − mean_g) / (std_g + eps)``
    with the population std of ``g``'s rewards (``scale="std"``), or
    ``R − mean_g`` (``scale="none"``). A group whose rewards are all equal
    (a group of one included) has no learning signal: its advantages are
    exactly 0, never NaN.

    ``packs``: one pack (returns a ``[T]`` tensor) or a list of packs
    (returns one ``[T_i]`` tensor per pack); groups are matched by name
    across the packs, so a group may span packs. ``distributed=True``: the
    statistics are over the rollouts of every rank of ``process_group``
    (default: the world), gathered with ``all_gather_object`` (one
    ``(id, group, reward)`` record per rollout; a rollout held by several
    ranks, as under context parallelism, counts once). Every rank of the
    group must call it.

    Raises ``ValueError`` for a rollout without a reward or a group (naming
    it), a rollout id seen twice with different reward or group, a bad
    ``scale`` or ``eps``.
    """
    single = not isinstance(packs, (list, tuple))
    plist = [packs] if single else list(packs)
    if scale not in ("std", "none"):
        raise ValueError(f'scale {scale!r}: expected "std" or "none"')
    records = _rollout_records(plist)
    if distributed:
        import torch.distributed as dist

        gathered: List[Any] = [None] * dist.get_world_size(process_group)
        dist.all_gather_object(gathered, records, group=process_group)
        everyone = [r for part in gathered for r in part]
    else:
        everyone = records
    by_id: Dict[str, Tuple[Optional[str], float]] = {}
    for rid, g, r in everyone:
        if rid in by_id and (by_id[rid][0] != g or not _same(by_id[rid][1], r)):
            raise ValueError(
                f"rollout {rid!r} appears twice with different group or reward: "
                f"{by_id[rid]} and {(g, r)}"
            )
        by_id[rid] = (g, r)
    no_group = [rid for rid, (g, _) in by_id.items() if g is None]
    no_reward = [rid for rid, (_, r) in by_id.items() if r != r]
    for what, ids, field in (("group", no_group, '"group"'), ("reward", no_reward, '"reward"')):
        if ids:
            shown = ", ".join(repr(i) for i in ids[:5]) + (" ..." if len(ids) > 5 else "")
            raise ValueError(
                f"{len(ids)} rollout(s) have no {what} ({shown}): GRPO needs a {field} on every rollout"
            )
    ids = list(by_id)
    names = {g: k for k, g in enumerate(dict.fromkeys(by_id[i][0] for i in ids))}
    per_rollout = _native.grpo(
        [by_id[i][1] for i in ids],
        [names[by_id[i][0]] for i in ids],
        float(eps) if scale == "std" else None,
    )
    adv_of = dict(zip(ids, per_rollout))
    out = []
    for p in plist:
        per = torch.tensor([adv_of[rid] for rid in p.rollout_ids], dtype=torch.float64)
        out.append(per[p.loss_rollout_local()].to(dtype))
    return out[0] if single else out


def _same(a: float, b: float) -> bool:
    return a == b or (a != a and b != b)




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
