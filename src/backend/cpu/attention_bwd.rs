//! Tiled attention backward in two deterministic kinds of work item, with
//! `S` and `dP` computed once per visited block (FlashAttention-2's five
//! block products, not seven):
//!
//! - per key tile, dK and dV over the query tiles that see it: `S`, `dP`,
//!   `P`, `dS`, then `dV += Pᵀ dO` and `dK += dSᵀ Q`, leaving each block's
//!   `dS` in a store;
//! - per (query head, query tile), dQ over the key tiles it sees:
//!   `dQ += dS K` from that store, after the key items are done.
//!
//! The store holds the `dS` of one *step* at a time — a chunk of query
//! tiles for a slice of the kv head's query heads, at most [`DS_BUDGET`]
//! bytes, so it is read back from cache, not memory — key tiles
//! accumulating dK, dV across steps. The steps depend on the mask alone and
//! every output block is summed by one item in a fixed order, so results are
//! bit-identical whatever the thread count. One kv head (with its query
//! heads) at a time: its inputs are copied, then its items run while the
//! copies are still in cache: copies of every head at once (5 arrays of
//! `lpad · dp` per head: 12 MB at 2.3k tokens, 4 heads, d = 64) would be read
//! back from memory by the passes (BENCHMARKS.md §2 has the measurement).

use super::attention_fwd::Softcap;
use super::lanes;
use super::microkernel::{live_strip_indices, live_strips, row_strips, simd_dispatch, strip, NS};
use super::operands::{head_tile_rows, prefetch_for_write, store_row, Input, Layout, RopeTable};
use super::pairs::{self, accumulate_or_pairs, scores_or_pairs, Sum};
use super::workspace;
use super::workspace::Staggered;
use super::{
    check_result, run_parallel, BlockMasks, CpuElement, CpuFloat, KeyTileBounds, TileClass, TILE,
};
use crate::backend::{BackwardCall, Grads, Host};
use crate::Result;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};

/// Most bytes of `dS` one step keeps for its dQ items, meant to be read
/// back from L2/L3 rather than memory. A step is a chunk of query tiles
/// for a slice of the kv head's query heads: all of them when one query
/// tile's blocks for all of them fit, else as many as fit (at least one).
/// Budgets from 1 MiB to 1 GiB timed alike within this guest's run-to-run
/// noise on the 8k compaction pack (no row in BENCHMARKS.md: nothing to
/// tell apart). Only a query tile of one head whose blocks alone exceed it
/// (more than 256 key tiles in f32: past 16k tokens) makes a larger step.
pub(crate) const DS_BUDGET: usize = 4 << 20;

/// The backward of a validated call on `threads` threads, from the
/// forward's `O`, `LSE` and the output gradient `dO`:
///
/// ```text
/// P = exp(scale · Q Kᵀ − LSE) masked      D = rowsum(dO ∘ O)
/// dS = P ∘ (dO Vᵀ − D)
/// dQ = scale · dS K    dK = scale · dSᵀ Q    dV = Pᵀ dO
/// ```
///
/// With GQA, dK and dV of a kv head sum over its query heads. With
/// `params.rope`, dQ and dK are with respect to the unrotated q and k.
/// With `params.softcap` c, P comes from the softcapped scores and dS is
/// multiplied by `1 − tanh²`; with `params.window`, each row's keys start
/// at its window's first key; with sinks (in the LSE already), `dsinks[h]
/// = −Σ_q exp(σ_h − LSE_hq) · D_hq` when asked for. The call is square
/// (`super::value_dim` pads the others).
/// Rows whose LSE is `−inf` (no visible key) get `dQ = 0` and add nothing.
/// Errors: a NaN or ±inf in the gradients (overflow of `T`, or non-finite
/// inputs left unchecked).
pub(crate) fn backward<T: CpuFloat, S: CpuElement<Compute = T>>(
    call: BackwardCall<'_, '_, '_, Host, S, T>,
    threads: usize,
) -> Result<()> {
    backward_in_chunks(call, threads, DS_BUDGET)
}

