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
line up with the batch after ``torch.cat`` in the same order.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

__all__ = ["collate", "Collator", "LOSS_TENSORS"]

#: Per-loss-entry tensors carried into a batch (when every pack has them).
LOSS_TENSORS = (
    "loss_rows", "loss_labels", "loss_weights", "loss_call", "loss_offset",
    "loss_rollout", "loss_segment", "loss_logprobs",
)

_ROW_TENSORS = ("tokens", "position_ids", "kv_end")


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
    students = [_get(p, "sdcc_student_rows") for p in packs]
    teachers = [_get(p, "sdcc_teacher_rows") for p in packs]
    if all(isinstance(t, torch.Tensor) for t in students + teachers):
        out["sdcc_batch"] = torch.cat(
            [torch.full((int(s.shape[0]),), b, dtype=torch.int64) for b, s in enumerate(students)]
        )
        out["sdcc_student_rows"] = torch.cat(students).to(torch.int64)
        out["sdcc_teacher_rows"] = torch.cat(teachers).to(torch.int64)
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
