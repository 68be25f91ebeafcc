//! The LogitTree baseline (DESIGN §1, §4) and entry-by-entry comparison of
//! layouts.
//!
//! LogitTree runs each of the K+1 root-to-leaf branches of a conditioning
//! tree as its own causal sequence ([`treeattn::tree::Tree::logittree_packs`]);
//! every target is scored on exactly one branch, and the parameter gradient
//! is the sum of the per-branch gradients. The same functions run a single
//! pack (trie, replicated, naive) as one pass, so every method yields results
//! in the same form:
//!
//! - [`run_model`]: the tiny transformer over one or more packs → per-entry
//!   log-probs in canonical `(rollout, call, offset)` order and the summed
//!   gradient of `J = Σ_e weight_e · log p_e`;
//! - [`run_attention`]: plain attention over one or more packs → the output
//!   row `O[row_e]` of every entry in canonical order and, per pack, dQ, dK,
//!   dV of the probe objective `Σ_e ⟨g_e, O[row_e]⟩`;
//! - [`compare_entries`]: two methods' per-entry values matched by
//!   `(rollout, call, offset)`.

use std::collections::HashSet;

use crate::model::{Model, Params};
use treeattn::backend::cpu::CpuFloat;
use treeattn::backend::AttnParams;
use treeattn::backend::{AttentionBackend, AttnArgs, AttnGrads, Host, HostAttention};
use treeattn::pack::{LossEntry, Pack};
use treeattn::{Error, Result};

/// Merges the entries of separate passes into canonical order. Returns, for
/// each pass, the canonical index of each of its entries. A key scored by two
/// passes is an error: LogitTree scores every target on one branch only.
fn canonical_order(packs: &[Pack]) -> Result<(Vec<LossEntry>, Vec<Vec<usize>>)> {
    let mut all: Vec<(LossEntry, usize, usize)> = Vec::new();
    for (p, pack) in packs.iter().enumerate() {
        all.extend(pack.loss.iter().enumerate().map(|(i, e)| (*e, p, i)));
    }
    all.sort_by_key(|(e, p, i)| (e.key(), *p, *i));
    let mut slots: Vec<Vec<usize>> = packs.iter().map(|p| vec![0; p.loss.len()]).collect();
    if let Some(w) = all.windows(2).find(|w| w[0].0.key() == w[1].0.key()) {
        return Err(Error::Pack(format!(
            "loss entry (rollout, call, offset) = {:?} is scored by pass {} and by pass {}",
            w[0].0.key(),
            w[0].1,
            w[1].1
        )));
    }
    for (c, &(_, p, i)) in all.iter().enumerate() {
        slots[p][i] = c;
    }
    Ok((all.into_iter().map(|(e, _, _)| e).collect(), slots))
}

/// The tiny model run over one or more packs as separate passes.
#[derive(Clone, Debug)]
pub struct ModelRun<T> {
    /// Every pass's loss entries in canonical `(rollout, call, offset)` order;
    /// `row` refers to the pack the entry came from.
    pub entries: Vec<LossEntry>,
    /// `log p(label_e | row_e)` per entry, same order.
    pub logprobs: Vec<T>,
    /// `Σ_passes ∂J/∂θ`, `J = Σ_e weight_e · log p_e` (see [`crate::model`]).
    pub grads: Params<T>,
    /// Number of passes (K+1 for LogitTree, 1 for a single pack).
    pub passes: usize,
    /// Tokens processed, summed over passes.
    pub tokens: usize,
    /// Visible (query, key) pairs per head and layer, summed over passes.
    pub visible_pairs: u64,
}

/// Runs `model` forward and backward on each pack as its own pass: LogitTree
/// when `packs` is [`treeattn::tree::Tree::logittree_packs`], one pass for a
/// single pack. Entries are merged into canonical order and the gradients
/// summed.
pub fn run_model<T: CpuFloat, A: AttentionBackend<T, Memory = Host, Lse = T>>(
    model: &Model<T, A>,
    packs: &[Pack],
) -> Result<ModelRun<T>> {
    let (entries, slots) = canonical_order(packs)?;
    let mut logprobs = vec![T::ZERO; entries.len()];
    let mut grads = Params::zeros(model.config());
    let (mut tokens, mut visible_pairs) = (0, 0);
    for (pack, slot) in packs.iter().zip(&slots) {
        let fwd = model.forward_pack(pack)?;
        for (&lp, &c) in fwd.logprobs.iter().zip(slot) {
            logprobs[c] = lp;
        }
        grads.add_assign(&model.backward(&fwd)?)?;
        tokens += pack.len();
        visible_pairs += pack.mask()?.visible_pairs();
    }
    Ok(ModelRun {
        entries,
        logprobs,
        grads,
        passes: packs.len(),
        tokens,
        visible_pairs,
    })
}

