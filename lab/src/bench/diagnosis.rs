//! Diagnosis of the CPU kernel's throughput on a mask: the share of the
//! computed entries that are visible ([`tile_utilization`],
//! [`kernel_utilization`]) and how evenly the forward's work items spread
//! over the threads ([`forward_balance`]).

use super::mask_of;
use treeattn::backend::cpu::{computed_entries, TILE};
use treeattn::pack::Pack;

/// How evenly the CPU backend's forward spreads over `threads` threads on
/// this pack with `heads` heads: its work items are (head, query tile),
/// each costing its non-skipped key tiles, pulled busiest first from a
/// shared queue (longest-processing-time list scheduling). Returns the
/// total cost over `threads ×` the simulated finishing time of the last
/// thread: 1.0 is perfect balance.
pub fn forward_balance(pack: &Pack, heads: usize, threads: usize) -> f64 {
    use treeattn::backend::cpu::{KeyTileBounds, TileClass};
    let l = pack.len();
    let bounds = KeyTileBounds::new(&pack.kv_end);
    let mut costs: Vec<u64> = (0..l.div_ceil(TILE))
        .flat_map(|qt| {
            let (q0, q1) = (qt * TILE, ((qt + 1) * TILE).min(l));
            let c = (0..=qt)
                .filter(|&kt| bounds.classify(q0, q1, kt) != TileClass::Skip)
                .count() as u64;
            std::iter::repeat_n(c, heads)
        })
        .collect();
    costs.sort_unstable_by(|a, b| b.cmp(a));
    let mut finish = vec![0u64; threads.max(1)];
    for c in &costs {
        let next = finish.iter_mut().min().expect("at least one thread");
        *next += c;
    }
    let total: u64 = costs.iter().sum();
    let last = finish.iter().copied().max().unwrap_or(0);
    if last == 0 {
        return 1.0;
    }
    total as f64 / (finish.len() as f64 * last as f64)
}

/// The fraction of the (query, key) entries in the `tile × tile` blocks a
/// tiled kernel computes on this pack (blocks in the lower block triangle
/// not skipped by the rule of DESIGN §5: skip when `k0 > q1 − 1` or
/// `max(kv_end[k0..k1]) <= q0`) that are visible: the rest is masked work.
/// At the CPU backend's [`treeattn::backend::cpu::TILE`] its FLOP/s on a mask
/// is roughly proportional to this, so the trie's over causal's explains
/// most of the tree/causal throughput ratio; smaller `tile`s show what
/// finer skipping would recover. 0 for an empty pack.
pub fn tile_utilization(pack: &Pack, tile: usize) -> f64 {
    let l = pack.len();
    let tile = tile.max(1);
    let max_end: Vec<usize> = pack
        .kv_end
        .chunks(tile)
        .map(|c| c.iter().copied().max().unwrap_or(0) as usize)
        .collect();
    let mut computed = 0u64;
    for qt in 0..l.div_ceil(tile) {
        let (q0, q1) = (qt * tile, ((qt + 1) * tile).min(l));
        for (kt, &end) in max_end.iter().enumerate().take(qt + 1) {
            let (k0, k1) = (kt * tile, ((kt + 1) * tile).min(l));
            if k0 < q1 && end > q0 {
                computed += ((q1 - q0) * (k1 - k0)) as u64;
            }
        }
    }
    if computed == 0 {
        return 0.0;
    }
    mask_of(pack).visible_pairs() as f64 / computed as f64
}

/// Visible pairs over the entries the CPU kernels compute on `pack`
/// ([`computed_entries`]); 0 for an empty pack.
pub fn kernel_utilization(pack: &Pack) -> f64 {
    let computed = computed_entries(mask_of(pack));
    if computed == 0 {
        return 0.0;
    }
    mask_of(pack).visible_pairs() as f64 / computed as f64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::workloads::{Workload, SHAPES};
    use crate::gen::Size;
    use treeattn::backend::cpu::tile_counts;

    #[test]
    fn tile_utilization_counts_visible_entries_of_computed_tiles() {
        let pack = |kv_end: Vec<u32>| Pack {
            position_ids: vec![0; kv_end.len()],
            tokens: vec![0; kv_end.len()],
            kv_end,
            loss: Vec::new(),
        };
        // One 64-token causal tile: 64·65/2 of 64² entries visible.
        let t = tile_utilization(&pack(vec![64; 64]), 64);
        assert!((t - 2080.0 / 4096.0).abs() < 1e-12, "{t}");
        // Two independent 64-token sequences: the off-diagonal block is
        // skipped, so the same share as one.
        let mut two = vec![64u32; 64];
        two.extend(vec![128u32; 64]);
        assert!((tile_utilization(&pack(two.clone()), 64) - 2080.0 / 4096.0).abs() < 1e-12);
        // Causal over 128: the off-diagonal block is full and computed.
        let t = tile_utilization(&pack(vec![128; 128]), 64);
        assert!(
            (t - (128.0 * 129.0 / 2.0) / (3.0 * 4096.0)).abs() < 1e-12,
            "{t}"
        );
        // A 65-token causal pack: edge tiles count their real size.
        let t = tile_utilization(&pack(vec![65; 65]), 64);
        assert!(
            (t - (65.0 * 66.0 / 2.0) / (4096.0 + 64.0 + 1.0)).abs() < 1e-12,
            "{t}"
        );
        // Tile 1 computes exactly the visible entries.
        assert_eq!(tile_utilization(&pack(two), 1), 1.0);
        // At the CPU backend's tile, the blocks computed are those its own
        // census does not skip (packs of whole tiles: entries = blocks · 64²).
        for (i, shape) in SHAPES.into_iter().enumerate() {
            let w = Workload::generate(shape, i as u64, Size::Bench).unwrap();
            let l = w.trie.len() / TILE * TILE;
            let mut p = w.trie.clone();
            p.kv_end.truncate(l);
            p.position_ids.truncate(l);
            p.tokens.truncate(l);
            for e in p.kv_end.iter_mut() {
                *e = (*e).min(l as u32);
            }
            let c = tile_counts(p.mask().unwrap());
            let computed = ((c.full + c.partial) * (TILE * TILE) as u64) as f64;
            let expected = p.mask().unwrap().visible_pairs() as f64 / computed;
            assert!(
                (tile_utilization(&p, TILE) - expected).abs() < 1e-12,
                "{shape:?}"
            );
        }
    }

    #[test]
    fn forward_balance_simulates_the_busiest_first_queue() {
        let pack = |kv_end: Vec<u32>| Pack {
            position_ids: vec![0; kv_end.len()],
            tokens: vec![0; kv_end.len()],
            kv_end,
            loss: Vec::new(),
        };
        // Causal over 3 tiles: items cost 1, 2, 3 per head. One head on two
        // threads: {3} and {2, 1} finish together.
        let causal = pack(vec![192; 192]);
        assert_eq!(forward_balance(&causal, 1, 2), 1.0);
        // Two heads: 3,3,2,2,1,1 → {3,2,1} {3,2,1}.
        assert_eq!(forward_balance(&causal, 2, 2), 1.0);
        // Three threads, one head: the 3-tile item alone bounds the time.
        assert!((forward_balance(&causal, 1, 3) - 6.0 / 9.0).abs() < 1e-12);
        assert_eq!(forward_balance(&causal, 1, 1), 1.0);
    }
}
