// Primitives shared by the treeattn kernels. Every inline-PTX use lives here,
// behind a small device function with an emulator implementation, so that a
// kernel body is the same text under nvcc and under the host SIMT emulator
// (kernels/emu/shim.h, selected by defining TA_EMU).
//
// Element types are tags (ta_bf16, ta_f16); tensors hold raw 16-bit words
// (uint16_t) and every conversion goes through ta_pack2 / ta_to_f32.
#pragma once

#ifdef TA_EMU
#include "emu/shim.h"
#else
#include <stdint.h>
#define TA_DYNAMIC_SMEM(name) extern __shared__ __align__(16) unsigned char name[]
#endif
#include <stddef.h>

struct ta_bf16 {
    static constexpr bool kIsBf16 = true;
};
struct ta_f16 {
    static constexpr bool kIsBf16 = false;
};

// The variants of the attention and rotary kernels, the one list of them:
// X(SUFFIX, E, D, DTYPE) per element type E and head dim D, SUFFIX the tail
// of the kernels' symbols (tree_attn_fwd_bf16_d64, ...), DTYPE the code the
// emulator entries take (Rust's `launch::Dtype::code`). Expanded by the
// instantiations (tree_attn_fwd.cu, tree_attn_bwd.cu, rope.cu) and the
// emulator's switches (emu/*_entry.cpp); build.rs reads the X(...) lines to
// generate Rust's table (`backend::launch::ATTN_VARIANTS`), which the
// launch plans and the CUDA backend's function tables follow. One variant a
// line, in this form.
#define TA_ATTN_VARIANTS(X)       \
    X(bf16_d64, ta_bf16, 64, 0)   \
    X(bf16_d128, ta_bf16, 128, 0) \
    X(f16_d64, ta_f16, 64, 1)     \
    X(f16_d128, ta_f16, 128, 1)

// Pins a field of a kernel argument struct (passed by value from Rust) at a
// byte offset; each struct's `#[repr(C)]` Rust mirror asserts the same size
// and offsets (`launch::assert_layout!`), so neither side can move alone.
#define TA_FIELD_AT(T, F, OFF) static_assert(offsetof(T, F) == (OFF), #T "::" #F " moved: update its Rust mirror")

#define TA_FULL_MASK 0xffffffffu

// 16 bytes moved as one vector load / store (LDS.128, STG.128 on the GPU).
struct alignas(16) ta_vec16 {
    uint32_t x, y, z, w;
};

__device__ __forceinline__ unsigned ta_lane() { return threadIdx.x & 31u; }

// threadIdx.x read afresh (a volatile read of %tid.x on the GPU): what is
// computed from it cannot be hoisted out of a loop or shared with an
// earlier computation, so ptxas recomputes such addresses where they are
// used instead of holding (or spilling) them across the loop. For address
// arithmetic used once per tile in a kernel at the register limit.
__device__ __forceinline__ unsigned ta_tid_fresh() {
#ifdef TA_EMU
    return threadIdx.x;
#else
    unsigned t;
    asm volatile("mov.u32 %0, %%tid.x;" : "=r"(t));
    return t;
#endif
}

