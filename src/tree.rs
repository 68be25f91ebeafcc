//! The conditioning tree: the token trie of every call's `context ++
//! completion` (DESIGN §3), laid out in pre-order.
//!
//! A trie path from the root to a node is that token's exact live prefix, so
//! tokens whose live prefixes agree are one node (computed once) and a token
//! re-rendered after an edit gets its own node. Nodes are numbered in
//! pre-order (depth-first, parent before children, children in first-seen
//! order), which makes every subtree a contiguous range `[i, end[i])` — the
//! `kv_end` of the interval mask — and the depth of a node its position id.
//!
//! A [`Tree`] may hold several rollouts (a batch). Without prefix sharing each
//! rollout is its own subtree of the (virtual) root; with sharing, rollouts
//! whose calls start with the same tokens (a GRPO group's prompt) share those
//! nodes.
//!
//! For black-box calls the tree also records which sampled tokens survive into
//! the final call's sequence (the *rightmost branch*, the compressed stream):
//! at each junction the new context is aligned to the previous call's full
//! sequence by [`align_blocks`], and aligned tokens inherit the identity
//! (call, offset) of the sampled token they align to.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use crate::rollout::Rollout;
use crate::{Error, Result};

/// Minimum length of a block aligned across a junction by [`align_blocks`].
/// Two tokens: single-token matches (a marker, a common word) are too often
/// coincidences, while a re-rendered summary or turn is always longer. The
/// worked example of DESIGN §4 keeps two-token blocks (`50 51`, `40 32`).
pub const MIN_BLOCK: usize = 2;

/// Parent of a top-level node.
const NO_PARENT: u32 = u32::MAX;

/// Seed pairs of one `min_block`-gram: while `count_a(g) · count_b(g)` is at
/// most this, every pair of its occurrences seeds a candidate run (the exact
/// greedy). Above it the gram is repetitive and its occurrences are paired by
/// rank (the r-th in `b` with the r-th in `a`, as patience diff pairs
/// anchors), which keeps one diagonal of a repeated stretch instead of all of
/// them.
const ALIGN_PAIR_CAP: usize = 4096;

/// Length of the second, longer seed tried for a frequent gram.
const LONG_SEED: usize = 16;

/// Aligns `b` (a new context) to `a` (the previous call's sequence) by a
/// token-level diff that allows moved blocks: repeatedly take the longest run
/// of equal consecutive tokens `a[i..i+n] == b[j..j+n]` whose tokens are all
/// still unmatched on both sides, with `n >= min_block` (clamped to at least
/// 1); ties go to the smallest `j`, then the smallest `i`. Each token is
/// matched at most once. Returns, for each position of `b`, the position of
/// `a` it is aligned to.
///
/// Cost: near-linear in `|a| + |b|` on any input. Candidate runs are found
/// from `min_block`-gram seeds; a gram that is frequent on both sides is
/// looked up again as a 16-gram, and if that is frequent too (a stream
/// repeating one token or a short pattern) its occurrences are paired by
/// rank instead of pair by pair (see `ALIGN_PAIR_CAP`), and the whole search is bounded by
/// a work budget proportional to `|a| + |b|`. Last, every gap left between
/// aligned blocks (and before the first and after the last one) whose tokens
/// are unmatched on both sides is aligned by its common prefix and suffix
/// (of at least `min_block` tokens each) — the patience-diff fallback that
/// keeps a repeated stretch aligned in order. On input where no gram is that
/// frequent and the budget is not reached (every rollout of the tests, and
/// non-repetitive text of any length) the result is exactly the greedy one
/// described above, which leaves no such gap to fill.
///
/// With blocks of two tokens, a common bigram of real text can align an
/// evicted token to an unrelated one; that only marks the token *present*
/// on the rightmost branch (SDCC pairs, Naive-Compressed), never the exact
/// layouts, which depend on the trie alone.
pub fn align_blocks(a: &[u32], b: &[u32], min_block: usize) -> Vec<Option<u32>> {
    align_counted(a, b, min_block).0
}

