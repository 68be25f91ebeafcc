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
use crate::backend::launch::bwd::DqMode;
use crate::backend::launch::rope::{backward_rotary, forward_rotary, RotaryHost};
use crate::backend::launch::rope::{
    check_max_position, plan_rope_apply, plan_rope_table, rope_kernel_name, RopeApplyParams,
    RopeTableParams,
};
use crate::backend::launch::KernelElem;
use crate::backend::{AttnArgs, BackwardCall, ForwardCall, Rope};
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

/// The CUDA side of the rotary sequence of [`crate::backend::launch::rope`]
/// (which the emulator runs too): the backend and the backward's dQ mode.
struct CudaRotary<'a> {
    be: &'a CudaBackend,
    mode: DqMode,
}

impl<T: KernelElem + DeviceRepr> RotaryHost<T> for CudaRotary<'_> {
    type M = Device;
    type Tables = Arc<DeviceRopeTables>;
    type Rotated = CudaSlice<T>;

    fn tables(&self, rope: Rope, mask: &DevicePack) -> Result<Arc<DeviceRopeTables>> {
        self.be.rope.tables(self.be.stream(), mask, rope)
    }
    fn rotate(
        &self,
        tables: &Arc<DeviceRopeTables>,
        mask: &DevicePack,
        x: &CudaSlice<T>,
        heads: usize,
        head_dim: usize,
    ) -> Result<CudaSlice<T>> {
        let s = self.be.stream();
        // SAFETY: every element is written by the rotary kernel (rotated
        // pairs and pass-through lanes alike) before it is read.
        let mut y =
            unsafe { s.alloc::<T>(x.len()) }.map_err(cuda_err("allocating a rotated copy"))?;
        {
            let (xp, _gx) = x.device_ptr(s);
            let (yp, _gy) = y.device_ptr_mut(s);
            self.be
                .rope
                .launch::<T>(s, tables, mask, xp, yp, heads, head_dim, false)?;
        }
        Ok(y)
    }
    fn view(r: &CudaSlice<T>) -> &CudaSlice<T> {
        r
    }
    fn rotate_back(
        &self,
        tables: &Arc<DeviceRopeTables>,
        mask: &DevicePack,
        g: &mut CudaSlice<T>,
        heads: usize,
        head_dim: usize,
    ) -> Result<()> {
        self.be
            .rope
            .rotate_back(self.be.stream(), tables, mask, g, heads, head_dim)
    }
    fn zero(&self, x: &mut CudaSlice<T>) -> Result<()> {
        let zeros = vec![T::from_f32(0.0); x.len()];
        self.be
            .stream()
            .memcpy_htod(&zeros[..], x)
            .map_err(cuda_err("zeroing dsinks"))
    }
    fn check_qk(&self, args: &AttnArgs<'_, Device, T>) -> Result<()> {
        check_qk(self.be.stream(), args)
    }
    fn forward_plain(&self, call: ForwardCall<'_, '_, Device, T, f32>) -> Result<()> {
        self.be.run_forward_kernel(call)
    }
    fn backward_plain(&self, call: BackwardCall<'_, '_, '_, Device, T, f32>) -> Result<()> {
        self.be.bwd.run(
            call,
            self.mode,
            self.be.main_kernel,
            self.be.balanced_backward,
        )
    }
    fn check_grads(&self, _: &mut CudaSlice<T>, _: &mut CudaSlice<T>) -> Result<()> {
        Ok(())
    }
}

/// Forward with rotary ([`forward_rotary`]: Q and K rotated into scratch,
/// then the rotary-free forward on them). Asynchronous on the backend's
/// stream.
pub(super) fn forward<T: KernelElem + DeviceRepr>(
    be: &CudaBackend,
    rope: Rope,
    call: ForwardCall<'_, '_, Device, T, f32>,
) -> Result<()> {
    let host = CudaRotary {
        be,
        mode: be.dq_mode,
    };
    forward_rotary(&host, rope, call)
}

impl CudaBackend {
    /// The attention backward with dQ summed as `mode` says, rotary
    /// included: with `params.rope`, Q and K are rotated into scratch, the
    /// rotary-free backward runs on them, and dQ, dK are rotated back in
    /// place (gradients with respect to the unrotated q, k;
    /// [`backward_rotary`], the sequence the emulator runs too).
    /// Asynchronous on the backend's stream.
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
        let host = CudaRotary { be: self, mode };
        match call.args().params().rope {
            Some(rope) => backward_rotary(&host, rope, call),
            None => RotaryHost::<T>::backward_plain(&host, call),
        }
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
