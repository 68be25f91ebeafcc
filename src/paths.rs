//! The path structure of a pack, for recurrent layers (DESIGN §11).
//!
//! Attention needs only the interval mask `kv_end`. A recurrent layer (a
//! short causal convolution, a gated delta rule, a Mamba-2 scan) needs the
//! *path* of every row: the rows before it on its own root-to-row path, in
//! order. In a pre-order pack the ancestors of row `t` are exactly the rows
//! `k < t` whose subtree range contains `t`, i.e. `kv_end[k] > t`, so
//!
//! ```text
//! parent[t] = max { k < t : kv_end[k] > t }      (−1 when there is none: a root)
//! ```
//!
//! which is `t − 1` whenever `kv_end[t − 1] > t`. A recurrent layer run along
//! the path of `t` reads `parent[t]`, `parent[parent[t]]`, … instead of
//! `t − 1`, `t − 2`, ….
//!
//! Rows group into *nodes*: maximal contiguous runs `[start, end)` in which
//! every row's parent is the row before it and that row has no other child
//! (`parent[t] == t − 1` and `kv_end[t] == kv_end[t − 1]`). A node starts
//! from the state its parent node ends with; nodes of one *level* (the
//! number of nodes above them on their path) are independent of each other,
//! so a scan runs level by level, each level batched.
//!
//! Everything is `O(L)`: one stack walk over the rows.

use crate::mask::PackMask;
use crate::{Error, Result};

/// Parents, nodes and the level schedule of a pack (see the module docs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Paths {
    /// Per row: the row before it on its own path, `−1` at a root.
    pub parent: Vec<i64>,
    /// Per row: the node it belongs to.
    pub row_node: Vec<u32>,
    /// Per node: its first row. Nodes are numbered in pre-order, so
    /// `node_start` is increasing and a node's parent has a smaller number.
    pub node_start: Vec<u32>,
    /// Per node: one past its last row.
    pub node_end: Vec<u32>,
    /// Per node: the node holding `parent[node_start]`, `−1` at a root node.
    pub node_parent: Vec<i64>,
    /// Per node: its level, the number of nodes above it on its path
    /// (`0` for a root node).
    pub node_level: Vec<u32>,
    /// The level schedule in CSR form: the nodes of level `l` are
    /// `level_nodes[level_offsets[l]..level_offsets[l + 1]]`, in increasing
    /// order. Every node's parent is in an earlier level.
    pub level_offsets: Vec<u32>,
    /// Nodes sorted by level (stable), see `level_offsets`.
    pub level_nodes: Vec<u32>,
}

impl Paths {
    /// The path structure of a validated pack mask.
    ///
    /// Besides [`PackMask::new`]'s checks (`k <= kv_end[k] <= L`), the ranges
    /// must nest like the subtrees of a pre-order layout: the range of a row
    /// lies inside the range of every row whose range contains it. A
    /// `kv_end` that breaks this is not a tree and is refused with the row
    /// that crosses its enclosing range.
    pub fn new(mask: &PackMask<'_>) -> Result<Paths> {
        Paths::from_kv_end(mask.kv_end())
    }

