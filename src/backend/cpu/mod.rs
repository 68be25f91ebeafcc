//! The CPU reference backend: tree attention (forward and backward, GQA,
//! optional fused rotary) and the fused SDCC forward-KL, on plain slices.
//!
//! Everything here takes flat row-major slices and explicit shapes so that it
//! can be exposed through a C ABI; [`crate::ops`] is the convenient front over
//! `ndarray` views.
//!
//! # Attention
//!
//! Per query head `h` (reading kv head `h / (q_heads / kv_heads)`), with the
//! interval mask `k <= q < kv_end[k]` of [`PackMask`]:
//!
//! ```text
//! S = scale · Q Kᵀ (masked entries = −inf)   P = softmax(S) row-wise
//! O = P V                                     LSE = ln Σ_k exp(S)
//! ```
//!
//! and backward `D = rowsum(dO ∘ O)`, `dP = dO Vᵀ`, `dS = P ∘ (dP − D)`,
//! `dQ = scale · dS K`, `dK = scale · dSᵀ Q`, `dV = Pᵀ dO` (dK, dV summed over
//! the query heads of a group). A query row with no visible key (only possible
//! with padding keys, `kv_end[k] == k`) gets `O = 0`, `LSE = −inf`, `dQ = 0`
//! and contributes nothing to dK, dV.
//!
//! The computation is tiled FlashAttention-style in [`TILE`]` × `[`TILE`]
//! blocks and never holds an `L × L` matrix: memory is linear in `L` (the
//! inputs are copied once into head-major, zero-padded layouts, plus a few
//! tiles of scratch per thread, which also hold each work item's output
//! rows until they are stored into the caller's token-major result; the
//! forward's Q rows go straight into the scratch of the one item that reads
//! them). Each (query tile, key tile) pair is
//! classified from the per-key-tile min/max of `kv_end` (DESIGN §5):
//! [`TileClass::Skip`] tiles are not computed, [`TileClass::Full`] tiles need
//! no per-element mask, [`TileClass::Partial`] tiles are computed by register
//! blocks of [`BLOCK_QUERIES`] × [`BLOCK_KEYS`] classified the same way from
//! per-block min/max of `kv_end`: blocks with no visible entry are neither
//! computed nor read (their probabilities are 0), blocks with only visible
//! entries are not masked, the rest are masked element-wise
//! ([`block_counts`] reports the census). So on a tree the work follows the
//! visible pairs at the micro-kernel's granularity, not the tile's. Partial
//! tiles that a query tile's rows see or ignore by whole columns (a run of
//! ancestors, such as a shared prompt, starting or ending inside them) are
//! not visited one by one: their seen keys are gathered into chunks of
//! [`TILE`] keys computed like full tiles ([`gather_counts`]; see the
//! `gather` module).
//!
//! The head-major copies come from a bounded process-wide pool of buffers
//! reused across calls (at most 32 buffers and 1 GiB kept, oldest freed
//! first), so repeated calls do not fault in fresh pages.
//! [`attention_forward`] and [`attention_backward`] return fresh `Vec`s
//! owned by the caller; [`attention_forward_into`] and
//! [`attention_backward_into`] write every element of buffers the caller
//! passes in (e.g. reused across a training loop's steps), which saves the
//! page faults of fresh outputs at every call.
//!
//! Forward runs one work item per (query head, query tile) with an online
//! softmax. Backward runs one kv head (with its query heads) at a time, so
//! that the copies its items read (Q and dO rows, K rows and columns, V
//! columns: 5 arrays of `lpad · dp` per head, 12 MB for all 4 heads of the
//! bench at 2.3k tokens, 3 MB for one) stay in cache between being written
//! and being read: its inputs are copied, then two deterministic kinds of
//! work item run in one parallel step: one per key tile accumulates dK, dV
//! over the query tiles that can see the key tile (the contiguous range
//! from the tile's first key to its largest `kv_end`), one per (query head,
//! query tile) accumulates dQ. Both compute `S` and `dP` blocks with query
//! rows and key columns (the dK, dV items then multiply by their
//! transpose), so the copies need no transposed Q or dO. Every output
//! element is accumulated by one item in a fixed order (the only atomics are
//! the items' non-finite flags), so results do not depend on the thread
//! count.
//!
//! Work is spread over [`num_threads`] threads, the caller and workers
//! started once per process and parked between calls (a call that finds
//! them busy, from another thread, uses scoped threads): a forward call has
//! two parallel steps (the K, V copies, the query tiles), a backward call
//! two per kv head (its input copies, which also compute `D`, then its dK,
//! dV and dQ items). Each work item stores its finished rows (`O`; or `dK`,
//! `dV`; or `dQ`, rotated back when rotary is on) straight into the
//! caller's token-major output, disjoint rows per item (prefetched for
//! writing when the item starts). On x86-64 CPUs with
//! AVX2 and FMA (detected at run time) the work items run a copy compiled
//! for those features, whose `f32` row-softmax steps (masking, `exp`, lane
//! maxima and sums, one strip of 8 keys at a time) are written with AVX2
//! intrinsics; elsewhere, or with `TREEATTN_PORTABLE=1` ([`uses_avx2_fma`]),
//! the portable copy of the same code, whose softmax steps give the same
//! bits and whose matmuls differ only by the rounding of fused
//! multiply-adds. `f32` exponentials use a polynomial within 2 ulp; `f64` uses
//! `f64::exp`. A NaN or infinity in a result (scores overflowing `T`,
//! or non-finite inputs when `check_finite` is off) is reported as
//! [`Error::NonFinite`], never returned: each work item checks the rows it
//! stores, and only when one reports a bad value is the output scanned for
//! the first bad index.

