//! Launch planning of the backward kernels (`kernels/tree_attn_bwd.cu`),
//! shared by the `emu` and `cuda` backends.
//!
//! One backward call runs, in order (see the top of the .cu file):
//!
//! | kernel | grid | block | shared memory |
//! |---|---|---|---|
//! | `tree_attn_bwd_pre_*` | `ceil(tokens · q_heads / 4)` | 128 | 0 |
//! | `tree_attn_bwd_main_{atomic,det}_*` ([`MainKernel::OneMTile`]) | `(key tiles of 64, kv_heads, group splits)` | 128 | 65,792 (d 64) / 75,520 (d 128) |
//! | `tree_attn_bwd_main2_{atomic,det}_*` ([`MainKernel::TwoMTiles`], the default) | `(key tiles of 128, kv_heads, group splits)` | 256 | 93,696 (d 64) / 159,232 (d 128) |
//! | `tree_attn_bwd_main2w4_{atomic,det}_*_d64` ([`MainKernel::TwoMTilesFourWarps`], d 64 only) | `(key tiles of 128, kv_heads, group splits)` | 128 | 93,696 |
//! | `tree_attn_bwd_dq_*` (deterministic only) | `(query tiles of 64, q_heads)` | 128 | 56,320 / 105,472 |
//! | `tree_attn_bwd_dq_convert_*` | `ceil(tokens · q_heads / 4)` | 128 | 0 |
//! | `tree_attn_bwd_dkv_convert_*` (group splits > 1 only) | `ceil(tokens · kv_heads / 4)` | 128 | 0 |
//!
//! Main kernels ([`MainKernel`]; tiling at the top of the .cu file and of
//! `kernels/tree_attn_bwd_main2_d128.cuh`, `kernels/tree_attn_bwd_main2_roles.cuh`).
//! [`MainKernel::TwoMTiles`], the default for both head dims, gives each
//! warp two 16-key m-tiles so that every shared-memory fragment feeds more
//! `mma`, in blocks of 8 warps where warps w and w + 4 share keys
//! 32w..32w+31, one computing Sᵀ and P, the other dPᵀ and dS (P and dS
//! pass through shared memory): at d 64 the first holds dV and the second
//! dK, at d 128 both split dK and dV over the head dim. HMMA per
//! `ldmatrix`, counted per query tile from the code: d 64 3.56 / 3.08, d
//! 128 2.91 / 2.86 (det / atomic), against 2.00 / 1.90 and 1.89 / 1.79 for
//! [`MainKernel::OneMTile`] and 2.67 / 2.50 for
//! [`MainKernel::TwoMTilesFourWarps`] (d 64: 4 warps of 32 keys, each
//! computing every product), which stay selectable until a GPU has timed
//! them (BENCHMARKS.md §6). The main kernel's block
//! ([`BwdTraits::main_threads`]) is 256 threads for the two-m-tile
//! kernels, 128 otherwise.
//!
//! Group splits ([`group_splits`], the one place the rule lives). The main
//! kernel's block sums dK, dV of its key tile over the `group = q_heads /
//! kv_heads` query heads that read its kv head. When `key tiles · kv_heads`
//! blocks cannot fill the GPU (fewer than [`MAIN_TARGET_BLOCKS`]), grid.z
//! splits the group: z-slice `s` handles query heads `s · group / splits ..
//! (s + 1) · group / splits` of the group and writes its f32 partial dK
//! (scaled) and dV into a scratch buffer `[splits, 2, tokens, kv_heads, D]`;
//! `tree_attn_bwd_dkv_convert` sums the splits in index order (no atomics:
//! bit-identical from run to run) into dK, dV. With one split the main
//! kernel writes dK, dV itself and no scratch is allocated.

use super::{Dtype, LaunchPlan};
use crate::backend::AttnShape;
use crate::{Error, Result};

/// How the backward accumulates dQ.
///
/// The default is [`DqMode::Atomic`], as in FlashAttention-2 and -3, whose
/// backward adds dQ with `atomicAdd` unless `deterministic=True` is asked
/// for. Why:
/// - speed: the deterministic path recomputes S, P, dP, dS in a second
///   kernel (7 tile matmuls per visible tile pair instead of 5, twice the
///   exponentials, a second walk over the key tiles), which the static
///   review of issue 39 puts at 25–35 % more backward time (an estimate
///   from the instruction counts, not yet a GPU measurement);
/// - accuracy is the same: atomic dQ differs from the deterministic one
///   only in the order of its f32 additions, inside the tolerances the
///   tests hold both modes to against the CPU backend (`backend::tolerance`);
/// - dK and dV are summed in a fixed order in both modes (no atomics):
///   only dQ's last bits depend on the mode.
///
/// Ask for [`DqMode::Deterministic`] (`with_dq_mode`) where dQ must be
/// bit-identical from run to run (debugging, reproducibility audits).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DqMode {
    /// Every (key tile, query tile) block adds its share of dQ into an f32
    /// accumulator with `atomicAdd`: 5 tile matmuls per visible tile pair,
    /// summation order (hence the last bits of dQ) varies from run to run.
    /// The default (see above).
    #[default]
    Atomic,
    /// A separate kernel per query tile walks the visible key tiles and
    /// recomputes S, P, dP, dS to form dQ in registers: 7 tile matmuls per
    /// visible tile pair (1.4x) and twice the exponentials, no atomics, dQ
    /// bit-identical across runs. The opt-in.
    Deterministic,
}

/// Which backward main kernel computes dK, dV (and dQ in atomic mode); the
/// other kernels are shared. All stay selectable until a GPU has timed
/// them side by side (`treeattn gpu-check`, issue 26).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MainKernel {
    /// `tree_attn_bwd_main_{atomic,det}_*`: one 16-key m-tile per warp,
    /// blocks of 64 keys and 4 warps, query tiles of 64 (d 64) or 32 (d
    /// 128) rows.
    OneMTile,
    /// `tree_attn_bwd_main2_{atomic,det}_*`: two 16-key m-tiles per warp,
    /// blocks of 128 keys, query tiles of 64, dQ by vector reductions. d
    /// 128: 8 warps, each pair of warps sharing 32 keys with the dK, dV
    /// accumulators split over the head dim (64 columns each),
    /// one computing Sᵀ and P, the other dPᵀ and dS, P and dS staged in
    /// shared memory (kernels/tree_attn_bwd_main2_d128.cuh). d 64: the
    /// same 8 warps, the pair split by product instead: one warp holds K's
    /// A fragments and dV and computes Sᵀ and P, the other V's and dK and
    /// computes dPᵀ and dS (kernels/tree_attn_bwd_main2_roles.cuh).
    TwoMTiles,
    /// `tree_attn_bwd_main2w4_{atomic,det}_*_d64` (d 64 only; the default
    /// for d 64 before the 8-warp kernel): two 16-key m-tiles per warp,
    /// blocks of 128 keys and 4 warps, each warp computing every product
    /// for its 32 keys over 32-query sub-tiles of the 64-query tiles.
    TwoMTilesFourWarps,
}

