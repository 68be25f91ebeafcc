//! SDCC fused forward-KL against a direct (unfused) softmax computation
//! written here, finite differences, infinities, large vocabularies and
//! error handling.

use crate::common::calls;

use ndarray::Array2;
use proptest::prelude::*;
use treeattn::backend::cpu::CpuFloat;
use treeattn::{ops, Error};
use treeattn_lab::gen::Rng;

/// Uniform in `0..n` by modulo, the draw these tests (and the seeds in
/// sdcc_cpu.proptest-regressions) were written against.
fn below(rng: &mut Rng, n: usize) -> usize {
    (rng.next_u64() % n as u64) as usize
}

/// Direct computation: materialize both log-softmaxes of `logits / τ`, then
/// `KL = Σ_{p_t > 0} p_t (log p_t − log p_s)` and
/// `grad[s] += w (p_s − p_t) / τ`.
struct Direct {
    per_pair: Vec<f64>,
    loss_sum: f64,
    grad: Vec<f64>,
}

fn log_softmax(row: &[f64], tau: f64) -> Vec<f64> {
    let x: Vec<f64> = row.iter().map(|v| v / tau).collect();
    let m = x.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let lse = m + x.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
    x.iter().map(|v| v - lse).collect()
}

fn direct(
    student: &[f64],
    teacher: &[f64],
    vocab: usize,
    pairs: &[(u32, u32)],
    w: &[f32],
    tau: f32,
) -> Direct {
    let tau = tau as f64;
    let mut grad = vec![0.0; student.len()];
    let mut per_pair = Vec::new();
    let mut loss_sum = 0.0;
    for (&(s, t), &wi) in pairs.iter().zip(w) {
        let (s, t) = (s as usize, t as usize);
        let ls = log_softmax(&student[s * vocab..(s + 1) * vocab], tau);
        let lt = log_softmax(&teacher[t * vocab..(t + 1) * vocab], tau);
        let kl: f64 = lt
            .iter()
            .zip(&ls)
            .filter(|(a, _)| **a > f64::NEG_INFINITY)
            .map(|(a, b)| a.exp() * (a - b))
            .sum();
        per_pair.push(kl);
        if wi > 0.0 {
            loss_sum += wi as f64 * kl;
        }
        for v in 0..vocab {
            grad[s * vocab + v] += wi as f64 * (ls[v].exp() - lt[v].exp()) / tau;
        }
    }
    Direct {
        per_pair,
        loss_sum,
        grad,
    }
}

/// Random logits: normal-ish values of spread `spread` around a per-row
/// offset of up to ±`offset` (softmax is shift-invariant; a fused
/// computation that forgets the max subtraction overflows), with a fraction
/// `neg_inf` of entries set to −inf (never a whole row).
fn logits(
    rng: &mut Rng,
    rows: usize,
    vocab: usize,
    spread: f64,
    offset: f64,
    neg_inf: f64,
) -> Vec<f64> {
    let mut x = Vec::with_capacity(rows * vocab);
    for _ in 0..rows {
        let shift = offset * (2.0 * rng.unit() - 1.0);
        for _ in 0..vocab {
            x.push(shift + spread * (rng.unit() + rng.unit() + rng.unit() - 1.5));
        }
        let row = x.len() - vocab;
        for v in 0..vocab {
            if rng.unit() < neg_inf {
                x[row + v] = f64::NEG_INFINITY;
            }
        }
        x[row + below(rng, vocab)] = shift;
    }
    x
}

fn rel_err<T: CpuFloat>(a: &[T], b: &[f64]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| (x.to_f64() - y).powi(2)).sum();
    let den: f64 = b.iter().map(|y| y * y).sum();
    (num / den.max(1e-300)).sqrt()
}

fn to_t<T: CpuFloat>(x: &[f64]) -> Vec<T> {
    x.iter().map(|&v| T::from_f64(v)).collect()
}

struct Case {
    vocab: usize,
    student: Vec<f64>,
    teacher: Vec<f64>,
    pairs: Vec<(u32, u32)>,
    weights: Vec<f32>,
    tau: f32,
}

