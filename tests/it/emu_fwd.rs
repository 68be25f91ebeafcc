//! The tree-attention forward kernel (kernels/tree_attn_fwd.cu) run under the
//! SIMT emulator, against the CPU backend on the same 16-bit-rounded inputs.
//!
//! The reference is the CPU backend (`backend::cpu::attention_forward`, f64
//! math), itself proven against a dense f64 loop in tests/it/attention_cpu.rs.
//!
//! Packs are exact trie packs of random generated rollouts with edits
//! (compaction, stack pop, fold, memex, GRPO forests), and random forests of random trees laid out in pre-order — a node is
//! a chain of tokens, `kv_end` of each token is the end of its node's subtree
//! range (DESIGN §4) — with branching (edits), several trees per pack, and
//! padding keys (`kv_end[k] == k`) whose rows see nothing. Lengths are not
//! multiples of the 64-key or 128-query tile. Inputs are fresh every run; the seed is in
//! every failure message and `TREEATTN_SEED` replays it.
//!
//! Tolerances (`backend::tolerance`, shared with the GPU check): relative Frobenius error of O at most 1e-2
//! for bf16 and 2e-3 for f16 — the kernel rounds P to the input type before
//! P·V and rounds O on output, each a relative error of up to 2^-9 (bf16) or
//! 2^-12 (f16) per element, so the Frobenius error sits near those values;
//! the bounds leave a factor of ~5 — and LSE within 1e-3 absolute (LSE is
//! computed in f32 from f32 scores: errors ~1e-6).

use crate::common;
use crate::common::calls;

use half::{bf16, f16};
use treeattn::backend::emu::{self, EmuOptions, KernelElem};
use treeattn::backend::{tolerance, AttnParams, AttnShape, Rope};
use treeattn::mask::PackMask;
use treeattn::tree::Tree;
use treeattn::Error;
use treeattn_lab::gen::{self, Rng, Shape};

/// The reference: the CPU backend (`backend::cpu::attention_forward`) in f64
/// on the same 16-bit-rounded inputs. Returns (O [tokens, hq, d], LSE [hq, tokens]).
fn reference(
    q: &[f64],
    k: &[f64],
    v: &[f64],
    shape: AttnShape,
    mask: PackMask<'_>,
    params: &AttnParams,
) -> (Vec<f64>, Vec<f64>) {
    let out = calls::cpu_forward::<f64>(q, k, v, shape, mask, params)
        .expect("the CPU reference accepts every case");
    (out.o, out.lse)
}

struct Case {
    shape: AttnShape,
    kv_end: Vec<u32>,
    pos: Vec<u32>,
}

