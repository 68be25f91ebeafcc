//! The element types of the CPU backend.

use crate::backend::Element;
use std::fmt::{Debug, Display};
use std::ops::{Add, AddAssign, Div, Mul, MulAssign, Neg, Sub, SubAssign};

/// A floating-point element type the CPU backend computes in: implemented
/// for `f32` and `f64`.
///
/// Attention accumulates dot products and softmax sums in `Self` (so `f32`
/// inputs are computed in `f32`, with max-subtraction in the online softmax
/// keeping every `exp` argument `<= 0`); rotary angles and the SDCC loss are
/// computed in `f64` whatever `Self` is.
pub trait CpuFloat:
    Element
    + Copy
    + Send
    + Sync
    + 'static
    + Debug
    + Display
    + Default
    + PartialOrd
    + Add<Output = Self>
    + Sub<Output = Self>
    + Mul<Output = Self>
    + Div<Output = Self>
    + Neg<Output = Self>
    + AddAssign
    + SubAssign
    + MulAssign
{
    /// 0.
    const ZERO: Self;
    /// 1.
    const ONE: Self;
    /// −∞.
    const NEG_INFINITY: Self;
    /// +∞.
    const INFINITY: Self;
    /// `e^self`.
    fn exp(self) -> Self;
    /// `self · a + b` with one rounding.
    fn mul_add(self, a: Self, b: Self) -> Self;
    /// Natural logarithm.
    fn ln(self) -> Self;
    /// Neither NaN nor ±∞.
    fn is_finite(self) -> bool;
    /// `x ← exp(x)` for every element, `exp(−inf) = 0` exactly. Arguments
    /// are `<= 0` in every use (scores minus their max or their LSE). `f64`
    /// calls `f64::exp`; `f32` uses a branch-free polynomial the compiler
    /// vectorizes (within 1 ulp, see `exp_f32`).
    fn exp_in_place(xs: &mut [Self]);
    /// [`Self::exp_in_place`] on one strip of 8 lanes, written so that it
    /// compiles to 8-lane vector code (one AVX register of `f32`) without a
    /// loop or a scalar remainder.
    fn exp_lanes(xs: &mut [Self; 8]);

    /// The larger of the two; `NaN`-free inputs assumed (callers check).
    #[inline(always)]
    fn max_of(self, other: Self) -> Self {
        if other > self {
            other
        } else {
            self
        }
    }
}

macro_rules! impl_cpu_float {
    ($t:ty, $exp:path, $exp_lanes:path) => {
        impl CpuFloat for $t {
            const ZERO: Self = 0.0;
            const ONE: Self = 1.0;
            const NEG_INFINITY: Self = <$t>::NEG_INFINITY;
            const INFINITY: Self = <$t>::INFINITY;
            #[inline(always)]
            fn exp(self) -> Self {
                <$t>::exp(self)
            }
            #[inline(always)]
            fn mul_add(self, a: Self, b: Self) -> Self {
                <$t>::mul_add(self, a, b)
            }
            #[inline(always)]
            fn ln(self) -> Self {
                <$t>::ln(self)
            }
            #[inline(always)]
            fn is_finite(self) -> bool {
                <$t>::is_finite(self)
            }
            #[inline(always)]
            fn exp_in_place(xs: &mut [Self]) {
                for x in xs {
                    *x = $exp(*x);
                }
            }
            #[inline(always)]
            fn exp_lanes(xs: &mut [Self; 8]) {
                $exp_lanes(xs)
            }
        }
    };
}

impl_cpu_float!(f32, exp_f32, exp_f32_lanes);
impl_cpu_float!(f64, f64::exp, exp_f64_lanes);

fn exp_f64_lanes(xs: &mut [f64; 8]) {
    xs.iter_mut().for_each(|x| *x = x.exp());
}

