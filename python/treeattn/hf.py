"""Hugging Face transformers integration: tree attention as an attention
implementation, so one packed forward scores every target under its exact
live prefix.

Usage::

    import treeattn, treeattn.hf
    treeattn.hf.register()
    model.set_attn_implementation("treeattn")      # or from_pretrained(..., attn_implementation="treeattn")
    (pack,) = treeattn.pack("rollouts.jsonl")
    out = model(input_ids=pack.tokens[None], position_ids=pack.position_ids[None], kv_end=pack.kv_end)
    lp = treeattn.hf.target_logprobs(model, pack)  # one log-prob per loss entry

What is registered: an attention function ``"treeattn"`` with
``transformers.AttentionInterface`` (it reads ``kv_end`` from the model
call's keyword arguments, which transformers passes through to every
attention layer) and a mask function ``"treeattn"`` with
``AttentionMaskInterface`` that returns ``None``, so transformers never builds
a dense ``[L, L]`` mask. The model applies its own rotary embedding at the
pack's depth ``position_ids`` (so the op runs without fused rotary). With no
mask built, transformers' packed-sequence detection from non-arange
``position_ids`` (which would split the pack where a position does not
follow its predecessor) never applies. Batch size 1 (one pack); no dropout
inside attention; no KV cache (training / scoring only).

What is checked, so that a mistake is an error and not a wrong number:

- ``target_logprobs`` / ``pack_loss`` refuse a model whose config (or any
  sub-config, e.g. a multimodal model's text config) does not use
  ``"treeattn"``: with ``"sdpa"`` or ``"eager"`` transformers ignores
  ``kv_end`` and runs causal attention over the whole pack.
- The attention function checks, once per model forward (the first layer;
  cached while the same ``kv_end`` and ``position_ids`` tensors are used,
  unmodified), that every row's position id is its depth in the tree
  (parent's + 1, roots at 0), as every pack the crate writes has: a missing
  ``position_ids`` (transformers then fills ``0 … L−1``) or the position ids
  of another pack is a ``ValueError`` naming the first bad row. On CUDA the
  check costs one synchronization per forward, not per layer. Callers whose
  positions are offset on purpose opt out with
  ``register(check_positions=False)``.
- An ``attention_mask`` with a zero (padding) is refused: padding is
  expressed in ``kv_end`` (a padding key has ``kv_end[k] == k``); all ones is
  accepted.

What cannot be detected: ``kv_end`` of another pack of the same length whose
depths happen to equal this pack's position ids (the op sees a valid tree);
use :func:`target_logprobs` / :func:`pack_loss`, which take every tensor from
one ``Pack``.
"""

from __future__ import annotations

import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from .torch import sdcc_forward_kl, tree_attention

__all__ = ["register", "attention", "target_logprobs", "pack_loss", "require_treeattn", "tree_depths", "NAME"]

NAME = "treeattn"

# register(check_positions=...): whether the attention function checks the
# position ids against the tree.
_CHECK_POSITIONS = True
# The (kv_end, position_ids) pair checked last: weak references and the
# tensors' versions, so that the other layers of the same forward skip the
# check, and a new or modified tensor is checked again.
_checked: Optional[Tuple[Any, Any, int, int]] = None


def tree_depths(kv_end: Tensor) -> Tensor:
    """``[L]`` int64 on ``kv_end``'s device: each row's depth in the tree of
    ``kv_end``, the number of its ancestors ``#{k < t : kv_end[k] > t}``
    (O(L): each key adds 1 on its subtree's range ``(k, kv_end[k])``)."""
    n = kv_end.shape[0]
    end = kv_end.to(torch.int64)
    k = torch.arange(n, device=end.device)
    inner = end > k + 1
    diff = torch.zeros(n + 1, dtype=torch.int64, device=end.device)
    ones = torch.ones_like(k[inner])
    diff.index_add_(0, (k + 1)[inner], ones)
    diff.index_add_(0, end[inner], -ones)
    return diff.cumsum(0)[:n]


