// Tree-attention backward: FlashAttention-2 backward on a pack with the
// interval mask of DESIGN §4 (query q sees key k iff k <= q < kv_end[k]).
// Per query head h (kv head h / group), with P recomputed from the saved LSE:
//
//   P  = exp(scale · Q Kᵀ − LSE) (masked),   D = rowsum(dO ∘ O)
//   dP = dO Vᵀ,   dS = P ∘ (dP − D)
//   dQ = scale · dS K,   dK = scale · dSᵀ Q,   dV = Pᵀ dO
//
// dK and dV of a kv head sum over the `group` query heads that read it: the
// main kernel loops over those heads inside the block (no reduction buffer,
// deterministic). When key tiles · kv_heads blocks are too few to fill the
// GPU, the launch plan splits the group over grid.z (group splits, the rule
// is `backend::launch::bwd::group_splits`): z-slice s loops over query heads
// s · group / splits .. (s + 1) · group / splits only and stores its f32
// partial dK (scaled) and dV into p.dkv_accum [splits, 2, tokens, kv_heads,
// D]; tree_attn_bwd_dkv_convert then sums the slices in index order (no
// atomics: bit-identical from run to run) into dK, dV. One split: the main
// kernel writes dK, dV itself and dkv_accum is null. A row with no visible key (LSE = −inf) gets P = 0, so dS = 0
// and it adds nothing; rows and keys past the pack and padding keys
// (kv_end[k] == k) likewise.
//
// Layout: Q, O, dO, dQ: [tokens, q_heads, D]; K, V, dK, dV: [tokens, kv_heads,
// D], 16-bit elements; LSE, D: [q_heads, tokens] f32; the dQ accumulator:
// [tokens, q_heads, D] f32. Natural-log LSE is turned into base 2 once per
// row (lse2 = LSE · log2 e, +inf for a row with none), so P = exp2(S·c −
// lse2) with c = scale · log2 e, exactly as the forward computes it.
//
// Kernels (one call runs 3 to 5 of them, in this order):
//   tree_attn_bwd_pre   D = rowsum(dO ∘ O) per (row, head), f32; zeroes the
//                       dQ accumulator rows in atomic mode. One warp per
//                       (row, head).
//   tree_attn_bwd_main  dK, dV (and, in atomic mode, dQ through f32
//                       atomic adds into the accumulator; main2: the
//                       two-m-tile variants of 8 warps, the default for
//                       both head dims, d 64 in
//                       tree_attn_bwd_main2_roles.cuh, d 128 in
//                       tree_attn_bwd_main2_d128.cuh; main2w4: the 4-warp
//                       d 64 two-m-tile kernel below). One block per (key
//                       tile, kv head, group split): grid (key tiles,
//                       kv_heads, group splits).
//   tree_attn_bwd_dq    deterministic mode only: dQ per (query tile, query
//                       head), plain f32 stores into the accumulator.
//   tree_attn_bwd_dq_convert   accumulator → dQ in the element type.
//   tree_attn_bwd_dkv_convert  group splits > 1 only: Σ over the splits of
//                       the f32 partials → dK, dV in the element type. One
//                       warp per (key row, kv head).
//
// Main kernel tiling (BwdTraits, kernel_traits.cuh): a key tile of kBlockN =
// 64 keys, 4 warps, warp w owns keys 16w..16w+15 and holds their dK and dV
// (16 x D each, f32, mma C fragments) for the whole block. K and V of the tile stay in shared
// memory; query tiles of kBlockM rows (64 for D = 64, 32 for D = 128, to keep
// the f32 accumulators plus Sᵀ and dPᵀ under 255 registers) stream through a
// double-buffered pipeline: Q and dO by cp.async, and LSE and D (BM floats
// each, double-buffered beside them) by 4-byte cp.async in the same group
// (their rows start at head · tokens + q0 of [q_heads, tokens], 16-byte
// aligned only when tokens % 4 == 0); the thread that copied a row's LSE
// turns it into lse2 after its own wait, before the tile's barrier. The
// tile's kv_end joins the K / V group the same way. Per query tile:
//   Sᵀ  (16 x BM per warp) = K Qᵀ   A: ldmatrix.x4 on the warp's K rows
//                                    (D = 64: loaded once per block and held
//                                    in registers, 16 per operand, instead of
//                                    once per query tile);
//                                    B: ldmatrix.x4 on Q rows (Q row-major is
//                                    Qᵀ column-major)
//   dPᵀ (16 x BM)          = V dOᵀ  same, with V and dO
//   Pᵀ = exp2(Sᵀ·c − lse2[q]),  dSᵀ = Pᵀ ∘ (dPᵀ − D[q])  (in registers)
//   dV (16 x D) += Pᵀ dO   A: Pᵀ's C fragments rounded to 16 bits are its A
//                          fragments (two n-tiles = one k-step);
//                          B: ldmatrix.x4.trans on dO rows
//   dK (16 x D) += dSᵀ Q   same, with dSᵀ and Q
//   atomic mode: dSᵀ goes to shared memory ([key][query], 16-bit); then
//   dQ (BM x D) = dS K     A: ldmatrix.x4.trans on dSᵀ (its transpose is dS);
//                          B: ldmatrix.x4.trans on K rows; the warps split
//                          BM x D into 16-row x (D / warps-per-row) pieces,
//                          computed 16 columns at a time and added to the
//                          f32 accumulator, one red.global.add.v2.f32 per
//                          two adjacent columns on sm_90 (two scalar
//                          atomic adds on sm_80).
//
// 4-warp two-m-tile main kernel (tree_attn_bwd_main2w4_{atomic,det}_*_d64,
// Bwd2Traits; Rust `MainKernel::TwoMTilesFourWarps`, the d 64 default until
// the 8-warp kernel of tree_attn_bwd_main2_roles.cuh replaced it (3.56 /
// 3.08 HMMA per LDSM against this kernel's 2.67 / 2.50, counted below);
// it stays selectable, as the one-m-tile kernel above
// (`MainKernel::OneMTile`), until a GPU has timed them. The D = 128
// two-m-tile kernel: 8 warps with the dK, dV accumulators split over the
// head dim, tree_attn_bwd_main2_d128.cuh). Why: with one 16-key m-tile per warp every Q / dO
// B fragment feeds 2 mma, so the loop above does 1.6–2.0 HMMA per LDSM.
// Here a block owns BN = 128 keys (two kv_end bounds tiles), warp w keys
// 32w..32w+31 as two m-tiles, and every B fragment (Q, dO; ldmatrix or
// ldmatrix.trans) feeds 4 mma. Per staged 64-row query tile each warp runs
// two sub-tiles of 32 queries (no barrier between them):
//   Sᵀ  (32 x 32) = K Qᵀ     A: ldmatrix.x4 on the warp's K rows (2 per
//                             k-step, reloaded per sub-tile), B: Q rows
//   Pᵀ = exp2(Sᵀ·c − lse2) (masked), rounded to E into the A fragments of
//        the dV product at once (16 registers instead of 32 f32)
//   dPᵀ (32 x 32) = V dOᵀ    the same with V, dO
//   dSᵀ = P̃ᵀ ∘ (dPᵀ − D) with P̃ the rounded Pᵀ (FlashAttention-2 keeps P in
//        f32 for dS: one more rounding, 2^-9 (bf16) relative per element;
//        the emulator errors are unchanged, tests/it/emu_bwd.rs)
//   dV (32 x D) += Pᵀ dO, dK += dSᵀ Q   A from registers, B by
//        ldmatrix.x4.trans on dO / Q rows
//   kv_end of the block's keys joins the K / V cp.async group, and each
//   query tile's LSE and D rows join its Q / dO group (4-byte cp.async,
//   ta_cp_async_4: no plain loads in front of the barrier; the thread that
//   copied a row's LSE turns it into lse2 in place after its own wait, so
//   the barrier that publishes the tile publishes lse2 too);
//   atomic mode: dSᵀ -> shared memory; after both sub-tiles and a barrier,
//   dQ (64 x D) = dS K with warps as 2 x 2 tiles of 32 rows x 32 columns
//   (A: ldmatrix.x4.trans on dSᵀ, B: ldmatrix.x4.trans on K, each feeding
//   4 mma), added with one red.global.add.v2.f32 per pair of adjacent
//   columns on sm_90 (ta_red_add_v2_f32; two scalar reds on sm_80).
// Counted per warp and 64-row query tile from the code: det 2 x (16 + 16 +
// 8 + 8) = 96 LDSM for 256 HMMA = 2.67; atomic + dQ's 32 LDSM / 64 HMMA =
// 128 / 320 = 2.50 (the one-m-tile kernel: 64 / 128 = 2.00 and 84 / 160 =
// 1.90 per 64 x 64 tile). dQ atomics: 64 x D f32 per 64 x 128 tile pair =
// D · 4 / 128 = 2 bytes per visible (query, key) pair and head for d 64,
// in 0.25 REDG.F32x2 per pair (sm_90; 0.5 scalar on sm_80), against 4
// bytes in 1 scalar RED per pair before (d 128, unchanged: 8 bytes, 2).
// The register / staging trade-off (ptxas, CUDA 13.0, sm_80 / sm_90a):
//   dK, dV of 32 keys x 64 in f32 take 2 · 2 · 8 · 4 · 2 = 128 registers,
//   Sᵀ + dPᵀ of a 32-query sub-tile 64 more; what is left decides the rest:
//   - chosen: K / V A fragments reloaded per sub-tile, Pᵀ packed before
//     dPᵀ: 240–245 / 237–240 registers, 0 spills (242–243 / 227–232
//     before kv_end, LSE and D moved to cp.async);
//   - the same with Pᵀ kept in f32 until dSᵀ (as FA2): 255 / 244–246, and
//     the sm_80 atomic kernel spills 8 bytes;
//   - K's A fragments hoisted for the whole block (+32 registers; code
//     count 3.20 det, 2.86 atomic): 255 and 8–88 bytes of spills, with or
//     without the early packing;
//   - K hoisted, 16-query sub-tiles: 0 spills at 238–254, but the same
//     2.67 / 2.50 per query tile as the choice (A reloaded per k-step of
//     every sub-tile: 4 sub-tiles instead of 2), more loop overhead.
//   Shared memory 93,696 bytes (K, V 36,864 | Q, dO x 2 36,864 | dSᵀ
//   18,432 | lse2, D 1,024 | kv_end 512): 1 block per SM on A100 (164 KB),
//   2 on H100 / H200 (227 KB); registers allow 2 either way.
//   D = 128 would need 256 registers for dK, dV alone in this layout: its
//   two-m-tile kernel splits them over the head dim across 8 warps, with P
//   and dS staged in shared memory (tree_attn_bwd_main2_d128.cuh). The d 64
//   default now does the same with 8 warps split by product (one warp of a
//   pair holds dV and K's A fragments, the other dK and V's: 64 + 32
//   registers each instead of 128 + 0), which is what frees the registers
//   to hold the A fragments (tree_attn_bwd_main2_roles.cuh).
// Fragment layouts (PTX ISA, mma.m16n8k16; g = lane/4, c = lane%4):
//   A 16x16: a[r] half h = A[g + 8(r&1)][2c + h + 8(r>>1)]
//   B 16x8:  b[r] half h = B[2c + h + 8r][g]
//   C 16x8:  acc[i]      = C[g + 8(i>>1)][2c + (i&1)]
// so a thread holds keys g and g+8 of its warp's 16 and, per n-tile, the
// query columns 2c, 2c+1.
//
// Which query tiles. Key k is seen by the queries [k, kv_end[k]); the block
// visits exactly the query tiles that meet the union of those intervals over
// its 64 keys (a subset of the contiguous range [k0, max kv_end)): from a
// query x the next visible query is min over keys with kv_end[k] > max(k, x)
// of max(k, x), read off the tile's kv_end staged in shared memory: each
// lane tests 2 of the 64 keys and a warp min by __shfl_xor_sync gives every
// lane the same result (2 compares + 5 shuffles per step instead of 64
// compares). Each visited tile is
// full (no element mask: k1 − 1 <= q0, min kv_end >= q1, both tiles inside
// the pack) or partial (element mask k <= q < kv_end[k]); both tests are
// mask.cuh's. Tiles are staged by tile_load.cuh's loader.
//
// Stores. The main kernel's unsplit epilogue rounds dK (scaled) and dV to
// the element type into shared memory (the K and V tile buffers, free after
// the loop) and writes them with 16-byte stores, consecutive threads on
// consecutive 16-byte chunks of a row; dq_convert and dkv_convert give each
// lane 8 elements (one 16-byte store). Rows past the pack are never stored;
// dQ, dK, dV must be 16-byte aligned (both backends check it). The split
// path's f32 partials are plain 4-byte stores from the fragments.
//
// Block order: the main kernel's blockIdx.x is the key tile (the first key
// tiles are seen by the most queries: heaviest first); the dQ kernel runs
// its query tiles last-first (the last ones see the most keys), as the
// forward does.
//
// Deterministic mode. The main kernel skips its dQ part, and tree_attn_bwd_dq
// (one block of 4 warps per 64 query rows and query head, the forward's
// tiling and tile walk) recomputes, per visible key tile, S = Q Kᵀ, P, dP =
// dO Vᵀ and dS, then dQ += dS K in registers (B: ldmatrix.x4.trans on K);
// its rows' LSE and D arrive by 4-byte cp.async with Q and dO. Per
// visible (query tile, key tile) pair atomic mode does 5 tile matmuls (S, dP,
// dV, dK, dQ), deterministic mode 4 + 3 = 7: 1.4x the matmul FLOPs and twice
// the exp2 work, but no atomics and a bit-identical dQ from run to run. (The
// dQ kernel walks key tiles by the forward's min / max rule, which can keep a
// few tile pairs the main kernel's exact interval walk drops: padding runs.)
// Its P is rounded to the element type as soon as it is formed (16
// registers instead of 32 while dP is computed) and dS = P̃ ∘ (dP − D) uses
// the rounded P̃, as in the two-m-tile main kernel: that keeps the d 64
// kernel at its 128-register bound with the ballot tile walk (issue 26).
// Its walk has the forward's one-tile look-ahead (issue 39): the next 32
// tiles' tile_kv_max / tile_kv_min land by cp.async with each K / V tile
// (a 64-word window per buffer), so the next tile and its unseen-key bound
// are read from shared memory once the current tile has landed (wait_group
// 0, then the barrier, then the next tile's copies, then the compute).
//
// Rotary is not these kernels' concern: with rotary on, the backends rotate Q
// and K once into scratch buffers (kernels/rope.cu), run these kernels on
// them, and rotate the dQ and dK they write back (the transpose rotation).
//
// Attention variants (the *_var_* kernels: the same bodies with kVar, and
// tree_attn_bwd_dsinks): the query rows' key starts (mask.cuh) travel with
// each query tile into shared memory (kSmemBytesVar); the main kernels'
// query-tile walk also skips tiles whose rows' windows all start after the
// key block (ta_next_window_qtile), the dQ kernel's key walk begins at the
// tile of the smallest start; a softcap recomputes c · tanh(scale · s / c)
// and scales dS by 1 − tanh² (ta_bwd_var_p; dQ, dK keep the factor
// `scale`); with sinks P = exp(s − LSE) is unchanged (the LSE holds the
// sink) and dsinks_h = −Σ_q exp(σ_h − LSE_q) D_q is one block per head in
// a fixed summation order (deterministic). The d 128 two-m-tile variant
// kernel has no softcap (tree_attn_bwd_main2_d128.cuh says why): the
// launch plan runs the one-m-tile one then.
#include "kernel_traits.cuh"
#include "mask.cuh"
#include "tile_load.cuh"

