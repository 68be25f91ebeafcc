//! The rotary kernels (kernels/rope.cu) run under the SIMT emulator: the
//! cos / sin tables `ta_rope_table` builds (what the CUDA backend caches per
//! device pack) against the f64 host tables, the elementwise rotation and
//! its inverse against f64 arithmetic, in place and out of place; and
//! attention with rotary through them (Q, K rotated once, the rotary-free
//! kernels, dQ, dK rotated back) against the CPU backend within
//! `backend::tolerance`, for bf16 and f16, head dims 64 and 128, GQA, both
//! dQ modes. (tests/it/emu_bwd.rs holds more rotary cases on random packs.)
//!
//! Inputs are fresh every run; the seed is in every failure message and
//! `TREEATTN_SEED` replays it.

use crate::common;
use crate::common::calls;

use half::{bf16, f16};
use treeattn::backend::emu::{self, DqMode, Emu, EmuOptions, KernelElem};
use treeattn::backend::launch::rope::{RopeTables, MAX_ROPE_POSITION, ROPE_THREADS};
use treeattn::backend::launch::Dtype;
use treeattn::backend::{tolerance, AttnParams, AttnShape, Rope};
use treeattn::mask::PackMask;
use treeattn_lab::gen::{self, Rng};

#[test]
fn rust_plan_matches_the_kernel_block() {
    assert_eq!(emu::rope_kernel_threads(), ROPE_THREADS);
}

/// The device tables (f64 on the device, rounded to f32) agree with the f64
/// host tables to one rounding, also at a large position id, where an f32
/// angle would be off by ~1e-3 rad.
#[test]
fn device_tables_match_the_f64_host_tables() {
    let emu = Emu::default();
    for (base, dims, pos) in [
        (10_000.0, 16, vec![0u32, 1, 2, 2, 3, 30_000, 7]),
        (500_000.0, 34, vec![5u32, 0, 300, 300, 12]),
    ] {
        let rope = Rope { base, dims };
        let got = emu.rope_tables(rope, &pos).unwrap();
        let want = RopeTables::new(rope, &pos).unwrap();
        assert_eq!(got.half, want.half);
        assert_eq!(got.cos.len(), want.cos.len());
        let worst = got
            .cos
            .iter()
            .chain(&got.sin)
            .zip(want.cos.iter().chain(&want.sin))
            .map(|(g, w)| (g - w).abs())
            .fold(0.0f32, f32::max);
        assert!(
            worst <= 6e-8,
            "base {base} dims {dims}: table error {worst:e}"
        );
        // The largest position against f64 directly.
        let p = *pos.iter().max().unwrap() as usize;
        for i in 0..dims / 2 {
            let angle = p as f64 * base.powf(-2.0 * i as f64 / dims as f64);
            let e = (got.sin[p * dims / 2 + i] as f64 - angle.sin()).abs();
            assert!(e <= 6e-8, "sin at position {p}, pair {i}: error {e:e}");
        }
    }
    let rope = Rope {
        base: 10_000.0,
        dims: 64,
    };
    assert!(emu.rope_tables(rope, &[MAX_ROPE_POSITION + 1]).is_err());
}

/// Half an ulp of the element type, relative.
fn unit_roundoff<T: KernelElem>() -> f64 {
    match T::DTYPE {
        Dtype::Bf16 => 2f64.powi(-8),
        Dtype::F16 => 2f64.powi(-11),
    }
}