fn make_case(seed: u64, vocab: usize, n_pairs: usize, neg_inf: f64) -> Case {
    let mut rng = Rng::new(seed);
    let (rows_s, rows_t) = (1 + below(&mut rng, 6), 1 + below(&mut rng, 6));
    // Teacher −inf only where the student is too would be a special case;
    // draw independently so that some pairs have student −inf under
    // teacher mass (KL = +inf) only when neg_inf is set on the student.
    let student = logits(&mut rng, rows_s, vocab, 4.0, 50.0, 0.0);
    let teacher = logits(&mut rng, rows_t, vocab, 4.0, 50.0, neg_inf);
    let pairs = (0..n_pairs)
        .map(|_| {
            (
                below(&mut rng, rows_s) as u32,
                below(&mut rng, rows_t) as u32,
            )
        })
        .collect();
    let weights = (0..n_pairs)
        .map(|i| {
            if i % 5 == 4 {
                0.0
            } else {
                (0.1 + rng.unit()) as f32
            }
        })
        .collect();
    let tau = (0.25 + 3.0 * rng.unit()) as f32;
    Case {
        vocab,
        student,
        teacher,
        pairs,
        weights,
        tau,
    }
}

/// Fused vs direct, both in f64 on the same (T-rounded) logits: returns
/// the worst relative error of (per-pair KL, loss_sum, gradient).
fn compare<T: CpuFloat>(c: &Case) -> [f64; 3] {
    let (s, t) = (to_t::<T>(&c.student), to_t::<T>(&c.teacher));
    let s64: Vec<f64> = s.iter().map(|x| x.to_f64()).collect();
    let t64: Vec<f64> = t.iter().map(|x| x.to_f64()).collect();
    let want = direct(&s64, &t64, c.vocab, &c.pairs, &c.weights, c.tau);
    let got = calls::cpu_sdcc(&s, &t, c.vocab, &c.pairs, &c.weights, c.tau).unwrap();
    assert!(got.grad_student.iter().all(|g| g.is_finite()));
    let kl_err = got
        .per_pair
        .iter()
        .zip(&want.per_pair)
        .map(|(a, b)| (a - b).abs() / b.abs().max(1e-3))
        .fold(0.0, f64::max);
    let sum_err = (got.loss_sum - want.loss_sum).abs() / want.loss_sum.abs().max(1e-3);
    let w_sum: f64 = c.weights.iter().map(|&w| w as f64).sum();
    if w_sum > 0.0 {
        assert!((got.loss_mean - got.loss_sum / w_sum).abs() <= 1e-12 * got.loss_sum.abs());
    }
    [kl_err, sum_err, rel_err(&got.grad_student, &want.grad)]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// f64 fused vs direct: both compute in f64; the fused form re-centres
    /// on running maxima instead of subtracting two LSEs, so they differ by
    /// rounding only (~1e-15 relative per term, summed over ≤ 3000 terms):
    /// 1e-11 relative (KL floored at 1e-3 absolute, the size below which
    /// a KL is numerically zero at these logit scales) is generous.
    #[test]
    fn fused_equals_direct_softmax_f64(seed in any::<u64>(), vocab in 7usize..3000, n_pairs in 1usize..12, neg_inf in prop_oneof![Just(0.0), 0.0..0.5]) {
        let c = make_case(seed, vocab, n_pairs, neg_inf);
        let e = compare::<f64>(&c);
        prop_assert!(e.iter().all(|&x| x < 1e-11), "errors {:?} (vocab {})", e, vocab);
    }

    /// f32 logits: the computation is still f64 on the same rounded values;
    /// only the gradient is rounded to f32 on output (5e-8 relative), so
    /// KL agrees to 1e-11 and the gradient to 1e-6.
    #[test]
    fn fused_equals_direct_softmax_f32(seed in any::<u64>(), vocab in 7usize..3000, n_pairs in 1usize..12) {
        let c = make_case(seed, vocab, n_pairs, 0.1);
        let e = compare::<f32>(&c);
        prop_assert!(e[0] < 1e-11 && e[1] < 1e-11 && e[2] < 1e-6, "errors {:?}", e);
    }

    /// KL ≥ 0 up to rounding, for arbitrary (independent) rows.
    #[test]
    fn kl_is_non_negative(seed in any::<u64>(), vocab in 7usize..500) {
        let c = make_case(seed, vocab, 8, 0.2);
        let out = calls::cpu_sdcc(&c.student, &c.teacher, vocab, &c.pairs, &c.weights, c.tau).unwrap();
        prop_assert!(out.per_pair.iter().all(|&kl| kl >= -1e-12), "{:?}", out.per_pair);
    }
}

