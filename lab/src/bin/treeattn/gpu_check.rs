//! `treeattn gpu-check`: the CUDA kernels against a reference on fresh random
//! packs, then timings — on a GPU (`--backend cuda`, a build with the `cuda`
//! feature) or the same flow on the SIMT emulator at small sizes
//! (`--backend emu`, a build with the `emu` feature); a thin front over
//! `treeattn_lab::gpu_check`. Built with neither, it says how to build it.

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
timing; DIR/timing/ gets each timing row's pack and our times (timing.json)
as the row finishes. scripts/gpu-anchor.py DIR runs PyTorch on the same packs
and prints its times beside ours.

--check-only skips the timings, --timing-only the correctness checks (the
same --seed gives the same packs and inputs: a failure found by a GPU run
replays with --check-only --seed S, on the GPU or with --backend emu);
--small uses the emulator's pack sizes;
--profile runs only one forward + backward (for ncu).

Timing runs in two passes: first the rows that matter most (the GRPO pack at
d 128 against causal, forward and forward + backward in both dQ modes, at most
10 reps), then every other row. With --dump each row goes to
DIR/timing/timing.json as it finishes (rewritten atomically: whole at any
moment, \"complete\": true once every section ended), so a run killed mid-way
keeps the rows it finished. --time-limit SECONDS starts a timing row only
while the time left covers its reserve (twice the slowest row so far, at least
2 s); the others are skipped with a line (and listed in timing.json).

--plan-only needs no GPU and no kernel (any build): it prints the backward
launch the GPU backend would make for --pack FILE (a pack safetensors file
with kv_end, as `treeattn pack` writes; or @grpo, the GRPO group of issue 39:
a 1,024-token prompt and 16 responses of 960; or @compaction, a 15,086-token
compaction tree) at --heads / --kv-heads / --head-dim: the main kernel's
blocks (and, with --dq-mode det, the dQ kernel's) in launch order, each with
its keys, kv head, the query range it walks and its visible (query, key)
pairs times its query heads, then the SM utilization predicted by assigning
the blocks in launch order to the first free of --sms x blocks-per-SM slots
(cost proportional to pairs). --json prints {\"blocks_per_sm\": b,
\"utilization\": u, \"kernels\": [{\"name\": ..., \"items\": [[key_begin,
key_end, kv_head, query_begin, query_end, pairs], ...]}], ...}.")]
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
    /// Seconds this run may take: timing rows that would not fit are
    /// skipped with a line [default: no limit].
    #[arg(long, value_name = "SECONDS", value_parser = number)]
    time_limit: Option<u64>,
    /// Print the backward launch plan of --pack and its predicted SM
    /// utilization; no kernel runs (any build).
    #[arg(long, conflicts_with_all = ["profile", "check_only", "timing_only", "dump", "backend", "time_limit"])]
    plan_only: bool,
    /// The pack of --plan-only: a pack safetensors file, @grpo or
    /// @compaction.
    #[arg(long, value_name = "FILE", requires = "plan_only")]
    pack: Option<String>,
    /// kv heads of --plan-only [default: --heads / 4, at least 1].
    #[arg(long, value_name = "HKV", value_parser = number, requires = "plan_only")]
    kv_heads: Option<u64>,
    /// Head dim of --plan-only: 64 or 128 [default: 128].
    #[arg(long, value_name = "D", value_parser = number, requires = "plan_only")]
    head_dim: Option<u64>,
    /// SMs of --plan-only's GPU [default: 132, an H100 / H200].
    #[arg(long, value_name = "N", value_parser = number, requires = "plan_only")]
    sms: Option<u64>,
    /// Resident blocks per SM of every planned kernel [default: from each
    /// kernel's threads, registers and shared memory on sm_90].
    #[arg(long, value_name = "B", value_parser = number, requires = "plan_only")]
    blocks_per_sm: Option<u64>,
    /// dQ mode of --plan-only: atomic (main kernel only) or det (main, then
    /// the dQ kernel) [default: atomic].
    #[arg(long, value_enum, value_name = "M", requires = "plan_only")]
    dq_mode: Option<DqModeArg>,
    /// Main kernel of --plan-only [default: the backend's for the head dim].
    #[arg(long, value_enum, value_name = "K", requires = "plan_only")]
    main_kernel: Option<MainKernelArg>,
    /// --plan-only: model the balanced main launch of issue 39 item 1
    /// (heavy key tiles' query walks split into ranges, heaviest first;
    /// not the backends' default yet) instead of today's grid.
    #[arg(long, requires = "plan_only")]
    balanced: bool,
    /// --plan-only output as one JSON object.
    #[arg(long, requires = "plan_only")]
    json: bool,
}

