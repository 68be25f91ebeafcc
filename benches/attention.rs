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
//! Like `treeattn bench`, each case writes into output buffers allocated
//! once outside the timed loop ([`Case::run_into`]), as a training loop or
//! a caching allocator reuses them: fresh outputs would add the same page
//! faults to every call whatever the mask, a fixed cost that weighs more on
//! the tree's shorter pass than on causal (the dense-mask baseline still
//! allocates per call).

use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use treeattn::bench::{Case, Method, Pass, Size, Workload, SHAPES};

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

criterion_group!(benches, attention);
criterion_main!(benches);
