//! The raw-memory layer under the foreign bindings: the PyO3 extension
//! (`python/src/lib.rs`) and the C ABI (`capi/`) both call these entries,
//! so that raw-pointer checks, dtype dispatch, the mask plan and the SDCC
//! pair formats are written once. Each binding only turns its own
//! arguments (Python ints and strings, C structs and status codes) into a
//! [`RawAttention`] / [`RawSdcc`] and maps [`Error`] to its own errors.
//!
//! An address is a plain `usize` (`tensor.data_ptr()`, a C pointer, a
//! `CUdeviceptr`); the number of elements behind it is derived from the
//! call's [`AttnShape`] (or rows × vocab), never given separately, so a
//! binding cannot pass a length that disagrees with the shape. Every
//! address is checked before it is read:
//! - null with a non-zero length is [`Error::Null`] naming the buffer
//!   (an empty buffer may be null and is never read);
//! - misaligned for its element type, or a length whose byte size
//!   overflows the address space, is [`Error::Shape`];
//! - on the host, an output overlapping another output or an input is
//!   [`Error::Shape`] (the outputs are written while the inputs are read).
//!
//! The element type is a [`Dtype`] argument; each entry takes the types
//! listed in its `*_DTYPES` constant and answers [`Error::Unsupported`],
//! naming the dtype and the ones it takes, for the others. The mask is a
//! [`RawMask`]: the pack's `kv_end` / position-id arrays (validated per
//! call) or a [`MaskPlan`] validated once (checked against the call's token
//! count; on CUDA its device copy is reused).
//!
//! Host entries compute on the [`Cpu`] backend given; the `cuda_*` entries
//! (feature `cuda`) enqueue on a stream the caller owns, through
//! [`crate::backend::cuda::host`]. Both then run the one contract
//! ([`AttnArgs`], [`SdccArgs`]), so every check after these is the
//! contract's.

use std::fmt;

use crate::backend::cpu::{Cpu, CpuElement, CpuFloat};
use crate::backend::{
    AttentionBackend, AttnArgs, AttnParams, AttnShape, Grads, Host, Saved, SdccArgs, SdccBackend,
    SdccLoss,
};
use crate::mask::PackMask;
use crate::plan::MaskPlan;
use crate::{Error, Result};

/// The element type of a raw call's tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dtype {
    /// IEEE binary32.
    F32,
    /// IEEE binary64.
    F64,
    /// bfloat16 (16 bits).
    Bf16,
    /// IEEE binary16.
    F16,
}

impl Dtype {
    /// The dtype's name as PyTorch, NumPy and JAX spell it: `"float32"`,
    /// `"float64"`, `"bfloat16"`, `"float16"`.
    pub fn name(self) -> &'static str {
        match self {
            Dtype::F32 => "float32",
            Dtype::F64 => "float64",
            Dtype::Bf16 => "bfloat16",
            Dtype::F16 => "float16",
        }
    }

    /// The dtype named `name` (as [`Dtype::name`] spells it);
    /// [`Error::Unsupported`] for any other name.
    pub fn from_name(name: &str) -> Result<Dtype> {
        [Dtype::F32, Dtype::F64, Dtype::Bf16, Dtype::F16]
            .into_iter()
            .find(|d| d.name() == name)
            .ok_or_else(|| {
                Error::Unsupported(format!(
                    "dtype {name:?}: treeattn takes float32, float64, bfloat16 or float16"
                ))
            })
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What [`attention_forward`] and [`attention_backward`] take: the CPU
/// backend's compute types, and bf16 / f16 computed in f32 (each result
/// rounded once; the LSE is then f32).
pub const HOST_ATTENTION_DTYPES: &[Dtype] = &[Dtype::F32, Dtype::F64, Dtype::Bf16, Dtype::F16];
/// What [`sdcc_forward_kl`] takes (logits and gradient of that type).
pub const HOST_SDCC_DTYPES: &[Dtype] = &[Dtype::F32, Dtype::F64];
/// What `cuda_attention_forward` / `cuda_attention_backward` take (the
/// kernels' element types; the LSE is f32).
pub const CUDA_ATTENTION_DTYPES: &[Dtype] = &[Dtype::Bf16, Dtype::F16];
/// What `cuda_sdcc_forward_kl` takes for the logits (the gradient is f32).
pub const CUDA_SDCC_DTYPES: &[Dtype] = &[Dtype::Bf16, Dtype::F16, Dtype::F32];

/// `Err(Error::Unsupported)` naming `dtype` and `takes` unless `dtype` is
/// one of `takes` (the dtypes of the entry `what`, one of the `*_DTYPES`
/// constants). The entries call it first; a binding built without an
/// entry's backend calls it too, so that its errors come in the same order.
pub fn check_dtype(what: &str, dtype: Dtype, takes: &[Dtype]) -> Result<()> {
    if takes.contains(&dtype) {
        return Ok(());
    }
    let names: Vec<&str> = takes.iter().map(|d| d.name()).collect();
    Err(Error::Unsupported(format!(
        "{what}: dtype {dtype} is not supported; it takes {}",
        names.join(", ")
    )))
}

/// The mask of a raw attention call.
#[derive(Clone, Copy, Debug)]
pub enum RawMask<'a> {
    /// The pack's arrays, `tokens` u32 each (host memory): validated by
    /// [`PackMask::new`] on every call (and uploaded by a CUDA call).
    Arrays {
        /// Address of `kv_end`.
        kv_end: usize,
        /// Address of the position ids.
        position_ids: usize,
    },
    /// A plan validated once ([`MaskPlan`]); it must be of the call's
    /// token count ([`Error::Shape`] otherwise).
    Plan(&'a MaskPlan),
}

/// One attention call on raw memory: q `[tokens, q_heads, head_dim]`, k
/// `[tokens, kv_heads, head_dim]`, v `[tokens, kv_heads, v_head_dim]`,
/// contiguous, of element type `dtype`, in the memory of the entry (host
/// for [`attention_forward`], device for `cuda_attention_forward`).
#[derive(Clone, Copy, Debug)]
pub struct RawAttention<'a> {
    /// Element type of q, k, v, o, dO, dQ, dK, dV and the sinks.
    pub dtype: Dtype,
    /// Address of q.
    pub q: usize,
    /// Address of k.
    pub k: usize,
    /// Address of v.
    pub v: usize,
    /// The pack's mask.
    pub mask: RawMask<'a>,
    /// Attention sinks, `[q_heads]` of `dtype` in the entry's memory; 0
    /// for none ([`AttnArgs::with_sinks`]).
    pub sinks: usize,
    /// Explicit first visible key per query row, `[tokens]` u32 on the
    /// host ([`AttnArgs::with_key_starts`]); 0 for none.
    pub key_starts: usize,
    /// Sizes (validated here before any length is derived).
    pub shape: AttnShape,
    /// Scale, rotary, window, softcap, finiteness scan.
    pub params: AttnParams,
}