impl MainKernel {
    /// The kernel a backward runs unless told otherwise:
    /// [`Self::TwoMTiles`] (d 64 and d 128; [`Self::OneMTile`] and, at d
    /// 64, [`Self::TwoMTilesFourWarps`] stay selectable until a GPU has
    /// timed them).
    pub fn default_for(head_dim: usize) -> MainKernel {
        let _ = head_dim;
        MainKernel::TwoMTiles
    }

    /// The main kernel of a call with attention variants (the `*_var_*`
    /// kernels: a window or key starts, a softcap, sinks), given the
    /// caller's choice (`None`: the default). [`Self::TwoMTiles`] and
    /// [`Self::OneMTile`] have variant kernels; at d 128 the two-m-tile
    /// one has no softcap (its role-1 warps read P from shared memory both
    /// for dV and for dS, which needs P ∘ (1 − tanh²): a second P region
    /// would pass A100's shared memory), so a softcap there runs the
    /// one-m-tile variant kernel by default. Errors ([`Error::Unsupported`],
    /// naming the kernels that do): [`Self::TwoMTilesFourWarps`] (no
    /// variant kernel); [`Self::TwoMTiles`] asked for with a softcap at d
    /// 128.
    pub fn for_variants(
        head_dim: usize,
        requested: Option<MainKernel>,
        softcap: bool,
    ) -> Result<MainKernel> {
        let split_d128 = head_dim == 128;
        match requested {
            None if split_d128 && softcap => Ok(MainKernel::OneMTile),
            None => Ok(MainKernel::default_for(head_dim)),
            Some(MainKernel::TwoMTilesFourWarps) => Err(Error::Unsupported(
                "the 4-warp two-m-tile backward main kernel has no variant kernel (sliding window, key \
                 starts, softcap, sinks): use MainKernel::TwoMTiles (the default) or MainKernel::OneMTile"
                    .into(),
            )),
            Some(MainKernel::TwoMTiles) if split_d128 && softcap => Err(Error::Unsupported(
                "the d 128 two-m-tile backward main kernel computes no softcap: use MainKernel::OneMTile \
                 (what the default picks for a softcap at d 128)"
                    .into(),
            )),
            Some(k) => Ok(k),
        }
    }
}

/// Tiling of the backward kernels for one head dim (the Rust copy of the C++
/// `BwdTraits` / `BwdDqTraits`; the emulator checks every launch against the
/// C++ ones).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BwdTraits {
    /// Head dim of the kernels (64 or 128).
    pub head_dim: u32,
    /// Query rows per streamed tile of the main kernel (64; 32 for the
    /// one-m-tile kernel at d 128, whose f32 dK, dV accumulators leave room
    /// for no more).
    pub block_m: u32,
    /// The kv_end bounds tile (`tile_kv_min` / `tile_kv_max`), 64 keys:
    /// the one-m-tile main kernel's block, half the two-m-tile one's.
    pub block_n: u32,
    /// Which main kernel these traits describe.
    pub main_kernel: MainKernel,
    /// Keys per block of the main kernel (64, or 128 for the two-m-tile
    /// kernels).
    pub main_keys: u32,
    /// Threads per block of the kernels other than the main one (128).
    pub threads: u32,
    /// Threads per block of the main kernel (128; 256 for the 8 warps of
    /// [`MainKernel::TwoMTiles`]).
    pub main_threads: u32,
    /// Query rows per block of the deterministic dQ kernel.
    pub dq_block_m: u32,
}

impl BwdTraits {
    /// The kernels exist for the head dims of
    /// [`ATTN_VARIANTS`](super::ATTN_VARIANTS) (64, 128); these are the
    /// traits with the one-m-tile main kernel ([`MainKernel::OneMTile`]).
    pub fn for_head_dim(head_dim: usize) -> Result<Self> {
        Self::for_kernel(head_dim, MainKernel::OneMTile)
    }
    /// The traits with main kernel `kernel` ([`MainKernel::OneMTile`] and
    /// [`MainKernel::TwoMTiles`] exist for every head dim of the kernels,
    /// [`MainKernel::TwoMTilesFourWarps`] for d 64 only).
    pub fn for_kernel(head_dim: usize, kernel: MainKernel) -> Result<Self> {
        let d = super::kernel_head_dim("the GPU attention backward kernels", head_dim)?;
        if kernel == MainKernel::TwoMTilesFourWarps && d != 64 {
            return Err(Error::Unsupported(format!(
                "the 4-warp two-m-tile backward main kernel exists for head dim 64 only, not {d}"
            )));
        }
        let two = kernel != MainKernel::OneMTile;
        Ok(BwdTraits {
            head_dim: d,
            block_m: if d == 64 || two { 64 } else { 32 },
            block_n: 64,
            main_kernel: kernel,
            main_keys: if two { 128 } else { 64 },
            threads: 128,
            main_threads: if kernel == MainKernel::TwoMTiles {
                256
            } else {
                128
            },
            dq_block_m: 64,
        })
    }
    fn row_stride(&self) -> u32 {
        self.head_dim + 8
    }
    /// Shared memory of the main kernel: K, V, two buffers each of Q and dO,
    /// dSᵀ (the 8-warp two-m-tile kernels: P, then dS written over it), two
    /// buffers each of lse2 and D, the tile's kv_end.
    pub fn main_smem_bytes(&self) -> u32 {
        let rs = self.row_stride();
        2 * self.main_keys * rs * 2
            + 4 * self.block_m * rs * 2
            + self.main_keys * (self.block_m + 8) * 2
            + 4 * self.block_m * 4
            + self.main_keys * 4
    }
    /// Shared memory of the deterministic dQ kernel: Q, dO, two buffers
    /// each of K and V, the query tile's lse2 and D, and per K / V buffer
    /// the key-tile walk's look-ahead window (64 words, C++
    /// `BwdDqTraits::kOffWindow`).
    pub fn dq_smem_bytes(&self) -> u32 {
        6 * self.dq_block_m * self.row_stride() * 2 + 2 * self.dq_block_m * 4 + 2 * 64 * 4
    }
    /// Shared memory of the main variant kernel (`main_var_*`,
    /// `main2_var_*`): [`Self::main_smem_bytes`] and the key starts of the
    /// two query buffers' rows (C++ `kSmemBytesVar`).
    pub fn main_smem_bytes_var(&self) -> u32 {
        self.main_smem_bytes() + 2 * self.block_m * 4
    }
    /// Shared memory of the dQ variant kernel (`dq_var`):
    /// [`Self::dq_smem_bytes`] and the query tile's key starts.
    pub fn dq_smem_bytes_var(&self) -> u32 {
        self.dq_smem_bytes() + self.dq_block_m * 4
    }
    /// Symbol of one of the backward kernels (`stage` is `"pre"`,
    /// `"main_atomic"`, `"main_det"`, `"dq"`, `"dq_convert"`,
    /// `"dkv_convert"`, or for the attention variants `"main_var_atomic"`,
    /// `"main_var_det"`, `"dq_var"`, `"dsinks"`); the main stages name the
    /// traits' main kernel (`main2_*` for [`MainKernel::TwoMTiles`],
    /// `main2w4_*` for [`MainKernel::TwoMTilesFourWarps`]).
    pub fn kernel_name(&self, stage: &str, dtype: Dtype) -> String {
        let stage = match (self.main_kernel, stage) {
            (MainKernel::TwoMTiles, "main_atomic") => "main2_atomic",
            (MainKernel::TwoMTiles, "main_det") => "main2_det",
            (MainKernel::TwoMTiles, "main_var_atomic") => "main2_var_atomic",
            (MainKernel::TwoMTiles, "main_var_det") => "main2_var_det",
            (MainKernel::TwoMTilesFourWarps, "main_atomic") => "main2w4_atomic",
            (MainKernel::TwoMTilesFourWarps, "main_det") => "main2w4_det",
            _ => stage,
        };
        format!("tree_attn_bwd_{stage}_{}_d{}", dtype.name(), self.head_dim)
    }
}

