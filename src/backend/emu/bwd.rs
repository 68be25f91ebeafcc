//! Attention backward on the emulator (`kernels/tree_attn_bwd.cu`).

use super::{check_result, emu_result, ffi, Emu, KernelElem};
use crate::backend::launch::bwd::{
    BwdOptions, BwdParams, BwdProgram, BwdStage, DqMode, MainKernel,
};
use crate::backend::{BackwardCall, Grads, Host};
use crate::{Error, Result};

/// Tree attention backward on the emulator (the math of
/// [`crate::backend::AttentionBackend`]) without rotary (`super::rope`
/// rotates Q and K first and dQ, dK back after), from the forward's `o`, its
/// f32 `lse` and `d_o`. 16-bit inputs and outputs, f32 accumulation;
/// `emu.dq_mode` picks how dQ is summed ([`DqMode`]), `emu.group_splits`
/// may force the main kernel's group splits. A call with a sliding window,
/// key starts, a softcap or sinks runs the variant kernels (`*_var_*`, and
/// `tree_attn_bwd_dsinks` for the sinks' gradient). A non-finite gradient
/// is an [`Error::NonFinite`].
pub(super) fn backward<T: KernelElem>(
    emu: &Emu,
    call: BackwardCall<'_, '_, '_, Host, T, f32>,
) -> Result<()> {
    let (args, saved, d_o, grads) = call.into_parts();
    let Grads {
        dq,
        dk,
        dv,
        mut dsinks,
    } = grads;
    let mask = args.mask();
    let opts = BwdOptions {
        mode: emu.dq_mode,
        splits: emu.group_splits,
        kernel: emu.main_kernel,
        balance: emu.balance,
    };
    let prog = BwdProgram::new(
        "emulated kernels",
        &args,
        mask.kv_end(),
        dsinks.is_some(),
        opts,
    )?;
    let (shape, traits) = (args.shape(), prog.traits);
    if prog.stages.is_empty() {
        if let Some(ds) = dsinks {
            // No row: the sum over rows is 0.
            ds.fill(T::from_f32(0.0));
        }
        return Ok(());
    }
    let (tile_min, tile_max) = emu.kv_tile_bounds(mask.kv_end(), traits.block_n as usize)?;
    let starts = if prog.variants {
        emu.key_starts(&args)?
    } else {
        None
    };
    let addr = |x: Option<&Vec<u32>>| x.map_or(0, |x| x.as_ptr() as u64);
    // Poisoned, so that the kernels, not this allocation, must provide every
    // value (and the accumulator's zeros in atomic mode).
    let mut delta = vec![f32::NAN; prog.delta_len];
    let mut dq_accum = vec![f32::NAN; prog.dq_accum_len];
    let mut dkv_accum = vec![f32::NAN; prog.dkv_accum_len];
    let nonempty = |len: usize, p: u64| if len == 0 { 0 } else { p };
    let p = BwdParams {
        q: args.q().as_ptr() as u64,
        k: args.k().as_ptr() as u64,
        v: args.v().as_ptr() as u64,
        o: saved.o.as_ptr() as u64,
        d_o: d_o.as_ptr() as u64,
        lse: saved.lse.as_ptr() as u64,
        delta: delta.as_mut_ptr() as u64,
        dq_accum: dq_accum.as_mut_ptr() as u64,
        dq: dq.as_mut_ptr() as u64,
        dk: dk.as_mut_ptr() as u64,
        dv: dv.as_mut_ptr() as u64,
        kv_end: mask.kv_end().as_ptr() as u64,
        tile_kv_min: tile_min.as_ptr() as u64,
        tile_kv_max: tile_max.as_ptr() as u64,
        dkv_accum: nonempty(dkv_accum.len(), dkv_accum.as_mut_ptr() as u64),
        key_start: addr(starts.as_ref().map(|s| &s.starts)),
        start_tile_min: addr(starts.as_ref().map(|s| &s.tile_min)),
        start_tile_max: addr(starts.as_ref().map(|s| &s.tile_max)),
        sinks: args.sinks().map_or(0, |s| s.as_ptr() as u64),
        dsinks: dsinks.as_mut().map_or(0, |d| d.as_mut_ptr() as u64),
        items: nonempty(prog.items.len(), prog.items.as_ptr() as u64),
        tile_regions: nonempty(
            prog.items.len(),
            prog.items[prog.regions_at..].as_ptr() as u64,
        ),
        ..prog.params(&shape, args.params())
    };
    let fault = NEGATIVE_CONTROL.with(|f| f.get());
    let main_stage = main_stage(traits.main_kernel, prog.variants, prog.mode, fault)?;
    let mut stats = BackwardStats::default();
    for &(stage, plan) in &prog.stages {
        // Stage numbers of kernels/emu/bwd_entry.cpp.
        let number = match (stage, prog.variants) {
            (BwdStage::Pre, _) => 0,
            (BwdStage::Main, _) => main_stage,
            (BwdStage::Dq, false) => 3,
            (BwdStage::Dq, true) => 19,
            (BwdStage::DqConvert, _) => 4,
            (BwdStage::DkvConvert, _) => 5,
            (BwdStage::Dsinks, _) => 20,
        };
        let mut err = [0u8; 1024];
        let mut bytes = 0u64;
        // SAFETY: every pointer in `p` refers to a live slice whose length was
        // checked against `shape` by `AttnArgs` / `BackwardCall` (delta,
        // the accumulators, the tile bounds and the item table are sized
        // here from the program); the call is synchronous.
        let rc = unsafe {
            ffi::ta_emu_tree_attn_bwd(
                T::DTYPE.code(),
                traits.head_dim,
                number,
                &p,
                plan.grid.0,
                plan.grid.1,
                plan.grid.2,
                plan.block.0,
                plan.shared_mem_bytes as usize,
                &emu.config(),
                &mut bytes,
                err.as_mut_ptr(),
                err.len(),
            )
        };
        let name = stage.name(prog.mode, prog.variants);
        emu_result(&traits.kernel_name(name, T::DTYPE), rc, &err)?;
        match stage {
            BwdStage::Main => stats.main_cp_async_bytes = bytes,
            BwdStage::Dq => stats.dq_cp_async_bytes = bytes,
            _ => {}
        }
    }
    LAST_BACKWARD.with(|s| s.set(Some(stats)));
    check_result("dq", dq, false)?;
    check_result("dk", dk, false)?;
    check_result("dv", dv, false)?;
    match dsinks {
        Some(ds) => check_result("dsinks", ds, false),
        None => Ok(()),
    }
}

