//! The CPU reference backend: tree attention (forward and backward, GQA,
//! optional fused rotary) and the fused SDCC forward-KL, on plain slices.
//!
//! Everything here takes flat row-major slices and explicit shapes so that it
//! can be exposed through a C ABI; [`crate::ops`] is the convenient front over
//! `ndarray` views.
//!
//! # Attention
//!
//! Per query head `h` (reading kv head `h / (q_heads / kv_heads)`), with the
//! interval mask `k <= q < kv_end[k]` of [`PackMask`]:
//!
//! ```text
//! S = scale · Q Kᵀ (masked entries = −inf)   P = softmax(S) row-wise
//! O = P V                                     LSE = ln Σ_k exp(S)
//! ```
//!
//! and backward `D = rowsum(dO ∘ O)`, `dP = dO Vᵀ`, `dS = P ∘ (dP − D)`,
//! `dQ = scale · dS K`, `dK = scale · dSᵀ Q`, `dV = Pᵀ dO` (dK, dV summed over
//! the query heads of a group). A query row with no visible key (only possible
//! with padding keys, `kv_end[k] == k`) gets `O = 0`, `LSE = −inf`, `dQ = 0`
//! and contributes nothing to dK, dV.
//!
//! The computation is tiled FlashAttention-style in [`TILE`]` × `[`TILE`]
//! blocks and never holds an `L × L` matrix: memory is linear in `L` (the
//! inputs are copied once into head-major, zero-padded layouts, plus a few
//! tiles of scratch per thread). Each (query tile, key tile) pair is
//! classified from the per-key-tile min/max of `kv_end` (DESIGN §5):
//! [`TileClass::Skip`] tiles are not computed, [`TileClass::Full`] tiles need
//! no per-element mask, [`TileClass::Partial`] tiles are masked element-wise.
//!
//! Forward runs one work item per (query head, query tile) with an online
//! softmax. Backward runs two deterministic passes: one work item per (kv
//! head, key tile) accumulates dK, dV over the query tiles that can see the
//! key tile (the contiguous range from the tile's first key to its largest
//! `kv_end`), then one work item per (query head, query tile) accumulates dQ.
//! No atomics, so results do not depend on the thread count.
//!
//! Work is spread over [`num_threads`] scoped threads.

mod attention_bwd;
mod attention_fwd;
mod float;
mod kernels;
mod layout;
mod sdcc;

pub use attention_bwd::attention_backward;
pub use attention_fwd::attention_forward;
pub use float::CpuFloat;
pub use sdcc::{sdcc_forward_kl, SdccOut};

use super::{AttnParams, AttnShape};
use crate::mask::PackMask;
use crate::{Error, Result};
use std::sync::{Mutex, PoisonError};

/// Side of the square (query tile × key tile) blocks the CPU backend
/// computes and classifies.
pub const TILE: usize = 64;

/// Forward result of [`attention_forward`].
#[derive(Clone, Debug, PartialEq)]
pub struct AttnOut<T> {
    /// `[tokens, q_heads, head_dim]`.
    pub o: Vec<T>,
    /// `[q_heads, tokens]`, natural log; `−inf` for a row with no visible key.
    pub lse: Vec<T>,
}

/// Gradients returned by [`attention_backward`], with respect to the
/// *unrotated* inputs when rotary is on.
#[derive(Clone, Debug, PartialEq)]
pub struct AttnGrads<T> {
    /// Like q: `[tokens, q_heads, head_dim]`.
    pub dq: Vec<T>,
    /// Like k: `[tokens, kv_heads, head_dim]`.
    pub dk: Vec<T>,
    /// Like v: `[tokens, kv_heads, head_dim]`.
    pub dv: Vec<T>,
}

/// Number of worker threads the CPU backend uses: the environment variable
/// `TREEATTN_THREADS` if it holds a positive integer, otherwise
/// `std::thread::available_parallelism()` (1 if unknown).
pub fn num_threads() -> usize {
    std::env::var("TREEATTN_THREADS")
        .ok()
        .and_then(|s| s.trim().parse::<usize>().ok())
        .filter(|&n| n > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// How a (query tile, key tile) block is computed (DESIGN §5).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TileClass {
    /// No (q, k) in the block is visible: not computed.
    Skip,
    /// Every (q, k) in the block is visible: no per-element mask.
    Full,
    /// Some are visible: masked element-wise.
    Partial,
}

/// Census of the (query tile, key tile) blocks of a pack at the CPU
/// backend's [`TILE`] size, over the lower block triangle (key tile index <=
/// query tile index; blocks above it are never visited).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TileCounts {
    pub skip: u64,
    pub full: u64,
    pub partial: u64,
}

