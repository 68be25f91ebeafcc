"""Batches of packs: ``[B, L]`` tensors for a model call, as Trainer-style
pipelines pass them.

:func:`collate` pads ``B`` packs to one length ``L`` and stacks them. A
padding row ``k`` gets ``kv_end[k] == k`` (no query sees it, and it sees
nothing), position id 0, the ``pad_token_id`` token and no loss entry, so
each pack's rows compute exactly what they compute alone: the ``"treeattn"``
HF attention runs the ``B`` packs as one forest (row ``(b, t)`` is row
``b·L + t``, its keys shifted by ``b·L``), which no query crosses.

Loss entries are concatenated in pack order (each pack's own loss order), and
``loss_batch`` names each entry's pack: ``loss_rows`` stay the rows within
that pack. Per-target tensors a caller computed per pack (advantages, say)
line up with the batch after ``torch.cat`` in the same order. The packs'
rollouts are concatenated the same way (``rollout_batch`` names each
rollout's pack), so :mod:`treeattn.rl` takes the dict as it takes a pack.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

__all__ = ["collate", "Collator", "unbatch", "LOSS_TENSORS", "ROLLOUT_TENSORS"]

from . import _native


def _axis(axis: str) -> tuple:
    """The pack tensors of one axis, from the crate's pack schema
    (``treeattn::safetensors::PACK_SCHEMA``), in its order."""
    return tuple(name for name, _, a in _native.PACK_SCHEMA if a == axis)


#: Per-loss-entry tensors carried into a batch (when every pack has them).
LOSS_TENSORS = _axis("T")

#: Per-rollout tensors carried into a batch (when every pack has them).
ROLLOUT_TENSORS = _axis("R")

_ROW_TENSORS = _axis("L")
assert _ROW_TENSORS == ("tokens", "position_ids", "kv_end")  # collate reads them in this order


def _get(p: Any, name: str) -> Any:
    return p.get(name) if isinstance(p, dict) else getattr(p, name, None)


def collate(
    packs: Sequence[Any],
    *,
    pad_token_id: int = 0,
    pad_to_multiple_of: Optional[int] = None,
) -> Dict[str, Any]:
    """The ``[B, L]`` batch of ``packs`` (:class:`treeattn.Pack` objects, or
    dicts of a pack's tensors as :meth:`Pack.tensors` returns them).

    Returns a dict of tensors: ``input_ids``, ``position_ids``, ``kv_end``
    ``[B, L]`` int64 (``L`` the longest pack, rounded up to a multiple of
    ``pad_to_multiple_of`` if given), ``loss_batch`` ``[T]`` int64 (each
    loss entry's pack) and the loss tensors of :data:`LOSS_TENSORS` that
    every pack has, concatenated; with SDCC pairs in every pack (trie
    layout), ``sdcc_batch``, ``sdcc_student_rows``, ``sdcc_teacher_rows``
    ``[P]``. ``model(input_ids=b["input_ids"], position_ids=b["position_ids"],
    kv_end=b["kv_end"])`` runs it; :func:`treeattn.hf.target_logprobs` and
    :func:`treeattn.hf.pack_loss` take the dict in place of a pack.

    The rollouts, when every pack names them (:class:`treeattn.Pack`
    objects; dicts with ``rollout_ids``, ``rollout_indices`` and ``groups``):
    ``rollout_ids``, ``rollout_indices`` (lists) and ``rollout_batch``
    ``[R]`` int64 (each rollout's pack), the packs' rollouts in pack order;
    ``groups``, every pack's group names once, in order of first
    appearance, and ``rollout_group`` ``[R]`` indexing it (−1: no group);
    the :data:`ROLLOUT_TENSORS` every pack has, concatenated; and
    ``loss_rollout_local`` ``[T]`` int64, each loss entry's rollout as an
    index into the batch's rollouts (``loss_rollout`` keeps the input
    index, as in the pack). :mod:`treeattn.rl` (``gae``, ``end_rows``,
    ``grpo_advantages``, ``policy_loss``) takes the dict as it takes a pack
    and gives the packs' results one after another.

    ``ValueError`` for an empty list, a pack whose tensors are missing or
    of different lengths, or a bad padding option.
    """
    import torch

    if isinstance(packs, dict) or not isinstance(packs, (list, tuple)):
        raise ValueError(f"collate takes a list of packs, got {type(packs).__name__}")
    if not packs:
        raise ValueError("collate: no packs (a batch needs at least one)")
    if isinstance(pad_token_id, bool) or not isinstance(pad_token_id, int) or not 0 <= pad_token_id <= 0xFFFFFFFF:
        raise ValueError(
            f"pad_token_id must be a token id, an int in 0..2^32-1 as the packs' tokens are, got {pad_token_id!r}"
        )
    if pad_to_multiple_of is not None and (
        isinstance(pad_to_multiple_of, bool) or not isinstance(pad_to_multiple_of, int) or pad_to_multiple_of <= 0
    ):
        raise ValueError(f"pad_to_multiple_of must be a positive int or None, got {pad_to_multiple_of!r}")
    lengths: List[int] = []
    for b, p in enumerate(packs):
        ts = []
        for name in _ROW_TENSORS + ("loss_rows", "loss_labels", "loss_weights"):
            t = _get(p, name)
            if not isinstance(t, torch.Tensor) or t.dim() != 1:
                raise ValueError(f"collate: pack {b} has no 1-D tensor {name!r}")
            ts.append(t)
        n = int(ts[0].shape[0])
        for name, t in zip(_ROW_TENSORS[1:], ts[1:3]):
            if int(t.shape[0]) != n:
                raise ValueError(f"collate: pack {b} has {n} tokens but {name} of length {int(t.shape[0])}")
        if n == 0:
            raise ValueError(f"collate: pack {b} is empty")
        lengths.append(n)
    L = max(lengths)
    if pad_to_multiple_of is not None:
        L = -(-L // pad_to_multiple_of) * pad_to_multiple_of
    B = len(packs)
    input_ids = torch.full((B, L), pad_token_id, dtype=torch.int64)
    position_ids = torch.zeros((B, L), dtype=torch.int64)
    # Padding keys: kv_end[k] == k (seen by no query).
    kv_end = torch.arange(L, dtype=torch.int64).repeat(B, 1)
    for b, (p, n) in enumerate(zip(packs, lengths)):
        input_ids[b, :n] = _get(p, "tokens").to(torch.int64)
        position_ids[b, :n] = _get(p, "position_ids").to(torch.int64)
        kv_end[b, :n] = _get(p, "kv_end").to(torch.int64)
    out: Dict[str, Any] = {"input_ids": input_ids, "position_ids": position_ids, "kv_end": kv_end}
    counts = [int(_get(p, "loss_rows").shape[0]) for p in packs]
    out["loss_batch"] = torch.cat([torch.full((c,), b, dtype=torch.int64) for b, c in enumerate(counts)])
    for name in LOSS_TENSORS:
        parts = [_get(p, name) for p in packs]
        if all(isinstance(t, torch.Tensor) for t in parts):
            for b, (t, c) in enumerate(zip(parts, counts)):
                if t.dim() != 1 or int(t.shape[0]) != c:
                    raise ValueError(f"collate: pack {b} has {c} loss entries but {name} of shape {tuple(t.shape)}")
            out[name] = torch.cat(parts)
    for b, (p, n) in enumerate(zip(packs, lengths)):
        rows = _get(p, "loss_rows")
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= n):
            raise ValueError(f"collate: pack {b} has loss_rows outside 0..{n - 1}")
    _collate_rollouts(packs, counts, out)
    students = [_get(p, "sdcc_student_rows") for p in packs]
    teachers = [_get(p, "sdcc_teacher_rows") for p in packs]
    if all(isinstance(t, torch.Tensor) for t in students + teachers):
        out["sdcc_batch"] = torch.cat(
            [torch.full((int(s.shape[0]),), b, dtype=torch.int64) for b, s in enumerate(students)]
        )
        out["sdcc_student_rows"] = torch.cat(students).to(torch.int64)
        out["sdcc_teacher_rows"] = torch.cat(teachers).to(torch.int64)
    return out


def _collate_rollouts(packs: Sequence[Any], counts: List[int], out: Dict[str, Any]) -> None:
    """The packs' rollouts into ``out`` (see :func:`collate`), when every
    pack names them."""
    import torch

    per = [(_get(p, "rollout_ids"), _get(p, "rollout_indices"), _get(p, "groups")) for p in packs]
    if not all(isinstance(x, (list, tuple)) for trio in per for x in trio):
        return
    names: Dict[str, int] = {}
    rollout_ids: List[Any] = []
    rollout_indices: List[Any] = []
    rollout_batch, rollout_group, local = [], [], []
    has_local, offset = True, 0
    for b, (p, (rid, ridx, grp)) in enumerate(zip(packs, per)):
        R = len(rid)
        if len(ridx) != R:
            raise ValueError(f"collate: pack {b} has {R} rollout_ids but {len(ridx)} rollout_indices")
        rollout_ids += list(rid)
        rollout_indices += list(ridx)
        rollout_batch.append(torch.full((R,), b, dtype=torch.int64))
        g = _get(p, "rollout_group")
        if not isinstance(g, torch.Tensor) or g.shape != (R,):
            raise ValueError(f"collate: pack {b} has {R} rollouts but rollout_group of shape "
                             f"{tuple(g.shape) if isinstance(g, torch.Tensor) else type(g).__name__}")
        g = g.to(torch.int64)
        if R and (int(g.min()) < -1 or int(g.max()) >= len(grp)):
            raise ValueError(f"collate: pack {b}'s rollout_group indexes none of its {len(grp)} groups")
        remap = torch.tensor([names.setdefault(n, len(names)) for n in grp] + [-1], dtype=torch.int64)
        rollout_group.append(remap[g])  # -1 indexes the appended -1
        lr = _get(p, "loss_rollout")
        if isinstance(lr, torch.Tensor) and lr.shape == (counts[b],):
            order = torch.tensor(list(ridx), dtype=torch.int64)
            sorted_idx, perm = torch.sort(order)
            pos = torch.searchsorted(sorted_idx, lr.to(torch.int64)).clamp_max(max(R - 1, 0))
            if lr.numel() and (R == 0 or not bool((sorted_idx[pos] == lr).all())):
                raise ValueError(f"collate: pack {b}'s loss_rollout names a rollout not in its rollout_indices")
            local.append(perm[pos] + offset if R else lr.to(torch.int64))
        else:
            has_local = False
        offset += R
    out["rollout_ids"], out["rollout_indices"] = rollout_ids, rollout_indices
    out["groups"] = list(names)
    out["rollout_batch"] = torch.cat(rollout_batch)
    out["rollout_group"] = torch.cat(rollout_group)
    for name in ROLLOUT_TENSORS:
        if name == "rollout_group":
            continue
        parts = [_get(p, name) for p in packs]
        if all(isinstance(t, torch.Tensor) for t in parts):
            for b, (t, trio) in enumerate(zip(parts, per)):
                if t.shape != (len(trio[0]),):
                    raise ValueError(
                        f"collate: pack {b} has {len(trio[0])} rollouts but {name} of shape {tuple(t.shape)}"
                    )
            out[name] = torch.cat(parts)
    if has_local:
        out["loss_rollout_local"] = torch.cat(local)


def unbatch(batch: Dict[str, Any]) -> List[Any]:
    """The :class:`treeattn.Pack` s of a :func:`collate` batch, one per
    pack in batch order, as :mod:`treeattn.rl` reads them: the loss
    entries and rollouts of each pack (``loss_batch`` / ``rollout_batch``),
    its rows padded to the batch's ``L`` (a padding row is seen by no
    query, so :func:`treeattn.rl.end_rows` finds the same rows). ``stats``
    are not carried (empty). ``ValueError`` for a dict that is not such a
    batch."""
    import torch

    from . import Pack

    if not isinstance(batch, dict):
        raise ValueError(f"unbatch takes treeattn.collate's dict, got {type(batch).__name__}")
    need = ("input_ids", "position_ids", "kv_end", "loss_batch", "rollout_batch", "loss_rows", "loss_labels",
            "loss_weights", "loss_call", "loss_offset", "loss_rollout", "loss_segment", "loss_logprobs",
            "rollout_reward", "rollout_group")
    missing = [n for n in need if not isinstance(batch.get(n), torch.Tensor)]
    lists = [n for n in ("rollout_ids", "rollout_indices", "groups") if not isinstance(batch.get(n), (list, tuple))]
    if missing or lists:
        raise ValueError(
            f"a batch dict without {', '.join(missing + lists)}: build it with treeattn.collate(packs) "
            "of treeattn.Pack objects (dicts of pack tensors name no rollouts)"
        )
    ids = batch["input_ids"]
    if ids.dim() != 2 or batch["position_ids"].shape != ids.shape or batch["kv_end"].shape != ids.shape:
        raise ValueError(
            f"batch input_ids {tuple(ids.shape)}, position_ids {tuple(batch['position_ids'].shape)}, "
            f"kv_end {tuple(batch['kv_end'].shape)}: expected three [B, L] tensors"
        )
    B = int(ids.shape[0])
    lb, rb = batch["loss_batch"], batch["rollout_batch"]
    T, R = int(lb.shape[0]), int(rb.shape[0])
    for name in [n for n in LOSS_TENSORS if n in batch]:
        t = batch[name]
        if not isinstance(t, torch.Tensor) or t.shape != (T,):
            raise ValueError(f"batch {name} must be [{T}] (one per loss entry, as loss_batch), got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    for name in [n for n in ROLLOUT_TENSORS if n in batch]:
        t = batch[name]
        if not isinstance(t, torch.Tensor) or t.shape != (R,):
            raise ValueError(f"batch {name} must be [{R}] (one per rollout, as rollout_batch), got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    if len(batch["rollout_ids"]) != R or len(batch["rollout_indices"]) != R:
        raise ValueError(f"batch has {R} rollouts (rollout_batch) but {len(batch['rollout_ids'])} rollout_ids "
                         f"and {len(batch['rollout_indices'])} rollout_indices")
    for name, t in (("loss_batch", lb), ("rollout_batch", rb)):
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= B):
            raise ValueError(f"batch {name} must name a pack 0..{B - 1}")
    out = []
    for b in range(B):
        sel = torch.nonzero(lb == b).flatten()
        rsel = torch.nonzero(rb == b).flatten().tolist()
        loss = {n: batch[n][sel] for n in LOSS_TENSORS if n in batch}
        roll = {n: batch[n][rsel] for n in ROLLOUT_TENSORS if n in batch}
        sdcc = {}
        if isinstance(batch.get("sdcc_batch"), torch.Tensor):
            ssel = batch["sdcc_batch"] == b
            sdcc = {n: batch[n][ssel] for n in ("sdcc_student_rows", "sdcc_teacher_rows")}
        out.append(Pack(
            tokens=ids[b], position_ids=batch["position_ids"][b], kv_end=batch["kv_end"][b],
            sdcc_student_rows=sdcc.get("sdcc_student_rows"), sdcc_teacher_rows=sdcc.get("sdcc_teacher_rows"),
            rollout_indices=[batch["rollout_indices"][i] for i in rsel],
            rollout_ids=[batch["rollout_ids"][i] for i in rsel],
            groups=list(batch["groups"]),
            **loss, **roll,
        ))
    return out


class Collator:
    """A ``data_collator`` for ``transformers.Trainer`` / TRL trainers and
    ``torch.utils.data.DataLoader(collate_fn=...)``: called with a list of
    packs (or dicts of pack tensors), returns :func:`collate`'s dict.

    With ``Trainer``, the batch's loss is :func:`treeattn.hf.pack_loss` of
    the dict (override ``compute_loss``); ``model(**batch)`` alone would not
    score the loss entries."""

    def __init__(self, pad_token_id: int = 0, pad_to_multiple_of: Optional[int] = None) -> None:
        self.pad_token_id = pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(self, features: Sequence[Any]) -> Dict[str, Any]:
        return collate(list(features), pad_token_id=self.pad_token_id, pad_to_multiple_of=self.pad_to_multiple_of)
