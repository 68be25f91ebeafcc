//! The exact cost of one training step of a decoder on a pack, in FLOPs
//! (forward + backward), for balancing packs across ranks (data parallel)
//! and rows across ranks (context parallel).
//!
//! A pack's attention work is its **visible (query, key) pairs**: under the
//! interval mask (query `q` sees key `k` iff `k <= q < kv_end[k]`) key `k` is
//! seen by the `kv_end[k] − k` queries `k..kv_end[k]`, so
//!
//! ```text
//! pairs = Σ_k (kv_end[k] − k)          (exact, O(L); a padding key, kv_end[k] == k, adds 0)
//! ```
//!
//! Everything else in a decoder layer is per token. With the model's shape
//! ([`ModelCost`]: `layers` N, `hidden` H, `heads` h, `kv_heads` g,
//! `head_dim` d, `intermediate` I, `vocab` V), counting a multiply-add as
//! 2 FLOPs, the **forward** is
//!
//! ```text
//! attention per visible pair   = N · h · 4d            (QKᵀ 2d, PV 2d per query head; DESIGN §7)
//! linear per token             = N · 2 · (H·h·d + 2·H·g·d + h·d·H + 3·H·I)
//!                                 (q, k, v, o projections; gated MLP: gate, up, down)
//! lm_head per logit row        = 2 · H · V
//! ```
//!
//! and the **backward** is 2.5× the forward for attention (FlashAttention's
//! count, DESIGN §7: dQ, dK, dV, dP and the recomputed S) and 2× for the
//! matrix products (the gradients of the input and of the weight). So, for a
//! step (forward + backward):
//!
//! ```text
//! attention = pairs · N · h · 4d · 3.5
//! linear    = (tokens · N · 2 · (2·H·h·d + 2·H·g·d + 3·H·I) + logit_rows · 2·H·V) · 3
//! total     = attention + linear
//! ```
//!
//! `logit_rows` counts the distinct rows whose logits a loss needs (the
//! loss rows, a row predicting several children counted once); the
//! lm_head is applied at those rows only (`logits_to_keep`). Norms,
//! rotary, softmax and activation functions are elementwise and left out
//! (under 1 % at the shapes of interest); so is the embedding lookup.

use crate::{Error, Result};

/// The shape of a decoder, as far as its FLOPs go (a Llama / Qwen / Mistral
/// style layer: q, k, v, o projections with GQA, a gated MLP, an lm_head).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ModelCost {
    /// Decoder layers N.
    pub layers: u64,
    /// Hidden size H.
    pub hidden: u64,
    /// Query heads h.
    pub heads: u64,
    /// Key / value heads g (GQA; `g == h` without it).
    pub kv_heads: u64,
    /// Head dimension d.
    pub head_dim: u64,
    /// MLP intermediate size I (gated MLP: three H × I matrices).
    pub intermediate: u64,
    /// Vocabulary size V (the lm_head is H × V).
    pub vocab: u64,
}

/// The cost of one pack for one model, forward + backward, in FLOPs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PackCost {
    /// Visible (query, key) pairs, `Σ_k (kv_end[k] − k)`.
    pub visible_pairs: u64,
    /// Tokens L.
    pub tokens: u64,
    /// Distinct rows whose logits a loss needs.
    pub logit_rows: u64,
    /// `visible_pairs · attention_per_pair`.
    pub attention: f64,
    /// `tokens · linear_per_token + logit_rows · logits_per_row`.
    pub linear: f64,
    /// `attention + linear`.
    pub total: f64,
}

/// Backward / forward FLOP ratio of attention (DESIGN §7).
pub const ATTENTION_BACKWARD: f64 = 2.5;
/// Backward / forward FLOP ratio of a matrix product (input and weight
/// gradients).
pub const LINEAR_BACKWARD: f64 = 2.0;

impl ModelCost {
    /// Llama-3-8B's shape (32 layers, hidden 4096, 32 / 8 heads of 128,
    /// intermediate 14,336, vocabulary 128,256): the default weighting when a
    /// caller gives no model.
    pub const LLAMA3_8B: ModelCost = ModelCost {
        layers: 32,
        hidden: 4096,
        heads: 32,
        kv_heads: 8,
        head_dim: 128,
        intermediate: 14336,
        vocab: 128_256,
    };

