// Rotary embedding (RoPE), applied ONCE per call by an elementwise kernel,
// outside the attention kernels: the Llama "rotate half" convention of
// `crate::backend::Rope`. For a token with position id p and i < half =
// dims / 2, θ_i = base^(−2i / dims):
//
//   forward  x'[i]        = x[i] · cos(p θ_i) − x[i + half] · sin(p θ_i)
//            x'[i + half] = x[i + half] · cos(p θ_i) + x[i] · sin(p θ_i)
//   inverse  g[i]         = g'[i] · cos + g'[i + half] · sin      (the transpose
//            g[i + half]  = g'[i + half] · cos − g'[i] · sin       rotation)
//
// lanes dims..D pass through. The CUDA and emulator backends rotate Q and K
// into scratch buffers (same 16-bit type as the inputs) before the no-rope
// attention forward / backward, and rotate the backward's dQ and dK back in
// place with the inverse: the gradient with respect to the unrotated inputs,
// the contract's math (the CPU backend stores its dQ, dK rows through the
// same transpose rotation).
//
// Kernels.
//   ta_rope_table           cos / sin tables [positions, half] f32, one
//                           thread per (position, i); built once per
//                           (device pack, base, dims) and cached there.
//   ta_rope_{bf16,f16}_d{64,128}   x [tokens, heads, D] 16-bit → y (y may be
//                           x: in place), forward or inverse.
//
// Tiling of the rotation. A row is one (token, head): D elements, D / 2
// "slots"; slot j < half rotates the pair (j, j + half), slot j >= half
// copies the two pass-through elements 2·half + 2(j − half) and the next one
// (D − 2·half = 2 (D/2 − half) of them, so every row has exactly D / 2
// slots). One thread per slot, blocks of 128 threads = 256 / D rows (4 for
// D = 64, 2 for D = 128), grid ceil(tokens · heads / rows per block); a warp
// covers 32 consecutive slots of one row, so its loads and stores of x[j]
// and of x[j + half] are two contiguous 64-byte runs. A thread reads and
// writes only its own elements: in place is safe. No shared memory, no
// barriers; rows past the end leave early.
//
// Precision. The angle p·θ_i is never formed in f32 (at p ~ 1e5 an f32
// angle carries ~1e-2 rad of rounding): the table kernel computes θ_i =
// pow(base, −2i/dims), p·θ_i, cos and sin in f64 (the operations of the
// host table `launch::rope::RopeTables` and of the CPU backend, which builds
// its f64 tables the same way), rounded once to f32 — an absolute error of
// at most 2^-25 (3e-8) per entry plus the f64 libm error (≤ 2 ulp of f64 on
// the GPU, far below the f32 rounding), the accuracy the in-kernel rotary
// had before (f64 host tables rounded to f32). The rotation itself is f32
// (two products and a sum: a few f32 ulp) and its result is rounded once to
// the element type (2^-9 relative for bf16, 2^-11 for f16), which dominates.
// The inverse rotation of the gradients reads dQ / dK already rounded to the
// element type and rounds again: one more rounding than a rotation of the f32
// accumulators would make (the CPU backend rotates before its single
// rounding), well inside `backend::tolerance`.
//
// ta_rope_table reports a small stack frame under ptxas: the local array of
// the f64 sin / cos slow path (argument reduction of large angles), not a
// register spill; it runs once per (pack, rotary setting).
#include "common.cuh"

// Arguments of ta_rope_table (one struct by value). Mirrored by
// `crate::backend::launch::rope::RopeTableParams`; both sides assert the
// layout.
struct TaRopeTableParams {
    float* cos;          // [positions, half]
    float* sin;          // [positions, half]
    double base;         // θ_i = base^(−2i / dims)
    uint32_t positions;  // max position id + 1
    uint32_t half;       // dims / 2
    uint32_t dims;
    uint32_t reserved;
};
static_assert(sizeof(TaRopeTableParams) == 40, "TaRopeTableParams: update its Rust mirror");
TA_FIELD_AT(TaRopeTableParams, cos, 0); TA_FIELD_AT(TaRopeTableParams, sin, 8);
TA_FIELD_AT(TaRopeTableParams, base, 16); TA_FIELD_AT(TaRopeTableParams, positions, 24);
TA_FIELD_AT(TaRopeTableParams, half, 28); TA_FIELD_AT(TaRopeTableParams, dims, 32);
TA_FIELD_AT(TaRopeTableParams, reserved, 36);