/// [`backward`] with query chunks of at most `ds_budget` bytes of dS.
fn backward_in_chunks<T: CpuFloat, S: CpuElement<Compute = T>>(
    call: BackwardCall<'_, '_, '_, Host, S, T>,
    threads: usize,
    ds_budget: usize,
) -> Result<()> {
    let (args, saved, d_o, grads) = call.into_parts();
    let (q, k, v, shape, mask) = (args.q(), args.k(), args.v(), args.shape(), args.mask());
    let params = args.params();
    let (o, lse) = (saved.o, saved.lse);
    let Grads { dq, dk, dv, dsinks } = grads;
    let l = shape.tokens;
    if l == 0 {
        return Ok(());
    }
    let lay = Layout::new(l, shape.head_dim, threads);
    let (lpad, dp) = (lay.lpad, lay.dp);
    let (hq, hkv) = (shape.q_heads, shape.kv_heads);
    let rope = params.rope.map(|r| RopeTable::new(r, mask.position_ids()));

    // Per (head, padded row): the LSE to subtract, with +inf for rows
    // without a visible key and for padding rows so that exp(s − lse) is
    // exactly 0 there.
    let mut lse_eff = workspace::take_stale(hq * lpad, T::INFINITY);
    for (lse_eff, lse) in lse_eff.chunks_mut(lpad).zip(lse.chunks(l)) {
        for (y, &x) in lse_eff.iter_mut().zip(lse) {
            *y = if x > T::NEG_INFINITY { x } else { T::INFINITY };
        }
        lse_eff[l..].fill(T::INFINITY);
    }

    // Rows that enter no visible pair are read as zeros, whatever they hold
    // (DESIGN §5): K, V of keys no query sees, Q, dO of queries that see no
    // key — otherwise a NaN there reaches dK, dQ through 0 · NaN.
    let starts = super::key_starts(&args)?;
    let (unseen, blind) = (mask.unseen_keys(), mask.blind_queries_in(starts.as_deref()));
    let mut bounds = KeyTileBounds::new(mask.kv_end());
    if let Some(starts) = starts {
        bounds = bounds.with_window(starts);
    }
    let sinks: Option<Vec<T>> = args.sinks().map(|s| s.iter().map(|x| x.widen()).collect());
    let mut dsinks_acc = vec![T::ZERO; hq];
    let group = shape.group();
    let block_bytes = TILE * TILE * std::mem::size_of::<T>();
    let (slice, chunks) = plan_steps(&bounds, l, group, block_bytes, ds_budget);
    let steps: Vec<(Range<usize>, &QueryChunk)> = (0..group)
        .step_by(slice)
        .flat_map(|a| {
            let heads = a..(a + slice).min(group);
            chunks.chunks.iter().map(move |c| (heads.clone(), c))
        })
        .collect();
    let bad = [(); 3].map(|_| AtomicBool::new(false));
    let flag = |i: usize, finite: bool| {
        if !finite {
            bad[i].store(true, Ordering::Relaxed);
        }
    };
    let mut dq_rows = head_tile_rows(&mut *dq, hq, shape.head_dim);
    let mut dk_rows = head_tile_rows(&mut *dk, hkv, shape.head_dim);
    let mut dv_rows = head_tile_rows(&mut *dv, hkv, shape.head_dim);
    let per_group = dq_rows
        .chunks_mut(group)
        .zip(dk_rows.iter_mut().zip(dv_rows.iter_mut()));
    // dK, dV of the kv head being done, `[lpad, dp]` each, summed over the
    // chunks; the dS of a chunk.
    let mut acc = workspace::take_stale(2 * lpad * dp, T::ZERO);
    let mut ds = workspace::take_stale(2 * chunks.max_blocks * slice * TILE * TILE, T::ZERO);
    let scratch = || BwdScratch::new(lay.dp);
    // One kv head and its query heads at a time: their copies (5 arrays of
    // `lpad · dp` per head) stay in cache while both kinds of item read them,
    // where copies of all heads at once would be read back from memory.
    for (g, (dq_group, (dk_head, dv_head))) in per_group.enumerate() {
        let heads = g * group..(g + 1) * group;
        // D = rowsum(dO ∘ O) per (head, padded row), computed while dO is
        // copied. Q and dO rows, K rows and columns, V columns: both kinds
        // of item compute S and dP with query rows, key columns.
        let mut delta = workspace::take_stale(group * lpad, T::ZERO);
        let [qh, k2, vt, doh] = lay.copy_inputs([
            Input::rows(q, hq, rope.as_ref())
                .heads(heads.clone())
                .ignoring(&blind),
            Input::rows_and_columns(k, hkv, rope.as_ref())
                .heads(g..g + 1)
                .ignoring(&unseen),
            Input::columns(v, hkv, None)
                .heads(g..g + 1)
                .ignoring(&unseen),
            Input::rows(d_o, hq, None)
                .heads(heads.clone())
                .ignoring(&blind)
                .with_row_dots(o, &mut delta),
        ]);
        if let Some(sinks) = &sinks {
            // ∂/∂σ_h = −Σ_q exp(σ_h − LSE_hq) · D_hq, in row order (D is 0
            // on rows that see no key: their dO copy is zero).
            for (j, h) in heads.clone().enumerate() {
                let rows = lse[h * l..(h + 1) * l]
                    .iter()
                    .zip(&delta[j * lpad..j * lpad + l]);
                dsinks_acc[h] =
                    rows.fold(T::ZERO, |acc, (&lse, &d)| acc - (sinks[h] - lse).exp() * d);
            }
        }
        let (kh, kt) = k2.split_at(k2.len() / 2);
        // bf16 on AVX-512 BF16: S and dP on bf16 pairs of head-dim lanes,
        // the other three products on P, dS rounded to bf16 and token pairs
        // (the `pairs` module).
        let pair_copies = pairs::uses_pairs::<S>().then(|| {
            [
                pairs::pair_rows(&qh),
                pairs::pair_rows(&doh),
                pairs::pair_columns(kt, dp),
                pairs::pair_columns(&vt, dp),
                pairs::token_pair_copy(&qh, dp),
                pairs::token_pair_copy(&doh, dp),
                pairs::token_pair_copy(kh, dp),
            ]
        });
        let ctx = BwdCtx {
            lay,
            h0: heads.start,
            scale: T::from_f64(params.softmax_scale),
            softcap: params
                .softcap
                .map(|c| Softcap::new(params.softmax_scale, c)),
            bounds: &bounds,
            rope: rope.as_ref(),
            delta: &delta,
            lse: &lse_eff[heads.start * lpad..heads.end * lpad],
            qh: &qh,
            kh,
            kt,
            vt: &vt,
            doh: &doh,
            pairs: pair_copies
                .as_ref()
                .map(|[qh, doh, kt, vt, q2, do2, k2]| BwdPairs {
                    qh,
                    doh,
                    kt,
                    vt,
                    q2,
                    do2,
                    k2,
                }),
        };
        let (acc_k, acc_v) = acc.split_at_mut(lpad * dp);
        acc_k.fill(T::ZERO);
        acc_v.fill(T::ZERO);
        let half = ds.len() / 2;
        let (store_a, store_b) = ds.split_at_mut(half);
        // Step `c` runs the dK, dV items of step `c` (a chunk of query
        // tiles for a slice of the query heads), which leave their dS in
        // one half of the store, beside the dQ items of step `c − 1`, which
        // read the other half; the last step stores dK and dV. One parallel
        // step per step, the longest items of both kinds first.
        let n = steps.len();
        for c in 0..=n {
            let (write, read): (&mut [T], &[T]) = if c % 2 == 0 {
                (&mut *store_a, &*store_b)
            } else {
                (&mut *store_b, &*store_a)
            };
            let mut work = Vec::new();
            if let Some((heads, chunk)) = steps.get(c) {
                // dK, dV of every key tile the chunk's query tiles see, over
                // the slice's heads; each item leaves its blocks' dS in its
                // part of the store.
                let (heads, chunk) = (heads.clone(), *chunk);
                let hs = heads.len();
                let mut store = &mut write[..chunk.blocks() * hs * TILE * TILE];
                for (kt, (dk, dv)) in acc_k
                    .chunks_mut(TILE * dp)
                    .zip(acc_v.chunks_mut(TILE * dp))
                    .enumerate()
                {
                    let blocks = chunk.query_tiles(kt).len();
                    if blocks == 0 {
                        continue;
                    }
                    let (ds, rest) =
                        std::mem::take(&mut store).split_at_mut(blocks * hs * TILE * TILE);
                    store = rest;
                    let cost = 4 * blocks * hs;
                    let item = KeyItem {
                        kt,
                        heads: heads.clone(),
                        dk,
                        dv,
                        ds,
                    };
                    work.push((cost, BwdItem::Key(chunk, item)));
                }
            } else {
                // The last step: dK, dV are complete.
                for (kt, ((dk_rows, dv_rows), (dk, dv))) in dk_head
                    .chunks_mut(TILE)
                    .zip(dv_head.chunks_mut(TILE))
                    .zip(acc_k.chunks_mut(TILE * dp).zip(acc_v.chunks_mut(TILE * dp)))
                    .enumerate()
                {
                    let item = StoreItem {
                        kt,
                        dk_rows,
                        dv_rows,
                        dk,
                        dv,
                    };
                    work.push((0, BwdItem::Store(item)));
                }
            }
            if let Some((slice, chunk)) = c.checked_sub(1).map(|p| &steps[p]) {
                // dQ of the previous step's query tiles and heads, from its
                // stored dS.
                let rows = chunk.rows(l);
                let at = |local: usize| heads.start + local;
                for (dq_head, h) in dq_group[slice.clone()]
                    .iter_mut()
                    .zip(slice.clone().map(at))
                {
                    for (dq, qt) in dq_head[rows.clone()]
                        .chunks_mut(TILE)
                        .zip(chunk.tiles.clone())
                    {
                        let cost = chunk.key_tiles(qt) as usize;
                        let item = QueryItem {
                            h,
                            slice: slice.clone(),
                            qt,
                            dq,
                        };
                        work.push((cost, BwdItem::Query(chunk, item)));
                    }
                }
            }
            // Longest first; ties in a fixed order (the results do not
            // depend on it, only the balance does).
            work.sort_by_key(|(cost, _)| std::cmp::Reverse(*cost));
            let work = work.into_iter().map(|(_, w)| w).collect();
            run_parallel(work, threads, scratch, |s, item| match item {
                BwdItem::Key(chunk, item) => key_tile(&ctx, chunk, s, item),
                BwdItem::Query(chunk, item) => {
                    prefetch_for_write(item.dq);
                    flag(0, query_tile(&ctx, chunk, read, s, item))
                }
                BwdItem::Store(item) => {
                    let [dk_ok, dv_ok] = store_key_tile(&ctx, item);
                    flag(1, dk_ok);
                    flag(2, dv_ok);
                }
            });
        }
    }

    if let Some(out) = dsinks {
        if !S::narrow_slice(&dsinks_acc, out) {
            let index = out
                .iter()
                .position(|x| !x.to_f64().is_finite())
                .unwrap_or(0);
            return Err(crate::Error::NonFinite {
                what: "dsinks".into(),
                index,
            });
        }
    }
    // The first non-finite index of the first bad gradient, as scans of dq,
    // dk, dv in that order report it.
    let [dq_bad, dk_bad, dv_bad] = bad.map(AtomicBool::into_inner);
    if dq_bad {
        check_result("dq", dq)?;
    }
    if dk_bad {
        check_result("dk", dk)?;
    }
    if dv_bad {
        check_result("dv", dv)?;
    }
    Ok(())
}

