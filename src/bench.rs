//! Benchmarks of DESIGN §7: one exact packed pass against LogitTree's K+1
//! passes, on realistic conditioning trees, plus the SDCC fused forward-KL
//! against its unfused form.
//!
//! # Methods
//!
//! Every tree shape ([`Shape`]) is packed five ways from the same trie, and
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

use std::fmt;
use std::time::Instant;

use crate::backend::cpu::{
    computed_entries, gather_counts, num_threads, run_parallel, tile_counts, Cpu, CpuFloat,
    GatherCounts, TileCounts, BLOCK_KEYS, BLOCK_QUERIES, TILE,
};
use crate::backend::{
    AttentionBackend, AttnArgs, AttnParams, AttnShape, Grads, Host, HostSdcc, Saved, SdccArgs,
    SdccLoss,
};

/// The owned results the baselines return, in the contract's types.
type AttnOut<T> = crate::backend::AttnOut<T, T>;
type AttnGrads<T> = crate::backend::AttnGrads<T>;
type SdccOut<T> = crate::backend::SdccOut<T>;
use crate::gen::{
    self, CompactionParams, FoldParams, GrpoParams, MemexParams, PlainParams, Rng, Shape,
    StackPopParams,
};
use crate::mask::{dense_mask, PackMask};
use crate::pack::Pack;
use crate::rollout::Rollout;
use crate::tree::Tree;
use crate::{Error, Result};

/// How large the generated rollouts are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Size {
    /// The generators' CPU-sized defaults (hundreds of tokens): for tests.
    Small,
    /// Trie packs of roughly 1–2k tokens: what the CPU benchmarks run on.
    Bench,
    /// The generators' `paper_scale()` sizes (windows up to 80k): for GPUs.
    Paper,
}

impl Size {
    /// `"small"`, `"bench"` or `"paper"`.
    pub fn name(self) -> &'static str {
        match self {
            Size::Small => "small",
            Size::Bench => "bench",
            Size::Paper => "paper",
        }
    }

    /// Parses a command-line name.
    pub fn parse(s: &str) -> Result<Size> {
        [Size::Small, Size::Bench, Size::Paper]
            .into_iter()
            .find(|x| x.name() == s)
            .ok_or_else(|| {
                Error::Usage(format!(
                    "unknown size {s:?}; expected small, bench or paper"
                ))
            })
    }
}

/// The tree shapes benchmarked by default: every generator shape except the
/// 16-token worked example.
pub const SHAPES: [Shape; 6] = [
    Shape::Compaction,
    Shape::StackPop,
    Shape::Fold,
    Shape::Memex,
    Shape::Grpo,
    Shape::Plain,
];

/// Generates the rollouts of `shape` from `seed` at `size`.
///
/// `Size::Bench` scales the CPU defaults of [`crate::gen`] up to packs of a
/// thousand or two tokens, keeping each shape's structure: compaction with
/// a 768-token window, a 192-token reserve, 3 compactions and the last 2
/// turns kept; stack pop, fold and memex with 1–2 frames / 2 folds / 2
/// evictions over a 250–400-token system prompt; a GRPO group of 16 on a
/// shared prompt of that size; a no-edit rollout of comparable length.
pub fn generate(shape: Shape, seed: u64, size: Size) -> Result<Vec<Rollout>> {
    match size {
        Size::Small => gen::generate(shape, seed, false),
        Size::Paper => gen::generate(shape, seed, true),
        Size::Bench => {
            let mut rng = Rng::new(seed);
            let id = format!("{}-{seed}", shape.name());
            let system = (250, 400);
            let task = (20, 60);
            Ok(match shape {
                Shape::Golden => vec![gen::golden()],
                Shape::Compaction => {
                    let p = CompactionParams {
                        system_len: (100, 160),
                        task_len: task,
                        completion_len: (20, 60),
                        tool_len: (40, 120),
                        window: 768,
                        reserve: 192,
                        compactions: 3,
                        summary_len: (40, 80),
                        keep_turns: 2,
                        final_turns: 2,
                    };
                    vec![gen::compaction(&p, &mut rng, &id)?]
                }
                Shape::StackPop => {
                    let p = StackPopParams {
                        system_len: system,
                        task_len: task,
                        completion_len: (20, 40),
                        tool_len: (40, 120),
                        frames: (1, 2),
                        turns_before_frame: (1, 3),
                        frame_turns: (1, 3),
                        return_len: (15, 30),
                        final_turns: 1,
                    };
                    vec![gen::stack_pop(&p, &mut rng, &id)?]
                }
                Shape::Fold => {
                    let p = FoldParams {
                        system_len: system,
                        task_len: task,
                        completion_len: (20, 40),
                        tool_len: (40, 90),
                        folds: (2, 2),
                        turns_per_fold: (2, 3),
                        summary_len: (15, 30),
                        final_turns: 1,
                    };
                    vec![gen::fold(&p, &mut rng, &id)?]
                }
                Shape::Memex => {
                    let p = MemexParams {
                        system_len: system,
                        task_len: task,
                        completion_len: (20, 40),
                        tool_len: (35, 47),
                        evictions: (2, 2),
                        turns_between: (2, 3),
                        final_turns: 1,
                    };
                    vec![gen::memex(&p, &mut rng, &id)?]
                }
                Shape::Grpo => {
                    let p = GrpoParams {
                        group: 16,
                        system_len: system,
                        task_len: task,
                        completion_len: (30, 80),
                        tool_len: (40, 80),
                        turns: (0, 1),
                    };
                    gen::grpo(&p, &mut rng, &id)?
                }
                Shape::Plain => {
                    let p = PlainParams {
                        system_len: system,
                        task_len: task,
                        completion_len: (30, 90),
                        tool_len: (60, 160),
                        turns: (4, 6),
                    };
                    vec![gen::plain(&p, &mut rng, &id)?]
                }
            })
        }
    }
}

/// An attention method compared by the benchmarks (see the [module
/// docs](self)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Method {
    Trie,
    Replicated,
    LogitTree,
    DenseMask,
    NaiveCompressed,
    Causal,
}

impl Method {
    /// In table order.
    pub const ALL: [Method; 6] = [
        Method::Trie,
        Method::Replicated,
        Method::LogitTree,
        Method::DenseMask,
        Method::NaiveCompressed,
        Method::Causal,
    ];

    /// The name in tables.
    pub fn name(self) -> &'static str {
        match self {
            Method::Trie => "trie",
            Method::Replicated => "replicated",
            Method::LogitTree => "logittree",
            Method::DenseMask => "dense-mask",
            Method::NaiveCompressed => "naive-compressed",
            Method::Causal => "causal",
        }
    }
}

/// Tokens processed, visible (query, key) pairs (per head) and targets
/// scored (loss entries) of one method on one workload.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Cost {
    pub tokens: u64,
    pub pairs: u64,
    /// Sampled tokens the method trains on: every target for the exact
    /// methods, only those present on the final call for Naive-Compressed,
    /// none for the causal reference.
    pub targets: u64,
}

impl Cost {
    /// Attention FLOPs over visible pairs: `4 · head_dim · q_heads · pairs`
    /// forward, times 3.5 with the backward (2.5× the forward).
    pub fn flops(&self, q_heads: usize, head_dim: usize, backward: bool) -> f64 {
        let fwd = 4.0 * head_dim as f64 * q_heads as f64 * self.pairs as f64;
        if backward {
            3.5 * fwd
        } else {
            fwd
        }
    }
}

/// One tree shape packed every way the benchmarks compare.
#[derive(Clone, Debug)]
pub struct Workload {
    pub shape: Shape,
    /// Junctions K summed over the rollouts (K+1 = branches for one rollout).
    pub junctions: usize,
    /// The deduplicated trie pack (prefixes shared across the rollouts).
    pub trie: Pack,
    /// The branch-replicated pack.
    pub replicated: Pack,
    /// LogitTree: one causal pack per branch.
    pub logittree: Vec<Pack>,
    /// Each rollout's final call sequence alone.
    pub naive_compressed: Pack,
    /// A plain causal pack as long as the trie pack.
    pub causal: Pack,
}

