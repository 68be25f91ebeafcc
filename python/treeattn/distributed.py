"""treeattn on many processes, over torch.distributed (NCCL on GPUs, gloo on
CPU); no transport of its own.

**Data parallel** — :func:`balance` packs rollouts into ``world_size`` lists
of packs, one per rank, all of the same length (the micro-steps), balanced
by the exact FLOPs of a training step (:func:`treeattn.cost`), not by token
counts; :func:`balance_report` says how well. :func:`global_weight`
all-reduces the loss weights of a step, so that every rank normalizes by the
same number and the summed loss (and gradient) is the single-process one::

    shards = balance(rollouts, world, budget=16384, model_cost=ModelCost.from_config(cfg))
    packs = shards[rank]
    G = global_weight(packs)                       # Σ w over every pack of every rank
    for p in packs:
        lp = treeattn.hf.target_logprobs(model, p)
        loss = -(p.loss_weights.double() * lp).sum() / G * world   # × world: DDP averages
        loss.backward()

**Context parallel** — :func:`shard` gives each rank a contiguous row range
of one pack (balanced by cost); :func:`tree_attention` runs the crate's op on
it: a rank's queries see its own rows and the keys of earlier ranks whose
subtree reaches into its range (``k < start`` with ``kv_end[k] > start``: in
a trie, the ancestors of its first row). Only those rows are exchanged
(``all_to_all_single`` with split sizes), and in backward their dK / dV go
back to their owners the same way. With Hugging Face, pass the shard to the
model call (``treeattn_shard=s``) and use :func:`treeattn.hf.shard_logprobs`.

No ``[L, L]`` or ``[L_local, L]`` tensor is built anywhere: the mask stays
``kv_end``.
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import Tensor

from . import ModelCost, Pack, _native, _pack_of, _rollout_source, cost as _cost
from . import torch as _tt

__all__ = [
    "balance",
    "balance_report",
    "empty_pack",
    "global_weight",
    "shard",
    "Shard",
    "CommStats",
    "tree_attention",
    "plan_comm",
    "sdcc_kl",
]


# --------------------------------------------------------------------------
# row costs


def visible_keys_per_query(kv_end: Tensor) -> Tensor:
    """``[L]`` int64: per query ``q``, the keys it sees, ``#{k <= q :
    kv_end[k] > q}`` (the crate's ``treeattn::cost::visible_keys_per_query``,
    O(L)). Their sum is the pack's visible pairs ``Σ_k (kv_end[k] − k)``."""
    return _tt._visible_keys(kv_end)


def _row_costs(p: Any, model_cost: ModelCost) -> Tensor:
    """FLOPs (forward + backward) of each row of a pack: its query's visible
    keys × attention per pair + linear per token + the lm_head where it is a
    loss row. Their sum is :func:`treeattn.cost`'s ``total``."""
    c = visible_keys_per_query(p.kv_end).to(torch.float64) * model_cost.attention_per_pair()
    c += model_cost.linear_per_token()
    if p.loss_rows.numel():
        rows = torch.unique(p.loss_rows)
        c[rows] += model_cost.logits_per_row()
    return c


