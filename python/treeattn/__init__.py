"""treeattn: exact, deduplicated attention on packed conditioning trees.

Python bindings of the Rust crate ``treeattn`` (PyO3, abi3). Everything here
is a thin adapter over the crate's one contract:

- :func:`from_chat` turns chat-log rollouts (messages, tools, sampled
  text or the engine's token ids) into the token rollouts :func:`pack`
  takes, reporting re-tokenized calls and the junctions a template makes;
- :func:`pack` packs rollouts (a JSONL path or a list of dicts shaped like its
  lines) exactly as ``treeattn pack`` does and returns :class:`Pack` objects
  holding torch tensors named like the pack file's tensors; :func:`collate`
  (and :class:`Collator`, a Trainer ``data_collator``) pads packs into a
  ``[B, L]`` batch;
- :mod:`treeattn.torch` has the autograd ops ``tree_attention`` and
  ``sdcc_forward_kl`` (``torch.library`` custom ops, CPU backend);
- :mod:`treeattn.hf` plugs the op into Hugging Face transformers and scores
  a pack (``target_logprobs``, ``pack_loss``) without ``[L, V]`` logits;
- :mod:`treeattn.rl` has the RL objectives on per-target tensors in a
  pack's loss order (PPO ``policy_loss`` and ``value_loss``).
- :class:`ModelCost` and :func:`cost` give the exact FLOPs of a training step
  on a pack; :mod:`treeattn.distributed` balances packs over data-parallel
  ranks and splits one pack over context-parallel ranks (torch.distributed).
- :func:`paths` gives the path structure of a pack (parents, trie nodes,
  level schedule) and :mod:`treeattn.hybrid` runs recurrent layers (short
  convolutions, Gated DeltaNet, Mamba-2) along it.

The mask rule of a pack: query ``q`` sees key ``k`` iff
``k <= q < kv_end[k]``; ``position_ids`` are depths in the trie.

Errors the Rust crate reports on bad input are :class:`TreeattnError`, a
``ValueError``, or one of its subclasses: :class:`RolloutError` (a rollout
that breaks the calls format, JSON that does not parse), :class:`PackError`
(an invalid pack or mask), :class:`ShapeError` (sizes that do not fit),
:class:`UnsupportedError` (a head dim, dtype or setting treeattn does not
take). Checks made in Python before the native call raise ``ValueError``.
"""

from __future__ import annotations

import json as _json
import os as _os
import reprlib as _reprlib
import sys as _sys
from dataclasses import dataclass as _dataclass
from dataclasses import field as _field
from typing import Any, Dict, List, Optional, Sequence, Union

from . import _native
from ._native import ModelCost, PackError, RolloutError, ShapeError, TreeattnError, UnsupportedError
from .batch import Collator, collate
from .chat import ChatReport, ChatRollouts, from_chat

__all__ = [
    "pack", "Pack", "collate", "Collator", "ModelCost", "cost", "paths", "Paths", "__version__",
    "from_chat", "ChatRollouts", "ChatReport",
    "TreeattnError", "RolloutError", "PackError", "ShapeError", "UnsupportedError",
]
__version__ = _native.__version__

_SUBMODULES = ("batch", "chat", "distributed", "hf", "hybrid", "rl", "torch", "trl")


def __dir__() -> List[str]:
    """The API (``__all__``) and the submodules imported so far: not the
    names this module imports for itself."""
    loaded = [m for m in _SUBMODULES if f"{__name__}.{m}" in _sys.modules]
    return sorted(set(__all__) | set(loaded))

# Names of the tensors of a pack, as in the pack files: the crate's
# pack schema (``treeattn::safetensors::PACK_SCHEMA``; ``_native.PACK_SCHEMA``
# has (name, dtype, axis) triples). loss_logprobs is NaN where a target
# has none.
PACK_TENSORS = tuple(name for name, _, _ in _native.PACK_SCHEMA)


