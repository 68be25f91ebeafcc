//! The C ABI of treeattn: a thin layer over the crate's contract
//! (`treeattn::backend`), never a second implementation.
//!
//! Every function returns a status code (`TREEATTN_OK` = 0 or one of the
//! `TREEATTN_ERR_*` codes) and writes its results through caller-owned
//! pointers; on failure [`treeattn_last_error`] returns the message (per
//! thread). No panic crosses the boundary: every entry runs under
//! `catch_unwind` and reports a panic as `TREEATTN_ERR_PANIC`. Pointers
//! are checked for null (a null pointer with a zero length is an empty
//! array) and alignment; lengths are derived from the sizes given and
//! checked for overflow; output buffers must not overlap each other or the
//! inputs (checked). The header is `include/treeattn.h`, generated from
//! this file by cbindgen and kept in sync by `tests/header.rs`.
//!
//! Layouts are those of the contract (`flash_attn_varlen`'s): q, o, dO, dQ
//! `[tokens, q_heads, head_dim]`; k, v, dK, dV `[tokens, kv_heads,
//! head_dim]`; LSE `[q_heads, tokens]`; logits `[rows, vocab]`, row-major.

#![allow(clippy::missing_safety_doc)]

mod cuda;
pub use cuda::*;

use std::cell::RefCell;
use std::ffi::{c_char, c_void, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

use treeattn::backend::cpu::{self, Cpu, CpuElement, CpuFloat};
use treeattn::backend::{
    AttentionBackend, AttnArgs, AttnParams, AttnShape, Element, Grads, Rope, Saved, SdccArgs,
    SdccBackend,
};
use treeattn::mask::PackMask;
use treeattn::pack::{Pack, SdccPair};
use treeattn::plan::MaskPlan;
use treeattn::rollout::{Call, Rollout};
use treeattn::tree::Tree;
use treeattn::Error;

/// Success.
pub const TREEATTN_OK: i32 = 0;
/// A required pointer was null (with a non-zero length).
pub const TREEATTN_ERR_NULL: i32 = 1;
/// Sizes, lengths, alignment or overlap of the arguments do not fit.
pub const TREEATTN_ERR_SHAPE: i32 = 2;
/// A rollout that breaks the calls format (empty context, ...).
pub const TREEATTN_ERR_ROLLOUT: i32 = 3;
/// An invalid mask / pack (kv_end out of range, SDCC row out of range).
pub const TREEATTN_ERR_PACK: i32 = 4;
/// Unsupported parameters (head dim, softmax scale, rotary settings, ...).
pub const TREEATTN_ERR_UNSUPPORTED: i32 = 5;
/// A NaN or infinity where finite values are required.
pub const TREEATTN_ERR_NON_FINITE: i32 = 6;
/// A CUDA error (builds with the `cuda` feature).
pub const TREEATTN_ERR_CUDA: i32 = 7;
/// Any other error (i/o, ...).
pub const TREEATTN_ERR_OTHER: i32 = 8;
/// A panic inside treeattn, caught at the boundary (a bug: please report).
pub const TREEATTN_ERR_PANIC: i32 = 9;

/// The element type of an attention or SDCC call (their first argument):
/// `TREEATTN_F32`, `TREEATTN_F64`, `TREEATTN_BF16` or `TREEATTN_F16`. Each
/// entry takes some of them and answers `TREEATTN_ERR_UNSUPPORTED`, naming
/// the dtype, for the others. An integer type with named values rather than
/// a C `enum`: a value outside the list is then that error too, where a Rust
/// enum would make it undefined behaviour.
pub type TreeattnDtype = u32;
/// `float` (IEEE binary32).
pub const TREEATTN_F32: TreeattnDtype = 0;
/// `double` (IEEE binary64).
pub const TREEATTN_F64: TreeattnDtype = 1;
/// bfloat16 (`__nv_bfloat16`; 16 bits, passed as `void *`).
pub const TREEATTN_BF16: TreeattnDtype = 2;
/// IEEE binary16 (`__half`; passed as `void *`).
pub const TREEATTN_F16: TreeattnDtype = 3;

/// `field` of [`treeattn_pack_u32`]: the pack's token ids, `len` entries.
pub const TREEATTN_PACK_TOKENS: u32 = 0;
/// Depth position ids, `len` entries.
pub const TREEATTN_PACK_POSITION_IDS: u32 = 1;
/// The mask: query q sees key k iff `k <= q < kv_end[k]`; `len` entries.
pub const TREEATTN_PACK_KV_END: u32 = 2;
/// Loss entries: the row whose logits predict the label.
pub const TREEATTN_PACK_LOSS_ROW: u32 = 3;
/// Loss entries: the target token.
pub const TREEATTN_PACK_LOSS_LABEL: u32 = 4;
/// Loss entries: the rollout's index in the input.
pub const TREEATTN_PACK_LOSS_ROLLOUT: u32 = 5;
/// Loss entries: the call's index in its rollout.
pub const TREEATTN_PACK_LOSS_CALL: u32 = 6;
/// Loss entries: the offset in the call's completion.
pub const TREEATTN_PACK_LOSS_OFFSET: u32 = 7;
/// SDCC pairs: the student row (compressed-stream row).
pub const TREEATTN_PACK_SDCC_STUDENT_ROW: u32 = 8;
/// SDCC pairs: the teacher row (live row).
pub const TREEATTN_PACK_SDCC_TEACHER_ROW: u32 = 9;

/// `field` of [`treeattn_pack_f32`]: loss entries' weights.
pub const TREEATTN_PACK_LOSS_WEIGHT: u32 = 0;
/// Loss entries' rollout log-probs (NaN where the input had none).
pub const TREEATTN_PACK_LOSS_LOGPROB: u32 = 1;

/// A packed conditioning tree (opaque): built by [`treeattn_pack_build`],
/// read with the getters, freed by [`treeattn_pack_free`].
pub struct TreeattnPack {
    pack: Pack,
    /// The pack's arrays as the getters hand them out (struct of arrays).
    u32s: [Vec<u32>; 10],
    f32s: [Vec<f32>; 2],
}

/// A pack's mask plan (opaque; the crate's `MaskPlan`, Python's
/// `treeattn.torch.MaskPlan`: one name in every language): `kv_end` and
/// the position ids validated once, with their key-tile bounds, built by [`treeattn_mask_plan_create`] and
/// freed by [`treeattn_mask_plan_destroy`]. The `*_mask` attention entries take
/// it in place of the two arrays: no call checks the mask again, and the
/// device entries upload it once per device (by their first call, on that
/// call's stream) and then copy nothing and synchronize nothing. It may be
/// shared by threads; destroy it after the last call that uses it has run.
pub struct TreeattnMaskPlan {
    plan: MaskPlan,
}

/// Sizes of an attention call.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct TreeattnShape {
    /// Tokens of the pack (`L`).
    pub tokens: usize,
    /// Query heads (a multiple of `kv_heads`).
    pub q_heads: usize,
    /// Key / value heads.
    pub kv_heads: usize,
    /// Head dimension of q and k.
    pub head_dim: usize,
    /// Head dimension of v and o (multi-head latent attention: DeepSeek-V3
    /// takes 192-dim q, k and 128-dim v); `0` means `head_dim`.
    pub v_head_dim: usize,
}

