//! The element types of the CPU backend: the types it computes in
//! ([`CpuFloat`]: `f32`, `f64`) and the types it takes and returns
//! ([`CpuElement`]: those two, and `bf16`, `f16` computed in `f32`).

use crate::backend::Element;
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
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
    + CpuElement<Compute = Self>
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
    /// `x ← tanh(x)` for every lane (the logit softcap). `f64` calls
    /// `f64::tanh`; `f32` computes `sign(x) · (1 − e) / (1 + e)` with `e =
    /// exp(−2|x|)` from [`Self::exp_lanes`]'s polynomial: an absolute error
    /// within `1.5e-7` (it is `e`'s rounding), branch-free, and the same
    /// operations as the AVX2 body in `lanes`.
    fn tanh_lanes(xs: &mut [Self; 8]);

    /// `xs` as `f32`s when `Self` is `f32` (the bf16 pair products write
    /// `f32` scores), else `None`.
    fn as_f32_mut(xs: &mut [Self]) -> Option<&mut [f32]>;
    /// `xs` as `f32`s when `Self` is `f32`, else `None`.
    fn as_f32(xs: &[Self]) -> Option<&[f32]>;

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
    ($t:ty, $exp:path, $exp_lanes:path, $tanh_lanes:path, $as_f32:expr) => {
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
            #[inline(always)]
            fn tanh_lanes(xs: &mut [Self; 8]) {
                $tanh_lanes(xs)
            }
            #[inline(always)]
            fn as_f32_mut(xs: &mut [Self]) -> Option<&mut [f32]> {
                $as_f32(xs)
            }
            #[inline(always)]
            fn as_f32(xs: &[Self]) -> Option<&[f32]> {
                $as_f32(xs)
            }
        }
    };
}

impl_cpu_float!(f32, exp_f32, exp_f32_lanes, tanh_f32_lanes, Some);
impl_cpu_float!(f64, f64::exp, exp_f64_lanes, tanh_f64_lanes, not_f32);

/// [`CpuFloat::as_f32`] of a type that is not `f32`.
#[inline(always)]
fn not_f32<X, Y>(_: X) -> Option<Y> {
    None
}

/// An element type the CPU backend takes and returns: `f32` and `f64`,
/// computed in themselves, and `bf16` and `f16`, computed in `f32`.
///
/// Inputs are widened exactly (every `bf16` and `f16` is an `f32`) when
/// the backend copies them into its head-major operands, so a call on
/// 16-bit inputs computes exactly what the `f32` call on the widened
/// inputs computes; each result element is then rounded once to `Self`
/// (to nearest, ties to even) as it is stored. Its LSE is an `f32`, as the
/// GPU kernels' is.
pub trait CpuElement: Element + Default {
    /// The type dot products, softmax sums and the LSE are computed in.
    type Compute: CpuFloat;
    /// `bf16`: its block products run on bf16 pairs on the
    /// [`Isa::Avx512Bf16`](super::Isa::Avx512Bf16) path.
    const BF16: bool = false;
    /// `self` as a [`Self::Compute`], exactly.
    fn widen(self) -> Self::Compute;
    /// `dst[i] = src[i]` widened, exactly; equal lengths.
    fn widen_slice(src: &[Self], dst: &mut [Self::Compute]);
    /// `dst[i] = src[i]` rounded to nearest; equal lengths. Returns whether
    /// every stored value is finite, read from `src` (in cache) rather than
    /// from the just-written `dst`: `src` finite and below the first
    /// magnitude that rounds to infinity in `Self`.
    fn narrow_slice(src: &[Self::Compute], dst: &mut [Self]) -> bool;
}

macro_rules! impl_cpu_element_same {
    ($t:ty) => {
        impl CpuElement for $t {
            type Compute = $t;
            #[inline(always)]
            fn widen(self) -> Self {
                self
            }
            #[inline(always)]
            fn widen_slice(src: &[Self], dst: &mut [Self]) {
                dst.copy_from_slice(src);
            }
            #[inline(always)]
            fn narrow_slice(src: &[Self], dst: &mut [Self]) -> bool {
                dst.copy_from_slice(src);
                src.iter().fold(true, |ok, x| ok & x.is_finite())
            }
        }
    };
}

impl_cpu_element_same!(f32);
impl_cpu_element_same!(f64);

