"""TRL's AsyncGRPO tree packing on treeattn's op: :func:`register`.

TRL 1.16's ``AsyncGRPOTrainer`` folds each rank's samples into a prefix
trie (``trl.experimental.async_grpo.packing.TreeRow``), lays it out in
pre-order with ``position_ids`` = depth, and runs attention under the name
``TREE_ATTENTION`` (``"tree_fa3"``) with FlashAttention-3: the K/V rows of
every segment's root-to-segment path are gathered (``tree_kv_index``) and
each segment attends causally to its path (``tree_cu_seqlens_q`` /
``tree_cu_seqlens_k``). That needs FA3 (Hopper, ``kernels``) and copies a
path's K/V once per segment under it.

After ``treeattn.trl.register()``, that name runs treeattn's op instead —
on CPU and GPU, no FlashAttention, no gather: the row's tree arrays become
one ``kv_end`` (query ``q`` sees key ``k`` iff ``k <= q < kv_end[k]``, the
same pairs as TRL's paths), checked against TRL's paths once per forward,
and the layers call :func:`treeattn.hf.attention` with it (sliding windows,
softcaps and sinks included). The trainer is unchanged::

    import treeattn.trl
    treeattn.trl.register()          # before or after building the trainer
    trainer = AsyncGRPOTrainer(model=..., args=AsyncGRPOConfig(...), ...)
    trainer.train()

``register`` replaces ``packing.tree_attention``, the function TRL's own
``register_tree_attention`` registers (the trainer calls it in its
``__init__``), and registers it now, so the order does not matter.

Hybrid models: the tree arrays reach attention layers only, so a model with
recurrent layers (Gated DeltaNet, Mamba-2, short convolutions) would scan
them across samples in packed order. TRL's ``AsyncGRPOTrainer`` refuses any
``layer_types`` beyond attention in its ``__init__``; the attention function
here refuses the recurrent families of :mod:`treeattn.hybrid` too. Such a
model trains exactly by calling it with ``kv_end`` instead
(:func:`tree_mask` of TRL's row gives it; ``attn_implementation="treeattn"``
and :func:`treeattn.hf.register` run the recurrent layers along the row's
paths) — outside ``AsyncGRPOTrainer``'s ``compute_loss``, which passes the
tree arrays only.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional, Tuple

import torch
from torch import Tensor

from .torch import MaskPlan

__all__ = ["register", "attention", "tree_mask", "TRL_VERSION"]

# The TRL release whose packing this module reads (trl/experimental/async_grpo/packing.py).
TRL_VERSION = "1.16.0"

_TREE_KWARGS = ("tree_kv_index", "tree_cu_seqlens_q", "tree_cu_seqlens_k", "tree_max_seqlen_q", "tree_max_seqlen_k")

# The mask built last: weak references to TRL's three tree tensors with their
# versions and the device, so the other layers of a forward reuse it.
_last: Optional[Tuple[Any, Any, Any, Tuple[int, int, int], Any, MaskPlan]] = None


def _ints(name: str, t: Any) -> Tensor:
    if not isinstance(t, Tensor) or t.dim() != 1 or t.dtype.is_floating_point or t.dtype == torch.bool:
        raise ValueError(f"TRL tree row: {name} must be a 1-D integer tensor, got "
                         f"{type(t).__name__ if not isinstance(t, Tensor) else (tuple(t.shape), t.dtype)}")
    return t.detach().to("cpu", torch.int64)


def tree_mask(
    tree_kv_index: Tensor,
    tree_cu_seqlens_q: Tensor,
    tree_cu_seqlens_k: Tensor,
    position_ids: Optional[Tensor] = None,
    *,
    length: Optional[int] = None,
    device: Any = None,
) -> MaskPlan:
    """The :class:`treeattn.torch.MaskPlan` of one TRL tree row (the
    ``TreeRow.pack()`` arrays, or those ``compute_loss`` hands the model).

    TRL's segments are ``[cu_q[s], cu_q[s+1])`` in pre-order and segment
    ``s`` attends causally to the rows ``tree_kv_index[cu_k[s]:cu_k[s+1]]``:
    its ancestors' rows, root first, then its own. So row ``cu_q[s]``'s
    parent is the path's last row before the segment's own (none at a root)
    and every other row's parent is the row before it; ``kv_end`` follows
    from the depths (:meth:`MaskPlan.from_positions`). Then checked, in
    ``O(rows + path entries)``: the segments tile ``0 .. L``, every path
    ends with its own segment and is a chain of parents from a root (so it
    holds exactly the keys ``kv_end`` gives the segment's queries), and each
    row's parent is the last row before it one level up (pre-order). With
    ``position_ids`` (``[L]`` or ``[1, L]``), they must be the depths. A
    failure is a ``ValueError`` naming the segment or row.

    ``length``: the row's token count (default ``cu_q[-1]``); ``device``:
    where the mask lives (default: ``tree_kv_index``'s)."""
    kv = _ints("tree_kv_index", tree_kv_index)
    cq = _ints("tree_cu_seqlens_q", tree_cu_seqlens_q)
    ck = _ints("tree_cu_seqlens_k", tree_cu_seqlens_k)
    dev = torch.device(device) if device is not None else tree_kv_index.device
    if cq.numel() < 2 or ck.numel() != cq.numel():
        raise ValueError(
            f"TRL tree row: tree_cu_seqlens_q has {cq.numel()} entries and tree_cu_seqlens_k {ck.numel()}: "
            "expected S + 1 each for S >= 1 segments"
        )
    L = int(cq[-1]) if length is None else int(length)
    S = cq.numel() - 1
    q_len, k_len = cq.diff(), ck.diff()
    if int(cq[0]) != 0 or int(cq[-1]) != L or bool((q_len <= 0).any()):
        bad = int((q_len <= 0).nonzero()[0, 0]) if bool((q_len <= 0).any()) else None
        raise ValueError(
            f"TRL tree row: the segments must tile rows 0 .. {L} with at least one row each "
            f"(tree_cu_seqlens_q from {int(cq[0])} to {int(cq[-1])}"
            + ("" if bad is None else f", segment {bad} empty") + ")"
        )
    if int(ck[0]) != 0 or int(ck[-1]) != kv.numel() or bool((k_len < q_len).any()):
        bad = (k_len < q_len).nonzero()
        raise ValueError(
            "TRL tree row: tree_cu_seqlens_k must split tree_kv_index into one path per segment, each at least as "
            "long as its segment"
            + (f" (segment {int(bad[0, 0])}'s path is shorter)" if bad.numel() else "")
        )
    if kv.numel() and (int(kv.min()) < 0 or int(kv.max()) >= L):
        raise ValueError(f"TRL tree row: tree_kv_index holds rows outside 0 .. {L - 1}")
    seg = torch.repeat_interleave(torch.arange(S), k_len)  # segment of each path entry
    off = torch.arange(kv.numel()) - ck[:-1][seg]  # offset of the entry in its path
    own = off >= (k_len - q_len)[seg]  # the entry is in the segment's own rows
    # A path ends with its own segment's rows, in order.
    want = cq[:-1][seg] + off - (k_len - q_len)[seg]
    wrong = own & (kv != want)
    if bool(wrong.any()):
        s = int(seg[wrong.nonzero()[0, 0]])
        raise ValueError(f"TRL tree row: segment {s}'s path does not end with the segment's own rows "
                         f"{int(cq[s])} .. {int(cq[s + 1]) - 1}")
    # Parents: within a segment the row before; a segment's first row, the
    # last ancestor row of its path (-1 at a root).
    parent = torch.arange(-1, L - 1)
    anc = k_len - q_len
    first = cq[:-1]
    parent[first] = torch.where(anc > 0, kv[(ck[:-1] + anc - 1).clamp(min=0)], torch.full_like(anc, -1))
    if bool((parent >= torch.arange(L)).any()):
        r = int((parent >= torch.arange(L)).nonzero()[0, 0])
        raise ValueError(f"TRL tree row: row {r}'s path lists row {int(parent[r])} before it, which comes after it "
                         "in the row (not a pre-order layout)")
    # Depths: a segment's first row has its path's ancestors above it. (The
    # chain check below makes them the depths of the parent tree.)
    seg_row = torch.repeat_interleave(torch.arange(S), q_len)
    depth = anc[seg_row] + torch.arange(L) - cq[:-1][seg_row]
    # Every path is a chain of parents from a root.
    prev = torch.cat([torch.tensor([-1]), kv[:-1]])
    start = off == 0
    link = torch.where(start, torch.full_like(kv, -1), prev)
    broken = parent[kv] != link
    if bool(broken.any()):
        i = int(broken.nonzero()[0, 0])
        s = int(seg[i])
        raise ValueError(
            f"TRL tree row: segment {s}'s path is not its root-to-segment path: entry {int(off[i])} (row "
            f"{int(kv[i])}) follows {'nothing' if bool(start[i]) else f'row {int(prev[i])}'} but that row's parent "
            f"is {'none (a root)' if int(parent[kv[i]]) < 0 else f'row {int(parent[kv[i]])}'}"
        )
    if position_ids is not None:
        pos = _ints("position_ids", position_ids.reshape(-1) if isinstance(position_ids, Tensor) else position_ids)
        if pos.numel() != L:
            raise ValueError(f"TRL tree row: position_ids has {pos.numel()} entries for {L} rows")
        bad = pos != depth
        if bool(bad.any()):
            r = int(bad.nonzero()[0, 0])
            raise ValueError(f"TRL tree row: position_ids[{r}] = {int(pos[r])}, but row {r} is at depth "
                             f"{int(depth[r])} of the row's tree")
    mask = MaskPlan.from_positions(depth, device=dev)
    # Pre-order: each row's parent is the last row before it one level up,
    # which is the parent kv_end encodes.
    from . import paths

    if not torch.equal(paths(mask.kv_end.cpu()).parent, parent):
        r = int((paths(mask.kv_end.cpu()).parent != parent).nonzero()[0, 0])
        raise ValueError(f"TRL tree row: row {r}'s parent (row {int(parent[r])}) is not the last row before it one "
                         "level up: the row is not laid out in pre-order")
    return mask


def _mask_of(kwargs: dict, L: int, device: Any) -> MaskPlan:
    """:func:`tree_mask` of the model call's TRL arrays, built once per forward."""
    global _last
    kv, cq, ck = kwargs["tree_kv_index"], kwargs["tree_cu_seqlens_q"], kwargs["tree_cu_seqlens_k"]
    versions = tuple(t._version for t in (kv, cq, ck))
    c = _last
    if c is not None and c[0]() is kv and c[1]() is cq and c[2]() is ck and c[3] == versions and c[4] == device:
        return c[5]
    m = tree_mask(kv, cq, ck, length=L, device=device)
    _last = (weakref.ref(kv), weakref.ref(cq), weakref.ref(ck), versions, device, m)
    return m


def _refuse_recurrent(module: Any) -> None:
    """ValueError for a model whose recurrent layers the tree arrays do not reach."""
    from . import hybrid

    config = getattr(module, "config", None)
    mt = getattr(config, "model_type", None)
    types = set(getattr(config, "layer_types", None) or []) - {"full_attention", "sliding_attention"}
    if types or (mt in hybrid.SUPPORTED or mt in hybrid.UNSUPPORTED) and getattr(config, "layer_types", None) is None:
        raise ValueError(
            f"{type(module).__name__} belongs to a model with recurrent layers ({mt}, layer types "
            f"{sorted(types) or 'not listed'}): TRL's tree arrays reach its attention layers only, so its recurrent "
            "layers would run across samples in packed order. Call the model with kv_end=treeattn.trl.tree_mask(...)"
            ".kv_end and attn_implementation=\"treeattn\" instead (treeattn.hybrid runs them along the paths)"
        )


def attention(
    module: Any,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Optional[Tensor],
    scaling: Optional[float] = None,
    dropout: float = 0.0,
    **kwargs: Any,
):
    """The attention function registered under TRL's ``TREE_ATTENTION``:
    TRL's tree arrays (``tree_kv_index``, ``tree_cu_seqlens_q`` /
    ``tree_cu_seqlens_k``; ``tree_max_seqlen_q`` / ``tree_max_seqlen_k``
    are not needed) become the row's :class:`MaskPlan` (:func:`tree_mask`,
    once per forward), and :func:`treeattn.hf.attention` runs the layer with
    it — which also checks that the model's ``position_ids`` are the row's
    depths. ``query`` ``[1, Hq, L, d]`` (TRL's rows are batch 1)."""
    from . import hf

    missing = [k for k in _TREE_KWARGS[:3] if kwargs.get(k) is None]
    if missing:
        raise ValueError(
            f"attention {_name()!r} (treeattn.trl) needs TRL's tree arrays; the model call lacks {missing} "
            "(AsyncGRPOTrainer.compute_loss passes them from DataCollatorForRollout's batch)"
        )
    if query.dim() != 4 or query.shape[0] != 1:
        raise ValueError(f"TRL's tree rows are one sequence (batch 1), got query of shape {tuple(query.shape)}")
    _refuse_recurrent(module)
    mask = _mask_of(kwargs, int(query.shape[2]), query.device)
    rest = {k: v for k, v in kwargs.items() if k not in _TREE_KWARGS}
    return hf.attention(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, kv_end=mask,
                        **rest)


def _name() -> str:
    try:
        from trl.experimental.async_grpo.packing import TREE_ATTENTION

        return TREE_ATTENTION
    except Exception:  # TRL absent: the name TRL 1.16 uses
        return "tree_fa3"


def register() -> str:
    """Makes TRL's AsyncGRPO tree attention name (``packing.TREE_ATTENTION``,
    ``"tree_fa3"`` in TRL 1.16) run :func:`attention` (idempotent), also
    when the trainer re-registers it in its ``__init__``; its mask function
    builds no mask. Returns the name. ``ImportError`` without TRL; a TRL
    whose packing module lacks what this reads is a ``RuntimeError``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from . import hf

    try:
        from trl.experimental.async_grpo import packing
    except ImportError as e:
        raise ImportError(f"treeattn.trl needs TRL (pip install trl=={TRL_VERSION}): {e}") from e
    for attr in ("TREE_ATTENTION", "tree_attention", "register_tree_attention", "TreeRow"):
        if not hasattr(packing, attr):
            raise RuntimeError(
                f"trl.experimental.async_grpo.packing has no {attr}: this TRL is not the {TRL_VERSION} layout "
                "treeattn.trl reads"
            )
    packing.tree_attention = attention
    AttentionInterface.register(packing.TREE_ATTENTION, attention)
    AttentionMaskInterface.register(packing.TREE_ATTENTION, hf._no_mask)
    return packing.TREE_ATTENTION
