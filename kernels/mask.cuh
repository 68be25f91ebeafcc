// The interval mask of DESIGN §4, as the attention kernels apply it: query q
// sees key k iff k <= q < kv_end[k]. Written once here for the forward, the
// backward's main (key-tile) kernel and its deterministic dQ kernel.
//
// Two levels, matching the tiling (a key tile of BN keys against a tile of
// query rows):
//
//   tile level     TA_TILE_FULL: every (query, key) pair of the two tiles is
//                  visible, so the kernel skips the element mask. Which tiles
//                  are skipped outright (no visible pair) is decided by each
//                  kernel's tile walk from the per-key-tile min / max of
//                  kv_end (tree_attn_kv_tile_bounds), not here.
//   element level  ta_key_end + TA_VISIBLE, applied to each accumulator
//                  entry of a partial tile. The kernels hold S (forward, dQ
//                  kernel: rows = queries) or Sᵀ (main backward: rows = keys)
//                  in mma C fragments, so a thread tests its own entries: rows
//                  g and g + 8 of each 16-row m-tile its warp owns (the
//                  forward: two m-tiles per warp, the backward kernels: one),
//                  columns 2c, 2c + 1 of each 8-wide n-tile (g = lane / 4,
//                  c = lane % 4).
//
// Keys past the pack have key end 0 (seen by nobody), as do padding keys
// (kv_end[k] == k): their tiles are never full. Query rows past the pack are
// never stored (forward) or carry P = 0 through lse2 = +inf (backward).
#pragma once

#include "common.cuh"

// A key tile [k0, k0 + BN) is fully visible to the query rows [q0, q1) when
// it lies inside the pack (k0 + BN <= tokens), its last key precedes the
// first query (k0 + BN − 1 <= q0: causal part), and every key's interval
// reaches past the last query (tile_kv_min >= q1: the keys' subtrees contain
// all the queries). q1 is exclusive; the forward and the dQ kernel pass it
// clipped to the pack. `tile_kv_min` (the key tile's min of kv_end) is
// evaluated only when the two position tests pass, so off-diagonal tiles cost
// no load. The Rust copy of this rule is `backend::launch::tile_class` (tests
// count tiles with it).
//
// TA_TILE_FULL and TA_VISIBLE are macros, not inline functions: with the
// same tests behind an inline function nvcc lays out the unrolled mask loop
// differently, and the D = 64 forward of 64-row tiles, which sat at exactly
// 128 registers, spilled 16 bytes (ptxas, CUDA 13.0, sm_80 and sm_90a); the
// 128-row forward sits at 254-255 registers, as tight. As macros the forward
// and the dQ kernel compile to the same cubin as with the tests written out in
// place, and no kernel's register count moves.
#define TA_TILE_FULL(BN, k0, q0, q1, tile_kv_min, tokens) \
    ((k0) + (BN) <= (tokens) && (k0) + (BN) - 1 <= (q0) && (tile_kv_min) >= (q1))

// kv_end of `key` as the element mask reads it: 0 for a key past the pack
// (which the tile loader zero-filled), so that no query sees it.
__device__ __forceinline__ uint32_t ta_key_end(const uint32_t* kv_end, uint32_t key, uint32_t tokens) {
    return key < tokens ? kv_end[key] : 0u;
}

// The tile loader's skip (tile_load.cuh) for K and V rows: a key no query
// sees (kv_end[k] == k, a padding key) is loaded as zeros, so that what it
// holds never reaches a result (DESIGN §5). `maybe` is false when the key
// tile holds no such key — min kv_end over the tile (tile_kv_min) at or past
// the tile's end — and then kv_end is not read.
struct TaUnseenKey {
    const uint32_t* kv_end;
    bool maybe;
    __device__ __forceinline__ bool operator()(uint32_t key) const { return maybe && kv_end[key] <= key; }
};

// TaUnseenKey for key tile t of `block_n` keys.
__device__ __forceinline__ TaUnseenKey ta_unseen_keys(const uint32_t* kv_end, const uint32_t* tile_kv_min,
                                                      uint32_t t, uint32_t block_n, uint32_t tokens) {
    const uint32_t k1 = (t + 1) * block_n < tokens ? (t + 1) * block_n : tokens;
    return TaUnseenKey{kv_end, tile_kv_min[t] < k1};
}

// Whether `query` sees `key`, given the key's end from ta_key_end (a macro
// for the reason above).
#define TA_VISIBLE(key, key_end, query) ((key) <= (query) && (query) < (key_end))

// The first key tile at or after t with a visible key for some query of
// the query tile [q0, ...) (tile_kv_max[t] > q0), or t_end: the tile walk
// of the forward and the deterministic dQ kernel (their first tile, and
// the next one after 32 skipped tiles in a row; otherwise they take it from
// the look-ahead window staged with the current tile, issue 39). Each warp reads 32 tiles
// per step (one load per lane, a ballot, the lowest set bit), so a run of
// skipped tiles (a GRPO pack has hundreds in a row) costs one dependent
// load per 32 tiles instead of one per tile. t and t_end must be the same
// in all 32 lanes, which then all reach every ballot and return the same
// tile.
__device__ __forceinline__ uint32_t ta_next_visible_tile(const uint32_t* __restrict__ tile_kv_max, uint32_t t,
                                                         uint32_t t_end, uint32_t q0) {
    for (; t < t_end; t += 32) {
        const uint32_t i = t + ta_lane();
        const unsigned seen = __ballot_sync(TA_FULL_MASK, i < t_end && tile_kv_max[i] > q0);
        if (seen) return t + unsigned(__ffs(int(seen))) - 1;
    }
    return t_end;
}

