//! Tiled attention backward: two deterministic passes (dK, dV per key tile;
//! dQ per query tile), each recomputing `P` from the saved LSE.

use super::kernels::{accumulate, has_avx2, scores};
use super::layout::{Layout, RopeTable};
use super::{
    check_finite, check_len, check_qkv, num_threads, run_parallel, AttnGrads, CpuFloat,
    KeyTileBounds, TileClass, TILE,
};
use crate::backend::{AttnParams, AttnShape};
use crate::mask::PackMask;
use crate::{Error, Result};

/// Attention backward on a pack, from the forward's `o` and `lse` and the
/// output gradient `d_o` (`[tokens, q_heads, head_dim]`):
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
/// `params` and `mask` must be those of the forward call.
///
/// Errors: everything [`super::attention_forward`] rejects, plus `o`, `d_o`,
/// `lse` of the wrong length, a NaN or `+inf` in `lse`, and (with
/// `params.check_finite`) a NaN or ±inf in `o` or `d_o`.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward<T: CpuFloat>(
    q: &[T],
    k: &[T],
    v: &[T],
    o: &[T],
    lse: &[T],
    d_o: &[T],
    shape: AttnShape,
    mask: PackMask<'_>,
    params: &AttnParams,
) -> Result<AttnGrads<T>> {
    check_qkv(q, k, v, &shape, &mask, params)?;
    let q_how = "tokens · q_heads · head_dim, like q";
    check_len("o", o.len(), shape.q_len(), q_how)?;
    check_len("d_o", d_o.len(), shape.q_len(), q_how)?;
    check_len(
        "lse",
        lse.len(),
        shape.q_heads * shape.tokens,
        "q_heads · tokens",
    )?;
    if let Some(index) = lse.iter().position(|&x| !(x < T::INFINITY)) {
        return Err(Error::NonFinite {
            what: "lse (NaN or +inf; −inf marks a row with no visible key)".into(),
            index,
        });
    }
    if params.check_finite {
        check_finite("o", o)?;
        check_finite("d_o", d_o)?;
    }
    let l = shape.tokens;
    if l == 0 {
        return Ok(AttnGrads {
            dq: Vec::new(),
            dk: Vec::new(),
            dv: Vec::new(),
        });
    }
    let lay = Layout::new(l, shape.head_dim, num_threads());
    let (lpad, dp, d) = (lay.lpad, lay.dp, lay.d);
    let (hq, hkv) = (shape.q_heads, shape.kv_heads);
    let rope = params.rope.map(|r| RopeTable::new(r, mask.position_ids));
    let qh = lay.head_major(q, hq, rope.as_ref());
    let kh = lay.head_major(k, hkv, rope.as_ref());
    let vh = lay.head_major(v, hkv, None);
    let doh = lay.head_major(d_o, hq, None);
    let qt = lay.transposed(&qh, hq);
    let kt = lay.transposed(&kh, hkv);
    let vt = lay.transposed(&vh, hkv);
    let dot = lay.transposed(&doh, hq);

    // Per (head, padded row): D = rowsum(dO ∘ O), and the LSE to subtract,
    // with +inf for rows without a visible key and for padding rows so that
    // exp(s − lse) is exactly 0 there.
    let mut delta = vec![T::ZERO; hq * lpad];
    let mut lse_eff = vec![T::INFINITY; hq * lpad];
    for h in 0..hq {
        for t in 0..l {
            let at = (t * hq + h) * d;
            let mut acc = T::ZERO;
            for (&a, &b) in o[at..at + d].iter().zip(&d_o[at..at + d]) {
                acc += a * b;
            }
            delta[h * lpad + t] = acc;
            let x = lse[h * l + t];
            if x > T::NEG_INFINITY {
                lse_eff[h * lpad + t] = x;
            }
        }
    }

    let bounds = KeyTileBounds::new(mask.kv_end);
    let ctx = BwdCtx {
        lay,
        group: shape.group(),
        scale: T::from_f64(params.softmax_scale),
        kv_end: mask.kv_end,
        bounds: &bounds,
        delta: &delta,
        lse: &lse_eff,
        qh: &qh,
        qt: &qt,
        kh: &kh,
        kt: &kt,
        vh: &vh,
        vt: &vt,
        doh: &doh,
        dot: &dot,
    };
    let tiles = l.div_ceil(TILE);

    // Pass 1: dK, dV per (kv head, key tile); earlier key tiles see more
    // query tiles, so they go first.
    let mut dkh = vec![T::ZERO; hkv * lpad * dp];
    let mut dvh = vec![T::ZERO; hkv * lpad * dp];
    let mut work = Vec::with_capacity(hkv * tiles);
    for (g, (dk_head, dv_head)) in dkh
        .chunks_mut(lpad * dp)
        .zip(dvh.chunks_mut(lpad * dp))
        .enumerate()
    {
        for (kt, (dk, dv)) in dk_head
            .chunks_mut(TILE * dp)
            .zip(dv_head.chunks_mut(TILE * dp))
            .enumerate()
        {
            work.push(KeyItem { g, kt, dk, dv });
        }
    }
    work.sort_by_key(|w| std::cmp::Reverse(bounds.query_tile_end(w.kt) - w.kt));
    run_parallel(work, lay.threads, BwdScratch::new, |s, item| {
        key_tile(&ctx, s, item)
    });

    // Pass 2: dQ per (query head, query tile).
    let mut dqh = vec![T::ZERO; hq * lpad * dp];
    let mut work: Vec<_> = dqh
        .chunks_mut(lpad * dp)
        .enumerate()
        .flat_map(|(h, dq_head)| {
            dq_head
                .chunks_mut(TILE * dp)
                .enumerate()
                .map(move |(qt, dq)| QueryItem { h, qt, dq })
        })
        .collect();
    work.sort_by_key(|w| std::cmp::Reverse(w.qt));
    run_parallel(work, lay.threads, BwdScratch::new, |s, item| {
        query_tile(&ctx, s, item)
    });

    Ok(AttnGrads {
        dq: lay.token_major(&dqh, hq, rope.as_ref()),
        dk: lay.token_major(&dkh, hkv, rope.as_ref()),
        dv: lay.token_major(&dvh, hkv, None),
    })
}

