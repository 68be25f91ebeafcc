//! Backends that run the ops on a pack.
//!
//! - [`cpu`]: the reference, always built; f32 and f64, tiled, multithreaded.
//! - `emu` (feature `emu`, on for the crate's own tests): the CUDA C++ kernels
//!   of `kernels/` compiled as host C++ against a SIMT shim, so kernel code is
//!   tested by `cargo test` with no GPU.
//! - `cuda` (feature `cuda`): the same kernels compiled by nvcc, launched
//!   through cudarc.
//!
//! Every backend implements the one contract of [`contract`]
//! ([`AttentionBackend`], [`SdccBackend`] on validated [`AttnArgs`] /
//! [`SdccArgs`]), in the varlen layout of `flash_attn_varlen`: Q is
//! `[tokens, q_heads, head_dim]`, K and V are `[tokens, kv_heads,
//! head_dim]`, row-major; LSE is `[q_heads, tokens]`.

pub mod contract;
pub mod cpu;
pub mod tolerance;

pub use contract::{
    AttentionBackend, AttnArgs, AttnGrads, AttnOut, BackwardCall, Element, Extent, ForwardCall,
    Grads, Host, HostAttention, HostSdcc, Memory, Saved, SdccArgs, SdccBackend, SdccCall, SdccLoss,
    SdccOut, MAX_SDCC_VOCAB,
};

use crate::{Error, Result};

#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(feature = "emu")]
pub mod emu;
// The kernel-argument mirrors and plan helpers of `launch` are crate-private
// and used only by the emu and cuda backends: unused with neither feature.
#[cfg_attr(not(any(feature = "emu", feature = "cuda")), allow(dead_code))]
pub mod launch;

/// Largest head dim any backend takes. The kernels take 64 and 128; the
/// CPU backend any size up to this bound (a larger one is almost surely a
/// wrong argument: one token at head dim 2^24 took 108 s and 16.9 GB).
pub const MAX_HEAD_DIM: usize = 1024;

/// Sizes of one attention call on a pack of `tokens` tokens.
///
/// Q and K have `head_dim` elements per head and token; V and O (and dO,
/// dV) have `v_head_dim` — equal to `head_dim` for most models; smaller
/// for multi-head latent attention (DeepSeek-V3, Kimi K2: 192 / 128).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnShape {
    /// Packed tokens `L` (rows of q, k, v).
    pub tokens: usize,
    /// Query heads.
    pub q_heads: usize,
    /// Must divide `q_heads` (GQA: query head `h` reads kv head `h / (q_heads / kv_heads)`).
    pub kv_heads: usize,
    /// Elements per head and token of Q and K, at most [`MAX_HEAD_DIM`].
    pub head_dim: usize,
    /// Elements per head and token of V and O, at most [`MAX_HEAD_DIM`].
    pub v_head_dim: usize,
}

impl AttnShape {
    /// The shape of a call whose V has Q's head dim (`v_head_dim ==
    /// head_dim`).
    pub fn new(tokens: usize, q_heads: usize, kv_heads: usize, head_dim: usize) -> Self {
        AttnShape {
            tokens,
            q_heads,
            kv_heads,
            head_dim,
            v_head_dim: head_dim,
        }
    }

    /// Checks that the head counts fit together, nothing is zero-sized,
    /// `head_dim`, `v_head_dim <= MAX_HEAD_DIM` and the element counts fit
    /// in `usize`.
    pub fn validate(&self) -> Result<()> {
        if self.q_heads == 0 || self.kv_heads == 0 || self.head_dim == 0 || self.v_head_dim == 0 {
            return Err(Error::Shape(format!("zero-sized attention shape {self:?}")));
        }
        for (what, d) in [("head_dim", self.head_dim), ("v_head_dim", self.v_head_dim)] {
            if d > MAX_HEAD_DIM {
                return Err(Error::Unsupported(format!(
                    "{what} = {d} exceeds the limit of {MAX_HEAD_DIM}"
                )));
            }
        }
        let elements = |heads: usize| {
            self.tokens
                .checked_mul(heads)
                .and_then(|x| x.checked_mul(self.head_dim.max(self.v_head_dim)))
        };
        if elements(self.q_heads).is_none() || elements(self.kv_heads).is_none() {
            return Err(Error::Shape(format!(
                "attention shape {self:?} overflows usize"
            )));
        }
        if !self.q_heads.is_multiple_of(self.kv_heads) {
            return Err(Error::Shape(format!(
                "q_heads = {} is not a multiple of kv_heads = {} (GQA needs kv heads dividing q heads)",
                self.q_heads, self.kv_heads
            )));
        }
        Ok(())
    }
    /// Query heads per kv head.
    pub fn group(&self) -> usize {
        self.q_heads / self.kv_heads
    }
    /// Elements of Q (and dQ): `tokens · q_heads · head_dim`.
    pub fn q_len(&self) -> usize {
        self.tokens * self.q_heads * self.head_dim
    }
    /// Elements of K (and dK): `tokens · kv_heads · head_dim`.
    pub fn kv_len(&self) -> usize {
        self.tokens * self.kv_heads * self.head_dim
    }
    /// Elements of O (and dO): `tokens · q_heads · v_head_dim`.
    pub fn o_len(&self) -> usize {
        self.tokens * self.q_heads * self.v_head_dim
    }
    /// Elements of V (and dV): `tokens · kv_heads · v_head_dim`.
    pub fn v_len(&self) -> usize {
        self.tokens * self.kv_heads * self.v_head_dim
    }
    /// Whether V has Q's head dim (every model but multi-head latent
    /// attention).
    pub fn square(&self) -> bool {
        self.v_head_dim == self.head_dim
    }
    /// Elements of LSE: `q_heads · tokens`.
    pub fn lse_len(&self) -> usize {
        self.q_heads * self.tokens
    }
}

