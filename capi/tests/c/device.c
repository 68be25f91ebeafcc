/* The C ABI's device entries from a C host that owns the context, the
 * memory and the stream, as a C++ framework or a JAX FFI handler would.
 * Needs no CUDA headers: the few driver functions used are declared here
 * and loaded with dlopen("libcuda.so.1").
 *
 * Where a driver and a GPU exist: retains device 0's primary context,
 * creates a stream, allocates and fills bf16 / f16 buffers, runs
 * treeattn_cuda_attention_forward / _backward (TREEATTN_BF16, TREEATTN_F16;
 * plain, then with attention sinks, their gradient and a window)
 * and treeattn_cuda_sdcc_forward_kl (TREEATTN_F32) on that stream, and checks them
 * against the library's CPU entries on the same rounded inputs, with the
 * bounds of treeattn's tolerance table (bf16: O 1e-2, grads 2e-2 relative
 * Frobenius; f16: 2e-3, 5e-3; LSE 1e-3 absolute; SDCC 1e-4 relative).
 * Without a driver: checks that the entries fail cleanly (not built with
 * CUDA: TREEATTN_ERR_UNSUPPORTED; built with it: TREEATTN_ERR_CUDA "no CUDA
 * driver") and exits 0.
 *
 * usage: device [--require-gpu]
 *   --require-gpu: no driver, no device, or a library built without the
 *   `cuda` feature is a failure (the GPU check script passes it). */
#include <dlfcn.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "treeattn.h"

#include "check.h"

/* The driver API subset, as in cuda.h (CUresult is an int, CUdeviceptr a
 * 64-bit integer, handles are pointers). */
typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef void *CUcontext;
typedef void *CUstream;
static struct {
  CUresult (*init)(unsigned);
  CUresult (*device_get)(int *, int);
  CUresult (*device_count)(int *);
  CUresult (*primary_retain)(CUcontext *, int);
  CUresult (*ctx_set_current)(CUcontext);
  CUresult (*stream_create)(CUstream *, unsigned);
  CUresult (*stream_sync)(CUstream);
  CUresult (*stream_destroy)(CUstream);
  CUresult (*mem_alloc)(CUdeviceptr *, size_t);
  CUresult (*mem_free)(CUdeviceptr);
  CUresult (*htod)(CUdeviceptr, const void *, size_t);
  CUresult (*dtoh)(void *, CUdeviceptr, size_t);
} cu;

#define CU(call)                                                             \
  do {                                                                       \
    CUresult r_ = (call);                                                    \
    if (r_ != 0) {                                                           \
      fprintf(stderr, "FAIL %s:%d: %s -> CUresult %d\n", __FILE__, __LINE__, \
              #call, r_);                                                    \
      exit(1);                                                               \
    }                                                                        \
  } while (0)

static int load_driver(void) {
  void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!h) h = dlopen("libcuda.so", RTLD_NOW | RTLD_LOCAL);
  if (!h) return 0;
#define SYM(field, name)                                                     \
  do {                                                                       \
    *(void **)(&cu.field) = dlsym(h, name);                                  \
    if (!cu.field) {                                                         \
      fprintf(stderr, "libcuda lacks %s\n", name);                           \
      return 0;                                                              \
    }                                                                        \
  } while (0)
  SYM(init, "cuInit");
  SYM(device_get, "cuDeviceGet");
  SYM(device_count, "cuDeviceGetCount");
  SYM(primary_retain, "cuDevicePrimaryCtxRetain");
  SYM(ctx_set_current, "cuCtxSetCurrent");
  SYM(stream_create, "cuStreamCreate");
  SYM(stream_sync, "cuStreamSynchronize");
  SYM(stream_destroy, "cuStreamDestroy_v2");
  SYM(mem_alloc, "cuMemAlloc_v2");
  SYM(mem_free, "cuMemFree_v2");
  SYM(htod, "cuMemcpyHtoD_v2");
  SYM(dtoh, "cuMemcpyDtoH_v2");
#undef SYM
  return 1;
}

/* float <-> bf16 / f16 bits (round to nearest even; inputs are finite and
 * small, so no overflow or subnormal handling is needed for f16 beyond
 * flushing tiny values, which these inputs do not produce). */
