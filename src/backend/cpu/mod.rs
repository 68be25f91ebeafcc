//! The CPU reference backend: tree attention (forward and backward, GQA,
//! optional fused rotary) and the fused SDCC forward-KL, on plain slices.
//!
//! Everything here takes flat row-major slices and explicit shapes so that it
//! can be exposed through a C ABI; [`crate::ops`] is the convenient front over
//! `ndarray` views.
//!
//! # Attention
//!
//! Per query head `h` (reading kv head `h / (q_heads / kv_heads)`), with the
//! interval mask `k <= q < kv_end[k]` of [`PackMask`](crate::mask::PackMask):
//!
//! ```text
//! S = scale · Q Kᵀ (masked entries = −inf)   P = softmax(S) row-wise
//! O = P V                                     LSE = ln Σ_k exp(S)
//! ```
//!
//! and backward `D = rowsum(dO ∘ O)`, `dP = dO Vᵀ`, `dS = P ∘ (dP − D)`,
//! `dQ = scale · dS K`, `dK = scale · dSᵀ Q`, `dV = Pᵀ dO` (dK, dV summed over
//! the query heads of a group). A query row with no visible key (only possible
//! with padding keys, `kv_end[k] == k`) gets `O = 0`, `LSE = −inf`, `dQ = 0`
//! and contributes nothing to dK, dV.
//!
//! The computation is tiled FlashAttention-style in [`TILE`]` × `[`TILE`]
//! blocks and never holds an `L × L` matrix: memory is linear in `L` (the
//! inputs are copied once into head-major, zero-padded layouts of the
//! compute type — `bf16` and `f16` inputs widened to `f32` there — plus a few
//! tiles of scratch per thread, which also hold each work item's output
//! rows until they are stored into the caller's token-major result; the
//! forward's Q rows go straight into the scratch of the one item that reads
//! them). Each (query tile, key tile) pair is
//! classified from the per-key-tile min/max of `kv_end` (DESIGN §5):
//! [`TileClass::Skip`] tiles are not computed, [`TileClass::Full`] tiles need
//! no per-element mask, [`TileClass::Partial`] tiles are computed by register
//! blocks of [`BLOCK_QUERIES`] × [`BLOCK_KEYS`] classified the same way from
//! per-block min/max of `kv_end`: blocks with no visible entry are neither
//! computed nor read (their probabilities are 0), blocks with only visible
//! entries are not masked, the rest are masked element-wise
//! ([`block_counts`] reports the census). So on a tree the work follows the
//! visible pairs at the micro-kernel's granularity, not the tile's. Partial
//! tiles that a query tile's rows see or ignore by whole columns (a run of
//! ancestors, such as a shared prompt, starting or ending inside them) are
//! not visited one by one: their seen keys are gathered into chunks of
//! [`TILE`] keys computed like full tiles ([`gather_counts`]; see the
//! `gather` module).
//!
//! The head-major copies come from a bounded process-wide pool of buffers
//! reused across calls (at most 32 buffers and 1 GiB kept, oldest freed
//! first), so repeated calls do not fault in fresh pages. Calls write
//! every element of the caller's outputs (the contract's
//! [`AttentionBackend::forward`], [`AttentionBackend::backward`]), which a
//! training loop reuses across steps, saving the page faults of fresh
//! outputs at every call; [`crate::backend::HostAttention`] allocates them
//! instead.
//!
//! Forward runs one work item per (query head, query tile) with an online
//! softmax. Backward runs one kv head (with its query heads) at a time, so
//! that the copies its items read (Q and dO rows, K rows and columns, V
//! columns: 5 arrays of `lpad · dp` per head, 12 MB for all 4 heads of the
//! bench at 2.3k tokens, 3 MB for one) stay in cache between being written
//! and being read: its inputs are copied, then two deterministic kinds of
//! work item run, step by step (a step: a chunk of query tiles for a
//! slice of the query heads): one per key tile
//! accumulates dK, dV over the step's query tiles that can see the key
//! tile (in the contiguous range from the tile's first key to its largest
//! `kv_end`), computing each block's `S`, `dP`, `P` and `dS` once (with
//! query rows and key columns, then multiplying by their transpose, so the
//! copies need no transposed Q or dO) and leaving `dS` in a store of at
//! most 4 MiB (unless one query tile of one head needs more); then one per
//! (query head, query tile) accumulates
//! `dQ = scale · dS K` from that store. Every output element is accumulated
//! by one item in a fixed order and the steps depend on the mask alone
//! (the only atomics are the items' non-finite flags), so results do not
//! depend on the thread count.
//!
//! Work is spread over [`num_threads`] threads, the caller and workers
//! started once per process and parked between calls (a call that finds
//! them busy, from another thread, uses scoped threads): a forward call has
//! two parallel steps (the K, V copies, the query tiles), a backward call
//! per kv head one for its input copies (which also compute `D`), one per
//! step (its dK, dV items beside the previous step's dQ items) and a last
//! one (the last step's dQ items, beside those storing dK, dV). Each work item stores its finished rows (`O`; or `dK`,
//! `dV`; or `dQ`, rotated back when rotary is on) straight into the
//! caller's token-major output, disjoint rows per item (prefetched for
//! writing when the item starts). On x86-64 CPUs with
//! AVX2 and FMA (detected at run time) the work items run a copy compiled
//! for those features, whose `f32` row-softmax steps (masking, `exp`, lane
//! maxima and sums, one strip of 8 keys at a time) are written with AVX2
//! intrinsics; with AVX-512 (F, VL, BW, DQ) a copy compiled for it, with
//! wider register blocks on fully live tiles and the same bits as the AVX2
//! copy (with AVX-512 BF16 too, [`Isa::Avx512Bf16`], `bf16` inputs' block
//! products run on bf16 pairs, P and dS rounded to bf16 as on the GPU: the
//! `pairs` module);
//! elsewhere, or
//! with `TREEATTN_PORTABLE=1` ([`isa`], [`uses_avx2_fma`]; `TREEATTN_ISA`
//! chooses), the portable copy of the same code, whose softmax
//! steps give the same bits and whose matmuls differ only by the rounding
//! of fused multiply-adds. `f32` exponentials use a polynomial within 2 ulp; `f64` uses
//! `f64::exp`. A NaN or infinity in a result (scores overflowing `T`,
//! or non-finite inputs when `check_finite` is off) is reported as
//! [`Error::NonFinite`](crate::Error::NonFinite), never returned: each work item checks the rows it
//! stores, and only when one reports a bad value is the output scanned for
//! the first bad index.
//!
//! # Files
//!
//! `attention_fwd`, `attention_bwd` and `sdcc` are the calls; `bounds` the
//! per-tile `kv_end` bounds and the tile and register-block classification;
//! `gather` the key gathering; `microkernel` the register-blocked block
//! products and `lanes` the row-softmax steps (portable and AVX2);
//! `pairs` the bf16 pair copies and their `vdpbf16ps` block products;
//! `operands` the head-major operand copies and the rotary table;
//! `workspace` the buffer pool; `pool` the worker threads and
//! [`num_threads`]; `census` the reports ([`tile_counts`] and friends);
//! `checks` the input checks; `float` [`CpuFloat`], [`CpuElement`].

