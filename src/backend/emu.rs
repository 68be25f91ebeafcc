//! The `emu` backend: the CUDA kernels of `kernels/` compiled as host C++
//! against the SIMT shim of `kernels/emu/` and run on the CPU — one fiber per
//! CUDA thread, blocks over OS threads — with the same launch plans as the
//! CUDA backend ([`super::launch`]). It exists to test the kernel code without
//! a GPU: the fragment layouts of `mma`/`ldmatrix`, the `cp.async` pipeline
//! (a copy lands at its `wait_group`, or at issue), barriers (a divergent one
//! is an error), warp schedules that expose missing barriers ([`Schedule`]),
//! and shared memory (poisoned with NaN before every block) are all
//! modelled, so a kernel bug shows up as a wrong number or an `Err`.

use super::launch::{self, FwdParams, KvBoundsParams};
use super::{
    AttentionBackend, BackwardCall, Element, ForwardCall, Host, SdccBackend, SdccCall, SdccLoss,
};
use crate::{Error, Result};

pub use super::launch::{Dtype, KernelElem};

mod bwd;
mod ffi;
mod rope;
mod sdcc;
pub use super::launch::bwd::{BwdBalance, DqMode, MainKernel};
pub use super::launch::sdcc::SdccElem;
pub use bwd::{
    backward2_kernel_traits, backward_kernel_traits, last_backward_stats, with_negative_control,
    BackwardStats,
};
use ffi::RawConfig;
pub use rope::rope_kernel_threads;
pub use sdcc::sdcc_kernel_traits;

/// How the emulator interleaves the threads of a block. Hardware timing can
/// put one warp far ahead of another; a kernel with a missing
/// `__syncthreads` or a wrong `cp.async.wait_group` count gives wrong numbers
/// under some schedule, so kernel tests run under all of them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Schedule {
    /// Round-robin over all threads: warps advance one collective at a time.
    Lockstep = 0,
    /// Each warp in turn runs alone to its next `__syncthreads` (warp 0 first).
    WarpSerial = 1,
    /// As [`Schedule::WarpSerial`], last warp first.
    WarpSerialReverse = 2,
}

/// Emulator settings of an [`Emu`] backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EmuOptions {
    /// OS threads that run blocks; 0 = one per core.
    pub workers: u32,
    /// How the threads of a block interleave.
    pub schedule: Schedule,
    /// `false`: a `cp.async` copy lands at its `wait_group` (the latest moment
    /// hardware allows); `true`: at issue (the earliest).
    pub cp_async_eager: bool,
}

impl Default for EmuOptions {
    fn default() -> Self {
        EmuOptions {
            workers: 0,
            schedule: Schedule::Lockstep,
            cp_async_eager: false,
        }
    }
}

impl EmuOptions {
    /// Every schedule with both cp.async landing times: the set a kernel test
    /// should pass under.
    pub fn all() -> [EmuOptions; 6] {
        let mut out = [EmuOptions::default(); 6];
        for (i, o) in out.iter_mut().enumerate() {
            o.schedule = [
                Schedule::Lockstep,
                Schedule::WarpSerial,
                Schedule::WarpSerialReverse,
            ][i / 2];
            o.cp_async_eager = i % 2 == 1;
        }
        out
    }
    fn raw(self) -> RawConfig {
        RawConfig {
            workers: self.workers,
            schedule: self.schedule as u32,
            cp_async_eager: u32::from(self.cp_async_eager),
            reserved: 0,
        }
    }
}