/// Parameters of an attention call; a null pointer means the defaults
/// (`1 / sqrt(head_dim)`, no rotary, no finiteness scan, atomic dQ on the
/// device), and so does a zero-initialised struct.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct TreeattnParams {
    /// Multiplies `Q Kᵀ` before the softmax; `0` means `1 / sqrt(head_dim)`.
    pub softmax_scale: f64,
    /// Rotary dims (even, at most head_dim) at the pack's position ids;
    /// `0` turns rotary off.
    pub rope_dims: usize,
    /// Rotary base (e.g. 10000), used when `rope_dims > 0`.
    pub rope_base: f64,
    /// Non-zero: scan the inputs for NaN / ±inf first.
    pub check_finite: i32,
    /// Sliding window of `window` tree levels (key `k` visible to query
    /// `q` only if `depth(q) − depth(k) < window`; on a chain, `q − k <
    /// window`); `0` turns it off. Needs a tree-shaped mask.
    pub window: u32,
    /// Logit softcap `c`: scores `c · tanh(s / c)` after the scale; `0`
    /// turns it off.
    pub softcap: f64,
    /// Attention sinks (gpt-oss): `q_heads` logits of q's element type
    /// joining each row's softmax denominator with no value, in the memory
    /// of the entry's q (host for the host entries, device for the
    /// `treeattn_cuda_*` ones); null: none. Their gradient goes to the
    /// backward entries' `dsinks` (the same memory).
    pub sinks: *const c_void,
    /// `1`: the device backward (`treeattn_cuda_attention_backward*`)
    /// sums dQ deterministically (a separate kernel, no atomics: dQ
    /// bit-identical from run to run, more backward time); `0`, the
    /// default of a zero-initialised struct, as in FlashAttention: dQ by
    /// atomic adds (faster; its last bits vary from run to run, within the
    /// kernels' tolerances). dK, dV and dsinks are deterministic either
    /// way. Every other value is `TREEATTN_ERR_UNSUPPORTED`. The host
    /// entries are deterministic anyway: they accept it and it changes
    /// nothing there (nor in any forward).
    pub deterministic: i32,
}

/// Result of an SDCC call.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct TreeattnSdccLoss {
    /// `Σ_pairs w · KL`.
    pub loss_sum: f64,
    /// `loss_sum / Σ w` (0 when `Σ w = 0`).
    pub loss_mean: f64,
}

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

/// An error at the boundary: a status code and its message.
struct Fail(i32, String);

impl From<Error> for Fail {
    fn from(e: Error) -> Fail {
        let code = match e {
            Error::Shape(_) => TREEATTN_ERR_SHAPE,
            Error::Rollout { .. } => TREEATTN_ERR_ROLLOUT,
            Error::Pack(_) => TREEATTN_ERR_PACK,
            Error::Unsupported(_) => TREEATTN_ERR_UNSUPPORTED,
            Error::NonFinite { .. } => TREEATTN_ERR_NON_FINITE,
            Error::Cuda(_) => TREEATTN_ERR_CUDA,
            _ => TREEATTN_ERR_OTHER,
        };
        Fail(code, e.to_string())
    }
}

type R<T> = std::result::Result<T, Fail>;

fn set_last_error(msg: &str) {
    let c = CString::new(msg.replace('\0', "\\0")).unwrap_or_default();
    LAST_ERROR.with(|e| *e.borrow_mut() = c);
}

/// Runs `f` at the boundary: its status code, the message stored for
/// [`treeattn_last_error`] on failure, a panic caught.
fn guard(f: impl FnOnce() -> R<()>) -> i32 {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => TREEATTN_OK,
        Ok(Err(Fail(code, msg))) => {
            set_last_error(&msg);
            code
        }
        Err(payload) => {
            let what = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic payload".into());
            set_last_error(&format!("panic inside treeattn (a bug): {what}"));
            TREEATTN_ERR_PANIC
        }
    }
}

fn null(what: &str) -> Fail {
    Fail(TREEATTN_ERR_NULL, format!("`{what}` is a null pointer"))
}

/// `len` elements at `p`: null only with `len == 0`, aligned for `T`.
unsafe fn slice<'a, T>(what: &str, p: *const T, len: usize) -> R<&'a [T]> {
    if p.is_null() {
        return if len == 0 { Ok(&[]) } else { Err(null(what)) };
    }
    check_ptr(
        what,
        p as usize,
        len,
        std::mem::size_of::<T>(),
        std::mem::align_of::<T>(),
    )?;
    Ok(std::slice::from_raw_parts(p, len))
}

/// As [`slice()`], writable.
unsafe fn slice_mut<'a, T>(what: &str, p: *mut T, len: usize) -> R<&'a mut [T]> {
    if p.is_null() {
        return if len == 0 {
            Ok(&mut [])
        } else {
            Err(null(what))
        };
    }
    check_ptr(
        what,
        p as usize,
        len,
        std::mem::size_of::<T>(),
        std::mem::align_of::<T>(),
    )?;
    Ok(std::slice::from_raw_parts_mut(p, len))
}

