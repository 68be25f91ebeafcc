//! A pack's mask plan: `kv_end` and the position ids validated once, built
//! once per pack and reused by every attention call on it — every layer of
//! a model's forward and backward. With the `cuda` feature the plan also
//! keeps its device copy ([`DevicePack`]: kv_end, position ids, the
//! key-tile bounds the kernels walk, the rotary tables) per CUDA context,
//! uploaded by its first device call: later calls copy nothing between host
//! and device and do not synchronize (FlexAttention users build a `BlockMask` once per step; this
//! is the same, for treeattn's mask).
//!
//! A plan owns its data (no borrow of the caller's buffers), so hosts can
//! keep it behind a handle under the same name: the Python
//! `treeattn.torch.MaskPlan`, the C ABI's `TreeattnMaskPlan`
//! (`treeattn_mask_plan_create`), the candle op's per-pack cache.

use crate::mask::PackMask;
use crate::Result;

#[cfg(feature = "cuda")]
use crate::backend::cuda::{CudaBackend, DevicePack};
#[cfg(feature = "cuda")]
use std::sync::{Arc, Mutex, PoisonError};

/// A validated pack mask, built once per pack.
pub struct MaskPlan {
    kv_end: Vec<u32>,
    position_ids: Vec<u32>,
    fingerprint: u64,
    visible_pairs: u64,
    /// Device copies per CUDA context (`CUcontext` address), made on first use.
    #[cfg(feature = "cuda")]
    device: Mutex<Vec<(usize, Arc<DevicePack>)>>,
}

impl std::fmt::Debug for MaskPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MaskPlan")
            .field("tokens", &self.kv_end.len())
            .field("fingerprint", &self.fingerprint)
            .finish_non_exhaustive()
    }
}

impl MaskPlan {
    /// Validates `kv_end` and `position_ids` ([`PackMask::new`]: the same
    /// errors) — once; [`Self::mask`] then hands out the mask without
    /// checking again.
    pub fn new(kv_end: &[u32], position_ids: &[u32]) -> Result<Self> {
        Ok(Self::from_mask(PackMask::new(kv_end, position_ids)?))
    }

    /// The plan of a mask already validated (a [`PackMask`] is valid by
    /// construction): copies it.
    pub fn from_mask(mask: PackMask<'_>) -> Self {
        MaskPlan {
            kv_end: mask.kv_end().to_vec(),
            position_ids: mask.position_ids().to_vec(),
            fingerprint: mask.fingerprint(),
            visible_pairs: mask.visible_pairs(),
            #[cfg(feature = "cuda")]
            device: Mutex::new(Vec::new()),
        }
    }

    /// Whether the plan is of exactly this mask (element by element).
    pub fn is_of(&self, mask: PackMask<'_>) -> bool {
        self.kv_end == mask.kv_end() && self.position_ids == mask.position_ids()
    }

    /// The validated mask (borrowing the plan; not checked again).
    pub fn mask(&self) -> PackMask<'_> {
        PackMask::trusted(&self.kv_end, &self.position_ids)
    }

    /// Packed tokens `L`.
    pub fn len(&self) -> usize {
        self.kv_end.len()
    }

    /// Whether the pack is empty.
    pub fn is_empty(&self) -> bool {
        self.kv_end.is_empty()
    }

    /// [`PackMask::fingerprint`] of the pack.
    pub fn fingerprint(&self) -> u64 {
        self.fingerprint
    }

    /// [`PackMask::visible_pairs`] of the pack.
    pub fn visible_pairs(&self) -> u64 {
        self.visible_pairs
    }

    /// The plan on `be`'s device: uploaded (kv_end, position ids, tile
    /// bounds) on `be`'s stream by the first call for that CUDA context,
    /// then shared — a later call copies nothing and synchronizes nothing.
    /// The upload is stream-ordered: a call on another stream of the same
    /// context must be ordered after the first one by the caller (as for
    /// any tensor made on one stream and read on another).
    #[cfg(feature = "cuda")]
    pub fn on_device(&self, be: &CudaBackend) -> Result<Arc<DevicePack>> {
        let key = be.context().cu_ctx() as usize;
        let mut cache = self.device.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some((_, pack)) = cache.iter().find(|(k, _)| *k == key) {
            return Ok(pack.clone());
        }
        let pack = Arc::new(be.upload_pack(self.mask())?);
        cache.push((key, pack.clone()));
        Ok(pack)
    }

    /// How many device copies the plan holds (one per CUDA context used).
    #[cfg(feature = "cuda")]
    pub fn device_copies(&self) -> usize {
        self.device
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Error;

    #[test]
    fn an_invalid_mask_is_refused_at_build() {
        let e = MaskPlan::new(&[2, 0], &[0, 1]).unwrap_err();
        assert!(
            matches!(e, Error::Pack(ref m) if m.contains("kv_end[1] = 0")),
            "{e}"
        );
        assert!(matches!(MaskPlan::new(&[1], &[]), Err(Error::Pack(_))));
        let empty = MaskPlan::new(&[], &[]).unwrap();
        assert!(empty.is_empty() && empty.mask().kv_end().is_empty());
    }
}
