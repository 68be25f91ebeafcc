// Host entry points of the backward kernels under the emulator: the Rust
// `emu` backend calls these with the launch plans of `backend::launch::bwd`;
// they check each plan against the kernels' traits, then run the grid.
#include "../tree_attn_bwd.cu"

#include <cstdio>

namespace {

// 1 with a message unless the launch plan matches the kernel's traits.
int check_plan(const char* what, unsigned block_threads, size_t smem, int want_threads, int want_smem, char* err,
               size_t err_len) {
    if (block_threads != unsigned(want_threads) || smem != size_t(want_smem)) {
        snprintf(err, err_len,
                 "%s: launch plan (%u threads, %zu bytes of shared memory) does not match the kernel traits (%d "
                 "threads, %d bytes)",
                 what, block_threads, smem, want_threads, want_smem);
        return 1;
    }
    return 0;
}

// The 4-warp D = 64 two-m-tile main kernel with a test-only fault (negative
// controls): kFault 1 drops the barrier before its dQ matmul (atomic mode),
// 2 swaps its two key m-tiles' K fragments in Sᵀ. Emulator only: not in the
// cubin.
template <class E, int kFault>
void tree_attn_bwd_main2w4_fault(const TreeAttnBwdParams p) {
    tree_attn_bwd_main2_body<Bwd2Traits<E, 64>, true, kFault>(p);
}
// The same for the 8-warp D = 64 two-m-tile kernel
// (tree_attn_bwd_main2_roles.cuh): 1 drops its barrier B, 2 swaps the key
// m-tiles' K fragments in Sᵀ, 3 drops its barrier A.
template <class E, int kFault>
void tree_attn_bwd_main2_roles_fault(const TreeAttnBwdParams p) {
    tree_attn_bwd_main2_roles_body<Bwd2RoleTraits<E, 64>, true, kFault>(p);
}
// The same for the D = 128 two-m-tile kernel (tree_attn_bwd_main2_d128.cuh):
// 1 drops its barrier B, 2 swaps the key m-tiles' K fragments in Sᵀ, 3 drops
// its barrier A.
template <class E, int kFault>
void tree_attn_bwd_main2_d128_fault(const TreeAttnBwdParams p) {
    tree_attn_bwd_main2_d128_body<Bwd2SplitTraits<E, 128>, true, kFault>(p);
}

}  // namespace

// Traits of a two-m-tile backward main kernel, `four_warps` 0: the 8-warp
// default (Bwd2RoleTraits for D = 64, Bwd2SplitTraits for D = 128), 1: the
// 4-warp D = 64 kernel (Bwd2Traits): out = {block_m, block_n, threads,
// smem_bytes, sub_m}. Returns 0, or 1 for a head dim without that kernel.
extern "C" int ta_emu_bwd2_traits(uint32_t head_dim, uint32_t four_warps, int32_t* out) noexcept {
    return ta_emu::guard_entry("ta_emu_bwd2_traits", nullptr, 0, [&]() -> int {
        auto fill = [&](auto t) {
            using M = decltype(t);
            out[0] = M::kBlockM;
            out[1] = M::kBlockN;
            out[2] = M::kThreads;
            out[3] = M::kSmemBytes;
            out[4] = M::kSubM;
            return 0;
        };
        if (four_warps) return head_dim == 64 ? fill(Bwd2Traits<ta_bf16, 64>{}) : 1;
        if (head_dim == 64) return fill(Bwd2RoleTraits<ta_bf16, 64>{});
        if (head_dim == 128) return fill(Bwd2SplitTraits<ta_bf16, 128>{});
        return 1;
    });
}