#ifndef TA_EMU
__device__ __forceinline__ unsigned ta_smem_addr(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
#endif

// Two floats -> one 32-bit register of two 16-bit elements (lo in the low
// half), round to nearest even.
template <class E>
__device__ __forceinline__ uint32_t ta_pack2(float lo, float hi) {
#ifdef TA_EMU
    if (E::kIsBf16) return uint32_t(ta_emu::f32_to_bf16(lo)) | (uint32_t(ta_emu::f32_to_bf16(hi)) << 16);
    return uint32_t(ta_emu::f32_to_f16(lo)) | (uint32_t(ta_emu::f32_to_f16(hi)) << 16);
#else
    uint32_t r;
    if (E::kIsBf16)
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    else
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
#endif
}

// One 16-bit element -> float (exact).
template <class E>
__device__ __forceinline__ float ta_to_f32(uint16_t h) {
#ifdef TA_EMU
    return E::kIsBf16 ? ta_emu::bf16_to_f32(h) : ta_emu::f16_to_f32(h);
#else
    float f;
    if (E::kIsBf16) {
        f = __uint_as_float(uint32_t(h) << 16);
    } else {
        asm("{ .reg .f16 t; mov.b16 t, %1; cvt.f32.f16 %0, t; }" : "=f"(f) : "h"(h));
    }
    return f;
#endif
}

// 2^x (ex2.approx.ftz on the GPU: max relative error 2^-22, flushes
// subnormal results; exp2(-inf) = 0).
__device__ __forceinline__ float ta_exp2(float x) {
#ifdef TA_EMU
    return std::exp2(x);
#else
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
#endif
}

// 1 / x (rcp.approx.ftz on the GPU: at most 1 ulp off, flushes subnormal
// results; 1 / inf = 0).
__device__ __forceinline__ float ta_rcp(float x) {
#ifdef TA_EMU
    return 1.f / x;
#else
    float r;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
#endif
}

// The logit softcap of the attention variants (Gemma 2): a raw score x (the
// mma's q·k) becomes c · tanh(scale · x / c). Written with one exp2 and one
// reciprocal: with e = exp2(x · in), in = 2 · scale / c · log2 e (the
// host's `softcap_in`), r = 1 / (e + 1) is returned and
//
//   c · tanh(scale · x / c) = c · (1 − 2r),    1 − tanh² = 4 r (1 − r),
//
// both with an absolute error of a few 2^-24 (ex2.approx and rcp.approx
// are relative 2^-22 / 1 ulp; no cancellation in 4r(1 − r) near |tanh| =
// 1, where 1 − t·t would cancel). e = inf (x · in >= 128) gives r = 0,
// the cap +c; e = 0 gives r = 1, −c. The result is in natural units: the
// kernels then multiply by log2 e (the host passes scale_log2 = log2 e
// when a softcap is on), never by the softmax scale a second time.
__device__ __forceinline__ float ta_softcap_r(float x, float in) { return ta_rcp(ta_exp2(x * in) + 1.f); }

// ldmatrix.sync.aligned.m8n8.x{1,2,4}[.trans].shared.b16. Lanes 8j..8j+7
// pass the row addresses (16 bytes each, 16-byte aligned, shared memory) of
// matrix j; lane t receives in r[j] row t/4, columns 2(t%4) and 2(t%4)+1 of
// matrix j (of its transpose with .trans). Lanes whose address is not used
// (16..31 for x2, 8..31 for x1) still pass a valid shared address.
__device__ __forceinline__ void ta_ldmatrix_x4(uint32_t (&r)[4], const void* row) {
#ifdef TA_EMU
    ta_emu::ldmatrix(r, 4, false, row);
#else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(ta_smem_addr(row)));
#endif
}
__device__ __forceinline__ void ta_ldmatrix_x4_trans(uint32_t (&r)[4], const void* row) {
#ifdef TA_EMU
    ta_emu::ldmatrix(r, 4, true, row);
#else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(ta_smem_addr(row)));
#endif
}
__device__ __forceinline__ void ta_ldmatrix_x2(uint32_t (&r)[2], const void* row) {
#ifdef TA_EMU
    ta_emu::ldmatrix(r, 2, false, row);
#else
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(ta_smem_addr(row)));
#endif
}
__device__ __forceinline__ void ta_ldmatrix_x2_trans(uint32_t (&r)[2], const void* row) {
#ifdef TA_EMU
    ta_emu::ldmatrix(r, 2, true, row);
#else
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(ta_smem_addr(row)));
#endif
}
__device__ __forceinline__ void ta_ldmatrix_x1(uint32_t& r, const void* row) {
#ifdef TA_EMU
    ta_emu::ldmatrix(&r, 1, false, row);
#else
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];" : "=r"(r) : "r"(ta_smem_addr(row)));
#endif
}
__device__ __forceinline__ void ta_ldmatrix_x1_trans(uint32_t& r, const void* row) {
#ifdef TA_EMU
    ta_emu::ldmatrix(&r, 1, true, row);
#else
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16 {%0}, [%1];" : "=r"(r) : "r"(ta_smem_addr(row)));
#endif
}

