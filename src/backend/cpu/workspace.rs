//! A process-wide pool of scratch buffers reused across attention calls.
//!
//! Every attention call needs head-major copies of its inputs: several
//! `heads · lpad · dp` arrays, megabytes at a few thousand tokens. Allocated
//! fresh, the allocator maps them from the OS at every call and each page is
//! faulted in on first touch, a fixed cost per call (thousands of minor
//! faults at L ≈ 2k; BENCHMARKS.md §7) that does not parallelize. A training
//! step calls attention with the same shapes for every layer, so
//! [`take_stale`] hands out a buffer a previous call gave back and [`Buf`]
//! gives it back when dropped.
//!
//! Policy (bounded, thread-safe): buffers live in one `Mutex`-guarded list.
//! [`take_stale`] picks the smallest free buffer of the right element type
//! whose capacity is at least the request and at most twice it (so a small call
//! does not pin a large buffer); otherwise it allocates. A given-back buffer
//! is kept only while the pool holds at most [`MAX_BUFFERS`] buffers and
//! [`MAX_BYTES`] bytes; the oldest are freed first to make room. The pool
//! therefore never holds more than [`MAX_BYTES`], and what a call uses is
//! linear in its tokens as before.
//!
//! [`Staggered`] is the other kind of scratch: a few tile-sized arrays per
//! worker thread, in one allocation, offset from each other within a page.

use std::any::Any;
use std::ops::{Deref, DerefMut};
use std::sync::{Mutex, PoisonError};

/// Most buffers the pool keeps (a backward call uses 6 at once).
pub(crate) const MAX_BUFFERS: usize = 32;
/// Most bytes the pool keeps.
pub(crate) const MAX_BYTES: usize = 1 << 30;

struct Entry {
    bytes: usize,
    buf: Box<dyn Any + Send>,
}

static POOL: Mutex<Vec<Entry>> = Mutex::new(Vec::new());

/// A pooled buffer of `len` elements; derefs to a slice and returns its
/// storage to the pool when dropped.
pub(crate) struct Buf<T: Copy + Send + 'static> {
    v: Vec<T>,
}

/// A buffer of `len` elements whose values are whatever a previous user left
/// (`fill` where new): every caller overwrites every element, so no
/// zero-fill pass is spent on it.
pub(crate) fn take_stale<T: Copy + Send + 'static>(len: usize, fill: T) -> Buf<T> {
    let reused = {
        let mut pool = POOL.lock().unwrap_or_else(PoisonError::into_inner);
        let best = pool
            .iter()
            .enumerate()
            .filter_map(|(i, e)| {
                let v = e.buf.downcast_ref::<Vec<T>>()?;
                let cap = v.capacity();
                (cap >= len && cap <= len.saturating_mul(2)).then_some((cap, i))
            })
            .min();
        best.map(|(_, i)| pool.remove(i))
    };
    let mut v = match reused {
        Some(e) => *e
            .buf
            .downcast::<Vec<T>>()
            .expect("the entry was selected by its type"),
        None => Vec::with_capacity(len),
    };
    v.truncate(len);
    v.resize(len, fill);
    Buf { v }
}

impl<T: Copy + Send + 'static> Drop for Buf<T> {
    fn drop(&mut self) {
        let v = std::mem::take(&mut self.v);
        let bytes = v.capacity() * std::mem::size_of::<T>();
        if bytes == 0 {
            return;
        }
        let mut pool = POOL.lock().unwrap_or_else(PoisonError::into_inner);
        admit(
            &mut pool,
            Entry {
                bytes,
                buf: Box::new(v),
            },
            MAX_BUFFERS,
            MAX_BYTES,
        );
    }
}

/// Adds `entry` to `pool`, first freeing the oldest entries until the pool
/// holds fewer than `max_buffers` and the new total is at most `max_bytes`
/// (an entry larger than `max_bytes` is dropped).
fn admit(pool: &mut Vec<Entry>, entry: Entry, max_buffers: usize, max_bytes: usize) {
    if entry.bytes > max_bytes {
        return;
    }
    let mut held: usize = pool.iter().map(|e| e.bytes).sum();
    while !pool.is_empty() && (pool.len() >= max_buffers || held + entry.bytes > max_bytes) {
        held -= pool.remove(0).bytes;
    }
    pool.push(entry);
}

impl<T: Copy + Send + 'static> Deref for Buf<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        &self.v
    }
}

impl<T: Copy + Send + 'static> DerefMut for Buf<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        &mut self.v
    }
}

