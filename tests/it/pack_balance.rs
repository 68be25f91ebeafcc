//! `pack::balance` (data-parallel packing: GRPO groups whole, LPT on exact
//! cost) and `pack::lpt`, its assignment, over random inputs; and the pack
//! schema (`safetensors::PACK_SCHEMA`) against the tensors the writers produce.

use std::collections::{BTreeMap, BTreeSet};

use proptest::prelude::*;
use treeattn::cost::ModelCost;
use treeattn::pack::{balance, batch, lpt, Layout, Objective, MAX_RANKS};
use treeattn::rollout::{Call, Rollout};
use treeattn::safetensors::{loss_field_tensors, pack_tensors, rollout_tensors};
use treeattn::safetensors::{Axis, PACK_SCHEMA};

const SMALL: ModelCost = ModelCost {
    layers: 2,
    hidden: 8,
    heads: 2,
    kv_heads: 1,
    head_dim: 4,
    intermediate: 16,
    vocab: 10,
};

/// The heaviest bin's load under an assignment.
fn max_load(weights: &[f64], bins: &[usize], n: usize) -> f64 {
    let mut load = vec![0.0; n];
    for (w, &b) in weights.iter().zip(bins) {
        load[b] += w;
    }
    load.into_iter().fold(0.0, f64::max)
}

/// The optimal makespan of `weights` on `m` bins, by trying every
/// assignment (unit 0 on bin 0 by symmetry).
fn optimum(weights: &[f64], m: usize) -> f64 {
    fn go(w: &[f64], load: &mut [f64], best: &mut f64) {
        let Some((&x, rest)) = w.split_first() else {
            *best = best.min(load.iter().copied().fold(0.0, f64::max));
            return;
        };
        for b in 0..load.len() {
            load[b] += x;
            if load[b] < *best {
                go(rest, load, best);
            }
            load[b] -= x;
        }
    }
    let mut load = vec![0.0; m];
    let mut best = f64::INFINITY;
    if let Some((&x, rest)) = weights.split_first() {
        load[0] = x;
        go(rest, &mut load, &mut best);
    } else {
        best = 0.0;
    }
    best
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// Without a token budget LPT is Graham's: every unit on one of the
    /// `world` bins of one micro-step, the heaviest bin within the mean
    /// plus the heaviest unit and within (4/3 − 1/(3m)) of the optimum.
    #[test]
    fn lpt_keeps_grahams_bounds(
        weights in prop::collection::vec(0.0..100.0f64, 1..9),
        world in 1usize..4,
    ) {
        let tokens = vec![1usize; weights.len()];
        let (micro, bins) = lpt(&weights, &tokens, world, usize::MAX, 1).unwrap();
        prop_assert_eq!(micro, 1);
        prop_assert_eq!(bins.len(), weights.len());
        prop_assert!(bins.iter().all(|&b| b < world));
        let got = max_load(&weights, &bins, world);
        let total: f64 = weights.iter().sum();
        let heaviest = weights.iter().copied().fold(0.0, f64::max);
        prop_assert!(got <= total / world as f64 + heaviest + 1e-9);
        let opt = optimum(&weights, world);
        let m = world as f64;
        prop_assert!(got <= (4.0 / 3.0 - 1.0 / (3.0 * m)) * opt + 1e-9, "LPT {} vs optimum {}", got, opt);
    }

    /// With a budget every bin stays within it, every unit is placed once,
    /// and the micro-steps start from the minimum asked.
    #[test]
    fn lpt_respects_the_budget(
        units in prop::collection::vec((0.0..50.0f64, 1usize..20), 1..30),
        world in 1usize..5,
        budget in 20usize..60,
        min_micro in 1usize..3,
    ) {
        let (weights, tokens): (Vec<f64>, Vec<usize>) = units.into_iter().unzip();
        let (micro, bins) = lpt(&weights, &tokens, world, budget, min_micro).unwrap();
        prop_assert!(micro >= min_micro);
        prop_assert_eq!(bins.len(), weights.len());
        let mut used = vec![0usize; world * micro];
        for (&b, &t) in bins.iter().zip(&tokens) {
            prop_assert!(b < world * micro);
            used[b] += t;
        }
        prop_assert!(used.iter().all(|&u| u <= budget), "{:?} over {}", used, budget);
        // Deterministic.
        prop_assert_eq!(lpt(&weights, &tokens, world, budget, min_micro).unwrap(), (micro, bins));
    }
}

