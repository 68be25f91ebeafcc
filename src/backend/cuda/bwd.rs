//! Attention backward on the device (`kernels/tree_attn_bwd.cu`), launched
//! on a [`super::CudaBackend`]'s stream.

use std::sync::Arc;

use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr,
    PushKernelArg,
};
use cudarc::nvrtc::Ptx;

use super::{config, cuda_err, Device};
use crate::backend::launch::bwd::{
    BwdBalance, BwdOptions, BwdParams, BwdProgram, BwdStage, BwdTraits, DqMode, MainKernel,
};
use crate::backend::launch::KernelElem;
use crate::backend::{BackwardCall, Grads};
use crate::{Error, Result};

/// The fatbin built from `kernels/tree_attn_bwd.cu` by build.rs.
static BWD_FATBIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/tree_attn_bwd.fatbin"));

// SAFETY: plain #[repr(C)] struct of integers, floats and device addresses,
// laid out exactly like `TreeAttnBwdParams`.
unsafe impl DeviceRepr for BwdParams {}

/// The stages of one backward call, in launch order where used.
const STAGES: [&str; 6] = [
    "pre",
    "main_atomic",
    "main_det",
    "dq",
    "dq_convert",
    "dkv_convert",
];

/// The variant kernels' stages (a window or key starts, a softcap, sinks),
/// in launch order where used: the one-m-tile main kernel, dQ, dsinks.
const VAR_STAGES: [&str; 4] = ["main_var_atomic", "main_var_det", "dq_var", "dsinks"];

/// The backward kernels, loaded by [`super::CudaBackend::new`].
#[derive(Clone)]
pub(crate) struct CudaBackward {
    pub(super) stream: Arc<CudaStream>,
    _module: Arc<CudaModule>,
    /// `[variant][stage]`: variants in the order of
    /// [`ATTN_VARIANTS`](crate::backend::launch::ATTN_VARIANTS), stages as in
    /// [`STAGES`].
    funcs: Vec<Vec<CudaFunction>>,
    /// `[variant]`: the two-m-tile main kernels (`main2_atomic`,
    /// `main2_det`) where they exist (d 64 and d 128).
    funcs2: Vec<Option<[CudaFunction; 2]>>,
    /// `[variant]`: the 4-warp two-m-tile main kernels (`main2w4_atomic`,
    /// `main2w4_det`) where they exist (d 64).
    funcs2w4: Vec<Option<[CudaFunction; 2]>>,
    /// `[variant][stage]`: the attention variants' kernels, stages as in
    /// [`VAR_STAGES`].
    funcs_var: Vec<Vec<CudaFunction>>,
    /// `[variant]`: the two-m-tile variant main kernels (`main2_var_atomic`,
    /// `main2_var_det`).
    funcs2_var: Vec<[CudaFunction; 2]>,
    /// The device's multiprocessors (the balanced launch's slots).
    sms: u32,
}

impl CudaBackward {
    /// Loads the embedded backward kernels on `be`'s device, raises their
    /// dynamic shared memory limits (up to 159,232 bytes: the d 128
    /// two-m-tile main kernel) and sets the maximum shared-memory carveout
    /// on every kernel that uses shared memory.
    pub(crate) fn new(ctx: &Arc<CudaContext>, stream: &Arc<CudaStream>) -> Result<Self> {
        let module = ctx
            .load_module(Ptx::from_binary(BWD_FATBIN.to_vec()))
            .map_err(cuda_err("loading the embedded backward kernels"))?;
        let mut funcs = Vec::new();
        let mut funcs2 = Vec::new();
        let mut funcs2w4 = Vec::new();
        let mut funcs_var = Vec::new();
        let mut funcs2_var = Vec::new();
        let load = |t: &BwdTraits, stage: &str, dtype| -> Result<CudaFunction> {
            let name = t.kernel_name(stage, dtype);
            let f = module
                .load_function(&name)
                .map_err(|e| Error::Cuda(format!("{name}: {e}")))?;
            let smem = match stage {
                "main_atomic" | "main_det" => t.main_smem_bytes(),
                "dq" => t.dq_smem_bytes(),
                "main_var_atomic" | "main_var_det" => t.main_smem_bytes_var(),
                "dq_var" => t.dq_smem_bytes_var(),
                _ => 0,
            };
            if smem > 48 * 1024 {
                f.set_attribute(
                    CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    smem as i32,
                )
                .map_err(|e| {
                    Error::Cuda(format!("{name}: raising shared memory to {smem}: {e}"))
                })?;
            }
            if smem > 0 {
                super::prefer_max_shared_carveout(&f, &name)?;
            }
            Ok(f)
        };
        for &(dtype, d) in crate::backend::launch::ATTN_VARIANTS {
            let t = BwdTraits::for_head_dim(d as usize)?;
            for (kernel, into) in [
                (MainKernel::TwoMTiles, &mut funcs2),
                (MainKernel::TwoMTilesFourWarps, &mut funcs2w4),
            ] {
                into.push(match BwdTraits::for_kernel(d as usize, kernel) {
                    Ok(t2) => Some([
                        load(&t2, "main_atomic", dtype)?,
                        load(&t2, "main_det", dtype)?,
                    ]),
                    Err(_) => None,
                });
            }
            let mut by_stage = Vec::new();
            for stage in STAGES {
                by_stage.push(load(&t, stage, dtype)?);
            }
            funcs.push(by_stage);
            funcs_var.push(
                VAR_STAGES
                    .iter()
                    .map(|stage| load(&t, stage, dtype))
                    .collect::<Result<Vec<_>>>()?,
            );
            let t2 = BwdTraits::for_kernel(d as usize, MainKernel::TwoMTiles)?;
            funcs2_var.push([
                load(&t2, "main_var_atomic", dtype)?,
                load(&t2, "main_var_det", dtype)?,
            ]);
        }
        let sms = ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(cuda_err("multiprocessor count"))?;
        Ok(CudaBackward {
            sms: sms.max(1) as u32,
            stream: stream.clone(),
            _module: module,
            funcs,
            funcs2,
            funcs2w4,
            funcs_var,
            funcs2_var,
        })
    }

