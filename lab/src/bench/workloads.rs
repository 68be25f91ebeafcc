//! What the benchmarks run: the tree shapes and their packs ([`Workload`]:
//! trie, replicated, LogitTree, Naive-Compressed, causal), the per-token
//! inputs ([`PackInputs`]), one method on one workload ready to run
//! ([`Case`]), and the SDCC workload ([`SdccCase`]).

use super::baselines::{dense_attention_backward, dense_attention_forward, sdcc_unfused};
use super::{mask_of, SdccOut};
use crate::gen::{self, Shape, Size};
use treeattn::backend::cpu::{num_threads, Cpu};
use treeattn::backend::{
    AttentionBackend, AttnArgs, AttnParams, AttnShape, Grads, HostSdcc, Saved, SdccArgs,
};
use treeattn::pack::Pack;
use treeattn::rng::Rng;
use treeattn::rollout::Rollout;
use treeattn::tree::Tree;
use treeattn::{Error, Result};

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
/// thousand or two tokens (the generators' `bench_scale()` presets),
/// keeping each shape's structure: compaction with
/// a 768-token window, a 192-token reserve, 3 compactions and the last 2
/// turns kept; stack pop, fold and memex with 1–2 frames / 2 folds / 2
/// evictions over a 250–400-token system prompt; a GRPO group of 16 on a
/// shared prompt of that size; a no-edit rollout of comparable length.
pub fn generate(shape: Shape, seed: u64, size: Size) -> Result<Vec<Rollout>> {
    gen::generate_at(shape, seed, size)
}

/// An attention method compared by the benchmarks (see the [module
/// docs](super)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Method {
    /// One pass on the deduplicated trie pack with the tiled CPU kernels
    /// (tile skipping): exact.
    Trie,
    /// One pass on the branch-replicated pack (the paper's 4D layout):
    /// exact.
    Replicated,
    /// K+1 causal passes, one per branch: exact.
    LogitTree,
    /// One pass on the trie pack through an `L × L` boolean mask and score
    /// matrix (the dense baseline): exact.
    DenseMask,
    /// One causal pass on each rollout's final call sequence: inexact.
    NaiveCompressed,
    /// Plain causal attention as long as the trie pack: the throughput
    /// reference, not a training method.
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
    /// Tokens processed: pack lengths summed over the method's passes.
    pub tokens: u64,
    /// Visible (query, key) pairs per head, summed over the passes.
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
    /// The shape the rollouts were generated as.
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
    /// Queries.
    pub q: Vec<f32>,
    /// Keys.
    pub k: Vec<f32>,
    /// Values.
    pub v: Vec<f32>,
    /// Gradient of the loss with respect to the attention output, for the
    /// backward.
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

/// Which passes a measurement times.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pass {
    /// The forward alone (output and log-sum-exp).
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
    /// The method this case runs.
    pub method: Method,
    /// The method's tokens, visible pairs and targets on the workload.
    pub cost: Cost,
    /// `q_heads = kv_heads = heads`.
    pub heads: usize,
    /// Dimension of each head.
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
    /// the contract's [`AttentionBackend::forward`] / [`AttentionBackend::backward`], the way a
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
                v_head_dim: self.head_dim,
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
                    dsinks: None,
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

/// An SDCC workload: `pairs` diverging targets, each a (student row,
/// teacher row) of `[pairs, vocab]` student and teacher logits, weight 1,
/// temperature 1. Logits are uniform in `[−4, 4)` with the teacher a
/// perturbed, row-permuted copy of the student (a small KL, as between two
/// prefixes of the same model).
#[derive(Clone, Debug)]
pub struct SdccCase {
    /// Vocabulary size: logits per row.
    pub vocab: usize,
    /// Student logits, `[pairs, vocab]` row-major.
    pub student: Vec<f32>,
    /// Teacher logits, `[pairs, vocab]` row-major.
    pub teacher: Vec<f32>,
    /// (student row, teacher row) of each pair: student row `i` with
    /// teacher row `(7 i + 3) mod pairs` (step 1 when 7 divides `pairs`).
    pub pairs: Vec<(u32, u32)>,
    /// Weight of each pair's KL in the loss sum; all 1.
    pub weights: Vec<f32>,
    /// Softmax temperature τ; 1.
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
        let step = if pairs.is_multiple_of(7) { 1 } else { 7 };
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::test_support::{attention_forward, max_diff, shape_of};
    use treeattn::mask::dense_mask;

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
    // visible prefix). Tolerance: as for the dense baseline (baselines.rs),
    // f32 sums in another order.
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
}