    /// [`Paths::new`] from `kv_end` alone (position ids play no part).
    pub fn from_kv_end(kv_end: &[u32]) -> Result<Paths> {
        let l = kv_end.len();
        if l > u32::MAX as usize {
            return Err(Error::Pack(format!(
                "pack of {l} tokens exceeds u32 indexing"
            )));
        }
        let mut parent = vec![-1i64; l];
        let mut row_node = vec![0u32; l];
        let mut node_start = Vec::new();
        let mut node_end: Vec<u32> = Vec::new();
        let mut node_parent = Vec::new();
        let mut node_level: Vec<u32> = Vec::new();
        // The open ancestors of the current row, innermost on top; their
        // kv_end values are non-increasing from bottom to top.
        let mut stack: Vec<usize> = Vec::new();
        for t in 0..l {
            let e = kv_end[t] as usize;
            if e < t || e > l {
                return Err(Error::Pack(format!(
                    "kv_end[{t}] = {e} breaks {t} <= kv_end[k] <= {l} (a key's range starts at itself and stays inside the pack)"
                )));
            }
            while let Some(&top) = stack.last() {
                if kv_end[top] as usize > t {
                    break;
                }
                stack.pop();
            }
            let p = stack.last().copied();
            if let Some(p) = p {
                if e > kv_end[p] as usize {
                    return Err(Error::Pack(format!(
                        "kv_end[{t}] = {e} reaches past kv_end[{p}] = {}, the end of the range of row {p} that contains row {t}: the ranges do not nest, so kv_end is not a tree",
                        kv_end[p]
                    )));
                }
            }
            parent[t] = p.map_or(-1, |p| p as i64);
            let continues = t > 0 && p == Some(t - 1) && kv_end[t] == kv_end[t - 1];
            if continues {
                let n = node_start.len() - 1;
                row_node[t] = n as u32;
                node_end[n] = t as u32 + 1;
            } else {
                let n = node_start.len();
                let (np, level) = match p {
                    Some(p) => {
                        let pn = row_node[p] as usize;
                        (pn as i64, node_level[pn] + 1)
                    }
                    None => (-1, 0),
                };
                row_node[t] = n as u32;
                node_start.push(t as u32);
                node_end.push(t as u32 + 1);
                node_parent.push(np);
                node_level.push(level);
            }
            stack.push(t);
        }
        // Counting sort of the nodes by level.
        let levels = node_level
            .iter()
            .map(|&v| v as usize + 1)
            .max()
            .unwrap_or(0);
        let mut level_offsets = vec![0u32; levels + 1];
        for &v in &node_level {
            level_offsets[v as usize + 1] += 1;
        }
        for i in 0..levels {
            level_offsets[i + 1] += level_offsets[i];
        }
        let mut fill: Vec<u32> = level_offsets[..levels].to_vec();
        let mut level_nodes = vec![0u32; node_level.len()];
        for (n, &v) in node_level.iter().enumerate() {
            level_nodes[fill[v as usize] as usize] = n as u32;
            fill[v as usize] += 1;
        }
        Ok(Paths {
            parent,
            row_node,
            node_start,
            node_end,
            node_parent,
            node_level,
            level_offsets,
            level_nodes,
        })
    }

    /// Number of rows `L`.
    pub fn len(&self) -> usize {
        self.parent.len()
    }

    /// True for an empty pack.
    pub fn is_empty(&self) -> bool {
        self.parent.is_empty()
    }

    /// Number of nodes.
    pub fn nodes(&self) -> usize {
        self.node_start.len()
    }

    /// Number of levels (sequential steps of a node-level scan).
    pub fn levels(&self) -> usize {
        self.level_offsets.len().saturating_sub(1)
    }