/// The emulator backend: the kernels of `kernels/` run on the CPU under
/// the SIMT shim, on host memory, with `bf16` / `f16` attention inputs (an
/// `f32` LSE) and `bf16` / `f16` / `f32` SDCC logits (an `f32` gradient).
/// It implements the crate's contract ([`AttentionBackend`],
/// [`SdccBackend`]) with the launch plans of the CUDA backend, and how it
/// runs them is set by its fields.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Emu {
    /// Worker threads, warp schedule and `cp.async` landing time.
    pub options: EmuOptions,
    /// How the backward sums dQ.
    pub dq_mode: DqMode,
    /// Group splits of the backward main kernel: `None` takes the launch
    /// plan's rule ([`launch::bwd::group_splits`]), `Some(s)` forces `s` (a
    /// divisor of `q_heads / kv_heads`), so that tests cover the split and
    /// unsplit paths on small packs.
    pub group_splits: Option<u32>,
    /// The backward main kernel: `None` takes [`MainKernel::default_for`]
    /// the head dim, as the CUDA backend does.
    pub main_kernel: Option<MainKernel>,
    /// The backward main launch's layout: the grid
    /// ([`launch::bwd::BwdBalance::Grid`], the default, as on CUDA) or the
    /// balanced launch (issue 39 item 1; the 8-warp two-m-tile kernels, d
    /// 64 and 128): every key tile's query walk cut into ranges of about a
    /// cap of pairs × heads ([`launch::bwd::balanced_main_items`]),
    /// heaviest first, partial dK, dV summed by `dkv_convert`. A tiny
    /// [`launch::bwd::BwdBalance::Cap`] forces splitting on small packs.
    pub balance: launch::bwd::BwdBalance,
}

impl Default for Emu {
    /// Default options, dQ by atomics ([`DqMode`]'s default, as on CUDA).
    fn default() -> Self {
        Emu::new(EmuOptions::default())
    }
}

impl Emu {
    /// An emulator with `options` and [`DqMode`]'s default (atomic dQ, as
    /// the CUDA backend); `with_dq_mode(DqMode::Deterministic)` for the
    /// bit-identical one.
    pub fn new(options: EmuOptions) -> Emu {
        Emu {
            options,
            dq_mode: DqMode::default(),
            group_splits: None,
            main_kernel: None,
            balance: launch::bwd::BwdBalance::Grid,
        }
    }

    /// The same emulator with the backward main kernel chosen (`Some`) or
    /// the head dim's default (`None`).
    pub fn with_main_kernel(self, kernel: Option<MainKernel>) -> Emu {
        Emu {
            main_kernel: kernel,
            ..self
        }
    }

    /// The same emulator with the backward's group splits forced (`Some`) or
    /// planned (`None`).
    pub fn with_group_splits(self, splits: Option<u32>) -> Emu {
        Emu {
            group_splits: splits,
            ..self
        }
    }

    /// The same emulator with the balanced backward main launch's cap
    /// (`Some`: [`launch::bwd::BwdBalance::Cap`]) or the grid (`None`).
    pub fn with_balance_cap(self, cap: Option<u64>) -> Emu {
        self.with_balance(cap.map_or(launch::bwd::BwdBalance::Grid, launch::bwd::BwdBalance::Cap))
    }

    /// The same emulator with the backward main launch laid out as
    /// `balance` says (the CUDA backend's balanced launch is
    /// [`launch::bwd::BwdBalance::Slots`] over its SMs).
    pub fn with_balance(self, balance: launch::bwd::BwdBalance) -> Emu {
        Emu { balance, ..self }
    }

    /// The same emulator with dQ summed as `mode` says.
    pub fn with_dq_mode(self, mode: DqMode) -> Emu {
        Emu {
            dq_mode: mode,
            ..self
        }
    }

    fn config(&self) -> RawConfig {
        self.options.raw()
    }
}

impl<T: KernelElem> AttentionBackend<T> for Emu {
    type Memory = Host;
    type Lse = f32;
    fn run_forward(&self, call: ForwardCall<'_, '_, Host, T, f32>) -> Result<()> {
        let (args, o, lse) = call.into_parts();
        let kernels = "emulated kernels";
        launch::check_kernel_call(kernels, &args)?;
        // As on the GPU (device allocations are 256-byte aligned, views
        // need not be): checked before anything runs, rotary included.
        launch::check_vector_alignment(
            "forward kernels",
            args.shape().tokens,
            &[
                ("q", args.q().as_ptr() as u64),
                ("k", args.k().as_ptr() as u64),
                ("v", args.v().as_ptr() as u64),
                ("o", o.as_ptr() as u64),
            ],
        )?;
        let call = ForwardCall::new(args, o, lse)?;
        match call.args().params().rope {
            Some(r) => launch::rope::forward_rotary(self, r, call),
            None => forward(self, call),
        }
    }
    fn run_backward(&self, call: BackwardCall<'_, '_, '_, Host, T, f32>) -> Result<()> {
        let (args, saved, d_o, grads) = call.into_parts();
        let kernels = "emulated kernels";
        launch::check_kernel_call(kernels, &args)?;
        launch::check_vector_alignment(
            "backward kernels",
            args.shape().tokens,
            &[
                ("q", args.q().as_ptr() as u64),
                ("k", args.k().as_ptr() as u64),
                ("v", args.v().as_ptr() as u64),
                ("d_o", d_o.as_ptr() as u64),
                ("dq", grads.dq.as_ptr() as u64),
                ("dk", grads.dk.as_ptr() as u64),
                ("dv", grads.dv.as_ptr() as u64),
            ],
        )?;
        let call = BackwardCall::new(args, saved, d_o, grads)?;
        match call.args().params().rope {
            Some(r) => launch::rope::backward_rotary(self, r, call),
            None => bwd::backward(self, call),
        }
    }
}