struct BwdCtx<'a, T> {
    lay: Layout,
    group: usize,
    scale: T,
    kv_end: &'a [u32],
    bounds: &'a KeyTileBounds,
    /// `[q_heads, lpad]`.
    delta: &'a [T],
    /// `[q_heads, lpad]`, +inf where no key is visible.
    lse: &'a [T],
    /// `[heads, lpad, dp]` (`*h`) and `[heads, dp, lpad]` (`*t`) copies; q, k rotated.
    qh: &'a [T],
    qt: &'a [T],
    kh: &'a [T],
    kt: &'a [T],
    vh: &'a [T],
    vt: &'a [T],
    doh: &'a [T],
    dot: &'a [T],
}

struct KeyItem<'a, T> {
    g: usize,
    kt: usize,
    /// `[TILE, dp]` rows of the head-major dK, dV.
    dk: &'a mut [T],
    dv: &'a mut [T],
}

struct QueryItem<'a, T> {
    h: usize,
    qt: usize,
    /// `[TILE, dp]` rows of the head-major dQ.
    dq: &'a mut [T],
}

struct BwdScratch<T> {
    /// Scores, then P (pass 1) or dS (pass 2): `[TILE, TILE]`.
    s: Vec<T>,
    /// dP, then dS (pass 1): `[TILE, TILE]`.
    dp: Vec<T>,
}

impl<T: CpuFloat> BwdScratch<T> {
    fn new() -> Self {
        BwdScratch {
            s: vec![T::ZERO; TILE * TILE],
            dp: vec![T::ZERO; TILE * TILE],
        }
    }
}

fn key_tile<T: CpuFloat>(ctx: &BwdCtx<'_, T>, s: &mut BwdScratch<T>, item: KeyItem<'_, T>) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the running CPU supports AVX2 (checked at run time).
        unsafe { key_tile_avx2(ctx, s, item) };
        return;
    }
    key_tile_body(ctx, s, item)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn key_tile_avx2<T: CpuFloat>(
    ctx: &BwdCtx<'_, T>,
    s: &mut BwdScratch<T>,
    item: KeyItem<'_, T>,
) {
    key_tile_body(ctx, s, item)
}

