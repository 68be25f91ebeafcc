//! The score products of bf16 inputs on AVX-512 BF16 ([`Isa::Avx512Bf16`]):
//! `S = Q Kᵀ` and `dP = dO Vᵀ` by `vdpbf16ps`, which multiplies 16 pairs
//! of bf16 values of two registers and adds each pair's two products to one
//! f32 lane: 32 products per instruction, twice an f32 FMA's 16.
//!
//! Operands are the f32 operand copies of the call (bf16 inputs widened,
//! rotated when rotary is on) rounded to bf16 and packed in pairs of
//! head-dim lanes, one pair per 32-bit word: *pair rows* `[rows, dp / 2]`
//! (word `p` of a row holds lanes `2p`, `2p + 1`; the query side) and *pair
//! columns* `[tiles, dp / 2, TILE]` (word `j` of pair row `p` of a tile holds
//! lanes `2p`, `2p + 1` of its key `j`; the key side, so that 16 keys' pairs
//! are one contiguous register). Without rotary the rounding gives back the
//! inputs exactly; with it, the rotated values are rounded once more, as the
//! GPU kernels' rotary stage stores them in bf16.
//!
//! The block product keeps an `MR × 64` block of f32 accumulators (16
//! registers) and streams one pair row of 64 keys (4 registers) per step,
//! broadcasting one pair word of each of the `MR` query rows: 16
//! `vdpbf16ps` per step, `dp / 2` steps. It computes whole 64-key rows of
//! each live row block and stores only its live strips (masked stores), so
//! every entry outside the live blocks is left as it was, as
//! [`microkernel::scores`](super::microkernel::scores) does. Products of
//! bf16 values are exact in f32; the sums round once per pair (and the
//! instruction treats bf16 subnormals as 0, values below 1.2e-38), so
//! scores differ from the f32 path's by f32 rounding in a different order.

use super::microkernel::{scores, LiveBlocks, MR, STRIPS};
use super::workspace::{self, Buf};
use super::{CpuElement, CpuFloat, Isa, TILE};
use half::bf16;

/// The two bf16 roundings of `lo`, `hi` in one word (`lo` in the low half,
/// the lane `vdpbf16ps` takes first).
#[inline(always)]
fn pair(lo: f32, hi: f32) -> u32 {
    bf16::from_f32(lo).to_bits() as u32 | (bf16::from_f32(hi).to_bits() as u32) << 16
}

/// Pair rows of `rows` `[n, dp]` (row-major, `dp` even) into `out`
/// `[n, dp / 2]`.
pub(crate) fn to_pair_rows(rows: &[f32], out: &mut [u32]) {
    for (o, x) in out.iter_mut().zip(rows.chunks_exact(2)) {
        *o = pair(x[0], x[1]);
    }
}

/// Pair columns of `columns` `[tiles, dp, TILE]` (the transposed operand
/// copies, `dp` even) into `out` `[tiles, dp / 2, TILE]`.
pub(crate) fn to_pair_columns(columns: &[f32], dp: usize, out: &mut [u32]) {
    for (tile, o) in columns
        .chunks_exact(dp * TILE)
        .zip(out.chunks_exact_mut(dp / 2 * TILE))
    {
        for (two, o) in tile.chunks_exact(2 * TILE).zip(o.chunks_exact_mut(TILE)) {
            let (lo, hi) = two.split_at(TILE);
            for ((o, &a), &b) in o.iter_mut().zip(lo).zip(hi) {
                *o = pair(a, b);
            }
        }
    }
}

/// Whether a call on `S` inputs runs its score products on bf16 pairs:
/// `bf16` inputs on the [`Isa::Avx512Bf16`] path.
pub(crate) fn uses_pairs<S: CpuElement>() -> bool {
    S::BF16 && super::microkernel::isa() == Isa::Avx512Bf16
}

/// Pair rows of an operand copy `rows` (f32; `dp` even) into a pooled
/// buffer.
pub(crate) fn pair_rows<T: CpuFloat>(rows: &[T]) -> Buf<u32> {
    let mut out = workspace::take_stale(rows.len() / 2, 0);
    to_pair_rows(
        T::as_f32(rows).expect("bf16 pairs come from f32 copies"),
        &mut out,
    );
    out
}

/// Pair columns of a transposed operand copy `columns` `[.., dp, TILE]`
/// (f32) into a pooled buffer.
pub(crate) fn pair_columns<T: CpuFloat>(columns: &[T], dp: usize) -> Buf<u32> {
    let mut out = workspace::take_stale(columns.len() / 2, 0);
    let columns = T::as_f32(columns).expect("bf16 pairs come from f32 copies");
    to_pair_columns(columns, dp, &mut out);
    out
}

/// [`scores`] of `TILE` rows of `a` (`dp` columns) against the `TILE`
/// columns of `bt` (row stride `TILE`), or, when `pairs` gives their pair
/// copies (`a`'s rows, `bt`'s columns at the same place) and `T` is `f32`,
/// [`scores_pairs`] of those.
#[inline(always)]
pub(crate) fn scores_or_pairs<T: CpuFloat, const FMA: bool>(
    a: &[T],
    bt: &[T],
    pairs: Option<(&[u32], &[u32])>,
    dp: usize,
    out: &mut [T],
    live: LiveBlocks,
) {
    if let Some((ap, btp)) = pairs {
        if let Some(out) = T::as_f32_mut(out) {
            return scores_pairs(ap, btp, TILE, dp / 2, out, live);
        }
    }
    scores::<T, FMA>(a, bt, TILE, dp, out, live)
}

