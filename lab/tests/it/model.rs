//! The tiny transformer's hand-written backward against central finite
//! differences, and the DESIGN §4 worked example run as one trie pack and as
//! its two LogitTree branches.

use treeattn::backend::Rope;
use treeattn::mask::PackMask;
use treeattn_lab::model::{Model, ModelConfig, Params, Target};

fn config(rope: bool, tied: bool, kv_heads: usize) -> ModelConfig {
    ModelConfig {
        vocab: 60,
        d_model: 16,
        layers: 2,
        q_heads: 4,
        kv_heads,
        head_dim: 4,
        ffn_dim: 24,
        rope: rope.then_some(Rope {
            base: 10_000.0,
            dims: 4,
        }),
        tied_embeddings: tied,
        rms_eps: 1e-6,
    }
}

/// DESIGN §4 worked example: the trie pack of four calls with one junction.
const TRIE_TOKENS: [u32; 16] = [10, 11, 20, 30, 31, 40, 32, 1, 50, 51, 3, 50, 51, 40, 32, 33];
const TRIE_POS: [u32; 16] = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 2, 3, 4, 5, 6, 7];
const TRIE_KV_END: [u32; 16] = [
    16, 16, 10, 10, 10, 10, 10, 10, 10, 10, 16, 16, 16, 16, 16, 16,
];
/// (row, label) of the six targets, in canonical (call, offset) order.
const TRIE_TARGETS: [(u32, u32); 6] = [(2, 30), (3, 31), (5, 32), (7, 50), (8, 51), (14, 33)];

fn targets(pairs: &[(u32, u32)], weights: &[f64]) -> Vec<Target> {
    pairs
        .iter()
        .zip(weights)
        .map(|(&(row, label), &weight)| Target { row, label, weight })
        .collect()
}

/// `J = Σ_e w_e · log p_e`, accumulated in f64.
fn objective(model: &Model<f64>, tokens: &[u32], mask: PackMask<'_>, t: &[Target]) -> f64 {
    let fwd = model.forward(tokens, mask, t).unwrap();
    fwd.logprobs
        .iter()
        .zip(t)
        .map(|(lp, t)| t.weight * lp)
        .sum()
}

/// Central differences on a few entries of every tensor. Targets include two
/// on the same row (one parent row predicting two children), a zero and a
/// negative weight, so that each term of `∂J/∂logits` is exercised.
fn check_finite_differences(cfg: ModelConfig, seed: u64) {
    let model = Model::<f64>::new(cfg.clone(), seed).unwrap();
    let mask = PackMask::new(&TRIE_KV_END, &TRIE_POS).unwrap();
    let mut pairs = TRIE_TARGETS.to_vec();
    pairs.push((14, 7)); // row 14 scores two labels
    pairs.push((0, 11));
    let t = targets(&pairs, &[1.0, 0.5, 2.0, 1.0, -0.75, 1.0, 0.3, 0.0]);
    let grads = model
        .backward(&model.forward(&TRIE_TOKENS, mask, &t).unwrap())
        .unwrap();

    // h = 1e-5: truncation error ~h²·|J'''| ~ 1e-9, rounding ~ε·|J|/h ~ 1e-10
    // (|J| ~ 30); gradients are O(0.01..10). A transposed index or a missing
    // term moves a gradient by far more than the 1e-6 allowed.
    let h = 1e-5;
    let mut probe = Model::<f64>::new(cfg, seed).unwrap();
    let names: Vec<(String, usize)> = grads
        .tensors()
        .iter()
        .map(|(n, t)| (n.clone(), t.len()))
        .collect();
    let mut checked = 0;
    for (ti, (name, len)) in names.iter().enumerate() {
        let grad = grads.tensors()[ti].1.to_vec();
        // A few indices spread over the tensor, plus the largest gradient
        // (for `embed`, the rows of tokens that occur; most rows are zero).
        let mut idx: Vec<usize> = (0..4).map(|j| (j * 7919 + ti * 31) % len).collect();
        let largest = (0..*len)
            .max_by(|&a, &b| grad[a].abs().total_cmp(&grad[b].abs()))
            .unwrap();
        idx.push(largest);
        for i in idx {
            let orig = probe.params().tensors()[ti].1[i];
            probe.params_mut().tensors_mut()[ti].1[i] = orig + h;
            let up = objective(&probe, &TRIE_TOKENS, mask, &t);
            probe.params_mut().tensors_mut()[ti].1[i] = orig - h;
            let down = objective(&probe, &TRIE_TOKENS, mask, &t);
            probe.params_mut().tensors_mut()[ti].1[i] = orig;
            let fd = (up - down) / (2.0 * h);
            let g = grad[i];
            assert!(
                (fd - g).abs() <= 1e-6 * (1.0 + g.abs()),
                "{name}[{i}]: backward {g:e}, finite difference {fd:e}"
            );
            checked += 1;
        }
        // The largest gradient of every tensor is nonzero: each parameter kind
        // really influences J (a zero here would make the check vacuous).
        assert!(grad[largest].abs() > 1e-6, "{name}: all gradients vanish");
    }
    assert_eq!(checked, names.len() * 5);
}

