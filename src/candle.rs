//! Tree attention as a candle op (feature `candle`, candle-core 0.11): a
//! thin adapter over the backend contract ([`crate::backend`]) that candle's
//! autograd differentiates.
//!
//! [`tree_attention`] takes q `[L, Hq, d]`, k `[L, Hkv, d]` and v `[L, Hkv,
//! dv]` (the contract's layout, `Hkv` dividing `Hq`; `dv` may differ from
//! `d`: multi-head latent attention), the pack's [`PackMask`] and the
//! [`AttnParams`] (softmax scale, rotary at the pack's position ids, a
//! sliding window of tree levels, a logit softcap), and returns O `[L, Hq,
//! dv]`; [`tree_attention_with_sinks`] adds learnable attention sinks
//! `[Hq]` (gpt-oss), whose gradient candle's backward returns. It is a
//! [`CustomOp3`]: the forward runs the CPU
//! backend ([`Cpu::default`], so [`crate::backend::cpu::set_default_threads`]
//! applies) in f32 or f64, and on bf16 / f16 tensors as they are (widened
//! exactly, computed in f32, rounded once as stored); the LSE it computes is
//! kept in the op, so the backward (candle's `backward()` reaches the op's
//! `bwd`) runs the contract's backward without a second forward, and yields
//! dQ, dK, dV. With the feature `candle-cuda`, CUDA tensors (bf16 / f16,
//! head dim 64 or 128) run the crate's kernels on candle's device stream
//! (`cuda_fwd`; the backward runs the device backward with the kept f32
//! LSE), the window, softcap and sinks included; the kernels are loaded
//! once per CUDA context. f32 / f64 CUDA
//! tensors are an error (cast them: nothing is cast silently). The CUDA
//! backward sums dQ with atomic adds (as FlashAttention-2/3) unless
//! [`TreeAttentionOptions::deterministic`] asks for the deterministic dQ
//! kernel ([`tree_attention_with`]); on the CPU the op is deterministic
//! either way.
//!
//! The mask is planned once per pack ([`crate::plan::MaskPlan`]): the op
//! keeps the plan for its backward, [`tree_attention`] reuses the plan of
//! the last pack it saw when it is given the same mask again (every layer of
//! a model), and [`tree_attention_plan`] takes a plan the caller holds. On
//! CUDA the plan's device copy is uploaded by its first call and shared by
//! the others (no copy, no synchronization per layer).
//!
//! ```
//! use candle_core::{Device, Tensor, Var};
//! use treeattn::backend::AttnParams;
//! use treeattn::mask::PackMask;
//!
//! // Two branches sharing a one-token trunk.
//! let (kv_end, pos) = ([3u32, 2, 3], [0u32, 1, 1]);
//! let mask = PackMask::new(&kv_end, &pos)?;
//! let q = Var::from_tensor(&Tensor::randn(0f32, 1.0, (3, 2, 4), &Device::Cpu)?)?;
//! let kv = Tensor::randn(0f32, 1.0, (3, 1, 4), &Device::Cpu)?;
//! let o = treeattn::candle::tree_attention(&q, &kv, &kv, &mask, &AttnParams::new(4))?;
//! assert_eq!(o.dims(), &[3, 2, 4]);
//! let grads = o.sum_all()?.backward()?;
//! assert_eq!(grads.get(&q).unwrap().dims(), &[3, 2, 4]);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::sync::{Arc, Mutex, PoisonError};

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, DType, Layout, Shape, Tensor};

use crate::backend::cpu::{Cpu, CpuElement};
use crate::backend::{AttnArgs, AttnOut, AttnParams, AttnShape, HostAttention};
use crate::mask::PackMask;
use crate::plan::MaskPlan;

