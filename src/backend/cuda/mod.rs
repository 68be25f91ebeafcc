//! The `cuda` backend (feature `cuda`): the kernels of `kernels/`, compiled
//! by nvcc at build time into one fatbin (SASS for sm_80 and sm_90a, PTX for
//! compute_80) embedded in the crate, launched through `cudarc` with dynamic
//! loading — the crate builds and runs without CUDA; only
//! [`CudaBackend::new`] needs a driver, and it returns an `Err` (never a
//! panic) when there is none.
//!
//! cudarc's loading mode: this crate asks for `fallback-dynamic-loading`
//! (not `dynamic-loading`), so that it builds in one project with crates
//! that ask for `dynamic-linking` (candle-core 0.11 does; cudarc refuses
//! both `dynamic-*` features at once). Alone it loads `libcuda` at run
//! time; beside such a crate cudarc links it, and a program then needs the
//! driver library to start. Either way the driver check is
//! [`driver_present`], which does not depend on cudarc's mode.
//!
//! Use: create a [`CudaBackend`], upload a pack once with
//! [`CudaBackend::upload_pack`] (kv_end, position ids, and the per-key-tile
//! min/max of kv_end, computed on the device), then call the contract's
//! [`AttentionBackend`] / [`SdccBackend`] methods on device buffers
//! ([`Device`] memory) in the `[tokens, heads, head_dim]` layout. Launches go
//! to the backend's stream.

pub(crate) mod bwd;
pub mod host;

/// The cudarc this backend is built with (its buffers and streams are the
/// [`Device`] memory), for hosts that name its types.
pub use cudarc;
mod rope;
mod sdcc;
mod starts;

use bwd::CudaBackward;
use sdcc::CudaSdcc;

use std::sync::Arc;

use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, DevicePtrMut,
    DeviceRepr, LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::Ptx;

use super::launch::sdcc::SdccElem;
use super::launch::{self, FwdParams, FwdTraits, KernelElem, KvBoundsParams, LaunchPlan};
use super::{
    AttentionBackend, BackwardCall, Element, Extent, ForwardCall, Memory, SdccArgs, SdccBackend,
    SdccCall, SdccLoss,
};
use crate::mask::PackMask;
use crate::{Error, Result};

pub use super::launch::bwd::{DqMode, MainKernel};

/// Whether the CUDA driver library (`libcuda.so.1` / `libcuda.so`,
/// `nvcuda.dll` on Windows) can be loaded on this machine: without it every
/// cudarc call panics, so [`CudaBackend::new`] asks first. Independent of
/// cudarc's loading mode (its own `is_culib_present` exists only with
/// `dynamic-loading`, which is off when another crate in the build asks
/// for `dynamic-linking`).
pub fn driver_present() -> bool {
    #[cfg(windows)]
    const NAMES: &[&str] = &["nvcuda.dll"];
    #[cfg(not(windows))]
    const NAMES: &[&str] = &["libcuda.so.1", "libcuda.so"];
    NAMES.iter().any(|name| {
        // SAFETY: loads the driver library, as cudarc itself does on first
        // use; its initializers are the driver's own.
        unsafe { libloading::Library::new(*name) }.is_ok()
    })
}

/// Device memory: cudarc buffers on the backend's device, and a pack
/// uploaded by [`CudaBackend::upload_pack`].
#[derive(Clone, Copy, Debug, Default)]
pub struct Device;

impl<T> Extent for &CudaSlice<T> {
    fn len(&self) -> usize {
        CudaSlice::len(self)
    }
}

impl<T> Extent for &mut CudaSlice<T> {
    fn len(&self) -> usize {
        CudaSlice::len(self)
    }
}

