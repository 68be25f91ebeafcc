//! Where `gpu-check` runs: a CUDA device (`CudaTarget`, feature `cuda`) or
//! the SIMT emulator (`EmuTarget`, feature `emu`), behind one small
//! interface, so that both run the very same check flow (mod.rs, bwd.rs).
//!
//! Every kernel call goes through the crate's contract
//! ([`treeattn::backend::AttentionBackend`] / [`treeattn::backend::SdccBackend`]
//! on validated [`AttnArgs`] / [`SdccArgs`]); what differs is where the
//! buffers live (device memory or host vectors), how a pack is made
//! resident, and how a call is timed (CUDA events, or the wall clock, whose
//! numbers mean nothing for a GPU).

#![allow(clippy::too_many_arguments)]

use crate::gen::MaskBuilder;
use treeattn::backend::launch::bwd::{DqMode, MainKernel};
use treeattn::backend::launch::sdcc::SdccElem;
use treeattn::backend::launch::KernelElem;
use treeattn::backend::{AttnParams, AttnShape, Element, SdccLoss};
use treeattn::{Error, Result};

#[allow(unused_imports)]
use treeattn::backend::{AttnArgs, SdccArgs};

/// An element type a target's buffers hold: with `cuda`, one cudarc can
/// copy to the device.
#[cfg(feature = "cuda")]
pub(crate) trait DevElem:
    Element + treeattn::backend::cuda::cudarc::driver::DeviceRepr
{
}
#[cfg(feature = "cuda")]
impl<T: Element + treeattn::backend::cuda::cudarc::driver::DeviceRepr> DevElem for T {}
/// An element type a target's buffers hold.
#[cfg(not(feature = "cuda"))]
pub(crate) trait DevElem: Element {}
#[cfg(not(feature = "cuda"))]
impl<T: Element> DevElem for T {}

/// What the check flow needs of a backend: buffers, a resident pack, the
/// kernels through the contract, and a timer.
pub(crate) trait Target {
    /// A buffer of the target's memory.
    type Buf<T: DevElem>;
    /// A pack made resident (kv_end, position ids, per-key-tile bounds).
    type Pack;
    /// `"cuda"` or `"emu"`.
    const NAME: &'static str;
    /// Whether [`Target::time_ms`] measures the GPU (false: the emulator's
    /// wall clock, meaningless for a GPU).
    const REAL_TIMING: bool;

