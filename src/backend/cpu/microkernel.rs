//! The block products every attention tile is made of, as register-blocked
//! micro-kernels over whole `TILE`-sized, zero-padded blocks: scores
//! `S = Q Kᵀ` (and `dP = dO Vᵀ`), `O += P V` (and `dQ += dS K`), and the
//! transposed `dV += Pᵀ dO`, `dK += dSᵀ Q`. Every pass computes its blocks
//! with query rows and key columns, so one block mask serves all of them.
//!
//! Each keeps an `MR × NR` block of accumulators in registers and streams
//! one row of `NR` contiguous values per step, so the inner loop is
//! `MR · NR` independent multiply-adds the compiler vectorizes. The bodies are
//! generic and `#[inline(always)]`; the work items that call them are
//! defined with [`simd_dispatch`], which runs a copy compiled for AVX-512 or
//! for AVX2 and FMA (`FMA = true`) where the CPU has them ([`isa`]) and
//! `FMA = false` elsewhere. On the AVX-512 path the blocks are wider (up to
//! `MR × 64`: 16 of its 32 registers hold accumulators, each step loads up
//! to 4 vectors of a row and broadcasts `MR` values for up to 16
//! multiply-adds), the same operations per output element in the same
//! order, so the same bits as the AVX2 path.

use super::operands::LANES;
use super::{CpuFloat, TILE};

/// Rows of a register block: query rows (key rows of the dK, dV
/// accumulators in [`accumulate_t`]).
pub(crate) const MR: usize = 4;
const NR: usize = LANES;
/// Strip of keys that a register block covers: the unit of skipping and
/// masking, and the summed index's unit in `accumulate` (a divisor of
/// `TILE`, independent of the head dim).
/// `scores` computes a run of live strips as `MR × 2·NS` blocks from its
/// start, and an odd strip at its end as an `MR × NS` block.
pub(crate) const NS: usize = 8;
/// Strips per tile row.
pub(crate) const STRIPS: usize = TILE / NS;

/// Which `MR × NS` register blocks of a `TILE × TILE` tile are computed: bit
/// `(r / MR) · STRIPS + c / NS` covers rows `r..r + MR` and columns
/// `c..c + NS`. A clear bit means every entry of the block is masked: the
/// kernels neither compute nor read it, and the softmax steps leave it alone
/// (its probabilities are 0).
pub(crate) type LiveBlocks = u128;

const _: () = assert!((TILE / MR) * STRIPS == LiveBlocks::BITS as usize);
// `score_block` names the rows of a register block one by one.
const _: () = assert!(MR == 4);
/// Every block computed.
#[cfg(test)]
pub(crate) const ALL_LIVE: LiveBlocks = LiveBlocks::MAX;

/// The bit of the block of rows `r..r + MR` and strip `cs` in [`LiveBlocks`].
#[inline(always)]
pub(crate) fn block_bit(r: usize, cs: usize) -> LiveBlocks {
    1 << (r / MR * STRIPS + cs)
}

/// The live strips of row `r` (bit `c` = strip `c`).
#[inline(always)]
pub(crate) fn row_strips(live: LiveBlocks, r: usize) -> u32 {
    ((live >> (r / MR * STRIPS)) & ((1 << STRIPS) - 1)) as u32
}

/// The ranges `[a · unit, b · unit)` of the runs of consecutive set bits
/// `a .. b` of `bits`, in order: live strips of a row (`unit` = [`NS`]
/// columns, as [`row_strips`] returns them) or live row blocks of a strip
/// (`unit` = [`MR`] rows).
#[inline(always)]
pub(crate) fn bit_runs(bits: u32, unit: usize) -> impl Iterator<Item = (usize, usize)> + Clone {
    let mut rest = bits;
    std::iter::from_fn(move || {
        if rest == 0 {
            return None;
        }
        let a = rest.trailing_zeros();
        let n = (!(rest >> a)).trailing_zeros();
        rest &= !((((1u64 << n) - 1) << a) as u32);
        Some((a as usize * unit, (a + n) as usize * unit))
    })
}