fn check_ptr(what: &str, addr: usize, len: usize, size: usize, align: usize) -> R<()> {
    if !addr.is_multiple_of(align) {
        return Err(Fail(
            TREEATTN_ERR_SHAPE,
            format!("`{what}` = {addr:#x} is not aligned to {align} bytes"),
        ));
    }
    match len.checked_mul(size) {
        Some(bytes) if bytes <= isize::MAX as usize && addr.checked_add(bytes).is_some() => Ok(()),
        _ => Err(Fail(
            TREEATTN_ERR_SHAPE,
            format!("`{what}`: {len} elements overflow the address space"),
        )),
    }
}

/// Byte range of a named buffer, for the overlap check.
fn range<T>(what: &'static str, s: &[T]) -> (&'static str, usize, usize) {
    let a = s.as_ptr() as usize;
    (what, a, a + std::mem::size_of_val(s))
}

/// `Err` when an output overlaps another output or an input (the outputs
/// are written while the inputs are read: Rust's `&mut` must be unique).
fn no_overlap(outputs: &[(&str, usize, usize)], inputs: &[(&str, usize, usize)]) -> R<()> {
    for (i, &(name, a0, a1)) in outputs.iter().enumerate() {
        let others = outputs[i + 1..].iter().chain(inputs);
        for &(other, b0, b1) in others {
            if a0 < a1 && b0 < b1 && a0 < b1 && b0 < a1 {
                return Err(Fail(
                    TREEATTN_ERR_SHAPE,
                    format!("output `{name}` overlaps `{other}`"),
                ));
            }
        }
    }
    Ok(())
}

/// The version of this library (`"0.1.0"`), a static NUL-terminated string.
#[no_mangle]
pub extern "C" fn treeattn_version() -> *const c_char {
    static V: &str = concat!(env!("CARGO_PKG_VERSION"), "\0");
    V.as_ptr() as *const c_char
}

/// The message of the last failed call on this thread (`""` if none
/// failed yet). Valid until the next failing call on the same thread;
/// successful calls leave it unchanged.
#[no_mangle]
pub extern "C" fn treeattn_last_error() -> *const c_char {
    LAST_ERROR
        .try_with(|e| e.borrow().as_ptr())
        .unwrap_or(c"".as_ptr())
}

/// Sets the CPU backend's default thread count for this process (the
/// calling thread plus `threads − 1` pooled workers, parked between
/// calls); `0` goes back to the `TREEATTN_THREADS` environment variable or
/// all cores. See README "Embedding" for sharing cores with a host pool.
#[no_mangle]
pub extern "C" fn treeattn_set_threads(threads: usize) -> i32 {
    guard(|| {
        cpu::set_default_threads(threads);
        Ok(())
    })
}

/// Writes the thread count a call would run on now.
#[no_mangle]
pub unsafe extern "C" fn treeattn_get_threads(out: *mut usize) -> i32 {
    guard(|| {
        if out.is_null() {
            return Err(null("out"));
        }
        *out = cpu::num_threads();
        Ok(())
    })
}

/// Builds the trie pack of `n_rollouts` rollouts given as flat arrays.
///
/// Calls are numbered over all rollouts: rollout `r` has calls
/// `rollout_offsets[r] .. rollout_offsets[r + 1]` (`n_rollouts + 1`
/// entries, starting at 0, non-decreasing). Call `c`'s context is
/// `context_tokens[context_offsets[c] .. context_offsets[c + 1]]` and its
/// completion `completion_tokens[completion_offsets[c] ..
/// completion_offsets[c + 1]]` (both offset arrays have `n_calls + 1`
/// entries, `n_calls = rollout_offsets[n_rollouts]`). `logprobs` is null
/// or one rollout log-prob per completion token (aligned with
/// `completion_tokens`). `share_prefixes` non-zero shares prefixes across
/// rollouts (one trie over all of them). Rollouts are named by their index.
/// On success `*out` owns the pack (free it with [`treeattn_pack_free`]).
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn treeattn_pack_build(
    n_rollouts: usize,
    rollout_offsets: *const usize,
    context_tokens: *const u32,
    context_offsets: *const usize,
    completion_tokens: *const u32,
    completion_offsets: *const usize,
    logprobs: *const f32,
    share_prefixes: i32,
    out: *mut *mut TreeattnPack,
) -> i32 {
    guard(|| {
        if out.is_null() {
            return Err(null("out"));
        }
        *out = std::ptr::null_mut();
        let n1 = n_rollouts
            .checked_add(1)
            .ok_or_else(|| Fail(TREEATTN_ERR_SHAPE, "n_rollouts overflows".into()))?;
        let ro = slice("rollout_offsets", rollout_offsets, n1)?;
        let n_calls = offsets_end("rollout_offsets", ro)?;
        let co = slice("context_offsets", context_offsets, n_calls + 1)?;
        let po = slice("completion_offsets", completion_offsets, n_calls + 1)?;
        let ctx = slice(
            "context_tokens",
            context_tokens,
            offsets_end("context_offsets", co)?,
        )?;
        let n_completion = offsets_end("completion_offsets", po)?;
        let comp = slice("completion_tokens", completion_tokens, n_completion)?;
        let lp = if logprobs.is_null() {
            None
        } else {
            Some(slice("logprobs", logprobs, n_completion)?)
        };
        let mut rollouts = Vec::with_capacity(n_rollouts);
        for r in 0..n_rollouts {
            let calls = (ro[r]..ro[r + 1])
                .map(|c| {
                    let (a, b) = (po[c], po[c + 1]);
                    Call {
                        context: ctx[co[c]..co[c + 1]].to_vec(),
                        completion: comp[a..b].to_vec(),
                        logprobs: lp.map(|l| l[a..b].to_vec()),
                    }
                })
                .collect();
            rollouts.push(Rollout::new(r.to_string(), calls)?);
        }
        let tree = Tree::build(&rollouts, share_prefixes != 0)?;
        let pack = tree.trie_pack();
        let sdcc: Vec<SdccPair> = tree.sdcc_pairs();
        let l = &pack.loss;
        let u32s = [
            pack.tokens.clone(),
            pack.position_ids.clone(),
            pack.kv_end.clone(),
            l.iter().map(|e| e.row).collect(),
            l.iter().map(|e| e.label).collect(),
            l.iter().map(|e| e.rollout).collect(),
            l.iter().map(|e| e.call).collect(),
            l.iter().map(|e| e.offset).collect(),
            sdcc.iter().map(|p| p.student_row).collect(),
            sdcc.iter().map(|p| p.teacher_row).collect(),
        ];
        let f32s = [
            l.iter().map(|e| e.weight).collect(),
            l.iter().map(|e| e.logprob.unwrap_or(f32::NAN)).collect(),
        ];
        *out = Box::into_raw(Box::new(TreeattnPack { pack, u32s, f32s }));
        Ok(())
    })
}

