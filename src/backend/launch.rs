//! Launch planning shared by the `emu` and `cuda` backends: which kernel,
//! grid, block and dynamic shared memory, derived from one description of the
//! kernel's tiling ([`FwdTraits`]), plus the argument structs passed to the
//! kernels by value (mirrors of the C structs in `kernels/tree_attn_fwd.cu`).
//!
//! Forward tiling (see the top of `kernels/tree_attn_fwd.cu`), that of
//! FlashAttention-2: one block of 4 warps per (query tile of 128 rows, query
//! head), each warp 32 rows (two 16-row m-tiles), key tiles of 64; shared
//! memory holds the Q tile (the O tile passes through it at the end), two
//! buffers each of K and V, rows padded by 8 elements, and the online-softmax
//! row statistics (4 f32 words per row a thread holds: 4 KiB), and per K / V
//! buffer the key tile's kv_end and bound and the tile walk's look-ahead
//! window (132 words):
//! `(128 + 4 · 64) · (d + 8) · 2 + 4096 + 1056` bytes (60,448 for d = 64,
//! 109,600 for d = 128; above 48 KiB, so the CUDA backend raises each forward kernel's
//! dynamic shared-memory limit before its first launch).

use super::{AttnParams, AttnShape};
use crate::mask::classify_tile;
pub use crate::mask::TileClass;
use crate::{Error, Result};

pub mod bwd;
pub mod rope;
pub mod sdcc;

mod sealed {
    pub trait Sealed {}
    impl Sealed for half::bf16 {}
    impl Sealed for half::f16 {}
}

/// The 16-bit storage types the kernels take (f32 accumulation inside).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dtype {
    /// bfloat16.
    Bf16,
    /// IEEE half precision.
    F16,
}

