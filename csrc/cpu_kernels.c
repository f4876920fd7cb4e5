/* CPU kernels (AVX2), called with raw pointers of contiguous torch tensors through
 * minisgl/kernels/cpu.py: weight-only quantized products, and the fused RMSNorm, RoPE and
 * decode attention of the float32 CPU path (one call where torch runs 8 to 15 ops, which at
 * batch 1 cost more than their arithmetic).
 *
 * 1. Quantized products y = x W^T with W kept in 4 or 8 bits. The GGUF method
 * (minisgl/extensions/quantization/gguf.py) repacks GGUF blocks at load time into the two
 * layouts below (exactly: no value is rounded twice) and calls `mm`.
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
#include "cpu_kernels.h"

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define QK 32   /* activation (and q4 / Q8_0) group */
#define MB 4    /* activation rows per pass over a weight row */
#define QMAX 32767.f
#define PREFETCH_ROWS 8

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


/* One weight row against mb (a compile-time constant after inlining) activation rows, two
 * groups per step into separate accumulators: the FMA chains stay in registers and overlap. */
#define INLINE static inline __attribute__((always_inline))

/* Eight scales from index i on, as floats. */
INLINE __m256 load8_scales(const void *p, int64_t i, int half) {
  return half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)))
              : _mm256_loadu_ps((const float *)p + i);
}

/* Before a row's groups: comb[g] = scale[n, g] * d[g] for each of its G groups, and the
 * row's whole offset term, sum_g offset[n, g] * d[g] * sum(q of group g); 8 groups at once,
 * so the loop over groups is left with the integer dot product and one FMA. */
INLINE float q4_row_scales(const Weights *w, int64_t row0, int64_t G, const float *d,
                           const float *dsum, float *comb) {
  __m256 off = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 8 <= G; g += 8) {
    _mm256_storeu_ps(comb + g, _mm256_mul_ps(load8_scales(w->scale, row0 + g, w->half),
                                             _mm256_loadu_ps(d + g)));
    off = _mm256_fmadd_ps(load8_scales(w->offset, row0 + g, w->half), _mm256_loadu_ps(dsum + g),
                          off);
  }
  float tail = 0.f;
  for (; g < G; g++) {
    comb[g] = load_scale(w->scale, row0 + g, w->half) * d[g];
    tail += load_scale(w->offset, row0 + g, w->half) * dsum[g];
  }
  return hsum(off) + tail;
}

INLINE void row_q4_mb(const Weights *w, int64_t n, const ActQ *a, int64_t m0, const int mb,
                      int64_t K, float *out, int64_t ldo) {
  const int64_t G = K / QK;
  const uint8_t *codes = w->codes + n * (K / 2);
  float comb[MB * G];
  __m256 acc0[MB], acc1[MB];
  float off[MB];
  for (int i = 0; i < mb; i++) {
    const int64_t r = (m0 + i) * G;
    off[i] = q4_row_scales(w, n * G, G, a->d + r, a->dsum + r, comb + i * G);
    acc0[i] = acc1[i] = _mm256_setzero_ps();
  }
  int64_t g = 0;
  for (; g + 1 < G; g += 2) {
    for (int i = 0; i < mb; i++) {
      const int16_t *x = a->q + ((m0 + i) * G + g) * QK;
      const float *c = comb + i * G + g;
      acc0[i] = _mm256_fmadd_ps(group_q4(codes + g * 16, x), _mm256_broadcast_ss(c), acc0[i]);
      acc1[i] = _mm256_fmadd_ps(group_q4(codes + g * 16 + 16, x + QK), _mm256_broadcast_ss(c + 1),
                                acc1[i]);
    }
  }
  for (; g < G; g++) {
    for (int i = 0; i < mb; i++) {
      const int16_t *x = a->q + ((m0 + i) * G + g) * QK;
      acc0[i] = _mm256_fmadd_ps(group_q4(codes + g * 16, x), _mm256_broadcast_ss(comb + i * G + g),
                                acc0[i]);
    }
  }
  for (int i = 0; i < mb; i++) out[(m0 + i) * ldo + n] = hsum(_mm256_add_ps(acc0[i], acc1[i])) + off[i];
}

