/* Cascade decode attention on the CPU, float32: the function of
   rollout.attention.cascade_decode_attention_matmul (its reference, and the test's).

   One work item is (sequence d, KV head h): the R query rows of d that read KV head h (query
   token x query head of the KV group) attend over [group prefix of d ++ own suffix of d] with one
   exact softmax. Scores of an item live in a per-thread buffer [R, Lp + Ls]; K and V are read in
   place (the suffix may be a strided view of the suffix lanes: any sequence and head strides,
   rows of Dh contiguous floats). Items are split over OpenMP threads; with torch imported first
   the process's one libgomp (torch's) runs them.

   Masking is additive, as in the reference: bias 0 = visible, -inf = not. A masked key's
   probability is exactly 0 and its V row is never read, so stale padding values never matter.
   Every row sees at least its own token, so its maximum score is finite.

   With AVX2 + FMA (x86-64, -march=native on a machine that has them) scores take 8 keys at a
   time and exp is a vector polynomial (Cephes' expf, ~1 ulp); elsewhere plain C loops compute
   the same function. Results differ from torch's in float32 rounding only. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "vector_math.h"

int cascade_decode_has_avx2(void) { return HAVE_AVX2; }

/* s[r * ld + j] = scale * <q_r, k_j> + bias[(r / rows_per_bias) * bias_stride + j] for the R
   rows of q [R, Dh] against L keys k [L, Dh]; a masked key's score is -inf. */
static inline __attribute__((always_inline)) void scores(
    const float *q, int64_t R, const int64_t Dh, const float *k, int64_t L, const float *bias,
    int64_t bias_stride, int64_t rows_per_bias, float scale, float *s, int64_t ld) {
  int64_t j = 0;
#if HAVE_AVX2
  const __m256 vscale = _mm256_set1_ps(scale), ninf = _mm256_set1_ps(-INFINITY);
  for (; Dh % 8 == 0 && j + 8 <= L; j += 8) {  // other head sizes: the plain loop below
    const float *kb = k + j * Dh;
    for (int64_t r = 0; r < R; r++) {
      __m256 vb = _mm256_loadu_ps(bias + (r / rows_per_bias) * bias_stride + j);
      if (_mm256_movemask_ps(_mm256_cmp_ps(vb, ninf, _CMP_EQ_OQ)) == 0xff) {
        _mm256_storeu_ps(s + r * ld + j, ninf);  // a whole masked block: no dots
        continue;
      }
      const float *qr = q + r * Dh;
      __m256 a[8];
      for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
      for (int64_t x = 0; x + 8 <= Dh; x += 8) {
        __m256 vq = _mm256_loadu_ps(qr + x);
        for (int i = 0; i < 8; i++)
          a[i] = _mm256_fmadd_ps(vq, _mm256_loadu_ps(kb + i * Dh + x), a[i]);
      }
      // horizontal sums of the 8 accumulators: lane i = <q_r, k_{j+i}>
      __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
      __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
      __m256 dot = _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20),
                                 _mm256_permute2f128_ps(t0, t1, 0x31));
      _mm256_storeu_ps(s + r * ld + j, _mm256_fmadd_ps(dot, vscale, vb));  // -inf stays -inf
    }
  }
#endif
  for (; j < L; j++) {
    const float *kj = k + j * Dh;
    for (int64_t r = 0; r < R; r++) {
      float b = bias[(r / rows_per_bias) * bias_stride + j];
      if (b == -INFINITY) {
        s[r * ld + j] = -INFINITY;
        continue;
      }
      float acc = 0.f;
      for (int64_t x = 0; x < Dh; x++) acc += q[r * Dh + x] * kj[x];
      s[r * ld + j] = acc * scale + b;
    }
  }
}


