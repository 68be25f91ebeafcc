/* The C ABI from C: compiled and run by capi/tests/c_program.rs (so it runs
 * in `cargo test`). Packs the README's worked example, checks the pack's
 * arrays, runs attention forward / backward (f64 against the values the
 * Rust API computed, passed in a file; f32 and f64 against a dense reference
 * computed here in double; bf16 against the f32 call on the widened inputs), SDCC against a reference, and the error codes
 * and messages of bad input.
 *
 * usage: smoke EXPECTED_FILE   (o, dq, dk, dv of the f64 call, %.17g each) */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "treeattn.h"

#include "check.h"

/* bf16 <-> float: the upper 16 bits, rounded to nearest even (finite
 * inputs; NaN is not used here). */
static uint16_t bf16_of(float x) {
  uint32_t u;
  memcpy(&u, &x, 4);
  u += 0x7FFF + ((u >> 16) & 1);
  return (uint16_t)(u >> 16);
}

static float float_of_bf16(uint16_t b) {
  uint32_t u = (uint32_t)b << 16;
  float x;
  memcpy(&x, &u, 4);
  return x;
}

/* A call that must fail with `code` and a message containing `needle`. */
#define FAILS(call, code, needle)                                            \
  do {                                                                       \
    int32_t st_ = (call);                                                    \
    CHECK(st_ == (code), "%s -> %d (%s), expected %d: %s", #call, st_,       \
          treeattn_status_name(st_), (code), treeattn_last_error());         \
    CHECK(strstr(treeattn_last_error(), (needle)) != NULL,                   \
          "%s: message \"%s\" lacks \"%s\"", #call, treeattn_last_error(),   \
          (needle));                                                         \
  } while (0)

/* Dense reference in double: O, LSE, and dQ, dK, dV for dO. */
static void reference(const double *q, const double *k, const double *v,
                      const double *d_o, const uint32_t *kv_end, size_t L,
                      size_t hq, size_t hkv, size_t d, double *o, double *dq,
                      double *dk, double *dv) {
  double scale = 1.0 / sqrt((double)d);
  double *p = malloc(L * sizeof(double));
  memset(dq, 0, L * hq * d * sizeof(double));
  memset(dk, 0, L * hkv * d * sizeof(double));
  memset(dv, 0, L * hkv * d * sizeof(double));
  for (size_t h = 0; h < hq; h++) {
    size_t g = h / (hq / hkv);
    for (size_t r = 0; r < L; r++) {
      const double *qr = q + (r * hq + h) * d;
      double m = -INFINITY, sum = 0.0;
      for (size_t c = 0; c < L; c++) {
        p[c] = -INFINITY;
        if (c <= r && r < kv_end[c]) {
          double s = 0.0;
          for (size_t i = 0; i < d; i++) s += qr[i] * k[(c * hkv + g) * d + i];
          p[c] = s * scale;
          if (p[c] > m) m = p[c];
        }
      }
      for (size_t c = 0; c < L; c++) {
        p[c] = isinf(p[c]) ? 0.0 : exp(p[c] - m);
        sum += p[c];
      }
      double *orow = o + (r * hq + h) * d;
      const double *dorow = d_o + (r * hq + h) * d;
      for (size_t i = 0; i < d; i++) orow[i] = 0.0;
      for (size_t c = 0; c < L; c++) {
        p[c] /= sum;
        for (size_t i = 0; i < d; i++) orow[i] += p[c] * v[(c * hkv + g) * d + i];
      }
      double D = 0.0;
      for (size_t i = 0; i < d; i++) D += dorow[i] * orow[i];
      for (size_t c = 0; c < L; c++) {
        if (p[c] == 0.0) continue;
        double dp = 0.0;
        for (size_t i = 0; i < d; i++) dp += dorow[i] * v[(c * hkv + g) * d + i];
        double ds = p[c] * (dp - D) * scale;
        for (size_t i = 0; i < d; i++) {
          dq[(r * hq + h) * d + i] += ds * k[(c * hkv + g) * d + i];
          dk[(c * hkv + g) * d + i] += ds * qr[i];
          dv[(c * hkv + g) * d + i] += p[c] * dorow[i];
        }
      }
    }
  }
  free(p);
}

static double max_abs_diff(const double *a, const double *b, size_t n) {
  double m = 0.0;
  for (size_t i = 0; i < n; i++) {
    double x = fabs(a[i] - b[i]);
    if (!(x <= m)) m = x; /* NaN propagates */
  }
  return m;
}