impl Memory for Device {
    type Ref<'a, T: Element> = &'a CudaSlice<T>;
    type Mut<'a, T: Element> = &'a mut CudaSlice<T>;
    type Mask<'a> = &'a DevicePack;
    fn mask_tokens(mask: &&DevicePack) -> usize {
        mask.tokens
    }
    fn mask_fingerprint(mask: &&DevicePack) -> u64 {
        mask.fingerprint
    }
    fn mask_is_tree(mask: &&DevicePack) -> bool {
        mask.is_tree
    }
    /// Device memory is not read from the host here: the backend scans it
    /// on its stream when `params.check_finite` asks.
    fn find<T: Element>(_: &&CudaSlice<T>, _: impl Fn(f64) -> bool) -> Option<usize> {
        None
    }
    fn shorten<'a: 'b, 'b, T: Element>(x: &'a CudaSlice<T>) -> &'b CudaSlice<T> {
        x
    }
    fn shorten_mask<'a: 'b, 'b>(mask: &'a DevicePack) -> &'b DevicePack {
        mask
    }
    fn reborrow_mut<'b, T: Element>(x: &'b mut &mut CudaSlice<T>) -> &'b mut CudaSlice<T> {
        x
    }
}

/// The fatbin built from `kernels/tree_attn_fwd.cu` by build.rs.
static FWD_FATBIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/tree_attn_fwd.fatbin"));

/// The `ptxas -v` report of the embedded kernels (registers, shared memory,
/// spills per kernel and architecture), as printed by nvcc at build time.
pub const PTXAS_REPORT: &str = include_str!(concat!(env!("OUT_DIR"), "/ptxas-report.txt"));

// SAFETY: plain #[repr(C)] structs of integers, floats and device addresses,
// laid out exactly like the kernel's parameter structs.
unsafe impl DeviceRepr for FwdParams {}
unsafe impl DeviceRepr for KvBoundsParams {}

fn cuda_err(what: &str) -> impl Fn(cudarc::driver::DriverError) -> Error + '_ {
    move |e| Error::Cuda(format!("{what}: {e}"))
}

/// Asks the driver to give `f`'s blocks the largest shared-memory carveout
/// of the SM's unified L1 / shared storage
/// (`CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT` = 100, i.e.
/// `CU_SHAREDMEM_CARVEOUT_MAX_SHARED`), as FlashAttention and CUTLASS do for
/// their shared-memory-bound kernels. The attention kernels stage every
/// tile in shared memory and read global memory only through `cp.async.cg`
/// (which bypasses L1), so L1 has little to cache for them, and with the
/// driver's default carveout a second block of a kernel may not fit on an
/// SM next to the first. A preference, not a guarantee: the driver may
/// round it to a supported split.
fn prefer_max_shared_carveout(f: &CudaFunction, name: &str) -> Result<()> {
    f.set_attribute(
        CUfunction_attribute::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
        100,
    )
    .map_err(|e| Error::Cuda(format!("{name}: setting the shared-memory carveout: {e}")))
}

fn config(plan: LaunchPlan) -> LaunchConfig {
    LaunchConfig {
        grid_dim: plan.grid,
        block_dim: plan.block,
        shared_mem_bytes: plan.shared_mem_bytes,
    }
}

/// Retains device `ordinal`'s primary context (the one the CUDA runtime,
/// and so PyTorch and JAX, use: cudarc's [`CudaContext::new`] creates no
/// context of its own) after checking that a driver and the device exist
/// and that the device can run the kernels.
pub(crate) fn open_context(ordinal: usize) -> Result<Arc<CudaContext>> {
    // cudarc panics on first use without a driver library.
    if !driver_present() {
        return Err(Error::Cuda(
            "no CUDA driver found (libcuda.so could not be loaded): this machine has no NVIDIA GPU driver; \
             use the cpu or emu backend"
                .into(),
        ));
    }
    let count = CudaContext::device_count().map_err(cuda_err("cuInit / device count"))?;
    if ordinal >= count.max(0) as usize {
        return Err(Error::Cuda(format!(
            "no CUDA device {ordinal}: {count} device(s) present"
        )));
    }
    let ctx = CudaContext::new(ordinal).map_err(cuda_err("retaining the primary context"))?;
    check_device(&ctx)?;
    Ok(ctx)
}

