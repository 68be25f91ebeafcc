// Kernels that test the SIMT shim itself (tests/it/emu_shim.rs): fragment
// layouts of ldmatrix and mma against the PTX ISA, shuffles, and the errors
// the emulator must raise. Written in CUDA style like the real kernels.
#include "../common.cuh"

#include <cstdio>
#include <stdexcept>
#include <string>

namespace {

struct SelfTestParams {
    const void* in;
    void* out;
    uint32_t arg;
};

// in: 4 matrices of 8x8 u16, row-major, matrix j at offset 64j.
// out: per lane 4 u32 (unused registers left untouched).
// arg: count (1, 2, 4) | trans << 8.
__global__ void ldmatrix_dump(const SelfTestParams p) {
    TA_DYNAMIC_SMEM(smem);
    uint16_t* s = reinterpret_cast<uint16_t*>(smem);
    const uint16_t* in = static_cast<const uint16_t*>(p.in);
    const unsigned lane = ta_lane();
    for (int i = lane; i < 256; i += 32) s[i] = in[i];
    __syncthreads();
    const unsigned count = p.arg & 0xff;
    const bool trans = (p.arg >> 8) & 1;
    // Lane l addresses row l%8 of matrix l/8 (lanes past the count reuse
    // valid rows, as the hardware ignores them).
    const uint16_t* row = s + ((lane / 8) % count) * 64 + (lane % 8) * 8;
    uint32_t* out = static_cast<uint32_t*>(p.out) + lane * 4;
    if (count == 4) {
        uint32_t r[4];
        if (trans) ta_ldmatrix_x4_trans(r, row); else ta_ldmatrix_x4(r, row);
        for (int j = 0; j < 4; j++) out[j] = r[j];
    } else if (count == 2) {
        uint32_t r[2];
        if (trans) ta_ldmatrix_x2_trans(r, row); else ta_ldmatrix_x2(r, row);
        for (int j = 0; j < 2; j++) out[j] = r[j];
    } else {
        uint32_t r;
        if (trans) ta_ldmatrix_x1_trans(r, row); else ta_ldmatrix_x1(r, row);
        out[0] = r;
    }
}

// D = A B + C through ldmatrix and mma, like the attention kernel:
// in: A [16][16] u16 row-major, then B as u16: arg bit 1 clear -> Bᵀ [8][16]
// (n-major, loaded with ldmatrix.x2), set -> B [16][8] (k-major, loaded with
// ldmatrix.x2.trans), then C [16][8] f32. out: D [16][8] f32.
// arg bit 0: 1 = bf16, 0 = f16.
template <class E>
__device__ void mma_chain_body(const SelfTestParams& p) {
    TA_DYNAMIC_SMEM(smem);
    uint16_t* sa = reinterpret_cast<uint16_t*>(smem);
    uint16_t* sb = sa + 256;
    const uint16_t* in = static_cast<const uint16_t*>(p.in);
    const float* cin = reinterpret_cast<const float*>(in + 384);
    const unsigned lane = ta_lane(), g = lane >> 2, c = lane & 3, mi = lane >> 3, ri = lane & 7;
    for (int i = lane; i < 384; i += 32) sa[i] = in[i];
    __syncthreads();
    uint32_t a[4];
    ta_ldmatrix_x4(a, sa + (ri + 8 * (mi & 1)) * 16 + 8 * (mi >> 1));
    uint32_t b[2];
    if (p.arg & 2)  // B [k][n], 8 elements per row: matrices (k 0-7), (k 8-15)
        ta_ldmatrix_x2_trans(b, sb + ((mi & 1) * 8 + ri) * 8);
    else  // Bᵀ [n][k], 16 elements per row: matrices (k 0-7), (k 8-15)
        ta_ldmatrix_x2(b, sb + ri * 16 + 8 * (mi & 1));
    float acc[4];
    for (int i = 0; i < 4; i++) acc[i] = cin[(g + 8 * (i >> 1)) * 8 + 2 * c + (i & 1)];
    ta_mma_16816<E>(acc, a, b[0], b[1]);
    float* out = static_cast<float*>(p.out);
    for (int i = 0; i < 4; i++) out[(g + 8 * (i >> 1)) * 8 + 2 * c + (i & 1)] = acc[i];
}
__global__ void mma_chain(const SelfTestParams p) {
    if (p.arg & 1)
        mma_chain_body<ta_bf16>(p);
    else
        mma_chain_body<ta_f16>(p);
}

// in: one u32 per thread. out: 9 u32 per thread:
// xor(arg), down(arg), up(arg), idx(arg), ballot(v & 1), xor(arg) width 16,
// quad max of the value as a float, __ffs and __popc of the ballot of
// (v >> 3) % arg == 0 in warp 0 (in warp 1 the mask is zero: __ffs(0) = 0).
__global__ void shuffles(const SelfTestParams p) {
    const unsigned t = threadIdx.x;
    const uint32_t v = static_cast<const uint32_t*>(p.in)[t];
    const int a = int(p.arg);
    uint32_t* out = static_cast<uint32_t*>(p.out) + t * 9;
    out[0] = __shfl_xor_sync(TA_FULL_MASK, v, a);
    out[1] = __shfl_down_sync(TA_FULL_MASK, v, unsigned(a));
    out[2] = __shfl_up_sync(TA_FULL_MASK, v, unsigned(a));
    out[3] = __shfl_sync(TA_FULL_MASK, v, a);
    out[4] = __ballot_sync(TA_FULL_MASK, int(v & 1));
    out[5] = __shfl_xor_sync(TA_FULL_MASK, v, a, 16);
    out[6] = __float_as_uint(ta_quad_max(float(v)));
    const unsigned sparse = __ballot_sync(TA_FULL_MASK, int(t < 32 && (v >> 3) % unsigned(a) == 0));
    out[7] = uint32_t(__ffs(int(sparse)));
    out[8] = uint32_t(__popc(sparse));
}

// Thread 0 leaves; the others wait at a barrier nobody completes.
__global__ void divergent_barrier(const SelfTestParams) {
    if (threadIdx.x == 0) return;
    __syncthreads();
}

// A shuffle with a half-warp mask.
__global__ void partial_mask(const SelfTestParams p) {
    float x = float(threadIdx.x);
    x = __shfl_xor_sync(0x0000ffffu, x, 1);
    static_cast<float*>(p.out)[threadIdx.x] = x;
}

// Half the warp at a shuffle, the other half at a ballot (arg 0) or at
// __syncthreads (arg 1).
__global__ void not_converged(const SelfTestParams p) {
    unsigned r;
    if (ta_lane() < 16)
        r = __shfl_xor_sync(TA_FULL_MASK, threadIdx.x, 1);
    else if (p.arg == 0)
        r = __ballot_sync(TA_FULL_MASK, 1);
    else {
        __syncthreads();
        r = 0;
    }
    static_cast<unsigned*>(p.out)[threadIdx.x] = r;
}

// Each thread reads its word of shared memory first (out[block][t]), then
// writes it: every read must see the poison, in every block.
__global__ void poison_read(const SelfTestParams p) {
    TA_DYNAMIC_SMEM(smem);
    uint32_t* s = reinterpret_cast<uint32_t*>(smem);
    const unsigned t = threadIdx.x;
    static_cast<uint32_t*>(p.out)[blockIdx.x * blockDim.x + t] = s[t];
    s[t] = 0x12345678u + t;
}

// cp.async visibility: two groups of 16 bytes per thread. out per thread (12
// u32): group 0 before any wait, after wait_group 1 (group 0 then visible,
// group 1 not), and group 1 after wait_group 0.
__global__ void cp_async_groups(const SelfTestParams p) {
    TA_DYNAMIC_SMEM(smem);
    const unsigned t = threadIdx.x;
    const unsigned char* in = static_cast<const unsigned char*>(p.in);
    uint32_t* s0 = reinterpret_cast<uint32_t*>(smem + 32 * t);
    uint32_t* s1 = s0 + 4;
    uint32_t* out = static_cast<uint32_t*>(p.out) + 12 * t;
    ta_cp_async_16(s0, in + 32 * t, true);
    ta_cp_async_commit();
    ta_cp_async_16(s1, in + 32 * t + 16, p.arg == 0);  // arg 1: zero-fill
    ta_cp_async_commit();
    for (int i = 0; i < 4; i++) out[i] = s0[i];
    ta_cp_async_wait<1>();
    for (int i = 0; i < 4; i++) out[4 + i] = s0[i] ^ s1[i];
    ta_cp_async_wait<0>();
    for (int i = 0; i < 4; i++) out[8 + i] = s1[i];
}

// Each thread passes (arg & 0xff) barriers, odd threads (arg >> 8) more.
__global__ void uneven_barriers(const SelfTestParams p) {
    const unsigned n = (p.arg & 0xffu) + (threadIdx.x & 1u) * (p.arg >> 8);
    for (unsigned i = 0; i < n; i++) __syncthreads();
}

// Warp 0 stores in[0..32) to shared memory; warp 1 copies it to out after a
// __syncthreads (arg 1) or without one (arg 0: a race).
__global__ void missing_barrier(const SelfTestParams p) {
    TA_DYNAMIC_SMEM(smem);
    uint32_t* s = reinterpret_cast<uint32_t*>(smem);
    const unsigned t = threadIdx.x;
    if (t < 32) s[t] = static_cast<const uint32_t*>(p.in)[t];
    if (p.arg) __syncthreads();
    if (t >= 32) static_cast<uint32_t*>(p.out)[t - 32] = s[t - 32];
}

// Global atomics from every thread of every block (blocks run on several OS
// threads). out: u32 count, f32 sum of 0.5, u32 max of the global thread id,
// i32 min of its negation, then a u64 count (8-byte aligned at word 4).
__global__ void atomics(const SelfTestParams p) {
    uint32_t* w = static_cast<uint32_t*>(p.out);
    const unsigned id = blockIdx.x * blockDim.x + threadIdx.x;
    atomicAdd(&w[0], 1u);
    atomicAdd(reinterpret_cast<float*>(&w[1]), 0.5f);
    atomicMax(&w[2], id);
    atomicMin(reinterpret_cast<int*>(&w[3]), -int(id));
    atomicAdd(reinterpret_cast<unsigned long long*>(&w[4]), 1ull);
}

// Thread `arg` of every block throws a C++ exception between two barriers:
// the launch must fail with the exception's message (not a divergent
// barrier, not std::terminate), whichever OS thread runs the block.
__global__ void throws(const SelfTestParams p) {
    __syncthreads();
    if (threadIdx.x == p.arg) throw std::runtime_error("thrown by thread " + std::to_string(p.arg));
    __syncthreads();
}

// __syncthreads_or, three barriers in a row: thread t writes out[3t ..
// 3t + 3] = the results with predicates (t == arg), 0 and (t == last
// thread), so every thread of every block must read (arg < blockDim.x), 0,
// 1: a result that leaks from one barrier into the next shows.
__global__ void syncthreads_or_k(const SelfTestParams p) {
    uint32_t* out = static_cast<uint32_t*>(p.out) + 3 * (blockIdx.x * blockDim.x + threadIdx.x);
    out[0] = uint32_t(__syncthreads_or(int(threadIdx.x == p.arg)));
    out[1] = uint32_t(__syncthreads_or(0));
    out[2] = uint32_t(__syncthreads_or(int(threadIdx.x + 1 == blockDim.x)));
}

using SelfTestKernel = void (*)(const SelfTestParams);
const SelfTestKernel kKernels[] = {ldmatrix_dump,   mma_chain,       shuffles, divergent_barrier, partial_mask,
                                   not_converged,   poison_read,     cp_async_groups, uneven_barriers,
                                   missing_barrier, atomics,         throws,          syncthreads_or_k};
constexpr uint32_t kNumKernels = sizeof kKernels / sizeof kKernels[0];

}  // namespace

// `in` is registered as the one buffer cp.async may read (in_bytes long).
// which == kNumKernels (one past the kernels) throws from the entry point
// itself, on the calling thread: the test of ta_emu::guard_entry.
extern "C" int ta_emu_selftest(uint32_t which, const void* in, size_t in_bytes, void* out, uint32_t arg,
                               uint32_t grid, uint32_t block, size_t smem, const ta_emu::Config* config, char* err,
                               size_t err_len) noexcept {
    return ta_emu::guard_entry("ta_emu_selftest", err, err_len, [&]() -> int {
        if (which == kNumKernels) throw std::runtime_error("thrown by the entry point");
        if (which > kNumKernels) {
            snprintf(err, err_len, "no self-test kernel %u", which);
            return 1;
        }
        const ta_emu::GlobalRange input{in, in_bytes, "the input"};
        ta_emu::LaunchIo io;
        io.ranges = &input;
        io.num_ranges = 1;
        return ta_emu::launch_kernel<SelfTestParams>(kKernels[which], SelfTestParams{in, out, arg}, dim3(grid),
                                                     dim3(block), smem, *config, err, err_len, io);
    });
}