mod attention_bwd;
mod attention_fwd;
mod float;
mod gather;
mod lanes;
mod microkernel;
mod operands;
mod pool;
mod sdcc;
mod workspace;

pub use crate::mask::TileClass;
pub use attention_bwd::{attention_backward, attention_backward_into};
pub use attention_fwd::{attention_forward, attention_forward_into};
pub use float::CpuFloat;
pub use sdcc::{sdcc_forward_kl, SdccOut};

use super::{AttnParams, AttnShape};
use crate::mask::PackMask;
use crate::{Error, Result};
use microkernel::LiveBlocks;
use std::sync::{Mutex, PoisonError};

/// Side of the square (query tile × key tile) blocks the CPU backend
/// computes and classifies.
pub const TILE: usize = 64;

/// Forward result of [`attention_forward`].
#[derive(Clone, Debug, PartialEq)]
pub struct AttnOut<T> {
    /// `[tokens, q_heads, head_dim]`.
    pub o: Vec<T>,
    /// `[q_heads, tokens]`, natural log; `−inf` for a row with no visible key.
    pub lse: Vec<T>,
}

/// Gradients returned by [`attention_backward`], with respect to the
/// *unrotated* inputs when rotary is on.
#[derive(Clone, Debug, PartialEq)]
pub struct AttnGrads<T> {
    /// Like q: `[tokens, q_heads, head_dim]`.
    pub dq: Vec<T>,
    /// Like k: `[tokens, kv_heads, head_dim]`.
    pub dk: Vec<T>,
    /// Like v: `[tokens, kv_heads, head_dim]`.
    pub dv: Vec<T>,
}

/// Whether the CPU backend's work items run their copies compiled for AVX2
/// and FMA (with the AVX2 row softmax): true on x86-64 CPUs that have both,
/// unless the environment variable `TREEATTN_PORTABLE` is `1` when the
/// process first asks (then, as on every other CPU, the portable copy of
/// the same code runs: the same results up to the rounding of fused
/// multiply-adds).
pub fn uses_avx2_fma() -> bool {
    microkernel::has_avx2_fma()
}

/// Number of worker threads the CPU backend uses: the environment variable
/// `TREEATTN_THREADS` if it holds a positive integer, otherwise
/// `std::thread::available_parallelism()` (1 if unknown).
pub fn num_threads() -> usize {
    std::env::var("TREEATTN_THREADS")
        .ok()
        .and_then(|s| s.trim().parse::<usize>().ok())
        .filter(|&n| n > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// Census of the (query tile, key tile) blocks of a pack at the CPU
/// backend's [`TILE`] size, over the lower block triangle (key tile index <=
/// query tile index; blocks above it are never visited).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TileCounts {
    pub skip: u64,
    pub full: u64,
    pub partial: u64,
}

/// Register-block masks of one tile (see [`LiveBlocks`]): `live` blocks
/// hold a visible entry, `full` ones (a subset) hold only visible entries.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct BlockMasks {
    pub live: LiveBlocks,
    pub full: LiveBlocks,
}