/// The query tiles of the backward in chunks whose blocks' dS fit
/// [`DS_BUDGET`], each with its visited (query tile, key tile) blocks in
/// key-tile-major order (the order the key items store them).
struct QueryChunks {
    chunks: Vec<QueryChunk>,
    /// Most blocks of any chunk.
    max_blocks: usize,
}

struct QueryChunk {
    /// Query tiles `tiles.start .. tiles.end`.
    tiles: Range<usize>,
    /// Key tile `kt`'s visited query tiles of the chunk, ascending:
    /// `query_tiles[starts[kt] .. starts[kt + 1]]`.
    starts: Vec<usize>,
    query_tiles: Vec<u32>,
    /// Per query tile of the chunk, the key tiles it visits.
    key_tiles: Vec<u32>,
}

/// The steps of the backward of a kv head with `group` query heads, from
/// the mask alone: query heads per step (the slice: all of them if one
/// query tile's blocks for all fit `budget` bytes of dS, else as many as
/// fit, at least one) and the chunks of query tiles each slice runs (at
/// most `budget` bytes for the slice, at least one query tile).
fn plan_steps(
    bounds: &KeyTileBounds,
    l: usize,
    group: usize,
    block_bytes: usize,
    budget: usize,
) -> (usize, QueryChunks) {
    let per_query = blocks_per_query_tile(bounds, l);
    let widest = per_query.iter().copied().max().unwrap_or(1).max(1);
    let slice = (budget / (widest * block_bytes)).clamp(1, group);
    let most = (budget / (slice * block_bytes)).max(1);
    (slice, QueryChunks::new(bounds, l, &per_query, most))
}