macro_rules! impl_cpu_element_half {
    ($t:ty, $overflow:expr, $bf16:expr) => {
        impl CpuElement for $t {
            type Compute = f32;
            const BF16: bool = $bf16;
            #[inline(always)]
            fn widen(self) -> f32 {
                self.to_f32()
            }
            #[inline(always)]
            fn widen_slice(src: &[Self], dst: &mut [f32]) {
                src.convert_to_f32_slice(dst);
            }
            #[inline(always)]
            fn narrow_slice(src: &[f32], dst: &mut [Self]) -> bool {
                dst.convert_from_f32_slice(src);
                // `<` is false for NaN and ±inf too.
                src.iter().fold(true, |ok, x| ok & (x.abs() < $overflow))
            }
        }
    };
}

// The smallest magnitudes that round to infinity: half-way between the
// largest finite value and the next power of two (ties go to the even
// significand, infinity's).
impl_cpu_element_half!(bf16, BF16_OVERFLOW, true);
impl_cpu_element_half!(f16, F16_OVERFLOW, false);

/// bf16's largest finite value is 0x7F7F (3.3895e38); 0x7F7F_8000 as `f32`
/// is half-way to 2^128.
const BF16_OVERFLOW: f32 = f32::from_bits(0x7F7F_8000);
/// f16's largest finite value is 65504; 65520 is half-way to 2^16.
const F16_OVERFLOW: f32 = 65_520.0;

fn exp_f64_lanes(xs: &mut [f64; 8]) {
    xs.iter_mut().for_each(|x| *x = x.exp());
}

fn tanh_f64_lanes(xs: &mut [f64; 8]) {
    xs.iter_mut().for_each(|x| *x = x.tanh());
}

/// [`CpuFloat::tanh_lanes`] for `f32`: `sign(x) · (1 − e) / (1 + e)`, `e =
/// exp(−2|x|)`; `lanes::avx2::softcap` performs the same operations.
#[inline(always)]
fn tanh_f32_lanes(xs: &mut [f32; 8]) {
    let mut e: [f32; 8] = std::array::from_fn(|j| xs[j].abs() * -2.0);
    exp_f32_lanes(&mut e);
    for (x, e) in xs.iter_mut().zip(e) {
        *x = ((1.0 - e) / (1.0 + e)).copysign(*x);
    }
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

    /// Narrowing rounds to nearest even and reports exactly the values that
    /// do not survive it: the last finite values stay finite, the
    /// half-way points round to infinity and are reported, as are NaN and
    /// ±inf; widening is exact.
    #[test]
    fn narrowing_reports_exactly_what_overflows() {
        let below = |x: f32| f32::from_bits(x.to_bits() - 1);
        for (over, max) in [
            (BF16_OVERFLOW, bf16::MAX.to_f32()),
            (F16_OVERFLOW, f16::MAX.to_f32()),
        ] {
            let mut b = [bf16::ZERO; 1];
            let mut h = [f16::ZERO; 1];
            let narrow = |x: f32, b: &mut [bf16; 1], h: &mut [f16; 1]| {
                if over == BF16_OVERFLOW {
                    (bf16::narrow_slice(&[x], b), b[0].is_finite())
                } else {
                    (f16::narrow_slice(&[x], h), h[0].is_finite())
                }
            };
            for x in [max, below(over), -below(over), 1.0, 0.0, -0.0] {
                assert_eq!(narrow(x, &mut b, &mut h), (true, true), "{x}");
            }
            for x in [over, -over, f32::INFINITY, f32::NEG_INFINITY] {
                assert_eq!(narrow(x, &mut b, &mut h), (false, false), "{x}");
            }
            assert!(!narrow(f32::NAN, &mut b, &mut h).0);
        }
        // Ties to even: 1 + 2^-8 lies half-way between bf16 1 and 1 + 2^-7.
        let mut b = [bf16::ZERO; 2];
        assert!(bf16::narrow_slice(
            &[1.0 + 2f32.powi(-8), 1.0 + 3.0 * 2f32.powi(-8)],
            &mut b
        ));
        assert_eq!(b.map(bf16::to_f32), [1.0, 1.0 + 2f32.powi(-6)]);
        let all: Vec<bf16> = (0..=u16::MAX).map(bf16::from_bits).collect();
        let mut wide = vec![0.0f32; all.len()];
        bf16::widen_slice(&all, &mut wide);
        for (x, w) in all.iter().zip(&wide) {
            assert!(x.to_f64() == *w as f64 || x.is_nan() && w.is_nan());
            assert_eq!(x.widen().to_bits(), w.to_bits());
        }
    }
}