mod attention_bwd;
mod attention_fwd;
mod bounds;
mod census;
mod checks;
mod float;
mod gather;
mod lanes;
mod microkernel;
mod operands;
mod pairs;
mod pool;
mod sdcc;
mod value_dim;
mod workspace;

pub use crate::mask::TileClass;
pub use bounds::KeyTileBounds;
pub use census::{
    block_counts, computed_entries, gather_counts, tile_counts, BlockCounts, GatherCounts,
    TileCounts, BLOCK_KEYS, BLOCK_QUERIES,
};
pub use float::{CpuElement, CpuFloat};
pub use pool::{num_threads, run_parallel, set_default_threads};

pub(crate) use bounds::BlockMasks;
pub(crate) use checks::check_result;

use super::{AttentionBackend, BackwardCall, ForwardCall, Host, SdccBackend, SdccCall, SdccLoss};
use crate::Result;

/// The first visible key of each query row, when the call bounds them: a
/// sliding window's ([`crate::mask::PackMask::window_starts`]) or the
/// call's explicit key starts.
fn key_starts<S: CpuElement>(args: &super::AttnArgs<'_, Host, S>) -> Result<Option<Vec<u32>>> {
    Ok(match (args.params().window, args.key_starts()) {
        (Some(w), _) => Some(args.mask().window_starts(w)?),
        (None, Some(starts)) => Some(starts.to_vec()),
        (None, None) => None,
    })
}

