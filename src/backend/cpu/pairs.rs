//! The block products of bf16 inputs on AVX-512 BF16 ([`Isa::Avx512Bf16`]),
//! all five by `vdpbf16ps`, which multiplies 16 pairs of bf16 values of two
//! registers and adds each pair's two products to one f32 lane: 32 products
//! per instruction, twice an f32 FMA's 16.
//!
//! **Score products** `S = Q Kᵀ` and `dP = dO Vᵀ` sum over the head dim.
//! Their operands are the f32 operand copies of the call (bf16 inputs
//! widened, rotated when rotary is on) rounded to bf16 and packed in pairs
//! of head-dim lanes, one pair per 32-bit word: *pair rows* `[rows, dp / 2]`
//! (word `p` of a row holds lanes `2p`, `2p + 1`; the query side) and *pair
//! columns* `[tiles, dp / 2, TILE]` (word `j` of pair row `p` of a tile holds
//! lanes `2p`, `2p + 1` of its key `j`; the key side, so that 16 keys' pairs
//! are one contiguous register). Without rotary the rounding gives back the
//! inputs exactly; with it, the rotated values are rounded once more, as the
//! GPU kernels' rotary stage stores them in bf16.
//!
//! **Probability products** `O += P V`, `dQ += dS K` (summing over keys) and
//! `dV += Pᵀ dO`, `dK += dSᵀ Q` (summing over queries) take the block's P or
//! dS rounded to bf16, as the GPU kernels (and torch's CPU flash attention
//! in bf16) round them before these products, against *token pairs*
//! `[n / 2, dp]` of the row operand (word `c` of pair row `p` holds lane
//! `c` of tokens `2p`, `2p + 1`: key pairs of V, K; query pairs of dO, Q),
//! made once per call. The block goes in key pairs ([`block_pairs`]: the
//! bf16 row in order) or query pairs ([`block_pairs_t`]: two rows
//! interleaved), converted per block (a 64th of the block's products). The
//! softmax sums, D = rowsum(dO ∘ O) and every accumulator stay f32; so do
//! the LSE and the P that dS is formed from.
//!
//! Each product keeps an `MR × 64` block of f32 accumulators (16 registers)
//! and streams one pair row of 64 values (4 registers) per step,
//! broadcasting one pair word of each of the `MR` rows: 16 `vdpbf16ps` per
//! step. The score product computes whole 64-key rows of each live row
//! block and stores only its live strips (masked stores), so every entry
//! outside the live blocks is left as it was, as
//! [`microkernel::scores`](super::microkernel::scores) does; the
//! accumulations sum over the live strips (key pairs) or live row blocks
//! (query pairs) only, as [`accumulate`] and [`accumulate_t`] do, and never
//! read the other entries. Products of bf16 values are exact in f32; the
//! sums round once per pair (and the instruction treats bf16 subnormals as
//! 0, values below 1.2e-38). Against the f32 path on the same bf16 inputs,
//! the scores differ by f32 rounding in another order and O and the
//! gradients by about one bf16 rounding of P and dS (2e-3 to 4e-3
//! relative, `tests/it/attention_isa.rs`).

use super::microkernel::{
    accumulate, accumulate_t, bit_runs, row_strips, scores, strip_row_blocks, LiveBlocks, MR, NS,
    STRIPS,
};
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

/// Whether a call on `S` inputs runs its block products on bf16 pairs:
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

/// The index a probability product sums over: keys (`O += P V`,
/// `dQ += dS K`) or queries (`dV += Pᵀ dO`, `dK += dSᵀ Q`).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Sum {
    Keys,
    Queries,
}

