//! `treeattn gpu-check`, part 2: the backward and SDCC kernels, on the
//! target of target.rs (a GPU, or the emulator at small sizes).
//!
//! 1. Backward correctness: fresh random packs (trees with edits, padding,
//!    a GRPO fan, varlen; GQA; d 64 and 128; bf16 and f16; rotary on and
//!    off; both dQ modes), dQ, dK, dV poisoned with NaN before the launch,
//!    every element checked written, compared by relative Frobenius error
//!    (≤ 2e-2 bf16, ≤ 5e-3 f16) with the CPU backend's f32 backward on the
//!    same rounded inputs (O and LSE from the CPU forward) — the tolerances
//!    of tests/it/emu_bwd.rs; and the kernel forward on the same inputs
//!    (rotary included) against the CPU forward (O ≤ 1e-2 bf16, ≤ 2e-3
//!    f16). The deterministic mode is run twice and must be bit-identical.
//!    With a dump, each case's pack, inputs, dO, our O, LSE (the kernel
//!    forward) and dQ, dK, dV go into it.
//! 2. SDCC correctness against the CPU backend (loss 1e-4, gradient 1e-3
//!    relative), a large vocab (151,936 on a GPU) with −inf entries and a
//!    repeated student row.
//! 3. Timing of forward + backward (atomic dQ, and deterministic) on tree
//!    packs against a causal run of the same size, and against LogitTree's
//!    K+1 passes: one causal forward + backward per root-to-leaf branch of
//!    the same tree (branches read off the mask: the ancestors of each leaf
//!    token). FLOPs: 4·d per visible pair per head forward, 2.5x that
//!    backward (DESIGN §7), visible pairs only. Every row (d 64 and d 128)
//!    is timed again with the one-m-tile backward main kernel
//!    (`MainKernel::OneMTile`), side by side with the two-m-tile default
//!    (issue 26), and every d 64 row with the 4-warp two-m-tile kernel
//!    (`MainKernel::TwoMTilesFourWarps`, the d 64 default before the 8-warp
//!    one); part 1 checks every case with each of them.
//! 4. SDCC timing: the fused kernel against the unfused baseline of
//!    kernels/sdcc_kl.cu (log-softmax of both sides into f32 buffers, then
//!    an elementwise KL and the gradient), bf16 logits.
//!
//! On the emulator the timings are its wall clock: the tables keep their
//! layout, marked meaningless.

use std::fmt::Write as _;

use serde_json::json;

use super::dump::{Dump, DumpTensor};
use super::target::{DevElem, Target};
use super::timing::{self, TimingRecord, Timings};
use super::{case_meta, cpu_forward, cpu_sdcc, warmup, CheckOptions, Report};
use crate::gen::MaskBuilder;
use treeattn::backend::launch::bwd::{DqMode, MainKernel};
use treeattn::backend::launch::{Dtype, KernelElem};
use treeattn::backend::tolerance::SDCC;
use treeattn::backend::{AttnParams, AttnShape, Rope};
use treeattn::rng::Rng;
use treeattn::{Error, Result};

/// Gradient tolerance per element type: the table the emulator tests use.
fn tol(dtype: Dtype) -> f64 {
    treeattn::backend::tolerance::attention(dtype).grad_rel
}

fn rel_err<T: KernelElem>(what: &str, got: &[T], want: &[f32]) -> Result<f64> {
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (i, (x, &r)) in got.iter().zip(want).enumerate() {
        let x = x.to_f32() as f64;
        if !x.is_finite() {
            return Err(Error::Cuda(format!(
                "{what}[{i}] = {x}: not written or not finite"
            )));
        }
        num += (x - r as f64).powi(2);
        den += (r as f64).powi(2);
    }
    Ok((num / den.max(f64::MIN_POSITIVE)).sqrt())
}

/// Which backward a correctness row runs: the default, the balanced main
/// launch, or a main kernel kept selectable until timed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Variant {
    Default,
    Balanced,
    OneMTile,
    FourWarps,
}

