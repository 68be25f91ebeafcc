//! SDCC forward-KL on the emulator (`kernels/sdcc_kl.cu`).

use super::{emu_result, ffi, Emu};
use crate::backend::launch::sdcc::{
    merge_row_status, plan_sdcc, status_error, vec8, SdccElem, SdccParams,
};
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
    let (pairs, weights, temperature) = (args.pairs(), args.weights(), args.temperature());
    // Rows no pair writes are 0; with repeated rows the kernel adds into
    // zeros. Rows written exactly once keep whatever they held until the
    // kernel stores them.
    for (row, &used) in grad.chunks_mut(vocab).zip(&plan.used) {
        if !used || plan.accumulate {
            row.fill(0.0);
        }
    }
    if pairs.is_empty() {
        return Ok(SdccLoss::from_per_pair(Vec::new(), weights));
    }
    let flat: Vec<u32> = pairs.iter().flat_map(|&(s, t)| [s, t]).collect();
    let mut kl = vec![f64::NAN; pairs.len()];
    let mut status = vec![u32::MAX; pairs.len()];
    let tau = temperature as f64;
    let p = SdccParams {
        student: student.as_ptr() as u64,
        teacher: teacher.as_ptr() as u64,
        pairs: flat.as_ptr() as u64,
        weights: weights.as_ptr() as u64,
        grad: grad.as_mut_ptr() as u64,
        kl: kl.as_mut_ptr() as u64,
        status: status.as_mut_ptr() as u64,
        vocab: vocab as u64,
        num_pairs: pairs.len() as u32,
        inv_tau_log2: (std::f64::consts::LOG2_E / tau) as f32,
        inv_tau: (1.0 / tau) as f32,
        accumulate: plan.accumulate as u32,
        vec8: vec8(
            vocab,
            [
                student.as_ptr() as u64,
                teacher.as_ptr() as u64,
                grad.as_ptr() as u64,
            ],
        ),
        logp: 0,
        row_status: 0,
    };
    let mut err = [0u8; 1024];
    let l = plan.launch;
    // SAFETY: every pointer in `p` refers to a live slice sized by
    // `plan_sdcc` and the checks above (pairs in range of both logits); the
    // call is synchronous.
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
    status_error(&status, pairs, vocab)?;
    Ok(SdccLoss::from_per_pair(kl, weights))
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
        let (pairs, weights, temperature) = (args.pairs(), args.weights(), args.temperature());
        let mut grad = vec![0f32; student.len()];
        let n = pairs.len();
        if n == 0 {
            return Ok(SdccOut {
                loss: SdccLoss::from_per_pair(Vec::new(), weights),
                grad_student: grad,
            });
        }
        let flat: Vec<u32> = pairs.iter().flat_map(|&(s, t)| [s, t]).collect();
        let mut kl = vec![f64::NAN; n];
        let mut logp = vec![f32::NAN; 2 * n * vocab];
        let mut row_status = vec![u32::MAX; 2 * n];
        let tau = temperature as f64;
        let p = SdccParams {
            student: student.as_ptr() as u64,
            teacher: teacher.as_ptr() as u64,
            pairs: flat.as_ptr() as u64,
            weights: weights.as_ptr() as u64,
            grad: grad.as_mut_ptr() as u64,
            kl: kl.as_mut_ptr() as u64,
            status: 0,
            vocab: vocab as u64,
            num_pairs: n as u32,
            inv_tau_log2: (std::f64::consts::LOG2_E / tau) as f32,
            inv_tau: (1.0 / tau) as f32,
            accumulate: plan.accumulate as u32,
            vec8: 0,
            logp: logp.as_mut_ptr() as u64,
            row_status: row_status.as_mut_ptr() as u64,
        };
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
        status_error(&merge_row_status(&row_status), pairs, vocab)?;
        Ok(SdccOut {
            loss: SdccLoss::from_per_pair(kl, weights),
            grad_student: grad,
        })
    }
}
