"""Recurrent (hybrid) models of Hugging Face transformers on a tree pack:
:func:`register` makes the mixers of the supported families run the tree
ops of :mod:`treeattn.recurrent` (short convolutions, the gated delta rule
of Gated DeltaNet — Qwen3.5, Qwen3-Next — and the Mamba-2 SSD scan, each
along every row's own root-to-row path instead of the packed order) when
the model is called with ``kv_end=``, and makes the other recurrent
families raise ``ValueError`` then (DESIGN §11).

The ops are re-exported here (``treeattn.hybrid.tree_ssd_scan`` and the
others stay where they were); their math and the chunk-tree schedule are
documented in :mod:`treeattn.recurrent`.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import importlib.abc
import inspect
import re
import sys
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

# The op layer (treeattn/recurrent.py), re-exported where users found it.
from .recurrent import TreePlan, plan, tree_causal_conv1d, tree_gated_delta_rule, tree_ssd_scan

__all__ = [
    "TreePlan",
    "plan",
    "tree_causal_conv1d",
    "tree_gated_delta_rule",
    "tree_ssd_scan",
    "register",
    "patched",
    "SUPPORTED",
    "UNSUPPORTED",
    "TREE_CHUNK_CAP",
]


# --------------------------------------------------------------------------
# Hugging Face transformers.
#
# The supported mixers all run their sequence mixing through module-level
# functions of their modeling file: ``causal_conv1d_fn`` (the short
# convolution) and ``torch_chunk_gated_delta_rule`` (Gated DeltaNet) or
# ``mamba2_chunk_scan`` (Mamba-2), and look these names up at call time.
# ``register`` wraps the mixer's ``forward``: with ``kv_end`` among its
# keyword arguments (transformers passes the model call's extra keyword
# arguments down to every layer) the wrapped forward checks its inputs,
# builds (or reuses) the pack's plan and runs the original forward with the
# plan active, so the wrapped module functions run the tree ops; it then
# checks that both did run (a transformers version that routes the mixer
# elsewhere is an error, not wrong numbers). Without ``kv_end`` nothing
# changes.

# family → (modeling module, mixer classes, kind)
SUPPORTED: Dict[str, Tuple[str, Tuple[str, ...], str]] = {
    "qwen3_5": ("transformers.models.qwen3_5.modeling_qwen3_5", ("Qwen3_5GatedDeltaNet",), "gdn"),
    "qwen3_5_moe": ("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe", ("Qwen3_5MoeGatedDeltaNet",), "gdn"),
    "qwen3_next": ("transformers.models.qwen3_next.modeling_qwen3_next", ("Qwen3NextGatedDeltaNet",), "gdn"),
    "mamba2": ("transformers.models.mamba2.modeling_mamba2", ("Mamba2Mixer",), "ssd"),
    "nemotron_h": ("transformers.models.nemotron_h.modeling_nemotron_h", ("NemotronHMamba2Mixer",), "ssd"),
    "bamba": ("transformers.models.bamba.modeling_bamba", ("BambaMixer",), "ssd"),
    "falcon_h1": ("transformers.models.falcon_h1.modeling_falcon_h1", ("FalconH1Mixer",), "ssd"),
    "granitemoehybrid": (
        "transformers.models.granitemoehybrid.modeling_granitemoehybrid",
        ("GraniteMoeHybridMambaLayer",),
        "ssd",
    ),
}

# family → (modeling module, recurrent layer classes) of the families whose
# recurrence treeattn does not run on trees: every model class of the
# module (the entry points) and these layers raise ValueError on kv_end.
UNSUPPORTED: Dict[str, Tuple[str, Tuple[str, ...]]] = {
    "mamba": ("transformers.models.mamba.modeling_mamba", ("MambaMixer",)),
    "falcon_mamba": ("transformers.models.falcon_mamba.modeling_falcon_mamba", ("FalconMambaMixer",)),
    "jamba": ("transformers.models.jamba.modeling_jamba", ("JambaMambaMixer",)),
    "zamba": ("transformers.models.zamba.modeling_zamba", ("ZambaMambaMixer",)),
    "zamba2": ("transformers.models.zamba2.modeling_zamba2", ("Zamba2MambaMixer",)),
    "lfm2": ("transformers.models.lfm2.modeling_lfm2", ("Lfm2ShortConv",)),
    "lfm2_moe": ("transformers.models.lfm2_moe.modeling_lfm2_moe", ("Lfm2MoeShortConv",)),
    "lfm3": ("transformers.models.lfm3.modeling_lfm3", ("Lfm3ShortConv",)),
    "kimi_linear": ("transformers.models.kimi_linear.modeling_kimi_linear", ("KimiLinearDeltaAttention",)),
    "minimax": ("transformers.models.minimax.modeling_minimax", ("MiniMaxLightningAttention",)),
    "olmo_hybrid": ("transformers.models.olmo_hybrid.modeling_olmo_hybrid", ("OlmoHybridGatedDeltaNet",)),
    "recurrent_gemma": ("transformers.models.recurrent_gemma.modeling_recurrent_gemma", ("RecurrentGemmaRecurrentBlock",)),
    "rwkv": ("transformers.models.rwkv.modeling_rwkv", ("RwkvBlock",)),
    "xlstm": ("transformers.models.xlstm.modeling_xlstm", ()),
    "bailing_hybrid": ("transformers.models.bailing_hybrid.modeling_bailing_hybrid", ()),
    "glm5_next": ("transformers.models.glm5_next.modeling_glm5_next", ("Glm5NextTextLinearAttention",)),
    "inkling": ("transformers.models.inkling.modeling_inkling", ("InklingShortConvolution",)),
    "inkling2": ("transformers.models.inkling2.modeling_inkling2", ("Inkling2ShortConvolution",)),
    "inkling2_loop": ("transformers.models.inkling2_loop.modeling_inkling2_loop", ("Inkling2LoopShortConvolution",)),
    "lara_mini": ("transformers.models.lara_mini.modeling_lara_mini", ("LaraMiniGatedDeltaNet",)),
    "qwen4_exp": ("transformers.models.qwen4_exp.modeling_qwen4_exp", ("Qwen4ExpTextGatedDeltaNet",)),
    "zaya": ("transformers.models.zaya.modeling_zaya", ("ZayaCCAProjection",)),
    "lfm3_vl": ("transformers.models.lfm3_vl.modeling_lfm3_vl", ()),
}

# A modeling module of neither list that defines one of these functions, or
# a class named like one of these, is taken for a recurrent family and
# refuses kv_end too (a family added to transformers after this list).
_RECURRENT_FUNCTIONS = (
    "causal_conv1d_fn", "causal_conv1d_update", "torch_chunk_gated_delta_rule", "mamba2_chunk_scan",
    "mamba_selective_scan", "mamba_inner_fn", "selective_scan_fn",
)
_RECURRENT_CLASS = re.compile(
    r"(Mamba|GatedDeltaNet|ShortConv|LinearAttention|LightningAttention|Rglru|RecurrentBlock|Rwkv|LSTM|DeltaAttention)"
)
_MODELING = re.compile(r"^transformers\.models\.\w+\.modeling_\w+$")

# Largest chunk the tree scans use. A node's last chunk is padded to the
# chunk size, and trie nodes are short (on data/sample.jsonl: median 22
# rows; slots per token 1.86 at 64, 5.28 at Mamba-2's default 256), so the
# SSD scan runs at min(config chunk, 64). The chunk size changes only the
# order of float32 sums, not the result in exact arithmetic.
TREE_CHUNK_CAP = 64

_SCAN_FN = {"gdn": "torch_chunk_gated_delta_rule", "ssd": "mamba2_chunk_scan"}


@dataclass
class _Active:
    """The plan of the tree forward running now, and which tree ops ran."""

    tree: TreePlan
    where: str
    conv_calls: int = 0
    scan_calls: int = 0


_ACTIVE: contextvars.ContextVar[Optional[_Active]] = contextvars.ContextVar("treeattn_hybrid", default=None)
# The kv_end of the model call running now: some entry points (e.g.
# Mamba2ForCausalLM) do not pass their extra keyword arguments down to the
# layers, so the patched entry points of a family keep it here too.
_CALL_KV_END: contextvars.ContextVar[Optional[Tensor]] = contextvars.ContextVar("treeattn_kv_end", default=None)
_PACKED_ORDER: contextvars.ContextVar[bool] = contextvars.ContextVar("treeattn_hybrid_packed", default=False)


@contextlib.contextmanager
def _packed_order():
    """Negative control for tests and benchmarks: inside, the wrapped
    mixers ignore ``kv_end`` and run in packed order (wrong on a tree)."""
    token = _PACKED_ORDER.set(True)
    try:
        yield
    finally:
        _PACKED_ORDER.reset(token)


def _tree_conv(orig: Callable) -> Callable:
    """Wraps a modeling file's ``causal_conv1d_fn(x [B, D, L], weight [D, K],
    bias, activation)``: inside a tree forward, the path convolution."""

    @functools.wraps(orig)
    def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
        act = _ACTIVE.get()
        if act is None:
            return orig(hidden_states, weight, bias, activation, **kwargs)
        from transformers.activations import ACT2FN

        act.conv_calls += 1
        x = hidden_states[0].transpose(0, 1).to(weight.dtype)
        out = tree_causal_conv1d(x, weight, act.tree, bias)
        if activation is not None:
            out = ACT2FN[activation](out)
        return out.transpose(0, 1).contiguous()[None].to(hidden_states.dtype)

    causal_conv1d_fn.__treeattn_wrapped__ = orig
    return causal_conv1d_fn


def _tree_gdn(orig: Callable) -> Callable:
    """Wraps ``torch_chunk_gated_delta_rule``: inside a tree forward, the
    tree gated delta rule with transformers' float32 internals."""

    @functools.wraps(orig)
    def torch_chunk_gated_delta_rule(
        query, key, value, g, beta, chunk_size=64, initial_state=None,
        output_final_state=False, use_qk_l2norm_in_kernel=False, **kwargs,
    ):
        act = _ACTIVE.get()
        if act is None:
            return orig(
                query, key, value, g, beta, chunk_size=chunk_size, initial_state=initial_state,
                output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **kwargs,
            )
        if initial_state is not None or output_final_state:
            raise ValueError(f"{act.where}: a tree pack has no single recurrent state to start from or return")
        act.scan_calls += 1
        f32 = [t[0].to(torch.float32) for t in (query, key, value, g, beta)]
        o = tree_gated_delta_rule(*f32, act.tree, chunk_size=chunk_size, use_qk_l2norm=use_qk_l2norm_in_kernel)
        return o[None].to(query.dtype), None

    torch_chunk_gated_delta_rule.__treeattn_wrapped__ = orig
    return torch_chunk_gated_delta_rule