/// What a backward call adds to its [`RawAttention`]: the forward's `o`
/// (like q, `v_head_dim` wide) and `lse` (`[q_heads, tokens]`, f64 for f64
/// calls, f32 otherwise), the output gradient `d_o` (like o), and the
/// gradients it writes: `dq` (like q), `dk` (like k), `dv` (like v) and,
/// with sinks, `dsinks` (`[q_heads]`; 0: not asked for).
#[derive(Clone, Copy, Debug)]
pub struct RawGrads {
    /// Address of the forward's output.
    pub o: usize,
    /// Address of the forward's log-sum-exp.
    pub lse: usize,
    /// Address of the output gradient.
    pub d_o: usize,
    /// Address dQ is written to.
    pub dq: usize,
    /// Address dK is written to.
    pub dk: usize,
    /// Address dV is written to.
    pub dv: usize,
    /// Address the sinks' gradient is written to; 0 for none.
    pub dsinks: usize,
}

/// The (student row, teacher row) pairs of an SDCC call, host memory, in
/// the two layouts the bindings receive.
#[derive(Clone, Copy, Debug)]
pub enum RawPairs {
    /// `2 · n_pairs` u32: student row, teacher row, student row, … (C).
    Interleaved(usize),
    /// Two columns of `n_pairs` i64 each (PyTorch's index tensors).
    Columns {
        /// Address of the student rows.
        student: usize,
        /// Address of the teacher rows.
        teacher: usize,
    },
}

/// One SDCC forward-KL call on raw memory: student logits `[student_rows,
/// vocab]` and teacher logits `[teacher_rows, vocab]` of `dtype` (they may
/// be the same buffer) in the entry's memory; `n_pairs` pairs and weights
/// (f32) on the host.
#[derive(Clone, Copy, Debug)]
pub struct RawSdcc {
    /// Element type of the logits.
    pub dtype: Dtype,
    /// Address of the student logits.
    pub student: usize,
    /// Rows of the student logits.
    pub student_rows: usize,
    /// Address of the teacher logits.
    pub teacher: usize,
    /// Rows of the teacher logits.
    pub teacher_rows: usize,
    /// Columns of both.
    pub vocab: usize,
    /// The pairs.
    pub pairs: RawPairs,
    /// Number of pairs.
    pub n_pairs: usize,
    /// Address of the weights, one f32 per pair.
    pub weights: usize,
    /// Softmax temperature `τ > 0`.
    pub temperature: f32,
}

/// The byte range of a named buffer, for the overlap check.
#[derive(Clone, Copy)]
struct Region {
    what: &'static str,
    start: usize,
    end: usize,
}

fn region<T>(what: &'static str, s: &[T]) -> Region {
    let start = s.as_ptr() as usize;
    Region {
        what,
        start,
        end: start + std::mem::size_of_val(s),
    }
}

/// `Err` naming `what` unless `len` elements of `T` at `addr` can be
/// addressed: non-null unless empty, aligned, no overflow.
fn check_addr<T>(what: &str, addr: usize, len: usize) -> Result<()> {
    if len == 0 {
        return Ok(());
    }
    if addr == 0 {
        return Err(Error::Null(format!("`{what}` ({len} elements)")));
    }
    let align = std::mem::align_of::<T>();
    if !addr.is_multiple_of(align) {
        return Err(Error::Shape(format!(
            "`{what}` = {addr:#x} is not aligned to {align} bytes"
        )));
    }
    match len.checked_mul(std::mem::size_of::<T>()) {
        Some(bytes) if bytes <= isize::MAX as usize && addr.checked_add(bytes).is_some() => Ok(()),
        _ => Err(Error::Shape(format!(
            "`{what}`: {len} elements overflow the address space"
        ))),
    }
}

