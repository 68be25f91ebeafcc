// The SIMT emulator's runtime: blocks spread over OS threads, the threads of
// one block run as fibers on one OS thread.
//
// Scheduling. A block's fibers run round-robin from a scheduler context; a
// fiber runs until it reaches a synchronisation point (a block barrier or a
// warp collective) and switches back. Once no fiber can run, the scheduler
// resolves: a warp whose 32 lanes all wait at the same collective gets it
// computed (the collective's function reads every lane's inputs straight off
// the suspended fibers' stacks and writes their outputs), and a block whose
// live threads all wait at __syncthreads is released. Anything else is a
// deadlock on hardware, undefined behaviour in CUDA, and an error here:
//   - a thread exited while others wait at __syncthreads (divergent barrier);
//   - lanes of one warp wait at different collectives, or some at a collective
//     while others wait at __syncthreads or have exited (not converged);
//   - a collective with a mask other than 0xffffffff.
// Errors carry the block and thread and stop the launch; the test process
// never hangs or aborts.
//
// Context switch: a hand-written x86-64 switch (callee-saved registers, MXCSR
// and the x87 control word; no syscall), with a ucontext fallback elsewhere
// (or when built with -DTA_EMU_UCONTEXT, which is how the fallback is tested).
// Fiber stacks are mmap'd with a guard page below each.
#include "shim.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdarg>
#include <cstdio>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#if defined(__x86_64__) && !defined(TA_EMU_UCONTEXT)
#define TA_EMU_ASM_SWITCH 1
#else
#define TA_EMU_ASM_SWITCH 0
#include <ucontext.h>
#endif

namespace ta_emu {

enum class St : uint8_t { Runnable, WaitBar, WaitWarp, Done };

struct Fiber;
// Gathers the inputs of the 32 lanes of a warp (lanes[i]->op.in) and writes
// their outputs (lanes[i]->op.out); runs once all 32 lanes have arrived.
using WarpFn = void (*)(Fiber* const* lanes);

struct WarpOp {
    WarpFn fn = nullptr;
    const char* name = "";
    unsigned mask = 0;
    const void* in = nullptr;
    void* out = nullptr;
};

struct PendingCopy {
    unsigned char* dst;
    uint32_t group;
    uint32_t bytes;  // 16 or 4
    unsigned char data[16];
};

struct Block;

struct Fiber {
#if TA_EMU_ASM_SWITCH
    void* sp = nullptr;
#else
    ucontext_t uc;
#endif
    St st = St::Runnable;
    dim3 tid;
    unsigned linear = 0;
    WarpOp op;
    unsigned char* stack = nullptr;  // usable stack (above the guard page)
    size_t stack_bytes = 0;
    std::vector<PendingCopy> pending;
    uint32_t groups_committed = 0;
    Block* block = nullptr;
};

struct Block {
    const Launch* launch = nullptr;
    dim3 idx;
    std::vector<Fiber> fibers;
    unsigned char* mapping = nullptr;
    size_t mapping_bytes = 0;
    std::vector<unsigned char> smem_storage;
    unsigned char* smem = nullptr;
    std::string error;
    uint64_t cp_async_bytes = 0;  // over every block this worker ran
    // __syncthreads_or: the predicates of the barrier being filled, and the
    // result of the last one released (read by each thread right after its
    // release, before it can reach the next barrier).
    int bar_or = 0;
    int bar_or_result = 0;
#if TA_EMU_ASM_SWITCH
    void* main_sp = nullptr;
#else
    ucontext_t main_uc;
#endif
};

static thread_local Fiber* g_cur = nullptr;
static thread_local Block* g_block = nullptr;

}  // namespace ta_emu

// ---------------------------------------------------------------- switching
#if TA_EMU_ASM_SWITCH
extern "C" void ta_emu_ctx_switch(void** save_sp, void* load_sp);
extern "C" void ta_emu_fiber_trampoline();
extern "C" [[noreturn]] void ta_emu_fiber_main(ta_emu::Fiber* f);

