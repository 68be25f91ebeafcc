//! `treeattn._native`: the PyO3 adapter of the treeattn crate for Python.
//!
//! Thin by design: every function here turns Python arguments into the
//! crate's argument types and calls the crate. Attention and SDCC go
//! through the crate's raw layer (`treeattn::ffi`, shared with the C ABI:
//! pointer checks, dtype dispatch, the mask plan, the contract's checks,
//! on the CPU backend or the caller's CUDA stream); packing, balancing,
//! RL and cost through `pack::batch`, `pack::balance`, `rl`,
//! `cost::ModelCost` and `safetensors::pack_tensors`. No attention,
//! softmax, packing or cost logic lives here.
//!
//! Tensors cross as raw data pointers of contiguous tensors (the
//! `treeattn.torch` wrapper checks device, dtype, contiguity and element
//! counts before it calls in; the raw layer checks null, alignment and
//! overlaps again), so nothing is copied; the computation runs with the GIL
//! released.
//!
//! Errors: the crate's `Error` becomes, for bad input, one of treeattn's
//! exception classes, all subclasses of `ValueError` (`TreeattnError` and
//! under it `RolloutError`, `PackError`, `ShapeError`, `UnsupportedError`,
//! defined here and exported by the `treeattn` package), `OSError` for i/o
//! and `RuntimeError` otherwise; a Rust panic is caught at the boundary and
//! becomes a `RuntimeError`, never a `pyo3_runtime.PanicException` (a
//! `BaseException`).

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use pyo3::exceptions::{PyOSError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyDict, PyInt, PyList, PyTuple, PyType};

use treeattn::backend::cpu::Cpu;
use treeattn::backend::{AttnParams, AttnShape, Rope};
use treeattn::ffi;
use treeattn::cost::{check_kv_end, depths, visible_keys_per_query, visible_pairs, ModelCost};
use treeattn::mask::{BlockCensus, PackMask};
use treeattn::pack::{balance as balance_packs, batch, Batch, Layout, Objective};
use treeattn::paths::Paths;
use treeattn::plan::MaskPlan;
use treeattn::rl::{
    grpo_advantages, summary_segments, Gae, GaeMode, GrpoScale, GrpoStd, Lambda, Rewards, Targets,
};
use treeattn::rollout::{parse_jsonl, read_jsonl_file, Rollout};
use treeattn::safetensors::{
    loss_field_tensors, pack_tensors, rollout_tensors, Dtype, PACK_SCHEMA,
};
use treeattn::tree::RolloutStats;
use treeattn::Error;

pyo3::create_exception!(
    treeattn,
    TreeattnError,
    PyValueError,
    "Bad input to treeattn: the base of its error classes (a ValueError)."
);
pyo3::create_exception!(
    treeattn,
    RolloutError,
    TreeattnError,
    "A rollout that breaks the calls format, or rollout JSON that does not parse."
);
pyo3::create_exception!(
    treeattn,
    PackError,
    TreeattnError,
    "An invalid pack or mask (kv_end out of range, an SDCC row outside the logits)."
);
pyo3::create_exception!(
    treeattn,
    ShapeError,
    TreeattnError,
    "Sizes or lengths of the arguments that do not fit together."
);
pyo3::create_exception!(
    treeattn,
    UnsupportedError,
    TreeattnError,
    "Well-formed input treeattn does not take (a head dim, a rotary setting, ...)."
);

/// The crate's error as the Python exception a caller expects.
fn to_py(e: Error) -> PyErr {
    let msg = e.to_string();
    match e {
        Error::Rollout { .. } | Error::Json { .. } => RolloutError::new_err(msg),
        Error::Pack(_) => PackError::new_err(msg),
        Error::Shape(_) => ShapeError::new_err(msg),
        Error::Unsupported(_) => UnsupportedError::new_err(msg),
        Error::NonFinite { .. } | Error::Usage(_) | Error::Null(_) => TreeattnError::new_err(msg),
        Error::Io(_) => PyOSError::new_err(msg),
        Error::Cuda(_) => PyRuntimeError::new_err(msg),
    }
}

/// Runs `f`, turning a panic into a `RuntimeError` (a panic is a bug in the
/// crate, never the caller's input; it must not unwind into Python).
fn guarded<R>(f: impl FnOnce() -> PyResult<R>) -> PyResult<R> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(p) => {
            let what = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            Err(PyRuntimeError::new_err(format!(
                "treeattn internal error (a bug, please report it): {what}"
            )))
        }
    }
}

/// A read-only host slice of `len` elements at address `ptr` (from
/// `tensor.data_ptr()`), checked by the crate's raw layer
/// ([`ffi::host_slice`]: null, alignment, overflow); an empty slice never
/// touches `ptr`.
///
/// Safety: the caller (the Python wrapper) guarantees that `ptr` is the
/// data of a live contiguous CPU tensor of at least `len` elements of type
/// `T`, not written while the slice lives.
unsafe fn slice<'a, T>(what: &str, ptr: usize, len: usize) -> PyResult<&'a [T]> {
    ffi::host_slice(what, ptr, len).map_err(to_py)
}

/// A writable host slice; see [`slice`]. Safety: also, nothing else reads
/// or writes that memory while the slice lives.
unsafe fn slice_mut<'a, T>(what: &str, ptr: usize, len: usize) -> PyResult<&'a mut [T]> {
    ffi::host_slice_mut(what, ptr, len).map_err(to_py)
}

/// The shape and parameters of one attention call, as the wrapper gives them.
#[derive(Clone, Copy)]
struct Call {
    shape: AttnShape,
    params: AttnParams,
}

/// The variants of a call beyond the scale and rotary (see
/// `treeattn::backend::AttnParams`), as the wrapper gives them.
#[derive(Clone, Copy, Default)]
struct Variants {
    v_head_dim: Option<usize>,
    window: Option<u32>,
    softcap: Option<f64>,
}

#[allow(clippy::too_many_arguments)]
fn attn_call(
    tokens: usize,
    q_heads: usize,
    kv_heads: usize,
    head_dim: usize,
    scale: f64,
    rope_base: Option<f64>,
    rope_dims: Option<usize>,
    var: Variants,
) -> Call {
    let mut params = AttnParams::new(head_dim);
    params.softmax_scale = scale;
    params.rope = rope_base.map(|base| Rope {
        base,
        dims: rope_dims.unwrap_or(head_dim),
    });
    params.window = var.window;
    params.softcap = var.softcap;
    Call {
        shape: AttnShape {
            tokens,
            q_heads,
            kv_heads,
            head_dim,
            v_head_dim: var.v_head_dim.unwrap_or(head_dim),
        },
        params,
    }
}

/// Addresses of one attention call's tensors (plain integers, so that the
/// closure run without the GIL is `Send`).
#[derive(Clone, Copy)]
struct Ptrs {
    q: usize,
    k: usize,
    v: usize,
    kv_end: usize,
    pos: usize,
    /// Attention sinks `[q_heads]` of q's dtype; 0 for none.
    sinks: usize,
    /// Explicit first visible key per query row, `[tokens]` int32 read as
    /// u32; 0 for none.
    key_starts: usize,
}