/// Blocks of the main kernel below which [`group_splits`] splits the GQA
/// group over grid.z: two blocks per SM of an H100 / H200 (132 SMs; the
/// one-m-tile kernel's 65,792 / 75,520 bytes of shared memory allow 3 per
/// SM; the two-m-tile kernels' 8 warps 1 (d 64: 241 registers x 256
/// threads; d 128: its 159,232 bytes), the d 64 4-warp one's 93,696 bytes
/// 2: two waves there). Not tuned on a GPU.
pub const MAIN_TARGET_BLOCKS: u64 = 264;

/// Most z-slices a group is split into: the scratch of the split path is
/// `splits · 2 · tokens · kv_heads · d · 4` bytes, and past 8 slices a block
/// handles too few query heads to amortize loading its K, V tile.
pub const MAX_GROUP_SPLITS: u32 = 8;

/// How many z-slices the main kernel splits the query heads of a GQA group
/// over, for `key_tiles · kv_heads` blocks and `group = q_heads / kv_heads`:
/// 1 when the blocks reach [`MAIN_TARGET_BLOCKS`] (or group = 1); otherwise
/// the smallest divisor `s` of `group` with `blocks · s >=
/// MAIN_TARGET_BLOCKS`, at most [`MAX_GROUP_SPLITS`] (the largest divisor up
/// to it when none reaches the target). A divisor, so that every slice
/// handles the same number of query heads.
pub fn group_splits(key_tiles: u64, kv_heads: u64, group: u32) -> u32 {
    let blocks = key_tiles * kv_heads;
    if group <= 1 || blocks >= MAIN_TARGET_BLOCKS {
        return 1;
    }
    let mut best = 1;
    for s in 2..=group.min(MAX_GROUP_SPLITS) {
        if group.is_multiple_of(s) {
            best = s;
            if blocks * s as u64 >= MAIN_TARGET_BLOCKS {
                break;
            }
        }
    }
    best
}

/// One work item of the balanced backward main launch (issue 39 item 1,
/// read by the 8-warp two-m-tile main kernels through
/// [`balanced_item_table`]): the query tiles
/// `[qt_begin, qt_end)` (of `block_m` rows) of one (key tile, kv head,
/// group split). A key tile whose query walk is heavier than the cap of
/// [`balanced_main_items`] is split into `chunks` consecutive query ranges,
/// chunk `chunk` writing its partial f32 dK / dV to a region of scratch of
/// its own ([`balanced_item_table`]; summed in region order by the convert
/// kernel: the same order every run, so deterministic mode stays
/// bit-identical run to run).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MainItem {
    /// Key tile (blockIdx.x of today's grid).
    pub key_tile: u32,
    /// kv head (blockIdx.y).
    pub kv_head: u32,
    /// Group split (blockIdx.z).
    pub split: u32,
    /// First query tile of the range.
    pub qt_begin: u32,
    /// End (exclusive) of the range's query tiles.
    pub qt_end: u32,
    /// Index of this range among its key tile's.
    pub chunk: u32,
    /// Ranges the key tile is split into (1: unsplit).
    pub chunks: u32,
    /// Visible (query, key) pairs of the item times its query heads.
    pub pairs: u64,
}

/// Items per slot (SMs × resident blocks) the balanced launch aims at: the
/// cap of an item is `total / (slots · BALANCE_ITEMS_PER_SLOT)` pairs, so
/// that heavy-first (LPT) assignment ends within about one small item of
/// the mean.
pub const BALANCE_ITEMS_PER_SLOT: u64 = 2;

/// The cap on one item's pairs for `total` pairs over `slots` slots
/// ([`BALANCE_ITEMS_PER_SLOT`]), at least 1.
pub fn balance_cap(total: u64, slots: u64) -> u64 {
    total.div_ceil(slots.max(1) * BALANCE_ITEMS_PER_SLOT).max(1)
}

/// Visible pairs of each query tile of `bm` rows with the keys `keys`:
/// `(query tile, pairs)` for the tiles with at least one, in order.
pub fn key_tile_query_pairs(
    kv_end: &[u32],
    keys: std::ops::Range<usize>,
    bm: usize,
) -> Vec<(u32, u64)> {
    let l = kv_end.len();
    let tiles = l.div_ceil(bm.max(1));
    let mut per = vec![0u64; tiles];
    for k in keys {
        let e = (kv_end[k] as usize).min(l);
        if e <= k {
            continue;
        }
        let (t0, t1) = (k / bm, (e - 1) / bm);
        for (t, slot) in per.iter_mut().enumerate().take(t1 + 1).skip(t0) {
            let a = k.max(t * bm);
            let b = e.min((t + 1) * bm);
            *slot += (b - a) as u64;
        }
    }
    per.into_iter()
        .enumerate()
        .filter(|&(_, n)| n > 0)
        .map(|(t, n)| (t as u32, n))
        .collect()
}

/// The balanced main launch: every (key tile, kv head, group split) of
/// today's grid, its query walk cut into the fewest consecutive ranges of
/// query tiles whose pairs (× the split's `per_split` query heads) stay
/// near `cap` (`ceil(walk / cap)` ranges of about equal pairs; a range is
/// at least one query tile), then ordered heaviest first (ties: key tile,
/// kv head, split, chunk), the order the kernel's blockIdx.x would read
/// them in. FlashAttention-2's backward has one block per key tile and no
/// split of its query walk; FlashAttention-3's persistent schedulers order
/// work longest first: this is that order over items cut to size.
pub fn balanced_main_items(
    kv_end: &[u32],
    main_keys: u32,
    block_m: u32,
    kv_heads: u32,
    group_splits: u32,
    per_split: u32,
    cap: u64,
) -> Vec<MainItem> {
    let l = kv_end.len();
    let keys = main_keys as usize;
    let cap = cap.max(1);
    let mut items = Vec::new();
    for x in 0..l.div_ceil(keys) {
        let walk =
            key_tile_query_pairs(kv_end, x * keys..((x + 1) * keys).min(l), block_m as usize);
        let total: u64 = walk.iter().map(|&(_, n)| n).sum::<u64>() * per_split as u64;
        // Ranges of the walk: (first tile, end tile, pairs per head).
        let mut ranges: Vec<(u32, u32, u64)> = Vec::new();
        if walk.is_empty() {
            ranges.push((0, 0, 0));
        } else {
            let n = total.div_ceil(cap).clamp(1, walk.len() as u64);
            let per_head_total = total / per_split.max(1) as u64;
            let mut acc = 0u64;
            let mut start = 0usize;
            for (i, &(_, p)) in walk.iter().enumerate() {
                acc += p;
                let c = ranges.len() as u64;
                // Cut once this range reaches its share of the walk.
                if c + 1 < n && acc * n >= (c + 1) * per_head_total {
                    let sum = walk[start..=i].iter().map(|&(_, p)| p).sum();
                    ranges.push((walk[start].0, walk[i].0 + 1, sum));
                    start = i + 1;
                }
            }
            if start < walk.len() {
                let sum = walk[start..].iter().map(|&(_, p)| p).sum();
                ranges.push((walk[start].0, walk.last().unwrap().0 + 1, sum));
            }
        }
        let chunks = ranges.len() as u32;
        for split in 0..group_splits {
            for kv_head in 0..kv_heads {
                for (c, &(a, b, p)) in ranges.iter().enumerate() {
                    items.push(MainItem {
                        key_tile: x as u32,
                        kv_head,
                        split,
                        qt_begin: a,
                        qt_end: b,
                        chunk: c as u32,
                        chunks,
                        pairs: p * per_split as u64,
                    });
                }
            }
        }
    }
    items.sort_by_key(|i| {
        (
            std::cmp::Reverse(i.pairs),
            i.key_tile,
            i.kv_head,
            i.split,
            i.chunk,
        )
    });
    items
}