impl<T: SdccElem> SdccBackend<T> for Emu {
    type Memory = Host;
    type Grad = f32;
    fn run_sdcc(&self, call: SdccCall<'_, '_, Host, T, f32>) -> Result<SdccLoss> {
        sdcc::sdcc_forward_kl(self, call)
    }
}

/// `Err(NonFinite)` at the first NaN or ±inf of a kernel result (`lse`
/// may hold `−inf`, the mark of a row with no visible key): the policy of
/// every host backend, so a result that overflowed is never returned.
fn check_result<T: Element>(what: &str, x: &[T], allow_neg_inf: bool) -> Result<()> {
    let bad =
        |v: f64| v.is_nan() || v == f64::INFINITY || (v == f64::NEG_INFINITY && !allow_neg_inf);
    match x.iter().position(|e| bad(e.to_f64())) {
        Some(index) => Err(Error::NonFinite {
            what: format!(
                "{what} (the kernel's result is not finite: inputs too large or non-finite)"
            ),
            index,
        }),
        None => Ok(()),
    }
}

/// Turns an emulator return code and message buffer into a `Result`.
fn emu_result(what: &str, rc: i32, err: &[u8]) -> Result<()> {
    if rc == 0 {
        return Ok(());
    }
    let end = err.iter().position(|&b| b == 0).unwrap_or(err.len());
    Err(Error::Cuda(format!(
        "emulated {what}: {}",
        String::from_utf8_lossy(&err[..end])
    )))
}

impl Emu {
    /// Per-key-tile `(min, max)` of `kv_end` over tiles of `tile` keys (the last
    /// tile may be short), computed by the `tree_attn_kv_tile_bounds` kernel
    /// under the emulator — what the CUDA backend computes once per pack on the
    /// device.
    pub fn kv_tile_bounds(&self, kv_end: &[u32], tile: usize) -> Result<(Vec<u32>, Vec<u32>)> {
        if tile == 0 || tile > u32::MAX as usize || kv_end.len() > u32::MAX as usize {
            return Err(Error::Shape(format!(
                "kv tile bounds: tile {tile} over {} keys",
                kv_end.len()
            )));
        }
        let n = kv_end.len().div_ceil(tile);
        if n == 0 {
            return Ok((Vec::new(), Vec::new()));
        }
        let mut lo = vec![0u32; n];
        let mut hi = vec![0u32; n];
        let p = KvBoundsParams {
            kv_end: kv_end.as_ptr() as u64,
            tile_kv_min: lo.as_mut_ptr() as u64,
            tile_kv_max: hi.as_mut_ptr() as u64,
            tokens: kv_end.len() as u32,
            tile: tile as u32,
            num_tiles: n as u32,
            reserved: 0,
        };
        let plan = launch::plan_kv_tile_bounds(n);
        let mut err = [0u8; 1024];
        // SAFETY: the pointers in `p` are valid for the lengths they describe for
        // the whole (synchronous) call; `err` is writable for its length.
        let rc = unsafe {
            ffi::ta_emu_kv_tile_bounds(
                &p,
                plan.grid.0,
                plan.block.0,
                &self.config(),
                err.as_mut_ptr(),
                err.len(),
            )
        };
        emu_result("tree_attn_kv_tile_bounds", rc, &err)?;
        Ok((lo, hi))
    }
}

/// The variant kernels' key starts of a call on host memory and their
/// per-64-row bounds (computed by the bounds kernel under the emulator):
/// `None` when the call needs none ([`launch::kernel_key_starts`]).
pub(crate) struct HostStarts {
    pub starts: Vec<u32>,
    pub tile_min: Vec<u32>,
    pub tile_max: Vec<u32>,
}