/// Checks an offsets array (starts at 0, non-decreasing) and returns its
/// last entry.
fn offsets_end(what: &str, o: &[usize]) -> R<usize> {
    if o.first() != Some(&0) {
        return Err(Fail(TREEATTN_ERR_SHAPE, format!("`{what}[0]` must be 0")));
    }
    if let Some(i) = o.windows(2).position(|w| w[1] < w[0]) {
        return Err(Fail(
            TREEATTN_ERR_SHAPE,
            format!(
                "`{what}` decreases at entry {}: {} after {}",
                i + 1,
                o[i + 1],
                o[i]
            ),
        ));
    }
    Ok(*o.last().expect("checked non-empty"))
}

/// Frees a pack (null is allowed and does nothing).
#[no_mangle]
pub unsafe extern "C" fn treeattn_pack_free(pack: *mut TreeattnPack) {
    if !pack.is_null() {
        // Dropping plain vectors cannot panic; catch_unwind anyway.
        let _ = catch_unwind(AssertUnwindSafe(|| drop(Box::from_raw(pack))));
    }
}

/// Writes the pack's token count (`L`), its loss entries and SDCC pairs
/// (any of the out pointers may be null).
#[no_mangle]
pub unsafe extern "C" fn treeattn_pack_sizes(
    pack: *const TreeattnPack,
    tokens: *mut usize,
    loss_entries: *mut usize,
    sdcc_pairs: *mut usize,
) -> i32 {
    guard(|| {
        let p = pack.as_ref().ok_or_else(|| null("pack"))?;
        for (out, n) in [
            (tokens, p.pack.len()),
            (loss_entries, p.pack.loss.len()),
            (sdcc_pairs, p.u32s[8].len()),
        ] {
            if let Some(o) = out.as_mut() {
                *o = n;
            }
        }
        Ok(())
    })
}

/// Points `*data` at one of the pack's `uint32_t` arrays
/// (`TREEATTN_PACK_TOKENS` ... `TREEATTN_PACK_SDCC_TEACHER_ROW`) and writes
/// its length; the array lives as long as the pack.
#[no_mangle]
pub unsafe extern "C" fn treeattn_pack_u32(
    pack: *const TreeattnPack,
    field: u32,
    data: *mut *const u32,
    len: *mut usize,
) -> i32 {
    pack_field(pack, field, "uint32_t", |p| &p.u32s, data, len)
}

/// As [`treeattn_pack_u32`] for the `float` arrays
/// (`TREEATTN_PACK_LOSS_WEIGHT`, `TREEATTN_PACK_LOSS_LOGPROB`).
#[no_mangle]
pub unsafe extern "C" fn treeattn_pack_f32(
    pack: *const TreeattnPack,
    field: u32,
    data: *mut *const f32,
    len: *mut usize,
) -> i32 {
    pack_field(pack, field, "float", |p| &p.f32s, data, len)
}

/// The getters' body: array `field` of `arrays(pack)` (of C type `kind`)
/// into `*data` and `*len`.
unsafe fn pack_field<T>(
    pack: *const TreeattnPack,
    field: u32,
    kind: &str,
    arrays: fn(&TreeattnPack) -> &[Vec<T>],
    data: *mut *const T,
    len: *mut usize,
) -> i32 {
    guard(|| {
        let p = pack.as_ref().ok_or_else(|| null("pack"))?;
        let all = arrays(p);
        let v = all.get(field as usize).ok_or_else(|| {
            Fail(
                TREEATTN_ERR_SHAPE,
                format!("no {kind} pack field {field} (0..={})", all.len() - 1),
            )
        })?;
        write_array(v, data, len)
    })
}

unsafe fn write_array<T>(v: &[T], data: *mut *const T, len: *mut usize) -> R<()> {
    if data.is_null() {
        return Err(null("data"));
    }
    if len.is_null() {
        return Err(null("len"));
    }
    *data = v.as_ptr();
    *len = v.len();
    Ok(())
}

fn shape_of(s: TreeattnShape) -> R<AttnShape> {
    let shape = AttnShape {
        tokens: s.tokens,
        q_heads: s.q_heads,
        kv_heads: s.kv_heads,
        head_dim: s.head_dim,
        v_head_dim: if s.v_head_dim == 0 {
            s.head_dim
        } else {
            s.v_head_dim
        },
    };
    shape.validate()?;
    Ok(shape)
}

unsafe fn params_of(p: *const TreeattnParams, shape: &AttnShape) -> R<AttnParams> {
    let mut params = AttnParams::new(shape.head_dim);
    if let Some(p) = p.as_ref() {
        if p.softmax_scale != 0.0 {
            params.softmax_scale = p.softmax_scale;
        }
        if p.rope_dims != 0 {
            params.rope = Some(Rope {
                base: p.rope_base,
                dims: p.rope_dims,
            });
        }
        params.check_finite = p.check_finite != 0;
        params.window = (p.window != 0).then_some(p.window);
        params.softcap = (p.softcap != 0.0).then_some(p.softcap);
        deterministic_of(p)?;
    }
    params.validate(shape)?;
    Ok(params)
}

/// The params' `deterministic` flag (null params: atomic, `false`);
/// anything but 0 or 1 is refused.
unsafe fn deterministic_of(p: *const TreeattnParams) -> R<bool> {
    match p.as_ref().map_or(0, |p| p.deterministic) {
        0 => Ok(false),
        1 => Ok(true),
        other => Err(Fail(
            TREEATTN_ERR_UNSUPPORTED,
            format!(
                "params.deterministic = {other}: expected 0 (atomic dQ, the default) or 1 \
                 (deterministic dQ)"
            ),
        )),
    }
}

/// The sinks pointer of a call's params (null params or pointer: none).
unsafe fn sinks_of(p: *const TreeattnParams) -> *const c_void {
    p.as_ref().map_or(std::ptr::null(), |p| p.sinks)
}

