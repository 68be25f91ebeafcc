//! Head-major, zero-padded copies of the varlen tensors, and the fused
//! rotary embedding applied while copying.
//!
//! The tiles read rows of `head_dim` contiguous values per head, so the
//! `[tokens, heads, head_dim]` inputs are copied once into `[heads, lpad, dp]`
//! (and, for the operand whose columns a tile reads, `[heads, dp, lpad]`),
//! where `lpad` rounds the tokens up to a multiple of [`TILE`] and `dp` rounds
//! the head dim up to a multiple of [`LANES`]. The padding is zero, which
//! leaves every dot product unchanged and lets the kernels work on whole
//! tiles. This costs O(tokens · heads · head_dim) memory: linear in `L`.

use super::{run_parallel, CpuFloat, TILE};
use crate::backend::Rope;

/// The head dim is padded to a multiple of this (the kernels' column block).
pub(crate) const LANES: usize = 8;

/// Sizes of the padded layouts of one call.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Layout {
    /// Tokens.
    pub l: usize,
    /// Tokens rounded up to a multiple of [`TILE`].
    pub lpad: usize,
    /// Head dim.
    pub d: usize,
    /// Head dim rounded up to a multiple of [`LANES`].
    pub dp: usize,
    pub threads: usize,
}

impl Layout {
    pub(crate) fn new(l: usize, d: usize, threads: usize) -> Self {
        Layout {
            l,
            lpad: l.div_ceil(TILE) * TILE,
            d,
            dp: d.div_ceil(LANES) * LANES,
            threads,
        }
    }

    /// `x` `[l, heads, d]` → `[heads, lpad, dp]`, rotated by `rope` if given.
    pub(crate) fn head_major<T: CpuFloat>(
        &self,
        x: &[T],
        heads: usize,
        rope: Option<&RopeTable>,
    ) -> Vec<T> {
        let Layout { l, lpad, d, dp, .. } = *self;
        let mut out = vec![T::ZERO; heads * lpad * dp];
        let work: Vec<_> = out.chunks_mut(lpad * dp).enumerate().collect();
        run_parallel(
            work,
            self.threads,
            || (),
            |_, (h, dst)| {
                for (t, row) in dst.chunks_exact_mut(dp).take(l).enumerate() {
                    let src = &x[(t * heads + h) * d..][..d];
                    match rope {
                        Some(r) => r.rotate(t, src, &mut row[..d], false),
                        None => row[..d].copy_from_slice(src),
                    }
                }
            },
        );
        out
    }

    /// `[heads, lpad, dp]` → `[heads, dp, lpad]` (per-head transpose).
    pub(crate) fn transposed<T: CpuFloat>(&self, xh: &[T], heads: usize) -> Vec<T> {
        let Layout { lpad, dp, .. } = *self;
        let mut out = vec![T::ZERO; heads * lpad * dp];
        let work: Vec<_> = out
            .chunks_mut(lpad * dp)
            .zip(xh.chunks(lpad * dp))
            .collect();
        run_parallel(
            work,
            self.threads,
            || (),
            |_, (dst, src)| {
                // Blocks of TILE tokens keep both sides' accesses in cache.
                for t0 in (0..lpad).step_by(TILE) {
                    for (c, dst_row) in dst.chunks_exact_mut(lpad).enumerate() {
                        let dst_block = &mut dst_row[t0..t0 + TILE];
                        for (j, y) in dst_block.iter_mut().enumerate() {
                            *y = src[(t0 + j) * dp + c];
                        }
                    }
                }
            },
        );
        out
    }

    /// `[heads, lpad, dp]` → `[l, heads, d]`, rotated back by `rope` (the
    /// transpose rotation) if given.
    pub(crate) fn token_major<T: CpuFloat>(
        &self,
        xh: &[T],
        heads: usize,
        rope: Option<&RopeTable>,
    ) -> Vec<T> {
        let Layout { l, lpad, d, dp, .. } = *self;
        let mut out = vec![T::ZERO; l * heads * d];
        let work: Vec<_> = out.chunks_mut(TILE * heads * d).enumerate().collect();
        run_parallel(
            work,
            self.threads,
            || (),
            |_, (block, dst)| {
                for (i, token_row) in dst.chunks_exact_mut(heads * d).enumerate() {
                    let t = block * TILE + i;
                    for (h, row) in token_row.chunks_exact_mut(d).enumerate() {
                        let src = &xh[(h * lpad + t) * dp..][..d];
                        match rope {
                            Some(r) => r.rotate(t, src, row, true),
                            None => row.copy_from_slice(src),
                        }
                    }
                }
            },
        );
        out
    }
}

/// `cos(p θ_i)`, `sin(p θ_i)` in f64 for every token of the pack (its
/// position id `p`) and every rotary frequency `θ_i = base^(−2i / dims)`,
/// `i < dims / 2`. Built once per call: `tokens · dims` f64s.
pub(crate) struct RopeTable {
    half: usize,
    cos: Vec<f64>,
    sin: Vec<f64>,
}

impl RopeTable {
    pub(crate) fn new(rope: Rope, position_ids: &[u32]) -> Self {
        let half = rope.dims / 2;
        let inv_freq: Vec<f64> = (0..half)
            .map(|i| rope.base.powf(-2.0 * i as f64 / rope.dims as f64))
            .collect();
        let mut cos = Vec::with_capacity(position_ids.len() * half);
        let mut sin = Vec::with_capacity(position_ids.len() * half);
        for &p in position_ids {
            for &f in &inv_freq {
                let (s, c) = (p as f64 * f).sin_cos();
                cos.push(c);
                sin.push(s);
            }
        }
        RopeTable { half, cos, sin }
    }

    /// Rotates one head row of token `t` (Llama rotate-half, see [`Rope`]);
    /// `inverse` applies the transpose rotation (used on gradients). Lanes
    /// past `dims` are copied.
    #[inline]
    pub(crate) fn rotate<T: CpuFloat>(&self, t: usize, src: &[T], dst: &mut [T], inverse: bool) {
        let h = self.half;
        let cos = &self.cos[t * h..(t + 1) * h];
        let sin = &self.sin[t * h..(t + 1) * h];
        let sign = if inverse { -1.0 } else { 1.0 };
        for i in 0..h {
            let (a, b) = (src[i].to_f64(), src[i + h].to_f64());
            let (c, s) = (cos[i], sign * sin[i]);
            dst[i] = T::from_f64(a * c - b * s);
            dst[i + h] = T::from_f64(b * c + a * s);
        }
        dst[2 * h..].copy_from_slice(&src[2 * h..]);
    }
}