@_dataclass
class Pack:
    """One pack: ``L`` tokens, ``T`` loss entries, ``P`` SDCC pairs.

    Tensors (CPU, like the pack files): ``tokens``, ``position_ids``,
    ``kv_end`` ``[L]`` int64; ``loss_rows``, ``loss_labels``, ``loss_call``
    (global call index in input order, from 0), ``loss_offset``,
    ``loss_rollout`` (input index of the rollout) ``[T]`` int64;
    ``loss_weights`` ``[T]`` float32; ``loss_segment`` ``[T]`` int64 (the
    target's segment in its rollout: 0 from the first call, +1 at every
    junction call, i.e. every compaction or eviction); ``loss_logprobs``
    ``[T]`` float32, NaN where a call logged no log-probs;
    ``sdcc_student_rows``, ``sdcc_teacher_rows`` ``[P]`` int64 (trie layout;
    ``None`` for the replicated layout, where student rows are not defined).
    Loss entries are in generation order (sorted by rollout, call, offset).

    Per rollout of the pack (``R`` of them, in the order of
    ``rollout_indices``): ``rollout_reward`` ``[R]`` float32 (the input's
    ``"reward"``, NaN where absent) and ``rollout_group`` ``[R]`` int64 (index
    into ``groups``, the GRPO group names in order of first appearance; −1
    where a rollout has no ``"group"``) and ``rollout_fingerprint`` ``[R]``
    int64 (a 64-bit hash of the rollout's calls' token ids, FNV-1a as
    ``treeattn::pack::calls_fingerprint`` defines it: the same rollout
    packed anywhere has the same value; ``None`` for a pack built without
    it, e.g. from a pack file of an earlier version, where
    :func:`treeattn.rl.grpo_advantages` cannot tell two rollouts of one id
    apart).

    The input's other RL fields (``None`` for a pack built without them,
    e.g. from a pack file of an earlier version): ``loss_reward`` ``[T]``
    float32 (the input's per-token ``"rewards"``, NaN where a rollout has
    none), ``loss_summary`` ``[T]`` bool (the target's call is marked
    ``"summary": true``), ``rollout_truncated`` ``[R]`` bool (the rollout
    is marked ``"truncated": true``). :mod:`treeattn.rl` reads them.

    Also: ``layout``, ``rollout_indices`` and ``rollout_ids`` (the rollouts
    in this pack, input order), ``stats`` (one dict per rollout of the pack:
    ``calls``, ``junctions`` (K), ``branches``, ``targets``, ``present``,
    ``diverging`` (D), ``trie_tokens``, ``branch_tokens``, ``dedup_ratio``,
    ``evicted``).
    """

    tokens: Any
    position_ids: Any
    kv_end: Any
    loss_rows: Any
    loss_labels: Any
    loss_weights: Any
    loss_call: Any
    loss_offset: Any
    loss_rollout: Any
    loss_segment: Any
    loss_logprobs: Any
    sdcc_student_rows: Optional[Any]
    sdcc_teacher_rows: Optional[Any]
    rollout_reward: Any
    rollout_group: Any
    layout: str = "trie"
    rollout_indices: List[int] = _field(default_factory=list)
    rollout_ids: List[str] = _field(default_factory=list)
    groups: List[str] = _field(default_factory=list)
    stats: List[Dict[str, Any]] = _field(default_factory=list)
    loss_reward: Optional[Any] = None
    loss_summary: Optional[Any] = None
    rollout_truncated: Optional[Any] = None
    rollout_fingerprint: Optional[Any] = None

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def __repr__(self) -> str:
        # Sizes, not tensors (the dataclass repr printed every tensor:
        # 36,847 characters for the sample pack).
        def n(x: Any) -> str:
            return str(int(x.shape[0])) if hasattr(x, "shape") and len(x.shape) else "?"

        ids = self.rollout_ids
        shown = ", ".join(repr(i) for i in ids[:3]) + (", ..." if len(ids) > 3 else "")
        sdcc = "" if self.sdcc_student_rows is None else f", sdcc_pairs={n(self.sdcc_student_rows)}"
        groups = f", groups={len(self.groups)}" if self.groups else ""
        return (
            f"Pack(layout={self.layout!r}, tokens={n(self.tokens)}, targets={n(self.loss_rows)}{sdcc}, "
            f"rollouts={len(ids)} [{shown}]{groups})"
        )

    def loss_rollout_local(self):
        """``[T]`` int64: each loss entry's rollout as an index into this
        pack's rollouts (``rollout_indices``, ``rollout_reward``, ...)."""
        import torch

        idx = torch.tensor(self.rollout_indices, dtype=torch.int64)
        local = torch.searchsorted(idx, self.loss_rollout)
        if self.loss_rollout.numel() and (
            int(local.max()) >= idx.numel() or not bool((idx[local] == self.loss_rollout).all())
        ):
            raise ValueError("loss_rollout names a rollout that is not in this pack's rollout_indices")
        return local

    def tensors(self) -> Dict[str, Any]:
        """The tensors by name (absent SDCC tensors left out)."""
        return {
            n: getattr(self, n) for n in PACK_TENSORS if getattr(self, n) is not None
        }


