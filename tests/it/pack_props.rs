//! Property tests over random rollouts built from random edit scripts
//! (extend, evict a span, insert a summary, re-render turns, pop a frame):
//! the interval mask is the trie's ancestry, every exact layout reproduces
//! each call's prefix for each of its targets exactly once, and the naive
//! layouts are exact precisely when there is no edit.
//!
//! Token ids come from a tiny vocabulary (8 ids) so that equal prefixes,
//! coincidental sharing and spurious alignment blocks are frequent.

use std::collections::{BTreeSet, HashMap};

use proptest::prelude::*;
use treeattn::mask::{dense_mask, PackMask, TileClass, TileMap};
use treeattn::pack::{batch, Layout, Pack};
use treeattn::rollout::{Call, Rollout};
use treeattn::safetensors::{deserialize, pack_from_tensors, pack_tensors, serialize};
use treeattn::tree::{align_blocks, RolloutStats, Tree, MIN_BLOCK};
use treeattn_lab::gen::{self, Rng};

/// One step of a harness script.
#[derive(Clone, Debug)]
enum Op {
    /// A call on the view, then a tool output appended.
    Extend { completion: usize, tool: usize },
    /// The harness drops `len` tokens starting at `at` (fraction of the view,
    /// never the first token).
    Evict { at: f64, len: usize },
    /// A summary call; the view becomes `view[..keep] ++ RESUME ++ summary`.
    Summary { keep: f64, len: usize },
    /// The view becomes `view[..keep] ++` the last call's completion.
    ReRender { keep: f64 },
    /// A frame is pushed, one call made in it, then popped keeping that
    /// call's completion as the return value.
    PopFrame { frame: usize, ret: usize },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (1..6usize, 0..6usize).prop_map(|(completion, tool)| Op::Extend { completion, tool }),
        1 => (0.0..1.0f64, 1..8usize).prop_map(|(at, len)| Op::Evict { at, len }),
        1 => (0.0..1.0f64, 1..6usize).prop_map(|(keep, len)| Op::Summary { keep, len }),
        1 => (0.0..1.0f64).prop_map(|keep| Op::ReRender { keep }),
        1 => (1..6usize, 1..4usize).prop_map(|(frame, ret)| Op::PopFrame { frame, ret }),
    ]
}

const V0: u32 = 100;
const VOCAB: u32 = 8;

struct Sim {
    rng: Rng,
    view: Vec<u32>,
    calls: Vec<Call>,
}

impl Sim {
    fn tokens(&mut self, n: usize) -> Vec<u32> {
        (0..n)
            .map(|_| V0 + self.rng.range(0, VOCAB as usize - 1) as u32)
            .collect()
    }
    fn call(&mut self, n: usize) -> Vec<u32> {
        let completion = self.tokens(n.max(1));
        let lp = completion
            .iter()
            .map(|_| -(self.rng.unit() as f32) - 0.01)
            .collect();
        self.calls.push(Call {
            context: self.view.clone(),
            completion: completion.clone(),
            logprobs: Some(lp),
        });
        self.view.extend(&completion);
        completion
    }
    fn cut(&self, f: f64) -> usize {
        // Keep at least one token so that contexts stay non-empty.
        1 + ((self.view.len() - 1) as f64 * f) as usize
    }
}

/// Runs a script; the rollout always ends with a call.
fn simulate(id: &str, seed: u64, system: usize, ops: &[Op]) -> Rollout {
    let mut s = Sim {
        rng: Rng::new(seed),
        view: Vec::new(),
        calls: Vec::new(),
    };
    s.view = s.tokens(system.max(1));
    for op in ops {
        match *op {
            Op::Extend { completion, tool } => {
                s.call(completion);
                let t = s.tokens(tool);
                s.view.extend(t);
            }
            Op::Evict { at, len } => {
                let a = s.cut(at);
                let b = (a + len).min(s.view.len());
                s.view.drain(a..b);
            }
            Op::Summary { keep, len } => {
                s.view.push(gen::SUMMARY_REQUEST);
                let summary = s.call(len);
                let k = s.cut(keep).min(s.view.len());
                s.view.truncate(k);
                s.view.push(gen::RESUME);
                s.view.extend(summary);
            }
            Op::ReRender { keep } => {
                if let Some(last) = s.calls.last().map(|c| c.completion.clone()) {
                    let k = s.cut(keep);
                    s.view.truncate(k);
                    s.view.extend(last);
                }
            }
            Op::PopFrame { frame, ret } => {
                let base = s.view.clone();
                s.view.push(gen::FRAME_PUSH);
                let f = s.tokens(frame);
                s.view.extend(f);
                let r = s.call(ret);
                s.view = base;
                s.view.push(gen::FRAME_POP);
                s.view.extend(r);
            }
        }
    }
    s.call(2);
    Rollout::new(id, s.calls).expect("simulated rollouts are valid")
}

