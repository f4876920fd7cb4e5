/* Weight-only quantized products for CPUs with AVX2: y = x W^T with W kept in 4 or 8 bits.
 *
 * Python side: minisgl/extensions/quantization/gguf_cpu.py, which repacks GGUF blocks at
 * load time into the two layouts below (exactly: no value is rounded twice) and calls
 * `mm_q4` / `mm_q8` with raw pointers of contiguous torch tensors.
 *
 * Layouts, for W [N, K] (row n, input k), groups of 32 inputs (q4) or G in {16, 32} (q8):
 *   q4: codes uint8 [N, K/2], byte j of group g holds input 32g+j in its low nibble and
 *       32g+j+16 in its high one (llama.cpp's Q4_0 order); W = scale * code + offset with
 *       scale, offset [N, K/32] (Q4_0: offset = -8 scale; Q4_1: offset = m; Q4_K:
 *       scale = d * sc, offset = -dmin * m).
 *   q8: codes int8 [N, K], W = scale * code with scale [N, K/G] (Q8_0: G = 32; Q6_K:
 *       G = 16, code = q - 32).
 * Scales are fp16 where that is exact (Q4_0, Q4_1, Q8_0 store fp16) and fp32 otherwise.
 *
 * Each activation row is quantized per 32 inputs to int16 (x ~ d * q, |q| <= 32767), so a
 * group's product is an integer dot product (weights widened to int16, vpmaddwd) and one
 * multiply by the two scales. llama.cpp uses int8 activations (vpmaddubsw on bytes); int16
 * keeps the products within float32 rounding of the dequantized model's (int8 moved the
 * bundled model's top-1 token at ~3% of positions). Weights are read once per call for all
 * M rows.
 * Threads: OpenMP over output rows; torch's own libgomp (loaded first, same soname) is
 * the runtime, so torch.set_num_threads sets ours too.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define QK 32   /* activation (and q4 / Q8_0) group */
#define MB 4    /* activation rows per pass over a weight row */
#define QMAX 32767.f

typedef struct {
  int16_t *q;  /* [M, K] */
  float *d;    /* [M, K/32]: scale of each group */
  float *dsum; /* [M, K/32]: d * sum(q), for the offsets of 4-bit groups */
} ActQ;

static void quantize_acts(const float *x, int64_t M, int64_t K, ActQ a) {
  const int64_t G = K / QK;
  for (int64_t r = 0; r < M * G; r++) {
    const float *xs = x + r * QK;
    float amax = 0.f;
    for (int i = 0; i < QK; i++) amax = fmaxf(amax, fabsf(xs[i]));
    const float d = amax / QMAX, inv = amax > 0.f ? QMAX / amax : 0.f;
    int sum = 0;
    for (int i = 0; i < QK; i++) {
      const int v = (int)nearbyintf(xs[i] * inv);
      a.q[r * QK + i] = (int16_t)v;
      sum += v;
    }
    a.d[r] = d;
    a.dsum[r] = d * (float)sum;
  }
}