// Arguments of ta_rope_* (one struct by value). Mirrored by
// `crate::backend::launch::rope::RopeApplyParams`; both sides assert the
// layout.
struct TaRopeApplyParams {
    const uint16_t* x;    // [tokens, heads, D]
    uint16_t* y;          // [tokens, heads, D]; may equal x
    const uint32_t* pos;  // [tokens] position ids
    const float* cos;     // [positions, half]
    const float* sin;     // [positions, half]
    uint32_t tokens;
    uint32_t heads;
    uint32_t half;     // 1 ..= D / 2
    uint32_t inverse;  // 0: rotate (Q, K), 1: rotate back (dQ, dK)
};
static_assert(sizeof(TaRopeApplyParams) == 56, "TaRopeApplyParams: update its Rust mirror");
TA_FIELD_AT(TaRopeApplyParams, x, 0); TA_FIELD_AT(TaRopeApplyParams, y, 8); TA_FIELD_AT(TaRopeApplyParams, pos, 16);
TA_FIELD_AT(TaRopeApplyParams, cos, 24); TA_FIELD_AT(TaRopeApplyParams, sin, 32);
TA_FIELD_AT(TaRopeApplyParams, tokens, 40); TA_FIELD_AT(TaRopeApplyParams, heads, 44);
TA_FIELD_AT(TaRopeApplyParams, half, 48); TA_FIELD_AT(TaRopeApplyParams, inverse, 52);

#define TA_ROPE_THREADS 128

// One thread per (position, i), TA_ROPE_THREADS per block.
extern "C" __global__ void __launch_bounds__(TA_ROPE_THREADS) ta_rope_table(const TaRopeTableParams p) {
    const uint64_t item = (uint64_t)blockIdx.x * TA_ROPE_THREADS + threadIdx.x;
    if (item >= (uint64_t)p.positions * p.half) return;
    const uint32_t pos = uint32_t(item / p.half), i = uint32_t(item % p.half);
    const double theta = pow(p.base, -2.0 * (double)i / (double)p.dims);
    const double angle = (double)pos * theta;
    p.cos[item] = (float)cos(angle);
    p.sin[item] = (float)sin(angle);
}

template <class E, int D>
__device__ __forceinline__ void ta_rope_apply_body(const TaRopeApplyParams& p) {
    constexpr int kSlots = D / 2, kRows = TA_ROPE_THREADS / kSlots;
    const uint64_t row = (uint64_t)blockIdx.x * kRows + threadIdx.x / kSlots;
    if (row >= (uint64_t)p.tokens * p.heads) return;
    const uint32_t j = threadIdx.x % kSlots, half = p.half;
    const size_t at = row * D;
    if (j < half) {
        const uint32_t token = uint32_t(row / p.heads);
        const size_t t = (size_t)p.pos[token] * half + j;
        const float c = p.cos[t], s = p.inverse ? -p.sin[t] : p.sin[t];
        const float a = ta_to_f32<E>(p.x[at + j]), b = ta_to_f32<E>(p.x[at + j + half]);
        const uint32_t r = ta_pack2<E>(a * c - b * s, b * c + a * s);
        p.y[at + j] = uint16_t(r & 0xffffu);
        p.y[at + j + half] = uint16_t(r >> 16);
    } else if (p.x != p.y) {
        const uint32_t e = 2 * half + 2 * (j - half);
        p.y[at + e] = p.x[at + e];
        p.y[at + e + 1] = p.x[at + e + 1];
    }
}

#define TA_ROPE_KERNEL(SUFFIX, E, D, DTYPE)                                             \
    extern "C" __global__ void __launch_bounds__(TA_ROPE_THREADS)                        \
        ta_rope_##SUFFIX(const TaRopeApplyParams p) {                                    \
        ta_rope_apply_body<E, D>(p);                                                     \
    }
TA_ATTN_VARIANTS(TA_ROPE_KERNEL)
#undef TA_ROPE_KERNEL
