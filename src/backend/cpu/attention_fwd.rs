//! Tiled attention forward with an online softmax.

use super::gather::{last_strip_ends, KeyGather};
use super::lanes;
use super::microkernel::{live_strip_indices, live_strips, row_strips, simd_dispatch, strip, NS};
use super::operands::{head_tile_rows, prefetch_for_write, store_row, Input, Layout, RopeTable};
use super::pairs::{self, accumulate_or_pairs, scores_or_pairs, Sum};
use super::workspace::Staggered;
use super::{
    check_result, run_parallel, BlockMasks, CpuElement, CpuFloat, KeyTileBounds, TileClass, TILE,
};
use crate::backend::{ForwardCall, Host};
use crate::{Error, Result};
use std::sync::atomic::{AtomicBool, Ordering};

/// The forward of a validated call on `threads` threads: `O = softmax(scale
/// · Q Kᵀ masked) V` and `LSE = ln Σ exp(scale · Q Kᵀ masked)` per query
/// row and head (see the [module docs](super)). With `params.rope`, Q and K
/// are rotated by the pack's position ids before the dot products; with
/// `params.softcap` c the scaled scores become `c · tanh(s / c)`; with
/// `params.window` each row's keys start at its window's first key; with
/// sinks, each row's sum gains `exp(σ_h)` (O and LSE take it in). Dot
/// products and softmax sums accumulate in `T`. The call's shape is square
/// (`v_head_dim == head_dim`: `super::value_dim` pads the others). Errors:
/// a NaN or ±inf in the result (scores that overflow `T`, or non-finite
/// inputs when they were not checked).
pub(crate) fn forward<T: CpuFloat, S: CpuElement<Compute = T>>(
    call: ForwardCall<'_, '_, Host, S, T>,
    threads: usize,
) -> Result<()> {
    let (args, o, lse) = call.into_parts();
    let (q, k, v, shape, mask) = (args.q(), args.k(), args.v(), args.shape(), args.mask());
    let params = args.params();
    let l = shape.tokens;
    if l == 0 {
        return Ok(());
    }
    let lay = Layout::new(l, shape.head_dim, threads);
    let rope = params.rope.map(|r| RopeTable::new(r, mask.position_ids()));
    // Q is copied per query tile by the one item that reads it. V rows of
    // keys no query sees are read as zeros (DESIGN §5): their P is 0, but
    // 0 · NaN in `P V` would still poison the rows of their register block.
    let unseen = mask.unseen_keys();
    let [kt, vh] = lay.copy_inputs([
        Input::columns(k, shape.kv_heads, rope.as_ref()),
        Input::rows(v, shape.kv_heads, None).ignoring(&unseen),
    ]);
    let mut bounds = KeyTileBounds::new(mask.kv_end());
    if let Some(starts) = super::key_starts(&args)? {
        bounds = bounds.with_window(starts);
    }
    let sinks: Option<Vec<T>> = args.sinks().map(|s| s.iter().map(|x| x.widen()).collect());
    // bf16 on AVX-512 BF16: S = Q Kᵀ on bf16 pairs (the `pairs` module).
    let kt_pairs = pairs::uses_pairs::<S>().then(|| pairs::pair_columns(&kt, lay.dp));
    // ... and O += P V on P rounded to bf16 and V's key pairs.
    let vh_pairs = kt_pairs
        .is_some()
        .then(|| pairs::token_pair_copy(&vh, lay.dp));
    let ctx = FwdCtx {
        lay,
        group: shape.group(),
        scale: T::from_f64(params.softmax_scale),
        bounds: &bounds,
        q,
        q_heads: shape.q_heads,
        rope: rope.as_ref(),
        kt: &kt,
        kt_pairs: kt_pairs.as_deref(),
        vh: &vh,
        vh_pairs: vh_pairs.as_deref(),
        softcap: params
            .softcap
            .map(|c| Softcap::new(params.softmax_scale, c)),
        sinks: sinks.as_deref(),
    };

    let tiles = l.div_ceil(TILE);
    let mut work = Vec::with_capacity(shape.q_heads * tiles);
    // Every row of `o` and every LSE entry is written by its query tile.
    let mut o_rows = head_tile_rows(o, shape.q_heads, shape.head_dim);
    for (h, (o_head, lse_head)) in o_rows.iter_mut().zip(lse.chunks_mut(l)).enumerate() {
        for (qt, (o, lse)) in o_head
            .chunks_mut(TILE)
            .zip(lse_head.chunks_mut(TILE))
            .enumerate()
        {
            work.push(FwdItem { h, qt, o, lse });
        }
    }
    // Per kv head, later query tiles first (they see more keys), the query
    // heads of a tile one after the other: consecutive items of a branch
    // then have the same gathering plan and reuse its chunk, and the queue
    // ends with the short first tiles of the last kv head.
    let group = shape.group();
    work.sort_by_key(|w| (w.h / group, std::cmp::Reverse(w.qt), w.h));
    let o_bad = AtomicBool::new(false);
    run_parallel(
        work,
        lay.threads,
        || FwdScratch::new(lay.dp),
        |s, item| {
            prefetch_for_write(item.o);
            if !query_tile(&ctx, s, item) {
                o_bad.store(true, Ordering::Relaxed);
            }
        },
    );

    if o_bad.into_inner() {
        // The first non-finite index, as a scan of `o` reports it.
        check_result("o", o)?;
    }
    // −inf is a legitimate LSE (no visible key); NaN and +inf are not.
    let bad_lse = lse
        .iter()
        .position(|x| x.partial_cmp(&T::INFINITY) != Some(std::cmp::Ordering::Less));
    if let Some(index) = bad_lse {
        return Err(Error::NonFinite {
            what: format!("lse (scores overflowed {})", T::NAME),
            index,
        });
    }
    Ok(())
}