impl Workload {
    /// Builds the conditioning tree of `rollouts` (sharing common prefixes,
    /// so a GRPO group stores its prompt once) and every pack.
    pub fn new(shape: Shape, rollouts: &[Rollout]) -> Result<Workload> {
        let tree = Tree::build(rollouts, true)?;
        let trie = tree.trie_pack();
        let l = trie.len() as u32;
        let causal = Pack {
            tokens: trie.tokens.clone(),
            position_ids: (0..l).collect(),
            kv_end: vec![l; l as usize],
            loss: Vec::new(),
        };
        let junctions = rollouts
            .iter()
            .map(|r| (1..r.calls().len()).filter(|&c| r.is_junction(c)).count())
            .sum();
        Ok(Workload {
            shape,
            junctions,
            replicated: tree.replicated_pack(),
            logittree: tree.logittree_packs(),
            naive_compressed: tree.naive_compressed_pack(),
            trie,
            causal,
        })
    }

    /// Generates `shape` from `seed` at `size` and builds its workload.
    pub fn generate(shape: Shape, seed: u64, size: Size) -> Result<Workload> {
        Workload::new(shape, &generate(shape, seed, size)?)
    }

    /// The packs `method` runs attention on, one pass each (the dense-mask
    /// method runs on the trie pack).
    pub fn packs(&self, method: Method) -> Vec<&Pack> {
        match method {
            Method::Trie | Method::DenseMask => vec![&self.trie],
            Method::Replicated => vec![&self.replicated],
            Method::LogitTree => self.logittree.iter().collect(),
            Method::NaiveCompressed => vec![&self.naive_compressed],
            Method::Causal => vec![&self.causal],
        }
    }

    /// Tokens and visible pairs of `method`, summed over its passes.
    pub fn cost(&self, method: Method) -> Cost {
        self.packs(method)
            .iter()
            .fold(Cost::default(), |c, p| Cost {
                tokens: c.tokens + p.len() as u64,
                pairs: c.pairs + mask_of(p).visible_pairs(),
                targets: c.targets + p.loss.len() as u64,
            })
    }
}

/// Attention inputs of one pack, `[tokens, heads, head_dim]` each.
#[derive(Clone, Debug, PartialEq)]
pub struct PackInputs {
    pub q: Vec<f32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    pub d_o: Vec<f32>,
}

impl PackInputs {
    /// Uniform values in `[−1, 1)` that depend only on each row's token id
    /// and position id (and the head and lane), like layer-0 activations:
    /// the same token at the same depth gets the same Q, K, V, dO in every
    /// layout, so the exact methods compute identical rows.
    pub fn new(pack: &Pack, heads: usize, head_dim: usize) -> PackInputs {
        let width = heads * head_dim;
        let fill = |salt: u64| {
            let mut x = Vec::with_capacity(pack.len() * width);
            for (&t, &p) in pack.tokens.iter().zip(&pack.position_ids) {
                let key = ((t as u64) << 32 | p as u64) ^ salt.wrapping_mul(0xd6e8_feb8_6659_fd93);
                let mut rng = Rng::new(key);
                x.extend((0..width).map(|_| (2.0 * rng.unit() - 1.0) as f32));
            }
            x
        };
        PackInputs {
            q: fill(1),
            k: fill(2),
            v: fill(3),
            d_o: fill(4),
        }
    }
}

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

