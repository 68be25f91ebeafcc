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
//! there, `8·tokens` bytes and one small kernel per call); every other
//! buffer, `params.sinks` and `dsinks` included, is device memory of that
//! context. Attention and its backward
//! return once the work is enqueued; SDCC waits for the stream once to read
//! the per-pair KL.

use std::ffi::c_void;

use crate::{
    check_dtype, guard, AttnCall, AttnGrads, Fail, TreeattnDtype, TreeattnMaskPlan, TreeattnParams,
};
#[cfg(feature = "cuda")]
use crate::{null, params_of, shape_of, slice};
use crate::{TreeattnSdccLoss, TreeattnShape, TREEATTN_BF16, TREEATTN_F16, TREEATTN_F32};

/// The element types of the device attention entries (the kernels').
const ATTENTION_DTYPES: [TreeattnDtype; 2] = [TREEATTN_BF16, TREEATTN_F16];
/// The logits' element types of the device SDCC entry.
const SDCC_DTYPES: [TreeattnDtype; 3] = [TREEATTN_BF16, TREEATTN_F16, TREEATTN_F32];

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

/// Kernels of `device` on `stream` (checked as an ordinal).
///
/// Safety: `stream` is null or a live stream of `device`'s primary context
/// (what the entries' callers promise).
#[cfg(feature = "cuda")]
unsafe fn device_backend(
    device: i32,
    stream: *mut c_void,
) -> crate::R<treeattn::backend::cuda::CudaBackend> {
    use treeattn::backend::cuda::host;
    let ordinal = usize::try_from(device).map_err(|_| {
        Fail(
            crate::TREEATTN_ERR_SHAPE,
            format!("device {device} is not a device ordinal"),
        )
    })?;
    let kernels = host::primary(ordinal)?;
    Ok(host::on_raw_stream(&kernels, stream.cast())?)
}

/// Kernels of `device` on `stream`, the validated call and the pack uploaded
/// there, then `f`.
#[cfg(feature = "cuda")]
unsafe fn with_device_call(
    device: i32,
    stream: *mut c_void,
    c: &AttnCall,
    f: impl FnOnce(
        &treeattn::backend::cuda::CudaBackend,
        &treeattn::backend::cuda::DevicePack,
        treeattn::backend::cuda::host::RawAttention<'_>,
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
    let plan = crate::call_plan(c.mask, shape.tokens)?;
    let be = device_backend(device, stream)?;
    // With a plan: its device copy (uploaded by its first call on this
    // device, then shared: no copy, no synchronization). Without: the
    // arrays checked and uploaded per call.
    let pack = match plan {
        Some(plan) => plan.on_device(&be)?,
        None => {
            let kv_end = slice("kv_end", c.kv_end, shape.tokens)?;
            let pos = slice("position_ids", c.position_ids, shape.tokens)?;
            std::sync::Arc::new(be.upload_pack(PackMask::new(kv_end, pos)?)?)
        }
    };
    // The sinks (device, `[q_heads]` of q's type) go to the contract as
    // they are; the C params have no explicit key starts.
    let call = host::RawAttention {
        q: c.q as u64,
        k: c.k as u64,
        v: c.v as u64,
        sinks: crate::sinks_of(c.params) as u64,
        key_starts: None,
        shape,
        params,
    };
    f(&be, &pack, call)?;
    Ok(())
}

#[cfg(feature = "cuda")]
unsafe fn forward<T>(
    device: i32,
    stream: *mut c_void,
    c: AttnCall,
    o: *mut c_void,
    lse: *mut f32,
) -> crate::R<()>
where
    T: treeattn::backend::launch::KernelElem + treeattn::backend::cuda::cudarc::driver::DeviceRepr,
{
    if o.is_null() {
        return Err(null("o"));
    }
    if lse.is_null() {
        return Err(null("lse"));
    }
    with_device_call(device, stream, &c, |be, pack, call| {
        be.forward_raw::<T>(pack, call, o as u64, lse as u64)
    })
}

/// `g.lse` is `float` here, whatever the element type.
#[cfg(feature = "cuda")]
unsafe fn backward<T>(device: i32, stream: *mut c_void, c: AttnCall, g: AttnGrads) -> crate::R<()>
where
    T: treeattn::backend::launch::KernelElem + treeattn::backend::cuda::cudarc::driver::DeviceRepr,
{
    g.check_null()?;
    use treeattn::backend::cuda::DqMode;
    let mode = match crate::deterministic_of(c.params)? {
        true => DqMode::Deterministic,
        false => DqMode::Atomic,
    };
    with_device_call(device, stream, &c, |be, pack, call| {
        be.backward_raw::<T>(
            pack,
            call,
            g.o as u64,
            g.lse as u64,
            g.d_o as u64,
            g.dq as u64,
            g.dk as u64,
            g.dv as u64,
            g.dsinks as u64,
            mode,
        )
    })
}

/// Tree attention forward on device memory. `dtype` `TREEATTN_BF16`
/// (`__nv_bfloat16`) or `TREEATTN_F16` (`__half`) is the element type of
/// q `[tokens, q_heads, head_dim]`, k and v `[tokens, kv_heads, head_dim]`
/// and `o` (like q); `lse` (`[q_heads, tokens]`) is `float`, natural log,
/// `-inf` for a row with no visible key. Head dim 64 or 128. `kv_end` and
/// `position_ids` are the pack's host arrays (`tokens` entries); `params`
/// may be null (defaults); its window and softcap run on the kernels, and
/// its `sinks`, when not null, are a device buffer (`q_heads` values of
/// q's type). Enqueued on `stream` of device `device`; see the module
/// notes.
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
    params: *const TreeattnParams,
    o: *mut c_void,
    lse: *mut f32,
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
    device_forward(
        "treeattn_cuda_attention_forward",
        dtype,
        device,
        stream,
        c,
        o,
        lse,
    )
}