/// `len` elements of `T` at host address `addr`, checked: null with
/// `len > 0` is [`Error::Null`] naming `what`; misaligned or overflowing
/// the address space, [`Error::Shape`]; empty, never read (it may be null).
///
/// # Safety
/// A nonzero `addr` is live host memory of at least `len` elements
/// of `T`, not written while the slice lives.
pub unsafe fn host_slice<'a, T>(what: &str, addr: usize, len: usize) -> Result<&'a [T]> {
    check_addr::<T>(what, addr, len)?;
    if len == 0 {
        return Ok(&[]);
    }
    // SAFETY: as the caller promises; non-null, aligned, in range.
    Ok(unsafe { std::slice::from_raw_parts(addr as *const T, len) })
}

/// As [`host_slice`], writable.
///
/// # Safety
/// As [`host_slice`]; also, nothing else reads or writes that memory while
/// the slice lives.
pub unsafe fn host_slice_mut<'a, T>(what: &str, addr: usize, len: usize) -> Result<&'a mut [T]> {
    check_addr::<T>(what, addr, len)?;
    if len == 0 {
        return Ok(&mut []);
    }
    // SAFETY: as the caller promises; non-null, aligned, in range.
    Ok(unsafe { std::slice::from_raw_parts_mut(addr as *mut T, len) })
}

/// `Err(Error::Shape)` naming both when the host slice `output` overlaps
/// `input` (an output written while an input is read).
pub fn check_no_overlap<A, B>(
    output: (&'static str, &[A]),
    input: (&'static str, &[B]),
) -> Result<()> {
    no_overlap(&[region(output.0, output.1)], &[region(input.0, input.1)])
}

/// `Err(Error::Shape)` when an output overlaps another output or an input.
fn no_overlap(outputs: &[Region], inputs: &[Region]) -> Result<()> {
    for (i, a) in outputs.iter().enumerate() {
        for b in outputs[i + 1..].iter().chain(inputs) {
            if a.start < a.end && b.start < b.end && a.start < b.end && b.start < a.end {
                return Err(Error::Shape(format!(
                    "output `{}` overlaps `{}`",
                    a.what, b.what
                )));
            }
        }
    }
    Ok(())
}

impl<'a> RawMask<'a> {
    /// The mask of a call of `tokens` tokens: the plan's (its size checked)
    /// or the host arrays' (validated).
    ///
    /// Safety: for arrays, both addresses as [`host_slice`] for `tokens` u32.
    unsafe fn host_mask(&self, tokens: usize) -> Result<PackMask<'a>> {
        match *self {
            RawMask::Plan(plan) => Ok(Self::plan_of(plan, tokens)?.mask()),
            RawMask::Arrays {
                kv_end,
                position_ids,
            } => {
                // SAFETY: as the caller promises.
                let (kv_end, pos) = unsafe {
                    (
                        host_slice::<u32>("kv_end", kv_end, tokens)?,
                        host_slice::<u32>("position_ids", position_ids, tokens)?,
                    )
                };
                PackMask::new(kv_end, pos)
            }
        }
    }

    fn plan_of(plan: &MaskPlan, tokens: usize) -> Result<&MaskPlan> {
        if plan.len() != tokens {
            return Err(Error::Shape(format!(
                "the mask plan is for {} tokens, the call has {tokens}",
                plan.len()
            )));
        }
        Ok(plan)
    }

    /// The host arrays' byte ranges (none for a plan: it is not the
    /// caller's memory).
    fn regions(&self, tokens: usize) -> Vec<Region> {
        match *self {
            RawMask::Plan(_) => vec![],
            RawMask::Arrays {
                kv_end,
                position_ids,
            } => {
                let bytes = tokens * 4;
                vec![
                    Region {
                        what: "kv_end",
                        start: kv_end,
                        end: kv_end + bytes,
                    },
                    Region {
                        what: "position_ids",
                        start: position_ids,
                        end: position_ids + bytes,
                    },
                ]
            }
        }
    }
}

/// A host call's validated inputs.
struct HostInputs<'a, T: CpuElement> {
    args: AttnArgs<'a, Host, T>,
    regions: Vec<Region>,
}

impl<'a> RawAttention<'a> {
    /// The contract's arguments on host memory, with the inputs' byte
    /// ranges.
    ///
    /// Safety: every address as [`host_slice`], for the sizes `self.shape` says.
    unsafe fn host_inputs<T: CpuElement>(&self) -> Result<HostInputs<'a, T>> {
        let s = self.shape;
        // Validated (sizes > 0, no overflow) before any length is used.
        s.validate()?;
        // SAFETY: as the caller promises.
        let (q, k, v, mask) = unsafe {
            (
                host_slice::<T>("q", self.q, s.q_len())?,
                host_slice::<T>("k", self.k, s.kv_len())?,
                host_slice::<T>("v", self.v, s.v_len())?,
                self.mask.host_mask(s.tokens)?,
            )
        };
        let mut regions = vec![region("q", q), region("k", k), region("v", v)];
        // The arrays are read (and checked) above, so their ranges are
        // within the address space.
        regions.extend(self.mask.regions(s.tokens));
        let mut args = AttnArgs::new(q, k, v, s, mask, self.params)?;
        if self.sinks != 0 {
            // SAFETY: as the caller promises.
            let sinks = unsafe { host_slice::<T>("sinks", self.sinks, s.q_heads)? };
            regions.push(region("sinks", sinks));
            args = args.with_sinks(sinks)?;
        }
        if self.key_starts != 0 {
            // SAFETY: as the caller promises.
            let starts = unsafe { host_slice::<u32>("key_starts", self.key_starts, s.tokens)? };
            regions.push(region("key_starts", starts));
            args = args.with_key_starts(starts)?;
        }
        Ok(HostInputs { args, regions })
    }
}

