//! The two block products every attention tile is made of, as register-
//! blocked micro-kernels over whole `TILE`-sized, zero-padded blocks.
//!
//! Both keep an `MR × NR` block of accumulators in registers and stream one
//! row of `NR` contiguous values per step, so the inner loop is
//! `MR · NR` independent multiply-adds the compiler vectorizes. The bodies are
//! generic and `#[inline(always)]`; callers that want AVX2 code wrap them in
//! a `#[target_feature]` function (see `attention_fwd`).

use super::layout::LANES;
use super::{CpuFloat, TILE};

const MR: usize = 4;
const NR: usize = LANES;

/// `out[r·TILE + j] = Σ_c a[r·dp + c] · bt[c·ld + j]` for `r, j < TILE`:
/// `TILE` rows of `a` (row-major, `dp` columns) times the `TILE` columns of a
/// transposed operand `bt` (row stride `ld`, starting at its first column).
#[inline(always)]
pub(crate) fn scores<T: CpuFloat>(a: &[T], bt: &[T], ld: usize, dp: usize, out: &mut [T]) {
    let a = &a[..TILE * dp];
    let out = &mut out[..TILE * TILE];
    for rb in (0..TILE).step_by(MR) {
        let rows: [&[T]; MR] = std::array::from_fn(|r| &a[(rb + r) * dp..(rb + r + 1) * dp]);
        for jb in (0..TILE).step_by(NR) {
            let mut acc = [[T::ZERO; NR]; MR];
            for c in 0..dp {
                let b = &bt[c * ld + jb..c * ld + jb + NR];
                for r in 0..MR {
                    let x = rows[r][c];
                    for j in 0..NR {
                        acc[r][j] += x * b[j];
                    }
                }
            }
            for r in 0..MR {
                out[(rb + r) * TILE + jb..(rb + r) * TILE + jb + NR].copy_from_slice(&acc[r]);
            }
        }
    }
}

/// `out[r·dp + c] += Σ_i a[r·TILE + i] · b[i·dp + c]` for `r, i < TILE`,
/// `c < dp`: a `TILE × TILE` block times `TILE` rows of `b` (row-major, `dp`
/// columns), accumulated into `TILE` rows of `out`.
#[inline(always)]
pub(crate) fn accumulate<T: CpuFloat>(a: &[T], b: &[T], dp: usize, out: &mut [T]) {
    let a = &a[..TILE * TILE];
    let b = &b[..TILE * dp];
    let out = &mut out[..TILE * dp];
    for rb in (0..TILE).step_by(MR) {
        let rows: [&[T]; MR] = std::array::from_fn(|r| &a[(rb + r) * TILE..(rb + r + 1) * TILE]);
        for cb in (0..dp).step_by(NR) {
            let mut acc = [[T::ZERO; NR]; MR];
            for r in 0..MR {
                acc[r].copy_from_slice(&out[(rb + r) * dp + cb..(rb + r) * dp + cb + NR]);
            }
            for i in 0..TILE {
                let bv = &b[i * dp + cb..i * dp + cb + NR];
                for r in 0..MR {
                    let x = rows[r][i];
                    for j in 0..NR {
                        acc[r][j] += x * bv[j];
                    }
                }
            }
            for r in 0..MR {
                out[(rb + r) * dp + cb..(rb + r) * dp + cb + NR].copy_from_slice(&acc[r]);
            }
        }
    }
}

/// Whether the running CPU has AVX2 (checked once by std, then cached).
#[inline]
pub(crate) fn has_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}
