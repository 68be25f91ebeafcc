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
follow its predecessor) never applies. Batches: ``kv_end`` ``[B, L]`` with
``input_ids`` / ``position_ids`` ``[B, L]`` (packs padded to one length by
:func:`treeattn.collate`, padding keys ``kv_end[k] == k``) run as one forest
of ``B·L`` rows; :func:`target_logprobs` and :func:`pack_loss` take the
collated dict in place of a pack. No dropout inside attention; no KV cache
(training / scoring only).

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
  ``register(check_positions=False)``. (A model that passes no position ids
  to its attention layers — GraniteMoeHybrid — is not checked.)
- An ``attention_mask`` with a zero (padding) is refused: padding is
  expressed in ``kv_end`` (a padding key has ``kv_end[k] == k``); all ones is
  accepted.

What cannot be detected: ``kv_end`` of another pack of the same length whose
depths happen to equal this pack's position ids (the op sees a valid tree);
use :func:`target_logprobs` / :func:`pack_loss`, which take every tensor from
one ``Pack``.

Scoring (:func:`target_logprobs`, :func:`pack_loss`) never builds ``[L, V]``
or ``[T, V]`` logits: the body runs once and the output embedding +
log-softmax run in row chunks at the loss / SDCC rows only, recomputed in
backward (see "Log-probs without [L, V] logits" below). The output
embedding must be a linear layer whose logits the model uses as they are,
or scaled (Cohere's ``logit_scale``, Granite's ``logits_scaling``) and / or
softcapped (``final_logit_softcapping``, Gemma) as its config says; one
probe row is checked against the model's own logits, and anything else is
refused (pass ``logits=`` to :func:`target_logprobs` then).
"""

from __future__ import annotations

import math
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor

# The chunked head ops live in treeattn/head.py (the op layer); CHUNK_ELEMENTS
# and default_chunk stay importable from here, where they were.
from .head import CHUNK_ELEMENTS, _head_logits, _HeadLogprob, _HeadSdcc, _Post, default_chunk  # noqa: F401
from .torch import MaskPlan, _depths, tree_attention

__all__ = [
    "register", "attention", "target_logprobs", "pack_loss", "values", "default_chunk",
    "require_treeattn", "tree_depths", "shard_logprobs", "NAME",
]

NAME = "treeattn"

# register(check_positions=...): whether the attention function checks the
# position ids against the tree.
_CHECK_POSITIONS = True
# The (kv_end, position_ids) pair checked last: weak references and the
# tensors' versions, so that the other layers of the same forward skip the
# check, and a new or modified tensor is checked again.
_checked: Optional[Tuple[Any, Any, int, int]] = None
# The mask plan (MaskPlan) of the forest kv_end seen last (_forest: the same
# tensor in every layer of a forward): a weak reference to it, its version
# and the device; built by the first attention layer of a forward and reused
# by every other layer (and by a later forward on the same, unmodified
# tensor). A new tensor, an in-place change (its version moves) or another
# device builds a new one.
_plan: Optional[Tuple[Any, int, Any, MaskPlan]] = None
# Calls of :func:`attention` so far: the scoring functions check that a
# forward reached it (a model whose attention bypasses transformers'
# attention interface would otherwise score the pack with plain causal
# attention, silently).
_attention_calls = 0


def _mask_plan(kv_end: Tensor, device: torch.device) -> MaskPlan:
    """The plan of ``kv_end`` on ``device``, built once per tensor."""
    global _plan
    c = _plan
    if c is not None and c[0]() is kv_end and c[1] == kv_end._version and c[2] == device:
        return c[3]
    m = MaskPlan(kv_end, device=device)
    _plan = (weakref.ref(kv_end), kv_end._version, device, m)
    return m


def tree_depths(kv_end: Tensor) -> Tensor:
    """``[L]`` int64 on ``kv_end``'s device: each row's depth in the tree of
    ``kv_end``, the number of its ancestors ``#{k < t : kv_end[k] > t}``
    (O(L), computed by the crate: ``treeattn::cost::depths``; a ``kv_end``
    outside ``k <= kv_end[k] <= L`` is a :class:`treeattn.PackError`)."""
    return _depths(kv_end)


def _check_positions(position_ids: Optional[Tensor], kv_end: Tensor) -> None:
    """ValueError unless every non-padding row's position id is its depth."""
    global _checked
    if position_ids is None:
        # The model does not hand position ids to its attention layers
        # (GraniteMoeHybrid, say): nothing to check here.
        return
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


# Keyword arguments transformers hands an attention function that do not
# change what it computes: the model call's own bookkeeping. Anything else
# with a value (not None) is either computed here (kv_end, treeattn_shard,
# position_ids, sliding_window, softcap, s_aux) or refused by name.
# ``output_router_logits`` and ``num_items_in_batch`` are fields of
# transformers' ``TransformersKwargs`` (utils/generic.py, 5.24): the MoE
# families' causal LMs (Mixtral, Qwen2/3-MoE, OLMoE, gpt-oss, …) pass
# ``output_router_logits`` (False by default) down every layer, and the
# Trainer passes ``num_items_in_batch`` to the model call for the loss; no
# attention function of transformers reads either (integrations/
# sdpa_attention.py, flash_attention.py, flex_attention.py and the eager
# functions).
_INERT_KWARGS = frozenset({
    "use_cache", "output_attentions", "output_hidden_states", "return_dict", "cache_position",
    "past_key_values", "past_key_value", "layer_idx", "is_causal", "position_embeddings",
    "output_router_logits", "num_items_in_batch",
})
_HANDLED_KWARGS = frozenset({
    "kv_end", "treeattn_shard", "position_ids", "sliding_window", "softcap", "s_aux", "deterministic",
})


def _deterministic(kwargs: Dict[str, Any]) -> bool:
    """Whether the backward must give a bit-identical dQ (the CUDA
    kernels' deterministic dQ; CPU is deterministic anyway): the call's
    ``deterministic`` keyword when given (as transformers' flash attention
    reads it), else ``torch.are_deterministic_algorithms_enabled()`` (where
    transformers' flash attention reads ``FLASH_ATTENTION_DETERMINISTIC``:
    ``torch.use_deterministic_algorithms(True)`` is torch's switch for the
    same wish)."""
    d = kwargs.get("deterministic")
    if d is None:
        return bool(torch.are_deterministic_algorithms_enabled())
    if not isinstance(d, bool):
        raise ValueError(f"deterministic = {d!r}: expected a bool (True or False) or None")
    return d


