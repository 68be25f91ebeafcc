//! `treeattn inspect`: the figures of each rollout's conditioning tree and a
//! terminal drawing of it.

use std::fmt::Write as _;
use treeattn::rollout::Rollout;
use treeattn::tree::{RolloutStats, Tree};

use treeattn::Result;

use clap::Args;

use crate::args::{emit, plural, read_rollouts};

/// Per rollout: calls, junctions K, branches, targets, diverging targets D,
/// evictions, dedup ratio, and a drawing of the conditioning tree.
#[derive(Args, Debug)]
#[command(long_about = "\
For each rollout: calls, junctions K (calls whose context does not extend the
previous call's sequence), branches (root-to-leaf paths of the trie), targets
(sampled tokens), diverging targets D (targets present on the final call's
sequence whose prefix there differs from their live prefix), tokens evicted
at each junction, trie tokens, summed branch lengths and the dedup ratio
(trie / branches). Then the tree: one bar per branch, `░` for the prefix it
shares with the branch it forks from, `█` for its own tokens, and a line per
junction. The file totals compare separate tries with one trie whose rollouts
share identical prefixes (a GRPO group's prompt).")]
pub struct InspectArgs {
    /// Rollouts, one JSON object per line.
    #[arg(value_name = "FILE.jsonl")]
    file: String,
}

/// Width of the longest branch's bar.
const BAR: usize = 48;

pub fn run(a: InspectArgs) -> Result<()> {
    let path = a.file;
    let rollouts = read_rollouts(&path)?;
    let mut trie_total = 0;
    let mut out = String::new();
    for (i, r) in rollouts.iter().enumerate() {
        let s = RolloutStats::of(r)?;
        trie_total += s.trie_tokens;
        draw_rollout(&mut out, i, r, &s);
    }
    let shared = Tree::build(&rollouts, true)?.len();
    let _ = writeln!(
        out,
        "{path}: {}, {}, {}; trie tokens {} separately, {} with shared prefixes",
        plural(rollouts.len(), "rollout"),
        plural(
            rollouts.iter().map(|r| r.calls().len()).sum::<usize>(),
            "call"
        ),
        plural(
            rollouts.iter().map(Rollout::targets).sum::<usize>(),
            "target"
        ),
        trie_total,
        shared
    );
    emit(&out)
}

fn draw_rollout(out: &mut String, index: usize, r: &Rollout, s: &RolloutStats) {
    // Writing to a String cannot fail.
    let _ = writeln!(
        out,
        "rollout {index} {:?}: {}, {} (sampled tokens)",
        s.id,
        plural(s.calls, "call"),
        plural(s.targets, "target")
    );
    let _ = writeln!(
        out,
        "  junctions K = {}, branches {}, diverging targets D = {} of {} present on the rightmost branch",
        s.junctions, s.branches, s.diverging, s.present
    );
    let _ = writeln!(
        out,
        "  trie {} tokens, branches {} tokens, dedup ratio {:.3}; longest call sequence {}",
        s.trie_tokens,
        s.branch_tokens,
        s.dedup_ratio,
        r.calls()
            .iter()
            .map(|c| c.sequence_len())
            .max()
            .unwrap_or(0)
    );
    let longest = s
        .branch_list
        .iter()
        .map(|b| b.len)
        .max()
        .unwrap_or(1)
        .max(1);
    let cols = |n: usize| (n * BAR).div_ceil(longest);
    for (b, br) in s.branch_list.iter().enumerate() {
        let shared = cols(br.fork_depth);
        let own = cols(br.len) - shared;
        let bar = format!("{}{}", "░".repeat(shared), "█".repeat(own));
        let pad = " ".repeat(BAR - shared - own);
        let fork = match br.forks_from {
            Some(p) => format!(" forks from b{p} at depth {}", br.fork_depth),
            None => String::new(),
        };
        let _ = writeln!(
            out,
            "  {bar}{pad} b{b}: {} tok (+{} own){fork}; calls {}",
            br.len,
            br.len - br.fork_depth,
            ranges(&br.calls)
        );
    }
    for j in &s.junction_list {
        let _ = writeln!(
        out,
            "    junction at call {}: forks at depth {}, kept {} of {} tokens of call {}'s sequence, evicted {}",
            j.call,
            j.fork_depth,
            j.kept,
            j.prev_len,
            j.call - 1,
            j.evicted
        );
    }
}

/// `[0, 1, 2, 5]` -> `0-2,5`.
fn ranges(xs: &[usize]) -> String {
    if xs.is_empty() {
        return "none".into();
    }
    let mut out = Vec::new();
    let mut i = 0;
    while i < xs.len() {
        let mut j = i;
        while j + 1 < xs.len() && xs[j + 1] == xs[j] + 1 {
            j += 1;
        }
        out.push(if j == i {
            xs[i].to_string()
        } else {
            format!("{}-{}", xs[i], xs[j])
        });
        i = j + 1;
    }
    out.join(",")
}