/// The tables of a balanced launch, as the kernels read them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BalancedTables {
    /// `TreeAttnBwdParams::items`: 8 words per item, `{key tile, kv head,
    /// group split, first query tile, end query tile, region, 0, 0}`, the
    /// region `u32::MAX` where the item stores dK, dV itself.
    pub items: Vec<u32>,
    /// `TreeAttnBwdParams::tile_regions`: per (key tile, kv head), key
    /// tile major, `{first region, regions}`.
    pub tile_regions: Vec<u32>,
    /// Regions in all (`dkv_slots`): `[2, key tile keys, D]` f32 tiles of
    /// scratch.
    pub regions: u32,
}

/// The tables of a balanced launch over `key_tiles` × `kv_heads` (key
/// tiles of the main kernel's keys): a key tile cut into `chunks > 1`
/// ranges, or any key tile when the group is split, gets `group_splits ·
/// chunks` consecutive regions of scratch, one per (split, range) in that
/// order, which every item writes whole and `dkv_convert` sums in region
/// order (the same order every run: deterministic mode stays
/// bit-identical); the other key tiles' items store dK, dV themselves and
/// take no scratch.
pub fn balanced_item_table(
    items: &[MainItem],
    group_splits: u32,
    key_tiles: u32,
    kv_heads: u32,
) -> BalancedTables {
    let mut chunks = vec![1u32; key_tiles as usize];
    for i in items {
        chunks[i.key_tile as usize] = i.chunks;
    }
    let mut tile_regions = Vec::with_capacity(2 * (key_tiles * kv_heads) as usize);
    let mut regions = 0u32;
    for &c in &chunks {
        let n = if c == 1 && group_splits == 1 {
            0
        } else {
            group_splits * c
        };
        for _ in 0..kv_heads {
            tile_regions.extend_from_slice(&[regions, n]);
            regions += n;
        }
    }
    let mut t = Vec::with_capacity(items.len() * 8);
    for i in items {
        let at = 2 * (i.key_tile * kv_heads + i.kv_head) as usize;
        let (first, n) = (tile_regions[at], tile_regions[at + 1]);
        let region = if n == 0 {
            u32::MAX
        } else {
            first + i.split * i.chunks + i.chunk
        };
        t.extend_from_slice(&[
            i.key_tile, i.kv_head, i.split, i.qt_begin, i.qt_end, region, 0, 0,
        ]);
    }
    BalancedTables {
        items: t,
        tile_regions,
        regions,
    }
}

/// The launch plans of one backward call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BwdPlans {
    /// `tree_attn_bwd_pre` and `tree_attn_bwd_dq_convert`: one warp per
    /// (token, query head).
    pub per_row: LaunchPlan,
    /// `tree_attn_bwd_main_*`: one block per (key tile, kv head, group
    /// split).
    pub main: LaunchPlan,
    /// `tree_attn_bwd_dq`: one block per (query tile, query head).
    pub dq: LaunchPlan,
    /// `tree_attn_bwd_dkv_convert` (run only when `group_splits > 1`): one
    /// warp per (token, kv head).
    pub dkv_convert: LaunchPlan,
    /// `tree_attn_bwd_dsinks` (run only for a call with sinks that asks for
    /// their gradient): one block of 128 threads per query head.
    pub dsinks: LaunchPlan,
    /// z-slices of the main kernel's grid ([`group_splits`]).
    pub group_splits: u32,
}

impl BwdPlans {
    /// f32 elements of the split path's dK / dV scratch (`[splits, 2,
    /// tokens, kv_heads, D]`); 0 with one split.
    pub fn dkv_accum_len(&self, shape: &AttnShape) -> usize {
        if self.group_splits <= 1 {
            0
        } else {
            self.group_splits as usize * 2 * shape.kv_len()
        }
    }
}

/// The tiling and launch plans of a backward on a validated shape (an
/// [`crate::backend::AttnArgs`]'s), with the group splits of [`group_splits`].
/// Errors: a head dim with no kernel, a grid or index past the hardware's
/// limits.
pub fn plan_backward(shape: &AttnShape) -> Result<(BwdTraits, BwdPlans)> {
    plan_backward_with_splits(shape, None)
}

/// [`plan_backward`] with the main kernel chosen: `None` takes
/// [`MainKernel::default_for`] the head dim.
pub fn plan_backward_with_kernel(
    shape: &AttnShape,
    kernel: Option<MainKernel>,
) -> Result<(BwdTraits, BwdPlans)> {
    plan_backward_with(shape, None, kernel)
}

/// [`plan_backward`] with the group splits forced (`Some(s)`: `s` must divide
/// `q_heads / kv_heads`) or chosen by [`group_splits`] (`None`). Tests force
/// them to cover both paths on small packs.
pub fn plan_backward_with_splits(
    shape: &AttnShape,
    splits: Option<u32>,
) -> Result<(BwdTraits, BwdPlans)> {
    plan_backward_with(shape, splits, None)
}

