//! Entries on device memory and the host's stream: attention on
//! `TREEATTN_BF16` / `TREEATTN_F16` elements, SDCC on `TREEATTN_BF16` /
//! `TREEATTN_F16` / `TREEATTN_F32` logits. The symbols exist in every build; a
//! library built without the `cuda` feature returns
//! `TREEATTN_ERR_UNSUPPORTED` saying so, one built with it but run where
//! there is no driver or device returns `TREEATTN_ERR_CUDA`.
//!
//! Each call takes the device ordinal and a `cudaStream_t` / `CUstream`
//! (null: the legacy default stream) and enqueues its kernels there; it
//! creates no context (the kernels are loaded once per process into the
//! device's primary context, the one the CUDA runtime uses) and no stream.
//! The pack's `kv_end` and `position_ids` are host arrays (checked on the
//! host, then uploaded on the stream with the key-tile bounds computed
//! there, `8·tokens` bytes and one small kernel per call) or a mask plan
//! (uploaded by its first device call, then reused); every other buffer,
//! `params.sinks` and `dsinks` included, is device memory of that context.
//! Attention and its backward return once the work is enqueued; SDCC waits
//! for the stream once to read the per-pair KL.
//!
//! Each entry turns its arguments into the crate's raw call
//! (`treeattn::ffi`) and runs `treeattn::ffi::cuda_*`: the checks, the
//! dtype dispatch and the mask plan are the crate's, as for the host
//! entries.

use std::ffi::c_void;

use treeattn::ffi;

use crate::{
    guard, raw_grads, AttnCall, Fail, SdccCall, TreeattnDtype, TreeattnMaskPlan, TreeattnParams,
    TreeattnSdccLoss, TreeattnShape, R,
};

/// The device ordinal `device` as the crate takes it.
#[cfg(feature = "cuda")]
fn ordinal(device: i32) -> R<usize> {
    usize::try_from(device).map_err(|_| {
        Fail(
            crate::TREEATTN_ERR_SHAPE,
            format!("device {device} is not a device ordinal"),
        )
    })
}

/// `Err` for a dtype `takes` does not hold (as the crate's entries check
/// it first, so a library without CUDA answers in the same order), then
/// `Err(TREEATTN_ERR_UNSUPPORTED)`: this library was built without the
/// `cuda` feature.
#[cfg(not(feature = "cuda"))]
fn no_cuda(entry: &str, what: &str, dtype: TreeattnDtype, takes: &[ffi::Dtype]) -> R<()> {
    ffi::check_dtype(what, crate::dtype_of(dtype)?, takes)?;
    Err(Fail(
        crate::TREEATTN_ERR_UNSUPPORTED,
        format!(
            "{entry}: this treeattn library was built without CUDA \
             (build it with `cargo build --release -p treeattn-capi --features cuda`)"
        ),
    ))
}

/// Tree attention forward on device memory. `dtype` `TREEATTN_BF16`
/// (`__nv_bfloat16`) or `TREEATTN_F16` (`__half`) is the element type of
/// q `[tokens, q_heads, head_dim]`, k and v `[tokens, kv_heads, head_dim]`
/// and `o` (like q); `lse` (`[q_heads, tokens]`) is `float`, natural log,
/// `-inf` for a row with no visible key. Head dim 64 or 128. The mask is
/// the pack's host arrays `kv_end` and `position_ids` (`tokens` entries)
/// with a null `mask`, or its plan `mask` (from
/// `treeattn_mask_plan_create`, of `shape.tokens` tokens) with null arrays:
/// the plan is uploaded to `device` by its first device call (on that
/// call's stream) and reused by every later one — no host-to-device copy,
/// no synchronization. `params` may be null (defaults); its window and
/// softcap run on the kernels, and its `sinks`, when not null, are a
/// device buffer (`q_heads` values of q's type). Enqueued on `stream` of
/// device `device`; see the module notes.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn treeattn_cuda_attention_forward(
    dtype: TreeattnDtype,
    device: i32,
    stream: *mut c_void,
    q: *const c_void,
    k: *const c_void,
    v: *const c_void,
    shape: TreeattnShape,
    kv_end: *const u32,
    position_ids: *const u32,
    mask: *const TreeattnMaskPlan,
    params: *const TreeattnParams,
    o: *mut c_void,
    lse: *mut f32,
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
        #[cfg(feature = "cuda")]
        {
            let a = c.raw()?;
            let (device, stream) = (ordinal(device)?, stream as usize);
            ffi::cuda_attention_forward(device, stream, &a, o as usize, lse as usize)?;
            Ok(())
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (device, stream, c, o, lse);
            no_cuda(
                "treeattn_cuda_attention_forward",
                "CUDA attention",
                dtype,
                ffi::CUDA_ATTENTION_DTYPES,
            )
        }
    })
}

