// Tree-attention forward: FlashAttention-2 on a pack with the interval mask
// of DESIGN §4 (query q sees key k iff k <= q < kv_end[k]).
//
//   S = scale · Q Kᵀ (masked),  P = softmax(S) row-wise,  O = P V,
//   LSE = log Σ_k exp(S) (natural log; −inf and O = 0 for a row with no key).
//
// Layout. Q, O: [tokens, q_heads, D]; K, V: [tokens, kv_heads, D], 16-bit
// elements, row-major; LSE: [q_heads, tokens] f32; GQA: query head h reads kv
// head h / (q_heads / kv_heads).
//
// Tiling (FwdTraits, kernel_traits.cuh), that of FlashAttention-2. One block
// per (query tile of kBlockM = 128 rows, query head): grid (ceil(L / 128),
// q_heads), the last query tile first; 4 warps, warp w owns query rows
// 32w..32w+31 of the tile as two 16-row m-tiles (mt = 0, 1), so every K or V
// fragment an ldmatrix.x4 loads feeds 4 mma (2 n-tiles x 2 m-tiles). Key
// tiles of kBlockN = 64. Dynamic shared memory, rows padded by 8 elements
// (16 bytes) so that the 8 row addresses of an ldmatrix fall in distinct bank
// groups: Q (128 x D, its own region) | K[2] | V[2] (64 x D each) | row
// statistics (4 KiB, below) | kv_end[2] (per K / V buffer, the key tile's
// kv_end and its tile_kv_min, 68 words, copied by cp.async in the tile's
// group: the full-tile test and the element mask read shared memory, with
// no global load left between QKᵀ and the softmax; issue 26; then the tile
// walk's look-ahead window, 64 words, below): 60,448 bytes for D = 64,
// 109,600 for D = 128 (above 48 KB: the CUDA backend raises the kernels'
// limit at load).
// For each key tile:
//   S (32 x 64 per warp)  = Q Kᵀ : ldmatrix.x4 on K rows gives the B
//                           fragments (K row-major is Kᵀ column-major), each
//                           used by both m-tiles; the A fragments of Q stay in
//                           registers for D = 64 (32 registers, loaded once)
//                           and are reloaded from the Q region per k-step for
//                           D = 128 (2 ldmatrix per 4 of K: 64 more registers
//                           would not fit in 255);
//   online softmax on S in registers (exp2 with scale·log2 e folded in);
//   P = S rounded to 16 bits, packed: the S accumulators of two n-tiles are
//                           the A fragment of one k-step (C layout of two
//                           n-tiles = A layout of one k-step);
//   O (32 x D per warp)  += P V  : ldmatrix.x4.trans on V rows gives the B
//                           fragments, each used by both m-tiles.
// Static HMMA / LDSM per key tile (scripts/sass-report.sh): D = 64: 128 / 32
// = 4.0 (Q in registers); D = 128: 256 / 80 = 3.2.
// Registers (ptxas, CUDA 13.0): O accumulators 2·(D/8)·4 f32 (64 or 128), S
// 2·8·4 = 64 f32, Q fragments 32 (D = 64) or 8 at a time (D = 128): 254 / 234
// (D = 64, sm_90a / sm_80) and 255 (D = 128), no spills. The running row max
// and row sum of a thread's 4 rows are kept in shared memory (one word per
// thread and statistic, consecutive threads in consecutive banks; each
// thread reads and writes only its own words), not registers: in registers
// the D = 128 kernel spilled 16 to 48 bytes to local memory.
// Fragment layouts (PTX ISA, mma.m16n8k16; g = lane/4, c = lane%4):
//   A 16x16: a[r] half h = A[g + 8(r&1)][2c + h + 8(r>>1)]
//   B 16x8:  b[r] half h = B[2c + h + 8r][g]
//   C 16x8:  acc[i]      = C[g + 8(i>>1)][2c + (i&1)]
// so a thread holds rows g and g+8 of each of its warp's two m-tiles (tile
// rows 32w + 16mt + g and 32w + 16mt + g + 8); row statistics (max, sum) are
// reduced over the quad of lanes 4g..4g+3.
//
// Epilogue: each warp normalises its O rows, stages them in its own 32 rows
// of the Q region (only this warp read those rows; no copy is in flight into
// them) and writes them out as 16-byte row-contiguous stores; rows past L
// are dropped.
//
// Pipeline. cp.async (ta_load_tile, tile_load.cuh): the Q tile in one commit
// group, then K and V in two buffers each: while tile j is computed, the next
// non-skipped tile is in flight; one commit group per tile. Per tile: wait
// for its group (wait_group 0) and a barrier (landed for all threads; every
// warp is past the previous tile, so the other buffer is free), choose the
// next tile and issue its copies into the other buffer, compute, and a
// barrier at the end (no warp still reads the buffer the next prefetch
// overwrites).
//
// Tile walk. The loop visits only the key tiles with a visible pair, in
// order. The next one is found by each warp on its own (all warps find the
// same): lane i reads tile_kv_max[t + 1 + i], __ballot_sync of "visible",
// and the lowest set bit (__ffs) is the tile; 32 tiles per step, so a
// GRPO-like pack that skips ~225 tiles in a row costs 8 steps, not 225.
// One-tile look-ahead (issue 39): tile_kv_max and tile_kv_min of the 32
// tiles after tile t are copied by cp.async in tile t's own group (the
// window, per K / V buffer), so that when tile t has landed the next tile
// and its unseen-key bound come from shared memory: no dependent global
// load (ballot -> tile_kv_min) stands between a tile's wait and the
// cp.async of the next one. Only after 32 skipped tiles in a row does the
// walk read global memory (ta_next_visible_tile from tile t + 33). What is
// left on that path: the per-key kv_end of TaUnseenKey, for a tile whose
// tile_kv_min lies inside it (a key that may be seen by nobody).
//
// Mask. Per key tile t = [k0, k1) the pack precomputes min and max of kv_end
// over its keys (tree_attn_kv_tile_bounds below). For the query tile
// [q0, q1) (q1 clipped to L):
//   skip    when k0 > q1 − 1 or max kv_end <= q0: no query of the tile sees a
//           key of the tile; the tile is never loaded: the loop walks only
//           the non-skipped tiles and prefetches the next one;
//   full    when the tile lies inside the pack (k0 + 64 <= L), k1 − 1 <= q0
//           and min kv_end >= q1: every pair is visible, no element mask
//           (TA_TILE_FULL, mask.cuh);
//   partial otherwise: S[q][k] = −inf unless k < L and k <= q < kv_end[k]
//           (ta_key_end, TA_VISIBLE).
// Padding keys (kv_end[k] == k) are seen by nobody, their tiles are partial;
// their V rows are loaded as zeros (TaUnseenKey, mask.cuh), so that a NaN
// there never enters P V as 0 · NaN (their K rows only reach masked scores).
// Rows and keys past L are zero-filled on load, masked, and never stored.
//
// Online softmax (per row, over tiles): m = running max of S (raw units),
// l = running Σ exp2(S·c − m·c) with c = scale·log2 e. For a new tile:
// m' = max(m, max S); base = m'·c, or 0 while m' = −inf (nothing visible yet,
// so that −inf − −inf never occurs); α = exp2(m·c − base); P = exp2(S·c −
// base); l = α l + Σ P; O = α O + P V. At the end O /= l and
// LSE = (m·c + log2 l) · ln 2; a row with l = 0 gets O = 0, LSE = −inf.
//
// Rotary is not this kernel's concern: with rotary on, the backends rotate Q
// and K once into scratch buffers (kernels/rope.cu) and launch this kernel on
// those.
//
// Attention variants (tree_attn_fwd_var_*, the same body with kVar): the
// same tiling plus the query tile's key starts (mask.cuh: q sees k iff
// key_start[q] <= k <= q < kv_end[k]; a sliding window on the tree,
// explicit starts, the blind rows of sinks) in shared memory after the
// plain layout (kSmemBytesVar: + 512 bytes); the key-tile walk begins at
// the tile of the smallest start of the tile's rows and a tile is full
// only at or after the largest (per-64-row bounds). A softcap maps each
// raw score to c · tanh(scale · s / c) before the mask (ta_softcap_r,
// common.cuh; scale_log2 is then log2 e); sinks join each row's sum at
// the end (exp(σ_h), no value: O = acc · 2^(m − top) / total, LSE =
// ln total). The plain kernels compile without any of it.
#include "kernel_traits.cuh"
#include "mask.cuh"
#include "tile_load.cuh"

