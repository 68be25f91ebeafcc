//! The mask, the mask plan and the cost model on the lab's generated
//! forests and on DESIGN §4's golden rollout (`treeattn_lab::gen`: the
//! library's own unit tests cannot use the lab, which depends on it).

use treeattn::cost::ModelCost;
use treeattn::mask::PackMask;
use treeattn::plan::MaskPlan;
use treeattn_lab::gen;

/// `window_starts` against its definition on random forests with
/// padding keys: `q` sees `k` under a window of `w` levels iff `k` is
/// visible and `depth(q) − depth(k) < w`, depth counted pair by pair
/// (`#{j < t : kv_end[j] > t}`); on a chain it is `q − k < w`.
#[test]
fn window_starts_follow_the_depth_definition() {
    let mut rng = gen::Rng::new(3);
    for case in 0..40 {
        let p = gen::random_forest(&mut rng, 1 + case % 3, 20 + case * 3, 2, 7);
        let mut kv_end = p.kv_end.clone();
        for (k, e) in kv_end.iter_mut().enumerate() {
            if *e as usize == k + 1 && (k * 7 + case) % 5 == 0 {
                *e = k as u32; // a padding key
            }
        }
        let pos = vec![0; kv_end.len()];
        let m = PackMask::new(&kv_end, &pos).unwrap();
        assert!(m.is_tree());
        let l = kv_end.len();
        let depth: Vec<usize> = (0..l)
            .map(|t| (0..t).filter(|&j| kv_end[j] as usize > t).count())
            .collect();
        for w in [1u32, 2, 5, 40] {
            let starts = m.window_starts(w).unwrap();
            for q in 0..l {
                for k in 0..=q {
                    let want = m.visible(q, k) && depth[q] - depth[k] < w as usize;
                    let got = starts[q] as usize <= k && m.visible(q, k);
                    assert_eq!(got, want, "case {case}, window {w}, q {q}, k {k}");
                }
            }
            let blind = m.blind_queries_in(Some(&starts));
            for (q, &b) in blind.iter().enumerate() {
                let sees = (0..=q).any(|k| starts[q] as usize <= k && m.visible(q, k));
                assert_eq!(b, !sees, "case {case}, window {w}, row {q}");
            }
        }
    }
    let chain = PackMask::new(&[9; 9], &[0; 9]).unwrap();
    assert_eq!(chain.window_starts(3).unwrap(), [0, 0, 0, 1, 2, 3, 4, 5, 6]);
    assert_eq!(
        chain.window_starts(1).unwrap(),
        (0..9).collect::<Vec<u32>>()
    );
}

#[test]
fn a_plan_is_its_mask_validated_once() {
    let mut rng = gen::Rng::new(7);
    let p = gen::random_forest(&mut rng, 3, 60, 3, 9);
    let plan = MaskPlan::new(&p.kv_end, &p.position_ids).unwrap();
    let mask = PackMask::new(&p.kv_end, &p.position_ids).unwrap();
    assert_eq!(plan.mask().kv_end(), mask.kv_end());
    assert_eq!(plan.mask().position_ids(), mask.position_ids());
    assert_eq!(plan.fingerprint(), mask.fingerprint());
    assert_eq!(plan.visible_pairs(), mask.visible_pairs());
    assert!(plan.is_of(mask));
    let mut other = p.kv_end.clone();
    let last = other.len() - 1;
    // The last key becomes padding (kv_end[k] == k), or stops being it.
    let l = other.len() as u32;
    other[last] = if other[last] == l { l - 1 } else { l };
    assert!(!plan.is_of(PackMask::new(&other, &p.position_ids).unwrap()));
}

#[test]
fn formulas_by_hand() {
    // Two layers, H 8, 2 q heads, 1 kv head of 4, I 16, V 10.
    let m = ModelCost {
        layers: 2,
        hidden: 8,
        heads: 2,
        kv_heads: 1,
        head_dim: 4,
        intermediate: 16,
        vocab: 10,
    };
    m.validate().unwrap();
    // attention: 2 · 2 · 16 = 64 forward per pair, 3.5× with backward.
    assert_eq!(m.attention_per_pair(), 64.0 * 3.5);
    // linear: q 64, k 32, v 32, o 64, MLP 3·128 = 576 MACs per layer.
    assert_eq!(m.linear_per_token(), 2.0 * 2.0 * 576.0 * 3.0);
    assert_eq!(m.logits_per_row(), 2.0 * 80.0 * 3.0);
    // The golden pack of DESIGN §4: 16 tokens, 6 loss rows (all distinct).
    let pack = treeattn::tree::Tree::build(&[gen::golden()], false)
        .unwrap()
        .trie_pack();
    let c = pack.cost(&m).unwrap();
    let pairs: u64 = pack
        .kv_end
        .iter()
        .enumerate()
        .map(|(k, &e)| e as u64 - k as u64)
        .sum();
    assert_eq!(c.visible_pairs, pairs);
    assert_eq!(c.tokens, 16);
    assert_eq!(c.logit_rows, 6);
    assert_eq!(c.total, c.attention + c.linear);
    assert_eq!(
        c.linear,
        16.0 * m.linear_per_token() + 6.0 * m.logits_per_row()
    );
    let bad = ModelCost { kv_heads: 3, ..m };
    assert!(bad.validate().unwrap_err().to_string().contains("kv_heads"));
    // Counts that would wrap in u64 are refused, not wrapped.
    for huge in [
        ModelCost {
            vocab: u64::MAX / 2,
            ..m
        },
        ModelCost {
            layers: 1 << 40,
            head_dim: 1 << 30,
            ..m
        },
    ] {
        assert!(huge
            .validate()
            .unwrap_err()
            .to_string()
            .contains("overflow"));
    }
    ModelCost::LLAMA3_8B.validate().unwrap();
}
