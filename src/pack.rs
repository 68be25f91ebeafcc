//! Packs: the conditioning tree serialized for one forward pass (DESIGN §4).
//!
//! Every layout is the same plain struct [`Pack`] of flat vectors: tokens,
//! position ids, the interval mask `kv_end` (query `q` sees key `k` iff
//! `k <= q < kv_end[k]`) and explicit loss entries. Loss targets are not
//! "row i predicts token i+1": the first token of a child node is predicted by
//! the last row of its parent, and one row may predict several labels, so a
//! pack lists `(row, label, weight)` per sampled token.
//!
//! Layouts built from a [`Tree`]:
//!
//! | method | layout | exact |
//! |---|---|---|
//! | [`Tree::trie_pack`] | trie in pre-order, `kv_end` = subtree end, position = depth | yes |
//! | [`Tree::replicated_pack`] | branches concatenated, `kv_end` = end of branch (the paper's 4D layout) | yes |
//! | [`Tree::logittree_packs`] | one causal pack per branch (K+1 passes) | yes |
//! | [`Tree::naive_full_pack`] | trie pre-order tokens, plain causal mask, contiguous positions | no |
//! | [`Tree::naive_compressed_pack`] | the final call's sequence alone | no |
//!
//! **Loss entry order**: in every layout the entries are sorted by
//! `(rollout, call, offset)`; [`Pack::loss_index`] finds an entry by that key.
//! The exact layouts hold one entry per sampled completion token (a completion
//! token that later reappears as context of an extending call is the same
//! trie node and is not scored again; two calls that sampled the same token at
//! the same node each keep their own entry). In the per-branch layouts a
//! target is scored on the first branch (in pre-order) through its node; every
//! branch through a node gives it the same prefix. Naive-Compressed holds
//! only the targets present on the final call's sequence (see [`crate::tree`])
//! at a position >= 1, scored there.

use std::collections::{BTreeSet, HashMap};

use crate::cost::{visible_pairs, ModelCost, PackCost};
use crate::mask::PackMask;
use crate::rollout::Rollout;
use crate::tree::{Tree, TrieBuilder};
use crate::{Error, Result};

/// One scored target: row `row`'s logits predict `label`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LossEntry {
    /// Packed row whose logits predict the label.
    pub row: u32,
    /// The sampled token.
    pub label: u32,
    /// Loss weight (1.0 for every sampled token).
    pub weight: f32,
    /// Index of the rollout (as given to the tree / batch).
    pub rollout: u32,
    /// Call index within its rollout.
    pub call: u32,
    /// Offset within the call's completion.
    pub offset: u32,
    /// Segment of the call within its rollout: segment 0 starts at the
    /// first call, and every junction call (a context that does not extend
    /// the previous call's sequence: a compaction, an eviction) starts the
    /// next one. Non-decreasing in generation order; the RL advantages of
    /// [`crate::rl`] read it.
    pub segment: u32,
    /// The rollout policy's log-prob of the label, when the input had it.
    pub logprob: Option<f32>,
}

impl LossEntry {
    /// The canonical sort key `(rollout, call, offset)`.
    pub fn key(&self) -> (u32, u32, u32) {
        (self.rollout, self.call, self.offset)
    }
}

/// A packed sequence with its interval mask and loss entries.
#[derive(Clone, Debug, PartialEq)]
pub struct Pack {
    /// Token ids in pre-order (the trie layout) or branch order.
    pub tokens: Vec<u32>,
    /// Depth of each token in its call's sequence (rotary positions).
    pub position_ids: Vec<u32>,
    /// The interval mask: query `q` sees key `k` iff `k <= q < kv_end[k]`.
    pub kv_end: Vec<u32>,
    /// Sorted by `(rollout, call, offset)`.
    pub loss: Vec<LossEntry>,
}

impl ModelCost {
    /// The cost of one step on `pack` (the formulas: [`crate::cost`]).
    /// Here rather than in `cost`, so that the cost model knows nothing of
    /// packs (no import circle: `pack` uses `cost`, never the reverse).
    pub fn pack_cost(&self, pack: &Pack) -> Result<PackCost> {
        let pairs = visible_pairs(&pack.kv_end)?;
        let rows = pack.loss.iter().map(|e| e.row).collect::<BTreeSet<_>>();
        Ok(self.cost(pairs, pack.len() as u64, rows.len() as u64))
    }
}

impl Pack {
    /// The FLOPs of one training step of `model` on this pack
    /// ([`ModelCost::pack_cost`]).
    pub fn cost(&self, model: &ModelCost) -> Result<PackCost> {
        model.pack_cost(self)
    }

