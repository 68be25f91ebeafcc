// Tree-attention backward main kernel for D = 128 with two key m-tiles per
// warp: tree_attn_bwd_main2_{atomic,det}_{bf16,f16}_d128 (Rust
// `MainKernel::TwoMTiles`, the default for d 128; the one-m-tile kernel of
// tree_attn_bwd.cu stays selectable as `MainKernel::OneMTile`). Included by
// tree_attn_bwd.cu (its params, lse2 rule, loaders and instantiations); the
// math, masks, walks and outputs are that file's (its top comment), only the
// tiling differs.
//
// Why. The d 64 two-m-tile kernel gives each warp 32 keys so that every Q /
// dO fragment feeds 4 mma; at D = 128 the dK, dV accumulators of 32 keys x
// 128 take 256 registers, so the one-m-tile kernel (16 keys per warp, 1.8–1.9
// HMMA per LDSM) was kept. Here, as in FlashAttention-2's hdim-128 backward,
// a block of 8 warps owns 128 keys and the dK, dV accumulators are split
// over the head dim: warp w = (key group wk = w % 4, role = w / 4) holds dK
// and dV of keys 32wk..32wk+31 (two 16-key m-tiles) x columns 64·role ..
// 64·role + 63: 2 · 2 · 8 · 4 = 128 registers. Unlike FA2 (every warp a 32 x
// 32 piece of both S and dP: 2 HMMA per LDSM there), the two warps of a key
// group split the two score products between them, each over all 64
// queries of the tile:
//
//   phase 1   role 0: Sᵀ  (32 keys x 64 queries) = K Qᵀ    A: ldmatrix.x4 on K
//             role 1: dPᵀ (32 x 64)              = V dOᵀ       rows (2 per
//             k-step), B: ldmatrix.x4 on Q / dO rows (4 per k-step), each
//             A fragment feeding 8 mma and each B fragment 4;
//             role 0: Pᵀ = exp2(Sᵀ·c − lse2) (masked), kept in its f32
//             registers and stored rounded to E to shared memory ([key]
//             [query], 16-bit);
//   barrier A (P in shared memory)
//   phase 2   role 0: dV[:, 0:64] += Pᵀ dO    A: its Pᵀ registers rounded
//                                              to E per k-step (the same
//                                              values it stored),
//                                              B: ldmatrix.x4.trans on dO
//             role 1, per 16-query k-step: Pᵀ's A fragments by ldmatrix.x4
//             from shared memory, dV[:, 64:128] += Pᵀ dO; then, in the same
//             registers, dSᵀ = P̃ᵀ ∘ (dPᵀ − D[q]) (P̃: the rounded P, as in
//             the d 64 kernels) rounded to E, written over Pᵀ in shared
//             memory (the warp's own rows: no other warp reads them until
//             barrier B), and dK[:, 64:128] += dSᵀ Q (B: ldmatrix.x4.trans
//             on dO / Q rows)
//   barrier B (dS in shared memory)
//   phase 3   role 0: dK[:, 0:64] += dSᵀ Q   A: ldmatrix.x4 on dSᵀ
//             role 1, atomic mode only: dQ (64 queries x 32 columns
//             32wk..32wk+31) = dS K over the 128 keys, A: ldmatrix.x4.trans
//             on dSᵀ (4 per key step), B: ldmatrix.x4.trans on K (2), each
//             A fragment feeding 4 mma and each B fragment 8; added with one
//             red.global.add.v2.f32 per pair of adjacent columns on sm_90
//             (ta_red_add_v2_f32; two scalar reds on sm_80).
//
// Warps w and w + 4 share an SM sub-partition (the usual warp-to-SMSP
// mapping w % 4), so each sub-partition runs one warp of each role; the
// phases keep both busy except role 0 during role 1's second half of phase
// 2 and (deterministic mode) role 1 during phase 3.
//
// Counted per warp and 64-row query tile from the code: role 0: Sᵀ 8 x (2 +
// 4) = 48 LDSM / 128 HMMA, dV 16 / 64, dK 8 + 16 / 64: 88 / 256; role 1: dPᵀ
// 48 / 128, Pᵀ 8, dV 16 / 64, dK 16 / 64: 88 / 256, atomic dQ 8 x (4 + 2) =
// 48 / 128 more. Per block and tile (64 queries x 128 keys): det 704 LDSM /
// 2,048 HMMA = 2.91, atomic 896 / 2,560 = 2.86 (the one-m-tile d 128 kernel:
// 1.89 / 1.79 by the same count). FA2's split (every warp 32 x 32 of Sᵀ and
// dPᵀ, 32 keys x 64 of dK, dV, 32 x 32 of dQ) counts 112 / 256 = 2.29 and
// 144 / 320 = 2.22. The price of the role split: while role 1 finishes
// phase 2 (its second 64 HMMA) and, in deterministic mode, while role 0
// runs phase 3, one warp per sub-partition issues alone (about a quarter
// of the HMMA, det; a fifth, atomic), with less latency hiding than FA2's
// lockstep warps; and 4 barriers per query tile (tile landed, A, B,
// buffers free) where the d 64 two-m-tile kernel has 3 (atomic) / 2 (det).
//
// dQ atomics: 64 x D f32 per 64 x 128 tile pair = D · 4 / 128 = 4 bytes per
// visible (query, key) pair and head, in 0.5 red.global.add.v2.f32 per pair
// on sm_90 (1 scalar on sm_80); the one-m-tile kernel (64-key tiles): 8
// bytes, 1 v2 (2 scalar) per pair.
//
// Registers: dK, dV 128, Sᵀ / Pᵀ or dPᵀ (f32, the same 64 registers: both
// roles run one code path in phase 1 and the barriers sit outside the role
// branches, so whatever a role keeps across a barrier is live for the
// other too; Pᵀ packed to 16 bits across barrier A would add 32), then one
// k-step's P, dS fragments; dQ's accumulator (64 x 32 f32: 64) only after
// dPᵀ is consumed. K / V A fragments are reloaded per k-step (holding
// them, 64 more registers, does not fit).
//
// Shared memory 159,232 bytes (Bwd2SplitTraits): K, V 69,632 | Q, dO x 2
// 69,632 | P / dS 18,432 | lse2, D 1,024 | kv_end 512: one block (8 warps)
// per SM on A100 and H100 / H200, as FA2's hdim-128 backward.
//
// kFault is a test-only knob, instantiated for the emulator only (negative
// controls, tests/it/emu_bwd.rs): 1 drops barrier B (dS before the dK and
// dQ products that read it from shared memory), 2 swaps the two key
// m-tiles' K fragments in Sᵀ, 3 drops barrier A (P before role 1 reads it).
//
// kVar: the variant kernels (tree_attn_bwd_main2_var_*_d128): key starts
// (the query-tile walk also skips tiles whose rows' windows all start after
// the block's last key; the element mask tests k >= key_start[q]; full
// tiles need k0 >= the tile's largest start) and the blind rows of sinks.
// No softcap: role 1 reads P from shared memory both for its half of dV
// (P) and for dS (which needs P ∘ (1 − tanh²)), so a softcap would need a
// second 18,432-byte P region (177,664 bytes: over A100's 166,912 per
// block) or recomputing S in role 1; a call with a softcap at d 128 runs
// the one-m-tile variant kernel instead (the launch plan's choice,
// `backend::launch::bwd`).
#pragma once