    /// Checks that every dimension is positive and that `kv_heads` divides
    /// `heads`.
    pub fn validate(&self) -> Result<()> {
        let dims = [
            ("layers", self.layers),
            ("hidden", self.hidden),
            ("heads", self.heads),
            ("kv_heads", self.kv_heads),
            ("head_dim", self.head_dim),
            ("intermediate", self.intermediate),
            ("vocab", self.vocab),
        ];
        for (name, v) in dims {
            if v == 0 {
                return Err(Error::Usage(format!("ModelCost.{name} must be positive")));
            }
        }
        if !self.heads.is_multiple_of(self.kv_heads) {
            return Err(Error::Usage(format!(
                "ModelCost.kv_heads = {} does not divide heads = {}",
                self.kv_heads, self.heads
            )));
        }
        // The per-pair, per-token and per-row counts are u64 products.
        let (h, d, hidden) = (self.heads, self.head_dim, self.hidden);
        let fits = (|| {
            self.layers.checked_mul(h)?.checked_mul(4)?.checked_mul(d)?;
            let qo = hidden.checked_mul(h)?.checked_mul(d)?.checked_mul(2)?;
            let kv = hidden
                .checked_mul(self.kv_heads)?
                .checked_mul(d)?
                .checked_mul(2)?;
            let mlp = hidden.checked_mul(self.intermediate)?.checked_mul(3)?;
            let per_layer = qo.checked_add(kv)?.checked_add(mlp)?;
            self.layers.checked_mul(2)?.checked_mul(per_layer)?;
            hidden.checked_mul(self.vocab)?.checked_mul(2)
        })();
        if fits.is_none() {
            return Err(Error::Usage(format!(
                "ModelCost {self:?}: its FLOP counts per pair, token or row overflow 64 bits"
            )));
        }
        Ok(())
    }

    /// Forward + backward FLOPs of one visible (query, key) pair over all
    /// layers and query heads: `N · h · 4d · (1 + 2.5)`.
    pub fn attention_per_pair(&self) -> f64 {
        (self.layers * self.heads * 4 * self.head_dim) as f64 * (1.0 + ATTENTION_BACKWARD)
    }

    /// Forward + backward FLOPs of the projections and the MLP for one token
    /// over all layers: `N · 2 · (2·H·h·d + 2·H·g·d + 3·H·I) · (1 + 2)`.
    pub fn linear_per_token(&self) -> f64 {
        let (h, d, hidden) = (self.heads, self.head_dim, self.hidden);
        let per_layer = 2 * hidden * h * d // q and o projections
            + 2 * hidden * self.kv_heads * d // k and v projections
            + 3 * hidden * self.intermediate; // gate, up, down
        (self.layers * 2 * per_layer) as f64 * (1.0 + LINEAR_BACKWARD)
    }

    /// Forward + backward FLOPs of the lm_head at one row: `2·H·V · (1 + 2)`.
    pub fn logits_per_row(&self) -> f64 {
        (2 * self.hidden * self.vocab) as f64 * (1.0 + LINEAR_BACKWARD)
    }

    /// The cost of a step with these counts.
    pub fn cost(&self, visible_pairs: u64, tokens: u64, logit_rows: u64) -> PackCost {
        let attention = visible_pairs as f64 * self.attention_per_pair();
        let linear =
            tokens as f64 * self.linear_per_token() + logit_rows as f64 * self.logits_per_row();
        PackCost {
            visible_pairs,
            tokens,
            logit_rows,
            attention,
            linear,
            total: attention + linear,
        }
    }
}

/// Checks `k <= kv_end[k] <= L` for every key, naming the first that
/// breaks it.
pub fn check_kv_end(kv_end: &[u32]) -> Result<()> {
    visible_pairs(kv_end).map(|_| ())
}

/// `Σ_k (kv_end[k] − k)`: the visible (query, key) pairs of a pack, after
/// checking `k <= kv_end[k] <= L` for every key.
pub fn visible_pairs(kv_end: &[u32]) -> Result<u64> {
    let len = kv_end.len() as u64;
    let mut sum = 0u64;
    for (k, &e) in kv_end.iter().enumerate() {
        let (k, e) = (k as u64, e as u64);
        if e < k || e > len {
            return Err(Error::Pack(format!(
                "kv_end[{k}] = {e} breaks {k} <= kv_end[k] <= L = {len}"
            )));
        }
        sum += e - k;
    }
    Ok(sum)
}