// Kernel arguments (one struct by value). Mirrored by
// `crate::backend::launch::FwdParams` in Rust; both sides assert the layout.
struct TreeAttnFwdParams {
    const uint16_t* q;
    const uint16_t* k;
    const uint16_t* v;
    uint16_t* o;
    float* lse;
    const uint32_t* kv_end;       // [tokens]
    const uint32_t* tile_kv_min;  // [num_key_tiles]
    const uint32_t* tile_kv_max;  // [num_key_tiles]
    uint32_t tokens;
    uint32_t q_heads;
    uint32_t kv_heads;
    uint32_t num_key_tiles;
    float scale_log2;  // softmax_scale · log2(e); log2(e) with a softcap (the capped scores are scaled)
    uint32_t reserved;
    // The attention variants (read by tree_attn_fwd_var_* only; null / 0
    // for the plain kernels): per-row key starts and their per-64-row
    // bounds (mask.cuh), one sink logit per query head, the softcap c and
    // 2 · scale / c · log2(e) (ta_softcap_r; 0: none).
    const uint32_t* key_start;       // [tokens] or null
    const uint32_t* start_tile_min;  // [ceil(tokens / 64)]
    const uint32_t* start_tile_max;
    const uint16_t* sinks;  // [q_heads] or null
    float softcap_c;
    float softcap_in;
};
static_assert(sizeof(TreeAttnFwdParams) == 128, "TreeAttnFwdParams: update its Rust mirror");
TA_FIELD_AT(TreeAttnFwdParams, q, 0); TA_FIELD_AT(TreeAttnFwdParams, k, 8); TA_FIELD_AT(TreeAttnFwdParams, v, 16);
TA_FIELD_AT(TreeAttnFwdParams, o, 24); TA_FIELD_AT(TreeAttnFwdParams, lse, 32);
TA_FIELD_AT(TreeAttnFwdParams, kv_end, 40); TA_FIELD_AT(TreeAttnFwdParams, tile_kv_min, 48);
TA_FIELD_AT(TreeAttnFwdParams, tile_kv_max, 56); TA_FIELD_AT(TreeAttnFwdParams, tokens, 64);
TA_FIELD_AT(TreeAttnFwdParams, q_heads, 68); TA_FIELD_AT(TreeAttnFwdParams, kv_heads, 72);
TA_FIELD_AT(TreeAttnFwdParams, num_key_tiles, 76); TA_FIELD_AT(TreeAttnFwdParams, scale_log2, 80);
TA_FIELD_AT(TreeAttnFwdParams, reserved, 84);
TA_FIELD_AT(TreeAttnFwdParams, key_start, 88); TA_FIELD_AT(TreeAttnFwdParams, start_tile_min, 96);
TA_FIELD_AT(TreeAttnFwdParams, start_tile_max, 104); TA_FIELD_AT(TreeAttnFwdParams, sinks, 112);
TA_FIELD_AT(TreeAttnFwdParams, softcap_c, 120); TA_FIELD_AT(TreeAttnFwdParams, softcap_in, 124);