static uint16_t to_bf16(float x) {
  uint32_t u;
  memcpy(&u, &x, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}
static float from_bf16(uint16_t b) {
  uint32_t u = (uint32_t)b << 16;
  float x;
  memcpy(&x, &u, 4);
  return x;
}
static uint16_t to_f16(float x) {
  uint32_t u;
  memcpy(&u, &x, 4);
  uint32_t sign = (u >> 16) & 0x8000u;
  int32_t exp = (int32_t)((u >> 23) & 0xFF) - 127 + 15;
  uint32_t mant = u & 0x7FFFFFu;
  if (exp <= 0) return (uint16_t)sign; /* |x| < 2^-14: not produced here */
  uint32_t h = sign | ((uint32_t)exp << 10) | (mant >> 13);
  uint32_t rest = mant & 0x1FFFu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) h++;
  return (uint16_t)h;
}
static float from_f16(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1F, mant = h & 0x3FFu;
  uint32_t u;
  if (exp == 0) {
    u = sign; /* zero (no subnormals here) */
  } else {
    u = sign | ((exp - 15 + 127) << 23) | (mant << 13);
  }
  float x;
  memcpy(&x, &u, 4);
  return x;
}

static double rel_frobenius(const float *got, const float *want, size_t n) {
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < n; i++) {
    double d = (double)got[i] - (double)want[i];
    if (!isfinite(got[i])) return INFINITY;
    num += d * d;
    den += (double)want[i] * want[i];
  }
  return den == 0.0 ? (num == 0.0 ? 0.0 : INFINITY) : sqrt(num / den);
}

static CUdeviceptr upload(const void *host, size_t bytes) {
  CUdeviceptr p;
  CU(cu.mem_alloc(&p, bytes ? bytes : 1));
  if (bytes) CU(cu.htod(p, host, bytes));
  return p;
}

/* The README's worked example (rollout r17), packed by the library. */
static TreeattnPack *readme_pack(void) {
  const size_t rollout_off[] = {0, 4};
  const uint32_t ctx[] = {10, 11, 20, 10, 11, 20, 30, 31, 40,
                          10, 11, 20, 30, 31, 40, 32, 1, 10, 11, 3, 50, 51, 40, 32};
  const size_t ctx_off[] = {0, 3, 9, 17, 24};
  const uint32_t comp[] = {30, 31, 32, 50, 51, 33};
  const size_t comp_off[] = {0, 2, 3, 5, 6};
  TreeattnPack *pack = NULL;
  OK(treeattn_pack_build(1, rollout_off, ctx, ctx_off, comp, comp_off, NULL, 0, &pack));
  return pack;
}

