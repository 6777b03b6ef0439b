/* The engine's element-wise steps on the CPU, float32, each one pass over its tokens instead of
   a chain of torch ops (each a pass over memory and a dispatch): RMSNorm (with the residual add
   before it), rotary embedding in place, SiLU(gate) * up, and row scatters into the KV pool.
   Each computes the function of its torch reference in rollout/model.py, rollout/rope.py and
   rollout/attention.py (tests compare them).

   Compiled with -std=c11, so no multiply-add is contracted into an FMA: the rotary and scatter
   kernels round exactly as torch's separate multiplies and adds do; RMSNorm's sum of squares and
   SiLU's exp round differently from torch's (a different summation order, another exp), within a
   few float32 ulps. Work is split over OpenMP threads (torch's libgomp) only for large batches,
   where the fork / join is worth it. */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vector_math.h"
#include "bf16_rows.h"  // rms_norm_bf16_row, silu_mul_bf16_row (shared with small_gemm.c)

#define PARALLEL_ELEMENTS 65536  // below this, one thread: the fork / join costs more
#define PREFETCH_TOKENS 8         // how far ahead scatter_kv_rows asks for its destination rows

int pointwise_has_avx2(void) { return HAVE_AVX2; }

/* Per token t of x [T, H] (token stride x_stride): if residual != NULL, x += residual first
   (x is written back); then out[t] = weight * (x * 1 / sqrt(mean(x^2) + eps)), as
   rollout.model.RMSNorm computes it (normalise, then scale). */
void rms_norm_f32(float *x, int64_t x_stride, const float *residual, int64_t residual_stride,
                  const float *weight, float eps, float *out, int64_t out_stride, int64_t T,
                  int64_t H, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (T * H >= PARALLEL_ELEMENTS) schedule(static)
  for (int64_t t = 0; t < T; t++) {
    float *xt = x + t * x_stride, *ot = out + t * out_stride;
    if (residual != NULL) {
      const float *rt = residual + t * residual_stride;
      for (int64_t i = 0; i < H; i++) xt[i] = xt[i] + rt[i];
    }
    float sum = 0.f;
    int64_t i = 0;
#if HAVE_AVX2
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= H; i += 8) {
      __m256 v = _mm256_loadu_ps(xt + i);
      acc = _mm256_add_ps(acc, _mm256_mul_ps(v, v));
    }
    float lane[8];
    _mm256_storeu_ps(lane, acc);
    for (int k = 0; k < 8; k++) sum += lane[k];
#endif
    for (; i < H; i++) sum += xt[i] * xt[i];
    const float inv = 1.f / sqrtf(sum / (float)H + eps);
    for (i = 0; i < H; i++) ot[i] = weight[i] * (xt[i] * inv);
  }
}

/* Rotary embedding in the "rotate half" layout, in place: for each token t and head h of x
   [T, heads, D] (token stride x_stride, head stride D), with c, s the rows of cos / sin [*, D]
   at positions[t]: x[:D/2], x[D/2:] <- x1 c1 - x2 s1, x2 c2 + x1 s2 (q * cos +
   rotate_half(q) * sin, term by term). Returns -1, writing nothing, if a position is outside
   the tables' table_rows rows. */
int rotary_f32(float *x, int64_t x_stride, int64_t T, int64_t heads, int64_t D,
               const float *cos_table, const float *sin_table, int64_t table_rows,
               const int64_t *positions, int num_threads) {
  const int64_t half = D / 2;
  for (int64_t t = 0; t < T; t++)
    if (positions[t] < 0 || positions[t] >= table_rows) return -1;  // nothing written
#pragma omp parallel for num_threads(num_threads) if (T * heads * D >= PARALLEL_ELEMENTS) schedule(static)
  for (int64_t t = 0; t < T; t++) {
    const float *c = cos_table + positions[t] * D, *s = sin_table + positions[t] * D;
    for (int64_t h = 0; h < heads; h++) {
      float *v = x + t * x_stride + h * D;
      for (int64_t i = 0; i < half; i++) {
        const float x1 = v[i], x2 = v[i + half];
        v[i] = x1 * c[i] - x2 * s[i];
        v[i + half] = x2 * c[i + half] + x1 * s[i + half];
      }
    }
  }
  return 0;
}