/* 32 int8 weights times 32 int16 activations: 8 int32 partial sums. */
INLINE __m256i dot32_q8(const int8_t *codes, const int16_t *x) {
  const __m128i lo = _mm_loadu_si128((const __m128i *)codes);
  const __m128i hi = _mm_loadu_si128((const __m128i *)(codes + 16));
  return _mm256_add_epi32(dot16(lo, 1, x), dot16(hi, 1, x + 16));
}

/* Before a row's groups: comb[h] = its weight scale times its activation group's d, for each
 * of the row's scales (G of them for Q8_0, 2G for Q6_K's 16-input scales); 8 at once. */
INLINE void q8_row_scales(const Weights *w, int64_t srow, int64_t G, const float *d,
                          float *comb) {
  int64_t h = 0;
  if (w->group == QK) {
    for (; h + 8 <= G; h += 8)
      _mm256_storeu_ps(comb + h, _mm256_mul_ps(load8_scales(w->scale, srow + h, w->half),
                                               _mm256_loadu_ps(d + h)));
    for (; h < G; h++) comb[h] = load_scale(w->scale, srow + h, w->half) * d[h];
    return;
  }
  for (; h + 8 <= 2 * G; h += 8) { /* d of groups h/2 .. h/2 + 3, each twice */
    const __m128 d4 = _mm_loadu_ps(d + h / 2);
    const __m256 dd = _mm256_set_m128(_mm_unpackhi_ps(d4, d4), _mm_unpacklo_ps(d4, d4));
    _mm256_storeu_ps(comb + h, _mm256_mul_ps(load8_scales(w->scale, srow + h, w->half), dd));
  }
  for (; h < 2 * G; h++) comb[h] = load_scale(w->scale, srow + h, w->half) * d[h / 2];
}

/* An 8-bit row: Q8_0 (one scale per 32 inputs) as one integer dot product and one FMA per
 * group; Q6_K (a scale per 16) as two, one per half. */
INLINE void row_q8_mb(const Weights *w, int64_t n, const ActQ *a, int64_t m0, const int mb,
                      int64_t K, float *out, int64_t ldo) {
  const int64_t G = K / QK;
  const int per = QK / w->group; /* weight scales per activation group: 1 or 2 */
  const int8_t *codes = (const int8_t *)w->codes + n * K;
  float comb[MB * 2 * G];
  __m256 acc0[MB], acc1[MB];
  for (int i = 0; i < mb; i++) {
    q8_row_scales(w, n * per * G, G, a->d + (m0 + i) * G, comb + i * per * G);
    acc0[i] = acc1[i] = _mm256_setzero_ps();
  }
  if (per == 1) {
    int64_t g = 0;
    for (; g + 1 < G; g += 2) {
      for (int i = 0; i < mb; i++) {
        const int16_t *x = a->q + ((m0 + i) * G + g) * QK;
        const float *c = comb + i * G + g;
        acc0[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot32_q8(codes + g * QK, x)),
                                  _mm256_broadcast_ss(c), acc0[i]);
        acc1[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot32_q8(codes + g * QK + QK, x + QK)),
                                  _mm256_broadcast_ss(c + 1), acc1[i]);
      }
    }
    for (; g < G; g++) {
      for (int i = 0; i < mb; i++) {
        const int16_t *x = a->q + ((m0 + i) * G + g) * QK;
        acc0[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot32_q8(codes + g * QK, x)),
                                  _mm256_broadcast_ss(comb + i * G + g), acc0[i]);
      }
    }
  } else {
    for (int64_t g = 0; g < G; g++) {
      const __m128i lo = _mm_loadu_si128((const __m128i *)(codes + g * QK));
      const __m128i hi = _mm_loadu_si128((const __m128i *)(codes + g * QK + 16));
      for (int i = 0; i < mb; i++) {
        const int16_t *x = a->q + ((m0 + i) * G + g) * QK;
        const float *c = comb + i * 2 * G + 2 * g;
        acc0[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot16(lo, 1, x)), _mm256_broadcast_ss(c),
                                  acc0[i]);
        acc1[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot16(hi, 1, x + 16)),
                                  _mm256_broadcast_ss(c + 1), acc1[i]);
      }
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
  /* Rows stream from memory once per call (too few, too short for the hardware prefetcher
   * to run ahead of the arithmetic): fetch a few rows ahead by hand. */
  const int64_t row_bytes = fn == row_q4 ? K / 2 : K, scale_bytes = (w->half ? 2 : 4) * G;
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; n++) {
    if (n + PREFETCH_ROWS < N) {
      const char *next = (const char *)w->codes + (n + PREFETCH_ROWS) * row_bytes;
      for (int64_t off = 0; off < row_bytes; off += 64) _mm_prefetch(next + off, _MM_HINT_T0);
      _mm_prefetch((const char *)w->scale + (n + PREFETCH_ROWS) * scale_bytes, _MM_HINT_T0);
      if (w->offset)
        _mm_prefetch((const char *)w->offset + (n + PREFETCH_ROWS) * scale_bytes, _MM_HINT_T0);
    }
    for (int64_t m0 = 0; m0 < M; m0 += MB) fn(w, n, &a, m0, (int)(M - m0 < MB ? M - m0 : MB), K,
                                              out, ldo);
  }
  free(a.q), free(a.d), free(a.dsum);
  return 0;
}