// Arguments of every backward kernel (one struct by value). Mirrored by
// `crate::backend::launch::bwd::BwdParams` in Rust; both sides assert the
// layout.
struct TreeAttnBwdParams {
    const uint16_t* q;
    const uint16_t* k;
    const uint16_t* v;
    const uint16_t* o;
    const uint16_t* d_o;
    const float* lse;   // [q_heads, tokens], natural log
    float* delta;       // [q_heads, tokens]
    float* dq_accum;    // [tokens, q_heads, D]
    uint16_t* dq;
    uint16_t* dk;
    uint16_t* dv;
    const uint32_t* kv_end;       // [tokens]
    const uint32_t* tile_kv_min;  // [num_key_tiles], tiles of 64 keys
    const uint32_t* tile_kv_max;
    float* dkv_accum;  // [group_splits, 2, tokens, kv_heads, D] f32 (dK scaled, dV); group_splits > 1 only
    uint32_t tokens;
    uint32_t q_heads;
    uint32_t kv_heads;
    uint32_t num_key_tiles;
    float scale;       // softmax scale
    float scale_log2;  // softmax scale · log2 e
    uint32_t head_dim;
    uint32_t zero_dq_accum;  // tree_attn_bwd_pre: also zero the accumulator
    uint32_t group_splits;   // the main kernel's gridDim.z; it divides q_heads / kv_heads
    // Slots of dkv_accum summed by tree_attn_bwd_dkv_convert (0: group_splits).
    // The balanced launch (items non-null): its regions (see tile_regions).
    uint32_t dkv_slots;
    // The attention variants (the *_var_* kernels, tree_attn_bwd_pre and
    // tree_attn_bwd_dsinks; null / 0 otherwise): per-row key starts and
    // their per-64-row bounds (mask.cuh), sinks [q_heads] and their
    // gradient dsinks [q_heads] (element type), the softcap c and 2 · scale
    // / c · log2 e (ta_softcap_r; 0: none). With a softcap, scale_log2 is
    // log2 e (the capped scores are already scaled) and scale stays the
    // softmax scale (dQ, dK carry it: ∂(c·tanh(scale·x/c))/∂x = scale ·
    // (1 − tanh²)).
    const uint32_t* key_start;       // [tokens] or null
    const uint32_t* start_tile_min;  // [ceil(tokens / 64)]
    const uint32_t* start_tile_max;
    const uint16_t* sinks;  // [q_heads] or null
    uint16_t* dsinks;       // [q_heads] or null
    float softcap_c;
    float softcap_in;
    // The balanced main launch (issue 39 item 1; the 8-warp two-m-tile
    // kernels, D = 64 and 128, only; null otherwise): per block (blockIdx.x)
    // 8 words {key tile, kv head, group split, first query tile, end query
    // tile, region, 0, 0}; the block walks only the query tiles in [first,
    // end). A key tile whose walk is cut into ranges (or, with group
    // splits, every one) gets one region of dkv_accum per (split, range):
    // a [2, kTaBalancedKeys, D] f32 tile, dK (scaled) then dV of its keys,
    // which the item writes whole; the others (region kTaNoRegion) store
    // dK, dV themselves, as today's grid does. Only cut key tiles take
    // scratch.
    const uint32_t* items;
    // The balanced launch: per (key tile, kv head) two words {first
    // region, regions}, the regions tree_attn_bwd_dkv_convert sums in
    // order into that tile's dK, dV (0 regions: stored by the main kernel,
    // not touched).
    const uint32_t* tile_regions;
};
static_assert(sizeof(TreeAttnBwdParams) == 224, "TreeAttnBwdParams: update its Rust mirror");
TA_FIELD_AT(TreeAttnBwdParams, q, 0); TA_FIELD_AT(TreeAttnBwdParams, k, 8); TA_FIELD_AT(TreeAttnBwdParams, v, 16);
TA_FIELD_AT(TreeAttnBwdParams, o, 24); TA_FIELD_AT(TreeAttnBwdParams, d_o, 32);
TA_FIELD_AT(TreeAttnBwdParams, lse, 40); TA_FIELD_AT(TreeAttnBwdParams, delta, 48);
TA_FIELD_AT(TreeAttnBwdParams, dq_accum, 56); TA_FIELD_AT(TreeAttnBwdParams, dq, 64);
TA_FIELD_AT(TreeAttnBwdParams, dk, 72); TA_FIELD_AT(TreeAttnBwdParams, dv, 80);
TA_FIELD_AT(TreeAttnBwdParams, kv_end, 88); TA_FIELD_AT(TreeAttnBwdParams, tile_kv_min, 96);
TA_FIELD_AT(TreeAttnBwdParams, tile_kv_max, 104); TA_FIELD_AT(TreeAttnBwdParams, dkv_accum, 112);
TA_FIELD_AT(TreeAttnBwdParams, tokens, 120); TA_FIELD_AT(TreeAttnBwdParams, q_heads, 124);
TA_FIELD_AT(TreeAttnBwdParams, kv_heads, 128); TA_FIELD_AT(TreeAttnBwdParams, num_key_tiles, 132);
TA_FIELD_AT(TreeAttnBwdParams, scale, 136); TA_FIELD_AT(TreeAttnBwdParams, scale_log2, 140);
TA_FIELD_AT(TreeAttnBwdParams, head_dim, 144); TA_FIELD_AT(TreeAttnBwdParams, zero_dq_accum, 148);
TA_FIELD_AT(TreeAttnBwdParams, group_splits, 152); TA_FIELD_AT(TreeAttnBwdParams, dkv_slots, 156);
TA_FIELD_AT(TreeAttnBwdParams, key_start, 160); TA_FIELD_AT(TreeAttnBwdParams, start_tile_min, 168);
TA_FIELD_AT(TreeAttnBwdParams, start_tile_max, 176); TA_FIELD_AT(TreeAttnBwdParams, sinks, 184);
TA_FIELD_AT(TreeAttnBwdParams, dsinks, 192); TA_FIELD_AT(TreeAttnBwdParams, softcap_c, 200);
TA_FIELD_AT(TreeAttnBwdParams, softcap_in, 204);
TA_FIELD_AT(TreeAttnBwdParams, items, 208); TA_FIELD_AT(TreeAttnBwdParams, tile_regions, 216);

// The balanced launch's key tile (the 8-warp two-m-tile kernels' BN) and
// the region of an item that stores dK, dV itself.
constexpr uint32_t kTaBalancedKeys = 128;
constexpr uint32_t kTaNoRegion = 0xffffffffu;