    /// The device, in words.
    fn describe(&self) -> Result<String>;
    /// The same target with the backward's main kernel chosen (`None`: the
    /// head dim's default), sharing its device and stream: the timings run
    /// the backward with both main kernels side by side.
    fn with_main_kernel(&self, kernel: Option<MainKernel>) -> Self
    where
        Self: Sized;
    /// The same target with the backward's balanced main launch (issue 39
    /// item 1): on CUDA `CudaBackend::with_balanced_backward`, its slots
    /// this device's SMs × resident blocks; on the emulator
    /// `BwdBalance::Slots(132)`, an H100's SMs, which cuts the prompt of
    /// the small emulated packs into many ranges.
    fn with_balanced(&self) -> Self
    where
        Self: Sized;
    /// A copy of `x` in the target's memory.
    fn up<T: DevElem>(&self, x: &[T]) -> Result<Self::Buf<T>>;
    /// A host copy of `x`.
    fn down<T: DevElem>(&self, x: &Self::Buf<T>) -> Result<Vec<T>>;
    /// A buffer of `n` elements, every one `v` (NaN: poisoned).
    fn filled<T: DevElem>(&self, n: usize, v: T) -> Result<Self::Buf<T>> {
        self.up(&vec![v; n])
    }
    /// Makes a pack resident.
    fn pack(&self, p: &MaskBuilder) -> Result<Self::Pack>;
    /// The per-key-tile (min, max) of kv_end as the target computed them,
    /// and the tile size.
    fn tile_bounds(&self, p: &Self::Pack) -> Result<(Vec<u32>, Vec<u32>, u32)>;
    /// The forward through the contract.
    fn forward<T: KernelElem + DevElem>(
        &self,
        q: &Self::Buf<T>,
        k: &Self::Buf<T>,
        v: &Self::Buf<T>,
        shape: AttnShape,
        pack: &Self::Pack,
        params: &AttnParams,
        o: &mut Self::Buf<T>,
        lse: &mut Self::Buf<f32>,
    ) -> Result<()>;
    /// The backward through the contract's validation, dQ summed as `mode`
    /// says.
    fn backward<T: KernelElem + DevElem>(
        &self,
        q: &Self::Buf<T>,
        k: &Self::Buf<T>,
        v: &Self::Buf<T>,
        o: &Self::Buf<T>,
        lse: &Self::Buf<f32>,
        d_o: &Self::Buf<T>,
        shape: AttnShape,
        pack: &Self::Pack,
        params: &AttnParams,
        mode: DqMode,
        dq: &mut Self::Buf<T>,
        dk: &mut Self::Buf<T>,
        dv: &mut Self::Buf<T>,
    ) -> Result<()>;
    /// The SDCC forward KL (fused, or the unfused baseline).
    fn sdcc<T: SdccElem + DevElem>(
        &self,
        unfused: bool,
        student: &Self::Buf<T>,
        teacher: &Self::Buf<T>,
        vocab: usize,
        pairs: &[(u32, u32)],
        weights: &[f32],
        tau: f32,
        grad: &mut Self::Buf<f32>,
    ) -> Result<SdccLoss>;
    /// Milliseconds `f` takes on the target (CUDA events around it, or the
    /// wall clock on the emulator).
    fn time_ms(&self, f: &mut dyn FnMut() -> Result<()>) -> Result<f64>;
}

#[cfg(feature = "emu")]
pub(crate) use emu_target::EmuTarget;

#[cfg(feature = "emu")]
mod emu_target {
    use super::*;
    use treeattn::backend::emu::Emu;
    use treeattn::backend::launch::FwdTraits;
    use treeattn::backend::{AttentionBackend, Grads, Host, Saved, SdccBackend};

    /// The emulator as a check target: host vectors, the pack kept on the
    /// host, the kernels run by [`Emu`] (one worker per core).
    #[derive(Default)]
    pub(crate) struct EmuTarget {
        pub emu: Emu,
    }

    impl Target for EmuTarget {
        type Buf<T: DevElem> = Vec<T>;
        type Pack = MaskBuilder;
        const NAME: &'static str = "emu";
        const REAL_TIMING: bool = false;

