//! The SDCC fused forward-KL kernel (kernels/sdcc_kl.cu) run under the SIMT
//! emulator, against the CPU backend (`backend::cpu::sdcc_forward_kl`, f64
//! accumulation) on the same logits widened to f32.
//!
//! Tolerances (`backend::tolerance::SDCC`, shared with the GPU check):
//! per-pair KL within 1e-4 relative, gradient within 1e-3 relative Frobenius
//! error. The kernel computes each exponential in f32 (ex2.approx-grade on
//! the GPU) and accumulates the per-thread sums and the cross term in f64,
//! then combines in f64; the table's bounds were set for the earlier f32
//! sums (measured 1e-8 to 1e-5 relative) and are kept for the GPU's
//! approximate exponentials. KLs below [`KL_FLOOR`] nats are held to the
//! relative bound times `KL_FLOOR` (1e-6 nats absolute against the CPU
//! backend): the KL is a difference of terms of size ~log(vocab), so its
//! absolute error does not shrink with it. How small that error now is on
//! tiny KLs: `tiny_kls_are_accurate_in_absolute_terms` (5e-9 nats).
//! Inputs are fresh every run; the seed is in every failure message and
//! `TREEATTN_SEED` replays it.

use crate::common;
use crate::common::calls;

/// KLs (nats) below which errors are measured relative to this floor.
const KL_FLOOR: f64 = SDCC.kl_floor;

use half::{bf16, f16};
use treeattn::backend::emu::{self, EmuOptions, SdccElem};
use treeattn::backend::launch::sdcc::{SDCC_SMEM_BYTES, SDCC_THREADS};
use treeattn::backend::tolerance::SDCC;
use treeattn::Error;
use treeattn_lab::gen::Rng;

/// An element type built from f32 (round to nearest).
trait Elem: SdccElem {
    fn from_f32(x: f32) -> Self;
}
impl Elem for bf16 {
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
}
impl Elem for f16 {
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
}
impl Elem for f32 {
    fn from_f32(x: f32) -> Self {
        x
    }
}

struct Problem<T> {
    student: Vec<T>,
    teacher: Vec<T>,
    vocab: usize,
    pairs: Vec<(u32, u32)>,
    weights: Vec<f32>,
    tau: f32,
}

/// Random logits (amplitude 6: peaked distributions); the teacher rows are
/// the student rows plus noise of amplitude `noise` (small KL) with
/// probability 1/2, independent otherwise. `neg_inf`: fraction of entries
/// set to −inf — teacher −inf entries everywhere, and the student −inf only
/// where its paired teacher is −inf too (finite KL).
fn problem<T: Elem>(
    rng: &mut Rng,
    vocab: usize,
    pairs: usize,
    neg_inf: f32,
    repeat_rows: bool,
) -> Problem<T> {
    let rows = pairs + 1;
    let mut s: Vec<f32> = (0..rows * vocab).map(|_| 6.0 * rng.signed_unit()).collect();
    let mut t = s.clone();
    for row in t.chunks_mut(vocab) {
        let noise = if rng.range(0, 1) == 0 { 0.5 } else { 6.0 };
        for x in row.iter_mut() {
            *x = if noise > 1.0 {
                6.0 * rng.signed_unit()
            } else {
                *x + noise * rng.signed_unit()
            };
        }
    }
    let pairs: Vec<(u32, u32)> = (0..pairs)
        .map(|i| {
            let srow = if repeat_rows { rng.range(0, 1) } else { i + 1 };
            (srow as u32, rng.range(0, rows - 1) as u32)
        })
        .collect();
    if neg_inf > 0.0 {
        // Never a whole row: entry 0 stays finite.
        for v in 1..vocab {
            for r in 0..rows {
                if (rng.signed_unit() + 1.0) / 2.0 < neg_inf {
                    t[r * vocab + v] = f32::NEG_INFINITY;
                }
            }
        }
        for &(sr, tr) in &pairs {
            for v in 1..vocab {
                if t[tr as usize * vocab + v] == f32::NEG_INFINITY && rng.range(0, 1) == 0 {
                    s[sr as usize * vocab + v] = f32::NEG_INFINITY;
                }
            }
        }
    }
    let weights = (0..pairs.len())
        .map(|_| (rng.signed_unit() + 1.0) * 0.75)
        .collect();
    Problem {
        student: s.iter().map(|&x| T::from_f32(x)).collect(),
        teacher: t.iter().map(|&x| T::from_f32(x)).collect(),
        vocab,
        pairs,
        weights,
        tau: [0.7f32, 1.0, 2.0][rng.range(0, 2)],
    }
}

