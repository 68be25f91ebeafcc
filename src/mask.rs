//! The interval mask of a pack and the utilities around it.
//!
//! A pack of length `L` carries one integer per key, `kv_end[k]`, and the
//! exact attention rule is
//!
//! ```text
//! query q may attend to key k   <=>   k <= q < kv_end[k]
//! ```
//!
//! (DESIGN §4: `kv_end[k]` is the exclusive end of the pre-order range of the
//! subtree of `k`'s trie node). Plain causal attention is `kv_end = L`; a
//! varlen batch of independent sequences is `kv_end = end of own sequence`.

use crate::{Error, Result};

/// The part of a pack that attention needs: the interval mask and the
/// position ids (one per packed token, used by rotary embeddings).
///
/// A `PackMask` is valid by construction: [`PackMask::new`] is the only way
/// to make one, so every backend reads `kv_end` and the position ids without
/// checking them again (a kernel indexes with them: an invalid `kv_end` or
/// too few position ids would read out of bounds).
#[derive(Clone, Copy, Debug)]
pub struct PackMask<'a> {
    kv_end: &'a [u32],
    position_ids: &'a [u32],
}

impl<'a> PackMask<'a> {
    /// Checks the invariants every op relies on and returns the mask:
    /// equal lengths and `k <= kv_end[k] <= L` for every key.
    ///
    /// `kv_end[k] == k` marks a *padding* key that no query sees, not even its
    /// own row; a query row with no visible key gets `O = 0`, `LSE = −inf`.
    /// Packs built from rollouts always have `kv_end[k] > k`.
    pub fn new(kv_end: &'a [u32], position_ids: &'a [u32]) -> Result<Self> {
        let l = kv_end.len();
        if position_ids.len() != l {
            return Err(Error::Pack(format!(
                "kv_end has {l} entries but position_ids has {}",
                position_ids.len()
            )));
        }
        if l > u32::MAX as usize {
            return Err(Error::Pack(format!(
                "pack of {l} tokens exceeds u32 indexing"
            )));
        }
        for (k, &e) in kv_end.iter().enumerate() {
            if (e as usize) < k || (e as usize) > l {
                return Err(Error::Pack(format!(
                    "kv_end[{k}] = {e} breaks {k} <= kv_end[k] <= {l} (a key's range starts at itself and stays inside the pack)"
                )));
            }
        }
        Ok(PackMask {
            kv_end,
            position_ids,
        })
    }

    /// A mask already validated by [`PackMask::new`] (a
    /// [`crate::plan::MaskPlan`] keeps only validated data).
    pub(crate) fn trusted(kv_end: &'a [u32], position_ids: &'a [u32]) -> Self {
        debug_assert!(PackMask::new(kv_end, position_ids).is_ok());
        PackMask {
            kv_end,
            position_ids,
        }
    }

