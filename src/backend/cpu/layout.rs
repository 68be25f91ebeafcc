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

use super::workspace::{self, Buf};
use super::{run_parallel, CpuFloat, TILE};
use crate::backend::Rope;

/// The head dim is padded to a multiple of this (the kernels' column block).
pub(crate) const LANES: usize = 16;

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
    ) -> Buf<T> {
        let Layout { l, lpad, d, dp, .. } = *self;
        let mut out = workspace::take(heads * lpad * dp, T::ZERO);
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
    pub(crate) fn transposed<T: CpuFloat>(&self, xh: &[T], heads: usize) -> Buf<T> {
        let Layout { lpad, dp, .. } = *self;
        // Every element is written below.
        let mut out = workspace::take_stale(heads * lpad * dp, T::ZERO);
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The rotation matches the formula of [`Rope`] on a hand-computed value,
    /// leaves lanes past `dims` alone, and its inverse undoes it.
    #[test]
    fn rotation_and_its_inverse() {
        let table = RopeTable::new(
            Rope {
                base: 100.0,
                dims: 4,
            },
            &[0, 3],
        );
        let x = [1.0f64, 2.0, 3.0, 4.0, 5.0];
        let mut y = [0.0; 5];
        table.rotate(0, &x, &mut y, false);
        assert_eq!(y, x, "position 0 is the identity");
        table.rotate(1, &x, &mut y, false);
        // i = 0: θ = 1, angle 3; i = 1: θ = 100^(−1/2) = 0.1, angle 0.3.
        let (a0, a1) = (3.0f64, 0.3f64);
        let want = [
            1.0 * a0.cos() - 3.0 * a0.sin(),
            2.0 * a1.cos() - 4.0 * a1.sin(),
            3.0 * a0.cos() + 1.0 * a0.sin(),
            4.0 * a1.cos() + 2.0 * a1.sin(),
            5.0,
        ];
        for (g, w) in y.iter().zip(want) {
            assert!((g - w).abs() < 1e-14, "{y:?} vs {want:?}");
        }
        let mut back = [0.0; 5];
        table.rotate(1, &y, &mut back, true);
        for (g, w) in back.iter().zip(x) {
            assert!((g - w).abs() < 1e-14);
        }
    }

    /// head-major → transposed → token-major round trips, with padding zero.
    #[test]
    fn layouts_round_trip() {
        let lay = Layout::new(70, 5, 2);
        assert_eq!((lay.lpad, lay.dp), (128, 16));
        let heads = 3;
        let x: Vec<f64> = (0..70 * heads * 5).map(|i| i as f64 + 1.0).collect();
        let xh = lay.head_major(&x, heads, None);
        assert_eq!(xh[(lay.lpad + 2) * lay.dp + 4], x[(2 * heads + 1) * 5 + 4]);
        assert!(xh[(lay.lpad + 2) * lay.dp + 5..(lay.lpad + 3) * lay.dp]
            .iter()
            .all(|&v| v == 0.0));
        assert!(xh[(lay.lpad + 70) * lay.dp..2 * lay.lpad * lay.dp]
            .iter()
            .all(|&v| v == 0.0));
        let xt = lay.transposed(&xh, heads);
        assert_eq!(
            xt[(2 * lay.dp + 3) * lay.lpad + 69],
            xh[(2 * lay.lpad + 69) * lay.dp + 3]
        );
        assert_eq!(lay.token_major(&xh, heads, None), x);
        // Again, now on the buffers just given back to the pool (no other
        // test uses these sizes), which hold the values of x: the padding is
        // zero again and the transpose overwrites every element.
        let y: Vec<f64> = x.iter().map(|v| -v).collect();
        drop((xh, xt));
        let yh = lay.head_major(&y, heads, None);
        let yt = lay.transposed(&yh, heads);
        assert!(yh[(lay.lpad + 2) * lay.dp + 5..(lay.lpad + 3) * lay.dp]
            .iter()
            .all(|&v| v == 0.0));
        assert_eq!(
            yt[(2 * lay.dp + 3) * lay.lpad + 69],
            -x[(69 * heads + 2) * 5 + 3]
        );
        assert!(yt[(lay.dp + 4) * lay.lpad + 70..(lay.dp + 5) * lay.lpad]
            .iter()
            .all(|&v| v == 0.0));
        assert_eq!(lay.token_major(&yh, heads, None), y);
    }
}
