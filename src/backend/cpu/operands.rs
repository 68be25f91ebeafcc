//! Head-major, zero-padded copies of the varlen inputs, the fused rotary
//! embedding applied while copying, and the rows of the token-major outputs
//! grouped per (head, tile) so that work items write them directly.
//!
//! The tiles read rows of `head_dim` contiguous values per head, so the
//! `[tokens, heads, head_dim]` inputs are copied once into `[heads, lpad, dp]`
//! (and, for the operand whose columns a tile reads, tile-major transposed
//! `[heads, lpad / TILE, dp, TILE]`: each tile's `dp × TILE` block is
//! contiguous, so a tile's columns are one run of memory however the
//! visited tiles are spread), where `lpad` rounds the tokens up to a multiple
//! of [`TILE`] and `dp` rounds the head dim up to a multiple of [`LANES`]. The padding is zero, which
//! leaves every dot product unchanged and lets the kernels work on whole
//! tiles. This costs O(tokens · heads · head_dim) memory: linear in `L`.
//!
//! The transposed layout is written from a `TILE × dp` block of rows while
//! it is in cache; an input needed in both layouts is read (and rotated)
//! once, its row-major copy serving as that block. Rows that a single work
//! item reads (the forward's query tile) are copied by that item into its
//! scratch instead ([`Layout::copy_tile`]). Results take no head-major
//! detour back: each work item keeps its `TILE × dp` accumulator in its own
//! scratch and stores the finished rows straight into the caller's
//! token-major output through [`head_tile_rows`], a safe split of that
//! output into disjoint rows.

