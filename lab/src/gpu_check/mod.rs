//! `treeattn gpu-check`: proves and times the CUDA kernels in one short
//! run — on a real GPU (`--backend cuda`; scripts/gpu-check.sh carries the
//! binary to the GPU machine), or the very same flow on the SIMT emulator
//! at small sizes (`--backend emu`), so that the GPU run is never the flow's
//! first run.
//!
//! 1. Forward correctness: fresh random packs of several shapes (trees with
//!    edits, forests with padding, varlen, long causal chains, a GRPO fan;
//!    GQA; both head dims and dtypes), outputs poisoned with NaN before the
//!    launch, every element checked written, O compared by relative
//!    Frobenius error and LSE by absolute error against an f64 reference on
//!    the same rounded inputs, with the bounds of `backend::tolerance`. The
//!    per-key-tile kv_end bounds computed by the kernel are checked against
//!    a host scan.
//! 2. Backward and SDCC correctness (bwd.rs).
//! 3. With `--dump DIR`, the packs, inputs and our outputs of every case of
//!    1 and 2, for `scripts/gpu-anchor.py` (dump.rs); written before any
//!    timing, so that a fault there keeps it.
//! 4. Timing (timing.rs): the forward on tree packs against a plain causal
//!    run of the same kernel and size, plus rows with rotary, GQA 8:1 and a
//!    65,536-token pack; inputs larger than L2 (rotating input sets),
//!    warm-up, then all repetitions between one pair of CUDA events (on the
//!    emulator its wall clock, marked as meaningless). FLOPs count visible
//!    pairs only (4·d per pair per head, DESIGN §7). Then forward + backward
//!    and SDCC timings (bwd.rs). Two passes: first the GRPO pack at d 128
//!    against causal (forward, forward + backward in both dQ modes, at most
//!    10 reps), then the rest. With `--dump`, each row's pack and times go
//!    to `DIR/timing/` as the row finishes (timing.json whole at any
//!    moment), for the anchor; `--time-limit` skips the rows that would not
//!    fit (budget.rs).
//!
//! `--check-only` stops after 3; `--profile` runs only one forward +
//! backward for a profiler (timing.rs).
//!
//! The reference is the CPU backend (`backend::cpu`). Every kernel call
//! goes through the contract traits, on the target of target.rs. Each
//! section is printed (and flushed) as it finishes.
//!
//! Compiled with the `cuda` feature (the GPU target) or the `emu` feature
//! (the emulator target), or both; [`plan`] (`--plan-only`: the backward
//! launch and its predicted SM utilization, no kernel) in every build.

use std::fmt::Write as _;
use std::path::PathBuf;

mod budget;
mod bwd;
mod dump;
pub mod plan;
mod target;
mod timing;

pub use dump::DUMP_FORMAT;
pub use timing::TIMING_FORMAT;

use serde_json::json;

use crate::gen::MaskBuilder;
use dump::{Dump, DumpTensor};
use target::{DevElem, Target};
use timing::Timings;
use treeattn::backend::cpu::Cpu;
use treeattn::backend::launch::{Dtype, KernelElem};
use treeattn::backend::{
    AttnArgs, AttnParams, AttnShape, HostAttention, HostSdcc, SdccArgs, SdccOut,
};
use treeattn::mask::PackMask;
use treeattn::rng::Rng;
use treeattn::{Error, Result};

/// Where `gpu-check` runs its kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CheckBackend {
    /// A CUDA device (needs the `cuda` feature and a GPU).
    Cuda,
    /// The SIMT emulator on the CPU (needs the `emu` feature); small sizes,
    /// timings meaningless.
    Emu,
}

impl CheckBackend {
    /// `cuda` where this build has it, else `emu`.
    pub fn default_for_build() -> CheckBackend {
        if cfg!(feature = "cuda") {
            CheckBackend::Cuda
        } else {
            CheckBackend::Emu
        }
    }
    /// `"cuda"` or `"emu"`.
    pub fn name(self) -> &'static str {
        match self {
            CheckBackend::Cuda => "cuda",
            CheckBackend::Emu => "emu",
        }
    }
}

