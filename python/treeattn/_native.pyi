"""Type stubs of ``treeattn._native``, the PyO3 module (python/src/lib.rs).

Checked against the built module by ``python -m mypy.stubtest
treeattn._native`` (.ci/run) and by python/tests/test_stub.py. Tensors cross
as raw data pointers (``tensor.data_ptr()``, ``int``) of contiguous tensors
that :mod:`treeattn.torch` has validated; ``dtype`` is a torch dtype's name:
``"float32"`` / ``"float64"`` / ``"bfloat16"`` / ``"float16"`` for CPU
attention (the LSE in float32 for the last two), ``"float32"`` /
``"float64"`` for CPU SDCC, ``"bfloat16"`` / ``"float16"`` for device
attention, and those or ``"float32"`` for device SDCC.
"""

from typing import Any, Dict, List, Optional, Tuple, Type, final

__all__ = [
    "attention_forward",
    "attention_backward",
    "sdcc_forward_kl",
    "pack",
    "gae",
    "grpo",
    "pack_cost",
    "balance",
    "tree_depths",
    "visible_keys_per_query",
    "ModelCost",
    "PACK_SCHEMA",
    "paths",
    "kv_end_from_positions",
    "block_census",
    "window_starts",
    "summary_segments_of",
    "cuda_built",
    "cpu_isa",
    "MaskPlan",
    "__version__",
    "TreeattnError",
    "RolloutError",
    "PackError",
    "ShapeError",
    "UnsupportedError",
]
__version__: str

PACK_SCHEMA: Tuple[Tuple[str, str, str], ...]
"""The pack schema (``treeattn::safetensors::PACK_SCHEMA``): ``(name, dtype,
axis)`` of every tensor a pack may hold, in file order; dtype a torch dtype
name, axis ``"L"`` (tokens), ``"T"`` (targets), ``"P"`` (SDCC pairs) or
``"R"`` (rollouts)."""

class TreeattnError(ValueError):
    """Bad input to treeattn: the base of its error classes (a ValueError)."""

class RolloutError(TreeattnError):
    """A rollout that breaks the calls format, or rollout JSON that does not parse."""

class PackError(TreeattnError):
    """An invalid pack or mask (kv_end out of range, an SDCC row outside the logits)."""

class ShapeError(TreeattnError):
    """Sizes or lengths of the arguments that do not fit together."""

class UnsupportedError(TreeattnError):
    """Well-formed input treeattn does not take (a head dim, a rotary setting, ...)."""

@final
class MaskPlan:
    """A pack's mask validated once (kv_end and position ids from host int32
    buffers of ``tokens`` entries); pass it as ``plan=`` to the attention
    entries, whose kv_end / position_ids arguments are then ignored. On CUDA
    it keeps its device copy, made by its first call."""

    def __new__(cls, kv_end: int, position_ids: int, tokens: int) -> MaskPlan: ...
    def __len__(self) -> int: ...
    @property
    def fingerprint(self) -> int: ...
    @property
    def device_copies(self) -> int: ...

def attention_forward(
    dtype: str,
    q: int,
    k: int,
    v: int,
    kv_end: int,
    position_ids: int,
    o: int,
    lse: int,
    tokens: int,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    scale: float,
    rope_base: Optional[float] = None,
    rope_dims: Optional[int] = None,
    threads: int = 0,
    plan: Optional[MaskPlan] = None,
    v_head_dim: Optional[int] = None,
    window: Optional[int] = None,
    softcap: Optional[float] = None,
    sinks: int = 0,
    kv_start: int = 0,
    device: Optional[int] = None,
    stream: int = 0,
) -> None: ...
def attention_backward(
    dtype: str,
    q: int,
    k: int,
    v: int,
    kv_end: int,
    position_ids: int,
    o: int,
    lse: int,
    grad_out: int,
    dq: int,
    dk: int,
    dv: int,
    tokens: int,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    scale: float,
    rope_base: Optional[float] = None,
    rope_dims: Optional[int] = None,
    threads: int = 0,
    plan: Optional[MaskPlan] = None,
    v_head_dim: Optional[int] = None,
    window: Optional[int] = None,
    softcap: Optional[float] = None,
    sinks: int = 0,
    dsinks: int = 0,
    kv_start: int = 0,
    deterministic: bool = False,
    device: Optional[int] = None,
    stream: int = 0,
) -> None: ...
def sdcc_forward_kl(
    dtype: str,
    logits: int,
    rows: int,
    vocab: int,
    student_rows: int,
    teacher_rows: int,
    pairs: int,
    weights: int,
    tau: float,
    grad: int,
    threads: int = 0,
    device: Optional[int] = None,
    stream: int = 0,
) -> Tuple[float, float, List[float]]:
    """Returns ``(loss_sum, loss_mean, per_pair_kl)``; on a device, waits
    for ``stream``."""