// ---- The walk's look-ahead window (issue 39) ---------------------------------
// The key-tile walks of the forward and the deterministic dQ kernel stage,
// with key tile tt, a window of 64 words: tile_kv_max of the 32 tiles after
// tt in win[0, 32) and their tile_kv_min in win[32, 64), copied by cp.async
// in tile tt's group by the block's last two warps (tiles at or past t_end
// zero-filled: a max of 0 is never > q0, so never chosen). Once tile tt has
// landed, the next tile and its unseen-key bound come from shared memory
// (ta_window_next), not from a dependent global load on the prefetch path.
template <int kThreads>
__device__ __forceinline__ void ta_stage_window(uint32_t* win, const uint32_t* tile_kv_max,
                                                const uint32_t* tile_kv_min, uint32_t tt, uint32_t t_end) {
    static_assert(kThreads >= 64 && kThreads % 64 == 0, "the last two warps stage the window");
    if (threadIdx.x >= kThreads - 64) {
        const unsigned i = threadIdx.x & 31, hi = (threadIdx.x >> 5) & 1;  // the second-to-last warp: min, last: max
        const uint32_t j = tt + 1 + i;
        ta_cp_async_4(win + (hi ? 0 : 32) + i, (hi ? tile_kv_max : tile_kv_min) + (j < t_end ? j : 0), j < t_end);
    }
}

// The walk's next tile after tile t, from t's landed window `win`: the
// first of the 32 tiles after t whose tile_kv_max passes q0 (a ballot over
// shared memory), else, after 32 skipped tiles, ta_next_visible_tile from
// t + 33 in global memory. `maybe_unseen`: whether the chosen tile may hold
// a key no query sees (its tile_kv_min below the tile's end; TaUnseenKey).
// Block-uniform: t, t_end, q0 the same in all lanes.
__device__ __forceinline__ uint32_t ta_window_next(const uint32_t* win, const uint32_t* __restrict__ tile_kv_max,
                                                   const uint32_t* __restrict__ tile_kv_min, uint32_t t,
                                                   uint32_t t_end, uint32_t q0, uint32_t block_n, uint32_t tokens,
                                                   bool& maybe_unseen) {
    const unsigned seen = __ballot_sync(TA_FULL_MASK, win[ta_lane()] > q0);
    if (seen) {
        const unsigned i = unsigned(__ffs(int(seen))) - 1;
        const uint32_t tn = t + 1 + i;
        maybe_unseen = win[32 + i] < min((tn + 1) * block_n, tokens);
        return tn;
    }
    const uint32_t tn = ta_next_visible_tile(tile_kv_max, t + 33, t_end, q0);
    maybe_unseen = tn < t_end && tile_kv_min[tn] < min((tn + 1) * block_n, tokens);
    return tn;
}

// ---- Key starts (the attention variants' kernels, kVar) ---------------------
// A sliding window, explicit key starts (context parallelism) and the rows
// that see no key under attention sinks all come to the kernels as one u32
// per query row, `key_start[q]`: q sees k iff
//
//   key_start[q] <= k <= q < kv_end[k]
//
// (the host computes it once per pack and window: `PackMask::
// window_starts`, one stack walk; a row that sees no key gets q + 1, so
// that every key is outside its window and the loaders can tell it from
// the array alone: TA_BLIND_ROW). With the per-64-row bounds `start_tile_
// min` / `start_tile_max` the tile rules gain: a key tile that ends before
// every row's start (k1 − 1 < min start) is skipped, and a tile is full
// only if it also begins at or after every row's start (k0 >= max start).

// Rows per tile of the key starts' bounds (`start_tile_min`,
// `start_tile_max`: min and max of key_start over rows [64i, 64i + 64),
// computed by tree_attn_kv_tile_bounds like the key tiles' bounds of
// kv_end). Query tiles of 128 rows (the forward) span two, of 32 rows (the
// one-m-tile backward at d 128) half of one (its bounds are then those of
// the enclosing 64 rows: looser, never wrong).
constexpr int kTaStartTile = 64;

// Whether query `row` sees no key at all (key_start[row] > row: the host's
// mark; a row that sees a key sees one at or before itself).
#define TA_BLIND_ROW(key_start, row) ((key_start)[row] > (row))

// The first query tile at or after tile t (tiles of `bm` rows, bm dividing
// kTaStartTile) whose rows' smallest key start is at most `k_last` (the
// last key of the caller's key block): the tiles before it hold no row
// whose window reaches a key of the block. 0xffffffff when none of the
// n_tiles does. 32 tiles per ballot, as ta_next_visible_tile;
// t must be the same in all 32 lanes (block-uniform control flow).
__device__ __forceinline__ uint32_t ta_next_window_qtile(const uint32_t* __restrict__ start_tile_min, uint32_t t,
                                                         uint32_t n_tiles, uint32_t bm, uint32_t k_last) {
    for (; t < n_tiles; t += 32) {
        const uint32_t i = t + ta_lane();
        const unsigned ok =
            __ballot_sync(TA_FULL_MASK, i < n_tiles && start_tile_min[i * bm / kTaStartTile] <= k_last);
        if (ok) return t + unsigned(__ffs(int(ok))) - 1;
    }
    return 0xffffffffu;
}