/// What `gpu-check` runs.
#[derive(Clone, Debug)]
pub struct CheckOptions {
    /// The target: a CUDA device or the emulator.
    pub backend: CheckBackend,
    /// CUDA device ordinal (cuda only).
    pub device: usize,
    /// Seed of the random packs and inputs; `None`: from the clock.
    pub seed: Option<u64>,
    /// Pack length of the timing runs.
    pub timing_tokens: usize,
    /// Query heads of the timing runs (kv heads: a quarter, GQA).
    pub timing_q_heads: usize,
    /// Timed launches per case (after warm-up launches).
    pub reps: usize,
    /// Correctness packs at the emulator's sizes (a few hundred tokens)
    /// instead of the GPU's (up to ~1,500).
    pub small: bool,
    /// The large vocabulary of the SDCC checks and timing.
    pub sdcc_vocab: usize,
    /// Write every correctness case's pack, inputs and outputs here (and,
    /// after the timings, the timing packs and our times in `timing/`).
    pub dump: Option<PathBuf>,
    /// Correctness only: no timing sections (the sanitizer runs, and the
    /// correctness process of scripts/gpu-check.sh).
    pub check_only: bool,
    /// Timing only: no correctness sections (the timing process of
    /// scripts/gpu-check.sh, after a correctness process).
    pub timing_only: bool,
    /// Only one forward + backward of one tree pack at the timing length
    /// (d 128), no checks: what a profiler looks at.
    pub profile: bool,
    /// Seconds the run may take from `started` (`--time-limit`): timing
    /// rows whose reserve the time left does not cover are skipped
    /// (budget.rs); `None`: no limit.
    pub time_limit: Option<f64>,
    /// When the run started (the process start in the CLI).
    pub started: std::time::Instant,
}

impl CheckOptions {
    /// The defaults of a target: the GPU's sizes for `cuda` (timing packs of
    /// 16k tokens, 16 heads, 50 reps, vocab 151,936); small ones for `emu`
    /// (256 tokens, 4 heads, 1 rep, vocab 8,192).
    pub fn for_backend(backend: CheckBackend) -> CheckOptions {
        match backend {
            CheckBackend::Cuda => CheckOptions {
                backend,
                device: 0,
                seed: None,
                timing_tokens: 16_384,
                timing_q_heads: 16,
                reps: 50,
                small: false,
                sdcc_vocab: 151_936,
                dump: None,
                check_only: false,
                timing_only: false,
                profile: false,
                time_limit: None,
                started: std::time::Instant::now(),
            },
            CheckBackend::Emu => CheckOptions {
                backend,
                device: 0,
                seed: None,
                timing_tokens: 256,
                timing_q_heads: 4,
                reps: 1,
                small: true,
                sdcc_vocab: 8_192,
                dump: None,
                check_only: false,
                timing_only: false,
                profile: false,
                time_limit: None,
                started: std::time::Instant::now(),
            },
        }
    }
}

impl Default for CheckOptions {
    fn default() -> Self {
        CheckOptions::for_backend(CheckBackend::default_for_build())
    }
}

/// The report being written: each line goes out (and is flushed) as it is
/// produced, so that a run cut short keeps what came before.
pub(crate) struct Report<'w> {
    out: &'w mut dyn std::io::Write,
}

impl std::fmt::Write for Report<'_> {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        self.out
            .write_all(s.as_bytes())
            .map_err(|_| std::fmt::Error)?;
        if s.contains('\n') {
            self.out.flush().map_err(|_| std::fmt::Error)?;
        }
        Ok(())
    }
}

/// The reference: the CPU backend in f64 on the same rounded inputs, no
/// rotary (the forward checks here run without it; bwd.rs checks rotary).
/// Returns (O [tokens, hq, d], LSE [hq, tokens]).
fn reference(
    q: &[f64],
    k: &[f64],
    v: &[f64],
    s: AttnShape,
    kv_end: &[u32],
    scale: f64,
) -> Result<(Vec<f64>, Vec<f64>)> {
    let positions = vec![0u32; kv_end.len()];
    let mask = treeattn::mask::PackMask::new(kv_end, &positions)?;
    let mut params = AttnParams::new(s.head_dim);
    params.softmax_scale = scale;
    let out = Cpu::default().forward_owned(&AttnArgs::new(q, k, v, s, mask, params)?)?;
    Ok((out.o, out.lse))
}