/* One dtype: forward and backward on the device against the CPU entries. */
static void attention_case(int f16, CUstream stream, const uint32_t *kv_end,
                           const uint32_t *pos, size_t L) {
  const char *name = f16 ? "f16" : "bf16";
  const TreeattnDtype dtype = f16 ? TREEATTN_F16 : TREEATTN_BF16;
  const double o_bound = f16 ? 2e-3 : 1e-2, g_bound = f16 ? 5e-3 : 2e-2;
  TreeattnShape shape = {L, 4, 2, 64, 0};
  size_t nq = L * 4 * 64, nk = L * 2 * 64, nl = 4 * L;
  uint16_t *q16 = malloc(nq * 2), *k16 = malloc(nk * 2), *v16 = malloc(nk * 2),
           *do16 = malloc(nq * 2), *o16 = malloc(nq * 2), *g16 = malloc(nq * 2);
  float *q = malloc(nq * 4), *k = malloc(nk * 4), *v = malloc(nk * 4),
        *dout = malloc(nq * 4), *o = malloc(nq * 4), *lse = malloc(nl * 4),
        *dq = malloc(nq * 4), *dk = malloc(nk * 4), *dv = malloc(nk * 4),
        *got = malloc(nq * 4), *got_lse = malloc(nl * 4);
  /* Inputs rounded to the element type; the CPU reference sees the same
   * values in f32. */
  for (size_t i = 0; i < nq; i++) {
    float a = (float)sin(0.37 * (double)i), b = (float)cos(0.29 * (double)i);
    q16[i] = f16 ? to_f16(a) : to_bf16(a);
    do16[i] = f16 ? to_f16(b) : to_bf16(b);
    q[i] = f16 ? from_f16(q16[i]) : from_bf16(q16[i]);
    dout[i] = f16 ? from_f16(do16[i]) : from_bf16(do16[i]);
  }
  for (size_t i = 0; i < nk; i++) {
    float a = (float)sin(0.53 * (double)i), b = (float)sin(0.71 * (double)i);
    k16[i] = f16 ? to_f16(a) : to_bf16(a);
    v16[i] = f16 ? to_f16(b) : to_bf16(b);
    k[i] = f16 ? from_f16(k16[i]) : from_bf16(k16[i]);
    v[i] = f16 ? from_f16(v16[i]) : from_bf16(v16[i]);
  }
  OK(treeattn_attention_forward(TREEATTN_F32, q, k, v, shape, kv_end, pos, NULL, NULL, o, lse));

  CUdeviceptr dq_ = upload(q16, nq * 2), dk_ = upload(k16, nk * 2),
              dv_ = upload(v16, nk * 2), ddo = upload(do16, nq * 2);
  /* Outputs poisoned (0xFF bytes: NaN in every type) before the kernels. */
  memset(o16, 0xFF, nq * 2);
  memset(got_lse, 0xFF, nl * 4);
  CUdeviceptr d_o = upload(o16, nq * 2), d_lse = upload(got_lse, nl * 4);
  OK(treeattn_cuda_attention_forward(dtype, 0, stream, (void *)dq_, (void *)dk_, (void *)dv_,
                                     shape, kv_end, pos, NULL, NULL, (void *)d_o, (float *)d_lse));
  CU(cu.stream_sync(stream));
  CU(cu.dtoh(o16, d_o, nq * 2));
  CU(cu.dtoh(got_lse, d_lse, nl * 4));
  for (size_t i = 0; i < nq; i++) got[i] = f16 ? from_f16(o16[i]) : from_bf16(o16[i]);
  double e_o = rel_frobenius(got, o, nq), e_lse = 0.0;
  for (size_t i = 0; i < nl; i++) {
    double e = fabs((double)got_lse[i] - lse[i]);
    if (!(e <= e_lse)) e_lse = e;
  }
  printf("%s forward on the device: O rel %.2e (bound %.0e), LSE abs %.2e (bound 1e-3)\n",
         name, e_o, o_bound, e_lse);
  CHECK(e_o <= o_bound, "%s O rel error %.3e > %.0e", name, e_o, o_bound);
  CHECK(e_lse <= 1e-3, "%s LSE abs error %.3e > 1e-3", name, e_lse);

  /* The same forward through a mask plan, twice (two "layers": the second
   * reuses the plan's device copy): bit-identical O and LSE. */
  {
    TreeattnMaskPlan *mask = NULL;
    OK(treeattn_mask_plan_create(kv_end, pos, L, &mask));
    uint16_t *o_plan = malloc(nq * 2);
    float *lse_plan = malloc(nl * 4);
    for (int layer = 0; layer < 2; layer++) {
      memset(o_plan, 0xFF, nq * 2);
      memset(lse_plan, 0xFF, nl * 4);
      CU(cu.htod(d_o, o_plan, nq * 2));
      CU(cu.htod(d_lse, lse_plan, nl * 4));
      OK(treeattn_cuda_attention_forward(dtype, 0, stream, (void *)dq_, (void *)dk_,
                                              (void *)dv_, shape, NULL, NULL, mask, NULL, (void *)d_o,
                                              (float *)d_lse));
      CU(cu.stream_sync(stream));
      CU(cu.dtoh(o_plan, d_o, nq * 2));
      CU(cu.dtoh(lse_plan, d_lse, nl * 4));
      CHECK(memcmp(o_plan, o16, nq * 2) == 0, "%s O through the plan (call %d) differs", name,
            layer);
      CHECK(memcmp(lse_plan, got_lse, nl * 4) == 0, "%s LSE through the plan (call %d) differs",
            name, layer);
    }
    treeattn_mask_plan_destroy(mask);
    free(o_plan);
    free(lse_plan);
    CU(cu.htod(d_o, o16, nq * 2));
    CU(cu.htod(d_lse, got_lse, nl * 4));
  }

  /* Backward from the device's own O and LSE; the reference from the
   * CPU's (both within the forward bounds of each other). */
  OK(treeattn_attention_backward(TREEATTN_F32, q, k, v, shape, kv_end, pos, NULL, NULL, o, lse,
                                 dout, dq, dk, dv, NULL));
  memset(g16, 0xFF, nq * 2);
  CUdeviceptr gq = upload(g16, nq * 2), gk = upload(g16, nk * 2), gv = upload(g16, nk * 2);
  OK(treeattn_cuda_attention_backward(dtype, 0, stream, (void *)dq_, (void *)dk_, (void *)dv_,
                                      shape, kv_end, pos, NULL, NULL, (void *)d_o, (const float *)d_lse,
                                      (void *)ddo, (void *)gq, (void *)gk, (void *)gv, NULL));
  CU(cu.stream_sync(stream));
  struct {
    const char *what;
    CUdeviceptr dev;
    const float *want;
    size_t n;
  } grads[] = {{"dq", gq, dq, nq}, {"dk", gk, dk, nk}, {"dv", gv, dv, nk}};
  for (int g = 0; g < 3; g++) {
    CU(cu.dtoh(g16, grads[g].dev, grads[g].n * 2));
    for (size_t i = 0; i < grads[g].n; i++)
      got[i] = f16 ? from_f16(g16[i]) : from_bf16(g16[i]);
    double e = rel_frobenius(got, grads[g].want, grads[g].n);
    printf("%s backward on the device: %s rel %.2e (bound %.0e)\n", name, grads[g].what, e,
           g_bound);
    CHECK(e <= g_bound, "%s %s rel error %.3e > %.0e", name, grads[g].what, e, g_bound);
  }
  /* params.deterministic = 1: two runs give bit-identical dq, dk, dv,
   * within the same bounds of the CPU's. */
  {
    TreeattnParams det = {0.0, 0, 0.0, 0, 0, 0.0, NULL, 1};
    uint16_t *first = malloc(nq * 2);
    for (int run = 0; run < 2; run++) {
      OK(treeattn_cuda_attention_backward(dtype, 0, stream, (void *)dq_, (void *)dk_, (void *)dv_,
                                          shape, kv_end, pos, NULL, &det, (void *)d_o,
                                          (const float *)d_lse, (void *)ddo, (void *)gq,
                                          (void *)gk, (void *)gv, NULL));
      CU(cu.stream_sync(stream));
      for (int g = 0; g < 3; g++) {
        CU(cu.dtoh(g16, grads[g].dev, grads[g].n * 2));
        for (size_t i = 0; i < grads[g].n; i++)
          got[i] = f16 ? from_f16(g16[i]) : from_bf16(g16[i]);
        double e = rel_frobenius(got, grads[g].want, grads[g].n);
        CHECK(e <= g_bound, "%s deterministic %s rel error %.3e > %.0e", name, grads[g].what, e,
              g_bound);
        if (g == 0 && run == 0) memcpy(first, g16, nq * 2);
        if (g == 0 && run == 1)
          CHECK(memcmp(first, g16, nq * 2) == 0, "%s deterministic dq differs between two runs",
                name);
      }
    }
    printf("%s backward on the device, deterministic dq: bit-identical over two runs\n", name);
    free(first);
  }
  CUdeviceptr bufs[] = {dq_, dk_, dv_, ddo, d_o, d_lse, gq, gk, gv};
  for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) CU(cu.mem_free(bufs[i]));
  free(q16), free(k16), free(v16), free(do16), free(o16), free(g16);
  free(q), free(k), free(v), free(dout), free(o), free(lse), free(dq), free(dk), free(dv);
  free(got), free(got_lse);
}

