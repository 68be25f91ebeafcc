//! Tiled attention backward: two deterministic kinds of work item (dK, dV
//! per key tile; dQ per query tile), each recomputing `P` from the saved
//! LSE. One kv head (with its query heads) at a time: its inputs are copied,
//! then all its items run in one parallel step while the copies are still in
//! cache: copies of every head at once (5 arrays of `lpad · dp` per head: 12 MB
//! at 2.3k tokens, 4 heads, d = 64) would be read back from memory by the
//! passes (BENCHMARKS.md §2 has the measurement).

use super::gather::{last_strip_ends, KeyGather};
use super::lanes;
use super::microkernel::{
    accumulate, accumulate_t, live_strip_indices, live_strips, row_strips, scores, simd_dispatch,
    strip, NS,
};
use super::operands::{head_tile_rows, prefetch_for_write, store_row, Input, Layout, RopeTable};
use super::workspace;
use super::workspace::Staggered;
use super::{check_result, run_parallel, BlockMasks, CpuFloat, KeyTileBounds, TileClass, TILE};
use crate::backend::{BackwardCall, Grads, Host};
use crate::Result;
use std::sync::atomic::{AtomicBool, Ordering};

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
/// Rows whose LSE is `−inf` (no visible key) get `dQ = 0` and add nothing.
/// Errors: a NaN or ±inf in the gradients (overflow of `T`, or non-finite
/// inputs left unchecked).
pub(crate) fn backward<T: CpuFloat>(
    call: BackwardCall<'_, '_, '_, Host, T, T>,
    threads: usize,
) -> Result<()> {
    let (args, saved, d_o, grads) = call.into_parts();
    let (q, k, v, shape, mask) = (args.q(), args.k(), args.v(), args.shape(), args.mask());
    let params = args.params();
    let (o, lse) = (saved.o, saved.lse);
    let Grads { dq, dk, dv } = grads;
    let l = shape.tokens;
    if l == 0 {
        return Ok(());
    }
    let lay = Layout::new(l, shape.head_dim, threads);
    let lpad = lay.lpad;
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
    let (unseen, blind) = (mask.unseen_keys(), mask.blind_queries());
    let bounds = KeyTileBounds::new(mask.kv_end());
    let group = shape.group();
    let scratch = || BwdScratch::new(lay.dp);
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
        let (kh, kt) = k2.split_at(k2.len() / 2);
        let ctx = BwdCtx {
            lay,
            h0: heads.start,
            group,
            scale: T::from_f64(params.softmax_scale),
            bounds: &bounds,
            rope: rope.as_ref(),
            delta: &delta,
            lse: &lse_eff[heads.start * lpad..heads.end * lpad],
            qh: &qh,
            kh,
            kt,
            vt: &vt,
            doh: &doh,
        };

        // dK, dV per key tile, stored into the caller's dk, dv; earlier key
        // tiles see more query tiles, so they go first. Then dQ per (query
        // head, query tile), stored into the caller's dq, longest first.
        let mut keys: Vec<_> = dk_head
            .chunks_mut(TILE)
            .zip(dv_head.chunks_mut(TILE))
            .enumerate()
            .map(|(kt, (dk, dv))| KeyItem { kt, dk, dv })
            .collect();
        keys.sort_by_key(|w| (std::cmp::Reverse(bounds.query_tile_end(w.kt) - w.kt), w.kt));
        let mut queries: Vec<_> = dq_group
            .iter_mut()
            .zip(heads.clone())
            .flat_map(|(dq_head, h)| {
                dq_head
                    .chunks_mut(TILE)
                    .enumerate()
                    .map(move |(qt, dq)| QueryItem { h, qt, dq })
            })
            .collect();
        queries.sort_by_key(|w| std::cmp::Reverse(w.qt));
        let work = keys
            .into_iter()
            .map(BwdItem::Key)
            .chain(queries.into_iter().map(BwdItem::Query))
            .collect();
        run_parallel(work, lay.threads, scratch, |s, item| match item {
            BwdItem::Key(item) => {
                prefetch_for_write(item.dk);
                prefetch_for_write(item.dv);
                let [dk_ok, dv_ok] = key_tile(&ctx, s, item);
                flag(1, dk_ok);
                flag(2, dv_ok);
            }
            BwdItem::Query(item) => {
                prefetch_for_write(item.dq);
                flag(0, query_tile(&ctx, s, item))
            }
        });
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

/// What the items of one kv head and its query heads `h0 .. h0 + group`
/// read: the copies hold those heads only (local head `h − h0`).
struct BwdCtx<'a, T> {
    lay: Layout,
    h0: usize,
    group: usize,
    scale: T,
    bounds: &'a KeyTileBounds,
    /// Rotates dQ, dK back to the unrotated inputs.
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
}

