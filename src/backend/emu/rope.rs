//! Rotary on the emulator (`kernels/rope.cu`), the way the CUDA backend does
//! it: the cos / sin tables built by `ta_rope_table`, Q and K rotated once
//! into scratch buffers by `ta_rope_*`, the rotary-free attention kernels run
//! on those, and (backward) dQ, dK rotated back in place by the same kernel
//! in inverse mode — so the rotary kernels are proven under the emulator too.

use super::{check_result, emu_result, ffi, Emu, KernelElem};
use crate::backend::launch::rope::{
    check_max_position, max_position, plan_rope_apply, plan_rope_table, RopeApplyParams,
    RopeTableParams, RopeTables,
};
use crate::backend::launch::{bwd::plan_backward, plan_forward};
use crate::backend::{AttnArgs, AttnParams, BackwardCall, ForwardCall, Grads, Host, Rope};
use crate::Result;

/// A buffer of `len` elements of `T` starting on a 16-byte boundary (the
/// attention kernels move rows in 16-byte vectors, as device allocations
/// allow).
struct Aligned<T> {
    words: Vec<u128>,
    len: usize,
    _t: std::marker::PhantomData<T>,
}

impl<T: KernelElem> Aligned<T> {
    fn zeroed(len: usize) -> Self {
        let bytes = len * std::mem::size_of::<T>();
        Aligned {
            words: vec![0u128; bytes.div_ceil(16)],
            len,
            _t: std::marker::PhantomData,
        }
    }
    fn as_slice(&self) -> &[T] {
        &bytemuck::cast_slice::<u128, T>(&self.words)[..self.len]
    }
    fn as_mut_slice(&mut self) -> &mut [T] {
        &mut bytemuck::cast_slice_mut::<u128, T>(&mut self.words)[..self.len]
    }
}

impl Emu {
    /// The rotary tables of `rope` over a pack's position ids as the
    /// `ta_rope_table` kernel builds them (what the CUDA backend caches per
    /// device pack): `[max position + 1, dims / 2]` cos and sin.
    pub fn rope_tables(&self, rope: Rope, position_ids: &[u32]) -> Result<RopeTables> {
        let (max, at) = max_position(position_ids);
        check_max_position(max, at)?;
        let half = (rope.dims / 2) as u32;
        let n = (max as usize + 1) * half as usize;
        let (mut cos, mut sin) = (vec![f32::NAN; n], vec![f32::NAN; n]);
        if n > 0 {
            let plan = plan_rope_table(max + 1, half)?;
            let p = RopeTableParams::new(
                rope,
                max + 1,
                cos.as_mut_ptr() as u64,
                sin.as_mut_ptr() as u64,
            );
            let mut err = [0u8; 1024];
            // SAFETY: the kernel writes `(max + 1) · half` entries of each
            // table, their length; the call is synchronous.
            let rc = unsafe {
                ffi::ta_emu_rope_table(
                    &p,
                    plan.grid.0,
                    plan.block.0,
                    &self.config(),
                    err.as_mut_ptr(),
                    err.len(),
                )
            };
            emu_result("ta_rope_table", rc, &err)?;
        }
        Ok(RopeTables { half, cos, sin })
    }

    /// `x` (`[tokens, heads, head_dim]`, `tokens = position_ids.len()`)
    /// rotated by the `ta_rope_*` kernel with `tables` (from
    /// [`Emu::rope_tables`] over the same position ids): forward, or with
    /// `inverse` the transpose rotation of gradients. Pass-through lanes are
    /// copied.
    pub fn rope_rotate<T: KernelElem>(
        &self,
        tables: &RopeTables,
        position_ids: &[u32],
        x: &[T],
        heads: usize,
        head_dim: usize,
        inverse: bool,
    ) -> Result<Vec<T>> {
        let mut y = vec![T::from_f32(f32::NAN); x.len()];
        self.rope_launch(
            tables,
            position_ids,
            x.as_ptr(),
            y.as_mut_ptr(),
            x.len(),
            heads,
            head_dim,
            inverse,
        )?;
        Ok(y)
    }