static inline float load_scale(const void *p, int64_t i, int half) {
  return half ? _cvtsh_ss(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

/* 16 weights widened to int16 times 16 int16 activations: 8 pair sums (int32). */
static inline __m256i dot16(__m128i w8, int is_signed, const int16_t *x) {
  const __m256i w = is_signed ? _mm256_cvtepi8_epi16(w8) : _mm256_cvtepu8_epi16(w8);
  return _mm256_madd_epi16(w, _mm256_loadu_si256((const __m256i *)x));
}

/* A 4-bit group's 16 bytes: inputs 0-15 (low nibbles) and 16-31 (high nibbles). */
static inline void unpack_q4(const uint8_t *p, __m128i *lo, __m128i *hi) {
  const __m128i raw = _mm_loadu_si128((const __m128i *)p);
  const __m128i m4 = _mm_set1_epi8(0x0F);
  *lo = _mm_and_si128(raw, m4);
  *hi = _mm_and_si128(_mm_srli_epi16(raw, 4), m4);
}

/* One 32-input group of a 4-bit row: the integer dot product as 8 float partial sums. */
static inline __m256 group_q4(const uint8_t *codes, const int16_t *x) {
  __m128i lo, hi;
  unpack_q4(codes, &lo, &hi);
  return _mm256_cvtepi32_ps(_mm256_add_epi32(dot16(lo, 0, x), dot16(hi, 0, x + 16)));
}

typedef struct {
  const uint8_t *codes;
  const void *scale;
  const void *offset; /* q4 only */
  int half;           /* scales stored as fp16 */
  int group;          /* q8: 16 or 32 */
} Weights;

/* One weight row against mb (a compile-time constant after inlining) activation rows, two
 * groups per step into separate accumulators: the FMA chains stay in registers and overlap. */
#define INLINE static inline __attribute__((always_inline))

INLINE void row_q4_mb(const Weights *w, int64_t n, const ActQ *a, int64_t m0, const int mb,
                      int64_t K, float *out, int64_t ldo) {
  const int64_t G = K / QK;
  const uint8_t *codes = w->codes + n * (K / 2);
  __m256 acc0[MB], acc1[MB];
  float off[MB];
  for (int i = 0; i < mb; i++) acc0[i] = acc1[i] = _mm256_setzero_ps(), off[i] = 0.f;
  int64_t g = 0;
  for (; g + 1 < G; g += 2) {
    const float s0 = load_scale(w->scale, n * G + g, w->half);
    const float s1 = load_scale(w->scale, n * G + g + 1, w->half);
    const float o0 = load_scale(w->offset, n * G + g, w->half);
    const float o1 = load_scale(w->offset, n * G + g + 1, w->half);
    for (int i = 0; i < mb; i++) {
      const int64_t r = (m0 + i) * G + g;
      const int16_t *x = a->q + r * QK;
      acc0[i] = _mm256_fmadd_ps(group_q4(codes + g * 16, x), _mm256_set1_ps(s0 * a->d[r]), acc0[i]);
      acc1[i] = _mm256_fmadd_ps(group_q4(codes + g * 16 + 16, x + QK),
                                _mm256_set1_ps(s1 * a->d[r + 1]), acc1[i]);
      off[i] += o0 * a->dsum[r] + o1 * a->dsum[r + 1];
    }
  }
  for (; g < G; g++) {
    const float s0 = load_scale(w->scale, n * G + g, w->half);
    const float o0 = load_scale(w->offset, n * G + g, w->half);
    for (int i = 0; i < mb; i++) {
      const int64_t r = (m0 + i) * G + g;
      acc0[i] = _mm256_fmadd_ps(group_q4(codes + g * 16, a->q + r * QK), _mm256_set1_ps(s0 * a->d[r]),
                                acc0[i]);
      off[i] += o0 * a->dsum[r];
    }
  }
  for (int i = 0; i < mb; i++) out[(m0 + i) * ldo + n] = hsum(_mm256_add_ps(acc0[i], acc1[i])) + off[i];
}

/* One 32-input group of an 8-bit row: 16 inputs per half, each half with its scale. */
INLINE __m256 group_q8(const int8_t *codes, const int16_t *x, __m256 s_lo, __m256 s_hi,
                       __m256 acc) {
  const __m128i lo = _mm_loadu_si128((const __m128i *)codes);
  const __m128i hi = _mm_loadu_si128((const __m128i *)(codes + 16));
  acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot16(lo, 1, x)), s_lo, acc);
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot16(hi, 1, x + 16)), s_hi, acc);
}

INLINE void row_q8_mb(const Weights *w, int64_t n, const ActQ *a, int64_t m0, const int mb,
                      int64_t K, float *out, int64_t ldo) {
  const int64_t G = K / QK;
  const int per = QK / w->group; /* weight scales per activation group: 1 or 2 */
  const int8_t *codes = (const int8_t *)w->codes + n * K;
  const int64_t srow = n * (K / w->group);
  __m256 acc0[MB], acc1[MB];
  for (int i = 0; i < mb; i++) acc0[i] = acc1[i] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; g++) {
    const float s_lo = load_scale(w->scale, srow + per * g, w->half);
    const float s_hi = per == 1 ? s_lo : load_scale(w->scale, srow + per * g + 1, w->half);
    for (int i = 0; i < mb; i++) {
      const int64_t r = (m0 + i) * G + g;
      const __m256 d = _mm256_set1_ps(a->d[r]);
      __m256 *acc = (g & 1) ? &acc1[i] : &acc0[i];
      *acc = group_q8(codes + g * QK, a->q + r * QK, _mm256_mul_ps(d, _mm256_set1_ps(s_lo)),
                      _mm256_mul_ps(d, _mm256_set1_ps(s_hi)), *acc);
    }
  }
  for (int i = 0; i < mb; i++) out[(m0 + i) * ldo + n] = hsum(_mm256_add_ps(acc0[i], acc1[i]));
}