/* Attention sinks (and a window) on the device, dsinks included, against
 * the CPU entries on the same rounded inputs; negative control: the CPU's
 * answer without the sinks is another answer. */
static void sinks_case(int f16, CUstream stream, const uint32_t *kv_end, const uint32_t *pos,
                       size_t L) {
  const char *name = f16 ? "f16" : "bf16";
  const TreeattnDtype dtype = f16 ? TREEATTN_F16 : TREEATTN_BF16;
  const double o_bound = f16 ? 2e-3 : 1e-2, g_bound = f16 ? 5e-3 : 2e-2;
  enum { H = 4 };
  TreeattnShape shape = {L, H, 2, 64, 0};
  size_t nq = L * H * 64, nk = L * 2 * 64, nl = H * L;
  size_t n_all = 2 * nq + 2 * nk + H;
  uint16_t *x16 = malloc(n_all * 2), *g16 = malloc(nq * 2);
  float *x = malloc(n_all * 4), *o = malloc(nq * 4), *lse = malloc(nl * 4),
        *plain = malloc(nq * 4), *dq = malloc(nq * 4), *dk = malloc(nk * 4),
        *dv = malloc(nk * 4), *got = malloc(nq * 4), *got_lse = malloc(nl * 4);
  float dsinks[H];
  /* q, k, v, d_o and the sinks, one rounded buffer. */
  for (size_t i = 0; i < n_all; i++) {
    float a = i < n_all - H ? (float)sin(0.41 * (double)i + 0.3) : 0.5f * (float)(i % H) - 0.75f;
    x16[i] = f16 ? to_f16(a) : to_bf16(a);
    x[i] = f16 ? from_f16(x16[i]) : from_bf16(x16[i]);
  }
  const size_t at_k = nq, at_v = nq + nk, at_do = nq + 2 * nk, at_s = 2 * nq + 2 * nk;
  TreeattnParams host_p = {0.0, 0, 0.0, 0, 3, 0.0, x + at_s, 0};
  TreeattnParams none_p = {0.0, 0, 0.0, 0, 3, 0.0, NULL, 0};
  OK(treeattn_attention_forward(TREEATTN_F32, x, x + at_k, x + at_v, shape, kv_end, pos, NULL, &host_p,
                                o, lse));
  OK(treeattn_attention_forward(TREEATTN_F32, x, x + at_k, x + at_v, shape, kv_end, pos, NULL, &none_p,
                                plain, got_lse));
  OK(treeattn_attention_backward(TREEATTN_F32, x, x + at_k, x + at_v, shape, kv_end, pos, NULL, &host_p,
                                 o, lse, x + at_do, dq, dk, dv, dsinks));

  CUdeviceptr d_x = upload(x16, n_all * 2);
  memset(g16, 0xFF, nq * 2);
  memset(got_lse, 0xFF, nl * 4);
  CUdeviceptr d_o = upload(g16, nq * 2), d_lse = upload(got_lse, nl * 4);
  CUdeviceptr gq = upload(g16, nq * 2), gk = upload(g16, nk * 2), gv = upload(g16, nk * 2),
              gs = upload(g16, H * 2);
  const uint16_t *dev = (const uint16_t *)(uintptr_t)d_x;
  TreeattnParams dev_p = {0.0, 0, 0.0, 0, 3, 0.0, dev + at_s, 0};
  OK(treeattn_cuda_attention_forward(dtype, 0, stream, dev, dev + at_k, dev + at_v, shape, kv_end,
                                     pos, NULL, &dev_p, (void *)d_o, (float *)d_lse));
  OK(treeattn_cuda_attention_backward(dtype, 0, stream, dev, dev + at_k, dev + at_v, shape, kv_end,
                                      pos, NULL, &dev_p, (void *)d_o, (const float *)d_lse, dev + at_do,
                                      (void *)gq, (void *)gk, (void *)gv, (void *)gs));
  CU(cu.stream_sync(stream));
  CU(cu.dtoh(g16, d_o, nq * 2));
  CU(cu.dtoh(got_lse, d_lse, nl * 4));
  for (size_t i = 0; i < nq; i++) got[i] = f16 ? from_f16(g16[i]) : from_bf16(g16[i]);
  double e_o = rel_frobenius(got, o, nq), e_plain = rel_frobenius(got, plain, nq), e_lse = 0.0;
  for (size_t i = 0; i < nl; i++) {
    double e = fabs((double)got_lse[i] - lse[i]);
    if (!(e <= e_lse)) e_lse = e;
  }
  printf("%s sinks + window 3 on the device: O rel %.2e (bound %.0e), LSE abs %.2e; "
         "against the answer without sinks %.2e\n",
         name, e_o, o_bound, e_lse, e_plain);
  CHECK(e_o <= o_bound, "%s sinks O rel error %.3e > %.0e", name, e_o, o_bound);
  CHECK(e_lse <= 1e-3, "%s sinks LSE abs error %.3e > 1e-3", name, e_lse);
  CHECK(e_plain > 2 * o_bound, "%s: O with sinks is the answer without them (%.3e)", name,
        e_plain);
  struct {
    const char *what;
    CUdeviceptr dev;
    const float *want;
    size_t n;
  } grads[] = {{"dq", gq, dq, nq}, {"dk", gk, dk, nk}, {"dv", gv, dv, nk}, {"dsinks", gs, dsinks, H}};
  for (int g = 0; g < 4; g++) {
    CU(cu.dtoh(g16, grads[g].dev, grads[g].n * 2));
    for (size_t i = 0; i < grads[g].n; i++)
      got[i] = f16 ? from_f16(g16[i]) : from_bf16(g16[i]);
    double e = rel_frobenius(got, grads[g].want, grads[g].n);
    printf("%s sinks backward on the device: %s rel %.2e (bound %.0e)\n", name, grads[g].what, e,
           g_bound);
    CHECK(e <= g_bound, "%s sinks %s rel error %.3e > %.0e", name, grads[g].what, e, g_bound);
  }
  CUdeviceptr bufs[] = {d_x, d_o, d_lse, gq, gk, gv, gs};
  for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) CU(cu.mem_free(bufs[i]));
  free(x16), free(g16), free(x), free(o), free(lse), free(plain), free(dq), free(dk), free(dv);
  free(got), free(got_lse);
}

