//! Censuses of how the CPU attention visits a mask: tiles skipped, full or
//! partial ([`tile_counts`]), register blocks inside the partial tiles
//! ([`block_counts`]), entries computed ([`computed_entries`]) and keys
//! gathered ([`gather_counts`]), for reports and for tests that must
//! exercise every path.

use super::bounds::KeyTileBounds;
use super::{gather, microkernel, TileClass, TILE};
use crate::mask::PackMask;

/// Census of the (query tile, key tile) blocks of a pack at the CPU
/// backend's [`TILE`] size, over the lower block triangle (key tile index <=
/// query tile index; blocks above it are never visited).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TileCounts {
    /// Blocks with no visible pair (not computed).
    pub skip: u64,
    /// Blocks with only visible pairs (no mask).
    pub full: u64,
    /// Mixed blocks (masked element-wise).
    pub partial: u64,
}

/// Counts the skip / full / partial blocks the CPU attention visits on this
/// mask (for reports and for tests that must exercise all three paths).
pub fn tile_counts(mask: PackMask<'_>) -> TileCounts {
    let bounds = KeyTileBounds::new(mask.kv_end());
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
/// forward and the backward classify them: `skip` blocks hold no visible
/// entry and are not computed, `full` ones need no per-element mask,
/// `masked` ones are masked element-wise. Blocks past the last token are not
/// counted. (The partial tiles that are gathered, [`gather_counts`], are
/// computed as chunks instead.)
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BlockCounts {
    /// Blocks with no visible entry.
    pub skip: u64,
    /// Blocks with only visible entries.
    pub full: u64,
    /// Blocks masked element-wise.
    pub masked: u64,
}

/// Queries per register block.
pub const BLOCK_QUERIES: usize = microkernel::MR;
/// Keys per register block.
pub const BLOCK_KEYS: usize = microkernel::NS;

/// Counts the register blocks of the partial tiles by how the CPU attention
/// computes them (see [`BlockCounts`]).
pub fn block_counts(mask: PackMask<'_>) -> BlockCounts {
    let bounds = KeyTileBounds::new(mask.kv_end());
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

/// The (query, key) entries the CPU forward computes on this
/// mask: the live register blocks ([`BLOCK_QUERIES`] × [`BLOCK_KEYS`]) of
/// every tile that is neither skipped nor gathered, and of every chunk of
/// gathered keys ([`gather_counts`]), whole blocks (the kernels compute
/// whole blocks, padding lanes included). Visible pairs over this is the
/// share of the computed work that is useful: 1 would be a kernel that
/// computes visible pairs only.
pub fn computed_entries(mask: PackMask<'_>) -> u64 {
    let bounds = KeyTileBounds::new(mask.kv_end());
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
/// CPU forward computes as chunks of gathered keys instead of
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

/// Counts the key gathering of the CPU forward on this mask
/// (see [`GatherCounts`]).
pub fn gather_counts(mask: PackMask<'_>) -> GatherCounts {
    let bounds = KeyTileBounds::new(mask.kv_end());
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
