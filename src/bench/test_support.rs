//! Helpers shared by the bench modules' tests.

use crate::backend::AttnShape;
use crate::pack::Pack;
use crate::rng::Rng;

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
    }
}

pub(crate) fn random(n: usize, rng: &mut Rng) -> Vec<f32> {
    (0..n).map(|_| (2.0 * rng.unit() - 1.0) as f32).collect()
}