/// Relative Frobenius error of O and max |ΔLSE| over rows with a visible key;
/// asserts every output element was written (no poison left) and that rows
/// without keys give O = 0, LSE = −inf. `mask_kv_end` is what the kernel runs
/// with (the case's own kv_end, or a wrong one for the negative control).
fn run_case<T: KernelElem>(rng: &mut Rng, seed: u64, c: &Case, mask_kv_end: &[u32]) -> (f64, f64) {
    let s = c.shape;
    // Amplitude 2: scores reach a few units, so the softmax is far from flat.
    let (q, qf) = common::random_tensor::<T, _>(rng, s.q_len(), 2.0);
    let (k, kf) = common::random_tensor::<T, _>(rng, s.kv_len(), 2.0);
    let (v, vf) = common::random_tensor::<T, _>(rng, s.kv_len(), 1.0);
    let params = AttnParams::new(s.head_dim);
    let mask = PackMask::new(mask_kv_end, &c.pos).unwrap();
    // Poison differs from run to run: a NaN or an f32 pattern never produced.
    let mut o = vec![T::from_f32(f32::NAN); s.q_len()];
    let mut lse =
        vec![f32::from_bits(0x7fc0_0000 | (rng.next_u64() as u32 & 0xffff)); s.q_heads * s.tokens];
    calls::emu_forward_into(&q, &k, &v, s, mask, &params, &mut o, &mut lse)
        .unwrap_or_else(|e| panic!("seed {seed}: {s:?}: {e}"));
    let true_mask = PackMask::new(&c.kv_end, &c.pos).unwrap();
    let (ro, rl) = reference(&qf, &kf, &vf, s, true_mask, &params);
    let (mut num, mut den, mut lse_err) = (0.0f64, 0.0f64, 0.0f64);
    for (i, (x, r)) in o.iter().zip(&ro).enumerate() {
        let x = x.to_f32() as f64;
        assert!(
            x.is_finite(),
            "seed {seed}: {s:?}: O[{i}] = {x} (not written?)"
        );
        num += (x - r) * (x - r);
        den += r * r;
    }
    for (i, (&x, &r)) in lse.iter().zip(&rl).enumerate() {
        assert!(!x.is_nan(), "seed {seed}: {s:?}: LSE[{i}] not written");
        if r == f64::NEG_INFINITY && mask_kv_end == c.kv_end.as_slice() {
            assert_eq!(
                x,
                f32::NEG_INFINITY,
                "seed {seed}: {s:?}: row {} of head {} sees no key",
                i % s.tokens,
                i / s.tokens
            );
            let (row, h) = (i % s.tokens, i / s.tokens);
            let orow = &o[(row * s.q_heads + h) * s.head_dim..][..s.head_dim];
            assert!(
                orow.iter().all(|e| e.to_f32() == 0.0),
                "seed {seed}: O of masked row {row} head {h} not 0"
            );
        } else if r.is_finite() {
            lse_err = lse_err.max((x as f64 - r).abs());
        }
    }
    ((num / den.max(f64::MIN_POSITIVE)).sqrt(), lse_err)
}

/// Runs a case under emulator options `opts` (a schedule and a cp.async
/// landing time) and holds it to the tolerances.
fn check<T: KernelElem>(rng: &mut Rng, seed: u64, c: &Case, o_tol: f64, opts: EmuOptions) {
    let (o_err, lse_err) = calls::with_options(opts, || run_case::<T>(rng, seed, c, &c.kv_end));
    let what = format!(
        "seed {seed}: {:?} {:?} (tokens {}) {opts:?}",
        T::DTYPE,
        c.shape,
        c.kv_end.len()
    );
    assert!(
        o_err <= o_tol,
        "{what}: relative Frobenius error of O {o_err:.3e} > {o_tol:.0e}"
    );
    let lse_tol = tolerance::attention(T::DTYPE).lse_abs;
    assert!(
        lse_err <= lse_tol,
        "{what}: LSE error {lse_err:.3e} > {lse_tol:.0e}"
    );
}

/// O tolerance per element type (the crate's table, `backend::tolerance`).
fn o_tol<T: KernelElem>() -> f64 {
    tolerance::attention(T::DTYPE).o_rel
}

fn random_case(rng: &mut Rng, head_dim: usize) -> Case {
    // Keep packs under 600 tokens so the f64 reference stays quick.
    let p = loop {
        let trees = rng.range(1, 4);
        let padding = rng.range(0, 9);
        let p = gen::random_forest(rng, trees, 24, 3, padding);
        if p.kv_end.len() <= 600 {
            break p;
        }
    };
    let kv_heads = [1, 2][rng.range(0, 1)];
    let q_heads = kv_heads * [1, 2, 3][rng.range(0, 2)];
    Case {
        shape: AttnShape {
            tokens: p.kv_end.len(),
            q_heads,
            kv_heads,
            head_dim,
            v_head_dim: head_dim,
        },
        kv_end: p.kv_end,
        pos: p.position_ids,
    }
}

fn random_packs<T: KernelElem>(head_dim: usize, cases: usize) {
    let (mut rng, seed) = common::seeded_rng();
    // Each case under the next schedule / cp.async landing combination.
    for i in 0..cases {
        let c = random_case(&mut rng, head_dim);
        check::<T>(&mut rng, seed, &c, o_tol::<T>(), EmuOptions::all()[i % 6]);
    }
}