#define TA_LOG2E 1.4426950408889634f

// lse2 = LSE · log2 e, or +inf for a row with no visible key and for rows past
// the pack, so that exp2(S·c − lse2) is exactly 0 there. An invalid LSE (NaN
// or +inf: not from a forward) gives NaN, so that the row's gradients are NaN
// rather than a silent 0 (the emulator wrapper, and the CUDA one with
// check_finite, report it as an Err before the launch). `l` is the row's
// natural-log LSE, `in_pack` whether the row is inside the pack. (The main
// kernels write the same rule out in place.)
__device__ __forceinline__ float ta_bwd_lse2(float l, bool in_pack) {
    if (!in_pack || l == -INFINITY) return INFINITY;
    return l < INFINITY ? l * TA_LOG2E : NAN;
}

// The tile loader's skip (tile_load.cuh) for Q and dO rows: a query that sees
// no key (LSE = −inf) is loaded as zeros, so that what its rows hold never
// reaches dK or dV through 0 · NaN (DESIGN §5); `lse` is the head's row.
// The deterministic dQ kernel's one load of its query tile; the main
// kernels, which stage a query tile per step, zero such rows after the
// copy instead (ta_zero_query_row).
struct TaBlindQuery {
    const float* lse;
    __device__ __forceinline__ bool operator()(uint32_t row) const { return lse[row] == -INFINITY; }
};

// The variant kernels' blind-row test: with key starts (a window, explicit
// starts, sinks: then a blind row's LSE is its sink, not −inf) the host's
// mark TA_BLIND_ROW, else TaBlindQuery's.
struct TaBlindQueryVar {
    const float* lse;
    const uint32_t* key_start;
    __device__ __forceinline__ bool operator()(uint32_t row) const {
        return key_start != nullptr ? TA_BLIND_ROW(key_start, row) : lse[row] == -INFINITY;
    }
};

// The backward main kernels' blind rows (issue 39): a query row that sees
// no key is copied with its tile like any other — its copy no longer waits
// on a global load of its LSE (TaBlindQuery) before it can issue — and the
// thread that staged the row's LSE, knowing it blind after its own wait,
// zeroes the row's Q and dO in shared memory after the barrier that
// publishes the tile (__syncthreads_or tells every thread whether the tile
// has one; a second barrier follows only then, so a tile without blind rows
// — nearly all of them — costs one barrier as before). The result is the
// skip's: what a blind row holds never reaches dK or dV through 0 · NaN
// (DESIGN §5). `q`, `d_o`: the tile's buffers; `r` the row in the tile.
template <int D, int RS>
__device__ __forceinline__ void ta_zero_query_row(uint16_t* q, uint16_t* d_o, unsigned r) {
    const ta_vec16 z{0u, 0u, 0u, 0u};
#pragma unroll 1
    for (int c = 0; c < D; c += 8) {
        *reinterpret_cast<ta_vec16*>(q + r * RS + c) = z;
        *reinterpret_cast<ta_vec16*>(d_o + r * RS + c) = z;
    }
}

// The variants' score -> probability step of the backward, for one element
// of S (raw scores, the mma's q·k): P = exp2(s'·scale_log2 − lse2) with s'
// = s, or with a softcap s' = c · tanh(scale · s / c) (then scale_log2 =
// log2 e) and *fac = 1 − tanh² (the factor dS carries: dS = P ∘ (dP − D)
// ∘ fac); fac = 1 without. A macro-free inline: used only by the *_var_*
// kernels (the plain kernels keep their expression in place).
__device__ __forceinline__ float ta_bwd_var_p(const TreeAttnBwdParams& p, float s, float lse2, float* fac) {
    if (p.softcap_c > 0.f) {
        const float r = ta_softcap_r(s, p.softcap_in);
        s = p.softcap_c - 2.f * p.softcap_c * r;
        *fac = 4.f * r * (1.f - r);
    } else {
        *fac = 1.f;
    }
    return ta_exp2(s * p.scale_log2 - lse2);
}

// acc[n] = A Bᵀ for the warp: A is 16 rows of `a_rows` (row stride RS), B is
// the N rows of `b_rows`, both [row][D] 16-bit in shared memory; acc is 16 x N
// in C fragments (N / 8 n-tiles).
template <class E, int D, int N, int RS>
__device__ __forceinline__ void ta_bwd_mm_abt(float (&acc)[N / 8][4], const uint16_t* a_rows, const uint16_t* b_rows) {
    const unsigned lane = ta_lane(), mi = lane >> 3, ri = lane & 7;
#pragma unroll
    for (int n = 0; n < N / 8; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[n][i] = 0.f;
    // Not unrolled: kk indexes no register array, and a rolled loop keeps
    // ptxas from hoisting every k-step's fragments (register pressure).
#pragma unroll 1
    for (int kk = 0; kk < D / 16; ++kk) {
        uint32_t a[4];
        ta_ldmatrix_x4(a, a_rows + (ri + 8 * (mi & 1)) * RS + kk * 16 + 8 * (mi >> 1));
#pragma unroll
        for (int np = 0; np < N / 16; ++np) {
            uint32_t b[4];
            ta_ldmatrix_x4(b, b_rows + (np * 16 + ri + 8 * (mi >> 1)) * RS + kk * 16 + 8 * (mi & 1));
            ta_mma_16816<E>(acc[2 * np], a, b[0], b[1]);
            ta_mma_16816<E>(acc[2 * np + 1], a, b[2], b[3]);
        }
    }
}

// As ta_bwd_mm_abt, with the warp's A fragments (16 rows x D) already in
// registers: a[kk] is the ldmatrix.x4 of k-step kk.
template <class E, int D, int N, int RS>
__device__ __forceinline__ void ta_bwd_mm_abt_ra(float (&acc)[N / 8][4], const uint32_t (&a)[D / 16][4],
                                                 const uint16_t* b_rows) {
    const unsigned lane = ta_lane(), mi = lane >> 3, ri = lane & 7;
#pragma unroll
    for (int n = 0; n < N / 8; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[n][i] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
        for (int np = 0; np < N / 16; ++np) {
            uint32_t b[4];
            ta_ldmatrix_x4(b, b_rows + (np * 16 + ri + 8 * (mi >> 1)) * RS + kk * 16 + 8 * (mi & 1));
            ta_mma_16816<E>(acc[2 * np], a[kk], b[0], b[1]);
            ta_mma_16816<E>(acc[2 * np + 1], a[kk], b[2], b[3]);
        }
    }
}

// acc (16 x D) += X · B where X (16 x K) is given as C fragments x[K / 8][4]
// (rounded to E here: they become A fragments) and B is K rows [row][D] of
// 16-bit elements in shared memory (ldmatrix.trans).
template <class E, int D, int K, int RS>
__device__ __forceinline__ void ta_bwd_mm_cb(float (&acc)[D / 8][4], const float (&x)[K / 8][4],
                                             const uint16_t* b_rows) {
    const unsigned lane = ta_lane(), mi = lane >> 3, ri = lane & 7;
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) {
        const uint32_t a[4] = {
            ta_pack2<E>(x[2 * kk][0], x[2 * kk][1]),
            ta_pack2<E>(x[2 * kk][2], x[2 * kk][3]),
            ta_pack2<E>(x[2 * kk + 1][0], x[2 * kk + 1][1]),
            ta_pack2<E>(x[2 * kk + 1][2], x[2 * kk + 1][3]),
        };
#pragma unroll
        for (int dp = 0; dp < D / 16; ++dp) {
            uint32_t b[4];
            ta_ldmatrix_x4_trans(b, b_rows + (kk * 16 + ri + 8 * (mi & 1)) * RS + dp * 16 + 8 * (mi >> 1));
            ta_mma_16816<E>(acc[2 * dp], a, b[0], b[1]);
            ta_mma_16816<E>(acc[2 * dp + 1], a, b[2], b[3]);
        }
    }
}

// 8 floats -> 8 elements of E at `dst` (16-byte aligned), one 16-byte
// store (round to nearest even). nvcc (13.0) splits the store of a ta_vec16
// or a uint4 built from registers into 4 STG.32, so the store is written in
// PTX (st.global.v4: one STG.128).
template <class E>
__device__ __forceinline__ void ta_bwd_store8(uint16_t* dst, const float* x) {
    const uint32_t a = ta_pack2<E>(x[0], x[1]), b = ta_pack2<E>(x[2], x[3]);
    const uint32_t c = ta_pack2<E>(x[4], x[5]), d = ta_pack2<E>(x[6], x[7]);
#ifdef TA_EMU
    *reinterpret_cast<ta_vec16*>(dst) = ta_vec16{a, b, c, d};
#else
    asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(dst), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
#endif
}

