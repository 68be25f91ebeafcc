// Host-side helper of the emulator entry points (bwd_entry.cpp,
// sdcc_entry.cpp): runs one kernel taking a params struct by value on the
// SIMT emulator.
#pragma once

#include <cstdio>

#include "shim.h"

namespace ta_emu_entry {

template <class P>
struct KernelCall {
    void (*kernel)(const P);
    P params;
};

template <class P>
inline void run_kernel(void* ctx) {
    const KernelCall<P>* call = static_cast<const KernelCall<P>*>(ctx);
    call->kernel(call->params);
}

// Runs `kernel(params)` on `grid` blocks of `block` threads with `smem` bytes
// of dynamic shared memory on `workers` OS threads (0 = all cores). Returns
// 0, or 1 with a message in err.
template <class P>
inline int launch(void (*kernel)(const P), const P& params, dim3 grid, dim3 block, size_t smem, unsigned workers,
                  char* err, size_t err_len) {
    KernelCall<P> call{kernel, params};
    ta_emu::Launch l;
    l.grid = grid;
    l.block = block;
    l.smem_bytes = smem;
    l.body = run_kernel<P>;
    l.ctx = &call;
    l.workers = workers;
    return ta_emu::launch(l, err, err_len);
}

// 1 with a message unless the launch plan matches the kernel's traits.
inline int check_plan(const char* what, unsigned block_threads, size_t smem, int want_threads, int want_smem,
                      char* err, size_t err_len) {
    if (block_threads != unsigned(want_threads) || smem != size_t(want_smem)) {
        snprintf(err, err_len,
                 "%s: launch plan (%u threads, %zu bytes of shared memory) does not match the kernel traits (%d "
                 "threads, %d bytes)",
                 what, block_threads, smem, want_threads, want_smem);
        return 1;
    }
    return 0;
}

}  // namespace ta_emu_entry
