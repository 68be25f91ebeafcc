"""PyTorch ops over the treeattn crate's backends (CPU; CUDA when built).

- :func:`tree_attention` — exact attention on a packed conditioning tree
  (mask ``k <= q < kv_end[k]``), optional fused rotary embedding, GQA;
- :func:`sdcc_forward_kl` — the fused forward KL of SDCC self-distillation.

Both are ``torch.library`` custom ops (``treeattn::tree_attention_fwd``,
``treeattn::tree_attention_bwd``, ``treeattn::sdcc_forward_kl``) with fake
(meta) implementations and autograd, so they pass
``torch.library.opcheck`` and run under ``torch.compile(fullgraph=True)``
(dynamo treats them as opaque calls).

Precision: the CPU backend computes in float32 or float64. bfloat16 and
float16 CPU tensors go to it as they are: widened exactly as the crate
copies them, computed in float32, each result rounded once to the input
dtype (the LSE is float32, as on CUDA) — bit for bit the float32 op on
``q.float()``, ``k.float()``, ``v.float()`` rounded, without the float32
copies; except that on CPUs with AVX-512 BF16 (:func:`cpu_isa` is
``"avx512+bf16"``) bfloat16's block products run on bfloat16 pairs
(``vdpbf16ps``: products exact, sums in float32; rotated q and k, and the
probabilities P and dS before ``P V``, ``Pᵀ dO``, ``dSᵀ Q``, ``dS K``,
rounded to bfloat16 first, as on CUDA): 2e-3 to 4e-3 from the float32 op,
within the 16-bit tolerances, 1e-2 / 2e-2.

Devices: CPU tensors run the crate's CPU backend. CUDA tensors run the
crate's CUDA kernels when the extension was built with the crate's
``cuda`` feature (``MATURIN_PEP517_ARGS="--features cuda" pip install
./python``, nvcc 13 at build time; :func:`cuda_built` tells): attention in
bfloat16 or float16 with head dim 64 or 128 (an f32 softmax, an f32 LSE),
SDCC on bfloat16, float16 or float32 logits. They run on torch's current
stream with torch's device pointers (the kernels are loaded once per device
into its primary context, torch's; no context or stream is created). With a
bare ``kv_end`` tensor the pack's ``kv_end`` / ``position_ids`` are read on
the host (copied there if they live on the GPU: a stream synchronization)
and uploaded per call; with a :class:`MaskPlan` they are validated once and
uploaded by its first CUDA call, and every later call (every layer) copies
nothing and synchronizes nothing. :func:`count_mask_work` counts the
copies. float32 / float64 CUDA inputs
to attention raise ``ValueError`` (cast them; nothing is cast silently);
an extension built without ``cuda`` raises ``RuntimeError`` saying so.
Tensors on different devices, wrong shapes or dtypes and out-of-range
``kv_end`` raise ``ValueError`` naming the argument.

Zero-copy: contiguous CPU inputs of the compute dtype are read in place
through their data pointers (non-contiguous ones are copied once by
``.contiguous()``); outputs are allocated by torch and written by the crate;
the computation runs with the GIL released.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import weakref
from typing import Any, Dict, Iterator, Optional, Tuple, Union

import torch
from torch import Tensor

from . import _native
from ._native import PackError, TreeattnError, UnsupportedError

__all__ = [
    "tree_attention", "sdcc_forward_kl", "set_num_threads", "get_num_threads", "cuda_built", "cpu_isa",
    "MaskPlan", "TreeMask", "count_mask_work",
]

_threads = 0  # 0: the crate's default (TREEATTN_THREADS or all cores)


def set_num_threads(n: int) -> None:
    """Threads the crate's CPU kernels use (0: ``TREEATTN_THREADS`` or all cores)."""
    global _threads
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"set_num_threads: n must be an int >= 0, got {n!r}")
    _threads = n


def get_num_threads() -> int:
    """The value given to :func:`set_num_threads` (0: the crate's default)."""
    return _threads


_COMPUTE = {
    torch.float32: torch.float32,
    torch.float64: torch.float64,
    torch.bfloat16: torch.float32,
    torch.float16: torch.float32,
}
_INT = (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8)


def _dtype_name(t: Tensor) -> str:
    return {
        torch.float32: "float32",
        torch.float64: "float64",
        torch.bfloat16: "bfloat16",
        torch.float16: "float16",
    }[t.dtype]


def _ptr(t: Tensor) -> int:
    return t.data_ptr() if t.numel() > 0 else 0


# Debug counting of the mask work (count_mask_work): None when off.
_COUNTS: Optional[Dict[str, int]] = None


def _count(what: str) -> None:
    if _COUNTS is not None:
        _COUNTS[what] = _COUNTS.get(what, 0) + 1


@contextlib.contextmanager
def count_mask_work() -> Iterator[Dict[str, int]]:
    """Debug mode: counts, while the ``with`` block runs, what the package
    does with a pack's mask — ``"plan_builds"`` (:class:`MaskPlan` built),
    ``"validations"`` (``kv_end`` / ``position_ids`` checked and converted
    for the crate: once per plan, or once per call with a bare ``kv_end``)
    and ``"host_copies"`` (mask data copied from a device to the host: a
    stream synchronization). Yields the dict of counts (zero entries
    absent)::

        with treeattn.torch.count_mask_work() as n:
            model(input_ids=..., kv_end=kv_end)
        assert n.get("host_copies", 0) == 0
    """
    global _COUNTS
    outer, _COUNTS = _COUNTS, {}
    try:
        yield _COUNTS
    finally:
        _COUNTS = outer


def _mask_u32(kv_end: Tensor, position_ids: Optional[Tensor], L: int) -> Tuple[Tensor, Tensor]:
    """Checks the values of kv_end and position_ids (real tensors, inside the
    op) and returns them as contiguous int32 buffers (read as u32)."""
    _count("validations")
    if L > 0:
        idx = torch.arange(L, dtype=torch.int64)
        ke = kv_end.to(torch.int64)
        bad = (ke < idx) | (ke > L)
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise ValueError(
                f"kv_end[{i}] = {int(ke[i])} breaks {i} <= kv_end[k] <= L = {L} "
                "(a key is seen by the queries k <= q < kv_end[k])"
            )
    ke32 = kv_end.to(torch.int32).contiguous()
    if position_ids is None:
        pos32 = torch.zeros(L, dtype=torch.int32)
    else:
        p = position_ids.to(torch.int64)
        bad = (p < 0) | (p > 0xFFFFFFFF)
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise ValueError(f"position_ids[{i}] = {int(p[i])} is outside 0..2^32-1")
        # Values up to 2^32-1 keep their bits in int32 (the crate reads u32).
        pos32 = torch.where(p > 0x7FFFFFFF, p - (1 << 32), p).to(torch.int32).contiguous()
    return ke32, pos32


# --------------------------------------------------------------------------
# tree attention


@torch.library.custom_op("treeattn::tree_attention_fwd", mutates_args=(), device_types="cpu")
def _attn_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    kv_end: Tensor,
    position_ids: Optional[Tensor],
    scale: float,
    rope_base: Optional[float],
    rope_dims: Optional[int],
    threads: int,
    plan: int = 0,
    window: Optional[int] = None,
    softcap: Optional[float] = None,
    sinks: Optional[Tensor] = None,
    kv_start: Optional[Tensor] = None,
    deterministic: bool = False,
) -> Tuple[Tensor, Tensor]:
    # ``deterministic`` only travels to the backward (see _attn_setup); the
    # CPU backward is deterministic whatever it says.
    L, hq, d = q.shape
    hkv, dv = k.shape[1], v.shape[2]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    sinks = None if sinks is None else sinks.to(q.dtype).contiguous()
    ke, pos, native = _call_mask(plan, kv_end, position_ids, L, host=False)
    ks = _key_starts(kv_start, L)
    o = q.new_empty((L, hq, dv))
    lse = torch.empty((hq, L), dtype=_lse_dtype(q))
    _native.attention_forward(
        _dtype_name(q), _ptr(q), _ptr(k), _ptr(v), _ptr_opt(ke), _ptr_opt(pos), _ptr(o), _ptr(lse),
        L, hq, hkv, d, scale, rope_base, rope_dims, threads, native,
        v_head_dim=dv, window=window, softcap=softcap, sinks=_ptr_opt(sinks), kv_start=_ptr_opt(ks),
    )
    return o, lse