    /// `kv_end[k]`: key `k` is seen by the queries `k <= q < kv_end[k]`.
    pub fn kv_end(&self) -> &'a [u32] {
        self.kv_end
    }

    /// One position id per packed token (its depth in the trie).
    pub fn position_ids(&self) -> &'a [u32] {
        self.position_ids
    }

    /// Number of packed tokens `L`.
    pub fn len(&self) -> usize {
        self.kv_end.len()
    }

    /// True for an empty pack.
    pub fn is_empty(&self) -> bool {
        self.kv_end.is_empty()
    }

    /// Whether query `q` may attend to key `k`.
    #[inline]
    pub fn visible(&self, q: usize, k: usize) -> bool {
        k <= q && q < self.kv_end[k] as usize
    }

    /// Number of visible (query, key) pairs: `Σ_k (kv_end[k] − k)`. This is
    /// the FLOP-count basis of DESIGN §7 (4·d FLOPs per pair per head forward).
    pub fn visible_pairs(&self) -> u64 {
        self.kv_end
            .iter()
            .enumerate()
            .map(|(k, &e)| e as u64 - k as u64)
            .sum()
    }

    /// Per key: whether no query sees it (`kv_end[k] == k`, a padding key).
    /// Its K and V rows enter no visible pair, and every backend ignores
    /// what they hold (DESIGN §5).
    pub fn unseen_keys(&self) -> Vec<bool> {
        self.kv_end
            .iter()
            .enumerate()
            .map(|(k, &e)| e as usize <= k)
            .collect()
    }

    /// Per query row: whether it sees no key (`max_{k <= q} kv_end[k] <= q`;
    /// its O is 0 and its LSE `−inf`). Its Q and dO rows enter no visible
    /// pair, and every backend ignores what they hold (DESIGN §5).
    pub fn blind_queries(&self) -> Vec<bool> {
        let mut reach = 0u32;
        self.kv_end
            .iter()
            .enumerate()
            .map(|(q, &e)| {
                reach = reach.max(e);
                reach as usize <= q
            })
            .collect()
    }

    /// Whether the key ranges nest, as a tree's subtrees do: for keys
    /// `j < k` that are not padding, `[k, kv_end[k])` lies inside
    /// `[j, kv_end[j])` or after it. Every pack, varlen batch and causal
    /// mask does; a valid interval mask need not (crossing ranges are a
    /// mask of no tree, refused by [`Self::window_starts`]). `O(L)`.
    pub fn is_tree(&self) -> bool {
        self.crossing_key().is_none()
    }

    /// The first key whose range crosses an enclosing one (see
    /// [`Self::is_tree`]), with that enclosing key.
    fn crossing_key(&self) -> Option<(usize, usize)> {
        let mut open: Vec<usize> = Vec::new();
        for (k, &e) in self.kv_end.iter().enumerate() {
            while open.last().is_some_and(|&j| self.kv_end[j] as usize <= k) {
                open.pop();
            }
            if e as usize > k {
                if let Some(&j) = open.last() {
                    if e > self.kv_end[j] {
                        return Some((k, j));
                    }
                }
                open.push(k);
            }
        }
        None
    }

    /// Per query row, the first key of its sliding window of `window` tree
    /// levels: query `q` sees key `k` under the window iff
    ///
    /// ```text
    /// starts[q] <= k <= q < kv_end[k]
    /// ```
    ///
    /// On a tree the keys `q` sees are its ancestors and itself, at depths
    /// `0, 1, …, depth(q)` in increasing row order, where `depth(q) = #{k <
    /// q : kv_end[k] > q}`; the window keeps those with `depth(q) −
    /// depth(k) < window`, which is every visible key from the ancestor at
    /// depth `depth(q) + 1 − window` on (the root when that is negative):
    /// `starts[q]` is that ancestor's row, or `q` when no ancestor is kept
    /// (`window == 1`). On a chain (causal) `starts[q] = max(0, q + 1 −
    /// window)`: transformers' sliding window `q − k < window`; on a pack
    /// the depth is the position id. One stack walk, `O(L)`.
    ///
    /// Errors: `window == 0`, or crossing key ranges ([`Self::is_tree`]:
    /// the depth of a row is not defined), [`Error::Pack`] naming the keys.
    pub fn window_starts(&self, window: u32) -> Result<Vec<u32>> {
        if window == 0 {
            return Err(Error::Unsupported("window = 0: must be >= 1".into()));
        }
        if let Some((k, j)) = self.crossing_key() {
            return Err(Error::Pack(format!(
                "a sliding window needs a tree-shaped mask, but the range of key {k} (kv_end {}) crosses that of key {j} (kv_end {}): the rows have no tree depth",
                self.kv_end[k], self.kv_end[j]
            )));
        }
        let w = window as usize;
        let mut path: Vec<u32> = Vec::new();
        let mut starts = Vec::with_capacity(self.len());
        for (t, &e) in self.kv_end.iter().enumerate() {
            while path
                .last()
                .is_some_and(|&j| self.kv_end[j as usize] as usize <= t)
            {
                path.pop();
            }
            // `path` holds t's ancestors, at depths 0 .. depth(t); t itself
            // (unless a padding key) is next, at depth(t) = path.len().
            let first_kept = (path.len() + 1).saturating_sub(w);
            starts.push(path.get(first_kept).copied().unwrap_or(t as u32));
            if e as usize > t {
                path.push(t as u32);
            }
        }
        Ok(starts)
    }

    /// [`Self::blind_queries`] with a first visible key per query row
    /// (`starts`: a sliding window's [`Self::window_starts`], or explicit
    /// key starts): a query sees no key when its last visible key precedes
    /// its start (a padding row's window of one level, say). On a tree
    /// the last visible key of row `q` is `q` itself, or, for a padding
    /// row, its parent: one stack walk, `O(L)`.
    pub fn blind_queries_in(&self, starts: Option<&[u32]>) -> Vec<bool> {
        let Some(starts) = starts else {
            return self.blind_queries();
        };
        let mut path: Vec<usize> = Vec::new();
        let mut blind = Vec::with_capacity(self.len());
        for (t, &e) in self.kv_end.iter().enumerate() {
            while path.last().is_some_and(|&j| self.kv_end[j] as usize <= t) {
                path.pop();
            }
            let last = if e as usize > t {
                Some(t)
            } else {
                path.last().copied()
            };
            blind.push(last.is_none_or(|k| k < starts[t] as usize));
            if e as usize > t {
                path.push(t);
            }
        }
        blind
    }

    /// A 64-bit FNV-1a fingerprint of `kv_end` and `position_ids`. Ops store
    /// it with saved forward state so that a backward call with a pack from
    /// another batch is rejected instead of silently computing garbage.
    pub fn fingerprint(&self) -> u64 {
        fingerprint(self.kv_end, self.position_ids)
    }
}

