//! Benchmarks of DESIGN §7: one exact packed pass against LogitTree's K+1
//! passes, on realistic conditioning trees, plus the SDCC fused forward-KL
//! against its unfused form.
//!
//! # Methods
//!
//! Every tree shape ([`Shape`](crate::gen::Shape)) is packed five ways from the same trie, and
//! each method runs attention on the same per-token inputs (Q, K, V and dO of
//! a row are a fixed function of its token id and position id, like layer-0
//! activations), so the exact methods compute the same numbers:
//!
//! | [`Method`] | what runs | exact |
//! |---|---|---|
//! | `trie` | one pass on the deduplicated trie pack, tiled kernel with tile skipping | yes |
//! | `replicated` | one pass on the branch-replicated pack (the paper's 4D layout) | yes |
//! | `logittree` | K+1 causal passes, one per branch | yes |
//! | `dense-mask` | one pass on the trie pack through an `L × L` boolean mask and `L × L` score matrix ([`dense_attention_forward`]) | yes |
//! | `naive-compressed` | one causal pass on the final call's sequence | no |
//! | `causal` | plain causal attention of the trie pack's length (throughput reference, not a training method) | — |
//!
//! # Counting
//!
//! FLOPs are counted as FlashAttention counts them, but over **visible
//! pairs only**: `4 · head_dim` FLOPs per visible (query, key) pair per query
//! head forward (`2·d` for `Q Kᵀ`, `2·d` for `P V`), and 2.5× that for the
//! backward (`dP = dO Vᵀ`, `dV = Pᵀ dO`, `dQ = dS K`, `dK = dSᵀ Q`, plus the
//! recomputation of `S`), so forward+backward is 3.5× the forward. The
//! dense-mask method is credited with the trie pack's visible pairs — the
//! work that is *useful* — although it computes all `L²` scores; its FLOP/s
//! is therefore an effective rate. Tokens processed (pack length; for
//! LogitTree the sum of branch lengths) stand for the rest of the model:
//! MLPs and projections scale with tokens.
//!
//! # Ratios
//!
//! `time/trie` is a method's median time over the trie pack's, in the same
//! pass (forward, or forward+backward); `tok/trie` and `flop/trie` are the
//! same ratios for tokens and FLOPs. The per-shape summary gives the trie
//! pack's FLOP/s over the causal reference's (the kernel turns FLOP savings
//! into time savings when this is near 1; the target is ≥ 0.9), and the trie
//! pack's cost over Naive-Compressed in tokens and time (the paper's 4D mask
//! costs 1.35×).
//!
//! # Entry points
//!
//! [`quick`] (the `treeattn bench` table), [`costs`] (tokens and pairs
//! without timing, for paper-scale trees), [`sdcc_table`] (SDCC fused
//! against [`sdcc_unfused`]); the criterion benches build [`Case`]s and
//! [`SdccCase`]s directly. Timings report wall and process CPU time
//! ([`measure`]); [`quick`] times the CPU backend through its `_into`
//! variants with output buffers allocated once before the timed runs
//! ([`Case::run_into`]), as a training loop reuses output memory;
//! [`tile_utilization`] and [`forward_balance`] explain the CPU kernel's
//! throughput on a mask.
//!
//! # Files
//!
//! `workloads` (shapes, packs, inputs, [`Case`], [`SdccCase`]), `baselines`
//! (dense mask, unfused SDCC), `timing`, `diagnosis`, `tables` (the
//! comparisons and their printing). The workload sizes are the rollout
//! generators' presets ([`Size`], `bench_scale()` in [`crate::gen`]).

/// The owned results the baselines return, in the contract's types.
pub type AttnOut<T> = treeattn::backend::AttnOut<T, T>;
/// Owned gradients of the baselines.
pub type AttnGrads<T> = treeattn::backend::AttnGrads<T>;
/// Owned SDCC results of the baselines.
pub type SdccOut<T> = treeattn::backend::SdccOut<T>;

/// The mask of a pack the bench built itself (from its own generators, so
/// valid by construction).
fn mask_of(pack: &treeattn::pack::Pack) -> treeattn::mask::PackMask<'_> {
    pack.mask()
        .expect("the bench's generators build packs with a valid kv_end")
}

mod baselines;
mod diagnosis;
mod on_pack;
mod tables;
#[cfg(test)]
mod test_support;
mod timing;
mod workloads;

pub use crate::gen::Size;
pub use baselines::{
    dense_attention_backward, dense_attention_forward, sdcc_unfused, DENSE_MAX_BYTES,
};
pub use diagnosis::{forward_balance, kernel_utilization, tile_utilization};
pub use on_pack::{time_pack, PackBenchOptions, PackTiming, PassTiming};
pub use tables::{
    costs, quick, quick_with, sdcc_table, CostTable, Options, Row, SdccRow, SdccTable, ShapeCosts,
    ShapeInfo, Table,
};
pub use timing::{measure, measure_round_robin, process_cpu_seconds, Timing};
pub use workloads::{
    generate, Case, CaseOutputs, Cost, Method, PackInputs, Pass, SdccCase, Workload, SHAPES,
};
