//! Criterion benchmarks of the SDCC forward KL, fused (the CPU backend's
//! `sdcc_forward_kl`) against unfused (`treeattn_lab::bench::sdcc_unfused`:
//! both softmaxes materialised, then KL and gradient), for 128 diverging
//! targets over vocabularies of 32k and 150k.
//!
//! Peak memory is measured by a counting global allocator in this binary:
//! the high-water mark of live heap bytes during one call, above what was
//! live before it (inputs excluded, outputs included). It is printed, next
//! to the exact arithmetic of each method's buffers, before criterion runs.
//!
//! Throughput is `Throughput::Elements` = logit entries of the pairs
//! (`pairs · vocab`), so "elem/s" reads as vocabulary entries per second.
//! Run: `cargo bench --bench sdcc`.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use treeattn_lab::bench::SdccCase;

/// Counts live heap bytes and their high-water mark.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call is forwarded to the system allocator unchanged; the
// counters only observe sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc(layout);
        if !p.is_null() {
            let now = LIVE.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(now, Ordering::Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout);
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = System.realloc(ptr, layout, new_size);
        if !p.is_null() {
            if new_size >= layout.size() {
                let grow = new_size - layout.size();
                let now = LIVE.fetch_add(grow, Ordering::Relaxed) + grow;
                PEAK.fetch_max(now, Ordering::Relaxed);
            } else {
                LIVE.fetch_sub(layout.size() - new_size, Ordering::Relaxed);
            }
        }
        p
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// Heap high-water mark of `f` above the bytes live when it starts.
fn peak_bytes<T>(f: impl FnOnce() -> T) -> usize {
    let base = LIVE.load(Ordering::Relaxed);
    PEAK.store(base, Ordering::Relaxed);
    let out = f();
    let peak = PEAK.load(Ordering::Relaxed);
    drop(out);
    peak - base
}

const PAIRS: usize = 128;
const VOCABS: [usize; 2] = [32_000, 150_000];

fn sdcc(c: &mut Criterion) {
    let mib = |b: usize| b as f64 / (1024.0 * 1024.0);
    println!("SDCC peak heap during one call ({PAIRS} pairs; counted / buffer arithmetic), MiB:");
    for vocab in VOCABS {
        let case = SdccCase::new(PAIRS, vocab, 7);
        let fused = peak_bytes(|| case.fused().expect("fused SDCC runs"));
        let unfused = peak_bytes(|| case.unfused().expect("unfused SDCC runs"));
        println!(
            "  vocab {vocab:>6}: fused {:>7.1} / {:>7.1}   unfused {:>7.1} / {:>7.1}   ratio {:.2}",
            mib(fused),
            mib(case.fused_peak_bytes()),
            mib(unfused),
            mib(case.unfused_peak_bytes()),
            unfused as f64 / fused as f64
        );
    }
    for vocab in VOCABS {
        let case = SdccCase::new(PAIRS, vocab, 7);
        let mut g = c.benchmark_group(format!("sdcc/vocab={vocab}"));
        g.sample_size(10)
            .warm_up_time(Duration::from_millis(300))
            .measurement_time(Duration::from_secs(2))
            .throughput(Throughput::Elements((PAIRS * vocab) as u64));
        g.bench_function("fused", |b| {
            b.iter(|| case.fused().expect("fused SDCC runs"))
        });
        g.bench_function("unfused", |b| {
            b.iter(|| case.unfused().expect("unfused SDCC runs"))
        });
        g.finish();
    }
}

criterion_group!(benches, sdcc);
criterion_main!(benches);