/// The inputs shared by forward and backward, as host slices.
struct Inputs<'a, T> {
    q: &'a [T],
    k: &'a [T],
    v: &'a [T],
    kv_end: &'a [u32],
    pos: &'a [u32],
    /// Attention sinks, `[q_heads]`.
    sinks: Option<&'a [T]>,
    /// The call's mask plan, when it came with one (then `kv_end` and
    /// `pos` are the plan's).
    plan: Option<&'a MaskPlan>,
    shape: AttnShape,
    params: AttnParams,
}

/// The inputs of an attention call as C gives them: q, k, v on the host or
/// the device (by entry), the pack's arrays and the params on the host.
#[derive(Clone, Copy)]
struct AttnCall {
    q: *const c_void,
    k: *const c_void,
    v: *const c_void,
    shape: TreeattnShape,
    kv_end: *const u32,
    position_ids: *const u32,
    /// Non-null: the pack's plan, in place of `kv_end` / `position_ids`.
    mask: *const TreeattnMaskPlan,
    params: *const TreeattnParams,
}

/// The plan of a call made with one (null: none), checked against the
/// call's token count.
unsafe fn call_plan<'a>(mask: *const TreeattnMaskPlan, tokens: usize) -> R<Option<&'a MaskPlan>> {
    if mask.is_null() {
        return Ok(None);
    }
    let plan = &(*mask).plan;
    if plan.len() != tokens {
        return Err(Fail(
            TREEATTN_ERR_SHAPE,
            format!(
                "`mask` is the plan of a pack of {} tokens, the call has {tokens}",
                plan.len()
            ),
        ));
    }
    Ok(Some(plan))
}

/// What a backward call adds to its [`AttnCall`]: the forward's `o` and
/// `lse`, the output gradient `d_o`, and the gradients it writes.
struct AttnGrads {
    o: *const c_void,
    lse: *const c_void,
    d_o: *const c_void,
    dq: *mut c_void,
    dk: *mut c_void,
    dv: *mut c_void,
    /// The sinks' gradient (`[q_heads]`, q's type); null: not asked for.
    dsinks: *mut c_void,
}

impl AttnGrads {
    /// `Err(TREEATTN_ERR_NULL)` naming the first null pointer.
    fn check_null(&self) -> R<()> {
        for (what, p) in [
            ("o", self.o),
            ("lse", self.lse),
            ("d_o", self.d_o),
            ("dq", self.dq as _),
            ("dk", self.dk as _),
            ("dv", self.dv as _),
        ] {
            if p.is_null() {
                return Err(null(what));
            }
        }
        Ok(())
    }
}

impl<'a, T> Inputs<'a, T> {
    unsafe fn new(c: &AttnCall) -> R<Self> {
        let AttnCall {
            q,
            k,
            v,
            shape,
            kv_end,
            position_ids,
            mask,
            params,
        } = *c;
        // Validated (sizes > 0, no overflow) before any length is used.
        let shape = shape_of(shape)?;
        let params_ptr = params;
        let params = params_of(params, &shape)?;
        let nonnull = |what, p: *const u8| if p.is_null() { Err(null(what)) } else { Ok(()) };
        nonnull("q", q as _)?;
        nonnull("k", k as _)?;
        nonnull("v", v as _)?;
        let plan = call_plan(mask, shape.tokens)?;
        let (kv_end, pos) = match plan {
            Some(plan) => (plan.mask().kv_end(), plan.mask().position_ids()),
            None => {
                nonnull("kv_end", kv_end as _)?;
                nonnull("position_ids", position_ids as _)?;
                (
                    slice("kv_end", kv_end, shape.tokens)?,
                    slice("position_ids", position_ids, shape.tokens)?,
                )
            }
        };
        let sinks = sinks_of(params_ptr);
        Ok(Inputs {
            q: slice("q", q.cast::<T>(), shape.q_len())?,
            k: slice("k", k.cast::<T>(), shape.kv_len())?,
            v: slice("v", v.cast::<T>(), shape.v_len())?,
            kv_end,
            pos,
            sinks: if sinks.is_null() {
                None
            } else {
                Some(slice("sinks", sinks.cast::<T>(), shape.q_heads)?)
            },
            plan,
            shape,
            params,
        })
    }
    fn ranges(&self) -> Vec<(&'static str, usize, usize)> {
        let mut r = vec![
            range("q", self.q),
            range("k", self.k),
            range("v", self.v),
            range("kv_end", self.kv_end),
            range("position_ids", self.pos),
        ];
        if let Some(sinks) = self.sinks {
            r.push(range("sinks", sinks));
        }
        r
    }
    fn args(&self) -> R<AttnArgs<'a, treeattn::backend::Host, T>>
    where
        T: Element,
    {
        let mask = match self.plan {
            Some(plan) => plan.mask(),
            None => PackMask::new(self.kv_end, self.pos)?,
        };
        let args = AttnArgs::new(self.q, self.k, self.v, self.shape, mask, self.params)?;
        Ok(match self.sinks {
            Some(sinks) => args.with_sinks(sinks)?,
            None => args,
        })
    }
}

/// `Err(TREEATTN_ERR_UNSUPPORTED)` naming `dtype` unless `entry` takes it
/// (one of `takes`).
fn check_dtype(entry: &str, dtype: TreeattnDtype, takes: &[TreeattnDtype]) -> R<()> {
    if takes.contains(&dtype) {
        return Ok(());
    }
    let takes: Vec<&str> = takes.iter().filter_map(|&d| dtype_name(d)).collect();
    let what = match dtype_name(dtype) {
        Some(name) => name.to_string(),
        None => format!("{dtype} (not a TreeattnDtype)"),
    };
    Err(Fail(
        TREEATTN_ERR_UNSUPPORTED,
        format!(
            "{entry}: dtype {what} is not supported; it takes {}",
            takes.join(", ")
        ),
    ))
}

/// The name of a dtype constant, `None` for a value that is none of them.
fn dtype_name(dtype: TreeattnDtype) -> Option<&'static str> {
    Some(match dtype {
        TREEATTN_F32 => "TREEATTN_F32",
        TREEATTN_F64 => "TREEATTN_F64",
        TREEATTN_BF16 => "TREEATTN_BF16",
        TREEATTN_F16 => "TREEATTN_F16",
        _ => return None,
    })
}