fn rotation_case<T: KernelElem>(rng: &mut Rng, seed: u64, d: usize, dims: usize, heads: usize) {
    let what = format!(
        "seed {seed}: {:?} d {d} dims {dims} heads {heads}",
        T::DTYPE
    );
    let tokens = rng.range(1, 40);
    let pos: Vec<u32> = (0..tokens).map(|_| rng.range(0, 200) as u32).collect();
    let rope = Rope {
        base: 10_000.0,
        dims,
    };
    let (x, xf) = common::random_tensor::<T, f32>(rng, tokens * heads * d, 2.0);
    let emu = Emu::default();
    let tables = emu.rope_tables(rope, &pos).unwrap();
    let y = emu.rope_rotate(&tables, &pos, &x, heads, d, false).unwrap();
    let (u, half) = (unit_roundoff::<T>(), dims / 2);
    for (r, row) in y.chunks(d).enumerate() {
        let src = &xf[r * d..][..d];
        let p = pos[r / heads] as f64;
        for i in 0..half {
            let (s, c) = (p * 10_000f64.powf(-2.0 * i as f64 / dims as f64)).sin_cos();
            let (a, b) = (src[i] as f64, src[i + half] as f64);
            for (j, exact) in [(i, a * c - b * s), (i + half, b * c + a * s)] {
                let got = row[j].to_f32() as f64;
                let bound = u * exact.abs() + 1e-6 * (a.abs() + b.abs()) + 2f64.powi(-24);
                assert!(
                    (got - exact).abs() <= bound,
                    "{what}: row {r} lane {j}: {got} vs {exact}"
                );
            }
        }
        for j in 2 * half..d {
            assert_eq!(
                row[j].to_f32().to_bits(),
                src[j].to_bits(),
                "{what}: pass-through lane {j} of row {r}"
            );
        }
    }
    // In place: the same bits.
    let mut z = x.clone();
    emu.rope_rotate_in_place(&tables, &pos, &mut z, heads, d, false)
        .unwrap();
    assert!(
        z.iter()
            .zip(&y)
            .all(|(a, b)| a.to_f32().to_bits() == b.to_f32().to_bits()),
        "{what}: in place differs"
    );
    // The inverse undoes it up to the two roundings.
    emu.rope_rotate_in_place(&tables, &pos, &mut z, heads, d, true)
        .unwrap();
    let back: Vec<f64> = z.iter().map(|e| e.to_f32() as f64).collect();
    let want: Vec<f64> = xf.iter().map(|&e| e as f64).collect();
    let e = tolerance::rel_frobenius(back, &want);
    assert!(e <= 3.0 * u, "{what}: inverse(rotate(x)) off by {e:e}");
    // And the out-of-place inverse gives the same bits as in place.
    let w = emu.rope_rotate(&tables, &pos, &y, heads, d, true).unwrap();
    assert!(
        w.iter()
            .zip(&z)
            .all(|(a, b)| a.to_f32().to_bits() == b.to_f32().to_bits()),
        "{what}: out-of-place inverse differs"
    );
}

#[test]
fn rotation_matches_f64_and_inverts() {
    let (mut rng, seed) = common::seeded_rng();
    for d in [64usize, 128] {
        // Full, half, and an odd number of pairs (17).
        for dims in [d, d / 2, 34] {
            rotation_case::<bf16>(&mut rng, seed, d, dims, 3);
            rotation_case::<f16>(&mut rng, seed, d, dims, 2);
        }
    }
}

fn rel_err<T: KernelElem>(got: &[T], want: &[f32]) -> f64 {
    let want: Vec<f64> = want.iter().map(|&x| x as f64).collect();
    tolerance::rel_frobenius(got.iter().map(|e| e.to_f32() as f64), &want)
}

/// Forward and backward with rotary on a random tree pack with GQA (4 query
/// heads over 2 kv heads) against the CPU backend (f32 on the same rounded
/// inputs; its backward from its own forward's O rounded to `T` and LSE).
fn attention_case<T: KernelElem>(
    rng: &mut Rng,
    seed: u64,
    d: usize,
    dims: usize,
    mode: DqMode,
    opts: EmuOptions,
) {
    let p = loop {
        let padding = rng.range(0, 4);
        let p = gen::random_forest(rng, 2, 16, 3, padding);
        if p.kv_end.len() <= 200 {
            break p;
        }
    };
    let shape = AttnShape {
        tokens: p.kv_end.len(),
        q_heads: 4,
        kv_heads: 2,
        head_dim: d,
        v_head_dim: d,
    };
    let what = format!(
        "seed {seed}: {:?} {shape:?} rope dims {dims} {mode:?} {opts:?}",
        T::DTYPE
    );
    let params = AttnParams {
        rope: Some(Rope {
            base: 10_000.0,
            dims,
        }),
        ..AttnParams::new(d)
    };
    let mask = PackMask::new(&p.kv_end, &p.position_ids).unwrap();
    let (q, qf) = common::random_tensor::<T, f32>(rng, shape.q_len(), 2.0);
    let (k, kf) = common::random_tensor::<T, f32>(rng, shape.kv_len(), 2.0);
    let (v, vf) = common::random_tensor::<T, f32>(rng, shape.kv_len(), 1.0);
    let (d_o, dof) = common::random_tensor::<T, f32>(rng, shape.q_len(), 1.0);
    let tol = tolerance::attention(T::DTYPE);

    let got = calls::with_options(opts, || {
        calls::emu_forward(&q, &k, &v, shape, mask, &params)
    })
    .unwrap_or_else(|e| panic!("{what}: {e}"));
    let want = calls::cpu_forward(&qf, &kf, &vf, shape, mask, &params).unwrap();
    let e = rel_err(&got.o, &want.o);
    assert!(
        e <= tol.o_rel,
        "{what}: O error {e:.3e} > {:.0e}",
        tol.o_rel
    );

    let o: Vec<T> = want.o.iter().map(|&x| T::from_f32(x)).collect();
    let of: Vec<f32> = o.iter().map(|e| e.to_f32()).collect();
    let grads = calls::with_options(opts, || {
        calls::emu_backward(&q, &k, &v, &o, &want.lse, &d_o, shape, mask, &params, mode)
    })
    .unwrap_or_else(|e| panic!("{what}: {e}"));
    let want_g =
        calls::cpu_backward(&qf, &kf, &vf, &of, &want.lse, &dof, shape, mask, &params).unwrap();
    for (name, g, w) in [
        ("dQ", &grads.dq, &want_g.dq),
        ("dK", &grads.dk, &want_g.dk),
        ("dV", &grads.dv, &want_g.dv),
    ] {
        let e = rel_err(g, w);
        eprintln!("{what}: {name} error {e:.2e}");
        assert!(
            e <= tol.grad_rel,
            "{what}: {name} error {e:.3e} > {:.0e}",
            tol.grad_rel
        );
    }
}

