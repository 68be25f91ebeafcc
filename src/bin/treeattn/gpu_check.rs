//! `treeattn gpu-check`: the CUDA kernels against a reference on fresh random
//! packs, then timings — on a GPU (`--backend cuda`, a build with the `cuda`
//! feature) or the same flow on the SIMT emulator at small sizes
//! (`--backend emu`, a build with the `emu` feature); a thin front over
//! `treeattn::gpu_check`. Built with neither, it says how to build it.

use treeattn::{Error, Result};

use clap::{Args, ValueEnum};

use crate::args::number;

/// Where the check runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum BackendArg {
    /// A CUDA device (build with --features cuda).
    Cuda,
    /// The SIMT emulator on the CPU, small sizes (build with --features emu).
    Emu,
}

/// CUDA kernels vs reference on random packs, then timings, on a GPU or
/// on the emulator (needs a build with --features cuda or emu).
#[derive(Args, Debug)]
#[command(long_about = "\
Runs the CUDA tree-attention kernels on fresh random packs (trees, forests with
padding, varlen, causal, a GRPO fan; GQA; head dims 64 and 128; bf16 and f16)
against the CPU backend, forward, backward (rotary, both dQ modes) and SDCC,
with outputs poisoned and every element checked, then times tree packs against
a causal run of the same kernel and size and against LogitTree's branch
passes. Each section is printed as it finishes, the tables last; exits 1 if
any check fails.

--backend cuda (the default in a build with `--features cuda`): on a machine
with an NVIDIA GPU (driver for CUDA 13.0 or newer); CUDA-event timings,
inputs larger than L2 (see scripts/gpu-check.sh).
--backend emu (the default in a build with only `--features emu`): the very
same flow on the SIMT emulator at small sizes, so that the GPU run is not the
flow's first run; its timings are the emulator's wall clock, meaningless for
a GPU, printed in the same table layout.

--dump DIR writes every correctness case's pack (kv_end, position ids),
inputs (q, k, v, dO) and our outputs (O, LSE, dQ, dK, dV) as safetensors plus
a manifest.json, atomically (DIR must not exist or be empty), before any
timing; after the timings, DIR/timing/ holds the timing packs and our times
(timing.json). scripts/gpu-anchor.py DIR runs PyTorch on the same packs and
prints its times beside ours.

--check-only skips the timings, --timing-only the correctness checks (the
same --seed gives the same packs and inputs: a failure found by a GPU run
replays with --check-only --seed S, on the GPU or with --backend emu);
--small uses the emulator's pack sizes;
--profile runs only one forward + backward (for ncu).")]
pub struct GpuCheckArgs {
    /// cuda or emu [default: cuda where built with `cuda`, else emu].
    #[arg(long, value_enum, value_name = "B")]
    backend: Option<BackendArg>,
    /// Write every correctness case's pack, inputs and outputs to DIR.
    #[arg(long, value_name = "DIR")]
    dump: Option<std::path::PathBuf>,
    /// CUDA device ordinal [default: 0].
    #[arg(long, value_name = "N", value_parser = number)]
    device: Option<u64>,
    /// Seed of the random packs [default: from the clock].
    #[arg(long, value_name = "S", value_parser = number)]
    seed: Option<u64>,
    /// Tokens of the timed packs [default: 16384 cuda, 256 emu].
    #[arg(long, value_name = "N", value_parser = number)]
    tokens: Option<u64>,
    /// Query heads of the timed packs [default: 16 cuda, 4 emu].
    #[arg(long, value_name = "H", value_parser = number)]
    heads: Option<u64>,
    /// Timed runs per row, between one pair of events; the mean is shown
    /// [default: 50 cuda, 1 emu].
    #[arg(long, value_name = "R", value_parser = number)]
    reps: Option<u64>,
    /// Correctness checks only, no timing (what the sanitizer runs).
    #[arg(long, conflicts_with = "profile")]
    check_only: bool,
    /// Timings only, no correctness checks (with --dump DIR: only
    /// DIR/timing/ is written, beside a --check-only run's dump).
    #[arg(long, conflicts_with_all = ["profile", "check_only"])]
    timing_only: bool,
    /// The emulator's small correctness packs (a few hundred tokens), on any
    /// backend (the sanitizer runs).
    #[arg(long)]
    small: bool,
    /// Only one forward + backward of a random-tree pack at --tokens, d 128,
    /// bf16, no checks: for a profiler (ncu).
    #[arg(long)]
    profile: bool,
}

fn to_usize(name: &str, v: u64) -> Result<usize> {
    usize::try_from(v).map_err(|_| Error::Usage(format!("--{name} {v} is too large")))
}

#[cfg(any(feature = "cuda", feature = "emu"))]
pub fn run(a: GpuCheckArgs) -> Result<()> {
    use treeattn::gpu_check::{run_to, CheckBackend, CheckOptions};
    let backend = match a.backend {
        Some(BackendArg::Cuda) => CheckBackend::Cuda,
        Some(BackendArg::Emu) => CheckBackend::Emu,
        None => CheckBackend::default_for_build(),
    };
    let mut opts = CheckOptions::for_backend(backend);
    if let Some(d) = a.device {
        opts.device = to_usize("device", d)?;
    }
    opts.seed = a.seed;
    if let Some(t) = a.tokens {
        opts.timing_tokens = to_usize("tokens", t)?;
    }
    if let Some(h) = a.heads {
        opts.timing_q_heads = to_usize("heads", h)?;
    }
    if let Some(r) = a.reps {
        if r == 0 {
            return Err(Error::Usage("--reps must be at least 1".into()));
        }
        opts.reps = to_usize("reps", r)?;
    }
    opts.dump = a.dump;
    opts.check_only = a.check_only;
    opts.timing_only = a.timing_only;
    opts.profile = a.profile;
    opts.small |= a.small;
    let mut out = std::io::stdout().lock();
    run_to(&opts, &mut out)
}

#[cfg(not(any(feature = "cuda", feature = "emu")))]
pub fn run(a: GpuCheckArgs) -> Result<()> {
    for (name, v) in [
        ("device", a.device),
        ("tokens", a.tokens),
        ("heads", a.heads),
        ("reps", a.reps),
    ] {
        if let Some(v) = v {
            to_usize(name, v)?;
        }
    }
    let _ = (
        a.seed,
        a.dump,
        a.check_only,
        a.timing_only,
        a.small,
        a.profile,
    );
    let how = match a.backend {
        Some(BackendArg::Emu) => {
            "this treeattn was built without the `emu` feature: rebuild with `cargo build --release --features emu` \
             (needs a C++ compiler) to run the check on the SIMT emulator"
        }
        _ => {
            "this treeattn was built without the `cuda` feature: rebuild with `cargo build --release --features cuda` \
             (needs nvcc; see the README) and run on a machine with an NVIDIA GPU, or with `--features emu` and \
             `--backend emu` to run the same check on the emulator"
        }
    };
    Err(Error::Unsupported(how.into()))
}
