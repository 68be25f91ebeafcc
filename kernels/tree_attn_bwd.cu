// Tree-attention backward: FlashAttention-2 backward on a pack with the
// interval mask of DESIGN §4 (query q sees key k iff k <= q < kv_end[k]).
// Per query head h (kv head h / group), with P recomputed from the saved LSE:
//
//   P  = exp(scale · Q Kᵀ − LSE) (masked),   D = rowsum(dO ∘ O)
//   dP = dO Vᵀ,   dS = P ∘ (dP − D)
//   dQ = scale · dS K,   dK = scale · dSᵀ Q,   dV = Pᵀ dO
//
// dK and dV of a kv head sum over the `group` query heads that read it: the
// main kernel loops over those heads inside the block (no reduction buffer,
// deterministic). When key tiles · kv_heads blocks are too few to fill the
// GPU, the launch plan splits the group over grid.z (group splits, the rule
// is `backend::launch::bwd::group_splits`): z-slice s loops over query heads
// s · group / splits .. (s + 1) · group / splits only and stores its f32
// partial dK (scaled) and dV into p.dkv_accum [splits, 2, tokens, kv_heads,
// D]; tree_attn_bwd_dkv_convert then sums the slices in index order (no
// atomics: bit-identical from run to run) into dK, dV. One split: the main
// kernel writes dK, dV itself and dkv_accum is null. A row with no visible key (LSE = −inf) gets P = 0, so dS = 0
// and it adds nothing; rows and keys past the pack and padding keys
// (kv_end[k] == k) likewise.
//
// Layout: Q, O, dO, dQ: [tokens, q_heads, D]; K, V, dK, dV: [tokens, kv_heads,
// D], 16-bit elements; LSE, D: [q_heads, tokens] f32; the dQ accumulator:
// [tokens, q_heads, D] f32. Natural-log LSE is turned into base 2 once per
// row (lse2 = LSE · log2 e, +inf for a row with none), so P = exp2(S·c −
// lse2) with c = scale · log2 e, exactly as the forward computes it.
//
// Kernels (one call runs 3 to 5 of them, in this order):
//   tree_attn_bwd_pre   D = rowsum(dO ∘ O) per (row, head), f32; zeroes the
//                       dQ accumulator rows in atomic mode. One warp per
//                       (row, head).
//   tree_attn_bwd_main  dK, dV (and, in atomic mode, dQ through f32
//                       atomicAdd into the accumulator). One block per (key
//                       tile, kv head, group split): grid (key tiles,
//                       kv_heads, group splits).
//   tree_attn_bwd_dq    deterministic mode only: dQ per (query tile, query
//                       head), plain f32 stores into the accumulator.
//   tree_attn_bwd_dq_convert   accumulator → dQ in the element type.
//   tree_attn_bwd_dkv_convert  group splits > 1 only: Σ over the splits of
//                       the f32 partials → dK, dV in the element type. One
//                       warp per (key row, kv head).
//
// Main kernel tiling (BwdTraits, kernel_traits.cuh): a key tile of kBlockN =
// 64 keys, 4 warps, warp w owns keys 16w..16w+15 and holds their dK and dV
// (16 x D each, f32, mma C fragments) for the whole block. K and V of the tile stay in shared
// memory; query tiles of kBlockM rows (64 for D = 64, 32 for D = 128, to keep
// the f32 accumulators plus Sᵀ and dPᵀ under 255 registers) stream through a
// double-buffered pipeline: Q and dO by cp.async, lse2 and D (BM floats
// each, double-buffered beside them) by plain loads in the same stage() call
// — the rows of the [q_heads, tokens] LSE / D start at head · tokens + q0,
// 16-byte aligned only when tokens % 4 == 0, and common.cuh has only the
// 16-byte cp.async (a 4-byte one with its emulator model would let them
// join the cp.async group; not done). Per query tile:
//   Sᵀ  (16 x BM per warp) = K Qᵀ   A: ldmatrix.x4 on the warp's K rows
//                                    (D = 64: loaded once per block and held
//                                    in registers, 16 per operand, instead of
//                                    once per query tile);
//                                    B: ldmatrix.x4 on Q rows (Q row-major is
//                                    Qᵀ column-major)
//   dPᵀ (16 x BM)          = V dOᵀ  same, with V and dO
//   Pᵀ = exp2(Sᵀ·c − lse2[q]),  dSᵀ = Pᵀ ∘ (dPᵀ − D[q])  (in registers)
//   dV (16 x D) += Pᵀ dO   A: Pᵀ's C fragments rounded to 16 bits are its A
//                          fragments (two n-tiles = one k-step);
//                          B: ldmatrix.x4.trans on dO rows
//   dK (16 x D) += dSᵀ Q   same, with dSᵀ and Q
//   atomic mode: dSᵀ goes to shared memory ([key][query], 16-bit); then
//   dQ (BM x D) = dS K     A: ldmatrix.x4.trans on dSᵀ (its transpose is dS);
//                          B: ldmatrix.x4.trans on K rows; the warps split
//                          BM x D into 16-row x (D / warps-per-row) pieces,
//                          computed 16 columns at a time and added to the
//                          f32 accumulator with atomicAdd.
// Fragment layouts (PTX ISA, mma.m16n8k16; g = lane/4, c = lane%4):
//   A 16x16: a[r] half h = A[g + 8(r&1)][2c + h + 8(r>>1)]
//   B 16x8:  b[r] half h = B[2c + h + 8r][g]
//   C 16x8:  acc[i]      = C[g + 8(i>>1)][2c + (i&1)]
// so a thread holds keys g and g+8 of its warp's 16 and, per n-tile, the
// query columns 2c, 2c+1.
//
// Which query tiles. Key k is seen by the queries [k, kv_end[k]); the block
// visits exactly the query tiles that meet the union of those intervals over
// its 64 keys (a subset of the contiguous range [k0, max kv_end)): from a
// query x the next visible query is min over keys with kv_end[k] > max(k, x)
// of max(k, x), read off the tile's kv_end staged in shared memory: each
// lane tests 2 of the 64 keys and a warp min by __shfl_xor_sync gives every
// lane the same result (2 compares + 5 shuffles per step instead of 64
// compares). Each visited tile is
// full (no element mask: k1 − 1 <= q0, min kv_end >= q1, both tiles inside
// the pack) or partial (element mask k <= q < kv_end[k]); both tests are
// mask.cuh's. Tiles are staged by tile_load.cuh's loader.
//
// Stores. The main kernel's unsplit epilogue rounds dK (scaled) and dV to
// the element type into shared memory (the K and V tile buffers, free after
// the loop) and writes them with 16-byte stores, consecutive threads on
// consecutive 16-byte chunks of a row; dq_convert and dkv_convert give each
// lane 8 elements (one 16-byte store). Rows past the pack are never stored;
// dQ, dK, dV must be 16-byte aligned (both backends check it). The split
// path's f32 partials are plain 4-byte stores from the fragments.
//
// Block order: the main kernel's blockIdx.x is the key tile (the first key
// tiles are seen by the most queries: heaviest first); the dQ kernel runs
// its query tiles last-first (the last ones see the most keys), as the
// forward does.
//
// Deterministic mode. The main kernel skips its dQ part, and tree_attn_bwd_dq
// (one block of 4 warps per 64 query rows and query head, the forward's
// tiling and tile walk) recomputes, per visible key tile, S = Q Kᵀ, P, dP =
// dO Vᵀ and dS, then dQ += dS K in registers (B: ldmatrix.x4.trans on K). Per
// visible (query tile, key tile) pair atomic mode does 5 tile matmuls (S, dP,
// dV, dK, dQ), deterministic mode 4 + 3 = 7: 1.4x the matmul FLOPs and twice
// the exp2 work, but no atomics and a bit-identical dQ from run to run. (The
// dQ kernel walks key tiles by the forward's min / max rule, which can keep a
// few tile pairs the main kernel's exact interval walk drops: padding runs.)
//
// Rotary is not these kernels' concern: with rotary on, the backends rotate Q
// and K once into scratch buffers (kernels/rope.cu), run these kernels on
// them, and rotate the dQ and dK they write back (the transpose rotation).
#include "kernel_traits.cuh"
#include "mask.cuh"
#include "tile_load.cuh"