def _tensor(dtype: str, data: bytes):
    import torch

    dt = {"int64": torch.int64, "float32": torch.float32, "int32": torch.int32,
          "float64": torch.float64, "bool": torch.bool}[dtype]
    if len(data) == 0:
        return torch.empty(0, dtype=dt)
    # frombuffer shares the (immutable) bytes; clone to own writable memory.
    return torch.frombuffer(bytearray(data), dtype=dt).clone()


def pack(
    rollouts: Union[str, "_os.PathLike[str]", Sequence[Dict[str, Any]]],
    layout: str = "trie",
    share_prefixes: bool = True,
    budget: Optional[int] = None,
) -> List[Pack]:
    """Packs rollouts exactly as ``treeattn pack`` does.

    ``rollouts``: a path to a JSON Lines file, or a list of dicts shaped like
    its lines, ``{"id": ..., "reward": float?, "group": str?, "rewards":
    [[float, ...], ...]?, "truncated": bool?, "calls": [{"context": [...],
    "completion": [...], "logprobs": [...]?, "summary": bool?}]}``
    (:mod:`treeattn.rl` says what the RL fields mean). ``layout``: ``"trie"`` (deduplicated
    pre-order trie) or ``"replicated"`` (each branch its own chain).
    ``share_prefixes`` (default ``True``): rollouts in a pack share identical
    prefixes (trie layout; a GRPO group's prompt is stored once); ``False``
    keeps each rollout's own copy (the same attention, more tokens).
    ``budget``: token budget per pack (default: one pack).

    Bad rollouts raise ``ValueError`` naming the rollout id, call and field
    (for a list, a JSON error names ``line i+1`` for ``rollouts[i]``); an
    unreadable file raises ``OSError``.
    """
    if layout not in ("trie", "replicated"):
        raise ValueError(f'layout {_reprlib.repr(layout)}: expected "trie" or "replicated"')
    if not isinstance(share_prefixes, bool):
        raise ValueError(f"share_prefixes must be True or False, got {_reprlib.repr(share_prefixes)}")
    if budget is not None:
        if isinstance(budget, bool) or not isinstance(budget, int):
            raise ValueError(f"budget must be a positive int or None, got {_reprlib.repr(budget)}")
        if not 0 < budget <= 0xFFFFFFFF:
            raise ValueError(f"budget must be in 1..=2^32-1 tokens (a pack indexes its rows in u32), got {budget}")
    source, value = _rollout_source(rollouts)
    return [_pack_of(p, layout) for p in _native.pack(source, value, layout, share_prefixes, budget)]


def _rollout_source(rollouts: Any):
    """``(source, value)`` for the native readers: ``("file", path)`` or
    ``("text", JSON Lines)`` of a list of dicts."""
    if isinstance(rollouts, (str, _os.PathLike)):
        return "file", _os.fspath(rollouts)
    if isinstance(rollouts, (list, tuple)):
        lines = []
        for i, r in enumerate(rollouts):
            if not isinstance(r, dict):
                raise ValueError(
                    f"rollouts[{i}] is a {type(r).__name__}, expected a dict "
                    '{"id": ..., "calls": [...]}'
                )
            try:
                lines.append(_json.dumps(r, allow_nan=False))
            except ValueError:
                # JSON has no NaN / infinity: say where, as the file reader would.
                raise ValueError(
                    f"rollouts[{i}] (id {_reprlib.repr(r.get('id'))}) holds a NaN or infinity: "
                    "token ids are integers, logprobs must be finite and <= 0, "
                    "and a reward must be finite"
                ) from None
            except TypeError as e:
                raise ValueError(f"rollouts[{i}] is not JSON-serialisable: {e}") from None
            except RecursionError:
                # The crate reads at most 128 levels of JSON anyway.
                raise ValueError(
                    f"rollouts[{i}] (id {_reprlib.repr(r.get('id'))}) is nested too deeply to be JSON"
                ) from None
        return "text", "\n".join(lines)
    raise ValueError(
        f"rollouts must be a JSONL path or a list of dicts, got {type(rollouts).__name__}"
    )