    /// The loaded kernel of `stage` in `prog` for `variant` (an index
    /// into [`ATTN_VARIANTS`](crate::backend::launch::ATTN_VARIANTS)).
    fn function(
        &self,
        prog: &BwdProgram,
        stage: BwdStage,
        variant: usize,
    ) -> Result<&CudaFunction> {
        let det = usize::from(prog.mode == DqMode::Deterministic);
        let (plain, var) = (&self.funcs[variant], &self.funcs_var[variant]);
        let missing = |what: &str| {
            Error::Unsupported(format!(
                "internal: no {what} backward main kernel for this call ({:?}, variants {})",
                prog.traits.main_kernel, prog.variants
            ))
        };
        Ok(match (stage, prog.variants) {
            (BwdStage::Pre, _) => &plain[0],
            (BwdStage::Dsinks, _) => &var[3],
            (BwdStage::Main, false) => match prog.traits.main_kernel {
                MainKernel::OneMTile => &plain[1 + det],
                MainKernel::TwoMTiles => &self.funcs2[variant]
                    .as_ref()
                    .ok_or_else(|| missing("two-m-tile"))?[det],
                MainKernel::TwoMTilesFourWarps => &self.funcs2w4[variant]
                    .as_ref()
                    .ok_or_else(|| missing("4-warp"))?[det],
            },
            (BwdStage::Main, true) => match prog.traits.main_kernel {
                MainKernel::OneMTile => &var[det],
                MainKernel::TwoMTiles => &self.funcs2_var[variant][det],
                MainKernel::TwoMTilesFourWarps => return Err(missing("4-warp variant")),
            },
            (BwdStage::Dq, false) => &plain[3],
            (BwdStage::Dq, true) => &var[2],
            (BwdStage::DqConvert, _) => &plain[4],
            (BwdStage::DkvConvert, _) => &plain[5],
        })
    }