use super::workspace::{self, Buf};
use super::{run_parallel, CpuElement, CpuFloat, TILE};
use crate::backend::{Element, Rope};
use std::ops::Range;

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
    /// start-up): input `i` `[l, heads, d]` becomes `[heads, lpad, dp]`
    /// ([`Input::rows`]), `[heads, lpad / TILE, dp, TILE]` ([`Input::columns`]) or the
    /// first followed by the second ([`Input::rows_and_columns`]), rotated by
    /// its `rope` if given, padding zero, for all its heads or those
    /// [`Input::heads`] names; and fills the row dot products an
    /// input asks for ([`Input::with_row_dots`]). Every element of the
    /// results is written, so the buffers come from the pool without a
    /// separate zero-fill pass.
    pub(crate) fn copy_inputs<S: CpuElement, const N: usize>(
        &self,
        inputs: [Input<'_, S>; N],
    ) -> [Buf<S::Compute>; N] {
        let per_head = self.lpad * self.dp;
        let mut bufs = inputs.each_ref().map(|x| {
            let copies = match x.form {
                Form::Rows | Form::Columns => 1,
                Form::Both => 2,
            };
            workspace::take_stale(copies * x.copied.len() * per_head, S::Compute::ZERO)
        });
        // One work item per (input, head, piece of up to COPY_TILES tiles),
        // transposes (the slower kind) first: whole heads were 4 items per
        // backward step (one kv head), which 2 threads split unevenly.
        let piece = COPY_TILES * TILE;
        let mut work = Vec::new();
        for (buf, x) in bufs.iter_mut().zip(inputs) {
            let (rows, columns): (&mut [S::Compute], &mut [S::Compute]) = match x.form {
                Form::Rows => (buf, &mut []),
                Form::Columns => (&mut [], buf),
                Form::Both => buf.split_at_mut(x.copied.len() * per_head),
            };
            let mut rows = rows.chunks_mut(per_head);
            let mut columns = columns.chunks_mut(per_head);
            let (with, dots) = match x.dots {
                Some(RowDots { with, out }) => (with, out),
                None => (&[][..], &mut [][..]),
            };
            let mut dots = dots.chunks_mut(self.lpad);
            for h in x.copied {
                let mut rows = rows.next().map(|r| r.chunks_mut(piece * self.dp));
                let mut columns = columns.next().map(|c| c.chunks_mut(piece * self.dp));
                let mut dots = dots.next().map(|d| d.chunks_mut(piece));
                for t0 in (0..self.lpad).step_by(piece) {
                    work.push(CopyItem {
                        x: x.x,
                        heads: x.heads,
                        rope: x.rope,
                        ignored: x.ignored,
                        h,
                        t0,
                        t1: (t0 + piece).min(self.lpad),
                        rows: rows.as_mut().and_then(Iterator::next),
                        columns: columns.as_mut().and_then(Iterator::next),
                        dots: dots
                            .as_mut()
                            .and_then(Iterator::next)
                            .map(|out| (with, out)),
                    });
                }
            }
        }
        work.sort_by_key(|w| w.columns.is_none());
        run_parallel(
            work,
            self.threads,
            || vec![S::Compute::ZERO; TILE * self.dp],
            |block, item| self.copy_head(block, item),
        );
        bufs
    }

    /// Row `t` of head `h` of `x` `[l, heads, d]` into `row` (`dp` values),
    /// rotated by `rope` if given, padded with zeros; all zero when `t >= l`
    /// or `ignored[t]` (a row that enters no visible pair: never read, so a
    /// NaN there cannot reach a result through `0 · NaN`). Returns where the
    /// row starts in `x` (`None` for a zero row).
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    fn padded_row<S: CpuElement>(
        &self,
        x: &[S],
        heads: usize,
        h: usize,
        t: usize,
        rope: Option<&RopeTable>,
        ignored: Option<&[bool]>,
        row: &mut [S::Compute],
    ) -> Option<usize> {
        let d = self.d;
        if t >= self.l || ignored.is_some_and(|z| z[t]) {
            row.fill(S::Compute::ZERO);
            return None;
        }
        let at = (t * heads + h) * d;
        let src = &x[at..at + d];
        match rope {
            Some(r) => r.rotate(t, src, &mut row[..d], false),
            None => S::widen_slice(src, &mut row[..d]),
        }
        row[d..].fill(S::Compute::ZERO);
        Some(at)
    }

    /// Rows `t0 .. t0 + TILE` of head `h` of `x` `[l, heads, d]` into `tile`
    /// `[TILE, dp]`, as [`Self::copy_inputs`] lays them out (rotated by
    /// `rope` if given, padding zero): for a work item that is the only
    /// reader of those rows, so that they need no head-major copy in memory.
    pub(crate) fn copy_tile<S: CpuElement>(
        &self,
        x: &[S],
        heads: usize,
        h: usize,
        t0: usize,
        rope: Option<&RopeTable>,
        tile: &mut [S::Compute],
    ) {
        self.prefetch_tile_rows(x, heads, h, t0);
        for (j, row) in tile[..TILE * self.dp].chunks_exact_mut(self.dp).enumerate() {
            self.padded_row(x, heads, h, t0 + j, rope, None, row);
        }
    }

    /// Asks for rows `t0 .. t0 + TILE` (those before `l`) of head `h` of `x`
    /// `[l, heads, d]` all at once before they are copied: the rows lie
    /// `heads · d` values apart in memory that is usually not in cache, and
    /// copied one by one their misses would be waited for one row at a
    /// time.
    #[inline]
    fn prefetch_tile_rows<T>(&self, x: &[T], heads: usize, h: usize, t0: usize) {
        #[cfg(target_arch = "x86_64")]
        for t in t0..(t0 + TILE).min(self.l) {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
            let row = &x[(t * heads + h) * self.d..][..self.d];
            let p = row.as_ptr().cast::<i8>();
            for offset in (0..std::mem::size_of_val::<[T]>(row)).step_by(64) {
                // SAFETY: a prefetch never faults and never changes memory
                // (the address is inside `row` anyway); SSE is part of every
                // x86-64 CPU.
                unsafe { _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(offset)) };
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (x, heads, h, t0);
    }

    /// One piece of one head of one input, `TILE` tokens at a time: the rows
    /// go into the row-major copy (or `block` when only columns are wanted),
    /// then, while they are in cache, into the `TILE`-long runs of the
    /// transposed copy.
    fn copy_head<S: CpuElement>(&self, block: &mut [S::Compute], mut item: CopyItem<'_, '_, S>) {
        let Layout { d, dp, .. } = *self;
        for t0 in (item.t0..item.t1).step_by(TILE) {
            self.prefetch_tile_rows(item.x, item.heads, item.h, t0);
            // Offsets within the piece.
            let p0 = t0 - item.t0;
            let rows = match item.rows.as_deref_mut() {
                Some(rows) => &mut rows[p0 * dp..][..TILE * dp],
                None => &mut block[..TILE * dp],
            };
            for (j, row) in rows.chunks_exact_mut(dp).enumerate() {
                let t = t0 + j;
                let at =
                    self.padded_row(item.x, item.heads, item.h, t, item.rope, item.ignored, row);
                if let Some((with, out)) = item.dots.as_mut() {
                    out[p0 + j] = match at {
                        Some(at) => {
                            let mut acc = S::Compute::ZERO;
                            for (&a, &b) in with[at..at + d].iter().zip(&item.x[at..at + d]) {
                                acc += a.widen() * b.widen();
                            }
                            acc
                        }
                        None => S::Compute::ZERO,
                    };
                }
            }
            if let Some(columns) = item.columns.as_deref_mut() {
                transpose_tile(rows, dp, &mut columns[p0 * dp..(p0 + TILE) * dp]);
            }
        }
    }
}

/// The rows of one [`Layout::copy_inputs`] work item.
struct CopyItem<'a, 'b, S: CpuElement> {
    x: &'a [S],
    heads: usize,
    rope: Option<&'a RopeTable>,
    ignored: Option<&'a [bool]>,
    h: usize,
    /// The piece: tokens `t0 .. t1`, whole tiles.
    t0: usize,
    t1: usize,
    /// The piece's rows `[t1 − t0, dp]` of the row-major copy.
    rows: Option<&'b mut [S::Compute]>,
    /// The piece's tiles `[(t1 − t0) / TILE, dp, TILE]` of the transposed copy.
    columns: Option<&'b mut [S::Compute]>,
    /// The other operand `[l, heads, d]` and the piece's `t1 − t0` dots.
    dots: Option<(&'a [S], &'b mut [S::Compute])>,
}

/// Tiles per work item of [`Layout::copy_inputs`].
const COPY_TILES: usize = 8;

/// `columns[c · TILE + j] = rows[j · dp + c]` for `j < TILE`, `c < dp`: a
/// `TILE × dp` block of rows (in cache, just written) into the `dp × TILE`
/// block of the same tile in the tile-major transposed layout.
#[inline(always)]
fn transpose_tile<T: Copy>(rows: &[T], dp: usize, columns: &mut [T]) {
    for (c, run) in columns.chunks_exact_mut(TILE).take(dp).enumerate() {
        for (j, y) in run.iter_mut().enumerate() {
            *y = rows[j * dp + c];
        }
    }
}

/// How [`Layout::copy_inputs`] lays out one input.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Form {
    Rows,
    Columns,
    Both,
}