/// [`PackMask::fingerprint`] of `kv_end` and position ids, valid or not.
pub(crate) fn fingerprint(kv_end: &[u32], position_ids: &[u32]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &x in kv_end.iter().chain(position_ids.iter()) {
        for b in x.to_le_bytes() {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h ^ (kv_end.len() as u64)
}

/// The `kv_end` of a pre-order layout whose position ids are depths (every
/// pack this crate writes, TRL's tree rows, and Hugging Face's
/// padding-free packed batches, where each sequence restarts at 0): row
/// `j`'s parent is the last row before it one level up, so
///
/// ```text
/// kv_end[k] = the first j > k with position_ids[j] <= position_ids[k], else L
/// ```
///
/// One stack walk, `O(L)`. A padding-free batch of sequences is a forest of
/// chains (`kv_end` = end of own sequence); a plain `0 … L−1` is causal.
///
/// Errors ([`Error::Pack`], naming the row): a first row that is not a root
/// (`position_ids[0] != 0`), a position that rises by more than 1 from one
/// row to the next (no tree has it in pre-order: a row's parent must be the
/// row before it or earlier), more than `u32::MAX` rows.
pub fn kv_end_from_positions(position_ids: &[u32]) -> Result<Vec<u32>> {
    let l = position_ids.len();
    if l > u32::MAX as usize {
        return Err(Error::Pack(format!("{l} position ids exceed u32 indexing")));
    }
    let mut kv_end = vec![l as u32; l];
    // Rows whose subtree is still open, depths strictly increasing.
    let mut open: Vec<u32> = Vec::new();
    for (j, &p) in position_ids.iter().enumerate() {
        let limit = if j == 0 {
            0
        } else {
            position_ids[j - 1] as u64 + 1
        };
        if p as u64 > limit {
            return Err(Error::Pack(if j == 0 {
                format!(
                    "position_ids[0] = {p}: the first row must be a root (depth 0) in a pre-order layout whose position ids are depths"
                )
            } else {
                format!(
                    "position_ids[{j}] = {p} after position_ids[{}] = {}: a depth rises by at most 1 from one row to the next in a pre-order layout (a row's parent is an earlier row one level up)",
                    j - 1,
                    position_ids[j - 1]
                )
            }));
        }
        while let Some(&k) = open.last() {
            if position_ids[k as usize] < p {
                break;
            }
            kv_end[k as usize] = j as u32;
            open.pop();
        }
        open.push(j as u32);
    }
    Ok(kv_end)
}

/// The dense boolean mask `[L, L]`, row-major `[q][k]`: entry `q * L + k` is
/// `k <= q < kv_end[k]`. For frameworks that take a 4D attention mask
/// (broadcast it over batch and heads); `O(L²)` memory, so for interop and
/// tests, not for long packs.
pub fn dense_mask(kv_end: &[u32]) -> Vec<bool> {
    let l = kv_end.len();
    let mut m = vec![false; l * l];
    for (k, &e) in kv_end.iter().enumerate() {
        for q in k..(e as usize).min(l) {
            m[q * l + k] = true;
        }
    }
    m
}

/// How a (query tile, key tile) block of the mask is handled (DESIGN §5).
/// Every backend (CPU tiles, the CUDA kernels' launch planning, [`TileMap`])
/// classifies with [`classify_tile`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TileClass {
    /// No visible pair: the block is not computed (on the GPU, never loaded).
    Skip,
    /// Every pair visible: no per-element mask needed.
    Full,
    /// Mixed: mask element-wise.
    Partial,
}

/// The tile rule of DESIGN §5 for query tile `[q0, q1)` and key tile
/// `[k0, k1)` (both non-empty), given the min and max of `kv_end` over the
/// key tile:
///
/// ```text
/// Skip     k0 > q1 − 1  or  max kv_end <= q0
/// Full     k1 − 1 <= q0  and  min kv_end >= q1
/// Partial  otherwise
/// ```
///
/// Skip and Full are exact (no pair, resp. every pair, is visible: the keys
/// precede every query and each key's range covers the query tile); Partial
/// may be conservative.
#[inline]
pub fn classify_tile(
    q0: usize,
    q1: usize,
    k0: usize,
    k1: usize,
    kv_min: u32,
    kv_max: u32,
) -> TileClass {
    debug_assert!(q0 < q1 && k0 < k1);
    if k0 + 1 > q1 || kv_max as usize <= q0 {
        TileClass::Skip
    } else if k1 <= q0 + 1 && kv_min as usize >= q1 {
        TileClass::Full
    } else {
        TileClass::Partial
    }
}

/// Per-tile classification of a pack's mask for tile sizes
/// `(q_tile, k_tile)`. With query tile `[q0, q1)` and key tile `[k0, k1)`
/// (the last tiles may be short):
///
/// - `Skip` when `k0 > q1 − 1` or `max(kv_end[k0..k1]) <= q0`;
/// - `Full` when `k1 − 1 <= q0` and `min(kv_end[k0..k1]) >= q1`;
/// - `Partial` otherwise.
///
/// Skip is exact (no pair is visible) and Full is exact (all pairs are);
/// Partial may be conservative (a block with all or no pairs visible).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TileMap {
    q_tile: usize,
    k_tile: usize,
    len: usize,
    key_min: Vec<u32>,
    key_max: Vec<u32>,
    classes: Vec<TileClass>,
}