def _variants(module: Any, kwargs: Dict[str, Any]) -> Tuple[Optional[int], Optional[float], Optional[Tensor]]:
    """The attention variants a transformers layer asks for — ``(window,
    softcap, sinks)`` from ``sliding_window``, ``softcap`` and ``s_aux`` —
    after refusing any keyword that would change the math and that treeattn
    does not compute (Llama 4's chunked attention, a non-causal layer, a
    packed-varlen layout), naming it."""
    unknown = sorted(
        k for k, v in kwargs.items()
        if v is not None and k not in _INERT_KWARGS and k not in _HANDLED_KWARGS
    )
    if unknown:
        raise ValueError(
            f"treeattn attention got keyword argument(s) {unknown} from {type(module).__name__}: they would change "
            "what attention computes and treeattn does not compute them; they are refused rather than ignored "
            "(the attention variants treeattn computes: sliding_window, softcap, s_aux)"
        )
    if kwargs.get("is_causal") is False or getattr(module, "is_causal", True) is False:
        raise ValueError(
            f"{type(module).__name__} is not causal (is_causal=False): treeattn attention is causal along the tree"
        )
    window = kwargs.get("sliding_window")
    if window is not None:
        if isinstance(window, Tensor):
            window = int(window)
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"sliding_window = {window!r}: expected an int >= 1")
    softcap = kwargs.get("softcap")
    if softcap is not None:
        softcap = float(softcap)
        if not (math.isfinite(softcap) and softcap > 0):
            raise ValueError(f"softcap = {softcap!r}: expected a finite float > 0")
    sinks = kwargs.get("s_aux")
    if sinks is not None and not isinstance(sinks, Tensor):
        raise ValueError(f"s_aux must be a tensor of one logit per query head, got {type(sinks).__name__}")
    return window, softcap, sinks


# Modeling modules (transformers 5.24) whose model forward builds a sliding
# window mask for every layer whenever ``config.sliding_window`` is set
# (``create_sliding_window_causal_mask``; phimoe: PhimoeModel.forward, doge:
# DogeModel.forward) while the attention layer passes no ``sliding_window``
# to the attention function: the window lives only in the mask, which
# treeattn's mask function does not build.
_WINDOW_IN_MASK_ONLY = frozenset({
    "transformers.models.phimoe.modeling_phimoe",
    "transformers.models.doge.modeling_doge",
})


# Modeling modules (transformers 5.24) whose decoder embeds the positions
# ``0 … L−1`` of the packed order itself (``position_ids =
# torch.arange(seq_length) + cache_length`` in ``*Decoder.forward``) and
# ignores the caller's ``position_ids``, which still reach the attention
# layers (so the depth check passes): on a tree pack every row after the
# first root's path would be embedded at the wrong position. The BART
# family's decoders, used as causal LMs (``BartForCausalLM`` …).
_POSITIONS_FROM_PACKED_ORDER = frozenset(
    f"transformers.models.{m}.modeling_{m}"
    for m in ("bart", "mbart", "blenderbot", "blenderbot_small", "marian", "pegasus", "plbart")
)


def _mask_only_pattern(module: Any, window: Optional[int]) -> Optional[Tuple[str, Optional[int]]]:
    """``(what, size)`` of a restriction that transformers would apply to
    this layer through the mask it builds (a sliding window, chunked
    attention) and that the layer does not hand the attention function as
    a keyword, so treeattn would not see it; None when there is none.

    A layer's mask follows ``config.layer_types[layer_idx]``
    (``masking_utils.LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING``):
    ``"sliding_attention"`` masks ``q − k >= config.sliding_window`` (a layer
    that does not pass ``sliding_window`` — Qwen2-MoE with
    ``use_sliding_window`` in transformers 5.24 — would be attended in
    full), ``"chunked_attention"`` masks keys outside the query's chunk of
    ``config.attention_chunk_size`` positions (Llama 4), which treeattn does
    not compute."""
    if window is not None:
        return None
    config = getattr(module, "config", None)
    types = getattr(config, "layer_types", None)
    idx = getattr(module, "layer_idx", None)
    kind = None
    if isinstance(types, (list, tuple)) and isinstance(idx, int) and 0 <= idx < len(types):
        kind = types[idx]
    if kind == "sliding_attention":
        return "a sliding window", getattr(config, "sliding_window", None)
    if kind == "chunked_attention":
        return "chunks", getattr(config, "attention_chunk_size", None)
    if type(module).__module__ in _WINDOW_IN_MASK_ONLY and getattr(config, "sliding_window", None) is not None:
        return "a sliding window", config.sliding_window
    return None


