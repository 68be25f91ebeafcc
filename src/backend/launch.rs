//! Launch planning shared by the `emu` and `cuda` backends: which kernel,
//! grid, block and dynamic shared memory, derived from one description of the
//! kernel's tiling ([`FwdTraits`]), plus the argument structs passed to the
//! kernels by value (mirrors of the C structs in `kernels/tree_attn_fwd.cu`).
//!
//! Forward tiling (see the top of `kernels/tree_attn_fwd.cu`): one block of
//! 4 warps per (query tile of 64 rows, query head), key tiles of 64; shared
//! memory holds Q and two buffers each of K and V, rows padded by 8 elements:
//! `(64 + 4 · 64) · (d + 8) · 2` bytes (46,080 for d = 64, 87,040 for d = 128).

use super::{AttnParams, AttnShape};
use crate::mask::PackMask;

pub mod bwd;
pub mod sdcc;
use crate::{Error, Result};

mod sealed {
    pub trait Sealed {}
    impl Sealed for half::bf16 {}
    impl Sealed for half::f16 {}
}

/// The 16-bit storage types the kernels take (f32 accumulation inside).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dtype {
    Bf16,
    F16,
}

impl Dtype {
    /// The code the emulator entry points take (0 = bf16, 1 = f16).
    pub(crate) fn code(self) -> u32 {
        match self {
            Dtype::Bf16 => 0,
            Dtype::F16 => 1,
        }
    }
    /// The name used in kernel symbols (`tree_attn_fwd_{name}_d{head_dim}`).
    pub fn name(self) -> &'static str {
        match self {
            Dtype::Bf16 => "bf16",
            Dtype::F16 => "f16",
        }
    }
}

/// An element type of the GPU kernels: `half::bf16` or `half::f16`.
pub trait KernelElem: sealed::Sealed + Copy + Send + Sync + bytemuck::Pod + 'static {
    const DTYPE: Dtype;
    fn to_f32(self) -> f32;
    /// Round to nearest even.
    fn from_f32(x: f32) -> Self;
}

impl KernelElem for half::bf16 {
    const DTYPE: Dtype = Dtype::Bf16;
    fn to_f32(self) -> f32 {
        half::bf16::to_f32(self)
    }
    fn from_f32(x: f32) -> Self {
        half::bf16::from_f32(x)
    }
}

impl KernelElem for half::f16 {
    const DTYPE: Dtype = Dtype::F16;
    fn to_f32(self) -> f32 {
        half::f16::to_f32(self)
    }
    fn from_f32(x: f32) -> Self {
        half::f16::from_f32(x)
    }
}

/// Tiling of the forward kernel for one head dim (the Rust copy of the C++
/// `FwdTraits`; the emulator checks every launch against the C++ one).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FwdTraits {
    pub head_dim: u32,
    /// Query rows per block.
    pub block_m: u32,
    /// Keys per key tile (also the tile of the per-tile kv_end bounds).
    pub block_n: u32,
    pub threads: u32,
    /// Shared-memory row stride in elements (`head_dim + 8`).
    pub row_stride: u32,
}

impl FwdTraits {
    /// The kernels exist for head dims 64 and 128.
    pub fn for_head_dim(head_dim: usize) -> Result<Self> {
        match head_dim {
            64 | 128 => {
                let d = head_dim as u32;
                Ok(FwdTraits {
                    head_dim: d,
                    block_m: 64,
                    block_n: 64,
                    threads: 128,
                    row_stride: d + 8,
                })
            }
            _ => Err(Error::Unsupported(format!(
                "the GPU attention kernels have head dims 64 and 128, not {head_dim}"
            ))),
        }
    }
    /// Dynamic shared memory: Q tile, two K and two V tiles of 16-bit elements.
    pub fn smem_bytes(&self) -> u32 {
        (self.block_m + 4 * self.block_n) * self.row_stride * 2
    }
    /// The kernel's symbol for an element type.
    pub fn kernel_name(&self, dtype: Dtype) -> String {
        format!("tree_attn_fwd_{}_d{}", dtype.name(), self.head_dim)
    }
    /// Number of key tiles of a pack of `tokens` tokens.
    pub fn key_tiles(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_n as usize)
    }
}

/// Grid, block and dynamic shared memory of one launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchPlan {
    pub grid: (u32, u32, u32),
    pub block: (u32, u32, u32),
    pub shared_mem_bytes: u32,
}

