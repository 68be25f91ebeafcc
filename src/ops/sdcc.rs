//! SDCC fused forward-KL (DESIGN §5), over `[rows, vocab]` logit views.

use super::{flat, shaped};
use crate::backend::cpu::{self, CpuFloat};
use crate::{Error, Result};
use ndarray::{Array2, ArrayView2};

/// Result of [`sdcc_forward_kl`].
#[derive(Clone, Debug)]
pub struct SdccLoss<T> {
    /// `Σ_pairs w · KL(teacher ‖ student)`.
    pub loss_sum: f64,
    /// `loss_sum / Σ w` (0 when `Σ w = 0`).
    pub loss_mean: f64,
    /// Unweighted KL per pair, in pair order.
    pub per_pair: Vec<f64>,
    /// `∂ loss_sum / ∂ student`, shaped like `student`; rows in several pairs
    /// accumulate.
    pub grad_student: Array2<T>,
}

/// SDCC forward KL for pairs `(student row, teacher row)` with per-pair
/// weights `w` and temperature `τ`, `p = softmax(logits / τ)`:
///
/// ```text
/// KL = Σ_v p_t(v) (log p_t(v) − log p_s(v))     ∂(w KL)/∂ student = w (p_s − p_t) / τ
/// ```
///
/// Fused over vocabulary chunks with an online log-sum-exp, f64
/// accumulation; the teacher gets no gradient. See
/// [`cpu::sdcc_forward_kl`] for the passes, the treatment of `−inf` logits
/// and the errors. `student` and `teacher` must have the same vocabulary
/// (number of columns).
pub fn sdcc_forward_kl<T: CpuFloat>(
    student: ArrayView2<'_, T>,
    teacher: ArrayView2<'_, T>,
    pairs: &[(u32, u32)],
    weights: &[f32],
    temperature: f32,
) -> Result<SdccLoss<T>> {
    let vocab = student.ncols();
    if teacher.ncols() != vocab {
        return Err(Error::Shape(format!(
            "student logits have vocab {vocab} but teacher logits have {}",
            teacher.ncols()
        )));
    }
    let out = cpu::sdcc_forward_kl(
        &flat(&student),
        &flat(&teacher),
        vocab,
        pairs,
        weights,
        temperature,
    )?;
    Ok(SdccLoss {
        loss_sum: out.loss_sum,
        loss_mean: out.loss_mean,
        per_pair: out.per_pair,
        grad_student: shaped(student.dim(), out.grad_student, "grad_student")?,
    })
}
