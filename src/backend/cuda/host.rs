//! Entries for a host that owns the memory and the stream: PyTorch, JAX,
//! candle, a C++ framework. The host gives device addresses (its tensors'
//! data pointers) and a stream; treeattn creates no context (it uses the
//! device's primary context, the CUDA runtime's) and no stream, enqueues
//! its kernels on the host's stream, and frees nothing it did not
//! allocate. These are thin adapters: each wraps the addresses as borrowed
//! cudarc buffers and runs the one contract ([`AttnArgs`], [`SdccArgs`],
//! the [`AttentionBackend`] / [`SdccBackend`] impls of [`CudaBackend`]), so
//! the checks and the math are the same as for owned buffers.
//!
//! Typical use (the Python extension and the C ABI do this):
//!
//! ```no_run
//! # fn main() -> treeattn::Result<()> {
//! use treeattn::backend::cuda::{host, CudaBackend};
//! # let (raw_stream, kv_end, pos): (cudarc::driver::sys::CUstream, Vec<u32>, Vec<u32>) = todo!();
//! # let (q, k, v, o, lse) = (0u64, 0u64, 0u64, 0u64, 0u64);
//! // Once per device: the kernels loaded into the primary context.
//! let kernels = host::primary(0)?;
//! // Per call, on the host's current stream:
//! let be = unsafe { host::on_raw_stream(&kernels, raw_stream) }?;
//! let pack = be.upload_pack(treeattn::mask::PackMask::new(&kv_end, &pos)?)?;
//! let shape = treeattn::backend::AttnShape { tokens: kv_end.len(), q_heads: 8, kv_heads: 8, head_dim: 128, v_head_dim: 128 };
//! let params = treeattn::backend::AttnParams::new(128);
//! // No sinks (0) and no explicit key starts: plain tree attention.
//! let call = host::RawAttention { q, k, v, sinks: 0, key_starts: None, shape, params };
//! unsafe { be.forward_raw::<half::bf16>(&pack, call, o, lse) }?;
//! # Ok(()) }
//! ```

use std::collections::HashMap;
use std::mem::ManuallyDrop;
use std::sync::{Arc, Mutex};

use cudarc::driver::sys::{CUdeviceptr, CUstream};
use cudarc::driver::{CudaSlice, CudaStream, DeviceRepr};

use super::{open_context, CudaBackend, DevicePack, DqMode};
use crate::backend::launch::sdcc::SdccElem;
use crate::backend::launch::KernelElem;
use crate::backend::{
    AttentionBackend, AttnArgs, AttnParams, AttnShape, BackwardCall, Grads, Saved, SdccArgs,
    SdccBackend, SdccLoss,
};
use crate::{Error, Result};

/// A caller-owned device buffer seen as a cudarc buffer for the duration of
/// one call: never freed here (dropping it gives the address back).
struct Borrowed<T>(ManuallyDrop<CudaSlice<T>>);

impl<T> Borrowed<T> {
    /// Borrows `len` elements at `addr`. Null or misaligned addresses of a
    /// non-empty buffer are an `Err` naming `what`.
    ///
    /// Safety: `addr` is a live allocation of the stream's context holding
    /// at least `len` elements of `T`, valid until the work enqueued on
    /// the stream with it has run.
    unsafe fn new(
        stream: &Arc<CudaStream>,
        what: &str,
        addr: CUdeviceptr,
        len: usize,
    ) -> Result<Self> {
        if len > 0 && addr == 0 {
            return Err(Error::Shape(format!(
                "{what}: null device pointer for {len} elements"
            )));
        }
        if !addr.is_multiple_of(std::mem::align_of::<T>() as u64) {
            return Err(Error::Shape(format!(
                "{what}: device pointer {addr:#x} is not aligned to {} bytes",
                std::mem::align_of::<T>()
            )));
        }
        // SAFETY: as the caller promises; the slice is leaked, not freed,
        // on drop.
        Ok(Borrowed(ManuallyDrop::new(unsafe {
            stream.upgrade_device_ptr(addr, len)
        })))
    }
}

impl<T> Drop for Borrowed<T> {
    fn drop(&mut self) {
        // SAFETY: taken once, here; `leak` gives up the address without
        // freeing it.
        let slice = unsafe { ManuallyDrop::take(&mut self.0) };
        let _ = slice.leak();
    }
}