/// The CPU backend's f32 forward (the reference of part 2).
pub(super) fn cpu_forward(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    shape: AttnShape,
    mask: PackMask<'_>,
    params: &AttnParams,
) -> Result<treeattn::backend::AttnOut<f32, f32>> {
    Cpu::default().forward_owned(&AttnArgs::new(q, k, v, shape, mask, *params)?)
}

/// The CPU backend's SDCC forward KL (f32), the reference of part 2.
pub(super) fn cpu_sdcc(
    student: &[f32],
    teacher: &[f32],
    vocab: usize,
    pairs: &[(u32, u32)],
    weights: &[f32],
    tau: f32,
) -> Result<SdccOut<f32>> {
    let args = SdccArgs::new(student, teacher, vocab, pairs, weights, tau)?;
    Cpu::default().sdcc_owned(&args)
}

/// The kernel error type of an element type (`SdccElem` also takes f32).
fn dtype_of<T: KernelElem>() -> Dtype {
    T::DTYPE
}

/// The manifest fields every case shares.
pub(super) fn case_meta<T: KernelElem>(shape: AttnShape, params: &AttnParams) -> serde_json::Value {
    let tol = treeattn::backend::tolerance::attention(T::DTYPE);
    json!({
        "dtype": T::NAME,
        "tokens": shape.tokens,
        "q_heads": shape.q_heads,
        "kv_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "softmax_scale": params.softmax_scale,
        "rope": params.rope.map(|r| json!({"base": r.base, "dims": r.dims})),
        "tolerance": {"o_rel": tol.o_rel, "lse_abs": tol.lse_abs, "grad_rel": tol.grad_rel},
    })
}

/// What one forward case measured.
struct FwdResult {
    o_err: f64,
    lse_err: f64,
}

/// One forward correctness case on the target; the first problem found is
/// an `Err`. With a dump, the case's pack, inputs and outputs go into it.
fn check_case<D: Target, T: KernelElem + DevElem>(
    be: &D,
    rng: &mut Rng,
    pack: &MaskBuilder,
    shape: AttnShape,
    name: &str,
    dump: Option<&mut Dump>,
) -> Result<FwdResult> {
    let gen = |rng: &mut Rng, n: usize, amp: f32| -> (Vec<T>, Vec<f64>) {
        let x: Vec<T> = (0..n)
            .map(|_| T::from_f32(rng.signed_unit() * amp))
            .collect();
        let f = x.iter().map(|e| e.to_f32() as f64).collect();
        (x, f)
    };
    let (q, qf) = gen(rng, shape.q_len(), 2.0);
    let (k, kf) = gen(rng, shape.kv_len(), 2.0);
    let (v, vf) = gen(rng, shape.kv_len(), 1.0);
    let params = AttnParams::new(shape.head_dim);
    let dp = be.pack(pack)?;
    let dq = be.up(&q)?;
    let dk = be.up(&k)?;
    let dv = be.up(&v)?;
    let mut dout = be.filled(shape.q_len(), T::from_f32(f32::NAN))?;
    let mut dlse = be.filled(shape.q_heads * shape.tokens, f32::NAN)?;
    let ms =
        be.time_ms(&mut || be.forward(&dq, &dk, &dv, shape, &dp, &params, &mut dout, &mut dlse))?;
    let o = be.down(&dout)?;
    let lse = be.down(&dlse)?;
    let (lo, hi, tile) = be.tile_bounds(&dp)?;
    for (t, c) in pack.kv_end.chunks(tile as usize).enumerate() {
        let want = (
            *c.iter().min().expect("tile"),
            *c.iter().max().expect("tile"),
        );
        if (lo[t], hi[t]) != want {
            return Err(Error::Cuda(format!(
                "tile {t}: kernel kv_end bounds {:?}, host {want:?}",
                (lo[t], hi[t])
            )));
        }
    }
    let (ro, rl) = reference(&qf, &kf, &vf, shape, &pack.kv_end, params.softmax_scale)?;
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (i, (x, r)) in o.iter().zip(&ro).enumerate() {
        let x = x.to_f32() as f64;
        if !x.is_finite() {
            return Err(Error::Cuda(format!(
                "O[{i}] = {x}: not written or not finite"
            )));
        }
        num += (x - r) * (x - r);
        den += r * r;
    }
    let mut lse_err = 0.0f64;
    for (i, (&x, &r)) in lse.iter().zip(&rl).enumerate() {
        if r == f64::NEG_INFINITY {
            if x != f32::NEG_INFINITY {
                return Err(Error::Cuda(format!(
                    "LSE[{i}] = {x} for a row with no visible key (expected -inf)"
                )));
            }
        } else if !x.is_finite() {
            return Err(Error::Cuda(format!(
                "LSE[{i}] = {x}: not written or not finite"
            )));
        } else {
            lse_err = lse_err.max((x as f64 - r).abs());
        }
    }
    let o_err = (num / den.max(f64::MIN_POSITIVE)).sqrt();
    if let Some(dump) = dump {
        let (l, hq, hk, d) = (shape.tokens, shape.q_heads, shape.kv_heads, shape.head_dim);
        let mut meta = case_meta::<T>(shape, &params);
        meta["kind"] = json!("forward");
        meta["dq_mode"] = serde_json::Value::Null;
        meta["ours_ms"] = json!({"fwd": ms, "bwd": null});
        meta["errors"] = json!({"o_rel": o_err, "lse_abs": lse_err});
        dump.case(
            name,
            meta,
            &[
                ("kv_end", DumpTensor::index(&pack.kv_end)),
                ("position_ids", DumpTensor::index(&pack.position_ids)),
                ("q", DumpTensor::elems(&q, &[l, hq, d])),
                ("k", DumpTensor::elems(&k, &[l, hk, d])),
                ("v", DumpTensor::elems(&v, &[l, hk, d])),
                ("o", DumpTensor::elems(&o, &[l, hq, d])),
                ("lse", DumpTensor::f32s(&lse, &[hq, l])),
            ],
        )?;
    }
    Ok(FwdResult { o_err, lse_err })
}