/* Dispatch on the number of activation rows so that each body is compiled for a constant. */
#define BY_MB(NAME, IMPL)                                                                   \
  static void NAME(const Weights *w, int64_t n, const ActQ *a, int64_t m0, int mb, int64_t K, \
                   float *out, int64_t ldo) {                                                \
    switch (mb) {                                                                            \
      case 1: IMPL(w, n, a, m0, 1, K, out, ldo); break;                                      \
      case 2: IMPL(w, n, a, m0, 2, K, out, ldo); break;                                      \
      case 3: IMPL(w, n, a, m0, 3, K, out, ldo); break;                                      \
      default: IMPL(w, n, a, m0, 4, K, out, ldo); break;                                     \
    }                                                                                        \
  }
BY_MB(row_q4, row_q4_mb)
BY_MB(row_q8, row_q8_mb)

typedef void (*RowFn)(const Weights *, int64_t, const ActQ *, int64_t, int, int64_t, float *,
                      int64_t);

static int run(RowFn fn, const Weights *w, const float *x, int64_t M, int64_t K, int64_t N,
               float *out, int64_t ldo) {
  const int64_t G = K / QK;
  ActQ a = {malloc(sizeof(int16_t) * (size_t)(M * K)), malloc(sizeof(float) * (size_t)(M * G)),
            malloc(sizeof(float) * (size_t)(M * G))};
  if (!a.q || !a.d || !a.dsum) {
    free(a.q), free(a.d), free(a.dsum);
    return -1;
  }
  quantize_acts(x, M, K, a);
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; n++)
    for (int64_t m0 = 0; m0 < M; m0 += MB) fn(w, n, &a, m0, (int)(M - m0 < MB ? M - m0 : MB), K,
                                              out, ldo);
  free(a.q), free(a.d), free(a.dsum);
  return 0;
}

/* mm_q4(x, M, K, codes, scale, offset, half, N, out, ldo): out[m, n] (row stride ldo). */
static PyObject *mm_q4(PyObject *self, PyObject *args) {
  Py_ssize_t x, M, K, codes, scale, offset, half, N, out, ldo;
  if (!PyArg_ParseTuple(args, "nnnnnnnnnn", &x, &M, &K, &codes, &scale, &offset, &half, &N,
                        &out, &ldo))
    return NULL;
  Weights w = {(const uint8_t *)codes, (const void *)scale, (const void *)offset, (int)half, QK};
  int rc;
  Py_BEGIN_ALLOW_THREADS rc = run(row_q4, &w, (const float *)x, M, K, N, (float *)out, ldo);
  Py_END_ALLOW_THREADS if (rc) return PyErr_NoMemory();
  Py_RETURN_NONE;
}

/* mm_q8(x, M, K, codes, scale, half, group, N, out, ldo). */
static PyObject *mm_q8(PyObject *self, PyObject *args) {
  Py_ssize_t x, M, K, codes, scale, half, group, N, out, ldo;
  if (!PyArg_ParseTuple(args, "nnnnnnnnnn", &x, &M, &K, &codes, &scale, &half, &group, &N, &out,
                        &ldo))
    return NULL;
  Weights w = {(const uint8_t *)codes, (const void *)scale, NULL, (int)half, (int)group};
  int rc;
  Py_BEGIN_ALLOW_THREADS rc = run(row_q8, &w, (const float *)x, M, K, N, (float *)out, ldo);
  Py_END_ALLOW_THREADS if (rc) return PyErr_NoMemory();
  Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"mm_q4", mm_q4, METH_VARARGS, "4-bit weights (see gguf_cpu.c)"},
    {"mm_q8", mm_q8, METH_VARARGS, "8-bit weights (see gguf_cpu.c)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_gguf_cpu", NULL, -1, methods};

PyMODINIT_FUNC PyInit__gguf_cpu(void) { return PyModule_Create(&module); }