fn widen<T: SdccElem>(x: &[T]) -> Vec<f32> {
    x.iter().map(|e| e.to_f32()).collect()
}

/// Runs both backends; returns (max relative KL error, gradient relative
/// Frobenius error), asserting every gradient element is finite.
fn compare<T: SdccElem>(what: &str, p: &Problem<T>, tau_kernel: f32) -> (f64, f64) {
    let got = calls::emu_sdcc(
        &p.student, &p.teacher, p.vocab, &p.pairs, &p.weights, tau_kernel,
    )
    .unwrap_or_else(|e| panic!("{what}: {e}"));
    errors_against_cpu(what, p, &got)
}

/// (max relative KL error, gradient relative Frobenius error) of `got`
/// against the CPU backend on `p`, asserting every gradient element finite.
fn errors_against_cpu<T: SdccElem>(
    what: &str,
    p: &Problem<T>,
    got: &calls::SdccFlat<f32>,
) -> (f64, f64) {
    let want = calls::cpu_sdcc(
        &widen(&p.student),
        &widen(&p.teacher),
        p.vocab,
        &p.pairs,
        &p.weights,
        p.tau,
    )
    .unwrap();
    let mut kl_err = 0.0f64;
    for (i, (&g, &w)) in got.per_pair.iter().zip(&want.per_pair).enumerate() {
        assert!(!g.is_nan(), "{what}: KL of pair {i} is NaN");
        if w.is_infinite() || g.is_infinite() {
            assert_eq!(g, w, "{what}: pair {i}");
            continue;
        }
        kl_err = kl_err.max((g - w).abs() / w.abs().max(KL_FLOOR));
    }
    if want.loss_sum.is_finite() {
        kl_err =
            kl_err.max((got.loss_sum - want.loss_sum).abs() / want.loss_sum.abs().max(KL_FLOOR));
    }
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (i, (&g, &w)) in got.grad_student.iter().zip(&want.grad_student).enumerate() {
        assert!(g.is_finite(), "{what}: gradient[{i}] = {g} (not written?)");
        num += (g as f64 - w as f64).powi(2);
        den += (w as f64).powi(2);
    }
    (kl_err, (num / den.max(f64::MIN_POSITIVE)).sqrt())
}

fn check<T: Elem>(
    rng: &mut Rng,
    seed: u64,
    vocab: usize,
    pairs: usize,
    neg_inf: f32,
    repeat: bool,
) {
    let p = problem::<T>(rng, vocab, pairs, neg_inf, repeat);
    let what = format!(
        "seed {seed}: {} vocab {vocab}, {pairs} pairs, −inf fraction {neg_inf}, repeated rows {repeat}, τ {}",
        T::NAME,
        p.tau
    );
    let (kl_err, grad_err) = compare(&what, &p, p.tau);
    eprintln!("{what}: KL relative error {kl_err:.2e}, gradient {grad_err:.2e}");
    assert!(
        kl_err <= SDCC.kl_rel,
        "{what}: KL relative error {kl_err:.3e} > {:.0e}",
        SDCC.kl_rel
    );
    assert!(
        grad_err <= SDCC.grad_rel,
        "{what}: gradient relative error {grad_err:.3e} > {:.0e}",
        SDCC.grad_rel
    );
}

#[test]
fn random_vocabularies_from_7_to_150k() {
    let (mut rng, seed) = common::seeded_rng();
    for (vocab, pairs) in [
        (7usize, 5usize),
        (100, 4),
        (2048, 3),
        (5000, 3),
        (150_000, 2),
    ] {
        check::<bf16>(&mut rng, seed, vocab, pairs, 0.0, false);
        check::<f16>(&mut rng, seed, vocab, pairs, 0.0, false);
        check::<f32>(&mut rng, seed, vocab, pairs, 0.0, false);
    }
}