#[test]
fn kl_is_zero_and_gradient_zero_when_student_equals_teacher() {
    let mut rng = Rng::new(1);
    let x = logits(&mut rng, 3, 1000, 5.0, 100.0, 0.2);
    let pairs = [(0, 0), (1, 1), (2, 2), (1, 1)];
    let out = calls::cpu_sdcc(&x, &x, 1000, &pairs, &[1.0, 0.5, 2.0, 1.0], 0.7).unwrap();
    assert!(
        out.per_pair.iter().all(|&kl| kl == 0.0),
        "{:?}",
        out.per_pair
    );
    assert_eq!(out.loss_sum, 0.0);
    assert!(out.grad_student.iter().all(|&g| g == 0.0));
    // Negative control: a different teacher gives a positive KL.
    let mut y = x.clone();
    y[5] += 1.0;
    let out = calls::cpu_sdcc(&x, &y, 1000, &[(0, 0)], &[1.0], 0.7).unwrap();
    assert!(out.per_pair[0] > 1e-6);
}

/// `loss_sum` against central differences in every student logit, with
/// τ ≠ 1, a repeated student row and a −inf teacher entry. h = 1e-5 on
/// logits of size ~3: truncation ~h² ≈ 1e-10, rounding ~1e-16 / h ≈ 1e-11;
/// tolerance 1e-8.
#[test]
fn gradient_matches_finite_differences() {
    let mut rng = Rng::new(42);
    let vocab = 9;
    let student = logits(&mut rng, 3, vocab, 3.0, 0.0, 0.0);
    let mut teacher = logits(&mut rng, 2, vocab, 3.0, 0.0, 0.0);
    teacher[4] = f64::NEG_INFINITY;
    let pairs = [(0, 1), (2, 0), (0, 0)];
    let weights = [0.7, 1.3, 0.4];
    let tau = 1.7;
    let out = calls::cpu_sdcc(&student, &teacher, vocab, &pairs, &weights, tau).unwrap();
    let loss = |s: &[f64]| {
        calls::cpu_sdcc(s, &teacher, vocab, &pairs, &weights, tau)
            .unwrap()
            .loss_sum
    };
    let h = 1e-5;
    for i in 0..student.len() {
        let mut s = student.clone();
        s[i] += h;
        let up = loss(&s);
        s[i] -= 2.0 * h;
        let fd = (up - loss(&s)) / (2.0 * h);
        assert!(
            (fd - out.grad_student[i]).abs() < 1e-8,
            "grad[{i}]: analytic {}, fd {fd}",
            out.grad_student[i]
        );
    }
    // Row 1 is in no pair: its gradient is exactly zero.
    assert!(out.grad_student[vocab..2 * vocab].iter().all(|&g| g == 0.0));
}

#[test]
fn repeated_student_rows_accumulate() {
    let mut rng = Rng::new(8);
    let vocab = 300;
    let student = logits(&mut rng, 2, vocab, 3.0, 10.0, 0.0);
    let teacher = logits(&mut rng, 3, vocab, 3.0, 10.0, 0.1);
    let pairs = [(1, 0), (0, 2), (1, 2), (1, 1)];
    let weights = [0.5, 1.0, 2.0, 0.25];
    let all = calls::cpu_sdcc(&student, &teacher, vocab, &pairs, &weights, 1.3).unwrap();
    let mut summed = vec![0.0; student.len()];
    for (p, w) in pairs.iter().zip(weights) {
        let one = calls::cpu_sdcc(&student, &teacher, vocab, &[*p], &[w], 1.3).unwrap();
        for (a, b) in summed.iter_mut().zip(&one.grad_student) {
            *a += b;
        }
    }
    assert!(rel_err(&all.grad_student, &summed) < 1e-14);
    let want: f64 = all
        .per_pair
        .iter()
        .zip(weights)
        .map(|(k, w)| k * w as f64)
        .sum();
    assert!((all.loss_sum - want).abs() < 1e-12 * want);
    assert!((all.loss_mean - want / 3.75).abs() < 1e-12 * want);
}