/// The element types of the host SDCC entry (the CPU backend's compute
/// types).
const HOST_DTYPES: [TreeattnDtype; 2] = [TREEATTN_F32, TREEATTN_F64];
/// The element types of the host attention entries: the CPU backend's
/// compute types, and bf16 / f16 computed in f32.
const HOST_ATTENTION_DTYPES: [TreeattnDtype; 4] =
    [TREEATTN_F32, TREEATTN_F64, TREEATTN_BF16, TREEATTN_F16];

unsafe fn forward<T: CpuElement>(c: AttnCall, o: *mut c_void, lse: *mut c_void) -> R<()> {
    let inputs = Inputs::<T>::new(&c)?;
    let s = inputs.shape;
    if o.is_null() {
        return Err(null("o"));
    }
    if lse.is_null() {
        return Err(null("lse"));
    }
    let o = slice_mut("o", o.cast::<T>(), s.o_len())?;
    let lse = slice_mut("lse", lse.cast::<T::Compute>(), s.lse_len())?;
    no_overlap(&[range("o", o), range("lse", lse)], &inputs.ranges())?;
    let args = inputs.args()?;
    Cpu::default().forward(&args, o, lse)?;
    Ok(())
}

unsafe fn backward<T: CpuElement>(c: AttnCall, g: AttnGrads) -> R<()> {
    let inputs = Inputs::<T>::new(&c)?;
    let s = inputs.shape;
    g.check_null()?;
    let o = slice("o", g.o.cast::<T>(), s.o_len())?;
    let lse = slice("lse", g.lse.cast::<T::Compute>(), s.lse_len())?;
    let d_o = slice("d_o", g.d_o.cast::<T>(), s.o_len())?;
    let dq = slice_mut("dq", g.dq.cast::<T>(), s.q_len())?;
    let dk = slice_mut("dk", g.dk.cast::<T>(), s.kv_len())?;
    let dv = slice_mut("dv", g.dv.cast::<T>(), s.v_len())?;
    let dsinks = if g.dsinks.is_null() {
        None
    } else {
        Some(slice_mut("dsinks", g.dsinks.cast::<T>(), s.q_heads)?)
    };
    let mut ins = inputs.ranges();
    ins.extend([range("o", o), range("lse", lse), range("d_o", d_o)]);
    let mut outs = vec![range("dq", dq), range("dk", dk), range("dv", dv)];
    if let Some(ds) = &dsinks {
        outs.push(range("dsinks", ds));
    }
    no_overlap(&outs, &ins)?;
    let args = inputs.args()?;
    let grads = Grads { dq, dk, dv, dsinks };
    Cpu::default().backward(&args, Saved { o, lse }, d_o, grads)?;
    Ok(())
}

/// Tree attention forward on host memory, on the CPU backend. `dtype`
/// `TREEATTN_F32` (`float`) or `TREEATTN_F64` (`double`) is the type of
/// q, k, v, o and lse; `TREEATTN_BF16` or `TREEATTN_F16` (16-bit words) the
/// type of q, k, v and o, computed in f32 (each result rounded once), with
/// a `float` lse. q is `[tokens, q_heads, head_dim]`, k `[tokens,
/// kv_heads, head_dim]`, v `[tokens, kv_heads, v_head_dim]`. Writes `o`
/// (`[tokens, q_heads, v_head_dim]`) and `lse` (`[q_heads, tokens]`,
/// natural log; `-inf` for a row with no visible key, the sink's logit
/// with sinks). `kv_end` and `position_ids` have `tokens` entries (a pack's
/// arrays); `params` may be null (defaults): its `window`, `softcap` and
/// `sinks` select the attention variants (all computed on the CPU).
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn treeattn_attention_forward(
    dtype: TreeattnDtype,
    q: *const c_void,
    k: *const c_void,
    v: *const c_void,
    shape: TreeattnShape,
    kv_end: *const u32,
    position_ids: *const u32,
    params: *const TreeattnParams,
    o: *mut c_void,
    lse: *mut c_void,
) -> i32 {
    let c = AttnCall {
        q,
        k,
        v,
        shape,
        kv_end,
        position_ids,
        mask: std::ptr::null(),
        params,
    };
    host_forward("treeattn_attention_forward", dtype, c, o, lse)
}

/// [`treeattn_attention_forward`] with the pack's plan `mask` (from
/// [`treeattn_mask_plan_create`], of `shape.tokens` tokens) in place of its
/// `kv_end` and `position_ids`: the mask is not checked again.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn treeattn_attention_forward_mask(
    dtype: TreeattnDtype,
    q: *const c_void,
    k: *const c_void,
    v: *const c_void,
    shape: TreeattnShape,
    mask: *const TreeattnMaskPlan,
    params: *const TreeattnParams,
    o: *mut c_void,
    lse: *mut c_void,
) -> i32 {
    if mask.is_null() {
        return guard(|| Err(null("mask")));
    }
    let c = AttnCall {
        q,
        k,
        v,
        shape,
        kv_end: std::ptr::null(),
        position_ids: std::ptr::null(),
        mask,
        params,
    };
    host_forward("treeattn_attention_forward_mask", dtype, c, o, lse)
}

unsafe fn host_forward(
    entry: &str,
    dtype: TreeattnDtype,
    c: AttnCall,
    o: *mut c_void,
    lse: *mut c_void,
) -> i32 {
    guard(|| {
        check_dtype(entry, dtype, &HOST_ATTENTION_DTYPES)?;
        match dtype {
            TREEATTN_F32 => forward::<f32>(c, o, lse),
            TREEATTN_BF16 => forward::<treeattn::half::bf16>(c, o, lse),
            TREEATTN_F16 => forward::<treeattn::half::f16>(c, o, lse),
            _ => forward::<f64>(c, o, lse),
        }
    })
}