@_attn_fwd.register_fake
def _(q, k, v, kv_end, position_ids, scale, rope_base, rope_dims, threads, plan=0, window=None, softcap=None,
      sinks=None, kv_start=None, deterministic=False):
    L, hq, _ = q.shape
    return q.new_empty((L, hq, v.shape[2])), q.new_empty((hq, L), dtype=_lse_dtype(q))


@torch.library.custom_op("treeattn::tree_attention_bwd", mutates_args=(), device_types="cpu")
def _attn_bwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    kv_end: Tensor,
    position_ids: Optional[Tensor],
    o: Tensor,
    lse: Tensor,
    grad_out: Tensor,
    scale: float,
    rope_base: Optional[float],
    rope_dims: Optional[int],
    threads: int,
    plan: int = 0,
    window: Optional[int] = None,
    softcap: Optional[float] = None,
    sinks: Optional[Tensor] = None,
    kv_start: Optional[Tensor] = None,
    deterministic: bool = False,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    # The CPU backward is deterministic whatever ``deterministic`` says.
    L, hq, d = q.shape
    hkv, dv_ = k.shape[1], v.shape[2]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    o, lse, grad_out = o.contiguous(), lse.contiguous(), grad_out.to(q.dtype).contiguous()
    sinks = None if sinks is None else sinks.to(q.dtype).contiguous()
    ke, pos, native = _call_mask(plan, kv_end, position_ids, L, host=False)
    ks = _key_starts(kv_start, L)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    # The sinks' gradient in q's dtype ([0] without sinks: custom ops return tensors).
    dsinks = q.new_empty((hq if sinks is not None else 0,))
    _native.attention_backward(
        _dtype_name(q), _ptr(q), _ptr(k), _ptr(v), _ptr_opt(ke), _ptr_opt(pos), _ptr(o), _ptr(lse),
        _ptr(grad_out), _ptr(dq), _ptr(dk), _ptr(dv),
        L, hq, hkv, d, scale, rope_base, rope_dims, threads, native,
        v_head_dim=dv_, window=window, softcap=softcap, sinks=_ptr_opt(sinks),
        dsinks=_ptr(dsinks) if sinks is not None else 0, kv_start=_ptr_opt(ks),
    )
    return dq, dk, dv, dsinks


@_attn_bwd.register_fake
def _(q, k, v, kv_end, position_ids, o, lse, grad_out, scale, rope_base, rope_dims, threads, plan=0, window=None,
      softcap=None, sinks=None, kv_start=None, deterministic=False):
    f = lambda t: torch.empty_like(t, memory_format=torch.contiguous_format)  # noqa: E731
    return f(q), f(k), f(v), q.new_empty((q.shape[1] if sinks is not None else 0,))


def _lse_dtype(q: Tensor) -> torch.dtype:
    """The LSE's dtype, the compute dtype: float32 for bf16 / f16 inputs (on
    CPU and CUDA), else the inputs' dtype."""
    return torch.float32 if q.dtype in (torch.bfloat16, torch.float16) else q.dtype


def _stream(t: Tensor) -> int:
    """torch's current stream on t's device, as a cudaStream_t address."""
    return torch.cuda.current_stream(t.device).cuda_stream


def _host(t: Optional[Tensor]) -> Optional[Tensor]:
    """``t`` on the host: the one place the package copies mask data there
    (counted by :func:`count_mask_work` when it is a real copy)."""
    if t is None:
        return None
    if t.device.type != "cpu":
        _count("host_copies")
    return t.cpu()


# Live MaskPlans by plan id: the ops take the id (an int, which custom ops
# and torch.compile pass through) and find the plan here; a plan that is
# gone (its MaskPlan collected) falls back to the kv_end tensor.
_PLANS: "weakref.WeakValueDictionary[int, MaskPlan]" = weakref.WeakValueDictionary()
_PLAN_IDS = itertools.count(1)


def _call_mask(
    plan: int, kv_end: Tensor, position_ids: Optional[Tensor], L: int, *, host: bool
) -> Tuple[Optional[Tensor], Optional[Tensor], Optional[Any]]:
    """The mask of one op call: ``(None, None, native plan)`` when ``plan``
    names a live MaskPlan of ``L`` tokens (nothing checked, copied or
    uploaded again), else kv_end / position_ids validated as int32 host
    buffers (copied there first when ``host`` says they may be on a
    device)."""
    m = _PLANS.get(plan) if plan else None
    if m is not None and len(m) == L:
        return None, None, m._native
    if host:
        kv_end, position_ids = _host(kv_end), _host(position_ids)
    ke, pos = _mask_u32(kv_end, position_ids, L)
    return ke, pos, None


def _ptr_opt(t: Optional[Tensor]) -> int:
    return 0 if t is None else _ptr(t)


def _key_starts(kv_start: Optional[Tensor], L: int) -> Optional[Tensor]:
    """Explicit key starts as an int32 host buffer (read as u32), checked:
    ``[L]`` integers in ``0 ..= L``."""
    if kv_start is None:
        return None
    ks = kv_start.to("cpu", torch.int64)
    if ks.shape != (L,) or bool(((ks < 0) | (ks > L)).any()):
        raise ValueError(f"kv_start must be [L] = [{L}] integers in 0..={L}")
    return ks.to(torch.int32).contiguous()


@_attn_fwd.register_kernel("cuda")
def _(q, k, v, kv_end, position_ids, scale, rope_base, rope_dims, threads, plan=0, window=None, softcap=None,
      sinks=None, kv_start=None, deterministic=False):
    L, hq, d = q.shape
    hkv, dv = k.shape[1], v.shape[2]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    # The sinks stay on the device (q's dtype); explicit key starts go to
    # the host (the crate uploads them per call).
    sinks = None if sinks is None else sinks.to(q.dtype).contiguous()
    ke, pos, native = _call_mask(plan, kv_end, position_ids, L, host=True)
    ks = _key_starts(kv_start, L)
    o = q.new_empty((L, hq, dv))
    lse = torch.empty((hq, L), dtype=torch.float32, device=q.device)
    _native.attention_forward(
        _CUDA_NAMES.get(q.dtype, str(q.dtype)),
        _ptr(q), _ptr(k), _ptr(v), _ptr_opt(ke), _ptr_opt(pos), _ptr(o), _ptr(lse),
        L, hq, hkv, d, scale, rope_base, rope_dims, 0, native,
        v_head_dim=dv, window=window, softcap=softcap, sinks=_ptr_opt(sinks), kv_start=_ptr_opt(ks),
        device=q.get_device(), stream=_stream(q),
    )
    return o, lse


