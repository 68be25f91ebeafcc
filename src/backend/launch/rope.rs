//! Rotary embedding on the GPU (and the emulator): the launch plans and
//! argument mirrors of the elementwise kernels of `kernels/rope.cu`, which
//! rotate Q and K once per call before the (rotary-free) attention kernels
//! and rotate dQ, dK back after the backward, and of the kernel that builds
//! the per-position cos / sin tables they read ([`RopeTables`] is the host
//! reference of those tables).

use super::{KernelElem, LaunchPlan};
use crate::backend::{AttnArgs, AttnParams, BackwardCall, ForwardCall, Grads, Memory, Rope};
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

/// What a backend running the rotary kernels provides, so that rotary
/// around its rotary-free attention kernels is sequenced once
/// ([`forward_rotary`], [`backward_rotary`]); the emulator and CUDA
/// implement it, and neither orders the steps itself.
pub(crate) trait RotaryHost<T: KernelElem> {
    /// Where the call's tensors live.
    type M: Memory;
    /// A pack's cos / sin tables for one rotary setting.
    type Tables;
    /// A rotated scratch copy of q or k.
    type Rotated;
    /// The tables of `rope` over the mask's position ids (built, or from a
    /// cache).
    fn tables(&self, rope: Rope, mask: <Self::M as Memory>::Mask<'_>) -> Result<Self::Tables>;
    /// `x` (`[tokens, heads, head_dim]`) rotated into scratch.
    fn rotate(
        &self,
        tables: &Self::Tables,
        mask: <Self::M as Memory>::Mask<'_>,
        x: <Self::M as Memory>::Ref<'_, T>,
        heads: usize,
        head_dim: usize,
    ) -> Result<Self::Rotated>;
    /// A rotated copy as an input of the rotary-free call.
    fn view(r: &Self::Rotated) -> <Self::M as Memory>::Ref<'_, T>;
    /// A gradient (dQ or dK) rotated back in place (the transpose
    /// rotation).
    fn rotate_back(
        &self,
        tables: &Self::Tables,
        mask: <Self::M as Memory>::Mask<'_>,
        g: <Self::M as Memory>::Mut<'_, T>,
        heads: usize,
        head_dim: usize,
    ) -> Result<()>;
    /// Every element of `x` set to 0.
    fn zero(&self, x: <Self::M as Memory>::Mut<'_, T>) -> Result<()>;
    /// With `params.check_finite`, the caller's q and k scanned before they
    /// are rotated, so that an error names the input element. (Host
    /// memory was scanned when the arguments were built: nothing to do.)
    fn check_qk(&self, args: &AttnArgs<'_, Self::M, T>) -> Result<()>;
    /// The rotary-free forward.
    fn forward_plain(&self, call: ForwardCall<'_, '_, Self::M, T, f32>) -> Result<()>;
    /// The rotary-free backward.
    fn backward_plain(&self, call: BackwardCall<'_, '_, '_, Self::M, T, f32>) -> Result<()>;
    /// dQ, dK once rotated back: the emulator checks them (a non-finite
    /// gradient is an `Err`); the asynchronous CUDA backend does not.
    fn check_grads(
        &self,
        dq: <Self::M as Memory>::Mut<'_, T>,
        dk: <Self::M as Memory>::Mut<'_, T>,
    ) -> Result<()>;
}

/// The rotary-free call's parameters: the caller's, without rotary. A
/// `check_finite` call scans the rotated copies again (a rotation that
/// overflows the element type is an error naming q or k).
fn without_rope(params: &AttnParams) -> AttnParams {
    AttnParams {
        rope: None,
        ..*params
    }
}

/// `plain` (the rotated Q, K of `args`) with the sinks and explicit key
/// starts of `args` (a window and a softcap travel in the params).
fn with_variants_of<'b, M: Memory, T: KernelElem>(
    mut plain: AttnArgs<'b, M, T>,
    args: &AttnArgs<'b, M, T>,
) -> Result<AttnArgs<'b, M, T>> {
    if let Some(s) = args.sinks() {
        plain = plain.with_sinks(s)?;
    }
    if let Some(st) = args.key_starts() {
        plain = plain.with_key_starts(st)?;
    }
    Ok(plain)
}

/// The tables of `rope` over the call's pack and the call's q and k rotated
/// into scratch by them.
fn rotate_qk<R: RotaryHost<T>, T: KernelElem>(
    host: &R,
    rope: Rope,
    args: &AttnArgs<'_, R::M, T>,
) -> Result<(R::Tables, R::Rotated, R::Rotated)> {
    let (shape, mask) = (args.shape(), args.mask());
    let tables = host.tables(rope, mask)?;
    let d = shape.head_dim;
    let q = host.rotate(&tables, mask, args.q(), shape.q_heads, d)?;
    let k = host.rotate(&tables, mask, args.k(), shape.kv_heads, d)?;
    Ok((tables, q, k))
}

/// The rotary-free call's arguments: the rotated `q`, `k`, the rest of
/// `args` (v, the pack, the variants) and its parameters without rotary.
fn plain_args<'b, R: RotaryHost<T>, T: KernelElem>(
    args: &AttnArgs<'b, R::M, T>,
    q: &'b R::Rotated,
    k: &'b R::Rotated,
) -> Result<AttnArgs<'b, R::M, T>> {
    let plain = AttnArgs::new(
        R::view(q),
        R::view(k),
        args.v(),
        args.shape(),
        args.mask(),
        without_rope(args.params()),
    )?;
    with_variants_of(plain, args)
}