/// `C[i, j] = Σ_p A[i, p] · B[p, j]` for `i < m`, `j < n`, `p < depth`; all
/// row-major with leading dimensions `lda`, `ldb`, `ldc`. Register blocks of
/// 4 rows × 16 columns, the depth loop innermost; with `FMA` the
/// multiply-adds are fused (only inside an `fma` target-feature function:
/// elsewhere `mul_add` is a slow library call).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn gemm_body<const FMA: bool>(
    m: usize,
    n: usize,
    depth: usize,
    a: &[f32],
    lda: usize,
    b: &[f32],
    ldb: usize,
    c: &mut [f32],
    ldc: usize,
) {
    const MR: usize = 4;
    const NR: usize = 16;
    for i in (0..m).step_by(MR) {
        let rows = (m - i).min(MR);
        for j in (0..n).step_by(NR) {
            let cols = (n - j).min(NR);
            let mut acc = [[0.0f32; NR]; MR];
            if rows == MR && cols == NR {
                for p in 0..depth {
                    let bp: &[f32; NR] = b[p * ldb + j..][..NR].try_into().expect("NR columns");
                    for (r, acc_r) in acc.iter_mut().enumerate() {
                        let x = a[(i + r) * lda + p];
                        for (y, &bv) in acc_r.iter_mut().zip(bp) {
                            *y = if FMA { x.mul_add(bv, *y) } else { *y + x * bv };
                        }
                    }
                }
            } else {
                for p in 0..depth {
                    let bp = &b[p * ldb + j..][..cols];
                    for (r, acc_r) in acc.iter_mut().enumerate().take(rows) {
                        let x = a[(i + r) * lda + p];
                        for (y, &bv) in acc_r.iter_mut().zip(bp) {
                            *y = if FMA { x.mul_add(bv, *y) } else { *y + x * bv };
                        }
                    }
                }
            }
            for (r, acc_r) in acc.iter().enumerate().take(rows) {
                c[(i + r) * ldc + j..][..cols].copy_from_slice(&acc_r[..cols]);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_avx2_fma(
    m: usize,
    n: usize,
    depth: usize,
    a: &[f32],
    lda: usize,
    b: &[f32],
    ldb: usize,
    c: &mut [f32],
    ldc: usize,
) {
    gemm_body::<true>(m, n, depth, a, lda, b, ldb, c, ldc)
}

/// [`gemm_body`], compiled for AVX2 with FMA when the CPU has both (the
/// instruction set the CPU backend's kernels use, so the comparison is
/// fair), portable otherwise.
#[allow(clippy::too_many_arguments)]
fn gemm(
    m: usize,
    n: usize,
    depth: usize,
    a: &[f32],
    lda: usize,
    b: &[f32],
    ldb: usize,
    c: &mut [f32],
    ldc: usize,
) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: the running CPU supports AVX2 and FMA (checked just above).
        unsafe { gemm_avx2_fma(m, n, depth, a, lda, b, ldb, c, ldc) };
        return;
    }
    gemm_body::<false>(m, n, depth, a, lda, b, ldb, c, ldc)
}

/// Rows per work item of the dense baseline.
const DENSE_ROWS: usize = 32;

/// `C = A · B` with `A` `[m, depth]`, `B` `[depth, n]`, `C` `[m, n]`
/// (contiguous, `m = c.len() / n`), rows of `C` spread over the CPU
/// backend's threads.
fn par_gemm(n: usize, depth: usize, a: &[f32], b: &[f32], c: &mut [f32]) {
    let work: Vec<_> = c.chunks_mut(DENSE_ROWS * n).enumerate().collect();
    run_parallel(
        work,
        num_threads(),
        || (),
        |_, (blk, c_rows)| {
            let r0 = blk * DENSE_ROWS;
            let rows = c_rows.len() / n;
            gemm(rows, n, depth, &a[r0 * depth..], depth, b, n, c_rows, n);
        },
    );
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
/// [`attention_forward`]: crate::backend::cpu::attention_forward
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
/// [`attention_backward`]: crate::backend::cpu::attention_backward
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
/// [`crate::backend::cpu::sdcc_forward_kl`], but every intermediate is a
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
/// and at step 5) plus the gradient; see [`SdccCase::unfused_peak_bytes`].
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

/// An SDCC workload: `pairs` diverging targets, each a (student row,
/// teacher row) of `[pairs, vocab]` student and teacher logits, weight 1,
/// temperature 1. Logits are uniform in `[−4, 4)` with the teacher a
/// perturbed, row-permuted copy of the student (a small KL, as between two
/// prefixes of the same model).
#[derive(Clone, Debug)]
pub struct SdccCase {
    pub vocab: usize,
    pub student: Vec<f32>,
    pub teacher: Vec<f32>,
    pub pairs: Vec<(u32, u32)>,
    pub weights: Vec<f32>,
    pub temperature: f32,
}

impl SdccCase {
    /// `pairs` pairs over a vocabulary of `vocab`, from `seed`.
    pub fn new(pairs: usize, vocab: usize, seed: u64) -> SdccCase {
        let mut rng = Rng::new(seed);
        let student: Vec<f32> = (0..pairs * vocab)
            .map(|_| (8.0 * rng.unit() - 4.0) as f32)
            .collect();
        // Teacher row (7 i + 3) mod pairs holds student row i, perturbed:
        // a permutation unless 7 divides `pairs` (then step 1 instead).
        let step = if pairs % 7 == 0 { 1 } else { 7 };
        let slot = |i: usize| (step * i + 3) % pairs.max(1);
        let mut teacher = vec![0.0f32; pairs * vocab];
        for i in 0..pairs {
            for (y, &x) in teacher[slot(i) * vocab..][..vocab]
                .iter_mut()
                .zip(&student[i * vocab..][..vocab])
            {
                *y = x + (rng.unit() - 0.5) as f32;
            }
        }
        SdccCase {
            vocab,
            student,
            teacher,
            pairs: (0..pairs).map(|i| (i as u32, slot(i) as u32)).collect(),
            weights: vec![1.0; pairs],
            temperature: 1.0,
        }
    }

    /// The fused op of the CPU backend.
    pub fn fused(&self) -> Result<SdccOut<f32>> {
        let args = SdccArgs::new(
            &self.student[..],
            &self.teacher[..],
            self.vocab,
            &self.pairs,
            &self.weights,
            self.temperature,
        )?;
        Cpu::default().sdcc_owned(&args)
    }

    /// [`sdcc_unfused`] on the same inputs.
    pub fn unfused(&self) -> Result<SdccOut<f32>> {
        sdcc_unfused(
            &self.student,
            &self.teacher,
            self.vocab,
            &self.pairs,
            &self.weights,
            self.temperature,
        )
    }

    /// Peak bytes [`SdccCase::unfused`] allocates, by exact arithmetic of its
    /// buffers: four `[pairs, vocab]` f32 tensors plus the f32 student
    /// gradient, plus `O(pairs + rows)` bookkeeping (ignored).
    pub fn unfused_peak_bytes(&self) -> usize {
        4 * self.pairs.len() * self.vocab * 4 + self.student.len() * 4
    }

    /// Peak bytes the fused op allocates, by the same arithmetic: the f32
    /// student gradient plus one f64 vocabulary row per worker thread.
    pub fn fused_peak_bytes(&self) -> usize {
        self.student.len() * 4 + num_threads().min(self.pairs.len()).max(1) * self.vocab * 8
    }
}

/// One measured SDCC variant of [`sdcc_table`].
#[derive(Clone, Debug, PartialEq)]
pub struct SdccRow {
    pub vocab: usize,
    pub pairs: usize,
    /// `"fused"` or `"unfused"`.
    pub method: &'static str,
    pub time: Timing,
    /// Peak bytes by the buffer arithmetic of [`SdccCase`].
    pub peak_bytes: usize,
}

/// The SDCC comparison: fused against unfused on [`SdccCase`]s of `pairs`
/// pairs for each vocabulary size, `reps` timed runs each (median). `Display`
/// prints one line per (vocab, method) with the ratios unfused ÷ fused.
#[derive(Clone, Debug, PartialEq)]
pub struct SdccTable {
    pub threads: usize,
    pub reps: usize,
    pub rows: Vec<SdccRow>,
}

/// Measures [`SdccTable`]; the fused and unfused results are checked to
/// agree (loss within 1e-4 relative) before timing, so both compute the
/// same thing.
///
/// Errors: `reps` or `pairs` of 0, a vocabulary of 0, or fused and unfused
/// disagreeing.
pub fn sdcc_table(pairs: usize, vocabs: &[usize], reps: usize) -> Result<SdccTable> {
    if pairs == 0 || vocabs.contains(&0) {
        return Err(Error::Usage(
            "SDCC pairs and vocabulary sizes must be positive".into(),
        ));
    }
    let mut rows = Vec::new();
    for &vocab in vocabs {
        let case = SdccCase::new(pairs, vocab, 7);
        let (a, b) = (case.fused()?, case.unfused()?);
        if (a.loss.loss_sum - b.loss.loss_sum).abs() > 1e-4 * a.loss.loss_sum.abs() {
            return Err(Error::Shape(format!(
                "fused and unfused SDCC disagree at vocab {vocab}: {} vs {}",
                a.loss.loss_sum, b.loss.loss_sum
            )));
        }
        let fused = measure(reps, || case.fused().map(drop))?;
        let unfused = measure(reps, || case.unfused().map(drop))?;
        rows.push(SdccRow {
            vocab,
            pairs,
            method: "fused",
            time: fused,
            peak_bytes: case.fused_peak_bytes(),
        });
        rows.push(SdccRow {
            vocab,
            pairs,
            method: "unfused",
            time: unfused,
            peak_bytes: case.unfused_peak_bytes(),
        });
    }
    Ok(SdccTable {
        threads: num_threads(),
        reps,
        rows,
    })
}

impl fmt::Display for SdccTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "SDCC forward KL + student gradient, CPU, f32 logits: fused (one pass over vocabulary chunks) vs \
             unfused (materialised softmaxes);\n{} threads, median of {} reps; peak = heap bytes by buffer \
             arithmetic (benches/sdcc.rs counts them with a global allocator); × = ÷ fused\n",
            self.threads, self.reps
        )?;
        writeln!(
            f,
            "{:>7} {:>6} {:<8} {:>9} {:>9} {:>10} {:>7} {:>7}",
            "vocab", "pairs", "method", "ms", "cpu ms", "peak MiB", "time×", "peak×"
        )?;
        for r in &self.rows {
            let fused = self
                .rows
                .iter()
                .find(|x| x.vocab == r.vocab && x.method == "fused")
                .unwrap_or(r);
            writeln!(
                f,
                "{:>7} {:>6} {:<8} {:>9.1} {:>9} {:>10.1} {:>7.2} {:>7.2}",
                r.vocab,
                r.pairs,
                r.method,
                r.time.wall_s * 1e3,
                r.time
                    .cpu_s
                    .map_or("-".to_string(), |c| format!("{:.1}", c * 1e3)),
                r.peak_bytes as f64 / (1024.0 * 1024.0),
                r.time.wall_s / fused.time.wall_s,
                r.peak_bytes as f64 / fused.peak_bytes as f64,
            )?;
        }
        Ok(())
    }
}

/// Which passes a measurement times.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pass {
    Forward,
    /// The forward and then the backward from its output (what a training
    /// step runs).
    ForwardBackward,
}

impl Pass {
    /// `"fwd"` or `"fwd+bwd"`.
    pub fn name(self) -> &'static str {
        match self {
            Pass::Forward => "fwd",
            Pass::ForwardBackward => "fwd+bwd",
        }
    }
}

/// One method on one workload, with its inputs built: ready to run
/// repeatedly (the criterion benches time [`Case::run`]).
#[derive(Clone, Debug)]
pub struct Case {
    pub method: Method,
    pub cost: Cost,
    /// `q_heads = kv_heads = heads`.
    pub heads: usize,
    pub head_dim: usize,
    passes: Vec<(Pack, PackInputs)>,
}

impl Case {
    /// Builds the packs and [`PackInputs`] of `method` on `w`.
    ///
    /// Errors: `heads` or `head_dim` of 0.
    pub fn new(w: &Workload, method: Method, heads: usize, head_dim: usize) -> Result<Case> {
        if heads == 0 || head_dim == 0 {
            return Err(Error::Usage(format!(
                "heads ({heads}) and head dim ({head_dim}) must be positive"
            )));
        }
        Ok(Case {
            method,
            cost: w.cost(method),
            heads,
            head_dim,
            passes: w
                .packs(method)
                .into_iter()
                .map(|p| (p.clone(), PackInputs::new(p, heads, head_dim)))
                .collect(),
        })
    }

    /// Attention FLOPs of `pass` over the visible pairs (see [`Cost::flops`]).
    pub fn flops(&self, pass: Pass) -> f64 {
        self.cost
            .flops(self.heads, self.head_dim, pass == Pass::ForwardBackward)
    }

    /// Runs `pass` once over every pack of the method (LogitTree: its K+1
    /// passes one after the other), f32, CPU backend (or the dense-mask
    /// baseline), softmax scale `1/sqrt(head_dim)`, no rotary; outputs in
    /// fresh buffers.
    pub fn run(&self, pass: Pass) -> Result<()> {
        self.run_into(pass, &mut self.outputs())
    }

    /// Output buffers for [`Case::run_into`], one set per pack.
    pub fn outputs(&self) -> CaseOutputs {
        CaseOutputs {
            passes: self
                .passes
                .iter()
                .map(|(pack, _)| {
                    let n = pack.len() * self.heads * self.head_dim;
                    [n, pack.len() * self.heads, n, n, n].map(|len| vec![0.0; len])
                })
                .collect(),
        }
    }