def _pack_of(p: Dict[str, Any], layout: str) -> Pack:
    """A :class:`Pack` from one pack dict of the native module."""
    t = {name: _tensor(dt, data) for name, (dt, data) in p["tensors"].items()}
    t["loss_logprobs"] = _tensor("float32", p["loss_logprobs"])
    return Pack(
        **{name: t.get(name) for name in PACK_TENSORS},
        layout=layout,
        rollout_indices=list(p["rollout_indices"]),
        rollout_ids=list(p["rollout_ids"]),
        groups=list(p["groups"]),
        stats=list(p["stats"]),
    )


def cost(pack: "Pack", model_cost: ModelCost) -> Dict[str, float]:
    """FLOPs of one training step (forward + backward) of ``model_cost``'s
    model on ``pack``, computed by the crate (``treeattn::cost``; formulas on
    :class:`ModelCost`, a native class): ``{"attention", "linear", "total", "visible_pairs",
    "tokens", "logit_rows"}``. A bad ``kv_end`` raises ``ValueError`` naming
    the key."""
    import torch

    if not isinstance(model_cost, ModelCost):
        raise ValueError(f"model_cost must be a treeattn.ModelCost, got {type(model_cost).__name__}")
    kv_end = pack.kv_end
    if not isinstance(kv_end, torch.Tensor) or kv_end.dim() != 1:
        raise ValueError("pack.kv_end must be a 1-D tensor")
    ke = kv_end.to(torch.int64)
    if ke.numel() and (int(ke.min()) < 0 or int(ke.max()) > 0xFFFFFFFF):
        raise ValueError("pack.kv_end has values outside 0..2^32-1")
    data = ke.to(torch.int32).contiguous().numpy().tobytes() if ke.numel() else b""
    rows = int(torch.unique(pack.loss_rows).numel()) if pack.loss_rows.numel() else 0
    return dict(_native.pack_cost(data, rows, model_cost))


@_dataclass
class Paths:
    """The path structure of a pack (Rust ``treeattn::paths``, DESIGN §11);
    all tensors CPU int64.

    ``parent`` ``[L]``: the row before ``t`` on its own root-to-``t`` path,
    ``max{k < t : kv_end[k] > t}``, or −1 at a root (``t − 1`` whenever
    ``kv_end[t − 1] > t``). ``row_node`` ``[L]``: each row's trie node.
    Nodes (``[N]``, pre-order) are maximal runs of rows ``[node_start,
    node_end)`` in which each row's parent is the row before it and has no
    other child; ``node_parent`` is the node holding ``parent[node_start]``
    (−1 at a root), ``node_level`` the number of nodes above it. The level
    schedule: the nodes of level ``l`` are
    ``level_nodes[level_offsets[l]:level_offsets[l + 1]]``; every node's
    parent is in an earlier level."""

    parent: Any
    row_node: Any
    node_start: Any
    node_end: Any
    node_parent: Any
    node_level: Any
    level_offsets: Any
    level_nodes: Any

    def __len__(self) -> int:
        return int(self.parent.shape[0])

    def __repr__(self) -> str:
        return (
            f"Paths(rows={int(self.parent.shape[0])}, nodes={int(self.node_start.shape[0])}, "
            f"levels={max(int(self.level_offsets.shape[0]) - 1, 0)})"
        )


def paths(kv_end: Any) -> Paths:
    """The :class:`Paths` of a pack's ``kv_end`` (a 1-D integer tensor or
    sequence), in ``O(L)``. ``ValueError`` when ``kv_end`` is not a nested
    pre-order layout (``k <= kv_end[k] <= L`` and ranges that nest), naming
    the row at fault."""
    import torch

    kv = torch.as_tensor(kv_end)
    if kv.dim() != 1:
        raise ValueError(f"kv_end must be 1-D, got shape {tuple(kv.shape)}")
    if kv.dtype.is_floating_point or kv.dtype == torch.bool:
        raise ValueError(f"kv_end must hold integers, got {kv.dtype}")
    data = kv.detach().to("cpu", torch.int64).contiguous().numpy().tobytes()
    out = _native.paths(data)
    return Paths(**{name: _tensor("int64", b) for name, b in out.items()})