/// Warm-up launches before timed ones: 5 on a GPU, 1 on the emulator.
fn warmup<D: Target>(gpu: usize) -> usize {
    if D::REAL_TIMING {
        gpu
    } else {
        1
    }
}

/// Runs the check on `opts.backend`, printing each section to `out` as it
/// finishes (flushed), the timing tables last; `Err` names the failed
/// checks (or the fault that stopped the run).
pub fn run_to(opts: &CheckOptions, out: &mut dyn std::io::Write) -> Result<()> {
    let mut rep = Report { out };
    match opts.backend {
        #[cfg(feature = "cuda")]
        CheckBackend::Cuda => {
            let be = target::CudaTarget {
                be: treeattn::backend::cuda::CudaBackend::new(opts.device)?,
            };
            flow(&be, opts, &mut rep)
        }
        #[cfg(feature = "emu")]
        CheckBackend::Emu => flow(&target::EmuTarget::default(), opts, &mut rep),
        #[allow(unreachable_patterns)]
        b => Err(Error::Unsupported(format!(
            "gpu-check --backend {}: this treeattn was built without the `{}` feature (rebuild with \
             `cargo build --release --features {}`)",
            b.name(),
            b.name(),
            b.name()
        ))),
    }
}

/// [`run_to`] into a string: the whole report, or `Err` naming the failed
/// checks followed by the report.
pub fn run(opts: &CheckOptions) -> Result<String> {
    let mut buf = Vec::new();
    let r = run_to(opts, &mut buf);
    let text = String::from_utf8_lossy(&buf).into_owned();
    match r {
        Ok(()) => Ok(text),
        Err(Error::Cuda(m)) if !text.is_empty() => Err(Error::Cuda(format!("{m}:\n{text}"))),
        Err(e) => Err(e),
    }
}