/// Counts the skip / full / partial blocks the CPU attention visits on this
/// mask (for reports and for tests that must exercise all three paths).
pub fn tile_counts(mask: PackMask<'_>) -> TileCounts {
    let bounds = KeyTileBounds::new(mask.kv_end);
    let l = mask.len();
    let tiles = l.div_ceil(TILE);
    let mut c = TileCounts::default();
    for qt in 0..tiles {
        let (q0, q1) = (qt * TILE, ((qt + 1) * TILE).min(l));
        for kt in 0..=qt {
            match bounds.classify(q0, q1, kt) {
                TileClass::Skip => c.skip += 1,
                TileClass::Full => c.full += 1,
                TileClass::Partial => c.partial += 1,
            }
        }
    }
    c
}

/// Census of the register blocks ([`BLOCK_QUERIES`] queries × [`BLOCK_KEYS`]
/// keys, the micro-kernels' unit) inside the partial tiles of a pack, as the
/// forward and the dQ pass classify them: `skip` blocks hold no visible
/// entry and are not computed, `full` ones need no per-element mask,
/// `masked` ones are masked element-wise. Blocks past the last token are not
/// counted. (The partial tiles that are gathered, [`gather_counts`], are
/// computed as chunks instead.)
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BlockCounts {
    pub skip: u64,
    pub full: u64,
    pub masked: u64,
}

/// Queries per register block.
pub const BLOCK_QUERIES: usize = microkernel::MR;
/// Keys per register block.
pub const BLOCK_KEYS: usize = microkernel::NS;

/// Counts the register blocks of the partial tiles by how the CPU attention
/// computes them (see [`BlockCounts`]).
pub fn block_counts(mask: PackMask<'_>) -> BlockCounts {
    let bounds = KeyTileBounds::new(mask.kv_end);
    let l = mask.len();
    let mut c = BlockCounts::default();
    for qt in 0..l.div_ceil(TILE) {
        let (q0, q1) = (qt * TILE, ((qt + 1) * TILE).min(l));
        for kt in 0..=qt {
            if bounds.classify(q0, q1, kt) != TileClass::Partial {
                continue;
            }
            let m = bounds.query_row_blocks(q0, q1, kt * TILE);
            let rows = (q1 - q0).div_ceil(BLOCK_QUERIES);
            let strips = ((kt + 1) * TILE).min(l).div_ceil(BLOCK_KEYS) - kt * microkernel::STRIPS;
            for rb in 0..rows {
                for cs in 0..strips {
                    let bit = microkernel::block_bit(rb * BLOCK_QUERIES, cs);
                    if m.live & bit == 0 {
                        c.skip += 1;
                    } else if m.full & bit != 0 {
                        c.full += 1;
                    } else {
                        c.masked += 1;
                    }
                }
            }
        }
    }
    c
}

/// The (query, key) entries the CPU forward and dQ pass compute on this
/// mask: the live register blocks ([`BLOCK_QUERIES`] × [`BLOCK_KEYS`]) of
/// every tile that is neither skipped nor gathered, and of every chunk of
/// gathered keys ([`gather_counts`]), whole blocks (the kernels compute
/// whole blocks, padding lanes included). Visible pairs over this is the
/// share of the computed work that is useful: 1 would be a kernel that
/// computes visible pairs only.
pub fn computed_entries(mask: PackMask<'_>) -> u64 {
    let bounds = KeyTileBounds::new(mask.kv_end);
    let l = mask.len();
    let mut gather = gather::KeyGather::default();
    let mut live = 0u64;
    for qt in 0..l.div_ceil(TILE) {
        let (q0, q1) = (qt * TILE, ((qt + 1) * TILE).min(l));
        gather.plan(&bounds, q0, q1, qt);
        for c in 0..gather.chunks() {
            let blocks = gather::KeyGather::chunk_blocks(q1 - q0, gather.chunk_keys(c));
            live += u64::from(blocks.live.count_ones());
        }
        for kt in 0..=qt {
            if bounds.classify(q0, q1, kt) != TileClass::Skip && !gather.is_gathered(kt) {
                live += u64::from(bounds.query_row_blocks(q0, q1, kt * TILE).live.count_ones());
            }
        }
    }
    live * (BLOCK_QUERIES * BLOCK_KEYS) as u64
}