/// Tree attention forward on host memory, on `cpu`: writes `o` (`[tokens,
/// q_heads, v_head_dim]` of `a.dtype`) and `lse` (`[q_heads, tokens]`,
/// natural log; f64 for f64 calls, f32 otherwise), as
/// [`AttentionBackend::forward`]. Takes [`HOST_ATTENTION_DTYPES`].
///
/// # Safety
/// Every nonzero address of `a`, `o` and `lse` is live host memory of at
/// least the elements the shape says, of the types above; the inputs are
/// not written during the call. Overlaps between `o`, `lse` and the inputs
/// are checked ([`Error::Shape`]).
pub unsafe fn attention_forward(
    cpu: &Cpu,
    a: &RawAttention<'_>,
    o: usize,
    lse: usize,
) -> Result<()> {
    check_dtype("host attention", a.dtype, HOST_ATTENTION_DTYPES)?;
    // SAFETY (each arm): as the caller promises.
    unsafe {
        match a.dtype {
            Dtype::F32 => host_forward::<f32>(cpu, a, o, lse),
            Dtype::F64 => host_forward::<f64>(cpu, a, o, lse),
            Dtype::Bf16 => host_forward::<half::bf16>(cpu, a, o, lse),
            Dtype::F16 => host_forward::<half::f16>(cpu, a, o, lse),
        }
    }
}

unsafe fn host_forward<T: CpuElement>(
    cpu: &Cpu,
    a: &RawAttention<'_>,
    o: usize,
    lse: usize,
) -> Result<()> {
    // SAFETY: as the caller of `attention_forward` promises.
    unsafe {
        let inputs = a.host_inputs::<T>()?;
        let s = a.shape;
        let o = host_slice_mut::<T>("o", o, s.o_len())?;
        let lse = host_slice_mut::<T::Compute>("lse", lse, s.lse_len())?;
        no_overlap(&[region("o", o), region("lse", lse)], &inputs.regions)?;
        cpu.forward(&inputs.args, o, lse)
    }
}

/// Tree attention backward on host memory, on `cpu`: from the forward's
/// inputs `a` (same shape, mask and params) and `g`'s `o`, `lse` and
/// `d_o`, writes `g`'s `dq`, `dk`, `dv` (with respect to the unrotated q
/// and k) and, when nonzero, `dsinks`, as [`AttentionBackend::backward`].
/// Takes [`HOST_ATTENTION_DTYPES`].
///
/// # Safety
/// As [`attention_forward`], for every address of `g` too (`lse` of the
/// forward's LSE type); overlaps of the gradients with each other and the
/// inputs are checked.
pub unsafe fn attention_backward(cpu: &Cpu, a: &RawAttention<'_>, g: &RawGrads) -> Result<()> {
    check_dtype("host attention", a.dtype, HOST_ATTENTION_DTYPES)?;
    // SAFETY (each arm): as the caller promises.
    unsafe {
        match a.dtype {
            Dtype::F32 => host_backward::<f32>(cpu, a, g),
            Dtype::F64 => host_backward::<f64>(cpu, a, g),
            Dtype::Bf16 => host_backward::<half::bf16>(cpu, a, g),
            Dtype::F16 => host_backward::<half::f16>(cpu, a, g),
        }
    }
}

unsafe fn host_backward<T: CpuElement>(
    cpu: &Cpu,
    a: &RawAttention<'_>,
    g: &RawGrads,
) -> Result<()> {
    // SAFETY: as the caller of `attention_backward` promises.
    unsafe {
        let inputs = a.host_inputs::<T>()?;
        let s = a.shape;
        let o = host_slice::<T>("o", g.o, s.o_len())?;
        let lse = host_slice::<T::Compute>("lse", g.lse, s.lse_len())?;
        let d_o = host_slice::<T>("d_o", g.d_o, s.o_len())?;
        let dq = host_slice_mut::<T>("dq", g.dq, s.q_len())?;
        let dk = host_slice_mut::<T>("dk", g.dk, s.kv_len())?;
        let dv = host_slice_mut::<T>("dv", g.dv, s.v_len())?;
        let dsinks = match g.dsinks {
            0 => None,
            at => Some(host_slice_mut::<T>("dsinks", at, s.q_heads)?),
        };
        let mut ins = inputs.regions;
        ins.extend([region("o", o), region("lse", lse), region("d_o", d_o)]);
        let mut outs = vec![region("dq", dq), region("dk", dk), region("dv", dv)];
        if let Some(ds) = &dsinks {
            outs.push(region("dsinks", ds));
        }
        no_overlap(&outs, &ins)?;
        let grads = Grads { dq, dk, dv, dsinks };
        cpu.backward(&inputs.args, Saved { o, lse }, d_o, grads)
    }
}

impl RawSdcc {
    /// Elements of the student and teacher logits (overflow checked).
    fn elems(&self) -> Result<(usize, usize)> {
        let elems = |rows: usize, what: &str| {
            rows.checked_mul(self.vocab).ok_or_else(|| {
                Error::Shape(format!(
                    "{what} logits: {rows} × {} elements overflow",
                    self.vocab
                ))
            })
        };
        Ok((
            elems(self.student_rows, "student")?,
            elems(self.teacher_rows, "teacher")?,
        ))
    }