def _fingerprint(kv_end: Tensor, position_ids: Tensor) -> int:
    """A 63-bit fingerprint of a pack's mask and positions (blake2b)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(kv_end.to(torch.int64).contiguous().numpy().tobytes())
    h.update(b"|")
    h.update(position_ids.to(torch.int64).contiguous().numpy().tobytes())
    return int.from_bytes(h.digest(), "little") >> 1


# --------------------------------------------------------------------------
# data parallel


def empty_pack(layout: str = "trie", pad_token: int = 0) -> Pack:
    """The pack of a rank with nothing to do in a micro-step: one padding
    token (``pad_token``, position 0, ``kv_end = [1]``: it sees itself, an
    ordinary row, so every kernel and model path runs as usual) and no loss
    entry. It goes through forward and backward like any pack (its loss is
    0 with a graph; its gradients are 0), so the collectives of DDP / FSDP
    and of context parallelism see every rank."""
    i64 = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    e = torch.empty(0, dtype=torch.int64)
    return Pack(
        tokens=i64([pad_token]),
        position_ids=i64([0]),
        kv_end=i64([1]),
        loss_rows=e.clone(),
        loss_labels=e.clone(),
        loss_weights=torch.empty(0, dtype=torch.float32),
        loss_call=e.clone(),
        loss_offset=e.clone(),
        loss_rollout=e.clone(),
        loss_segment=e.clone(),
        loss_logprobs=torch.empty(0, dtype=torch.float32),
        sdcc_student_rows=e.clone() if layout == "trie" else None,
        sdcc_teacher_rows=e.clone() if layout == "trie" else None,
        rollout_reward=torch.empty(0, dtype=torch.float32),
        rollout_group=e.clone(),
        layout=layout,
    )


def balance(
    rollouts: Union[str, "os.PathLike[str]", Sequence[Dict[str, Any]]],
    world_size: int,
    *,
    budget: int,
    model_cost: Optional[ModelCost] = None,
    share_prefixes: bool = True,
    layout: str = "trie",
    pad_token: int = 0,
    objective: str = "flops",
) -> List[List[Pack]]:
    """Packs rollouts for ``world_size`` data-parallel ranks: returns
    ``shards[rank][micro]``, every rank the same number of micro-steps, each
    pack at most ``budget`` tokens, balanced by the exact cost of a training
    step (:func:`treeattn.cost` with ``model_cost``, default
    :meth:`ModelCost.llama3_8b`). The crate's ``treeattn::pack::balance``
    does the work: one native call reads the rollouts, forms the units,
    weighs them, assigns them and packs every bin.

    Units: with ``share_prefixes`` the rollouts whose first call has the same
    context (a GRPO group) stay in one pack, split in input order only when
    together they exceed ``budget``; else each rollout is a unit. The units
    are assigned by LPT (cost descending onto the least-loaded bin with
    room) to ``world_size × M`` bins, M the fewest micro-steps for which
    every unit finds room (from ``ceil(tokens / (world_size · budget))``);
    each bin's rollouts are packed together (input order; prefixes shared
    across units too when ``share_prefixes``). A bin with nothing gets
    :func:`empty_pack` (of token ``pad_token``) — it must still run forward
    and backward. Deterministic for the same input. Rollout and call indices in the packs
    (``rollout_indices``, ``loss_rollout``, ``loss_call``) are those of the
    whole input. ``objective``: ``"flops"`` (the default), or for
    comparisons ``"tokens"`` / ``"l2"`` (the unit's tokens, or tokens²).

    A rollout longer than ``budget`` by itself raises ``ValueError`` naming
    it (split it with context parallelism: :func:`shard`).
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size <= 0:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0:
        raise ValueError(f"budget must be a positive int, got {budget!r}")
    if objective not in ("flops", "tokens", "l2"):
        raise ValueError(f'objective {objective!r}: expected "flops", "tokens" or "l2"')
    if layout not in ("trie", "replicated"):
        raise ValueError(f'layout {layout!r}: expected "trie" or "replicated"')
    model_cost = model_cost or ModelCost.llama3_8b()
    if not isinstance(model_cost, ModelCost):
        if objective == "flops":
            raise ValueError(f"model_cost must be a treeattn.ModelCost, got {type(model_cost).__name__}")
        model_cost = ModelCost.llama3_8b()  # not read by the token objectives
    source, value = _rollout_source(rollouts)
    # A budget past what any pack reaches is no budget (the crate counts in u64).
    out = _native.balance(source, value, world_size, min(budget, 2**63), model_cost,
                          share_prefixes=share_prefixes, layout=layout, objective=objective)
    micro = out["micro_steps"]
    bins = [None if b is None else _pack_of(b, layout) for b in out["bins"]]
    return [
        [empty_pack(layout, pad_token) if bins[m * world_size + r] is None else bins[m * world_size + r]
         for m in range(micro)]
        for r in range(world_size)
    ]


def balance_report(shards: Sequence[Sequence[Any]], model_cost: Optional[ModelCost] = None) -> Dict[str, Any]:
    """How balanced ``shards[rank][micro]`` are, by :func:`treeattn.cost`
    (``model_cost`` default :meth:`ModelCost.llama3_8b`): per micro-step the
    ``max`` and ``mean`` cost over ranks and ``ratio`` = max / mean; ``step``
    = Σ max / Σ mean (the step's time over the ideal when ranks synchronize
    at every micro-step), ``total`` (FLOPs of all packs) and ``tokens``
    (max / mean per micro-step, for comparison)."""
    model_cost = model_cost or ModelCost.llama3_8b()
    if not shards or any(len(s) != len(shards[0]) for s in shards):
        raise ValueError("shards must be a non-empty list of equally long lists of packs")
    micro = len(shards[0])
    mx, mean, tmx, tmean = [], [], [], []
    total = 0.0
    for m in range(micro):
        c = [_cost(s[m], model_cost)["total"] for s in shards]
        t = [len(s[m]) for s in shards]
        total += sum(c)
        mx.append(max(c))
        mean.append(sum(c) / len(c))
        tmx.append(max(t))
        tmean.append(sum(t) / len(t))
    return {
        "micro_steps": micro,
        "max": mx,
        "mean": mean,
        "ratio": [a / b if b else 1.0 for a, b in zip(mx, mean)],
        "step": sum(mx) / sum(mean) if sum(mean) else 1.0,
        "total": total,
        "tokens_ratio": [a / b if b else 1.0 for a, b in zip(tmx, tmean)],
    }


def global_weight(packs: Sequence[Any], group: Optional[Any] = None) -> Tensor:
    """Σ of the loss weights of every pack of this step on every rank: the
    local sum over ``packs`` (float64), all-reduced (SUM) over ``group``
    (default: the default group; no reduction without an initialized
    process group). Dividing each rank's Σ w·nll by it makes the sum over
    ranks and micro-steps equal the single-process weighted mean — and the
    gradients too: DDP averages gradients over ranks, so multiply the loss
    by the world size (or use a SUM all-reduce) for the single-process
    gradient. A 0-dim float64 tensor (on CPU; move it as needed)."""
    w = torch.zeros((), dtype=torch.float64)
    for i, p in enumerate(packs):
        lw = getattr(p, "loss_weights", None)
        if not isinstance(lw, Tensor):
            raise ValueError(f"packs[{i}] has no loss_weights tensor")
        w = w + lw.to(torch.float64).sum()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        if dist.get_backend(group) == "nccl":
            w = w.cuda()
        dist.all_reduce(w, op=dist.ReduceOp.SUM, group=group)
        w = w.cpu()
    return w


# --------------------------------------------------------------------------
# context parallel


@dataclass
class CommStats:
    """Bytes a rank moved in :func:`tree_attention` (K and V rows of earlier
    ranks, and their gradients back), summed over calls, against what
    all-gathering the whole K / V would move. ``calls``; ``rows_received``
    (forward, per call summed); ``bytes_received`` / ``bytes_sent``
    (forward); ``grad_bytes_received`` / ``grad_bytes_sent`` (backward);
    ``allgather_bytes``: the K / V bytes an all-gather would have brought
    this rank in the same calls ((L − L_local) rows per call)."""

    calls: int = 0
    rows_received: int = 0
    bytes_received: int = 0
    bytes_sent: int = 0
    grad_bytes_received: int = 0
    grad_bytes_sent: int = 0
    allgather_bytes: int = 0

    def reset(self) -> None:
        """Sets every counter to 0."""
        for f in self.__dataclass_fields__:
            setattr(self, f, 0)


@dataclass
class Shard:
    """One rank's part of a pack for context parallelism: rows
    ``[start, end)`` of the pack.

    Fields: ``start``, ``end``; ``world_size``, ``rank``; ``bounds`` (every
    rank's start, and L: ``[P + 1]`` ints, the same on every rank);
    ``rows`` (global row ids, int64 ``[L_local]``); ``tokens``,
    ``position_ids`` (of its rows; a rank with no rows has ``padded`` set
    and one padding row here, token ``pad_token`` at position 0, that the
    model runs and nothing scores); ``kv_end`` (the whole pack's, global
    ``[L]``); ``loss_index`` (indices into the pack's loss entries whose row
    it owns, int64), ``loss_rows_local`` (those rows as indices into its
    rows), ``loss_labels``, ``loss_weights`` (of those entries);
    ``sdcc_index``, ``sdcc_student_rows_local``, ``sdcc_teacher_rows``:
    the SDCC pairs whose **student** row it owns (the student's rank owns a
    pair; the teacher row is global: :func:`sdcc_kl` fetches its logits
    from ``owner(teacher_row)``); ``logit_rows_local`` (the local rows
    whose logits the loss needs: its loss rows, its SDCC student rows and
    its rows that are the teacher of any pair, ascending);
    ``cost`` (FLOPs of each rank's rows, ``[P]``, what the split balances);
    ``gathered`` (the global rows of earlier ranks its queries see,
    ascending) and ``gather_ranges`` (the same as ``(lo, hi)`` ranges);
    ``fingerprint`` (of the pack's kv_end and position ids); ``group`` (the
    process group, ``None`` for the default one); ``stats``
    (:class:`CommStats` of :func:`tree_attention` calls)."""

    start: int
    end: int
    world_size: int
    rank: int
    bounds: List[int]
    rows: Tensor
    tokens: Tensor
    position_ids: Tensor
    kv_end: Tensor
    loss_index: Tensor
    loss_rows_local: Tensor
    loss_labels: Tensor
    loss_weights: Tensor
    sdcc_index: Optional[Tensor]
    sdcc_student_rows_local: Optional[Tensor]
    sdcc_teacher_rows: Optional[Tensor]
    cost: List[float]
    gathered: Tensor
    gather_ranges: List[Tuple[int, int]]
    fingerprint: int
    pack_position_ids: Tensor = field(repr=False)
    padded: bool = False
    logit_rows_local: Optional[Tensor] = None
    pack_sdcc: Optional[Tuple[Tensor, Tensor]] = field(default=None, repr=False)
    group: Any = field(default=None, repr=False)
    stats: CommStats = field(default_factory=CommStats)
    _plan: Optional[Tuple[Tensor, List[int], List[int]]] = field(default=None, repr=False)
    _verified: bool = field(default=False, repr=False)

    def __len__(self) -> int:
        return self.end - self.start

    def owner(self, row: int) -> int:
        """The rank that holds global row ``row``."""
        if not 0 <= row < self.bounds[-1]:
            raise ValueError(f"row {row} is outside the pack of {self.bounds[-1]} rows")
        return next(r for r in range(self.world_size) if self.bounds[r] <= row < self.bounds[r + 1])

    def check_pack(self, pack: Any) -> None:
        """Raises ``ValueError`` unless ``pack`` is the pack this shard was cut from."""
        if _fingerprint(pack.kv_end, pack.position_ids) != self.fingerprint:
            raise ValueError(
                "shard: the pack's kv_end / position_ids fingerprint differs from the shard's "
                "(a shard of another pack)"
            )


def _split(row_cost: Tensor, parts: int) -> List[int]:
    """Boundaries ``0 = b_0 <= … <= b_P = L`` of contiguous ranges whose cost
    sums are near ``total / P``: ``b_r`` is the prefix boundary whose prefix
    sum is nearest ``r · total / P`` (so every range is within one row's cost
    of the ideal), moved where needed so that every range has a row when
    ``L >= P``."""
    L = int(row_cost.numel())
    prefix = torch.zeros(L + 1, dtype=torch.float64)
    prefix[1:] = torch.cumsum(row_cost, 0)
    total = float(prefix[-1])
    bounds = [0]
    for r in range(1, parts):
        target = total * r / parts
        j = int(torch.searchsorted(prefix, torch.tensor([target], dtype=torch.float64))[0])
        j = min(max(j, 1), L)
        if abs(float(prefix[j - 1]) - target) <= abs(float(prefix[j]) - target):
            j -= 1
        if L >= parts:  # every rank at least one row when there are enough
            j = min(max(j, bounds[-1] + 1), L - (parts - r))
        bounds.append(max(j, bounds[-1]))
    bounds.append(L)
    return bounds


def _runs(idx: Tensor) -> List[Tuple[int, int]]:
    """Sorted indices as ``(lo, hi)`` ranges of consecutive values."""
    if idx.numel() == 0:
        return []
    breaks = (idx[1:] != idx[:-1] + 1).nonzero().flatten() + 1
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), breaks])
    ends = torch.cat([breaks, torch.tensor([idx.numel()])])
    return [(int(idx[a]), int(idx[b - 1]) + 1) for a, b in zip(starts.tolist(), ends.tolist())]


