"""Reinforcement learning on packs: advantages (GAE across compactions,
GRPO, whitening) and the PPO objectives over a pack's targets, with the
conventions of verl (and where they differ, TRL / OpenRLHF) spelled out.

A pack's loss entries are its targets in generation order (sorted by rollout,
call, offset); ``Pack.loss_segment`` numbers each target's segment in its
rollout (0 from the first call, +1 at every junction: a compaction, an
eviction); ``Pack.rollout_reward`` / ``Pack.rollout_group`` carry the
rollouts' ``"reward"`` and ``"group"`` input fields, ``Pack.loss_reward``
the per-token ``"rewards"``, ``Pack.rollout_truncated`` ``"truncated"`` and
``Pack.loss_summary`` the calls marked ``"summary"``. The advantages'
arithmetic runs in the Rust crate (``treeattn::rl``) in float64; these
functions map a pack's tensors onto it.

The losses work on per-target tensors in a pack's loss order (``[T]``,
one entry per loss entry, as :func:`treeattn.hf.target_logprobs` returns
them), so a loss computed on a pack is the loss of every target scored under
its exact live prefix. They aggregate as verl's ``loss_agg_mode`` does, with
a ``normalizer`` that makes the per-pack losses of a batch add up to the
batch loss (see :func:`policy_loss`).

Errors are ``ValueError`` naming the argument: a non-tensor, wrong shape or
dtype, NaN / ±inf entries, negative weights, a bad clip range or normalizer,
a rollout without a reward.
"""

from __future__ import annotations

import math
import reprlib
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from . import _native

__all__ = ["gae", "end_rows", "grpo_advantages", "whiten", "policy_loss", "value_loss"]


def _f64(data: bytes) -> Tensor:
    if not data:
        return torch.empty(0, dtype=torch.float64)
    return torch.frombuffer(bytearray(data), dtype=torch.float64).clone()


def _shown(ids: Sequence[Any]) -> str:
    return ", ".join(repr(i) for i in ids[:5]) + (" ..." if len(ids) > 5 else "")


def _rollout_rewards(pack: Any, token: Optional[Tensor]) -> Tuple[Tensor, Optional[Tensor]]:
    """``(R, ρ)``: ``R`` ``[R]`` float64, each rollout's scalar reward (0
    where it has none but has per-token rewards), ``ρ`` ``[T]`` float64, the
    per-token rewards (``token`` if given, else the pack's ``loss_reward``
    with 0 where a rollout has none; ``None`` where there are none at all).
    ValueError naming the rollouts with neither."""
    local = pack.loss_rollout_local()
    reward = pack.rollout_reward.to(torch.float64).clone()
    if token is None and getattr(pack, "loss_reward", None) is not None:
        lr = pack.loss_reward.to(torch.float64)
        if not bool(torch.isnan(lr).all()):
            token = torch.nan_to_num(lr, nan=0.0)
            has = torch.zeros(reward.shape[0], dtype=torch.bool)
            has[local[~torch.isnan(lr)]] = True
        else:
            has = torch.zeros(reward.shape[0], dtype=torch.bool)
    else:
        has = torch.full((reward.shape[0],), token is not None, dtype=torch.bool)
    present = torch.zeros(reward.shape[0], dtype=torch.bool)
    present[local] = True
    missing = torch.isnan(reward) & ~has & present
    if bool(missing.any()):
        ids = [pack.rollout_ids[i] for i in torch.nonzero(missing).flatten().tolist()]
        raise ValueError(
            f"{len(ids)} rollout(s) of the pack have no reward ({_shown(ids)}): "
            'give each rollout a finite "reward" (or per-token "rewards") in the input'
        )
    return torch.nan_to_num(reward, nan=0.0), token


def end_rows(pack: Any) -> Tensor:
    """``[R]`` int64: for each rollout of the pack (``rollout_indices``
    order), the row of its last sampled token, where a critic's value is
    ``V(s_n)``, the value after the rollout's last target: the bootstrap
    value of a truncated rollout (:func:`gae`'s ``bootstrap``).

    The row is the child of the last target's loss row ``r`` that holds its
    label: the row ``c`` with ``r < c < kv_end[r]``, ``position_ids[c] =
    position_ids[r] + 1`` and ``tokens[c] = label`` (one in every exact
    layout: the trie has one child per token, a replicated branch is a
    chain).

    For a :func:`treeattn.collate` batch: ``[R]`` over the batch's
    rollouts (``rollout_batch`` order), each row within its own pack
    (``rollout_batch`` names it), as ``loss_rows`` are: the critic's value
    there is ``V[rollout_batch, end_rows]`` of a ``[B, L]`` output."""
    if isinstance(pack, dict):
        from .batch import unbatch

        packs = unbatch(pack)
        rb = pack["rollout_batch"]
        out = torch.full((int(rb.shape[0]),), -1, dtype=torch.int64)
        for b, p in enumerate(packs):
            out[torch.nonzero(rb == b).flatten()] = end_rows(p)
        return out
    _check_pack("end_rows", pack, _END_FIELDS)
    L = int(pack.tokens.shape[0])
    for name in ("position_ids", "kv_end"):
        if getattr(pack, name).shape != (L,):
            raise ValueError(f"end_rows: pack.{name} has shape {tuple(getattr(pack, name).shape)}, expected [{L}]")
    T = int(pack.loss_rows.shape[0])
    if pack.loss_labels.shape != (T,) or pack.loss_rollout.shape != (T,):
        raise ValueError(
            f"end_rows: pack has {T} loss_rows but loss_labels {tuple(pack.loss_labels.shape)} and "
            f"loss_rollout {tuple(pack.loss_rollout.shape)}"
        )
    if T and (int(pack.loss_rows.min()) < 0 or int(pack.loss_rows.max()) >= L):
        bad = (pack.loss_rows < 0) | (pack.loss_rows >= L)
        t = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"end_rows: pack.loss_rows[{t}] = {int(pack.loss_rows[t])} is outside the pack's rows 0..{L - 1}"
        )
    if L and (int(pack.kv_end.min()) < 0 or int(pack.kv_end.max()) > L):
        raise ValueError(f"end_rows: pack.kv_end holds values outside 0..{L}")
    local = pack.loss_rollout_local()
    n = len(pack.rollout_indices)
    out = torch.full((n,), -1, dtype=torch.int64)
    if local.numel():
        last = torch.zeros(n, dtype=torch.int64)
        last.scatter_reduce_(0, local, torch.arange(local.numel()), reduce="amax", include_self=False)
        for k in range(n):
            t = int(last[k])
            r = int(pack.loss_rows[t])
            end = int(pack.kv_end[r])
            pos = pack.position_ids[r + 1:end]
            tok = pack.tokens[r + 1:end]
            hit = torch.nonzero((pos == pack.position_ids[r] + 1) & (tok == pack.loss_labels[t])).flatten()
            if hit.numel() != 1:
                raise ValueError(
                    f"pack: no single row holds the last token of rollout {pack.rollout_ids[k]!r} "
                    f"({hit.numel()} candidates under row {r}): not a pack of an exact layout?"
                )
            out[k] = r + 1 + int(hit[0])
    return out


