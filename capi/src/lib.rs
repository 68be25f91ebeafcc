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

use treeattn::backend::cpu::{self, Cpu};
use treeattn::backend::{AttnParams, AttnShape, Rope};
use treeattn::ffi;
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
            Error::Null(_) => TREEATTN_ERR_NULL,
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

/// `len` elements at `p`: null only with `len == 0`, aligned for `T`
/// ([`ffi::host_slice`]).
unsafe fn slice<'a, T>(what: &str, p: *const T, len: usize) -> R<&'a [T]> {
    Ok(ffi::host_slice(what, p as usize, len)?)
}

/// As [`slice()`], writable ([`ffi::host_slice_mut`]).
unsafe fn slice_mut<'a, T>(what: &str, p: *mut T, len: usize) -> R<&'a mut [T]> {
    Ok(ffi::host_slice_mut(what, p as usize, len)?)
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

/// A [`TreeattnDtype`] as the crate's [`ffi::Dtype`]; a value that is none
/// of the constants is `TREEATTN_ERR_UNSUPPORTED`.
fn dtype_of(dtype: TreeattnDtype) -> R<ffi::Dtype> {
    Ok(match dtype {
        TREEATTN_F32 => ffi::Dtype::F32,
        TREEATTN_F64 => ffi::Dtype::F64,
        TREEATTN_BF16 => ffi::Dtype::Bf16,
        TREEATTN_F16 => ffi::Dtype::F16,
        other => {
            return Err(Fail(
                TREEATTN_ERR_UNSUPPORTED,
                format!(
                    "dtype {other} is not a TreeattnDtype (TREEATTN_F32, TREEATTN_F64, \
                     TREEATTN_BF16 or TREEATTN_F16)"
                ),
            ))
        }
    })
}

/// The inputs of an attention call as C gives them: q, k, v on the host or
/// the device (by entry), the pack's arrays or plan and the params on the
/// host.
#[derive(Clone, Copy)]
struct AttnCall {
    dtype: TreeattnDtype,
    q: *const c_void,
    k: *const c_void,
    v: *const c_void,
    shape: TreeattnShape,
    kv_end: *const u32,
    position_ids: *const u32,
    mask: *const TreeattnMaskPlan,
    params: *const TreeattnParams,
}

impl AttnCall {
    /// The call as the crate's raw layer takes it: shape and params
    /// validated, the mask the plan (then `kv_end` and `position_ids` must
    /// be null) or the arrays, the sinks from the params.
    unsafe fn raw<'a>(&self) -> R<ffi::RawAttention<'a>> {
        let shape = shape_of(self.shape)?;
        let params = params_of(self.params, &shape)?;
        let mask = match self.mask.as_ref() {
            None => ffi::RawMask::Arrays {
                kv_end: self.kv_end as usize,
                position_ids: self.position_ids as usize,
            },
            Some(_) if !self.kv_end.is_null() || !self.position_ids.is_null() => {
                return Err(Fail(
                    TREEATTN_ERR_PACK,
                    "both a mask plan and kv_end / position_ids were given: pass the plan \
                     with null arrays, or the arrays with a null plan"
                        .into(),
                ))
            }
            Some(m) => ffi::RawMask::Plan(&m.plan),
        };
        Ok(ffi::RawAttention {
            dtype: dtype_of(self.dtype)?,
            q: self.q as usize,
            k: self.k as usize,
            v: self.v as usize,
            mask,
            sinks: self.params.as_ref().map_or(0, |p| p.sinks as usize),
            key_starts: 0,
            shape,
            params,
        })
    }
}

/// The buffers a backward call adds: the forward's `o` and `lse`, the
/// output gradient `d_o`, and the gradients it writes (`dsinks` may be
/// null: not asked for).
fn raw_grads(
    o: *const c_void,
    lse: *const c_void,
    d_o: *const c_void,
    dq: *mut c_void,
    dk: *mut c_void,
    dv: *mut c_void,
    dsinks: *mut c_void,
) -> ffi::RawGrads {
    ffi::RawGrads {
        o: o as usize,
        lse: lse as usize,
        d_o: d_o as usize,
        dq: dq as usize,
        dk: dk as usize,
        dv: dv as usize,
        dsinks: dsinks as usize,
    }
}

/// Tree attention forward on host memory, on the CPU backend. `dtype`
/// `TREEATTN_F32` (`float`) or `TREEATTN_F64` (`double`) is the type of
/// q, k, v, o and lse; `TREEATTN_BF16` or `TREEATTN_F16` (16-bit words) the
/// type of q, k, v and o, computed in f32 (each result rounded once), with
/// a `float` lse. q is `[tokens, q_heads, head_dim]`, k `[tokens,
/// kv_heads, head_dim]`, v `[tokens, kv_heads, v_head_dim]`. Writes `o`
/// (`[tokens, q_heads, v_head_dim]`) and `lse` (`[q_heads, tokens]`,
/// natural log; `-inf` for a row with no visible key, the sink's logit
/// with sinks).
///
/// The mask is the pack's `kv_end` and `position_ids` (`tokens` entries
/// each, host memory, checked per call) with a null `mask`, or the pack's
/// plan `mask` (from [`treeattn_mask_plan_create`], of `shape.tokens`
/// tokens: not checked again) with null `kv_end` and `position_ids`.
/// `params` may be null (defaults): its `window`, `softcap` and `sinks`
/// select the attention variants (all computed on the CPU).
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
    mask: *const TreeattnMaskPlan,
    params: *const TreeattnParams,
    o: *mut c_void,
    lse: *mut c_void,
) -> i32 {
    let c = AttnCall {
        dtype,
        q,
        k,
        v,
        shape,
        kv_end,
        position_ids,
        mask,
        params,
    };
    guard(|| {
        let a = c.raw()?;
        ffi::attention_forward(&Cpu::default(), &a, o as usize, lse as usize)?;
        Ok(())
    })
}