impl Dtype {
    /// The code the emulator entry points take (0 = bf16, 1 = f16; the
    /// `DTYPE` of `TA_ATTN_VARIANTS`, which build.rs checks).
    #[cfg(feature = "emu")]
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

/// The attention and rotary kernels' variants, `(element type, head dim)`,
/// in the order of `TA_ATTN_VARIANTS` (kernels/common.cuh), which build.rs
/// reads: the one list behind the `.cu` instantiations, the emulator's
/// switches, the head dims the launch plans accept and the CUDA backend's
/// function tables (in this order: [`variant_index`]).
pub const ATTN_VARIANTS: &[(Dtype, u32)] = &include!(concat!(env!("OUT_DIR"), "/attn_variants.rs"));

/// The position of `(dtype, head_dim)` in [`ATTN_VARIANTS`], `None` when no
/// kernel has it.
pub fn variant_index(dtype: Dtype, head_dim: u32) -> Option<usize> {
    ATTN_VARIANTS.iter().position(|&v| v == (dtype, head_dim))
}

/// As [`variant_index`], an [`Error::Unsupported`] when no kernel has the
/// variant.
#[cfg(feature = "cuda")]
pub(crate) fn variant(dtype: Dtype, head_dim: u32) -> Result<usize> {
    variant_index(dtype, head_dim).ok_or_else(|| {
        Error::Unsupported(format!(
            "no {} GPU kernel for head dim {head_dim}",
            dtype.name()
        ))
    })
}

/// `head_dim` when some variant of [`ATTN_VARIANTS`] has it, else
/// [`Error::Unsupported`]: "`kernels` have head dims 64 and 128, not …".
pub(crate) fn kernel_head_dim(kernels: &str, head_dim: usize) -> Result<u32> {
    let mut dims: Vec<u32> = ATTN_VARIANTS.iter().map(|&(_, d)| d).collect();
    dims.sort_unstable();
    dims.dedup();
    if let Some(&d) = dims.iter().find(|&&d| d as usize == head_dim) {
        return Ok(d);
    }
    let names: Vec<String> = dims.iter().map(u32::to_string).collect();
    let list = match names.split_last() {
        Some((last, rest)) if !rest.is_empty() => format!("{} and {last}", rest.join(", ")),
        _ => names.concat(),
    };
    Err(Error::Unsupported(format!(
        "{kernels} have head dims {list}, not {head_dim}"
    )))
}

/// Asserts, at compile time, the size and field offsets of a kernel
/// argument struct's `#[repr(C)]` mirror: the numbers the C++ struct pins
/// with `static_assert` / `TA_FIELD_AT` (kernels/common.cuh), so that
/// neither side can change alone.
macro_rules! assert_layout {
    ($t:ty, $size:expr, { $($field:ident: $offset:expr),* $(,)? }) => {
        const _: () = {
            assert!(std::mem::size_of::<$t>() == $size);
            $(assert!(std::mem::offset_of!($t, $field) == $offset);)*
        };
    };
}
pub(crate) use assert_layout;

/// An element type of the GPU kernels: `half::bf16` or `half::f16`.
pub trait KernelElem:
    sealed::Sealed + crate::backend::Element + Copy + Send + Sync + bytemuck::Pod + 'static
{
    /// The storage type as the kernels name it.
    const DTYPE: Dtype;
    /// Widens exactly.
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
    /// Head dim of the kernel (64 or 128).
    pub head_dim: u32,
    /// Query rows per block.
    pub block_m: u32,
    /// Keys per key tile (also the tile of the per-tile kv_end bounds).
    pub block_n: u32,
    /// Threads per block.
    pub threads: u32,
    /// Shared-memory row stride in elements (`head_dim + 8`).
    pub row_stride: u32,
}

impl FwdTraits {
    /// The kernels exist for the head dims of [`ATTN_VARIANTS`] (64, 128).
    pub fn for_head_dim(head_dim: usize) -> Result<Self> {
        let d = kernel_head_dim("the GPU attention kernels", head_dim)?;
        Ok(FwdTraits {
            head_dim: d,
            block_m: 128,
            block_n: 64,
            threads: 128,
            row_stride: d + 8,
        })
    }
    /// Dynamic shared memory: the Q tile, two K and two V tiles of 16-bit
    /// elements, then the row max and partial row sum of each of a thread's
    /// `2 · block_m / (16 · warps)` rows in f32 (C++ `FwdTraits::kOffStats`),
    /// then per K / V buffer the tile's kv_end and bound (`block_n + 4`
    /// words, C++ `FwdTraits::kOffKvEnd`) and the walk's look-ahead window
    /// (`tile_kv_max`, `tile_kv_min` of the next 32 key tiles: 64 words,
    /// C++ `FwdTraits::kWindowOff`).
    pub fn smem_bytes(&self) -> u32 {
        let rows_per_thread = 2 * self.block_m / (16 * (self.threads / 32));
        (self.block_m + 4 * self.block_n) * self.row_stride * 2
            + 2 * rows_per_thread * self.threads * 4
            + 2 * (self.block_n + 4 + 64) * 4
    }
    /// Dynamic shared memory of the variant kernel (`tree_attn_fwd_var_*`):
    /// [`Self::smem_bytes`] plus the query tile's key starts, one u32 per
    /// row (C++ `FwdTraits::kSmemBytesVar`).
    pub fn smem_bytes_var(&self) -> u32 {
        self.smem_bytes() + self.block_m * 4
    }
    /// The kernel's symbol for an element type.
    pub fn kernel_name(&self, dtype: Dtype) -> String {
        format!("tree_attn_fwd_{}_d{}", dtype.name(), self.head_dim)
    }
    /// The variant kernel's symbol (`tree_attn_fwd_var_{dtype}_d{head_dim}`).
    pub fn kernel_name_var(&self, dtype: Dtype) -> String {
        format!("tree_attn_fwd_var_{}_d{}", dtype.name(), self.head_dim)
    }
    /// Number of key tiles of a pack of `tokens` tokens.
    pub fn key_tiles(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_n as usize)
    }
}

/// Grid, block and dynamic shared memory of one launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchPlan {
    /// Blocks per grid dimension.
    pub grid: (u32, u32, u32),
    /// Threads per block dimension.
    pub block: (u32, u32, u32),
    /// Dynamic shared memory per block.
    pub shared_mem_bytes: u32,
}