/// One input of [`Layout::copy_inputs`]: `x` is `[l, heads, d]`.
pub(crate) struct Input<'a, S: CpuElement> {
    x: &'a [S],
    heads: usize,
    /// The heads copied (all unless [`Input::heads`] narrows them).
    copied: Range<usize>,
    rope: Option<&'a RopeTable>,
    /// Rows copied as zeros ([`Input::ignoring`]).
    ignored: Option<&'a [bool]>,
    form: Form,
    dots: Option<RowDots<'a, S>>,
}

/// `out[(h − copied.start) · lpad + t] = Σ_c with[t, h, c] · x[t, h, c]`,
/// summed in order of `c` (0 for the padding rows `t >= l`).
struct RowDots<'a, S: CpuElement> {
    with: &'a [S],
    out: &'a mut [S::Compute],
}

impl<'a, S: CpuElement> Input<'a, S> {
    /// `[heads, lpad, dp]`, rotated by `rope` if given.
    pub(crate) fn rows(x: &'a [S], heads: usize, rope: Option<&'a RopeTable>) -> Self {
        Input {
            x,
            heads,
            copied: 0..heads,
            rope,
            ignored: None,
            form: Form::Rows,
            dots: None,
        }
    }

    /// `[heads, lpad / TILE, dp, TILE]`, rotated by `rope` if given.
    pub(crate) fn columns(x: &'a [S], heads: usize, rope: Option<&'a RopeTable>) -> Self {
        Input {
            x,
            heads,
            copied: 0..heads,
            rope,
            ignored: None,
            form: Form::Columns,
            dots: None,
        }
    }