struct KvTileBoundsParams {
    const uint32_t* kv_end;
    uint32_t* tile_kv_min;
    uint32_t* tile_kv_max;
    uint32_t tokens;
    uint32_t tile;  // keys per tile
    uint32_t num_tiles;
    uint32_t reserved;
};
static_assert(sizeof(KvTileBoundsParams) == 40, "KvTileBoundsParams: update its Rust mirror");
TA_FIELD_AT(KvTileBoundsParams, kv_end, 0); TA_FIELD_AT(KvTileBoundsParams, tile_kv_min, 8);
TA_FIELD_AT(KvTileBoundsParams, tile_kv_max, 16); TA_FIELD_AT(KvTileBoundsParams, tokens, 24);
TA_FIELD_AT(KvTileBoundsParams, tile, 28); TA_FIELD_AT(KvTileBoundsParams, num_tiles, 32);
TA_FIELD_AT(KvTileBoundsParams, reserved, 36);

// kVar: the variant kernel (tree_attn_fwd_var_*): key starts (a sliding
// window, explicit starts, the sinks' blind rows), a softcap and sinks as
// the params say, each off when null / 0. Without kVar none of that code
// exists: the plain kernels compile exactly as before the variants.
template <class Tr, bool kVar = false>
__device__ __forceinline__ void tree_attn_fwd_body(const TreeAttnFwdParams& p) {
    using E = typename Tr::Elem;
    constexpr int D = Tr::kHeadDim, BM = Tr::kBlockM, BN = Tr::kBlockN, RS = Tr::kRowStride;
    constexpr int MT = Tr::kMTiles;   // m-tiles (16 rows) per warp
    constexpr int WM = 16 * MT;       // query rows per warp
    constexpr int kNTiles = BN / 8;   // n-tiles of S per m-tile
    constexpr int kDTiles = D / 8;    // n-tiles of O per m-tile
    constexpr int kDSteps = D / 16;   // k-steps of Q Kᵀ
    constexpr int kNSteps = BN / 16;  // k-steps of P V

    TA_DYNAMIC_SMEM(smem_raw);
    uint16_t* const sq = reinterpret_cast<uint16_t*>(smem_raw);  // the Q tile, then the O tile
    uint16_t* const sk = reinterpret_cast<uint16_t*>(smem_raw + Tr::kOffK);  // two buffers of kKvElems
    uint16_t* const sv = reinterpret_cast<uint16_t*>(smem_raw + Tr::kOffV);  // two buffers of kKvElems

    const uint32_t L = p.tokens;
    // Last query tile first: with a causal-like mask the late tiles carry the
    // most keys, and starting them first shortens the tail of the grid.
    const uint32_t q0 = (gridDim.x - 1 - blockIdx.x) * BM;
    if (q0 >= p.tokens) return;  // a grid larger than the pack (whole block: no barrier skipped)
    const uint32_t head = blockIdx.y;
    const uint32_t kv_head = head / (p.q_heads / p.kv_heads);
    const uint32_t q1 = q0 + BM < L ? q0 + BM : L;  // exclusive, clipped
    const unsigned lane = ta_lane(), warp = threadIdx.x / 32;
    const unsigned g = lane >> 2, c = lane & 3;
    // ldmatrix row-address roles of this lane: matrix mi = lane/8, row ri.
    const unsigned mi = lane >> 3, ri = lane & 7;
    // This warp's rows of the Q / O tile in shared memory.
    uint16_t* const sq_warp = sq + warp * WM * RS;

    // Key tiles that can hold a visible key: k0 <= q1 - 1.
    const uint32_t t_end = min(p.num_key_tiles, (q1 - 1) / BN + 1);
    // Variants with key starts: the walk begins at the key tile of the
    // smallest start of the tile's rows (tiles wholly before every row's
    // window are never visited), and a tile is full only at or after the
    // largest (kTaStartTile-row bounds; a 128-row tile spans two).
    uint32_t t_begin = 0, start_max = 0;
    const bool window = kVar && p.key_start != nullptr;
    if constexpr (kVar) {
        static_assert(BM % kTaStartTile == 0, "whole start tiles per query tile");
        if (window) {
            uint32_t lo = 0xffffffffu;
            for (uint32_t i = q0 / kTaStartTile; i * kTaStartTile < q1; ++i) {
                lo = min(lo, p.start_tile_min[i]);
                start_max = max(start_max, p.start_tile_max[i]);
            }
            t_begin = lo / BN;
        }
    }
    // The next key tile with a visible key (mask.cuh: 32 tiles per step).
    auto next_tile = [&](uint32_t t) { return ta_next_visible_tile(p.tile_kv_max, t, t_end, q0); };

    // Per K / V buffer b: the tile's kv_end (keys past the pack zero-filled:
    // seen by nobody) and its tile_kv_min, copied by cp.async in the tile's
    // group (thread i < BN: key i, thread BN: the bound), so that neither the
    // full-tile test nor the element mask waits on a global load after QKᵀ;
    // and the look-ahead window of the walk: tile_kv_max and tile_kv_min of
    // the 32 key tiles after it (warps 2 and 3; tiles at or past t_end
    // zero-filled: a max of 0 is never > q0, so never chosen).
    uint32_t* const skv = reinterpret_cast<uint32_t*>(smem_raw + Tr::kOffKvEnd);
    static_assert(Tr::kThreads == 128 && BN + 1 <= Tr::kThreads, "warps 2, 3 stage the window");
    auto stage_bounds = [&](uint32_t tt, int b) {
        uint32_t* const dst = skv + b * Tr::kKvEndWords;
        const uint32_t key = tt * BN + threadIdx.x;
        if (threadIdx.x < BN)
            ta_cp_async_4(dst + threadIdx.x, p.kv_end + (key < L ? key : 0), key < L);
        if (threadIdx.x == BN) ta_cp_async_4(dst + BN, p.tile_kv_min + tt, true);
        ta_stage_window<Tr::kThreads>(dst + Tr::kWindowOff, p.tile_kv_max, p.tile_kv_min, tt, t_end);
    };

    ta_load_tile<BM, D, RS, Tr::kThreads>(sq, p.q, q0, L, p.q_heads, head);
    // Variants with key starts: the rows' starts join Q's group (rows past
    // the pack zero-filled: never stored).
    const uint32_t* const sstart = reinterpret_cast<const uint32_t*>(smem_raw + (kVar ? Tr::kOffStarts : 0));
    if constexpr (kVar) {
        static_assert(BM == Tr::kThreads, "one row's start per thread");
        if (window) {
            const uint32_t row = q0 + threadIdx.x;
            ta_cp_async_4(smem_raw + Tr::kOffStarts + 4 * threadIdx.x, p.key_start + (row < L ? row : 0), row < L);
        }
    }
    ta_cp_async_commit();
    uint32_t t = next_tile(t_begin);
    if (t < t_end) {
        ta_load_tile<BN, D, RS, Tr::kThreads>(sk, p.k, t * BN, L, p.kv_heads, kv_head);
        ta_load_tile<BN, D, RS, Tr::kThreads>(sv, p.v, t * BN, L, p.kv_heads, kv_head,
                                              ta_unseen_keys(p.kv_end, p.tile_kv_min, t, BN, L));
        stage_bounds(t, 0);
    }
    ta_cp_async_commit();
    ta_cp_async_wait<1>();  // Q has landed (this thread's part)
    __syncthreads();

    // A fragments of Q for m-tile mt, k-step kk: rows 16mt + (0..15) of this
    // warp's, columns 16kk + (0..15).
    auto load_q = [&](uint32_t (&a)[4], int mt, int kk) {
        ta_ldmatrix_x4(a, sq_warp + (mt * 16 + ri + 8 * (mi & 1)) * RS + kk * 16 + 8 * (mi >> 1));
    };
    // kQInRegs: all of them, once (the Q region is read by nobody after).
    uint32_t qf[Tr::kQInRegs ? MT : 1][Tr::kQInRegs ? kDSteps : 1][4];
    if constexpr (Tr::kQInRegs) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int kk = 0; kk < kDSteps; ++kk) load_q(qf[mt][kk], mt, kk);
    }

    float acc[MT][kDTiles][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int n = 0; n < kDTiles; ++n)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[mt][n][i] = 0.f;
    // Per m-tile mt, r = 0 / 1: row g / g + 8 of the m-tile.
    // Online-softmax statistics of this lane's rows (row g + 8r of m-tile
    // mt): the running max and the partial running sum over this lane's
    // columns. They live in shared memory, one word per thread and statistic
    // (FwdTraits::kOffStats; consecutive threads, consecutive banks): in
    // registers they push the D = 128 kernel past 255 registers into local
    // memory spills (ptxas, CUDA 13.0). Each thread touches only its own words.
    float* const stats = reinterpret_cast<float*>(smem_raw + Tr::kOffStats) + threadIdx.x;