#[test]
fn attention_with_rotary_gqa_matches_the_cpu() {
    let (mut rng, seed) = common::seeded_rng();
    let all = EmuOptions::all();
    let modes = [DqMode::Deterministic, DqMode::Atomic];
    for (i, d) in [64usize, 128].into_iter().enumerate() {
        attention_case::<bf16>(&mut rng, seed, d, d, modes[i], all[2 * i]);
        attention_case::<f16>(&mut rng, seed, d, d / 2, modes[1 - i], all[2 * i + 1]);
    }
}

/// With `check_finite`, a rotation that overflows the element type is an
/// error naming the rotated tensor, in the forward and the backward (the
/// rotary sequence of `launch::rope`, which the CUDA backend runs too,
/// scans the rotated copies): f16 q and k of 60,000 in every lane
/// (finite), whose first pair at position 1 turns by 1 rad. Control: the
/// same calls on 1s pass.
#[test]
fn a_rotation_that_overflows_is_named_with_check_finite() {
    let (l, d) = (2usize, 64usize);
    let kv_end = vec![2u32, 2];
    let pos = vec![0u32, 1];
    let mask = PackMask::new(&kv_end, &pos).unwrap();
    let shape = AttnShape::new(l, 1, 1, d);
    // θ_0 = base^0 = 1 for the first pair: the angle at position 1 is 1
    // rad, which rotates (a, a) to (a (cos 1 − sin 1), a (cos 1 + sin 1)):
    // 1.3818 a, past 65,504 for a = 60,000.
    let params = AttnParams {
        rope: Some(Rope {
            base: 10_000.0,
            dims: d,
        }),
        check_finite: true,
        ..AttnParams::new(d)
    };
    let big = vec![f16::from_f32(60_000.0); l * d];
    let ones = vec![f16::from_f32(1.0); l * d];
    let e = calls::emu_forward(&big, &ones, &ones, shape, mask, &params).unwrap_err();
    assert!(
        matches!(&e, treeattn::Error::NonFinite { what, index } if what == "q" && *index >= d),
        "{e:?}"
    );
    let e = calls::emu_forward(&ones, &big, &ones, shape, mask, &params).unwrap_err();
    assert!(
        matches!(&e, treeattn::Error::NonFinite { what, .. } if what == "k"),
        "{e:?}"
    );
    let out = calls::emu_forward(&ones, &ones, &ones, shape, mask, &params).unwrap();
    let e = calls::emu_backward(
        &big,
        &ones,
        &ones,
        &out.o,
        &out.lse,
        &ones,
        shape,
        mask,
        &params,
        DqMode::Atomic,
    )
    .unwrap_err();
    assert!(
        matches!(&e, treeattn::Error::NonFinite { what, .. } if what == "q"),
        "{e:?}"
    );
    calls::emu_backward(
        &ones,
        &ones,
        &ones,
        &out.o,
        &out.lse,
        &ones,
        shape,
        mask,
        &params,
        DqMode::Atomic,
    )
    .unwrap();
}
