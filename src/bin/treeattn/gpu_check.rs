//! `treeattn gpu-check`: the CUDA kernels against a reference on fresh random
//! packs, then timings; a thin front over `treeattn::gpu_check`.
//! Without the `cuda` feature it says how to build it.

use treeattn::{Error, Result};

use clap::Args;

use crate::args::number;

/// CUDA kernels vs reference on random packs, then timings (needs a build
/// with --features cuda).
#[derive(Args, Debug)]
#[command(long_about = "\
On a machine with an NVIDIA GPU (driver for CUDA 13.0 or newer): runs the CUDA
tree-attention kernels on fresh random packs (trees, forests with padding,
varlen, causal, a GRPO fan; GQA; head dims 64 and 128; bf16 and f16) against a
reference, with outputs poisoned and every element checked, then times tree
packs against a causal run of the same kernel and size (CUDA events, warm-up,
median of R runs, inputs larger than L2). Prints a table last; exits 1 if any
check fails. Needs a binary built with `cargo build --release --features cuda`
(see scripts/gpu-check.sh).")]
pub struct GpuCheckArgs {
    /// CUDA device ordinal [default: 0].
    #[arg(long, value_name = "N", value_parser = number)]
    device: Option<u64>,
    /// Seed of the random packs [default: from the clock].
    #[arg(long, value_name = "S", value_parser = number)]
    seed: Option<u64>,
    /// Tokens of the timed packs [default: 16384].
    #[arg(long, value_name = "N", value_parser = number)]
    tokens: Option<u64>,
    /// Query heads of the timed packs [default: 16].
    #[arg(long, value_name = "H", value_parser = number)]
    heads: Option<u64>,
    /// Timed runs, the median is shown [default: 50].
    #[arg(long, value_name = "R", value_parser = number)]
    reps: Option<u64>,
}

pub fn run(a: GpuCheckArgs) -> Result<()> {
    check(a.device, a.seed, a.tokens, a.heads, a.reps)
}

fn to_usize(name: &str, v: u64) -> Result<usize> {
    usize::try_from(v).map_err(|_| Error::Usage(format!("--{name} {v} is too large")))
}

#[cfg(feature = "cuda")]
fn check(
    device: Option<u64>,
    seed: Option<u64>,
    tokens: Option<u64>,
    heads: Option<u64>,
    reps: Option<u64>,
) -> Result<()> {
    use treeattn::gpu_check::{run as run_check, CheckOptions};
    let mut opts = CheckOptions::default();
    if let Some(d) = device {
        opts.device = to_usize("device", d)?;
    }
    opts.seed = seed;
    if let Some(t) = tokens {
        opts.timing_tokens = to_usize("tokens", t)?;
    }
    if let Some(h) = heads {
        opts.timing_q_heads = to_usize("heads", h)?;
    }
    if let Some(r) = reps {
        if r == 0 {
            return Err(Error::Usage("--reps must be at least 1".into()));
        }
        opts.reps = to_usize("reps", r)?;
    }
    let table = run_check(&opts)?;
    crate::args::emit(&format!("{table}\n"))
}

#[cfg(not(feature = "cuda"))]
fn check(
    device: Option<u64>,
    seed: Option<u64>,
    tokens: Option<u64>,
    heads: Option<u64>,
    reps: Option<u64>,
) -> Result<()> {
    let _ = (device, seed, tokens, heads, reps);
    for (name, v) in [
        ("device", device),
        ("tokens", tokens),
        ("heads", heads),
        ("reps", reps),
    ] {
        if let Some(v) = v {
            to_usize(name, v)?;
        }
    }
    Err(Error::Unsupported(
        "this treeattn was built without the `cuda` feature: rebuild with `cargo build --release --features cuda` \
         (needs nvcc; see the README) and run on a machine with an NVIDIA GPU"
            .into(),
    ))
}
