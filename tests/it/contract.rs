//! The backend contract (`backend::contract`): what `PackMask`, `AttnArgs`,
//! the call types and `SdccArgs` reject before any backend runs, that every
//! host backend is driven through one generic function, and that the
//! emulator follows the CPU backend's policy for non-finite results.

use crate::common;

use half::bf16;
use treeattn::backend::cpu::Cpu;
use treeattn::backend::emu::Emu;
use treeattn::backend::{
    AttentionBackend, AttnArgs, AttnParams, AttnShape, Element, Grads, Host, HostAttention,
    HostSdcc, Rope, Saved, SdccArgs, MAX_HEAD_DIM, MAX_SDCC_VOCAB,
};
use treeattn::mask::PackMask;
use treeattn::Error;

const CAUSAL: [u32; 3] = [3, 3, 3];
const POS: [u32; 3] = [0, 1, 2];

fn shape(head_dim: usize) -> AttnShape {
    AttnShape {
        tokens: 3,
        q_heads: 2,
        kv_heads: 1,
        head_dim,
        v_head_dim: head_dim,
    }
}

/// Used to reach the emulated kernel with rotary on and too few position
/// ids, which read past the table and crashed the process: the mask cannot
/// be built any more.
#[test]
fn a_mask_with_too_few_position_ids_cannot_be_built() {
    let e = PackMask::new(&CAUSAL, &POS[..2]).unwrap_err();
    assert!(
        matches!(&e, Error::Pack(m) if m.contains("3 entries") && m.contains("has 2")),
        "{e}"
    );
}

/// `kv_end[k] > L` and `kv_end[k] < k` were accepted by the emulated forward
/// and gave a wrong result.
#[test]
fn a_mask_breaking_the_interval_rule_cannot_be_built() {
    for (kv, bad) in [
        ([3u32, 4, 3], "kv_end[1] = 4"),
        ([3, 0, 3], "kv_end[1] = 0"),
    ] {
        let e = PackMask::new(&kv, &POS).unwrap_err();
        assert!(matches!(&e, Error::Pack(m) if m.contains(bad)), "{e}");
    }
    // Padding keys (kv_end[k] == k) are valid.
    assert!(PackMask::new(&[3, 1, 3], &POS).is_ok());
}

#[test]
fn attention_arguments_are_checked_once_with_names() {
    let mask = PackMask::new(&CAUSAL, &POS).unwrap();
    let s = shape(8);
    let (q, kv) = (vec![0.1f32; s.q_len()], vec![0.2f32; s.kv_len()]);
    let p = AttnParams::new(8);
    let args = |q: &[f32], k: &[f32], s: AttnShape, m: PackMask<'_>, p: AttnParams| {
        AttnArgs::<Host, f32>::new(q, k, &kv, s, m, p).map(drop)
    };
    assert!(args(&q, &kv, s, mask, p).is_ok(), "negative control");
    let e = args(&q[1..], &kv, s, mask, p).unwrap_err();
    assert!(
        matches!(&e, Error::Shape(m) if m.starts_with("q has 47")),
        "{e}"
    );
    let e = args(&q, &kv[1..], s, mask, p).unwrap_err();
    assert!(
        matches!(&e, Error::Shape(m) if m.starts_with("k has 23")),
        "{e}"
    );
    let two = PackMask::new(&[2, 2], &[0, 1]).unwrap();
    let e = args(&q, &kv, s, two, p).unwrap_err();
    assert!(
        matches!(&e, Error::Pack(m) if m.contains("2 tokens")),
        "{e}"
    );
    let gqa = AttnShape { kv_heads: 3, ..s };
    assert!(matches!(args(&q, &kv, gqa, mask, p), Err(Error::Shape(_))));
    let rope = AttnParams {
        rope: Some(Rope {
            base: 10_000.0,
            dims: 10,
        }),
        ..p
    };
    let e = args(&q, &kv, s, mask, rope).unwrap_err();
    assert!(e.to_string().contains("rotary dims 10"), "{e}");
    let mut nan = q.clone();
    nan[7] = f32::NAN;
    let checked = AttnParams {
        check_finite: true,
        ..p
    };
    assert!(args(&nan, &kv, s, mask, p).is_ok(), "unchecked");
    assert_eq!(
        args(&nan, &kv, s, mask, checked).unwrap_err(),
        Error::NonFinite {
            what: "q".into(),
            index: 7
        }
    );
}