/// The kernels need sm_80 or newer.
fn check_device(ctx: &CudaContext) -> Result<()> {
    let (major, minor) = ctx
        .compute_capability()
        .map_err(cuda_err("compute capability"))?;
    if major < 8 {
        return Err(Error::Unsupported(format!(
            "device {} has compute capability {major}.{minor}; the kernels need 8.0 or newer \
             (mma.sync bf16, ldmatrix, cp.async)",
            ctx.ordinal()
        )));
    }
    Ok(())
}

/// A CUDA device with the treeattn kernels loaded and a stream to launch on.
///
/// Cloning is cheap (the loaded modules are shared).
#[derive(Clone)]
pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    _module: Arc<CudaModule>,
    /// Forward kernels in the order of [`launch::ATTN_VARIANTS`].
    fwd: Vec<CudaFunction>,
    /// The variant kernels (`tree_attn_fwd_var_*`), in the same order.
    fwd_var: Vec<CudaFunction>,
    kv_bounds: CudaFunction,
    pub(crate) bwd: CudaBackward,
    sdcc: CudaSdcc,
    rope: rope::CudaRope,
    dq_mode: DqMode,
    /// The backward main kernel (`None`: the head dim's default).
    pub(crate) main_kernel: Option<MainKernel>,
    /// The balanced backward main launch ([`Self::with_balanced_backward`]).
    pub(crate) balanced_backward: bool,
}

impl CudaBackend {
    /// Opens device `ordinal` (its primary context), loads the kernels,
    /// creates a stream of its own. A host that owns the stream (candle,
    /// PyTorch, a C++ framework) uses [`Self::with_stream`] /
    /// [`Self::on_stream`] instead, or the borrowed-pointer entries of
    /// [`host`].
    ///
    /// Errors (never panics): no CUDA driver library on this machine, no such
    /// device, a device older than sm_80, a driver too old for the embedded
    /// code (CUDA 13.0, driver 580, is needed).
    pub fn new(ordinal: usize) -> Result<Self> {
        let ctx = open_context(ordinal)?;
        let stream = ctx.new_stream().map_err(cuda_err("creating a stream"))?;
        Self::load(ctx, stream)
    }

    /// Loads the kernels into the context of a stream someone else owns
    /// (candle's device stream, a stream wrapped with
    /// [`CudaContext::wrap_borrowed_stream`]) and launches on that stream:
    /// no context and no stream is created. Loading takes milliseconds; for
    /// one call per step keep the backend, or load once and use
    /// [`Self::on_stream`] per stream.
    ///
    /// Errors as [`Self::new`].
    pub fn with_stream(stream: &Arc<CudaStream>) -> Result<Self> {
        let ctx = stream.context().clone();
        check_device(&ctx)?;
        Self::load(ctx, stream.clone())
    }

    /// This backend's kernels launched on `stream` (a cheap copy: the
    /// loaded modules are shared). `stream` must belong to this backend's
    /// context (an `Err` otherwise: the kernels are loaded per context).
    pub fn on_stream(&self, stream: &Arc<CudaStream>) -> Result<Self> {
        if stream.context().cu_ctx() != self.ctx.cu_ctx() {
            return Err(Error::Cuda(format!(
                "the stream belongs to another CUDA context (device {}) than this backend's (device {}): \
                 load the kernels there with CudaBackend::with_stream",
                stream.context().ordinal(),
                self.ctx.ordinal()
            )));
        }
        let mut be = self.clone();
        be.stream = stream.clone();
        be.bwd.stream = stream.clone();
        be.sdcc.stream = stream.clone();
        Ok(be)
    }