    /// The attention view: `kv_end` and position ids, checked (the fields
    /// are public, so a pack may have been changed since it was built).
    pub fn mask(&self) -> Result<PackMask<'_>> {
        PackMask::new(&self.kv_end, &self.position_ids)
    }

    /// Packed length `L`.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// True for an empty pack.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Fingerprint of the mask (see [`PackMask::fingerprint`]).
    pub fn fingerprint(&self) -> u64 {
        crate::mask::fingerprint(&self.kv_end, &self.position_ids)
    }

    /// Index of the loss entry for completion token `offset` of call `call`
    /// of rollout `rollout`, if this layout scores it.
    pub fn loss_index(&self, rollout: u32, call: u32, offset: u32) -> Option<usize> {
        self.loss
            .binary_search_by_key(&(rollout, call, offset), LossEntry::key)
            .ok()
    }

    /// Checks the pack's invariants: equal lengths, a valid interval mask,
    /// loss rows inside the pack, strictly increasing loss keys, finite
    /// weights, segments constant within a call and non-decreasing within a
    /// rollout.
    pub fn validate(&self) -> Result<()> {
        if self.tokens.len() != self.kv_end.len() {
            return Err(Error::Pack(format!(
                "{} tokens but {} kv_end entries",
                self.tokens.len(),
                self.kv_end.len()
            )));
        }
        PackMask::new(&self.kv_end, &self.position_ids)?;
        for (i, e) in self.loss.iter().enumerate() {
            if e.row as usize >= self.len() {
                return Err(Error::Pack(format!(
                    "loss entry {i}: row {} outside a pack of {}",
                    e.row,
                    self.len()
                )));
            }
            if !e.weight.is_finite() {
                return Err(Error::NonFinite {
                    what: "loss weight".into(),
                    index: i,
                });
            }
            if i > 0 && self.loss[i - 1].key() >= e.key() {
                return Err(Error::Pack(format!(
                    "loss entry {i}: key {:?} is not after {:?}",
                    e.key(),
                    self.loss[i - 1].key()
                )));
            }
            if let Some(p) = i.checked_sub(1).map(|j| &self.loss[j]) {
                let same_call = (p.rollout, p.call) == (e.rollout, e.call);
                if p.rollout == e.rollout
                    && (e.segment < p.segment || (same_call && e.segment != p.segment))
                {
                    return Err(Error::Pack(format!(
                        "loss entry {i}: segment {} after segment {} of rollout {} (segments are constant within a call and non-decreasing)",
                        e.segment, p.segment, e.rollout
                    )));
                }
            }
        }
        Ok(())
    }
}

/// A diverging target's SDCC pair, rows in trie-pack coordinates: the
/// student row predicts the target on the rightmost branch (the compressed
/// stream), the teacher row is its loss row on its live branch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SdccPair {
    /// Row of the target in the compressed (rightmost) stream.
    pub student_row: u32,
    /// Row of the same target on its live branch.
    pub teacher_row: u32,
    /// Rollout of the target (index in the tree / batch).
    pub rollout: u32,
    /// Call of the target within its rollout.
    pub call: u32,
    /// Offset of the target in its call's completion.
    pub offset: u32,
    /// The sampled token.
    pub label: u32,
}

/// The exact layouts a batch can be packed in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// Deduplicated trie in pre-order.
    Trie,
    /// Branches concatenated (the paper's 4D-mask layout).
    Replicated,
}

impl Layout {
    /// `"trie"` or `"replicated"`.
    pub fn name(self) -> &'static str {
        match self {
            Layout::Trie => "trie",
            Layout::Replicated => "replicated",
        }
    }
}

/// One sampled token as the tree sees it.
struct Target {
    rollout: u32,
    call: u32,
    offset: u32,
    segment: u32,
    /// Trie node of the token before it (the predicting row).
    row: u32,
    /// Trie node of the token itself.
    node: u32,
    logprob: Option<f32>,
}

impl Target {
    /// The loss entry scoring this target at packed row `row`.
    fn entry(&self, row: u32, label: u32) -> LossEntry {
        LossEntry {
            row,
            label,
            weight: 1.0,
            rollout: self.rollout,
            call: self.call,
            offset: self.offset,
            segment: self.segment,
            logprob: self.logprob,
        }
    }
}

impl Tree {
    /// Visits every sampled token, rollout by rollout, in generation order.
    fn for_each_target(&self, mut f: impl FnMut(Target)) {
        for tr in &self.rollouts {
            for (c, call) in tr.calls.iter().enumerate() {
                let segment = tr.segment_of(c);
                let ctx = call.ctx_len as usize;
                for j in 0..call.nodes.len() - ctx {
                    f(Target {
                        rollout: tr.index,
                        call: c as u32,
                        offset: j as u32,
                        segment,
                        row: call.nodes[ctx + j - 1],
                        node: call.nodes[ctx + j],
                        logprob: call.logprobs.as_ref().map(|l| l[j]),
                    });
                }
            }
        }
    }

    fn entries(&self, mut place: impl FnMut(u32, u32) -> u32) -> Vec<LossEntry> {
        let mut loss = Vec::new();
        self.for_each_target(|t| {
            loss.push(t.entry(place(t.row, t.node), self.tokens()[t.node as usize]))
        });
        loss.sort_by_key(LossEntry::key);
        loss
    }

    /// The exact deduplicated pack: trie tokens in pre-order, position =
    /// depth, `kv_end` = end of the node's subtree, one loss entry per
    /// sampled token with `row` = trie node of the token before it in its
    /// call's `context ++ completion`.
    pub fn trie_pack(&self) -> Pack {
        Pack {
            tokens: self.tokens().to_vec(),
            position_ids: self.depths().to_vec(),
            kv_end: self.subtree_ends().to_vec(),
            loss: self.entries(|row, _| row),
        }
    }

    /// Offsets of each branch in the replicated layout, keyed by leaf.
    fn branch_offsets(&self) -> (Vec<(u32, u32)>, HashMap<u32, usize>) {
        let mut off = 0;
        let mut spans = Vec::new();
        let mut slot = HashMap::new();
        for (s, b) in self.branches().into_iter().enumerate() {
            spans.push((b.leaf, off));
            slot.insert(b.leaf, s);
            off += b.len;
        }
        (spans, slot)
    }

    /// The paper's branch-replicated 4D layout: every root-to-leaf path
    /// (pre-order of leaves) as its own chain, positions `0..len` per branch,
    /// `kv_end` = end of the branch. Each target is on the first branch
    /// through its node.
    pub fn replicated_pack(&self) -> Pack {
        let (spans, slot) = self.branch_offsets();
        let first_leaf = self.first_leaf();
        let mut p = Pack {
            tokens: Vec::new(),
            position_ids: Vec::new(),
            kv_end: Vec::new(),
            loss: Vec::new(),
        };
        for &(leaf, off) in &spans {
            let path = self.path_to(leaf as usize);
            let end = off + path.len() as u32;
            for (d, &n) in path.iter().enumerate() {
                p.tokens.push(self.tokens()[n as usize]);
                p.position_ids.push(d as u32);
                p.kv_end.push(end);
            }
        }
        p.loss = self.entries(|row, target| {
            spans[slot[&first_leaf[target as usize]]].1 + self.depths()[row as usize]
        });
        p
    }

