//! SDCC forward-KL on the device (`kernels/sdcc_kl.cu`), launched on a
//! [`super::CudaBackend`]'s stream.

use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr,
    PushKernelArg,
};
use cudarc::nvrtc::Ptx;

use super::{config, cuda_err, Device};
use crate::backend::launch::sdcc::{plan_sdcc, SdccAddrs, SdccElem, SdccParams, SdccPlan};
use crate::backend::{SdccCall, SdccLoss};
use crate::{Error, Result};

/// The fatbin built from `kernels/sdcc_kl.cu` by build.rs.
static SDCC_FATBIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/sdcc_kl.fatbin"));

// SAFETY: plain #[repr(C)] struct of integers, floats and device addresses,
// laid out exactly like `SdccParams` in the kernel.
unsafe impl DeviceRepr for SdccParams {}

/// The SDCC kernels, loaded by [`super::CudaBackend::new`].
#[derive(Clone)]
pub(crate) struct CudaSdcc {
    pub(super) stream: Arc<CudaStream>,
    _module: Arc<CudaModule>,
    /// Indexed by [`SdccElem::CODE`]: bf16, f16, f32.
    funcs: Vec<CudaFunction>,
    /// The unfused baseline: log-softmax by [`SdccElem::CODE`], then the KL.
    unfused_log_softmax: Vec<CudaFunction>,
    unfused_kl: CudaFunction,
}

impl CudaSdcc {
    /// Loads the embedded SDCC kernels on `ctx`'s device, to launch on
    /// `stream`.
    pub(crate) fn new(ctx: &Arc<CudaContext>, stream: &Arc<CudaStream>) -> Result<Self> {
        let module = ctx
            .load_module(Ptx::from_binary(SDCC_FATBIN.to_vec()))
            .map_err(cuda_err("loading the embedded SDCC kernels"))?;
        let load = |n: &str| {
            module
                .load_function(n)
                .map_err(|e| Error::Cuda(format!("{n}: {e}")))
        };
        let dtypes = ["bf16", "f16", "f32"];
        let funcs = dtypes
            .iter()
            .map(|d| load(&format!("sdcc_kl_{d}")))
            .collect::<Result<Vec<_>>>()?;
        let unfused_log_softmax = dtypes
            .iter()
            .map(|d| load(&format!("sdcc_unfused_log_softmax_{d}")))
            .collect::<Result<Vec<_>>>()?;
        Ok(CudaSdcc {
            stream: stream.clone(),
            unfused_kl: load("sdcc_unfused_kl")?,
            _module: module,
            funcs,
            unfused_log_softmax,
        })
    }

    /// SDCC forward KL on the device (the math of
    /// [`crate::backend::SdccBackend`]): `pairs` and `weights` on the host
    /// (they are uploaded), logits and the f32 gradient on the device (every
    /// element written: rows no pair names are zeroed, rows several pairs
    /// name are summed with f32 atomics). Synchronises the stream once at the
    /// end to read the per-pair KL and status words (O(pairs) bytes) and turn
    /// a bad row into the CPU backend's error.
    pub(crate) fn run<T: SdccElem + DeviceRepr>(
        &self,
        call: SdccCall<'_, '_, Device, T, f32>,
    ) -> Result<SdccLoss> {
        let (args, grad) = call.into_parts();
        let plan = plan_sdcc(&args)?;
        let (student, teacher, vocab) = (args.student(), args.teacher(), args.vocab());
        let (pairs, weights) = (args.pairs(), args.weights());
        let s = &self.stream;
        for rows in plan.zero_rows() {
            let mut view = grad.slice_mut(rows.start * vocab..rows.end * vocab);
            s.memset_zeros(&mut view)
                .map_err(cuda_err("zeroing gradient rows"))?;
        }
        if pairs.is_empty() {
            return SdccPlan::finish(&args, Vec::new(), &[]);
        }
        let dpairs = s
            .clone_htod(&SdccPlan::flat_pairs(pairs))
            .map_err(cuda_err("uploading SDCC pairs"))?;
        let dweights = s
            .clone_htod(weights)
            .map_err(cuda_err("uploading SDCC weights"))?;
        let mut kl = s
            .clone_htod(&vec![SdccPlan::KL_POISON; pairs.len()])
            .map_err(cuda_err("allocating per-pair KL"))?;
        let mut status = s
            .clone_htod(&vec![SdccPlan::STATUS_POISON; pairs.len()])
            .map_err(cuda_err("allocating status words"))?;
        {
            let (sp, _g0) = student.device_ptr(s);
            let (tp, _g1) = teacher.device_ptr(s);
            let (pp, _g2) = dpairs.device_ptr(s);
            let (wp, _g3) = dweights.device_ptr(s);
            let (gp, _g4) = grad.device_ptr_mut(s);
            let (kp, _g5) = kl.device_ptr_mut(s);
            let (stp, _g6) = status.device_ptr_mut(s);
            let p = plan.params(
                &args,
                SdccAddrs {
                    student: sp,
                    teacher: tp,
                    pairs: pp,
                    weights: wp,
                    grad: gp,
                    kl: kp,
                    status: stp,
                },
            );
            let mut b = s.launch_builder(&self.funcs[T::CODE as usize]);
            b.arg(&p);
            // SAFETY: pairs were range-checked against both logits by
            // SdccArgs; the gradient has the student's length; kl and
            // status hold one element per pair.
            unsafe { b.launch(config(plan.launch)) }
                .map_err(|e| Error::Cuda(format!("launching sdcc_kl_{}: {e}", T::NAME)))?;
        }
        let per_pair = s
            .clone_dtoh(&kl)
            .map_err(cuda_err("downloading per-pair KL"))?;
        let status = s
            .clone_dtoh(&status)
            .map_err(cuda_err("downloading status words"))?;
        SdccPlan::finish(&args, per_pair, &status)
    }