// ---- D = rowsum(dO ∘ O) ------------------------------------------------------
template <class E, int D>
__device__ __forceinline__ void tree_attn_bwd_pre_body(const TreeAttnBwdParams& p) {
    const uint64_t item = (uint64_t)blockIdx.x * 4 + threadIdx.x / 32;
    if (item >= (uint64_t)p.tokens * p.q_heads) return;  // whole warps leave together
    const uint32_t row = uint32_t(item / p.q_heads), head = uint32_t(item % p.q_heads);
    const size_t at = ((size_t)row * p.q_heads + head) * D;
    float acc = 0.f;
    // A row that sees no key has D = 0 whatever dO holds (DESIGN §5): its
    // LSE is −inf, or, with key starts (the variants: with sinks a blind
    // row's LSE is its sink), the host marked it (TA_BLIND_ROW).
    const bool blind = p.lse[(size_t)head * p.tokens + row] == -INFINITY ||
                       (p.key_start != nullptr && TA_BLIND_ROW(p.key_start, row));
#pragma unroll
    for (int j = ta_lane(); j < D && !blind; j += 32)
        acc += ta_to_f32<E>(p.o[at + j]) * ta_to_f32<E>(p.d_o[at + j]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(TA_FULL_MASK, acc, o);
    if (ta_lane() == 0) p.delta[(size_t)head * p.tokens + row] = acc;
    if (p.zero_dq_accum)
        for (int j = ta_lane(); j < D; j += 32) p.dq_accum[at + j] = 0.f;
}

// ---- dsinks = −Σ_q exp(σ_h − LSE_q) · D_q ------------------------------------
// One block of 128 threads per query head h, after tree_attn_bwd_pre (D):
// thread i sums rows i, i + 128, ... in order (f32), then a fixed tree —
// the warp's butterfly, then the 4 warps' sums in warp order by thread 0 —
// so the result is bit-identical from run to run (no atomics). Launch:
// grid (q_heads), 128 threads, kDsinksSmemBytes of dynamic shared memory. A row that
// sees no key has D = 0 (pre) and adds 0; with sinks every LSE >= σ_h, so
// each exp2 is at most 1. Written in the element type.
constexpr int kDsinksSmemBytes = 16;
template <class E>
__device__ __forceinline__ void tree_attn_bwd_dsinks_body(const TreeAttnBwdParams& p) {
    TA_DYNAMIC_SMEM(smem_raw);  // 4 floats (kDsinksSmemBytes)
    float* const part = reinterpret_cast<float*>(smem_raw);
    const uint32_t h = blockIdx.x, L = p.tokens;
    const float s2 = ta_to_f32<E>(p.sinks[h]) * TA_LOG2E;
    const float* const lse = p.lse + (size_t)h * L;
    const float* const dlt = p.delta + (size_t)h * L;
    float acc = 0.f;
    for (uint32_t row = threadIdx.x; row < L; row += 128) {
        const float d = dlt[row];
        if (d != 0.f) acc += ta_exp2(s2 - lse[row] * TA_LOG2E) * d;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(TA_FULL_MASK, acc, o);
    if (ta_lane() == 0) part[threadIdx.x / 32] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
        const float sum = ((part[0] + part[1]) + part[2]) + part[3];
        p.dsinks[h] = uint16_t(ta_pack2<E>(-sum, 0.f) & 0xffffu);
    }
}

// ---- dK, dV (and atomic dQ) per key tile ----------------------------------------
// kVar: the variant kernels (tree_attn_bwd_main_var_*): key starts (the
// query-tile walk also skips tiles whose rows' windows all start after the
// block's last key, the element mask tests k >= key_start[q], full tiles
// need k0 >= the tile's largest start), a softcap (dS ∘ (1 − tanh²)) and
// the blind rows of sinks, as the params say. Without kVar none of that
// code exists (the plain kernels compile as before the variants).
template <class Tr, bool kAtomicDq, bool kVar = false>
__device__ __forceinline__ void tree_attn_bwd_main_body(const TreeAttnBwdParams& p) {
    using E = typename Tr::Elem;
    constexpr int D = Tr::kHeadDim, BM = Tr::kBlockM, BN = Tr::kBlockN, RS = Tr::kRowStride;
    constexpr int DSS = Tr::kDsStride;
    constexpr int kDTiles = D / 8;   // n-tiles of dK, dV per warp
    constexpr int kMTiles = BM / 8;  // n-tiles of Sᵀ, dPᵀ per warp

    TA_DYNAMIC_SMEM(smem_raw);
    uint16_t* const sk = reinterpret_cast<uint16_t*>(smem_raw);
    uint16_t* const sv = sk + Tr::kKvElems;
    uint16_t* const sq = reinterpret_cast<uint16_t*>(smem_raw + Tr::kOffQ);  // 2 buffers
    uint16_t* const sdo = sq + 2 * Tr::kQElems;                               // 2 buffers
    uint16_t* const sds = reinterpret_cast<uint16_t*>(smem_raw + Tr::kOffDs);
    float* const slse = reinterpret_cast<float*>(smem_raw + Tr::kOffRowStats);  // 2 x BM
    float* const sdelta = slse + 2 * BM;                                          // 2 x BM
    uint32_t* const skv = reinterpret_cast<uint32_t*>(smem_raw + Tr::kOffKvEnd);

    const uint32_t L = p.tokens;
    const uint32_t tile = blockIdx.x, kv_head = blockIdx.y, split = blockIdx.z;
    const uint32_t k0 = tile * BN;
    const uint32_t group = p.q_heads / p.kv_heads;
    // This z-slice's query heads: [head_begin, head_end), group / splits of
    // the kv head's group.
    const uint32_t per_split = group / p.group_splits;
    const uint32_t head_begin = kv_head * group + split * per_split, head_end = head_begin + per_split;
    const unsigned lane = ta_lane(), warp = threadIdx.x / 32;
    const unsigned g = lane >> 2, c = lane & 3;

    const TaUnseenKey unseen = ta_unseen_keys(p.kv_end, p.tile_kv_min, tile, BN, L);
    ta_load_tile<BN, D, RS, Tr::kThreads>(sk, p.k, k0, L, p.kv_heads, kv_head, unseen);
    ta_load_tile<BN, D, RS, Tr::kThreads>(sv, p.v, k0, L, p.kv_heads, kv_head, unseen);
    // kv_end of the tile in the same cp.async group; keys past the pack are
    // seen by nobody (zero-filled).
    if (threadIdx.x < BN)
        ta_cp_async_4(skv + threadIdx.x, p.kv_end + (k0 + threadIdx.x < L ? k0 + threadIdx.x : 0),
                      k0 + threadIdx.x < L);
    ta_cp_async_commit();
    // This thread's two keys (rows g and g + 8 of the warp's 16).
    uint32_t key[2], key_end[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        key[r] = k0 + warp * 16 + g + 8 * r;
        key_end[r] = ta_key_end(p.kv_end, key[r], L);
    }
    ta_cp_async_wait<0>();
    __syncthreads();

    // D = 64: the warp's K and V A fragments stay in registers for the whole
    // block (2 x 16 registers) instead of an ldmatrix per query tile. (Not
    // in the atomic variant kernel: at 255 registers with them its window
    // walk spilled 4 bytes on sm_90a; this kernel is not the d 64 default.)
    constexpr bool kHoistA = D == 64 && !(kVar && kAtomicDq);
    uint32_t ka[kHoistA ? D / 16 : 1][4], va[kHoistA ? D / 16 : 1][4];
    if constexpr (kHoistA) {
        const unsigned mi = lane >> 3, ri = lane & 7;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            const int at = (warp * 16 + ri + 8 * (mi & 1)) * RS + kk * 16 + 8 * (mi >> 1);
            ta_ldmatrix_x4(ka[kk], sk + at);
            ta_ldmatrix_x4(va[kk], sv + at);
        }
    }

    // The first query tile at or after query x that sees a key of the tile
    // (0xffffffff when none): min over keys with kv_end[k] > max(k, x) of
    // max(k, x). Each lane takes BN / 32 keys (lane, lane + 32), then a warp
    // min by butterfly shuffles, so every lane of every warp holds the same
    // result. All lanes must call it together (full-mask shuffles): it runs
    // in block-uniform control flow only.
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
    // Variants with key starts: the walk also skips the query tiles whose
    // rows' windows all start after the block's last key (mask.cuh), until
    // both rules agree on a tile.
    const bool window = kVar && p.key_start != nullptr;
    auto next_visit = [&](uint32_t x) {
        uint32_t t = next_qtile(x);
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
        return t;
    };
    const uint32_t first_qt = next_visit(0);
    const uint32_t tile_min = p.tile_kv_min[tile];

    // Stages query tile qt of query head `head` into buffer b.
    // (LSE and D rows by 4-byte cp.async in the tile's group; the copying
    // thread turns LSE into lse2 after its own wait: lse2_in_place.
    // Variants with key starts: the rows' starts too.)
    static_assert(BM <= Tr::kThreads, "one row's LSE and D per thread");
    uint32_t* const sstart = reinterpret_cast<uint32_t*>(smem_raw + (kVar ? Tr::kOffStarts : 0));
    auto stage = [&](uint32_t head, uint32_t qt, int b) {
        // Every row inside the pack, blind ones too (ta_zero_query_row).
        ta_load_tile<BM, D, RS, Tr::kThreads>(sq + b * Tr::kQElems, p.q, qt * BM, L, p.q_heads, head);
        ta_load_tile<BM, D, RS, Tr::kThreads>(sdo + b * Tr::kQElems, p.d_o, qt * BM, L, p.q_heads, head);
        if (threadIdx.x < BM) {
            const uint32_t row = qt * BM + threadIdx.x;
            const size_t at = (size_t)head * L + (row < L ? row : 0);
            ta_cp_async_4(slse + b * BM + threadIdx.x, p.lse + at, row < L);
            ta_cp_async_4(sdelta + b * BM + threadIdx.x, p.delta + at, row < L);
            if (kVar && window) ta_cp_async_4(sstart + b * BM + threadIdx.x, p.key_start + (row < L ? row : 0), row < L);
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

    float dk[kDTiles][4], dv[kDTiles][4];
#pragma unroll
    for (int n = 0; n < kDTiles; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) dk[n][i] = dv[n][i] = 0.f;

    // Iteration over (query head, query tile qt).
    uint32_t head = head_begin, qt = first_qt;
    if (qt != 0xffffffffu) stage(head, qt, 0);
    ta_cp_async_commit();
    int buf = 0;
    while (qt != 0xffffffffu) {
        uint32_t nhead = head, nqt = next_visit((qt + 1) * BM);
        if (nqt == 0xffffffffu && ++nhead < head_end) nqt = first_qt;
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
        const uint32_t* const sst = sstart + buf * BM;

        // Sᵀ = K Qᵀ and dPᵀ = V dOᵀ for the warp's 16 keys and the BM queries.
        float s[kMTiles][4], dp[kMTiles][4];
        if constexpr (kHoistA) {
            ta_bwd_mm_abt_ra<E, D, BM, RS>(s, ka, qb);
            ta_bwd_mm_abt_ra<E, D, BM, RS>(dp, va, dob);
        } else {
            ta_bwd_mm_abt<E, D, BM, RS>(s, sk + warp * 16 * RS, qb);
            ta_bwd_mm_abt<E, D, BM, RS>(dp, sv + warp * 16 * RS, dob);
        }

        // Full also needs the whole query tile inside the pack: q1 is not
        // clipped here, and a query tile that runs past the pack is partial.
        // (Variants with key starts: and the tile at or after every row's
        // start, by the bounds of the kTaStartTile rows holding it.)
        const bool full = TA_TILE_FULL(BN, k0, q0, q0 + BM, tile_min, L) && q0 + BM <= L &&
                          (!window || k0 >= p.start_tile_max[q0 / kTaStartTile]);
#pragma unroll
        for (int n = 0; n < kMTiles; ++n) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int ql = n * 8 + 2 * c + (i & 1);
                const uint32_t qrow = q0 + ql;
                const int r = i >> 1;
                if constexpr (kVar) {
                    float fac;
                    float pv = ta_bwd_var_p(p, s[n][i], lse2[ql], &fac);
                    if (!full && (!TA_VISIBLE(key[r], key_end[r], qrow) || (window && key[r] < sst[ql]))) pv = 0.f;
                    s[n][i] = pv;                               // Pᵀ
                    dp[n][i] = pv * (dp[n][i] - dlt[ql]) * fac;  // dSᵀ
                } else {
                    float pv = ta_exp2(s[n][i] * p.scale_log2 - lse2[ql]);
                    if (!full && !TA_VISIBLE(key[r], key_end[r], qrow)) pv = 0.f;
                    s[n][i] = pv;                         // Pᵀ
                    dp[n][i] = pv * (dp[n][i] - dlt[ql]);  // dSᵀ
                }
            }
        }

        ta_bwd_mm_cb<E, D, BM, RS>(dv, s, dob);
        ta_bwd_mm_cb<E, D, BM, RS>(dk, dp, qb);

        if (kAtomicDq) {
            // dSᵀ -> shared memory, [key][query].
#pragma unroll
            for (int n = 0; n < kMTiles; ++n)
#pragma unroll
                for (int r = 0; r < 2; ++r)
                    *reinterpret_cast<uint32_t*>(sds + (warp * 16 + g + 8 * r) * DSS + n * 8 + 2 * c) =
                        ta_pack2<E>(dp[n][2 * r], dp[n][2 * r + 1]);
            __syncthreads();
            // dQ (BM x D) = dS K: warp -> 16 query rows (m-tile mt) x a D / kSplit slice.
            constexpr int kRowTiles = BM / 16, kSplit = Tr::kWarps / kRowTiles;
            constexpr int kPairsPerWarp = D / 16 / kSplit;  // 16-column pieces
            const unsigned mt = warp % kRowTiles, part = warp / kRowTiles;
            const unsigned mi = lane >> 3, ri = lane & 7;
            uint32_t a[BN / 16][4];
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk)
                ta_ldmatrix_x4_trans(a[kk], sds + (kk * 16 + 8 * (mi >> 1) + ri) * DSS + mt * 16 + 8 * (mi & 1));
            const uint32_t rows[2] = {q0 + mt * 16 + g, q0 + mt * 16 + g + 8};
#pragma unroll
            for (int j = 0; j < kPairsPerWarp; ++j) {
                const int dpi = part * kPairsPerWarp + j;
                float acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
                for (int kk = 0; kk < BN / 16; ++kk) {
                    uint32_t b[4];
                    ta_ldmatrix_x4_trans(b, sk + (kk * 16 + ri + 8 * (mi & 1)) * RS + dpi * 16 + 8 * (mi >> 1));
                    ta_mma_16816<E>(acc[0], a[kk], b[0], b[1]);
                    ta_mma_16816<E>(acc[1], a[kk], b[2], b[3]);
                }
                // One red.global.add.v2.f32 per pair of adjacent columns on
                // sm_90 (ta_red_add_v2_f32; two scalar reds before).
#pragma unroll
                for (int h2 = 0; h2 < 2; ++h2)
#pragma unroll
                    for (int r = 0; r < 2; ++r) {
                        const uint32_t row = rows[r];
                        if (row < L)
                            ta_red_add_v2_f32(p.dq_accum + ((size_t)row * p.q_heads + head) * D + dpi * 16 + h2 * 8 +
                                                  2 * c,
                                              acc[h2][2 * r] * p.scale, acc[h2][2 * r + 1] * p.scale);
                    }
            }
        }
        __syncthreads();  // buffer `buf` (and dSᵀ) free before they are refilled
        head = nhead;
        qt = nqt;
        buf ^= 1;
    }

    if (p.group_splits > 1) {
        // This slice's f32 partial dK (scaled) and dV, summed over the
        // slices by tree_attn_bwd_dkv_convert.
        const size_t kv_len = (size_t)L * p.kv_heads * D;
        float* const pk = p.dkv_accum + (size_t)split * 2 * kv_len;
        float* const pv = pk + kv_len;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            if (key[r] >= L) continue;
            const size_t at = ((size_t)key[r] * p.kv_heads + kv_head) * D;
#pragma unroll
            for (int n = 0; n < kDTiles; ++n) {
                const size_t e = at + n * 8 + 2 * c;
                pv[e] = dv[n][2 * r];
                pv[e + 1] = dv[n][2 * r + 1];
                pk[e] = dk[n][2 * r] * p.scale;
                pk[e + 1] = dk[n][2 * r + 1] * p.scale;
            }
        }
        return;
    }
    // dV and dK (scaled) in the element type through shared memory — the K
    // and V tile buffers, which nothing reads after the loop's last barrier
    // (and, with no query tile visited, after the first one) — then 16-byte
    // stores, D / 8 per row, consecutive threads on consecutive chunks of a
    // row; rows past the pack are never stored.
    uint16_t* const sdk = sk;
    uint16_t* const sdv = sv;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = warp * 16 + g + 8 * r;