impl TileMap {
    /// Classifies every block of `mask`; tile sizes must be positive.
    pub fn new(mask: &PackMask<'_>, q_tile: usize, k_tile: usize) -> Result<TileMap> {
        if q_tile == 0 || k_tile == 0 {
            return Err(Error::Shape(format!(
                "tile sizes must be positive, got q_tile = {q_tile}, k_tile = {k_tile}"
            )));
        }
        let l = mask.len();
        let (key_min, key_max): (Vec<u32>, Vec<u32>) = mask
            .kv_end
            .chunks(k_tile)
            .map(|c| {
                (
                    *c.iter().min().expect("chunks are non-empty"),
                    *c.iter().max().expect("chunks are non-empty"),
                )
            })
            .unzip();
        let nq = l.div_ceil(q_tile);
        let mut classes = Vec::with_capacity(nq * key_min.len());
        for qt in 0..nq {
            let (q0, q1) = (qt * q_tile, ((qt + 1) * q_tile).min(l));
            for kt in 0..key_min.len() {
                let (k0, k1) = (kt * k_tile, ((kt + 1) * k_tile).min(l));
                classes.push(classify_tile(q0, q1, k0, k1, key_min[kt], key_max[kt]));
            }
        }
        Ok(TileMap {
            q_tile,
            k_tile,
            len: l,
            key_min,
            key_max,
            classes,
        })
    }

    /// Query tile size.
    pub fn q_tile(&self) -> usize {
        self.q_tile
    }

    /// Key tile size.
    pub fn k_tile(&self) -> usize {
        self.k_tile
    }

    /// Number of query tiles, `ceil(L / q_tile)`.
    pub fn q_tiles(&self) -> usize {
        self.len.div_ceil(self.q_tile)
    }

    /// Number of key tiles, `ceil(L / k_tile)`.
    pub fn k_tiles(&self) -> usize {
        self.key_min.len()
    }

    /// `min(kv_end[k0..k1])` of each key tile.
    pub fn key_min(&self) -> &[u32] {
        &self.key_min
    }

    /// `max(kv_end[k0..k1])` of each key tile.
    pub fn key_max(&self) -> &[u32] {
        &self.key_max
    }

    /// Class of block (query tile `qt`, key tile `kt`); `None` out of range.
    pub fn class(&self, qt: usize, kt: usize) -> Option<TileClass> {
        (qt < self.q_tiles() && kt < self.k_tiles()).then(|| self.classes[qt * self.k_tiles() + kt])
    }