fn rollout() -> impl Strategy<Value = Rollout> {
    (any::<u64>(), 1..6usize, prop::collection::vec(op(), 0..8))
        .prop_map(|(seed, sys, ops)| simulate("r", seed, sys, &ops))
}

/// Several rollouts with distinct ids; half of them start with the same
/// system prompt so that prefix sharing has something to share.
fn rollouts() -> impl Strategy<Value = Vec<Rollout>> {
    prop::collection::vec(
        (any::<u64>(), 1..6usize, prop::collection::vec(op(), 0..6)),
        1..5,
    )
    .prop_map(|v| {
        v.into_iter()
            .enumerate()
            .map(|(i, (seed, sys, ops))| {
                simulate(
                    &format!("r{i}"),
                    if i % 2 == 0 { seed } else { 7 },
                    sys,
                    &ops,
                )
            })
            .collect()
    })
}

/// Every sampled token as (rollout, call, offset).
fn all_targets(rs: &[Rollout]) -> BTreeSet<(u32, u32, u32)> {
    let mut s = BTreeSet::new();
    for (r, ro) in rs.iter().enumerate() {
        for (c, call) in ro.calls().iter().enumerate() {
            for j in 0..call.completion.len() {
                s.insert((r as u32, c as u32, j as u32));
            }
        }
    }
    s
}

/// For each loss entry, the keys its row sees, in order, must be exactly the
/// call's `context ++ completion` before the target, with position ids
/// 0, 1, 2, ...; and the label must be the target. This is what a model
/// run on the pack with this mask computes for that target.
fn check_entries(pack: &Pack, rs: &[Rollout], what: &str) {
    pack.validate().unwrap();
    let m = pack.mask().unwrap();
    for e in &pack.loss {
        let call = &rs[e.rollout as usize].calls()[e.call as usize];
        let n = call.context.len() + e.offset as usize;
        let q = e.row as usize;
        let seen: Vec<usize> = (0..=q).filter(|&k| m.visible(q, k)).collect();
        let toks: Vec<u32> = seen.iter().map(|&k| pack.tokens[k]).collect();
        let pos: Vec<u32> = seen.iter().map(|&k| pack.position_ids[k]).collect();
        assert_eq!(
            toks,
            call.sequence()[..n],
            "{what}: prefix of {:?}",
            e.key()
        );
        assert_eq!(
            pos,
            (0..n as u32).collect::<Vec<_>>(),
            "{what}: positions of {:?}",
            e.key()
        );
        assert_eq!(
            e.label,
            call.completion[e.offset as usize],
            "{what}: label of {:?}",
            e.key()
        );
        assert_eq!(
            e.logprob,
            call.logprobs.as_ref().map(|l| l[e.offset as usize])
        );
        // The segment: junction calls at or before this one.
        let r = &rs[e.rollout as usize];
        let junctions = (1..=e.call as usize).filter(|&c| r.is_junction(c)).count();
        assert_eq!(
            e.segment as usize,
            junctions,
            "{what}: segment of {:?}",
            e.key()
        );
    }
}