/// [`align_blocks`] and the number of elementary steps it took (token
/// comparisons, seed look-ups, heap operations), for the complexity tests.
fn align_counted(a: &[u32], b: &[u32], min_block: usize) -> (Vec<Option<u32>>, u64) {
    let k = min_block.max(1);
    let mut out = vec![None; b.len()];
    if a.len() < k || b.len() < k {
        return (out, 0);
    }
    let mut steps = (a.len() + b.len()) as u64;
    // Work allowed to each of the two phases (seeding, greedy selection).
    let phase_budget = 16 * (a.len() + b.len()) as u64 + 50_000;
    let mut budget = steps + phase_budget;
    let mut used_a = vec![false; a.len()];

    // Occurrences of each gram in a, and per gram of b its count in b.
    let mut grams: HashMap<&[u32], Vec<u32>> = HashMap::new();
    for i in 0..=a.len() - k {
        grams.entry(&a[i..i + k]).or_default().push(i as u32);
    }
    let mut count_b: HashMap<&[u32], u32> = HashMap::new();
    for j in 0..=b.len() - k {
        if grams.contains_key(&b[j..j + k]) {
            *count_b.entry(&b[j..j + k]).or_default() += 1;
        }
    }
    // A gram frequent on both sides is looked up again as a LONG_SEED-gram
    // (distinct in a low-entropy stream that is not one repeated pattern),
    // and only when that is frequent too are its occurrences paired by rank.
    let frequent =
        |g: &[u32]| grams[g].len() * count_b.get(g).copied().unwrap_or(0) as usize > ALIGN_PAIR_CAP;
    let long = LONG_SEED.max(k);
    let mut long_a: HashMap<&[u32], Vec<u32>> = HashMap::new();
    let mut long_count_b: HashMap<&[u32], u32> = HashMap::new();
    if long > k && a.len() >= long && b.len() >= long {
        for i in 0..=a.len() - long {
            if frequent(&a[i..i + k]) {
                long_a.entry(&a[i..i + long]).or_default().push(i as u32);
            }
        }
        for j in 0..=b.len() - long {
            if long_a.contains_key(&b[j..j + long]) {
                *long_count_b.entry(&b[j..j + long]).or_default() += 1;
            }
        }
        steps += (a.len() + b.len()) as u64;
    }
    // Seeds in increasing j; each maximal run is found once, from its first
    // seed, by extending left and right (`covered[d]`: end in b of the last
    // run found on diagonal d = i - j).
    let mut rank_b: HashMap<&[u32], u32> = HashMap::new();
    let mut covered: HashMap<i64, usize> = HashMap::new();
    // (length, Reverse(j), Reverse(i)): the max-heap pops the longest run,
    // earliest in b, then earliest in a.
    let mut heap = BinaryHeap::new();
    'seeds: for j in 0..=b.len() - k {
        let g = &b[j..j + k];
        let Some(starts) = grams.get(g) else { continue };
        let rank = rank_b.entry(g).or_default();
        let r = *rank as usize;
        *rank += 1;
        let lg = b.get(j..j + long).filter(|_| long > k);
        let pick: &[u32] = if !frequent(g) {
            starts
        } else if let Some(ls) = lg.and_then(|lg| {
            long_a
                .get(lg)
                .filter(|ls| ls.len() * long_count_b[lg] as usize <= ALIGN_PAIR_CAP)
        }) {
            ls
        } else if r < starts.len() {
            &starts[r..r + 1]
        } else {
            &[]
        };
        for &i in pick {
            steps += 1;
            let (i, d) = (i as usize, i as i64 - j as i64);
            if covered.get(&d).is_some_and(|&e| e > j) {
                continue;
            }
            let (mut i0, mut j0) = (i, j);
            while i0 > 0 && j0 > 0 && a[i0 - 1] == b[j0 - 1] {
                i0 -= 1;
                j0 -= 1;
                steps += 1;
            }
            let mut n = j + k - j0;
            while i0 + n < a.len() && j0 + n < b.len() && a[i0 + n] == b[j0 + n] {
                n += 1;
                steps += 1;
            }
            covered.insert(d, j0 + n);
            heap.push((n, Reverse(j0), Reverse(i0)));
            if steps > budget {
                // Keep the runs found so far; the gap pass below aligns
                // the rest in order.
                break 'seeds;
            }
        }
    }
    budget = steps + phase_budget;
    while let Some((n, Reverse(j), Reverse(i))) = heap.pop() {
        steps += n as u64 + 1;
        if steps > budget {
            break;
        }
        // Split the run into its still-unmatched segments.
        let mut segs = Vec::new();
        let mut t = 0;
        while t < n {
            if used_a[i + t] || out[j + t].is_some() {
                t += 1;
                continue;
            }
            let s = t;
            while t < n && !used_a[i + t] && out[j + t].is_none() {
                t += 1;
            }
            segs.push((s, t - s));
        }
        if segs.len() == 1 && segs[0] == (0, n) {
            for t in 0..n {
                used_a[i + t] = true;
                out[j + t] = Some((i + t) as u32);
            }
        } else {
            for (s, len) in segs {
                if len >= k {
                    heap.push((len, Reverse(j + s), Reverse(i + s)));
                }
            }
        }
    }
    steps += fill_gaps(a, b, k, &mut out, &mut used_a);
    (out, steps)
}

