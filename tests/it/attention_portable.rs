//! The CPU backend's portable code path (what runs on CPUs without AVX2 and
//! FMA, e.g. aarch64), forced on with `TREEATTN_PORTABLE=1` on a machine
//! that has them: f32 forward and backward against the dense-mask
//! attention of `bench` (its own `L × L` mask, no tiles or blocks) and
//! against the backend's f64 results. The test runs in a process of its own
//! ([`own_process`](crate::common::own_process)), so the switch, read once
//! per process, is set before any attention call and never seen by the
//! other tests.

use crate::common::calls;

use treeattn::backend::cpu::{gather_counts, tile_counts, uses_avx2_fma, CpuFloat};
use treeattn::backend::{AttnParams, AttnShape, Rope};
use treeattn_lab::bench::{dense_attention_backward, dense_attention_forward};
use treeattn_lab::gen::{MaskBuilder, Rng};

/// Relative Frobenius error of `got` against `want`.
fn rel(got: &[f32], want: &[f64]) -> f64 {
    let (mut num, mut den) = (0.0, 0.0);
    for (&g, &w) in got.iter().zip(want) {
        num += (g as f64 - w).powi(2);
        den += w * w;
    }
    (num / den.max(1e-300)).sqrt()
}

fn data<T: CpuFloat>(rng: &mut Rng, n: usize) -> (Vec<T>, Vec<f64>) {
    let x: Vec<f32> = (0..n).map(|_| rng.signed_unit()).collect();
    (
        x.iter().map(|&v| T::from_f64(v as f64)).collect(),
        x.iter().map(|&v| v as f64).collect(),
    )
}

#[test]
fn portable_path_matches_the_dense_reference_and_the_f64_backend() {
    if !crate::common::own_process(
        "attention_portable::portable_path_matches_the_dense_reference_and_the_f64_backend",
        &[("TREEATTN_PORTABLE", "1")],
    ) {
        return;
    }
    assert!(
        !uses_avx2_fma(),
        "TREEATTN_PORTABLE=1 must select the portable code"
    );
    let mut rng = Rng::new(41);
    let mut cases = 0;
    for (d, rope) in [(64, false), (40, true), (16, false)] {
        // A deep random tree, a GRPO-like fan, a fan of long branches and
        // padding: skipped, full and partial tiles, masked and unmasked
        // blocks, gathered keys, padding rows.
        let mut b = MaskBuilder::new();
        b.push_tree(&mut rng, 0, 24, 4, true);
        b.push_fan(70, 3, 30);
        b.push_fan(90, 4, 170);
        b.push_padding(5);
        let l = b.len();
        let mask = b.mask().unwrap();
        let t = tile_counts(mask);
        cases += (t.partial > 0 && gather_counts(mask).tiles > 0) as usize;
        let shape = AttnShape {
            tokens: l,
            q_heads: 4,
            kv_heads: 2,
            head_dim: d,
            v_head_dim: d,
        };
        let mut params = AttnParams::new(d);
        params.rope = rope.then_some(Rope {
            base: 10_000.0,
            dims: d,
        });
        let (q, q64) = data::<f32>(&mut rng, shape.q_len());
        let (k, k64) = data::<f32>(&mut rng, shape.kv_len());
        let (v, v64) = data::<f32>(&mut rng, shape.kv_len());
        let (d_o, do64) = data::<f32>(&mut rng, shape.q_len());
        let f = calls::cpu_forward(&q, &k, &v, shape, mask, &params).unwrap();
        let f64_ = calls::cpu_forward(&q64, &k64, &v64, shape, mask, &params).unwrap();
        let g = calls::cpu_backward(&q, &k, &v, &f.o, &f.lse, &d_o, shape, mask, &params).unwrap();
        let g64 = calls::cpu_backward(
            &q64, &k64, &v64, &f64_.o, &f64_.lse, &do64, shape, mask, &params,
        )
        .unwrap();
        // The bounds of attention_cpu's f32 proptests (f32 accumulation
        // over up to ~200 keys and 64 lanes; a masking or indexing mistake
        // gives O(1)).
        // LSE: finite entries only (rows without a visible key are −inf).
        let (lse, lse64): (Vec<f32>, Vec<f64>) = f
            .lse
            .iter()
            .zip(&f64_.lse)
            .filter(|(_, w)| w.is_finite())
            .map(|(&g, &w)| (g, w))
            .unzip();
        let errs = [
            ("o", rel(&f.o, &f64_.o), 1e-5),
            ("lse", rel(&lse, &lse64), 1e-5),
            ("dq", rel(&g.dq, &g64.dq), 2e-5),
            ("dk", rel(&g.dk, &g64.dk), 2e-5),
            ("dv", rel(&g.dv, &g64.dv), 2e-5),
        ];
        for (name, e, bound) in errs {
            assert!(
                e < bound,
                "{name}: {e:e} (l={l}, d={d}, rope={rope}, {t:?})"
            );
        }
        if rope {
            continue;
        }
        // The dense-mask reference: the same f32 inputs, masking from the
        // L × L mask. Up to f32 summation order (bounds as above).
        let dense = dense_attention_forward(&q, &k, &v, shape, mask, &params).unwrap();
        let dg =
            dense_attention_backward(&q, &k, &v, &dense.o, &dense.lse, &d_o, shape, mask, &params)
                .unwrap();
        let wide = |x: &[f32]| x.iter().map(|&v| v as f64).collect::<Vec<f64>>();
        let errs = [
            ("o", rel(&f.o, &wide(&dense.o)), 1e-5),
            ("dq", rel(&g.dq, &wide(&dg.dq)), 2e-5),
            ("dk", rel(&g.dk, &wide(&dg.dk)), 2e-5),
            ("dv", rel(&g.dv, &wide(&dg.dv)), 2e-5),
        ];
        for (name, e, bound) in errs {
            assert!(e < bound, "dense {name}: {e:e} (l={l}, d={d}, {t:?})");
        }
    }
    assert!(
        cases == 3,
        "the trees must have partial tiles and gathered keys"
    );
}