def _refuse_mask_only(module: Any, what: str, size: Optional[int], deepest: Optional[int]) -> None:
    where = "" if deepest is None else f", and this pack has rows at depth {deepest}"
    raise ValueError(
        f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}) restricts attention to {what} of "
        f"{size} positions only through the mask transformers builds, not through a keyword argument of the "
        f"attention function{where}: treeattn builds no such mask and would attend across the whole path, so "
        "it refuses rather than give wrong numbers"
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
    """transformers attention function: ``query`` ``[B, Hq, L, d]``,
    ``key`` ``[B, Hkv, L, d]``, ``value`` ``[B, Hkv, L, dv]`` (already
    rotated by the model; ``dv`` may differ: multi-head latent attention);
    returns ``([B, L, Hq, dv], None)``. Needs ``kv_end`` (``[L]`` or
    ``[1, L]`` for one pack, ``[B, L]`` for a :func:`treeattn.collate`
    batch, run as one forest) among the model call's keyword arguments — or
    ``treeattn_shard`` (a :class:`treeattn.distributed.Shard`; then ``L`` is
    the shard's rows and the call is context-parallel).

    The layer's attention variants are computed on the tree, never dropped:
    ``sliding_window`` (Mistral, Gemma 2/3, Cohere2, Starcoder2, gpt-oss,
    Qwen2 with ``use_sliding_window``: a window of tree levels, which on a
    chain is transformers' ``q − k < W``), ``softcap`` (Gemma 2's
    ``attn_logit_softcapping``) and ``s_aux`` (gpt-oss's sinks); any other
    keyword that would change the math is a ``ValueError`` naming it.

    ``deterministic`` (a model-call keyword, as for transformers' flash
    attention; default ``torch.are_deterministic_algorithms_enabled()``)
    asks the CUDA backward for a bit-identical dQ
    (:func:`treeattn.torch.tree_attention`'s ``deterministic``)."""
    global _attention_calls
    _attention_calls += 1
    window, softcap, sinks = _variants(module, kwargs)
    deterministic = _deterministic(kwargs)
    if type(module).__module__ in _POSITIONS_FROM_PACKED_ORDER:
        raise ValueError(
            f"{type(module).__name__}: this decoder embeds the positions 0 … L−1 of the packed order itself and "
            "ignores position_ids, so on a tree pack the rows of every branch after the first would get wrong "
            "positions; treeattn refuses it rather than give wrong numbers"
        )
    pattern = _mask_only_pattern(module, window)
    shard = kwargs.get("treeattn_shard")
    if shard is not None:
        if pattern is not None:
            # No depth test here: every rank must take the same decision.
            _refuse_mask_only(module, *pattern, None)
        return _shard_attention(query, key, value, attention_mask, scaling, dropout, shard, window, softcap, sinks,
                                deterministic)
    kv_end = kwargs.get("kv_end")
    if kv_end is None:
        raise ValueError(
            'attn_implementation "treeattn" needs the pack\'s mask: call the model with kv_end=pack.kv_end '
            f"(if the model was called with it, {type(module).__name__} did not hand the model call's keyword "
            "arguments to its attention function — its decoder layer drops them, as Nemotron's and StableLM's "
            "do in transformers 5.24 — and cannot run on a tree pack)"
        )
    given: Optional[MaskPlan] = None
    if isinstance(kv_end, MaskPlan):
        given, kv_end = kv_end, kv_end.kv_end
    if not isinstance(kv_end, Tensor):
        raise ValueError(f"kv_end must be a torch.Tensor, got {type(kv_end).__name__}")
    if query.dim() != 4:
        raise ValueError(f"treeattn attention takes query [B, H, L, d], got shape {tuple(query.shape)}")
    if key.shape[2] != query.shape[2]:
        raise ValueError(
            f"treeattn attention needs as many keys as queries, one per packed token: query {tuple(query.shape)}, "
            f"key {tuple(key.shape)} from {type(module).__name__} (a KV cache, or keys that are not the tokens "
            "themselves — e.g. DeepSeek-V4's compressed key blocks — cannot be placed on the tree)"
        )
    if dropout:
        raise ValueError(f"treeattn attention has no dropout (got dropout={dropout}); set attention_dropout=0")
    if attention_mask is not None:
        raise ValueError(
            f"treeattn attention got a mask from transformers in {type(module).__name__}: register the mask "
            "function too (treeattn.hf.register()); with it registered, transformers builds no mask, so the "
            "layer made this one itself (e.g. Doge's learned dynamic mask) and treeattn cannot apply it"
        )
    B, L = int(query.shape[0]), int(query.shape[2])
    if given is not None and B != 1:
        raise ValueError(f"a MaskPlan is one pack's mask, got a batch of {B}: pass treeattn.collate's kv_end [B, L]")
    shape2 = (1,) + tuple(kv_end.shape) if kv_end.dim() == 1 else tuple(kv_end.shape)
    if shape2 != (B, L):
        raise ValueError(
            f"kv_end of shape {tuple(kv_end.shape)} for a batch of {B} × {L} tokens: pass the pack's kv_end "
            "with the pack's tokens ([L] or [1, L]), or treeattn.collate's [B, L] with its input_ids"
        )
    position_ids = kwargs.get("position_ids")
    flat, flat_pos = _forest(kv_end, position_ids)
    if _CHECK_POSITIONS:
        _check_positions(flat_pos, flat)
    if pattern is not None:
        # The restriction changes nothing while every row is shallower than
        # its size (then the layer's transformers mask is plain causal).
        deepest = int(tree_depths(flat).max()) if flat.numel() else 0
        if pattern[1] is None or deepest >= pattern[1]:
            _refuse_mask_only(module, *pattern, deepest)
    # The B packs as one forest of B·L rows: row (b, t) is b·L + t.
    q = query.transpose(1, 2).reshape(B * L, query.shape[1], query.shape[3])
    k = key.transpose(1, 2).reshape(B * L, key.shape[1], key.shape[3])
    v = value.transpose(1, 2).reshape(B * L, value.shape[1], value.shape[3])
    # One plan per forward, not per layer: validated once, and on CUDA
    # uploaded once (no host copy, no synchronization in the other layers).
    # `flat` is the same tensor in every layer of a forward (_forest).
    if given is not None and given.kv_end.device == q.device:
        mask = given
    else:
        mask = _mask_plan(flat, q.device)
    # "auto": the crate's CPU backend, its CUDA kernels where they run the
    # call (bf16 / f16, head dim 64 or 128, with or without a window,
    # softcap or sinks), else FlexAttention (a GPU model with MLA).
    o = tree_attention(q, k, v, mask, scale=scaling, window=window, softcap=softcap, sinks=sinks, backend="auto",
                       deterministic=deterministic)
    return o.reshape(B, L, o.shape[1], o.shape[2]), None


# The batch flattened last: weak references to the model call's kv_end and
# position_ids with their versions, and the forest's (kv_end, position_ids),
# so that every layer of one forward gets the same tensors (and the position
# check, cached on them, runs once per forward).
_forest_cache: Optional[Tuple[Any, Any, int, int, Tensor, Optional[Tensor]]] = None


def _forest(kv_end: Tensor, position_ids: Optional[Tensor]) -> Tuple[Tensor, Optional[Tensor]]:
    """``kv_end`` ``[B, L]`` (or one pack's ``[L]``) as one ``[B·L]`` forest (pack ``b``'s keys
    shifted by ``b·L``; no query crosses packs) and ``position_ids`` flattened
    alike (``None`` stays ``None``)."""
    global _forest_cache
    c = _forest_cache
    pv = -1 if position_ids is None else position_ids._version
    if (
        c is not None
        and c[0]() is kv_end
        and (c[1] is None if position_ids is None else (c[1] is not None and c[1]() is position_ids))
        and (c[2], c[3]) == (kv_end._version, pv)
    ):
        return c[4], c[5]
    B, L = (1, int(kv_end.shape[0])) if kv_end.dim() == 1 else (int(kv_end.shape[0]), int(kv_end.shape[1]))
    if kv_end.dim() == 1:
        flat = kv_end
    elif B == 1:
        flat = kv_end[0]
    else:
        off = torch.arange(B, device=kv_end.device, dtype=kv_end.dtype)[:, None] * L
        flat = (kv_end + off).reshape(B * L)
    pos = None
    if position_ids is not None:
        p2 = position_ids[None] if position_ids.dim() == 1 else position_ids
        if p2.dim() != 2 or p2.shape[1] != L or p2.shape[0] not in (1, B):
            raise ValueError(f"position_ids of shape {tuple(position_ids.shape)} for a batch of {B} × {L} tokens")
        pos = p2.expand(B, L).reshape(B * L)
    _forest_cache = (
        weakref.ref(kv_end),
        None if position_ids is None else weakref.ref(position_ids),
        kv_end._version,
        pv,
        flat,
        pos,
    )
    return flat, pos