    /// LogitTree: one causal pack per branch (pre-order of leaves), each
    /// target scored on the first branch through its node.
    pub fn logittree_packs(&self) -> Vec<Pack> {
        let (spans, slot) = self.branch_offsets();
        let first_leaf = self.first_leaf();
        let mut packs: Vec<Pack> = spans
            .iter()
            .map(|&(leaf, _)| {
                let path = self.path_to(leaf as usize);
                let l = path.len() as u32;
                Pack {
                    tokens: path.iter().map(|&n| self.tokens()[n as usize]).collect(),
                    position_ids: (0..l).collect(),
                    kv_end: vec![l; path.len()],
                    loss: Vec::new(),
                }
            })
            .collect();
        let mut assigned = Vec::new();
        self.for_each_target(|t| {
            assigned.push((
                slot[&first_leaf[t.node as usize]],
                t.entry(
                    self.depths()[t.row as usize],
                    self.tokens()[t.node as usize],
                ),
            ))
        });
        assigned.sort_by_key(|(_, e)| e.key());
        for (b, e) in assigned {
            packs[b].loss.push(e);
        }
        packs
    }

    /// For each node, the start of its top-level subtree and that subtree's
    /// end: one rollout (or one shared group) per top-level subtree.
    fn top_level_spans(&self) -> Vec<(u32, u32)> {
        let mut spans = Vec::with_capacity(self.len());
        let mut i = 0;
        while i < self.len() {
            let end = self.subtree_ends()[i];
            spans.extend(std::iter::repeat_n((i as u32, end), (end as usize) - i));
            i = end as usize;
        }
        spans
    }

    /// Naive-Full: the trie's pre-order tokens replayed with a plain causal
    /// mask and contiguous positions (per top-level subtree: one rollout, or
    /// one group of rollouts sharing a prefix), loss entries as in the trie
    /// pack. Inexact: later tokens see content that was already evicted.
    pub fn naive_full_pack(&self) -> Pack {
        let spans = self.top_level_spans();
        Pack {
            tokens: self.tokens().to_vec(),
            position_ids: spans
                .iter()
                .enumerate()
                .map(|(i, &(s, _))| i as u32 - s)
                .collect(),
            kv_end: spans.iter().map(|&(_, e)| e).collect(),
            loss: self.entries(|row, _| row),
        }
    }

    /// Naive-Compressed: each rollout's final call sequence alone (causal,
    /// positions `0..n`), scoring the targets present there (see
    /// [`crate::tree`]) at positions >= 1, in place. Inexact: earlier
    /// tokens are scored without content they saw (time-travel leakage).
    pub fn naive_compressed_pack(&self) -> Pack {
        let mut p = Pack {
            tokens: Vec::new(),
            position_ids: Vec::new(),
            kv_end: Vec::new(),
            loss: Vec::new(),
        };
        for tr in &self.rollouts {
            let fin = tr.calls.last().expect("validated rollouts have calls");
            let off = p.tokens.len() as u32;
            let n = fin.nodes.len() as u32;
            p.tokens
                .extend(fin.nodes.iter().map(|&x| self.tokens()[x as usize]));
            p.position_ids.extend(0..n);
            p.kv_end.extend(std::iter::repeat_n(off + n, n as usize));
            for pr in &tr.present {
                let lp = tr.calls[pr.call as usize]
                    .logprobs
                    .as_ref()
                    .map(|l| l[pr.offset as usize]);
                p.loss.push(LossEntry {
                    row: off + pr.pos - 1,
                    label: self.tokens()[fin.nodes[pr.pos as usize] as usize],
                    weight: 1.0,
                    rollout: tr.index,
                    call: pr.call,
                    offset: pr.offset,
                    segment: tr.segment_of(pr.call as usize),
                    logprob: lp,
                });
            }
        }
        p.loss.sort_by_key(LossEntry::key);
        p
    }

    /// SDCC pairs for the diverging targets: present targets (on the final
    /// call's sequence, position >= 1) whose predicting row there differs
    /// from their loss row, i.e. whose prefix differs from the live one.
    /// Rows are trie-pack rows; sorted by `(rollout, call, offset)`.
    pub fn sdcc_pairs(&self) -> Vec<SdccPair> {
        let mut out = Vec::new();
        for tr in &self.rollouts {
            let fin = &tr
                .calls
                .last()
                .expect("validated rollouts have calls")
                .nodes;
            for pr in &tr.present {
                let student = fin[pr.pos as usize - 1];
                let teacher = tr.loss_row(pr.call as usize, pr.offset as usize);
                if student != teacher {
                    out.push(SdccPair {
                        student_row: student,
                        teacher_row: teacher,
                        rollout: tr.index,
                        call: pr.call,
                        offset: pr.offset,
                        label: self.tokens()[fin[pr.pos as usize] as usize],
                    });
                }
            }
        }
        out.sort_by_key(|p| (p.rollout, p.call, p.offset));
        out
    }

    /// The pack of an exact layout.
    pub fn pack(&self, layout: Layout) -> Pack {
        match layout {
            Layout::Trie => self.trie_pack(),
            Layout::Replicated => self.replicated_pack(),
        }
    }
}