// ta_emu_ctx_switch(save, load): push the callee-saved state on the current
// stack, store rsp to *save, load rsp = load, pop the state saved there, ret.
asm(R"(
    .pushsection .text
    .globl ta_emu_ctx_switch
    .hidden ta_emu_ctx_switch
    .type ta_emu_ctx_switch,@function
ta_emu_ctx_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size ta_emu_ctx_switch, .-ta_emu_ctx_switch

    .globl ta_emu_fiber_trampoline
    .hidden ta_emu_fiber_trampoline
    .type ta_emu_fiber_trampoline,@function
ta_emu_fiber_trampoline:
    movq %r12, %rdi
    call ta_emu_fiber_main@PLT
    ud2
    .size ta_emu_fiber_trampoline, .-ta_emu_fiber_trampoline
    .popsection
)");
#endif

namespace ta_emu {

static void to_scheduler(Fiber* f) {
#if TA_EMU_ASM_SWITCH
    ta_emu_ctx_switch(&f->sp, f->block->main_sp);
#else
    swapcontext(&f->uc, &f->block->main_uc);
#endif
}

static void to_fiber(Block& b, Fiber& f) {
    g_cur = &f;
#if TA_EMU_ASM_SWITCH
    ta_emu_ctx_switch(&b.main_sp, f.sp);
#else
    swapcontext(&b.main_uc, &f.uc);
#endif
    g_cur = nullptr;
}

}  // namespace ta_emu

// A C++ exception thrown by a kernel thread stops here, on the fiber's own
// stack (the switch code below it has no unwind information): it fails the
// launch like __trap(), with the exception's message. The handler is left
// before fail() switches away, so no caught exception stays on the OS
// thread's exception stack.
extern "C" [[noreturn]] void ta_emu_fiber_main(ta_emu::Fiber* f) {
    bool threw = false;
    char what[256] = "";
    try {
        f->block->launch->body(f->block->launch->ctx);
    } catch (const std::exception& e) {
        threw = true;
        snprintf(what, sizeof what, "%s", e.what());
    } catch (...) {
        threw = true;
        snprintf(what, sizeof what, "(not a std::exception)");
    }
    if (threw) ta_emu::fail("C++ exception in the kernel: %s", what);
    f->st = ta_emu::St::Done;
    ta_emu::to_scheduler(f);
    __builtin_trap();  // a finished fiber is never resumed
}

#if !TA_EMU_ASM_SWITCH
static void ta_emu_uc_entry(unsigned hi, unsigned lo) {
    uintptr_t p = ((uintptr_t)hi << 32) | lo;
    ta_emu_fiber_main(reinterpret_cast<ta_emu::Fiber*>(p));
}
#endif