def _shard_attention(query, key, value, attention_mask, scaling, dropout, shard, window=None, softcap=None,
                     sinks=None, deterministic=False):
    """The context-parallel branch of :func:`attention`
    (:func:`treeattn.distributed.tree_attention` on this rank's rows)."""
    from .distributed import tree_attention as cp_attention

    if query.dim() != 4 or query.shape[0] != 1:
        raise ValueError(
            f"context-parallel treeattn attention takes one pack's shard (batch 1), got query of shape {tuple(query.shape)}"
        )
    if dropout:
        raise ValueError(f"treeattn attention has no dropout (got dropout={dropout}); set attention_dropout=0")
    if attention_mask is not None:
        raise ValueError(
            "treeattn attention got a mask from transformers: register the mask function too (treeattn.hf.register())"
        )
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    return cp_attention(q, k, v, shard, scale=scaling, window=window, softcap=softcap, sinks=sinks,
                        deterministic=deterministic)[None], None


def shard_logprobs(model: Any, shard: Any) -> Tensor:
    """Log-probabilities of this rank's loss entries (``shard.loss_index``
    of the pack's, in that order, ``[T_local]``) from one context-parallel
    forward of ``model`` (``attn_implementation="treeattn"``) on the shard's
    rows: ``model(input_ids=s.tokens[None], position_ids=s.position_ids[None],
    treeattn_shard=s)``, logits only at the loss rows. Every rank of the
    shard's group must call it (and backward through it), with or without
    loss entries: the attention layers exchange K / V. A rank with no loss
    entry returns an empty tensor still tied to the lm_head (zero
    gradients), so every rank's parameters get a gradient."""
    device = next(model.parameters()).device
    rows = shard.loss_rows_local.to(device)
    keep, inverse = torch.unique(rows, return_inverse=True)
    anchor = keep.numel() == 0  # no loss row here: keep row 0 so the lm_head is in the graph
    if anchor:
        keep = torch.zeros(1, dtype=torch.int64, device=device)
    out = model(
        input_ids=shard.tokens[None].to(device),
        position_ids=shard.position_ids[None].to(device),
        treeattn_shard=shard,
        use_cache=False,
        logits_to_keep=keep,
    )
    logits = out.logits[0]
    if anchor:
        return logits.sum() * 0 + torch.zeros(0, dtype=logits.dtype, device=device)
    lp = torch.log_softmax(logits[inverse], dim=-1)
    return lp.gather(-1, shard.loss_labels.to(device)[:, None])[:, 0]


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


def _guard_call(model: Any, kwargs: Dict[str, Any]) -> None:
    """What a model call with a pack's mask must not be: a model whose
    attention is not ``"treeattn"`` (sdpa, eager, flash would ignore
    ``kv_end`` and attend causally across the pack), or a call with
    ``labels`` (transformers shifts labels by row position, which is wrong
    at every branch of a pack)."""
    bad = [(p, impl) for p, impl in _attn_implementations(model.config) if impl != NAME]
    # A model without attention layers (Mamba) runs the pack through
    # treeattn.hybrid, whatever its attention implementation says.
    if bad and _has_attention_layers(model):
        where = ", ".join(f"{p}._attn_implementation = {impl!r}" for p, impl in bad)
        raise ValueError(
            f"{type(model).__name__} was called with a tree pack's mask (kv_end / treeattn_shard) but {where}: "
            "that attention would ignore kv_end and attend causally across the whole pack; "
            'call model.set_attn_implementation("treeattn") first'
        )
    if kwargs.get("labels") is not None:
        raise ValueError(
            f"{type(model).__name__} was called with labels= and a tree pack's mask: transformers shifts labels "
            "by row position (row t predicts row t + 1), which is wrong at every branch of a pack, whose "
            "targets are (logit row, label) pairs; use treeattn.hf.pack_loss(model, pack) or "
            "treeattn.hf.target_logprobs(model, pack)"
        )


def _install_call_guard() -> None:
    """Every transformers model call that carries ``kv_end`` or
    ``treeattn_shard`` goes through :func:`_guard_call` first (a
    ``PreTrainedModel.__call__`` override, installed once; other calls are
    untouched)."""
    from transformers import PreTrainedModel

    if getattr(PreTrainedModel, "_treeattn_call_guard", False):
        return
    call = PreTrainedModel.__call__

    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("kv_end") is not None or kwargs.get("treeattn_shard") is not None:
            _guard_call(self, kwargs)
        return call(self, *args, **kwargs)

    PreTrainedModel.__call__ = __call__
    PreTrainedModel._treeattn_call_guard = True


def register(*, check_positions: bool = True) -> None:
    """Registers ``"treeattn"`` with transformers' ``AttentionInterface`` and
    ``AttentionMaskInterface`` (idempotent), and makes the recurrent layers
    of hybrid models run along the pack's paths when called with ``kv_end``
    (:func:`treeattn.hybrid.register`). ``check_positions=False`` turns off
    the check that the position ids are the tree's depths (for callers whose
    positions are offset on purpose).

    From then on, a transformers model called with ``kv_end`` (or a
    context-parallel ``treeattn_shard``) whose attention is not
    ``"treeattn"`` — sdpa, eager, flash would ignore the mask — or with
    ``labels=`` (shifted by row position: wrong on a tree) raises
    ``ValueError`` naming the fix, instead of returning plausible numbers."""
    global _CHECK_POSITIONS, _checked
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    _CHECK_POSITIONS = bool(check_positions)
    _checked = None
    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, _no_mask)
    _install_call_guard()
    # Recurrent layers (Gated DeltaNet, Mamba-2) along the pack's paths;
    # other recurrent families refuse kv_end (treeattn.hybrid).
    from . import hybrid

    hybrid.register()


def _attn_implementations(config: Any, path: str = "config") -> List[Tuple[str, Any]]:
    """(path, attention implementation) of a config and its sub-configs."""
    out = [(path, getattr(config, "_attn_implementation", None))]
    for name in getattr(config, "sub_configs", None) or {}:
        sub = getattr(config, name, None)
        if sub is not None and hasattr(sub, "_attn_implementation"):
            out.extend(_attn_implementations(sub, f"{path}.{name}"))
    return out


def _inner(model: Any) -> Any:
    """The model under data-parallel wrappers (DDP, FSDP: ``.module``), for
    its config and output embedding; the forward still goes through the
    wrapper, so its gradient hooks run."""
    m = model
    while not hasattr(m, "config") and hasattr(m, "module"):
        m = m.module
    return m


