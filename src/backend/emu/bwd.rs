//! Attention backward on the emulator (`kernels/tree_attn_bwd.cu`).

use super::{check_result, emu_result, ffi, Emu, KernelElem};
use crate::backend::launch::bwd::{
    balanced_item_table, balanced_main_items, plan_backward_var, plan_backward_with, BwdParams,
    DqMode, MainKernel,
};
use crate::backend::launch::{check_kernel_call, scale_log2, softcap_args, LaunchPlan};
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
    let (q, k, v, shape, mask) = (args.q(), args.k(), args.v(), args.shape(), args.mask());
    let params = args.params();
    let (o, lse) = (saved.o, saved.lse);
    let Grads {
        dq,
        dk,
        dv,
        mut dsinks,
    } = grads;
    let mode = emu.dq_mode;
    let var = check_kernel_call("emulated kernels", &args)?;
    let (traits, mut plans) = if var {
        plan_backward_var(
            &shape,
            emu.group_splits,
            emu.main_kernel,
            params.softcap.is_some(),
        )?
    } else {
        plan_backward_with(&shape, emu.group_splits, emu.main_kernel)?
    };
    if shape.tokens == 0 {
        if let Some(ds) = dsinks {
            // No row: the sum over rows is 0.
            ds.fill(T::from_f32(0.0));
        }
        return Ok(());
    }
    if params.rope.is_some() {
        return Err(Error::Unsupported(
            "internal: rotary reached the rotary-free backward kernels".into(),
        ));
    }
    let (tile_min, tile_max) = emu.kv_tile_bounds(mask.kv_end(), traits.block_n as usize)?;
    let starts = if var { emu.key_starts(&args)? } else { None };
    let (softcap_c, softcap_in) = softcap_args(params);
    let addr = |x: Option<&Vec<u32>>| x.map_or(0, |x| x.as_ptr() as u64);
    let dsinks_addr = dsinks.as_mut().map_or(0, |d| d.as_mut_ptr() as u64);
    // Poisoned, so that the kernels, not this allocation, must provide every
    // value (and the accumulator's zeros in atomic mode).
    let mut delta = vec![f32::NAN; shape.q_heads * shape.tokens];
    let mut dq_accum = vec![f32::NAN; shape.q_len()];
    // The balanced launch: the item table, its grid and slots; the scratch
    // zero-filled (slots past a key tile's chunks are summed unwritten).
    let (items, dkv_slots) = match emu.balance_cap {
        None => (Vec::new(), 0),
        Some(cap) => {
            if traits.main_kernel != MainKernel::TwoMTiles {
                return Err(Error::Unsupported(format!(
                    "the balanced backward launch exists for the 8-warp two-m-tile main kernel only, not {:?}",
                    traits.main_kernel
                )));
            }
            let group = (shape.q_heads / shape.kv_heads) as u32;
            let list = balanced_main_items(
                mask.kv_end(),
                traits.main_keys,
                traits.block_m,
                shape.kv_heads as u32,
                plans.group_splits,
                group / plans.group_splits,
                cap,
            );
            plans.main.grid = (list.len() as u32, 1, 1);
            balanced_item_table(&list, plans.group_splits)
        }
    };
    let mut dkv_accum = if dkv_slots > 0 {
        vec![0f32; dkv_slots as usize * 2 * shape.kv_len()]
    } else {
        vec![f32::NAN; plans.dkv_accum_len(&shape)]
    };
    let p = BwdParams {
        q: q.as_ptr() as u64,
        k: k.as_ptr() as u64,
        v: v.as_ptr() as u64,
        o: o.as_ptr() as u64,
        d_o: d_o.as_ptr() as u64,
        lse: lse.as_ptr() as u64,
        delta: delta.as_mut_ptr() as u64,
        dq_accum: dq_accum.as_mut_ptr() as u64,
        dq: dq.as_mut_ptr() as u64,
        dk: dk.as_mut_ptr() as u64,
        dv: dv.as_mut_ptr() as u64,
        kv_end: mask.kv_end().as_ptr() as u64,
        tile_kv_min: tile_min.as_ptr() as u64,
        tile_kv_max: tile_max.as_ptr() as u64,
        dkv_accum: if dkv_accum.is_empty() {
            0
        } else {
            dkv_accum.as_mut_ptr() as u64
        },
        tokens: shape.tokens as u32,
        q_heads: shape.q_heads as u32,
        kv_heads: shape.kv_heads as u32,
        num_key_tiles: tile_min.len() as u32,
        scale: params.softmax_scale as f32,
        scale_log2: scale_log2(params),
        head_dim: traits.head_dim,
        zero_dq_accum: (mode == DqMode::Atomic) as u32,
        group_splits: plans.group_splits,
        dkv_slots,
        key_start: addr(starts.as_ref().map(|s| &s.starts)),
        start_tile_min: addr(starts.as_ref().map(|s| &s.tile_min)),
        start_tile_max: addr(starts.as_ref().map(|s| &s.tile_max)),
        sinks: args.sinks().map_or(0, |s| s.as_ptr() as u64),
        dsinks: dsinks_addr,
        softcap_c,
        softcap_in,
        items: if items.is_empty() {
            0
        } else {
            items.as_ptr() as u64
        },
    };
    // Stage numbers of kernels/emu/bwd_entry.cpp: the two-m-tile main
    // kernel is 6 (atomic) / 7 (det), 8 / 9 / 10 with a negative control's
    // fault; the 4-warp d 64 one 11 / 12, 13 / 14 with fault 1 / 2.
    let fault = NEGATIVE_CONTROL.with(|f| f.get());
    let (main_atomic, main_det) = match (traits.main_kernel, fault) {
        // The variant kernels (15 / 16 one m-tile, 17 / 18 two; their
        // dQ kernel 19): no negative-control faults.
        (MainKernel::OneMTile, 0) if var => (15, 16),
        (MainKernel::TwoMTiles, 0) if var => (17, 18),
        (_, f) if var => {
            return Err(Error::Unsupported(format!(
                "negative control {f}: the faults exist in the plain main kernels only (or {:?} with variants)",
                traits.main_kernel
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
    let (main_atomic_name, main_det_name, dq_stage, dq_name) = if var {
        ("main_var_atomic", "main_var_det", 19, "dq_var")
    } else {
        ("main_atomic", "main_det", 3, "dq")
    };
    let mut stages: Vec<(u32, &str, LaunchPlan)> = match mode {
        DqMode::Atomic => vec![
            (0, "pre", plans.per_row),
            (main_atomic, main_atomic_name, plans.main),
            (4, "dq_convert", plans.per_row),
        ],
        DqMode::Deterministic => vec![
            (0, "pre", plans.per_row),
            (main_det, main_det_name, plans.main),
            (dq_stage, dq_name, plans.dq),
            (4, "dq_convert", plans.per_row),
        ],
    };
    if plans.group_splits > 1 || dkv_slots > 0 {
        stages.push((5, "dkv_convert", plans.dkv_convert));
    }
    if args.sinks().is_some() && dsinks_addr != 0 {
        // After pre (D), in launch order.
        stages.insert(1, (20, "dsinks", plans.dsinks));
    }
    let mut stats = BackwardStats::default();
    for &(stage, name, plan) in &stages {
        let mut err = [0u8; 1024];
        let mut bytes = 0u64;
        // SAFETY: every pointer in `p` refers to a live slice whose length was
        // checked against `shape` above (delta, dq_accum, dkv_accum and the
        // tile bounds are sized here); the call is synchronous.
        let rc = unsafe {
            ffi::ta_emu_tree_attn_bwd(
                T::DTYPE.code(),
                traits.head_dim,
                stage,
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
        emu_result(&traits.kernel_name(name, T::DTYPE), rc, &err)?;
        match stage {
            1 | 2 | 6..=18 => stats.main_cp_async_bytes = bytes,
            3 | 19 => stats.dq_cp_async_bytes = bytes,
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