impl Emu {
    /// The key starts of `args` for the variant kernels, `None` without a
    /// window, explicit starts or sinks.
    pub(crate) fn key_starts<T: KernelElem>(
        &self,
        args: &super::AttnArgs<'_, Host, T>,
    ) -> Result<Option<HostStarts>> {
        let starts = launch::kernel_key_starts(
            args.mask(),
            args.params().window,
            args.key_starts(),
            args.sinks().is_some(),
        )?;
        let Some(starts) = starts else {
            return Ok(None);
        };
        let (tile_min, tile_max) = self.kv_tile_bounds(&starts, launch::START_TILE as usize)?;
        Ok(Some(HostStarts {
            starts,
            tile_min,
            tile_max,
        }))
    }
}

/// Tree attention forward on the emulator (the math of
/// [`AttentionBackend`]) without rotary (`rope::forward` rotates Q and K
/// first, then calls this): d ∈ {64, 128}; 16-bit inputs, f32 accumulation
/// and softmax, an f32 LSE. A call with a sliding window, key starts, a
/// softcap or sinks runs the variant kernel (`tree_attn_fwd_var_*`).
/// Tensors must start at 16-byte aligned addresses (as device allocations
/// do; checked by `run_forward`). A non-finite `o` or `lse` (other than
/// `−inf`) is an [`Error::NonFinite`].
fn forward<T: KernelElem>(emu: &Emu, call: ForwardCall<'_, '_, Host, T, f32>) -> Result<()> {
    let (args, o, lse) = call.into_parts();
    let (shape, mask) = (args.shape(), args.mask());
    let prog = launch::FwdProgram::new("emulated kernels", &args)?;
    if prog.empty {
        return Ok(());
    }
    let (traits, plan) = (prog.traits, prog.plan);
    let (tile_min, tile_max) = emu.kv_tile_bounds(mask.kv_end(), traits.block_n as usize)?;
    let starts = if prog.variants {
        emu.key_starts(&args)?
    } else {
        None
    };
    let addr = |x: Option<&Vec<u32>>| x.map_or(0, |x| x.as_ptr() as u64);
    let p = FwdParams {
        q: args.q().as_ptr() as u64,
        k: args.k().as_ptr() as u64,
        v: args.v().as_ptr() as u64,
        o: o.as_mut_ptr() as u64,
        lse: lse.as_mut_ptr() as u64,
        kv_end: mask.kv_end().as_ptr() as u64,
        tile_kv_min: tile_min.as_ptr() as u64,
        tile_kv_max: tile_max.as_ptr() as u64,
        key_start: addr(starts.as_ref().map(|s| &s.starts)),
        start_tile_min: addr(starts.as_ref().map(|s| &s.tile_min)),
        start_tile_max: addr(starts.as_ref().map(|s| &s.tile_max)),
        sinks: args.sinks().map_or(0, |s| s.as_ptr() as u64),
        ..prog.params(&shape, args.params())
    };
    let mut err = [0u8; 1024];
    let mut cp_async_bytes = 0u64;
    // SAFETY: all pointers in `p` refer to live slices whose lengths were
    // checked against `shape` by `AttnArgs` / `ForwardCall` (the key starts
    // and their bounds are sized here, the sinks by `AttnArgs::with_sinks`);
    // the call is synchronous.
    let rc = unsafe {
        ffi::ta_emu_tree_attn_fwd(
            T::DTYPE.code(),
            traits.head_dim,
            u32::from(prog.variants),
            &p,
            plan.grid.0,
            plan.grid.1,
            plan.block.0,
            plan.shared_mem_bytes as usize,
            &emu.config(),
            &mut cp_async_bytes,
            err.as_mut_ptr(),
            err.len(),
        )
    };
    let name = prog.kernel_name(T::DTYPE);
    emu_result(&name, rc, &err)?;
    LAST_FORWARD.with(|s| s.set(Some(LaunchStats { cp_async_bytes })));
    check_result("o", o, false)?;
    check_result("lse", lse, true)
}

/// What an emulated forward launch moved.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchStats {
    /// Bytes loaded into shared memory by `cp.async` over the whole grid,
    /// zero-filled rows included: with the kernel's tiling (query tiles of
    /// 128 rows, key tiles of 64), `q_heads · Σ over query tiles of (128 + 2 ·
    /// 64 · non-skipped key tiles) · d · 2`.
    pub cp_async_bytes: u64,
}

