// Compile-time tiling of the attention kernels: tile sizes, warps, the
// shared-memory row stride and the dynamic shared-memory layout of each
// kernel. The Rust launch plans mirror these (`backend::launch::FwdTraits`,
// `backend::launch::bwd::BwdTraits`) and the emulator entry points check every
// launch against them (kernels/emu/fwd_entry.cpp, bwd_entry.cpp).
//
// Common to all: 16-bit elements (E = ta_bf16 or ta_f16), head dim D a
// multiple of 16, blocks of kWarps = 4 warps, tiles of kBlockM query rows and
// kBlockN keys staged in shared memory row-major with a row stride of D + 8
// elements: the 8 row addresses of an ldmatrix are then 16 bytes apart modulo
// 128 and fall in distinct bank groups (no bank conflicts).
#pragma once

#include "common.cuh"

// The variant kernels' extra shared memory: the key starts of the query
// rows a block holds, one u32 per row (per query buffer), after the plain
// kernel's layout (kOffStarts = the plain kernel's kSmemBytes, so that the
// plain kernels keep their layout and size exactly).

template <class E, int D, int BM, int BN>
struct TaTileTraits {
    using Elem = E;
    static constexpr int kHeadDim = D;
    static constexpr int kBlockM = BM;
    static constexpr int kBlockN = BN;
    static constexpr int kWarps = 4;
    static constexpr int kThreads = kWarps * 32;
    static constexpr int kRowStride = D + 8;  // elements; +16 bytes against bank conflicts
    static_assert(D % 16 == 0 && BM % 16 == 0 && BN % 16 == 0, "tile shape");
};

// Forward (tree_attn_fwd.cu), FlashAttention-2 tiling: a query tile of 128
// rows per block, warp w owns rows 32w..32w+31 (two 16-row m-tiles, so every
// K / V fragment an ldmatrix loads feeds two mma); key tiles of 64.
// Shared memory, in bytes: Q (its own region: the O tile passes through it in
// the epilogue) | K[2] | V[2] | row statistics | kv_end[2] (each with the
// walk's look-ahead window): (128 + 4 · 64) · (D + 8) · 2 + 4096 + 2 · 132 · 4
// = 60,448 for D = 64, 109,600 for D = 128
// (above 48 KB: the CUDA
// backend raises the function's dynamic shared-memory limit before
// launching). The row statistics (running max and partial sum of the
// online softmax) are in shared memory because in registers the D = 128
// kernel spills to local memory (ptxas, CUDA 13.0; tree_attn_fwd.cu).
// kQInRegs: the Q tile's A fragments stay in registers for the whole key
// loop (D = 64: 32 registers); for D = 128 they would take 64 and push the
// kernel past 255 registers, so it reloads them from the Q region per k-step
// of every key tile (2 ldmatrix next to 4 for K, as FlashAttention-2 does).
template <class E, int D>
struct FwdTraits : TaTileTraits<E, D, 128, 64> {
    using Base = TaTileTraits<E, D, 128, 64>;
    static constexpr int kMTiles = Base::kBlockM / (16 * Base::kWarps);  // 16-row m-tiles per warp
    static constexpr int kQElems = Base::kBlockM * Base::kRowStride;
    static constexpr int kKvElems = Base::kBlockN * Base::kRowStride;
    static constexpr bool kQInRegs = D == 64;
    // Byte offsets: Q | K[2] | V[2] | the online-softmax statistics (row max
    // and partial row sum of a thread's 2 · kMTiles rows: 4 · kMTiles f32
    // words per thread, kept out of registers).
    static constexpr int kOffK = kQElems * 2;
    static constexpr int kOffV = kOffK + 2 * kKvElems * 2;
    static constexpr int kOffStats = kOffV + 2 * kKvElems * 2;
    // Per K / V buffer, the tile's kv_end (BN words) and its tile_kv_min
    // (one word, padded to 4), staged by cp.async with K and V (issue 26);
    // then the walk's look-ahead window (issue 39): tile_kv_max of the 32
    // key tiles after the buffer's, then their tile_kv_min (64 words).
    static constexpr int kWindowOff = Base::kBlockN + 4;
    static constexpr int kKvEndWords = kWindowOff + 64;
    static constexpr int kOffKvEnd = kOffStats + 4 * kMTiles * Base::kThreads * 4;
    static constexpr int kSmemBytes = kOffKvEnd + 2 * kKvEndWords * 4;
    // The variant kernel (tree_attn_fwd_var_*): the Q tile's key starts.
    static constexpr int kOffStarts = kSmemBytes;
    static constexpr int kSmemBytesVar = kOffStarts + Base::kBlockM * 4;
    static_assert(kMTiles == 2, "two 16-row m-tiles per warp");
    static_assert(Base::kBlockN < Base::kThreads, "one kv_end per thread, one more thread for the tile bound");
    static_assert(kOffK % 16 == 0 && kOffV % 16 == 0 && kOffStats % 16 == 0, "aligned regions");
};