static void sdcc_case(CUstream stream) {
  enum { ROWS = 6, VOCAB = 1000, PAIRS = 3 };
  static float logits[ROWS * VOCAB], grad[ROWS * VOCAB], got[ROWS * VOCAB];
  for (size_t i = 0; i < ROWS * VOCAB; i++) logits[i] = (float)(3.0 * sin(0.013 * (double)i * (double)(i % 7 + 1)));
  const uint32_t pairs[2 * PAIRS] = {0, 3, 1, 4, 2, 5};
  const float weights[PAIRS] = {1.0f, 0.5f, 2.0f};
  TreeattnSdccLoss want, loss;
  double per_want[PAIRS], per[PAIRS];
  OK(treeattn_sdcc_forward_kl(TREEATTN_F32, logits, ROWS, logits, ROWS, VOCAB, pairs, weights,
                              PAIRS, 1.0f, grad, &want, per_want));
  CUdeviceptr d_logits = upload(logits, sizeof logits);
  memset(got, 0xFF, sizeof got);
  CUdeviceptr d_grad = upload(got, sizeof got);
  OK(treeattn_cuda_sdcc_forward_kl(TREEATTN_F32, 0, stream, (void *)d_logits, ROWS,
                                   (void *)d_logits, ROWS, VOCAB, pairs, weights, PAIRS, 1.0f,
                                   (float *)d_grad, &loss, per));
  CU(cu.dtoh(got, d_grad, sizeof got));
  double e_loss = fabs(loss.loss_sum - want.loss_sum) / fmax(fabs(want.loss_sum), 1e-2);
  double e_grad = rel_frobenius(got, grad, ROWS * VOCAB);
  printf("f32 SDCC on the device: loss rel %.2e (bound 1e-4), grad rel %.2e (bound 1e-3)\n",
         e_loss, e_grad);
  CHECK(e_loss <= 1e-4, "SDCC loss rel error %.3e", e_loss);
  CHECK(e_grad <= 1e-3, "SDCC grad rel error %.3e", e_grad);
  for (int p = 0; p < PAIRS; p++)
    CHECK(fabs(per[p] - per_want[p]) <= 1e-4 * fmax(fabs(per_want[p]), 1e-2),
          "SDCC pair %d: %.9g vs %.9g", p, per[p], per_want[p]);
  CU(cu.mem_free(d_logits));
  CU(cu.mem_free(d_grad));
}

