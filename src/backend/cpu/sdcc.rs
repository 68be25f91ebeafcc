//! SDCC fused forward-KL over the vocabulary (DESIGN §5).

use super::{run_parallel, CpuFloat};
use crate::backend::{Host, SdccCall, SdccLoss};
use crate::{Error, Result};
use std::sync::Mutex;

/// Vocabulary entries per chunk of the online log-sum-exp: one max update
/// and one rescale per chunk instead of per entry.
const CHUNK: usize = 1024;

/// Forward KL of SDCC self-distillation, fused over the vocabulary.
///
/// For each pair `i = (s, t)` (student row, teacher row of the `[rows,
/// vocab]` row-major logits), weight `w_i` and temperature `τ`, with
/// `p = softmax(logits / τ)`:
///
/// ```text
/// KL_i = Σ_v p_t(v) · (log p_t(v) − log p_s(v))
/// ∂(w_i KL_i) / ∂ student[s, v] = w_i · (p_s(v) − p_t(v)) / τ
/// ```
///
/// The teacher gets no gradient (stop-gradient). Everything accumulates in
/// f64. Memory traffic per pair: two sweeps over the pair's two rows. Sweep 1
/// reads both rows once, in chunks, keeping an online log-sum-exp of both
/// distributions and the cross term `Σ_v e^{a_v − m_a} ((a_v − m_a) − (b_v −
/// m_b))` (rescaled whenever a running max moves), which gives
/// `KL = W / Z_t − ln Z_t + ln Z_s` without materializing either softmax and
/// without cancelling large logit offsets. Sweep 2 re-reads both rows and
/// writes the gradient, which needs both final LSEs, so it cannot be folded
/// into sweep 1. A row used by several pairs accumulates its gradient in an
/// f64 row and is converted to `T` once.
///
/// Infinities: a teacher entry of `−inf` (`p_t = 0`) adds exactly 0; a
/// student `−inf` where the teacher has mass makes that pair's KL `+inf` (the
/// true value), while its gradient stays finite (`p_s = 0` there).
///
/// Errors: `vocab == 0` or logits not a whole number of rows; `weights` not
/// one per pair, non-finite or negative; `temperature` non-finite or `<= 0`;
/// a pair naming a row out of range; a used row containing NaN or `+inf`,
/// entirely `−inf`, or overflowing f64 once divided by `τ`. When several pairs are bad, the lowest pair index is
/// reported.
///
/// The gradient goes to the caller's `grad` (validated by [`SdccCall`]):
/// every element is written; rows no pair names, and the rows of pairs
/// weighted 0, are 0.
pub(crate) fn sdcc_forward_kl<T: CpuFloat>(
    call: SdccCall<'_, '_, Host, T, T>,
    threads: usize,
) -> Result<SdccLoss> {
    let (args, grad) = call.into_parts();
    let (student, teacher, vocab) = (args.student(), args.teacher(), args.vocab());
    let (pairs, weights) = (args.pairs(), args.weights());
    let temperature = args.temperature();

    // Pairs grouped by student row (stable: pair order within a row), so
    // that each work item owns one gradient row.
    let mut order: Vec<usize> = (0..pairs.len()).collect();
    order.sort_by_key(|&i| pairs[i].0);
    let mut kl_sorted = vec![0.0f64; pairs.len()];
    let mut work = Vec::new();
    {
        let mut rest_order: &[usize] = &order;
        let mut rest_kl: &mut [f64] = &mut kl_sorted;
        for (row, grad_row) in grad.chunks_mut(vocab).enumerate() {
            let n = rest_order
                .iter()
                .take_while(|&&i| pairs[i].0 as usize == row)
                .count();
            if n == 0 {
                grad_row.fill(T::ZERO);
                continue;
            }
            let (ids, tail) = rest_order.split_at(n);
            let (kls, kl_tail) = std::mem::take(&mut rest_kl).split_at_mut(n);
            rest_order = tail;
            rest_kl = kl_tail;
            work.push(RowItem {
                grad: grad_row,
                pairs: ids,
                kl: kls,
            });
        }
    }
    work.sort_by_key(|w| std::cmp::Reverse(w.pairs.len()));
    if work.is_empty() {
        // No pair: no vocab-sized scratch either (`vocab` may be large).
        return Ok(SdccLoss::from_per_pair(Vec::new(), weights));
    }

    let inv_tau = 1.0 / temperature as f64;
    let first_error: Mutex<Option<(usize, Error)>> = Mutex::new(None);
    run_parallel(
        work,
        threads,
        || vec![0.0f64; vocab],
        |acc, item| {
            let RowItem {
                grad,
                pairs: ids,
                kl,
            } = item;
            let many = ids.len() > 1;
            if many {
                acc.fill(0.0);
            }
            for (&i, kl_out) in ids.iter().zip(kl.iter_mut()) {
                let (s, t) = (pairs[i].0 as usize, pairs[i].1 as usize);
                let s_row = &student[s * vocab..(s + 1) * vocab];
                let t_row = &teacher[t * vocab..(t + 1) * vocab];
                let stats = match row_stats(s_row, t_row, inv_tau, s, t, vocab) {
                    Ok(st) => st,
                    Err(e) => {
                        let mut slot = first_error.lock().unwrap_or_else(|p| p.into_inner());
                        if slot.as_ref().is_none_or(|(j, _)| i < *j) {
                            *slot = Some((i, e));
                        }
                        return;
                    }
                };
                *kl_out = stats.kl;
                let w = weights[i] as f64;
                if w == 0.0 {
                    if !many {
                        grad.fill(T::ZERO);
                    }
                    continue;
                }
                let c = w * inv_tau;
                let terms = s_row.iter().zip(t_row).map(|(&x, &y)| {
                    let p_s = (x.to_f64() * inv_tau - stats.lse_s).exp();
                    let p_t = (y.to_f64() * inv_tau - stats.lse_t).exp();
                    c * (p_s - p_t)
                });
                if many {
                    for (a, g) in acc.iter_mut().zip(terms) {
                        *a += g;
                    }
                } else {
                    for (out, g) in grad.iter_mut().zip(terms) {
                        *out = T::from_f64(g);
                    }
                }
            }
            if many {
                for (out, &a) in grad.iter_mut().zip(acc.iter()) {
                    *out = T::from_f64(a);
                }
            }
        },
    );
    if let Some((_, e)) = first_error.into_inner().unwrap_or_else(|p| p.into_inner()) {
        return Err(e);
    }

    let mut per_pair = vec![0.0f64; pairs.len()];
    for (&i, &kl) in order.iter().zip(&kl_sorted) {
        per_pair[i] = kl;
    }
    Ok(SdccLoss::from_per_pair(per_pair, weights))
}