/// The emulator's stage number (kernels/emu/bwd_entry.cpp) of the main
/// kernel: the two-m-tile kernel 6 (atomic) / 7 (det), 8 / 9 / 10 with a
/// negative control's fault; the 4-warp d 64 one 11 / 12, 13 / 14 with
/// fault 1 / 2; the one-m-tile one 1 / 2; the variant kernels 15 / 16 (one
/// m-tile) and 17 / 18 (two), with no faults.
fn main_stage(kernel: MainKernel, variants: bool, mode: DqMode, fault: u32) -> Result<u32> {
    let (atomic, det) = match (kernel, fault) {
        (MainKernel::OneMTile, 0) if variants => (15, 16),
        (MainKernel::TwoMTiles, 0) if variants => (17, 18),
        (_, f) if variants => {
            return Err(Error::Unsupported(format!(
                "negative control {f}: the faults exist in the plain main kernels only (or {kernel:?} with variants)"
            )))
        }
        (MainKernel::TwoMTiles, 0) => (6, 7),
        (MainKernel::TwoMTiles, f) => (7 + f, 7),
        (MainKernel::TwoMTilesFourWarps, 0) => (11, 12),
        (MainKernel::TwoMTilesFourWarps, f @ (1 | 2)) => (12 + f, 12),
        (MainKernel::TwoMTilesFourWarps, f) => {
            return Err(Error::Unsupported(format!(
                "negative control {f}: the 4-warp two-m-tile kernel has faults 1 and 2 only"
            )))
        }
        (MainKernel::OneMTile, _) => (1, 2),
    };
    Ok(match mode {
        DqMode::Atomic => atomic,
        DqMode::Deterministic => det,
    })
}