    /// The pairs as the contract takes them, with the host ranges of the
    /// pairs and the weights. Rows outside their logits are
    /// [`Error::Pack`] (checked again by [`SdccArgs::new`]).
    ///
    /// Safety: the pairs' and weights' addresses as [`host_slice`].
    unsafe fn host_pairs(&self) -> Result<HostPairs<'_>> {
        let n = self.n_pairs;
        // SAFETY: as the caller promises.
        let weights = unsafe { host_slice::<f32>("weights", self.weights, n)? };
        let mut regions = vec![region("weights", weights)];
        let pairs = match self.pairs {
            RawPairs::Interleaved(at) => {
                let n2 = n
                    .checked_mul(2)
                    .ok_or_else(|| Error::Shape(format!("{n} pairs overflow")))?;
                // SAFETY: as the caller promises.
                let flat = unsafe { host_slice::<u32>("pairs", at, n2)? };
                regions.push(region("pairs", flat));
                flat.chunks_exact(2).map(|p| (p[0], p[1])).collect()
            }
            RawPairs::Columns { student, teacher } => {
                // SAFETY: as the caller promises.
                let (s, t) = unsafe {
                    (
                        host_slice::<i64>("student_rows", student, n)?,
                        host_slice::<i64>("teacher_rows", teacher, n)?,
                    )
                };
                regions.extend([region("student_rows", s), region("teacher_rows", t)]);
                let row = |what: &str, i: usize, r: i64, rows: usize| {
                    u32::try_from(r)
                        .ok()
                        .filter(|&r| (r as usize) < rows)
                        .ok_or_else(|| {
                            Error::Pack(format!(
                                "{what}[{i}] = {r} is outside the {rows} rows of its logits"
                            ))
                        })
                };
                let mut pairs = Vec::with_capacity(n);
                for (i, (&a, &b)) in s.iter().zip(t).enumerate() {
                    pairs.push((
                        row("student_rows", i, a, self.student_rows)?,
                        row("teacher_rows", i, b, self.teacher_rows)?,
                    ));
                }
                pairs
            }
        };
        Ok(HostPairs {
            pairs,
            weights,
            regions,
        })
    }
}

/// An SDCC call's host arrays: the pairs as the contract takes them, the
/// weights, and the byte ranges of both as the caller gave them.
struct HostPairs<'a> {
    pairs: Vec<(u32, u32)>,
    weights: &'a [f32],
    regions: Vec<Region>,
}

/// The fused SDCC forward KL on host memory, on `cpu`: writes the gradient
/// of `Σ w · KL(teacher ‖ student)` with respect to the student logits into
/// `grad` (like the student; rows no pair names are 0) and returns the
/// loss, as [`SdccBackend::sdcc_forward_kl`]. Takes [`HOST_SDCC_DTYPES`].
///
/// # Safety
/// Every nonzero address of `c` and `grad` is live host memory of at least
/// the elements the call says; the inputs are not written during the call.
/// Overlaps of `grad` with the inputs are checked.
pub unsafe fn sdcc_forward_kl(cpu: &Cpu, c: &RawSdcc, grad: usize) -> Result<SdccLoss> {
    check_dtype("host SDCC", c.dtype, HOST_SDCC_DTYPES)?;
    // SAFETY (each arm): as the caller promises.
    unsafe {
        match c.dtype {
            Dtype::F64 => host_sdcc::<f64>(cpu, c, grad),
            _ => host_sdcc::<f32>(cpu, c, grad),
        }
    }
}

unsafe fn host_sdcc<T: CpuFloat>(cpu: &Cpu, c: &RawSdcc, grad: usize) -> Result<SdccLoss> {
    let (ns, nt) = c.elems()?;
    // SAFETY: as the caller of `sdcc_forward_kl` promises.
    unsafe {
        let HostPairs {
            pairs,
            weights,
            regions: mut ins,
        } = c.host_pairs()?;
        let student = host_slice::<T>("student", c.student, ns)?;
        let teacher = host_slice::<T>("teacher", c.teacher, nt)?;
        let grad = host_slice_mut::<T>("grad", grad, ns)?;
        ins.extend([region("student", student), region("teacher", teacher)]);
        no_overlap(&[region("grad", grad)], &ins)?;
        let args = SdccArgs::new(student, teacher, c.vocab, &pairs, weights, c.temperature)?;
        cpu.sdcc_forward_kl(&args, grad)
    }
}

#[cfg(feature = "cuda")]
pub use device::{cuda_attention_backward, cuda_attention_forward, cuda_sdcc_forward_kl};

/// The device entries: the caller's device memory and stream.
#[cfg(feature = "cuda")]
mod device {
    use std::sync::Arc;

    use super::*;
    use crate::backend::cuda::host::{self, RawAttention as DeviceCall};
    use crate::backend::cuda::{CudaBackend, DevicePack, DqMode};

    /// The kernels of device `ordinal` on the caller's `stream`.
    ///
    /// Safety: `stream` is null (the legacy default stream) or a live
    /// stream of that device's primary context.
    unsafe fn backend(ordinal: usize, stream: usize) -> Result<CudaBackend> {
        let kernels = host::primary(ordinal)?;
        // SAFETY: as the caller promises.
        unsafe { host::on_raw_stream(&kernels, stream as _) }
    }

    /// `Err(Error::Null)` naming the first null address of a non-empty
    /// buffer (the device borrow checks alignment and sizes).
    fn nonnull(bufs: &[(&str, usize, usize)]) -> Result<()> {
        for &(what, addr, len) in bufs {
            if len > 0 && addr == 0 {
                return Err(Error::Null(format!("`{what}` ({len} elements)")));
            }
        }
        Ok(())
    }

