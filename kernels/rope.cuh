// Fused rotary embedding for the attention kernels: the Llama "rotate half"
// convention of `crate::backend::Rope`. For a token with position id p and
// i < half = dims / 2, θ_i = base^(−2i / dims):
//
//   x'[i]        = x[i] · cos(p θ_i) − x[i + half] · sin(p θ_i)
//   x'[i + half] = x[i + half] · cos(p θ_i) + x[i] · sin(p θ_i)
//
// lanes dims..D pass through. The gradient goes back through the transpose
// rotation (sin → −sin):
//
//   g[i]        = g'[i] · cos + g'[i + half] · sin
//   g[i + half] = g'[i + half] · cos − g'[i] · sin
//
// cos and sin come from per-position tables [max_position + 1, half] (f32,
// computed on the host in f64 and rounded once), indexed by the pack's
// position ids, so the kernels never evaluate p·θ_i in f32 (at p ~ 1e5 that
// angle would carry ~1e-2 rad of rounding).
#pragma once

#include "common.cuh"

// The rotary inputs of one call; half == 0 means "no rotary".
struct TaRope {
    const uint32_t* pos;  // [tokens] position ids
    const float* cos;     // [max_position + 1, half]
    const float* sin;     // [max_position + 1, half]
    uint32_t half;
    uint32_t reserved;
};

// Rotates rows [row0, row0 + Rows) of a tile of 16-bit elements staged in
// shared memory (row stride RS) in place, in f32, rounding the result to E.
// Rows at or past `tokens` (zero-filled) are left alone. Every thread of the
// block takes part; the caller brackets the call with __syncthreads.
template <class E, int Rows, int RS, int Threads>
__device__ __forceinline__ void ta_rope_tile(uint16_t* s, uint32_t row0, uint32_t tokens, const TaRope& r) {
    const uint32_t half = r.half;
    for (uint32_t i = threadIdx.x; i < Rows * half; i += Threads) {
        const uint32_t row = i / half, j = i % half;
        if (row0 + row >= tokens) continue;
        const size_t t = (size_t)r.pos[row0 + row] * half + j;
        const float c = r.cos[t], sn = r.sin[t];
        uint16_t* x = s + row * RS + j;
        const float a = ta_to_f32<E>(x[0]), b = ta_to_f32<E>(x[half]);
        const uint32_t packed = ta_pack2<E>(a * c - b * sn, b * c + a * sn);
        x[0] = uint16_t(packed & 0xffffu);
        x[half] = uint16_t(packed >> 16);
    }
}

// Element j of the gradient with respect to the unrotated row, from the
// gradient g' of the rotated row (f32, contiguous D values) of a token with
// position id p.
__device__ __forceinline__ float ta_rope_grad_back(const float* g, uint32_t j, uint32_t p, const TaRope& r) {
    if (j >= 2 * r.half) return g[j];
    const bool lo = j < r.half;
    const uint32_t i = lo ? j : j - r.half;
    const size_t t = (size_t)p * r.half + i;
    const float c = r.cos[t], sn = r.sin[t];
    return lo ? g[i] * c + g[i + r.half] * sn : g[i + r.half] * c - g[i] * sn;
}