struct FwdCtx<'a, T, S> {
    lay: Layout,
    group: usize,
    scale: T,
    bounds: &'a KeyTileBounds,
    /// `[tokens, q_heads, head_dim]`, as given, and the rotary table for it.
    q: &'a [S],
    q_heads: usize,
    rope: Option<&'a RopeTable>,
    /// `[kv_heads, lpad / TILE, dp, TILE]`, rotated.
    kt: &'a [T],
    /// Its bf16 pair columns `[kv_heads, lpad / TILE, dp / 2, TILE]`, when
    /// the scores are computed on pairs.
    kt_pairs: Option<&'a [u32]>,
    /// `[kv_heads, lpad, dp]`.
    vh: &'a [T],
    /// Its key pairs `[kv_heads, lpad / 2, dp]` ([`pairs::token_pairs`]),
    /// with `kt_pairs`.
    vh_pairs: Option<&'a [u32]>,
    /// The logit softcap, if any.
    softcap: Option<Softcap<T>>,
    /// One sink logit per query head, if any.
    sinks: Option<&'a [T]>,
}

/// The logit softcap `c` of a call with softmax scale `scale`: raw scores
/// `x` become `c · tanh(a · x)` with `a = scale / c`, already scaled.
#[derive(Clone, Copy)]
pub(super) struct Softcap<T> {
    pub a: T,
    pub c: T,
}

impl<T: CpuFloat> Softcap<T> {
    pub(super) fn new(scale: f64, c: f64) -> Self {
        Softcap {
            a: T::from_f64(scale / c),
            c: T::from_f64(c),
        }
    }
}

/// One (query head, query tile): its output rows and LSE entries.
struct FwdItem<'a, 'b, T, S> {
    h: usize,
    qt: usize,
    /// The tile's rows (up to `TILE`, `head_dim` values each) of the
    /// caller's token-major `o`.
    o: &'a mut [&'b mut [S]],
    /// Up to `TILE` entries of the `[q_heads, tokens]` LSE.
    lse: &'a mut [T],
}