def require_treeattn(model: Any) -> None:
    """ValueError unless the model's config and every sub-config use the
    ``"treeattn"`` attention implementation (with another one, transformers
    ignores ``kv_end`` and the log-probs are silently wrong)."""
    inner = _inner(model)
    bad = [(p, impl) for p, impl in _attn_implementations(inner.config) if impl != NAME]
    # A model without attention layers (Mamba) runs the pack through
    # treeattn.hybrid, whatever its attention implementation says.
    if bad and _has_attention_layers(inner):
        where = ", ".join(f"{p}._attn_implementation = {impl!r}" for p, impl in bad)
        if not getattr(inner, "_supports_attention_backend", True):
            raise ValueError(
                f"{type(inner).__name__} does not route its attention through transformers' attention interface "
                f"({where}; its family takes no custom attention implementation): treeattn cannot run it on a tree pack"
            )
        raise ValueError(
            f"the model does not use treeattn attention ({where}): call treeattn.hf.register() and "
            'model.set_attn_implementation("treeattn") (or from_pretrained(..., attn_implementation="treeattn"))'
        )


class _Scored:
    """What the scoring functions read, from a :class:`treeattn.Pack` or a
    :func:`treeattn.collate` batch: ``[B, L]`` row tensors and loss / SDCC
    rows flattened to the forest's rows ``b·L + t``."""

    def __init__(self, x: Any) -> None:
        if isinstance(x, dict):
            need = ("input_ids", "position_ids", "kv_end", "loss_batch", "loss_rows", "loss_labels", "loss_weights")
            missing = [n for n in need if not isinstance(x.get(n), Tensor)]
            if missing:
                raise ValueError(f"batch dict without {missing}: build it with treeattn.collate(packs)")
            self.tokens, self.position_ids, self.kv_end = x["input_ids"], x["position_ids"], x["kv_end"]
            if self.tokens.dim() != 2 or self.position_ids.shape != self.tokens.shape or self.kv_end.shape != self.tokens.shape:
                raise ValueError(
                    f"batch input_ids {tuple(self.tokens.shape)}, position_ids {tuple(self.position_ids.shape)}, "
                    f"kv_end {tuple(self.kv_end.shape)}: expected three [B, L] tensors"
                )
            B, L = self.tokens.shape
            lb = x["loss_batch"].to(torch.int64)
            if lb.shape != x["loss_rows"].shape or (lb.numel() and (int(lb.min()) < 0 or int(lb.max()) >= B)):
                raise ValueError(f"batch loss_batch must name a pack 0..{B - 1} for every loss entry")
            self.loss_rows = lb * L + x["loss_rows"].to(torch.int64)
            self.loss_labels, self.loss_weights = x["loss_labels"], x["loss_weights"]
            if isinstance(x.get("sdcc_batch"), Tensor):
                sb = x["sdcc_batch"].to(torch.int64) * L
                self.sdcc_student_rows = sb + x["sdcc_student_rows"].to(torch.int64)
                self.sdcc_teacher_rows = sb + x["sdcc_teacher_rows"].to(torch.int64)
            else:
                self.sdcc_student_rows = self.sdcc_teacher_rows = None
        else:
            self.tokens, self.position_ids, self.kv_end = x.tokens[None], x.position_ids[None], x.kv_end[None]
            self.loss_rows, self.loss_labels, self.loss_weights = x.loss_rows, x.loss_labels, x.loss_weights
            self.sdcc_student_rows, self.sdcc_teacher_rows = x.sdcc_student_rows, x.sdcc_teacher_rows
        self.batch, self.length = int(self.tokens.shape[0]), int(self.tokens.shape[1])


