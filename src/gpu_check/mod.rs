//! `treeattn gpu-check`: proves and times the CUDA forward on a real GPU in
//! one short run (scripts/gpu-check.sh carries the binary to the GPU machine).
//!
//! 1. Correctness: fresh random packs of several shapes (trees with edits,
//!    forests with padding, varlen, long causal chains; GQA; both head dims
//!    and dtypes), outputs poisoned with NaN before the launch, every element
//!    checked written, O compared by relative Frobenius error (≤ 1e-2 bf16,
//!    ≤ 2e-3 f16) and LSE by absolute error (≤ 1e-3) against an f64 reference
//!    on the same rounded inputs — the tolerances of tests/emu_fwd.rs. The
//!    per-key-tile kv_end bounds computed on the device are checked against
//!    a host scan.
//! 2. Timing: the kernel on tree packs against a plain causal run of the same
//!    kernel and size, inputs larger than L2 (three rotating input sets),
//!    warm-up, median of CUDA-event timings. FLOPs count visible pairs only
//!    (4·d per pair per head, DESIGN §7).
//!
//! The reference is the CPU backend (`backend::cpu::attention_forward::<f64>`).
//!
//! The harness lives outside the backend (it is a test driver, and the only
//! user of the rollout generators' mask builder next to the kernels); it is
//! compiled only with the `cuda` feature.

use std::fmt::Write as _;

mod bwd;

use cudarc::driver::{CudaSlice, DeviceRepr};

use crate::backend::cpu::Cpu;
use crate::backend::cuda::{CudaBackend, Device, DevicePack};
use crate::backend::launch::bwd::DqMode;
use crate::backend::launch::sdcc::SdccElem;
use crate::backend::launch::{count_tiles, FwdTraits, KernelElem};
use crate::backend::{
    AttentionBackend, AttnArgs, AttnParams, AttnShape, BackwardCall, Grads, HostAttention,
    HostSdcc, Saved, SdccArgs, SdccBackend, SdccLoss, SdccOut,
};
use crate::gen::MaskBuilder;
use crate::mask::PackMask;
use crate::rng::Rng;
use crate::{Error, Result};

/// What `gpu-check` runs.
#[derive(Clone, Debug)]
pub struct CheckOptions {
    /// CUDA device ordinal.
    pub device: usize,
    /// Seed of the random packs and inputs; `None`: from the clock.
    pub seed: Option<u64>,
    /// Pack length of the timing runs.
    pub timing_tokens: usize,
    /// Query heads of the timing runs (kv heads: a quarter, GQA).
    pub timing_q_heads: usize,
    /// Timed launches per case (after 5 warm-up launches).
    pub reps: usize,
}

impl Default for CheckOptions {
    fn default() -> Self {
        CheckOptions {
            device: 0,
            seed: None,
            timing_tokens: 16_384,
            timing_q_heads: 16,
            reps: 50,
        }
    }
}

