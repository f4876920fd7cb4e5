/* Quantized products of several activation rows (a server's concurrent decode steps) on
 * AVX-512: float32 weight tiles dequantized into L1 and multiplied with float32 activations.
 *
 * The integer kernels of cpu_kernels.c pay, per 32-input group and activation row, two
 * vpmaddwd, an add, a convert and an FMA: their cost grows with the rows. Here a tile of
 * NR weight rows by TILE_K inputs is dequantized once (scale * code + offset, rounded as
 * the `dequant` kernel and gguf-py round it) and every activation row is multiplied with it
 * by plain FMAs, 16 rows to a register: out^T[n, m] += W[n, k] * x^T[k, m], the weight
 * broadcast, the activations transposed once per call (x^T [K, 16 MV], zero-padded rows).
 * The dequantization is shared by all rows; per row and 32 inputs the work is two FMAs.
 * The activations stay float32 (no int16 step): the products are the dequantized model's
 * up to float32 summation order.
 *
 * Compiled for AVX-512 by function attribute; callers check `tile_supported` first.
 */
#include "cpu_kernels.h"

#include <immintrin.h>
#include <stdlib.h>
#include <string.h>

#define TILE_K 128 /* inputs per dequantized tile */
#define NR_MAX 24  /* weight rows per tile */
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))
#define INLINE static inline __attribute__((always_inline))

int tile_supported(void) {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
}

/* n scales (n <= 8) from index i on, as floats. */
AVX512 INLINE void scales_at(const void *p, int64_t i, int n, int half, float *out) {
  const uint16_t *h = (const uint16_t *)p + i;
  const float *f = (const float *)p + i;
  if (half && n == 8) {
    _mm256_storeu_ps(out, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h)));
    return;
  }
  for (int j = 0; j < n; j++) out[j] = half ? _cvtsh_ss(h[j]) : f[j];
}

/* The bytes [p + a, p + b) towards L1 (a prefetch never faults: past the end is harmless). */
static inline void prefetch_range(const void *p, int64_t a, int64_t b) {
  for (int64_t i = a & ~63; i < b; i += 64) _mm_prefetch((const char *)p + i, _MM_HINT_T0);
}

/* Ask for what dequant_row(row n + NR, same inputs) will read: the next tile's rows stream
 * from L3 (a model's weights do not stay in L2), too scattered for the hardware prefetcher. */
static void prefetch_row(const Weights *w, int four_bit, int64_t K, int64_t n, int64_t k0,
                         int64_t kb) {
  const int64_t sz = w->half ? 2 : 4;
  if (four_bit) {
    prefetch_range(w->codes, n * (K / 2) + k0 / 2, n * (K / 2) + (k0 + kb) / 2);
    const int64_t i = n * (K / 32) + k0 / 32;
    prefetch_range(w->scale, i * sz, (i + kb / 32) * sz);
    prefetch_range(w->offset, i * sz, (i + kb / 32) * sz);
    return;
  }
  prefetch_range(w->codes, n * K + k0, n * K + k0 + kb);
  prefetch_range(w->scale, (n * K + k0) / w->group * sz, (n * K + k0 + kb) / w->group * sz);
}

/* Weight row n, inputs [k0, k0 + kb) (kb <= TILE_K, whole 32-input groups), as float32 into
 * t: scale * code + offset, each rounded (the `dequant` kernel's values). */
AVX512 static void dequant_row(const Weights *w, int four_bit, int64_t K, int64_t n, int64_t k0,
                               int64_t kb, float *t) {
  float sc[8], off[8];
  if (four_bit) {
    const int64_t G = K / 32, i = n * G + k0 / 32;
    const int ng = (int)(kb / 32);
    const uint8_t *c = w->codes + n * (K / 2) + k0 / 2;
    scales_at(w->scale, i, ng, w->half, sc);
    scales_at(w->offset, i, ng, w->half, off);
    /* A group's 16 values scale * code + offset as a table, looked up by code (vpermps reads
     * an index's low 4 bits: no masking of the nibbles). */
    const __m512 codes16 = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int g = 0; g < ng; g++) {
      const __m512 lut = _mm512_add_ps(_mm512_mul_ps(codes16, _mm512_set1_ps(sc[g])),
                                       _mm512_set1_ps(off[g]));
      const __m128i raw = _mm_loadu_si128((const __m128i *)(c + g * 16));
      const __m512i lo = _mm512_cvtepu8_epi32(raw);
      const __m512i hi = _mm512_cvtepu8_epi32(_mm_srli_epi16(raw, 4));
      _mm512_store_ps(t + g * 32, _mm512_permutexvar_ps(lo, lut));
      _mm512_store_ps(t + g * 32 + 16, _mm512_permutexvar_ps(hi, lut));
    }
    return;
  }
  const int per = w->group == 16 ? 1 : 2; /* 16-input runs per scale */
  const int ns = (int)(kb / 16 / per);
  const int8_t *c = (const int8_t *)w->codes + n * K + k0;
  scales_at(w->scale, (n * K + k0) / w->group, ns, w->half, sc);
  for (int h = 0; h < (int)(kb / 16); h++) {
    const __m128i codes = _mm_loadu_si128((const __m128i *)(c + 16 * h));
    const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(codes));
    _mm512_store_ps(t + 16 * h, _mm512_mul_ps(v, _mm512_set1_ps(sc[per == 1 ? h : h / 2])));
  }
}

