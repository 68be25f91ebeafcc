//! The element-wise steps of the row softmax, one strip of [`NS`] lanes at a
//! time: scaling and masking a strip of scores, running lane maxima and
//! sums, `exp`, and the gradient products of the backward.
//!
//! Every function has one portable body (plain loops over `[T; NS]`), and
//! for `f32` in the `SIMD` instantiation (the copies of the work items
//! compiled for AVX2 and FMA or for AVX-512, see [`super::isa`]) an AVX2
//! body written with `std::arch` intrinsics. The compiler's auto-vectorizer
//! handles the plain loops well on long rows but turns short, masked strips
//! into scalar, branchy code depending on what surrounds them; the
//! intrinsics make the cost of a strip independent of its row, which is what
//! keeps partial tiles (those a tree mask cuts into) as cheap per entry as
//! full ones.
//!
//! Both bodies perform the same IEEE operations in the same order (no fused
//! multiply-adds, reductions in the same tree order), so their results are
//! bit-identical: the backend gives the same bits on every x86-64 CPU, and
//! the tests compare the two bodies exactly.

use super::microkernel::NS;
use super::CpuFloat;
use std::any::TypeId;

// The AVX2 bodies hold one strip in one 8-lane register.
const _: () = assert!(NS == 8);

/// `Some(x)` as `f32` lanes when `T` is `f32`.
#[inline(always)]
fn f32_lanes<T: 'static, const N: usize>(x: &mut [T; N]) -> Option<&mut [f32; N]> {
    // SAFETY: `T` is `f32` (same type, so same size and layout).
    (TypeId::of::<T>() == TypeId::of::<f32>()).then(|| unsafe { &mut *(x as *mut [T; N]).cast() })
}

/// `x` as `f32`, `T` being `f32`.
#[inline(always)]
fn to_f32<T: 'static + Copy>(x: T) -> f32 {
    assert!(TypeId::of::<T>() == TypeId::of::<f32>());
    // SAFETY: `T` is `f32`.
    unsafe { std::mem::transmute_copy(&x) }
}

/// `f32` results as `T`, `T` being `f32`.
#[inline(always)]
fn from_f32<T: 'static + Copy>(x: f32) -> T {
    assert!(TypeId::of::<T>() == TypeId::of::<f32>());
    // SAFETY: `T` is `f32`.
    unsafe { std::mem::transmute_copy(&x) }
}

/// `x ← scale · x` and `max ← max(max, x)` lane-wise.
#[inline(always)]
pub(crate) fn scale_max<T: CpuFloat, const SIMD: bool>(
    x: &mut [T; NS],
    scale: T,
    max: &mut [T; NS],
) {
    #[cfg(target_arch = "x86_64")]
    if SIMD {
        if let (Some(x32), Some(m32)) = (f32_lanes(x), f32_lanes(max)) {
            // SAFETY: SIMD copies run only where AVX2 and FMA were detected.
            return unsafe { avx2::scale_max(x32, to_f32(scale), m32) };
        }
    }
    for (x, m) in x.iter_mut().zip(max) {
        *x *= scale;
        *m = m.max_of(*x);
    }
}

/// One strip of query `q`'s scores against keys `first..first + NS` with
/// their `kv_end` values `ends`: `x ← scale · x − offset` where the key is
/// visible (`lo <= k <= q < kv_end[k]`; `lo` is the first key of the
/// query's sliding window, 0 without one), `−inf` where it is not;
/// `max ← max(max, x)` and `visible += 1` on visible lanes.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(crate) fn mask_max<T: CpuFloat, const SIMD: bool>(
    x: &mut [T; NS],
    first: u32,
    ends: &[u32; NS],
    q: u32,
    lo: u32,
    scale: T,
    offset: T,
    max: &mut [T; NS],
    visible: &mut [u32; NS],
) {
    #[cfg(target_arch = "x86_64")]
    if SIMD {
        if let (Some(x32), Some(m32)) = (f32_lanes(x), f32_lanes(max)) {
            let (scale, offset) = (to_f32(scale), to_f32(offset));
            // SAFETY: SIMD copies run only where AVX2 and FMA were detected.
            return unsafe { avx2::mask_max(x32, first, ends, q, lo, scale, offset, m32, visible) };
        }
    }
    for j in 0..NS {
        let k = first + j as u32;
        let seen = lo <= k && k <= q && q < ends[j];
        visible[j] += seen as u32;
        x[j] = if seen {
            x[j] * scale - offset
        } else {
            T::NEG_INFINITY
        };
        max[j] = max[j].max_of(x[j]);
    }
}