fn flow<D: Target>(be: &D, opts: &CheckOptions, rep: &mut Report<'_>) -> Result<()> {
    let seed = opts.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1)
    });
    let mut rng = Rng::new(seed);
    // Before anything is printed or run: a dump that cannot be written
    // stops the run. --timing-only writes only DIR/timing/, beside the dump
    // of a --check-only run.
    let mut dump = match opts.timing_only {
        true => None,
        false => opts.dump.as_deref().map(Dump::create).transpose()?,
    };
    let device = be.describe()?;
    let _ = writeln!(
        rep,
        "gpu-check --backend {} on {device} (seed {seed})",
        D::NAME
    );
    if opts.profile {
        return bwd::profile(be, &mut rng, opts, rep);
    }
    if opts.check_only && opts.timing_only {
        return Err(Error::Usage(
            "gpu-check: --check-only and --timing-only leave nothing to run".into(),
        ));
    }
    if opts.timing_only {
        // The dump's correctness part comes from another (check-only) run:
        // only DIR/timing/ is written here.
        return timings(be, &mut rng, opts, rep);
    }
    // Sizes: the GPU's, or the emulator's (it runs every thread of every
    // block on the CPU: a few hundred tokens per pack).
    let sz = |gpu: usize, emu: usize| if opts.small { emu } else { gpu };

    // 1. correctness
    let mut cases: Vec<(String, MaskBuilder, AttnShape, bool)> = Vec::new();
    let shape = |tokens, q_heads, kv_heads, head_dim| AttnShape {
        tokens,
        q_heads,
        kv_heads,
        head_dim,
        v_head_dim: head_dim,
    };
    {
        let mut p = MaskBuilder::new();
        p.push_tree(&mut rng, 0, sz(120, 24), 3, true);
        p.push_tree(&mut rng, 0, sz(120, 24), 3, true);
        let n = p.kv_end.len();
        cases.push(("trees bf16 d64 gqa 4/2".into(), p, shape(n, 4, 2, 64), true));
        let mut p = MaskBuilder::new();
        p.push_tree(&mut rng, 0, sz(200, 40), 3, true);
        p.push_padding(13);
        let n = p.kv_end.len();
        cases.push((
            "tree+pad f16 d128 gqa 4/1".into(),
            p,
            shape(n, 4, 1, 128),
            false,
        ));
        let mut p = MaskBuilder::new();
        while p.kv_end.len() < sz(1500, 200) {
            let n = rng.range(1, sz(300, 60));
            p.push_sequence(n);
        }
        p.push_padding(7);
        let n = p.kv_end.len();
        cases.push((
            "varlen+pad bf16 d128".into(),
            p,
            shape(n, sz(8, 4), sz(8, 4), 128),
            true,
        ));
        let mut p = MaskBuilder::new();
        let n = rng.range(sz(700, 150), sz(1100, 250));
        p.push_sequence(n);
        cases.push(("causal f16 d64".into(), p, shape(n, 2, 1, 64), false));
        let mut p = MaskBuilder::new();
        p.push_fan(
            rng.range(sz(100, 20), sz(300, 60)),
            16,
            rng.range(sz(20, 4), sz(90, 12)),
        );
        let n = p.kv_end.len();
        cases.push(("grpo fan bf16 d128".into(), p, shape(n, 4, 2, 128), true));
        // The paths only the timed sizes used to reach: a group of 4 query
        // heads per kv head over ~4.3k tokens (the kernels' in-block GQA
        // head loop at the timing shapes' 16 / 4 heads) ...
        let mut p = MaskBuilder::new();
        while p.kv_end.len() < sz(4300, 160) {
            p.push_tree(&mut rng, 0, sz(900, 40), 3, true);
        }
        let n = p.kv_end.len();
        cases.push((
            "trees bf16 d128 gqa 16/4".into(),
            p,
            shape(n, sz(16, 4), sz(4, 1), 128),
            true,
        ));
        // ... and a GRPO fan whose prompt is longer than 32 key tiles of 64
        // (2,048 keys): each answer's query tiles walk the prompt's tiles in
        // more than one step of the tile walk.
        let mut p = MaskBuilder::new();
        p.push_fan(sz(2200, 140), 16, rng.range(sz(30, 4), sz(60, 8)));
        let n = p.kv_end.len();
        cases.push((
            "grpo fan 2k prompt f16 d64".into(),
            p,
            shape(n, 4, 2, 64),
            false,
        ));
    }
    let mut failures = Vec::new();
    let _ = writeln!(
        rep,
        "\ncorrectness (O: relative Frobenius error; LSE: max absolute error; f64 reference)"
    );
    for (name, pack, sh, bf) in &cases {
        let (r, dtype) = if *bf {
            (
                check_case::<D, half::bf16>(be, &mut rng, pack, *sh, name, dump.as_mut()),
                dtype_of::<half::bf16>(),
            )
        } else {
            (
                check_case::<D, half::f16>(be, &mut rng, pack, *sh, name, dump.as_mut()),
                dtype_of::<half::f16>(),
            )
        };
        match r {
            Ok(FwdResult {
                o_err: oe,
                lse_err: le,
            }) => {
                let tol = treeattn::backend::tolerance::attention(dtype);
                let ok = oe <= tol.o_rel && le <= tol.lse_abs;
                let _ = writeln!(
                    rep,
                    "  {:<28} L={:<5} O err {:.2e} (tol {:.0e})  LSE err {:.2e} (tol {:.0e})  {}",
                    name,
                    sh.tokens,
                    oe,
                    tol.o_rel,
                    le,
                    tol.lse_abs,
                    if ok { "ok" } else { "FAIL" }
                );
                if !ok {
                    failures.push(name.clone());
                }
            }
            Err(e) => {
                let _ = writeln!(rep, "  {name:<28} L={:<5} FAIL: {e}", sh.tokens);
                failures.push(name.clone());
            }
        }
    }

    let _ = match failures.len() {
        0 => writeln!(rep, "all {} correctness checks passed", cases.len()),
        n => writeln!(rep, "{n} of {} correctness checks FAILED", cases.len()),
    };

    // 2. backward and SDCC correctness (bwd.rs)
    failures.extend(bwd::check(be, &mut rng, opts, rep, dump.as_mut())?);

    // 3. the dump, complete before any timing
    if let Some(d) = dump.take() {
        let path = d.commit(json!({
            "backend": D::NAME,
            "device": device,
            "seed": seed,
            "timing": if D::REAL_TIMING { "gpu" } else { "emulator wall clock (meaningless for a GPU)" },
            "failed": failures,
        }))?;
        let _ = writeln!(
            rep,
            "\ndump: {} (scripts/gpu-anchor.py {} runs PyTorch on these packs)",
            path.display(),
            path.display()
        );
    }

    // 4. timing (timing.rs, bwd.rs), recorded for the anchor
    if !opts.check_only {
        timings(be, &mut rng, opts, rep)?;
    }
    if failures.is_empty() {
        Ok(())
    } else {
        Err(Error::Cuda(format!(
            "gpu-check failed ({})",
            failures.join(", ")
        )))
    }
}

