// Host entry points of the forward kernels under the emulator: the Rust
// `emu` backend calls these with the launch plan of `backend::launch`; they
// check the plan against the kernels' traits, then run the grid.
#include "../tree_attn_fwd.cu"

#include <cstdio>

namespace {

template <class Tr>
int check_plan(unsigned block_threads, size_t smem, uint32_t grid_x, uint32_t tokens, bool var, char* err,
               size_t err_len) {
    const int want_smem = var ? Tr::kSmemBytesVar : Tr::kSmemBytes;
    if (block_threads != unsigned(Tr::kThreads) || smem != size_t(want_smem)) {
        snprintf(err, err_len,
                 "launch plan (%u threads, %zu bytes of shared memory) does not match the kernel traits (%d threads, "
                 "%d bytes)",
                 block_threads, smem, Tr::kThreads, want_smem);
        return 1;
    }
    // One block per query tile of kBlockM rows: fewer would leave rows
    // unwritten, more are idle blocks.
    const uint32_t want = (tokens + Tr::kBlockM - 1) / Tr::kBlockM;
    if (grid_x != want) {
        snprintf(err, err_len, "launch plan grid.x %u, but %u tokens make %u query tiles of %d rows", grid_x, tokens,
                 want, Tr::kBlockM);
        return 1;
    }
    return 0;
}

}  // namespace

// dtype: 0 = bf16, 1 = f16. Traits of the forward kernel for head_dim:
// out = {block_m, block_n, threads, smem_bytes, row_stride}. Returns 0, or 1
// for a head dim without a kernel.
extern "C" int ta_emu_fwd_traits(uint32_t head_dim, int32_t* out) noexcept {
    return ta_emu::guard_entry("ta_emu_fwd_traits", nullptr, 0, [&]() -> int {
        auto fill = [&](auto tr) {
            using Tr = decltype(tr);
            out[0] = Tr::kBlockM;
            out[1] = Tr::kBlockN;
            out[2] = Tr::kThreads;
            out[3] = Tr::kSmemBytes;
            out[4] = Tr::kRowStride;
            return 0;
        };
#define TA_TRAITS(SUFFIX, E, HD, DT) \
    if (head_dim == HD) return fill(FwdTraits<E, HD>{});
        TA_ATTN_VARIANTS(TA_TRAITS)
#undef TA_TRAITS
        return 1;
    });
}

// var: 1 runs the variant kernel (tree_attn_fwd_var_*: key starts, softcap,
// sinks as *p says), 0 the plain one (which must get no variant argument).
extern "C" int ta_emu_tree_attn_fwd(uint32_t dtype, uint32_t head_dim, uint32_t var, const TreeAttnFwdParams* p,
                                    uint32_t grid_x, uint32_t grid_y, uint32_t block_threads, size_t smem,
                                    const ta_emu::Config* config, uint64_t* cp_async_bytes, char* err,
                                    size_t err_len) noexcept {
    return ta_emu::guard_entry("ta_emu_tree_attn_fwd", err, err_len, [&]() -> int {
        const dim3 grid(grid_x, grid_y), block(block_threads);
        if (!var && (p->key_start || p->sinks || p->softcap_c != 0.f)) {
            snprintf(err, err_len, "variant arguments (key starts, sinks, softcap) for the plain forward kernel");
            return 1;
        }
        const size_t q_bytes = size_t(p->tokens) * p->q_heads * head_dim * 2;
        const size_t kv_bytes = size_t(p->tokens) * p->kv_heads * head_dim * 2;
        // (kv_end and tile_kv_min: 4-byte cp.async with each K / V tile, and
        // the walk's look-ahead window of tile_kv_min / tile_kv_max;
        // the variant kernel's key starts with the Q tile.)
        const ta_emu::GlobalRange ranges[] = {{p->q, q_bytes, "q"},
                                              {p->k, kv_bytes, "k"},
                                              {p->v, kv_bytes, "v"},
                                              {p->kv_end, size_t(p->tokens) * 4, "kv_end"},
                                              {p->tile_kv_min, size_t(p->num_key_tiles) * 4, "tile_kv_min"},
                                              {p->tile_kv_max, size_t(p->num_key_tiles) * 4, "tile_kv_max"},
                                              {p->key_start, p->key_start ? size_t(p->tokens) * 4 : 0, "key_start"}};
        ta_emu::LaunchIo io;
        io.ranges = ranges;
        io.num_ranges = 7;
        io.cp_async_bytes = cp_async_bytes;
#define TA_CASE(SUFFIX, E, HD, DT)                                                                            \
        if (dtype == DT && head_dim == HD) {                                                                     \
            if (check_plan<FwdTraits<E, HD>>(block_threads, smem, grid_x, p->tokens, var, err, err_len)) return 1; \
            return ta_emu::launch_kernel<TreeAttnFwdParams>(var ? tree_attn_fwd_var_##SUFFIX : tree_attn_fwd_##SUFFIX, \
                                                            *p, grid, block, smem, *config, err, err_len, io);   \
        }
        TA_ATTN_VARIANTS(TA_CASE)
#undef TA_CASE
        snprintf(err, err_len, "no forward kernel for dtype %u, head_dim %u", dtype, head_dim);
        return 1;
    });
}

extern "C" int ta_emu_kv_tile_bounds(const KvTileBoundsParams* p, uint32_t grid_x, uint32_t block_threads,
                                     const ta_emu::Config* config, char* err, size_t err_len) noexcept {
    return ta_emu::guard_entry("ta_emu_kv_tile_bounds", err, err_len, [&]() -> int {
        return ta_emu::launch_kernel<KvTileBoundsParams>(tree_attn_kv_tile_bounds, *p, dim3(grid_x), dim3(block_threads), 0,
                                                 *config, err, err_len);
    });
}
