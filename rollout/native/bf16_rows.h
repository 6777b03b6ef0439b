/* The bfloat16 element-wise row kernels that more than one source needs: RMSNorm of a row and
   SiLU(gate) * up of a row. pointwise.c runs them over a batch (rms_norm_bf16, add_rms_norm_bf16,
   silu_mul_bf16); small_gemm.c runs them on the rows of a linear layer's input before its
   multiply (small_gemm_prepared). One definition, so both compute the same bits. Include after
   vector_math.h. */

#ifndef ROLLOUT_NATIVE_BF16_ROWS_H
#define ROLLOUT_NATIVE_BF16_ROWS_H

#include <math.h>
#include <stdint.h>

#include "vector_math.h"

/* out[t] = weight * bfloat16(x * 1 / sqrt(mean(x^2) + eps)): RMSNorm normalises in float32 and
   rounds to the model dtype before the (bfloat16) weight multiplies. */
static inline void rms_norm_bf16_row(const uint16_t *xt, const uint16_t *weight, float eps,
                                     uint16_t *ot, int64_t H) {
  float sum = 0.f;
  int64_t i = 0;
#if HAVE_AVX2
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= H; i += 8) {
    __m256 v = bf16_load8(xt + i);
    acc = _mm256_add_ps(acc, _mm256_mul_ps(v, v));
  }
  float lane[8];
  _mm256_storeu_ps(lane, acc);
  for (int k = 0; k < 8; k++) sum += lane[k];
#endif
  for (; i < H; i++) sum += bf16_load(xt[i]) * bf16_load(xt[i]);
  const float inv = 1.f / sqrtf(sum / (float)H + eps);
  i = 0;
#if HAVE_AVX512
  const __m512 vinv16 = _mm512_set1_ps(inv);
  for (; i + 16 <= H; i += 16) {  // bf16_store8's rounding and packing, 16 lanes at a time
    const __m512 y = _mm512_mul_ps(bf16_load16(weight + i),
                                   bf16_rounded16(_mm512_mul_ps(bf16_load16(xt + i), vinv16)));
    const __m512i b = _mm512_srli_epi32(_mm512_castps_si512(bf16_rounded16(y)), 16);
    _mm256_storeu_si256((__m256i *)(ot + i), _mm512_cvtepi32_epi16(b));  // each <= 0xFFFF
  }
#endif
#if HAVE_AVX2
  const __m256 vinv = _mm256_set1_ps(inv);
  for (; i + 8 <= H; i += 8)
    bf16_store8(ot + i, _mm256_mul_ps(bf16_load8(weight + i),
                                      bf16_rounded8(_mm256_mul_ps(bf16_load8(xt + i), vinv))));
#endif
  for (; i < H; i++)
    ot[i] = bf16_round(bf16_load(weight[i]) * bf16_rounded(bf16_load(xt[i]) * inv));
}

/* o = bfloat16(bfloat16(silu(g)) * u) for one row of I elements: silu(gate) is rounded to
   bfloat16 (torch's bfloat16 silu computes in float32 and stores bfloat16), then its product with
   up is rounded again. */
static inline void silu_mul_bf16_row(const uint16_t *g, const uint16_t *u, uint16_t *o,
                                     int64_t I) {
  int64_t i = 0;
#if HAVE_AVX512
  const __m512 one16 = _mm512_set1_ps(1.f), zero16 = _mm512_setzero_ps();
  for (; i + 16 <= I; i += 16) {
    __m512 vg = bf16_load16(g + i);
    __m512 silu = _mm512_div_ps(vg, _mm512_add_ps(one16, exp16(_mm512_sub_ps(zero16, vg))));
    bf16_store16(o + i, _mm512_mul_ps(bf16_rounded16(silu), bf16_load16(u + i)));
  }
#endif
#if HAVE_AVX2
  const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
  for (; i + 8 <= I; i += 8) {
    __m256 vg = bf16_load8(g + i);
    __m256 silu = _mm256_div_ps(vg, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, vg))));
    bf16_store8(o + i, _mm256_mul_ps(bf16_rounded8(silu), bf16_load8(u + i)));
  }
#endif
  for (; i < I; i++) {
    const float x = bf16_load(g[i]);
    o[i] = bf16_round(bf16_rounded(x / (1.f + expf(-x))) * bf16_load(u[i]));
  }
}

#endif