/// Side of the square (query tile × key tile) blocks the CPU backend
/// computes and classifies.
pub const TILE: usize = 64;

/// The CPU backend: tree attention and the SDCC forward KL on host memory,
/// on [`Cpu::threads`] threads. It implements the crate's contract
/// ([`AttentionBackend`] for every [`CpuElement`]: `f32`, `f64`, and `bf16`,
/// `f16` computed in `f32`; gradients in the input type, the LSE in the
/// compute type; [`SdccBackend`] for `f32`, `f64`).
///
/// ```
/// use treeattn::backend::cpu::Cpu;
/// assert_eq!(Cpu::with_threads(3).threads(), 3);
/// assert!(Cpu::default().threads() >= 1);
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Cpu {
    threads: Option<usize>,
}

impl Cpu {
    /// A backend that runs on `threads` threads (at least 1): the caller's
    /// and `threads − 1` pooled workers. Use it to share the machine with a
    /// host's own thread pool (rayon, OpenMP): the pool's workers are parked
    /// (blocked, not spinning) between calls.
    pub fn with_threads(threads: usize) -> Cpu {
        Cpu {
            threads: Some(threads.max(1)),
        }
    }
    /// The thread count calls run on: the one given to
    /// [`Cpu::with_threads`], else [`num_threads`] (the process-wide
    /// [`set_default_threads`], else the `TREEATTN_THREADS` environment
    /// variable, else the machine's cores), read at every call.
    pub fn threads(&self) -> usize {
        self.threads.unwrap_or_else(num_threads)
    }
}

impl<S: CpuElement> AttentionBackend<S> for Cpu {
    type Memory = Host;
    type Lse = S::Compute;
    fn run_forward(&self, call: ForwardCall<'_, '_, Host, S, S::Compute>) -> Result<()> {
        if call.args().shape().square() {
            attention_fwd::forward(call, self.threads())
        } else {
            value_dim::forward(call, self.threads())
        }
    }
    fn run_backward(&self, call: BackwardCall<'_, '_, '_, Host, S, S::Compute>) -> Result<()> {
        if call.args().shape().square() {
            attention_bwd::backward(call, self.threads())
        } else {
            value_dim::backward(call, self.threads())
        }
    }
}

impl<T: CpuFloat> SdccBackend<T> for Cpu {
    type Memory = Host;
    type Grad = T;
    fn run_sdcc(&self, call: SdccCall<'_, '_, Host, T, T>) -> Result<SdccLoss> {
        sdcc::sdcc_forward_kl(call, self.threads())
    }
}

/// Whether the CPU backend's work items run one of their SIMD copies
/// (AVX-512 or AVX2, both with FMA and the AVX2 row softmax): true on x86-64
/// CPUs that have AVX2 and FMA, unless the environment variable
/// `TREEATTN_PORTABLE` is `1` (or `TREEATTN_ISA` is `portable`) when the
/// process first asks (then, as on every other CPU, the portable copy of the
/// same code runs: the same results up to the rounding of fused
/// multiply-adds). [`isa`] says which copy.
pub fn uses_avx2_fma() -> bool {
    microkernel::has_avx2_fma()
}

/// The code paths of the CPU backend's work items, in order of the
/// features they need.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Isa {
    /// Plain Rust, compiled for the target's baseline.
    Portable,
    /// Compiled for AVX2 and FMA (8-lane `f32` registers).
    Avx2Fma,
    /// Compiled for AVX-512 F, VL, BW, DQ (with AVX2 and FMA): the same
    /// code as [`Isa::Avx2Fma`] with 16-lane registers, so the same bits.
    Avx512,
    /// [`Isa::Avx512`], and on CPUs with AVX-512 BF16, `bf16` inputs' five
    /// block products by `vdpbf16ps` on bf16 pairs (32 products per
    /// instruction): the same bits as [`Isa::Avx512`] for every other input
    /// type; for bf16, scores summed in another order, rotated q, k rounded
    /// to bf16 before the products, and P, dS rounded to bf16 before
    /// `P V`, `Pᵀ dO`, `dSᵀ Q`, `dS K`, as the GPU kernels round them.
    Avx512Bf16,
}

