//! Per-key-tile bounds of `kv_end` and the tile and register-block
//! classification built on them (DESIGN §5): which (query tile, key tile)
//! pairs are skipped, computed without a mask or masked, and inside a
//! partial tile which register blocks are.
//!
//! With a sliding window the visible keys of query `q` are also bounded
//! below, by `starts[q]` ([`crate::mask::PackMask::window_starts`]): query
//! `q` sees key `k` iff `starts[q] <= k <= q < kv_end[k]`. The per-query-tile
//! and per-register-block min / max of `starts` then tighten the rules: a
//! block whose keys all precede every row's start is skipped, and only a
//! block whose keys are at or after every row's start can be unmasked.

use super::microkernel::{self, LiveBlocks};
use super::{TileClass, TILE};

/// Register-block masks of one tile (see [`LiveBlocks`]): `live` blocks
/// hold a visible entry, `full` ones (a subset) hold only visible entries.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct BlockMasks {
    pub live: LiveBlocks,
    pub full: LiveBlocks,
}

/// Per key tile, the min and max of `kv_end` over its keys, and over the
/// finer key groups the micro-kernels' register blocks cover ([`microkernel::NS`]
/// keys): computed once per call.
pub struct KeyTileBounds {
    len: usize,
    min_end: Vec<u32>,
    max_end: Vec<u32>,
    /// Min and max `kv_end` per group of `NS` keys.
    strip_min: Vec<u32>,
    strip_max: Vec<u32>,
    /// `kv_end` padded with 0 (seen by no query) to whole tiles.
    padded_ends: Vec<u32>,
    /// With a sliding window: the first key of each query's window and its
    /// bounds per query tile and register block.
    window: Option<WindowBounds>,
}

/// Per query row, the first key of its sliding window (`starts`), and the
/// min and max of it over each query tile (`TILE` rows) and each register
/// block of rows ([`microkernel::MR`]).
struct WindowBounds {
    starts: Vec<u32>,
    tile_min: Vec<u32>,
    tile_max: Vec<u32>,
    block_min: Vec<u32>,
    block_max: Vec<u32>,
}

impl WindowBounds {
    fn new(starts: Vec<u32>) -> Self {
        let mins = |n: usize| -> Vec<u32> {
            starts
                .chunks(n)
                .map(|c| c.iter().copied().min().unwrap_or(0))
                .collect()
        };
        let maxes = |n: usize| -> Vec<u32> {
            starts
                .chunks(n)
                .map(|c| c.iter().copied().max().unwrap_or(0))
                .collect()
        };
        WindowBounds {
            tile_min: mins(TILE),
            tile_max: maxes(TILE),
            block_min: mins(microkernel::MR),
            block_max: maxes(microkernel::MR),
            starts,
        }
    }
}

impl KeyTileBounds {
    /// The bounds of the pack whose interval mask is `kv_end`.
    pub fn new(kv_end: &[u32]) -> Self {
        let maxes = |n: usize| -> Vec<u32> {
            kv_end
                .chunks(n)
                .map(|c| c.iter().copied().max().unwrap_or(0))
                .collect()
        };
        let mins = |n: usize| -> Vec<u32> {
            kv_end
                .chunks(n)
                .map(|c| c.iter().copied().min().unwrap_or(0))
                .collect()
        };
        KeyTileBounds {
            len: kv_end.len(),
            min_end: mins(TILE),
            strip_min: mins(microkernel::NS),
            max_end: maxes(TILE),
            strip_max: maxes(microkernel::NS),
            padded_ends: (0..kv_end.len().div_ceil(TILE) * TILE)
                .map(|k| kv_end.get(k).copied().unwrap_or(0))
                .collect(),
            window: None,
        }
    }

    /// The same bounds under a sliding window whose first key per query
    /// row is `starts` (one per token,
    /// [`crate::mask::PackMask::window_starts`]).
    pub(crate) fn with_window(mut self, starts: Vec<u32>) -> Self {
        debug_assert_eq!(starts.len(), self.len);
        self.window = Some(WindowBounds::new(starts));
        self
    }

    /// The first key of the windows of the query rows from `q0` (a slice
    /// of the rest of the pack), with a sliding window.
    #[inline]
    pub(crate) fn window_starts(&self, q0: usize) -> Option<&[u32]> {
        self.window.as_ref().map(|w| &w.starts[q0.min(self.len)..])
    }