/* out[t, i] = silu(gate[t, i]) * up[t, i] = gate / (1 + e^-gate) * up, for gate and up [T, I]
   (token strides gate_stride, up_stride: the halves of one fused projection). */
void silu_mul_f32(const float *gate, int64_t gate_stride, const float *up, int64_t up_stride,
                  float *out, int64_t out_stride, int64_t T, int64_t I, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (T * I >= PARALLEL_ELEMENTS) schedule(static)
  for (int64_t t = 0; t < T; t++) {
    const float *g = gate + t * gate_stride, *u = up + t * up_stride;
    float *o = out + t * out_stride;
    int64_t i = 0;
#if HAVE_AVX512
    // exp16 is exp8's polynomial lane for lane: the same results as the 8-wide loop below
    const __m512 one16 = _mm512_set1_ps(1.f), zero16 = _mm512_setzero_ps();
    for (; i + 16 <= I; i += 16) {
      __m512 vg = _mm512_loadu_ps(g + i);
      __m512 silu = _mm512_div_ps(vg, _mm512_add_ps(one16, exp16(_mm512_sub_ps(zero16, vg))));
      _mm512_storeu_ps(o + i, _mm512_mul_ps(silu, _mm512_loadu_ps(u + i)));
    }
#endif
#if HAVE_AVX2
    const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
    for (; i + 8 <= I; i += 8) {
      __m256 vg = _mm256_loadu_ps(g + i);
      __m256 silu = _mm256_div_ps(vg, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, vg))));
      _mm256_storeu_ps(o + i, _mm256_mul_ps(silu, _mm256_loadu_ps(u + i)));
    }
#endif
    for (; i < I; i++) o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
  }
}

/* dst rows [Hkv, dst_rows, D]: for each token t and KV head h, dst[h, index[t]] = src[t, h], with src
   element (t, h, x) at t * src_stride + h * D + x and dst row (h, r) at h * dst_head_stride +
   r * D. Rows are copied exactly (the pool's and the lanes' K/V stores). Returns -1, writing
   nothing, if an index is out of range. */
int scatter_rows_f32(float *dst, int64_t dst_head_stride, int64_t dst_rows, const float *src,
                     int64_t src_stride, const int64_t *index, int64_t T, int64_t Hkv, int64_t D,
                     int num_threads) {
  for (int64_t t = 0; t < T; t++)
    if (index[t] < 0 || index[t] >= dst_rows) return -1;  // nothing written
#pragma omp parallel for num_threads(num_threads) if (T * Hkv * D >= PARALLEL_ELEMENTS / 4) schedule(static)
  for (int64_t t = 0; t < T; t++)
    for (int64_t h = 0; h < Hkv; h++)
      memcpy(dst + h * dst_head_stride + index[t] * D, src + t * src_stride + h * D,
             sizeof(float) * (size_t)D);
  return 0;
}

/* The bfloat16 kernels: the same steps on bfloat16 tensors, each rounding where the torch
   reference's bfloat16 ops round (an op computes in float32 and stores bfloat16), so the results
   are the reference's up to the float32 differences noted above. */

void rms_norm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *weight, float eps,
                   uint16_t *out, int64_t out_stride, int64_t T, int64_t H, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (T * H >= PARALLEL_ELEMENTS) schedule(static)
  for (int64_t t = 0; t < T; t++)
    rms_norm_bf16_row(x + t * x_stride, weight, eps, out + t * out_stride, H);
}

/* The residual add and the RMSNorm after it, one pass over each token's row: x[t] =
   bfloat16(x[t] + residual[t]) (the float32 sum rounded once, as torch's bfloat16 add rounds it;
   written back: the new residual stream), then out[t] = `rms_norm_bf16` of it. In bfloat16 the
   add cannot be folded into the projection's GEMM (the reference rounds the product before
   adding), so without this it is a pass of its own. */
