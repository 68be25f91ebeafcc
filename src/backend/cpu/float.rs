//! The element types of the CPU backend.

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
    Copy
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
    const ZERO: Self;
    const ONE: Self;
    const NEG_INFINITY: Self;
    const INFINITY: Self;
    /// `"f32"` or `"f64"`, for messages.
    const NAME: &'static str;

    /// Rounds to nearest.
    fn from_f64(x: f64) -> Self;
    fn to_f64(self) -> f64;
    fn exp(self) -> Self;
    fn ln(self) -> Self;
    fn is_finite(self) -> bool;
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
    ($t:ty, $name:literal) => {
        impl CpuFloat for $t {
            const ZERO: Self = 0.0;
            const ONE: Self = 1.0;
            const NEG_INFINITY: Self = <$t>::NEG_INFINITY;
            const INFINITY: Self = <$t>::INFINITY;
            const NAME: &'static str = $name;
            #[inline(always)]
            fn from_f64(x: f64) -> Self {
                x as $t
            }
            #[inline(always)]
            fn to_f64(self) -> f64 {
                self as f64
            }
            #[inline(always)]
            fn exp(self) -> Self {
                <$t>::exp(self)
            }
            #[inline(always)]
            fn ln(self) -> Self {
                <$t>::ln(self)
            }
            #[inline(always)]
            fn is_finite(self) -> bool {
                <$t>::is_finite(self)
            }
        }
    };
}

impl_cpu_float!(f32, "f32");
impl_cpu_float!(f64, "f64");