/// One item of the backward of a kv head and its query heads.
enum BwdItem<'a, 'b, T> {
    Key(KeyItem<'a, 'b, T>),
    Query(QueryItem<'a, 'b, T>),
}

struct KeyItem<'a, 'b, T> {
    kt: usize,
    /// The tile's rows (up to `TILE`, `head_dim` values each) of the
    /// caller's token-major dK, dV.
    dk: &'a mut [&'b mut [T]],
    dv: &'a mut [&'b mut [T]],
}

struct QueryItem<'a, 'b, T> {
    h: usize,
    qt: usize,
    /// The tile's rows (up to `TILE`, `head_dim` values each) of the
    /// caller's token-major dQ.
    dq: &'a mut [&'b mut [T]],
}

/// Per thread, `[TILE, TILE]` scores then P (dK, dV items) or dS (dQ
/// items); `[TILE, TILE]` dP, then dS (dK, dV items); the `[TILE, dp]`
/// gradient rows being accumulated: dK and dV, or dQ; and a chunk of
/// gathered keys for dQ items.
struct BwdScratch<T> {
    /// Two `[TILE, TILE]` blocks and five `[TILE, dp]` ones: a dK, dV item's
    /// scores, dP, dK accumulator and (the last) dV accumulator; a dQ item's
    /// scores, dP, dQ accumulator and a chunk of gathered keys (its Kᵀ and
    /// Vᵀ columns and K rows), which a dK, dV item never overwrites, so the
    /// next dQ item of the thread can reuse it ([`KeyGather::holds_chunk`]).
    tiles: Staggered<T, 7>,
    gather: KeyGather,
}

impl<T: CpuFloat> BwdScratch<T> {
    fn new(dp: usize) -> Self {
        let (tile, rows) = (TILE * TILE, TILE * dp);
        BwdScratch {
            tiles: Staggered::new([tile, tile, rows, rows, rows, rows, rows], T::ZERO),
            gather: KeyGather::default(),
        }
    }
}

