//! The rotary inputs of the attention kernels (`kernels/rope.cuh`): per-position
//! cos / sin tables and their kernel-argument mirror.

use crate::backend::Rope;
use crate::{Error, Result};

/// Largest position id the rotary tables are built for (tables are
/// `(max position + 1) · dims` f32s).
pub const MAX_ROPE_POSITION: u32 = 1 << 22;

/// Per-position rotary tables of the kernels: `cos[p · half + i] = cos(p
/// θ_i)`, `sin` likewise, `θ_i = base^(−2i / dims)`, for `p` up to the largest
/// position id of the pack — computed in f64 (as the CPU backend does) and
/// rounded once to f32.
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
        let max = position_ids.iter().copied().max().unwrap_or(0);
        if max > MAX_ROPE_POSITION {
            let at = position_ids.iter().position(|&p| p == max).unwrap_or(0);
            return Err(Error::Unsupported(format!(
                "position id {max} (token {at}) exceeds {MAX_ROPE_POSITION}, the largest the GPU rotary tables cover"
            )));
        }
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

impl RopeTables {
    /// The kernel arguments for these tables at addresses `cos` and `sin`
    /// (host or device copies of [`Self::cos`], [`Self::sin`]) and the
    /// pack's position ids at `pos`.
    pub(crate) fn args(&self, pos: u64, cos: u64, sin: u64) -> RopeArgs {
        RopeArgs {
            pos,
            cos,
            sin,
            half: self.half,
            reserved: 0,
        }
    }
}

/// Mirror of `TaRope` (kernels/rope.cuh); `half == 0`: no rotary.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct RopeArgs {
    pub pos: u64,
    pub cos: u64,
    pub sin: u64,
    pub half: u32,
    pub reserved: u32,
}

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
    }
}
