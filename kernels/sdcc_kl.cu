// SDCC fused forward-KL over the vocabulary (DESIGN §5). For each pair i =
// (student row s, teacher row t) of [rows, vocab] logits, temperature τ and
// weight w_i, with p = softmax(logits / τ):
//
//   KL_i = Σ_v p_t(v) · (log p_t(v) − log p_s(v))
//   ∂(w_i KL_i) / ∂ student[s, v] = w_i · (p_s(v) − p_t(v)) / τ
//
// The teacher gets no gradient (stop-gradient).
//
// One block of 256 threads per pair, two sweeps over the pair's two rows:
//   sweep 1 reads both rows once, in chunks of 256 x 8 entries (thread j
//     reads entries chunk + 8j .. chunk + 8j + 7 as 16-byte vectors when the
//     vocabulary is a multiple of 8 and the tensors are 16-byte aligned,
//     else entries chunk + 256i + j: coalesced scalars), keeping per thread
//     an online log-sum-exp of both distributions — running maxima m_t, m_s and sums
//     Z_t = Σ 2^(a − m_t), Z_s = Σ 2^(b − m_s) with a, b the logits / τ in
//     base-2 units (· log2 e, so every exponential is one ex2) — and the
//     cross term W = Σ 2^(a − m_t) ((a − m_t) − (b − m_s)), re-centred
//     whenever a running maximum moves. Then KL = (W / Z_t − log2 Z_t +
//     log2 Z_s) · ln 2: no softmax is materialised and large logit offsets
//     never cancel. The exponentials are f32 (one ex2 each); Z_t, Z_s, W and
//     the cross term's differences are accumulated in f64 per thread, so for
//     near-equal rows (tiny KLs, where W / Z_t, log2 Z_t and log2 Z_s nearly
//     cancel) the error is the exponentials' rounding alone: measured
//     ≤ 4.6e-10 nats absolute at vocab 32k–150k, against up to 4.8e-8 with
//     f32 sums (tests/it/emu_sdcc.rs). The f64 work is ~4 operations per entry of a
//     memory-bound sweep; re-centring (f64 exp2) only when a maximum moves.
//     The 256 partial states are combined in f64 (warp
//     shuffles, then one slot per warp in shared memory).
//   sweep 2 re-reads both rows and writes the gradient, which needs both
//     final log-sum-exps, so it cannot be folded into sweep 1.
// Memory traffic per pair: 4 row reads + 1 f32 row write; beyond inputs and
// gradient, O(pairs): the per-pair KL (f64) and a status word.
//
// Infinities: a teacher −inf (p_t = 0) adds exactly 0 (its terms are skipped,
// never 0 · −inf); a student −inf where the teacher has mass makes KL = +inf
// (the true value) while the gradient stays finite (p_s = 0 there). NaN and
// +inf logits, and rows that are entirely −inf, are reported in the status
// word (the host turns them into errors, as the CPU backend does).
//
// Student rows named by several pairs: with `accumulate` the gradient is
// added with f32 atomics into a zeroed buffer (summation order varies); the
// host sets it only when rows repeat, otherwise each row is stored once.
// Indexing is 64-bit: rows × vocab may pass 2^31.
#include "common.cuh"