struct FwdScratch<T> {
    /// Scores, then probabilities, of one block: `[TILE, TILE]`; the
    /// output rows being accumulated: `[TILE, dp]`; the item's query rows,
    /// rotated and padded: `[TILE, dp]`; a chunk of gathered keys, their
    /// Kᵀ columns `[dp, TILE]` and V rows `[TILE, dp]`.
    tiles: Staggered<T, 5>,
    /// With bf16 pairs, the query rows' and the gathered keys' pair copies
    /// (`[TILE, dp / 2]`, `[dp / 2, TILE]`), the gathered V rows' key pairs
    /// (`[TILE / 2, dp]`) and a block's probabilities in bf16
    /// (`[TILE, TILE / 2]`).
    q_pairs: Vec<u32>,
    kg_pairs: Vec<u32>,
    vg_pairs: Vec<u32>,
    p_pairs: Vec<u32>,
    gather: KeyGather,
    /// Running row max and row sum of the online softmax.
    m: Vec<T>,
    sum: Vec<T>,
}

impl<T: CpuFloat> FwdScratch<T> {
    fn new(dp: usize) -> Self {
        FwdScratch {
            tiles: Staggered::new(
                [TILE * TILE, TILE * dp, TILE * dp, TILE * dp, TILE * dp],
                T::ZERO,
            ),
            q_pairs: vec![0; TILE * dp / 2],
            kg_pairs: vec![0; TILE * dp / 2],
            vg_pairs: vec![0; TILE * dp / 2],
            p_pairs: vec![0; TILE * TILE / 2],
            gather: KeyGather::default(),
            m: vec![T::ZERO; TILE],
            sum: vec![T::ZERO; TILE],
        }
    }
}