/// The call as the crate's raw layer takes it (`ffi::RawAttention`): the
/// plan's mask when one is given, else the buffers'.
fn raw_call<'a>(
    dtype: &str,
    c: Call,
    p: Ptrs,
    plan: Option<&'a MaskPlan>,
) -> PyResult<ffi::RawAttention<'a>> {
    Ok(ffi::RawAttention {
        dtype: ffi::Dtype::from_name(dtype).map_err(to_py)?,
        q: p.q,
        k: p.k,
        v: p.v,
        mask: match plan {
            Some(plan) => ffi::RawMask::Plan(plan),
            None => ffi::RawMask::Arrays {
                kv_end: p.kv_end,
                position_ids: p.pos,
            },
        },
        sinks: p.sinks,
        key_starts: p.key_starts,
        shape: c.shape,
        params: c.params,
    })
}

/// `treeattn._native.MaskPlan`: a pack's mask validated once
/// ([`treeattn::plan::MaskPlan`]), passed as `plan=` to the attention
/// entries in place of the kv_end / position id buffers, so that no call
/// validates or (on CUDA) uploads the mask again: the device copy is made
/// by the first CUDA call and kept in the plan.
#[pyclass(name = "MaskPlan", module = "treeattn._native", frozen)]
struct PyMaskPlan(Arc<MaskPlan>);

#[pymethods]
impl PyMaskPlan {
    /// From host int32 buffers (read as u32) of `tokens` entries each.
    #[new]
    fn new(kv_end: usize, position_ids: usize, tokens: usize) -> PyResult<Self> {
        // SAFETY: the wrapper passes the data of live contiguous int32
        // tensors of `tokens` elements (checked for null and alignment).
        let (ke, pos) = unsafe {
            (
                slice::<u32>("kv_end", kv_end, tokens)?,
                slice::<u32>("position_ids", position_ids, tokens)?,
            )
        };
        guarded(|| Ok(PyMaskPlan(Arc::new(MaskPlan::new(ke, pos).map_err(to_py)?))))
    }
    fn __len__(&self) -> usize {
        self.0.len()
    }
    /// The pack's fingerprint (FNV-1a of kv_end and position ids).
    #[getter]
    fn fingerprint(&self) -> u64 {
        self.0.fingerprint()
    }
    /// Device copies the plan holds (one per CUDA device used; 0 without
    /// the `cuda` feature).
    #[getter]
    fn device_copies(&self) -> usize {
        #[cfg(feature = "cuda")]
        return self.0.device_copies();
        #[cfg(not(feature = "cuda"))]
        0
    }
}

fn cpu(threads: usize) -> Cpu {
    if threads == 0 {
        Cpu::default()
    } else {
        Cpu::with_threads(threads)
    }
}

/// Where a call runs: `device = None`, on the host on the CPU backend
/// (`threads`, 0 for the default); `device = n`, on CUDA device `n` on
/// torch's stream `stream` (a `cudaStream_t` address).
#[derive(Clone, Copy)]
enum Place {
    Host {
        threads: usize,
    },
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    Cuda {
        device: usize,
        stream: usize,
    },
}

impl Place {
    /// `what`'s place, refused on a build without the kernels. A stream
    /// without a device, or CPU threads with one, is refused rather than
    /// dropped.
    fn of(what: &str, device: Option<usize>, stream: usize, threads: usize) -> PyResult<Place> {
        // One of the two is unused in each build.
        let _ = (what, stream);
        match device {
            None if stream != 0 => Err(PyValueError::new_err(format!(
                "{what}: stream={stream:#x} without a device: a stream is for a CUDA call (device=n)"
            ))),
            Some(device) if threads != 0 => Err(PyValueError::new_err(format!(
                "{what}: threads={threads} with device={device}: threads are the CPU backend's"
            ))),
            None => Ok(Place::Host { threads }),
            #[cfg(feature = "cuda")]
            Some(device) => Ok(Place::Cuda { device, stream }),
            #[cfg(not(feature = "cuda"))]
            Some(_) => Err(no_cuda_build(what)),
        }
    }
}

/// Tree attention forward (see `treeattn.torch`) on contiguous buffers: on
/// the host (`device = None`; every buffer CPU memory) or on CUDA device
/// `device` on torch's stream `stream` (q, k, v, o, lse and the sinks
/// device memory, bf16 / f16 with an f32 lse; kv_end, position_ids and
/// kv_start host int32 buffers; nothing is copied but the mask, and a
/// `MaskPlan`'s device copy is uploaded by its first call, then reused).
/// `sinks` `[q_heads]` of q's dtype (0: none), `kv_start` `[tokens]` read
/// as u32 (0: none).
#[pyfunction]
#[pyo3(signature = (dtype, q, k, v, kv_end, position_ids, o, lse, tokens, q_heads, kv_heads, head_dim, scale, rope_base=None, rope_dims=None, threads=0, plan=None, v_head_dim=None, window=None, softcap=None, sinks=0, kv_start=0, device=None, stream=0))]
#[allow(clippy::too_many_arguments)]
fn attention_forward(
    py: Python<'_>,
    dtype: &str,
    q: usize,
    k: usize,
    v: usize,
    kv_end: usize,
    position_ids: usize,
    o: usize,
    lse: usize,
    tokens: usize,
    q_heads: usize,
    kv_heads: usize,
    head_dim: usize,
    scale: f64,
    rope_base: Option<f64>,
    rope_dims: Option<usize>,
    threads: usize,
    plan: Option<&PyMaskPlan>,
    v_head_dim: Option<usize>,
    window: Option<u32>,
    softcap: Option<f64>,
    sinks: usize,
    kv_start: usize,
    device: Option<usize>,
    stream: usize,
) -> PyResult<()> {
    let place = Place::of("tree_attention", device, stream, threads)?;
    let var = Variants {
        v_head_dim,
        window,
        softcap,
    };
    let c = attn_call(
        tokens, q_heads, kv_heads, head_dim, scale, rope_base, rope_dims, var,
    );
    let p = Ptrs {
        q,
        k,
        v,
        kv_end,
        pos: position_ids,
        sinks,
        key_starts: kv_start,
    };
    let dtype = dtype.to_string();
    let plan = plan.map(|pl| pl.0.clone());
    py.detach(move || {
        guarded(|| {
            let a = raw_call(&dtype, c, p, plan.as_deref())?;
            // SAFETY: the wrapper passes live contiguous tensors of the
            // sizes the call says, in the memory `place` says (torch's
            // current stream of that device).
            unsafe {
                match place {
                    Place::Host { threads } => ffi::attention_forward(&cpu(threads), &a, o, lse),
                    #[cfg(feature = "cuda")]
                    Place::Cuda { device, stream } => {
                        ffi::cuda_attention_forward(device, stream, &a, o, lse)
                    }
                    #[cfg(not(feature = "cuda"))]
                    Place::Cuda { .. } => unreachable!("refused by Place::of"),
                }
            }
            .map_err(to_py)
        })
    })
}

