//! Tiled attention backward: two deterministic passes (dK, dV per key tile;
//! dQ per query tile), each recomputing `P` from the saved LSE.

use super::kernels::{
    accumulate, has_avx2_fma, live_strip_indices, live_strips, row_strips, scores, NS,
};
use super::lanes;
use super::layout::{Input, Layout, Output, RopeTable};
use super::workspace;
use super::{
    check_finite, check_len, check_qkv, check_result, num_threads, run_parallel, AttnGrads,
    CpuFloat, KeyTileBounds, TileClass, TILE,
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
/// `params.check_finite`) a NaN or ±inf in `o` or `d_o`; and a NaN or ±inf
/// in the gradients (overflow of `T`, or non-finite inputs left unchecked).
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
    backward_on_threads(q, k, v, o, lse, d_o, shape, mask, params, num_threads())
}

/// [`attention_backward`] writing into the caller's buffers: `dq` like q
/// `[tokens, q_heads, head_dim]`, `dk` and `dv` like k `[tokens, kv_heads,
/// head_dim]`. On `Ok` every element of the three is written (their prior
/// contents are never read), so a training loop can reuse them across calls
/// without zeroing. On `Err` their contents are unspecified.
///
/// Errors: those of [`attention_backward`], and `dq`, `dk` or `dv` of the
/// wrong length (checked before any work).
#[allow(clippy::too_many_arguments)]
pub fn attention_backward_into<T: CpuFloat>(
    q: &[T],
    k: &[T],
    v: &[T],
    o: &[T],
    lse: &[T],
    d_o: &[T],
    shape: AttnShape,
    mask: PackMask<'_>,
    params: &AttnParams,
    dq: &mut [T],
    dk: &mut [T],
    dv: &mut [T],
) -> Result<()> {
    let threads = num_threads();
    check_inputs(q, k, v, o, lse, d_o, &shape, &mask, params)?;
    check_len(
        "dq",
        dq.len(),
        shape.q_len(),
        "tokens · q_heads · head_dim, like q",
    )?;
    let kv_how = "tokens · kv_heads · head_dim, like k";
    check_len("dk", dk.len(), shape.kv_len(), kv_how)?;
    check_len("dv", dv.len(), shape.kv_len(), kv_how)?;
    let grads = [dq, dk, dv];
    backward_checked(q, k, v, o, lse, d_o, shape, mask, params, grads, threads)
}

/// [`attention_backward`] on `threads` threads.
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward_on_threads<T: CpuFloat>(
    q: &[T],
    k: &[T],
    v: &[T],
    o: &[T],
    lse: &[T],
    d_o: &[T],
    shape: AttnShape,
    mask: PackMask<'_>,
    params: &AttnParams,
    threads: usize,
) -> Result<AttnGrads<T>> {
    // Validated before allocating: the gradients' sizes come from `shape`.
    check_inputs(q, k, v, o, lse, d_o, &shape, &mask, params)?;
    let mut dq = vec![T::ZERO; shape.q_len()];
    let mut dk = vec![T::ZERO; shape.kv_len()];
    let mut dv = vec![T::ZERO; shape.kv_len()];
    let grads = [&mut dq[..], &mut dk[..], &mut dv[..]];
    backward_checked(q, k, v, o, lse, d_o, shape, mask, params, grads, threads)?;
    Ok(AttnGrads { dq, dk, dv })
}

/// Validation of the backward's inputs (see [`attention_backward`]).
#[allow(clippy::too_many_arguments)]
fn check_inputs<T: CpuFloat>(
    q: &[T],
    k: &[T],
    v: &[T],
    o: &[T],
    lse: &[T],
    d_o: &[T],
    shape: &AttnShape,
    mask: &PackMask<'_>,
    params: &AttnParams,
) -> Result<()> {
    check_qkv(q, k, v, shape, mask, params)?;
    let q_how = "tokens · q_heads · head_dim, like q";
    check_len("o", o.len(), shape.q_len(), q_how)?;
    check_len("d_o", d_o.len(), shape.q_len(), q_how)?;
    check_len(
        "lse",
        lse.len(),
        shape.q_heads * shape.tokens,
        "q_heads · tokens",
    )?;
    if let Some(index) = lse
        .iter()
        .position(|x| x.partial_cmp(&T::INFINITY) != Some(std::cmp::Ordering::Less))
    {
        return Err(Error::NonFinite {
            what: "lse (NaN or +inf; −inf marks a row with no visible key)".into(),
            index,
        });
    }
    if params.check_finite {
        check_finite("o", o)?;
        check_finite("d_o", d_o)?;
    }
    Ok(())
}