/// Checks one forward call and returns the kernel tiling and launch plan:
/// grid `(ceil(tokens / block_m), q_heads)`, one block per (query tile, head).
/// `lens` are the element counts of q, k, v.
pub fn plan_forward(
    shape: &AttnShape,
    mask: &PackMask<'_>,
    params: &AttnParams,
    lens: (usize, usize, usize),
) -> Result<(FwdTraits, LaunchPlan)> {
    shape.validate()?;
    params.validate(shape)?;
    if params.rope.is_some() {
        return Err(Error::Unsupported(
            "rotary embedding inside the GPU forward kernel is not implemented yet; rotate Q and K before the call"
                .into(),
        ));
    }
    let traits = FwdTraits::for_head_dim(shape.head_dim)?;
    if mask.len() != shape.tokens {
        return Err(Error::Pack(format!(
            "pack has {} tokens but the attention shape has {}",
            mask.len(),
            shape.tokens
        )));
    }
    let (q, k, v) = lens;
    for (name, got, want) in [
        ("q", q, shape.q_len()),
        ("k", k, shape.kv_len()),
        ("v", v, shape.kv_len()),
    ] {
        if got != want {
            return Err(Error::Shape(format!(
                "{name} has {got} elements, expected {want} for {shape:?} ([tokens, heads, head_dim])"
            )));
        }
    }
    if shape.q_heads > 65_535 {
        return Err(Error::Unsupported(format!(
            "{} query heads exceed the grid's y limit 65535",
            shape.q_heads
        )));
    }
    if shape.q_len() > (i32::MAX as usize) * 8
        || shape.tokens >= u32::MAX as usize - traits.block_m as usize
    {
        return Err(Error::Unsupported(format!(
            "pack of {} tokens is too large for one launch",
            shape.tokens
        )));
    }
    let grid_x = shape.tokens.div_ceil(traits.block_m as usize) as u32;
    let plan = LaunchPlan {
        grid: (grid_x, shape.q_heads as u32, 1),
        block: (traits.threads, 1, 1),
        shared_mem_bytes: traits.smem_bytes(),
    };
    Ok((traits, plan))
}

/// Warps (key tiles) per block of the per-tile kv_end bounds kernel.
pub const KV_BOUNDS_TILES_PER_BLOCK: u32 = 4;

/// Launch plan of `tree_attn_kv_tile_bounds`: one warp per key tile.
pub fn plan_kv_tile_bounds(num_tiles: usize) -> LaunchPlan {
    LaunchPlan {
        grid: ((num_tiles as u32).div_ceil(KV_BOUNDS_TILES_PER_BLOCK), 1, 1),
        block: (32 * KV_BOUNDS_TILES_PER_BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// `softmax_scale · log2(e)`, the factor the kernel folds into exp2.
pub(crate) fn scale_log2(params: &AttnParams) -> f32 {
    (params.softmax_scale * std::f64::consts::LOG2_E) as f32
}

/// Mirror of `TreeAttnFwdParams` (kernels/tree_attn_fwd.cu). Pointers are
/// device addresses (CUDA) or host addresses (emulator).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct FwdParams {
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub o: u64,
    pub lse: u64,
    pub kv_end: u64,
    pub tile_kv_min: u64,
    pub tile_kv_max: u64,
    pub tokens: u32,
    pub q_heads: u32,
    pub kv_heads: u32,
    pub num_key_tiles: u32,
    pub scale_log2: f32,
    pub reserved: u32,
}

/// Mirror of `KvTileBoundsParams` (kernels/tree_attn_fwd.cu).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct KvBoundsParams {
    pub kv_end: u64,
    pub tile_kv_min: u64,
    pub tile_kv_max: u64,
    pub tokens: u32,
    pub tile: u32,
    pub num_tiles: u32,
    pub reserved: u32,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_cover_every_token_and_head() {
        let shape = AttnShape {
            tokens: 130,
            q_heads: 6,
            kv_heads: 2,
            head_dim: 128,
        };
        let kv_end = vec![130u32; 130];
        let pos: Vec<u32> = (0..130).collect();
        let mask = PackMask::new(&kv_end, &pos).unwrap();
        let p = AttnParams::new(128);
        let (t, plan) = plan_forward(
            &shape,
            &mask,
            &p,
            (shape.q_len(), shape.kv_len(), shape.kv_len()),
        )
        .unwrap();
        assert_eq!(plan.grid, (3, 6, 1));
        assert_eq!(plan.block, (128, 1, 1));
        assert_eq!(plan.shared_mem_bytes, 87_040);
        assert_eq!(t.kernel_name(Dtype::F16), "tree_attn_fwd_f16_d128");
        assert_eq!(plan_kv_tile_bounds(t.key_tiles(130)).grid, (1, 1, 1));
        assert_eq!(plan_kv_tile_bounds(5).grid, (2, 1, 1));
    }

    #[test]
    fn rejects_what_the_kernel_cannot_do() {
        let kv_end = vec![4u32; 4];
        let pos = vec![0u32; 4];
        let mask = PackMask::new(&kv_end, &pos).unwrap();
        let shape = AttnShape {
            tokens: 4,
            q_heads: 1,
            kv_heads: 1,
            head_dim: 96,
        };
        let lens = (shape.q_len(), shape.kv_len(), shape.kv_len());
        assert!(matches!(
            plan_forward(&shape, &mask, &AttnParams::new(96), lens),
            Err(Error::Unsupported(_))
        ));
        let shape = AttnShape {
            head_dim: 64,
            ..shape
        };
        let lens = (shape.q_len(), shape.kv_len(), shape.kv_len());
        let mut p = AttnParams::new(64);
        p.rope = Some(super::super::Rope {
            base: 10_000.0,
            dims: 64,
        });
        let e = plan_forward(&shape, &mask, &p, lens).unwrap_err();
        assert!(e.to_string().contains("rotary"), "{e}");
        let e = plan_forward(
            &shape,
            &mask,
            &AttnParams::new(64),
            (lens.0, lens.1 - 1, lens.2),
        )
        .unwrap_err();
        assert!(e.to_string().contains("k has"), "{e}");
        let short = PackMask::new(&[3, 3, 3], &pos[..3]).unwrap();
        assert!(matches!(
            plan_forward(&shape, &short, &AttnParams::new(64), lens),
            Err(Error::Pack(_))
        ));
    }
}