// Kernel arguments (one struct by value). Mirrored by
// `crate::backend::launch::sdcc::SdccParams` in Rust; both sides assert the
// layout.
struct SdccParams {
    const void* student;      // [student rows, vocab] of the element type
    const void* teacher;      // [teacher rows, vocab]
    const uint32_t* pairs;    // [pairs, 2]: (student row, teacher row)
    const float* weights;     // [pairs]
    float* grad;              // [student rows, vocab]
    double* kl;               // [pairs], natural log
    uint32_t* status;         // [pairs], kSdcc* bits
    uint64_t vocab;
    uint32_t num_pairs;
    float inv_tau_log2;       // log2(e) / τ
    float inv_tau;            // 1 / τ
    uint32_t accumulate;      // atomicAdd the gradient (rows repeat)
    uint32_t vec8;            // 16-byte vector loads / stores (vocab % 8 == 0, aligned tensors)
    // Unfused baseline only: [2, pairs, vocab] f32 log-probabilities (student
    // rows, then teacher rows) and [2, pairs] per-row status words.
    float* logp;
    uint32_t* row_status;
};
static_assert(sizeof(SdccParams) == 104, "SdccParams: update its Rust mirror");
TA_FIELD_AT(SdccParams, student, 0); TA_FIELD_AT(SdccParams, teacher, 8); TA_FIELD_AT(SdccParams, pairs, 16);
TA_FIELD_AT(SdccParams, weights, 24); TA_FIELD_AT(SdccParams, grad, 32); TA_FIELD_AT(SdccParams, kl, 40);
TA_FIELD_AT(SdccParams, status, 48); TA_FIELD_AT(SdccParams, vocab, 56); TA_FIELD_AT(SdccParams, num_pairs, 64);
TA_FIELD_AT(SdccParams, inv_tau_log2, 68); TA_FIELD_AT(SdccParams, inv_tau, 72);
TA_FIELD_AT(SdccParams, accumulate, 76); TA_FIELD_AT(SdccParams, vec8, 80); TA_FIELD_AT(SdccParams, logp, 88);
TA_FIELD_AT(SdccParams, row_status, 96);

// Status bits per pair.
#define TA_SDCC_STUDENT_NONFINITE 1u  // a NaN or +inf student logit
#define TA_SDCC_TEACHER_NONFINITE 2u
#define TA_SDCC_STUDENT_ALL_NEG_INF 4u  // no distribution
#define TA_SDCC_TEACHER_ALL_NEG_INF 8u

struct ta_f32 {};

template <class E>
__device__ __forceinline__ float ta_sdcc_load(const void* p, size_t i) {
    return ta_to_f32<E>(static_cast<const uint16_t*>(p)[i]);
}
template <>
__device__ __forceinline__ float ta_sdcc_load<ta_f32>(const void* p, size_t i) {
    return static_cast<const float*>(p)[i];
}

#define TA_SDCC_THREADS 256
#define TA_SDCC_WARPS (TA_SDCC_THREADS / 32)
#define TA_SDCC_UNROLL 8  // entries per thread per chunk

// Entries v0 .. v0 + 7 of a row as 16-byte vector loads (v0 a multiple of
// 8, the row 16-byte aligned): one vector for 16-bit elements, two for f32.
template <class E>
__device__ __forceinline__ void ta_sdcc_vec8(const void* p, size_t at, float (&out)[TA_SDCC_UNROLL]) {
    const ta_vec16 u = *reinterpret_cast<const ta_vec16*>(static_cast<const uint16_t*>(p) + at);
    const uint32_t words[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        out[2 * i] = ta_to_f32<E>(uint16_t(words[i] & 0xffffu));
        out[2 * i + 1] = ta_to_f32<E>(uint16_t(words[i] >> 16));
    }
}
template <>
__device__ __forceinline__ void ta_sdcc_vec8<ta_f32>(const void* p, size_t at, float (&out)[TA_SDCC_UNROLL]) {
    const ta_vec16* q = reinterpret_cast<const ta_vec16*>(static_cast<const float*>(p) + at);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const ta_vec16 u = q[h];
        out[4 * h + 0] = __uint_as_float(u.x);
        out[4 * h + 1] = __uint_as_float(u.y);
        out[4 * h + 2] = __uint_as_float(u.z);
        out[4 * h + 3] = __uint_as_float(u.w);
    }
}

// The columns of the 8 entries of a row that thread t handles in the chunk
// starting at entry `base` (a multiple of 256 · 8). With `vec`: the
// contiguous entries base + 8t .. base + 8t + 7 (vocab a multiple of 8, so
// all are in range or none is); otherwise base + t + 256j (coalesced scalar
// loads). Out-of-range entries get column V.
__device__ __forceinline__ void ta_sdcc_cols(size_t base, size_t V, bool vec, size_t (&col)[TA_SDCC_UNROLL]) {
#pragma unroll
    for (int j = 0; j < TA_SDCC_UNROLL; ++j) {
        const size_t v = vec ? base + (size_t)threadIdx.x * TA_SDCC_UNROLL + j
                             : base + (size_t)j * TA_SDCC_THREADS + threadIdx.x;
        col[j] = v < V ? v : V;
    }
}