/// Aligns, inside every gap of `b` between two aligned positions (or a
/// sequence end) whose `a` side between the same two positions is entirely
/// unmatched, the common prefix and the common suffix of the two gaps when
/// they are at least `k` tokens long. Linear: the gaps are disjoint on both
/// sides. Returns the steps taken.
fn fill_gaps(a: &[u32], b: &[u32], k: usize, out: &mut [Option<u32>], used_a: &mut [bool]) -> u64 {
    // used_before[i]: matched positions of a before i.
    let mut used_before = vec![0u32; a.len() + 1];
    for i in 0..a.len() {
        used_before[i + 1] = used_before[i] + used_a[i] as u32;
    }
    let mut steps = 0u64;
    let mut j = 0;
    while j < b.len() {
        if out[j].is_some() {
            j += 1;
            continue;
        }
        let j1 = j;
        while j < b.len() && out[j].is_none() {
            j += 1;
        }
        let j2 = j;
        // The a range between the neighbouring aligned positions.
        let i1 = if j1 == 0 {
            0
        } else {
            out[j1 - 1].expect("aligned left neighbour") as usize + 1
        };
        let i2 = if j2 == b.len() {
            a.len()
        } else {
            out[j2].expect("aligned right neighbour") as usize
        };
        if i1 >= i2 || used_before[i2] != used_before[i1] {
            continue;
        }
        let (ga, gb) = (&a[i1..i2], &b[j1..j2]);
        let pre = ga.iter().zip(gb).take_while(|(x, y)| x == y).count();
        let pre = if pre >= k { pre } else { 0 };
        let room = (ga.len() - pre).min(gb.len() - pre);
        let suf = ga[pre..]
            .iter()
            .rev()
            .zip(gb[pre..].iter().rev())
            .take(room)
            .take_while(|(x, y)| x == y)
            .count();
        let suf = if suf >= k { suf } else { 0 };
        steps += (pre + suf + 1) as u64;
        for t in 0..pre {
            out[j1 + t] = Some((i1 + t) as u32);
            used_a[i1 + t] = true;
        }
        for t in 1..=suf {
            out[j2 - t] = Some((i2 - t) as u32);
            used_a[i2 - t] = true;
        }
    }
    steps
}

/// One call as stored in the tree.
#[derive(Clone, Debug)]
pub(crate) struct TreeCall {
    pub ctx_len: u32,
    /// Pre-order node of every position of `context ++ completion`.
    pub nodes: Vec<u32>,
    pub logprobs: Option<Vec<f32>>,
}

/// A sampled token that is present on the rightmost branch (the final call's
/// sequence) at position `pos >= 1`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Present {
    pub pos: u32,
    pub call: u32,
    pub offset: u32,
}

/// What one junction did to the previous call's sequence.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Junction {
    /// The call whose context does not extend the previous call's sequence.
    pub call: usize,
    /// Length of the longest common prefix of the new context and the
    /// previous sequence: where the new branch forks off.
    pub fork_depth: usize,
    /// Length of the previous call's `context ++ completion`.
    pub prev_len: usize,
    /// Tokens of the previous sequence aligned into the new context (kept,
    /// moved or re-rendered).
    pub kept: usize,
    /// `prev_len - kept`: tokens the edit removed from the live view.
    pub evicted: usize,
}

/// One rollout inside a tree.
#[derive(Clone, Debug)]
pub(crate) struct TreeRollout {
    pub index: u32,
    pub calls: Vec<TreeCall>,
    pub junctions: Vec<Junction>,
    /// Present targets in order of their position on the rightmost branch.
    pub present: Vec<Present>,
}

impl TreeRollout {
    /// The trie row that predicts completion token `offset` of `call`.
    pub fn loss_row(&self, call: usize, offset: usize) -> u32 {
        let c = &self.calls[call];
        c.nodes[c.ctx_len as usize + offset - 1]
    }

    /// The segment of `call`: the number of junctions at or before it
    /// (segment 0 starts at the first call; each junction starts the next).
    pub fn segment_of(&self, call: usize) -> u32 {
        self.junctions.partition_point(|j| j.call <= call) as u32
    }
}

/// A root-to-leaf path of the trie.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Branch {
    /// Pre-order index of the leaf.
    pub leaf: u32,
    /// Number of tokens on the path (leaf depth + 1).
    pub len: u32,
}