/// [`plan_backward`] with the group splits forced or planned (as
/// [`plan_backward_with_splits`]) and the main kernel chosen (`None`:
/// [`MainKernel::default_for`] the head dim).
pub fn plan_backward_with(
    shape: &AttnShape,
    splits: Option<u32>,
    kernel: Option<MainKernel>,
) -> Result<(BwdTraits, BwdPlans)> {
    let kernel = kernel.unwrap_or_else(|| MainKernel::default_for(shape.head_dim));
    let traits = BwdTraits::for_kernel(shape.head_dim, kernel)?;
    if shape.q_heads > 65_535 {
        return Err(Error::Unsupported(format!(
            "{} query heads exceed the grid's y limit 65535",
            shape.q_heads
        )));
    }
    let rows = shape.tokens as u64 * shape.q_heads as u64;
    if shape.tokens >= u32::MAX as usize - 128 || rows.div_ceil(4) > i32::MAX as u64 {
        return Err(Error::Unsupported(format!(
            "pack of {} tokens x {} query heads is too large for one launch",
            shape.tokens, shape.q_heads
        )));
    }
    let block = (traits.threads, 1, 1);
    let main_block = (traits.main_threads, 1, 1);
    let key_tiles = shape.tokens.div_ceil(traits.main_keys as usize) as u64;
    let group = (shape.q_heads / shape.kv_heads.max(1)) as u32;
    let splits = match splits {
        None => group_splits(key_tiles, shape.kv_heads as u64, group),
        Some(s) if s >= 1 && group.is_multiple_of(s) && s <= 65_535 => s,
        Some(s) => {
            return Err(Error::Unsupported(format!(
                "{s} group splits do not divide the group of {group} query heads per kv head"
            )))
        }
    };
    let kv_rows = shape.tokens as u64 * shape.kv_heads as u64;
    let plans = BwdPlans {
        per_row: LaunchPlan {
            grid: (rows.div_ceil(4) as u32, 1, 1),
            block,
            shared_mem_bytes: 0,
        },
        main: LaunchPlan {
            grid: (
                shape.tokens.div_ceil(traits.main_keys as usize) as u32,
                shape.kv_heads as u32,
                splits,
            ),
            block: main_block,
            shared_mem_bytes: traits.main_smem_bytes(),
        },
        dq: LaunchPlan {
            grid: (
                shape.tokens.div_ceil(traits.dq_block_m as usize) as u32,
                shape.q_heads as u32,
                1,
            ),
            block,
            shared_mem_bytes: traits.dq_smem_bytes(),
        },
        dkv_convert: LaunchPlan {
            grid: (kv_rows.div_ceil(4) as u32, 1, 1),
            block,
            shared_mem_bytes: 0,
        },
        dsinks: LaunchPlan {
            grid: (shape.q_heads as u32, 1, 1),
            block,
            shared_mem_bytes: DSINKS_SMEM_BYTES,
        },
        group_splits: splits,
    };
    Ok((traits, plans))
}

/// Dynamic shared memory of `tree_attn_bwd_dsinks` (its 4 warps' partial
/// sums; C++ `kDsinksSmemBytes`).
pub const DSINKS_SMEM_BYTES: u32 = 16;

/// [`plan_backward_with`] for a call with attention variants (the
/// `*_var_*` kernels): the main kernel [`MainKernel::for_variants`] picks
/// from `kernel` and whether there is a softcap, and the main and dQ
/// kernels' shared memory with their query rows' key starts.
pub fn plan_backward_var(
    shape: &AttnShape,
    splits: Option<u32>,
    kernel: Option<MainKernel>,
    softcap: bool,
) -> Result<(BwdTraits, BwdPlans)> {
    let kernel = MainKernel::for_variants(shape.head_dim, kernel, softcap)?;
    let (traits, mut plans) = plan_backward_with(shape, splits, Some(kernel))?;
    plans.main.shared_mem_bytes = traits.main_smem_bytes_var();
    plans.dq.shared_mem_bytes = traits.dq_smem_bytes_var();
    Ok((traits, plans))
}

/// How a backward call lays out its main kernel's blocks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum BwdBalance {
    /// One block per (key tile, kv head, group split): the grid of
    /// [`BwdPlans::main`].
    #[default]
    Grid,
    /// The balanced launch ([`balanced_main_items`]) with this cap on an
    /// item's pairs × heads. An error for a main kernel that reads no item
    /// table (only the 8-warp [`MainKernel::TwoMTiles`] kernels do). Tests
    /// use a tiny cap to split small packs.
    Cap(u64),
    /// The balanced launch over `slots` resident blocks (SMs × the main
    /// kernel's blocks per SM): the cap of [`balance_cap`] over the call's
    /// visible pairs × query heads. A main kernel that reads no item table
    /// runs [`Self::Grid`].
    Slots(u64),
}

/// What a backend chose for one backward call (the rest comes from the
/// call).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct BwdOptions {
    pub mode: DqMode,
    /// Forced group splits (`None`: [`group_splits`]).
    pub splits: Option<u32>,
    /// The main kernel (`None`: [`MainKernel::default_for`], or
    /// [`MainKernel::for_variants`] with variants).
    pub kernel: Option<MainKernel>,
    pub balance: BwdBalance,
}

/// One kernel launch of a backward call; the backend maps it to its kernel
/// from [`BwdProgram::traits`]' main kernel, [`BwdProgram::variants`] and
/// [`BwdProgram::mode`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BwdStage {
    /// `tree_attn_bwd_pre`: D = rowsum(dO ∘ O), and the zeroed dQ
    /// accumulator in atomic mode.
    Pre,
    /// `tree_attn_bwd_dsinks`: the sinks' gradient.
    Dsinks,
    /// The main kernel (dK, dV; dQ too in atomic mode).
    Main,
    /// `tree_attn_bwd_dq` (deterministic mode).
    Dq,
    /// `tree_attn_bwd_dq_convert`.
    DqConvert,
    /// `tree_attn_bwd_dkv_convert`: the f32 partials of group splits or of
    /// a balanced launch summed into dK, dV.
    DkvConvert,
}

impl BwdStage {
    /// The stage's name in [`BwdTraits::kernel_name`] (`variants`: the
    /// call runs the `*_var_*` kernels).
    pub(crate) fn name(self, mode: DqMode, variants: bool) -> &'static str {
        let det = mode == DqMode::Deterministic;
        match (self, variants, det) {
            (BwdStage::Pre, ..) => "pre",
            (BwdStage::Dsinks, ..) => "dsinks",
            (BwdStage::Main, false, false) => "main_atomic",
            (BwdStage::Main, false, true) => "main_det",
            (BwdStage::Main, true, false) => "main_var_atomic",
            (BwdStage::Main, true, true) => "main_var_det",
            (BwdStage::Dq, false, _) => "dq",
            (BwdStage::Dq, true, _) => "dq_var",
            (BwdStage::DqConvert, ..) => "dq_convert",
            (BwdStage::DkvConvert, ..) => "dkv_convert",
        }
    }
}

