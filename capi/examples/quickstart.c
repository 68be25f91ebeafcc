/* treeattn from C: pack the README's worked example (one rollout, four
 * calls, a summary), run tree attention forward and backward on the pack
 * (float, 4 query heads, 2 kv heads, head dim 16), and print the pack and a
 * checksum. Every call returns TREEATTN_OK or an error code, with the
 * message in treeattn_last_error().
 *
 * Built against an installed treeattn (docs/c.md), with -lm for its own sinf:
 *   cc quickstart.c $(pkg-config --cflags --libs treeattn) -lm -o quickstart
 * or with CMake: capi/examples/CMakeLists.txt (find_package(treeattn)). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include <treeattn.h>

#define TRY(call)                                                        \
  do {                                                                   \
    int32_t st_ = (call);                                                \
    if (st_ != TREEATTN_OK) {                                            \
      fprintf(stderr, "%s: %s: %s\n", #call, treeattn_status_name(st_),  \
              treeattn_last_error());                                    \
      return 1;                                                          \
    }                                                                    \
  } while (0)

int main(void) {
  /* Calls as flat token arrays with offsets: call i's context is
   * ctx[ctx_off[i] .. ctx_off[i + 1]), its completion likewise; rollout r
   * holds calls rollout_off[r] .. rollout_off[r + 1]. */
  const uint32_t ctx[] = {10, 11, 20,                     /* call 0 */
                          10, 11, 20, 30, 31, 40,         /* call 1 */
                          10, 11, 20, 30, 31, 40, 32, 1,  /* call 2 */
                          10, 11, 3,  50, 51, 40, 32};    /* call 3: resumes from the summary */
  const size_t ctx_off[] = {0, 3, 9, 17, 24};
  const uint32_t comp[] = {30, 31, 32, 50, 51, 33};
  const size_t comp_off[] = {0, 2, 3, 5, 6};
  const size_t rollout_off[] = {0, 4};

  TreeattnPack *pack = NULL;
  TRY(treeattn_pack_build(1, rollout_off, ctx, ctx_off, comp, comp_off,
                          /* logprobs */ NULL, /* share_prefixes */ 1, &pack));
  size_t L = 0, n_loss = 0, n_sdcc = 0, n = 0;
  TRY(treeattn_pack_sizes(pack, &L, &n_loss, &n_sdcc));
  const uint32_t *tokens, *kv_end, *pos;
  TRY(treeattn_pack_u32(pack, TREEATTN_PACK_TOKENS, &tokens, &n));
  TRY(treeattn_pack_u32(pack, TREEATTN_PACK_KV_END, &kv_end, &n));
  TRY(treeattn_pack_u32(pack, TREEATTN_PACK_POSITION_IDS, &pos, &n));
  printf("treeattn %s: %zu tokens, %zu loss entries, %zu SDCC pairs\n",
         treeattn_version(), L, n_loss, n_sdcc);
  printf("tokens   ");
  for (size_t i = 0; i < L; i++) printf("%3u", tokens[i]);
  printf("\nposition ");
  for (size_t i = 0; i < L; i++) printf("%3u", pos[i]);
  printf("\nkv_end   ");
  for (size_t i = 0; i < L; i++) printf("%3u", kv_end[i]);
  printf("\n");

  /* q [L, 4, 16], k and v [L, 2, 16], row-major; o like q, lse [4, L]. */
  TreeattnShape shape = {L, 4, 2, 16, 0};
  size_t nq = L * 4 * 16, nkv = L * 2 * 16;
  float *q = malloc(nq * sizeof(float)), *o = malloc(nq * sizeof(float));
  float *d_o = malloc(nq * sizeof(float)), *dq = malloc(nq * sizeof(float));
  float *k = malloc(nkv * sizeof(float)), *v = malloc(nkv * sizeof(float));
  float *dk = malloc(nkv * sizeof(float)), *dv = malloc(nkv * sizeof(float));
  float *lse = malloc(4 * L * sizeof(float));
  if (!q || !o || !d_o || !dq || !k || !v || !dk || !dv || !lse) return 1;
  for (size_t i = 0; i < nq; i++) q[i] = sinf(0.37f * (float)i), d_o[i] = 1.0f;
  for (size_t i = 0; i < nkv; i++) k[i] = sinf(0.53f * (float)i), v[i] = sinf(0.71f * (float)i);
  /* Rotary embedding at the pack's position ids (Llama's rotate-half). */
  TreeattnParams params = {/* softmax_scale: 0 = 1/sqrt(d) */ 0.0, /* rope_dims */ 16,
                           /* rope_base */ 10000.0, /* check_finite */ 1,
                           /* window: 0 = none */ 0, /* softcap: 0 = none */ 0.0,
                           /* sinks */ NULL, /* deterministic: 0 = atomic dQ */ 0};
  /* The mask: the pack's arrays (and no mask plan, NULL). */
  TRY(treeattn_attention_forward(TREEATTN_F32, q, k, v, shape, kv_end, pos, NULL, &params, o,
                                 lse));
  TRY(treeattn_attention_backward(TREEATTN_F32, q, k, v, shape, kv_end, pos, NULL, &params, o,
                                  lse, d_o, dq, dk, dv, NULL));
  double so = 0.0, sg = 0.0;
  for (size_t i = 0; i < nq; i++) so += o[i], sg += fabs(dq[i]);
  for (size_t i = 0; i < nkv; i++) sg += fabs(dk[i]) + fabs(dv[i]);
  printf("sum(O) = %.6f, sum|dQ|+|dK|+|dV| = %.6f\n", so, sg);

  /* Bad input is an error code and a message, never a crash. */
  TreeattnShape ragged = {L, 3, 2, 16, 0};
  int32_t st =
      treeattn_attention_forward(TREEATTN_F32, q, k, v, ragged, kv_end, pos, NULL, NULL, o, lse);
  printf("3 query heads over 2 kv heads: %s (%s)\n", treeattn_status_name(st), treeattn_last_error());

  free(q), free(o), free(d_o), free(dq), free(k), free(v), free(dk), free(dv), free(lse);
  treeattn_pack_free(pack);
  return st == TREEATTN_OK; /* the ragged call must have failed */
}