    fn load(ctx: Arc<CudaContext>, stream: Arc<CudaStream>) -> Result<Self> {
        let (major, minor) = ctx
            .compute_capability()
            .map_err(cuda_err("compute capability"))?;
        let ordinal = ctx.ordinal();
        let module = ctx.load_module(Ptx::from_binary(FWD_FATBIN.to_vec())).map_err(|e| {
            Error::Cuda(format!(
                "loading the embedded kernels (SASS sm_80/sm_90a, PTX compute_80, built by CUDA 13.0) on \
                 compute capability {major}.{minor}: {e}; a driver for CUDA 13.0 or newer (580+) is required"
            ))
        })?;
        let optin = ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            .map_err(cuda_err("shared memory limit"))?;
        let load = |name: &str| module.load_function(name).map_err(cuda_err(name));
        let mut fwd = Vec::new();
        let mut fwd_var = Vec::new();
        for &(dtype, d) in launch::ATTN_VARIANTS {
            let t = FwdTraits::for_head_dim(d as usize)?;
            for (name, smem, into) in [
                (t.kernel_name(dtype), t.smem_bytes(), &mut fwd),
                (t.kernel_name_var(dtype), t.smem_bytes_var(), &mut fwd_var),
            ] {
                let f = load(&name)?;
                if smem as i32 > optin {
                    return Err(Error::Unsupported(format!(
                        "{name} needs {smem} bytes of shared memory per block; device {ordinal} allows {optin}"
                    )));
                }
                f.set_attribute(
                    CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    smem as i32,
                )
                .map_err(cuda_err("raising the dynamic shared memory limit"))?;
                prefer_max_shared_carveout(&f, &name)?;
                into.push(f);
            }
        }
        let kv_bounds = load("tree_attn_kv_tile_bounds")?;
        Ok(CudaBackend {
            bwd: CudaBackward::new(&ctx, &stream)?,
            sdcc: CudaSdcc::new(&ctx, &stream)?,
            rope: rope::CudaRope::new(&ctx)?,
            dq_mode: DqMode::default(),
            main_kernel: None,
            balanced_backward: false,
            ctx,
            stream,
            _module: module,
            fwd,
            fwd_var,
            kv_bounds,
        })
    }

    /// The same backend with the backward summing dQ as `mode` says
    /// (atomic by default, as in FlashAttention: [`DqMode`] says why;
    /// `with_dq_mode(DqMode::Deterministic)` for a bit-identical dQ). The
    /// borrowed-pointer entry [`Self::backward_raw`] takes the mode per
    /// call instead (the bindings pass their caller's `deterministic`).
    pub fn with_dq_mode(self, mode: DqMode) -> Self {
        CudaBackend {
            dq_mode: mode,
            ..self
        }
    }

    /// The same backend with the backward's main kernel chosen (`Some`) or
    /// the head dim's default (`None`: [`MainKernel::default_for`]); the
    /// GPU check times both.
    pub fn with_main_kernel(self, kernel: Option<MainKernel>) -> Self {
        CudaBackend {
            main_kernel: kernel,
            ..self
        }
    }

    /// The same backend with the backward's balanced main launch on or off
    /// (off by default until a GPU has timed it; `treeattn gpu-check` times
    /// both). On, every key tile whose query walk holds more than `Σ pairs /
    /// (2 · slots)` pairs × heads (slots: this device's SMs × the main
    /// kernel's resident blocks) is cut into consecutive query ranges,
    /// launched heaviest first, each range writing f32 partial dK / dV
    /// summed in a fixed order ([`launch::bwd::balanced_main_items`]; the
    /// result is bit-identical run to run in deterministic mode). It costs
    /// a host walk of the pack per call and `8 · slots · tokens · kv_heads
    /// · d` bytes of zeroed scratch, where slots is the most ranges of one
    /// key tile. Only the 8-warp [`MainKernel::TwoMTiles`] kernels read an
    /// item table; other main kernels run their grid.
    pub fn with_balanced_backward(self, on: bool) -> Self {
        CudaBackend {
            balanced_backward: on,
            ..self
        }
    }

    /// The unfused baseline of the SDCC forward KL (log-softmax of each
    /// side into an f32 `[2, pairs, vocab]` buffer, then an elementwise KL
    /// and the gradient): the same contract and result as
    /// [`SdccBackend::sdcc_forward_kl`], for timing the fused kernel against.
    pub fn sdcc_forward_kl_unfused<T: SdccElem + DeviceRepr>(
        &self,
        args: &SdccArgs<'_, Device, T>,
        grad: &mut CudaSlice<f32>,
    ) -> Result<SdccLoss> {
        self.sdcc.run_unfused(SdccCall::new(*args, grad)?)
    }

