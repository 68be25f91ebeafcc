//! Every `extern "C"` entry point of the emulator (`kernels/emu/*.cpp`) and
//! the `#[repr(C)]` mirror of its launch settings, in one place. The entry
//! points return 0, or nonzero with a NUL-terminated message in `err`. None
//! lets a C++ exception unwind into Rust (undefined behaviour through
//! `extern "C"`): each is `noexcept` and catches everything into an error
//! code (`ta_emu::guard_entry`, kernels/emu/shim.h); an exception in a kernel
//! thread fails the launch like `__trap()` (tests/it/emu_shim.rs).

use crate::backend::launch::bwd::BwdParams;
use crate::backend::launch::rope::{RopeApplyParams, RopeTableParams};
use crate::backend::launch::sdcc::SdccParams;
use crate::backend::launch::{FwdParams, KvBoundsParams};

/// Mirror of `ta_emu::Config` (kernels/emu/shim.h).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(super) struct RawConfig {
    pub workers: u32,
    pub schedule: u32,
    pub cp_async_eager: u32,
    pub reserved: u32,
}

extern "C" {
    // kernels/emu/fwd_entry.cpp
    pub fn ta_emu_fwd_traits(head_dim: u32, out: *mut i32) -> i32;
    #[allow(clippy::too_many_arguments)]
    pub fn ta_emu_tree_attn_fwd(
        dtype: u32,
        head_dim: u32,
        var: u32,
        p: *const FwdParams,
        grid_x: u32,
        grid_y: u32,
        block_threads: u32,
        smem: usize,
        config: *const RawConfig,
        cp_async_bytes: *mut u64,
        err: *mut u8,
        err_len: usize,
    ) -> i32;
    pub fn ta_emu_kv_tile_bounds(
        p: *const KvBoundsParams,
        grid_x: u32,
        block_threads: u32,
        config: *const RawConfig,
        err: *mut u8,
        err_len: usize,
    ) -> i32;

    // kernels/emu/bwd_entry.cpp
    pub fn ta_emu_bwd_traits(head_dim: u32, out: *mut i32) -> i32;
    pub fn ta_emu_bwd2_traits(head_dim: u32, four_warps: u32, out: *mut i32) -> i32;
    pub fn ta_emu_var_smem(head_dim: u32, out: *mut i32) -> i32;
    #[allow(clippy::too_many_arguments)]
    pub fn ta_emu_tree_attn_bwd(
        dtype: u32,
        head_dim: u32,
        stage: u32,
        p: *const BwdParams,
        grid_x: u32,
        grid_y: u32,
        grid_z: u32,
        block_threads: u32,
        smem: usize,
        config: *const RawConfig,
        cp_async_bytes: *mut u64,
        err: *mut u8,
        err_len: usize,
    ) -> i32;

    // kernels/emu/rope_entry.cpp
    pub fn ta_emu_rope_threads() -> i32;
    pub fn ta_emu_rope_table(
        p: *const RopeTableParams,
        grid_x: u32,
        block_threads: u32,
        config: *const RawConfig,
        err: *mut u8,
        err_len: usize,
    ) -> i32;
    #[allow(clippy::too_many_arguments)]
    pub fn ta_emu_rope_apply(
        dtype: u32,
        head_dim: u32,
        p: *const RopeApplyParams,
        grid_x: u32,
        block_threads: u32,
        config: *const RawConfig,
        err: *mut u8,
        err_len: usize,
    ) -> i32;

    // kernels/emu/sdcc_entry.cpp
    pub fn ta_emu_sdcc_traits(out: *mut i32);
    #[allow(clippy::too_many_arguments)]
    pub fn ta_emu_sdcc_unfused(
        dtype: u32,
        stage: u32,
        p: *const SdccParams,
        grid_x: u32,
        grid_y: u32,
        block_threads: u32,
        smem: usize,
        config: *const RawConfig,
        err: *mut u8,
        err_len: usize,
    ) -> i32;
    pub fn ta_emu_sdcc_kl(
        dtype: u32,
        p: *const SdccParams,
        grid_x: u32,
        block_threads: u32,
        smem: usize,
        config: *const RawConfig,
        err: *mut u8,
        err_len: usize,
    ) -> i32;

    // kernels/emu/shim_selftest.cpp
    #[allow(clippy::too_many_arguments)]
    pub fn ta_emu_selftest(
        which: u32,
        input: *const u8,
        input_len: usize,
        output: *mut u8,
        arg: u32,
        grid: u32,
        block: u32,
        smem: usize,
        config: *const RawConfig,
        err: *mut u8,
        err_len: usize,
    ) -> i32;
}
