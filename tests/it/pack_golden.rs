//! The worked example of DESIGN §4 as a golden vector: every layout, the
//! figures of the tree, and the SDCC pairs, exactly.

use treeattn::pack::LossEntry;
use treeattn::rollout::{Call, Rollout};
use treeattn::tree::{RolloutStats, Tree};

fn golden() -> Rollout {
    Rollout::new(
        "golden",
        vec![
            Call::new(vec![10, 11, 20], vec![30, 31]),
            Call::new(vec![10, 11, 20, 30, 31, 40], vec![32]),
            Call::new(vec![10, 11, 20, 30, 31, 40, 32, 1], vec![50, 51]),
            Call::new(vec![10, 11, 3, 50, 51, 40, 32], vec![33]),
        ],
    )
    .unwrap()
}

/// (call, offset, row, label) of each loss entry, in canonical order.
fn rows(loss: &[LossEntry]) -> Vec<(u32, u32, u32, u32)> {
    loss.iter()
        .map(|e| (e.call, e.offset, e.row, e.label))
        .collect()
}

#[test]
fn trie_pack_is_the_design_vector() {
    let tree = Tree::build(&[golden()], false).unwrap();
    let p = tree.trie_pack();
    assert_eq!(
        p.tokens,
        vec![10, 11, 20, 30, 31, 40, 32, 1, 50, 51, 3, 50, 51, 40, 32, 33]
    );
    assert_eq!(
        p.position_ids,
        vec![0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 2, 3, 4, 5, 6, 7]
    );
    assert_eq!(
        p.kv_end,
        vec![16, 16, 10, 10, 10, 10, 10, 10, 10, 10, 16, 16, 16, 16, 16, 16]
    );
    assert_eq!(
        rows(&p.loss),
        vec![
            (0, 0, 2, 30),
            (0, 1, 3, 31),
            (1, 0, 5, 32),
            (2, 0, 7, 50),
            (2, 1, 8, 51),
            (3, 0, 14, 33)
        ]
    );
    assert!(p
        .loss
        .iter()
        .all(|e| e.rollout == 0 && e.weight == 1.0 && e.logprob.is_none()));
    p.validate().unwrap();
    assert_eq!(p.loss_index(0, 2, 1), Some(4));
    assert_eq!(p.loss_index(0, 2, 2), None);
}

#[test]
fn figures_sdcc_and_naive_layouts() {
    let r = golden();
    let s = RolloutStats::of(&r).unwrap();
    assert_eq!((s.calls, s.junctions, s.branches, s.targets), (4, 1, 2, 6));
    assert_eq!((s.present, s.diverging), (4, 3)); // 50 51 32 33 present; 33 is in place
    assert_eq!((s.trie_tokens, s.branch_tokens), (16, 18));
    assert!((s.dedup_ratio - 16.0 / 18.0).abs() < 1e-12);
    let j = &s.junction_list[0];
    // Call 2's sequence has 10 tokens; 10 11, 50 51 and 40 32 are kept.
    assert_eq!(
        (j.call, j.fork_depth, j.prev_len, j.kept, j.evicted),
        (3, 2, 10, 6, 4)
    );
    assert_eq!(s.branch_list[1].fork_depth, 2);
    assert_eq!(s.branch_list[1].forks_from, Some(0));
    assert_eq!(s.branch_list[0].calls, vec![0, 1, 2]);
    assert_eq!(s.branch_list[1].calls, vec![3]);

    let tree = Tree::build(&[r], false).unwrap();
    let pairs: Vec<(u32, u32, u32)> = tree
        .sdcc_pairs()
        .iter()
        .map(|p| (p.student_row, p.teacher_row, p.label))
        .collect();
    // Canonical order (call, offset): 32 (call 1) first, then 50, 51.
    assert_eq!(pairs, vec![(13, 5, 32), (10, 7, 50), (11, 8, 51)]);

    let rep = tree.replicated_pack();
    assert_eq!(rep.len(), 18);
    assert_eq!(rep.kv_end, [vec![10; 10], vec![18; 8]].concat());
    assert_eq!(rep.tokens[10..], [10, 11, 3, 50, 51, 40, 32, 33]);
    assert_eq!(
        rows(&rep.loss),
        vec![
            (0, 0, 2, 30),
            (0, 1, 3, 31),
            (1, 0, 5, 32),
            (2, 0, 7, 50),
            (2, 1, 8, 51),
            (3, 0, 16, 33)
        ]
    );

    let lt = tree.logittree_packs();
    assert_eq!(lt.len(), 2);
    assert_eq!(rows(&lt[1].loss), vec![(3, 0, 6, 33)]);
    assert_eq!(lt[0].loss.len(), 5);

    let nc = tree.naive_compressed_pack();
    assert_eq!(nc.tokens, vec![10, 11, 3, 50, 51, 40, 32, 33]);
    assert_eq!(nc.kv_end, vec![8; 8]);
    // Scores 32, 50, 51, 33 on call 3's sequence; 30 and 31 are absent.
    assert_eq!(
        rows(&nc.loss),
        vec![(1, 0, 5, 32), (2, 0, 2, 50), (2, 1, 3, 51), (3, 0, 6, 33)]
    );
    assert_eq!(nc.loss_index(0, 0, 0), None);

    let nf = tree.naive_full_pack();
    assert_eq!(nf.tokens, tree.trie_pack().tokens);
    assert_eq!(nf.position_ids, (0..16).collect::<Vec<u32>>());
    assert_eq!(nf.kv_end, vec![16; 16]);
}