/// The logit softcap on one strip of raw scores: `t ← tanh(a · x)` and
/// `x ← c · t`, with `a = scale / c` (so that `x` becomes `c · tanh(scale ·
/// x / c)`); `t` is kept for the backward's `1 − t²`.
#[inline(always)]
pub(crate) fn softcap<T: CpuFloat, const SIMD: bool>(x: &mut [T; NS], a: T, c: T, t: &mut [T; NS]) {
    #[cfg(target_arch = "x86_64")]
    if SIMD {
        if let (Some(x32), Some(t32)) = (f32_lanes(x), f32_lanes(t)) {
            // SAFETY: SIMD copies run only where AVX2 and FMA were detected.
            return unsafe { avx2::softcap(x32, to_f32(a), to_f32(c), t32) };
        }
    }
    for (t, &x) in t.iter_mut().zip(x.iter()) {
        *t = x * a;
    }
    T::tanh_lanes(t);
    for (x, &t) in x.iter_mut().zip(t.iter()) {
        *x = c * t;
    }
}

/// `x ← scale · x − offset`.
#[inline(always)]
pub(crate) fn scale_offset<T: CpuFloat, const SIMD: bool>(x: &mut [T; NS], scale: T, offset: T) {
    #[cfg(target_arch = "x86_64")]
    if SIMD {
        if let Some(x32) = f32_lanes(x) {
            // SAFETY: SIMD copies run only where AVX2 and FMA were detected.
            return unsafe { avx2::scale_offset(x32, to_f32(scale), to_f32(offset)) };
        }
    }
    for x in x {
        *x = *x * scale - offset;
    }
}

/// `x ← exp(x − m)` and `sum ← sum + x` lane-wise.
#[inline(always)]
pub(crate) fn exp_sum<T: CpuFloat, const SIMD: bool>(x: &mut [T; NS], m: T, sum: &mut [T; NS]) {
    #[cfg(target_arch = "x86_64")]
    if SIMD {
        if let (Some(x32), Some(s32)) = (f32_lanes(x), f32_lanes(sum)) {
            // SAFETY: SIMD copies run only where AVX2 and FMA were detected.
            return unsafe { avx2::exp_sum(x32, to_f32(m), s32) };
        }
    }
    for x in x.iter_mut() {
        *x -= m;
    }
    T::exp_lanes(x);
    for (s, &x) in sum.iter_mut().zip(x.iter()) {
        *s += x;
    }
}

/// P and dS of the backward's key items: `p = exp(x)`, then `dx ← (dx − dd) · p` and
/// `x ← p` (from scores already scaled, offset by the row's LSE and masked
/// to −inf, so that masked lanes get `p = 0` and `dS = 0`).
#[inline(always)]
pub(crate) fn exp_ds<T: CpuFloat, const SIMD: bool>(x: &mut [T; NS], dx: &mut [T; NS], dd: T) {
    #[cfg(target_arch = "x86_64")]
    if SIMD {
        if let (Some(x32), Some(dx32)) = (f32_lanes(x), f32_lanes(dx)) {
            // SAFETY: SIMD copies run only where AVX2 and FMA were detected.
            return unsafe { avx2::exp_ds(x32, dx32, to_f32(dd)) };
        }
    }
    T::exp_lanes(x);
    for (dx, &p) in dx.iter_mut().zip(x.iter()) {
        *dx = (*dx - dd) * p;
    }
}