/// The backward on inputs and gradient buffers `[dq, dk, dv]` already
/// validated.
#[allow(clippy::too_many_arguments)]
fn backward_checked<T: CpuFloat>(
    q: &[T],
    k: &[T],
    v: &[T],
    o: &[T],
    lse: &[T],
    d_o: &[T],
    shape: AttnShape,
    mask: PackMask<'_>,
    params: &AttnParams,
    [dq, dk, dv]: [&mut [T]; 3],
    threads: usize,
) -> Result<()> {
    let l = shape.tokens;
    if l == 0 {
        return Ok(());
    }
    let lay = Layout::new(l, shape.head_dim, threads);
    let (lpad, dp, d) = (lay.lpad, lay.dp, lay.d);
    let (hq, hkv) = (shape.q_heads, shape.kv_heads);
    let rope = params.rope.map(|r| RopeTable::new(r, mask.position_ids));
    let [qh, qt, kh, kt, vh, vt, doh, dot] = lay.copy_inputs([
        Input::rows(q, hq, rope.as_ref()),
        Input::columns(q, hq, rope.as_ref()),
        Input::rows(k, hkv, rope.as_ref()),
        Input::columns(k, hkv, rope.as_ref()),
        Input::rows(v, hkv, None),
        Input::columns(v, hkv, None),
        Input::rows(d_o, hq, None),
        Input::columns(d_o, hq, None),
    ]);

    // Per (head, padded row): D = rowsum(dO ∘ O), and the LSE to subtract,
    // with +inf for rows without a visible key and for padding rows so that
    // exp(s − lse) is exactly 0 there.
    let mut delta = workspace::take(hq * lpad, T::ZERO);
    let mut lse_eff = workspace::take(hq * lpad, T::INFINITY);
    let work: Vec<_> = delta
        .chunks_mut(lpad)
        .zip(lse_eff.chunks_mut(lpad))
        .enumerate()
        .collect();
    run_parallel(
        work,
        lay.threads,
        || (),
        |_, (h, (delta, lse_eff))| {
            for t in 0..l {
                let at = (t * hq + h) * d;
                let mut acc = T::ZERO;
                for (&a, &b) in o[at..at + d].iter().zip(&d_o[at..at + d]) {
                    acc += a * b;
                }
                delta[t] = acc;
                let x = lse[h * l + t];
                if x > T::NEG_INFINITY {
                    lse_eff[t] = x;
                }
            }
        },
    );

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
    let mut dkh = workspace::take(hkv * lpad * dp, T::ZERO);
    let mut dvh = workspace::take(hkv * lpad * dp, T::ZERO);
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
    let mut dqh = workspace::take(hq * lpad * dp, T::ZERO);
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

    lay.copy_outputs([
        Output {
            xh: &dqh,
            heads: hq,
            rope: rope.as_ref(),
            out: &mut *dq,
        },
        Output {
            xh: &dkh,
            heads: hkv,
            rope: rope.as_ref(),
            out: &mut *dk,
        },
        Output {
            xh: &dvh,
            heads: hkv,
            rope: None,
            out: &mut *dv,
        },
    ]);
    check_result("dq", dq)?;
    check_result("dk", dk)?;
    check_result("dv", dv)?;
    Ok(())
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
    /// `[heads, lpad, dp]` (`*h`) and `[heads, lpad / TILE, dp, TILE]` (`*t`) copies; q, k rotated.
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
    if has_avx2_fma() {
        // SAFETY: the running CPU supports AVX2 and FMA (checked at run time).
        unsafe { key_tile_avx2(ctx, s, item) };
        return;
    }
    key_tile_body::<T, false>(ctx, s, item)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn key_tile_avx2<T: CpuFloat>(
    ctx: &BwdCtx<'_, T>,
    s: &mut BwdScratch<T>,
    item: KeyItem<'_, T>,
) {
    key_tile_body::<T, true>(ctx, s, item)
}

/// dK, dV of one key tile of kv head `g`, summed over the group's query heads
/// and over the query tiles `kt .. query_tile_end(kt)` (all that can see it).
/// Works on transposed blocks: row `j` = key, column `i` = query.
#[inline(always)]
fn key_tile_body<T: CpuFloat, const FMA: bool>(
    ctx: &BwdCtx<'_, T>,
    sc: &mut BwdScratch<T>,
    item: KeyItem<'_, T>,
) {
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
            let live = ctx.bounds.live_key_rows(k0, q0, q1);
            scores::<T, FMA>(k_rows, &ctx.qt[(head + q0) * dp..], TILE, dp, st, live);
            scores::<T, FMA>(v_rows, &ctx.dot[(head + q0) * dp..], TILE, dp, dpt, live);
            let lse = &ctx.lse[head + q0..head + q0 + TILE];
            let delta = &ctx.delta[head + q0..head + q0 + TILE];
            for (j, (srow, dprow)) in st
                .chunks_exact_mut(TILE)
                .zip(dpt.chunks_exact_mut(TILE))
                .enumerate()
            {
                let strips = row_strips(live, j);
                if strips == 0 {
                    continue;
                }
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
                let pairs = live_strips(srow, strips).zip(live_strips(dprow, strips));
                for (c, (x, dx)) in live_strip_indices(strips).zip(pairs) {
                    let a = c * NS;
                    lanes::key_strip::<T, FMA>(
                        x,
                        dx,
                        lse[a..a + NS].try_into().expect("NS lanes"),
                        delta[a..a + NS].try_into().expect("NS lanes"),
                        a as u32,
                        lo as u32,
                        hi as u32,
                        ctx.scale,
                    );
                }
            }
            accumulate::<T, FMA>(st, &ctx.doh[(head + q0) * dp..], dp, dv, live);
            accumulate::<T, FMA>(dpt, &ctx.qh[(head + q0) * dp..], dp, dk, live);
        }
    }
    for x in dk.iter_mut() {
        *x *= ctx.scale;
    }
}