    /// The rows of `t`'s path from its root to `t`, in order (`O(depth)`).
    pub fn path(&self, t: usize) -> Vec<usize> {
        let mut out = vec![t];
        let mut k = self.parent[t];
        while k >= 0 {
            out.push(k as usize);
            k = self.parent[k as usize];
        }
        out.reverse();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;

    /// `kv_end` of a random forest laid out in pre-order: each new row is a
    /// child of a random open row (or a new root), so runs, branch points,
    /// single-row nodes and several roots all occur.
    fn random_kv_end(rng: &mut Rng, l: usize) -> Vec<u32> {
        let mut parent: Vec<Option<usize>> = Vec::with_capacity(l);
        let mut open: Vec<usize> = Vec::new();
        for t in 0..l {
            // Close a random number of open rows (finishing their subtrees).
            let close = if open.is_empty() {
                0
            } else {
                rng.range(0, open.len())
            };
            let close = if rng.range(0, 2) == 0 { close } else { 0 };
            open.truncate(open.len() - close);
            parent.push(open.last().copied());
            open.push(t);
        }
        let mut kv_end: Vec<u32> = (0..l).map(|t| t as u32 + 1).collect();
        for t in (0..l).rev() {
            if let Some(p) = parent[t] {
                kv_end[p] = kv_end[p].max(kv_end[t]);
            }
        }
        kv_end
    }

    /// The definitions, by brute force (`O(L²)`).
    fn brute(kv_end: &[u32]) -> (Vec<i64>, Vec<(u32, u32)>) {
        let l = kv_end.len();
        let parent: Vec<i64> = (0..l)
            .map(|t| {
                (0..t)
                    .rev()
                    .find(|&k| kv_end[k] as usize > t)
                    .map_or(-1, |k| k as i64)
            })
            .collect();
        let children = |k: usize| (0..l).filter(|&c| parent[c] == k as i64).count();
        let mut nodes = Vec::new();
        let mut start = 0;
        // A node ends before t unless t continues it, and at the end.
        for (t, &p) in parent.iter().enumerate().skip(1) {
            if !(p == t as i64 - 1 && children(t - 1) == 1) {
                nodes.push((start as u32, t as u32));
                start = t;
            }
        }
        if l > 0 {
            nodes.push((start as u32, l as u32));
        }
        (parent, nodes)
    }

    #[test]
    fn paths_match_brute_force_on_random_packs() {
        let mut rng = Rng::new(25);
        for case in 0..300 {
            let l = rng.range(0, 59);
            let kv_end = random_kv_end(&mut rng, l);
            let p = Paths::from_kv_end(&kv_end).unwrap();
            let (parent, nodes) = brute(&kv_end);
            assert_eq!(p.parent, parent, "case {case}: {kv_end:?}");
            let got: Vec<(u32, u32)> = p
                .node_start
                .iter()
                .copied()
                .zip(p.node_end.iter().copied())
                .collect();
            assert_eq!(got, nodes, "case {case}: {kv_end:?}");
            for (n, &(s, e)) in nodes.iter().enumerate() {
                for t in s..e {
                    assert_eq!(p.row_node[t as usize], n as u32);
                }
                let want = parent[s as usize];
                let np = if want < 0 {
                    -1
                } else {
                    p.row_node[want as usize] as i64
                };
                assert_eq!(p.node_parent[n], np);
                // The node's parent's last row is the start row's parent.
                if np >= 0 {
                    assert_eq!(p.node_end[np as usize] as i64 - 1, want);
                    assert_eq!(p.node_level[n], p.node_level[np as usize] + 1);
                } else {
                    assert_eq!(p.node_level[n], 0);
                }
            }
            // The schedule lists every node once, by level, parents first.
            let mut seen = vec![false; p.nodes()];
            for lv in 0..p.levels() {
                let (a, b) = (
                    p.level_offsets[lv] as usize,
                    p.level_offsets[lv + 1] as usize,
                );
                assert!(a < b, "empty level {lv}");
                for &n in &p.level_nodes[a..b] {
                    assert_eq!(p.node_level[n as usize], lv as u32);
                    let np = p.node_parent[n as usize];
                    assert!(np < 0 || seen[np as usize]);
                    seen[n as usize] = true;
                }
            }
            assert!(seen.iter().all(|&s| s));
        }
    }

    #[test]
    fn worked_example_and_chains() {
        // The crate's doctest pack: [1, 2, 3] and [1, 9, 3, 4] share the root.
        let p = Paths::from_kv_end(&[6, 3, 3, 6, 6, 6]).unwrap();
        assert_eq!(p.parent, [-1, 0, 1, 0, 3, 4]);
        assert_eq!(p.node_start, [0, 1, 3]);
        assert_eq!(p.node_end, [1, 3, 6]);
        assert_eq!(p.node_parent, [-1, 0, 0]);
        assert_eq!(p.level_offsets, [0, 1, 3]);
        assert_eq!(p.path(5), [0, 3, 4, 5]);
        // Plain causal: one node.
        let p = Paths::from_kv_end(&[4, 4, 4, 4]).unwrap();
        assert_eq!((p.nodes(), p.levels()), (1, 1));
        // Varlen: three independent chains, all roots of level 0.
        let p = Paths::from_kv_end(&[2, 2, 3, 5, 5]).unwrap();
        assert_eq!(p.parent, [-1, 0, -1, -1, 3]);
        assert_eq!((p.nodes(), p.levels()), (3, 1));
        assert!(Paths::from_kv_end(&[]).unwrap().is_empty());
    }

    #[test]
    fn rejects_ranges_that_do_not_nest_or_leave_the_pack() {
        let e = Paths::from_kv_end(&[3, 4, 4, 4]).unwrap_err();
        assert!(e.to_string().contains("do not nest"), "{e}");
        let e = Paths::from_kv_end(&[2, 0, 2]).unwrap_err();
        assert!(e.to_string().contains("kv_end[1] = 0"), "{e}");
        let e = Paths::from_kv_end(&[5, 2]).unwrap_err();
        assert!(e.to_string().contains("kv_end[0] = 5"), "{e}");
        let kv = [2u32, 2];
        let pos = [0u32, 1];
        assert!(Paths::new(&PackMask::new(&kv, &pos).unwrap()).is_ok());
    }
}