/// Tree attention on a pack as a differentiable candle op; see the module
/// docs. Errors (as `candle_core::Error`, the message of the crate's
/// [`crate::Error`]): q, k, v not 3-D or not `[L, Hq, d]`, `[L, Hkv, d]`,
/// `[L, Hkv, dv]` with `L` the mask's tokens, different dtypes, a dtype
/// other than f32 / f64 / bf16 / f16, tensors not on the CPU, and every
/// error of [`AttnArgs::new`].
pub fn tree_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &PackMask<'_>,
    params: &AttnParams,
) -> candle_core::Result<Tensor> {
    tree_attention_plan(q, k, v, &plan_for(*mask), params)
}

/// The plan of `mask`, cached per pack: the plan [`tree_attention`] built
/// last when `mask` is the same pack (compared element by element, `O(L)`),
/// else a new one, which becomes the cached one. One process-wide entry:
/// the layers of a model's forward and backward all hit it.
pub fn plan_for(mask: PackMask<'_>) -> Arc<MaskPlan> {
    static LAST: Mutex<Option<Arc<MaskPlan>>> = Mutex::new(None);
    let mut last = LAST.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(plan) = last.as_ref().filter(|p| p.is_of(mask)) {
        return plan.clone();
    }
    let plan = Arc::new(MaskPlan::from_mask(mask));
    *last = Some(plan.clone());
    plan
}

/// [`tree_attention`] on a pack's plan the caller holds (build it once per
/// pack with [`MaskPlan::new`] and pass it to every layer): the mask is not
/// checked, copied or, on CUDA, uploaded again.
pub fn tree_attention_plan(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    plan: &Arc<MaskPlan>,
    params: &AttnParams,
) -> candle_core::Result<Tensor> {
    tree_attention_with(q, k, v, None, plan, params, TreeAttentionOptions::default())
}

/// [`tree_attention_plan`] with attention sinks `[Hq]` (one logit per query
/// head joining each row's softmax denominator, with no value: gpt-oss),
/// of q's dtype, differentiable: candle's backward returns their gradient
/// with dQ, dK, dV. CPU tensors and, with the feature `candle-cuda`, CUDA
/// tensors (bf16 / f16: the kernels compute the sinks and their gradient).
/// (k and v go to the op as one flat tensor, candle's three-input op
/// holding q, K‖V and the sinks; candle's autograd splits the gradient
/// back.)
pub fn tree_attention_with_sinks(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    sinks: &Tensor,
    plan: &Arc<MaskPlan>,
    params: &AttnParams,
) -> candle_core::Result<Tensor> {
    tree_attention_with(
        q,
        k,
        v,
        Some(sinks),
        plan,
        params,
        TreeAttentionOptions::default(),
    )
}

/// What the op takes beyond the contract's [`AttnParams`]
/// ([`tree_attention_with`]); the default is what the other entries use.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TreeAttentionOptions {
    /// On CUDA tensors, the backward sums dQ with the deterministic kernel
    /// (no atomics: dQ bit-identical from run to run, more backward time;
    /// [`crate::backend::launch::bwd::DqMode::Deterministic`]) instead of
    /// atomic adds (`false`, the default, as FlashAttention's
    /// `deterministic=False`: faster, the last bits of dQ vary from run to
    /// run within the kernels' tolerances). dK, dV and the sinks' gradient
    /// are deterministic either way, and so is everything on the CPU, where
    /// it changes nothing.
    pub deterministic: bool,
}