/// Tree attention backward (see `attention_forward`): o, grad_out, dq,
/// dk, dv like q, lse as the forward wrote it; with sinks, their gradient
/// into `dsinks` (`[q_heads]`, q's dtype; 0: not asked for). On CUDA,
/// `deterministic` sums dQ by the deterministic kernel (bit-identical run
/// to run) instead of atomic adds (the default); the host backward is
/// deterministic either way.
#[pyfunction]
#[pyo3(signature = (dtype, q, k, v, kv_end, position_ids, o, lse, grad_out, dq, dk, dv, tokens, q_heads, kv_heads, head_dim, scale, rope_base=None, rope_dims=None, threads=0, plan=None, v_head_dim=None, window=None, softcap=None, sinks=0, dsinks=0, kv_start=0, deterministic=false, device=None, stream=0))]
#[allow(clippy::too_many_arguments, unused_variables)]
fn attention_backward(
    py: Python<'_>,
    dtype: &str,
    q: usize,
    k: usize,
    v: usize,
    kv_end: usize,
    position_ids: usize,
    o: usize,
    lse: usize,
    grad_out: usize,
    dq: usize,
    dk: usize,
    dv: usize,
    tokens: usize,
    q_heads: usize,
    kv_heads: usize,
    head_dim: usize,
    scale: f64,
    rope_base: Option<f64>,
    rope_dims: Option<usize>,
    threads: usize,
    plan: Option<&PyMaskPlan>,
    v_head_dim: Option<usize>,
    window: Option<u32>,
    softcap: Option<f64>,
    sinks: usize,
    dsinks: usize,
    kv_start: usize,
    deterministic: bool,
    device: Option<usize>,
    stream: usize,
) -> PyResult<()> {
    let place = Place::of("tree_attention", device, stream, threads)?;
    let var = Variants {
        v_head_dim,
        window,
        softcap,
    };
    let c = attn_call(
        tokens, q_heads, kv_heads, head_dim, scale, rope_base, rope_dims, var,
    );
    let p = Ptrs {
        q,
        k,
        v,
        kv_end,
        pos: position_ids,
        sinks,
        key_starts: kv_start,
    };
    let g = ffi::RawGrads {
        o,
        lse,
        d_o: grad_out,
        dq,
        dk,
        dv,
        dsinks,
    };
    let dtype = dtype.to_string();
    let plan = plan.map(|pl| pl.0.clone());
    py.detach(move || {
        guarded(|| {
            let a = raw_call(&dtype, c, p, plan.as_deref())?;
            // SAFETY: as for `attention_forward`.
            unsafe {
                match place {
                    Place::Host { threads } => ffi::attention_backward(&cpu(threads), &a, &g),
                    #[cfg(feature = "cuda")]
                    Place::Cuda { device, stream } => {
                        use treeattn::backend::cuda::DqMode;
                        let mode = if deterministic {
                            DqMode::Deterministic
                        } else {
                            DqMode::Atomic
                        };
                        ffi::cuda_attention_backward(device, stream, &a, &g, mode)
                    }
                    #[cfg(not(feature = "cuda"))]
                    Place::Cuda { .. } => unreachable!("refused by Place::of"),
                }
            }
            .map_err(to_py)
        })
    })
}

/// SDCC forward KL (see `treeattn.torch`): student and teacher rows (two
/// int64 host columns of `pairs` entries) both index `logits` (`rows ×
/// vocab`), one f32 host weight each; the gradient of `Σ w·KL` goes to
/// `grad` (like `logits` on the host; f32 on CUDA). On the host
/// (`device = None`) or on CUDA device `device` on torch's stream `stream`
/// (logits and grad device memory; waits for the stream once). Returns
/// `(loss_sum, loss_mean, kl_per_pair)`.
#[pyfunction]
#[pyo3(signature = (dtype, logits, rows, vocab, student_rows, teacher_rows, pairs, weights, tau, grad, threads=0, device=None, stream=0))]
#[allow(clippy::too_many_arguments)]
fn sdcc_forward_kl(
    py: Python<'_>,
    dtype: &str,
    logits: usize,
    rows: usize,
    vocab: usize,
    student_rows: usize,
    teacher_rows: usize,
    pairs: usize,
    weights: usize,
    tau: f32,
    grad: usize,
    threads: usize,
    device: Option<usize>,
    stream: usize,
) -> PyResult<(f64, f64, Vec<f64>)> {
    let place = Place::of("sdcc_forward_kl", device, stream, threads)?;
    let c = ffi::RawSdcc {
        dtype: ffi::Dtype::from_name(dtype).map_err(to_py)?,
        student: logits,
        student_rows: rows,
        teacher: logits,
        teacher_rows: rows,
        vocab,
        pairs: ffi::RawPairs::Columns {
            student: student_rows,
            teacher: teacher_rows,
        },
        n_pairs: pairs,
        weights,
        temperature: tau,
    };
    py.detach(move || {
        guarded(|| {
            // SAFETY: as for `attention_forward`.
            let loss = unsafe {
                match place {
                    Place::Host { threads } => ffi::sdcc_forward_kl(&cpu(threads), &c, grad),
                    #[cfg(feature = "cuda")]
                    Place::Cuda { device, stream } => {
                        ffi::cuda_sdcc_forward_kl(device, stream, &c, grad)
                    }
                    #[cfg(not(feature = "cuda"))]
                    Place::Cuda { .. } => unreachable!("refused by Place::of"),
                }
            }
            .map_err(to_py)?;
            Ok((loss.loss_sum, loss.loss_mean, loss.per_pair))
        })
    })
}

/// Whether this extension was built with the crate's `cuda` feature (the
/// entries then run the kernels for `device = n`; otherwise they raise).
#[pyfunction]
fn cuda_built() -> bool {
    cfg!(feature = "cuda")
}

/// The CPU backend's code path in this process (`treeattn::backend::cpu::isa`):
/// `"portable"`, `"avx2+fma"`, `"avx512"` or `"avx512+bf16"`.
#[pyfunction]
fn cpu_isa() -> &'static str {
    treeattn::backend::cpu::isa().name()
}

#[cfg(not(feature = "cuda"))]
fn no_cuda_build(what: &str) -> PyErr {
    PyRuntimeError::new_err(format!(
        "{what}: CUDA tensors are not supported by this build of treeattn (the extension was built \
         without the crate's `cuda` feature; rebuild it with \
         MATURIN_PEP517_ARGS=\"--features cuda\" pip install ./python, nvcc 13 on PATH or in \
         TREEATTN_NVCC), or move the tensors to the CPU"
    ))
}