static int tile_ok = -1; /* the CPU runs cpu_tile.c's kernels; -1: not yet asked */

int quant_mm(const Weights *w, int four_bit, const float *x, int64_t M, int64_t K, int64_t N,
             float *out, int64_t ldo, int64_t tile_rows) {
  if (tile_rows > 0 && M >= tile_rows) {
    if (tile_ok < 0) tile_ok = tile_supported();
    if (tile_ok) return tile_mm(w, four_bit, x, M, K, N, out, ldo);
  }
  return run(four_bit ? row_q4 : row_q8, w, x, M, K, N, out, ldo);
}

/* mm(codes, scale, offset, half, group, N, ldo, x, M, K, out, tile_rows): out[m, n] (row
 * stride ldo) for a 4-bit (group 0; offset: its offsets) or 8-bit (group 16 or 32; offset
 * unused) weight; float32 tiles from tile_rows rows on (0: never). The weight's arguments
 * come first: the caller binds them once (functools.partial). */
static PyObject *mm(PyObject *self, PyObject *args) {
  Py_ssize_t codes, scale, offset, half, group, N, ldo, x, M, K, out, tile_rows;
  if (!PyArg_ParseTuple(args, "nnnnnnnnnnnn", &codes, &scale, &offset, &half, &group, &N, &ldo,
                        &x, &M, &K, &out, &tile_rows))
    return NULL;
  Weights w = {(const uint8_t *)codes, (const void *)scale, group ? NULL : (const void *)offset,
               (int)half, group ? (int)group : QK};
  int rc;
  Py_BEGIN_ALLOW_THREADS rc = quant_mm(&w, !group, (const float *)x, M, K, N, (float *)out, ldo,
                                       tile_rows);
  Py_END_ALLOW_THREADS if (rc) return PyErr_NoMemory();
  Py_RETURN_NONE;
}

/* dequant(codes, scale, offset, half, group, n0, n1, K, out): rows [n0, n1) of the weight
 * as float32 [n1 - n0, K] (scale * code + offset, each rounded as gguf-py rounds them), for
 * products of many rows, which torch's GEMM then runs faster than the integer kernels. */