fn keys(pack: &Pack) -> Vec<(u32, u32, u32)> {
    pack.loss.iter().map(|e| e.key()).collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    #[test]
    fn interval_rule_is_trie_ancestry(rs in rollouts(), share in any::<bool>()) {
        let tree = Tree::build(&rs, share).unwrap();
        let p = tree.trie_pack();
        let l = p.len();
        let dense = dense_mask(&p.kv_end);
        for q in 0..l {
            // Ancestors of q from parent pointers, independent of kv_end.
            let mut anc = vec![false; l];
            let mut x = Some(q);
            while let Some(n) = x {
                anc[n] = true;
                x = tree.parent(n);
            }
            for k in 0..l {
                prop_assert_eq!(p.mask().unwrap().visible(q, k), anc[k], "q={} k={}", q, k);
                prop_assert_eq!(dense[q * l + k], anc[k]);
                prop_assert_eq!(tree.is_ancestor_or_self(k, q), anc[k]);
            }
        }
    }

    #[test]
    fn trie_positions_and_dedup(r in rollout()) {
        let tree = Tree::build(std::slice::from_ref(&r), false).unwrap();
        let p = tree.trie_pack();
        // Same prefix <=> same node; position = index in the call's sequence.
        let mut by_prefix: HashMap<Vec<u32>, u32> = HashMap::new();
        for (c, call) in r.calls().iter().enumerate() {
            let seq = call.sequence();
            let nodes = tree.call_nodes(0, c);
            for i in 0..seq.len() {
                prop_assert_eq!(p.tokens[nodes[i] as usize], seq[i]);
                prop_assert_eq!(p.position_ids[nodes[i] as usize], i as u32);
                let prev = by_prefix.insert(seq[..=i].to_vec(), nodes[i]);
                prop_assert!(prev.is_none() || prev == Some(nodes[i]));
            }
        }
        // Distinct prefixes are distinct nodes, and every node is some prefix.
        let distinct: BTreeSet<u32> = by_prefix.values().copied().collect();
        prop_assert_eq!(distinct.len(), by_prefix.len());
        prop_assert_eq!(distinct.len(), p.len());
    }

    #[test]
    fn exact_layouts_score_every_target_once_on_its_live_prefix(rs in rollouts(), share in any::<bool>()) {
        let tree = Tree::build(&rs, share).unwrap();
        let want: Vec<_> = all_targets(&rs).into_iter().collect();
        let trie = tree.trie_pack();
        prop_assert_eq!(keys(&trie), want.clone());
        check_entries(&trie, &rs, "trie");
        let rep = tree.replicated_pack();
        prop_assert_eq!(keys(&rep), want.clone());
        prop_assert_eq!(rep.len(), tree.branches().iter().map(|b| b.len as usize).sum::<usize>());
        check_entries(&rep, &rs, "replicated");
        let lt = tree.logittree_packs();
        prop_assert_eq!(lt.len(), tree.branches().len());
        let mut lt_keys: Vec<_> = lt.iter().flat_map(keys).collect();
        lt_keys.sort();
        prop_assert_eq!(lt_keys, want.clone());
        for b in &lt {
            prop_assert!(b.kv_end.iter().all(|&e| e as usize == b.len()), "each branch is causal");
            check_entries(b, &rs, "logittree");
        }
        // Naive-Full scores the same entries, but on a causal replay.
        prop_assert_eq!(keys(&tree.naive_full_pack()), want);
    }

    #[test]
    fn naive_layouts_are_exact_iff_there_is_no_edit(r in rollout()) {
        let rs = std::slice::from_ref(&r);
        let tree = Tree::build(rs, false).unwrap();
        let st = RolloutStats::of(&r).unwrap();
        let (trie, nf, nc) = (tree.trie_pack(), tree.naive_full_pack(), tree.naive_compressed_pack());
        // Naive-Compressed scores each present target on the final sequence:
        // the label is the token after its row there.
        let fin = r.calls().last().unwrap().sequence();
        prop_assert_eq!(&nc.tokens, &fin);
        for e in &nc.loss {
            prop_assert_eq!(e.label, fin[e.row as usize + 1]);
            prop_assert_eq!(e.label, r.calls()[e.call as usize].completion[e.offset as usize]);
        }
        if st.junctions == 0 {
            prop_assert_eq!(st.branches, 1);
            prop_assert_eq!(&nf, &trie);
            prop_assert_eq!(&nc, &trie);
            prop_assert_eq!(st.diverging, 0);
        }
        if st.branches > 1 {
            prop_assert!(st.junctions > 0);
            prop_assert_ne!(&nf.kv_end, &trie.kv_end, "an edit makes Naive-Full inexact");
        } else {
            prop_assert_eq!(&nf.kv_end, &trie.kv_end);
        }
        // The final call's own completion is always scored in place.
        let last = r.calls().len() as u32 - 1;
        for j in 0..r.calls()[last as usize].completion.len() as u32 {
            prop_assert!(nc.loss_index(0, last, j).is_some());
        }
    }

    #[test]
    fn sdcc_pairs_are_the_diverging_present_targets(r in rollout()) {
        let tree = Tree::build(std::slice::from_ref(&r), false).unwrap();
        let st = RolloutStats::of(&r).unwrap();
        let pairs = tree.sdcc_pairs();
        prop_assert_eq!(pairs.len(), st.diverging);
        let trie = tree.trie_pack();
        let nc = tree.naive_compressed_pack();
        prop_assert_eq!(nc.loss.len(), st.present);
        let last = r.calls().len() - 1;
        let fin = tree.call_nodes(0, last);
        for p in &pairs {
            prop_assert_ne!(p.student_row, p.teacher_row);
            let e = trie.loss[trie.loss_index(p.rollout, p.call, p.offset).unwrap()];
            prop_assert_eq!((e.row, e.label), (p.teacher_row, p.label));
            // The student row is on the rightmost branch, followed there by the label.
            let at = fin.iter().position(|&n| n == p.student_row).unwrap();
            prop_assert_eq!(trie.tokens[fin[at + 1] as usize], p.label);
            // Naive-Compressed scores the same target from the same place.
            let c = nc.loss[nc.loss_index(p.rollout, p.call, p.offset).unwrap()];
            prop_assert_eq!(c.row as usize, at);
        }
    }

    #[test]
    fn batches_cover_every_target_within_budget(
        rs in rollouts(), budget in 20usize..400, share in any::<bool>(), replicated in any::<bool>()
    ) {
        let layout = if replicated { Layout::Replicated } else { Layout::Trie };
        let own: Vec<usize> = rs.iter().map(|r| {
            let t = Tree::build(std::slice::from_ref(r), false).unwrap();
            if replicated { t.replicated_pack().len() } else { t.len() }
        }).collect();
        match batch(&rs, budget, share, layout) {
            Err(e) => {
                prop_assert!(own.iter().any(|&s| s > budget), "{}", e);
                prop_assert!(e.to_string().contains("budget"));
            }
            Ok(bs) => {
                let mut seen_rollouts = Vec::new();
                let mut seen_keys = Vec::new();
                for b in &bs {
                    prop_assert!(b.pack.len() <= budget);
                    check_entries(&b.pack, &rs, "batch");
                    seen_rollouts.extend(b.rollouts.iter().copied());
                    seen_keys.extend(keys(&b.pack));
                    prop_assert_eq!(b.sdcc.is_some(), !replicated);
                }
                seen_rollouts.sort();
                prop_assert_eq!(seen_rollouts, (0..rs.len() as u32).collect::<Vec<_>>());
                seen_keys.sort();
                prop_assert_eq!(seen_keys, all_targets(&rs).into_iter().collect::<Vec<_>>());
            }
        }
    }

    #[test]
    fn safetensors_round_trip(rs in rollouts(), share in any::<bool>()) {
        let tree = Tree::build(&rs, share).unwrap();
        let pack = tree.trie_pack();
        let mut base = vec![0u64];
        for r in &rs {
            base.push(base.last().unwrap() + r.calls().len() as u64);
        }
        let pairs = tree.sdcc_pairs();
        let t = pack_tensors(&pack, Some(&pairs), &base).unwrap();
        let st = deserialize(&serialize(&t, &Default::default()).unwrap()).unwrap();
        prop_assert_eq!(pack_from_tensors(&st, &base).unwrap(), pack);
        prop_assert_eq!(st.get("sdcc_student_rows").unwrap().to_i64().unwrap().len(), pairs.len());
    }

    #[test]
    fn alignment_is_a_one_to_one_matching_of_equal_blocks(
        a in prop::collection::vec(0u32..4, 0..60), b in prop::collection::vec(0u32..4, 0..60)
    ) {
        let al = align_blocks(&a, &b, MIN_BLOCK);
        prop_assert_eq!(al.len(), b.len());
        let mut used = vec![false; a.len()];
        for (j, x) in al.iter().enumerate() {
            if let Some(i) = *x {
                let i = i as usize;
                prop_assert_eq!(a[i], b[j]);
                prop_assert!(!used[i], "a[{}] matched twice", i);
                used[i] = true;
            }
        }
        // Every run of consecutive aligned positions on one diagonal is a
        // block of at least MIN_BLOCK tokens.
        let mut j = 0;
        while j < b.len() {
            if let Some(i) = al[j] {
                let mut n = 1;
                while j + n < b.len() && al[j + n] == Some(i + n as u32) {
                    n += 1;
                }
                prop_assert!(n >= MIN_BLOCK, "block of {} at b[{}]", n, j);
                j += n;
            } else {
                j += 1;
            }
        }
        // A sequence aligns to itself and to its extensions position by position.
        let mut ext = a.clone();
        ext.extend(&b);
        let self_al = align_blocks(&a, &ext, MIN_BLOCK);
        if a.len() >= MIN_BLOCK {
            let want: Vec<Option<u32>> = (0..a.len() as u32).map(Some).collect();
            prop_assert_eq!(&self_al[..a.len()], &want[..]);
        }
    }

    #[test]
    fn tile_classes_agree_with_the_dense_mask(
        spans in prop::collection::vec((0usize..40, 0usize..40), 1..60), qt in 1usize..9, kt in 1usize..9
    ) {
        // Arbitrary valid kv_end (k <= kv_end[k] <= L), padding keys included.
        let l = spans.len();
        let kv: Vec<u32> = spans.iter().enumerate().map(|(k, &(a, _))| (k + a % (l - k + 1)) as u32).collect();
        let pos: Vec<u32> = (0..l as u32).collect();
        let m = PackMask::new(&kv, &pos).unwrap();
        let tiles = TileMap::new(&m, qt, kt).unwrap();
        let dense = dense_mask(&kv);
        for a in 0..tiles.q_tiles() {
            for b in 0..tiles.k_tiles() {
                let qs = a * qt..((a + 1) * qt).min(l);
                let ks = b * kt..((b + 1) * kt).min(l);
                let vis: Vec<bool> = qs.clone().flat_map(|q| ks.clone().map(move |k| (q, k))).map(|(q, k)| dense[q * l + k]).collect();
                match tiles.class(a, b).unwrap() {
                    TileClass::Skip => prop_assert!(vis.iter().all(|&v| !v)),
                    TileClass::Full => prop_assert!(vis.iter().all(|&v| v)),
                    TileClass::Partial => {}
                }
            }
        }
        let (s, f, p) = tiles.counts();
        prop_assert_eq!(s + f + p, tiles.q_tiles() * tiles.k_tiles());
    }
}

