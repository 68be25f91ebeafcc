//! The interval mask of a pack and the utilities around it.
//!
//! A pack of length `L` carries one integer per key, `kv_end[k]`, and the
//! exact attention rule is
//!
//! ```text
//! query q may attend to key k   <=>   k <= q < kv_end[k]
//! ```
//!
//! (DESIGN §4: `kv_end[k]` is the exclusive end of the pre-order range of the
//! subtree of `k`'s trie node). Plain causal attention is `kv_end = L`; a
//! varlen batch of independent sequences is `kv_end = end of own sequence`.

use crate::{Error, Result};

/// The part of a pack that attention needs: the interval mask and the
/// position ids (one per packed token, used by rotary embeddings).
#[derive(Clone, Copy, Debug)]
pub struct PackMask<'a> {
    pub kv_end: &'a [u32],
    pub position_ids: &'a [u32],
}

impl<'a> PackMask<'a> {
    /// Checks the invariants every op relies on and returns the mask:
    /// equal lengths and `k <= kv_end[k] <= L` for every key.
    ///
    /// `kv_end[k] == k` marks a *padding* key that no query sees, not even its
    /// own row; a query row with no visible key gets `O = 0`, `LSE = −inf`.
    /// Packs built from rollouts always have `kv_end[k] > k`.
    pub fn new(kv_end: &'a [u32], position_ids: &'a [u32]) -> Result<Self> {
        let l = kv_end.len();
        if position_ids.len() != l {
            return Err(Error::Pack(format!(
                "kv_end has {l} entries but position_ids has {}",
                position_ids.len()
            )));
        }
        if l > u32::MAX as usize {
            return Err(Error::Pack(format!("pack of {l} tokens exceeds u32 indexing")));
        }
        for (k, &e) in kv_end.iter().enumerate() {
            if (e as usize) < k || (e as usize) > l {
                return Err(Error::Pack(format!(
                    "kv_end[{k}] = {e} breaks {k} <= kv_end[k] <= {l} (a key's range starts at itself and stays inside the pack)"
                )));
            }
        }
        Ok(PackMask { kv_end, position_ids })
    }

    /// Number of packed tokens `L`.
    pub fn len(&self) -> usize {
        self.kv_end.len()
    }

    /// True for an empty pack.
    pub fn is_empty(&self) -> bool {
        self.kv_end.is_empty()
    }

    /// Whether query `q` may attend to key `k`.
    #[inline]
    pub fn visible(&self, q: usize, k: usize) -> bool {
        k <= q && q < self.kv_end[k] as usize
    }

    /// Number of visible (query, key) pairs: `Σ_k (kv_end[k] − k)`. This is
    /// the FLOP-count basis of DESIGN §7 (4·d FLOPs per pair per head forward).
    pub fn visible_pairs(&self) -> u64 {
        self.kv_end.iter().enumerate().map(|(k, &e)| e as u64 - k as u64).sum()
    }

    /// A 64-bit FNV-1a fingerprint of `kv_end` and `position_ids`. Ops store
    /// it with saved forward state so that a backward call with a pack from
    /// another batch is rejected instead of silently computing garbage.
    pub fn fingerprint(&self) -> u64 {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for &x in self.kv_end.iter().chain(self.position_ids.iter()) {
            for b in x.to_le_bytes() {
                h ^= b as u64;
                h = h.wrapping_mul(0x0000_0100_0000_01b3);
            }
        }
        h ^ (self.kv_end.len() as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_kv_end_that_does_not_cover_its_key() {
        let err = PackMask::new(&[2, 0], &[0, 1]).unwrap_err();
        assert!(err.to_string().contains("kv_end[1] = 0"), "{err}");
        // kv_end[k] == k is a padding key, allowed.
        assert!(PackMask::new(&[2, 1], &[0, 1]).is_ok());
        assert!(PackMask::new(&[3, 2], &[0, 1]).is_err());
        assert!(PackMask::new(&[2, 2], &[0]).is_err());
    }

    #[test]
    fn causal_pairs_and_fingerprint() {
        let m = PackMask::new(&[4, 4, 4, 4], &[0, 1, 2, 3]).unwrap();
        assert_eq!(m.visible_pairs(), 10);
        assert!(m.visible(3, 0) && !m.visible(0, 3));
        let other = PackMask::new(&[2, 2, 4, 4], &[0, 1, 0, 1]).unwrap();
        assert_ne!(m.fingerprint(), other.fingerprint());
    }
}