    /// The smallest and largest window start over the query tile from `q0`
    /// (a multiple of `TILE`), with a sliding window.
    #[inline]
    fn tile_starts(&self, q0: usize) -> Option<(usize, usize)> {
        debug_assert_eq!(q0 % TILE, 0);
        self.window.as_ref().map(|w| {
            (
                w.tile_min[q0 / TILE] as usize,
                w.tile_max[q0 / TILE] as usize,
            )
        })
    }

    /// `kv_end` of keys `k..k + NS` (`k` a multiple of `NS` within the
    /// padded tiles), 0 for keys past the last token.
    #[inline(always)]
    pub(crate) fn strip_ends(&self, k: usize) -> &[u32; microkernel::NS] {
        self.padded_ends[k..k + microkernel::NS]
            .try_into()
            .expect("NS keys")
    }

    /// The register blocks of the (queries `[q0, q1)`, keys from `k0`) tile
    /// that hold a visible entry, and those whose entries are all visible,
    /// with query rows and key columns (forward, dQ). A block of queries
    /// `[qa, qb]` and keys `[ka, kb]` holds none when `ka > qb` (all keys
    /// after all queries) or the keys' largest `kv_end` is `<= qa` (they are
    /// seen by none of the queries); blocks past the last token or query
    /// hold none either. It needs no mask when `kb <= qa` and the keys'
    /// smallest `kv_end` is `> qb` (DESIGN §5's rules, per block).
    #[inline]
    pub(crate) fn query_row_blocks(&self, q0: usize, q1: usize, k0: usize) -> BlockMasks {
        use microkernel::{MR, NS, STRIPS};
        if self.whole_and_full(q0, q1, k0) {
            return BlockMasks {
                live: LiveBlocks::MAX,
                full: LiveBlocks::MAX,
            };
        }
        let mut m = BlockMasks::default();
        for cs in 0..STRIPS {
            let ka = k0 + cs * NS;
            if ka >= self.len {
                break;
            }
            let kb = (ka + NS).min(self.len) - 1;
            let (lo_end, hi_end) = (
                self.strip_min[ka / NS] as usize,
                self.strip_max[ka / NS] as usize,
            );
            for rb in 0..TILE / MR {
                let qa = q0 + rb * MR;
                if qa >= q1 {
                    break;
                }
                let qb = (qa + MR).min(q1) - 1;
                let bit = microkernel::block_bit(rb * MR, cs);
                // Window starts of the block's rows (none: every key from 0).
                let (lo_start, hi_start) = match &self.window {
                    Some(w) => (w.block_min[qa / MR] as usize, w.block_max[qa / MR] as usize),
                    None => (0, 0),
                };
                if ka <= qb && hi_end > qa && kb >= lo_start {
                    m.live |= bit;
                    if kb <= qa && lo_end > qb && ka >= hi_start {
                        m.full |= bit;
                    }
                }
            }
        }
        m
    }

    /// Whether the tile of queries `[q0, q1)` and keys from `k0` has `TILE`
    /// of each and all its entries visible: then every register block is
    /// live and needs no mask, without looking at them one by one.
    #[inline]
    fn whole_and_full(&self, q0: usize, q1: usize, k0: usize) -> bool {
        q1 - q0 == TILE
            && k0 + TILE <= self.len
            && self.classify(q0, q1, k0 / TILE) == TileClass::Full
    }