static PyObject *dequant(PyObject *self, PyObject *args) {
  Py_ssize_t codes, scale, offset, half, group, n0, n1, K, out;
  if (!PyArg_ParseTuple(args, "nnnnnnnnn", &codes, &scale, &offset, &half, &group, &n0, &n1, &K,
                        &out))
    return NULL;
  Py_BEGIN_ALLOW_THREADS
  const int64_t per = group ? group : QK, G = K / per;
#pragma omp parallel for schedule(static)
  for (int64_t n = n0; n < n1; n++) {
    float *o = (float *)out + (n - n0) * K;
    for (int64_t g = 0; g < G; g++) {
      const float sc = load_scale((const void *)scale, n * G + g, (int)half);
      if (!group) {
        const float off = load_scale((const void *)offset, n * G + g, (int)half);
        const uint8_t *c = (const uint8_t *)codes + n * (K / 2) + g * 16;
        for (int j = 0; j < 16; j++) {
          o[g * QK + j] = sc * (float)(c[j] & 15) + off;
          o[g * QK + j + 16] = sc * (float)(c[j] >> 4) + off;
        }
      } else {
        const int8_t *c = (const int8_t *)codes + n * K + g * per;
        for (int64_t j = 0; j < per; j++) o[g * per + j] = sc * (float)c[j];
      }
    }
  }
  Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

/* 2. The float32 CPU path's fused ops. */

/* sum = x + residual (residual may be NULL: sum = x); out = weight * (sum * rsqrt(mean(sum^2)
 * + eps)), per row of H: torch's RMSNorm of the sum, in its order of operations. */
void add_rms_norm(const float *x, const float *res, const float *w, float eps, int64_t T,
                         int64_t H, float *out, float *sum) {
#pragma omp parallel for schedule(static) if (T > 4)
  for (int64_t t = 0; t < T; t++) {
    const float *xr = x + t * H;
    float *sr = sum + t * H, *o = out + t * H;
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < H; i++) {
      const float v = res ? xr[i] + res[t * H + i] : xr[i];
      sr[i] = v;
      ss += v * v;
    }
    const float r = 1.f / sqrtf(ss / (float)H + eps);
#pragma omp simd
    for (int64_t i = 0; i < H; i++) o[i] = w[i] * (sr[i] * r);
  }
}

/* Rotate heads [h0, h1) of every token in place (rotate-half RoPE, HF's order): x * cos +
 * cat(-x2, x1) * sin, each product rounded before the sum as torch computes it. */
void rope(float *base, int64_t T, int64_t stride, int64_t h0, int64_t h1, int64_t D,
                 const int64_t *pos, const float *cos_t, const float *sin_t) {
  const int64_t half = D / 2;
#pragma omp parallel for schedule(static) if (T > 4)
  for (int64_t t = 0; t < T; t++) {
    const float *c = cos_t + pos[t] * D, *sn = sin_t + pos[t] * D;
    for (int64_t h = h0; h < h1; h++) {
      float *x = base + t * stride + h * D;
      for (int64_t i = 0; i < half; i++) {
        const float x1 = x[i], x2 = x[i + half];
        const float a = x1 * c[i], b = -x2 * sn[i];
        const float e = x2 * c[i + half], f = x1 * sn[i + half];
        x[i] = a + b;
        x[i + half] = e + f;
      }
    }
  }
}

static inline float dot_f32(const float *a, const float *b, int64_t D) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= D; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float s = hsum(acc);
  for (; i < D; i++) s += a[i] * b[i];
  return s;
}

