//! The baselines the exact packed pass is compared against: attention
//! through a dense `L × L` mask ([`dense_attention_forward`],
//! [`dense_attention_backward`]), the way frameworks run a 4D mask, and the
//! SDCC forward KL with every intermediate materialised ([`sdcc_unfused`]).

use super::{AttnGrads, AttnOut, SdccOut};
use crate::matmul::{matmul, Mat};
use treeattn::backend::cpu::{num_threads, run_parallel, CpuFloat};
use treeattn::backend::{AttnArgs, AttnParams, AttnShape, Host, SdccArgs, SdccLoss};
use treeattn::mask::{dense_mask, PackMask};
use treeattn::{Error, Result};

/// The most memory the dense-mask baseline may take for its `L × L`
/// buffers (mask and score matrices): 8 GiB. Larger packs are refused with
/// an error instead of exhausting memory (the paper-scale compaction pack of
/// ~196k tokens would need 38 GB for the mask alone).
pub const DENSE_MAX_BYTES: u64 = 8 << 30;

/// Checks the dense methods' shared preconditions; `matrices` is the number
/// of `L × L` f32 buffers the caller holds besides the boolean mask.
fn check_dense(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    shape: &AttnShape,
    mask: &PackMask<'_>,
    params: &AttnParams,
    matrices: u64,
) -> Result<()> {
    let l = shape.tokens as u64;
    let bytes = l.saturating_mul(l).saturating_mul(1 + 4 * matrices);
    if bytes > DENSE_MAX_BYTES {
        return Err(Error::Unsupported(format!(
            "the dense-mask baseline needs {:.1} GiB of L × L buffers for L = {l} (limit {} GiB)",
            bytes as f64 / (1u64 << 30) as f64,
            DENSE_MAX_BYTES >> 30
        )));
    }
    if params.rope.is_some() {
        return Err(Error::Unsupported(
            "the dense-mask baseline takes pre-rotated inputs (params.rope must be None)".into(),
        ));
    }
    AttnArgs::<Host, f32>::new(q, k, v, *shape, *mask, *params)?;
    Ok(())
}

/// Rows per work item of the dense baseline.
const DENSE_ROWS: usize = 32;

/// `C = A · B` with `A` `[m, depth]`, `B` `[depth, n]`, `C` `[m, n]`
/// (contiguous, `m = c.len() / n`): the crate's one CPU matrix product
/// (`src/matmul.rs`), rows of `C` spread over the CPU backend's threads.
fn par_gemm(n: usize, depth: usize, a: &[f32], b: &[f32], c: &mut [f32]) {
    let m = c.len() / n;
    matmul(m, depth, n, Mat::rows(a, depth), Mat::rows(b, n), c, false);
}

/// `[rows, cols]` → `[cols, rows]`, in 32 × 32 blocks, in parallel.
fn par_transpose(x: &[f32], rows: usize, cols: usize, out: &mut [f32]) {
    const B: usize = 32;
    let work: Vec<_> = out.chunks_mut(B * rows).enumerate().collect();
    run_parallel(
        work,
        num_threads(),
        || (),
        |_, (blk, dst)| {
            let c0 = blk * B;
            let nc = dst.len() / rows;
            for r0 in (0..rows).step_by(B) {
                for c in 0..nc {
                    for r in r0..(r0 + B).min(rows) {
                        dst[c * rows + r] = x[r * cols + c0 + c];
                    }
                }
            }
        },
    );
}

/// Head `h` of a `[tokens, heads, d]` tensor as a contiguous `[tokens, d]`.
fn head_rows(x: &[f32], tokens: usize, heads: usize, h: usize, d: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(tokens * d);
    for t in 0..tokens {
        out.extend_from_slice(&x[(t * heads + h) * d..][..d]);
    }
    out
}

/// Writes (or, with `add`, adds) a contiguous `[tokens, d]` head back into
/// head `h` of a `[tokens, heads, d]` tensor, times `scale`.
fn put_head(x: &mut [f32], rows: &[f32], heads: usize, h: usize, d: usize, scale: f32, add: bool) {
    for (t, row) in rows.chunks_exact(d).enumerate() {
        let dst = &mut x[(t * heads + h) * d..][..d];
        for (y, &r) in dst.iter_mut().zip(row) {
            *y = if add { *y + scale * r } else { scale * r };
        }
    }
}