/// A head dim past the limit is refused before anything is allocated (one
/// token at head dim 2^24 used to take 108 s and 16.9 GB).
#[test]
fn head_dims_past_the_limit_and_overflowing_shapes_are_refused() {
    let mask = PackMask::new(&[1], &[0]).unwrap();
    let s = AttnShape {
        tokens: 1,
        q_heads: 1,
        kv_heads: 1,
        head_dim: MAX_HEAD_DIM + 1,
        v_head_dim: MAX_HEAD_DIM + 1,
    };
    let x = vec![0.0f32; s.q_len()];
    let e = AttnArgs::<Host, f32>::new(&x, &x, &x, s, mask, AttnParams::new(s.head_dim));
    assert!(
        matches!(&e, Err(Error::Unsupported(m)) if m.contains("head_dim")),
        "{:?}",
        e.map(drop)
    );
    let huge = AttnShape {
        tokens: usize::MAX / 2,
        q_heads: 4,
        kv_heads: 1,
        head_dim: 64,
        v_head_dim: 64,
    };
    assert!(matches!(huge.validate(), Err(Error::Shape(m)) if m.contains("overflows")));
}

#[test]
fn outputs_and_saved_state_are_checked_against_the_call() {
    let mask = PackMask::new(&CAUSAL, &POS).unwrap();
    let s = shape(8);
    let (q, kv) = (vec![0.1f64; s.q_len()], vec![0.2f64; s.kv_len()]);
    let args = AttnArgs::new(&q[..], &kv[..], &kv[..], s, mask, AttnParams::new(8)).unwrap();
    let cpu = Cpu::default();
    let (mut o, mut lse) = (vec![0.0; s.q_len()], vec![0.0; s.lse_len()]);
    let e = cpu.forward(&args, &mut o[1..], &mut lse[..]).unwrap_err();
    assert!(
        matches!(&e, Error::Shape(m) if m.starts_with("o has")),
        "{e}"
    );
    let e = cpu.forward(&args, &mut o[..], &mut lse[1..]).unwrap_err();
    assert!(
        matches!(&e, Error::Shape(m) if m.starts_with("lse has")),
        "{e}"
    );
    cpu.forward(&args, &mut o[..], &mut lse[..]).unwrap();

    let d_o = vec![1.0; s.q_len()];
    let mut g = [
        vec![0.0; s.q_len()],
        vec![0.0; s.kv_len()],
        vec![0.0; s.kv_len()],
    ];
    let mut bwd = |lse: &[f64], dk_len: usize| {
        let [dq, dk, dv] = &mut g;
        let saved = Saved { o: &o[..], lse };
        let grads = Grads {
            dq: &mut dq[..],
            dk: &mut dk[..dk_len],
            dv: &mut dv[..],
            dsinks: None,
        };
        cpu.backward(&args.reborrow(), saved, &d_o[..], grads)
    };
    assert!(bwd(&lse, s.kv_len()).is_ok(), "negative control");
    let e = bwd(&lse, s.kv_len() - 1).unwrap_err();
    assert!(
        matches!(&e, Error::Shape(m) if m.starts_with("dk has")),
        "{e}"
    );
    let mut bad = lse.clone();
    bad[4] = f64::INFINITY;
    assert!(matches!(
        bwd(&bad, s.kv_len()),
        Err(Error::NonFinite { index: 4, .. })
    ));
    bad[4] = f64::NEG_INFINITY;
    assert!(
        bwd(&bad, s.kv_len()).is_ok(),
        "−inf marks a row with no key"
    );
}