/// Exact trie packs built from generated rollouts with edits: every shape of
/// the generators, one or two rollouts per pack (a forest), trimmed to whole
/// rollouts under 700 tokens so the suite stays quick.
fn rollout_packs<T: KernelElem>(head_dim: usize) {
    let (mut rng, seed) = common::seeded_rng();
    let mut checked = 0;
    for (i, shape) in Shape::ALL.iter().enumerate() {
        let mut rollouts =
            gen::generate(*shape, rng.next_u64(), false).expect("generators give valid rollouts");
        rollouts.truncate(rng.range(1, 2));
        let pack = Tree::build(&rollouts, true)
            .expect("valid rollouts build a tree")
            .trie_pack();
        if pack.len() > 700 {
            continue;
        }
        let kv_heads = [1, 2][rng.range(0, 1)];
        let c = Case {
            shape: AttnShape {
                tokens: pack.len(),
                q_heads: kv_heads * 2,
                kv_heads,
                head_dim,
                v_head_dim: head_dim,
            },
            kv_end: pack.kv_end.clone(),
            pos: pack.position_ids.clone(),
        };
        check::<T>(&mut rng, seed, &c, o_tol::<T>(), EmuOptions::all()[i % 6]);
        checked += 1;
    }
    // Guard: the size cap must not silently skip most shapes.
    assert!(
        checked >= 5,
        "seed {seed}: only {checked} generated packs were small enough"
    );
}

#[test]
fn bf16_packs_of_generated_rollouts() {
    rollout_packs::<bf16>(64);
    rollout_packs::<bf16>(128);
}

#[test]
fn f16_packs_of_generated_rollouts() {
    rollout_packs::<f16>(64);
}

#[test]
fn bf16_d64_random_tree_packs() {
    random_packs::<bf16>(64, 6);
}
#[test]
fn bf16_d128_random_tree_packs() {
    random_packs::<bf16>(128, 6);
}
#[test]
fn f16_d64_random_tree_packs() {
    random_packs::<f16>(64, 6);
}
#[test]
fn f16_d128_random_tree_packs() {
    random_packs::<f16>(128, 6);
}

/// Long causal chains exercise the full-tile path (no element mask) below the
/// diagonal; many tiny trees exercise skipped tiles; short packs a single
/// partial tile; 64 (half a query tile) and 128 (one query tile, two key
/// tiles) exact multiples of the tiles.
#[test]
fn tile_classes_and_edge_lengths() {
    let (mut rng, seed) = common::seeded_rng();
    for (i, tokens) in [1usize, 17, 64, 128, 200, 257].into_iter().enumerate() {
        let kv_end = vec![tokens as u32; tokens];
        let pos = (0..tokens as u32).collect();
        let c = Case {
            shape: AttnShape {
                tokens,
                q_heads: 2,
                kv_heads: 1,
                head_dim: 64,
                v_head_dim: 64,
            },
            kv_end,
            pos,
        };
        check::<bf16>(&mut rng, seed, &c, o_tol::<bf16>(), EmuOptions::all()[i]);
    }
    // Varlen-style: many independent short sequences, so most key tiles of a
    // query tile are skipped; plus padding at the end.
    let mut kv_end = Vec::new();
    while kv_end.len() < 300 {
        let start = kv_end.len();
        let len = rng.range(1, 40);
        kv_end.extend(std::iter::repeat_n((start + len) as u32, len));
    }
    let n = kv_end.len();
    kv_end.extend((n..n + 5).map(|k| k as u32));
    let tokens = kv_end.len();
    let c = Case {
        shape: AttnShape {
            tokens,
            q_heads: 4,
            kv_heads: 2,
            head_dim: 128,
            v_head_dim: 128,
        },
        kv_end,
        pos: vec![0; tokens],
    };
    for opts in EmuOptions::all() {
        check::<f16>(&mut rng, seed, &c, o_tol::<f16>(), opts);
    }
}

/// A pack that is padding only: every row is fully masked.
#[test]
fn all_padding_gives_zero_and_minus_infinity() {
    let (mut rng, seed) = common::seeded_rng();
    let kv_end: Vec<u32> = (0..70).collect();
    let c = Case {
        shape: AttnShape {
            tokens: 70,
            q_heads: 2,
            kv_heads: 2,
            head_dim: 64,
            v_head_dim: 64,
        },
        kv_end,
        pos: vec![0; 70],
    };
    let (o_err, lse_err) = run_case::<bf16>(&mut rng, seed, &c, &c.kv_end);
    assert_eq!((o_err, lse_err), (0.0, 0.0));
}

