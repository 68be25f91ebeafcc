//! Launch planning of the backward kernels (`kernels/tree_attn_bwd.cu`),
//! shared by the `emu` and `cuda` backends.
//!
//! One backward call runs, in order (see the top of the .cu file):
//!
//! | kernel | grid | block | shared memory |
//! |---|---|---|---|
//! | `tree_attn_bwd_pre_*` | `ceil(tokens · q_heads / 4)` | 128 | 0 |
//! | `tree_attn_bwd_main_{atomic,det}_*` | `(key tiles of 64, kv_heads)` | 128 | 65,792 (d 64) / 75,520 (d 128) |
//! | `tree_attn_bwd_dq_*` (deterministic only) | `(query tiles of 64, q_heads)` | 128 | 55,296 / 104,448 |
//! | `tree_attn_bwd_dq_convert_*` | `ceil(tokens · q_heads / 4)` | 128 | 0 |

use super::{Dtype, LaunchPlan};
use crate::backend::AttnShape;
use crate::{Error, Result};

/// How the backward accumulates dQ.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DqMode {
    /// Every (key tile, query tile) block adds its share of dQ into an f32
    /// accumulator with `atomicAdd`: 5 tile matmuls per visible tile pair,
    /// summation order (hence the last bits of dQ) varies from run to run.
    Atomic,
    /// A separate kernel per query tile walks the visible key tiles and
    /// recomputes S, P, dP, dS to form dQ in registers: 7 tile matmuls per
    /// visible tile pair (1.4x) and twice the exponentials, no atomics, dQ
    /// bit-identical across runs.
    Deterministic,
}

/// Tiling of the backward kernels for one head dim (the Rust copy of the C++
/// `BwdTraits` / `BwdDqTraits`; the emulator checks every launch against the
/// C++ ones).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BwdTraits {
    /// Head dim of the kernels (64 or 128).
    pub head_dim: u32,
    /// Query rows per streamed tile of the main kernel (64 for d 64, 32 for
    /// d 128: the f32 dK, dV accumulators leave room for no more).
    pub block_m: u32,
    /// Keys per block of the main kernel (= the kv_end bounds tile).
    pub block_n: u32,
    /// Threads per block of the main kernel.
    pub threads: u32,
    /// Query rows per block of the deterministic dQ kernel.
    pub dq_block_m: u32,
}

impl BwdTraits {
    /// The kernels exist for head dims 64 and 128.
    pub fn for_head_dim(head_dim: usize) -> Result<Self> {
        match head_dim {
            64 | 128 => Ok(BwdTraits {
                head_dim: head_dim as u32,
                block_m: if head_dim == 64 { 64 } else { 32 },
                block_n: 64,
                threads: 128,
                dq_block_m: 64,
            }),
            _ => Err(Error::Unsupported(format!(
                "the GPU attention backward kernels have head dims 64 and 128, not {head_dim}"
            ))),
        }
    }
    fn row_stride(&self) -> u32 {
        self.head_dim + 8
    }
    /// Shared memory of the main kernel: K, V, two buffers each of Q and dO,
    /// dSᵀ, two buffers each of lse2 and D, the tile's kv_end.
    pub fn main_smem_bytes(&self) -> u32 {
        let rs = self.row_stride();
        2 * self.block_n * rs * 2
            + 4 * self.block_m * rs * 2
            + self.block_n * (self.block_m + 8) * 2
            + 4 * self.block_m * 4
            + self.block_n * 4
    }
    /// Shared memory of the deterministic dQ kernel: Q, dO and two buffers
    /// each of K and V.
    pub fn dq_smem_bytes(&self) -> u32 {
        6 * self.dq_block_m * self.row_stride() * 2
    }
    /// Symbol of one of the backward kernels (`stage` is `"pre"`,
    /// `"main_atomic"`, `"main_det"`, `"dq"` or `"dq_convert"`).
    pub fn kernel_name(&self, stage: &str, dtype: Dtype) -> String {
        format!("tree_attn_bwd_{stage}_{}_d{}", dtype.name(), self.head_dim)
    }
}

