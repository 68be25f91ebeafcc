// The tile loader shared by the forward and backward kernels: rows
// [row0, row0 + Rows) of one head of a [tokens, heads, D] tensor of 16-bit
// elements, global -> shared memory through cp.async.
//
// Tiling. A row of D elements is D / 8 chunks of 16 bytes; the block's
// Threads threads take the Rows · D / 8 chunks round-robin (chunk i in round
// `it` is it · Threads + threadIdx.x), one cp.async of 16 bytes each, so a
// warp's 32 copies cover whole consecutive rows (coalesced global reads). The
// tile lands row-major in shared memory with a row stride of RowStride
// elements (the kernels pad rows by 8 elements so that the 8 row addresses of
// an ldmatrix fall in distinct bank groups: kernel_traits.cuh). Rows at or
// past `tokens` are zero-filled (cp.async with src-size 0: nothing is read
// from global memory, `g` itself stands in as the valid dummy source), so a
// partial last tile computes with zeros and the kernels mask those rows.
//
// A row the caller's `skip(row)` names (a row that enters no visible pair:
// a key no query sees, a query that sees no key) is zero-filled the same
// way, so that a NaN or inf stored there never meets the zero probabilities
// of its masked entries inside an mma (0 · NaN = NaN): non-finite values in
// such rows are ignored, as the CPU backend ignores them (DESIGN §5).
//
// The caller commits the copies as one group (ta_cp_async_commit) and waits
// for them (ta_cp_async_wait) before reading the tile.
#pragma once

#include "common.cuh"

// Skips no row.
struct TaLoadAll {
    __device__ __forceinline__ bool operator()(uint32_t) const { return false; }
};

// `tid` is the thread's index in the block (threadIdx.x; a kernel at the
// register limit may pass ta_tid_fresh() so that the copy addresses are
// recomputed per call rather than held across its loop).
template <int Rows, int D, int RowStride, int Threads, class Skip = TaLoadAll>
__device__ __forceinline__ void ta_load_tile(uint16_t* smem, const uint16_t* __restrict__ g, uint32_t row0,
                                             uint32_t tokens, uint32_t heads, uint32_t head, Skip skip = Skip{},
                                             unsigned tid = threadIdx.x) {
    constexpr int kChunks = D / 8;
    static_assert((Rows * kChunks) % Threads == 0, "whole copy rounds per tile");
#pragma unroll
    for (int it = 0; it < Rows * kChunks / Threads; ++it) {
        const int i = it * Threads + tid;
        const int r = i / kChunks, c = i % kChunks;
        const uint32_t row = row0 + r;
        const bool ok = row < tokens && !skip(row);
        const uint16_t* src = ok ? g + ((size_t)row * heads + head) * D + c * 8 : g;
        ta_cp_async_16(smem + r * RowStride + c * 8, src, ok);
    }
}