/// Tree attention backward on host memory, `dtype` `TREEATTN_F32` or
/// `TREEATTN_F64` (every buffer of that type), or `TREEATTN_BF16` or
/// `TREEATTN_F16` (every buffer but the `float` lse): from the forward's inputs
/// (same shape, mask and params), its `o` and `lse`, and the output
/// gradient `d_o` (like o), writes `dq` (like q), `dk` (like k), `dv`
/// (like v), with respect to the unrotated q and k, and with sinks in
/// `params` the sinks' gradient into `dsinks` (`q_heads` values of q's
/// type) unless it is null (which it must be without sinks).
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn treeattn_attention_backward(
    dtype: TreeattnDtype,
    q: *const c_void,
    k: *const c_void,
    v: *const c_void,
    shape: TreeattnShape,
    kv_end: *const u32,
    position_ids: *const u32,
    params: *const TreeattnParams,
    o: *const c_void,
    lse: *const c_void,
    d_o: *const c_void,
    dq: *mut c_void,
    dk: *mut c_void,
    dv: *mut c_void,
    dsinks: *mut c_void,
) -> i32 {
    let c = AttnCall {
        q,
        k,
        v,
        shape,
        kv_end,
        position_ids,
        mask: std::ptr::null(),
        params,
    };
    let g = AttnGrads {
        o,
        lse,
        d_o,
        dq,
        dk,
        dv,
        dsinks,
    };
    host_backward("treeattn_attention_backward", dtype, c, g)
}

/// [`treeattn_attention_backward`] with the pack's plan `mask` in place of
/// its `kv_end` and `position_ids` (as [`treeattn_attention_forward_mask`]).
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn treeattn_attention_backward_mask(
    dtype: TreeattnDtype,
    q: *const c_void,
    k: *const c_void,
    v: *const c_void,
    shape: TreeattnShape,
    mask: *const TreeattnMaskPlan,
    params: *const TreeattnParams,
    o: *const c_void,
    lse: *const c_void,
    d_o: *const c_void,
    dq: *mut c_void,
    dk: *mut c_void,
    dv: *mut c_void,
    dsinks: *mut c_void,
) -> i32 {
    if mask.is_null() {
        return guard(|| Err(null("mask")));
    }
    let c = AttnCall {
        q,
        k,
        v,
        shape,
        kv_end: std::ptr::null(),
        position_ids: std::ptr::null(),
        mask,
        params,
    };
    let g = AttnGrads {
        o,
        lse,
        d_o,
        dq,
        dk,
        dv,
        dsinks,
    };
    host_backward("treeattn_attention_backward_mask", dtype, c, g)
}

unsafe fn host_backward(entry: &str, dtype: TreeattnDtype, c: AttnCall, g: AttnGrads) -> i32 {
    guard(|| {
        check_dtype(entry, dtype, &HOST_ATTENTION_DTYPES)?;
        match dtype {
            TREEATTN_F32 => backward::<f32>(c, g),
            TREEATTN_BF16 => backward::<treeattn::half::bf16>(c, g),
            TREEATTN_F16 => backward::<treeattn::half::f16>(c, g),
            _ => backward::<f64>(c, g),
        }
    })
}

/// Builds the plan of a pack's mask ([`TreeattnMaskPlan`]) from its `kv_end`
/// and `position_ids` (`tokens` entries each, host memory, copied;
/// `position_ids` may be null: all zeros, for calls without rotary) into
/// `*out`. Errors: `TREEATTN_ERR_PACK` for a `kv_end` outside
/// `k <= kv_end[k] <= tokens` (the message names the key), null pointers.
#[no_mangle]
pub unsafe extern "C" fn treeattn_mask_plan_create(
    kv_end: *const u32,
    position_ids: *const u32,
    tokens: usize,
    out: *mut *mut TreeattnMaskPlan,
) -> i32 {
    guard(|| {
        if out.is_null() {
            return Err(null("out"));
        }
        *out = std::ptr::null_mut();
        if kv_end.is_null() && tokens > 0 {
            return Err(null("kv_end"));
        }
        let kv_end = slice("kv_end", kv_end, tokens)?;
        let zeros;
        let pos = if position_ids.is_null() {
            zeros = vec![0u32; tokens];
            &zeros[..]
        } else {
            slice("position_ids", position_ids, tokens)?
        };
        let plan = MaskPlan::new(kv_end, pos)?;
        *out = Box::into_raw(Box::new(TreeattnMaskPlan { plan }));
        Ok(())
    })
}

/// Frees a mask plan (null is allowed and does nothing). No call may be
/// using it, on the host or still queued on a device stream.
#[no_mangle]
pub unsafe extern "C" fn treeattn_mask_plan_destroy(mask: *mut TreeattnMaskPlan) {
    if !mask.is_null() {
        let _ = catch_unwind(AssertUnwindSafe(|| drop(Box::from_raw(mask))));
    }
}

/// The former name of [`TreeattnMaskPlan`], kept so that code written
/// against it keeps compiling.
pub type TreeattnMask = TreeattnMaskPlan;

/// The former name of [`treeattn_mask_plan_create`] (the same function).
#[no_mangle]
pub unsafe extern "C" fn treeattn_mask_create(
    kv_end: *const u32,
    position_ids: *const u32,
    tokens: usize,
    out: *mut *mut TreeattnMask,
) -> i32 {
    treeattn_mask_plan_create(kv_end, position_ids, tokens, out)
}

/// The former name of [`treeattn_mask_plan_destroy`] (the same function).
#[no_mangle]
pub unsafe extern "C" fn treeattn_mask_destroy(mask: *mut TreeattnMask) {
    treeattn_mask_plan_destroy(mask)
}

/// Writes the `kv_end` of a pre-order layout whose position ids are depths
/// (a treeattn pack, TRL's tree rows, a padding-free batch of sequences
/// whose positions restart at 0) into `kv_end` (`tokens` entries, host
/// memory): `kv_end[k]` is the first `j > k` with `position_ids[j] <=
/// position_ids[k]`, else `tokens` (`treeattn::mask::kv_end_from_positions`,
/// `O(tokens)`). Errors: `TREEATTN_ERR_PACK` for a first position that is
/// not 0 or a position that rises by more than 1 from one row to the next
/// (the message names the row; `kv_end` is then unspecified),
/// `TREEATTN_ERR_NULL`, `TREEATTN_ERR_SHAPE` for overlapping buffers.
#[no_mangle]
pub unsafe extern "C" fn treeattn_kv_end_from_positions(
    position_ids: *const u32,
    tokens: usize,
    kv_end: *mut u32,
) -> i32 {
    guard(|| {
        let pos = slice("position_ids", position_ids, tokens)?;
        let out = slice_mut("kv_end", kv_end, tokens)?;
        no_overlap(&[range("kv_end", out)], &[range("position_ids", pos)])?;
        let ends = treeattn::mask::kv_end_from_positions(pos)?;
        out.copy_from_slice(&ends);
        Ok(())
    })
}