// Backward main kernel (tree_attn_bwd.cu): a key tile of 64 per block, warp w
// owns keys 16w..16w+15; query tiles of 64 rows for D = 64, 32 for D = 128 (to
// keep the f32 dK, dV accumulators plus Sᵀ and dPᵀ under 255 registers). For
// D = 64 the warp's K and V A fragments (32 registers) also stay in
// registers for the whole block: 224 / 242 registers (det / atomic, sm_90a),
// still 2 blocks per SM as at 176. For D = 128 they would need 64 more
// registers on top of 231 / 241: they are reloaded per query tile. The
// block's grid.z is its slice of the GQA group (group splits: the launch
// plan's rule, backend::launch::bwd::group_splits); the shared-memory layout
// does not depend on it.
template <class E, int D>
struct BwdTraits : TaTileTraits<E, D, D == 64 ? 64 : 32, 64> {
    using Base = TaTileTraits<E, D, D == 64 ? 64 : 32, 64>;
    static constexpr int kBlockM = Base::kBlockM, kBlockN = Base::kBlockN, kRowStride = Base::kRowStride;
    static constexpr int kDsStride = kBlockM + 8;  // dSᵀ rows (16-bit)
    static constexpr int kKvElems = kBlockN * kRowStride;
    static constexpr int kQElems = kBlockM * kRowStride;
    // Shared memory, in bytes: K, V | Q[2], dO[2] | dSᵀ | lse2[2], D[2] | kv_end.
    static constexpr int kOffQ = 2 * kKvElems * 2;
    static constexpr int kOffDs = kOffQ + 4 * kQElems * 2;
    static constexpr int kOffRowStats = kOffDs + kBlockN * kDsStride * 2;
    static constexpr int kOffKvEnd = kOffRowStats + 4 * kBlockM * 4;
    static constexpr int kSmemBytes = kOffKvEnd + kBlockN * 4;
    // The variant kernels: the key starts of the two query buffers' rows.
    static constexpr int kOffStarts = kSmemBytes;
    static constexpr int kSmemBytesVar = kOffStarts + 2 * kBlockM * 4;
    static_assert(kBlockN == 16 * Base::kWarps, "one 16-key slice per warp");
    static_assert(Base::kWarps % (kBlockM / 16) == 0 && (D / 16) % (Base::kWarps / (kBlockM / 16)) == 0,
                  "dQ split of BM x D over the warps");
    static_assert(kOffQ % 16 == 0 && kOffDs % 16 == 0 && kOffRowStats % 16 == 0, "aligned regions");
};

// Backward deterministic dQ kernel (tree_attn_bwd.cu): the forward's tile
// rule on 64-row query tiles (one 16-row m-tile per warp; the forward itself
// moved to 128-row tiles) and key tiles of 64. Shared memory: Q, dO, K[2],
// V[2] | lse2, D of the query tile | the walk's look-ahead window[2] =
// 56,320 B (D = 64) / 105,472 B (128).
template <class E, int D>
struct BwdDqTraits : TaTileTraits<E, D, 64, 64> {
    using Base = TaTileTraits<E, D, 64, 64>;
    static constexpr int kTileElems = 64 * Base::kRowStride;
    // Q, dO, K[2], V[2], then the query tile's lse2 and D (64 f32 each,
    // staged by cp.async with Q and dO), then per K / V buffer the key-tile
    // walk's look-ahead window (tile_kv_max, tile_kv_min of the next 32
    // key tiles: 64 words; issue 39).
    static constexpr int kOffRowStats = 6 * kTileElems * 2;
    static constexpr int kOffWindow = kOffRowStats + 2 * 64 * 4;
    static constexpr int kSmemBytes = kOffWindow + 2 * 64 * 4;
    // The variant kernel: the query tile's key starts.
    static constexpr int kOffStarts = kSmemBytes;
    static constexpr int kSmemBytesVar = kOffStarts + 64 * 4;
    // Blocks per SM the register allocation must leave room for. On sm_90
    // the D = 64 kernel's 56,320 bytes of shared memory allow 4 blocks, and
    // 4 blocks of 128 threads need at most 128 registers each: without the
    // bound ptxas takes 156 (3 blocks) since the kernel no longer carries
    // rotary (kernels/rope.cu). sm_80 (164 KB: 2 blocks by shared memory)
    // and D = 128 (105,472 bytes: 2 blocks) gain nothing from a bound.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    static constexpr int kMinBlocks = D == 64 ? 4 : 1;
#else
    static constexpr int kMinBlocks = 1;
#endif
    static_assert(Base::kBlockM == 16 * Base::kWarps && Base::kBlockM == 64 && Base::kBlockN == 64, "tile shape");
};