/// The conditioning tree of one or more rollouts.
#[derive(Clone, Debug)]
pub struct Tree {
    tokens: Vec<u32>,
    depth: Vec<u32>,
    end: Vec<u32>,
    parent: Vec<u32>,
    pub(crate) rollouts: Vec<TreeRollout>,
}

/// Trie under construction, nodes in insertion order.
#[derive(Default)]
pub(crate) struct TrieBuilder {
    token: Vec<u32>,
    children: Vec<Vec<u32>>,
    roots: Vec<u32>,
    child_of: HashMap<(u32, u32), u32>,
    root_of: HashMap<(u32, u32), u32>,
}

impl TrieBuilder {
    fn child(&mut self, group: u32, parent: u32, token: u32) -> u32 {
        let key = (if parent == NO_PARENT { group } else { parent }, token);
        let map = if parent == NO_PARENT {
            &mut self.root_of
        } else {
            &mut self.child_of
        };
        if let Some(&n) = map.get(&key) {
            return n;
        }
        let n = self.token.len() as u32;
        map.insert(key, n);
        self.token.push(token);
        self.children.push(Vec::new());
        if parent == NO_PARENT {
            self.roots.push(n);
        } else {
            self.children[parent as usize].push(n);
        }
        n
    }

    fn lookup(&self, group: u32, parent: u32, token: u32) -> Option<u32> {
        if parent == NO_PARENT {
            self.root_of.get(&(group, token)).copied()
        } else {
            self.child_of.get(&(parent, token)).copied()
        }
    }

    /// Number of nodes.
    pub fn len(&self) -> usize {
        self.token.len()
    }

    /// Inserts every call of `r` under root group `group`; returns each
    /// call's path in insertion ids.
    fn insert(&mut self, group: u32, r: &Rollout) -> Vec<Vec<u32>> {
        r.calls()
            .iter()
            .map(|c| {
                let mut parent = NO_PARENT;
                (0..c.sequence_len())
                    .map(|i| {
                        parent = self.child(group, parent, c.token_at(i));
                        parent
                    })
                    .collect()
            })
            .collect()
    }

    /// How many nodes inserting `r` under `group` would add, without
    /// inserting; `None` as soon as that exceeds `limit`.
    pub fn added_by(&self, group: u32, r: &Rollout, limit: usize) -> Option<usize> {
        // Nodes off the existing trie are named (virtual parent, token) in a
        // scratch map; virtual ids start above every real id.
        let mut scratch: HashMap<(u64, u32), u64> = HashMap::new();
        let base = u32::MAX as u64 + 1;
        for c in r.calls() {
            let mut at: Option<u64> = None; // None = root
            for i in 0..c.sequence_len() {
                let t = c.token_at(i);
                let real = match at {
                    None => self.lookup(group, NO_PARENT, t),
                    Some(p) if p < base => self.lookup(group, p as u32, t),
                    Some(_) => None,
                };
                at = Some(match real {
                    Some(n) => n as u64,
                    None => {
                        let key = (at.unwrap_or(u64::MAX), t);
                        let next = base + scratch.len() as u64;
                        let id = *scratch.entry(key).or_insert(next);
                        if scratch.len() > limit {
                            return None;
                        }
                        id
                    }
                });
            }
        }
        Some(scratch.len())
    }

    /// Adds a rollout to the builder under root group `group`.
    pub fn add(&mut self, group: u32, r: &Rollout) -> Result<Vec<Vec<u32>>> {
        let paths = self.insert(group, r);
        if self.len() > (u32::MAX / 2) as usize {
            return Err(Error::Pack(format!(
                "trie of {} nodes exceeds u32 indexing",
                self.len()
            )));
        }
        Ok(paths)
    }
}

impl Tree {
    /// Builds the conditioning tree of `rollouts`, numbered `0..n` in the
    /// loss entries. With `share_prefixes`, rollouts that begin with the same
    /// tokens share those trie nodes; otherwise each rollout is its own
    /// subtree.
    pub fn build(rollouts: &[Rollout], share_prefixes: bool) -> Result<Tree> {
        let indexed: Vec<(u32, &Rollout)> = rollouts
            .iter()
            .enumerate()
            .map(|(i, r)| (i as u32, r))
            .collect();
        Tree::build_indexed(&indexed, share_prefixes)
    }