    /// The keys of key tile `kt`, which lies wholly before `q0`, seen by the
    /// queries `[q0, q1)` (bit `j` = key `kt · TILE + j`), if each of them is
    /// seen by all of these queries (`kv_end >= q1`, and with a window at or
    /// after every row's start) or by none (`kv_end <= q0`, or before every
    /// row's start); `None` if some key is seen by some of them only.
    pub(crate) fn uniform_keys(&self, q0: usize, q1: usize, kt: usize) -> Option<u64> {
        use microkernel::{NS, STRIPS};
        debug_assert!((kt + 1) * TILE <= q0);
        let (lo_start, hi_start) = self.tile_starts(q0).unwrap_or((0, 0));
        // With a window, the smallest start over rows q0 ..= q0 + i: a key
        // that rows [q0, e) could see is in none of their windows iff it
        // precedes the smallest of their starts.
        let first_starts = self.window.as_ref().map(|w| {
            let mut least = u32::MAX;
            let rows = &w.starts[q0..q1];
            rows.iter()
                .map(|&st| {
                    least = least.min(st);
                    least as usize
                })
                .collect::<Vec<usize>>()
        });
        let mut seen = 0u64;
        for cs in 0..STRIPS {
            let s = kt * STRIPS + cs;
            let ka = s * NS;
            if ka + NS <= lo_start || self.strip_max[s] as usize <= q0 {
                // Before every row's window, or past every key's range.
                continue;
            }
            if self.strip_min[s] as usize >= q1 && ka >= hi_start {
                seen |= ((1 << NS) - 1) << (cs * NS);
                continue;
            }
            for (j, &end) in self.strip_ends(ka).iter().enumerate() {
                let (key, end) = (ka + j, end as usize);
                if end <= q0 {
                    continue;
                }
                // The rows that could see the key are [q0, min(end, q1)).
                let last = end.min(q1) - 1 - q0;
                if first_starts.as_ref().is_some_and(|f| key < f[last]) {
                    continue;
                }
                if end >= q1 && key >= hi_start {
                    seen |= 1 << (cs * NS + j);
                } else {
                    return None;
                }
            }
        }
        Some(seen)
    }

    /// Class of the block of queries `[q0, q1)` (a query tile: `q0` a
    /// multiple of `TILE`) against key tile `kt`.
    #[inline]
    pub fn classify(&self, q0: usize, q1: usize, kt: usize) -> TileClass {
        let k0 = kt * TILE;
        let k1 = (k0 + TILE).min(self.len);
        let class = crate::mask::classify_tile(q0, q1, k0, k1, self.min_end[kt], self.max_end[kt]);
        match self.tile_starts(q0) {
            // Every key before every row's window.
            Some((lo, _)) if k1 <= lo => TileClass::Skip,
            // Some key before some row's window.
            Some((_, hi)) if class == TileClass::Full && k0 < hi => TileClass::Partial,
            _ => class,
        }
    }