def _tree_ssd(orig: Callable) -> Callable:
    """Wraps ``mamba2_chunk_scan``: inside a tree forward, the tree SSD scan
    with transformers' dtype handling (float32 scan, ``D`` skip added after)."""

    @functools.wraps(orig)
    def mamba2_chunk_scan(
        hidden_states, dt, A, B, C, chunk_size, D=None, dt_bias=None, initial_states=None,
        dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False, **kwargs,
    ):
        act = _ACTIVE.get()
        if act is None:
            return orig(
                hidden_states, dt, A, B, C, chunk_size, D=D, dt_bias=dt_bias, initial_states=initial_states,
                dt_softplus=dt_softplus, dt_limit=dt_limit, return_final_states=return_final_states, **kwargs,
            )
        if initial_states is not None or return_final_states:
            raise ValueError(f"{act.where}: a tree pack has no single recurrent state to start from or return")
        if kwargs.get("z") is not None:
            raise ValueError(f"{act.where}: a gate z inside the scan is not supported on a tree pack")
        act.scan_calls += 1
        if dt_bias is not None:
            dt = dt + dt_bias.to(dt.dtype)
        if dt_softplus:
            dt = F.softplus(dt)
        dt = torch.clamp(dt, min=dt_limit[0], max=dt_limit[1])
        x = hidden_states[0].float()
        y = tree_ssd_scan(
            x, dt[0].float(), A.float(), B[0].float(), C[0].float(), act.tree,
            chunk_size=min(int(chunk_size), TREE_CHUNK_CAP),
        )
        if D is not None:
            y = y + D[..., None] * x
        return y[None]

    mamba2_chunk_scan.__treeattn_wrapped__ = orig
    return mamba2_chunk_scan