/// Forward and backward through the contract alone, for any host backend.
fn forward_backward<T: Element, B: HostAttention<T>>(
    backend: &B,
    args: &AttnArgs<'_, Host, T>,
    d_o: &[T],
) -> (Vec<f64>, Vec<f64>) {
    let fwd = backend.forward_owned(args).unwrap();
    let g = backend.backward_owned(args, fwd.saved(), d_o).unwrap();
    let wide = |x: &[T]| x.iter().map(|e| e.to_f64()).collect::<Vec<_>>();
    (wide(&fwd.o), wide(&g.dq))
}

/// The CPU backend (f64) and the emulated kernels (bf16) run from one
/// generic caller and agree within bf16 tolerance on a two-branch tree with
/// GQA; their outputs are poisoned before the backends write them, so an
/// element left unwritten would be NaN.
#[test]
fn one_generic_caller_drives_the_cpu_backend_and_the_emulator() {
    // Trunk [0, 40) seen by all, branch [40, 90), branch [90, 130).
    let l = 130;
    let kv_end: Vec<u32> = (0..l as u32)
        .map(|k| match k {
            0..=39 => 130,
            40..=89 => 90,
            _ => 130,
        })
        .collect();
    let pos: Vec<u32> = (0..l as u32)
        .map(|k| if k < 90 { k } else { k - 50 })
        .collect();
    let mask = PackMask::new(&kv_end, &pos).unwrap();
    let s = AttnShape {
        tokens: l,
        q_heads: 4,
        kv_heads: 2,
        head_dim: 64,
        v_head_dim: 64,
    };
    let (mut rng, seed) = common::seeded_rng();
    let (q, qf) = common::random_tensor::<bf16, f64>(&mut rng, s.q_len(), 1.0);
    let (k, kf) = common::random_tensor::<bf16, f64>(&mut rng, s.kv_len(), 1.0);
    let (v, vf) = common::random_tensor::<bf16, f64>(&mut rng, s.kv_len(), 1.0);
    let (d_o, dof) = common::random_tensor::<bf16, f64>(&mut rng, s.q_len(), 1.0);
    let p = AttnParams::new(64);
    let cpu_args = AttnArgs::new(&qf[..], &kf[..], &vf[..], s, mask, p).unwrap();
    let emu_args = AttnArgs::new(&q[..], &k[..], &v[..], s, mask, p).unwrap();
    let (o_ref, dq_ref) = forward_backward(&Cpu::default(), &cpu_args, &dof);
    let (o, dq) = forward_backward(&Emu::default(), &emu_args, &d_o);
    let rel = |a: &[f64], b: &[f64]| {
        let num: f64 = a.iter().zip(b).map(|(x, y)| (x - y).powi(2)).sum();
        let den: f64 = b.iter().map(|y| y * y).sum();
        (num / den).sqrt()
    };
    // bf16 outputs: 8 mantissa bits, relative rounding 2^-9 per element.
    assert!(rel(&o, &o_ref) < 1e-2, "seed {seed}: O {}", rel(&o, &o_ref));
    assert!(
        rel(&dq, &dq_ref) < 3e-2,
        "seed {seed}: dQ {}",
        rel(&dq, &dq_ref)
    );
}