// Arguments of every backward kernel (one struct by value). Mirrored by
// `crate::backend::launch::bwd::BwdParams` in Rust; both sides assert the
// layout.
struct TreeAttnBwdParams {
    const uint16_t* q;
    const uint16_t* k;
    const uint16_t* v;
    const uint16_t* o;
    const uint16_t* d_o;
    const float* lse;   // [q_heads, tokens], natural log
    float* delta;       // [q_heads, tokens]
    float* dq_accum;    // [tokens, q_heads, D]
    uint16_t* dq;
    uint16_t* dk;
    uint16_t* dv;
    const uint32_t* kv_end;       // [tokens]
    const uint32_t* tile_kv_min;  // [num_key_tiles], tiles of 64 keys
    const uint32_t* tile_kv_max;
    float* dkv_accum;  // [group_splits, 2, tokens, kv_heads, D] f32 (dK scaled, dV); group_splits > 1 only
    uint32_t tokens;
    uint32_t q_heads;
    uint32_t kv_heads;
    uint32_t num_key_tiles;
    float scale;       // softmax scale
    float scale_log2;  // softmax scale · log2 e
    uint32_t head_dim;
    uint32_t zero_dq_accum;  // tree_attn_bwd_pre: also zero the accumulator
    uint32_t group_splits;   // the main kernel's gridDim.z; it divides q_heads / kv_heads
    uint32_t reserved;
};
static_assert(sizeof(TreeAttnBwdParams) == 160, "TreeAttnBwdParams: update its Rust mirror");
TA_FIELD_AT(TreeAttnBwdParams, q, 0); TA_FIELD_AT(TreeAttnBwdParams, k, 8); TA_FIELD_AT(TreeAttnBwdParams, v, 16);
TA_FIELD_AT(TreeAttnBwdParams, o, 24); TA_FIELD_AT(TreeAttnBwdParams, d_o, 32);
TA_FIELD_AT(TreeAttnBwdParams, lse, 40); TA_FIELD_AT(TreeAttnBwdParams, delta, 48);
TA_FIELD_AT(TreeAttnBwdParams, dq_accum, 56); TA_FIELD_AT(TreeAttnBwdParams, dq, 64);
TA_FIELD_AT(TreeAttnBwdParams, dk, 72); TA_FIELD_AT(TreeAttnBwdParams, dv, 80);
TA_FIELD_AT(TreeAttnBwdParams, kv_end, 88); TA_FIELD_AT(TreeAttnBwdParams, tile_kv_min, 96);
TA_FIELD_AT(TreeAttnBwdParams, tile_kv_max, 104); TA_FIELD_AT(TreeAttnBwdParams, dkv_accum, 112);
TA_FIELD_AT(TreeAttnBwdParams, tokens, 120); TA_FIELD_AT(TreeAttnBwdParams, q_heads, 124);
TA_FIELD_AT(TreeAttnBwdParams, kv_heads, 128); TA_FIELD_AT(TreeAttnBwdParams, num_key_tiles, 132);
TA_FIELD_AT(TreeAttnBwdParams, scale, 136); TA_FIELD_AT(TreeAttnBwdParams, scale_log2, 140);
TA_FIELD_AT(TreeAttnBwdParams, head_dim, 144); TA_FIELD_AT(TreeAttnBwdParams, zero_dq_accum, 148);
TA_FIELD_AT(TreeAttnBwdParams, group_splits, 152); TA_FIELD_AT(TreeAttnBwdParams, reserved, 156);

