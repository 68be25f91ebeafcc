//! SDCC forward-KL on the emulator (`kernels/sdcc_kl.cu`).

use super::{current_config, emu_result, ffi};
use crate::backend::launch::sdcc::{
    merge_row_status, plan_sdcc, status_error, vec8, weighted_loss, SdccElem, SdccParams,
};
use crate::{Error, Result};

/// Result of [`sdcc_forward_kl`].
#[derive(Clone, Debug, PartialEq)]
pub struct GpuSdccOut {
    /// `Σ_pairs w · KL` (pairs with `w = 0` add exactly 0, even if their KL
    /// is `+inf`).
    pub loss_sum: f64,
    /// `loss_sum / Σ w`; `0` when `Σ w = 0`.
    pub loss_mean: f64,
    /// The unweighted `KL(teacher ‖ student)` of each pair, in pair order.
    pub per_pair: Vec<f64>,
    /// `∂ loss_sum / ∂ student`, f32, shaped like `student`; rows used by
    /// several pairs hold the sum of their pairs' gradients (f32 atomics:
    /// summation order varies); rows used by none are 0.
    pub grad_student: Vec<f32>,
}

/// Forward KL of SDCC self-distillation on the emulator, fused over the
/// vocabulary — the same contract as the CPU backend's
/// [`crate::backend::cpu::sdcc_forward_kl`]: for pair `i = (s, t)` of
/// `[rows, vocab]` row-major logits, weight `w_i`, temperature `τ`, with `p =
/// softmax(logits / τ)`,
///
/// ```text
/// KL_i = Σ_v p_t(v) · (log p_t(v) − log p_s(v))
/// ∂(w_i KL_i) / ∂ student[s, v] = w_i · (p_s(v) − p_t(v)) / τ
/// ```
///
/// and the teacher gets no gradient. Logits are bf16, f16 or f32; sums in
/// f32 per thread, f64 across the block and for the KL. A teacher `−inf`
/// adds exactly 0; a student `−inf` under teacher mass gives `KL = +inf`
/// with a finite gradient.
///
/// Errors: as the CPU backend — `vocab == 0`, logits not whole rows, weights
/// not one per pair / non-finite / negative, temperature non-finite or
/// `<= 0`, a pair out of range, and a used row holding a NaN or `+inf` or
/// entirely `−inf` (reported for the lowest such pair; `index` is the first
/// element of the row, the kernel does not locate the column).
pub fn sdcc_forward_kl<T: SdccElem>(
    student: &[T],
    teacher: &[T],
    vocab: usize,
    pairs: &[(u32, u32)],
    weights: &[f32],
    temperature: f32,
) -> Result<GpuSdccOut> {
    let mut grad = vec![f32::NAN; student.len()];
    let per_pair = sdcc_forward_kl_into(
        student,
        teacher,
        vocab,
        pairs,
        weights,
        temperature,
        &mut grad,
    )?;
    let (loss_sum, loss_mean) = weighted_loss(&per_pair, weights);
    Ok(GpuSdccOut {
        loss_sum,
        loss_mean,
        per_pair,
        grad_student: grad,
    })
}

/// [`sdcc_forward_kl`] writing the gradient into caller-owned `grad`
/// (shaped like `student`: every element is written, whatever it held) and
/// returning the per-pair KL.
pub fn sdcc_forward_kl_into<T: SdccElem>(
    student: &[T],
    teacher: &[T],
    vocab: usize,
    pairs: &[(u32, u32)],
    weights: &[f32],
    temperature: f32,
    grad: &mut [f32],
) -> Result<Vec<f64>> {
    let plan = plan_sdcc(
        (student.len(), teacher.len()),
        vocab,
        pairs,
        weights,
        temperature,
    )?;
    if grad.len() != student.len() {
        return Err(Error::Shape(format!(
            "SDCC gradient has {} elements, the student logits {}",
            grad.len(),
            student.len()
        )));
    }
    // Rows no pair writes are 0; with repeated rows the kernel adds into
    // zeros. Rows written exactly once keep whatever they held until the
    // kernel stores them.
    for (row, &used) in grad.chunks_mut(vocab).zip(&plan.used) {
        if !used || plan.accumulate {
            row.fill(0.0);
        }
    }
    if pairs.is_empty() {
        return Ok(Vec::new());
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
            &current_config(),
            err.as_mut_ptr(),
            err.len(),
        )
    };
    emu_result(&format!("sdcc_kl_{}", T::NAME), rc, &err)?;
    status_error(&status, pairs, vocab)?;
    Ok(kl)
}

/// The C++ block size and shared memory of the SDCC kernel, `(threads,
/// smem_bytes)`, to hold [`crate::backend::launch::sdcc`] to the source.
pub fn sdcc_kernel_traits() -> (u32, u32) {
    let mut out = [0i32; 2];
    // SAFETY: `out` has the 2 slots the function writes.
    unsafe { ffi::ta_emu_sdcc_traits(out.as_mut_ptr()) };
    (out[0] as u32, out[1] as u32)
}

/// The unfused baseline of [`sdcc_forward_kl`] on the emulator — the same
/// contract and result, computed the textbook way (log-softmax of each side
/// into an f32 `[2, pairs, vocab]` buffer, then an elementwise KL and the
/// gradient; `kernels/sdcc_kl.cu`), for timing the fused kernel against on
/// the GPU. Sums in f32.
pub fn sdcc_forward_kl_unfused<T: SdccElem>(
    student: &[T],
    teacher: &[T],
    vocab: usize,
    pairs: &[(u32, u32)],
    weights: &[f32],
    temperature: f32,
) -> Result<GpuSdccOut> {
    let plan = plan_sdcc(
        (student.len(), teacher.len()),
        vocab,
        pairs,
        weights,
        temperature,
    )?;
    let mut grad = vec![0f32; student.len()];
    let n = pairs.len();
    if n == 0 {
        return Ok(GpuSdccOut {
            loss_sum: 0.0,
            loss_mean: 0.0,
            per_pair: Vec::new(),
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
                &current_config(),
                err.as_mut_ptr(),
                err.len(),
            )
        };
        emu_result("sdcc_unfused", rc, &err)?;
    }
    status_error(&merge_row_status(&row_status), pairs, vocab)?;
    let (loss_sum, loss_mean) = weighted_loss(&kl, weights);
    Ok(GpuSdccOut {
        loss_sum,
        loss_mean,
        per_pair: kl,
        grad_student: grad,
    })
}