@_attn_bwd.register_kernel("cuda")
def _(q, k, v, kv_end, position_ids, o, lse, grad_out, scale, rope_base, rope_dims, threads, plan=0, window=None,
      softcap=None, sinks=None, kv_start=None, deterministic=False):
    L, hq, d = q.shape
    hkv, dv_ = k.shape[1], v.shape[2]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    o, lse = o.contiguous(), lse.to(torch.float32).contiguous()
    grad_out = grad_out.to(q.dtype).contiguous()
    sinks = None if sinks is None else sinks.to(q.dtype).contiguous()
    ke, pos, native = _call_mask(plan, kv_end, position_ids, L, host=True)
    ks = _key_starts(kv_start, L)
    f = lambda t: torch.empty_like(t, memory_format=torch.contiguous_format)  # noqa: E731
    dq, dk, dv = f(q), f(k), f(v)
    # The sinks' gradient on the device in q's dtype ([0] without sinks).
    dsinks = q.new_empty((hq if sinks is not None else 0,))
    _native.attention_backward(
        _CUDA_NAMES.get(q.dtype, str(q.dtype)),
        _ptr(q), _ptr(k), _ptr(v), _ptr_opt(ke), _ptr_opt(pos), _ptr(o), _ptr(lse), _ptr(grad_out),
        _ptr(dq), _ptr(dk), _ptr(dv),
        L, hq, hkv, d, scale, rope_base, rope_dims, 0, native,
        v_head_dim=dv_, window=window, softcap=softcap, sinks=_ptr_opt(sinks),
        dsinks=_ptr(dsinks) if sinks is not None else 0, kv_start=_ptr_opt(ks),
        deterministic=bool(deterministic), device=q.get_device(), stream=_stream(q),
    )
    return dq, dk, dv, dsinks


_CUDA_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def cuda_built() -> bool:
    """Whether this build of the extension has the crate's CUDA kernels."""
    return bool(_native.cuda_built())


def cpu_isa() -> str:
    """The CPU backend's code path in this process: ``"portable"``,
    ``"avx2+fma"``, ``"avx512"`` or ``"avx512+bf16"`` (the best the CPU
    has, lowered by ``TREEATTN_ISA``). On ``"avx512+bf16"``, bfloat16 inputs'
    block products run on bfloat16 pairs (``vdpbf16ps``, P and dS rounded to
    bfloat16 as on CUDA) rather than as the float32 op on the widened
    inputs."""
    return str(_native.cpu_isa())


def _attn_setup(ctx, inputs, output):
    q, k, v, kv_end, position_ids, scale, rope_base, rope_dims, threads, *rest = inputs
    plan, window, softcap, sinks, kv_start, deterministic = (
        list(rest) + [0, None, None, None, None, False][len(rest):]
    )[:6]
    o, lse = output
    ctx.save_for_backward(q, k, v, kv_end, position_ids, o, lse, sinks, kv_start)
    ctx.params = (scale, rope_base, rope_dims, threads, plan, window, softcap, deterministic)
    # The plan stays alive until the backward has used it.
    ctx.plan_ref = _PLANS.get(plan) if plan else None
    ctx.mark_non_differentiable(lse)


def _attn_backward(ctx, grad_o, grad_lse):
    q, k, v, kv_end, position_ids, o, lse, sinks, kv_start = ctx.saved_tensors
    scale, rope_base, rope_dims, threads, plan, window, softcap, deterministic = ctx.params
    if grad_o is None:
        grad_o = torch.zeros_like(o)
    dq, dk, dv, dsinks = _attn_bwd(
        q, k, v, kv_end, position_ids, o, lse, grad_o, scale, rope_base, rope_dims, threads, plan,
        window, softcap, sinks, kv_start, deterministic,
    )
    dsinks = None if sinks is None else dsinks.to(sinks.dtype)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None, dsinks, None, None


_attn_fwd.register_autograd(_attn_backward, setup_context=_attn_setup)