fn layout_of(name: &str) -> PyResult<Layout> {
    match name {
        "trie" => Ok(Layout::Trie),
        "replicated" => Ok(Layout::Replicated),
        other => Err(PyValueError::new_err(format!(
            "layout {other:?}: expected \"trie\" or \"replicated\""
        ))),
    }
}

fn dtype_name(d: Dtype) -> &'static str {
    match d {
        Dtype::I64 => "int64",
        Dtype::I32 => "int32",
        Dtype::F32 => "float32",
        Dtype::F64 => "float64",
        Dtype::Bool => "bool",
    }
}

fn stats_dict<'py>(py: Python<'py>, s: &RolloutStats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("id", &s.id)?;
    d.set_item("calls", s.calls)?;
    d.set_item("junctions", s.junctions)?;
    d.set_item("branches", s.branches)?;
    d.set_item("targets", s.targets)?;
    d.set_item("present", s.present)?;
    d.set_item("diverging", s.diverging)?;
    d.set_item("trie_tokens", s.trie_tokens)?;
    d.set_item("branch_tokens", s.branch_tokens)?;
    d.set_item("dedup_ratio", s.dedup_ratio)?;
    let evicted: usize = s.branch_list.iter().map(|b| b.evicted).sum();
    d.set_item("evicted", evicted)?;
    Ok(d)
}

/// What one pack holds before Python turns it into tensors.
struct PackOut {
    tensors: Vec<(String, &'static str, Vec<u8>)>,
    logprobs: Vec<f32>,
    rollout_indices: Vec<u32>,
    groups: Vec<String>,
}

/// The tensors of one pack, as `treeattn pack` writes them.
fn pack_out(b: &Batch, call_base: &[u64]) -> treeattn::Result<PackOut> {
    let tensors = pack_tensors(&b.pack, b.sdcc.as_deref(), call_base)?
        .into_iter()
        .chain(rollout_tensors(&b.fields))
        .chain(loss_field_tensors(&b.loss_fields))
        .filter(|(name, _)| name != "loss_logprobs")
        .map(|(name, t)| (name, dtype_name(t.dtype), t.data))
        .collect();
    // Log-probs per target, NaN where a call logged none (the file
    // writes the tensor only when every target has one).
    let logprobs = b
        .pack
        .loss
        .iter()
        .map(|e| e.logprob.unwrap_or(f32::NAN))
        .collect();
    Ok(PackOut {
        tensors,
        logprobs,
        rollout_indices: b.rollouts.clone(),
        groups: b.fields.groups.clone(),
    })
}

/// Each rollout's first call's index in the whole input.
fn call_base(rollouts: &[Rollout]) -> Vec<u64> {
    let mut base = Vec::with_capacity(rollouts.len());
    let mut calls = 0u64;
    for r in rollouts {
        base.push(calls);
        calls += r.calls().len() as u64;
    }
    base
}

fn all_stats(rollouts: &[Rollout]) -> treeattn::Result<Vec<RolloutStats>> {
    rollouts.iter().map(RolloutStats::of).collect()
}

fn pack_rollouts(
    rollouts: &[Rollout],
    layout: Layout,
    share: bool,
    budget: Option<u64>,
) -> treeattn::Result<(Vec<PackOut>, Vec<RolloutStats>)> {
    if rollouts.is_empty() {
        return Err(Error::Usage("no rollouts to pack".into()));
    }
    let budget = budget.map_or(usize::MAX, |b| usize::try_from(b).unwrap_or(usize::MAX));
    let batches = batch(rollouts, budget, share, layout)?;
    let base = call_base(rollouts);
    let out = batches
        .iter()
        .map(|b| pack_out(b, &base))
        .collect::<treeattn::Result<Vec<_>>>()?;
    Ok((out, all_stats(rollouts)?))
}

/// Rollouts from JSON Lines text (`source = "text"`) or a file path
/// (`source = "file"`), read by the crate.
fn read_rollouts(source: &str, value: &str) -> PyResult<Vec<Rollout>> {
    match source {
        "text" => parse_jsonl(value),
        "file" => read_jsonl_file(std::path::Path::new(value)),
        other => {
            return Err(PyValueError::new_err(format!("source {other:?}")));
        }
    }
    .map_err(to_py)
}

/// One pack as the dict `pack` returns.
fn pack_dict<'py>(
    py: Python<'py>,
    p: &PackOut,
    ids: &[String],
    stats: &[RolloutStats],
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    let tensors = PyDict::new(py);
    for (name, dtype, data) in &p.tensors {
        tensors.set_item(name, (*dtype, PyBytes::new(py, data)))?;
    }
    d.set_item("tensors", tensors)?;
    let lp: Vec<u8> = p.logprobs.iter().flat_map(|x| x.to_le_bytes()).collect();
    d.set_item("loss_logprobs", PyBytes::new(py, &lp))?;
    d.set_item("rollout_indices", p.rollout_indices.clone())?;
    let pack_ids: Vec<&str> = p
        .rollout_indices
        .iter()
        .map(|&r| ids[r as usize].as_str())
        .collect();
    d.set_item("rollout_ids", pack_ids)?;
    d.set_item("groups", p.groups.clone())?;
    let st = PyList::empty(py);
    for &r in &p.rollout_indices {
        st.append(stats_dict(py, &stats[r as usize])?)?;
    }
    d.set_item("stats", st)?;
    Ok(d)
}

/// Packs rollouts given as JSON Lines text (`source = "text"`) or a file
/// path (`source = "file"`), as `treeattn pack` does. Returns a list of
/// dicts: `tensors` (name → (dtype, little-endian bytes)), `loss_logprobs`
/// (float32 bytes, NaN where none), `rollout_indices`, `rollout_ids`, `groups` (GRPO
/// group names, first appearance first), `stats` (one dict per rollout of
/// the pack).
#[pyfunction]
#[pyo3(signature = (source, value, layout="trie", share_prefixes=true, budget=None))]
fn pack<'py>(
    py: Python<'py>,
    source: &str,
    value: &str,
    layout: &str,
    share_prefixes: bool,
    budget: Option<u64>,
) -> PyResult<Bound<'py, PyList>> {
    let layout = layout_of(layout)?;
    if budget == Some(0) {
        return Err(PyValueError::new_err("budget must be positive"));
    }
    let (source, value) = (source.to_string(), value.to_string());
    let (packs, stats, ids) = py.detach(move || {
        guarded(|| {
            let rollouts = read_rollouts(&source, &value)?;
            let (packs, stats) =
                pack_rollouts(&rollouts, layout, share_prefixes, budget).map_err(to_py)?;
            let ids: Vec<String> = rollouts.iter().map(|r| r.id().to_string()).collect();
            Ok((packs, stats, ids))
        })
    })?;
    let list = PyList::empty(py);
    for p in &packs {
        list.append(pack_dict(py, p, &ids, &stats)?)?;
    }
    Ok(list)
}