impl Isa {
    /// `"portable"`, `"avx2+fma"`, `"avx512"` or `"avx512+bf16"`.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Portable => "portable",
            Isa::Avx2Fma => "avx2+fma",
            Isa::Avx512 => "avx512",
            Isa::Avx512Bf16 => "avx512+bf16",
        }
    }
}

/// The code path the CPU backend's work items run, decided when the process
/// first asks: the best the CPU has (AVX-512 F/VL/BW/DQ with BF16, else
/// without, else AVX2 + FMA, else portable), lowered by the environment:
/// `TREEATTN_ISA=avx512`, `TREEATTN_ISA=avx2`, `TREEATTN_ISA=portable` (or
/// `TREEATTN_PORTABLE=1`).
pub fn isa() -> Isa {
    microkernel::isa()
}

/// The best code path the running CPU supports, whatever the environment.
pub fn best_isa() -> Isa {
    microkernel::best_isa()
}

/// Runs later calls on `isa` if the running CPU supports it (returns
/// whether it does; nothing changes when not). For tests and benchmarks
/// that compare the paths in one process: the switch is process-wide, so
/// calls running concurrently on other threads may see either path.
#[doc(hidden)]
pub fn force_isa(isa: Isa) -> bool {
    microkernel::force_isa(isa)
}

/// A test attention shape over a mask where every key is seen by every
/// query: the shape, `kv_end` and position ids.
#[cfg(test)]
pub(crate) fn all_visible_case(
    l: usize,
    q_heads: usize,
    kv_heads: usize,
    head_dim: usize,
) -> (crate::backend::AttnShape, Vec<u32>, Vec<u32>) {
    let shape = crate::backend::AttnShape {
        tokens: l,
        q_heads,
        kv_heads,
        head_dim,
        v_head_dim: head_dim,
    };
    (shape, vec![l as u32; l], (0..l as u32).collect())
}

/// Test values in `[−1, 1)` from a multiplicative hash of the index and a
/// salt: deterministic, varied, the same on every machine.
#[cfg(test)]
pub(crate) fn hashed_values<T: CpuFloat>(n: usize, salt: u64) -> Vec<T> {
    (0..n as u64)
        .map(|i| T::from_f64((((i * 2_654_435_761) ^ salt) % 997) as f64 / 498.0 - 1.0))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{AttnArgs, AttnParams, AttnShape, HostAttention};
    use crate::mask::PackMask;

    /// Each output block is written by one work item in a fixed order, so
    /// results are bit-identical whatever the thread count.
    #[test]
    fn results_do_not_depend_on_the_thread_count() {
        let l = 300;
        let kv_end: Vec<u32> = (0..l as u32)
            .map(|k| {
                if k < 100 {
                    l as u32
                } else if k < 180 {
                    180
                } else {
                    l as u32
                }
            })
            .collect();
        let pos: Vec<u32> = (0..l as u32)
            .map(|k| if k < 180 { k } else { k - 80 })
            .collect();
        let mask = PackMask::new(&kv_end, &pos).unwrap();
        let shape = AttnShape {
            tokens: l,
            q_heads: 4,
            kv_heads: 2,
            head_dim: 40,
            v_head_dim: 40,
        };
        let mut params = AttnParams::new(40);
        params.rope = Some(super::super::Rope {
            base: 500.0,
            dims: 40,
        });
        let data = |n: usize, salt: u64| hashed_values::<f32>(n, salt);
        let (q, k, v) = (
            data(shape.q_len(), 1),
            data(shape.kv_len(), 2),
            data(shape.kv_len(), 3),
        );
        let d_o = data(shape.q_len(), 4);
        let run = |threads: usize| {
            let cpu = Cpu::with_threads(threads);
            let args = AttnArgs::new(&q[..], &k[..], &v[..], shape, mask, params).unwrap();
            let f = cpu.forward_owned(&args).unwrap();
            let g = cpu.backward_owned(&args, f.saved(), &d_o).unwrap();
            (f, g)
        };
        let one = run(1);
        for threads in [2, 5] {
            assert!(run(threads) == one, "{threads} threads");
        }
    }
}
