//! The CPU backend's code paths side by side in one process: each path the
//! machine supports ([`best_isa`] and below) is forced in turn with
//! [`force_isa`] and runs the same f32 and f64 forward and backward on tree
//! masks (partial tiles, gathered keys, padding, GQA, rotary; and a sliding
//! window, a softcap and sinks together). The test runs
//! in a process of its own ([`own_process`](crate::common::own_process)),
//! since the switch is process-wide.
//!
//! Tolerances:
//! - AVX-512 against AVX2 + FMA: bit for bit. Both copies are the same
//!   code (fused multiply-adds, the same AVX2 row-softmax intrinsics, no
//!   reassociation) compiled for wider registers: vectorizing a lane-wise
//!   loop changes no element's operations or their order.
//! - A SIMD path against the portable one: they differ only in the
//!   rounding of fused multiply-adds (the softmax steps give the same bits,
//!   `lanes`' tests), i.e. by ~1 ulp per product-sum step; the bounds are
//!   those of `attention_portable` (each path against the f64 backend),
//!   relative Frobenius 1e-5 on O and LSE and 2e-5 on the gradients in f32,
//!   1e-12 in f64.

use treeattn::backend::cpu::{best_isa, force_isa, isa, CpuFloat, Isa};
use treeattn::backend::{AttnParams, AttnShape, Rope};
use treeattn_lab::gen::{MaskBuilder, Rng};

/// Relative Frobenius error of `got` against `want` (finite entries of
/// `want` only: rows with no visible key have LSE −inf on every path).
fn rel<T: CpuFloat>(got: &[T], want: &[T]) -> f64 {
    let (mut num, mut den) = (0.0, 0.0);
    for (&g, &w) in got.iter().zip(want) {
        let (g, w) = (g.to_f64(), w.to_f64());
        if w.is_finite() {
            num += (g - w).powi(2);
            den += w * w;
        } else {
            assert_eq!(g.to_bits(), w.to_bits(), "non-finite entries differ");
        }
    }
    (num / den.max(1e-300)).sqrt()
}

/// A tree pack (partial tiles, gathered keys, padding), its shape with 2 kv
/// heads of `group` query heads each at head dim `d`, and rotary if `rope`.
fn case(rng: &mut Rng, d: usize, rope: bool, group: usize) -> (MaskBuilder, AttnShape, AttnParams) {
    let mut b = MaskBuilder::new();
    b.push_tree(rng, 0, 24, 4, true);
    b.push_fan(70, 3, 30);
    b.push_fan(90, 4, 170);
    b.push_padding(5);
    let shape = AttnShape {
        tokens: b.len(),
        q_heads: 2 * group,
        kv_heads: 2,
        head_dim: d,
        v_head_dim: d,
    };
    let mut params = AttnParams::new(d);
    params.rope = rope.then_some(Rope {
        base: 10_000.0,
        dims: d,
    });
    (b, shape, params)
}

/// Every output of one forward and backward, in order o, lse, dq, dk, dv,
/// dsinks (empty without sinks).
type Outputs<T> = [Vec<T>; 6];

fn run_all<T: CpuFloat>(seed: u64, tol: f64) {
    use treeattn::backend::cpu::Cpu;
    use treeattn::backend::{AttnArgs, HostAttention};
    let mut rng = Rng::new(seed);
    for (d, rope, variants) in [
        (64, false, false),
        (40, true, false),
        (128, false, false),
        (48, true, true),
    ] {
        let (b, shape, mut params) = case(&mut rng, d, rope, 2);
        let mask = b.mask().unwrap();
        if variants {
            params.window = Some(7);
            params.softcap = Some(2.5);
        }
        let sinks: Vec<T> = (0..shape.q_heads)
            .map(|h| T::from_f64(h as f64 - 1.5))
            .collect();
        let mut data = |n: usize| -> Vec<T> {
            (0..n)
                .map(|_| T::from_f64(rng.signed_unit() as f64))
                .collect()
        };
        let (q, k, v, d_o) = (
            data(shape.q_len()),
            data(shape.kv_len()),
            data(shape.kv_len()),
            data(shape.q_len()),
        );
        let mut results: Vec<(Isa, Outputs<T>)> = Vec::new();
        for path in [Isa::Portable, Isa::Avx2Fma, Isa::Avx512] {
            if path > best_isa() {
                assert!(!force_isa(path), "{path:?} forced on a CPU without it");
                continue;
            }
            assert!(force_isa(path));
            assert_eq!(isa(), path);
            let mut args = AttnArgs::new(&q[..], &k[..], &v[..], shape, mask, params).unwrap();
            if variants {
                args = args.with_sinks(&sinks[..]).unwrap();
            }
            let f = Cpu::default().forward_owned(&args).unwrap();
            let g = Cpu::default()
                .backward_owned(&args, f.saved(), &d_o)
                .unwrap();
            let ds = g.dsinks.unwrap_or_default();
            results.push((path, [f.o, f.lse, g.dq, g.dk, g.dv, ds]));
        }
        let names = ["o", "lse", "dq", "dk", "dv", "dsinks"];
        let (_, portable) = &results[0];
        for (path, out) in &results[1..] {
            for (i, name) in names.iter().enumerate() {
                let bound = if i < 2 { tol } else { 2.0 * tol };
                let e = rel(&out[i], &portable[i]);
                assert!(
                    e < bound,
                    "{path:?} vs portable, {name}: {e:e} (d={d}, rope={rope})"
                );
            }
        }
        if let [(_, avx2), (_, avx512)] = &results[1..] {
            for (i, name) in names.iter().enumerate() {
                let bits = |x: &[T]| x.iter().map(|v| v.to_f64().to_bits()).collect::<Vec<_>>();
                assert!(
                    bits(&avx512[i]) == bits(&avx2[i]),
                    "avx512 vs avx2+fma, {name}: not bit-identical (d={d}, rope={rope})"
                );
            }
        }
    }
}