    /// `[heads, lpad, dp]` followed by `[heads, lpad / TILE, dp, TILE]` in one buffer
    /// (split it at `heads · lpad · dp`), rotated by `rope` if given: the
    /// source is read and rotated once for both.
    pub(crate) fn rows_and_columns(x: &'a [S], heads: usize, rope: Option<&'a RopeTable>) -> Self {
        Input {
            x,
            heads,
            copied: 0..heads,
            rope,
            ignored: None,
            form: Form::Both,
            dots: None,
        }
    }

    /// Copies only the heads `copied` (within `0 .. heads`): the results are
    /// laid out as above for `copied.len()` heads, the first being
    /// `copied.start`.
    pub(crate) fn heads(self, copied: Range<usize>) -> Self {
        assert!(
            copied.end <= self.heads,
            "heads {copied:?} of {}",
            self.heads
        );
        Input { copied, ..self }
    }

    /// Copies the rows `t` with `ignored[t]` (`[l]`) as zeros, whatever
    /// they hold (their row dots are 0): rows that enter no visible pair
    /// (DESIGN §5, non-finite values in padding rows).
    pub(crate) fn ignoring(self, ignored: &'a [bool]) -> Self {
        Input {
            ignored: Some(ignored),
            ..self
        }
    }

    /// Also writes `out[(h − copied.start) · lpad + t] = Σ_c with[t, h, c] ·
    /// x[t, h, c]` for the copied heads `h` (the unrotated `x`; summed in
    /// order of `c`; 0 for the padding rows `t >= l`): `with` is
    /// `[l, heads, d]` like `x`, `out` is `[copied heads, lpad]`.
    pub(crate) fn with_row_dots(self, with: &'a [S], out: &'a mut [S::Compute]) -> Self {
        Input {
            dots: Some(RowDots { with, out }),
            ..self
        }
    }
}

/// The `d`-long rows of a token-major `out` `[l, heads, d]`, grouped per head
/// and in token order: `rows[h][t]` is token `t`, head `h`. Work items take
/// disjoint `chunks_mut(TILE)` of a head's rows, so one (head, tile) item
/// writes its rows of the caller's output directly, without unsafe code and
/// without a head-major copy of the result. `heads` and `d` are nonzero (the
/// callers' shapes are validated).
pub(crate) fn head_tile_rows<T>(out: &mut [T], heads: usize, d: usize) -> Vec<Vec<&mut [T]>> {
    let tokens = out.len() / (heads * d);
    let mut rows: Vec<Vec<&mut [T]>> = (0..heads).map(|_| Vec::with_capacity(tokens)).collect();
    for (i, row) in out.chunks_exact_mut(d).enumerate() {
        rows[i % heads].push(row);
    }
    rows
}

/// Stores one finished result row: `dst = src` (rounded to the output's
/// element type), rotated back by `rope` (the transpose rotation, for
/// gradients) at token `t` if given, in place in `src` first. Returns
/// whether every stored value is finite, so the callers' result check rides
/// on the store instead of a second pass over the output. The check reads
/// `src` (in cache), never `dst`: reading back just-stored values stalls
/// until their cache lines arrive ([`CpuElement::narrow_slice`]).
#[inline(always)]
pub(crate) fn store_row<S: CpuElement>(
    src: &mut [S::Compute],
    dst: &mut [S],
    t: usize,
    rope: Option<&RopeTable>,
) -> bool {
    if let Some(r) = rope {
        r.rotate_in_place(t, src, true);
    }
    S::narrow_slice(src, dst)
}