    /// Like [`Tree::build`], with the rollout index (as it appears in loss
    /// entries) given for each rollout, e.g. its line in the input file.
    pub fn build_indexed(rollouts: &[(u32, &Rollout)], share_prefixes: bool) -> Result<Tree> {
        let mut b = TrieBuilder::default();
        let mut paths = Vec::with_capacity(rollouts.len());
        for (slot, (_, r)) in rollouts.iter().enumerate() {
            let group = if share_prefixes { 0 } else { slot as u32 };
            paths.push(b.add(group, r)?);
        }
        Ok(Tree::finish(b, rollouts, paths))
    }

    fn finish(b: TrieBuilder, rollouts: &[(u32, &Rollout)], paths: Vec<Vec<Vec<u32>>>) -> Tree {
        let n = b.len();
        let mut pre = vec![0u32; n];
        let mut tokens = Vec::with_capacity(n);
        let mut depth = Vec::with_capacity(n);
        let mut parent = Vec::with_capacity(n);
        let mut end = vec![0u32; n];
        // Iterative DFS; the stack holds (insertion id, parent pre-order id, depth)
        // and is pushed in reverse so children come out in first-seen order.
        let mut stack: Vec<(u32, u32, u32)> =
            b.roots.iter().rev().map(|&r| (r, NO_PARENT, 0)).collect();
        while let Some((id, par, d)) = stack.pop() {
            let p = tokens.len() as u32;
            pre[id as usize] = p;
            tokens.push(b.token[id as usize]);
            depth.push(d);
            parent.push(par);
            for &c in b.children[id as usize].iter().rev() {
                stack.push((c, p, d + 1));
            }
        }
        // Subtree end: children come after their parent, so a backward sweep
        // sees every child's end before its parent's.
        for i in (0..n).rev() {
            end[i] = end[i].max(i as u32 + 1);
            if parent[i] != NO_PARENT {
                let p = parent[i] as usize;
                end[p] = end[p].max(end[i]);
            }
        }
        let trees = rollouts
            .iter()
            .zip(paths)
            .map(|(&(index, r), call_paths)| {
                let calls: Vec<TreeCall> = r
                    .calls()
                    .iter()
                    .zip(call_paths)
                    .map(|(c, path)| TreeCall {
                        ctx_len: c.context.len() as u32,
                        nodes: path.into_iter().map(|id| pre[id as usize]).collect(),
                        logprobs: c.logprobs.clone(),
                    })
                    .collect();
                let (junctions, present) = trace_identities(r);
                TreeRollout {
                    index,
                    calls,
                    junctions,
                    present,
                }
            })
            .collect();
        Tree {
            tokens,
            depth,
            end,
            parent,
            rollouts: trees,
        }
    }

    /// Number of trie nodes (the trie pack's length).
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// True when the tree holds no token.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Tokens in pre-order.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Depth of each node (its position id).
    pub fn depths(&self) -> &[u32] {
        &self.depth
    }

    /// End (exclusive) of each node's pre-order subtree range: `kv_end`.
    pub fn subtree_ends(&self) -> &[u32] {
        &self.end
    }

    /// Parent of node `i` in pre-order numbering (`None` for a top-level node).
    pub fn parent(&self, i: usize) -> Option<usize> {
        (self.parent[i] != NO_PARENT).then(|| self.parent[i] as usize)
    }

    /// Whether node `a` is node `q` or one of its ancestors (walks `q`'s
    /// parent chain; independent of `kv_end`).
    pub fn is_ancestor_or_self(&self, a: usize, q: usize) -> bool {
        let mut x = Some(q);
        while let Some(n) = x {
            if n == a {
                return true;
            }
            if n < a {
                return false;
            }
            x = self.parent(n);
        }
        false
    }

    /// Number of rollouts in the tree.
    pub fn rollout_count(&self) -> usize {
        self.rollouts.len()
    }

    /// The rollout index (as used in loss entries) of the `slot`-th rollout
    /// of the tree. Panics if `slot >= rollout_count()`.
    pub fn rollout_index(&self, slot: usize) -> u32 {
        self.rollouts[slot].index
    }

    /// The pre-order nodes of call `call` of the `slot`-th rollout of the
    /// tree, one per position of `context ++ completion`. Panics if `slot`
    /// or `call` is out of range.
    pub fn call_nodes(&self, slot: usize, call: usize) -> &[u32] {
        &self.rollouts[slot].calls[call].nodes
    }

    /// The leaves in pre-order, i.e. LogitTree's branches.
    pub fn branches(&self) -> Vec<Branch> {
        (0..self.len())
            .filter(|&i| self.end[i] == i as u32 + 1)
            .map(|i| Branch {
                leaf: i as u32,
                len: self.depth[i] + 1,
            })
            .collect()
    }