/// What the kernels of an emulated backward moved with `cp.async` (zero-filled
/// rows included), to prove the tile walks: the main kernel loads, per (key
/// tile, kv head), K and V once and Q, dO for each query tile it visits
/// (`2 · 64 · d · 2 + group · visited · 2 · block_m · d · 2` bytes; the
/// two-m-tile kernel per 128-key tile), plus the tile's kv_end, 4 bytes a
/// key, and each visited tile's LSE and D, 4 bytes a row each; the
/// deterministic dQ kernel Q, dO and the rows' LSE and D once and K, V per
/// non-skipped key tile.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BackwardStats {
    /// Bytes the main kernel (atomic or deterministic) moved with
    /// `cp.async`.
    pub main_cp_async_bytes: u64,
    /// 0 in atomic mode (no dQ kernel).
    pub dq_cp_async_bytes: u64,
}

thread_local! {
    static NEGATIVE_CONTROL: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// Runs `f` with a test-only fault in the two-m-tile main kernels' atomic
/// mode on this thread (negative controls; emulator only, the GPU build has
/// no such kernels): 1 drops the barrier between the dSᵀ stores and the
/// matmuls that read dS from shared memory (d 64: dQ; d 128: dK's first
/// half and dQ), 2 swaps the two key m-tiles' K fragments in Sᵀ, 3 (the
/// 8-warp kernels only; an error with the 4-warp d 64 one) drops the
/// barrier between the P stores and the warps that read P. 0: none.
#[doc(hidden)]
pub fn with_negative_control<R>(fault: u32, f: impl FnOnce() -> R) -> R {
    assert!(fault <= 3, "negative control {fault}: 0, 1, 2 or 3");
    let before = NEGATIVE_CONTROL.with(|c| c.replace(fault));
    let r = f();
    NEGATIVE_CONTROL.with(|c| c.set(before));
    r
}

thread_local! {
    static LAST_BACKWARD: std::cell::Cell<Option<BackwardStats>> = const { std::cell::Cell::new(None) };
}

/// Statistics of the last successful emulated backward on this thread.
pub fn last_backward_stats() -> Option<BackwardStats> {
    LAST_BACKWARD.with(|s| s.get())
}

/// The C++ traits of the backward kernels for `head_dim` as the emulator
/// sees them: `[main block_m, main block_n, main threads, main smem, dq
/// block_m, dq threads, dq smem]`; `None` when no kernel exists. Lets tests
/// hold [`crate::backend::launch::bwd::BwdTraits`] to the C++ source.
pub fn backward_kernel_traits(head_dim: u32) -> Option<[u32; 7]> {
    let mut out = [0i32; 7];
    // SAFETY: `out` has the 7 slots the function writes.
    let rc = unsafe { ffi::ta_emu_bwd_traits(head_dim, out.as_mut_ptr()) };
    (rc == 0).then(|| out.map(|x| x as u32))
}

/// The C++ traits of a two-m-tile backward main kernel for `head_dim`
/// (`four_warps`: [`MainKernel::TwoMTilesFourWarps`], else
/// [`MainKernel::TwoMTiles`]): `[block_m, block_n, threads, smem, sub_m]`;
/// `None` when it does not exist (head dims other than 64 and 128; the
/// 4-warp kernel: other than 64).
pub fn backward2_kernel_traits(head_dim: u32, four_warps: bool) -> Option<[u32; 5]> {
    let mut out = [0i32; 5];
    // SAFETY: `out` has the 5 slots the function writes.
    let rc = unsafe { ffi::ta_emu_bwd2_traits(head_dim, four_warps as u32, out.as_mut_ptr()) };
    (rc == 0).then(|| out.map(|x| x as u32))
}
