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
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch
from torch import Tensor

from .torch import sdcc_forward_kl, tree_attention

__all__ = ["register", "attention", "target_logprobs", "pack_loss", "NAME"]

NAME = "treeattn"


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
    q = query[0].transpose(0, 1)
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    o = tree_attention(q, k, v, kv_end.to(q.device), scale=scaling)
    return o[None], None


def _no_mask(*args: Any, **kwargs: Any) -> None:
    """Mask function of "treeattn": no dense mask; the op takes kv_end."""
    return None


def register() -> None:
    """Registers ``"treeattn"`` with transformers' ``AttentionInterface`` and
    ``AttentionMaskInterface``, and makes the recurrent layers of hybrid
    models run along the pack's paths when called with ``kv_end``
    (:func:`treeattn.hybrid.register`; idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, _no_mask)
    # Recurrent layers (Gated DeltaNet, Mamba-2) along the pack's paths;
    # other recurrent families refuse kv_end (treeattn.hybrid).
    from . import hybrid

    hybrid.register()


def _forward(model: Any, pack: Any, **kwargs: Any) -> Tensor:
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