def _check_positions(position_ids: Optional[Tensor], kv_end: Tensor) -> None:
    """ValueError unless every non-padding row's position id is its depth."""
    global _checked
    if position_ids is None:
        raise ValueError(
            "treeattn attention got no position_ids: call the model with position_ids=pack.position_ids[None]"
        )
    pos = position_ids[0] if position_ids.dim() == 2 else position_ids
    c = _checked
    if (
        c is not None
        and c[0]() is kv_end
        and c[1]() is position_ids
        and (c[2], c[3]) == (kv_end._version, position_ids._version)
    ):
        return
    if pos.dim() != 1 or pos.shape[0] != kv_end.shape[0]:
        raise ValueError(
            f"position_ids of shape {tuple(position_ids.shape)} for a pack of {kv_end.shape[0]} rows"
        )
    depth = tree_depths(kv_end)
    rows = torch.arange(kv_end.shape[0], device=depth.device)
    bad = (pos.to(depth.device, torch.int64) != depth) & (kv_end.to(depth.device) != rows)
    if bool(bad.any()):
        r = int(bad.nonzero()[0, 0])
        hint = (
            " (transformers fills 0 … L−1 when no position_ids is given: "
            "pass position_ids=pack.position_ids[None])"
            if bool((pos.to(rows.device) == rows).all())
            else ""
        )
        raise ValueError(
            f"position_ids[{r}] = {int(pos[r])}, but row {r} is at depth {int(depth[r])} of the "
            f"tree of kv_end: the position ids are not this pack's{hint}; "
            "register(check_positions=False) turns this check off for offset positions"
        )
    _checked = (weakref.ref(kv_end), weakref.ref(position_ids), kv_end._version, position_ids._version)


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
    """transformers attention function: ``query`` ``[1, Hq, L, d]``,
    ``key`` / ``value`` ``[1, Hkv, L, d]`` (already rotated by the model);
    returns ``([1, L, Hq, d], None)``. Needs ``kv_end`` (``[L]`` or
    ``[1, L]``) among the model call's keyword arguments."""
    kv_end = kwargs.get("kv_end")
    if kv_end is None:
        raise ValueError(
            'attn_implementation "treeattn" needs the pack\'s mask: call the model with kv_end=pack.kv_end'
        )
    if not isinstance(kv_end, Tensor):
        raise ValueError(f"kv_end must be a torch.Tensor, got {type(kv_end).__name__}")
    if query.dim() != 4 or query.shape[0] != 1:
        raise ValueError(
            f"treeattn attention takes one pack (batch size 1), got query of shape {tuple(query.shape)}"
        )
    if key.shape[2] != query.shape[2]:
        raise ValueError(
            f"treeattn attention needs as many keys as queries (no KV cache): query {tuple(query.shape)}, key {tuple(key.shape)}"
        )
    if dropout:
        raise ValueError(f"treeattn attention has no dropout (got dropout={dropout}); set attention_dropout=0")
    if attention_mask is not None:
        raise ValueError(
            "treeattn attention got a mask from transformers: register the mask function too (treeattn.hf.register())"
        )
    if kv_end.dim() == 2 and kv_end.shape[0] == 1:
        kv_end = kv_end[0]
    if kv_end.dim() != 1 or kv_end.shape[0] != query.shape[2]:
        raise ValueError(
            f"kv_end of shape {tuple(kv_end.shape)} for {query.shape[2]} tokens: pass the pack's kv_end "
            "with the pack's tokens"
        )
    if _CHECK_POSITIONS:
        _check_positions(kwargs.get("position_ids"), kv_end)
    q = query[0].transpose(0, 1)
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    o = tree_attention(q, k, v, kv_end.to(q.device), scale=scaling)
    return o[None], None


def _no_mask(*args: Any, attention_mask: Optional[Tensor] = None, **kwargs: Any) -> None:
    """Mask function of "treeattn": no dense mask; the op takes kv_end. An
    ``attention_mask`` with a zero is refused (it would be ignored)."""
    if attention_mask is not None and not bool(attention_mask.bool().all()):
        zero = attention_mask.reshape(-1).bool().logical_not().nonzero()[0, 0]
        raise ValueError(
            f"attention_mask has a zero (at flat index {int(zero)}): treeattn ignores attention_mask; "
            "express padding in kv_end (a padding key has kv_end[k] == k) and pass no attention_mask"
        )
    return None