#[test]
fn negative_infinity_entries_are_ordinary_input() {
    let (mut rng, seed) = common::seeded_rng();
    for vocab in [7usize, 300, 9000] {
        check::<bf16>(&mut rng, seed, vocab, 3, 0.3, false);
        check::<f32>(&mut rng, seed, vocab, 3, 0.7, false);
    }
}

/// A student −inf where the teacher has mass: KL = +inf (the true value) for
/// that pair, a finite gradient equal to the CPU's; a zero weight keeps it
/// out of the loss.
#[test]
fn student_negative_infinity_under_teacher_mass_gives_infinite_kl() {
    let (mut rng, seed) = common::seeded_rng();
    let mut p = problem::<f32>(&mut rng, 500, 3, 0.0, false);
    let (s, t) = p.pairs[1];
    let v = rng.range(0, 499);
    p.student[s as usize * 500 + v] = f32::NEG_INFINITY;
    assert!(p.teacher[t as usize * 500 + v].is_finite());
    let what = format!("seed {seed}");
    let (kl_err, grad_err) = compare(&what, &p, p.tau);
    assert!(
        kl_err <= 1e-4 && grad_err <= 1e-3,
        "{what}: {kl_err:.2e} {grad_err:.2e}"
    );
    let out = calls::emu_sdcc(&p.student, &p.teacher, 500, &p.pairs, &p.weights, p.tau).unwrap();
    assert_eq!(out.per_pair[1], f64::INFINITY, "{what}");
    assert_eq!(out.loss_sum, f64::INFINITY, "{what}");
    p.weights[1] = 0.0;
    let out = calls::emu_sdcc(&p.student, &p.teacher, 500, &p.pairs, &p.weights, p.tau).unwrap();
    assert!(
        out.loss_sum.is_finite(),
        "{what}: a zero-weight +inf pair leaked into the loss"
    );
}

/// Student rows named by several pairs accumulate their pairs' gradients
/// (f32 atomics in the kernel), as the CPU backend sums them.
#[test]
fn repeated_student_rows_accumulate() {
    let (mut rng, seed) = common::seeded_rng();
    check::<bf16>(&mut rng, seed, 3000, 6, 0.0, true);
    check::<f32>(&mut rng, seed, 31, 9, 0.2, true);
}

/// Identical student and teacher: every KL is exactly 0 and so is every
/// gradient element (the two online states evolve identically).
#[test]
fn identical_student_and_teacher_give_zero() {
    let (mut rng, seed) = common::seeded_rng();
    for vocab in [7usize, 4099, 150_000] {
        let p = problem::<bf16>(&mut rng, vocab, 2, 0.1, false);
        let pairs: Vec<(u32, u32)> = vec![(1, 1), (2, 2)];
        let out =
            calls::emu_sdcc(&p.student, &p.student, vocab, &pairs, &[1.0, 0.5], p.tau).unwrap();
        assert_eq!(out.per_pair, vec![0.0, 0.0], "seed {seed}: vocab {vocab}");
        assert_eq!(out.loss_sum, 0.0);
        assert!(
            out.grad_student.iter().all(|&g| g == 0.0),
            "seed {seed}: vocab {vocab}: nonzero gradient for identical distributions"
        );
    }
}

/// The kernel gives the same answer under every emulator schedule (warp
/// orders, cp.async timing): its barriers order the block reduction.
#[test]
fn every_schedule_agrees() {
    let (mut rng, seed) = common::seeded_rng();
    let p = problem::<bf16>(&mut rng, 3000, 2, 0.1, false);
    let run = |opts| {
        calls::with_options(opts, || {
            calls::emu_sdcc(&p.student, &p.teacher, 3000, &p.pairs, &p.weights, p.tau).unwrap()
        })
    };
    let first = run(EmuOptions::all()[0]);
    for opts in EmuOptions::all() {
        assert_eq!(run(opts), first, "seed {seed}: {opts:?}");
    }
}