/// One backward case: returns the relative errors of the kernel forward's O
/// (same params, rotary included) and of dQ, dK, dV.
#[allow(clippy::too_many_arguments)]
fn check_backward<D: Target, T: KernelElem + DevElem>(
    be: &D,
    rng: &mut Rng,
    pack: &MaskBuilder,
    shape: AttnShape,
    rope: Option<Rope>,
    mode: DqMode,
    name: &str,
    dump: Option<&mut Dump>,
) -> Result<[f64; 4]> {
    let mask = pack.mask()?;
    let gen = |rng: &mut Rng, n: usize, amp: f32| -> (Vec<T>, Vec<f32>) {
        let x: Vec<T> = (0..n)
            .map(|_| T::from_f32(rng.signed_unit() * amp))
            .collect();
        let f = x.iter().map(|e| e.to_f32()).collect();
        (x, f)
    };
    let (q, qf) = gen(rng, shape.q_len(), 2.0);
    let (k, kf) = gen(rng, shape.kv_len(), 2.0);
    let (v, vf) = gen(rng, shape.kv_len(), 1.0);
    let (d_o, dof) = gen(rng, shape.q_len(), 1.0);
    let params = AttnParams {
        rope,
        ..AttnParams::new(shape.head_dim)
    };
    let fwd = cpu_forward(&qf, &kf, &vf, shape, mask, &params)?;
    let o: Vec<T> = fwd.o.iter().map(|&x| T::from_f32(x)).collect();
    let of: Vec<f32> = o.iter().map(|e| e.to_f32()).collect();
    // The CPU backward of the O the kernel sees (rounded to T).
    let want = {
        use treeattn::backend::{AttnArgs, HostAttention, Saved};
        let args = AttnArgs::new(&qf[..], &kf[..], &vf[..], shape, mask, params)?;
        let rounded = Saved {
            o: &of[..],
            lse: &fwd.lse[..],
        };
        treeattn::backend::cpu::Cpu::default().backward_owned(&args, rounded, &dof)?
    };

    let dp = be.pack(pack)?;
    let (dq_in, dk_in, dv_in, do_in, o_in) =
        (be.up(&q)?, be.up(&k)?, be.up(&v)?, be.up(&d_o)?, be.up(&o)?);
    let lse_in = be.up(&fwd.lse)?;
    let mut bwd_ms = 0.0;
    let mut run = || -> Result<[Vec<T>; 3]> {
        let nan = T::from_f32(f32::NAN);
        let mut gq = be.filled(shape.q_len(), nan)?;
        let mut gk = be.filled(shape.kv_len(), nan)?;
        let mut gv = be.filled(shape.kv_len(), nan)?;
        bwd_ms = be.time_ms(&mut || {
            be.backward(
                &dq_in, &dk_in, &dv_in, &o_in, &lse_in, &do_in, shape, &dp, &params, mode, &mut gq,
                &mut gk, &mut gv,
            )
        })?;
        Ok([be.down(&gq)?, be.down(&gk)?, be.down(&gv)?])
    };
    let [gq, gk, gv] = run()?;
    if mode == DqMode::Deterministic {
        let again = run()?;
        let bits = |x: &[T]| bytemuck::cast_slice::<T, u16>(x).to_vec();
        if bits(&again[0]) != bits(&gq) {
            return Err(Error::Cuda(
                "deterministic dQ differs between two runs".into(),
            ));
        }
    }
    // The kernel forward on the same inputs (rotary included) against the
    // CPU forward: O within the forward's tolerance.
    let mut o_dev = be.filled(shape.q_len(), T::from_f32(f32::NAN))?;
    let mut lse_dev = be.filled(shape.q_heads * shape.tokens, f32::NAN)?;
    let fwd_ms = be.time_ms(&mut || {
        be.forward(
            &dq_in,
            &dk_in,
            &dv_in,
            shape,
            &dp,
            &params,
            &mut o_dev,
            &mut lse_dev,
        )
    })?;
    let o_dev = be.down(&o_dev)?;
    let lse_dev = be.down(&lse_dev)?;
    let errs = [
        rel_err("o", &o_dev, &fwd.o)?,
        rel_err("dq", &gq, &want.dq)?,
        rel_err("dk", &gk, &want.dk)?,
        rel_err("dv", &gv, &want.dv)?,
    ];
    if let Some(dump) = dump {
        let (l, hq, hk, d) = (shape.tokens, shape.q_heads, shape.kv_heads, shape.head_dim);
        let mut meta = case_meta::<T>(shape, &params);
        meta["kind"] = json!("backward");
        meta["dq_mode"] = json!(format!("{mode:?}").to_lowercase());
        meta["ours_ms"] = json!({"fwd": fwd_ms, "bwd": bwd_ms});
        meta["errors"] =
            json!({"o_rel": errs[0], "dq_rel": errs[1], "dk_rel": errs[2], "dv_rel": errs[3]});
        dump.case(
            name,
            meta,
            &[
                ("kv_end", DumpTensor::index(&pack.kv_end)),
                ("position_ids", DumpTensor::index(&pack.position_ids)),
                ("q", DumpTensor::elems(&q, &[l, hq, d])),
                ("k", DumpTensor::elems(&k, &[l, hk, d])),
                ("v", DumpTensor::elems(&v, &[l, hk, d])),
                ("d_o", DumpTensor::elems(&d_o, &[l, hq, d])),
                ("o", DumpTensor::elems(&o_dev, &[l, hq, d])),
                ("lse", DumpTensor::f32s(&lse_dev, &[hq, l])),
                ("dq", DumpTensor::elems(&gq, &[l, hq, d])),
                ("dk", DumpTensor::elems(&gk, &[l, hk, d])),
                ("dv", DumpTensor::elems(&gv, &[l, hk, d])),
            ],
        )?;
    }
    Ok(errs)
}