/// The one entry behind [`tree_attention_plan`] and
/// [`tree_attention_with_sinks`]: q, k, v on the pack's `plan`, with
/// attention sinks `[Hq]` when given (differentiable, as
/// [`tree_attention_with_sinks`]), and `options` (the CUDA backward's dQ
/// mode). Errors as theirs.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use treeattn::backend::AttnParams;
/// use treeattn::candle::{plan_for, tree_attention_with, TreeAttentionOptions};
/// use treeattn::mask::PackMask;
///
/// let (kv_end, pos) = ([3u32, 2, 3], [0u32, 1, 1]);
/// let plan = plan_for(PackMask::new(&kv_end, &pos)?);
/// let q = Tensor::randn(0f32, 1.0, (3, 2, 4), &Device::Cpu)?;
/// let kv = Tensor::randn(0f32, 1.0, (3, 1, 4), &Device::Cpu)?;
/// let det = TreeAttentionOptions { deterministic: true };
/// let o = tree_attention_with(&q, &kv, &kv, None, &plan, &AttnParams::new(4), det)?;
/// assert_eq!(o.dims(), &[3, 2, 4]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn tree_attention_with(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    sinks: Option<&Tensor>,
    plan: &Arc<MaskPlan>,
    params: &AttnParams,
    options: TreeAttentionOptions,
) -> candle_core::Result<Tensor> {
    let Some(sinks) = sinks else {
        let mut op = TreeAttention::new(q, k, v, plan, params, Inputs::Separate)?;
        op.options = options;
        return q
            .contiguous()?
            .apply_op3(&k.contiguous()?, &v.contiguous()?, op);
    };
    let k_len = k.elem_count();
    let mut op = TreeAttention::new(q, k, v, plan, params, Inputs::Packed { k_len })?;
    op.options = options;
    if sinks.dims() != [op.shape.q_heads] || sinks.dtype() != q.dtype() {
        return Err(err(crate::Error::Shape(format!(
            "sinks are {:?} {:?}, expected [{}] of q's dtype {:?} (one logit per query head)",
            sinks.dims(),
            sinks.dtype(),
            op.shape.q_heads,
            q.dtype()
        ))));
    }
    let kv = Tensor::cat(&[k.flatten_all()?, v.flatten_all()?], 0)?;
    q.contiguous()?.apply_op3(&kv, &sinks.contiguous()?, op)
}

impl TreeAttention {
    /// The op for q, k, v on `plan`, checked: shapes, dtypes, parameters.
    fn new(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        plan: &Arc<MaskPlan>,
        params: &AttnParams,
        inputs: Inputs,
    ) -> candle_core::Result<Self> {
        let mask = plan.mask();
        let (tokens, q_heads, head_dim) = q.dims3()?;
        let (_, kv_heads, _) = k.dims3()?;
        let v_head_dim = v.dims().get(2).copied().unwrap_or(0);
        let shape = AttnShape {
            tokens,
            q_heads,
            kv_heads,
            head_dim,
            v_head_dim,
        };
        for (what, t, want) in [
            ("k", k, (tokens, kv_heads, head_dim)),
            ("v", v, (tokens, kv_heads, v_head_dim)),
        ] {
            if t.dims3()? != want {
                return Err(err(crate::Error::Shape(format!(
                    "{what} is {:?}, expected [{}, {}, {}] (like q: [tokens, kv_heads, head_dim])",
                    t.dims(),
                    want.0,
                    want.1,
                    want.2
                ))));
            }
        }
        if k.dtype() != q.dtype() || v.dtype() != q.dtype() {
            return Err(err(crate::Error::Unsupported(format!(
                "q, k, v dtypes {:?}, {:?}, {:?} differ",
                q.dtype(),
                k.dtype(),
                v.dtype()
            ))));
        }
        // Sizes and parameters are checked here, before candle runs the op (a
        // PackMask is valid by construction).
        shape.validate().map_err(err)?;
        params.validate(&shape).map_err(err)?;
        if mask.len() != tokens {
            return Err(err(crate::Error::Pack(format!(
                "the mask has {} tokens but q has {tokens}",
                mask.len()
            ))));
        }
        Ok(TreeAttention {
            plan: plan.clone(),
            shape,
            params: *params,
            inputs,
            options: TreeAttentionOptions::default(),
            lse: Mutex::new(None),
        })
    }
}

fn err(e: crate::Error) -> candle_core::Error {
    candle_core::Error::Msg(e.to_string())
}

