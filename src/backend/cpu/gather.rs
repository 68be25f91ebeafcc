//! Key gathering: the column-split key tiles of a query tile, computed as
//! few whole chunks instead of one visit each.
//!
//! On a tree a query tile's visible keys are a few runs of its ancestors:
//! the shared prompt, then its own branch. Where such a run starts or ends
//! inside a key tile, that tile is partial even though each of its keys is
//! seen by *all* of the query tile's rows or by *none* of them (the tile is
//! split by columns, not rows). Visited as stored, each such tile pays a
//! whole visit's per-row costs (softmax bookkeeping, rescaling, the
//! accumulator's loads and stores per register block) for a fraction of its
//! keys, and masks the strips where a run starts or ends.
//!
//! A [`KeyGather`] plan collects, for one query tile, the past key tiles
//! (entirely before the query tile's first row) that are partial and
//! column-split ([`KeyTileBounds::uniform_keys`]) and, when that saves
//! visits, lays their seen keys end to end in chunks of [`TILE`] keys. A
//! work item copies each chunk's operand columns and rows into scratch
//! ([`KeyGather::gather_columns`], [`KeyGather::gather_rows`]: `dp × TILE`
//! values per operand, about 1/64 of the chunk's multiply-adds) and computes
//! it like a full tile, only its last strip masked (lanes past the chunk's
//! keys). The gathered tiles are then not visited. Only keys seen by every
//! row are gathered, so no per-row mask is needed inside a chunk, and the
//! results equal the tiled ones up to the order of the sums. The query
//! tiles of one branch have the same plan; a thread that runs them one
//! after the other gathers a one-chunk plan's chunk once and keeps it in
//! its buffers ([`KeyGather::holds_chunk`], [`KeyGather::keep`]).
//!
//! Shapes without such splits (a plain causal mask, fold, stack-pop) never
//! gather; BENCHMARKS.md §7 has what it removes on the compaction tree.

use super::microkernel::{NS, STRIPS};
use super::{CpuFloat, KeyTileBounds, TileClass, TILE};

// A tile's keys are one `u64` bit mask.
const _: () = assert!(TILE == 64);

/// Keys past the chunk's last (a partial last strip): visible lanes get
/// `kv_end = u32::MAX`, the others 0 (seen by no query). Used as the `ends`
/// of a strip whose first key is taken to be 0, which holds for every query
/// row of a gathering tile (their index is at least [`TILE`]).
pub(crate) fn last_strip_ends(keys: usize) -> [u32; NS] {
    let valid = keys % NS;
    std::array::from_fn(|j| if valid == 0 || j < valid { u32::MAX } else { 0 })
}

/// One run of gathered keys: `len` consecutive keys from `key`, placed at
/// `at` within its chunk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Run {
    key: usize,
    len: usize,
    at: usize,
}

/// The gathering plan of one query tile (reused across work items).
#[derive(Debug, Default)]
pub(crate) struct KeyGather {
    /// Gathered key tiles, ascending, and their seen keys.
    tiles: Vec<(usize, u64)>,
    /// Runs of gathered keys in order, none across a chunk boundary.
    runs: Vec<Run>,
    /// Index in `runs` of each chunk's first run, then `runs.len()`.
    chunk_start: Vec<usize>,
    /// Keys gathered.
    keys: usize,
    /// Cursor of [`Self::is_gathered`].
    next: usize,
    /// The source (kv head) and gathered tiles of the one-chunk plan whose
    /// chunk the caller's buffers hold (see [`Self::holds_chunk`]).
    held: Option<(usize, Vec<(usize, u64)>)>,
}