/* Row r of s (L scores) -> unnormalised probabilities e^(s - max) in place; returns their sum. */
static inline float exp_row(float *sr, int64_t L) {
  float m = -INFINITY, sum = 0.f;
  int64_t j = 0;
#if HAVE_AVX2
  float lane[8];
  __m256 vm = _mm256_set1_ps(-INFINITY);
  for (; j + 8 <= L; j += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(sr + j));
  _mm256_storeu_ps(lane, vm);
  for (int i = 0; i < 8; i++) m = lane[i] > m ? lane[i] : m;
#endif
  for (int64_t t = j; t < L; t++) m = sr[t] > m ? sr[t] : m;
  j = 0;
#if HAVE_AVX2
  __m256 vmax = _mm256_set1_ps(m), vsum = _mm256_setzero_ps();
  for (; j + 8 <= L; j += 8) {
    __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sr + j), vmax));
    _mm256_storeu_ps(sr + j, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  _mm256_storeu_ps(lane, vsum);
  for (int i = 0; i < 8; i++) sum += lane[i];
#endif
  for (int64_t t = j; t < L; t++) {
    float e = sr[t] == -INFINITY ? 0.f : expf(sr[t] - m);
    sr[t] = e;
    sum += e;
  }
  return sum;
}

#if HAVE_AVX2
/* acc0 += p0[t] V[t], acc1 += p1[t] V[t] over n rows of V [n, Dh]: two query rows share each V
   load, and their 2 x Dh / 8 independent accumulator chains hide the FMA latency. */
static inline __attribute__((always_inline)) void pv_pair(const int64_t Dh, const float *p0,
                                                          const float *p1, const float *V,
                                                          int64_t n, __m256 *acc0, __m256 *acc1) {
  for (int64_t t = 0; t < n; t++) {
    if (p0[t] == 0.f && p1[t] == 0.f) continue;  // masked for both: V[t] is never read
    const __m256 b0 = _mm256_set1_ps(p0[t]), b1 = _mm256_set1_ps(p1[t]);
    for (int64_t x = 0; x < Dh / 8; x++) {
      const __m256 v = _mm256_loadu_ps(V + t * Dh + x * 8);
      acc0[x] = _mm256_fmadd_ps(b0, v, acc0[x]);
      acc1[x] = _mm256_fmadd_ps(b1, v, acc1[x]);
    }
  }
}
#endif

/* One item: out [R, Dh] = softmax([prefix ++ suffix] scores) @ [prefix V ++ suffix V].
   s holds R * (Lp + Ls) scores, then R normalisers. */
static inline __attribute__((always_inline)) void item(
    const int64_t Dh, int64_t R, int64_t rows_per_bias, const float *q, const float *pk,
    const float *pv, int64_t Lp, const float *pbias, const float *sk, const float *sv, int64_t Ls,
    const float *sbias, float scale, float *out, float *s) {
  const int64_t L = Lp + Ls;
  float *inv = s + R * L;
  if (Lp > 0) scores(q, R, Dh, pk, Lp, pbias, 0, R, scale, s, L);
  scores(q, R, Dh, sk, Ls, sbias, Ls, rows_per_bias, scale, s + Lp, L);
  for (int64_t r = 0; r < R; r++) inv[r] = 1.f / exp_row(s + r * L, L);
  int64_t r = 0;
#if HAVE_AVX2
  if (Dh % 8 == 0 && Dh <= 128) {
    for (; r + 2 <= R; r += 2) {  // rows in pairs (a last odd row: the loop below)
      const float *s0 = s + r * L, *s1 = s0 + L;
      __m256 acc0[16], acc1[16];
      for (int64_t x = 0; x < Dh / 8; x++) acc0[x] = acc1[x] = _mm256_setzero_ps();
      pv_pair(Dh, s0, s1, pv, Lp, acc0, acc1);
      pv_pair(Dh, s0 + Lp, s1 + Lp, sv, Ls, acc0, acc1);
      const __m256 inv0 = _mm256_set1_ps(inv[r]), inv1 = _mm256_set1_ps(inv[r + 1]);
      for (int64_t x = 0; x < Dh / 8; x++) {
        _mm256_storeu_ps(out + r * Dh + x * 8, _mm256_mul_ps(acc0[x], inv0));
        _mm256_storeu_ps(out + (r + 1) * Dh + x * 8, _mm256_mul_ps(acc1[x], inv1));
      }
    }
  }
#endif
  for (; r < R; r++) {
    const float *sr = s + r * L;
    float *o = out + r * Dh;
    for (int64_t x = 0; x < Dh; x++) o[x] = 0.f;
    for (int64_t t = 0; t < L; t++) {
      if (sr[t] == 0.f) continue;
      const float *vt = t < Lp ? pv + t * Dh : sv + (t - Lp) * Dh;
      for (int64_t x = 0; x < Dh; x++) o[x] += sr[t] * vt[x];
    }
    for (int64_t x = 0; x < Dh; x++) o[x] *= inv[r];
  }
}