#define TA_ROW_MAX(mt, r) stats[((mt) * 2 + (r)) * Tr::kThreads]
#define TA_ROW_SUM(mt, r) stats[(2 * MT + (mt) * 2 + (r)) * Tr::kThreads]
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            TA_ROW_MAX(mt, r) = -INFINITY;
            TA_ROW_SUM(mt, r) = 0.f;
        }
    // Query row of this lane's accumulator row r of m-tile mt.
    const uint32_t row_g = q0 + warp * WM + g;
#define TA_FWD_ROW(mt, r) (row_g + (mt) * 16 + 8 * (r))

    int buf = 0;
    while (t < t_end) {
        ta_cp_async_wait<0>();  // tile t has landed, with its bounds and look-ahead window
        __syncthreads();
        // The next tile from tile t's window (shared memory: no global load
        // on the prefetch path) and whether it may hold a key no query sees
        // (its tile_kv_min below its end: TaUnseenKey). Only after a run of
        // 32 skipped tiles does the walk go back to global memory.
        bool maybe_unseen;
        const uint32_t tn = ta_window_next(skv + buf * Tr::kKvEndWords + Tr::kWindowOff, p.tile_kv_max,
                                           p.tile_kv_min, t, t_end, q0, BN, L, maybe_unseen);
        if (tn < t_end) {
            ta_load_tile<BN, D, RS, Tr::kThreads>(sk + (buf ^ 1) * Tr::kKvElems, p.k, tn * BN, L, p.kv_heads,
                                                  kv_head);
            ta_load_tile<BN, D, RS, Tr::kThreads>(sv + (buf ^ 1) * Tr::kKvElems, p.v, tn * BN, L, p.kv_heads,
                                                  kv_head, TaUnseenKey{p.kv_end, maybe_unseen});
            stage_bounds(tn, buf ^ 1);
        }
        ta_cp_async_commit();

        const uint16_t* const kt = sk + buf * Tr::kKvElems;
        const uint16_t* vt = sv + buf * Tr::kKvElems;
        const uint32_t k0 = t * BN;

        // S = Q Kᵀ for this warp's 32 rows and the tile's BN keys: each K
        // fragment feeds both m-tiles.
        float s[MT][kNTiles][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int n = 0; n < kNTiles; ++n)
#pragma unroll
                for (int i = 0; i < 4; ++i) s[mt][n][i] = 0.f;
#pragma unroll
        for (int kk = 0; kk < kDSteps; ++kk) {
            uint32_t qs[MT][4];
            if constexpr (!Tr::kQInRegs) {
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) load_q(qs[mt], mt, kk);
            }
#pragma unroll
            for (int np = 0; np < kNTiles / 2; ++np) {
                uint32_t b[4];
                ta_ldmatrix_x4(b, kt + (np * 16 + ri + 8 * (mi >> 1)) * RS + kk * 16 + 8 * (mi & 1));
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    const uint32_t(&a)[4] = Tr::kQInRegs ? qf[mt][Tr::kQInRegs ? kk : 0] : qs[mt];
                    ta_mma_16816<E>(s[mt][2 * np], a, b[0], b[1]);
                    ta_mma_16816<E>(s[mt][2 * np + 1], a, b[2], b[3]);
                }
            }
        }

        if constexpr (kVar) {
            // Softcap (before the mask: tanh(−inf) would unmask): s = c ·
            // tanh(scale · s / c), in natural units (scale_log2 = log2 e).
            if (p.softcap_c > 0.f) {
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int n = 0; n < kNTiles; ++n)
#pragma unroll
                        for (int i = 0; i < 4; ++i)
                            s[mt][n][i] = p.softcap_c - 2.f * p.softcap_c * ta_softcap_r(s[mt][n][i], p.softcap_in);
            }
        }

        const uint32_t* const kvt = skv + buf * Tr::kKvEndWords;
        const bool full = TA_TILE_FULL(BN, k0, q0, q1, kvt[BN], L) && (!kVar || k0 >= start_max);
        if (!full) {  // element mask (mask.cuh; kv_end as ta_key_end gives it)
#pragma unroll
            for (int n = 0; n < kNTiles; ++n) {
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    const uint32_t col = k0 + n * 8 + 2 * c + j;
                    const uint32_t end = kvt[n * 8 + 2 * c + j];
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                        for (int r = 0; r < 2; ++r) {
                            bool vis = TA_VISIBLE(col, end, TA_FWD_ROW(mt, r));
                            // Variants: also at or after the row's key start.
                            if (kVar && window) vis = vis && col >= sstart[warp * WM + mt * 16 + 8 * r + g];
                            if (!vis) s[mt][n][2 * r + j] = -INFINITY;
                        }
                }
            }
        }

        // Online softmax, per m-tile rows g (r = 0) and g + 8 (r = 1).
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                float mx = TA_ROW_MAX(mt, r);
#pragma unroll
                for (int n = 0; n < kNTiles; ++n) mx = fmaxf(mx, fmaxf(s[mt][n][2 * r], s[mt][n][2 * r + 1]));
                mx = ta_quad_max(mx);
                const float base = mx == -INFINITY ? 0.f : mx * p.scale_log2;
                const float alpha = ta_exp2(TA_ROW_MAX(mt, r) * p.scale_log2 - base);
                TA_ROW_MAX(mt, r) = mx;
                float sum = 0.f;