/// The launch plans of one backward call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BwdPlans {
    /// `tree_attn_bwd_pre` and `tree_attn_bwd_dq_convert`: one warp per
    /// (token, query head).
    pub per_row: LaunchPlan,
    /// `tree_attn_bwd_main_*`: one block per (key tile, kv head).
    pub main: LaunchPlan,
    /// `tree_attn_bwd_dq`: one block per (query tile, query head).
    pub dq: LaunchPlan,
}

/// The tiling and launch plans of a backward on a validated shape (an
/// [`crate::backend::AttnArgs`]'s). Errors: a head dim with no kernel, a
/// grid or index past the hardware's limits.
pub fn plan_backward(shape: &AttnShape) -> Result<(BwdTraits, BwdPlans)> {
    let traits = BwdTraits::for_head_dim(shape.head_dim)?;
    if shape.q_heads > 65_535 {
        return Err(Error::Unsupported(format!(
            "{} query heads exceed the grid's y limit 65535",
            shape.q_heads
        )));
    }
    let rows = shape.tokens as u64 * shape.q_heads as u64;
    if shape.tokens >= u32::MAX as usize - 128 || rows.div_ceil(4) > i32::MAX as u64 {
        return Err(Error::Unsupported(format!(
            "pack of {} tokens x {} query heads is too large for one launch",
            shape.tokens, shape.q_heads
        )));
    }
    let block = (traits.threads, 1, 1);
    let plans = BwdPlans {
        per_row: LaunchPlan {
            grid: (rows.div_ceil(4) as u32, 1, 1),
            block,
            shared_mem_bytes: 0,
        },
        main: LaunchPlan {
            grid: (
                shape.tokens.div_ceil(traits.block_n as usize) as u32,
                shape.kv_heads as u32,
                1,
            ),
            block,
            shared_mem_bytes: traits.main_smem_bytes(),
        },
        dq: LaunchPlan {
            grid: (
                shape.tokens.div_ceil(traits.dq_block_m as usize) as u32,
                shape.q_heads as u32,
                1,
            ),
            block,
            shared_mem_bytes: traits.dq_smem_bytes(),
        },
    };
    Ok((traits, plans))
}

/// Mirror of `TreeAttnBwdParams` (kernels/tree_attn_bwd.cu). Pointers are
/// device addresses (CUDA) or host addresses (emulator).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct BwdParams {
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub o: u64,
    pub d_o: u64,
    pub lse: u64,
    pub delta: u64,
    pub dq_accum: u64,
    pub dq: u64,
    pub dk: u64,
    pub dv: u64,
    pub kv_end: u64,
    pub tile_kv_min: u64,
    pub tile_kv_max: u64,
    pub tokens: u32,
    pub q_heads: u32,
    pub kv_heads: u32,
    pub num_key_tiles: u32,
    pub scale: f32,
    pub scale_log2: f32,
    pub head_dim: u32,
    pub zero_dq_accum: u32,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans() {
        let shape = AttnShape {
            tokens: 130,
            q_heads: 6,
            kv_heads: 2,
            head_dim: 128,
        };
        let (t, p) = plan_backward(&shape).unwrap();
        assert_eq!(t.block_m, 32);
        assert_eq!(p.main.grid, (3, 2, 1));
        assert_eq!(p.main.shared_mem_bytes, 75_520);
        assert_eq!(p.dq.grid, (3, 6, 1));
        assert_eq!(p.dq.shared_mem_bytes, 104_448);
        assert_eq!(p.per_row.grid, (195, 1, 1));
        assert_eq!(
            BwdTraits::for_head_dim(64).unwrap().main_smem_bytes(),
            65_792
        );
        assert_eq!(
            t.kernel_name("main_det", Dtype::Bf16),
            "tree_attn_bwd_main_det_bf16_d128"
        );
        assert!(matches!(
            BwdTraits::for_head_dim(96),
            Err(Error::Unsupported(_))
        ));
    }
}