/// Tree attention backward on device memory, `dtype` `TREEATTN_BF16` or
/// `TREEATTN_F16` as for the forward: from the forward's inputs (same
/// shape, mask and params), its `o` and `lse` (`float`) and the output
/// gradient `d_o` (like q), writes `dq` (like q), `dk`, `dv` (like k), with
/// respect to the unrotated q and k, and with sinks in `params` (device,
/// `q_heads` values of q's type) their gradient into the device buffer
/// `dsinks` (`q_heads` values of q's type) unless it is null (which it
/// must be without sinks). Scratch (`4 · tokens · q_heads · (head_dim +
/// 1)` bytes) is allocated and freed on `stream`. The kernels compute a
/// window, a softcap and sinks; a `v_head_dim` unlike `head_dim` is
/// `TREEATTN_ERR_UNSUPPORTED` (the host entries compute it). dQ is summed
/// with atomic adds unless `params->deterministic` is 1 (then by the
/// deterministic kernel: bit-identical from run to run); dK, dV and
/// `dsinks` are deterministic either way.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn treeattn_cuda_attention_backward(
    dtype: TreeattnDtype,
    device: i32,
    stream: *mut c_void,
    q: *const c_void,
    k: *const c_void,
    v: *const c_void,
    shape: TreeattnShape,
    kv_end: *const u32,
    position_ids: *const u32,
    mask: *const TreeattnMaskPlan,
    params: *const TreeattnParams,
    o: *const c_void,
    lse: *const f32,
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
    let g = raw_grads(o, lse.cast(), d_o, dq, dk, dv, dsinks);
    guard(|| {
        #[cfg(feature = "cuda")]
        {
            use treeattn::backend::cuda::DqMode;
            let a = c.raw()?;
            let mode = match crate::deterministic_of(params)? {
                true => DqMode::Deterministic,
                false => DqMode::Atomic,
            };
            let (device, stream) = (ordinal(device)?, stream as usize);
            ffi::cuda_attention_backward(device, stream, &a, &g, mode)?;
            Ok(())
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (device, stream, c, g);
            no_cuda(
                "treeattn_cuda_attention_backward",
                "CUDA attention",
                dtype,
                ffi::CUDA_ATTENTION_DTYPES,
            )
        }
    })
}

/// The fused SDCC forward KL on device logits. `dtype` `TREEATTN_BF16`,
/// `TREEATTN_F16` or `TREEATTN_F32` is the element type of the student
/// `[student_rows, vocab]` and teacher `[teacher_rows, vocab]` logits
/// (device; they may be one buffer); `pairs` (`2·n_pairs`: student row,
/// teacher row) and `weights` are on the host. Writes the `float` gradient
/// of `Σ w · KL(teacher ‖ student)` with respect to the student logits into
/// the device buffer `grad_student` (like the student; rows no pair names
/// are 0), the loss into `*loss` and, when `per_pair` (host) is not null,
/// each pair's unweighted KL. Waits for `stream` once.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn treeattn_cuda_sdcc_forward_kl(
    dtype: TreeattnDtype,
    device: i32,
    stream: *mut c_void,
    student: *const c_void,
    student_rows: usize,
    teacher: *const c_void,
    teacher_rows: usize,
    vocab: usize,
    pairs: *const u32,
    weights: *const f32,
    n_pairs: usize,
    temperature: f32,
    grad_student: *mut f32,
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
        grad_student: grad_student.cast(),
        loss,
        per_pair,
    };
    guard(|| {
        #[cfg(feature = "cuda")]
        {
            let raw = c.raw()?;
            let (device, stream) = (ordinal(device)?, stream as usize);
            let out = ffi::cuda_sdcc_forward_kl(device, stream, &raw, c.grad_student as usize)?;
            c.write(&out)
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (device, stream, c);
            no_cuda(
                "treeattn_cuda_sdcc_forward_kl",
                "CUDA SDCC",
                dtype,
                ffi::CUDA_SDCC_DTYPES,
            )
        }
    })
}
