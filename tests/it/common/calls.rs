//! The backends' contract in the argument order the tests read best: each
//! helper builds the validated arguments ([`AttnArgs`], [`SdccArgs`]) and
//! calls the backend through [`AttentionBackend`] / [`SdccBackend`], so
//! every test exercises the contract's validation as a user's call does.
//! Outputs are poisoned with NaN before the backend writes them.
#![allow(dead_code, clippy::too_many_arguments)]

use std::cell::Cell;

use treeattn::backend::cpu::{Cpu, CpuFloat};
use treeattn::backend::emu::{DqMode, Emu, EmuOptions, KernelElem, SdccElem};
use treeattn::backend::{
    AttentionBackend, AttnArgs, AttnGrads, AttnOut, AttnParams, AttnShape, Grads, HostAttention,
    HostSdcc, Saved, SdccArgs,
};
use treeattn::mask::PackMask;
use treeattn::Result;

/// An SDCC result with the loss fields at the top level (as tests compare
/// them field by field).
#[derive(Clone, Debug, PartialEq)]
pub struct SdccFlat<G> {
    pub loss_sum: f64,
    pub loss_mean: f64,
    pub per_pair: Vec<f64>,
    pub grad_student: Vec<G>,
}

fn flat<G>(out: treeattn::backend::SdccOut<G>) -> SdccFlat<G> {
    SdccFlat {
        loss_sum: out.loss.loss_sum,
        loss_mean: out.loss.loss_mean,
        per_pair: out.loss.per_pair,
        grad_student: out.grad_student,
    }
}

pub fn cpu_forward<T: CpuFloat>(
    q: &[T],
    k: &[T],
    v: &[T],
    shape: AttnShape,
    mask: PackMask<'_>,
    params: &AttnParams,
) -> Result<AttnOut<T, T>> {
    Cpu::default().forward_owned(&AttnArgs::new(q, k, v, shape, mask, *params)?)
}

pub fn cpu_backward<T: CpuFloat>(
    q: &[T],
    k: &[T],
    v: &[T],
    o: &[T],
    lse: &[T],
    d_o: &[T],
    shape: AttnShape,
    mask: PackMask<'_>,
    params: &AttnParams,
) -> Result<AttnGrads<T>> {
    let args = AttnArgs::new(q, k, v, shape, mask, *params)?;
    Cpu::default().backward_owned(&args, Saved { o, lse }, d_o)
}

pub fn cpu_forward_into<T: CpuFloat>(
    q: &[T],
    k: &[T],
    v: &[T],
    shape: AttnShape,
    mask: PackMask<'_>,
    params: &AttnParams,
    o: &mut [T],
    lse: &mut [T],
) -> Result<()> {
    let args = AttnArgs::new(q, k, v, shape, mask, *params)?;
    Cpu::default().forward(&args, o, lse)
}

pub fn cpu_backward_into<T: CpuFloat>(
    q: &[T],
    k: &[T],
    v: &[T],
    o: &[T],
    lse: &[T],
    d_o: &[T],
    shape: AttnShape,
    mask: PackMask<'_>,
    params: &AttnParams,
    dq: &mut [T],
    dk: &mut [T],
    dv: &mut [T],
) -> Result<()> {
    let args = AttnArgs::new(q, k, v, shape, mask, *params)?;
    Cpu::default().backward(
        &args,
        Saved { o, lse },
        d_o,
        Grads {
            dq,
            dk,
            dv,
            dsinks: None,
        },
    )
}

pub fn cpu_sdcc<T: CpuFloat>(
    student: &[T],
    teacher: &[T],
    vocab: usize,
    pairs: &[(u32, u32)],
    weights: &[f32],
    temperature: f32,
) -> Result<SdccFlat<T>> {
    let args = SdccArgs::new(student, teacher, vocab, pairs, weights, temperature)?;
    Ok(flat(Cpu::default().sdcc_owned(&args)?))
}

thread_local! {
    static OPTIONS: Cell<EmuOptions> = Cell::new(EmuOptions::default());
}

/// Runs `f` with the emulator helpers below using `opts`.
pub fn with_options<R>(opts: EmuOptions, f: impl FnOnce() -> R) -> R {
    let before = OPTIONS.with(|o| o.replace(opts));
    let r = f();
    OPTIONS.with(|o| o.set(before));
    r
}

thread_local! {
    static MAIN_KERNEL: Cell<Option<treeattn::backend::emu::MainKernel>> = const { Cell::new(None) };
}