def _needed(kv_end: Tensor, start: int, end: int) -> Tensor:
    """Global rows before ``start`` that the queries ``[start, end)`` see:
    ``k < start`` with ``kv_end[k] > start`` (ascending; none for an empty
    range). A visible key ``k < start`` must reach ``start``, and then it is
    seen by every query from ``start`` on up to its ``kv_end``."""
    if end <= start:
        return torch.empty(0, dtype=torch.int64)
    return (kv_end[:start].to(torch.int64) > start).nonzero().flatten()


def _group_size_rank(group: Any) -> Tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            "shard(pack, group=...) needs an initialized torch.distributed process group; "
            "for planning without one, give world_size= and rank="
        )
    return dist.get_world_size(group), dist.get_rank(group)


def shard(
    pack: Any,
    group: Optional[Any] = None,
    *,
    world_size: Optional[int] = None,
    rank: Optional[int] = None,
    model_cost: Optional[ModelCost] = None,
    pad_token: int = 0,
) -> Shard:
    """This rank's :class:`Shard` of ``pack`` for context parallelism over
    ``group`` (the default group when ``None``), or over ``world_size``
    ranks as rank ``rank`` with no process group (for planning).

    The pack's rows are cut into ``P`` contiguous ranges of near-equal cost
    (:func:`_row_costs` with ``model_cost``, default
    :meth:`ModelCost.llama3_8b`: each query's visible keys × the attention
    FLOPs per pair, plus the per-token linear FLOPs, plus the lm_head at loss
    rows), not of equal token counts; every rank gets at least one row when
    ``L >= P``. A pack shorter than ``P`` leaves ranks with no rows: their
    shard is ``padded`` (``tokens`` = ``[pad_token]``, ``position_ids`` =
    ``[0]``, no loss entry), so that the model still runs a forward on one
    row and the rank takes part in every collective. Deterministic:
    every rank computes the same cut from the same pack.
    """
    if world_size is None:
        if rank is not None:
            raise ValueError("shard: rank= needs world_size=")
        world_size, rank = _group_size_rank(group)
    else:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size <= 0:
            raise ValueError(f"shard: world_size must be a positive int, got {world_size!r}")
        if rank is None:
            raise ValueError("shard: world_size= needs rank=")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"shard: rank must be an int in 0..{world_size - 1}, got {rank!r}")
    for name in ("tokens", "position_ids", "kv_end", "loss_rows", "loss_labels", "loss_weights"):
        if not isinstance(getattr(pack, name, None), Tensor):
            raise ValueError(f"shard: pack.{name} must be a tensor")
    L = int(pack.tokens.numel())
    if pack.kv_end.numel() != L or pack.position_ids.numel() != L:
        raise ValueError(
            f"shard: pack has {L} tokens but {pack.kv_end.numel()} kv_end and "
            f"{pack.position_ids.numel()} position_ids"
        )
    kv_end = pack.kv_end.to(torch.int64)
    idx = torch.arange(L, dtype=torch.int64)
    bad = (kv_end < idx) | (kv_end > L)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(f"shard: pack.kv_end[{i}] = {int(kv_end[i])} breaks {i} <= kv_end[k] <= L = {L}")
    model_cost = model_cost or ModelCost.llama3_8b()
    rc = _row_costs(pack, model_cost)
    bounds = _split(rc, world_size)
    start, end = bounds[rank], bounds[rank + 1]
    rows = torch.arange(start, end, dtype=torch.int64)
    lr = pack.loss_rows.to(torch.int64)
    mine = ((lr >= start) & (lr < end)).nonzero().flatten()
    need = [lr[mine]]
    pack_sdcc = None
    if pack.sdcc_student_rows is not None:
        sr = pack.sdcc_student_rows.to(torch.int64)
        tr = pack.sdcc_teacher_rows.to(torch.int64)
        sidx = ((sr >= start) & (sr < end)).nonzero().flatten()
        s_local, s_teacher = sr[sidx] - start, tr[sidx]
        need += [sr[sidx], tr[(tr >= start) & (tr < end)]]
        pack_sdcc = (sr, tr)
    else:
        sidx = s_local = s_teacher = None
    logit_rows_local = torch.unique(torch.cat(need)) - start
    padded = end == start
    gathered = _needed(kv_end, start, end)
    cost = [float(rc[bounds[r]:bounds[r + 1]].sum()) for r in range(world_size)]
    return Shard(
        start=start,
        end=end,
        world_size=world_size,
        rank=rank,
        bounds=bounds,
        rows=rows,
        tokens=pack.tokens[start:end].clone() if not padded else torch.tensor([pad_token], dtype=torch.int64),
        position_ids=pack.position_ids[start:end].clone() if not padded else torch.zeros(1, dtype=torch.int64),
        padded=padded,
        kv_end=kv_end,
        loss_index=mine,
        loss_rows_local=lr[mine] - start,
        loss_labels=pack.loss_labels[mine].clone(),
        loss_weights=pack.loss_weights[mine].clone(),
        sdcc_index=sidx,
        sdcc_student_rows_local=s_local,
        sdcc_teacher_rows=s_teacher,
        cost=cost,
        gathered=gathered,
        gather_ranges=_runs(gathered),
        fingerprint=_fingerprint(kv_end, pack.position_ids),
        pack_position_ids=pack.position_ids.to(torch.int64).clone(),
        logit_rows_local=logit_rows_local,
        pack_sdcc=pack_sdcc,
        group=group,
    )