/// Whether query tile `qt` visits key tile `kt` (a pack of `l` tokens).
fn visited(bounds: &KeyTileBounds, l: usize, qt: usize, kt: usize) -> bool {
    let (q0, q1) = (qt * TILE, ((qt + 1) * TILE).min(l));
    bounds.classify(q0, q1, kt) != TileClass::Skip
}

/// Per query tile of a pack of `l` tokens, how many key tiles it visits.
fn blocks_per_query_tile(bounds: &KeyTileBounds, l: usize) -> Vec<usize> {
    (0..l.div_ceil(TILE))
        .map(|qt| (0..=qt).filter(|&kt| visited(bounds, l, qt, kt)).count())
        .collect()
}

impl QueryChunks {
    /// Chunks of at most `most` blocks (at least one query tile each), from
    /// the mask alone; `per_query` is [`blocks_per_query_tile`].
    fn new(bounds: &KeyTileBounds, l: usize, per_query: &[usize], most: usize) -> Self {
        let tiles = per_query.len();
        let visited = |qt: usize, kt: usize| visited(bounds, l, qt, kt);
        let mut chunks = Vec::new();
        let mut start = 0;
        while start < tiles {
            let (mut end, mut blocks) = (start, 0);
            while end < tiles && (end == start || blocks + per_query[end] <= most) {
                blocks += per_query[end];
                end += 1;
            }
            let mut starts = vec![0; tiles + 1];
            let mut query_tiles = Vec::with_capacity(blocks);
            for kt in 0..tiles {
                let from = kt.max(start);
                let to = bounds.query_tile_end(kt).min(end);
                query_tiles.extend((from..to).filter(|&qt| visited(qt, kt)).map(|qt| qt as u32));
                starts[kt + 1] = query_tiles.len();
            }
            debug_assert_eq!(query_tiles.len(), blocks);
            chunks.push(QueryChunk {
                tiles: start..end,
                starts,
                query_tiles,
                key_tiles: per_query[start..end].iter().map(|&n| n as u32).collect(),
            });
            start = end;
        }
        let max_blocks = chunks.iter().map(QueryChunk::blocks).max().unwrap_or(0);
        QueryChunks { chunks, max_blocks }
    }
}

impl QueryChunk {
    /// Visited blocks.
    fn blocks(&self) -> usize {
        self.query_tiles.len()
    }

    /// The chunk's query tiles that visit key tile `kt`, ascending.
    fn query_tiles(&self, kt: usize) -> &[u32] {
        &self.query_tiles[self.starts[kt]..self.starts[kt + 1]]
    }

    /// How many key tiles query tile `qt` of the chunk visits.
    fn key_tiles(&self, qt: usize) -> u32 {
        self.key_tiles[qt - self.tiles.start]
    }

    /// The chunk's token rows.
    fn rows(&self, l: usize) -> Range<usize> {
        self.tiles.start * TILE..(self.tiles.end * TILE).min(l)
    }

    /// Offset in the store (of a step over `heads` query heads) of the dS
    /// of query tile `qt`, the step's `i`-th head, key tile `kt`; `None` if
    /// the block is not visited.
    fn ds_offset(&self, heads: usize, i: usize, qt: usize, kt: usize) -> Option<usize> {
        let tiles = self.query_tiles(kt);
        let rank = tiles.binary_search(&(qt as u32)).ok()?;
        Some((self.starts[kt] * heads + i * tiles.len() + rank) * TILE * TILE)
    }
}

/// What the items of one kv head and its query heads `h0 .. h0 + group`
/// read: the copies hold those heads only (local head `h − h0`).
struct BwdCtx<'a, T> {
    lay: Layout,
    h0: usize,
    scale: T,
    /// The logit softcap, if any.
    softcap: Option<Softcap<T>>,
    bounds: &'a KeyTileBounds,
    /// Rotates dQ back to the unrotated inputs.
    rope: Option<&'a RopeTable>,
    /// `[group, lpad]`.
    delta: &'a [T],
    /// `[group, lpad]`, +inf where no key is visible.
    lse: &'a [T],
    /// `[heads, lpad, dp]` (`*h`) and `[heads, lpad / TILE, dp, TILE]` (`*t`)
    /// copies of the group's query heads (q, dO) or of its kv head (k, v);
    /// q, k rotated.
    qh: &'a [T],
    kh: &'a [T],
    kt: &'a [T],
    vt: &'a [T],
    doh: &'a [T],
    /// Their bf16 pair copies when S and dP are computed on pairs.
    pairs: Option<BwdPairs<'a>>,
}

/// bf16 pair copies of [`BwdCtx`]'s operands: pair rows of `qh`, `doh`
/// (`[heads, lpad, dp / 2]`), pair columns of `kt`, `vt` (`[lpad / TILE,
/// dp / 2, TILE]`) for S and dP; token pairs ([`pairs::token_pairs`]) of
/// `qh`, `doh` (`q2`, `do2`: `[heads, lpad / 2, dp]`) and `kh` (`k2`:
/// `[lpad / 2, dp]`) for `dK += dSᵀ Q`, `dV += Pᵀ dO`, `dQ += dS K`.
#[derive(Clone, Copy)]
struct BwdPairs<'a> {
    qh: &'a [u32],
    doh: &'a [u32],
    kt: &'a [u32],
    vt: &'a [u32],
    q2: &'a [u32],
    do2: &'a [u32],
    k2: &'a [u32],
}