    /// One past the last query tile that can see key tile `kt`.
    #[inline]
    pub(crate) fn query_tile_end(&self, kt: usize) -> usize {
        (self.max_end[kt] as usize).div_ceil(TILE)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// DESIGN §5's rules on a pack with a trunk `[0, 64)` seen by all, a
    /// branch `[64, 128)` and a sibling branch `[128, 192)`.
    #[test]
    fn classification_follows_the_design_rules() {
        let kv_end: Vec<u32> = (0..192)
            .map(|k| {
                if k < 64 {
                    192
                } else if k < 128 {
                    128
                } else {
                    192
                }
            })
            .collect();
        let b = KeyTileBounds::new(&kv_end);
        assert_eq!(b.classify(64, 128, 0), TileClass::Full);
        assert_eq!(b.classify(128, 192, 1), TileClass::Skip, "sibling branch");
        assert_eq!(b.classify(128, 192, 0), TileClass::Full);
        assert_eq!(b.classify(0, 64, 0), TileClass::Partial, "diagonal");
        assert_eq!(b.classify(0, 64, 1), TileClass::Skip, "above the diagonal");
        assert_eq!(
            (
                b.query_tile_end(0),
                b.query_tile_end(1),
                b.query_tile_end(2)
            ),
            (3, 2, 3)
        );
        // A padding key makes an otherwise full block partial.
        let mut padded = kv_end.clone();
        padded[5] = 5;
        assert_eq!(
            KeyTileBounds::new(&padded).classify(64, 128, 0),
            TileClass::Partial
        );
    }

    /// A random `kv_end` with `k < kv_end[k] <= l`, or `== k` (padding) for
    /// a few keys: the block rules only assume `kv_end[k] >= k`.
    fn random_kv_end(seed: u64, l: usize) -> Vec<u32> {
        let mut s = seed;
        let mut next = move |n: usize| {
            s = s
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (s >> 33) as usize % n
        };
        let mut kv_end = vec![l as u32; l];
        // Nested closed subtrees of varied sizes, so that blocks are
        // visible, invisible and mixed; and some padding keys.
        for _ in 0..l / 32 {
            let k = next(l);
            let size = 1 + next(3 * microkernel::NS);
            let end = (k + size).min(l) as u32;
            for e in &mut kv_end[k..(k + size).min(l)] {
                *e = (*e).min(end);
            }
        }
        for _ in 0..l / 100 {
            let k = next(l);
            kv_end[k] = k as u32;
        }
        kv_end
    }

    /// Every register block the kernels skip holds no visible entry, and
    /// every block they compute without a mask holds only visible ones,
    /// checked entry by entry (the blocks of query rows and key columns that
    /// every pass computes) — and every tile they skip, resp. compute
    /// without a mask, likewise; with no window and with sliding windows of
    /// 1, 3 and 17 levels (`seen` then also needs `starts[q] <= k`). The
    /// census must find skipped and unmasked blocks inside partial tiles, or
    /// the test would prove nothing.
    #[test]
    fn register_block_masks_are_sound() {
        use microkernel::{MR, NS, STRIPS};
        for window in [None, Some(1), Some(3), Some(17)] {
            let (mut dead, mut full, mut skipped) = (0, 0, 0);
            for seed in 0..6u64 {
                let l = [200, 257, 64 * 5 + 3][seed as usize % 3];
                let kv_end = random_kv_end(seed, l);
                let pos = vec![0u32; l];
                let mask = crate::mask::PackMask::new(&kv_end, &pos).unwrap();
                let starts = window.map(|w| mask.window_starts(w).unwrap());
                let mut b = KeyTileBounds::new(&kv_end);
                if let Some(st) = &starts {
                    b = b.with_window(st.clone());
                }
                let seen = |q: usize, k: usize| {
                    starts.as_ref().is_none_or(|st| st[q] as usize <= k)
                        && k <= q
                        && q < kv_end[k] as usize
                };
                let tiles = l.div_ceil(TILE);
                for qt in 0..tiles {
                    let (q0, q1) = (qt * TILE, ((qt + 1) * TILE).min(l));
                    for kt in 0..=qt {
                        let k0 = kt * TILE;
                        let k1 = (k0 + TILE).min(l);
                        let tile: Vec<bool> = (q0..q1)
                            .flat_map(|q| (k0..k1).map(move |k| (q, k)))
                            .map(|(q, k)| seen(q, k))
                            .collect();
                        match b.classify(q0, q1, kt) {
                            TileClass::Skip => {
                                assert!(!tile.contains(&true), "skipped a visible tile");
                                skipped += 1;
                            }
                            TileClass::Full => {
                                assert!(tile.iter().all(|&v| v), "a hidden pair in a full tile")
                            }
                            TileClass::Partial => {}
                        }
                        let m = b.query_row_blocks(q0, q1, k0);
                        assert_eq!(m.full & !m.live, 0, "full blocks are live");
                        for rb in 0..TILE / MR {
                            for cs in 0..STRIPS {
                                let bit = microkernel::block_bit(rb * MR, cs);
                                // Query rows rb, key strip cs.
                                let qs = (q0 + rb * MR..q0 + (rb + 1) * MR).filter(|&q| q < q1);
                                let ks = (k0 + cs * NS..k0 + (cs + 1) * NS).filter(|&k| k < k1);
                                let pairs: Vec<bool> = qs
                                    .flat_map(|q| ks.clone().map(move |k| (q, k)))
                                    .map(|(q, k)| seen(q, k))
                                    .collect();
                                if m.live & bit == 0 {
                                    assert!(!pairs.contains(&true), "skipped a visible entry");
                                    dead += !pairs.is_empty() as usize;
                                }
                                if m.full & bit != 0 {
                                    assert!(pairs.iter().all(|&v| v), "unmasked a hidden entry");
                                    full += 1;
                                }
                            }
                        }
                    }
                }
            }
            assert!(
                // (A window of 1 to 3 levels leaves few all-visible blocks.)
                dead > 100
                    && (full > 100 || window.is_some_and(|w| w <= 3))
                    && (window.is_none() || skipped > 0),
                "window {window:?}: {dead} blocks skipped, {full} unmasked, {skipped} tiles skipped"
            );
        }
    }
}