fn query_tile<T: CpuFloat>(ctx: &BwdCtx<'_, T>, s: &mut BwdScratch<T>, item: QueryItem<'_, T>) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: the running CPU supports AVX2 and FMA (checked at run time).
        unsafe { query_tile_avx2(ctx, s, item) };
        return;
    }
    query_tile_body::<T, false>(ctx, s, item)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn query_tile_avx2<T: CpuFloat>(
    ctx: &BwdCtx<'_, T>,
    s: &mut BwdScratch<T>,
    item: QueryItem<'_, T>,
) {
    query_tile_body::<T, true>(ctx, s, item)
}

/// dQ of one query tile of head `h`, over the key tiles it can see.
#[inline(always)]
fn query_tile_body<T: CpuFloat, const FMA: bool>(
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
        let blocks = ctx.bounds.query_row_blocks(q0, q1, k0);
        let live = blocks.live;
        scores::<T, FMA>(q_rows, &kt_head[k0 * dp..], TILE, dp, s, live);
        scores::<T, FMA>(do_rows, &vt_head[k0 * dp..], TILE, dp, dpm, live);
        for (i, (srow, dprow)) in s
            .chunks_exact_mut(TILE)
            .zip(dpm.chunks_exact_mut(TILE))
            .enumerate()
        {
            let strips = row_strips(live, i);
            if strips == 0 {
                continue;
            }
            let (m, dd) = (lse[i], delta[i]);
            if m == T::INFINITY {
                // No visible key in this row (or a padding row): dS = 0.
                live_strips(srow, strips).for_each(|x| *x = [T::ZERO; NS]);
                continue;
            }
            let full = row_strips(blocks.full, i);
            let q = (q0 + i) as u32;
            let (mut unused_max, mut unused_visible) = ([T::NEG_INFINITY; NS], [0; NS]);
            let pairs = live_strips(srow, strips).zip(live_strips(dprow, strips));
            for (c, (x, dx)) in live_strip_indices(strips).zip(pairs) {
                let k = k0 + c * NS;
                if full >> c & 1 == 1 && k + NS <= l {
                    // A fully visible block: no mask.
                    lanes::scale_offset::<T, FMA>(x, ctx.scale, m);
                } else {
                    // Masked entries, and keys past the pack's end (kv_end
                    // 0), get exp(−inf) = 0.
                    lanes::mask_max::<T, FMA>(
                        x,
                        k as u32,
                        ctx.bounds.strip_ends(k),
                        q,
                        ctx.scale,
                        m,
                        &mut unused_max,
                        &mut unused_visible,
                    );
                }
                lanes::exp_times::<T, FMA>(x, &*dx, dd);
            }
        }
        accumulate::<T, FMA>(s, &ctx.kh[(g * lpad + k0) * dp..], dp, dq, live);
    }
    for x in dq.iter_mut() {
        *x *= ctx.scale;
    }
}