    impl<'a> RawAttention<'a> {
        /// The backend, the pack on the device, and the call as the
        /// borrowed-pointer entries take it.
        ///
        /// Safety: as [`cuda_attention_forward`].
        unsafe fn on_device(
            &self,
            device: usize,
            stream: usize,
        ) -> Result<(CudaBackend, Arc<DevicePack>, DeviceCall<'a>)> {
            let s = self.shape;
            s.validate()?;
            nonnull(&[
                ("q", self.q, s.q_len()),
                ("k", self.k, s.kv_len()),
                ("v", self.v, s.v_len()),
            ])?;
            // SAFETY: as the caller promises.
            let be = unsafe { backend(device, stream)? };
            // With a plan: its device copy (uploaded by its first call on
            // this device, then shared: no copy, no synchronization).
            // Without: the arrays checked and uploaded per call.
            let pack = match self.mask {
                RawMask::Plan(plan) => RawMask::plan_of(plan, s.tokens)?.on_device(&be)?,
                arrays => Arc::new(be.upload_pack(unsafe { arrays.host_mask(s.tokens)? })?),
            };
            let key_starts = match self.key_starts {
                0 => None,
                // SAFETY: as the caller promises (a host buffer).
                at => Some(unsafe { host_slice::<u32>("key_starts", at, s.tokens)? }),
            };
            let call = DeviceCall {
                q: self.q as u64,
                k: self.k as u64,
                v: self.v as u64,
                sinks: self.sinks as u64,
                key_starts,
                shape: s,
                params: self.params,
            };
            Ok((be, pack, call))
        }
    }

    /// Tree attention forward on device memory, enqueued on `stream` of
    /// device `device`: writes `o` (like q, `v_head_dim` wide) and `lse`
    /// (`[q_heads, tokens]`, f32), as
    /// [`CudaBackend::forward_raw`]. The mask arrays and key starts are
    /// host memory; the sinks device memory. Takes
    /// [`CUDA_ATTENTION_DTYPES`].
    ///
    /// # Safety
    /// `stream` is null or a live stream of `device`'s primary context;
    /// every nonzero device address is a live allocation of that context
    /// of the elements the shape says, valid until the enqueued work has
    /// run; host addresses as [`attention_forward`]; `o` and `lse` overlap
    /// nothing else of the call.
    pub unsafe fn cuda_attention_forward(
        device: usize,
        stream: usize,
        a: &RawAttention<'_>,
        o: usize,
        lse: usize,
    ) -> Result<()> {
        check_dtype("CUDA attention", a.dtype, CUDA_ATTENTION_DTYPES)?;
        let s = a.shape;
        s.validate()?;
        nonnull(&[("o", o, s.o_len()), ("lse", lse, s.lse_len())])?;
        // SAFETY: as the caller promises.
        unsafe {
            let (be, pack, call) = a.on_device(device, stream)?;
            let (o, lse) = (o as u64, lse as u64);
            match a.dtype {
                Dtype::Bf16 => be.forward_raw::<half::bf16>(&pack, call, o, lse),
                _ => be.forward_raw::<half::f16>(&pack, call, o, lse),
            }
        }
    }

    /// Tree attention backward on device memory (see
    /// [`cuda_attention_forward`]), dQ summed as `mode` says: writes `g`'s
    /// gradients as [`CudaBackend::backward_raw`] (`lse` f32).
    ///
    /// # Safety
    /// As [`cuda_attention_forward`], for every address of `g` too.
    pub unsafe fn cuda_attention_backward(
        device: usize,
        stream: usize,
        a: &RawAttention<'_>,
        g: &RawGrads,
        mode: DqMode,
    ) -> Result<()> {
        check_dtype("CUDA attention", a.dtype, CUDA_ATTENTION_DTYPES)?;
        let s = a.shape;
        s.validate()?;
        nonnull(&[
            ("o", g.o, s.o_len()),
            ("lse", g.lse, s.lse_len()),
            ("d_o", g.d_o, s.o_len()),
            ("dq", g.dq, s.q_len()),
            ("dk", g.dk, s.kv_len()),
            ("dv", g.dv, s.v_len()),
        ])?;
        // SAFETY: as the caller promises.
        unsafe {
            let (be, pack, call) = a.on_device(device, stream)?;
            let at = |x: usize| x as u64;
            let (o, lse, d_o) = (at(g.o), at(g.lse), at(g.d_o));
            let (dq, dk, dv, ds) = (at(g.dq), at(g.dk), at(g.dv), at(g.dsinks));
            match a.dtype {
                Dtype::Bf16 => {
                    be.backward_raw::<half::bf16>(&pack, call, o, lse, d_o, dq, dk, dv, ds, mode)
                }
                _ => be.backward_raw::<half::f16>(&pack, call, o, lse, d_o, dq, dk, dv, ds, mode),
            }
        }
    }