/// The reference: the CPU backend in f64 on the same rounded inputs, no
/// rotary (the forward timings and checks here run without it; part 2 checks
/// rotary). Returns (O [tokens, hq, d], LSE [hq, tokens]).
fn reference(
    q: &[f64],
    k: &[f64],
    v: &[f64],
    s: AttnShape,
    kv_end: &[u32],
    scale: f64,
) -> Result<(Vec<f64>, Vec<f64>)> {
    let positions = vec![0u32; kv_end.len()];
    let mask = crate::mask::PackMask::new(kv_end, &positions)?;
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
) -> Result<crate::backend::AttnOut<f32, f32>> {
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

/// The device forward through the contract.
#[allow(clippy::too_many_arguments)]
pub(super) fn dev_forward<T: KernelElem + DeviceRepr>(
    be: &CudaBackend,
    q: &CudaSlice<T>,
    k: &CudaSlice<T>,
    v: &CudaSlice<T>,
    shape: AttnShape,
    pack: &DevicePack,
    params: &AttnParams,
    o: &mut CudaSlice<T>,
    lse: &mut CudaSlice<f32>,
) -> Result<()> {
    let args = AttnArgs::<Device, T>::new(q, k, v, shape, pack, *params)?;
    be.forward(&args, o, lse)
}

/// The device backward through the contract's validation, with dQ summed
/// as `mode` says.
#[allow(clippy::too_many_arguments)]
pub(super) fn dev_backward<T: KernelElem + DeviceRepr>(
    be: &CudaBackend,
    q: &CudaSlice<T>,
    k: &CudaSlice<T>,
    v: &CudaSlice<T>,
    o: &CudaSlice<T>,
    lse: &CudaSlice<f32>,
    d_o: &CudaSlice<T>,
    shape: AttnShape,
    pack: &DevicePack,
    params: &AttnParams,
    mode: DqMode,
    dq: &mut CudaSlice<T>,
    dk: &mut CudaSlice<T>,
    dv: &mut CudaSlice<T>,
) -> Result<()> {
    let args = AttnArgs::<Device, T>::new(q, k, v, shape, pack, *params)?;
    let call = BackwardCall::new(args, Saved { o, lse }, d_o, Grads { dq, dk, dv })?;
    be.backward_with_mode(call, mode)
}

/// The device SDCC forward KL (fused, or the unfused baseline).
#[allow(clippy::too_many_arguments)]
pub(super) fn dev_sdcc<T: SdccElem + DeviceRepr>(
    be: &CudaBackend,
    unfused: bool,
    student: &CudaSlice<T>,
    teacher: &CudaSlice<T>,
    vocab: usize,
    pairs: &[(u32, u32)],
    weights: &[f32],
    tau: f32,
    grad: &mut CudaSlice<f32>,
) -> Result<SdccLoss> {
    let args = SdccArgs::<Device, T>::new(student, teacher, vocab, pairs, weights, tau)?;
    if unfused {
        be.sdcc_forward_kl_unfused(&args, grad)
    } else {
        be.sdcc_forward_kl(&args, grad)
    }
}

fn cerr(what: &'static str) -> impl Fn(cudarc::driver::DriverError) -> Error {
    move |e| Error::Cuda(format!("{what}: {e}"))
}

/// One correctness case on the device; returns (O rel. error, LSE abs.
/// error, tolerance) or the first problem found.
fn check_case<T: KernelElem + DeviceRepr>(
    be: &CudaBackend,
    rng: &mut Rng,
    pack: &MaskBuilder,
    shape: AttnShape,
) -> Result<(f64, f64, f64)> {
    let s = be.stream();
    let mask = pack.mask()?;
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
    let dp = be.upload_pack(mask)?;
    let dq = s.clone_htod(&q).map_err(cerr("upload q"))?;
    let dk = s.clone_htod(&k).map_err(cerr("upload k"))?;
    let dv = s.clone_htod(&v).map_err(cerr("upload v"))?;
    let mut dout = s
        .clone_htod(&vec![T::from_f32(f32::NAN); shape.q_len()])
        .map_err(cerr("poison o"))?;
    let mut dlse = s
        .clone_htod(&vec![f32::NAN; shape.q_heads * shape.tokens])
        .map_err(cerr("poison lse"))?;
    dev_forward(be, &dq, &dk, &dv, shape, &dp, &params, &mut dout, &mut dlse)?;
    let o = s.clone_dtoh(&dout).map_err(cerr("download o"))?;
    let lse = s.clone_dtoh(&dlse).map_err(cerr("download lse"))?;
    let (lo, hi, tile) = dp.tile_bounds();
    let lo = s.clone_dtoh(lo).map_err(cerr("download tile bounds"))?;
    let hi = s.clone_dtoh(hi).map_err(cerr("download tile bounds"))?;
    for (t, c) in pack.kv_end.chunks(tile as usize).enumerate() {
        let want = (
            *c.iter().min().expect("tile"),
            *c.iter().max().expect("tile"),
        );
        if (lo[t], hi[t]) != want {
            return Err(Error::Cuda(format!(
                "tile {t}: device kv_end bounds {:?}, host {want:?}",
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
    let tol = crate::backend::tolerance::attention(T::DTYPE).o_rel;
    Ok(((num / den.max(f64::MIN_POSITIVE)).sqrt(), lse_err, tol))
}

/// Random device input sets (q, k, v) for timing: enough of them that one
/// pass over the sets is several times a 60 MB L2.
fn timing_inputs<T: KernelElem + DeviceRepr>(
    be: &CudaBackend,
    rng: &mut Rng,
    shape: AttnShape,
) -> Result<Vec<[CudaSlice<T>; 3]>> {
    let s = be.stream();
    let set_bytes = (shape.q_len() + 2 * shape.kv_len()) * 2;
    let sets = (240usize << 20).div_ceil(set_bytes).clamp(2, 16);
    let mut inputs = Vec::with_capacity(sets);
    for _ in 0..sets {
        let mut mk = |n: usize| -> Result<CudaSlice<T>> {
            let h: Vec<T> = (0..n)
                .map(|_| T::from_f32(rng.signed_unit() * 2.0))
                .collect();
            s.clone_htod(&h).map_err(cerr("upload timing inputs"))
        };
        inputs.push([mk(shape.q_len())?, mk(shape.kv_len())?, mk(shape.kv_len())?]);
    }
    Ok(inputs)
}

/// Timing of one pack: median milliseconds over `reps` launches (after 5
/// warm-up launches), each timed by a pair of CUDA events, rotating over the
/// input sets so that inputs never sit in L2.
fn time_pack<T: KernelElem + DeviceRepr>(
    be: &CudaBackend,
    inputs: &[[CudaSlice<T>; 3]],
    pack: &MaskBuilder,
    shape: AttnShape,
    reps: usize,
) -> Result<f64> {
    let s = be.stream();
    let ctx = be.context();
    let dp = be.upload_pack(pack.mask()?)?;
    let sets = inputs.len();
    let mut out: CudaSlice<T> = s
        .clone_htod(&vec![T::from_f32(0.0); shape.q_len()])
        .map_err(cerr("alloc o"))?;
    let mut lse = s
        .alloc_zeros::<f32>(shape.q_heads * shape.tokens)
        .map_err(cerr("alloc lse"))?;
    let params = AttnParams::new(shape.head_dim);
    let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
    let mut times = Vec::with_capacity(reps);
    for i in 0..reps.max(1) + 5 {
        let [q, k, v] = &inputs[i % sets];
        let start = ctx.new_event(flags).map_err(cerr("event"))?;
        let end = ctx.new_event(flags).map_err(cerr("event"))?;
        start.record(s).map_err(cerr("event record"))?;
        dev_forward(be, q, k, v, shape, &dp, &params, &mut out, &mut lse)?;
        end.record(s).map_err(cerr("event record"))?;
        let ms = start.elapsed_ms(&end).map_err(cerr("event timing"))? as f64;
        if i >= 5 {
            times.push(ms);
        }
    }
    s.synchronize().map_err(cerr("synchronize after timing"))?;
    times.sort_by(|a, b| a.total_cmp(b));
    Ok(times[times.len() / 2])
}

/// Runs the checks and the timings; returns the report with the summary
/// table last, or `Err` naming the first failed check.
pub fn run(opts: &CheckOptions) -> Result<String> {
    let seed = opts.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1)
    });
    let mut rng = Rng::new(seed);
    let be = CudaBackend::new(opts.device)?;
    let mut rep = String::new();
    let _ = writeln!(rep, "gpu-check on {} (seed {seed})", be.describe()?);

    // 1. correctness
    let mut cases: Vec<(String, MaskBuilder, AttnShape, bool)> = Vec::new();
    let shape = |tokens, q_heads, kv_heads, head_dim| AttnShape {
        tokens,
        q_heads,
        kv_heads,
        head_dim,
    };
    {
        let mut p = MaskBuilder::new();
        p.push_tree(&mut rng, 0, 120, 3, true);
        p.push_tree(&mut rng, 0, 120, 3, true);
        let n = p.kv_end.len();
        cases.push(("trees bf16 d64 gqa 4/2".into(), p, shape(n, 4, 2, 64), true));
        let mut p = MaskBuilder::new();
        p.push_tree(&mut rng, 0, 200, 3, true);
        p.push_padding(13);
        let n = p.kv_end.len();
        cases.push((
            "tree+pad f16 d128 gqa 4/1".into(),
            p,
            shape(n, 4, 1, 128),
            false,
        ));
        let mut p = MaskBuilder::new();
        while p.kv_end.len() < 1500 {
            let n = rng.range(1, 300);
            p.push_sequence(n);
        }
        p.push_padding(7);
        let n = p.kv_end.len();
        cases.push(("varlen+pad bf16 d128".into(), p, shape(n, 8, 8, 128), true));
        let mut p = MaskBuilder::new();
        let n = rng.range(700, 1100);
        p.push_sequence(n);
        cases.push(("causal f16 d64".into(), p, shape(n, 2, 1, 64), false));
        let mut p = MaskBuilder::new();
        p.push_fan(rng.range(100, 300), 16, rng.range(20, 90));
        let n = p.kv_end.len();
        cases.push(("grpo fan bf16 d128".into(), p, shape(n, 4, 2, 128), true));
    }
    let mut failures = Vec::new();
    let _ = writeln!(
        rep,
        "\ncorrectness (O: relative Frobenius error; LSE: max absolute error; f64 reference)"
    );
    for (name, pack, sh, bf) in &cases {
        let r = if *bf {
            check_case::<half::bf16>(&be, &mut rng, pack, *sh)
        } else {
            check_case::<half::f16>(&be, &mut rng, pack, *sh)
        };
        match r {
            Ok((oe, le, tol)) => {
                let dtype = if *bf {
                    crate::backend::launch::Dtype::Bf16
                } else {
                    crate::backend::launch::Dtype::F16
                };
                let lse_tol = crate::backend::tolerance::attention(dtype).lse_abs;
                let ok = oe <= tol && le <= lse_tol;
                let _ = writeln!(
                    rep,
                    "  {:<28} L={:<5} O err {:.2e} (tol {:.0e})  LSE err {:.2e} (tol {:.0e})  {}",
                    name,
                    sh.tokens,
                    oe,
                    tol,
                    le,
                    lse_tol,
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

    // 2. timing
    let n = opts.timing_tokens.max(256);
    let hq = opts.timing_q_heads.max(4);
    let hk = hq / 4;
    let mut timing: Vec<(String, MaskBuilder)> = Vec::new();
    let mut p = MaskBuilder::new();
    let system = n / 8;
    p.push_fan(system, 4, (n - system) / 4);
    timing.push(("compaction: prompt + 4 views".into(), p));
    let mut p = MaskBuilder::new();
    let prompt = n / 16;
    p.push_fan(prompt, 16, (n - prompt) / 16);
    timing.push(("grpo: prompt + 16 responses".into(), p));
    let mut p = MaskBuilder::new();
    while p.kv_end.len() < n {
        p.push_tree(&mut rng, 0, n / 16, 3, true);
    }
    p.kv_end.truncate(n);
    p.position_ids.truncate(n);
    for (k, e) in p.kv_end.iter_mut().enumerate() {
        *e = (*e).min(n as u32).max(k as u32 + 1);
    }
    timing.push(("random trees".into(), p));
    let mut table = String::new();
    let _ = writeln!(
        table,
        "{:<30} {:>4} {:>6} {:>8} {:>6} {:>6} {:>8} {:>8} {:>9} {:>7}",
        "pack (bf16, hq/hk)",
        "d",
        "L",
        "pairs M",
        "skip%",
        "full%",
        "ms",
        "TFLOP/s",
        "causal ms",
        "speedup"
    );
    let mut causal = MaskBuilder::new();
    causal.push_sequence(n);
    for d in [128usize, 64] {
        let sh = shape(n, hq, hk, d);
        let traits = FwdTraits::for_head_dim(d)?;
        let inputs = timing_inputs::<half::bf16>(&be, &mut rng, sh)?;
        let causal_ms = time_pack(&be, &inputs, &causal, sh, opts.reps)?;
        let rows = std::iter::once((format!("causal {hq}/{hk}"), &causal))
            .chain(timing.iter().map(|(name, p)| (name.clone(), p)));
        for (name, pack) in rows {
            let ms = if std::ptr::eq(pack, &causal) {
                causal_ms
            } else {
                time_pack(&be, &inputs, pack, sh, opts.reps)?
            };
            let pairs = pack.mask()?.visible_pairs();
            let (skip, full, part) = count_tiles(&pack.kv_end, &traits);
            let all = (skip + full + part).max(1) as f64;
            let tflops = 4.0 * d as f64 * hq as f64 * pairs as f64 / (ms * 1e-3) / 1e12;
            let _ = writeln!(
                table,
                "{:<30} {:>4} {:>6} {:>8.1} {:>6.1} {:>6.1} {:>8.3} {:>8.1} {:>9.3} {:>7.2}",
                name,
                d,
                n,
                pairs as f64 / 1e6,
                100.0 * skip as f64 / all,
                100.0 * full as f64 / all,
                ms,
                tflops,
                causal_ms,
                causal_ms / ms
            );
        }
    }
    let tiles = FwdTraits::for_head_dim(128)?;
    let _ = writeln!(
        rep,
        "\ntiming: median of {} launches after 5 warm-up, CUDA events, rotating input sets > L2; \
         FLOPs = 4·d·heads per visible pair; tiles {}x{} (skip%: never loaded, full%: no mask)",
        opts.reps, tiles.block_m, tiles.block_n
    );
    rep.push_str(&table);
    // Backward and SDCC (gpu_check/bwd.rs).
    failures.extend(bwd::run(&be, &mut rng, opts, &mut rep)?);
    if failures.is_empty() {
        Ok(rep)
    } else {
        Err(Error::Cuda(format!(
            "gpu-check failed ({}):\n{rep}",
            failures.join(", ")
        )))
    }
}

// Needs the emulator (feature `emu`: on in `cargo test`).
#[cfg(all(test, feature = "emu"))]
mod tests {
    use super::*;
    use crate::backend::emu;

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

    #[test]
    fn without_a_driver_the_check_says_so() {
        if crate::backend::cuda::driver_present() {
            return; // a GPU machine: scripts/gpu-check.sh runs the real thing
        }
        let e = run(&CheckOptions::default()).unwrap_err();
        assert!(e.to_string().contains("no CUDA driver"), "{e}");
    }
}