/// Packs rollouts (JSON Lines text or a file, as [`pack`]) for
/// `world_size` data-parallel ranks (`treeattn::pack::balance`): units
/// (GRPO groups whole with `share_prefixes`) by LPT on `objective`
/// (`"flops"` of `model_cost`'s model, `"tokens"` or `"l2"`) onto
/// `world_size × M` bins of at most `budget` tokens. Returns a dict:
/// `micro_steps` M and `bins` (M · world_size entries, bin `m · world_size
/// + r`: a pack dict as [`pack`] returns, or `None` where nothing went).
#[pyfunction]
#[pyo3(signature = (source, value, world_size, budget, model_cost, share_prefixes=true, layout="trie", objective="flops"))]
#[allow(clippy::too_many_arguments)]
fn balance<'py>(
    py: Python<'py>,
    source: &str,
    value: &str,
    world_size: usize,
    budget: usize,
    model_cost: &Bound<'py, PyModelCost>,
    share_prefixes: bool,
    layout: &str,
    objective: &str,
) -> PyResult<Bound<'py, PyDict>> {
    let layout = layout_of(layout)?;
    let objective = match objective {
        "flops" => Objective::Flops(model_cost.get().0),
        "tokens" => Objective::Tokens,
        "l2" => Objective::TokensSquared,
        other => {
            return Err(PyValueError::new_err(format!(
                "objective {other:?}: expected \"flops\", \"tokens\" or \"l2\""
            )))
        }
    };
    let (source, value) = (source.to_string(), value.to_string());
    let (micro, bins, stats, ids) = py.detach(move || {
        guarded(|| {
            let rollouts = read_rollouts(&source, &value)?;
            let b = balance_packs(
                &rollouts,
                world_size,
                budget,
                share_prefixes,
                layout,
                objective,
            )
            .map_err(to_py)?;
            let base = call_base(&rollouts);
            let bins = b
                .bins
                .iter()
                .map(|x| x.as_ref().map(|x| pack_out(x, &base)).transpose())
                .collect::<treeattn::Result<Vec<_>>>()
                .map_err(to_py)?;
            let stats = all_stats(&rollouts).map_err(to_py)?;
            let ids: Vec<String> = rollouts.iter().map(|r| r.id().to_string()).collect();
            Ok((b.micro_steps, bins, stats, ids))
        })
    })?;
    let list = PyList::empty(py);
    for p in &bins {
        match p {
            Some(p) => list.append(pack_dict(py, p, &ids, &stats)?)?,
            None => list.append(py.None())?,
        }
    }
    let d = PyDict::new(py);
    d.set_item("micro_steps", micro)?;
    d.set_item("bins", list)?;
    Ok(d)
}

/// GAE over a pack's targets (`treeattn::rl::Gae::compute`): `rollout`,
/// `segment`, `values`, `outcome` (the rollout's scalar reward `R`) one per
/// target in generation order; `token` the per-token rewards and
/// `bootstrap` the value after each rollout's last target (per target,
/// `None` for zeros); `lam` a number, or `None` with `alpha` for the
/// adaptive λ; `critic_lam` the returns' λ (`critic_adaptive` for the
/// adaptive one; neither: `lam`'s). Returns `(advantages, returns)` as
/// float64 little-endian bytes.
#[pyfunction]
#[pyo3(signature = (rollout, segment, values, outcome, token, bootstrap, gamma, lam, alpha, critic_lam, critic_adaptive, mode))]
#[allow(clippy::too_many_arguments)]
fn gae<'py>(
    py: Python<'py>,
    rollout: Vec<u32>,
    segment: Vec<u32>,
    values: Vec<f64>,
    outcome: Vec<f64>,
    token: Option<Vec<f64>>,
    bootstrap: Option<Vec<f64>>,
    gamma: f64,
    lam: Option<f64>,
    alpha: f64,
    critic_lam: Option<f64>,
    critic_adaptive: bool,
    mode: &str,
) -> PyResult<(Bound<'py, PyBytes>, Bound<'py, PyBytes>)> {
    let critic_lambda = if critic_adaptive {
        Some(Lambda::Adaptive { alpha })
    } else {
        critic_lam.map(Lambda::Fixed)
    };
    let g = Gae {
        gamma,
        lambda: lam.map_or(Lambda::Adaptive { alpha }, Lambda::Fixed),
        critic_lambda,
        mode: GaeMode::parse(mode).map_err(to_py)?,
    };
    let out = py.detach(|| {
        guarded(|| {
            let t = Targets {
                rollout: &rollout,
                segment: &segment,
            };
            let rewards = Rewards {
                outcome: &outcome,
                token: token.as_deref(),
                bootstrap: bootstrap.as_deref(),
            };
            g.compute(t, &values, rewards).map_err(to_py)
        })
    })?;
    let bytes = |v: &[f64]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    Ok((
        PyBytes::new(py, &bytes(&out.advantages)),
        PyBytes::new(py, &bytes(&out.returns)),
    ))
}

/// CompactionRL's segments (`treeattn::rl::summary_segments`): the
/// junction `segment` of each target, its `call` and whether that call is
/// a summary call; one per target in generation order.
#[pyfunction]
fn summary_segments_of(
    rollout: Vec<u32>,
    segment: Vec<u32>,
    call: Vec<u32>,
    summary: Vec<bool>,
) -> PyResult<Vec<u32>> {
    guarded(|| {
        let t = Targets {
            rollout: &rollout,
            segment: &segment,
        };
        summary_segments(t, &call, &summary).map_err(to_py)
    })
}

/// GRPO advantages per rollout (`treeattn::rl::grpo_advantages`): one
/// reward and group key per rollout; `eps = None` for the unscaled form,
/// `std` "sample", "population" or "batch".
#[pyfunction]
#[pyo3(signature = (rewards, groups, eps, std="sample"))]
fn grpo(rewards: Vec<f64>, groups: Vec<u32>, eps: Option<f64>, std: &str) -> PyResult<Vec<f64>> {
    let std = GrpoStd::parse(std).map_err(to_py)?;
    let scale = eps.map_or(GrpoScale::None, |eps| GrpoScale::Std { eps, std });
    guarded(|| grpo_advantages(&rewards, &groups, scale).map_err(to_py))
}

/// The FLOPs of one training step (forward + backward) of `model`'s
/// decoder on a pack (`treeattn::cost`): `kv_end` as little-endian uint32
/// bytes, `logit_rows` the distinct loss rows. Returns a dict `attention`,
/// `linear`, `total`, `visible_pairs`, `tokens`, `logit_rows`.
#[pyfunction]
fn pack_cost<'py>(
    py: Python<'py>,
    kv_end: &[u8],
    logit_rows: u64,
    model: &Bound<'py, PyModelCost>,
) -> PyResult<Bound<'py, PyDict>> {
    let model = model.get().0;
    if !kv_end.len().is_multiple_of(4) {
        return Err(PyValueError::new_err(
            "kv_end: byte length is not a multiple of 4",
        ));
    }
    let ke: Vec<u32> = kv_end
        .chunks_exact(4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    let pairs = visible_pairs(&ke).map_err(to_py)?;
    let c = model.cost(pairs, ke.len() as u64, logit_rows);
    let d = PyDict::new(py);
    d.set_item("attention", c.attention)?;
    d.set_item("linear", c.linear)?;
    d.set_item("total", c.total)?;
    d.set_item("visible_pairs", c.visible_pairs)?;
    d.set_item("tokens", c.tokens)?;
    d.set_item("logit_rows", c.logit_rows)?;
    Ok(d)
}