/// Census of key gathering on a pack (per head): the partial tiles that the
/// CPU forward and dQ pass compute as chunks of gathered keys instead of
/// visiting them, and those chunks. A past key tile (wholly before the query
/// tile) whose keys are each seen by all of the query tile's rows or by none
/// (a run of ancestors starting or ending inside it) is gathered when the
/// query tile has several such tiles whose seen keys fit in fewer chunks of
/// [`TILE`] keys; each chunk is then computed like a full tile.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GatherCounts {
    /// (Query tile, key tile) pairs gathered instead of visited.
    pub tiles: u64,
    /// Chunks computed in their place.
    pub chunks: u64,
    /// Keys gathered, summed over query tiles.
    pub keys: u64,
}

/// Counts the key gathering of the CPU forward and dQ pass on this mask
/// (see [`GatherCounts`]).
pub fn gather_counts(mask: PackMask<'_>) -> GatherCounts {
    let bounds = KeyTileBounds::new(mask.kv_end);
    let l = mask.len();
    let mut gather = gather::KeyGather::default();
    let mut c = GatherCounts::default();
    for qt in 0..l.div_ceil(TILE) {
        let (q0, q1) = (qt * TILE, ((qt + 1) * TILE).min(l));
        gather.plan(&bounds, q0, q1, qt);
        c.tiles += (0..qt).filter(|&kt| gather.is_gathered(kt)).count() as u64;
        c.chunks += gather.chunks() as u64;
        c.keys += (0..gather.chunks())
            .map(|i| gather.chunk_keys(i) as u64)
            .sum::<u64>();
    }
    c
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

/// A test attention shape over a mask where every key is seen by every
/// query: the shape, `kv_end` and position ids.
#[cfg(test)]
pub(crate) fn all_visible_case(
    l: usize,
    q_heads: usize,
    kv_heads: usize,
    head_dim: usize,
) -> (AttnShape, Vec<u32>, Vec<u32>) {
    let shape = AttnShape {
        tokens: l,
        q_heads,
        kv_heads,
        head_dim,
    };
    (shape, vec![l as u32; l], (0..l as u32).collect())
}

/// Test values in `[−1, 1)` from a multiplicative hash of the index and a
/// salt: deterministic, varied, the same on every machine.
#[cfg(test)]
pub(crate) fn hashed_values<T: CpuFloat>(n: usize, salt: u64) -> Vec<T> {
    (0..n as u64)
        .map(|i| T::from_f64((((i * 2_654_435_761) ^ salt) % 997) as f64 / 498.0 - 1.0))
        .collect()
}

/// Runs `body` on every work item on up to `threads` threads (the caller
/// and the process's pooled workers, [`pool`]), pulling items from a shared
/// queue in order (put expensive items first). Each thread builds its
/// scratch once with `init`.
pub(crate) fn run_parallel<W: Send, S>(
    work: Vec<W>,
    threads: usize,
    init: impl Fn() -> S + Sync,
    body: impl Fn(&mut S, W) + Sync,
) {
    let n = threads.min(work.len());
    if n <= 1 {
        let mut scratch = init();
        for w in work {
            body(&mut scratch, w);
        }
        return;
    }
    let queue = Mutex::new(work.into_iter());
    pool::broadcast(n - 1, &|| {
        let mut scratch = init();
        loop {
            let next = queue.lock().unwrap_or_else(PoisonError::into_inner).next();
            match next {
                Some(w) => body(&mut scratch, w),
                None => break,
            }
        }
    });
}

/// `Err(Shape)` unless `got == expected`.
pub(crate) fn check_len(what: &str, got: usize, expected: usize, how: &str) -> Result<()> {
    if got != expected {
        return Err(Error::Shape(format!(
            "{what} has {got} elements, expected {expected} ({how})"
        )));
    }
    Ok(())
}

/// `Err(NonFinite)` at the first NaN or ±inf.
pub(crate) fn check_finite<T: CpuFloat>(what: &str, x: &[T]) -> Result<()> {
    match x.iter().position(|v| !v.is_finite()) {
        Some(index) => Err(Error::NonFinite {
            what: what.to_string(),
            index,
        }),
        None => Ok(()),
    }
}

/// `Err(NonFinite)` at the first NaN or ±inf of a result. Finite inputs can
/// still overflow `T` (e.g. `scale · q·k` beyond f32 range); this linear scan
/// turns that into an error instead of a silent NaN. The attention calls
/// run it only once a work item has reported a non-finite row, to name the
/// first bad index.
pub(crate) fn check_result<T: CpuFloat>(what: &str, x: &[T]) -> Result<()> {
    match x.iter().position(|v| !v.is_finite()) {
        Some(index) => Err(Error::NonFinite {
            what: format!(
                "{what} (the result overflowed {}: inputs too large or non-finite)",
                T::NAME
            ),
            index,
        }),
        None => Ok(()),
    }
}

/// Validation shared by forward and backward: shape, params, mask (re-checked,
/// since `PackMask`'s fields are public), and the q, k, v lengths.
pub(crate) fn check_qkv<T: CpuFloat>(
    q: &[T],
    k: &[T],
    v: &[T],
    shape: &AttnShape,
    mask: &PackMask<'_>,
    params: &AttnParams,
) -> Result<()> {
    shape.validate()?;
    params.validate(shape)?;
    if mask.len() != shape.tokens {
        return Err(Error::Pack(format!(
            "kv_end has {} entries but the attention shape has {} tokens",
            mask.len(),
            shape.tokens
        )));
    }
    PackMask::new(mask.kv_end, mask.position_ids)?;
    let elements = |heads: usize| {
        shape
            .tokens
            .checked_mul(heads)
            .and_then(|x| x.checked_mul(shape.head_dim))
    };
    if elements(shape.q_heads).is_none() || elements(shape.kv_heads).is_none() {
        return Err(Error::Shape(format!(
            "attention shape {shape:?} overflows usize"
        )));
    }
    let q_how = "tokens · q_heads · head_dim";
    let kv_how = "tokens · kv_heads · head_dim";
    check_len("q", q.len(), shape.q_len(), q_how)?;
    check_len("k", k.len(), shape.kv_len(), kv_how)?;
    check_len("v", v.len(), shape.kv_len(), kv_how)?;
    if params.check_finite {
        check_finite("q", q)?;
        check_finite("k", k)?;
        check_finite("v", v)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_parallel_visits_every_item_once() {
        for threads in [1, 3, 64] {
            let mut out = vec![0u32; 100];
            let work: Vec<_> = out.chunks_mut(7).enumerate().collect();
            run_parallel(
                work,
                threads,
                || 0u32,
                |calls, (i, chunk)| {
                    *calls += 1;
                    chunk.iter_mut().for_each(|x| *x += i as u32 + 1);
                },
            );
            assert!(
                out.iter()
                    .enumerate()
                    .all(|(j, &x)| x == (j / 7) as u32 + 1),
                "{threads} threads"
            );
        }
    }

    /// Each output block is written by one work item in a fixed order, so
    /// results are bit-identical whatever the thread count.
    #[test]
    fn results_do_not_depend_on_the_thread_count() {
        let l = 300;
        let kv_end: Vec<u32> = (0..l as u32)
            .map(|k| {
                if k < 100 {
                    l as u32
                } else if k < 180 {
                    180
                } else {
                    l as u32
                }
            })
            .collect();
        let pos: Vec<u32> = (0..l as u32)
            .map(|k| if k < 180 { k } else { k - 80 })
            .collect();
        let mask = PackMask::new(&kv_end, &pos).unwrap();
        let shape = AttnShape {
            tokens: l,
            q_heads: 4,
            kv_heads: 2,
            head_dim: 40,
        };
        let mut params = AttnParams::new(40);
        params.rope = Some(super::super::Rope {
            base: 500.0,
            dims: 40,
        });
        let data = |n: usize, salt: u64| hashed_values::<f32>(n, salt);
        let (q, k, v) = (
            data(shape.q_len(), 1),
            data(shape.kv_len(), 2),
            data(shape.kv_len(), 3),
        );
        let d_o = data(shape.q_len(), 4);
        let run = |threads: usize| {
            let f = attention_fwd::forward_on_threads(&q, &k, &v, shape, mask, &params, threads)
                .unwrap();
            let g = attention_bwd::backward_on_threads(
                &q, &k, &v, &f.o, &f.lse, &d_o, shape, mask, &params, threads,
            )
            .unwrap();
            (f, g)
        };
        let one = run(1);
        for threads in [2, 5] {
            assert!(run(threads) == one, "{threads} threads");
        }
    }

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