// Those 8 entries of the row starting at element `row_off`; −inf past V.
template <class E>
__device__ __forceinline__ void ta_sdcc_load8(const void* p, size_t row_off, size_t V, bool vec,
                                              const size_t (&col)[TA_SDCC_UNROLL], float (&out)[TA_SDCC_UNROLL]) {
    if (vec) {
        if (col[0] < V) {
            ta_sdcc_vec8<E>(p, row_off + col[0], out);
        } else {
#pragma unroll
            for (int j = 0; j < TA_SDCC_UNROLL; ++j) out[j] = -INFINITY;
        }
        return;
    }
#pragma unroll
    for (int j = 0; j < TA_SDCC_UNROLL; ++j) out[j] = col[j] < V ? ta_sdcc_load<E>(p, row_off + col[j]) : -INFINITY;
}

// A partial sweep-1 state over some vocabulary entries (base-2 units).
struct SdccState {
    double m_t, z_t, m_s, z_s, w;
    uint32_t flags;  // status bits, plus kInfinite
};
#define TA_SDCC_INFINITE 0x100u  // teacher mass where the student is −inf

// The state of the union of the entries of x and y.
__device__ __forceinline__ SdccState ta_sdcc_combine(const SdccState& x, const SdccState& y) {
    SdccState r;
    r.m_t = fmax(x.m_t, y.m_t);
    r.m_s = fmax(x.m_s, y.m_s);
    r.flags = x.flags | y.flags;
    r.z_t = r.z_s = r.w = 0.0;
    const bool inf = r.flags & TA_SDCC_INFINITE;
    const SdccState* parts[2] = {&x, &y};
    for (int i = 0; i < 2; ++i) {
        const SdccState& s = *parts[i];
        if (s.z_t > 0.0) {
            const double f = exp2(s.m_t - r.m_t);
            r.z_t += s.z_t * f;
            // z_t > 0 without the infinite flag implies a finite m_s.
            if (!inf) r.w += (s.w + ((s.m_t - s.m_s) - (r.m_t - r.m_s)) * s.z_t) * f;
        }
        if (s.z_s > 0.0) r.z_s += s.z_s * exp2(s.m_s - r.m_s);
    }
    return r;
}

__device__ __forceinline__ SdccState ta_sdcc_shfl_xor(const SdccState& s, int o) {
    SdccState r;
    r.m_t = __shfl_xor_sync(TA_FULL_MASK, s.m_t, o);
    r.z_t = __shfl_xor_sync(TA_FULL_MASK, s.z_t, o);
    r.m_s = __shfl_xor_sync(TA_FULL_MASK, s.m_s, o);
    r.z_s = __shfl_xor_sync(TA_FULL_MASK, s.z_s, o);
    r.w = __shfl_xor_sync(TA_FULL_MASK, s.w, o);
    r.flags = __shfl_xor_sync(TA_FULL_MASK, s.flags, o);
    return r;
}

// Shared memory: one state per warp, then the two final base-2 LSEs.
#define TA_SDCC_SMEM_BYTES (TA_SDCC_WARPS * int(sizeof(SdccState)) + 16)