/// Forward softmax of the `[l, l]` score rows in place, through the dense
/// boolean mask: `P = softmax(scale · S)` over the allowed entries (0
/// elsewhere), and each row's `LSE` (−inf and a zero row when nothing is
/// allowed).
fn softmax_rows(s: &mut [f32], allowed: &[bool], l: usize, scale: f32, lse: &mut [f32]) {
    let work: Vec<_> = s
        .chunks_mut(DENSE_ROWS * l)
        .zip(lse.chunks_mut(DENSE_ROWS))
        .enumerate()
        .collect();
    run_parallel(
        work,
        num_threads(),
        || (),
        |_, (blk, (rows, lse_rows))| {
            for (i, row) in rows.chunks_exact_mut(l).enumerate() {
                let q = blk * DENSE_ROWS + i;
                let ok = &allowed[q * l..(q + 1) * l];
                let mut m = f32::NEG_INFINITY;
                for (x, &a) in row.iter_mut().zip(ok) {
                    *x = if a { *x * scale } else { f32::NEG_INFINITY };
                    m = m.max(*x);
                }
                if m == f32::NEG_INFINITY {
                    row.fill(0.0);
                    lse_rows[i] = f32::NEG_INFINITY;
                    continue;
                }
                for x in row.iter_mut() {
                    *x -= m;
                }
                f32::exp_in_place(row);
                let sum: f32 = row.iter().sum();
                let inv = 1.0 / sum;
                for x in row.iter_mut() {
                    *x *= inv;
                }
                lse_rows[i] = m + sum.ln();
            }
        },
    );
}

/// Backward recomputation of `P` in place from the `[l, l]` scores, the
/// dense mask and the saved LSE: `P = exp(scale · S − LSE)` where allowed, 0
/// elsewhere and on rows whose LSE is −inf (no visible key).
fn recompute_p(s: &mut [f32], allowed: &[bool], l: usize, scale: f32, lse: &[f32]) {
    let work: Vec<_> = s.chunks_mut(DENSE_ROWS * l).enumerate().collect();
    run_parallel(
        work,
        num_threads(),
        || (),
        |_, (blk, rows)| {
            for (i, row) in rows.chunks_exact_mut(l).enumerate() {
                let q = blk * DENSE_ROWS + i;
                let ok = &allowed[q * l..(q + 1) * l];
                let x_lse = lse[q];
                if x_lse == f32::NEG_INFINITY {
                    row.fill(0.0);
                    continue;
                }
                for (x, &a) in row.iter_mut().zip(ok) {
                    *x = if a {
                        // <= 0 up to rounding: the LSE bounds every score.
                        (*x * scale - x_lse).min(0.0)
                    } else {
                        f32::NEG_INFINITY
                    };
                }
                f32::exp_in_place(row);
            }
        },
    );
}

/// Attention forward the way frameworks run a 4D mask today: materialise the
/// `L × L` boolean mask of the pack (`k <= q < kv_end[k]`), then per query
/// head the full `L × L` score matrix `S = Q Kᵀ` (all `L²` entries; a
/// framework handed an arbitrary mask cannot skip blocks), mask it, softmax
/// it row-wise into `P` and compute `O = P V`. Same result as
/// [`attention_forward`] (`O`, and `LSE = ln Σ exp(scale · S)` over visible
/// keys; a row with no visible key gets `O = 0`, `LSE = −inf`); `O(L²)`
/// memory (the mask plus one head's `L × L` scores at a time). Rows are
/// spread over the same threads as the CPU backend, with the same
/// instruction set (AVX2 + FMA matmuls where available, the backend's
/// vectorized `exp`). f32, no rotary.
///
/// Errors: as [`attention_forward`], `Unsupported` for `params.rope`, and
/// `Unsupported` when the `L × L` buffers would exceed [`DENSE_MAX_BYTES`].
///
/// [`attention_forward`]: treeattn::backend::AttentionBackend::forward
pub fn dense_attention_forward(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    shape: AttnShape,
    mask: PackMask<'_>,
    params: &AttnParams,
) -> Result<AttnOut<f32>> {
    check_dense(q, k, v, &shape, &mask, params, 1)?;
    let (l, d, hq, hkv) = (shape.tokens, shape.head_dim, shape.q_heads, shape.kv_heads);
    let mut o = vec![0.0f32; shape.q_len()];
    let mut lse = vec![f32::NEG_INFINITY; hq * l];
    if l == 0 {
        return Ok(AttnOut { o, lse });
    }
    let allowed = dense_mask(mask.kv_end());
    let scale = params.softmax_scale as f32;
    let mut s = vec![0.0f32; l * l];
    let mut kt = vec![0.0f32; d * l];
    let mut oh = vec![0.0f32; l * d];
    for h in 0..hq {
        let g = h / shape.group();
        let qh = head_rows(q, l, hq, h, d);
        par_transpose(&head_rows(k, l, hkv, g, d), l, d, &mut kt);
        let vh = head_rows(v, l, hkv, g, d);
        par_gemm(l, d, &qh, &kt, &mut s);
        softmax_rows(&mut s, &allowed, l, scale, &mut lse[h * l..(h + 1) * l]);
        par_gemm(d, l, &s, &vh, &mut oh);
        put_head(&mut o, &oh, hq, h, d, 1.0, false);
    }
    Ok(AttnOut { o, lse })
}