/// The arguments of an SDCC call as C gives them, host or device logits
/// (`pairs`, `weights`, `loss` and `per_pair` are host memory either way).
struct SdccCall {
    student: *const c_void,
    student_rows: usize,
    teacher: *const c_void,
    teacher_rows: usize,
    vocab: usize,
    pairs: *const u32,
    weights: *const f32,
    n_pairs: usize,
    temperature: f32,
    grad_student: *mut c_void,
    loss: *mut TreeattnSdccLoss,
    per_pair: *mut f64,
}

/// The host arrays of an SDCC call, checked: the flat pairs (`2·n_pairs`),
/// the weights and, when given, `per_pair`.
struct SdccHost<'a> {
    flat: &'a [u32],
    weights: &'a [f32],
    per_pair: Option<&'a mut [f64]>,
}

impl SdccHost<'_> {
    /// The pairs as (student row, teacher row).
    fn pairs(&self) -> Vec<(u32, u32)> {
        self.flat.chunks_exact(2).map(|p| (p[0], p[1])).collect()
    }
}

impl SdccCall {
    /// The host arrays, checked (and `loss` not null).
    unsafe fn host<'a>(&self) -> R<SdccHost<'a>> {
        let n2 = self
            .n_pairs
            .checked_mul(2)
            .ok_or_else(|| Fail(TREEATTN_ERR_SHAPE, "n_pairs overflows".into()))?;
        if self.loss.is_null() {
            return Err(null("loss"));
        }
        Ok(SdccHost {
            flat: slice("pairs", self.pairs, n2)?,
            weights: slice("weights", self.weights, self.n_pairs)?,
            per_pair: if self.per_pair.is_null() {
                None
            } else {
                Some(slice_mut("per_pair", self.per_pair, self.n_pairs)?)
            },
        })
    }
}

unsafe fn sdcc<T: CpuFloat>(c: SdccCall) -> R<()> {
    let elems = |rows: usize, what: &str| {
        rows.checked_mul(c.vocab)
            .ok_or_else(|| Fail(TREEATTN_ERR_SHAPE, format!("{what}_rows · vocab overflows")))
    };
    let (ns, nt) = (
        elems(c.student_rows, "student")?,
        elems(c.teacher_rows, "teacher")?,
    );
    let h = c.host()?;
    let student = slice("student", c.student.cast::<T>(), ns)?;
    let teacher = slice("teacher", c.teacher.cast::<T>(), nt)?;
    let grad = slice_mut("grad_student", c.grad_student.cast::<T>(), ns)?;
    let mut outs = vec![range("grad_student", grad)];
    if let Some(p) = &h.per_pair {
        outs.push(range("per_pair", p));
    }
    let loss = c.loss as usize;
    outs.push(("loss", loss, loss + std::mem::size_of::<TreeattnSdccLoss>()));
    no_overlap(
        &outs,
        &[
            range("student", student),
            range("teacher", teacher),
            range("pairs", h.flat),
            range("weights", h.weights),
        ],
    )?;
    let pairs = h.pairs();
    let args = SdccArgs::new(student, teacher, c.vocab, &pairs, h.weights, c.temperature)?;
    let out = Cpu::default().sdcc_forward_kl(&args, grad)?;
    write_sdcc(&out, c.loss, h.per_pair);
    Ok(())
}

/// An SDCC result into the caller's `*loss` and, when given, `per_pair`
/// (checked non-null and of `n_pairs` entries by the caller).
unsafe fn write_sdcc(
    out: &treeattn::backend::SdccLoss,
    loss: *mut TreeattnSdccLoss,
    per_pair: Option<&mut [f64]>,
) {
    if let Some(p) = per_pair {
        p.copy_from_slice(&out.per_pair);
    }
    *loss = TreeattnSdccLoss {
        loss_sum: out.loss_sum,
        loss_mean: out.loss_mean,
    };
}

/// The fused SDCC forward KL on host memory. `dtype` `TREEATTN_F32` or
/// `TREEATTN_F64` is the type of the logits and the gradient: student
/// logits `[student_rows, vocab]`, teacher logits `[teacher_rows, vocab]`,
/// `n_pairs` pairs as `pairs[2i]` = student row, `pairs[2i + 1]` = teacher
/// row, one weight each, temperature `τ > 0`. Writes the gradient of
/// `Σ w · KL(teacher ‖ student)` with respect to the student logits into
/// `grad_student` (like the student; rows no pair names are 0), the loss
/// into `*loss`, and, when `per_pair` is not null, each pair's unweighted KL.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn treeattn_sdcc_forward_kl(
    dtype: TreeattnDtype,
    student: *const c_void,
    student_rows: usize,
    teacher: *const c_void,
    teacher_rows: usize,
    vocab: usize,
    pairs: *const u32,
    weights: *const f32,
    n_pairs: usize,
    temperature: f32,
    grad_student: *mut c_void,
    loss: *mut TreeattnSdccLoss,
    per_pair: *mut f64,
) -> i32 {
    let c = SdccCall {
        student,
        student_rows,
        teacher,
        teacher_rows,
        vocab,
        pairs,
        weights,
        n_pairs,
        temperature,
        grad_student,
        loss,
        per_pair,
    };
    guard(|| {
        check_dtype("treeattn_sdcc_forward_kl", dtype, &HOST_DTYPES)?;
        match dtype {
            TREEATTN_F32 => sdcc::<f32>(c),
            _ => sdcc::<f64>(c),
        }
    })
}

/// The message of a status code, for callers that print codes
/// (a static NUL-terminated string; never null).
#[no_mangle]
pub extern "C" fn treeattn_status_name(status: i32) -> *const c_char {
    let s: &CStr = match status {
        TREEATTN_OK => c"ok",
        TREEATTN_ERR_NULL => c"null pointer",
        TREEATTN_ERR_SHAPE => c"shape",
        TREEATTN_ERR_ROLLOUT => c"rollout",
        TREEATTN_ERR_PACK => c"pack",
        TREEATTN_ERR_UNSUPPORTED => c"unsupported",
        TREEATTN_ERR_NON_FINITE => c"non-finite",
        TREEATTN_ERR_CUDA => c"cuda",
        TREEATTN_ERR_OTHER => c"other",
        TREEATTN_ERR_PANIC => c"panic",
        _ => c"unknown status",
    };
    s.as_ptr()
}