/* q [D, Hkv, R, Dh]: sequence d's Hkv * R rows of Dh contiguous floats at q + d * q_d (the
   decode tokens' q heads read in place from the fused projection's output); suffix K, V:
   element (h, d, t, x) at h * s_h + d * s_d + t * Dh + x; sbias [D, R / rows_per_bias, Ls];
   prefix K, V [Hkv, G, Lp, Dh] at h * p_h + g * p_g; pbias [G, Lp]; group_of [D], each in
   [0, G = num_groups); out [D, Hkv, R, Dh] contiguous. Returns 0; -1 if a buffer could not be
   allocated (out is then incomplete); -2, writing nothing, if a group index is out of range. */
int cascade_decode_f32(int64_t D, int64_t Hkv, int64_t R, int64_t Dh, int64_t rows_per_bias,
                       const float *q, int64_t q_d, const float *sk, const float *sv, int64_t s_h,
                       int64_t s_d, int64_t Ls, const float *sbias, const float *pk,
                       const float *pv, int64_t p_h, int64_t p_g, int64_t Lp, const float *pbias,
                       const int64_t *group_of, int64_t num_groups, float scale, float *out,
                       int num_threads) {
  const int64_t L = Lp + Ls, sbias_d = (R / rows_per_bias) * Ls;
  if (Lp > 0)
    for (int64_t d = 0; d < D; d++)
      if (group_of[d] < 0 || group_of[d] >= num_groups) return -2;  // nothing written
  int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
  {
    float *s = (float *)malloc(sizeof(float) * (size_t)(R * (L + 1)));
    failed = s == NULL;
#pragma omp for schedule(static)
    for (int64_t it = 0; it < D * Hkv; it++) {
      if (s == NULL) continue;
      const int64_t d = it / Hkv, h = it % Hkv, g = Lp > 0 ? group_of[d] : 0;
      const float *qi = q + d * q_d + h * R * Dh;
      const float *pki = pk + h * p_h + g * p_g, *pvi = pv + h * p_h + g * p_g;
      const float *ski = sk + h * s_h + d * s_d, *svi = sv + h * s_h + d * s_d;
      const float *pb = pbias + g * Lp, *sb = sbias + d * sbias_d;
      float *o = out + it * R * Dh;
      switch (Dh) {  // constant head sizes let the compiler unroll and keep acc in registers
        case 32: item(32, R, rows_per_bias, qi, pki, pvi, Lp, pb, ski, svi, Ls, sb, scale, o, s); break;
        case 64: item(64, R, rows_per_bias, qi, pki, pvi, Lp, pb, ski, svi, Ls, sb, scale, o, s); break;
        case 128: item(128, R, rows_per_bias, qi, pki, pvi, Lp, pb, ski, svi, Ls, sb, scale, o, s); break;
        default: item(Dh, R, rows_per_bias, qi, pki, pvi, Lp, pb, ski, svi, Ls, sb, scale, o, s);
      }
    }
    free(s);
  }
  return failed ? -1 : 0;
}