static inline void axpy_f32(float p, const float *x, float *y, int64_t D) {
  const __m256 pv = _mm256_set1_ps(p);
  int64_t i = 0;
  for (; i + 8 <= D; i += 8)
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(pv, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  for (; i < D; i++) y[i] += p * x[i];
}

/* One query row per request: out[b, h] = softmax(scale * q k^T) v over the request's
 * seq_lens[b] cached tokens, found through kv_index[b, :] (slot of each position). */
void decode_attention(const float *q, float *kc, float *vc, const int64_t *kv_index,
                             int64_t kv_stride, const int64_t *seq_lens, float scale, int64_t B,
                             int64_t Hq, int64_t Hk, int64_t D, float *out, const float *k_new,
                             const float *v_new, const int64_t *new_slots) {
  const int64_t group = Hq / Hk;
  /* This step's K/V first (one row per request, [B, Hk, D]): the attention reads them. */
  for (int64_t b = 0; new_slots && b < B; b++) {
    memcpy(kc + new_slots[b] * Hk * D, k_new + b * Hk * D, sizeof(float) * (size_t)(Hk * D));
    memcpy(vc + new_slots[b] * Hk * D, v_new + b * Hk * D, sizeof(float) * (size_t)(Hk * D));
  }
#pragma omp parallel for schedule(static)
  for (int64_t bh = 0; bh < B * Hq; bh++) {
    const int64_t b = bh / Hq, h = bh % Hq, hk = h / group, n = seq_lens[b];
    const float *qr = q + bh * D;
    const int64_t *slots = kv_index + b * kv_stride;
    float *o = out + bh * D;
    float stack[4096];
    float *scores = n <= 4096 ? stack : malloc(sizeof(float) * (size_t)n);
    for (int64_t i = 0; i < D; i++) o[i] = 0.f;
    if (!scores) continue; /* out of memory: the row stays zero */
    float mx = -INFINITY;
    for (int64_t t = 0; t < n; t++) {
      scores[t] = dot_f32(qr, kc + (slots[t] * Hk + hk) * D, D) * scale;
      mx = fmaxf(mx, scores[t]);
    }
    float denom = 0.f;
    for (int64_t t = 0; t < n; t++) {
      const float p = expf(scores[t] - mx);
      denom += p;
      axpy_f32(p, vc + (slots[t] * Hk + hk) * D, o, D);
    }
    const float inv = denom > 0.f ? 1.f / denom : 0.f;
    for (int64_t i = 0; i < D; i++) o[i] *= inv;
    if (scores != stack) free(scores);
  }
}

static PyObject *py_add_rms_norm(PyObject *self, PyObject *args) {
  Py_ssize_t x, res, w, T, H, out, sum;
  float eps;
  if (!PyArg_ParseTuple(args, "nnnfnnnn", &x, &res, &w, &eps, &T, &H, &out, &sum)) return NULL;
  Py_BEGIN_ALLOW_THREADS add_rms_norm((const float *)x, (const float *)res, (const float *)w, eps,
                                      T, H, (float *)out, (float *)sum);
  Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

static PyObject *py_rope(PyObject *self, PyObject *args) {
  Py_ssize_t base, T, stride, h0, h1, D, pos, cos_t, sin_t;
  if (!PyArg_ParseTuple(args, "nnnnnnnnn", &base, &T, &stride, &h0, &h1, &D, &pos, &cos_t,
                        &sin_t))
    return NULL;
  Py_BEGIN_ALLOW_THREADS rope((float *)base, T, stride, h0, h1, D, (const int64_t *)pos,
                              (const float *)cos_t, (const float *)sin_t);
  Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

static PyObject *py_decode_attention(PyObject *self, PyObject *args) {
  Py_ssize_t q, kc, vc, idx, stride, lens, B, Hq, Hk, D, out, k_new, v_new, slots;
  float scale;
  if (!PyArg_ParseTuple(args, "nnnnnnfnnnnnnnn", &q, &kc, &vc, &idx, &stride, &lens, &scale, &B,
                        &Hq, &Hk, &D, &out, &k_new, &v_new, &slots))
    return NULL;
  Py_BEGIN_ALLOW_THREADS decode_attention((const float *)q, (float *)kc, (float *)vc,
                                          (const int64_t *)idx, stride, (const int64_t *)lens,
                                          scale, B, Hq, Hk, D, (float *)out, (const float *)k_new,
                                          (const float *)v_new, (const int64_t *)slots);
  Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"mm", mm, METH_VARARGS, "x W^T for a 4- or 8-bit weight (see cpu_kernels.c)"},
    {"dequant", dequant, METH_VARARGS, "rows of a 4- or 8-bit weight as float32"},
    {"add_rms_norm", py_add_rms_norm, METH_VARARGS, "fused residual add + RMSNorm"},
    {"rope", py_rope, METH_VARARGS, "rotate-half RoPE in place"},
    {"decode_attention", py_decode_attention, METH_VARARGS, "one query row per request"},
    {"stack_new", py_stack_new, METH_VARARGS, "a decoder stack's plan (cpu_stack.c)"},
    {"stack_set_layer", py_stack_set_layer, METH_VARARGS, "one layer of a stack's plan"},
    {"stack_forward", py_stack_forward, METH_VARARGS, "decode rows through the stack"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cpu", NULL, -1, methods};

PyMODINIT_FUNC PyInit__cpu(void) { return PyModule_Create(&module); }