// Backward main kernel, two key m-tiles per warp, 4 warps (tree_attn_bwd.cu,
// tree_attn_bwd_main2w4_*_d64, no longer the d 64 default: Bwd2RoleTraits
// below; the trade-off is written at the top of that file):
// a key tile of 128 keys per block (two of the 64-key kv_end bounds tiles),
// warp w owns keys 32w..32w+31 (two 16-key m-tiles), so every Q / dO
// fragment an ldmatrix loads feeds 4 mma. Query tiles of kBlockM = 64 rows
// are staged (double-buffered) and each warp runs through them in
// sub-tiles of kSubM = 32 queries (the Sᵀ, dPᵀ accumulators of one
// sub-tile: 2 · 2 · 4 · 4 = 64 registers). D = 64 only: its f32 dK, dV
// accumulators (32 keys x D x 2 per warp) take 2D = 128 registers, 256 for
// D = 128.
// Shared memory, in bytes: K, V | Q[2], dO[2] | dSᵀ | lse2[2], D[2] | kv_end.
template <class E, int D>
struct Bwd2Traits : TaTileTraits<E, D, 64, 128> {
    using Base = TaTileTraits<E, D, 64, 128>;
    static constexpr int kBlockM = Base::kBlockM, kBlockN = Base::kBlockN, kRowStride = Base::kRowStride;
    static constexpr int kSubM = 32;
    static constexpr int kBoundsTile = 64;  // tile of tile_kv_min / tile_kv_max
    static constexpr int kDsStride = kBlockM + 8;
    static constexpr int kKvElems = kBlockN * kRowStride;
    static constexpr int kQElems = kBlockM * kRowStride;
    static constexpr int kOffQ = 2 * kKvElems * 2;
    static constexpr int kOffDs = kOffQ + 4 * kQElems * 2;
    static constexpr int kOffRowStats = kOffDs + kBlockN * kDsStride * 2;
    static constexpr int kOffKvEnd = kOffRowStats + 4 * kBlockM * 4;
    static constexpr int kSmemBytes = kOffKvEnd + kBlockN * 4;
    static_assert(D == 64, "two key m-tiles per warp: D = 64 only (registers)");
    static_assert(kBlockN == 32 * Base::kWarps && kBlockN == 2 * kBoundsTile, "32 keys per warp, 2 bounds tiles");
    static_assert(kBlockM % kSubM == 0 && kBlockM == 64, "dQ split: 2 x 2 warps of 32 x 32");
    static_assert(kOffQ % 16 == 0 && kOffDs % 16 == 0 && kOffRowStats % 16 == 0, "aligned regions");
};

