// Tree-attention backward main kernel for D = 64 with two key m-tiles per
// warp and the products split by role: tree_attn_bwd_main2_{atomic,det}_
// {bf16,f16}_d64 (Rust `MainKernel::TwoMTiles`, the default for d 64; the
// 4-warp two-m-tile kernel of tree_attn_bwd.cu stays selectable as
// `MainKernel::TwoMTilesFourWarps`, the one-m-tile kernel as
// `MainKernel::OneMTile`). Included by tree_attn_bwd.cu (its params, lse2
// rule, loaders and instantiations); the math, masks, walks and outputs are
// that file's (its top comment), only the tiling differs.
//
// Why. The 4-warp d 64 kernel gives each warp 32 keys and all five products,
// holding dK and dV (128 f32 registers) and a 32-query sub-tile's Sᵀ, dPᵀ
// (64): nothing is left to hold K's or V's A fragments, which it reloads per
// sub-tile, and it counts 2.67 (det) / 2.50 (atomic) HMMA per LDSM. Here, as
// in the d 128 kernel (tree_attn_bwd_main2_d128.cuh), a block of 8 warps
// owns 128 keys and the two warps of a key group (wk = w % 4, keys
// 32wk..32wk+31; role = w / 4) divide the work by role — at D = 64 not over
// the head dim but by product, each warp with one accumulator of 32 keys x
// 64 columns (64 registers):
//
//   once      role 0: K's A fragments of its 32 keys (4 k-steps x 2
//             m-tiles: 32 registers), role 1: V's, held for the block
//   phase 1   role 0: Sᵀ  (32 keys x 64 queries) = K Qᵀ   A: the held
//             role 1: dPᵀ (32 x 64)              = V dOᵀ  fragments,
//             B: ldmatrix.x4 on Q / dO rows (4 per k-step), each feeding 4
//             mma;
//             role 0: Pᵀ = exp2(Sᵀ·c − lse2) (masked), rounded to E into
//             the A fragments of the dV product and stored to shared memory
//             ([key][query], 16-bit)
//   barrier A (P in shared memory)
//   phase 2   role 0: dV += Pᵀ dO   A: its P fragments, B: ldmatrix.x4.trans
//                                    on dO rows (4 per k-step, 4 mma each)
//             role 1: Pᵀ's A fragments by ldmatrix.x4 from shared memory,
//             dSᵀ = P̃ᵀ ∘ (dPᵀ − D[q]) (P̃: the rounded P, as in the other
//             d 64 kernels) rounded to E; atomic mode: written over Pᵀ in
//             shared memory (the warp's own rows, read by no other warp
//             before barrier B)
//   barrier B (atomic mode only: dS in shared memory)
//   phase 3   role 1: dK += dSᵀ Q   A: its dS fragments, B: ldmatrix.x4.trans
//                                    on Q rows
//             role 0, atomic mode: dQ (32 queries x 32 columns per warp, the
//             4-warp kernel's 2 x 2 split) = dS K over the 128 keys, A:
//             ldmatrix.x4.trans on dSᵀ (2 per key step), B: ldmatrix.x4.trans
//             on K (2), each feeding 4 mma; one red.global.add.v2.f32 per
//             pair of adjacent columns on sm_90 (two scalar reds on sm_80).
//
// The next query tile is staged right after the barrier that publishes the
// current one (its buffer was last read before that barrier), so a tile
// needs 2 barriers (det: landed, A) or 3 (atomic: + B), as the 4-warp
// kernel. Warps w and w + 4 share an SM sub-partition (the usual mapping w %
// 4): phase 1 runs Sᵀ beside dPᵀ (64 HMMA each), then role 0's
// exponentials while role 1 waits at barrier A; det: role 0's dV (64)
// beside role 1's P loads, dS arithmetic and dK (64); atomic: dV beside the
// dS arithmetic and stores, then dQ (64) beside dK (64). Per warp and tile
// 128 HMMA (det), 128 / 192 (atomic: role 1 / role 0).
//
// Counted per warp and 64-row query tile from the code: role 0: Sᵀ 4 x 4 =
// 16 LDSM / 64 HMMA, dV 16 / 64: 32 / 128; role 1: dPᵀ 16 / 64, Pᵀ 8, dK 16 /
// 64: 40 / 128; atomic dQ (role 0) 8 key steps x (2 + 2) = 32 / 64 more. Per
// block and tile (64 queries x 128 keys): det 288 LDSM / 1,024 HMMA = 3.56,
// atomic 416 / 1,280 = 3.08 (the 4-warp kernel: 2.67 / 2.50; the one-m-tile
// kernel 2.00 / 1.90). Not counted per tile: the held A fragments, 8 LDSM
// per warp once per block.
//
// dQ atomics: 64 x D f32 per 64 x 128 tile pair = 2 bytes per visible
// (query, key) pair and head (0.25 red.global.add.v2.f32 per pair on sm_90,
// 0.5 scalar on sm_80), as the 4-warp kernel.
//
// Registers: the accumulator 64, the held A fragments 32, Sᵀ or dPᵀ in f32
// 64 (the same registers for both roles: phase 1 is one code path), then
// P's or dS's packed fragments 32; dQ's accumulator (32) after the
// accumulator-free phase 2 of role 0. 256 threads: one block per SM by
// registers as by the shared memory on A100.
//
// Shared memory 93,696 bytes (Bwd2RoleTraits, the 4-warp kernel's layout):
// K, V 36,864 | Q, dO x 2 36,864 | P / dS 18,432 | lse2, D 1,024 | kv_end
// 512.
//
// kFault is a test-only knob, instantiated for the emulator only (negative
// controls, tests/it/emu_bwd.rs): 1 drops barrier B (dS before the dQ
// product that reads it from shared memory), 2 swaps the two key m-tiles'
// K fragments in Sᵀ, 3 drops barrier A (P before role 1 reads it).
//
// kVar: the variant kernels (tree_attn_bwd_main2_var_*_d64): key starts
// (the query-tile walk also skips tiles whose rows' windows all start after
// the block's last key; the element mask tests k >= key_start[q]; full
// tiles need k0 >= the tile's largest start), a softcap and the blind rows
// of sinks, as the params say. The softcap costs no register: role 0 keeps
// P for dV and stores P ∘ (1 − tanh²) for role 1, which needs P only to
// form dS (dS = P̃' ∘ (dP − D), P̃' the stored, rounded product).
#pragma once