/// The unfused baseline (gpu-check times the fused kernel against it) gives
/// the CPU backend's answer (KL within 1e-4 relative + 1e-6 absolute,
/// gradient 1e-3), repeated rows and −inf entries included, under every
/// emulator schedule, and reports bad rows as the fused kernel does.
#[test]
fn unfused_baseline_matches_the_cpu_backend() {
    let (mut rng, seed) = common::seeded_rng();
    for (vocab, pairs, neg_inf, repeat) in [
        (7usize, 4usize, 0.0f32, false),
        (5000, 5, 0.3, true),
        (150_000, 2, 0.0, false),
    ] {
        let p = problem::<bf16>(&mut rng, vocab, pairs, neg_inf, repeat);
        let want = calls::cpu_sdcc(
            &widen(&p.student),
            &widen(&p.teacher),
            vocab,
            &p.pairs,
            &p.weights,
            p.tau,
        )
        .unwrap();
        for opts in EmuOptions::all() {
            let what = format!("seed {seed}: unfused vocab {vocab} {opts:?}");
            let got = calls::with_options(opts, || {
                calls::emu_sdcc_unfused(&p.student, &p.teacher, vocab, &p.pairs, &p.weights, p.tau)
            })
            .unwrap();
            for (i, (&g, &w)) in got.per_pair.iter().zip(&want.per_pair).enumerate() {
                if w.is_infinite() || g.is_infinite() {
                    assert_eq!(g, w, "{what}: pair {i}");
                    continue;
                }
                // 1e-4 relative plus 1e-6 absolute: the baseline's f32
                // log-probabilities carry ~1e-7 absolute error each (x/τ −
                // LSE rounded), which dominates a KL near 1e-3 — one reason
                // the fused kernel keeps the cross term instead.
                let e = (g - w).abs();
                assert!(
                    e <= 1e-4 * w.abs() + 1e-6,
                    "{what}: KL of pair {i}: {g} vs {w} ({e:.2e})"
                );
            }
            let (mut num, mut den) = (0.0f64, 0.0f64);
            for (&g, &w) in got.grad_student.iter().zip(&want.grad_student) {
                num += (g as f64 - w as f64).powi(2);
                den += (w as f64).powi(2);
            }
            let e = (num / den).sqrt();
            assert!(e <= 1e-3, "{what}: gradient error {e:.2e}");
        }
    }
    let v = 10usize;
    let s = vec![0.5f32; 2 * v];
    let mut t = s.clone();
    t[v..].fill(f32::NEG_INFINITY);
    let e = calls::emu_sdcc_unfused(&s, &t, v, &[(0, 0), (1, 1)], &[1.0, 1.0], 1.0).unwrap_err();
    assert!(
        e.to_string()
            .contains("pair 1: teacher logits row 1 is entirely −inf"),
        "{e}"
    );
}

/// The 16-byte vector path (vocab a multiple of 8, aligned tensors) and the
/// scalar path (the same logits one element off a 16-byte boundary) agree:
/// each within the tolerances of the CPU backend, and with each other within
/// the same KL bound (their f32 summation orders differ) and a gradient
/// relative Frobenius difference of 1e-4.
#[test]
fn vector_and_scalar_paths_agree() {
    let (mut rng, seed) = common::seeded_rng();
    for vocab in [8usize, 4096, 40_000] {
        let p = problem::<bf16>(&mut rng, vocab, 3, 0.2, false);
        let mut shifted_s = vec![bf16::ZERO; p.student.len() + 8];
        let mut shifted_t = vec![bf16::ZERO; p.teacher.len() + 8];
        // One element past a 16-byte boundary: never vector-aligned.
        let off = |v: &Vec<bf16>| (16 - (v.as_ptr() as usize % 16)) / 2 % 8 + 1;
        let (os, ot) = (off(&shifted_s), off(&shifted_t));
        shifted_s[os..os + p.student.len()].copy_from_slice(&p.student);
        shifted_t[ot..ot + p.teacher.len()].copy_from_slice(&p.teacher);
        let (ss, tt) = (
            &shifted_s[os..os + p.student.len()],
            &shifted_t[ot..ot + p.teacher.len()],
        );
        assert!(
            !(ss.as_ptr() as usize).is_multiple_of(16)
                && !(tt.as_ptr() as usize).is_multiple_of(16)
        );
        // (The system allocator aligns these to 16 bytes: the vector path.)
        assert!(
            (p.student.as_ptr() as usize).is_multiple_of(16)
                && (p.teacher.as_ptr() as usize).is_multiple_of(16)
        );
        let aligned =
            calls::emu_sdcc(&p.student, &p.teacher, vocab, &p.pairs, &p.weights, p.tau).unwrap();
        let scalar = calls::emu_sdcc(ss, tt, vocab, &p.pairs, &p.weights, p.tau).unwrap();
        for (i, (&a, &b)) in aligned.per_pair.iter().zip(&scalar.per_pair).enumerate() {
            if a.is_infinite() || b.is_infinite() {
                assert_eq!(a, b, "seed {seed}: vocab {vocab}: pair {i}");
            } else {
                assert!(
                    (a - b).abs() <= 1e-4 * a.abs().max(KL_FLOOR),
                    "seed {seed}: vocab {vocab}: pair {i}: {a} vs {b}"
                );
            }
        }
        // Gradient entries are differences of probabilities computed by f32
        // exp2 from each path's own LSE; the paths' LSEs differ in their last
        // f32 bits, so entries differ by ~1e-6 at vocab 8. Held to a relative
        // Frobenius 1e-4: ten times tighter than the bound against the CPU.
        let (mut num, mut den) = (0.0f64, 0.0f64);
        for (&a, &b) in aligned.grad_student.iter().zip(&scalar.grad_student) {
            num += (a as f64 - b as f64).powi(2);
            den += (a as f64).powi(2);
        }
        let g_diff = (num / den.max(f64::MIN_POSITIVE)).sqrt();
        assert!(
            g_diff <= 1e-4,
            "seed {seed}: vocab {vocab}: vector and scalar gradients differ by {g_diff:.2e} (relative Frobenius)"
        );
        let what = format!("seed {seed}: vocab {vocab} scalar path");
        let (kl, g) = errors_against_cpu(&what, &p, &scalar);
        assert!(
            kl <= 1e-4 && g <= 1e-3,
            "{what}: KL error {kl:.2e}, gradient {g:.2e}"
        );
    }
}