/// Per-thread scratch of `N` arrays in one allocation, array `i` starting
/// `i · 4096 / N` bytes (rounded down to a cache line) after array 0,
/// modulo 4 KiB. The tile loops' scratch arrays are mostly multiples of
/// 4 KiB long (`TILE × TILE` and `TILE × dp` values); allocated one after
/// the other they would all start at the same offset within a page, and a
/// load from one right after a store to another at the same page offset is
/// treated as dependent on that store (4K aliasing), which measurably slowed
/// the forward's tile loop.
pub(crate) struct Staggered<T, const N: usize> {
    buf: Vec<T>,
    starts: [usize; N],
    lens: [usize; N],
}

impl<T: Copy, const N: usize> Staggered<T, N> {
    /// Arrays of `lens[i]` elements, all equal to `fill`.
    pub(crate) fn new(lens: [usize; N], fill: T) -> Self {
        const PAGE: usize = 4096;
        const LINE: usize = 64;
        let size = std::mem::size_of::<T>().max(1);
        let mut starts = [0; N];
        let mut end = 0;
        for (i, (start, &len)) in starts.iter_mut().zip(&lens).enumerate() {
            let want = i * PAGE / N / LINE * LINE;
            let pad = (want + PAGE - end * size % PAGE) % PAGE;
            *start = end + pad.div_ceil(size);
            end = *start + len;
        }
        Staggered {
            buf: vec![fill; end],
            starts,
            lens,
        }
    }

    /// The `N` arrays.
    pub(crate) fn parts(&mut self) -> [&mut [T]; N] {
        let mut rest: &mut [T] = &mut self.buf;
        let mut taken = 0;
        std::array::from_fn(|i| {
            let (_, tail) = std::mem::take(&mut rest).split_at_mut(self.starts[i] - taken);
            let (part, tail) = tail.split_at_mut(self.lens[i]);
            rest = tail;
            taken = self.starts[i] + self.lens[i];
            part
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Element types no other code pools, so that tests running in parallel
    // cannot take these buffers.
    #[derive(Clone, Copy, Debug, PartialEq)]
    struct Tag(u32);

    #[test]
    fn a_given_back_buffer_is_reused() {
        let mut first = take_stale(1000, Tag(7));
        assert!(
            first.iter().all(|&x| x == Tag(7)),
            "new elements are filled"
        );
        first[3] = Tag(9);
        let ptr = first.as_ptr();
        drop(first);
        let again = take_stale(900, Tag(1));
        assert_eq!(again.as_ptr(), ptr, "same storage");
        assert_eq!(again.len(), 900);
        assert_eq!(again[3], Tag(9), "old values are kept");
        drop(again);
        let longer = take_stale(1000, Tag(2));
        assert_eq!(longer.as_ptr(), ptr);
        assert_eq!(longer[3], Tag(9));
        assert_eq!(longer[950], Tag(2), "and what is new is filled");
        // Far too large for the request: not handed out.
        let small = take_stale(10, Tag(0));
        assert_ne!(small.as_ptr(), ptr);
        // Negative control: a buffer still held is never handed out twice.
        let other = take_stale(1000, Tag(3));
        assert_ne!(other.as_ptr(), longer.as_ptr());
    }

    #[test]
    fn the_pool_stays_within_its_bounds() {
        let entry = |bytes: usize| Entry {
            bytes,
            buf: Box::new(bytes),
        };
        let mut pool = Vec::new();
        for i in 0..10 {
            admit(&mut pool, entry(100 + i), 4, 1000);
            assert!(pool.len() <= 4);
        }
        let kept: Vec<usize> = pool.iter().map(|e| e.bytes).collect();
        assert_eq!(kept, [106, 107, 108, 109], "the oldest go first");
        admit(&mut pool, entry(700), 4, 1000);
        let kept: Vec<usize> = pool.iter().map(|e| e.bytes).collect();
        assert_eq!(kept, [108, 109, 700], "freed until the bytes fit");
        admit(&mut pool, entry(1001), 4, 1000);
        assert_eq!(
            pool.len(),
            3,
            "larger than the cap: not kept, nothing freed"
        );
    }

    /// The arrays have the requested lengths, do not overlap, and start at
    /// the staggered offsets within a page, for element sizes 4 and 8.
    #[test]
    fn staggered_arrays_start_at_different_page_offsets() {
        fn check<T: Copy + PartialEq + std::fmt::Debug>(zero: T, one: T) {
            let lens = [64 * 64, 64 * 64, 64 * 48, 7];
            let mut s = Staggered::<T, 4>::new(lens, zero);
            let base = s.buf.as_ptr() as usize;
            let parts = s.parts();
            let mut offsets = Vec::new();
            for (part, &len) in parts.iter().zip(&lens) {
                assert_eq!(part.len(), len);
                offsets.push((part.as_ptr() as usize - base) % 4096);
            }
            assert_eq!(offsets, [0, 1024, 2048, 3072]);
            for part in parts {
                assert!(part.iter().all(|&x| x == zero), "filled, not overlapping");
                part.fill(one);
            }
        }
        check(0.0f32, 1.0);
        check(0.0f64, 1.0);
    }
}