/// [`treeattn_cuda_attention_forward`] with the pack's plan `mask` (from
/// `treeattn_mask_plan_create`, of `shape.tokens` tokens) in place of its
/// `kv_end` and `position_ids`: the plan is uploaded to `device` by its
/// first device call (on that call's stream) and reused by every later
/// one — no host-to-device copy, no synchronization.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn treeattn_cuda_attention_forward_mask(
    dtype: TreeattnDtype,
    device: i32,
    stream: *mut c_void,
    q: *const c_void,
    k: *const c_void,
    v: *const c_void,
    shape: TreeattnShape,
    mask: *const TreeattnMaskPlan,
    params: *const TreeattnParams,
    o: *mut c_void,
    lse: *mut f32,
) -> i32 {
    if mask.is_null() {
        return guard(|| Err(crate::null("mask")));
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
    device_forward(
        "treeattn_cuda_attention_forward_mask",
        dtype,
        device,
        stream,
        c,
        o,
        lse,
    )
}

unsafe fn device_forward(
    entry: &'static str,
    dtype: TreeattnDtype,
    device: i32,
    stream: *mut c_void,
    c: AttnCall,
    o: *mut c_void,
    lse: *mut f32,
) -> i32 {
    guard(|| {
        check_dtype(entry, dtype, &ATTENTION_DTYPES)?;
        #[cfg(feature = "cuda")]
        return match dtype {
            TREEATTN_BF16 => forward::<treeattn::half::bf16>(device, stream, c, o, lse),
            _ => forward::<treeattn::half::f16>(device, stream, c, o, lse),
        };
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (device, stream, c, o, lse);
            Err(no_cuda(entry))
        }
    })
}

/// Tree attention backward on device memory, `dtype` `TREEATTN_BF16` or
/// `TREEATTN_F16` as for the forward: from the forward's inputs (same
/// shape, pack and params), its `o` and `lse` (`float`) and the output
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
        lse: lse.cast(),
        d_o,
        dq,
        dk,
        dv,
        dsinks,
    };
    device_backward(
        "treeattn_cuda_attention_backward",
        dtype,
        device,
        stream,
        c,
        g,
    )
}

/// [`treeattn_cuda_attention_backward`] with the pack's plan `mask` in
/// place of its `kv_end` and `position_ids` (as
/// [`treeattn_cuda_attention_forward_mask`]).
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn treeattn_cuda_attention_backward_mask(
    dtype: TreeattnDtype,
    device: i32,
    stream: *mut c_void,
    q: *const c_void,
    k: *const c_void,
    v: *const c_void,
    shape: TreeattnShape,
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
    if mask.is_null() {
        return guard(|| Err(crate::null("mask")));
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
        lse: lse.cast(),
        d_o,
        dq,
        dk,
        dv,
        dsinks,
    };
    device_backward(
        "treeattn_cuda_attention_backward_mask",
        dtype,
        device,
        stream,
        c,
        g,
    )
}

unsafe fn device_backward(
    entry: &'static str,
    dtype: TreeattnDtype,
    device: i32,
    stream: *mut c_void,
    c: AttnCall,
    g: AttnGrads,
) -> i32 {
    guard(|| {
        check_dtype(entry, dtype, &ATTENTION_DTYPES)?;
        #[cfg(feature = "cuda")]
        return match dtype {
            TREEATTN_BF16 => backward::<treeattn::half::bf16>(device, stream, c, g),
            _ => backward::<treeattn::half::f16>(device, stream, c, g),
        };
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (device, stream, c, g);
            Err(no_cuda(entry))
        }
    })
}

#[cfg(feature = "cuda")]
unsafe fn sdcc<T>(device: i32, stream: *mut c_void, c: crate::SdccCall) -> crate::R<()>
where
    T: treeattn::backend::launch::sdcc::SdccElem
        + treeattn::backend::cuda::cudarc::driver::DeviceRepr,
{
    for (what, p) in [
        ("student", c.student),
        ("teacher", c.teacher),
        ("grad_student", c.grad_student as _),
    ] {
        if p.is_null() {
            return Err(null(what));
        }
    }
    let h = c.host()?;
    let pairs = h.pairs();
    let be = device_backend(device, stream)?;
    let out = be.sdcc_raw::<T>(
        c.student as u64,
        c.student_rows,
        c.teacher as u64,
        c.teacher_rows,
        c.vocab,
        &pairs,
        h.weights,
        c.temperature,
        c.grad_student as u64,
    )?;
    crate::write_sdcc(&out, c.loss, h.per_pair);
    Ok(())
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
    const ENTRY: &str = "treeattn_cuda_sdcc_forward_kl";
    let c = crate::SdccCall {
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
        check_dtype(ENTRY, dtype, &SDCC_DTYPES)?;
        #[cfg(feature = "cuda")]
        return match dtype {
            TREEATTN_BF16 => sdcc::<treeattn::half::bf16>(device, stream, c),
            TREEATTN_F16 => sdcc::<treeattn::half::f16>(device, stream, c),
            _ => sdcc::<f32>(device, stream, c),
        };
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (device, stream, c);
            Err(no_cuda(ENTRY))
        }
    })
}
