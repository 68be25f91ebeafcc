//! The key starts of the attention variants on the device (kernels/mask.cuh:
//! query `q` sees key `k` iff `key_start[q] <= k <= q < kv_end[k]`) and
//! their per-64-row bounds, computed on the host
//! ([`launch::kernel_key_starts`]: one `O(L)` walk over the pack's
//! `kv_end`, kept on the host by [`super::DevicePack`]) and uploaded. A
//! sliding window's starts (or the sinks' blind-row marks alone) are
//! cached per pack and (window, sinks), so that every layer after the
//! first reuses them; explicit key starts (context parallelism) come with
//! each call and are uploaded per call.

use std::sync::{Arc, Mutex, PoisonError};

use cudarc::driver::{CudaSlice, CudaStream};

use super::{cuda_err, DevicePack};
use crate::backend::launch;
use crate::mask::PackMask;
use crate::Result;

/// A call's key starts on the device: `[tokens]` and the min / max over
/// each [`launch::START_TILE`] rows.
pub(crate) struct DeviceStarts {
    pub starts: CudaSlice<u32>,
    pub tile_min: CudaSlice<u32>,
    pub tile_max: CudaSlice<u32>,
}

/// The cached starts of a pack, per (window, sinks).
#[derive(Default)]
pub(crate) struct StartsCache(Mutex<Vec<(StartsKey, Arc<DeviceStarts>)>>);

type StartsKey = (Option<u32>, bool);

/// Min and max of `starts` over each `tile` rows.
fn tile_bounds(starts: &[u32], tile: usize) -> (Vec<u32>, Vec<u32>) {
    starts
        .chunks(tile)
        .map(|c| {
            let lo = c.iter().copied().min().unwrap_or(0);
            let hi = c.iter().copied().max().unwrap_or(0);
            (lo, hi)
        })
        .unzip()
}

fn upload(stream: &Arc<CudaStream>, starts: &[u32]) -> Result<DeviceStarts> {
    let (lo, hi) = tile_bounds(starts, launch::START_TILE as usize);
    let up = |x: &[u32]| {
        stream
            .clone_htod(x)
            .map_err(cuda_err("uploading the key starts"))
    };
    Ok(DeviceStarts {
        starts: up(starts)?,
        tile_min: up(&lo)?,
        tile_max: up(&hi)?,
    })
}

/// The key starts the variant kernels read for a call on `pack` with
/// `window`, `explicit` key starts and `sinks`; `None` when the call needs
/// none (no window, no explicit starts, no sinks).
pub(crate) fn device_starts(
    stream: &Arc<CudaStream>,
    pack: &DevicePack,
    window: Option<u32>,
    explicit: Option<&[u32]>,
    sinks: bool,
) -> Result<Option<Arc<DeviceStarts>>> {
    let mask = PackMask::new(&pack.host_kv_end, &pack.host_position_ids)?;
    if explicit.is_some() {
        let Some(starts) = launch::kernel_key_starts(mask, window, explicit, sinks)? else {
            return Ok(None);
        };
        return Ok(Some(Arc::new(upload(stream, &starts)?)));
    }
    if window.is_none() && !sinks {
        return Ok(None);
    }
    let key = (window, sinks);
    let mut cache = pack.starts.0.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some((_, d)) = cache.iter().find(|(k, _)| *k == key) {
        return Ok(Some(d.clone()));
    }
    let Some(starts) = launch::kernel_key_starts(mask, window, None, sinks)? else {
        return Ok(None);
    };
    let d = Arc::new(upload(stream, &starts)?);
    cache.push((key, d.clone()));
    Ok(Some(d))
}

#[cfg(test)]
mod tests {
    use super::tile_bounds;

    #[test]
    fn tile_bounds_are_per_chunk() {
        let s: Vec<u32> = (0..130).map(|i| (i * 7 % 11) as u32).collect();
        let (lo, hi) = tile_bounds(&s, 64);
        assert_eq!(lo.len(), 3);
        assert_eq!(lo[2], *s[128..].iter().min().unwrap());
        assert_eq!(hi[0], *s[..64].iter().max().unwrap());
    }
}