    /// The stream every launch of this backend goes to.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The device context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Device name and compute capability, e.g. `"NVIDIA H200 (sm_90)"`.
    pub fn describe(&self) -> Result<String> {
        let name = self.ctx.name().map_err(cuda_err("device name"))?;
        let (ma, mi) = self
            .ctx
            .compute_capability()
            .map_err(cuda_err("compute capability"))?;
        Ok(format!("{name} (sm_{ma}{mi})"))
    }

    /// Uploads a pack (kv_end and position ids) and computes the per-key-tile
    /// min and max of kv_end on the device, for tiles of the forward kernel's
    /// key-tile size. Do this once per pack; every op on the pack reuses it.
    pub fn upload_pack(&self, mask: PackMask<'_>) -> Result<DevicePack> {
        let tokens = mask.len();
        let tile = FwdTraits::for_head_dim(64)?.block_n;
        debug_assert_eq!(tile, FwdTraits::for_head_dim(128)?.block_n);
        let tiles = tokens.div_ceil(tile as usize);
        let s = &self.stream;
        let kv_end = s
            .clone_htod(mask.kv_end())
            .map_err(cuda_err("uploading kv_end"))?;
        let position_ids = s
            .clone_htod(mask.position_ids())
            .map_err(cuda_err("uploading position ids"))?;
        let mut tile_kv_min = s
            .alloc_zeros::<u32>(tiles.max(1))
            .map_err(cuda_err("allocating tile bounds"))?;
        let mut tile_kv_max = s
            .alloc_zeros::<u32>(tiles.max(1))
            .map_err(cuda_err("allocating tile bounds"))?;
        if tiles > 0 {
            let plan = launch::plan_kv_tile_bounds(tiles);
            let (e, _g0) = kv_end.device_ptr(s);
            let (lo, _g1) = tile_kv_min.device_ptr_mut(s);
            let (hi, _g2) = tile_kv_max.device_ptr_mut(s);
            let p = KvBoundsParams {
                kv_end: e,
                tile_kv_min: lo,
                tile_kv_max: hi,
                tokens: tokens as u32,
                tile,
                num_tiles: tiles as u32,
                reserved: 0,
            };
            let mut b = s.launch_builder(&self.kv_bounds);
            b.arg(&p);
            // SAFETY: the kernel reads `tokens` entries of kv_end and writes
            // `tiles` entries of each bounds buffer, all allocated above.
            unsafe { b.launch(config(plan)) }
                .map_err(cuda_err("launching tree_attn_kv_tile_bounds"))?;
        }
        Ok(DevicePack {
            tokens,
            tile,
            fingerprint: mask.fingerprint(),
            visible_pairs: mask.visible_pairs(),
            is_tree: mask.is_tree(),
            kv_end,
            position_ids,
            max_position: launch::rope::max_position(mask.position_ids()),
            rope_tables: Default::default(),
            host_kv_end: mask.kv_end().to_vec(),
            host_position_ids: mask.position_ids().to_vec(),
            starts: Default::default(),
            tile_kv_min,
            tile_kv_max,
        })
    }