    /// [`Case::run`] with the CPU backend writing into `out` (from
    /// [`Case::outputs`] of this case) through
    /// [`attention_forward_into`] / [`attention_backward_into`], the way a
    /// training loop or a caching allocator reuses output memory across
    /// steps. The dense-mask baseline allocates its outputs as before.
    ///
    /// Errors: those of the attention calls; `out` of another case.
    pub fn run_into(&self, pass: Pass, out: &mut CaseOutputs) -> Result<()> {
        if out.passes.len() != self.passes.len() {
            return Err(Error::Usage(format!(
                "output buffers for {} packs, the case has {}",
                out.passes.len(),
                self.passes.len()
            )));
        }
        let params = AttnParams::new(self.head_dim);
        for ((pack, x), [o, lse, dq, dk, dv]) in self.passes.iter().zip(&mut out.passes) {
            let shape = AttnShape {
                tokens: pack.len(),
                q_heads: self.heads,
                kv_heads: self.heads,
                head_dim: self.head_dim,
            };
            let mask = pack.mask()?;
            if self.method == Method::DenseMask {
                let fwd = dense_attention_forward(&x.q, &x.k, &x.v, shape, mask, &params)?;
                if pass == Pass::ForwardBackward {
                    let (o, lse) = (&fwd.o, &fwd.lse);
                    let grads = dense_attention_backward(
                        &x.q, &x.k, &x.v, o, lse, &x.d_o, shape, mask, &params,
                    )?;
                    std::hint::black_box(grads);
                }
                std::hint::black_box(fwd);
                continue;
            }
            let args = AttnArgs::new(&x.q[..], &x.k[..], &x.v[..], shape, mask, params)?;
            Cpu::default().forward(&args, &mut o[..], &mut lse[..])?;
            if pass == Pass::ForwardBackward {
                let saved = Saved {
                    o: &o[..],
                    lse: &lse[..],
                };
                let grads = Grads {
                    dq: &mut dq[..],
                    dk: &mut dk[..],
                    dv: &mut dv[..],
                };
                Cpu::default().backward(&args, saved, &x.d_o[..], grads)?;
            }
            std::hint::black_box((o, lse, dq, dk, dv));
        }
        Ok(())
    }
}

/// Output buffers of a [`Case`]: per pack `[o, lse, dq, dk, dv]`.
#[derive(Clone, Debug)]
pub struct CaseOutputs {
    passes: Vec<[Vec<f32>; 5]>,
}