/// Negative control: the kernel at a different temperature than the
/// reference is far outside the tolerances (so they can fail).
#[test]
fn wrong_temperature_fails_the_tolerance() {
    let (mut rng, seed) = common::seeded_rng();
    let p = problem::<f32>(&mut rng, 1000, 3, 0.0, false);
    let (kl_err, grad_err) = compare(&format!("seed {seed}"), &p, p.tau * 1.1);
    assert!(
        kl_err > 1e-2 && grad_err > 1e-2,
        "seed {seed}: {kl_err:.2e} {grad_err:.2e}"
    );
}

#[test]
fn gradient_buffer_is_fully_written() {
    let (mut rng, seed) = common::seeded_rng();
    let p = problem::<f16>(&mut rng, 777, 4, 0.0, false);
    // Row 0 is named by no pair: zeroed; rows 1..=4 written by the kernel.
    let mut grad = vec![f32::NAN; p.student.len()];
    calls::emu_sdcc_into(
        &p.student, &p.teacher, 777, &p.pairs, &p.weights, p.tau, &mut grad,
    )
    .unwrap();
    assert!(
        grad[..777].iter().all(|&g| g == 0.0),
        "seed {seed}: unused row not zeroed"
    );
    assert!(
        grad.iter().all(|g| g.is_finite()),
        "seed {seed}: gradient element not written"
    );
}

