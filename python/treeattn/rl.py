"""Reinforcement learning on packs: advantages (GAE across compactions,
GRPO) over a pack's targets.

A pack's loss entries are its targets in generation order (sorted by rollout,
call, offset); ``Pack.loss_segment`` numbers each target's segment in its
rollout (0 from the first call, +1 at every junction: a compaction, an
eviction); ``Pack.rollout_reward`` / ``Pack.rollout_group`` carry the
rollouts' ``"reward"`` and ``"group"`` input fields. The arithmetic runs in
the Rust crate (``treeattn::rl``) in float64; these functions map a pack's
tensors onto it.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from . import _native

__all__ = ["gae", "grpo_advantages"]


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