_GAE_FIELDS = ("loss_rows", "loss_rollout", "loss_segment", "loss_call", "rollout_reward",
               "rollout_indices", "rollout_ids", "loss_rollout_local")
_END_FIELDS = ("tokens", "position_ids", "kv_end", "loss_rows", "loss_labels", "loss_rollout",
               "rollout_indices", "rollout_ids", "loss_rollout_local")


def _check_pack(fn: str, pack: Any, fields: Sequence[str]) -> None:
    """ValueError unless ``pack`` is a :class:`treeattn.Pack` (or holds its
    fields: ``fields``, tensors where a Pack has tensors)."""
    missing = [f for f in fields if not hasattr(pack, f)]
    if missing:
        raise ValueError(
            f"{fn}: pack must be a treeattn.Pack or a treeattn.collate batch, got {type(pack).__name__} "
            f"(no {', '.join(missing)})"
        )
    for f in fields:
        x = getattr(pack, f)
        if f.startswith(("loss_", "rollout_reward", "tokens", "position_ids", "kv_end")) and f != "loss_rollout_local":
            if not isinstance(x, Tensor) or x.dim() != 1:
                raise ValueError(
                    f"{fn}: pack.{f} must be a 1-D tensor, got "
                    f"{tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__}"
                )
            _readable(f"pack.{f}", x)


def _lam(name: str, lam: Union[float, str, None]) -> Tuple[Optional[float], bool]:
    """(number or None, adaptive)."""
    if isinstance(lam, str):
        if lam != "adaptive":
            raise ValueError(f'{name} {lam!r}: expected a number in [0, 1] or "adaptive"')
        return None, True
    if lam is None:
        return None, False
    if isinstance(lam, bool) or not isinstance(lam, (int, float)):
        raise ValueError(f'{name} must be a number in [0, 1] or "adaptive", got {lam!r}')
    return float(lam), False