/// Tree attention backward on host memory, `dtype` `TREEATTN_F32` or
/// `TREEATTN_F64` (every buffer of that type), or `TREEATTN_BF16` or
/// `TREEATTN_F16` (every buffer but the `float` lse): from the forward's
/// inputs (same shape, mask and params), its `o` and `lse`, and the output
/// gradient `d_o` (like o), writes `dq` (like q), `dk` (like k), `dv`
/// (like v), with respect to the unrotated q and k, and with sinks in
/// `params` the sinks' gradient into `dsinks` (`q_heads` values of q's
/// type) unless it is null (which it must be without sinks). The mask is
/// given as for [`treeattn_attention_forward`].
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
    let c = AttnCall {
        dtype,
        q,
        k,
        v,
        shape,
        kv_end,
        position_ids,
        mask,
        params,
    };
    let g = raw_grads(o, lse, d_o, dq, dk, dv, dsinks);
    guard(|| {
        let a = c.raw()?;
        ffi::attention_backward(&Cpu::default(), &a, &g)?;
        Ok(())
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
        ffi::check_no_overlap(("kv_end", &*out), ("position_ids", pos))?;
        let ends = treeattn::mask::kv_end_from_positions(pos)?;
        out.copy_from_slice(&ends);
        Ok(())
    })
}

/// The arguments of an SDCC call as C gives them, host or device logits
/// (`pairs`, `weights`, `loss` and `per_pair` are host memory either way).
struct SdccCall {
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
}

impl SdccCall {
    /// The call as the crate's raw layer takes it (`loss` checked not
    /// null first: nothing runs when the result has nowhere to go).
    fn raw(&self) -> R<ffi::RawSdcc> {
        if self.loss.is_null() {
            return Err(null("loss"));
        }
        Ok(ffi::RawSdcc {
            dtype: dtype_of(self.dtype)?,
            student: self.student as usize,
            student_rows: self.student_rows,
            teacher: self.teacher as usize,
            teacher_rows: self.teacher_rows,
            vocab: self.vocab,
            pairs: ffi::RawPairs::Interleaved(self.pairs as usize),
            n_pairs: self.n_pairs,
            weights: self.weights as usize,
            temperature: self.temperature,
        })
    }

    /// An SDCC result into the caller's `*loss` and, when not null,
    /// `per_pair` (`n_pairs` entries).
    unsafe fn write(&self, out: &treeattn::backend::SdccLoss) -> R<()> {
        if !self.per_pair.is_null() {
            slice_mut("per_pair", self.per_pair, self.n_pairs)?.copy_from_slice(&out.per_pair);
        }
        *self.loss = TreeattnSdccLoss {
            loss_sum: out.loss_sum,
            loss_mean: out.loss_mean,
        };
        Ok(())
    }
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
        dtype,
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
        let out = ffi::sdcc_forward_kl(&Cpu::default(), &c.raw()?, c.grad_student as usize)?;
        c.write(&out)
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