#[test]
fn infinite_logits_are_handled_exactly() {
    let vocab = 6;
    let ninf = f64::NEG_INFINITY;
    // Teacher −inf entries (p_t = 0) add exactly 0; the student may be −inf there.
    let student = [
        1.0, ninf, 0.5, -2.0, ninf, 3.0, /* row 1 */ 0.0, 0.0, 0.0, 0.0, 0.0, ninf,
    ];
    let teacher = [0.3, ninf, 1.0, ninf, ninf, 2.0];
    let out = calls::cpu_sdcc(&student, &teacher, vocab, &[(0, 0)], &[1.0], 1.0).unwrap();
    let want = direct(&student, &teacher, vocab, &[(0, 0)], &[1.0], 1.0);
    assert!(out.per_pair[0].is_finite() && (out.per_pair[0] - want.per_pair[0]).abs() < 1e-14);
    assert!(rel_err(&out.grad_student, &want.grad) < 1e-14);
    // Student −inf where the teacher has mass: KL = +inf, gradient finite
    // (p_s = 0 there: the gradient pushes that logit up by w p_t / τ).
    let out = calls::cpu_sdcc(&student, &teacher, vocab, &[(1, 0)], &[2.0], 0.5).unwrap();
    assert_eq!(out.per_pair[0], f64::INFINITY);
    assert_eq!(out.loss_sum, f64::INFINITY);
    assert!(out.grad_student.iter().all(|g| g.is_finite()));
    assert!(out.grad_student[vocab + 5] < 0.0);
    // ... and weight 0 makes such a pair add exactly 0, not 0 · inf = NaN.
    let out = calls::cpu_sdcc(
        &student,
        &teacher,
        vocab,
        &[(1, 0), (0, 0)],
        &[0.0, 1.0],
        1.0,
    )
    .unwrap();
    assert!(out.loss_sum.is_finite() && out.loss_mean.is_finite());
}

/// A Qwen-size vocabulary: 151,936 entries, spanning many chunks, f32
/// logits, −inf entries, τ = 2.
#[test]
fn large_vocabulary_matches_direct() {
    let vocab = 151_936;
    let mut rng = Rng::new(150_000);
    let c = Case {
        vocab,
        student: logits(&mut rng, 2, vocab, 6.0, 30.0, 0.0),
        teacher: logits(&mut rng, 2, vocab, 6.0, 30.0, 0.05),
        pairs: vec![(0, 0), (1, 1), (0, 1)],
        weights: vec![1.0, 0.5, 1.0],
        tau: 2.0,
    };
    let e = compare::<f32>(&c);
    assert!(e[0] < 1e-10 && e[1] < 1e-10 && e[2] < 1e-6, "{e:?}");
    let e = compare::<f64>(&c);
    assert!(e.iter().all(|&x| x < 1e-10), "{e:?}");
}

#[test]
fn ops_front_wraps_the_core() {
    let c = make_case(3, 50, 6, 0.1);
    let s = Array2::from_shape_vec((c.student.len() / 50, 50), c.student.clone()).unwrap();
    let t = Array2::from_shape_vec((c.teacher.len() / 50, 50), c.teacher.clone()).unwrap();
    let out = ops::sdcc_forward_kl(s.view(), t.view(), &c.pairs, &c.weights, c.tau).unwrap();
    let core = calls::cpu_sdcc(&c.student, &c.teacher, 50, &c.pairs, &c.weights, c.tau).unwrap();
    assert_eq!(out.grad_student.as_slice().unwrap(), &core.grad_student[..]);
    assert_eq!(out.grad_student.dim(), s.dim());
    assert_eq!(
        (out.loss.loss_sum, out.loss.loss_mean, &out.loss.per_pair),
        (core.loss_sum, core.loss_mean, &core.per_pair)
    );
    // Column-major student view: same answer.
    let s_f = s.t().as_standard_layout().into_owned();
    let out_f = ops::sdcc_forward_kl(s_f.t(), t.view(), &c.pairs, &c.weights, c.tau).unwrap();
    assert_eq!(out_f.loss.per_pair, out.loss.per_pair);
    let t_small = Array2::<f64>::zeros((2, 49));
    let r = ops::sdcc_forward_kl(s.view(), t_small.view(), &c.pairs, &c.weights, c.tau);
    assert!(matches!(r, Err(Error::Shape(m)) if m.contains("vocab 50")));
}