/// What a pack holds of its rollouts for RL, one entry per rollout of the
/// pack in the order of its rollout list ([`Batch::rollouts`]).
#[derive(Clone, Debug, PartialEq)]
pub struct RolloutFields {
    /// The rollout's reward ([`Rollout::reward`]), NaN where it has none.
    pub reward: Vec<f32>,
    /// Index of the rollout's GRPO group in `groups`, −1 where it has none.
    pub group: Vec<i64>,
    /// The group names, in order of first appearance among the rollouts.
    pub groups: Vec<String>,
    /// [`calls_fingerprint`] of the rollout, as the bits of an `i64`.
    pub fingerprint: Vec<i64>,
    /// Whether the rollout was cut off ([`Rollout::truncated`]: its last
    /// value bootstraps in GAE).
    pub truncated: Vec<bool>,
}

/// What a pack holds of its input for RL per loss entry, in the order of
/// [`Pack::loss`].
#[derive(Clone, Debug, PartialEq)]
pub struct LossFields {
    /// The target's per-token reward from the input's `"rewards"`
    /// ([`Rollout::token_rewards`]), NaN where its rollout has none.
    pub reward: Vec<f32>,
    /// Whether the target's call is marked `"summary"`
    /// ([`Rollout::is_summary`]).
    pub summary: Vec<bool>,
}

impl LossFields {
    /// The fields of each entry of `loss`, whose `rollout` indexes
    /// `rollouts`.
    ///
    /// # Panics
    /// If an entry's rollout, call or offset is not one of `rollouts` (a
    /// pack built from these rollouts never has such an entry).
    pub fn of(rollouts: &[Rollout], loss: &[LossEntry]) -> LossFields {
        LossFields {
            reward: loss
                .iter()
                .map(|e| {
                    rollouts[e.rollout as usize]
                        .token_rewards()
                        .map_or(f32::NAN, |r| r[e.call as usize][e.offset as usize])
                })
                .collect(),
            summary: loss
                .iter()
                .map(|e| rollouts[e.rollout as usize].is_summary(e.call as usize))
                .collect(),
        }
    }
}

/// A 64-bit fingerprint of a rollout's calls (their token ids only: not its
/// id, reward, group or log-probs), the same on every machine and run:
/// FNV-1a (64-bit) over the little-endian bytes of the `u32` words
/// `n_calls`, then per call `len(context)`, `context…`, `len(completion)`,
/// `completion…`. Two packs that hold a rollout of the same id tell by it
/// whether they hold the same rollout (`treeattn.rl.grpo_advantages`).
pub fn calls_fingerprint(r: &Rollout) -> u64 {
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut word = |w: u32| {
        for b in w.to_le_bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(PRIME);
        }
    };
    // Lengths above u32::MAX cannot occur: a call's tokens are indexed in u32.
    word(r.calls().len() as u32);
    for c in r.calls() {
        word(c.context.len() as u32);
        c.context.iter().for_each(|&t| word(t));
        word(c.completion.len() as u32);
        c.completion.iter().for_each(|&t| word(t));
    }
    h
}

impl RolloutFields {
    /// The fields of `rollouts[i]` for each `i` of `members`, in that order.
    ///
    /// # Panics
    /// If a member is not an index of `rollouts`.
    pub fn of(rollouts: &[Rollout], members: &[u32]) -> RolloutFields {
        let mut f = RolloutFields {
            reward: Vec::with_capacity(members.len()),
            group: Vec::with_capacity(members.len()),
            groups: Vec::new(),
            fingerprint: Vec::with_capacity(members.len()),
            truncated: Vec::with_capacity(members.len()),
        };
        let mut index: HashMap<&str, i64> = HashMap::new();
        for &m in members {
            let r = &rollouts[m as usize];
            f.reward.push(r.reward().unwrap_or(f32::NAN));
            f.fingerprint.push(calls_fingerprint(r) as i64);
            f.truncated.push(r.truncated());
            f.group.push(match r.group() {
                Some(g) => *index.entry(g).or_insert_with(|| {
                    f.groups.push(g.to_string());
                    f.groups.len() as i64 - 1
                }),
                None => -1,
            });
        }
        f
    }
}

/// One pack of a batch.
#[derive(Clone, Debug, PartialEq)]
pub struct Batch {
    /// The packed sequence.
    pub pack: Pack,
    /// Input indices of the rollouts in this pack, increasing.
    pub rollouts: Vec<u32>,
    /// Reward, GRPO group, calls' fingerprint and truncation of each
    /// rollout of `rollouts`, in that order.
    pub fields: RolloutFields,
    /// Per-token reward and summary flag of each loss entry of `pack`.
    pub loss_fields: LossFields,
    /// SDCC pairs in this pack's rows (trie layout only; `None` for the
    /// replicated layout, whose student rows are not defined here).
    pub sdcc: Option<Vec<SdccPair>>,
}

/// How many earlier bins sharing a first token with a rollout, and with
/// room for the nodes it adds to the union of all bins, [`batch`] checks for
/// room by the nodes it would add there (before the first bin with room for
/// the rollout's whole size); it visits at most four times as many bins.
pub const SHARE_CANDIDATES: usize = 256;

/// Free room per bin in a max segment tree: the first bin with room for `x`
/// in O(log bins).
#[derive(Default)]
struct FirstFit {
    /// Leaves at `cap..2 * cap`; `tree[n]` = max of its two children.
    tree: Vec<usize>,
    cap: usize,
    len: usize,
}

impl FirstFit {
    fn push(&mut self, free: usize) {
        if self.len == self.cap {
            let cap = (self.cap * 2).max(1);
            let mut tree = vec![0; 2 * cap];
            tree[cap..cap + self.len].copy_from_slice(&self.tree[self.cap..self.cap + self.len]);
            self.tree = tree;
            self.cap = cap;
            for n in (1..cap).rev() {
                self.tree[n] = self.tree[2 * n].max(self.tree[2 * n + 1]);
            }
        }
        self.len += 1;
        self.set(self.len - 1, free);
    }