/// The dQ mode of a planned backward.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum DqModeArg {
    /// dQ by atomic adds in the main kernel.
    Atomic,
    /// A separate deterministic dQ kernel.
    Det,
}

/// The backward main kernel of a plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum MainKernelArg {
    /// One 16-key m-tile per warp, 64-key blocks of 4 warps.
    OneMTile,
    /// Two m-tiles per warp, 128-key blocks of 8 warps (the default).
    TwoMTiles,
    /// Two m-tiles per warp, 128-key blocks of 4 warps (d 64 only).
    TwoMTiles4w,
}

/// `--plan-only`: the backward launch plan of a pack (no kernel, any build).
fn plan_only(a: &GpuCheckArgs) -> Result<()> {
    use treeattn::backend::launch::bwd::{DqMode, MainKernel};
    use treeattn_lab::gpu_check::plan::{issue_pack, Launch, PlanReport, H100_SMS};
    let pack = a.pack.as_deref().ok_or_else(|| {
        Error::Usage("--plan-only needs --pack FILE (or @grpo, @compaction)".into())
    })?;
    let kv_end: Vec<u32> = match pack.strip_prefix('@') {
        Some(name) => issue_pack(name)?.kv_end,
        None => {
            let st = treeattn::safetensors::read_file(std::path::Path::new(pack))?;
            st.get("kv_end")?
                .to_i64()?
                .into_iter()
                .enumerate()
                .map(|(i, x)| {
                    u32::try_from(x)
                        .map_err(|_| Error::Pack(format!("{pack}: kv_end[{i}] = {x} is not a u32")))
                })
                .collect::<Result<_>>()?
        }
    };
    let heads = to_usize("heads", a.heads.unwrap_or(16))?;
    let kv_heads = match a.kv_heads {
        Some(h) => to_usize("kv-heads", h)?,
        None => (heads / 4).max(1),
    };
    let head_dim = to_usize("head-dim", a.head_dim.unwrap_or(128))?;
    let shape = treeattn::backend::AttnShape {
        tokens: kv_end.len(),
        q_heads: heads,
        kv_heads,
        head_dim,
        v_head_dim: head_dim,
    };
    let mode = match a.dq_mode {
        Some(DqModeArg::Det) => DqMode::Deterministic,
        _ => DqMode::Atomic,
    };
    let kernel = a.main_kernel.map(|k| match k {
        MainKernelArg::OneMTile => MainKernel::OneMTile,
        MainKernelArg::TwoMTiles => MainKernel::TwoMTiles,
        MainKernelArg::TwoMTiles4w => MainKernel::TwoMTilesFourWarps,
    });
    let sms = match a.sms {
        Some(n) => to_usize("sms", n)?,
        None => H100_SMS,
    };
    let bps = a
        .blocks_per_sm
        .map(|b| {
            u32::try_from(b).map_err(|_| Error::Usage(format!("--blocks-per-sm {b} is too large")))
        })
        .transpose()?;
    let launch = if a.balanced {
        Launch::Balanced
    } else {
        Launch::Grid
    };
    let report = PlanReport::with_launch(&kv_end, shape, mode, kernel, sms, bps, launch)?;
    crate::args::emit(&if a.json {
        report.to_json().to_string() + "\n"
    } else {
        report.to_string()
    })
}

fn to_usize(name: &str, v: u64) -> Result<usize> {
    usize::try_from(v).map_err(|_| Error::Usage(format!("--{name} {v} is too large")))
}

#[cfg(any(feature = "cuda", feature = "emu"))]
pub fn run(a: GpuCheckArgs) -> Result<()> {
    use treeattn_lab::gpu_check::{run_to, CheckBackend, CheckOptions};
    if a.plan_only {
        return plan_only(&a);
    }
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
    opts.time_limit = a.time_limit.map(|s| s as f64);
    let mut out = std::io::stdout().lock();
    run_to(&opts, &mut out)
}

#[cfg(not(any(feature = "cuda", feature = "emu")))]
pub fn run(a: GpuCheckArgs) -> Result<()> {
    if a.plan_only {
        return plan_only(&a);
    }
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
        a.time_limit,
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