/// The timing sections (timing.rs, bwd.rs) in two passes
/// ([`timing::TimingSet::passes`]): first the GRPO pack at d 128 against
/// causal, forward then forward + backward in both dQ modes, with at most
/// 10 repetitions; then every other row with `--reps`. With a dump, each
/// row is written to `DIR/timing/timing.json` as it finishes (whole at any
/// moment; `"complete": true` once every section ended). Under
/// `--time-limit` a row starts only while the time left covers its reserve
/// (budget.rs); the others are skipped with a line.
fn timings<D: Target>(
    be: &D,
    rng: &mut Rng,
    opts: &CheckOptions,
    rep: &mut Report<'_>,
) -> Result<()> {
    let mut tm = Timings::default();
    tm.budget = budget::Budget::from(opts.started, opts.time_limit);
    if let Some(dir) = &opts.dump {
        let p = tm.open(dir, D::REAL_TIMING)?;
        let _ = writeln!(
            rep,
            "\ntiming rows go to {} as each finishes (scripts/gpu-anchor.py times PyTorch on the same packs)",
            p.join("timing.json").display()
        );
    }
    let set = timing::TimingSet::new(rng, opts);
    let [first, rest] = set.passes();
    let first_reps = opts.reps.min(10);
    let _ = writeln!(
        rep,
        "\ntiming, first pass: the rows that matter most (GRPO at d 128 against causal, forward and forward + \
         backward, both dQ modes; {first_reps} reps)"
    );
    timing::forward(be, rng, first_reps, rep, &mut tm, &first)?;
    bwd::timings(be, rng, opts, rep, &mut tm, &set, &first, first_reps, false)?;
    let _ = writeln!(
        rep,
        "\ntiming, second pass: every other row ({} reps)",
        opts.reps
    );
    timing::forward(be, rng, opts.reps, rep, &mut tm, &rest)?;
    bwd::timings(be, rng, opts, rep, &mut tm, &set, &rest, opts.reps, true)?;
    tm.finish()?;
    if !tm.skipped.is_empty() {
        let _ = writeln!(
            rep,
            "\n{} timing step(s) skipped by --time-limit {:.0} s (listed above and in timing.json)",
            tm.skipped.len(),
            opts.time_limit.unwrap_or(0.0)
        );
    }
    Ok(())
}

