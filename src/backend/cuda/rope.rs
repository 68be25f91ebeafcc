//! Rotary on the device (`kernels/rope.cu`): Q and K are rotated once per
//! call into scratch buffers by an elementwise kernel and the rotary-free
//! attention kernels run on those; the backward rotates the dQ and dK they
//! write back in place (the transpose rotation), so the gradients are with
//! respect to the unrotated inputs, as the contract says.
//!
//! The cos / sin tables (`[max position + 1, dims / 2]` f32, computed in f64
//! on the device by `ta_rope_table`) are built on a pack's first rotary call
//! and cached on its [`DevicePack`], keyed by what they depend on: the rotary
//! base and dims (the pack's position ids are fixed at upload). Nothing is
//! downloaded and nothing synchronises: every call only enqueues kernels on
//! the backend's stream.

use std::sync::{Arc, Mutex, PoisonError};

use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, DevicePtrMut,
    DeviceRepr, PushKernelArg,
};
use cudarc::nvrtc::Ptx;

use super::{config, cuda_err, CudaBackend, Device, DevicePack};
use crate::backend::launch::bwd::{plan_backward_with_kernel, DqMode};
use crate::backend::launch::rope::{
    check_max_position, plan_rope_apply, plan_rope_table, rope_kernel_name, RopeApplyParams,
    RopeTableParams,
};
use crate::backend::launch::{plan_forward, KernelElem};
use crate::backend::{AttnArgs, AttnParams, BackwardCall, ForwardCall, Grads, Rope};
use crate::{Error, Result};

/// The fatbin built from `kernels/rope.cu` by build.rs.
static ROPE_FATBIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/rope.fatbin"));

// SAFETY: plain #[repr(C)] structs of integers, floats and device addresses,
// laid out exactly like `TaRopeTableParams` / `TaRopeApplyParams`.
unsafe impl DeviceRepr for RopeTableParams {}
unsafe impl DeviceRepr for RopeApplyParams {}

/// The rotary kernels, loaded by [`CudaBackend::new`].
#[derive(Clone)]
pub(crate) struct CudaRope {
    _module: Arc<CudaModule>,
    table: CudaFunction,
    /// `ta_rope_{dtype}_d{head_dim}` in the order of
    /// [`ATTN_VARIANTS`](crate::backend::launch::ATTN_VARIANTS).
    apply: Vec<CudaFunction>,
}

/// The cos / sin tables of one (base, dims) on the device.
pub(crate) struct DeviceRopeTables {
    half: u32,
    cos: CudaSlice<f32>,
    sin: CudaSlice<f32>,
}

/// The rotary tables of a [`DevicePack`], built on its first rotary call per
/// (base, dims) and kept as long as the pack: a short list behind a mutex
/// (a pack sees one or two rotary settings), each entry shared out as an
/// `Arc` so that the lock is held only while looking up or building.
#[derive(Default)]
pub(crate) struct RopeTableCache(Mutex<Vec<(RopeKey, Arc<DeviceRopeTables>)>>);

/// What a pack's tables depend on besides its position ids: the base's bits
/// and the rotated dims (not the head dim: lanes past `dims` pass through).
type RopeKey = (u64, usize);

impl CudaRope {
    /// Loads the embedded rotary kernels on `ctx`.
    pub(crate) fn new(ctx: &Arc<CudaContext>) -> Result<Self> {
        let module = ctx
            .load_module(Ptx::from_binary(ROPE_FATBIN.to_vec()))
            .map_err(cuda_err("loading the embedded rotary kernels"))?;
        let load = |name: &str| {
            module
                .load_function(name)
                .map_err(|e| Error::Cuda(format!("{name}: {e}")))
        };
        let apply = crate::backend::launch::ATTN_VARIANTS
            .iter()
            .map(|&(dtype, d)| load(&rope_kernel_name(dtype, d)))
            .collect::<Result<Vec<_>>>()?;
        Ok(CudaRope {
            table: load("ta_rope_table")?,
            apply,
            _module: module,
        })
    }