#[test]
fn backward_matches_finite_differences_gqa_rope_untied() {
    check_finite_differences(config(true, false, 2), 11);
}

#[test]
fn backward_matches_finite_differences_mha_no_rope_tied() {
    check_finite_differences(config(false, true, 4), 12);
}

#[test]
fn backward_matches_finite_differences_mqa_rope_tied() {
    check_finite_differences(config(true, true, 1), 13);
}

fn close(a: f64, b: f64, scale: f64) -> bool {
    // Same sums in another order (another tiling, another summation of branch
    // contributions): f64 rounding ~1e-15 relative; 1e-9 leaves a margin of
    // 10⁶ while a real difference (a leaked or missing key) is O(1e-2) or more.
    (a - b).abs() <= 1e-9 * scale.max(a.abs()).max(b.abs())
}

/// The worked example as one trie pack and as LogitTree's two causal branch
/// sequences: identical log-probs and identical (summed) gradients.
#[test]
fn worked_example_trie_pack_equals_its_two_branches() {
    for (rope, tied, kv) in [(true, false, 2), (false, true, 4)] {
        let model = Model::<f64>::new(config(rope, tied, kv), 5).unwrap();
        let w = [1.0, 0.5, 2.0, 1.0, -0.75, 1.5];
        let t = targets(&TRIE_TARGETS, &w);
        let trie = model
            .forward(
                &TRIE_TOKENS,
                PackMask::new(&TRIE_KV_END, &TRIE_POS).unwrap(),
                &t,
            )
            .unwrap();
        let trie_grads = model.backward(&trie).unwrap();

        // Branch 0: calls 0–2 (10 tokens); branch 1: call 3 (8 tokens).
        let b0: Vec<u32> = TRIE_TOKENS[..10].to_vec();
        let b1: Vec<u32> = [10, 11, 3, 50, 51, 40, 32, 33].to_vec();
        let mut sum = Params::zeros(model.config());
        let mut logprobs = Vec::new();
        for (tokens, pairs, ws) in [
            (&b0, &TRIE_TARGETS[..5], &w[..5]),
            (&b1, &[(6, 33)][..], &w[5..]),
        ] {
            let kv = vec![tokens.len() as u32; tokens.len()];
            let pos: Vec<u32> = (0..tokens.len() as u32).collect();
            let fwd = model
                .forward(
                    tokens,
                    PackMask::new(&kv, &pos).unwrap(),
                    &targets(pairs, ws),
                )
                .unwrap();
            logprobs.extend_from_slice(&fwd.logprobs);
            sum.add_assign(&model.backward(&fwd).unwrap()).unwrap();
        }
        for (e, (a, b)) in trie.logprobs.iter().zip(&logprobs).enumerate() {
            assert!(close(*a, *b, 1.0), "entry {e}: trie {a} vs branch {b}");
        }
        for ((name, a), (_, b)) in trie_grads.tensors().iter().zip(sum.tensors().iter()) {
            let scale = a.iter().fold(0.0f64, |m, v| m.max(v.abs()));
            for (i, (x, y)) in a.iter().zip(b.iter()).enumerate() {
                assert!(
                    close(*x, *y, scale),
                    "{name}[{i}]: trie {x} vs branches {y}"
                );
            }
        }

        // Negative control: the same tokens as one plain causal sequence
        // (Naive-Full) give other log-probs for the targets after the edit.
        let causal_kv = [16u32; 16];
        let contiguous: Vec<u32> = (0..16).collect();
        let naive = model
            .forward(
                &TRIE_TOKENS,
                PackMask::new(&causal_kv, &contiguous).unwrap(),
                &t,
            )
            .unwrap();
        assert!(
            (naive.logprobs[5] - trie.logprobs[5]).abs() > 1e-6,
            "naive-full must differ after the edit"
        );
    }
}