/// Attention backward of [`dense_attention_forward`], dense: per query head,
/// recompute `P` (`L × L`) from `S = Q Kᵀ`, the mask and the saved LSE, then
/// `dP = dO Vᵀ` (`L × L`), `dS = P ∘ (dP − rowsum(dO ∘ O))`, `dQ = scale · dS
/// K`, `dK = scale · dSᵀ Q`, `dV = Pᵀ dO` (`dSᵀ` and `Pᵀ` materialised, as a
/// framework's transposed matmul reads them). GQA sums dK, dV over a kv
/// head's query heads. Same result as [`attention_backward`].
///
/// Errors: as [`attention_backward`] (wrong lengths, NaN or +inf in `lse`),
/// and `Unsupported` for `params.rope`.
///
/// [`attention_backward`]: treeattn::backend::AttentionBackend::backward
#[allow(clippy::too_many_arguments)]
pub fn dense_attention_backward(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    o: &[f32],
    lse: &[f32],
    d_o: &[f32],
    shape: AttnShape,
    mask: PackMask<'_>,
    params: &AttnParams,
) -> Result<AttnGrads<f32>> {
    check_dense(q, k, v, &shape, &mask, params, 3)?;
    let (l, d, hq, hkv) = (shape.tokens, shape.head_dim, shape.q_heads, shape.kv_heads);
    for (what, x, n) in [
        ("o", o, shape.q_len()),
        ("d_o", d_o, shape.q_len()),
        ("lse", lse, hq * l),
    ] {
        if x.len() != n {
            return Err(Error::Shape(format!(
                "{what} has {} elements, expected {n} for {shape:?}",
                x.len()
            )));
        }
    }
    if let Some(index) = lse.iter().position(|&x| x.is_nan() || x == f32::INFINITY) {
        return Err(Error::NonFinite {
            what: "lse (NaN or +inf; −inf marks a row with no visible key)".into(),
            index,
        });
    }
    let mut grads = AttnGrads {
        dq: vec![0.0f32; shape.q_len()],
        dk: vec![0.0f32; shape.kv_len()],
        dv: vec![0.0f32; shape.kv_len()],
        dsinks: None,
    };
    if l == 0 {
        return Ok(grads);
    }
    let allowed = dense_mask(mask.kv_end());
    let scale = params.softmax_scale as f32;
    let mut p = vec![0.0f32; l * l];
    let mut dp = vec![0.0f32; l * l];
    let mut tr = vec![0.0f32; l * l];
    let (mut kt, mut vt) = (vec![0.0f32; d * l], vec![0.0f32; d * l]);
    let mut out = vec![0.0f32; l * d];
    for h in 0..hq {
        let g = h / shape.group();
        let qh = head_rows(q, l, hq, h, d);
        let kh = head_rows(k, l, hkv, g, d);
        let vh = head_rows(v, l, hkv, g, d);
        let doh = head_rows(d_o, l, hq, h, d);
        par_transpose(&kh, l, d, &mut kt);
        par_transpose(&vh, l, d, &mut vt);
        par_gemm(l, d, &qh, &kt, &mut p);
        recompute_p(&mut p, &allowed, l, scale, &lse[h * l..(h + 1) * l]);
        par_gemm(l, d, &doh, &vt, &mut dp);
        let delta: Vec<f32> = (0..l)
            .map(|t| {
                let at = (t * hq + h) * d;
                o[at..at + d]
                    .iter()
                    .zip(&d_o[at..at + d])
                    .map(|(a, b)| a * b)
                    .sum()
            })
            .collect();
        let work: Vec<_> = dp
            .chunks_mut(DENSE_ROWS * l)
            .zip(p.chunks(DENSE_ROWS * l))
            .enumerate()
            .collect();
        run_parallel(
            work,
            num_threads(),
            || (),
            |_, (blk, (ds_rows, p_rows))| {
                for (i, (ds, pr)) in ds_rows
                    .chunks_exact_mut(l)
                    .zip(p_rows.chunks_exact(l))
                    .enumerate()
                {
                    let dl = delta[blk * DENSE_ROWS + i];
                    for (x, &pv) in ds.iter_mut().zip(pr) {
                        *x = pv * (*x - dl);
                    }
                }
            },
        );
        par_gemm(d, l, &dp, &kh, &mut out);
        put_head(&mut grads.dq, &out, hq, h, d, scale, false);
        par_transpose(&dp, l, l, &mut tr);
        par_gemm(d, l, &tr, &qh, &mut out);
        put_head(&mut grads.dk, &out, hkv, g, d, scale, true);
        par_transpose(&p, l, l, &mut tr);
        par_gemm(d, l, &tr, &doh, &mut out);
        put_head(&mut grads.dv, &out, hkv, g, d, 1.0, true);
    }
    Ok(grads)
}