    /// The pack's tables for `rope`: from its cache, or built now on
    /// `stream` (enqueued; no synchronisation) and cached.
    fn tables(
        &self,
        stream: &Arc<CudaStream>,
        pack: &DevicePack,
        rope: Rope,
    ) -> Result<Arc<DeviceRopeTables>> {
        let key = (rope.base.to_bits(), rope.dims);
        let mut cache = pack
            .rope_tables
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some((_, t)) = cache.iter().find(|(k, _)| *k == key) {
            return Ok(t.clone());
        }
        check_max_position(pack.max_position.0, pack.max_position.1)?;
        let positions = pack.max_position.0 + 1;
        let half = (rope.dims / 2) as u32;
        let n = positions as usize * half as usize;
        // SAFETY (both): every entry is written by ta_rope_table below
        // before any rotary kernel reads it (same stream, or ordered by
        // cudarc's events on another).
        let mut cos = unsafe { stream.alloc::<f32>(n.max(1)) }
            .map_err(cuda_err("allocating rotary tables"))?;
        let mut sin = unsafe { stream.alloc::<f32>(n.max(1)) }
            .map_err(cuda_err("allocating rotary tables"))?;
        if n > 0 {
            let plan = plan_rope_table(positions, half)?;
            let (c, _g0) = cos.device_ptr_mut(stream);
            let (s, _g1) = sin.device_ptr_mut(stream);
            let p = RopeTableParams::new(rope, positions, c, s);
            let mut b = stream.launch_builder(&self.table);
            b.arg(&p);
            // SAFETY: the kernel writes `positions · half` entries of each
            // table, their length.
            unsafe { b.launch(config(plan)) }.map_err(cuda_err("launching ta_rope_table"))?;
        }
        let t = Arc::new(DeviceRopeTables { half, cos, sin });
        cache.push((key, t.clone()));
        Ok(t)
    }

    /// Enqueues `ta_rope_*`: `y = rot(x)` (or its transpose with `inverse`)
    /// over `[tokens, heads, head_dim]` tensors at device addresses `x`, `y`
    /// (equal: in place).
    #[allow(clippy::too_many_arguments)]
    fn launch<T: KernelElem>(
        &self,
        stream: &Arc<CudaStream>,
        tables: &DeviceRopeTables,
        pack: &DevicePack,
        x: u64,
        y: u64,
        heads: usize,
        head_dim: usize,
        inverse: bool,
    ) -> Result<()> {
        let plan = plan_rope_apply(pack.tokens, heads, head_dim)?;
        let (pos, _g0) = pack.position_ids.device_ptr(stream);
        let (cos, _g1) = tables.cos.device_ptr(stream);
        let (sin, _g2) = tables.sin.device_ptr(stream);
        let p = RopeApplyParams {
            x,
            y,
            pos,
            cos,
            sin,
            tokens: pack.tokens as u32,
            heads: heads as u32,
            half: tables.half,
            inverse: u32::from(inverse),
        };
        let f = &self.apply[crate::backend::launch::variant(T::DTYPE, head_dim as u32)?];
        let mut b = stream.launch_builder(f);
        b.arg(&p);
        // SAFETY: x and y hold `tokens · heads · head_dim` elements (the
        // callers' buffers were checked against the shape), every position id
        // of the pack has its row in the tables (built for its largest).
        unsafe { b.launch(config(plan)) }.map_err(|e| {
            Error::Cuda(format!(
                "launching {}: {e}",
                rope_kernel_name(T::DTYPE, head_dim as u32)
            ))
        })?;
        Ok(())
    }