def _check_tokens(model: Any, batch: _Scored) -> None:
    """ValueError naming the first row whose token id is outside the
    model's input vocabulary (before the forward: the embedding would raise
    a bare IndexError)."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    vocab = getattr(emb, "num_embeddings", None)
    tokens = batch.tokens
    if not isinstance(vocab, int) or tokens.numel() == 0:
        return
    bad = (tokens < 0) | (tokens >= vocab)
    if bool(bad.any()):
        flat = int(bad.reshape(-1).nonzero()[0, 0])
        b, t = divmod(flat, batch.length)
        where = f"row {t}" if batch.batch == 1 else f"pack {b}, row {t}"
        raise ValueError(
            f"token id {int(tokens.reshape(-1)[flat])} at {where} is outside the model's vocabulary 0..{vocab - 1}"
        )


def _has_attention_layers(model: Any) -> bool:
    """Whether the model has attention layers (modules named ``*Attention``;
    a pure recurrent model — Mamba — has none), cached per model."""
    if not hasattr(model, "modules"):
        return True  # not an nn.Module: assume it has
    has = model.__dict__.get("_treeattn_has_attention")
    if has is None:
        has = any(type(m).__name__.endswith("Attention") for m in model.modules())
        model.__dict__["_treeattn_has_attention"] = has
    return has


def _check_attention_ran(model: Any, calls_before: int) -> None:
    """ValueError when a forward with ``kv_end`` never reached treeattn's
    attention although the model has attention layers: their attention does
    not go through transformers' attention interface (GIT's text attention,
    chosen when the model was built), so they attended causally over the
    whole pack."""
    if _attention_calls == calls_before and _has_attention_layers(model):
        raise ValueError(
            f"{type(model).__name__}'s forward never called treeattn's attention although the model has attention "
            "layers: they do not go through transformers' attention interface (the implementation is fixed when "
            "the model is built, or the family does not support set_attn_implementation), so they attended "
            "causally across the whole pack; this model cannot run on a tree pack"
        )


def _forward(model: Any, batch: _Scored, **kwargs: Any) -> Tensor:
    require_treeattn(model)
    inner = _inner(model)
    _check_tokens(inner, batch)
    device = next(model.parameters()).device
    before = _attention_calls
    out = model(
        input_ids=batch.tokens.to(device),
        position_ids=batch.position_ids.to(device),
        kv_end=batch.kv_end.to(device),
        use_cache=False,
        **kwargs,
    )
    _check_attention_ran(inner, before)
    return out.logits


# --------------------------------------------------------------------------
# Log-probs without [L, V] logits
#
# The model body runs once; the output embedding's input (the final hidden
# states h [L, H]) is taken from a forward pre-hook, which hands the output
# embedding one row only (the last), so the model's own head computes a
# [1, V] block. The rows that carry a loss (loss rows, SDCC student and
# teacher rows) are gathered from h, and the head z = h·Wᵀ (+ b), softcapped
# if the config says so, is computed in row chunks inside autograd Functions
# that keep only per-row scalars and recompute each chunk's logits in
# backward (treeattn/head.py). Extra memory: a few [chunk, V] buffers,
# whatever L and T.

def _text_config(model: Any) -> Any:
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "get_text_config"):
        try:
            return cfg.get_text_config()
        except Exception:  # pragma: no cover - configs without a text part
            return cfg
    return cfg


def _head(model: Any) -> Tuple[Any, Tensor, Optional[Tensor], _Post]:
    """The output embedding module, its weight [V, H], bias [V] or None, and
    what the model does to its output, a :class:`_Post` (s, c): a logit
    scale s (Cohere's ``config.logit_scale`` multiplies, Granite's
    ``config.logits_scaling`` divides; 1 otherwise) and the final logit
    softcapping c (``config.final_logit_softcapping``, Gemma 2/3; None
    otherwise). :func:`_score` checks the result against the model's own
    logits on one row. Under FSDP / ZeRO-3 the weight read here is a shard:
    read it again inside the forward."""
    model = _inner(model)
    if not hasattr(model, "get_output_embeddings"):
        raise ValueError(f"model ({type(model).__name__}) has no get_output_embeddings(): pass a causal LM")
    emb = model.get_output_embeddings()
    weight = getattr(emb, "weight", None)
    if emb is None or not isinstance(weight, Tensor) or weight.dim() != 2:
        raise ValueError(
            f"model ({type(model).__name__}) has no linear output embedding (got {type(emb).__name__}): "
            "the chunked log-probs need z = h·Wᵀ + b; pass logits= instead"
        )
    bias = getattr(emb, "bias", None)
    if bias is not None and not isinstance(bias, Tensor):
        bias = None
    cfg = _text_config(model)
    scale = 1.0
    for name, invert in (("logit_scale", False), ("logits_scaling", True)):
        v = getattr(cfg, name, None)
        if v is None or isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        v = float(v)
        if not (math.isfinite(v) and v > 0):
            raise ValueError(f"config.{name} = {v} must be finite and > 0")
        scale *= 1.0 / v if invert else v
    cap = getattr(cfg, "final_logit_softcapping", None)
    if cap is not None:
        cap = float(cap)
        if not (math.isfinite(cap) and cap > 0):
            raise ValueError(f"config.final_logit_softcapping = {cap} must be finite and > 0")
    return emb, weight, bias, _Post(scale, cap)


def _install_scoring(model: Any) -> None:
    """Wraps ``model.forward`` (once; the instance's, not the class's) so
    that a call with ``treeattn_scoring=f`` runs ``f(forward, args,
    kwargs)`` in its place — inside the model's own forward, where FSDP2,
    FSDP1 and ZeRO-3 have gathered the parameters (the output embedding's
    weight is a shard outside it) and where DDP, activation checkpointing
    and autocast see a normal forward; every other call is the model's."""
    if getattr(model, "_treeattn_scoring", False):
        return
    orig = model.forward

    def forward(*args: Any, treeattn_scoring: Optional[Callable] = None, **kwargs: Any) -> Any:
        if treeattn_scoring is None:
            return orig(*args, **kwargs)
        return treeattn_scoring(orig, args, kwargs)

    model.forward = forward
    model._treeattn_scoring = True


def _score(model: Any, pack: _Scored, fn: Callable[[Tensor, Tensor, Optional[Tensor], _Post], Any]) -> Any:
    """One packed forward of ``model`` in which ``fn(h, W, b, post)`` runs
    inside the model's own forward (:func:`_install_scoring`): ``h``
    ``[B·L, H]``, the final hidden states the output embedding would see;
    ``W``, ``b`` its weight and bias as the forward has them (gathered under
    FSDP / ZeRO-3); ``post`` what the model does to its output (:func:`_head`).
    Returns what ``fn`` returns (tensors: the wrappers' backward hooks —
    FSDP's re-gather of the weight — attach to them).

    The output embedding is handed the last row only (a forward pre-hook),
    so the model computes a ``[1, V]`` logits block; that block is compared
    with z = s·(h·Wᵀ + b) (softcapped) on the same row (see :func:`_head`),
    so a model that changes its logits after the output embedding in another
    way is refused, not silently mis-scored."""
    require_treeattn(model)
    inner = _inner(model)
    _check_tokens(inner, pack)
    emb, weight, _bias, post = _head(inner)
    _check_labels(pack.loss_labels, weight.shape[0])
    _install_scoring(inner)
    B, L = pack.batch, pack.length

    def inside(orig: Callable, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        seen = []

        def keep_last_row(module, a):
            x = a[0]
            seen.append(x)
            return (x[..., -1:, :],) + tuple(a[1:])

        handle = emb.register_forward_pre_hook(keep_last_row)
        before = _attention_calls
        try:
            out = orig(*args, **kwargs)
        finally:
            handle.remove()
        _check_attention_ran(inner, before)
        weight, bias = emb.weight, getattr(emb, "bias", None)
        if not isinstance(bias, Tensor):
            bias = None
        if type(weight).__name__ == "DTensor" or weight.shape[0] * weight.shape[1] != weight.numel():
            raise ValueError(
                "the output embedding's weight is still sharded inside the model's forward (a DTensor): it is "
                "its own FSDP unit; the chunked log-probs run in the root module's forward, so wrap the output "
                "embedding with the root (fully_shard the decoder layers, then the model)"
            )
        if len(seen) != 1:
            raise ValueError(
                f"the output embedding of {type(inner).__name__} ran {len(seen)} times in one forward: "
                "the chunked log-probs need one head call; pass logits= instead"
            )
        h = seen[0]
        if h.dim() != 3 or tuple(h.shape) != (B, L, weight.shape[1]):
            raise ValueError(
                f"the output embedding's input has shape {tuple(h.shape)}, expected [B, L, H] = "
                f"[{B}, {L}, {weight.shape[1]}] (the model slices its hidden states before the head?)"
            )
        # The probe below is the last row of the last pack: h's last row too.
        h = h.reshape(B * L, h.shape[2])
        logits = out.logits if hasattr(out, "logits") else out[0]
        with torch.no_grad():
            theirs = logits.reshape(-1, logits.shape[-1])[-1]
            mine, _ = _head_logits(h[-1:].detach(), weight, bias, post)
            mine = mine[0]
            adt = mine.dtype
            tol = {torch.float64: 1e-10, torch.float32: 1e-4}.get(theirs.dtype, 2e-2)
            diff = float((mine - theirs.to(adt)).abs().max()) if mine.numel() else 0.0
            size = 1.0 + (float(theirs.to(adt).abs().max()) if theirs.numel() else 0.0)
            if theirs.shape != mine.shape or not diff <= tol * size:
                raise ValueError(
                    f"{type(inner).__name__} changes its logits after the output embedding beyond "
                    f"z = {post.scale:g}·(h·Wᵀ + b){f' softcapped at {post.cap:g}' if post.cap is not None else ''} "
                    f"(max |Δ| {diff:.3g} on the probe row): the chunked log-probs would be wrong; pass logits= instead"
                )
        return fn(h, weight, bias, post)

    device = next(model.parameters()).device
    return model(
        input_ids=pack.tokens.to(device),
        position_ids=pack.position_ids.to(device),
        kv_end=pack.kv_end.to(device),
        use_cache=False,
        treeattn_scoring=inside,
    )


def _check_chunk(chunk: Optional[int], vocab: int) -> int:
    if chunk is None:
        return default_chunk(vocab)
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk <= 0:
        raise ValueError(f"chunk must be a positive int (rows per logits block) or None, got {chunk!r}")
    return chunk


def _check_labels(labels: Tensor, vocab: int) -> None:
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= vocab):
        bad = int(((labels < 0) | (labels >= vocab)).nonzero()[0, 0])
        raise ValueError(
            f"pack.loss_labels[{bad}] = {int(labels[bad])} is outside the model's vocabulary 0..{vocab - 1}"
        )


