//! Attention backward on the emulator (`kernels/tree_attn_bwd.cu`).

use super::{current_config, emu_result, ffi, kv_tile_bounds, KernelElem};
use crate::backend::launch::bwd::{plan_backward, BwdParams, DqMode};
use crate::backend::launch::rope::{RopeArgs, RopeTables};
use crate::backend::launch::{scale_log2, LaunchPlan};
use crate::backend::{AttnParams, AttnShape};
use crate::mask::PackMask;
use crate::{Error, Result};

/// Gradients of a GPU-backend backward on host memory, with respect to the
/// *unrotated* q and k when rotary is on.
#[derive(Clone, Debug)]
pub struct GpuAttnGrads<T> {
    /// `[tokens, q_heads, head_dim]`.
    pub dq: Vec<T>,
    /// `[tokens, kv_heads, head_dim]`.
    pub dk: Vec<T>,
    /// `[tokens, kv_heads, head_dim]`.
    pub dv: Vec<T>,
}

/// Tree attention backward on the emulator, on one pack (DESIGN §5), from the
/// forward's `o` and `lse` and the output gradient `d_o`:
///
/// ```text
/// P = exp(scale · Q Kᵀ − LSE) masked      D = rowsum(dO ∘ O)
/// dS = P ∘ (dO Vᵀ − D)
/// dQ = scale · dS K    dK = scale · dSᵀ Q    dV = Pᵀ dO
/// ```
///
/// Shapes as [`super::attention_forward`]; `lse` is `[q_heads, tokens]` f32
/// (natural log, `−inf` for a row with no visible key: its dQ is 0 and it
/// adds nothing). dK and dV of a kv head sum over its query heads (GQA). With
/// `params.rope`, Q and K are rotated inside the kernels and dQ, dK are with
/// respect to the unrotated inputs. 16-bit inputs and outputs, f32
/// accumulation; `mode` picks how dQ is summed ([`DqMode`]). `params` and
/// `mask` must be those of the forward call.
///
/// Errors: everything [`super::attention_forward`] rejects;
/// `o`, `d_o`, `lse` of the wrong length; a NaN or `+inf` in `lse`; with
/// `params.check_finite`, a NaN or ±inf in q, k, v, o or d_o; a position id
/// past [`crate::backend::launch::rope::MAX_ROPE_POSITION`] with rotary.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward<T: KernelElem>(
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
) -> Result<GpuAttnGrads<T>> {
    // Poisoned: an element the kernels fail to write stays NaN.
    let nan = T::from_f32(f32::NAN);
    let mut g = GpuAttnGrads {
        dq: vec![nan; shape.q_len()],
        dk: vec![nan; shape.kv_len()],
        dv: vec![nan; shape.kv_len()],
    };
    attention_backward_into(
        q, k, v, o, lse, d_o, shape, mask, params, mode, &mut g.dq, &mut g.dk, &mut g.dv,
    )?;
    Ok(g)
}