/// Device addresses and sizes of one attention call's inputs, caller-owned.
/// q is `[tokens, q_heads, head_dim]`, k `[tokens, kv_heads, head_dim]`,
/// v `[tokens, kv_heads, v_head_dim]`, contiguous, of the element type the
/// entry is called with; the optional attention sinks are `[q_heads]` of
/// that type on the device, the optional key starts `[tokens]` on the host
/// (as [`AttnArgs::with_key_starts`] takes them: uploaded per call).
#[derive(Clone, Copy, Debug)]
pub struct RawAttention<'a> {
    /// Address of q.
    pub q: CUdeviceptr,
    /// Address of k.
    pub k: CUdeviceptr,
    /// Address of v.
    pub v: CUdeviceptr,
    /// Address of the attention sinks (gpt-oss: one logit per query head,
    /// `[q_heads]` of q's element type; [`AttnArgs::with_sinks`]); 0 for
    /// none.
    pub sinks: CUdeviceptr,
    /// Explicit first visible key per query row, `[tokens]`, on the host
    /// ([`AttnArgs::with_key_starts`]: context parallelism); `None` for
    /// none.
    pub key_starts: Option<&'a [u32]>,
    /// Sizes (validated by [`AttnArgs::new`]).
    pub shape: AttnShape,
    /// Softmax scale, rotary, window, softcap, finiteness scan.
    pub params: AttnParams,
}

impl<'a> RawAttention<'a> {
    /// The contract's arguments on the borrowed `q`, `k`, `v` and `sinks`
    /// (checked there: [`AttnArgs::new`], [`AttnArgs::with_sinks`],
    /// [`AttnArgs::with_key_starts`]).
    fn args<'b, T: KernelElem>(
        &self,
        pack: &'b DevicePack,
        q: &'b Borrowed<T>,
        k: &'b Borrowed<T>,
        v: &'b Borrowed<T>,
        sinks: Option<&'b Borrowed<T>>,
    ) -> Result<AttnArgs<'b, super::Device, T>>
    where
        'a: 'b,
    {
        let args = AttnArgs::new(&*q.0, &*k.0, &*v.0, self.shape, pack, self.params)?;
        let args = match sinks {
            Some(s) => args.with_sinks(&*s.0)?,
            None => args,
        };
        match self.key_starts {
            Some(starts) => args.with_key_starts(starts),
            None => Ok(args),
        }
    }

    /// The sinks borrowed (`None` for address 0).
    ///
    /// Safety: as [`Borrowed::new`] for a nonzero address of `q_heads`
    /// elements.
    unsafe fn borrow_sinks<T>(&self, s: &Arc<CudaStream>) -> Result<Option<Borrowed<T>>> {
        match self.sinks {
            0 => Ok(None),
            at => Ok(Some(unsafe {
                Borrowed::<T>::new(s, "sinks", at, self.shape.q_heads)?
            })),
        }
    }
}

/// The backend of device `ordinal`, its kernels loaded into the device's
/// primary context (the CUDA runtime's: PyTorch's, JAX's), loaded once per
/// process and device and cached. Its own stream is the legacy default
/// stream, which nothing here launches on: take [`on_raw_stream`] or
/// [`CudaBackend::on_stream`] per call. Event tracking is off for this
/// context wrapper (as for any kernel a host launches, the host orders
/// its work on its streams; every buffer treeattn allocates is used and
/// freed on the stream of its call).
pub fn primary(ordinal: usize) -> Result<CudaBackend> {
    static LOADED: Mutex<Option<HashMap<usize, CudaBackend>>> = Mutex::new(None);
    let mut guard = LOADED.lock().unwrap_or_else(|p| p.into_inner());
    let map = guard.get_or_insert_with(HashMap::new);
    if let Some(be) = map.get(&ordinal) {
        return Ok(be.clone());
    }
    let ctx = open_context(ordinal)?;
    // SAFETY: this context wrapper is ours; no stream is created in it and
    // every buffer allocated through it lives on one caller stream (see
    // above), so there is no cross-stream use to track.
    unsafe { ctx.disable_event_tracking() };
    let be = CudaBackend::with_stream(&ctx.default_stream())?;
    map.insert(ordinal, be.clone());
    Ok(be)
}