/// The indices of the live strips in `strips` (as [`row_strips`] returns),
/// in order.
#[inline(always)]
pub(crate) fn live_strip_indices(strips: u32) -> impl Iterator<Item = usize> {
    let mut rest = strips;
    std::iter::from_fn(move || {
        if rest == 0 {
            return None;
        }
        let c = rest.trailing_zeros() as usize;
        rest &= rest - 1;
        Some(c)
    })
}

/// Strip `c` of a tile row, as an `NS`-lane array.
#[inline(always)]
pub(crate) fn strip<T>(row: &mut [T], c: usize) -> &mut [T; NS] {
    (&mut row[c * NS..(c + 1) * NS])
        .try_into()
        .expect("NS lanes")
}

/// The live strips of a `TILE`-long tile row, as `NS`-lane arrays, in order.
#[inline(always)]
pub(crate) fn live_strips<T>(row: &mut [T], strips: u32) -> impl Iterator<Item = &mut [T; NS]> {
    row[..TILE]
        .chunks_exact_mut(NS)
        .enumerate()
        .filter(move |(c, _)| strips >> c & 1 == 1)
        .map(|(_, x)| x.try_into().expect("NS lanes"))
}

/// `out[r·TILE + j] = Σ_c a[r·dp + c] · bt[c·ld + j]` for `r, j < TILE` in
/// the `live` blocks (others are left as they were): `TILE` rows of `a`
/// (row-major, `dp` columns) times the `TILE` columns of a transposed operand
/// `bt` (row stride `ld`, starting at its first column).
#[inline(always)]
pub(crate) fn scores<T: CpuFloat, const FMA: bool>(
    a: &[T],
    bt: &[T],
    ld: usize,
    dp: usize,
    out: &mut [T],
    live: LiveBlocks,
) {
    scores_in::<T, FMA>(
        a,
        bt,
        ld,
        dp,
        out,
        live,
        wide_blocks() && live == LiveBlocks::MAX,
    )
}

/// Whether the block products use the wide register blocks (up to
/// `MR × 64` accumulators, 16 of the 32 AVX-512 registers): on the AVX-512
/// path only, where they fit in registers (with AVX2's 16 they would spill),
/// and (at the call sites) only on tiles whose blocks are all live: on
/// partial tiles they made trees' fwd+bwd 15–20 % slower (BENCHMARKS §9).
/// Each output element gets the same operations in the same order either
/// way, so the same bits.
#[inline(always)]
fn wide_blocks() -> bool {
    matches!(isa(), Isa::Avx512 | Isa::Avx512Bf16)
}

/// [`scores`], with the wide register blocks when `wide`.
#[inline(always)]
fn scores_in<T: CpuFloat, const FMA: bool>(
    a: &[T],
    bt: &[T],
    ld: usize,
    dp: usize,
    out: &mut [T],
    live: LiveBlocks,
    wide: bool,
) {
    let a = &a[..TILE * dp];
    let out = &mut out[..TILE * TILE];
    // Every column block read below ends within the first `TILE` columns of
    // row `dp - 1`.
    let bt = &bt[..(dp - 1) * ld + TILE];
    for rb in (0..TILE).step_by(MR) {
        let strips = row_strips(live, rb);
        if strips == 0 {
            continue;
        }
        let rows: [&[T]; MR] = std::array::from_fn(|r| &a[(rb + r) * dp..(rb + r + 1) * dp]);
        let out = &mut out[rb * TILE..(rb + MR) * TILE];
        // Each run of live strips in blocks of two strips from its start,
        // and one narrow block for an odd strip at its end.
        for (a, b) in bit_runs(strips, NS) {
            let mut jb = a;
            if wide {
                while jb + 8 * NS <= b {
                    score_block::<T, FMA, { 8 * NS }>(&rows, bt, ld, jb, out);
                    jb += 8 * NS;
                }
                if jb + 4 * NS <= b {
                    score_block::<T, FMA, { 4 * NS }>(&rows, bt, ld, jb, out);
                    jb += 4 * NS;
                }
            }
            while jb + 2 * NS <= b {
                score_block::<T, FMA, { 2 * NS }>(&rows, bt, ld, jb, out);
                jb += 2 * NS;
            }
            if jb < b {
                score_block::<T, FMA, NS>(&rows, bt, ld, jb, out);
            }
        }
    }
}