/// Padding keys (`kv_end[k] == k`) change nothing for the real rows, and the
/// padding rows themselves (no visible key: O = 0) stay finite in forward and
/// backward.
#[test]
fn padding_rows_are_inert_and_finite() {
    let model = Model::<f64>::new(config(true, false, 2), 9).unwrap();
    let tokens = [5u32, 6, 7, 8, 0, 0, 0];
    let real_kv = [4u32, 4, 4, 4];
    let padded_kv = [4u32, 4, 4, 4, 4, 5, 6];
    let pos = [0u32, 1, 2, 3, 0, 0, 0];
    let t = targets(&[(0, 6), (1, 7), (2, 8)], &[1.0, 1.0, 1.0]);
    let real = model
        .forward(
            &tokens[..4],
            PackMask::new(&real_kv, &pos[..4]).unwrap(),
            &t,
        )
        .unwrap();
    let mut padded_t = t.clone();
    padded_t.push(Target {
        row: 5,
        label: 3,
        weight: 1.0,
    });
    let padded = model
        .forward(&tokens, PackMask::new(&padded_kv, &pos).unwrap(), &padded_t)
        .unwrap();
    for e in 0..3 {
        assert!(close(real.logprobs[e], padded.logprobs[e], 1.0));
    }
    assert!(padded.logprobs[3].is_finite());
    let g = model.backward(&padded).unwrap();
    assert!(g
        .tensors()
        .iter()
        .all(|(_, t)| t.iter().all(|v| v.is_finite())));
}

/// The same weights (f32 = f64 rounded) give the same log-probs and
/// gradients in f32 and f64, up to f32 rounding: ~1e-7 relative per
/// operation, amplified by depth and softmax to ~1e-5; 1e-3 (gradients,
/// normwise per tensor) and 1e-4 (log-probs, absolute, |log p| ~ 5) are loose
/// enough for rounding and far below a missing term.
#[test]
fn f32_and_f64_agree() {
    let cfg = config(true, false, 2);
    let m64 = Model::<f64>::new(cfg.clone(), 21).unwrap();
    let m32 = Model::<f32>::new(cfg, 21).unwrap();
    let mask = PackMask::new(&TRIE_KV_END, &TRIE_POS).unwrap();
    let t = targets(&TRIE_TARGETS, &[1.0; 6]);
    let f64_fwd = m64.forward(&TRIE_TOKENS, mask, &t).unwrap();
    let f32_fwd = m32.forward(&TRIE_TOKENS, mask, &t).unwrap();
    for (a, b) in f64_fwd.logprobs.iter().zip(&f32_fwd.logprobs) {
        assert!((a - *b as f64).abs() < 1e-4, "{a} vs {b}");
    }
    let (g64, g32) = (
        m64.backward(&f64_fwd).unwrap(),
        m32.backward(&f32_fwd).unwrap(),
    );
    for ((name, a), (_, b)) in g64.tensors().iter().zip(g32.tensors()) {
        let scale = a.iter().fold(0.0f64, |m, v| m.max(v.abs()));
        let diff = a
            .iter()
            .zip(b.iter())
            .fold(0.0f64, |m, (x, y)| m.max((x - *y as f64).abs()));
        assert!(
            diff <= 1e-3 * scale,
            "{name}: max |Δ| {diff:e} at scale {scale:e}"
        );
    }
}

/// An empty pack is valid input: no log-probs, all-zero gradients.
#[test]
fn empty_pack_gives_zero_gradients() {
    let model = Model::<f64>::new(config(true, false, 2), 2).unwrap();
    let fwd = model
        .forward(&[], PackMask::new(&[], &[]).unwrap(), &[])
        .unwrap();
    assert!(fwd.logprobs.is_empty());
    let g = model.backward(&fwd).unwrap();
    assert!(g.tensors().iter().all(|(_, t)| t.iter().all(|&v| v == 0.0)));
}