/// The LSE the forward computed, in its compute type.
enum Lse {
    F32(Vec<f32>),
    F64(Vec<f64>),
    /// The CUDA forward's, `[q_heads, tokens]` f32 on the device.
    #[cfg(feature = "candle-cuda")]
    Device(cudarc::driver::CudaSlice<f32>),
}

/// What the op's three candle inputs hold.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Inputs {
    /// q, k, v.
    Separate,
    /// q, k and v flattened one after the other (`k_len` elements of k),
    /// and the sinks.
    Packed { k_len: usize },
}

/// The op: the pack's plan (shared; candle keeps the op until the
/// backward), the sizes, the parameters, what its inputs hold, the
/// options and the forward's LSE.
struct TreeAttention {
    plan: Arc<MaskPlan>,
    shape: AttnShape,
    params: AttnParams,
    inputs: Inputs,
    options: TreeAttentionOptions,
    lse: Mutex<Option<Lse>>,
}

/// A contiguous tensor's elements on the CPU (the op made them contiguous).
fn host<'a, T>(data: &'a [T], l: &Layout, what: &str) -> candle_core::Result<&'a [T]> {
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&data[a..b]),
        None => candle_core::bail!("tree_attention: {what} is not contiguous"),
    }
}

impl TreeAttention {
    /// The contract's arguments from the op's three inputs (`b`, `c`: k
    /// and v, or K‖V and the sinks).
    fn args<'a, S: CpuElement>(
        &'a self,
        q: &'a [S],
        b: &'a [S],
        c: &'a [S],
    ) -> candle_core::Result<AttnArgs<'a, crate::backend::Host, S>> {
        let (k, v, sinks) = match self.inputs {
            Inputs::Separate => (b, c, None),
            Inputs::Packed { k_len } => (&b[..k_len], &b[k_len..], Some(c)),
        };
        let args =
            AttnArgs::new(q, k, v, self.shape, self.plan.mask(), self.params).map_err(err)?;
        match sinks {
            Some(sinks) => args.with_sinks(sinks).map_err(err),
            None => Ok(args),
        }
    }

    /// O in the inputs' type, the LSE in the compute type (f32 for bf16 and
    /// f16: the CPU backend takes them as they are).
    fn forward<S: CpuElement>(
        &self,
        q: &[S],
        b: &[S],
        c: &[S],
    ) -> candle_core::Result<AttnOut<S, S::Compute>> {
        Cpu::default()
            .forward_owned(&self.args(q, b, c)?)
            .map_err(err)
    }

    /// The gradients of the op's three inputs in the tensors' type `S`
    /// (dQ, dK, dV; or dQ, dK‖dV, dsinks), from host copies of the
    /// tensors, with the kept LSE (or a recomputed one).
    fn grads<S: CpuElement + candle_core::WithDType>(
        &self,
        t: [&Tensor; 5],
        kept: Option<Vec<S::Compute>>,
    ) -> candle_core::Result<[Vec<S>; 3]> {
        let [q, b, c, o, d_o] = t.map(|x| x.flatten_all().and_then(|x| x.to_vec1::<S>()));
        let (q, b, c, o, d_o) = (q?, b?, c?, o?, d_o?);
        let args = self.args(&q, &b, &c)?;
        let lse = match kept {
            Some(lse) => lse,
            None => self.forward(&q, &b, &c)?.lse,
        };
        let fwd = AttnOut { o, lse };
        let g = Cpu::default()
            .backward_owned(&args, fwd.saved(), &d_o)
            .map_err(err)?;
        Ok(match self.inputs {
            Inputs::Separate => [g.dq, g.dk, g.dv],
            Inputs::Packed { .. } => {
                let mut dkv = g.dk;
                dkv.extend(g.dv);
                [g.dq, dkv, g.dsinks.unwrap_or_default()]
            }
        })
    }

    /// The shapes of the op's three inputs.
    fn input_dims(&self) -> [Vec<usize>; 3] {
        let s = self.shape;
        match self.inputs {
            Inputs::Separate => [
                vec![s.tokens, s.q_heads, s.head_dim],
                vec![s.tokens, s.kv_heads, s.head_dim],
                vec![s.tokens, s.kv_heads, s.v_head_dim],
            ],
            Inputs::Packed { .. } => [
                vec![s.tokens, s.q_heads, s.head_dim],
                vec![s.kv_len() + s.v_len()],
                vec![s.q_heads],
            ],
        }
    }
}