const COST_FIELDS: [&str; 7] = [
    "layers",
    "hidden",
    "heads",
    "kv_heads",
    "head_dim",
    "intermediate",
    "vocab",
];

/// One dimension of a `ModelCost`: a positive `int` (not a `bool`).
fn cost_dim(name: &str, v: &Bound<'_, PyAny>) -> PyResult<u64> {
    if v.is_instance_of::<PyInt>() && !v.is_instance_of::<PyBool>() {
        match v.extract::<u64>() {
            Ok(x) if x > 0 => return Ok(x),
            Ok(_) => {}
            Err(_) if v.gt(0)? => {
                return Err(PyValueError::new_err(format!(
                    "ModelCost.{name} must be a positive int below 2**64, got {}",
                    v.repr()?
                )))
            }
            Err(_) => {}
        }
    }
    Err(PyValueError::new_err(format!(
        "ModelCost.{name} must be a positive int, got {}",
        v.repr()?
    )))
}

/// The shape of a decoder as far as its FLOPs go (the crate's
/// ``treeattn::cost::ModelCost``): ``layers`` N, ``hidden`` H, ``heads`` h,
/// ``kv_heads`` g, ``head_dim`` d, ``intermediate`` I (gated MLP), ``vocab`` V.
///
/// FLOPs of one training step (forward + backward; a multiply-add is 2):
///
/// - attention = visible pairs · N · h · 4d · 3.5 (backward 2.5× forward,
///   DESIGN §7), visible pairs = Σ_k (kv_end[k] − k);
/// - linear = 3 · (tokens · N · 2 · (2·H·h·d + 2·H·g·d + 3·H·I)
///   + logit rows · 2·H·V) (q/o, k/v projections, gate/up/down; the lm_head
///   at the distinct loss rows only; backward 2× forward);
/// - total = attention + linear.
///
/// Immutable, compared and hashed by its fields. Every dimension must be a
/// positive ``int`` and ``kv_heads`` divide ``heads`` (``ValueError``).
#[pyclass(name = "ModelCost", module = "treeattn", frozen, eq, hash)]
#[derive(Clone, PartialEq)]
struct PyModelCost(ModelCost);

impl std::hash::Hash for PyModelCost {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        self.fields().hash(h)
    }
}

impl PyModelCost {
    fn fields(&self) -> [u64; 7] {
        let m = &self.0;
        [
            m.layers,
            m.hidden,
            m.heads,
            m.kv_heads,
            m.head_dim,
            m.intermediate,
            m.vocab,
        ]
    }
}

#[pymethods]
impl PyModelCost {
    #[new]
    #[pyo3(signature = (layers, hidden, heads, kv_heads, head_dim, intermediate, vocab))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        layers: &Bound<'_, PyAny>,
        hidden: &Bound<'_, PyAny>,
        heads: &Bound<'_, PyAny>,
        kv_heads: &Bound<'_, PyAny>,
        head_dim: &Bound<'_, PyAny>,
        intermediate: &Bound<'_, PyAny>,
        vocab: &Bound<'_, PyAny>,
    ) -> PyResult<Self> {
        let m = ModelCost {
            layers: cost_dim("layers", layers)?,
            hidden: cost_dim("hidden", hidden)?,
            heads: cost_dim("heads", heads)?,
            kv_heads: cost_dim("kv_heads", kv_heads)?,
            head_dim: cost_dim("head_dim", head_dim)?,
            intermediate: cost_dim("intermediate", intermediate)?,
            vocab: cost_dim("vocab", vocab)?,
        };
        // The crate's message alone, as the Python class said it.
        m.validate().map_err(|e| match e {
            Error::Usage(msg) => TreeattnError::new_err(msg),
            e => to_py(e),
        })?;
        Ok(PyModelCost(m))
    }

    /// From a Hugging Face config (``LlamaConfig``, ``Qwen2Config``, … or
    /// a multimodal config with a text config): ``num_hidden_layers``,
    /// ``hidden_size``, ``num_attention_heads``, ``num_key_value_heads``
    /// (default: the heads), ``head_dim`` (default: hidden / heads),
    /// ``intermediate_size``, ``vocab_size``.
    #[classmethod]
    fn from_config<'py>(
        cls: &Bound<'py, PyType>,
        config: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = cls.py();
        let mut config = config.clone();
        if config.hasattr("get_text_config")? {
            config = config.call_method0("get_text_config")?;
        }
        // getattr(config, name, None)
        let get = |name: &str| -> PyResult<Option<Bound<'py, PyAny>>> {
            match config.getattr(name) {
                Ok(v) if v.is_none() => Ok(None),
                Ok(v) => Ok(Some(v)),
                Err(e) if e.is_instance_of::<pyo3::exceptions::PyAttributeError>(py) => Ok(None),
                Err(e) => Err(e),
            }
        };
        let required = [
            "num_hidden_layers",
            "hidden_size",
            "num_attention_heads",
            "intermediate_size",
            "vocab_size",
        ];
        let mut missing = Vec::new();
        for n in required {
            if get(n)?.is_none() {
                missing.push(n);
            }
        }
        if !missing.is_empty() {
            return Err(PyValueError::new_err(format!(
                "ModelCost.from_config: the config has no {}",
                missing.join(", ")
            )));
        }
        let int = py.get_type::<PyInt>();
        let as_int = |v: Bound<'py, PyAny>| int.call1((v,));
        let need = |n: &str| get(n).map(|v| v.expect("checked above"));
        let heads = as_int(need("num_attention_heads")?)?;
        let kv = match get("num_key_value_heads")? {
            Some(v) if v.is_truthy()? => v,
            _ => heads.clone(),
        };
        let head_dim = match get("head_dim")? {
            Some(v) if v.is_truthy()? => v,
            _ => as_int(need("hidden_size")?)?.floor_div(&heads)?,
        };
        let kwargs = PyDict::new(py);
        kwargs.set_item("layers", as_int(need("num_hidden_layers")?)?)?;
        kwargs.set_item("hidden", as_int(need("hidden_size")?)?)?;
        kwargs.set_item("heads", &heads)?;
        kwargs.set_item("kv_heads", as_int(kv)?)?;
        kwargs.set_item("head_dim", as_int(head_dim)?)?;
        kwargs.set_item("intermediate", as_int(need("intermediate_size")?)?)?;
        kwargs.set_item("vocab", as_int(need("vocab_size")?)?)?;
        cls.call((), Some(&kwargs))
    }

    /// Llama-3-8B's shape, the default weighting of :mod:`treeattn.distributed`.
    #[classmethod]
    fn llama3_8b(_cls: &Bound<'_, PyType>) -> Self {
        PyModelCost(ModelCost::LLAMA3_8B)
    }

    #[getter]
    fn layers(&self) -> u64 {
        self.0.layers
    }
    #[getter]
    fn hidden(&self) -> u64 {
        self.0.hidden
    }
    #[getter]
    fn heads(&self) -> u64 {
        self.0.heads
    }
    #[getter]
    fn kv_heads(&self) -> u64 {
        self.0.kv_heads
    }
    #[getter]
    fn head_dim(&self) -> u64 {
        self.0.head_dim
    }
    #[getter]
    fn intermediate(&self) -> u64 {
        self.0.intermediate
    }
    #[getter]
    fn vocab(&self) -> u64 {
        self.0.vocab
    }

    /// Forward + backward FLOPs of one visible (query, key) pair: N·h·4d·3.5.
    fn attention_per_pair(&self) -> f64 {
        self.0.attention_per_pair()
    }

    /// Forward + backward FLOPs of projections + MLP per token:
    /// 3 · N · 2 · (2·H·h·d + 2·H·g·d + 3·H·I).
    fn linear_per_token(&self) -> f64 {
        self.0.linear_per_token()
    }

    /// Forward + backward FLOPs of the lm_head at one row: 3 · 2·H·V.
    fn logits_per_row(&self) -> f64 {
        self.0.logits_per_row()
    }

    fn __repr__(&self) -> String {
        let parts: Vec<String> = COST_FIELDS
            .iter()
            .zip(self.fields())
            .map(|(n, v)| format!("{n}={v}"))
            .collect();
        format!("ModelCost({})", parts.join(", "))
    }

    fn __reduce__<'py>(
        slf: &Bound<'py, Self>,
    ) -> PyResult<(Bound<'py, PyType>, Bound<'py, PyTuple>)> {
        let f = slf.get().fields();
        Ok((slf.get_type(), PyTuple::new(slf.py(), f)?))
    }
}