#[test]
fn bad_inputs_are_errors() {
    let v = 10usize;
    let s = vec![0.5f32; 3 * v];
    let pairs = [(0u32, 1u32), (2, 2)];
    let w = [1.0f32, 1.0];
    assert!(calls::emu_sdcc(&s, &s, v, &pairs, &w, 1.0).is_ok());
    assert!(matches!(
        calls::emu_sdcc(&s, &s, 0, &pairs, &w, 1.0),
        Err(Error::Shape(_))
    ));
    assert!(matches!(
        calls::emu_sdcc(&s, &s, 7, &pairs, &w, 1.0),
        Err(Error::Shape(_))
    ));
    assert!(matches!(
        calls::emu_sdcc(&s, &s, v, &pairs, &w[..1], 1.0),
        Err(Error::Shape(_))
    ));
    assert!(matches!(
        calls::emu_sdcc(&s, &s, v, &pairs, &w, 0.0),
        Err(Error::Unsupported(_))
    ));
    assert!(matches!(
        calls::emu_sdcc(&s, &s, v, &pairs, &[1.0, -1.0], 1.0),
        Err(Error::Unsupported(_))
    ));
    assert!(matches!(
        calls::emu_sdcc(&s, &s, v, &pairs, &[1.0, f32::NAN], 1.0),
        Err(Error::NonFinite { index: 1, .. })
    ));
    assert!(matches!(
        calls::emu_sdcc(&s, &s, v, &[(3, 0)], &[1.0], 1.0),
        Err(Error::Pack(_))
    ));
    // A NaN in the teacher row of pair 1, +inf in the student row of pair 0.
    let mut t = s.clone();
    t[2 * v + 4] = f32::NAN;
    let e = calls::emu_sdcc(&s, &t, v, &pairs, &w, 1.0).unwrap_err();
    assert!(
        e.to_string().contains("pair 1: teacher logits row 2"),
        "{e}"
    );
    let mut s2 = s.clone();
    s2[3] = f32::INFINITY;
    let e = calls::emu_sdcc(&s2, &t, v, &pairs, &w, 1.0).unwrap_err();
    assert!(
        e.to_string().contains("pair 0: student logits row 0"),
        "{e}"
    );
    // An entirely −inf student row.
    let mut s3 = s.clone();
    s3[2 * v..].fill(f32::NEG_INFINITY);
    let e = calls::emu_sdcc(&s3, &s, v, &pairs, &w, 1.0).unwrap_err();
    assert!(
        e.to_string()
            .contains("student logits row 2 is entirely −inf"),
        "{e}"
    );
    // The CPU backend rejects the same inputs.
    assert!(calls::cpu_sdcc(&s3, &s, v, &pairs, &w, 1.0).is_err());
    // No pairs: zero loss, zero gradient.
    let out = calls::emu_sdcc(&s, &s, v, &[], &[], 1.0).unwrap();
    assert_eq!((out.loss_sum, out.loss_mean), (0.0, 0.0));
    assert!(out.grad_student.iter().all(|&g| g == 0.0));
}

#[test]
fn rust_launch_plan_matches_the_kernel() {
    assert_eq!(emu::sdcc_kernel_traits(), (SDCC_THREADS, SDCC_SMEM_BYTES));
}

/// Tiny KLs (a student a small perturbation of its teacher, as SDCC sees
/// once the compressed stream has learnt the live one): the kernel's
/// absolute KL error against the CPU backend's f64, on the same f32
/// logits. The per-thread sums and the cross term are accumulated in f64
/// (the exponentials stay f32), so the error is set by the f32 exponentials'
/// rounding, not by cancellation between `W / Z_t`, `log Z_t` and `log Z_s`.
/// Bound: 5e-9 nats (measured ≤ 4.6e-10 over five runs at vocab 32k–150k,
/// KLs 1.7e-7 and 1.5e-4; the previous f32 sums gave 1.3e-9 to 4.8e-8, which
/// fails it).
#[test]
fn tiny_kls_are_accurate_in_absolute_terms() {
    const TINY_KL_ABS: f64 = 5e-9;
    let (mut rng, seed) = common::seeded_rng();
    for (vocab, eps) in [(32_000usize, 1e-3f32), (150_000, 1e-3), (150_000, 3e-2)] {
        let teacher: Vec<f32> = (0..2 * vocab).map(|_| 4.0 * rng.signed_unit()).collect();
        let student: Vec<f32> = teacher
            .iter()
            .map(|&x| x + eps * rng.signed_unit())
            .collect();
        let pairs = [(0u32, 0u32), (1, 1)];
        let got = calls::emu_sdcc(&student, &teacher, vocab, &pairs, &[1.0, 1.0], 1.0)
            .unwrap_or_else(|e| panic!("seed {seed}: {e}"));
        let want = calls::cpu_sdcc(&student, &teacher, vocab, &pairs, &[1.0, 1.0], 1.0).unwrap();
        for (i, (&g, &w)) in got.per_pair.iter().zip(&want.per_pair).enumerate() {
            let err = (g - w).abs();
            eprintln!("vocab {vocab}, ε {eps}: pair {i} KL {w:.3e}, |error| {err:.2e}");
            assert!(
                err <= TINY_KL_ABS,
                "seed {seed}: vocab {vocab}, ε {eps}, pair {i}: KL {w:e}, error {err:e} > {TINY_KL_ABS:e}"
            );
        }
    }
}