#pragma unroll
                for (int n = 0; n < kNTiles; ++n) {
#pragma unroll
                    for (int j = 0; j < 2; ++j) {
                        const float e = ta_exp2(s[mt][n][2 * r + j] * p.scale_log2 - base);
                        s[mt][n][2 * r + j] = e;
                        sum += e;
                    }
                }
                TA_ROW_SUM(mt, r) = TA_ROW_SUM(mt, r) * alpha + sum;
#pragma unroll
                for (int n = 0; n < kDTiles; ++n) {
                    acc[mt][n][2 * r] *= alpha;
                    acc[mt][n][2 * r + 1] *= alpha;
                }
            }
        }

        // P in 16 bits: the S accumulators of n-tiles 2kk and 2kk + 1 of an
        // m-tile are the A fragment of P for k-step kk (C layout of two
        // n-tiles = A layout of one k-step). Packing all of P before P V
        // halves the registers S held (64 floats -> 32 words).
        uint32_t pf[MT][kNSteps][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int kk = 0; kk < kNSteps; ++kk) {
                pf[mt][kk][0] = ta_pack2<E>(s[mt][2 * kk][0], s[mt][2 * kk][1]);
                pf[mt][kk][1] = ta_pack2<E>(s[mt][2 * kk][2], s[mt][2 * kk][3]);
                pf[mt][kk][2] = ta_pack2<E>(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
                pf[mt][kk][3] = ta_pack2<E>(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
            }

        // O += P V: each V fragment feeds both m-tiles.
#pragma unroll
        for (int kk = 0; kk < kNSteps; ++kk) {
#pragma unroll
            for (int dp = 0; dp < kDTiles / 2; ++dp) {
                uint32_t b[4];
                ta_ldmatrix_x4_trans(b, vt + (kk * 16 + ri + 8 * (mi & 1)) * RS + dp * 16 + 8 * (mi >> 1));
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    ta_mma_16816<E>(acc[mt][2 * dp], pf[mt][kk], b[0], b[1]);
                    ta_mma_16816<E>(acc[mt][2 * dp + 1], pf[mt][kk], b[2], b[3]);
                }
            }
        }
        __syncthreads();  // every warp is done with buffer `buf` before it is refilled
        t = tn;
        buf ^= 1;
    }

    // Epilogue: O = acc / l goes through this warp's own 32 rows of the Q
    // region (only this warp read them, and no copy is in flight into them),
    // so that the global stores are 16-byte and row-contiguous; rows past L
    // are dropped.
    __syncwarp();  // this warp's Q fragment loads are done before O overwrites them
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const float l = ta_quad_sum(TA_ROW_SUM(mt, r));
            if constexpr (!kVar) {
                const float inv = l > 0.f ? 1.f / l : 0.f;
#pragma unroll
                for (int n = 0; n < kDTiles; ++n)
                    *reinterpret_cast<uint32_t*>(sq_warp + (mt * 16 + g + 8 * r) * RS + n * 8 + 2 * c) =
                        ta_pack2<E>(acc[mt][n][2 * r] * inv, acc[mt][n][2 * r + 1] * inv);
                if (c == 0 && TA_FWD_ROW(mt, r) < L)
                    p.lse[(size_t)head * L + TA_FWD_ROW(mt, r)] =
                        l > 0.f ? (TA_ROW_MAX(mt, r) * p.scale_log2 + log2f(l)) * 0.69314718055994531f : -INFINITY;
            } else {
                // In log2 units: m2 the row's max, l the sum relative to it.
                const float m2 = TA_ROW_MAX(mt, r) * p.scale_log2;
                float inv = l > 0.f ? 1.f / l : 0.f;
                float lse = l > 0.f ? (m2 + log2f(l)) * 0.69314718055994531f : -INFINITY;
                if (p.sinks != nullptr) {
                    // Sinks: exp(σ) joins the row's sum with no value,
                    // relative to the larger of the two references (neither
                    // term overflows): total = l · 2^(m2 − top) + 2^(σ2 −
                    // top), O = acc · 2^(m2 − top) / total, LSE = (top +
                    // log2 total) · ln 2; a row with no visible key: O = 0,
                    // LSE = σ exactly.
                    const float sink = ta_to_f32<E>(p.sinks[head]);
                    if (l > 0.f) {
                        const float s2 = sink * 1.4426950408889634f, top = fmaxf(m2, s2);
                        const float a = ta_exp2(m2 - top), total = l * a + ta_exp2(s2 - top);
                        inv = a / total;
                        lse = (top + log2f(total)) * 0.69314718055994531f;
                    } else {
                        lse = sink;
                    }
                }
#pragma unroll
                for (int n = 0; n < kDTiles; ++n)
                    *reinterpret_cast<uint32_t*>(sq_warp + (mt * 16 + g + 8 * r) * RS + n * 8 + 2 * c) =
                        ta_pack2<E>(acc[mt][n][2 * r] * inv, acc[mt][n][2 * r + 1] * inv);
                if (c == 0 && TA_FWD_ROW(mt, r) < L) p.lse[(size_t)head * L + TA_FWD_ROW(mt, r)] = lse;
            }
        }
    }
    __syncwarp();
    constexpr int kChunks = D / 8;  // 16-byte chunks per row