#pragma unroll
        for (int n = 0; n < kDTiles; ++n) {
            *reinterpret_cast<uint32_t*>(sdv + row * RS + n * 8 + 2 * c) = ta_pack2<E>(dv[n][2 * r], dv[n][2 * r + 1]);
            *reinterpret_cast<uint32_t*>(sdk + row * RS + n * 8 + 2 * c) =
                ta_pack2<E>(dk[n][2 * r] * p.scale, dk[n][2 * r + 1] * p.scale);
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

// ---- dK, dV (and atomic dQ) per 128-key tile, two key m-tiles per warp -------------
// (tree_attn_bwd_main2w4_*: the layout and its trade-off are at the top of
// the file.) kFault is a test-only knob, instantiated for the emulator only
// (negative controls, tests/it/emu_bwd.rs): 1 drops the barrier between the dSᵀ
// stores and the dQ matmul, 2 swaps the two key m-tiles' K fragments in Sᵀ.
template <class Tr, bool kAtomicDq, int kFault = 0>
__device__ __forceinline__ void tree_attn_bwd_main2_body(const TreeAttnBwdParams& p) {
    using E = typename Tr::Elem;
    constexpr int D = Tr::kHeadDim, BM = Tr::kBlockM, BN = Tr::kBlockN, RS = Tr::kRowStride;
    constexpr int SUB = Tr::kSubM, DSS = Tr::kDsStride;
    constexpr int kDTiles = D / 8;   // n-tiles of dK, dV per m-tile
    constexpr int kSubN = SUB / 8;   // n-tiles of Sᵀ, dPᵀ per m-tile and sub-tile
    constexpr int kKSteps = D / 16;  // k-steps of Sᵀ, dPᵀ

    TA_DYNAMIC_SMEM(smem_raw);
    uint16_t* const sk = reinterpret_cast<uint16_t*>(smem_raw);
    uint16_t* const sv = sk + Tr::kKvElems;
    uint16_t* const sq = reinterpret_cast<uint16_t*>(smem_raw + Tr::kOffQ);  // 2 buffers
    uint16_t* const sdo = sq + 2 * Tr::kQElems;                               // 2 buffers
    uint16_t* const sds = reinterpret_cast<uint16_t*>(smem_raw + Tr::kOffDs);
    float* const slse = reinterpret_cast<float*>(smem_raw + Tr::kOffRowStats);  // 2 x BM
    float* const sdelta = slse + 2 * BM;                                          // 2 x BM
    uint32_t* const skv = reinterpret_cast<uint32_t*>(smem_raw + Tr::kOffKvEnd);

    const uint32_t L = p.tokens;
    const uint32_t tile = blockIdx.x, kv_head = blockIdx.y, split = blockIdx.z;
    const uint32_t k0 = tile * BN;
    const uint32_t group = p.q_heads / p.kv_heads;
    const uint32_t per_split = group / p.group_splits;
    const uint32_t head_begin = kv_head * group + split * per_split, head_end = head_begin + per_split;
    const unsigned lane = ta_lane(), warp = threadIdx.x / 32;
    const unsigned g = lane >> 2, c = lane & 3, mi = lane >> 3, ri = lane & 7;

    // Keys no query sees load as zeros (DESIGN §5); kv_end is read only when
    // one of the block's two 64-key bounds tiles may hold such a key.
    const uint32_t bt0 = tile * 2;
    const TaUnseenKey unseen{
        p.kv_end, ta_unseen_keys(p.kv_end, p.tile_kv_min, bt0, BN / 2, L).maybe ||
                      (bt0 + 1 < p.num_key_tiles &&
                       ta_unseen_keys(p.kv_end, p.tile_kv_min, bt0 + 1, BN / 2, L).maybe)};
    ta_load_tile<BN, D, RS, Tr::kThreads>(sk, p.k, k0, L, p.kv_heads, kv_head, unseen);
    ta_load_tile<BN, D, RS, Tr::kThreads>(sv, p.v, k0, L, p.kv_heads, kv_head, unseen);
    // kv_end of the tile in the same cp.async group (keys past the pack
    // zero-filled: seen by nobody).
    static_assert(BN == Tr::kThreads, "one kv_end per thread");
    ta_cp_async_4(skv + threadIdx.x, p.kv_end + (k0 + threadIdx.x < L ? k0 + threadIdx.x : 0), k0 + threadIdx.x < L);
    ta_cp_async_commit();
    // The block's two bounds tiles: the full-tile test needs the min of both
    // (a second tile past the pack makes k0 + BN > L: never full).
    const uint32_t bt = tile * 2;
    const uint32_t tile_min =
        bt + 1 < p.num_key_tiles ? min(p.tile_kv_min[bt], p.tile_kv_min[bt + 1]) : 0u;
    ta_cp_async_wait<0>();
    __syncthreads();

    // As the one-m-tile kernel's walk, over BN keys (BN / 32 per lane).
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
    const uint32_t first_qt = next_qtile(0);

    // Stages query tile qt of query head `head` into buffer b: Q, dO and the
    // rows' LSE and D, all by cp.async in one group (thread i < BM copies
    // row i's LSE and D, 4 bytes each; rows past the pack zero-filled).
    // The LSE lands raw: the same thread turns it into lse2 after its wait
    // (lse2_in_place), before the barrier that publishes the tile.
    static_assert(BM <= Tr::kThreads, "one row's LSE and D per thread");
    auto stage = [&](uint32_t head, uint32_t qt, int b) {
        // Every row inside the pack; blind ones are zeroed after the
        // barrier (ta_zero_query_row, DESIGN §5).
        ta_load_tile<BM, D, RS, Tr::kThreads>(sq + b * Tr::kQElems, p.q, qt * BM, L, p.q_heads, head);
        ta_load_tile<BM, D, RS, Tr::kThreads>(sdo + b * Tr::kQElems, p.d_o, qt * BM, L, p.q_heads, head);
        if (threadIdx.x < BM) {
            const uint32_t row = qt * BM + threadIdx.x;
            const size_t at = (size_t)head * L + (row < L ? row : 0);
            ta_cp_async_4(slse + b * BM + threadIdx.x, p.lse + at, row < L);
            ta_cp_async_4(sdelta + b * BM + threadIdx.x, p.delta + at, row < L);
        }
    };
    // LSE -> lse2 (ta_bwd_lse2's rule) for the row this thread staged into
    // buffer b, once its copies have landed (after its own wait); returns
    // whether the row is blind (inside the pack, LSE −inf).
    auto lse2_in_place = [&](uint32_t qt, int b) -> bool {
        bool blind = false;
        if (threadIdx.x < BM) {
            const uint32_t row = qt * BM + threadIdx.x;
            float* const x = slse + b * BM + threadIdx.x;
            const float l = *x;
            blind = row < L && l == -INFINITY;
            *x = row >= L || l == -INFINITY ? INFINITY : l < INFINITY ? l * TA_LOG2E : NAN;
        }
        return blind;
    };

    // dK, dV of the warp's 32 keys: [m-tile][n-tile][4], 2 · 2 · D / 8 · 4
    // = 2D registers.
    float dk[2][kDTiles][4], dv[2][kDTiles][4];
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int n = 0; n < kDTiles; ++n)
#pragma unroll
            for (int i = 0; i < 4; ++i) dk[m][n][i] = dv[m][n][i] = 0.f;

    uint32_t head = head_begin, qt = first_qt;
    if (qt != 0xffffffffu) stage(head, qt, 0);
    ta_cp_async_commit();
    int buf = 0;
    while (qt != 0xffffffffu) {
        uint32_t nhead = head, nqt = next_qtile((qt + 1) * BM);
        if (nqt == 0xffffffffu && ++nhead < head_end) nqt = first_qt;
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
        const bool full = TA_TILE_FULL(BN, k0, q0, q0 + BM, tile_min, L) && q0 + BM <= L;

#pragma unroll 1
        for (int sb = 0; sb < BM / SUB; ++sb) {
            const uint16_t* const qs = qb + sb * SUB * RS;
            const uint16_t* const dos = dob + sb * SUB * RS;
            // Sᵀ = K Qᵀ for 32 keys x SUB queries: each B fragment (x4: 16
            // queries x 16 of D) feeds 4 mma, each A fragment (x4: 16 keys x
            // 16 of D) SUB / 8 = 4.
            float s[2][kSubN][4];
#pragma unroll
            for (int m = 0; m < 2; ++m)
#pragma unroll
                for (int n = 0; n < kSubN; ++n)
#pragma unroll
                    for (int i = 0; i < 4; ++i) s[m][n][i] = 0.f;
#pragma unroll
            for (int kk = 0; kk < kKSteps; ++kk) {
                uint32_t a[2][4];
#pragma unroll
                for (int m = 0; m < 2; ++m)
                    ta_ldmatrix_x4(a[m], sk + (warp * 32 + m * 16 + ri + 8 * (mi & 1)) * RS + kk * 16 + 8 * (mi >> 1));
#pragma unroll
                for (int np = 0; np < SUB / 16; ++np) {
                    uint32_t b[4];
                    ta_ldmatrix_x4(b, qs + (np * 16 + ri + 8 * (mi >> 1)) * RS + kk * 16 + 8 * (mi & 1));
#pragma unroll
                    for (int m = 0; m < 2; ++m) {
                        const int am = kFault == 2 ? 1 - m : m;
                        ta_mma_16816<E>(s[m][2 * np], a[am], b[0], b[1]);
                        ta_mma_16816<E>(s[m][2 * np + 1], a[am], b[2], b[3]);
                    }
                }
            }
            // Pᵀ = exp2(Sᵀ·c − lse2[q]) (masked), rounded to E at once into
            // the A fragments of dV += Pᵀ dO (pa[m][kk]: k-step kk = queries
            // 16kk..16kk+15 of the sub-tile): 16 registers instead of 32
            // while dPᵀ is computed. dSᵀ below uses this rounded Pᵀ.
            uint32_t pa[2][SUB / 16][4];
#pragma unroll
            for (int m = 0; m < 2; ++m) {
#pragma unroll
                for (int n = 0; n < kSubN; ++n) {
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const int ql = sb * SUB + n * 8 + 2 * c + (i & 1);
                        const int kl = warp * 32 + m * 16 + g + 8 * (i >> 1);
                        float pv = ta_exp2(s[m][n][i] * p.scale_log2 - lse2[ql]);
                        if (!full && !TA_VISIBLE(k0 + kl, skv[kl], q0 + ql)) pv = 0.f;
                        s[m][n][i] = pv;
                    }
                    pa[m][n >> 1][2 * (n & 1)] = ta_pack2<E>(s[m][n][0], s[m][n][1]);
                    pa[m][n >> 1][2 * (n & 1) + 1] = ta_pack2<E>(s[m][n][2], s[m][n][3]);
                }
            }
            // dPᵀ = V dOᵀ (V's A fragments from shared memory).
            float dp[2][kSubN][4];
#pragma unroll
            for (int m = 0; m < 2; ++m)
#pragma unroll
                for (int n = 0; n < kSubN; ++n)
#pragma unroll
                    for (int i = 0; i < 4; ++i) dp[m][n][i] = 0.f;
#pragma unroll 1
            for (int kk = 0; kk < kKSteps; ++kk) {
                uint32_t a[2][4];
#pragma unroll
                for (int m = 0; m < 2; ++m)
                    ta_ldmatrix_x4(a[m], sv + (warp * 32 + m * 16 + ri + 8 * (mi & 1)) * RS + kk * 16 + 8 * (mi >> 1));
#pragma unroll
                for (int np = 0; np < SUB / 16; ++np) {
                    uint32_t b[4];
                    ta_ldmatrix_x4(b, dos + (np * 16 + ri + 8 * (mi >> 1)) * RS + kk * 16 + 8 * (mi & 1));
#pragma unroll
                    for (int m = 0; m < 2; ++m) {
                        ta_mma_16816<E>(dp[m][2 * np], a[m], b[0], b[1]);
                        ta_mma_16816<E>(dp[m][2 * np + 1], a[m], b[2], b[3]);
                    }
                }
            }

            // dV += Pᵀ dO, dK += dSᵀ Q with dSᵀ = Pᵀ ∘ (dPᵀ − D[q]) (rounded
            // to E as A fragments), B by ldmatrix.trans, each feeding 4 mma.
#pragma unroll
            for (int kk = 0; kk < SUB / 16; ++kk) {
                uint32_t da[2][4];
#pragma unroll
                for (int m = 0; m < 2; ++m)
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        const int n = 2 * kk + (j >> 1), i0 = 2 * (j & 1);
                        const int ql = sb * SUB + n * 8 + 2 * c;
                        const float p0 = ta_to_f32<E>(uint16_t(pa[m][kk][j] & 0xffffu));
                        const float p1 = ta_to_f32<E>(uint16_t(pa[m][kk][j] >> 16));
                        da[m][j] = ta_pack2<E>(p0 * (dp[m][n][i0] - dlt[ql]), p1 * (dp[m][n][i0 + 1] - dlt[ql + 1]));
                    }
#pragma unroll
                for (int dpi = 0; dpi < D / 16; ++dpi) {
                    const int at = (kk * 16 + ri + 8 * (mi & 1)) * RS + dpi * 16 + 8 * (mi >> 1);
                    uint32_t b[4];
                    ta_ldmatrix_x4_trans(b, dos + at);
#pragma unroll
                    for (int m = 0; m < 2; ++m) {
                        ta_mma_16816<E>(dv[m][2 * dpi], pa[m][kk], b[0], b[1]);
                        ta_mma_16816<E>(dv[m][2 * dpi + 1], pa[m][kk], b[2], b[3]);
                    }
                    ta_ldmatrix_x4_trans(b, qs + at);
#pragma unroll
                    for (int m = 0; m < 2; ++m) {
                        ta_mma_16816<E>(dk[m][2 * dpi], da[m], b[0], b[1]);
                        ta_mma_16816<E>(dk[m][2 * dpi + 1], da[m], b[2], b[3]);
                    }
                }
                if (kAtomicDq) {
                    // dSᵀ -> shared memory, [key][query] (16-bit): the A
                    // fragments just packed, row g / g + 8, columns 2c, 2c + 1
                    // of the two 8-query n-tiles.
#pragma unroll
                    for (int m = 0; m < 2; ++m)
#pragma unroll
                        for (int j = 0; j < 4; ++j)
                            *reinterpret_cast<uint32_t*>(sds + (warp * 32 + m * 16 + g + 8 * (j & 1)) * DSS +
                                                         sb * SUB + kk * 16 + 8 * (j >> 1) + 2 * c) = da[m][j];
                }
            }
        }

        if (kAtomicDq) {
            if (kFault != 1) __syncthreads();  // every warp's dSᵀ is in shared memory
            // dQ (BM x D) = dS K over the BN keys: warp -> 32 query rows (half
            // mt) x 32 columns (half part), two m-tiles x four n-tiles; each
            // A fragment feeds 4 mma, each B fragment 4.
            static_assert(BM == 64 && D == 64 && Tr::kWarps == 4, "dQ: 2 x 2 warps of 32 x 32");
            const unsigned mt = warp & 1, part = warp >> 1;
            float acc[2][4][4];
#pragma unroll
            for (int j = 0; j < 2; ++j)
#pragma unroll
                for (int n = 0; n < 4; ++n)
#pragma unroll
                    for (int i = 0; i < 4; ++i) acc[j][n][i] = 0.f;
#pragma unroll 2
            for (int kk = 0; kk < BN / 16; ++kk) {
                uint32_t a[2][4];
#pragma unroll
                for (int j = 0; j < 2; ++j)
                    ta_ldmatrix_x4_trans(a[j], sds + (kk * 16 + 8 * (mi >> 1) + ri) * DSS + mt * 32 + j * 16 +
                                                   8 * (mi & 1));
#pragma unroll
                for (int dpi = 0; dpi < 2; ++dpi) {
                    uint32_t b[4];
                    ta_ldmatrix_x4_trans(b, sk + (kk * 16 + ri + 8 * (mi & 1)) * RS + part * 32 + dpi * 16 +
                                                8 * (mi >> 1));
#pragma unroll
                    for (int j = 0; j < 2; ++j) {
                        ta_mma_16816<E>(acc[j][2 * dpi], a[j], b[0], b[1]);
                        ta_mma_16816<E>(acc[j][2 * dpi + 1], a[j], b[2], b[3]);
                    }
                }
            }
            // Vector reductions: a thread's two adjacent columns of a row
            // in one red.global.add.v2.f32 (sm_90; two scalar ones before).
#pragma unroll
            for (int j = 0; j < 2; ++j)
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const uint32_t row = q0 + mt * 32 + j * 16 + g + 8 * r;
                    if (row >= L) continue;
                    float* const out = p.dq_accum + ((size_t)row * p.q_heads + head) * D + part * 32 + 2 * c;
#pragma unroll
                    for (int n = 0; n < 4; ++n)
                        ta_red_add_v2_f32(out + n * 8, acc[j][n][2 * r] * p.scale, acc[j][n][2 * r + 1] * p.scale);
                }
        }
        __syncthreads();  // buffer `buf` (and dSᵀ) free before they are refilled
        head = nhead;
        qt = nqt;
        buf ^= 1;
    }

    if (p.group_splits > 1) {
        const size_t kv_len = (size_t)L * p.kv_heads * D;
        float* const pk = p.dkv_accum + (size_t)split * 2 * kv_len;
        float* const pv = pk + kv_len;
#pragma unroll
        for (int m = 0; m < 2; ++m)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const uint32_t key = k0 + warp * 32 + m * 16 + g + 8 * r;
                if (key >= L) continue;
                const size_t at = ((size_t)key * p.kv_heads + kv_head) * D;
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
            const int row = warp * 32 + m * 16 + g + 8 * r;
#pragma unroll
            for (int n = 0; n < kDTiles; ++n) {
                *reinterpret_cast<uint32_t*>(sdv + row * RS + n * 8 + 2 * c) =
                    ta_pack2<E>(dv[m][n][2 * r], dv[m][n][2 * r + 1]);
                *reinterpret_cast<uint32_t*>(sdk + row * RS + n * 8 + 2 * c) =
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

// ---- deterministic dQ per query tile ---------------------------------------------
// kVar: the variant kernel (tree_attn_bwd_dq_var_*): key starts (the walk
// begins at the key tile of the tile's smallest start, full tiles need k0
// >= its largest, the element mask tests k >= key_start[q]), a softcap (dS
// ∘ (1 − tanh²): P is needed here only to form dS, so the packed P holds
// P ∘ (1 − tanh²) and no register is added) and the blind rows of sinks.
template <class Tr, bool kVar = false>
__device__ __forceinline__ void tree_attn_bwd_dq_body(const TreeAttnBwdParams& p) {
    using E = typename Tr::Elem;
    constexpr int D = Tr::kHeadDim, BM = Tr::kBlockM, BN = Tr::kBlockN, RS = Tr::kRowStride;
    constexpr int kNTiles = BN / 8, kDTiles = D / 8;

    TA_DYNAMIC_SMEM(smem_raw);
    uint16_t* const sq = reinterpret_cast<uint16_t*>(smem_raw);
    uint16_t* const sdo = sq + Tr::kTileElems;
    uint16_t* const sk = sdo + Tr::kTileElems;     // 2 buffers
    uint16_t* const sv = sk + 2 * Tr::kTileElems;  // 2 buffers
    float* const slse = reinterpret_cast<float*>(smem_raw + Tr::kOffRowStats);  // BM
    float* const sdelta = slse + BM;                                              // BM

    const uint32_t L = p.tokens;
    // Heaviest query tiles (the last ones, which see the most keys) first.
    const uint32_t q0 = (gridDim.x - 1 - blockIdx.x) * BM, head = blockIdx.y;
    const uint32_t kv_head = head / (p.q_heads / p.kv_heads);
    const uint32_t q1 = q0 + BM < L ? q0 + BM : L;
    const unsigned lane = ta_lane(), warp = threadIdx.x / 32;
    const unsigned g = lane >> 2, c = lane & 3;

    const uint32_t t_end = min(p.num_key_tiles, (q1 - 1) / BN + 1);
    // Variants with key starts: the tile's bounds (one kTaStartTile tile).
    const bool window = kVar && p.key_start != nullptr;
    uint32_t t_begin = 0;
    if constexpr (kVar) {
        static_assert(BM == kTaStartTile, "one start tile per query tile");
        if (window) t_begin = p.start_tile_min[q0 / kTaStartTile] / BN;
    }
    // The next key tile with a visible key: the forward's walk (mask.cuh,
    // 32 tiles per ballot). (D = 64 used to keep one dependent load per
    // skipped tile: at the 128 registers of its 4-blocks-per-SM bound,
    // BwdDqTraits::kMinBlocks, the ballot walk spilled 4 bytes on sm_90a
    // until P was packed to 16 bits before dP, below.)
    auto next_tile = [&](uint32_t t) -> uint32_t {
        return ta_next_visible_tile(p.tile_kv_max, t, t_end, q0);
    };

    if constexpr (kVar) {
        const TaBlindQueryVar blind{p.lse + (size_t)head * L, p.key_start};
        ta_load_tile<BM, D, RS, Tr::kThreads>(sq, p.q, q0, L, p.q_heads, head, blind);
        ta_load_tile<BM, D, RS, Tr::kThreads>(sdo, p.d_o, q0, L, p.q_heads, head, blind);
    } else {
        const TaBlindQuery blind{p.lse + (size_t)head * L};
        ta_load_tile<BM, D, RS, Tr::kThreads>(sq, p.q, q0, L, p.q_heads, head, blind);
        ta_load_tile<BM, D, RS, Tr::kThreads>(sdo, p.d_o, q0, L, p.q_heads, head, blind);
    }
    // The rows' LSE and D join the Q / dO group (4-byte cp.async, rows past
    // the pack zero-filled), as in the main kernels: no dependent global
    // loads after the first barrier. (Variants with key starts: the rows'
    // starts too.)
    static_assert(BM <= Tr::kThreads, "one row's LSE and D per thread");
    uint32_t* const sstart = reinterpret_cast<uint32_t*>(smem_raw + (kVar ? Tr::kOffStarts : 0));
    if (threadIdx.x < BM) {
        const uint32_t row = q0 + threadIdx.x;
        const size_t at = (size_t)head * L + (row < L ? row : 0);
        ta_cp_async_4(slse + threadIdx.x, p.lse + at, row < L);
        ta_cp_async_4(sdelta + threadIdx.x, p.delta + at, row < L);
        if (kVar && window) ta_cp_async_4(sstart + threadIdx.x, p.key_start + (row < L ? row : 0), row < L);
    }
    ta_cp_async_commit();
    // The walk's one-tile look-ahead (issue 39; the forward's, tree_attn_
    // fwd.cu): tile_kv_max and tile_kv_min of the 32 key tiles after tile
    // tt, copied by cp.async in tile tt's group into buffer b's window
    // (warps 2, 3; tiles at or past t_end zero-filled: never chosen), so
    // that once tile tt has landed the next tile and its unseen-key bound
    // are read from shared memory, not by a dependent global load.
    uint32_t* const swin = reinterpret_cast<uint32_t*>(smem_raw + Tr::kOffWindow);
    static_assert(Tr::kThreads == 128, "warps 2, 3 stage the window");
    auto stage_window = [&](uint32_t tt, int b) {
        ta_stage_window<Tr::kThreads>(swin + b * 64, p.tile_kv_max, p.tile_kv_min, tt, t_end);
    };
    uint32_t t = next_tile(t_begin);
    if (t < t_end) {
        const TaUnseenKey unseen = ta_unseen_keys(p.kv_end, p.tile_kv_min, t, BN, L);
        ta_load_tile<BN, D, RS, Tr::kThreads>(sk, p.k, t * BN, L, p.kv_heads, kv_head, unseen);
        ta_load_tile<BN, D, RS, Tr::kThreads>(sv, p.v, t * BN, L, p.kv_heads, kv_head, unseen);
        stage_window(t, 0);
    }
    ta_cp_async_commit();
    ta_cp_async_wait<1>();  // Q, dO, LSE and D have landed
    // LSE -> lse2 (ta_bwd_lse2's rule) by the thread that copied the row,
    // after its own wait and before the barrier that publishes it.
    if (threadIdx.x < BM) slse[threadIdx.x] = ta_bwd_lse2(slse[threadIdx.x], q0 + threadIdx.x < L);
    __syncthreads();

    const uint32_t rows[2] = {q0 + warp * 16 + g, q0 + warp * 16 + g + 8};
    float lse2[2], dlt[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        lse2[r] = slse[warp * 16 + g + 8 * r];
        dlt[r] = sdelta[warp * 16 + g + 8 * r];  // 0 past the pack (zero-filled)
    }
    float acc[kDTiles][4];
#pragma unroll
    for (int n = 0; n < kDTiles; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[n][i] = 0.f;

    int buf = 0;
    while (t < t_end) {
        ta_cp_async_wait<0>();  // tile t has landed, with its look-ahead window
        __syncthreads();
        // The next tile from tile t's window; global memory only after 32
        // skipped tiles in a row.
        bool maybe_unseen;
        const uint32_t tn =
            ta_window_next(swin + buf * 64, p.tile_kv_max, p.tile_kv_min, t, t_end, q0, BN, L, maybe_unseen);
        if (tn < t_end) {
            const TaUnseenKey unseen{p.kv_end, maybe_unseen};
            ta_load_tile<BN, D, RS, Tr::kThreads>(sk + (buf ^ 1) * Tr::kTileElems, p.k, tn * BN, L, p.kv_heads,
                                                      kv_head, unseen);
            ta_load_tile<BN, D, RS, Tr::kThreads>(sv + (buf ^ 1) * Tr::kTileElems, p.v, tn * BN, L, p.kv_heads,
                                                      kv_head, unseen);
            stage_window(tn, buf ^ 1);
        }
        ta_cp_async_commit();
        const uint16_t* const kt = sk + buf * Tr::kTileElems;
        const uint16_t* const vt = sv + buf * Tr::kTileElems;
        const uint32_t k0 = t * BN;

        // S = Q Kᵀ, then P rounded to E at once (two 16-bit values a
        // register: 16 registers instead of 32 while dP is computed), then
        // dP = dO Vᵀ and dS = P̃ ∘ (dP − D) with the rounded P̃ (as the
        // two-m-tile main kernel does). (Variants with a softcap: P̃ is P ∘
        // (1 − tanh²) rounded.)
        uint32_t pp[kNTiles][2];
        {
            float s[kNTiles][4];
            ta_bwd_mm_abt<E, D, BN, RS>(s, sq + warp * 16 * RS, kt);
            const bool full = TA_TILE_FULL(BN, k0, q0, q1, p.tile_kv_min[t], L) &&
                              (!window || k0 >= p.start_tile_max[q0 / kTaStartTile]);
#pragma unroll
            for (int n = 0; n < kNTiles; ++n) {
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    const uint32_t col = k0 + n * 8 + 2 * c + j;
                    const uint32_t end = ta_key_end(p.kv_end, col, L);
#pragma unroll
                    for (int r = 0; r < 2; ++r) {
                        if constexpr (kVar) {
                            // P ∘ (1 − tanh²): the dS factor (P itself is
                            // not needed by dQ).
                            float fac;
                            float pv = ta_bwd_var_p(p, s[n][2 * r + j], lse2[r], &fac) * fac;
                            if (!full &&
                                (!TA_VISIBLE(col, end, rows[r]) || (window && col < sstart[warp * 16 + g + 8 * r])))
                                pv = 0.f;
                            s[n][2 * r + j] = pv;
                        } else {
                            float pv = ta_exp2(s[n][2 * r + j] * p.scale_log2 - lse2[r]);
                            if (!full && !TA_VISIBLE(col, end, rows[r])) pv = 0.f;
                            s[n][2 * r + j] = pv;
                        }
                    }
                }
                pp[n][0] = ta_pack2<E>(s[n][0], s[n][1]);
                pp[n][1] = ta_pack2<E>(s[n][2], s[n][3]);
            }
        }
        float dp[kNTiles][4];
        ta_bwd_mm_abt<E, D, BN, RS>(dp, sdo + warp * 16 * RS, vt);
#pragma unroll
        for (int n = 0; n < kNTiles; ++n)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const float p0 = ta_to_f32<E>(uint16_t(pp[n][r] & 0xffffu));
                const float p1 = ta_to_f32<E>(uint16_t(pp[n][r] >> 16));
                dp[n][2 * r] = p0 * (dp[n][2 * r] - dlt[r]);  // dS
                dp[n][2 * r + 1] = p1 * (dp[n][2 * r + 1] - dlt[r]);
            }
        ta_bwd_mm_cb<E, D, BN, RS>(acc, dp, kt);
        __syncthreads();  // every warp is done with buffer `buf` before it is refilled
        t = tn;
        buf ^= 1;
    }

#pragma unroll
    for (int r = 0; r < 2; ++r) {
        if (rows[r] >= L) continue;
        float* out = p.dq_accum + ((size_t)rows[r] * p.q_heads + head) * D;
#pragma unroll
        for (int n = 0; n < kDTiles; ++n) {
            out[n * 8 + 2 * c] = acc[n][2 * r] * p.scale;
            out[n * 8 + 2 * c + 1] = acc[n][2 * r + 1] * p.scale;
        }
    }
}

// ---- dQ accumulator -> element type ------------------------------------------------
template <class E, int D>
__device__ __forceinline__ void tree_attn_bwd_dq_convert_body(const TreeAttnBwdParams& p) {
    const uint64_t item = (uint64_t)blockIdx.x * 4 + threadIdx.x / 32;
    if (item >= (uint64_t)p.tokens * p.q_heads) return;
    const size_t at = item * D;  // (row · q_heads + head) · D
    // One 16-byte store of 8 elements per lane (lanes D / 8 and up idle).
    const int j = ta_lane() * 8;
    if (j < D) ta_bwd_store8<E>(p.dq + at + j, p.dq_accum + at + j);
}

// ---- split dK, dV partials -> element type ------------------------------------------
// One warp per (key row, kv head): the sum over the group splits in index
// order (the same order every run).
template <class E, int D>
__device__ __forceinline__ void tree_attn_bwd_dkv_convert_body(const TreeAttnBwdParams& p) {
    const uint64_t item = (uint64_t)blockIdx.x * 4 + threadIdx.x / 32;
    if (item >= (uint64_t)p.tokens * p.kv_heads) return;
    const size_t at = item * D;  // (row · kv_heads + head) · D
    const size_t kv_len = (size_t)p.tokens * p.kv_heads * D;
    // 8 elements per lane (lanes D / 8 and up idle), one 16-byte store each.
    const int j = ta_lane() * 8;
    if (j >= D) return;
    float k[8], v[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) k[e] = v[e] = 0.f;
    if (p.items) {
        // The balanced launch: the regions of this row's key tile, in
        // region order (the same every run); none: stored by the main kernel.
        const uint32_t row = uint32_t(item / p.kv_heads), kv_head = uint32_t(item % p.kv_heads);
        const uint32_t tile = row / kTaBalancedKeys;
        const uint32_t* const rt = p.tile_regions + 2 * ((size_t)tile * p.kv_heads + kv_head);
        const uint32_t first = rt[0], regions = rt[1];
        if (regions == 0) return;
        const size_t half = (size_t)kTaBalancedKeys * D;
        for (uint32_t r = first; r < first + regions; ++r) {
            const float* const pk = p.dkv_accum + 2 * r * half + (size_t)(row - tile * kTaBalancedKeys) * D + j;
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                k[e] += pk[e];
                v[e] += pk[half + e];
            }
        }
    } else {
        const uint32_t slots = p.dkv_slots ? p.dkv_slots : p.group_splits;
        for (uint32_t s = 0; s < slots; ++s) {
            const float* const pk = p.dkv_accum + 2 * s * kv_len + at + j;
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                k[e] += pk[e];
                v[e] += pk[kv_len + e];
            }
        }
    }
    ta_bwd_store8<E>(p.dk + at + j, k);
    ta_bwd_store8<E>(p.dv + at + j, v);
}