impl KeyGather {
    /// Plans the queries `[q0, q1)` of query tile `qt`: gathers the past
    /// column-split partial key tiles if their keys fit in fewer chunks
    /// than there are such tiles, otherwise nothing.
    pub(crate) fn plan(&mut self, bounds: &KeyTileBounds, q0: usize, q1: usize, qt: usize) {
        self.tiles.clear();
        self.runs.clear();
        self.chunk_start.clear();
        self.keys = 0;
        self.next = 0;
        for kt in 0..qt {
            if bounds.classify(q0, q1, kt) == TileClass::Partial {
                if let Some(seen) = bounds.uniform_keys(q0, q1, kt) {
                    self.tiles.push((kt, seen));
                    self.keys += seen.count_ones() as usize;
                }
            }
        }
        if self.chunks() >= self.tiles.len() {
            self.tiles.clear();
            self.keys = 0;
            return;
        }
        let mut pos = 0;
        for &(kt, seen) in &self.tiles {
            let mut rest = seen;
            while rest != 0 {
                let a = rest.trailing_zeros() as usize;
                let n = (!(rest >> a)).trailing_zeros() as usize;
                rest &= !(u64::MAX >> (64 - n) << a);
                let (mut key, mut left) = (kt * TILE + a, n);
                while left > 0 {
                    let at = pos % TILE;
                    if at == 0 {
                        self.chunk_start.push(self.runs.len());
                    }
                    let len = left.min(TILE - at);
                    self.runs.push(Run { key, len, at });
                    (key, left, pos) = (key + len, left - len, pos + len);
                }
            }
        }
        self.chunk_start.push(self.runs.len());
        debug_assert_eq!(pos, self.keys);
        debug_assert_eq!(self.chunk_start.len(), self.chunks() + 1);
    }

    /// Whether the caller's chunk buffers already hold the current plan's
    /// chunk of `source`: the plan has one chunk, and [`Self::keep`] was
    /// last told that they were filled for the same source and the same
    /// gathered tiles (then the same keys: the plans of a branch's query
    /// tiles are all alike, and items of one source come in query-tile
    /// order, so a chunk is gathered once per branch instead of per item).
    pub(crate) fn holds_chunk(&self, source: usize) -> bool {
        self.chunks() == 1
            && matches!(&self.held, Some((s, tiles)) if *s == source && *tiles == self.tiles)
    }

    /// Records what the caller's chunk buffers hold after the current plan
    /// ran for `source`: its chunk if it has exactly one (a plan of several
    /// chunks leaves its last, and none leaves the previous contents).
    pub(crate) fn keep(&mut self, source: usize) {
        match self.chunks() {
            0 => {}
            1 => {
                let held = self.held.get_or_insert_with(|| (source, Vec::new()));
                held.0 = source;
                held.1.clone_from(&self.tiles);
            }
            _ => self.held = None,
        }
    }

    /// Chunks of the plan: `⌈keys / TILE⌉`.
    pub(crate) fn chunks(&self) -> usize {
        self.keys.div_ceil(TILE)
    }

    /// Keys in chunk `c`.
    pub(crate) fn chunk_keys(&self, c: usize) -> usize {
        (self.keys - c * TILE).min(TILE)
    }

    /// Whether key tile `kt` is gathered; asked for ascending `kt` after
    /// each [`Self::plan`].
    #[inline]
    pub(crate) fn is_gathered(&mut self, kt: usize) -> bool {
        while self.next < self.tiles.len() && self.tiles[self.next].0 < kt {
            self.next += 1;
        }
        self.next < self.tiles.len() && self.tiles[self.next].0 == kt
    }

    fn chunk_runs(&self, c: usize) -> &[Run] {
        &self.runs[self.chunk_start[c]..self.chunk_start[c + 1]]
    }

    /// Chunk `c`'s columns of a tile-major transposed head (`[lpad / TILE,
    /// dp, TILE]`) into `out` (`[dp, TILE]`), zero up to the end of its last
    /// strip. Returns its number of keys.
    pub(crate) fn gather_columns<T: Copy + Default>(
        &self,
        c: usize,
        head: &[T],
        dp: usize,
        out: &mut [T],
    ) -> usize {
        let n = self.chunk_keys(c);
        let width = n.div_ceil(NS) * NS;
        for (row, o) in out[..dp * TILE].chunks_exact_mut(TILE).enumerate() {
            for r in self.chunk_runs(c) {
                let src = (r.key / TILE * dp + row) * TILE + r.key % TILE;
                o[r.at..r.at + r.len].copy_from_slice(&head[src..src + r.len]);
            }
            o[n..width].fill(T::default());
        }
        n
    }

