"""Recurrent layers on a tree pack: short convolutions, the gated delta rule
(Gated DeltaNet: Qwen3.5, Qwen3-Next) and the Mamba-2 SSD scan, each run
along every row's own root-to-row path instead of the packed order.

Why: in a pre-order pack the row before ``t`` is often not on ``t``'s path
(the first row of a second branch follows the last row of the first
branch). Attention is made exact by the interval mask ``kv_end``; a
recurrent layer must instead start every trie node from the state its
parent node ends with, and a short convolution must read ``parent[t]``,
``parent[parent[t]]``, … (DESIGN §11).

The path structure comes from :func:`treeattn.paths` (Rust, ``O(L)``):
``parent[t]``, the trie nodes as contiguous runs of rows with their parent
node, and a level schedule. Here every node is cut into chunks of at most
``C`` rows; a chunk starts from the end state of the chunk before it in
its node, or of the last chunk of its parent node (zero at a root). Chunks
at the same depth of this chunk tree are independent and run as one batch,
so a scan takes (longest path in chunks) sequential steps, like a plain
chunked scan of the longest call, and computes a shared node once.
Siblings read one end state; autograd sums their state gradients into it.

Ops (plain torch, autograd through them; they compute in the dtype of
their inputs, the Hugging Face glue casts to float32 as transformers does):

- :func:`tree_causal_conv1d` — depthwise causal convolution along paths;
- :func:`tree_gated_delta_rule` — per value head, state ``S`` ``[d_k, d_v]``:
  ``S_t = (I − β_t k_t k_tᵀ) e^{g_t} S_{p(t)} + β_t k_t v_tᵀ``,
  ``o_t = S_tᵀ q_t``, q and k optionally L2-normalized, q scaled by
  ``d_k^{-1/2}``;
- :func:`tree_ssd_scan` — Mamba-2, per head, state ``h`` ``[P, N]``:
  ``h_t = e^{Δ_t A} h_{p(t)} + Δ_t x_t B_tᵀ``, ``y_t = h_t C_t`` (the
  ``D x_t`` skip is the caller's), one scalar decay per head;

where ``p(t)`` is ``t``'s parent row and ``S_{-1} = 0``, ``h_{-1} = 0``.

:func:`register` makes the transformers mixers of the supported families
use them when the model is called with ``kv_end=`` and makes the other
recurrent families raise ``ValueError`` then.
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
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from . import Paths, paths

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
# The plan: path structure, conv taps and chunk schedules of one pack.


@dataclass
class ChunkSchedule:
    """Chunks of at most ``size`` rows, in level order (see :class:`TreePlan`).

    ``rows`` ``[N, size]``: the packed row of each chunk slot, ``L`` (a zero
    row) for padding; ``level_offsets``: the chunks of level ``l`` are
    ``offsets[l]:offsets[l + 1]``; ``pred`` ``[N]``: the position of a
    chunk's predecessor within the previous level, or that level's length
    (an appended zero state) where it has none; ``row_slot`` ``[L]``: the
    flat slot ``chunk * size + j`` holding each row."""

    size: int
    rows: Tensor
    level_offsets: List[int]
    pred: Tensor
    row_slot: Tensor


@dataclass
class TreePlan:
    """Everything a recurrent layer needs to run on one pack, built once per
    pack and reused by every layer (:func:`plan` caches the last one).

    ``paths``: the :class:`treeattn.Paths` of ``kv_end``; ``device``: where
    the index tensors live. ``taps(K)`` and ``chunks(C)`` are computed on
    first use."""

    kv_end: Tensor
    paths: Paths
    device: torch.device
    _taps: Dict[int, Tensor] = field(default_factory=dict)
    _chunks: Dict[int, ChunkSchedule] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.kv_end.shape[0])

    def taps(self, k: int) -> Tensor:
        """``[L, k]`` int64: column ``j`` is the row ``j`` steps back on each
        row's path (``j = 0`` the row itself), ``L`` (a zero row) past a root."""
        if k not in self._taps:
            n = len(self)
            parent = self.paths.parent.clone()
            parent = torch.where(parent < 0, torch.full_like(parent, n), parent)
            ext = torch.cat([parent, torch.tensor([n])])  # parent of the zero row is itself
            cols = [torch.arange(n)]
            for _ in range(1, k):
                cols.append(ext[cols[-1]])
            self._taps[k] = torch.stack(cols, 1).to(self.device)
        return self._taps[k]

    def chunks(self, size: int) -> ChunkSchedule:
        """The chunk schedule for chunks of at most ``size`` rows."""
        if size not in self._chunks:
            self._chunks[size] = _chunk_schedule(self.paths, len(self), size, self.device)
        return self._chunks[size]


