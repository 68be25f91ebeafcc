//! Entries on device memory and the host's stream: bf16 / f16 attention,
//! SDCC on bf16 / f16 / f32 logits. The symbols exist in every build; a
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
//! there, `8·tokens` bytes and one small kernel per call); every other
//! buffer is device memory of that context. Attention and its backward
//! return once the work is enqueued; SDCC waits for the stream once to read
//! the per-pair KL.

use std::ffi::c_void;

use crate::{guard, Fail, TreeattnParams, TreeattnSdccLoss, TreeattnShape};
#[cfg(feature = "cuda")]
use crate::{null, params_of, shape_of, slice};

/// Treeattn was built without the `cuda` feature.
#[cfg(not(feature = "cuda"))]
fn no_cuda(what: &str) -> Fail {
    Fail(
        crate::TREEATTN_ERR_UNSUPPORTED,
        format!(
            "{what}: this treeattn library was built without CUDA \
             (build it with `cargo build --release -p treeattn-capi --features cuda`)"
        ),
    )
}

/// The pointers and sizes of one device attention call, as C gives them.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct DeviceCall {
    device: i32,
    stream: *mut c_void,
    q: *const c_void,
    k: *const c_void,
    v: *const c_void,
    shape: TreeattnShape,
    kv_end: *const u32,
    position_ids: *const u32,
    params: *const TreeattnParams,
}

/// Kernels of `device` on `stream`, the validated call and the pack uploaded
/// there, then `f`.
#[cfg(feature = "cuda")]
unsafe fn with_device_call(
    c: &DeviceCall,
    f: impl FnOnce(
        &treeattn::backend::cuda::CudaBackend,
        &treeattn::backend::cuda::DevicePack,
        treeattn::backend::cuda::host::RawAttention,
    ) -> treeattn::Result<()>,
) -> crate::R<()> {
    use treeattn::backend::cuda::host;
    use treeattn::mask::PackMask;
    let shape = shape_of(c.shape)?;
    let params = params_of(c.params, &shape)?;
    for (what, p) in [("q", c.q), ("k", c.k), ("v", c.v)] {
        if p.is_null() {
            return Err(null(what));
        }
    }
    let kv_end = slice("kv_end", c.kv_end, shape.tokens)?;
    let pos = slice("position_ids", c.position_ids, shape.tokens)?;
    let mask = PackMask::new(kv_end, pos)?;
    let ordinal = usize::try_from(c.device).map_err(|_| {
        Fail(
            crate::TREEATTN_ERR_SHAPE,
            format!("device {} is not a device ordinal", c.device),
        )
    })?;
    let kernels = host::primary(ordinal)?;
    let be = host::on_raw_stream(&kernels, c.stream.cast())?;
    let pack = be.upload_pack(mask)?;
    let call = host::RawAttention {
        q: c.q as u64,
        k: c.k as u64,
        v: c.v as u64,
        shape,
        params,
    };
    f(&be, &pack, call)?;
    Ok(())
}

#[cfg(feature = "cuda")]
unsafe fn forward<T>(c: DeviceCall, o: *mut c_void, lse: *mut f32) -> i32
where
    T: treeattn::backend::launch::KernelElem + treeattn::backend::cuda::cudarc::driver::DeviceRepr,
{
    guard(|| {
        if o.is_null() {
            return Err(null("o"));
        }
        if lse.is_null() {
            return Err(null("lse"));
        }
        with_device_call(&c, |be, pack, call| {
            be.forward_raw::<T>(pack, call, o as u64, lse as u64)
        })
    })
}

#[cfg(feature = "cuda")]
#[allow(clippy::too_many_arguments)]
unsafe fn backward<T>(
    c: DeviceCall,
    o: *const c_void,
    lse: *const f32,
    d_o: *const c_void,
    dq: *mut c_void,
    dk: *mut c_void,
    dv: *mut c_void,
) -> i32
where
    T: treeattn::backend::launch::KernelElem + treeattn::backend::cuda::cudarc::driver::DeviceRepr,
{
    guard(|| {
        for (what, p) in [
            ("o", o as *const u8),
            ("lse", lse as _),
            ("d_o", d_o as _),
            ("dq", dq as _),
            ("dk", dk as _),
            ("dv", dv as _),
        ] {
            if p.is_null() {
                return Err(null(what));
            }
        }
        with_device_call(&c, |be, pack, call| {
            be.backward_raw::<T>(
                pack, call, o as u64, lse as u64, d_o as u64, dq as u64, dk as u64, dv as u64,
            )
        })
    })
}