/// One backward call sequenced once for every backend that runs the
/// kernels (the emulator and CUDA execute it; neither decides the order,
/// the scratch or the item table itself): the plans, the launches in order,
/// the scratch each needs and how it must start, the balanced launch's
/// item table.
#[derive(Clone, Debug)]
pub(crate) struct BwdProgram {
    pub traits: BwdTraits,
    pub plans: BwdPlans,
    pub mode: DqMode,
    /// The call has attention variants: the `*_var_*` kernels run.
    pub variants: bool,
    /// The launches in order; empty for an empty pack (then only a
    /// requested dsinks is zeroed: no row, the sum over rows is 0).
    pub stages: Vec<(BwdStage, LaunchPlan)>,
    /// f32 elements of D (written by `pre` before anything reads it).
    pub delta_len: usize,
    /// f32 elements of the dQ accumulator (zeroed by `pre` in atomic mode,
    /// written by the dQ kernel in deterministic mode).
    pub dq_accum_len: usize,
    /// f32 elements of the dK / dV partials (0: none, the address is 0).
    /// Every element a kernel reads is written before (group splits: each
    /// z-slice writes its slot for every key; a balanced launch: each item
    /// its whole region).
    pub dkv_accum_len: usize,
    /// The balanced launch's tables ([`balanced_item_table`]; empty: the
    /// grid): the item table, then at word [`Self::regions_at`] the tile
    /// regions. Uploaded by the backend as one buffer, its address in
    /// [`BwdParams::items`] and that plus `4 · regions_at` bytes in
    /// [`BwdParams::tile_regions`].
    pub items: Vec<u32>,
    /// Where the tile regions start in [`Self::items`] (words).
    pub regions_at: usize,
    /// [`BwdParams::dkv_slots`].
    pub dkv_slots: u32,
}

impl BwdProgram {
    /// The program of a backward call on the kernels (`kernels`, e.g. "CUDA
    /// kernels", names them in errors) over a pack whose kv_end is
    /// `kv_end` (on the host: the balanced launch's items are cut from
    /// it), with or without the sinks' gradient.
    ///
    /// Errors: a call the kernels do not compute
    /// ([`super::check_kernel_call`]), rotary (rotated around the backward
    /// by the backend), a plan past the hardware's limits, a balanced
    /// [`BwdBalance::Cap`] on a main kernel with no item table.
    pub(crate) fn new<M: crate::backend::Memory, T: crate::backend::Element>(
        kernels: &str,
        args: &crate::backend::AttnArgs<'_, M, T>,
        kv_end: &[u32],
        dsinks: bool,
        opts: BwdOptions,
    ) -> Result<BwdProgram> {
        let variants = super::check_kernel_call(kernels, args)?;
        let (shape, params) = (args.shape(), args.params());
        if params.rope.is_some() {
            return Err(Error::Unsupported(
                "internal: rotary reached the rotary-free backward kernels".into(),
            ));
        }
        if kv_end.len() != shape.tokens {
            return Err(Error::Pack(format!(
                "internal: a kv_end of {} keys for a call of {} tokens",
                kv_end.len(),
                shape.tokens
            )));
        }
        let (traits, mut plans) = if variants {
            plan_backward_var(&shape, opts.splits, opts.kernel, params.softcap.is_some())?
        } else {
            plan_backward_with(&shape, opts.splits, opts.kernel)?
        };
        let mode = opts.mode;
        let mut program = BwdProgram {
            traits,
            plans,
            mode,
            variants,
            stages: Vec::new(),
            delta_len: shape.q_heads * shape.tokens,
            dq_accum_len: shape.q_len(),
            dkv_accum_len: plans.dkv_accum_len(&shape),
            items: Vec::new(),
            regions_at: 0,
            dkv_slots: 0,
        };
        if shape.tokens == 0 {
            return Ok(program);
        }
        let two = traits.main_kernel == MainKernel::TwoMTiles;
        let cap = match opts.balance {
            BwdBalance::Grid => None,
            BwdBalance::Cap(_) if !two => {
                return Err(Error::Unsupported(format!(
                    "the balanced backward launch exists for the 8-warp two-m-tile main kernel only, not {:?}",
                    traits.main_kernel
                )))
            }
            BwdBalance::Cap(cap) => Some(cap),
            BwdBalance::Slots(_) if !two => None,
            BwdBalance::Slots(slots) => {
                let pairs: u64 = kv_end
                    .iter()
                    .enumerate()
                    .map(|(k, &e)| (e as u64).saturating_sub(k as u64))
                    .sum();
                Some(balance_cap(pairs * shape.q_heads as u64, slots))
            }
        };
        if let Some(cap) = cap {
            let group = (shape.q_heads / shape.kv_heads) as u32;
            let list = balanced_main_items(
                kv_end,
                traits.main_keys,
                traits.block_m,
                shape.kv_heads as u32,
                plans.group_splits,
                group / plans.group_splits,
                cap,
            );
            plans.main.grid = (list.len() as u32, 1, 1);
            let key_tiles = shape.tokens.div_ceil(traits.main_keys as usize) as u32;
            let t =
                balanced_item_table(&list, plans.group_splits, key_tiles, shape.kv_heads as u32);
            program.plans = plans;
            program.regions_at = t.items.len();
            program.items = [t.items, t.tile_regions].concat();
            program.dkv_slots = t.regions;
            program.dkv_accum_len =
                t.regions as usize * 2 * traits.main_keys as usize * shape.head_dim;
        }
        let mut stages = vec![(BwdStage::Pre, plans.per_row)];
        if dsinks && args.sinks().is_some() {
            stages.push((BwdStage::Dsinks, plans.dsinks));
        }
        stages.push((BwdStage::Main, plans.main));
        if mode == DqMode::Deterministic {
            stages.push((BwdStage::Dq, plans.dq));
        }
        stages.push((BwdStage::DqConvert, plans.per_row));
        if program.dkv_accum_len > 0 {
            stages.push((BwdStage::DkvConvert, plans.dkv_convert));
        }
        program.stages = stages;
        Ok(program)
    }

    /// The call's scalars in the kernels' argument struct; every address 0
    /// (the backend sets the ones it has).
    pub(crate) fn params(
        &self,
        shape: &AttnShape,
        params: &crate::backend::AttnParams,
    ) -> BwdParams {
        let (softcap_c, softcap_in) = super::softcap_args(params);
        BwdParams {
            q: 0,
            k: 0,
            v: 0,
            o: 0,
            d_o: 0,
            lse: 0,
            delta: 0,
            dq_accum: 0,
            dq: 0,
            dk: 0,
            dv: 0,
            kv_end: 0,
            tile_kv_min: 0,
            tile_kv_max: 0,
            dkv_accum: 0,
            tokens: shape.tokens as u32,
            q_heads: shape.q_heads as u32,
            kv_heads: shape.kv_heads as u32,
            num_key_tiles: shape.tokens.div_ceil(self.traits.block_n as usize) as u32,
            scale: params.softmax_scale as f32,
            scale_log2: super::scale_log2(params),
            head_dim: self.traits.head_dim,
            zero_dq_accum: u32::from(self.mode == DqMode::Atomic),
            group_splits: self.plans.group_splits,
            dkv_slots: self.dkv_slots,
            key_start: 0,
            start_tile_min: 0,
            start_tile_max: 0,
            sinks: 0,
            dsinks: 0,
            softcap_c,
            softcap_in,
            items: 0,
            tile_regions: 0,
        }
    }
}