/// Random rollouts: GRPO groups (one prompt, several answers, two turns)
/// and lone rollouts, from a small vocabulary.
fn rollouts() -> impl Strategy<Value = Vec<Rollout>> {
    let group = (
        prop::collection::vec(1u32..6, 1..12),
        prop::collection::vec(
            (
                prop::collection::vec(1u32..6, 1..6),
                prop::collection::vec(1u32..6, 0..4),
            ),
            1..5,
        ),
    );
    prop::collection::vec(group, 1..7).prop_map(|groups| {
        let mut out = Vec::new();
        for (g, (prompt, answers)) in groups.into_iter().enumerate() {
            for (a, (first, second)) in answers.into_iter().enumerate() {
                let mut calls = vec![Call::new(prompt.clone(), first.clone())];
                if !second.is_empty() {
                    let mut ctx = prompt.clone();
                    ctx.extend(&first);
                    ctx.push(9);
                    calls.push(Call::new(ctx, second));
                }
                out.push(Rollout::new(format!("g{g}-{a}"), calls).unwrap());
            }
        }
        out
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Every rollout in exactly one pack; every pack within the budget; a
    /// group (rollouts with one first context) whole in one pack when its
    /// pack fits the budget; the packs' loss entries are those of one pack
    /// of everything; the same input gives the same packs.
    #[test]
    fn balance_places_every_rollout_once_and_keeps_groups_whole(
        rs in rollouts(),
        world in 1usize..4,
        slack in 1.0..4.0f64,
        share in any::<bool>(),
        replicated in any::<bool>(),
        objective in 0usize..3,
    ) {
        let layout = if replicated { Layout::Replicated } else { Layout::Trie };
        let objective = [Objective::Flops(SMALL), Objective::Tokens, Objective::TokensSquared][objective];
        let single = |r: &Rollout| {
            batch(std::slice::from_ref(r), usize::MAX, share, layout).unwrap()[0].pack.len()
        };
        let longest = rs.iter().map(single).max().unwrap();
        let budget = (longest as f64 * slack) as usize;
        let b = balance(&rs, world, budget, share, layout, objective).unwrap();
        prop_assert_eq!(b.bins.len(), world * b.micro_steps);
        let mut seen = vec![0usize; rs.len()];
        for bin in b.bins.iter().flatten() {
            prop_assert!(bin.pack.len() <= budget);
            for &i in &bin.rollouts {
                seen[i as usize] += 1;
            }
        }
        prop_assert!(seen.iter().all(|&n| n == 1), "{:?}", seen);
        // Units: each in its bin, and a group is one unit when it fits.
        for u in &b.units {
            let bin = b.bins[u.bin].as_ref().unwrap();
            prop_assert!(u.rollouts.iter().all(|i| bin.rollouts.contains(i)));
            prop_assert!(u.tokens <= budget);
        }
        let mut groups: BTreeMap<Vec<u32>, Vec<u32>> = BTreeMap::new();
        for (i, r) in rs.iter().enumerate() {
            groups.entry(r.calls()[0].context.clone()).or_default().push(i as u32);
        }
        for members in groups.values() {
            let subset: Vec<Rollout> = members.iter().map(|&i| rs[i as usize].clone()).collect();
            let whole = batch(&subset, usize::MAX, share, layout).unwrap()[0].pack.len();
            if share && whole <= budget {
                let holders: BTreeSet<usize> = b.units.iter()
                    .filter(|u| u.rollouts.iter().any(|i| members.contains(i)))
                    .map(|u| u.bin)
                    .collect();
                prop_assert_eq!(holders.len(), 1, "group {:?} split", members);
            }
        }
        let mut keys: Vec<_> = b.bins.iter().flatten()
            .flat_map(|bin| bin.pack.loss.iter().map(|e| e.key()))
            .collect();
        keys.sort_unstable();
        let all = batch(&rs, usize::MAX, share, layout).unwrap();
        let mut want: Vec<_> = all[0].pack.loss.iter().map(|e| e.key()).collect();
        want.sort_unstable();
        prop_assert_eq!(keys, want);
        // Deterministic (Debug: the NaN rewards compare unequal under PartialEq).
        let again = balance(&rs, world, budget, share, layout, objective).unwrap();
        prop_assert_eq!(format!("{:?}", again), format!("{:?}", b));
    }
}

#[test]
fn balance_is_deterministic_and_weighs_by_exact_flops() {
    // Three GRPO groups of different sizes and a lone long rollout.
    let mut rs = Vec::new();
    for (g, (prompt, n)) in [(12usize, 4usize), (3, 2), (20, 3)].into_iter().enumerate() {
        let p: Vec<u32> = (0..prompt as u32)
            .map(|t| 10 + g as u32 * 100 + t)
            .collect();
        for a in 0..n {
            rs.push(
                Rollout::new(
                    format!("g{g}-{a}"),
                    vec![Call::new(p.clone(), vec![1 + a as u32; 3 + a])],
                )
                .unwrap(),
            );
        }
    }
    rs.push(Rollout::new("long", vec![Call::new((500..540).collect(), vec![7; 5])]).unwrap());
    let first = balance(&rs, 2, 64, true, Layout::Trie, Objective::Flops(SMALL)).unwrap();
    for _ in 0..3 {
        // Debug, not PartialEq: the NaN rewards compare unequal.
        let again = balance(&rs, 2, 64, true, Layout::Trie, Objective::Flops(SMALL)).unwrap();
        assert_eq!(format!("{again:?}"), format!("{first:?}"));
    }
    // Each unit's weight is its pack's cost; the units are the groups.
    assert_eq!(first.units.len(), 4);
    for u in &first.units {
        let subset: Vec<Rollout> = u.rollouts.iter().map(|&i| rs[i as usize].clone()).collect();
        let p = &batch(&subset, usize::MAX, true, Layout::Trie).unwrap()[0].pack;
        assert_eq!(u.weight, SMALL.pack_cost(p).unwrap().total);
        assert_eq!(u.tokens, p.len());
    }
    assert_eq!(first.units[0].rollouts, vec![0, 1, 2, 3]);
    // LPT: the heaviest unit alone on one rank of the first micro-step.
    let heaviest = first
        .units
        .iter()
        .max_by(|a, b| a.weight.total_cmp(&b.weight))
        .unwrap();
    assert_eq!(heaviest.bin, 0);
    // A rollout over the budget is named; an empty input and a zero world
    // are refused.
    let e = balance(&rs, 2, 30, true, Layout::Trie, Objective::Tokens)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("id \"long\"") && e.contains("budget of 30"),
        "{e}"
    );
    assert!(balance(&[], 2, 30, true, Layout::Trie, Objective::Tokens).is_err());
    assert!(balance(&rs, 0, 30, true, Layout::Trie, Objective::Tokens).is_err());
    let bad = ModelCost {
        kv_heads: 3,
        ..SMALL
    };
    assert!(balance(&rs, 2, 64, true, Layout::Trie, Objective::Flops(bad)).is_err());
}

#[test]
fn the_pack_schema_is_what_the_writers_write() {
    let mut c0 = Call::new(vec![1, 2, 3], vec![4, 5]);
    c0.logprobs = Some(vec![-0.5, -1.0]);
    let mut c1 = Call::new(vec![1, 2, 3, 4, 5, 6], vec![7]);
    c1.logprobs = Some(vec![-0.25]);
    let r0 = Rollout::new("a", vec![c0.clone(), c1])
        .unwrap()
        .with_group("g");
    let mut c2 = Call::new(vec![1, 2, 9], vec![8]);
    c2.logprobs = Some(vec![-2.0]);
    let r1 = Rollout::new("b", vec![c2]).unwrap();
    let rs = vec![r0, r1];
    let b = &batch(&rs, usize::MAX, true, Layout::Trie).unwrap()[0];
    let written: Vec<_> = pack_tensors(&b.pack, b.sdcc.as_deref(), &[0, 2])
        .unwrap()
        .into_iter()
        .chain(rollout_tensors(&b.fields))
        .chain(loss_field_tensors(&b.loss_fields))
        .collect();
    let names: BTreeSet<&str> = written.iter().map(|(n, _)| n.as_str()).collect();
    let schema: BTreeSet<&str> = PACK_SCHEMA.iter().map(|t| t.name).collect();
    assert_eq!(
        names, schema,
        "every tensor written is in the schema and back"
    );
    assert_eq!(PACK_SCHEMA.len(), schema.len(), "no name twice");
    for (name, t) in &written {
        let spec = PACK_SCHEMA.iter().find(|s| s.name == name).unwrap();
        assert_eq!(t.dtype, spec.dtype, "{name}");
        let len = match spec.axis {
            Axis::Tokens => b.pack.len(),
            Axis::Targets => b.pack.loss.len(),
            Axis::Pairs => b.sdcc.as_ref().unwrap().len(),
            Axis::Rollouts => b.rollouts.len(),
        };
        assert_eq!(t.shape, vec![len], "{name}");
    }
}

/// Weights that are not finite and non-negative, and rank counts out of
/// range, are errors naming them, never a silent placement.
#[test]
fn lpt_refuses_bad_weights_and_rank_counts() {
    let tokens = [3usize, 4, 5];
    for bad in [f64::NAN, -1.0, f64::INFINITY] {
        let e = lpt(&[1.0, bad, 2.0], &tokens, 2, 10, 1)
            .unwrap_err()
            .to_string();
        assert!(e.contains("weights[1]"), "{e}");
    }
    for world in [0, MAX_RANKS + 1] {
        let e = lpt(&[1.0, 1.0, 1.0], &tokens, world, 10, 1)
            .unwrap_err()
            .to_string();
        assert!(e.contains("world_size"), "{e}");
    }
    // The control: the same call with good weights places every unit.
    let (micro, bins) = lpt(&[1.0, 0.0, 2.0], &tokens, 2, 10, 1).unwrap();
    assert_eq!((micro, bins.len()), (1, 3));
}