/// CPU time consumed so far by the whole process (all threads), in
/// seconds, where the OS reports it (64-bit Linux: `clock_gettime` with
/// `CLOCK_PROCESS_CPUTIME_ID`). Unlike wall time it does not grow while the
/// process waits for a core, so it measures work on a loaded machine; it
/// also does not see threads idling at the end of an unbalanced pass, which
/// wall time does.
pub fn process_cpu_seconds() -> Option<f64> {
    #[cfg(all(target_os = "linux", target_pointer_width = "64"))]
    {
        #[repr(C)]
        struct Timespec {
            tv_sec: i64,
            tv_nsec: i64,
        }
        extern "C" {
            fn clock_gettime(clock: i32, tp: *mut Timespec) -> i32;
        }
        const CLOCK_PROCESS_CPUTIME_ID: i32 = 2;
        let mut ts = Timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: clock_gettime writes one `struct timespec` (two 64-bit
        // fields on 64-bit Linux) into `ts`, which outlives the call.
        let rc = unsafe { clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
        (rc == 0).then_some(ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9)
    }
    #[cfg(not(all(target_os = "linux", target_pointer_width = "64")))]
    {
        None
    }
}

/// Median times of repeated runs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Timing {
    /// Median wall time, seconds.
    pub wall_s: f64,
    /// Median process CPU time (all threads), seconds, where available.
    pub cpu_s: Option<f64>,
}

fn median(mut x: Vec<f64>) -> f64 {
    x.sort_by(f64::total_cmp);
    let mid = x.len() / 2;
    if x.len() % 2 == 1 {
        x[mid]
    } else {
        0.5 * (x[mid - 1] + x[mid])
    }
}

/// Median wall and CPU time of `reps` runs of `f`, after one warm-up run.
pub fn measure(reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<Timing> {
    if reps == 0 {
        return Err(Error::Usage("--reps must be at least 1".into()));
    }
    f()?;
    let (mut wall, mut cpu) = (Vec::with_capacity(reps), Vec::with_capacity(reps));
    for _ in 0..reps {
        let c0 = process_cpu_seconds();
        let start = Instant::now();
        f()?;
        wall.push(start.elapsed().as_secs_f64());
        if let (Some(c0), Some(c1)) = (c0, process_cpu_seconds()) {
            cpu.push(c1 - c0);
        }
    }
    Ok(Timing {
        wall_s: median(wall),
        cpu_s: (cpu.len() == reps).then(|| median(cpu)),
    })
}

/// [`measure`] for several runs at once, taken in turns: `reps` rounds
/// that run each unit twice in a row, in order, and time the second run (the
/// first brings its inputs and buffers back into cache, as back-to-back
/// repetitions would); the median of each unit's timed runs. Ratios between
/// units (the tables' ×-columns) then compare runs taken under the same
/// conditions even when the machine's load or clock drifts during the
/// benchmark, which timing each unit's runs back to back does not.
///
/// Errors: `reps` of 0, and the first error of a run.
pub fn measure_round_robin<U>(
    reps: usize,
    units: &mut [U],
    mut run: impl FnMut(&mut U) -> Result<()>,
) -> Result<Vec<Timing>> {
    if reps == 0 {
        return Err(Error::Usage("--reps must be at least 1".into()));
    }
    let mut wall = vec![Vec::with_capacity(reps); units.len()];
    let mut cpu = vec![Vec::with_capacity(reps); units.len()];
    for _ in 0..reps {
        for (i, u) in units.iter_mut().enumerate() {
            run(u)?;
            let c0 = process_cpu_seconds();
            let start = Instant::now();
            run(u)?;
            wall[i].push(start.elapsed().as_secs_f64());
            if let (Some(c0), Some(c1)) = (c0, process_cpu_seconds()) {
                cpu[i].push(c1 - c0);
            }
        }
    }
    Ok(wall
        .into_iter()
        .zip(cpu)
        .map(|(wall, cpu)| Timing {
            wall_s: median(wall),
            cpu_s: (cpu.len() == reps).then(|| median(cpu)),
        })
        .collect())
}

/// Settings of [`quick`].
#[derive(Clone, Debug, PartialEq)]
pub struct Options {
    pub shapes: Vec<Shape>,
    pub size: Size,
    pub seed: u64,
    /// Timed repetitions per measurement (after one warm-up); the median is
    /// reported.
    pub reps: usize,
    /// Query heads (= kv heads).
    pub heads: usize,
    pub head_dim: usize,
}

impl Default for Options {
    /// Every shape of [`SHAPES`] at [`Size::Bench`], seed 0, 3 reps, 4 heads
    /// of dim 64.
    fn default() -> Self {
        Options {
            shapes: SHAPES.to_vec(),
            size: Size::Bench,
            seed: 0,
            reps: 3,
            heads: 4,
            head_dim: 64,
        }
    }
}

/// One measured (shape, method, pass).
#[derive(Clone, Debug, PartialEq)]
pub struct Row {
    pub shape: Shape,
    pub method: Method,
    pub pass: Pass,
    pub cost: Cost,
    /// Attention FLOPs over visible pairs.
    pub flops: f64,
    pub time: Timing,
}

impl Row {
    /// Visible-pair FLOPs per wall second.
    pub fn flops_per_s(&self) -> f64 {
        self.flops / self.time.wall_s
    }
    /// Visible-pair FLOPs per CPU second (all threads), where measured.
    pub fn flops_per_cpu_s(&self) -> Option<f64> {
        self.time.cpu_s.map(|c| self.flops / c)
    }
}

/// Per-shape facts of a [`Table`].
#[derive(Clone, Debug, PartialEq)]
pub struct ShapeInfo {
    pub shape: Shape,
    /// Junctions K (summed over the shape's rollouts).
    pub junctions: usize,
    /// LogitTree passes (branches).
    pub branches: usize,
    /// [`tile_utilization`] of the trie pack and of the causal pack at the
    /// CPU backend's tile size.
    pub trie_tile_use: f64,
    pub causal_tile_use: f64,
    /// Visible pairs over [`computed_entries`] (the register blocks the CPU
    /// kernels compute) of the trie pack and of the causal pack.
    pub trie_kernel_use: f64,
    pub causal_kernel_use: f64,
    /// The CPU backend's tile census of the trie pack.
    pub trie_tiles: TileCounts,
    /// Its partial tiles computed as chunks of gathered keys.
    pub trie_gather: GatherCounts,
    /// [`forward_balance`] of the trie pack and of the causal pack.
    pub trie_balance: f64,
    pub causal_balance: f64,
}

/// How evenly the CPU backend's forward spreads over `threads` threads on
/// this pack with `heads` heads: its work items are (head, query tile),
/// each costing its non-skipped key tiles, pulled busiest first from a
/// shared queue (longest-processing-time list scheduling). Returns the
/// total cost over `threads ×` the simulated finishing time of the last
/// thread: 1.0 is perfect balance.
pub fn forward_balance(pack: &Pack, heads: usize, threads: usize) -> f64 {
    use crate::backend::cpu::{KeyTileBounds, TileClass};
    let l = pack.len();
    let bounds = KeyTileBounds::new(&pack.kv_end);
    let mut costs: Vec<u64> = (0..l.div_ceil(TILE))
        .flat_map(|qt| {
            let (q0, q1) = (qt * TILE, ((qt + 1) * TILE).min(l));
            let c = (0..=qt)
                .filter(|&kt| bounds.classify(q0, q1, kt) != TileClass::Skip)
                .count() as u64;
            std::iter::repeat_n(c, heads)
        })
        .collect();
    costs.sort_unstable_by(|a, b| b.cmp(a));
    let mut finish = vec![0u64; threads.max(1)];
    for c in &costs {
        let next = finish.iter_mut().min().expect("at least one thread");
        *next += c;
    }
    let total: u64 = costs.iter().sum();
    let last = finish.iter().copied().max().unwrap_or(0);
    if last == 0 {
        return 1.0;
    }
    total as f64 / (finish.len() as f64 * last as f64)
}

/// The fraction of the (query, key) entries in the `tile × tile` blocks a
/// tiled kernel computes on this pack (blocks in the lower block triangle
/// not skipped by the rule of DESIGN §5: skip when `k0 > q1 − 1` or
/// `max(kv_end[k0..k1]) <= q0`) that are visible: the rest is masked work.
/// At the CPU backend's [`crate::backend::cpu::TILE`] its FLOP/s on a mask
/// is roughly proportional to this, so the trie's over causal's explains
/// most of the tree/causal throughput ratio; smaller `tile`s show what
/// finer skipping would recover. 0 for an empty pack.
pub fn tile_utilization(pack: &Pack, tile: usize) -> f64 {
    let l = pack.len();
    let tile = tile.max(1);
    let max_end: Vec<usize> = pack
        .kv_end
        .chunks(tile)
        .map(|c| c.iter().copied().max().unwrap_or(0) as usize)
        .collect();
    let mut computed = 0u64;
    for qt in 0..l.div_ceil(tile) {
        let (q0, q1) = (qt * tile, ((qt + 1) * tile).min(l));
        for (kt, &end) in max_end.iter().enumerate().take(qt + 1) {
            let (k0, k1) = (kt * tile, ((kt + 1) * tile).min(l));
            if k0 < q1 && end > q0 {
                computed += ((q1 - q0) * (k1 - k0)) as u64;
            }
        }
    }
    if computed == 0 {
        return 0.0;
    }
    mask_of(pack).visible_pairs() as f64 / computed as f64
}

/// Visible pairs over the entries the CPU kernels compute on `pack`
/// ([`computed_entries`]); 0 for an empty pack.
pub fn kernel_utilization(pack: &Pack) -> f64 {
    let computed = computed_entries(mask_of(pack));
    if computed == 0 {
        return 0.0;
    }
    mask_of(pack).visible_pairs() as f64 / computed as f64
}

/// The result of [`quick`]; `Display` prints the comparison table and the
/// per-shape summary.
#[derive(Clone, Debug, PartialEq)]
pub struct Table {
    pub options: Options,
    pub threads: usize,
    pub shapes: Vec<ShapeInfo>,
    pub rows: Vec<Row>,
}

impl Table {
    /// The row of `(shape, method, pass)`, if measured.
    pub fn row(&self, shape: Shape, method: Method, pass: Pass) -> Option<&Row> {
        self.rows
            .iter()
            .find(|r| r.shape == shape && r.method == method && r.pass == pass)
    }

    /// The row's median wall time over the trie pack's, same shape and pass.
    pub fn time_ratio(&self, row: &Row) -> Option<f64> {
        self.row(row.shape, Method::Trie, row.pass)
            .map(|t| row.time.wall_s / t.time.wall_s)
    }

    /// The trie pack's visible-pair FLOP/s over the plain causal pack's (of
    /// the same length), for `shape` and `pass`: the throughput
    /// criterion (≥ 0.9). By wall time, and by CPU time where measured.
    pub fn causal_throughput_ratio(&self, shape: Shape, pass: Pass) -> Option<(f64, Option<f64>)> {
        let t = self.row(shape, Method::Trie, pass)?;
        let c = self.row(shape, Method::Causal, pass)?;
        let cpu = match (t.flops_per_cpu_s(), c.flops_per_cpu_s()) {
            (Some(a), Some(b)) => Some(a / b),
            _ => None,
        };
        Some((t.flops_per_s() / c.flops_per_s(), cpu))
    }
}

/// Runs the comparison of the [module docs](self): for every shape, every
/// [`Method`] forward and forward+backward, `reps` timed runs each (median),
/// on the CPU backend in f32 with the backend's thread count.
///
/// Errors: no shapes, `reps`, `heads` or `head_dim` of 0, [`Size::Paper`]
/// (too large to time here; see [`costs`]), and any error of the generators
/// or the ops.
pub fn quick(opts: &Options) -> Result<Table> {
    if opts.shapes.is_empty() {
        return Err(Error::Usage("no shapes to benchmark".into()));
    }
    if opts.reps == 0 {
        return Err(Error::Usage("--reps must be at least 1".into()));
    }
    if opts.size == Size::Paper {
        return Err(Error::Usage(
            "paper-scale trees (up to ~200k tokens) take hours to time on the CPU and the dense-mask \
             baseline cannot hold them; use --costs-only for their tokens and FLOPs"
                .into(),
        ));
    }
    let mut table = Table {
        options: opts.clone(),
        threads: num_threads(),
        shapes: Vec::new(),
        rows: Vec::new(),
    };
    for &shape in &opts.shapes {
        let w = Workload::generate(shape, opts.seed, opts.size)?;
        table.shapes.push(ShapeInfo {
            shape,
            junctions: w.junctions,
            branches: w.logittree.len(),
            trie_tile_use: tile_utilization(&w.trie, TILE),
            causal_tile_use: tile_utilization(&w.causal, TILE),
            trie_kernel_use: kernel_utilization(&w.trie),
            causal_kernel_use: kernel_utilization(&w.causal),
            trie_tiles: tile_counts(mask_of(&w.trie)),
            trie_gather: gather_counts(mask_of(&w.trie)),
            trie_balance: forward_balance(&w.trie, opts.heads, num_threads()),
            causal_balance: forward_balance(&w.causal, opts.heads, num_threads()),
        });
        // Every (method, pass) of the shape, each with output buffers
        // allocated once outside the timed runs.
        let cases = Method::ALL
            .into_iter()
            .map(|method| Case::new(&w, method, opts.heads, opts.head_dim))
            .collect::<Result<Vec<_>>>()?;
        let mut units: Vec<_> = cases
            .iter()
            .flat_map(|case| {
                [Pass::Forward, Pass::ForwardBackward].map(|pass| (case, pass, case.outputs()))
            })
            .collect();
        let times = measure_round_robin(opts.reps, &mut units, |(case, pass, out)| {
            case.run_into(*pass, out)
        })?;
        for ((case, pass, _), time) in units.iter().zip(times) {
            table.rows.push(Row {
                shape,
                method: case.method,
                pass: *pass,
                cost: case.cost,
                flops: case.flops(*pass),
                time,
            });
        }
    }
    Ok(table)
}

impl fmt::Display for Table {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let o = &self.options;
        writeln!(
            f,
            "attention, CPU backend, f32: {} heads × head dim {}, {} threads, size {}, seed {}, median of {} reps",
            o.heads, o.head_dim, self.threads, o.size.name(), o.seed, o.reps
        )?;
        writeln!(
            f,
            "GFLOP = 4·d·heads per visible pair (fwd), ×3.5 for fwd+bwd; ms = wall, cpu ms = all threads; \
             ×-columns are ratios to the trie pack, same shape and pass;\n\
             CPU backend outputs written into buffers allocated once outside the timed runs \
             (as a training loop or caching allocator reuses them); dense-mask allocates per call\n"
        )?;
        writeln!(
            f,
            "{:<11} {:<17} {:<8} {:>6} {:>5} {:>9} {:>7} {:>5} {:>8} {:>8} {:>7} {:>6}",
            "shape",
            "method",
            "pass",
            "tokens",
            "tok×",
            "pairs",
            "GFLOP",
            "flop×",
            "ms",
            "cpu ms",
            "GFLOP/s",
            "time×"
        )?;
        let opt =
            |x: Option<f64>, scale: f64| x.map_or("-".to_string(), |v| format!("{:.1}", v * scale));
        for r in &self.rows {
            let trie = self.row(r.shape, Method::Trie, r.pass);
            let rel = |x: f64, y: Option<f64>| y.map_or(f64::NAN, |y| x / y);
            writeln!(
                f,
                "{:<11} {:<17} {:<8} {:>6} {:>5.2} {:>9} {:>7.3} {:>5.2} {:>8.1} {:>8} {:>7.2} {:>6.2}",
                r.shape.name(),
                r.method.name(),
                r.pass.name(),
                r.cost.tokens,
                rel(r.cost.tokens as f64, trie.map(|t| t.cost.tokens as f64)),
                r.cost.pairs,
                r.flops * 1e-9,
                rel(r.flops, trie.map(|t| t.flops)),
                r.time.wall_s * 1e3,
                opt(r.time.cpu_s, 1e3),
                r.flops_per_s() * 1e-9,
                rel(r.time.wall_s, trie.map(|t| t.time.wall_s)),
            )?;
        }
        writeln!(f)?;
        writeln!(
            f,
            "summary: tree/causal = trie GFLOP/s ÷ causal GFLOP/s at the same length (target ≥ 0.90), by wall \
             and by CPU time;\ntile use = visible share of the entries in computed tiles, trie / causal; \
             logittree and replicated: time, FLOPs and tokens ÷ the trie's (both have the same FLOPs and \
             tokens);\ntrie÷naive: the trie's tokens, FLOPs and time ÷ Naive-Compressed's (the paper's 4D mask \
             costs 1.35×)"
        )?;
        writeln!(
            f,
            "{:<11} {:>2} {:>3} {:<8} {:>11} {:>6} {:>11} {:>18} {:>11} {:>18}",
            "shape",
            "K",
            "K+1",
            "pass",
            "tree/causal",
            "(cpu)",
            "tile use",
            "logittree t/f/tok",
            "replicated",
            "trie÷naive tok/f/t"
        )?;
        let num = |x: Option<f64>| x.map_or("-".to_string(), |v| format!("{v:.2}"));
        for s in &self.shapes {
            for pass in [Pass::Forward, Pass::ForwardBackward] {
                let trie = self.row(s.shape, Method::Trie, pass);
                let over_trie = |m: Method| {
                    let r = self.row(s.shape, m, pass);
                    let ratio = |g: &dyn Fn(&Row) -> f64| match (r, trie) {
                        (Some(r), Some(t)) => Some(g(r) / g(t)),
                        _ => None,
                    };
                    (
                        ratio(&|r| r.time.wall_s),
                        ratio(&|r| r.flops),
                        ratio(&|r| r.cost.tokens as f64),
                    )
                };
                let (wall, cpu) = match self.causal_throughput_ratio(s.shape, pass) {
                    Some((w, c)) => (Some(w), c),
                    None => (None, None),
                };
                let lt = over_trie(Method::LogitTree);
                let naive = over_trie(Method::NaiveCompressed);
                let inv = |x: Option<f64>| x.map(|v| 1.0 / v);
                writeln!(
                    f,
                    "{:<11} {:>2} {:>3} {:<8} {:>11} {:>6} {:>11} {:>18} {:>11} {:>18}",
                    s.shape.name(),
                    s.junctions,
                    s.branches,
                    pass.name(),
                    num(wall),
                    num(cpu),
                    format!("{:.2} / {:.2}", s.trie_tile_use, s.causal_tile_use),
                    format!("{} / {} / {}", num(lt.0), num(lt.1), num(lt.2)),
                    num(over_trie(Method::Replicated).0),
                    format!(
                        "{} / {} / {}",
                        num(inv(naive.2)),
                        num(inv(naive.1)),
                        num(inv(naive.0))
                    ),
                )?;
            }
        }
        writeln!(f)?;
        writeln!(
            f,
            "diagnosis of tree/causal: trie tiles ({TILE}×{TILE}) skipped / full / partial, of the partial ones gathered → chunks of \
             {TILE} keys; kernel use = visible pairs ÷ entries the \
             kernels compute ({BLOCK_QUERIES}×{BLOCK_KEYS} blocks), trie / causal;\nper-entry = (tree/causal by CPU time) ÷ (trie ÷ causal \
             kernel use): the speed per computed entry on the tree relative to causal (below 1: partial-tile, masking\nand per-call \
             overheads weigh more on the tree); balance = simulated forward thread balance, trie / causal"
        )?;
        writeln!(
            f,
            "{:<11} {:>20} {:>9} {:>13} {:>17} {:>13}",
            "shape", "skip/full/partial", "gathered", "kernel use", "per-entry fwd/bwd", "balance"
        )?;
        for s in &self.shapes {
            let use_ratio = s.trie_kernel_use / s.causal_kernel_use;
            let per_entry = |pass| {
                self.causal_throughput_ratio(s.shape, pass)
                    .and_then(|(_, cpu)| cpu)
                    .map_or("-".to_string(), |c| format!("{:.2}", c / use_ratio))
            };
            let (t, g) = (s.trie_tiles, s.trie_gather);
            writeln!(
                f,
                "{:<11} {:>20} {:>9} {:>13} {:>17} {:>13}",
                s.shape.name(),
                format!("{}/{}/{}", t.skip, t.full, t.partial),
                format!("{}→{}", g.tiles, g.chunks),
                format!("{:.3} / {:.3}", s.trie_kernel_use, s.causal_kernel_use),
                format!(
                    "{} / {}",
                    per_entry(Pass::Forward),
                    per_entry(Pass::ForwardBackward)
                ),
                format!("{:.2} / {:.2}", s.trie_balance, s.causal_balance),
            )?;
        }
        Ok(())
    }
}

/// Tokens and visible pairs of every method on every shape, without
/// timing anything: the comparison for sizes too large to time on a CPU
/// ([`Size::Paper`]). `Display` prints one line per shape.
#[derive(Clone, Debug, PartialEq)]
pub struct CostTable {
    pub size: Size,
    pub seed: u64,
    pub shapes: Vec<ShapeCosts>,
}

/// One shape of a [`CostTable`].
#[derive(Clone, Debug, PartialEq)]
pub struct ShapeCosts {
    pub shape: Shape,
    pub junctions: usize,
    pub branches: usize,
    /// In [`Method::ALL`] order.
    pub costs: Vec<(Method, Cost)>,
}

impl ShapeCosts {
    /// The cost of `method`.
    pub fn cost(&self, method: Method) -> Cost {
        self.costs
            .iter()
            .find(|(m, _)| *m == method)
            .map(|(_, c)| *c)
            .expect("every method is costed")
    }
}

/// Builds the workloads of `opts.shapes` at `opts.size` from `opts.seed`
/// and counts each method's tokens and visible pairs (no attention runs;
/// `reps`, `heads` and `head_dim` are not used).
///
/// Errors: no shapes, and any error of the generators.
pub fn costs(opts: &Options) -> Result<CostTable> {
    if opts.shapes.is_empty() {
        return Err(Error::Usage("no shapes to count".into()));
    }
    let mut shapes = Vec::new();
    for &shape in &opts.shapes {
        let w = Workload::generate(shape, opts.seed, opts.size)?;
        shapes.push(ShapeCosts {
            shape,
            junctions: w.junctions,
            branches: w.logittree.len(),
            costs: Method::ALL.iter().map(|&m| (m, w.cost(m))).collect(),
        });
    }
    Ok(CostTable {
        size: opts.size,
        seed: opts.seed,
        shapes,
    })
}

impl fmt::Display for CostTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "tokens and visible pairs (FLOPs ∝ pairs), size {}, seed {}; LogitTree and the replicated pack \
             have the same tokens and pairs;\n×-columns: that method ÷ trie; trie÷naive: trie ÷ Naive-Compressed \
             (the paper's 4D mask costs 1.35×);\nnaive scores: the share of the sampled tokens Naive-Compressed \
             trains on at all (the exact methods score every one)\n",
            self.size.name(),
            self.seed
        )?;
        writeln!(
            f,
            "{:<11} {:>2} {:>3} {:>8} {:>13} {:>14} {:>14} {:>11} {:>11} {:>12} {:>12}",
            "shape",
            "K",
            "K+1",
            "trie tok",
            "trie pairs",
            "logittree tok×",
            "logittree flop×",
            "naive tok",
            "trie÷naive tok",
            "trie÷naive flop",
            "naive scores"
        )?;
        for s in &self.shapes {
            let (t, r, n) = (
                s.cost(Method::Trie),
                s.cost(Method::LogitTree),
                s.cost(Method::NaiveCompressed),
            );
            let ratio = |a: u64, b: u64| a as f64 / b as f64;
            writeln!(
                f,
                "{:<11} {:>2} {:>3} {:>8} {:>13} {:>14.2} {:>14.2} {:>11} {:>11.2} {:>12.2} {:>11.0}%",
                s.shape.name(),
                s.junctions,
                s.branches,
                t.tokens,
                t.pairs,
                ratio(r.tokens, t.tokens),
                ratio(r.pairs, t.pairs),
                n.tokens,
                ratio(t.tokens, n.tokens),
                ratio(t.pairs, n.pairs),
                100.0 * ratio(n.targets, t.targets),
            )?;
        }
        Ok(())
    }
}