def _no_fused(orig: Callable) -> Callable:
    """Wraps ``mamba2_split_conv1d_scan_combined`` (the fused mamba-ssm
    training kernel, when installed): never used inside a tree forward, so
    the mixer takes its step-by-step path through the wrapped functions."""

    @functools.wraps(orig)
    def mamba2_split_conv1d_scan_combined(*args, **kwargs):
        if _ACTIVE.get() is not None:
            return None
        return orig(*args, **kwargs)

    mamba2_split_conv1d_scan_combined.__treeattn_wrapped__ = orig
    return mamba2_split_conv1d_scan_combined


def _take(args: list, kwargs: dict, pos: int, names: Tuple[str, ...]) -> Any:
    """Removes and returns an argument given by position or by one of its names."""
    for n in names:
        if n in kwargs:
            return kwargs.pop(n)
    if len(args) > pos:
        v = args[pos]
        args[pos] = None
        return v
    return None


def _tree_forward(orig: Callable, family: str) -> Callable:
    """Wraps a supported mixer's ``forward(hidden_states, cache, attention_mask, **kwargs)``."""

    @functools.wraps(orig)
    def forward(self, hidden_states, *args, **kwargs):
        kv_end = kwargs.get("kv_end")
        if kv_end is None:
            kv_end = _CALL_KV_END.get()
        if kv_end is None or _PACKED_ORDER.get():
            return orig(self, hidden_states, *args, **kwargs)
        where = f"{type(self).__name__} (layer {getattr(self, 'layer_idx', '?')})"
        if hidden_states.dim() != 3 or hidden_states.shape[0] != 1:
            raise ValueError(
                f"{where}: a tree pack is one sequence (batch size 1), got hidden states of shape {tuple(hidden_states.shape)}"
            )
        if not isinstance(kv_end, Tensor):
            raise ValueError(f"kv_end must be a torch.Tensor, got {type(kv_end).__name__}")
        n = int(kv_end.shape[-1]) if kv_end.dim() > 0 else -1
        if n != hidden_states.shape[1]:
            raise ValueError(
                f"{where}: kv_end has {n} entries but the input has {hidden_states.shape[1]} tokens; pass the pack's own kv_end"
            )
        if len(args) > 2:
            raise ValueError(f"{where}: expected (hidden_states, cache, attention_mask) and keywords, got {len(args) + 1} positional arguments")
        args = list(args)
        cache = _take(args, kwargs, 0, ("cache", "cache_params"))
        mask = _take(args, kwargs, 1, ("attention_mask",))
        if mask is not None and not bool((mask != 0).all()):
            raise ValueError(f"{where}: a tree pack has no padding; got an attention_mask with zeros")
        if cache is not None:
            get = getattr(cache, "get_recurrent_state", None)
            idx = getattr(self, "layer_idx", None)
            if get is not None and idx is not None and get(idx, state_idx=0) is not None:
                raise ValueError(f"{where}: a tree pack cannot continue from a cache that already holds this layer's state")
        tree = plan(kv_end, device=hidden_states.device)
        act = _Active(tree=tree, where=where)
        token = _ACTIVE.set(act)
        try:
            # The cache is neither read nor written: a tree has no single end state.
            out = orig(self, hidden_states, cache=None, attention_mask=None, **kwargs)
        finally:
            _ACTIVE.reset(token)
        if act.conv_calls != 1 or act.scan_calls != 1:
            raise RuntimeError(
                f"{where}: the {family} mixer ran {act.conv_calls} tree convolutions and {act.scan_calls} tree scans "
                "(expected one each): this transformers version routes it differently; treeattn.hybrid must be updated"
            )
        return out

    forward.__treeattn_wrapped__ = orig
    return forward