    /// The unfused baseline of [`Self::run`] (log-softmax of each side into
    /// an f32 `[2, pairs, vocab]` buffer allocated here, then an elementwise
    /// KL and the gradient; `kernels/sdcc_kl.cu`): the same contract and
    /// result, for timing the fused kernel against.
    pub(crate) fn run_unfused<T: SdccElem + DeviceRepr>(
        &self,
        call: SdccCall<'_, '_, Device, T, f32>,
    ) -> Result<SdccLoss> {
        let (args, grad) = call.into_parts();
        let plan = plan_sdcc(&args)?;
        let (student, teacher, vocab) = (args.student(), args.teacher(), args.vocab());
        let (pairs, weights) = (args.pairs(), args.weights());
        let s = &self.stream;
        s.memset_zeros(grad)
            .map_err(cuda_err("zeroing the gradient"))?;
        if pairs.is_empty() {
            return SdccPlan::finish(&args, Vec::new(), &[]);
        }
        let n = pairs.len();
        let dpairs = s
            .clone_htod(&SdccPlan::flat_pairs(pairs))
            .map_err(cuda_err("uploading SDCC pairs"))?;
        let dweights = s
            .clone_htod(weights)
            .map_err(cuda_err("uploading SDCC weights"))?;
        let mut kl = s
            .clone_htod(&vec![SdccPlan::KL_POISON; n])
            .map_err(cuda_err("allocating per-pair KL"))?;
        let mut row_status = s
            .clone_htod(&vec![SdccPlan::STATUS_POISON; 2 * n])
            .map_err(cuda_err("allocating status words"))?;
        // SAFETY: every element is written by sdcc_unfused_log_softmax before
        // sdcc_unfused_kl reads it.
        let mut logp = unsafe { s.alloc::<f32>(2 * n * vocab) }
            .map_err(cuda_err("allocating log-probabilities"))?;
        {
            let (sp, _g0) = student.device_ptr(s);
            let (tp, _g1) = teacher.device_ptr(s);
            let (pp, _g2) = dpairs.device_ptr(s);
            let (wp, _g3) = dweights.device_ptr(s);
            let (gp, _g4) = grad.device_ptr_mut(s);
            let (kp, _g5) = kl.device_ptr_mut(s);
            let (lp, _g6) = logp.device_ptr_mut(s);
            let (rp, _g7) = row_status.device_ptr_mut(s);
            let addrs = SdccAddrs {
                student: sp,
                teacher: tp,
                pairs: pp,
                weights: wp,
                grad: gp,
                kl: kp,
                status: 0,
            };
            let p = plan.unfused_params(&args, addrs, lp, rp);
            let [ls, klp] = plan.unfused_launches();
            for (f, l) in [
                (&self.unfused_log_softmax[T::CODE as usize], ls),
                (&self.unfused_kl, klp),
            ] {
                let mut b = s.launch_builder(f);
                b.arg(&p);
                // SAFETY: pairs range-checked by SdccArgs; logp holds 2 ·
                // pairs rows, row_status 2 · pairs words, kl one per pair; the
                // gradient has the student's length and is zeroed.
                unsafe { b.launch(config(l)) }.map_err(|e| {
                    Error::Cuda(format!("launching the unfused SDCC baseline: {e}"))
                })?;
            }
        }
        let per_pair = s
            .clone_dtoh(&kl)
            .map_err(cuda_err("downloading per-pair KL"))?;
        let row_status = s
            .clone_dtoh(&row_status)
            .map_err(cuda_err("downloading status words"))?;
        SdccPlan::finish_unfused(&args, per_pair, &row_status)
    }
}