/// A `TILE × TILE` block `a` (probabilities or dS) times `TILE` rows of
/// `b`, summed over `sum`, into `out`: [`accumulate`] or [`accumulate_t`];
/// or, when `pairs` gives a scratch for the block's bf16 pairs and the token
/// pairs of `b`'s rows (key or query pairs, as `sum` says) and `T` is
/// `f32`, the block rounded to bf16 ([`block_pairs`], [`block_pairs_t`])
/// times those ([`accumulate_pairs`], [`accumulate_t_pairs`]).
#[inline(always)]
pub(crate) fn accumulate_or_pairs<T: CpuFloat, const FMA: bool>(
    sum: Sum,
    a: &[T],
    b: &[T],
    pairs: Option<(&mut [u32], &[u32])>,
    dp: usize,
    out: &mut [T],
    live: LiveBlocks,
) {
    if let Some((ap, bp)) = pairs {
        if let (Some(a), Some(out)) = (T::as_f32(a), T::as_f32_mut(out)) {
            if sum == Sum::Keys {
                block_pairs(a, live, ap);
                accumulate_pairs(ap, bp, dp, out, live);
            } else {
                block_pairs_t(a, live, ap);
                accumulate_t_pairs(ap, bp, dp, out, live);
            }
            return;
        }
    }
    match sum {
        Sum::Keys => accumulate::<T, FMA>(a, b, dp, out, live),
        Sum::Queries => accumulate_t::<T, FMA>(a, b, dp, out, live),
    }
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

/// The pairs of *token* rows `2p`, `2p + 1` of `rows` `[n, w]` (row-major,
/// `n` even, `w` a multiple of 16) into `out` `[n / 2, w]`: word `(p, c)`
/// holds lanes `c` of both rows. The `B` operand of the probability
/// products, whose sum runs over tokens: V and K rows (key pairs), dO and Q
/// rows (query pairs).
pub(crate) fn token_pairs(rows: &[f32], w: usize, out: &mut [u32]) {
    assert!(w.is_multiple_of(16) && rows.len().is_multiple_of(2 * w));
    assert!(out.len() >= rows.len() / 2);
    for (two, o) in rows.chunks_exact(2 * w).zip(out.chunks_exact_mut(w)) {
        let (lo, hi) = two.split_at(w);
        interleave(lo, hi, o);
    }
}

/// [`token_pairs`] of an operand copy `rows` `[.., w]` (f32) into a pooled
/// buffer.
pub(crate) fn token_pair_copy<T: CpuFloat>(rows: &[T], w: usize) -> Buf<u32> {
    let mut out = workspace::take_stale(rows.len() / 2, 0);
    let rows = T::as_f32(rows).expect("bf16 pairs come from f32 copies");
    token_pairs(rows, w, &mut out);
    out
}

/// The probabilities (or dS) of a `TILE × TILE` block `s` rounded to bf16
/// in their order, for the rows of `live` blocks: `out[r·TILE/2 + p]` holds
/// `s[r][2p]`, `s[r][2p + 1]`, pairs of keys. The `A` operand of
/// [`accumulate_pairs`] (`O += P V`, `dQ += dS K`).
pub(crate) fn block_pairs(s: &[f32], live: LiveBlocks, out: &mut [u32]) {
    assert!(s.len() >= TILE * TILE && out.len() >= TILE * TILE / 2);
    #[cfg(target_arch = "x86_64")]
    if super::microkernel::best_isa() == Isa::Avx512Bf16 {
        // SAFETY: the CPU has AVX-512 F, BW and BF16 (`best_isa`); the
        // lengths are asserted above.
        return unsafe { block_pairs_avx512(s, live, out) };
    }
    unreachable!("bf16 pair products on a CPU without AVX-512 BF16")
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn block_pairs_avx512(s: &[f32], live: LiveBlocks, out: &mut [u32]) {
    use std::arch::x86_64::*;
    let (s, out) = (s.as_ptr(), out.as_mut_ptr());
    for rb in (0..TILE).step_by(MR) {
        if row_strips(live, rb) == 0 {
            continue;
        }
        for r in rb..rb + MR {
            for v in 0..TILE / 16 {
                let x = _mm512_loadu_ps(s.add(r * TILE + 16 * v));
                let y: __m256i = std::mem::transmute(_mm512_cvtneps_pbh(x));
                _mm256_storeu_si256(out.add(r * TILE / 2 + 8 * v).cast(), y);
            }
        }
    }
}

/// The probabilities (or dS) of a `TILE × TILE` block `s` in pairs of
/// *rows*, for the row pairs of `live` row blocks: `out[p·TILE + j]` holds
/// `s[2p][j]`, `s[2p + 1][j]`, pairs of queries. The `A` operand of
/// [`accumulate_t_pairs`] (`dV += Pᵀ dO`, `dK += dSᵀ Q`).
pub(crate) fn block_pairs_t(s: &[f32], live: LiveBlocks, out: &mut [u32]) {
    assert!(s.len() >= TILE * TILE && out.len() >= TILE * TILE / 2);
    for p in 0..TILE / 2 {
        if row_strips(live, 2 * p) != 0 {
            let (lo, hi) = s[2 * p * TILE..(2 * p + 2) * TILE].split_at(TILE);
            interleave(lo, hi, &mut out[p * TILE..(p + 1) * TILE]);
        }
    }
}

/// `out[c]` = the bf16 roundings of `lo[c]` (low half) and `hi[c]`, for
/// `c < out.len()` (a multiple of 16).
#[inline]
fn interleave(lo: &[f32], hi: &[f32], out: &mut [u32]) {
    let w = out.len();
    assert!(w.is_multiple_of(16) && lo.len() >= w && hi.len() >= w);
    #[cfg(target_arch = "x86_64")]
    if super::microkernel::best_isa() == Isa::Avx512Bf16 {
        // SAFETY: the CPU has AVX-512 F, BW and BF16 (`best_isa`); the
        // lengths are asserted above.
        return unsafe { interleave_avx512(lo, hi, out) };
    }
    for ((o, &a), &b) in out.iter_mut().zip(lo).zip(hi) {
        *o = pair(a, b);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn interleave_avx512(lo: &[f32], hi: &[f32], out: &mut [u32]) {
    use std::arch::x86_64::*;
    // Word j of the result takes bf16 lanes j (from `lo`) and 16 + j (from
    // `hi`) of the two-row conversion.
    let idx = _mm512_set_epi16(
        31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4,
        19, 3, 18, 2, 17, 1, 16, 0,
    );
    for c in (0..out.len()).step_by(16) {
        let a = _mm512_loadu_ps(lo.as_ptr().add(c));
        let b = _mm512_loadu_ps(hi.as_ptr().add(c));
        let both: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(b, a));
        let words = _mm512_permutexvar_epi16(idx, both);
        _mm512_storeu_si512(out.as_mut_ptr().add(c).cast(), words);
    }
}

/// `out[r·dp + c] += Σ_p a[r·TILE/2 + p] · b[p·dp + c]` over bf16 pairs,
/// for `r < TILE`, `c < dp`, over the key pairs `p` of `r`'s live strips
/// (the others are not read): a block's [`block_pairs`] times the key pairs
/// [`token_pairs`] of its `TILE` keys (row stride `dp` words), accumulated
/// into `TILE` rows of f32 `out`. The pair form of
/// [`accumulate`](super::microkernel::accumulate).
pub(crate) fn accumulate_pairs(a: &[u32], b: &[u32], dp: usize, out: &mut [f32], live: LiveBlocks) {
    assert!(a.len() >= TILE * TILE / 2 && b.len() >= TILE / 2 * dp);
    assert!(out.len() >= TILE * dp && dp.is_multiple_of(16));
    #[cfg(target_arch = "x86_64")]
    if super::microkernel::best_isa() == Isa::Avx512Bf16 {
        let (a, b, out) = (a.as_ptr(), b.as_ptr(), out.as_mut_ptr());
        for rb in (0..TILE).step_by(MR) {
            let strips = row_strips(live, rb);
            if strips == 0 {
                continue;
            }
            let runs = bit_runs(strips, NS / 2);
            // SAFETY: AVX-512 BF16 is there (`best_isa`); rows `rb..rb +
            // MR` of `a` and `out`, and pair rows below `TILE / 2` of `b`,
            // are within the lengths asserted above.
            let x = |p: usize| std::array::from_fn(|r| unsafe { *a.add((rb + r) * TILE / 2 + p) });
            unsafe { pair_columns_blocks(out, b, dp, rb, runs, x) };
        }
        return;
    }
    unreachable!("bf16 pair products on a CPU without AVX-512 BF16")
}

/// `out[r·dp + c] += Σ_p a[p·TILE + r] · b[p·dp + c]` over bf16 pairs, for
/// `r < TILE` (keys), `c < dp`, over the query pairs `p` of the live row
/// blocks of `r`'s strip (the others are not read): a block's
/// [`block_pairs_t`] times the query pairs [`token_pairs`] of its `TILE`
/// query rows, accumulated into `TILE` key rows of f32 `out`. The pair form
/// of [`accumulate_t`](super::microkernel::accumulate_t).
pub(crate) fn accumulate_t_pairs(
    a: &[u32],
    b: &[u32],
    dp: usize,
    out: &mut [f32],
    live: LiveBlocks,
) {
    assert!(a.len() >= TILE * TILE / 2 && b.len() >= TILE / 2 * dp);
    assert!(out.len() >= TILE * dp && dp.is_multiple_of(16));
    #[cfg(target_arch = "x86_64")]
    if super::microkernel::best_isa() == Isa::Avx512Bf16 {
        let (a, b, out) = (a.as_ptr(), b.as_ptr(), out.as_mut_ptr());
        for cs in 0..STRIPS {
            let blocks = strip_row_blocks(live, cs);
            if blocks == 0 {
                continue;
            }
            let runs = bit_runs(blocks, MR / 2);
            for rb in (cs * NS..(cs + 1) * NS).step_by(MR) {
                // SAFETY: as in `accumulate_pairs`; key rows `rb..rb + MR`
                // are below `TILE`.
                let x = |p: usize| std::array::from_fn(|r| unsafe { *a.add(p * TILE + rb + r) });
                unsafe { pair_columns_blocks(out, b, dp, rb, runs.clone(), x) };
            }
        }
        return;
    }
    unreachable!("bf16 pair products on a CPU without AVX-512 BF16")
}

/// Output rows `rb..rb + MR` of [`accumulate_pairs`] and
/// [`accumulate_t_pairs`], all `dp` columns, in `MR × 64` register blocks
/// (then 32, 16): `out[(rb + r)·dp + c] += Σ_p x(p)[r] · b[p·dp + c]` over
/// the pair ranges `runs`. They differ only in where pair `p` finds its
/// `MR` multipliers.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn pair_columns_blocks(
    out: *mut f32,
    b: *const u32,
    dp: usize,
    rb: usize,
    runs: impl Iterator<Item = (usize, usize)> + Clone,
    x: impl Fn(usize) -> [u32; MR],
) {
    let mut cb = 0;
    while cb + 64 <= dp {
        pair_block::<4>(out, b, dp, rb, cb, runs.clone(), &x);
        cb += 64;
    }
    if cb + 32 <= dp {
        pair_block::<2>(out, b, dp, rb, cb, runs.clone(), &x);
        cb += 32;
    }
    if cb < dp {
        pair_block::<1>(out, b, dp, rb, cb, runs, &x);
    }
}

/// One `MR × 16·V` block of [`pair_columns_blocks`]: columns `cb..cb +
/// 16·V`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
#[inline]
unsafe fn pair_block<const V: usize>(
    out: *mut f32,
    b: *const u32,
    dp: usize,
    rb: usize,
    cb: usize,
    runs: impl Iterator<Item = (usize, usize)>,
    x: &impl Fn(usize) -> [u32; MR],
) {
    use std::arch::x86_64::*;
    let mut acc = [[_mm512_setzero_ps(); V]; MR];
    for (r, acc) in acc.iter_mut().enumerate() {
        for (v, acc) in acc.iter_mut().enumerate() {
            *acc = _mm512_loadu_ps(out.add((rb + r) * dp + cb + 16 * v));
        }
    }
    for (p0, p1) in runs {
        for p in p0..p1 {
            let row = b.add(p * dp + cb);
            let bv: [__m512bh; V] = std::array::from_fn(|v| {
                std::mem::transmute(_mm512_loadu_si512(row.add(16 * v).cast()))
            });
            for (acc, xr) in acc.iter_mut().zip(x(p)) {
                let xv: __m512bh = std::mem::transmute(_mm512_set1_epi32(xr as i32));
                for v in 0..V {
                    acc[v] = _mm512_dpbf16_ps(acc[v], xv, bv[v]);
                }
            }
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        for (v, &acc) in acc.iter().enumerate() {
            _mm512_storeu_ps(out.add((rb + r) * dp + cb + 16 * v), acc);
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

    /// A block mask with dead blocks in every row block and strip, and one
    /// fully dead row block.
    fn ragged_live() -> LiveBlocks {
        let mut live: LiveBlocks = 0;
        for r in (0..TILE).step_by(MR) {
            for cs in 0..STRIPS {
                if r / MR != 5 && !(r / MR + 2 * cs).is_multiple_of(5) {
                    live |= block_bit(r, cs);
                }
            }
        }
        live
    }

    /// `accumulate_pairs` and `accumulate_t_pairs`, with the block and
    /// token pairs made by `block_pairs`, `block_pairs_t` and
    /// `token_pairs`, against scalar f64 sums of the same bf16 products
    /// over the live entries only: dead entries of the block are NaN, so
    /// reading one would show; `out` starts from values the products add
    /// to; head dims 64 + 32 + 16 (every register block width) and 48.
    #[test]
    fn pair_accumulations_match_the_bf16_products() {
        if super::super::microkernel::best_isa() != Isa::Avx512Bf16 {
            return;
        }
        let val = |i: usize, s: u64| (((i as u64 * 2_654_435_761) ^ s) % 997) as f32 / 300.0 - 1.6;
        let r16 = |x: f32| bf16::from_f32(x).to_f64();
        let live = ragged_live();
        let is_live = |r: usize, j: usize| live & block_bit(r, j / NS) != 0;
        let block: Vec<f32> = (0..TILE * TILE)
            .map(|i| {
                if is_live(i / TILE, i % TILE) {
                    val(i, 3)
                } else {
                    f32::NAN
                }
            })
            .collect();
        for dp in [112, 48] {
            let rows: Vec<f32> = (0..TILE * dp).map(|i| val(i, 11)).collect();
            let start: Vec<f32> = (0..TILE * dp).map(|i| val(i, 17)).collect();
            let mut b = vec![0; TILE / 2 * dp];
            token_pairs(&rows, dp, &mut b);
            let mut a = vec![0; TILE * TILE / 2];
            for transposed in [false, true] {
                let mut out = start.clone();
                if transposed {
                    block_pairs_t(&block, live, &mut a);
                    accumulate_t_pairs(&a, &b, dp, &mut out, live);
                } else {
                    block_pairs(&block, live, &mut a);
                    accumulate_pairs(&a, &b, dp, &mut out, live);
                }
                for r in 0..TILE {
                    for c in 0..dp {
                        // Row r of the product: a query row (P V), or a key
                        // column of the block (Pᵀ dO).
                        let want: f64 = start[r * dp + c] as f64
                            + (0..TILE)
                                .filter(|&i| {
                                    if transposed {
                                        is_live(i, r)
                                    } else {
                                        is_live(r, i)
                                    }
                                })
                                .map(|i| {
                                    let x = if transposed {
                                        block[i * TILE + r]
                                    } else {
                                        block[r * TILE + i]
                                    };
                                    r16(x) * r16(rows[i * dp + c])
                                })
                                .sum::<f64>();
                        let got = out[r * dp + c] as f64;
                        assert!(
                            (got - want).abs() <= 1e-5 * (1.0 + want.abs()),
                            "transposed {transposed}, dp {dp}, ({r}, {c}): {got} {want}"
                        );
                    }
                }
            }
        }
    }

    /// The vector interleave gives `pair`'s words.
    #[test]
    fn token_pairs_are_the_scalar_pairs() {
        let rows: Vec<f32> = (0..6 * 32).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
        let mut out = vec![0; 3 * 32];
        token_pairs(&rows, 32, &mut out);
        for p in 0..3 {
            for c in 0..32 {
                let want = pair(rows[2 * p * 32 + c], rows[(2 * p + 1) * 32 + c]);
                assert_eq!(out[p * 32 + c], want, "({p}, {c})");
            }
        }
    }
}