def _refuse_forward(orig: Callable, family: str, cls_name: str) -> Callable:
    """Wraps the forward of a layer of an unsupported recurrent family: with
    ``kv_end`` it raises instead of running the recurrence in packed order."""

    @functools.wraps(orig)
    def forward(self, *args, **kwargs):
        if kwargs.get("kv_end") is not None or _CALL_KV_END.get() is not None:
            raise ValueError(
                f"{cls_name} ({family}) runs a recurrence that treeattn cannot run on a tree pack: "
                f"called with kv_end it would mix branches in packed order and give wrong numbers. "
                f"Supported recurrent families: {', '.join(sorted(SUPPORTED))}"
            )
        return orig(self, *args, **kwargs)

    forward.__treeattn_wrapped__ = orig
    return forward


def _capture_forward(orig: Callable, cls_name: str = "") -> Callable:
    """Wraps a model entry point's forward: a ``kv_end`` among its keyword
    arguments is kept in a context variable for the call (and still passed
    on), so the family's recurrent layers see it even where the entry point
    does not pass its keyword arguments down (``Mamba2ForCausalLM`` calls
    its backbone without them; the backbone's wrapper puts it back)."""

    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(orig).parameters.values())

    @functools.wraps(orig)
    def forward(self, *args, **kwargs):
        kv_end = kwargs.get("kv_end")
        if kv_end is None:
            kv_end = _CALL_KV_END.get()
            if kv_end is None:
                return orig(self, *args, **kwargs)
            # An inner model called by an outer entry point that dropped
            # kv_end: hand it on as a keyword argument, so that it reaches
            # the layers also when gradient checkpointing re-runs them in
            # backward, outside this call.
            if takes_kwargs:
                kwargs["kv_end"] = kv_end
        token = _CALL_KV_END.set(kv_end)
        try:
            return orig(self, *args, **kwargs)
        finally:
            _CALL_KV_END.reset(token)

    forward.__treeattn_wrapped__ = orig
    return forward