/// Runs `f` with the emulated backward's main kernel chosen (`None`: the
/// head dim's default) on this thread.
#[allow(dead_code)]
pub fn with_main_kernel<R>(
    kernel: Option<treeattn::backend::emu::MainKernel>,
    f: impl FnOnce() -> R,
) -> R {
    let before = MAIN_KERNEL.with(|o| o.replace(kernel));
    let r = f();
    MAIN_KERNEL.with(|o| o.set(before));
    r
}

thread_local! {
    static GROUP_SPLITS: Cell<Option<u32>> = const { Cell::new(None) };
}

/// Runs `f` with the emulated backward's group splits forced to `splits`
/// (`None`: the launch plan's rule) on this thread.
pub fn with_group_splits<R>(splits: Option<u32>, f: impl FnOnce() -> R) -> R {
    let before = GROUP_SPLITS.with(|o| o.replace(splits));
    let r = f();
    GROUP_SPLITS.with(|o| o.set(before));
    r
}

thread_local! {
    static BALANCE_CAP: Cell<Option<u64>> = const { Cell::new(None) };
}

/// Runs `f` with the emulated backward's balanced main launch at `cap`
/// pairs per item (`None`: today's grid) on this thread.
pub fn with_balance_cap<R>(cap: Option<u64>, f: impl FnOnce() -> R) -> R {
    let before = BALANCE_CAP.with(|o| o.replace(cap));
    let r = f();
    BALANCE_CAP.with(|o| o.set(before));
    r
}

/// The cap of the innermost [`with_balance_cap`] on this thread.
pub fn balance_cap() -> Option<u64> {
    BALANCE_CAP.with(|o| o.get())
}

/// The options of the innermost [`with_options`] on this thread.
pub fn options() -> EmuOptions {
    OPTIONS.with(|o| o.get())
}

/// The emulator with the current options and deterministic dQ.
pub fn emu() -> Emu {
    Emu::new(options())
}

pub fn emu_forward<T: KernelElem>(
    q: &[T],
    k: &[T],
    v: &[T],
    shape: AttnShape,
    mask: PackMask<'_>,
    params: &AttnParams,
) -> Result<AttnOut<T, f32>> {
    emu().forward_owned(&AttnArgs::new(q, k, v, shape, mask, *params)?)
}

pub fn emu_forward_into<T: KernelElem>(
    q: &[T],
    k: &[T],
    v: &[T],
    shape: AttnShape,
    mask: PackMask<'_>,
    params: &AttnParams,
    o: &mut [T],
    lse: &mut [f32],
) -> Result<()> {
    let args = AttnArgs::new(q, k, v, shape, mask, *params)?;
    emu().forward(&args, o, lse)
}

pub fn emu_backward<T: KernelElem>(
    q: &[T],
    k: &[T],
    v: &[T],
    o: &[T],
    lse: &[f32],
    d_o: &[T],
    shape: AttnShape,
    mask: PackMask<'_>,
    params: &AttnParams,
    mode: DqMode,
) -> Result<AttnGrads<T>> {
    let args = AttnArgs::new(q, k, v, shape, mask, *params)?;
    emu()
        .with_dq_mode(mode)
        .with_group_splits(GROUP_SPLITS.with(|o| o.get()))
        .with_main_kernel(MAIN_KERNEL.with(|o| o.get()))
        .with_balance_cap(BALANCE_CAP.with(|o| o.get()))
        .backward_owned(&args, Saved { o, lse }, d_o)
}

pub fn emu_sdcc<T: SdccElem>(
    student: &[T],
    teacher: &[T],
    vocab: usize,
    pairs: &[(u32, u32)],
    weights: &[f32],
    temperature: f32,
) -> Result<SdccFlat<f32>> {
    let args = SdccArgs::new(student, teacher, vocab, pairs, weights, temperature)?;
    Ok(flat(emu().sdcc_owned(&args)?))
}

/// The per-pair KL of an SDCC call into the caller's gradient buffer.
pub fn emu_sdcc_into<T: SdccElem>(
    student: &[T],
    teacher: &[T],
    vocab: usize,
    pairs: &[(u32, u32)],
    weights: &[f32],
    temperature: f32,
    grad: &mut [f32],
) -> Result<Vec<f64>> {
    use treeattn::backend::SdccBackend;
    let args = SdccArgs::new(student, teacher, vocab, pairs, weights, temperature)?;
    Ok(emu().sdcc_forward_kl(&args, grad)?.per_pair)
}

pub fn emu_sdcc_unfused<T: SdccElem>(
    student: &[T],
    teacher: &[T],
    vocab: usize,
    pairs: &[(u32, u32)],
    weights: &[f32],
    temperature: f32,
) -> Result<SdccFlat<f32>> {
    let args = SdccArgs::new(student, teacher, vocab, pairs, weights, temperature)?;
    Ok(flat(emu().sdcc_forward_kl_unfused(&args)?))
}