// acc += A · B with mma.sync.aligned.m16n8k16.row.col.f32.E.E.f32, where
// (g = lane/4, c = lane%4, h = half of a register):
//   A 16x16: a[r] half h = A[g + 8(r&1)][2c + h + 8(r>>1)]
//   B 16x8:  b0 half h = B[2c + h][g],  b1 half h = B[2c + h + 8][g]
//   acc 16x8 (f32): acc[i] = D[g + 8(i>>1)][2c + (i&1)]
template <class E>
__device__ __forceinline__ void ta_mma_16816(float (&acc)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#ifdef TA_EMU
    const uint32_t b[2] = {b0, b1};
    ta_emu::mma_m16n8k16(E::kIsBf16, acc, a, b);
#else
    if (E::kIsBf16) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};"
            : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};"
            : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
#endif
}

// cp.async.cg.shared.global of 16 bytes; with fill == false nothing is read
// and the 16 destination bytes are zeroed (src-size 0). Both addresses
// 16-byte aligned. Completion only through ta_cp_async_commit/wait.
__device__ __forceinline__ void ta_cp_async_16(void* smem, const void* gmem, bool fill) {
#ifdef TA_EMU
    ta_emu::cp_async_16(smem, gmem, fill);
#else
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(ta_smem_addr(smem)), "l"(gmem),
                 "r"(fill ? 16 : 0));
#endif
}
// cp.async.ca.shared.global of 4 bytes (one f32 or u32), zero-filled with
// fill == false; both addresses 4-byte aligned. Same groups as the 16-byte
// form: it lets per-row scalars (kv_end, LSE, D) join a tile's group.
__device__ __forceinline__ void ta_cp_async_4(void* smem, const void* gmem, bool fill) {
#ifdef TA_EMU
    ta_emu::cp_async_4(smem, gmem, fill);
#else
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(ta_smem_addr(smem)), "l"(gmem),
                 "r"(fill ? 4 : 0));
#endif
}
// Closes the group of cp.async issued by this thread since the last commit.
// The commit and the wait carry a "memory" clobber (as CUTLASS's
// cp_async_fence / cp_async_wait do): without it the compiler may move an
// ordinary shared-memory load or store of the tile across them (a read
// hoisted above the wait sees the bytes before they land).
__device__ __forceinline__ void ta_cp_async_commit() {
#ifdef TA_EMU
    ta_emu::cp_async_commit();
#else
    asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}
// Waits until at most N of this thread's committed groups (the newest) are
// still in flight. Other threads' copies need a __syncthreads after this.
template <int N>
__device__ __forceinline__ void ta_cp_async_wait() {
#ifdef TA_EMU
    ta_emu::cp_async_wait(N);
#else
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
#endif
}

// Warp reductions over the 4 lanes of a quad (lanes 4g..4g+3), the lanes
// that share a row of an mma accumulator.
__device__ __forceinline__ float ta_quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(TA_FULL_MASK, x, 1));
    return fmaxf(x, __shfl_xor_sync(TA_FULL_MASK, x, 2));
}
__device__ __forceinline__ float ta_quad_sum(float x) {
    x += __shfl_xor_sync(TA_FULL_MASK, x, 1);
    return x + __shfl_xor_sync(TA_FULL_MASK, x, 2);
}

// p[0] += a, p[1] += b in global memory, no return value (p 8-byte
// aligned). sm_90: one red.global.add.v2.f32 (PTX ISA 8.1; as for every
// vector atomic, each element is its own atomic add: the pair is not one
// indivisible update). Before sm_90: two scalar red.global.add.f32 (what
// atomicAdd with an unused result compiles to). The emulator: two atomic
// adds.
__device__ __forceinline__ void ta_red_add_v2_f32(float* p, float a, float b) {
#ifdef TA_EMU
    atomicAdd(p, a);
    atomicAdd(p + 1, b);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(p), "f"(a), "f"(b) : "memory");
#else
    atomicAdd(p, a);
    atomicAdd(p + 1, b);
#endif
}
