//! Criterion benchmarks of DESIGN §7 on the CPU backend (f32): for every
//! tree shape at `Size::Bench`, attention forward and forward+backward of
//! the trie pack, the branch-replicated pack, LogitTree's K+1 passes, the
//! dense-mask baseline, Naive-Compressed and a plain causal pack of the
//! trie's length. 4 heads of dim 64.
//!
//! Throughput is `Throughput::Elements` = attention FLOPs over visible pairs
//! (4·d per pair per head forward, ×3.5 for forward+backward), so criterion's
//! "elem/s" reads as visible-pair FLOP/s. Run: `cargo bench --bench
//! attention` (a few minutes on 2 cores; filter with e.g. `-- compaction`).
//!
//! The `long` groups time one compaction tree of ~8k and ~16k tokens
//! against the causal mask of its length, 8 heads, f32, and the tree on
//! bf16 inputs (`trie-bf16`: all block products on bf16 pairs where the
//! CPU has AVX-512 BF16; `TREEATTN_ISA=avx512` runs the f32 products on
//! the same inputs, to compare): `cargo bench --bench attention -- long`.
//!
//! Like `treeattn bench`, each case writes into output buffers allocated
//! once outside the timed loop ([`Case::run_into`]), as a training loop or
//! a caching allocator reuses them: fresh outputs would add the same page
//! faults to every call whatever the mask, a fixed cost that weighs more on
//! the tree's shorter pass than on causal (the dense-mask baseline still
//! allocates per call).

use std::time::Duration;

use criterion::measurement::WallTime;
use criterion::{criterion_group, criterion_main, BenchmarkGroup, Criterion, Throughput};
use treeattn::backend::cpu::{Cpu, CpuElement, CpuFloat};
use treeattn::backend::{AttentionBackend, AttnArgs, AttnParams, AttnShape, Grads, Saved};
use treeattn::half::bf16;
use treeattn::mask::PackMask;
use treeattn::rng::Rng;
use treeattn::tree::Tree;
use treeattn_lab::bench::{Case, Method, Pass, Size, Workload, SHAPES};
use treeattn_lab::gen::{self, CompactionParams};

const HEADS: usize = 4;
const HEAD_DIM: usize = 64;

fn attention(c: &mut Criterion) {
    for shape in SHAPES {
        let w = Workload::generate(shape, 0, Size::Bench).expect("bench workloads generate");
        let cases: Vec<Case> = Method::ALL
            .into_iter()
            .map(|m| Case::new(&w, m, HEADS, HEAD_DIM).expect("valid heads and head dim"))
            .collect();
        for pass in [Pass::Forward, Pass::ForwardBackward] {
            let mut g = c.benchmark_group(format!("attention/{}/{}", shape.name(), pass.name()));
            g.sample_size(10)
                .warm_up_time(Duration::from_millis(300))
                .measurement_time(Duration::from_secs(1));
            for case in &cases {
                g.throughput(Throughput::Elements(case.flops(pass) as u64));
                let mut out = case.outputs();
                g.bench_function(case.method.name(), |b| {
                    b.iter(|| case.run_into(pass, &mut out).expect("attention runs"))
                });
            }
            g.finish();
        }
    }
}

/// One compaction tree with every length of [`CompactionParams::bench_scale`]
/// (and its window) times `scale`: a single tree of several thousand tokens.
fn long_compaction_pack(scale: usize) -> treeattn::pack::Pack {
    let b = CompactionParams::bench_scale();
    let s = |(lo, hi): (usize, usize)| (lo * scale, hi * scale);
    let p = CompactionParams {
        system_len: s(b.system_len),
        task_len: s(b.task_len),
        completion_len: s(b.completion_len),
        tool_len: s(b.tool_len),
        window: b.window * scale,
        reserve: b.reserve * scale,
        summary_len: s(b.summary_len),
        ..b
    };
    let r = gen::compaction(&p, &mut Rng::new(1), "long").expect("the generator runs");
    Tree::build(&[r], false)
        .expect("a valid rollout")
        .trie_pack()
}