#define TA_LOG2E 1.4426950408889634f

// lse2 = LSE · log2 e, or +inf for a row with no visible key and for rows past
// the pack, so that exp2(S·c − lse2) is exactly 0 there. An invalid LSE (NaN
// or +inf: not from a forward) gives NaN, so that the row's gradients are NaN
// rather than a silent 0 (the emulator wrapper, and the CUDA one with
// check_finite, report it as an Err before the launch).
__device__ __forceinline__ float ta_bwd_lse2(const TreeAttnBwdParams& p, uint32_t head, uint32_t row) {
    if (row >= p.tokens) return INFINITY;
    const float l = p.lse[(size_t)head * p.tokens + row];
    if (l == -INFINITY) return INFINITY;
    return l < INFINITY ? l * TA_LOG2E : NAN;
}

// The tile loader's skip (tile_load.cuh) for Q and dO rows: a query that sees
// no key (LSE = −inf) is loaded as zeros, so that what its rows hold never
// reaches dK or dV through 0 · NaN (DESIGN §5); `lse` is the head's row.
struct TaBlindQuery {
    const float* lse;
    __device__ __forceinline__ bool operator()(uint32_t row) const { return lse[row] == -INFINITY; }
};

// acc[n] = A Bᵀ for the warp: A is 16 rows of `a_rows` (row stride RS), B is
// the N rows of `b_rows`, both [row][D] 16-bit in shared memory; acc is 16 x N
// in C fragments (N / 8 n-tiles).
template <class E, int D, int N, int RS>
__device__ __forceinline__ void ta_bwd_mm_abt(float (&acc)[N / 8][4], const uint16_t* a_rows, const uint16_t* b_rows) {
    const unsigned lane = ta_lane(), mi = lane >> 3, ri = lane & 7;
#pragma unroll
    for (int n = 0; n < N / 8; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[n][i] = 0.f;
    // Not unrolled: kk indexes no register array, and a rolled loop keeps
    // ptxas from hoisting every k-step's fragments (register pressure).
#pragma unroll 1
    for (int kk = 0; kk < D / 16; ++kk) {
        uint32_t a[4];
        ta_ldmatrix_x4(a, a_rows + (ri + 8 * (mi & 1)) * RS + kk * 16 + 8 * (mi >> 1));
#pragma unroll
        for (int np = 0; np < N / 16; ++np) {
            uint32_t b[4];
            ta_ldmatrix_x4(b, b_rows + (np * 16 + ri + 8 * (mi >> 1)) * RS + kk * 16 + 8 * (mi & 1));
            ta_mma_16816<E>(acc[2 * np], a, b[0], b[1]);
            ta_mma_16816<E>(acc[2 * np + 1], a, b[2], b[3]);
        }
    }
}

// As ta_bwd_mm_abt, with the warp's A fragments (16 rows x D) already in
// registers: a[kk] is the ldmatrix.x4 of k-step kk.
template <class E, int D, int N, int RS>
__device__ __forceinline__ void ta_bwd_mm_abt_ra(float (&acc)[N / 8][4], const uint32_t (&a)[D / 16][4],
                                                 const uint16_t* b_rows) {
    const unsigned lane = ta_lane(), mi = lane >> 3, ri = lane & 7;
#pragma unroll
    for (int n = 0; n < N / 8; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[n][i] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
        for (int np = 0; np < N / 16; ++np) {
            uint32_t b[4];
            ta_ldmatrix_x4(b, b_rows + (np * 16 + ri + 8 * (mi >> 1)) * RS + kk * 16 + 8 * (mi & 1));
            ta_mma_16816<E>(acc[2 * np], a[kk], b[0], b[1]);
            ta_mma_16816<E>(acc[2 * np + 1], a[kk], b[2], b[3]);
        }
    }
}

// acc (16 x D) += X · B where X (16 x K) is given as C fragments x[K / 8][4]
// (rounded to E here: they become A fragments) and B is K rows [row][D] of
// 16-bit elements in shared memory (ldmatrix.trans).
template <class E, int D, int K, int RS>
__device__ __forceinline__ void ta_bwd_mm_cb(float (&acc)[D / 8][4], const float (&x)[K / 8][4],
                                             const uint16_t* b_rows) {
    const unsigned lane = ta_lane(), mi = lane >> 3, ri = lane & 7;
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) {
        const uint32_t a[4] = {
            ta_pack2<E>(x[2 * kk][0], x[2 * kk][1]),
            ta_pack2<E>(x[2 * kk][2], x[2 * kk][3]),
            ta_pack2<E>(x[2 * kk + 1][0], x[2 * kk + 1][1]),
            ta_pack2<E>(x[2 * kk + 1][2], x[2 * kk + 1][3]),
        };
#pragma unroll
        for (int dp = 0; dp < D / 16; ++dp) {
            uint32_t b[4];
            ta_ldmatrix_x4_trans(b, b_rows + (kk * 16 + ri + 8 * (mi & 1)) * RS + dp * 16 + 8 * (mi >> 1));
            ta_mma_16816<E>(acc[2 * dp], a, b[0], b[1]);
            ta_mma_16816<E>(acc[2 * dp + 1], a, b[2], b[3]);
        }
    }
}