def _patch_entry_points(mod: Any, make: Callable[[Callable], Callable]) -> None:
    """Wraps the forward of every model class a modeling module defines."""
    from transformers import PreTrainedModel

    for obj in list(vars(mod).values()):
        if (
            isinstance(obj, type)
            and issubclass(obj, PreTrainedModel)
            and obj.__module__ == mod.__name__
            and "forward" in obj.__dict__
        ):
            _wrap(obj, "forward", lambda f, obj=obj: make(f, obj.__name__))


def _wrap(owner: Any, name: str, make: Callable[[Callable], Callable]) -> bool:
    """Replaces ``owner.name`` by ``make(owner.name)`` once (idempotent)."""
    cur = getattr(owner, name, None)
    if cur is None:
        return False
    if getattr(cur, "__treeattn_wrapped__", None) is not None and (
        not isinstance(owner, type) or name in owner.__dict__
    ):
        return True
    setattr(owner, name, make(cur))
    return True


def _patch_supported(family: str, mod: Any) -> None:
    """Wraps the module functions and mixer forwards of a supported family."""
    modname, classes, kind = SUPPORTED[family]
    scan = _tree_gdn if kind == "gdn" else _tree_ssd
    for fn, make in (("causal_conv1d_fn", _tree_conv), (_SCAN_FN[kind], scan)):
        if not _wrap(mod, fn, make):
            raise RuntimeError(f"treeattn.hybrid: {modname} has no {fn}; this transformers version is not supported")
    _wrap(mod, "mamba2_split_conv1d_scan_combined", _no_fused)
    for c in classes:
        cls = getattr(mod, c, None)
        if cls is None:
            raise RuntimeError(f"treeattn.hybrid: {modname} has no {c}; this transformers version is not supported")
        _wrap(cls, "forward", lambda f, family=family: _tree_forward(f, family))