/// The kernel tiling and launch plan of a forward on a validated shape (an
/// [`crate::backend::AttnArgs`]'s): grid `(ceil(tokens / block_m),
/// q_heads)`, one block per (query tile, head). Errors: a head dim with no
/// kernel, a grid or index past the hardware's limits.
pub fn plan_forward(shape: &AttnShape) -> Result<(FwdTraits, LaunchPlan)> {
    let traits = FwdTraits::for_head_dim(shape.head_dim)?;
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

/// The forward kernel's rule (DESIGN §5) for the query tile `[q0, q0 +
/// block_m)` and key tile `[k0, k0 + block_n)` of a pack of `tokens` tokens,
/// given min and max of `kv_end` over the key tile; with `q1` the query tile's
/// end clipped to the pack:
///
/// ```text
/// skip     k0 > q1 − 1  or  max kv_end <= q0
/// full     k0 + block_n <= tokens  and  k0 + block_n − 1 <= q0  and  min kv_end >= q1
/// partial  otherwise
/// ```
pub fn tile_class(
    traits: &FwdTraits,
    tokens: usize,
    q0: usize,
    k0: usize,
    kv_min: u32,
    kv_max: u32,
) -> TileClass {
    let (bm, bn) = (traits.block_m as usize, traits.block_n as usize);
    let q1 = (q0 + bm).min(tokens);
    match classify_tile(q0, q1, k0, (k0 + bn).min(tokens), kv_min, kv_max) {
        // The kernel loads whole key tiles; a short last tile needs the
        // element mask for its out-of-range keys.
        TileClass::Full if k0 + bn > tokens => TileClass::Partial,
        class => class,
    }
}

/// [`tile_class`] for the variant kernel with key starts (a sliding
/// window): `starts` is `(min, max)` of the key starts over the query
/// tile's rows. A key tile that ends before every row's start is skipped
/// (the kernel's walk begins at the key tile of the smallest start), and a
/// tile is full only if it also begins at or after the largest.
#[allow(clippy::too_many_arguments)]
pub fn tile_class_with_starts(
    traits: &FwdTraits,
    tokens: usize,
    q0: usize,
    k0: usize,
    kv_min: u32,
    kv_max: u32,
    starts: (u32, u32),
) -> TileClass {
    let last_key = k0 + traits.block_n as usize - 1;
    match tile_class(traits, tokens, q0, k0, kv_min, kv_max) {
        _ if last_key < starts.0 as usize => TileClass::Skip,
        TileClass::Full if k0 < starts.1 as usize => TileClass::Partial,
        class => class,
    }
}

/// Counts of [`TileClass`] over all (query tile, key tile) pairs of a pack:
/// `(skipped, full, partial)` — how much of the square the kernel never
/// touches, and how much it computes without a mask.
pub fn count_tiles(kv_end: &[u32], traits: &FwdTraits) -> (u64, u64, u64) {
    let (bm, bn, l) = (
        traits.block_m as usize,
        traits.block_n as usize,
        kv_end.len(),
    );
    let mut n = (0u64, 0u64, 0u64);
    for (t, c) in kv_end.chunks(bn).enumerate() {
        let lo = c.iter().copied().min().unwrap_or(0);
        let hi = c.iter().copied().max().unwrap_or(0);
        for q0 in (0..l).step_by(bm) {
            match tile_class(traits, l, q0, t * bn, lo, hi) {
                TileClass::Skip => n.0 += 1,
                TileClass::Full => n.1 += 1,
                TileClass::Partial => n.2 += 1,
            }
        }
    }
    n
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

/// The alignment, in bytes, the attention kernels need of every tensor they
/// read or write row by row: rows move in 16-byte vectors (`cp.async`
/// loads of q, k, v, d_o; the stores of o, dq, dk, dv).
pub const VECTOR_ALIGN: u64 = 16;

/// Which kernels a call runs: `Ok(false)` for the plain kernels, `Ok(true)`
/// for the variant kernels (`*_var_*`: a sliding window, explicit key
/// starts, a logit softcap or attention sinks), `Err(Unsupported)` naming
/// what no kernel computes — a value head dim unlike the query/key head
/// dim (multi-head latent attention): the kernels exist for square heads
/// of 64 and 128 only (kernels/README.md has the ptxas figures that keep
/// d 192 / 128 and d 256 out). Checked before anything runs, so an
/// unsupported call is an error, never another result; the CPU backend
/// computes it (and torch users have `backend="flex"`).
pub(crate) fn check_kernel_call<M: crate::backend::Memory, T: crate::backend::Element>(
    kernels: &str,
    args: &crate::backend::AttnArgs<'_, M, T>,
) -> Result<bool> {
    let (shape, params) = (args.shape(), args.params());
    if !shape.square() {
        return Err(Error::Unsupported(format!(
            "the {kernels} do not compute a value head dim ({}) unlike the query/key head dim ({}) \
             (multi-head latent attention): run it on the CPU backend, or with FlexAttention \
             (treeattn.torch.tree_attention(..., backend=\"flex\"))",
            shape.v_head_dim, shape.head_dim
        )));
    }
    Ok(params.window.is_some()
        || params.softcap.is_some()
        || args.sinks().is_some()
        || args.key_starts().is_some())
}

/// The per-query-row key starts the variant kernels read (kernels/mask.cuh):
/// query `q` sees key `k` iff `starts[q] <= k <= q < kv_end[k]`. A sliding
/// window's [`PackMask::window_starts`](crate::mask::PackMask::window_starts),
/// or the call's explicit starts, or (sinks alone) zeros — in every case
/// with each row that sees no key set to `q + 1` (`blind_queries_in`), the
/// mark by which the backward kernels tell such a row (its LSE is the sink
/// with sinks, not −inf) and load its Q and dO rows as zeros. `None` when
/// the call needs none (no window, no explicit starts, no sinks). One
/// `O(L)` walk or two on the host: the CUDA backend caches the result per
/// pack and window on the device (the starts of explicit key starts are
/// uploaded per call).
pub(crate) fn kernel_key_starts(
    mask: crate::mask::PackMask<'_>,
    window: Option<u32>,
    explicit: Option<&[u32]>,
    sinks: bool,
) -> Result<Option<Vec<u32>>> {
    let mut starts = match (window, explicit) {
        (Some(w), _) => mask.window_starts(w)?,
        (None, Some(s)) => s.to_vec(),
        (None, None) if sinks => vec![0; mask.len()],
        (None, None) => return Ok(None),
    };
    let blind = mask.blind_queries_in(Some(&starts));
    for (q, (s, b)) in starts.iter_mut().zip(blind).enumerate() {
        if b {
            *s = q as u32 + 1;
        }
    }
    Ok(Some(starts))
}

/// Rows per tile of the key starts' bounds (`start_tile_min` /
/// `start_tile_max`, C++ `kTaStartTile`): the key tile of the kv_end
/// bounds, so one bounds kernel serves both.
pub const START_TILE: u32 = 64;

/// The one alignment check of the attention kernels (forward and backward,
/// CUDA and emulator), run before any launch: `Err(Error::Shape)` naming
/// the first of `tensors` (name, address) that does not start on a
/// [`VECTOR_ALIGN`]-byte boundary — a misaligned view (a tensor sliced one
/// element in, a host buffer) would otherwise be a misaligned-address fault
/// that takes the whole CUDA context down. Device allocations are 256-byte
/// aligned, so only views can fail. With `tokens == 0` nothing is read and
/// nothing is checked (an empty buffer may sit anywhere).
pub(crate) fn check_vector_alignment(
    kernels: &str,
    tokens: usize,
    tensors: &[(&str, u64)],
) -> Result<()> {
    if tokens == 0 {
        return Ok(());
    }
    match tensors.iter().find(|(_, addr)| addr % VECTOR_ALIGN != 0) {
        Some((name, addr)) => Err(Error::Shape(format!(
            "{name}: address {addr:#x} is not {VECTOR_ALIGN}-byte aligned; the {kernels} move rows in \
             {VECTOR_ALIGN}-byte vectors (pass a tensor that starts on such a boundary, e.g. a fresh copy)"
        ))),
        None => Ok(()),
    }
}

/// The factor the kernels fold into exp2: `softmax_scale · log2(e)`, or,
/// with a softcap, `log2(e)` alone — the capped score `c · tanh(scale · s
/// / c)` is already scaled (scaling it again is the classic mistake a
/// negative control of tests/it/emu_variants.rs catches).
pub(crate) fn scale_log2(params: &AttnParams) -> f32 {
    match params.softcap {
        Some(_) => std::f64::consts::LOG2_E as f32,
        None => (params.softmax_scale * std::f64::consts::LOG2_E) as f32,
    }
}

/// The softcap arguments of the variant kernels: `(c, 2 · scale / c ·
/// log2 e)` (`ta_softcap_r` of kernels/common.cuh), `(0, 0)` without.
pub(crate) fn softcap_args(params: &AttnParams) -> (f32, f32) {
    match params.softcap {
        Some(c) => (
            c as f32,
            (2.0 * params.softmax_scale / c * std::f64::consts::LOG2_E) as f32,
        ),
        None => (0.0, 0.0),
    }
}

/// One forward call sequenced once for the emulator and CUDA (each only
/// provides the addresses and launches): the kernel (plain or `*_var_*`),
/// its launch plan and shared memory, and the call's scalar arguments.
#[derive(Clone, Copy, Debug)]
pub(crate) struct FwdProgram {
    pub traits: FwdTraits,
    /// The one launch (the variant kernel's shared memory with variants).
    pub plan: LaunchPlan,
    /// The call has attention variants: `tree_attn_fwd_var_*` runs, with
    /// the key starts.
    pub variants: bool,
    /// An empty pack: nothing to launch.
    pub empty: bool,
}

impl FwdProgram {
    /// The program of a forward call on the kernels (`kernels` names them
    /// in errors). Errors: a call they do not compute
    /// ([`check_kernel_call`]), a head dim with no kernel, a plan past the
    /// hardware's limits, rotary (rotated around the forward by
    /// `rope::forward_rotary`).
    pub(crate) fn new<M: crate::backend::Memory, T: crate::backend::Element>(
        kernels: &str,
        args: &crate::backend::AttnArgs<'_, M, T>,
    ) -> Result<FwdProgram> {
        let shape = args.shape();
        let (traits, mut plan) = plan_forward(&shape)?;
        let variants = check_kernel_call(kernels, args)?;
        if args.params().rope.is_some() {
            return Err(Error::Unsupported(
                "internal: rotary reached the rotary-free forward kernel".into(),
            ));
        }
        if variants {
            plan.shared_mem_bytes = traits.smem_bytes_var();
        }
        Ok(FwdProgram {
            traits,
            plan,
            variants,
            empty: shape.tokens == 0,
        })
    }

    /// The kernel's name for `dtype`.
    pub(crate) fn kernel_name(&self, dtype: Dtype) -> String {
        if self.variants {
            self.traits.kernel_name_var(dtype)
        } else {
            self.traits.kernel_name(dtype)
        }
    }

    /// The call's scalars in the kernel's argument struct; every address 0
    /// (the backend sets the ones it has).
    pub(crate) fn params(&self, shape: &AttnShape, params: &AttnParams) -> FwdParams {
        let (softcap_c, softcap_in) = softcap_args(params);
        FwdParams {
            q: 0,
            k: 0,
            v: 0,
            o: 0,
            lse: 0,
            kv_end: 0,
            tile_kv_min: 0,
            tile_kv_max: 0,
            tokens: shape.tokens as u32,
            q_heads: shape.q_heads as u32,
            kv_heads: shape.kv_heads as u32,
            num_key_tiles: shape.tokens.div_ceil(self.traits.block_n as usize) as u32,
            scale_log2: scale_log2(params),
            reserved: 0,
            key_start: 0,
            start_tile_min: 0,
            start_tile_max: 0,
            sinks: 0,
            softcap_c,
            softcap_in,
        }
    }
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
    /// The variants (the `*_var_*` kernel only; 0 otherwise).
    pub key_start: u64,
    pub start_tile_min: u64,
    pub start_tile_max: u64,
    pub sinks: u64,
    pub softcap_c: f32,
    pub softcap_in: f32,
}
assert_layout!(FwdParams, 128, {
    q: 0, k: 8, v: 16, o: 24, lse: 32, kv_end: 40, tile_kv_min: 48, tile_kv_max: 56,
    tokens: 64, q_heads: 68, kv_heads: 72, num_key_tiles: 76, scale_log2: 80, reserved: 84,
    key_start: 88, start_tile_min: 96, start_tile_max: 104, sinks: 112, softcap_c: 120,
    softcap_in: 124,
});

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
assert_layout!(KvBoundsParams, 40, {
    kv_end: 0, tile_kv_min: 8, tile_kv_max: 16, tokens: 24, tile: 28, num_tiles: 32, reserved: 36,
});

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_variant_list_comes_from_the_kernels() {
        // TA_ATTN_VARIANTS of kernels/common.cuh, as build.rs read it.
        assert_eq!(
            ATTN_VARIANTS,
            &[
                (Dtype::Bf16, 64),
                (Dtype::Bf16, 128),
                (Dtype::F16, 64),
                (Dtype::F16, 128)
            ]
        );
        assert_eq!(variant_index(Dtype::F16, 64), Some(2));
        assert_eq!(variant_index(Dtype::Bf16, 96), None);
        let e = FwdTraits::for_head_dim(96).unwrap_err().to_string();
        assert!(e.contains("have head dims 64 and 128, not 96"), "{e}");
    }

    #[test]
    fn plans_cover_every_token_and_head() {
        let shape = AttnShape {
            tokens: 130,
            q_heads: 6,
            kv_heads: 2,
            head_dim: 128,
            v_head_dim: 128,
        };
        let (t, plan) = plan_forward(&shape).unwrap();
        assert_eq!(plan.grid, (2, 6, 1));
        assert_eq!(plan.block, (128, 1, 1));
        assert_eq!(plan.shared_mem_bytes, 109_600);
        assert_eq!(FwdTraits::for_head_dim(64).unwrap().smem_bytes(), 60_448);
        assert_eq!(t.kernel_name(Dtype::F16), "tree_attn_fwd_f16_d128");
        assert_eq!(plan_kv_tile_bounds(t.key_tiles(130)).grid, (1, 1, 1));
        assert_eq!(plan_kv_tile_bounds(5).grid, (2, 1, 1));
    }

    /// The tile rule against brute force on random varlen packs with
    /// padding keys: a skipped tile has no visible pair, a full tile only
    /// visible pairs inside the pack.
    #[test]
    fn tile_classes_match_brute_force() {
        let mut seed = std::process::id() as u64 | 1;
        let mut next = move |n: usize| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed % n as u64) as usize
        };
        let t = FwdTraits::for_head_dim(64).unwrap();
        let (bm, bn) = (t.block_m as usize, t.block_n as usize);
        let mut seen = [0usize; 3];
        for _ in 0..30 {
            let mut kv_end: Vec<u32> = Vec::new();
            let target = 1 + next(400);
            while kv_end.len() < target {
                let (start, len) = (kv_end.len(), 1 + next(150));
                if next(4) == 0 {
                    kv_end.extend((start..start + len).map(|k| k as u32)); // padding keys
                } else {
                    kv_end.extend(std::iter::repeat_n((start + len) as u32, len));
                }
            }
            let l = kv_end.len();
            for k0 in (0..l).step_by(bn) {
                let keys = k0..(k0 + bn).min(l);
                let lo = kv_end[keys.clone()].iter().copied().min().unwrap();
                let hi = kv_end[keys.clone()].iter().copied().max().unwrap();
                for q0 in (0..l).step_by(bm) {
                    let rows = q0..(q0 + bm).min(l);
                    let visible = rows
                        .clone()
                        .flat_map(|q| keys.clone().map(move |k| (q, k)))
                        .filter(|&(q, k)| k <= q && q < kv_end[k] as usize)
                        .count();
                    let class = tile_class(&t, l, q0, k0, lo, hi);
                    let ctx =
                        format!("tile q0={q0} k0={k0} of L={l}: {class:?}, {visible} visible");
                    match class {
                        TileClass::Skip => assert_eq!(visible, 0, "{ctx}"),
                        TileClass::Full => assert_eq!(visible, bm.min(l - q0) * bn, "{ctx}"),
                        TileClass::Partial => {}
                    }
                    seen[class as usize] += 1;
                }
            }
            let (s, f, p) = count_tiles(&kv_end, &t);
            assert_eq!(s + f + p, (l.div_ceil(bm) * l.div_ceil(bn)) as u64);
        }
        assert!(
            seen.iter().all(|&n| n > 0),
            "every class exercised: {seen:?}"
        );
    }

    /// Argument checks are the contract's (`AttnArgs::new`); the plan
    /// rejects only what the kernel cannot do.
    #[test]
    fn rejects_what_the_kernel_cannot_do() {
        let shape = AttnShape {
            tokens: 4,
            q_heads: 1,
            kv_heads: 1,
            head_dim: 96,
            v_head_dim: 96,
        };
        assert!(matches!(plan_forward(&shape), Err(Error::Unsupported(_))));
        let many_heads = AttnShape {
            q_heads: 65_536,
            head_dim: 64,
            ..shape
        };
        let e = plan_forward(&many_heads).unwrap_err();
        assert!(e.to_string().contains("65535"), "{e}");
        assert!(plan_forward(&AttnShape {
            head_dim: 64,
            ..shape
        })
        .is_ok());
    }
}