// 8 floats -> 8 elements of E at `dst` (16-byte aligned), one 16-byte
// store (round to nearest even). nvcc (13.0) splits the store of a ta_vec16
// or a uint4 built from registers into 4 STG.32, so the store is written in
// PTX (st.global.v4: one STG.128).
template <class E>
__device__ __forceinline__ void ta_bwd_store8(uint16_t* dst, const float* x) {
    const uint32_t a = ta_pack2<E>(x[0], x[1]), b = ta_pack2<E>(x[2], x[3]);
    const uint32_t c = ta_pack2<E>(x[4], x[5]), d = ta_pack2<E>(x[6], x[7]);
#ifdef TA_EMU
    *reinterpret_cast<ta_vec16*>(dst) = ta_vec16{a, b, c, d};
#else
    asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(dst), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
#endif
}

// ---- D = rowsum(dO ∘ O) ------------------------------------------------------
template <class E, int D>
__device__ __forceinline__ void tree_attn_bwd_pre_body(const TreeAttnBwdParams& p) {
    const uint64_t item = (uint64_t)blockIdx.x * 4 + threadIdx.x / 32;
    if (item >= (uint64_t)p.tokens * p.q_heads) return;  // whole warps leave together
    const uint32_t row = uint32_t(item / p.q_heads), head = uint32_t(item % p.q_heads);
    const size_t at = ((size_t)row * p.q_heads + head) * D;
    float acc = 0.f;
    // A row that sees no key has D = 0 whatever dO holds (DESIGN §5).
    const bool blind = p.lse[(size_t)head * p.tokens + row] == -INFINITY;
#pragma unroll
    for (int j = ta_lane(); j < D && !blind; j += 32)
        acc += ta_to_f32<E>(p.o[at + j]) * ta_to_f32<E>(p.d_o[at + j]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(TA_FULL_MASK, acc, o);
    if (ta_lane() == 0) p.delta[(size_t)head * p.tokens + row] = acc;
    if (p.zero_dq_accum)
        for (int j = ta_lane(); j < D; j += 32) p.dq_accum[at + j] = 0.f;
}

// ---- dK, dV (and atomic dQ) per key tile ----------------------------------------
template <class Tr, bool kAtomicDq>
__device__ __forceinline__ void tree_attn_bwd_main_body(const TreeAttnBwdParams& p) {
    using E = typename Tr::Elem;
    constexpr int D = Tr::kHeadDim, BM = Tr::kBlockM, BN = Tr::kBlockN, RS = Tr::kRowStride;
    constexpr int DSS = Tr::kDsStride;
    constexpr int kDTiles = D / 8;   // n-tiles of dK, dV per warp
    constexpr int kMTiles = BM / 8;  // n-tiles of Sᵀ, dPᵀ per warp

    TA_DYNAMIC_SMEM(smem_raw);
    uint16_t* const sk = reinterpret_cast<uint16_t*>(smem_raw);
    uint16_t* const sv = sk + Tr::kKvElems;
    uint16_t* const sq = reinterpret_cast<uint16_t*>(smem_raw + Tr::kOffQ);  // 2 buffers
    uint16_t* const sdo = sq + 2 * Tr::kQElems;                               // 2 buffers
    uint16_t* const sds = reinterpret_cast<uint16_t*>(smem_raw + Tr::kOffDs);
    float* const slse = reinterpret_cast<float*>(smem_raw + Tr::kOffRowStats);  // 2 x BM
    float* const sdelta = slse + 2 * BM;                                          // 2 x BM
    uint32_t* const skv = reinterpret_cast<uint32_t*>(smem_raw + Tr::kOffKvEnd);

    const uint32_t L = p.tokens;
    const uint32_t tile = blockIdx.x, kv_head = blockIdx.y, split = blockIdx.z;
    const uint32_t k0 = tile * BN;
    const uint32_t group = p.q_heads / p.kv_heads;
    // This z-slice's query heads: [head_begin, head_end), group / splits of
    // the kv head's group.
    const uint32_t per_split = group / p.group_splits;
    const uint32_t head_begin = kv_head * group + split * per_split, head_end = head_begin + per_split;
    const unsigned lane = ta_lane(), warp = threadIdx.x / 32;
    const unsigned g = lane >> 2, c = lane & 3;

    const TaUnseenKey unseen = ta_unseen_keys(p.kv_end, p.tile_kv_min, tile, BN, L);
    ta_load_tile<BN, D, RS, Tr::kThreads>(sk, p.k, k0, L, p.kv_heads, kv_head, unseen);
    ta_load_tile<BN, D, RS, Tr::kThreads>(sv, p.v, k0, L, p.kv_heads, kv_head, unseen);
    ta_cp_async_commit();
    // kv_end of the tile; keys past the pack are seen by nobody (0).
    if (threadIdx.x < BN) skv[threadIdx.x] = ta_key_end(p.kv_end, k0 + threadIdx.x, L);
    // This thread's two keys (rows g and g + 8 of the warp's 16).
    uint32_t key[2], key_end[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        key[r] = k0 + warp * 16 + g + 8 * r;
        key_end[r] = ta_key_end(p.kv_end, key[r], L);
    }
    ta_cp_async_wait<0>();
    __syncthreads();

    // D = 64: the warp's K and V A fragments stay in registers for the whole
    // block (2 x 16 registers) instead of an ldmatrix per query tile.
    constexpr bool kHoistA = D == 64;
    uint32_t ka[kHoistA ? D / 16 : 1][4], va[kHoistA ? D / 16 : 1][4];
    if constexpr (kHoistA) {
        const unsigned mi = lane >> 3, ri = lane & 7;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            const int at = (warp * 16 + ri + 8 * (mi & 1)) * RS + kk * 16 + 8 * (mi >> 1);
            ta_ldmatrix_x4(ka[kk], sk + at);
            ta_ldmatrix_x4(va[kk], sv + at);
        }
    }

    // The first query tile at or after query x that sees a key of the tile
    // (0xffffffff when none): min over keys with kv_end[k] > max(k, x) of
    // max(k, x). Each lane takes BN / 32 keys (lane, lane + 32), then a warp
    // min by butterfly shuffles, so every lane of every warp holds the same
    // result. All lanes must call it together (full-mask shuffles): it runs
    // in block-uniform control flow only.
    static_assert(BN % 32 == 0, "whole keys per lane");
    auto next_qtile = [&](uint32_t x) {
        uint32_t best = 0xffffffffu;
#pragma unroll
        for (int j = 0; j < BN / 32; ++j) {
            const uint32_t i = lane + 32 * j;
            const uint32_t lo = max(k0 + i, x);
            if (skv[i] > lo) best = min(best, lo);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) best = min(best, __shfl_xor_sync(TA_FULL_MASK, best, o));
        return best == 0xffffffffu ? best : best / BM;
    };
    const uint32_t first_qt = next_qtile(0);
    const uint32_t tile_min = p.tile_kv_min[tile];

    // Stages query tile qt of query head `head` into buffer b.
    auto stage = [&](uint32_t head, uint32_t qt, int b) {
        const TaBlindQuery blind{p.lse + (size_t)head * L};
        ta_load_tile<BM, D, RS, Tr::kThreads>(sq + b * Tr::kQElems, p.q, qt * BM, L, p.q_heads, head, blind);
        ta_load_tile<BM, D, RS, Tr::kThreads>(sdo + b * Tr::kQElems, p.d_o, qt * BM, L, p.q_heads, head, blind);
        for (int i = threadIdx.x; i < BM; i += Tr::kThreads) {
            const uint32_t row = qt * BM + i;
            slse[b * BM + i] = ta_bwd_lse2(p, head, row);
            sdelta[b * BM + i] = row < L ? p.delta[(size_t)head * L + row] : 0.f;
        }
    };

    float dk[kDTiles][4], dv[kDTiles][4];
#pragma unroll
    for (int n = 0; n < kDTiles; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) dk[n][i] = dv[n][i] = 0.f;

    // Iteration over (query head, query tile qt).
    uint32_t head = head_begin, qt = first_qt;
    if (qt != 0xffffffffu) stage(head, qt, 0);
    ta_cp_async_commit();
    int buf = 0;
    while (qt != 0xffffffffu) {
        uint32_t nhead = head, nqt = next_qtile((qt + 1) * BM);
        if (nqt == 0xffffffffu && ++nhead < head_end) nqt = first_qt;
        if (nqt != 0xffffffffu) stage(nhead, nqt, buf ^ 1);
        ta_cp_async_commit();
        ta_cp_async_wait<1>();  // tile (gi, qt) has landed
        __syncthreads();

        const uint32_t q0 = qt * BM;
        const uint16_t* const qb = sq + buf * Tr::kQElems;
        const uint16_t* const dob = sdo + buf * Tr::kQElems;
        const float* const lse2 = slse + buf * BM;
        const float* const dlt = sdelta + buf * BM;

        // Sᵀ = K Qᵀ and dPᵀ = V dOᵀ for the warp's 16 keys and the BM queries.
        float s[kMTiles][4], dp[kMTiles][4];
        if constexpr (kHoistA) {
            ta_bwd_mm_abt_ra<E, D, BM, RS>(s, ka, qb);
            ta_bwd_mm_abt_ra<E, D, BM, RS>(dp, va, dob);
        } else {
            ta_bwd_mm_abt<E, D, BM, RS>(s, sk + warp * 16 * RS, qb);
            ta_bwd_mm_abt<E, D, BM, RS>(dp, sv + warp * 16 * RS, dob);
        }

        // Full also needs the whole query tile inside the pack: q1 is not
        // clipped here, and a query tile that runs past the pack is partial.
        const bool full = TA_TILE_FULL(BN, k0, q0, q0 + BM, tile_min, L) && q0 + BM <= L;
#pragma unroll
        for (int n = 0; n < kMTiles; ++n) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int ql = n * 8 + 2 * c + (i & 1);
                const uint32_t qrow = q0 + ql;
                const int r = i >> 1;
                float pv = ta_exp2(s[n][i] * p.scale_log2 - lse2[ql]);
                if (!full && !TA_VISIBLE(key[r], key_end[r], qrow)) pv = 0.f;
                s[n][i] = pv;                         // Pᵀ
                dp[n][i] = pv * (dp[n][i] - dlt[ql]);  // dSᵀ
            }
        }

        ta_bwd_mm_cb<E, D, BM, RS>(dv, s, dob);
        ta_bwd_mm_cb<E, D, BM, RS>(dk, dp, qb);

        if (kAtomicDq) {
            // dSᵀ -> shared memory, [key][query].
#pragma unroll
            for (int n = 0; n < kMTiles; ++n)
#pragma unroll
                for (int r = 0; r < 2; ++r)
                    *reinterpret_cast<uint32_t*>(sds + (warp * 16 + g + 8 * r) * DSS + n * 8 + 2 * c) =
                        ta_pack2<E>(dp[n][2 * r], dp[n][2 * r + 1]);
            __syncthreads();
            // dQ (BM x D) = dS K: warp -> 16 query rows (m-tile mt) x a D / kSplit slice.
            constexpr int kRowTiles = BM / 16, kSplit = Tr::kWarps / kRowTiles;
            constexpr int kPairsPerWarp = D / 16 / kSplit;  // 16-column pieces
            const unsigned mt = warp % kRowTiles, part = warp / kRowTiles;
            const unsigned mi = lane >> 3, ri = lane & 7;
            uint32_t a[BN / 16][4];
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk)
                ta_ldmatrix_x4_trans(a[kk], sds + (kk * 16 + 8 * (mi >> 1) + ri) * DSS + mt * 16 + 8 * (mi & 1));
            const uint32_t rows[2] = {q0 + mt * 16 + g, q0 + mt * 16 + g + 8};