/// Which per-row count of a `kv_end` [`per_row`] computes.
#[derive(Clone, Copy)]
enum PerRow {
    Depths,
    VisibleKeys,
}

/// Reads the int64 `kv_end` at `kv_end` (`tokens` values), checks `k <=
/// kv_end[k] <= L`, and writes the count of each row to the int64 buffer
/// at `out`.
///
/// Safety: the wrapper passes live contiguous int64 CPU tensors of
/// `tokens` elements; it does not touch them meanwhile.
fn per_row(py: Python<'_>, kv_end: usize, tokens: usize, out: usize, what: PerRow) -> PyResult<()> {
    let kv: &[i64] = unsafe { slice("kv_end", kv_end, tokens)? };
    let out: &mut [i64] = unsafe { slice_mut("out", out, tokens)? };
    py.detach(|| {
        guarded(|| {
            let mut ke = Vec::with_capacity(kv.len());
            for (k, &e) in kv.iter().enumerate() {
                ke.push(u32::try_from(e).map_err(|_| {
                    PackError::new_err(format!(
                        "kv_end[{k}] = {e} breaks {k} <= kv_end[k] <= L = {}",
                        kv.len()
                    ))
                })?);
            }
            check_kv_end(&ke).map_err(to_py)?;
            let counts = match what {
                PerRow::Depths => depths(&ke),
                PerRow::VisibleKeys => visible_keys_per_query(&ke),
            };
            for (o, c) in out.iter_mut().zip(counts) {
                *o = c as i64;
            }
            Ok(())
        })
    })
}

/// Each row's depth in the tree of `kv_end` (`treeattn::cost::depths`):
/// `kv_end` and `out` are addresses of contiguous int64 CPU tensors of
/// `tokens` elements; a `kv_end` outside `k <= kv_end[k] <= L` is a
/// `PackError` naming the key.
#[pyfunction]
fn tree_depths(py: Python<'_>, kv_end: usize, tokens: usize, out: usize) -> PyResult<()> {
    per_row(py, kv_end, tokens, out, PerRow::Depths)
}

/// Each query's visible keys (`treeattn::cost::visible_keys_per_query`),
/// as [`tree_depths`] takes and writes them.
#[pyfunction]
#[pyo3(name = "visible_keys_per_query")]
fn visible_keys(py: Python<'_>, kv_end: usize, tokens: usize, out: usize) -> PyResult<()> {
    per_row(py, kv_end, tokens, out, PerRow::VisibleKeys)
}

/// The path structure of a pack (`treeattn::paths::Paths`): `kv_end` as
/// int64 little-endian bytes; returns a dict of int64 little-endian bytes
/// (`parent`, `row_node`, `node_start`, `node_end`, `node_parent`,
/// `node_level`, `level_offsets`, `level_nodes`).
#[pyfunction]
fn paths<'py>(py: Python<'py>, kv_end: &[u8]) -> PyResult<Bound<'py, PyDict>> {
    if !kv_end.len().is_multiple_of(8) {
        return Err(PyValueError::new_err(format!(
            "kv_end: {} bytes is not a whole number of int64 values",
            kv_end.len()
        )));
    }
    let mut ends = Vec::with_capacity(kv_end.len() / 8);
    for (k, b) in kv_end.chunks_exact(8).enumerate() {
        let v = i64::from_le_bytes(b.try_into().expect("8 bytes"));
        let v = u32::try_from(v).map_err(|_| {
            PyValueError::new_err(format!(
                "kv_end[{k}] = {v} is outside 0..=u32::MAX (a key's range end is a row index)"
            ))
        })?;
        ends.push(v);
    }
    let p = py.detach(|| guarded(|| Paths::from_kv_end(&ends).map_err(to_py)))?;
    let d = PyDict::new(py);
    let put = |name: &str, v: &mut dyn Iterator<Item = i64>| -> PyResult<()> {
        let bytes: Vec<u8> = v.flat_map(|x| x.to_le_bytes()).collect();
        d.set_item(name, PyBytes::new(py, &bytes))
    };
    put("parent", &mut p.parent.iter().copied())?;
    put("row_node", &mut p.row_node.iter().map(|&x| x as i64))?;
    put("node_start", &mut p.node_start.iter().map(|&x| x as i64))?;
    put("node_end", &mut p.node_end.iter().map(|&x| x as i64))?;
    put("node_parent", &mut p.node_parent.iter().copied())?;
    put("node_level", &mut p.node_level.iter().map(|&x| x as i64))?;
    put(
        "level_offsets",
        &mut p.level_offsets.iter().map(|&x| x as i64),
    )?;
    put("level_nodes", &mut p.level_nodes.iter().map(|&x| x as i64))?;
    Ok(d)
}