// Shared memory of the variant kernels for head_dim (C++ kSmemBytesVar):
// out = {forward, one-m-tile main, two-m-tile main (8 warps), dq}. Returns
// 0, or 1 for a head dim without kernels.
extern "C" int ta_emu_var_smem(uint32_t head_dim, int32_t* out) noexcept {
    return ta_emu::guard_entry("ta_emu_var_smem", nullptr, 0, [&]() -> int {
        auto fill = [&](auto f, auto m, auto m2, auto q) {
            out[0] = decltype(f)::kSmemBytesVar;
            out[1] = decltype(m)::kSmemBytesVar;
            out[2] = decltype(m2)::kSmemBytesVar;
            out[3] = decltype(q)::kSmemBytesVar;
            return 0;
        };
        if (head_dim == 64)
            return fill(FwdTraits<ta_bf16, 64>{}, BwdTraits<ta_bf16, 64>{}, Bwd2RoleTraits<ta_bf16, 64>{},
                        BwdDqTraits<ta_bf16, 64>{});
        if (head_dim == 128)
            return fill(FwdTraits<ta_bf16, 128>{}, BwdTraits<ta_bf16, 128>{}, Bwd2SplitTraits<ta_bf16, 128>{},
                        BwdDqTraits<ta_bf16, 128>{});
        return 1;
    });
}

// Traits of the backward kernels for head_dim: out = {main block_m, main
// block_n, main threads, main smem_bytes, dq block_m, dq threads, dq
// smem_bytes}. Returns 0, or 1 for a head dim without kernels.
extern "C" int ta_emu_bwd_traits(uint32_t head_dim, int32_t* out) noexcept {
    return ta_emu::guard_entry("ta_emu_bwd_traits", nullptr, 0, [&]() -> int {
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
#define TA_TRAITS(SUFFIX, E, HD, DT) \
    if (head_dim == HD) return fill(BwdTraits<E, HD>{}, BwdDqTraits<E, HD>{});
        TA_ATTN_VARIANTS(TA_TRAITS)
#undef TA_TRAITS
        return 1;
    });
}