#pragma unroll
            for (int j = 0; j < kPairsPerWarp; ++j) {
                const int dpi = part * kPairsPerWarp + j;
                float acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
                for (int kk = 0; kk < BN / 16; ++kk) {
                    uint32_t b[4];
                    ta_ldmatrix_x4_trans(b, sk + (kk * 16 + ri + 8 * (mi & 1)) * RS + dpi * 16 + 8 * (mi >> 1));
                    ta_mma_16816<E>(acc[0], a[kk], b[0], b[1]);
                    ta_mma_16816<E>(acc[1], a[kk], b[2], b[3]);
                }
#pragma unroll
                for (int h2 = 0; h2 < 2; ++h2)
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const uint32_t row = rows[i >> 1];
                        if (row < L)
                            atomicAdd(p.dq_accum + ((size_t)row * p.q_heads + head) * D + dpi * 16 + h2 * 8 + 2 * c +
                                          (i & 1),
                                      acc[h2][i] * p.scale);
                    }
            }
        }
        __syncthreads();  // buffer `buf` (and dSᵀ) free before they are refilled
        head = nhead;
        qt = nqt;
        buf ^= 1;
    }

    if (p.group_splits > 1) {
        // This slice's f32 partial dK (scaled) and dV, summed over the
        // slices by tree_attn_bwd_dkv_convert.
        const size_t kv_len = (size_t)L * p.kv_heads * D;
        float* const pk = p.dkv_accum + (size_t)split * 2 * kv_len;
        float* const pv = pk + kv_len;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            if (key[r] >= L) continue;
            const size_t at = ((size_t)key[r] * p.kv_heads + kv_head) * D;
#pragma unroll
            for (int n = 0; n < kDTiles; ++n) {
                const size_t e = at + n * 8 + 2 * c;
                pv[e] = dv[n][2 * r];
                pv[e + 1] = dv[n][2 * r + 1];
                pk[e] = dk[n][2 * r] * p.scale;
                pk[e + 1] = dk[n][2 * r + 1] * p.scale;
            }
        }
        return;
    }
    // dV and dK (scaled) in the element type through shared memory — the K
    // and V tile buffers, which nothing reads after the loop's last barrier
    // (and, with no query tile visited, after the first one) — then 16-byte
    // stores, D / 8 per row, consecutive threads on consecutive chunks of a
    // row; rows past the pack are never stored.
    uint16_t* const sdk = sk;
    uint16_t* const sdv = sv;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = warp * 16 + g + 8 * r;