/// [`attention_backward`] writing into caller-owned `dq`, `dk`, `dv`; every
/// element of the three is written.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward_into<T: KernelElem>(
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
    dq: &mut [T],
    dk: &mut [T],
    dv: &mut [T],
) -> Result<()> {
    let lens = [q.len(), k.len(), v.len(), o.len(), d_o.len(), lse.len()];
    let (traits, plans) = plan_backward(&shape, mask.len(), params, lens)?;
    // PackMask's fields are public: re-check the interval rule.
    PackMask::new(mask.kv_end, mask.position_ids)?;
    for (name, got, want) in [
        ("dq", dq.len(), shape.q_len()),
        ("dk", dk.len(), shape.kv_len()),
        ("dv", dv.len(), shape.kv_len()),
    ] {
        if got != want {
            return Err(Error::Shape(format!(
                "{name} has {got} elements, expected {want} for {shape:?}"
            )));
        }
    }
    if let Some(index) = lse.iter().position(|&x| x.is_nan() || x == f32::INFINITY) {
        return Err(Error::NonFinite {
            what: "lse (NaN or +inf; −inf marks a row with no visible key)".into(),
            index,
        });
    }
    if params.check_finite {
        for (name, x) in [("q", q), ("k", k), ("v", v), ("o", o), ("d_o", d_o)] {
            if let Some(index) = x.iter().position(|e| !e.to_f32().is_finite()) {
                return Err(Error::NonFinite {
                    what: name.into(),
                    index,
                });
            }
        }
    }
    if shape.tokens == 0 {
        return Ok(());
    }
    // Rows move in 16-byte cp.async vectors, dV in 4-byte stores, as on the
    // GPU, where device allocations are 256-byte aligned.
    for (name, addr, align) in [
        ("q", q.as_ptr() as usize, 16),
        ("k", k.as_ptr() as usize, 16),
        ("v", v.as_ptr() as usize, 16),
        ("d_o", d_o.as_ptr() as usize, 16),
        ("dv", dv.as_ptr() as usize, 4),
    ] {
        if addr % align != 0 {
            return Err(Error::Unsupported(format!(
                "{name} starts at {addr:#x}: the backward kernels need {align}-byte aligned tensors (copy it into a \
                 fresh Vec)"
            )));
        }
    }
    let tables = params
        .rope
        .map(|r| RopeTables::new(r, mask.position_ids))
        .transpose()?;
    let rope = tables.as_ref().map_or(RopeArgs::default(), |t| {
        t.args(
            mask.position_ids.as_ptr() as u64,
            t.cos.as_ptr() as u64,
            t.sin.as_ptr() as u64,
        )
    });
    let (tile_min, tile_max) = kv_tile_bounds(mask.kv_end, traits.block_n as usize)?;
    // Poisoned, so that the kernels, not this allocation, must provide every
    // value (and the accumulator's zeros in atomic mode).
    let mut delta = vec![f32::NAN; shape.q_heads * shape.tokens];
    let mut dq_accum = vec![f32::NAN; shape.q_len()];
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
        kv_end: mask.kv_end.as_ptr() as u64,
        tile_kv_min: tile_min.as_ptr() as u64,
        tile_kv_max: tile_max.as_ptr() as u64,
        rope,
        tokens: shape.tokens as u32,
        q_heads: shape.q_heads as u32,
        kv_heads: shape.kv_heads as u32,
        num_key_tiles: tile_min.len() as u32,
        scale: params.softmax_scale as f32,
        scale_log2: scale_log2(params),
        head_dim: traits.head_dim,
        zero_dq_accum: (mode == DqMode::Atomic) as u32,
    };
    let stages: &[(u32, &str, LaunchPlan)] = match mode {
        DqMode::Atomic => &[
            (0, "pre", plans.per_row),
            (1, "main_atomic", plans.main),
            (4, "dq_convert", plans.per_row),
        ],
        DqMode::Deterministic => &[
            (0, "pre", plans.per_row),
            (2, "main_det", plans.main),
            (3, "dq", plans.dq),
            (4, "dq_convert", plans.per_row),
        ],
    };
    let mut stats = BackwardStats::default();
    for &(stage, name, plan) in stages {
        let mut err = [0u8; 1024];
        let mut bytes = 0u64;
        // SAFETY: every pointer in `p` refers to a live slice whose length was
        // checked against `shape` above (delta, dq_accum, the tile bounds and
        // rope tables are sized here); the call is synchronous.
        let rc = unsafe {
            ffi::ta_emu_tree_attn_bwd(
                T::DTYPE.code(),
                traits.head_dim,
                stage,
                &p,
                plan.grid.0,
                plan.grid.1,
                plan.block.0,
                plan.shared_mem_bytes as usize,
                &current_config(),
                &mut bytes,
                err.as_mut_ptr(),
                err.len(),
            )
        };
        emu_result(&traits.kernel_name(name, T::DTYPE), rc, &err)?;
        match stage {
            1 | 2 => stats.main_cp_async_bytes = bytes,
            3 => stats.dq_cp_async_bytes = bytes,
            _ => {}
        }
    }
    LAST_BACKWARD.with(|s| s.set(Some(stats)));
    Ok(())
}

/// What the kernels of an emulated backward moved with `cp.async` (zero-filled
/// rows included), to prove the tile walks: the main kernel loads, per (key
/// tile, kv head), K and V once and Q, dO for each query tile it visits
/// (`2 · 64 · d · 2 + group · visited · 2 · block_m · d · 2` bytes); the
/// deterministic dQ kernel Q, dO once and K, V per non-skipped key tile.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BackwardStats {
    pub main_cp_async_bytes: u64,
    /// 0 in atomic mode (no dQ kernel).
    pub dq_cp_async_bytes: u64,
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