// stage: 0 = tree_attn_bwd_pre, 1 = tree_attn_bwd_main_atomic, 2 =
// tree_attn_bwd_main_det, 3 = tree_attn_bwd_dq, 4 = tree_attn_bwd_dq_convert,
// 5 = tree_attn_bwd_dkv_convert, 6 = tree_attn_bwd_main2_atomic, 7 =
// tree_attn_bwd_main2_det (D = 64 and 128), 8 / 9 / 10 = tree_attn_bwd_main2_atomic
// with test-only fault 1 / 2 / 3 (negative controls), 11 / 12 =
// tree_attn_bwd_main2w4_atomic / _det (D = 64 only), 13 / 14 =
// tree_attn_bwd_main2w4_atomic with fault 1 / 2; the attention variants'
// kernels: 15 / 16 = tree_attn_bwd_main_var_atomic / _det (one m-tile), 17
// / 18 = tree_attn_bwd_main2_var_atomic / _det (D = 64: the role split, D =
// 128: the head-dim split, which has no softcap), 19 = tree_attn_bwd_dq_var,
// 20 = tree_attn_bwd_dsinks. grid_z is the main kernel's group splits (1
// for the others).
// dtype: 0 = bf16, 1 = f16. *cp_async_bytes receives the bytes the launch
// moved with cp.async.
extern "C" int ta_emu_tree_attn_bwd(uint32_t dtype, uint32_t head_dim, uint32_t stage, const TreeAttnBwdParams* p,
                                    uint32_t grid_x, uint32_t grid_y, uint32_t grid_z, uint32_t block_threads,
                                    size_t smem,
                                    const ta_emu::Config* config, uint64_t* cp_async_bytes, char* err,
                                    size_t err_len) noexcept {
    return ta_emu::guard_entry("ta_emu_tree_attn_bwd", err, err_len, [&]() -> int {
        const dim3 grid(grid_x, grid_y, grid_z), block(block_threads);
        const bool main_stage = stage == 1 || stage == 2 || (stage >= 6 && stage <= 18);
        // The plain main and dQ kernels ignore the variants' fields: a call
        // with them must not reach those (pre, the converts and dsinks are
        // shared by both kinds of call).
        const bool plain_scores = stage == 1 || stage == 2 || stage == 3 || (stage >= 6 && stage <= 14);
        if (plain_scores && (p->key_start || p->sinks || p->softcap_c != 0.f)) {
            snprintf(err, err_len, "stage %u: variant arguments (key starts, sinks, softcap) for a plain kernel",
                     stage);
            return 1;
        }
        if ((stage == 17 || stage == 18) && head_dim == 128 && p->softcap_c != 0.f) {
            snprintf(err, err_len, "the d 128 two-m-tile variant kernel computes no softcap (the one-m-tile one does)");
            return 1;
        }
        if (stage == 20 && (!p->sinks || !p->dsinks)) {
            snprintf(err, err_len, "tree_attn_bwd_dsinks without sinks or dsinks");
            return 1;
        }
        // The balanced launch's item table: among the main kernels, the
        // 8-warp two-m-tile ones only (6, 7, 17, 18; D = 64 and 128), with a
        // scratch for the partials.
        // Regions of scratch where a key tile is cut (dkv_slots of them, none
        // when no tile is: then no scratch and no dK / dV conversion).
        if (p->items && ((main_stage && !(stage == 6 || stage == 7 || stage == 17 || stage == 18)) ||
                         !p->tile_regions || (p->dkv_accum == nullptr) != (p->dkv_slots == 0) ||
                         (stage == 5 && p->dkv_slots == 0))) {
            snprintf(err, err_len, "stage %u (d %u): a balanced item table where no kernel reads one", stage, head_dim);
            return 1;
        }
        if (p->group_splits == 0 || (main_stage ? grid_z != (p->items ? 1u : p->group_splits) : grid_z != 1) ||
            (p->kv_heads != 0 && (p->q_heads / p->kv_heads) % p->group_splits != 0) ||
            (p->group_splits > 1 && p->dkv_accum == nullptr)) {
            snprintf(err, err_len,
                     "stage %u: grid z %u with %u group splits of %u query heads per kv head (dkv_accum %s)", stage,
                     grid_z, p->group_splits, p->kv_heads ? p->q_heads / p->kv_heads : 0,
                     p->dkv_accum ? "set" : "null");
            return 1;
        }
        // The buffers the kernels read with cp.async.
        const size_t q_bytes = size_t(p->tokens) * p->q_heads * head_dim * 2;
        const size_t kv_bytes = size_t(p->tokens) * p->kv_heads * head_dim * 2;
        // (kv_end, LSE and D: the two-m-tile main kernel stages them by
        // 4-byte cp.async; tile_kv_min / tile_kv_max: the dQ kernel's
        // look-ahead window.)
        const size_t row_bytes = size_t(p->tokens) * p->q_heads * 4;
        const ta_emu::GlobalRange ranges[] = {{p->q, q_bytes, "q"},
                                              {p->k, kv_bytes, "k"},
                                              {p->v, kv_bytes, "v"},
                                              {p->d_o, q_bytes, "d_o"},
                                              {p->kv_end, size_t(p->tokens) * 4, "kv_end"},
                                              {p->lse, row_bytes, "lse"},
                                              {p->delta, row_bytes, "delta"},
                                              {p->tile_kv_min, size_t(p->num_key_tiles) * 4, "tile_kv_min"},
                                              {p->tile_kv_max, size_t(p->num_key_tiles) * 4, "tile_kv_max"},
                                              {p->key_start, p->key_start ? size_t(p->tokens) * 4 : 0, "key_start"}};
        ta_emu::LaunchIo io;
        io.ranges = ranges;
        io.num_ranges = 10;
        io.cp_async_bytes = cp_async_bytes;
        auto launch = [&](void (*kernel)(const TreeAttnBwdParams)) {
            return ta_emu::launch_kernel<TreeAttnBwdParams>(kernel, *p, grid, block, smem, *config, err, err_len, io);
        };
#define TA_CASE(SUFFIX, E, HD, DT)                                                                             \
        if (dtype == DT && head_dim == HD) {                                                                      \
            using M = BwdTraits<E, HD>;                                                                           \
            using Q = BwdDqTraits<E, HD>;                                                                         \
            switch (stage) {                                                                                      \
                case 0:                                                                                           \
                    if (check_plan("tree_attn_bwd_pre", block_threads, smem, 128, 0, err, err_len)) return 1;    \
                    return launch(tree_attn_bwd_pre_##SUFFIX);                                                    \
                case 1:                                                                                           \
                case 2:                                                                                           \
                    if (check_plan("tree_attn_bwd_main", block_threads, smem, M::kThreads, M::kSmemBytes, err,   \
                                   err_len))                                                                      \
                        return 1;                                                                                 \
                    return launch(stage == 1 ? tree_attn_bwd_main_atomic_##SUFFIX : tree_attn_bwd_main_det_##SUFFIX); \
                case 3:                                                                                           \
                    if (check_plan("tree_attn_bwd_dq", block_threads, smem, Q::kThreads, Q::kSmemBytes, err,     \
                                   err_len))                                                                      \
                        return 1;                                                                                 \
                    return launch(tree_attn_bwd_dq_##SUFFIX);                                                     \
                case 4:                                                                                           \
                    if (check_plan("tree_attn_bwd_dq_convert", block_threads, smem, 128, 0, err, err_len))       \
                        return 1;                                                                                 \
                    return launch(tree_attn_bwd_dq_convert_##SUFFIX);                                             \
                case 5:                                                                                           \
                    if (check_plan("tree_attn_bwd_dkv_convert", block_threads, smem, 128, 0, err, err_len))      \
                        return 1;                                                                                 \
                    return launch(tree_attn_bwd_dkv_convert_##SUFFIX);                                            \
                case 15:                                                                                          \
                case 16:                                                                                          \
                    if (check_plan("tree_attn_bwd_main_var", block_threads, smem, M::kThreads, M::kSmemBytesVar, \
                                   err, err_len))                                                                 \
                        return 1;                                                                                 \
                    return launch(stage == 15 ? tree_attn_bwd_main_var_atomic_##SUFFIX                            \
                                              : tree_attn_bwd_main_var_det_##SUFFIX);                             \
                case 19:                                                                                          \
                    if (check_plan("tree_attn_bwd_dq_var", block_threads, smem, Q::kThreads, Q::kSmemBytesVar,   \
                                   err, err_len))                                                                 \
                        return 1;                                                                                 \
                    return launch(tree_attn_bwd_dq_var_##SUFFIX);                                                 \
                case 20:                                                                                          \
                    if (check_plan("tree_attn_bwd_dsinks", block_threads, smem, 128, kDsinksSmemBytes, err,      \
                                   err_len))                                                                      \
                        return 1;                                                                                 \
                    return launch(tree_attn_bwd_dsinks_##SUFFIX);                                                 \
                default:                                                                                          \
                    break;                                                                                        \
            }                                                                                                     \
        }
        TA_ATTN_VARIANTS(TA_CASE)
#undef TA_CASE
#define TA_CASE2(SUFFIX, E)                                                                                    \
        if (dtype == (E::kIsBf16 ? 0u : 1u) && head_dim == 64 && stage >= 6 && stage <= 10) {                   \
            using M2 = Bwd2RoleTraits<E, 64>;                                                                      \
            if (check_plan("tree_attn_bwd_main2", block_threads, smem, M2::kThreads, M2::kSmemBytes, err, err_len)) \
                return 1;                                                                                          \
            switch (stage) {                                                                                       \
                case 6: return launch(tree_attn_bwd_main2_atomic_##SUFFIX);                                        \
                case 7: return launch(tree_attn_bwd_main2_det_##SUFFIX);                                           \
                case 8: return launch(tree_attn_bwd_main2_roles_fault<E, 1>);                                      \
                case 9: return launch(tree_attn_bwd_main2_roles_fault<E, 2>);                                      \
                default: return launch(tree_attn_bwd_main2_roles_fault<E, 3>);                                     \
            }                                                                                                      \
        }                                                                                                          \
        if (dtype == (E::kIsBf16 ? 0u : 1u) && head_dim == 64 && stage >= 11 && stage <= 14) {                  \
            using M2 = Bwd2Traits<E, 64>;                                                                          \
            if (check_plan("tree_attn_bwd_main2w4", block_threads, smem, M2::kThreads, M2::kSmemBytes, err,       \
                           err_len))                                                                               \
                return 1;                                                                                          \
            switch (stage) {                                                                                       \
                case 11: return launch(tree_attn_bwd_main2w4_atomic_##SUFFIX);                                     \
                case 12: return launch(tree_attn_bwd_main2w4_det_##SUFFIX);                                        \
                case 13: return launch(tree_attn_bwd_main2w4_fault<E, 1>);                                         \
                default: return launch(tree_attn_bwd_main2w4_fault<E, 2>);                                         \
            }                                                                                                      \
        }
        TA_CASE2(bf16_d64, ta_bf16)
        TA_CASE2(f16_d64, ta_f16)
#undef TA_CASE2
#define TA_CASE2_VAR(SUFFIX, E, HD, TR)                                                                          \
        if (dtype == (E::kIsBf16 ? 0u : 1u) && head_dim == HD && (stage == 17 || stage == 18)) {                   \
            using M2 = TR<E, HD>;                                                                                  \
            if (check_plan("tree_attn_bwd_main2_var", block_threads, smem, M2::kThreads, M2::kSmemBytesVar, err,   \
                           err_len))                                                                               \
                return 1;                                                                                          \
            return launch(stage == 17 ? tree_attn_bwd_main2_var_atomic_##SUFFIX : tree_attn_bwd_main2_var_det_##SUFFIX); \
        }
        TA_CASE2_VAR(bf16_d64, ta_bf16, 64, Bwd2RoleTraits)
        TA_CASE2_VAR(f16_d64, ta_f16, 64, Bwd2RoleTraits)
        TA_CASE2_VAR(bf16_d128, ta_bf16, 128, Bwd2SplitTraits)
        TA_CASE2_VAR(f16_d128, ta_f16, 128, Bwd2SplitTraits)
#undef TA_CASE2_VAR
#define TA_CASE2_D128(SUFFIX, E)                                                                                \
        if (dtype == (E::kIsBf16 ? 0u : 1u) && head_dim == 128 && stage >= 6 && stage <= 10) {                   \
            using M2 = Bwd2SplitTraits<E, 128>;                                                                    \
            if (check_plan("tree_attn_bwd_main2", block_threads, smem, M2::kThreads, M2::kSmemBytes, err, err_len)) \
                return 1;                                                                                          \
            switch (stage) {                                                                                       \
                case 6: return launch(tree_attn_bwd_main2_atomic_##SUFFIX);                                        \
                case 7: return launch(tree_attn_bwd_main2_det_##SUFFIX);                                           \
                case 8: return launch(tree_attn_bwd_main2_d128_fault<E, 1>);                                       \
                case 9: return launch(tree_attn_bwd_main2_d128_fault<E, 2>);                                       \
                default: return launch(tree_attn_bwd_main2_d128_fault<E, 3>);                                      \
            }                                                                                                      \
        }
        TA_CASE2_D128(bf16_d128, ta_bf16)
        TA_CASE2_D128(f16_d128, ta_f16)
#undef TA_CASE2_D128
        snprintf(err, err_len, "no backward kernel for dtype %u, head_dim %u, stage %u", dtype, head_dim, stage);
        return 1;
    });
}