/// Per row `t`, its depth in the tree of `kv_end`: the keys before it whose
/// range holds it, `#{k < t : kv_end[k] > t}` (its ancestors; a pack's
/// position id), in O(L) — [`visible_keys_per_query`] less the row itself
/// where it is not a padding key. Assumes a valid `kv_end` (see
/// [`check_kv_end`]); needs no nesting (crossing ranges count too).
pub fn depths(kv_end: &[u32]) -> Vec<u64> {
    visible_keys_per_query(kv_end)
        .into_iter()
        .zip(kv_end)
        .enumerate()
        .map(|(t, (n, &e))| n - u64::from(e as usize > t))
        .collect()
}

/// Per query row `q`, the keys it sees: `#{k <= q : kv_end[k] > q}`
/// (the summands of [`visible_pairs`] regrouped by query), in O(L) with a
/// difference array. Assumes a valid `kv_end` (see [`visible_pairs`]).
pub fn visible_keys_per_query(kv_end: &[u32]) -> Vec<u64> {
    let len = kv_end.len();
    let mut delta = vec![0i64; len + 1];
    for (k, &e) in kv_end.iter().enumerate() {
        let e = (e as usize).min(len);
        if e > k {
            delta[k] += 1;
            delta[e] -= 1;
        }
    }
    let mut run = 0i64;
    delta[..len]
        .iter()
        .map(|d| {
            run += d;
            run as u64
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;

    /// A random valid `kv_end` of a forest: nested intervals built by a
    /// random pre-order walk, with some padding keys.
    fn random_kv_end(rng: &mut Rng, len: usize) -> Vec<u32> {
        // Parent of each row: a random earlier row whose subtree is still
        // open, or none (a new root); subtree ends follow from the parents.
        let mut parent: Vec<Option<usize>> = vec![None; len];
        let mut open: Vec<usize> = Vec::new();
        for (i, p) in parent.iter_mut().enumerate() {
            let keep = if open.is_empty() {
                0
            } else {
                rng.range(0, open.len())
            };
            open.truncate(keep);
            *p = open.last().copied();
            open.push(i);
        }
        let mut kv_end: Vec<u32> = (1..=len as u32).collect();
        for i in (0..len).rev() {
            if let Some(p) = parent[i] {
                kv_end[p] = kv_end[p].max(kv_end[i]);
            }
        }
        for (k, e) in kv_end.iter_mut().enumerate() {
            if rng.range(0, 9) == 0 {
                *e = k as u32; // a padding key
            }
        }
        kv_end
    }

    #[test]
    fn visible_pairs_match_a_brute_force_count() {
        let mut rng = Rng::new(23);
        for len in [0usize, 1, 2, 5, 17, 64, 200] {
            for _ in 0..20 {
                let kv_end = random_kv_end(&mut rng, len);
                let mut brute = 0u64;
                let mut per_query = vec![0u64; len];
                for (q, count) in per_query.iter_mut().enumerate() {
                    for (k, &e) in kv_end.iter().enumerate() {
                        if k <= q && q < e as usize {
                            brute += 1;
                            *count += 1;
                        }
                    }
                }
                assert_eq!(visible_pairs(&kv_end).unwrap(), brute, "{kv_end:?}");
                assert_eq!(visible_keys_per_query(&kv_end), per_query, "{kv_end:?}");
                let depth: Vec<u64> = (0..len)
                    .map(|t| (0..t).filter(|&k| kv_end[k] as usize > t).count() as u64)
                    .collect();
                assert_eq!(depths(&kv_end), depth, "{kv_end:?}");
            }
        }
    }

    #[test]
    fn bad_kv_end_is_named() {
        let e = visible_pairs(&[4, 1, 2]).unwrap_err().to_string();
        assert!(e.contains("kv_end[0] = 4"), "{e}");
        let e = visible_pairs(&[1, 0]).unwrap_err().to_string();
        assert!(e.contains("kv_end[1] = 0"), "{e}");
    }
}
