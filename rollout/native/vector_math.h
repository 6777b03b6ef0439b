/* Vector math shared by the engine's C kernels (included by each source: native_build keys a
   library by its source and the headers it includes). */

#ifndef ROLLOUT_NATIVE_VECTOR_MATH_H
#define ROLLOUT_NATIVE_VECTOR_MATH_H

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2 1

/* e^x for 8 floats: Cephes' expf polynomial (~1 ulp); exactly 0 below -87.3 (so at -inf),
   clamped above 88.4. */
static inline __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.33654f);
  __m256 underflow = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, lo), _mm256_set1_ps(88.3762626647949f));
  // e^x = 2^n e^r with n = round(x log2 e), r = x - n ln 2 (ln 2 split in two for precision)
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(underflow, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}
#else
#define HAVE_AVX2 0
#endif

/* bfloat16 <-> float32, as torch converts: a bfloat16 is the top 16 bits of a float32; rounding
   is to nearest, ties to even; a NaN becomes the quiet NaN 0x7FC0. */
#include <stdint.h>
#include <string.h>

static inline float bf16_load(uint16_t h) {
  const uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

static inline uint16_t bf16_round(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  if (f != f) return 0x7FC0;
  return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* f rounded to bfloat16 and back: the value a bfloat16 torch op stores. */
static inline float bf16_rounded(float f) { return bf16_load(bf16_round(f)); }

#if HAVE_AVX2
static inline __m256 bf16_load8(const uint16_t *p) {
  __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

/* 8 floats rounded to bfloat16 (ties to even; NaN -> the quiet NaN), kept as floats. */
static inline __m256 bf16_rounded8(__m256 v) {
  __m256i b = _mm256_castps_si256(v);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  b = _mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  b = _mm256_and_si256(b, _mm256_set1_epi32((int)0xFFFF0000u));
  __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_castsi256_ps(_mm256_blendv_epi8(b, _mm256_set1_epi32(0x7FC00000), nan));
}

static inline void bf16_store8(uint16_t *p, __m256 v) {
  __m256i b = _mm256_srli_epi32(_mm256_castps_si256(bf16_rounded8(v)), 16);
  // each lane holds a value <= 0xFFFF, so the unsigned saturating pack keeps it as it is
  __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
  _mm_storeu_si128((__m128i *)p, packed);
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define HAVE_AVX512 1

/* e^x for 16 floats of x within exp16's clamps (or below them, where `underflow` is set and the
   result is 0): exp8's Cephes polynomial in 512-bit registers. */
static inline __m512 exp16_in_range(__m512 x, __mmask16 underflow) {
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)),
                                23);
  return _mm512_maskz_mul_ps((__mmask16)~underflow, y, _mm512_castsi512_ps(e));
}

/* e^x for 16 floats. */
static inline __m512 exp16(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.33654f);
  const __mmask16 underflow = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_min_ps(_mm512_max_ps(x, lo), _mm512_set1_ps(88.3762626647949f));
  return exp16_in_range(x, underflow);
}

static inline __m512 bf16_load16(const uint16_t *p) {
  __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

/* 16 floats rounded to bfloat16 as bf16_rounded8 rounds them, kept as floats. */
static inline __m512 bf16_rounded16(__m512 v) {
  __m512i b = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  b = _mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  b = _mm512_and_si512(b, _mm512_set1_epi32((int)0xFFFF0000u));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_castsi512_ps(_mm512_mask_mov_epi32(b, nan, _mm512_set1_epi32(0x7FC00000)));
}

static inline void bf16_store16(uint16_t *p, __m512 v) {
  __m512i b = _mm512_srli_epi32(_mm512_castps_si512(bf16_rounded16(v)), 16);
  _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(b));
}
#else
#define HAVE_AVX512 0
#endif

#endif