def _chunk_schedule(p: Paths, n_rows: int, size: int, device: torch.device) -> ChunkSchedule:
    """Cuts every node into chunks of ``size`` rows and orders the chunks by
    their depth in the chunk tree (one pass over the node levels)."""
    if size <= 0:
        raise ValueError(f"chunk size must be positive, got {size}")
    start, end, nparent = p.node_start, p.node_end, p.node_parent
    n_nodes = int(start.shape[0])
    nch = (end - start + size - 1) // size
    # Depth (in chunks) of each node's first chunk: parent's first + parent's count.
    first_depth = torch.zeros(n_nodes, dtype=torch.int64)
    offs = p.level_offsets.tolist()
    for lv in range(1, len(offs) - 1):
        nodes = p.level_nodes[offs[lv]:offs[lv + 1]]
        par = nparent[nodes]
        first_depth[nodes] = first_depth[par] + nch[par]
    first_chunk = torch.cumsum(nch, 0) - nch  # global chunk id of each node's first chunk
    total = int(nch.sum())
    chunk_node = torch.repeat_interleave(torch.arange(n_nodes), nch)
    chunk_i = torch.arange(total) - first_chunk[chunk_node]
    depth = first_depth[chunk_node] + chunk_i
    # Predecessor chunk: the previous chunk of the node, else the parent node's last.
    par_node = nparent[chunk_node]
    par_last = torch.where(par_node >= 0, first_chunk[par_node.clamp_min(0)] + nch[par_node.clamp_min(0)] - 1, -1)
    pred_chunk = torch.where(chunk_i > 0, torch.arange(total) - 1, par_last)
    # Level order (stable by chunk id within a depth).
    order = torch.argsort(depth, stable=True)
    pos = torch.empty(total, dtype=torch.int64)
    pos[order] = torch.arange(total)
    levels = int(depth.max()) + 1 if total else 0
    counts = torch.bincount(depth, minlength=levels)
    level_offsets = [0] + torch.cumsum(counts, 0).tolist()
    lev_start = torch.tensor(level_offsets[:-1], dtype=torch.int64)
    d_sorted = depth[order]
    pred_sorted = pred_chunk[order]
    prev_len = torch.cat([torch.zeros(1, dtype=torch.int64), counts[:-1]])[d_sorted] if total else d_sorted
    pred_pos = torch.where(
        pred_sorted >= 0,
        pos[pred_sorted.clamp_min(0)] - lev_start[(d_sorted - 1).clamp_min(0)],
        prev_len,
    )
    # Rows of each chunk slot.
    c_start = start[chunk_node[order]] + chunk_i[order] * size
    c_end = end[chunk_node[order]]
    slot = c_start[:, None] + torch.arange(size)[None, :]
    rows = torch.where(slot < c_end[:, None], slot, torch.full_like(slot, n_rows))
    # Flat slot of every row.
    row_slot = torch.empty(n_rows, dtype=torch.int64)
    valid = rows < n_rows
    flat = torch.arange(total * size).reshape(total, size)
    row_slot[rows[valid]] = flat[valid]
    return ChunkSchedule(
        size=size,
        rows=rows.to(device),
        level_offsets=level_offsets,
        pred=pred_pos.to(device),
        row_slot=row_slot.to(device),
    )


_PLAN_CACHE: Dict[str, Any] = {}