/// Attention inputs of one pack in the varlen layout of [`treeattn::backend`]:
/// Q `[tokens, q_heads, head_dim]`, K and V `[tokens, kv_heads, head_dim]`.
#[derive(Clone, Copy, Debug)]
pub struct AttnInputs<'a, T> {
    /// Queries, `[tokens, q_heads, head_dim]`.
    pub q: &'a [T],
    /// Keys, `[tokens, kv_heads, head_dim]`.
    pub k: &'a [T],
    /// Values, `[tokens, kv_heads, head_dim]`.
    pub v: &'a [T],
    /// Sizes of the pass.
    pub shape: treeattn::backend::AttnShape,
}

/// Plain attention run over one or more packs as separate passes.
pub struct AttnRun<T> {
    /// Every pass's loss entries in canonical order.
    pub entries: Vec<LossEntry>,
    /// `O[row_e]` per entry, `[entries, q_heads, head_dim]`, same order.
    pub outputs: Vec<T>,
    /// Per pass, in the order of `packs`: dQ, dK, dV of the probe objective
    /// `Σ_e ⟨g_e, O[row_e]⟩`.
    pub grads: Vec<AttnGrads<T>>,
}

/// Runs attention forward on each pack with its inputs, gathers the output
/// row of every loss entry, and runs backward with `dO[r] = Σ_{e: row_e = r}
/// g_e`, where `cotangent` holds `g_e` (`q_heads · head_dim` values) per
/// entry in canonical order of all packs' entries.
pub fn run_attention<T: CpuFloat, A: AttentionBackend<T, Memory = Host, Lse = T>>(
    attention: &A,
    packs: &[Pack],
    inputs: &[AttnInputs<'_, T>],
    params: &AttnParams,
    cotangent: &[T],
) -> Result<AttnRun<T>> {
    if inputs.len() != packs.len() {
        return Err(Error::Shape(format!(
            "{} packs but attention inputs for {}",
            packs.len(),
            inputs.len()
        )));
    }
    let widths: HashSet<usize> = inputs
        .iter()
        .map(|x| x.shape.q_heads * x.shape.head_dim)
        .collect();
    if widths.len() > 1 {
        return Err(Error::Shape(format!(
            "passes disagree on q_heads · head_dim: {widths:?}"
        )));
    }
    let width = widths.into_iter().next().unwrap_or(0);
    let (entries, slots) = canonical_order(packs)?;
    if cotangent.len() != entries.len() * width {
        return Err(Error::Shape(format!(
            "cotangent has {} values, expected {} entries × {width}",
            cotangent.len(),
            entries.len()
        )));
    }
    let mut outputs = vec![T::ZERO; entries.len() * width];
    let mut grads = Vec::with_capacity(packs.len());
    for (p, ((pack, x), slot)) in packs.iter().zip(inputs).zip(&slots).enumerate() {
        pack.validate()?;
        let shape = x.shape;
        if shape.tokens != pack.len() {
            return Err(Error::Shape(format!(
                "pass {p}: inputs for {} tokens, pack of {}",
                shape.tokens,
                pack.len()
            )));
        }
        let args = AttnArgs::new(x.q, x.k, x.v, shape, pack.mask()?, *params)
            .map_err(|e| Error::Shape(format!("pass {p}: {e}")))?;
        let out = attention.forward_owned(&args)?;
        let mut d_o = vec![T::ZERO; shape.q_len()];
        for (e, &c) in pack.loss.iter().zip(slot) {
            let row = e.row as usize * width..(e.row as usize + 1) * width;
            outputs[c * width..(c + 1) * width].copy_from_slice(&out.o[row.clone()]);
            for (d, &g) in d_o[row]
                .iter_mut()
                .zip(&cotangent[c * width..(c + 1) * width])
            {
                *d += g;
            }
        }
        grads.push(attention.backward_owned(&args, out.saved(), &d_o)?);
    }
    Ok(AttnRun {
        entries,
        outputs,
        grads,
    })
}

/// Two methods' per-entry values compared on the entries both score.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EntryDiff {
    /// Entries scored by both.
    pub compared: usize,
    /// Entries only the first (second) method scores.
    pub only_first: usize,
    /// Entries only the second method scores.
    pub only_second: usize,
    /// Largest and mean `|a − b|` over all compared values.
    pub max_abs: f64,
    /// Mean `|a − b|` over all compared values.
    pub mean_abs: f64,
    /// Largest `|a|` or `|b|` among the compared values (the scale that
    /// `max_abs` is relative to).
    pub scale: f64,
}