/// SDCC forward KL the unfused way (what `log_softmax` + `kl_div` +
/// autograd run): same inputs, semantics and result as
/// [`treeattn::backend::SdccBackend::sdcc_forward_kl`] on the CPU backend, but every intermediate is a
/// materialised `[pairs, vocab]` f32 tensor, one pass each:
///
/// 1. gather the pairs' student and teacher rows, divided by `τ`;
/// 2. `log p_s`, `log p_t` = row-wise log-softmax (new tensors; the
///    gathered rows are then freed);
/// 3. `p_t = exp(log p_t)`;
/// 4. `KL_i = Σ_v p_t (log p_t − log p_s)`, entries with `p_t = 0` adding 0;
/// 5. `g_i = w_i (exp(log p_s) − p_t) / τ`;
/// 6. scatter-add the `g_i` into the `[rows, vocab]` student gradient.
///
/// Peak memory: four `[pairs, vocab]` f32 tensors live at once (after step 2
/// and at step 5) plus the gradient; see [`SdccCase::unfused_peak_bytes`](super::SdccCase::unfused_peak_bytes).
/// Exponentials are f32; the row sums of the log-softmax and the KL sums
/// accumulate in f64 (a plain f32 sum over 150k entries would drift by
/// ~1e-3; frameworks use pairwise f32 sums of comparable accuracy).
///
/// Errors: as the fused op (vocab 0, logits not whole rows, weights not one
/// per pair / non-finite / negative, temperature non-finite or `<= 0`, pair
/// rows out of range, a used row with NaN or +inf or entirely −inf).
pub fn sdcc_unfused(
    student: &[f32],
    teacher: &[f32],
    vocab: usize,
    pairs: &[(u32, u32)],
    weights: &[f32],
    temperature: f32,
) -> Result<SdccOut<f32>> {
    let n_student =
        SdccArgs::<Host, f32>::new(student, teacher, vocab, pairs, weights, temperature)?
            .student_rows();
    for &(s, t) in pairs {
        for (what, x, r) in [("student", student, s), ("teacher", teacher, t)] {
            let row = &x[r as usize * vocab..][..vocab];
            if let Some(c) = row.iter().position(|v| v.is_nan() || *v == f32::INFINITY) {
                return Err(Error::NonFinite {
                    what: format!("SDCC {what} logits row {r}, column {c} (NaN or +inf)"),
                    index: r as usize * vocab + c,
                });
            }
            if row.iter().all(|&v| v == f32::NEG_INFINITY) {
                return Err(Error::NonFinite {
                    what: format!("SDCC {what} logits row {r} (entirely −inf: no distribution)"),
                    index: r as usize * vocab,
                });
            }
        }
    }
    let n = pairs.len();
    let threads = num_threads();
    let inv_tau = 1.0 / temperature;

    // 1. Gather.
    let (mut s, mut t) = (vec![0.0f32; n * vocab], vec![0.0f32; n * vocab]);
    for (src, buf, side) in [(student, &mut s, 0), (teacher, &mut t, 1)] {
        run_parallel(
            rows_of(buf, vocab),
            threads,
            || (),
            |_, (i, row)| {
                let r = if side == 0 { pairs[i].0 } else { pairs[i].1 } as usize;
                for (y, &x) in row.iter_mut().zip(&src[r * vocab..][..vocab]) {
                    *y = x * inv_tau;
                }
            },
        );
    }
    // 2. Log-softmax into new tensors.
    let log_softmax = |x: &[f32]| {
        let mut out = vec![0.0f32; n * vocab];
        run_parallel(
            rows_of(&mut out, vocab),
            threads,
            || (),
            |_, (i, row)| {
                let src = &x[i * vocab..][..vocab];
                let m = src.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
                let z: f64 = src.iter().map(|&v| (v - m).exp() as f64).sum();
                let lse = m + z.ln() as f32;
                for (y, &v) in row.iter_mut().zip(src) {
                    *y = v - lse;
                }
            },
        );
        out
    };
    let log_ps = log_softmax(&s);
    let log_pt = log_softmax(&t);
    drop((s, t));
    // 3. Teacher probabilities.
    let mut p_t = vec![0.0f32; n * vocab];
    run_parallel(
        rows_of(&mut p_t, vocab),
        threads,
        || (),
        |_, (i, row)| {
            for (y, &l) in row.iter_mut().zip(&log_pt[i * vocab..][..vocab]) {
                *y = l.exp();
            }
        },
    );
    // 4. KL per pair.
    let mut per_pair = vec![0.0f64; n];
    let work: Vec<_> = per_pair.iter_mut().enumerate().collect();
    run_parallel(
        work,
        threads,
        || (),
        |_, (i, kl)| {
            let rows = p_t[i * vocab..][..vocab]
                .iter()
                .zip(&log_pt[i * vocab..][..vocab])
                .zip(&log_ps[i * vocab..][..vocab]);
            *kl = rows
                .filter(|((&p, _), _)| p > 0.0)
                .map(|((&p, &lt), &ls)| p as f64 * (lt as f64 - ls as f64))
                .sum();
        },
    );
    // 5. Gradient rows.
    let mut g = vec![0.0f32; n * vocab];
    run_parallel(
        rows_of(&mut g, vocab),
        threads,
        || (),
        |_, (i, row)| {
            let c = weights[i] * inv_tau;
            let src = log_ps[i * vocab..][..vocab]
                .iter()
                .zip(&p_t[i * vocab..][..vocab]);
            for (y, (&ls, &p)) in row.iter_mut().zip(src) {
                *y = c * (ls.exp() - p);
            }
        },
    );
    // 6. Scatter-add into the student gradient, one work item per student row.
    let mut by_row: Vec<Vec<usize>> = vec![Vec::new(); n_student];
    for (i, &(s_row, _)) in pairs.iter().enumerate() {
        by_row[s_row as usize].push(i);
    }
    let mut grad_student = vec![0.0f32; student.len()];
    let work: Vec<_> = grad_student
        .chunks_mut(vocab)
        .zip(&by_row)
        .filter(|(_, ids)| !ids.is_empty())
        .collect();
    run_parallel(
        work,
        threads,
        || (),
        |_, (row, ids)| {
            for &i in ids {
                for (y, &x) in row.iter_mut().zip(&g[i * vocab..][..vocab]) {
                    *y += x;
                }
            }
        },
    );
    Ok(SdccOut {
        loss: SdccLoss::from_per_pair(per_pair, weights),
        grad_student,
    })
}

