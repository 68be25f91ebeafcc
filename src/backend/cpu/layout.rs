//! Head-major, zero-padded copies of the varlen tensors, and the fused
//! rotary embedding applied while copying.
//!
//! The tiles read rows of `head_dim` contiguous values per head, so the
//! `[tokens, heads, head_dim]` inputs are copied once into `[heads, lpad, dp]`
//! (and, for the operand whose columns a tile reads, tile-major transposed
//! `[heads, lpad / TILE, dp, TILE]`: each tile's `dp × TILE` block is
//! contiguous, so a tile's columns are one run of memory however the
//! visited tiles are spread), where `lpad` rounds the tokens up to a multiple
//! of [`TILE`] and `dp` rounds the head dim up to a multiple of [`LANES`].
//! The padding is zero, which leaves every dot product unchanged and lets the
//! kernels work on whole tiles. This costs O(tokens · heads · head_dim)
//! memory: linear in `L`.

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

    /// Copies every input of a call in one parallel step (one thread
    /// start-up): input `i` `[l, heads, d]` becomes `[heads, lpad, dp]`, or
    /// `[heads, lpad / TILE, dp, TILE]` when `transposed`, rotated by its `rope` if given,
    /// padding zero. Every element of the result is written, so the buffers
    /// come from the pool without a separate zero-fill pass.
    pub(crate) fn copy_inputs<T: CpuFloat, const N: usize>(
        &self,
        inputs: [Input<'_, T>; N],
    ) -> [Buf<T>; N] {
        let Layout { lpad, dp, .. } = *self;
        let mut bufs = inputs
            .each_ref()
            .map(|x| workspace::take_stale(x.heads * lpad * dp, T::ZERO));
        // One work item per (input, head), transposes (the slower kind) first.
        let mut work: Vec<_> = bufs
            .iter_mut()
            .zip(&inputs)
            .flat_map(|(buf, x)| {
                buf.chunks_mut(lpad * dp)
                    .enumerate()
                    .map(move |(h, dst)| (x, h, dst))
            })
            .collect();
        work.sort_by_key(|(x, ..)| !x.transposed);
        run_parallel(
            work,
            self.threads,
            || vec![T::ZERO; TILE * dp],
            |block, (x, h, dst)| {
                if !x.transposed {
                    for (t, row) in dst.chunks_exact_mut(dp).enumerate() {
                        self.padded_row(x, h, t, row);
                    }
                    return;
                }
                // TILE tokens at a time: rows into `block`, then its columns
                // into the TILE-long runs of the transposed rows, so both
                // sides' accesses stay in cache.
                for t0 in (0..lpad).step_by(TILE) {
                    for (j, row) in block.chunks_exact_mut(dp).enumerate() {
                        self.padded_row(x, h, t0 + j, row);
                    }
                    let dst_tile = &mut dst[t0 * dp..(t0 + TILE) * dp];
                    for (c, dst_row) in dst_tile.chunks_exact_mut(TILE).enumerate() {
                        for (j, y) in dst_row.iter_mut().enumerate() {
                            *y = block[j * dp + c];
                        }
                    }
                }
            },
        );
        bufs
    }

    /// Row `t` (of `lpad`) of head `h` of `x`, padded to `dp` with zeros;
    /// all zero past the last token.
    #[inline]
    fn padded_row<T: CpuFloat>(&self, x: &Input<'_, T>, h: usize, t: usize, row: &mut [T]) {
        let d = self.d;
        if t >= self.l {
            row.fill(T::ZERO);
            return;
        }
        let src = &x.x[(t * x.heads + h) * d..][..d];
        match x.rope {
            Some(r) => r.rotate(t, src, &mut row[..d], false),
            None => row[..d].copy_from_slice(src),
        }
        row[d..].fill(T::ZERO);
    }

    /// Writes every output of a call in one parallel step: output `i`'s
    /// `xh` `[heads, lpad, dp]` → its `out` `[l, heads, d]`, rotated back by
    /// its `rope` (the transpose rotation) if given. Every element of each
    /// `out` is written.
    pub(crate) fn copy_outputs<T: CpuFloat, const N: usize>(&self, outputs: [Output<'_, T>; N]) {
        let Layout { lpad, d, dp, .. } = *self;
        let work: Vec<_> = outputs
            .into_iter()
            .flat_map(|x| {
                let (xh, heads, rope) = (x.xh, x.heads, x.rope);
                x.out
                    .chunks_mut(TILE * heads * d)
                    .enumerate()
                    .map(move |(block, dst)| (xh, heads, rope, block, dst))
            })
            .collect();
        run_parallel(
            work,
            self.threads,
            || (),
            |_, (xh, heads, rope, block, dst)| {
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
    }
}

/// One input of [`Layout::copy_inputs`]: `x` is `[l, heads, d]`.
pub(crate) struct Input<'a, T> {
    pub x: &'a [T],
    pub heads: usize,
    pub rope: Option<&'a RopeTable>,
    /// `[heads, lpad / TILE, dp, TILE]` instead of `[heads, lpad, dp]`.
    pub transposed: bool,
}

impl<'a, T> Input<'a, T> {
    /// `[heads, lpad, dp]`, rotated by `rope` if given.
    pub(crate) fn rows(x: &'a [T], heads: usize, rope: Option<&'a RopeTable>) -> Self {
        Input {
            x,
            heads,
            rope,
            transposed: false,
        }
    }

    /// `[heads, lpad / TILE, dp, TILE]`, rotated by `rope` if given.
    pub(crate) fn columns(x: &'a [T], heads: usize, rope: Option<&'a RopeTable>) -> Self {
        Input {
            x,
            heads,
            rope,
            transposed: true,
        }
    }
}

/// One output of [`Layout::copy_outputs`]: head-major `xh` `[heads, lpad,
/// dp]` into `out` `[l, heads, d]`.
pub(crate) struct Output<'a, T> {
    pub xh: &'a [T],
    pub heads: usize,
    pub rope: Option<&'a RopeTable>,
    pub out: &'a mut [T],
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

    /// Rows, columns (transposed) and back to token-major, with padding zero,
    /// also on pooled buffers that still hold another call's values.
    #[test]
    fn layouts_round_trip() {
        let lay = Layout::new(70, 5, 2);
        assert_eq!((lay.lpad, lay.dp), (128, 16));
        let heads = 3;
        let x: Vec<f64> = (0..70 * heads * 5).map(|i| i as f64 + 1.0).collect();
        let check = |x: &[f64]| {
            let [xh, xt] =
                lay.copy_inputs([Input::rows(x, heads, None), Input::columns(x, heads, None)]);
            for h in 0..heads {
                for t in 0..lay.lpad {
                    for c in 0..lay.dp {
                        let want = if t < 70 && c < 5 {
                            x[(t * heads + h) * 5 + c]
                        } else {
                            0.0
                        };
                        assert_eq!(xh[(h * lay.lpad + t) * lay.dp + c], want, "{h} {t} {c}");
                        let tile_major =
                            (h * lay.lpad + t / TILE * TILE) * lay.dp + c * TILE + t % TILE;
                        assert_eq!(xt[tile_major], want, "{h} {t} {c}");
                    }
                }
            }
            let mut back = vec![f64::NAN; x.len()];
            lay.copy_outputs([Output {
                xh: &xh,
                heads,
                rope: None,
                out: &mut back,
            }]);
            assert_eq!(back, x);
        };
        check(&x);
        // Again on the buffers just given back to the pool (no other test
        // uses these sizes), which hold the values of x: every element,
        // padding included, is rewritten.
        let y: Vec<f64> = x.iter().map(|v| -v).collect();
        check(&y);
    }
}