simd_dispatch! {
    /// Runs one work item; per dK, dV: `false` if it stored a non-finite value.
    fn key_tile(ctx: &BwdCtx<'_, T>, s: &mut BwdScratch<T>, item: KeyItem<'_, '_, T>) -> [bool; 2] => key_tile_body
}

/// dK, dV of one key tile of kv head `g`, summed over the group's query heads
/// and over the query tiles `kt .. query_tile_end(kt)` (all that can see it):
/// S and dP of each visited (query tile, key tile) block with query rows and
/// key columns, as the dQ items compute them, then `dV += Pᵀ dO` and
/// `dK += dSᵀ Q` by the transposed product ([`accumulate_t`]).
#[inline(always)]
fn key_tile_body<T: CpuFloat, const FMA: bool>(
    ctx: &BwdCtx<'_, T>,
    sc: &mut BwdScratch<T>,
    item: KeyItem<'_, '_, T>,
) -> [bool; 2] {
    let Layout { l, lpad, d, dp, .. } = ctx.lay;
    let KeyItem {
        kt,
        dk: dk_rows,
        dv: dv_rows,
    } = item;
    let k0 = kt * TILE;
    let (k_cols, v_cols) = (&ctx.kt[k0 * dp..], &ctx.vt[k0 * dp..]);
    let [s, dpm, dk, _, _, _, dv] = sc.tiles.parts();
    dk.fill(T::ZERO);
    dv.fill(T::ZERO);
    // Keys past the pack's end have kv_end 0: masked.
    let masks = |c: usize, full: bool| {
        let k = k0 + c * NS;
        (!full || k + NS > l).then(|| (k as u32, ctx.bounds.strip_ends(k)))
    };
    for local in 0..ctx.group {
        let head = local * lpad;
        for qt in kt..ctx.bounds.query_tile_end(kt) {
            let (q0, q1) = (qt * TILE, ((qt + 1) * TILE).min(l));
            if ctx.bounds.classify(q0, q1, kt) == TileClass::Skip {
                continue;
            }
            let blocks = ctx.bounds.query_row_blocks(q0, q1, k0);
            let q_rows = &ctx.qh[(head + q0) * dp..][..TILE * dp];
            let do_rows = &ctx.doh[(head + q0) * dp..][..TILE * dp];
            scores::<T, FMA>(q_rows, k_cols, TILE, dp, s, blocks.live);
            scores::<T, FMA>(do_rows, v_cols, TILE, dp, dpm, blocks.live);
            let rows = DqRows {
                q0,
                lse: &ctx.lse[head + q0..head + q0 + TILE],
                delta: &ctx.delta[head + q0..head + q0 + TILE],
                scale: ctx.scale,
            };
            ds_block::<T, FMA, true>(rows, s, dpm, blocks, masks);
            accumulate_t::<T, FMA>(s, do_rows, dp, dv, blocks.live);
            accumulate_t::<T, FMA>(dpm, q_rows, dp, dk, blocks.live);
        }
    }
    for x in dk.iter_mut() {
        *x *= ctx.scale;
    }
    let (mut dk_ok, mut dv_ok) = (true, true);
    for (j, (dk_row, dv_row)) in dk_rows.iter_mut().zip(dv_rows.iter_mut()).enumerate() {
        dk_ok &= store_row(&mut dk[j * dp..][..d], dk_row, k0 + j, ctx.rope);
        dv_ok &= store_row(&mut dv[j * dp..][..d], dv_row, k0 + j, None);
    }
    [dk_ok, dv_ok]
}

simd_dispatch! {
    /// Runs one work item; `false` if it stored a non-finite value into dQ.
    fn query_tile(ctx: &BwdCtx<'_, T>, s: &mut BwdScratch<T>, item: QueryItem<'_, '_, T>) -> bool => query_tile_body
}

/// dQ of one query tile of head `h`, over the key tiles it can see.
#[inline(always)]
fn query_tile_body<T: CpuFloat, const FMA: bool>(
    ctx: &BwdCtx<'_, T>,
    sc: &mut BwdScratch<T>,
    item: QueryItem<'_, '_, T>,
) -> bool {
    let Layout { l, lpad, d, dp, .. } = ctx.lay;
    let QueryItem { h, qt, dq: dq_rows } = item;
    let (q0, q1) = (qt * TILE, ((qt + 1) * TILE).min(l));
    let head = (h - ctx.h0) * lpad;
    let q_rows = &ctx.qh[(head + q0) * dp..][..TILE * dp];
    let do_rows = &ctx.doh[(head + q0) * dp..][..TILE * dp];
    let (kt_head, vt_head, kh_head) = (ctx.kt, ctx.vt, ctx.kh);
    let lse = &ctx.lse[head + q0..head + q0 + TILE];
    let delta = &ctx.delta[head + q0..head + q0 + TILE];
    let [s, dpm, dq, kg, vg, krows, _] = sc.tiles.parts();
    dq.fill(T::ZERO);
    let rows = DqRows {
        q0,
        lse,
        delta,
        scale: ctx.scale,
    };
    // The past column-split tiles, as whole chunks of gathered keys (still
    // in the buffers when the previous dQ item of this thread had the same).
    let gather = &mut sc.gather;
    gather.plan(ctx.bounds, q0, q1, qt);
    let source = ctx.h0 / ctx.group;
    let held = gather.holds_chunk(source);
    for c in 0..gather.chunks() {
        let n = if held {
            gather.chunk_keys(c)
        } else {
            gather.gather_columns(c, vt_head, dp, vg);
            gather.gather_rows(c, kh_head, dp, krows);
            gather.gather_columns(c, kt_head, dp, kg)
        };
        let blocks = KeyGather::chunk_blocks(q1 - q0, n);
        let ends = last_strip_ends(n);
        scores::<T, FMA>(q_rows, kg, TILE, dp, s, blocks.live);
        scores::<T, FMA>(do_rows, vg, TILE, dp, dpm, blocks.live);
        // Every row sees every key of the chunk: only lanes past its last
        // key are masked (first key taken as 0: the rows are past TILE).
        let masks = |_: usize, full: bool| (!full).then_some((0, &ends));
        ds_block::<T, FMA, false>(rows, s, dpm, blocks, masks);
        accumulate::<T, FMA>(s, krows, dp, dq, blocks.live);
    }
    gather.keep(source);

    for kt in 0..=qt {
        let class = ctx.bounds.classify(q0, q1, kt);
        if class == TileClass::Skip || gather.is_gathered(kt) {
            continue;
        }
        let k0 = kt * TILE;
        let blocks = ctx.bounds.query_row_blocks(q0, q1, k0);
        scores::<T, FMA>(q_rows, &kt_head[k0 * dp..], TILE, dp, s, blocks.live);
        scores::<T, FMA>(do_rows, &vt_head[k0 * dp..], TILE, dp, dpm, blocks.live);
        // Masked entries, and keys past the pack's end (kv_end 0), get
        // exp(−inf) = 0.
        let masks = |c: usize, full: bool| {
            let k = k0 + c * NS;
            (!full || k + NS > l).then(|| (k as u32, ctx.bounds.strip_ends(k)))
        };
        ds_block::<T, FMA, false>(rows, s, dpm, blocks, masks);
        accumulate::<T, FMA>(s, &kh_head[k0 * dp..], dp, dq, blocks.live);
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
/// (+inf: no visible key, or a padding row) and `D`.
#[derive(Clone, Copy)]
struct DqRows<'a, T> {
    q0: usize,
    lse: &'a [T],
    delta: &'a [T],
    scale: T,
}

/// `dS = P ∘ (dP − D)` of the `blocks.live` register blocks, with
/// `P = exp(scale · s − LSE)` (0 where masked) from the raw scores `s` and
/// `dP` in `dpm`: in place of `s` (dQ items), or into `dpm` with `P` in
/// place of `s` when `KEEP_P` (dK, dV items). `masks(c, full)` gives strip
/// `c`'s first key and `kv_end`s when it must be masked for a row whose
/// block `full` says it holds only visible entries, `None` when it needs no
/// mask.
#[inline(always)]
fn ds_block<'e, T: CpuFloat, const FMA: bool, const KEEP_P: bool>(
    DqRows {
        q0,
        lse,
        delta,
        scale,
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
            if KEEP_P {
                live_strips(dprow, strips).for_each(|x| *x = [T::ZERO; NS]);
            }
            continue;
        }
        let full = row_strips(blocks.full, i);
        let q = (q0 + i) as u32;
        let (mut unused_max, mut unused_visible) = ([T::NEG_INFINITY; NS], [0; NS]);
        for c in live_strip_indices(strips) {
            let (x, dx) = (strip(srow, c), strip(dprow, c));
            match masks(c, full >> c & 1 == 1) {
                // A fully visible block: no mask.
                None => lanes::scale_offset::<T, FMA>(x, scale, m),
                Some((first, ends)) => lanes::mask_max::<T, FMA>(
                    x,
                    first,
                    ends,
                    q,
                    scale,
                    m,
                    &mut unused_max,
                    &mut unused_visible,
                ),
            }
            if KEEP_P {
                lanes::exp_ds::<T, FMA>(x, dx, dd);
            } else {
                lanes::exp_times::<T, FMA>(x, &*dx, dd);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::Cpu;
    use crate::backend::{AttentionBackend, AttnArgs, AttnParams, HostAttention, Saved};
    use crate::mask::PackMask;
    use crate::Error;

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