/// The pairs of one student row and that row's gradient.
struct RowItem<'a, T> {
    grad: &'a mut [T],
    pairs: &'a [usize],
    kl: &'a mut [f64],
}

struct RowStats {
    lse_s: f64,
    lse_t: f64,
    kl: f64,
}

/// Sweep 1 over one (student, teacher) pair of rows: both log-sum-exps of
/// `logits / τ` and the KL, online over chunks of the vocabulary.
fn row_stats<T: CpuFloat>(
    s_row: &[T],
    t_row: &[T],
    inv_tau: f64,
    s: usize,
    t: usize,
    vocab: usize,
) -> Result<RowStats> {
    let ninf = f64::NEG_INFINITY;
    // Teacher a = t/τ, student b = s/τ: running maxima, Σ e^{a−m_a},
    // Σ e^{b−m_b}, the cross term W = Σ e^{a−m_a} ((a−m_a) − (b−m_b)) and
    // whether the teacher has mass where the student is −inf.
    let (mut m_a, mut z_a, mut m_b, mut z_b, mut w) = (ninf, 0.0f64, ninf, 0.0f64, 0.0f64);
    let mut infinite = false;
    for (c, (sc, tc)) in s_row.chunks(CHUNK).zip(t_row.chunks(CHUNK)).enumerate() {
        let (mut max_a, mut max_b) = (ninf, ninf);
        for (j, (&x, &y)) in sc.iter().zip(tc).enumerate() {
            let (x, y) = (x.to_f64(), y.to_f64());
            if x.is_nan() || x == f64::INFINITY {
                return Err(bad_logit("student", s, vocab, c * CHUNK + j));
            }
            if y.is_nan() || y == f64::INFINITY {
                return Err(bad_logit("teacher", t, vocab, c * CHUNK + j));
            }
            max_a = max_a.max(y);
            max_b = max_b.max(x);
        }
        let (new_a, new_b) = (m_a.max(max_a * inv_tau), m_b.max(max_b * inv_tau));
        if new_a == f64::INFINITY || new_b == f64::INFINITY {
            let (what, row) = if new_a == f64::INFINITY {
                ("teacher", t)
            } else {
                ("student", s)
            };
            return Err(Error::NonFinite {
                what: format!(
                    "SDCC {what} logits row {row} divided by the temperature (overflows f64)"
                ),
                index: row * vocab + c * CHUNK,
            });
        }
        if z_a > 0.0 {
            let alpha = (m_a - new_a).exp();
            if !infinite {
                // Re-center the cross term on the new maxima (Z_a of the old terms).
                w = (w + ((m_a - m_b) - (new_a - new_b)) * z_a) * alpha;
            }
            z_a *= alpha;
        }
        if z_b > 0.0 {
            z_b *= (m_b - new_b).exp();
        }
        m_a = new_a;
        m_b = new_b;
        for (&x, &y) in sc.iter().zip(tc) {
            let (b, a) = (x.to_f64() * inv_tau, y.to_f64() * inv_tau);
            if b > ninf {
                z_b += (b - m_b).exp();
            }
            if a > ninf {
                let e = (a - m_a).exp();
                z_a += e;
                if b == ninf {
                    infinite = true;
                } else if !infinite {
                    w += e * ((a - m_a) - (b - m_b));
                }
            }
        }
    }
    if z_a == 0.0 {
        return Err(Error::NonFinite {
            what: format!("SDCC teacher logits row {t} (entirely −inf: no distribution)"),
            index: t * vocab,
        });
    }
    if z_b == 0.0 {
        return Err(Error::NonFinite {
            what: format!("SDCC student logits row {s} (entirely −inf: no distribution)"),
            index: s * vocab,
        });
    }
    let kl = if infinite {
        f64::INFINITY
    } else {
        w / z_a - z_a.ln() + z_b.ln()
    };
    Ok(RowStats {
        lse_s: m_b + z_b.ln(),
        lse_t: m_a + z_a.ln(),
        kl,
    })
}

fn bad_logit(what: &str, row: usize, vocab: usize, col: usize) -> Error {
    Error::NonFinite {
        what: format!("SDCC {what} logits row {row}, column {col} (NaN or +inf)"),
        index: row * vocab + col,
    }
}