    /// Tree attention forward on the device (the math of
    /// [`AttentionBackend`]): d ∈ {64, 128}, bf16 / f16 inputs, f32 LSE.
    /// Asynchronous on [`Self::stream`]. `params.check_finite` downloads and
    /// scans q, k, v first (slow; for debugging). No rotary here: with
    /// `params.rope`, `rope::forward` rotates Q and K into scratch buffers
    /// first and calls this on them.
    fn run_forward_kernel<T: KernelElem + DeviceRepr>(
        &self,
        call: ForwardCall<'_, '_, Device, T, f32>,
    ) -> Result<()> {
        let (args, o, lse) = call.into_parts();
        let (q, k, v, shape, pack) = (args.q(), args.k(), args.v(), args.shape(), args.mask());
        let params = args.params();
        let prog = launch::FwdProgram::new("CUDA kernels", &args)?;
        if pack.tile != prog.traits.block_n {
            return Err(Error::Pack(format!(
                "pack tile bounds are for tiles of {} keys, the kernel uses {}",
                pack.tile, prog.traits.block_n
            )));
        }
        if params.check_finite {
            for (name, x) in [("q", q), ("k", k), ("v", v)] {
                let h = self
                    .stream
                    .clone_dtoh(x)
                    .map_err(cuda_err("downloading for the finiteness check"))?;
                if let Some(i) = h.iter().position(|e| !e.to_f32().is_finite()) {
                    return Err(Error::NonFinite {
                        what: name.into(),
                        index: i,
                    });
                }
            }
        }
        if prog.empty {
            return Ok(());
        }
        let s = &self.stream;
        // The attention variants: the key starts (window, explicit starts,
        // the sinks' blind rows), the sinks; the softcap is a scalar.
        let starts = if prog.variants {
            starts::device_starts(
                s,
                pack,
                params.window,
                args.key_starts(),
                args.sinks().is_some(),
            )?
        } else {
            None
        };
        let (qp, _g0) = q.device_ptr(s);
        let (kp, _g1) = k.device_ptr(s);
        let (vp, _g2) = v.device_ptr(s);
        let (op, _g3) = o.device_ptr_mut(s);
        let (lp, _g4) = lse.device_ptr_mut(s);
        let (ep, _g5) = pack.kv_end.device_ptr(s);
        let (lo, _g6) = pack.tile_kv_min.device_ptr(s);
        let (hi, _g7) = pack.tile_kv_max.device_ptr(s);
        let st = starts.as_deref().map(|d| {
            (
                d.starts.device_ptr(s),
                d.tile_min.device_ptr(s),
                d.tile_max.device_ptr(s),
            )
        });
        let sk = args.sinks().map(|x| x.device_ptr(s));
        let p = FwdParams {
            q: qp,
            k: kp,
            v: vp,
            o: op,
            lse: lp,
            kv_end: ep,
            tile_kv_min: lo,
            tile_kv_max: hi,
            key_start: st.as_ref().map_or(0, |x| x.0 .0),
            start_tile_min: st.as_ref().map_or(0, |x| x.1 .0),
            start_tile_max: st.as_ref().map_or(0, |x| x.2 .0),
            sinks: sk.as_ref().map_or(0, |x| x.0),
            ..prog.params(&shape, params)
        };
        let at = launch::variant(T::DTYPE, prog.traits.head_dim)?;
        let f = if prog.variants {
            &self.fwd_var[at]
        } else {
            &self.fwd[at]
        };
        let mut b = s.launch_builder(f);
        b.arg(&p);
        // SAFETY: every buffer's length was checked against `shape` and the
        // pack (`AttnArgs`, `ForwardCall`); the kernel stays inside them
        // (rows and keys past `tokens` are neither loaded nor stored).
        unsafe { b.launch(config(prog.plan)) }
            .map_err(|e| Error::Cuda(format!("launching {}: {e}", prog.kernel_name(T::DTYPE))))?;
        Ok(())
    }
}

impl<T: KernelElem + DeviceRepr> AttentionBackend<T> for CudaBackend {
    type Memory = Device;
    type Lse = f32;
    fn run_forward(&self, call: ForwardCall<'_, '_, Device, T, f32>) -> Result<()> {
        let (args, o, lse) = call.into_parts();
        let s = &self.stream;
        launch::check_kernel_call("CUDA kernels", &args)?;
        // Before any launch (rotary included): a misaligned view would
        // fault and take the CUDA context down.
        launch::check_vector_alignment(
            "forward kernels",
            args.shape().tokens,
            &[
                ("q", args.q().device_ptr(s).0),
                ("k", args.k().device_ptr(s).0),
                ("v", args.v().device_ptr(s).0),
                ("o", o.device_ptr(s).0),
            ],
        )?;
        let call = ForwardCall::new(args, o, lse)?;
        match call.args().params().rope {
            Some(r) => rope::forward(self, r, call),
            None => self.run_forward_kernel(call),
        }
    }
    fn run_backward(&self, call: BackwardCall<'_, '_, '_, Device, T, f32>) -> Result<()> {
        self.backward_with_mode(call, self.dq_mode)
    }
}