/// Counts the skip / full / partial blocks the CPU attention visits on this
/// mask (for reports and for tests that must exercise all three paths).
pub fn tile_counts(mask: PackMask<'_>) -> TileCounts {
    let bounds = KeyTileBounds::new(mask.kv_end);
    let l = mask.len();
    let tiles = l.div_ceil(TILE);
    let mut c = TileCounts::default();
    for qt in 0..tiles {
        let (q0, q1) = (qt * TILE, ((qt + 1) * TILE).min(l));
        for kt in 0..=qt {
            match bounds.classify(q0, q1, kt) {
                TileClass::Skip => c.skip += 1,
                TileClass::Full => c.full += 1,
                TileClass::Partial => c.partial += 1,
            }
        }
    }
    c
}

/// Per key tile, the min and max of `kv_end` over its keys, computed once per
/// call.
pub(crate) struct KeyTileBounds {
    len: usize,
    min_end: Vec<u32>,
    max_end: Vec<u32>,
}

impl KeyTileBounds {
    pub(crate) fn new(kv_end: &[u32]) -> Self {
        let mut min_end = Vec::with_capacity(kv_end.len().div_ceil(TILE));
        let mut max_end = Vec::with_capacity(min_end.capacity());
        for tile in kv_end.chunks(TILE) {
            min_end.push(tile.iter().copied().min().unwrap_or(0));
            max_end.push(tile.iter().copied().max().unwrap_or(0));
        }
        KeyTileBounds {
            len: kv_end.len(),
            min_end,
            max_end,
        }
    }

    /// Class of the block of queries `[q0, q1)` against key tile `kt`.
    #[inline]
    pub(crate) fn classify(&self, q0: usize, q1: usize, kt: usize) -> TileClass {
        let k0 = kt * TILE;
        let k1 = (k0 + TILE).min(self.len);
        if k0 + 1 > q1 || self.max_end[kt] as usize <= q0 {
            TileClass::Skip
        } else if k1 <= q0 + 1 && self.min_end[kt] as usize >= q1 {
            TileClass::Full
        } else {
            TileClass::Partial
        }
    }

    /// One past the last query tile that can see key tile `kt`.
    #[inline]
    pub(crate) fn query_tile_end(&self, kt: usize) -> usize {
        (self.max_end[kt] as usize).div_ceil(TILE)
    }
}

/// Runs `body` on every work item on up to `threads` scoped threads, pulling
/// items from a shared queue in order (put expensive items first). Each
/// thread builds its scratch once with `init`.
pub(crate) fn run_parallel<W: Send, S>(
    work: Vec<W>,
    threads: usize,
    init: impl Fn() -> S + Sync,
    body: impl Fn(&mut S, W) + Sync,
) {
    let n = threads.min(work.len());
    if n <= 1 {
        let mut scratch = init();
        for w in work {
            body(&mut scratch, w);
        }
        return;
    }
    let queue = Mutex::new(work.into_iter());
    std::thread::scope(|scope| {
        for _ in 0..n {
            scope.spawn(|| {
                let mut scratch = init();
                loop {
                    let next = queue.lock().unwrap_or_else(PoisonError::into_inner).next();
                    match next {
                        Some(w) => body(&mut scratch, w),
                        None => break,
                    }
                }
            });
        }
    });
}

/// `Err(Shape)` unless `got == expected`.
pub(crate) fn check_len(what: &str, got: usize, expected: usize, how: &str) -> Result<()> {
    if got != expected {
        return Err(Error::Shape(format!(
            "{what} has {got} elements, expected {expected} ({how})"
        )));
    }
    Ok(())
}

/// `Err(NonFinite)` at the first NaN or ±inf.
pub(crate) fn check_finite<T: CpuFloat>(what: &str, x: &[T]) -> Result<()> {
    match x.iter().position(|v| !v.is_finite()) {
        Some(index) => Err(Error::NonFinite {
            what: what.to_string(),
            index,
        }),
        None => Ok(()),
    }
}

/// Validation shared by forward and backward: shape, params, mask (re-checked,
/// since `PackMask`'s fields are public), and the q, k, v lengths.
pub(crate) fn check_qkv<T: CpuFloat>(
    q: &[T],
    k: &[T],
    v: &[T],
    shape: &AttnShape,
    mask: &PackMask<'_>,
    params: &AttnParams,
) -> Result<()> {
    shape.validate()?;
    params.validate(shape)?;
    if mask.len() != shape.tokens {
        return Err(Error::Pack(format!(
            "kv_end has {} entries but the attention shape has {} tokens",
            mask.len(),
            shape.tokens
        )));
    }
    PackMask::new(mask.kv_end, mask.position_ids)?;
    let q_how = "tokens · q_heads · head_dim";
    let kv_how = "tokens · kv_heads · head_dim";
    check_len("q", q.len(), shape.q_len(), q_how)?;
    check_len("k", k.len(), shape.kv_len(), kv_how)?;
    check_len("v", v.len(), shape.kv_len(), kv_how)?;
    if params.check_finite {
        check_finite("q", q)?;
        check_finite("k", k)?;
        check_finite("v", v)?;
    }
    Ok(())
}