template <class E>
__device__ __forceinline__ void sdcc_kl_body(const SdccParams& p) {
    TA_DYNAMIC_SMEM(smem_raw);
    SdccState* const swarp = reinterpret_cast<SdccState*>(smem_raw);
    float* const slse = reinterpret_cast<float*>(smem_raw + TA_SDCC_WARPS * sizeof(SdccState));

    const uint32_t pair = blockIdx.x;
    const size_t V = p.vocab;
    const uint32_t srow = p.pairs[2 * pair], trow = p.pairs[2 * pair + 1];
    const size_t s_off = (size_t)srow * V, t_off = (size_t)trow * V;
    const float c = p.inv_tau_log2;

    // Sweep 1, per thread: maxima and exponentials in f32, the sums Z_t,
    // Z_s, W and the cross term's differences in f64 (see the top).
    float m_t = -INFINITY, m_s = -INFINITY;
    double z_t = 0.0, z_s = 0.0, w = 0.0;
    uint32_t flags = 0;
    const bool vec = p.vec8 != 0;
    for (size_t base = 0; base < V; base += TA_SDCC_THREADS * TA_SDCC_UNROLL) {
        size_t col[TA_SDCC_UNROLL];
        float a[TA_SDCC_UNROLL], b[TA_SDCC_UNROLL];
        ta_sdcc_cols(base, V, vec, col);
        ta_sdcc_load8<E>(p.student, s_off, V, vec, col, b);
        ta_sdcc_load8<E>(p.teacher, t_off, V, vec, col, a);
        float mx_t = -INFINITY, mx_s = -INFINITY;
#pragma unroll
        for (int j = 0; j < TA_SDCC_UNROLL; ++j) {
            if (!(b[j] < INFINITY)) flags |= TA_SDCC_STUDENT_NONFINITE;
            if (!(a[j] < INFINITY)) flags |= TA_SDCC_TEACHER_NONFINITE;
            a[j] *= c;
            b[j] *= c;
            mx_t = fmaxf(mx_t, a[j]);
            mx_s = fmaxf(mx_s, b[j]);
        }
        const float n_t = fmaxf(m_t, mx_t), n_s = fmaxf(m_s, mx_s);
        // Re-centre only when a maximum moved (f64 factors: rare, exact
        // differences of f32 maxima).
        if (z_t > 0.0 && (n_t != m_t || n_s != m_s)) {
            const double f = n_t != m_t ? exp2((double)m_t - (double)n_t) : 1.0;
            if (!(flags & TA_SDCC_INFINITE))
                w = (w + (((double)m_t - (double)m_s) - ((double)n_t - (double)n_s)) * z_t) * f;
            z_t *= f;
        }
        if (z_s > 0.0 && n_s != m_s) z_s *= exp2((double)m_s - (double)n_s);
        m_t = n_t;
        m_s = n_s;
#pragma unroll
        for (int j = 0; j < TA_SDCC_UNROLL; ++j) {
            if (b[j] > -INFINITY) z_s += (double)ta_exp2(b[j] - m_s);
            if (a[j] > -INFINITY) {
                const float e = ta_exp2(a[j] - m_t);
                z_t += (double)e;
                if (b[j] == -INFINITY)
                    flags |= TA_SDCC_INFINITE;
                else if (!(flags & TA_SDCC_INFINITE))
                    // (a − m_t) − (b − m_s) exactly: f32 values subtract
                    // without rounding in f64, so near-equal rows (tiny KLs)
                    // do not lose the difference.
                    w += (double)e * (((double)a[j] - (double)m_t) - ((double)b[j] - (double)m_s));
            }
        }
    }

    // Block reduction in f64.
    SdccState st{m_t, z_t, m_s, z_s, w, flags};
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) st = ta_sdcc_combine(st, ta_sdcc_shfl_xor(st, o));
    const unsigned warp = threadIdx.x / 32;
    if (ta_lane() == 0) swarp[warp] = st;
    __syncthreads();
    if (threadIdx.x == 0) {
        SdccState r = swarp[0];
        for (int i = 1; i < TA_SDCC_WARPS; ++i) r = ta_sdcc_combine(r, swarp[i]);
        uint32_t status = r.flags & 0xffu;
        if (r.z_t == 0.0) status |= TA_SDCC_TEACHER_ALL_NEG_INF;
        if (r.z_s == 0.0) status |= TA_SDCC_STUDENT_ALL_NEG_INF;
        const double ln2 = 0.69314718055994530942;
        const double kl = (r.flags & TA_SDCC_INFINITE) ? INFINITY : (r.w / r.z_t - log2(r.z_t) + log2(r.z_s)) * ln2;
        p.kl[pair] = status ? NAN : kl;
        p.status[pair] = status;
        // Base-2 log-sum-exps; +inf makes every probability 0 for a bad pair.
        slse[0] = status ? INFINITY : float(r.m_s + log2(r.z_s));
        slse[1] = status ? INFINITY : float(r.m_t + log2(r.z_t));
    }
    __syncthreads();

    // Sweep 2: the gradient w · (p_s − p_t) / τ.
    const float lse_s = slse[0], lse_t = slse[1];
    const float g = p.weights[pair] * p.inv_tau;
    float* const grow = p.grad + s_off;
    for (size_t base = 0; base < V; base += TA_SDCC_THREADS * TA_SDCC_UNROLL) {
        size_t col[TA_SDCC_UNROLL];
        float x[TA_SDCC_UNROLL], y[TA_SDCC_UNROLL], d[TA_SDCC_UNROLL];
        ta_sdcc_cols(base, V, vec, col);
        ta_sdcc_load8<E>(p.student, s_off, V, vec, col, x);
        ta_sdcc_load8<E>(p.teacher, t_off, V, vec, col, y);
#pragma unroll
        for (int j = 0; j < TA_SDCC_UNROLL; ++j) d[j] = g * (ta_exp2(x[j] * c - lse_s) - ta_exp2(y[j] * c - lse_t));
        if (vec && !p.accumulate) {
            if (col[0] < V) {
                ta_vec16* out = reinterpret_cast<ta_vec16*>(grow + col[0]);
                out[0] = ta_vec16{__float_as_uint(d[0]), __float_as_uint(d[1]), __float_as_uint(d[2]),
                                  __float_as_uint(d[3])};
                out[1] = ta_vec16{__float_as_uint(d[4]), __float_as_uint(d[5]), __float_as_uint(d[6]),
                                  __float_as_uint(d[7])};
            }
        } else {
#pragma unroll
            for (int j = 0; j < TA_SDCC_UNROLL; ++j) {
                if (col[j] >= V) continue;
                if (p.accumulate)
                    atomicAdd(grow + col[j], d[j]);
                else
                    grow[col[j]] = d[j];
            }
        }
    }
}