int main(int argc, char **argv) {
  int require = argc > 1 && strcmp(argv[1], "--require-gpu") == 0;
  TreeattnPack *pack = readme_pack();
  const uint32_t *kv_end, *pos;
  size_t L, n;
  OK(treeattn_pack_u32(pack, TREEATTN_PACK_KV_END, &kv_end, &L));
  OK(treeattn_pack_u32(pack, TREEATTN_PACK_POSITION_IDS, &pos, &n));
  TreeattnShape shape = {L, 4, 2, 64, 0};
  {
    /* A dtype an entry does not take: TREEATTN_ERR_UNSUPPORTED naming it (by
     * the crate's name of the type: float64 for TREEATTN_F64), in
     * every build, before any CUDA work (the pointers are never read). */
    char dummy[16];
    float dummy_lse[4];
    int32_t st = treeattn_cuda_attention_forward(TREEATTN_F64, 0, NULL, dummy, dummy, dummy,
                                                 shape, kv_end, pos, NULL, NULL, dummy, dummy_lse);
    CHECK(st == TREEATTN_ERR_UNSUPPORTED && strstr(treeattn_last_error(), "float64"),
          "f64 device attention -> %d: %s", st, treeattn_last_error());
    st = treeattn_cuda_attention_forward(TREEATTN_F32, 0, NULL, dummy, dummy, dummy, shape,
                                         kv_end, pos, NULL, NULL, dummy, dummy_lse);
    CHECK(st == TREEATTN_ERR_UNSUPPORTED && strstr(treeattn_last_error(), "float32"),
          "f32 device attention -> %d: %s", st, treeattn_last_error());
    TreeattnSdccLoss loss;
    const uint32_t pair[2] = {0, 0};
    const float weight = 1.0f;
    st = treeattn_cuda_sdcc_forward_kl(TREEATTN_F64, 0, NULL, dummy, 1, dummy, 1, 1, pair,
                                       &weight, 1, 1.0f, dummy_lse, &loss, NULL);
    CHECK(st == TREEATTN_ERR_UNSUPPORTED && strstr(treeattn_last_error(), "float64"),
          "f64 device SDCC -> %d: %s", st, treeattn_last_error());
  }
  int dev_count = 0;
  if (!load_driver() || cu.init(0) != 0 || cu.device_count(&dev_count) != 0 || dev_count == 0) {
    /* No GPU: the entries must fail cleanly, with non-null (never
     * dereferenced) pointers so that the failure is about CUDA itself. */
    char dummy[16];
    float dummy_lse[4];
    int32_t st = treeattn_cuda_attention_forward(TREEATTN_BF16, 0, NULL, dummy, dummy, dummy,
                                                 shape, kv_end, pos, NULL, NULL, dummy, dummy_lse);
    CHECK(st == TREEATTN_ERR_UNSUPPORTED || st == TREEATTN_ERR_CUDA,
          "forward without a GPU -> %d (%s): %s", st, treeattn_status_name(st),
          treeattn_last_error());
    CHECK(strstr(treeattn_last_error(), st == TREEATTN_ERR_UNSUPPORTED ? "built without CUDA"
                                                                      : "CUDA") != NULL,
          "message: %s", treeattn_last_error());
    printf("no GPU here: the device entries fail cleanly (%s: %s)\n", treeattn_status_name(st),
           treeattn_last_error());
    TreeattnMaskPlan *mask = NULL;
    OK(treeattn_mask_plan_create(kv_end, pos, L, &mask));
    st = treeattn_cuda_attention_forward(TREEATTN_BF16, 0, NULL, dummy, dummy, dummy, shape, NULL, NULL,
                                              mask, NULL, dummy, dummy_lse);
    CHECK(st == TREEATTN_ERR_UNSUPPORTED || st == TREEATTN_ERR_CUDA,
          "forward with a plan without a GPU -> %d (%s): %s", st, treeattn_status_name(st),
          treeattn_last_error());
    treeattn_mask_plan_destroy(mask);
    /* Sinks (and their gradient) pass the argument checks and reach the
     * backend: the failure is the same clean one, about CUDA itself. */
    TreeattnParams with_sinks = {0.0, 0, 0.0, 0, 0, 0.0, dummy, 0};
    st = treeattn_cuda_attention_forward(TREEATTN_BF16, 0, NULL, dummy, dummy, dummy, shape, kv_end,
                                         pos, NULL, &with_sinks, dummy, dummy_lse);
    CHECK(st == TREEATTN_ERR_UNSUPPORTED || st == TREEATTN_ERR_CUDA,
          "forward with sinks without a GPU -> %d (%s): %s", st, treeattn_status_name(st),
          treeattn_last_error());
    CHECK(strstr(treeattn_last_error(), st == TREEATTN_ERR_UNSUPPORTED ? "built without CUDA"
                                                                      : "CUDA") != NULL,
          "forward with sinks: %s", treeattn_last_error());
    st = treeattn_cuda_attention_backward(TREEATTN_BF16, 0, NULL, dummy, dummy, dummy, shape,
                                          kv_end, pos, NULL, &with_sinks, dummy, dummy_lse, dummy, dummy,
                                          dummy, dummy, dummy);
    CHECK(st == TREEATTN_ERR_UNSUPPORTED || st == TREEATTN_ERR_CUDA,
          "backward with sinks and dsinks without a GPU -> %d (%s): %s", st,
          treeattn_status_name(st), treeattn_last_error());
    CHECK(strstr(treeattn_last_error(), st == TREEATTN_ERR_UNSUPPORTED ? "built without CUDA"
                                                                      : "CUDA") != NULL,
          "backward with sinks: %s", treeattn_last_error());
    /* params.deterministic = 1 reaches the backend too (the same clean
     * failure); 2 is refused by a library built with CUDA before any CUDA
     * work (one built without says so first). */
    TreeattnParams det = {0.0, 0, 0.0, 0, 0, 0.0, NULL, 1};
    st = treeattn_cuda_attention_backward(TREEATTN_BF16, 0, NULL, dummy, dummy, dummy, shape,
                                          kv_end, pos, NULL, &det, dummy, dummy_lse, dummy, dummy,
                                          dummy, dummy, NULL);
    CHECK(st == TREEATTN_ERR_UNSUPPORTED || st == TREEATTN_ERR_CUDA,
          "deterministic backward without a GPU -> %d (%s): %s", st, treeattn_status_name(st),
          treeattn_last_error());
    CHECK(strstr(treeattn_last_error(), st == TREEATTN_ERR_UNSUPPORTED ? "built without CUDA"
                                                                      : "CUDA") != NULL,
          "deterministic backward: %s", treeattn_last_error());
    int built = st == TREEATTN_ERR_CUDA;
    TreeattnParams bad_det = {0.0, 0, 0.0, 0, 0, 0.0, NULL, 2};
    st = treeattn_cuda_attention_backward(TREEATTN_BF16, 0, NULL, dummy, dummy, dummy, shape,
                                          kv_end, pos, NULL, &bad_det, dummy, dummy_lse, dummy, dummy,
                                          dummy, dummy, NULL);
    CHECK(st == TREEATTN_ERR_UNSUPPORTED &&
              strstr(treeattn_last_error(), built ? "deterministic" : "built without CUDA") != NULL,
          "deterministic = 2 -> %d (%s): %s", st, treeattn_status_name(st), treeattn_last_error());
    treeattn_pack_free(pack);
    if (require) {
      fprintf(stderr, "FAIL: --require-gpu and no usable GPU\n");
      return 1;
    }
    if (failures) return 1;
    printf("device C ABI checks passed (no GPU: error paths only)\n");
    return 0;
  }
  int dev;
  CUcontext ctx;
  CUstream stream;
  CU(cu.device_get(&dev, 0));
  CU(cu.primary_retain(&ctx, dev));
  CU(cu.ctx_set_current(ctx));
  CU(cu.stream_create(&stream, 1 /* CU_STREAM_NON_BLOCKING */));
  /* A library built without CUDA says so on the first call. */
  {
    char dummy[16];
    float dummy_lse[4];
    TreeattnShape empty = {0, 4, 2, 64, 0};
    int32_t st = treeattn_cuda_attention_forward(TREEATTN_BF16, 0, stream, dummy, dummy, dummy,
                                                 empty, kv_end, pos, NULL, NULL, dummy, dummy_lse);
    if (st == TREEATTN_ERR_UNSUPPORTED) {
      printf("the library was built without CUDA: %s\n", treeattn_last_error());
      treeattn_pack_free(pack);
      return require ? 1 : 0;
    }
  }
  attention_case(0, stream, kv_end, pos, L);
  attention_case(1, stream, kv_end, pos, L);
  sinks_case(0, stream, kv_end, pos, L);
  sinks_case(1, stream, kv_end, pos, L);
  sdcc_case(stream);
  CU(cu.stream_sync(stream));
  CU(cu.stream_destroy(stream));
  treeattn_pack_free(pack);
  if (failures) {
    fprintf(stderr, "%d device check(s) failed\n", failures);
    return 1;
  }
  printf("device C ABI checks passed (on the GPU, caller's stream)\n");
  return 0;
}
