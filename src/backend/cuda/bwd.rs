//! Attention backward on the device (`kernels/tree_attn_bwd.cu`), launched
//! on a [`super::CudaBackend`]'s stream.

use std::sync::Arc;

use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr,
    PushKernelArg,
};
use cudarc::nvrtc::Ptx;

use super::{config, cuda_err, Device};
use crate::backend::launch::bwd::{
    plan_backward_var, plan_backward_with_kernel, BwdParams, BwdTraits, DqMode, MainKernel,
};
use crate::backend::launch::{check_kernel_call, scale_log2, softcap_args, KernelElem, LaunchPlan};
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
        Ok(CudaBackward {
            stream: stream.clone(),
            _module: module,
            funcs,
            funcs2,
            funcs2w4,
            funcs_var,
            funcs2_var,
        })
    }

    /// Tree attention backward on the device (the math of
    /// [`crate::backend::AttentionBackend`]): from the forward's `o` and
    /// `lse` (f32) and `d_o`, writes every element of dq, dk, dv. Scratch (D
    /// and the f32 dQ accumulator, `4 · tokens · q_heads · (d + 1)` bytes,
    /// plus, when the plan splits the GQA group over grid.z, the f32 dK / dV
    /// partials, `8 · splits · tokens · kv_heads · d` bytes) is allocated on
    /// the stream per call. No rotary here
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
        let var = check_kernel_call("CUDA kernels", &args)?;
        let (traits, plans) = if var {
            plan_backward_var(&shape, None, kernel, params.softcap.is_some())?
        } else {
            plan_backward_with_kernel(&shape, kernel)?
        };
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
        if pack.tile != traits.block_n {
            return Err(Error::Pack(format!(
                "pack tile bounds are for tiles of {} keys, the backward uses {}",
                pack.tile, traits.block_n
            )));
        }
        if shape.tokens == 0 {
            if let Some(ds) = dsinks {
                // No row: the sum over rows is 0.
                let zeros = vec![T::from_f32(0.0); ds.len()];
                s.memcpy_htod(&zeros[..], ds)
                    .map_err(cuda_err("zeroing dsinks"))?;
            }
            return Ok(());
        }
        if params.rope.is_some() {
            return Err(Error::Unsupported(
                "internal: rotary reached the rotary-free backward kernels".into(),
            ));
        }
        let starts = if var {
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
        let mut delta = unsafe { s.alloc::<f32>(shape.q_heads * shape.tokens) }
            .map_err(cuda_err("allocating D"))?;
        let mut acc = unsafe { s.alloc::<f32>(shape.q_len()) }
            .map_err(cuda_err("allocating the dQ accumulator"))?;
        // SAFETY: with group splits > 1 every element is written by the main
        // kernel's z-slices (each writes its slice for every key row < tokens
        // of its kv head) before tree_attn_bwd_dkv_convert reads it. With
        // one split it is never touched: a 1-element placeholder, null to the
        // kernels.
        let split = plans.group_splits > 1;
        let mut dkv = unsafe { s.alloc::<f32>(plans.dkv_accum_len(&shape).max(1)) }
            .map_err(cuda_err("allocating the dK / dV partials"))?;

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
        let st = starts.as_deref().map(|d| {
            (
                d.starts.device_ptr(s),
                d.tile_min.device_ptr(s),
                d.tile_max.device_ptr(s),
            )
        });
        let sk = args.sinks().map(|x| x.device_ptr(s));
        let dsk = dsinks.as_mut().map(|x| x.device_ptr_mut(s));
        let (softcap_c, softcap_in) = softcap_args(params);
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
            dkv_accum: if split { dkvp } else { 0 },
            tokens: shape.tokens as u32,
            q_heads: shape.q_heads as u32,
            kv_heads: shape.kv_heads as u32,
            num_key_tiles: pack.num_tiles as u32,
            scale: params.softmax_scale as f32,
            scale_log2: scale_log2(params),
            head_dim: traits.head_dim,
            zero_dq_accum: u32::from(mode == DqMode::Atomic),
            group_splits: plans.group_splits,
            dkv_slots: 0,
            key_start: st.as_ref().map_or(0, |x| x.0 .0),
            start_tile_min: st.as_ref().map_or(0, |x| x.1 .0),
            start_tile_max: st.as_ref().map_or(0, |x| x.2 .0),
            sinks: sk.as_ref().map_or(0, |x| x.0),
            dsinks: dsk.as_ref().map_or(0, |x| x.0),
            softcap_c,
            softcap_in,
            items: 0,
        };
        if var {
            return self.launch_var::<T>(&p, &traits, &plans, mode, dsk.is_some());
        }
        let mut stages: Vec<(usize, LaunchPlan)> = match mode {
            DqMode::Atomic => vec![(0, plans.per_row), (1, plans.main), (4, plans.per_row)],
            DqMode::Deterministic => vec![
                (0, plans.per_row),
                (2, plans.main),
                (3, plans.dq),
                (4, plans.per_row),
            ],
        };
        if split {
            stages.push((5, plans.dkv_convert));
        }
        let variant = crate::backend::launch::variant(T::DTYPE, traits.head_dim)?;
        let by_stage = &self.funcs[variant];
        for &(stage, plan) in &stages {
            let two = match traits.main_kernel {
                MainKernel::TwoMTiles => Some(&self.funcs2[variant]),
                MainKernel::TwoMTilesFourWarps => Some(&self.funcs2w4[variant]),
                MainKernel::OneMTile => None,
            };
            let f = match (two, stage) {
                (Some(Some(two)), 1 | 2) => &two[stage - 1],
                (Some(None), 1 | 2) => {
                    return Err(Error::Unsupported(
                        "internal: no two-m-tile backward main kernel for this variant".into(),
                    ))
                }
                _ => &by_stage[stage],
            };
            let mut b = s.launch_builder(f);
            b.arg(&p);
            // SAFETY: every buffer was sized against `shape` and the pack
            // above (scratch allocated here); the kernels stay inside them.
            unsafe { b.launch(config(plan)) }.map_err(|e| {
                Error::Cuda(format!(
                    "launching {}: {e}",
                    traits.kernel_name(STAGES[stage], T::DTYPE)
                ))
            })?;
        }
        Ok(())
    }

    /// The launches of a call with attention variants: pre (D), dsinks
    /// when asked for, the variant main kernel (two m-tiles or one, as
    /// [`MainKernel::for_variants`] chose), in deterministic mode the
    /// variant dQ kernel, the dQ conversion and with group splits the dK /
    /// dV one.
    fn launch_var<T: KernelElem>(
        &self,
        p: &BwdParams,
        traits: &BwdTraits,
        plans: &crate::backend::launch::bwd::BwdPlans,
        mode: DqMode,
        dsinks: bool,
    ) -> Result<()> {
        let variant = crate::backend::launch::variant(T::DTYPE, traits.head_dim)?;
        let (plain, var) = (&self.funcs[variant], &self.funcs_var[variant]);
        let det = usize::from(mode == DqMode::Deterministic);
        let main = match traits.main_kernel {
            MainKernel::TwoMTiles => &self.funcs2_var[variant][det],
            MainKernel::OneMTile => &var[det],
            MainKernel::TwoMTilesFourWarps => {
                return Err(Error::Unsupported(
                    "internal: no 4-warp backward main kernel for the attention variants".into(),
                ))
            }
        };
        let main_name = if det == 1 {
            "main_var_det"
        } else {
            "main_var_atomic"
        };
        let mut stages: Vec<(&CudaFunction, &str, LaunchPlan)> =
            vec![(&plain[0], "pre", plans.per_row)];
        if dsinks {
            stages.push((&var[3], "dsinks", plans.dsinks));
        }
        stages.push((main, main_name, plans.main));
        if det == 1 {
            stages.push((&var[2], "dq_var", plans.dq));
        }
        stages.push((&plain[4], "dq_convert", plans.per_row));
        if plans.group_splits > 1 {
            stages.push((&plain[5], "dkv_convert", plans.dkv_convert));
        }
        let s = &self.stream;
        for (f, name, plan) in stages {
            let mut b = s.launch_builder(f);
            b.arg(p);
            // SAFETY: every buffer was sized against the call's shape and
            // pack by `run` (scratch allocated there, the key starts by
            // `device_starts`, the sinks by `AttnArgs::with_sinks`); the
            // kernels stay inside them.
            unsafe { b.launch(config(plan)) }.map_err(|e| {
                Error::Cuda(format!(
                    "launching {}: {e}",
                    traits.kernel_name(name, T::DTYPE)
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