    /// As [`Emu::rope_rotate`], in place (the kernel's `x == y` mode, the
    /// way the backward rotates dQ and dK back).
    pub fn rope_rotate_in_place<T: KernelElem>(
        &self,
        tables: &RopeTables,
        position_ids: &[u32],
        x: &mut [T],
        heads: usize,
        head_dim: usize,
        inverse: bool,
    ) -> Result<()> {
        let p = x.as_mut_ptr();
        self.rope_launch(
            tables,
            position_ids,
            p,
            p,
            x.len(),
            heads,
            head_dim,
            inverse,
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn rope_launch<T: KernelElem>(
        &self,
        tables: &RopeTables,
        position_ids: &[u32],
        x: *const T,
        y: *mut T,
        len: usize,
        heads: usize,
        head_dim: usize,
        inverse: bool,
    ) -> Result<()> {
        let tokens = position_ids.len();
        let (max, _) = max_position(position_ids);
        let half = tables.half as usize;
        if heads == 0
            || len != tokens * heads * head_dim
            || tables.cos.len() != (max as usize + 1) * half
            || tables.sin.len() != tables.cos.len()
        {
            return Err(crate::Error::Shape(format!(
                "rotary: {len} elements for {tokens} tokens x {heads} heads x {head_dim}, tables of {} for \
                 {} positions x {half}",
                tables.cos.len(),
                max as usize + 1
            )));
        }
        if tokens == 0 {
            return Ok(());
        }
        let plan = plan_rope_apply(tokens, heads, head_dim)?;
        let p = RopeApplyParams {
            x: x as u64,
            y: y as u64,
            pos: position_ids.as_ptr() as u64,
            cos: tables.cos.as_ptr() as u64,
            sin: tables.sin.as_ptr() as u64,
            tokens: tokens as u32,
            heads: heads as u32,
            half: tables.half,
            inverse: u32::from(inverse),
        };
        let mut err = [0u8; 1024];
        // SAFETY: x and y hold `tokens · heads · head_dim` elements (checked
        // above; the callers pass slices of that length, possibly the same
        // one), the tables cover every position id; synchronous.
        let rc = unsafe {
            ffi::ta_emu_rope_apply(
                T::DTYPE.code(),
                head_dim as u32,
                &p,
                plan.grid.0,
                plan.block.0,
                &self.config(),
                err.as_mut_ptr(),
                err.len(),
            )
        };
        emu_result(
            &crate::backend::launch::rope::rope_kernel_name(T::DTYPE, head_dim as u32),
            rc,
            &err,
        )
    }
}

/// The threads per block of the rotary kernels as the C++ source has them
/// (`TA_ROPE_THREADS`), to hold
/// [`crate::backend::launch::rope::ROPE_THREADS`] to it.
pub fn rope_kernel_threads() -> u32 {
    // SAFETY: returns a constant.
    unsafe { ffi::ta_emu_rope_threads() as u32 }
}

/// Scratch copies of q and k rotated by `rope`, and the tables.
fn rotate_qk<T: KernelElem>(
    emu: &Emu,
    rope: Rope,
    args: &AttnArgs<'_, Host, T>,
) -> Result<(RopeTables, Aligned<T>, Aligned<T>)> {
    let (shape, pos) = (args.shape(), args.mask().position_ids());
    let tables = emu.rope_tables(rope, pos)?;
    let mut q = Aligned::<T>::zeroed(shape.q_len());
    let mut k = Aligned::<T>::zeroed(shape.kv_len());
    let (qs, ks) = (q.as_mut_slice(), k.as_mut_slice());
    let d = shape.head_dim;
    emu.rope_launch(
        &tables,
        pos,
        args.q().as_ptr(),
        qs.as_mut_ptr(),
        qs.len(),
        shape.q_heads,
        d,
        false,
    )?;
    emu.rope_launch(
        &tables,
        pos,
        args.k().as_ptr(),
        ks.as_mut_ptr(),
        ks.len(),
        shape.kv_heads,
        d,
        false,
    )?;
    Ok((tables, q, k))
}

/// The parameters of the rotary-free call on rotated inputs: no rotary, and
/// no second finiteness scan (the caller's inputs were scanned when its
/// arguments were built; a rotation that overflows shows in the results'
/// check).
fn plain_params(params: &AttnParams) -> AttnParams {
    AttnParams {
        rope: None,
        check_finite: false,
        ..*params
    }
}

/// `plain` (the rotated Q, K of `args`) with the sinks and explicit key
/// starts of `args` (a window travels in the params).
fn with_variants_of<'b, T: KernelElem>(
    mut plain: AttnArgs<'b, Host, T>,
    args: &AttnArgs<'b, Host, T>,
) -> Result<AttnArgs<'b, Host, T>> {
    if let Some(s) = args.sinks() {
        plain = plain.with_sinks(s)?;
    }
    if let Some(st) = args.key_starts() {
        plain = plain.with_key_starts(st)?;
    }
    Ok(plain)
}

