//! Scaffolding shared by the integration tests (each test file that needs it
//! declares `mod common;`).

use treeattn::backend::emu::KernelElem;
use treeattn::gen::Rng;

/// A fresh generator and its seed: `TREEATTN_SEED` when set (to replay a
/// failure), otherwise the clock. Tests put the seed in every failure
/// message.
#[allow(dead_code)]
pub fn seeded_rng() -> (Rng, u64) {
    let seed = std::env::var("TREEATTN_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0x5eed, |d| d.as_nanos() as u64)
        });
    (Rng::new(seed), seed)
}

/// `n` kernel-element values drawn uniformly from `[-amp, amp)` and rounded
/// to `T`, with the same rounded values widened to `W` (`f32` or `f64`) for
/// the reference, so that only the kernel's arithmetic is under test.
// Not every test file that declares `mod common;` draws kernel tensors.
#[allow(dead_code)]
pub fn random_tensor<T: KernelElem, W: From<f32>>(
    rng: &mut Rng,
    n: usize,
    amp: f32,
) -> (Vec<T>, Vec<W>) {
    let x: Vec<T> = (0..n)
        .map(|_| T::from_f32(rng.signed_unit() * amp))
        .collect();
    let wide = x.iter().map(|e| W::from(e.to_f32())).collect();
    (x, wide)
}
pub mod calls;

/// A copy of `x` in a buffer of its own that starts `aligned` or not on a
/// 16-byte boundary (the attention kernels need 16-byte aligned tensors):
/// returns the buffer and the offset of the copy in it, so that
/// `&buf[off..off + x.len()]` is the view.
#[allow(dead_code)]
pub fn placed<T: Copy + Default>(x: &[T], aligned: bool) -> (Vec<T>, usize) {
    let size = std::mem::size_of::<T>();
    let mut buf = vec![T::default(); x.len() + 16];
    let base = buf.as_ptr() as usize;
    let off = (0..16)
        .find(|i| ((base + i * size) % 16 == 0) == aligned)
        .expect("an offset with the asked alignment");
    buf[off..off + x.len()].copy_from_slice(x);
    (buf, off)
}