def plan(kv_end: Tensor, device: Optional[torch.device] = None) -> TreePlan:
    """The :class:`TreePlan` of a pack's ``kv_end`` (``[L]`` or ``[1, L]``),
    index tensors on ``device`` (default: ``kv_end``'s). The last plan is
    cached and reused while ``kv_end`` holds the same values (checked in
    ``O(L)``), so the layers of one forward share one. Invalid ``kv_end``
    (not a nested pre-order layout) raises ``ValueError``."""
    if not isinstance(kv_end, Tensor):
        raise ValueError(f"kv_end must be a torch.Tensor, got {type(kv_end).__name__}")
    if kv_end.dim() == 2 and kv_end.shape[0] == 1:
        kv_end = kv_end[0]
    if kv_end.dim() != 1:
        raise ValueError(f"kv_end must be [L] or [1, L], got shape {tuple(kv_end.shape)}")
    device = torch.device(device) if device is not None else kv_end.device
    cached = _PLAN_CACHE.get("plan")
    if (
        cached is not None
        and cached.device == device
        and cached.kv_end.shape == kv_end.shape
        and torch.equal(cached.kv_end, kv_end.detach().to("cpu", torch.int64))
    ):
        return cached
    cpu = kv_end.detach().to("cpu", torch.int64).clone()
    p = TreePlan(kv_end=cpu, paths=paths(cpu), device=device)
    _PLAN_CACHE["plan"] = p
    return p


# --------------------------------------------------------------------------
# The ops.


def tree_causal_conv1d(x: Tensor, weight: Tensor, tree: TreePlan, bias: Optional[Tensor] = None) -> Tensor:
    """Depthwise causal convolution along paths, before any activation:
    ``out[t, c] = bias[c] + Σ_j weight[c, K−1−j] · x[a_j(t), c]`` with
    ``a_0(t) = t``, ``a_{j+1}(t) = parent[a_j(t)]`` and ``x = 0`` past a root
    (what ``conv1d(padding=K−1)[:L]`` computes on a single sequence).
    ``x`` ``[L, D]``, ``weight`` ``[D, K]``, ``bias`` ``[D]`` or None."""
    if x.dim() != 2 or x.shape[0] != len(tree):
        raise ValueError(f"tree_causal_conv1d: x must be [L={len(tree)}, D], got {tuple(x.shape)}")
    if weight.dim() != 2 or weight.shape[0] != x.shape[1]:
        raise ValueError(f"tree_causal_conv1d: weight must be [D={x.shape[1]}, K], got {tuple(weight.shape)}")
    k = weight.shape[1]
    taps = tree.taps(k)
    xz = torch.cat([x, x.new_zeros(1, x.shape[1])], 0)
    out = xz[taps[:, 0]] * weight[:, k - 1]
    for j in range(1, k):
        out = out + xz[taps[:, j]] * weight[:, k - 1 - j]
    if bias is not None:
        out = out + bias
    return out


def _gather_chunks(x: Tensor, sched: ChunkSchedule) -> Tensor:
    """``x`` ``[L, ...]`` → ``[N, size, ...]`` with zeros in padding slots."""
    xz = torch.cat([x, x.new_zeros((1,) + tuple(x.shape[1:]))], 0)
    return xz[sched.rows]


def _scatter_rows(y: Tensor, sched: ChunkSchedule) -> Tensor:
    """``y`` ``[N, size, ...]`` (level order) → ``[L, ...]``."""
    return y.reshape((-1,) + tuple(y.shape[2:]))[sched.row_slot]