/// `kernels` launching on a stream the host owns (`cudaStream_t` and
/// `CUstream` are the same handle; null is the legacy default stream).
/// Nothing is created and the stream is never destroyed here.
///
/// # Safety
/// `stream` is a live stream of `kernels`' context (for [`primary`]: the
/// device's primary context, where PyTorch's and JAX's streams live) and
/// stays alive while the returned backend and what it allocated are used.
pub unsafe fn on_raw_stream(kernels: &CudaBackend, stream: CUstream) -> Result<CudaBackend> {
    // SAFETY: as the caller promises.
    let wrapped = unsafe { kernels.ctx.wrap_borrowed_stream(stream) };
    kernels.on_stream(&wrapped)
}

impl CudaBackend {
    /// Tree attention forward on caller-owned device memory: writes `o`
    /// (`[tokens, q_heads, v_head_dim]`, element `T`) and `lse` (`[q_heads,
    /// tokens]`, f32, natural log) on this backend's stream, as
    /// [`AttentionBackend::forward`] does on owned buffers (same checks,
    /// same errors), with the sinks and key starts of `a` when given.
    ///
    /// # Safety
    /// Every address is a live allocation of this backend's context with
    /// the elements `a.shape` says (`o` `tokens · q_heads · v_head_dim`,
    /// `lse` `q_heads · tokens` f32, nonzero sinks `q_heads`), valid until
    /// the enqueued work has run; `o` and `lse` overlap nothing else of the
    /// call.
    pub unsafe fn forward_raw<T: KernelElem + DeviceRepr>(
        &self,
        pack: &DevicePack,
        a: RawAttention<'_>,
        o: CUdeviceptr,
        lse: CUdeviceptr,
    ) -> Result<()> {
        let s = &self.stream;
        let sh = a.shape;
        sh.validate()?;
        let (q, k, v, sinks) = unsafe {
            (
                Borrowed::<T>::new(s, "q", a.q, sh.q_len())?,
                Borrowed::<T>::new(s, "k", a.k, sh.kv_len())?,
                Borrowed::<T>::new(s, "v", a.v, sh.v_len())?,
                a.borrow_sinks::<T>(s)?,
            )
        };
        let mut o = unsafe { Borrowed::<T>::new(s, "o", o, sh.o_len())? };
        let mut lse = unsafe { Borrowed::<f32>::new(s, "lse", lse, sh.lse_len())? };
        let args = a.args(pack, &q, &k, &v, sinks.as_ref())?;
        self.forward(&args, &mut *o.0, &mut *lse.0)
    }

