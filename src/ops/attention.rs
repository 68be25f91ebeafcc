//! Attention on a pack (DESIGN §5), over `[tokens, heads, head_dim]` views.

use super::{flat, shaped};
use crate::backend::cpu::{Cpu, CpuFloat};
use crate::backend::{AttnArgs, AttnParams, AttnShape, HostAttention, Saved};
use crate::mask::PackMask;
use crate::{Error, Result};
use ndarray::{Array2, Array3, ArrayView3};

/// Output of [`attention_forward`], kept for [`attention_backward`].
///
/// Remembers the shape, the parameters and the pack's
/// [`PackMask::fingerprint`], so that a backward call with a mask from
/// another pack is an error instead of silently wrong gradients.
#[derive(Clone, Debug)]
pub struct AttnForward<T> {
    /// `O = softmax(scale · Q Kᵀ masked) V`: `[tokens, q_heads, head_dim]`.
    pub o: Array3<T>,
    /// `LSE = ln Σ_k exp(scale · q·k)` over visible keys: `[q_heads,
    /// tokens]`; `−inf` for a row with no visible key.
    pub lse: Array2<T>,
    shape: AttnShape,
    params: AttnParams,
    fingerprint: u64,
}

impl<T> AttnForward<T> {
    /// Sizes of the forward call.
    pub fn shape(&self) -> AttnShape {
        self.shape
    }
    /// Parameters of the forward call (reused by backward).
    pub fn params(&self) -> &AttnParams {
        &self.params
    }
    /// Fingerprint of the pack the forward ran on.
    pub fn fingerprint(&self) -> u64 {
        self.fingerprint
    }
}

/// Gradients from [`attention_backward`], shaped like q, k, v; with
/// respect to the unrotated q, k when rotary is on.
#[derive(Clone, Debug)]
pub struct AttnGradients<T> {
    /// Like q: `[tokens, q_heads, head_dim]`.
    pub dq: Array3<T>,
    /// Like k: `[tokens, kv_heads, head_dim]`.
    pub dk: Array3<T>,
    /// Like v: `[tokens, kv_heads, head_dim]`.
    pub dv: Array3<T>,
}

/// Attention forward on a pack: for each query head `h` (reading kv head
/// `h / (q_heads / kv_heads)`) and query row `q`, over the keys
/// `k <= q < kv_end[k]`,
///
/// ```text
/// s_k = scale · rot(q)·rot(k_k)    O_q = Σ_k softmax(s)_k v_k    LSE_q = ln Σ_k exp(s_k)
/// ```
///
/// where `rot` is the rotary embedding at the pack's position ids when
/// `params.rope` is set (identity otherwise). `q`: `[tokens, q_heads,
/// head_dim]`; `k`, `v`: `[tokens, kv_heads, head_dim]`.
///
/// Errors on mismatched shapes (names the tensor), heads that do not divide,
/// a mask of another length or with an invalid `kv_end`, unsupported rotary
/// settings, and non-finite inputs when `params.check_finite`.
pub fn attention_forward<T: CpuFloat>(
    q: ArrayView3<'_, T>,
    k: ArrayView3<'_, T>,
    v: ArrayView3<'_, T>,
    mask: PackMask<'_>,
    params: &AttnParams,
) -> Result<AttnForward<T>> {
    let shape = shape_of(&q, &k, &v)?;
    let (q, k, v) = (flat(&q), flat(&k), flat(&v));
    let args = AttnArgs::new(&q[..], &k[..], &v[..], shape, mask, *params)?;
    let out = Cpu::default().forward_owned(&args)?;
    Ok(AttnForward {
        o: shaped((shape.tokens, shape.q_heads, shape.head_dim), out.o, "o")?,
        lse: shaped((shape.q_heads, shape.tokens), out.lse, "lse")?,
        shape,
        params: *params,
        fingerprint: mask.fingerprint(),
    })
}

/// Attention backward for the output gradient `d_o` (shaped like `O`):
///
/// ```text
/// D = rowsum(dO ∘ O)   dS = P ∘ (dO Vᵀ − D)
/// dQ = scale · dS K    dK = scale · dSᵀ Q    dV = Pᵀ dO
/// ```
///
/// (dK, dV summed over each kv head's query heads; dQ, dK taken back through
/// the rotary embedding). `q`, `k`, `v` and `mask` must be those of the
/// forward call that produced `fwd`; its parameters are reused.
///
/// Errors: a mask whose fingerprint differs from the forward's
/// (`Error::Pack`), q/k/v/d_o shapes that differ from the forward's, and
/// everything [`attention_forward`] rejects.
pub fn attention_backward<T: CpuFloat>(
    fwd: &AttnForward<T>,
    q: ArrayView3<'_, T>,
    k: ArrayView3<'_, T>,
    v: ArrayView3<'_, T>,
    d_o: ArrayView3<'_, T>,
    mask: PackMask<'_>,
) -> Result<AttnGradients<T>> {
    if mask.fingerprint() != fwd.fingerprint {
        return Err(Error::Pack(format!(
            "backward got a mask with fingerprint {:#018x}, the forward ran on {:#018x}: a mask of another pack",
            mask.fingerprint(),
            fwd.fingerprint
        )));
    }
    let shape = shape_of(&q, &k, &v)?;
    if shape != fwd.shape {
        return Err(Error::Shape(format!(
            "backward q/k/v shape {shape:?} differs from the forward's {:?}",
            fwd.shape
        )));
    }
    if d_o.dim() != fwd.o.dim() {
        return Err(Error::Shape(format!(
            "d_o is {:?}, expected {:?} like o",
            d_o.dim(),
            fwd.o.dim()
        )));
    }
    let (qf, kf, vf) = (flat(&q), flat(&k), flat(&v));
    let args = AttnArgs::new(&qf[..], &kf[..], &vf[..], shape, mask, fwd.params)?;
    let (o, lse, d_o_flat) = (flat(&fwd.o.view()), flat(&fwd.lse.view()), flat(&d_o));
    let saved = Saved {
        o: &o[..],
        lse: &lse[..],
    };
    let g = Cpu::default().backward_owned(&args, saved, &d_o_flat)?;
    Ok(AttnGradients {
        dq: shaped(q.dim(), g.dq, "dq")?,
        dk: shaped(k.dim(), g.dk, "dk")?,
        dv: shaped(v.dim(), g.dv, "dv")?,
    })
}

/// The attention shape of q, k, v views, checking that they fit together.
fn shape_of<T>(
    q: &ArrayView3<'_, T>,
    k: &ArrayView3<'_, T>,
    v: &ArrayView3<'_, T>,
) -> Result<AttnShape> {
    let (tokens, q_heads, head_dim) = q.dim();
    let (k_tokens, kv_heads, k_dim) = k.dim();
    if k_tokens != tokens || k_dim != head_dim {
        return Err(Error::Shape(format!(
            "k is {:?} but q is {:?}: k needs q's tokens and head_dim",
            k.dim(),
            q.dim()
        )));
    }
    if v.dim() != k.dim() {
        return Err(Error::Shape(format!(
            "v is {:?}, expected {:?} like k",
            v.dim(),
            k.dim()
        )));
    }
    let shape = AttnShape {
        tokens,
        q_heads,
        kv_heads,
        head_dim,
        v_head_dim: head_dim,
    };
    shape.validate()?;
    Ok(shape)
}