    fn set(&mut self, i: usize, free: usize) {
        let mut n = self.cap + i;
        self.tree[n] = free;
        while n > 1 {
            n /= 2;
            self.tree[n] = self.tree[2 * n].max(self.tree[2 * n + 1]);
        }
    }

    /// The first bin at or after `from` whose room is at least `x`.
    fn first_with_from(&self, x: usize, from: usize) -> Option<usize> {
        fn go(
            t: &FirstFit,
            n: usize,
            lo: usize,
            hi: usize,
            x: usize,
            from: usize,
        ) -> Option<usize> {
            if hi <= from || t.tree[n] < x || lo >= t.len {
                return None;
            }
            if hi - lo == 1 {
                return Some(lo);
            }
            let mid = (lo + hi) / 2;
            go(t, 2 * n, lo, mid, x, from).or_else(|| go(t, 2 * n + 1, mid, hi, x, from))
        }
        if self.len == 0 {
            return None;
        }
        go(self, 1, 0, self.cap, x, from)
    }

    /// The first bin whose room is at least `x`.
    fn first_with(&self, x: usize) -> Option<usize> {
        if self.len == 0 || self.tree[1] < x {
            return None;
        }
        let mut n = 1;
        while n < self.cap {
            n = if self.tree[2 * n] >= x {
                2 * n
            } else {
                2 * n + 1
            };
        }
        Some(n - self.cap)
    }
}

/// Packs `rollouts` into packs of at most `budget_tokens` tokens each.
///
/// Greedy first-fit decreasing: rollouts sorted by their own size in the
/// layout (trie nodes, or sum of branch lengths), largest first, ties by input
/// index; each goes into the first pack it still fits in, else a new pack.
/// With `share_prefixes` (trie layout), a rollout's size in a pack is the
/// number of trie nodes it adds there, so rollouts sharing a prompt (a GRPO
/// group) cost their prompt once (of the earlier packs that share a first
/// token with the rollout and have room for what it adds to all packs'
/// union, the first [`SHARE_CANDIDATES`] are tried). Loss entries carry
/// input indices. A rollout that alone exceeds the budget is an error.
///
/// Cost: O(n log n) in the number of rollouts plus their tokens (the pack
/// search is a segment tree over the packs' free room).
pub fn batch(
    rollouts: &[Rollout],
    budget_tokens: usize,
    share_prefixes: bool,
    layout: Layout,
) -> Result<Vec<Batch>> {
    if budget_tokens == 0 {
        return Err(Error::Pack(
            "the token budget per pack must be positive".into(),
        ));
    }
    let mut sizes = Vec::with_capacity(rollouts.len());
    for r in rollouts {
        let tree = Tree::build(std::slice::from_ref(r), false)?;
        sizes.push(match layout {
            Layout::Trie => tree.len(),
            Layout::Replicated => tree.branches().iter().map(|b| b.len as usize).sum(),
        });
    }
    let mut order: Vec<usize> = (0..rollouts.len()).collect();
    order.sort_by_key(|&i| (std::cmp::Reverse(sizes[i]), i));
    let share_trie = share_prefixes && layout == Layout::Trie;
    struct Bin {
        used: usize,
        members: Vec<u32>,
        trie: TrieBuilder,
    }
    let mut bins: Vec<Bin> = Vec::new();
    // Free room of every bin, for "first bin with room >= x" in O(log bins).
    let mut room = FirstFit::default();
    // With sharing: the bins holding a call that starts with a given token
    // (only those can hold any of a rollout's nodes already).
    let mut by_root: HashMap<u32, BTreeSet<usize>> = HashMap::new();
    // With sharing: the union of every bin's trie.
    let mut placed = TrieBuilder::default();
    for i in order {
        let r = &rollouts[i];
        if sizes[i] > budget_tokens {
            return Err(Error::Pack(format!(
                "rollout {:?} (index {i}) needs {} tokens in the {} layout, more than the budget of {budget_tokens} per pack",
                r.id(),
                sizes[i],
                layout.name()
            )));
        }
        // First fit: the first bin with room for the rollout's own size,
        // unless an earlier bin that shares a prefix with it has room for
        // the nodes it would add there.
        let mut slot = room.first_with(sizes[i]);
        if share_trie {
            // A bin holds a subset of all nodes placed so far, so the nodes
            // `r` adds to their union bound its cost in any bin from below:
            // only bins with at least that much room, before `slot`, that
            // share a first token with `r`, can take it at a smaller cost.
            let least = placed.added_by(0, r, usize::MAX).unwrap_or(usize::MAX);
            let roots: BTreeSet<u32> = r.calls().iter().map(|c| c.context[0]).collect();
            let end = slot.unwrap_or(bins.len());
            let (mut from, mut visits, mut checks) = (0, 0, 0);
            while let Some(c) = room.first_with_from(least, from).filter(|&c| c < end) {
                visits += 1;
                if visits > 4 * SHARE_CANDIDATES || checks >= SHARE_CANDIDATES {
                    break;
                }
                from = c + 1;
                if !roots
                    .iter()
                    .any(|t| by_root.get(t).is_some_and(|b| b.contains(&c)))
                {
                    continue;
                }
                checks += 1;
                let free = budget_tokens - bins[c].used;
                if bins[c].trie.added_by(0, r, free).is_some() {
                    slot = Some(c);
                    break;
                }
            }
        }
        let slot = match slot {
            Some(s) => s,
            None => {
                bins.push(Bin {
                    used: 0,
                    members: Vec::new(),
                    trie: TrieBuilder::default(),
                });
                room.push(budget_tokens);
                bins.len() - 1
            }
        };
        let b = &mut bins[slot];
        if share_trie {
            b.trie.add(0, r)?;
            b.used = b.trie.len();
            placed.add(0, r)?;
            for c in r.calls() {
                by_root.entry(c.context[0]).or_default().insert(slot);
            }
        } else {
            b.used += sizes[i];
        }
        b.members.push(i as u32);
        room.set(slot, budget_tokens - b.used);
    }
    bins.into_iter()
        .map(|b| batch_of(rollouts, b.members, share_prefixes, layout))
        .collect()
}