    /// Number of (skip, full, partial) blocks.
    pub fn counts(&self) -> (usize, usize, usize) {
        self.classes.iter().fold((0, 0, 0), |(s, f, p), c| match c {
            TileClass::Skip => (s + 1, f, p),
            TileClass::Full => (s, f + 1, p),
            TileClass::Partial => (s, f, p + 1),
        })
    }
}

/// FlexAttention's block view of a pack's mask: square blocks of `block`
/// queries × `block` keys, and for each query block the key blocks in which
/// every pair is visible (*full*) and those in which some but not all are
/// (*partial*), in ascending order. Exact, as FlexAttention's
/// `create_block_mask` classifies them — a block cut short by the end of
/// the pack counts as padded with masked pairs, so it is never full:
///
/// ```text
/// key block j < query block i   (every key precedes every query)
///   none visible  iff  max kv_end[k0..k1] <= q0
///   all visible   iff  min kv_end[k0..k1] >= q1  and the query block is whole
/// j == i   some visible iff one key of the block is not padding (its own row
///          sees it); all visible only for block = 1
/// j > i    none visible
/// ```
///
/// `O(L + n²)` for `n = ceil(L / block)` blocks, from the per-block min and
/// max of `kv_end` (the tile census every backend uses), with no `[L, L]`
/// mask and no mask evaluation per pair.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockCensus {
    /// Block size (queries and keys).
    pub block: usize,
    /// Per query block, the key blocks with every pair visible.
    pub full: Vec<Vec<u32>>,
    /// Per query block, the key blocks with some but not every pair visible.
    pub partial: Vec<Vec<u32>>,
}

impl BlockCensus {
    /// The census of `mask` for blocks of `block` (positive).
    pub fn new(mask: &PackMask<'_>, block: usize) -> Result<BlockCensus> {
        Self::windowed(mask, block, None)
    }

    /// The census of `mask` under a sliding window of `window` tree levels
    /// ([`PackMask::window_starts`]): a key block wholly before every
    /// row's window start is skipped, and only one at or after every row's
    /// start can be full. Errors: as [`PackMask::window_starts`].
    pub fn windowed(mask: &PackMask<'_>, block: usize, window: Option<u32>) -> Result<BlockCensus> {
        let tiles = TileMap::new(mask, block, block)?;
        let l = mask.len();
        let kv = mask.kv_end();
        let n = tiles.k_tiles();
        let starts = window.map(|w| mask.window_starts(w)).transpose()?;
        let (mut full, mut partial) = (vec![Vec::new(); n], vec![Vec::new(); n]);
        for i in 0..n {
            let (q0, q1) = (i * block, ((i + 1) * block).min(l));
            // The smallest and largest window start of the block's rows.
            let (lo, hi) = starts.as_ref().map_or((0, 0), |st| {
                let rows = &st[q0..q1];
                let lo = rows.iter().copied().min().unwrap_or(0) as usize;
                (lo, rows.iter().copied().max().unwrap_or(0) as usize)
            });
            for j in 0..i {
                if tiles.key_max()[j] as usize <= q0 || (j + 1) * block <= lo {
                    continue;
                }
                if tiles.key_min()[j] as usize >= q1 && q1 - q0 == block && j * block >= hi {
                    full[i].push(j as u32);
                } else {
                    partial[i].push(j as u32);
                }
            }
            if (q0..q1).any(|k| kv[k] as usize > k) {
                if block == 1 {
                    full[i].push(i as u32);
                } else {
                    partial[i].push(i as u32);
                }
            }
        }
        Ok(BlockCensus {
            block,
            full,
            partial,
        })
    }

