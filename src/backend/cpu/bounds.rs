//! Per-key-tile bounds of `kv_end` and the tile and register-block
//! classification built on them (DESIGN §5): which (query tile, key tile)
//! pairs are skipped, computed without a mask or masked, and inside a
//! partial tile which register blocks are.

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
pub(crate) struct KeyTileBounds {
    len: usize,
    min_end: Vec<u32>,
    max_end: Vec<u32>,
    /// Min and max `kv_end` per group of `NS` keys.
    strip_min: Vec<u32>,
    strip_max: Vec<u32>,
    /// `kv_end` padded with 0 (seen by no query) to whole tiles.
    padded_ends: Vec<u32>,
}

impl KeyTileBounds {
    pub(crate) fn new(kv_end: &[u32]) -> Self {
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
        }
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
                if ka <= qb && hi_end > qa {
                    m.live |= bit;
                    if kb <= qa && lo_end > qb {
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
    /// seen by all of these queries (`kv_end >= q1`) or by none (`kv_end <=
    /// q0`); `None` if some key is seen by some of them only.
    pub(crate) fn uniform_keys(&self, q0: usize, q1: usize, kt: usize) -> Option<u64> {
        use microkernel::{NS, STRIPS};
        debug_assert!((kt + 1) * TILE <= q0);
        let mut seen = 0u64;
        for cs in 0..STRIPS {
            let s = kt * STRIPS + cs;
            if self.strip_min[s] as usize >= q1 {
                seen |= ((1 << NS) - 1) << (cs * NS);
            } else if self.strip_max[s] as usize > q0 {
                for (j, &end) in self.strip_ends(s * NS).iter().enumerate() {
                    if end as usize >= q1 {
                        seen |= 1 << (cs * NS + j);
                    } else if end as usize > q0 {
                        return None;
                    }
                }
            }
        }
        Some(seen)
    }

    /// Class of the block of queries `[q0, q1)` against key tile `kt`.
    #[inline]
    pub(crate) fn classify(&self, q0: usize, q1: usize, kt: usize) -> TileClass {
        let k0 = kt * TILE;
        let k1 = (k0 + TILE).min(self.len);
        crate::mask::classify_tile(q0, q1, k0, k1, self.min_end[kt], self.max_end[kt])
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
    /// every pass computes). The census must find skipped and unmasked
    /// blocks inside partial tiles, or the test would prove nothing.
    #[test]
    fn register_block_masks_are_sound() {
        use microkernel::{MR, NS, STRIPS};
        let (mut dead, mut full) = (0, 0);
        for seed in 0..6u64 {
            let l = [200, 257, 64 * 5 + 3][seed as usize % 3];
            let kv_end = random_kv_end(seed, l);
            let b = KeyTileBounds::new(&kv_end);
            let seen = |q: usize, k: usize| k <= q && q < kv_end[k] as usize;
            let tiles = l.div_ceil(TILE);
            for qt in 0..tiles {
                let (q0, q1) = (qt * TILE, ((qt + 1) * TILE).min(l));
                for kt in 0..=qt {
                    let k0 = kt * TILE;
                    let k1 = (k0 + TILE).min(l);
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
        assert!(dead > 100 && full > 100, "{dead} skipped, {full} unmasked");
    }
}