#define TA_SDCC_KERNEL(NAME, E)                                                           \
    extern "C" __global__ void __launch_bounds__(TA_SDCC_THREADS) NAME(const SdccParams p) { \
        sdcc_kl_body<E>(p);                                                               \
    }
TA_SDCC_KERNEL(sdcc_kl_bf16, ta_bf16)
TA_SDCC_KERNEL(sdcc_kl_f16, ta_f16)
TA_SDCC_KERNEL(sdcc_kl_f32, ta_f32)

// ---- Unfused baseline ----------------------------------------------------------
// The textbook composition the fused kernel replaces, kept for gpu-check's
// timing (and tested against the CPU backend like the fused one): gather +
// log_softmax of each side into an f32 buffer, then an elementwise KL with a
// block sum and the gradient. Memory traffic per pair: 4 row reads (16-bit)
// + 2 f32 row writes + 2 f32 row reads + 1 f32 row write, against the fused
// kernel's 4 row reads + 1 f32 row write. Natural-log units, f32 sums.

// Block-wide max (is_max) or sum of x, returned to every thread; `red` holds
// one float per warp. Every thread of the block calls it.
__device__ __forceinline__ float ta_sdcc_block_reduce(float x, bool is_max, float* red) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float y = __shfl_xor_sync(TA_FULL_MASK, x, o);
        x = is_max ? fmaxf(x, y) : x + y;
    }
    if (ta_lane() == 0) red[threadIdx.x / 32] = x;
    __syncthreads();
    float r = red[0];
    for (int i = 1; i < TA_SDCC_WARPS; ++i) r = is_max ? fmaxf(r, red[i]) : r + red[i];
    __syncthreads();  // `red` is free again
    return r;
}