/// One item of the backward of a kv head and its query heads.
enum BwdItem<'c, 'a, 'b, T, S> {
    Key(&'c QueryChunk, KeyItem<'a, T>),
    Query(&'c QueryChunk, QueryItem<'a, 'b, S>),
    Store(StoreItem<'a, 'b, T, S>),
}

/// The finished dK, dV accumulators of key tile `kt` and its rows (up to
/// `TILE`, `head_dim` values each) of the caller's token-major dK, dV.
struct StoreItem<'a, 'b, T, S> {
    kt: usize,
    dk_rows: &'a mut [&'b mut [S]],
    dv_rows: &'a mut [&'b mut [S]],
    dk: &'a mut [T],
    dv: &'a mut [T],
}

struct KeyItem<'a, T> {
    kt: usize,
    /// The step's local query heads (within the kv head's group).
    heads: Range<usize>,
    /// The tile's `[TILE, dp]` dK, dV accumulators.
    dk: &'a mut [T],
    dv: &'a mut [T],
    /// The store of its blocks' dS: `[heads, blocks, TILE, TILE]`.
    ds: &'a mut [T],
}

struct QueryItem<'a, 'b, S> {
    h: usize,
    /// The step's local query heads (`h − h0` among them).
    slice: Range<usize>,
    qt: usize,
    /// The tile's rows (up to `TILE`, `head_dim` values each) of the
    /// caller's token-major dQ.
    dq: &'a mut [&'b mut [S]],
}

/// Per thread: a key item's `[TILE, TILE]` scores, then P; a dQ item's
/// `[TILE, dp]` accumulator; with bf16 pairs, a block of P or dS in bf16
/// pairs (`[TILE * TILE / 2]`).
struct BwdScratch<T> {
    tiles: Staggered<T, 2>,
    block_pairs: Vec<u32>,
}

impl<T: CpuFloat> BwdScratch<T> {
    fn new(dp: usize) -> Self {
        BwdScratch {
            tiles: Staggered::new([TILE * TILE, TILE * dp], T::ZERO),
            block_pairs: vec![0; TILE * TILE / 2],
        }
    }
}

/// Stores key tile `item.kt`'s dK (times the softmax scale, rotated back)
/// and dV; per dK, dV: `false` if it stored a non-finite value.
fn store_key_tile<T: CpuFloat, S: CpuElement<Compute = T>>(
    ctx: &BwdCtx<'_, T>,
    item: StoreItem<'_, '_, T, S>,
) -> [bool; 2] {
    let Layout { d, dp, .. } = ctx.lay;
    let StoreItem {
        kt,
        dk_rows,
        dv_rows,
        dk,
        dv,
    } = item;
    prefetch_for_write(dk_rows);
    prefetch_for_write(dv_rows);
    for x in dk.iter_mut() {
        *x *= ctx.scale;
    }
    let (mut dk_ok, mut dv_ok) = (true, true);
    for (j, (dk_row, dv_row)) in dk_rows.iter_mut().zip(dv_rows.iter_mut()).enumerate() {
        let t = kt * TILE + j;
        dk_ok &= store_row(&mut dk[j * dp..][..d], dk_row, t, ctx.rope);
        dv_ok &= store_row(&mut dv[j * dp..][..d], dv_row, t, None);
    }
    [dk_ok, dv_ok]
}

simd_dispatch! {
    /// Runs one key work item.
    fn key_tile(ctx: &BwdCtx<'_, T>, chunk: &QueryChunk, s: &mut BwdScratch<T>, item: KeyItem<'_, T>) -> () => key_tile_body
}