/// SDCC on the target against the CPU backend: (max KL relative error,
/// gradient relative Frobenius error).
fn check_sdcc<D: Target>(be: &D, rng: &mut Rng, vocab: usize) -> Result<(f64, f64)> {
    let rows = 5;
    let mut st: Vec<f32> = (0..rows * vocab).map(|_| 6.0 * rng.signed_unit()).collect();
    let mut te: Vec<f32> = st.iter().map(|&x| x + 0.7 * rng.signed_unit()).collect();
    for v in 1..vocab {
        if rng.range(0, 9) == 0 {
            te[v] = f32::NEG_INFINITY;
            st[v] = f32::NEG_INFINITY;
        }
        if rng.range(0, 19) == 0 {
            te[vocab + v] = f32::NEG_INFINITY;
        }
    }
    let st: Vec<half::bf16> = st.iter().map(|&x| half::bf16::from_f32(x)).collect();
    let te: Vec<half::bf16> = te.iter().map(|&x| half::bf16::from_f32(x)).collect();
    // Student row 3 is named twice (accumulated gradient).
    let pairs = [(0u32, 0u32), (1, 1), (3, 2), (3, 4), (4, 3)];
    let weights = [1.0f32, 0.5, 0.25, 1.0, 0.8];
    let tau = 1.3f32;
    let wide = |x: &[half::bf16]| x.iter().map(|e| e.to_f32()).collect::<Vec<f32>>();
    let want = cpu_sdcc(&wide(&st), &wide(&te), vocab, &pairs, &weights, tau)?;
    let dst = be.up(&st)?;
    let dte = be.up(&te)?;
    let mut grad = be.filled(st.len(), f32::NAN)?;
    let got = be.sdcc(false, &dst, &dte, vocab, &pairs, &weights, tau, &mut grad)?;
    let g = be.down(&grad)?;
    let mut kl_err = 0.0f64;
    for (&a, &b) in got.per_pair.iter().zip(&want.loss.per_pair) {
        kl_err = kl_err.max(SDCC.kl_error(a, b));
    }
    kl_err = kl_err.max(SDCC.kl_error(got.loss_sum, want.loss.loss_sum));
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (i, (&a, &b)) in g.iter().zip(&want.grad_student).enumerate() {
        if !a.is_finite() {
            return Err(Error::Cuda(format!(
                "SDCC gradient[{i}] = {a}: not written"
            )));
        }
        num += (a as f64 - b as f64).powi(2);
        den += (b as f64).powi(2);
    }
    Ok((kl_err, (num / den.max(f64::MIN_POSITIVE)).sqrt()))
}

/// The root-to-leaf branches of a pack (LogitTree's K+1 sequences): for
/// each leaf token q (`kv_end[q] == q + 1`), its ancestors `k <= q` with
/// `kv_end[k] > q`. Returns their lengths.
fn branch_lengths(pack: &MaskBuilder) -> Vec<usize> {
    let kv = &pack.kv_end;
    (0..kv.len())
        .filter(|&q| kv[q] as usize == q + 1)
        .map(|q| (0..=q).filter(|&k| kv[k] as usize > q).count())
        .collect()
}

/// Buffers of one forward + backward run.
pub(super) struct Run<D: Target, T: DevElem> {
    pack: D::Pack,
    shape: AttnShape,
    params: AttnParams,
    inputs: [D::Buf<T>; 4], // q, k, v, d_o
    o: D::Buf<T>,
    lse: D::Buf<f32>,
    grads: [D::Buf<T>; 3],
}