        fn with_main_kernel(&self, kernel: Option<MainKernel>) -> Self {
            EmuTarget {
                emu: self.emu.with_main_kernel(kernel),
            }
        }
        fn with_balanced(&self) -> Self {
            EmuTarget {
                emu: self
                    .emu
                    .with_balance(treeattn::backend::emu::BwdBalance::Slots(132)),
            }
        }
        fn describe(&self) -> Result<String> {
            Ok(format!(
                "the SIMT emulator ({} CPU threads; timings are the emulator's wall clock and mean nothing for a GPU)",
                std::thread::available_parallelism().map_or(1, |n| n.get())
            ))
        }
        fn up<T: DevElem>(&self, x: &[T]) -> Result<Vec<T>> {
            // A fresh Vec: the kernels need 16-byte aligned tensors, which
            // the allocator gives these sizes.
            Ok(x.to_vec())
        }
        fn down<T: DevElem>(&self, x: &Vec<T>) -> Result<Vec<T>> {
            Ok(x.clone())
        }
        fn pack(&self, p: &MaskBuilder) -> Result<MaskBuilder> {
            p.mask()?;
            Ok(p.clone())
        }
        fn tile_bounds(&self, p: &MaskBuilder) -> Result<(Vec<u32>, Vec<u32>, u32)> {
            let tile = FwdTraits::for_head_dim(64)?.block_n;
            let (lo, hi) = self.emu.kv_tile_bounds(&p.kv_end, tile as usize)?;
            Ok((lo, hi, tile))
        }
        fn forward<T: KernelElem + DevElem>(
            &self,
            q: &Vec<T>,
            k: &Vec<T>,
            v: &Vec<T>,
            shape: AttnShape,
            pack: &MaskBuilder,
            params: &AttnParams,
            o: &mut Vec<T>,
            lse: &mut Vec<f32>,
        ) -> Result<()> {
            let args = AttnArgs::<Host, T>::new(q, k, v, shape, pack.mask()?, *params)?;
            AttentionBackend::<T>::forward(&self.emu, &args, &mut o[..], &mut lse[..])
        }
        fn backward<T: KernelElem + DevElem>(
            &self,
            q: &Vec<T>,
            k: &Vec<T>,
            v: &Vec<T>,
            o: &Vec<T>,
            lse: &Vec<f32>,
            d_o: &Vec<T>,
            shape: AttnShape,
            pack: &MaskBuilder,
            params: &AttnParams,
            mode: DqMode,
            dq: &mut Vec<T>,
            dk: &mut Vec<T>,
            dv: &mut Vec<T>,
        ) -> Result<()> {
            let args = AttnArgs::<Host, T>::new(q, k, v, shape, pack.mask()?, *params)?;
            let saved = Saved {
                o: &o[..],
                lse: &lse[..],
            };
            let grads = Grads {
                dq: &mut dq[..],
                dk: &mut dk[..],
                dv: &mut dv[..],
                dsinks: None,
            };
            AttentionBackend::<T>::backward(
                &self.emu.with_dq_mode(mode),
                &args,
                saved,
                &d_o[..],
                grads,
            )
        }
        fn sdcc<T: SdccElem + DevElem>(
            &self,
            unfused: bool,
            student: &Vec<T>,
            teacher: &Vec<T>,
            vocab: usize,
            pairs: &[(u32, u32)],
            weights: &[f32],
            tau: f32,
            grad: &mut Vec<f32>,
        ) -> Result<SdccLoss> {
            let args = SdccArgs::<Host, T>::new(student, teacher, vocab, pairs, weights, tau)?;
            if unfused {
                let out = self.emu.sdcc_forward_kl_unfused(&args)?;
                if grad.len() != out.grad_student.len() {
                    return Err(Error::Shape(format!(
                        "SDCC gradient has {} elements, expected {} (like the student logits)",
                        grad.len(),
                        out.grad_student.len()
                    )));
                }
                grad.copy_from_slice(&out.grad_student);
                Ok(out.loss)
            } else {
                SdccBackend::<T>::sdcc_forward_kl(&self.emu, &args, &mut grad[..])
            }
        }
        fn time_ms(&self, f: &mut dyn FnMut() -> Result<()>) -> Result<f64> {
            let t = std::time::Instant::now();
            f()?;
            Ok(t.elapsed().as_secs_f64() * 1e3)
        }
    }
}

#[cfg(feature = "cuda")]
pub(crate) use cuda_target::CudaTarget;

#[cfg(feature = "cuda")]
mod cuda_target {
    use super::*;
    use treeattn::backend::cuda::cudarc::driver::CudaSlice;
    use treeattn::backend::cuda::{CudaBackend, Device, DevicePack};
    use treeattn::backend::{AttentionBackend, BackwardCall, Grads, Saved, SdccBackend};

    fn cerr(
        what: &'static str,
    ) -> impl Fn(treeattn::backend::cuda::cudarc::driver::DriverError) -> Error {
        move |e| Error::Cuda(format!("{what}: {e}"))
    }

    /// A CUDA device as a check target: device buffers, packs uploaded
    /// once, launches on the backend's stream, CUDA-event timing.
    pub(crate) struct CudaTarget {
        pub be: CudaBackend,
    }

    impl Target for CudaTarget {
        type Buf<T: DevElem> = CudaSlice<T>;
        type Pack = DevicePack;
        const NAME: &'static str = "cuda";
        const REAL_TIMING: bool = true;