    /// Scratch copies of the call's q and k, rotated, and the tables.
    #[allow(clippy::type_complexity)]
    fn rotate_qk<T: KernelElem + DeviceRepr>(
        &self,
        stream: &Arc<CudaStream>,
        rope: Rope,
        args: &AttnArgs<'_, Device, T>,
    ) -> Result<(Arc<DeviceRopeTables>, CudaSlice<T>, CudaSlice<T>)> {
        let (shape, pack) = (args.shape(), args.mask());
        let tables = self.tables(stream, pack, rope)?;
        // SAFETY (both): every element is written by the rotary kernel
        // (rotated pairs and pass-through lanes alike) before it is read.
        let mut q = unsafe { stream.alloc::<T>(shape.q_len()) }
            .map_err(cuda_err("allocating rotated q"))?;
        let mut k = unsafe { stream.alloc::<T>(shape.kv_len()) }
            .map_err(cuda_err("allocating rotated k"))?;
        let d = shape.head_dim;
        for (src, dst, heads) in [
            (args.q(), &mut q, shape.q_heads),
            (args.k(), &mut k, shape.kv_heads),
        ] {
            let (x, _gx) = src.device_ptr(stream);
            let (y, _gy) = dst.device_ptr_mut(stream);
            self.launch::<T>(stream, &tables, pack, x, y, heads, d, false)?;
        }
        Ok((tables, q, k))
    }

    /// Rotates a gradient (`dq` or `dk`) back in place.
    fn rotate_back<T: KernelElem + DeviceRepr>(
        &self,
        stream: &Arc<CudaStream>,
        tables: &DeviceRopeTables,
        pack: &DevicePack,
        g: &mut CudaSlice<T>,
        heads: usize,
        head_dim: usize,
    ) -> Result<()> {
        let (x, _g) = g.device_ptr_mut(stream);
        self.launch::<T>(stream, tables, pack, x, x, heads, head_dim, true)
    }
}

/// With `params.check_finite`: the caller's q and k scanned before they are
/// rotated (so that an error names the input element; the rotary-free call
/// then scans the rotated copies and the other tensors).
fn check_qk<T: KernelElem + DeviceRepr>(
    stream: &Arc<CudaStream>,
    args: &AttnArgs<'_, Device, T>,
) -> Result<()> {
    if !args.params().check_finite {
        return Ok(());
    }
    for (name, x) in [("q", args.q()), ("k", args.k())] {
        let h = stream
            .clone_dtoh(x)
            .map_err(cuda_err("downloading for the finiteness check"))?;
        if let Some(index) = h.iter().position(|e| !e.to_f32().is_finite()) {
            return Err(Error::NonFinite {
                what: name.into(),
                index,
            });
        }
    }
    Ok(())
}

fn without_rope(params: &AttnParams) -> AttnParams {
    AttnParams {
        rope: None,
        ..*params
    }
}

/// `plain` (the rotated Q, K of `args`) with the sinks and explicit key
/// starts of `args` (a window and a softcap travel in the params).
fn with_variants_of<'a: 'b, 'b, T: KernelElem + DeviceRepr>(
    mut plain: AttnArgs<'b, Device, T>,
    args: &AttnArgs<'a, Device, T>,
) -> Result<AttnArgs<'b, Device, T>> {
    if let Some(x) = args.sinks() {
        plain = plain.with_sinks(x)?;
    }
    if let Some(st) = args.key_starts() {
        plain = plain.with_key_starts(st)?;
    }
    Ok(plain)
}

/// Forward with rotary: Q and K rotated into scratch, then the rotary-free
/// forward on them. Asynchronous on the backend's stream.
pub(super) fn forward<T: KernelElem + DeviceRepr>(
    be: &CudaBackend,
    rope: Rope,
    call: ForwardCall<'_, '_, Device, T, f32>,
) -> Result<()> {
    let (args, o, lse) = call.into_parts();
    let shape = args.shape();
    plan_forward(&shape)?;
    let s = be.stream();
    check_qk(s, &args)?;
    if shape.tokens == 0 {
        return Ok(());
    }
    let (_tables, q, k) = be.rope.rotate_qk(s, rope, &args)?;
    let plain = AttnArgs::<Device, T>::new(
        &q,
        &k,
        args.v(),
        shape,
        args.mask(),
        without_rope(args.params()),
    )?;
    let plain = with_variants_of(plain, &args)?;
    be.run_forward_kernel(ForwardCall::new(plain, o, lse)?)
}