/// The `vocab`-long rows of `buf`, numbered: work items of one pass.
fn rows_of(buf: &mut [f32], vocab: usize) -> Vec<(usize, &mut [f32])> {
    buf.chunks_mut(vocab).enumerate().collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::test_support::{
        attention_backward, attention_forward, max_diff, random, shape_of,
    };
    use crate::bench::workloads::{SdccCase, Workload, SHAPES};
    use crate::gen::Size;
    use treeattn::rng::Rng;

    // The dense baseline must compute exactly what the tiled kernel computes
    // (it is credited with the trie pack's pairs). Inputs in [−1, 1) with
    // scale 1/sqrt(d): scores are O(1), softmax weights sum to 1 and outputs
    // are convex combinations of values in [−1, 1], so f32 rounding of
    // sums over <= ~600 terms stays near 1e-6; 2e-4 on O and LSE and 1e-3 on
    // gradients (sums of up to L products, then scaled) leaves a margin of
    // ~100× while any masking or indexing bug moves values by O(0.1).
    #[test]
    fn dense_baseline_equals_the_tiled_kernel_on_every_shape() {
        let mut rng = Rng::new(11);
        for (i, shape) in SHAPES.into_iter().enumerate() {
            let w = Workload::generate(shape, 100 + i as u64, Size::Small).unwrap();
            for (hq, hkv, d) in [(2, 1, 16), (1, 1, 64)] {
                let p = &w.trie;
                let sh = shape_of(p, hq, hkv, d);
                let params = AttnParams::new(d);
                let q = random(sh.q_len(), &mut rng);
                let k = random(sh.kv_len(), &mut rng);
                let v = random(sh.kv_len(), &mut rng);
                let d_o = random(sh.q_len(), &mut rng);
                let tiled = attention_forward(&q, &k, &v, sh, p.mask().unwrap(), &params).unwrap();
                let dense =
                    dense_attention_forward(&q, &k, &v, sh, p.mask().unwrap(), &params).unwrap();
                assert!(max_diff(&tiled.o, &dense.o) < 2e-4, "{shape:?} O");
                assert!(max_diff(&tiled.lse, &dense.lse) < 2e-4, "{shape:?} LSE");
                let gt = attention_backward(
                    &q,
                    &k,
                    &v,
                    &tiled.o,
                    &tiled.lse,
                    &d_o,
                    sh,
                    p.mask().unwrap(),
                    &params,
                )
                .unwrap();
                let gd = dense_attention_backward(
                    &q,
                    &k,
                    &v,
                    &dense.o,
                    &dense.lse,
                    &d_o,
                    sh,
                    p.mask().unwrap(),
                    &params,
                )
                .unwrap();
                assert!(max_diff(&gt.dq, &gd.dq) < 1e-3, "{shape:?} dQ");
                assert!(max_diff(&gt.dk, &gd.dk) < 1e-3, "{shape:?} dK");
                assert!(max_diff(&gt.dv, &gd.dv) < 1e-3, "{shape:?} dV");
                // Negative control: the same inputs under a plain causal
                // mask differ wherever the tree hides something.
                if w.junctions > 0 {
                    let causal =
                        dense_attention_forward(&q, &k, &v, sh, w.causal.mask().unwrap(), &params)
                            .unwrap();
                    assert!(
                        max_diff(&causal.o, &dense.o) > 1e-2,
                        "{shape:?} mask ignored"
                    );
                }
            }
        }
    }

    #[test]
    fn dense_baseline_handles_padding_keys_and_rejects_bad_input() {
        // Key 0 is visible to row 0 only, key 1 is padding (kv_end[1] ==
        // 1): row 1 sees no key at all, row 2 sees only key 2.
        let kv_end = [1u32, 1, 3];
        let pos = [0u32, 1, 2];
        let mask = PackMask::new(&kv_end, &pos).unwrap();
        let sh = AttnShape {
            tokens: 3,
            q_heads: 1,
            kv_heads: 1,
            head_dim: 8,
            v_head_dim: 8,
        };
        let mut rng = Rng::new(3);
        let (q, k, v) = (
            random(24, &mut rng),
            random(24, &mut rng),
            random(24, &mut rng),
        );
        let params = AttnParams::new(8);
        let out = dense_attention_forward(&q, &k, &v, sh, mask, &params).unwrap();
        assert_eq!(out.lse[1], f32::NEG_INFINITY);
        assert!(out.o[8..16].iter().all(|&x| x == 0.0));
        assert!(max_diff(&out.o[16..24], &v[16..24]) < 1e-6, "row 2 = v[2]");
        let g =
            dense_attention_backward(&q, &k, &v, &out.o, &out.lse, &q, sh, mask, &params).unwrap();
        assert!(g.dq[8..16].iter().all(|&x| x == 0.0));
        assert!(g.dk.iter().chain(&g.dv).chain(&g.dq).all(|x| x.is_finite()));
        // Errors name what is wrong.
        let e = dense_attention_forward(&q[..23], &k, &v, sh, mask, &params).unwrap_err();
        assert!(
            matches!(e, Error::Shape(ref m) if m.starts_with("q has 23")),
            "{e}"
        );
        let roped = AttnParams {
            rope: Some(treeattn::backend::Rope {
                base: 10000.0,
                dims: 8,
            }),
            ..params
        };
        assert!(matches!(
            dense_attention_forward(&q, &k, &v, sh, mask, &roped),
            Err(Error::Unsupported(_))
        ));
        // A pack too large for L × L buffers (50k² · 5 bytes = 11.6 GiB) is
        // refused before anything is allocated.
        let l = 50_000;
        let big = AttnShape {
            tokens: l,
            q_heads: 1,
            kv_heads: 1,
            head_dim: 1,
            v_head_dim: 1,
        };
        let kv_big = vec![l as u32; l];
        let (pos_big, x_big) = (vec![0u32; l], vec![0.0f32; l]);
        let refused = dense_attention_forward(
            &x_big,
            &x_big,
            &x_big,
            big,
            PackMask::new(&kv_big, &pos_big).unwrap(),
            &AttnParams::new(1),
        )
        .map(drop);
        assert!(
            matches!(refused, Err(Error::Unsupported(ref m)) if m.contains("L = 50000")),
            "{refused:?}"
        );
        let mut lse = out.lse.clone();
        lse[2] = f32::NAN;
        let e =
            dense_attention_backward(&q, &k, &v, &out.o, &lse, &q, sh, mask, &params).unwrap_err();
        assert_eq!(
            e,
            Error::NonFinite {
                what: "lse (NaN or +inf; −inf marks a row with no visible key)".into(),
                index: 2
            }
        );
    }

    // Fused and unfused SDCC compute the same loss and gradient. The fused
    // op works in f64; the unfused one stores log-probabilities of magnitude
    // ~ln(3000) ≈ 8 in f32 (rounding ~5e-7 each), so a per-pair KL (~0.01
    // here) differs by ~1e-6: 1e-5 absolute + 1e-4 relative per pair (and
    // 1e-4 on the sum of 11 pairs) is a 10× margin, while a wrong
    // temperature, weight or row moves KLs by > 1e-3. Gradient entries are
    // differences of probabilities ~1/3000 stored in f32: 1e-6 absolute.
    #[test]
    fn unfused_sdcc_equals_fused() {
        let mut c = SdccCase::new(9, 3000, 4);
        // A row used by two pairs, a zero weight, and teacher zeros (−inf).
        c.pairs.push((0, 5));
        c.weights.push(0.0);
        c.pairs.push((2, 1));
        c.weights.push(0.5);
        c.teacher[5 * 3000..5 * 3000 + 100].fill(f32::NEG_INFINITY);
        c.temperature = 1.7;
        let (a, b) = (c.fused().unwrap(), c.unfused().unwrap());
        assert!(
            (a.loss.loss_sum - b.loss.loss_sum).abs() <= 1e-5 * a.loss.loss_sum.abs(),
            "{a:?} {b:?}"
        );
        assert!(a.loss.loss_sum > 0.0);
        for (x, y) in a.loss.per_pair.iter().zip(&b.loss.per_pair) {
            assert!((x - y).abs() <= 1e-5 + 1e-4 * x.abs(), "{x} {y}");
        }
        assert!(max_diff(&a.grad_student, &b.grad_student) < 1e-6);
        assert!(a.grad_student.iter().any(|&g| g.abs() > 1e-5));
        // Student −inf where the teacher has mass: KL = +inf in both.
        c.student[7 * 3000 + 11] = f32::NEG_INFINITY;
        assert_eq!(c.unfused().unwrap().loss.per_pair[7], f64::INFINITY);
        assert_eq!(c.fused().unwrap().loss.per_pair[7], f64::INFINITY);
        // Bad input is an error naming it.
        c.student[3 * 3000 + 2] = f32::NAN;
        let e = c.unfused().unwrap_err();
        assert_eq!(
            e,
            Error::NonFinite {
                what: "SDCC student logits row 3, column 2 (NaN or +inf)".into(),
                index: 3 * 3000 + 2
            }
        );
        let e = sdcc_unfused(&c.student, &c.teacher, 3000, &[(0, 99)], &[1.0], 1.0).unwrap_err();
        assert!(matches!(e, Error::Pack(_)), "{e}");
        assert!(sdcc_unfused(&c.student, &c.teacher, 0, &[], &[], 1.0).is_err());
        assert!(sdcc_unfused(&c.student, &c.teacher, 3000, &[(0, 0)], &[-1.0], 1.0).is_err());
        assert!(sdcc_unfused(&c.student, &c.teacher, 3000, &[(0, 0)], &[1.0], 0.0).is_err());
    }
}