// Needs the emulator (feature `emu`: on in `cargo test`).
#[cfg(all(test, feature = "emu"))]
mod tests {
    use super::*;
    use treeattn::backend::emu;

    /// The generators give valid packs and the threaded reference agrees with
    /// the emulated kernel (so a gpu-check failure points at the GPU, not at
    /// this file).
    #[test]
    fn generators_and_reference_agree_with_the_emulator() {
        let mut rng = Rng::new(0x5eed ^ std::process::id() as u64);
        let mut packs = Vec::new();
        let mut p = MaskBuilder::new();
        p.push_tree(&mut rng, 0, 20, 3, true);
        p.push_padding(5);
        packs.push(p);
        let mut p = MaskBuilder::new();
        p.push_fan(30, 16, 7);
        packs.push(p);
        let mut p = MaskBuilder::new();
        p.push_sequence(70);
        p.push_sequence(9);
        packs.push(p);
        for p in &packs {
            let m = p.mask().unwrap();
            let shape = AttnShape {
                tokens: m.len(),
                q_heads: 4,
                kv_heads: 2,
                head_dim: 64,
                v_head_dim: 64,
            };
            let q: Vec<half::f16> = (0..shape.q_len())
                .map(|_| half::f16::from_f32(rng.signed_unit() * 2.0))
                .collect();
            let k: Vec<half::f16> = (0..shape.kv_len())
                .map(|_| half::f16::from_f32(rng.signed_unit() * 2.0))
                .collect();
            let v: Vec<half::f16> = (0..shape.kv_len())
                .map(|_| half::f16::from_f32(rng.signed_unit()))
                .collect();
            let f = |x: &[half::f16]| x.iter().map(|e| e.to_f64()).collect::<Vec<f64>>();
            let params = AttnParams::new(64);
            let out = emu::Emu::default()
                .forward_owned(&AttnArgs::new(&q[..], &k[..], &v[..], shape, m, params).unwrap())
                .unwrap();
            let (ro, rl) = reference(
                &f(&q),
                &f(&k),
                &f(&v),
                shape,
                &p.kv_end,
                params.softmax_scale,
            )
            .unwrap();
            let (mut num, mut den) = (0.0, 0.0);
            for (x, r) in out.o.iter().zip(&ro) {
                num += (x.to_f64() - r).powi(2);
                den += r * r;
            }
            assert!((num / den).sqrt() < 2e-3, "O error {}", (num / den).sqrt());
            for (x, r) in out.lse.iter().zip(&rl) {
                assert!(
                    (*x as f64 == *r) || ((*x as f64) - r).abs() < 1e-3,
                    "LSE {x} vs {r}"
                );
            }
        }
    }

    #[cfg(feature = "cuda")]
    #[test]
    fn without_a_driver_the_check_says_so() {
        if treeattn::backend::cuda::driver_present() {
            return; // a GPU machine: scripts/gpu-check.sh runs the real thing
        }
        let e = run(&CheckOptions::for_backend(CheckBackend::Cuda)).unwrap_err();
        assert!(e.to_string().contains("no CUDA driver"), "{e}");
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn the_cuda_target_needs_the_cuda_feature() {
        assert_eq!(CheckBackend::default_for_build(), CheckBackend::Emu);
        let e = run(&CheckOptions::for_backend(CheckBackend::Cuda)).unwrap_err();
        assert!(e.to_string().contains("--features cuda"), "{e}");
    }

    /// A dump that cannot be written stops the run before any kernel runs.
    #[test]
    fn an_unwritable_dump_stops_the_run_first() {
        let base = std::env::temp_dir().join(format!("treeattn-nodump-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        std::fs::create_dir_all(&base).unwrap();
        let mut opts = CheckOptions::for_backend(CheckBackend::Emu);
        let mut out = Vec::new();
        let mut rep = Report { out: &mut out };
        std::fs::write(base.join("file"), b"x").unwrap();
        opts.dump = Some(base.join("file").join("d"));
        let e = flow(&target::EmuTarget::default(), &opts, &mut rep).unwrap_err();
        assert!(matches!(e, Error::Io(_)), "{e}");
        assert!(out.is_empty(), "{}", String::from_utf8_lossy(&out));
        let left: Vec<_> = std::fs::read_dir(&base)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(left, vec![std::ffi::OsString::from("file")], "{left:?}");
        std::fs::remove_dir_all(&base).unwrap();
    }
}