/// dK, dV of one key tile of kv head `g`, summed over the group's query heads
/// and over the query tiles `kt .. query_tile_end(kt)` (all that can see it).
/// Works on transposed blocks: row `j` = key, column `i` = query.
#[inline(always)]
fn key_tile_body<T: CpuFloat>(ctx: &BwdCtx<'_, T>, sc: &mut BwdScratch<T>, item: KeyItem<'_, T>) {
    let Layout { l, lpad, dp, .. } = ctx.lay;
    let KeyItem { g, kt, dk, dv } = item;
    let k0 = kt * TILE;
    let bk = (k0 + TILE).min(l) - k0;
    let k_rows = &ctx.kh[(g * lpad + k0) * dp..][..TILE * dp];
    let v_rows = &ctx.vh[(g * lpad + k0) * dp..][..TILE * dp];
    let (st, dpt) = (&mut sc.s, &mut sc.dp);
    for h in g * ctx.group..(g + 1) * ctx.group {
        let head = h * lpad;
        for qt in kt..ctx.bounds.query_tile_end(kt) {
            let (q0, q1) = (qt * TILE, ((qt + 1) * TILE).min(l));
            let class = ctx.bounds.classify(q0, q1, kt);
            if class == TileClass::Skip {
                continue;
            }
            scores(k_rows, &ctx.qt[head * dp + q0..], lpad, dp, st);
            scores(v_rows, &ctx.dot[head * dp + q0..], lpad, dp, dpt);
            let lse = &ctx.lse[head + q0..head + q0 + TILE];
            let delta = &ctx.delta[head + q0..head + q0 + TILE];
            for (j, (srow, dprow)) in st
                .chunks_exact_mut(TILE)
                .zip(dpt.chunks_exact_mut(TILE))
                .enumerate()
            {
                // Key k0 + j is visible to the contiguous queries [k0 + j, kv_end).
                let (lo, hi) = if j >= bk {
                    (0, 0)
                } else if class == TileClass::Full {
                    (0, TILE)
                } else {
                    let k = k0 + j;
                    let end = ctx.kv_end[k] as usize;
                    (k.clamp(q0, q1) - q0, end.clamp(q0, q1) - q0)
                };
                let lo = lo.min(hi);
                srow[..lo].fill(T::ZERO);
                dprow[..lo].fill(T::ZERO);
                srow[hi..].fill(T::ZERO);
                dprow[hi..].fill(T::ZERO);
                let live = srow[lo..hi]
                    .iter_mut()
                    .zip(&mut dprow[lo..hi])
                    .zip(lse[lo..hi].iter().zip(&delta[lo..hi]));
                for ((x, dx), (&m, &dd)) in live {
                    let p = (*x * ctx.scale - m).exp();
                    *x = p;
                    *dx = p * (*dx - dd);
                }
            }
            accumulate(st, &ctx.doh[(head + q0) * dp..], dp, dv);
            accumulate(dpt, &ctx.qh[(head + q0) * dp..], dp, dk);
        }
    }
    for x in dk.iter_mut() {
        *x *= ctx.scale;
    }
}

fn query_tile<T: CpuFloat>(ctx: &BwdCtx<'_, T>, s: &mut BwdScratch<T>, item: QueryItem<'_, T>) {
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
    ctx: &BwdCtx<'_, T>,
    s: &mut BwdScratch<T>,
    item: QueryItem<'_, T>,
) {
    query_tile_body(ctx, s, item)
}

/// dQ of one query tile of head `h`, over the key tiles it can see.
#[inline(always)]
fn query_tile_body<T: CpuFloat>(
    ctx: &BwdCtx<'_, T>,
    sc: &mut BwdScratch<T>,
    item: QueryItem<'_, T>,
) {
    let Layout { l, lpad, dp, .. } = ctx.lay;
    let QueryItem { h, qt, dq } = item;
    let (q0, q1) = (qt * TILE, ((qt + 1) * TILE).min(l));
    let g = h / ctx.group;
    let head = h * lpad;
    let q_rows = &ctx.qh[(head + q0) * dp..][..TILE * dp];
    let do_rows = &ctx.doh[(head + q0) * dp..][..TILE * dp];
    let kt_head = &ctx.kt[g * dp * lpad..][..dp * lpad];
    let vt_head = &ctx.vt[g * dp * lpad..][..dp * lpad];
    let lse = &ctx.lse[head + q0..head + q0 + TILE];
    let delta = &ctx.delta[head + q0..head + q0 + TILE];
    let (s, dpm) = (&mut sc.s, &mut sc.dp);
    for kt in 0..=qt {
        let class = ctx.bounds.classify(q0, q1, kt);
        if class == TileClass::Skip {
            continue;
        }
        let k0 = kt * TILE;
        let bk = (k0 + TILE).min(l) - k0;
        let kv_end = &ctx.kv_end[k0..k0 + bk];
        scores(q_rows, &kt_head[k0..], lpad, dp, s);
        scores(do_rows, &vt_head[k0..], lpad, dp, dpm);
        for (i, (srow, dprow)) in s
            .chunks_exact_mut(TILE)
            .zip(dpm.chunks_exact(TILE))
            .enumerate()
        {
            let (m, dd) = (lse[i], delta[i]);
            let (live, pad) = srow.split_at_mut(bk);
            pad.fill(T::ZERO);
            if m == T::INFINITY {
                // No visible key in this row (or a padding row): dS = 0.
                live.fill(T::ZERO);
                continue;
            }
            let q = q0 + i;
            if class == TileClass::Full {
                for (x, &dx) in live.iter_mut().zip(dprow) {
                    let p = (*x * ctx.scale - m).exp();
                    *x = p * (dx - dd);
                }
            } else {
                for (j, ((x, &dx), &end)) in live.iter_mut().zip(dprow).zip(kv_end).enumerate() {
                    *x = if k0 + j <= q && q < end as usize {
                        let p = (*x * ctx.scale - m).exp();
                        p * (dx - dd)
                    } else {
                        T::ZERO
                    };
                }
            }
        }
        accumulate(s, &ctx.kh[(g * lpad + k0) * dp..], dp, dq);
    }
    for x in dq.iter_mut() {
        *x *= ctx.scale;
    }
}