    /// Chunk `c`'s rows of a row-major head (`[lpad, dp]`) into `out`
    /// (`[TILE, dp]`), zero up to the end of its last strip. Returns its
    /// number of keys.
    pub(crate) fn gather_rows<T: CpuFloat>(
        &self,
        c: usize,
        head: &[T],
        dp: usize,
        out: &mut [T],
    ) -> usize {
        let n = self.chunk_keys(c);
        for r in self.chunk_runs(c) {
            out[r.at * dp..(r.at + r.len) * dp]
                .copy_from_slice(&head[r.key * dp..(r.key + r.len) * dp]);
        }
        out[n * dp..n.div_ceil(NS) * NS * dp].fill(T::ZERO);
        n
    }

    /// The register blocks of a chunk of `keys` keys against `rows` query
    /// rows: every block of those rows and the chunk's strips is live, and
    /// all but a partial last strip need no mask.
    pub(crate) fn chunk_blocks(rows: usize, keys: usize) -> super::BlockMasks {
        use super::microkernel::{block_bit, MR};
        let mut m = super::BlockMasks::default();
        for rb in (0..rows).step_by(MR) {
            for cs in 0..keys.div_ceil(NS) {
                m.live |= block_bit(rb, cs);
                if (cs + 1) * NS <= keys {
                    m.full |= block_bit(rb, cs);
                }
            }
        }
        m
    }

    /// The gathered keys in order (for tests and the census).
    #[cfg(test)]
    fn keys_in_order(&self) -> Vec<usize> {
        (0..self.chunks())
            .flat_map(|c| self.chunk_runs(c).iter().flat_map(|r| r.key..r.key + r.len))
            .collect()
    }
}

// `STRIPS` strips of `NS` keys make a tile's `u64`.
const _: () = assert!(STRIPS * NS == 64);

#[cfg(test)]
mod tests {
    use super::*;

    /// A star: a shared prefix of `p` keys, then children of the given
    /// lengths, each seeing the prefix and itself.
    fn star(p: usize, children: &[usize]) -> Vec<u32> {
        let l = p + children.iter().sum::<usize>();
        let mut kv_end = vec![l as u32; p];
        for &n in children {
            let end = kv_end.len() + n;
            kv_end.extend(std::iter::repeat_n(end as u32, n));
        }
        kv_end
    }

    /// Brute force: the keys before `q0` seen by every query of
    /// `[q0, q1)`, in tiles where no key is seen by only some of them.
    fn uniform_seen(kv_end: &[u32], q0: usize, q1: usize, kt: usize) -> Option<u64> {
        let mut seen = 0;
        for j in 0..TILE {
            let e = kv_end[kt * TILE + j] as usize;
            if e >= q1 {
                seen |= 1 << j;
            } else if e > q0 {
                return None;
            }
        }
        Some(seen)
    }

    #[test]
    fn uniform_keys_match_brute_force() {
        let kv_end = star(155, &[530, 301, 7, 600]);
        let bounds = KeyTileBounds::new(&kv_end);
        let l = kv_end.len();
        let mut some = [0; 2];
        for qt in 1..l.div_ceil(TILE) {
            let (q0, q1) = (qt * TILE, ((qt + 1) * TILE).min(l));
            for kt in 0..qt {
                let want = uniform_seen(&kv_end, q0, q1, kt);
                assert_eq!(bounds.uniform_keys(q0, q1, kt), want, "qt {qt} kt {kt}");
                some[want.is_some() as usize] += 1;
            }
        }
        assert!(some[0] > 0 && some[1] > 0, "{some:?}");
    }