/// Negative control: on trees with edits, the same kernel run with a plain
/// causal mask (the tree structure ignored) is far off the tree reference —
/// so the tolerances above do detect a wrong mask.
#[test]
fn causal_mask_on_a_tree_fails_the_tolerance() {
    let (mut rng, seed) = common::seeded_rng();
    for _ in 0..3 {
        let p = gen::random_forest(&mut rng, 2, 24, 3, 0);
        let tokens = p.kv_end.len();
        let c = Case {
            shape: AttnShape {
                tokens,
                q_heads: 2,
                kv_heads: 1,
                head_dim: 64,
                v_head_dim: 64,
            },
            kv_end: p.kv_end,
            pos: p.position_ids,
        };
        let causal = vec![tokens as u32; tokens];
        let (o_err, _) = run_case::<f16>(&mut rng, seed, &c, &causal);
        assert!(
            o_err > 20.0 * o_tol::<f16>(),
            "seed {seed}: causal mask on a tree only {o_err:.3e} off"
        );
    }
}

#[test]
fn empty_pack_is_a_no_op() {
    let out = calls::emu_forward::<bf16>(
        &[],
        &[],
        &[],
        AttnShape {
            tokens: 0,
            q_heads: 2,
            kv_heads: 1,
            head_dim: 128,
            v_head_dim: 128,
        },
        PackMask::new(&[], &[]).unwrap(),
        &AttnParams::new(128),
    )
    .unwrap();
    assert!(out.o.is_empty() && out.lse.is_empty());
}

#[test]
fn unsupported_and_bad_inputs_are_errors() {
    let kv_end = [3u32, 3, 3];
    let pos = [0u32, 1, 2];
    let mask = PackMask::new(&kv_end, &pos).unwrap();
    let shape = AttnShape {
        tokens: 3,
        q_heads: 1,
        kv_heads: 1,
        head_dim: 64,
        v_head_dim: 64,
    };
    let x = vec![bf16::from_f32(0.5); 3 * 64];
    let p = AttnParams::new(64);
    // Head dim 32: no kernel (the lengths fit, so the backend sees it).
    let e = calls::emu_forward(
        &x[..96],
        &x[..96],
        &x[..96],
        AttnShape {
            head_dim: 32,
            v_head_dim: 32,
            ..shape
        },
        mask,
        &AttnParams::new(32),
    )
    .unwrap_err();
    assert!(matches!(e, Error::Unsupported(_)), "{e}");
    // Rotary over more lanes than the head has.
    let rope = AttnParams {
        rope: Some(Rope {
            base: 10_000.0,
            dims: 66,
        }),
        ..p
    };
    assert!(matches!(
        calls::emu_forward(&x, &x, &x, shape, mask, &rope),
        Err(Error::Unsupported(_))
    ));
    assert!(matches!(
        calls::emu_forward(&x[1..], &x, &x, shape, mask, &p),
        Err(Error::Shape(_))
    ));
    // A tensor that does not start on a 16-byte boundary.
    let wide = vec![bf16::from_f32(0.5); 3 * 64 + 2];
    let off = if (wide.as_ptr() as usize + 2).is_multiple_of(16) {
        2
    } else {
        1
    };
    let e = calls::emu_forward(&wide[off..off + 3 * 64], &x, &x, shape, mask, &p).unwrap_err();
    assert!(e.to_string().contains("16-byte aligned"), "{e}");
    let mut bad = x.clone();
    bad[70] = bf16::NAN;
    let checked = AttnParams {
        check_finite: true,
        ..p
    };
    let e = calls::emu_forward(&x, &x, &bad, shape, mask, &checked).unwrap_err();
    assert_eq!(
        e,
        Error::NonFinite {
            what: "v".into(),
            index: 70
        }
    );
}