/// `max` of the lanes, folded as `((0 4)(2 6))((1 5)(3 7))`.
#[inline(always)]
pub(crate) fn reduce_max<T: CpuFloat, const SIMD: bool>(mut v: [T; NS]) -> T {
    #[cfg(target_arch = "x86_64")]
    if SIMD {
        if let Some(v32) = f32_lanes(&mut v) {
            // SAFETY: SIMD copies run only where AVX2 and FMA were detected.
            return from_f32(unsafe { avx2::reduce_max(v32) });
        }
    }
    let h: [T; 4] = std::array::from_fn(|j| v[j].max_of(v[j + 4]));
    let q = [h[0].max_of(h[2]), h[1].max_of(h[3])];
    q[0].max_of(q[1])
}

/// `Σ` of the lanes, summed as `((0 + 4) + (2 + 6)) + ((1 + 5) + (3 + 7))`.
#[inline(always)]
pub(crate) fn reduce_sum<T: CpuFloat, const SIMD: bool>(mut v: [T; NS]) -> T {
    #[cfg(target_arch = "x86_64")]
    if SIMD {
        if let Some(v32) = f32_lanes(&mut v) {
            // SAFETY: SIMD copies run only where AVX2 and FMA were detected.
            return from_f32(unsafe { avx2::reduce_sum(v32) });
        }
    }
    let h: [T; 4] = std::array::from_fn(|j| v[j] + v[j + 4]);
    let q = [h[0] + h[2], h[1] + h[3]];
    q[0] + q[1]
}