/// dK, dV of one key tile of kv head `g`, summed over the group's query heads
/// and the chunk's query tiles that see it: S and dP of each visited (query
/// tile, key tile) block with query rows and key columns, P and dS, then
/// `dV += Pᵀ dO` and `dK += dSᵀ Q` by the transposed product
/// ([`accumulate_t`]); dS stays in the item's store for the dQ items.
#[inline(always)]
fn key_tile_body<T: CpuFloat, const FMA: bool>(
    ctx: &BwdCtx<'_, T>,
    chunk: &QueryChunk,
    sc: &mut BwdScratch<T>,
    item: KeyItem<'_, T>,
) {
    let Layout { l, lpad, dp, .. } = ctx.lay;
    let KeyItem {
        kt,
        heads,
        dk,
        dv,
        ds,
    } = item;
    let k0 = kt * TILE;
    let (k_cols, v_cols) = (&ctx.kt[k0 * dp..], &ctx.vt[k0 * dp..]);
    let [s, _] = sc.tiles.parts();
    // Keys past the pack's end have kv_end 0: masked.
    let masks = |c: usize, full: bool| {
        let k = k0 + c * NS;
        (!full || k + NS > l).then(|| (k as u32, ctx.bounds.strip_ends(k)))
    };
    let mut stores = ds.chunks_exact_mut(TILE * TILE);
    for local in heads {
        let head = local * lpad;
        for &qt in chunk.query_tiles(kt) {
            let qt = qt as usize;
            let dpm = stores.next().expect("one dS block per visited block");
            let (q0, q1) = (qt * TILE, ((qt + 1) * TILE).min(l));
            let blocks = ctx.bounds.query_row_blocks(q0, q1, k0);
            let q_rows = &ctx.qh[(head + q0) * dp..][..TILE * dp];
            let do_rows = &ctx.doh[(head + q0) * dp..][..TILE * dp];
            let (dp2, at) = (dp / 2, (head + q0) * dp / 2);
            let [s_pairs, dp_pairs] = match ctx.pairs {
                Some(p) => [
                    Some((&p.qh[at..][..TILE * dp2], &p.kt[k0 * dp2..])),
                    Some((&p.doh[at..][..TILE * dp2], &p.vt[k0 * dp2..])),
                ],
                None => [None; 2],
            };
            scores_or_pairs::<T, FMA>(q_rows, k_cols, s_pairs, dp, s, blocks.live);
            scores_or_pairs::<T, FMA>(do_rows, v_cols, dp_pairs, dp, dpm, blocks.live);
            let rows = DqRows {
                q0,
                lse: &ctx.lse[head + q0..head + q0 + TILE],
                delta: &ctx.delta[head + q0..head + q0 + TILE],
                scale: ctx.scale,
                softcap: ctx.softcap,
                starts: ctx.bounds.window_starts(q0),
            };
            ds_block::<T, FMA>(rows, s, dpm, blocks, masks);
            // With pairs, P and then dS in bf16 query pairs (one scratch),
            // against dO's and Q's query pairs.
            let at2 = (head + q0) / 2 * dp;
            let bp = &mut sc.block_pairs;
            let dv_pairs = ctx.pairs.map(|p| (&mut bp[..], &p.do2[at2..]));
            accumulate_or_pairs::<T, FMA>(Sum::Queries, s, do_rows, dv_pairs, dp, dv, blocks.live);
            let dk_pairs = ctx.pairs.map(|p| (&mut bp[..], &p.q2[at2..]));
            accumulate_or_pairs::<T, FMA>(Sum::Queries, dpm, q_rows, dk_pairs, dp, dk, blocks.live);
        }
    }
}

simd_dispatch! {
    /// Runs one work item; `false` if it stored a non-finite value into dQ.
    fn query_tile<S>(ctx: &BwdCtx<'_, T>, chunk: &QueryChunk, ds: &[T], s: &mut BwdScratch<T>, item: QueryItem<'_, '_, S>) -> bool => query_tile_body
}

/// dQ of one query tile of head `h`: `scale · Σ dS K` over the key tiles it
/// visits, in key order, from the dS the key items stored.
#[inline(always)]
fn query_tile_body<T: CpuFloat, S: CpuElement<Compute = T>, const FMA: bool>(
    ctx: &BwdCtx<'_, T>,
    chunk: &QueryChunk,
    ds: &[T],
    sc: &mut BwdScratch<T>,
    item: QueryItem<'_, '_, S>,
) -> bool {
    let Layout { l, d, dp, .. } = ctx.lay;
    let QueryItem {
        h,
        slice,
        qt,
        dq: dq_rows,
    } = item;
    let (q0, q1) = (qt * TILE, ((qt + 1) * TILE).min(l));
    let local = h - ctx.h0;
    let [_, dq] = sc.tiles.parts();
    dq.fill(T::ZERO);
    for kt in 0..=qt {
        let Some(at) = chunk.ds_offset(slice.len(), local - slice.start, qt, kt) else {
            continue;
        };
        let k0 = kt * TILE;
        let blocks = ctx.bounds.query_row_blocks(q0, q1, k0);
        let pairs = ctx
            .pairs
            .map(|p| (&mut sc.block_pairs[..], &p.k2[k0 / 2 * dp..]));
        accumulate_or_pairs::<T, FMA>(
            Sum::Keys,
            &ds[at..][..TILE * TILE],
            &ctx.kh[k0 * dp..],
            pairs,
            dp,
            dq,
            blocks.live,
        );
    }
    for x in dq.iter_mut() {
        *x *= ctx.scale;
    }
    let mut finite = true;
    for (i, dst) in dq_rows.iter_mut().enumerate() {
        finite &= store_row(&mut dq[i * dp..][..d], dst, q0 + i, ctx.rope);
    }
    finite
}

/// What the dS step needs of the item's query rows from `q0`: their LSE
/// (+inf: no visible key, or a padding row), `D`, the scale and softcap,
/// and with a sliding window the first key of each row's window.
#[derive(Clone, Copy)]
struct DqRows<'a, T> {
    q0: usize,
    lse: &'a [T],
    delta: &'a [T],
    scale: T,
    softcap: Option<Softcap<T>>,
    starts: Option<&'a [u32]>,
}