simd_dispatch! {
    /// Runs one work item; `false` if it stored a non-finite value into `o`.
    fn query_tile<S>(ctx: &FwdCtx<'_, T, S>, s: &mut FwdScratch<T>, item: FwdItem<'_, '_, T, S>) -> bool => query_tile_body
}

#[inline(always)]
fn query_tile_body<T: CpuFloat, S: CpuElement<Compute = T>, const FMA: bool>(
    ctx: &FwdCtx<'_, T, S>,
    sc: &mut FwdScratch<T>,
    item: FwdItem<'_, '_, T, S>,
) -> bool {
    let Layout { l, lpad, d, dp, .. } = ctx.lay;
    let FwdItem {
        h,
        qt,
        o: o_rows,
        lse,
    } = item;
    let (q0, q1) = (qt * TILE, ((qt + 1) * TILE).min(l));
    let bq = q1 - q0;
    let g = h / ctx.group;
    let kt_head = &ctx.kt[g * dp * lpad..][..dp * lpad];
    let v_head = &ctx.vh[g * lpad * dp..][..lpad * dp];
    let [s, o, q_rows, kg, vg] = sc.tiles.parts();
    ctx.lay
        .copy_tile(ctx.q, ctx.q_heads, h, q0, ctx.rope, q_rows);
    let q_rows = &*q_rows;
    let dp2 = dp / 2;
    let kt_pairs = ctx.kt_pairs.map(|p| &p[g * dp2 * lpad..][..dp2 * lpad]);
    let vh_pairs = ctx.vh_pairs.map(|p| &p[g * dp2 * lpad..][..dp2 * lpad]);
    if kt_pairs.is_some() {
        pairs::to_pair_rows(T::as_f32(q_rows).expect("f32 copies"), &mut sc.q_pairs);
    }
    let (q_pairs, kg_pairs) = (&sc.q_pairs[..], &mut sc.kg_pairs);
    let (vg_pairs, p_pairs) = (&mut sc.vg_pairs, &mut sc.p_pairs);
    let (m, sum) = (&mut sc.m, &mut sc.sum);
    m.fill(T::NEG_INFINITY);
    sum.fill(T::ZERO);
    o.fill(T::ZERO);

    // The past column-split tiles, as whole chunks of gathered keys (still
    // in the buffers when the previous item of this thread had the same).
    sc.gather.plan(ctx.bounds, q0, q1, qt);
    let held = sc.gather.holds_chunk(g);
    for c in 0..sc.gather.chunks() {
        let n = if held {
            sc.gather.chunk_keys(c)
        } else {
            sc.gather.gather_rows(c, v_head, dp, vg);
            match kt_pairs {
                Some(kp) => {
                    // V's key pairs of the gathered rows (zero past the
                    // chunk's keys, up to its last strip).
                    let rows = sc.gather.chunk_keys(c).div_ceil(NS) * NS * dp;
                    let vg = T::as_f32(&vg[..rows]).expect("f32 copies");
                    pairs::token_pairs(vg, dp, vg_pairs);
                    sc.gather.gather_columns(c, kp, dp2, kg_pairs)
                }
                None => sc.gather.gather_columns(c, kt_head, dp, kg),
            }
        };
        let blocks = KeyGather::chunk_blocks(bq, n);
        let ends = last_strip_ends(n);
        let pairs = kt_pairs.map(|_| (q_pairs, &kg_pairs[..]));
        scores_or_pairs::<T, FMA>(q_rows, kg, pairs, dp, s, blocks.live);
        // Every row sees every key of the chunk: only lanes past its last
        // key are masked (first key taken as 0: the rows are past TILE).
        let masks = |_: usize, full: bool| (!full).then_some((0, &ends));
        // Gathered keys are in every row's window (uniform_keys): none to mask.
        let rows = Rows {
            q0,
            bq,
            dp,
            starts: None,
        };
        softmax_block::<T, FMA>(ctx.scale, ctx.softcap, rows, s, blocks, masks, m, sum, o);
        let pairs = vh_pairs.map(|_| (&mut p_pairs[..], &vg_pairs[..]));
        accumulate_or_pairs::<T, FMA>(Sum::Keys, s, vg, pairs, dp, o, blocks.live);
    }
    sc.gather.keep(g);

    for kt in 0..=qt {
        let class = ctx.bounds.classify(q0, q1, kt);
        if class == TileClass::Skip || sc.gather.is_gathered(kt) {
            continue;
        }
        let k0 = kt * TILE;
        let blocks = ctx.bounds.query_row_blocks(q0, q1, k0);
        let pairs = kt_pairs.map(|kp| (q_pairs, &kp[k0 * dp2..]));
        scores_or_pairs::<T, FMA>(q_rows, &kt_head[k0 * dp..], pairs, dp, s, blocks.live);
        // Keys past the pack's end have kv_end 0: masked.
        let masks = |c: usize, full: bool| {
            let k = k0 + c * NS;
            (!full || k + NS > l).then(|| (k as u32, ctx.bounds.strip_ends(k)))
        };
        let rows = Rows {
            q0,
            bq,
            dp,
            starts: ctx.bounds.window_starts(q0),
        };
        softmax_block::<T, FMA>(ctx.scale, ctx.softcap, rows, s, blocks, masks, m, sum, o);
        let pairs = vh_pairs.map(|vp| (&mut p_pairs[..], &vp[k0 / 2 * dp..]));
        accumulate_or_pairs::<T, FMA>(Sum::Keys, s, &v_head[k0 * dp..], pairs, dp, o, blocks.live);
    }

    let sink = ctx.sinks.map(|s| s[h]);
    let mut finite = true;
    for (i, dst) in o_rows.iter_mut().enumerate() {
        let row = &mut o[i * dp..][..d];
        if sum[i] > T::ZERO {
            let (inv, row_lse) = match sink {
                None => (T::ONE / sum[i], m[i] + sum[i].ln()),
                Some(sg) => {
                    // The sink joins the sum: relative to the larger of
                    // the two references, so that neither term overflows.
                    let top = m[i].max_of(sg);
                    let alpha = (m[i] - top).exp();
                    let total = sum[i] * alpha + (sg - top).exp();
                    (alpha / total, top + total.ln())
                }
            };
            for y in row.iter_mut() {
                *y *= inv;
            }
            lse[i] = row_lse;
        } else if sum[i] == T::ZERO {
            // No visible key: the sink alone (or nothing) in the sum.
            row.fill(T::ZERO);
            lse[i] = sink.unwrap_or(T::NEG_INFINITY);
        } else {
            // Poisoned by non-finite scores (a NaN sum, or marked above):
            // +inf makes the caller's scan report it.
            lse[i] = T::INFINITY;
        }
        finite &= store_row(row, dst, q0 + i, None);
    }
    finite
}

/// The item's query rows `q0..q0 + bq` (`dp` values per accumulator row),
/// and with a sliding window the first key of each one's window.
#[derive(Clone, Copy)]
struct Rows<'s> {
    q0: usize,
    bq: usize,
    dp: usize,
    starts: Option<&'s [u32]>,
}