    /// With a sliding window, a key is seen by every row only if it is in
    /// every row's window too; `uniform_keys` against the pair-by-pair
    /// definition (`starts[q] <= k < q < kv_end[k]` for every or for no
    /// row), on a star whose children are long enough for windows to cut
    /// the prefix.
    #[test]
    fn uniform_keys_with_a_window_match_brute_force() {
        let kv_end = star(155, &[530, 301, 7, 600]);
        let l = kv_end.len();
        let pos = vec![0; l];
        let mask = crate::mask::PackMask::new(&kv_end, &pos).unwrap();
        let mut some = [0; 2];
        for w in [40u32, 200, 500] {
            let starts = mask.window_starts(w).unwrap();
            let bounds = KeyTileBounds::new(&kv_end).with_window(starts.clone());
            for qt in 1..l.div_ceil(TILE) {
                let (q0, q1) = (qt * TILE, ((qt + 1) * TILE).min(l));
                for kt in 0..qt {
                    let mut want = Some(0u64);
                    for j in 0..TILE {
                        let k = kt * TILE + j;
                        let rows = (q0..q1)
                            .filter(|&q| starts[q] as usize <= k && q < kv_end[k] as usize)
                            .count();
                        if rows == q1 - q0 {
                            want = want.map(|x| x | 1 << j);
                        } else if rows > 0 {
                            want = None;
                        }
                    }
                    assert_eq!(
                        bounds.uniform_keys(q0, q1, kt),
                        want,
                        "w {w} qt {qt} kt {kt}"
                    );
                    some[want.is_some() as usize] += 1;
                }
            }
        }
        assert!(some[0] > 0 && some[1] > 0, "{some:?}");
    }

    #[test]
    fn a_plan_gathers_the_split_tiles_in_fewer_chunks() {
        // Prefix 155 = 2 tiles + 27 keys; the second child starts at 685
        // (tile 10 holds its keys 685..704: 19).
        let kv_end = star(155, &[530, 600]);
        let bounds = KeyTileBounds::new(&kv_end);
        let mut g = KeyGather::default();
        let qt = 13;
        g.plan(&bounds, qt * TILE, (qt + 1) * TILE, qt);
        let want: Vec<usize> = (128..155).chain(685..704).collect();
        assert_eq!(g.keys_in_order(), want);
        assert_eq!((g.chunks(), g.chunk_keys(0)), (1, 46));
        assert!([2, 10].iter().all(|&kt| g.is_gathered(kt)));
        let mut g2 = KeyGather::default();
        g2.plan(&bounds, qt * TILE, (qt + 1) * TILE, qt);
        assert!(!g2.is_gathered(3) && g2.is_gathered(10) && !g2.is_gathered(11));
        // Inside the first child nothing is split: no plan.
        g.plan(&bounds, 5 * TILE, 6 * TILE, 5);
        assert_eq!((g.chunks(), g.is_gathered(2)), (0, false));
    }

    /// A kept one-chunk plan is held for the same source and the same
    /// gathered tiles only; a plan of several chunks, or none kept, holds
    /// nothing.
    #[test]
    fn a_kept_chunk_is_held_for_the_same_source_and_tiles_only() {
        let kv_end = star(155, &[530, 600]);
        let bounds = KeyTileBounds::new(&kv_end);
        let mut g = KeyGather::default();
        let l = kv_end.len();
        let plan =
            |g: &mut KeyGather, qt: usize| g.plan(&bounds, qt * TILE, ((qt + 1) * TILE).min(l), qt);
        plan(&mut g, 13);
        assert_eq!(g.chunks(), 1);
        assert!(!g.holds_chunk(0), "nothing kept yet");
        g.keep(0);
        assert!(g.holds_chunk(0) && !g.holds_chunk(1));
        // The next tile of the same child gathers the same tiles.
        plan(&mut g, 14);
        assert!(g.holds_chunk(0));
        // A tile of the first child gathers nothing; keeping it leaves the
        // buffers as they were.
        plan(&mut g, 5);
        assert_eq!(g.chunks(), 0);
        g.keep(0);
        plan(&mut g, 15);
        assert!(g.holds_chunk(0));
        // The second child's last tile (partial) sees the same tiles.
        plan(&mut g, l.div_ceil(TILE) - 1);
        assert!(g.holds_chunk(0), "{:?}", g.tiles);
        // Another tree: other gathered tiles, so not held.
        let other = star(100, &[530, 600]);
        let bounds2 = KeyTileBounds::new(&other);
        g.plan(&bounds2, 13 * TILE, 14 * TILE, 13);
        assert_eq!(g.chunks(), 1);
        assert!(!g.holds_chunk(0));
        // Several chunks: their last chunk overwrote the buffers.
        // A caterpillar: a 40-key root, then 12 levels of a 30-key leaf and
        // the 30-key node the path goes on from, then a 300-key tail: a
        // query tile of the tail sees the root, every node and itself, and
        // the nodes share their tiles with the leaves.
        let l3 = 40 + 12 * 60 + 300;
        let mut many = vec![l3 as u32; 40];
        for _ in 0..12 {
            let leaf_end = many.len() + 30;
            many.extend(std::iter::repeat_n(leaf_end as u32, 30));
            many.extend(std::iter::repeat_n(l3 as u32, 30));
        }
        many.extend(std::iter::repeat_n(l3 as u32, 300));
        let bounds3 = KeyTileBounds::new(&many);
        let n = many.len();
        let several = (1..n.div_ceil(TILE)).find(|&qt| {
            g.plan(&bounds3, qt * TILE, ((qt + 1) * TILE).min(n), qt);
            g.chunks() > 1
        });
        assert!(several.is_some(), "no plan of several chunks");
        g.keep(0);
        plan(&mut g, 13);
        assert!(!g.holds_chunk(0));
    }