impl CustomOp3 for TreeAttention {
    fn name(&self) -> &'static str {
        "treeattn-tree-attention"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let out_shape =
            Shape::from_dims(&[self.shape.tokens, self.shape.q_heads, self.shape.v_head_dim]);
        let (storage, lse) = match (s1, s2, s3) {
            (CpuStorage::F32(q), CpuStorage::F32(k), CpuStorage::F32(v)) => {
                let f = self.forward(host(q, l1, "q")?, host(k, l2, "k")?, host(v, l3, "v")?)?;
                (CpuStorage::F32(f.o), Lse::F32(f.lse))
            }
            (CpuStorage::F64(q), CpuStorage::F64(k), CpuStorage::F64(v)) => {
                let f = self.forward(host(q, l1, "q")?, host(k, l2, "k")?, host(v, l3, "v")?)?;
                (CpuStorage::F64(f.o), Lse::F64(f.lse))
            }
            (CpuStorage::BF16(q), CpuStorage::BF16(k), CpuStorage::BF16(v)) => {
                let f = self.forward(host(q, l1, "q")?, host(k, l2, "k")?, host(v, l3, "v")?)?;
                (CpuStorage::BF16(f.o), Lse::F32(f.lse))
            }
            (CpuStorage::F16(q), CpuStorage::F16(k), CpuStorage::F16(v)) => {
                let f = self.forward(host(q, l1, "q")?, host(k, l2, "k")?, host(v, l3, "v")?)?;
                (CpuStorage::F16(f.o), Lse::F32(f.lse))
            }
            // f32, f64, bf16 and f16 are the CPU op's dtypes.
            _ => {
                return Err(candle_core::Error::UnsupportedDTypeForOp(s1.dtype(), self.name()).bt())
            }
        };
        *self.lse.lock().unwrap_or_else(|e| e.into_inner()) = Some(lse);
        Ok((storage, out_shape))
    }

    #[cfg(feature = "candle-cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let out_shape =
            Shape::from_dims(&[self.shape.tokens, self.shape.q_heads, self.shape.v_head_dim]);
        let (o, lse) = match s1.dtype() {
            DType::BF16 => device::forward::<half::bf16>(self, [(s1, l1), (s2, l2), (s3, l3)])?,
            DType::F16 => device::forward::<half::f16>(self, [(s1, l1), (s2, l2), (s3, l3)])?,
            // The CUDA kernels take bf16 or f16 (cast q, k, v).
            other => {
                return Err(candle_core::Error::UnsupportedDTypeForOp(other, self.name()).bt())
            }
        };
        *self.lse.lock().unwrap_or_else(|e| e.into_inner()) = Some(Lse::Device(lse));
        Ok((o, out_shape))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let kept = self.lse.lock().unwrap_or_else(|e| e.into_inner()).take();
        #[cfg(feature = "candle-cuda")]
        if q.device().is_cuda() {
            let [dq, dk, dv] = device::backward(self, [q, k, v, res, grad_res], kept)?;
            return Ok((Some(dq), Some(dk), Some(dv)));
        }
        let t = [q, k, v, res, grad_res];
        let dev = q.device();
        let dims = self.input_dims();
        let (f32_lse, f64_lse) = match kept {
            Some(Lse::F32(l)) => (Some(l), None),
            Some(Lse::F64(l)) => (None, Some(l)),
            _ => (None, None),
        };
        let [dq, dk, dv] = match q.dtype() {
            DType::F64 => tensors(self.grads::<f64>(t, f64_lse)?, dims, dev)?,
            DType::F32 => tensors(self.grads::<f32>(t, f32_lse)?, dims, dev)?,
            DType::BF16 => tensors(self.grads::<half::bf16>(t, f32_lse)?, dims, dev)?,
            DType::F16 => tensors(self.grads::<half::f16>(t, f32_lse)?, dims, dev)?,
            other => {
                return Err(candle_core::Error::UnsupportedDTypeForOp(other, self.name()).bt())
            }
        };
        Ok((Some(dq), Some(dk), Some(dv)))
    }
}

