//! Tree attention as a candle op (feature `candle`, candle-core 0.11): a
//! thin adapter over the backend contract ([`crate::backend`]) that candle's
//! autograd differentiates.
//!
//! [`tree_attention`] takes q `[L, Hq, d]`, k and v `[L, Hkv, d]` (the
//! contract's layout, `Hkv` dividing `Hq`), the pack's [`PackMask`] and the
//! [`AttnParams`] (softmax scale, rotary at the pack's position ids), and
//! returns O `[L, Hq, d]`. It is a [`CustomOp3`]: the forward runs the CPU
//! backend ([`Cpu::default`], so [`crate::backend::cpu::set_default_threads`]
//! applies) in f32 or f64, bf16 / f16 through f32; the LSE it computes is
//! kept in the op, so the backward (candle's `backward()` reaches the op's
//! `bwd`) runs the contract's backward without a second forward, and yields
//! dQ, dK, dV. Device tensors are not supported yet (`cuda_fwd` is candle's
//! default error).
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

use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, DType, Layout, Shape, Tensor};

use crate::backend::cpu::{Cpu, CpuFloat};
use crate::backend::{AttnArgs, AttnOut, AttnParams, AttnShape, HostAttention};
use crate::mask::PackMask;

/// Tree attention on a pack as a differentiable candle op; see the module
/// docs. Errors (as `candle_core::Error`, the message of the crate's
/// [`crate::Error`]): q, k, v not 3-D or not `[L, Hq, d]`, `[L, Hkv, d]`,
/// `[L, Hkv, d]` with `L` the mask's tokens, different dtypes, a dtype
/// other than f32 / f64 / bf16 / f16, tensors not on the CPU, and every
/// error of [`AttnArgs::new`].
pub fn tree_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &PackMask<'_>,
    params: &AttnParams,
) -> candle_core::Result<Tensor> {
    let (tokens, q_heads, head_dim) = q.dims3()?;
    let (_, kv_heads, _) = k.dims3()?;
    let shape = AttnShape {
        tokens,
        q_heads,
        kv_heads,
        head_dim,
    };
    for (what, t, want) in [
        ("k", k, (tokens, kv_heads, head_dim)),
        ("v", v, (tokens, kv_heads, head_dim)),
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
    let op = TreeAttention {
        kv_end: mask.kv_end().to_vec(),
        position_ids: mask.position_ids().to_vec(),
        shape,
        params: *params,
        lse: Mutex::new(None),
    };
    q.contiguous()?
        .apply_op3(&k.contiguous()?, &v.contiguous()?, op)
}

fn err(e: crate::Error) -> candle_core::Error {
    candle_core::Error::Msg(e.to_string())
}

/// The LSE the forward computed, in its compute type.
enum Lse {
    F32(Vec<f32>),
    F64(Vec<f64>),
}

/// The op: an owned copy of the pack's mask (candle keeps the op until the
/// backward), the sizes, the parameters and the forward's LSE.
struct TreeAttention {
    kv_end: Vec<u32>,
    position_ids: Vec<u32>,
    shape: AttnShape,
    params: AttnParams,
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
    fn args<'a, T: CpuFloat>(
        &'a self,
        q: &'a [T],
        k: &'a [T],
        v: &'a [T],
    ) -> candle_core::Result<AttnArgs<'a, crate::backend::Host, T>> {
        let mask = PackMask::new(&self.kv_end, &self.position_ids).map_err(err)?;
        AttnArgs::new(q, k, v, self.shape, mask, self.params).map_err(err)
    }

    fn forward<T: CpuFloat>(
        &self,
        q: &[T],
        k: &[T],
        v: &[T],
    ) -> candle_core::Result<AttnOut<T, T>> {
        Cpu::default()
            .forward_owned(&self.args(q, k, v)?)
            .map_err(err)
    }

    /// dQ, dK, dV in the compute type `T`, from host copies of the
    /// tensors, with the kept LSE (or a recomputed one).
    fn grads<T: CpuFloat + candle_core::WithDType>(
        &self,
        t: [&Tensor; 5],
        dtype: DType,
        kept: Option<Vec<T>>,
    ) -> candle_core::Result<[Vec<T>; 3]> {
        let [q, k, v, o, d_o] = t.map(|x| {
            x.to_dtype(dtype)
                .and_then(|x| x.flatten_all())
                .and_then(|x| x.to_vec1::<T>())
        });
        let (q, k, v, o, d_o) = (q?, k?, v?, o?, d_o?);
        let args = self.args(&q, &k, &v)?;
        let lse = match kept {
            Some(lse) => lse,
            None => self.forward(&q, &k, &v)?.lse,
        };
        let fwd = AttnOut { o, lse };
        let g = Cpu::default()
            .backward_owned(&args, fwd.saved(), &d_o)
            .map_err(err)?;
        Ok([g.dq, g.dk, g.dv])
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
            Shape::from_dims(&[self.shape.tokens, self.shape.q_heads, self.shape.head_dim]);
        let to_f32 = |s: &[half::bf16]| s.iter().map(|x| x.to_f32()).collect::<Vec<f32>>();
        let to_f32h = |s: &[half::f16]| s.iter().map(|x| x.to_f32()).collect::<Vec<f32>>();
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
                let (q, k, v) = (
                    to_f32(host(q, l1, "q")?),
                    to_f32(host(k, l2, "k")?),
                    to_f32(host(v, l3, "v")?),
                );
                let f = self.forward(&q, &k, &v)?;
                let o = f.o.iter().map(|&x| half::bf16::from_f32(x)).collect();
                (CpuStorage::BF16(o), Lse::F32(f.lse))
            }
            (CpuStorage::F16(q), CpuStorage::F16(k), CpuStorage::F16(v)) => {
                let (q, k, v) = (
                    to_f32h(host(q, l1, "q")?),
                    to_f32h(host(k, l2, "k")?),
                    to_f32h(host(v, l3, "v")?),
                );
                let f = self.forward(&q, &k, &v)?;
                let o = f.o.iter().map(|&x| half::f16::from_f32(x)).collect();
                (CpuStorage::F16(o), Lse::F32(f.lse))
            }
            _ => candle_core::bail!(
                "tree_attention: dtype {:?} unsupported (f32, f64, bf16, f16)",
                s1.dtype()
            ),
        };
        *self.lse.lock().unwrap_or_else(|e| e.into_inner()) = Some(lse);
        Ok((storage, out_shape))
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
        let t = [q, k, v, res, grad_res];
        let (s, dev) = (self.shape, q.device());
        let (q_dims, kv_dims) = (
            (s.tokens, s.q_heads, s.head_dim),
            (s.tokens, s.kv_heads, s.head_dim),
        );
        let dims = [q_dims, kv_dims, kv_dims];
        let [dq, dk, dv] = if q.dtype() == DType::F64 {
            let kept = match kept {
                Some(Lse::F64(l)) => Some(l),
                _ => None,
            };
            tensors(
                self.grads::<f64>(t, DType::F64, kept)?,
                dims,
                dev,
                q.dtype(),
            )?
        } else {
            let kept = match kept {
                Some(Lse::F32(l)) => Some(l),
                _ => None,
            };
            tensors(
                self.grads::<f32>(t, DType::F32, kept)?,
                dims,
                dev,
                q.dtype(),
            )?
        };
        Ok((Some(dq), Some(dk), Some(dv)))
    }
}

/// Gradients as tensors of the inputs' shapes, device and dtype.
fn tensors<T: candle_core::WithDType>(
    g: [Vec<T>; 3],
    dims: [(usize, usize, usize); 3],
    dev: &candle_core::Device,
    dtype: DType,
) -> candle_core::Result<[Tensor; 3]> {
    let [a, b, c] = g;
    let t = |g: Vec<T>, d| Tensor::from_vec(g, d, dev)?.to_dtype(dtype);
    Ok([t(a, dims[0])?, t(b, dims[1])?, t(c, dims[2])?])
}
