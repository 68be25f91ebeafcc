//! Rotary on the emulator (`kernels/rope.cu`), the way the CUDA backend does
//! it: the cos / sin tables built by `ta_rope_table`, Q and K rotated once
//! into scratch buffers by `ta_rope_*`, the rotary-free attention kernels run
//! on those, and (backward) dQ, dK rotated back in place by the same kernel
//! in inverse mode — so the rotary kernels are proven under the emulator too.

use super::{check_result, emu_result, ffi, Emu, KernelElem};
use crate::backend::launch::rope::{
    check_max_position, max_position, plan_rope_apply, plan_rope_table, RopeApplyParams,
    RopeTableParams, RopeTables, RotaryHost,
};
use crate::backend::{AttnArgs, BackwardCall, ForwardCall, Host, Rope};
use crate::mask::PackMask;
use crate::Result;

/// A buffer of `len` elements of `T` starting on a 16-byte boundary (the
/// attention kernels move rows in 16-byte vectors, as device allocations
/// allow).
pub(crate) struct Aligned<T> {
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

/// The emulator's side of the rotary sequence of
/// [`crate::backend::launch::rope`] (which the CUDA backend runs too):
/// tables and rotations by the emulated kernels, scratch in 16-byte aligned
/// host buffers.
impl<T: KernelElem> RotaryHost<T> for Emu {
    type M = Host;
    type Tables = RopeTables;
    type Rotated = Aligned<T>;

    fn tables(&self, rope: Rope, mask: PackMask<'_>) -> Result<RopeTables> {
        self.rope_tables(rope, mask.position_ids())
    }
    fn rotate(
        &self,
        tables: &RopeTables,
        mask: PackMask<'_>,
        x: &[T],
        heads: usize,
        head_dim: usize,
    ) -> Result<Aligned<T>> {
        // Zeroed, not poisoned: the kernel writes every element (rotated
        // pairs and pass-through lanes), which the results' checks and the
        // rotary tests prove.
        let mut y = Aligned::<T>::zeroed(x.len());
        let ys = y.as_mut_slice();
        self.rope_launch(
            tables,
            mask.position_ids(),
            x.as_ptr(),
            ys.as_mut_ptr(),
            ys.len(),
            heads,
            head_dim,
            false,
        )?;
        Ok(y)
    }
    fn view(r: &Aligned<T>) -> &[T] {
        r.as_slice()
    }
    fn rotate_back(
        &self,
        tables: &RopeTables,
        mask: PackMask<'_>,
        g: &mut [T],
        heads: usize,
        head_dim: usize,
    ) -> Result<()> {
        self.rope_rotate_in_place(tables, mask.position_ids(), g, heads, head_dim, true)
    }
    fn zero(&self, x: &mut [T]) -> Result<()> {
        x.fill(T::from_f32(0.0));
        Ok(())
    }
    fn check_qk(&self, _: &AttnArgs<'_, Host, T>) -> Result<()> {
        Ok(())
    }
    fn forward_plain(&self, call: ForwardCall<'_, '_, Host, T, f32>) -> Result<()> {
        super::forward(self, call)
    }
    fn backward_plain(&self, call: BackwardCall<'_, '_, '_, Host, T, f32>) -> Result<()> {
        super::bwd::backward(self, call)
    }
    fn check_grads(&self, dq: &mut [T], dk: &mut [T]) -> Result<()> {
        check_result("dq", dq, false)?;
        check_result("dk", dk, false)
    }
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