thread_local! {
    static LAST_FORWARD: std::cell::Cell<Option<LaunchStats>> = const { std::cell::Cell::new(None) };
}

/// Statistics of the last successful emulated forward launch on this thread
/// (for tests and tuning: e.g. that skipped key tiles are never loaded).
pub fn last_forward_stats() -> Option<LaunchStats> {
    LAST_FORWARD.with(|s| s.get())
}

/// The shared memory of the variant kernels for `head_dim` as the C++
/// traits say (`kSmemBytesVar`): `[forward, one-m-tile backward main,
/// two-m-tile (8-warp) backward main, dQ]`; `None` when no kernel exists.
/// Lets tests hold the Rust plans (`smem_bytes_var`,
/// `main_smem_bytes_var`, `dq_smem_bytes_var`) to the C++ source.
pub fn variant_smem_bytes(head_dim: u32) -> Option<[u32; 4]> {
    let mut out = [0i32; 4];
    // SAFETY: `out` has the 4 slots the function writes.
    let rc = unsafe { ffi::ta_emu_var_smem(head_dim, out.as_mut_ptr()) };
    (rc == 0).then(|| out.map(|x| x as u32))
}

/// The C++ traits of the forward kernel for `head_dim` as the emulator sees
/// them: `(block_m, block_n, threads, smem_bytes, row_stride)`; `None` when no
/// kernel exists. Lets tests hold [`launch::FwdTraits`] to the C++ source.
pub fn kernel_traits(head_dim: u32) -> Option<(u32, u32, u32, u32, u32)> {
    let mut out = [0i32; 5];
    // SAFETY: `out` has the 5 slots the function writes.
    let rc = unsafe { ffi::ta_emu_fwd_traits(head_dim, out.as_mut_ptr()) };
    (rc == 0).then(|| {
        (
            out[0] as u32,
            out[1] as u32,
            out[2] as u32,
            out[3] as u32,
            out[4] as u32,
        )
    })
}

/// Kernels that test the SIMT shim itself (`kernels/emu/shim_selftest.cpp`),
/// for `tests/it/emu_shim.rs`. Not part of the crate's API.
#[doc(hidden)]
pub mod shim_selftest {
    use super::{emu_result, ffi, EmuOptions, Result};

    /// The self-test kernels, in the order of `kKernels` in the C++ file,
    /// then `ThrowOnHost`, which throws from the entry point itself.
    #[derive(Clone, Copy, Debug)]
    pub enum Kernel {
        LdmatrixDump = 0,
        MmaChain = 1,
        Shuffles = 2,
        DivergentBarrier = 3,
        PartialMask = 4,
        NotConverged = 5,
        PoisonRead = 6,
        CpAsyncGroups = 7,
        UnevenBarriers = 8,
        MissingBarrier = 9,
        Atomics = 10,
        Throws = 11,
        SyncthreadsOr = 12,
        ThrowOnHost = 13,
    }

    /// Launches a self-test kernel on `grid` blocks of `block` threads with
    /// `smem` bytes of dynamic shared memory, under `options`. The kernel reads `input` and
    /// writes `output`; the caller sizes both for the kernel (see the C++
    /// comments).
    ///
    /// `input` is the only buffer the kernel's `cp.async` may read: a copy
    /// from outside it fails the launch.
    ///
    /// # Safety
    /// `output` must be at least as large as the kernel writes, and `input`
    /// as large as it reads with plain loads, for this `grid`, `block` and
    /// `arg`.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn run(
        options: EmuOptions,
        kernel: Kernel,
        input: &[u8],
        output: &mut [u8],
        arg: u32,
        grid: u32,
        block: u32,
        smem: usize,
    ) -> Result<()> {
        let mut err = [0u8; 1024];
        // SAFETY: the caller sized the buffers (this function's contract);
        // the call is synchronous.
        let rc = unsafe {
            ffi::ta_emu_selftest(
                kernel as u32,
                input.as_ptr(),
                input.len(),
                output.as_mut_ptr(),
                arg,
                grid,
                block,
                smem,
                &options.raw(),
                err.as_mut_ptr(),
                err.len(),
            )
        };
        emu_result(&format!("{kernel:?}"), rc, &err)
    }
}