#[test]
fn bad_inputs_are_errors() {
    let v = 4;
    let s = [0.0, 1.0, 2.0, 3.0, 1.0, 1.0, 1.0, 1.0];
    let t = [3.0, 2.0, 1.0, 0.0];
    let ok = |r: treeattn::Result<calls::SdccFlat<f64>>| r.unwrap_err();
    assert!(matches!(
        ok(calls::cpu_sdcc(&s, &t, 0, &[], &[], 1.0)),
        Error::Shape(_)
    ));
    assert!(
        matches!(ok(calls::cpu_sdcc(&s, &t, 3, &[], &[], 1.0)), Error::Shape(m) if m.contains("student"))
    );
    assert!(
        matches!(ok(calls::cpu_sdcc(&s, &t[..3], v, &[], &[], 1.0)), Error::Shape(m) if m.contains("teacher"))
    );
    assert!(matches!(
        ok(calls::cpu_sdcc(&s, &t, v, &[(0, 0)], &[], 1.0)),
        Error::Shape(_)
    ));
    for tau in [0.0, -1.0, f32::NAN, f32::INFINITY] {
        assert!(
            matches!(
                ok(calls::cpu_sdcc(&s, &t, v, &[(0, 0)], &[1.0], tau)),
                Error::Unsupported(_)
            ),
            "τ {tau}"
        );
    }
    assert_eq!(
        ok(calls::cpu_sdcc(
            &s,
            &t,
            v,
            &[(0, 0), (1, 0)],
            &[1.0, f32::NAN],
            1.0
        )),
        Error::NonFinite {
            what: "SDCC weights".into(),
            index: 1
        }
    );
    assert!(matches!(
        ok(calls::cpu_sdcc(&s, &t, v, &[(0, 0)], &[-1.0], 1.0)),
        Error::Unsupported(_)
    ));
    let e = ok(calls::cpu_sdcc(
        &s,
        &t,
        v,
        &[(0, 0), (2, 0)],
        &[1.0, 1.0],
        1.0,
    ));
    assert!(
        matches!(&e, Error::Pack(m) if m.contains("pair 1") && m.contains("student row 2")),
        "{e:?}"
    );
    let e = ok(calls::cpu_sdcc(&s, &t, v, &[(0, 1)], &[1.0], 1.0));
    assert!(
        matches!(&e, Error::Pack(m) if m.contains("teacher row 1")),
        "{e:?}"
    );
    // NaN / +inf logits in a used row: the flat index is named.
    let mut s_nan = s;
    s_nan[6] = f64::NAN;
    assert!(
        calls::cpu_sdcc(&s_nan, &t, v, &[(0, 0)], &[1.0], 1.0).is_ok(),
        "row 1 is unused"
    );
    assert!(matches!(
        ok(calls::cpu_sdcc(
            &s_nan,
            &t,
            v,
            &[(0, 0), (1, 0)],
            &[1.0, 1.0],
            1.0
        )),
        Error::NonFinite { index: 6, .. }
    ));
    let mut t_inf = t;
    t_inf[2] = f64::INFINITY;
    let e = ok(calls::cpu_sdcc(&s, &t_inf, v, &[(0, 0)], &[1.0], 1.0));
    assert!(
        matches!(&e, Error::NonFinite { what, index: 2 } if what.contains("teacher")),
        "{e:?}"
    );
    // Finite logits that overflow once divided by a tiny temperature.
    let huge = [1e300, 0.0, 0.0, 0.0];
    let e = ok(calls::cpu_sdcc(&s, &huge, v, &[(0, 0)], &[1.0], 1e-30));
    assert!(
        matches!(&e, Error::NonFinite { what, .. } if what.contains("temperature")),
        "{e:?}"
    );
    // Rows entirely −inf have no distribution.
    let ninf = [f64::NEG_INFINITY; 4];
    assert!(
        matches!(ok(calls::cpu_sdcc(&s, &ninf, v, &[(0, 0)], &[1.0], 1.0)), Error::NonFinite { what, .. } if what.contains("teacher"))
    );
    let mut s_ninf = s;
    s_ninf[4..].copy_from_slice(&ninf);
    assert!(
        matches!(ok(calls::cpu_sdcc(&s_ninf, &t, v, &[(1, 0)], &[1.0], 1.0)), Error::NonFinite { what, index: 4 } if what.contains("student"))
    );
    // With several bad pairs the lowest pair index is reported, whatever the thread schedule.
    let e = ok(calls::cpu_sdcc(
        &s_ninf,
        &ninf,
        v,
        &[(0, 0), (1, 0)],
        &[1.0, 1.0],
        1.0,
    ));
    assert!(
        matches!(&e, Error::NonFinite { what, .. } if what.contains("teacher logits row 0")),
        "{e:?}"
    );
}