void add_rms_norm_bf16(uint16_t *x, int64_t x_stride, const uint16_t *residual,
                       int64_t residual_stride, const uint16_t *weight, float eps, uint16_t *out,
                       int64_t out_stride, int64_t T, int64_t H, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (T * H >= PARALLEL_ELEMENTS) schedule(static)
  for (int64_t t = 0; t < T; t++) {
    uint16_t *xt = x + t * x_stride;
    const uint16_t *rt = residual + t * residual_stride;
    int64_t i = 0;
#if HAVE_AVX512
    for (; i + 16 <= H; i += 16)
      bf16_store16(xt + i, _mm512_add_ps(bf16_load16(xt + i), bf16_load16(rt + i)));
#endif
#if HAVE_AVX2
    for (; i + 8 <= H; i += 8)
      bf16_store8(xt + i, _mm256_add_ps(bf16_load8(xt + i), bf16_load8(rt + i)));
#endif
    for (; i < H; i++) xt[i] = bf16_round(bf16_load(xt[i]) + bf16_load(rt[i]));
    rms_norm_bf16_row(xt, weight, eps, out + t * out_stride, H);
  }
}

/* `rotary_f32` on bfloat16 x with float32 tables: the tables are rounded to bfloat16 (the
   reference converts them to the model dtype) and each product and sum is rounded as a bfloat16
   op rounds it (x * cos, rotate_half(x) * sin, their sum). */
int rotary_bf16(uint16_t *x, int64_t x_stride, int64_t T, int64_t heads, int64_t D,
                const float *cos_table, const float *sin_table, int64_t table_rows,
                const int64_t *positions, int num_threads) {
  const int64_t half = D / 2;
  for (int64_t t = 0; t < T; t++)
    if (positions[t] < 0 || positions[t] >= table_rows) return -1;  // nothing written
  // Each token's table entries are rounded once, for all its heads (heads the inner loop).
#pragma omp parallel for num_threads(num_threads) if (T * heads * D >= PARALLEL_ELEMENTS) schedule(static)
  for (int64_t t = 0; t < T; t++) {
    const float *c = cos_table + positions[t] * D, *s = sin_table + positions[t] * D;
    uint16_t *row = x + t * x_stride;
    int64_t i = 0;
#if HAVE_AVX512
    for (; i + 16 <= half; i += 16) {
      const __m512 c1 = bf16_rounded16(_mm512_loadu_ps(c + i));
      const __m512 s1 = bf16_rounded16(_mm512_loadu_ps(s + i));
      const __m512 c2 = bf16_rounded16(_mm512_loadu_ps(c + i + half));
      const __m512 s2 = bf16_rounded16(_mm512_loadu_ps(s + i + half));
      for (int64_t h = 0; h < heads; h++) {
        uint16_t *v = row + h * D;
        const __m512 x1 = bf16_load16(v + i), x2 = bf16_load16(v + i + half);
        bf16_store16(v + i, _mm512_sub_ps(bf16_rounded16(_mm512_mul_ps(x1, c1)),
                                          bf16_rounded16(_mm512_mul_ps(x2, s1))));
        bf16_store16(v + i + half, _mm512_add_ps(bf16_rounded16(_mm512_mul_ps(x2, c2)),
                                                 bf16_rounded16(_mm512_mul_ps(x1, s2))));
      }
    }
#endif
#if HAVE_AVX2
    for (; i + 8 <= half; i += 8) {
      const __m256 c1 = bf16_rounded8(_mm256_loadu_ps(c + i));
      const __m256 s1 = bf16_rounded8(_mm256_loadu_ps(s + i));
      const __m256 c2 = bf16_rounded8(_mm256_loadu_ps(c + i + half));
      const __m256 s2 = bf16_rounded8(_mm256_loadu_ps(s + i + half));
      for (int64_t h = 0; h < heads; h++) {
        uint16_t *v = row + h * D;
        const __m256 x1 = bf16_load8(v + i), x2 = bf16_load8(v + i + half);
        bf16_store8(v + i, _mm256_sub_ps(bf16_rounded8(_mm256_mul_ps(x1, c1)),
                                         bf16_rounded8(_mm256_mul_ps(x2, s1))));
        bf16_store8(v + i + half, _mm256_add_ps(bf16_rounded8(_mm256_mul_ps(x2, c2)),
                                                bf16_rounded8(_mm256_mul_ps(x1, s2))));
      }
    }
#endif
    for (; i < half; i++) {
      const float c1 = bf16_rounded(c[i]), s1 = bf16_rounded(s[i]);
      const float c2 = bf16_rounded(c[i + half]), s2 = bf16_rounded(s[i + half]);
      for (int64_t h = 0; h < heads; h++) {
        uint16_t *v = row + h * D;
        const float x1 = bf16_load(v[i]), x2 = bf16_load(v[i + half]);
        v[i] = bf16_round(bf16_rounded(x1 * c1) - bf16_rounded(x2 * s1));
        v[i + half] = bf16_round(bf16_rounded(x2 * c2) + bf16_rounded(x1 * s2));
      }
    }
  }
  return 0;
}