#[test]
fn tile_map_of_a_trie_pack_skips_finished_branches() {
    // On a real tree with two long branches, the second branch's queries
    // skip the first branch's own tokens.
    let r = &gen::generate(gen::Shape::Compaction, 5, false).unwrap()[0];
    let p = Tree::build(std::slice::from_ref(r), false)
        .unwrap()
        .trie_pack();
    let t = TileMap::new(&p.mask().unwrap(), 16, 16).unwrap();
    let (skip, full, partial) = t.counts();
    let causal_blocks = (0..t.q_tiles()).map(|a| a + 1).sum::<usize>();
    assert!(
        skip > t.q_tiles() * t.k_tiles() - causal_blocks,
        "skips beyond the causal upper triangle"
    );
    assert!(full > 0 && partial > 0);
}

#[test]
fn shared_prefixes_store_a_grpo_prompt_once() {
    let group = gen::generate(gen::Shape::Grpo, 11, false).unwrap();
    let prompt = group[0].calls()[0].context.len();
    let separate = Tree::build(&group, false).unwrap().len();
    let shared = Tree::build(&group, true).unwrap().len();
    // 16 rollouts, one prompt: 15 copies saved (more if two responses also
    // begin alike, which random 32k-vocab tokens make vanishingly rare).
    assert_eq!(separate - shared, 15 * prompt);
    // Batching with sharing fits the whole group in a budget that the
    // unshared trie exceeds.
    let b = batch(&group, shared, true, Layout::Trie).unwrap();
    assert_eq!(b.len(), 1);
    assert_eq!(b[0].pack.len(), shared);
    assert!(batch(&group, shared, false, Layout::Trie).unwrap().len() > 1);
    // The shared pack is still exact for every response.
    let pack = &b[0].pack;
    for e in &pack.loss {
        let call = &group[e.rollout as usize].calls()[e.call as usize];
        let n = call.context.len() + e.offset as usize;
        let seen: Vec<u32> = (0..=e.row as usize)
            .filter(|&k| pack.mask().unwrap().visible(e.row as usize, k))
            .map(|k| pack.tokens[k])
            .collect();
        assert_eq!(seen, call.sequence()[..n]);
    }
}