    /// The fused SDCC forward KL on device logits, enqueued on `stream`:
    /// the f32 gradient (like the student) into `grad`; pairs and weights
    /// on the host; waits for the stream once to read the per-pair KL, as
    /// [`CudaBackend::sdcc_raw`]. Takes [`CUDA_SDCC_DTYPES`].
    ///
    /// # Safety
    /// As [`cuda_attention_forward`]; `grad` overlaps neither logits
    /// buffer.
    pub unsafe fn cuda_sdcc_forward_kl(
        device: usize,
        stream: usize,
        c: &RawSdcc,
        grad: usize,
    ) -> Result<SdccLoss> {
        check_dtype("CUDA SDCC", c.dtype, CUDA_SDCC_DTYPES)?;
        let (ns, nt) = c.elems()?;
        nonnull(&[
            ("student", c.student, ns),
            ("teacher", c.teacher, nt),
            ("grad", grad, ns),
        ])?;
        // SAFETY: as the caller promises.
        unsafe {
            let HostPairs { pairs, weights, .. } = c.host_pairs()?;
            let be = backend(device, stream)?;
            let (st, sr, te, tr, v) = (
                c.student as u64,
                c.student_rows,
                c.teacher as u64,
                c.teacher_rows,
                c.vocab,
            );
            let (tau, g) = (c.temperature, grad as u64);
            match c.dtype {
                Dtype::Bf16 => {
                    be.sdcc_raw::<half::bf16>(st, sr, te, tr, v, &pairs, weights, tau, g)
                }
                Dtype::F16 => be.sdcc_raw::<half::f16>(st, sr, te, tr, v, &pairs, weights, tau, g),
                _ => be.sdcc_raw::<f32>(st, sr, te, tr, v, &pairs, weights, tau, g),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::AttnParams;

    fn shape(tokens: usize) -> AttnShape {
        AttnShape {
            tokens,
            q_heads: 2,
            kv_heads: 1,
            head_dim: 64,
            v_head_dim: 64,
        }
    }

    /// A chain of `tokens` tokens: kv_end = tokens, positions 0..tokens.
    fn chain(tokens: usize) -> (Vec<u32>, Vec<u32>) {
        (vec![tokens as u32; tokens], (0..tokens as u32).collect())
    }

    fn call<'a>(
        dtype: Dtype,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        mask: RawMask<'a>,
        tokens: usize,
    ) -> RawAttention<'a> {
        RawAttention {
            dtype,
            q: q.as_ptr() as usize,
            k: k.as_ptr() as usize,
            v: v.as_ptr() as usize,
            mask,
            sinks: 0,
            key_starts: 0,
            shape: shape(tokens),
            params: AttnParams::new(64),
        }
    }

    fn filled(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = crate::rng::Rng::new(seed);
        (0..n).map(|_| rng.signed_unit()).collect()
    }

    #[test]
    fn dtype_names_round_trip_and_unknown_names_are_refused() {
        for d in [Dtype::F32, Dtype::F64, Dtype::Bf16, Dtype::F16] {
            assert_eq!(Dtype::from_name(d.name()).unwrap(), d);
        }
        let e = Dtype::from_name("int8").unwrap_err();
        assert!(matches!(e, Error::Unsupported(_)), "{e}");
        assert!(e.to_string().contains("\"int8\""), "{e}");
    }

    /// The raw forward equals the contract's forward on the same slices,
    /// with the arrays and with a plan; a plan of another size is refused.
    #[test]
    fn raw_forward_is_the_contract_forward_with_arrays_or_a_plan() {
        let t = 7;
        let s = shape(t);
        let (q, k, v) = (
            filled(s.q_len(), 1),
            filled(s.kv_len(), 2),
            filled(s.v_len(), 3),
        );
        let (kv_end, pos) = chain(t);
        let cpu = Cpu::default();
        let args = AttnArgs::new(
            &q[..],
            &k[..],
            &v[..],
            s,
            PackMask::new(&kv_end, &pos).unwrap(),
            AttnParams::new(64),
        )
        .unwrap();
        let (mut o_ref, mut lse_ref) = (vec![0f32; s.o_len()], vec![0f32; s.lse_len()]);
        cpu.forward(&args, &mut o_ref, &mut lse_ref).unwrap();

        let plan = MaskPlan::new(&kv_end, &pos).unwrap();
        let arrays = RawMask::Arrays {
            kv_end: kv_end.as_ptr() as usize,
            position_ids: pos.as_ptr() as usize,
        };
        for mask in [arrays, RawMask::Plan(&plan)] {
            let a = call(Dtype::F32, &q, &k, &v, mask, t);
            let (mut o, mut lse) = (vec![f32::NAN; s.o_len()], vec![f32::NAN; s.lse_len()]);
            unsafe {
                attention_forward(&cpu, &a, o.as_mut_ptr() as usize, lse.as_mut_ptr() as usize)
            }
            .unwrap();
            assert_eq!(o, o_ref);
            assert_eq!(lse, lse_ref);
        }

        let other = MaskPlan::new(
            &kv_end[..t - 1]
                .iter()
                .map(|_| (t - 1) as u32)
                .collect::<Vec<_>>(),
            &pos[..t - 1],
        )
        .unwrap();
        let a = call(Dtype::F32, &q, &k, &v, RawMask::Plan(&other), t);
        let (mut o, mut lse) = (vec![0f32; s.o_len()], vec![0f32; s.lse_len()]);
        let e = unsafe {
            attention_forward(&cpu, &a, o.as_mut_ptr() as usize, lse.as_mut_ptr() as usize)
        }
        .unwrap_err();
        assert!(
            matches!(e, Error::Shape(_)) && e.to_string().contains("6 tokens"),
            "{e}"
        );
    }

    /// Null, misaligned and overlapping buffers, and a dtype the entry does
    /// not take, are errors naming the buffer or the dtype; nothing is
    /// written.
    #[test]
    fn bad_addresses_and_dtypes_are_named_errors() {
        let t = 5;
        let s = shape(t);
        let (q, k, v) = (
            filled(s.q_len(), 4),
            filled(s.kv_len(), 5),
            filled(s.v_len(), 6),
        );
        let (kv_end, pos) = chain(t);
        let mask = RawMask::Arrays {
            kv_end: kv_end.as_ptr() as usize,
            position_ids: pos.as_ptr() as usize,
        };
        let cpu = Cpu::default();
        let mut o = vec![f32::NAN; s.o_len()];
        let mut lse = vec![f32::NAN; s.lse_len()];
        let (oa, la) = (o.as_mut_ptr() as usize, lse.as_mut_ptr() as usize);
        let run = |a: &RawAttention<'_>, o: usize, lse: usize| unsafe {
            attention_forward(&cpu, a, o, lse).unwrap_err()
        };

        let mut a = call(Dtype::F32, &q, &k, &v, mask, t);
        a.k = 0;
        let e = run(&a, oa, la);
        assert!(
            matches!(e, Error::Null(_)) && e.to_string().contains("`k`"),
            "{e}"
        );

        let mut a = call(Dtype::F32, &q, &k, &v, mask, t);
        a.v += 2;
        let e = run(&a, oa, la);
        assert!(
            matches!(e, Error::Shape(_)) && e.to_string().contains("aligned"),
            "{e}"
        );

        let a = call(Dtype::F32, &q, &k, &v, mask, t);
        let e = run(&a, q.as_ptr() as usize, la);
        assert!(e.to_string().contains("output `o` overlaps `q`"), "{e}");
        let e = run(&a, oa, kv_end.as_ptr() as usize);
        assert!(
            e.to_string().contains("output `lse` overlaps `kv_end`"),
            "{e}"
        );

        let mut a = call(Dtype::F32, &q, &k, &v, mask, t);
        a.mask = RawMask::Arrays {
            kv_end: kv_end.as_ptr() as usize,
            position_ids: 0,
        };
        let e = run(&a, oa, la);
        assert!(
            matches!(e, Error::Null(_)) && e.to_string().contains("position_ids"),
            "{e}"
        );

        // SDCC on the host takes f32 and f64 only.
        let c = RawSdcc {
            dtype: Dtype::Bf16,
            student: q.as_ptr() as usize,
            student_rows: 2,
            teacher: q.as_ptr() as usize,
            teacher_rows: 2,
            vocab: 8,
            pairs: RawPairs::Interleaved(0),
            n_pairs: 0,
            weights: 0,
            temperature: 1.0,
        };
        let e = unsafe { sdcc_forward_kl(&cpu, &c, oa) }.unwrap_err();
        assert!(
            matches!(e, Error::Unsupported(_)) && e.to_string().contains("bfloat16"),
            "{e}"
        );
        assert!(
            o.iter().chain(&lse).all(|x| x.is_nan()),
            "an output was written"
        );
    }