def gae(
    pack: Any,
    values: Tensor,
    *,
    gamma: float = 1.0,
    lam: Union[float, str] = 0.95,
    alpha: float = 1.5,
    mode: str = "exact",
    segments: str = "summary",
    critic_lam: Union[float, str, None] = None,
    rewards: Optional[Tensor] = None,
    bootstrap: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """Generalized advantage estimation over a pack's targets.

    ``values`` ``[T]``: the critic's value ``V_t`` at each loss entry's row
    (``pack.loss_rows``), i.e. under that target's own live prefix. A
    rollout's targets ``t = 0 … n−1`` (generation order) get the rewards
    ``r_t = ρ_t + [t = n−1]·R``: the per-token reward ``ρ_t`` (the input's
    ``"rewards"``, or ``rewards`` ``[T]`` if given, which replaces them; 0
    without) plus the rollout's scalar ``"reward"`` ``R`` (0 without, if it
    has per-token rewards) at its last target. After the last target comes
    ``V_n = 0`` — or, for a rollout marked ``"truncated": true`` (cut off by
    a length limit, not finished), ``V_n = bootstrap[k]``, the critic's
    value after its last token (at the row :func:`end_rows` gives). Returns
    ``(advantages, returns)``, both ``[T]`` in ``values``' dtype and device,
    computed in float64; no gradient flows.

    ``mode``:

    - ``"exact"``: ``δ_t = r_t + γ V_{t+1} − V_t``,
      ``A_t = Σ_l (γλ)^l δ_{t+l}`` over the whole rollout, across its
      segments (one reverse scan: the pack holds every segment at once).
    - ``"segment"``: each segment alone, as if the rollout ended at its last
      target (``R`` added there, then ``V_n``).
    - ``"compaction"``: CompactionRL's eq. 9 (arXiv 2607.05378): the
      ``"segment"`` advantage of segment ``s`` times ``(γλ)^{N>s}``, ``N>s``
      = the rollout's targets in later segments.

    ``segments`` (the two segment modes): ``"summary"`` (default,
    CompactionRL's): a new segment at every junction and around every call
    marked ``"summary": true`` (a summary call is a segment of its own);
    ``"junction"``: at junctions only (``pack.loss_segment``). They differ
    only where calls are marked.

    ``lam="adaptive"``: VAPO's ``λ = 1 − 1/(alpha · n)`` per rollout, with
    ``n`` read as the rollout's number of targets, clamped to ``[0, 1]``.
    ``critic_lam``: the ``λ`` of the returns (a number or ``"adaptive"``;
    VAPO's decoupled GAE uses 1.0): ``returns = A(critic_lam) + V``, the
    advantages with ``lam``; default ``None``: ``returns = A + V``.

    Unlike verl's GAE estimator this does not whiten the advantages: call
    :func:`whiten` over the batch for that.

    Raises ``ValueError`` for ``values`` / ``rewards`` / ``bootstrap`` of the
    wrong shape or not finite, a rollout with no reward (naming it), a
    truncated rollout without ``bootstrap``, ``gamma`` / ``lam`` /
    ``critic_lam`` outside ``[0, 1]``, an unknown ``mode`` or ``segments``.
    """
    if isinstance(pack, dict):
        return _gae_batch(pack, values, gamma=gamma, lam=lam, alpha=alpha, mode=mode, segments=segments,
                          critic_lam=critic_lam, rewards=rewards, bootstrap=bootstrap)
    _check_pack("gae", pack, _GAE_FIELDS)
    if not isinstance(values, Tensor):
        raise ValueError(f"values must be a torch.Tensor, got {type(values).__name__}")
    _readable("values", values)
    t = pack.loss_rows.numel()
    if values.dim() != 1 or values.shape[0] != t:
        raise ValueError(
            f"values has shape {tuple(values.shape)}, expected [{t}] (one per loss entry of the pack)"
        )
    if not values.dtype.is_floating_point:
        raise ValueError(f"values must be floating point, got {values.dtype}")
    for name, x in (("gamma", gamma), ("alpha", alpha)):
        if isinstance(x, bool) or not isinstance(x, (int, float)):
            raise ValueError(f"{name} must be a number, got {reprlib.repr(x)}")
    if mode not in ("exact", "segment", "compaction"):
        raise ValueError(f'mode {mode!r}: expected "exact", "segment" or "compaction"')
    if segments not in ("summary", "junction"):
        raise ValueError(f'segments {segments!r}: expected "summary" or "junction"')
    lam_value, lam_adaptive = _lam("lam", lam)
    if lam_value is None and not lam_adaptive:
        raise ValueError('lam must be a number in [0, 1] or "adaptive", got None')
    critic_value, critic_adaptive = _lam("critic_lam", critic_lam)
    token = None if rewards is None else _vector("rewards", rewards, t).detach().to("cpu", torch.float64)
    outcome, token = _rollout_rewards(pack, token)
    local = pack.loss_rollout_local()
    truncated = getattr(pack, "rollout_truncated", None)
    boot = None
    if truncated is not None and bool(truncated.any()):
        n = len(pack.rollout_indices)
        if bootstrap is None:
            ids = [pack.rollout_ids[i] for i in torch.nonzero(truncated).flatten().tolist()]
            raise ValueError(
                f"bootstrap: {len(ids)} rollout(s) of the pack are truncated ({_shown(ids)}): pass "
                f"bootstrap [{n}], the critic's value after each rollout's last token (rows: rl.end_rows(pack))"
            )
        b = _vector("bootstrap", bootstrap, n).detach().to("cpu", torch.float64)
        boot = torch.where(truncated, b, torch.zeros_like(b))[local]
    segment = pack.loss_segment
    summary = getattr(pack, "loss_summary", None)
    if mode != "exact" and segments == "summary" and summary is not None and bool(summary.any()):
        segment = torch.tensor(
            _native.summary_segments_of(
                pack.loss_rollout.tolist(), pack.loss_segment.tolist(),
                pack.loss_call.tolist(), summary.tolist(),
            ),
            dtype=torch.int64,
        )
    v = values.detach().to("cpu", torch.float64)
    adv, ret = _native.gae(
        pack.loss_rollout.tolist(),
        segment.tolist(),
        v.tolist(),
        outcome[local].tolist(),
        None if token is None else token.tolist(),
        None if boot is None else boot.tolist(),
        float(gamma),
        lam_value,
        float(alpha),
        critic_value,
        critic_adaptive,
        mode,
    )
    out = (_f64(adv), _f64(ret))
    return tuple(x.to(values.device, values.dtype) for x in out)  # type: ignore[return-value]


def _gae_batch(batch: Dict[str, Any], values: Any, *, rewards: Any, bootstrap: Any, **kw: Any) -> Tuple[Tensor, Tensor]:
    """:func:`gae` of a :func:`treeattn.collate` batch: each pack's
    :func:`gae` on its entries (``loss_batch``) and rollouts
    (``rollout_batch``), put back in the batch's order."""
    from .batch import unbatch

    packs = unbatch(batch)
    lb, rb = batch["loss_batch"], batch["rollout_batch"]
    T, R = int(lb.shape[0]), int(rb.shape[0])
    if not isinstance(values, Tensor):
        raise ValueError(f"values must be a torch.Tensor, got {type(values).__name__}")
    _readable("values", values)
    if values.dim() != 1 or values.shape[0] != T:
        raise ValueError(
            f"values has shape {tuple(values.shape)}, expected [{T}] (one per loss entry of the batch)"
        )
    if rewards is not None:
        rewards = _vector("rewards", rewards, T)
    if bootstrap is not None:
        if not isinstance(bootstrap, Tensor) or bootstrap.dim() != 1 or bootstrap.shape[0] != R:
            raise ValueError(
                f"bootstrap has {tuple(bootstrap.shape) if isinstance(bootstrap, Tensor) else type(bootstrap).__name__}"
                f", expected [{R}] (one per rollout of the batch, rollout_batch order)"
            )
    adv, ret = torch.empty_like(values), torch.empty_like(values)
    for b, p in enumerate(packs):
        sel = torch.nonzero(lb == b).flatten().to(values.device)
        rsel = torch.nonzero(rb == b).flatten()
        a, r = gae(
            p, values[sel], rewards=None if rewards is None else rewards[sel.to(rewards.device)],
            bootstrap=None if bootstrap is None else bootstrap[rsel.to(bootstrap.device)], **kw,
        )
        adv[sel], ret[sel] = a, r
    return adv.detach(), ret.detach()


Record = Tuple[str, Optional[str], float, Optional[int], str]


def _rollout_records(packs: Sequence[Any]) -> List[Record]:
    """(rollout id, group name or None, return, fingerprint or None, where)
    of every rollout of the packs: the return is ``R + Σ_t ρ_t`` (NaN where
    a rollout has neither); the fingerprint is ``rollout_fingerprint``'s
    (``None`` for a pack without it); ``where`` names the pack
    (``packs[i]``)."""
    out = []
    for j, p in enumerate(packs):
        _check_rollout_fields(j, p)
        reward = p.rollout_reward.to(torch.float64).clone()
        lr = getattr(p, "loss_reward", None)
        if lr is not None and lr.numel():
            lr = lr.to(torch.float64)
            local = p.loss_rollout_local()
            ok = ~torch.isnan(lr)
            tok = torch.zeros_like(reward).index_add_(0, local[ok], lr[ok])
            has = torch.zeros(reward.shape[0], dtype=torch.bool)
            has[local[ok]] = True
            reward = torch.where(has, torch.nan_to_num(reward, nan=0.0) + tok, reward)
        fps: List[Optional[int]] = [None] * len(p.rollout_ids)
        fp = getattr(p, "rollout_fingerprint", None)
        if fp is not None:
            if not isinstance(fp, Tensor) or fp.shape != (len(p.rollout_ids),) or fp.dtype != torch.int64:
                raise ValueError(
                    f"packs[{j}].rollout_fingerprint must be an int64 tensor [{len(p.rollout_ids)}] "
                    f"(one per rollout) or None, got "
                    f"{tuple(fp.shape) if isinstance(fp, Tensor) else type(fp).__name__}"
                    f"{' ' + str(fp.dtype) if isinstance(fp, Tensor) else ''}"
                )
            fps = [int(x) for x in fp.tolist()]
        for i, rid in enumerate(p.rollout_ids):
            g = int(p.rollout_group[i])
            out.append((rid, p.groups[g] if g >= 0 else None, float(reward[i]), fps[i], f"packs[{j}]"))
    return out


def _check_rollout_fields(j: int, p: Any) -> None:
    """ValueError naming ``packs[j]`` unless it holds the per-rollout
    fields GRPO reads, consistent with each other (a pack of
    :func:`treeattn.pack`, or one built or edited by hand)."""
    fields = ("rollout_ids", "groups", "rollout_reward", "rollout_group", "loss_rollout", "rollout_indices")
    missing = [f for f in fields if not hasattr(p, f)]
    if missing:
        raise ValueError(f"packs[{j}] must be a treeattn.Pack, got {type(p).__name__} (no {', '.join(missing)})")
    ids, groups = p.rollout_ids, p.groups
    if not isinstance(ids, (list, tuple)) or not all(isinstance(i, str) for i in ids):
        raise ValueError(f"packs[{j}].rollout_ids must be a list of strings, got {reprlib.repr(ids)}")
    if not isinstance(groups, (list, tuple)) or not all(isinstance(g, str) for g in groups):
        raise ValueError(f"packs[{j}].groups must be a list of strings, got {reprlib.repr(groups)}")
    R = len(ids)
    if not isinstance(p.rollout_indices, (list, tuple)) or len(p.rollout_indices) != R:
        raise ValueError(f"packs[{j}] has {R} rollout_ids but rollout_indices {reprlib.repr(p.rollout_indices)}")
    for name, want in (("rollout_reward", "float"), ("rollout_group", "int")):
        t = getattr(p, name)
        if (
            not isinstance(t, Tensor) or t.shape != (R,)
            or t.dtype.is_floating_point != (want == "float") or t.dtype == torch.bool or t.is_complex()
        ):
            raise ValueError(
                f"packs[{j}].{name} must be a 1-D {want} tensor with one entry per rollout [{R}], got "
                f"{(tuple(t.shape), t.dtype) if isinstance(t, Tensor) else type(t).__name__}"
            )
    g = p.rollout_group
    if R and (int(g.min()) < -1 or int(g.max()) >= len(groups)):
        raise ValueError(
            f"packs[{j}].rollout_group holds {int(g.min())}..{int(g.max())}: expected -1 (no group) or "
            f"an index into its {len(groups)} groups"
        )
    lr = getattr(p, "loss_reward", None)
    T = p.loss_rollout.shape[0] if isinstance(p.loss_rollout, Tensor) else -1
    if lr is not None and (not isinstance(lr, Tensor) or lr.shape != (T,) or not lr.dtype.is_floating_point):
        raise ValueError(
            f"packs[{j}].loss_reward must be None or a float tensor with one entry per target [{T}], got "
            f"{(tuple(lr.shape), lr.dtype) if isinstance(lr, Tensor) else type(lr).__name__}"
        )


def _merge_records(everyone: Sequence[Record]) -> Dict[str, Tuple[Optional[str], float, Optional[int], str]]:
    """One entry per rollout id: the same rollout given twice (same calls,
    group and reward) counts once; one id on two different rollouts is a
    ``ValueError`` naming it. A record without a fingerprint matches any
    calls (only group and reward are compared)."""
    by_id: Dict[str, Tuple[Optional[str], float, Optional[int], str]] = {}
    for rid, g, r, fp, where in everyone:
        if rid not in by_id:
            by_id[rid] = (g, r, fp, where)
            continue
        g0, r0, fp0, where0 = by_id[rid]
        if fp is not None and fp0 is not None and fp != fp0:
            raise ValueError(
                f"rollout id {rid!r} names two different rollouts (their calls differ: "
                f"rollout_fingerprint {fp0} in {where0}, {fp} in {where}): "
                "give every rollout of the batch its own id"
            )
        if g0 != g or not _same(r0, r):
            raise ValueError(
                f"rollout {rid!r} appears twice with different group or reward: "
                f"{(g0, r0)} in {where0} and {(g, r)} in {where}"
            )
        if fp0 is None:
            by_id[rid] = (g, r, fp, where)
    return by_id


def grpo_advantages(
    packs: Union[Any, Sequence[Any]],
    *,
    scale: str = "std",
    std: str = "sample",
    eps: float = 1e-6,
    dtype: torch.dtype = torch.float32,
    distributed: bool = False,
    process_group: Any = None,
) -> Union[Tensor, List[Tensor]]:
    """GRPO advantages, broadcast to every target of a rollout.

    For a rollout with return ``R`` (its ``"reward"`` plus the sum of its
    per-token ``"rewards"``, as verl sums ``token_level_rewards``) in group
    ``g`` (the input's ``"group"``: rollouts answering the same prompt):
    ``(R − mean_g) / (std_g + eps)`` (``scale="std"``) or ``R − mean_g``
    (``scale="none"``, Dr. GRPO). ``std``:

    - ``"sample"`` (default): the group's Bessel-corrected std
      ``sqrt(Σ (R − mean_g)² / (G − 1))``, ``torch.std`` — verl's
      ``compute_grpo_outcome_advantage``, TRL's ``scale_rewards="group"``,
      OpenRLHF;
    - ``"population"``: ``sqrt(Σ (R − mean_g)² / G)``, which is
      ``sqrt((G − 1)/G)`` times the sample std (advantages ``sqrt(G/(G−1))``
      larger);
    - ``"batch"``: the sample std of every rollout's ``R`` in the batch
      (all groups, all packs, all ranks with ``distributed``), TRL's
      ``scale_rewards="batch"``; 1 for a batch of one rollout.

    A group of one is treated as verl treats it: mean 0 and std 1, so its
    advantage is ``R / (1 + eps)`` (``R`` unscaled; with ``std="batch"`` it
    is divided by the batch std like the others). A group of two or more
    with equal returns has no learning signal: exactly 0 (verl: ``0 / eps``
    up to the rounding of its mean). Never NaN or infinite, also with
    ``eps=0`` (an advantage whose divisor is 0 is 0). ``eps`` defaults to
    verl's 1e-6 (TRL adds 1e-4).

    ``packs``: one pack (returns a ``[T]`` tensor) or a list of packs
    (returns one ``[T_i]`` tensor per pack); groups are matched by name
    across the packs, so a group may span packs. Rollouts are matched by
    id: the same rollout in two packs (same id, calls, group and reward,
    e.g. one pack split over context-parallel ranks) counts once, and one id
    on two different rollouts (their ``rollout_fingerprint`` differs:
    separately packed files that reuse ids) is refused — it would merge
    them into one. A pack without ``rollout_fingerprint`` (``None``: built
    from a pack file of an earlier version) cannot tell: its rollouts are
    matched by id, group and reward alone. ``distributed=True``: the
    statistics are over the rollouts of every rank of ``process_group``
    (default: the world), gathered with ``all_gather_object`` (one
    ``(id, group, return, fingerprint)`` record per rollout; the same
    rollout held by several ranks counts once). Every rank of the group
    must call it. ``dtype``: a float dtype of the result.

    Raises ``ValueError`` for a rollout without a reward or a group (naming
    it), a rollout id seen twice with different calls, reward or group
    (naming it and the packs, and with ``distributed`` the ranks), a bad
    ``scale``, ``std``, ``eps`` or ``dtype``, a ``rollout_fingerprint`` that
    is not ``[R]`` int64.
    """
    single = not isinstance(packs, (list, tuple))
    given = [packs] if single else list(packs)
    plist: List[Any] = []
    spans: List[Tuple[int, int, Optional[Dict[str, Any]]]] = []
    for x in given:
        if isinstance(x, dict):
            from .batch import unbatch

            parts = unbatch(x)
            spans.append((len(plist), len(plist) + len(parts), x))
            plist += parts
        else:
            spans.append((len(plist), len(plist) + 1, None))
            plist.append(x)
    if scale not in ("std", "none"):
        raise ValueError(f'scale {reprlib.repr(scale)}: expected "std" or "none"')
    if std not in ("sample", "population", "batch"):
        raise ValueError(f'std {reprlib.repr(std)}: expected "sample", "population" or "batch"')
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point torch dtype (advantages are fractions), got {reprlib.repr(dtype)}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps = {reprlib.repr(eps)}: must be finite and non-negative")
    records = _rollout_records(plist)
    if distributed:
        import torch.distributed as dist

        gathered: List[Any] = [None] * dist.get_world_size(process_group)
        dist.all_gather_object(gathered, records, group=process_group)
        everyone = [(*r[:4], f"rank {k} {r[4]}") for k, part in enumerate(gathered) for r in part]
    else:
        everyone = records
    by_id = _merge_records(everyone)
    no_group = [rid for rid, (g, *_) in by_id.items() if g is None]
    no_reward = [rid for rid, (_, r, *_) in by_id.items() if r != r]
    for what, ids, field in (("group", no_group, '"group"'), ("reward", no_reward, '"reward"')):
        if ids:
            raise ValueError(
                f"{len(ids)} rollout(s) have no {what} ({_shown(ids)}): GRPO needs a {field} on every rollout"
            )
    ids = list(by_id)
    names = {g: k for k, g in enumerate(dict.fromkeys(by_id[i][0] for i in ids))}
    per_rollout = _native.grpo(
        [by_id[i][1] for i in ids],
        [names[by_id[i][0]] for i in ids],
        float(eps) if scale == "std" else None,
        std,
    )
    adv_of = dict(zip(ids, per_rollout))
    each = []
    for p in plist:
        per = torch.tensor([adv_of[rid] for rid in p.rollout_ids], dtype=torch.float64)
        each.append(per[p.loss_rollout_local()].to(dtype))
    out = []
    for lo, hi, batch in spans:
        if batch is None:
            out.append(each[lo])
            continue
        lb = batch["loss_batch"]
        merged = torch.empty(int(lb.shape[0]), dtype=dtype)
        for b in range(hi - lo):
            merged[torch.nonzero(lb == b).flatten()] = each[lo + b]
        out.append(merged)
    return out[0] if single else out


def _same(a: float, b: float) -> bool:
    return a == b or (a != a and b != b)


def whiten(
    advantages_list: Union[Tensor, Sequence[Tensor]],
    weights_list: Union[Tensor, Sequence[Optional[Tensor]], None] = None,
    *,
    distributed: bool = False,
    process_group: Any = None,
    shift_mean: bool = True,
) -> Union[Tensor, List[Tensor]]:
    """verl's ``masked_whiten`` over a whole batch of packs (and ranks).

    With weights ``w`` (a pack's ``loss_weights``; verl's ``response_mask``
    is the 0/1 case) over every entry of every tensor given (and of every
    rank of ``process_group`` with ``distributed=True``, one
    ``all_reduce`` for ``Σ w, Σ w·a`` and one for ``Σ w·(a − μ)²``, in
    float64):

    ``μ = Σ w a / Σ w``, ``σ² = Σ w (a − μ)² / (Σ w − 1)`` (verl's
    ``masked_var`` with Bessel's correction ``Σw / (Σw − 1)``),
    ``a' = (a − μ) / sqrt(σ² + 1e-8)``, plus ``μ`` again with
    ``shift_mean=False``. Every entry is whitened, also those of weight 0
    (as verl; they carry no loss).

    ``advantages_list``: a ``[T]`` tensor or a list of them;
    ``weights_list`` the same shape (default ones). Returns the same
    structure, detached, each in its input's dtype and device. Under
    context parallelism pass the data-parallel ``process_group`` (or weight
    0 for the copies): an entry held by two ranks would count twice.

    Raises ``ValueError`` for tensors of the wrong shape, dtype or not
    finite, negative weights, or a total weight ``Σ w <= 1`` (the sample
    variance needs more).
    """
    single = isinstance(advantages_list, Tensor)
    if not single and not isinstance(advantages_list, (list, tuple)):
        raise ValueError(
            f"advantages_list must be a [T] tensor or a list of them, got {type(advantages_list).__name__}"
        )
    advs = [advantages_list] if single else list(advantages_list)
    if weights_list is None:
        ws: List[Optional[Tensor]] = [None] * len(advs)
    elif not isinstance(weights_list, (Tensor, list, tuple)):
        raise ValueError(
            f"weights_list must be None, a [T] tensor or a list of them, got {type(weights_list).__name__}"
        )
    elif isinstance(weights_list, Tensor):
        if not single:
            raise ValueError("weights_list is one tensor but advantages_list a list: give a list of the same length")
        ws = [weights_list]
    else:
        ws = list(weights_list)
        if single or len(ws) != len(advs):
            raise ValueError(
                f"weights_list has {len(ws)} entries for {1 if single else len(advs)} advantage tensors"
            )
    for i, a in enumerate(advs):
        _vector(f"advantages_list[{i}]", a)
    wd = []
    for i, (a, w) in enumerate(zip(advs, ws)):
        if w is None:
            wd.append(torch.ones(a.shape[0], dtype=torch.float64, device=a.device))
            continue
        w = _vector(f"weights_list[{i}]", w, a.shape[0]).detach()
        if bool((w < 0).any()):
            j = int((w < 0).nonzero()[0, 0])
            raise ValueError(f"weights_list[{i}][{j}] = {float(w[j])} is negative")
        wd.append(w.to(a.device, torch.float64))
    ad = [a.detach().to(torch.float64) for a in advs]
    dev = ad[0].device if ad else torch.device("cpu")
    first = torch.zeros(2, dtype=torch.float64, device=dev)
    for a, w in zip(ad, wd):
        first += torch.stack([w.sum(), (w * a).sum()]).to(dev)
    if distributed:
        import torch.distributed as dist

        dist.all_reduce(first, group=process_group)
    total = float(first[0])
    if not total > 1:
        raise ValueError(
            f"weights_list: the total weight is {total}; whitening needs more than 1 "
            "(the Bessel-corrected variance divides by Σw − 1)"
        )
    mean = first[1] / first[0]
    second = torch.zeros(1, dtype=torch.float64, device=dev)
    for a, w in zip(ad, wd):
        second += (w * (a - mean.to(a.device)) ** 2).sum().to(dev)
    if distributed:
        dist.all_reduce(second, group=process_group)
    var = second[0] / (first[0] - 1)
    inv = torch.rsqrt(var + 1e-8)
    out = []
    for a, src in zip(ad, advs):
        m, s = mean.to(a.device), inv.to(a.device)
        x = (a - m) * s
        if not shift_mean:
            x = x + m
        out.append(x.to(src.dtype))
    return out[0] if single else out


# --------------------------------------------------------------------------
# helpers


def _vector(name: str, x: Any, n: Optional[int] = None, like: Optional[Tensor] = None) -> Tensor:
    """A finite 1-D floating tensor (``[n]`` when given), on ``like``'s
    device and in its dtype when given."""
    if not isinstance(x, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    _readable(name, x)
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


def _readable(name: str, x: Tensor) -> None:
    """ValueError unless ``x`` is a dense (strided) tensor with data: a
    sparse tensor (no ``isfinite`` / indexing by entry) or one on the meta
    device (shapes only) cannot be read here."""
    if x.layout != torch.strided:
        raise ValueError(f"{name} has layout {x.layout}: expected a dense tensor (call .to_dense())")
    if x.device.type == "meta":
        raise ValueError(f"{name} is on the meta device (no data): give its values on the CPU or a GPU")


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
        _readable("normalizer", normalizer)
        if normalizer.is_complex() or normalizer.dtype == torch.bool:
            raise ValueError(f"normalizer must be a real number, got a {normalizer.dtype} tensor")
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


_AGG = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
_KL = ("k1", "k2", "k3", "low_var_kl")


def _logp_arg(name: str, x: Any, T: int, like: Tensor) -> Tensor:
    """A ``[T]`` log-prob tensor, or a pack's ``loss_logprobs`` (refused
    when some are missing), detached, on ``like``'s device and dtype."""
    if isinstance(x, dict) or (hasattr(x, "loss_logprobs") and not isinstance(x, Tensor)):
        pack_lp = x.get("loss_logprobs") if isinstance(x, dict) else x.loss_logprobs
        if pack_lp is None or pack_lp.shape != (T,):
            raise ValueError(
                f"{name} is a pack with {None if pack_lp is None else tuple(pack_lp.shape)} "
                f"loss_logprobs, expected [{T}] (one per target of logp)"
            )
        missing = int(torch.isnan(pack_lp).sum())
        if missing:
            raise ValueError(
                f"{name}: the pack lacks rollout log-probs for {missing} of its {T} targets "
                "(loss_logprobs is NaN where a call logged none): log them, or recompute them and pass a tensor"
            )
        x = pack_lp.to(like.device)
    return _vector(name, x, T, like).detach()


def _sequences(pack: Any, agg_sequence: str, T: int) -> Tensor:
    """``[T]`` int64: each target's sequence (its rollout or its call) as
    an index ``0 … S−1``, from a pack or a collated batch (whose
    ``loss_batch`` keeps the packs' sequences apart)."""
    name = "loss_rollout" if agg_sequence == "rollout" else "loss_call"

    def get(key: str) -> Any:
        return pack.get(key) if isinstance(pack, dict) else getattr(pack, key, None)

    ids = get(name)
    if not isinstance(ids, Tensor):
        raise ValueError(f"pack must be a treeattn.Pack or a collated batch with {name}, got {type(pack).__name__}")
    if ids.shape != (T,):
        raise ValueError(f"pack has {tuple(ids.shape)} {name}, expected [{T}] (one per target of logp)")
    ids = ids.to("cpu", torch.int64)
    batch = get("loss_batch")
    if isinstance(batch, Tensor) and batch.shape == (T,) and T:
        ids = batch.to("cpu", torch.int64) * (int(ids.max()) + 1) + ids
    return torch.unique(ids, return_inverse=True)[1]


def _aggregate(x: Tensor, w: Tensor, agg: str, seq: Optional[Tensor], normalizer: Any) -> Tensor:
    """verl's ``agg_loss`` with weights and a normalizer (see policy_loss)."""
    if agg in ("token-mean", "seq-mean-token-sum-norm"):
        return (w * x).sum() / _normalizer(normalizer, w)
    assert seq is not None
    n = int(seq.max()) + 1 if seq.numel() else 0
    s = seq.to(x.device)
    tok_sum = torch.zeros(n, dtype=x.dtype, device=x.device).index_add(0, s, w * x)
    if agg == "seq-mean-token-mean":
        wsum = torch.zeros(n, dtype=w.dtype, device=w.device).index_add(0, s, w)
        tok_sum = torch.where(wsum > 0, tok_sum / wsum.clamp_min(torch.finfo(w.dtype).tiny), torch.zeros_like(tok_sum))
    if normalizer is None:
        norm = torch.tensor(float(max(n, 1)), dtype=x.dtype, device=x.device)
    else:
        norm = _normalizer(normalizer, w)
    return tok_sum.sum() / norm


def _kl_estimate(logp: Tensor, ref: Tensor, estimator: str, clamp: Optional[float]) -> Tensor:
    """Per-target KL(π ‖ π_ref) estimate, differentiable in ``logp``."""
    if estimator == "k1":
        return logp - ref
    if estimator == "k2":
        return 0.5 * (logp - ref) ** 2
    u = ref - logp
    if clamp is not None:
        u = torch.clamp(u, -clamp, clamp)
    k3 = torch.exp(u) - u - 1.0
    return torch.clamp(k3, -10.0, 10.0) if estimator == "low_var_kl" else k3


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
    rollout_logp: Any = None,
    tis_cap: Optional[float] = None,
    ref_logp: Optional[Tensor] = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    log_ratio_clamp: Optional[float] = 20.0,
    agg: str = "token-mean",
    agg_sequence: str = "rollout",
    pack: Any = None,
) -> Tuple[Tensor, Dict[str, Tensor]]:
    """PPO clipped surrogate with verl's options, per target then aggregated.

    Per target t (``w_t`` its weight; no gradient flows through anything
    but ``logp``):

    - ``d_t = clamp(logp_t − old_logp_t, ±log_ratio_clamp)`` (verl clamps
      the log-ratio to ±20 before ``exp``; ``None``: no clamp), ``ρ_t =
      exp(d_t)``;
    - ``ℓ_t = −min(ρ_t A_t, clip(ρ_t, 1 − clip_low, 1 + clip_high) A_t)``;
      with ``dual_clip`` c (> 1, verl's ``clip_ratio_c``), for ``A_t < 0``:
      ``ℓ_t = min(ℓ_t, −c·A_t)``;
    - with ``tis_cap`` C: truncated importance sampling against the rollout
      engine's log-probs (verl's ``tis_imp_ratio_cap``, slime's
      ``--use-tis``): ``ℓ_t ← min(exp(old_logp_t − rollout_logp_t), C) ·
      ℓ_t``, the weight without gradient, on the policy term only;
    - with ``ref_logp``: a KL-to-reference estimate ``k_t`` of
      ``KL(π ‖ π_ref)``, gradient through ``logp``, ``u = clamp(ref_logp −
      logp, ±log_ratio_clamp)``: ``"k1"``: ``logp − ref_logp``; ``"k2"``:
      ``½ (logp − ref_logp)²``; ``"k3"`` (Schulman's, slime's):
      ``exp(u) − u − 1``; ``"low_var_kl"``: k3 clamped to ``[−10, 10]``
      (verl's ``low_var_kl``, which verl also runs for ``"k3"``). The loss
      gets ``kl_coef · k_t`` (verl's ``use_kl_loss``; ``kl_coef=0``: the
      estimate is a statistic only).

    Then ``L = agg(ℓ + kl_coef·k)`` (verl's ``loss_agg_mode``, the KL term
    aggregated like the policy term as verl does), a *sequence* ``s`` being
    a rollout (``agg_sequence="rollout"``, default: verl's response is the
    whole multi-turn trajectory) or a call (``"call"``: one model call, as
    trainers that treat each call as a sample), read from ``pack``'s
    ``loss_rollout`` / ``loss_call`` (a pack or a collated batch):

    - ``"token-mean"``: ``Σ_t w_t ℓ_t / N``, ``N`` default ``Σ w``;
    - ``"seq-mean-token-sum"``: ``Σ_s Σ_{t∈s} w_t ℓ_t / N``, ``N`` default
      the number of sequences;
    - ``"seq-mean-token-mean"``: ``Σ_s (Σ_{t∈s} w_t ℓ_t / Σ_{t∈s} w_t) / N``
      (a sequence of weight 0 adds 0), ``N`` default the number of sequences;
    - ``"seq-mean-token-sum-norm"``: ``Σ_t w_t ℓ_t / N`` with ``N`` a
      constant that must be given (verl divides by the padded response
      length; Dr. GRPO by a fixed ``MAX_TOKENS``): no default on a tree.

    The ``seq-mean-token-sum`` / ``-token-mean`` modes need ``pack=`` (the
    tensors are then its ``T`` entries; a sequence must lie within one
    pack, which every rollout does). ``normalizer``: for a loss over a batch
    of packs (and ranks), pass the batch's ``N`` — ``Σ w`` over all packs
    for token-mean (``treeattn.distributed.global_weight``), the batch's
    number of sequences for the two seq-mean modes (``Σ len(p.rollout_ids)``
    for rollouts, ``Σ p.loss_call.unique().numel()`` for calls), the same
    constant for seq-mean-token-sum-norm — and the per-pack losses add up
    to the batch loss, their gradients to its gradient.

    ``logp`` ``[T]``: the current policy's log-probs; ``old_logp`` ``[T]``
    or a :class:`treeattn.Pack` (its ``loss_logprobs``; missing ones are
    refused, saying how many); ``rollout_logp`` likewise (needs
    ``tis_cap``); ``advantages`` ``[T]``; ``weights`` ``[T]`` non-negative
    (default ones; a pack's ``loss_weights``).

    Returns ``(loss, stats)``; stats detached, weighted means over targets
    unless said: ``clip_frac`` (the clipped term is taken: ``clip(ρ)A <
    ρA``), ``dual_clip_frac``, ``approx_kl`` (k3 of the ratio,
    ``(ρ − 1) − d``, an estimate of KL(π_old ‖ π)), ``ratio_mean``,
    ``log_ratio_clamp_frac`` (``|logp − old_logp| > log_ratio_clamp``),
    ``tis_mean`` (of the TIS weight; 1 without), ``tis_clip_frac``
    (``exp(old_logp − rollout_logp) > tis_cap``; 0 without), ``kl`` (of
    ``k``; 0 without ``ref_logp``), ``pg_loss`` and ``kl_loss`` (the two
    terms of ``loss``, aggregated as it is).
    """
    if not isinstance(logp, Tensor):
        raise ValueError(f"logp must be a torch.Tensor, got {type(logp).__name__}")
    logp = _vector("logp", logp)
    T = logp.shape[0]
    old = _logp_arg("old_logp", old_logp, T, logp)
    adv = _vector("advantages", advantages, T, logp).detach()
    w = _weights(weights, logp)
    lo = _number("clip_low", clip_low, 0.0)
    hi = _number("clip_high", clip_high, 0.0)
    if lo >= 1.0:
        raise ValueError(f"clip_low = {lo} must be < 1 (the ratio's lower bound 1 − clip_low must be positive)")
    c = None
    if dual_clip is not None:
        c = _number("dual_clip", dual_clip, 1.0, lo_open=True)
    clamp = None if log_ratio_clamp is None else _number("log_ratio_clamp", log_ratio_clamp, 0.0, lo_open=True)
    if agg not in _AGG:
        raise ValueError(f"agg {agg!r}: expected one of {', '.join(repr(a) for a in _AGG)}")
    if agg_sequence not in ("rollout", "call"):
        raise ValueError(f'agg_sequence {agg_sequence!r}: expected "rollout" or "call"')
    seq = None
    if agg in ("seq-mean-token-sum", "seq-mean-token-mean"):
        if pack is None:
            raise ValueError(
                f"pack: agg={agg!r} needs pack= (its loss_rollout / loss_call say which targets form a sequence)"
            )
        seq = _sequences(pack, agg_sequence, T)
    if agg == "seq-mean-token-sum-norm" and normalizer is None:
        raise ValueError(
            "normalizer: agg='seq-mean-token-sum-norm' divides by a constant that must be given "
            "(verl: the padded response length; Dr. GRPO: MAX_TOKENS)"
        )
    if normalizer is not None:
        _normalizer(normalizer, w)  # checked up front
    cap = None
    if tis_cap is not None:
        cap = _number("tis_cap", tis_cap, 0.0, lo_open=True)
        if rollout_logp is None:
            raise ValueError("rollout_logp: tis_cap needs the rollout engine's log-probs (a [T] tensor or a pack)")
        rlp = _logp_arg("rollout_logp", rollout_logp, T, logp)
    elif rollout_logp is not None:
        raise ValueError("rollout_logp is read only with tis_cap (truncated importance sampling): give tis_cap")
    kc = _number("kl_coef", kl_coef, 0.0)
    if kl_estimator not in _KL:
        raise ValueError(f"kl_estimator {kl_estimator!r}: expected one of {', '.join(repr(k) for k in _KL)}")
    ref = None
    if ref_logp is not None:
        ref = _vector("ref_logp", ref_logp, T, logp).detach()
    elif kc > 0:
        raise ValueError(f"ref_logp: kl_coef = {kc} needs the reference policy's log-probs [T]")

    raw = logp - old
    d = raw if clamp is None else torch.clamp(raw, -clamp, clamp)
    ratio = torch.exp(d)
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
    tis = torch.ones_like(w)
    tis_clipped = torch.zeros_like(clipped)
    if cap is not None:
        with torch.no_grad():
            behave = torch.exp(old - rlp)
            tis_clipped = behave > cap
            tis = torch.clamp(behave, max=cap)
        per = per * tis
    k = None if ref is None else _kl_estimate(logp, ref, kl_estimator, clamp)
    total = per if (k is None or kc == 0) else per + kc * k
    loss = _aggregate(total, w, agg, seq, normalizer)
    with torch.no_grad():
        r = ratio.detach()
        zero = torch.zeros((), dtype=w.dtype, device=w.device)
        pg_loss = _aggregate(per.detach(), w, agg, seq, normalizer)
        stats = {
            "clip_frac": _wmean(clipped.to(w.dtype), w),
            "dual_clip_frac": _wmean(dual.to(w.dtype), w),
            "approx_kl": _wmean((r - 1.0) - d.detach(), w),
            "ratio_mean": _wmean(r, w),
            "log_ratio_clamp_frac": zero if clamp is None else _wmean((raw.detach().abs() > clamp).to(w.dtype), w),
            "tis_mean": _wmean(tis, w) if cap is not None else torch.ones((), dtype=w.dtype, device=w.device),
            "tis_clip_frac": _wmean(tis_clipped.to(w.dtype), w),
            "kl": zero if k is None else _wmean(k.detach(), w),
            "pg_loss": pg_loss,
            "kl_loss": zero if (k is None or kc == 0) else kc * _aggregate(k.detach(), w, agg, seq, normalizer),
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