template <class Tr, bool kAtomicDq, int kFault = 0, bool kVar = false>
__device__ __forceinline__ void tree_attn_bwd_main2_d128_body(const TreeAttnBwdParams& p) {
    using E = typename Tr::Elem;
    constexpr int D = Tr::kHeadDim, BM = Tr::kBlockM, BN = Tr::kBlockN, RS = Tr::kRowStride;
    constexpr int PS = Tr::kDsStride;  // row stride of P / dS
    constexpr int DH = Tr::kHalfD;     // columns of dK, dV per warp
    constexpr int kDTiles = DH / 8;    // n-tiles of dK, dV per m-tile
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
    // (Its addresses are computed from ta_tid_fresh(): per call, not held
    // in registers across the loop, where ptxas spilled them.)
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

    // dK, dV of the warp's 32 keys x its DH columns: [m-tile][n-tile][4].
    float dk[2][kDTiles][4], dv[2][kDTiles][4];
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int n = 0; n < kDTiles; ++n)
#pragma unroll
            for (int i = 0; i < 4; ++i) dk[m][n][i] = dv[m][n][i] = 0.f;

    // Row of the warp's 16-key m-tile m that lane passes to ldmatrix (A
    // fragments of K, V, Pᵀ, dSᵀ), and the B fragments' row / column split.
    const int a_row = kr0 + ri + 8 * (mi & 1), a_col = 8 * (mi >> 1);
    const int col0 = int(role) * DH;  // the warp's first dK, dV column

    uint32_t head = head_begin, qt = next_visit(0);
    if (qt != 0xffffffffu) stage(head, qt, 0);
    ta_cp_async_commit();
    int buf = 0;
    while (qt != 0xffffffffu) {
        uint32_t nhead = head, nqt = next_visit((qt + 1) * BM);
        // (The first tile again for the next head: the walk from 0 rather
        // than a register held across the loop.)
        if (nqt == 0xffffffffu && ++nhead < head_end) nqt = next_visit(0);
        if (nqt != 0xffffffffu) stage(nhead, nqt, buf ^ 1);
        ta_cp_async_commit();
        ta_cp_async_wait<1>();  // tile (head, qt) has landed
        // Publishes the tile; one with a blind row zeroes it, then again.
        const bool blind = lse2_in_place(qt, buf);
        if (__syncthreads_or(blind)) {
            if (blind) ta_zero_query_row<D, RS>(sq + buf * Tr::kQElems, sdo + buf * Tr::kQElems, threadIdx.x);
            __syncthreads();
        }

        const uint32_t q0 = qt * BM;
        const uint16_t* const qb = sq + buf * Tr::kQElems;
        const uint16_t* const dob = sdo + buf * Tr::kQElems;
        const float* const lse2 = slse + buf * BM;
        const float* const dlt = sdelta + buf * BM;

        // Phase 1: X = A Bᵀ for the warp's 32 keys x BM queries, Sᵀ = K Qᵀ
        // (role 0) or dPᵀ = V dOᵀ (role 1).
        float x[2][kQTiles][4];
        {
            const uint16_t* const arows = role == 0 ? sk : sv;
            const uint16_t* const brows = role == 0 ? qb : dob;
#pragma unroll
            for (int m = 0; m < 2; ++m)
#pragma unroll
                for (int n = 0; n < kQTiles; ++n)
#pragma unroll
                    for (int i = 0; i < 4; ++i) x[m][n][i] = 0.f;
#pragma unroll 1
            for (int kk = 0; kk < kKSteps; ++kk) {
                uint32_t a[2][4];
#pragma unroll
                for (int m = 0; m < 2; ++m) ta_ldmatrix_x4(a[m], arows + (a_row + m * 16) * RS + kk * 16 + a_col);
#pragma unroll
                for (int np = 0; np < BM / 16; ++np) {
                    uint32_t b[4];
                    ta_ldmatrix_x4(b, brows + (np * 16 + ri + 8 * (mi >> 1)) * RS + kk * 16 + 8 * (mi & 1));
#pragma unroll
                    for (int m = 0; m < 2; ++m) {
                        const int am = kFault == 2 && role == 0 ? 1 - m : m;
                        ta_mma_16816<E>(x[m][2 * np], a[am], b[0], b[1]);
                        ta_mma_16816<E>(x[m][2 * np + 1], a[am], b[2], b[3]);
                    }
                }
            }
        }

        if (role == 0) {
            // Pᵀ = exp2(Sᵀ·c − lse2[q]) (masked), kept in x (f32; rounded to
            // E where it becomes the A fragments of dV += Pᵀ dO) and stored
            // rounded to shared memory, [key][query].
            const bool full = TA_TILE_FULL(BN, k0, q0, q0 + BM, tile_min, L) && q0 + BM <= L &&
                              (!window || k0 >= p.start_tile_max[q0 / kTaStartTile]);
#pragma unroll
            for (int m = 0; m < 2; ++m)
#pragma unroll
                for (int n = 0; n < kQTiles; ++n) {
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const int ql = n * 8 + 2 * c + (i & 1);
                        const int kl = kr0 + m * 16 + g + 8 * (i >> 1);
                        float pv = ta_exp2(x[m][n][i] * p.scale_log2 - lse2[ql]);
                        if (!full && (!TA_VISIBLE(k0 + kl, skv[kl], q0 + ql) ||
                                      (window && k0 + kl < sstart[buf * BM + ql])))
                            pv = 0.f;
                        x[m][n][i] = pv;
                    }
#pragma unroll
                    for (int r = 0; r < 2; ++r)
                        *reinterpret_cast<uint32_t*>(sp + (kr0 + m * 16 + g + 8 * r) * PS + n * 8 + 2 * c) =
                            ta_pack2<E>(x[m][n][2 * r], x[m][n][2 * r + 1]);
                }
        }
        // (The barriers sit where every thread of the block reaches them:
        // the role branches close before each one.)
        if (kFault != 3) __syncthreads();  // barrier A: P in shared memory

        if (role == 0) {
            // Phase 2: dV[:, 0:DH] += Pᵀ dO, A fragments packed from x (the
            // C fragments of n-tiles 2kq, 2kq + 1 are the A fragment of
            // k-step kq).
#pragma unroll
            for (int kq = 0; kq < kQSteps; ++kq) {
                uint32_t pa[2][4];
#pragma unroll
                for (int m = 0; m < 2; ++m)
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        const int n = 2 * kq + (j >> 1), i0 = 2 * (j & 1);
                        pa[m][j] = ta_pack2<E>(x[m][n][i0], x[m][n][i0 + 1]);
                    }
#pragma unroll
                for (int dpi = 0; dpi < DH / 16; ++dpi) {
                    uint32_t b[4];
                    ta_ldmatrix_x4_trans(b, dob + (kq * 16 + ri + 8 * (mi & 1)) * RS + col0 + dpi * 16 + 8 * (mi >> 1));
#pragma unroll
                    for (int m = 0; m < 2; ++m) {
                        ta_mma_16816<E>(dv[m][2 * dpi], pa[m], b[0], b[1]);
                        ta_mma_16816<E>(dv[m][2 * dpi + 1], pa[m], b[2], b[3]);
                    }
                }
            }
        } else {
            // Phase 2, per 16-query k-step: Pᵀ's A fragments from shared
            // memory, dV[:, DH:D] += Pᵀ dO; then dSᵀ = P̃ᵀ ∘ (dPᵀ − D[q])
            // rounded to E (A fragments), written over Pᵀ (this warp's rows
            // only), and dK[:, DH:D] += dSᵀ Q. (In this order the P and dS
            // fragments are not live together: 8 registers less at the
            // kernel's peak.)
#pragma unroll
            for (int kq = 0; kq < kQSteps; ++kq) {
                uint32_t pf[2][4];
#pragma unroll
                for (int m = 0; m < 2; ++m) ta_ldmatrix_x4(pf[m], sp + (a_row + m * 16) * PS + kq * 16 + a_col);
#pragma unroll
                for (int dpi = 0; dpi < DH / 16; ++dpi) {
                    uint32_t b[4];
                    ta_ldmatrix_x4_trans(b, dob + (kq * 16 + ri + 8 * (mi & 1)) * RS + col0 + dpi * 16 + 8 * (mi >> 1));
#pragma unroll
                    for (int m = 0; m < 2; ++m) {
                        ta_mma_16816<E>(dv[m][2 * dpi], pf[m], b[0], b[1]);
                        ta_mma_16816<E>(dv[m][2 * dpi + 1], pf[m], b[2], b[3]);
                    }
                }
#pragma unroll
                for (int m = 0; m < 2; ++m)
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        const int n = 2 * kq + (j >> 1), i0 = 2 * (j & 1);
                        const int ql = n * 8 + 2 * c;
                        const float p0 = ta_to_f32<E>(uint16_t(pf[m][j] & 0xffffu));
                        const float p1 = ta_to_f32<E>(uint16_t(pf[m][j] >> 16));
                        pf[m][j] = ta_pack2<E>(p0 * (x[m][n][i0] - dlt[ql]), p1 * (x[m][n][i0 + 1] - dlt[ql + 1]));
                    }
                // pf now holds dSᵀ. The warp's ldmatrix above has read the
                // words it overwrites (one warp-wide instruction: every
                // lane's values are in registers); the __syncwarp makes that
                // order explicit (memory ordering among the warp's lanes,
                // and converged lanes under independent thread scheduling)
                // before any lane stores over a word another lane read.
                __syncwarp();
#pragma unroll
                for (int m = 0; m < 2; ++m)
#pragma unroll
                    for (int j = 0; j < 4; ++j)
                        *reinterpret_cast<uint32_t*>(sp + (kr0 + m * 16 + g + 8 * (j & 1)) * PS + kq * 16 +
                                                     8 * (j >> 1) + 2 * c) = pf[m][j];
#pragma unroll
                for (int dpi = 0; dpi < DH / 16; ++dpi) {
                    uint32_t b[4];
                    ta_ldmatrix_x4_trans(b, qb + (kq * 16 + ri + 8 * (mi & 1)) * RS + col0 + dpi * 16 + 8 * (mi >> 1));
#pragma unroll
                    for (int m = 0; m < 2; ++m) {
                        ta_mma_16816<E>(dk[m][2 * dpi], pf[m], b[0], b[1]);
                        ta_mma_16816<E>(dk[m][2 * dpi + 1], pf[m], b[2], b[3]);
                    }
                }
            }
        }
        if (kFault != 1) __syncthreads();  // barrier B: dS in shared memory

        if (role == 0) {
            // Phase 3: dK[:, 0:DH] += dSᵀ Q, A by ldmatrix on dSᵀ.
#pragma unroll 1
            for (int kq = 0; kq < kQSteps; ++kq) {
                uint32_t da[2][4];
#pragma unroll
                for (int m = 0; m < 2; ++m) ta_ldmatrix_x4(da[m], sp + (a_row + m * 16) * PS + kq * 16 + a_col);
#pragma unroll
                for (int dpi = 0; dpi < DH / 16; ++dpi) {
                    uint32_t b[4];
                    ta_ldmatrix_x4_trans(b, qb + (kq * 16 + ri + 8 * (mi & 1)) * RS + col0 + dpi * 16 + 8 * (mi >> 1));
#pragma unroll
                    for (int m = 0; m < 2; ++m) {
                        ta_mma_16816<E>(dk[m][2 * dpi], da[m], b[0], b[1]);
                        ta_mma_16816<E>(dk[m][2 * dpi + 1], da[m], b[2], b[3]);
                    }
                }
            }
        } else if (kAtomicDq) {
            // Phase 3: dQ (BM x 32 columns 32wk..) = dS K over the BN keys;
            const int dq_col0 = int(wk) * 32;
            // A (4 m-tiles of queries) by ldmatrix.x4.trans on dSᵀ, B (2 x 16
            // columns) by ldmatrix.x4.trans on K.
            float acc[BM / 16][4][4];
#pragma unroll
            for (int j = 0; j < BM / 16; ++j)
#pragma unroll
                for (int n = 0; n < 4; ++n)
#pragma unroll
                    for (int i = 0; i < 4; ++i) acc[j][n][i] = 0.f;
#pragma unroll 1
            for (int kk = 0; kk < BN / 16; ++kk) {
                uint32_t b[2][4];
#pragma unroll
                for (int dpi = 0; dpi < 2; ++dpi)
                    ta_ldmatrix_x4_trans(b[dpi], sk + (kk * 16 + ri + 8 * (mi & 1)) * RS + dq_col0 + dpi * 16 +
                                                     8 * (mi >> 1));
#pragma unroll
                for (int j = 0; j < BM / 16; ++j) {
                    uint32_t a[4];
                    ta_ldmatrix_x4_trans(a, sp + (kk * 16 + 8 * (mi >> 1) + ri) * PS + j * 16 + 8 * (mi & 1));
#pragma unroll
                    for (int dpi = 0; dpi < 2; ++dpi) {
                        ta_mma_16816<E>(acc[j][2 * dpi], a, b[dpi][0], b[dpi][1]);
                        ta_mma_16816<E>(acc[j][2 * dpi + 1], a, b[dpi][2], b[dpi][3]);
                    }
                }
            }
            // One red.global.add.v2.f32 per pair of adjacent columns on sm_90
            // (ta_red_add_v2_f32; two scalar reds before).
#pragma unroll
            for (int j = 0; j < BM / 16; ++j)
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const uint32_t row = q0 + j * 16 + g + 8 * r;
                    if (row >= L) continue;
                    float* const out = p.dq_accum + ((size_t)row * p.q_heads + head) * D + dq_col0 + 2 * c;
#pragma unroll
                    for (int n = 0; n < 4; ++n)
                        ta_red_add_v2_f32(out + n * 8, acc[j][n][2 * r] * p.scale, acc[j][n][2 * r + 1] * p.scale);
                }
        }
        __syncthreads();  // buffer `buf`, P / dS free before they are refilled
        head = nhead;
        qt = nqt;
        buf ^= 1;
    }

    static_assert(BN == kTaBalancedKeys, "a balanced launch's region is one key tile");
    const uint32_t region = p.items ? p.items[(size_t)blockIdx.x * 8 + 5] : kTaNoRegion;
    if (p.items ? region != kTaNoRegion : p.group_splits > 1) {
        // This slice's (item's) f32 partial dK (scaled) and dV, summed by
        // tree_attn_bwd_dkv_convert: slot `split` of [splits, 2, L,
        // kv_heads, D], or the item's region, [2, BN, D] for keys k0...
        const size_t half = p.items ? (size_t)BN * D : (size_t)L * p.kv_heads * D;
        const size_t row_stride = p.items ? (size_t)D : (size_t)p.kv_heads * D;
        float* const pk = p.dkv_accum + (size_t)(p.items ? region : split) * 2 * half +
                          (p.items ? 0 : (size_t)kv_head * D);
        float* const pv = pk + half;
        const uint32_t row0 = p.items ? k0 : 0u;
#pragma unroll
        for (int m = 0; m < 2; ++m)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const uint32_t key = k0 + kr0 + m * 16 + g + 8 * r;
                if (key >= L) continue;
                const size_t at = (size_t)(key - row0) * row_stride + col0;
#pragma unroll
                for (int n = 0; n < kDTiles; ++n) {
                    const size_t e = at + n * 8 + 2 * c;
                    pv[e] = dv[m][n][2 * r];
                    pv[e + 1] = dv[m][n][2 * r + 1];
                    pk[e] = dk[m][n][2 * r] * p.scale;
                    pk[e + 1] = dk[m][n][2 * r + 1] * p.scale;
                }
            }
        return;
    }
    // dV, dK (scaled) through the K, V tile buffers (free after the loop's
    // last barrier), then 16-byte stores, rows past the pack never stored.
    uint16_t* const sdk = sk;
    uint16_t* const sdv = sv;
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = kr0 + m * 16 + g + 8 * r;
#pragma unroll
            for (int n = 0; n < kDTiles; ++n) {
                const int col = col0 + n * 8 + 2 * c;
                *reinterpret_cast<uint32_t*>(sdv + row * RS + col) = ta_pack2<E>(dv[m][n][2 * r], dv[m][n][2 * r + 1]);
                *reinterpret_cast<uint32_t*>(sdk + row * RS + col) =
                    ta_pack2<E>(dk[m][n][2 * r] * p.scale, dk[m][n][2 * r + 1] * p.scale);
            }
        }
    __syncthreads();
    constexpr int kChunks = D / 8;
#pragma unroll
    for (int it = 0; it < BN * kChunks / Tr::kThreads; ++it) {
        const int i = it * Tr::kThreads + threadIdx.x;
        const int r = i / kChunks, ch = i % kChunks;
        if (k0 + r >= L) continue;
        const size_t at = ((size_t)(k0 + r) * p.kv_heads + kv_head) * D + ch * 8;
        *reinterpret_cast<ta_vec16*>(p.dk + at) = *reinterpret_cast<const ta_vec16*>(sdk + r * RS + ch * 8);
        *reinterpret_cast<ta_vec16*>(p.dv + at) = *reinterpret_cast<const ta_vec16*>(sdv + r * RS + ch * 8);
    }
}