int main(int argc, char **argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: %s EXPECTED_FILE\n", argv[0]);
    return 2;
  }
  CHECK(strlen(treeattn_version()) > 0, "empty version");
  CHECK(strcmp(treeattn_last_error(), "") == 0, "an error before any call");
  printf("treeattn %s\n", treeattn_version());

  /* --- the README's worked example: one rollout, four calls ---------- */
  const uint32_t ctx[] = {10, 11, 20, /**/ 10, 11, 20, 30, 31, 40,
                          /**/ 10, 11, 20, 30, 31, 40, 32, 1,
                          /**/ 10, 11, 3, 50, 51, 40, 32};
  const size_t ctx_off[] = {0, 3, 9, 17, 24};
  const uint32_t comp[] = {30, 31, 32, 50, 51, 33};
  const size_t comp_off[] = {0, 2, 3, 5, 6};
  const float logprobs[] = {-0.1f, -2.3f, -0.5f, -0.25f, -1.0f, -0.75f};
  const size_t rollout_off[] = {0, 4};
  TreeattnPack *pack = NULL;
  OK(treeattn_pack_build(1, rollout_off, ctx, ctx_off, comp, comp_off,
                         logprobs, 0, &pack));
  size_t L = 0, n_loss = 0, n_sdcc = 0;
  OK(treeattn_pack_sizes(pack, &L, &n_loss, &n_sdcc));
  CHECK(L == 16 && n_loss == 6 && n_sdcc == 3, "sizes %zu %zu %zu", L, n_loss,
        n_sdcc);
  const uint32_t want_tokens[] = {10, 11, 20, 30, 31, 40, 32, 1,
                                  50, 51, 3,  50, 51, 40, 32, 33};
  const uint32_t want_pos[] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 2, 3, 4, 5, 6, 7};
  const uint32_t want_kv_end[] = {16, 16, 10, 10, 10, 10, 10, 10,
                                  10, 10, 16, 16, 16, 16, 16, 16};
  const uint32_t want_loss_row[] = {2, 3, 5, 7, 8, 14};
  const uint32_t want_loss_label[] = {30, 31, 32, 50, 51, 33};
  /* sorted by (rollout, call, offset): 32 of call 1, then 50, 51 */
  const uint32_t want_student[] = {13, 10, 11}, want_teacher[] = {5, 7, 8};
  struct {
    uint32_t field;
    const uint32_t *want;
    size_t n;
  } fields[] = {{TREEATTN_PACK_TOKENS, want_tokens, 16},
                {TREEATTN_PACK_POSITION_IDS, want_pos, 16},
                {TREEATTN_PACK_KV_END, want_kv_end, 16},
                {TREEATTN_PACK_LOSS_ROW, want_loss_row, 6},
                {TREEATTN_PACK_LOSS_LABEL, want_loss_label, 6},
                {TREEATTN_PACK_SDCC_STUDENT_ROW, want_student, 3},
                {TREEATTN_PACK_SDCC_TEACHER_ROW, want_teacher, 3}};
  for (size_t f = 0; f < sizeof fields / sizeof fields[0]; f++) {
    const uint32_t *data = NULL;
    size_t n = 0;
    OK(treeattn_pack_u32(pack, fields[f].field, &data, &n));
    CHECK(n == fields[f].n, "field %u: %zu entries", fields[f].field, n);
    for (size_t i = 0; i < n && i < fields[f].n; i++)
      CHECK(data[i] == fields[f].want[i], "field %u[%zu] = %u, expected %u",
            fields[f].field, i, data[i], fields[f].want[i]);
  }
  const float *lp = NULL;
  size_t n_lp = 0;
  OK(treeattn_pack_f32(pack, TREEATTN_PACK_LOSS_LOGPROB, &lp, &n_lp));
  CHECK(n_lp == 6 && lp[0] == -0.1f && lp[5] == -0.75f, "logprobs");
  const uint32_t *kv_end = NULL, *pos = NULL;
  size_t n = 0;
  OK(treeattn_pack_u32(pack, TREEATTN_PACK_KV_END, &kv_end, &n));
  OK(treeattn_pack_u32(pack, TREEATTN_PACK_POSITION_IDS, &pos, &n));

  /* the pack's kv_end back from its depth position ids */
  {
    uint32_t ends[16];
    OK(treeattn_kv_end_from_positions(pos, L, ends));
    CHECK(memcmp(ends, want_kv_end, sizeof ends) == 0, "kv_end from the position ids");
    const uint32_t flat[5] = {0, 1, 2, 0, 1}; /* two sequences, padding-free */
    uint32_t chains[5];
    OK(treeattn_kv_end_from_positions(flat, 5, chains));
    CHECK(chains[0] == 3 && chains[2] == 3 && chains[3] == 5 && chains[4] == 5, "chains");
    const uint32_t jump[3] = {0, 1, 3};
    FAILS(treeattn_kv_end_from_positions(jump, 3, chains), TREEATTN_ERR_PACK,
          "position_ids[2] = 3 after position_ids[1] = 1");
    FAILS(treeattn_kv_end_from_positions(NULL, 3, chains), TREEATTN_ERR_NULL, "`position_ids`");
    OK(treeattn_kv_end_from_positions(NULL, 0, NULL));
  }

  /* --- attention on the pack: f64 and f32 ---------------------------- */
  const size_t hq = 4, hkv = 2, d = 16;
  TreeattnShape shape = {L, hq, hkv, d, 0};
  size_t nq = L * hq * d, nkv = L * hkv * d;
  double *q = malloc(nq * sizeof(double)), *k = malloc(nkv * sizeof(double)),
         *v = malloc(nkv * sizeof(double)), *d_o = malloc(nq * sizeof(double));
  for (size_t i = 0; i < nq; i++) {
    q[i] = sin((double)i * 0.37);
    d_o[i] = cos((double)i * 0.29);
  }
  for (size_t i = 0; i < nkv; i++) {
    k[i] = sin((double)i * 0.53);
    v[i] = sin((double)i * 0.71);
  }
  double *o = malloc(nq * sizeof(double)), *lse = malloc(hq * L * sizeof(double));
  double *dq = malloc(nq * sizeof(double)), *dk = malloc(nkv * sizeof(double)),
         *dv = malloc(nkv * sizeof(double));
  OK(treeattn_attention_forward(TREEATTN_F64, q, k, v, shape, kv_end, pos, NULL, NULL, o, lse));
  OK(treeattn_attention_backward(TREEATTN_F64, q, k, v, shape, kv_end, pos, NULL, NULL, o, lse,
                                 d_o, dq, dk, dv, NULL));

  /* against the Rust API's result */
  FILE *fp = fopen(argv[1], "r");
  CHECK(fp != NULL, "cannot open %s", argv[1]);
  if (fp == NULL) return 1;
  double *arrays[] = {o, dq, dk, dv};
  size_t lens[] = {nq, nq, nkv, nkv};
  const char *names[] = {"o", "dq", "dk", "dv"};
  for (int a = 0; a < 4; a++) {
    double worst = 0.0;
    for (size_t i = 0; i < lens[a]; i++) {
      double want;
      if (fscanf(fp, "%lf", &want) != 1) {
        CHECK(0, "expected file too short at %s[%zu]", names[a], i);
        return 1;
      }
      double x = fabs(arrays[a][i] - want);
      if (!(x <= worst)) worst = x;
    }
    /* The same library on the same inputs: bit-equal but for the thread
     * count, which only reorders nothing here; allow rounding anyway. */
    CHECK(worst <= 1e-12, "%s differs from the Rust API's by %g", names[a], worst);
  }

  /* the attention variants: a window of 2 tree levels, a softcap of 3,
   * sinks (with their gradient) and a value head dim of 8 */
  {
    const size_t dv_ = 8;
    TreeattnShape vshape = {L, hq, hkv, d, dv_};
    size_t no = L * hq * dv_, nv = L * hkv * dv_;
    double *vv = malloc(nv * sizeof(double)), *vdo = malloc(no * sizeof(double));
    for (size_t i = 0; i < nv; i++) vv[i] = sin((double)i * 0.71);
    for (size_t i = 0; i < no; i++) vdo[i] = cos((double)i * 0.29);
    double sinks[4] = {-1.5, -0.5, 0.5, 1.5};
    TreeattnParams var = {0.0, 0, 0.0, 0, 2, 3.0, sinks, 0};
    double *vo = malloc(no * sizeof(double)), *vlse = malloc(hq * L * sizeof(double));
    double *vdq = malloc(nq * sizeof(double)), *vdk = malloc(nkv * sizeof(double)),
           *vdv = malloc(nv * sizeof(double)), dsinks[4];
    OK(treeattn_attention_forward(TREEATTN_F64, q, k, vv, vshape, kv_end, pos, NULL, &var, vo, vlse));
    OK(treeattn_attention_backward(TREEATTN_F64, q, k, vv, vshape, kv_end, pos, NULL, &var, vo, vlse,
                                   vdo, vdq, vdk, vdv, dsinks));
    double *varrays[] = {vo, vdq, vdk, vdv, dsinks};
    size_t vlens[] = {no, nq, nkv, nv, 4};
    const char *vnames[] = {"variant o", "variant dq", "variant dk", "variant dv", "dsinks"};
    for (int a = 0; a < 5; a++) {
      double worst = 0.0;
      for (size_t i = 0; i < vlens[a]; i++) {
        double want;
        if (fscanf(fp, "%lf", &want) != 1) {
          CHECK(0, "expected file too short at %s[%zu]", vnames[a], i);
          return 1;
        }
        double x = fabs(varrays[a][i] - want);
        if (!(x <= worst)) worst = x;
      }
      CHECK(worst <= 1e-12, "%s differs from the Rust API's by %g", vnames[a], worst);
    }
    /* sinks without asking for their gradient; dsinks without sinks: refused */
    OK(treeattn_attention_backward(TREEATTN_F64, q, k, vv, vshape, kv_end, pos, NULL, &var, vo, vlse,
                                   vdo, vdq, vdk, vdv, NULL));
    FAILS(treeattn_attention_backward(TREEATTN_F64, q, k, v, shape, kv_end, pos, NULL, NULL, o, lse,
                                      d_o, dq, dk, dv, dsinks),
          TREEATTN_ERR_SHAPE, "without attention sinks");
    TreeattnParams zero_window = {0.0, 0, 0.0, 0, 0, -1.0, NULL, 0};
    FAILS(treeattn_attention_forward(TREEATTN_F64, q, k, v, shape, kv_end, pos, NULL, &zero_window, o,
                                     lse),
          TREEATTN_ERR_UNSUPPORTED, "softcap");
    free(vv), free(vdo), free(vo), free(vlse), free(vdq), free(vdk), free(vdv);
  }
  fclose(fp);

  /* against the dense reference */
  double *ro = malloc(nq * sizeof(double)), *rdq = malloc(nq * sizeof(double)),
         *rdk = malloc(nkv * sizeof(double)), *rdv = malloc(nkv * sizeof(double));
  reference(q, k, v, d_o, kv_end, L, hq, hkv, d, ro, rdq, rdk, rdv);
  CHECK(max_abs_diff(o, ro, nq) <= 1e-12, "f64 o vs reference %g", max_abs_diff(o, ro, nq));
  CHECK(max_abs_diff(dq, rdq, nq) <= 1e-12, "f64 dq vs reference %g", max_abs_diff(dq, rdq, nq));
  CHECK(max_abs_diff(dk, rdk, nkv) <= 1e-12, "f64 dk vs reference %g", max_abs_diff(dk, rdk, nkv));
  CHECK(max_abs_diff(dv, rdv, nkv) <= 1e-12, "f64 dv vs reference %g", max_abs_diff(dv, rdv, nkv));

  /* params.deterministic: 1 is accepted by the host entries and changes
   * nothing there (the CPU backend is deterministic); anything but 0 or 1
   * is refused, by every entry that takes the params. */
  {
    TreeattnParams det = {0.0, 0, 0.0, 0, 0, 0.0, NULL, 1};
    CHECK(det.deterministic == 1, "the last field is deterministic");
    TreeattnParams zeroed;
    memset(&zeroed, 0, sizeof zeroed);
    CHECK(zeroed.deterministic == 0, "zero-initialised params are atomic (0)");
    double *o2 = malloc(nq * sizeof(double)), *lse2 = malloc(hq * L * sizeof(double)),
           *dq2 = malloc(nq * sizeof(double)), *dk2 = malloc(nkv * sizeof(double)),
           *dv2 = malloc(nkv * sizeof(double));
    OK(treeattn_attention_forward(TREEATTN_F64, q, k, v, shape, kv_end, pos, NULL, &det, o2, lse2));
    OK(treeattn_attention_backward(TREEATTN_F64, q, k, v, shape, kv_end, pos, NULL, &det, o2, lse2, d_o,
                                   dq2, dk2, dv2, NULL));
    CHECK(memcmp(o2, o, nq * sizeof(double)) == 0, "deterministic: o differs on the host");
    CHECK(memcmp(dq2, dq, nq * sizeof(double)) == 0, "deterministic: dq differs on the host");
    CHECK(memcmp(dk2, dk, nkv * sizeof(double)) == 0, "deterministic: dk differs on the host");
    CHECK(memcmp(dv2, dv, nkv * sizeof(double)) == 0, "deterministic: dv differs on the host");
    int32_t bad_values[] = {2, -1, 255};
    for (size_t i = 0; i < sizeof bad_values / sizeof bad_values[0]; i++) {
      TreeattnParams bad_det = {0.0, 0, 0.0, 0, 0, 0.0, NULL, bad_values[i]};
      FAILS(treeattn_attention_forward(TREEATTN_F64, q, k, v, shape, kv_end, pos, NULL, &bad_det, o2,
                                       lse2),
            TREEATTN_ERR_UNSUPPORTED, "deterministic");
      FAILS(treeattn_attention_backward(TREEATTN_F64, q, k, v, shape, kv_end, pos, NULL, &bad_det, o2,
                                        lse2, d_o, dq2, dk2, dv2, NULL),
            TREEATTN_ERR_UNSUPPORTED, "deterministic");
    }
    free(o2), free(lse2), free(dq2), free(dk2), free(dv2);
  }

  /* the same calls through a mask plan built once: bit-identical results */
  {
    TreeattnMaskPlan *mask = NULL;
    OK(treeattn_mask_plan_create(kv_end, pos, L, &mask));
    double *o2 = malloc(nq * sizeof(double)), *lse2 = malloc(hq * L * sizeof(double));
    double *dq2 = malloc(nq * sizeof(double)), *dk2 = malloc(nkv * sizeof(double)),
           *dv2 = malloc(nkv * sizeof(double));
    for (int layer = 0; layer < 2; layer++) {
      OK(treeattn_attention_forward(TREEATTN_F64, q, k, v, shape, NULL, NULL, mask, NULL, o2, lse2));
      OK(treeattn_attention_backward(TREEATTN_F64, q, k, v, shape, NULL, NULL, mask, NULL, o2,
                                     lse2, d_o, dq2, dk2, dv2, NULL));
      CHECK(memcmp(o, o2, nq * sizeof(double)) == 0, "o through the plan differs");
      CHECK(memcmp(lse, lse2, hq * L * sizeof(double)) == 0, "lse through the plan differs");
      CHECK(memcmp(dq, dq2, nq * sizeof(double)) == 0, "dq through the plan differs");
      CHECK(memcmp(dk, dk2, nkv * sizeof(double)) == 0, "dk through the plan differs");
      CHECK(memcmp(dv, dv2, nkv * sizeof(double)) == 0, "dv through the plan differs");
    }
    TreeattnShape shorter = {L - 1, hq, hkv, d, 0};
    FAILS(treeattn_attention_forward(TREEATTN_F64, q, k, v, shorter, NULL, NULL, mask, NULL, o2, lse2),
          TREEATTN_ERR_SHAPE, "mask plan is for 16 tokens");
    /* No plan and no arrays: the arrays are missing; a plan and arrays:
     * ambiguous, refused. */
    FAILS(treeattn_attention_forward(TREEATTN_F64, q, k, v, shape, NULL, NULL, NULL, NULL, o2,
                                     lse2),
          TREEATTN_ERR_NULL, "`kv_end`");
    FAILS(treeattn_attention_forward(TREEATTN_F64, q, k, v, shape, kv_end, pos, mask, NULL, o2,
                                     lse2),
          TREEATTN_ERR_PACK, "both a mask plan");
    treeattn_mask_plan_destroy(mask);
    treeattn_mask_plan_destroy(NULL);
    const uint32_t bad_kv[3] = {3, 0, 3};
    TreeattnMaskPlan *none = (TreeattnMaskPlan *)1;
    FAILS(treeattn_mask_plan_create(bad_kv, NULL, 3, &none), TREEATTN_ERR_PACK, "kv_end[1] = 0");
    CHECK(none == NULL, "a failed treeattn_mask_plan_create leaves *out non-null");
    FAILS(treeattn_mask_plan_create(bad_kv, NULL, 3, NULL), TREEATTN_ERR_NULL, "`out`");
    /* The former names, kept: the same type and functions. */
    TreeattnMask *old_name = NULL;
    OK(treeattn_mask_create(kv_end, pos, L, &old_name));
    OK(treeattn_attention_forward(TREEATTN_F64, q, k, v, shape, NULL, NULL, old_name, NULL, o2, lse2));
    treeattn_mask_destroy(old_name);
    free(o2); free(lse2); free(dq2); free(dk2); free(dv2);
  }

  float *qf = malloc(nq * sizeof(float)), *kf = malloc(nkv * sizeof(float)),
        *vf = malloc(nkv * sizeof(float)), *of = malloc(nq * sizeof(float)),
        *lsef = malloc(hq * L * sizeof(float));
  for (size_t i = 0; i < nq; i++) qf[i] = (float)q[i];
  for (size_t i = 0; i < nkv; i++) {
    kf[i] = (float)k[i];
    vf[i] = (float)v[i];
  }
  OK(treeattn_set_threads(1));
  size_t threads = 0;
  OK(treeattn_get_threads(&threads));
  CHECK(threads == 1, "threads %zu after treeattn_set_threads(1)", threads);
  OK(treeattn_attention_forward(TREEATTN_F32, qf, kf, vf, shape, kv_end, pos, NULL, NULL, of, lsef));
  OK(treeattn_set_threads(0));
  double worst = 0.0;
  for (size_t i = 0; i < nq; i++) {
    double x = fabs((double)of[i] - ro[i]);
    if (!(x <= worst)) worst = x;
  }
  CHECK(worst <= 1e-5, "f32 o vs reference %g", worst);

  /* --- bf16 on the host: the f32 call on the widened inputs, rounded -- */
  {
    uint16_t *qb = malloc(nq * 2), *kb = malloc(nkv * 2), *vb = malloc(nkv * 2),
             *dob = malloc(nq * 2), *ob = malloc(nq * 2), *dqb = malloc(nq * 2),
             *dkb = malloc(nkv * 2), *dvb = malloc(nkv * 2);
    float *qw = malloc(nq * sizeof(float)), *kw = malloc(nkv * sizeof(float)),
          *vw = malloc(nkv * sizeof(float)), *dow = malloc(nq * sizeof(float)),
          *ow = malloc(nq * sizeof(float)), *lseb = malloc(hq * L * sizeof(float)),
          *lsew = malloc(hq * L * sizeof(float)), *dqw = malloc(nq * sizeof(float)),
          *dkw = malloc(nkv * sizeof(float)), *dvw = malloc(nkv * sizeof(float));
    for (size_t i = 0; i < nq; i++) {
      qb[i] = bf16_of(qf[i]);
      dob[i] = bf16_of((float)d_o[i]);
      qw[i] = float_of_bf16(qb[i]);
      dow[i] = float_of_bf16(dob[i]);
    }
    for (size_t i = 0; i < nkv; i++) {
      kb[i] = bf16_of(kf[i]);
      vb[i] = bf16_of(vf[i]);
      kw[i] = float_of_bf16(kb[i]);
      vw[i] = float_of_bf16(vb[i]);
    }
    OK(treeattn_attention_forward(TREEATTN_BF16, qb, kb, vb, shape, kv_end, pos, NULL, NULL, ob,
                                  lseb));
    OK(treeattn_attention_forward(TREEATTN_F32, qw, kw, vw, shape, kv_end, pos, NULL, NULL, ow,
                                  lsew));
    size_t bad = 0, rounded = 0;
    for (size_t i = 0; i < nq; i++) {
      bad += ob[i] != bf16_of(ow[i]);
      rounded += float_of_bf16(ob[i]) != ow[i];
    }
    for (size_t i = 0; i < hq * L; i++) bad += memcmp(&lseb[i], &lsew[i], 4) != 0;
    CHECK(bad == 0, "bf16 o, lse: %zu values differ from the f32 call's, rounded", bad);
    CHECK(rounded > 0, "bf16 o: no value was rounded (the check above proves nothing)");
    /* the backward from the bf16 o: the f32 backward from the widened o */
    for (size_t i = 0; i < nq; i++) ow[i] = float_of_bf16(ob[i]);
    OK(treeattn_attention_backward(TREEATTN_BF16, qb, kb, vb, shape, kv_end, pos, NULL, NULL, ob,
                                   lseb, dob, dqb, dkb, dvb, NULL));
    OK(treeattn_attention_backward(TREEATTN_F32, qw, kw, vw, shape, kv_end, pos, NULL, NULL, ow,
                                   lsew, dow, dqw, dkw, dvw, NULL));
    bad = 0;
    for (size_t i = 0; i < nq; i++) bad += dqb[i] != bf16_of(dqw[i]);
    for (size_t i = 0; i < nkv; i++) bad += (dkb[i] != bf16_of(dkw[i])) + (dvb[i] != bf16_of(dvw[i]));
    CHECK(bad == 0, "bf16 dq, dk, dv: %zu values differ from the f32 call's, rounded", bad);
    free(qb); free(kb); free(vb); free(dob); free(ob); free(dqb); free(dkb); free(dvb);
    free(qw); free(kw); free(vw); free(dow); free(ow); free(lseb); free(lsew); free(dqw);
    free(dkw); free(dvw);
  }

  /* --- SDCC on the pack's pairs, against a reference ---------------- */
  const size_t vocab = 7, rows = 16;
  double *logits = malloc(rows * vocab * sizeof(double)),
         *grad = malloc(rows * vocab * sizeof(double));
  for (size_t i = 0; i < rows * vocab; i++) logits[i] = 2.0 * sin((double)i * 1.3);
  const uint32_t pairs[] = {10, 7, 11, 8, 13, 5};
  const float weights[] = {1.0f, 0.5f, 2.0f};
  TreeattnSdccLoss loss;
  double per_pair[3];
  OK(treeattn_sdcc_forward_kl(TREEATTN_F64, logits, rows, logits, rows, vocab, pairs,
                              weights, 3, 1.0f, grad, &loss, per_pair));
  double want_sum = 0.0;
  for (int i = 0; i < 3; i++) {
    const double *s = logits + pairs[2 * i] * vocab, *t = logits + pairs[2 * i + 1] * vocab;
    double zs = 0.0, zt = 0.0, kl = 0.0;
    for (size_t j = 0; j < vocab; j++) {
      zs += exp(s[j]);
      zt += exp(t[j]);
    }
    for (size_t j = 0; j < vocab; j++) {
      double pt = exp(t[j]) / zt;
      kl += pt * ((t[j] - log(zt)) - (s[j] - log(zs)));
    }
    CHECK(fabs(kl - per_pair[i]) <= 1e-12, "pair %d KL %g, reference %g", i, per_pair[i], kl);
    want_sum += weights[i] * kl;
  }
  CHECK(fabs(loss.loss_sum - want_sum) <= 1e-12, "loss_sum %g, reference %g", loss.loss_sum, want_sum);
  CHECK(fabs(loss.loss_mean - want_sum / 3.5) <= 1e-12, "loss_mean %g", loss.loss_mean);

  /* --- bad input: a status code and a message, never a crash --------- */
  FAILS(treeattn_attention_forward(TREEATTN_F64, NULL, k, v, shape, kv_end, pos, NULL, NULL, o, lse),
        TREEATTN_ERR_NULL, "`q`");
  FAILS(treeattn_attention_forward(TREEATTN_F64, q, k, v, shape, kv_end, pos, NULL, NULL, NULL, lse),
        TREEATTN_ERR_NULL, "`o`");
  TreeattnShape bad_heads = {L, 3, 2, d, 0};
  FAILS(treeattn_attention_forward(TREEATTN_F64, q, k, v, bad_heads, kv_end, pos, NULL, NULL, o, lse),
        TREEATTN_ERR_SHAPE, "kv_heads");
  uint32_t bad_kv_end[16];
  memcpy(bad_kv_end, kv_end, sizeof bad_kv_end);
  bad_kv_end[3] = 2; /* key 3 visible to no query, below itself */
  FAILS(treeattn_attention_forward(TREEATTN_F64, q, k, v, shape, bad_kv_end, pos, NULL, NULL, o, lse),
        TREEATTN_ERR_PACK, "kv_end");
  FAILS(treeattn_attention_forward(TREEATTN_F64, q, k, v, shape, kv_end, pos, NULL, NULL, q, lse),
        TREEATTN_ERR_SHAPE, "overlaps");
  TreeattnParams rope = {0.0, 3, 10000.0, 0, 0, 0.0, NULL, 0};
  FAILS(treeattn_attention_forward(TREEATTN_F64, q, k, v, shape, kv_end, pos, NULL, &rope, o, lse),
        TREEATTN_ERR_UNSUPPORTED, "rotary");
  TreeattnParams finite = {0.0, 0, 0.0, 1, 0, 0.0, NULL, 0};
  q[5] = NAN;
  FAILS(treeattn_attention_forward(TREEATTN_F64, q, k, v, shape, kv_end, pos, NULL, &finite, o, lse),
        TREEATTN_ERR_NON_FINITE, "q");
  q[5] = 0.0;
  FAILS(treeattn_attention_backward(TREEATTN_F64, q, k, v, shape, kv_end, pos, NULL, NULL, o, lse,
                                    d_o, dq, dk, NULL, NULL),
        TREEATTN_ERR_NULL, "`dv`");
  TreeattnPack *bad = (TreeattnPack *)&failures;
  const size_t empty_comp_off[] = {0, 2, 3, 5, 5}; /* call 3 completes nothing */
  FAILS(treeattn_pack_build(1, rollout_off, ctx, ctx_off, comp, empty_comp_off,
                            NULL, 0, &bad),
        TREEATTN_ERR_ROLLOUT, "completion");
  CHECK(bad == NULL, "a failed build leaves *out non-null");
  const size_t decreasing[] = {0, 3, 2, 17, 24};
  FAILS(treeattn_pack_build(1, rollout_off, ctx, decreasing, comp, comp_off, NULL, 0, &bad),
        TREEATTN_ERR_SHAPE, "decreases");
  FAILS(treeattn_pack_build(1, NULL, ctx, ctx_off, comp, comp_off, NULL, 0, &bad),
        TREEATTN_ERR_NULL, "rollout_offsets");
  const uint32_t *data = NULL;
  FAILS(treeattn_pack_u32(pack, 99, &data, &n), TREEATTN_ERR_SHAPE, "field");
  FAILS(treeattn_pack_u32(NULL, TREEATTN_PACK_TOKENS, &data, &n), TREEATTN_ERR_NULL, "pack");
  const uint32_t bad_pair[] = {10, 99};
  FAILS(treeattn_sdcc_forward_kl(TREEATTN_F64, logits, rows, logits, rows, vocab, bad_pair,
                                 weights, 1, 1.0f, grad, &loss, NULL),
        TREEATTN_ERR_PACK, "out of range");
  FAILS(treeattn_sdcc_forward_kl(TREEATTN_F64, logits, rows, logits, rows, vocab, pairs,
                                 weights, 3, 0.0f, grad, &loss, NULL),
        TREEATTN_ERR_UNSUPPORTED, "temperature");
  /* a dtype the host entries do not take, and a value that is no dtype */
  FAILS(treeattn_sdcc_forward_kl(TREEATTN_BF16, logits, rows, logits, rows, vocab, pairs,
                                 weights, 3, 1.0f, grad, &loss, NULL),
        TREEATTN_ERR_UNSUPPORTED, "dtype bfloat16 is not supported");
  FAILS(treeattn_attention_backward((TreeattnDtype)7, q, k, v, shape, kv_end, pos, NULL, NULL, o,
                                    lse, d_o, dq, dk, dv, NULL),
        TREEATTN_ERR_UNSUPPORTED, "dtype 7 is not a TreeattnDtype");
  FAILS(treeattn_sdcc_forward_kl((TreeattnDtype)42, logits, rows, logits, rows, vocab, pairs,
                                 weights, 3, 1.0f, grad, &loss, NULL),
        TREEATTN_ERR_UNSUPPORTED, "dtype 42 is not a TreeattnDtype");
  CHECK(strcmp(treeattn_status_name(TREEATTN_ERR_PACK), "pack") == 0, "status name");

  treeattn_pack_free(pack);
  treeattn_pack_free(NULL);
  free(q); free(k); free(v); free(d_o); free(o); free(lse); free(dq); free(dk);
  free(dv); free(ro); free(rdq); free(rdk); free(rdv); free(qf); free(kf);
  free(vf); free(of); free(lsef); free(logits); free(grad);
  if (failures) {
    fprintf(stderr, "%d check(s) failed\n", failures);
    return 1;
  }
  printf("all C ABI checks passed\n");
  return 0;
}