/// Asks the CPU to fetch, for writing, the cache lines of `rows` (the output
/// rows a work item stores when it ends), so that those stores find their
/// lines in cache instead of stalling on memory in a burst at the item's
/// end. A hint: no effect on any value. Nothing is done off x86-64.
#[inline]
pub(crate) fn prefetch_for_write<T>(rows: &[&mut [T]]) {
    #[cfg(target_arch = "x86_64")]
    for row in rows.iter().map(|row| &**row) {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_ET0};
        let p = row.as_ptr().cast::<i8>();
        for offset in (0..std::mem::size_of_val(row)).step_by(64) {
            // SAFETY: a prefetch never faults and never changes memory (the
            // address is inside `row` anyway); SSE is part of every x86-64
            // CPU.
            unsafe { _mm_prefetch::<_MM_HINT_ET0>(p.wrapping_add(offset)) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = rows;
}

/// `cos(p θ_i)`, `sin(p θ_i)` in f64 for the position ids `p` of a pack and
/// every rotary frequency `θ_i = base^(−2i / dims)`, `i < dims / 2`. Built
/// once per call. In a tree pack many tokens share a position id (siblings
/// at the same depth: 764 distinct ids for 2294 tokens on the compaction
/// bench), so when the largest id is below the token count the table has
/// one row per position `0 ..= max` and tokens look their row up; otherwise
/// one row per token. Either way at most `tokens · dims` f64s, and the same
/// values for every token. Angles come from libm at every 32nd position and
/// by angle addition in between (see [`RopeTable::new`]).
pub(crate) struct RopeTable {
    half: usize,
    /// Per token, its row of `cos` and `sin`: its position id (one row per
    /// position), or `None` for one row per token.
    rows: Option<Vec<u32>>,
    cos: Vec<f64>,
    sin: Vec<f64>,
}

impl RopeTable {
    pub(crate) fn new(rope: Rope, position_ids: &[u32]) -> Self {
        let half = rope.dims / 2;
        let inv_freq: Vec<f64> = (0..half)
            .map(|i| rope.base.powf(-2.0 * i as f64 / rope.dims as f64))
            .collect();
        let max = position_ids.iter().copied().max().unwrap_or(0);
        let per_position = (max as usize) < position_ids.len();
        let positions: Vec<u32> = if per_position {
            (0..=max).collect()
        } else {
            position_ids.to_vec()
        };
        // Position p's angles are those of its anchor a = p − p mod ANCHOR
        // (libm `sin_cos`) turned by k = p mod ANCHOR steps of each
        // frequency (a rotation precomputed by repeated angle addition):
        // one `sin_cos` per anchor instead of per entry (libm per entry is a
        // measurable share of a call; BENCHMARKS.md §7), within ~1e-14
        // of libm's value, and a function of p alone, so both table kinds
        // give every position the same bits.
        const ANCHOR: usize = 32;
        let mut turns = vec![(1.0f64, 0.0f64); ANCHOR * half];
        for i in 0..half {
            let (s1, c1) = inv_freq[i].sin_cos();
            for k in 1..ANCHOR {
                let (c0, s0) = turns[(k - 1) * half + i];
                turns[k * half + i] = (c0 * c1 - s0 * s1, s0 * c1 + c0 * s1);
            }
        }
        let mut cos = Vec::with_capacity(positions.len() * half);
        let mut sin = Vec::with_capacity(positions.len() * half);
        let mut anchor = vec![(0.0f64, 0.0f64); half];
        let mut anchored = None;
        for &p in &positions {
            let (a, k) = (p as usize / ANCHOR * ANCHOR, p as usize % ANCHOR);
            if anchored != Some(a) {
                for (x, &f) in anchor.iter_mut().zip(&inv_freq) {
                    *x = (a as f64 * f).sin_cos();
                }
                anchored = Some(a);
            }
            for (&(sa, ca), &(ck, sk)) in anchor.iter().zip(&turns[k * half..(k + 1) * half]) {
                cos.push(ca * ck - sa * sk);
                sin.push(sa * ck + ca * sk);
            }
        }
        RopeTable {
            half,
            rows: per_position.then(|| position_ids.to_vec()),
            cos,
            sin,
        }
    }

    /// The `cos` and `sin` of token `t`.
    #[inline(always)]
    fn angles(&self, t: usize) -> (&[f64], &[f64]) {
        let h = self.half;
        let row = match &self.rows {
            Some(position_ids) => position_ids[t] as usize,
            None => t,
        };
        (&self.cos[row * h..][..h], &self.sin[row * h..][..h])
    }

    /// Rotates one head row of token `t` (Llama rotate-half, see [`Rope`]),
    /// widened to the compute type (exactly: the arithmetic is in f64);
    /// `inverse` applies the transpose rotation (used on gradients). Lanes
    /// past `dims` are copied.
    #[inline]
    pub(crate) fn rotate<S: CpuElement>(
        &self,
        t: usize,
        src: &[S],
        dst: &mut [S::Compute],
        inverse: bool,
    ) {
        let h = self.half;
        let (cos, sin) = self.angles(t);
        let sign = if inverse { -1.0 } else { 1.0 };
        for i in 0..h {
            let (a, b) = (src[i].to_f64(), src[i + h].to_f64());
            let (c, s) = (cos[i], sign * sin[i]);
            dst[i] = S::Compute::from_f64(a * c - b * s);
            dst[i + h] = S::Compute::from_f64(b * c + a * s);
        }
        S::widen_slice(&src[2 * h..], &mut dst[2 * h..]);
    }

    /// [`Self::rotate`] of `row` in place (the same arithmetic): each pair
    /// `(i, i + dims / 2)` is read before it is written.
    #[inline]
    pub(crate) fn rotate_in_place<T: CpuFloat>(&self, t: usize, row: &mut [T], inverse: bool) {
        let h = self.half;
        let (cos, sin) = self.angles(t);
        let sign = if inverse { -1.0 } else { 1.0 };
        let (lo, hi) = row.split_at_mut(h);
        for ((x, y), (&c, &s)) in lo.iter_mut().zip(&mut hi[..h]).zip(cos.iter().zip(sin)) {
            let (a, b) = (x.to_f64(), y.to_f64());
            let s = sign * s;
            *x = T::from_f64(a * c - b * s);
            *y = T::from_f64(b * c + a * s);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The per-position table, built by angle addition between anchors,
    /// agrees with libm's `sin_cos` of every angle `p · θ_i` (positions up to
    /// 5,000, frequencies from 1 to base^(−62/64)) to 2e-14 plus the
    /// rounding of the angle itself (`p · θ_i` in f64 is off by up to half
    /// an ulp of it, and the anchor's angle by as much: 2.5e-16 · p · θ_i);
    /// the per-token table (position ids past the token count) likewise.
    #[test]
    fn rotary_tables_match_direct_sines_and_cosines() {
        let rope = Rope {
            base: 10_000.0,
            dims: 64,
        };
        let check = |ids: &[u32], exact: bool| {
            let table = RopeTable::new(rope, ids);
            for (t, &p) in ids.iter().enumerate() {
                let (c, s) = table.angles(t);
                for i in 0..32 {
                    let angle = p as f64 * rope.base.powf(-2.0 * i as f64 / 64.0);
                    let (ws, wc) = angle.sin_cos();
                    let bound = if exact { 0.0 } else { 2e-14 + 2.5e-16 * angle };
                    assert!((c[i] - wc).abs() <= bound, "cos p {p} i {i}");
                    assert!((s[i] - ws).abs() <= bound, "sin p {p} i {i}");
                }
            }
        };
        let ids: Vec<u32> = (0..5000).map(|t| (t * 7 % 4999) as u32).collect();
        check(&ids, false);
        check(&[3, 90_000, 17], false);
    }

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

    /// A position gets the same rotation bits from a per-position table
    /// (ids below the token count) and from a per-token table (an id at or
    /// above it), and both are the Rope formula at that position up to the
    /// angle tables' rounding (1e-14 here: angles below 40 radians).
    #[test]
    fn per_position_and_per_token_tables_agree() {
        let rope = Rope {
            base: 500.0,
            dims: 6,
        };
        let x = [0.5f64, -1.25, 2.0, 0.75, -0.5, 3.0, 9.0];
        let dense: Vec<u32> = (0..45).rev().collect();
        let sparse = [40u32, 33, 3, 0];
        let (per_position, per_token) =
            (RopeTable::new(rope, &dense), RopeTable::new(rope, &sparse));
        assert!(per_position.rows.is_some() && per_token.rows.is_none());
        for (t, &p) in sparse.iter().enumerate() {
            let mut got = [0.0; 7];
            per_token.rotate(t, &x, &mut got, false);
            let mut same = [0.0; 7];
            per_position.rotate(44 - p as usize, &x, &mut same, false);
            assert_eq!(got, same, "position {p}");
            let mut again = x;
            per_token.rotate_in_place(t, &mut again, false);
            assert_eq!(again, got);
            for i in 0..3 {
                let f = rope.base.powf(-2.0 * i as f64 / 6.0);
                let (s, c) = (p as f64 * f).sin_cos();
                let want = [x[i] * c - x[i + 3] * s, x[i + 3] * c + x[i] * s];
                assert!((got[i] - want[0]).abs() < 1e-14, "position {p}");
                assert!((got[i + 3] - want[1]).abs() < 1e-14, "position {p}");
            }
            assert_eq!(got[6], 9.0, "lanes past dims are copied");
        }
    }

    /// Rows, columns (transposed), both in one buffer, the row dot products,
    /// single tiles, and back to token-major through [`head_tile_rows`] and
    /// [`store_row`], with padding zero, also on pooled buffers that still
    /// hold another call's values. The head dim (21) leaves a partial
    /// `LANES` chunk and the tokens (70) a partial tile, so the remainder
    /// paths run too; 1100 tokens are copied in three pieces per head, the
    /// last one partial.
    #[test]
    fn layouts_round_trip() {
        for l in [70, 1100] {
            round_trip(l);
        }
    }

    fn round_trip(l: usize) {
        let (d, heads) = (21, 3);
        let lay = Layout::new(l, d, 2);
        assert_eq!(lay.dp, 32);
        assert_eq!(lay.lpad, l.div_ceil(TILE) * TILE);
        let n = lay.lpad * lay.dp * heads;
        let x: Vec<f64> = (0..l * heads * d).map(|i| i as f64 + 1.0).collect();
        let w: Vec<f64> = (0..l * heads * d).map(|i| (i % 7) as f64 - 3.0).collect();
        let check = |x: &[f64]| {
            let mut dots = workspace::take_stale(heads * lay.lpad, f64::NAN);
            let [xh, xt, both] = lay.copy_inputs([
                Input::rows(x, heads, None),
                Input::columns(x, heads, None),
                Input::rows_and_columns(x, heads, None).with_row_dots(&w, &mut dots),
            ]);
            assert_eq!((xh.len(), xt.len(), both.len()), (n, n, 2 * n));
            assert_eq!(both[..n], xh[..]);
            assert_eq!(both[n..], xt[..]);
            for h in 0..heads {
                for t in 0..lay.lpad {
                    for c in 0..lay.dp {
                        let want = if t < l && c < d {
                            x[(t * heads + h) * d + c]
                        } else {
                            0.0
                        };
                        assert_eq!(xh[(h * lay.lpad + t) * lay.dp + c], want, "{h} {t} {c}");
                        let tile_major =
                            (h * lay.lpad + t / TILE * TILE) * lay.dp + c * TILE + t % TILE;
                        assert_eq!(xt[tile_major], want, "{h} {t} {c}");
                    }
                    let want: f64 = (0..d)
                        .filter(|_| t < l)
                        .map(|c| x[(t * heads + h) * d + c] * w[(t * heads + h) * d + c])
                        .sum();
                    assert_eq!(dots[h * lay.lpad + t], want, "dot {h} {t}");
                }
            }
            // One tile at a time, as a forward item copies its queries.
            let mut tile = vec![f64::NAN; TILE * lay.dp];
            for h in 0..heads {
                for t0 in (0..lay.lpad).step_by(TILE) {
                    lay.copy_tile(x, heads, h, t0, None, &mut tile);
                    assert_eq!(
                        tile[..],
                        xh[(h * lay.lpad + t0) * lay.dp..][..TILE * lay.dp]
                    );
                }
            }
            let mut back = vec![f64::NAN; x.len()];
            let mut finite = true;
            for (h, rows) in head_tile_rows(&mut back, heads, d).iter_mut().enumerate() {
                assert_eq!(rows.len(), l);
                for (qt, tile) in rows.chunks_mut(TILE).enumerate() {
                    for (i, row) in tile.iter_mut().enumerate() {
                        let mut src = xh[(h * lay.lpad + qt * TILE + i) * lay.dp..][..d].to_vec();
                        finite &= store_row(&mut src, row, qt * TILE + i, None);
                    }
                }
            }
            assert!(finite);
            assert_eq!(back, x);
        };
        check(&x);
        // Again on the buffers just given back to the pool (no other test
        // uses these sizes), which hold the values of x: every element,
        // padding included, is rewritten.
        let y: Vec<f64> = x.iter().map(|v| -v).collect();
        check(&y);
    }

    /// A copy of a range of heads (as the backward makes per kv head) is
    /// exactly that range's part of the copy of all heads, in every layout
    /// and for the row dots; a range that is not the first starts at its
    /// own first head (a copy from head 0 fails it).
    #[test]
    fn a_range_of_heads_is_that_part_of_the_whole_copy() {
        let (l, d, heads) = (150, 24, 5);
        let lay = Layout::new(l, d, 3);
        let per_head = lay.lpad * lay.dp;
        let x: Vec<f32> = (0..l * heads * d).map(|i| (i % 97) as f32 - 40.0).collect();
        let w: Vec<f32> = (0..l * heads * d).map(|i| (i % 13) as f32 - 6.0).collect();
        let mut all_dots = workspace::take_stale(heads * lay.lpad, f32::NAN);
        let [all_both, all_cols] = lay.copy_inputs([
            Input::rows_and_columns(&x, heads, None).with_row_dots(&w, &mut all_dots),
            Input::columns(&x, heads, None),
        ]);
        let all_both = all_both.to_vec();
        let all_cols = all_cols.to_vec();
        let (all_rows, all_t) = all_both.split_at(heads * per_head);
        for range in [0..1, 1..3, 4..5, 0..heads] {
            let n = range.len();
            let mut dots = workspace::take_stale(n * lay.lpad, f32::NAN);
            let [both, cols] = lay.copy_inputs([
                Input::rows_and_columns(&x, heads, None)
                    .heads(range.clone())
                    .with_row_dots(&w, &mut dots),
                Input::columns(&x, heads, None).heads(range.clone()),
            ]);
            let (rows, t) = both.split_at(n * per_head);
            let part = range.start * per_head..range.end * per_head;
            assert_eq!(rows, &all_rows[part.clone()], "{range:?}");
            assert_eq!(t, &all_t[part.clone()], "{range:?}");
            assert_eq!(&cols[..], &all_cols[part], "{range:?}");
            let dots_part = range.start * lay.lpad..range.end * lay.lpad;
            assert_eq!(&dots[..], &all_dots[dots_part], "{range:?}");
        }
    }

    /// `store_row` reports a non-finite value wherever it is in the row
    /// (negative control: a finite row is reported finite), and rotates back
    /// when given a rope, as `rotate` does.
    #[test]
    fn store_row_reports_non_finite_values() {
        let src: Vec<f32> = (0..37).map(|i| i as f32 * 0.5 - 9.0).collect();
        let mut dst = vec![0.0f32; 37];
        assert!(store_row(&mut src.clone(), &mut dst, 0, None));
        assert_eq!(dst, src);
        for at in [0, 15, 16, 36] {
            for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                let mut s = src.clone();
                s[at] = bad;
                assert!(!store_row(&mut s, &mut dst, 0, None), "{bad} at {at}");
                assert!(dst[at].to_bits() == bad.to_bits(), "stored as is");
            }
        }
        let table = RopeTable::new(
            Rope {
                base: 100.0,
                dims: 36,
            },
            &[0, 5],
        );
        let mut want = vec![0.0f32; 37];
        table.rotate(1, &src, &mut want, true);
        assert!(store_row(&mut src.clone(), &mut dst, 1, Some(&table)));
        assert_eq!(dst, want);
        assert_ne!(dst, src, "the rotation is not the identity at t = 1");
        // A rotation that overflows f32 is reported: it is checked after.
        let mut big = vec![3e38f32; 37];
        assert!(!store_row(&mut big, &mut dst, 1, Some(&table)));
        assert!(dst.iter().any(|x| x.is_infinite()));
    }
}