    /// Number of blocks per side, `ceil(L / block)`.
    pub fn blocks(&self) -> usize {
        self.full.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_kv_end_that_does_not_cover_its_key() {
        let err = PackMask::new(&[2, 0], &[0, 1]).unwrap_err();
        assert!(err.to_string().contains("kv_end[1] = 0"), "{err}");
        // kv_end[k] == k is a padding key, allowed.
        assert!(PackMask::new(&[2, 1], &[0, 1]).is_ok());
        assert!(PackMask::new(&[3, 2], &[0, 1]).is_err());
        assert!(PackMask::new(&[2, 2], &[0]).is_err());
    }

    #[test]
    fn crossing_ranges_are_no_tree() {
        let m = PackMask::new(&[3, 4, 4, 4], &[0; 4]).unwrap();
        assert!(!m.is_tree());
        match m.window_starts(2) {
            Err(Error::Pack(msg)) => {
                assert!(msg.contains("key 1") && msg.contains("key 0"), "{msg}")
            }
            other => panic!("{other:?}"),
        }
        // Padding keys and a forest of chains are trees.
        assert!(PackMask::new(&[2, 1, 4, 4], &[0; 4]).unwrap().is_tree());
    }

    #[test]
    fn kv_end_from_positions_of_the_worked_example_chains_and_causal() {
        // DESIGN §4's golden pack: depths in, its kv_end out.
        let pos = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 2, 3, 4, 5, 6, 7];
        let kv = [
            16, 16, 10, 10, 10, 10, 10, 10, 10, 10, 16, 16, 16, 16, 16, 16,
        ];
        assert_eq!(kv_end_from_positions(&pos).unwrap(), kv);
        // Hugging Face padding-free packing (positions restart at 0): a
        // forest of chains, kv_end = end of own sequence.
        assert_eq!(
            kv_end_from_positions(&[0, 1, 2, 0, 1, 0, 0, 1, 2, 3]).unwrap(),
            [3, 3, 3, 5, 5, 6, 10, 10, 10, 10]
        );
        assert_eq!(kv_end_from_positions(&[0, 1, 2, 3]).unwrap(), [4; 4]);
        assert_eq!(kv_end_from_positions(&[0, 0, 0]).unwrap(), [1, 2, 3]);
        assert!(kv_end_from_positions(&[]).unwrap().is_empty());
    }

    #[test]
    fn kv_end_from_positions_refuses_what_is_no_pre_order_naming_the_row() {
        match kv_end_from_positions(&[1, 2]) {
            Err(Error::Pack(msg)) => assert!(msg.contains("position_ids[0] = 1"), "{msg}"),
            other => panic!("{other:?}"),
        }
        match kv_end_from_positions(&[0, 1, 2, 0, 2]) {
            Err(Error::Pack(msg)) => assert!(
                msg.contains("position_ids[4] = 2 after position_ids[3] = 0"),
                "{msg}"
            ),
            other => panic!("{other:?}"),
        }
        // An offset sequence (a second chunk of a long sequence) is refused
        // rather than read as a tree it is not.
        assert!(kv_end_from_positions(&[5, 6, 7]).is_err());
        assert!(kv_end_from_positions(&[0, u32::MAX]).is_err());
    }

    #[test]
    fn kv_end_from_positions_inverts_the_depths_of_random_forests() {
        use crate::rng::Rng;
        let mut rng = Rng::new(0x9051);
        for case in 0..300 {
            let l = 1 + rng.range(0, 80);
            // A random pre-order forest (no padding keys): each row closes
            // a random number of open subtrees, then opens its own.
            let (mut kv, mut open) = (vec![l as u32; l], Vec::new());
            for t in 0..l {
                for _ in 0..rng.range(0, open.len()) {
                    kv[open.pop().expect("counted")] = t as u32;
                }
                open.push(t);
            }
            let depth: Vec<u32> = (0..l)
                .map(|t| (0..t).filter(|&k| kv[k] as usize > t).count() as u32)
                .collect();
            assert_eq!(kv_end_from_positions(&depth).unwrap(), kv, "case {case}");
            // The rule as written: the first later row no deeper, else L.
            for (k, &e) in kv_end_from_positions(&depth).unwrap().iter().enumerate() {
                let first = (k + 1..l).find(|&j| depth[j] <= depth[k]).unwrap_or(l);
                assert_eq!(e as usize, first, "case {case} key {k}");
            }
            assert!(PackMask::new(&kv, &depth).unwrap().is_tree());
        }
    }

    #[test]
    fn causal_pairs_and_fingerprint() {
        let m = PackMask::new(&[4, 4, 4, 4], &[0, 1, 2, 3]).unwrap();
        assert_eq!(m.visible_pairs(), 10);
        assert!(m.visible(3, 0) && !m.visible(0, 3));
        let other = PackMask::new(&[2, 2, 4, 4], &[0, 1, 0, 1]).unwrap();
        assert_ne!(m.fingerprint(), other.fingerprint());
    }