/// Forward with rotary: Q and K rotated by the kernel into scratch, then the
/// rotary-free forward on them.
pub(super) fn forward<T: KernelElem>(
    emu: &Emu,
    rope: Rope,
    call: ForwardCall<'_, '_, Host, T, f32>,
) -> Result<()> {
    let (args, o, lse) = call.into_parts();
    let shape = args.shape();
    plan_forward(&shape)?;
    if shape.tokens == 0 {
        return Ok(());
    }
    let (_tables, q, k) = rotate_qk(emu, rope, &args)?;
    let plain = AttnArgs::<Host, T>::new(
        q.as_slice(),
        k.as_slice(),
        args.v(),
        shape,
        args.mask(),
        plain_params(args.params()),
    )?;
    let plain = with_variants_of(plain, &args.reborrow())?;
    super::forward(emu, ForwardCall::new(plain, o, lse)?)
}

/// Backward with rotary: Q and K rotated into scratch, the rotary-free
/// backward on them (dQ, dK with respect to the rotated inputs), then dQ and
/// dK rotated back in place (the transpose rotation): gradients with respect
/// to the unrotated q and k, as the contract says.
pub(super) fn backward<T: KernelElem>(
    emu: &Emu,
    rope: Rope,
    call: BackwardCall<'_, '_, '_, Host, T, f32>,
) -> Result<()> {
    let (args, saved, d_o, grads) = call.into_parts();
    let Grads { dq, dk, dv, dsinks } = grads;
    let shape = args.shape();
    plan_backward(&shape)?;
    if shape.tokens == 0 {
        if let Some(ds) = dsinks {
            ds.fill(T::from_f32(0.0));
        }
        return Ok(());
    }
    let (tables, q, k) = rotate_qk(emu, rope, &args)?;
    let plain = AttnArgs::<Host, T>::new(
        q.as_slice(),
        k.as_slice(),
        args.v(),
        shape,
        args.mask(),
        plain_params(args.params()),
    )?;
    let plain = with_variants_of(plain, &args.reborrow())?;
    let call = BackwardCall::new(
        plain,
        saved,
        d_o,
        Grads {
            dq: &mut *dq,
            dk: &mut *dk,
            dv,
            dsinks,
        },
    )?;
    super::bwd::backward(emu, call)?;
    let (pos, d) = (args.mask().position_ids(), shape.head_dim);
    emu.rope_rotate_in_place(&tables, pos, dq, shape.q_heads, d, true)?;
    emu.rope_rotate_in_place(&tables, pos, dk, shape.kv_heads, d, true)?;
    check_result("dq", dq, false)?;
    check_result("dk", dk, false)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::launch::rope::ROPE_THREADS;

    #[test]
    fn threads_match_the_kernel() {
        assert_eq!(rope_kernel_threads(), ROPE_THREADS);
    }
}