/// Rotary position embedding applied inside the op, Llama convention
/// ("rotate half"): for `i < dims / 2`, with `θ_i = base^(−2i / dims)` and the
/// token's position id `p`,
///
/// ```text
/// x'[i]          = x[i] · cos(p θ_i) − x[i + dims/2] · sin(p θ_i)
/// x'[i + dims/2] = x[i + dims/2] · cos(p θ_i) + x[i] · sin(p θ_i)
/// ```
///
/// Lanes `dims..head_dim` pass through unrotated. Q and K are rotated; V is
/// not. Backward rotates dQ and dK back (by the transpose rotation).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rope {
    /// `θ_i = base^(−2i / dims)`; finite and > 1.
    pub base: f64,
    /// Even, at most `head_dim`.
    pub dims: usize,
}

/// Parameters of the attention op.
///
/// The score of query `q` and key `k` is `s = scale · q·k`, then, with a
/// softcap `c`, `s ← c · tanh(s / c)` (Gemma 2); with a window `W`, key `k`
/// is visible to `q` only if also `depth(q) − depth(k) < W`, where the depth
/// of a row is its number of ancestors in the pack's tree (a chain's row
/// `q` has depth `q`: transformers' sliding window `q − k < W`; see
/// [`crate::mask::PackMask::window_starts`]). Attention sinks (gpt-oss) are
/// an input of the call, not a parameter: [`AttnArgs::with_sinks`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttnParams {
    /// Multiplies `Q Kᵀ` before the softmax; usually `1 / sqrt(head_dim)`.
    pub softmax_scale: f64,
    /// Rotary embedding at the pack's position ids, applied inside the op.
    pub rope: Option<Rope>,
    /// Scan inputs for NaN / ±inf and return [`Error::NonFinite`] (costs one pass).
    pub check_finite: bool,
    /// Sliding window of `W >= 1` tree levels: a key more than `W − 1`
    /// levels above the query is masked (needs a tree-shaped mask: nested
    /// key ranges).
    pub window: Option<u32>,
    /// Logit softcap `c > 0`: `s ← c · tanh(s / c)` after the scale, before
    /// the mask and the softmax; the backward goes through the `tanh`.
    pub softcap: Option<f64>,
}

impl AttnParams {
    /// `softmax_scale = 1 / sqrt(head_dim)`, no rotary, no finiteness scan,
    /// no window, no softcap.
    pub fn new(head_dim: usize) -> Self {
        AttnParams {
            softmax_scale: 1.0 / (head_dim as f64).sqrt(),
            rope: None,
            check_finite: false,
            window: None,
            softcap: None,
        }
    }

    /// Whether the call computes plain softmax attention on the interval
    /// mask (no window, no softcap): what every backend and kernel runs.
    pub fn plain_scores(&self) -> bool {
        self.window.is_none() && self.softcap.is_none()
    }

    /// Checks the scale, the rotary settings against the head dim, the
    /// window and the softcap.
    pub fn validate(&self, shape: &AttnShape) -> Result<()> {
        if !self.softmax_scale.is_finite() || self.softmax_scale <= 0.0 {
            return Err(Error::Unsupported(format!(
                "softmax_scale {} must be finite and > 0",
                self.softmax_scale
            )));
        }
        if self.window == Some(0) {
            return Err(Error::Unsupported(
                "window = 0: a sliding window must hold at least the query's own level (window >= 1)"
                    .into(),
            ));
        }
        if let Some(c) = self.softcap {
            if !(c.is_finite() && c > 0.0) {
                return Err(Error::Unsupported(format!(
                    "softcap {c} must be finite and > 0"
                )));
            }
        }
        if let Some(r) = self.rope {
            if r.dims == 0 || r.dims % 2 != 0 || r.dims > shape.head_dim {
                return Err(Error::Unsupported(format!(
                    "rotary dims {} must be even, > 0 and <= head_dim {}",
                    r.dims, shape.head_dim
                )));
            }
            if !(r.base.is_finite() && r.base > 1.0) {
                return Err(Error::Unsupported(format!(
                    "rotary base {} must be finite and > 1",
                    r.base
                )));
            }
        }
        Ok(())
    }
}
