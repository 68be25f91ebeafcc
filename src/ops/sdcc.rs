//! SDCC fused forward-KL (DESIGN §5), over `[rows, vocab]` logit views.

use super::{flat, shaped};
use crate::backend::cpu::{Cpu, CpuFloat};
use crate::backend::{HostSdcc, SdccArgs, SdccLoss};
use crate::{Error, Result};
use ndarray::{Array2, ArrayView2};

/// Result of [`sdcc_forward_kl`].
#[derive(Clone, Debug)]
pub struct SdccForward<T> {
    /// Sum, mean and per-pair KL (see [`SdccLoss`]).
    pub loss: SdccLoss,
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
/// [`crate::backend::SdccBackend`] for the treatment of `−inf` logits
/// and the errors. `student` and `teacher` must have the same vocabulary
/// (number of columns).
pub fn sdcc_forward_kl<T: CpuFloat>(
    student: ArrayView2<'_, T>,
    teacher: ArrayView2<'_, T>,
    pairs: &[(u32, u32)],
    weights: &[f32],
    temperature: f32,
) -> Result<SdccForward<T>> {
    let vocab = student.ncols();
    if teacher.ncols() != vocab {
        return Err(Error::Shape(format!(
            "student logits have vocab {vocab} but teacher logits have {}",
            teacher.ncols()
        )));
    }
    let (s, t) = (flat(&student), flat(&teacher));
    let args = SdccArgs::new(&s[..], &t[..], vocab, pairs, weights, temperature)?;
    let out = Cpu::default().sdcc_owned(&args)?;
    Ok(SdccForward {
        loss: out.loss,
        grad_student: shaped(student.dim(), out.grad_student, "grad_student")?,
    })
}