namespace ta_emu {

static void init_fiber(Fiber& f) {
    f.st = St::Runnable;
    f.op = WarpOp{};
    f.pending.clear();
    f.groups_committed = 0;
#if TA_EMU_ASM_SWITCH
    uintptr_t top = (reinterpret_cast<uintptr_t>(f.stack) + f.stack_bytes) & ~uintptr_t(15);
    uint64_t* a = reinterpret_cast<uint64_t*>(top - 24);  // return address slot
    a[0] = reinterpret_cast<uint64_t>(&ta_emu_fiber_trampoline);
    a[-1] = 0;                                         // rbp
    a[-2] = 0;                                         // rbx
    a[-3] = reinterpret_cast<uint64_t>(&f);            // r12 -> first argument
    a[-4] = 0;                                         // r13
    a[-5] = 0;                                         // r14
    a[-6] = 0;                                         // r15
    a[-7] = uint64_t(0x1F80) | (uint64_t(0x037F) << 32);  // MXCSR, x87 control word
    f.sp = &a[-7];
#else
    getcontext(&f.uc);
    f.uc.uc_stack.ss_sp = f.stack;
    f.uc.uc_stack.ss_size = f.stack_bytes;
    f.uc.uc_link = nullptr;
    uintptr_t p = reinterpret_cast<uintptr_t>(&f);
    makecontext(&f.uc, (void (*)())ta_emu_uc_entry, 2, unsigned(p >> 32), unsigned(p & 0xffffffffu));
#endif
}

// ------------------------------------------------------------ fiber side
const dim3& thread_idx() { return g_cur->tid; }
const dim3& block_idx() { return g_block->idx; }
const dim3& block_dim() { return g_block->launch->block; }
const dim3& grid_dim() { return g_block->launch->grid; }
unsigned char* dynamic_smem() { return g_block->smem; }

static void set_error_v(const Fiber* f, const char* fmt, va_list ap) {
    Block& b = *g_block;
    if (!b.error.empty()) return;
    char buf[640];
    vsnprintf(buf, sizeof buf, fmt, ap);
    char full[768];
    snprintf(full, sizeof full, "block (%u,%u,%u) thread (%u,%u,%u): %s", b.idx.x, b.idx.y, b.idx.z, f->tid.x,
             f->tid.y, f->tid.z, buf);
    b.error = full;
}

// Records an error found by the scheduler (inside a collective): the block
// stops once the collective returns.
static void sched_error(const Fiber* f, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
static void sched_error(const Fiber* f, const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    set_error_v(f, fmt, ap);
    va_end(ap);
}

[[noreturn]] void fail(const char* fmt, ...) {
    Fiber* f = g_cur;
    va_list ap;
    va_start(ap, fmt);
    set_error_v(f, fmt, ap);
    va_end(ap);
    f->st = St::Done;
    to_scheduler(f);
    __builtin_trap();  // the scheduler abandons the block on error
}

void syncthreads() {
    Fiber* f = g_cur;
    f->st = St::WaitBar;
    to_scheduler(f);
}

int syncthreads_or(int pred) {
    Block& b = *g_cur->block;
    if (pred) b.bar_or = 1;
    syncthreads();
    return b.bar_or_result;
}

// Deposits `in`, waits for the other 31 lanes, lets `fn` compute, returns with
// `out` written. `name` identifies the collective in error messages.
static void warp_collective(WarpFn fn, const char* name, unsigned mask, const void* in, void* out) {
    Fiber* f = g_cur;
    if (mask != 0xffffffffu)
        fail("%s with mask 0x%08x: the kernels must use full-warp masks (0xffffffff)", name, mask);
    f->op = WarpOp{fn, name, mask, in, out};
    f->st = St::WaitWarp;
    to_scheduler(f);
}

static bool in_smem(const void* p, size_t bytes) {
    const unsigned char* c = static_cast<const unsigned char*>(p);
    const Block& b = *g_block;
    return c >= b.smem && c + bytes <= b.smem + b.launch->smem_bytes;
}

static void cp_async_land(void* smem_dst, const void* gmem_src, bool fill, size_t n);

// One cp.async of n = 16 or 4 bytes: destination inside the block's shared
// memory, both addresses n-byte aligned, the source (unless zero-filled)
// inside one of the launch's registered input buffers.
static void cp_async_n(void* smem_dst, const void* gmem_src, bool fill, size_t n) {
    if (!in_smem(smem_dst, n))
        fail("cp.async destination %p is outside the block's %zu bytes of dynamic shared memory", smem_dst,
             g_block->launch->smem_bytes);
    if ((reinterpret_cast<uintptr_t>(smem_dst) | reinterpret_cast<uintptr_t>(gmem_src)) & (n - 1))
        fail("cp.async of %zu bytes needs %zu-byte aligned addresses (dst %p, src %p)", n, n, smem_dst, gmem_src);
    const Launch& l = *g_block->launch;
    g_block->cp_async_bytes += n;
    if (fill && l.io.ranges) {
        const unsigned char* src = static_cast<const unsigned char*>(gmem_src);
        const GlobalRange* below = nullptr;  // the buffer starting closest below src
        for (size_t i = 0; i < l.io.num_ranges; i++) {
            const GlobalRange& r = l.io.ranges[i];
            const unsigned char* b = static_cast<const unsigned char*>(r.begin);
            if (src >= b && src + n <= b + r.bytes) return cp_async_land(smem_dst, gmem_src, fill, n);
            if (src >= b && (!below || b > static_cast<const unsigned char*>(below->begin))) below = &r;
        }
        if (below)
            fail("cp.async reads %zu bytes at offset %zd of %s, a buffer of %zu bytes", n,
                 src - static_cast<const unsigned char*>(below->begin), below->name, below->bytes);
        fail("cp.async reads %zu bytes at %p, before every input buffer of the launch", n, gmem_src);
    }
    cp_async_land(smem_dst, gmem_src, fill, n);
}

void cp_async_16(void* smem_dst, const void* gmem_src, bool fill) { cp_async_n(smem_dst, gmem_src, fill, 16); }
void cp_async_4(void* smem_dst, const void* gmem_src, bool fill) { cp_async_n(smem_dst, gmem_src, fill, 4); }

// Queues (or, eagerly, performs) one checked copy of n bytes.
static void cp_async_land(void* smem_dst, const void* gmem_src, bool fill, size_t n) {
    Fiber* f = g_cur;
    if (g_block->launch->config.cp_async_eager) {
        if (fill)
            std::memcpy(smem_dst, gmem_src, n);
        else
            std::memset(smem_dst, 0, n);
        return;
    }
    PendingCopy c;
    c.dst = static_cast<unsigned char*>(smem_dst);
    c.group = f->groups_committed;
    c.bytes = uint32_t(n);
    if (fill)
        std::memcpy(c.data, gmem_src, n);
    else
        std::memset(c.data, 0, n);
    f->pending.push_back(c);
}

void cp_async_commit() { g_cur->groups_committed++; }

void cp_async_wait(int newest_pending_allowed) {
    Fiber* f = g_cur;
    if (newest_pending_allowed < 0) fail("cp.async.wait_group with a negative count");
    // Groups with index < committed - N are complete after the wait.
    int64_t limit = int64_t(f->groups_committed) - newest_pending_allowed;
    auto keep = f->pending.begin();
    for (auto it = f->pending.begin(); it != f->pending.end(); ++it) {
        if (int64_t(it->group) < limit)
            std::memcpy(it->dst, it->data, it->bytes);
        else
            *keep++ = *it;
    }
    f->pending.erase(keep, f->pending.end());
}

// ---------------------------------------------------------- collectives
static void shfl_fn_impl(Fiber* const* lanes, int mode) {
    struct In {
        uint64_t v;
        int arg, width;
    };
    for (int i = 0; i < 32; i++) {
        const In& me = *static_cast<const In*>(lanes[i]->op.in);
        int w = me.width;
        if (w <= 0 || w > 32 || (w & (w - 1))) {
            sched_error(lanes[i], "shuffle width %d is not a power of two in 1..32", w);
            return;
        }
        int seg = i & ~(w - 1);
        int src;
        switch (mode) {
            case SHFL_IDX: src = seg + (me.arg & (w - 1)); break;
            case SHFL_UP: src = (i - seg) >= me.arg ? i - me.arg : i; break;
            case SHFL_DOWN: src = (i - seg) + me.arg < w ? i + me.arg : i; break;
            default: {
                src = i ^ me.arg;
                if (src < 0 || src >= seg + w) src = i;
            }
        }
        *static_cast<uint64_t*>(lanes[i]->op.out) = static_cast<const In*>(lanes[src]->op.in)->v;
    }
}
static void shfl_idx_fn(Fiber* const* l) { shfl_fn_impl(l, SHFL_IDX); }
static void shfl_up_fn(Fiber* const* l) { shfl_fn_impl(l, SHFL_UP); }
static void shfl_down_fn(Fiber* const* l) { shfl_fn_impl(l, SHFL_DOWN); }
static void shfl_xor_fn(Fiber* const* l) { shfl_fn_impl(l, SHFL_XOR); }

uint64_t shfl(int mode, unsigned mask, uint64_t v, int arg, int width) {
    struct {
        uint64_t v;
        int arg, width;
    } in{v, arg, width};
    uint64_t out = 0;
    static const WarpFn fns[4] = {shfl_idx_fn, shfl_up_fn, shfl_down_fn, shfl_xor_fn};
    static const char* names[4] = {"__shfl_sync", "__shfl_up_sync", "__shfl_down_sync", "__shfl_xor_sync"};
    warp_collective(fns[mode & 3], names[mode & 3], mask, &in, &out);
    return out;
}

static void ballot_fn(Fiber* const* lanes) {
    unsigned bits = 0;
    for (int i = 0; i < 32; i++)
        if (*static_cast<const int*>(lanes[i]->op.in)) bits |= 1u << i;
    for (int i = 0; i < 32; i++) *static_cast<unsigned*>(lanes[i]->op.out) = bits;
}
unsigned ballot(unsigned mask, int pred) {
    int in = pred != 0;
    unsigned out = 0;
    warp_collective(ballot_fn, "__ballot_sync", mask, &in, &out);
    return out;
}

static void syncwarp_fn(Fiber* const*) {}
void syncwarp(unsigned mask) { warp_collective(syncwarp_fn, "__syncwarp", mask, nullptr, nullptr); }

// ldmatrix: lanes 8j..8j+7 give the row addresses of matrix j (16 bytes, 8
// b16 elements each). Lane t receives in register j: matrix j, row t/4,
// elements 2(t%4) and 2(t%4)+1 (lower column in the low half); with .trans,
// the same positions of the transposed matrix.
template <int Count, bool Trans>
static void ldmatrix_fn(Fiber* const* lanes) {
    for (int i = 0; i < 8 * Count; i++) {
        const void* p = *static_cast<const void* const*>(lanes[i]->op.in);
        if (!in_smem(p, 16)) {
            sched_error(lanes[i], "ldmatrix row address %p is outside the block's dynamic shared memory", p);
            return;
        }
        if (reinterpret_cast<uintptr_t>(p) & 15u) {
            sched_error(lanes[i], "ldmatrix row address %p is not 16-byte aligned", p);
            return;
        }
    }
    for (int t = 0; t < 32; t++) {
        uint32_t* regs = static_cast<uint32_t*>(lanes[t]->op.out);
        for (int j = 0; j < Count; j++) {
            uint16_t e[2];
            for (int h = 0; h < 2; h++) {
                int r = t >> 2, c = 2 * (t & 3) + h;
                int row = Trans ? c : r, col = Trans ? r : c;
                const uint16_t* rp = *static_cast<const uint16_t* const*>(lanes[8 * j + row]->op.in);
                e[h] = rp[col];
            }
            regs[j] = uint32_t(e[0]) | (uint32_t(e[1]) << 16);
        }
    }
}

void ldmatrix(uint32_t* regs, int count, bool trans, const void* row_addr) {
    WarpFn fn;
    const char* name;
    switch (count * 2 + (trans ? 1 : 0)) {
        case 2: fn = ldmatrix_fn<1, false>; name = "ldmatrix.x1"; break;
        case 3: fn = ldmatrix_fn<1, true>; name = "ldmatrix.x1.trans"; break;
        case 4: fn = ldmatrix_fn<2, false>; name = "ldmatrix.x2"; break;
        case 5: fn = ldmatrix_fn<2, true>; name = "ldmatrix.x2.trans"; break;
        case 8: fn = ldmatrix_fn<4, false>; name = "ldmatrix.x4"; break;
        case 9: fn = ldmatrix_fn<4, true>; name = "ldmatrix.x4.trans"; break;
        default: fail("ldmatrix with %d matrices (1, 2 or 4)", count);
    }
    warp_collective(fn, name, 0xffffffffu, &row_addr, regs);
}

// mma.m16n8k16 (row.col), PTX fragment layouts with g = lane/4, c = lane%4:
//   A 16x16: reg r, half h -> row g + 8(r&1), col 2c + h + 8(r>>1)
//   B 16x8:  reg r, half h -> row(k) 2c + h + 8r, col(n) g
//   C/D 16x8 f32: element i -> row g + 8(i>>1), col 2c + (i&1)
struct MmaIn {
    const float* acc;
    const uint32_t* a;
    const uint32_t* b;
};
template <bool Bf16>
static void mma_fn(Fiber* const* lanes) {
    float A[16][16], B[16][8], C[16][8];
    auto cvt = [](uint16_t h) { return Bf16 ? bf16_to_f32(h) : f16_to_f32(h); };
    for (int t = 0; t < 32; t++) {
        const MmaIn& in = *static_cast<const MmaIn*>(lanes[t]->op.in);
        int g = t >> 2, c = t & 3;
        for (int r = 0; r < 4; r++)
            for (int h = 0; h < 2; h++)
                A[g + 8 * (r & 1)][2 * c + h + 8 * (r >> 1)] = cvt(uint16_t(in.a[r] >> (16 * h)));
        for (int r = 0; r < 2; r++)
            for (int h = 0; h < 2; h++) B[2 * c + h + 8 * r][g] = cvt(uint16_t(in.b[r] >> (16 * h)));
        for (int i = 0; i < 4; i++) C[g + 8 * (i >> 1)][2 * c + (i & 1)] = in.acc[i];
    }
    for (int t = 0; t < 32; t++) {
        float* d = static_cast<float*>(lanes[t]->op.out);
        int g = t >> 2, c = t & 3;
        for (int i = 0; i < 4; i++) {
            int row = g + 8 * (i >> 1), col = 2 * c + (i & 1);
            float s = C[row][col];
            for (int k = 0; k < 16; k++) s += A[row][k] * B[k][col];
            d[i] = s;
        }
    }
}

void mma_m16n8k16(bool bf16, float* acc4, const uint32_t* a4, const uint32_t* b2) {
    MmaIn in{acc4, a4, b2};
    float out[4];
    if (bf16)
        warp_collective(mma_fn<true>, "mma.m16n8k16.bf16", 0xffffffffu, &in, out);
    else
        warp_collective(mma_fn<false>, "mma.m16n8k16.f16", 0xffffffffu, &in, out);
    std::memcpy(acc4, out, sizeof out);
}

// ---------------------------------------------------------- conversions
float bf16_to_f32(uint16_t h) { return __uint_as_float(uint32_t(h) << 16); }
uint16_t f32_to_bf16(float f) {
    uint32_t x = __float_as_uint(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return uint16_t((x >> 16) | 0x40u);  // quiet NaN
    x += 0x7fffu + ((x >> 16) & 1u);
    return uint16_t(x >> 16);
}
float f16_to_f32(uint16_t h) {
    uint32_t sign = uint32_t(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0) {
        float v = std::ldexp(float(m), -24);
        return sign ? -v : v;
    }
    if (e == 31) return __uint_as_float(sign | 0x7f800000u | (m << 13));
    return __uint_as_float(sign | ((e + 112u) << 23) | (m << 13));
}
uint16_t f32_to_f16(float f) {
    uint32_t x = __float_as_uint(f);
    uint16_t sign = uint16_t((x >> 16) & 0x8000u);
    uint32_t ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return sign | 0x7e00u;   // NaN
    if (ax >= 0x477ff000u) return sign | 0x7c00u;  // >= 65520 rounds to inf
    if (ax >= 0x38800000u) {                       // normal half (>= 2^-14)
        uint32_t odd = (ax >> 13) & 1u;
        return sign | uint16_t((ax - (112u << 23) + 0xfffu + odd) >> 13);
    }
    // Subnormal half: multiples of 2^-24; the scaling is exact and nearbyint
    // rounds to nearest even in the default rounding mode.
    float m = std::nearbyint(std::fabs(f) * 16777216.0f);
    return sign | uint16_t(m);
}

// ---------------------------------------------------------- the scheduler
static const char* state_name(const Fiber& f) {
    switch (f.st) {
        case St::Runnable: return "runnable";
        case St::WaitBar: return "__syncthreads";
        case St::WaitWarp: return f.op.name;
        default: return "exited";
    }
}

// Runs one block to completion; false with b.error set on failure.
static bool run_block(Block& b) {
    const unsigned n = unsigned(b.fibers.size());
    const unsigned warps = n / 32;
    for (Fiber& f : b.fibers) init_fiber(f);
    std::memset(b.smem, 0xff, b.launch->smem_bytes);  // NaN in f32, bf16 and f16
    g_block = &b;
    const uint32_t schedule = b.launch->config.schedule;
    Fiber* lanes[32];
    // Computes warp w's collective if all 32 lanes wait at one; false if not
    // ready, or with b.error set when the lanes wait at different ones.
    auto resolve_warp = [&](unsigned w) {
        for (unsigned l = 0; l < 32; l++) {
            lanes[l] = &b.fibers[w * 32 + l];
            if (lanes[l]->st != St::WaitWarp) return false;
        }
        for (unsigned l = 1; l < 32; l++) {
            if (lanes[l]->op.fn != lanes[0]->op.fn) {
                sched_error(lanes[l], "warp %u not converged: lane 0 is at %s while lane %u is at %s", w,
                            lanes[0]->op.name, l, lanes[l]->op.name);
                return false;
            }
        }
        lanes[0]->op.fn(lanes);
        if (!b.error.empty()) return false;
        for (unsigned l = 0; l < 32; l++) lanes[l]->st = St::Runnable;
        return true;
    };
    for (;;) {
        if (schedule == SCHEDULE_LOCKSTEP) {
            for (unsigned i = 0; i < n; i++) {
                if (b.fibers[i].st != St::Runnable) continue;
                to_fiber(b, b.fibers[i]);
                if (!b.error.empty()) return false;
            }
        } else {
            // Each warp alone, up to its next __syncthreads or its exit.
            for (unsigned k = 0; k < warps; k++) {
                const unsigned w = schedule == SCHEDULE_WARP_SERIAL_REVERSE ? warps - 1 - k : k;
                do {
                    for (unsigned l = 0; l < 32; l++) {
                        Fiber& f = b.fibers[w * 32 + l];
                        if (f.st != St::Runnable) continue;
                        to_fiber(b, f);
                        if (!b.error.empty()) return false;
                    }
                } while (resolve_warp(w));
                if (!b.error.empty()) return false;
            }
        }
        unsigned done = 0, bar = 0;
        for (const Fiber& f : b.fibers) {
            done += f.st == St::Done;
            bar += f.st == St::WaitBar;
        }
        if (done == n) return true;
        bool released = false;
        for (unsigned w = 0; w < warps; w++) {
            released |= resolve_warp(w);
            if (!b.error.empty()) return false;
        }
        if (released) continue;
        if (bar > 0 && bar + done == n) {
            if (done > 0) {
                char buf[256];
                snprintf(buf, sizeof buf,
                         "block (%u,%u,%u): divergent __syncthreads: %u threads wait at the barrier while %u have "
                         "exited",
                         b.idx.x, b.idx.y, b.idx.z, bar, done);
                b.error = buf;
                return false;
            }
            // Released: every live thread is at this barrier.
            b.bar_or_result = b.bar_or;
            b.bar_or = 0;
            for (Fiber& f : b.fibers) f.st = St::Runnable;
            continue;
        }
        // Some warp is partly at a collective, partly elsewhere: a deadlock.
        for (unsigned w = 0; w < warps; w++) {
            const Fiber* at = nullptr;
            const Fiber* other = nullptr;
            for (unsigned l = 0; l < 32; l++) {
                const Fiber& f = b.fibers[w * 32 + l];
                if (f.st == St::WaitWarp)
                    at = at ? at : &f;
                else
                    other = other ? other : &f;
            }
            if (at && other) {
                char buf[384];
                snprintf(buf, sizeof buf,
                         "block (%u,%u,%u): warp %u not converged: lane %u waits at %s while lane %u is at %s",
                         b.idx.x, b.idx.y, b.idx.z, w, at->linear & 31u, at->op.name, other->linear & 31u,
                         state_name(*other));
                b.error = buf;
                return false;
            }
        }
        b.error = "emulator scheduler: no thread can make progress (internal error)";
        return false;
    }
}

static constexpr size_t kStackBytes = 256 * 1024;

static bool setup_block(Block& b, const Launch& l, std::string& err) {
    const unsigned n = l.block.x * l.block.y * l.block.z;
    const size_t page = size_t(sysconf(_SC_PAGESIZE));
    const size_t per = kStackBytes + page;  // guard page below each stack
    b.mapping_bytes = per * n;
    void* m = mmap(nullptr, b.mapping_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1,
                   0);
    if (m == MAP_FAILED) {
        err = "emulator: cannot map fiber stacks";
        return false;
    }
    b.mapping = static_cast<unsigned char*>(m);
    b.launch = &l;
    b.fibers.resize(n);
    for (unsigned i = 0; i < n; i++) {
        Fiber& f = b.fibers[i];
        mprotect(b.mapping + i * per, page, PROT_NONE);
        f.stack = b.mapping + i * per + page;
        f.stack_bytes = kStackBytes;
        f.linear = i;
        f.tid = dim3(i % l.block.x, (i / l.block.x) % l.block.y, i / (l.block.x * l.block.y));
        f.block = &b;
        f.pending.reserve(64);
    }
    b.smem_storage.assign(l.smem_bytes + 128, 0);
    uintptr_t p = reinterpret_cast<uintptr_t>(b.smem_storage.data());
    b.smem = reinterpret_cast<unsigned char*>((p + 127) & ~uintptr_t(127));
    return true;
}

int launch(const Launch& l, char* err, size_t err_len) {
    auto report = [&](const std::string& msg) {
        if (err && err_len) snprintf(err, err_len, "%s", msg.c_str());
        return 1;
    };
    const uint64_t n = uint64_t(l.block.x) * l.block.y * l.block.z;
    if (n == 0 || n > 1024 || n % 32 != 0)
        return report("emulator launch: block of " + std::to_string(n) +
                      " threads; the emulator needs a multiple of 32 up to 1024 (whole warps)");
    const uint64_t blocks = uint64_t(l.grid.x) * l.grid.y * l.grid.z;
    if (blocks == 0) return report("emulator launch: empty grid");
    if (l.smem_bytes > 228 * 1024)
        return report("emulator launch: " + std::to_string(l.smem_bytes) +
                      " bytes of dynamic shared memory exceed the 227 KB of a block on sm_90");
    if (l.config.schedule > SCHEDULE_WARP_SERIAL_REVERSE)
        return report("emulator launch: unknown schedule " + std::to_string(l.config.schedule));
    unsigned workers = l.config.workers ? l.config.workers : std::max(1u, std::thread::hardware_concurrency());
    workers = unsigned(std::min<uint64_t>(workers, blocks));

    std::atomic<uint64_t> next{0};
    std::atomic<uint64_t> total_cp_async_bytes{0};
    std::atomic<bool> stop{false};
    std::mutex err_mu;
    std::string first_error;
    auto fail_launch = [&](const std::string& e) {
        std::lock_guard<std::mutex> g(err_mu);
        if (first_error.empty()) first_error = e;
        stop = true;
    };
    // A worker lets no exception out: from a std::thread it would terminate
    // the process. One from the scheduler side (allocation) fails the launch.
    auto work = [&]() {
        Block b;
        try {
            std::string e;
            if (!setup_block(b, l, e)) {
                fail_launch(e);
            } else {
                for (;;) {
                    if (stop.load(std::memory_order_relaxed)) break;
                    uint64_t i = next.fetch_add(1);
                    if (i >= blocks) break;
                    b.idx = dim3(unsigned(i % l.grid.x), unsigned((i / l.grid.x) % l.grid.y),
                                 unsigned(i / (uint64_t(l.grid.x) * l.grid.y)));
                    b.error.clear();
                    if (!run_block(b)) {
                        fail_launch(b.error);
                        break;
                    }
                }
            }
        } catch (const std::exception& ex) {
            fail_launch(std::string("emulator: C++ exception: ") + ex.what());
        } catch (...) {
            fail_launch("emulator: C++ exception (not a std::exception)");
        }
        g_block = nullptr;
        if (b.mapping) munmap(b.mapping, b.mapping_bytes);
        total_cp_async_bytes += b.cp_async_bytes;
    };
    if (workers == 1) {
        work();
    } else {
        std::vector<std::thread> ts;
        try {
            ts.reserve(workers);
            for (unsigned i = 0; i < workers; i++) ts.emplace_back(work);
        } catch (const std::exception&) {
            // Fewer OS threads than asked for (std::system_error): the ones
            // that started share the grid; with none, this thread runs it.
            if (ts.empty()) work();
        }
        for (auto& t : ts) t.join();
    }
    if (!first_error.empty()) return report(first_error);
    if (l.io.cp_async_bytes) *l.io.cp_async_bytes = total_cp_async_bytes;
    return 0;
}

}  // namespace ta_emu