/// Tree attention forward on device memory, `__nv_bfloat16` elements
/// (passed as `void *`): q `[tokens, q_heads, head_dim]`, k and v
/// `[tokens, kv_heads, head_dim]`; writes `o` (like q, bf16) and `lse`
/// (`[q_heads, tokens]`, `float`, natural log, `-inf` for a row with no
/// visible key). Head dim 64 or 128. `kv_end` and `position_ids` are the
/// pack's host arrays (`tokens` entries); `params` may be null (defaults).
/// Enqueued on `stream` of device `device`; see the module notes.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn treeattn_cuda_attention_forward_bf16(
    device: i32,
    stream: *mut c_void,
    q: *const c_void,
    k: *const c_void,
    v: *const c_void,
    shape: TreeattnShape,
    kv_end: *const u32,
    position_ids: *const u32,
    params: *const TreeattnParams,
    o: *mut c_void,
    lse: *mut f32,
) -> i32 {
    let c = DeviceCall {
        device,
        stream,
        q,
        k,
        v,
        shape,
        kv_end,
        position_ids,
        params,
    };
    #[cfg(feature = "cuda")]
    return forward::<treeattn::half::bf16>(c, o, lse);
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (c, o, lse);
        guard(|| Err(no_cuda("treeattn_cuda_attention_forward_bf16")))
    }
}

/// As [`treeattn_cuda_attention_forward_bf16`], `__half` elements.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn treeattn_cuda_attention_forward_f16(
    device: i32,
    stream: *mut c_void,
    q: *const c_void,
    k: *const c_void,
    v: *const c_void,
    shape: TreeattnShape,
    kv_end: *const u32,
    position_ids: *const u32,
    params: *const TreeattnParams,
    o: *mut c_void,
    lse: *mut f32,
) -> i32 {
    let c = DeviceCall {
        device,
        stream,
        q,
        k,
        v,
        shape,
        kv_end,
        position_ids,
        params,
    };
    #[cfg(feature = "cuda")]
    return forward::<treeattn::half::f16>(c, o, lse);
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (c, o, lse);
        guard(|| Err(no_cuda("treeattn_cuda_attention_forward_f16")))
    }
}

/// Tree attention backward on device memory, `__nv_bfloat16`: from the
/// forward's inputs (same shape, pack and params), its `o` and `lse`
/// (`float`) and the output gradient `d_o` (like q), writes `dq` (like q),
/// `dk`, `dv` (like k), with respect to the unrotated q and k. Scratch
/// (`4 · tokens · q_heads · (head_dim + 1)` bytes) is allocated and freed
/// on `stream`.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn treeattn_cuda_attention_backward_bf16(
    device: i32,
    stream: *mut c_void,
    q: *const c_void,
    k: *const c_void,
    v: *const c_void,
    shape: TreeattnShape,
    kv_end: *const u32,
    position_ids: *const u32,
    params: *const TreeattnParams,
    o: *const c_void,
    lse: *const f32,
    d_o: *const c_void,
    dq: *mut c_void,
    dk: *mut c_void,
    dv: *mut c_void,
) -> i32 {
    let c = DeviceCall {
        device,
        stream,
        q,
        k,
        v,
        shape,
        kv_end,
        position_ids,
        params,
    };
    #[cfg(feature = "cuda")]
    return backward::<treeattn::half::bf16>(c, o, lse, d_o, dq, dk, dv);
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (c, o, lse, d_o, dq, dk, dv);
        guard(|| Err(no_cuda("treeattn_cuda_attention_backward_bf16")))
    }
}

/// As [`treeattn_cuda_attention_backward_bf16`], `__half` elements.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn treeattn_cuda_attention_backward_f16(
    device: i32,
    stream: *mut c_void,
    q: *const c_void,
    k: *const c_void,
    v: *const c_void,
    shape: TreeattnShape,
    kv_end: *const u32,
    position_ids: *const u32,
    params: *const TreeattnParams,
    o: *const c_void,
    lse: *const f32,
    d_o: *const c_void,
    dq: *mut c_void,
    dk: *mut c_void,
    dv: *mut c_void,
) -> i32 {
    let c = DeviceCall {
        device,
        stream,
        q,
        k,
        v,
        shape,
        kv_end,
        position_ids,
        params,
    };
    #[cfg(feature = "cuda")]
    return backward::<treeattn::half::f16>(c, o, lse, d_o, dq, dk, dv);
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (c, o, lse, d_o, dq, dk, dv);
        guard(|| Err(no_cuda("treeattn_cuda_attention_backward_f16")))
    }
}