/// Matches two methods' entries by `(rollout, call, offset)` (both lists in
/// canonical order, as every pack and every run keeps them) and compares
/// their `width` values per entry.
pub fn compare_entries<T: CpuFloat>(
    first: &[LossEntry],
    first_values: &[T],
    second: &[LossEntry],
    second_values: &[T],
    width: usize,
) -> Result<EntryDiff> {
    for (name, e, v) in [
        ("first", first, first_values),
        ("second", second, second_values),
    ] {
        if v.len() != e.len() * width {
            return Err(Error::Shape(format!(
                "{name} method: {} values for {} entries × {width}",
                v.len(),
                e.len()
            )));
        }
        if let Some(i) = (1..e.len()).find(|&i| e[i - 1].key() >= e[i].key()) {
            return Err(Error::Pack(format!(
                "{name} method: entry {i} key {:?} is not after {:?} (entries must be in canonical order)",
                e[i].key(),
                e[i - 1].key()
            )));
        }
    }
    let mut diff = EntryDiff {
        compared: 0,
        only_first: 0,
        only_second: 0,
        max_abs: 0.0,
        mean_abs: 0.0,
        scale: 0.0,
    };
    let (mut i, mut j, mut sum) = (0, 0, 0.0);
    while i < first.len() || j < second.len() {
        let order = match (first.get(i), second.get(j)) {
            (Some(a), Some(b)) => a.key().cmp(&b.key()),
            (Some(_), None) => std::cmp::Ordering::Less,
            _ => std::cmp::Ordering::Greater,
        };
        match order {
            std::cmp::Ordering::Less => {
                diff.only_first += 1;
                i += 1;
            }
            std::cmp::Ordering::Greater => {
                diff.only_second += 1;
                j += 1;
            }
            std::cmp::Ordering::Equal => {
                let a = &first_values[i * width..(i + 1) * width];
                let b = &second_values[j * width..(j + 1) * width];
                for (&x, &y) in a.iter().zip(b) {
                    let (x, y) = (x.to_f64(), y.to_f64());
                    let d = (x - y).abs();
                    diff.max_abs = diff.max_abs.max(d);
                    diff.scale = diff.scale.max(x.abs()).max(y.abs());
                    sum += d;
                }
                diff.compared += 1;
                i += 1;
                j += 1;
            }
        }
    }
    if diff.compared > 0 && width > 0 {
        diff.mean_abs = sum / (diff.compared * width) as f64;
    }
    Ok(diff)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(rollout: u32, call: u32, offset: u32, row: u32) -> LossEntry {
        LossEntry {
            row,
            label: 0,
            weight: 1.0,
            rollout,
            call,
            offset,
            segment: 0,
            logprob: None,
        }
    }

    fn pack(loss: Vec<LossEntry>) -> Pack {
        Pack {
            tokens: vec![0; 4],
            position_ids: (0..4).collect(),
            kv_end: vec![4; 4],
            loss,
        }
    }

    #[test]
    fn passes_merge_into_canonical_order() {
        let a = pack(vec![entry(0, 0, 1, 1), entry(1, 0, 0, 2)]);
        let b = pack(vec![entry(0, 0, 0, 0), entry(0, 2, 0, 3)]);
        let (entries, slots) = canonical_order(&[a, b]).unwrap();
        let keys: Vec<_> = entries.iter().map(LossEntry::key).collect();
        assert_eq!(keys, [(0, 0, 0), (0, 0, 1), (0, 2, 0), (1, 0, 0)]);
        assert_eq!(slots, [vec![1, 3], vec![0, 2]]);
    }

    #[test]
    fn a_target_scored_by_two_passes_is_an_error() {
        let a = pack(vec![entry(0, 1, 0, 1)]);
        let b = pack(vec![entry(0, 1, 0, 2)]);
        let err = canonical_order(&[a, b]).unwrap_err();
        assert!(err.to_string().contains("(0, 1, 0)"), "{err}");
    }

    #[test]
    fn comparison_matches_by_key_and_counts_the_rest() {
        let first = [entry(0, 0, 0, 0), entry(0, 0, 1, 0), entry(0, 1, 0, 0)];
        let second = [entry(0, 0, 1, 5), entry(0, 1, 0, 6), entry(0, 2, 0, 7)];
        let d = compare_entries(&first, &[1.0f64, 2.0, 3.0], &second, &[2.5, 2.0, 9.0], 1).unwrap();
        assert_eq!((d.compared, d.only_first, d.only_second), (2, 1, 1));
        assert_eq!((d.max_abs, d.mean_abs, d.scale), (1.0, 0.75, 3.0));
        let unsorted = [entry(0, 1, 0, 0), entry(0, 0, 0, 0)];
        assert!(compare_entries(&unsorted, &[0.0f64; 2], &second, &[0.0; 3], 1).is_err());
        assert!(compare_entries(&first, &[0.0f64; 2], &second, &[0.0; 3], 1).is_err());
    }
}
