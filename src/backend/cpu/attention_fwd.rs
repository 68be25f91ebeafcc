//! Tiled attention forward with an online softmax.

use super::kernels::{accumulate, has_avx2, scores};
use super::layout::{Layout, RopeTable};
use super::{
    check_qkv, num_threads, run_parallel, AttnOut, CpuFloat, KeyTileBounds, TileClass, TILE,
};
use crate::backend::{AttnParams, AttnShape};
use crate::mask::PackMask;
use crate::Result;

/// Attention forward on a pack: `O = softmax(scale · Q Kᵀ masked) V` and
/// `LSE = ln Σ exp(scale · Q Kᵀ masked)` per query row and head (see the
/// [module docs](super)).
///
/// `q` is `[tokens, q_heads, head_dim]`, `k` and `v` are `[tokens, kv_heads,
/// head_dim]`, row-major. With `params.rope`, Q and K are rotated by the
/// pack's position ids before the dot products. Dot products and softmax sums
/// accumulate in `T`.
///
/// Errors: slice lengths that do not match `shape`, `q_heads` not a multiple
/// of `kv_heads`, a mask of another length or with `kv_end[k] < k` or
/// `> tokens`, unsupported rotary dims, and (with `params.check_finite`) a
/// NaN or ±inf in q, k or v.
pub fn attention_forward<T: CpuFloat>(
    q: &[T],
    k: &[T],
    v: &[T],
    shape: AttnShape,
    mask: PackMask<'_>,
    params: &AttnParams,
) -> Result<AttnOut<T>> {
    check_qkv(q, k, v, &shape, &mask, params)?;
    let l = shape.tokens;
    if l == 0 {
        return Ok(AttnOut {
            o: Vec::new(),
            lse: Vec::new(),
        });
    }
    let lay = Layout::new(l, shape.head_dim, num_threads());
    let rope = params.rope.map(|r| RopeTable::new(r, mask.position_ids));
    let qh = lay.head_major(q, shape.q_heads, rope.as_ref());
    let kh = lay.head_major(k, shape.kv_heads, rope.as_ref());
    let kt = lay.transposed(&kh, shape.kv_heads);
    drop(kh);
    let vh = lay.head_major(v, shape.kv_heads, None);
    let bounds = KeyTileBounds::new(mask.kv_end);
    let ctx = FwdCtx {
        lay,
        group: shape.group(),
        scale: T::from_f64(params.softmax_scale),
        kv_end: mask.kv_end,
        bounds: &bounds,
        qh: &qh,
        kt: &kt,
        vh: &vh,
    };

    let (lpad, dp) = (lay.lpad, lay.dp);
    let mut oh = vec![T::ZERO; shape.q_heads * lpad * dp];
    let mut lse = vec![T::NEG_INFINITY; shape.q_heads * l];
    let tiles = l.div_ceil(TILE);
    // Busiest query tiles first, so the queue ends with short items.
    let cost: Vec<usize> = (0..tiles)
        .map(|qt| {
            let (q0, q1) = (qt * TILE, ((qt + 1) * TILE).min(l));
            (0..=qt)
                .filter(|&kt| bounds.classify(q0, q1, kt) != TileClass::Skip)
                .count()
        })
        .collect();
    let mut work = Vec::with_capacity(shape.q_heads * tiles);
    for (h, (o_head, lse_head)) in oh.chunks_mut(lpad * dp).zip(lse.chunks_mut(l)).enumerate() {
        for (qt, (o, lse)) in o_head
            .chunks_mut(TILE * dp)
            .zip(lse_head.chunks_mut(TILE))
            .enumerate()
        {
            work.push(FwdItem { h, qt, o, lse });
        }
    }
    work.sort_by_key(|w| std::cmp::Reverse(cost[w.qt]));
    run_parallel(work, lay.threads, FwdScratch::new, |s, item| {
        query_tile(&ctx, s, item)
    });

    let o = lay.token_major(&oh, shape.q_heads, None);
    Ok(AttnOut { o, lse })
}

struct FwdCtx<'a, T> {
    lay: Layout,
    group: usize,
    scale: T,
    kv_end: &'a [u32],
    bounds: &'a KeyTileBounds,
    /// `[q_heads, lpad, dp]`, rotated.
    qh: &'a [T],
    /// `[kv_heads, dp, lpad]`, rotated.
    kt: &'a [T],
    /// `[kv_heads, lpad, dp]`.
    vh: &'a [T],
}