#[test]
fn a_batch_rejects_a_rollout_over_the_budget() {
    let r = gen::generate(gen::Shape::Plain, 1, false).unwrap();
    let size = Tree::build(&r, false).unwrap().len();
    let err = batch(&r, size - 1, false, Layout::Trie)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("plain-1") && err.contains(&size.to_string()),
        "{err}"
    );
    assert!(batch(&r, size, false, Layout::Trie).is_ok());
    assert!(batch(&r, 0, false, Layout::Trie).is_err());
}

#[test]
fn the_strategy_produces_edits_sharing_and_plain_rollouts() {
    // Guards the property tests against vacuity: the random scripts must
    // produce both edited trees (with diverging targets) and edit-free ones.
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;
    let mut runner = TestRunner::deterministic();
    let (mut plain, mut branched, mut diverging, mut nodes) = (0, 0, 0, 0);
    for _ in 0..200 {
        let r = rollout().new_tree(&mut runner).unwrap().current();
        let st = RolloutStats::of(&r).unwrap();
        plain += usize::from(st.junctions == 0);
        branched += usize::from(st.branches > 1);
        diverging += usize::from(st.diverging > 0);
        nodes += st.trie_tokens;
    }
    assert!(
        plain >= 10 && branched >= 50 && diverging >= 20,
        "{plain} {branched} {diverging}"
    );
    assert!(nodes / 200 >= 10, "mean trie size {}", nodes / 200);
}