/// Forward with rotary, on any [`RotaryHost`]: q and k scanned (with
/// `check_finite`), rotated into scratch by the rotary kernel, then the
/// rotary-free forward on them.
pub(crate) fn forward_rotary<R: RotaryHost<T>, T: KernelElem>(
    host: &R,
    rope: Rope,
    call: ForwardCall<'_, '_, R::M, T, f32>,
) -> Result<()> {
    let (args, o, lse) = call.into_parts();
    let shape = args.shape();
    super::plan_forward(&shape)?;
    host.check_qk(&args)?;
    if shape.tokens == 0 {
        return Ok(());
    }
    let (_tables, q, k) = rotate_qk(host, rope, &args)?;
    let call = ForwardCall::new(plain_args::<R, T>(&args.reborrow(), &q, &k)?, o, lse)?;
    host.forward_plain(call)
}

/// Backward with rotary, on any [`RotaryHost`]: q and k scanned (with
/// `check_finite`), rotated into scratch, the rotary-free backward on them
/// (dQ, dK with respect to the rotated inputs), then dQ and dK rotated back
/// in place (the transpose rotation): gradients with respect to the
/// unrotated q and k, as the contract says. An empty pack only zeroes a
/// requested dsinks (no row: the sum over rows is 0).
pub(crate) fn backward_rotary<R: RotaryHost<T>, T: KernelElem>(
    host: &R,
    rope: Rope,
    call: BackwardCall<'_, '_, '_, R::M, T, f32>,
) -> Result<()> {
    let (args, saved, d_o, grads) = call.into_parts();
    let Grads {
        mut dq,
        mut dk,
        mut dv,
        mut dsinks,
    } = grads;
    let shape = args.shape();
    super::bwd::plan_backward(&shape)?;
    host.check_qk(&args)?;
    if shape.tokens == 0 {
        return match dsinks {
            Some(ds) => host.zero(ds),
            None => Ok(()),
        };
    }
    let (mask, d) = (args.mask(), shape.head_dim);
    let (tables, q, k) = rotate_qk(host, rope, &args)?;
    {
        let plain = plain_args::<R, T>(&args.reborrow(), &q, &k)?;
        // Every tensor reborrowed for this inner call (the memory's
        // types are invariant in their lifetime): dQ and dK are written
        // again after it.
        let grads = Grads {
            dq: R::M::reborrow_mut(&mut dq),
            dk: R::M::reborrow_mut(&mut dk),
            dv: R::M::reborrow_mut(&mut dv),
            dsinks: dsinks.as_mut().map(|x| R::M::reborrow_mut(x)),
        };
        let d_o = <R::M as Memory>::shorten(d_o);
        let call = BackwardCall::new(plain, saved.reborrow(), d_o, grads)?;
        host.backward_plain(call)?;
    }
    host.rotate_back(&tables, mask, R::M::reborrow_mut(&mut dq), shape.q_heads, d)?;
    host.rotate_back(
        &tables,
        mask,
        R::M::reborrow_mut(&mut dk),
        shape.kv_heads,
        d,
    )?;
    host.check_grads(dq, dk)
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