/* Output rows [n0, n0 + nr) (nr <= NR; the tile's other rows are zeros) for every
 * activation row: MV vectors of 16 rows each, NR * MV accumulators in registers. */
AVX512 INLINE void tile_block(const Weights *w, int four_bit, const float *xt, int64_t M,
                              int64_t K, int64_t n0, int nr, float *out, int64_t ldo, float *t,
                              const int MV, const int NR) {
  __m512 acc[NR_MAX]; /* NR * MV of them: fixed sizes, so that they live in registers */
#pragma GCC unroll 32
  for (int j = 0; j < NR * MV; j++) acc[j] = _mm512_setzero_ps();
  for (int64_t k0 = 0; k0 < K; k0 += TILE_K) {
    const int64_t kb = K - k0 < TILE_K ? K - k0 : TILE_K;
    for (int j = 0; j < nr; j++) {
      prefetch_row(w, four_bit, K, n0 + j + NR, k0, kb);
      dequant_row(w, four_bit, K, n0 + j, k0, kb, t + j * TILE_K);
    }
    for (int j = nr; j < NR; j++) memset(t + j * TILE_K, 0, sizeof(float) * TILE_K);
    const float *xk = xt + k0 * 16 * MV;
    for (int64_t kk = 0; kk < kb; kk++, xk += 16 * MV) {
      __m512 xv[2];
#pragma GCC unroll 4
      for (int v = 0; v < MV; v++) xv[v] = _mm512_load_ps(xk + 16 * v);
#pragma GCC unroll 32
      for (int j = 0; j < NR; j++) {
        const __m512 b = _mm512_set1_ps(t[j * TILE_K + kk]);
#pragma GCC unroll 4
        for (int v = 0; v < MV; v++) acc[j * MV + v] = _mm512_fmadd_ps(b, xv[v], acc[j * MV + v]);
      }
    }
  }
  float col[32] __attribute__((aligned(64)));
  for (int j = 0; j < nr; j++) {
    for (int v = 0; v < MV; v++) _mm512_store_ps(col + 16 * v, acc[j * MV + v]);
    for (int64_t m = 0; m < M; m++) out[m * ldo + n0 + j] = col[m];
  }
}

AVX512 static void block_mv1(const Weights *w, int fb, const float *xt, int64_t M, int64_t K,
                             int64_t n0, int nr, float *out, int64_t ldo, float *t) {
  tile_block(w, fb, xt, M, K, n0, nr, out, ldo, t, 1, 24);
}

AVX512 static void block_mv2(const Weights *w, int fb, const float *xt, int64_t M, int64_t K,
                             int64_t n0, int nr, float *out, int64_t ldo, float *t) {
  tile_block(w, fb, xt, M, K, n0, nr, out, ldo, t, 2, 12);
}

/* out[m, n] (row stride ldo) = x[m, :] W[n, :] for m < M <= 32; -1 when out of memory. */
AVX512 static int tile_mm32(const Weights *w, int four_bit, const float *x, int64_t M, int64_t K,
                            int64_t N, float *out, int64_t ldo) {
  const int MV = M > 16 ? 2 : 1, NR = MV == 1 ? 24 : 12;
  const int64_t ld = 16 * MV;
  float *xt = aligned_alloc(64, sizeof(float) * (size_t)(K * ld));
  if (!xt) return -1;
  memset(xt, 0, sizeof(float) * (size_t)(K * ld));
  for (int64_t m = 0; m < M; m++)
    for (int64_t k = 0; k < K; k++) xt[k * ld + m] = x[m * K + k];
  const int64_t blocks = (N + NR - 1) / NR;
#pragma omp parallel
  {
    float t[NR_MAX * TILE_K] __attribute__((aligned(64)));
#pragma omp for schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
      const int64_t n0 = b * NR;
      const int nr = (int)(N - n0 < NR ? N - n0 : NR);
      (MV == 1 ? block_mv1 : block_mv2)(w, four_bit, xt, M, K, n0, nr, out, ldo, t);
    }
  }
  free(xt);
  return 0;
}

int tile_mm(const Weights *w, int four_bit, const float *x, int64_t M, int64_t K, int64_t N,
            float *out, int64_t ldo) {
  for (int64_t m0 = 0; m0 < M; m0 += 32) {
    const int64_t mb = M - m0 < 32 ? M - m0 : 32;
    if (tile_mm32(w, four_bit, x + m0 * K, mb, K, N, out + m0 * ldo, ldo)) return -1;
  }
  return 0;
}
