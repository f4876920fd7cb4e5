/* What csrc/cpu_kernels.c shares with csrc/cpu_stack.c (one extension, minisgl.kernels._cpu). */
#ifndef MINISGL_CPU_KERNELS_H
#define MINISGL_CPU_KERNELS_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#define HIDDEN __attribute__((visibility("hidden")))

/* A 4-bit (group 0 at the call, QK in the struct) or 8-bit (group 16 or 32) weight. */
typedef struct {
  const uint8_t *codes;
  const void *scale;
  const void *offset; /* q4 only */
  int half;           /* scales stored as fp16 */
  int group;          /* q8: 16 or 32 */
} Weights;

/* out[m, n] (row stride ldo) = x[m, :] W[n, :] for n < N; -1 when out of memory. From
 * tile_rows rows on (0: never), on AVX-512 CPUs, the float32 tiles of cpu_tile.c. */
HIDDEN int quant_mm(const Weights *w, int four_bit, const float *x, int64_t M, int64_t K,
                    int64_t N, float *out, int64_t ldo, int64_t tile_rows);
/* cpu_tile.c: the CPU runs it (AVX-512), and the product itself. */
HIDDEN int tile_supported(void);
HIDDEN int tile_mm(const Weights *w, int four_bit, const float *x, int64_t M, int64_t K,
                   int64_t N, float *out, int64_t ldo);
HIDDEN void add_rms_norm(const float *x, const float *res, const float *w, float eps, int64_t T,
                         int64_t H, float *out, float *sum);
HIDDEN void rope(float *base, int64_t T, int64_t stride, int64_t h0, int64_t h1, int64_t D,
                 const int64_t *pos, const float *cos_t, const float *sin_t);
HIDDEN void decode_attention(const float *q, float *kc, float *vc, const int64_t *kv_index,
                             int64_t kv_stride, const int64_t *seq_lens, float scale, int64_t B,
                             int64_t Hq, int64_t Hk, int64_t D, float *out, const float *k_new,
                             const float *v_new, const int64_t *new_slots);

HIDDEN PyObject *py_stack_new(PyObject *self, PyObject *args);
HIDDEN PyObject *py_stack_set_layer(PyObject *self, PyObject *args);
HIDDEN PyObject *py_stack_forward(PyObject *self, PyObject *args);
#endif
