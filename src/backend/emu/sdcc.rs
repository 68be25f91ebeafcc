//! SDCC forward-KL on the emulator (`kernels/sdcc_kl.cu`).

use super::{emu_result, ffi, Emu};
use crate::backend::launch::sdcc::{plan_sdcc, SdccAddrs, SdccElem, SdccPlan};
use crate::backend::{Host, SdccArgs, SdccCall, SdccLoss, SdccOut};
use crate::Result;

/// SDCC forward KL on the emulator (the math of
/// [`crate::backend::SdccBackend`]): logits bf16, f16 or f32; sums in f32
/// per thread, f64 across the block and for the KL; the gradient in f32
/// (rows several pairs name are summed with f32 atomics: summation order
/// varies). A bad row is reported for the lowest such pair, `index` being
/// the first element of the row (the kernel does not locate the column).
pub(super) fn sdcc_forward_kl<T: SdccElem>(
    emu: &Emu,
    call: SdccCall<'_, '_, Host, T, f32>,
) -> Result<SdccLoss> {
    let (args, grad) = call.into_parts();
    let plan = plan_sdcc(&args)?;
    let (student, teacher, vocab) = (args.student(), args.teacher(), args.vocab());
    for rows in plan.zero_rows() {
        grad[rows.start * vocab..rows.end * vocab].fill(0.0);
    }
    if args.pairs().is_empty() {
        return SdccPlan::finish(&args, Vec::new(), &[]);
    }
    let flat = SdccPlan::flat_pairs(args.pairs());
    let mut kl = vec![SdccPlan::KL_POISON; args.pairs().len()];
    let mut status = vec![SdccPlan::STATUS_POISON; args.pairs().len()];
    let p = plan.params(
        &args,
        SdccAddrs {
            student: student.as_ptr() as u64,
            teacher: teacher.as_ptr() as u64,
            pairs: flat.as_ptr() as u64,
            weights: args.weights().as_ptr() as u64,
            grad: grad.as_mut_ptr() as u64,
            kl: kl.as_mut_ptr() as u64,
            status: status.as_mut_ptr() as u64,
        },
    );
    let mut err = [0u8; 1024];
    let l = plan.launch;
    // SAFETY: every pointer in `p` refers to a live slice sized by
    // `plan_sdcc` and the checks of `SdccArgs` (pairs in range of both
    // logits); the call is synchronous.
    let rc = unsafe {
        ffi::ta_emu_sdcc_kl(
            T::CODE,
            &p,
            l.grid.0,
            l.block.0,
            l.shared_mem_bytes as usize,
            &emu.config(),
            err.as_mut_ptr(),
            err.len(),
        )
    };
    emu_result(&format!("sdcc_kl_{}", T::NAME), rc, &err)?;
    SdccPlan::finish(&args, kl, &status)
}

/// The C++ block size and shared memory of the SDCC kernel, `(threads,
/// smem_bytes)`, to hold [`crate::backend::launch::sdcc`] to the source.
pub fn sdcc_kernel_traits() -> (u32, u32) {
    let mut out = [0i32; 2];
    // SAFETY: `out` has the 2 slots the function writes.
    unsafe { ffi::ta_emu_sdcc_traits(out.as_mut_ptr()) };
    (out[0] as u32, out[1] as u32)
}

impl Emu {
    /// The unfused baseline of the SDCC forward KL on the emulator — the same
    /// contract and result, computed the textbook way (log-softmax of each side
    /// into an f32 `[2, pairs, vocab]` buffer, then an elementwise KL and the
    /// gradient; `kernels/sdcc_kl.cu`), for timing the fused kernel against on
    /// the GPU. Sums in f32.
    pub fn sdcc_forward_kl_unfused<T: SdccElem>(
        &self,
        args: &SdccArgs<'_, Host, T>,
    ) -> Result<SdccOut<f32>> {
        let plan = plan_sdcc(args)?;
        let (student, teacher, vocab) = (args.student(), args.teacher(), args.vocab());
        let mut grad = vec![0f32; student.len()];
        let n = args.pairs().len();
        if n == 0 {
            return Ok(SdccOut {
                loss: SdccPlan::finish(args, Vec::new(), &[])?,
                grad_student: grad,
            });
        }
        let flat = SdccPlan::flat_pairs(args.pairs());
        let mut kl = vec![SdccPlan::KL_POISON; n];
        let mut logp = vec![f32::NAN; 2 * n * vocab];
        let mut row_status = vec![SdccPlan::STATUS_POISON; 2 * n];
        let p = plan.unfused_params(
            args,
            SdccAddrs {
                student: student.as_ptr() as u64,
                teacher: teacher.as_ptr() as u64,
                pairs: flat.as_ptr() as u64,
                weights: args.weights().as_ptr() as u64,
                grad: grad.as_mut_ptr() as u64,
                kl: kl.as_mut_ptr() as u64,
                status: 0,
            },
            logp.as_mut_ptr() as u64,
            row_status.as_mut_ptr() as u64,
        );
        for (stage, l) in plan.unfused_launches().into_iter().enumerate() {
            let mut err = [0u8; 1024];
            // SAFETY: as in `sdcc_forward_kl_into`, plus `logp` and `row_status`
            // sized for 2 · pairs rows here; the gradient is zeroed (rows no pair
            // names stay 0, repeated rows are added into).
            let rc = unsafe {
                ffi::ta_emu_sdcc_unfused(
                    T::CODE,
                    stage as u32,
                    &p,
                    l.grid.0,
                    l.grid.1,
                    l.block.0,
                    l.shared_mem_bytes as usize,
                    &self.config(),
                    err.as_mut_ptr(),
                    err.len(),
                )
            };
            emu_result("sdcc_unfused", rc, &err)?;
        }
        Ok(SdccOut {
            loss: SdccPlan::finish_unfused(args, kl, &row_status)?,
            grad_student: grad,
        })
    }
}