/// `e^x` for `f32` without branches or calls, so that loops over it
/// vectorize: `x = n ln 2 + r` with `n = round(x / ln 2)` (ln 2 split in a
/// high part exact in f32 and a low correction), `e^r` by the minimax
/// polynomial of Cephes' `expf` on `|r| <= ln 2 / 2`, and `2^n` built in the
/// exponent bits. Relative error <= 2 ulp for `x` in `[−87, 88]`; below
/// `−87` (where `e^x` < 1.7e-38, the edge of the normal range) the result is
/// 0, so `exp(−inf) = 0` exactly; NaN is not expected (callers reject it).
#[inline(always)]
fn exp_f32(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Adding and subtracting 1.5 · 2^23 rounds to the nearest integer.
    const ROUND: f32 = 12_582_912.0;
    let xc = x.clamp(-87.0, 88.0);
    let t = xc * LOG2E + ROUND;
    let n = t - ROUND;
    let r = (xc - n * LN2_HI) - n * LN2_LO;
    let mut p = 1.987_569_1e-4_f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let er = p * r * r + r + 1.0;
    // t = 1.5 · 2^23 + n exactly, so its bits are ROUND's plus n: the bits
    // of 2^n in integer arithmetic (no float-to-int conversion, which does
    // not vectorize).
    let two_n = f32::from_bits((t.to_bits().wrapping_sub(ROUND.to_bits()).wrapping_add(127)) << 23);
    if x < -87.0 {
        0.0
    } else {
        er * two_n
    }
}

/// [`exp_f32`] on 8 lanes, one step at a time over all lanes (each step a
/// straight 8-lane loop the compiler turns into one vector instruction):
/// the same operations in the same order, so the same results bit for bit.
#[inline(always)]
fn exp_f32_lanes(xs: &mut [f32; 8]) {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    const ROUND: f32 = 12_582_912.0;
    let lanes = |f: &dyn Fn(usize) -> f32| -> [f32; 8] { std::array::from_fn(f) };
    let xc = lanes(&|j| xs[j].clamp(-87.0, 88.0));
    let t = lanes(&|j| xc[j] * LOG2E + ROUND);
    let n = lanes(&|j| t[j] - ROUND);
    let r = lanes(&|j| (xc[j] - n[j] * LN2_HI) - n[j] * LN2_LO);
    let mut p = [1.987_569_1e-4_f32; 8];
    for c in [
        1.398_199_9e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        1.666_666_5e-1,
        0.5,
    ] {
        p = lanes(&|j| p[j] * r[j] + c);
    }
    let er = lanes(&|j| p[j] * r[j] * r[j] + r[j] + 1.0);
    let two_n = lanes(&|j| {
        f32::from_bits(
            (t[j]
                .to_bits()
                .wrapping_sub(ROUND.to_bits())
                .wrapping_add(127))
                << 23,
        )
    });
    for j in 0..8 {
        xs[j] = if xs[j] < -87.0 { 0.0 } else { er[j] * two_n[j] };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The polynomial against `f64::exp` over the whole argument range the
    /// ops use (x <= 0) and a little above: within 1 ulp relative (1.2e-7;
    /// measured worst 7.9e-8 on these 133k points).
    #[test]
    fn exp_f32_is_within_two_ulp() {
        let mut worst = 0.0f64;
        let mut x = -87.0f32;
        while x <= 10.0 {
            let got = exp_f32(x) as f64;
            let want = (x as f64).exp();
            worst = worst.max((got - want).abs() / want);
            x += 0.000_731;
        }
        assert!(
            worst <= f32::EPSILON as f64,
            "worst relative error {worst:e}"
        );
        assert_eq!(exp_f32(f32::NEG_INFINITY), 0.0);
        // The 8-lane form is the same function, bit for bit.
        let mut x = -90.0f32;
        while x <= 10.0 {
            let mut lanes: [f32; 8] = std::array::from_fn(|j| x + j as f32 * 0.37);
            let want = lanes.map(exp_f32);
            f32::exp_lanes(&mut lanes);
            assert_eq!(lanes.map(f32::to_bits), want.map(f32::to_bits), "at {x}");
            x += 0.0917;
        }
        let mut inf = [f32::NEG_INFINITY; 8];
        f32::exp_lanes(&mut inf);
        assert_eq!(inf, [0.0; 8]);
        assert_eq!(exp_f32(-100.0), 0.0);
        assert_eq!(exp_f32(0.0), 1.0);
    }
}
