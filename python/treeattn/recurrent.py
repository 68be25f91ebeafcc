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

These are the op layer, usable without transformers; :mod:`treeattn.hybrid`
patches transformers' mixers to call them (as Liger-Kernel keeps its ops
apart from its model patches).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch
from torch import Tensor

from . import Paths, paths

__all__ = [
    "ChunkSchedule",
    "TreePlan",
    "plan",
    "tree_causal_conv1d",
    "tree_gated_delta_rule",
    "tree_ssd_scan",
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