impl CudaBackend {
    /// The attention backward with dQ summed as `mode` says, rotary
    /// included: with `params.rope`, Q and K are rotated into scratch, the
    /// rotary-free backward runs on them, and dQ, dK are rotated back in
    /// place (gradients with respect to the unrotated q, k). Asynchronous on
    /// the backend's stream.
    pub fn backward_with_mode<T: KernelElem + DeviceRepr>(
        &self,
        call: BackwardCall<'_, '_, '_, Device, T, f32>,
        mode: DqMode,
    ) -> Result<()> {
        let (args, saved, d_o, grads) = call.into_parts();
        let s = self.stream();
        crate::backend::launch::check_kernel_call("CUDA kernels", &args)?;
        // Before any launch (rotary included), as the forward does.
        crate::backend::launch::check_vector_alignment(
            "backward kernels",
            args.shape().tokens,
            &[
                ("q", args.q().device_ptr(s).0),
                ("k", args.k().device_ptr(s).0),
                ("v", args.v().device_ptr(s).0),
                ("d_o", d_o.device_ptr(s).0),
                ("dq", grads.dq.device_ptr(s).0),
                ("dk", grads.dk.device_ptr(s).0),
                ("dv", grads.dv.device_ptr(s).0),
            ],
        )?;
        let call = BackwardCall::new(args, saved, d_o, grads)?;
        let Some(rope) = call.args().params().rope else {
            return self
                .bwd
                .run(call, mode, self.main_kernel, self.balanced_backward);
        };
        let (args, saved, d_o, grads) = call.into_parts();
        let Grads { dq, dk, dv, dsinks } = grads;
        let shape = args.shape();
        plan_backward_with_kernel(&shape, self.main_kernel)?;
        let s = self.stream();
        check_qk(s, &args)?;
        if shape.tokens == 0 {
            if let Some(ds) = dsinks {
                // No row: the sum over rows is 0.
                let zeros = vec![T::from_f32(0.0); ds.len()];
                s.memcpy_htod(&zeros[..], ds)
                    .map_err(cuda_err("zeroing dsinks"))?;
            }
            return Ok(());
        }
        let (tables, q, k) = self.rope.rotate_qk(s, rope, &args)?;
        let plain = AttnArgs::<Device, T>::new(
            &q,
            &k,
            args.v(),
            shape,
            args.mask(),
            without_rope(args.params()),
        )?;
        let plain = with_variants_of(plain, &args)?;
        let grads = Grads {
            dq: &mut *dq,
            dk: &mut *dk,
            dv,
            dsinks,
        };
        self.bwd.run(
            BackwardCall::new(plain, saved, d_o, grads)?,
            mode,
            self.main_kernel,
            self.balanced_backward,
        )?;
        let (pack, d) = (args.mask(), shape.head_dim);
        self.rope
            .rotate_back(s, &tables, pack, dq, shape.q_heads, d)?;
        self.rope
            .rotate_back(s, &tables, pack, dk, shape.kv_heads, d)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cuda::PTXAS_REPORT;

    #[test]
    fn the_rotary_fatbin_is_embedded() {
        // A fatbin starts with its magic 0xBA55ED50 (little endian).
        assert_eq!(&ROPE_FATBIN[..4], &[0x50, 0xed, 0x55, 0xba]);
        for &(dtype, d) in crate::backend::launch::ATTN_VARIANTS {
            let name = rope_kernel_name(dtype, d);
            assert!(PTXAS_REPORT.contains(&name), "{name} missing");
        }
        assert!(PTXAS_REPORT.contains("ta_rope_table"));
    }
}