        fn with_main_kernel(&self, kernel: Option<MainKernel>) -> Self {
            CudaTarget {
                be: self.be.clone().with_main_kernel(kernel),
            }
        }
        fn with_balanced(&self) -> Self {
            CudaTarget {
                be: self.be.clone().with_balanced_backward(true),
            }
        }
        fn describe(&self) -> Result<String> {
            self.be.describe()
        }
        fn up<T: DevElem>(&self, x: &[T]) -> Result<CudaSlice<T>> {
            self.be.stream().clone_htod(x).map_err(cerr("upload"))
        }
        fn down<T: DevElem>(&self, x: &CudaSlice<T>) -> Result<Vec<T>> {
            self.be.stream().clone_dtoh(x).map_err(cerr("download"))
        }
        fn pack(&self, p: &MaskBuilder) -> Result<DevicePack> {
            self.be.upload_pack(p.mask()?)
        }
        fn tile_bounds(&self, p: &DevicePack) -> Result<(Vec<u32>, Vec<u32>, u32)> {
            let (lo, hi, tile) = p.tile_bounds();
            let s = self.be.stream();
            let lo = s.clone_dtoh(lo).map_err(cerr("download tile bounds"))?;
            let hi = s.clone_dtoh(hi).map_err(cerr("download tile bounds"))?;
            Ok((lo, hi, tile))
        }
        fn forward<T: KernelElem + DevElem>(
            &self,
            q: &CudaSlice<T>,
            k: &CudaSlice<T>,
            v: &CudaSlice<T>,
            shape: AttnShape,
            pack: &DevicePack,
            params: &AttnParams,
            o: &mut CudaSlice<T>,
            lse: &mut CudaSlice<f32>,
        ) -> Result<()> {
            let args = AttnArgs::<Device, T>::new(q, k, v, shape, pack, *params)?;
            AttentionBackend::<T>::forward(&self.be, &args, o, lse)
        }
        fn backward<T: KernelElem + DevElem>(
            &self,
            q: &CudaSlice<T>,
            k: &CudaSlice<T>,
            v: &CudaSlice<T>,
            o: &CudaSlice<T>,
            lse: &CudaSlice<f32>,
            d_o: &CudaSlice<T>,
            shape: AttnShape,
            pack: &DevicePack,
            params: &AttnParams,
            mode: DqMode,
            dq: &mut CudaSlice<T>,
            dk: &mut CudaSlice<T>,
            dv: &mut CudaSlice<T>,
        ) -> Result<()> {
            let args = AttnArgs::<Device, T>::new(q, k, v, shape, pack, *params)?;
            let call = BackwardCall::new(
                args,
                Saved { o, lse },
                d_o,
                Grads {
                    dq,
                    dk,
                    dv,
                    dsinks: None,
                },
            )?;
            self.be.backward_with_mode(call, mode)
        }
        fn sdcc<T: SdccElem + DevElem>(
            &self,
            unfused: bool,
            student: &CudaSlice<T>,
            teacher: &CudaSlice<T>,
            vocab: usize,
            pairs: &[(u32, u32)],
            weights: &[f32],
            tau: f32,
            grad: &mut CudaSlice<f32>,
        ) -> Result<SdccLoss> {
            let args = SdccArgs::<Device, T>::new(student, teacher, vocab, pairs, weights, tau)?;
            if unfused {
                self.be.sdcc_forward_kl_unfused(&args, grad)
            } else {
                SdccBackend::<T>::sdcc_forward_kl(&self.be, &args, grad)
            }
        }
        fn time_ms(&self, f: &mut dyn FnMut() -> Result<()>) -> Result<f64> {
            let s = self.be.stream();
            let flags =
                Some(treeattn::backend::cuda::cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
            let start = self.be.context().new_event(flags).map_err(cerr("event"))?;
            let end = self.be.context().new_event(flags).map_err(cerr("event"))?;
            start.record(s).map_err(cerr("event record"))?;
            f()?;
            end.record(s).map_err(cerr("event record"))?;
            Ok(start.elapsed_ms(&end).map_err(cerr("event timing"))? as f64)
        }
    }
}