    /// Nodes of the path from the root to `leaf`, root first.
    pub fn path_to(&self, leaf: usize) -> Vec<u32> {
        let mut p = Vec::with_capacity(self.depth[leaf] as usize + 1);
        let mut x = Some(leaf);
        while let Some(n) = x {
            p.push(n as u32);
            x = self.parent(n);
        }
        p.reverse();
        p
    }

    /// For each node, the first leaf of its subtree in pre-order (the branch
    /// a target on that node is scored on in the per-branch layouts).
    pub(crate) fn first_leaf(&self) -> Vec<u32> {
        let n = self.len();
        let mut f = vec![0u32; n];
        for i in (0..n).rev() {
            // The first child of a non-leaf is the next node in pre-order.
            f[i] = if self.end[i] == i as u32 + 1 {
                i as u32
            } else {
                f[i + 1]
            };
        }
        f
    }
}

/// Walks a rollout's calls and follows each sampled token's identity
/// (call, offset) through the junctions; returns the junctions and the
/// targets present on the final call's sequence at positions >= 1.
fn trace_identities(r: &Rollout) -> (Vec<Junction>, Vec<Present>) {
    let calls = r.calls();
    let own = |c: usize| (0..calls[c].completion.len() as u32).map(move |j| Some((c as u32, j)));
    let mut ident: Vec<Option<(u32, u32)>> = vec![None; calls[0].context.len()];
    ident.extend(own(0));
    let mut junctions = Vec::new();
    for c in 1..calls.len() {
        let prev = &calls[c - 1];
        let cur = &calls[c];
        let mut next: Vec<Option<(u32, u32)>>;
        if r.is_junction(c) {
            let prev_seq = prev.sequence();
            let al = align_blocks(&prev_seq, &cur.context, MIN_BLOCK);
            next = al
                .iter()
                .map(|a| a.and_then(|i| ident[i as usize]))
                .collect();
            let kept = al.iter().flatten().count();
            let fork_depth = prev_seq
                .iter()
                .zip(&cur.context)
                .take_while(|(x, y)| x == y)
                .count();
            junctions.push(Junction {
                call: c,
                fork_depth,
                prev_len: prev_seq.len(),
                kept,
                evicted: prev_seq.len() - kept,
            });
        } else {
            next = ident;
            next.resize(cur.context.len(), None);
        }
        next.extend(own(c));
        ident = next;
    }
    let present = ident
        .iter()
        .enumerate()
        .skip(1)
        .filter_map(|(p, id)| {
            id.map(|(call, offset)| Present {
                pos: p as u32,
                call,
                offset,
            })
        })
        .collect();
    (junctions, present)
}

/// One branch of a rollout as [`RolloutStats`] reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BranchStats {
    /// Tokens on the branch.
    pub len: usize,
    /// Depth where the branch leaves the earlier branches (0 for the first).
    pub fork_depth: usize,
    /// Index (in this list) of the branch it forks from; `None` for the first.
    pub forks_from: Option<usize>,
    /// Calls whose sequence ends on this branch (first branch in pre-order
    /// when the call's last node lies on several).
    pub calls: Vec<usize>,
    /// Tokens evicted by the junctions that started this branch.
    pub evicted: usize,
}

/// The figures of one rollout's conditioning tree (issue 2, point 2).
#[derive(Clone, Debug, PartialEq)]
pub struct RolloutStats {
    /// The rollout's id.
    pub id: String,
    /// Number of calls.
    pub calls: usize,
    /// Junctions K: calls whose context does not extend the previous call's
    /// `context ++ completion`.
    pub junctions: usize,
    /// Root-to-leaf paths of the trie (LogitTree's sequences).
    pub branches: usize,
    /// Sampled (completion) tokens.
    pub targets: usize,
    /// Targets present on the rightmost branch (final call's sequence).
    pub present: usize,
    /// D: present targets whose prefix on the rightmost branch differs from
    /// their live prefix.
    pub diverging: usize,
    /// Trie nodes (trie pack length).
    pub trie_tokens: usize,
    /// Sum of branch lengths (branch-replicated pack length).
    pub branch_tokens: usize,
    /// `trie_tokens / branch_tokens`.
    pub dedup_ratio: f64,
    /// Each junction, in call order.
    pub junction_list: Vec<Junction>,
    /// Each branch, in pre-order.
    pub branch_list: Vec<BranchStats>,
}

