//! Rotary embedding on the GPU (and the emulator): the launch plans and
//! argument mirrors of the elementwise kernels of `kernels/rope.cu`, which
//! rotate Q and K once per call before the (rotary-free) attention kernels
//! and rotate dQ, dK back after the backward, and of the kernel that builds
//! the per-position cos / sin tables they read ([`RopeTables`] is the host
//! reference of those tables).

use super::LaunchPlan;
use crate::backend::Rope;
use crate::{Error, Result};

/// Largest position id the rotary tables are built for (tables are
/// `(max position + 1) · dims` f32s).
pub const MAX_ROPE_POSITION: u32 = 1 << 22;

/// Threads per block of every rotary kernel (`TA_ROPE_THREADS`).
pub const ROPE_THREADS: u32 = 128;

/// `Err` unless a pack whose largest position id is `max` (at token `at`)
/// fits the rotary tables ([`MAX_ROPE_POSITION`]).
pub fn check_max_position(max: u32, at: usize) -> Result<()> {
    if max > MAX_ROPE_POSITION {
        return Err(Error::Unsupported(format!(
            "position id {max} (token {at}) exceeds {MAX_ROPE_POSITION}, the largest the GPU rotary tables cover"
        )));
    }
    Ok(())
}

/// The largest position id of a pack and its first token (0, 0 when empty).
pub fn max_position(position_ids: &[u32]) -> (u32, usize) {
    let max = position_ids.iter().copied().max().unwrap_or(0);
    let at = position_ids.iter().position(|&p| p == max).unwrap_or(0);
    (max, at)
}

/// Per-position rotary tables: `cos[p · half + i] = cos(p θ_i)`, `sin`
/// likewise, `θ_i = base^(−2i / dims)`, for `p` up to the largest position id
/// of the pack — computed in f64 (as the CPU backend does) and rounded once
/// to f32. The host reference of what `ta_rope_table` builds on the device.
#[derive(Clone, Debug, PartialEq)]
pub struct RopeTables {
    /// `dims / 2`: the rotated pairs per position.
    pub half: u32,
    /// `cos(p θ_i)`, `[positions, half]`.
    pub cos: Vec<f32>,
    /// `sin(p θ_i)`, `[positions, half]`.
    pub sin: Vec<f32>,
}

impl RopeTables {
    /// Tables for `rope` over the positions of `position_ids`; `Err` when a
    /// position id exceeds [`MAX_ROPE_POSITION`].
    pub fn new(rope: Rope, position_ids: &[u32]) -> Result<Self> {
        let (max, at) = max_position(position_ids);
        check_max_position(max, at)?;
        let half = rope.dims / 2;
        let inv_freq: Vec<f64> = (0..half)
            .map(|i| rope.base.powf(-2.0 * i as f64 / rope.dims as f64))
            .collect();
        let n = (max as usize + 1) * half;
        let (mut cos, mut sin) = (Vec::with_capacity(n), Vec::with_capacity(n));
        for p in 0..=max {
            for &f in &inv_freq {
                let (s, c) = (p as f64 * f).sin_cos();
                cos.push(c as f32);
                sin.push(s as f32);
            }
        }
        Ok(RopeTables {
            half: half as u32,
            cos,
            sin,
        })
    }
}

