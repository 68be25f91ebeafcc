// SIMT shim: lets the CUDA C++ kernels of kernels/*.cu compile as host C++
// and run on the CPU, one fiber per CUDA thread (see runtime.cpp).
//
// What a kernel may use (and nothing else from CUDA):
//   threadIdx, blockIdx, blockDim, gridDim        (dim3, per fiber / per block)
//   __syncthreads()                                (block barrier; divergence is an error)
//   __syncthreads_or(pred)                         (the barrier, returning whether any thread's pred is nonzero)
//   __syncwarp(mask)                               (warp convergence point)
//   __shfl_sync / __shfl_xor_sync / __shfl_up_sync / __shfl_down_sync   (4- and 8-byte types)
//   __ballot_sync / __any_sync / __all_sync
//   __ffs / __popc                                 (bit scans of a 32-bit mask)
//   atomicAdd (float, unsigned, int, unsigned long long), atomicMax / atomicMin (int, unsigned)
//   __trap()                                       (fails the launch with an error)
//   __float_as_uint / __uint_as_float / __float_as_int / __int_as_float
//   math from <cmath> (exp2f, log2f, fmaxf, ...)
//   TA_DYNAMIC_SMEM(name)   declares the block's dynamic shared memory (the only
//                           kind allowed: static __shared__ does not compile here)
//   and the primitives of kernels/common.cuh (ldmatrix, mma, cp.async, ...).
//
// Every warp collective must name the full mask 0xffffffff and be reached by
// all 32 lanes of the warp at the same collective; anything else fails the
// launch with a message (on hardware it would be undefined behaviour).
//
// Host side (bottom of this file): ta_emu::launch_kernel(kernel, params,
// grid, block, smem_bytes, config, err, err_len) runs a kernel that takes one
// parameter struct by value; ta_emu::Config picks the worker threads, the
// thread schedule and when cp.async copies land (run kernel tests under all
// of them: races show up as wrong numbers under some). Blocks need whole
// warps (blockDim a multiple of 32).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <type_traits>

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
    dim3() = default;
    constexpr dim3(unsigned x_, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

namespace ta_emu {

// The calling fiber's view of the launch.
const dim3& thread_idx();
const dim3& block_idx();
const dim3& block_dim();
const dim3& grid_dim();
unsigned char* dynamic_smem();

// Fails the whole launch with `msg` (prefixed with the block and thread).
[[noreturn]] void fail(const char* fmt, ...) __attribute__((format(printf, 1, 2)));

void syncthreads();
int syncthreads_or(int pred);

// cp.async model: the source is read at issue; the destination is written
// when a cp.async.wait_group retires the copy's group (the latest moment), so
// a kernel that reads shared memory before the matching wait sees the
// poison — or, with Config::cp_async_eager, at issue (the earliest moment),
// so a copy into a buffer that other warps still read corrupts their data.
void cp_async_16(void* smem_dst, const void* gmem_src, bool fill);
void cp_async_4(void* smem_dst, const void* gmem_src, bool fill);  // 4 bytes, 4-byte aligned
void cp_async_commit();
void cp_async_wait(int newest_pending_allowed);

// ldmatrix.sync.aligned.m8n8.{x1,x2,x4}[.trans].shared.b16, exact PTX lane layout.
void ldmatrix(uint32_t* regs, int count, bool trans, const void* row_addr);
// mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32 with D == C.
void mma_m16n8k16(bool bf16, float* acc4, const uint32_t* a4, const uint32_t* b2);

uint64_t shfl(int mode, unsigned mask, uint64_t v, int arg, int width);
unsigned ballot(unsigned mask, int pred);
void syncwarp(unsigned mask);

// Round-to-nearest-even conversions with the hardware's NaN / inf handling.
float bf16_to_f32(uint16_t h);
uint16_t f32_to_bf16(float f);
float f16_to_f32(uint16_t h);
uint16_t f32_to_f16(float f);

}  // namespace ta_emu

#define threadIdx (::ta_emu::thread_idx())
#define blockIdx (::ta_emu::block_idx())
#define blockDim (::ta_emu::block_dim())
#define gridDim (::ta_emu::grid_dim())

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
// Static shared memory would silently become per-thread memory here: refuse it.
#define __shared__ static_assert(false, "use TA_DYNAMIC_SMEM: static __shared__ is not emulated");
#define TA_DYNAMIC_SMEM(name) unsigned char* name = ::ta_emu::dynamic_smem()

inline void __syncthreads() { ::ta_emu::syncthreads(); }
inline int __syncthreads_or(int pred) { return ::ta_emu::syncthreads_or(pred); }
inline void __syncwarp(unsigned mask = 0xffffffffu) { ::ta_emu::syncwarp(mask); }
[[noreturn]] inline void __trap() { ::ta_emu::fail("__trap() called"); }

namespace ta_emu {
template <class T>
inline T shfl_t(int mode, unsigned mask, T v, int arg, int width) {
    static_assert(std::is_trivially_copyable<T>::value && sizeof(T) <= 8, "shuffle of a 4- or 8-byte value");
    uint64_t bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    bits = shfl(mode, mask, bits, arg, width);
    T r;
    std::memcpy(&r, &bits, sizeof(T));
    return r;
}
enum { SHFL_IDX = 0, SHFL_UP = 1, SHFL_DOWN = 2, SHFL_XOR = 3 };
}  // namespace ta_emu

template <class T>
inline T __shfl_sync(unsigned mask, T v, int src_lane, int width = 32) {
    return ::ta_emu::shfl_t(::ta_emu::SHFL_IDX, mask, v, src_lane, width);
}
template <class T>
inline T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
    return ::ta_emu::shfl_t(::ta_emu::SHFL_UP, mask, v, (int)delta, width);
}
template <class T>
inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
    return ::ta_emu::shfl_t(::ta_emu::SHFL_DOWN, mask, v, (int)delta, width);
}
template <class T>
inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
    return ::ta_emu::shfl_t(::ta_emu::SHFL_XOR, mask, v, lane_mask, width);
}
inline unsigned __ballot_sync(unsigned mask, int pred) { return ::ta_emu::ballot(mask, pred); }
inline int __any_sync(unsigned mask, int pred) { return ::ta_emu::ballot(mask, pred) != 0; }
inline int __all_sync(unsigned mask, int pred) { return ::ta_emu::ballot(mask, pred) == 0xffffffffu; }