/// The one pack of `rollouts[i]` for every `i` of `members` (sorted here),
/// with loss entries carrying input indices.
fn batch_of(
    rollouts: &[Rollout],
    mut members: Vec<u32>,
    share_prefixes: bool,
    layout: Layout,
) -> Result<Batch> {
    members.sort_unstable();
    let indexed: Vec<(u32, &Rollout)> = members
        .iter()
        .map(|&i| (i, &rollouts[i as usize]))
        .collect();
    let tree = Tree::build_indexed(&indexed, share_prefixes)?;
    let pack = tree.pack(layout);
    let sdcc = (layout == Layout::Trie).then(|| tree.sdcc_pairs());
    let fields = RolloutFields::of(rollouts, &members);
    let loss_fields = LossFields::of(rollouts, &pack.loss);
    Ok(Batch {
        pack,
        fields,
        loss_fields,
        rollouts: members,
        sdcc,
    })
}

/// Tokens of the one pack of `rollouts[i]` for every `i` of `members`
/// (sorted), without building it: trie nodes, or the sum of the branches.
fn packed_len(
    rollouts: &[Rollout],
    members: &[u32],
    share_prefixes: bool,
    layout: Layout,
) -> Result<usize> {
    let indexed: Vec<(u32, &Rollout)> = members
        .iter()
        .map(|&i| (i, &rollouts[i as usize]))
        .collect();
    let tree = Tree::build_indexed(&indexed, share_prefixes)?;
    Ok(match layout {
        Layout::Trie => tree.len(),
        Layout::Replicated => tree.branches().iter().map(|b| b.len as usize).sum(),
    })
}

/// What [`balance`] weighs a unit by.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Objective {
    /// The FLOPs of a training step of this model on the unit's pack
    /// ([`ModelCost::pack_cost`]'s `total`): exact, the default.
    Flops(ModelCost),
    /// The unit's tokens (for comparison).
    Tokens,
    /// The unit's tokens squared (for comparison).
    TokensSquared,
}

/// One unit of [`balance`]: rollouts that go to one bin together.
#[derive(Clone, Debug, PartialEq)]
pub struct Unit {
    /// Input indices of its rollouts, increasing.
    pub rollouts: Vec<u32>,
    /// Tokens of their pack.
    pub tokens: usize,
    /// Its weight under the objective.
    pub weight: f64,
    /// Its bin, `micro · world_size + rank`.
    pub bin: usize,
}

/// The packs of a data-parallel step: `world_size` ranks × `micro_steps`.
#[derive(Clone, Debug, PartialEq)]
pub struct Balanced {
    /// Ranks.
    pub world_size: usize,
    /// Micro-steps, the same on every rank.
    pub micro_steps: usize,
    /// The units in the order they were formed (groups in order of first
    /// appearance), each with its bin.
    pub units: Vec<Unit>,
    /// `bins[micro · world_size + rank]`: the pack of that rank in that
    /// micro-step, `None` where no unit went (the caller runs an empty pack
    /// there, so that every rank enters every collective).
    pub bins: Vec<Option<Batch>>,
}

impl Balanced {
    /// The pack of `rank` in micro-step `micro` (`None`: nothing to do).
    pub fn get(&self, rank: usize, micro: usize) -> Option<&Batch> {
        self.bins[micro * self.world_size + rank].as_ref()
    }
}

/// The most ranks [`lpt`] and [`balance`] take (2^20): past it a request is
/// taken for a mistake rather than allocated.
pub const MAX_RANKS: usize = 1 << 20;

/// LPT (longest processing time first) of units of `weights` and `tokens`
/// onto `world_size × M` bins of at most `budget_tokens` tokens each, M
/// the fewest micro-steps from `min_micro_steps` on for which every unit
/// finds room: units by weight descending (ties: tokens descending, then
/// index), each onto the bin of least load that has room for it (ties: the
/// lowest bin, i.e. micro-step, then rank); when a unit finds no room, the
/// whole assignment starts again with one more micro-step. Deterministic.
/// Returns `(M, bin of each unit)` with bin = `micro · world_size + rank`.
///
/// Without the token budget this is Graham's LPT: the heaviest bin is at
/// most `(4/3 − 1/(3·bins))` times the optimum, and at most the mean load
/// plus the heaviest unit.
pub fn lpt(
    weights: &[f64],
    tokens: &[usize],
    world_size: usize,
    budget_tokens: usize,
    min_micro_steps: usize,
) -> Result<(usize, Vec<usize>)> {
    if weights.len() != tokens.len() {
        return Err(Error::Shape(format!(
            "lpt: {} weights for {} units",
            weights.len(),
            tokens.len()
        )));
    }
    if world_size == 0 || world_size > MAX_RANKS {
        return Err(Error::Usage(format!(
            "lpt: world_size = {world_size}, expected 1 to {MAX_RANKS}"
        )));
    }
    // A NaN or negative weight would order and place units silently wrong.
    if let Some((u, w)) = weights
        .iter()
        .enumerate()
        .find(|(_, w)| !(w.is_finite() && **w >= 0.0))
    {
        return Err(Error::Usage(format!(
            "lpt: weights[{u}] = {w}: weights must be finite and non-negative"
        )));
    }
    if let Some(&t) = tokens.iter().max().filter(|&&t| t > budget_tokens) {
        return Err(Error::Pack(format!(
            "a unit of {t} tokens does not fit the budget of {budget_tokens}"
        )));
    }
    let mut order: Vec<usize> = (0..weights.len()).collect();
    order.sort_by(|&a, &b| {
        weights[b]
            .partial_cmp(&weights[a])
            .unwrap_or(std::cmp::Ordering::Equal)
            .then(tokens[b].cmp(&tokens[a]))
            .then(a.cmp(&b))
    });
    let mut micro = min_micro_steps.max(1);
    'grow: loop {
        let n = world_size * micro;
        let mut load = vec![0.0f64; n];
        let mut room = vec![budget_tokens; n];
        let mut bin = vec![0usize; weights.len()];
        for &u in &order {
            let mut best: Option<usize> = None;
            for b in 0..n {
                if room[b] >= tokens[u] && best.is_none_or(|c| load[b] < load[c]) {
                    best = Some(b);
                }
            }
            let Some(b) = best else {
                micro += 1;
                continue 'grow;
            };
            load[b] += weights[u];
            room[b] -= tokens[u];
            bin[u] = b;
        }
        return Ok((micro, bin));
    }
}