impl<D: Target, T: KernelElem + DevElem> Run<D, T> {
    /// Random inputs for `pack` at `shape`, rotary `rope` (or none).
    pub(super) fn new(
        be: &D,
        rng: &mut Rng,
        pack: &MaskBuilder,
        shape: AttnShape,
        rope: Option<Rope>,
    ) -> Result<Self> {
        let mut mk = |n: usize| -> Result<D::Buf<T>> {
            let h: Vec<T> = (0..n)
                .map(|_| T::from_f32(rng.signed_unit() * 2.0))
                .collect();
            be.up(&h)
        };
        let inputs = [
            mk(shape.q_len())?,
            mk(shape.kv_len())?,
            mk(shape.kv_len())?,
            mk(shape.q_len())?,
        ];
        let zeros = |n: usize| be.filled(n, T::from_f32(0.0));
        let mut params = AttnParams::new(shape.head_dim);
        params.rope = rope;
        Ok(Run {
            pack: be.pack(pack)?,
            shape,
            params,
            o: zeros(shape.q_len())?,
            lse: be.filled(shape.q_heads * shape.tokens, 0.0f32)?,
            grads: [
                zeros(shape.q_len())?,
                zeros(shape.kv_len())?,
                zeros(shape.kv_len())?,
            ],
            inputs,
        })
    }
    /// One forward, then one backward with dQ by `mode`.
    pub(super) fn launch(&mut self, be: &D, mode: DqMode) -> Result<()> {
        let [q, k, v, d_o] = &self.inputs;
        be.forward(
            q,
            k,
            v,
            self.shape,
            &self.pack,
            &self.params,
            &mut self.o,
            &mut self.lse,
        )?;
        let [dq, dk, dv] = &mut self.grads;
        be.backward(
            q,
            k,
            v,
            &self.o,
            &self.lse,
            d_o,
            self.shape,
            &self.pack,
            &self.params,
            mode,
            dq,
            dk,
            dv,
        )
    }
}

/// Milliseconds per round of forward + backward over every run in `runs`:
/// the warm-up rounds, then `reps` rounds between one pair of events (the
/// mean).
fn time_runs<D: Target, T: KernelElem + DevElem>(
    be: &D,
    runs: &mut [Run<D, T>],
    mode: DqMode,
    reps: usize,
) -> Result<f64> {
    let mut round = || -> Result<()> {
        for r in runs.iter_mut() {
            r.launch(be, mode)?;
        }
        Ok(())
    };
    for _ in 0..warmup::<D>(3) {
        round()?;
    }
    let reps = reps.max(1);
    let ms = be.time_ms(&mut || (0..reps).try_for_each(|_| round()))?;
    Ok(ms / reps as f64)
}