template <class Tr, bool kAtomicDq, int kFault = 0, bool kVar = false>
__device__ __forceinline__ void tree_attn_bwd_main2_roles_body(const TreeAttnBwdParams& p) {
    using E = typename Tr::Elem;
    constexpr int D = Tr::kHeadDim, BM = Tr::kBlockM, BN = Tr::kBlockN, RS = Tr::kRowStride;
    constexpr int PS = Tr::kDsStride;  // row stride of P / dS
    constexpr int kDTiles = D / 8;     // n-tiles of dK, dV per m-tile
    constexpr int kQTiles = BM / 8;    // n-tiles of Sᵀ, dPᵀ per m-tile
    constexpr int kQSteps = BM / 16;   // k-steps of the dK, dV products
    constexpr int kKSteps = D / 16;    // k-steps of Sᵀ, dPᵀ

    TA_DYNAMIC_SMEM(smem_raw);
    uint16_t* const sk = reinterpret_cast<uint16_t*>(smem_raw);
    uint16_t* const sv = sk + Tr::kKvElems;
    uint16_t* const sq = reinterpret_cast<uint16_t*>(smem_raw + Tr::kOffQ);  // 2 buffers
    uint16_t* const sdo = sq + 2 * Tr::kQElems;                               // 2 buffers
    uint16_t* const sp = reinterpret_cast<uint16_t*>(smem_raw + Tr::kOffDs);  // P, then dS
    float* const slse = reinterpret_cast<float*>(smem_raw + Tr::kOffRowStats);  // 2 x BM
    float* const sdelta = slse + 2 * BM;                                          // 2 x BM
    uint32_t* const skv = reinterpret_cast<uint32_t*>(smem_raw + Tr::kOffKvEnd);

    const uint32_t L = p.tokens;
    // Today's grid (key tile, kv head, split), or the balanced launch's item
    // blockIdx.x (p.items): the same, a query-tile range and a scratch slot.
    const uint32_t* const item = p.items ? p.items + (size_t)blockIdx.x * 8 : nullptr;
    const uint32_t tile = item ? item[0] : blockIdx.x, kv_head = item ? item[1] : blockIdx.y,
                   split = item ? item[2] : blockIdx.z;
    const uint32_t k0 = tile * BN;
    const uint32_t group = p.q_heads / p.kv_heads;
    const uint32_t per_split = group / p.group_splits;
    const uint32_t head_begin = kv_head * group + split * per_split, head_end = head_begin + per_split;
    const unsigned lane = ta_lane(), warp = threadIdx.x / 32;
    const unsigned g = lane >> 2, c = lane & 3, mi = lane >> 3, ri = lane & 7;
    const unsigned wk = warp & 3, role = warp >> 2;
    const int kr0 = int(wk) * 32;  // the warp's first key in the block

    // K, V (keys no query sees load as zeros, DESIGN §5; kv_end is read only
    // when one of the block's two bounds tiles may hold such a key) and the
    // block's kv_end (zero-filled past the pack), one cp.async group.
    const uint32_t bt = tile * 2;
    const TaUnseenKey unseen{
        p.kv_end, ta_unseen_keys(p.kv_end, p.tile_kv_min, bt, BN / 2, L).maybe ||
                      (bt + 1 < p.num_key_tiles && ta_unseen_keys(p.kv_end, p.tile_kv_min, bt + 1, BN / 2, L).maybe)};
    ta_load_tile<BN, D, RS, Tr::kThreads>(sk, p.k, k0, L, p.kv_heads, kv_head, unseen);
    ta_load_tile<BN, D, RS, Tr::kThreads>(sv, p.v, k0, L, p.kv_heads, kv_head, unseen);
    if (threadIdx.x < BN)
        ta_cp_async_4(skv + threadIdx.x, p.kv_end + (k0 + threadIdx.x < L ? k0 + threadIdx.x : 0),
                      k0 + threadIdx.x < L);
    ta_cp_async_commit();
    // The full-tile test needs the min over both bounds tiles (a second tile
    // past the pack makes k0 + BN > L: never full).
    const uint32_t tile_min = bt + 1 < p.num_key_tiles ? min(p.tile_kv_min[bt], p.tile_kv_min[bt + 1]) : 0u;
    ta_cp_async_wait<0>();
    __syncthreads();

    // The next visited query tile: the walk of the other main kernels, over
    // BN keys (BN / 32 per lane); every warp computes the same result.
    static_assert(BN % 32 == 0, "whole keys per lane");
    auto next_qtile = [&](uint32_t x) {
        uint32_t best = 0xffffffffu;
#pragma unroll
        for (int j = 0; j < BN / 32; ++j) {
            const uint32_t i = lane + 32 * j;
            const uint32_t lo = max(k0 + i, x);
            if (skv[i] > lo) best = min(best, lo);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) best = min(best, __shfl_xor_sync(TA_FULL_MASK, best, o));
        return best == 0xffffffffu ? best : best / BM;
    };
    // Variants with key starts: also skip the query tiles whose rows'
    // windows all start after the block's last key (mask.cuh), until both
    // rules agree.
    const bool window = kVar && p.key_start != nullptr;
    auto next_visit = [&](uint32_t x) {
        // (The item's range is re-read per call from its (cached) row, not
        // held in registers across the loop.)
        const uint32_t* const it = p.items ? p.items + (size_t)blockIdx.x * 8 : nullptr;
        const uint32_t qt_lo = it ? it[3] : 0u, qt_hi = it ? it[4] : 0xffffffffu;
        uint32_t t = next_qtile(max(x, qt_lo * BM));
        if constexpr (kVar) {
            if (window) {
                const uint32_t n_tiles = (L + BM - 1) / BM;
                while (t != 0xffffffffu) {
                    const uint32_t w = ta_next_window_qtile(p.start_tile_min, t, n_tiles, BM, k0 + BN - 1);
                    if (w == t) break;
                    t = w == 0xffffffffu ? w : next_qtile(w * BM);
                }
            }
        }
        return t >= qt_hi ? 0xffffffffu : t;
    };
    uint32_t* const sstart = reinterpret_cast<uint32_t*>(smem_raw + (kVar ? Tr::kOffStarts : 0));

    // Query tile qt of query head `head` -> buffer b: Q, dO (every row inside
    // the pack; blind ones are zeroed after the barrier, ta_zero_query_row)
    // and the rows' LSE and D by cp.async in one group;
    // the LSE lands raw and the thread that copied it turns it into lse2
    // after its own wait (lse2_in_place), before the barrier that publishes
    // the tile.
    auto stage = [&](uint32_t head, uint32_t qt, int b) {
        const unsigned tid = ta_tid_fresh();
        ta_load_tile<BM, D, RS, Tr::kThreads>(sq + b * Tr::kQElems, p.q, qt * BM, L, p.q_heads, head, TaLoadAll{}, tid);
        ta_load_tile<BM, D, RS, Tr::kThreads>(sdo + b * Tr::kQElems, p.d_o, qt * BM, L, p.q_heads, head, TaLoadAll{},
                                              tid);
        if (tid < BM) {
            const uint32_t row = qt * BM + tid;
            const size_t at = (size_t)head * L + (row < L ? row : 0);
            ta_cp_async_4(slse + b * BM + tid, p.lse + at, row < L);
            ta_cp_async_4(sdelta + b * BM + tid, p.delta + at, row < L);
            if (kVar && window)
                ta_cp_async_4(sstart + b * BM + tid, p.key_start + (row < L ? row : 0), row < L);
        }
    };
    // Returns whether the row is blind (inside the pack, no visible key:
    // LSE −inf, or with key starts the host's mark, TA_BLIND_ROW).
    auto lse2_in_place = [&](uint32_t qt, int b) -> bool {
        bool blind = false;
        if (threadIdx.x < BM) {
            const uint32_t row = qt * BM + threadIdx.x;
            float* const x = slse + b * BM + threadIdx.x;
            const float l = *x;
            if (kVar && window)
                blind = row < L && sstart[b * BM + threadIdx.x] > row;
            else
                blind = row < L && l == -INFINITY;
            *x = row >= L || l == -INFINITY ? INFINITY : l < INFINITY ? l * TA_LOG2E : NAN;
        }
        return blind;
    };

    // Row of the warp's 16-key m-tile m that lane passes to ldmatrix (A
    // fragments of K, V, Pᵀ, dSᵀ), and the B fragments' row / column split.
    const int a_row = kr0 + ri + 8 * (mi & 1), a_col = 8 * (mi >> 1);

    // The warp's A fragments of K (role 0) or V (role 1), held for the
    // block: [k-step][m-tile][4].
    uint32_t af[kKSteps][2][4];
    {
        const uint16_t* const arows = role == 0 ? sk : sv;
#pragma unroll
        for (int kk = 0; kk < kKSteps; ++kk)
#pragma unroll
            for (int m = 0; m < 2; ++m) ta_ldmatrix_x4(af[kk][m], arows + (a_row + m * 16) * RS + kk * 16 + a_col);
    }

    // dV (role 0) or dK (role 1) of the warp's 32 keys x D: [m-tile][n-tile][4].
    float acc[2][kDTiles][4];
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int n = 0; n < kDTiles; ++n)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[m][n][i] = 0.f;

    uint32_t head = head_begin, qt = next_visit(0);
    if (qt != 0xffffffffu) stage(head, qt, 0);
    ta_cp_async_commit();
    int buf = 0;
    while (qt != 0xffffffffu) {
        ta_cp_async_wait<0>();  // tile (head, qt) has landed
        const bool blind = lse2_in_place(qt, buf);
        // Publishes the tile; every warp is also done with the other
        // buffer and with P / dS of the previous tile. A tile with a blind
        // row zeroes it, then waits again.
        if (__syncthreads_or(blind)) {
            if (blind) ta_zero_query_row<D, RS>(sq + buf * Tr::kQElems, sdo + buf * Tr::kQElems, threadIdx.x);
            __syncthreads();
        }
        uint32_t nhead = head, nqt = next_visit((qt + 1) * BM);
        // (The first tile again for the next head: the walk from 0 rather
        // than a register held across the loop.)
        if (nqt == 0xffffffffu && ++nhead < head_end) nqt = next_visit(0);
        if (nqt != 0xffffffffu) stage(nhead, nqt, buf ^ 1);
        ta_cp_async_commit();

        const uint32_t q0 = qt * BM;
        const uint16_t* const qb = sq + buf * Tr::kQElems;
        const uint16_t* const dob = sdo + buf * Tr::kQElems;
        const float* const lse2 = slse + buf * BM;
        const float* const dlt = sdelta + buf * BM;

        // Phase 1: X = A Bᵀ for the warp's 32 keys x BM queries, Sᵀ = K Qᵀ
        // (role 0) or dPᵀ = V dOᵀ (role 1), A from the held fragments.
        float x[2][kQTiles][4];
        {
            const uint16_t* const brows = role == 0 ? qb : dob;
#pragma unroll
            for (int m = 0; m < 2; ++m)
#pragma unroll
                for (int n = 0; n < kQTiles; ++n)
#pragma unroll
                    for (int i = 0; i < 4; ++i) x[m][n][i] = 0.f;
#pragma unroll
            for (int kk = 0; kk < kKSteps; ++kk) {
#pragma unroll
                for (int np = 0; np < BM / 16; ++np) {
                    uint32_t b[4];
                    ta_ldmatrix_x4(b, brows + (np * 16 + ri + 8 * (mi >> 1)) * RS + kk * 16 + 8 * (mi & 1));
#pragma unroll
                    for (int m = 0; m < 2; ++m) {
                        const int am = kFault == 2 && role == 0 ? 1 - m : m;
                        ta_mma_16816<E>(x[m][2 * np], af[kk][am], b[0], b[1]);
                        ta_mma_16816<E>(x[m][2 * np + 1], af[kk][am], b[2], b[3]);
                    }
                }
            }
        }

        // Pᵀ (role 0) or dSᵀ (role 1) as A fragments rounded to E:
        // [m-tile][k-step][4] (the C fragments of n-tiles 2kq, 2kq + 1 are
        // the A fragment of k-step kq).
        uint32_t pa[2][kQSteps][4];
        if (role == 0) {
            // Pᵀ = exp2(Sᵀ·c − lse2[q]) (masked), packed and stored rounded
            // to shared memory, [key][query].
            const bool full = TA_TILE_FULL(BN, k0, q0, q0 + BM, tile_min, L) && q0 + BM <= L &&
                              (!window || k0 >= p.start_tile_max[q0 / kTaStartTile]);
#pragma unroll
            for (int m = 0; m < 2; ++m)
#pragma unroll
                for (int n = 0; n < kQTiles; ++n) {
                    if constexpr (kVar) {
                        // P for dV (pa), P ∘ (1 − tanh²) for role 1's dS (sp).
                        float pf[4];
#pragma unroll
                        for (int i = 0; i < 4; ++i) {
                            const int ql = n * 8 + 2 * c + (i & 1);
                            const int kl = kr0 + m * 16 + g + 8 * (i >> 1);
                            float fac;
                            float pv = ta_bwd_var_p(p, x[m][n][i], lse2[ql], &fac);
                            if (!full && (!TA_VISIBLE(k0 + kl, skv[kl], q0 + ql) ||
                                          (window && k0 + kl < sstart[buf * BM + ql])))
                                pv = 0.f;
                            x[m][n][i] = pv;
                            pf[i] = pv * fac;
                        }
#pragma unroll
                        for (int r = 0; r < 2; ++r) {
                            pa[m][n >> 1][2 * (n & 1) + r] = ta_pack2<E>(x[m][n][2 * r], x[m][n][2 * r + 1]);
                            *reinterpret_cast<uint32_t*>(sp + (kr0 + m * 16 + g + 8 * r) * PS + n * 8 + 2 * c) =
                                ta_pack2<E>(pf[2 * r], pf[2 * r + 1]);
                        }
                    } else {
#pragma unroll
                        for (int i = 0; i < 4; ++i) {
                            const int ql = n * 8 + 2 * c + (i & 1);
                            const int kl = kr0 + m * 16 + g + 8 * (i >> 1);
                            float pv = ta_exp2(x[m][n][i] * p.scale_log2 - lse2[ql]);
                            if (!full && !TA_VISIBLE(k0 + kl, skv[kl], q0 + ql)) pv = 0.f;
                            x[m][n][i] = pv;
                        }
#pragma unroll
                        for (int r = 0; r < 2; ++r) {
                            const uint32_t w = ta_pack2<E>(x[m][n][2 * r], x[m][n][2 * r + 1]);
                            pa[m][n >> 1][2 * (n & 1) + r] = w;
                            *reinterpret_cast<uint32_t*>(sp + (kr0 + m * 16 + g + 8 * r) * PS + n * 8 + 2 * c) = w;
                        }
                    }
                }
        }
        // (The barriers sit where every thread of the block reaches them:
        // the role branches close before each one.)
        if (kFault != 3) __syncthreads();  // barrier A: P in shared memory

        if (role == 0) {
            // Phase 2: dV += Pᵀ dO.
#pragma unroll
            for (int kq = 0; kq < kQSteps; ++kq)
#pragma unroll
                for (int dpi = 0; dpi < D / 16; ++dpi) {
                    uint32_t b[4];
                    ta_ldmatrix_x4_trans(b, dob + (kq * 16 + ri + 8 * (mi & 1)) * RS + dpi * 16 + 8 * (mi >> 1));
#pragma unroll
                    for (int m = 0; m < 2; ++m) {
                        ta_mma_16816<E>(acc[m][2 * dpi], pa[m][kq], b[0], b[1]);
                        ta_mma_16816<E>(acc[m][2 * dpi + 1], pa[m][kq], b[2], b[3]);
                    }
                }
        } else {
            // Phase 2: Pᵀ's A fragments from shared memory, dSᵀ = P̃ᵀ ∘ (dPᵀ −
            // D[q]) rounded to E; atomic mode: written over Pᵀ (this warp's
            // rows; its ldmatrix has read the words it overwrites: one
            // warp-wide instruction, every lane's values in registers).
#pragma unroll
            for (int kq = 0; kq < kQSteps; ++kq) {
#pragma unroll
                for (int m = 0; m < 2; ++m) ta_ldmatrix_x4(pa[m][kq], sp + (a_row + m * 16) * PS + kq * 16 + a_col);
#pragma unroll
                for (int m = 0; m < 2; ++m)
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        const int n = 2 * kq + (j >> 1), i0 = 2 * (j & 1);
                        const int ql = n * 8 + 2 * c;
                        const float p0 = ta_to_f32<E>(uint16_t(pa[m][kq][j] & 0xffffu));
                        const float p1 = ta_to_f32<E>(uint16_t(pa[m][kq][j] >> 16));
                        pa[m][kq][j] =
                            ta_pack2<E>(p0 * (x[m][n][i0] - dlt[ql]), p1 * (x[m][n][i0 + 1] - dlt[ql + 1]));
                    }
                if (kAtomicDq) {
                    // Every lane's ldmatrix of this k-step has read before
                    // any lane stores over those words (explicit ordering
                    // among the warp's lanes, not left to convergence).
                    __syncwarp();
#pragma unroll
                    for (int m = 0; m < 2; ++m)
#pragma unroll
                        for (int j = 0; j < 4; ++j)
                            *reinterpret_cast<uint32_t*>(sp + (kr0 + m * 16 + g + 8 * (j & 1)) * PS + kq * 16 +
                                                         8 * (j >> 1) + 2 * c) = pa[m][kq][j];
                }
            }
        }
        if (kAtomicDq && kFault != 1) __syncthreads();  // barrier B: dS in shared memory

        if (role == 1) {
            // Phase 3: dK += dSᵀ Q.
#pragma unroll
            for (int kq = 0; kq < kQSteps; ++kq)
#pragma unroll
                for (int dpi = 0; dpi < D / 16; ++dpi) {
                    uint32_t b[4];
                    ta_ldmatrix_x4_trans(b, qb + (kq * 16 + ri + 8 * (mi & 1)) * RS + dpi * 16 + 8 * (mi >> 1));
#pragma unroll
                    for (int m = 0; m < 2; ++m) {
                        ta_mma_16816<E>(acc[m][2 * dpi], pa[m][kq], b[0], b[1]);
                        ta_mma_16816<E>(acc[m][2 * dpi + 1], pa[m][kq], b[2], b[3]);
                    }
                }
        } else if (kAtomicDq) {
            // Phase 3: dQ (BM x D) = dS K over the BN keys: role-0 warp wk
            // -> 32 query rows (half mt) x 32 columns (half part), two
            // m-tiles x four n-tiles; each A and each B fragment feeds 4 mma.
            static_assert(BM == 64 && D == 64, "dQ: 2 x 2 warps of 32 x 32");
            const unsigned mt = wk & 1, part = wk >> 1;
            float dq[2][4][4];
#pragma unroll
            for (int j = 0; j < 2; ++j)
#pragma unroll
                for (int n = 0; n < 4; ++n)
#pragma unroll
                    for (int i = 0; i < 4; ++i) dq[j][n][i] = 0.f;
#pragma unroll 2
            for (int kk = 0; kk < BN / 16; ++kk) {
                uint32_t a[2][4];
#pragma unroll
                for (int j = 0; j < 2; ++j)
                    ta_ldmatrix_x4_trans(a[j], sp + (kk * 16 + 8 * (mi >> 1) + ri) * PS + mt * 32 + j * 16 + 8 * (mi & 1));
#pragma unroll
                for (int dpi = 0; dpi < 2; ++dpi) {
                    uint32_t b[4];
                    ta_ldmatrix_x4_trans(b, sk + (kk * 16 + ri + 8 * (mi & 1)) * RS + part * 32 + dpi * 16 +
                                                8 * (mi >> 1));
#pragma unroll
                    for (int j = 0; j < 2; ++j) {
                        ta_mma_16816<E>(dq[j][2 * dpi], a[j], b[0], b[1]);
                        ta_mma_16816<E>(dq[j][2 * dpi + 1], a[j], b[2], b[3]);
                    }
                }
            }
            // One red.global.add.v2.f32 per pair of adjacent columns on sm_90
            // (ta_red_add_v2_f32; two scalar reds before).
#pragma unroll
            for (int j = 0; j < 2; ++j)
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const uint32_t row = q0 + mt * 32 + j * 16 + g + 8 * r;
                    if (row >= L) continue;
                    float* const out = p.dq_accum + ((size_t)row * p.q_heads + head) * D + part * 32 + 2 * c;
#pragma unroll
                    for (int n = 0; n < 4; ++n)
                        ta_red_add_v2_f32(out + n * 8, dq[j][n][2 * r] * p.scale, dq[j][n][2 * r + 1] * p.scale);
                }
        }
        head = nhead;
        qt = nqt;
        buf ^= 1;
    }

    // Role 0 holds dV, role 1 dK (scaled on the way out).
    const float osc = role == 0 ? 1.f : p.scale;
    static_assert(BN == kTaBalancedKeys, "a balanced launch's region is one key tile");
    const uint32_t region = p.items ? p.items[(size_t)blockIdx.x * 8 + 5] : kTaNoRegion;
    if (p.items ? region != kTaNoRegion : p.group_splits > 1) {
        // This slice's (item's) f32 partial dK (scaled) or dV, summed by
        // tree_attn_bwd_dkv_convert: slot `split` of [splits, 2, L,
        // kv_heads, D], or the item's region, [2, BN, D] for keys k0...
        const size_t half = p.items ? (size_t)BN * D : (size_t)L * p.kv_heads * D;
        const size_t row_stride = p.items ? (size_t)D : (size_t)p.kv_heads * D;
        float* const out = p.dkv_accum + (size_t)(p.items ? region : split) * 2 * half +
                           (p.items ? 0 : (size_t)kv_head * D) + (role == 0 ? half : 0);
        const uint32_t row0 = p.items ? k0 : 0u;
#pragma unroll
        for (int m = 0; m < 2; ++m)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const uint32_t key = k0 + kr0 + m * 16 + g + 8 * r;
                if (key >= L) continue;
                const size_t at = (size_t)(key - row0) * row_stride;
#pragma unroll
                for (int n = 0; n < kDTiles; ++n) {
                    const size_t e = at + n * 8 + 2 * c;
                    out[e] = acc[m][n][2 * r] * osc;
                    out[e + 1] = acc[m][n][2 * r + 1] * osc;
                }
            }
        return;
    }
    // dV, dK (scaled) through the K, V tile buffers once every warp is past
    // its last read of K (atomic dQ), then 16-byte stores, rows past the pack
    // never stored.
    __syncthreads();
    uint16_t* const sout = role == 0 ? sv : sk;
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = kr0 + m * 16 + g + 8 * r;
#pragma unroll
            for (int n = 0; n < kDTiles; ++n)
                *reinterpret_cast<uint32_t*>(sout + row * RS + n * 8 + 2 * c) =
                    ta_pack2<E>(acc[m][n][2 * r] * osc, acc[m][n][2 * r + 1] * osc);
        }
    __syncthreads();
    constexpr int kChunks = D / 8;
#pragma unroll
    for (int it = 0; it < BN * kChunks / Tr::kThreads; ++it) {
        const int i = it * Tr::kThreads + threadIdx.x;
        const int r = i / kChunks, ch = i % kChunks;
        if (k0 + r >= L) continue;
        const size_t at = ((size_t)(k0 + r) * p.kv_heads + kv_head) * D + ch * 8;
        *reinterpret_cast<ta_vec16*>(p.dk + at) = *reinterpret_cast<const ta_vec16*>(sk + r * RS + ch * 8);
        *reinterpret_cast<ta_vec16*>(p.dv + at) = *reinterpret_cast<const ta_vec16*>(sv + r * RS + ch * 8);
    }
}