    /// Both pair layouts give the same loss; a column row out of range or
    /// negative is an `Error::Pack` naming it.
    #[test]
    fn sdcc_pair_layouts_agree_and_bad_rows_are_named() {
        let (rows, vocab) = (4, 16);
        let logits = filled(rows * vocab, 7);
        let flat: [u32; 4] = [0, 2, 1, 3];
        let (student, teacher): ([i64; 2], [i64; 2]) = ([0, 1], [2, 3]);
        let weights = [1.0f32, 0.5];
        let cpu = Cpu::default();
        let base = RawSdcc {
            dtype: Dtype::F32,
            student: logits.as_ptr() as usize,
            student_rows: rows,
            teacher: logits.as_ptr() as usize,
            teacher_rows: rows,
            vocab,
            pairs: RawPairs::Interleaved(flat.as_ptr() as usize),
            n_pairs: 2,
            weights: weights.as_ptr() as usize,
            temperature: 1.0,
        };
        let mut g1 = vec![f32::NAN; rows * vocab];
        let l1 = unsafe { sdcc_forward_kl(&cpu, &base, g1.as_mut_ptr() as usize) }.unwrap();
        let cols = RawSdcc {
            pairs: RawPairs::Columns {
                student: student.as_ptr() as usize,
                teacher: teacher.as_ptr() as usize,
            },
            ..base
        };
        let mut g2 = vec![f32::NAN; rows * vocab];
        let l2 = unsafe { sdcc_forward_kl(&cpu, &cols, g2.as_mut_ptr() as usize) }.unwrap();
        assert_eq!(l1.per_pair, l2.per_pair);
        assert!(l1.loss_sum > 0.0);
        assert_eq!(g1, g2);

        for bad in [vec![0i64, -1], vec![0i64, 4]] {
            let c = RawSdcc {
                pairs: RawPairs::Columns {
                    student: student.as_ptr() as usize,
                    teacher: bad.as_ptr() as usize,
                },
                ..base
            };
            let e = unsafe { sdcc_forward_kl(&cpu, &c, g2.as_mut_ptr() as usize) }.unwrap_err();
            assert!(
                matches!(e, Error::Pack(_)) && e.to_string().contains("teacher_rows[1]"),
                "{e}"
            );
        }
        // The gradient may not alias the logits it reads.
        let e = unsafe { sdcc_forward_kl(&cpu, &base, logits.as_ptr() as usize) }.unwrap_err();
        assert!(e.to_string().contains("output `grad` overlaps"), "{e}");
    }
}