/// The AVX2 bodies (f32, 8 lanes). `#[inline]` with the same target
/// features as the work-item copies that call them, so they inline there.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::NS;
    use std::arch::x86_64::*;

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn load(x: &[f32; NS]) -> __m256 {
        _mm256_loadu_ps(x.as_ptr())
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn store(x: &mut [f32; NS], v: __m256) {
        _mm256_storeu_ps(x.as_mut_ptr(), v)
    }

    /// `max_of(acc, x)` = `x > acc ? x : acc`; `maxps(x, acc)` returns its
    /// second operand unless the first is greater, NaN included.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn max_of(acc: __m256, x: __m256) -> __m256 {
        _mm256_max_ps(x, acc)
    }

    /// Lanes `first + j` with `lo <= first + j < hi` (all `u32`, compared
    /// unsigned) as an all-ones mask.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn in_range(first: u32, lo: __m256i, hi: __m256i) -> __m256i {
        let k = _mm256_add_epi32(
            _mm256_set1_epi32(first as i32),
            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
        );
        // lo <= k  ⇔  max(lo, k) == k;  k < hi  ⇔  not (max(k, hi) == k).
        let ge_lo = _mm256_cmpeq_epi32(_mm256_max_epu32(lo, k), k);
        let ge_hi = _mm256_cmpeq_epi32(_mm256_max_epu32(k, hi), k);
        _mm256_andnot_si256(ge_hi, ge_lo)
    }

    /// [`super::super::float`]'s `exp_f32` on 8 lanes: the same operations
    /// in the same order (no FMA), so the same bits.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn exp(x: __m256) -> __m256 {
        let c = _mm256_set1_ps;
        let round = 12_582_912.0f32;
        // clamp keeps NaN: max(−87, x) and min(88, ·) return x when it is NaN.
        let xc = _mm256_min_ps(c(88.0), _mm256_max_ps(c(-87.0), x));
        let t = _mm256_add_ps(_mm256_mul_ps(xc, c(std::f32::consts::LOG2_E)), c(round));
        let n = _mm256_sub_ps(t, c(round));
        let r = _mm256_sub_ps(
            _mm256_sub_ps(xc, _mm256_mul_ps(n, c(0.693_359_4))),
            _mm256_mul_ps(n, c(-2.121_944_4e-4)),
        );
        let mut p = c(1.987_569_1e-4);
        for k in [
            1.398_199_9e-3,
            8.333_452e-3,
            4.166_579_6e-2,
            1.666_666_5e-1,
            0.5,
        ] {
            p = _mm256_add_ps(_mm256_mul_ps(p, r), c(k));
        }
        let er = _mm256_add_ps(
            _mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(p, r), r), r),
            c(1.0),
        );
        let bits = _mm256_add_epi32(
            _mm256_sub_epi32(
                _mm256_castps_si256(t),
                _mm256_set1_epi32(round.to_bits() as i32),
            ),
            _mm256_set1_epi32(127),
        );
        let two_n = _mm256_castsi256_ps(_mm256_slli_epi32(bits, 23));
        let below = _mm256_cmp_ps(x, c(-87.0), _CMP_LT_OQ);
        _mm256_andnot_ps(below, _mm256_mul_ps(er, two_n))
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn scale_max(x: &mut [f32; NS], scale: f32, max: &mut [f32; NS]) {
        let v = _mm256_mul_ps(load(x), _mm256_set1_ps(scale));
        store(x, v);
        store(max, max_of(load(max), v));
    }

    #[allow(clippy::too_many_arguments)]
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn mask_max(
        x: &mut [f32; NS],
        first: u32,
        ends: &[u32; NS],
        q: u32,
        lo: u32,
        scale: f32,
        offset: f32,
        max: &mut [f32; NS],
        visible: &mut [u32; NS],
    ) {
        // Key k is seen by q when lo <= k <= q < kv_end[k]: k in [lo, q + 1)
        // and q in [0, kv_end[k]) ⇔ kv_end[k] > q.
        let qv = _mm256_set1_epi32(q as i32);
        let keys = in_range(
            first,
            _mm256_set1_epi32(lo as i32),
            _mm256_set1_epi32((q + 1) as i32),
        );
        let ends = _mm256_loadu_si256(ends.as_ptr().cast());
        // kv_end[k] > q ⇔ not (max(q, kv_end[k]) == q).
        let ends_le_q = _mm256_cmpeq_epi32(_mm256_max_epu32(qv, ends), qv);
        let seen = _mm256_andnot_si256(ends_le_q, keys);
        let y = _mm256_sub_ps(
            _mm256_mul_ps(load(x), _mm256_set1_ps(scale)),
            _mm256_set1_ps(offset),
        );
        let v = _mm256_blendv_ps(
            _mm256_set1_ps(f32::NEG_INFINITY),
            y,
            _mm256_castsi256_ps(seen),
        );
        store(x, v);
        store(max, max_of(load(max), v));
        let count = _mm256_loadu_si256(visible.as_ptr().cast());
        // seen lanes are −1: subtracting counts them.
        let count = _mm256_sub_epi32(count, seen);
        _mm256_storeu_si256(visible.as_mut_ptr().cast(), count);
    }

    /// `super::softcap` on 8 lanes, with `super::super::float`'s
    /// `tanh_f32_lanes`: the same operations in the same order.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn softcap(x: &mut [f32; NS], a: f32, c: f32, t: &mut [f32; NS]) {
        let sign = _mm256_set1_ps(-0.0);
        let y = _mm256_mul_ps(load(x), _mm256_set1_ps(a));
        let e = exp(_mm256_mul_ps(
            _mm256_andnot_ps(sign, y),
            _mm256_set1_ps(-2.0),
        ));
        let one = _mm256_set1_ps(1.0);
        let th = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
        // copysign(th, y): th >= 0, so OR in y's sign bit.
        let th = _mm256_or_ps(th, _mm256_and_ps(sign, y));
        store(t, th);
        store(x, _mm256_mul_ps(_mm256_set1_ps(c), th));
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn scale_offset(x: &mut [f32; NS], scale: f32, offset: f32) {
        let y = _mm256_sub_ps(
            _mm256_mul_ps(load(x), _mm256_set1_ps(scale)),
            _mm256_set1_ps(offset),
        );
        store(x, y);
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn exp_sum(x: &mut [f32; NS], m: f32, sum: &mut [f32; NS]) {
        let p = exp(_mm256_sub_ps(load(x), _mm256_set1_ps(m)));
        store(x, p);
        store(sum, _mm256_add_ps(load(sum), p));
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn exp_ds(x: &mut [f32; NS], dx: &mut [f32; NS], dd: f32) {
        let p = exp(load(x));
        store(x, p);
        store(
            dx,
            _mm256_mul_ps(_mm256_sub_ps(load(dx), _mm256_set1_ps(dd)), p),
        );
    }

    /// `((0 4)(2 6))((1 5)(3 7))`.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn reduce_max(v: &mut [f32; NS]) -> f32 {
        let v = load(v);
        let h = max_of4(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let q = max_of4(h, _mm_movehl_ps(h, h));
        let r = max_of4(q, _mm_shuffle_ps(q, q, 1));
        _mm_cvtss_f32(r)
    }

    /// `((0 + 4) + (2 + 6)) + ((1 + 5) + (3 + 7))`.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn reduce_sum(v: &mut [f32; NS]) -> f32 {
        let v = load(v);
        let h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let q = _mm_add_ps(h, _mm_movehl_ps(h, h));
        let r = _mm_add_ss(q, _mm_shuffle_ps(q, q, 1));
        _mm_cvtss_f32(r)
    }

    /// [`max_of`] on 4 lanes.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn max_of4(acc: __m128, x: __m128) -> __m128 {
        _mm_max_ps(x, acc)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::microkernel::cpu_has_avx2_fma;
    use crate::rng::Rng;

    /// Scores-like lanes: mostly moderate values, some −inf (masked
    /// earlier), zeros and large magnitudes, so every branch of `exp` and
    /// of the masks is taken.
    fn strip(rng: &mut Rng) -> [f32; NS] {
        std::array::from_fn(|_| {
            let u = rng.signed_unit();
            match rng.range(0, 7) {
                0 => f32::NEG_INFINITY,
                1 => 0.0,
                2 => u * 200.0,
                _ => u * 6.0,
            }
        })
    }

    fn bits(x: [f32; NS]) -> [u32; NS] {
        x.map(f32::to_bits)
    }

    /// A primitive applied to a strip, an accumulator strip and counts.
    type Step<'a> = &'a dyn Fn(&mut [f32; NS], &mut [f32; NS], &mut [u32; NS]);

    /// Calls `f` as the AVX2 work items do (`SIMD`) and as the portable
    /// ones do, on the same inputs.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn simd_and_portable<R>(f: impl Fn(bool) -> R) -> (R, R) {
        (f(true), f(false))
    }

    /// The AVX2 bodies give the portable bodies' bits on every lane, for
    /// every primitive, on random strips (the backend's results do not
    /// depend on the CPU). Skipped where AVX2 is missing: then only the
    /// portable bodies run.
    #[test]
    fn simd_bodies_match_portable_bodies_bit_for_bit() {
        #[cfg(target_arch = "x86_64")]
        {
            if !cpu_has_avx2_fma() {
                return;
            }
            let mut rng = Rng::new(7);
            for case in 0..2000u32 {
                let x = strip(&mut rng);
                let y = strip(&mut rng);
                let ends: [u32; NS] = std::array::from_fn(|j| (case * 7 + j as u32 * 13) % 40);
                let (first, q, lo) = (case % 29, case % 37, case % 31);
                let (scale, m) = (0.125f32 + (case % 5) as f32, y[3].max(-50.0));
                // SAFETY: AVX2 and FMA were detected above.
                let (a, b) = unsafe {
                    simd_and_portable(|simd| {
                        let run = |f: Step| {
                            let (mut x, mut acc, mut n) = (x, y, [3u32; NS]);
                            f(&mut x, &mut acc, &mut n);
                            (bits(x), bits(acc), n)
                        };
                        macro_rules! both {
                            ($f:ident $(, $arg:expr)*) => {
                                if simd { $f::<f32, true>($($arg),*) } else { $f::<f32, false>($($arg),*) }
                            };
                        }
                        let out = [
                            run(&|x, acc, _| both!(scale_max, x, scale, acc)),
                            run(&|x, acc, n| {
                                both!(mask_max, x, first, &ends, q, 0, scale, m, acc, n)
                            }),
                            run(&|x, acc, n| {
                                both!(mask_max, x, first, &ends, q, lo, scale, m, acc, n)
                            }),
                            run(&|x, acc, _| both!(softcap, x, scale / 7.0, 7.0, acc)),
                            run(&|x, _, _| both!(scale_offset, x, scale, m)),
                            run(&|x, acc, _| both!(exp_sum, x, m, acc)),
                            run(&|x, acc, _| both!(exp_ds, x, acc, m)),
                        ];
                        let reduced = [
                            both!(reduce_max, x).to_bits(),
                            both!(reduce_sum, x.map(|v| v.max(-1e3))).to_bits(),
                        ];
                        (out, reduced)
                    })
                };
                assert_eq!(a, b, "case {case}: x {x:?} y {y:?}");
            }
        }
    }

    /// The portable bodies against their definitions, element by element,
    /// on one hand-made strip (f64, where no SIMD body exists).
    #[test]
    fn portable_bodies_follow_their_definitions() {
        let x: [f64; NS] = [0.5, -1.0, 2.0, f64::NEG_INFINITY, 0.0, 3.0, -2.0, 1.0];
        // Keys 10..18 against query 14: keys <= 14 with kv_end > 14.
        let ends = [20, 14, 15, 30, 16, 14, 40, 50];
        let (mut y, mut max, mut visible) = (x, [f64::NEG_INFINITY; NS], [0; NS]);
        mask_max::<f64, true>(&mut y, 10, &ends, 14, 0, 2.0, 1.0, &mut max, &mut visible);
        let ninf = f64::NEG_INFINITY;
        assert_eq!(y, [0.0, ninf, 3.0, ninf, -1.0, ninf, ninf, ninf]);
        assert_eq!(visible, [1, 0, 1, 1, 1, 0, 0, 0]);
        assert_eq!(max, y);
        // A sliding window from key 12: keys 10 and 11 are masked too.
        let (mut w, mut wmax, mut wvisible) = (x, [f64::NEG_INFINITY; NS], [0; NS]);
        mask_max::<f64, true>(
            &mut w,
            10,
            &ends,
            14,
            12,
            2.0,
            1.0,
            &mut wmax,
            &mut wvisible,
        );
        assert_eq!(w, [ninf, ninf, 3.0, ninf, -1.0, ninf, ninf, ninf]);
        assert_eq!(wvisible, [0, 0, 1, 1, 1, 0, 0, 0]);
        // The softcap: c · tanh(a · x), and tanh kept.
        let (mut c, mut t) = (x, [0.0; NS]);
        softcap::<f64, true>(&mut c, 0.5, 3.0, &mut t);
        for j in 0..NS {
            assert_eq!(t[j], (0.5 * x[j]).tanh());
            assert_eq!(c[j], 3.0 * t[j]);
        }
        assert_eq!(reduce_max::<f64, true>(y), 3.0);
        assert_eq!(
            reduce_sum::<f64, true>([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]),
            36.0
        );
        // Masked lanes (−inf) get p = 0 and dS = 0.
        let ninf = f64::NEG_INFINITY;
        let (mut p, mut ds) = ([ninf, 0.0, 0.0, ninf, 0.0, ninf, ninf, 0.0], [1.0; NS]);
        ds[4] = 3.0;
        exp_ds::<f64, true>(&mut p, &mut ds, 0.5);
        assert_eq!(p, [0.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0]);
        assert_eq!(ds, [0.0, 0.5, 0.5, 0.0, 2.5, 0.0, 0.0, 0.5]);
        let (mut e, mut sum) = ([0.0f64; NS], [1.0; NS]);
        exp_sum::<f64, true>(&mut e, 0.0, &mut sum);
        assert_eq!((e, sum), ([1.0; NS], [2.0; NS]));
    }
}
