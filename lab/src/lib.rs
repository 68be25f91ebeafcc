//! # treeattn-lab
//!
//! The development tools of [treeattn](../treeattn/index.html), built on the
//! library's public API and kept out of it, so that a crate depending on
//! treeattn compiles none of them (nor `clap`):
//!
//! - [`gen`]: seeded rollout, forest and mask generators (the tests' and
//!   the benchmarks' inputs);
//! - [`model`]: a small reference transformer on the CPU (f64), and
//!   [`logittree`]: LogitTree's K+1 separate passes, the property tests'
//!   ground truth for one packed pass;
//! - [`demo`]: the README's main job (`cargo run --release -- demo`);
//! - [`bench`]: the benchmark workloads, baselines and tables (the `bench`
//!   command and `benches/`);
//! - [`gpu_check`]: `treeattn gpu-check` (on the GPU with the `cuda`
//!   feature, on the SIMT emulator with `emu`; the launch plan,
//!   `--plan-only`, always);
//! - the `treeattn` command line (`src/bin/treeattn`).

#![warn(missing_docs)]
pub mod bench;
pub mod demo;
pub mod gen;
#[cfg(any(feature = "cuda", feature = "emu"))]
pub mod gpu_check;
/// `treeattn gpu-check`: without the `cuda` and `emu` features, only the
/// backward launch plan and its SM-utilization model ([`gpu_check::plan`],
/// `gpu-check --plan-only`), which need no kernel.
#[cfg(not(any(feature = "cuda", feature = "emu")))]
pub mod gpu_check {
    pub mod plan;
}
pub mod logittree;
mod matmul;
pub mod model;