def _check_temperature(temperature: Any) -> float:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not (
        math.isfinite(temperature) and temperature > 0
    ):
        raise ValueError(f"temperature = {temperature!r} must be a finite number > 0 (the rollout's sampling temperature)")
    return float(temperature)


def _chunked_logprobs(h: Tensor, weight: Tensor, bias: Optional[Tensor], post: _Post,
                      pack: _Scored, chunk: int, entropy: bool) -> Tuple[Tensor, Tensor]:
    rows = pack.loss_rows.to(h.device)
    labels = pack.loss_labels.to(h.device, torch.int64)
    return _HeadLogprob.apply(h[rows], weight, bias, labels, chunk, post, entropy)


def target_logprobs(
    model: Any,
    pack: Any,
    logits: Optional[Tensor] = None,
    *,
    chunk: Optional[int] = None,
    entropy: bool = False,
    temperature: float = 1.0,
):
    """Log-probability of every loss entry of ``pack`` (``[T]``, in the
    pack's loss order): ``lp_i = z_{r_i}[y_i] − logsumexp(z_{r_i})`` with
    ``r_i = loss_rows[i]``, ``y_i = loss_labels[i]`` and ``z_r`` the logits
    of packed row ``r`` (one packed forward of ``model``, which must use
    ``attn_implementation="treeattn"``). ``pack`` may be a
    :func:`treeattn.collate` batch: then one forward of ``[B, L]`` and the
    entries of every pack in the batch's order (``loss_batch``).

    Without ``logits``: the model body runs once, the hidden states are
    taken at the loss rows only and ``z = h·Wᵀ + b`` (the output embedding;
    final logit softcapping ``c·tanh(z/c)`` when the config has it) is
    computed ``chunk`` rows at a time, recomputed in backward: no ``[L, V]``
    or ``[T, V]`` tensor exists, the extra memory is a few ``[chunk, V]``
    blocks (default :func:`default_chunk`). A logit scale in the config
    (Cohere ``logit_scale``, Granite ``logits_scaling``) is applied too; the
    result is checked on one row against the model's own logits. Gradients
    flow to the hidden states and to W (and b) — with tied embeddings, to
    the shared weight.
    bfloat16 / float16 models: the head runs in the model's dtype, the
    softmax in float32, and the result is float32.

    With ``logits`` ``[L, V]`` (``[B, L, V]`` for a batch) given, they are
    used as they are (the old path: full logits).

    ``entropy=True`` also returns ``H_i = −Σ_v p_v log p_v`` at each loss
    row, from the same chunks: the result is then ``(logprobs, entropy)``.

    ``temperature`` ``T``: the log-probs (and entropy) of ``softmax(z /
    T)``, the distribution the rollout engine sampled from at temperature
    ``T`` (verl, TRL and slime divide the logits by it); after the model's
    own final softcap.

    The head runs inside the model's own forward (a wrapper of its
    ``forward``, installed once), so the model may be wrapped by FSDP2
    (``fully_shard``), FSDP1, ZeRO-3 or DDP, with activation checkpointing:
    the output embedding's weight is used where the wrapper has gathered
    it. The gradient of a 16-bit weight is summed per vocabulary slice in
    float32 and rounded once: the extra memory stays a few blocks besides
    the weight's own gradient.

    Checked before the forward: token ids and labels inside the model's
    vocabulary (naming the row); after it: that the forward reached
    treeattn's attention. ``logits`` must be this pack's: ``[L, V]`` (or
    ``[B, L, V]``) of a model on ``"treeattn"``.
    """
    temperature = _check_temperature(temperature)
    pack = _Scored(pack)
    if logits is not None:
        require_treeattn(model)
        B, L = pack.batch, pack.length
        if not isinstance(logits, Tensor) or logits.dim() not in (2, 3) or logits.shape[:-1] not in (
            (B * L,), (B, L)
        ) or (logits.dim() == 2 and B != 1):
            raise ValueError(
                f"logits of shape {tuple(logits.shape) if isinstance(logits, Tensor) else type(logits).__name__} "
                f"for a pack of {B} × {L} rows: pass this pack's logits, [L, V] (or [B, L, V] for a batch), from "
                "a forward of the model on \"treeattn\" with this pack's kv_end"
            )
        _check_labels(pack.loss_labels, logits.shape[-1])
        rows = pack.loss_rows.to(logits.device)
        labels = pack.loss_labels.to(logits.device, torch.int64)
        z = logits.reshape(-1, logits.shape[-1])[rows]
        lp = torch.log_softmax(z / temperature if temperature != 1.0 else z, dim=-1)
        out = lp.gather(-1, labels[:, None])[:, 0]
        if entropy:
            return out, -(lp.exp() * lp).sum(-1)
        return out

    def head(h: Tensor, weight: Tensor, bias: Optional[Tensor], post: _Post) -> Tuple[Tensor, Tensor]:
        post = post._replace(inv_temp=1.0 / temperature)
        return _chunked_logprobs(h, weight, bias, post, pack, _check_chunk(chunk, weight.shape[0]), entropy)

    lp, ent = _score(model, pack, head)
    return (lp, ent) if entropy else lp


