//! Rotary tables on the device for the attention kernels.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};

use super::{cuda_err, DevicePack};
use crate::backend::launch::rope::{RopeArgs, RopeTables};
use crate::backend::Rope;
use crate::Result;

/// Device copies of the per-position cos / sin tables of one call.
pub(crate) struct DeviceRope {
    tables: RopeTables,
    cos: CudaSlice<f32>,
    sin: CudaSlice<f32>,
}

impl DeviceRope {
    /// Builds the tables for `rope` over the pack's position ids (downloaded
    /// once: the pack keeps no host copy) and uploads them; `None` without
    /// rotary.
    pub(crate) fn new(
        stream: &Arc<CudaStream>,
        pack: &DevicePack,
        rope: Option<Rope>,
    ) -> Result<Option<Self>> {
        let Some(rope) = rope else { return Ok(None) };
        let pos = stream
            .clone_dtoh(&pack.position_ids)
            .map_err(cuda_err("downloading position ids"))?;
        let tables = RopeTables::new(rope, &pos)?;
        let cos = stream
            .clone_htod(&tables.cos)
            .map_err(cuda_err("uploading rotary tables"))?;
        let sin = stream
            .clone_htod(&tables.sin)
            .map_err(cuda_err("uploading rotary tables"))?;
        Ok(Some(DeviceRope { tables, cos, sin }))
    }

    /// Kernel arguments for `rope` (none when `None`).
    pub(crate) fn args(
        rope: Option<&Self>,
        stream: &Arc<CudaStream>,
        pack: &DevicePack,
    ) -> RopeArgs {
        match rope {
            Some(r) => r.tables.args(
                pack.position_ids.device_ptr(stream).0,
                r.cos.device_ptr(stream).0,
                r.sin.device_ptr(stream).0,
            ),
            None => RopeArgs::default(),
        }
    }
}