impl<T: SdccElem + DeviceRepr> SdccBackend<T> for CudaBackend {
    type Memory = Device;
    type Grad = f32;
    fn run_sdcc(&self, call: SdccCall<'_, '_, Device, T, f32>) -> Result<SdccLoss> {
        self.sdcc.run(call)
    }
}

/// A pack resident on the device: kv_end, position ids and the per-key-tile
/// bounds of kv_end (min and max over each tile of the kernel's key-tile
/// size), computed once by [`CudaBackend::upload_pack`]; and the rotary
/// cos / sin tables of each rotary setting used with it, built on the
/// device by its first rotary call (cached; no call downloads anything).
pub struct DevicePack {
    tokens: usize,
    tile: u32,
    fingerprint: u64,
    visible_pairs: u64,
    /// [`PackMask::is_tree`] of the uploaded pack.
    is_tree: bool,
    kv_end: CudaSlice<u32>,
    position_ids: CudaSlice<u32>,
    /// The largest position id and its first token (from the host mask at
    /// upload): the rows of the rotary tables.
    max_position: (u32, usize),
    /// Rotary tables per (base, dims), built on first use (`rope.rs`).
    rope_tables: rope::RopeTableCache,
    /// kv_end and the position ids on the host, for the key starts of the
    /// attention variants (`starts.rs`: one `O(L)` walk per window).
    host_kv_end: Vec<u32>,
    host_position_ids: Vec<u32>,
    /// The variants' key starts per (window, sinks), built on first use.
    starts: starts::StartsCache,
    tile_kv_min: CudaSlice<u32>,
    tile_kv_max: CudaSlice<u32>,
}

impl DevicePack {
    /// Packed tokens `L`.
    pub fn tokens(&self) -> usize {
        self.tokens
    }
    /// [`PackMask::fingerprint`] of the uploaded pack.
    pub fn fingerprint(&self) -> u64 {
        self.fingerprint
    }
    /// [`PackMask::visible_pairs`] of the uploaded pack.
    pub fn visible_pairs(&self) -> u64 {
        self.visible_pairs
    }
    /// Device kv_end, `[tokens]`.
    pub fn kv_end(&self) -> &CudaSlice<u32> {
        &self.kv_end
    }
    /// Device position ids, `[tokens]`.
    pub fn position_ids(&self) -> &CudaSlice<u32> {
        &self.position_ids
    }
    /// Device per-key-tile min and max of kv_end, `[ceil(tokens / tile)]`
    /// (one unused element for an empty pack), and the tile size.
    pub fn tile_bounds(&self) -> (&CudaSlice<u32>, &CudaSlice<u32>, u32) {
        (&self.tile_kv_min, &self.tile_kv_max, self.tile)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_driver_is_an_error_not_a_panic() {
        let present = driver_present();
        match CudaBackend::new(0) {
            Ok(be) => assert!(present, "a backend without a driver: {:?}", be.describe()),
            Err(e) if !present => assert!(e.to_string().contains("no CUDA driver"), "{e}"),
            Err(e) => eprintln!("driver present, no usable device: {e}"),
        }
    }

    #[test]
    fn the_fatbin_and_report_are_embedded() {
        // A fatbin starts with its magic 0xBA55ED50 (little endian).
        assert_eq!(&FWD_FATBIN[..4], &[0x50, 0xed, 0x55, 0xba]);
        let fwd = launch::ATTN_VARIANTS.iter().flat_map(|&(dtype, d)| {
            let t = FwdTraits::for_head_dim(d as usize).unwrap();
            [t.kernel_name(dtype), t.kernel_name_var(dtype)]
        });
        for name in fwd.chain(["tree_attn_kv_tile_bounds".to_string()]) {
            assert!(
                PTXAS_REPORT.contains(name.as_str()),
                "{name} missing from the ptxas report"
            );
        }
        assert!(PTXAS_REPORT.contains("sm_80") && PTXAS_REPORT.contains("sm_90a"));
    }
}