#[test]
fn the_entry_check_catches_a_wrong_mask_or_row() {
    // Negative controls for `check_entries`: a key leaking into a sibling
    // subtree, or a loss row off by one, must be caught.
    let r = gen::golden();
    let rs = std::slice::from_ref(&r);
    let good = Tree::build(rs, false).unwrap().trie_pack();
    check_entries(&good, rs, "golden");
    let mut leak = good.clone();
    leak.kv_end[9] = 16; // token 51 of call 2 becomes visible to call 3's branch
    assert!(std::panic::catch_unwind(|| check_entries(&leak, rs, "leak")).is_err());
    let mut shifted = good.clone();
    shifted.loss[2].row += 1;
    assert!(std::panic::catch_unwind(|| check_entries(&shifted, rs, "row")).is_err());
    let mut naive = Tree::build(rs, false).unwrap().naive_full_pack();
    naive.position_ids = good.position_ids.clone();
    assert!(std::panic::catch_unwind(|| check_entries(&naive, rs, "naive")).is_err());
}

#[test]
fn batching_is_first_fit_decreasing() {
    // Trie sizes 3, 6, 4, 5 (input order) with a budget of 9: decreasing
    // order 6, 5, 4, 3; 6 opens pack 0, 5 opens pack 1, 4 joins pack 1,
    // 3 joins pack 0.
    let rs: Vec<Rollout> = [3u32, 6, 4, 5]
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            let ctx: Vec<u32> = (0..n - 1).map(|t| 1000 * i as u32 + t).collect();
            Rollout::new(format!("s{n}"), vec![Call::new(ctx, vec![7])]).unwrap()
        })
        .collect();
    let b = batch(&rs, 9, false, Layout::Trie).unwrap();
    // A tree of a subset keeps the input indices.
    let t = Tree::build_indexed(&[(1, &rs[1]), (3, &rs[3])], false).unwrap();
    assert_eq!((t.rollout_index(0), t.rollout_index(1)), (1, 3));
    let members: Vec<Vec<u32>> = b.iter().map(|x| x.rollouts.clone()).collect();
    assert_eq!(members, vec![vec![0, 1], vec![2, 3]]);
    assert_eq!(
        b.iter().map(|x| x.pack.len()).collect::<Vec<_>>(),
        vec![9, 9]
    );
    // Loss entries keep input rollout indices.
    assert_eq!(
        b[1].pack.loss.iter().map(|e| e.rollout).collect::<Vec<_>>(),
        vec![2, 3]
    );
}