#[test]
fn kv_tile_bounds_kernel_matches_a_scan() {
    let (mut rng, seed) = common::seeded_rng();
    for _ in 0..4 {
        let (trees, padding) = (rng.range(1, 5), rng.range(0, 70));
        let p = gen::random_forest(&mut rng, trees, 30, 3, padding);
        let tile = [16usize, 64, 100][rng.range(0, 2)];
        let (lo, hi) = calls::emu().kv_tile_bounds(&p.kv_end, tile).unwrap();
        let want: Vec<(u32, u32)> = p
            .kv_end
            .chunks(tile)
            .map(|c| (*c.iter().min().unwrap(), *c.iter().max().unwrap()))
            .collect();
        let got: Vec<(u32, u32)> = lo.into_iter().zip(hi).collect();
        assert_eq!(got, want, "seed {seed}: tile {tile}");
    }
}

#[test]
fn rust_launch_plan_matches_the_kernel_traits() {
    for d in [64usize, 128] {
        let t = treeattn::backend::launch::FwdTraits::for_head_dim(d).unwrap();
        assert_eq!(
            emu::kernel_traits(d as u32),
            Some((
                t.block_m,
                t.block_n,
                t.threads,
                t.smem_bytes(),
                t.row_stride
            ))
        );
    }
    assert_eq!(emu::kernel_traits(96), None);
}

/// Skipped key tiles are never loaded: the bytes the kernel moves with
/// cp.async are exactly the Q tiles plus K and V for the key tiles that the
/// tile rule does not skip (checked on packs where most tiles are skipped,
/// among them a GRPO-like fan whose last query tiles skip runs of more than
/// 32 key tiles in a row: the tile walk's ballot covers 32 tiles per step).
#[test]
fn skipped_key_tiles_are_never_loaded() {
    use treeattn::backend::launch::{tile_class, FwdTraits, TileClass};
    #[derive(Clone, Copy, PartialEq)]
    enum Pack {
        Forest,
        Aligned,
        Fan,
    }
    let (mut rng, seed) = common::seeded_rng();
    for (head_dim, kind) in [
        (64usize, Pack::Forest),
        (128, Pack::Forest),
        (64, Pack::Aligned),
        (64, Pack::Fan),
    ] {
        let t = FwdTraits::for_head_dim(head_dim).unwrap();
        let (bm, bn) = (t.block_m as usize, t.block_n as usize);
        let p = match kind {
            Pack::Aligned => {
                // Sequences of exactly one key tile: for every other key tile
                // (block_m = 2 · block_n) the max kv_end equals the next query
                // tile's start, the boundary of the skip rule.
                let n = 5 + rng.range(0, 4);
                let kv_end: Vec<u32> = (0..n * bn).map(|k| ((k / bn + 1) * bn) as u32).collect();
                gen::MaskBuilder {
                    position_ids: (0..n * bn).map(|k| (k % bn) as u32).collect(),
                    kv_end,
                }
            }
            Pack::Forest => loop {
                // 300 to 900 tokens: at least 3 query tiles, most pairs skipped.
                let p = gen::random_forest(&mut rng, 6, 30, 2, 40);
                if (300..=900).contains(&p.kv_end.len()) {
                    break p;
                }
            },
            Pack::Fan => {
                // A prompt seen by 30 branches, each seen only by itself, and
                // padding: a query tile of a late branch sees the prompt's
                // tiles, then skips ~45 key tiles of the other branches.
                let mut b = gen::MaskBuilder::new();
                b.push_fan(40 + rng.range(0, 60), 30, 80 + rng.range(0, 40));
                b.push_padding(1 + rng.range(0, 20));
                b
            }
        };
        let l = p.kv_end.len();
        let c = Case {
            shape: AttnShape {
                tokens: l,
                q_heads: 3,
                kv_heads: 1,
                head_dim,
                v_head_dim: head_dim,
            },
            kv_end: p.kv_end,
            pos: p.position_ids,
        };
        // The outputs too: a walk that stops early loads less and is wrong.
        let opts = EmuOptions::all()[rng.range(0, 5)];
        check::<bf16>(&mut rng, seed, &c, o_tol::<bf16>(), opts);
        let got = emu::last_forward_stats().unwrap().cp_async_bytes;
        let (mut loaded_tiles, mut skipped) = (0u64, 0u64);
        for q0 in (0..l).step_by(bm) {
            for (ti, keys) in c.kv_end.chunks(bn).enumerate() {
                let (lo, hi) = (*keys.iter().min().unwrap(), *keys.iter().max().unwrap());
                match tile_class(&t, l, q0, ti * bn, lo, hi) {
                    TileClass::Skip => skipped += 1,
                    _ => loaded_tiles += 1,
                }
            }
        }
        let tile_bytes = (bn * head_dim * 2) as u64;
        // Per loaded key tile: K, V, and its kv_end and bound (4-byte
        // cp.async, issue 26), and the walk's look-ahead window (the next 32
        // tiles' max and min of kv_end, 4-byte cp.async, zero-filled ones
        // counted too; issue 39).
        let bounds_bytes = (bn * 4 + 4 + 64 * 4) as u64;
        let want = 3
            * (l.div_ceil(bm) as u64 * (bm * head_dim * 2) as u64
                + (2 * tile_bytes + bounds_bytes) * loaded_tiles);
        assert_eq!(
            got, want,
            "seed {seed}: d {head_dim}, L {l}, {skipped} tiles skipped"
        );
        assert!(
            skipped > loaded_tiles / 2,
            "seed {seed}: the pack should skip many tiles"
        );
        if kind == Pack::Fan {
            // The longest run of skipped key tiles of one query tile.
            let longest = (0..l)
                .step_by(bm)
                .map(|q0| {
                    let mut run = (0usize, 0usize);
                    for (ti, keys) in c.kv_end.chunks(bn).enumerate() {
                        let (lo, hi) = (*keys.iter().min().unwrap(), *keys.iter().max().unwrap());
                        run.0 = match tile_class(&t, l, q0, ti * bn, lo, hi) {
                            TileClass::Skip if ti * bn < q0 + bm => run.0 + 1,
                            _ => 0,
                        };
                        run.1 = run.1.max(run.0);
                    }
                    run.1
                })
                .max()
                .unwrap();
            assert!(longest > 32, "seed {seed}: longest skipped run {longest}");
        }
    }
}

