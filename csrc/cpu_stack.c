/* A decoder stack's decode step in one call (minisgl/models/cpu_stack.py).
 *
 * At batch 1 a small model's layer is ~10 kernel calls of tens of microseconds each, and the
 * Python and torch dispatch around them costs as much as the arithmetic. This file runs every
 * layer of a decode step (one query row per request) from C: the same kernels, in the same
 * order and with the same inputs as the layer-by-layer path (cpu_kernels.c), so its floats
 * are that path's except for SiLU, where expf may round differently from torch's.
 *
 * The plan (a capsule) holds each layer's pointers, taken once: norms' weights, the KV
 * caches, and each linear layer's segments of 4- or 8-bit rows (a GGUF file may mix types
 * in one layer). Python keeps the tensors behind them alive.
 */
#include "cpu_kernels.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define MAX_SEGS 8

typedef struct {
  Weights w;
  int four_bit;
  int64_t start, rows;
} Seg;

typedef struct {
  int n;
  int64_t N, K;
  Seg seg[MAX_SEGS];
} Linear;

typedef struct {
  const float *ln1, *ln2;
  float *kc, *vc;
  Linear qkv, o, gate_up, down;
} Layer;

typedef struct {
  int64_t L, H, Hq, Hk, D, I;
  float eps, scale;
  const float *cos_t, *sin_t;
  Layer *layers;
} Stack;

static void stack_free(PyObject *capsule) {
  Stack *s = PyCapsule_GetPointer(capsule, "minisgl.stack");
  if (s) free(s->layers), free(s);
}

/* stack_new(L, H, Hq, Hk, D, I, eps, scale, cos, sin) */
PyObject *py_stack_new(PyObject *self, PyObject *args) {
  Py_ssize_t L, H, Hq, Hk, D, I, cos_t, sin_t;
  float eps, scale;
  if (!PyArg_ParseTuple(args, "nnnnnnffnn", &L, &H, &Hq, &Hk, &D, &I, &eps, &scale, &cos_t,
                        &sin_t))
    return NULL;
  Stack *s = calloc(1, sizeof(Stack));
  Layer *layers = calloc((size_t)L, sizeof(Layer));
  if (!s || !layers) return free(s), free(layers), PyErr_NoMemory();
  *s = (Stack){L, H, Hq, Hk, D, I, eps, scale, (const float *)cos_t, (const float *)sin_t, layers};
  return PyCapsule_New(s, "minisgl.stack", stack_free);
}

/* A linear layer from (N, K, segments), each segment (codes, scale, offset, half, group,
 * start, rows) with group 0 for 4-bit rows. */
static int parse_linear(PyObject *spec, Linear *lin) {
  PyObject *segs;
  Py_ssize_t N, K;
  if (!PyArg_ParseTuple(spec, "nnO!", &N, &K, &PyTuple_Type, &segs)) return -1;
  const Py_ssize_t n = PyTuple_GET_SIZE(segs);
  if (n < 1 || n > MAX_SEGS) {
    PyErr_Format(PyExc_ValueError, "a linear layer of %zd segments (1 to %d)", n, MAX_SEGS);
    return -1;
  }
  lin->n = (int)n, lin->N = N, lin->K = K;
  for (Py_ssize_t i = 0; i < n; i++) {
    Py_ssize_t codes, scale, offset, half, group, start, rows;
    if (!PyArg_ParseTuple(PyTuple_GET_ITEM(segs, i), "nnnnnnn", &codes, &scale, &offset, &half,
                          &group, &start, &rows))
      return -1;
    lin->seg[i] = (Seg){{(const uint8_t *)codes, (const void *)scale,
                         group ? NULL : (const void *)offset, (int)half, group ? (int)group : 32},
                        group == 0, start, rows};
  }
  return 0;
}

/* stack_set_layer(stack, i, ln1, ln2, k_cache, v_cache, qkv, o, gate_up, down) */
PyObject *py_stack_set_layer(PyObject *self, PyObject *args) {
  PyObject *capsule, *qkv, *o, *gate_up, *down;
  Py_ssize_t i, ln1, ln2, kc, vc;
  if (!PyArg_ParseTuple(args, "OnnnnnOOOO", &capsule, &i, &ln1, &ln2, &kc, &vc, &qkv, &o,
                        &gate_up, &down))
    return NULL;
  Stack *s = PyCapsule_GetPointer(capsule, "minisgl.stack");
  if (!s) return NULL;
  if (i < 0 || i >= s->L) return PyErr_Format(PyExc_IndexError, "layer %zd of %ld", i, s->L);
  Layer *l = &s->layers[i];
  *l = (Layer){(const float *)ln1, (const float *)ln2, (float *)kc, (float *)vc};
  if (parse_linear(qkv, &l->qkv) || parse_linear(o, &l->o) || parse_linear(gate_up, &l->gate_up) ||
      parse_linear(down, &l->down))
    return NULL;
  Py_RETURN_NONE;
}

static int linear(const Linear *lin, const float *x, int64_t M, float *out, int64_t tile_rows) {
  for (int i = 0; i < lin->n; i++) {
    const Seg *sg = &lin->seg[i];
    if (quant_mm(&sg->w, sg->four_bit, x, M, lin->K, sg->rows, out + sg->start, lin->N,
                 tile_rows))
      return -1;
  }
  return 0;
}

/* Row b of gate_up [B, 2I] (gate, then up) -> silu(gate) * up, row b of out [B, I]. */
static void silu_mul_row(const float *gu, int64_t b, int64_t I, float *out) {
  for (int64_t i = 0; i < I; i++) {
    const float g = gu[b * 2 * I + i];
    out[b * I + i] = g / (1.f + expf(-g)) * gu[b * 2 * I + I + i];
  }
}