/// Part 2's correctness sections (backward, SDCC); appends them to `rep`
/// and returns the names of the failed checks.
pub(super) fn check<D: Target>(
    be: &D,
    rng: &mut Rng,
    opts: &CheckOptions,
    rep: &mut Report<'_>,
    mut dump: Option<&mut Dump>,
) -> Result<Vec<String>> {
    let mut failures = Vec::new();
    let sz = |gpu: usize, emu: usize| if opts.small { emu } else { gpu };
    let shape = |tokens, q_heads, kv_heads, head_dim| AttnShape {
        tokens,
        q_heads,
        kv_heads,
        head_dim,
        v_head_dim: head_dim,
    };
    let rope = |dims| {
        Some(Rope {
            base: 10_000.0,
            dims,
        })
    };

    // 1. backward correctness
    let _ = writeln!(
        rep,
        "\nbackward correctness (relative Frobenius errors: dQ, dK, dV vs the CPU f32 backward; O: the kernel \
         forward, rotary included, vs the CPU forward)"
    );
    let mut cases: Vec<(String, MaskBuilder, AttnShape, Option<Rope>, DqMode, bool)> = Vec::new();
    let mut p = MaskBuilder::new();
    p.push_tree(rng, 0, sz(100, 20), 3, true);
    p.push_tree(rng, 0, sz(100, 20), 3, true);
    let n = p.kv_end.len();
    cases.push((
        "trees bf16 d64 4/2 rope atomic".into(),
        p,
        shape(n, 4, 2, 64),
        rope(64),
        DqMode::Atomic,
        true,
    ));
    let mut p = MaskBuilder::new();
    p.push_tree(rng, 0, sz(150, 30), 3, true);
    p.push_padding(11);
    let n = p.kv_end.len();
    cases.push((
        "tree+pad f16 d128 4/1 det".into(),
        p,
        shape(n, 4, 1, 128),
        None,
        DqMode::Deterministic,
        false,
    ));
    let mut p = MaskBuilder::new();
    p.push_fan(
        rng.range(sz(100, 20), sz(300, 60)),
        16,
        rng.range(sz(20, 4), sz(60, 10)),
    );
    let n = p.kv_end.len();
    cases.push((
        "grpo fan bf16 d128 4/2 rope/2 det".into(),
        p,
        shape(n, 4, 2, 128),
        rope(64),
        DqMode::Deterministic,
        true,
    ));
    let mut p = MaskBuilder::new();
    while p.kv_end.len() < sz(1200, 200) {
        let n = rng.range(1, sz(250, 50));
        p.push_sequence(n);
        p.push_padding(rng.range(0, 2));
    }
    let n = p.kv_end.len();
    cases.push((
        "varlen+pad f16 d64 8/8 atomic".into(),
        p,
        shape(n, sz(8, 4), sz(8, 4), 64),
        None,
        DqMode::Atomic,
        false,
    ));
    // The cases again with the one-m-tile main kernel and, at d 64, the
    // 4-warp two-m-tile one (kept selectable until timed against the
    // two-m-tile default; not dumped).
    // And every case with the balanced main launch (issue 39 item 1: the
    // default kernel's query walks cut into ranges, heaviest first).
    let one = be.with_main_kernel(Some(MainKernel::OneMTile));
    let four = be.with_main_kernel(Some(MainKernel::TwoMTilesFourWarps));
    let balanced = be.with_balanced();
    let runs: Vec<(Variant, String, usize)> = (0..cases.len())
        .map(|i| (Variant::Default, cases[i].0.clone(), i))
        .chain((0..cases.len()).map(|i| (Variant::Balanced, format!("{} balanced", cases[i].0), i)))
        .chain(
            (0..cases.len()).map(|i| (Variant::OneMTile, format!("{} one-m-tile", cases[i].0), i)),
        )
        .chain(
            (0..cases.len())
                .filter(|&i| cases[i].2.head_dim == 64)
                .map(|i| (Variant::FourWarps, format!("{} 4-warp", cases[i].0), i)),
        )
        .collect();
    for (variant, name, i) in &runs {
        let be = match variant {
            Variant::Default => be,
            Variant::Balanced => &balanced,
            Variant::OneMTile => &one,
            Variant::FourWarps => &four,
        };
        let (_, pack, sh, rp, mode, bf) = &cases[*i];
        let dump = if *variant != Variant::Default {
            None
        } else {
            dump.as_deref_mut()
        };
        let (r, t) = if *bf {
            (
                check_backward::<D, half::bf16>(be, rng, pack, *sh, *rp, *mode, name, dump),
                tol(Dtype::Bf16),
            )
        } else {
            (
                check_backward::<D, half::f16>(be, rng, pack, *sh, *rp, *mode, name, dump),
                tol(Dtype::F16),
            )
        };
        match r {
            Ok(e) => {
                // O: the forward's bound (1e-2 bf16, 2e-3 f16).
                let dtype = if *bf { Dtype::Bf16 } else { Dtype::F16 };
                let o_tol = treeattn::backend::tolerance::attention(dtype).o_rel;
                let ok = e[0] <= o_tol && e[1..].iter().all(|&x| x <= t);
                let _ = writeln!(
                    rep,
                    "  {name:<36} L={:<5} O {:.2e} (tol {o_tol:.0e})  dQ {:.2e} dK {:.2e} dV {:.2e} (tol {t:.0e})  {}",
                    sh.tokens,
                    e[0],
                    e[1],
                    e[2],
                    e[3],
                    if ok { "ok" } else { "FAIL" }
                );
                if !ok {
                    failures.push(name.clone());
                }
            }
            Err(e) => {
                let _ = writeln!(rep, "  {name:<36} L={:<5} FAIL: {e}", sh.tokens);
                failures.push(name.clone());
            }
        }
    }

    // 2. SDCC correctness
    let _ = writeln!(rep, "\nSDCC correctness (vs the CPU backend, bf16 logits, −inf entries, a repeated student row)");
    for vocab in [7usize, opts.sdcc_vocab] {
        let name = format!("sdcc vocab {vocab}");
        match check_sdcc(be, rng, vocab) {
            Ok((kl, g)) => {
                let ok = kl <= SDCC.kl_rel && g <= SDCC.grad_rel;
                let _ = writeln!(
                    rep,
                    "  {name:<36} KL {kl:.2e} (tol 1e-4)  gradient {g:.2e} (tol 1e-3)  {}",
                    if ok { "ok" } else { "FAIL" }
                );
                if !ok {
                    failures.push(name);
                }
            }
            Err(e) => {
                let _ = writeln!(rep, "  {name:<36} FAIL: {e}");
                failures.push(name);
            }
        }
    }
    Ok(failures)
}