/// The mask of a pack the bench built itself (from its own generators, so
/// valid by construction).
fn mask_of(pack: &Pack) -> PackMask<'_> {
    pack.mask()
        .expect("the bench's generators build packs with a valid kv_end")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::HostAttention;

    /// The CPU backend's forward through the contract.
    fn attention_forward(
        q: &[f32],
        k: &[f32],
        v: &[f32],
        shape: AttnShape,
        mask: PackMask<'_>,
        params: &AttnParams,
    ) -> Result<AttnOut<f32>> {
        Cpu::default().forward_owned(&AttnArgs::new(q, k, v, shape, mask, *params)?)
    }

    /// The CPU backend's backward through the contract.
    #[allow(clippy::too_many_arguments)]
    fn attention_backward(
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
        let args = AttnArgs::new(q, k, v, shape, mask, *params)?;
        let fwd = AttnOut {
            o: o.to_vec(),
            lse: lse.to_vec(),
        };
        Cpu::default().backward_owned(&args, &fwd, d_o)
    }

    /// Largest |a − b| over two equally long slices.
    fn max_diff(a: &[f32], b: &[f32]) -> f32 {
        assert_eq!(a.len(), b.len());
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f32::max)
    }

    fn shape_of(pack: &Pack, q_heads: usize, kv_heads: usize, head_dim: usize) -> AttnShape {
        AttnShape {
            tokens: pack.len(),
            q_heads,
            kv_heads,
            head_dim,
        }
    }

    fn random(n: usize, rng: &mut Rng) -> Vec<f32> {
        (0..n).map(|_| (2.0 * rng.unit() - 1.0) as f32).collect()
    }

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
            rope: Some(crate::backend::Rope {
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

    #[test]
    fn costs_count_visible_pairs_and_tokens_of_each_layout() {
        for (i, shape) in SHAPES.into_iter().enumerate() {
            let w = Workload::generate(shape, i as u64, Size::Small).unwrap();
            let trie = w.cost(Method::Trie);
            // Brute force over the dense mask.
            let brute = dense_mask(&w.trie.kv_end).iter().filter(|&&b| b).count() as u64;
            assert_eq!(trie.pairs, brute, "{shape:?}");
            assert_eq!(trie.tokens, w.trie.len() as u64);
            assert_eq!(w.cost(Method::DenseMask), trie);
            // LogitTree's passes are causal chains, and the replicated pack
            // is the same chains side by side: equal tokens and pairs.
            let lt = w.cost(Method::LogitTree);
            let chains: u64 = w
                .logittree
                .iter()
                .map(|p| (p.len() as u64) * (p.len() as u64 + 1) / 2)
                .sum();
            assert_eq!(lt.pairs, chains);
            assert_eq!(w.cost(Method::Replicated), lt);
            let l = w.trie.len() as u64;
            assert_eq!(
                w.cost(Method::Causal),
                Cost {
                    tokens: l,
                    pairs: l * (l + 1) / 2,
                    targets: 0
                }
            );
            // Every exact method scores each sampled token once.
            let sampled: usize = generate(shape, i as u64, Size::Small)
                .unwrap()
                .iter()
                .map(|r| r.targets())
                .sum();
            assert_eq!(trie.targets, sampled as u64, "{shape:?}");
            assert_eq!(lt.targets, trie.targets);
            assert!(w.cost(Method::NaiveCompressed).targets <= trie.targets);
            // Deduplication never adds work.
            assert!(
                trie.tokens <= lt.tokens && trie.pairs <= lt.pairs,
                "{shape:?}"
            );
            if w.junctions > 0 || w.logittree.len() > 1 {
                assert!(
                    trie.pairs < lt.pairs,
                    "{shape:?}: shared prefixes are counted once"
                );
            }
        }
        let c = Cost {
            tokens: 10,
            pairs: 1000,
            targets: 5,
        };
        assert_eq!(c.flops(2, 64, false), 4.0 * 64.0 * 2.0 * 1000.0);
        assert_eq!(c.flops(2, 64, true), 3.5 * c.flops(2, 64, false));
    }

    // The methods see the same inputs: a trie row's output equals the output
    // of the same node on its LogitTree branch (same token and depth, same
    // visible prefix). Tolerance: as above, f32 sums in another order.
    #[test]
    fn trie_rows_equal_logittree_rows_with_the_same_inputs() {
        let rollouts = generate(Shape::Compaction, 5, Size::Small).unwrap();
        let tree = Tree::build(&rollouts, true).unwrap();
        let w = Workload::new(Shape::Compaction, &rollouts).unwrap();
        let (h, d) = (2, 16);
        let params = AttnParams::new(d);
        let run = |p: &Pack| {
            let x = PackInputs::new(p, h, d);
            attention_forward(
                &x.q,
                &x.k,
                &x.v,
                shape_of(p, h, h, d),
                p.mask().unwrap(),
                &params,
            )
            .unwrap()
        };
        let trie = run(&w.trie);
        let mut checked = 0;
        for (b, branch) in tree.branches().iter().enumerate() {
            let out = run(&w.logittree[b]);
            for (depth, &node) in tree.path_to(branch.leaf as usize).iter().enumerate() {
                let (a, z) = (node as usize * h * d, depth * h * d);
                assert!(max_diff(&trie.o[a..a + h * d], &out.o[z..z + h * d]) < 2e-4);
                checked += 1;
            }
        }
        assert_eq!(checked, w.cost(Method::LogitTree).tokens as usize);
        // Control: different inputs would not match (position enters the hash).
        let other = PackInputs::new(&w.causal, h, d);
        assert_ne!(other.q, PackInputs::new(&w.trie, h, d).q);
    }

    #[test]
    fn bench_sized_shapes_keep_their_structure() {
        for shape in SHAPES {
            let w = Workload::generate(shape, 0, Size::Bench).unwrap();
            let l = w.trie.len();
            assert!((500..=4000).contains(&l), "{shape:?}: trie pack of {l}");
            match shape {
                Shape::Compaction => assert_eq!(w.junctions, 3),
                Shape::StackPop => assert!((1..=2).contains(&w.junctions)),
                Shape::Fold | Shape::Memex => assert_eq!(w.junctions, 2),
                Shape::Grpo => assert_eq!((w.junctions, w.logittree.len()), (0, 16)),
                Shape::Plain => assert_eq!((w.junctions, w.logittree.len()), (0, 1)),
                Shape::Golden => unreachable!("not a benchmark shape"),
            }
        }
        assert_eq!(Size::parse("paper").unwrap(), Size::Paper);
        assert!(matches!(Size::parse("huge"), Err(Error::Usage(_))));
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

    #[test]
    fn sdcc_table_measures_both_variants() {
        let t = sdcc_table(3, &[500, 700], 1).unwrap();
        assert_eq!(t.rows.len(), 4);
        let fused = &t.rows[0];
        assert_eq!((fused.vocab, fused.method), (500, "fused"));
        assert!(t.rows[1].peak_bytes > fused.peak_bytes);
        let text = t.to_string();
        assert!(
            text.contains("unfused") && text.lines().any(|l| l.trim_start().starts_with("700"))
        );
        assert!(matches!(sdcc_table(0, &[500], 1), Err(Error::Usage(_))));
        assert!(matches!(sdcc_table(3, &[0], 1), Err(Error::Usage(_))));
        assert!(matches!(sdcc_table(3, &[500], 0), Err(Error::Usage(_))));
    }

    #[test]
    fn quick_measures_every_method_and_pass() {
        let opts = Options {
            shapes: vec![Shape::Fold, Shape::Grpo],
            size: Size::Small,
            seed: 1,
            reps: 1,
            heads: 1,
            head_dim: 8,
        };
        let t = quick(&opts).unwrap();
        assert_eq!(t.rows.len(), 2 * Method::ALL.len() * 2);
        for s in [Shape::Fold, Shape::Grpo] {
            for pass in [Pass::Forward, Pass::ForwardBackward] {
                let trie = t.row(s, Method::Trie, pass).unwrap();
                assert_eq!(t.time_ratio(trie), Some(1.0));
                assert!(trie.time.wall_s > 0.0 && trie.flops > 0.0);
                assert!(
                    trie.time.cpu_s.is_some_and(|c| c > 0.0),
                    "Linux reports CPU time"
                );
                let (wall, cpu) = t.causal_throughput_ratio(s, pass).unwrap();
                assert!(wall.is_finite() && wall > 0.0 && cpu.unwrap() > 0.0);
            }
        }
        let text = t.to_string();
        assert!(text.contains("naive-compressed") && text.contains("dense-mask"));
        assert!(text
            .lines()
            .any(|l| l.starts_with("grpo") && l.contains("16")));
        for bad in [
            Options {
                reps: 0,
                ..opts.clone()
            },
            Options {
                heads: 0,
                ..opts.clone()
            },
            Options {
                head_dim: 0,
                ..opts.clone()
            },
            Options {
                shapes: vec![],
                ..opts.clone()
            },
            Options {
                size: Size::Paper,
                ..opts.clone()
            },
        ] {
            assert!(matches!(quick(&bad), Err(Error::Usage(_))), "{bad:?}");
        }
    }

    #[test]
    fn tile_utilization_counts_visible_entries_of_computed_tiles() {
        let pack = |kv_end: Vec<u32>| Pack {
            position_ids: vec![0; kv_end.len()],
            tokens: vec![0; kv_end.len()],
            kv_end,
            loss: Vec::new(),
        };
        // One 64-token causal tile: 64·65/2 of 64² entries visible.
        let t = tile_utilization(&pack(vec![64; 64]), 64);
        assert!((t - 2080.0 / 4096.0).abs() < 1e-12, "{t}");
        // Two independent 64-token sequences: the off-diagonal block is
        // skipped, so the same share as one.
        let mut two = vec![64u32; 64];
        two.extend(vec![128u32; 64]);
        assert!((tile_utilization(&pack(two.clone()), 64) - 2080.0 / 4096.0).abs() < 1e-12);
        // Causal over 128: the off-diagonal block is full and computed.
        let t = tile_utilization(&pack(vec![128; 128]), 64);
        assert!(
            (t - (128.0 * 129.0 / 2.0) / (3.0 * 4096.0)).abs() < 1e-12,
            "{t}"
        );
        // A 65-token causal pack: edge tiles count their real size.
        let t = tile_utilization(&pack(vec![65; 65]), 64);
        assert!(
            (t - (65.0 * 66.0 / 2.0) / (4096.0 + 64.0 + 1.0)).abs() < 1e-12,
            "{t}"
        );
        // Tile 1 computes exactly the visible entries.
        assert_eq!(tile_utilization(&pack(two), 1), 1.0);
        // At the CPU backend's tile, the blocks computed are those its own
        // census does not skip (packs of whole tiles: entries = blocks · 64²).
        for (i, shape) in SHAPES.into_iter().enumerate() {
            let w = Workload::generate(shape, i as u64, Size::Bench).unwrap();
            let l = w.trie.len() / TILE * TILE;
            let mut p = w.trie.clone();
            p.kv_end.truncate(l);
            p.position_ids.truncate(l);
            p.tokens.truncate(l);
            for e in p.kv_end.iter_mut() {
                *e = (*e).min(l as u32);
            }
            let c = tile_counts(p.mask().unwrap());
            let computed = ((c.full + c.partial) * (TILE * TILE) as u64) as f64;
            let expected = p.mask().unwrap().visible_pairs() as f64 / computed;
            assert!(
                (tile_utilization(&p, TILE) - expected).abs() < 1e-12,
                "{shape:?}"
            );
        }
    }

    #[test]
    fn forward_balance_simulates_the_busiest_first_queue() {
        let pack = |kv_end: Vec<u32>| Pack {
            position_ids: vec![0; kv_end.len()],
            tokens: vec![0; kv_end.len()],
            kv_end,
            loss: Vec::new(),
        };
        // Causal over 3 tiles: items cost 1, 2, 3 per head. One head on two
        // threads: {3} and {2, 1} finish together.
        let causal = pack(vec![192; 192]);
        assert_eq!(forward_balance(&causal, 1, 2), 1.0);
        // Two heads: 3,3,2,2,1,1 → {3,2,1} {3,2,1}.
        assert_eq!(forward_balance(&causal, 2, 2), 1.0);
        // Three threads, one head: the 3-tile item alone bounds the time.
        assert!((forward_balance(&causal, 1, 3) - 6.0 / 9.0).abs() < 1e-12);
        assert_eq!(forward_balance(&causal, 1, 1), 1.0);
    }

    #[test]
    fn cost_table_counts_every_method_without_timing() {
        let opts = Options {
            shapes: vec![Shape::StackPop, Shape::Grpo],
            size: Size::Small,
            ..Options::default()
        };
        let t = costs(&opts).unwrap();
        assert_eq!(t.shapes.len(), 2);
        for s in &t.shapes {
            let w = Workload::generate(s.shape, 0, Size::Small).unwrap();
            for m in Method::ALL {
                assert_eq!(s.cost(m), w.cost(m), "{:?} {m:?}", s.shape);
            }
        }
        let text = t.to_string();
        assert!(text
            .lines()
            .any(|l| l.starts_with("grpo") && l.contains(" 16 ")));
        let none = Options {
            shapes: vec![],
            ..opts
        };
        assert!(matches!(costs(&none), Err(Error::Usage(_))));
    }

    #[test]
    fn measure_takes_medians_of_timed_runs_after_a_warm_up() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 3.0, 2.0]), 2.5);
        let mut n = 0;
        let t = measure(3, || {
            n += 1;
            let end = Instant::now() + std::time::Duration::from_millis(5);
            while Instant::now() < end {
                std::hint::spin_loop();
            }
            Ok(())
        })
        .unwrap();
        assert_eq!(n, 4, "one warm-up and three timed runs");
        assert!(t.wall_s >= 0.005, "{t:?}");
        // Process CPU time (which also counts other tests' threads here).
        assert!(t.cpu_s.expect("Linux reports CPU time") > 0.0);
        assert!(measure(0, || Ok(())).is_err());
        let mut calls = 0;
        let failing = measure(2, || {
            calls += 1;
            Err(Error::Usage("stop".into()))
        });
        assert_eq!((failing, calls), (Err(Error::Usage("stop".into())), 1));
    }

    /// Round robin: rounds in order, each unit run twice in a row (warm-up,
    /// timed); each unit's median is its own (a 30 ms unit and a 1 ms unit
    /// are told apart; the gap is wide because other tests share the cores
    /// and can delay a spinning unit by milliseconds).
    #[test]
    fn round_robin_takes_turns_and_keeps_each_units_times() {
        let order = std::cell::RefCell::new(Vec::new());
        let mut units = [(0usize, 30u64), (1, 1)];
        let t = measure_round_robin(3, &mut units, |&mut (id, ms)| {
            order.borrow_mut().push(id);
            let end = Instant::now() + std::time::Duration::from_millis(ms);
            while Instant::now() < end {
                std::hint::spin_loop();
            }
            Ok(())
        })
        .unwrap();
        assert_eq!(order.into_inner(), [0, 0, 1, 1, 0, 0, 1, 1, 0, 0, 1, 1]);
        assert!(t[0].wall_s >= 0.030 && t[1].wall_s >= 0.001, "{t:?}");
        assert!(t[0].wall_s > t[1].wall_s * 2.0, "{t:?}");
        assert!(measure_round_robin(0, &mut units, |_| Ok(())).is_err());
        let mut calls = 0;
        let failing = measure_round_robin(2, &mut units, |_| {
            calls += 1;
            Err(Error::Usage("stop".into()))
        });
        assert_eq!((failing, calls), (Err(Error::Usage("stop".into())), 1));
    }
}