#pragma unroll
        for (int n = 0; n < kDTiles; ++n) {
            *reinterpret_cast<uint32_t*>(sdv + row * RS + n * 8 + 2 * c) = ta_pack2<E>(dv[n][2 * r], dv[n][2 * r + 1]);
            *reinterpret_cast<uint32_t*>(sdk + row * RS + n * 8 + 2 * c) =
                ta_pack2<E>(dk[n][2 * r] * p.scale, dk[n][2 * r + 1] * p.scale);
        }
    }
    __syncthreads();
    constexpr int kChunks = D / 8;
#pragma unroll
    for (int it = 0; it < BN * kChunks / Tr::kThreads; ++it) {
        const int i = it * Tr::kThreads + threadIdx.x;
        const int r = i / kChunks, ch = i % kChunks;
        if (k0 + r >= L) continue;
        const size_t at = ((size_t)(k0 + r) * p.kv_heads + kv_head) * D + ch * 8;
        *reinterpret_cast<ta_vec16*>(p.dk + at) = *reinterpret_cast<const ta_vec16*>(sdk + r * RS + ch * 8);
        *reinterpret_cast<ta_vec16*>(p.dv + at) = *reinterpret_cast<const ta_vec16*>(sdv + r * RS + ch * 8);
    }
}

// ---- deterministic dQ per query tile ---------------------------------------------
template <class Tr>
__device__ __forceinline__ void tree_attn_bwd_dq_body(const TreeAttnBwdParams& p) {
    using E = typename Tr::Elem;
    constexpr int D = Tr::kHeadDim, BM = Tr::kBlockM, BN = Tr::kBlockN, RS = Tr::kRowStride;
    constexpr int kNTiles = BN / 8, kDTiles = D / 8;

    TA_DYNAMIC_SMEM(smem_raw);
    uint16_t* const sq = reinterpret_cast<uint16_t*>(smem_raw);
    uint16_t* const sdo = sq + Tr::kTileElems;
    uint16_t* const sk = sdo + Tr::kTileElems;     // 2 buffers
    uint16_t* const sv = sk + 2 * Tr::kTileElems;  // 2 buffers

    const uint32_t L = p.tokens;
    // Heaviest query tiles (the last ones, which see the most keys) first.
    const uint32_t q0 = (gridDim.x - 1 - blockIdx.x) * BM, head = blockIdx.y;
    const uint32_t kv_head = head / (p.q_heads / p.kv_heads);
    const uint32_t q1 = q0 + BM < L ? q0 + BM : L;
    const unsigned lane = ta_lane(), warp = threadIdx.x / 32;
    const unsigned g = lane >> 2, c = lane & 3;

    const uint32_t t_end = min(p.num_key_tiles, (q1 - 1) / BN + 1);
    // The next key tile with a visible key. D = 128: the forward's walk
    // (mask.cuh, 32 tiles per step). D = 64 keeps one dependent load per
    // skipped tile: the kernel sits at the 128 registers of its
    // 4-blocks-per-SM bound (BwdDqTraits::kMinBlocks), and the ballot walk
    // costs it one more (a 4-byte spill on sm_90a, CUDA 13.0).
    auto next_tile = [&](uint32_t t) -> uint32_t {
        if constexpr (D == 128) {
            return ta_next_visible_tile(p.tile_kv_max, t, t_end, q0);
        } else {
            while (t < t_end && p.tile_kv_max[t] <= q0) ++t;
            return t;
        }
    };

    const TaBlindQuery blind{p.lse + (size_t)head * L};
    ta_load_tile<BM, D, RS, Tr::kThreads>(sq, p.q, q0, L, p.q_heads, head, blind);
    ta_load_tile<BM, D, RS, Tr::kThreads>(sdo, p.d_o, q0, L, p.q_heads, head, blind);
    ta_cp_async_commit();
    uint32_t t = next_tile(0);
    if (t < t_end) {
        const TaUnseenKey unseen = ta_unseen_keys(p.kv_end, p.tile_kv_min, t, BN, L);
        ta_load_tile<BN, D, RS, Tr::kThreads>(sk, p.k, t * BN, L, p.kv_heads, kv_head, unseen);
        ta_load_tile<BN, D, RS, Tr::kThreads>(sv, p.v, t * BN, L, p.kv_heads, kv_head, unseen);
    }
    ta_cp_async_commit();
    ta_cp_async_wait<1>();  // Q, dO have landed
    __syncthreads();

    const uint32_t rows[2] = {q0 + warp * 16 + g, q0 + warp * 16 + g + 8};
    float lse2[2], dlt[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        lse2[r] = ta_bwd_lse2(p, head, rows[r]);
        dlt[r] = rows[r] < L ? p.delta[(size_t)head * L + rows[r]] : 0.f;
    }
    float acc[kDTiles][4];
#pragma unroll
    for (int n = 0; n < kDTiles; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[n][i] = 0.f;

    int buf = 0;
    while (t < t_end) {
        const uint32_t tn = next_tile(t + 1);
        if (tn < t_end) {
            const TaUnseenKey unseen = ta_unseen_keys(p.kv_end, p.tile_kv_min, tn, BN, L);
            ta_load_tile<BN, D, RS, Tr::kThreads>(sk + (buf ^ 1) * Tr::kTileElems, p.k, tn * BN, L, p.kv_heads,
                                                      kv_head, unseen);
            ta_load_tile<BN, D, RS, Tr::kThreads>(sv + (buf ^ 1) * Tr::kTileElems, p.v, tn * BN, L, p.kv_heads,
                                                      kv_head, unseen);
        }
        ta_cp_async_commit();
        ta_cp_async_wait<1>();  // tile t has landed
        __syncthreads();
        const uint16_t* const kt = sk + buf * Tr::kTileElems;
        const uint16_t* const vt = sv + buf * Tr::kTileElems;
        const uint32_t k0 = t * BN;

        float s[kNTiles][4], dp[kNTiles][4];
        ta_bwd_mm_abt<E, D, BN, RS>(s, sq + warp * 16 * RS, kt);
        ta_bwd_mm_abt<E, D, BN, RS>(dp, sdo + warp * 16 * RS, vt);

        const bool full = TA_TILE_FULL(BN, k0, q0, q1, p.tile_kv_min[t], L);
#pragma unroll
        for (int n = 0; n < kNTiles; ++n) {
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const uint32_t col = k0 + n * 8 + 2 * c + j;
                const uint32_t end = ta_key_end(p.kv_end, col, L);
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    float pv = ta_exp2(s[n][2 * r + j] * p.scale_log2 - lse2[r]);
                    if (!full && !TA_VISIBLE(col, end, rows[r])) pv = 0.f;
                    dp[n][2 * r + j] = pv * (dp[n][2 * r + j] - dlt[r]);  // dS
                }
            }
        }
        ta_bwd_mm_cb<E, D, BN, RS>(acc, dp, kt);
        __syncthreads();  // every warp is done with buffer `buf` before it is refilled
        t = tn;
        buf ^= 1;
    }