#[test]
fn every_code_path_matches_the_portable_one() {
    if !crate::common::own_process(
        "attention_isa::every_code_path_matches_the_portable_one",
        &[],
    ) {
        return;
    }
    run_all::<f32>(43, 1e-5);
    run_all::<f64>(44, 1e-12);
}

/// bf16 inputs on the AVX-512 BF16 path (all five block products by
/// `vdpbf16ps` on bf16 pairs, P and dS rounded to bf16 before `P V`,
/// `Pᵀ dO`, `dSᵀ Q`, `dS K`) against the same inputs on the AVX-512 path
/// (the f32 computation on the widened inputs, rounded once), relative
/// Frobenius. The rounding of P and dS is the GPU kernels' (and torch's
/// bf16 CPU flash attention's): measured 2.1e-3 to 2.2e-3 on O and 2.5e-3
/// to 2.9e-3 on the gradients without rotary, 3.3e-3 to 3.5e-3 and 3.6e-3
/// to 4.3e-3 with it (rotated q and k rounded to bf16 before the products,
/// as the GPU kernels round them), the size of the outputs' own bf16
/// rounding (2⁻⁹ ≈ 2e-3 at most per value); the LSE, which never meets a
/// rounded P, 1.7e-8 (1.6e-4 with rotary). Bounds: the 16-bit kernels'
/// table, 1e-2 on O, 2e-2 on the gradients, 1e-3 on the LSE (1e-6
/// without rotary; a wrong pair index or a skipped run of keys gives errors
/// of order 1). The pair path gives the same bits on 1, 2 and 3 threads.
/// Negative control: the paths differ (the pair products did run). Skipped, saying so, on CPUs without AVX-512 BF16.
#[test]
fn bf16_pair_products_match_the_f32_path() {
    if !crate::common::own_process("attention_isa::bf16_pair_products_match_the_f32_path", &[]) {
        return;
    }
    if best_isa() != Isa::Avx512Bf16 {
        eprintln!("skipped: this CPU has no AVX-512 BF16");
        return;
    }
    use half::bf16;
    use treeattn::backend::cpu::Cpu;
    use treeattn::backend::{AttnArgs, HostAttention};
    let mut rng = Rng::new(45);
    for (d, rope, group) in [
        (64, false, 2),
        (40, true, 1),
        (128, false, 4),
        (64, true, 2),
    ] {
        let (b, shape, params) = case(&mut rng, d, rope, group);
        let mask = b.mask().unwrap();
        let mut data = |n: usize| -> Vec<bf16> {
            (0..n)
                .map(|_| bf16::from_f64(2.0 * rng.signed_unit() as f64))
                .collect()
        };
        let (q, k, v, d_o) = (
            data(shape.q_len()),
            data(shape.kv_len()),
            data(shape.kv_len()),
            data(shape.q_len()),
        );
        let run = |path: Isa, threads: usize| {
            assert!(force_isa(path));
            let cpu = Cpu::with_threads(threads);
            let args = AttnArgs::new(&q[..], &k[..], &v[..], shape, mask, params).unwrap();
            let f = cpu.forward_owned(&args).unwrap();
            let g = cpu.backward_owned(&args, f.saved(), &d_o).unwrap();
            let wide = |x: &[bf16]| x.iter().map(|v| v.to_f32()).collect::<Vec<f32>>();
            [wide(&f.o), f.lse, wide(&g.dq), wide(&g.dk), wide(&g.dv)]
        };
        let pairs = run(Isa::Avx512Bf16, 2);
        let exact = run(Isa::Avx512, 2);
        let names = ["o", "lse", "dq", "dk", "dv"];
        // As on the f32 path, the thread count does not change a bit.
        let bits = |x: &[Vec<f32>; 5]| {
            x.each_ref()
                .map(|v| v.iter().map(|y| y.to_bits()).collect::<Vec<_>>())
        };
        for threads in [1, 3] {
            assert!(
                bits(&run(Isa::Avx512Bf16, threads)) == bits(&pairs),
                "the pair path on {threads} threads differs from 2 (d={d}, rope={rope})"
            );
        }
        let lse_tol = if rope { 1e-3 } else { 1e-6 };
        let tol = [1e-2, lse_tol, 2e-2, 2e-2, 2e-2];
        let mut differs = false;
        for i in 0..5 {
            let e = rel(&pairs[i], &exact[i]);
            eprintln!("d={d} rope={rope} group={group} {}: {e:.2e}", names[i]);
            assert!(e < tol[i], "{}: {e:e} (d={d}, rope={rope})", names[i]);
            differs |= pairs[i] != exact[i];
        }
        assert!(
            differs,
            "negative control: the pair path gave the f32 path's bits (d={d})"
        );
    }
}
