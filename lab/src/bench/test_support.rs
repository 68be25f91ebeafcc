//! Helpers shared by the bench modules' tests.

use super::{AttnGrads, AttnOut};
use treeattn::backend::cpu::Cpu;
use treeattn::backend::{AttnArgs, AttnParams, AttnShape, HostAttention, Saved};
use treeattn::mask::PackMask;
use treeattn::pack::Pack;
use treeattn::rng::Rng;
use treeattn::Result;

/// Largest |a − b| over two equally long slices.
pub(crate) fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

pub(crate) fn shape_of(pack: &Pack, q_heads: usize, kv_heads: usize, head_dim: usize) -> AttnShape {
    AttnShape {
        tokens: pack.len(),
        q_heads,
        kv_heads,
        head_dim,
        v_head_dim: head_dim,
    }
}

pub(crate) fn random(n: usize, rng: &mut Rng) -> Vec<f32> {
    (0..n).map(|_| (2.0 * rng.unit() - 1.0) as f32).collect()
}

/// The CPU backend's forward through the contract.
pub(crate) fn attention_forward(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    shape: AttnShape,
    mask: PackMask<'_>,
    params: &AttnParams,
) -> Result<AttnOut<f32>> {
    Cpu::default().forward_owned(&AttnArgs::new(q, k, v, shape, mask, *params)?)
}

/// The CPU backend's backward through the contract.
#[allow(clippy::too_many_arguments)]
pub(crate) fn attention_backward(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    o: &[f32],
    lse: &[f32],
    d_o: &[f32],
    shape: AttnShape,
    mask: PackMask<'_>,
    params: &AttnParams,
) -> Result<AttnGrads<f32>> {
    let args = AttnArgs::new(q, k, v, shape, mask, *params)?;
    Cpu::default().backward_owned(&args, Saved { o, lse }, d_o)
}
