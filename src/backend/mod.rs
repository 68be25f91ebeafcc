//! Backends that run the ops on a pack.
//!
//! - [`cpu`]: the reference, always built; f32 and f64, tiled, multithreaded.
//! - `emu` (feature `emu`, on for the crate's own tests): the CUDA C++ kernels
//!   of `kernels/` compiled as host C++ against a SIMT shim, so kernel code is
//!   tested by `cargo test` with no GPU.
//! - `cuda` (feature `cuda`): the same kernels compiled by nvcc, launched
//!   through cudarc.
//!
//! Every backend takes tensors in the varlen layout of `flash_attn_varlen`:
//! Q is `[tokens, q_heads, head_dim]`, K and V are `[tokens, kv_heads,
//! head_dim]`, row-major; LSE is `[q_heads, tokens]`.

pub mod cpu;

use crate::{Error, Result};

#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(feature = "emu")]
pub mod emu;
// The kernel-argument mirrors and plan helpers of `launch` are crate-private
// and used only by the emu and cuda backends: unused with neither feature.
#[cfg_attr(not(any(feature = "emu", feature = "cuda")), allow(dead_code))]
pub mod launch;

/// Sizes of one attention call on a pack of `tokens` tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnShape {
    pub tokens: usize,
    pub q_heads: usize,
    /// Must divide `q_heads` (GQA: query head `h` reads kv head `h / (q_heads / kv_heads)`).
    pub kv_heads: usize,
    pub head_dim: usize,
}

impl AttnShape {
    /// Checks that the head counts fit together and nothing is zero-sized.
    pub fn validate(&self) -> Result<()> {
        if self.q_heads == 0 || self.kv_heads == 0 || self.head_dim == 0 {
            return Err(Error::Shape(format!("zero-sized attention shape {self:?}")));
        }
        if self.q_heads % self.kv_heads != 0 {
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
    /// Elements of Q (and O, dO, dQ): `tokens · q_heads · head_dim`.
    pub fn q_len(&self) -> usize {
        self.tokens * self.q_heads * self.head_dim
    }
    /// Elements of K and V (and dK, dV): `tokens · kv_heads · head_dim`.
    pub fn kv_len(&self) -> usize {
        self.tokens * self.kv_heads * self.head_dim
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
    pub base: f64,
    /// Even, at most `head_dim`.
    pub dims: usize,
}

/// Parameters of the attention op.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttnParams {
    /// Multiplies `Q Kᵀ` before the softmax; usually `1 / sqrt(head_dim)`.
    pub softmax_scale: f64,
    pub rope: Option<Rope>,
    /// Scan inputs for NaN / ±inf and return [`Error::NonFinite`] (costs one pass).
    pub check_finite: bool,
}

impl AttnParams {
    /// `softmax_scale = 1 / sqrt(head_dim)`, no rotary, no finiteness scan.
    pub fn new(head_dim: usize) -> Self {
        AttnParams {
            softmax_scale: 1.0 / (head_dim as f64).sqrt(),
            rope: None,
            check_finite: false,
        }
    }
    /// Checks the rotary settings against the head dim.
    pub fn validate(&self, shape: &AttnShape) -> Result<()> {
        if !self.softmax_scale.is_finite() || self.softmax_scale <= 0.0 {
            return Err(Error::Unsupported(format!(
                "softmax_scale {} must be finite and > 0",
                self.softmax_scale
            )));
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

/// Checks the arguments of an SDCC forward-KL call the same way on every
/// backend and returns the number of (student, teacher) logit rows. `lens`
/// are the element counts of the student and teacher logits.
///
/// Errors: `vocab == 0` or logits not a whole number of rows; `weights` not
/// one per pair, non-finite or negative; `temperature` non-finite or `<= 0`;
/// a pair naming a row out of range (the lowest such pair is reported).
pub fn check_sdcc_args(
    lens: (usize, usize),
    vocab: usize,
    pairs: &[(u32, u32)],
    weights: &[f32],
    temperature: f32,
) -> Result<(usize, usize)> {
    if vocab == 0 {
        return Err(Error::Shape("SDCC vocab must be > 0".into()));
    }
    for (what, n) in [("student", lens.0), ("teacher", lens.1)] {
        if n % vocab != 0 {
            return Err(Error::Shape(format!(
                "{what} logits have {n} elements, not a multiple of vocab = {vocab}"
            )));
        }
    }
    if weights.len() != pairs.len() {
        return Err(Error::Shape(format!(
            "{} weights for {} SDCC pairs",
            weights.len(),
            pairs.len()
        )));
    }
    if !(temperature.is_finite() && temperature > 0.0) {
        return Err(Error::Unsupported(format!(
            "SDCC temperature {temperature} must be finite and > 0"
        )));
    }
    if let Some(index) = weights.iter().position(|w| !w.is_finite()) {
        return Err(Error::NonFinite {
            what: "SDCC weights".into(),
            index,
        });
    }
    if let Some(i) = weights.iter().position(|&w| w < 0.0) {
        return Err(Error::Unsupported(format!(
            "SDCC weight {i} is {} (weights must be >= 0)",
            weights[i]
        )));
    }
    let (n_student, n_teacher) = (lens.0 / vocab, lens.1 / vocab);
    for (i, &(s, t)) in pairs.iter().enumerate() {
        if s as usize >= n_student || t as usize >= n_teacher {
            return Err(Error::Pack(format!(
                "SDCC pair {i} = (student row {s}, teacher row {t}) is out of range: {n_student} student rows, {n_teacher} teacher rows"
            )));
        }
    }
    Ok((n_student, n_teacher))
}