/// The long-sequence groups of issue 15: one compaction tree of ~8k and
/// ~16k tokens against the causal mask of the same length, forward and
/// forward+backward, 8 heads of dim 64 (elements = visible-pair FLOPs).
fn long(c: &mut Criterion) {
    let (heads, d) = (8, 64);
    for scale in [6, 12] {
        let pack = long_compaction_pack(scale);
        let l = pack.len();
        let shape = AttnShape {
            tokens: l,
            q_heads: heads,
            kv_heads: heads,
            head_dim: d,
            v_head_dim: d,
        };
        let mut rng = Rng::new(7);
        let mut random = |n: usize| (0..n).map(|_| rng.signed_unit()).collect::<Vec<f32>>();
        let inputs = [
            random(shape.q_len()),
            random(shape.kv_len()),
            random(shape.kv_len()),
            random(shape.q_len()),
        ];
        let bf16_inputs = inputs
            .each_ref()
            .map(|x| x.iter().map(|&v| bf16::from_f32(v)).collect::<Vec<_>>());
        let causal = vec![l as u32; l];
        let trie = pack.mask().expect("a valid pack");
        let causal = PackMask::new(&causal, &pack.position_ids).expect("causal");
        for pass in [Pass::Forward, Pass::ForwardBackward] {
            let mut g = c.benchmark_group(format!("long/compaction-{l}/{}", pass.name()));
            g.sample_size(10)
                .warm_up_time(Duration::from_millis(500))
                .measurement_time(Duration::from_secs(3));
            let long = Long { shape, pass };
            long.time(&mut g, "trie", &inputs, trie);
            long.time(&mut g, "causal", &inputs, causal);
            long.time(&mut g, "trie-bf16", &bf16_inputs, trie);
            g.finish();
        }
    }
}

/// One pass of the `long` groups on one pack.
struct Long {
    shape: AttnShape,
    pass: Pass,
}

impl Long {
    /// Times `pass` on inputs `[q, k, v, dO]` of element type `S` under
    /// `mask`, into outputs allocated once.
    fn time<S: CpuElement>(
        &self,
        g: &mut BenchmarkGroup<'_, WallTime>,
        name: &str,
        [q, k, v, d_o]: &[Vec<S>; 4],
        mask: PackMask<'_>,
    ) {
        let (shape, pass) = (self.shape, self.pass);
        let per_pair = 4.0 * shape.head_dim as f64 * shape.q_heads as f64;
        let bwd = if pass == Pass::ForwardBackward {
            3.5
        } else {
            1.0
        };
        g.throughput(Throughput::Elements(
            (mask.visible_pairs() as f64 * per_pair * bwd) as u64,
        ));
        let params = AttnParams::new(shape.head_dim);
        let args =
            AttnArgs::new(&q[..], &k[..], &v[..], shape, mask, params).expect("valid arguments");
        let mut o = vec![S::default(); shape.q_len()];
        let mut lse = vec![<S::Compute as CpuFloat>::ZERO; shape.lse_len()];
        let mut grads =
            [shape.q_len(), shape.kv_len(), shape.kv_len()].map(|n| vec![S::default(); n]);
        let cpu = Cpu::default();
        g.bench_function(name, |b| {
            b.iter(|| {
                cpu.forward(&args, &mut o[..], &mut lse[..])
                    .expect("forward");
                if pass == Pass::ForwardBackward {
                    let [dq, dk, dv] = &mut grads;
                    let saved = Saved {
                        o: &o[..],
                        lse: &lse[..],
                    };
                    let g = Grads {
                        dq: &mut dq[..],
                        dk: &mut dk[..],
                        dv: &mut dv[..],
                        dsinks: None,
                    };
                    cpu.backward(&args, saved, &d_o[..], g).expect("backward");
                }
            })
        });
    }
}

criterion_group!(benches, attention, long);
criterion_main!(benches);
