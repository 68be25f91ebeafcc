// Host entry points of the backward kernels under the emulator: the Rust
// `emu` backend calls these with the launch plans of `backend::launch::bwd`;
// they check each plan against the kernels' traits, then run the grid.
#include "../tree_attn_bwd.cu"

#include "entry_launch.h"

// Traits of the backward kernels for head_dim: out = {main block_m, main
// block_n, main threads, main smem_bytes, dq block_m, dq threads, dq
// smem_bytes}. Returns 0, or 1 for a head dim without kernels.
extern "C" int ta_emu_bwd_traits(uint32_t head_dim, int32_t* out) {
    auto fill = [&](auto main, auto dq) {
        using M = decltype(main);
        using Q = decltype(dq);
        out[0] = M::kBlockM;
        out[1] = M::kBlockN;
        out[2] = M::kThreads;
        out[3] = M::kSmemBytes;
        out[4] = Q::kBlockM;
        out[5] = Q::kThreads;
        out[6] = Q::kSmemBytes;
        return 0;
    };
    if (head_dim == 64) return fill(BwdTraits<ta_bf16, 64>{}, BwdDqTraits<ta_bf16, 64>{});
    if (head_dim == 128) return fill(BwdTraits<ta_bf16, 128>{}, BwdDqTraits<ta_bf16, 128>{});
    return 1;
}

// stage: 0 = tree_attn_bwd_pre, 1 = tree_attn_bwd_main_atomic, 2 =
// tree_attn_bwd_main_det, 3 = tree_attn_bwd_dq, 4 = tree_attn_bwd_dq_convert.
// dtype: 0 = bf16, 1 = f16.
extern "C" int ta_emu_tree_attn_bwd(uint32_t dtype, uint32_t head_dim, uint32_t stage, const TreeAttnBwdParams* p,
                                    uint32_t grid_x, uint32_t grid_y, uint32_t block_threads, size_t smem,
                                    uint32_t workers, char* err, size_t err_len) {
    using ta_emu_entry::check_plan;
    using ta_emu_entry::launch;
    const dim3 grid(grid_x, grid_y), block(block_threads);
#define TA_CASE(DT, HD, E, SUFFIX)                                                                                  \
    if (dtype == DT && head_dim == HD) {                                                                           \
        using M = BwdTraits<E, HD>;                                                                                \
        using Q = BwdDqTraits<E, HD>;                                                                              \
        switch (stage) {                                                                                           \
            case 0:                                                                                                \
                if (check_plan("tree_attn_bwd_pre", block_threads, smem, 128, 0, err, err_len)) return 1;         \
                return launch<TreeAttnBwdParams>(tree_attn_bwd_pre_##SUFFIX, *p, grid, block, smem, workers, err,  \
                                                 err_len);                                                         \
            case 1:                                                                                                \
            case 2:                                                                                                \
                if (check_plan("tree_attn_bwd_main", block_threads, smem, M::kThreads, M::kSmemBytes, err,        \
                               err_len))                                                                           \
                    return 1;                                                                                      \
                return launch<TreeAttnBwdParams>(                                                                  \
                    stage == 1 ? tree_attn_bwd_main_atomic_##SUFFIX : tree_attn_bwd_main_det_##SUFFIX, *p, grid,  \
                    block, smem, workers, err, err_len);                                                           \
            case 3:                                                                                                \
                if (check_plan("tree_attn_bwd_dq", block_threads, smem, Q::kThreads, Q::kSmemBytes, err, err_len)) \
                    return 1;                                                                                      \
                return launch<TreeAttnBwdParams>(tree_attn_bwd_dq_##SUFFIX, *p, grid, block, smem, workers, err,   \
                                                 err_len);                                                         \
            case 4:                                                                                                \
                if (check_plan("tree_attn_bwd_dq_convert", block_threads, smem, 128, 0, err, err_len)) return 1;  \
                return launch<TreeAttnBwdParams>(tree_attn_bwd_dq_convert_##SUFFIX, *p, grid, block, smem,        \
                                                 workers, err, err_len);                                           \
            default:                                                                                               \
                break;                                                                                             \
        }                                                                                                          \
    }
    TA_CASE(0, 64, ta_bf16, bf16_d64)
    TA_CASE(0, 128, ta_bf16, bf16_d128)
    TA_CASE(1, 64, ta_f16, f16_d64)
    TA_CASE(1, 128, ta_f16, f16_d128)
#undef TA_CASE
    snprintf(err, err_len, "no backward kernel for dtype %u, head_dim %u, stage %u", dtype, head_dim, stage);
    return 1;
}