/// How far a row's scores may exceed its running reference `m` before the
/// online softmax moves `m` up and rescales the row's sum and accumulator:
/// probabilities are kept as `exp(s − m) <= e^8 ≈ 3000` against a reference
/// that may trail the true running maximum. The result is the same (`O =
/// Σ p v / Σ p` and `LSE = m + ln Σ p` for any reference); only the
/// rescales, an `exp` and a pass over the `dp` accumulators of the row each,
/// become rare once a row has seen a few blocks (FlashAttention-4's
/// conditional rescaling). On a tree, where rows see fewer blocks than on
/// a long causal sequence, more of their blocks come early, when the
/// maximum still moves, so rescaling on every increase costs a tree more
/// per entry than causal (BENCHMARKS.md §7).
const RESCALE_MARGIN: f64 = 8.0;

/// One step of the online softmax over a block of `TILE` keys: the raw
/// scores `s` of the `blocks.live` register blocks become probabilities
/// `exp(scale · s − m)` in place (0 where masked; `scale · s` softcapped
/// first with `cap`; a row's keys before its window start masked too), with the running row
/// references `m` (moved up, and the sums `sum` and accumulator rows `o`
/// rescaled, only when a score exceeds them by more than
/// [`RESCALE_MARGIN`]). `masks(c, full)` gives strip `c`'s first key and `kv_end`s when
/// it must be masked for a row whose block `full` says it holds only
/// visible entries, `None` when it needs no mask.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn softmax_block<'e, T: CpuFloat, const FMA: bool>(
    scale: T,
    cap: Option<Softcap<T>>,
    Rows { q0, bq, dp, starts }: Rows<'_>,
    s: &mut [T],
    blocks: BlockMasks,
    masks: impl Fn(usize, bool) -> Option<(u32, &'e [u32; NS])>,
    m: &mut [T],
    sum: &mut [T],
    o: &mut [T],
) {
    for (i, row) in s.chunks_exact_mut(TILE).enumerate() {
        let strips = row_strips(blocks.live, i);
        if strips == 0 {
            continue;
        }
        if i >= bq {
            // A padding row in a live block: P = 0.
            live_strips(row, strips).for_each(|x| *x = [T::ZERO; NS]);
            continue;
        }
        // Whole strips of NS lanes, maxima and sums kept per lane and
        // reduced once per row: no scalar remainders on short runs.
        let full = row_strips(blocks.full, i);
        let q = (q0 + i) as u32;
        let lo = starts.map_or(0, |st| st[i]);
        let mut visible = [0u32; NS];
        let mut lane_max = [T::NEG_INFINITY; NS];
        let mut tanh = [T::ZERO; NS];
        for c in live_strip_indices(strips) {
            let x = strip(row, c);
            // Softcapped scores are already scaled.
            let scale = match cap {
                Some(Softcap { a, c }) => {
                    lanes::softcap::<T, FMA>(x, a, c, &mut tanh);
                    T::ONE
                }
                None => scale,
            };
            match masks(c, full >> c & 1 == 1) {
                None => {
                    // A fully visible block: no mask.
                    visible[0] = 1;
                    lanes::scale_max::<T, FMA>(x, scale, &mut lane_max);
                }
                Some((first, ends)) => lanes::mask_max::<T, FMA>(
                    x,
                    first,
                    ends,
                    q,
                    lo,
                    scale,
                    T::ZERO,
                    &mut lane_max,
                    &mut visible,
                ),
            }
        }
        let row_max = lanes::reduce_max::<T, FMA>(lane_max);
        if row_max == T::NEG_INFINITY {
            if visible != [0; NS] {
                // Visible scores that are all NaN or −inf: an overflow, not
                // an empty row. Poison the row (reported by the item).
                sum[i] = T::NEG_INFINITY;
            }
            live_strips(row, strips).for_each(|x| *x = [T::ZERO; NS]);
            continue;
        }
        if m[i] == T::NEG_INFINITY {
            // The row's first visible block: its O row and sum are 0 (or
            // the sum is the −inf poison mark), nothing to rescale.
            m[i] = row_max;
        } else if matches!(
            row_max.partial_cmp(&(m[i] + T::from_f64(RESCALE_MARGIN))),
            Some(std::cmp::Ordering::Greater) | None
        ) {
            // (NaN scores also take this branch and poison the row.)
            let m_new = m[i].max_of(row_max);
            let alpha = (m[i] - m_new).exp();
            sum[i] *= alpha;
            for y in &mut o[i * dp..(i + 1) * dp] {
                *y *= alpha;
            }
            m[i] = m_new;
        }
        let mut lane_sum = [T::ZERO; NS];
        for c in live_strip_indices(strips) {
            lanes::exp_sum::<T, FMA>(strip(row, c), m[i], &mut lane_sum);
        }
        sum[i] += lanes::reduce_sum::<T, FMA>(lane_sum);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::Cpu;
    use crate::backend::{AttentionBackend, AttnArgs, AttnParams};
    use crate::mask::PackMask;

    /// Items store their rows of `o` directly and only flag a bad value;
    /// the error must still name the first non-finite index of the whole
    /// token-major `o` (as a scan of it would), whatever item met one first
    /// and on any thread count. NaNs in v (unchecked) at two tokens in
    /// different query tiles and kv heads spread into many rows of `o`.
    #[test]
    fn a_non_finite_output_names_its_first_index() {
        let (l, hq, hkv, d) = (300, 4, 2, 24);
        let (shape, kv_end, pos) = super::super::all_visible_case(l, hq, hkv, d);
        let mask = PackMask::new(&kv_end, &pos).unwrap();
        let params = AttnParams::new(d);
        let data = |n: usize, salt: u64| super::super::hashed_values::<f32>(n, salt);
        let (q, k) = (data(shape.q_len(), 1), data(shape.kv_len(), 2));
        let mut v = data(shape.kv_len(), 3);
        let mut o = vec![0.0; shape.q_len()];
        let mut lse = vec![0.0; hq * l];
        let mut run = |v: &[f32], o: &mut [f32], threads| {
            let args = AttnArgs::new(&q[..], &k[..], v, shape, mask, params).unwrap();
            Cpu::with_threads(threads).forward(&args, o, &mut lse[..])
        };
        assert!(run(&v, &mut o, 2).is_ok(), "negative control");
        assert!(o.iter().all(|x| x.is_finite()));
        v[(200 * hkv) * d + 2] = f32::NAN;
        v[(150 * hkv + 1) * d + 5] = f32::NAN;
        for threads in [1, 3] {
            o.fill(0.0);
            let r = run(&v, &mut o, threads);
            let first = o.iter().position(|x| !x.is_finite()).unwrap();
            // The NaN of token 150 reaches rows before token 200.
            assert!(first < 200 * hq * d, "{first}");
            match r {
                Err(Error::NonFinite { what, index }) => {
                    assert!(what.starts_with("o "), "{what}");
                    assert_eq!(index, first, "{threads} threads");
                }
                other => panic!("{other:?}"),
            }
        }
    }
}