/// The `kv_end` of a pre-order layout whose position ids are depths
/// (`treeattn::mask::kv_end_from_positions`): `position_ids` as int64
/// little-endian bytes in, `kv_end` as int64 little-endian bytes out.
/// A position outside `0..=u32::MAX` is a `ValueError`, a layout that is
/// no pre-order (a first row not at 0, a rise by more than 1) a
/// `PackError`, each naming the row.
#[pyfunction]
fn kv_end_from_positions<'py>(
    py: Python<'py>,
    position_ids: &[u8],
) -> PyResult<Bound<'py, PyBytes>> {
    if !position_ids.len().is_multiple_of(8) {
        return Err(PyValueError::new_err(format!(
            "position_ids: {} bytes is not a whole number of int64 values",
            position_ids.len()
        )));
    }
    let mut pos = Vec::with_capacity(position_ids.len() / 8);
    for (j, b) in position_ids.chunks_exact(8).enumerate() {
        let v = i64::from_le_bytes(b.try_into().expect("8 bytes"));
        let v = u32::try_from(v).map_err(|_| {
            PyValueError::new_err(format!(
                "position_ids[{j}] = {v} is outside 0..=u32::MAX (a position id is a depth)"
            ))
        })?;
        pos.push(v);
    }
    let out = py.detach(|| {
        guarded(|| {
            let kv = treeattn::mask::kv_end_from_positions(&pos).map_err(to_py)?;
            Ok(kv
                .iter()
                .flat_map(|&x| (x as i64).to_le_bytes())
                .collect::<Vec<u8>>())
        })
    })?;
    Ok(PyBytes::new(py, &out))
}

/// The first visible key of each query row under a sliding window of
/// `window` tree levels (`treeattn::mask::PackMask::window_starts`) for
/// `kv_end` at address `kv_end` (`tokens` int32 values read as u32,
/// contiguous, CPU), as int32 little-endian bytes.
#[pyfunction]
fn window_starts<'py>(
    py: Python<'py>,
    kv_end: usize,
    tokens: usize,
    window: u32,
) -> PyResult<Bound<'py, PyBytes>> {
    // Safety: the wrapper passes a live contiguous int32 CPU tensor of
    // `tokens` elements that it does not write meanwhile.
    let kv: &[u32] = unsafe { slice("kv_end", kv_end, tokens)? };
    let out = py.detach(|| {
        guarded(|| {
            let pos = vec![0u32; kv.len()];
            let mask = PackMask::new(kv, &pos).map_err(to_py)?;
            let starts = mask.window_starts(window).map_err(to_py)?;
            Ok(starts
                .iter()
                .flat_map(|x| x.to_le_bytes())
                .collect::<Vec<u8>>())
        })
    })?;
    Ok(PyBytes::new(py, &out))
}

/// FlexAttention's block view of a tree mask (`treeattn::mask::BlockCensus`)
/// for `kv_end` at address `kv_end` (`tokens` int32 values read as u32,
/// contiguous, CPU) and square blocks of `block`. Returns, as int32
/// little-endian bytes, `(kv_num [n], kv_indices [n, n], full_num [n],
/// full_indices [n, n])` with `n = ceil(tokens / block)`; each row's indices
/// ascending, then zeros.
#[pyfunction]
#[pyo3(signature = (kv_end, tokens, block, window=None))]
fn block_census<'py>(
    py: Python<'py>,
    kv_end: usize,
    tokens: usize,
    block: usize,
    window: Option<u32>,
) -> PyResult<Vec<Bound<'py, PyBytes>>> {
    // Safety: the wrapper passes a live contiguous int32 CPU tensor of
    // `tokens` elements that it does not write meanwhile.
    let kv: &[u32] = unsafe { slice("kv_end", kv_end, tokens)? };
    let out = py.detach(|| {
        guarded(|| {
            let pos = vec![0u32; kv.len()];
            let mask = PackMask::new(kv, &pos).map_err(to_py)?;
            let c = BlockCensus::windowed(&mask, block, window).map_err(to_py)?;
            let n = c.blocks();
            let table = |lists: &[Vec<u32>]| {
                let mut num = Vec::with_capacity(n * 4);
                let mut idx = vec![0u8; n * n * 4];
                for (i, l) in lists.iter().enumerate() {
                    num.extend_from_slice(&(l.len() as i32).to_le_bytes());
                    for (j, &b) in l.iter().enumerate() {
                        idx[(i * n + j) * 4..(i * n + j + 1) * 4]
                            .copy_from_slice(&(b as i32).to_le_bytes());
                    }
                }
                (num, idx)
            };
            let (pn, pi) = table(&c.partial);
            let (fnum, fi) = table(&c.full);
            Ok(vec![pn, pi, fnum, fi])
        })
    })?;
    Ok(out.iter().map(|b| PyBytes::new(py, b)).collect())
}

/// The native half of the `treeattn` Python package.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(attention_forward, m)?)?;
    m.add_function(wrap_pyfunction!(window_starts, m)?)?;
    m.add_function(wrap_pyfunction!(attention_backward, m)?)?;
    m.add_function(wrap_pyfunction!(sdcc_forward_kl, m)?)?;
    m.add_function(wrap_pyfunction!(pack, m)?)?;
    m.add_function(wrap_pyfunction!(gae, m)?)?;
    m.add_function(wrap_pyfunction!(block_census, m)?)?;
    m.add_function(wrap_pyfunction!(grpo, m)?)?;
    m.add_function(wrap_pyfunction!(summary_segments_of, m)?)?;
    m.add_function(wrap_pyfunction!(pack_cost, m)?)?;
    m.add_function(wrap_pyfunction!(balance, m)?)?;
    m.add_function(wrap_pyfunction!(tree_depths, m)?)?;
    m.add_function(wrap_pyfunction!(visible_keys, m)?)?;
    m.add_class::<PyModelCost>()?;
    // The pack schema (`treeattn::safetensors::PACK_SCHEMA`): (name, dtype, axis).
    let schema: Vec<(&str, &str, &str)> = PACK_SCHEMA
        .iter()
        .map(|t| (t.name, dtype_name(t.dtype), t.axis.name()))
        .collect();
    m.add("PACK_SCHEMA", PyTuple::new(m.py(), schema)?)?;
    m.add_function(wrap_pyfunction!(paths, m)?)?;
    m.add_function(wrap_pyfunction!(kv_end_from_positions, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_built, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_isa, m)?)?;
    m.add_class::<PyMaskPlan>()?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    let py = m.py();
    m.add("TreeattnError", py.get_type::<TreeattnError>())?;
    m.add("RolloutError", py.get_type::<RolloutError>())?;
    m.add("PackError", py.get_type::<PackError>())?;
    m.add("ShapeError", py.get_type::<ShapeError>())?;
    m.add("UnsupportedError", py.get_type::<UnsupportedError>())?;
    Ok(())
}