// CUDA's integer intrinsics for ballot masks: __ffs is the 1-based position
// of the least significant set bit (0 for x == 0), __popc the number of set
// bits.
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __popc(unsigned x) { return __builtin_popcount(x); }

// CUDA's overloaded min / max for the integer types (floats use fminf / fmaxf).
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }

inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline int __float_as_int(float f) { int u; std::memcpy(&u, &f, 4); return u; }
inline float __int_as_float(int u) { float f; std::memcpy(&f, &u, 4); return f; }

// Blocks run concurrently on several OS threads: global atomics are real atomics.
inline unsigned atomicAdd(unsigned* p, unsigned v) { return __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
inline int atomicAdd(int* p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
    return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
}
inline float atomicAdd(float* p, float v) {
    unsigned* u = reinterpret_cast<unsigned*>(p);
    unsigned old = __atomic_load_n(u, __ATOMIC_RELAXED);
    while (!__atomic_compare_exchange_n(u, &old, __float_as_uint(__uint_as_float(old) + v), true, __ATOMIC_RELAXED,
                                        __ATOMIC_RELAXED)) {
    }
    return __uint_as_float(old);
}
template <class T>
inline T ta_emu_atomic_minmax(T* p, T v, bool is_max) {
    T old = __atomic_load_n(p, __ATOMIC_RELAXED);
    while ((is_max ? v > old : v < old) &&
           !__atomic_compare_exchange_n(p, &old, v, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
    }
    return old;
}
inline int atomicMax(int* p, int v) { return ta_emu_atomic_minmax(p, v, true); }
inline unsigned atomicMax(unsigned* p, unsigned v) { return ta_emu_atomic_minmax(p, v, true); }
inline int atomicMin(int* p, int v) { return ta_emu_atomic_minmax(p, v, false); }
inline unsigned atomicMin(unsigned* p, unsigned v) { return ta_emu_atomic_minmax(p, v, false); }

// ---- host side: launching a kernel on the emulator ------------------------
namespace ta_emu {
// How the emulator interleaves threads and lands cp.async copies. Races that
// hardware timing could expose (a missing __syncthreads, a wait_group count
// off by one) show up as wrong numbers under one of the combinations, so
// kernel tests should run under several. Mirrored by `EmuConfig` in Rust.
enum Schedule : uint32_t {
    // Round-robin over all threads: warps advance one collective at a time.
    SCHEDULE_LOCKSTEP = 0,
    // Each warp in turn runs alone until it blocks at __syncthreads or exits
    // (warp 0 first): as far ahead of the others as hardware allows.
    SCHEDULE_WARP_SERIAL = 1,
    // The same, last warp first.
    SCHEDULE_WARP_SERIAL_REVERSE = 2,
};
struct Config {
    uint32_t workers;         // OS threads for blocks; 0 = all cores
    uint32_t schedule;        // a Schedule
    uint32_t cp_async_eager;  // 0: a copy lands at its wait_group (latest), 1: at issue (earliest)
    uint32_t reserved;
};
// A global buffer the kernel may read with cp.async.
struct GlobalRange {
    const void* begin;
    size_t bytes;
    const char* name;
};
// Optional checks and counters of a launch.
struct LaunchIo {
    // When set, every cp.async source must lie inside one of these buffers
    // (an out-of-bounds read is an error instead of a silent read of host
    // memory, or a fault on the GPU).
    const GlobalRange* ranges = nullptr;
    size_t num_ranges = 0;
    // When set, receives the bytes moved by cp.async over the whole launch
    // (zero-fills included): what the kernel loads, e.g. to check that
    // skipped tiles are never loaded.
    uint64_t* cp_async_bytes = nullptr;
};
struct Launch {
    dim3 grid, block;
    size_t smem_bytes = 0;
    void (*body)(void* ctx) = nullptr;  // runs once per CUDA thread
    void* ctx = nullptr;
    Config config = {0, SCHEDULE_LOCKSTEP, 0, 0};
    LaunchIo io;
};
// Runs every block; returns 0, or nonzero with a message in err (NUL-terminated).
int launch(const Launch& l, char* err, size_t err_len);

// Launches `kernel(params)` — a kernel taking one parameter struct by value,
// the convention of the treeattn kernels — on the emulator. A host entry
// point (see kernels/emu/fwd_entry.cpp) checks its launch plan, then calls
// this; Rust reaches the entry point through FFI.
template <class P>
int launch_kernel(void (*kernel)(const P), const P& params, dim3 grid, dim3 block, size_t smem_bytes,
                  const Config& config, char* err, size_t err_len, const LaunchIo& io = LaunchIo()) {
    struct Call {
        void (*kernel)(const P);
        P params;
        static void run(void* ctx) {
            const Call* c = static_cast<const Call*>(ctx);
            c->kernel(c->params);
        }
    } call{kernel, params};
    Launch l;
    l.grid = grid;
    l.block = block;
    l.smem_bytes = smem_bytes;
    l.body = Call::run;
    l.ctx = &call;
    l.config = config;
    l.io = io;
    return launch(l, err, err_len);
}

// The body of every `extern "C"` entry point Rust calls: a C++ exception
// unwinding into Rust through an `extern "C"` function is undefined
// behaviour, so none may leave. `body()` returns the entry's code (0 = ok);
// an exception becomes code 1 with "<what>: C++ exception: <message>" in err
// (when there is a buffer). Exceptions inside a kernel thread never get this
// far: ta_emu_fiber_main turns them into a launch error (runtime.cpp).
template <class F>
int guard_entry(const char* what, char* err, size_t err_len, F&& body) noexcept {
    try {
        return body();
    } catch (const std::exception& e) {
        if (err && err_len) snprintf(err, err_len, "%s: C++ exception: %s", what, e.what());
    } catch (...) {
        if (err && err_len) snprintf(err, err_len, "%s: C++ exception (not a std::exception)", what);
    }
    return 1;
}
}  // namespace ta_emu