def pack(
    source: str,
    value: str,
    layout: str = "trie",
    share_prefixes: bool = True,
    budget: Optional[int] = None,
) -> List[Dict[str, Any]]:
    """Packs JSONL text (``source="text"``) or a file (``"file"``): one dict a pack."""

def gae(
    rollout: List[int],
    segment: List[int],
    values: List[float],
    outcome: List[float],
    token: Optional[List[float]],
    bootstrap: Optional[List[float]],
    gamma: float,
    lam: Optional[float],
    alpha: float,
    critic_lam: Optional[float],
    critic_adaptive: bool,
    mode: str,
) -> Tuple[bytes, bytes]:
    """Returns ``(advantages, returns)`` as float64 little-endian bytes:
    ``outcome`` the rollouts' scalar reward per target, ``token`` the
    per-token rewards, ``bootstrap`` the value after each rollout's last
    target (per target; ``None``: zeros)."""

def summary_segments_of(
    rollout: List[int], segment: List[int], call: List[int], summary: List[bool]
) -> List[int]:
    """CompactionRL's segments: the junction segments with every summary
    call a segment of its own, one per target."""

def grpo(rewards: List[float], groups: List[int], eps: Optional[float], std: str = "sample") -> List[float]:
    """GRPO advantages per rollout; ``eps=None``: unscaled; ``std``
    ``"sample"``, ``"population"`` or ``"batch"``."""

@final
class ModelCost:
    """The shape of a decoder as far as its FLOPs go
    (``treeattn::cost::ModelCost``); immutable, compared and hashed by its
    fields. Exported as :class:`treeattn.ModelCost`."""

    def __new__(
        cls,
        layers: int,
        hidden: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        intermediate: int,
        vocab: int,
    ) -> ModelCost: ...
    @classmethod
    def from_config(cls, config: Any) -> ModelCost: ...
    @classmethod
    def llama3_8b(cls) -> ModelCost: ...
    @property
    def layers(self) -> int: ...
    @property
    def hidden(self) -> int: ...
    @property
    def heads(self) -> int: ...
    @property
    def kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def intermediate(self) -> int: ...
    @property
    def vocab(self) -> int: ...
    def attention_per_pair(self) -> float: ...
    def linear_per_token(self) -> float: ...
    def logits_per_row(self) -> float: ...
    def __eq__(self, value: object, /) -> bool: ...
    def __hash__(self) -> int: ...
    def __reduce__(self) -> Tuple[Type[ModelCost], Tuple[int, ...]]: ...

def pack_cost(kv_end: bytes, logit_rows: int, model: ModelCost) -> Dict[str, float]:
    """FLOPs of a training step on a pack: ``attention``, ``linear``,
    ``total``, ``visible_pairs``, ``tokens``, ``logit_rows``."""

def balance(
    source: str,
    value: str,
    world_size: int,
    budget: int,
    model_cost: ModelCost,
    share_prefixes: bool = True,
    layout: str = "trie",
    objective: str = "flops",
) -> Dict[str, Any]:
    """``treeattn::pack::balance`` on JSONL text or a file: ``micro_steps``
    M and ``bins`` (M · world_size, bin ``m · world_size + r``: a pack dict
    as :func:`pack` returns, or ``None``)."""

def tree_depths(kv_end: int, tokens: int, out: int) -> None:
    """Each row's depth (``treeattn::cost::depths``) from the int64
    ``kv_end`` at one address into the int64 buffer at ``out``."""

def visible_keys_per_query(kv_end: int, tokens: int, out: int) -> None:
    """Each query's visible keys (``treeattn::cost::visible_keys_per_query``),
    as :func:`tree_depths`."""

def paths(kv_end: bytes) -> Dict[str, bytes]:
    """The path structure of ``kv_end`` (int64 bytes) as int64 bytes per field."""

def kv_end_from_positions(position_ids: bytes) -> bytes:
    """``kv_end`` (int64 little-endian bytes) of a pre-order layout whose
    position ids (int64 little-endian bytes) are depths:
    ``treeattn::mask::kv_end_from_positions``."""

def window_starts(kv_end: int, tokens: int, window: int) -> bytes:
    """The first visible key per row under a sliding window, as int32 bytes."""

def block_census(kv_end: int, tokens: int, block: int, window: Optional[int] = None) -> List[bytes]:
    """``(kv_num, kv_indices, full_num, full_indices)`` as int32 bytes."""

def cuda_built() -> bool: ...
def cpu_isa() -> str: ...