    /// Tree attention backward on caller-owned device memory: from the
    /// forward's inputs `a` (its sinks and key starts included), its `o`
    /// and `lse` and the output gradient `d_o` (like o), writes `dq` (like
    /// q), `dk` (like k) and `dv` (like v), with respect to the unrotated q
    /// and k, and with sinks the sinks' gradient into `dsinks` (`[q_heads]`,
    /// element `T`) unless it is 0 (which it must be without sinks: the
    /// contract's [`Error::Shape`]), on this backend's stream (scratch is
    /// allocated and freed on it), as [`AttentionBackend::backward`].
    ///
    /// `mode` says how dQ is summed, for this call (the backend's own
    /// [`CudaBackend::with_dq_mode`] is not read here: a host binding
    /// passes its caller's choice every call): [`DqMode::Atomic`], the
    /// default of the bindings as of FlashAttention, or
    /// [`DqMode::Deterministic`] for a dQ bit-identical from run to run
    /// (Python's `deterministic=True`, the C params' `deterministic`,
    /// candle's `TreeAttentionOptions`). dK, dV and dsinks are
    /// deterministic in both modes.
    ///
    /// # Safety
    /// As [`Self::forward_raw`]; `d_o` like o; `dq`, `dk`, `dv` and a
    /// nonzero `dsinks` (`q_heads` elements) overlap nothing else of the
    /// call.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn backward_raw<T: KernelElem + DeviceRepr>(
        &self,
        pack: &DevicePack,
        a: RawAttention<'_>,
        o: CUdeviceptr,
        lse: CUdeviceptr,
        d_o: CUdeviceptr,
        dq: CUdeviceptr,
        dk: CUdeviceptr,
        dv: CUdeviceptr,
        dsinks: CUdeviceptr,
        mode: DqMode,
    ) -> Result<()> {
        let s = &self.stream;
        let sh = a.shape;
        sh.validate()?;
        let (q, k, v, sinks, o, lse, d_o) = unsafe {
            (
                Borrowed::<T>::new(s, "q", a.q, sh.q_len())?,
                Borrowed::<T>::new(s, "k", a.k, sh.kv_len())?,
                Borrowed::<T>::new(s, "v", a.v, sh.v_len())?,
                a.borrow_sinks::<T>(s)?,
                Borrowed::<T>::new(s, "o", o, sh.o_len())?,
                Borrowed::<f32>::new(s, "lse", lse, sh.lse_len())?,
                Borrowed::<T>::new(s, "d_o", d_o, sh.o_len())?,
            )
        };
        let (mut dq, mut dk, mut dv) = unsafe {
            (
                Borrowed::<T>::new(s, "dq", dq, sh.q_len())?,
                Borrowed::<T>::new(s, "dk", dk, sh.kv_len())?,
                Borrowed::<T>::new(s, "dv", dv, sh.v_len())?,
            )
        };
        let mut dsinks = match dsinks {
            0 => None,
            at => Some(unsafe { Borrowed::<T>::new(s, "dsinks", at, sh.q_heads)? }),
        };
        let args = a.args(pack, &q, &k, &v, sinks.as_ref())?;
        // The contract's checks (`BackwardCall::new`, as
        // `AttentionBackend::backward`), then the one backward with `mode`.
        let call = BackwardCall::new(
            args,
            Saved {
                o: &*o.0,
                lse: &*lse.0,
            },
            &*d_o.0,
            Grads {
                dq: &mut *dq.0,
                dk: &mut *dk.0,
                dv: &mut *dv.0,
                dsinks: dsinks.as_mut().map(|d| &mut *d.0),
            },
        )?;
        self.backward_with_mode(call, mode)
    }

    /// The fused SDCC forward KL on caller-owned device logits: student
    /// `[student_rows, vocab]` and teacher `[teacher_rows, vocab]` (element
    /// `T`; they may be the same buffer), pairs and weights on the host;
    /// writes the f32 gradient (like the student) and returns the loss, as
    /// [`SdccBackend::sdcc_forward_kl`] (it synchronises the stream once to
    /// read the per-pair KL).
    ///
    /// # Safety
    /// Every address is a live allocation of this backend's context of the
    /// size given; `grad` overlaps neither logits buffer.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn sdcc_raw<T: SdccElem + DeviceRepr>(
        &self,
        student: CUdeviceptr,
        student_rows: usize,
        teacher: CUdeviceptr,
        teacher_rows: usize,
        vocab: usize,
        pairs: &[(u32, u32)],
        weights: &[f32],
        temperature: f32,
        grad: CUdeviceptr,
    ) -> Result<SdccLoss> {
        let s = &self.stream;
        let elems = |rows: usize, what: &str| {
            rows.checked_mul(vocab)
                .ok_or_else(|| Error::Shape(format!("{what}: {rows} × {vocab} elements overflow")))
        };
        let (ns, nt) = (
            elems(student_rows, "student")?,
            elems(teacher_rows, "teacher")?,
        );
        let (st, te) = unsafe {
            (
                Borrowed::<T>::new(s, "student", student, ns)?,
                Borrowed::<T>::new(s, "teacher", teacher, nt)?,
            )
        };
        let mut g = unsafe { Borrowed::<f32>::new(s, "grad", grad, ns)? };
        let args = SdccArgs::new(&*st.0, &*te.0, vocab, pairs, weights, temperature)?;
        self.sdcc_forward_kl(&args, &mut *g.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn primary_without_a_driver_is_an_error_not_a_panic() {
        match primary(0) {
            Ok(be) => assert!(super::super::driver_present(), "{:?}", be.describe()),
            Err(e) if !super::super::driver_present() => {
                assert!(e.to_string().contains("no CUDA driver"), "{e}")
            }
            Err(e) => eprintln!("driver present, no usable device: {e}"),
        }
        // A second call asks again (failures are not cached).
        assert_eq!(primary(0).is_ok(), primary(0).is_ok());
    }
}