def _check_device(name: str, t: Tensor, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, q is on {device}: all tensors must be on one device")


def _no_cuda(what: str) -> None:
    raise RuntimeError(
        f"{what}: CUDA tensors are not supported by this build of treeattn "
        "(the extension was built without the crate's `cuda` feature: rebuild it with "
        "MATURIN_PEP517_ARGS=\"--features cuda\" pip install ./python); "
        "or move the tensors to the CPU"
    )


# --------------------------------------------------------------------------
# the mask of a pack, validated once, and its forms for other kernels


class MaskPlan:
    """The mask of one pack — ``kv_end`` (query ``q`` sees key ``k`` iff
    ``k <= q < kv_end[k]``) and its position ids — validated once, for every
    attention call and layer of a forward, and converted for the kernels
    users already run.

    ``kv_end``, ``position_ids``: ``[L]`` integer tensors (``position_ids``
    optional: needed for rotary). ``device``: where the int64 copies live
    (default: ``kv_end``'s); int32 host copies (read as u32 by the crate)
    are kept too. Pass a ``MaskPlan`` wherever :func:`tree_attention` takes
    ``kv_end``.

    Interop, each exact (tested against the dense mask):

    - :meth:`block_mask`: a FlexAttention ``BlockMask`` from the crate's
      block census (``O(L + n²)`` for ``n = L / block``), no
      ``create_block_mask``;
    - :meth:`flashmask`: FlashMask's ``startend_row_indices`` (causal,
      lower-triangle start per key column: rows ``[k, kv_end[k])`` see key
      ``k``, so the start of the masked rows is ``kv_end``);
    - :meth:`tin_tout`: the ``tin[k] <= tin[q] < tout[k]`` form of TRL's tree
      packing (``tin`` = row, ``tout`` = ``kv_end``);
    - :meth:`magi_ranges`: MagiAttention's ``q_ranges`` / ``k_ranges`` /
      mask types (a causal slice per trie node, a full slice per run of its
      ancestors' rows).

    The plan: ``kv_end`` and the position ids are validated once, here, into
    the crate's ``MaskPlan`` (one host copy if they live on a GPU); every
    :func:`tree_attention` call with this mask then skips validation, and on
    CUDA the plan's device copy (kv_end, position ids, key-tile bounds,
    rotary tables) is uploaded by the first call and reused by every later
    one — no host↔device copy, no synchronization per layer
    (:func:`count_mask_work` counts them). Build one per pack and pass it
    to every layer (``treeattn.hf`` does).
    """

    def __init__(self, kv_end: Tensor, position_ids: Optional[Tensor] = None, *, device: Any = None):
        if not isinstance(kv_end, Tensor) or kv_end.dim() != 1 or kv_end.dtype not in _INT:
            raise ValueError(
                f"kv_end must be a 1-D integer torch.Tensor, got "
                f"{type(kv_end).__name__ if not isinstance(kv_end, Tensor) else (tuple(kv_end.shape), kv_end.dtype)}"
            )
        L = int(kv_end.shape[0])
        if position_ids is not None:
            if not isinstance(position_ids, Tensor) or position_ids.dim() != 1 or position_ids.dtype not in _INT:
                raise ValueError("position_ids must be a 1-D integer torch.Tensor or None")
            if position_ids.shape[0] != L:
                raise ValueError(f"position_ids has {position_ids.shape[0]} entries, kv_end has {L}")
        _count("plan_builds")
        self._ke32, self._pos32 = _mask_u32(_host(kv_end), _host(position_ids), L)
        self._native = _native.MaskPlan(_ptr(self._ke32), _ptr(self._pos32), L)
        self._plan_id = next(_PLAN_IDS)
        _PLANS[self._plan_id] = self
        dev = torch.device(device) if device is not None else kv_end.device
        # Copies of their own (never the caller's tensors), whose versions
        # are checked at every use: the plan cannot silently disagree with
        # what the mask shows.
        self._kv_end = kv_end.to(dev, torch.int64, copy=True)
        self._position_ids = None if position_ids is None else position_ids.to(dev, torch.int64, copy=True)
        self._versions = self._current_versions()
        self._block_masks: Dict[Tuple[int, Optional[int]], Any] = {}

    @classmethod
    def from_positions(cls, position_ids: Tensor, *, device: Any = None) -> "MaskPlan":
        """The mask of a pre-order layout whose position ids are depths —
        a treeattn pack, TRL's tree rows, Hugging Face's padding-free packed
        batches (positions restarting at 0: a forest of chains) — with
        ``kv_end[k]`` = the first row ``j > k`` with ``position_ids[j] <=
        position_ids[k]``, else ``L`` (the crate's
        ``mask::kv_end_from_positions``, one stack walk, ``O(L)``).

        ``position_ids``: ``[L]`` or ``[1, L]`` integers (one layout; the
        mask keeps them as its position ids). ``ValueError`` naming the row
        unless the first row is at 0 and no position rises by more than 1
        from one row to the next (offset positions — a second chunk of a
        long sequence — are refused, not read as some other tree)."""
        if not isinstance(position_ids, Tensor) or position_ids.dtype not in _INT:
            raise ValueError(
                "position_ids must be an integer torch.Tensor, got "
                f"{type(position_ids).__name__ if not isinstance(position_ids, Tensor) else position_ids.dtype}"
            )
        if position_ids.dim() == 2 and position_ids.shape[0] == 1:
            position_ids = position_ids[0]
        if position_ids.dim() != 1:
            raise ValueError(
                f"position_ids must be [L] or [1, L] (one layout), got shape {tuple(position_ids.shape)}"
            )
        host = _host(position_ids).to(torch.int64).contiguous()
        if host.numel():
            raw = _native.kv_end_from_positions(host.numpy().tobytes())
            kv_end = torch.frombuffer(bytearray(raw), dtype=torch.int64).to(position_ids.device)
        else:
            kv_end = torch.zeros(0, dtype=torch.int64, device=position_ids.device)
        return cls(kv_end, position_ids, device=device)

    def _current_versions(self) -> Tuple[int, int]:
        pos = self._position_ids
        return self._kv_end._version, (-1 if pos is None else pos._version)

    def _fresh(self) -> None:
        if self._current_versions() != self._versions:
            raise ValueError(
                "this MaskPlan's kv_end or position_ids was modified in place after the mask was built: "
                "its validated plan would no longer match them; build a new MaskPlan for the new mask"
            )

    @property
    def kv_end(self) -> Tensor:
        """``[L]`` int64: the mask's own copy of ``kv_end`` (the tensor
        given is copied; an in-place change of this one makes every later
        use of the mask raise ``ValueError``)."""
        self._fresh()
        return self._kv_end

    @property
    def position_ids(self) -> Optional[Tensor]:
        """``[L]`` int64 or ``None``: the mask's own copy of the position
        ids (as :attr:`kv_end`)."""
        self._fresh()
        return self._position_ids

    def __len__(self) -> int:
        return int(self._kv_end.shape[0])

    def __repr__(self) -> str:
        pos = "with" if self._position_ids is not None else "without"
        return f"MaskPlan(L={len(self)}, {pos} position_ids, device={self._kv_end.device})"

    def dense(self) -> Tensor:
        """The ``[L, L]`` boolean mask (``O(L²)``: for checks and small packs)."""
        L = len(self)
        i = torch.arange(L, device=self.kv_end.device)
        return (i[None, :] <= i[:, None]) & (i[:, None] < self.kv_end[None, :])

    def window_starts(self, window: int) -> Tensor:
        """``[L]`` int64: the first visible key of each row under a sliding
        window of ``window`` tree levels (query ``q`` then sees key ``k``
        iff ``starts[q] <= k <= q < kv_end[k]``; the crate's
        ``PackMask::window_starts``)."""
        if window is None:
            raise ValueError("window_starts: window must be an int >= 1")
        return _window_starts(self._ke32, window)

    def depths(self) -> Tensor:
        """``[L]`` int64 on the mask's device: each row's depth in the tree,
        the number of keys whose range holds it, ``#{k < t : kv_end[k] >
        t}`` (its ancestors; a pack's position id). A sliding window of
        ``W`` levels keeps the keys with ``depth(q) − depth(k) < W``."""
        return _depths(self.kv_end)

    def block_census(
        self, block_size: int = 128, window: Optional[int] = None
    ) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        """``(kv_num_blocks [n], kv_indices [n, n], full_kv_num_blocks [n],
        full_kv_indices [n, n])`` int32 for square blocks of ``block_size``:
        per query block, the key blocks with some but not all pairs visible
        (partial) and with all (full), ascending, then zeros — exactly what
        ``create_block_mask`` finds (a block cut short by the pack's end is
        padded with masked pairs, so never full). With a sliding ``window``
        of tree levels, the blocks wholly outside every row's window are
        left out and only blocks inside every row's window are full; a
        partial block may then hold no visible pair (the census is sound,
        not exact)."""
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        window = _check_window(window)
        L = len(self)
        n = -(-L // block_size)
        raw = _native.block_census(_ptr(self._ke32), L, block_size, window)

        def t(b: bytes, shape):
            if not b:
                return torch.zeros(shape, dtype=torch.int32)
            return torch.frombuffer(bytearray(b), dtype=torch.int32).view(shape)

        return t(raw[0], (n,)), t(raw[1], (n, n)), t(raw[2], (n,)), t(raw[3], (n, n))

    def block_mask(self, block_size: int = 128, window: Optional[int] = None) -> Any:
        """A FlexAttention ``BlockMask`` of this mask (batch and heads
        broadcast), built from :meth:`block_census` with a ``mask_mod`` that
        reads ``kv_end`` (and with a sliding ``window`` of tree levels, the
        rows' depths: ``depth(q) − depth(k) < window``) for the partial
        blocks; cached per block size and window."""
        window = _check_window(window)
        key = (block_size, window)
        if key in self._block_masks:
            return self._block_masks[key]
        from torch.nn.attention.flex_attention import BlockMask

        L = len(self)
        dev = self.kv_end.device
        num, idx, fnum, fidx = (x.to(dev)[None, None] for x in self.block_census(block_size, window))
        n = num.shape[-1]
        # kv_end padded to whole blocks with 0 (no query sees a padded key):
        # FlexAttention may evaluate mask_mod past L in the last block.
        ke = torch.zeros(n * block_size, dtype=torch.int64, device=dev)
        ke[:L] = self.kv_end
        if window is None:

            def mask_mod(b, h, q_idx, kv_idx):
                return (kv_idx <= q_idx) & (q_idx < ke[kv_idx])

        else:
            depth = torch.zeros(n * block_size, dtype=torch.int64, device=dev)
            depth[:L] = self.depths()

            def mask_mod(b, h, q_idx, kv_idx):
                return (kv_idx <= q_idx) & (q_idx < ke[kv_idx]) & (depth[q_idx] - depth[kv_idx] < window)

        bm = BlockMask.from_kv_blocks(num, idx, fnum, fidx, BLOCK_SIZE=block_size, mask_mod=mask_mod,
                                      seq_lengths=(L, L))
        self._block_masks[key] = bm
        return bm

    def flashmask(self) -> Tensor:
        """FlashMask's ``startend_row_indices`` ``[1, 1, L, 1]`` int32 for a
        causal mask with lower-triangle start: key ``k`` is masked from row
        ``kv_end[k]`` on."""
        return self.kv_end.to(torch.int32).view(1, 1, -1, 1)

    def magi_ranges(self) -> Tuple[Tensor, Tensor, list]:
        """MagiAttention's form: ``(q_ranges [S, 2], k_ranges [S, 2],
        types)`` int32 ranges ``[start, end)`` and one mask type per slice,
        ``"causal"`` or ``"full"``. One causal slice per trie node (its rows
        against themselves) and one full slice per maximal contiguous run of
        its ancestors' rows (:func:`treeattn.paths`); a padding row (no key
        visible to itself) gets only its ancestors. ``S`` is about nodes ×
        (1 + ancestor runs); the union of the slices is the tree mask."""
        from . import paths as _paths

        P = _paths(self.kv_end.cpu())
        ke = self.kv_end.cpu().tolist()
        starts, ends, parents = P.node_start.tolist(), P.node_end.tolist(), P.node_parent.tolist()
        runs_of: list = []
        qr, kr, types = [], [], []

        def extend(runs, s, e):
            if s >= e:
                return runs
            if runs and runs[-1][1] == s:
                return runs[:-1] + [(runs[-1][0], e)]
            return runs + [(s, e)]

        for n, (s, e, p) in enumerate(zip(starts, ends, parents)):
            runs = [] if p < 0 else extend(runs_of[p], starts[p], ends[p])
            runs_of.append(runs)
            own_end = e - 1 if ke[e - 1] == e - 1 else e  # a padding row ends its node
            if own_end > s:
                for a, b in runs:
                    qr.append((s, own_end)), kr.append((a, b)), types.append("full")
                qr.append((s, own_end)), kr.append((s, own_end)), types.append("causal")
            if own_end < e:
                for a, b in extend(runs, s, own_end):
                    qr.append((own_end, e)), kr.append((a, b)), types.append("full")
        t = lambda x: torch.tensor(x, dtype=torch.int32).view(-1, 2)  # noqa: E731
        return t(qr), t(kr), types

    def tin_tout(self) -> Tuple[Tensor, Tensor]:
        """``(tin, tout)`` with ``tin[k] <= tin[q] < tout[k]`` iff ``q`` sees
        ``k`` (TRL's tree-packing form): ``tin`` = row index, ``tout`` =
        ``kv_end``."""
        return torch.arange(len(self), device=self.kv_end.device), self.kv_end.clone()


#: The former name of :class:`MaskPlan` (the crate's ``MaskPlan``, C's
#: ``TreeattnMaskPlan``: one name in every language); kept so that code
#: written against it keeps working.
TreeMask = MaskPlan


def _rotate(x: Tensor, pos: Tensor, base: float, dims: int) -> Tensor:
    """Llama rotate-half rotary of ``x`` ``[L, H, d]`` at ``pos`` ``[L]`` over
    the first ``dims`` lanes, computed in float32 or better."""
    half = dims // 2
    wdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    inv = base ** (-torch.arange(half, dtype=torch.float64, device=x.device) * 2.0 / dims)
    ang = pos.to(x.device, torch.float64)[:, None] * inv[None, :]
    cos = torch.cat([ang.cos(), ang.cos()], -1)[:, None, :].to(wdt)
    sin = torch.cat([ang.sin(), ang.sin()], -1)[:, None, :].to(wdt)
    xr, rest = x[..., :dims].to(wdt), x[..., dims:]
    rot = torch.cat([-xr[..., half:], xr[..., :half]], -1)
    return torch.cat([(xr * cos + rot * sin).to(x.dtype), rest], -1)


def _depths(kv_end: Tensor) -> Tensor:
    """``[L]`` int64 on ``kv_end``'s device: each row's depth, the number of
    its ancestors ``#{k < t : kv_end[k] > t}`` (the crate's
    ``treeattn::cost::depths``, O(L))."""
    return _per_row(kv_end, _native.tree_depths)


def _visible_keys(kv_end: Tensor) -> Tensor:
    """``[L]`` int64 on ``kv_end``'s device: per query ``q``, the keys it
    sees, ``#{k <= q : kv_end[k] > q}`` (the crate's
    ``treeattn::cost::visible_keys_per_query``, O(L))."""
    return _per_row(kv_end, _native.visible_keys_per_query)


def _per_row(kv_end: Tensor, fn: Any) -> Tensor:
    """One int64 per row of the 1-D ``kv_end``, computed by the native
    ``fn`` on a host copy; a ``kv_end`` outside ``k <= kv_end[k] <= L`` is a
    :class:`treeattn.PackError` naming the key."""
    if kv_end.dim() != 1:
        raise ValueError(f"kv_end must be 1-D, got shape {tuple(kv_end.shape)}")
    if kv_end.dtype.is_floating_point or kv_end.dtype == torch.bool:
        raise ValueError(f"kv_end must hold integers, got {kv_end.dtype}")
    host = kv_end.detach().to("cpu", torch.int64).contiguous()
    out = torch.empty(host.shape[0], dtype=torch.int64)
    if host.numel():
        fn(_ptr(host), host.numel(), _ptr(out))
    return out.to(kv_end.device)


def _window_starts(ke32: Tensor, window: int) -> Tensor:
    """``[L]`` int64: each row's first visible key under a sliding window
    (the crate's ``PackMask::window_starts``) of the int32 host ``kv_end``
    ``ke32``."""
    window = _check_window(window)
    L = int(ke32.numel())
    if L == 0:
        return torch.zeros(0, dtype=torch.int64)
    raw = _native.window_starts(_ptr(ke32), L, window)
    return torch.frombuffer(bytearray(raw), dtype=torch.int32).to(torch.int64)


def _check_window(window: Any) -> Optional[int]:
    """The window as the crate takes it (a u32): a window of 2**32 - 1
    levels or more lets every key of a pack through, as no window does, so
    a larger one is taken as 2**32 - 1 (the same attention)."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window = {window!r} must be None or an int >= 1 (tree levels)")
    return None if window is None else min(window, 2**32 - 1)


def _check_strided(**tensors: Optional[Tensor]) -> None:
    for name, t in tensors.items():
        if t is not None and t.layout != torch.strided:
            raise ValueError(f"{name} has layout {t.layout}: treeattn takes dense (strided) tensors")


def _real(name: str, x: Any) -> float:
    if isinstance(x, bool) or isinstance(x, complex):
        raise ValueError(f"{name} = {x!r} must be a real number")
    try:
        return float(x)
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"{name} = {x!r} must be a real number ({e})") from None


_flex_compiled: Dict[str, Any] = {}


def _flex(q: Tensor, k: Tensor, v: Tensor, mask: MaskPlan, scale: float, block_size: int,
          window: Optional[int] = None, softcap: Optional[float] = None,
          sinks: Optional[Tensor] = None) -> Tensor:
    """FlexAttention (compiled) with the mask's BlockMask; q ``[L, Hq, d]``.
    A softcap is its ``score_mod`` (``c · tanh(s / c)`` of the scaled
    score); sinks join each row's sum through the LSE FlexAttention
    returns: ``O · exp(LSE − logaddexp(LSE, σ_h))``."""
    from torch.nn.attention.flex_attention import flex_attention

    key = q.device.type
    if key not in _flex_compiled:
        _flex_compiled[key] = torch.compile(flex_attention, dynamic=False)
    hq, hkv = q.shape[1], k.shape[1]
    score_mod = None
    if softcap is not None:
        cap = float(softcap)

        def score_mod(score, b, h, q_idx, kv_idx):
            return cap * torch.tanh(score / cap)

    if sinks is not None and q.device.type == "cpu":
        raise ValueError(
            "backend=\"flex\" with sinks needs FlexAttention's LSE, which torch does not return on CPU "
            "(torch.compile of flex_attention on CPU: inference without return_lse); the crate's CPU backend "
            "(backend=\"treeattn\") computes sinks"
        )
    out = _flex_compiled[key](
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        score_mod=score_mod, block_mask=mask.block_mask(block_size, window), scale=scale,
        enable_gqa=hq != hkv, return_lse=sinks is not None,
    )
    if sinks is None:
        return out[0].transpose(0, 1)
    o, lse = out[0][0], out[1][0]  # [Hq, L, dv], [Hq, L]
    total = torch.logaddexp(lse.float(), sinks.float()[:, None])
    o = o * torch.exp(lse.float() - total)[..., None].to(o.dtype)
    return o.transpose(0, 1)



def _heads_first_hint(q: Tensor, k: Tensor) -> str:
    """A hint when q and k look like [H, L, d] (heads first, as transformers
    lays them out after the batch dim): the same length in dim 1."""
    if q.shape[1] == k.shape[1] and q.shape[0] != k.shape[0]:
        return (
            f"; they look like [H, L, d] (heads first, L = {q.shape[1]}): pass q.transpose(0, 1), "
            "k.transpose(0, 1), v.transpose(0, 1)"
        )
    return ""

def tree_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    kv_end: Union[Tensor, MaskPlan],
    *,
    scale: Optional[float] = None,
    position_ids: Optional[Tensor] = None,
    rope_base: Optional[float] = None,
    rope_dims: Optional[int] = None,
    backend: str = "treeattn",
    block_size: int = 128,
    window: Optional[int] = None,
    softcap: Optional[float] = None,
    sinks: Optional[Tensor] = None,
    deterministic: bool = False,
) -> Tensor:
    """Exact attention on a packed tree: query ``q`` sees key ``k`` iff
    ``k <= q < kv_end[k]``.

    ``q``: ``[L, Hq, d]``; ``k``: ``[L, Hkv, d]``, ``v``: ``[L, Hkv, dv]``
    with ``Hkv`` dividing ``Hq`` (GQA: query head ``h`` reads kv head ``h //
    (Hq // Hkv)``; ``dv`` may differ from ``d``: multi-head latent
    attention); ``kv_end``: ``[L]`` integers with ``k <= kv_end[k] <= L``
    (``kv_end[k] == k`` is a padding key no query sees). ``scale``: softmax
    scale, default ``1/sqrt(d)``. With ``rope_base``, q and k are rotated
    inside the op at ``position_ids`` (required then), Llama rotate-half
    convention, ``θ_i = rope_base^(−2i/rope_dims)`` over the first
    ``rope_dims`` lanes (default ``d``); gradients are with respect to the
    unrotated q and k. Returns O ``[L, Hq, dv]`` in q's dtype; a query row
    with no visible key gets O = 0 (and zero gradients), never NaN.

    The attention variants of the models people train (each exact on the
    tree, forward and backward):

    - ``window`` (int >= 1): a sliding window of tree levels — key ``k`` is
      visible to ``q`` only if also ``depth(q) − depth(k) < window``, depth
      = the row's number of ancestors (:meth:`MaskPlan.depths`, a pack's
      position id). On a chain it is transformers' ``sliding_window``
      (``q − k < window``); on a tree the distance is along the query's own
      branch, not in the pack's row order.
    - ``softcap`` (float > 0): ``s ← softcap · tanh(s / softcap)`` on the
      scaled score, before the mask and softmax (Gemma 2).
    - ``sinks`` (``[Hq]`` tensor, learnable: it gets a gradient): one logit
      per query head added to each row's softmax denominator with no value
      (gpt-oss): ``O = Σ e^{s_k} v_k / (Σ e^{s_k} + e^{sink})``.

    ``kv_end`` may be a :class:`MaskPlan` (validated once; its position ids
    are used when ``position_ids`` is not given). ``backend``:
    ``"treeattn"`` (the crate's CPU backend or CUDA kernels), ``"flex"``
    (FlexAttention, compiled, with :meth:`MaskPlan.block_mask` of
    ``block_size``; rotary applied in torch first; the softcap as its
    ``score_mod``, sinks through its LSE; on CPU torch has no FlexAttention
    backward), or ``"auto"``: the crate's kernels where they run (CPU; CUDA
    when built with them, bfloat16 / float16, head dim 64 or 128, with or
    without a window, softcap or sinks, no other value head dim), else
    FlexAttention. On CUDA, ``backend="treeattn"`` refuses a value head dim
    unlike q's with a ``ValueError`` naming ``backend="flex"``; the CPU
    backend computes them all.

    ``deterministic`` (bool, FlashAttention's name and default): on CUDA
    the backward sums dQ with atomic adds by default (as FlashAttention-2
    and -3: faster; the last bits of dQ vary from run to run, within the
    tolerances the kernels are held to); ``deterministic=True`` runs the
    deterministic dQ kernel instead (bit-identical dQ run to run, more
    backward time: docs/gpu.md). dK, dV and the sinks' gradient are
    deterministic either way, and so is everything on the CPU backend,
    where the flag is accepted and changes nothing (nor does it change the
    forward, or ``backend="flex"``). Anything but a bool is a
    ``ValueError``.
    """
    if backend not in ("treeattn", "flex", "auto"):
        raise ValueError(f'backend {backend!r}: expected "treeattn", "flex" or "auto"')
    if not isinstance(deterministic, bool):
        raise ValueError(f"deterministic = {deterministic!r}: expected a bool (True or False)")
    mask: Optional[MaskPlan] = None
    plan = 0
    if isinstance(kv_end, MaskPlan):
        mask = kv_end
        kv_end = mask.kv_end
        if position_ids is None:
            position_ids = mask.position_ids
        # The plan holds the mask's own position ids: other ones take the
        # per-call path.
        if position_ids is mask.position_ids:
            plan = mask._plan_id
    for name, t in (("q", q), ("k", k), ("v", v), ("kv_end", kv_end)):
        if not isinstance(t, Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if position_ids is not None and not isinstance(position_ids, Tensor):
        raise ValueError(f"position_ids must be a torch.Tensor or None, got {type(position_ids).__name__}")
    _check_strided(q=q, k=k, v=v, kv_end=kv_end, position_ids=position_ids)
    # Under autocast, attention runs in the autocast dtype, as SDPA does
    # (a model's q, k come out of rotary in float32 while v is bfloat16).
    if q.device.type in ("cpu", "cuda") and torch.is_autocast_enabled(q.device.type):
        amp = torch.get_autocast_dtype(q.device.type)
        q, k, v = (t.to(amp) if t.is_floating_point() else t for t in (q, k, v))
    if q.dim() != 3:
        raise ValueError(
            f"q must be [L, Hq, d] (tokens first), got shape {tuple(q.shape)} (from transformers' "
            "[B, H, L, d], take q[0].transpose(0, 1); a batch of packs goes through treeattn.hf's attention)"
        )
    if k.dim() != 3:
        raise ValueError(
            f"k must be [L, Hkv, d] (tokens first), got shape {tuple(k.shape)} (from transformers' "
            "[B, H, L, d], take k[0].transpose(0, 1))"
        )
    if v.dim() != 3 or v.shape[:2] != k.shape[:2] or v.shape[2] == 0:
        raise ValueError(
            f"v must be [L, Hkv, dv] (tokens first) with k's L and Hkv {tuple(k.shape[:2])}, got {tuple(v.shape)}"
        )
    L, hq, d = q.shape
    if L == 0 or hq == 0 or d == 0:
        raise ValueError(f"q must be non-empty, got shape {tuple(q.shape)}")
    if k.shape[0] != L:
        raise ValueError(
            f"k has {k.shape[0]} tokens, q has {L}: q {tuple(q.shape)} and k {tuple(k.shape)} must be "
            f"[L, Hq, d] and [L, Hkv, d] (tokens first){_heads_first_hint(q, k)}"
        )
    if k.shape[2] != d:
        raise ValueError(
            f"k has head dim {k.shape[2]}, q has {d}: q {tuple(q.shape)} and k {tuple(k.shape)} must be "
            "[L, Hq, d] and [L, Hkv, d] with one d"
        )
    hkv = k.shape[1]
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(
            f"k has {hkv} kv heads, which must divide q's {hq} heads (q {tuple(q.shape)} is [L, Hq, d], "
            f"k {tuple(k.shape)} [L, Hkv, d])"
        )
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in _COMPUTE:
            raise ValueError(f"{name} has dtype {t.dtype}: expected float32, float64, bfloat16 or float16")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if kv_end.dim() != 1 or kv_end.shape[0] != L:
        raise ValueError(
            f"kv_end must be [L] = [{L}] (L = q.shape[0], q being [L, Hq, d]), got shape {tuple(kv_end.shape)}"
            + (" (a [B, L] batch goes through treeattn.hf's attention, one pack per call here)"
               if kv_end.dim() == 2 else "")
        )
    if kv_end.dtype not in _INT:
        raise ValueError(f"kv_end has dtype {kv_end.dtype}: expected an integer dtype")
    if position_ids is not None:
        if position_ids.dim() != 1 or position_ids.shape[0] != L:
            raise ValueError(f"position_ids must be [L] = [{L}], got shape {tuple(position_ids.shape)}")
        if position_ids.dtype not in _INT:
            raise ValueError(f"position_ids has dtype {position_ids.dtype}: expected an integer dtype")
    if rope_base is not None:
        if position_ids is None:
            raise ValueError("rope_base is set but position_ids is None: rotary needs the position ids")
        rope_base = float(rope_base)
        if not (math.isfinite(rope_base) and rope_base > 1.0):
            raise ValueError(f"rope_base = {rope_base} must be finite and > 1")
        if rope_dims is None:
            rope_dims = d
        if isinstance(rope_dims, bool) or not isinstance(rope_dims, int) or rope_dims <= 0 or rope_dims % 2 or rope_dims > d:
            raise ValueError(f"rope_dims = {rope_dims!r} must be an even int in 2..={d}")
    elif rope_dims is not None:
        raise ValueError("rope_dims is set but rope_base is None")
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    scale = _real("scale", scale)
    if not (math.isfinite(scale) and scale > 0.0):
        raise ValueError(f"scale = {scale} must be finite and > 0")
    window = _check_window(window)
    if softcap is not None:
        if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not (
            math.isfinite(softcap) and softcap > 0
        ):
            raise ValueError(f"softcap = {softcap!r} must be None or a finite float > 0")
        softcap = float(softcap)
    if sinks is not None:
        if not isinstance(sinks, Tensor):
            raise ValueError(f"sinks must be a torch.Tensor or None, got {type(sinks).__name__}")
        _check_strided(sinks=sinks)
        if sinks.dim() != 1 or sinks.shape[0] != hq:
            raise ValueError(f"sinks must be [Hq] = [{hq}] (one logit per query head), got shape {tuple(sinks.shape)}")
        if not sinks.dtype.is_floating_point:
            raise ValueError(f"sinks has dtype {sinks.dtype}: expected a float dtype")
    device = q.device
    for name, t in (("k", k), ("v", v), ("kv_end", kv_end), ("position_ids", position_ids), ("sinks", sinks)):
        if t is not None:
            _check_device(name, t, device)
    # What the CUDA kernels compute: plain attention, a window, a softcap and
    # sinks (proven under the emulator); a value head dim unlike q's runs
    # with FlexAttention there.
    cuda_kernels = v.shape[2] == d
    if backend == "auto":
        ours = device.type == "cpu" or (
            device.type == "cuda" and cuda_built() and q.dtype in (torch.bfloat16, torch.float16)
            and d in (64, 128) and cuda_kernels
        )
        backend = "treeattn" if ours else "flex"
    if backend == "flex":
        if mask is None:
            mask = MaskPlan(kv_end, position_ids)
        if rope_base is not None:
            q = _rotate(q, position_ids, rope_base, rope_dims)
            k = _rotate(k, position_ids, rope_base, rope_dims)
        return _flex(q, k, v, mask, scale, block_size, window, softcap, sinks)
    if device.type == "cuda":
        if not cuda_built():
            _no_cuda("tree_attention")
        if q.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(
                f"q has dtype {q.dtype} on {device}: the CUDA kernels take bfloat16 or float16 "
                "(cast q, k, v, e.g. q.to(torch.bfloat16); nothing is cast silently)"
            )
        if not cuda_kernels:
            raise ValueError(
                "the CUDA kernels take a window, a softcap and attention sinks, not a value head "
                f"dim ({v.shape[2]}) unlike q's ({d}): this runs with backend=\"flex\" (or \"auto\") on CUDA"
            )
        o, _lse = _attn_fwd(
            q, k, v, kv_end, position_ids, scale, rope_base, rope_dims, _threads, plan, window, softcap, sinks,
            None, deterministic,
        )
        return o
    if device.type not in ("cpu", "meta"):
        raise ValueError(f"q is on {device}: treeattn runs on CPU and CUDA tensors")
    o, _lse = _attn_fwd(
        q, k, v, kv_end, position_ids, scale, rope_base, rope_dims, _threads, plan, window, softcap, sinks,
        None, deterministic,
    )
    return o


# --------------------------------------------------------------------------
# SDCC forward KL


@torch.library.custom_op("treeattn::sdcc_forward_kl", mutates_args=(), device_types="cpu")
def _sdcc(
    logits: Tensor,
    student_rows: Tensor,
    teacher_rows: Tensor,
    weights: Tensor,
    tau: float,
    threads: int,
) -> Tuple[Tensor, Tensor, Tensor]:
    rows, vocab = logits.shape
    logits = logits.contiguous()
    s = student_rows.to(torch.int64).contiguous()
    t = teacher_rows.to(torch.int64).contiguous()
    if logits.dtype == torch.float64:
        return _sdcc_float64(logits, s, t, weights.to(torch.float64), tau, threads)
    w = weights.to(torch.float32).contiguous()
    grad = torch.empty_like(logits)
    _loss_sum, loss_mean, per_pair = _native.sdcc_forward_kl(
        _dtype_name(logits), _ptr(logits), rows, vocab, _ptr(s), _ptr(t), s.numel(),
        _ptr(w), tau, _ptr(grad), threads,
    )
    # The crate's gradient is that of Σ w·KL; loss_mean = Σ w·KL / Σ w.
    wsum = float(w.to(torch.float64).clamp_min(0).sum())
    if wsum > 0:
        grad.div_(wsum)
    else:
        grad.zero_()
    return (
        torch.tensor(loss_mean, dtype=logits.dtype),
        torch.tensor(per_pair, dtype=logits.dtype).reshape(-1),
        grad,
    )


def _sdcc_float64(logits: Tensor, s: Tensor, t: Tensor, w: Tensor, tau: float, threads: int):
    """float64 SDCC with ``tau`` and the weights in float64 (the crate takes
    both as float32: with tau = 1.7 that alone is a 1e-7 relative error).
    The pairs' rows are gathered into a ``[2P, V]`` block divided by tau in
    float64; the crate computes each pair's KL and ``p_s − p_t`` on it with
    tau = 1 and unit weights (both exact in float32); the weights are
    applied here: ``loss = Σ w·KL / Σ w`` (0 when ``Σ w <= 0``),
    ``∂loss/∂logits[s_i] += w_i (p_s − p_t) / (tau Σ w)``."""
    rows, vocab = logits.shape
    P = s.numel()
    # The crate sees only the gathered block and unit weights, so what it
    # would check on the float32 path is checked here first, with its
    # errors: rows inside the logits (indexing would read row -1 as the
    # last), weights finite and >= 0.
    out_s, out_t = (s < 0) | (s >= rows), (t < 0) | (t >= rows)
    bad = (out_s | out_t).nonzero()
    if bad.numel():
        i = int(bad[0, 0])
        name, r = ("student_rows", s) if bool(out_s[i]) else ("teacher_rows", t)
        raise PackError(f"invalid pack: {name}[{i}] = {int(r[i])} is outside the {rows} rows of its logits")
    bad = (~torch.isfinite(w)).nonzero()
    if bad.numel():
        raise TreeattnError(f"non-finite value in SDCC weights at index {int(bad[0, 0])}")
    neg = (w < 0).nonzero()
    if neg.numel():
        i = int(neg[0, 0])
        raise UnsupportedError(f"unsupported: SDCC weight {i} is {float(w[i])} (weights must be >= 0)")
    block = torch.cat([logits[s], logits[t]]).div_(tau).contiguous()
    idx = torch.arange(2 * P, dtype=torch.int64)
    ones = torch.ones(P, dtype=torch.float32)
    gblock = torch.empty_like(block)
    _loss_sum, _loss_mean, per_pair = _native.sdcc_forward_kl(
        "float64", _ptr(block), 2 * P, vocab, _ptr(idx), _ptr(idx[P:].contiguous()), P,
        _ptr(ones), 1.0, _ptr(gblock), threads,
    )
    kl = torch.tensor(per_pair, dtype=torch.float64).reshape(-1)
    grad = torch.zeros_like(logits)
    wsum = w.sum()
    if float(wsum) > 0:
        loss = (w * kl).sum() / wsum
        grad.index_add_(0, s, gblock[:P] * (w / (wsum * tau))[:, None])
    else:
        loss = torch.zeros((), dtype=torch.float64)
    return loss, kl, grad


@_sdcc.register_fake
def _(logits, student_rows, teacher_rows, weights, tau, threads):
    return (
        logits.new_empty(()),
        logits.new_empty((student_rows.shape[0],)),
        torch.empty_like(logits, memory_format=torch.contiguous_format),
    )


@_sdcc.register_kernel("cuda")
def _(logits, student_rows, teacher_rows, weights, tau, threads):
    rows, vocab = logits.shape
    logits = logits.contiguous()
    s = student_rows.to("cpu", torch.int64).contiguous()
    t = teacher_rows.to("cpu", torch.int64).contiguous()
    w = weights.to("cpu", torch.float32).contiguous()
    grad = torch.empty((rows, vocab), dtype=torch.float32, device=logits.device)
    _loss_sum, loss_mean, per_pair = _native.sdcc_forward_kl(
        _CUDA_NAMES.get(logits.dtype, str(logits.dtype)),
        _ptr(logits), rows, vocab, _ptr(s), _ptr(t), s.numel(), _ptr(w), tau, _ptr(grad),
        device=logits.get_device(), stream=_stream(logits),
    )
    wsum = float(w.to(torch.float64).clamp_min(0).sum())
    if wsum > 0:
        grad.div_(wsum)
    else:
        grad.zero_()
    dev = logits.device
    return (
        torch.tensor(loss_mean, dtype=logits.dtype, device=dev),
        torch.tensor(per_pair, dtype=logits.dtype, device=dev).reshape(-1),
        grad.to(logits.dtype),
    )


def _sdcc_setup(ctx, inputs, output):
    _loss, kl, grad = output
    ctx.save_for_backward(grad)
    ctx.mark_non_differentiable(kl, grad)


def _sdcc_backward(ctx, grad_loss, _grad_kl, _grad_grad):
    (grad,) = ctx.saved_tensors
    return grad * grad_loss, None, None, None, None, None


_sdcc.register_autograd(_sdcc_backward, setup_context=_sdcc_setup)


def sdcc_forward_kl(
    logits: Tensor,
    student_rows: Tensor,
    teacher_rows: Tensor,
    weights: Optional[Tensor] = None,
    tau: float = 1.0,
) -> Tuple[Tensor, Tensor]:
    """SDCC forward KL(teacher ‖ student) over the vocabulary, fused.

    ``logits``: ``[rows, vocab]`` (e.g. the pack's logits); pair ``i`` is
    (student row ``student_rows[i]``, teacher row ``teacher_rows[i]``) of
    the same tensor; ``weights`` ``[P]`` non-negative (default ones); ``tau``
    the softmax temperature, ``p = softmax(logits / tau)``. Returns
    ``(loss_mean, kl_per_pair)``: ``loss_mean = Σ w·KL / Σ w`` (0 when
    ``Σ w = 0``), differentiable with respect to the *student* rows only
    (the teacher is stop-gradient: ``∂/∂student = w (p_s − p_t) / (τ Σ w)``);
    ``kl_per_pair`` ``[P]`` (unweighted, for logging) carries no gradient.
    A teacher entry of −inf adds exactly 0; a student −inf under teacher
    mass gives KL = +inf. No ``[P, vocab]`` softmax is materialised: the
    crate computes both log-sum-exps and the gradient in a pass over each
    row; the only extra memory is the gradient, shaped like ``logits``.
    bfloat16 / float16 logits are computed in float32. ``weights`` and
    ``tau`` are used in the logits' compute dtype: float32 for float32 /
    bfloat16 / float16 logits (``tau = 0.7`` means ``float32(0.7)``), and
    float64 for float64 logits — on CPU the crate (which takes them as
    float32) then runs on a gathered ``[2P, V]`` block pre-divided by tau,
    with unit weights applied afterwards (extra memory: that block and its
    gradient).
    """
    for name, t in (("logits", logits), ("student_rows", student_rows), ("teacher_rows", teacher_rows)):
        if not isinstance(t, Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    _check_strided(logits=logits, student_rows=student_rows, teacher_rows=teacher_rows)
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"logits must be [rows, vocab] with vocab > 0, got shape {tuple(logits.shape)}")
    if logits.dtype not in _COMPUTE:
        raise ValueError(f"logits has dtype {logits.dtype}: expected float32, float64, bfloat16 or float16")
    for name, t in (("student_rows", student_rows), ("teacher_rows", teacher_rows)):
        if t.dim() != 1:
            raise ValueError(f"{name} must be 1-D [P], got shape {tuple(t.shape)}")
        if t.dtype not in _INT:
            raise ValueError(f"{name} has dtype {t.dtype}: expected an integer dtype")
    if student_rows.shape != teacher_rows.shape:
        raise ValueError(
            f"student_rows has {student_rows.shape[0]} pairs, teacher_rows {teacher_rows.shape[0]}"
        )
    P = student_rows.shape[0]
    if weights is None:
        weights = torch.ones(P, dtype=torch.float32, device=logits.device)
    else:
        if not isinstance(weights, Tensor):
            raise ValueError(f"weights must be a torch.Tensor or None, got {type(weights).__name__}")
        if weights.dim() != 1 or weights.shape[0] != P:
            raise ValueError(f"weights must be [P] = [{P}], got shape {tuple(weights.shape)}")
        if not weights.dtype.is_floating_point:
            raise ValueError(f"weights has dtype {weights.dtype}: expected a float dtype")
        _check_strided(weights=weights)
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not (math.isfinite(tau) and tau > 0):
        raise ValueError(f"tau = {tau!r} must be finite and > 0")
    device = logits.device
    for name, t in (("student_rows", student_rows), ("teacher_rows", teacher_rows), ("weights", weights)):
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, logits is on {device}: all tensors must be on one device")
    if device.type == "cuda":
        if not cuda_built():
            _no_cuda("sdcc_forward_kl")
        if logits.dtype not in _CUDA_NAMES:
            raise ValueError(
                f"logits has dtype {logits.dtype} on {device}: the CUDA SDCC kernel takes "
                "bfloat16, float16 or float32"
            )
        loss, kl, _grad = _sdcc(logits, student_rows, teacher_rows, weights.detach(), float(tau), _threads)
        return loss, kl
    if device.type not in ("cpu", "meta"):
        raise ValueError(f"logits is on {device}: treeattn runs on CPU and CUDA tensors")
    cdt = _COMPUTE[logits.dtype]
    loss, kl, _grad = _sdcc(logits.to(cdt), student_rows, teacher_rows, weights.detach(), float(tau), _threads)
    return loss.to(logits.dtype), kl.to(logits.dtype)