def register(*, check_positions: bool = True) -> None:
    """Registers ``"treeattn"`` with transformers' ``AttentionInterface`` and
    ``AttentionMaskInterface`` (idempotent). ``check_positions=False`` turns
    off the check that the position ids are the tree's depths (for callers
    whose positions are offset on purpose)."""
    global _CHECK_POSITIONS, _checked
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    _CHECK_POSITIONS = bool(check_positions)
    _checked = None
    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, _no_mask)


def _attn_implementations(config: Any, path: str = "config") -> List[Tuple[str, Any]]:
    """(path, attention implementation) of a config and its sub-configs."""
    out = [(path, getattr(config, "_attn_implementation", None))]
    for name in getattr(config, "sub_configs", None) or {}:
        sub = getattr(config, name, None)
        if sub is not None and hasattr(sub, "_attn_implementation"):
            out.extend(_attn_implementations(sub, f"{path}.{name}"))
    return out


def require_treeattn(model: Any) -> None:
    """ValueError unless the model's config and every sub-config use the
    ``"treeattn"`` attention implementation (with another one, transformers
    ignores ``kv_end`` and the log-probs are silently wrong)."""
    bad = [(p, impl) for p, impl in _attn_implementations(model.config) if impl != NAME]
    if bad:
        where = ", ".join(f"{p}._attn_implementation = {impl!r}" for p, impl in bad)
        raise ValueError(
            f"the model does not use treeattn attention ({where}): call treeattn.hf.register() and "
            'model.set_attn_implementation("treeattn") (or from_pretrained(..., attn_implementation="treeattn"))'
        )


def _forward(model: Any, pack: Any, **kwargs: Any) -> Tensor:
    require_treeattn(model)
    device = next(model.parameters()).device
    out = model(
        input_ids=pack.tokens[None].to(device),
        position_ids=pack.position_ids[None].to(device),
        kv_end=pack.kv_end.to(device),
        use_cache=False,
        **kwargs,
    )
    return out.logits[0]


def target_logprobs(model: Any, pack: Any, logits: Optional[Tensor] = None) -> Tensor:
    """Log-probability of every loss entry of ``pack`` (``[T]``, in the
    pack's loss order) from one packed forward of ``model`` (which must use
    ``attn_implementation="treeattn"``), or from given ``logits`` ``[L, V]``."""
    if logits is None:
        logits = _forward(model, pack)
    rows = pack.loss_rows.to(logits.device)
    labels = pack.loss_labels.to(logits.device)
    lp = torch.log_softmax(logits[rows], dim=-1)
    return lp.gather(-1, labels[:, None])[:, 0]


def pack_loss(
    model: Any,
    pack: Any,
    sdcc_lambda: float = 0.0,
    tau: float = 1.0,
) -> Dict[str, Tensor]:
    """The training loss of one pack: ``nll = −Σ w·log p / Σ w`` over the
    loss entries, plus ``sdcc_lambda · SDCC`` (forward KL(teacher ‖ student)
    at the pack's SDCC pairs, teacher stop-gradient; the paper ramps λ from
    0 to 0.1 over the first 20% of steps — the ramp is the caller's).
    Returns ``{"loss", "nll", "sdcc", "logprobs"}``."""
    logits = _forward(model, pack)
    lp = target_logprobs(model, pack, logits)
    w = pack.loss_weights.to(lp.device, lp.dtype)
    nll = -(w * lp).sum() / w.sum().clamp_min(torch.finfo(lp.dtype).tiny)
    sdcc = torch.zeros((), dtype=lp.dtype, device=lp.device)
    if sdcc_lambda:
        if pack.sdcc_student_rows is None:
            raise ValueError("sdcc_lambda > 0 needs a trie-layout pack (the replicated layout has no SDCC pairs)")
        if pack.sdcc_student_rows.numel() > 0:
            sdcc, _ = sdcc_forward_kl(logits, pack.sdcc_student_rows, pack.sdcc_teacher_rows, tau=tau)
    return {"loss": nll + sdcc_lambda * sdcc, "nll": nll, "sdcc": sdcc, "logprobs": lp}