    #[test]
    fn chunks_split_runs_at_their_boundaries() {
        // Short children after a 40-key prefix leave split tiles (and runs
        // that cross chunk boundaries) all over the long last child's plans.
        let kv_end = star(40, &[50, 50, 50, 50, 500]);
        let bounds = KeyTileBounds::new(&kv_end);
        let mut g = KeyGather::default();
        let l = kv_end.len();
        for qt in 1..l.div_ceil(TILE) {
            let (q0, q1) = (qt * TILE, ((qt + 1) * TILE).min(l));
            g.plan(&bounds, q0, q1, qt);
            let keys = g.keys_in_order();
            assert_eq!(keys.len(), g.keys);
            // Every gathered key is seen by every row, none twice.
            for w in keys.windows(2) {
                assert!(w[0] < w[1]);
            }
            for &k in &keys {
                assert!(kv_end[k] as usize >= q1 && k < q0, "qt {qt} key {k}");
            }
            for c in 0..g.chunks() {
                let runs = g.chunk_runs(c);
                let n: usize = runs.iter().map(|r| r.len).sum();
                assert_eq!(n, g.chunk_keys(c));
                assert!(runs.iter().all(|r| r.at + r.len <= TILE));
            }
        }
    }

    #[test]
    fn gathered_operands_hold_the_chunk_keys_then_zeros() {
        let kv_end = star(155, &[530, 600]);
        let bounds = KeyTileBounds::new(&kv_end);
        let mut g = KeyGather::default();
        g.plan(&bounds, 13 * TILE, 14 * TILE, 13);
        let (lpad, dp) = (kv_end.len().div_ceil(TILE) * TILE, 16);
        // Value of (key, column) in both layouts.
        let val = |k: usize, c: usize| (k * 100 + c) as f64;
        let mut rows = vec![0.0; lpad * dp];
        let mut cols = vec![0.0; lpad * dp];
        for k in 0..lpad {
            for c in 0..dp {
                rows[k * dp + c] = val(k, c);
                cols[(k / TILE * dp + c) * TILE + k % TILE] = val(k, c);
            }
        }
        let (mut out_r, mut out_c) = (vec![f64::NAN; TILE * dp], vec![f64::NAN; dp * TILE]);
        let n = g.gather_rows(0, &rows, dp, &mut out_r);
        assert_eq!(n, g.gather_columns(0, &cols, dp, &mut out_c));
        let keys = g.keys_in_order();
        for c in 0..dp {
            for j in 0..n.div_ceil(NS) * NS {
                let want = keys.get(j).map_or(0.0, |&k| val(k, c));
                assert_eq!(out_r[j * dp + c], want);
                assert_eq!(out_c[c * TILE + j], want);
            }
        }
        assert_eq!(last_strip_ends(n)[..6], [u32::MAX; 6]);
        assert_eq!(last_strip_ends(n)[6..], [0; 2]);
        assert_eq!(last_strip_ends(64), [u32::MAX; NS]);
    }
}