def _check_normalizer(normalizer: Any, name: str = "normalizer") -> None:
    if normalizer is None:
        return
    if isinstance(normalizer, Tensor):
        if normalizer.numel() != 1:
            raise ValueError(f"{name} must be a number or a one-element tensor, got shape {tuple(normalizer.shape)}")
        v = float(normalizer.detach())
    elif isinstance(normalizer, bool) or not isinstance(normalizer, (int, float)):
        raise ValueError(f"{name} must be a positive number or None, got {normalizer!r}")
    else:
        v = float(normalizer)
    if not (math.isfinite(v) and v > 0):
        raise ValueError(f"{name} = {v} must be finite and > 0 (e.g. Σ weights of the whole batch)")


def pack_loss(
    model: Any,
    pack: Any,
    sdcc_lambda: float = 0.0,
    tau: float = 1.0,
    *,
    normalizer: Any = None,
    sdcc_normalizer: Any = None,
    chunk: Optional[int] = None,
    entropy: bool = False,
    temperature: float = 1.0,
) -> Dict[str, Tensor]:
    """The training loss of one pack (or of a :func:`treeattn.collate`
    batch: the same sums over every pack's entries), from one packed forward
    without ``[L, V]`` logits (as :func:`target_logprobs`):

    ``nll = −Σ_i w_i·lp_i / N`` over the loss entries (``w`` =
    ``loss_weights``; ``N`` = ``normalizer``, default ``Σ w`` of this pack —
    for a token mean over a whole batch (CompactionRL), pass the batch's
    ``Σ w`` over all packs and ranks, so per-pack losses add up to it);

    ``loss = nll + sdcc_lambda · sdcc``, ``sdcc = Σ_j KL_j / N_s``: the
    forward KL(teacher ‖ student) at the pack's ``P`` SDCC pairs, ``KL_j =
    Σ_v p_t(v)(log p_t(v) − log p_s(v))``, ``p = softmax(z / tau)`` of the
    student / teacher rows' logits, the teacher stop-gradient, computed in
    the logits' dtype (τ is not rounded to float32); ``N_s`` =
    ``sdcc_normalizer``, default this pack's ``P`` — for micro-batches,
    pass the batch's pairs over all packs and ranks, so that the per-pack
    terms add up to the batch's mean (with the default, each micro-batch
    would be its own mean). The paper ramps λ from 0 to 0.1 over the first
    20% of steps — the ramp is the caller's.

    ``temperature`` ``T``: the NLL's log-probs are those of ``softmax(z /
    T)`` (:func:`target_logprobs`); SDCC keeps its own ``tau``.

    Returns ``{"loss", "nll", "sdcc", "logprobs"}`` (+ ``"entropy"`` ``[T]``
    with ``entropy=True``). The head runs inside the model's forward, as in
    :func:`target_logprobs` (FSDP2, FSDP1, ZeRO-3, DDP, checkpointing).
    """
    _check_normalizer(normalizer)
    _check_normalizer(sdcc_normalizer, "sdcc_normalizer")
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not (math.isfinite(tau) and tau > 0):
        raise ValueError(f"tau = {tau!r} must be finite and > 0")
    if isinstance(sdcc_lambda, bool) or not isinstance(sdcc_lambda, (int, float)) or not (
        math.isfinite(sdcc_lambda) and sdcc_lambda >= 0
    ):
        raise ValueError(f"sdcc_lambda = {sdcc_lambda!r} must be a finite number >= 0")
    temperature = _check_temperature(temperature)
    pack = _Scored(pack)
    if sdcc_lambda and pack.sdcc_student_rows is None:
        raise ValueError(
            "sdcc_lambda > 0 needs trie-layout packs (the replicated layout has no SDCC pairs; "
            "a batch has them only when every pack does)"
        )

    def head(h: Tensor, weight: Tensor, bias: Optional[Tensor], post: _Post) -> Tuple[Tensor, ...]:
        c = _check_chunk(chunk, weight.shape[0])
        lp, ent = _chunked_logprobs(h, weight, bias, post._replace(inv_temp=1.0 / temperature), pack, c, entropy)
        sdcc = torch.zeros((), dtype=lp.dtype, device=lp.device)
        if sdcc_lambda and pack.sdcc_student_rows.numel() > 0:
            s = pack.sdcc_student_rows.to(h.device)
            t = pack.sdcc_teacher_rows.to(h.device)
            ones = torch.ones(s.shape[0], dtype=lp.dtype, device=h.device)
            sdcc, _kl = _HeadSdcc.apply(h[s], h[t].detach(), weight, bias, ones, float(tau), c, post)
            if sdcc_normalizer is not None:
                n = sdcc_normalizer.to(lp.device, lp.dtype) if isinstance(sdcc_normalizer, Tensor) else float(
                    sdcc_normalizer
                )
                sdcc = sdcc * (s.shape[0] / n)
        return lp, ent, sdcc

    lp, ent, sdcc = _score(model, pack, head)
    w = pack.loss_weights.to(lp.device, lp.dtype)
    if normalizer is None:
        norm = w.sum().clamp_min(torch.finfo(lp.dtype).tiny)
    else:
        norm = normalizer.to(lp.device, lp.dtype) if isinstance(normalizer, Tensor) else float(normalizer)
    nll = -(w * lp).sum() / norm
    out = {"loss": nll + sdcc_lambda * sdcc, "nll": nll, "sdcc": sdcc, "logprobs": lp}
    if entropy:
        out["entropy"] = ent
    return out


def values(critic: Any, pack: Any) -> Tensor:
    """The critic's value at every loss entry's row (``[T]``, the pack's
    loss order): ``V_i = critic(pack)[r_i]`` with ``r_i = loss_rows[i]``,
    each under its target's own live prefix — what :func:`treeattn.rl.gae`
    takes. ``critic``: a value model whose output ``logits`` hold one value
    per row (``[B, L, 1]``: a ``*ForTokenClassification`` with
    ``num_labels=1``, verl's critic, or any model returning that), on
    ``attn_implementation="treeattn"`` — a critic left on ``"sdpa"`` would
    ignore ``kv_end`` and read every value off plain causal attention, so
    it is refused. ``pack`` may be a :func:`treeattn.collate` batch."""
    pack = _Scored(pack)
    out = _forward(critic, pack)
    B, L = pack.batch, pack.length
    if not isinstance(out, Tensor) or out.dim() != 3 or tuple(out.shape) != (B, L, 1):
        raise ValueError(
            f"the critic returned logits of shape {tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__}, "
            f"expected [B, L, 1] = [{B}, {L}, 1]: one value per row (a *ForTokenClassification with num_labels=1)"
        )
    return out.reshape(B * L)[pack.loss_rows.to(out.device)]