#pragma unroll
    for (int r = 0; r < 2; ++r) {
        if (rows[r] >= L) continue;
        float* out = p.dq_accum + ((size_t)rows[r] * p.q_heads + head) * D;
#pragma unroll
        for (int n = 0; n < kDTiles; ++n) {
            out[n * 8 + 2 * c] = acc[n][2 * r] * p.scale;
            out[n * 8 + 2 * c + 1] = acc[n][2 * r + 1] * p.scale;
        }
    }
}

// ---- dQ accumulator -> element type ------------------------------------------------
template <class E, int D>
__device__ __forceinline__ void tree_attn_bwd_dq_convert_body(const TreeAttnBwdParams& p) {
    const uint64_t item = (uint64_t)blockIdx.x * 4 + threadIdx.x / 32;
    if (item >= (uint64_t)p.tokens * p.q_heads) return;
    const size_t at = item * D;  // (row · q_heads + head) · D
    // One 16-byte store of 8 elements per lane (lanes D / 8 and up idle).
    const int j = ta_lane() * 8;
    if (j < D) ta_bwd_store8<E>(p.dq + at + j, p.dq_accum + at + j);
}

// ---- split dK, dV partials -> element type ------------------------------------------
// One warp per (key row, kv head): the sum over the group splits in index
// order (the same order every run).
template <class E, int D>
__device__ __forceinline__ void tree_attn_bwd_dkv_convert_body(const TreeAttnBwdParams& p) {
    const uint64_t item = (uint64_t)blockIdx.x * 4 + threadIdx.x / 32;
    if (item >= (uint64_t)p.tokens * p.kv_heads) return;
    const size_t at = item * D;  // (row · kv_heads + head) · D
    const size_t kv_len = (size_t)p.tokens * p.kv_heads * D;
    // 8 elements per lane (lanes D / 8 and up idle), one 16-byte store each.
    const int j = ta_lane() * 8;
    if (j >= D) return;
    float k[8], v[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) k[e] = v[e] = 0.f;
    for (uint32_t s = 0; s < p.group_splits; ++s) {
        const float* const pk = p.dkv_accum + 2 * s * kv_len + at + j;
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            k[e] += pk[e];
            v[e] += pk[kv_len + e];
        }
    }
    ta_bwd_store8<E>(p.dk + at + j, k);
    ta_bwd_store8<E>(p.dv + at + j, v);
}