/// `out[r·TILE + j] = Σ_p a[r·dp2 + p] · bt[p·ld + j]` over bf16 pairs, for
/// `r, j < TILE` in the `live` blocks (others are left as they were): `TILE`
/// pair rows of `a` (`dp2` words each) against the `TILE` keys of pair
/// columns `bt` (row stride `ld >= TILE` words, starting at its first key).
///
/// Only called on the [`Isa::Avx512Bf16`] path; on a CPU without AVX-512
/// BF16 it panics.
pub(crate) fn scores_pairs(
    a: &[u32],
    bt: &[u32],
    ld: usize,
    dp2: usize,
    out: &mut [f32],
    live: LiveBlocks,
) {
    assert!(a.len() >= TILE * dp2 && out.len() >= TILE * TILE && ld >= TILE);
    assert!(dp2 == 0 || bt.len() >= (dp2 - 1) * ld + TILE);
    #[cfg(target_arch = "x86_64")]
    if super::microkernel::best_isa() == Isa::Avx512Bf16 {
        // SAFETY: the running CPU has AVX-512 F, BW and BF16 (checked by
        // `best_isa`), and the bounds are asserted above.
        return unsafe { scores_pairs_avx512(a, bt, ld, dp2, out, live) };
    }
    unreachable!("bf16 pair products on a CPU without AVX-512 BF16")
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn scores_pairs_avx512(
    a: &[u32],
    bt: &[u32],
    ld: usize,
    dp2: usize,
    out: &mut [f32],
    live: LiveBlocks,
) {
    use std::arch::x86_64::*;
    const V: usize = TILE / 16;
    let (a, bt, out) = (a.as_ptr(), bt.as_ptr(), out.as_mut_ptr());
    for rb in 0..TILE / MR {
        let strips = ((live >> (rb * STRIPS)) & ((1 << STRIPS) - 1)) as u32;
        if strips == 0 {
            continue;
        }
        let mut acc = [[_mm512_setzero_ps(); V]; MR];
        for p in 0..dp2 {
            let row = bt.add(p * ld);
            let b: [__m512bh; V] = std::array::from_fn(|v| {
                std::mem::transmute(_mm512_loadu_si512(row.add(16 * v).cast()))
            });
            for (r, acc) in acc.iter_mut().enumerate() {
                let x: __m512bh =
                    std::mem::transmute(_mm512_set1_epi32(*a.add((rb * MR + r) * dp2 + p) as i32));
                for v in 0..V {
                    acc[v] = _mm512_dpbf16_ps(acc[v], x, b[v]);
                }
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            let dst = out.add((rb * MR + r) * TILE);
            for (v, &x) in acc.iter().enumerate() {
                // Strips 2v and 2v + 1 (8 keys each) of this 16-key vector.
                let m = (strips >> (2 * v)) & 3;
                let mask =
                    (if m & 1 != 0 { 0x00ff } else { 0 }) | (if m & 2 != 0 { 0xff00 } else { 0 });
                if mask != 0 {
                    _mm512_mask_storeu_ps(dst.add(16 * v), mask as __mmask16, x);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::microkernel::{block_bit, NS};

    /// Against a scalar f64 sum of the same bf16 products, on blocks with
    /// dead strips and rows (left as they were), when the CPU has the path.
    #[test]
    fn pair_scores_match_the_bf16_products() {
        if super::super::microkernel::best_isa() != Isa::Avx512Bf16 {
            return;
        }
        let dp = 48;
        let dp2 = dp / 2;
        let val = |i: usize, s: u64| (((i as u64 * 2_654_435_761) ^ s) % 997) as f32 / 300.0 - 1.6;
        let rows: Vec<f32> = (0..TILE * dp).map(|i| val(i, 5)).collect();
        let columns: Vec<f32> = (0..2 * dp * TILE).map(|i| val(i, 9)).collect();
        let (mut a, mut bt) = (vec![0; TILE * dp2], vec![0; 2 * dp2 * TILE]);
        to_pair_rows(&rows, &mut a);
        to_pair_columns(&columns, dp, &mut bt);
        let mut live: LiveBlocks = 0;
        for r in (0..TILE).step_by(MR) {
            for cs in 0..STRIPS {
                if !(r / MR + cs).is_multiple_of(3) {
                    live |= block_bit(r, cs);
                }
            }
        }
        let mut out = vec![f32::NAN; TILE * TILE];
        scores_pairs(&a, &bt[dp2 * TILE..], TILE, dp2, &mut out, live);
        let r16 = |x: f32| bf16::from_f32(x).to_f64();
        for r in 0..TILE {
            for j in 0..TILE {
                let got = out[r * TILE + j];
                if live & block_bit(r, j / NS) == 0 {
                    assert!(got.is_nan(), "dead entry ({r}, {j}) written");
                    continue;
                }
                let want: f64 = (0..dp)
                    .map(|c| r16(rows[r * dp + c]) * r16(columns[(dp + c) * TILE + j]))
                    .sum();
                assert!(
                    (got as f64 - want).abs() <= 1e-5 * (1.0 + want.abs()),
                    "({r}, {j}) {got} {want}"
                );
            }
        }
    }
}