impl RolloutStats {
    /// Builds the rollout's own tree and measures it.
    pub fn of(r: &Rollout) -> Result<RolloutStats> {
        let tree = Tree::build(std::slice::from_ref(r), false)?;
        let tr = &tree.rollouts[0];
        let leaves = tree.branches();
        let first_leaf = tree.first_leaf();
        let leaf_slot: HashMap<u32, usize> = leaves
            .iter()
            .enumerate()
            .map(|(s, b)| (b.leaf, s))
            .collect();
        let mut branch_list: Vec<BranchStats> = leaves
            .iter()
            .map(|b| {
                // Walk up from the leaf while still inside the subtree's first
                // branch: the fork is the deepest node whose first leaf is
                // another (earlier) branch.
                let mut x = b.leaf as usize;
                let mut forks_from = None;
                while let Some(p) = tree.parent(x) {
                    if first_leaf[p] != b.leaf {
                        forks_from = Some(leaf_slot[&first_leaf[p]]);
                        break;
                    }
                    x = p;
                }
                let fork_depth = if forks_from.is_some() {
                    tree.depth[x] as usize
                } else {
                    0
                };
                BranchStats {
                    len: b.len as usize,
                    fork_depth,
                    forks_from,
                    calls: Vec::new(),
                    evicted: 0,
                }
            })
            .collect();
        for (c, call) in tr.calls.iter().enumerate() {
            let last = *call.nodes.last().expect("validated calls are non-empty") as usize;
            branch_list[leaf_slot[&first_leaf[last]]].calls.push(c);
        }
        for j in &tr.junctions {
            let last = *tr.calls[j.call].nodes.last().expect("non-empty") as usize;
            branch_list[leaf_slot[&first_leaf[last]]].evicted += j.evicted;
        }
        let last_call = tr.calls.len() - 1;
        let final_nodes = &tr.calls[last_call].nodes;
        let diverging = tr
            .present
            .iter()
            .filter(|p| {
                final_nodes[p.pos as usize - 1] != tr.loss_row(p.call as usize, p.offset as usize)
            })
            .count();
        let branch_tokens: usize = leaves.iter().map(|b| b.len as usize).sum();
        Ok(RolloutStats {
            id: r.id().to_string(),
            calls: r.calls().len(),
            junctions: tr.junctions.len(),
            branches: leaves.len(),
            targets: r.targets(),
            present: tr.present.len(),
            diverging,
            trie_tokens: tree.len(),
            branch_tokens,
            dedup_ratio: tree.len() as f64 / branch_tokens as f64,
            junction_list: tr.junctions.clone(),
            branch_list,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn align_prefers_longest_then_earliest() {
        // b moves a's tail block to the front; the 3-block wins over the
        // 2-block prefix that overlaps it in a.
        let a = [1, 2, 3, 4, 5];
        let b = [3, 4, 5, 1, 2];
        assert_eq!(
            align_blocks(&a, &b, 2),
            vec![Some(2), Some(3), Some(4), Some(0), Some(1)]
        );
        // A single shared token is below the minimum block.
        assert_eq!(align_blocks(&[7, 8], &[8, 9], 2), vec![None, None]);
        // Each token of a is matched at most once: the repeated block in b
        // is aligned only the first time.
        assert_eq!(
            align_blocks(&[5, 6], &[5, 6, 5, 6], 2),
            vec![Some(0), Some(1), None, None]
        );
    }

    /// A small xorshift for test inputs (kept local: `gen::Rng` is moving).
    struct Xs(u64);
    impl Xs {
        /// Uniform in `lo..=hi`.
        fn range(&mut self, lo: usize, hi: usize) -> usize {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            lo + (self.0 % (hi - lo + 1) as u64) as usize
        }
    }

    /// The alignment before issue 17 (all seed pairs, unbounded): the
    /// reference the bounded one must equal on non-repetitive input.
    fn greedy_reference(a: &[u32], b: &[u32], k: usize) -> Vec<Option<u32>> {
        let mut out = vec![None; b.len()];
        if a.len() < k || b.len() < k {
            return out;
        }
        let mut grams: HashMap<&[u32], Vec<usize>> = HashMap::new();
        for i in 0..=a.len() - k {
            grams.entry(&a[i..i + k]).or_default().push(i);
        }
        let mut heap = BinaryHeap::new();
        for j in 0..=b.len() - k {
            for &i in grams.get(&b[j..j + k]).into_iter().flatten() {
                if i > 0 && j > 0 && a[i - 1] == b[j - 1] {
                    continue;
                }
                let mut n = k;
                while i + n < a.len() && j + n < b.len() && a[i + n] == b[j + n] {
                    n += 1;
                }
                heap.push((n, Reverse(j), Reverse(i)));
            }
        }
        let mut used_a = vec![false; a.len()];
        while let Some((n, Reverse(j), Reverse(i))) = heap.pop() {
            let free: Vec<bool> = (0..n)
                .map(|t| !used_a[i + t] && out[j + t].is_none())
                .collect();
            if free.iter().all(|&f| f) {
                for t in 0..n {
                    used_a[i + t] = true;
                    out[j + t] = Some((i + t) as u32);
                }
                continue;
            }
            let mut t = 0;
            while t < n {
                if !free[t] {
                    t += 1;
                    continue;
                }
                let s = t;
                while t < n && free[t] {
                    t += 1;
                }
                if t - s >= k {
                    heap.push((t - s, Reverse(j + s), Reverse(i + s)));
                }
            }
        }
        out
    }

    #[test]
    fn bounded_alignment_equals_the_exact_greedy_on_ordinary_input() {
        let mut rng = Xs(0x9e37_79b9_7f4a_7c15);
        for case in 0..3000 {
            let vocab = [2, 3, 4, 8, 50][case % 5];
            let la = rng.range(0, 70);
            let lb = rng.range(0, 70);
            let a: Vec<u32> = (0..la).map(|_| rng.range(0, vocab - 1) as u32).collect();
            let mut b: Vec<u32> = (0..lb).map(|_| rng.range(0, vocab - 1) as u32).collect();
            if case % 3 == 0 && la > 4 {
                // An edit: a kept prefix, a quoted block, new tokens.
                let cut = rng.range(1, la - 1);
                b = a[..cut]
                    .iter()
                    .chain(&b)
                    .chain(&a[cut / 2..])
                    .copied()
                    .collect();
            }
            for k in [1, 2, 3] {
                assert_eq!(
                    align_blocks(&a, &b, k),
                    greedy_reference(&a, &b, k),
                    "a = {a:?}, b = {b:?}, k = {k}"
                );
            }
        }
    }

    #[test]
    fn alignment_work_is_linear_on_repetitive_input() {
        let n = 1_000_000;
        let x = 7u32;
        // One token repeated a million times, re-rendered between markers.
        let a = vec![x; n];
        let b: Vec<u32> = std::iter::once(1)
            .chain(std::iter::repeat_n(x, n))
            .chain([2])
            .collect();
        let (al, steps) = align_counted(&a, &b, MIN_BLOCK);
        let bound = 40 * (a.len() + b.len()) as u64 + 200_000;
        assert!(
            steps <= bound,
            "{steps} steps for 2M tokens (bound {bound})"
        );
        assert_eq!(al[0], None);
        assert_eq!(al[n + 1], None);
        assert!(
            (1..=n).all(|j| al[j] == Some(j as u32 - 1)),
            "kept in order"
        );
        // A short period, shifted, and random tokens over a tiny vocabulary:
        // every gram is frequent on both sides.
        let a: Vec<u32> = (0..300_000).map(|i| [1, 2, 3][i % 3]).collect();
        let b: Vec<u32> = a[1..].iter().chain(&a[..5]).copied().collect();
        let (al, steps) = align_counted(&a, &b, MIN_BLOCK);
        assert!(
            steps <= 40 * (a.len() + b.len()) as u64 + 200_000,
            "{steps}"
        );
        assert!(al.iter().flatten().count() >= a.len() - 1);
        let mut rng = Xs(12345);
        let a: Vec<u32> = (0..200_000).map(|_| rng.range(0, 3) as u32).collect();
        let mut b = a[50_000..].to_vec();
        b.extend_from_slice(&a[..50_000]);
        let (al, steps) = align_counted(&a, &b, MIN_BLOCK);
        assert!(
            steps <= 40 * (a.len() + b.len()) as u64 + 200_000,
            "{steps}"
        );
        // The two moved halves are long unique-enough runs: found whole.
        assert!(al.iter().flatten().count() >= a.len() - 64);
    }

    #[test]
    fn overlapping_runs_are_trimmed_not_dropped() {
        // Two runs of length 4 tie; the earlier in b wins, and the other,
        // [3 4 5 6] at a=2, loses its first two tokens and is kept as [5 6].
        let a = [1, 2, 3, 4, 5, 6];
        let b = [1, 2, 3, 4, 3, 4, 5, 6];
        let want = vec![
            Some(0),
            Some(1),
            Some(2),
            Some(3),
            None,
            None,
            Some(4),
            Some(5),
        ];
        assert_eq!(align_blocks(&a, &b, 2), want);
    }
}