/// Launch plan of `ta_rope_table` for `positions` positions (max position
/// id + 1) of `half` pairs: one thread per entry.
pub fn plan_rope_table(positions: u32, half: u32) -> Result<LaunchPlan> {
    let blocks = (positions as u64 * half as u64).div_ceil(ROPE_THREADS as u64);
    if blocks > i32::MAX as u64 {
        return Err(Error::Unsupported(format!(
            "rotary tables of {positions} positions x {half} pairs are too large for one launch"
        )));
    }
    Ok(LaunchPlan {
        grid: (blocks.max(1) as u32, 1, 1),
        block: (ROPE_THREADS, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// Launch plan of `ta_rope_{dtype}_d{head_dim}` over a `[tokens, heads,
/// head_dim]` tensor: one thread per (row, pair slot), `256 / head_dim` rows
/// per block of [`ROPE_THREADS`] (see the top of `kernels/rope.cu`).
pub fn plan_rope_apply(tokens: usize, heads: usize, head_dim: usize) -> Result<LaunchPlan> {
    super::kernel_head_dim("the GPU rotary kernels", head_dim)?;
    let rows_per_block = 2 * ROPE_THREADS as u64 / head_dim as u64;
    let blocks = (tokens as u64 * heads as u64).div_ceil(rows_per_block);
    if blocks > i32::MAX as u64 || tokens > u32::MAX as usize || heads > u32::MAX as usize {
        return Err(Error::Unsupported(format!(
            "{tokens} tokens x {heads} heads are too many rows for one rotary launch"
        )));
    }
    Ok(LaunchPlan {
        grid: (blocks.max(1) as u32, 1, 1),
        block: (ROPE_THREADS, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// The kernel's symbol for an element type and head dim.
pub fn rope_kernel_name(dtype: super::Dtype, head_dim: u32) -> String {
    format!("ta_rope_{}_d{head_dim}", dtype.name())
}

/// Mirror of `TaRopeTableParams` (kernels/rope.cu).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct RopeTableParams {
    pub cos: u64,
    pub sin: u64,
    pub base: f64,
    pub positions: u32,
    pub half: u32,
    pub dims: u32,
    pub reserved: u32,
}
super::assert_layout!(RopeTableParams, 40, {
    cos: 0, sin: 8, base: 16, positions: 24, half: 28, dims: 32, reserved: 36,
});

impl RopeTableParams {
    /// Tables for `rope` at `cos`, `sin` (each `positions · dims / 2` f32s).
    pub(crate) fn new(rope: Rope, positions: u32, cos: u64, sin: u64) -> Self {
        RopeTableParams {
            cos,
            sin,
            base: rope.base,
            positions,
            half: (rope.dims / 2) as u32,
            dims: rope.dims as u32,
            reserved: 0,
        }
    }
}

/// Mirror of `TaRopeApplyParams` (kernels/rope.cu).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct RopeApplyParams {
    pub x: u64,
    pub y: u64,
    pub pos: u64,
    pub cos: u64,
    pub sin: u64,
    pub tokens: u32,
    pub heads: u32,
    pub half: u32,
    /// 0: rotate; 1: rotate back (the transpose rotation, for gradients).
    pub inverse: u32,
}
super::assert_layout!(RopeApplyParams, 56, {
    x: 0, y: 8, pos: 16, cos: 24, sin: 32, tokens: 40, heads: 44, half: 48, inverse: 52,
});

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_hold_the_cpu_angles() {
        let rope = Rope {
            base: 10_000.0,
            dims: 8,
        };
        let tb = RopeTables::new(rope, &[3, 0, 5]).unwrap();
        assert_eq!((tb.half, tb.cos.len()), (4, 24));
        let want = (5.0f64 * 10_000f64.powf(-2.0 / 8.0)).sin_cos();
        assert_eq!(tb.sin[5 * 4 + 1], want.0 as f32);
        assert_eq!(tb.cos[5 * 4 + 1], want.1 as f32);
        assert!(RopeTables::new(rope, &[MAX_ROPE_POSITION + 1]).is_err());
        assert_eq!(max_position(&[3, 9, 2, 9]), (9, 1));
    }

    #[test]
    fn plans_cover_every_row_and_entry() {
        // 4 rows of d 64 per block, 2 of d 128.
        assert_eq!(plan_rope_apply(10, 3, 64).unwrap().grid, (8, 1, 1));
        assert_eq!(plan_rope_apply(10, 3, 128).unwrap().grid, (15, 1, 1));
        assert_eq!(plan_rope_apply(1, 1, 64).unwrap().block, (128, 1, 1));
        assert!(plan_rope_apply(10, 3, 96).is_err());
        assert_eq!(plan_rope_table(6, 32).unwrap().grid, (2, 1, 1));
        assert_eq!(plan_rope_table(7, 32).unwrap().grid, (2, 1, 1));
        assert_eq!(plan_rope_table(9, 32).unwrap().grid, (3, 1, 1));
    }
}