/* `silu_mul_f32` on bfloat16 gate and up, row by row (`silu_mul_bf16_row`: silu(gate) rounded
   to bfloat16, then its product with up rounded again). */
void silu_mul_bf16(const uint16_t *gate, int64_t gate_stride, const uint16_t *up,
                   int64_t up_stride, uint16_t *out, int64_t out_stride, int64_t T, int64_t I,
                   int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (T * I >= PARALLEL_ELEMENTS) schedule(static)
  for (int64_t t = 0; t < T; t++)
    silu_mul_bf16_row(gate + t * gate_stride, up + t * up_stride, out + t * out_stride, I);
}

/* `scatter_rows_f32` for 2-byte rows (bfloat16, float16): rows copied exactly. */
int scatter_rows_16(uint16_t *dst, int64_t dst_head_stride, int64_t dst_rows, const uint16_t *src,
                    int64_t src_stride, const int64_t *index, int64_t T, int64_t Hkv, int64_t D,
                    int num_threads) {
  for (int64_t t = 0; t < T; t++)
    if (index[t] < 0 || index[t] >= dst_rows) return -1;  // nothing written
#pragma omp parallel for num_threads(num_threads) if (T * Hkv * D >= PARALLEL_ELEMENTS / 2) schedule(static)
  for (int64_t t = 0; t < T; t++)
    for (int64_t h = 0; h < Hkv; h++)
      memcpy(dst + h * dst_head_stride + index[t] * D, src + t * src_stride + h * D,
             sizeof(uint16_t) * (size_t)D);
  return 0;
}

/* A layer's two K/V stores in one call: `scatter_rows_*` of k into dst_k and of v into dst_v, the
   same index and strides for both (k and v are views of one projection's output; the pool's, or
   the lanes', K and V tensors have one layout), rows of row_bytes bytes, strides in bytes.
   Returns -1, writing nothing, if an index is out of range. */
int scatter_kv_rows(char *dst_k, char *dst_v, int64_t dst_head_stride, int64_t dst_rows,
                    const char *src_k, const char *src_v, int64_t src_stride,
                    const int64_t *index, int64_t T, int64_t Hkv, int64_t row_bytes,
                    int num_threads) {
  for (int64_t t = 0; t < T; t++)
    if (index[t] < 0 || index[t] >= dst_rows) return -1;  // nothing written
  // the one-tensor scatters' threshold: PARALLEL_ELEMENTS bytes a tensor
#pragma omp parallel for num_threads(num_threads) if (T * Hkv * row_bytes >= PARALLEL_ELEMENTS) schedule(static)
  for (int64_t t = 0; t < T; t++) {
    // Each token's rows lie in pages of their own (a sequence's slots, its lane): a cache (and
    // often a TLB) miss apiece. Asking for the rows a few tokens ahead overlaps those misses.
    if (t + PREFETCH_TOKENS < T)
      for (int64_t h = 0; h < Hkv; h++) {
        const int64_t ahead = h * dst_head_stride + index[t + PREFETCH_TOKENS] * row_bytes;
        __builtin_prefetch(dst_k + ahead, 1, 3);
        __builtin_prefetch(dst_v + ahead, 1, 3);
      }
    for (int64_t h = 0; h < Hkv; h++) {
      const int64_t to = h * dst_head_stride + index[t] * row_bytes;
      const int64_t from = t * src_stride + h * row_bytes;
      memcpy(dst_k + to, src_k + from, (size_t)row_bytes);
      memcpy(dst_v + to, src_v + from, (size_t)row_bytes);
    }
  }
  return 0;
}
