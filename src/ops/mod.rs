//! The public ops, on `ndarray` views: attention on a pack and the SDCC
//! fused forward-KL. They are the `ndarray` adapter of the backend contract
//! ([`crate::backend::AttentionBackend`], [`crate::backend::SdccBackend`])
//! and run on the CPU backend ([`crate::backend::cpu::Cpu`]).
//!
//! Layouts (those of `flash_attn_varlen`): Q, O, dQ are `[tokens, q_heads,
//! head_dim]`; K, V, dK, dV are `[tokens, kv_heads, head_dim]`; LSE is
//! `[q_heads, tokens]`; logits are `[rows, vocab]`. Views need not be
//! contiguous (non-standard layouts are copied once).

pub mod attention;
pub mod sdcc;

pub use attention::{attention_backward, attention_forward, AttnForward, AttnGradients};
pub use sdcc::{sdcc_forward_kl, SdccForward};

use crate::{Error, Result};
use ndarray::{ArrayView, Dimension};
use std::borrow::Cow;

/// The elements of a view in logical (row-major) order, borrowed when the
/// view is already contiguous.
fn flat<'a, T: Clone, D: Dimension>(a: &ArrayView<'a, T, D>) -> Cow<'a, [T]> {
    match a.to_slice() {
        Some(s) => Cow::Borrowed(s),
        None => Cow::Owned(a.iter().cloned().collect()),
    }
}

/// Wraps a flat result into an owned array of the given shape.
fn shaped<T, Sh: ndarray::ShapeBuilder>(
    shape: Sh,
    data: Vec<T>,
    what: &str,
) -> Result<ndarray::Array<T, Sh::Dim>> {
    ndarray::Array::from_shape_vec(shape, data).map_err(|e| Error::Shape(format!("{what}: {e}")))
}