/// Mirror of `TreeAttnBwdParams` (kernels/tree_attn_bwd.cu). Pointers are
/// device addresses (CUDA) or host addresses (emulator).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct BwdParams {
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub o: u64,
    pub d_o: u64,
    pub lse: u64,
    pub delta: u64,
    pub dq_accum: u64,
    pub dq: u64,
    pub dk: u64,
    pub dv: u64,
    pub kv_end: u64,
    pub tile_kv_min: u64,
    pub tile_kv_max: u64,
    pub dkv_accum: u64,
    pub tokens: u32,
    pub q_heads: u32,
    pub kv_heads: u32,
    pub num_key_tiles: u32,
    pub scale: f32,
    pub scale_log2: f32,
    pub head_dim: u32,
    pub zero_dq_accum: u32,
    pub group_splits: u32,
    /// Slots of `dkv_accum` summed by `dkv_convert` (0: `group_splits`).
    pub dkv_slots: u32,
    /// The variants (0 for a plain call).
    pub key_start: u64,
    pub start_tile_min: u64,
    pub start_tile_max: u64,
    pub sinks: u64,
    pub dsinks: u64,
    pub softcap_c: f32,
    pub softcap_in: f32,
    /// The balanced main launch's item table (8 words per block; 0: today's
    /// grid). See [`balanced_item_table`].
    pub items: u64,
    /// The balanced launch's regions per (key tile, kv head).
    pub tile_regions: u64,
}
super::assert_layout!(BwdParams, 224, {
    q: 0, k: 8, v: 16, o: 24, d_o: 32, lse: 40, delta: 48, dq_accum: 56, dq: 64, dk: 72,
    dv: 80, kv_end: 88, tile_kv_min: 96, tile_kv_max: 104, dkv_accum: 112, tokens: 120,
    q_heads: 124, kv_heads: 128, num_key_tiles: 132, scale: 136, scale_log2: 140,
    head_dim: 144, zero_dq_accum: 148, group_splits: 152, dkv_slots: 156, key_start: 160,
    start_tile_min: 168, start_tile_max: 176, sinks: 184, dsinks: 192, softcap_c: 200,
    softcap_in: 204, items: 208, tile_regions: 216,
});

#[cfg(test)]
mod tests {
    use super::*;

    /// The program of a call on the tree `kv_end` (positions 0..): 4 / 2
    /// heads at d 128, bf16.
    fn program(kv_end: &[u32], sinks: bool, softcap: bool, opts: BwdOptions) -> Result<BwdProgram> {
        use crate::backend::{AttnArgs, AttnParams, Host};
        let l = kv_end.len();
        let shape = AttnShape::new(l, 4, 2, 128);
        let pos: Vec<u32> = (0..l as u32).collect();
        let mask = crate::mask::PackMask::new(kv_end, &pos)?;
        let zeros = vec![half::bf16::ZERO; shape.q_len().max(4)];
        let params = AttnParams {
            softcap: softcap.then_some(30.0),
            ..AttnParams::new(128)
        };
        let args = AttnArgs::<Host, half::bf16>::new(
            &zeros[..shape.q_len()],
            &zeros[..shape.kv_len()],
            &zeros[..shape.kv_len()],
            shape,
            mask,
            params,
        )?;
        let args = if sinks {
            args.with_sinks(&zeros[..4])?
        } else {
            args
        };
        BwdProgram::new("test kernels", &args, kv_end, sinks, opts)
    }

    fn stages(p: &BwdProgram) -> Vec<BwdStage> {
        p.stages.iter().map(|s| s.0).collect()
    }

    /// A GRPO-like fan: a prompt of `prompt` keys seen by `n` branches of
    /// `each`.
    fn fan(prompt: usize, n: usize, each: usize) -> Vec<u32> {
        let l = prompt + n * each;
        let mut e: Vec<u32> = vec![l as u32; prompt];
        for b in 0..n {
            let end = (prompt + (b + 1) * each) as u32;
            e.extend(std::iter::repeat_n(end, each));
        }
        e
    }

    #[test]
    fn a_program_sequences_the_launches_once() {
        use BwdStage::*;
        let tree = fan(256, 3, 200);
        // One group split (the rule would split so small a pack).
        let atomic = BwdOptions {
            splits: Some(1),
            ..BwdOptions::default()
        };
        let det = BwdOptions {
            mode: DqMode::Deterministic,
            ..atomic
        };
        let p = program(&tree, false, false, atomic).unwrap();
        assert_eq!(stages(&p), [Pre, Main, DqConvert]);
        assert!(!p.variants && p.items.is_empty() && p.dkv_accum_len == 0);
        assert_eq!(
            p.params(
                &AttnShape::new(856, 4, 2, 128),
                &crate::backend::AttnParams::new(128)
            )
            .zero_dq_accum,
            1
        );
        let p = program(&tree, false, false, det).unwrap();
        assert_eq!(stages(&p), [Pre, Main, Dq, DqConvert]);
        // Sinks: the variant kernels, dsinks after pre.
        let p = program(&tree, true, false, det).unwrap();
        assert!(p.variants);
        assert_eq!(stages(&p), [Pre, Dsinks, Main, Dq, DqConvert]);
        assert_eq!(Main.name(p.mode, p.variants), "main_var_det");
        assert_eq!(Dq.name(p.mode, p.variants), "dq_var");
        // Forced splits: partials, summed by dkv_convert.
        let split = BwdOptions {
            splits: Some(2),
            ..atomic
        };
        let p = program(&tree, false, false, split).unwrap();
        assert_eq!(stages(&p), [Pre, Main, DqConvert, DkvConvert]);
        assert_eq!(p.dkv_accum_len, 2 * 2 * tree.len() * 2 * 128);
        // An empty pack: nothing to launch.
        assert!(program(&[], true, false, det).unwrap().stages.is_empty());
    }