/// Gradients as tensors of the inputs' shapes and device (and dtype: `T`).
fn tensors<T: candle_core::WithDType>(
    g: [Vec<T>; 3],
    dims: [Vec<usize>; 3],
    dev: &candle_core::Device,
) -> candle_core::Result<[Tensor; 3]> {
    let [a, b, c] = g;
    let [da, db, dc] = dims;
    let t = |g: Vec<T>, d: Vec<usize>| Tensor::from_vec(g, d, dev);
    Ok([t(a, da)?, t(b, db)?, t(c, dc)?])
}

/// The op on CUDA tensors: the crate's kernels on candle's device stream,
/// through the borrowed-pointer entries of [`crate::backend::cuda::host`]
/// (candle keeps ownership of every buffer it gave; the outputs are fresh
/// candle buffers).
#[cfg(feature = "candle-cuda")]
mod device {
    use std::collections::HashMap;
    use std::sync::{Arc, Mutex};

    use candle_core::backend::BackendStorage;
    use candle_core::cuda::CudaDType;
    use candle_core::op::BackpropOp;
    use candle_core::{CudaDevice, CudaStorage, Layout, Storage, Tensor};
    use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr};

    use super::{err, Inputs, Lse, TreeAttention};
    use crate::backend::cuda::host::RawAttention;
    use crate::backend::cuda::{CudaBackend, DevicePack, DqMode};
    use crate::backend::launch::KernelElem;

    /// The kernels for `stream`'s context (loaded once per context),
    /// launching on `stream`.
    fn backend(stream: &Arc<CudaStream>) -> candle_core::Result<CudaBackend> {
        static LOADED: Mutex<Option<HashMap<usize, CudaBackend>>> = Mutex::new(None);
        let key = stream.context().cu_ctx() as usize;
        let mut guard = LOADED.lock().unwrap_or_else(|p| p.into_inner());
        let map = guard.get_or_insert_with(HashMap::new);
        let be = match map.get(&key) {
            Some(be) => be.on_stream(stream),
            None => {
                let be = CudaBackend::with_stream(stream);
                if let Ok(be) = &be {
                    map.insert(key, be.clone());
                }
                be
            }
        };
        be.map_err(err)
    }

    /// The plan's device copy: uploaded by its first call on this context,
    /// then shared (no copy, no synchronization).
    fn upload(op: &TreeAttention, be: &CudaBackend) -> candle_core::Result<Arc<DevicePack>> {
        op.plan.on_device(be).map_err(err)
    }

    /// The device address of a contiguous candle buffer's first element.
    fn address<T: CudaDType + DeviceRepr>(
        s: &CudaStorage,
        l: &Layout,
        stream: &CudaStream,
        what: &str,
    ) -> candle_core::Result<u64> {
        let Some((a, b)) = l.contiguous_offsets() else {
            candle_core::bail!("tree_attention: {what} is not contiguous")
        };
        let view = s.as_cuda_slice::<T>()?.slice(a..b);
        let (ptr, _sync) = view.device_ptr(stream);
        Ok(ptr)
    }

    /// The addresses of q, k, v and the sinks (0 for none) in the op's
    /// three inputs: q, k, v; or q, K‖V (k's `k_len` elements, then v's)
    /// and the sinks.
    fn addresses<T: CudaDType + DeviceRepr>(
        op: &TreeAttention,
        inputs: [(&CudaStorage, &Layout); 3],
        stream: &CudaStream,
    ) -> candle_core::Result<[u64; 4]> {
        let [(qs, ql), (bs, bl), (cs, cl)] = inputs;
        let q = address::<T>(qs, ql, stream, "q")?;
        Ok(match op.inputs {
            Inputs::Separate => [
                q,
                address::<T>(bs, bl, stream, "k")?,
                address::<T>(cs, cl, stream, "v")?,
                0,
            ],
            Inputs::Packed { k_len } => {
                let kv = address::<T>(bs, bl, stream, "k and v")?;
                let v = kv + (k_len * std::mem::size_of::<T>()) as u64;
                [q, kv, v, address::<T>(cs, cl, stream, "sinks")?]
            }
        })
    }

    fn out_ptr<T>(s: &mut CudaSlice<T>, stream: &CudaStream) -> u64 {
        let (ptr, _sync) = s.device_ptr_mut(stream);
        ptr
    }

    fn alloc<T: DeviceRepr>(dev: &CudaDevice, n: usize) -> candle_core::Result<CudaSlice<T>> {
        // SAFETY: the kernels write every element before anyone reads it
        // (the contract's outputs are written in full).
        unsafe { dev.alloc::<T>(n) }
    }

    /// O (a fresh candle buffer) and the f32 LSE of the forward.
    pub(super) fn forward<T: KernelElem + CudaDType + DeviceRepr>(
        op: &TreeAttention,
        inputs: [(&CudaStorage, &Layout); 3],
    ) -> candle_core::Result<(CudaStorage, CudaSlice<f32>)> {
        let dev = inputs[0].0.device().clone();
        let stream = dev.cuda_stream();
        let be = backend(&stream)?;
        let pack = upload(op, &be)?;
        let s = op.shape;
        let [q, k, v, sinks] = addresses::<T>(op, inputs, &stream)?;
        let mut o = alloc::<T>(&dev, s.o_len())?;
        let mut lse = alloc::<f32>(&dev, s.lse_len())?;
        let call = RawAttention {
            q,
            k,
            v,
            sinks,
            key_starts: None,
            shape: s,
            params: op.params,
        };
        let (op_, lp) = (out_ptr(&mut o, &stream), out_ptr(&mut lse, &stream));
        // SAFETY: the addresses are candle's live buffers of the sizes the
        // op checked (`tree_attention`), and two fresh outputs, all on
        // `stream`'s context; candle keeps the inputs alive until the op
        // returns and orders later work on the same stream.
        unsafe { be.forward_raw::<T>(&pack, call, op_, lp) }.map_err(err)?;
        Ok((CudaStorage::wrap_cuda_slice(o, dev), lse))
    }

    /// The gradients of the op's three inputs on the device (dQ, dK, dV;
    /// or dQ, dK‖dV, dsinks), from the kept LSE (or a recomputed one).
    pub(super) fn backward(
        op: &TreeAttention,
        t: [&Tensor; 5],
        kept: Option<Lse>,
    ) -> candle_core::Result<[Tensor; 3]> {
        match t[0].dtype() {
            candle_core::DType::BF16 => backward_t::<half::bf16>(op, t, kept),
            candle_core::DType::F16 => backward_t::<half::f16>(op, t, kept),
            other => {
                use candle_core::CustomOp3;
                Err(candle_core::Error::UnsupportedDTypeForOp(other, op.name()).bt())
            }
        }
    }

    fn backward_t<T: KernelElem + CudaDType + DeviceRepr>(
        op: &TreeAttention,
        t: [&Tensor; 5],
        kept: Option<Lse>,
    ) -> candle_core::Result<[Tensor; 3]> {
        let contiguous = t.map(|x| x.contiguous());
        let [q, k, v, o, d_o] = contiguous;
        let (q, k, v, o, d_o) = (
            q?,
            k?,
            v?,
            o?.to_dtype(t[0].dtype())?,
            d_o?.to_dtype(t[0].dtype())?,
        );
        let Storage::Cuda(qs) = &*q.storage_and_layout().0 else {
            candle_core::bail!("tree_attention: q is not a CUDA tensor")
        };
        let dev = qs.device().clone();
        let stream = dev.cuda_stream();
        let be = backend(&stream)?;
        let pack = upload(op, &be)?;
        let s = op.shape;
        let lse = match kept {
            Some(Lse::Device(l)) => l,
            // Not kept (a second backward through the same op): recompute.
            _ => {
                let (st, l) = q.storage_and_layout();
                let (ks, kl) = k.storage_and_layout();
                let (vs, vl) = v.storage_and_layout();
                let (Storage::Cuda(a), Storage::Cuda(b), Storage::Cuda(c)) = (&*st, &*ks, &*vs)
                else {
                    candle_core::bail!("tree_attention: q, k, v must all be CUDA tensors")
                };
                forward::<T>(op, [(a, l), (b, kl), (c, vl)])?.1
            }
        };
        let guards = [&q, &k, &v, &o, &d_o].map(|x| x.storage_and_layout());
        let mut cuda = Vec::with_capacity(5);
        for ((st, l), what) in guards.iter().zip(["q", "k", "v", "o", "grad"]) {
            let Storage::Cuda(cs) = &**st else {
                candle_core::bail!("tree_attention: {what} is not a CUDA tensor")
            };
            cuda.push((cs, *l));
        }
        let [qp, kp, vp, sinks] = addresses::<T>(op, [cuda[0], cuda[1], cuda[2]], &stream)?;
        let op_ = address::<T>(cuda[3].0, cuda[3].1, &stream, "o")?;
        let dop = address::<T>(cuda[4].0, cuda[4].1, &stream, "grad")?;
        // The gradients as the op's inputs hold them: dQ, dK, dV; or dQ,
        // dK‖dV (one buffer) and dsinks.
        let [qd, bd, cd] = op.input_dims();
        let mut dq = alloc::<T>(&dev, s.q_len())?;
        let mut db = alloc::<T>(&dev, bd.iter().product())?;
        let mut dc = alloc::<T>(&dev, cd.iter().product())?;
        let call = RawAttention {
            q: qp,
            k: kp,
            v: vp,
            sinks,
            key_starts: None,
            shape: s,
            params: op.params,
        };
        let lp = {
            let (p, _sync) = lse.device_ptr(&stream);
            p
        };
        let (a, b, c) = (
            out_ptr(&mut dq, &stream),
            out_ptr(&mut db, &stream),
            out_ptr(&mut dc, &stream),
        );
        let (dk, dv, dsinks) = match op.inputs {
            Inputs::Separate => (b, c, 0),
            Inputs::Packed { k_len } => (b, b + (k_len * std::mem::size_of::<T>()) as u64, c),
        };
        let mode = match op.options.deterministic {
            true => DqMode::Deterministic,
            false => DqMode::Atomic,
        };
        // SAFETY: as in `forward`; the storage guards keep the inputs
        // alive for the call, the gradients are fresh buffers.
        unsafe { be.backward_raw::<T>(&pack, call, op_, lp, dop, a, dk, dv, dsinks, mode) }
            .map_err(err)?;
        drop(cuda);
        drop(guards);
        // The kernels read the LSE on the stream: free it there, after them.
        drop(lse);
        let wrap = |g: CudaSlice<T>, dims: Vec<usize>| {
            Tensor::from_storage(
                Storage::Cuda(CudaStorage::wrap_cuda_slice(g, dev.clone())),
                dims,
                BackpropOp::none(),
                false,
            )
        };
        Ok([wrap(dq, qd), wrap(db, bd), wrap(dc, cd)])
    }
}