/* Every row; split among threads from 8 rows on (16 rows: 2.7 -> 1.6 ms of a 30-layer step on
 * 2 threads); fewer rows stay outside any parallel region (batch 1). */
static void silu_mul(const float *gu, int64_t B, int64_t I, float *out) {
  if (B < 8) {
    for (int64_t b = 0; b < B; b++) silu_mul_row(gu, b, I, out);
    return;
  }
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < B; b++) silu_mul_row(gu, b, I, out);
}

typedef struct {
  const int64_t *pos, *kv_index, *seq_lens, *slots;
  int64_t kv_stride, tile_rows;
} Rows;

typedef struct {
  float *h, *qkv, *q, *k, *v, *attn, *o, *gu, *act;
} Scratch;

/* One layer: x [B, H] (the previous layer's output) and res [B, H] (the residual stream,
 * updated in place; NULL before the first layer, when res_out takes x) -> out [B, H]. */
static int layer_forward(const Stack *s, const Layer *l, const float *x, const float *res,
                         float *res_out, int64_t B, const Rows *r, const Scratch *t, float *out) {
  const int64_t H = s->H, D = s->D, qd = s->Hq * D, kd = s->Hk * D, nqkv = qd + 2 * kd;
  add_rms_norm(x, res, l->ln1, s->eps, B, H, t->h, res_out);
  if (linear(&l->qkv, t->h, B, t->qkv, r->tile_rows)) return -1;
  rope(t->qkv, B, nqkv, 0, s->Hq + s->Hk, D, r->pos, s->cos_t, s->sin_t);
  for (int64_t b = 0; b < B; b++) {
    memcpy(t->q + b * qd, t->qkv + b * nqkv, sizeof(float) * (size_t)qd);
    memcpy(t->k + b * kd, t->qkv + b * nqkv + qd, sizeof(float) * (size_t)kd);
    memcpy(t->v + b * kd, t->qkv + b * nqkv + qd + kd, sizeof(float) * (size_t)kd);
  }
  decode_attention(t->q, l->kc, l->vc, r->kv_index, r->kv_stride, r->seq_lens, s->scale, B,
                   s->Hq, s->Hk, D, t->attn, t->k, t->v, r->slots);
  if (linear(&l->o, t->attn, B, t->o, r->tile_rows)) return -1;
  add_rms_norm(t->o, res_out, l->ln2, s->eps, B, H, t->h, res_out);
  if (linear(&l->gate_up, t->h, B, t->gu, r->tile_rows)) return -1;
  silu_mul(t->gu, B, s->I, t->act);
  return linear(&l->down, t->act, B, out, r->tile_rows);
}

static int stack_run(const Stack *s, const float *x, const float *res, int64_t B, const Rows *r,
                     float *x_out, float *res_out) {
  const int64_t H = s->H, qd = s->Hq * s->D, kd = s->Hk * s->D, I = s->I;
  const int64_t sizes[] = {H, qd + 2 * kd, qd, kd, kd, qd, H, 2 * I, I, H};
  int64_t total = 0;
  for (int i = 0; i < 10; i++) total += sizes[i] * B;
  float *buf = malloc(sizeof(float) * (size_t)total), *p = buf;
  if (!buf) return -1;
  float *parts[10];
  for (int i = 0; i < 10; i++) parts[i] = p, p += sizes[i] * B;
  const Scratch t = {parts[0], parts[1], parts[2], parts[3], parts[4],
                     parts[5], parts[6], parts[7], parts[8]};
  float *next = parts[9]; /* ping-pong with x_out: the last layer writes x_out */
  const float *cur = x;
  int rc = 0;
  for (int64_t i = 0; i < s->L && !rc; i++) {
    float *dst = ((s->L - 1 - i) % 2 == 0) ? x_out : next;
    rc = layer_forward(s, &s->layers[i], cur, i == 0 ? res : res_out, res_out, B, r, &t, dst);
    cur = dst;
  }
  free(buf);
  return rc;
}

/* stack_forward(stack, x, residual or 0, B, positions, kv_index, kv_stride, seq_lens, slots,
 * x_out, res_out, tile_rows): every layer for B decode rows; x_out and res_out [B, H] as the
 * last layer's (output, residual); products of tile_rows rows or more (0: none) on float32
 * tiles (cpu_tile.c). */
PyObject *py_stack_forward(PyObject *self, PyObject *args) {
  PyObject *capsule;
  Py_ssize_t x, res, B, pos, kv_index, kv_stride, seq_lens, slots, x_out, res_out, tile_rows;
  if (!PyArg_ParseTuple(args, "Onnnnnnnnnnn", &capsule, &x, &res, &B, &pos, &kv_index,
                        &kv_stride, &seq_lens, &slots, &x_out, &res_out, &tile_rows))
    return NULL;
  Stack *s = PyCapsule_GetPointer(capsule, "minisgl.stack");
  if (!s) return NULL;
  const Rows r = {(const int64_t *)pos, (const int64_t *)kv_index, (const int64_t *)seq_lens,
                  (const int64_t *)slots, kv_stride, tile_rows};
  int rc;
  Py_BEGIN_ALLOW_THREADS rc = stack_run(s, (const float *)x, (const float *)res, B, &r,
                                        (float *)x_out, (float *)res_out);
  Py_END_ALLOW_THREADS if (rc) return PyErr_NoMemory();
  Py_RETURN_NONE;
}