def _patch_unsupported(family: str, mod: Any) -> None:
    """Wraps the layers of an unsupported family to refuse ``kv_end``."""
    for c in UNSUPPORTED[family][1]:
        cls = getattr(mod, c, None)
        if cls is not None:
            _wrap(cls, "forward", lambda f, family=family, c=c: _refuse_forward(f, family, c))


def _looks_recurrent(mod: Any) -> bool:
    """Whether a modeling module of no known family holds a recurrent layer."""
    names = vars(mod)
    if any(f in names for f in _RECURRENT_FUNCTIONS):
        return True
    return any(
        isinstance(v, type) and v.__module__ == mod.__name__ and _RECURRENT_CLASS.search(k)
        for k, v in names.items()
    )


def _patch(modname: str, mod: Any) -> None:
    """Patches a transformers modeling module (by module name): a supported
    family's mixers take the tree path, an unsupported or unknown recurrent
    family refuses kv_end, anything else is left alone."""
    if getattr(mod, "__treeattn_patched__", False):
        return
    family = _BY_MODULE.get(modname)
    if family is None:
        if not _looks_recurrent(mod):
            return
        family = modname.rsplit(".", 2)[-2]
        _patch_entry_points(mod, lambda f, c, family=family: _refuse_forward(f, family, c))
    elif family in SUPPORTED:
        _patch_entry_points(mod, _capture_forward)
        _patch_supported(family, mod)
    else:
        _patch_entry_points(mod, lambda f, c, family=family: _refuse_forward(f, family, c))
        _patch_unsupported(family, mod)
    mod.__treeattn_patched__ = True


_BY_MODULE = {spec[0]: family for family, spec in list(SUPPORTED.items()) + list(UNSUPPORTED.items())}


class _PatchAfterExec(importlib.abc.Loader):
    """Delegating loader: runs the real loader, then patches the module."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.loader.exec_module(module)
        _patch(module.__name__, module)


class _Finder(importlib.abc.MetaPathFinder):
    """Patches a family's modeling module when it is first imported, so
    that :func:`register` does not import (seconds each) every family."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if not _MODELING.match(fullname):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchAfterExec(spec.loader)
                return spec
        return None


_FINDER = _Finder()


def register() -> Dict[str, str]:
    """Makes the recurrent mixers of the :data:`SUPPORTED` transformers
    families tree-aware when the model is called with ``kv_end=`` and the
    layers of the :data:`UNSUPPORTED` families raise ``ValueError`` then
    (idempotent; called by :func:`treeattn.hf.register`). Modeling modules
    already imported are patched now, the others when they are first
    imported (an import hook), so registering costs no imports. Returns
    ``{family: "tree" | "refuse"}`` for the families patched so far."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
    for modname, mod in list(sys.modules.items()):
        if mod is not None and _MODELING.match(modname):
            _patch(modname, mod)
    return patched()


def patched() -> Dict[str, str]:
    """``{family: "tree" | "refuse"}`` for the families whose modeling
    module is imported and patched."""
    out = {}
    for modname, mod in list(sys.modules.items()):
        if mod is not None and _MODELING.match(modname) and getattr(mod, "__treeattn_patched__", False):
            family = _BY_MODULE.get(modname, modname.rsplit(".", 2)[-2])
            out[family] = "tree" if family in SUPPORTED else "refuse"
    return out