#define TA_BWD_KERNELS(SUFFIX, E, D, DTYPE)                                                                         \
    extern "C" __global__ void __launch_bounds__(128) tree_attn_bwd_pre_##SUFFIX(const TreeAttnBwdParams p) {       \
        tree_attn_bwd_pre_body<E, D>(p);                                                                            \
    }                                                                                                               \
    extern "C" __global__ void __launch_bounds__(BwdTraits<E, D>::kThreads)                                        \
        tree_attn_bwd_main_atomic_##SUFFIX(const TreeAttnBwdParams p) {                                             \
        tree_attn_bwd_main_body<BwdTraits<E, D>, true>(p);                                                          \
    }                                                                                                               \
    extern "C" __global__ void __launch_bounds__(BwdTraits<E, D>::kThreads)                                        \
        tree_attn_bwd_main_det_##SUFFIX(const TreeAttnBwdParams p) {                                                \
        tree_attn_bwd_main_body<BwdTraits<E, D>, false>(p);                                                         \
    }                                                                                                               \
    extern "C" __global__ void                                                                                      \
        __launch_bounds__(BwdDqTraits<E, D>::kThreads, BwdDqTraits<E, D>::kMinBlocks)                               \
        tree_attn_bwd_dq_##SUFFIX(const TreeAttnBwdParams p) {                                                      \
        tree_attn_bwd_dq_body<BwdDqTraits<E, D>>(p);                                                                \
    }                                                                                                               \
    extern "C" __global__ void __launch_bounds__(128) tree_attn_bwd_dq_convert_##SUFFIX(const TreeAttnBwdParams p) { \
        tree_attn_bwd_dq_convert_body<E, D>(p);                                                                     \
    }                                                                                                               \
    extern "C" __global__ void __launch_bounds__(128) tree_attn_bwd_dkv_convert_##SUFFIX(const TreeAttnBwdParams p) { \
        tree_attn_bwd_dkv_convert_body<E, D>(p);                                                                    \
    }                                                                                                               \
    extern "C" __global__ void __launch_bounds__(BwdTraits<E, D>::kThreads)                                        \
        tree_attn_bwd_main_var_atomic_##SUFFIX(const TreeAttnBwdParams p) {                                         \
        tree_attn_bwd_main_body<BwdTraits<E, D>, true, true>(p);                                                    \
    }                                                                                                               \
    extern "C" __global__ void __launch_bounds__(BwdTraits<E, D>::kThreads)                                        \
        tree_attn_bwd_main_var_det_##SUFFIX(const TreeAttnBwdParams p) {                                            \
        tree_attn_bwd_main_body<BwdTraits<E, D>, false, true>(p);                                                   \
    }                                                                                                               \
    extern "C" __global__ void                                                                                      \
        __launch_bounds__(BwdDqTraits<E, D>::kThreads, BwdDqTraits<E, D>::kMinBlocks)                               \
        tree_attn_bwd_dq_var_##SUFFIX(const TreeAttnBwdParams p) {                                                  \
        tree_attn_bwd_dq_body<BwdDqTraits<E, D>, true>(p);                                                          \
    }                                                                                                               \
    extern "C" __global__ void __launch_bounds__(128) tree_attn_bwd_dsinks_##SUFFIX(const TreeAttnBwdParams p) {    \
        tree_attn_bwd_dsinks_body<E>(p);                                                                            \
    }