    #[test]
    fn a_balanced_program_cuts_the_prompt_and_gives_only_it_scratch() {
        let tree = fan(512, 8, 256);
        let l = tree.len();
        let one_split = BwdOptions {
            splits: Some(1),
            ..BwdOptions::default()
        };
        let grid = program(&tree, false, false, one_split).unwrap();
        let balanced = BwdOptions {
            balance: BwdBalance::Slots(64),
            ..one_split
        };
        let p = program(&tree, false, false, balanced).unwrap();
        assert_eq!(
            stages(&p),
            [
                BwdStage::Pre,
                BwdStage::Main,
                BwdStage::DqConvert,
                BwdStage::DkvConvert
            ]
        );
        // More items than the grid's blocks: the prompt's key tiles are cut.
        let blocks = grid.plans.main.grid.0 * grid.plans.main.grid.1 * grid.plans.main.grid.2;
        assert!(
            p.plans.main.grid.0 > blocks,
            "{:?} vs {blocks}",
            p.plans.main
        );
        assert_eq!(p.plans.main.grid.1 * p.plans.main.grid.2, 1);
        let n_items = p.plans.main.grid.0 as usize;
        assert_eq!(p.regions_at, 8 * n_items);
        // 20 key tiles of 128 × 2 kv heads, two words each.
        assert_eq!(p.items.len(), 8 * n_items + 2 * 20 * 2);
        // Scratch only for the cut key tiles: one [2, 128, d] region per
        // range; the uncut tiles' items store dK, dV themselves.
        let (items, regions) = p.items.split_at(p.regions_at);
        let cut: Vec<u32> = regions.chunks(2).map(|r| r[1]).collect();
        assert!(cut.contains(&0) && cut.iter().any(|&n| n > 1), "{cut:?}");
        assert_eq!(p.dkv_slots, cut.iter().sum::<u32>());
        assert_eq!(p.dkv_accum_len, p.dkv_slots as usize * 2 * 128 * 128);
        // Every region is some item's, exactly once; an item without one
        // belongs to an uncut key tile.
        let mut owner = vec![0u32; p.dkv_slots as usize];
        for it in items.chunks(8) {
            let (tile, kv_head, region) = (it[0], it[1], it[5]);
            let at = 2 * (tile * 2 + kv_head) as usize;
            let (first, n) = (regions[at], regions[at + 1]);
            if region == u32::MAX {
                assert_eq!(n, 0);
            } else {
                assert!((first..first + n).contains(&region));
                owner[region as usize] += 1;
            }
        }
        assert!(owner.iter().all(|&o| o == 1), "{owner:?}");
        assert_eq!(
            p.params(
                &AttnShape::new(l, 4, 2, 128),
                &crate::backend::AttnParams::new(128)
            )
            .dkv_slots,
            p.dkv_slots
        );
        // The cap follows the slots: Σ pairs × heads / (2 · slots).
        let pairs: u64 = tree
            .iter()
            .enumerate()
            .map(|(k, &e)| e as u64 - k as u64)
            .sum();
        let cap = BwdOptions {
            balance: BwdBalance::Cap(balance_cap(pairs * 4, 64)),
            ..one_split
        };
        assert_eq!(program(&tree, false, false, cap).unwrap().items, p.items);
        // The one-m-tile kernel reads no table: Slots runs its grid, an
        // explicit cap is an error naming the kernel.
        let one = BwdOptions {
            kernel: Some(MainKernel::OneMTile),
            ..balanced
        };
        let p = program(&tree, false, false, one).unwrap();
        assert!(p.items.is_empty() && p.dkv_slots == 0);
        let e = program(
            &tree,
            false,
            false,
            BwdOptions {
                balance: BwdBalance::Cap(1),
                ..one
            },
        )
        .unwrap_err();
        assert!(format!("{e}").contains("OneMTile"), "{e}");
        // A softcap at d 128 picks the one-m-tile variant kernel: the grid.
        let p = program(&tree, false, true, balanced).unwrap();
        assert!(p.variants && p.items.is_empty());
    }

    #[test]
    fn a_program_refuses_rotary_and_a_foreign_kv_end() {
        use crate::backend::{AttnArgs, AttnParams, Host, Rope};
        let kv_end = vec![4u32; 4];
        let pos = [0u32, 1, 2, 3];
        let shape = AttnShape::new(4, 1, 1, 64);
        let mask = crate::mask::PackMask::new(&kv_end, &pos).unwrap();
        let z = vec![half::f16::ZERO; 4 * 64];
        let rope = AttnParams {
            rope: Some(Rope {
                base: 10_000.0,
                dims: 64,
            }),
            ..AttnParams::new(64)
        };
        let args = AttnArgs::<Host, half::f16>::new(&z, &z, &z, shape, mask, rope).unwrap();
        let e = BwdProgram::new("k", &args, &kv_end, false, BwdOptions::default()).unwrap_err();
        assert!(format!("{e}").contains("rotary"), "{e}");
        let args =
            AttnArgs::<Host, half::f16>::new(&z, &z, &z, shape, mask, AttnParams::new(64)).unwrap();
        assert!(BwdProgram::new("k", &args, &kv_end, false, BwdOptions::default()).is_ok());
        let e =
            BwdProgram::new("k", &args, &kv_end[..3], false, BwdOptions::default()).unwrap_err();
        assert!(format!("{e}").contains("kv_end of 3 keys"), "{e}");
    }

    #[test]
    fn plans() {
        let shape = AttnShape {
            tokens: 130,
            q_heads: 6,
            kv_heads: 2,
            head_dim: 128,
            v_head_dim: 128,
        };
        // The one-m-tile main kernel: 64-key blocks of 4 warps, 32-row
        // query tiles at d 128.
        let (t, p) = plan_backward_with_kernel(&shape, Some(MainKernel::OneMTile)).unwrap();
        assert_eq!(t.block_m, 32);
        // 6 blocks < 264: the group of 3 splits 3 ways.
        assert_eq!(p.main.grid, (3, 2, 3));
        assert_eq!(p.main.block, (128, 1, 1));
        assert_eq!(p.group_splits, 3);
        assert_eq!(p.dkv_convert.grid, (65, 1, 1));
        assert_eq!(p.dkv_accum_len(&shape), 3 * 2 * 130 * 2 * 128);
        let (_, p1) = plan_backward_with(&shape, Some(1), Some(MainKernel::OneMTile)).unwrap();
        assert_eq!((p1.main.grid, p1.dkv_accum_len(&shape)), ((3, 2, 1), 0));
        assert!(plan_backward_with_splits(&shape, Some(2)).is_err());
        assert_eq!(p.main.shared_mem_bytes, 75_520);
        assert_eq!(
            t.kernel_name("main_det", Dtype::Bf16),
            "tree_attn_bwd_main_det_bf16_d128"
        );
        // The default at d 128: the two-m-tile kernel, 128-key blocks of 8
        // warps, 64-row query tiles; the other kernels keep 128 threads.
        let (t, p) = plan_backward(&shape).unwrap();
        assert_eq!(
            (t.main_kernel, t.block_m, t.main_keys),
            (MainKernel::TwoMTiles, 64, 128)
        );
        assert_eq!(p.main.grid, (2, 2, 3));
        assert_eq!(p.main.block, (256, 1, 1));
        assert_eq!(p.per_row.block, (128, 1, 1));
        assert_eq!(p.main.shared_mem_bytes, 159_232);
        assert_eq!(p.dq.grid, (3, 6, 1));
        assert_eq!(p.dq.shared_mem_bytes, 105_472);
        assert_eq!(p.per_row.grid, (195, 1, 1));
        assert_eq!(
            BwdTraits::for_head_dim(64).unwrap().main_smem_bytes(),
            65_792
        );
        assert_eq!(
            t.kernel_name("main_det", Dtype::Bf16),
            "tree_attn_bwd_main2_det_bf16_d128"
        );
        assert!(matches!(
            BwdTraits::for_head_dim(96),
            Err(Error::Unsupported(_))
        ));
    }

    #[test]
    fn group_split_rule() {
        // Plenty of blocks, or nothing to split: one slice.
        assert_eq!(group_splits(264, 1, 8), 1);
        assert_eq!(group_splits(4, 1, 1), 1);
        // 64 key tiles (L = 4096), 1 kv head, 8:1 GQA: 64 · 8 = 512 >= 264
        // and 64 · 4 = 256 < 264.
        assert_eq!(group_splits(64, 1, 8), 8);
        assert_eq!(group_splits(66, 1, 8), 4);
        assert_eq!(group_splits(132, 1, 8), 2);
        // Divisors only; capped at MAX_GROUP_SPLITS.
        assert_eq!(group_splits(100, 1, 3), 3);
        assert_eq!(group_splits(1, 1, 6), 6);
        assert_eq!(group_splits(1, 1, 32), 8);
        assert_eq!(group_splits(1, 1, 7), 7);
        assert_eq!(group_splits(1, 1, 11), 1);
    }
}