/// One (query head, query tile): its output rows and LSE entries.
struct FwdItem<'a, T> {
    h: usize,
    qt: usize,
    /// `[TILE, dp]` of the head-major output.
    o: &'a mut [T],
    /// Up to `TILE` entries of the `[q_heads, tokens]` LSE.
    lse: &'a mut [T],
}

struct FwdScratch<T> {
    /// Scores, then probabilities, of one block: `[TILE, TILE]`.
    s: Vec<T>,
    /// Running row max and row sum of the online softmax.
    m: Vec<T>,
    sum: Vec<T>,
}

impl<T: CpuFloat> FwdScratch<T> {
    fn new() -> Self {
        FwdScratch {
            s: vec![T::ZERO; TILE * TILE],
            m: vec![T::ZERO; TILE],
            sum: vec![T::ZERO; TILE],
        }
    }
}

fn query_tile<T: CpuFloat>(ctx: &FwdCtx<'_, T>, s: &mut FwdScratch<T>, item: FwdItem<'_, T>) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the running CPU supports AVX2 (checked at run time).
        unsafe { query_tile_avx2(ctx, s, item) };
        return;
    }
    query_tile_body(ctx, s, item)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn query_tile_avx2<T: CpuFloat>(
    ctx: &FwdCtx<'_, T>,
    s: &mut FwdScratch<T>,
    item: FwdItem<'_, T>,
) {
    query_tile_body(ctx, s, item)
}

#[inline(always)]
fn query_tile_body<T: CpuFloat>(ctx: &FwdCtx<'_, T>, sc: &mut FwdScratch<T>, item: FwdItem<'_, T>) {
    let Layout { l, lpad, dp, .. } = ctx.lay;
    let FwdItem { h, qt, o, lse } = item;
    let (q0, q1) = (qt * TILE, ((qt + 1) * TILE).min(l));
    let bq = q1 - q0;
    let g = h / ctx.group;
    let q_rows = &ctx.qh[(h * lpad + q0) * dp..][..TILE * dp];
    let kt_head = &ctx.kt[g * dp * lpad..][..dp * lpad];
    let v_head = &ctx.vh[g * lpad * dp..][..lpad * dp];
    let (s, m, sum) = (&mut sc.s, &mut sc.m, &mut sc.sum);
    m.fill(T::NEG_INFINITY);
    sum.fill(T::ZERO);

    for kt in 0..=qt {
        let class = ctx.bounds.classify(q0, q1, kt);
        if class == TileClass::Skip {
            continue;
        }
        let k0 = kt * TILE;
        let bk = (k0 + TILE).min(l) - k0;
        let kv_end = &ctx.kv_end[k0..k0 + bk];
        scores(q_rows, &kt_head[k0..], lpad, dp, s);
        for (i, row) in s.chunks_exact_mut(TILE).enumerate() {
            let (live, pad) = row.split_at_mut(bk);
            pad.fill(T::ZERO);
            if i >= bq {
                live.fill(T::ZERO);
                continue;
            }
            let q = q0 + i;
            let mut row_max = T::NEG_INFINITY;
            if class == TileClass::Full {
                for x in live.iter_mut() {
                    *x = *x * ctx.scale;
                    row_max = row_max.max_of(*x);
                }
            } else {
                for (j, (x, &end)) in live.iter_mut().zip(kv_end).enumerate() {
                    *x = if k0 + j <= q && q < end as usize {
                        *x * ctx.scale
                    } else {
                        T::NEG_INFINITY
                    };
                    row_max = row_max.max_of(*x);
                }
            }
            if row_max == T::NEG_INFINITY {
                live.fill(T::ZERO);
                continue;
            }
            let m_new = m[i].max_of(row_max);
            if m_new != m[i] {
                // exp(−inf) = 0 drops nothing on a row's first visible block.
                let alpha = (m[i] - m_new).exp();
                sum[i] *= alpha;
                for y in &mut o[i * dp..(i + 1) * dp] {
                    *y *= alpha;
                }
                m[i] = m_new;
            }
            let mut row_sum = T::ZERO;
            for x in live.iter_mut() {
                *x = (*x - m_new).exp();
                row_sum += *x;
            }
            sum[i] += row_sum;
        }
        accumulate(s, &v_head[k0 * dp..], dp, o);
    }

    for i in 0..bq {
        let row = &mut o[i * dp..(i + 1) * dp];
        if sum[i] > T::ZERO {
            let inv = T::ONE / sum[i];
            for y in row {
                *y *= inv;
            }
            lse[i] = m[i] + sum[i].ln();
        } else {
            row.fill(T::ZERO);
            lse[i] = T::NEG_INFINITY;
        }
    }
}
