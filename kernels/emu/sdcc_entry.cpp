// Host entry point of the SDCC forward-KL kernels under the emulator: the
// Rust `emu` backend calls it with the launch plan of
// `backend::launch::sdcc`; it checks the plan, then runs the grid.
#include "../sdcc_kl.cu"

#include <cstdio>

// Block size and shared memory of the kernel: out = {threads, smem_bytes}.
// Two constant stores, no error channel: it cannot throw, and noexcept would
// turn a future exception into std::terminate rather than an unwind into Rust.
extern "C" void ta_emu_sdcc_traits(int32_t* out) noexcept {
    out[0] = TA_SDCC_THREADS;
    out[1] = TA_SDCC_SMEM_BYTES;
}

// dtype: 0 = bf16, 1 = f16, 2 = f32.
extern "C" int ta_emu_sdcc_kl(uint32_t dtype, const SdccParams* p, uint32_t grid_x, uint32_t block_threads,
                              size_t smem, const ta_emu::Config* config, char* err, size_t err_len) noexcept {
    return ta_emu::guard_entry("ta_emu_sdcc_kl", err, err_len, [&]() -> int {
        if (block_threads != TA_SDCC_THREADS || smem != size_t(TA_SDCC_SMEM_BYTES)) {
            snprintf(err, err_len,
                     "sdcc_kl: launch plan (%u threads, %zu bytes of shared memory) does not match the kernel (%d "
                     "threads, %d bytes)",
                     block_threads, smem, TA_SDCC_THREADS, TA_SDCC_SMEM_BYTES);
            return 1;
        }
        void (*kernel)(const SdccParams) = dtype == 0 ? sdcc_kl_bf16 : dtype == 1 ? sdcc_kl_f16 : dtype == 2 ? sdcc_kl_f32
                                                                                                              : nullptr;
        if (!kernel) {
            snprintf(err, err_len, "no SDCC kernel for dtype %u", dtype);
            return 1;
        }
        return ta_emu::launch_kernel<SdccParams>(kernel, *p, dim3(grid_x), dim3(block_threads), smem, *config, err,
                                                 err_len);
    });
}

// The unfused baseline: stage 0 = sdcc_unfused_log_softmax (grid (pairs,
// 2)), stage 1 = sdcc_unfused_kl (grid pairs). dtype as above.
extern "C" int ta_emu_sdcc_unfused(uint32_t dtype, uint32_t stage, const SdccParams* p, uint32_t grid_x,
                                   uint32_t grid_y, uint32_t block_threads, size_t smem,
                                   const ta_emu::Config* config, char* err, size_t err_len) noexcept {
    return ta_emu::guard_entry("ta_emu_sdcc_unfused", err, err_len, [&]() -> int {
        if (block_threads != TA_SDCC_THREADS || smem != size_t(TA_SDCC_SMEM_BYTES)) {
            snprintf(err, err_len, "sdcc_unfused: launch plan does not match the kernel (%d threads, %d bytes)",
                     TA_SDCC_THREADS, TA_SDCC_SMEM_BYTES);
            return 1;
        }
        void (*kernel)(const SdccParams) = stage == 1    ? sdcc_unfused_kl
                                           : dtype == 0 ? sdcc_unfused_log_softmax_bf16
                                           : dtype == 1 ? sdcc_unfused_log_softmax_f16
                                           : dtype == 2 ? sdcc_unfused_log_softmax_f32
                                                        : nullptr;
        if (!kernel || stage > 1) {
            snprintf(err, err_len, "no unfused SDCC kernel for dtype %u, stage %u", dtype, stage);
            return 1;
        }
        return ta_emu::launch_kernel<SdccParams>(kernel, *p, dim3(grid_x, grid_y), dim3(block_threads), smem, *config,
                                                 err, err_len);
    });
}