def _plan(s: Shard) -> Tuple[Tensor, List[int], List[int]]:
    """The exchange of rank ``s.rank``: the local rows it sends (to rank 0,
    1, … in turn, ascending), how many to each rank, and how many it
    receives from each rank (its ``gathered`` rows, by owner)."""
    if s._plan is None:
        send_idx, send_counts, recv_counts = [], [], []
        for r in range(s.world_size):
            need = _needed(s.kv_end, s.bounds[r], s.bounds[r + 1])
            mine = need[(need >= s.start) & (need < s.end)]
            send_idx.append(mine - s.start)
            send_counts.append(int(mine.numel()))
            lo, hi = s.bounds[r], s.bounds[r + 1]
            recv_counts.append(int(((s.gathered >= lo) & (s.gathered < hi)).sum()))
        s._plan = (torch.cat(send_idx), send_counts, recv_counts)
    return s._plan


def plan_comm(pack: Any, world_size: int, *, model_cost: Optional[ModelCost] = None) -> Dict[str, Any]:
    """The context-parallel plan of ``pack`` over ``world_size`` ranks
    without a process group: per rank its ``rows``, the ``visible_pairs`` of
    its queries (the attention it must do), ``received`` (rows of earlier
    ranks it gathers per attention call), ``allgather`` (rows an all-gather
    of K / V would bring it: L − rows) and ``wasted_pairs`` (pairs the op
    computes for the gathered rows' zero queries, per head, with
    :func:`tree_attention`'s default chunk)."""
    out: Dict[str, List[int]] = {"rows": [], "visible_pairs": [], "received": [], "allgather": [], "wasted_pairs": []}
    vk = visible_keys_per_query(pack.kv_end)
    L = len(pack.tokens)
    for r in range(world_size):
        s = shard(pack, world_size=world_size, rank=r, model_cost=model_cost)
        g = int(s.gathered.numel())
        out["rows"].append(len(s))
        out["visible_pairs"].append(int(vk[s.start:s.end].sum()))
        out["received"].append(g)
        out["allgather"].append(L - len(s))
        c = max(128, len(s) // 4)
        out["wasted_pairs"].append(sum((min(g, a + c) - a) * (min(g, a + c) - a + 1) // 2
                                       for a in range(0, g, c)))
    return out


def _exchange(s: Shard, rows: Tensor, group: Any, backward: bool) -> Tensor:
    """Forward: every rank sends the rows of its K / V (``rows``, ``[n, F]``)
    that later ranks' queries see and receives the rows it needs
    (``all_to_all_single`` with split sizes), ascending. Backward
    (``rows`` = the gradients of the received rows): the reverse, summed
    into the sent rows (one local row may go to several ranks)."""
    send_idx, send_counts, recv_counts = _plan(s)
    st = s.stats
    row_bytes = (rows[:1].numel() if rows.shape[0] else int(torch.tensor(rows.shape[1:]).prod())) * rows.element_size()
    if not backward:
        send = rows.index_select(0, send_idx.to(rows.device)).contiguous()
        recv = rows.new_empty((sum(recv_counts),) + tuple(rows.shape[1:]))
        if s.world_size > 1:
            dist.all_to_all_single(recv, send, output_split_sizes=recv_counts,
                                   input_split_sizes=send_counts, group=group)
        st.calls += 1
        st.rows_received += recv.shape[0]
        st.bytes_received += recv.shape[0] * row_bytes
        st.bytes_sent += send.shape[0] * row_bytes
        st.allgather_bytes += (int(s.kv_end.numel()) - len(s)) * row_bytes
        return recv
    grad = rows.contiguous()
    back = grad.new_empty((sum(send_counts),) + tuple(grad.shape[1:]))
    if s.world_size > 1:
        dist.all_to_all_single(back, grad, output_split_sizes=send_counts,
                               input_split_sizes=recv_counts, group=group)
    st.grad_bytes_sent += grad.shape[0] * row_bytes
    st.grad_bytes_received += back.shape[0] * row_bytes
    n = 1 if s.padded else len(s)
    out = grad.new_zeros((n,) + tuple(grad.shape[1:]))
    out.index_add_(0, send_idx.to(grad.device), back)
    return out


def _merge(parts: List[Tuple[Tensor, Tensor]]) -> Tuple[Tensor, Tensor]:
    """Attention over a union of disjoint key sets from the per-set results
    ``(O_x [n, H, d], LSE_x [H, n])``: ``LSE = log Σ_x exp(LSE_x)``,
    ``O = Σ_x exp(LSE_x − LSE) · O_x``; a row that sees no key anywhere
    (LSE = −inf everywhere) gets O = 0 and LSE = −inf."""
    if len(parts) == 1:
        return parts[0]
    lses = torch.stack([l for _, l in parts])  # [m, H, n]
    lse = torch.logsumexp(lses, 0)
    w = torch.exp(lses - lse)
    w = torch.where(torch.isfinite(lse)[None], w, torch.zeros_like(w))
    o = sum(w[i].t()[:, :, None] * parts[i][0] for i in range(len(parts)))
    return o, lse


class _ContextParallelAttention(torch.autograd.Function):
    """Forward: gather the visible K / V rows of earlier ranks, run the
    crate's op on this rank's rows alone and, per chunk of gathered rows, on
    [chunk, own rows] with the own rows as padding keys (so only own queries
    × chunk keys are new work), and merge the parts by their LSE. Backward:
    the op's backward of every part with the merged O and LSE (the
    probabilities of a part are exp(S − LSE) of the whole row), then dK / dV
    of the gathered rows back to their owners. One autograd node, so that
    its backward — and its collective — runs on every rank whenever the
    output is part of the loss, even with nothing gathered.

    The variants: a softcap is per score, so every part applies it; a
    sliding window keeps each row's window of the whole pack — its first
    visible key (``window_starts`` of the global ``kv_end``) becomes the
    parts' explicit key starts, re-indexed into each part; sinks join the
    merged sum once (``LSE ← logaddexp(LSE, σ)``, O rescaled), and their
    gradient is ``−Σ exp(σ − LSE) · D`` over this rank's rows."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, s, scale, rope_base, group, chunk, window, softcap,  # noqa: D401
                deterministic=False):
        n, hkv, d = k.shape
        dv = v.shape[2]
        kv = torch.cat([k.reshape(n, hkv * d), v.reshape(n, hkv * dv)], 1)
        cdt = q.dtype if q.device.type == "cuda" else _tt._COMPUTE[q.dtype]
        dev = q.device
        got = _exchange(s, kv[:0] if s.padded else kv, group, backward=False)
        G = got.shape[0]
        qc, kc, vc = q.to(cdt), k.to(cdt), v.to(cdt)
        gk = got[:, : hkv * d].reshape(G, hkv, d).to(cdt)
        gv = got[:, hkv * d:].reshape(G, hkv, dv).to(cdt)
        rope = rope_base is not None
        if s.padded:  # the padding row sees itself only
            ke0 = torch.ones(1, dtype=torch.int64)
            pos0 = torch.zeros(1, dtype=torch.int64)
            own_starts = torch.zeros(1, dtype=torch.int64) if window is not None else None
        else:
            ke0 = s.kv_end[s.start:s.end].clamp(max=s.end) - s.start
            pos0 = s.pack_position_ids[s.start:s.end]
            # Each own row's window of the whole pack, as the first key it
            # sees (global row index).
            own_starts = _shard_window_starts(s, window)[s.start:s.end] if window is not None else None
        # Own rows among themselves.
        starts0 = None if own_starts is None else (own_starts - s.start).clamp(min=0)
        calls = [(0, 0, ke0.to(dev), pos0.to(dev) if rope else None, starts0)]
        # Own queries × each chunk of gathered keys: [chunk keys, own rows
        # as padding keys]; chunk key g is seen by the own rows before its
        # kv_end (and, with a window, by those whose first key is at most it).
        for a in range(0, G, chunk):
            b = min(G, a + chunk)
            c = b - a
            rows = s.gathered[a:b]
            ke = torch.cat([c + (s.kv_end[rows] - s.start).clamp(0, n), c + torch.arange(n)])
            pos = torch.cat([s.pack_position_ids[rows], pos0]) if rope else None
            st = None
            if own_starts is not None:
                st = torch.cat([torch.zeros(c, dtype=torch.int64), torch.searchsorted(rows, own_starts)])
            calls.append((a, b, ke.to(dev), pos.to(dev) if rope else None, st))
        parts = []
        for a, b, ke, pos, st in calls:
            c = b - a
            if c == 0:
                o, lse = _tt._attn_fwd(qc, kc, vc, ke, pos, scale, rope_base, None, _tt._threads, 0, None,
                                       softcap, None, st)
            else:
                qq = torch.cat([qc.new_zeros((c,) + tuple(qc.shape[1:])), qc], 0)
                o, lse = _tt._attn_fwd(qq, torch.cat([gk[a:b], kc]), torch.cat([gv[a:b], vc]), ke, pos,
                                       scale, rope_base, None, _tt._threads, 0, None, softcap, None, st)
                o, lse = o[c:], lse[:, c:]
            parts.append((o, lse))
        o, lse = _merge(parts)
        sc = None
        if sinks is not None:
            # The sink joins each row's sum once, after the parts merged.
            sc = sinks.detach().to(lse.dtype)
            total = torch.logaddexp(lse, sc[:, None])
            o = o * torch.exp(lse - total).t()[:, :, None].to(o.dtype)
            lse = total
        ctx.save_for_backward(qc, kc, vc, gk, gv, o, lse, sc)
        ctx.calls = calls
        ctx.s, ctx.params, ctx.dtype = s, (scale, rope_base, group, softcap), q.dtype
        ctx.deterministic = deterministic
        ctx.sinks_dtype = None if sinks is None else sinks.dtype
        return o.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_o):
        qc, kc, vc, gk, gv, o, lse, sc = ctx.saved_tensors
        s, (scale, rope_base, group, softcap) = ctx.s, ctx.params
        n, hkv, d = kc.shape
        dv_ = vc.shape[2]
        g = grad_o.to(o.dtype).contiguous()
        dq = torch.zeros_like(qc)
        dk = torch.zeros_like(kc)
        dv = torch.zeros_like(vc)
        dgk, dgv = torch.zeros_like(gk), torch.zeros_like(gv)
        for a, b, ke, pos, st in ctx.calls:
            c = b - a
            if c == 0:
                q_, k_, v_ = qc, kc, vc
                o_, l_, g_ = o, lse, g
            else:
                # The chunk's zero queries: output gradient 0, so any finite
                # LSE (0) gives them zero dS; they add nothing.
                q_ = torch.cat([qc.new_zeros((c,) + tuple(qc.shape[1:])), qc], 0)
                k_, v_ = torch.cat([gk[a:b], kc]), torch.cat([gv[a:b], vc])
                o_ = torch.cat([o.new_zeros((c,) + tuple(o.shape[1:])), o], 0)
                l_ = torch.cat([lse.new_zeros((lse.shape[0], c)), lse], 1)
                g_ = torch.cat([g.new_zeros((c,) + tuple(g.shape[1:])), g], 0)
            dq_, dk_, dv_p, _ = _tt._attn_bwd(q_, k_, v_, ke, pos, o_, l_, g_, scale, rope_base, None,
                                              _tt._threads, 0, None, softcap, None, st, ctx.deterministic)
            dq += dq_[c:]
            if c == 0:
                dk += dk_
                dv += dv_p
            else:  # the own rows were padding keys here: no gradient for them
                dgk[a:b] += dk_[:c]
                dgv[a:b] += dv_p[:c]
        G = gk.shape[0]
        dgot = torch.cat([dgk.reshape(G, hkv * d), dgv.reshape(G, hkv * dv_)], 1)
        back = _exchange(s, dgot, group, backward=True)
        dk = dk + back[:, : hkv * d].reshape(n, hkv, d)
        dv = dv + back[:, hkv * d:].reshape(n, hkv, dv_)
        dsinks = None
        if sc is not None:
            # ∂/∂σ_h = −Σ_q exp(σ_h − LSE_hq) · D_hq over this rank's rows.
            D = (g * o).sum(-1).t()  # [H, n]
            dsinks = -(torch.exp(sc[:, None] - lse) * D).sum(1)
            dsinks = dsinks.to(ctx.sinks_dtype)
        t = ctx.dtype
        return dq.to(t), dk.to(t), dv.to(t), dsinks, None, None, None, None, None, None, None, None


def _shard_window_starts(s: Shard, window: int) -> Tensor:
    """The first visible key of every row of the pack under a sliding
    window (global row indices, int64), from the shard's global
    ``kv_end``; cached on the shard per window."""
    cache = s.__dict__.setdefault("_window_starts", {})
    if window not in cache:
        ke32 = s.kv_end.to(torch.int32).contiguous()
        cache[window] = _tt._window_starts(ke32, window)
    return cache[window]


def _verify(s: Shard, group: Any) -> None:
    """Once per shard: all ranks hold shards of the same pack, cut the same
    way, one per rank. Every rank sees every rank's fingerprint, so all of
    them raise together (none is left waiting)."""
    if s._verified:
        return
    if dist.is_available() and dist.is_initialized():
        P, r = dist.get_world_size(group), dist.get_rank(group)
        if P != s.world_size or r != s.rank:
            raise ValueError(
                f"tree_attention: the shard is rank {s.rank} of {s.world_size}, "
                f"the process group has this process as rank {r} of {P}"
            )
        if P > 1:
            mine = torch.tensor([s.fingerprint, s.start, s.end, int(s.kv_end.numel())], dtype=torch.int64)
            if dist.get_backend(group) == "nccl":
                mine = mine.cuda()
            every = mine.new_empty(P * 4)
            dist.all_gather_into_tensor(every, mine, group=group)
            every = every.view(P, 4).cpu()
            for q in range(P):
                if int(every[q, 0]) != s.fingerprint or int(every[q, 3]) != int(s.kv_end.numel()):
                    raise ValueError(
                        f"tree_attention: rank {q}'s shard is of another pack (kv_end / position_ids "
                        f"fingerprint {int(every[q, 0]):#x}, rank {s.rank}'s {s.fingerprint:#x})"
                    )
                if (int(every[q, 1]), int(every[q, 2])) != (s.bounds[q], s.bounds[q + 1]):
                    raise ValueError(
                        f"tree_attention: rank {q} holds rows [{int(every[q, 1])}, {int(every[q, 2])}), "
                        f"this rank's plan gives it [{s.bounds[q]}, {s.bounds[q + 1]})"
                    )
    elif s.world_size != 1:
        raise ValueError(
            f"tree_attention: a shard of {s.world_size} ranks needs an initialized process group"
        )
    s._verified = True


def tree_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    shard: Shard,
    *,
    scale: Optional[float] = None,
    position_ids: Optional[Tensor] = None,
    rope_base: Optional[float] = None,
    group: Optional[Any] = None,
    chunk: Optional[int] = None,
    window: Optional[int] = None,
    softcap: Optional[float] = None,
    sinks: Optional[Tensor] = None,
    deterministic: bool = False,
) -> Tensor:
    """Context-parallel tree attention, differentiable: ``q`` ``[L_local,
    Hq, d]``, ``k`` ``[L_local, Hkv, d]``, ``v`` ``[L_local, Hkv, dv]`` of
    this rank's rows → ``O`` ``[L_local, Hq, dv]``, equal to the rows
    ``[start, end)`` of :func:`treeattn.torch.tree_attention` on the whole
    pack — with its ``window``, ``softcap`` and ``sinks`` too (sinks get
    this rank's share of their gradient; a window keeps each row's window
    of the whole pack).

    How: this rank's queries see its own keys and the keys ``k < start``
    with ``kv_end[k] > start`` (``shard.gathered``, G rows). Those K / V
    rows (concatenated, one ``all_to_all_single``) come from their owners.
    The crate's op then runs on this rank's rows alone (``kv_end`` clipped
    to the range), and once per ``chunk`` gathered rows on [chunk, own
    rows]: the chunk's keys with ``kv_end`` re-indexed (a gathered key is
    seen by the own rows before its ``kv_end``), the own rows as padding
    keys, the chunk's rows as zero queries whose outputs are dropped; the
    parts merge by their log-sum-exp. Backward runs the op's backward on
    every part with the merged O and LSE and sends the dK / dV of gathered
    rows back to their owners the same way. Work thrown away: the chunk
    rows' zero queries, ``≈ G · chunk / 2`` pairs per head (default chunk
    ``max(128, L_local / 4)``: at most ~1/8 of the own-queries × gathered
    pairs when they all see every gathered key). Every rank must call it
    (the same layers in the same order), even with no rows. ``rope_base``:
    rotary inside the op at the pack's positions (``position_ids``, if
    given, must be the shard's).
    ``group``: default ``shard.group``. Bytes moved: ``shard.stats``.
    ``deterministic``: as for :func:`treeattn.torch.tree_attention` (each
    part's CUDA backward sums dQ without atomics; the parts' sum is in a
    fixed order either way).
    """
    if not isinstance(deterministic, bool):
        raise ValueError(f"tree_attention: deterministic = {deterministic!r}: expected a bool (True or False)")
    if not isinstance(shard, Shard):
        raise ValueError(f"tree_attention: shard must be a treeattn.distributed.Shard, got {type(shard).__name__}")
    n = len(shard)
    n_model = 1 if shard.padded else n
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.dim() != 3:
            raise ValueError(f"tree_attention: {name} must be a 3-D tensor [L_local, heads, d]")
        if t.shape[0] != n_model:
            raise ValueError(
                f"tree_attention: {name} has {t.shape[0]} rows, the shard (rank {shard.rank}) holds "
                f"{n} rows [{shard.start}, {shard.end})" + (" (and runs one padding row)" if shard.padded else "")
            )
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(f"tree_attention: k {tuple(k.shape)} and v {tuple(v.shape)} differ in rows or heads")
    if position_ids is not None and not torch.equal(position_ids.to(torch.int64).cpu(), shard.position_ids.to(torch.int64)):
        raise ValueError("tree_attention: position_ids are not the shard's (a shard of another pack?)")
    if q.dtype != k.dtype or v.dtype != k.dtype:
        raise ValueError(f"tree_attention: q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.shape[2] != k.shape[2] or k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"tree_attention: q {tuple(q.shape)} and k {tuple(k.shape)}: head dims must agree "
                         "and kv heads divide q heads")
    if q.dtype not in _tt._COMPUTE:
        raise ValueError(f"tree_attention: dtype {q.dtype}: expected float32, float64, bfloat16 or float16")
    if rope_base is not None:
        rope_base = float(rope_base)
        if not (math.isfinite(rope_base) and rope_base > 1.0):
            raise ValueError(f"tree_attention: rope_base = {rope_base} must be finite and > 1")
    scale = _tt._real("tree_attention: scale", scale) if scale is not None else 1.0 / math.sqrt(q.shape[2])
    if not (math.isfinite(scale) and scale > 0.0):
        raise ValueError(f"tree_attention: scale = {scale} must be finite and > 0")
    window = _tt._check_window(window)
    if softcap is not None:
        if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not (
            math.isfinite(softcap) and softcap > 0
        ):
            raise ValueError(f"tree_attention: softcap = {softcap!r} must be None or a finite float > 0")
        softcap = float(softcap)
    if sinks is not None and (
        not isinstance(sinks, Tensor) or sinks.shape != (q.shape[1],) or not sinks.dtype.is_floating_point
    ):
        raise ValueError(f"tree_attention: sinks must be a float tensor [Hq] = [{q.shape[1]}]")
    # Local checks above raise on this rank alone; from here on every rank
    # of the group takes part in the same collectives.
    group = shard.group if group is None else group
    _verify(shard, group)
    if chunk is None:
        chunk = max(128, len(shard) // 4)
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk <= 0:
        raise ValueError(f"tree_attention: chunk must be a positive int, got {chunk!r}")
    return _ContextParallelAttention.apply(q, k, v, sinks, shard, scale, rope_base, group, chunk, window, softcap,
                                           deterministic)


def sdcc_kl(logits: Tensor, shard: Shard, *, tau: float = 1.0, group: Optional[Any] = None) -> Tuple[Tensor, Tensor]:
    """This rank's share of the pack's SDCC loss under context parallelism.

    ``logits``: ``[len(shard.logit_rows_local), V]``, the model's logits at
    ``shard.logit_rows_local`` in that order (e.g. ``logits_to_keep=
    shard.logit_rows_local``). A pair belongs to the rank holding its
    student row; the teacher row's logits come from the rank holding it
    (one ``all_to_all_single`` of exactly those rows, detached: the teacher
    is stop-gradient). Returns ``(share, kl_per_pair)``: ``share = Σ_own KL
    / P_total`` (so the sum of the ranks' shares, and of their gradients,
    is :func:`treeattn.torch.sdcc_forward_kl`'s mean over the whole pack),
    and the KL of this rank's pairs (``shard.sdcc_index`` order, no
    gradient). Every rank of the group must call it."""
    if shard.pack_sdcc is None:
        raise ValueError("sdcc_kl: the shard's pack has no SDCC pairs (replicated layout)")
    rows = shard.logit_rows_local
    if logits.dim() != 2 or logits.shape[0] != rows.numel():
        raise ValueError(
            f"sdcc_kl: logits must be [{rows.numel()}, V] (the rows shard.logit_rows_local), "
            f"got {tuple(logits.shape)}"
        )
    group = shard.group if group is None else group
    sr, tr = shard.pack_sdcc
    ends = torch.tensor(shard.bounds[1:], dtype=torch.int64)
    s_own = torch.searchsorted(ends, sr, right=True)  # owner of each pair's student row
    t_own = torch.searchsorted(ends, tr, right=True)
    me = shard.rank
    # Sent: teacher rows I hold for pairs whose student another rank holds,
    # by destination rank, in pair order; received: the same seen from the
    # other side.
    send_rows, send_counts, recv_counts = [], [], []
    for r in range(shard.world_size):
        out = (t_own == me) & (s_own == r) & (s_own != me)
        send_rows.append(tr[out])
        send_counts.append(int(out.sum()))
        inc = (s_own == me) & (t_own == r) & (t_own != me)
        recv_counts.append(int(inc.sum()))
    global_rows = rows + shard.start
    local_pos = lambda g: torch.searchsorted(global_rows, g)  # noqa: E731
    send = logits.detach().index_select(0, local_pos(torch.cat(send_rows)).to(logits.device)).contiguous()
    recv = logits.new_empty((sum(recv_counts), logits.shape[1]))
    if shard.world_size > 1:
        dist.all_to_all_single(recv, send, output_split_sizes=recv_counts,
                               input_split_sizes=send_counts, group=group)
    mine = (s_own == me).nonzero().flatten()
    total = int(sr.numel())
    if mine.numel() == 0:
        return logits.sum() * 0, logits.new_zeros(0)
    student = local_pos(sr[mine])
    teacher = torch.empty_like(student)
    local_t = t_own[mine] == me
    teacher[local_t] = local_pos(tr[mine][local_t])
    # Received rows are ordered by source rank, then pair order.
    remote = (~local_t).nonzero().flatten()
    order = sorted(remote.tolist(), key=lambda i: (int(t_own[mine][i]), i))
    for j, i in enumerate(order):
        teacher[i] = logits.shape[0] + j
    both = torch.cat([logits, recv])
    mean, kl = _tt.sdcc_forward_kl(both, student.to(logits.device), teacher.to(logits.device), tau=tau)
    return mean * (mine.numel() / total), kl