/// One `MR × W` block of [`scores`]: columns `jb..jb + W` of the `MR` rows
/// whose `TILE`-wide output rows are `out`.
#[inline(always)]
fn score_block<T: CpuFloat, const FMA: bool, const W: usize>(
    rows: &[&[T]; MR],
    bt: &[T],
    ld: usize,
    jb: usize,
    out: &mut [T],
) {
    let mut acc = [[T::ZERO; W]; MR];
    let [r0, r1, r2, r3] = *rows;
    let xs = r0.iter().zip(r1).zip(r2).zip(r3);
    for (b, (((&x0, &x1), &x2), &x3)) in bt[jb..].chunks(ld).zip(xs) {
        let b: &[T; W] = b[..W].try_into().expect("W columns");
        for (r, x) in [x0, x1, x2, x3].into_iter().enumerate() {
            for j in 0..W {
                acc[r][j] = madd::<T, FMA>(x, b[j], acc[r][j]);
            }
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        out[r * TILE + jb..r * TILE + jb + W].copy_from_slice(acc);
    }
}

/// `out[r·dp + c] += Σ_i a[r·TILE + i] · b[i·dp + c]` for `r < TILE`,
/// `c < dp`, over the `i < TILE` of the `live` blocks of `a` (the others
/// are taken as 0 and not read): a `TILE × TILE` block times `TILE` rows of
/// `b` (row-major, `dp` columns), accumulated into `TILE` rows of `out`.
#[inline(always)]
pub(crate) fn accumulate<T: CpuFloat, const FMA: bool>(
    a: &[T],
    b: &[T],
    dp: usize,
    out: &mut [T],
    live: LiveBlocks,
) {
    accumulate_in::<T, FMA>(
        a,
        b,
        dp,
        out,
        live,
        wide_blocks() && live == LiveBlocks::MAX,
    )
}

/// [`accumulate`], with the wide register blocks when `wide`.
#[inline(always)]
fn accumulate_in<T: CpuFloat, const FMA: bool>(
    a: &[T],
    b: &[T],
    dp: usize,
    out: &mut [T],
    live: LiveBlocks,
    wide: bool,
) {
    let a = &a[..TILE * TILE];
    let b = &b[..TILE * dp];
    let out = &mut out[..TILE * dp];
    for rb in (0..TILE).step_by(MR) {
        let strips = row_strips(live, rb);
        if strips == 0 {
            continue;
        }
        let rows: [&[T]; MR] = std::array::from_fn(|r| &a[(rb + r) * TILE..(rb + r + 1) * TILE]);
        let x = |i: usize| -> [T; MR] { std::array::from_fn(|r| rows[r][i]) };
        register_block::<T, FMA>(out, b, dp, rb, bit_runs(strips, NS), x, wide);
    }
}

/// `out[(rb + r)·dp + c] += Σ_i x(i)[r] · b[i·dp + c]` for `r < MR`, all
/// `c < dp`, over the `i` of `runs` (ranges of rows of `b`): the register
/// blocks of [`accumulate`] and [`accumulate_t`], which differ only in
/// where a row `i` of `b` finds its `MR` multipliers.
#[inline(always)]
fn register_block<T: CpuFloat, const FMA: bool>(
    out: &mut [T],
    b: &[T],
    dp: usize,
    rb: usize,
    runs: impl Iterator<Item = (usize, usize)> + Clone,
    x: impl Fn(usize) -> [T; MR],
    wide: bool,
) {
    let mut cb = 0;
    if wide {
        while cb + 4 * NR <= dp {
            register_block_w::<T, FMA, { 4 * NR }>(out, b, dp, rb, cb, runs.clone(), &x);
            cb += 4 * NR;
        }
        if cb + 2 * NR <= dp {
            register_block_w::<T, FMA, { 2 * NR }>(out, b, dp, rb, cb, runs.clone(), &x);
            cb += 2 * NR;
        }
    }
    while cb < dp {
        register_block_w::<T, FMA, NR>(out, b, dp, rb, cb, runs.clone(), &x);
        cb += NR;
    }
}

/// One `MR × W` block of [`register_block`]: columns `cb..cb + W`.
#[inline(always)]
fn register_block_w<T: CpuFloat, const FMA: bool, const W: usize>(
    out: &mut [T],
    b: &[T],
    dp: usize,
    rb: usize,
    cb: usize,
    runs: impl Iterator<Item = (usize, usize)>,
    x: &impl Fn(usize) -> [T; MR],
) {
    let mut acc = [[T::ZERO; W]; MR];
    for r in 0..MR {
        acc[r].copy_from_slice(&out[(rb + r) * dp + cb..(rb + r) * dp + cb + W]);
    }
    for (i0, i1) in runs {
        for i in i0..i1 {
            let bv: &[T; W] = b[i * dp + cb..i * dp + cb + W]
                .try_into()
                .expect("W columns");
            let xs = x(i);
            for r in 0..MR {
                for j in 0..W {
                    acc[r][j] = madd::<T, FMA>(xs[r], bv[j], acc[r][j]);
                }
            }
        }
    }
    for r in 0..MR {
        out[(rb + r) * dp + cb..(rb + r) * dp + cb + W].copy_from_slice(&acc[r]);
    }
}

/// The query row blocks of strip `cs` that `live` holds: bit `qb` stands for
/// rows `qb·MR .. qb·MR + MR` of that strip's columns.
#[inline(always)]
pub(crate) fn strip_row_blocks(live: LiveBlocks, cs: usize) -> u32 {
    let mut blocks = 0;
    for qb in 0..TILE / MR {
        blocks |= ((live >> (qb * STRIPS + cs)) as u32 & 1) << qb;
    }
    blocks
}

/// `out[r·dp + c] += Σ_i a[i·TILE + r] · b[i·dp + c]` for `r < TILE`,
/// `c < dp`, over the rows `i` of `a` whose block in column `r`'s strip is
/// `live` (the others are taken as 0 and not read): the transpose of a
/// `TILE × TILE` block (rows `i` = queries, columns `r` = keys) times `TILE`
/// rows of `b` (row-major, `dp` columns), accumulated into `TILE` rows of
/// `out` (dV += Pᵀ dO, dK += dSᵀ Q). Each step broadcasts `MR` consecutive
/// values of a row of `a` against one row of `NR` values of `b`, the same
/// `MR × NR` register block as [`accumulate`].
#[inline(always)]
pub(crate) fn accumulate_t<T: CpuFloat, const FMA: bool>(
    a: &[T],
    b: &[T],
    dp: usize,
    out: &mut [T],
    live: LiveBlocks,
) {
    accumulate_t_in::<T, FMA>(
        a,
        b,
        dp,
        out,
        live,
        wide_blocks() && live == LiveBlocks::MAX,
    )
}

/// [`accumulate_t`], with the wide register blocks when `wide`.
#[inline(always)]
fn accumulate_t_in<T: CpuFloat, const FMA: bool>(
    a: &[T],
    b: &[T],
    dp: usize,
    out: &mut [T],
    live: LiveBlocks,
    wide: bool,
) {
    let a = &a[..TILE * TILE];
    let b = &b[..TILE * dp];
    let out = &mut out[..TILE * dp];
    for cs in 0..STRIPS {
        let blocks = strip_row_blocks(live, cs);
        if blocks == 0 {
            continue;
        }
        for rb in (cs * NS..(cs + 1) * NS).step_by(MR) {
            let x =
                |i: usize| -> [T; MR] { a[i * TILE + rb..][..MR].try_into().expect("MR values") };
            register_block::<T, FMA>(out, b, dp, rb, bit_runs(blocks, MR), x, wide);
        }
    }
}

/// `acc + x · y`, fused (one rounding) when `FMA`. Only instantiate
/// `FMA = true` inside functions compiled with the `fma` target feature:
/// elsewhere `mul_add` is a slow library call.
#[inline(always)]
fn madd<T: CpuFloat, const FMA: bool>(x: T, y: T, acc: T) -> T {
    if FMA {
        x.mul_add(y, acc)
    } else {
        acc + x * y
    }
}

/// Defines a work-item function `$name` that runs `$body::<T, true>` in a
/// copy compiled for AVX-512 (F, VL, BW, DQ) or for AVX2 and FMA, as
/// [`isa`] chooses, and the portable `$body::<T, false>` elsewhere. The two
/// SIMD copies are the same code (the same operations in the same order,
/// fused multiply-adds in both) compiled for different registers, so they
/// give the same bits. Written `fn $name<S>(..)`, the function is generic
/// over the caller's element type too (`T` computing, `S: CpuElement<Compute
/// = T>` stored) and runs `$body::<T, S, _>`.
macro_rules! simd_dispatch {
    ($(#[$doc:meta])* fn $name:ident($($arg:ident: $ty:ty),* $(,)?) -> $ret:ty => $body:ident) => {
        $crate::backend::cpu::microkernel::simd_dispatch! {
            @fn [$(#[$doc])*] $name [T: CpuFloat] [T] ($($arg: $ty),*) -> $ret => $body
        }
    };
    ($(#[$doc:meta])* fn $name:ident<S>($($arg:ident: $ty:ty),* $(,)?) -> $ret:ty => $body:ident) => {
        $crate::backend::cpu::microkernel::simd_dispatch! {
            @fn [$(#[$doc])*]
            $name [T: CpuFloat, S: $crate::backend::cpu::CpuElement<Compute = T>] [T, S]
            ($($arg: $ty),*) -> $ret => $body
        }
    };
    (@fn [$($attr:tt)*] $name:ident [$($g:tt)*] [$($p:ident),*] ($($arg:ident: $ty:ty),*) -> $ret:ty => $body:ident) => {
        $($attr)*
        fn $name<$($g)*>($($arg: $ty),*) -> $ret {
            #[cfg(target_arch = "x86_64")]
            match $crate::backend::cpu::microkernel::isa() {
                $crate::backend::cpu::Isa::Avx512 | $crate::backend::cpu::Isa::Avx512Bf16 => {
                    #[target_feature(enable = "avx512f,avx512vl,avx512bw,avx512dq,avx2,fma")]
                    unsafe fn avx512<$($g)*>($($arg: $ty),*) -> $ret {
                        $body::<$($p,)* true>($($arg),*)
                    }
                    // SAFETY: the running CPU supports AVX-512 F, VL, BW,
                    // DQ, AVX2 and FMA (checked at run time).
                    return unsafe { avx512($($arg),*) };
                }
                $crate::backend::cpu::Isa::Avx2Fma => {
                    #[target_feature(enable = "avx2,fma")]
                    unsafe fn avx2<$($g)*>($($arg: $ty),*) -> $ret {
                        $body::<$($p,)* true>($($arg),*)
                    }
                    // SAFETY: the running CPU supports AVX2 and FMA (checked
                    // at run time).
                    return unsafe { avx2($($arg),*) };
                }
                $crate::backend::cpu::Isa::Portable => {}
            }
            $body::<$($p,)* false>($($arg),*)
        }
    };
}
pub(crate) use simd_dispatch;

use super::Isa;
use std::sync::atomic::{AtomicU8, Ordering};

/// The code path in use: 0 until first asked, else `Isa as u8 + 1`.
static ISA: AtomicU8 = AtomicU8::new(0);

/// The code path the work items run: decided once per process from the CPU
/// and the environment (see [`super::isa`]), or set by [`force_isa`].
#[inline]
pub(crate) fn isa() -> Isa {
    match ISA.load(Ordering::Relaxed) {
        1 => Isa::Portable,
        2 => Isa::Avx2Fma,
        3 => Isa::Avx512,
        4 => Isa::Avx512Bf16,
        _ => {
            let chosen = isa_from_env(best_isa());
            // A racing first call decides the same way; a `force_isa` in
            // between wins.
            let _ = ISA.compare_exchange(0, chosen as u8 + 1, Ordering::Relaxed, Ordering::Relaxed);
            isa()
        }
    }
}

/// `isa`, run from now on if the running CPU has it (else nothing changes
/// and the result is `false`).
pub(crate) fn force_isa(isa: Isa) -> bool {
    if isa > best_isa() {
        return false;
    }
    ISA.store(isa as u8 + 1, Ordering::Relaxed);
    true
}

/// What the environment asks for, within `best` (what the CPU has):
/// `TREEATTN_PORTABLE=1` or `TREEATTN_ISA=portable` the portable copy,
/// `TREEATTN_ISA=avx2` at most AVX2, `TREEATTN_ISA=avx512` at most AVX-512
/// without the BF16 dot products, `TREEATTN_ISA=avx512+bf16` at most with
/// them; otherwise the default, [`default_isa`].
fn isa_from_env(best: Isa) -> Isa {
    if std::env::var("TREEATTN_PORTABLE").is_ok_and(|v| v.trim() == "1") {
        return Isa::Portable;
    }
    let wanted = match std::env::var("TREEATTN_ISA").as_deref().map(str::trim) {
        Ok("portable") => Isa::Portable,
        Ok("avx2") | Ok("avx2+fma") => Isa::Avx2Fma,
        Ok("avx512") => Isa::Avx512,
        Ok("avx512+bf16") | Ok("avx512bf16") => Isa::Avx512Bf16,
        _ => default_isa(best),
    };
    wanted.min(best)
}

/// The code path run when the environment does not choose: the best the
/// CPU has (BENCHMARKS.md §9: AVX-512, with wide blocks on fully live
/// tiles only, took 0.59–0.66× the AVX2 path's time on trees and causal).
fn default_isa(best: Isa) -> Isa {
    best
}

/// The best code path the running CPU supports (checked by std, cached).
pub(crate) fn best_isa() -> Isa {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        if !cpu_has_avx2_fma() {
            Isa::Portable
        } else if has!("avx512f") && has!("avx512vl") && has!("avx512bw") && has!("avx512dq") {
            if has!("avx512bf16") {
                Isa::Avx512Bf16
            } else {
                Isa::Avx512
            }
        } else {
            Isa::Avx2Fma
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        Isa::Portable
    }
}

/// Whether the work items run one of their SIMD copies (AVX2 + FMA or
/// AVX-512, both with the AVX2 row softmax).
#[inline]
pub(crate) fn has_avx2_fma() -> bool {
    isa() != Isa::Portable
}

/// Whether the running CPU has AVX2 and FMA (checked once by std, then
/// cached).
#[inline]
pub(crate) fn cpu_has_avx2_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;

    fn data(rng: &mut Rng, n: usize) -> Vec<f64> {
        (0..n).map(|_| rng.unit() - 0.5).collect()
    }

    /// The kernels against triple loops on the `live` blocks, with a
    /// transposed operand of row stride `ld` read from column `col0` (as
    /// when a tile's columns are part of a wider operand). Dead blocks:
    /// `scores` leaves them as they were, and `accumulate`, `accumulate_t`
    /// never read them (dead entries of their input are NaN here, so
    /// reading one would poison the result). Same products in a different order: 1e-13 absolute on
    /// sums of up to 64 terms of size < 0.25.
    fn check<const FMA: bool>(
        rng: &mut Rng,
        live: LiveBlocks,
        dp: usize,
        ld: usize,
        col0: usize,
        wide: bool,
    ) {
        let a = data(rng, TILE * dp);
        let bt = data(rng, dp * ld);
        let sentinel = 7.0;
        let mut s = vec![sentinel; TILE * TILE];
        scores_in::<f64, FMA>(&a, &bt[col0..], ld, dp, &mut s, live, wide);
        let is_live = |r: usize, j: usize| row_strips(live, r) >> (j / NS) & 1 == 1;
        for r in 0..TILE {
            for j in 0..TILE {
                let got = s[r * TILE + j];
                if is_live(r, j) {
                    let want: f64 = (0..dp).map(|c| a[r * dp + c] * bt[c * ld + col0 + j]).sum();
                    assert!((got - want).abs() < 1e-13, "scores[{r}][{j}]");
                } else {
                    assert_eq!(got, sentinel, "dead scores[{r}][{j}] written");
                    s[r * TILE + j] = f64::NAN;
                }
            }
        }
        // `accumulate` sums row r's live entries s[r][i], `accumulate_t`
        // column r's, s[i][r]: the same live entries read by columns.
        let b = data(rng, TILE * dp);
        let row = |r: usize, i: usize| is_live(r, i).then(|| s[r * TILE + i]);
        let column = |r: usize, i: usize| is_live(i, r).then(|| s[i * TILE + r]);
        type Kernel = fn(&[f64], &[f64], usize, &mut [f64], LiveBlocks, bool);
        type Entry<'a> = &'a dyn Fn(usize, usize) -> Option<f64>;
        let products: [(&str, Kernel, Entry); 2] = [
            ("accumulate", accumulate_in::<f64, FMA>, &row),
            ("accumulate_t", accumulate_t_in::<f64, FMA>, &column),
        ];
        for (name, kernel, entry) in products {
            let mut out = data(rng, TILE * dp);
            let before = out.clone();
            kernel(&s, &b, dp, &mut out, live, wide);
            for r in 0..TILE {
                for c in 0..dp {
                    let want = before[r * dp + c]
                        + (0..TILE)
                            .filter_map(|i| entry(r, i).map(|a| a * b[i * dp + c]))
                            .sum::<f64>();
                    assert!((out[r * dp + c] - want).abs() < 1e-13, "{name}[{r}][{c}]");
                }
            }
        }
    }

    #[test]
    fn kernels_match_triple_loops_on_live_blocks() {
        let mut rng = Rng::new(11);
        for (fma, wide) in [(false, false), (true, false), (false, true), (true, true)] {
            let run = |rng: &mut Rng, live, dp, ld, col0| {
                if fma {
                    check::<true>(rng, live, dp, ld, col0, wide)
                } else {
                    check::<false>(rng, live, dp, ld, col0, wide)
                }
            };
            // Every block, from a wider operand; head dims that take each
            // width of the wide blocks (64 + 32 + 16 columns).
            run(&mut rng, ALL_LIVE, 48, 3 * TILE + 5, 70);
            run(&mut rng, ALL_LIVE, 112, TILE, 0);
            for _ in 0..4 {
                let live = (rng.next_u64() as LiveBlocks) << 64 | rng.next_u64() as LiveBlocks;
                run(&mut rng, live, 32, TILE, 0);
            }
            // Lone strips next to dead ones, both halves of a pair: the
            // narrow block path on either side.
            run(&mut rng, LiveBlocks::MAX / 3, 32, TILE, 0);
            run(&mut rng, LiveBlocks::MAX / 3 * 2, 32, TILE, 0);
            // All dead: nothing written, nothing read.
            run(&mut rng, 0, 32, TILE, 0);
        }
    }

    #[test]
    fn bit_runs_merge_consecutive_bits() {
        let runs = |bits: u32| bit_runs(bits, NS).collect::<Vec<_>>();
        assert_eq!(runs(0), []);
        assert_eq!(runs((1 << STRIPS) - 1), [(0, TILE)]);
        assert_eq!(runs(0b1111), [(0, 4 * NS)]);
        assert_eq!(runs(0b1011), [(0, 2 * NS), (3 * NS, 4 * NS)]);
        assert_eq!(runs(0b0100), [(2 * NS, 3 * NS)]);
        assert_eq!(row_strips(0b1111 << STRIPS, MR), 0b1111);
        assert_eq!(row_strips(0b1111 << STRIPS, MR - 1), 0);
    }

    #[test]
    fn row_blocks_of_a_strip_and_their_runs() {
        // Strip 2 live in row blocks 0, 1, 3 and 15; strip 3 in block 1.
        let live = block_bit(0, 2) | block_bit(MR, 2) | block_bit(MR, 3) | block_bit(3 * MR, 2);
        let live = live | block_bit(15 * MR, 2);
        assert_eq!(strip_row_blocks(live, 2), 1 | 1 << 1 | 1 << 3 | 1 << 15);
        assert_eq!(strip_row_blocks(live, 3), 1 << 1);
        assert_eq!(strip_row_blocks(live, 0), 0);
        let runs = |bits: u32| bit_runs(bits, MR).collect::<Vec<_>>();
        assert_eq!(runs(0), []);
        assert_eq!(runs(0xffff), [(0, TILE)]);
        assert_eq!(
            runs(strip_row_blocks(live, 2)),
            [(0, 2 * MR), (3 * MR, 4 * MR), (15 * MR, TILE)]
        );
    }
}