TA_ATTN_VARIANTS(TA_BWD_KERNELS)
#undef TA_BWD_KERNELS

// The 4-warp two-m-tile main kernels for D = 64 (Bwd2Traits; Rust
// `MainKernel::TwoMTilesFourWarps`).
#define TA_BWD2_KERNELS(SUFFIX, E)                                                                               \
    extern "C" __global__ void __launch_bounds__(Bwd2Traits<E, 64>::kThreads)                                   \
        tree_attn_bwd_main2w4_atomic_##SUFFIX(const TreeAttnBwdParams p) {                                       \
        tree_attn_bwd_main2_body<Bwd2Traits<E, 64>, true>(p);                                                    \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(Bwd2Traits<E, 64>::kThreads)                                   \
        tree_attn_bwd_main2w4_det_##SUFFIX(const TreeAttnBwdParams p) {                                          \
        tree_attn_bwd_main2_body<Bwd2Traits<E, 64>, false>(p);                                                   \
    }
TA_BWD2_KERNELS(bf16_d64, ta_bf16)
TA_BWD2_KERNELS(f16_d64, ta_f16)
#undef TA_BWD2_KERNELS

// The D = 128 two-m-tile main kernels: 8 warps, the head-dim split of dK, dV
// (tree_attn_bwd_main2_d128.cuh, Bwd2SplitTraits).
#include "tree_attn_bwd_main2_d128.cuh"
#define TA_BWD2_D128_KERNELS(SUFFIX, E)                                                                          \
    extern "C" __global__ void __launch_bounds__(Bwd2SplitTraits<E, 128>::kThreads)                             \
        tree_attn_bwd_main2_atomic_##SUFFIX(const TreeAttnBwdParams p) {                                         \
        tree_attn_bwd_main2_d128_body<Bwd2SplitTraits<E, 128>, true>(p);                                         \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(Bwd2SplitTraits<E, 128>::kThreads)                             \
        tree_attn_bwd_main2_det_##SUFFIX(const TreeAttnBwdParams p) {                                            \
        tree_attn_bwd_main2_d128_body<Bwd2SplitTraits<E, 128>, false>(p);                                        \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(Bwd2SplitTraits<E, 128>::kThreads)                             \
        tree_attn_bwd_main2_var_atomic_##SUFFIX(const TreeAttnBwdParams p) {                                     \
        tree_attn_bwd_main2_d128_body<Bwd2SplitTraits<E, 128>, true, 0, true>(p);                                \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(Bwd2SplitTraits<E, 128>::kThreads)                             \
        tree_attn_bwd_main2_var_det_##SUFFIX(const TreeAttnBwdParams p) {                                        \
        tree_attn_bwd_main2_d128_body<Bwd2SplitTraits<E, 128>, false, 0, true>(p);                               \
    }