// Backward main kernel for D = 128, two key m-tiles per warp with the head
// dim split (tree_attn_bwd_main2_d128.cuh, tree_attn_bwd_main2_*_d128; the
// layout and its trade-off are at the top of that file): 8 warps, a key tile
// of 128 keys (two 64-key bounds tiles), query tiles of 64 rows. Warp w =
// (key group wk = w % 4: keys 32wk..32wk+31, role = w / 4). Each warp holds
// dK, dV of its 32 keys x one half of D (64 columns: 2 · 2 · 8 · 4 = 128
// registers); role 0 computes Sᵀ (32 keys x 64 queries) and P, role 1 dPᵀ
// and dS; P (then dS, written over it) is staged in shared memory.
// Shared memory, in bytes: K, V | Q[2], dO[2] | P / dS ([key][query], one
// region) | lse2[2], D[2] | kv_end = 69,632 + 69,632 + 18,432 + 1,024 + 512
// = 159,232 (1 block per SM: A100 163 KB per block, H100 / H200 227 KB).
template <class E, int D>
struct Bwd2SplitTraits : TaTileTraits<E, D, 64, 128> {
    using Base = TaTileTraits<E, D, 64, 128>;
    static constexpr int kBlockM = Base::kBlockM, kBlockN = Base::kBlockN, kRowStride = Base::kRowStride;
    static constexpr int kWarps = 8;  // (shadows the base's 4)
    static constexpr int kThreads = kWarps * 32;
    static constexpr int kSubM = kBlockM;  // queries per Sᵀ pass: the whole tile
    static constexpr int kBoundsTile = 64;
    static constexpr int kHalfD = D / 2;  // columns of dK, dV per warp
    static constexpr int kDsStride = kBlockM + 8;
    static constexpr int kKvElems = kBlockN * kRowStride;
    static constexpr int kQElems = kBlockM * kRowStride;
    static constexpr int kOffQ = 2 * kKvElems * 2;
    static constexpr int kOffDs = kOffQ + 4 * kQElems * 2;  // P, then dS in place
    static constexpr int kOffRowStats = kOffDs + kBlockN * kDsStride * 2;
    static constexpr int kOffKvEnd = kOffRowStats + 4 * kBlockM * 4;
    static constexpr int kSmemBytes = kOffKvEnd + kBlockN * 4;
    static_assert(D == 128, "the head-dim split layout is written for D = 128");
    static_assert(kBlockN == 32 * (kWarps / 2) && kBlockN == 2 * kBoundsTile, "32 keys per warp pair, 2 bounds tiles");
    static_assert(kBlockM == 64 && kBlockM <= kThreads && kBlockN <= kThreads, "tile shape");
    static_assert(kOffQ % 16 == 0 && kOffDs % 16 == 0 && kOffRowStats % 16 == 0, "aligned regions");
    static_assert(kSmemBytes == 159232, "shared memory: update the Rust plan and the docs");
    // The variant kernels: the key starts of the two query buffers' rows
    // (159,744 bytes: still under A100's 166,912 per block).
    static constexpr int kOffStarts = kSmemBytes;
    static constexpr int kSmemBytesVar = kOffStarts + 2 * kBlockM * 4;
};

// Backward main kernel for D = 64 with two key m-tiles per warp and the
// products split by role (tree_attn_bwd_main2_roles.cuh,
// tree_attn_bwd_main2_*_d64; the layout and its trade-off are at the top of
// that file): 8 warps, a key tile of 128 keys (two 64-key bounds tiles),
// query tiles of 64 rows. Warp w = (key group wk = w % 4: keys
// 32wk..32wk+31, role = w / 4): role 0 holds K's A fragments and dV (32
// keys x D), computes Sᵀ and P; role 1 holds V's A fragments and dK,
// computes dPᵀ and dS; P (then dS, written over it) is staged in shared
// memory. The same layout as Bwd2Traits: K, V | Q[2], dO[2] | P / dS |
// lse2[2], D[2] | kv_end = 36,864 + 36,864 + 18,432 + 1,024 + 512 = 93,696.
template <class E, int D>
struct Bwd2RoleTraits : TaTileTraits<E, D, 64, 128> {
    using Base = TaTileTraits<E, D, 64, 128>;
    static constexpr int kBlockM = Base::kBlockM, kBlockN = Base::kBlockN, kRowStride = Base::kRowStride;
    static constexpr int kWarps = 8;  // (shadows the base's 4)
    static constexpr int kThreads = kWarps * 32;
    static constexpr int kSubM = kBlockM;  // queries per Sᵀ pass: the whole tile
    static constexpr int kBoundsTile = 64;
    static constexpr int kDsStride = kBlockM + 8;
    static constexpr int kKvElems = kBlockN * kRowStride;
    static constexpr int kQElems = kBlockM * kRowStride;
    static constexpr int kOffQ = 2 * kKvElems * 2;
    static constexpr int kOffDs = kOffQ + 4 * kQElems * 2;  // P, then dS in place
    static constexpr int kOffRowStats = kOffDs + kBlockN * kDsStride * 2;
    static constexpr int kOffKvEnd = kOffRowStats + 4 * kBlockM * 4;
    static constexpr int kSmemBytes = kOffKvEnd + kBlockN * 4;
    static_assert(D == 64, "the role split layout is written for D = 64 (dK or dV of 32 keys x D per warp)");
    static_assert(kBlockN == 32 * (kWarps / 2) && kBlockN == 2 * kBoundsTile, "32 keys per warp pair, 2 bounds tiles");
    static_assert(kBlockM == 64 && kBlockM <= kThreads && kBlockN <= kThreads, "tile shape");
    static_assert(kOffQ % 16 == 0 && kOffDs % 16 == 0 && kOffRowStats % 16 == 0, "aligned regions");
    static_assert(kSmemBytes == 93696, "shared memory: update the Rust plan and the docs");
    // The variant kernels: the key starts of the two query buffers' rows.
    static constexpr int kOffStarts = kSmemBytes;
    static constexpr int kSmemBytesVar = kOffStarts + 2 * kBlockM * 4;
};