    #[test]
    fn dense_mask_of_the_worked_example_branches() {
        // Two chains [0,2) and [2,4): block diagonal lower triangles.
        let m = dense_mask(&[2, 2, 4, 4]);
        let rows: Vec<Vec<bool>> = m.chunks(4).map(|r| r.to_vec()).collect();
        assert_eq!(rows[0], vec![true, false, false, false]);
        assert_eq!(rows[1], vec![true, true, false, false]);
        assert_eq!(rows[2], vec![false, false, true, false]);
        assert_eq!(rows[3], vec![false, false, true, true]);
    }

    #[test]
    fn tile_map_rejects_zero_tiles_and_classifies_chains() {
        let kv = [2, 2, 4, 4];
        let pos = [0, 1, 0, 1];
        let m = PackMask::new(&kv, &pos).unwrap();
        assert!(TileMap::new(&m, 0, 2).is_err());
        let t = TileMap::new(&m, 2, 2).unwrap();
        assert_eq!(t.class(0, 0), Some(TileClass::Partial)); // diagonal triangle
        assert_eq!(t.class(1, 0), Some(TileClass::Skip)); // other chain
        assert_eq!(t.class(0, 1), Some(TileClass::Skip)); // above the diagonal
        assert_eq!(t.class(2, 0), None);
        let t1 = TileMap::new(&m, 1, 1).unwrap();
        assert_eq!(t1.class(1, 0), Some(TileClass::Full));
        assert_eq!(t1.counts(), (10, 6, 0));
    }

    #[test]
    fn block_census_is_exact_against_the_dense_mask() {
        use crate::rng::Rng;
        let mut rng = Rng::new(0xb10c);
        for case in 0..200 {
            let l = 1 + rng.range(0, 70);
            // A random pre-order forest: each row closes a random number of
            // open subtrees, then opens its own; some rows are padding.
            let (mut kv, mut open) = (vec![l as u32; l], Vec::new());
            for t in 0..l {
                for _ in 0..rng.range(0, open.len()) {
                    kv[open.pop().expect("counted")] = t as u32;
                }
                open.push(t);
            }
            for (t, e) in kv.iter_mut().enumerate() {
                if case % 3 == 1 && rng.range(0, 8) == 0 {
                    *e = t as u32;
                }
            }
            let pos = vec![0; l];
            let m = PackMask::new(&kv, &pos).unwrap();
            let block = [1, 2, 3, 8, 16][case % 5];
            let c = BlockCensus::new(&m, block).unwrap();
            assert_eq!(c.blocks(), l.div_ceil(block));
            for i in 0..c.blocks() {
                for j in 0..c.blocks() {
                    // FlexAttention pads a short block with masked pairs.
                    let (mut any, mut all) = (false, true);
                    for q in i * block..(i + 1) * block {
                        for k in j * block..(j + 1) * block {
                            let v = q < l && k < l && m.visible(q, k);
                            any |= v;
                            all &= v;
                        }
                    }
                    let (f, p) = (
                        c.full[i].contains(&(j as u32)),
                        c.partial[i].contains(&(j as u32)),
                    );
                    assert_eq!(
                        (f, p),
                        (all, any && !all),
                        "case {case} block {block} ({i}, {j})"
                    );
                }
                assert!(c.full[i].windows(2).all(|w| w[0] < w[1]));
                assert!(c.partial[i].windows(2).all(|w| w[0] < w[1]));
            }
            // Under a window the census is sound (a full block has only
            // visible pairs, an unlisted one none), and skips blocks.
            for w in [1u32, 2, 5] {
                let starts = m.window_starts(w).unwrap();
                let c = BlockCensus::windowed(&m, block, Some(w)).unwrap();
                for i in 0..c.blocks() {
                    for j in 0..c.blocks() {
                        let (mut any, mut all) = (false, true);
                        for q in i * block..(i + 1) * block {
                            for k in j * block..(j + 1) * block {
                                let in_window = starts.get(q).is_some_and(|&st| st as usize <= k);
                                let v = q < l && k < l && in_window && m.visible(q, k);
                                any |= v;
                                all &= v;
                            }
                        }
                        let (f, p) = (
                            c.full[i].contains(&(j as u32)),
                            c.partial[i].contains(&(j as u32)),
                        );
                        assert!(!(f && p), "case {case} window {w}");
                        assert!(
                            !f || all,
                            "case {case} window {w}: a hidden pair in a full block"
                        );
                        assert!(
                            f || p || !any,
                            "case {case} window {w}: a visible pair skipped"
                        );
                    }
                }
            }
        }
    }
}
