// Host entry points of the rotary kernels (kernels/rope.cu) under the
// emulator: the Rust `emu` backend calls these with the launch plans of
// `backend::launch::rope`; they check the plan against the kernels, then run
// the grid.
#include "../rope.cu"

#include <cstdio>

namespace {

int check_block(const char* what, unsigned block_threads, char* err, size_t err_len) {
    if (block_threads != TA_ROPE_THREADS) {
        snprintf(err, err_len, "%s: launch plan of %u threads per block, the kernel is written for %d", what,
                 block_threads, TA_ROPE_THREADS);
        return 1;
    }
    return 0;
}

}  // namespace

// Threads per block of every rotary kernel.
extern "C" int32_t ta_emu_rope_threads() noexcept { return TA_ROPE_THREADS; }

extern "C" int ta_emu_rope_table(const TaRopeTableParams* p, uint32_t grid_x, uint32_t block_threads,
                                 const ta_emu::Config* config, char* err, size_t err_len) noexcept {
    return ta_emu::guard_entry("ta_emu_rope_table", err, err_len, [&]() -> int {
        if (check_block("ta_rope_table", block_threads, err, err_len)) return 1;
        return ta_emu::launch_kernel<TaRopeTableParams>(ta_rope_table, *p, dim3(grid_x), dim3(block_threads), 0,
                                                        *config, err, err_len);
    });
}

// dtype: 0 = bf16, 1 = f16.
extern "C" int ta_emu_rope_apply(uint32_t dtype, uint32_t head_dim, const TaRopeApplyParams* p, uint32_t grid_x,
                                 uint32_t block_threads, const ta_emu::Config* config, char* err,
                                 size_t err_len) noexcept {
    return ta_emu::guard_entry("ta_emu_rope_apply", err, err_len, [&]() -> int {
        if (check_block("ta_rope", block_threads, err, err_len)) return 1;
        if (p->half == 0 || p->half > head_dim / 2) {
            snprintf(err, err_len, "ta_rope: %u rotated pairs in a head of %u lanes", p->half, head_dim);
            return 1;
        }
#define TA_CASE(SUFFIX, E, HD, DT)                                                                           \
        if (dtype == DT && head_dim == HD)                                                                      \
            return ta_emu::launch_kernel<TaRopeApplyParams>(ta_rope_##SUFFIX, *p, dim3(grid_x), dim3(block_threads), \
                                                            0, *config, err, err_len);
        TA_ATTN_VARIANTS(TA_CASE)
#undef TA_CASE
        snprintf(err, err_len, "no rotary kernel for dtype %u, head_dim %u", dtype, head_dim);
        return 1;
    });
}
