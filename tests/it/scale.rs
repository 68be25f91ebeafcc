//! No quadratic cliffs (issue 17): inputs that used to take minutes stay
//! near-linear. Bounds are generous; the code before the fix needed 141 s
//! for the alignment of 120k repeated tokens and 21 s for the
//! prefix-sharing batch below. Times are the test thread's CPU time
//! ([`ThreadClock`]), so a loaded machine or the other tests of this binary
//! do not fail them.

use crate::common::ThreadClock;

use treeattn::pack::{batch, Layout};
use treeattn::rollout::{Call, Rollout};
use treeattn::tree::RolloutStats;

#[test]
fn a_million_repeated_tokens_align_in_seconds() {
    let n = 1_000_000;
    // Call 1 re-renders call 0's million copies of one token after a marker:
    // a junction whose alignment used to be O(n²).
    let r = Rollout::new(
        "rep",
        vec![
            Call::new(vec![7; n], vec![7]),
            Call::new([1].into_iter().chain(vec![7; n + 1]).collect(), vec![2]),
        ],
    )
    .unwrap();
    let t = ThreadClock::start();
    let s = RolloutStats::of(&r).unwrap();
    let secs = t.secs();
    eprintln!("alignment of {n} repeated tokens: {secs:.2} s");
    assert_eq!(s.junctions, 1);
    assert_eq!(
        s.junction_list[0].kept,
        n + 1,
        "every copy is kept, in order"
    );
    assert!(secs < 20.0, "{secs:.1} s for a million repeated tokens");
}

#[test]
fn prefix_sharing_batch_is_near_linear() {
    let mut s = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = |m: u64| {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s % m) as u32
    };
    // 5,000 small rollouts, at most two per pack of 25 tokens.
    let rs: Vec<Rollout> = (0..5000)
        .map(|i| {
            let ctx: Vec<u32> = (0..4 + next(8)).map(|_| next(1000)).collect();
            let comp: Vec<u32> = (0..1 + next(4)).map(|_| next(1000)).collect();
            Rollout::new(format!("r{i}"), vec![Call::new(ctx, comp)]).unwrap()
        })
        .collect();
    let t = ThreadClock::start();
    let plain = batch(&rs, 25, false, Layout::Trie).unwrap();
    let t_plain = t.secs();
    let t = ThreadClock::start();
    let shared = batch(&rs, 25, true, Layout::Trie).unwrap();
    let t_shared = t.secs();
    eprintln!(
        "5,000 rollouts at budget 25: {t_plain:.3} s plain, {t_shared:.3} s sharing prefixes"
    );
    assert!(plain.len() > 2000 && shared.len() <= plain.len());
    assert!(
        t_shared < 5.0 + 4.0 * t_plain,
        "share-prefixes {t_shared:.2} s against {t_plain:.2} s without"
    );
}

#[test]
fn prefix_sharing_batch_with_a_common_system_prompt_is_near_linear() {
    let mut s = 0x2545_f491_4f6c_dd1du64;
    let mut next = |m: u64| {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s % m) as u32
    };
    // Every rollout starts with the same 200-token system prompt, so every
    // pack shares a first token (and 200 nodes) with every rollout.
    let system: Vec<u32> = (0..200).map(|_| next(50_000)).collect();
    let rs: Vec<Rollout> = (0..5000)
        .map(|i| {
            let mut ctx = system.clone();
            ctx.extend((0..20 + next(40)).map(|_| next(50_000)));
            let comp: Vec<u32> = (0..1 + next(20)).map(|_| next(50_000)).collect();
            Rollout::new(format!("s{i}"), vec![Call::new(ctx, comp)]).unwrap()
        })
        .collect();
    let t = ThreadClock::start();
    let shared = batch(&rs, 1000, true, Layout::Trie).unwrap();
    let secs = t.secs();
    eprintln!(
        "5,000 rollouts with one system prompt, budget 1000: {secs:.3} s, {} packs",
        shared.len()
    );
    // The prompt is stored once per pack: about 13 responses per pack.
    assert!(shared.len() < 5000 / 10, "{} packs", shared.len());
    assert!(secs < 10.0, "{secs:.1} s");
}