#pragma unroll
    for (int it = 0; it < WM * kChunks / 32; ++it) {
        const int i = it * 32 + lane, r = i / kChunks, ch = i % kChunks;
        const uint32_t row = q0 + warp * WM + r;
        if (row < L)
            *reinterpret_cast<ta_vec16*>(p.o + ((size_t)row * p.q_heads + head) * D + ch * 8) =
                *reinterpret_cast<const ta_vec16*>(sq_warp + r * RS + ch * 8);
    }
}

#undef TA_FWD_ROW
#undef TA_ROW_MAX
#undef TA_ROW_SUM

#define TA_FWD_KERNEL(SUFFIX, E, D, DTYPE)                                              \
    extern "C" __global__ void __launch_bounds__(FwdTraits<E, D>::kThreads)             \
        tree_attn_fwd_##SUFFIX(const TreeAttnFwdParams p) {                              \
        tree_attn_fwd_body<FwdTraits<E, D>>(p);                                          \
    }                                                                                    \
    extern "C" __global__ void __launch_bounds__(FwdTraits<E, D>::kThreads)             \
        tree_attn_fwd_var_##SUFFIX(const TreeAttnFwdParams p) {                          \
        tree_attn_fwd_body<FwdTraits<E, D>, true>(p);                                    \
    }