/// `dS = P ∘ (dP − D)` of the `blocks.live` register blocks, with
/// `P = exp(scale · s − LSE)` (0 where masked; with a softcap `c`, `P =
/// exp(c · tanh(scale · s / c) − LSE)` and dS times `1 − tanh²`) from the raw scores `s` and
/// `dP` in `dpm`: dS into `dpm`, `P` in place of `s`. `masks(c, full)` gives strip
/// `c`'s first key and `kv_end`s when it must be masked for a row whose
/// block `full` says it holds only visible entries, `None` when it needs no
/// mask.
#[inline(always)]
fn ds_block<'e, T: CpuFloat, const FMA: bool>(
    DqRows {
        q0,
        lse,
        delta,
        scale,
        softcap,
        starts,
    }: DqRows<'_, T>,
    s: &mut [T],
    dpm: &mut [T],
    blocks: BlockMasks,
    masks: impl Fn(usize, bool) -> Option<(u32, &'e [u32; NS])>,
) {
    for (i, (srow, dprow)) in s
        .chunks_exact_mut(TILE)
        .zip(dpm.chunks_exact_mut(TILE))
        .enumerate()
    {
        let strips = row_strips(blocks.live, i);
        if strips == 0 {
            continue;
        }
        let (m, dd) = (lse[i], delta[i]);
        if m == T::INFINITY {
            // No visible key in this row (or a padding row): P = dS = 0.
            live_strips(srow, strips).for_each(|x| *x = [T::ZERO; NS]);
            live_strips(dprow, strips).for_each(|x| *x = [T::ZERO; NS]);
            continue;
        }
        let full = row_strips(blocks.full, i);
        let q = (q0 + i) as u32;
        let lo = starts.map_or(0, |st| st[i]);
        let (mut unused_max, mut unused_visible) = ([T::NEG_INFINITY; NS], [0; NS]);
        let mut tanh = [T::ZERO; NS];
        for c in live_strip_indices(strips) {
            let (x, dx) = (strip(srow, c), strip(dprow, c));
            // Softcapped scores are already scaled.
            let scale = match softcap {
                Some(Softcap { a, c }) => {
                    lanes::softcap::<T, FMA>(x, a, c, &mut tanh);
                    T::ONE
                }
                None => scale,
            };
            match masks(c, full >> c & 1 == 1) {
                // A fully visible block: no mask.
                None => lanes::scale_offset::<T, FMA>(x, scale, m),
                Some((first, ends)) => lanes::mask_max::<T, FMA>(
                    x,
                    first,
                    ends,
                    q,
                    lo,
                    scale,
                    m,
                    &mut unused_max,
                    &mut unused_visible,
                ),
            }
            lanes::exp_ds::<T, FMA>(x, dx, dd);
            if softcap.is_some() {
                // d(c · tanh(u)) / du = 1 − tanh².
                for (dx, &t) in dx.iter_mut().zip(&tanh) {
                    *dx *= T::ONE - t * t;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::Cpu;
    use crate::backend::BackwardCall;
    use crate::backend::{AttentionBackend, AttnArgs, AttnParams, HostAttention, Saved};
    use crate::mask::PackMask;
    use crate::Error;

    /// The gradients of `backward_in_chunks` with `budget` bytes of dS per
    /// chunk on `threads` threads: a tree of two branches after a shared
    /// prompt, partial tiles and padding rows, rotary on.
    fn chunked<T: CpuFloat>(hq: usize, hkv: usize, budget: usize, threads: usize) -> Vec<T> {
        let (l, d) = (347, 40);
        let kv_end: Vec<u32> = (0..l as u32)
            .map(|k| match k {
                0..=119 => l as u32,
                120..=229 => 230,
                _ => l as u32,
            })
            .collect();
        let pos: Vec<u32> = (0..l as u32)
            .map(|k| if k < 230 { k } else { k - 110 })
            .collect();
        let mask = PackMask::new(&kv_end, &pos).unwrap();
        let shape = crate::backend::AttnShape {
            tokens: l,
            q_heads: hq,
            kv_heads: hkv,
            head_dim: d,
            v_head_dim: d,
        };
        let mut params = AttnParams::new(d);
        params.rope = Some(crate::backend::Rope {
            base: 700.0,
            dims: d,
        });
        let data = |n: usize, salt: u64| super::super::hashed_values::<T>(n, salt);
        let (q, k, v, d_o) = (
            data(shape.q_len(), 11),
            data(shape.kv_len(), 12),
            data(shape.kv_len(), 13),
            data(shape.q_len(), 14),
        );
        let args = AttnArgs::new(&q[..], &k[..], &v[..], shape, mask, params).unwrap();
        let fwd = Cpu::with_threads(1).forward_owned(&args).unwrap();
        // Poisoned: every element must be written.
        let mut out = vec![T::from_f64(f64::NAN); 2 * shape.kv_len() + shape.q_len()];
        let (dq, rest) = out.split_at_mut(shape.q_len());
        let (dk, dv) = rest.split_at_mut(shape.kv_len());
        let saved = Saved {
            o: &fwd.o[..],
            lse: &fwd.lse[..],
        };
        let call = BackwardCall::new(
            args,
            saved,
            &d_o[..],
            Grads {
                dq,
                dk,
                dv,
                dsinks: None,
            },
        )
        .unwrap();
        backward_in_chunks(call, threads, budget).unwrap();
        out
    }

    /// With dS kept for one query tile at a time (6 chunks), the gradients
    /// equal those of one chunk, bit for bit, on any thread count: without
    /// GQA each sum keeps its order; with a group of 2, such a budget also
    /// takes one query head per step, and dK, dV still sum head by head,
    /// query tile by query tile. A budget that takes both heads in chunks
    /// of query tiles sums chunk by chunk instead: within rounding.
    #[test]
    fn query_chunks_give_the_gradients_of_one_chunk() {
        let block = TILE * TILE * std::mem::size_of::<f64>();
        let whole = chunked::<f64>(2, 2, usize::MAX, 1);
        let tiny = chunked::<f64>(2, 2, block, 1);
        assert!(whole.iter().all(|x| x.is_finite()));
        assert!(whole == tiny, "no GQA: same bits");
        assert!(chunked::<f64>(2, 2, block, 3) == tiny, "3 threads");
        let bounds = KeyTileBounds::new(&[347; 347]);
        let per_query = blocks_per_query_tile(&bounds, 347);
        assert_eq!(per_query, [1, 2, 3, 4, 5, 6]);
        let chunks = |most| {
            QueryChunks::new(&bounds, 347, &per_query, most)
                .chunks
                .len()
        };
        assert_eq!(chunks(1), 6);
        assert_eq!(chunks(7), 4);
        let whole = chunked::<f64>(4, 2, usize::MAX, 2);
        assert!(
            chunked::<f64>(4, 2, block, 2) == whole,
            "GQA, one head per step"
        );
        assert_eq!(plan_steps(&bounds, 347, 2, block, block).0, 1);
        // 12 blocks: both heads, chunks of up to 6 blocks per head (4 chunks).
        assert_eq!(plan_steps(&bounds, 347, 2, block, 12 * block).0, 2);
        let both = chunked::<f64>(4, 2, 12 * block, 2);
        let worst = whole
            .iter()
            .zip(&both)
            .map(|(a, b)| (a - b).abs() / (1.0 + a.abs()))
            .fold(0.0, f64::max);
        assert!(worst < 1e-13, "GQA: {worst}");
        assert!(worst > 0.0, "negative control: the sums did change order");
        assert!(chunked::<f64>(4, 2, 12 * block, 1) == both, "1 thread");
        // f32, where the chunked order matters more: still the same bits
        // on 1 and 2 threads.
        let f32_block = block / 2;
        for budget in [f32_block, 3 * f32_block, 12 * f32_block] {
            assert!(chunked::<f32>(4, 2, budget, 1) == chunked::<f32>(4, 2, budget, 2));
        }
    }

    /// The store of one step stays within the budget unless one query tile
    /// of one head alone exceeds it: causal packs in f32 with 8 query heads
    /// per kv head, where a step of all 8 heads took 8 × 256 blocks of 16
    /// KiB (32 MiB) at 16k tokens.
    #[test]
    fn steps_keep_ds_within_the_budget() {
        let block = TILE * TILE * 4;
        for (l, group, slice, bytes) in [
            (2048, 8, 8, 4 << 20),   // 32 blocks per tile · 8 heads: 4 MiB
            (4096, 8, 4, 4 << 20),   // 64 · 4
            (16_384, 8, 1, 4 << 20), // 256 · 1
            (16_384, 1, 1, 4 << 20), // no GQA: as before
            (32_768, 8, 1, 8 << 20), // one tile of one head: 512 blocks
        ] {
            let bounds = KeyTileBounds::new(&vec![l as u32; l]);
            let (s, chunks) = plan_steps(&bounds, l, group, block, DS_BUDGET);
            assert_eq!(s, slice, "L {l}, group {group}");
            assert_eq!(s * chunks.max_blocks * block, bytes, "L {l}, group {group}");
            // Every query tile is in exactly one chunk, in order.
            let tiles: Vec<usize> = chunks.chunks.iter().flat_map(|c| c.tiles.clone()).collect();
            assert_eq!(tiles, (0..l / TILE).collect::<Vec<_>>());
        }
    }

    /// Items store their gradient rows directly and only flag a bad value;
    /// the error must still name the first non-finite index of dq (checked
    /// before dk and dv, as scans of dq, dk, dv in that order would), on
    /// any thread count, with rotary on. NaNs in d_o (unchecked) at two
    /// rows in different query tiles spread into dq, dk and dv.
    #[test]
    fn a_non_finite_gradient_names_its_first_index() {
        let (l, hq, hkv, d) = (260, 4, 2, 40);
        let (shape, kv_end, pos) = super::super::all_visible_case(l, hq, hkv, d);
        let mask = PackMask::new(&kv_end, &pos).unwrap();
        let mut params = AttnParams::new(d);
        params.rope = Some(crate::backend::Rope {
            base: 1000.0,
            dims: d,
        });
        let data = |n: usize, salt: u64| super::super::hashed_values::<f64>(n, salt);
        let (q, k, v) = (
            data(shape.q_len(), 1),
            data(shape.kv_len(), 2),
            data(shape.kv_len(), 3),
        );
        let args = AttnArgs::new(&q[..], &k[..], &v[..], shape, mask, params).unwrap();
        let fwd = Cpu::with_threads(2).forward_owned(&args).unwrap();
        let mut d_o = data(shape.q_len(), 4);
        let mut dq = vec![0.0; shape.q_len()];
        let mut dk = vec![0.0; shape.kv_len()];
        let mut dv = vec![0.0; shape.kv_len()];
        let mut run = |d_o: &[f64], threads| {
            let grads = Grads {
                dq: &mut dq[..],
                dk: &mut dk[..],
                dv: &mut dv[..],
                dsinks: None,
            };
            let saved = Saved {
                o: &fwd.o[..],
                lse: &fwd.lse[..],
            };
            let r = Cpu::with_threads(threads).backward(&args.reborrow(), saved, d_o, grads);
            let first_bad = |x: &[f64]| x.iter().position(|v| !v.is_finite());
            (r, [first_bad(&dq), first_bad(&dk), first_bad(&dv)])
        };
        let (r, bad) = run(&d_o, 2);
        assert!(r.is_ok() && bad == [None; 3], "negative control");
        d_o[(230 * hq + 3) * d + 7] = f64::NAN;
        d_o[(131 * hq + 1) * d + 30] = f64::NAN;
        for threads in [1, 3] {
            let (r, bad) = run(&d_o, threads);
            assert!(bad[1].is_some() && bad[2].is_some(), "{bad:?}");
            match (r, bad[0]) {
                (Err(Error::NonFinite { what, index }), Some(first)) => {
                    assert!(what.starts_with("dq "), "{what}");
                    assert_eq!(index, first, "{threads} threads");
                    assert!(first <= (131 * hq + 1) * d, "{first}");
                }
                other => panic!("{other:?}"),
            }
        }
    }
}