    /// Tree attention backward on the device (the math of
    /// [`crate::backend::AttentionBackend`]): from the forward's `o` and
    /// `lse` (f32) and `d_o`, writes every element of dq, dk, dv. The
    /// launches, the scratch and the item table are the [`BwdProgram`]'s
    /// (the emulator executes the same one): D and the f32 dQ accumulator,
    /// `4 · tokens · q_heads · (d + 1)` bytes, plus the f32 dK / dV
    /// partials, with group splits `8 · splits · tokens · kv_heads · d`
    /// bytes, in a balanced launch `8 · 128 · d` bytes per region (one per
    /// (split, range) of a cut key tile), allocated on the stream per call. `balanced`
    /// runs the balanced main launch ([`BwdBalance::Slots`] over this
    /// device's SMs × the main kernel's resident blocks) where the main
    /// kernel reads an item table. No rotary here
    /// (`CudaBackend::backward_with_mode` rotates around this call).
    /// Asynchronous on the backend's stream. A NaN or `+inf` in `lse`
    /// makes the gradients of its row NaN (never a silent 0);
    /// `params.check_finite` downloads and scans lse, q, k, v, o and d_o first
    /// and returns the emulator's `Err` instead (slow; for debugging).
    pub(crate) fn run<T: KernelElem + DeviceRepr>(
        &self,
        call: BackwardCall<'_, '_, '_, Device, T, f32>,
        mode: DqMode,
        kernel: Option<MainKernel>,
        balanced: bool,
    ) -> Result<()> {
        let (args, saved, d_o, grads) = call.into_parts();
        let (q, k, v, shape, pack) = (args.q(), args.k(), args.v(), args.shape(), args.mask());
        let params = args.params();
        let (o, lse) = (saved.o, saved.lse);
        let Grads {
            dq,
            dk,
            dv,
            mut dsinks,
        } = grads;
        let mut opts = BwdOptions {
            mode,
            kernel,
            ..BwdOptions::default()
        };
        let with_dsinks = dsinks.is_some();
        let mut prog =
            BwdProgram::new("CUDA kernels", &args, &pack.host_kv_end, with_dsinks, opts)?;
        let s = &self.stream;
        if params.check_finite {
            let lse_host = s
                .clone_dtoh(lse)
                .map_err(cuda_err("downloading lse for its check"))?;
            if let Some(index) = lse_host
                .iter()
                .position(|&x| x.is_nan() || x == f32::INFINITY)
            {
                return Err(Error::NonFinite {
                    what: "lse (NaN or +inf; −inf marks a row with no visible key)".into(),
                    index,
                });
            }
            for (name, x) in [("q", q), ("k", k), ("v", v), ("o", o), ("d_o", d_o)] {
                let h = s
                    .clone_dtoh(x)
                    .map_err(cuda_err("downloading for the finiteness check"))?;
                if let Some(index) = h.iter().position(|e| !e.to_f32().is_finite()) {
                    return Err(Error::NonFinite {
                        what: name.into(),
                        index,
                    });
                }
            }
        }
        if pack.tile != prog.traits.block_n {
            return Err(Error::Pack(format!(
                "pack tile bounds are for tiles of {} keys, the backward uses {}",
                pack.tile, prog.traits.block_n
            )));
        }
        if prog.stages.is_empty() {
            if let Some(ds) = dsinks {
                // No row: the sum over rows is 0.
                let zeros = vec![T::from_f32(0.0); ds.len()];
                s.memcpy_htod(&zeros[..], ds)
                    .map_err(cuda_err("zeroing dsinks"))?;
            }
            return Ok(());
        }
        let variant = crate::backend::launch::variant(T::DTYPE, prog.traits.head_dim)?;
        if balanced && prog.traits.main_kernel == MainKernel::TwoMTiles {
            let main = prog.plans.main;
            let per_sm = self
                .function(&prog, BwdStage::Main, variant)?
                .occupancy_max_active_blocks_per_multiprocessor(
                    main.block.0,
                    main.shared_mem_bytes as usize,
                    None,
                )
                .map_err(cuda_err("the backward main kernel's occupancy"))?;
            opts.balance = BwdBalance::Slots(self.sms as u64 * per_sm.max(1) as u64);
            prog = BwdProgram::new("CUDA kernels", &args, &pack.host_kv_end, with_dsinks, opts)?;
        }
        let starts = if prog.variants {
            super::starts::device_starts(
                s,
                pack,
                params.window,
                args.key_starts(),
                args.sinks().is_some(),
            )?
        } else {
            None
        };
        // SAFETY (both): every element is written before it is read — delta
        // by tree_attn_bwd_pre, the accumulator by pre (atomic mode) or by
        // tree_attn_bwd_dq (deterministic mode).
        let mut delta =
            unsafe { s.alloc::<f32>(prog.delta_len) }.map_err(cuda_err("allocating D"))?;
        let mut acc = unsafe { s.alloc::<f32>(prog.dq_accum_len) }
            .map_err(cuda_err("allocating the dQ accumulator"))?;
        // SAFETY: every element the kernels read is written first (the
        // program's rule: each group split's z-slice writes its slot for
        // every key row < tokens of its kv head, each balanced item its whole
        // region) before tree_attn_bwd_dkv_convert reads it. Without
        // partials a 1-element placeholder, null to the kernels.
        let mut dkv = unsafe { s.alloc::<f32>(prog.dkv_accum_len.max(1)) }
            .map_err(cuda_err("allocating the dK / dV partials"))?;
        let items = if prog.items.is_empty() {
            None
        } else {
            Some(
                s.clone_htod(&prog.items)
                    .map_err(cuda_err("uploading the backward's item table"))?,
            )
        };

        let (qp, _g0) = q.device_ptr(s);
        let (kp, _g1) = k.device_ptr(s);
        let (vp, _g2) = v.device_ptr(s);
        let (op, _g3) = o.device_ptr(s);
        let (dop, _g4) = d_o.device_ptr(s);
        let (lp, _g5) = lse.device_ptr(s);
        let (deltap, _g6) = delta.device_ptr_mut(s);
        let (accp, _g7) = acc.device_ptr_mut(s);
        let (dqp, _g8) = dq.device_ptr_mut(s);
        let (dkp, _g9) = dk.device_ptr_mut(s);
        let (dvp, _g10) = dv.device_ptr_mut(s);
        let (ep, _g11) = pack.kv_end.device_ptr(s);
        let (lo, _g12) = pack.tile_kv_min.device_ptr(s);
        let (hi, _g13) = pack.tile_kv_max.device_ptr(s);
        let (dkvp, _g14) = dkv.device_ptr_mut(s);
        let it = items.as_ref().map(|x| x.device_ptr(s));
        let st = starts.as_deref().map(|d| {
            (
                d.starts.device_ptr(s),
                d.tile_min.device_ptr(s),
                d.tile_max.device_ptr(s),
            )
        });
        let sk = args.sinks().map(|x| x.device_ptr(s));
        let dsk = dsinks.as_mut().map(|x| x.device_ptr_mut(s));
        let p = BwdParams {
            q: qp,
            k: kp,
            v: vp,
            o: op,
            d_o: dop,
            lse: lp,
            delta: deltap,
            dq_accum: accp,
            dq: dqp,
            dk: dkp,
            dv: dvp,
            kv_end: ep,
            tile_kv_min: lo,
            tile_kv_max: hi,
            dkv_accum: if prog.dkv_accum_len > 0 { dkvp } else { 0 },
            key_start: st.as_ref().map_or(0, |x| x.0 .0),
            start_tile_min: st.as_ref().map_or(0, |x| x.1 .0),
            start_tile_max: st.as_ref().map_or(0, |x| x.2 .0),
            sinks: sk.as_ref().map_or(0, |x| x.0),
            dsinks: dsk.as_ref().map_or(0, |x| x.0),
            items: it.as_ref().map_or(0, |x| x.0),
            tile_regions: it.as_ref().map_or(0, |x| x.0 + 4 * prog.regions_at as u64),
            ..prog.params(&shape, params)
        };
        for &(stage, plan) in &prog.stages {
            let f = self.function(&prog, stage, variant)?;
            let mut b = s.launch_builder(f);
            b.arg(&p);
            // SAFETY: every buffer was sized against the call's shape and
            // pack (`AttnArgs`, `BackwardCall`), the scratch and the item
            // table from the program here, the key starts by
            // `device_starts`, the sinks by `AttnArgs::with_sinks`; the
            // kernels stay inside them.
            unsafe { b.launch(config(plan)) }.map_err(|e| {
                Error::Cuda(format!(
                    "launching {}: {e}",
                    prog.traits
                        .kernel_name(stage.name(prog.mode, prog.variants), T::DTYPE)
                ))
            })?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cuda::PTXAS_REPORT;

    #[test]
    fn the_backward_and_sdcc_fatbins_are_embedded() {
        // A fatbin starts with its magic 0xBA55ED50 (little endian).
        assert_eq!(&BWD_FATBIN[..4], &[0x50, 0xed, 0x55, 0xba]);
        for &(dtype, d) in crate::backend::launch::ATTN_VARIANTS {
            let t = BwdTraits::for_head_dim(d as usize).unwrap();
            for stage in STAGES.iter().chain(&VAR_STAGES) {
                let name = t.kernel_name(stage, dtype);
                assert!(
                    PTXAS_REPORT.contains(&name),
                    "{name} missing from the ptxas report"
                );
            }
            // The two-m-tile main kernels (d 64 and d 128; the 4-warp one d
            // 64 only).
            for kernel in [MainKernel::TwoMTiles, MainKernel::TwoMTilesFourWarps] {
                let Ok(t2) = BwdTraits::for_kernel(d as usize, kernel) else {
                    assert!(kernel == MainKernel::TwoMTilesFourWarps && d != 64);
                    continue;
                };
                let var: &[&str] = if kernel == MainKernel::TwoMTiles {
                    &["main_var_atomic", "main_var_det"]
                } else {
                    &[]
                };
                for stage in ["main_atomic", "main_det"].iter().chain(var) {
                    let name = t2.kernel_name(stage, dtype);
                    assert!(
                        name.contains("main2") && PTXAS_REPORT.contains(&name),
                        "{name} missing from the ptxas report"
                    );
                }
            }
        }
        for name in ["sdcc_kl_bf16", "sdcc_kl_f16", "sdcc_kl_f32"] {
            assert!(
                PTXAS_REPORT.contains(name),
                "{name} missing from the ptxas report"
            );
        }
    }
}