TA_ATTN_VARIANTS(TA_FWD_KERNEL)
#undef TA_FWD_KERNEL

// Per-key-tile min and max of kv_end: one warp per tile of `tile` keys,
// 4 warps per block (grid = ceil(num_tiles / 4)). Runs once per pack.
extern "C" __global__ void __launch_bounds__(128) tree_attn_kv_tile_bounds(const KvTileBoundsParams p) {
    const uint32_t t = blockIdx.x * 4 + threadIdx.x / 32;
    if (t >= p.num_tiles) return;  // whole warps leave together
    const uint32_t k0 = t * p.tile;
    const uint32_t k1 = k0 + p.tile < p.tokens ? k0 + p.tile : p.tokens;
    uint32_t lo = 0xffffffffu, hi = 0u;
    for (uint32_t k = k0 + ta_lane(); k < k1; k += 32) {
        const uint32_t e = p.kv_end[k];
        lo = min(lo, e);
        hi = max(hi, e);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        lo = min(lo, __shfl_xor_sync(TA_FULL_MASK, lo, o));
        hi = max(hi, __shfl_xor_sync(TA_FULL_MASK, hi, o));
    }
    if (ta_lane() == 0) {
        p.tile_kv_min[t] = lo;
        p.tile_kv_max[t] = hi;
    }
}