def _l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """``x / sqrt(Σ x² + eps)`` over the last dim (the FLA / transformers form)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def tree_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    tree: TreePlan,
    chunk_size: int = 64,
    use_qk_l2norm: bool = True,
) -> Tensor:
    """The gated delta rule along every path of the pack.

    ``q``, ``k`` ``[L, Hk, dk]``, ``v`` ``[L, Hv, dv]``, ``g`` (log decay,
    ``<= 0``) and ``beta`` ``[L, Hv]``; ``Hv`` a multiple of ``Hk`` (value
    head ``h`` reads key head ``h // (Hv / Hk)``). Per value head, with
    ``q̂ = q·dk^{-1/2}`` (after L2 normalization of q and k when
    ``use_qk_l2norm``)::

        S_t = exp(g_t) S_{p(t)} + k_t (β_t (v_t − (exp(g_t) S_{p(t)})ᵀ k_t))ᵀ,   o_t = S_tᵀ q̂_t

    with ``S_{p(t)}`` the state after ``t``'s parent row (zero at a root).
    This is transformers' ``torch_recurrent_gated_delta_rule``; it is
    computed in the chunked (WY / UT-transform) form of
    ``torch_chunk_gated_delta_rule``, chunks cut per trie node. Returns
    ``o`` ``[L, Hv, dv]`` in the inputs' dtype."""
    n = len(tree)
    if q.dim() != 3 or k.shape != q.shape or q.shape[0] != n:
        raise ValueError(f"tree_gated_delta_rule: q, k must be [L={n}, Hk, dk], got {tuple(q.shape)}, {tuple(k.shape)}")
    if v.dim() != 3 or v.shape[0] != n or v.shape[1] % q.shape[1] != 0:
        raise ValueError(f"tree_gated_delta_rule: v must be [L={n}, Hv, dv] with Hv a multiple of Hk={q.shape[1]}, got {tuple(v.shape)}")
    if g.shape != v.shape[:2] or beta.shape != v.shape[:2]:
        raise ValueError(f"tree_gated_delta_rule: g, beta must be [L, Hv]={tuple(v.shape[:2])}, got {tuple(g.shape)}, {tuple(beta.shape)}")
    rep = v.shape[1] // q.shape[1]
    if rep > 1:
        q = q.repeat_interleave(rep, dim=1)
        k = k.repeat_interleave(rep, dim=1)
    if use_qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    q = q * (q.shape[-1] ** -0.5)
    sched = tree.chunks(chunk_size)
    C = chunk_size
    # [N, H, C, d] and [N, H, C]
    qc, kc, vc = (_gather_chunks(x, sched).transpose(1, 2) for x in (q, k, v))
    gc, bc = (_gather_chunks(x, sched).transpose(1, 2) for x in (g, beta))
    cum = gc.cumsum(-1)
    upper = torch.ones(C, C, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    k_beta = kc * bc[..., None]
    v_beta = vc * bc[..., None]
    ut = (k_beta @ kc.transpose(-1, -2)) * decay
    intra = (qc @ kc.transpose(-1, -2)) * decay
    new_v = torch.linalg.solve_triangular(ut, v_beta, upper=False, unitriangular=True)
    k_cd = torch.linalg.solve_triangular(ut, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)
    q_dec = qc * cum.exp()[..., None]
    k_dec = kc * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]
    H, dk, dv = qc.shape[1], qc.shape[-1], vc.shape[-1]
    outs = []
    state = None
    offs = sched.level_offsets
    for lv in range(len(offs) - 1):
        a, b = offs[lv], offs[lv + 1]
        if state is None:
            s_in = q.new_zeros(b - a, H, dk, dv)
        else:
            s_in = torch.cat([state, state.new_zeros((1,) + tuple(state.shape[1:]))], 0)[sched.pred[a:b]]
        vn = new_v[a:b] - k_cd[a:b] @ s_in
        outs.append(q_dec[a:b] @ s_in + intra[a:b] @ vn)
        state = s_in * chunk_decay[a:b] + k_dec[a:b].transpose(-1, -2) @ vn
    if not outs:
        return v.new_zeros(v.shape)
    o = torch.cat(outs, 0).transpose(1, 2)  # [N, C, H, dv]
    return _scatter_rows(o, sched)


def _segsum(a: Tensor) -> Tensor:
    """``[..., C]`` → ``[..., C, C]``: entry ``(i, j)`` is ``Σ_{j<m<=i} a_m``
    for ``j <= i`` (a sum of the terms themselves, not a difference of
    cumulative sums, so it stays accurate far from the chunk start), ``−inf``
    above the diagonal."""
    c = a.shape[-1]
    x = a[..., None, :].expand(*a.shape, c).transpose(-1, -2)  # x[..., i, j] = a_i
    strict = torch.tril(torch.ones(c, c, dtype=torch.bool, device=a.device), -1)
    s = x.masked_fill(~strict, 0).cumsum(-2)
    return s.masked_fill(~torch.tril(torch.ones(c, c, dtype=torch.bool, device=a.device)), float("-inf"))


def tree_ssd_scan(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    tree: TreePlan,
    chunk_size: int = 64,
) -> Tensor:
    """The Mamba-2 state-space scan (SSD, scalar decay per head) along every
    path of the pack, without the ``D`` skip term.

    ``x`` ``[L, H, P]``, ``dt`` ``[L, H]`` (the final step sizes: bias,
    softplus and clamp already applied), ``A`` ``[H]`` (negative), ``B``,
    ``C`` ``[L, G, N]`` with ``H`` a multiple of ``G`` (head ``h`` reads
    group ``h // (H / G)``). Per head, with the state ``h_t`` ``[P, N]``::

        h_t = exp(dt_t A) h_{p(t)} + dt_t x_t B_tᵀ,    y_t = h_t C_t

    with ``h_{p(t)}`` the state after ``t``'s parent row (zero at a root).
    Returns ``y`` ``[L, H, P]`` in the inputs' dtype."""
    n = len(tree)
    if x.dim() != 3 or x.shape[0] != n:
        raise ValueError(f"tree_ssd_scan: x must be [L={n}, H, P], got {tuple(x.shape)}")
    if dt.shape != x.shape[:2] or A.shape != x.shape[1:2]:
        raise ValueError(f"tree_ssd_scan: dt must be [L, H]={tuple(x.shape[:2])} and A [H], got {tuple(dt.shape)}, {tuple(A.shape)}")
    if B.dim() != 3 or B.shape != C.shape or B.shape[0] != n or x.shape[1] % B.shape[1] != 0:
        raise ValueError(f"tree_ssd_scan: B, C must be [L={n}, G, N] with H a multiple of G, got {tuple(B.shape)}, {tuple(C.shape)}")
    rep = x.shape[1] // B.shape[1]
    if rep > 1:
        B = B.repeat_interleave(rep, dim=1)
        C = C.repeat_interleave(rep, dim=1)
    sched = tree.chunks(chunk_size)
    xd = x * dt[..., None]
    a = A * dt
    xc, Bc, Cc = (_gather_chunks(t, sched).transpose(1, 2) for t in (xd, B, C))  # [N, H, C, *]
    ac = _gather_chunks(a, sched).transpose(1, 2)  # [N, H, C]
    cum = ac.cumsum(-1)
    Lmat = _segsum(ac).exp()
    y_diag = ((Cc @ Bc.transpose(-1, -2)) * Lmat) @ xc  # [N, H, C, P]
    decay_states = (cum[..., -1:] - cum).exp()
    states = xc.transpose(-1, -2) @ (Bc * decay_states[..., None])  # [N, H, P, N]
    chunk_decay = cum[..., -1].exp()[..., None, None]
    out_decay = cum.exp()[..., None]
    H, P, N = xc.shape[1], xc.shape[-1], Bc.shape[-1]
    outs = []
    state = None
    offs = sched.level_offsets
    for lv in range(len(offs) - 1):
        lo, hi = offs[lv], offs[lv + 1]
        if state is None:
            outs.append(y_diag[lo:hi])
            state = states[lo:hi]
            continue
        s_in = torch.cat([state, state.new_zeros((1,) + tuple(state.shape[1:]))], 0)[sched.pred[lo:hi]]
        outs.append(y_diag[lo:hi] + (Cc[lo:hi] @ s_in.transpose(-1, -2)) * out_decay[lo:hi])
        state = s_in * chunk_decay[lo:hi] + states[lo:hi]
    if not outs:
        return x.new_zeros(x.shape)
    y = torch.cat(outs, 0).transpose(1, 2)  # [N, C, H, P]
    return _scatter_rows(y, sched)


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