/// The emulator used to return `Ok` with NaN in O and LSE where the CPU
/// backend returned `Err(NonFinite)`: both now refuse to return a
/// non-finite result (here from a NaN in v, unchecked).
#[test]
fn a_non_finite_result_is_an_error_on_every_host_backend() {
    let kv_end = vec![64u32; 64];
    let pos: Vec<u32> = (0..64).collect();
    let mask = PackMask::new(&kv_end, &pos).unwrap();
    let s = AttnShape {
        tokens: 64,
        q_heads: 1,
        kv_heads: 1,
        head_dim: 64,
        v_head_dim: 64,
    };
    let p = AttnParams::new(64);
    let x = vec![bf16::from_f32(0.25); s.q_len()];
    let mut v = x.clone();
    v[5 * 64 + 3] = bf16::NAN;
    let ok =
        Emu::default().forward_owned(&AttnArgs::new(&x[..], &x[..], &x[..], s, mask, p).unwrap());
    assert!(ok.is_ok(), "negative control");
    let e = Emu::default()
        .forward_owned(&AttnArgs::new(&x[..], &x[..], &v[..], s, mask, p).unwrap())
        .unwrap_err();
    assert!(
        matches!(&e, Error::NonFinite { what, .. } if what.starts_with("o ")),
        "{e}"
    );
    let wide = |x: &[bf16]| x.iter().map(|e| e.to_f32()).collect::<Vec<f32>>();
    let (xf, vf) = (wide(&x), wide(&v));
    let e = Cpu::default()
        .forward_owned(&AttnArgs::new(&xf[..], &xf[..], &vf[..], s, mask, p).unwrap())
        .unwrap_err();
    assert!(matches!(e, Error::NonFinite { .. }), "{e}");
}

/// SDCC with no pairs used to allocate vocab-sized buffers first (`1 << 40`
/// aborted the process, `usize::MAX` panicked on capacity overflow).
#[test]
fn sdcc_vocab_is_bounded_and_no_pairs_allocates_nothing() {
    let none: [f32; 0] = [];
    for vocab in [MAX_SDCC_VOCAB + 1, 1 << 40, usize::MAX] {
        let e = SdccArgs::<Host, f32>::new(&none, &none, vocab, &[], &[], 1.0)
            .map(drop)
            .unwrap_err();
        assert!(matches!(&e, Error::Shape(m) if m.contains("vocab")), "{e}");
    }
    let args = SdccArgs::<Host, f32>::new(&none, &none, MAX_SDCC_VOCAB, &[], &[], 1.0).unwrap();
    let out = Cpu::default().sdcc_owned(&args).unwrap();
    assert!(out.grad_student.is_empty() && out.loss.per_pair.is_empty());
    assert_eq!((out.loss.loss_sum, out.loss.loss_mean), (0.0, 0.0));
}

/// A zero-weight pair that is the only one on its student row still gets
/// that row written (0): the caller's gradient buffer holds anything before
/// the call.
#[test]
fn sdcc_writes_every_gradient_element_of_the_callers_buffer() {
    use treeattn::backend::SdccBackend;
    let vocab = 5;
    let student: Vec<f64> = (0..3 * vocab).map(|i| (i % 7) as f64 * 0.3).collect();
    let teacher: Vec<f64> = (0..2 * vocab).map(|i| (i % 3) as f64 * 0.5).collect();
    let pairs = [(0u32, 1u32), (2, 0)];
    let args = SdccArgs::new(&student[..], &teacher[..], vocab, &pairs, &[1.0, 0.0], 1.0).unwrap();
    let mut grad = vec![f64::NAN; student.len()];
    Cpu::default()
        .sdcc_forward_kl(&args, &mut grad[..])
        .unwrap();
    assert!(
        grad[..vocab].iter().any(|&g| g != 0.0),
        "pair 0 has a gradient"
    );
    assert!(grad[vocab..].iter().all(|&g| g == 0.0), "{grad:?}");
    // The emulator writes the same rows.
    let (s16, t16): (Vec<bf16>, Vec<bf16>) = (
        student.iter().map(|&x| bf16::from_f64(x)).collect(),
        teacher.iter().map(|&x| bf16::from_f64(x)).collect(),
    );
    let args = SdccArgs::new(&s16[..], &t16[..], vocab, &pairs, &[1.0, 0.0], 1.0).unwrap();
    let mut g32 = vec![f32::NAN; student.len()];
    Emu::default().sdcc_forward_kl(&args, &mut g32[..]).unwrap();
    assert!(g32[vocab..].iter().all(|&g| g == 0.0), "{g32:?}");
}