// One block per (pair, side): side 0 the pair's student row, 1 its teacher
// row. logp = logits / τ − LSE; row_status gets the row's NaN / +inf and
// all-−inf bits (student bits; the host maps teacher rows).
template <class E>
__device__ __forceinline__ void sdcc_unfused_log_softmax_body(const SdccParams& p) {
    TA_DYNAMIC_SMEM(smem_raw);
    float* const red = reinterpret_cast<float*>(smem_raw);
    const uint32_t pair = blockIdx.x, side = blockIdx.y;
    const size_t V = p.vocab;
    const void* src = side ? p.teacher : p.student;
    const size_t off = (size_t)p.pairs[2 * pair + side] * V;
    float* const out = p.logp + ((size_t)side * p.num_pairs + pair) * V;
    float m = -INFINITY;
    float bad = 0.f;
    for (size_t v = threadIdx.x; v < V; v += TA_SDCC_THREADS) {
        const float x = ta_sdcc_load<E>(src, off + v);
        if (!(x < INFINITY)) bad = 1.f;
        m = fmaxf(m, x * p.inv_tau);
    }
    m = ta_sdcc_block_reduce(m, true, red);
    bad = ta_sdcc_block_reduce(bad, true, red);
    float z = 0.f;
    for (size_t v = threadIdx.x; v < V; v += TA_SDCC_THREADS) {
        const float x = ta_sdcc_load<E>(src, off + v) * p.inv_tau;
        if (x > -INFINITY) z += expf(x - m);
    }
    z = ta_sdcc_block_reduce(z, false, red);
    const float lse = m + logf(z);
    for (size_t v = threadIdx.x; v < V; v += TA_SDCC_THREADS) out[v] = ta_sdcc_load<E>(src, off + v) * p.inv_tau - lse;
    if (threadIdx.x == 0)
        p.row_status[side * p.num_pairs + pair] =
            (bad > 0.f ? TA_SDCC_STUDENT_NONFINITE : 0u) | (z > 0.f ? 0u : TA_SDCC_STUDENT_ALL_NEG_INF);
}

// One block per pair: KL from the two log-probability rows, and the gradient.
__device__ __forceinline__ void sdcc_unfused_kl_body(const SdccParams& p) {
    TA_DYNAMIC_SMEM(smem_raw);
    float* const red = reinterpret_cast<float*>(smem_raw);
    const uint32_t pair = blockIdx.x;
    const size_t V = p.vocab;
    const float* const ls = p.logp + (size_t)pair * V;
    const float* const lt = p.logp + ((size_t)p.num_pairs + pair) * V;
    float* const grow = p.grad + (size_t)p.pairs[2 * pair] * V;
    const float g = p.weights[pair] * p.inv_tau;
    float kl = 0.f, inf = 0.f;
    for (size_t v = threadIdx.x; v < V; v += TA_SDCC_THREADS) {
        const float a = lt[v], b = ls[v];
        const float pt = expf(a);
        if (a > -INFINITY) {
            if (b == -INFINITY)
                inf = 1.f;
            else
                kl += pt * (a - b);
        }
        const float d = g * (expf(b) - pt);
        if (p.accumulate)
            atomicAdd(grow + v, d);
        else
            grow[v] = d;
    }
    kl = ta_sdcc_block_reduce(kl, false, red);
    inf = ta_sdcc_block_reduce(inf, true, red);
    if (threadIdx.x == 0) p.kl[pair] = inf > 0.f ? INFINITY : (double)kl;
}

#define TA_SDCC_UNFUSED_KERNEL(NAME, E)                                                      \
    extern "C" __global__ void __launch_bounds__(TA_SDCC_THREADS) NAME(const SdccParams p) { \
        sdcc_unfused_log_softmax_body<E>(p);                                                 \
    }
TA_SDCC_UNFUSED_KERNEL(sdcc_unfused_log_softmax_bf16, ta_bf16)
TA_SDCC_UNFUSED_KERNEL(sdcc_unfused_log_softmax_f16, ta_f16)
TA_SDCC_UNFUSED_KERNEL(sdcc_unfused_log_softmax_f32, ta_f32)
extern "C" __global__ void __launch_bounds__(TA_SDCC_THREADS) sdcc_unfused_kl(const SdccParams p) {
    sdcc_unfused_kl_body(p);
}