/// A view that does not start on a 16-byte boundary (q, k, v or o, rotary
/// on or off) is an `Err(Shape)` naming that tensor, raised before anything
/// runs — the one check the CUDA forward and backward also run before any
/// launch (`launch::check_vector_alignment`). Negative control: the same
/// data placed on a boundary runs.
#[test]
fn misaligned_views_are_errors_naming_the_tensor() {
    let kv_end = [3u32, 3, 3];
    let pos = [0u32, 1, 2];
    let mask = PackMask::new(&kv_end, &pos).unwrap();
    let shape = AttnShape {
        tokens: 3,
        q_heads: 1,
        kv_heads: 1,
        head_dim: 64,
        v_head_dim: 64,
    };
    let x = vec![bf16::from_f32(0.25); 3 * 64];
    for rope in [
        None,
        Some(Rope {
            base: 10_000.0,
            dims: 64,
        }),
    ] {
        let p = AttnParams {
            rope,
            ..AttnParams::new(64)
        };
        for bad in ["", "q", "k", "v", "o"] {
            let place = |name: &str| common::placed(&x, name != bad);
            let ((qb, qo), (kb, ko), (vb, vo), (mut ob, oo)) =
                (place("q"), place("k"), place("v"), place("o"));
            let mut lse = vec![0f32; 3];
            let n = x.len();
            let r = calls::emu_forward_into(
                &qb[qo..qo + n],
                &kb[ko..ko + n],
                &vb[vo..vo + n],
                shape,
                mask,
                &p,
                &mut ob[oo..oo + n],
                &mut lse,
            );
            match (bad, r) {
                ("", r) => r.unwrap(),
                (name, Err(Error::Shape(m))) => assert!(
                    m.starts_with(&format!("{name}: address"))
                        && m.contains("is not 16-byte aligned"),
                    "{name}: {m}"
                ),
                (name, r) => panic!("{name} misaligned, rope {rope:?}: {r:?}"),
            }
        }
    }
}