/// The logits of one device SDCC call, as C gives them.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct DeviceSdcc {
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
}

#[cfg(feature = "cuda")]
unsafe fn sdcc<T>(c: DeviceSdcc) -> i32
where
    T: treeattn::backend::launch::sdcc::SdccElem
        + treeattn::backend::cuda::cudarc::driver::DeviceRepr,
{
    use treeattn::backend::cuda::host;
    guard(|| {
        for (what, p) in [
            ("student", c.student as *const u8),
            ("teacher", c.teacher as _),
            ("grad_student", c.grad_student as _),
            ("loss", c.loss as _),
        ] {
            if p.is_null() {
                return Err(null(what));
            }
        }
        let n2 = c
            .n_pairs
            .checked_mul(2)
            .ok_or_else(|| Fail(crate::TREEATTN_ERR_SHAPE, "n_pairs overflows".into()))?;
        let flat = slice("pairs", c.pairs, n2)?;
        let weights = slice("weights", c.weights, c.n_pairs)?;
        let per = if c.per_pair.is_null() {
            None
        } else {
            Some(crate::slice_mut("per_pair", c.per_pair, c.n_pairs)?)
        };
        let pairs: Vec<(u32, u32)> = flat.chunks_exact(2).map(|p| (p[0], p[1])).collect();
        let ordinal = usize::try_from(c.device).map_err(|_| {
            Fail(
                crate::TREEATTN_ERR_SHAPE,
                format!("device {} is not a device ordinal", c.device),
            )
        })?;
        let kernels = host::primary(ordinal)?;
        let be = host::on_raw_stream(&kernels, c.stream.cast())?;
        let out = be.sdcc_raw::<T>(
            c.student as u64,
            c.student_rows,
            c.teacher as u64,
            c.teacher_rows,
            c.vocab,
            &pairs,
            weights,
            c.temperature,
            c.grad_student as u64,
        )?;
        crate::write_sdcc(&out, c.loss, per);
        Ok(())
    })
}

/// The fused SDCC forward KL on device logits, `__nv_bfloat16`: student
/// `[student_rows, vocab]` and teacher `[teacher_rows, vocab]` (device;
/// they may be one buffer), `pairs` (`2·n_pairs`: student row, teacher
/// row) and `weights` on the host; writes the `float` gradient of
/// `Σ w · KL(teacher ‖ student)` with respect to the student logits into
/// the device buffer `grad_student` (like the student; rows no pair names
/// are 0), the loss into `*loss` and, when `per_pair` (host) is not null,
/// each pair's unweighted KL. Waits for `stream` once.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn treeattn_cuda_sdcc_forward_kl_bf16(
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
    let c = DeviceSdcc {
        device,
        stream,
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
    #[cfg(feature = "cuda")]
    return sdcc::<treeattn::half::bf16>(c);
    #[cfg(not(feature = "cuda"))]
    {
        let _ = c;
        guard(|| Err(no_cuda("treeattn_cuda_sdcc_forward_kl_bf16")))
    }
}

/// As [`treeattn_cuda_sdcc_forward_kl_bf16`], `__half` logits.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn treeattn_cuda_sdcc_forward_kl_f16(
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
    let c = DeviceSdcc {
        device,
        stream,
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
    #[cfg(feature = "cuda")]
    return sdcc::<treeattn::half::f16>(c);
    #[cfg(not(feature = "cuda"))]
    {
        let _ = c;
        guard(|| Err(no_cuda("treeattn_cuda_sdcc_forward_kl_f16")))
    }
}

/// As [`treeattn_cuda_sdcc_forward_kl_bf16`], `float` logits.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn treeattn_cuda_sdcc_forward_kl_f32(
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
    let c = DeviceSdcc {
        device,
        stream,
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
    #[cfg(feature = "cuda")]
    return sdcc::<f32>(c);
    #[cfg(not(feature = "cuda"))]
    {
        let _ = c;
        guard(|| Err(no_cuda("treeattn_cuda_sdcc_forward_kl_f32")))
    }
}