/// Packs `rollouts` for `world_size` data-parallel ranks (DESIGN §10):
/// every rank the same number of micro-steps, each pack at most
/// `budget_tokens` tokens, balanced by `objective` (the exact FLOPs of a
/// training step by default).
///
/// Units: with `share_prefixes` the rollouts whose first call has the same
/// context (a GRPO group's prompt) stay in one pack — split, in input
/// order, only where together they exceed the budget; else each rollout is
/// a unit. The units go to `world_size × M` bins by [`lpt`] (M from
/// `ceil(tokens / (world_size · budget))` up); each bin's rollouts are
/// packed together as [`batch`] packs one bin (input order; prefixes shared
/// across units too with `share_prefixes`). A bin no unit went to is
/// `None`. Deterministic. Loss entries carry input indices.
///
/// A rollout that alone exceeds the budget is an [`Error::Pack`] naming it
/// (context parallelism splits one pack over ranks instead).
pub fn balance(
    rollouts: &[Rollout],
    world_size: usize,
    budget_tokens: usize,
    share_prefixes: bool,
    layout: Layout,
    objective: Objective,
) -> Result<Balanced> {
    if world_size == 0 || world_size > MAX_RANKS {
        return Err(Error::Usage(format!(
            "balance: world_size = {world_size}, expected 1 to {MAX_RANKS}"
        )));
    }
    if budget_tokens == 0 {
        return Err(Error::Usage(
            "balance: the token budget per pack must be positive".into(),
        ));
    }
    if rollouts.is_empty() {
        return Err(Error::Usage("balance: no rollouts".into()));
    }
    if let Objective::Flops(m) = &objective {
        m.validate()?;
    }
    // Groups: rollouts with the same first context, in order of first
    // appearance.
    let mut groups: Vec<Vec<u32>> = Vec::new();
    if share_prefixes {
        let mut index: HashMap<&[u32], usize> = HashMap::new();
        for (i, r) in rollouts.iter().enumerate() {
            let key = r.calls().first().map_or(&[][..], |c| &c.context[..]);
            let g = *index.entry(key).or_insert_with(|| {
                groups.push(Vec::new());
                groups.len() - 1
            });
            groups[g].push(i as u32);
        }
    } else {
        groups = (0..rollouts.len() as u32).map(|i| vec![i]).collect();
    }
    let too_long = |i: u32, n: usize| {
        Error::Pack(format!(
            "rollouts[{i}] (id {:?}) packs to {n} tokens, over the budget of {budget_tokens}: give it a larger budget or split it over ranks (treeattn.distributed.shard)",
            rollouts[i as usize].id()
        ))
    };
    // Each unit's pack; a group over the budget is cut greedily.
    let mut units: Vec<Batch> = Vec::new();
    for group in groups {
        let whole = batch_of(rollouts, group.clone(), share_prefixes, layout)?;
        if whole.pack.len() <= budget_tokens {
            units.push(whole);
            continue;
        }
        let mut chunk: Vec<u32> = Vec::new();
        for i in group {
            let mut trial = chunk.clone();
            trial.push(i);
            let n = packed_len(rollouts, &trial, share_prefixes, layout)?;
            if n <= budget_tokens {
                chunk = trial;
                continue;
            }
            if chunk.is_empty() {
                return Err(too_long(i, n));
            }
            units.push(batch_of(rollouts, chunk, share_prefixes, layout)?);
            chunk = vec![i];
            let alone = packed_len(rollouts, &chunk, share_prefixes, layout)?;
            if alone > budget_tokens {
                return Err(too_long(i, alone));
            }
        }
        units.push(batch_of(rollouts, chunk, share_prefixes, layout)?);
    }
    let tokens: Vec<usize> = units.iter().map(|u| u.pack.len()).collect();
    let weights = units
        .iter()
        .map(|u| {
            let t = u.pack.len() as f64;
            Ok(match objective {
                Objective::Flops(m) => m.pack_cost(&u.pack)?.total,
                Objective::Tokens => t,
                Objective::TokensSquared => t * t,
            })
        })
        .collect::<Result<Vec<f64>>>()?;
    let total: u128 = tokens.iter().map(|&t| t as u128).sum();
    let per_step = world_size as u128 * budget_tokens as u128;
    let min_micro = usize::try_from(total.div_ceil(per_step).max(1)).unwrap_or(usize::MAX);
    let (micro_steps, bin_of) = lpt(&weights, &tokens, world_size, budget_tokens, min_micro)?;
    let mut in_bin: Vec<Vec<usize>> = vec![Vec::new(); world_size * micro_steps];
    for (u, &b) in bin_of.iter().enumerate() {
        in_bin[b].push(u);
    }
    let out_units: Vec<Unit> = units
        .iter()
        .zip(&bin_of)
        .zip(&weights)
        .map(|((u, &bin), &weight)| Unit {
            rollouts: u.rollouts.clone(),
            tokens: u.pack.len(),
            weight,
            bin,
        })
        .collect();
    let mut units: Vec<Option<Batch>> = units.into_iter().map(Some).collect();
    let bins = in_bin
        .into_iter()
        .map(|us| match us.as_slice() {
            [] => Ok(None),
            [u] => Ok(units[*u].take()),
            many => {
                let members: Vec<u32> = many
                    .iter()
                    .flat_map(|&u| out_units[u].rollouts.iter().copied())
                    .collect();
                batch_of(rollouts, members, share_prefixes, layout).map(Some)
            }
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Balanced {
        world_size,
        micro_steps,
        units: out_units,
        bins,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rollout::Call;

    /// First fit as it was before issue 17: every bin tried in order.
    fn first_fit_reference(rs: &[Rollout], budget: usize, share: bool) -> Vec<Vec<u32>> {
        let sizes: Vec<usize> = rs
            .iter()
            .map(|r| Tree::build(std::slice::from_ref(r), false).unwrap().len())
            .collect();
        let mut order: Vec<usize> = (0..rs.len()).collect();
        order.sort_by_key(|&i| (std::cmp::Reverse(sizes[i]), i));
        let mut bins: Vec<(usize, Vec<u32>, TrieBuilder)> = Vec::new();
        for i in order {
            let cost = |b: &(usize, Vec<u32>, TrieBuilder)| {
                if share {
                    b.2.added_by(0, &rs[i], usize::MAX).unwrap()
                } else {
                    sizes[i]
                }
            };
            let slot = match bins.iter().position(|b| b.0 + cost(b) <= budget) {
                Some(s) => s,
                None => {
                    bins.push((0, Vec::new(), TrieBuilder::default()));
                    bins.len() - 1
                }
            };
            let b = &mut bins[slot];
            if share {
                b.2.add(0, &rs[i]).unwrap();
                b.0 = b.2.len();
            } else {
                b.0 += sizes[i];
            }
            b.1.push(i as u32);
        }
        bins.into_iter()
            .map(|mut b| {
                b.1.sort_unstable();
                b.1
            })
            .collect()
    }

    #[test]
    fn first_fit_is_unchanged_by_the_segment_tree_and_root_index() {
        let mut s = 0x2545_f491_4f6c_dd1du64;
        let mut next = |n: u64| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s % n) as u32
        };
        for case in 0..40 {
            // Few first tokens and a tiny vocabulary: much sharing, many
            // partly shared bins, duplicates included.
            let rs: Vec<Rollout> = (0..60)
                .map(|r| {
                    let first = next(3);
                    let mut ctx: Vec<u32> = vec![first];
                    ctx.extend((0..next(6)).map(|_| next(3)));
                    let comp: Vec<u32> = (0..1 + next(4)).map(|_| next(3)).collect();
                    let mut calls = vec![Call::new(ctx.clone(), comp.clone())];
                    if next(2) == 0 {
                        let mut c2 = ctx.clone();
                        c2.extend(&comp);
                        c2.push(next(3));
                        calls.push(Call::new(c2, vec![next(3)]));
                    }
                    Rollout::new(format!("r{r}"), calls).unwrap()
                })
                .collect();
            let budget = 12 + case % 30;
            for share in [false, true] {
                let got: Vec<Vec<u32>> = batch(&rs, budget, share, Layout::Trie)
                    .unwrap()
                    .into_iter()
                    .map(|b| b.rollouts)
                    .collect();
                assert_eq!(
                    got,
                    first_fit_reference(&rs, budget, share),
                    "case {case}, share {share}"
                );
            }
        }
    }

    #[test]
    fn fingerprint_is_the_documented_fnv1a_of_the_calls_alone() {
        // FNV-1a 64 of the u32 words [1, 2, 7, 8, 1, 9], written out.
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for w in [1u32, 2, 7, 8, 1, 9] {
            for b in w.to_le_bytes() {
                h = (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
            }
        }
        let r = |id: &str, calls: Vec<Call>| Rollout::new(id, calls).unwrap();
        let a = r("a", vec![Call::new(vec![7, 8], vec![9])]);
        assert_eq!(calls_fingerprint(&a), h);
        // Not the id, reward or group: the same calls, the same fingerprint.
        let b = r("b", vec![Call::new(vec![7, 8], vec![9])])
            .with_reward(1.0)
            .unwrap()
            .with_group("g");
        assert_eq!(calls_fingerprint(&b), h);
        // The split between context and completion, and between calls, counts.
        for other in [
            vec![Call::new(vec![7], vec![8, 9])],
            vec![Call::new(vec![7, 8], vec![9, 0])],
            vec![
                Call::new(vec![7, 8], vec![9]),
                Call::new(vec![7, 8, 9], vec![1]),
            ],
        ] {
            assert_ne!(calls_fingerprint(&r("a", other)), h);
        }
        // batch() carries it per rollout of each pack, in the pack's order.
        let rs = vec![a.clone(), r("c", vec![Call::new(vec![5], vec![6])]), b];
        for bt in batch(&rs, 3, true, Layout::Trie).unwrap() {
            let want: Vec<i64> = bt
                .rollouts
                .iter()
                .map(|&i| calls_fingerprint(&rs[i as usize]) as i64)
                .collect();
            assert_eq!(bt.fields.fingerprint, want);
        }
    }
}