#define TA_BWD_KERNELS(SUFFIX, E, D, DTYPE)                                                                         \
    extern "C" __global__ void __launch_bounds__(128) tree_attn_bwd_pre_##SUFFIX(const TreeAttnBwdParams p) {       \
        tree_attn_bwd_pre_body<E, D>(p);                                                                            \
    }                                                                                                               \
    extern "C" __global__ void __launch_bounds__(BwdTraits<E, D>::kThreads)                                        \
        tree_attn_bwd_main_atomic_##SUFFIX(const TreeAttnBwdParams p) {                                             \
        tree_attn_bwd_main_body<BwdTraits<E, D>, true>(p);                                                          \
    }                                                                                                               \
    extern "C" __global__ void __launch_bounds__(BwdTraits<E, D>::kThreads)                                        \
        tree_attn_bwd_main_det_##SUFFIX(const TreeAttnBwdParams p) {                                                \
        tree_attn_bwd_main_body<BwdTraits<E, D>, false>(p);                                                         \
    }                                                                                                               \
    extern "C" __global__ void                                                                                      \
        __launch_bounds__(BwdDqTraits<E, D>::kThreads, BwdDqTraits<E, D>::kMinBlocks)                               \
        tree_attn_bwd_dq_##SUFFIX(const TreeAttnBwdParams p) {                                                      \
        tree_attn_bwd_dq_body<BwdDqTraits<E, D>>(p);                                                                \
    }                                                                                                               \
    extern "C" __global__ void __launch_bounds__(128) tree_attn_bwd_dq_convert_##SUFFIX(const TreeAttnBwdParams p) { \
        tree_attn_bwd_dq_convert_body<E, D>(p);                                                                     \
    }                                                                                                               \
    extern "C" __global__ void __launch_bounds__(128) tree_attn_bwd_dkv_convert_##SUFFIX(const TreeAttnBwdParams p) { \
        tree_attn_bwd_dkv_convert_body<E, D>(p);                                                                    \
    }
TA_ATTN_VARIANTS(TA_BWD_KERNELS)
#undef TA_BWD_KERNELS