TA_BWD2_D128_KERNELS(bf16_d128, ta_bf16)
TA_BWD2_D128_KERNELS(f16_d128, ta_f16)
#undef TA_BWD2_D128_KERNELS

// The D = 64 two-m-tile main kernels: 8 warps, the products split by role
// (tree_attn_bwd_main2_roles.cuh, Bwd2RoleTraits; Rust `MainKernel::TwoMTiles`).
#include "tree_attn_bwd_main2_roles.cuh"
#define TA_BWD2_ROLES_KERNELS(SUFFIX, E)                                                                         \
    extern "C" __global__ void __launch_bounds__(Bwd2RoleTraits<E, 64>::kThreads)                               \
        tree_attn_bwd_main2_atomic_##SUFFIX(const TreeAttnBwdParams p) {                                         \
        tree_attn_bwd_main2_roles_body<Bwd2RoleTraits<E, 64>, true>(p);                                          \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(Bwd2RoleTraits<E, 64>::kThreads)                               \
        tree_attn_bwd_main2_det_##SUFFIX(const TreeAttnBwdParams p) {                                            \
        tree_attn_bwd_main2_roles_body<Bwd2RoleTraits<E, 64>, false>(p);                                         \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(Bwd2RoleTraits<E, 64>::kThreads)                               \
        tree_attn_bwd_main2_var_atomic_##SUFFIX(const TreeAttnBwdParams p) {                                     \
        tree_attn_bwd_main2_roles_body<Bwd2RoleTraits<E, 64>, true, 0, true>(p);                                 \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(Bwd2RoleTraits<E, 64>::kThreads)                               \
        tree_attn_bwd_main2_var_det_##SUFFIX(const TreeAttnBwdParams p) {                                        \
        tree_attn_bwd_main2_roles_body<Bwd2RoleTraits<E, 64>, false, 0, true>(p);                                \
    }
TA_BWD2_ROLES_KERNELS(bf16_d64, ta_bf16)
TA_BWD2_ROLES_KERNELS(f16_d64, ta_f16)
#undef TA_BWD2_ROLES_KERNELS
