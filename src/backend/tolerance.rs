//! The one table of tolerances that kernel results are held to, by the
//! emulator tests (`tests/it/emu_*.rs`) and by the GPU check
//! (`treeattn gpu-check`) alike, and the error measures they use. The
//! reference is always the CPU backend ([`super::cpu::Cpu`], itself proven
//! against a dense loop) on the *same rounded inputs* the kernel saw, so
//! only the kernel's arithmetic is measured.
//!
//! Why these bounds (attention): the kernels round `P` to the input type
//! before `P·V` and round their outputs, each a relative error of up to
//! 2^-9 (bf16) or 2^-12 (f16) per element, so relative Frobenius errors sit
//! near those values; the bounds leave a factor of about 5. The LSE is
//! computed in f32 from f32 scores (errors ~1e-6 absolute). The backward
//! compounds two such roundings (P and dS), hence twice the forward's bound.
//!
//! SDCC: the kernel takes f32 exponentials (approximate on the GPU) and
//! sums them, and the cross term, in f64 per thread and across threads. The
//! KL is a difference of terms of size ~ln(vocab), so its absolute error
//! does not shrink with the KL: KLs below [`Sdcc::kl_floor`] nats are held
//! to `kl_rel · kl_floor` = 1e-6 nats absolute. That is the order the GPU's
//! `ex2.approx` allows: each exponential is off by at most 2^-22 ≈ 2.4e-7
//! relative, hence each sum (`Z_t`, `Z_s`, `W`) too, and the KL `W / Z_t −
//! ln Z_t + ln Z_s` by up to ~5e-7 · (1 + |W / Z_t|) nats in the worst
//! case (errors of one sign). The emulator, whose `exp2` is exact to f32
//! rounding, measures ≤ 5e-10 nats on tiny KLs (tests/it/emu_sdcc.rs), which
//! proves the f64 summation but not the GPU's exponentials: the bounds stay
//! at the worst case until a GPU run measures them.

use super::launch::Dtype;

/// Bounds for one attention kernel result against the CPU backend.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Attention {
    /// Relative Frobenius error of O.
    pub o_rel: f64,
    /// Absolute error of the LSE (natural log).
    pub lse_abs: f64,
    /// Relative Frobenius error of dQ, dK and dV.
    pub grad_rel: f64,
}

/// The attention bounds of a kernel element type.
pub fn attention(dtype: Dtype) -> Attention {
    match dtype {
        Dtype::Bf16 => Attention {
            o_rel: 1e-2,
            lse_abs: 1e-3,
            grad_rel: 2e-2,
        },
        Dtype::F16 => Attention {
            o_rel: 2e-3,
            lse_abs: 1e-3,
            grad_rel: 5e-3,
        },
    }
}

/// Bounds for the SDCC kernel against the CPU backend.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sdcc {
    /// Relative error of each pair's KL (and of the weighted sum).
    pub kl_rel: f64,
    /// KLs below this many nats are held to `kl_rel · kl_floor` absolute.
    pub kl_floor: f64,
    /// Relative Frobenius error of the student gradient.
    pub grad_rel: f64,
}

/// The SDCC bounds (every logit type: the exponentials are f32 and the sums
/// f64 whatever it is; see the module docs for why they stay loose).
pub const SDCC: Sdcc = Sdcc {
    kl_rel: 1e-4,
    kl_floor: 1e-2,
    grad_rel: 1e-3,
};

impl Sdcc {
    /// The error of a KL measured as this table holds it: relative to the
    /// reference, or to [`Sdcc::kl_floor`] when the reference is smaller.
    pub fn kl_error(&self, got: f64, want: f64) -> f64 {
        (got - want).abs() / want.abs().max(self.kl_floor)
    }
}

/// `‖got − want‖ / ‖want‖` (Frobenius), in f64; 0 when both are 0. A
/// non-finite element of `got` gives `+inf` (it never passes a bound).
pub fn rel_frobenius(got: impl IntoIterator<Item = f64>, want: &[f64]) -> f64 {
    let (mut num, mut den) = (0.0f64, 0.0f64);
    let mut n = 0;
    for (g, &w) in got.into_iter().zip(want) {
        if !g.is_finite() {
            return f64::INFINITY;
        }
        num += (g - w) * (g - w);
        den += w * w;
        n += 1;
    }
    if n != want.len() {
        return f64::INFINITY;
    }
    if num == 0.0 {
        0.0
    } else {
        (num / den.max(f64::MIN_POSITIVE)).sqrt()
    }
}

/// Largest `|got − want|` over finite pairs where `want` is finite; `+inf`
/// where only one of the two is infinite or `got` is NaN (an LSE of a row
/// with no visible key is `−inf` on both sides and counts 0).
pub fn max_abs(got: impl IntoIterator<Item = f64>, want: &[f64]) -> f64 {
    let mut m = 0.0f64;
    for (g, &w) in got.into_iter().zip(want) {
        let e = if g == w {
            0.0
        } else if g.is_finite() && w.is_finite() {
            (g - w).abs()
        } else {
            f64::INFINITY
        };
        m = m.max(e);
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn measures() {
        assert_eq!(rel_frobenius([1.0, 2.0], &[1.0, 2.0]), 0.0);
        assert!((rel_frobenius([1.0, 0.0], &[0.0, 1.0]) - 2f64.sqrt()).abs() < 1e-15);
        assert_eq!(rel_frobenius([f64::NAN], &[1.0]), f64::INFINITY);
        assert_eq!(rel_frobenius([1.0], &[1.0, 2.0]), f64::INFINITY, "short");
        assert_eq!(
            max_abs([f64::NEG_INFINITY, 1.5], &[f64::NEG_INFINITY, 1.0]),
            0.5
        );
        assert_eq!(max_abs([0.0], &[f64::NEG_INFINITY]), f64::INFINITY);
        assert!((SDCC.kl_error(1e-6 + 1e-9, 1e-6) - 1e-7).abs() < 1e-15);
        assert!(attention(Dtype::F16).o_rel < attention(Dtype::Bf16).o_rel);
    }
}