/// Part 2's timing sections (forward + backward against causal and
/// LogitTree; SDCC fused against unfused), appended to `rep`.
///
/// `groups` is one pass of [`timing::TimingSet::passes`], timed with
/// `reps` rounds per row (at most 20); the SDCC section runs with `sdcc`
/// (the last pass). Rows go into `tm` as they finish; a row the time limit
/// does not admit is skipped with a line.
#[allow(clippy::too_many_arguments)]
pub(super) fn timings<D: Target>(
    be: &D,
    rng: &mut Rng,
    opts: &CheckOptions,
    rep: &mut Report<'_>,
    tm: &mut Timings,
    set: &timing::TimingSet,
    groups: &[(AttnShape, Vec<timing::Row<'_>>)],
    reps: usize,
    sdcc: bool,
) -> Result<()> {
    let shape = |tokens, q_heads, kv_heads, head_dim| AttnShape {
        tokens,
        q_heads,
        kv_heads,
        head_dim,
        v_head_dim: head_dim,
    };
    let clock = if D::REAL_TIMING {
        "CUDA events"
    } else {
        "EMULATOR WALL CLOCK, meaningless for a GPU"
    };
    // 3. timing of forward + backward
    let n = set.tokens;
    let reps = reps.clamp(1, 20);
    let warm = warmup::<D>(3);
    let _ = writeln!(
        rep,
        "\nforward + backward timing (bf16; mean of {reps} rounds between one pair of events after {warm} warm-up, \
         {clock}; FLOPs = 3.5 · 4·d·heads per visible pair; LogitTree = one causal fwd+bwd per root-to-leaf branch)"
    );
    let _ = writeln!(
        rep,
        "{:<34} {:>4} {:>6} {:>8} {:>9} {:>9} {:>8} {:>9} {:>5} {:>10} {:>9}",
        "pack",
        "d",
        "L",
        "pairs M",
        "ms atomic",
        "ms det",
        "TFLOP/s",
        "causal ms",
        "K+1",
        "LogitT ms",
        "vs LogitT"
    );
    // Atomic against deterministic dQ on the same inputs, per timed tree
    // pack: (pack, relative Frobenius difference).
    let mut dq_modes: Vec<(String, f64)> = Vec::new();
    for (sh, rows) in groups {
        let (d, l) = (sh.head_dim, sh.tokens);
        let causal_name = format!("causal {}/{}", sh.q_heads, sh.kv_heads);
        let causal_ms = match tm.causal_ms("forward+backward", sh) {
            Some(ms) => ms,
            None => {
                let started = std::time::Instant::now();
                let what = format!("forward+backward {causal_name} d{d} and its group");
                if let Err(line) = tm.budget.admit(&what) {
                    let _ = writeln!(rep, "{line}");
                    tm.skipped.push(line);
                    continue;
                }
                let causal = timing::causal_pack(l);
                let mut c = [Run::<D, half::bf16>::new(be, rng, &causal, *sh, None)?];
                let causal_ms = time_runs(be, &mut c, DqMode::Atomic, reps)?;
                drop(c);
                let _ = writeln!(
                    rep,
                    "{:<34} {:>4} {:>6} {:>8.1} {:>9.3} {:>9} {:>8} {:>9.3} {:>5} {:>10} {:>9}",
                    causal_name,
                    d,
                    l,
                    causal.mask()?.visible_pairs() as f64 / 1e6,
                    causal_ms,
                    "-",
                    "-",
                    causal_ms,
                    "-",
                    "-",
                    "-"
                );
                let id = tm.pack_id("causal", &causal);
                tm.causal.push(("forward+backward", *sh, causal_ms));
                tm.push(TimingRecord {
                    name: causal_name,
                    kind: "forward+backward",
                    pack: id,
                    shape: *sh,
                    rope: None,
                    pairs: causal.mask()?.visible_pairs(),
                    ours_ms: causal_ms,
                    ours_det_ms: None,
                    ours_balanced_ms: None,
                    causal_ms,
                })?;
                tm.budget.took(started.elapsed());
                causal_ms
            }
        };
        for r in rows {
            let started = std::time::Instant::now();
            if let Err(line) = tm
                .budget
                .admit(&format!("forward+backward {} d{d}", r.label))
            {
                let _ = writeln!(rep, "{line}");
                tm.skipped.push(line);
                continue;
            }
            let (name, pack, rope) = (&r.label, r.pack, &r.rope);
            let mut tree = [Run::<D, half::bf16>::new(be, rng, pack, *sh, *rope)?];
            let ms = time_runs(be, &mut tree, DqMode::Atomic, reps)?;
            let dq_atomic = be.down(&tree[0].grads[0])?;
            let det_ms = time_runs(be, &mut tree, DqMode::Deterministic, reps)?;
            let dq_det: Vec<f32> = be
                .down(&tree[0].grads[0])?
                .iter()
                .map(|x| x.to_f32())
                .collect();
            dq_modes.push((
                format!("{name} d{d}"),
                rel_err("dq (atomic mode)", &dq_atomic, &dq_det)?,
            ));
            // The same runs with the one-m-tile main kernel, side by
            // side with the two-m-tile default (issue 26).
            let one = be.with_main_kernel(Some(MainKernel::OneMTile));
            let one_ms = (
                time_runs(&one, &mut tree, DqMode::Atomic, reps)?,
                time_runs(&one, &mut tree, DqMode::Deterministic, reps)?,
            );
            // The balanced main launch (issue 39 item 1), both dQ modes.
            let bal = be.with_balanced();
            let balanced_ms = (
                time_runs(&bal, &mut tree, DqMode::Atomic, reps)?,
                time_runs(&bal, &mut tree, DqMode::Deterministic, reps)?,
            );
            // d 64: and with the 4-warp two-m-tile kernel (the d 64
            // default before the 8-warp one).
            let four_ms = if d == 64 {
                let four = be.with_main_kernel(Some(MainKernel::TwoMTilesFourWarps));
                Some((
                    time_runs(&four, &mut tree, DqMode::Atomic, reps)?,
                    time_runs(&four, &mut tree, DqMode::Deterministic, reps)?,
                ))
            } else {
                None
            };
            drop(tree);
            let lt = if r.base {
                let branches = branch_lengths(pack);
                let mut lt = branches
                    .iter()
                    .map(|&len| {
                        let mut b = MaskBuilder::new();
                        b.push_sequence(len);
                        Run::<D, half::bf16>::new(
                            be,
                            rng,
                            &b,
                            shape(len, sh.q_heads, sh.kv_heads, d),
                            None,
                        )
                    })
                    .collect::<Result<Vec<_>>>()?;
                let lt_ms = time_runs(be, &mut lt, DqMode::Atomic, reps)?;
                Some((branches.len(), lt_ms))
            } else {
                None
            };
            let pairs = pack.mask()?.visible_pairs();
            let tflops =
                3.5 * 4.0 * d as f64 * sh.q_heads as f64 * pairs as f64 / (ms * 1e-3) / 1e12;
            let (k1, lt_ms, vs) = match lt {
                Some((k, t)) => (k.to_string(), format!("{t:.3}"), format!("{:.2}x", t / ms)),
                None => ("-".into(), "-".into(), "-".into()),
            };
            let _ = writeln!(
                rep,
                "{:<34} {:>4} {:>6} {:>8.1} {:>9.3} {:>9.3} {:>8.1} {:>9.3} {:>5} {:>10} {:>9}",
                name,
                d,
                l,
                pairs as f64 / 1e6,
                ms,
                det_ms,
                tflops,
                causal_ms,
                k1,
                lt_ms,
                vs
            );
            let (a, b) = one_ms;
            let _ = writeln!(
                rep,
                "  \u{2514} one-m-tile main kernel: ms atomic {a:.3}, ms det {b:.3} (time two-m-tile / \
                 one-m-tile: {:.2}x, {:.2}x; below 1: two-m-tile faster)",
                ms / a,
                det_ms / b
            );
            let (a, b) = balanced_ms;
            let _ = writeln!(
                rep,
                "  \u{2514} balanced main launch: ms atomic {a:.3}, ms det {b:.3} (time grid / balanced: \
                 {:.2}x, {:.2}x; above 1: balanced faster)",
                ms / a,
                det_ms / b
            );
            if let Some((a, b)) = four_ms {
                let _ = writeln!(
                    rep,
                    "  \u{2514} 4-warp two-m-tile main kernel: ms atomic {a:.3}, ms det {b:.3} (time 8-warp / \
                     4-warp: {:.2}x, {:.2}x; below 1: 8-warp faster)",
                    ms / a,
                    det_ms / b
                );
            }
            let id = tm.pack_id(timing::name_of_pack(name), pack);
            tm.push(TimingRecord {
                name: name.clone(),
                kind: "forward+backward",
                pack: id,
                shape: *sh,
                rope: *rope,
                pairs,
                ours_ms: ms,
                ours_det_ms: Some(det_ms),
                ours_balanced_ms: Some(balanced_ms),
                causal_ms,
            })?;
            tm.budget.took(started.elapsed());
        }
    }

    // The two dQ modes at the timing sizes (16k tokens on a GPU): the same
    // sums in another order, so they differ by f32 rounding before the bf16
    // store, far inside the gradient tolerance.
    let bound = tol(Dtype::Bf16);
    let worst = dq_modes.iter().map(|m| m.1).fold(0.0f64, f64::max);
    let bad: Vec<&str> = dq_modes
        .iter()
        .filter(|m| m.1.is_nan() || m.1 > bound)
        .map(|m| m.0.as_str())
        .collect();
    let _ = writeln!(
        rep,
        "atomic vs deterministic dQ on the timed packs (L = {n}): max relative difference {worst:.2e} over {} \
         packs (tol {bound:.0e})  {}",
        dq_modes.len(),
        if bad.is_empty() { "ok" } else { "FAIL" }
    );

    // 4. SDCC fused vs unfused (the last pass only)
    if sdcc {
        if let Err(line) = tm.budget.admit("SDCC timing") {
            let _ = writeln!(rep, "{line}");
            tm.skipped.push(line);
        } else {
            sdcc_timing(be, rng, opts, rep, n, reps, clock)?;
        }
    }
    if !bad.is_empty() {
        return Err(Error::Cuda(format!(
            "gpu-check failed (atomic vs deterministic dQ differ beyond {bound:.0e}: {})",
            bad.join(", ")
        )));
    }
    Ok(())
}

/// SDCC fused against unfused at the timing length's pair count.
fn sdcc_timing<D: Target>(
    be: &D,
    rng: &mut Rng,
    opts: &CheckOptions,
    rep: &mut Report<'_>,
    n: usize,
    reps: usize,
    clock: &str,
) -> Result<()> {
    let vocab = opts.sdcc_vocab;
    // 2048 pairs at the default 16k timing tokens (~1.8 MB of traffic per
    // pair at vocab 151,936); fewer for the small sanitizer runs.
    let n_pairs = (n / 8).clamp(16, 2048);
    let rows: Vec<half::bf16> = (0..n_pairs * vocab)
        .map(|_| half::bf16::from_f32(6.0 * rng.signed_unit()))
        .collect();
    let dst = be.up(&rows)?;
    let dte = be.up(&rows)?;
    drop(rows);
    let pairs: Vec<(u32, u32)> = (0..n_pairs as u32)
        .map(|i| (i, (i * 7 + 3) % n_pairs as u32))
        .collect();
    let weights = vec![1.0f32; n_pairs];
    let mut grad = be.filled(n_pairs * vocab, 0.0f32)?;
    let sdcc_warm = warmup::<D>(2);
    let mut time_sdcc = |unfused: bool| -> Result<f64> {
        let mut call = || {
            be.sdcc(unfused, &dst, &dte, vocab, &pairs, &weights, 1.0, &mut grad)
                .map(|_| ())
        };
        for _ in 0..sdcc_warm {
            call()?;
        }
        let ms = be.time_ms(&mut || (0..reps).try_for_each(|_| call()))?;
        Ok(ms / reps as f64)
    };
    let fused = time_sdcc(false)?;
    let unfused = time_sdcc(true)?;
    // Bytes the fused kernel must move: 4 bf16 row reads + 1 f32 row write per pair.
    let bytes = (n_pairs * vocab * (4 * 2 + 4)) as f64;
    let _ = writeln!(
        rep,
        "\nSDCC timing (bf16, vocab {vocab}, {n_pairs} pairs, τ 1; mean of {reps} between one pair of events, {clock}; each call includes its \
         small uploads and the per-pair download)\n  fused {fused:.3} ms ({:.0} GB/s of its minimal traffic)   unfused \
         {unfused:.3} ms   speedup {:.2}x",
        bytes / (fused * 1e-3) / 1e9,
        unfused / fused
    );
    Ok(())
}

/// `--profile`: one forward and one forward + backward (dQ by atomics) of
/// the random-trees pack at the timing length, d 128, bf16, nothing else —
/// what `ncu` in scripts/gpu-check.sh profiles. Prints what it ran.
pub(super) fn profile<D: Target>(
    be: &D,
    rng: &mut Rng,
    opts: &CheckOptions,
    rep: &mut Report<'_>,
) -> Result<()> {
    let n = opts.timing_tokens.max(256);
    let hq = opts.timing_q_heads.max(4);
    let sh = AttnShape {
        tokens: n,
        q_heads: hq,
        kv_heads: hq / 4,
        head_dim: 128,
        v_head_dim: 128,
    };
    let pack = timing::random_trees(rng, n);
    let mut run = Run::<D, half::bf16>::new(be, rng, &pack, sh, None)?;
    run.launch(be, DqMode::Atomic)?;
    let _ = writeln!(
        rep,
        "profile: one forward + backward (atomic dQ) of random trees, bf16, L={n}, {hq}/{} heads, d 128, {:.1} M visible \
         pairs per head",
        hq / 4,
        pack.mask()?.visible_pairs() as f64 / 1e6
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// LogitTree's branches read off the mask: the DESIGN §4 worked example
    /// (two branches of 10 and 8 tokens), a fan, and padding (no branch).
    #[test]
    fn branches_of_a_pack() {
        let example = MaskBuilder {
            kv_end: vec![
                16, 16, 10, 10, 10, 10, 10, 10, 10, 10, 16, 16, 16, 16, 16, 16,
            ],
            position_ids: vec![0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 2, 3, 4, 5, 6, 7],
        };
        assert_eq!(branch_lengths(&example), vec![10, 8]);
        let mut fan = MaskBuilder::new();
        fan.push_fan(5, 3, 4);
        fan.push_padding(2);
        assert_eq!(branch_lengths(&fan), vec![9, 9, 9]);
    }
}
